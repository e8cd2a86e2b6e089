"""Test helpers for the server: tiny checkpoints, a real server process, an in-thread server, a scripted model."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import httpx
import torch
from torch import nn

from clover import CloverConfig
from clover.config import FULL_ATTENTION
from clover.model.cache import CloverCache

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_checkpoint(directory: Path, tokenizer: Any, preset: str = "clover-tiny-dense", seed: int = 0,
                     **overrides: Any) -> Path:
    """A random tiny model (peaked logits, so decoding fills several positions per step) with `tokenizer`."""
    from model_helpers import tiny_model

    tok_dir = directory.parent / f"{directory.name}-tokenizer"
    tokenizer.save_pretrained(tok_dir)
    overrides = {"vocab_size": len(tokenizer), "mask_token_id": tokenizer.mask_token_id,
                 "eos_token_id": tokenizer.eos_token_id, **overrides}
    model = tiny_model(preset, seed=seed, **overrides)
    model.save_pretrained(directory, tokenizer_dir=tok_dir)
    return directory


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout: float, what: str = "server",
                 poll: float = 0.2) -> None:
    """Wait (bounded) until `url`/health answers 200; a process that exits or stays unhealthy raises with the end
    of its `log`."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not healthy after {timeout} s:\n{log.read_text()[-4000:]}")
        time.sleep(poll)


@contextmanager
def server_process(model_dir: Path, *args: str, name: str | tuple[str, ...] = "clover-test", timeout: float = 120.0,
                   log: Path | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """`clover serve` in a subprocess on a free localhost port; waits (bounded) for /health; always killed.
    `name`: the served model id, or several (the first canonical, the others aliases)."""
    port = free_port()
    names = [name] if isinstance(name, str) else list(name)
    cmd = [sys.executable, "-m", "clover.cli.main", "serve", "--model", str(model_dir), "--port", str(port),
           "--served-model-name", *names, "--log-level", "warning", "--threads", "1", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    log = log or model_dir.parent / f"server-{port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log, timeout)
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@contextmanager
def server_thread(app: Any, timeout: float = 30.0) -> Iterator[str]:
    """An ASGI app on uvicorn in a background thread (real HTTP on localhost, same process)."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + timeout
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("in-thread server did not start")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)


class ConciseLM(nn.Module):
    """A random tiny model with a logit bias towards tokens that close JSON values (quotes, brackets, commas): its
    answers are arbitrary but end, where an unbiased random model can write one string forever (max_tokens)."""

    def __init__(self, model: nn.Module, tokenizer: Any, bias: float = 4.0) -> None:
        super().__init__()
        self.model, self.config = model, model.config
        closing = torch.zeros(model.config.vocab_size)
        for token, i in tokenizer.get_vocab().items():
            if any(c in tokenizer.convert_tokens_to_string([token]) for c in '"}],'):
                closing[i] = bias
        self.register_buffer("bias", closing)

    def new_cache(self, batch_size: int) -> Any:
        return self.model.new_cache(batch_size)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.model(*args, **kwargs)
        out.logits = out.logits + self.bias
        return out


@contextmanager
def concise_server(tokenizer: Any, name: str) -> Iterator[str]:
    """The server (`create_app` on uvicorn, real HTTP) of a random tiny dense model wrapped in `ConciseLM`, served as
    `name`; yields its URL. Its structured answers and forced tool calls are arbitrary but end."""
    from clover.serving import ServerOptions, create_app
    from model_helpers import tiny_model

    model = tiny_model("clover-tiny-dense", vocab_size=len(tokenizer), mask_token_id=tokenizer.mask_token_id,
                       eos_token_id=tokenizer.eos_token_id, logit_scale=3.0)
    app = create_app(ConciseLM(model, tokenizer), tokenizer, ServerOptions(served_model_name=name, prefill_chunk=16))
    with server_thread(app) as url:
        yield url


@contextmanager
def scripted_client(tokenizer: Any, script: Callable[..., str], name: str, timeout: float = 60.0) -> Iterator[Any]:
    """An official `openai` client on a server of `ScriptedLM(tokenizer, script)` served in-process as `name`."""
    import openai

    from clover.serving import ServerOptions, create_app

    app = create_app(ScriptedLM(tokenizer, script), tokenizer, ServerOptions(served_model_name=name, prefill_chunk=16))
    with server_thread(app) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=timeout)


class ScriptedLM(nn.Module):
    """A stand-in model that writes a scripted answer, so tool-call and reasoning round trips are deterministic.

    It has the model's interface as the engine uses it (forward with clean / query tokens and a `CloverCache`).
    The cache is real: its one attention layer stores each token id as its "key" and whether it was generated
    as its "value", so batching, joins, cancellation and prefix reuse all run the real cache code. The answer
    to a prompt is `script(prompt text)` followed by EOS; the next token of a history is the answer's token at
    the number of tokens generated so far. A position whose left neighbour is still masked gets flat logits, so
    decoding fills one position per step, left to right.
    """

    def __init__(self, tokenizer: Any, script: Callable[[str], str], context: int = 4096, block_size: int = 4) -> None:
        super().__init__()
        self.anchor = nn.Parameter(torch.zeros(1))  # gives the engine a device
        self.tokenizer, self.script = tokenizer, script
        self.config = CloverConfig.from_preset(
            "clover-tiny-dense", vocab_size=len(tokenizer), num_hidden_layers=1, layer_types=[FULL_ATTENTION],
            mask_token_id=tokenizer.mask_token_id, eos_token_id=tokenizer.eos_token_id,
            max_position_embeddings=context, block_size=block_size, threshold=0.9)
        self._answers: dict[tuple[int, ...], tuple[str, list[int]]] = {}

    def new_cache(self, batch_size: int) -> CloverCache:
        return CloverCache(self.config, batch_size)

    def _answer(self, prompt: list[int]) -> tuple[str, list[int]]:
        key = tuple(prompt)
        if key not in self._answers:
            text = self.script(self.tokenizer.decode(prompt))
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            self._answers[key] = text, ids + [self.config.eos_token_ids[0]]
        return self._answers[key]

    def _written(self, prompt: list[int], generated: list[int]) -> tuple[str, list[int], list[int]]:
        """(answer text, answer ids, what is written of it). Exact mode feeds what it commits as clean context (as
        a prompt is fed), so a history that extends a known prompt by the start of its answer's text continues
        that answer."""
        key = tuple(prompt)
        if key not in self._answers:
            known = [k for k in self._answers if len(k) < len(key) and key[:len(k)] == k]
            for k in sorted(known, key=len, reverse=True):
                text, ids = self._answers[k]
                written = list(key[len(k):]) + generated
                if text.startswith(self.tokenizer.decode(written)):
                    return text, ids, written
        return *self._answer(prompt), generated

    def _next(self, prompt: list[int], generated: list[int]) -> int:
        """The answer's next token: by position while the history is the answer's tokens; after a split of the same
        text into other tokens (a grammar's forced tokens), the first token of the rest of the answer's text."""
        text, answer, written = self._written(prompt, generated)
        n = len(written)
        if answer[:n] != written:
            done = self.tokenizer.decode(written)
            if text.startswith(done):
                rest = self.tokenizer(text[len(done):], add_special_tokens=False)["input_ids"]
                return rest[0] if rest else answer[-1]
        return answer[min(n, len(answer) - 1)]

    def _predict(self, prompt: list[int], generated: list[int]) -> torch.Tensor:
        logits = torch.zeros(self.config.vocab_size)
        logits[self._next(prompt, generated)] = 30.0
        return logits

    def forward(self, input_ids: torch.Tensor | None = None, block_size: int = 1, *, prefix_len: int = 0,
                attention_mask: torch.Tensor | None = None, cache: CloverCache | None = None,
                query_ids: torch.Tensor | None = None, logits_to_keep: int | None = None,
                logits_at: torch.Tensor | None = None, **_: Any) -> Any:
        assert cache is not None, "the scripted model only decodes with a cache"
        n = cache.batch_size
        ids = input_ids if input_ids is not None else torch.zeros(n, 0, dtype=torch.long)
        valid = attention_mask.bool() if attention_mask is not None else torch.ones_like(ids, dtype=torch.bool)
        layer = cache.layers[0]
        past = layer.keys_values()
        past_ids = past[0][:, 0, :, 0].long() if past is not None else torch.zeros(n, 0, dtype=torch.long)
        past_gen = past[1][:, 0, :, 0].bool() if past is not None else torch.zeros(n, 0, dtype=torch.bool)
        past_valid = cache.valid
        generated_now = prefix_len == 0  # the engine's prefill chunks pass prefix_len; commits do not
        if ids.shape[1]:
            flags = torch.full_like(ids, int(generated_now))
            layer.append(ids[:, None, :, None].float(), flags[:, None, :, None].float())
            cache.commit(valid)
        keep = ids.shape[1] if logits_to_keep is None or logits_at is not None else min(logits_to_keep, ids.shape[1])
        mask_id = self.config.mask_token_id
        clean_logits, query_logits = [], []
        for r in range(n):
            hist = [(int(t), bool(g)) for t, g, v in zip(past_ids[r], past_gen[r], past_valid[r]) if v]
            hist += [(int(t), generated_now) for t, v in zip(ids[r], valid[r]) if v]
            prompt = [t for t, g in hist if not g]
            gen = [t for t, g in hist if g]
            row = []
            for i in range(ids.shape[1] - keep, ids.shape[1]):  # kept clean positions (the last ones)
                cut = len(hist) - (ids.shape[1] - 1 - i)
                row.append(self._predict([t for t, g in hist[:cut] if not g], [t for t, g in hist[:cut] if g]))
            clean_logits.append(torch.stack(row) if row else torch.zeros(0, self.config.vocab_size))
            if query_ids is not None:
                q = query_ids[r].tolist()
                qrow = []
                for j in range(len(q)):
                    if mask_id in q[: j + 1]:
                        qrow.append(torch.zeros(self.config.vocab_size))
                    else:
                        qrow.append(self._predict(prompt, gen + q[: j + 1]))
                query_logits.append(torch.stack(qrow))
        clean, query = torch.stack(clean_logits), torch.stack(query_logits) if query_ids is not None else None
        if logits_at is not None:
            every = clean if query is None else torch.cat([clean, query], dim=1)
            return SimpleNamespace(logits=every[logits_at], query_logits=None)
        return SimpleNamespace(logits=clean, query_logits=query)


def decode_alone(engine: Any, prompt: list[int], store: Any, max_new: int = 12,
                 sampling: Any = None) -> tuple[list[int], torch.Tensor, int]:
    """What the scheduler does for one request with a prefix store (`clover.serving.scheduling.prefix_cache`): prefill
    it alone on the grid from the longest stored prefix, snapshotting on the way, store it, then decode. Returns
    (tokens, what the first forward decided: block decoding's logits or exact mode's drafts, reused length)."""
    from clover.engine import SamplingParams

    seq = engine.make_sequences([prompt], max_new, sampling or SamplingParams())[0]
    reuse = store.find(prompt) if store is not None else None
    states = dict(reuse.states) if reuse is not None else {}
    prefill = engine.begin_prefill(seq, reuse.cache if reuse is not None else None)
    batch = None
    while batch is None:
        batch = engine.prefill_step(prefill)
        if store is not None and store.wants_snapshot(prefill.done, len(prompt)):
            states[prefill.done] = prefill.cache.snapshot()
    if store is not None:
        store.insert(prompt, prefill.cache, states)
    first = (batch.logits if hasattr(batch, "logits") else batch.drafts).clone()
    tokens = []
    while batch is not None:
        events, batch = engine.step(batch)
        tokens += [t for e in events for t in e.token_ids]
    return tokens, first, (reuse.length if reuse is not None else 0)


def checkpoint_and_gguf(directory: Path, tokenizer: Any, context: int) -> tuple[Path, Path]:
    """A tiny random checkpoint (block size 4, `context` positions) and its f32 GGUF export, for runner tests."""
    from clover.conversion.gguf_export import export_gguf

    checkpoint = build_checkpoint(directory / "model", tokenizer, block_size=4, max_position_embeddings=context)
    return checkpoint, export_gguf(checkpoint, directory / "model.gguf", "f32")


def stream_chat(client: Any, **kwargs: Any) -> tuple[str, str, list[dict[str, Any]], str | None, list[str]]:
    """Accumulate a streamed chat completion the way agent frameworks do: (content, reasoning, calls, finish reason,
    the order of the delta kinds)."""
    content, reasoning, calls, finish, order = "", "", {}, None, []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            d = c.delta
            if getattr(d, "reasoning_content", None):
                reasoning += d.reasoning_content
                order.append("reasoning")
            if d.content:
                content += d.content
                order.append("content")
            for tc in d.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                slot["id"] = tc.id or slot["id"]
                slot["name"] += tc.function.name or ""
                slot["arguments"] += tc.function.arguments or ""
                order.append("tool_call")
            finish = c.finish_reason or finish
    return content, reasoning, [calls[i] for i in sorted(calls)], finish, order


def tool_call_entries(client: Any, **kwargs: Any) -> list[dict[str, Any]]:
    """The `delta.tool_calls` entries of a streamed chat completion, in the order they came; each chunk carries
    at most one (the server sends a call's start and each block's fragments as chunks of their own)."""
    entries = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            calls = c.delta.tool_calls or []
            assert len(calls) <= 1, chunk
            entries += [call.model_dump(exclude_none=True) for call in calls]
    return entries
