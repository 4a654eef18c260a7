//! Timing of the fused ops against the unfused burn ops, side by side.
//!
//! Each case runs on the same backend and device, at sizes of the MNIST
//! workload (batch 256 unless asked otherwise): the distillation losses of the teacher's blocks, the
//! students' pointwise convolutions and the head's linear layers; and the
//! decoder layer's ops at SmolLM2-135M's sizes (`batch / 16` sequences of 32
//! tokens: 16 at the default batch, the LLM recipes' own). Both
//! directions are timed: the forward alone (no gradient tracking) and the
//! forward plus backward. The matmul ops are timed twice: with our fused
//! kernel forced (`[kernel]`) and as the engine runs them (`[auto]`: the
//! faster of the fused kernel and burn's matmul plus our epilogue kernel,
//! picked per shape at the first call). `pipebd kernels --bench` prints the
//! table.

use std::time::Instant;

use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Tensor};

use crate::reference::unfused;
use burn::tensor::ops::ConvOptions;

use crate::{
    conv2d, conv2d_pool, linear, loss, max_pool2x2, pointwise_conv, set_conv_variant, set_matmul_variant,
    ConvVariant, DistillBackend, Epilogue, MatmulVariant,
};

/// One timed case: median milliseconds per call of each side.
#[derive(Debug, Clone)]
pub struct BenchRow {
    /// The op.
    pub op: String,
    /// Its input shape and options.
    pub case: String,
    /// Fused, forward only.
    pub fused_forward_ms: f64,
    /// Unfused burn ops, forward only.
    pub unfused_forward_ms: f64,
    /// Fused, forward and backward.
    pub fused_train_ms: f64,
    /// Unfused burn ops, forward and backward.
    pub unfused_train_ms: f64,
}

impl BenchRow {
    /// Unfused time over fused time, forward only (above 1: the kernel wins).
    pub fn forward_speedup(&self) -> f64 {
        self.unfused_forward_ms / self.fused_forward_ms
    }

    /// Unfused time over fused time, forward and backward.
    pub fn train_speedup(&self) -> f64 {
        self.unfused_train_ms / self.fused_train_ms
    }
}

/// Median milliseconds of `repeats` calls of `f`, after two warm-up calls,
/// each followed by a device sync so that queued kernels are counted.
fn median_ms<B: Backend>(device: &B::Device, repeats: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..2 {
        f();
        let _ = B::sync(device);
    }
    let mut times: Vec<f64> = (0..repeats.max(1))
        .map(|_| {
            let start = Instant::now();
            f();
            let _ = B::sync(device);
            start.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

fn normal<B: Backend, const D: usize>(shape: [usize; D], device: &B::Device) -> Tensor<B, D> {
    Tensor::random(shape, Distribution::Normal(0.0, 1.0), device)
}

/// A loss case: `(student, teacher) -> loss` fused and unfused.
fn loss_row<B: DistillBackend, const D: usize>(
    op: &str,
    shape: [usize; D],
    repeats: usize,
    device: &B::Device,
    fused: fn(Tensor<B, D>, Tensor<B, D>) -> Tensor<B, 1>,
    reference: fn(Tensor<B, D>, Tensor<B, D>) -> Tensor<B, 1>,
) -> BenchRow {
    let student = normal::<B::InnerBackend, D>(shape, device);
    let teacher = normal::<B::InnerBackend, D>(shape, device);
    let forward = |f: fn(Tensor<B, D>, Tensor<B, D>) -> Tensor<B, 1>| {
        median_ms::<B>(device, repeats, || {
            let _ = f(Tensor::from_inner(student.clone()), Tensor::from_inner(teacher.clone()));
        })
    };
    let train = |f: fn(Tensor<B, D>, Tensor<B, D>) -> Tensor<B, 1>| {
        median_ms::<B>(device, repeats, || {
            let s = Tensor::<B, D>::from_inner(student.clone()).require_grad();
            let grads = f(s.clone(), Tensor::from_inner(teacher.clone())).backward();
            let _ = s.grad(&grads);
        })
    };
    BenchRow {
        op: op.to_string(),
        case: format!("{shape:?}"),
        fused_forward_ms: forward(fused),
        unfused_forward_ms: forward(reference),
        fused_train_ms: train(fused),
        unfused_train_ms: train(reference),
    }
}

type Layer<B, const D: usize, const DW: usize> =
    dyn Fn(Tensor<B, D>, Tensor<B, DW>, Option<Tensor<B, 1>>) -> Tensor<B, D>;

/// A layer case: `(x, weight, bias) -> y`, trained through `sum(y)`.
#[allow(clippy::too_many_arguments)]
fn layer_row<B: DistillBackend, const D: usize, const DW: usize>(
    op: &str,
    case: String,
    x_shape: [usize; D],
    w_shape: [usize; DW],
    bias_len: usize,
    repeats: usize,
    device: &B::Device,
    fused: &Layer<B, D, DW>,
    reference: &Layer<B, D, DW>,
) -> BenchRow {
    let x = normal::<B::InnerBackend, D>(x_shape, device);
    let w = normal::<B::InnerBackend, DW>(w_shape, device).mul_scalar(0.1);
    let b = normal::<B::InnerBackend, 1>([bias_len], device);
    let forward = |f: &Layer<B, D, DW>| {
        median_ms::<B>(device, repeats, || {
            let _ = f(
                Tensor::from_inner(x.clone()),
                Tensor::from_inner(w.clone()),
                Some(Tensor::from_inner(b.clone())),
            );
        })
    };
    let train = |f: &Layer<B, D, DW>| {
        median_ms::<B>(device, repeats, || {
            let xs = Tensor::<B, D>::from_inner(x.clone()).require_grad();
            let ws = Tensor::<B, DW>::from_inner(w.clone()).require_grad();
            let bs = Tensor::<B, 1>::from_inner(b.clone()).require_grad();
            let grads = f(xs.clone(), ws.clone(), Some(bs.clone())).sum().backward();
            let _ = (xs.grad(&grads), ws.grad(&grads), bs.grad(&grads));
        })
    };
    BenchRow {
        op: op.to_string(),
        case,
        fused_forward_ms: forward(fused),
        unfused_forward_ms: forward(reference),
        fused_train_ms: train(fused),
        unfused_train_ms: train(reference),
    }
}

type Op<B, const D: usize, const N: usize, const DO: usize> = dyn Fn([Tensor<B, D>; N]) -> Tensor<B, DO>;

/// An op's case on `N` inputs: `inputs -> output`, trained through
/// `sum(output)` with the gradient of every input.
fn op_row<B: DistillBackend, const D: usize, const N: usize, const DO: usize>(
    op: &str,
    case: String,
    inputs: [Tensor<B::InnerBackend, D>; N],
    repeats: usize,
    device: &B::Device,
    fused: &Op<B, D, N, DO>,
    reference: &Op<B, D, N, DO>,
) -> BenchRow {
    let forward = |f: &Op<B, D, N, DO>| {
        median_ms::<B>(device, repeats, || {
            let _ = f(inputs.clone().map(Tensor::from_inner));
        })
    };
    let train = |f: &Op<B, D, N, DO>| {
        median_ms::<B>(device, repeats, || {
            let tracked = inputs.clone().map(|x| Tensor::<B, D>::from_inner(x).require_grad());
            let grads = f(tracked.clone()).sum().backward();
            for x in &tracked {
                let _ = x.grad(&grads);
            }
        })
    };
    BenchRow {
        op: op.to_string(),
        case,
        fused_forward_ms: forward(fused),
        unfused_forward_ms: forward(reference),
        fused_train_ms: train(fused),
        unfused_train_ms: train(reference),
    }
}

/// The decoder layer's ops at SmolLM2-135M's sizes (576 wide, 9 query heads
/// over 3 key/value heads of 64, SwiGLU 1536, 49,152 classes), on `batch /
/// 16` sequences of 32 tokens (and 128 for the attention): the backend's op
/// against the burn-op reference of [`crate::llama`] (differentiated by
/// burn's autodiff).
fn decoder_rows<B: DistillBackend>(rows: &mut Vec<BenchRow>, options: &BenchOptions, device: &B::Device) {
    use crate::llama::{self, CausalHeads};
    use crate::reference::{unwrap as prim, wrap as tensor};
    // SmolLM2-135M's layer (the kernels crate names no teacher here).
    let (hidden, ffn, heads, kv_heads, head_dim, epsilon) = (576, 1536, 9, 3, 64, 1e-5);
    let repeats = options.repeats;
    let batch = (options.batch / 16).max(1);
    let tokens = batch * 32;
    if options.wants("rms-norm") {
        let inputs = [normal([tokens, hidden], device), normal([1, hidden], device)];
        let norm = |reference: bool| {
            move |[x, gamma]: [Tensor<B, 2>; 2]| {
                let gamma = prim(gamma.reshape([hidden]));
                tensor::<B, 2>(match reference {
                    true => llama::rms_norm_reference::<B>(prim(x), gamma, epsilon, false).output,
                    false => B::rms_norm(prim(x), gamma, epsilon, false).output,
                })
            }
        };
        let case = format!("[{tokens}, {hidden}]");
        record(
            rows,
            options,
            op_row::<B, 2, 2, 2>("rms-norm", case, inputs, repeats, device, &norm(false), &norm(true)),
        );
    }
    if options.wants("swiglu") {
        let inputs = [normal([tokens, ffn], device), normal([tokens, ffn], device)];
        let gated = |reference: bool| {
            move |[gate, up]: [Tensor<B, 2>; 2]| {
                tensor::<B, 2>(match reference {
                    true => llama::swiglu_reference::<B>(prim(gate), prim(up)),
                    false => B::swiglu(prim(gate), prim(up)),
                })
            }
        };
        let case = format!("[{tokens}, {ffn}]");
        record(
            rows,
            options,
            op_row::<B, 2, 2, 2>("swiglu", case, inputs, repeats, device, &gated(false), &gated(true)),
        );
    }
    for length in [32, 128].into_iter().filter(|_| options.wants("causal-attention")) {
        let layout = CausalHeads { heads, kv_heads, rope_base: 100_000.0 };
        let (q_width, kv_width) = (heads * head_dim, kv_heads * head_dim);
        let inputs = [
            normal([batch, length, q_width], device),
            normal([batch, length, kv_width], device),
            normal([batch, length, kv_width], device),
        ];
        // The last quarter of every other sequence is padding.
        let mask: Vec<f32> = (0..batch * length)
            .map(|i| f32::from(i / length % 2 == 0 || i % length < 3 * length / 4))
            .collect();
        let mask = Tensor::<B, 2>::from_data(burn::tensor::TensorData::new(mask, [batch, length]), device);
        let attend = |reference: bool| {
            let mask = mask.clone();
            move |[q, k, v]: [Tensor<B, 3>; 3]| {
                let (q, k, v, m) = (prim(q), prim(k), prim(v), prim(mask.clone()));
                tensor::<B, 3>(match reference {
                    true => llama::causal_attention_reference::<B>(q, k, v, m, layout, false).context,
                    false => B::causal_attention(q, k, v, m, layout, false).context,
                })
            }
        };
        let case = format!("[{batch}, {length}, {}/{}x{head_dim}]", heads, kv_heads);
        let (fused, reference) = (attend(false), attend(true));
        record(
            rows,
            options,
            op_row::<B, 3, 3, 3>("causal-attention", case, inputs, repeats, device, &fused, &reference),
        );
    }
    if options.wants("head-kl") {
        let teacher = normal::<B, 2>([tokens, 49_152], device).mul_scalar(3.0);
        let weights = Tensor::<B, 1>::ones([tokens], device);
        let kl = |reference: bool| {
            let (teacher, weights) = (teacher.clone(), weights.clone());
            move |[student]: [Tensor<B, 2>; 1]| {
                let (s, t, w) = (prim(student), prim(teacher.clone()), prim(weights.clone()));
                tensor::<B, 1>(match reference {
                    true => llama::weighted_kl_reference::<B>(s, t, w, 1.0, false).loss,
                    false => B::weighted_kl_loss(s, t, w, 1.0, false).loss,
                })
            }
        };
        let inputs = [normal::<B::InnerBackend, 2>([tokens, 49_152], device).mul_scalar(3.0)];
        let case = format!("[{tokens}, 49152]");
        record(
            rows,
            options,
            op_row::<B, 2, 1, 1>("head-kl", case, inputs, repeats, device, &kl(false), &kl(true)),
        );
    }
}

/// What to time: the cases of the ops whose names start with one of
/// `only` (all when empty), at batch `batch`, with `repeats` timed calls per
/// side and direction.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// Timed calls per case, side and direction (the median is shown).
    pub repeats: usize,
    /// Samples per batch.
    pub batch: usize,
    /// Op name prefixes to time (all ops when empty).
    pub only: Vec<String>,
    /// Called with each row as soon as it is timed (a long bench's progress).
    pub progress: Option<fn(&BenchRow)>,
}

impl Default for BenchOptions {
    /// 10 repeats of every op at batch 256, no progress.
    fn default() -> Self {
        Self { repeats: 10, batch: 256, only: Vec::new(), progress: None }
    }
}

impl BenchOptions {
    /// True when the cases of op `op` are to be timed.
    pub fn wants(&self, op: &str) -> bool {
        self.only.is_empty() || self.only.iter().any(|o| op.starts_with(o.as_str()))
    }
}

/// Keeps a timed row, and shows it at once where the caller follows along.
fn record(rows: &mut Vec<BenchRow>, options: &BenchOptions, row: BenchRow) {
    if let Some(show) = options.progress {
        show(&row);
    }
    rows.push(row);
}

/// Times every case with `repeats` timed calls per side and direction.
pub fn run<B: DistillBackend>(device: &B::Device, repeats: usize) -> Vec<BenchRow> {
    run_with::<B>(device, &BenchOptions { repeats, ..Default::default() })
}

/// Times the cases `options` selects.
pub fn run_with<B: DistillBackend>(device: &B::Device, options: &BenchOptions) -> Vec<BenchRow> {
    let (repeats, batch) = (options.repeats, options.batch);
    let wanted = |op: &str| options.wants(op);
    let mut rows = Vec::new();
    for shape in
        [[batch, 32, 14, 14], [batch, 64, 7, 7], [batch, 128, 3, 3]].into_iter().filter(|_| wanted("mse"))
    {
        record(&mut rows, options, loss_row::<B, 4>("mse", shape, repeats, device, loss::mse, unfused::mse));
    }
    if wanted("soft-ce") {
        record(
            &mut rows,
            options,
            loss_row::<B, 2>(
                "soft-ce",
                [batch, 10],
                repeats,
                device,
                loss::soft_target_cross_entropy,
                unfused::soft_target_cross_entropy,
            ),
        );
    }
    if wanted("linear") || wanted("pointwise-conv") {
        for variant in [MatmulVariant::Fused, MatmulVariant::Split, MatmulVariant::Auto] {
            set_matmul_variant(variant);
            layer_rows::<B>(&mut rows, variant, options, device);
        }
        set_matmul_variant(MatmulVariant::Auto);
    }
    for variant in [ConvVariant::Tiled, ConvVariant::Direct, ConvVariant::Auto] {
        set_conv_variant(variant);
        conv_rows::<B>(&mut rows, variant, options, device);
    }
    set_conv_variant(ConvVariant::Auto);
    // The separable students' depthwise 3x3 (one filter per channel).
    for (channels, hw) in [(32, 14), (64, 7)].into_iter().filter(|_| wanted("depthwise3x3")) {
        let conv = ConvOptions::new([1, 1], [1, 1], [1, 1], channels);
        let reference_options = conv.clone();
        record(
            &mut rows,
            options,
            layer_row::<B, 4, 4>(
                "depthwise3x3",
                format!("[{batch}, {channels}, {hw}, {hw}] relu"),
                [batch, channels, hw, hw],
                [channels, 1, 3, 3],
                channels,
                repeats,
                device,
                &move |x, w, b| conv2d(x, w, b, conv.clone(), Epilogue::Relu),
                &move |x, w, b| {
                    burn::tensor::activation::relu(burn::tensor::module::conv2d(
                        x,
                        w,
                        b,
                        reference_options.clone(),
                    ))
                },
            ),
        );
    }
    if wanted("adam-step") {
        optimizer_rows::<B>(&mut rows, options, device);
    }
    decoder_rows::<B>(&mut rows, options, device);
    for (channels, hw) in [(32, 28), (64, 14), (128, 7)].into_iter().filter(|_| wanted("max-pool-2x2")) {
        record(
            &mut rows,
            options,
            layer_row::<B, 4, 1>(
                "max-pool-2x2",
                format!("[{batch}, {channels}, {hw}, {hw}]"),
                [batch, channels, hw, hw],
                [1],
                1,
                repeats,
                device,
                &|x, w, _| max_pool2x2(x) * w.reshape([1, 1, 1, 1]),
                &|x, w, _| {
                    burn::tensor::module::max_pool2d(x, [2, 2], [2, 2], [0, 0], [1, 1], false)
                        * w.reshape([1, 1, 1, 1])
                },
            ),
        );
    }
    rows
}

/// One Adam step over a block's parameters: the backend's update
/// ([`crate::FusedBackend::optimizer_step`], one launch on CubeCL backends)
/// against burn's ops one tensor at a time, as burn's `Adam` runs them. An
/// update has no backward pass: both column pairs time the same step.
fn optimizer_rows<B: DistillBackend>(rows: &mut Vec<BenchRow>, options: &BenchOptions, device: &B::Device) {
    let repeats = options.repeats;
    use crate::optim::{reference_step, AdamRule, ParamSlot, UpdateRule};
    use crate::FusedBackend;
    type Inner<B> = <B as burn::tensor::backend::AutodiffBackend>::InnerBackend;
    let rule = UpdateRule::Adam(AdamRule { beta_1: 0.9, beta_2: 0.999, epsilon: 1e-5, weight_decay: None });
    let blocks: [(&str, &[&[usize]]); 2] = [
        (
            "bottleneck block (6 tensors)",
            &[&[16, 32, 1, 1], &[16], &[16, 16, 3, 3], &[16], &[64, 16, 1, 1], &[64]],
        ),
        ("head block (4 tensors)", &[&[1152, 128], &[128], &[128, 10], &[10]]),
    ];
    for (case, shapes) in blocks {
        let tensor = |shape: &[usize]| {
            let n: usize = shape.iter().product();
            normal::<Inner<B>, 1>([n], device).into_primitive().tensor()
        };
        let params: Vec<_> = shapes.iter().map(|s| tensor(s)).collect();
        let grads: Vec<_> = shapes.iter().map(|s| tensor(s)).collect();
        let slots = |step: &dyn Fn(Vec<ParamSlot<Inner<B>>>) -> Vec<crate::ParamUpdate<Inner<B>>>| {
            let first: Vec<_> = params
                .iter()
                .zip(&grads)
                .map(|(p, g)| ParamSlot { param: p.clone(), grad: g.clone(), state: None })
                .collect();
            // One warm step, so that the timed ones update existing moments.
            step(first)
                .into_iter()
                .zip(&grads)
                .map(|(u, g)| ParamSlot { param: u.param, grad: g.clone(), state: u.state })
                .collect::<Vec<_>>()
        };
        let fused_step =
            |s: Vec<ParamSlot<Inner<B>>>| <Inner<B> as FusedBackend>::optimizer_step(s, &rule, 1e-3);
        let burn_step = |s: Vec<ParamSlot<Inner<B>>>| reference_step::<Inner<B>>(s, &rule, 1e-3);
        let warm_fused = slots(&fused_step);
        let warm_burn = slots(&burn_step);
        let fused = median_ms::<B>(device, repeats, || {
            let _ = fused_step(warm_fused.clone());
        });
        let unfused = median_ms::<B>(device, repeats, || {
            let _ = burn_step(warm_burn.clone());
        });
        record(
            rows,
            options,
            BenchRow {
                op: "adam-step".into(),
                case: case.into(),
                fused_forward_ms: fused,
                unfused_forward_ms: unfused,
                fused_train_ms: fused,
                unfused_train_ms: unfused,
            },
        );
    }
}

/// The dense convolutions (3x3, and with the 2x2 max-pool fused in) with
/// the convolution `variant` in force.
fn conv_rows<B: DistillBackend>(
    rows: &mut Vec<BenchRow>,
    variant: ConvVariant,
    options: &BenchOptions,
    device: &B::Device,
) {
    let (repeats, batch) = (options.repeats, options.batch);
    let wanted = |op: &str| options.wants(op);
    let tag = match variant {
        ConvVariant::Auto => "auto",
        ConvVariant::Tiled => "tiled",
        ConvVariant::Direct => "direct",
    };
    // The teacher's and the quickstart students' 3x3 convolutions (padding 1).
    let conv3x3 = [(1, 28, 32), (32, 14, 64), (64, 7, 128), (1, 28, 6), (16, 14, 16), (24, 7, 24)];
    for (c_in, hw, c_out) in conv3x3.into_iter().filter(|_| wanted("conv3x3")) {
        let conv = ConvOptions::new([1, 1], [1, 1], [1, 1], 1);
        let reference_options = conv.clone();
        record(
            rows,
            options,
            layer_row::<B, 4, 4>(
                "conv3x3",
                format!("[{batch}, {c_in}, {hw}, {hw}] -> {c_out} relu [{tag}]"),
                [batch, c_in, hw, hw],
                [c_out, c_in, 3, 3],
                c_out,
                repeats,
                device,
                &move |x, w, b| conv2d(x, w, b, conv.clone(), Epilogue::Relu),
                &move |x, w, b| {
                    crate::reference::activate(
                        burn::tensor::module::conv2d(x, w, b, reference_options.clone()),
                        Epilogue::Relu,
                    )
                },
            ),
        );
    }
    // With the 2x2 max-pool fused in: the teacher's stages and the
    // quickstart's pooled 1x1 projections.
    let pooled = [(1, 28, 32, 3), (32, 14, 64, 3), (64, 7, 128, 3), (6, 28, 32, 1), (16, 14, 64, 1)];
    for (c_in, hw, c_out, k) in pooled.into_iter().filter(|_| wanted("conv-relu-pool")) {
        let conv = ConvOptions::new([1, 1], [k / 2, k / 2], [1, 1], 1);
        let reference_options = conv.clone();
        record(
            rows,
            options,
            layer_row::<B, 4, 4>(
                "conv-relu-pool",
                format!("[{batch}, {c_in}, {hw}, {hw}] -> {c_out} {k}x{k} [{tag}]"),
                [batch, c_in, hw, hw],
                [c_out, c_in, k, k],
                c_out,
                repeats,
                device,
                &move |x, w, b| conv2d_pool(x, w, b, conv.clone(), Epilogue::Relu),
                &move |x, w, b| {
                    let y = burn::tensor::activation::relu(burn::tensor::module::conv2d(
                        x,
                        w,
                        b,
                        reference_options.clone(),
                    ));
                    burn::tensor::module::max_pool2d(y, [2, 2], [2, 2], [0, 0], [1, 1], false)
                },
            ),
        );
    }
}

/// The linear and pointwise-conv cases with the matmul `variant` in force.
fn layer_rows<B: DistillBackend>(
    rows: &mut Vec<BenchRow>,
    variant: MatmulVariant,
    options: &BenchOptions,
    device: &B::Device,
) {
    let (repeats, batch) = (options.repeats, options.batch);
    let wanted = |op: &str| options.wants(op);
    let tag = match variant {
        MatmulVariant::Auto => "auto",
        MatmulVariant::Split => "split",
        MatmulVariant::Fused => "kernel",
    };
    let linear_cases = [(1152, 128, Epilogue::Relu), (128, 10, Epilogue::Identity)];
    for (d_in, d_out, epilogue) in linear_cases.into_iter().filter(|_| wanted("linear")) {
        record(
            rows,
            options,
            layer_row::<B, 2, 2>(
                "linear",
                format!("[{batch}, {d_in}] -> {d_out} {} [{tag}]", epilogue.name()),
                [batch, d_in],
                [d_in, d_out],
                d_out,
                repeats,
                device,
                &move |x, w, b| linear(x, w, b, epilogue),
                &move |x, w, b| unfused::linear(x, w, b, epilogue),
            ),
        );
    }
    for (c_in, hw, c_out) in
        [(32, 14, 16), (16, 7, 64), (24, 3, 128)].into_iter().filter(|_| wanted("pointwise-conv"))
    {
        record(
            rows,
            options,
            layer_row::<B, 4, 4>(
                "pointwise-conv",
                format!("[{batch}, {c_in}, {hw}, {hw}] -> {c_out} relu [{tag}]"),
                [batch, c_in, hw, hw],
                [c_out, c_in, 1, 1],
                c_out,
                repeats,
                device,
                &|x, w, b| pointwise_conv(x, w, b, Epilogue::Relu),
                &|x, w, b| unfused::pointwise_conv(x, w, b, Epilogue::Relu),
            ),
        );
    }
}

/// The rows as an aligned text table with the speedups.
pub fn table(rows: &[BenchRow]) -> String {
    let mut text = format!(
        "{:<15} {:<42} {:>10} {:>10} {:>7}   {:>10} {:>10} {:>7}\n",
        "op", "case", "fwd fused", "unfused", "ratio", "f+b fused", "unfused", "ratio"
    );
    for r in rows {
        text.push_str(&format!(
            "{:<15} {:<42} {:>8.3}ms {:>8.3}ms {:>6.2}x   {:>8.3}ms {:>8.3}ms {:>6.2}x\n",
            r.op,
            r.case,
            r.fused_forward_ms,
            r.unfused_forward_ms,
            r.forward_speedup(),
            r.fused_train_ms,
            r.unfused_train_ms,
            r.train_speedup()
        ));
    }
    text
}
