//! Correctness checks of the fused ops against the unfused burn ops.
//!
//! [`run`] draws fresh random inputs of awkward sizes (not multiples of the
//! tile, batch 1, long rows), runs each fused op on the backend under test and
//! its unfused reference ([`crate::reference::unfused`], burn's ops on the CPU)
//! under autodiff, and reports the relative error of the forward output and of
//! every gradient.
//! The kernel tests assert on these rows; `pipebd kernels --check` prints them.
//!
//! The checks are grouped by subject: the losses here, the matmul layers
//! (`matmul.rs`), the convolutions and the max-pool (`conv.rs`), the
//! encoder's attention and layer norm (`encoder.rs`), the decoder's ops
//! (`decoder.rs`) and the optimizer update (`optim.rs`), all on the rows,
//! tolerances and helpers of `common.rs`.

mod common;
mod conv;
mod decoder;
mod encoder;
mod matmul;
mod optim;

use burn::tensor::{Tensor, TensorData};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use self::common::{random, tensor, values, Reference, Rows};
pub use self::common::{relative_error, CheckRow, LOSS_TOLERANCE, MATMUL_TOLERANCE, OPTIMIZER_TOLERANCE};
use self::conv::{check_convolutions, check_max_pool};
use self::encoder::{check_attention, check_layer_norm};
use self::matmul::check_layers;
use self::optim::check_optimizers;
use crate::reference::unfused;
use crate::{loss, set_conv_variant, set_matmul_variant, ConvVariant, DistillBackend, MatmulVariant};

type LossFn<B, const D: usize> = fn(Tensor<B, D>, Tensor<B, D>) -> Tensor<B, 1>;

/// A loss and its student gradient (scaled by `upstream`) on backend `B`.
fn loss_on<B: DistillBackend, const D: usize>(
    f: LossFn<B, D>,
    student: &TensorData,
    teacher: &TensorData,
    upstream: f32,
    device: &B::Device,
) -> (Vec<f32>, Vec<f32>) {
    let s = tensor::<B, D>(student, device).require_grad();
    let value = f(s.clone(), tensor(teacher, device));
    let grads = value.clone().mul_scalar(upstream).backward();
    (values(value), values(s.grad(&grads).expect("student gradient")))
}

#[allow(clippy::too_many_arguments)]
fn check_loss<B: DistillBackend, const D: usize>(
    out: &mut Vec<CheckRow>,
    rng: &mut StdRng,
    op: &'static str,
    shape: [usize; D],
    scale: f32,
    fused: LossFn<B, D>,
    reference: LossFn<Reference, D>,
    device: &B::Device,
) {
    let student = random(rng, &shape, scale);
    let teacher = random(rng, &shape, scale);
    let upstream = 1.0 + rng.random::<f32>();
    let f = loss_on::<B, D>(fused, &student, &teacher, upstream, device);
    let r = loss_on::<Reference, D>(reference, &student, &teacher, upstream, &Default::default());
    let mut rows = Rows { rows: vec![], op, case: format!("{shape:?}"), tolerance: LOSS_TOLERANCE };
    rows.add("forward", &f.0, &r.0);
    rows.add("d student", &f.1, &r.1);
    out.extend(rows.rows);
}

/// Checks every op on `device` against burn's unfused ops on the CPU, on fresh
/// random inputs drawn from `seed`.
pub fn run<B: DistillBackend>(device: &B::Device, seed: u64) -> Vec<CheckRow> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out = Vec::new();
    check_loss::<B, 2>(&mut out, &mut rng, "mse", [1, 7], 2.0, loss::mse, unfused::mse, device);
    check_loss::<B, 4>(&mut out, &mut rng, "mse", [3, 5, 13, 11], 2.0, loss::mse, unfused::mse, device);
    check_loss::<B, 4>(&mut out, &mut rng, "mse", [37, 32, 14, 14], 2.0, loss::mse, unfused::mse, device);
    check_loss::<B, 2>(&mut out, &mut rng, "mse", [1, 100_003], 2.0, loss::mse, unfused::mse, device);
    for shape in [[1, 10], [257, 10], [3, 1000], [2, 4099]] {
        let (fused, reference) = (loss::soft_target_cross_entropy, unfused::soft_target_cross_entropy);
        check_loss::<B, 2>(&mut out, &mut rng, "soft-ce", shape, 4.0, fused, reference, device);
    }
    for variant in [MatmulVariant::Fused, MatmulVariant::Split] {
        set_matmul_variant(variant);
        check_layers::<B>(&mut out, &mut rng, variant, device);
    }
    set_matmul_variant(MatmulVariant::Auto);
    for variant in [ConvVariant::Tiled, ConvVariant::Direct] {
        set_conv_variant(variant);
        check_convolutions::<B>(&mut out, &mut rng, variant, device);
    }
    set_conv_variant(ConvVariant::Auto);
    check_max_pool::<B>(&mut out, &mut rng, device);
    check_attention::<B>(&mut out, &mut rng, device);
    check_layer_norm::<B>(&mut out, &mut rng, device);
    decoder::run::<B>(&mut out, &mut rng, device);
    check_optimizers::<B>(&mut out, &mut rng, device);
    out
}

/// The rows as an aligned text table.
pub fn table(rows: &[CheckRow]) -> String {
    let mut text =
        format!("{:<15} {:<48} {:<10} {:>10} {:>9}  ok\n", "op", "case", "quantity", "rel.error", "bound");
    for row in rows {
        text.push_str(&format!(
            "{:<15} {:<48} {:<10} {:>10.2e} {:>9.0e}  {}\n",
            row.op,
            row.case,
            row.quantity,
            row.relative_error,
            row.tolerance,
            if row.passed() { "yes" } else { "NO" }
        ));
    }
    text
}

/// One line per op and quantity: how many cases, the largest relative error
/// and its bound; then every failing row in full.
pub fn summary(rows: &[CheckRow]) -> String {
    let mut groups: Vec<(String, String, usize, f64, f64)> = Vec::new();
    for row in rows {
        match groups.iter_mut().find(|g| g.0 == row.op && g.1 == row.quantity) {
            Some(g) => {
                g.2 += 1;
                g.3 = g.3.max(row.relative_error);
            }
            None => groups.push((row.op.clone(), row.quantity.clone(), 1, row.relative_error, row.tolerance)),
        }
    }
    let mut text = format!(
        "{:<15} {:<10} {:>6} {:>14} {:>9}  ok\n",
        "op", "quantity", "cases", "max rel.error", "bound"
    );
    for (op, quantity, cases, worst, bound) in groups {
        let ok = if worst <= bound { "yes" } else { "NO" };
        text.push_str(&format!("{op:<15} {quantity:<10} {cases:>6} {worst:>14.2e} {bound:>9.0e}  {ok}\n"));
    }
    let failed: Vec<CheckRow> = rows.iter().filter(|r| !r.passed()).cloned().collect();
    if !failed.is_empty() {
        text.push_str("failing cases:\n");
        text.push_str(&table(&failed));
    }
    text
}
