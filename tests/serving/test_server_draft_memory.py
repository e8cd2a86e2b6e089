"""Whose answers draft whose (clover.serving.draft_memories): with API keys, a client's repeated request drafts
from its own earlier answer and is decoded in fewer forwards, while another key's first request is not (its
memory is its own); `shared` pools them, `off` keeps none; the text is the same in every case."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from clover.engine.loops import exact
from clover.engine.drafts.cost import ForwardCost
from clover.serving import ServerOptions, create_app
from model_helpers import tiny_model
from server_helpers import server_thread

NAME = "clover-memory"
KEYS = ("alice-key", "bob-key")
PROMPT = [{"role": "user", "content": "Write the list of files in the folder, then read the first one."}]


@pytest.fixture(scope="module")
def model(chat_tokenizer):
    return tiny_model("clover-tiny-dense", vocab_size=len(chat_tokenizer), mask_token_id=chat_tokenizer.mask_token_id,
                      eos_token_id=chat_tokenizer.eos_token_id)


def _serve(model, tokenizer, mode: str, log: Path):
    with pytest.MonkeyPatch.context() as patch:  # free rows, never re-timed: exact mode verifies every draft it has
        patch.setattr(exact, "cost_table", lambda runner, recalibrate=False: ForwardCost.flat())
        patch.setattr(exact.ExactLoop, "_timed", lambda self, *args: None)
        app = create_app(model, tokenizer, ServerOptions(served_model_name=NAME, api_key=KEYS, draft_memory=mode,
                                                         prefill_chunk=16, record_requests=str(log)))
        with server_thread(app) as url:
            yield url, app.state.server


@pytest.fixture(params=["per-key", "shared", "off"])
def served(request, model, chat_tokenizer, tmp_path):
    yield from _serve(model, chat_tokenizer, request.param, tmp_path / "requests.jsonl")


def _ask(url: str, server, key: str) -> tuple[str, float, int]:
    """The answer to PROMPT (greedy, exact mode, the EOS ignored so every answer is 40 tokens), the forwards that
    decoded it (the server's counter before and after) and the drafts from a memory it accepted."""
    before, accepted = _forwards(url, key), _memory_accepted(server)
    r = httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                   json={"model": NAME, "messages": PROMPT, "max_tokens": 40, "temperature": 0, "rule": "exact",
                         "block_size": 4, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return (r.json()["choices"][0]["message"]["content"], _forwards(url, key) - before,
            _memory_accepted(server) - accepted)


def _memory_accepted(server) -> int:
    return sum(e.loop.memory_tally[1] for e in server.scheduler.engines.values() if e.loop.name == "exact")


def _forwards(url: str, key: str) -> float:
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {key}"}).text
    return float(re.search(r"^clover_request_forward_passes_total (\S+)$", text, re.M).group(1))


def test_whose_answers_draft_whose(served):
    url, server = served
    mode = server.options.draft_memory
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer carol-key"}).status_code == 401
    alice_first, alice_first_forwards, alice_first_drafts = _ask(url, server, KEYS[0])
    alice_again, alice_again_forwards, alice_again_drafts = _ask(url, server, KEYS[0])
    bob_first, bob_first_forwards, bob_first_drafts = _ask(url, server, KEYS[1])
    assert alice_first == alice_again == bob_first  # drafts never change an answer
    assert alice_first_drafts == 0  # every memory is empty at first
    # --record-requests: each answer's token ids, and the drafts it took from a memory
    log = [json.loads(line) for line in Path(server.options.record_requests).read_text().splitlines()]
    assert len(log) == 3 and log[0]["answer"] == log[1]["answer"] == log[2]["answer"] and len(log[0]["answer"]) == 40
    assert log[1]["stats"].get("drafts", {}).get("memory", {}).get("accepted", 0) == alice_again_drafts
    if mode == "off":
        assert alice_again_drafts == bob_first_drafts == 0 and server.memories.tokens() == 0
        return
    # her own answer drafted the repeat (the tiny model's text also repeats itself, so the context drafts part of
    # it): fewer forwards
    assert alice_again_drafts >= 10 and alice_again_forwards < alice_first_forwards
    if mode == "per-key":  # bob's memory held nothing of hers
        assert bob_first_drafts == 0
    else:
        assert bob_first_drafts >= 10 and bob_first_forwards < alice_first_forwards
    assert server.memories.tokens() == 3 * 40
    # /metrics shows a key the memory it drafts from: per key, hers (two answers); shared, everyone's
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEYS[0]}"}).text
    assert re.search(rf"^clover_draft_memory_tokens {80 if mode == 'per-key' else 120}\.0$", text, re.M)


def test_draft_memory_options_are_checked():
    with pytest.raises(ValueError, match="draft_memory must be one of"):
        ServerOptions(draft_memory="everyone")
    with pytest.raises(ValueError, match="empty"):
        ServerOptions(api_key=("alice", ""))
