//! Device selection: which burn backend runs a job, and on which device.

use std::fmt;

use pipebd_kernels::DistillBackend;

use crate::error::{Error, Result};

/// A device as written in a config or on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceSpec {
    /// The CPU, through burn's flex backend (always available).
    Cpu,
    /// NVIDIA GPU number N (needs the `cuda` feature and a CUDA driver).
    Cuda(usize),
    /// Through wgpu (needs the `wgpu` feature): `wgpu` is the default
    /// adapter (on machines without a GPU, Mesa's software Vulkan driver,
    /// slowly), `wgpu:N` the N-th discrete GPU.
    Wgpu(Option<usize>),
}

impl DeviceSpec {
    /// Parses `cpu`, `cuda`, `cuda:N`, `wgpu` or `wgpu:N`.
    pub fn parse(text: &str) -> std::result::Result<Self, String> {
        let (kind, index) = match text.split_once(':') {
            Some((kind, index)) => {
                let index = index
                    .parse::<usize>()
                    .map_err(|_| format!("`{text}`: the part after ':' must be a device number"))?;
                (kind, Some(index))
            }
            None => (text, None),
        };
        match (kind, index) {
            ("cpu", None) => Ok(Self::Cpu),
            ("cuda", index) => Ok(Self::Cuda(index.unwrap_or(0))),
            ("wgpu", index) => Ok(Self::Wgpu(index)),
            _ => Err(format!("unknown device `{text}`: expected `cpu`, `cuda[:N]` or `wgpu[:N]`")),
        }
    }

    /// Checks that this build and this machine can use the device.
    pub fn check_available(&self) -> Result<()> {
        let unavailable = |message: String| Err(Error::Device { device: self.to_string(), message });
        match self {
            Self::Cpu => Ok(()),
            Self::Cuda(_) => {
                if !cfg!(feature = "cuda") {
                    return unavailable(
                        "this pipebd was built without CUDA support; rebuild with `--features cuda`".into(),
                    );
                }
                if !cuda_driver_present() {
                    return unavailable(
                        "no CUDA driver found (libcuda.so.1 is not in the loader's search path); is this a GPU machine?".into(),
                    );
                }
                Ok(())
            }
            Self::Wgpu(_) => {
                if !cfg!(feature = "wgpu") {
                    return unavailable(
                        "this pipebd was built without wgpu support; rebuild with `--features wgpu`".into(),
                    );
                }
                Ok(())
            }
        }
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Cpu => write!(f, "cpu"),
            Self::Cuda(i) => write!(f, "cuda:{i}"),
            Self::Wgpu(None) => write!(f, "wgpu"),
            Self::Wgpu(Some(i)) => write!(f, "wgpu:{i}"),
        }
    }
}

/// burn 0.21 loads libcuda lazily on a worker thread and panics there when it
/// is missing, so we look for the library ourselves before touching CUDA.
fn cuda_driver_present() -> bool {
    let mut dirs: Vec<std::path::PathBuf> =
        std::env::var_os("LD_LIBRARY_PATH").map(|v| std::env::split_paths(&v).collect()).unwrap_or_default();
    for d in [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib64",
        "/usr/lib",
        "/usr/local/cuda/lib64",
        "/usr/local/cuda/compat",
        "/usr/local/nvidia/lib64",
        "/usr/local/nvidia/lib",
        "/usr/lib/wsl/lib",
        "/usr/lib/aarch64-linux-gnu",
    ] {
        dirs.push(d.into());
    }
    if dirs.iter().any(|d| d.join("libcuda.so.1").exists() || d.join("libcuda.so").exists()) {
        return true;
    }
    std::process::Command::new("ldconfig")
        .arg("-p")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains("libcuda.so"))
        .unwrap_or(false)
}

/// Parses a list of device slots (`["cpu", "cpu"]`); they must all be of
/// one kind (one burn backend runs a job).
pub fn parse_slots(slots: &[String]) -> std::result::Result<Vec<DeviceSpec>, String> {
    if slots.is_empty() {
        return Err("at least one device slot is needed".into());
    }
    let specs = slots.iter().map(|s| DeviceSpec::parse(s)).collect::<std::result::Result<Vec<_>, _>>()?;
    let kind = |d: &DeviceSpec| std::mem::discriminant(d);
    if specs.iter().any(|d| kind(d) != kind(&specs[0])) {
        return Err(format!("device slots {slots:?} mix kinds; one run uses one backend"));
    }
    Ok(specs)
}

/// Work that runs on whichever burn backend the device slots name.
pub trait BackendJob {
    /// What the job returns.
    type Output;
    /// Runs the job on backend `B` with one device per slot.
    fn run<B: DistillBackend>(self, devices: &[B::Device]) -> Result<Self::Output>;
}

/// Picks the burn backend for `devices` (all of one kind) and runs `job` on it.
pub fn dispatch<J: BackendJob>(devices: &[DeviceSpec], job: J) -> Result<J::Output> {
    let first = *devices
        .first()
        .ok_or_else(|| Error::Device { device: String::new(), message: "no device slots".into() })?;
    match first {
        DeviceSpec::Cpu => {
            job.run::<burn::backend::Autodiff<burn::backend::Flex>>(&vec![Default::default(); devices.len()])
        }
        #[cfg(feature = "cuda")]
        DeviceSpec::Cuda(_) => {
            keep_cubecl_caches();
            let slots: Vec<_> = devices
                .iter()
                .map(|d| match d {
                    DeviceSpec::Cuda(i) => burn::backend::cuda::CudaDevice::new(*i),
                    _ => Default::default(),
                })
                .collect();
            job.run::<burn::backend::Autodiff<pipebd_kernels::Cuda>>(&slots)
        }
        #[cfg(feature = "wgpu")]
        DeviceSpec::Wgpu(_) => {
            keep_cubecl_caches();
            let slots: Vec<_> = devices
                .iter()
                .map(|d| match d {
                    DeviceSpec::Wgpu(i) => wgpu_device(*i),
                    _ => Default::default(),
                })
                .collect();
            job.run::<burn::backend::Autodiff<pipebd_kernels::Wgpu>>(&slots)
        }
        #[allow(unreachable_patterns)]
        other => Err(Error::Device { device: other.to_string(), message: "not compiled in".into() }),
    }
}

/// Where CubeCL keeps its autotune results and compiled kernels between
/// runs: `$PIPEBD_CACHE_DIR`, else `$XDG_CACHE_HOME/pipe-bd/cubecl`, else
/// `~/.cache/pipe-bd/cubecl`.
pub fn cubecl_cache_dir() -> Option<std::path::PathBuf> {
    let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty()).map(std::path::PathBuf::from);
    var("PIPEBD_CACHE_DIR")
        .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("pipe-bd").join("cubecl")))
        .or_else(|| var("HOME").map(|d| d.join(".cache").join("pipe-bd").join("cubecl")))
}

/// Points CubeCL's caches at [`cubecl_cache_dir`] before the first CubeCL
/// device starts (unless the user configured CubeCL), so that a second
/// start reuses the first one's autotuning and kernel compilation.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn keep_cubecl_caches() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if let Some(dir) = cubecl_cache_dir() {
            if std::fs::create_dir_all(&dir).is_ok() {
                pipebd_kernels::keep_cubecl_caches_in(&dir);
            }
        }
    });
}

#[cfg(feature = "wgpu")]
fn wgpu_device(index: Option<usize>) -> burn::backend::wgpu::WgpuDevice {
    match index {
        None => burn::backend::wgpu::WgpuDevice::DefaultDevice,
        Some(i) => burn::backend::wgpu::WgpuDevice::DiscreteGpu(i),
    }
}

/// Waits until the device has computed `activation` and everything queued
/// before it (backends may run asynchronously): a device synchronisation,
/// no copy. For timing device work.
pub fn wait_for<B: burn::tensor::backend::Backend>(activation: pipebd_core::Activation<B>) {
    let _ = B::sync(&activation.device());
}

thread_local! {
    static HOST_READS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Counts one read of training values (a loss) back to the host by this
/// thread. On an asynchronous device each read waits for the queued work;
/// the runtime reads there once per logged step ([`crate::train::StepLoss`]).
pub(crate) fn count_host_read() {
    HOST_READS.with(|reads| reads.set(reads.get() + 1));
}

/// Reads of training values back to the host by this thread so far (see
/// [`count_host_read`]); each pipeline worker reports its own
/// ([`crate::trace::WorkerSummary::host_reads`]).
pub fn host_reads_on_this_thread() -> usize {
    HOST_READS.with(|reads| reads.get())
}
