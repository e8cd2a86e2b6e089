"""A failure belongs to its request: every per-request option is bounded where it is parsed (a 400 naming the
field, never a value that reaches a limit of the engine), every client mistake is a 400, and a 500 (our bug) names
the request id and nothing else. One in-process server of a random tiny model, keyed (two API keys)."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from clover.engine.engine import Engine
from clover.engine.request import REPETITION_FIELDS, RequestOptions
from clover.serving import ServerOptions, create_app
from clover.serving.api.protocol import MAX_SCHEMA_CHARS, ChatCompletionRequest
from model_helpers import tiny_model
from server_helpers import server_thread

NAME = "tiny"
KEY = "k1"
HEADERS = {"Authorization": f"Bearer {KEY}"}
USER = [{"role": "user", "content": "Hello there."}]


@pytest.fixture(scope="module")
def app(chat_tokenizer):
    model = tiny_model("clover-tiny-dense", vocab_size=len(chat_tokenizer), mask_token_id=chat_tokenizer.mask_token_id,
                       eos_token_id=chat_tokenizer.eos_token_id, max_position_embeddings=512)
    return create_app(model, chat_tokenizer, ServerOptions(served_model_name=NAME, api_key=(KEY, "k2"),
                                                           prefill_chunk=16))


@pytest.fixture(scope="module")
def server(app):
    with server_thread(app) as url:
        yield url


def _post(server: str, path: str, body: dict | bytes, **kwargs) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(f"{server}{path}", content=body, timeout=60,
                          headers={**HEADERS, "Content-Type": "application/json"}, **kwargs)
    return httpx.post(f"{server}{path}", json=body, headers=HEADERS, timeout=60, **kwargs)


BIG = 2**64  # past int64: what overflowed the sampler ("Overflow when unpacking long long") and failed a batch
FORM = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
        "required": ["answer"], "additionalProperties": False}
HUGE_SCHEMA = {"type": "object", "properties": {f"field_{i}": {"type": "string", "description": "x" * 64}
                                                for i in range(MAX_SCHEMA_CHARS // 80)}}


@pytest.mark.parametrize("fields, param", [
    ({"temperature": 1, "top_k": BIG}, "top_k"),
    ({"max_tokens": BIG}, "max_tokens"),
    ({"max_completion_tokens": BIG}, "max_completion_tokens"),
    ({"thinking_token_budget": BIG}, "thinking_token_budget"),
    ({"dry_multiplier": 1.0, "dry_penalty_last_n": BIG}, "dry_penalty_last_n"),
    ({"dry_multiplier": 1.0, "dry_sequence_breakers": ["x" * 300]}, "dry_sequence_breakers.0"),
    ({"stop": ["x" * 2000]}, "stop"),
    ({"stop": "x" * 2000}, "stop"),
    ({"n": 17}, "n"),
    ({"seed": BIG}, "seed"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logit_bias": {"42": 5.0}}, "logit_bias"),
    ({"logit_bias": {"42": 500.0}}, "logit_bias.42"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": HUGE_SCHEMA}}},
     "response_format.json_schema.schema"),
    *[({"chat_template_kwargs": {name: "x"}}, "chat_template_kwargs")
      for name in ("eos_token", "tools", "messages", "add_generation_prompt", "template")],
])
def test_an_option_beyond_its_bound_is_a_400_naming_the_field(server, fields, param):
    r = _post(server, "/v1/chat/completions", {"model": NAME, "messages": USER, "max_tokens": 4, **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param or error["param"].startswith(param + "."), error


@pytest.mark.parametrize("fields, param", [
    ({"chat_template_kwargs": {"eos_token": "x"}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"top_k": BIG}, "top_k"),
    ({"text": {"format": {"type": "json_schema", "name": "big", "schema": HUGE_SCHEMA}}}, "text.format.schema"),
])
def test_responses_options_beyond_their_bounds_are_400s(server, fields, param):
    r = _post(server, "/v1/responses", {"model": NAME, "input": "Hi", "max_output_tokens": 4, **fields})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_a_lone_surrogate_in_a_schema_is_refused_before_the_model_runs(server, app):
    """A decision-mode schema (a form) holding a lone surrogate: a 400 at parsing, on chat and Responses."""
    forwards = app.state.server.scheduler.engines[app.state.server.scheduler.default_key].counters.forwards
    schema = json.dumps({**FORM, "properties": {"answer": {"type": "string", "enum": ["yes", "SURROGATE"]}}})
    schema = schema.replace("SURROGATE", "\\ud800")
    chat = ('{"model": "%s", "messages": [{"role": "user", "content": "Yes?"}], "response_format": {"type": '
            '"json_schema", "json_schema": {"name": "a", "schema": %s}}}' % (NAME, schema)).encode()
    r = _post(server, "/v1/chat/completions", chat)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_unicode", r.text
    assert r.json()["error"]["param"].startswith("response_format.json_schema.schema")
    responses = ('{"model": "%s", "input": "Yes?", "text": {"format": {"type": "json_schema", "name": "a", '
                 '"schema": %s}}}' % (NAME, schema)).encode()
    r = _post(server, "/v1/responses", responses)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_unicode", r.text
    assert app.state.server.scheduler.engines[app.state.server.scheduler.default_key].counters.forwards == forwards


def test_a_bad_request_among_concurrent_ones_fails_alone(server):
    """Five concurrent short chats (prefilled as one group) and one with an out-of-range top_k: the bad one is a
    400, the others are answered."""

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server, headers=HEADERS, timeout=60) as client:
            bodies = [{"model": NAME, "messages": [{"role": "user", "content": f"Question {i}?"}], "max_tokens": 8,
                       "temperature": 1, "seed": i} for i in range(5)]
            bodies.insert(2, {**bodies[0], "top_k": BIG})
            return await asyncio.gather(*(client.post("/v1/chat/completions", json=b) for b in bodies))

    codes = [r.status_code for r in asyncio.run(run())]
    assert codes == [200, 200, 400, 200, 200, 200], codes


def test_a_generation_failure_is_a_500_naming_only_the_request_id(server, monkeypatch):
    """Our bug (here: the engine's step raising with a message of its own) is a 500 whose body names the request id
    and nothing of the exception, whole or streamed (in-band), on chat, completions and Responses."""
    step = Engine.step

    def broken(self, batch):
        raise RuntimeError("secret internals: /home/user/model.safetensors")

    monkeypatch.setattr(Engine, "step", broken)
    try:
        for path, body in (("/v1/chat/completions", {"messages": USER}), ("/v1/completions", {"prompt": "Hi"}),
                           ("/v1/responses", {"input": "Hi"})):
            r = _post(server, path, {"model": NAME, "max_tokens": 4, **body})
            assert r.status_code == 500, r.text
            rid = r.headers["x-request-id"]
            assert r.json()["error"] == {"message": f"internal server error (request id {rid})",
                                         "type": "server_error", "param": None, "code": "internal_error"}
            with httpx.stream("POST", f"{server}{path}", json={"model": NAME, "max_tokens": 4, "stream": True, **body},
                              headers=HEADERS, timeout=60) as s:
                text = s.read().decode()
                rid = s.headers["x-request-id"]
            assert "secret" not in text and f"internal server error (request id {rid})" in text, text
    finally:
        monkeypatch.setattr(Engine, "step", step)
    assert _post(server, "/v1/chat/completions", {"model": NAME, "messages": USER, "max_tokens": 4}).status_code == 200


def test_dry_breakers_are_resolved_off_the_scheduler_thread(server, monkeypatch):
    """Resolving breaker strings against the vocabulary takes a pass over it per breaker: it runs in a worker
    thread before the request is queued, so the scheduler (every stream's steps) never waits for it."""
    from clover.engine.constraints import repetition

    threads: list[str] = []
    resolve = repetition.breakers_from_texts

    def recorded(texts, breakers, device="cpu"):
        threads.append(threading.current_thread().name)
        return resolve(texts, breakers, device)

    monkeypatch.setattr(repetition, "breakers_from_texts", recorded)
    r = _post(server, "/v1/chat/completions", {"model": NAME, "messages": USER, "max_tokens": 8, "dry_multiplier": 1.0,
                                               "dry_sequence_breakers": ["\n", "unique-to-this-test"]})
    assert r.status_code == 200, r.text
    assert threads and "clover-scheduler" not in threads, threads


def test_the_request_log_is_owner_only_and_follows_no_link(tmp_path):
    """--record-requests holds users' prompts: an existing file is made owner-only (not left 0644), and a
    symlink at the path is refused (it could point anywhere the server may write)."""
    from clover.serving.request_log import RequestLog

    path = tmp_path / "requests.jsonl"
    path.write_text("")
    path.chmod(0o644)
    RequestLog(path)
    assert path.stat().st_mode & 0o777 == 0o600
    target, link = tmp_path / "elsewhere", tmp_path / "link.jsonl"
    target.write_text("")
    link.symlink_to(target)
    with pytest.raises(OSError):
        RequestLog(link)


# a schema llguidance compiles but cannot follow: 1000 open alternatives after the forced `[` exceed its parser's
# items at one position (2000; "ParserTooComplex"), at the answer's first token whatever the model writes
TOO_COMPLEX = {"anyOf": [{"type": "array", "minItems": i} for i in range(1000)]}


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 8, "structured_mode": "grammar", "response_format": {
        "type": "json_schema", "json_schema": {"name": "a", "schema": TOO_COMPLEX}}},
     "response_format.json_schema.schema"),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 8, "text": {"format": {"type": "json_schema", "name": "a",
                                                          "schema": TOO_COMPLEX}}}, "text.format.schema"),
])
def test_a_schema_too_complex_to_follow_is_a_400_naming_it(server, path, body, param):
    """The grammar engine gives up on the schema while decoding: the client's schema, a 400 naming its field in our
    words (whole, or in-band when streamed), not a 500."""
    r = _post(server, path, {"model": NAME, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == "unsupported_schema", error
    assert "too complex" in error["message"] and "<state>" not in error["message"], error
    with httpx.stream("POST", f"{server}{path}", json={"model": NAME, "stream": True, **body},
                      headers=HEADERS, timeout=60) as s:
        text = s.read().decode()
    assert "too complex" in text and param in text and "internal server error" not in text, text


def test_failures_past_the_queue_name_no_exception(server, app, monkeypatch):
    """A decision run or a prompt scoring whose step raises is our bug: a 500 naming the request id only (not a 503
    carrying the exception); a scheduler that died makes a 503 in our words, not its exception's."""
    from clover.engine.loops.decision import DecisionRun
    from clover.engine.logprobs import PromptScoring

    def broken(self):
        raise RuntimeError("secret internals: /home/user/model.safetensors")

    monkeypatch.setattr(DecisionRun, "step", broken)
    monkeypatch.setattr(PromptScoring, "step", broken)
    decision = {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"name": "a",
                                                                                          "schema": FORM}}}
    for path, body in (("/v1/chat/completions", decision),
                       ("/v1/completions", {"prompt": "Hi", "echo": True, "logprobs": 1})):
        r = _post(server, path, {"model": NAME, "max_tokens": 4, **body})
        assert r.status_code == 500 and "secret" not in r.text, r.text
        assert r.json()["error"]["message"] == f"internal server error (request id {r.headers['x-request-id']})"
    scheduler = app.state.server.scheduler
    monkeypatch.setattr(scheduler, "error", RuntimeError("secret internals: /home/user/model.safetensors"))
    for path, body in (("/v1/chat/completions", {"messages": USER}), ("/v1/chat/completions", decision),
                       ("/v1/completions", {"prompt": "Hi", "block_size": 2})):
        r = _post(server, path, {"model": NAME, "max_tokens": 4, **body})
        assert r.status_code == 503 and "secret" not in r.text, r.text
        assert r.json()["error"]["code"] == "unavailable"


def test_every_repetition_option_is_a_request_field_passed_on_by_name() -> None:
    assert len(REPETITION_FIELDS) == 8 and set(REPETITION_FIELDS) <= set(ChatCompletionRequest.model_fields)
    values = {"dry_multiplier": 0.5, "dry_base": 2.0, "dry_allowed_length": 3, "dry_penalty_last_n": 64,
              "dry_sequence_breakers": ["\n"], "dry_include_prompt": False, "loop_guard_span": 8, "loop_guard_repeats": 3}
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], **values)
    options = RequestOptions.of(**req.repetition())
    params = {**vars(options.sampling), **vars(options)}
    assert {name: params[name] for name in REPETITION_FIELDS} == values | {"dry_sequence_breakers": ("\n",)}
