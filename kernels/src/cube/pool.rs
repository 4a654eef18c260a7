//! The 2x2, stride-2 max-pool on CubeCL backends (odd edges dropped), one
//! unit per output, and its input gradient, one unit per input element.

use burn::tensor::Shape;
use burn_cubecl::element::BoolElement;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::*;

use super::common::{new_indices, new_output};
use super::geometry::{elementwise_grid, UNITS};

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
