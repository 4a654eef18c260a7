//! Depthwise convolutions (one input channel per filter) on CubeCL
//! backends, in burn's NCHW layout: direct kernels, one unit per output or
//! input element; their weight gradient reduces per filter tap in shared
//! memory, then through the dense convolutions' partial sums
//! (`conv_grad.rs`). The launches take the operands the dense paths
//! prepared.

use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::*;

use super::common::activate;
use super::geometry::{elementwise_grid, pre_gradient, Geometry, UNITS};

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

/// Launches the depthwise forward ([`depthwise_forward_kernel`]) of `x`,
/// `weight` and `bias` (a placeholder without one) into `out`, one unit per
/// output element; `epilogue` as [`super::common::epilogue_code`].
pub(super) fn forward<R: CubeRuntime, F: FloatElement>(
    client: &ComputeClient<R>,
    g: &Geometry,
    (x, weight, bias): (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>),
    out: &CubeTensor<R>,
    has_bias: bool,
    epilogue: u32,
) {
    let elements = out.meta.num_elements();
    depthwise_forward_kernel::launch::<F, R>(
        client,
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
        epilogue,
    );
}

/// Launches the depthwise input gradient ([`depthwise_input_grad_kernel`])
/// into `dx`, one unit per input element; `code` as
/// [`super::common::epilogue_code`].
pub(super) fn input_grad<R: CubeRuntime, F: FloatElement, I: IntElement>(
    client: &ComputeClient<R>,
    g: &Geometry,
    (grad, saved, indices, weight): (&CubeTensor<R>, &CubeTensor<R>, &CubeTensor<R>, &CubeTensor<R>),
    dx: &CubeTensor<R>,
    code: u32,
) {
    depthwise_input_grad_kernel::launch::<F, I, R>(
        client,
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
}

/// Launches the first stage of the depthwise weight and bias gradients
/// ([`depthwise_weight_grad_kernel`]): `count` cubes per filter along the
/// reduction, each summing `chunk` positions into its rows of `partials`
/// and `bias_partials`; `code` as [`super::common::epilogue_code`].
pub(super) fn weight_grad_partials<R: CubeRuntime, F: FloatElement, I: IntElement>(
    client: &ComputeClient<R>,
    g: &Geometry,
    (grad, saved, indices, x): (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>, &CubeTensor<R>),
    (partials, bias_partials): (&CubeTensor<R>, &CubeTensor<R>),
    (count, chunk): (usize, usize),
    code: u32,
) {
    depthwise_weight_grad_kernel::launch::<F, I, R>(
        client,
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
}
