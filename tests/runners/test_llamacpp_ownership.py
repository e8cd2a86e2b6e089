"""What the llama.cpp runner keeps must be trustworthy (`clover.runners.llamacpp`): its slots go back by their
owner's call, on the owner's thread — never from whatever thread drops a cache's last reference — and the GGUF
tokenizer it caches on disk is published whole, a damaged one rebuilt, not trusted."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest
import torch
from server_helpers import checkpoint_and_gguf

from clover.engine import Engine, SamplingParams
from clover.runners.llamacpp import TOKENIZER_MANIFEST, LlamaCppRunner


@pytest.fixture(scope="module")
def gguf(tmp_path_factory, chat_tokenizer):
    return checkpoint_and_gguf(tmp_path_factory.mktemp("ownership"), chat_tokenizer, 256)[1]


class RecordingLib(SimpleNamespace):
    """llama.cpp's functions, recording the thread of every call that changes the KV cache."""

    def __init__(self, lib: SimpleNamespace) -> None:
        super().__init__(**vars(lib))
        self.threads: list[int] = []
        for name in ("llama_memory_seq_rm", "llama_memory_seq_cp", "llama_decode"):
            setattr(self, name, self._recorded(getattr(lib, name)))

    def _recorded(self, fn):
        def call(*args):
            self.threads.append(threading.get_ident())
            return fn(*args)
        return call


def _cells(runner: LlamaCppRunner, slot: int) -> int:
    """Positions a slot holds (every sequence id of the slot carries its history)."""
    return max(runner._lib.llama_memory_seq_pos_max(runner._memory, s) + 1 for s in runner._ids(slot))


def test_a_cache_dropped_on_another_thread_is_freed_on_the_owners(gguf):
    runner = LlamaCppRunner(gguf, threads=1, max_rows=2)
    runner._lib = lib = RecordingLib(runner._lib)
    held = [runner.new_cache(2)]
    runner.forward(torch.tensor([[5, 6, 7], [8, 9, 10]]), 1, cache=held[0], prefix_len=3, logits_to_keep=0)
    slots = list(held[0].slots)
    assert all(_cells(runner, s) == 3 for s in slots)
    lib.threads.clear()
    dropper = threading.Thread(target=held.clear)  # the last reference dies on this thread
    dropper.start()
    dropper.join()
    assert lib.threads == [] and runner._free == []  # the finalizer only queued the slots
    again = runner.new_cache(2)  # the owner's next call frees them, on its own thread
    assert set(lib.threads) == {threading.get_ident()}
    assert sorted(again.slots) == sorted(slots) and all(_cells(runner, s) == 0 for s in slots)


def test_release_gives_the_slots_back_at_once(gguf):
    runner = LlamaCppRunner(gguf, threads=1, max_rows=2)
    cache = runner.new_cache(2)
    runner.forward(torch.tensor([[5, 6], [7, 8]]), 1, cache=cache, prefix_len=2, logits_to_keep=0)
    cache.release()
    assert sorted(runner._free) == [0, 1] and cache.batch_size == 0
    assert _cells(runner, 0) == _cells(runner, 1) == 0
    cache.release()  # twice: nothing more to give
    assert sorted(runner._free) == [0, 1]


def test_the_engine_releases_a_finished_batch(gguf):
    runner = LlamaCppRunner(gguf, threads=1, max_rows=2)
    runner._lib = lib = RecordingLib(runner._lib)
    engine = Engine(runner, 4, 0.9)
    tokens = [t for piece in engine.run([[5, 6, 7], [8, 9]], 6, SamplingParams()) for t in piece.token_ids]
    assert tokens
    assert sorted(runner._free) == [0, 1] and not runner._abandoned  # released by the engine, not queued
    assert _cells(runner, 0) == _cells(runner, 1) == 0


@pytest.mark.usefixtures("temp_clover_cache")
def test_a_damaged_tokenizer_cache_is_rebuilt_not_trusted(gguf, chat_tokenizer, monkeypatch):
    runner = LlamaCppRunner(gguf, threads=1, max_rows=1)
    text = "def add(a, b): return a + b"
    want = runner.tokenizer().encode(text)
    saved = runner.tokenizer_cache_dir()  # this file's (the session's cache holds other GGUFs of the same name)
    manifest = json.loads((saved / TOKENIZER_MANIFEST).read_text())
    assert "tokenizer.json" in manifest and not list(saved.parent.glob(".*tmp-*"))  # published whole
    whole = (saved / "tokenizer.json").read_bytes()

    (saved / "tokenizer.json").write_bytes(whole[: len(whole) // 2])  # cut short, as a killed writer leaves it
    assert runner.tokenizer().encode(text) == want
    assert (saved / "tokenizer.json").read_bytes() == whole

    (saved / "tokenizer.json").write_bytes(whole.replace(b'"', b"'", 1))  # same size, damaged
    (saved / TOKENIZER_MANIFEST).unlink()  # and no manifest: an older Clover wrote in place
    assert runner.tokenizer().encode(text) == want
    assert (saved / "tokenizer.json").read_bytes() == whole

    def no_rebuild():
        raise AssertionError("an intact cached tokenizer was rebuilt")

    monkeypatch.setattr(runner._source, "tokenizer", no_rebuild)
    assert runner.tokenizer().encode(text) == want  # intact: reused
