"""`clover serve` as a real process on localhost, driven by the official `openai` client and raw HTTP.

One random tiny model (dense, peaked logits: several tokens per step) behind two server processes: the main one
(API key, small context so bad `max_tokens` are easy to make) and a one-slot one (backpressure, disconnects).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import openai
import pytest

from clover.chat_template import render_chat
from clover.engine import generate
from clover.model import CloverForBlockDiffusion
from clover.serving import create_app
from server_helpers import build_checkpoint, server_process, server_thread

KEY = "test-key-123"
CONTEXT = 256
NAME = "clover-test"
ALIAS = "clover-test-0123abcd"  # a second model id (as the default model's versioned id)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, chat_tokenizer):
    return build_checkpoint(tmp_path_factory.mktemp("server") / "tiny", chat_tokenizer,
                            max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module")
def server(checkpoint):
    with server_process(checkpoint, "--api-key", KEY, "--prefill-chunk", "16", "--max-body-mb", "0.25",
                        name=(NAME, ALIAS)) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(checkpoint, chat_tokenizer):
    """What the model gives a chat alone, decoded offline with the engine (greedy): the server must match it."""
    model = CloverForBlockDiffusion.from_pretrained(checkpoint)
    eos = [chat_tokenizer.eos_token_id]

    def answer(messages, max_tokens, **decoding):
        prompt = render_chat(chat_tokenizer, messages, add_generation_prompt=True)
        ids = chat_tokenizer(prompt, add_special_tokens=False)["input_ids"]
        out = generate(model, [ids], max_tokens, eos_token_ids=eos, vocab_limit=len(chat_tokenizer), **decoding)
        return chat_tokenizer.decode(out.sequences[0], skip_special_tokens=True), len(ids), out.stats[0]
    return answer


def _user(text):
    return [{"role": "user", "content": text}]


def _strip(text):
    return text.strip()


# -- the happy paths ------------------------------------------------------------------------------------------
def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == [NAME, ALIAS]
    assert client.models.retrieve(NAME).id == NAME
    assert httpx.get(f"{server}/health").json()["status"] == "ok"  # no key needed


def test_chat_matches_the_engine_alone_with_usage(client, reference):
    msgs = _user("Hello world. What is the weather?")
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=24)
    text, prompt_len, stats = reference(msgs, 24)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == text.strip()
    assert choice.finish_reason == ("length" if stats["finish_reason"] == "length" else "stop")
    assert r.usage.prompt_tokens == prompt_len and r.usage.completion_tokens == stats["tokens"]
    assert r.usage.total_tokens == prompt_len + stats["tokens"]
    assert r.object == "chat.completion" and r.model == NAME and r.id.startswith("chatcmpl-")


def test_decoding_options_per_request(client, reference):
    msgs = _user("List three colours.")
    for decoding in ({"rule": "left_to_right"}, {"rule": "product_threshold", "threshold": 0.3, "block_size": 2}):
        r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=16, extra_body=decoding)
        assert r.choices[0].message.content == reference(msgs, 16, **decoding)[0].strip()
    # exact mode: the model's block-size-1 greedy output
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=16, extra_body={"rule": "exact"})
    assert r.choices[0].message.content == reference(msgs, 16, block_size=1)[0].strip()


def test_dry_and_the_loop_guard_as_extra_body_fields(client, reference, server):
    """llama.cpp's DRY fields and the loop guard's reach the engine; an answer the guard ended is OpenAI's "stop"
    with `stop_reason: "repetition"`, streamed or not."""
    msgs = _user("Count: one two three.")
    dry = {"dry_multiplier": 3.0, "dry_base": 2.0, "dry_allowed_length": 1, "dry_sequence_breakers": []}
    text = reference(msgs, 40, **dry)[0]
    assert text != reference(msgs, 40)[0]  # DRY changes the answer
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=40, extra_body=dry)
    assert r.choices[0].message.content == text.strip()
    fields = {"loop_guard_span": 2, "loop_guard_repeats": 1}
    text, _, stats = reference(msgs, 40, **fields)
    assert stats["finish_reason"] == "repetition"  # the tiny model repeats a pair of tokens within 40
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=40, extra_body=fields)
    assert r.choices[0].message.content == text.strip()
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] == "repetition"
    chunks = list(client.chat.completions.create(model=NAME, messages=msgs, max_tokens=40, extra_body=fields,
                                                 stream=True))
    last = [c for c in chunks if c.choices and c.choices[0].finish_reason][-1].choices[0]
    assert last.finish_reason == "stop" and last.model_extra["stop_reason"] == "repetition"
    plain = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=40)
    assert "stop_reason" not in plain.choices[0].model_extra  # OpenAI's semantics unless asked
    bad = httpx.post(f"{server}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                     json={"model": NAME, "messages": msgs, "dry_base": 0.5})
    assert bad.status_code == 400 and "dry_base" in bad.text


def test_chat_streaming_equals_non_streaming(client):
    msgs = _user("def add(x, y):")
    whole = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=20)
    chunks = list(client.chat.completions.create(model=NAME, messages=msgs, max_tokens=20, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 1  # streamed as blocks commit


def test_completion_and_streamed_completion(client, checkpoint, chat_tokenizer):
    r = client.completions.create(model=NAME, prompt="The weather is", max_tokens=12)
    assert r.object == "text_completion" and r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=NAME, prompt="The weather is", max_tokens=12, stream=True) if c.choices)
    assert streamed == r.choices[0].text
    ids = chat_tokenizer("The weather is", add_special_tokens=False)["input_ids"]
    by_ids = client.completions.create(model=NAME, prompt=ids, max_tokens=12, echo=True)
    assert by_ids.choices[0].text == "The weather is" + r.choices[0].text


def test_n_choices_stop_and_seed(client):
    r = client.chat.completions.create(model=NAME, messages=_user("Hello"), max_tokens=16, n=3,
                                       temperature=0.9, seed=7)
    assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.completion_tokens > 0
    again = client.chat.completions.create(model=NAME, messages=_user("Hello"), max_tokens=16, n=3,
                                           temperature=0.9, seed=7)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    full = client.completions.create(model=NAME, prompt="Hello world", max_tokens=16).choices[0].text
    stop = full[5:7]
    if stop.strip():
        cut = client.completions.create(model=NAME, prompt="Hello world", max_tokens=16, stop=[stop])
        assert cut.choices[0].text == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_sixteen_concurrent_streaming_clients_get_complete_correct_answers(server, reference):
    prompts = [_user(f"Client {i}: def f{i}(x): return x + {i}") for i in range(16)]
    expected = [reference(m, 20) for m in prompts]

    async def one(client, msgs):
        text, usage, finish = "", None, None
        stream = await client.chat.completions.create(model=NAME, messages=msgs, max_tokens=20, stream=True,
                                                      stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            for c in chunk.choices:
                text += c.delta.content or ""
                finish = c.finish_reason or finish
        return text, usage, finish

    async def run():
        client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=120)
        return await asyncio.gather(*(one(client, m) for m in prompts))

    wide_before = _wide_steps(server)
    results = asyncio.run(run())
    assert _wide_steps(server) > wide_before  # they really were decoded together, not one after another
    for (text, usage, finish), (want, prompt_len, stats) in zip(results, expected):
        assert text == want.strip()
        assert usage.completion_tokens == stats["tokens"] and usage.prompt_tokens == prompt_len
        assert finish in ("stop", "length")
    metrics = httpx.get(f"{server}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    assert "clover_tokens_per_forward_bucket" in metrics and "clover_queue_depth" in metrics


def _wide_steps(url, rows=4):
    """Denoising steps so far whose batch had more than `rows` sequences (from /metrics)."""
    metrics = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    total = narrow = 0.0
    for line in metrics.splitlines():
        if line.startswith("clover_batch_size_count"):
            total = float(line.split()[1])
        elif line.startswith(f'clover_batch_size_bucket{{le="{float(rows)}"}}'):
            narrow = float(line.split()[1])
    return total - narrow


def test_prefix_reuse_reports_cached_tokens_and_keeps_the_answer(client):
    msgs = [{"role": "system", "content": "You are a helpful assistant. " * 6}] + _user("Hello world.")
    first = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=8)
    second = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=8)
    assert second.usage.prompt_tokens_details.cached_tokens >= 16
    assert second.choices[0].message.content == first.choices[0].message.content


# -- bad input: OpenAI error JSON, 4xx, and the server keeps serving ---------------------------------------------
def _raw(fields: bytes) -> bytes:
    """A chat body with `fields` spliced in as raw JSON text (for what `json.dumps` cannot write)."""
    return b'{"model": "clover-test", "messages": [{"role": "user", "content": "hi"}], ' + fields + b"}"


def _tool(function: dict) -> list[dict]:
    return [{"type": "function", "function": function}]


def _nested(depth: int) -> dict:
    value: dict = {"type": "string"}
    for _ in range(depth):
        value = {"type": "object", "properties": {"a": value}}
    return value


ARGS_DEEP = json.dumps(_nested(100))  # call arguments as OpenAI sends them: a JSON string
# (name, request, status, code): every error has a code
BAD = [
    ("malformed json", dict(raw=b'{"model": "clover-test", "messages": ['), 400, "invalid_json"),
    ("wrong type", dict(body={"model": NAME, "messages": _user("hi"), "max_tokens": "ten"}), 400, "invalid_type"),
    ("messages not a list", dict(body={"model": NAME, "messages": "hi"}), 400, "invalid_type"),
    ("missing messages", dict(body={"model": NAME}), 400, "missing_required_parameter"),
    ("body not an object", dict(raw=b"[1, 2]"), 400, "invalid_type"),
    ("unknown model", dict(body={"model": "gpt-4", "messages": _user("hi")}), 404, "model_not_found"),
    ("empty messages", dict(body={"model": NAME, "messages": []}), 400, "invalid_value"),
    ("negative max_tokens", dict(body={"model": NAME, "messages": _user("hi"), "max_tokens": -1}), 400,
     "invalid_value"),
    ("huge max_tokens", dict(body={"model": NAME, "messages": _user("hi"), "max_tokens": 10**12}), 400,
     "context_length_exceeded"),
    ("prompt beyond context", dict(body={"model": NAME, "messages": _user("weather " * 400), "max_tokens": 4}), 400,
     "context_length_exceeded"),
    ("invalid tool schema", dict(body={"model": NAME, "messages": _user("hi"), "tools": _tool(
        {"name": "bad name!", "parameters": {"type": "string"}})}), 400, "invalid_value"),
    ("tool parameters not an object", dict(body={"model": NAME, "messages": _user("hi"), "tools": _tool(
        {"name": "f", "parameters": {"type": "array"}})}), 400, "invalid_value"),
    ("tool required not a list", dict(body={"model": NAME, "messages": _user("hi"), "tools": _tool(
        {"name": "f", "parameters": {"type": "object", "required": "a"}})}), 400, "invalid_value"),
    ("tool without a function", dict(body={"model": NAME, "messages": _user("hi"), "tools": [{"type": "function"}]}),
     400, "missing_required_parameter"),
    ("tools not a list", dict(body={"model": NAME, "messages": _user("hi"), "tools": {"name": "f"}}), 400,
     "invalid_type"),
    ("tool_choice unknown function", dict(body={"model": NAME, "messages": _user("hi"), "tools": _tool({"name": "f"}),
                                                "tool_choice": {"type": "function", "function": {"name": "g"}}}),
     400, "invalid_value"),
    ("unknown role", dict(body={"model": NAME, "messages": [{"role": "wizard", "content": "hi"}]}), 400,
     "invalid_value"),
    ("image content", dict(body={"model": NAME, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}), 400, "invalid_type"),
    ("image part after text", dict(body={"model": NAME, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]}]}),
     400, "invalid_type"),
    ("temperature out of range", dict(body={"model": NAME, "messages": _user("hi"), "temperature": -0.5}), 400,
     "invalid_value"),
    ("n zero", dict(body={"model": NAME, "messages": _user("hi"), "n": 0}), 400, "invalid_value"),
    ("bad block_size", dict(body={"model": NAME, "messages": _user("hi"), "block_size": 0}), 400, "invalid_value"),
    ("threshold 0", dict(body={"model": NAME, "messages": _user("hi"), "threshold": 0}), 400, "invalid_value"),
    ("threshold above 1", dict(path="/v1/completions", body={"model": NAME, "prompt": "hi", "threshold": 1.01}), 400,
     "invalid_value"),
    ("unknown rule", dict(body={"model": NAME, "messages": _user("hi"), "rule": "fastest"}), 400, "invalid_value"),
    ("DRY base below 1", dict(body={"model": NAME, "messages": _user("hi"), "dry_multiplier": 0.8,
                                    "dry_base": 0.5}), 400, "invalid_value"),
    ("top_logprobs above 20", dict(body={"model": NAME, "messages": _user("hi"), "logprobs": True,
                                         "top_logprobs": 21}), 400, "invalid_value"),
    ("wrong api key", dict(body={"model": NAME, "messages": _user("hi")}, key="nope"), 401, "invalid_api_key"),
    ("no api key", dict(body={"model": NAME, "messages": _user("hi")}, key=None), 401, "invalid_api_key"),
    ("body too large", dict(body={"model": NAME, "messages": _user("x" * 400_000)}), 413, "request_too_large"),
    ("10 MB body", dict(body={"model": NAME, "messages": _user("x" * 10 * 2**20)}), 413, "request_too_large"),
    # text that is not Unicode: JSON escapes of lone UTF-16 surrogates, and bytes that are not UTF-8
    ("lone surrogate in chat content", dict(raw=_raw(b'"max_tokens": 4').replace(b'"hi"', b'"\\ud800"')), 400,
     "invalid_unicode"),
    ("lone surrogate in a text part", dict(raw=_raw(b'"max_tokens": 4').replace(
        b'"hi"', b'[{"type": "text", "text": "ok \\udfff"}]')), 400, "invalid_unicode"),
    ("lone surrogate in a tool description", dict(raw=_raw(
        b'"tools": [{"type": "function", "function": {"name": "f", "description": "\\ud83d"}}]')), 400,
     "invalid_unicode"),
    ("lone surrogate in a tool schema key", dict(raw=_raw(
        b'"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", '
        b'"properties": {"\\udc00": {"type": "string"}}}}}]')), 400, "invalid_unicode"),
    ("lone surrogate in stop", dict(raw=_raw(b'"stop": ["\\ud800"]')), 400, "invalid_unicode"),
    ("lone surrogate in a prompt", dict(path="/v1/completions", raw=b'{"model": "clover-test", "prompt": "a\\ud800"}'),
     400, "invalid_unicode"),
    ("lone surrogate in a Responses tool's type", dict(path="/v1/responses", raw=b'{"model": "clover-test", '
        b'"input": "hi", "tools": [{"type": "functi\\udbffon", "name": "f"}]}'), 400, "invalid_unicode"),
    ("invalid utf-8", dict(raw=_raw(b'"user": "\xff\xfe"')), 400, "invalid_json"),
    # numbers JSON does not have, or Python will not parse
    ("NaN temperature", dict(raw=_raw(b'"temperature": NaN')), 400, "invalid_value"),
    ("infinite top_p", dict(raw=_raw(b'"top_p": Infinity')), 400, "invalid_value"),
    ("negative infinite penalty", dict(raw=_raw(b'"presence_penalty": -Infinity')), 400, "invalid_value"),
    ("integer of 5000 digits", dict(raw=_raw(b'"max_tokens": ' + b"9" * 5000)), 400, "invalid_json"),
    ("seed beyond 64 bits", dict(body={"model": NAME, "messages": _user("hi"), "seed": 2**70}), 400,
     "invalid_value"),
    # nesting: beyond the parser's recursion limit, and parseable but too deep to render
    ("100000 nested arrays", dict(raw=_raw(b'"metadata": ' + b"[" * 100_000 + b"]" * 100_000)), 400,
     "invalid_json"),
    ("deeply nested tool schema", dict(body={"model": NAME, "messages": _user("hi"), "tools": _tool(
        {"name": "f", "parameters": _nested(100)})}), 400, "nesting_too_deep"),
    ("deeply nested call arguments", dict(body={"model": NAME, "messages": [
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                              "function": {"name": "f", "arguments": ARGS_DEEP}}]},
        *_user("hi")]}), 400, "nesting_too_deep"),
    ("completion empty prompt", dict(path="/v1/completions", body={"model": NAME, "prompt": ""}), 400,
     "invalid_value"),
    ("completion token out of vocab", dict(path="/v1/completions", body={"model": NAME, "prompt": [10**6]}), 400,
     "invalid_value"),
    ("completion huge max_tokens", dict(path="/v1/completions", body={"model": NAME, "prompt": "hi",
                                                                     "max_tokens": 100000}), 400,
     "context_length_exceeded"),
    ("completion suffix", dict(path="/v1/completions", body={"model": NAME, "prompt": "hi", "suffix": "x"}), 400,
     "unsupported_parameter"),
    ("unknown route", dict(path="/v1/embeddings", body={"model": NAME, "input": "hi"}), 404, "not_found"),
]


@pytest.fixture(scope="module")
def one_connection(server):
    """A client with a single keep-alive connection: every request of a test goes over the same socket."""
    with httpx.Client(base_url=server, timeout=60, limits=httpx.Limits(max_connections=1)) as http:
        yield http


def _local_port(response: httpx.Response) -> int:
    return response.extensions["network_stream"].get_extra_info("client_addr")[1]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_is_an_openai_error_and_the_connection_keeps_serving(one_connection, case):
    """Each malformed request over real HTTP: its status, OpenAI's error JSON with a code, and then a valid request
    answered on the same keep-alive connection."""
    name, request, status, code = case
    key = request.get("key", KEY)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    path = request.get("path", "/v1/chat/completions")
    if "raw" in request:
        r = one_connection.post(path, content=request["raw"], headers={**headers, "Content-Type": "application/json"})
    else:
        r = one_connection.post(path, json=request["body"], headers=headers)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert isinstance(error["message"], str) and error["message"] and error["type"]
    assert error["code"] == code, error
    if "unicode" in code:
        assert "surrogate" in error["message"] and error["param"]  # names the field
    assert r.headers["x-request-id"].startswith("req_")
    ok = one_connection.post("/v1/completions", json={"model": NAME, "prompt": "still there?", "max_tokens": 4},
                             headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200 and _local_port(ok) == _local_port(r)


def test_a_server_error_is_a_500_with_a_request_id_and_the_connection_keeps_serving(checkpoint, caplog):
    """A bug inside a handler (here: the tokenizer raising TypeError, as it did on a lone surrogate) is a 500
    naming the request id, and the next request on the same keep-alive connection is answered."""
    app = create_app(checkpoint)
    tokenizer = app.state.server.tokenizer
    encode = tokenizer.encode

    def broken(text):
        if "BOOM" in text:
            raise TypeError("TextEncodeInput must be Union[TextInputSequence, Tuple[InputSequence, InputSequence]]")
        return encode(text)

    tokenizer.encode = broken
    with server_thread(app) as url, httpx.Client(base_url=url, timeout=60,
                                                 limits=httpx.Limits(max_connections=1)) as http:
        for path, body in (("/v1/chat/completions", {"model": "clover", "messages": _user("BOOM")}),
                           ("/v1/completions", {"model": "clover", "prompt": "BOOM", "stream": True})):
            bad = http.post(path, json=body)
            assert bad.status_code == 500, bad.text
            error, request_id = bad.json()["error"], bad.headers["x-request-id"]
            assert error["code"] == "internal_error" and error["type"] == "server_error"
            assert request_id in error["message"] and "TextEncodeInput" not in error["message"]
            assert any(request_id in r.getMessage() and r.exc_info for r in caplog.records)  # logged with traceback
            ok = http.post("/v1/chat/completions", json={"model": "clover", "messages": _user("hi"), "max_tokens": 4})
            assert ok.status_code == 200 and _local_port(ok) == _local_port(bad)


def test_a_lone_surrogate_in_chat_content_is_a_400_naming_the_field(server):
    r = httpx.post(f"{server}/v1/chat/completions", content=_raw(b'"max_tokens": 4').replace(b'"hi"', b'"\\ud800"'),
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content", r.text


def test_bearer_scheme_is_case_insensitive(server):
    for scheme in ("bearer", "BEARER", "Bearer", "bEaReR"):
        r = httpx.get(f"{server}/v1/models", headers={"Authorization": f"{scheme} {KEY}"})
        assert r.status_code == 200, (scheme, r.text)
    for header in (f"Basic {KEY}", "Bearer", f"Bearer{KEY}", f"Bearer {KEY}x", KEY):
        r = httpx.get(f"{server}/v1/models", headers={"Authorization": header})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", header


def test_the_model_answers_to_its_aliases(client):
    for name in (NAME, ALIAS):
        assert client.models.retrieve(name).id == name
        r = client.chat.completions.create(model=name, messages=_user("hi"), max_tokens=4)
        assert r.model == NAME  # responses carry the canonical id


def test_the_default_model_is_served_as_clover_smol_and_its_full_id():
    from clover.cli.serve import served_model_names

    cached = Path("/cache/clover/clover-smol-0123456789ab")
    assert served_model_names(None, None, cached) == ["clover-smol", "clover-smol-0123456789ab"]
    assert served_model_names(None, cached.name, cached) == ["clover-smol-0123456789ab"]  # --model: its own name
    gguf = cached / "clover-smol-0123456789ab-q8_0.gguf"  # the default model on the llama.cpp runner
    assert served_model_names(None, None, gguf) == ["clover-smol", "clover-smol-0123456789ab-q8_0"]
    converted = Path("/cache/clover/converted/Qwen--Qwen3-0.6B-c0ffee")
    assert served_model_names(None, "Qwen/Qwen3-0.6B", converted) == ["Qwen/Qwen3-0.6B"]  # a hub id, as vLLM
    assert served_model_names(["a", "b", "a"], None, cached) == ["a", "b"]


def test_openai_client_raises_typed_errors(client, server):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=_user("hi"))
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=NAME, messages=_user("hi"), max_tokens=CONTEXT * 4)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0).models.list()


# -- backpressure and disconnects (a one-slot server) --------------------------------------------------------------
@pytest.fixture(scope="module")
def small_server(tmp_path_factory, chat_tokenizer):
    """One running sequence, one waiting; a long context, so requests can be made to run for many seconds."""
    long = build_checkpoint(tmp_path_factory.mktemp("small") / "tiny-long", chat_tokenizer,
                            max_position_embeddings=8192)
    with server_process(long, "--max-num-seqs", "1", "--max-queue", "1") as (url, _):
        yield url


def _running(url):
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("clover_running_requests "):
            return float(line.split()[1])
    raise AssertionError("no clover_running_requests metric")


def test_full_queue_answers_429_and_a_disconnecting_client_frees_its_slot(small_server):
    # one token per forward, no EOS: each of these would run for seconds if nothing stopped it
    body = {"model": NAME, "messages": _user("Tell me a long story."), "max_tokens": 8000, "stream": True,
            "block_size": 1, "ignore_eos": True}
    with httpx.Client(timeout=60) as a, httpx.Client(timeout=60) as b:
        with a.stream("POST", f"{small_server}/v1/chat/completions", json=body) as ra, \
                b.stream("POST", f"{small_server}/v1/chat/completions", json=body) as rb:
            assert ra.status_code == rb.status_code == 200
            lines = ra.iter_lines()  # kept: dropping a half-read iterator closes the connection
            assert next(lines).startswith("data: ")  # the role chunk: sent before the scheduler takes the request
            deadline = time.monotonic() + 10
            while _running(small_server) < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _running(small_server) == 1
            full = httpx.post(f"{small_server}/v1/chat/completions", json={**body, "stream": False}, timeout=30)
            assert full.status_code == 429 and full.json()["error"]["type"] == "rate_limit_error"
        # both clients closed their streams mid-generation: their slots must be freed
    deadline = time.monotonic() + 5
    while _running(small_server) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _running(small_server) == 0
    r = httpx.post(f"{small_server}/v1/chat/completions",
                   json={"model": NAME, "messages": _user("hi"), "max_tokens": 4}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_a_non_streaming_client_that_gives_up_frees_its_slot(small_server):
    body = {"model": NAME, "messages": _user("Tell me a long story."), "max_tokens": 8000, "block_size": 1,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{small_server}/v1/chat/completions", json=body, timeout=1.0)
    deadline = time.monotonic() + 5
    while _running(small_server) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _running(small_server) == 0


# -- fuzzing the OpenAPI schema ------------------------------------------------------------------------------------
def test_fuzz_openapi_schema_no_server_errors(server):
    """schemathesis generates valid and invalid requests for every route of the server's OpenAPI schema, for a
    bounded number of examples: no 5xx, every error with a code, and the server stays healthy."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings

    headers = {"Authorization": f"Bearer {KEY}"}
    spec = httpx.get(f"{server}/openapi.json", headers=headers).json()
    schema = schemathesis.openapi.from_dict(spec)
    failures, statuses = [], {}
    for result in schema.get_all_operations():
        operation = result.ok()

        @settings(max_examples=60 if operation.method.upper() == "POST" else 5, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck), derandomize=True)
        @given(case=operation.as_strategy(generation_mode=schemathesis.GenerationMode.POSITIVE)
               | operation.as_strategy(generation_mode=schemathesis.GenerationMode.NEGATIVE))
        def check(case):
            if isinstance(case.body, dict):
                if isinstance(case.body.get("model"), str):
                    case.body["model"] = NAME  # else nearly every request stops at "unknown model"
                if case.body.get("stream") is True:
                    case.body["stream"] = False  # a stream would only be read to its end
            response = case.call(base_url=server, headers=headers, timeout=60)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            if response.status_code >= 500 or (response.status_code >= 400 and not response.json()["error"]["code"]):
                failures.append((operation.label, case.body, response.status_code, response.text[:300]))

        check()
    assert not failures, failures[:3]
    assert statuses.get(200, 0) >= 5 and statuses.get(400, 0) >= 5, statuses  # both paths were exercised
    assert httpx.get(f"{server}/health").status_code == 200


# -- request metrics, in process -------------------------------------------------------------------------------------
def test_a_client_gone_before_the_response_counts_as_499_not_500():
    from types import SimpleNamespace

    from clover.serving.metrics import ServerMetrics
    from clover.serving.middleware import RequestGuard
    from clover.serving.served_model import ServerOptions

    async def never_called(scope, receive, send):
        raise AssertionError("the app runs only once the body is read")

    async def failing(scope, receive, send):
        raise RuntimeError("bug")

    async def left():
        return {"type": "http.disconnect"}

    async def body():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    sent = []

    async def send(message):
        sent.append(message)

    metrics = ServerMetrics()
    server = SimpleNamespace(options=ServerOptions(), metrics=metrics)
    scope = {"type": "http", "path": "/v1/completions", "headers": []}
    asyncio.run(RequestGuard(never_called, server)(scope, left, send))
    assert sent == []
    asyncio.run(RequestGuard(failing, server)(scope, body, send))  # a bug is answered, not raised to the ASGI server
    assert sent[0]["status"] == 500 and json.loads(sent[1]["body"])["error"]["code"] == "internal_error"

    def count(status):
        return metrics.registry.get_sample_value("clover_requests_total",
                                                 {"route": "/v1/completions", "status": status})
    assert count("499") == 1 and count("500") == 1


# -- a released family's conventions ----------------------------------------------------------------------------
def test_a_model_of_sdar_conventions_serves_what_the_engine_gives_alone(tmp_path, chat_tokenizer):
    """No token shift, the prompt on the absolute block grid (its last partial block opens the first generated
    one): concurrent chats, prefilled one by one in chunks and joined into one batch, each get what the engine gives
    the chat alone."""
    from concurrent.futures import ThreadPoolExecutor

    checkpoint = build_checkpoint(tmp_path / "sdar-like", chat_tokenizer, max_position_embeddings=CONTEXT,
                                  token_shift=False, prompt_reading="blocks", block_grid="absolute", block_size=4,
                                  family="sdar")
    model = CloverForBlockDiffusion.from_pretrained(checkpoint)
    chats = [_user(text) for text in ("Hello world.", "What is the weather today in Paris?", "Hi")]
    want = []
    for msgs in chats:
        ids = chat_tokenizer(render_chat(chat_tokenizer, msgs, add_generation_prompt=True),
                             add_special_tokens=False)["input_ids"]
        out = generate(model, [ids], 12, eos_token_ids=[chat_tokenizer.eos_token_id], vocab_limit=len(chat_tokenizer))
        want.append(chat_tokenizer.decode(out.sequences[0], skip_special_tokens=True).strip())
    assert {len(chat_tokenizer(render_chat(chat_tokenizer, m, add_generation_prompt=True),
                               add_special_tokens=False)["input_ids"]) % 4 for m in chats} != {0}
    with server_process(checkpoint, "--prefill-chunk", "8") as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        with ThreadPoolExecutor(len(chats)) as pool:
            got = list(pool.map(lambda m: client.chat.completions.create(model="clover-test", messages=m,
                                                                        max_tokens=12), chats))
    assert [r.choices[0].message.content for r in got] == want
