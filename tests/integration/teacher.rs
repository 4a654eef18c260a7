//! The pretrained MNIST CNN teacher imported from its PyTorch state dict.

use burn::backend::Flex;
use pipe_bd::eval::{accuracy, Network};
use pipebd_cli::config::{RunConfig, TeacherConfig};
use pipebd_zoo::build_teacher;
use pipebd_zoo::mnist::Split;

use crate::common;

fn run_config(teacher: TeacherConfig) -> RunConfig {
    let text = common::small_config(64, 64, 1);
    let mut config = RunConfig::parse(&text, std::path::Path::new("test.toml")).unwrap();
    config.teacher = teacher;
    config
}

fn teacher_config() -> RunConfig {
    run_config(TeacherConfig::new("mnist-cnn", common::teacher_weights()))
}

#[test]
fn imported_teacher_classifies_real_test_images() {
    let device = Default::default();
    let teacher = build_teacher::<Flex>(&teacher_config(), &device).unwrap();
    let test = pipebd_zoo::mnist::load(&common::mnist_dir(), Split::Test, Some(1000)).unwrap();
    let run_teacher = |x| pipe_bd::forward_chain(&teacher.blocks, x);
    let acc = accuracy(&Network::new(&run_teacher, &teacher.specs), &test, &device, 250).unwrap();
    assert!(acc > 0.98, "teacher accuracy {acc} on 1000 test images");
}

#[test]
fn teacher_has_four_chained_blocks_with_the_documented_shapes() {
    let teacher = build_teacher::<Flex>(&teacher_config(), &Default::default()).unwrap();
    let outputs: Vec<Vec<usize>> = teacher.specs.iter().map(|s| s.output_shape.clone()).collect();
    assert_eq!(outputs, vec![vec![32, 14, 14], vec![64, 7, 7], vec![128, 3, 3], vec![10]]);
    let params: usize = teacher.specs.iter().map(|s| s.params).sum();
    assert_eq!(params, 390_410, "the state dict holds 390,410 parameters");
}

#[test]
fn corrupt_weights_are_refused_with_the_file_named() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("broken.pth");
    std::fs::write(&path, b"not a pytorch file").unwrap();
    let config = run_config(TeacherConfig::new("mnist-cnn", path.clone()));
    let err = build_teacher::<Flex>(&config, &Default::default()).unwrap_err();
    assert!(err.to_string().contains("broken.pth"), "{err}");
}
