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

use std::borrow::Cow;

use burn::backend::flex::FlexTensor;
use burn::backend::Flex;
use burn::tensor::ops::{ConvOptions, FloatTensor, FloatTensorOps, IntTensor};
use burn::tensor::{DType, Shape, TensorData, TensorMetadata};
use rayon::prelude::*;

use crate::{reference, BiasAxis, Epilogue, FusedBackend, LossWithGrad};

/// Elements per parallel task of an elementwise pass (fixed, so the partition
/// and any partial sums do not depend on the thread count).
const CHUNK: usize = 16 * 1024;

fn is_f32(tensor: &FlexTensor) -> bool {
    tensor.dtype() == DType::F32
}

/// The values of `tensor` in row-major order: a view when it is contiguous.
fn values(tensor: &FlexTensor) -> Cow<'_, [f32]> {
    match tensor.as_slice::<f32>() {
        Some(slice) => Cow::Borrowed(slice),
        None => Cow::Owned(tensor.to_contiguous().as_slice::<f32>().unwrap_or_default().to_vec()),
    }
}

/// `tensor` as a uniquely owned, contiguous buffer that may be written in
/// place (copied only when it is shared or strided).
fn owned(tensor: FlexTensor) -> FlexTensor {
    let n = tensor.layout().num_elements();
    let exact = tensor.layout().contiguous_offsets() == Some((0, n)) && tensor.bytes().len() == n * 4;
    if exact && tensor.is_unique() {
        tensor
    } else {
        FlexTensor::from_data(TensorData::new(values(&tensor).into_owned(), tensor.shape()))
    }
}

/// Runs `f` on the first `n` values of a tensor from [`owned`].
fn write(tensor: &mut FlexTensor, f: impl FnOnce(&mut [f32])) {
    let n = tensor.layout().num_elements();
    f(&mut tensor.storage_mut::<f32>()[..n]);
}

fn from_vec(values: Vec<f32>, shape: impl Into<Shape>) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape))
}

/// Rows of `row` elements per parallel task, for about [`CHUNK`] elements.
fn rows_per_task(row: usize) -> usize {
    (CHUNK / row.max(1)).max(1)
}

fn activate(x: f32, epilogue: Epilogue) -> f32 {
    match epilogue {
        Epilogue::Identity => x,
        Epilogue::Relu => x.max(0.0),
        Epilogue::Relu6 => x.clamp(0.0, 6.0),
        // Not reached: GELU takes the generic path.
        Epilogue::Gelu => x,
    }
}

/// `act(product + bias)` in place: one pass instead of a broadcast add and an
/// activation.
fn apply_epilogue(product: FlexTensor, bias: Option<(Vec<f32>, BiasAxis)>, epilogue: Epilogue) -> FlexTensor {
    let [_, m, n] = product.shape().dims::<3>();
    let mut out = owned(product);
    write(&mut out, |data| {
        data.par_chunks_mut(n.max(1)).with_min_len(rows_per_task(n)).enumerate().for_each(|(r, row)| {
            match &bias {
                None => row.iter_mut().for_each(|v| *v = activate(*v, epilogue)),
                Some((bias, BiasAxis::Rows)) => {
                    let b = bias[r % m];
                    row.iter_mut().for_each(|v| *v = activate(*v + b, epilogue));
                }
                Some((bias, BiasAxis::Cols)) => {
                    row.iter_mut().zip(bias).for_each(|(v, b)| *v = activate(*v + b, epilogue));
                }
            }
        });
    });
    out
}

/// A 2x2, stride-2 max-pool (no padding, odd edges dropped) of `[b, c, h, w]`:
/// the output and, per output element, the flat index of its maximum within
/// its `h x w` plane (the first maximum of the window on ties).
fn max_pool2x2(x: &FlexTensor, with_indices: bool) -> (FlexTensor, Option<FlexTensor>) {
    let [b, c, h, w] = x.shape().dims::<4>();
    let (oh, ow) = (h / 2, w / 2);
    let input = values(x);
    let mut output = vec![0f32; b * c * oh * ow];
    let mut indices = vec![0i32; if with_indices { output.len() } else { 0 }];
    let plane_out = (oh * ow).max(1);
    let pool_plane = |p: usize, out: &mut [f32], idx: &mut [i32]| {
        let plane = &input[p * h * w..(p + 1) * h * w];
        for oy in 0..oh {
            for ox in 0..ow {
                let base = 2 * oy * w + 2 * ox;
                let mut best = base;
                for offset in [1, w, w + 1] {
                    if plane[base + offset] > plane[best] {
                        best = base + offset;
                    }
                }
                out[oy * ow + ox] = plane[best];
                if let Some(slot) = idx.get_mut(oy * ow + ox) {
                    *slot = best as i32;
                }
            }
        }
    };
    let planes_per_task = rows_per_task(h * w);
    if with_indices {
        output
            .par_chunks_mut(plane_out)
            .zip(indices.par_chunks_mut(plane_out))
            .with_min_len(planes_per_task)
            .enumerate()
            .for_each(|(p, (out, idx))| pool_plane(p, out, idx));
    } else {
        output
            .par_chunks_mut(plane_out)
            .with_min_len(planes_per_task)
            .enumerate()
            .for_each(|(p, out)| pool_plane(p, out, &mut []));
    }
    let output = from_vec(output, [b, c, oh, ow]);
    let indices = with_indices.then(|| FlexTensor::from_data(TensorData::new(indices, [b, c, oh, ow])));
    (output, indices)
}

/// Whether [`im2col`] and [`col2im`] serve this convolution: `f32`, no
/// groups, no dilation.
fn native_conv(x: &FlexTensor, weight: &FlexTensor, options: &ConvOptions<2>) -> bool {
    is_f32(x) && is_f32(weight) && options.groups == 1 && options.dilation == [1, 1]
}

/// The geometry of a convolution over `h x w` planes with a `kh x kw` kernel.
#[derive(Debug, Clone, Copy)]
struct ConvGeometry {
    input: [usize; 2],
    kernel: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
    output: [usize; 2],
}

impl ConvGeometry {
    fn new(input: [usize; 2], kernel: [usize; 2], options: &ConvOptions<2>) -> Self {
        let out = |i: usize| (input[i] + 2 * options.padding[i]).saturating_sub(kernel[i]) / options.stride[i] + 1;
        Self { input, kernel, stride: options.stride, padding: options.padding, output: [out(0), out(1)] }
    }

    fn taps(&self) -> usize {
        self.kernel[0] * self.kernel[1]
    }

    fn output_pixels(&self) -> usize {
        self.output[0] * self.output[1]
    }

    /// Calls `f(tap, out_start, in_start, len)` for every run of output pixels
    /// of one output row that kernel tap `tap` (`ky * kw + kx`) reads from
    /// inside the input plane: output pixels `out_start..out_start + len`
    /// read input pixels `in_start + j * stride_x` (padding reads nothing).
    fn for_each_run(&self, mut f: impl FnMut(usize, usize, usize, usize)) {
        let ([h, w], [kh, kw], [sy, sx], [py, px], [oh, ow]) =
            (self.input, self.kernel, self.stride, self.padding, self.output);
        for ky in 0..kh {
            for kx in 0..kw {
                // Output columns whose input column `ox * sx + kx - px` is inside [0, w).
                let first = if px > kx { (px - kx).div_ceil(sx) } else { 0 };
                let end = if w + px > kx { ((w + px - kx - 1) / sx + 1).min(ow) } else { 0 };
                if first >= end {
                    continue;
                }
                for oy in 0..oh {
                    let Some(iy) = (oy * sy + ky).checked_sub(py).filter(|iy| *iy < h) else {
                        continue;
                    };
                    f(ky * kw + kx, oy * ow + first, iy * w + first * sx + kx - px, end - first);
                }
            }
        }
    }
}

/// Unfolds `x [b, c, h, w]` into the columns of a convolution,
/// `[b, c * kh * kw, oh * ow]` (row `c * kh * kw + ky * kw + kx`), zeros
/// where the kernel reads the padding.
fn im2col(x: &FlexTensor, geometry: ConvGeometry) -> FlexTensor {
    let [b, c, h, w] = x.shape().dims::<4>();
    let (taps, pixels, step) = (geometry.taps(), geometry.output_pixels(), geometry.stride[1]);
    let input = values(x);
    let mut cols = vec![0f32; b * c * taps * pixels];
    let rows_per_plane = (taps * pixels).max(1);
    cols.par_chunks_mut(rows_per_plane).with_min_len(rows_per_task(rows_per_plane)).enumerate().for_each(
        |(p, rows)| {
            let plane = &input[p * h * w..(p + 1) * h * w];
            geometry.for_each_run(|tap, out, input, len| {
                let row = &mut rows[tap * pixels + out..tap * pixels + out + len];
                if step == 1 {
                    row.copy_from_slice(&plane[input..input + len]);
                } else {
                    row.iter_mut().enumerate().for_each(|(j, v)| *v = plane[input + j * step]);
                }
            });
        },
    );
    from_vec(cols, [b, c * taps, pixels])
}

/// The adjoint of [`im2col`]: sums the columns `[b, c * kh * kw, oh * ow]`
/// back into `[b, c, h, w]`.
fn col2im(cols: &FlexTensor, shape: [usize; 4], geometry: ConvGeometry) -> FlexTensor {
    let [b, c, h, w] = shape;
    let (taps, pixels, step) = (geometry.taps(), geometry.output_pixels(), geometry.stride[1]);
    let cols = values(cols);
    let mut image = vec![0f32; b * c * h * w];
    image.par_chunks_mut((h * w).max(1)).with_min_len(rows_per_task(h * w)).enumerate().for_each(|(p, plane)| {
        let rows = &cols[p * taps * pixels..(p + 1) * taps * pixels];
        geometry.for_each_run(|tap, out, input, len| {
            let row = &rows[tap * pixels + out..tap * pixels + out + len];
            if step == 1 {
                plane[input..input + len].iter_mut().zip(row).for_each(|(v, g)| *v += g);
            } else {
                row.iter().enumerate().for_each(|(j, g)| plane[input + j * step] += g);
            }
        });
    });
    from_vec(image, shape)
}

impl FusedBackend for Flex {
    fn mse_loss(student: FloatTensor<Self>, teacher: FloatTensor<Self>, with_grad: bool) -> LossWithGrad<Self> {
        if !is_f32(&student) || !is_f32(&teacher) {
            return reference::mse_with_grad::<Self>(student, teacher, with_grad);
        }
        let shape = student.shape();
        let (s, t) = (values(&student), values(&teacher));
        let n = s.len();
        let scale = 2.0 / n as f32;
        let mut grad = if with_grad { vec![0f32; n] } else { Vec::new() };
        let partial_sums: Vec<f64> = if with_grad {
            grad.par_chunks_mut(CHUNK)
                .zip(s.par_chunks(CHUNK).zip(t.par_chunks(CHUNK)))
                .map(|(g, (s, t))| {
                    let mut sum = 0f64;
                    for ((g, s), t) in g.iter_mut().zip(s).zip(t) {
                        let d = s - t;
                        sum += (d * d) as f64;
                        *g = d * scale;
                    }
                    sum
                })
                .collect()
        } else {
            s.par_chunks(CHUNK)
                .zip(t.par_chunks(CHUNK))
                .map(|(s, t)| s.iter().zip(t).map(|(s, t)| ((s - t) * (s - t)) as f64).sum::<f64>())
                .collect()
        };
        let loss = (partial_sums.iter().sum::<f64>() / n.max(1) as f64) as f32;
        LossWithGrad { loss: from_vec(vec![loss], [1]), grad: with_grad.then(|| from_vec(grad, shape)) }
    }

    fn epilogue_backward(grad: FloatTensor<Self>, saved: FloatTensor<Self>, epilogue: Epilogue) -> FloatTensor<Self> {
        let (low, high) = match epilogue {
            Epilogue::Identity => return grad,
            Epilogue::Relu => (0.0, f32::INFINITY),
            Epilogue::Relu6 => (0.0, 6.0),
            Epilogue::Gelu => return reference::epilogue_backward::<Self>(grad, saved, epilogue),
        };
        if !is_f32(&grad) || !is_f32(&saved) {
            return reference::epilogue_backward::<Self>(grad, saved, epilogue);
        }
        let saved = values(&saved);
        let mut out = owned(grad);
        write(&mut out, |data| {
            data.par_chunks_mut(CHUNK).zip(saved.par_chunks(CHUNK)).for_each(|(g, s)| {
                for (g, s) in g.iter_mut().zip(s) {
                    // As the reference: zero where the output sat at a bound.
                    if *s <= low || *s >= high {
                        *g = 0.0;
                    }
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
                .map(|i| (0..z).map(|k| g[(k * m + i) * n..(k * m + i + 1) * n].iter().sum::<f32>()).sum())
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
        let generic = epilogue == Epilogue::Gelu
            || !is_f32(&lhs)
            || !is_f32(&rhs)
            || bias.as_ref().is_some_and(|(b, _)| !is_f32(b));
        if generic {
            return reference::matmul_epilogue::<Self>(lhs, rhs, bias, epilogue, sum_batch);
        }
        let [zl, _, _] = lhs.shape().dims::<3>();
        let [zr, _, _] = rhs.shape().dims::<3>();
        let mut product = Self::float_matmul(lhs, rhs);
        if sum_batch && zl.max(zr) > 1 {
            product = Self::float_sum_dim(product, 0);
        }
        if bias.is_none() && epilogue == Epilogue::Identity {
            return product;
        }
        let bias = bias.map(|(b, axis)| (values(&b).into_owned(), axis));
        apply_epilogue(product, bias, epilogue)
    }

    fn conv2d_epilogue(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        options: ConvOptions<2>,
        epilogue: Epilogue,
    ) -> FloatTensor<Self> {
        if !native_conv(&x, &weight, &options) || epilogue == Epilogue::Gelu {
            return reference::conv2d_epilogue::<Self>(x, weight, bias, options, epilogue);
        }
        let [b, _, h, w] = x.shape().dims::<4>();
        let [c_out, c_in, kh, kw] = weight.shape().dims::<4>();
        let geometry = ConvGeometry::new([h, w], [kh, kw], &options);
        let cols = im2col(&x, geometry);
        let weight = Self::float_reshape(weight, [1, c_out, c_in * kh * kw].into());
        let bias = bias.map(|b| (b, BiasAxis::Rows));
        let out = Self::matmul_epilogue(weight, cols, bias, epilogue, false);
        let [oh, ow] = geometry.output;
        Self::float_reshape(out, [b, c_out, oh, ow].into())
    }

    fn conv2d_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        options: ConvOptions<2>,
        x_grad: bool,
    ) -> (Option<FloatTensor<Self>>, FloatTensor<Self>) {
        if !native_conv(&x, &weight, &options) || !is_f32(&grad) {
            return reference::conv2d_backward::<Self>(x, weight, grad, options, x_grad);
        }
        let [b, c, h, w] = x.shape().dims::<4>();
        let [c_out, c_in, kh, kw] = weight.shape().dims::<4>();
        let geometry = ConvGeometry::new([h, w], [kh, kw], &options);
        let grad = Self::float_reshape(grad, [b, c_out, geometry.output_pixels()].into());
        let weight = Self::float_reshape(weight, [1, c_out, c_in * kh * kw].into());
        let x_grad = x_grad.then(|| {
            let cols_grad = Self::float_matmul(Self::float_swap_dims(weight, 1, 2), grad.clone());
            col2im(&cols_grad, [b, c, h, w], geometry)
        });
        let cols = im2col(&x, geometry);
        let per_sample = Self::float_matmul(grad, Self::float_swap_dims(cols, 1, 2));
        let weight_grad = Self::float_sum_dim(per_sample, 0);
        (x_grad, Self::float_reshape(weight_grad, [c_out, c_in, kh, kw].into()))
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
        let mut x_grad = vec![0f32; b * c * h * w];
        x_grad
            .par_chunks_mut((h * w).max(1))
            .with_min_len(rows_per_task(h * w))
            .enumerate()
            .for_each(|(p, plane)| {
                let range = p * plane_out..(p + 1) * plane_out;
                for (g, i) in grad[range.clone()].iter().zip(&indices[range]) {
                    plane[*i as usize] += g;
                }
            });
        from_vec(x_grad, [b, c, h, w])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owned_copies_a_shared_buffer_instead_of_writing_through_it() {
        let a = from_vec(vec![1.0, -2.0, 3.0], [1, 1, 3]);
        let shared = a.clone();
        let out = apply_epilogue(a, None, Epilogue::Relu);
        assert_eq!(values(&out).as_ref(), &[1.0, 0.0, 3.0]);
        assert_eq!(values(&shared).as_ref(), &[1.0, -2.0, 3.0]);
    }

    /// A direct (loop) convolution of one sample, for the im2col tests.
    fn direct_conv(x: &[f32], [c, h, w]: [usize; 3], weight: &[f32], c_out: usize, g: ConvGeometry) -> Vec<f32> {
        let ([kh, kw], [sy, sx], [py, px], [oh, ow]) = (g.kernel, g.stride, g.padding, g.output);
        let mut out = vec![0f32; c_out * oh * ow];
        for o in 0..c_out {
            for oy in 0..oh {
                for ox in 0..ow {
                    let mut sum = 0f32;
                    for ci in 0..c {
                        for ky in 0..kh {
                            for kx in 0..kw {
                                let (iy, ix) = ((oy * sy + ky) as isize - py as isize, (ox * sx + kx) as isize - px as isize);
                                if iy >= 0 && ix >= 0 && (iy as usize) < h && (ix as usize) < w {
                                    let xv = x[(ci * h + iy as usize) * w + ix as usize];
                                    sum += xv * weight[((o * c + ci) * kh + ky) * kw + kx];
                                }
                            }
                        }
                    }
                    out[(o * oh + oy) * ow + ox] = sum;
                }
            }
        }
        out
    }

    #[test]
    fn im2col_matches_a_direct_convolution_and_col2im_is_its_adjoint() {
        for (shape, kernel, stride, padding) in [
            ([2, 3, 7, 6], [3, 3], [1, 1], [1, 1]),
            ([1, 2, 8, 9], [3, 3], [2, 2], [1, 0]),
            ([1, 1, 5, 5], [5, 3], [1, 2], [2, 1]),
        ] {
            let [b, c, h, w] = shape;
            let n = b * c * h * w;
            let x: Vec<f32> = (0..n).map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0).collect();
            let options = ConvOptions::new(stride, padding, [1, 1], 1);
            let geometry = ConvGeometry::new([h, w], kernel, &options);
            let c_out = 2;
            let weight: Vec<f32> = (0..c_out * c * kernel[0] * kernel[1]).map(|i| (i % 5) as f32 - 2.0).collect();
            let out = Flex::conv2d_epilogue(
                from_vec(x.clone(), shape),
                from_vec(weight.clone(), [c_out, c, kernel[0], kernel[1]]),
                None,
                options,
                Epilogue::Identity,
            );
            let out = values(&out).into_owned();
            let per_sample = c_out * geometry.output_pixels();
            for s in 0..b {
                let direct = direct_conv(&x[s * c * h * w..(s + 1) * c * h * w], [c, h, w], &weight, c_out, geometry);
                let got = &out[s * per_sample..(s + 1) * per_sample];
                for (a, e) in got.iter().zip(&direct) {
                    assert!((a - e).abs() < 1e-4, "{shape:?} {kernel:?} {stride:?} {padding:?}: {a} vs {e}");
                }
            }
            // <im2col(x), y> == <x, col2im(y)> for any y.
            let cols = im2col(&from_vec(x.clone(), shape), geometry);
            let y: Vec<f32> = (0..cols.layout().num_elements()).map(|i| ((i * 11 % 13) as f32) - 6.0).collect();
            let back = col2im(&from_vec(y.clone(), cols.shape()), shape, geometry);
            let lhs: f64 = values(&cols).iter().zip(&y).map(|(a, b)| (*a as f64) * (*b as f64)).sum();
            let rhs: f64 = x.iter().zip(values(&back).iter()).map(|(a, b)| (*a as f64) * (*b as f64)).sum();
            assert!((lhs - rhs).abs() < 1e-6 * lhs.abs().max(1.0), "{lhs} vs {rhs}");
        }
    }

    #[test]
    fn max_pool_picks_the_first_maximum_and_drops_odd_edges() {
        // One 3x3 plane: the pool sees its top-left 2x2 window only.
        let x = from_vec(vec![5.0, 5.0, 9.0, 1.0, 2.0, 9.0, 9.0, 9.0, 9.0], [1, 1, 3, 3]);
        let (out, indices) = max_pool2x2(&x, true);
        assert_eq!(values(&out).as_ref(), &[5.0]);
        assert_eq!(indices.unwrap().as_slice::<i32>().unwrap(), &[0]);
        let grad = from_vec(vec![2.0], [1, 1, 1, 1]);
        let (_, indices) = max_pool2x2(&x, true);
        let x_grad = Flex::max_pool2x2_backward(x, grad, indices.unwrap());
        assert_eq!(values(&x_grad).as_ref(), &[2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
    }
}
