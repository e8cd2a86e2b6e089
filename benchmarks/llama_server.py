"""llama.cpp's own OpenAI server (the C++ `llama-server`, run in this process by xllamacpp) on a GGUF, until
SIGTERM or Ctrl-C: the `llamacpp-server` baseline of bench_agent.py.

    python benchmarks/llama_server.py MODEL.gguf --port 8080 [--alias bench] [--ctx 8192] [--threads 1]

One slot (`n_parallel` 1: the agent sends one request at a time, and each slot would get only n_ctx / n_parallel
cells), the GGUF's own chat template through llama.cpp's Jinja engine with its tool-call parsing (`--jinja`), its
prompt cache on (llama-server's default: a request reuses the previous prompt's prefix).
"""

from __future__ import annotations

import argparse
import signal
import threading


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("gguf")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--alias", default="bench", help="the model name /v1/models lists")
    p.add_argument("--ctx", type=int, default=8192)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)

    import xllamacpp  # deferred: --help needs no llama.cpp

    params = xllamacpp.CommonParams()
    params.model.path = args.gguf
    params.model_alias = {args.alias}
    params.hostnames, params.port = ["127.0.0.1"], args.port
    params.n_ctx, params.n_parallel = args.ctx, 1
    params.cpuparams.n_threads = params.cpuparams_batch.n_threads = args.threads
    params.use_jinja = True
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server = xllamacpp.Server(params)  # loads the model, then serves from its own threads
    print(f"llama-server (llama.cpp via xllamacpp {xllamacpp.__version__}) on {server.listening_address}", flush=True)
    stop.wait()
    del server  # joins llama.cpp's threads
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
