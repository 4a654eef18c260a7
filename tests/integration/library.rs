//! The library door for a user's own blocks: a teacher and students built
//! from bare modules get their shapes and parameters inferred, and their
//! FLOPs from the user (`with_flops`), which the planner and the report read.

use burn::backend::{Autodiff, Flex};
use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use pipe_bd::{Activation, Block, BlockResult, FusedBackend, Students, Teacher};

#[derive(Module, Debug)]
struct Dense<B: burn::tensor::backend::Backend> {
    linear: Linear<B>,
}

impl<B: FusedBackend> Block<B> for Dense<B> {
    fn forward(&self, input: Activation<B>) -> BlockResult<Activation<B>> {
        match input {
            Activation::Flat(x) => Ok(Activation::Flat(self.linear.forward(x))),
            other => Err(pipe_bd::BlockError::block(format!("expected flat input, got {:?}", other.dims()))),
        }
    }
}

fn dense<B: FusedBackend>(inputs: usize, outputs: usize, device: &B::Device) -> Dense<B> {
    Dense { linear: LinearConfig::new(inputs, outputs).init(device) }
}

#[test]
fn blocks_from_bare_modules_take_their_flops_from_the_user() {
    let device = Default::default();
    let teacher =
        Teacher::from_blocks(vec![dense::<Flex>(8, 6, &device), dense(6, 4, &device)], &[8], &device)
            .unwrap();
    assert_eq!(teacher.specs.iter().map(|s| s.flops).collect::<Vec<_>>(), [0, 0], "FLOPs are not inferred");
    assert_eq!(teacher.specs[1].input_shape, [6]);
    assert_eq!(teacher.specs[1].params, 6 * 4 + 4);
    // Two FLOPs per multiply-accumulate of each layer.
    let teacher = teacher.with_flops(&[2 * 8 * 6, 2 * 6 * 4]).unwrap();
    assert_eq!(teacher.specs.iter().map(|s| s.flops).collect::<Vec<_>>(), [96, 48]);

    let blocks = vec![dense::<Autodiff<Flex>>(8, 6, &device), dense(6, 4, &device)];
    let students = Students::from_blocks(blocks, &teacher.specs, &device).unwrap();
    let students = students.with_flops(&[96, 48]).unwrap();
    assert_eq!(students.specs[0].flops, 96);
    let error = students.with_flops(&[1]).unwrap_err().to_string();
    assert!(error.contains("1 FLOPs counts given for 2 blocks"), "{error}");
}
