//! Convolutions on CubeCL backends, in burn's NCHW layout (no transposes
//! to NHWC and back); the 2x2 max-pool is in `pool.rs`.
//!
//! Dense convolutions (no groups) are implicit matrix products: a cube owns
//! a `TM x 64` tile of the output matrix and walks the reduction in steps of
//! 16, staging a `TM x 16` tile of one operand and a `16 x 64` tile of the
//! other in shared memory, where the convolution's im2col columns are
//! gathered (they never exist in global memory); each of its `4 TM` units
//! keeps a 4x4 block of the tile in registers.
//! - forward: `act(W [c_out, c_in kh kw] @ cols(x) + bias)`; pooled, a unit's
//!   four columns are one 2x2 window, so it writes the window's maximum and
//!   where it came from (the full-resolution output is never stored);
//! - input gradient: `W^T @ cols(G)`, where `G` is the pre-activation
//!   gradient, made on the fly from the output gradient and the saved
//!   output (the activation's derivative) and, pooled, routed to each
//!   window's maximum by the saved indices;
//! - weight and bias gradients: `G @ cols(x)^T`, the long reduction over
//!   batch and pixels split over cubes (partial sums), then one small
//!   kernel adds the partials.
//!
//! Depthwise convolutions (one input channel per filter) are direct: one
//! unit per output or input element; their weight gradient reduces per
//! filter tap in shared memory, then through the same partial sums.
//!
//! This module holds the dense forward kernels and the forward launches;
//! the gradients are in `conv_grad.rs`, the depthwise kernels in
//! `depthwise.rs`, the max-pool in `pool.rs`, and the launch geometry, the
//! sizes every convolution kernel takes (`ConvShape`) and the index
//! arithmetic they share in `geometry.rs`.

use burn::tensor::ops::ConvOptions;
use burn::tensor::Shape;
use burn_cubecl::element::BoolElement;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::*;

use super::common::{activate, clamp_index, new_indices, new_output, outer_product_add, placeholder, Cube};
use super::depthwise;
use super::geometry::{
    clear, column_tile, input_at, inside_input, matrix_grid, multiply_tiles, tile_rows, ConvShape, Geometry,
};
use crate::{ConvVariant, Epilogue};

/// Dense forward: `out = act(W @ cols(x) + bias)`, pooled or not (see the
/// module docs), with the sizes and activation of `shape`. `w` is `[c_out,
/// c_in * kh * kw]`, `x` `[batch, c_in, h, wd]`; unpooled `out` is `[batch,
/// c_out, oh, ow]`, pooled `out` and `indices` are `[batch, c_out, oh / 2,
/// ow / 2]`.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
fn conv_forward_kernel<F: Float, I: Int>(
    x: &Array<F>,
    w: &Array<F>,
    bias: &Array<F>,
    out: &mut Array<F>,
    indices: &mut Array<I>,
    shape: &ConvShape,
    #[comptime] tile_m: usize,
    #[comptime] has_bias: bool,
    #[comptime] pooled: bool,
) {
    let taps = comptime![shape.kh * shape.kw];
    let depth = shape.c_in * taps;
    let (ph, pw) = (shape.oh / 2, shape.ow / 2);
    let mut columns = shape.batch * shape.oh * shape.ow;
    if pooled {
        columns = shape.batch * ph * pw * 4;
    }
    let n0 = column_tile() * 64;
    let m0 = CUBE_POS_Y as usize * tile_m;
    if n0 < columns {
        let units = tile_m * 4;
        let unit = UNIT_POS as usize;
        let (ux, uy) = (UNIT_POS_X as usize, UNIT_POS_Y as usize);
        let dy = tile_m / 4;
        let mut a_tile = SharedMemory::<F>::new(tile_m * 16);
        let mut b_tile = SharedMemory::<F>::new(1024usize);

        // This unit's column of the im2col tile: its output pixel.
        let load_col = unit % 64;
        let n = n0 + load_col;
        let mut b = n / (shape.oh * shape.ow);
        let mut oy = (n % (shape.oh * shape.ow)) / shape.ow;
        let mut ox = n % shape.ow;
        if pooled {
            let window = n / 4;
            let quad = n % 4;
            let at = window % (ph * pw);
            b = window / (ph * pw);
            oy = (at / pw) * 2 + quad / 2;
            ox = (at % pw) * 2 + quad % 2;
        }
        let column_ok = n < columns;
        let rows_per_pass = units / 64;

        let mut acc = Array::<F>::new(16usize);
        clear::<F>(&mut acc, 16usize);
        let mut k0 = 0usize.runtime();
        while k0 < depth {
            // Weights: each unit stages 4 of the tile_m x 16 values.
            #[unroll]
            for j in 0..4usize {
                let idx = unit + j * units;
                let (m, k) = (m0 + idx / 16, k0 + idx % 16);
                let mut v = F::new(0.0);
                if m < shape.c_out && k < depth {
                    v = w[m * depth + k];
                }
                a_tile[idx] = v;
            }
            // im2col: this unit's column, rows `unit / 64 + r * rows_per_pass`.
            let mut r = unit / 64;
            while r < 16 {
                let k = k0 + r;
                let mut v = F::new(0.0);
                if column_ok && k < depth {
                    let tap = k % taps;
                    let (c, ky, kx) = (k / taps, tap / shape.kw, tap % shape.kw);
                    v = input_at::<F>(x, shape, b, c, oy, ox, ky, kx);
                }
                b_tile[r * 64 + load_col] = v;
                r += rows_per_pass;
            }
            sync_cube();
            multiply_tiles::<F>(&mut acc, &a_tile, &b_tile, ux, uy, dy, pooled);
            sync_cube();
            k0 += 16;
        }

        store_tile::<F, I>(&acc, bias, out, indices, shape, n0, m0, ux, uy, dy, columns, has_bias, pooled);
    }
}

/// A forward kernel's 4x4 register tile (rows `m0 + uy + i dy`; columns
/// `n0 + ux + 16 j`, or pooled the window `n0 / 4 + ux`) with its bias and
/// `shape`'s activation: stored, or pooled the window's maximum and where
/// it sat.
#[allow(clippy::too_many_arguments)]
#[cube]
fn store_tile<F: Float, I: Int>(
    acc: &Array<F>,
    bias: &Array<F>,
    out: &mut Array<F>,
    indices: &mut Array<I>,
    shape: &ConvShape,
    n0: usize,
    m0: usize,
    ux: usize,
    uy: usize,
    #[comptime] dy: usize,
    columns: usize,
    #[comptime] has_bias: bool,
    #[comptime] pooled: bool,
) {
    let (ph, pw) = (shape.oh / 2, shape.ow / 2);
    if pooled {
        // The unit's 4 columns are one window, in window order.
        let window = (n0 + 4 * ux) / 4;
        if window < shape.batch * ph * pw {
            let wb = window / (ph * pw);
            let at = window % (ph * pw);
            let (py, px) = (at / pw, at % pw);
            #[unroll]
            for i in 0..4usize {
                let m = m0 + uy + i * dy;
                if m < shape.c_out {
                    let mut shift = F::new(0.0);
                    if has_bias {
                        shift = bias[m];
                    }
                    let mut best = activate::<F>(acc[i * 4] + shift, shape.epilogue);
                    let mut best_at = 0usize.runtime();
                    #[unroll]
                    for q in 1..4usize {
                        let v = activate::<F>(acc[i * 4 + q] + shift, shape.epilogue);
                        if v > best {
                            best = v;
                            best_at = q;
                        }
                    }
                    let slot = (wb * shape.c_out + m) * ph * pw + at;
                    out[slot] = best;
                    indices[slot] = I::cast_from((2 * py + best_at / 2) * shape.ow + 2 * px + best_at % 2);
                }
            }
        }
    } else {
        #[unroll]
        for j in 0..4usize {
            let col = n0 + ux + 16 * j;
            if col < columns {
                let cb = col / (shape.oh * shape.ow);
                let at = col % (shape.oh * shape.ow);
                #[unroll]
                for i in 0..4usize {
                    let m = m0 + uy + i * dy;
                    if m < shape.c_out {
                        let mut v = acc[i * 4 + j];
                        if has_bias {
                            v += bias[m];
                        }
                        out[(cb * shape.c_out + m) * shape.oh * shape.ow + at] =
                            activate::<F>(v, shape.epilogue);
                    }
                }
            }
        }
    }
}

/// Where output column `col` reads its input: the offset of its sample's
/// first channel, its window's top row and left column in the padded input
/// (before the tap), and whether the column exists. Pooled, columns come
/// in fours: one 2x2 window's positions in window order.
#[cube]
fn column_origin(
    shape: &ConvShape,
    col: usize,
    columns: usize,
    #[comptime] pooled: bool,
) -> (usize, usize, usize, bool) {
    let mut b = col / (shape.oh * shape.ow);
    let mut oy = (col % (shape.oh * shape.ow)) / shape.ow;
    let mut ox = col % shape.ow;
    if pooled {
        let (ph, pw) = (shape.oh / 2, shape.ow / 2);
        let window = col / 4;
        let quad = col % 4;
        let at = window % (ph * pw);
        b = window / (ph * pw);
        oy = (at / pw) * 2 + quad / 2;
        ox = (at % pw) * 2 + quad % 2;
    }
    (b * shape.c_in * shape.h * shape.wd, oy * shape.sy, ox * shape.sx, col < columns)
}

/// The input value a column reads at one tap (zero in the padding).
#[cube]
fn tap_offset(
    shape: &ConvShape,
    origin: (usize, usize, usize, bool),
    #[comptime] ky: usize,
    #[comptime] kx: usize,
) -> (usize, bool) {
    let (base, y0, x0, valid) = origin;
    let yy = y0 + ky;
    let xx = x0 + kx;
    let ok = valid && inside_input(shape, yy, xx);
    (select(ok, base + (yy - shape.pad_y) * shape.wd + xx - shape.pad_x, 0usize), ok)
}

/// Dense forward without shared memory or barriers (the other variant of
/// [`conv_forward_kernel`], same arguments and output): each unit keeps 4
/// output channels x 4 columns in registers and walks the filter taps
/// (unrolled) and, innermost, the input channels, so that each step of the
/// walk is 8 loads and 16 multiply-adds with no index arithmetic. CPU
/// Vulkan drivers pay dearly for barriers; GPUs may prefer either.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
fn conv_forward_direct_kernel<F: Float, I: Int>(
    x: &Array<F>,
    w: &Array<F>,
    bias: &Array<F>,
    out: &mut Array<F>,
    indices: &mut Array<I>,
    shape: &ConvShape,
    #[comptime] tile_m: usize,
    #[comptime] has_bias: bool,
    #[comptime] pooled: bool,
) {
    let taps = comptime![shape.kh * shape.kw];
    let depth = shape.c_in * taps;
    let plane = shape.h * shape.wd;
    let (ph, pw) = (shape.oh / 2, shape.ow / 2);
    let mut columns = shape.batch * shape.oh * shape.ow;
    if pooled {
        columns = shape.batch * ph * pw * 4;
    }
    let n0 = column_tile() * 64;
    let m0 = CUBE_POS_Y as usize * tile_m;
    if n0 < columns {
        let (ux, uy) = (UNIT_POS_X as usize, UNIT_POS_Y as usize);
        let dy = tile_m / 4;
        // Columns n0 + ux + 16 j (neighbouring units read neighbouring
        // pixels), or pooled the window n0 / 4 + ux.
        let mut c0 = n0 + ux;
        let mut step = 16usize.runtime();
        if pooled {
            c0 = n0 + 4 * ux;
            step = 1usize.runtime();
        }
        let o0 = column_origin(shape, c0, columns, pooled);
        let o1 = column_origin(shape, c0 + step, columns, pooled);
        let o2 = column_origin(shape, c0 + 2 * step, columns, pooled);
        let o3 = column_origin(shape, c0 + 3 * step, columns, pooled);
        // Rows past c_out read the last filter (never stored).
        let r0 = clamp_index(m0 + uy, shape.c_out) * depth;
        let r1 = clamp_index(m0 + uy + dy, shape.c_out) * depth;
        let r2 = clamp_index(m0 + uy + 2 * dy, shape.c_out) * depth;
        let r3 = clamp_index(m0 + uy + 3 * dy, shape.c_out) * depth;
        let mut acc = Array::<F>::new(16usize);
        clear::<F>(&mut acc, 16usize);
        let zero = F::new(0.0);
        #[unroll]
        for ky in 0..shape.kh {
            #[unroll]
            for kx in 0..shape.kw {
                let (p0, ok0) = tap_offset(shape, o0, ky, kx);
                let (p1, ok1) = tap_offset(shape, o1, ky, kx);
                let (p2, ok2) = tap_offset(shape, o2, ky, kx);
                let (p3, ok3) = tap_offset(shape, o3, ky, kx);
                let tap = comptime![ky * shape.kw + kx];
                for c in 0..shape.c_in {
                    let at = c * plane;
                    let k = c * taps + tap;
                    let a0 = w[r0 + k];
                    let a1 = w[r1 + k];
                    let a2 = w[r2 + k];
                    let a3 = w[r3 + k];
                    let b0 = select(ok0, x[p0 + at], zero);
                    let b1 = select(ok1, x[p1 + at], zero);
                    let b2 = select(ok2, x[p2 + at], zero);
                    let b3 = select(ok3, x[p3 + at], zero);
                    outer_product_add::<F>(&mut acc, a0, a1, a2, a3, b0, b1, b2, b3);
                }
            }
        }
        store_tile::<F, I>(&acc, bias, out, indices, shape, n0, m0, ux, uy, dy, columns, has_bias, pooled);
    }
}

/// `act(conv(x) + bias)`, pooled or not, for a convolution our kernels take
/// ([`super::geometry::takes`]): the output and, pooled, where each maximum sat.
pub(crate) fn conv_forward<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    x: CubeTensor<R>,
    weight: CubeTensor<R>,
    bias: Option<CubeTensor<R>>,
    options: &ConvOptions<2>,
    epilogue: Epilogue,
    pooled: bool,
) -> (CubeTensor<R>, Option<CubeTensor<R>>) {
    let g = Geometry::of(&x, &weight, options)
        .expect("the caller checked that the kernels take this convolution");
    let (x, weight) = (into_contiguous(x), into_contiguous(weight));
    let has_bias = bias.is_some();
    let bias = bias.map(into_contiguous).unwrap_or_else(|| placeholder::<R, F, I, BT>(&x));
    let client = x.client.clone();
    if g.depthwise {
        let out = new_output::<R, F, I, BT>(&x, Shape::from(vec![g.batch, g.c_out, g.oh, g.ow]));
        depthwise::forward::<R, F>(&client, &g, (x, weight, bias), &out, has_bias, epilogue);
        return (out, None);
    }
    let (out, indices, columns) = if pooled {
        let shape = Shape::from(vec![g.batch, g.c_out, g.oh / 2, g.ow / 2]);
        let out = new_output::<R, F, I, BT>(&x, shape.clone());
        (out, new_indices::<R, I>(&x, shape), g.batch * (g.oh / 2) * (g.ow / 2) * 4)
    } else {
        let out = new_output::<R, F, I, BT>(&x, Shape::from(vec![g.batch, g.c_out, g.oh, g.ow]));
        (out, new_indices::<R, I>(&x, Shape::from(vec![1])), g.batch * g.oh * g.ow)
    };
    if columns == 0 {
        return (out, pooled.then_some(indices));
    }
    let call = ForwardCall {
        x,
        weight,
        bias,
        out: out.clone(),
        indices: indices.clone(),
        g,
        columns,
        has_bias,
        epilogue,
        pooled,
    };
    match choose_forward::<R, F, I, BT>(&call) {
        ConvVariant::Direct => forward_direct::<R, F, I, BT>(call),
        _ => forward_tiled::<R, F, I, BT>(call),
    }
    (out, pooled.then_some(indices))
}

/// The arguments of one dense forward launch.
#[derive(Clone)]
struct ForwardCall<R: CubeRuntime> {
    x: CubeTensor<R>,
    weight: CubeTensor<R>,
    bias: CubeTensor<R>,
    out: CubeTensor<R>,
    indices: CubeTensor<R>,
    g: Geometry,
    columns: usize,
    has_bias: bool,
    epilogue: Epilogue,
    pooled: bool,
}

/// The variant in force, or the faster one for this call's shapes on this
/// device ([`super::tuning::faster`]).
fn choose_forward<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    call: &ForwardCall<R>,
) -> ConvVariant {
    let forced = crate::conv_variant();
    if forced != ConvVariant::Auto {
        return forced;
    }
    let key = format!(
        "conv {:?} {:?} {:?} {} {:?} {}",
        call.x.device, call.g, call.has_bias, call.columns, call.epilogue, call.pooled
    );
    let timed = |variant: ConvVariant| {
        move || {
            match variant {
                ConvVariant::Direct => forward_direct::<R, F, I, BT>(call.clone()),
                _ => forward_tiled::<R, F, I, BT>(call.clone()),
            }
            let _ = <Cube<R, F, I, BT> as burn::tensor::backend::Backend>::sync(&call.x.device);
        }
    };
    let (tiled, direct) = (timed(ConvVariant::Tiled), timed(ConvVariant::Direct));
    match super::tuning::faster(key, [("tiled", &tiled), ("direct", &direct)]) {
        "direct" => ConvVariant::Direct,
        _ => ConvVariant::Tiled,
    }
}

/// Rows of a direct kernel's cube: `c_out` rounded up to a power of two
/// from 4 to 64 (4 rows per unit row).
fn direct_rows(rows: usize) -> usize {
    rows.next_power_of_two().clamp(4, 64)
}

fn forward_direct<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(call: ForwardCall<R>) {
    let ForwardCall { x, weight, bias, out, indices, g, columns, has_bias, epilogue, pooled } = call;
    let tile_m = direct_rows(g.c_out);
    let client = x.client.clone();
    // SAFETY: filter rows are read clamped to c_out and input pixels only
    // inside the input (a padding tap reads offset 0 and discards it);
    // stores are guarded by the output's rows and columns.
    unsafe {
        conv_forward_direct_kernel::launch_unchecked::<F, I, R>(
            &client,
            matrix_grid(columns, g.c_out, tile_m),
            CubeDim::new_2d(16, (tile_m / 4) as u32),
            x.into_array_arg(),
            weight.into_array_arg(),
            bias.into_array_arg(),
            out.into_array_arg(),
            indices.into_array_arg(),
            g.shape::<R>(epilogue),
            tile_m,
            has_bias,
            pooled,
        );
    }
}

fn forward_tiled<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(call: ForwardCall<R>) {
    let ForwardCall { x, weight, bias, out, indices, g, columns, has_bias, epilogue, pooled } = call;
    let client = x.client.clone();
    let tile_m = tile_rows(g.c_out);
    // SAFETY: every load is guarded by the operands' sizes (rows < c_out,
    // k < c_in * taps, pixels inside the padded input) and every store by
    // the output's (rows < c_out, columns < batch x pixels or windows).
    unsafe {
        conv_forward_kernel::launch_unchecked::<F, I, R>(
            &client,
            matrix_grid(columns, g.c_out, tile_m),
            CubeDim::new_2d(16, (tile_m / 4) as u32),
            x.into_array_arg(),
            weight.into_array_arg(),
            bias.into_array_arg(),
            out.into_array_arg(),
            indices.into_array_arg(),
            g.shape::<R>(epilogue),
            tile_m,
            has_bias,
            pooled,
        );
    }
}
