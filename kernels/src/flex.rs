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
use burn::tensor::ops::{ConvOptions, FloatTensor, IntTensor};
use burn::tensor::{DType, Shape, TensorData, TensorMetadata};
use rayon::prelude::*;

use crate::flex_decoder::{self, CausalSizes};
use crate::flex_encoder::{self, AttentionSizes};
use crate::flex_optim;
use crate::llama::{self, CausalAttentionOutput, CausalHeads, RmsNormOutput};
use crate::optim::{ParamSlot, ParamUpdate, UpdateRule};
use crate::transformer::{self, AttentionOutput, LayerNormGrads, LayerNormOutput};
use crate::{reference, BiasAxis, Epilogue, FusedBackend, LossWithGrad};

/// Elements per parallel task of an elementwise pass (fixed, so the partition
/// and any partial sums do not depend on the thread count).
const CHUNK: usize = 16 * 1024;

/// `n` zeros, written in parallel (a large buffer's first touch is the
/// costly part; one thread would do it alone).
fn zeros(n: usize) -> Vec<f32> {
    let mut values = Vec::with_capacity(n);
    values.par_extend(rayon::iter::repeat_n(0f32, n));
    values
}

/// Sum of `values` in eight interleaved lanes (vectorised; a fixed order).
fn lane_sum(values: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let chunks = values.chunks_exact(8);
    let rest: f32 = chunks.remainder().iter().sum();
    for chunk in chunks {
        lanes.iter_mut().zip(chunk).for_each(|(lane, v)| *lane += v);
    }
    lanes.iter().sum::<f32>() + rest
}

/// `sum((s - t)^2)` in eight interleaved lanes.
fn lane_sum_squared_difference(s: &[f32], t: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let (s_chunks, t_chunks) = (s.chunks_exact(8), t.chunks_exact(8));
    let rest: f32 =
        s_chunks.remainder().iter().zip(t_chunks.remainder()).map(|(a, b)| (a - b) * (a - b)).sum();
    for (sc, tc) in s_chunks.zip(t_chunks) {
        for ((lane, a), b) in lanes.iter_mut().zip(sc).zip(tc) {
            *lane += (a - b) * (a - b);
        }
    }
    lanes.iter().sum::<f32>() + rest
}

/// `sum(a * b)` in eight interleaved lanes.
fn lane_dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let (a_chunks, b_chunks) = (a.chunks_exact(8), b.chunks_exact(8));
    let rest: f32 = a_chunks.remainder().iter().zip(b_chunks.remainder()).map(|(x, y)| x * y).sum();
    for (ac, bc) in a_chunks.zip(b_chunks) {
        for ((lane, x), y) in lanes.iter_mut().zip(ac).zip(bc) {
            *lane += x * y;
        }
    }
    lanes.iter().sum::<f32>() + rest
}

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

/// Batch entries per task of a batch-summed product (fixed, so the partial
/// sums and their order do not depend on the thread count).
const BATCH_PER_TASK: usize = 8;

/// The activation; NaN stays NaN (as burn's and PyTorch's), so that a
/// diverging block shows in its loss.
fn activate(x: f32, epilogue: Epilogue) -> f32 {
    match epilogue {
        Epilogue::Identity => x,
        Epilogue::Relu => {
            if x < 0.0 {
                0.0
            } else {
                x
            }
        }
        Epilogue::Relu6 => x.clamp(0.0, 6.0),
        // Applied by `epilogue_in_place` to whole rows after the bias.
        Epilogue::Gelu => x,
    }
}

/// `act(data + bias)` in place on `[z, m, n]` row-major values (bias along
/// `m` or `n`), in parallel over rows when `parallel`.
fn epilogue_in_place(
    data: &mut [f32],
    [m, n]: [usize; 2],
    bias: Option<(&[f32], BiasAxis)>,
    epilogue: Epilogue,
    parallel: bool,
) {
    if bias.is_none() && epilogue == Epilogue::Identity {
        return;
    }
    if epilogue == Epilogue::Gelu {
        epilogue_in_place(data, [m, n], bias, Epilogue::Identity, parallel);
        match parallel {
            true => data.par_chunks_mut(CHUNK).for_each(flex_encoder::gelu_slice),
            false => flex_encoder::gelu_slice(data),
        }
        return;
    }
    let row_op = |(r, row): (usize, &mut [f32])| match bias {
        None => row.iter_mut().for_each(|v| *v = activate(*v, epilogue)),
        Some((bias, BiasAxis::Rows)) => {
            let b = bias[r % m];
            row.iter_mut().for_each(|v| *v = activate(*v + b, epilogue));
        }
        Some((bias, BiasAxis::Cols)) => {
            row.iter_mut().zip(bias).for_each(|(v, b)| *v = activate(*v + b, epilogue));
        }
    };
    if parallel {
        data.par_chunks_mut(n.max(1)).with_min_len(rows_per_task(n)).enumerate().for_each(row_op);
    } else {
        data.chunks_mut(n.max(1)).enumerate().for_each(row_op);
    }
}

/// A strided matrix inside a buffer: element `(r, c)` at
/// `data[offset + r * row_stride + c * col_stride]`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Matrix<'a> {
    pub(crate) data: &'a [f32],
    pub(crate) offset: usize,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) row_stride: usize,
    pub(crate) col_stride: usize,
}

impl<'a> Matrix<'a> {
    /// A contiguous row-major `rows x cols` matrix.
    pub(crate) fn dense(data: &'a [f32], rows: usize, cols: usize) -> Self {
        Self { data, offset: 0, rows, cols, row_stride: cols, col_stride: 1 }
    }

    /// Batch entry `z` of a rank-3 `f32` tensor (a batch of one is shared by
    /// every entry); `None` for negative strides.
    fn batch_entry(tensor: &'a FlexTensor, z: usize) -> Option<Self> {
        let [batch, rows, cols] = tensor.shape().dims::<3>();
        let strides: Vec<usize> =
            tensor.layout().strides().iter().map(|s| usize::try_from(*s).ok()).collect::<Option<_>>()?;
        let entry = if batch == 1 { 0 } else { z };
        Some(Self {
            data: tensor.storage::<f32>(),
            offset: tensor.layout().start_offset() + entry * strides[0],
            rows,
            cols,
            row_stride: strides[1],
            col_stride: strides[2],
        })
    }

    pub(crate) fn transposed(self) -> Self {
        Self {
            rows: self.cols,
            cols: self.rows,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
            ..self
        }
    }

    /// Whether every element lies inside `data`.
    fn in_bounds(&self) -> bool {
        self.rows == 0
            || self.cols == 0
            || self.offset + (self.rows - 1) * self.row_stride + (self.cols - 1) * self.col_stride
                < self.data.len()
    }
}

/// `dst = lhs @ rhs`, or `dst += lhs @ rhs` with `accumulate`, for a
/// contiguous row-major `dst`, through the `gemm` crate.
pub(crate) fn gemm_into(
    dst: &mut [f32],
    lhs: Matrix,
    rhs: Matrix,
    accumulate: bool,
    parallelism: gemm::Parallelism,
) {
    let (m, k, n) = (lhs.rows, lhs.cols, rhs.cols);
    assert!(
        rhs.rows == k && dst.len() == m * n && lhs.in_bounds() && rhs.in_bounds(),
        "gemm_into: [{m}, {k}] @ [{}, {n}] into {} values",
        rhs.rows,
        dst.len()
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            dst.fill(0.0);
        }
        return;
    }
    // SAFETY: the assertion keeps every element gemm reads (`lhs`, `rhs`:
    // offset + (rows-1) * row_stride + (cols-1) * col_stride < len) and writes
    // (`dst`: m * n contiguous values) inside those slices, and `dst` is
    // borrowed mutably, so nothing else touches it meanwhile.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            lhs.data.as_ptr().add(lhs.offset),
            lhs.col_stride as isize,
            lhs.row_stride as isize,
            rhs.data.as_ptr().add(rhs.offset),
            rhs.col_stride as isize,
            rhs.row_stride as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
}

/// Threads inside one product (flex's rule: only above 192^3 multiply-adds).
fn parallelism(m: usize, k: usize, n: usize) -> gemm::Parallelism {
    if m.saturating_mul(k).saturating_mul(n) >= 192 * 192 * 192 {
        gemm::Parallelism::Rayon(0)
    } else {
        gemm::Parallelism::None
    }
}

/// [`FusedBackend::matmul_epilogue`] on `f32` tensors with non-negative
/// strides: every batch entry's product is written straight into the output
/// and its epilogue applied while it is in cache, entries in parallel; a
/// batch-summed product accumulates fixed groups of entries and adds the
/// groups in order. `None` when the operands do not qualify.
fn matmul_native(
    lhs: &FlexTensor,
    rhs: &FlexTensor,
    bias: Option<(&[f32], BiasAxis)>,
    epilogue: Epilogue,
    sum_batch: bool,
) -> Option<FlexTensor> {
    let [zl, m, k] = lhs.shape().dims::<3>();
    let [zr, _, n] = rhs.shape().dims::<3>();
    let z = zl.max(zr);
    let (lhs_at, rhs_at) = (|e| Matrix::batch_entry(lhs, e), |e| Matrix::batch_entry(rhs, e));
    lhs_at(0)?;
    rhs_at(0)?;
    let (lhs_at, rhs_at) = (|e| lhs_at(e).expect("checked"), |e| rhs_at(e).expect("checked"));
    if z == 1 {
        let mut out = vec![0f32; m * n];
        gemm_into(&mut out, lhs_at(0), rhs_at(0), false, parallelism(m, k, n));
        epilogue_in_place(&mut out, [m, n], bias, epilogue, true);
        return Some(from_vec(out, [1, m, n]));
    }
    if sum_batch {
        let partials: Vec<Vec<f32>> = (0..z.div_ceil(BATCH_PER_TASK))
            .into_par_iter()
            .map(|task| {
                let mut sum = vec![0f32; m * n];
                for e in task * BATCH_PER_TASK..((task + 1) * BATCH_PER_TASK).min(z) {
                    gemm_into(&mut sum, lhs_at(e), rhs_at(e), true, gemm::Parallelism::None);
                }
                sum
            })
            .collect();
        let mut out = add_in_order(partials, m * n);
        epilogue_in_place(&mut out, [m, n], bias, epilogue, false);
        return Some(from_vec(out, [1, m, n]));
    }
    let mut out = zeros(z * m * n);
    out.par_chunks_mut((m * n).max(1)).enumerate().for_each(|(e, out)| {
        gemm_into(out, lhs_at(e), rhs_at(e), false, gemm::Parallelism::None);
        epilogue_in_place(out, [m, n], bias, epilogue, false);
    });
    Some(from_vec(out, [z, m, n]))
}

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
fn max_pool2x2(x: &FlexTensor, with_indices: bool) -> (FlexTensor, Option<FlexTensor>) {
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
struct ConvSizes {
    batch: usize,
    channels: usize,
    c_out: usize,
    geometry: ConvGeometry,
}

impl ConvSizes {
    fn new(x: &FlexTensor, weight: &FlexTensor, options: &ConvOptions<2>) -> Self {
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
fn conv_forward(
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
fn conv_backward(
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

/// The element-wise sum of `partials` (`len` values each), added in order.
fn add_in_order(partials: Vec<Vec<f32>>, len: usize) -> Vec<f32> {
    let mut sum = vec![0f32; len];
    for partial in partials {
        sum.iter_mut().zip(partial).for_each(|(s, p)| *s += p);
    }
    sum
}

/// Whether a convolution is depthwise: one group per input channel, each
/// filter reading one channel (`c_out` a multiple of `c_in`).
fn depthwise(x: &FlexTensor, weight: &FlexTensor, options: &ConvOptions<2>) -> bool {
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
fn depthwise_forward(
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
fn depthwise_backward(
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
enum OutputGrad<'a> {
    Dense(&'a [f32]),
    Pooled { grad: &'a [f32], indices: &'a [i32] },
}

/// `max_pool2x2(act(conv(x) + bias))` per sample: the full-resolution output
/// lives in a cached scratch buffer only; the pooled output and the indices
/// of the maxima (within each full-resolution plane) are written.
fn conv_pool_forward(
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
            UpdateRule::Adam(adam) if flex_optim::native_adam_applies(&slots) => {
                slots.into_iter().map(|slot| flex_optim::adam_slot(slot, adam, lr)).collect()
            }
            _ => crate::optim::reference_step::<Self>(slots, rule, lr),
        }
    }

    fn activation(x: FloatTensor<Self>, epilogue: Epilogue) -> FloatTensor<Self> {
        if epilogue != Epilogue::Gelu || !is_f32(&x) {
            return reference::activation::<Self>(x, epilogue);
        }
        let mut out = owned(x);
        write(&mut out, flex_encoder::gelu_in_place);
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
        let (context, probs) = flex_encoder::attention(inputs, &values(&mask), sizes, with_probs);
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
        flex_encoder::attention_backward(inputs, &values(&probs), &values(&grad), sizes)
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
        let (output, saved) = flex_encoder::add_layer_norm(inputs, scale, epsilon, with_saved);
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
        let [input, dgamma, dbeta] = flex_encoder::add_layer_norm_backward(
            &values(&sum),
            &values(&rstd),
            &values(&gamma),
            &values(&grad),
        );
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
        let (output, rstd) = flex_decoder::rms_norm(&values(&x), &values(&gamma), epsilon);
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
            flex_decoder::rms_norm_backward(&values(&x), &values(&rstd), &values(&gamma), &values(&grad));
        [from_vec(dx, shape), from_vec(dgamma, [hidden])]
    }

    fn swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        if !is_f32(&gate) || !is_f32(&up) || gate.shape() != up.shape() {
            return llama::swiglu_reference::<Self>(gate, up);
        }
        let shape = gate.shape();
        from_vec(flex_decoder::swiglu(&values(&gate), &values(&up)), shape)
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
        flex_decoder::swiglu_backward(&values(&gate), &values(&up), &values(&grad))
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
            flex_decoder::causal_attention(inputs, &values(&mask), sizes, layout.rope_base, with_probs);
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
        let [dq, dk, dv] = flex_decoder::causal_attention_backward(
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
        let (loss, grad) = flex_decoder::weighted_kl(
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
            write(&mut out, |data| flex_encoder::gelu_backward_in_place(&values(&saved), data));
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
