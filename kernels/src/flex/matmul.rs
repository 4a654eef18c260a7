//! The native batched matmul of flex with its epilogue
//! ([`crate::FusedBackend::matmul_epilogue`]): every batch entry's product
//! written straight into the output through the `gemm` crate, its bias and
//! activation applied while it is in cache.

use burn::backend::flex::FlexTensor;
use burn::tensor::TensorMetadata;
use rayon::prelude::*;

use super::epilogue::epilogue_in_place;
use super::gemm::{add_in_order, from_vec, gemm_into, parallelism, zeros, Matrix, BATCH_PER_TASK};
use crate::{BiasAxis, Epilogue};

/// [`crate::FusedBackend::matmul_epilogue`] on `f32` tensors with non-negative
/// strides: every batch entry's product is written straight into the output
/// and its epilogue applied while it is in cache, entries in parallel; a
/// batch-summed product accumulates fixed groups of entries and adds the
/// groups in order. `None` when the operands do not qualify.
pub(super) fn matmul_native(
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
