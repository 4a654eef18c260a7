//! Ten Adam steps of a SmolLM2 decoder student, blockwise and stitched, give
//! PyTorch's losses: the same real weights (SmolLM2-135M's layers, the
//! SwiGLU narrowed to its first 768 neurons), the same batch (8 probe
//! sentences, 16 tokens, right-padded) and the same Adam, run by
//! bench/peers/smollm2_steps_reference.py in float32 torch and recorded in
//! `tests/data/smollm2-steps-reference.json` (its `protocol` says how).
//! Here the decoder runs on the fused flex ops (RMSNorm, rotary grouped-query
//! causal attention, SwiGLU, the head's KL, each with its own backward, real
//! tokens only), so this checks every one of their gradients end to end
//! against PyTorch's autograd.

use burn::backend::{Autodiff, Flex};
use burn::module::Param;
use burn::nn::Linear;
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::{Int, Tensor, TensorData};
use pipebd_core::{head_kl, Activation};
use pipebd_kernels::decoder::DecoderLayer;
use pipebd_kernels::loss::masked_mse;
use pipebd_teachers::smollm2::SmolLm2;
use pipebd_zoo::lm::NextTokenHead;
use serde::Deserialize;

use crate::common;

type Ad = Autodiff<Flex>;

#[derive(Deserialize)]
struct Reference {
    ids: Vec<Vec<i64>>,
    mask: Vec<Vec<f32>>,
    ffn_kept: usize,
    lr: f64,
    adam_eps: f64,
    steps: usize,
    blockwise: Part,
    stitched: Part,
}

#[derive(Deserialize)]
struct Part {
    losses: Vec<f64>,
}

fn reference() -> Reference {
    let path = common::repo().join("tests/data/smollm2-steps-reference.json");
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

/// `layer` with its SwiGLU narrowed to the first `kept` neurons.
fn narrowed(layer: &DecoderLayer<Ad>, kept: usize) -> DecoderLayer<Ad> {
    let mut layer = layer.clone();
    let ffn = layer.ffn.as_mut().expect("SmolLM2's layers have a feed-forward");
    let cut = |linear: &Linear<Ad>, dim: usize| Linear {
        weight: Param::from_tensor(linear.weight.val().narrow(dim, 0, kept).detach()),
        bias: None,
    };
    ffn.gate = cut(&ffn.gate, 1);
    ffn.up = cut(&ffn.up, 1);
    ffn.down = cut(&ffn.down, 0);
    layer
}

/// Each step's loss (before its update) against the reference's, within
/// `tolerance` relative.
fn assert_losses(what: &str, ours: &[f64], theirs: &[f64], tolerance: f64) {
    assert_eq!(ours.len(), theirs.len(), "{what}: step counts");
    for (step, (a, b)) in ours.iter().zip(theirs).enumerate() {
        let gap = (a - b).abs() / b.abs();
        assert!(gap <= tolerance, "{what}, step {step}: {a} against PyTorch's {b} ({gap:.2e} relative)");
    }
    assert!(ours.last() < ours.first(), "{what}: the loss should fall over the steps: {ours:?}");
}

#[test]
fn ten_adam_steps_of_a_decoder_student_match_pytorch_blockwise_and_stitched() {
    let reference = reference();
    let device = Default::default();
    let model = SmolLm2::<Ad>::load(&crate::smollm2::model_path(), &device).unwrap();
    let (batch, tokens) = (reference.ids.len(), reference.ids[0].len());
    let ids: Vec<i64> = reference.ids.concat();
    let mask: Vec<f32> = reference.mask.concat();
    let ids = Tensor::<Ad, 2, Int>::from_data(TensorData::new(ids, [batch, tokens]), &device);
    let mask = Tensor::<Ad, 2>::from_data(TensorData::new(mask, [batch, tokens]), &device);
    let x = model.embeddings.forward(ids).detach();
    let adam = AdamConfig::new().with_epsilon(reference.adam_eps as f32);

    // (A) Blockwise: layer 12, narrowed, learns the dense layer's output.
    let target = model.layers[12].forward(x.clone(), mask.clone()).detach();
    let mut student = narrowed(&model.layers[12], reference.ffn_kept);
    let mut optimizer = adam.init();
    let mut losses = Vec::new();
    for _ in 0..reference.steps {
        let loss = masked_mse(student.forward(x.clone(), mask.clone()), target.clone(), mask.clone());
        losses.push(loss.clone().into_scalar() as f64);
        let grads = GradientsParams::from_grads(loss.backward(), &student);
        student = optimizer.step(reference.lr, student, grads);
    }
    assert_losses("blockwise", &losses, &reference.blockwise.losses, 1e-5);

    // (B) Stitched: layers 0 and 1 (1 narrowed) through the frozen final
    // norm and LM head, on the KL to the dense layers' distributions.
    let head = NextTokenHead::new(model.head.clone());
    let teacher = model.layers[1].forward(model.layers[0].forward(x.clone(), mask.clone()), mask.clone());
    let teacher = Activation::Tokens { hidden: teacher.detach(), mask: mask.clone() };
    let mut students = vec![model.layers[0].clone(), narrowed(&model.layers[1], reference.ffn_kept)];
    let mut optimizer = adam.init();
    let mut losses = Vec::new();
    for _ in 0..reference.steps {
        let hidden = students[1].forward(students[0].forward(x.clone(), mask.clone()), mask.clone());
        let student = Activation::Tokens { hidden, mask: mask.clone() };
        let loss = head_kl(&head, student, teacher.clone(), 1.0).unwrap();
        losses.push(loss.clone().into_scalar() as f64);
        let grads = GradientsParams::from_grads(loss.backward(), &students);
        students = optimizer.step(reference.lr, students, grads);
    }
    // (float32 rounding alone moves PyTorch's own stitched losses by up to
    // 7e-6 relative: its float64 run, in the reference file.)
    assert_losses("stitched", &losses, &reference.stitched.losses, 1e-5);
}
