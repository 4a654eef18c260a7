//! `pipebd kernels`: the fused ops checked against burn's ops, and timed.

use pipebd_kernels::DistillBackend;

use pipe_bd::device::{dispatch, BackendJob, DeviceSpec};
use pipe_bd::error::{Error, Result};

/// What `pipebd kernels` measured: the fused ops against burn's ops.
#[derive(Debug, Default)]
pub struct KernelsReport {
    /// The device the ops ran on.
    pub device: String,
    /// Correctness rows (when checked).
    pub checks: Vec<pipebd_kernels::check::CheckRow>,
    /// Timing rows (when benchmarked).
    pub timings: Vec<pipebd_kernels::bench::BenchRow>,
}

struct KernelsJob {
    check_seed: Option<u64>,
    bench: Option<pipebd_kernels::bench::BenchOptions>,
}

impl BackendJob for KernelsJob {
    type Output = KernelsReport;

    fn run<B: DistillBackend>(self, devices: &[B::Device]) -> Result<KernelsReport> {
        let device = &devices[0];
        let mut report = KernelsReport::default();
        if let Some(seed) = self.check_seed {
            pipebd_kernels::set_poison_outputs(true);
            report.checks = pipebd_kernels::check::run::<B>(device, seed);
            pipebd_kernels::set_poison_outputs(false);
        }
        if let Some(options) = &self.bench {
            report.timings = pipebd_kernels::bench::run_with::<B>(device, options);
        }
        Ok(report)
    }
}

/// Checks the fused ops against burn's unfused ops on `device` (random inputs
/// from `check_seed`, outputs NaN-poisoned) and/or times both sides as
/// `bench` says. On `cpu` the fused ops are flex's native paths where they
/// exist and their burn-op fallback elsewhere, so this also checks the custom
/// backward passes.
pub fn kernels(
    device: &str,
    check_seed: Option<u64>,
    bench: Option<pipebd_kernels::bench::BenchOptions>,
) -> Result<KernelsReport> {
    let spec =
        DeviceSpec::parse(device).map_err(|message| Error::Device { device: device.into(), message })?;
    spec.check_available()?;
    let mut report = dispatch(&[spec], KernelsJob { check_seed, bench })?;
    report.device = device.to_string();
    Ok(report)
}
