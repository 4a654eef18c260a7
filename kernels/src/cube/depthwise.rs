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
use super::geometry::{elementwise_grid, inside_input, pre_gradient, ConvShape, Geometry, UNITS};
use crate::Epilogue;

/// Depthwise forward: one unit per output element, with the sizes and
/// activation of `shape`; filter `co` reads input channel `co /
/// multiplier`.
#[cube(launch)]
fn depthwise_forward_kernel<F: Float>(
    x: &Array<F>,
    w: &Array<F>,
    bias: &Array<F>,
    out: &mut Array<F>,
    shape: &ConvShape,
    #[comptime] has_bias: bool,
) {
    let e = ABSOLUTE_POS;
    if e < out.len() {
        let ox = e % shape.ow;
        let oy = (e / shape.ow) % shape.oh;
        let plane = e / (shape.oh * shape.ow);
        let co = plane % shape.c_out;
        let b = plane / shape.c_out;
        let c = co / (shape.c_out / shape.c_in);
        let mut acc = F::new(0.0);
        if has_bias {
            acc = bias[co];
        }
        let base = (b * shape.c_in + c) * shape.h * shape.wd;
        #[unroll]
        for ky in 0..shape.kh {
            #[unroll]
            for kx in 0..shape.kw {
                let yy = oy * shape.sy + ky;
                let xx = ox * shape.sx + kx;
                if inside_input(shape, yy, xx) {
                    acc += w[co * shape.kh * shape.kw + comptime![ky * shape.kw + kx]]
                        * x[base + (yy - shape.pad_y) * shape.wd + xx - shape.pad_x];
                }
            }
        }
        out[e] = activate::<F>(acc, shape.epilogue);
    }
}

/// Depthwise input gradient: one unit per input element, summing over the
/// channel's filters and the taps that reach it.
#[cube(launch)]
fn depthwise_input_grad_kernel<F: Float, I: Int>(
    grad: &Array<F>,
    saved: &Array<F>,
    indices: &Array<I>,
    w: &Array<F>,
    dx: &mut Array<F>,
    shape: &ConvShape,
) {
    let e = ABSOLUTE_POS;
    if e < dx.len() {
        let ix = e % shape.wd;
        let iy = (e / shape.wd) % shape.h;
        let plane = e / (shape.h * shape.wd);
        let c = plane % shape.c_in;
        let b = plane / shape.c_in;
        let multiplier = shape.c_out / shape.c_in;
        let mut acc = F::new(0.0);
        for j in 0..multiplier {
            let co = c * multiplier + j;
            #[unroll]
            for ky in 0..shape.kh {
                #[unroll]
                for kx in 0..shape.kw {
                    let ty = iy + shape.pad_y;
                    let tx = ix + shape.pad_x;
                    if ty >= ky && tx >= kx {
                        let (ty, tx) = (ty - ky, tx - kx);
                        if ty % shape.sy == 0
                            && tx % shape.sx == 0
                            && ty / shape.sy < shape.oh
                            && tx / shape.sx < shape.ow
                        {
                            let g = pre_gradient::<F, I>(
                                grad,
                                saved,
                                indices,
                                shape,
                                b * shape.c_out + co,
                                ty / shape.sy,
                                tx / shape.sx,
                                false,
                            );
                            acc += w[co * shape.kh * shape.kw + comptime![ky * shape.kw + kx]] * g;
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
    shape: &ConvShape,
    chunk: usize,
) {
    let taps = comptime![shape.kh * shape.kw];
    let co = CUBE_POS_X as usize;
    let z = CUBE_POS_Y as usize;
    let c = co / (shape.c_out / shape.c_in);
    let unit = UNIT_POS as usize;
    let reduction = shape.batch * shape.oh * shape.ow;
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
        let b = r / (shape.oh * shape.ow);
        let at = r % (shape.oh * shape.ow);
        let (oy, ox) = (at / shape.ow, at % shape.ow);
        let g = pre_gradient::<F, I>(grad, saved, indices, shape, b * shape.c_out + co, oy, ox, false);
        let base = (b * shape.c_in + c) * shape.h * shape.wd;
        #[unroll]
        for ky in 0..shape.kh {
            #[unroll]
            for kx in 0..shape.kw {
                let yy = oy * shape.sy + ky;
                let xx = ox * shape.sx + kx;
                if inside_input(shape, yy, xx) {
                    acc[comptime![ky * shape.kw + kx]] +=
                        g * x[base + (yy - shape.pad_y) * shape.wd + xx - shape.pad_x];
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
                partials[(z * shape.c_out + co) * taps + t] = shared[0];
            } else {
                bias_partials[z * shape.c_out + co] = shared[0];
            }
        }
        sync_cube();
    }
}

/// Launches the depthwise forward ([`depthwise_forward_kernel`]) of `x`,
/// `weight` and `bias` (a placeholder without one), followed by
/// `epilogue`, into `out`, one unit per output element.
pub(super) fn forward<R: CubeRuntime, F: FloatElement>(
    client: &ComputeClient<R>,
    g: &Geometry,
    (x, weight, bias): (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>),
    out: &CubeTensor<R>,
    has_bias: bool,
    epilogue: Epilogue,
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
        g.shape::<R>(epilogue),
        has_bias,
    );
}

/// Launches the depthwise input gradient ([`depthwise_input_grad_kernel`])
/// into `dx`, one unit per input element, for a forward followed by
/// `epilogue`.
pub(super) fn input_grad<R: CubeRuntime, F: FloatElement, I: IntElement>(
    client: &ComputeClient<R>,
    g: &Geometry,
    (grad, saved, indices, weight): (&CubeTensor<R>, &CubeTensor<R>, &CubeTensor<R>, &CubeTensor<R>),
    dx: &CubeTensor<R>,
    epilogue: Epilogue,
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
        g.shape::<R>(epilogue),
    );
}

/// Launches the first stage of the depthwise weight and bias gradients
/// ([`depthwise_weight_grad_kernel`]): `count` cubes per filter along the
/// reduction, each summing `chunk` positions into its rows of `partials`
/// and `bias_partials`, for a forward followed by `epilogue`.
pub(super) fn weight_grad_partials<R: CubeRuntime, F: FloatElement, I: IntElement>(
    client: &ComputeClient<R>,
    g: &Geometry,
    (grad, saved, indices, x): (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>, &CubeTensor<R>),
    (partials, bias_partials): (&CubeTensor<R>, &CubeTensor<R>),
    (count, chunk): (usize, usize),
    epilogue: Epilogue,
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
        g.shape::<R>(epilogue),
        chunk,
    );
}
