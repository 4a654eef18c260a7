//! The zoo of `examples/custom_zoo`: a teacher cut and student kinds of our
//! own (also used by `tests/integration/zoo.rs`).

use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::pool::{AdaptiveAvgPool2d, AdaptiveAvgPool2dConfig};
use burn::nn::{Linear, LinearConfig, PaddingConfig2d};
use burn::tensor::activation::relu;
use burn::tensor::backend::Backend;
use pipe_bd::eval::TopOneAccuracy;
use pipe_bd::serde::Deserialize;
use pipe_bd::{forward_chain, Activation, Block, BlockError, BlockResult, BlockSpec, DistillBackend};
use pipe_bd::{FusedBackend, Students, Teacher};
use pipebd_cli::config::{ConfigIssue, RunConfig};
use pipebd_cli::zoo::{parse_custom, parse_students, Workload, Zoo};
use pipebd_zoo::mnist::Split;
use pipebd_zoo::teachers::mnist_cnn::{block_flops, MnistBlock, MnistCnn};

/// The zoo's own settings: the `[custom]` table. (serde comes through
/// pipe-bd: this crate needs only `pipe-bd` and `burn`.)
#[derive(Deserialize)]
#[serde(crate = "pipe_bd::serde", deny_unknown_fields)]
struct Custom {
    /// How many of the CNN's four blocks each student replaces, in order.
    cut: Vec<usize>,
}

/// The zoo's student kinds: one `[[students]]` table each.
#[derive(Clone, Copy, Deserialize)]
#[serde(crate = "pipe_bd::serde", tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
enum StudentKind {
    /// Two stride-2 3x3 convolutions, pooled to the teacher block's size.
    Strided { width: usize },
    /// Flatten, one hidden layer, and the output features.
    Mlp { hidden: usize },
}

/// Consecutive blocks of the pretrained CNN, run as one teacher block.
#[derive(Module, Debug)]
pub struct Group<B: Backend> {
    parts: Vec<MnistBlock<B>>,
}

impl<B: FusedBackend> Block<B> for Group<B> {
    fn forward(&self, input: Activation<B>) -> BlockResult<Activation<B>> {
        forward_chain(&self.parts, input)
    }
}

/// Two stride-2 convolutions and a pooling to the wanted size.
#[derive(Module, Debug)]
pub struct Strided<B: Backend> {
    first: Conv2d<B>,
    second: Conv2d<B>,
    pool: AdaptiveAvgPool2d,
}

/// A hidden layer and the output features.
#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    hidden: Linear<B>,
    output: Linear<B>,
}

/// The zoo's student module: one variant per kind.
#[derive(Module, Debug)]
pub enum MyStudent<B: Backend> {
    Strided(Strided<B>),
    Mlp(Mlp<B>),
}

impl<B: FusedBackend> Block<B> for MyStudent<B> {
    fn forward(&self, input: Activation<B>) -> BlockResult<Activation<B>> {
        match self {
            Self::Strided(Strided { first, second, pool }) => {
                let x = relu(first.forward(input.into_maps(0)?));
                Ok(Activation::Maps(pool.forward(relu(second.forward(x)))))
            }
            Self::Mlp(Mlp { hidden, output }) => {
                let x = match input {
                    Activation::Maps(maps) => maps.flatten(1, 3),
                    Activation::Flat(x) => x,
                    other => {
                        return Err(BlockError::block(format!(
                            "`mlp` takes maps or flat features, got {:?}",
                            other.dims()
                        )))
                    }
                };
                Ok(Activation::Flat(output.forward(relu(hidden.forward(x)))))
            }
        }
    }
}

impl StudentKind {
    /// The module for a block from `input` to `output` (per-sample shapes).
    fn init<B: Backend>(
        &self,
        input: &[usize],
        output: &[usize],
        device: &B::Device,
    ) -> BlockResult<MyStudent<B>> {
        let fail = |message: String| BlockError::block(message);
        match (*self, input, output) {
            (Self::Strided { width }, [channels, ..], [out_channels, height, width_out]) => {
                let conv = |from, to| {
                    Conv2dConfig::new([from, to], [3, 3])
                        .with_stride([2, 2])
                        .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
                        .init(device)
                };
                Ok(MyStudent::Strided(Strided {
                    first: conv(*channels, width),
                    second: conv(width, *out_channels),
                    pool: AdaptiveAvgPool2dConfig::new([*height, *width_out]).init(),
                }))
            }
            (Self::Mlp { hidden }, input, [features]) => Ok(MyStudent::Mlp(Mlp {
                hidden: LinearConfig::new(input.iter().product(), hidden).init(device),
                output: LinearConfig::new(hidden, *features).init(device),
            })),
            (Self::Strided { .. }, _, _) => {
                Err(fail(format!("`strided` maps images to images, not {output:?}")))
            }
            (Self::Mlp { .. }, _, _) => Err(fail(format!("`mlp` produces flat features, not {output:?}"))),
        }
    }
}

impl StudentKind {
    /// Forward FLOPs per sample (two per multiply-accumulate) of the block
    /// with `spec`'s shapes.
    fn flops(&self, spec: &BlockSpec) -> u64 {
        let (input, output) = (&spec.input_shape, &spec.output_shape);
        let product = |s: &[usize]| s.iter().product::<usize>() as u64;
        match (*self, input.as_slice()) {
            (Self::Strided { width }, [channels, height, breadth]) => {
                // 3x3 stride-2 convolutions: the first to half, the second to a quarter of the size.
                let (h1, w1) = (height.div_ceil(2) as u64, breadth.div_ceil(2) as u64);
                let (h2, w2) = (h1.div_ceil(2), w1.div_ceil(2));
                let out_channels = output[0] as u64;
                2 * 9 * (*channels as u64 * width as u64 * h1 * w1 + width as u64 * out_channels * h2 * w2)
            }
            (Self::Mlp { hidden }, _) => {
                2 * (product(input) * hidden as u64 + hidden as u64 * product(output))
            }
            _ => 0,
        }
    }
}

/// The zoo: what `pipebd` builds from a config, for our own kinds.
pub struct MyZoo;

impl MyZoo {
    /// The CNN's four blocks grouped as `[custom] cut` says, on `device`.
    fn teacher<B: FusedBackend>(
        config: &RunConfig,
        cnn: MnistCnn<B>,
        device: &B::Device,
    ) -> pipe_bd::Result<Teacher<B, Group<B>>> {
        let cut = custom(config)?.cut;
        let mut parts = cnn.into_blocks().into_iter();
        let groups: Vec<Group<B>> =
            cut.iter().map(|&n| Group { parts: parts.by_ref().take(n).collect() }).collect();
        // FLOPs for the planner and the report: the sum over each group's CNN blocks.
        let flops = block_flops();
        let mut first = 0;
        let group_flops: Vec<u64> = cut
            .iter()
            .map(|&n| {
                first += n;
                flops[first - n..first].iter().sum()
            })
            .collect();
        Ok(Teacher::from_blocks(groups, &[1, 28, 28], device)?.with_flops(&group_flops)?)
    }
}

fn custom(config: &RunConfig) -> pipe_bd::Result<Custom> {
    parse_custom(config).map_err(ConfigIssue::into_plain_error)
}

impl Zoo for MyZoo {
    type Teacher<B: FusedBackend> = Group<B>;
    type Student<B: DistillBackend> = MyStudent<B>;

    fn check_config(&self, config: &RunConfig) -> Result<(), ConfigIssue> {
        if config.data.dataset != "mnist" {
            let message = format!("this zoo serves `mnist`, not `{}`", config.data.dataset);
            return Err(ConfigIssue::new("data", "dataset", message));
        }
        if config.teacher.kind != "mnist-cnn-cut" {
            let message = format!("this zoo serves `mnist-cnn-cut`, not `{}`", config.teacher.kind);
            return Err(ConfigIssue::new("teacher", "kind", message));
        }
        let Custom { cut } = parse_custom(config)?;
        if cut.contains(&0) || cut.iter().sum::<usize>() != 4 {
            return Err(ConfigIssue::new(
                "custom",
                "cut",
                format!("must be positive and add up to 4, got {cut:?}"),
            ));
        }
        let students: Vec<StudentKind> = parse_students(config)?;
        if students.len() != cut.len() {
            let message =
                format!("{} student blocks for the {} teacher blocks of `cut`", students.len(), cut.len());
            return Err(ConfigIssue::new("students", "", message));
        }
        Ok(())
    }

    fn teacher_specs(&self, config: &RunConfig) -> pipe_bd::Result<Vec<BlockSpec>> {
        let device = Default::default();
        Ok(Self::teacher::<burn::backend::Flex>(config, MnistCnn::init(&device), &device)?.specs)
    }

    fn check_inputs(&self, config: &RunConfig) -> pipe_bd::Result<()> {
        pipebd_zoo::mnist::check_mnist_files(&config.data.dir)?;
        MnistCnn::<burn::backend::Flex>::load_pytorch(&config.teacher.weights, &Default::default())
            .map_err(pipe_bd::Error::teacher)?;
        Ok(())
    }

    fn workload<B: FusedBackend>(
        &self,
        config: &RunConfig,
        device: &B::Device,
        with_evaluation: bool,
    ) -> pipe_bd::Result<Workload<B, Group<B>>> {
        let cnn = MnistCnn::load_pytorch(&config.teacher.weights, device).map_err(pipe_bd::Error::teacher)?;
        let test = match with_evaluation {
            true => Some(pipebd_zoo::mnist::load(&config.data.dir, Split::Test, config.data.test_limit)?),
            false => None,
        };
        Ok(Workload {
            teacher: Self::teacher(config, cnn, device)?,
            train: Box::new(pipebd_zoo::mnist::load(
                &config.data.dir,
                Split::Train,
                config.data.train_limit,
            )?),
            // Top-1 accuracy of the stitched student on the test images.
            evaluation: test.map(|test| Box::new(TopOneAccuracy(test)) as _),
        })
    }

    fn students<B: DistillBackend>(
        &self,
        config: &RunConfig,
        teacher: &[BlockSpec],
        device: &B::Device,
    ) -> pipe_bd::Result<Students<B, MyStudent<B>>> {
        let kinds: Vec<StudentKind> = parse_students(config).map_err(ConfigIssue::into_plain_error)?;
        // burn draws from one process-wide generator: keep other threads'
        // draws out of this seeded sequence until the blocks are built.
        let rng = pipe_bd::rng::burn_rng_lock();
        B::seed(device, config.seed);
        let blocks = kinds
            .iter()
            .zip(teacher)
            .map(|(kind, spec)| kind.init::<B>(&spec.input_shape, &spec.output_shape, device))
            .collect::<BlockResult<Vec<_>>>()?;
        let students = Students::from_blocks(blocks, teacher, device)?;
        drop(rng);
        // FLOPs per sample, for the report and the planner (0 = unknown).
        let flops: Vec<u64> = students.specs.iter().zip(&kinds).map(|(s, kind)| kind.flops(s)).collect();
        Ok(students.with_flops(&flops)?)
    }
}
