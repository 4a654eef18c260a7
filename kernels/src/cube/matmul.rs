//! The fused matmul on CubeCL backends ([`crate::FusedBackend::matmul_epilogue`]):
//! our register-tiled kernel with the epilogue applied before the store
//! ([`MatmulVariant::Fused`]), or burn's matmul followed by our epilogue
//! kernel ([`MatmulVariant::Split`]), whichever is forced or measured faster.

use burn::tensor::{Shape, Tensor as BurnTensor, TensorPrimitive};
use burn_cubecl::element::BoolElement;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::*;

use super::common::{
    activate, clamp_index, epilogue_code, new_output, outer_product_add, Cube, REDUCE_UNITS,
};
use super::tuning;
use crate::{BiasAxis, Epilogue, MatmulVariant};

/// Most units in a matmul cube (each unit computes 4x4 outputs).
const MATMUL_UNITS: u32 = 256;

/// The epilogue alone over a contiguous `[z, m, n]` product (the second pass
/// of [`MatmulVariant::Split`]).
#[cube(launch)]
fn epilogue_kernel<F: Float>(
    values: &Array<F>,
    bias: &Array<F>,
    out: &mut Array<F>,
    rows: usize,
    cols: usize,
    #[comptime] bias_axis: u32,
    #[comptime] epilogue: u32,
) {
    let total = values.len();
    let step = CUBE_COUNT * CUBE_DIM as usize;
    let mut i = ABSOLUTE_POS;
    while i < total {
        let mut v = values[i];
        if bias_axis == 1 {
            v += bias[(i / cols) % rows];
        }
        if bias_axis == 2 {
            v += bias[i % cols];
        }
        out[i] = activate::<F>(v, epilogue);
        i += step;
    }
}

/// `bias_axis`: 0 none, 1 rows, 2 cols. `epilogue`: [`epilogue_code`].
///
/// Each unit computes 4x4 outputs in registers, reading its operands straight
/// from memory (no shared memory, no barriers); a cube of 16x16 units covers
/// a 64x64 output tile. Out-of-range rows and columns are read clamped and
/// never stored.
#[cube(launch_unchecked)]
fn matmul_epilogue_kernel<F: Float>(
    lhs: &Tensor<F>,
    rhs: &Tensor<F>,
    bias: &Array<F>,
    out: &mut Tensor<F>,
    #[comptime] bias_axis: u32,
    #[comptime] epilogue: u32,
    #[comptime] sum_batch: bool,
) {
    let m = lhs.shape(1);
    let k = lhs.shape(2);
    let n = rhs.shape(2);
    // With a cube of DX x DY units, unit (x, y) of cube (X, Y) owns rows
    // 4*DY*Y + y + DY*i and columns 4*DX*X + x + DX*j (i, j < 4): neighbouring
    // units touch neighbouring columns, so their loads and stores are contiguous.
    let dx = CUBE_DIM_X as usize;
    let dy = CUBE_DIM_Y as usize;
    let row0 = CUBE_POS_Y as usize * 4 * dy + UNIT_POS_Y as usize;
    let col0 = CUBE_POS_X as usize * 4 * dx + UNIT_POS_X as usize;
    if row0 < m && col0 < n {
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
        let (ls_row, ls_k) = (lhs.stride(1), lhs.stride(2));
        let (rs_k, rs_col) = (rhs.stride(1), rhs.stride(2));
        let r0 = clamp_index(row0, m) * ls_row;
        let r1 = clamp_index(row0 + dy, m) * ls_row;
        let r2 = clamp_index(row0 + 2 * dy, m) * ls_row;
        let r3 = clamp_index(row0 + 3 * dy, m) * ls_row;
        let c0 = clamp_index(col0, n) * rs_col;
        let c1 = clamp_index(col0 + dx, n) * rs_col;
        let c2 = clamp_index(col0 + 2 * dx, n) * rs_col;
        let c3 = clamp_index(col0 + 3 * dx, n) * rs_col;
        let mut acc = Array::<F>::new(16usize);
        #[unroll]
        for i in 0..16usize {
            acc[i] = F::new(0.0);
        }
        for z in z_begin..z_end {
            let mut lz = z * lhs.stride(0);
            if lhs_batches == 1 {
                lz = 0usize;
            }
            let mut rz = z * rhs.stride(0);
            if rhs_batches == 1 {
                rz = 0usize;
            }
            let mut la = lz;
            let mut rb = rz;
            for _ in 0..k {
                let a0 = lhs[la + r0];
                let a1 = lhs[la + r1];
                let a2 = lhs[la + r2];
                let a3 = lhs[la + r3];
                let b0 = rhs[rb + c0];
                let b1 = rhs[rb + c1];
                let b2 = rhs[rb + c2];
                let b3 = rhs[rb + c3];
                outer_product_add::<F>(&mut acc, a0, a1, a2, a3, b0, b1, b2, b3);
                la += ls_k;
                rb += rs_k;
            }
        }
        let mut out_z = CUBE_POS_Z as usize;
        if sum_batch {
            out_z = 0usize;
        }
        let base = out_z * out.stride(0);
        #[unroll]
        for i in 0..4usize {
            #[unroll]
            for j in 0..4usize {
                let row = row0 + i * dy;
                let col = col0 + j * dx;
                if row < m && col < n {
                    let mut v = acc[i * 4 + j];
                    if bias_axis == 1 {
                        v += bias[row];
                    }
                    if bias_axis == 2 {
                        v += bias[col];
                    }
                    v = activate::<F>(v, epilogue);
                    out[base + row * out.stride(1) + col * out.stride(2)] = v;
                }
            }
        }
    }
}

/// The arguments of one fused matmul call.
#[derive(Clone)]
pub(super) struct MatmulCall<R: CubeRuntime> {
    pub(super) lhs: CubeTensor<R>,
    pub(super) rhs: CubeTensor<R>,
    pub(super) bias: Option<(CubeTensor<R>, BiasAxis)>,
    pub(super) epilogue: Epilogue,
    pub(super) sum_batch: bool,
}

impl<R: CubeRuntime> MatmulCall<R> {
    /// The bias buffer and its axis code. Without a bias the kernels still
    /// need a buffer (never read) other than their output.
    fn bias_arg<F: FloatElement, I: IntElement, BT: BoolElement>(&self) -> (CubeTensor<R>, u32) {
        match &self.bias {
            Some((bias, BiasAxis::Rows)) => (into_contiguous(bias.clone()), 1),
            Some((bias, BiasAxis::Cols)) => (into_contiguous(bias.clone()), 2),
            None => (new_output::<R, F, I, BT>(&self.lhs, Shape::from(vec![1])), 0),
        }
    }

    /// What the autotuner tells calls apart by: device, shapes, strides, options.
    fn key(&self) -> String {
        let bias = self.bias.as_ref().map(|(_, axis)| *axis);
        format!(
            "{:?} {:?} {:?} {:?} {:?} {bias:?} {:?} {}",
            self.lhs.device,
            self.lhs.meta.shape(),
            self.lhs.meta.strides(),
            self.rhs.meta.shape(),
            self.rhs.meta.strides(),
            self.epilogue,
            self.sum_batch
        )
    }
}

/// The matmul variant in force, or the faster one for this call's shapes on
/// this device ([`tuning::faster`]).
pub(super) fn choose_variant<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    call: &MatmulCall<R>,
) -> MatmulVariant {
    let forced = crate::matmul_variant();
    if forced != MatmulVariant::Auto {
        return forced;
    }
    let timed = |variant: MatmulVariant| {
        move || {
            let out = match variant {
                MatmulVariant::Split => split_matmul::<R, F, I, BT>(call.clone()),
                _ => fused_matmul::<R, F, I, BT>(call.clone()),
            };
            let _ = <Cube<R, F, I, BT> as burn::tensor::backend::Backend>::sync(&out.device);
        }
    };
    let (fused, split) = (timed(MatmulVariant::Fused), timed(MatmulVariant::Split));
    match tuning::faster(format!("matmul {}", call.key()), [("fused", &fused), ("split", &split)]) {
        "split" => MatmulVariant::Split,
        _ => MatmulVariant::Fused,
    }
}

/// Our one-kernel matmul with the epilogue.
pub(super) fn fused_matmul<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    call: MatmulCall<R>,
) -> CubeTensor<R> {
    let (bias, bias_axis) = call.bias_arg::<F, I, BT>();
    let MatmulCall { lhs, rhs, epilogue, sum_batch, .. } = call;
    let [zl, m, _] = lhs.meta.shape().dims::<3>();
    let [zr, _, n] = rhs.meta.shape().dims::<3>();
    let out_batches = if sum_batch { 1 } else { zl.max(zr) };
    let out = new_output::<R, F, I, BT>(&lhs, Shape::from(vec![out_batches, m, n]));
    let client = lhs.client.clone();
    // Fit the cube to the output: few rows (a pointwise conv's channels)
    // or few columns (a 3x3 map) should not leave most units idle.
    let units = (MATMUL_UNITS as usize).min(client.properties().hardware.max_units_per_cube as usize);
    let dx = n.div_ceil(4).next_power_of_two().clamp(1, units);
    let dy = m.div_ceil(4).next_power_of_two().clamp(1, units / dx);
    let count = CubeCount::Static(n.div_ceil(4 * dx) as u32, m.div_ceil(4 * dy) as u32, out_batches as u32);
    // SAFETY: every read is clamped to the operands' shapes and every
    // store is guarded by `row < m && col < n`; `bias` is only read when
    // `bias_axis` says it has `m` or `n` elements, so no access leaves its
    // buffer.
    unsafe {
        matmul_epilogue_kernel::launch_unchecked::<F, R>(
            &client,
            count,
            CubeDim::new_2d(dx as u32, dy as u32),
            lhs.into_tensor_arg(),
            rhs.into_tensor_arg(),
            bias.into_array_arg(),
            out.clone().into_tensor_arg(),
            bias_axis,
            epilogue_code(epilogue),
            sum_batch,
        );
    }
    out
}

/// burn's matmul, then our in-place epilogue kernel.
pub(super) fn split_matmul<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    call: MatmulCall<R>,
) -> CubeTensor<R> {
    let (bias, bias_axis) = call.bias_arg::<F, I, BT>();
    let MatmulCall { lhs, rhs, epilogue, sum_batch, .. } = call;
    let [zl, m, _] = lhs.meta.shape().dims::<3>();
    let [zr, _, n] = rhs.meta.shape().dims::<3>();
    let lhs = BurnTensor::<Cube<R, F, I, BT>, 3>::from_primitive(TensorPrimitive::Float(lhs));
    let rhs = BurnTensor::<Cube<R, F, I, BT>, 3>::from_primitive(TensorPrimitive::Float(rhs));
    let mut product = if zl == 1 && zr == 1 {
        // A plain 2-D product (a linear layer): burn picks its 2-D kernel.
        let [_, _, k] = lhs.dims();
        lhs.reshape([m, k]).matmul(rhs.reshape([k, n])).reshape([1, m, n])
    } else {
        lhs.matmul(rhs)
    };
    if sum_batch && zl.max(zr) > 1 {
        product = product.sum_dim(0);
    }
    let values = into_contiguous(product.into_primitive().tensor());
    if bias_axis == 0 && epilogue == Epilogue::Identity {
        return values;
    }
    let total = values.meta.num_elements();
    let cubes = total.div_ceil(REDUCE_UNITS as usize * 16).clamp(1, 64);
    let out = new_output::<R, F, I, BT>(&values, values.meta.shape().clone());
    epilogue_kernel::launch::<F, R>(
        &values.client.clone(),
        CubeCount::Static(cubes as u32, 1, 1),
        CubeDim::new_1d(REDUCE_UNITS),
        values.into_array_arg(),
        bias.into_array_arg(),
        out.clone().into_array_arg(),
        m,
        n,
        bias_axis,
        epilogue_code(epilogue),
    );
    out
}
