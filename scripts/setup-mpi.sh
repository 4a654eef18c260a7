#!/usr/bin/env bash
# Makes sure OpenMPI (the `mpirun` launcher, the library and its headers) and
# libclang (rsmpi reads the MPI headers with bindgen) are present, for the
# `mpi` cargo feature and its tests (tests/integration/mpi.rs). Debian packages
# openmpi-bin, libopenmpi-dev and libclang-dev. Idempotent: does nothing when
# they are installed. Only builds with `--features mpi` need this.
set -euo pipefail

say() { echo "setup-mpi: $*" >&2; }

have_mpi() {
  command -v mpirun >/dev/null 2>&1 && command -v mpicc >/dev/null 2>&1 &&
    ldconfig -p 2>/dev/null | grep -q 'libclang'
}

if have_mpi; then
  say "OpenMPI ($(mpirun --version 2>/dev/null | head -1)) and libclang are installed"
  exit 0
fi

command -v apt-get >/dev/null 2>&1 || {
  say "ERROR: OpenMPI or libclang missing and no apt-get to install them;"
  say "install an MPI library with its headers (OpenMPI or MPICH) and libclang with your package manager"
  exit 1
}
sudo=""
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null 2>&1 || { say "ERROR: need root (or sudo) to install openmpi-bin"; exit 1; }
  sudo="sudo"
fi
say "installing openmpi-bin, libopenmpi-dev and libclang-dev"
$sudo apt-get update -qq
$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
  openmpi-bin libopenmpi-dev libclang-dev >/dev/null
have_mpi || { say "ERROR: packages installed but mpirun, mpicc or libclang still missing"; exit 1; }
say "done"
