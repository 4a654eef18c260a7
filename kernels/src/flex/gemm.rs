//! The shared numeric helpers of the native flex paths: strided matrices
//! and their products through the `gemm` crate, sums and dot products in
//! eight interleaved lanes, the branch-free `exp`, and the `f32` buffer
//! plumbing every path uses (views, owned copies, parallel zeros, and the
//! fixed task sizes that keep results independent of the thread count).

use std::borrow::Cow;

use burn::backend::flex::FlexTensor;
use burn::tensor::{DType, Shape, TensorData, TensorMetadata};
use rayon::prelude::*;

/// Elements per parallel task of an elementwise pass (fixed, so the partition
/// and any partial sums do not depend on the thread count).
pub(super) const CHUNK: usize = 16 * 1024;

/// `n` zeros, written in parallel (a large buffer's first touch is the
/// costly part; one thread would do it alone).
pub(super) fn zeros(n: usize) -> Vec<f32> {
    let mut values = Vec::with_capacity(n);
    values.par_extend(rayon::iter::repeat_n(0f32, n));
    values
}

/// Sum of `values` in eight interleaved lanes (vectorised; a fixed order).
pub(super) fn lane_sum(values: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let chunks = values.chunks_exact(8);
    let rest: f32 = chunks.remainder().iter().sum();
    for chunk in chunks {
        lanes.iter_mut().zip(chunk).for_each(|(lane, v)| *lane += v);
    }
    lanes.iter().sum::<f32>() + rest
}

/// `sum((s - t)^2)` in eight interleaved lanes.
pub(super) fn lane_sum_squared_difference(s: &[f32], t: &[f32]) -> f32 {
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
pub(super) fn lane_dot(a: &[f32], b: &[f32]) -> f32 {
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

pub(super) fn is_f32(tensor: &FlexTensor) -> bool {
    tensor.dtype() == DType::F32
}

/// The values of `tensor` in row-major order: a view when it is contiguous.
pub(super) fn values(tensor: &FlexTensor) -> Cow<'_, [f32]> {
    match tensor.as_slice::<f32>() {
        Some(slice) => Cow::Borrowed(slice),
        None => Cow::Owned(tensor.to_contiguous().as_slice::<f32>().unwrap_or_default().to_vec()),
    }
}

/// `tensor` as a uniquely owned, contiguous buffer that may be written in
/// place (copied only when it is shared or strided).
pub(super) fn owned(tensor: FlexTensor) -> FlexTensor {
    let n = tensor.layout().num_elements();
    let exact = tensor.layout().contiguous_offsets() == Some((0, n)) && tensor.bytes().len() == n * 4;
    if exact && tensor.is_unique() {
        tensor
    } else {
        FlexTensor::from_data(TensorData::new(values(&tensor).into_owned(), tensor.shape()))
    }
}

/// Runs `f` on the first `n` values of a tensor from [`owned`].
pub(super) fn write(tensor: &mut FlexTensor, f: impl FnOnce(&mut [f32])) {
    let n = tensor.layout().num_elements();
    f(&mut tensor.storage_mut::<f32>()[..n]);
}

pub(super) fn from_vec(values: Vec<f32>, shape: impl Into<Shape>) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape))
}

/// Rows of `row` elements per parallel task, for about [`CHUNK`] elements.
pub(super) fn rows_per_task(row: usize) -> usize {
    (CHUNK / row.max(1)).max(1)
}

/// Batch entries per task of a batch-summed product (fixed, so the partial
/// sums and their order do not depend on the thread count).
pub(super) const BATCH_PER_TASK: usize = 8;

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
    pub(super) fn batch_entry(tensor: &'a FlexTensor, z: usize) -> Option<Self> {
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
pub(super) fn parallelism(m: usize, k: usize, n: usize) -> gemm::Parallelism {
    if m.saturating_mul(k).saturating_mul(n) >= 192 * 192 * 192 {
        gemm::Parallelism::Rayon(0)
    } else {
        gemm::Parallelism::None
    }
}

/// The element-wise sum of `partials` (`len` values each), added in order.
pub(super) fn add_in_order(partials: Vec<Vec<f32>>, len: usize) -> Vec<f32> {
    let mut sum = vec![0f32; len];
    for partial in partials {
        sum.iter_mut().zip(partial).for_each(|(s, p)| *s += p);
    }
    sum
}

#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let rest: f32 = ac.remainder().iter().zip(bc.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ac.zip(bc) {
        for i in 0..8 {
            lanes[i] += x[i] * y[i];
        }
    }
    lanes.iter().sum::<f32>() + rest
}

/// `e^x` without calls or branches, so that loops over it vectorise: `x = n
/// ln2 + r` with `|r| <= ln2 / 2` (Cody-Waite), `e^r` by Cephes' degree-6
/// polynomial, `2^n` through the exponent bits. Within 2 ulp of `exp` for
/// `x` in `[-87, 88]`; clamped outside (0 and `f32::MAX`-ish, as needed here).
#[inline(always)]
pub(crate) fn exp_fast(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 88.0);
    let n = (x * LOG2E + ROUND) - ROUND;
    let r = x - n * 0.693_359_4 - n * -2.121_944_4e-4;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 5.000_000_1e-1;
    let e_r = p * r * r + r + 1.0;
    e_r * f32::from_bits(((n as i32 + 127) << 23) as u32)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_fast_exp_is_within_a_few_ulp() {
        for i in -8_700..=8_800 {
            let x = i as f32 * 0.01;
            let (ours, std) = (super::exp_fast(x), x.exp());
            assert!((ours - std).abs() <= 4.0 * f32::EPSILON * std, "exp({x}) = {ours}, std {std}");
        }
    }
}
