//! On the CPU (flex) the fused ops are burn-op fallbacks behind our own
//! autodiff backward steps: check those backward steps against burn's autodiff
//! of the unfused ops, on random inputs.

use burn::backend::{Autodiff, Flex};
use pipebd_kernels::check;

#[test]
fn fallback_ops_and_their_custom_backward_match_burns_autodiff() {
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
    let rows = check::run::<Autodiff<Flex>>(&Default::default(), seed);
    let ops: std::collections::BTreeSet<_> = rows.iter().map(|r| r.op.as_str()).collect();
    let every = [
        "add-layer-norm",
        "attention",
        "causal-attention",
        "conv2d",
        "conv2d-pool",
        "head-kl",
        "linear",
        "max-pool-2x2",
        "mse",
        "optimizer",
        "pointwise-conv",
        "rms-norm",
        "soft-ce",
        "swiglu",
    ];
    assert_eq!(ops, every.into_iter().collect(), "every op is checked");
    assert!(rows.iter().any(|r| r.quantity == "d bias"), "bias gradients are checked");
    assert!(rows.iter().all(|r| r.passed()), "seed {seed}:\n{}", check::table(&rows));
}

#[test]
fn a_nan_or_a_wrong_value_is_caught() {
    let reference = [1.0, -2.0, 0.5];
    // Relative to the largest magnitude (2): 1e-4 off at 0.5 is 5e-5.
    let close = check::relative_error(&[1.0, -2.0, 0.5001], &reference);
    assert!((close - 5e-5).abs() < 1e-6, "{close}");
    assert!(check::relative_error(&[1.0, f32::NAN, 0.5], &reference).is_infinite());
    let off = check::relative_error(&[1.0, -2.0, 0.52], &reference);
    assert!((off - 0.01).abs() < 1e-6, "{off}");
    assert!(off > check::MATMUL_TOLERANCE);
}
