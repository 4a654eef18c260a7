//! The native convolution and pooling paths on flex: dense convolutions as
//! an im2col per sample and one product straight into the output (and the
//! transposed products for the gradients), depthwise convolutions as one
//! multiply-add pass per kernel tap, the convolution fused with the 2x2
//! max-pool, and the pool on its own.

use burn::backend::flex::FlexTensor;
use burn::tensor::ops::ConvOptions;
use burn::tensor::{TensorData, TensorMetadata};
use rayon::prelude::*;

use super::epilogue::{activate, epilogue_in_place};
use super::gemm::{
    add_in_order, from_vec, gemm_into, is_f32, lane_dot, rows_per_task, values, zeros, Matrix, BATCH_PER_TASK,
};
use crate::{BiasAxis, Epilogue};

/// The 2x2, stride-2 max-pool of one `h x w` plane into `out` (`h/2 x w/2`)
/// and, unless `idx` is empty, the flat index of each maximum in the plane
/// (the first maximum in window order on ties).
fn pool_plane(plane: &[f32], [h, w]: [usize; 2], out: &mut [f32], idx: &mut [i32]) {
    let (oh, ow) = (h / 2, w / 2);
    for oy in 0..oh {
        let top = &plane[2 * oy * w..2 * oy * w + 2 * ow];
        let bottom = &plane[(2 * oy + 1) * w..(2 * oy + 1) * w + 2 * ow];
        let windows =
            out[oy * ow..(oy + 1) * ow].iter_mut().zip(top.chunks_exact(2).zip(bottom.chunks_exact(2)));
        if idx.is_empty() {
            for (o, (t, b)) in windows {
                *o = t[0].max(t[1]).max(b[0].max(b[1]));
            }
            continue;
        }
        for ((o, (t, b)), (ox, slot)) in windows.zip(idx[oy * ow..(oy + 1) * ow].iter_mut().enumerate()) {
            let (mut best, mut at) = (t[0], 0);
            for (value, offset) in [(t[1], 1), (b[0], w), (b[1], w + 1)] {
                if value > best {
                    (best, at) = (value, offset);
                }
            }
            *o = best;
            *slot = (2 * oy * w + 2 * ox + at) as i32;
        }
    }
}

/// A 2x2, stride-2 max-pool (no padding, odd edges dropped) of `[b, c, h, w]`:
/// the output and, per output element, the flat index of its maximum within
/// its `h x w` plane (the first maximum of the window on ties).
pub(super) fn max_pool2x2(x: &FlexTensor, with_indices: bool) -> (FlexTensor, Option<FlexTensor>) {
    let [b, c, h, w] = x.shape().dims::<4>();
    let (oh, ow) = (h / 2, w / 2);
    let input = values(x);
    let mut output = zeros(b * c * oh * ow);
    let mut indices = vec![0i32; if with_indices { output.len() } else { 0 }];
    let plane_out = (oh * ow).max(1);
    let pool_plane = |p: usize, out: &mut [f32], idx: &mut [i32]| {
        pool_plane(&input[p * h * w..(p + 1) * h * w], [h, w], out, idx);
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

/// Whether the im2col path serves this convolution: `f32`, no groups, no
/// dilation.
pub(super) fn native_conv(x: &FlexTensor, weight: &FlexTensor, options: &ConvOptions<2>) -> bool {
    is_f32(x) && is_f32(weight) && options.groups == 1 && options.dilation == [1, 1]
}

/// The geometry of a convolution over `h x w` planes with a `kh x kw` kernel.
#[derive(Debug, Clone, Copy)]
pub(super) struct ConvGeometry {
    pub(super) input: [usize; 2],
    pub(super) kernel: [usize; 2],
    pub(super) stride: [usize; 2],
    pub(super) padding: [usize; 2],
    pub(super) output: [usize; 2],
}

impl ConvGeometry {
    fn new(input: [usize; 2], kernel: [usize; 2], options: &ConvOptions<2>) -> Self {
        let out =
            |i: usize| (input[i] + 2 * options.padding[i]).saturating_sub(kernel[i]) / options.stride[i] + 1;
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

/// Unfolds one sample `x [c, h, w]` into the columns of a convolution,
/// `cols [c * kh * kw, oh * ow]` (row `c * kh * kw + ky * kw + kx`). Only the
/// elements the kernel reads inside the image are written: the padding's
/// zeros are the same for every sample, so a scratch buffer zeroed once is
/// reused across samples.
fn im2col_sample(x: &[f32], geometry: ConvGeometry, cols: &mut [f32]) {
    let [h, w] = geometry.input;
    let (taps, pixels, step) = (geometry.taps(), geometry.output_pixels(), geometry.stride[1]);
    for (plane, rows) in x.chunks(h * w).zip(cols.chunks_mut(taps * pixels)) {
        geometry.for_each_run(|tap, out, input, len| {
            let row = &mut rows[tap * pixels + out..tap * pixels + out + len];
            if step == 1 {
                row.copy_from_slice(&plane[input..input + len]);
            } else {
                row.iter_mut().enumerate().for_each(|(j, v)| *v = plane[input + j * step]);
            }
        });
    }
}

/// The adjoint of [`im2col_sample`]: adds the columns back into `x [c, h, w]`.
fn col2im_sample(cols: &[f32], geometry: ConvGeometry, x: &mut [f32]) {
    let [h, w] = geometry.input;
    let (taps, pixels, step) = (geometry.taps(), geometry.output_pixels(), geometry.stride[1]);
    for (plane, rows) in x.chunks_mut(h * w).zip(cols.chunks(taps * pixels)) {
        geometry.for_each_run(|tap, out, input, len| {
            let row = &rows[tap * pixels + out..tap * pixels + out + len];
            if step == 1 {
                plane[input..input + len].iter_mut().zip(row).for_each(|(v, g)| *v += g);
            } else {
                row.iter().enumerate().for_each(|(j, g)| plane[input + j * step] += g);
            }
        });
    }
}

/// The sizes of a convolution: input `[batch, channels, h, w]` and
/// `c_out` filters.
#[derive(Debug, Clone, Copy)]
pub(super) struct ConvSizes {
    pub(super) batch: usize,
    pub(super) channels: usize,
    pub(super) c_out: usize,
    pub(super) geometry: ConvGeometry,
}

impl ConvSizes {
    pub(super) fn new(x: &FlexTensor, weight: &FlexTensor, options: &ConvOptions<2>) -> Self {
        let [batch, channels, h, w] = x.shape().dims::<4>();
        let [c_out, _, kh, kw] = weight.shape().dims::<4>();
        Self { batch, channels, c_out, geometry: ConvGeometry::new([h, w], [kh, kw], options) }
    }

    /// Values of one input sample.
    fn plane(&self) -> usize {
        self.channels * self.geometry.input[0] * self.geometry.input[1]
    }

    /// Rows of the column matrix (the reduction length).
    fn depth(&self) -> usize {
        self.channels * self.geometry.taps()
    }

    /// A 1x1, stride-1, unpadded convolution: the sample is its own column matrix.
    fn pointwise(&self) -> bool {
        let g = &self.geometry;
        g.kernel == [1, 1] && g.stride == [1, 1] && g.padding == [0, 0]
    }

    /// The column matrix of sample `x`: the sample itself for a pointwise
    /// convolution, else unfolded into `scratch`.
    fn columns<'a>(&self, x: &'a [f32], scratch: &'a mut [f32]) -> Matrix<'a> {
        let (depth, pixels) = (self.depth(), self.geometry.output_pixels());
        if self.pointwise() {
            Matrix::dense(x, depth, pixels)
        } else {
            im2col_sample(x, self.geometry, scratch);
            Matrix::dense(scratch, depth, pixels)
        }
    }

    fn scratch(&self) -> Vec<f32> {
        vec![0f32; if self.pointwise() { 0 } else { self.depth() * self.geometry.output_pixels() }]
    }
}

/// `act(conv(x) + bias)`, per sample in parallel: unfold into a scratch
/// buffer that stays in cache, one product straight into the output, the
/// epilogue on it while it is hot.
pub(super) fn conv_forward(
    x: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    sizes: ConvSizes,
    epilogue: Epilogue,
) -> Vec<f32> {
    let pixels = sizes.geometry.output_pixels();
    let weight = Matrix::dense(weight, sizes.c_out, sizes.depth());
    let mut out = zeros(sizes.batch * sizes.c_out * pixels);
    out.par_chunks_mut((sizes.c_out * pixels).max(1)).enumerate().for_each_init(
        || sizes.scratch(),
        |scratch, (s, out)| {
            let cols = sizes.columns(&x[s * sizes.plane()..(s + 1) * sizes.plane()], scratch);
            gemm_into(out, weight, cols, false, gemm::Parallelism::None);
            let bias = bias.map(|b| (b, BiasAxis::Rows));
            epilogue_in_place(out, [sizes.c_out, pixels], bias, epilogue, false);
        },
    );
    out
}

/// The input gradient (when `x_grad`) and the weight gradient of a
/// convolution from the gradient of its output: per fixed group of samples,
/// the weight gradient accumulated in one buffer (`grad_s @ cols_s^T`) and
/// the input gradient as `col2im(weight^T @ grad_s)`; the groups' weight
/// gradients added in order.
pub(super) fn conv_backward(
    x: &[f32],
    weight: &[f32],
    grad: OutputGrad,
    sizes: ConvSizes,
    x_grad: bool,
) -> (Option<Vec<f32>>, Vec<f32>) {
    let (depth, pixels, plane) = (sizes.depth(), sizes.geometry.output_pixels(), sizes.plane());
    let weight_t = Matrix::dense(weight, sizes.c_out, depth).transposed();
    let group = |task: usize, x_grad_group: &mut [f32]| -> Vec<f32> {
        let mut weight_grad = vec![0f32; sizes.c_out * depth];
        let (mut scratch, mut cols_grad) = (sizes.scratch(), sizes.scratch());
        let mut unpooled =
            vec![0f32; if matches!(grad, OutputGrad::Pooled { .. }) { sizes.c_out * pixels } else { 0 }];
        let first = task * BATCH_PER_TASK;
        for s in first..(first + BATCH_PER_TASK).min(sizes.batch) {
            let grad_s = match grad {
                OutputGrad::Dense(grad) => Matrix::dense(
                    &grad[s * sizes.c_out * pixels..(s + 1) * sizes.c_out * pixels],
                    sizes.c_out,
                    pixels,
                ),
                OutputGrad::Pooled { grad, indices } => {
                    let pooled = grad.len() / (sizes.batch * sizes.c_out).max(1);
                    unpooled.fill(0.0);
                    let range = s * sizes.c_out * pooled..(s + 1) * sizes.c_out * pooled;
                    let per_channel =
                        grad[range.clone()].chunks(pooled.max(1)).zip(indices[range].chunks(pooled.max(1)));
                    for ((g, i), plane) in per_channel.zip(unpooled.chunks_mut(pixels)) {
                        g.iter().zip(i).for_each(|(g, i)| plane[*i as usize] += g);
                    }
                    Matrix::dense(&unpooled, sizes.c_out, pixels)
                }
            };
            let cols = sizes.columns(&x[s * plane..(s + 1) * plane], &mut scratch);
            gemm_into(&mut weight_grad, grad_s, cols.transposed(), true, gemm::Parallelism::None);
            if let Some(x_grad_s) = x_grad_group.get_mut((s - first) * plane..(s - first + 1) * plane) {
                if sizes.pointwise() {
                    gemm_into(x_grad_s, weight_t, grad_s, false, gemm::Parallelism::None);
                } else {
                    gemm_into(&mut cols_grad, weight_t, grad_s, false, gemm::Parallelism::None);
                    col2im_sample(&cols_grad, sizes.geometry, x_grad_s);
                }
            }
        }
        weight_grad
    };
    per_sample_groups(sizes.batch, plane, sizes.c_out * depth, x_grad, group)
}

/// Runs `group(task, x_grad_of_its_samples)` over fixed groups of
/// [`BATCH_PER_TASK`] samples in parallel (the input gradient, when asked
/// for, split among them; `plane` values per sample) and adds the groups'
/// weight gradients (`len` values each) in order.
fn per_sample_groups(
    batch: usize,
    plane: usize,
    len: usize,
    x_grad: bool,
    group: impl Fn(usize, &mut [f32]) -> Vec<f32> + Sync,
) -> (Option<Vec<f32>>, Vec<f32>) {
    let mut input_grad = zeros(if x_grad { batch * plane } else { 0 });
    let partials: Vec<Vec<f32>> = if x_grad {
        input_grad
            .par_chunks_mut((BATCH_PER_TASK * plane).max(1))
            .enumerate()
            .map(|(task, chunk)| group(task, chunk))
            .collect()
    } else {
        (0..batch.div_ceil(BATCH_PER_TASK)).into_par_iter().map(|task| group(task, &mut [])).collect()
    };
    (x_grad.then_some(input_grad), add_in_order(partials, len))
}

/// Whether a convolution is depthwise: one group per input channel, each
/// filter reading one channel (`c_out` a multiple of `c_in`).
pub(super) fn depthwise(x: &FlexTensor, weight: &FlexTensor, options: &ConvOptions<2>) -> bool {
    let [_, c_in, _, _] = x.shape().dims::<4>();
    let [c_out, per_group, _, _] = weight.shape().dims::<4>();
    is_f32(x)
        && is_f32(weight)
        && options.dilation == [1, 1]
        && c_in > 1
        && options.groups == c_in
        && per_group == 1
        && c_out.is_multiple_of(c_in)
}

/// The input channel filter `o` of a depthwise convolution reads.
fn depthwise_channel(sizes: &ConvSizes, o: usize) -> usize {
    o / (sizes.c_out / sizes.channels).max(1)
}

/// `act(depthwise_conv(x) + bias)`: per output plane, one multiply-add pass
/// per kernel tap over the input rows it reads.
pub(super) fn depthwise_forward(
    x: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    sizes: ConvSizes,
    epilogue: Epilogue,
) -> Vec<f32> {
    let ([h, w], taps, pixels, step) = (
        sizes.geometry.input,
        sizes.geometry.taps(),
        sizes.geometry.output_pixels(),
        sizes.geometry.stride[1],
    );
    let mut out = zeros(sizes.batch * sizes.c_out * pixels);
    out.par_chunks_mut(pixels.max(1)).with_min_len(rows_per_task(pixels)).enumerate().for_each(|(p, out)| {
        let (s, o) = (p / sizes.c_out, p % sizes.c_out);
        let source = &x[(s * sizes.channels + depthwise_channel(&sizes, o)) * h * w..][..h * w];
        let filter = &weight[o * taps..(o + 1) * taps];
        out.fill(bias.map_or(0.0, |b| b[o]));
        sizes.geometry.for_each_run(|tap, start, input, len| {
            let (weight, run) = (filter[tap], &mut out[start..start + len]);
            if step == 1 {
                run.iter_mut().zip(&source[input..input + len]).for_each(|(v, x)| *v += weight * x);
            } else {
                run.iter_mut().enumerate().for_each(|(j, v)| *v += weight * source[input + j * step]);
            }
        });
        out.iter_mut().for_each(|v| *v = activate(*v, epilogue));
    });
    out
}

/// The input gradient (when `x_grad`) and the weight gradient of a
/// depthwise convolution, per fixed group of samples.
pub(super) fn depthwise_backward(
    x: &[f32],
    weight: &[f32],
    grad: &[f32],
    sizes: ConvSizes,
    x_grad: bool,
) -> (Option<Vec<f32>>, Vec<f32>) {
    let ([h, w], taps, pixels, step) = (
        sizes.geometry.input,
        sizes.geometry.taps(),
        sizes.geometry.output_pixels(),
        sizes.geometry.stride[1],
    );
    let plane = sizes.plane();
    let group = |task: usize, x_grad_group: &mut [f32]| -> Vec<f32> {
        let mut weight_grad = vec![0f32; sizes.c_out * taps];
        let first = task * BATCH_PER_TASK;
        for s in first..(first + BATCH_PER_TASK).min(sizes.batch) {
            for o in 0..sizes.c_out {
                let c = depthwise_channel(&sizes, o);
                let source = &x[(s * sizes.channels + c) * h * w..][..h * w];
                let g = &grad[(s * sizes.c_out + o) * pixels..][..pixels];
                let filter = &weight[o * taps..(o + 1) * taps];
                let filter_grad = &mut weight_grad[o * taps..(o + 1) * taps];
                let mut source_grad = x_grad_group
                    .get_mut((s - first) * plane + c * h * w..(s - first) * plane + (c + 1) * h * w);
                sizes.geometry.for_each_run(|tap, start, input, len| {
                    let run = &g[start..start + len];
                    if step == 1 {
                        filter_grad[tap] += lane_dot(run, &source[input..input + len]);
                        if let Some(dx) = source_grad.as_deref_mut() {
                            dx[input..input + len]
                                .iter_mut()
                                .zip(run)
                                .for_each(|(d, g)| *d += filter[tap] * g);
                        }
                    } else {
                        filter_grad[tap] +=
                            run.iter().enumerate().map(|(j, g)| g * source[input + j * step]).sum::<f32>();
                        if let Some(dx) = source_grad.as_deref_mut() {
                            run.iter().enumerate().for_each(|(j, g)| dx[input + j * step] += filter[tap] * g);
                        }
                    }
                });
            }
        }
        weight_grad
    };
    per_sample_groups(sizes.batch, plane, sizes.c_out * taps, x_grad, group)
}

/// The gradient a convolution's backward starts from: of its full output,
/// or of its 2x2-pooled output with the pool's indices (unpooled per sample
/// into a cached scratch buffer).
#[derive(Debug, Clone, Copy)]
pub(super) enum OutputGrad<'a> {
    Dense(&'a [f32]),
    Pooled { grad: &'a [f32], indices: &'a [i32] },
}

/// `max_pool2x2(act(conv(x) + bias))` per sample: the full-resolution output
/// lives in a cached scratch buffer only; the pooled output and the indices
/// of the maxima (within each full-resolution plane) are written.
pub(super) fn conv_pool_forward(
    x: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    sizes: ConvSizes,
    epilogue: Epilogue,
) -> (Vec<f32>, Vec<i32>) {
    let [oh, ow] = sizes.geometry.output;
    let (pixels, pooled) = (oh * ow, (oh / 2) * (ow / 2));
    let weight = Matrix::dense(weight, sizes.c_out, sizes.depth());
    let mut output = zeros(sizes.batch * sizes.c_out * pooled);
    let mut indices = vec![0i32; output.len()];
    let per_sample = (sizes.c_out * pooled).max(1);
    output.par_chunks_mut(per_sample).zip(indices.par_chunks_mut(per_sample)).enumerate().for_each_init(
        || (sizes.scratch(), vec![0f32; sizes.c_out * pixels]),
        |(scratch, full), (s, (out, idx))| {
            let cols = sizes.columns(&x[s * sizes.plane()..(s + 1) * sizes.plane()], scratch);
            gemm_into(full, weight, cols, false, gemm::Parallelism::None);
            epilogue_in_place(
                full,
                [sizes.c_out, pixels],
                bias.map(|b| (b, BiasAxis::Rows)),
                epilogue,
                false,
            );
            let planes = full
                .chunks(pixels.max(1))
                .zip(out.chunks_mut(pooled.max(1)).zip(idx.chunks_mut(pooled.max(1))));
            for (plane, (out, idx)) in planes {
                pool_plane(plane, [oh, ow], out, idx);
            }
        },
    );
    (output, indices)
}

#[cfg(test)]
mod tests {
    use burn::backend::Flex;

    use super::*;
    use crate::FusedBackend;

    /// A direct (loop) convolution of one sample, for the im2col tests.
    fn direct_conv(
        x: &[f32],
        [c, h, w]: [usize; 3],
        weight: &[f32],
        c_out: usize,
        g: ConvGeometry,
    ) -> Vec<f32> {
        let ([kh, kw], [sy, sx], [py, px], [oh, ow]) = (g.kernel, g.stride, g.padding, g.output);
        let mut out = vec![0f32; c_out * oh * ow];
        for o in 0..c_out {
            for oy in 0..oh {
                for ox in 0..ow {
                    let mut sum = 0f32;
                    for ci in 0..c {
                        for ky in 0..kh {
                            for kx in 0..kw {
                                let (iy, ix) = (
                                    (oy * sy + ky) as isize - py as isize,
                                    (ox * sx + kx) as isize - px as isize,
                                );
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
            let weight: Vec<f32> =
                (0..c_out * c * kernel[0] * kernel[1]).map(|i| (i % 5) as f32 - 2.0).collect();
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
                let direct =
                    direct_conv(&x[s * c * h * w..(s + 1) * c * h * w], [c, h, w], &weight, c_out, geometry);
                let got = &out[s * per_sample..(s + 1) * per_sample];
                for (a, e) in got.iter().zip(&direct) {
                    assert!((a - e).abs() < 1e-4, "{shape:?} {kernel:?} {stride:?} {padding:?}: {a} vs {e}");
                }
            }
            // <im2col(x), y> == <x, col2im(y)> for any y (one sample).
            let x = &x[..c * h * w];
            let mut cols = vec![0f32; c * geometry.taps() * geometry.output_pixels()];
            im2col_sample(x, geometry, &mut cols);
            let y: Vec<f32> = (0..cols.len()).map(|i| ((i * 11 % 13) as f32) - 6.0).collect();
            let mut back = vec![0f32; x.len()];
            col2im_sample(&y, geometry, &mut back);
            let lhs: f64 = cols.iter().zip(&y).map(|(a, b)| (*a as f64) * (*b as f64)).sum();
            let rhs: f64 = x.iter().zip(&back).map(|(a, b)| (*a as f64) * (*b as f64)).sum();
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
