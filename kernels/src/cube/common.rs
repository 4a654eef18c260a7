//! What the CubeCL kernels share: the epilogue's activation (with the
//! accurate `erf` it needs) and its code, the 4x4 register tile's update,
//! clamped operand indices, the outputs the kernels write (left
//! uninitialised, or NaN-filled when poisoning is on), the cube-wide
//! reduction and the second stages of the sums (`sum_kernel`,
//! `sum_chunks_kernel`, `finish_sum`).

use std::sync::atomic::{AtomicBool, Ordering};

use burn::tensor::{Shape, Tensor as BurnTensor, TensorData};
use burn_cubecl::element::BoolElement;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::*;

use crate::Epilogue;

/// Units per cube of the reduction kernels (a power of two).
pub(super) const REDUCE_UNITS: u32 = 256;

static POISON_OUTPUTS: AtomicBool = AtomicBool::new(false);

/// Fill every kernel output with NaN before the launch (for tests: an element
/// the kernel does not write then shows up as NaN). Off by default.
pub fn set_poison_outputs(on: bool) {
    POISON_OUTPUTS.store(on, Ordering::SeqCst);
}

/// `erf(x)` to about 1e-7 relative: the Chebyshev fit of `erfc` from
/// Numerical Recipes (`erfcc`), more accurate than the usual polynomial
/// polyfill, so that GELU's derivative matches a CPU's libm.
#[cube]
pub(super) fn erf_accurate<F: Float>(x: F) -> F {
    let z = F::abs(x);
    let t = F::new(1.0) / (F::new(1.0) + F::new(0.5) * z);
    let poly = F::new(-1.265_512_2)
        + t * (F::new(1.000_023_7)
            + t * (F::new(0.374_091_96)
                + t * (F::new(0.096_784_18)
                    + t * (F::new(-0.186_288_06)
                        + t * (F::new(0.278_868_07)
                            + t * (F::new(-1.135_204)
                                + t * (F::new(1.488_516)
                                    + t * (F::new(-0.822_152_23) + t * F::new(0.170_872_77)))))))));
    let erfc = t * F::exp(F::new(0.0) - z * z + poly);
    let mut out = F::new(1.0) - erfc;
    if x < F::new(0.0) {
        out = erfc - F::new(1.0);
    }
    out
}

/// The epilogue activation (`epilogue`: see [`epilogue_code`]). NaN stays
/// NaN (as burn's and PyTorch's activations), so that a diverging block
/// shows in its loss.
// The nested ifs keep the comptime test (`epilogue`) apart from the runtime one.
#[allow(clippy::collapsible_if)]
#[cube]
pub(super) fn activate<F: Float>(v: F, #[comptime] epilogue: u32) -> F {
    let mut out = v;
    if epilogue == 1 || epilogue == 2 {
        if v < F::new(0.0) {
            out = F::new(0.0);
        }
    }
    if epilogue == 2 {
        if v > F::new(6.0) {
            out = F::new(6.0);
        }
    }
    if epilogue == 3 {
        out =
            F::new(0.5) * v * (F::new(1.0) + erf_accurate::<F>(v * F::new(std::f32::consts::FRAC_1_SQRT_2)));
    }
    out
}

/// `acc[4 i + j] += a_i * b_j`: a 4x4 register tile's update by one column
/// of the left operand and one row of the right one (every register-tiled
/// product kernel's inner step).
#[allow(clippy::too_many_arguments)]
#[cube]
pub(super) fn outer_product_add<F: Float>(
    acc: &mut Array<F>,
    a0: F,
    a1: F,
    a2: F,
    a3: F,
    b0: F,
    b1: F,
    b2: F,
    b3: F,
) {
    acc[0] += a0 * b0;
    acc[1] += a0 * b1;
    acc[2] += a0 * b2;
    acc[3] += a0 * b3;
    acc[4] += a1 * b0;
    acc[5] += a1 * b1;
    acc[6] += a1 * b2;
    acc[7] += a1 * b3;
    acc[8] += a2 * b0;
    acc[9] += a2 * b1;
    acc[10] += a2 * b2;
    acc[11] += a2 * b3;
    acc[12] += a3 * b0;
    acc[13] += a3 * b1;
    acc[14] += a3 * b2;
    acc[15] += a3 * b3;
}

/// `min(i, len - 1)`: operand indices past the edge are read clamped, so the
/// matmul's inner loop has no branches (their products are never stored).
#[cube]
pub(super) fn clamp_index(i: usize, len: usize) -> usize {
    let mut j = i;
    if j >= len {
        j = len - 1;
    }
    j
}

/// Row-major strides of `shape`.
pub(super) fn contiguous_strides(shape: &Shape) -> Vec<usize> {
    let mut strides = vec![1; shape.num_dims()];
    for d in (0..shape.num_dims().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * shape[d + 1];
    }
    strides
}

pub(super) fn epilogue_code(epilogue: Epilogue) -> u32 {
    match epilogue {
        Epilogue::Identity => 0,
        Epilogue::Relu => 1,
        Epilogue::Relu6 => 2,
        Epilogue::Gelu => 3,
    }
}

pub(super) type Cube<R, F, I, BT> = CubeBackend<R, F, I, BT>;

/// A contiguous output tensor shaped like `shape` on `like`'s device: left
/// uninitialised, or NaN-filled when poisoning is on.
pub(super) fn new_output<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    like: &CubeTensor<R>,
    shape: Shape,
) -> CubeTensor<R> {
    if POISON_OUTPUTS.load(Ordering::SeqCst) {
        let n = shape.num_elements();
        let filled = BurnTensor::<Cube<R, F, I, BT>, 1>::full([n], f32::NAN, &like.device);
        let mut tensor = into_contiguous(filled.into_primitive().tensor());
        let strides = contiguous_strides(&shape);
        *tensor.meta.shape_mut() = shape;
        *tensor.meta.strides_mut() = strides.into();
        tensor
    } else {
        empty_device_contiguous_dtype(like.client.clone(), like.device.clone(), shape, like.dtype)
    }
}

/// An int tensor for the pool indices, shaped `shape`.
pub(super) fn new_indices<R: CubeRuntime, I: IntElement>(
    like: &CubeTensor<R>,
    shape: Shape,
) -> CubeTensor<R> {
    empty_device_contiguous_dtype(like.client.clone(), like.device.clone(), shape, I::dtype())
}

/// A buffer the kernels bind but never read (a missing bias or indices).
pub(super) fn placeholder<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    like: &CubeTensor<R>,
) -> CubeTensor<R> {
    new_output::<R, F, I, BT>(like, Shape::from(vec![1]))
}

/// `values` as a `[n]` tensor on `like`'s device (a small upload; no read).
pub(super) fn upload<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    values: Vec<f32>,
    like: &CubeTensor<R>,
) -> CubeTensor<R> {
    let n = values.len();
    let tensor = BurnTensor::<Cube<R, F, I, BT>, 1>::from_data(TensorData::new(values, [n]), &like.device);
    into_contiguous(tensor.into_primitive().tensor())
}

/// The sum (or, with `max`, the maximum) of every unit's `value` in the
/// cube, through a shared-memory tree of `CUBE_DIM` (a power of two, at
/// most `shared`'s length) slots. Every unit of the cube must call it; each
/// gets the result.
#[cube]
pub(super) fn cube_reduce<F: Float>(shared: &mut SharedMemory<F>, value: F, #[comptime] max: bool) -> F {
    let unit = UNIT_POS as usize;
    shared[unit] = value;
    sync_cube();
    let mut half = CUBE_DIM as usize / 2;
    while half > 0 {
        if unit < half {
            if max {
                shared[unit] = F::max(shared[unit], shared[unit + half]);
            } else {
                shared[unit] = shared[unit] + shared[unit + half];
            }
        }
        sync_cube();
        half /= 2;
    }
    let total = shared[0];
    // Nobody writes the memory again before everyone has read the result.
    sync_cube();
    total
}

/// Second stage of the loss reductions: one cube of [`REDUCE_UNITS`] units
/// sums `partials` (strided per unit, then a shared-memory tree) and writes
/// `sum * scale` to `out[0]`.
#[cube(launch)]
pub(super) fn sum_kernel<F: Float>(partials: &Array<F>, out: &mut Array<F>, scale: f32) {
    let mut shared = SharedMemory::<F>::new(256usize);
    let unit = UNIT_POS as usize;
    let mut acc = F::new(0.0);
    let mut i = unit;
    while i < partials.len() {
        acc += partials[i];
        i += 256;
    }
    let total = cube_reduce::<F>(&mut shared, acc, false);
    if unit == 0 {
        out[0] = total * F::cast_from(scale);
    }
}

/// Bias gradient, second stage: `out[j] = sum of partials[j * chunks ..][..chunks]`.
#[cube(launch)]
pub(super) fn sum_chunks_kernel<F: Float>(partials: &Array<F>, out: &mut Array<F>, chunks: usize) {
    let j = ABSOLUTE_POS;
    if j < out.len() {
        let mut acc = F::new(0.0);
        for c in 0..chunks {
            acc += partials[j * chunks + c];
        }
        out[j] = acc;
    }
}

/// `sum(partials) * scale` as a `[1]` tensor (the small final reduction).
pub(super) fn finish_sum<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    partials: CubeTensor<R>,
    scale: f32,
) -> CubeTensor<R> {
    let out = new_output::<R, F, I, BT>(&partials, Shape::from(vec![1]));
    sum_kernel::launch::<F, R>(
        &partials.client.clone(),
        CubeCount::Static(1, 1, 1),
        CubeDim::new_1d(REDUCE_UNITS),
        partials.into_array_arg(),
        out.clone().into_array_arg(),
        scale,
    );
    out
}
