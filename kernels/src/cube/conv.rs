//! Convolutions and the 2x2 max-pool on CubeCL backends, in burn's NCHW
//! layout (no transposes to NHWC and back).
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

use burn::tensor::ops::ConvOptions;
use burn::tensor::Shape;
use burn_cubecl::element::BoolElement;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::*;

use super::{activate, clamp_index, epilogue_code, new_output, outer_product_add};
use crate::{ConvBackwardInputs, ConvGrads, ConvVariant, Epilogue};

/// Columns of the output tile of a cube (units along x: 16, 4 columns each).
const TILE_N: usize = 64;
/// Reduction step staged in shared memory.
const TILE_K: usize = 16;
/// Most cubes along one grid axis.
const MAX_GRID: usize = 65_535;
/// Units per cube of the direct kernels.
const UNITS: u32 = 256;

/// The activation's derivative at the saved output `s` (epilogue codes as
/// [`epilogue_code`]; gelu never reaches these kernels).
#[cube]
fn keeps_gradient<F: Float>(s: F, #[comptime] epilogue: u32) -> F {
    let mut keep = F::new(1.0);
    if epilogue == 1 {
        if s <= F::new(0.0) {
            keep = F::new(0.0);
        }
    }
    if epilogue == 2 {
        if s <= F::new(0.0) || s >= F::new(6.0) {
            keep = F::new(0.0);
        }
    }
    keep
}

/// The pre-activation gradient at full-resolution output `(b, c, oy, ox)`.
/// Unpooled: `grad * act'(saved)` there. Pooled (`grad`, `saved` and
/// `indices` at half resolution `ph x pw`): that of the window, where the
/// window's maximum sat, else zero.
#[allow(clippy::too_many_arguments)]
#[cube]
fn pre_gradient<F: Float, I: Int>(
    grad: &Array<F>,
    saved: &Array<F>,
    indices: &Array<I>,
    plane: usize,
    oy: usize,
    ox: usize,
    oh: usize,
    ow: usize,
    #[comptime] epilogue: u32,
    #[comptime] pooled: bool,
) -> F {
    let mut g = F::new(0.0);
    if pooled {
        let (ph, pw) = (oh / 2, ow / 2);
        if oy < 2 * ph && ox < 2 * pw {
            let at = (plane * ph + oy / 2) * pw + ox / 2;
            if u32::cast_from(indices[at]) as usize == oy * ow + ox {
                g = grad[at] * keeps_gradient::<F>(saved[at], epilogue);
            }
        }
    } else {
        let at = (plane * oh + oy) * ow + ox;
        g = grad[at] * keeps_gradient::<F>(saved[at], epilogue);
    }
    g
}

/// The output tile this cube owns along the columns (grids longer than
/// [`MAX_GRID`] fold into the z axis).
#[cube]
fn column_tile() -> usize {
    CUBE_POS_Z as usize * CUBE_COUNT_X as usize + CUBE_POS_X as usize
}

/// Dense forward: `out = act(W @ cols(x) + bias)`, pooled or not (see the
/// module docs). `w` is `[c_out, c_in * kh * kw]`, `x` `[batch, c_in, h,
/// w]`; unpooled `out` is `[batch, c_out, oh, ow]`, pooled `out` and
/// `indices` are `[batch, c_out, oh / 2, ow / 2]`.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
fn conv_forward_kernel<F: Float, I: Int>(
    x: &Array<F>,
    w: &Array<F>,
    bias: &Array<F>,
    out: &mut Array<F>,
    indices: &mut Array<I>,
    batch: usize,
    c_in: usize,
    h: usize,
    wd: usize,
    c_out: usize,
    oh: usize,
    ow: usize,
    #[comptime] kh: usize,
    #[comptime] kw: usize,
    #[comptime] sy: usize,
    #[comptime] sx: usize,
    #[comptime] pad_y: usize,
    #[comptime] pad_x: usize,
    #[comptime] tile_m: usize,
    #[comptime] has_bias: bool,
    #[comptime] epilogue: u32,
    #[comptime] pooled: bool,
) {
    let taps = kh * kw;
    let depth = c_in * taps;
    let (ph, pw) = (oh / 2, ow / 2);
    let mut columns = batch * oh * ow;
    if pooled {
        columns = batch * ph * pw * 4;
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
        let mut b = n / (oh * ow);
        let mut oy = (n % (oh * ow)) / ow;
        let mut ox = n % ow;
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
                if m < c_out && k < depth {
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
                    let (c, ky, kx) = (k / taps, tap / kw, tap % kw);
                    v = input_at::<F>(x, b, c, oy, ox, ky, kx, c_in, h, wd, sy, sx, pad_y, pad_x);
                }
                b_tile[r * 64 + load_col] = v;
                r += rows_per_pass;
            }
            sync_cube();
            multiply_tiles::<F>(&mut acc, &a_tile, &b_tile, ux, uy, dy, pooled);
            sync_cube();
            k0 += 16;
        }

        store_tile::<F, I>(
            &acc, bias, out, indices, n0, m0, ux, uy, dy, batch, c_out, oh, ow, columns, has_bias, epilogue,
            pooled,
        );
    }
}

/// A forward kernel's 4x4 register tile (rows `m0 + uy + i dy`; columns
/// `n0 + ux + 16 j`, or pooled the window `n0 / 4 + ux`) with its bias and
/// activation: stored, or pooled the window's maximum and where it sat.
#[allow(clippy::too_many_arguments)]
#[cube]
fn store_tile<F: Float, I: Int>(
    acc: &Array<F>,
    bias: &Array<F>,
    out: &mut Array<F>,
    indices: &mut Array<I>,
    n0: usize,
    m0: usize,
    ux: usize,
    uy: usize,
    #[comptime] dy: usize,
    batch: usize,
    c_out: usize,
    oh: usize,
    ow: usize,
    columns: usize,
    #[comptime] has_bias: bool,
    #[comptime] epilogue: u32,
    #[comptime] pooled: bool,
) {
    let (ph, pw) = (oh / 2, ow / 2);
    if pooled {
        // The unit's 4 columns are one window, in window order.
        let window = (n0 + 4 * ux) / 4;
        if window < batch * ph * pw {
            let wb = window / (ph * pw);
            let at = window % (ph * pw);
            let (py, px) = (at / pw, at % pw);
            #[unroll]
            for i in 0..4usize {
                let m = m0 + uy + i * dy;
                if m < c_out {
                    let mut shift = F::new(0.0);
                    if has_bias {
                        shift = bias[m];
                    }
                    let mut best = activate::<F>(acc[i * 4] + shift, epilogue);
                    let mut best_at = 0usize.runtime();
                    #[unroll]
                    for q in 1..4usize {
                        let v = activate::<F>(acc[i * 4 + q] + shift, epilogue);
                        if v > best {
                            best = v;
                            best_at = q;
                        }
                    }
                    let slot = (wb * c_out + m) * ph * pw + at;
                    out[slot] = best;
                    indices[slot] = I::cast_from((2 * py + best_at / 2) * ow + 2 * px + best_at % 2);
                }
            }
        }
    } else {
        #[unroll]
        for j in 0..4usize {
            let col = n0 + ux + 16 * j;
            if col < columns {
                let cb = col / (oh * ow);
                let at = col % (oh * ow);
                #[unroll]
                for i in 0..4usize {
                    let m = m0 + uy + i * dy;
                    if m < c_out {
                        let mut v = acc[i * 4 + j];
                        if has_bias {
                            v += bias[m];
                        }
                        out[(cb * c_out + m) * oh * ow + at] = activate::<F>(v, epilogue);
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
#[allow(clippy::too_many_arguments)]
#[cube]
fn column_origin(
    col: usize,
    columns: usize,
    c_in: usize,
    h: usize,
    wd: usize,
    oh: usize,
    ow: usize,
    #[comptime] sy: usize,
    #[comptime] sx: usize,
    #[comptime] pooled: bool,
) -> (usize, usize, usize, bool) {
    let mut b = col / (oh * ow);
    let mut oy = (col % (oh * ow)) / ow;
    let mut ox = col % ow;
    if pooled {
        let (ph, pw) = (oh / 2, ow / 2);
        let window = col / 4;
        let quad = col % 4;
        let at = window % (ph * pw);
        b = window / (ph * pw);
        oy = (at / pw) * 2 + quad / 2;
        ox = (at % pw) * 2 + quad % 2;
    }
    (b * c_in * h * wd, oy * sy, ox * sx, col < columns)
}

/// The input value a column reads at one tap (zero in the padding).
#[allow(clippy::too_many_arguments)]
#[cube]
fn tap_offset(
    origin: (usize, usize, usize, bool),
    #[comptime] ky: usize,
    #[comptime] kx: usize,
    h: usize,
    wd: usize,
    #[comptime] pad_y: usize,
    #[comptime] pad_x: usize,
) -> (usize, bool) {
    let (base, y0, x0, valid) = origin;
    let yy = y0 + ky;
    let xx = x0 + kx;
    let ok = valid && yy >= pad_y && yy < h + pad_y && xx >= pad_x && xx < wd + pad_x;
    (select(ok, base + (yy - pad_y) * wd + xx - pad_x, 0usize), ok)
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
    batch: usize,
    c_in: usize,
    h: usize,
    wd: usize,
    c_out: usize,
    oh: usize,
    ow: usize,
    #[comptime] kh: usize,
    #[comptime] kw: usize,
    #[comptime] sy: usize,
    #[comptime] sx: usize,
    #[comptime] pad_y: usize,
    #[comptime] pad_x: usize,
    #[comptime] tile_m: usize,
    #[comptime] has_bias: bool,
    #[comptime] epilogue: u32,
    #[comptime] pooled: bool,
) {
    let taps = kh * kw;
    let depth = c_in * taps;
    let plane = h * wd;
    let (ph, pw) = (oh / 2, ow / 2);
    let mut columns = batch * oh * ow;
    if pooled {
        columns = batch * ph * pw * 4;
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
        let o0 = column_origin(c0, columns, c_in, h, wd, oh, ow, sy, sx, pooled);
        let o1 = column_origin(c0 + step, columns, c_in, h, wd, oh, ow, sy, sx, pooled);
        let o2 = column_origin(c0 + 2 * step, columns, c_in, h, wd, oh, ow, sy, sx, pooled);
        let o3 = column_origin(c0 + 3 * step, columns, c_in, h, wd, oh, ow, sy, sx, pooled);
        // Rows past c_out read the last filter (never stored).
        let r0 = clamp_index(m0 + uy, c_out) * depth;
        let r1 = clamp_index(m0 + uy + dy, c_out) * depth;
        let r2 = clamp_index(m0 + uy + 2 * dy, c_out) * depth;
        let r3 = clamp_index(m0 + uy + 3 * dy, c_out) * depth;
        let mut acc = Array::<F>::new(16usize);
        clear::<F>(&mut acc, 16usize);
        let zero = F::new(0.0);
        #[unroll]
        for ky in 0..kh {
            #[unroll]
            for kx in 0..kw {
                let (p0, ok0) = tap_offset(o0, ky, kx, h, wd, pad_y, pad_x);
                let (p1, ok1) = tap_offset(o1, ky, kx, h, wd, pad_y, pad_x);
                let (p2, ok2) = tap_offset(o2, ky, kx, h, wd, pad_y, pad_x);
                let (p3, ok3) = tap_offset(o3, ky, kx, h, wd, pad_y, pad_x);
                let tap = ky * kw + kx;
                for c in 0..c_in {
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
        store_tile::<F, I>(
            &acc, bias, out, indices, n0, m0, ux, uy, dy, batch, c_out, oh, ow, columns, has_bias, epilogue,
            pooled,
        );
    }
}

/// Dense input gradient: `dx = W^T @ cols(G)` (see [`pre_gradient`] for
/// `G`). `dx` is `[batch, c_in, h, w]`, every element written.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
fn conv_input_grad_kernel<F: Float, I: Int>(
    grad: &Array<F>,
    saved: &Array<F>,
    indices: &Array<I>,
    w: &Array<F>,
    dx: &mut Array<F>,
    batch: usize,
    c_in: usize,
    h: usize,
    wd: usize,
    c_out: usize,
    oh: usize,
    ow: usize,
    #[comptime] kh: usize,
    #[comptime] kw: usize,
    #[comptime] sy: usize,
    #[comptime] sx: usize,
    #[comptime] pad_y: usize,
    #[comptime] pad_x: usize,
    #[comptime] tile_m: usize,
    #[comptime] epilogue: u32,
    #[comptime] pooled: bool,
) {
    let taps = kh * kw;
    let depth = c_out * taps;
    let columns = batch * h * wd;
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
        let b = n / (h * wd);
        let at = n % (h * wd);
        let iy = at / wd;
        let ix = at % wd;
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
                if c < c_in && k < depth {
                    v = w[((k / taps) * c_in + c) * taps + k % taps];
                }
                a_tile[idx] = v;
            }
            let mut r = unit / 64;
            while r < 16 {
                let k = k0 + r;
                let mut v = F::new(0.0);
                if column_ok && k < depth {
                    let tap = k % taps;
                    let (ky, kx) = (tap / kw, tap % kw);
                    let (ty, tx) = (iy + pad_y, ix + pad_x);
                    // The output position whose tap (ky, kx) reads input (iy, ix), if any.
                    if ty >= ky && tx >= kx && (ty - ky) % sy == 0 && (tx - kx) % sx == 0 {
                        let (oy, ox) = ((ty - ky) / sy, (tx - kx) / sx);
                        if oy < oh && ox < ow {
                            let plane = b * c_out + k / taps;
                            v = pre_gradient::<F, I>(
                                grad, saved, indices, plane, oy, ox, oh, ow, epilogue, pooled,
                            );
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
        store_input_grad::<F>(&acc, dx, n0, m0, ux, uy, dy, columns, c_in, h, wd);
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
    n0: usize,
    m0: usize,
    ux: usize,
    uy: usize,
    dy: usize,
    columns: usize,
    c_in: usize,
    h: usize,
    wd: usize,
) {
    #[unroll]
    for j in 0..4usize {
        let col = n0 + ux + 16 * j;
        if col < columns {
            let cb = col / (h * wd);
            let cat = col % (h * wd);
            #[unroll]
            for i in 0..4usize {
                let c = m0 + uy + i * dy;
                if c < c_in {
                    dx[(cb * c_in + c) * h * wd + cat] = acc[i * 4 + j];
                }
            }
        }
    }
}

/// The input value under filter tap `(ky, kx)` of output position `(oy,
/// ox)` of sample `b`, channel `c` (zero in the padding).
#[allow(clippy::too_many_arguments)]
#[cube]
fn input_at<F: Float>(
    x: &Array<F>,
    b: usize,
    c: usize,
    oy: usize,
    ox: usize,
    ky: usize,
    kx: usize,
    c_in: usize,
    h: usize,
    wd: usize,
    #[comptime] sy: usize,
    #[comptime] sx: usize,
    #[comptime] pad_y: usize,
    #[comptime] pad_x: usize,
) -> F {
    let yy = oy * sy + ky;
    let xx = ox * sx + kx;
    let mut v = F::new(0.0);
    if yy >= pad_y && yy < h + pad_y && xx >= pad_x && xx < wd + pad_x {
        v = x[((b * c_in + c) * h + yy - pad_y) * wd + xx - pad_x];
    }
    v
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
    batch: usize,
    c_in: usize,
    h: usize,
    wd: usize,
    c_out: usize,
    oh: usize,
    ow: usize,
    chunk: usize,
    #[comptime] kh: usize,
    #[comptime] kw: usize,
    #[comptime] sy: usize,
    #[comptime] sx: usize,
    #[comptime] pad_y: usize,
    #[comptime] pad_x: usize,
    #[comptime] tile_m: usize,
    #[comptime] epilogue: u32,
    #[comptime] pooled: bool,
    #[comptime] swap: bool,
) {
    let taps = kh * kw;
    let depth = c_in * taps;
    // Rows and columns of the product this kernel computes.
    let mut rows = c_out;
    let mut cols = depth;
    if swap {
        rows = depth;
        cols = c_out;
    }
    // Pooled, only the pixels inside a whole window can carry a gradient.
    let mut rh = oh;
    let mut rw = ow;
    if pooled {
        rh = (oh / 2) * 2;
        rw = (ow / 2) * 2;
    }
    let reduction = batch * rh * rw;
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
            grad, saved, indices, x, &mut lhs, &mut rhs, unit, units, m0, n, k0, r_end, rows, cols, rh, rw,
            c_in, h, wd, c_out, oh, ow, kh, kw, sy, sx, pad_y, pad_x, epilogue, pooled, swap,
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
        &acc, &bias_acc, partials, bias_parts, z, m0, n0, ux, uy, dy, rows, cols, c_out, depth, sums_bias,
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
    c_in: usize,
    h: usize,
    wd: usize,
    c_out: usize,
    oh: usize,
    ow: usize,
    #[comptime] kh: usize,
    #[comptime] kw: usize,
    #[comptime] sy: usize,
    #[comptime] sx: usize,
    #[comptime] pad_y: usize,
    #[comptime] pad_x: usize,
    #[comptime] epilogue: u32,
    #[comptime] pooled: bool,
    #[comptime] swap: bool,
) {
    let taps = kh * kw;
    let load_col = unit % 64;
    let column_ok = n < cols;
    let c = n / taps;
    let tap = n % taps;
    let (ky, kx) = (tap / kw, tap % kw);
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
                let (my, mx) = (entry_tap / kw, entry_tap % kw);
                v = input_at::<F>(x, rb, m / taps, ry, rx, my, mx, c_in, h, wd, sy, sx, pad_y, pad_x);
            } else {
                let plane = rb * c_out + m;
                v = pre_gradient::<F, I>(grad, saved, indices, plane, ry, rx, oh, ow, epilogue, pooled);
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
                let plane = rb * c_out + n;
                v = pre_gradient::<F, I>(grad, saved, indices, plane, ry, rx, oh, ow, epilogue, pooled);
            } else {
                v = input_at::<F>(x, rb, c, ry, rx, ky, kx, c_in, h, wd, sy, sx, pad_y, pad_x);
            }
        }
        b_tile[rr * 64 + load_col] = v;
        rr += rows_per_pass;
    }
}

/// Zeroes the first `len` values of `values` (a register tile).
#[cube]
fn clear<F: Float>(values: &mut Array<F>, #[comptime] len: usize) {
    #[unroll]
    for i in 0..len {
        values[i] = F::new(0.0);
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
    z: usize,
    m0: usize,
    n0: usize,
    ux: usize,
    uy: usize,
    dy: usize,
    rows: usize,
    cols: usize,
    c_out: usize,
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
                let mut at = (z * c_out + m) * depth + col;
                if swap {
                    at = (z * c_out + col) * depth + m;
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
            if channel < c_out {
                bias_partials[z * c_out + channel] = bias_acc[i];
            }
        }
    }
}

/// Accumulates the staged tiles' product into this unit's 4x4 register tile
/// `acc`: rows `uy + i dy` of `a_tile` (`tile_m x 16`) times columns of
/// `b_tile` (`16 x 64`): `ux + 16 j`, or with `adjacent` the four
/// neighbouring columns `4 ux + j` (a pooling window's pixels).
#[cube]
fn multiply_tiles<F: Float>(
    acc: &mut Array<F>,
    a_tile: &SharedMemory<F>,
    b_tile: &SharedMemory<F>,
    ux: usize,
    uy: usize,
    dy: usize,
    #[comptime] adjacent: bool,
) {
    #[unroll]
    for kk in 0..16usize {
        let a0 = a_tile[uy * 16 + kk];
        let a1 = a_tile[(uy + dy) * 16 + kk];
        let a2 = a_tile[(uy + 2 * dy) * 16 + kk];
        let a3 = a_tile[(uy + 3 * dy) * 16 + kk];
        let mut b0 = b_tile[kk * 64 + ux];
        let mut b1 = b_tile[kk * 64 + ux + 16];
        let mut b2 = b_tile[kk * 64 + ux + 32];
        let mut b3 = b_tile[kk * 64 + ux + 48];
        if adjacent {
            b0 = b_tile[kk * 64 + 4 * ux];
            b1 = b_tile[kk * 64 + 4 * ux + 1];
            b2 = b_tile[kk * 64 + 4 * ux + 2];
            b3 = b_tile[kk * 64 + 4 * ux + 3];
        }
        outer_product_add::<F>(acc, a0, a1, a2, a3, b0, b1, b2, b3);
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

/// Depthwise forward: one unit per output element; filter `co` reads input
/// channel `co / multiplier`.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn depthwise_forward_kernel<F: Float>(
    x: &Array<F>,
    w: &Array<F>,
    bias: &Array<F>,
    out: &mut Array<F>,
    c_in: usize,
    h: usize,
    wd: usize,
    c_out: usize,
    oh: usize,
    ow: usize,
    #[comptime] kh: usize,
    #[comptime] kw: usize,
    #[comptime] sy: usize,
    #[comptime] sx: usize,
    #[comptime] pad_y: usize,
    #[comptime] pad_x: usize,
    #[comptime] has_bias: bool,
    #[comptime] epilogue: u32,
) {
    let e = ABSOLUTE_POS;
    if e < out.len() {
        let ox = e % ow;
        let oy = (e / ow) % oh;
        let plane = e / (oh * ow);
        let co = plane % c_out;
        let b = plane / c_out;
        let c = co / (c_out / c_in);
        let mut acc = F::new(0.0);
        if has_bias {
            acc = bias[co];
        }
        let base = (b * c_in + c) * h * wd;
        #[unroll]
        for ky in 0..kh {
            #[unroll]
            for kx in 0..kw {
                let yy = oy * sy + ky;
                let xx = ox * sx + kx;
                if yy >= pad_y && yy < h + pad_y && xx >= pad_x && xx < wd + pad_x {
                    acc += w[co * kh * kw + ky * kw + kx] * x[base + (yy - pad_y) * wd + xx - pad_x];
                }
            }
        }
        out[e] = activate::<F>(acc, epilogue);
    }
}

/// Depthwise input gradient: one unit per input element, summing over the
/// channel's filters and the taps that reach it.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn depthwise_input_grad_kernel<F: Float, I: Int>(
    grad: &Array<F>,
    saved: &Array<F>,
    indices: &Array<I>,
    w: &Array<F>,
    dx: &mut Array<F>,
    c_in: usize,
    h: usize,
    wd: usize,
    c_out: usize,
    oh: usize,
    ow: usize,
    #[comptime] kh: usize,
    #[comptime] kw: usize,
    #[comptime] sy: usize,
    #[comptime] sx: usize,
    #[comptime] pad_y: usize,
    #[comptime] pad_x: usize,
    #[comptime] epilogue: u32,
) {
    let e = ABSOLUTE_POS;
    if e < dx.len() {
        let ix = e % wd;
        let iy = (e / wd) % h;
        let plane = e / (h * wd);
        let c = plane % c_in;
        let b = plane / c_in;
        let multiplier = c_out / c_in;
        let mut acc = F::new(0.0);
        for j in 0..multiplier {
            let co = c * multiplier + j;
            #[unroll]
            for ky in 0..kh {
                #[unroll]
                for kx in 0..kw {
                    let ty = iy + pad_y;
                    let tx = ix + pad_x;
                    if ty >= ky && tx >= kx {
                        let (ty, tx) = (ty - ky, tx - kx);
                        if ty % sy == 0 && tx % sx == 0 && ty / sy < oh && tx / sx < ow {
                            let g = pre_gradient::<F, I>(
                                grad,
                                saved,
                                indices,
                                b * c_out + co,
                                ty / sy,
                                tx / sx,
                                oh,
                                ow,
                                epilogue,
                                false,
                            );
                            acc += w[co * kh * kw + ky * kw + kx] * g;
                        }
                    }
                }
            }
        }
        dx[e] = acc;
    }
}

/// Depthwise weight and bias gradients, first stage: cube `(co, z)` sums
/// over its chunk of batch x pixels, per tap, into `partials[z][co][tap]`
/// and `bias_partials[z][co]` (a shared-memory tree per tap).
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn depthwise_weight_grad_kernel<F: Float, I: Int>(
    grad: &Array<F>,
    saved: &Array<F>,
    indices: &Array<I>,
    x: &Array<F>,
    partials: &mut Array<F>,
    bias_partials: &mut Array<F>,
    batch: usize,
    c_in: usize,
    h: usize,
    wd: usize,
    c_out: usize,
    oh: usize,
    ow: usize,
    chunk: usize,
    #[comptime] kh: usize,
    #[comptime] kw: usize,
    #[comptime] sy: usize,
    #[comptime] sx: usize,
    #[comptime] pad_y: usize,
    #[comptime] pad_x: usize,
    #[comptime] epilogue: u32,
) {
    let taps = kh * kw;
    let co = CUBE_POS_X as usize;
    let z = CUBE_POS_Y as usize;
    let c = co / (c_out / c_in);
    let unit = UNIT_POS as usize;
    let reduction = batch * oh * ow;
    let r_begin = z * chunk;
    let mut r_end = r_begin + chunk;
    if r_end > reduction {
        r_end = reduction;
    }
    let mut acc = Array::<F>::new(taps + 1);
    #[unroll]
    for t in 0..taps + 1 {
        acc[t] = F::new(0.0);
    }
    let mut r = r_begin + unit;
    while r < r_end {
        let b = r / (oh * ow);
        let at = r % (oh * ow);
        let (oy, ox) = (at / ow, at % ow);
        let g = pre_gradient::<F, I>(grad, saved, indices, b * c_out + co, oy, ox, oh, ow, epilogue, false);
        let base = (b * c_in + c) * h * wd;
        #[unroll]
        for ky in 0..kh {
            #[unroll]
            for kx in 0..kw {
                let yy = oy * sy + ky;
                let xx = ox * sx + kx;
                if yy >= pad_y && yy < h + pad_y && xx >= pad_x && xx < wd + pad_x {
                    acc[ky * kw + kx] += g * x[base + (yy - pad_y) * wd + xx - pad_x];
                }
            }
        }
        acc[taps] += g;
        r += 256;
    }
    let mut shared = SharedMemory::<F>::new(256usize);
    #[unroll]
    for t in 0..taps + 1 {
        shared[unit] = acc[t];
        sync_cube();
        let mut half = 128usize.runtime();
        while half > 0 {
            if unit < half {
                shared[unit] = shared[unit] + shared[unit + half];
            }
            sync_cube();
            half /= 2;
        }
        if unit == 0 {
            if t < taps {
                partials[(z * c_out + co) * taps + t] = shared[0];
            } else {
                bias_partials[z * c_out + co] = shared[0];
            }
        }
        sync_cube();
    }
}

/// The 2x2, stride-2 max-pool of `[planes, h, w]` (odd edges dropped), one
/// unit per output; with `with_indices`, where each maximum sat in its
/// plane (the first maximum in window order on ties).
#[cube(launch)]
fn max_pool_kernel<F: Float, I: Int>(
    x: &Array<F>,
    out: &mut Array<F>,
    indices: &mut Array<I>,
    h: usize,
    wd: usize,
    #[comptime] with_indices: bool,
) {
    let e = ABSOLUTE_POS;
    if e < out.len() {
        let (ph, pw) = (h / 2, wd / 2);
        let px = e % pw;
        let py = (e / pw) % ph;
        let plane = e / (ph * pw);
        let top = plane * h * wd + 2 * py * wd + 2 * px;
        let mut best = x[top];
        let mut best_at = 0usize.runtime();
        let v1 = x[top + 1];
        if v1 > best {
            best = v1;
            best_at = 1usize;
        }
        let v2 = x[top + wd];
        if v2 > best {
            best = v2;
            best_at = wd;
        }
        let v3 = x[top + wd + 1];
        if v3 > best {
            best = v3;
            best_at = wd + 1;
        }
        out[e] = best;
        if with_indices {
            indices[e] = I::cast_from(2 * py * wd + 2 * px + best_at);
        }
    }
}

/// The 2x2 max-pool's input gradient: one unit per input element, which
/// takes its window's gradient when it was the window's maximum.
#[cube(launch)]
fn max_pool_backward_kernel<F: Float, I: Int>(
    grad: &Array<F>,
    indices: &Array<I>,
    dx: &mut Array<F>,
    h: usize,
    wd: usize,
) {
    let e = ABSOLUTE_POS;
    if e < dx.len() {
        let (ph, pw) = (h / 2, wd / 2);
        let xx = e % wd;
        let yy = (e / wd) % h;
        let plane = e / (h * wd);
        let mut v = F::new(0.0);
        if yy < 2 * ph && xx < 2 * pw {
            let at = (plane * ph + yy / 2) * pw + xx / 2;
            if u32::cast_from(indices[at]) as usize == yy * wd + xx {
                v = grad[at];
            }
        }
        dx[e] = v;
    }
}

type Cube<R, F, I, BT> = CubeBackend<R, F, I, BT>;

/// A convolution's sizes, when our kernels take it: no dilation, and
/// either no groups (dense) or one input channel per filter (depthwise).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Geometry {
    batch: usize,
    c_in: usize,
    h: usize,
    w: usize,
    c_out: usize,
    kernel: (usize, usize),
    stride: (usize, usize),
    padding: (usize, usize),
    oh: usize,
    ow: usize,
    /// One input channel per filter, `c_out` a multiple of `c_in`.
    depthwise: bool,
}

impl Geometry {
    pub(crate) fn of<R: CubeRuntime>(
        x: &CubeTensor<R>,
        weight: &CubeTensor<R>,
        options: &ConvOptions<2>,
    ) -> Option<Self> {
        let [batch, c_in, h, w] = x.meta.shape().dims::<4>();
        let [c_out, per_group, kh, kw] = weight.meta.shape().dims::<4>();
        if options.dilation != [1, 1] || batch == 0 || c_out == 0 {
            return None;
        }
        let depthwise = match options.groups {
            1 if per_group == c_in => false,
            g if g == c_in && per_group == 1 && c_out % c_in == 0 && g > 1 => true,
            _ => return None,
        };
        let [sy, sx] = options.stride;
        let [py, px] = options.padding;
        if h + 2 * py < kh || w + 2 * px < kw || sy == 0 || sx == 0 {
            return None;
        }
        let (oh, ow) = ((h + 2 * py - kh) / sy + 1, (w + 2 * px - kw) / sx + 1);
        Some(Self {
            batch,
            c_in,
            h,
            w,
            c_out,
            kernel: (kh, kw),
            stride: (sy, sx),
            padding: (py, px),
            oh,
            ow,
            depthwise,
        })
    }

    fn taps(&self) -> usize {
        self.kernel.0 * self.kernel.1
    }
}

/// Rows of a cube's output tile for a matrix of `rows` rows.
fn tile_rows(rows: usize) -> usize {
    match rows {
        0..=16 => 16,
        17..=32 => 32,
        _ => 64,
    }
}

/// A grid covering `columns` columns in tiles of [`TILE_N`] (folded into z
/// past [`MAX_GRID`]) and `rows` rows in tiles of `tile_m`.
fn matrix_grid(columns: usize, rows: usize, tile_m: usize) -> CubeCount {
    let tiles = columns.div_ceil(TILE_N).max(1);
    let x = tiles.min(MAX_GRID);
    CubeCount::Static(x as u32, rows.div_ceil(tile_m) as u32, tiles.div_ceil(x) as u32)
}

fn elementwise_grid(elements: usize) -> CubeCount {
    let cubes = elements.div_ceil(UNITS as usize).max(1);
    assert!(cubes <= MAX_GRID * MAX_GRID, "{elements} elements: too many for one launch");
    let x = cubes.min(MAX_GRID);
    CubeCount::Static(x as u32, cubes.div_ceil(x) as u32, 1)
}

/// An int tensor for the pool indices, shaped `shape`.
fn new_indices<R: CubeRuntime, I: IntElement>(like: &CubeTensor<R>, shape: Shape) -> CubeTensor<R> {
    empty_device_contiguous_dtype(like.client.clone(), like.device.clone(), shape, I::dtype())
}

/// A buffer the kernels bind but never read (a missing bias or indices).
fn placeholder<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    like: &CubeTensor<R>,
) -> CubeTensor<R> {
    new_output::<R, F, I, BT>(like, Shape::from(vec![1]))
}

/// Whether our kernels take this convolution (with `epilogue`, followed by
/// the 2x2 max-pool when `pooled`): no dilation, dense or depthwise (not
/// pooled), and an activation whose derivative its output tells.
pub(crate) fn takes<R: CubeRuntime>(
    x: &CubeTensor<R>,
    weight: &CubeTensor<R>,
    options: &ConvOptions<2>,
    epilogue: Epilogue,
    pooled: bool,
) -> bool {
    match Geometry::of(x, weight, options) {
        Some(g) => epilogue != Epilogue::Gelu && !(pooled && g.depthwise),
        None => false,
    }
}

/// `act(conv(x) + bias)`, pooled or not, for a convolution our kernels take
/// ([`takes`]): the output and, pooled, where each maximum sat.
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
        let elements = out.meta.num_elements();
        depthwise_forward_kernel::launch::<F, R>(
            &client,
            elementwise_grid(elements),
            CubeDim::new_1d(UNITS),
            x.into_array_arg(),
            weight.into_array_arg(),
            bias.into_array_arg(),
            out.clone().into_array_arg(),
            g.c_in,
            g.h,
            g.w,
            g.c_out,
            g.oh,
            g.ow,
            g.kernel.0,
            g.kernel.1,
            g.stride.0,
            g.stride.1,
            g.padding.0,
            g.padding.1,
            has_bias,
            epilogue_code(epilogue),
        );
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
            g.batch,
            g.c_in,
            g.h,
            g.w,
            g.c_out,
            g.oh,
            g.ow,
            g.kernel.0,
            g.kernel.1,
            g.stride.0,
            g.stride.1,
            g.padding.0,
            g.padding.1,
            tile_m,
            has_bias,
            epilogue_code(epilogue),
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
            g.batch,
            g.c_in,
            g.h,
            g.w,
            g.c_out,
            g.oh,
            g.ow,
            g.kernel.0,
            g.kernel.1,
            g.stride.0,
            g.stride.1,
            g.padding.0,
            g.padding.1,
            tile_m,
            has_bias,
            epilogue_code(epilogue),
            pooled,
        );
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
    epilogue: u32,
}

/// Every gradient of a fused convolution layer (see
/// [`crate::FusedBackend::conv2d_layer_backward`]) our kernels take ([`takes`]).
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
        epilogue: epilogue_code(inputs.epilogue),
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
    let (g, pooled, code, client) = (*g, *pooled, *epilogue, x.client.clone());
    let dx = new_output::<R, F, I, BT>(&x, x.meta.shape().clone());
    if g.depthwise {
        depthwise_input_grad_kernel::launch::<F, I, R>(
            &client,
            elementwise_grid(dx.meta.num_elements()),
            CubeDim::new_1d(UNITS),
            grad.clone().into_array_arg(),
            saved.clone().into_array_arg(),
            indices.clone().into_array_arg(),
            weight.clone().into_array_arg(),
            dx.clone().into_array_arg(),
            g.c_in,
            g.h,
            g.w,
            g.c_out,
            g.oh,
            g.ow,
            g.kernel.0,
            g.kernel.1,
            g.stride.0,
            g.stride.1,
            g.padding.0,
            g.padding.1,
            code,
        );
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
                g.batch,
                g.c_in,
                g.h,
                g.w,
                g.c_out,
                g.oh,
                g.ow,
                g.kernel.0,
                g.kernel.1,
                g.stride.0,
                g.stride.1,
                g.padding.0,
                g.padding.1,
                tile_m,
                code,
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
    code: u32,
    pooled: bool,
) {
    let client = x.client.clone();
    if g.depthwise {
        depthwise_weight_grad_kernel::launch::<F, I, R>(
            &client,
            CubeCount::Static(g.c_out as u32, count as u32, 1),
            CubeDim::new_1d(UNITS),
            grad.into_array_arg(),
            saved.into_array_arg(),
            indices.into_array_arg(),
            x.clone().into_array_arg(),
            partials.clone().into_array_arg(),
            bias_partials.clone().into_array_arg(),
            g.batch,
            g.c_in,
            g.h,
            g.w,
            g.c_out,
            g.oh,
            g.ow,
            chunk,
            g.kernel.0,
            g.kernel.1,
            g.stride.0,
            g.stride.1,
            g.padding.0,
            g.padding.1,
            code,
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
                g.batch,
                g.c_in,
                g.h,
                g.w,
                g.c_out,
                g.oh,
                g.ow,
                chunk,
                g.kernel.0,
                g.kernel.1,
                g.stride.0,
                g.stride.1,
                g.padding.0,
                g.padding.1,
                tile_m,
                code,
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
    let BackwardOperands { g, x, weight, grad, saved, indices, pooled, epilogue: code } = operands;
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
        code,
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
/// activation, for a convolution our kernels take ([`takes`]).
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

/// The 2x2 max-pool of `x` and, with `with_indices`, where each maximum sat.
pub(crate) fn max_pool<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    x: CubeTensor<R>,
    with_indices: bool,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let x = into_contiguous(x);
    let [b, c, h, w] = x.meta.shape().dims::<4>();
    let shape = Shape::from(vec![b, c, h / 2, w / 2]);
    let out = new_output::<R, F, I, BT>(&x, shape.clone());
    let indices = new_indices::<R, I>(&x, if with_indices { shape } else { Shape::from(vec![1]) });
    let elements = out.meta.num_elements();
    if elements > 0 {
        max_pool_kernel::launch::<F, I, R>(
            &x.client.clone(),
            elementwise_grid(elements),
            CubeDim::new_1d(UNITS),
            x.into_array_arg(),
            out.clone().into_array_arg(),
            indices.clone().into_array_arg(),
            h,
            w,
            with_indices,
        );
    }
    (out, indices)
}

/// The 2x2 max-pool's input gradient (`x` gives the shape).
pub(crate) fn max_pool_backward<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    x: &CubeTensor<R>,
    grad: CubeTensor<R>,
    indices: CubeTensor<R>,
) -> CubeTensor<R> {
    let [_, _, h, w] = x.meta.shape().dims::<4>();
    let dx = new_output::<R, F, I, BT>(x, x.meta.shape().clone());
    let elements = dx.meta.num_elements();
    if elements > 0 {
        max_pool_backward_kernel::launch::<F, I, R>(
            &x.client.clone(),
            elementwise_grid(elements),
            CubeDim::new_1d(UNITS),
            into_contiguous(grad).into_array_arg(),
            into_contiguous(indices).into_array_arg(),
            dx.clone().into_array_arg(),
            h,
            w,
        );
    }
    dx
}
