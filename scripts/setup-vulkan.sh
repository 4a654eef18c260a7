#!/usr/bin/env bash
# Makes sure a Vulkan driver is present for burn's wgpu backend and our CubeCL
# kernels. On machines without a GPU this is Mesa's software driver
# (lavapipe, Debian package mesa-vulkan-drivers), which the kernel tests run on.
# Idempotent: does nothing when a driver manifest is already installed.
set -euo pipefail

say() { echo "setup-vulkan: $*" >&2; }

have_driver() {
  compgen -G "/usr/share/vulkan/icd.d/*.json" >/dev/null ||
    compgen -G "/etc/vulkan/icd.d/*.json" >/dev/null
}

if have_driver && ldconfig -p 2>/dev/null | grep -q 'libvulkan\.so\.1'; then
  say "a Vulkan driver and loader are installed"
  exit 0
fi

command -v apt-get >/dev/null 2>&1 || {
  say "ERROR: no Vulkan driver found and no apt-get to install one;"
  say "install Mesa's Vulkan drivers (lavapipe) and the Vulkan loader with your package manager"
  exit 1
}
sudo=""
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null 2>&1 || { say "ERROR: need root (or sudo) to install mesa-vulkan-drivers"; exit 1; }
  sudo="sudo"
fi
say "installing mesa-vulkan-drivers and libvulkan1 (software Vulkan)"
$sudo apt-get update -qq
$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
  mesa-vulkan-drivers libvulkan1 >/dev/null
have_driver || { say "ERROR: mesa-vulkan-drivers installed but no driver manifest found"; exit 1; }
say "done"
