//! Native CPU paths of the fused ops on burn's flex backend.
//!
//! burn's generic fallbacks ([`crate::reference`]) run each fused op as several
//! flex ops, and some of those are slow at the students' shapes: flex walks a
//! `[z, m, n] + bias[1, m, 1]` broadcast with a scalar strided iterator on one
//! core, and its 2x2 max-pool is a general 3-D pool. Here every op is one pass
//! over contiguous `f32` buffers, parallel over rows or planes on the calling
//! thread's rayon pool (each pipeline worker installs its own), in a partition
//! that does not depend on the number of threads, so results are the same on
//! any pool. Matrix products stay flex's (the `gemm` crate).
//!
//! Anything that is not `f32`, and the GELU epilogue, takes the generic path.
//!
//! The paths live by subject, each module below depending only on those
//! after it: the backend's `impl` here; the batched matmul (`matmul.rs`),
//! the convolutions and the pool (`conv.rs`), the encoder's ops
//! (`encoder.rs`), the decoder's ops (`decoder.rs`) and the optimizer
//! update (`optim.rs`); the epilogues (`epilogue.rs`); and the shared
//! products and buffers (`gemm.rs`).

mod conv;
mod decoder;
mod encoder;
mod epilogue;
mod gemm;
mod matmul;
mod optim;

use burn::backend::flex::FlexTensor;
use burn::backend::Flex;
use burn::tensor::ops::{ConvOptions, FloatTensor, IntTensor};
use burn::tensor::{DType, TensorData, TensorMetadata};
use rayon::prelude::*;

use self::conv::{
    conv_backward, conv_forward, conv_pool_forward, depthwise, depthwise_backward, depthwise_forward,
    max_pool2x2, native_conv, ConvSizes, OutputGrad,
};
use self::decoder::CausalSizes;
use self::encoder::AttentionSizes;
use self::epilogue::{gelu_backward_in_place, gelu_in_place};
use self::gemm::{
    from_vec, is_f32, lane_sum, lane_sum_squared_difference, owned, rows_per_task, values, write, zeros,
    CHUNK,
};
use self::matmul::matmul_native;
use crate::llama::{self, CausalAttentionOutput, CausalHeads, RmsNormOutput};
use crate::optim::{ParamSlot, ParamUpdate, UpdateRule};
use crate::transformer::{self, AttentionOutput, LayerNormGrads, LayerNormOutput};
use crate::{reference, BiasAxis, Epilogue, FusedBackend, LossWithGrad};

/// The sizes of a causal attention call the native path takes: `f32`
/// inputs of consistent shapes, heads a multiple of the key/value heads,
/// an even head width. `None` sends it to the reference.
fn causal_sizes(
    q: &FlexTensor,
    k: &FlexTensor,
    v: &FlexTensor,
    mask: &FlexTensor,
    layout: CausalHeads,
) -> Option<CausalSizes> {
    let CausalHeads { heads, kv_heads, .. } = layout;
    if ![q, k, v, mask].iter().all(|t| is_f32(t)) || heads == 0 || kv_heads == 0 || heads % kv_heads != 0 {
        return None;
    }
    let [batch, tokens, width] = q.shape().dims::<3>();
    let head_dim = width / heads;
    let kv = [batch, tokens, kv_heads * head_dim];
    let fits = width % heads == 0
        && head_dim % 2 == 0
        && k.shape().dims::<3>() == kv
        && v.shape().dims::<3>() == kv
        && mask.shape().dims::<2>() == [batch, tokens];
    fits.then_some(CausalSizes { batch, tokens, heads, kv_heads, head_dim })
}

impl FusedBackend for Flex {
    const FUSED_CONV_POOL: bool = true;
    const FUSED_OPTIMIZER: bool = true;

    fn optimizer_step(slots: Vec<ParamSlot<Self>>, rule: &UpdateRule, lr: f64) -> Vec<ParamUpdate<Self>> {
        match rule {
            UpdateRule::Adam(adam) if optim::native_adam_applies(&slots) => {
                slots.into_iter().map(|slot| optim::adam_slot(slot, adam, lr)).collect()
            }
            _ => crate::optim::reference_step::<Self>(slots, rule, lr),
        }
    }

    fn activation(x: FloatTensor<Self>, epilogue: Epilogue) -> FloatTensor<Self> {
        if epilogue != Epilogue::Gelu || !is_f32(&x) {
            return reference::activation::<Self>(x, epilogue);
        }
        let mut out = owned(x);
        write(&mut out, gelu_in_place);
        out
    }

    fn masked_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        heads: usize,
        with_probs: bool,
    ) -> AttentionOutput<Self> {
        let [batch, tokens, width] = q.shape().dims::<3>();
        if ![&q, &k, &v, &mask].iter().all(|t| is_f32(t)) || heads == 0 || width % heads != 0 {
            return transformer::attention_reference::<Self>(q, k, v, mask, heads, with_probs);
        }
        let sizes = AttentionSizes { batch, tokens, heads, head_dim: width / heads };
        let inputs = [&*values(&q), &*values(&k), &*values(&v)];
        let (context, probs) = encoder::attention(inputs, &values(&mask), sizes, with_probs);
        AttentionOutput {
            context: from_vec(context, [batch, tokens, width]),
            probs: with_probs.then(|| from_vec(probs, [batch, heads, tokens, tokens])),
        }
    }

    fn masked_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        probs: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        heads: usize,
    ) -> [FloatTensor<Self>; 3] {
        let [batch, tokens, width] = q.shape().dims::<3>();
        if ![&q, &k, &v, &probs, &grad].iter().all(|t| is_f32(t)) {
            return transformer::attention_backward_reference::<Self>(q, k, v, probs, grad, heads);
        }
        let sizes = AttentionSizes { batch, tokens, heads, head_dim: width / heads };
        let inputs = [&*values(&q), &*values(&k), &*values(&v)];
        encoder::attention_backward(inputs, &values(&probs), &values(&grad), sizes)
            .map(|g| from_vec(g, [batch, tokens, width]))
    }

    fn add_layer_norm(
        x: FloatTensor<Self>,
        residual: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
        with_saved: bool,
    ) -> LayerNormOutput<Self> {
        let shape = x.shape();
        let [rows, hidden] = shape.dims::<2>();
        if ![&x, &residual, &gamma, &beta].iter().all(|t| is_f32(t)) {
            return transformer::add_layer_norm_reference::<Self>(
                x, residual, gamma, beta, epsilon, with_saved,
            );
        }
        let (inputs, scale) = ([&*values(&x), &*values(&residual)], [&*values(&gamma), &*values(&beta)]);
        let (output, saved) = encoder::add_layer_norm(inputs, scale, epsilon, with_saved);
        LayerNormOutput {
            output: from_vec(output, shape),
            saved: saved.map(|(sum, rstd)| (from_vec(sum, [rows, hidden]), from_vec(rstd, [rows]))),
        }
    }

    fn add_layer_norm_backward(
        sum: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> LayerNormGrads<Self> {
        let shape = sum.shape();
        if ![&sum, &rstd, &gamma, &grad].iter().all(|t| is_f32(t)) {
            return transformer::add_layer_norm_backward_reference::<Self>(sum, rstd, gamma, grad);
        }
        let hidden = shape.dims::<2>()[1];
        let [input, dgamma, dbeta] =
            encoder::add_layer_norm_backward(&values(&sum), &values(&rstd), &values(&gamma), &values(&grad));
        LayerNormGrads {
            input: from_vec(input, shape),
            gamma: from_vec(dgamma, [hidden]),
            beta: from_vec(dbeta, [hidden]),
        }
    }

    fn rms_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        epsilon: f64,
        with_rstd: bool,
    ) -> RmsNormOutput<Self> {
        if !is_f32(&x) || !is_f32(&gamma) {
            return llama::rms_norm_reference::<Self>(x, gamma, epsilon, with_rstd);
        }
        let shape = x.shape();
        let (output, rstd) = decoder::rms_norm(&values(&x), &values(&gamma), epsilon);
        let rows = rstd.len();
        RmsNormOutput { output: from_vec(output, shape), rstd: with_rstd.then(|| from_vec(rstd, [rows])) }
    }

    fn rms_norm_backward(
        x: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        epsilon: f64,
        grad: FloatTensor<Self>,
    ) -> [FloatTensor<Self>; 2] {
        if ![&x, &rstd, &gamma, &grad].iter().all(|t| is_f32(t)) {
            return llama::rms_norm_backward_reference::<Self>(x, gamma, epsilon, grad);
        }
        let (shape, hidden) = (x.shape(), gamma.shape().num_elements());
        let [dx, dgamma] =
            decoder::rms_norm_backward(&values(&x), &values(&rstd), &values(&gamma), &values(&grad));
        [from_vec(dx, shape), from_vec(dgamma, [hidden])]
    }

    fn swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        if !is_f32(&gate) || !is_f32(&up) || gate.shape() != up.shape() {
            return llama::swiglu_reference::<Self>(gate, up);
        }
        let shape = gate.shape();
        from_vec(decoder::swiglu(&values(&gate), &values(&up)), shape)
    }

    fn swiglu_backward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> [FloatTensor<Self>; 2] {
        if ![&gate, &up, &grad].iter().all(|t| is_f32(t)) {
            return llama::swiglu_backward_reference::<Self>(gate, up, grad);
        }
        let shape = gate.shape();
        decoder::swiglu_backward(&values(&gate), &values(&up), &values(&grad))
            .map(|g| from_vec(g, shape.clone()))
    }

    fn causal_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        layout: CausalHeads,
        with_probs: bool,
    ) -> CausalAttentionOutput<Self> {
        let Some(sizes) = causal_sizes(&q, &k, &v, &mask, layout) else {
            return llama::causal_attention_reference::<Self>(q, k, v, mask, layout, with_probs);
        };
        let inputs = [&*values(&q), &*values(&k), &*values(&v)];
        let (context, probs) =
            decoder::causal_attention(inputs, &values(&mask), sizes, layout.rope_base, with_probs);
        let CausalSizes { batch, tokens, heads, head_dim, .. } = sizes;
        CausalAttentionOutput {
            context: from_vec(context, [batch, tokens, heads * head_dim]),
            probs: with_probs.then(|| from_vec(probs, [batch, heads, tokens, tokens])),
        }
    }

    fn causal_attention_backward(
        qkv: [FloatTensor<Self>; 3],
        mask: FloatTensor<Self>,
        probs: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        layout: CausalHeads,
    ) -> [FloatTensor<Self>; 3] {
        let [q, k, v] = &qkv;
        let sizes = causal_sizes(q, k, v, &mask, layout).filter(|_| is_f32(&probs) && is_f32(&grad));
        let Some(sizes) = sizes else {
            return llama::causal_attention_backward_reference::<Self>(qkv, mask, probs, grad, layout);
        };
        let inputs = [&*values(q), &*values(k), &*values(v)];
        let [dq, dk, dv] = decoder::causal_attention_backward(
            inputs,
            &values(&probs),
            &values(&grad),
            sizes,
            layout.rope_base,
        );
        [from_vec(dq, q.shape()), from_vec(dk, k.shape()), from_vec(dv, v.shape())]
    }

    fn weighted_kl_loss(
        student: FloatTensor<Self>,
        teacher: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        temperature: f64,
        with_grad: bool,
    ) -> LossWithGrad<Self> {
        let rows = student.shape().dims::<2>()[0];
        let fits = student.shape() == teacher.shape() && weights.shape().num_elements() == rows;
        if !fits || ![&student, &teacher, &weights].iter().all(|t| is_f32(t)) {
            return llama::weighted_kl_reference::<Self>(student, teacher, weights, temperature, with_grad);
        }
        let shape = student.shape();
        let (loss, grad) = decoder::weighted_kl(
            &values(&student),
            &values(&teacher),
            &values(&weights),
            temperature,
            with_grad,
        );
        LossWithGrad { loss: from_vec(vec![loss], [1]), grad: with_grad.then(|| from_vec(grad, shape)) }
    }

    fn mse_loss(
        student: FloatTensor<Self>,
        teacher: FloatTensor<Self>,
        with_grad: bool,
    ) -> LossWithGrad<Self> {
        if !is_f32(&student) || !is_f32(&teacher) {
            return reference::mse_with_grad::<Self>(student, teacher, with_grad);
        }
        let shape = student.shape();
        let (s, t) = (values(&student), values(&teacher));
        let n = s.len();
        let scale = 2.0 / n as f32;
        let mut grad = if with_grad { zeros(n) } else { Vec::new() };
        let partial_sums: Vec<f64> = if with_grad {
            grad.par_chunks_mut(CHUNK)
                .zip(s.par_chunks(CHUNK).zip(t.par_chunks(CHUNK)))
                .map(|(g, (s, t))| {
                    g.iter_mut().zip(s.iter().zip(t)).for_each(|(g, (s, t))| *g = (s - t) * scale);
                    lane_sum_squared_difference(s, t) as f64
                })
                .collect()
        } else {
            s.par_chunks(CHUNK)
                .zip(t.par_chunks(CHUNK))
                .map(|(s, t)| lane_sum_squared_difference(s, t) as f64)
                .collect()
        };
        let loss = (partial_sums.iter().sum::<f64>() / n.max(1) as f64) as f32;
        LossWithGrad { loss: from_vec(vec![loss], [1]), grad: with_grad.then(|| from_vec(grad, shape)) }
    }

    fn epilogue_backward(
        grad: FloatTensor<Self>,
        saved: FloatTensor<Self>,
        epilogue: Epilogue,
    ) -> FloatTensor<Self> {
        let (low, high) = match epilogue {
            Epilogue::Identity => return grad,
            Epilogue::Relu => (0.0, f32::INFINITY),
            Epilogue::Relu6 => (0.0, 6.0),
            Epilogue::Gelu => (f32::NAN, f32::NAN),
        };
        if !is_f32(&grad) || !is_f32(&saved) {
            return reference::epilogue_backward::<Self>(grad, saved, epilogue);
        }
        if epilogue == Epilogue::Gelu {
            let mut out = owned(grad);
            write(&mut out, |data| gelu_backward_in_place(&values(&saved), data));
            return out;
        }
        let saved = values(&saved);
        let mut out = owned(grad);
        write(&mut out, |data| {
            data.par_chunks_mut(CHUNK).zip(saved.par_chunks(CHUNK)).for_each(|(g, s)| {
                for (g, s) in g.iter_mut().zip(s) {
                    // As the reference: zero where the output sat at a bound.
                    *g = if (*s > low) & (*s < high) { *g } else { 0.0 };
                }
            });
        });
        out
    }

    fn bias_grad(grad: FloatTensor<Self>, axis: BiasAxis) -> FloatTensor<Self> {
        if !is_f32(&grad) {
            return reference::bias_grad::<Self>(grad, axis);
        }
        let [z, m, n] = grad.shape().dims::<3>();
        let g = values(&grad);
        let sums = match axis {
            BiasAxis::Rows => (0..m)
                .into_par_iter()
                .map(|i| (0..z).map(|k| lane_sum(&g[(k * m + i) * n..(k * m + i + 1) * n])).sum())
                .collect(),
            BiasAxis::Cols => {
                let mut sums = vec![0f32; n];
                for row in g.chunks(n.max(1)) {
                    sums.iter_mut().zip(row).for_each(|(s, v)| *s += v);
                }
                sums
            }
        };
        let len = sums.len();
        from_vec(sums, [len])
    }

    fn matmul_epilogue(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        bias: Option<(FloatTensor<Self>, BiasAxis)>,
        epilogue: Epilogue,
        sum_batch: bool,
    ) -> FloatTensor<Self> {
        let generic = !is_f32(&lhs) || !is_f32(&rhs) || bias.as_ref().is_some_and(|(b, _)| !is_f32(b));
        if generic {
            return reference::matmul_epilogue::<Self>(lhs, rhs, bias, epilogue, sum_batch);
        }
        let bias_values = bias.as_ref().map(|(b, axis)| (values(b).into_owned(), *axis));
        let bias_view = bias_values.as_ref().map(|(b, axis)| (b.as_slice(), *axis));
        match matmul_native(&lhs, &rhs, bias_view, epilogue, sum_batch) {
            Some(out) => out,
            None => reference::matmul_epilogue::<Self>(lhs, rhs, bias, epilogue, sum_batch),
        }
    }

    fn conv2d_epilogue(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        options: ConvOptions<2>,
        epilogue: Epilogue,
    ) -> FloatTensor<Self> {
        let dense = native_conv(&x, &weight, &options);
        if !(dense || depthwise(&x, &weight, &options))
            || epilogue == Epilogue::Gelu
            || bias.as_ref().is_some_and(|b| !is_f32(b))
        {
            return reference::conv2d_epilogue::<Self>(x, weight, bias, options, epilogue);
        }
        let sizes = ConvSizes::new(&x, &weight, &options);
        let bias = bias.as_ref().map(values);
        let run = if dense { conv_forward } else { depthwise_forward };
        let out = run(&values(&x), &values(&weight), bias.as_deref(), sizes, epilogue);
        let [oh, ow] = sizes.geometry.output;
        from_vec(out, [sizes.batch, sizes.c_out, oh, ow])
    }

    fn conv2d_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        options: ConvOptions<2>,
        x_grad: bool,
    ) -> (Option<FloatTensor<Self>>, FloatTensor<Self>) {
        let dense = native_conv(&x, &weight, &options);
        if !(dense || depthwise(&x, &weight, &options)) || !is_f32(&grad) {
            return reference::conv2d_backward::<Self>(x, weight, grad, options, x_grad);
        }
        let sizes = ConvSizes::new(&x, &weight, &options);
        let grad = values(&grad);
        let (x_grad, weight_grad) = match dense {
            true => conv_backward(&values(&x), &values(&weight), OutputGrad::Dense(&grad), sizes, x_grad),
            false => depthwise_backward(&values(&x), &values(&weight), &grad, sizes, x_grad),
        };
        let x_shape = x.shape();
        (x_grad.map(|g| from_vec(g, x_shape)), from_vec(weight_grad, weight.shape()))
    }

    fn conv2d_pool(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        options: ConvOptions<2>,
        epilogue: Epilogue,
    ) -> (FloatTensor<Self>, IntTensor<Self>) {
        if !native_conv(&x, &weight, &options)
            || epilogue == Epilogue::Gelu
            || bias.as_ref().is_some_and(|b| !is_f32(b))
        {
            return Self::max_pool2x2_with_indices(reference::conv2d_epilogue::<Self>(
                x, weight, bias, options, epilogue,
            ));
        }
        let sizes = ConvSizes::new(&x, &weight, &options);
        let bias = bias.as_ref().map(values);
        let (output, indices) =
            conv_pool_forward(&values(&x), &values(&weight), bias.as_deref(), sizes, epilogue);
        let [oh, ow] = sizes.geometry.output;
        let shape = [sizes.batch, sizes.c_out, oh / 2, ow / 2];
        (from_vec(output, shape), FlexTensor::from_data(TensorData::new(indices, shape)))
    }

    fn conv2d_pool_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        indices: IntTensor<Self>,
        options: ConvOptions<2>,
        x_grad: bool,
    ) -> (Option<FloatTensor<Self>>, FloatTensor<Self>) {
        if !native_conv(&x, &weight, &options) || !is_f32(&grad) || indices.dtype() != DType::I32 {
            return crate::unpool_then_conv_backward::<Self>(x, weight, grad, indices, options, x_grad);
        }
        let sizes = ConvSizes::new(&x, &weight, &options);
        let (grad, indices) = (values(&grad), indices.to_contiguous());
        let grad = OutputGrad::Pooled { grad: &grad, indices: indices.as_slice::<i32>().unwrap_or_default() };
        let (x_grad, weight_grad) = conv_backward(&values(&x), &values(&weight), grad, sizes, x_grad);
        let x_shape = x.shape();
        (x_grad.map(|g| from_vec(g, x_shape)), from_vec(weight_grad, weight.shape()))
    }

    fn max_pool2x2(x: FloatTensor<Self>) -> FloatTensor<Self> {
        if !is_f32(&x) {
            return Self::max_pool2x2_with_indices(x).0;
        }
        max_pool2x2(&x, false).0
    }

    fn max_pool2x2_with_indices(x: FloatTensor<Self>) -> (FloatTensor<Self>, IntTensor<Self>) {
        if !is_f32(&x) {
            return reference::max_pool2x2_with_indices::<Self>(x);
        }
        let (output, indices) = max_pool2x2(&x, true);
        (output, indices.expect("indices were asked for"))
    }

    fn max_pool2x2_backward(
        x: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        indices: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        if !is_f32(&x) || indices.dtype() != DType::I32 {
            return reference::max_pool2x2_backward::<Self>(x, grad, indices);
        }
        let [b, c, h, w] = x.shape().dims::<4>();
        let plane_out = (h / 2) * (w / 2);
        let grad = values(&grad);
        let indices = indices.to_contiguous();
        let indices = indices.as_slice::<i32>().unwrap_or_default();
        let mut x_grad = zeros(b * c * h * w);
        x_grad.par_chunks_mut((h * w).max(1)).with_min_len(rows_per_task(h * w)).enumerate().for_each(
            |(p, plane)| {
                let range = p * plane_out..(p + 1) * plane_out;
                for (g, i) in grad[range.clone()].iter().zip(&indices[range]) {
                    plane[*i as usize] += g;
                }
            },
        );
        from_vec(x_grad, [b, c, h, w])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owned_copies_a_shared_buffer_instead_of_writing_through_it() {
        let grad = from_vec(vec![1.0, -2.0, 3.0], [1, 1, 3]);
        let shared = grad.clone();
        let saved = from_vec(vec![0.5, 1.0, 0.0], [1, 1, 3]);
        let out = Flex::epilogue_backward(grad, saved, Epilogue::Relu);
        assert_eq!(values(&out).as_ref(), &[1.0, -2.0, 0.0]);
        assert_eq!(values(&shared).as_ref(), &[1.0, -2.0, 3.0]);
    }
}
