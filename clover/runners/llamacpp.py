"""The llama.cpp runner: Clover's block decoding on llama.cpp's (quantised) CPU kernels, for a GGUF written by
`clover export --to gguf` (dense Llama-family models; llama.cpp's C API through `clover.runners.llama_api`).

(Over the ~450-line mark on purpose: the runner and its cache share one layout of sequence ids and slots, which
both write; the C API (llama_api.py) and the hybrid and plain-GGUF runners already live beside it.)

    from clover.runners.llamacpp import LlamaCppRunner
    runner = LlamaCppRunner("clover-smol-q8_0.gguf", threads=2)
    result = clover.engine.generate(runner, prompts, max_new_tokens=64)   # any engine entry point

**Attention masks from sequence ids.** llama.cpp has one causal switch per decode (`llama_set_causal_attn`) and
otherwise decides who sees whom by sequence ids: a token attends to every cached cell that carries *its own* id
(the last id given for it; with causal attention off, whatever the position), and its own cell is written with
all the ids given. A forward of Clover's layout (`clover.engine.runner`) then takes one non-causal decode: each
row of the batch owns a slot of `K = max_block_size + 1` ids `s_0 … s_{K-2}, q`; its history cells carry them all;

* clean token in group `g` (a causal token is a group of its own, a committed block one group) is written with
  ids `[q, s_{K-2}, …, s_g]`: it sees the history and the groups up to its own (causal between groups, both
  directions inside a block), and is seen by later groups and by the query (no token of the decode attends with
  an id past the last group's, `s_{G-1}`, so those are written at once);
* query token: `[q]` only: it sees the history, every clean token and its whole block, and nobody sees it.

After the decode the query cells are removed (`llama_memory_seq_rm`) and the new clean cells get the ids before
their group's (`llama_memory_seq_cp`, `G - 1` calls: none for one causal token), so they are history for the next
forward. A causal run longer than the slot
(a prompt) is decoded first with causal attention on. Exact mode's rewind removes the rejected cells. Rows are
independent sequences, so batches need no padding: each row's positions are its own, and a forward whose rows do
not fit one decode is split between rows. A query block costs no sequence ids, so it may be longer than
`max_block_size` (decision mode's answer block); blocks of clean tokens may not.

**Flash attention's shapes** (llama.cpp b11549's CPU kernel, f16 KV). A decode's attention takes one of three
paths by its number of tokens `T`: `T >= 64` is tiled (sums in f32); `2 <= T < 64`, and `T == 1` in a small cache,
sum each query row in one pass over the keys (the value sum in f16); `T == 1` splits the keys between the threads
and merges their partial sums (`use_split_kv_path`) where the decode's view of the cache, `n_kv`, is 512 cells or
more. That view is not the row's length: it is the whole (unified) cache's highest used cell + 1, rounded up to a
multiple of 256 (`llama_kv_cache::get_n_kv`), so a lone token is split from the moment any cell at index 256 or
above is in use (a scratch probe, not kept: clover-smol's q4_0 export, 2 threads, an empty cache: after a prompt of
`L` tokens a lone token's logits equal its padded twin's bits for `L` <= 255 and differ by 0.3-0.6 from `L` = 256).
The paths round differently: on that export, a tool prompt of ~300 tokens, one token decoded alone and the same token
inside a verification were up to ~1 apart per logit, so exact mode's answers parted from block size 1's at a near
tie. So every token after the prompt's head takes the one-pass path: a lone token that would be split is decoded
beside a copy of itself on the scratch sequence id (seen by nothing, removed after; it changes no other row's
bits, as a position's logits do not depend on the batch's other rows), and a decode with the sequence-id masks
holds at most 63 tokens (whole rows go in separate decodes beyond). Which cells llama.cpp uses is not in its C
API, so the runner keeps a bound, `_cells_high`: a decode of `n` tokens takes the first free cells from the
cache's head (or from 0) and every cell from the bound on is free, so they lie below the bound + `n`; it grows by
each decode's tokens (and a restored prefix's) and returns to 0, with `llama_memory_clear` putting the head at 0,
when no row holds a cell. A lone token is padded when the bound + 1 gives a view of 512: never too late, sometimes
early (after rejected drafts or a twin have left holes llama.cpp fills). A prompt's head, every token before the
first whose logits are wanted and that one too (the whole prompt: `_head`), is decoded with causal attention in
llama.cpp's own batches, as llama.cpp decodes a prompt (tiled from 64 tokens), its last token's logits from that
decode; only what follows (exact mode's first query block) takes a decode with the sequence-id masks, so block
size 1 and exact mode cut a prompt at the same place (docs/gguf.md). With flash attention off (f32 KV) nothing is
padded.

**Prefix reuse** (`clover.engine.runner`). A stored prefix is kept out of the KV cache, in host memory: the
first `n` cells of a row are copied to the runner's scratch sequence id (`llama_memory_seq_cp`: no KV is copied),
saved with `llama_state_seq_get_data` (their positions, keys and values, ~23 KB a token for SmolLM2-135M in f16)
and the scratch id cleared (`LlamaCppCache.prefix(n, copy=True)`); `LlamaCppPrefix.prefix(n)` writes them back into
a new row's slot (`llama_state_seq_set_data`, then every id of the slot carries them), so its prefill starts at
`n`. Why not keep them as cells: in one unified KV cache every decode attends over every cell up to the highest
one in use, masked or not, so cells kept for later cost every forward of every row. Restored cells equal the
saved ones bit for bit.

What needs the torch runner: hybrid (Gated DeltaNet) models' block rules — llama.cpp's DeltaNet is causal,
Clover's reads a block in both directions (their causal path, block size 1 and exact mode, runs on llama.cpp:
`clover.runners.llamacpp_hybrid`, which `open` picks for such a GGUF; a plain AR GGUF without Clover's metadata
runs the same causal path: `clover.runners.llamacpp_plain`); gated adapters' drafts (they act only at query positions; llama.cpp applies weights to
every token: `clover export --drop-gated-adapter` writes the causal path alone, which this runner decodes to the
model's own answers at block size 1 and in exact mode, drafting with the base).
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import gc
import hashlib
import json
import logging
import weakref
from pathlib import Path
from typing import Any, Hashable, Iterable

import numpy as np
import torch

from clover.checkpoint import atomic_directory
from clover.config import CloverConfig
from clover.conversion.gguf import GGUFSource
from clover.paths import cache_root
from clover.runners import llama_api
from clover.runners.registry import RunnerOptions

logger = logging.getLogger(__name__)

FLASH_TILE_ROWS = 64  # llama.cpp's CPU flash attention tiles decodes of this many tokens or more (Q_TILE_SZ)
KV_VIEW_PAD = 256  # a decode attends over the KV cache's used cells rounded up to this many (llama_kv_cache::get_n_kv)
SPLIT_KV_CELLS = 512  # ... and splits a lone token's attention between the threads over this many or more
MAX_SEQ_IDS = 256  # llama.cpp's LLAMA_MAX_SEQ: every row's slot of ids (and the scratch id) must fit in it
DEFAULT_MAX_CELLS = 16384  # the default KV budget (SmolLM2-135M: 23 KB per cell in f16, so ~380 MB)
TOKENIZER_MANIFEST = "clover-manifest.json"  # a cached tokenizer's files and their sha256, written last
TOKENIZER_CONVERSION = 2  # the conversion's version, in the cache's name: 2 reads the file alone, where 1 read a
# `tokenizer.json` beside it instead, without a chat template (one converted by an older Clover is converted again)


@dataclasses.dataclass
class _Row:
    """One row's part of a forward: its clean tokens by group, its query block, and which outputs it wants."""

    clean: list[tuple[int, int, int]]  # (token, column, group) of the real clean tokens, in order
    query: list[tuple[int, int]]  # (token, column)
    want: set[int]  # columns (clean then query) whose logits are needed


class LlamaCppCache:
    """The rows of a batch in the runner's one llama.cpp KV cache: a slot of sequence ids and a length per row.

    Its owner gives the slots back: `select` for the rows that leave, `release()` for all of them; `concat` moves
    the slots into the joined cache. A cache dropped without `release()` (a failed request's batch) only queues its
    slots: the runner frees them at its next call, on its owner's thread, never from a garbage collector's."""

    def __init__(self, runner: LlamaCppRunner, slots: list[int]) -> None:
        self.runner = runner
        self.slots = slots
        self.lengths = [0] * len(slots)
        self.marked: list[int] | None = None
        self._finalizer = weakref.finalize(self, runner._abandon, self.slots)

    def release(self) -> None:
        """Give every row's slot back now: the cache is empty afterwards (0 rows). Safe to call twice."""
        self.runner._release(list(self.slots))
        self.slots.clear()  # in place: the finalizer holds this list
        self.lengths = []

    @property
    def batch_size(self) -> int:
        return len(self.slots)

    @property
    def length(self) -> int:
        return max(self.lengths, default=0)

    def select(self, rows: torch.Tensor | list[int]) -> None:
        rows = [int(r) for r in (rows.tolist() if torch.is_tensor(rows) else rows)]
        kept = set(rows)
        self.runner._release([s for i, s in enumerate(self.slots) if i not in kept])
        slots, self.lengths = [self.slots[r] for r in rows], [self.lengths[r] for r in rows]
        self.slots[:] = slots  # in place: the finalizer holds this list

    def mark(self) -> None:
        self.marked = list(self.lengths)

    def rewind(self, keep: torch.Tensor) -> None:
        """Keep each row's first `keep[r]` clean tokens of the forward since `mark`; its later cells are removed."""
        if self.marked is None:
            raise RuntimeError("rewind needs a mark() before the forward it undoes")
        for r, (slot, start, k) in enumerate(zip(self.slots, self.marked, keep.tolist())):
            self.lengths[r] = start + int(k)
            self.runner._trim(slot, self.lengths[r])
        self.marked = None

    def snapshot(self) -> None:
        """Nothing: every layer is attention, and attention KV can be cut at any length."""
        return None

    def prefix(self, length: int, snapshot: None = None, copy: bool = False) -> LlamaCppCache | LlamaCppPrefix:
        """This one row's first `length` tokens: stored apart (`copy`), or as a new row to continue from."""
        if self.batch_size != 1 or length > self.lengths[0]:
            raise ValueError(f"a prefix is cut from one row of at least its length; this cache has "
                             f"{self.batch_size} rows of {self.lengths} tokens, asked for {length}")
        return self.runner._prefix_of(self.runner._ids(self.slots[0])[-1], length, copy)

    @classmethod
    def concat(cls, caches: list[LlamaCppCache]) -> LlamaCppCache:
        if not caches:
            raise ValueError("concat needs at least one cache")
        new = cls(caches[0].runner, [s for c in caches for s in c.slots])
        new.lengths = [n for c in caches for n in c.lengths]
        for c in caches:  # the slots now belong to `new`
            c.slots.clear()
            c.lengths = []
        return new


class LlamaCppPrefix:
    """A stored prefix: the first `length` cells of a sequence saved out of the KV cache (`llama_state_seq_get_data`,
    see the module docstring), in host memory until it is garbage."""

    def __init__(self, runner: LlamaCppRunner, data: ctypes.Array, length: int) -> None:
        self.runner, self.data, self.length = runner, data, length

    batch_size = 1

    def prefix(self, length: int, snapshot: None = None, copy: bool = False) -> LlamaCppCache | LlamaCppPrefix:
        if length > self.length:
            raise ValueError(f"this stored prefix holds {self.length} tokens, asked for {length}")
        if copy and length == self.length:
            return LlamaCppPrefix(self.runner, self.data, length)  # the same bytes: shared, counted once
        return self.runner._restore(self, length, copy)

    def storages(self, snapshots: Iterable[None] = ()) -> dict[Hashable, int]:
        """Its saved bytes, by buffer (prefixes of the same length share one)."""
        return {id(self.data): len(self.data)}


class LlamaCppRunner:
    """A GGUF exported by `clover export --to gguf`, run by llama.cpp (see the module docstring).

    `max_rows`: rows decoded together (the server's batch; None: as many as llama.cpp's sequence ids allow);
    `n_ctx`: KV cells shared by all rows (default `max_rows * max_position_embeddings`, at most 16384); one row
    may hold `max_context = min(max_position_embeddings, n_ctx)` positions;
    `max_block_size`: the largest block size an engine may use with it (default: 16, or the model's block size if
    larger); `kv_type`: "f16" (llama.cpp's default) or "f32"; `flash_attn`: llama.cpp's flash attention (None:
    on with an f16 KV cache, as llama-server's `auto` turns it on for a CPU, off with f32, where the plain path
    keeps the exactness the tests check; `flash_attention` says why)."""

    name = "llamacpp"
    cache_class = LlamaCppCache
    _pad_id: int | None = None  # the sequence id a lone token's twin is decoded on (module docstring); None: none
    _cells_high = 0  # a bound on the KV cache's highest used cell + 1, which decides the twin (module docstring)
    causal_only = False  # block rules and query blocks run here (a hybrid GGUF's runner runs the causal path only)
    # torch's threads during the engine's prefills and steps (clover.engine.engine, every rule): the forward is
    # llama.cpp's, on its own threads; torch only reads a few rows of logits, and its pool would spin on those cores
    torch_threads = 1

    def __init__(self, path: str | Path, *, threads: int | None = None, max_rows: int | None = 8,
                 n_ctx: int | None = None, max_block_size: int | None = None, kv_type: str = "f16",
                 flash_attn: bool | None = None, verbose: bool = False) -> None:
        lib = llama_api.load()
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file {self.path} not found (make one with `clover export --to gguf`)")
        try:
            source = GGUFSource(self.path)
        except ValueError as e:
            raise ValueError(f"{e}. LlamaCppRunner runs dense Llama-family GGUFs written by `clover export --to "
                             "gguf`; a hybrid model's GGUF (qwen35moe / qwen35) runs on HybridLlamaCppRunner "
                             "(clover.runners.llamacpp_hybrid; --runner llamacpp picks it: clover.runners.llamacpp_open)") from e
        if source.mask_token_id is None:
            raise ValueError(f"{self.path} has no mask token (no clover.mask_token_id metadata): block decoding "
                             "needs one. Export the model with `clover export --to gguf`, which writes it")
        self._source, self._header = source, source.header
        self.config: CloverConfig = dataclasses.replace(source.config, mask_token_id=int(source.mask_token_id))
        self.device = torch.device("cpu")
        if kv_type not in ("f16", "f32"):
            raise ValueError(f"kv_type must be 'f16' or 'f32', got {kv_type!r}")
        max_block_size = max_block_size or max(16, self.config.block_size)
        max_rows = max_rows or (MAX_SEQ_IDS - 1) // (max_block_size + 1)
        if max_rows < 1 or max_block_size < 1:
            raise ValueError(f"max_rows and max_block_size must be >= 1, got {max_rows}, {max_block_size}")
        self.ids_per_slot = max_block_size + 1
        if max_rows * self.ids_per_slot + 1 > MAX_SEQ_IDS:
            raise ValueError(f"max_rows={max_rows} rows of {self.ids_per_slot} sequence ids (max_block_size + 1) "
                             f"and a scratch id exceed llama.cpp's {MAX_SEQ_IDS}: lower max_rows or max_block_size")
        self.max_rows, self.max_block_size = max_rows, max_block_size
        self.threads = threads or torch.get_num_threads()
        self._load_model(lib, verbose)
        if self.n_vocab != self.config.vocab_size:
            raise ValueError(f"{self.path}: the tokenizer has {self.n_vocab} tokens but the embeddings "
                             f"{self.config.vocab_size} rows; llama.cpp's logits would not cover Clover's vocabulary")
        self.n_ctx = n_ctx or min(max_rows * self.config.max_position_embeddings, DEFAULT_MAX_CELLS)
        self.max_context = min(self.config.max_position_embeddings, self.n_ctx)
        # one ubatch holds a whole non-causal decode: every row's clean tokens (at most a slot's groups) and block
        self.n_batch = max(512, 2 * max_rows * max_block_size)
        # cells carry several sequence ids (a row's groups, a prefix's scratch id): one shared cache
        self._open_context(max_rows * self.ids_per_slot + 1, kv_type, flash_attn)
        self._free = list(range(max_rows))
        self._abandoned: collections.deque[list[int]] = collections.deque()  # slots of caches dropped unreleased
        self._scratch = max_rows * self.ids_per_slot  # the sequence id a prefix passes through to be saved
        # flash attention's one-pass shape for every token after the prompt's head (module docstring)
        flash = self.kernel_options["flash_attn"]
        self._pad_id = self._scratch if flash else None
        self._decode_rows_most = FLASH_TILE_ROWS - 1 if flash else self.n_batch
        self._finalizer = weakref.finalize(self, llama_api.free_all, lib, self._batch, self._ctx, self._model)

    def _load_model(self, lib: Any, verbose: bool) -> None:
        self._lib = lib
        if not verbose:
            lib.llama_log_set(llama_api.quiet_log(), None)
        params = lib.llama_model_default_params()
        params.n_gpu_layers = 0
        self._model = lib.llama_model_load_from_file(str(self.path).encode(), params)
        if not self._model:
            raise RuntimeError(f"llama.cpp could not load {self.path}")
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self._model))

    def _open_context(self, n_seq_max: int, kv_type: str, flash_attn: bool | None, n_rs_seq: int = 0) -> None:
        """The context (`n_ctx` cells, `n_batch` a ubatch, one KV cache all sequences share; `n_rs_seq` recurrent-
        state snapshots per sequence, for a hybrid model's rollback), its memory and a batch whose tokens may
        carry `ids_per_slot` sequence ids."""
        lib = self._lib
        ctx_params = lib.llama_context_default_params()
        ctx_params.n_ctx, ctx_params.n_batch, ctx_params.n_ubatch = self.n_ctx, self.n_batch, self.n_batch
        ctx_params.n_seq_max, ctx_params.n_rs_seq = n_seq_max, n_rs_seq
        ctx_params.kv_unified = True
        ctx_params.n_threads = ctx_params.n_threads_batch = self.threads
        self.kernel_options = {"kv_type": kv_type, "flash_attn": flash_attention(kv_type, flash_attn)}  # cost key
        kv = llama_api.GGML_TYPE_F32 if kv_type == "f32" else llama_api.GGML_TYPE_F16
        ctx_params.type_k = ctx_params.type_v = kv
        ctx_params.flash_attn_type = (llama_api.LLAMA_FLASH_ATTN_TYPE_ENABLED if self.kernel_options["flash_attn"]
                                      else llama_api.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        self._ctx = lib.llama_init_from_model(self._model, ctx_params)
        if not self._ctx:
            lib.llama_model_free(self._model)
            raise RuntimeError(f"llama.cpp could not create a context for {self.path} (n_ctx={self.n_ctx})")
        self._memory = lib.llama_get_memory(self._ctx)
        self._batch = lib.llama_batch_init(self.n_batch, 0, self.ids_per_slot)

    def close(self) -> None:
        """Free llama.cpp's context and model now (otherwise when the runner is garbage)."""
        self._finalizer()

    @classmethod
    def open(cls, path: str | Path, options: RunnerOptions) -> LlamaCppRunner:
        """The GGUF file `path` with `options`' threads, rows and KV cells; it keeps the GGUF's weight types and
        runs on the CPU, so a dtype, quantisation or device is refused. This class's own; which class a file needs
        (a hybrid's, a plain AR file's) `clover.runners.llamacpp_open` chooses."""
        if options.dtype or options.quant not in ("none", "auto"):
            raise ValueError("--dtype / --quant: the llama.cpp runner keeps the GGUF's weight types (choose them "
                             "with `clover export --to gguf --quant`)")
        if options.device not in (None, "cpu"):
            raise ValueError(f"--device {options.device}: the llama.cpp runner runs on the CPU; use --runner torch")
        return cls(path, threads=options.threads, max_rows=options.max_rows, n_ctx=options.ctx)

    def tokenizer_cache_dir(self) -> Path:
        """Where the GGUF's converted tokenizer is kept: named by a hash of the file's tokenizer metadata (and
        Clover's mask token), so that every file of one tokenizer (another quantisation, a re-export, a copy) shares
        one conversion."""
        digest = self._header.metadata_digest(("tokenizer.", "clover.mask_token_id"))
        return cache_root() / "gguf-tokenizers" / f"{digest[:32]}-v{TOKENIZER_CONVERSION}"

    def tokenizer(self) -> Any:
        """The GGUF's tokenizer (with Clover's mask token and the file's chat template), converted by `transformers`.
        Converting it takes `transformers` tens of seconds, so the result is kept in Clover's cache directory,
        keyed by a hash of the file's tokenizer metadata (`tokenizer_cache_dir`): published whole (written apart, then renamed into
        place) with a manifest of its files' hashes, and rebuilt where the manifest is missing or disagrees (a
        directory cut short, or written in place by an older Clover)."""
        from clover.tokenizer import load_tokenizer  # deferred: tokenizers, only when one is read

        saved = self.tokenizer_cache_dir()
        if not _complete(saved):
            if saved.exists():
                logger.warning("the tokenizer cached in %s is incomplete or damaged: rebuilding it", saved)
            with atomic_directory(saved) as tmp:
                self._read_tokenizer().save_pretrained(tmp)
                hashes = {f.name: _sha256(f) for f in sorted(tmp.iterdir()) if f.is_file()}
                (tmp / TOKENIZER_MANIFEST).write_text(json.dumps(hashes, indent=1))
        return load_tokenizer(saved)

    def _read_tokenizer(self) -> Any:
        return self._source.tokenizer()

    # -- cache ------------------------------------------------------------------------------------------
    def new_cache(self, batch_size: int) -> LlamaCppCache:
        self._reclaim()
        if batch_size > len(self._free):
            gc.collect()  # a cache kept alive only by a reference cycle (a failed request's traceback) frees its rows
            self._reclaim()
        if batch_size > len(self._free):
            raise ValueError(f"the llama.cpp runner decodes at most {self.max_rows} rows at once (max_rows) and "
                             f"{self.max_rows - len(self._free)} are in use: {batch_size} more do not fit")
        slots, self._free = self._free[:batch_size], self._free[batch_size:]
        return self.cache_class(self, slots)

    def _ids(self, slot: int) -> range:
        return range(slot * self.ids_per_slot, (slot + 1) * self.ids_per_slot)

    def _trim(self, slot: int, length: int) -> None:
        for s in self._ids(slot):
            self._lib.llama_memory_seq_rm(self._memory, s, length, -1)

    def _release(self, slots: list[int]) -> None:
        for slot in slots:
            self._trim(slot, 0)
            self._free.append(slot)
        if self._pad_id is not None and len(self._free) == self.max_rows:  # no cell in use: new cells from 0 on
            self._lib.llama_memory_clear(self._memory, False)
            self._cells_high = 0

    def _abandon(self, slots: list[int]) -> None:
        """A cache dropped without `release()` (its finalizer, on any thread): queue its slots, touch nothing."""
        if slots:
            self._abandoned.append(slots)  # deque.append is atomic: safe from any thread

    def _reclaim(self) -> None:
        """Free the slots of caches dropped without `release()` (queued by their finalizers), on this thread."""
        while self._abandoned:
            self._release(self._abandoned.popleft())

    # -- stored prefixes ----------------------------------------------------------------------------------
    def _prefix_of(self, source: int, length: int, copy: bool) -> LlamaCppCache | LlamaCppPrefix:
        """The first `length` cells of the sequence `source`, saved to host memory (`copy`) or as a new row of one
        slot (every id of the slot carries them: they are its history)."""
        if copy:
            self._lib.llama_memory_seq_cp(self._memory, source, self._scratch, 0, length)
            return self._save_scratch(length)
        row = self.new_cache(1)
        row.lengths[0] = length
        for s in self._ids(row.slots[0]):
            self._lib.llama_memory_seq_cp(self._memory, source, s, 0, length)
        return row

    def _save_scratch(self, length: int) -> LlamaCppPrefix:
        """The scratch id's cells saved to host memory; the scratch id is cleared."""
        try:
            size = self._lib.llama_state_seq_get_size(self._ctx, self._scratch)
            data = (ctypes.c_uint8 * size)()
            if self._lib.llama_state_seq_get_data(self._ctx, data, size, self._scratch) != size:
                raise RuntimeError(f"llama.cpp could not save a prefix of {length} tokens")
        finally:
            self._lib.llama_memory_seq_rm(self._memory, self._scratch, 0, -1)
        return LlamaCppPrefix(self, data, length)

    def _restore(self, stored: LlamaCppPrefix, length: int, copy: bool) -> LlamaCppCache | LlamaCppPrefix:
        """The first `length` tokens of a stored prefix: written back as a new row (or saved again, shorter)."""
        row = None if copy else self.new_cache(1)
        target = self._scratch if copy else self._ids(row.slots[0])[-1]
        self._cells_high += stored.length  # the cells it is written to (the `_decode` bound's argument)
        if not self._lib.llama_state_seq_set_data(self._ctx, stored.data, len(stored.data), target):
            self._lib.llama_memory_seq_rm(self._memory, target, 0, -1)
            raise RuntimeError(f"llama.cpp's KV cache has no room for a stored prefix of {stored.length} tokens "
                               f"({self.n_ctx} cells shared by all rows): a larger n_ctx (--ctx)")
        self._lib.llama_memory_seq_rm(self._memory, target, length, -1)
        if copy:
            return self._save_scratch(length)
        row.lengths[0] = length
        for s in self._ids(row.slots[0])[:-1]:
            self._lib.llama_memory_seq_cp(self._memory, target, s, 0, length)
        return row

    # -- forward ----------------------------------------------------------------------------------------
    def forward(self, ids: torch.Tensor | None, block_size: int, *, cache: LlamaCppCache, prefix_len: int = 0,
                attention_mask: torch.Tensor | None = None, query_ids: torch.Tensor | None = None,
                logits_at: torch.Tensor | None = None, logits_to_keep: int | None = None,
                prompt: bool = False) -> torch.Tensor:
        self._reclaim()
        n = cache.batch_size
        clean = ids.tolist() if ids is not None else [[] for _ in range(n)]
        lc = len(clean[0]) if clean else 0
        query = query_ids.tolist() if query_ids is not None else [[] for _ in range(n)]
        lq = len(query[0]) if query else 0
        if lq not in (0, block_size):
            raise ValueError(f"the llama.cpp runner decodes one query block of block_size tokens per forward; got "
                             f"{lq} query tokens, block_size {block_size}")
        if logits_at is None and logits_to_keep != 0:
            raise ValueError("the llama.cpp runner returns logits where logits_at selects (or none: logits_to_keep=0)")
        want = logits_at.tolist() if logits_at is not None else None
        valid = attention_mask.bool().tolist() if attention_mask is not None else None
        causal = block_size == 1 or self.config.context_reading == "causal"
        causal_len = lc if causal else prefix_len
        if lc > causal_len and block_size > self.max_block_size:  # a query block alone may be longer (decisions)
            raise ValueError(f"the llama.cpp runner commits blocks of at most {self.max_block_size} tokens "
                             f"(max_block_size); got block_size {block_size}")
        rows = []
        for r in range(n):
            tokens, group = [], -1
            for c, t in enumerate(clean[r]):
                if valid is not None and not valid[r][c]:
                    continue
                if c < causal_len or (c - causal_len) % block_size == 0 or group < 0:
                    group += 1
                tokens.append((t, c, group))
            wanted = {c for c, w in enumerate(want[r]) if w} if want is not None else set()
            rows.append(_Row(tokens, [(t, lc + j) for j, t in enumerate(query[r])], wanted))
        outputs = self._decode_rows(cache, rows, prompt)
        if want is None:
            return torch.empty(0, self.config.vocab_size)
        return self._in_order(outputs, [(r, c) for r in range(n) for c in sorted(rows[r].want)])

    def _in_order(self, outputs: list[tuple[list[tuple[int, int]], torch.Tensor]],
                  order: list[tuple[int, int]]) -> torch.Tensor:
        """The logits of `order`'s (row, column)s, `[len(order), V]`, from the decodes' `(keys, logits)`. A forward
        of one decode whose outputs come in the order asked (a step of one row) returns its copy as it is."""
        outputs = [(keys, logits) for keys, logits in outputs if keys]
        if len(outputs) == 1 and outputs[0][0] == order:
            return outputs[0][1]
        at = {rc: i for i, rc in enumerate(rc for keys, _ in outputs for rc in keys)}
        missing = [rc for rc in order if rc not in at]
        if missing:
            raise ValueError(f"logits_at selects padding positions (row, column) {missing[:5]}: they have no logits")
        if not order:
            return torch.empty(0, self.config.vocab_size)
        return torch.cat([logits for _, logits in outputs])[[at[rc] for rc in order]]

    def _decode_rows(self, cache: LlamaCppCache, rows: list[_Row],
                     prompt: bool = False) -> list[tuple[list[tuple[int, int]], torch.Tensor]]:
        """Decode every row's tokens: a leading causal run with causal attention on (`_head`; `prompt`: the forward
        reads the prompt), the rest in one non-causal decode with the sequence-id masks. Returns each decode's
        (row, column)s and their logits."""
        early: list[list[tuple[int, int, int]]] = []
        for row in rows:
            cut, first = _head(row, self.ids_per_slot - 1, prompt)
            early.append(row.clean[:cut])
            row.clean = [(t, c, g - first) for t, c, g in row.clean[cut:]]
        outputs: list[tuple[list[tuple[int, int]], torch.Tensor]] = []
        if any(early):  # causal, so it may be cut into batches of any size
            entries = [(r, t, c) for r, part in enumerate(early) for t, c, _ in part]
            for start in range(0, len(entries), self.n_batch):
                items = []
                for r, t, c in entries[start:start + self.n_batch]:
                    slot = cache.slots[r]
                    items.append((r, c, t, cache.lengths[r], list(self._ids(slot)), c in rows[r].want))
                    cache.lengths[r] += 1
                outputs.append(self._decode(items, causal=True))
        starts = list(cache.lengths)
        slot_ids = [list(self._ids(slot)) for slot in cache.slots]
        items: list[tuple[int, int, int, int, list[int], bool]] = []
        for r, row in enumerate(rows):
            ids, own = slot_ids[r], []
            q, position = ids[-1], cache.lengths[r]
            if row.clean:  # group g written with [q, s_{K-2} .. s_g]: ids past the last group are seen by no
                # token of this decode, so they are written now rather than copied after it
                for t, c, g in row.clean:
                    own.append((r, c, t, position, [q] + ids[g:-1][::-1], c in row.want))
                    position += 1
            for t, c in row.query:
                own.append((r, c, t, position, [q], c in row.want))
                position += 1
            cache.lengths[r] += len(row.clean)
            if len(own) > self.n_batch:
                raise ValueError(f"{len(own)} tokens of one row in one block forward exceed the runner's batch of "
                                 f"{self.n_batch}: a smaller block (or a shorter form)")
            if items and len(items) + len(own) > self._decode_rows_most:  # rows are independent: whole rows may
                # go in separate decodes (and do past flash attention's tiled size: module docstring)
                outputs.append(self._decode(items, causal=False))
                items = []
            items += own
        if items:
            outputs.append(self._decode(items, causal=False))
        for r, row in enumerate(rows):
            ids = slot_ids[r]
            if row.query:
                self._lib.llama_memory_seq_rm(self._memory, ids[-1], cache.lengths[r], -1)
            if row.clean:  # the new cells join the history: every id of the slot sees them from now on (they all
                # carry the last group's id; the ids before it are added: none for a single causal token)
                last = row.clean[-1][2]
                for s in ids[:last]:
                    self._lib.llama_memory_seq_cp(self._memory, ids[last], s, starts[r], cache.lengths[r])
        return outputs

    def _twin(self) -> bool:
        """Whether a lone token is decoded beside a twin now: where llama.cpp would split its attention."""
        return _split_kv(self._cells_high + 1)

    def _decode(self, items: list[tuple[int, int, int, int, list[int], bool]],
                causal: bool) -> tuple[list[tuple[int, int]], torch.Tensor]:
        """One `llama_decode` of `(row, column, token, position, sequence ids, wants logits)` items. With flash
        attention a lone token that llama.cpp would split between its threads (`_twin`) is decoded beside a copy of
        itself on the scratch id (module docstring)."""
        lib, batch = self._lib, self._batch
        padded = len(items) == 1 and self._pad_id is not None and self._twin()
        if padded:  # seen by no other token (its only id is one no other cell carries), removed after the decode
            _, _, token, position, _, _ = items[0]
            items = [*items, (-1, -1, token, position, [self._pad_id], False)]
        # llama.cpp takes a decode's cells from its search start (the cache's head, at most `_cells_high`, or 0):
        # the first free ones, and every cell from `_cells_high` on is free, so they all lie below this
        self._cells_high += len(items)
        batch.n_tokens = len(items)
        for i, (_, _, token, position, seq_ids, logits) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, position, len(seq_ids), logits
            row = batch.seq_id[i]  # (indexed once: ctypes builds a pointer object per index)
            for j, s in enumerate(seq_ids):
                row[j] = s
        lib.llama_set_causal_attn(self._ctx, causal)
        rc = lib.llama_decode(self._ctx, batch)
        if padded:
            lib.llama_memory_seq_rm(self._memory, self._pad_id, 0, -1)
        if rc == 1:
            raise RuntimeError(f"llama.cpp's KV cache is full ({self.n_ctx} cells shared by all rows): create the "
                               "runner with a larger n_ctx (--ctx)")
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with code {rc}")
        wanted = [(r, c) for r, c, _, _, _, w in items if w]
        if not wanted:
            return wanted, torch.empty(0, self.config.vocab_size)
        logits = np.ctypeslib.as_array(lib.llama_get_logits(self._ctx), shape=(len(wanted), self.n_vocab))
        out = torch.from_numpy(logits.copy())  # one copy out of llama.cpp's buffer, which the next decode reuses
        if self.config.vocab_size > self.n_vocab:  # a plain GGUF's mask id, past its vocabulary (llamacpp_plain)
            out = torch.nn.functional.pad(out, (0, self.config.vocab_size - self.n_vocab), value=float("-inf"))
        return wanted, out


def _head(row: _Row, groups: int, prompt: bool) -> tuple[int, int]:
    """How many of `row`'s clean tokens are decoded first, causally (their cells written with causal attention on),
    and the group the rest start at. The head is the leading run of one-token groups (causal tokens) before the
    first whose logits are wanted, and in a forward that reads the prompt (`prompt`) that token too: a prompt is
    then decoded as llama.cpp decodes it, its last token's logits from the same decode, and only what follows it
    (exact mode's query block) with the sequence-id masks; block size 1 and exact mode cut a prompt alike. The head
    grows further where the rest would hold more groups than the slot has ids (`groups`)."""
    total = row.clean[-1][2] + 1 if row.clean else 0
    sizes = collections.Counter(g for _, _, g in row.clean)
    wanted = next((g + prompt for _, c, g in row.clean if c in row.want), total)
    first = min(wanted, next((g for _, _, g in row.clean if sizes[g] > 1), total))
    first = max(first, total - groups, 0)
    return sum(1 for _, _, g in row.clean if g < first), first


def _split_kv(used_end: int) -> bool:
    """Whether llama.cpp b11549's CPU flash attention splits a lone token's keys between its threads when the
    cache's highest used cell + 1 is `used_end`: its view of the cache (`n_kv`, what it attends over) is that
    rounded up to `KV_VIEW_PAD` cells (at least one pad), and the split path (`use_split_kv_path` in
    `ggml_compute_forward_flash_attn_ext_f16`) takes one query token over an f16 view of `SPLIT_KV_CELLS` or more."""
    return -(-used_end // KV_VIEW_PAD) * KV_VIEW_PAD >= SPLIT_KV_CELLS


def flash_attention(kv_type: str, asked: bool | None) -> bool:
    """Whether a context uses llama.cpp's flash attention: as `asked`, else (None) with an f16 KV cache only.

    Why on with f16: in the decode shapes the runner gives it (module docstring, "flash attention's shapes") its
    CPU kernel sums each query row in one pass, so a position's logits are the same bits decoded alone or inside
    a verification of several tokens, and exact mode's answers on a quantised file are block size 1's (with the
    plain path they differ by up to ~0.9 on clover-smol's q4_0 and q8_0 exports, and part from block size 1's
    after some tokens: docs/gguf.md); it is also one fused op per layer where the plain path is six (each
    a barrier of the CPU threads), and what llama-server's `auto` picks on a CPU. It rounds q and the running
    output through f16, so at f32 (kv_type "f32", where the tests compare the runner with the torch runner at
    ~1e-5) it stays off: the plain path keeps f32 throughout."""
    return asked if asked is not None else kv_type == "f16"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _complete(directory: Path) -> bool:
    """Whether `directory` holds every file its manifest lists, each with the hash listed."""
    try:
        hashes = json.loads((directory / TOKENIZER_MANIFEST).read_text())
        return bool(hashes) and all(_sha256(directory / name) == h for name, h in hashes.items())
    except (OSError, ValueError, AttributeError, TypeError):
        return False
