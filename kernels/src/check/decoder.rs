//! The decoder ops' part of `pipebd kernels --check` ([`crate::check::run`]):
//! RMSNorm, SwiGLU's gated product, the grouped-query causal attention with
//! rotary positions and the head's weighted KL, each through the backend's
//! own path (its fused op and custom backward under autodiff) against the
//! burn-op reference of [`crate::llama`] differentiated by burn's autodiff
//! on the CPU: the forward value and every gradient.

use burn::tensor::{Tensor, TensorData};
use rand::rngs::StdRng;

use super::common::{
    mask_of, random, tensor, values, CheckRow, Reference, Rows, LOSS_TOLERANCE, MATMUL_TOLERANCE,
};
use crate::llama::{self, CausalHeads};
use crate::reference::wrap;
use crate::DistillBackend;

/// Every decoder op's checks, appended to `out`.
pub(crate) fn run<B: DistillBackend>(out: &mut Vec<CheckRow>, rng: &mut StdRng, device: &B::Device) {
    check_rms_norm::<B>(out, rng, device);
    check_swiglu::<B>(out, rng, device);
    check_causal_attention::<B>(out, rng, device);
    check_head_kl::<B>(out, rng, device);
}

/// `f` of the tracked `inputs`, its value and the gradients of `sum(f *
/// probe)` with respect to each input.
fn value_and_grads<B: DistillBackend, const D: usize, const N: usize, const DI: usize>(
    inputs: &[TensorData; N],
    probe: &TensorData,
    f: impl Fn([Tensor<B, DI>; N]) -> Tensor<B, D>,
    device: &B::Device,
) -> Vec<Vec<f32>> {
    let tracked: [Tensor<B, DI>; N] =
        std::array::from_fn(|i| tensor::<B, DI>(&inputs[i], device).require_grad());
    let output = f(tracked.clone());
    let grads = (output.clone() * tensor::<B, D>(probe, device)).sum().backward();
    let mut all = vec![values(output)];
    all.extend(tracked.into_iter().map(|x| values(x.grad(&grads).expect("gradient"))));
    all
}

fn add_rows(out: &mut Vec<CheckRow>, mut rows: Rows, quantities: &[&str], f: &[Vec<f32>], r: &[Vec<f32>]) {
    for (quantity, (f, r)) in quantities.iter().zip(f.iter().zip(r)) {
        rows.add(quantity, f, r);
    }
    out.extend(rows.rows);
}

/// RMSNorm of `[rows, hidden]` (groups of 32 rows on the CPU: 37 ends in a
/// short one), forward, `d x` and `d gamma`.
fn check_rms_norm<B: DistillBackend>(out: &mut Vec<CheckRow>, rng: &mut StdRng, device: &B::Device) {
    let cpu = Default::default();
    for [rows, hidden] in [[1, 5], [37, 576], [130, 17]] {
        let inputs = [random(rng, &[rows, hidden], 3.0), random(rng, &[1, hidden], 1.5)];
        let probe = random(rng, &[rows, hidden], 1.0);
        fn normed<B: DistillBackend>([x, gamma]: [Tensor<B, 2>; 2], reference: bool) -> Tensor<B, 2> {
            let hidden = gamma.dims()[1];
            let gamma = gamma.reshape([hidden]).into_primitive().tensor();
            let x = x.into_primitive().tensor();
            let out = match reference {
                true => llama::rms_norm_reference::<B>(x, gamma, 1e-5, false),
                false => B::rms_norm(x, gamma, 1e-5, false),
            };
            wrap(out.output)
        }
        let f = value_and_grads::<B, 2, 2, 2>(&inputs, &probe, |t| normed(t, false), device);
        let r = value_and_grads::<Reference, 2, 2, 2>(&inputs, &probe, |t| normed(t, true), &cpu);
        let rows = Rows {
            rows: vec![],
            op: "rms-norm",
            case: format!("[{rows}, {hidden}]"),
            tolerance: MATMUL_TOLERANCE,
        };
        add_rows(out, rows, &["forward", "d x", "d gamma"], &f, &r);
    }
}

/// `SiLU(gate) * up` with gates far into both tails, forward and both gradients.
fn check_swiglu<B: DistillBackend>(out: &mut Vec<CheckRow>, rng: &mut StdRng, device: &B::Device) {
    let cpu = Default::default();
    for [rows, width] in [[1, 7], [37, 1536]] {
        let inputs = [random(rng, &[rows, width], 12.0), random(rng, &[rows, width], 1.0)];
        let probe = random(rng, &[rows, width], 1.0);
        fn gated<B: DistillBackend>([gate, up]: [Tensor<B, 2>; 2], reference: bool) -> Tensor<B, 2> {
            let (gate, up) = (gate.into_primitive().tensor(), up.into_primitive().tensor());
            wrap(match reference {
                true => llama::swiglu_reference::<B>(gate, up),
                false => B::swiglu(gate, up),
            })
        }
        let f = value_and_grads::<B, 2, 2, 2>(&inputs, &probe, |t| gated(t, false), device);
        let r = value_and_grads::<Reference, 2, 2, 2>(&inputs, &probe, |t| gated(t, true), &cpu);
        let rows = Rows {
            rows: vec![],
            op: "swiglu",
            case: format!("[{rows}, {width}]"),
            tolerance: MATMUL_TOLERANCE,
        };
        add_rows(out, rows, &["forward", "d gate", "d up"], &f, &r);
    }
}

/// The causal attention with rotary positions, forward and the gradients
/// of q, k and v: one token and 70, SmolLM2's 9 query heads over 3
/// key/value heads of 64, multi-head (one query per key/value head) and
/// multi-query (one key/value head), and padding at the end, at the start,
/// inside, every other token, and none.
fn check_causal_attention<B: DistillBackend>(out: &mut Vec<CheckRow>, rng: &mut StdRng, device: &B::Device) {
    let cpu = Default::default();
    type Real = Box<dyn Fn(usize, usize) -> bool>;
    let cases: [(&str, [usize; 5], Real); 6] = [
        ("no padding", [1, 1, 1, 1, 8], Box::new(|_, _| true)),
        ("padded ends", [3, 32, 9, 3, 64], Box::new(|b, t| t < [32, 1, 17][b])),
        ("padded starts", [2, 9, 4, 2, 4], Box::new(|b, t| t >= 2 + 3 * b)),
        ("padding inside", [2, 70, 2, 1, 8], Box::new(|b, t| !(10 + b..40).contains(&t))),
        ("every other", [2, 13, 6, 6, 8], Box::new(|b, t| (t + b) % 2 == 0)),
        ("one real token", [4, 6, 2, 2, 6], Box::new(|b, t| t == b)),
    ];
    for (pattern, [batch, tokens, heads, kv_heads, head_dim], real) in cases {
        let layout = CausalHeads { heads, kv_heads, rope_base: 10_000.0 };
        let (q_width, kv_width) = (heads * head_dim, kv_heads * head_dim);
        let inputs = [
            random(rng, &[batch, tokens, q_width], 1.5),
            random(rng, &[batch, tokens, kv_width], 1.5),
            random(rng, &[batch, tokens, kv_width], 1.0),
        ];
        let mask = mask_of(batch, tokens, real);
        let probe = random(rng, &[batch, tokens, q_width], 1.0);
        fn attended<B: DistillBackend>(
            [q, k, v]: [Tensor<B, 3>; 3],
            mask: Tensor<B, 2>,
            layout: CausalHeads,
            reference: bool,
        ) -> Tensor<B, 3> {
            let [q, k, v] = [q, k, v].map(|t| t.into_primitive().tensor());
            let m = mask.into_primitive().tensor();
            let out = match reference {
                true => llama::causal_attention_reference::<B>(q, k, v, m, layout, false),
                false => B::causal_attention(q, k, v, m, layout, false),
            };
            wrap(out.context)
        }
        let f = value_and_grads::<B, 3, 3, 3>(
            &inputs,
            &probe,
            |t| attended(t, tensor::<B, 2>(&mask, device), layout, false),
            device,
        );
        let r = value_and_grads::<Reference, 3, 3, 3>(
            &inputs,
            &probe,
            |t| attended(t, tensor::<Reference, 2>(&mask, &cpu), layout, true),
            &cpu,
        );
        let case = format!("[{batch}, {tokens}, {heads}/{kv_heads}x{head_dim}] {pattern}");
        let rows = Rows { rows: vec![], op: "causal-attention", case, tolerance: MATMUL_TOLERANCE };
        add_rows(out, rows, &["forward", "d q", "d k", "d v"], &f, &r);
    }
}

/// The weighted KL of `[rows, classes]` scores (some rows weighted 0), at
/// temperatures 1 and 2: the loss and the student's gradient.
fn check_head_kl<B: DistillBackend>(out: &mut Vec<CheckRow>, rng: &mut StdRng, device: &B::Device) {
    let cpu = Default::default();
    for ([rows, classes], temperature) in [([3, 1000], 1.0), ([37, 4099], 2.0), ([5, 2051], 1.0)] {
        let student = random(rng, &[rows, classes], 6.0);
        let teacher = random(rng, &[rows, classes], 6.0);
        let weights: Vec<f32> =
            (0..rows).map(|r| if r % 3 == 1 { 0.0 } else { 1.0 + r as f32 * 0.1 }).collect();
        let weights = TensorData::new(weights, vec![rows]);
        let probe = TensorData::new(vec![1.5f32], vec![1]);
        fn kl<B: DistillBackend>(
            [s]: [Tensor<B, 2>; 1],
            teacher: Tensor<B, 2>,
            weights: Tensor<B, 1>,
            temperature: f64,
            reference: bool,
        ) -> Tensor<B, 1> {
            let (s, t, w) = (
                s.into_primitive().tensor(),
                teacher.into_primitive().tensor(),
                weights.into_primitive().tensor(),
            );
            wrap(match reference {
                true => llama::weighted_kl_reference::<B>(s, t, w, temperature, false).loss,
                false => B::weighted_kl_loss(s, t, w, temperature, false).loss,
            })
        }
        let inputs = [student];
        let f = value_and_grads::<B, 1, 1, 2>(
            &inputs,
            &probe,
            |s| kl(s, tensor(&teacher, device), tensor(&weights, device), temperature, false),
            device,
        );
        let r = value_and_grads::<Reference, 1, 1, 2>(
            &inputs,
            &probe,
            |s| kl(s, tensor(&teacher, &cpu), tensor(&weights, &cpu), temperature, true),
            &cpu,
        );
        let case = format!("[{rows}, {classes}] T={temperature}");
        let rows = Rows { rows: vec![], op: "head-kl", case, tolerance: LOSS_TOLERANCE };
        add_rows(out, rows, &["forward", "d student"], &f, &r);
    }
}
