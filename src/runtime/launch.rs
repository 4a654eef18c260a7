//! How the processes of a run are started and talk: which transport a run
//! uses (`pipebd run --transport`), what an MPI launcher's environment says
//! (ranks, this rank, ranks per node), and opening the transport.

use std::sync::Arc;

use super::transport::Transport;
#[cfg(not(feature = "mpi"))]
use crate::error::Error;
use crate::error::Result;

/// Which transport a run uses (`pipebd run --transport`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TransportChoice {
    /// MPI when an MPI launcher started this process with more than one
    /// rank, else one process.
    #[default]
    Auto,
    /// One process: every worker a thread, whatever the environment says.
    Local,
    /// MPI (fails unless built with the `mpi` feature and started by an MPI launcher).
    Mpi,
}

impl TransportChoice {
    /// `auto`, `local` or `mpi`.
    pub fn parse(text: &str) -> std::result::Result<Self, String> {
        match text {
            "auto" => Ok(Self::Auto),
            "local" => Ok(Self::Local),
            "mpi" => Ok(Self::Mpi),
            other => Err(format!("unknown transport `{other}`: expected auto, local or mpi")),
        }
    }
}

/// The number of ranks an MPI launcher started, judged by the environment
/// the launchers set (OpenMPI, MPICH/Intel MPI's PMI, Slurm), if any.
pub fn launcher_ranks() -> Option<usize> {
    env_number(&["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "SLURM_NTASKS"])
}

/// This process's rank as the launcher's environment gives it, in a run of
/// more than one rank (for labelling messages before MPI is up).
pub fn launcher_rank() -> Option<usize> {
    if launcher_ranks().is_none_or(|n| n < 2) {
        return None;
    }
    env_number(&["OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"])
}

/// How many ranks of this run share this machine (for dividing its cores),
/// from the launcher's environment; 1 when unknown.
pub fn ranks_on_this_node() -> usize {
    env_number(&["OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"]).unwrap_or(1)
}

/// The first of the environment variables `names` that holds a number.
fn env_number(names: &[&str]) -> Option<usize> {
    names.iter().find_map(|v| std::env::var(v).ok().and_then(|n| n.parse().ok()))
}

/// The transport `choice` gives in this process: `None` for one process.
pub fn open(choice: TransportChoice) -> Result<Option<Arc<dyn Transport>>> {
    let launched = launcher_ranks();
    let wanted = match choice {
        TransportChoice::Local => false,
        TransportChoice::Mpi => true,
        TransportChoice::Auto => launched.is_some_and(|n| n > 1),
    };
    if !wanted {
        return Ok(None);
    }
    open_mpi(launched)
}

#[cfg(feature = "mpi")]
fn open_mpi(_launched: Option<usize>) -> Result<Option<Arc<dyn Transport>>> {
    let transport = super::mpi::MpiTransport::start()?;
    Ok(Some(Arc::new(transport)))
}

#[cfg(not(feature = "mpi"))]
fn open_mpi(launched: Option<usize>) -> Result<Option<Arc<dyn Transport>>> {
    let how = match launched {
        Some(n) => format!("this process is one of {n} started by an MPI launcher, but "),
        None => String::new(),
    };
    Err(Error::Transport {
        message: format!(
            "{how}this pipebd was built without MPI: rebuild it with `cargo build --release --features mpi` \
             (needs OpenMPI or MPICH with headers, and libclang: `bash scripts/setup-mpi.sh`)"
        ),
    })
}
