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
    assert_eq!(ops.len(), 7, "every op is checked: {ops:?}");
    assert!(rows.iter().any(|r| r.quantity == "d bias"), "bias gradients are checked");
    assert!(rows.iter().all(|r| r.passed()), "seed {seed}:\n{}", check::table(&rows));
}

#[test]
fn a_nan_or_a_wrong_value_is_caught() {
    let reference = [1.0, -2.0, 0.5];
    assert_eq!(check::relative_error(&reference, &reference), 0.0);
    assert!(check::relative_error(&[1.0, f32::NAN, 0.5], &reference).is_infinite());
    let off = check::relative_error(&[1.0, -2.0, 0.52], &reference);
    assert!((off - 0.01).abs() < 1e-6, "{off}");
    assert!(off > check::MATMUL_TOLERANCE);
}
