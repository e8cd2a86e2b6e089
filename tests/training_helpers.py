"""Shared test data for the training tests: tiny random prompt/response documents."""

from __future__ import annotations

import torch


def documents(n: int = 32, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """`n` documents (input_ids, loss_mask, prompt_len): a 2–5 token prompt, a 3–9 token supervised response."""
    g = torch.Generator().manual_seed(seed)
    docs = []
    for _ in range(n):
        prompt_len = int(torch.randint(2, 6, (1,), generator=g))
        response_len = int(torch.randint(3, 10, (1,), generator=g))
        ids = torch.randint(0, 250, (prompt_len + response_len,), generator=g)
        mask = torch.zeros(prompt_len + response_len, dtype=torch.bool)
        mask[prompt_len:] = True
        docs.append((ids, mask, prompt_len))
    return docs
