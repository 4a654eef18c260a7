//! Our CubeCL kernels and their [`FusedBackend`] implementation for burn's
//! CubeCL backends (`CubeBackend<R, ..>`: wgpu, cuda).
//!
//! - `mse_kernel`: one pass over `s` and `t` that writes `2 (s - t) / n` and
//!   per-cube partial sums of `(s - t)^2`; a small sum of the partials gives
//!   the loss.
//! - `soft_ce_kernel`: one unit per row: both softmaxes (max-shifted), the
//!   row's cross-entropy and its gradient `(softmax(s) - softmax(t)) / batch`.
//! - `matmul_epilogue_kernel`: a 16x16 shared-memory tiled matmul over
//!   strided rank-3 operands (so transposes and weights shared across the
//!   batch need no copies), with bias and activation applied before the store.
//!
//! Outputs are allocated uninitialised. [`set_poison_outputs`] makes them start
//! as NaN instead, so that a test sees any element a kernel failed to write.

use std::sync::atomic::{AtomicBool, Ordering};

use burn::tensor::ops::FloatTensor;
use burn::tensor::{Shape, Tensor as BurnTensor, TensorPrimitive};
use burn_cubecl::element::BoolElement;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::*;

use crate::{BiasAxis, Epilogue, FusedBackend, LossWithGrad};

/// Units per cube of the reduction kernels (a power of two).
const REDUCE_UNITS: u32 = 256;
/// Side of the matmul tile (the cube is `TILE x TILE` units).
const TILE: u32 = 16;

static POISON_OUTPUTS: AtomicBool = AtomicBool::new(false);

/// Fill every kernel output with NaN before the launch (for tests: an element
/// the kernel does not write then shows up as NaN). Off by default.
pub fn set_poison_outputs(on: bool) {
    POISON_OUTPUTS.store(on, Ordering::SeqCst);
}

/// Sum of `value` over the cube's units (`CUBE_DIM` must be a power of two of
/// at most 256); the result is valid on unit 0.
#[cube]
fn cube_sum<F: Float>(value: F) -> F {
    let mut shared = SharedMemory::<F>::new(256usize);
    let unit = UNIT_POS as usize;
    shared[unit] = value;
    sync_cube();
    let mut half = CUBE_DIM as usize / 2;
    while half > 0 {
        if unit < half {
            shared[unit] = shared[unit] + shared[unit + half];
        }
        sync_cube();
        half /= 2;
    }
    shared[0]
}

#[cube(launch)]
fn mse_kernel<F: Float>(
    student: &Array<F>,
    teacher: &Array<F>,
    grad: &mut Array<F>,
    partials: &mut Array<F>,
    grad_scale: f32,
    #[comptime] write_grad: bool,
) {
    let n = student.len();
    let step = CUBE_COUNT * CUBE_DIM as usize;
    let scale = F::cast_from(grad_scale);
    let mut acc = F::new(0.0);
    let mut i = ABSOLUTE_POS;
    while i < n {
        let d = student[i] - teacher[i];
        acc += d * d;
        if write_grad {
            grad[i] = d * scale;
        }
        i += step;
    }
    let total = cube_sum::<F>(acc);
    if UNIT_POS == 0 {
        partials[CUBE_POS] = total;
    }
}

#[cube(launch)]
fn soft_ce_kernel<F: Float>(
    student: &Tensor<F>,
    teacher: &Tensor<F>,
    grad: &mut Tensor<F>,
    partials: &mut Array<F>,
    grad_scale: f32,
    #[comptime] write_grad: bool,
) {
    let rows = student.shape(0);
    let classes = student.shape(1);
    let row = ABSOLUTE_POS;
    let mut row_loss = F::new(0.0);
    if row < rows {
        let s_base = row * student.stride(0);
        let s_col = student.stride(1);
        let t_base = row * teacher.stride(0);
        let t_col = teacher.stride(1);
        let mut max_s = student[s_base];
        let mut max_t = teacher[t_base];
        for j in 1..classes {
            max_s = F::max(max_s, student[s_base + j * s_col]);
            max_t = F::max(max_t, teacher[t_base + j * t_col]);
        }
        let mut sum_s = F::new(0.0);
        let mut sum_t = F::new(0.0);
        for j in 0..classes {
            sum_s += F::exp(student[s_base + j * s_col] - max_s);
            sum_t += F::exp(teacher[t_base + j * t_col] - max_t);
        }
        let log_z = max_s + F::ln(sum_s);
        let inv_sum_t = F::new(1.0) / sum_t;
        let scale = F::cast_from(grad_scale);
        let mut cross = F::new(0.0);
        for j in 0..classes {
            let p = F::exp(teacher[t_base + j * t_col] - max_t) * inv_sum_t;
            let log_q = student[s_base + j * s_col] - log_z;
            cross += p * log_q;
            if write_grad {
                grad[row * grad.stride(0) + j * grad.stride(1)] = (F::exp(log_q) - p) * scale;
            }
        }
        row_loss = F::new(0.0) - cross;
    }
    let total = cube_sum::<F>(row_loss);
    if UNIT_POS == 0 {
        partials[CUBE_POS] = total;
    }
}

/// `bias_axis`: 0 none, 1 rows, 2 cols. `epilogue`: [`epilogue_code`].
#[cube(launch)]
fn matmul_epilogue_kernel<F: Float>(
    lhs: &Tensor<F>,
    rhs: &Tensor<F>,
    bias: &Array<F>,
    out: &mut Tensor<F>,
    #[comptime] bias_axis: u32,
    #[comptime] epilogue: u32,
    #[comptime] sum_batch: bool,
) {
    let mut lhs_tile = SharedMemory::<F>::new(256usize);
    let mut rhs_tile = SharedMemory::<F>::new(256usize);
    let tx = UNIT_POS_X as usize;
    let ty = UNIT_POS_Y as usize;
    let row = CUBE_POS_Y as usize * 16 + ty;
    let col = CUBE_POS_X as usize * 16 + tx;
    let m = lhs.shape(1);
    let k = lhs.shape(2);
    let n = rhs.shape(2);
    let lhs_batches = lhs.shape(0);
    let rhs_batches = rhs.shape(0);
    let mut z_begin = CUBE_POS_Z as usize;
    let mut z_end = z_begin + 1;
    if sum_batch {
        z_begin = 0usize;
        z_end = lhs_batches;
        if rhs_batches > lhs_batches {
            z_end = rhs_batches;
        }
    }
    let tiles = k.div_ceil(16);
    let mut acc = F::new(0.0);
    for z in z_begin..z_end {
        let mut lhs_z = z * lhs.stride(0);
        if lhs_batches == 1 {
            lhs_z = 0usize;
        }
        let mut rhs_z = z * rhs.stride(0);
        if rhs_batches == 1 {
            rhs_z = 0usize;
        }
        for t in 0..tiles {
            let ka = t * 16 + tx;
            let mut a = F::new(0.0);
            if row < m && ka < k {
                a = lhs[lhs_z + row * lhs.stride(1) + ka * lhs.stride(2)];
            }
            lhs_tile[ty * 16 + tx] = a;
            let kb = t * 16 + ty;
            let mut b = F::new(0.0);
            if kb < k && col < n {
                b = rhs[rhs_z + kb * rhs.stride(1) + col * rhs.stride(2)];
            }
            rhs_tile[ty * 16 + tx] = b;
            sync_cube();
            #[unroll]
            for i in 0..16usize {
                acc += lhs_tile[ty * 16 + i] * rhs_tile[i * 16 + tx];
            }
            sync_cube();
        }
    }
    if row < m && col < n {
        let mut v = acc;
        if bias_axis == 1 {
            v += bias[row];
        }
        if bias_axis == 2 {
            v += bias[col];
        }
        if epilogue == 1 {
            v = F::max(v, F::new(0.0));
        }
        if epilogue == 2 {
            v = F::min(F::max(v, F::new(0.0)), F::new(6.0));
        }
        if epilogue == 3 {
            v = F::new(0.5) * v * (F::new(1.0) + F::erf(v * F::new(std::f32::consts::FRAC_1_SQRT_2)));
        }
        let mut out_z = CUBE_POS_Z as usize;
        if sum_batch {
            out_z = 0usize;
        }
        out[out_z * out.stride(0) + row * out.stride(1) + col * out.stride(2)] = v;
    }
}

/// Row-major strides of `shape`.
fn contiguous_strides(shape: &Shape) -> Vec<usize> {
    let mut strides = vec![1; shape.num_dims()];
    for d in (0..shape.num_dims().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * shape[d + 1];
    }
    strides
}

fn epilogue_code(epilogue: Epilogue) -> u32 {
    match epilogue {
        Epilogue::Identity => 0,
        Epilogue::Relu => 1,
        Epilogue::Relu6 => 2,
        Epilogue::Gelu => 3,
    }
}

type Cube<R, F, I, BT> = CubeBackend<R, F, I, BT>;

/// A contiguous output tensor shaped like `shape` on `like`'s device: left
/// uninitialised, or NaN-filled when poisoning is on.
fn new_output<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    like: &CubeTensor<R>,
    shape: Shape,
) -> CubeTensor<R> {
    if POISON_OUTPUTS.load(Ordering::SeqCst) {
        let n = shape.num_elements();
        let filled = BurnTensor::<Cube<R, F, I, BT>, 1>::full([n], f32::NAN, &like.device);
        let filled = BurnTensor::<Cube<R, F, I, BT>, 3>::from_primitive(TensorPrimitive::Float(
            filled.reshape([1, 1, n]).into_primitive().tensor(),
        ));
        let mut tensor = into_contiguous(filled.into_primitive().tensor());
        let strides = contiguous_strides(&shape);
        *tensor.meta.shape_mut() = shape;
        *tensor.meta.strides_mut() = strides.into();
        tensor
    } else {
        empty_device_contiguous_dtype(like.client.clone(), like.device.clone(), shape, like.dtype)
    }
}

/// `sum(partials) * scale` as a `[1]` tensor (the small final reduction).
fn finish_sum<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    partials: CubeTensor<R>,
    scale: f32,
) -> FloatTensor<Cube<R, F, I, BT>> {
    let partials = BurnTensor::<Cube<R, F, I, BT>, 1>::from_primitive(TensorPrimitive::Float(partials));
    partials.sum().mul_scalar(scale).into_primitive().tensor()
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> FusedBackend for CubeBackend<R, F, I, BT> {
    fn mse_loss(student: FloatTensor<Self>, teacher: FloatTensor<Self>, with_grad: bool) -> LossWithGrad<Self> {
        let student = into_contiguous(student);
        let teacher = into_contiguous(teacher);
        let shape = student.meta.shape().clone();
        let n = shape.num_elements();
        let cubes = n.div_ceil(REDUCE_UNITS as usize * 8).clamp(1, 1024);
        let partials = new_output::<R, F, I, BT>(&student, Shape::from(vec![cubes]));
        let grad_shape = if with_grad { shape } else { Shape::from(vec![1]) };
        let grad = new_output::<R, F, I, BT>(&student, grad_shape);
        let client = student.client.clone();
        mse_kernel::launch::<F, R>(
            &client,
            CubeCount::Static(cubes as u32, 1, 1),
            CubeDim::new_1d(REDUCE_UNITS),
            student.into_array_arg(),
            teacher.into_array_arg(),
            grad.clone().into_array_arg(),
            partials.clone().into_array_arg(),
            2.0 / n as f32,
            with_grad,
        );
        let loss = finish_sum::<R, F, I, BT>(partials, 1.0 / n as f32);
        LossWithGrad { loss, grad: with_grad.then_some(grad) }
    }

    fn soft_target_ce_loss(
        student: FloatTensor<Self>,
        teacher: FloatTensor<Self>,
        with_grad: bool,
    ) -> LossWithGrad<Self> {
        let student = into_contiguous(student);
        let teacher = into_contiguous(teacher);
        let shape = student.meta.shape().clone();
        let rows = shape[0];
        let cubes = rows.div_ceil(REDUCE_UNITS as usize).max(1);
        let partials = new_output::<R, F, I, BT>(&student, Shape::from(vec![cubes]));
        let grad_shape = if with_grad { shape } else { Shape::from(vec![1, 1]) };
        let grad = new_output::<R, F, I, BT>(&student, grad_shape);
        let client = student.client.clone();
        soft_ce_kernel::launch::<F, R>(
            &client,
            CubeCount::Static(cubes as u32, 1, 1),
            CubeDim::new_1d(REDUCE_UNITS),
            student.into_tensor_arg(),
            teacher.into_tensor_arg(),
            grad.clone().into_tensor_arg(),
            partials.clone().into_array_arg(),
            1.0 / rows as f32,
            with_grad,
        );
        let loss = finish_sum::<R, F, I, BT>(partials, 1.0 / rows as f32);
        LossWithGrad { loss, grad: with_grad.then_some(grad) }
    }

    fn matmul_epilogue(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        bias: Option<(FloatTensor<Self>, BiasAxis)>,
        epilogue: Epilogue,
        sum_batch: bool,
    ) -> FloatTensor<Self> {
        let [zl, m, _] = lhs.meta.shape().dims::<3>();
        let [zr, _, n] = rhs.meta.shape().dims::<3>();
        let z = zl.max(zr);
        let out_batches = if sum_batch { 1 } else { z };
        let out = new_output::<R, F, I, BT>(&lhs, Shape::from(vec![out_batches, m, n]));
        let (bias, bias_axis) = match bias {
            Some((bias, BiasAxis::Rows)) => (into_contiguous(bias), 1),
            Some((bias, BiasAxis::Cols)) => (into_contiguous(bias), 2),
            // Never read (bias_axis 0), but the kernel needs a buffer other
            // than `out` (a buffer bound as input and output is invalid).
            None => (new_output::<R, F, I, BT>(&lhs, Shape::from(vec![1])), 0),
        };
        let client = lhs.client.clone();
        let count = CubeCount::Static(n.div_ceil(TILE as usize) as u32, m.div_ceil(TILE as usize) as u32, out_batches as u32);
        matmul_epilogue_kernel::launch::<F, R>(
            &client,
            count,
            CubeDim::new_2d(TILE, TILE),
            lhs.into_tensor_arg(),
            rhs.into_tensor_arg(),
            bias.into_array_arg(),
            out.clone().into_tensor_arg(),
            bias_axis,
            epilogue_code(epilogue),
            sum_batch,
        );
        out
    }
}
