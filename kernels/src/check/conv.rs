//! The convolutions and the 2x2 max-pool in the check ([`super::run`]):
//! dense and depthwise, pooled or not, against burn's `conv2d`,
//! activation and `max_pool2d` on the CPU.

use burn::tensor::ops::ConvOptions;
use burn::tensor::{Tensor, TensorData};
use rand::rngs::StdRng;

use super::common::{
    add_layer_rows, avoid_kinks, floats, layer_on, random, tensor, values, CheckRow, LayerInputs, Reference,
    Rows, LOSS_TOLERANCE, MATMUL_TOLERANCE,
};
use crate::{conv2d, conv2d_pool, max_pool2x2, ConvVariant, DistillBackend, Epilogue};

/// A convolution's pre-activation `[batch, c_out, oh, ow]` in f64 on the host.
fn conv_kxk_pre(
    inputs: &LayerInputs,
    x_shape: [usize; 4],
    w_shape: [usize; 4],
    options: &ConvOptions<2>,
) -> Vec<f64> {
    let (x, w) = (floats(&inputs.x), floats(&inputs.weight));
    let b = inputs.bias.as_ref().map(floats);
    let ([batch, c_in, h, wd], [c_out, per_group, kh, kw]) = (x_shape, w_shape);
    let filters_per_group = c_out / (c_in / per_group);
    let ([sy, sx], [py, px]) = (options.stride, options.padding);
    let (oh, ow) = ((h + 2 * py - kh) / sy + 1, (wd + 2 * px - kw) / sx + 1);
    let mut pre = vec![0f64; batch * c_out * oh * ow];
    for n in 0..batch {
        for o in 0..c_out {
            for oy in 0..oh {
                for ox in 0..ow {
                    let mut sum = b.as_ref().map_or(0.0, |b| b[o] as f64);
                    for g in 0..per_group {
                        // The input channel of this filter's group.
                        let c = o / filters_per_group * per_group + g;
                        for ky in 0..kh {
                            for kx in 0..kw {
                                let (iy, ix) = (
                                    (oy * sy + ky) as isize - py as isize,
                                    (ox * sx + kx) as isize - px as isize,
                                );
                                if iy >= 0 && ix >= 0 && (iy as usize) < h && (ix as usize) < wd {
                                    let xv = x[((n * c_in + c) * h + iy as usize) * wd + ix as usize] as f64;
                                    sum += xv * w[((o * per_group + g) * kh + ky) * kw + kx] as f64;
                                }
                            }
                        }
                    }
                    pre[((n * c_out + o) * oh + oy) * ow + ox] = sum;
                }
            }
        }
    }
    pre
}

/// The fused convolution (kernels 3x3 and 5x3, strides 1 and 2, with and
/// without padding) against burn's `conv2d` and the activation.
pub(super) fn check_convolutions<B: DistillBackend>(
    out: &mut Vec<CheckRow>,
    rng: &mut StdRng,
    variant: ConvVariant,
    device: &B::Device,
) {
    let tag = match variant {
        ConvVariant::Direct => " [direct]",
        _ => "",
    };
    let cpu = burn::tensor::Device::<Reference>::default();
    let cases = [
        ([3, 1, 28, 28], [6, 1, 3, 3], [1, 1], [1, 1]),
        ([4, 16, 14, 14], [16, 16, 3, 3], [1, 1], [1, 1]),
        ([2, 5, 9, 8], [7, 5, 3, 3], [2, 2], [1, 1]),
        ([1, 3, 7, 6], [4, 3, 5, 3], [1, 2], [0, 1]),
        // Fewer filter entries than output channels (the weight gradient's
        // transposed product): a 1x1 and a 3x3.
        ([3, 6, 10, 10], [32, 6, 1, 1], [1, 1], [0, 0]),
        ([2, 2, 8, 8], [40, 2, 3, 3], [1, 1], [1, 1]),
        // Depthwise (groups = input channels; the weight's second axis is 1).
        ([3, 4, 9, 9], [8, 1, 3, 3], [1, 1], [1, 1]),
        ([2, 6, 8, 7], [6, 1, 3, 3], [2, 2], [1, 1]),
    ];
    for (i, (x_shape, w_shape, stride, padding)) in cases.into_iter().enumerate() {
        for (epilogue, pooled) in [
            (Epilogue::Identity, false),
            (Epilogue::Relu, false),
            (Epilogue::Relu6, false),
            (Epilogue::Identity, true),
            (Epilogue::Relu, true),
        ] {
            let with_bias = (i + epilogue as usize) % 3 != 1;
            let groups = x_shape[1] / w_shape[1];
            let options = ConvOptions::new(stride, padding, [1, 1], groups);
            let fan_in = (w_shape[1] * w_shape[2] * w_shape[3]) as f32;
            let [batch, _, h, w] = x_shape;
            let (oh, ow) = (
                (h + 2 * padding[0] - w_shape[2]) / stride[0] + 1,
                (w + 2 * padding[1] - w_shape[3]) / stride[1] + 1,
            );
            let mut inputs = LayerInputs {
                x: random(rng, &x_shape, 1.0),
                weight: random(rng, &w_shape, 1.0 / fan_in.sqrt()),
                bias: with_bias.then(|| random(rng, &[w_shape[0]], 0.5)),
                probe: random(rng, &[batch, w_shape[0], oh, ow], 1.0),
            };
            let pre = conv_kxk_pre(&inputs, x_shape, w_shape, &options);
            if pooled {
                inputs.probe = random(rng, &[batch, w_shape[0], oh / 2, ow / 2], 1.0);
                avoid_pool_ties(&mut inputs.probe, &pre, [oh, ow], epilogue);
            } else {
                avoid_kinks(&mut inputs.probe, &pre, epilogue);
            }
            let mut rows = Rows {
                rows: vec![],
                op: if pooled { "conv2d-pool" } else { "conv2d" },
                case: format!(
                    "x {x_shape:?} w {w_shape:?} s{stride:?} p{padding:?} {} bias={with_bias}{tag}",
                    epilogue.name()
                ),
                tolerance: MATMUL_TOLERANCE,
            };
            let opts = options.clone();
            let f = layer_on::<B, 4, 4>(
                &inputs,
                move |x, w, b| match pooled {
                    true => conv2d_pool(x, w, b, opts.clone(), epilogue),
                    false => conv2d(x, w, b, opts.clone(), epilogue),
                },
                device,
            );
            let r = layer_on::<Reference, 4, 4>(
                &inputs,
                move |x, w, b| {
                    let y = crate::reference::activate(
                        burn::tensor::module::conv2d(x, w, b, options.clone()),
                        epilogue,
                    );
                    match pooled {
                        true => burn::tensor::module::max_pool2d(y, [2, 2], [2, 2], [0, 0], [1, 1], false),
                        false => y,
                    }
                },
                &cpu,
            );
            add_layer_rows(&mut rows, f, r);
            out.extend(rows.rows);
        }
    }
}

/// Zeroes the probe of every pooled output whose window's maximum is not
/// clear: two values within a hair of each other (rounding may pick either),
/// or a maximum within a hair of an activation kink.
fn avoid_pool_ties(probe: &mut TensorData, pre: &[f64], [h, w]: [usize; 2], epilogue: Epilogue) {
    let mut values = floats(probe);
    let (ph, pw) = (h / 2, w / 2);
    for (o, v) in values.iter_mut().enumerate() {
        let (plane, oy, ox) = (o / (ph * pw), o / pw % ph, o % pw);
        let at = |dy: usize, dx: usize| pre[plane * h * w + (2 * oy + dy) * w + 2 * ox + dx];
        let mut window = [at(0, 0), at(0, 1), at(1, 0), at(1, 1)];
        window.sort_by(|a, b| b.total_cmp(a));
        let kink = matches!(epilogue, Epilogue::Relu | Epilogue::Relu6) && window[0].abs() < 1e-3;
        if window[0] - window[1] < 1e-3 || kink {
            *v = 0.0;
        }
    }
    *probe = TensorData::new(values, probe.shape.clone());
}

/// The 2x2 max-pool (even and odd sizes) against burn's `max_pool2d`.
pub(super) fn check_max_pool<B: DistillBackend>(
    out: &mut Vec<CheckRow>,
    rng: &mut StdRng,
    device: &B::Device,
) {
    let cpu = burn::tensor::Device::<Reference>::default();
    for shape in [[2, 3, 28, 28], [5, 4, 7, 7], [1, 2, 6, 9]] {
        let x = random(rng, &shape, 2.0);
        let probe = random(rng, &[shape[0], shape[1], shape[2] / 2, shape[3] / 2], 1.0);
        fn pooled<B: DistillBackend>(
            x: &TensorData,
            probe: &TensorData,
            pool: impl Fn(Tensor<B, 4>) -> Tensor<B, 4>,
            device: &B::Device,
        ) -> (Vec<f32>, Vec<f32>) {
            let x = tensor::<B, 4>(x, device).require_grad();
            let y = pool(x.clone());
            let grads = (y.clone() * tensor::<B, 4>(probe, device)).sum().backward();
            (values(y), values(x.grad(&grads).expect("x gradient")))
        }
        let f = pooled::<B>(&x, &probe, max_pool2x2, device);
        let r = pooled::<Reference>(
            &x,
            &probe,
            |x| burn::tensor::module::max_pool2d(x, [2, 2], [2, 2], [0, 0], [1, 1], false),
            &cpu,
        );
        let mut rows = Rows {
            rows: vec![],
            op: "max-pool-2x2",
            case: format!("x {shape:?}"),
            tolerance: LOSS_TOLERANCE,
        };
        rows.add("forward", &f.0, &r.0);
        rows.add("d x", &f.1, &r.1);
        out.extend(rows.rows);
    }
}
