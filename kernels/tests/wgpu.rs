//! Our CubeCL kernels on burn's wgpu backend (Mesa's software Vulkan driver
//! where there is no GPU): every fused op, forward and every gradient, against
//! burn's unfused ops on the same device, on fresh random inputs of awkward
//! sizes, with every kernel output filled with NaN before the launch.
#![cfg(feature = "wgpu")]

use burn::backend::wgpu::WgpuDevice;
use burn::backend::Autodiff;
use pipebd_kernels::{check, Wgpu};

#[test]
fn kernels_match_burn_ops_on_wgpu() {
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
    pipebd_kernels::set_poison_outputs(true);
    let rows = check::run::<Autodiff<Wgpu>>(&WgpuDevice::DefaultDevice, seed);
    pipebd_kernels::set_poison_outputs(false);
    assert!(rows.len() > 100, "{} rows", rows.len());
    assert!(rows.iter().all(|r| r.passed()), "seed {seed}:\n{}", check::table(&rows));
}
