//! The block API on small modules: specs inferred from modules, checks
//! against declared specs, the loss and its temperature.

use burn::backend::{Autodiff, Flex};
use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::{Tensor, TensorData};
use pipebd_core::{Activation, Block, BlockSpec, Error, FusedBackend, Loss, LossKind, Students, Teacher};

type Train = Autodiff<Flex>;

#[derive(Module, Debug)]
struct Dense<B: burn::tensor::backend::Backend> {
    linear: Linear<B>,
}

impl<B: FusedBackend> Block<B> for Dense<B> {
    fn forward(&self, input: Activation<B>) -> pipebd_core::Result<Activation<B>> {
        match input {
            Activation::Flat(x) => Ok(Activation::Flat(self.linear.forward(x))),
            other => Err(Error::block(format!("expected flat input, got {:?}", other.dims()))),
        }
    }
}

fn dense<B: burn::tensor::backend::Backend>(inputs: usize, outputs: usize) -> Dense<B> {
    Dense { linear: LinearConfig::new(inputs, outputs).init(&Default::default()) }
}

#[test]
fn specs_are_inferred_from_the_modules_and_chained() {
    let device = Default::default();
    let teacher = Teacher::<Flex, _>::from_blocks(vec![dense(6, 5), dense(5, 3)], &[6], &device).unwrap();
    let shapes: Vec<_> =
        teacher.specs.iter().map(|s| (s.input_shape.clone(), s.output_shape.clone())).collect();
    assert_eq!(shapes, vec![(vec![6], vec![5]), (vec![5], vec![3])]);
    assert_eq!(teacher.specs.iter().map(|s| s.params).collect::<Vec<_>>(), vec![6 * 5 + 5, 5 * 3 + 3]);
    // The last block produces logits: soft-target cross-entropy; the others MSE.
    assert_eq!(teacher.specs[0].loss, LossKind::Mse);
    assert_eq!(teacher.specs[1].loss, LossKind::SoftTargetCrossEntropy);

    let students =
        Students::<Train, _>::from_blocks(vec![dense(6, 5), dense(5, 3)], &teacher.specs, &device).unwrap();
    assert_eq!(students.specs[1].loss, LossKind::SoftTargetCrossEntropy);
    assert_eq!(students.specs[0].params, 35);
}

#[test]
fn students_of_the_wrong_shape_or_count_are_refused() {
    let device = Default::default();
    let teacher = Teacher::<Flex, _>::from_blocks(vec![dense(6, 5), dense(5, 3)], &[6], &device).unwrap();
    let err = Students::<Train, _>::from_blocks(vec![dense(6, 4), dense(4, 3)], &teacher.specs, &device)
        .unwrap_err();
    assert!(matches!(err, Error::ShapeMismatch { block: 1, .. }), "{err}");
    let err = Students::<Train, _>::from_blocks(vec![dense(6, 5)], &teacher.specs, &device).unwrap_err();
    assert_eq!(err, Error::BlockCount { students: 1, teacher: 2 });
    // A block that cannot take its input says which block it is.
    let err = Teacher::<Flex, _>::from_blocks(vec![dense(6, 5), dense(4, 3)], &[6], &device).unwrap_err();
    assert!(matches!(err, Error::Block { block: 2, .. }) || err.to_string().contains("block 2"), "{err}");
}

#[test]
fn a_declared_parameter_count_and_output_shape_must_be_the_modules() {
    let device = Default::default();
    let block: Dense<Flex> = dense(6, 5);
    let spec = BlockSpec::infer("dense", &block, &[6], &device).unwrap();
    assert!(Teacher::<Flex, _>::new(vec![block.clone()], vec![spec.clone()]).is_ok());
    let wrong = BlockSpec { params: spec.params + 1, ..spec.clone() };
    let err = Teacher::<Flex, _>::new(vec![block.clone()], vec![wrong]).unwrap_err();
    assert!(err.to_string().contains("declares 36 parameters but the module has 35"), "{err}");
    let wrong = BlockSpec { output_shape: vec![4], ..spec };
    let err = Teacher::<Flex, _>::new(vec![block], vec![wrong]).unwrap_err();
    assert!(err.to_string().contains("declares output shape [4] but the module produces [5]"), "{err}");
}

fn logits(values: &[f32]) -> Tensor<Flex, 2> {
    Tensor::from_data(TensorData::new(values.to_vec(), [2, 3]), &Default::default())
}

/// Soft-target cross-entropy computed here from its definition.
fn reference_ce(student: &[f32], teacher: &[f32], temperature: f32) -> f32 {
    let softmax = |row: &[f32]| {
        let exps: Vec<f32> = row.iter().map(|v| (v / temperature).exp()).collect();
        let sum: f32 = exps.iter().sum();
        exps.into_iter().map(|e| e / sum).collect::<Vec<_>>()
    };
    let mut total = 0.0;
    for (s, t) in student.chunks(3).zip(teacher.chunks(3)) {
        let (p, q) = (softmax(t), softmax(s));
        total -= p.iter().zip(&q).map(|(p, q)| p * q.ln()).sum::<f32>();
    }
    total / 2.0 * temperature * temperature
}

#[test]
fn the_soft_target_loss_follows_its_definition_at_any_temperature() {
    let s = [0.5, -1.0, 2.0, 0.1, 0.2, 0.3];
    let t = [1.5, 0.0, -2.0, 3.0, -0.2, 0.4];
    for temperature in [1.0, 2.0, 4.0] {
        let loss = Loss::new(LossKind::SoftTargetCrossEntropy).with_temperature(temperature);
        let value: f32 =
            loss.compute(Activation::Flat(logits(&s)), Activation::Flat(logits(&t))).unwrap().into_scalar();
        let expected = reference_ce(&s, &t, temperature as f32);
        assert!(
            (value - expected).abs() < 1e-4 * expected.abs().max(1.0),
            "T={temperature}: {value} vs {expected}"
        );
    }
    let bad = Loss::new(LossKind::SoftTargetCrossEntropy).with_temperature(0.0);
    assert!(bad.compute(Activation::Flat(logits(&s)), Activation::Flat(logits(&t))).is_err());
}

#[test]
fn a_loss_of_mismatched_shapes_is_an_error_not_a_panic() {
    let device = Default::default();
    let a = Activation::Flat(Tensor::<Flex, 2>::zeros([2, 3], &device));
    let b = Activation::Flat(Tensor::<Flex, 2>::zeros([2, 4], &device));
    let err = Loss::new(LossKind::Mse).compute(a, b).unwrap_err();
    assert!(err.to_string().contains("differ"), "{err}");
}
