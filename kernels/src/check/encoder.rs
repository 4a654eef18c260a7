//! The encoder layer's ops in the check ([`super::run`]): the masked
//! attention and the residual add with its layer norm, each against the
//! same formula in burn's ops on the CPU.

use burn::tensor::{Tensor, TensorData};
use rand::rngs::StdRng;

use super::common::{mask_of, random, tensor, values, CheckRow, Reference, Rows, MATMUL_TOLERANCE};
use crate::DistillBackend;

/// The masked attention ([`crate::transformer::masked_attention`]) against
/// the same formula in burn's ops, forward and the gradients of q, k and v:
/// one token and 70, head widths of 4, 7 and 32, and padding at the end (of
/// every length down to one real token), at the start, in the middle, every
/// other token, and none.
pub(super) fn check_attention<B: DistillBackend>(
    out: &mut Vec<CheckRow>,
    rng: &mut StdRng,
    device: &B::Device,
) {
    use crate::transformer::{attention_reference, masked_attention};
    let cpu = burn::tensor::Device::<Reference>::default();
    let cases: [(&str, [usize; 4], Box<dyn Fn(usize, usize) -> bool>); 6] = [
        ("no padding", [1, 1, 1, 8], Box::new(|_, _| true)),
        ("padded ends", [3, 32, 12, 32], Box::new(|b, t| t < [32, 1, 17][b])),
        ("padded starts", [2, 9, 3, 4], Box::new(|b, t| t >= 2 + 3 * b)),
        ("padding inside", [2, 70, 2, 7], Box::new(|b, t| !(10 + b..40).contains(&t))),
        ("every other", [2, 13, 4, 8], Box::new(|b, t| (t + b) % 2 == 0)),
        ("one real token", [4, 6, 2, 5], Box::new(|b, t| t == b)),
    ];
    for (pattern, [batch, tokens, heads, head_dim], real) in cases {
        let width = heads * head_dim;
        let inputs: Vec<TensorData> = (0..3).map(|_| random(rng, &[batch, tokens, width], 1.5)).collect();
        let mask = mask_of(batch, tokens, real);
        let probe = random(rng, &[batch, tokens, width], 1.0);
        fn attend<B: DistillBackend>(
            inputs: &[TensorData],
            mask: &TensorData,
            probe: &TensorData,
            f: impl Fn([Tensor<B, 3>; 3], Tensor<B, 2>) -> Tensor<B, 3>,
            device: &B::Device,
        ) -> Vec<Vec<f32>> {
            let qkv: [Tensor<B, 3>; 3] =
                std::array::from_fn(|i| tensor::<B, 3>(&inputs[i], device).require_grad());
            let context = f(qkv.clone(), tensor(mask, device));
            let grads = (context.clone() * tensor::<B, 3>(probe, device)).sum().backward();
            let mut all = vec![values(context)];
            all.extend(qkv.into_iter().map(|x| values(x.grad(&grads).expect("gradient"))));
            all
        }
        let f =
            attend::<B>(&inputs, &mask, &probe, |[q, k, v], m| masked_attention(q, k, v, m, heads), device);
        let reference = |[q, k, v]: [Tensor<Reference, 3>; 3], m: Tensor<Reference, 2>| {
            let prim = |t: Tensor<Reference, 3>| t.into_primitive().tensor();
            let out = attention_reference::<Reference>(
                prim(q),
                prim(k),
                prim(v),
                m.into_primitive().tensor(),
                heads,
                false,
            );
            Tensor::from_primitive(burn::tensor::TensorPrimitive::Float(out.context))
        };
        let r = attend::<Reference>(&inputs, &mask, &probe, reference, &cpu);
        let mut rows = Rows {
            rows: vec![],
            op: "attention",
            case: format!("[{batch}, {tokens}, {heads}x{head_dim}] {pattern}"),
            tolerance: MATMUL_TOLERANCE,
        };
        for (quantity, (f, r)) in ["forward", "d q", "d k", "d v"].iter().zip(f.iter().zip(&r)) {
            rows.add(quantity, f, r);
        }
        out.extend(rows.rows);
    }
}

/// The residual add with its layer norm ([`crate::transformer::add_layer_norm`])
/// against burn's `LayerNorm` of the sum, forward and every gradient.
pub(super) fn check_layer_norm<B: DistillBackend>(
    out: &mut Vec<CheckRow>,
    rng: &mut StdRng,
    device: &B::Device,
) {
    use burn::module::Param;
    use burn::nn::{LayerNorm, LayerNormConfig};
    let cpu = burn::tensor::Device::<Reference>::default();
    for [rows_n, hidden] in [[1, 5], [37, 384], [130, 17]] {
        let inputs: Vec<TensorData> = (0..2).map(|_| random(rng, &[rows_n, hidden], 2.0)).collect();
        let (gamma, beta) = (random(rng, &[hidden], 1.5), random(rng, &[hidden], 0.5));
        let probe = random(rng, &[rows_n, hidden], 1.0);
        fn normed<B: DistillBackend>(
            inputs: &[TensorData],
            [gamma, beta]: [&TensorData; 2],
            probe: &TensorData,
            f: impl Fn(Tensor<B, 2>, Tensor<B, 2>, &LayerNorm<B>) -> Tensor<B, 2>,
            device: &B::Device,
        ) -> Vec<Vec<f32>> {
            let [x, residual]: [Tensor<B, 2>; 2] =
                std::array::from_fn(|i| tensor::<B, 2>(&inputs[i], device).require_grad());
            let hidden = gamma.shape[0];
            let mut norm = LayerNormConfig::new(hidden).with_epsilon(1e-12).init::<B>(device);
            norm.gamma = Param::from_tensor(tensor::<B, 1>(gamma, device).require_grad());
            norm.beta = Some(Param::from_tensor(tensor::<B, 1>(beta, device).require_grad()));
            let y = f(x.clone(), residual.clone(), &norm);
            let grads = (y.clone() * tensor::<B, 2>(probe, device)).sum().backward();
            let grad = |t: Tensor<B, 2>| values(t.grad(&grads).expect("gradient"));
            let param = |p: &Param<Tensor<B, 1>>| values(p.val().grad(&grads).expect("gradient"));
            vec![values(y), grad(x), grad(residual), param(&norm.gamma), param(norm.beta.as_ref().unwrap())]
        }
        let scale = [&gamma, &beta];
        let f = normed::<B>(
            &inputs,
            scale,
            &probe,
            |x, r, n| crate::transformer::add_layer_norm(x, r, n, 1e-12),
            device,
        );
        let r = normed::<Reference>(&inputs, scale, &probe, |x, r, n| n.forward(x + r), &cpu);
        let mut rows = Rows {
            rows: vec![],
            op: "add-layer-norm",
            case: format!("[{rows_n}, {hidden}]"),
            tolerance: MATMUL_TOLERANCE,
        };
        let quantities = ["forward", "d x", "d residual", "d gamma", "d beta"];
        for (quantity, (f, r)) in quantities.iter().zip(f.iter().zip(&r)) {
            rows.add(quantity, f, r);
        }
        out.extend(rows.rows);
    }
}
