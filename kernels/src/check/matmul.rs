//! The fused matmul layers in the check ([`super::run`]): linear layers and
//! pointwise convolutions with every epilogue, against burn's unfused ops.

use rand::rngs::StdRng;

use super::common::{
    add_layer_rows, avoid_kinks, floats, layer_on, random, CheckRow, LayerInputs, Reference, Rows,
    MATMUL_TOLERANCE,
};
use crate::reference::unfused;
use crate::{linear, pointwise_conv, DistillBackend, Epilogue, MatmulVariant};

/// `x [rows, in] @ w [in, out] + b` in f64 on the host.
fn linear_pre(inputs: &LayerInputs, rows: usize, d_in: usize, d_out: usize) -> Vec<f64> {
    let (x, w) = (floats(&inputs.x), floats(&inputs.weight));
    let b = inputs.bias.as_ref().map(floats);
    let mut pre = vec![0f64; rows * d_out];
    for r in 0..rows {
        for o in 0..d_out {
            let dot: f64 = (0..d_in).map(|i| x[r * d_in + i] as f64 * w[i * d_out + o] as f64).sum();
            pre[r * d_out + o] = dot + b.as_ref().map_or(0.0, |b| b[o] as f64);
        }
    }
    pre
}

/// The pointwise conv's pre-activation `[batch, out, h*w]` in f64 on the host.
fn conv_pre(inputs: &LayerInputs, batch: usize, c_in: usize, c_out: usize, pixels: usize) -> Vec<f64> {
    let (x, w) = (floats(&inputs.x), floats(&inputs.weight));
    let b = inputs.bias.as_ref().map(floats);
    let mut pre = vec![0f64; batch * c_out * pixels];
    for n in 0..batch {
        for o in 0..c_out {
            for p in 0..pixels {
                let dot: f64 =
                    (0..c_in).map(|c| w[o * c_in + c] as f64 * x[(n * c_in + c) * pixels + p] as f64).sum();
                pre[(n * c_out + o) * pixels + p] = dot + b.as_ref().map_or(0.0, |b| b[o] as f64);
            }
        }
    }
    pre
}

/// The linear and pointwise-conv cases with the matmul `variant` in force.
pub(super) fn check_layers<B: DistillBackend>(
    out: &mut Vec<CheckRow>,
    rng: &mut StdRng,
    variant: MatmulVariant,
    device: &B::Device,
) {
    let cpu = burn::tensor::Device::<Reference>::default();
    let tag = match variant {
        MatmulVariant::Split => " [split]",
        _ => "",
    };
    let linear_cases = [(1, 5, 3), (37, 29, 53), (130, 300, 70), (2, 1152, 17)];
    for (i, (rows_n, d_in, d_out)) in linear_cases.into_iter().enumerate() {
        for epilogue in Epilogue::ALL {
            let with_bias = (i + epilogue as usize) % 3 != 2;
            let mut inputs = LayerInputs {
                x: random(rng, &[rows_n, d_in], 1.0),
                weight: random(rng, &[d_in, d_out], 1.0 / (d_in as f32).sqrt()),
                bias: with_bias.then(|| random(rng, &[d_out], 0.5)),
                probe: random(rng, &[rows_n, d_out], 1.0),
            };
            let pre = linear_pre(&inputs, rows_n, d_in, d_out);
            avoid_kinks(&mut inputs.probe, &pre, epilogue);
            let mut rows = Rows {
                rows: vec![],
                op: "linear",
                case: format!(
                    "x [{rows_n}, {d_in}] w [{d_in}, {d_out}] {} bias={with_bias}{tag}",
                    epilogue.name()
                ),
                tolerance: MATMUL_TOLERANCE,
            };
            let f = layer_on::<B, 2, 2>(&inputs, |x, w, b| linear(x, w, b, epilogue), device);
            let r = layer_on::<Reference, 2, 2>(&inputs, |x, w, b| unfused::linear(x, w, b, epilogue), &cpu);
            add_layer_rows(&mut rows, f, r);
            out.extend(rows.rows);
        }
    }
    let conv_cases = [([1, 3, 5, 7], 4), ([17, 24, 7, 7], 40), ([5, 32, 14, 14], 19)];
    for (i, (shape, c_out)) in conv_cases.into_iter().enumerate() {
        for epilogue in Epilogue::ALL {
            let with_bias = (i + epilogue as usize) % 3 != 1;
            let [batch, c_in, h, w] = shape;
            let mut inputs = LayerInputs {
                x: random(rng, &shape, 1.0),
                weight: random(rng, &[c_out, c_in, 1, 1], 1.0 / (c_in as f32).sqrt()),
                bias: with_bias.then(|| random(rng, &[c_out], 0.5)),
                probe: random(rng, &[batch, c_out, h, w], 1.0),
            };
            let pre = conv_pre(&inputs, batch, c_in, c_out, h * w);
            avoid_kinks(&mut inputs.probe, &pre, epilogue);
            let mut rows = Rows {
                rows: vec![],
                op: "pointwise-conv",
                case: format!("x {shape:?} -> {c_out} {} bias={with_bias}{tag}", epilogue.name()),
                tolerance: MATMUL_TOLERANCE,
            };
            let f = layer_on::<B, 4, 4>(&inputs, |x, w, b| pointwise_conv(x, w, b, epilogue), device);
            let r = layer_on::<Reference, 4, 4>(
                &inputs,
                |x, w, b| unfused::pointwise_conv(x, w, b, epilogue),
                &cpu,
            );
            add_layer_rows(&mut rows, f, r);
            out.extend(rows.rows);
        }
    }
}
