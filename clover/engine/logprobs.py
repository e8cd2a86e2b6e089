"""Log-probabilities of tokens under the model's own distribution: what `logprobs` in the OpenAI API reports.

A value is `log softmax(logits)[token]` over the tokens the engine may emit (the mask token and the ids past the
tokenizer's vocabulary are excluded, as they are from every choice), computed from the raw logits: before the
repetition penalties, temperature, top-k / top-p and a grammar's mask, so the model's distribution whatever the
sampling (vLLM's default, `raw_logprobs`). Which logits a token's value comes from is the loop's:

* exact mode: the causal logits that verified the token, i.e. block size 1's (exact.py);
* a block rule: the prediction the step that unmasked the position read (block_loop.py), which saw the block as it
  stood at that step; with block size 1 it is the causal one;
* a prompt's tokens (`prompt_logprobs`, the completions API's `echo`): one causal forward over the prompt.

Nothing here runs for a request that asks for no logprobs (`RequestOptions.logprobs` None).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from clover.engine.runner import release_cache

MAX_TOP_LOGPROBS = 20  # the most alternatives a token's logprobs may list (OpenAI's and vLLM's limit)


@dataclass
class TokenLogprob:
    """One token's log-probability and the `n` most probable tokens at its position (best first)."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


def banned_ids(mask_id: int, vocab_limit: int, vocab_size: int) -> list[int]:
    """The ids never emitted: the mask token and the embedding rows past the tokenizer's vocabulary."""
    return [mask_id] + list(range(vocab_limit, vocab_size))


def log_probs(logits: torch.Tensor, banned: torch.Tensor) -> torch.Tensor:
    """`[..., V]` logits -> fp32 log-probabilities over the ids not in `banned` (those -inf). Never in place."""
    x = logits.float().index_fill(-1, banned, float("-inf"))
    return torch.log_softmax(x, dim=-1)


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int, banned: torch.Tensor) -> list[TokenLogprob]:
    """`logits` `[T, V]` (row `t` predicts `tokens[t]`; rows past `len(tokens)` unused) -> each token's value and
    its position's `top` most probable tokens."""
    n = len(tokens)
    if n == 0:
        return []
    lp = log_probs(logits[:n], banned)
    ids = torch.tensor(list(tokens), dtype=torch.long, device=lp.device)
    chosen = lp.gather(-1, ids[:, None])[:, 0].tolist()
    if top:
        values, best = lp.topk(top, dim=-1)
        alternatives = [list(zip(b, v)) for b, v in zip(best.tolist(), values.tolist())]
    else:
        alternatives = [[] for _ in range(n)]
    return [TokenLogprob(t, c, a) for t, c, a in zip(tokens, chosen, alternatives)]


class PromptScoring:
    """The causal log-probability of each prompt token after the ones before it (the first has none): one causal
    forward per prompt (in chunks of `chunk` tokens), on its own cache. It runs where the model runs: the server's
    scheduler steps it as it steps a decision run (`step` -> done, `results`), one prompt per step."""

    def __init__(self, runner: Any, prompts: list[list[int]], top: int, banned: Sequence[int],
                 chunk: int) -> None:
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
        self.runner, self.prompts, self.top, self.chunk = runner, prompts, top, chunk
        self.banned = torch.tensor(list(banned), dtype=torch.long, device=runner.device)
        self.scored: list[list[TokenLogprob | None]] = []

    def step(self) -> bool:
        """Score the next prompt; True when every prompt is scored."""
        prompt = self.prompts[len(self.scored)]
        cache = self.runner.new_cache(1)
        out: list[TokenLogprob | None] = [None]
        try:
            with torch.inference_mode():
                for start in range(0, len(prompt), self.chunk):
                    ids = prompt[start:start + self.chunk]
                    logits = self.runner.forward(torch.tensor([ids], dtype=torch.long, device=self.runner.device),
                                                 1, cache=cache, prefix_len=len(ids), prompt=True)
                    # position t predicts token t + 1; the prompt's last position predicts the answer's first
                    out += token_logprobs(logits[0], prompt[start + 1:start + 1 + len(ids)], self.top, self.banned)
        finally:
            release_cache(cache)
        self.scored.append(out)
        return len(self.scored) == len(self.prompts)

    def results(self) -> list[list[TokenLogprob | None]]:
        return self.scored
