"""How many drafts exact decoding would accept, measured teacher-forced in one forward per batch.

Exact decoding drafts the `B - 1` tokens after the next one from a fully masked block and verifies them against
the causal (greedy) path: a forward commits the drafts that match up to the first miss, plus one causal token.
On documents whose responses are the base's own greedy answers, the same numbers come from the training layout
with every response block fully masked: block `j`'s drafts at positions `1 .. B-1` against the true tokens,

    run_j = max{k : drafts 1..k of block j all equal the answer},   accept_k = P(run >= k),
    tokens per forward  ~=  1 + E[run]   (at a block size B, drafting the whole block every forward).

Exact decoding draws its drafts in the same forward that verifies the previous ones, from a query block after
all of them, so the drafts are usable only where every draft was accepted; after a miss the next forward has
none and commits one token. With `a = accept_{B-1}` (a whole block accepted), a forward with drafts is followed
by one with drafts with probability `a`, and one without always is, so a share `1 / (2 - a)` of forwards have
drafts and

    tokens per forward (exact decoding, whole block)  ~=  (2 + E[run] - a) / (2 - a).

Blocks are aligned to the response start where decoding starts one wherever the last forward stopped; over many
blocks the two sample the same positions. Only positions the loss trains count (a block that runs past the
answer's end counts its drafts up to the end).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from clover.training.batches import collate
from clover.training.objective import Noise, masked_logits


@torch.no_grad()
def draft_acceptance(model: torch.nn.Module, documents: Sequence[Any], block_size: int, *, eos_token_id: int | None,
                     pad_target: str = "eos", max_seq_len: int | None = None,
                     batch_size: int = 8) -> dict[str, Any]:
    """`{"blocks", "accept": [accept_1 .. accept_{B-1}], "tokens_per_forward", "exact_tokens_per_forward",
    "draft_accuracy"}` over `documents` (`collate`'s input): tokens per forward if every forward verified a whole
    block of drafts, and as exact decoding pipelines them (module docstring); `draft_accuracy`: the fraction of
    single drafts that are right."""
    if block_size < 2:
        raise ValueError("draft acceptance needs block_size >= 2 (block size 1 has no drafts)")
    mask_id = model.config.mask_token_id
    runs: list[torch.Tensor] = []
    right = total = 0
    was_training = model.training
    model.eval()
    try:
        for i in range(0, len(documents), batch_size):
            batch = collate(documents[i: i + batch_size], block_size, mask_token_id=mask_id,
                            eos_token_id=eos_token_id, pad_target=pad_target, max_seq_len=max_seq_len)
            blocks = batch.response_len // block_size
            noise = Noise(batch.loss_mask.clone(), torch.ones(batch.rows, blocks), copies=1)
            m = masked_logits(model, batch, block_size, noise, mask_id)
            hit = torch.zeros(batch.rows, batch.response_len, dtype=torch.bool)
            hit[m.rows, m.pos] = m.logits.argmax(-1).cpu() == m.targets.cpu()
            trained = batch.loss_mask.view(batch.rows, blocks, block_size)[..., 1:]
            drafts = hit.view(batch.rows, blocks, block_size)[..., 1:] & trained
            right += int(drafts.sum())
            total += int(trained.sum())
            # leading run of right drafts, only over blocks with at least one trained draft
            run = drafts.int().cumprod(-1).sum(-1)
            runs.append(run[trained.any(-1)].flatten())
    finally:
        model.train(was_training)
    run = torch.cat(runs) if runs else torch.zeros(0, dtype=torch.long)
    n = max(run.numel(), 1)
    accept = [float((run >= k).sum()) / n for k in range(1, block_size)]
    mean_run, whole = float(run.sum()) / n, accept[-1]
    return {"blocks": int(run.numel()), "accept": accept, "tokens_per_forward": 1.0 + mean_run,
            "exact_tokens_per_forward": (2.0 + mean_run - whole) / (2.0 - whole), "draft_accuracy": right / max(total, 1)}
