//! The epilogues of the native flex paths: the activation after a
//! product's bias, in place over rows, and the exact (erf) GELU and its
//! derivative in vectorised passes.

use rayon::prelude::*;

use super::gemm::{exp_fast, rows_per_task, CHUNK};
use crate::{BiasAxis, Epilogue};

/// The activation; NaN stays NaN (as burn's and PyTorch's), so that a
/// diverging block shows in its loss.
pub(super) fn activate(x: f32, epilogue: Epilogue) -> f32 {
    match epilogue {
        Epilogue::Identity => x,
        Epilogue::Relu => {
            if x < 0.0 {
                0.0
            } else {
                x
            }
        }
        Epilogue::Relu6 => x.clamp(0.0, 6.0),
        // Applied by `epilogue_in_place` to whole rows after the bias.
        Epilogue::Gelu => x,
    }
}

/// `act(data + bias)` in place on `[z, m, n]` row-major values (bias along
/// `m` or `n`), in parallel over rows when `parallel`.
pub(super) fn epilogue_in_place(
    data: &mut [f32],
    [m, n]: [usize; 2],
    bias: Option<(&[f32], BiasAxis)>,
    epilogue: Epilogue,
    parallel: bool,
) {
    if bias.is_none() && epilogue == Epilogue::Identity {
        return;
    }
    if epilogue == Epilogue::Gelu {
        epilogue_in_place(data, [m, n], bias, Epilogue::Identity, parallel);
        match parallel {
            true => data.par_chunks_mut(CHUNK).for_each(gelu_slice),
            false => gelu_slice(data),
        }
        return;
    }
    let row_op = |(r, row): (usize, &mut [f32])| match bias {
        None => row.iter_mut().for_each(|v| *v = activate(*v, epilogue)),
        Some((bias, BiasAxis::Rows)) => {
            let b = bias[r % m];
            row.iter_mut().for_each(|v| *v = activate(*v + b, epilogue));
        }
        Some((bias, BiasAxis::Cols)) => {
            row.iter_mut().zip(bias).for_each(|(v, b)| *v = activate(*v + b, epilogue));
        }
    };
    if parallel {
        data.par_chunks_mut(n.max(1)).with_min_len(rows_per_task(n)).enumerate().for_each(row_op);
    } else {
        data.chunks_mut(n.max(1)).enumerate().for_each(row_op);
    }
}

/// `(1 + erf(x / sqrt 2)) / 2` (the normal CDF) and `e^(-x^2 / 2)`, the two
/// pieces of GELU and its derivative: erf by Abramowitz and Stegun 7.1.26
/// (absolute error under 1.5e-7).
#[inline(always)]
fn normal_cdf_and_gauss(x: f32) -> (f32, f32) {
    let z = x.abs() * std::f32::consts::FRAC_1_SQRT_2;
    let t = 1.0 / (1.0 + 0.327_591_1 * z);
    let poly = ((((1.061_405_4 * t - 1.453_152) * t + 1.421_413_8) * t - 0.284_496_72) * t + 0.254_829_6) * t;
    let gauss = exp_fast(-z * z);
    let erf = (1.0 - poly * gauss).copysign(x);
    (0.5 * (1.0 + erf), gauss)
}

wide! {
/// The exact (erf) GELU, `x * Phi(x)`, in place, on the calling thread.
fn gelu_slice(values: &mut [f32]) {
    for v in values.iter_mut() {
        *v *= normal_cdf_and_gauss(*v).0;
    }
}
}

wide! {
/// `grad * GELU'(pre)` in place (`GELU'(x) = Phi(x) + x phi(x)`), on the
/// calling thread.
fn gelu_backward_slice(pre: &[f32], grad: &mut [f32]) {
    const INV_SQRT_2PI: f32 = 0.398_942_3;
    for (g, &x) in grad.iter_mut().zip(pre) {
        let (cdf, gauss) = normal_cdf_and_gauss(x);
        *g *= cdf + x * INV_SQRT_2PI * gauss;
    }
}
}

/// [`gelu_slice`] in parallel over fixed chunks.
pub(super) fn gelu_in_place(values: &mut [f32]) {
    values.par_chunks_mut(16 * 1024).for_each(gelu_slice);
}

/// [`gelu_backward_slice`] in parallel over fixed chunks.
pub(super) fn gelu_backward_in_place(pre: &[f32], grad: &mut [f32]) {
    grad.par_chunks_mut(16 * 1024).zip(pre.par_chunks(16 * 1024)).for_each(|(grad, pre)| {
        gelu_backward_slice(pre, grad);
    });
}

#[cfg(test)]
mod tests {
    use burn::backend::Flex;
    use burn::tensor::{Tensor, TensorData};

    /// Inputs from -12 to 12, dense near 0, and the extremes.
    fn inputs() -> Vec<f32> {
        let mut x: Vec<f32> = (-24_000..=24_000).map(|i| i as f32 * 5e-4).collect();
        x.extend([-100.0, -88.5, -40.0, 40.0, 88.5, 100.0, 1e-30, -1e-30, 0.0]);
        x
    }

    #[test]
    fn the_fast_gelu_and_its_derivative_match_burns_erf_gelu() {
        let x = inputs();
        let device = Default::default();
        let t = || Tensor::<Flex, 1>::from_data(TensorData::new(x.clone(), [x.len()]), &device);
        let reference: Vec<f32> = burn::tensor::activation::gelu(t()).into_data().to_vec().unwrap();
        let mut ours = x.clone();
        super::gelu_in_place(&mut ours);
        for ((a, b), x) in ours.iter().zip(&reference).zip(&x) {
            assert!((a - b).abs() <= 1e-6 * x.abs().max(1.0), "gelu({x}) = {a}, burn's {b}");
        }
        // The derivative against burn's autodiff of its GELU.
        type Train = burn::backend::Autodiff<Flex>;
        let xt = Tensor::<Train, 1>::from_data(TensorData::new(x.clone(), [x.len()]), &device).require_grad();
        let grads = burn::tensor::activation::gelu(xt.clone()).sum().backward();
        let reference: Vec<f32> = xt.grad(&grads).unwrap().into_data().to_vec().unwrap();
        let mut ours = vec![1.0; x.len()];
        super::gelu_backward_in_place(&x, &mut ours);
        for ((a, b), x) in ours.iter().zip(&reference).zip(&x) {
            assert!((a - b).abs() <= 2e-6, "gelu'({x}) = {a}, burn's {b}");
        }
    }
}
