"""Training batches for the block-diffusion objective (`objective.py`): documents -> one padded batch.

A sample is a prompt (a causal prefix, never masked) and a response padded with `[MASK]` to whole blocks of the
block size, so no block crosses a document boundary (docs/design.md §4); `collate` right-pads the samples of a
batch to the longest, and records per sample its prompt length, blocks, noise seed, real length and untrained
tail (what the noised copies must not show).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

@dataclass
class Batch:
    """Documents laid out for the objective.

    `input_ids` `[N, P + R]`: prompts left-padded to a common `P` (attention_mask False there), then responses
    padded with `[MASK]` to `R`, a multiple of the block size. `loss_mask` `[N, R]`: supervised response
    positions. `num_blocks[n]`: blocks of row `n`'s own response (its noise depends only on that and its seed).
    `tail` `[N, R]`: untrained response tokens after the last trained one (a chat answer's newline after
    `<|im_end|>`), shown as `[MASK]` in every noised copy: decoding never sees past the answer's end.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    prompt_len: int
    num_blocks: list[int]
    seeds: list[int | None] = field(default_factory=list)
    num_tokens: int = 0  # real tokens (prompt + response, no padding)
    tail: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_len(self) -> int:
        return self.loss_mask.shape[1]

    @property
    def response(self) -> torch.Tensor:
        return self.input_ids[:, self.prompt_len:]

    @property
    def padded(self) -> bool:
        return not bool(self.attention_mask.all())

    def to(self, device: torch.device | str) -> "Batch":
        return Batch(self.input_ids.to(device), self.attention_mask.to(device), self.loss_mask.to(device),
                     self.prompt_len, list(self.num_blocks), list(self.seeds), self.num_tokens,
                     None if self.tail is None else self.tail.to(device))


def _as_document(doc: Any) -> tuple[torch.Tensor, torch.Tensor, int]:
    """`(input_ids, loss_mask, prompt tokens)`: the prompt is the first `max(prompt_len, 1)` tokens (a document with
    no prompt still needs one token of context to predict the first response token from), and a 1-token
    document has no response."""
    if isinstance(doc, dict):
        ids, mask, prompt_len = doc["input_ids"], doc.get("loss_mask"), doc.get("prompt_len", 0)
    else:
        ids, mask, prompt_len = doc
    ids = torch.as_tensor(ids, dtype=torch.long).flatten()
    mask = torch.ones_like(ids, dtype=torch.bool) if mask is None else torch.as_tensor(mask).flatten().bool()
    if mask.shape != ids.shape:
        raise ValueError(f"document has {ids.numel()} tokens but {mask.numel()} loss-mask entries")
    return ids, mask, min(max(int(prompt_len), 1), max(ids.numel() - 1, 1))


def document_shape(doc: Any) -> tuple[int, int]:
    """(prompt, response) tokens of a document as `collate` splits it, before `max_seq_len` truncation."""
    ids, _, prompt_len = _as_document(doc)
    return prompt_len, ids.numel() - prompt_len


def collate(documents: Sequence[Any], block_size: int, *, mask_token_id: int, eos_token_id: int | None = None,
            pad_target: str = "none", max_seq_len: int | None = None,
            seeds: Sequence[int | None] | None = None) -> Batch:
    """Lay out `(input_ids, loss_mask, prompt_len)` documents (e.g. `clover.training.data.Document`) as a Batch.

    * The prompt is split off as `_as_document` says; its loss mask is ignored.
    * `max_seq_len` bounds prompt + response before block padding (so a row may exceed it by up to
      `block_size - 1` pad positions): the response is truncated; a prompt that leaves no room for a block keeps
      only its last `max_seq_len - 1` tokens.
    * Each response is padded to a multiple of `block_size`: with `[MASK]`, never trained (`pad_target="none"`),
      or with EOS, trained (`"eos"`: the model learns to fill a finished block with EOS). Rows are then padded
      with `[MASK]` blocks (never trained, and invisible to earlier blocks) to the longest response.
    * `tail`: the response's untrained tokens after its last trained one (`_untrained_tail`), hidden from the
      noised copies.
    """
    if not documents:
        raise ValueError("collate needs at least one document")
    if pad_target == "eos" and eos_token_id is None:
        raise ValueError("pad_target='eos' needs an eos_token_id")
    prompts, responses, masks, tails, nbs = [], [], [], [], []
    real = 0
    for doc in documents:
        ids, mask, pl = _as_document(doc)
        if ids.numel() == 0:
            raise ValueError("empty document")
        prompt, response, rmask = ids[:pl], ids[pl:], mask[pl:]
        if max_seq_len is not None:
            if pl > max_seq_len - 1:
                prompt = prompt[-(max_seq_len - 1):]
            room = max(max_seq_len - prompt.numel(), 1)
            response, rmask = response[:room], rmask[:room]
        real += prompt.numel() + response.numel()
        tails.append(_untrained_tail(rmask))
        nb = math.ceil(response.numel() / block_size)
        pad = nb * block_size - response.numel()
        fill, train = (eos_token_id, True) if pad_target == "eos" else (mask_token_id, False)
        response = torch.cat([response, torch.full((pad,), fill, dtype=torch.long)])
        rmask = torch.cat([rmask, torch.full((pad,), train, dtype=torch.bool)])
        prompts.append(prompt)
        responses.append(response)
        masks.append(rmask)
        nbs.append(nb)
    p = max(x.numel() for x in prompts)
    r = max(max(nbs), 1) * block_size
    n = len(documents)
    input_ids = torch.full((n, p + r), mask_token_id, dtype=torch.long)
    attention = torch.zeros(n, p + r, dtype=torch.bool)
    loss_mask = torch.zeros(n, r, dtype=torch.bool)
    tail = torch.zeros(n, r, dtype=torch.bool)
    for i, (prompt, response, rmask, rtail) in enumerate(zip(prompts, responses, masks, tails)):
        input_ids[i, p - prompt.numel(): p] = prompt
        input_ids[i, p: p + response.numel()] = response
        attention[i, p - prompt.numel():] = True
        loss_mask[i, : rmask.numel()] = rmask
        tail[i, : rtail.numel()] = rtail
    seeds = list(seeds) if seeds is not None else [None] * n
    if len(seeds) != n:
        raise ValueError(f"{len(seeds)} seeds for {n} documents")
    return Batch(input_ids, attention, loss_mask, p, nbs, seeds, real, tail)


def _untrained_tail(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions after the last trained one (none if nothing is trained): a chat answer ends with a trained
    `<|im_end|>` and an untrained newline, which the noised copy must not show (decoding drafts the block after
    `<|im_end|>` from masks alone; a visible newline would be a hint of the end it never gets)."""
    trained = loss_mask.nonzero()
    tail = torch.zeros_like(loss_mask)
    if trained.numel():
        tail[int(trained[-1]) + 1:] = True
    return tail
