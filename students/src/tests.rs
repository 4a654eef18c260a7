//! Unit tests of the crate: every kind builds with the output shape its
//! forward pass gives, candidate sets train and choose as documented, and
//! bad configurations are refused naming the block and the field.

use burn::backend::Flex;
use burn::module::Module;
use burn::tensor::Tensor;
use pipebd_core::{Activation, Block};

use crate::{Downsample, EncoderInit, SkipBlock, StudentBlock, StudentBlockConfig, MAX_SIZE};

fn forward_shape(config: &StudentBlockConfig, input: [usize; 3]) -> (Vec<usize>, Vec<usize>) {
    let device = Default::default();
    let built = config.init::<Flex>(1, &input, &device).unwrap();
    let x = Tensor::<Flex, 4>::zeros([2, input[0], input[1], input[2]], &device);
    let actual = Block::forward(&built.module, Activation::Maps(x)).unwrap().dims()[1..].to_vec();
    (built.output_shape, actual)
}

#[test]
fn declared_output_shapes_match_the_forward_pass_for_every_downsample_mode() {
    for downsample in [Downsample::Pool, Downsample::Stride, Downsample::None] {
        for (c, hw) in [(1, 28), (32, 14), (64, 7)] {
            let configs = [
                StudentBlockConfig::Conv { width: 4, out_channels: 8, downsample },
                StudentBlockConfig::Separable {
                    out_channels: 8,
                    depth_multiplier: 1,
                    inner_relu: true,
                    downsample,
                },
                StudentBlockConfig::Bottleneck { rank: 4, out_channels: 8, inner_relu: false, downsample },
                StudentBlockConfig::Inverted { expansion: 3, kernel: 3, out_channels: 8, downsample },
                StudentBlockConfig::Inverted { expansion: 6, kernel: 5, out_channels: 8, downsample },
                StudentBlockConfig::Inverted { expansion: 2, kernel: 5, out_channels: c, downsample },
            ];
            for config in &configs {
                let (declared, actual) = forward_shape(config, [c, hw, hw]);
                assert_eq!(declared, actual, "{config:?} on {c}x{hw}x{hw}");
            }
        }
    }
    let (declared, actual) =
        forward_shape(&StudentBlockConfig::Head { hidden: 16, classes: 10 }, [128, 3, 3]);
    assert_eq!((declared, actual), (vec![10], vec![10]));
}

#[test]
fn encoder_blocks_keep_the_token_shape_and_refuse_images() {
    let device = Default::default();
    let config = StudentBlockConfig::Encoder { heads: 2, head_dim: 4, ffn: 16, init: EncoderInit::Random };
    let built = config.init::<Flex>(1, &[5, 12], &device).unwrap();
    assert_eq!(built.output_shape, vec![5, 12]);
    let input = Activation::Tokens {
        hidden: Tensor::zeros([3, 5, 12], &device),
        mask: Tensor::ones([3, 5], &device),
    };
    match Block::forward(&built.module, input) {
        Ok(Activation::Tokens { hidden, .. }) => assert_eq!(hidden.dims(), [3, 5, 12]),
        other => panic!("unexpected output {other:?}"),
    }
    let refused = Block::forward(&built.module, Activation::Maps(Tensor::zeros([1, 1, 5, 12], &device)));
    assert!(refused.unwrap_err().to_string().contains("`encoder` student block"));
    let err = config.init::<Flex>(2, &[1, 28, 28], &device).unwrap_err();
    assert!(err.to_string().contains("token states"), "{err}");
}

#[test]
fn an_inverted_block_adds_its_input_only_when_the_shapes_allow() {
    let device = Default::default();
    let same = StudentBlockConfig::Inverted {
        expansion: 2,
        kernel: 3,
        out_channels: 4,
        downsample: Downsample::None,
    };
    let built = same.init::<Flex>(1, &[4, 6, 6], &device).unwrap();
    // With every weight zero the block is the identity when residual, zero otherwise.
    let zeroed = built.module.map(&mut Zero);
    let x = Tensor::<Flex, 4>::ones([1, 4, 6, 6], &device);
    let out = Block::forward(&zeroed, Activation::Maps(x.clone())).unwrap();
    assert_eq!(out.dims(), [1, 4, 6, 6]);
    let Activation::Maps(out) = out else { panic!("feature maps expected") };
    assert_eq!(out.sum().into_scalar(), 144.0, "the input comes through");
    let pooled = StudentBlockConfig::Inverted {
        expansion: 2,
        kernel: 3,
        out_channels: 4,
        downsample: Downsample::Pool,
    };
    let zeroed = pooled.init::<Flex>(1, &[4, 6, 6], &device).unwrap().module.map(&mut Zero);
    let Activation::Maps(out) = Block::forward(&zeroed, Activation::Maps(x)).unwrap() else { panic!() };
    assert_eq!(out.sum().into_scalar(), 0.0, "no residual across a downsampling");
    let bad = StudentBlockConfig::Inverted {
        expansion: 2,
        kernel: 4,
        out_channels: 4,
        downsample: Downsample::Pool,
    };
    let err = bad.init::<Flex>(2, &[4, 6, 6], &device).unwrap_err();
    assert_eq!(err.to_string(), "student block 2 (inverted): `kernel` must be 3 or 5, got 4");
}

/// Sets every parameter to zero.
struct Zero;

impl<B: burn::tensor::backend::Backend> burn::module::ModuleMapper<B> for Zero {
    fn map_float<const D: usize>(
        &mut self,
        param: burn::module::Param<Tensor<B, D>>,
    ) -> burn::module::Param<Tensor<B, D>> {
        param.map(|t| t.zeros_like())
    }
}

#[test]
fn a_candidate_set_gives_each_candidate_the_gradient_of_its_own_loss() {
    type Train = burn::backend::Autodiff<Flex>;
    let device = Default::default();
    let first = StudentBlockConfig::Conv { width: 3, out_channels: 4, downsample: Downsample::Pool };
    let second = StudentBlockConfig::Inverted {
        expansion: 2,
        kernel: 3,
        out_channels: 4,
        downsample: Downsample::Pool,
    };
    let alone: u64 =
        [&first, &second].iter().map(|c| c.init::<Train>(1, &[2, 6, 6], &device).unwrap().flops).sum();
    let set = StudentBlockConfig::Candidates { candidates: vec![first, second] };
    let built = set.init::<Train>(1, &[2, 6, 6], &device).unwrap();
    assert_eq!(built.output_shape, vec![4, 3, 3]);
    assert_eq!(built.flops, alone, "a set costs its candidates' FLOPs together");
    // burn draws parameters at first use: draw them now, once, so that
    // the candidates' copies below share them.
    let module = built.module.clone().load_record(built.module.into_record());
    assert_eq!(module.candidates().len(), 2);
    let x = Tensor::<Train, 4>::random([3, 2, 6, 6], burn::tensor::Distribution::Default, &device);
    let target = Tensor::<Train, 4>::random([3, 4, 3, 3], burn::tensor::Distribution::Default, &device);
    let loss = pipebd_core::Loss::new(pipebd_core::LossKind::Mse);
    let total =
        module.distill_loss(Activation::Maps(x.clone()), Activation::Maps(target.clone()), &loss).unwrap();
    let total_grads = total.clone().backward();
    let mut sum = 0.0;
    for candidate in module.candidates() {
        // Alone: the candidate's loss and gradients, as if it were the only student.
        let own = candidate
            .distill_loss(Activation::Maps(x.clone()), Activation::Maps(target.clone()), &loss)
            .unwrap();
        sum += own.clone().into_scalar();
        let own_grads = own.backward();
        let mut checked = 0;
        candidate.visit(&mut CompareGrads { a: &own_grads, b: &total_grads, checked: &mut checked });
        assert!(checked > 0, "the candidate has parameters with gradients");
    }
    let total = total.into_scalar();
    assert!((total - sum).abs() <= 1e-5 * sum.abs(), "set loss {total} vs summed {sum}");
    // Stitching and evaluation see the first candidate's output.
    let out = Block::forward(&module, Activation::Maps(x.clone())).unwrap();
    let first_out = Block::forward(&module.candidates()[0], Activation::Maps(x)).unwrap();
    let (Activation::Maps(out), Activation::Maps(first_out)) = (out, first_out) else { panic!() };
    assert_eq!(out.into_data(), first_out.into_data());
}

#[test]
fn a_candidate_set_follows_its_largest_architecture_logit() {
    let device = Default::default();
    let conv = |width| StudentBlockConfig::Conv { width, out_channels: 4, downsample: Downsample::Pool };
    let set = StudentBlockConfig::Candidates { candidates: vec![conv(3), conv(2), StudentBlockConfig::Skip] };
    let built = set.init::<Flex>(1, &[4, 6, 6], &device);
    // Skip keeps 4 channels at 6x6: refused next to a pooling conv.
    assert!(built.is_err());
    let set = StudentBlockConfig::Candidates { candidates: vec![conv(3), conv(2)] };
    let module = set.init::<Flex>(1, &[2, 6, 6], &device).unwrap().module;
    let module = module.clone().load_record(module.into_record());
    let alpha = module.arch_logits().expect("a candidate set has architecture logits");
    assert_eq!(alpha.into_data().iter::<f32>().collect::<Vec<_>>(), [0.0, 0.0], "uniform at the start");
    let StudentBlock::Candidates(mut set) = module else { panic!("not a candidate set") };
    assert_eq!(set.argmax(), 0, "the first on ties");
    set.alpha = burn::module::Param::from_tensor(Tensor::from_floats([0.5, 0.75], &device));
    assert_eq!(set.argmax(), 1);
    let module = StudentBlock::Candidates(set);
    let x = Tensor::<Flex, 4>::random([3, 2, 6, 6], burn::tensor::Distribution::Default, &device);
    let out = Block::forward(&module, Activation::Maps(x.clone())).unwrap();
    let second = Block::forward(&module.candidates()[1], Activation::Maps(x)).unwrap();
    let (Activation::Maps(out), Activation::Maps(second)) = (out, second) else { panic!() };
    assert_eq!(out.into_data(), second.into_data());
    assert!(StudentBlock::<Flex>::Skip(SkipBlock::new()).arch_logits().is_none());
}

/// Asserts that every float parameter has the same gradient in `a` and `b`.
struct CompareGrads<'a, B: burn::tensor::backend::AutodiffBackend> {
    a: &'a B::Gradients,
    b: &'a B::Gradients,
    checked: &'a mut usize,
}

impl<B: burn::tensor::backend::AutodiffBackend> burn::module::ModuleVisitor<B> for CompareGrads<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<B, D>>) {
        let (Some(a), Some(b)) = (param.val().grad(self.a), param.val().grad(self.b)) else {
            panic!("a parameter without a gradient")
        };
        a.into_data().assert_approx_eq::<f32>(&b.into_data(), burn::tensor::Tolerance::default());
        *self.checked += 1;
    }
}

#[test]
fn candidate_sets_refuse_nesting_mismatched_shapes_and_emptiness() {
    let device = Default::default();
    let conv =
        |out_channels| StudentBlockConfig::Conv { width: 3, out_channels, downsample: Downsample::Pool };
    let err =
        |config: StudentBlockConfig| config.init::<Flex>(2, &[2, 6, 6], &device).unwrap_err().to_string();
    assert_eq!(
        err(StudentBlockConfig::Candidates { candidates: vec![] }),
        "student block 2 (candidates): `candidates` must list at least one student block"
    );
    let nested = StudentBlockConfig::Candidates { candidates: vec![conv(4)] };
    assert!(err(StudentBlockConfig::Candidates { candidates: vec![conv(4), nested] })
        .contains("candidate 2: candidate sets cannot nest"));
    let mismatched = err(StudentBlockConfig::Candidates { candidates: vec![conv(4), conv(5)] });
    assert!(
        mismatched.contains("candidate 2 (conv) outputs [5, 3, 3] but candidate 1 outputs [4, 3, 3]"),
        "{mismatched}"
    );
    let inner = err(StudentBlockConfig::Candidates { candidates: vec![conv(4), conv(0)] });
    assert!(inner.contains("candidate 2 (conv): `out_channels` must be at least 1"), "{inner}");
    let parsed: StudentBlockConfig = toml::from_str(
        "kind = \"candidates\"\ncandidates = [{ kind = \"conv\", width = 3, out_channels = 4 }, { kind = \"head\", hidden = 4, classes = 2 }]",
    )
    .unwrap();
    assert_eq!(parsed.candidates().len(), 2);
}

#[test]
fn a_skip_block_is_the_identity_and_cannot_stand_in_for_a_downsampling_block() {
    let device = Default::default();
    let built = StudentBlockConfig::Skip.init::<Flex>(3, &[5, 12], &device).unwrap();
    assert_eq!((built.output_shape.clone(), built.flops, built.module.num_params()), (vec![5, 12], 0, 0));
    let hidden = Tensor::<Flex, 3>::random([2, 5, 12], burn::tensor::Distribution::Default, &device);
    let mask = Tensor::<Flex, 2>::ones([2, 5], &device);
    let out = Block::forward(&built.module, Activation::Tokens { hidden: hidden.clone(), mask }).unwrap();
    let Activation::Tokens { hidden: out, .. } = out else { panic!("token states expected") };
    assert_eq!(out.into_data(), hidden.into_data());
    let conv = StudentBlockConfig::Conv { width: 3, out_channels: 4, downsample: Downsample::Pool };
    let set = StudentBlockConfig::Candidates { candidates: vec![conv, StudentBlockConfig::Skip] };
    let err = set.init::<Flex>(2, &[2, 6, 6], &device).unwrap_err().to_string();
    assert!(err.contains("candidate 2 (skip) outputs [2, 6, 6] but candidate 1 outputs [4, 3, 3]"), "{err}");
    let parsed: StudentBlockConfig = toml::from_str("kind = \"skip\"").unwrap();
    assert_eq!(parsed, StudentBlockConfig::Skip);
}

#[test]
fn zero_sizes_are_refused_naming_the_block_and_field() {
    let config = StudentBlockConfig::Bottleneck {
        rank: 0,
        out_channels: 8,
        inner_relu: false,
        downsample: Downsample::Pool,
    };
    let err = config.init::<Flex>(3, &[32, 14, 14], &Default::default()).unwrap_err();
    assert_eq!(err.to_string(), "student block 3 (bottleneck): `rank` must be at least 1");
}

/// Fuzzing's findings (issue 55): a size typed far too large was
/// allocated (64 GB for `out_channels = 1000000000`, a capacity
/// overflow panic for `rank = 2^63 - 1`); it is refused, naming it.
#[test]
fn sizes_too_large_to_allocate_are_refused_naming_the_field() {
    let device = Default::default();
    let bottleneck = |rank, out_channels| StudentBlockConfig::Bottleneck {
        rank,
        out_channels,
        inner_relu: false,
        downsample: Downsample::Pool,
    };
    let err = bottleneck(usize::MAX >> 1, 8).init::<Flex>(2, &[32, 14, 14], &device).unwrap_err().to_string();
    assert!(err.contains("`rank` = 9223372036854775807 is larger than 65536"), "{err}");
    let err = bottleneck(8192, 8192).init::<Flex>(2, &[32, 14, 14], &device).unwrap_err().to_string();
    assert!(err.contains("`rank` x `out_channels` = 8192 x 8192"), "{err}");
    // The largest allowed sizes still pass the check (not built here).
    assert!(bottleneck(MAX_SIZE, 256).check_sizes().is_ok());
    let decoder: StudentBlockConfig = toml::from_str("kind = \"decoder\"\nffn = 1000000000000").unwrap();
    let err = decoder.check_sizes().unwrap_err();
    assert!(err.contains("`ffn` = 1000000000000 is larger than 65536"), "{err}");
}
