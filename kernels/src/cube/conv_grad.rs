//! The gradients of dense convolutions on CubeCL backends, pooled or not,
//! and the launches of every convolution's backward (depthwise kernels in
//! `depthwise.rs`):
//! - input gradient: `W^T @ cols(G)`, where `G` is the pre-activation
//!   gradient, made on the fly from the output gradient and the saved
//!   output (the activation's derivative) and, pooled, routed to each
//!   window's maximum by the saved indices;
//! - weight and bias gradients: `G @ cols(x)^T`, the long reduction over
//!   batch and pixels split over cubes (partial sums), then one small
//!   kernel adds the partials (the depthwise ones' too).

use burn::tensor::ops::ConvOptions;
use burn::tensor::Shape;
use burn_cubecl::element::BoolElement;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::*;

use super::common::{new_indices, new_output, placeholder, Cube};
use super::depthwise;
use super::geometry::{
    clear, column_tile, elementwise_grid, input_at, matrix_grid, multiply_tiles, pre_gradient, tile_rows,
    ConvShape, Geometry, TILE_K, TILE_N, UNITS,
};
use crate::{ConvBackwardInputs, ConvGrads, Epilogue};

/// Dense input gradient: `dx = W^T @ cols(G)` (see [`pre_gradient`] for
/// `G`), with the sizes and activation of `shape`. `dx` is `[batch, c_in,
/// h, wd]`, every element written.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
fn conv_input_grad_kernel<F: Float, I: Int>(
    grad: &Array<F>,
    saved: &Array<F>,
    indices: &Array<I>,
    w: &Array<F>,
    dx: &mut Array<F>,
    shape: &ConvShape,
    #[comptime] tile_m: usize,
    #[comptime] pooled: bool,
) {
    let taps = comptime![shape.kh * shape.kw];
    let depth = shape.c_out * taps;
    let columns = shape.batch * shape.h * shape.wd;
    let n0 = column_tile() * 64;
    let m0 = CUBE_POS_Y as usize * tile_m;
    if n0 < columns {
        let units = tile_m * 4;
        let unit = UNIT_POS as usize;
        let (ux, uy) = (UNIT_POS_X as usize, UNIT_POS_Y as usize);
        let dy = tile_m / 4;
        let mut a_tile = SharedMemory::<F>::new(tile_m * 16);
        let mut b_tile = SharedMemory::<F>::new(1024usize);

        let load_col = unit % 64;
        let n = n0 + load_col;
        let b = n / (shape.h * shape.wd);
        let at = n % (shape.h * shape.wd);
        let iy = at / shape.wd;
        let ix = at % shape.wd;
        let column_ok = n < columns;
        let rows_per_pass = units / 64;

        let mut acc = Array::<F>::new(16usize);
        clear::<F>(&mut acc, 16usize);
        let mut k0 = 0usize.runtime();
        while k0 < depth {
            // A[c][(co, tap)] = W[co, c, tap].
            #[unroll]
            for j in 0..4usize {
                let idx = unit + j * units;
                let (c, k) = (m0 + idx / 16, k0 + idx % 16);
                let mut v = F::new(0.0);
                if c < shape.c_in && k < depth {
                    v = w[((k / taps) * shape.c_in + c) * taps + k % taps];
                }
                a_tile[idx] = v;
            }
            let mut r = unit / 64;
            while r < 16 {
                let k = k0 + r;
                let mut v = F::new(0.0);
                if column_ok && k < depth {
                    let tap = k % taps;
                    let (ky, kx) = (tap / shape.kw, tap % shape.kw);
                    let (ty, tx) = (iy + shape.pad_y, ix + shape.pad_x);
                    // The output position whose tap (ky, kx) reads input (iy, ix), if any.
                    if ty >= ky && tx >= kx && (ty - ky) % shape.sy == 0 && (tx - kx) % shape.sx == 0 {
                        let (oy, ox) = ((ty - ky) / shape.sy, (tx - kx) / shape.sx);
                        if oy < shape.oh && ox < shape.ow {
                            let plane = b * shape.c_out + k / taps;
                            v = pre_gradient::<F, I>(grad, saved, indices, shape, plane, oy, ox, pooled);
                        }
                    }
                }
                b_tile[r * 64 + load_col] = v;
                r += rows_per_pass;
            }
            sync_cube();
            multiply_tiles::<F>(&mut acc, &a_tile, &b_tile, ux, uy, dy, false);
            sync_cube();
            k0 += 16;
        }
        store_input_grad::<F>(&acc, dx, shape, n0, m0, ux, uy, dy, columns);
    }
}

/// The input-gradient kernel's 4x4 register tile: rows `m0 + uy + i dy`
/// (input channels), columns `n0 + ux + 16 j` (sample and input pixel) of
/// `dx`.
#[allow(clippy::too_many_arguments)]
#[cube]
fn store_input_grad<F: Float>(
    acc: &Array<F>,
    dx: &mut Array<F>,
    shape: &ConvShape,
    n0: usize,
    m0: usize,
    ux: usize,
    uy: usize,
    dy: usize,
    columns: usize,
) {
    #[unroll]
    for j in 0..4usize {
        let col = n0 + ux + 16 * j;
        if col < columns {
            let cb = col / (shape.h * shape.wd);
            let cat = col % (shape.h * shape.wd);
            #[unroll]
            for i in 0..4usize {
                let c = m0 + uy + i * dy;
                if c < shape.c_in {
                    dx[(cb * shape.c_in + c) * shape.h * shape.wd + cat] = acc[i * 4 + j];
                }
            }
        }
    }
}

/// Dense weight and bias gradients, first stage: cube `z` sums `G @
/// cols(x)^T` over its chunk of `chunk` positions of the reduction (batch x
/// output pixels) into `partials[z][c_out][c_in * taps]`, and the bias
/// gradient over the same chunk into `bias_parts[z][c_out]`. With
/// `swap` it computes the transposed product `cols(x) @ G^T` (rows: the
/// filter's `c_in * taps` entries, columns: the output channels), which
/// fills the 64 columns of a tile better when the filter has fewer entries
/// than there are channels; the partials keep their layout.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
fn conv_weight_grad_kernel<F: Float, I: Int>(
    grad: &Array<F>,
    saved: &Array<F>,
    indices: &Array<I>,
    x: &Array<F>,
    partials: &mut Array<F>,
    bias_parts: &mut Array<F>,
    shape: &ConvShape,
    chunk: usize,
    #[comptime] tile_m: usize,
    #[comptime] pooled: bool,
    #[comptime] swap: bool,
) {
    let taps = comptime![shape.kh * shape.kw];
    let depth = shape.c_in * taps;
    // Rows and columns of the product this kernel computes.
    let mut rows = shape.c_out;
    let mut cols = depth;
    if swap {
        rows = depth;
        cols = shape.c_out;
    }
    // Pooled, only the pixels inside a whole window can carry a gradient.
    let mut rh = shape.oh;
    let mut rw = shape.ow;
    if pooled {
        rh = (shape.oh / 2) * 2;
        rw = (shape.ow / 2) * 2;
    }
    let reduction = shape.batch * rh * rw;
    let n0 = CUBE_POS_X as usize * 64;
    let m0 = CUBE_POS_Y as usize * tile_m;
    let z = CUBE_POS_Z as usize;
    let r_begin = z * chunk;
    let mut r_end = r_begin + chunk;
    if r_end > reduction {
        r_end = reduction;
    }
    let units = tile_m * 4;
    let unit = UNIT_POS as usize;
    let (ux, uy) = (UNIT_POS_X as usize, UNIT_POS_Y as usize);
    let dy = tile_m / 4;
    let mut lhs = SharedMemory::<F>::new(tile_m * 16);
    let mut rhs = SharedMemory::<F>::new(1024usize);

    // This unit's column of the B tile: a filter entry (c, tap), or with
    // `swap` an output channel.
    let n = n0 + unit % 64;
    // The bias is summed once, from the tile that holds G: by the first
    // column tile's first unit column (A), or with `swap` by the first row
    // tile's first unit row (B).
    let mut sums_bias = CUBE_POS_X == 0 && ux == 0;
    if swap {
        sums_bias = CUBE_POS_Y == 0 && uy == 0;
    }

    let mut acc = Array::<F>::new(16usize);
    let mut bias_acc = Array::<F>::new(4usize);
    clear::<F>(&mut acc, 16usize);
    clear::<F>(&mut bias_acc, 4usize);
    let mut k0 = r_begin;
    while k0 < r_end {
        stage_weight_grad_tiles::<F, I>(
            grad, saved, indices, x, &mut lhs, &mut rhs, shape, unit, units, m0, n, k0, r_end, rows, cols,
            rh, rw, pooled, swap,
        );
        sync_cube();
        if sums_bias {
            sum_gradient_tile::<F>(&mut bias_acc, &lhs, &rhs, ux, uy, dy, swap);
        }
        multiply_tiles::<F>(&mut acc, &lhs, &rhs, ux, uy, dy, false);
        sync_cube();
        k0 += 16;
    }
    store_weight_partials::<F>(
        &acc, &bias_acc, partials, bias_parts, shape, z, m0, n0, ux, uy, dy, rows, cols, depth, sums_bias,
        swap,
    );
}

/// Stages one step of the weight-gradient product (16 reduction positions
/// from `k0`, short of `r_end`): `a_tile[row][r]`, G of output channel
/// `row` (with `swap`: the input under filter entry `row`), and, in this
/// unit's column `n` of `b_tile`, the input under filter entry `n` (with
/// `swap`: G of output channel `n`). Reduction position `r` is a sample and
/// an output pixel inside the `rh x rw` region that carries a gradient.
#[allow(clippy::too_many_arguments)]
#[cube]
fn stage_weight_grad_tiles<F: Float, I: Int>(
    grad: &Array<F>,
    saved: &Array<F>,
    indices: &Array<I>,
    x: &Array<F>,
    a_tile: &mut SharedMemory<F>,
    b_tile: &mut SharedMemory<F>,
    shape: &ConvShape,
    unit: usize,
    units: usize,
    m0: usize,
    n: usize,
    k0: usize,
    r_end: usize,
    rows: usize,
    cols: usize,
    rh: usize,
    rw: usize,
    #[comptime] pooled: bool,
    #[comptime] swap: bool,
) {
    let taps = comptime![shape.kh * shape.kw];
    let load_col = unit % 64;
    let column_ok = n < cols;
    let c = n / taps;
    let tap = n % taps;
    let (ky, kx) = (tap / shape.kw, tap % shape.kw);
    let rows_per_pass = units / 64;
    // A[row][r]: G of output channel `row` (with `swap`: the input
    // under filter entry `row`) at reduction position r.
    #[unroll]
    for j in 0..4usize {
        let idx = unit + j * units;
        let (m, r) = (m0 + idx / 16, k0 + idx % 16);
        let mut v = F::new(0.0);
        if m < rows && r < r_end {
            let (rb, at) = (r / (rh * rw), r % (rh * rw));
            let (ry, rx) = (at / rw, at % rw);
            if swap {
                let entry_tap = m % taps;
                let (my, mx) = (entry_tap / shape.kw, entry_tap % shape.kw);
                v = input_at::<F>(x, shape, rb, m / taps, ry, rx, my, mx);
            } else {
                let plane = rb * shape.c_out + m;
                v = pre_gradient::<F, I>(grad, saved, indices, shape, plane, ry, rx, pooled);
            }
        }
        a_tile[idx] = v;
    }
    // B[r][col]: the input under filter entry `col` (with `swap`: G of
    // output channel `col`) at reduction position r.
    let mut rr = unit / 64;
    while rr < 16 {
        let r = k0 + rr;
        let mut v = F::new(0.0);
        if column_ok && r < r_end {
            let (rb, at) = (r / (rh * rw), r % (rh * rw));
            let (ry, rx) = (at / rw, at % rw);
            if swap {
                let plane = rb * shape.c_out + n;
                v = pre_gradient::<F, I>(grad, saved, indices, shape, plane, ry, rx, pooled);
            } else {
                v = input_at::<F>(x, shape, rb, c, ry, rx, ky, kx);
            }
        }
        b_tile[rr * 64 + load_col] = v;
        rr += rows_per_pass;
    }
}

/// The weight-gradient kernel's 4x4 register tile of cube `z`'s partial sums
/// (rows `m0 + uy + i dy`, columns `n0 + ux + 16 j` of its product, stored
/// as `partials[z][c_out][depth]` whichever way the product ran) and, where
/// this unit summed them, its 4 bias partials.
#[allow(clippy::too_many_arguments)]
#[cube]
fn store_weight_partials<F: Float>(
    acc: &Array<F>,
    bias_acc: &Array<F>,
    partials: &mut Array<F>,
    bias_partials: &mut Array<F>,
    shape: &ConvShape,
    z: usize,
    m0: usize,
    n0: usize,
    ux: usize,
    uy: usize,
    dy: usize,
    rows: usize,
    cols: usize,
    depth: usize,
    sums_bias: bool,
    #[comptime] swap: bool,
) {
    #[unroll]
    for i in 0..4usize {
        let m = m0 + uy + i * dy;
        #[unroll]
        for j in 0..4usize {
            let col = n0 + ux + 16 * j;
            if m < rows && col < cols {
                let mut at = (z * shape.c_out + m) * depth + col;
                if swap {
                    at = (z * shape.c_out + col) * depth + m;
                }
                partials[at] = acc[i * 4 + j];
            }
        }
    }
    if sums_bias {
        #[unroll]
        for i in 0..4usize {
            let mut channel = m0 + uy + i * dy;
            if swap {
                channel = n0 + ux + 16 * i;
            }
            if channel < shape.c_out {
                bias_partials[z * shape.c_out + channel] = bias_acc[i];
            }
        }
    }
}

/// Adds the staged output gradients to this unit's 4 bias sums: its rows
/// `uy + i dy` of `a_tile` over the 16 staged positions, or with `swap`
/// (the gradient staged in `b_tile`) its columns `ux + 16 i`.
#[cube]
fn sum_gradient_tile<F: Float>(
    bias_acc: &mut Array<F>,
    a_tile: &SharedMemory<F>,
    b_tile: &SharedMemory<F>,
    ux: usize,
    uy: usize,
    dy: usize,
    #[comptime] swap: bool,
) {
    #[unroll]
    for kk in 0..16usize {
        #[unroll]
        for i in 0..4usize {
            if swap {
                bias_acc[i] += b_tile[kk * 64 + ux + 16 * i];
            } else {
                bias_acc[i] += a_tile[(uy + i * dy) * 16 + kk];
            }
        }
    }
}

/// Second stage of the weight and bias gradients: `weight[e] = sum over z
/// of partials[z][e]` for the `len` weights, and the same for the biases.
#[cube(launch)]
fn sum_partials_kernel<F: Float>(
    partials: &Array<F>,
    bias_partials: &Array<F>,
    weight: &mut Array<F>,
    bias: &mut Array<F>,
    len: usize,
    bias_len: usize,
    splits: usize,
    #[comptime] has_bias: bool,
) {
    let e = ABSOLUTE_POS;
    if e < len {
        let mut acc = F::new(0.0);
        for z in 0..splits {
            acc += partials[z * len + e];
        }
        weight[e] = acc;
    }
    if has_bias {
        if e >= len && e < len + bias_len {
            let j = e - len;
            let mut acc = F::new(0.0);
            for z in 0..splits {
                acc += bias_partials[z * bias_len + j];
            }
            bias[j] = acc;
        }
    }
}

/// The splits of a reduction of `len` positions over cubes, and the chunk
/// each sums (a multiple of [`TILE_K`]).
fn splits(len: usize, per_cube: usize, max: usize) -> (usize, usize) {
    let splits = len.div_ceil(per_cube).clamp(1, max);
    let chunk = len.div_ceil(splits).div_ceil(TILE_K) * TILE_K;
    (len.div_ceil(chunk.max(1)).max(1), chunk.max(TILE_K))
}

/// The operands of a convolution's backward kernels, contiguous.
struct BackwardOperands<R: CubeRuntime> {
    g: Geometry,
    x: CubeTensor<R>,
    weight: CubeTensor<R>,
    /// The output gradient (pooled when pooled).
    grad: CubeTensor<R>,
    /// The saved output the activation's derivative is read from.
    saved: CubeTensor<R>,
    /// Where each pooled maximum sat (a placeholder unpooled).
    indices: CubeTensor<R>,
    pooled: bool,
    /// The activation the forward applied.
    epilogue: Epilogue,
}

/// Every gradient of a fused convolution layer (see
/// [`crate::FusedBackend::conv2d_layer_backward`]) our kernels take ([`super::geometry::takes`]).
pub(crate) fn conv_backward<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    inputs: &ConvBackwardInputs<Cube<R, F, I, BT>>,
    x_grad: bool,
    bias_grad: bool,
) -> ConvGrads<Cube<R, F, I, BT>> {
    let x = into_contiguous(inputs.x.clone());
    let indices = match &inputs.pool_indices {
        Some(indices) => into_contiguous(indices.clone()),
        None => new_indices::<R, I>(&x, Shape::from(vec![1])),
    };
    let operands = BackwardOperands {
        g: Geometry::of(&inputs.x, &inputs.weight, &inputs.options)
            .expect("the caller checked that the kernels take this convolution"),
        x,
        weight: into_contiguous(inputs.weight.clone()),
        grad: into_contiguous(inputs.output_grad.clone()),
        saved: into_contiguous(inputs.output.clone()),
        indices,
        pooled: inputs.pool_indices.is_some(),
        epilogue: inputs.epilogue,
    };
    let dx = x_grad.then(|| input_grad::<R, F, I, BT>(&operands));
    let (weight, bias) = weight_grads::<R, F, I, BT>(operands, bias_grad);
    ConvGrads { x: dx, weight, bias }
}

/// The input gradient: one kernel.
fn input_grad<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    operands: &BackwardOperands<R>,
) -> CubeTensor<R> {
    let BackwardOperands { g, x, weight, grad, saved, indices, pooled, epilogue } = operands;
    let (g, pooled, epilogue, client) = (*g, *pooled, *epilogue, x.client.clone());
    let dx = new_output::<R, F, I, BT>(&x, x.meta.shape().clone());
    if g.depthwise {
        depthwise::input_grad::<R, F, I>(&client, &g, (grad, saved, indices, weight), &dx, epilogue);
    } else {
        let tile_m = tile_rows(g.c_in);
        // SAFETY: loads are guarded by the operands' sizes (c < c_in,
        // k < c_out * taps, output pixels inside the output, windows
        // inside the pooled output) and stores by dx's.
        unsafe {
            conv_input_grad_kernel::launch_unchecked::<F, I, R>(
                &client,
                matrix_grid(g.batch * g.h * g.w, g.c_in, tile_m),
                CubeDim::new_2d(16, (tile_m / 4) as u32),
                grad.clone().into_array_arg(),
                saved.clone().into_array_arg(),
                indices.clone().into_array_arg(),
                weight.clone().into_array_arg(),
                dx.clone().into_array_arg(),
                g.shape::<R>(epilogue),
                tile_m,
                pooled,
            );
        }
    }
    dx
}

/// Launches the first stage of the weight and bias gradients: `count`
/// cubes along the reduction, each summing `chunk` positions into its rows
/// of `partials` and `bias_partials` (depthwise: the direct kernel; dense:
/// the register-tiled product, transposed when the filter has fewer entries
/// than output channels).
fn launch_weight_grad_partials<R: CubeRuntime, F: FloatElement, I: IntElement>(
    g: &Geometry,
    (grad, saved, indices, x): (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>, &CubeTensor<R>),
    (partials, bias_partials): (&CubeTensor<R>, &CubeTensor<R>),
    (count, chunk): (usize, usize),
    epilogue: Epilogue,
    pooled: bool,
) {
    let client = x.client.clone();
    if g.depthwise {
        depthwise::weight_grad_partials::<R, F, I>(
            &client,
            g,
            (grad, saved, indices, x),
            (partials, bias_partials),
            (count, chunk),
            epilogue,
        );
    } else {
        let depth = g.c_in * g.taps();
        // The longer side along the tile's 64 columns.
        let swap = depth < g.c_out;
        let (rows, cols) = if swap { (depth, g.c_out) } else { (g.c_out, depth) };
        let tile_m = tile_rows(rows);
        // SAFETY: loads are guarded by the operands' sizes (rows < c_out,
        // positions < the chunk's end, pixels inside the padded input) and
        // stores by the partial buffers' (count x c_out x depth, count x c_out).
        unsafe {
            conv_weight_grad_kernel::launch_unchecked::<F, I, R>(
                &client,
                CubeCount::Static(cols.div_ceil(TILE_N) as u32, rows.div_ceil(tile_m) as u32, count as u32),
                CubeDim::new_2d(16, (tile_m / 4) as u32),
                grad.into_array_arg(),
                saved.into_array_arg(),
                indices.into_array_arg(),
                x.clone().into_array_arg(),
                partials.clone().into_array_arg(),
                bias_partials.clone().into_array_arg(),
                g.shape::<R>(epilogue),
                chunk,
                tile_m,
                pooled,
                swap,
            );
        }
    }
}

/// The weight gradient and, with `bias_grad`, the bias gradient: partial
/// sums over chunks of the batch and pixels, then their sum (two kernels).
fn weight_grads<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    operands: BackwardOperands<R>,
    bias_grad: bool,
) -> (CubeTensor<R>, Option<CubeTensor<R>>) {
    let BackwardOperands { g, x, weight, grad, saved, indices, pooled, epilogue } = operands;
    let client = x.client.clone();
    // Weight (and bias) gradients: partial sums, then their sum.
    let (rh, rw) = if pooled { (g.oh / 2 * 2, g.ow / 2 * 2) } else { (g.oh, g.ow) };
    let reduction = g.batch * rh * rw;
    let weights = g.c_out * if g.depthwise { g.taps() } else { g.c_in * g.taps() };
    // At most 16M partial sums (64 MB in f32).
    let most = ((1usize << 24) / weights.max(1)).max(1);
    let (count, chunk) = if g.depthwise {
        splits(reduction, 4096, most.min(64))
    } else {
        splits(reduction, 2048, most.min(256))
    };
    let partials = new_output::<R, F, I, BT>(&x, Shape::from(vec![count * weights]));
    let bias_partials = new_output::<R, F, I, BT>(&x, Shape::from(vec![count * g.c_out]));
    launch_weight_grad_partials::<R, F, I>(
        &g,
        (grad, saved, indices, &x),
        (&partials, &bias_partials),
        (count, chunk),
        epilogue,
        pooled,
    );
    let weight_grad = new_output::<R, F, I, BT>(&x, weight.meta.shape().clone());
    let bias = bias_grad.then(|| new_output::<R, F, I, BT>(&x, Shape::from(vec![g.c_out])));
    let bias_out = bias.clone().unwrap_or_else(|| placeholder::<R, F, I, BT>(&x));
    let total = weights + if bias_grad { g.c_out } else { 0 };
    sum_partials_kernel::launch::<F, R>(
        &client,
        elementwise_grid(total),
        CubeDim::new_1d(UNITS),
        partials.into_array_arg(),
        bias_partials.into_array_arg(),
        weight_grad.clone().into_array_arg(),
        bias_out.into_array_arg(),
        weights,
        g.c_out,
        count,
        bias_grad,
    );
    (weight_grad, bias)
}

/// The input (when `x_grad`) and weight gradients of a convolution, pooled
/// when `indices` is set, from the gradient of its output before any
/// activation, for a convolution our kernels take ([`super::geometry::takes`]).
pub(crate) fn plain_backward<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    x: CubeTensor<R>,
    weight: CubeTensor<R>,
    grad: CubeTensor<R>,
    indices: Option<CubeTensor<R>>,
    options: ConvOptions<2>,
    x_grad: bool,
) -> (Option<CubeTensor<R>>, CubeTensor<R>) {
    // The identity's derivative is 1: the saved output (the gradient itself here) only fills the slot.
    let inputs = ConvBackwardInputs {
        output: grad.clone(),
        output_grad: grad,
        x,
        weight,
        epilogue: Epilogue::Identity,
        pool_indices: indices,
        options,
    };
    let grads = conv_backward::<R, F, I, BT>(&inputs, x_grad, false);
    (grads.x, grads.weight)
}
