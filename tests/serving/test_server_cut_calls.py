"""A call cut by the length limit is reported as cut, never as something else: a Responses `function_call` item
`incomplete`, a chat choice `finish_reason: "length"` with the partial call, and the forced start of a call
(`tool_choice: "required"`) never as content. Logprob `bytes` are each token's own bytes, also for a token that
is part of a character. The scripted model writes what a trained one would (server_helpers.ScriptedLM)."""

from __future__ import annotations

import httpx
import pytest

from clover.serving import ServerOptions, create_app
from clover.serving.locked_tokenizer import LockedTokenizer
from server_helpers import ScriptedLM, server_thread

NAME = "scripted"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris, the capital of France"}}\n</tool_call>'


def script(prompt: str) -> str:
    if prompt.endswith("<tool_call>\n"):  # a forced call
        return CALL[len("<tool_call>\n"):]
    return CALL if "<tools>" in prompt else "Hello world."


@pytest.fixture(scope="module")
def server(chat_tokenizer):
    app = create_app(ScriptedLM(chat_tokenizer, script), chat_tokenizer,
                     ServerOptions(served_model_name=NAME, prefill_chunk=16))
    with server_thread(app) as url:
        yield url


def _chat(server: str, **fields) -> dict:
    r = httpx.post(f"{server}/v1/chat/completions", timeout=60,
                   json={"model": NAME, "messages": [{"role": "user", "content": "Weather in Paris?"}],
                         "tools": TOOLS, **fields})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_a_call_cut_by_max_output_tokens_is_an_incomplete_item(server):
    for stream in (False, True):
        body = {"model": NAME, "input": "Weather in Paris?", "max_output_tokens": 30, "stream": stream,
                "tools": [{"type": "function", **TOOLS[0]["function"]}]}
        if not stream:
            response = httpx.post(f"{server}/v1/responses", json=body, timeout=60).json()
        else:
            with httpx.stream("POST", f"{server}/v1/responses", json=body, timeout=60) as s:
                events = [line for line in s.iter_lines() if line.startswith("data: ")]
            import json
            response = json.loads(events[-1][len("data: "):])["response"]
        assert response["status"] == "incomplete"
        call = [item for item in response["output"] if item["type"] == "function_call"][-1]
        assert call["status"] == "incomplete" and call["name"] == "get_weather", call
        assert '"Paris, the capital of France"' not in call["arguments"]  # really cut


def test_a_cut_chat_call_is_length_with_the_partial_call(server):
    choice = _chat(server, max_tokens=30)
    assert choice["finish_reason"] == "length"
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert not choice["message"]["content"]


def test_a_forced_call_cut_before_its_name_is_never_content(server):
    """tool_choice "required" and max_tokens 3: the call the server forced has no name yet; the answer is cut
    (length), with no content (the forced `<tool_call>` start is the server's own text, never the model's)."""
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        got = _chat(server, max_tokens=3, tool_choice=choice)
        assert got["finish_reason"] == "length" and not got["message"]["content"], got


def test_logprob_bytes_are_the_tokens_own_bytes(chat_tokenizer):
    """A byte-level token that holds part of a character decodes to U+FFFD; its `bytes` are its own."""
    tok = LockedTokenizer(chat_tokenizer)
    ids = chat_tokenizer("é€", add_special_tokens=False)["input_ids"]
    parts = tok.token_bytes(ids)
    assert b"".join(parts) == "é€".encode() and len(parts) == len(ids)
    assert any(text == "\ufffd" for text in tok.token_texts(ids))  # a partial token's text is U+FFFD
    from clover.serving.api.openai_format import chat_logprobs
    from clover.engine.logprobs import TokenLogprob

    values = [TokenLogprob(i, -1.0, [(i, -1.0)]) for i in ids]
    content = chat_logprobs(values, tok.token_texts, tok.token_bytes)["content"]
    assert [bytes(c["bytes"]) for c in content] == parts
    assert [bytes(c["top_logprobs"][0]["bytes"]) for c in content] == parts
