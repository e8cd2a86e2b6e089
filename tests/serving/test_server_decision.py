"""Structured outputs (`response_format` json_schema) served by decision decoding, with the official client."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from clover.engine.loops.decision import decide_batch
from clover.engine.constraints.form import parse_form
from clover.serving import ServerOptions, create_app
from server_helpers import server_thread
from model_helpers import tiny_model

NAME = "clover-decide"
FORM = {"type": "object", "properties": {
    "category": {"type": "string", "enum": ["billing", "bug", "outage"]},
    "urgency": {"type": "integer", "minimum": 1, "maximum": 4},
    "needs_human": {"type": "boolean"}},
    "required": ["category", "urgency", "needs_human"], "additionalProperties": False}
USER = [{"role": "user", "content": "The site is down and we lose money."}]


class Triage(BaseModel):  # what `client.chat.completions.parse` turns into a strict json_schema
    category: Literal["billing", "bug", "outage"]
    urgency: int = Field(ge=1, le=4)
    needs_human: bool


@pytest.fixture(scope="module")
def model(chat_tokenizer):
    return tiny_model("clover-tiny-dense", vocab_size=len(chat_tokenizer), mask_token_id=chat_tokenizer.mask_token_id,
                      eos_token_id=chat_tokenizer.eos_token_id)


@pytest.fixture(scope="module")
def url(model, chat_tokenizer):
    app = create_app(model, chat_tokenizer, ServerOptions(served_model_name=NAME, prefill_chunk=16))
    with server_thread(app) as u:
        yield u


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def _format(schema):
    return {"type": "json_schema", "json_schema": {"name": "triage", "schema": schema, "strict": True}}


def test_json_schema_round_trip(client):
    out = client.chat.completions.create(model=NAME, messages=USER, response_format=_format(FORM))
    values = json.loads(out.choices[0].message.content)
    parse_form(FORM).validate(values)
    assert out.choices[0].finish_reason == "stop"
    extra = out.model_extra["decision"]
    assert set(extra["probabilities"]) == set(FORM["properties"]) and 1 <= extra["forward_passes"] <= 3
    parsed = client.chat.completions.parse(model=NAME, messages=USER, response_format=Triage)
    assert isinstance(parsed.choices[0].message.parsed, Triage)
    assert parsed.choices[0].message.parsed.model_dump() == values  # same prompt and form: the same decision


def test_streamed_and_plain_requests(client):
    chunks = list(client.chat.completions.create(model=NAME, messages=USER, response_format=_format(FORM),
                                                 stream=True, stream_options={"include_usage": True}))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    parse_form(FORM).validate(json.loads(content))
    assert chunks[-1].usage.prompt_tokens > 0
    plain = client.chat.completions.create(model=NAME, messages=USER, max_tokens=8)  # no response_format: as before
    assert plain.choices[0].finish_reason in ("stop", "length")
    text = client.chat.completions.create(model=NAME, messages=USER, max_tokens=8, response_format={"type": "text"})
    assert text.choices[0].message.content == plain.choices[0].message.content


def test_decisions_run_in_the_scheduler_beside_generation(client, model, chat_tokenizer):
    """Decisions and generations sent at once share the scheduler's thread and iterations; each decision is the
    one decision mode makes alone (on the model, with the server's prefill chunk)."""
    contexts = [USER, [{"role": "user", "content": "Where is my invoice?"}], [{"role": "user", "content": "hi"}]]

    def decision(messages):
        out = client.chat.completions.create(model=NAME, messages=messages, response_format=_format(FORM))
        return json.loads(out.choices[0].message.content), out.model_extra["decision"]["forward_passes"]

    def generation(_):
        return client.chat.completions.create(model=NAME, messages=USER, max_tokens=24).choices[0].finish_reason

    with ThreadPoolExecutor(6) as pool:
        decisions = pool.map(decision, contexts)
        generations = pool.map(generation, range(3))
        decisions, generations = list(decisions), list(generations)
    assert all(reason in ("stop", "length") for reason in generations)
    for messages, got in zip(contexts, decisions):
        want = decide_batch(model, chat_tokenizer, [messages], FORM, prefill_chunk=16)[0]
        assert got == (want.values, want.forward_passes)


@pytest.mark.parametrize("schema, param, word", [
    ({**FORM, "properties": {"note": {"type": "string"}}}, "properties.note", "maxLength"),
    ({**FORM, "properties": {"tags": {"type": "array", "items": {"type": "string"}}}}, "properties.tags", "items"),
    ({**FORM, "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 10**6}}}, "properties.n", "maximum"),
    ({**FORM, "properties": {"c": {"enum": []}}}, "properties.c", "enum"),
])
def test_unsupported_schema_is_a_400_naming_the_field(url, schema, param, word):
    """Asked for decision mode (`structured_mode`), a schema outside the form subset is refused by name (without
    it, the schema takes the grammar path: test_server_grammar.py)."""
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": NAME, "messages": USER,
                                                        "response_format": _format({**schema, "required": []}),
                                                        "structured_mode": "decision"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == f"response_format.json_schema.schema.{param}"
    assert param in error["message"] and word in error["message"]


def test_other_bad_formats(url):
    for body, param in [({"response_format": {"type": "json_schema"}}, "response_format"),
                        ({"response_format": _format(FORM), "n": 2, "structured_mode": "decision"}, "n")]:
        r = httpx.post(f"{url}/v1/chat/completions", json={"model": NAME, "messages": USER, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
