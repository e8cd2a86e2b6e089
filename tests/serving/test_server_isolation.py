"""No client can reach another through the server's shared state: with API keys, the prefix cache, the stored
responses and the per-request figures of /metrics and /health are each key's own (docs/serving.md "Security").
One in-process server of a random tiny model with two keys."""

from __future__ import annotations

import re

import httpx
import pytest

from clover.serving import ServerOptions, create_app
from model_helpers import tiny_model
from server_helpers import server_thread

NAME = "tiny"
KEYS = ("k1", "k2")
SECRET = [{"role": "user", "content": "My account number is 4921 7730 1185 2206 and my PIN is 8812; the vault code "
                                      "is 55 19 73 and the password is swordfish-marmalade-42. Remember all of it."}]


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def app(chat_tokenizer):
    model = tiny_model("clover-tiny-dense", vocab_size=len(chat_tokenizer), mask_token_id=chat_tokenizer.mask_token_id,
                       eos_token_id=chat_tokenizer.eos_token_id, max_position_embeddings=512)
    return create_app(model, chat_tokenizer, ServerOptions(served_model_name=NAME, api_key=KEYS, prefill_chunk=16))


@pytest.fixture(scope="module")
def server(app):
    with server_thread(app) as url:
        yield url


def _chat(server: str, key: str, messages: list[dict], **fields) -> dict:
    r = httpx.post(f"{server}/v1/chat/completions", headers=_auth(key), timeout=60,
                   json={"model": NAME, "messages": messages, "max_tokens": 4, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def _cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def _figure(server: str, key: str, name: str) -> float:
    text = httpx.get(f"{server}/metrics", headers=_auth(key), timeout=30).text
    match = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def test_a_key_never_reuses_another_keys_prompt(server):
    """k2 sending k1's prompt gets no cached tokens (a hit would confirm k1's prompt one chunk at a time); k1's
    own repeat does, and k2's own repeat reuses k2's."""
    first = _chat(server, "k1", SECRET)
    assert _cached(first) == 0 and first["usage"]["prompt_tokens"] > 48
    assert _cached(_chat(server, "k2", SECRET)) == 0
    assert _cached(_chat(server, "k1", SECRET)) >= 48
    assert _cached(_chat(server, "k2", SECRET)) >= 48  # the cache works within a key


def test_metrics_show_each_key_only_its_own_figures(server):
    """The per-request figures (prompt and cached tokens, the drafting memory) are each key's own; /health shows
    the load only to a client with a key."""
    before = {key: (_figure(server, key, "clover_prompt_tokens_total"),
                    _figure(server, key, "clover_cached_prompt_tokens_total")) for key in KEYS}
    prompt = [{"role": "user", "content": "A question only k1 asks, long enough to fill three chunks of the cache "
                                          "grid, about the weather in a city that k2 never names at all."}]
    body = _chat(server, "k1", prompt)
    _chat(server, "k1", prompt)
    k1 = (_figure(server, "k1", "clover_prompt_tokens_total"), _figure(server, "k1", "clover_cached_prompt_tokens_total"))
    assert k1[0] - before["k1"][0] == 2 * body["usage"]["prompt_tokens"] and k1[1] > before["k1"][1]
    k2 = (_figure(server, "k2", "clover_prompt_tokens_total"), _figure(server, "k2", "clover_cached_prompt_tokens_total"))
    assert k2 == before["k2"]  # nothing of k1's requests shows to k2
    assert _figure(server, "k1", "clover_prefix_cache_entries") >= 1
    health = httpx.get(f"{server}/health", timeout=30).json()
    assert health == {"status": "ok"}  # no key: no load figures
    assert set(httpx.get(f"{server}/health", headers=_auth("k2"), timeout=30).json()) >= {"status", "running"}


def test_a_stored_response_belongs_to_its_key(server):
    """k2 cannot read, continue or delete k1's stored response: for k2 it does not exist."""
    r = httpx.post(f"{server}/v1/responses", headers=_auth("k1"), timeout=60,
                   json={"model": NAME, "input": "Keep this.", "max_output_tokens": 4})
    assert r.status_code == 200, r.text
    rid = r.json()["id"]
    assert httpx.get(f"{server}/v1/responses/{rid}", headers=_auth("k2"), timeout=30).status_code == 404
    follow = httpx.post(f"{server}/v1/responses", headers=_auth("k2"), timeout=60,
                        json={"model": NAME, "input": "And?", "max_output_tokens": 4, "previous_response_id": rid})
    assert follow.status_code == 400 and follow.json()["error"]["param"] == "previous_response_id", follow.text
    assert httpx.delete(f"{server}/v1/responses/{rid}", headers=_auth("k2"), timeout=30).status_code == 404
    assert httpx.get(f"{server}/v1/responses/{rid}", headers=_auth("k1"), timeout=30).json()["id"] == rid
    follow = httpx.post(f"{server}/v1/responses", headers=_auth("k1"), timeout=60,
                        json={"model": NAME, "input": "And?", "max_output_tokens": 4, "previous_response_id": rid})
    assert follow.status_code == 200, follow.text
    assert httpx.delete(f"{server}/v1/responses/{rid}", headers=_auth("k1"), timeout=30).status_code == 200
