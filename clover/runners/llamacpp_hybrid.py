"""The llama.cpp runner for a hybrid (Gated DeltaNet) model's causal path: block size 1 and exact mode on a GGUF
that `clover export --to gguf` wrote as llama.cpp's `qwen35moe` / `qwen35` (clover.conversion.gguf_hybrid).

    runner = LlamaCppFile.open("model.q4_0.gguf", options)     # picks this class for a hybrid GGUF
    generate(runner, prompts, block_size=1)                       # or rule="exact" with any block size

**Causal only.** llama.cpp's DeltaNet is the AR recurrence; Clover's block-bidirectional read of a block being
decoded has no llama.cpp form. So every forward is causal clean tokens (no query block): block rules with blocks of
more than one token are refused by the engine (`causal_only`), and exact mode verifies drafts copied from the
request's context (clover.engine.drafts.lookup) and never asks for a query block of drafts. The runner's config says
`rule: exact` (its default rule), so a plain `clover generate --runner llamacpp --model OUT.gguf` gives the model's
block-size-1 answers.

**Rewinding the recurrent state.** Exact mode feeds `[last, d_1 .. d_k]` and keeps the first `1 + a` of them.
Attention KV cells can be cut at any position, but a recurrent layer holds one state per sequence, after its last
token. llama.cpp b11549 keeps more where asked: a context made with `n_rs_seq = n` keeps, for each sequence, the
recurrent state after each of the last `n` tokens of its last decode (snapshots), and `llama_memory_seq_rm(seq, p,
-1)` then rolls the sequence back to position `p` (attention cells removed, the recurrent state taken from the
snapshot after token `p - 1`) as long as it drops at most `n` tokens: its "recurrent partial rollback", what its own
MTP and n-gram speculation use on Qwen3.5 / Qwen3-Next. So `rewind(keep)` is one `llama_memory_seq_rm` a row and
costs no forward: a rejection costs what full acceptance does. The snapshots are of the states inside the last
decode, so the earliest state a row goes back to is the one after its forward's first token (exact mode always
keeps that one, the last decided token; `keeps_first` says so to the cost calibration): rewinding a whole forward
of a row that had tokens before it is refused. The runner asks for `rollback` snapshots (default
`ROLLBACK`, enough for exact mode's widest verification and the cost calibration's widest forward) and reads back
what the context took (`llama_n_rs_seq`); a forward that `rewind` may have to undo is refused beyond them. The
snapshots cost memory: `1 + rollback` recurrent states a row instead of one (docs/gguf.md).

Where the build refuses partial rollback for the model's architecture (it clamps `n_rs_seq` to 0), each row owns
two sequence ids, its sequence and a backup: `mark()` copies the sequence to the backup (`llama_memory_seq_cp`:
the recurrent state's cell is shared, and llama.cpp copies it when the sequence is next written; attention cells
are only tagged), and `rewind(keep)` either drops the backup (every token kept) or puts the backup back in place of
the sequence and re-decodes the kept tokens (one causal decode of `keep` tokens per such row, batched): there a
rejection costs a second, shorter forward (docs/gguf.md gives the measured costs of both).

**A lone token's twin.** ggml multiplies one column by an f32 matrix (the MoE routers, `ffn_gate_inp`, stay f32 in
every export, as llama.cpp's quantiser keeps them) otherwise than several columns, so a token decoded alone and the
same token inside exact mode's verification differ in the router logits' last bits (~4e-7 at layer 0 of the 1.28 B
q4_0 twin, 2 threads, found by comparing every node of the two graphs through `cb_eval` in a scratch probe, not
kept); the 8-bit rounding of activations before the quantised matmuls now and then turns that into a step (first at layer 19's experts, 3e-4),
and the logits part by up to 5e-3, which on a random twin's flat logits changes the greedy answer (exact mode
parted from block size 1 at tokens 22, 14 and 2). Attention, DeltaNet (llama.cpp's fused per-token recurrence) and
the quantised matmuls gave the same bits alone and batched. So a lone token is decoded beside a twin on a spare
sequence id (the context holds `max_rows + 1` sequences; the twin starts from an empty state, is seen by nothing
and is removed after the decode): on that twin the five tokens' logits were then the same bits as in one
verification. Its cost (a second row a step, and one more sequence's recurrent states and snapshots: ~255 MiB on
the 1.28 B twin with `rollback` 16) is for an idle same-run measurement; `twin=False` decodes lone tokens alone.
A file without routed experts (`qwen35`, a plain dense GGUF) has no f32 router: its lone tokens get the twin only
where flash attention would split their keys (clover.runners.llamacpp, "Flash attention's shapes").
It does not make an all-f32 file's verification the same bits as block size 1 (there every matmul is f32, and 2
columns and 5 differ too, by ~3e-6 on the tests' tiny twin; its tokens are equal).

Prefix reuse (the server's prefix cache) is not offered (`prefix_reuse = False`: the server runs without one): a
stored prefix would need the recurrent state at its cut, which llama.cpp keeps only at a sequence's end.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import weakref
from pathlib import Path
from typing import Any

import torch

from clover.config import CloverConfig
from clover.conversion.gguf import gguf_tokenizer
from clover.conversion.gguf_header import read_header
from clover.conversion.gguf_hybrid import CONFIG_KEY
from clover.runners import llama_api
from clover.runners.llamacpp import DEFAULT_MAX_CELLS, LlamaCppCache, LlamaCppRunner

HYBRID_ARCHITECTURES = ("qwen35moe", "qwen35")
# recurrent-state snapshots asked for: exact mode's widest verification feeds 1 + 15 copied drafts and keeps at
# least one; the cost calibration's widest forward is 16 tokens, rewound to none (clover.engine.drafts.cost)
ROLLBACK = 16
CAUSAL_ONLY = ("a hybrid (Gated DeltaNet) model on the llama.cpp runner runs its causal path only: block size 1 or "
               "--rule exact (drafts from the context); block rules read a block in both directions, which "
               "llama.cpp's DeltaNet cannot: use the torch runner (--runner torch) for them")


class HybridCache(LlamaCppCache):
    """The rows' sequences. With rollback snapshots (`runner.rollback > 0`) `rewind` removes the rejected tokens in
    place; without, each slot's ids are `(sequence, backup)` and the cache remembers the tokens fed since `mark()`,
    which `rewind` re-decodes (module docstring)."""

    def __init__(self, runner: HybridLlamaCppRunner, slots: list[int]) -> None:
        super().__init__(runner, slots)
        self.fed: list[list[int]] | None = None

    def mark(self) -> None:
        super().mark()
        if self.runner.in_place:
            return
        self.fed = [[] for _ in self.slots]
        for slot in self.slots:
            main, backup = self.runner._ids(slot)
            self.runner._lib.llama_memory_seq_rm(self.runner._memory, backup, 0, -1)
            self.runner._lib.llama_memory_seq_cp(self.runner._memory, main, backup, -1, -1)

    @property
    def keeps_first(self) -> bool:
        """Whether `rewind` must keep each row's first token of the forward (rollback snapshots: module docstring)."""
        return self.runner.recurrent and bool(self.runner.rollback)

    def rewind(self, keep: torch.Tensor) -> None:
        if self.marked is None:
            raise RuntimeError("rewind needs a mark() before the forward it undoes")
        if self.runner.in_place:
            self._roll_back(keep)
        else:
            self._restore_and_redecode(keep)
        self.marked, self.fed = None, None

    def _roll_back(self, keep: torch.Tensor) -> None:
        """Each row's tokens after its first `keep[r]` removed from its sequence: attention cells and recurrent
        state alike (llama.cpp's rollback snapshots)."""
        runner = self.runner
        for r, (slot, start, k) in enumerate(zip(self.slots, self.marked, keep.tolist())):
            cut = start + int(k)
            if self.keeps_first and cut == start > 0 and cut < self.lengths[r]:
                raise RuntimeError(f"row {r}: rewind keeps none of the forward's tokens, but llama.cpp's rollback "
                                   "snapshots hold the recurrent state after its first token at the earliest")
            if cut < self.lengths[r]:
                if not runner._lib.llama_memory_seq_rm(runner._memory, runner._ids(slot)[0], cut, -1):
                    raise RuntimeError(f"llama.cpp refused to roll row {r} back from {self.lengths[r]} to {cut} "
                                       f"tokens (it keeps {runner.rollback} recurrent-state snapshots a sequence)")
            self.lengths[r] = cut

    def _restore_and_redecode(self, keep: torch.Tensor) -> None:
        """Rows that keep fewer tokens than they were fed get the backup back and re-decode the kept ones."""
        runner = self.runner
        lib, memory = runner._lib, runner._memory
        redo: list[tuple[int, list[int], int]] = []  # (row, tokens to re-decode, position of the first)
        for r, (slot, start, k) in enumerate(zip(self.slots, self.marked, keep.tolist())):
            main, backup = runner._ids(slot)
            if int(k) < len(self.fed[r]):  # the sequence back as it was at mark(), then the kept tokens again
                lib.llama_memory_seq_rm(memory, main, 0, -1)
                lib.llama_memory_seq_cp(memory, backup, main, -1, -1)
                if int(k):
                    redo.append((r, self.fed[r][: int(k)], start))
            lib.llama_memory_seq_rm(memory, backup, 0, -1)
            self.lengths[r] = start + int(k)
        if redo:
            runner._decode_causal([(r, tokens, start, set()) for r, tokens, start in redo], self)

    def snapshot(self) -> None:
        raise NotImplementedError("prefix reuse is not available for a hybrid model on the llama.cpp runner (the "
                                  "recurrent state exists only at a sequence's end)")

    def prefix(self, length: int, snapshot: None = None, copy: bool = False) -> Any:
        raise NotImplementedError("prefix reuse is not available for a hybrid model on the llama.cpp runner (the "
                                  "recurrent state exists only at a sequence's end)")


class HybridLlamaCppRunner(LlamaCppRunner):
    """A hybrid GGUF's causal path on llama.cpp (module docstring). `max_rows`: sequences held at once; `n_ctx`:
    attention KV cells shared by all rows (default `max_rows * max_position_embeddings`, at most 16384);
    `rollback`: recurrent-state snapshots to ask llama.cpp for (0: rewind by backup and re-decode); `self.rollback`
    is what the context took; `twin`: decode a lone token beside a twin, so that it rounds as a verification's rows
    do (module docstring)."""

    cache_class = HybridCache
    causal_only = True
    recurrent = True  # Gated DeltaNet layers: a state per sequence (a plain GGUF's runner has none)
    prefix_reuse = False  # the server's prefix cache is off for it (module docstring)
    max_block_size = None  # exact mode verifies drafts of any block size; block rules are refused (causal_only)

    def __init__(self, path: str | Path, *, threads: int | None = None, max_rows: int | None = 8,
                 n_ctx: int | None = None, max_block_size: int | None = None, kv_type: str = "f16",
                 flash_attn: bool | None = None, verbose: bool = False, rollback: int = ROLLBACK,
                 twin: bool = True) -> None:
        lib = llama_api.load()
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file {self.path} not found (make one with `clover export --to gguf`)")
        self.device = torch.device("cpu")
        if kv_type not in ("f16", "f32"):
            raise ValueError(f"kv_type must be 'f16' or 'f32', got {kv_type!r}")
        max_rows = max_rows or 8
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.max_rows = max_rows
        self.threads = threads or torch.get_num_threads()
        self._load_model(lib, verbose)
        self.config: CloverConfig = self._read_config()
        self.n_ctx = n_ctx or min(max_rows * self.config.max_position_embeddings, DEFAULT_MAX_CELLS)
        self.max_context = min(self.config.max_position_embeddings, self.n_ctx)
        self.n_batch = 512
        self.rollback = 0
        if rollback and self.recurrent:  # one sequence a row, rolled back in place
            self.ids_per_slot = 1
            self._open_context(max_rows + 1, kv_type, flash_attn, n_rs_seq=rollback)
            self.rollback = int(lib.llama_n_rs_seq(self._ctx))
            if not self.rollback:  # this build has no partial rollback for the architecture: a backup id a row
                lib.llama_batch_free(self._batch)
                lib.llama_free(self._ctx)
        if not self.recurrent:  # attention only: cells are cut at any position
            self.ids_per_slot = 1
            self._open_context(max_rows + 1, kv_type, flash_attn)
        elif not self.rollback:
            self.ids_per_slot = 2
            self._open_context(max_rows * self.ids_per_slot + 1, kv_type, flash_attn)
        # the last sequence id: a lone token's twin (module docstring); None: lone tokens decoded alone
        self._pad_id = max_rows * self.ids_per_slot if twin else None
        self._free = list(range(max_rows))
        self._abandoned: collections.deque[list[int]] = collections.deque()
        self._finalizer = weakref.finalize(self, llama_api.free_all, lib, self._batch, self._ctx, self._model)

    def _twin(self) -> bool:
        """With routed experts always: a lone row's f32 matmul (the MoE routers) rounds otherwise than a batch's
        (module docstring); without them (a dense file) where flash attention would split, as the parent decides."""
        return self.config.mlp_type == "moe" or (self.kernel_options["flash_attn"] and super()._twin())

    @property
    def in_place(self) -> bool:
        """Whether `rewind` cuts the sequence where it stands (rollback snapshots, or no recurrent layer)."""
        return bool(self.rollback) or not self.recurrent

    def _read_config(self) -> CloverConfig:
        """The checkpoint's config, which `clover export` wrote into the file."""
        self._header = read_header(self.path)
        if CONFIG_KEY not in self._header.metadata:
            raise ValueError(f"{self.path} has no {CONFIG_KEY} metadata: the llama.cpp runner runs hybrid GGUFs "
                             "written by `clover export --to gguf`, which carry the checkpoint's config")
        config = CloverConfig.from_dict(json.loads(self._header.metadata[CONFIG_KEY]))
        # the decoding default: exact mode (block size 1's answers) where the checkpoint's is a block rule, which
        # this runner cannot run; an explicit block rule is refused by the engine
        return dataclasses.replace(config, rule="exact")

    def _read_tokenizer(self) -> Any:
        return gguf_tokenizer(self.path, self.config.mask_token_id)

    def forward(self, ids: torch.Tensor | None, block_size: int, *, cache: HybridCache, prefix_len: int = 0,
                attention_mask: torch.Tensor | None = None, query_ids: torch.Tensor | None = None,
                logits_at: torch.Tensor | None = None, logits_to_keep: int | None = None,
                prompt: bool = False) -> torch.Tensor:
        """Causal clean tokens only (module docstring); logits where `logits_at` selects (or none)."""
        self._reclaim()
        if query_ids is not None:
            raise ValueError(CAUSAL_ONLY)
        clean = ids.tolist() if ids is not None else [[] for _ in range(cache.batch_size)]
        if block_size > 1 and prefix_len < (len(clean[0]) if clean else 0):
            raise ValueError(CAUSAL_ONLY)
        if logits_at is None and logits_to_keep != 0:
            raise ValueError("the llama.cpp runner returns logits where logits_at selects (or none: logits_to_keep=0)")
        want = logits_at.tolist() if logits_at is not None else None
        valid = attention_mask.bool().tolist() if attention_mask is not None else None
        rows = []
        for r, row in enumerate(clean):
            kept = [(c, t) for c, t in enumerate(row) if valid is None or valid[r][c]]
            wanted = {c for c, w in enumerate(want[r]) if w} if want is not None else set()
            rows.append((r, kept, cache.lengths[r], wanted))
        widest = max((len(kept) for _, kept, _, _ in rows), default=0)
        if cache.marked is not None and cache.keeps_first and widest > self.rollback:
            raise ValueError(f"a forward that rewind() may undo feeds at most {self.rollback} tokens a row on this "
                             f"runner (the recurrent-state snapshots llama.cpp keeps); got {widest}")
        outputs = self._decode_causal([(r, [t for _, t in kept], start, {i for i, (c, _) in enumerate(kept)
                                                                        if c in wanted})
                                       for r, kept, start, wanted in rows], cache)
        if cache.fed is not None:
            for r, kept, _, _ in rows:
                cache.fed[r] += [t for _, t in kept]
        if want is None:
            return torch.empty(0, self.config.vocab_size)
        order, missing = [], []
        for r, kept, _, wanted in rows:
            index = {c: i for i, (c, _) in enumerate(kept)}
            for c in sorted(wanted):
                (order if c in index else missing).append((r, index.get(c, c)))
        if missing:
            raise ValueError(f"logits_at selects padding positions (row, column) {missing[:5]}: they have no logits")
        return self._in_order(outputs, order)

    def _decode_causal(self, rows: list[tuple[int, list[int], int, set[int]]],
                       cache: HybridCache) -> list[tuple[list[tuple[int, int]], torch.Tensor]]:
        """Decode each row's `tokens` on its sequence from position `start`, causally, in batches of `n_batch`;
        each decode's (row, index)s of the tokens whose index is in the row's set, and their logits. Advances the
        rows' lengths."""
        entries = []
        for r, tokens, start, wanted in rows:
            main = self._ids(cache.slots[r])[0]
            entries += [(r, i, t, start + i, [main], i in wanted) for i, t in enumerate(tokens)]
            cache.lengths[r] = start + len(tokens)
        return [self._decode(entries[at:at + self.n_batch], causal=True)
                for at in range(0, len(entries), self.n_batch)]
