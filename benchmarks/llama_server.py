"""llama.cpp's own server (the C++ `llama-server`, run in this process by xllamacpp) on a GGUF, until SIGTERM or
Ctrl-C: the llama.cpp server baselines of bench_agent.py and bench_exact.py.

    python benchmarks/llama_server.py MODEL.gguf --port 8080 [--alias bench] [--ctx 8192] [--threads 1]
        [--spec-type ngram-mod [--spec-ngram-mod-n-match 24] [--spec-ngram-mod-n-min 48] [--spec-ngram-mod-n-max 64]]
        [--cache-reuse 256]

One slot (`n_parallel` 1: the agent sends one request at a time, and each slot would get only n_ctx / n_parallel
cells), the GGUF's own chat template through llama.cpp's Jinja engine with its tool-call parsing (`--jinja`), its
prompt cache on (llama-server's default: a request reuses the longest common prefix of the slot's last prompt).

Options with llama-server's own names and meanings:

* `--spec-type`: draft-free speculation, the draft verified by the model in one batch (greedy output unchanged).
  `ngram-mod` hashes every n-gram of `n_match` tokens (an LCG rolling hash) into one fixed pool of 4M entries
  (16 MB) holding the token that followed it, filled from every prompt and answer and shared by all slots, so
  requests draft from each other; a draft extends token by token while the pool has a successor, and is used when
  at least `n_min` long (at most `n_max`); the pool is emptied when a quarter of it is in use or after five drafts
  in a row with under a quarter accepted. `ngram-simple` copies the `m` tokens that followed the latest earlier
  occurrence of the last `n` tokens of the request's own context; `ngram-map-k` does so when the n-gram key was
  followed by the same m-gram `min_hits` times; `ngram-map-k4v` keeps up to four m-grams per key and drafts the
  dominant one; `ngram-cache` drafts from n-gram statistics. The draft-model types of this build (draft-simple,
  draft-eagle3, draft-mtp, draft-dflash, draft-dspark) need a second model and are not offered.
* `--cache-reuse N` (`n_cache_reuse`): beyond the common prefix, chunks of at least N tokens of the slot's last
  prompt that reappear later in the new prompt are reused by shifting their KV cells (RoPE re-applied to the keys)
  instead of being prefilled again: it helps when a prompt drops or edits text in the middle (0: off).

`command` is the line the benchmarks start this script with; `completion_request` / `completion_result` are
bench_exact.py's side of llama-server's native `/completion` endpoint (a prompt as token ids, greedy).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import signal
import sys
import threading
from pathlib import Path
from typing import Any

SPEC_TYPES = ("none", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
MAP_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v")  # the types with n / m / min-hits settings
# option -> (the spec types it applies to, the field it sets in CommonParams.speculative.<type, '-' as '_'>)
SPEC_OPTIONS = {
    "spec_ngram_mod_n_match": (("ngram-mod",), "n_match"),
    "spec_ngram_mod_n_min": (("ngram-mod",), "n_min"),
    "spec_ngram_mod_n_max": (("ngram-mod",), "n_max"),
    "spec_ngram_size_n": (MAP_TYPES, "size_n"),
    "spec_ngram_size_m": (MAP_TYPES, "size_m"),
    "spec_ngram_min_hits": (MAP_TYPES, "min_hits"),
}


def llama_cpp_build() -> dict[str, str]:
    """Which llama.cpp the installed xllamacpp wheel carries: its version, and the llama.cpp release tag it pins
    (xllamacpp's versions are YEAR.MONTH.<llama.cpp build number>: 2026.10.11549 is llama.cpp b11549; the library
    itself reports build 0, commit unknown, its build stamp not set)."""
    version = importlib.metadata.version("xllamacpp")
    return {"xllamacpp": version, "llama_cpp": f"b{version.rsplit('.', 1)[-1]}"}


def command(gguf: str | Path, port: int, *, alias: str, ctx: int, threads: int, spec_type: str = "none",
            cache_reuse: int = 0) -> list[str]:
    """The command line that runs this script (what the benchmarks start in a subprocess)."""
    return [sys.executable, str(Path(__file__).resolve()), str(gguf), "--alias", alias, "--port", str(port), "--ctx",
            str(ctx), "--threads", str(threads), "--spec-type", spec_type, "--cache-reuse", str(cache_reuse)]


# -- the client side: llama-server's native /completion endpoint with token ids (bench_exact.py) --------------------
def completion_request(ids: list[int], max_new: int) -> dict[str, Any]:
    """llama-server's native `/completion` body for greedy decoding of a prompt given as token ids: temperature 0
    (its greedy sampler), no repetition penalty, the generated ids returned (`return_tokens`), and no reuse of the
    previous prompt's KV cells (`cache_prompt` off: bench_exact.py prefills every prompt whole on every system)."""
    return {"prompt": ids, "n_predict": max_new, "temperature": 0.0, "repeat_penalty": 1.0, "cache_prompt": False,
            "return_tokens": True}


def completion_result(response: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
    """The new token ids (the end-of-generation token that stopped it left out, as the other systems leave it out)
    and bench_exact.py's stats from a `/completion` response. Forwards: with speculation, one verify forward commits
    its accepted drafted tokens plus one of its own, and the prompt's forward the first token, so forwards =
    generated tokens (the end token included: it took a forward) - accepted drafted tokens
    (`timings.draft_n_accepted`; absent when nothing was drafted: every token one forward). Time to first token:
    the server's prompt evaluation."""
    generated, timings = response["tokens"], response["timings"]
    accepted = timings.get("draft_n_accepted", 0)
    tokens = generated[:-1] if response.get("stop_type") == "eos" else generated
    return tokens, {"forward_passes": len(generated) - accepted, "time_to_first_token_s": timings["prompt_ms"] / 1000,
                    "draft_tokens": timings.get("draft_n", 0), "draft_tokens_accepted": accepted}


# -- the server -------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("gguf")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--alias", default="bench", help="the model name /v1/models lists")
    p.add_argument("--ctx", type=int, default=8192)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--spec-type", default="none", choices=SPEC_TYPES, help="draft-free speculation (default: none)")
    p.add_argument("--spec-ngram-mod-n-match", type=int, help="ngram-mod: n-gram length hashed (build default 24)")
    p.add_argument("--spec-ngram-mod-n-min", type=int, help="ngram-mod: shortest draft used (build default 48)")
    p.add_argument("--spec-ngram-mod-n-max", type=int, help="ngram-mod: longest draft (build default 64)")
    p.add_argument("--spec-ngram-size-n", type=int, help="ngram-simple/map: lookup n-gram length (default 12)")
    p.add_argument("--spec-ngram-size-m", type=int, help="ngram-simple/map: draft m-gram length (default 48)")
    p.add_argument("--spec-ngram-min-hits", type=int, help="ngram-map: occurrences before a key drafts (default 1)")
    p.add_argument("--cache-reuse", type=int, default=0,
                   help="reuse chunks of at least N tokens of the last prompt by KV shifting (0: off)")
    args = p.parse_args(argv)
    for option, (types, _) in SPEC_OPTIONS.items():
        if getattr(args, option) is not None and args.spec_type not in types:
            p.error(f"--{option.replace('_', '-')} applies to --spec-type {' or '.join(types)}, not {args.spec_type}")
    return args


def server_params(args: argparse.Namespace, xllamacpp: Any) -> Any:
    """xllamacpp's CommonParams (llama.cpp's `common_params`) for the parsed options."""
    params = xllamacpp.CommonParams()
    params.model.path = args.gguf
    params.model_alias = {args.alias}
    params.hostnames, params.port = ["127.0.0.1"], args.port
    params.n_ctx, params.n_parallel = args.ctx, 1
    params.cpuparams.n_threads = params.cpuparams_batch.n_threads = args.threads
    params.use_jinja = True
    params.n_cache_reuse = args.cache_reuse
    if args.spec_type != "none":
        name = "COMMON_SPECULATIVE_TYPE_" + args.spec_type.upper().replace("-", "_")
        params.speculative.types = [xllamacpp.common_speculative_type[name]]
        settings = getattr(params.speculative, args.spec_type.replace("-", "_"))
        for option, (_, attribute) in SPEC_OPTIONS.items():
            if getattr(args, option) is not None:
                setattr(settings, attribute, getattr(args, option))
    return params


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import xllamacpp  # deferred: --help needs no llama.cpp

    params = server_params(args, xllamacpp)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server = xllamacpp.Server(params)  # loads the model, then serves from its own threads
    build = llama_cpp_build()
    print(f"llama-server (llama.cpp {build['llama_cpp']} via xllamacpp {build['xllamacpp']}) on "
          f"{server.listening_address}, spec-type {args.spec_type}, cache-reuse {args.cache_reuse}", flush=True)
    stop.wait()
    del server  # joins llama.cpp's threads
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
