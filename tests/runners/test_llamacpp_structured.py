"""Structured outputs on the llama.cpp runner: `clover decide --runner llamacpp` and the server's `response_format`
(a form: decision mode; any other JSON Schema: the grammar path, exact mode) give valid answers, equal to the torch
runner's on the same model at f32 (the runner with f32 KV; the CLI's f16 KV on this model too)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema_rs
import openai
import pytest
from server_helpers import checkpoint_and_gguf, server_thread

from clover import CloverForBlockDiffusion
from clover.cli.main import main
from clover.engine.constraints.form import parse_form
from clover.runners.llamacpp import LlamaCppRunner
from clover.serving import ServerOptions, create_app

CONTEXT = "Hello world. What is the weather in Paris?"
FORM = {"type": "object", "properties": {"category": {"enum": ["billing", "bug", "weather report"]},
                                         "urgent": {"type": "boolean"}, "note": {"type": "string", "maxLength": 4}}}
# outside the form subset (an array, a nested object, `required`): the grammar path; bounded, so a random model ends
SCHEMA = {"type": "object", "properties": {
    "tags": {"type": "array", "items": {"enum": ["rain", "sun", "wind"]}, "maxItems": 2},
    "where": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"],
              "additionalProperties": False},
    "urgent": {"type": "boolean"}}, "required": ["tags", "where", "urgent"], "additionalProperties": False}


pytestmark = pytest.mark.usefixtures("temp_clover_cache")  # the GGUF's converted tokenizer is cached there


@pytest.fixture(scope="module")
def exported(tmp_path_factory, chat_tokenizer) -> tuple[Path, Path]:
    return checkpoint_and_gguf(tmp_path_factory.mktemp("llamacpp-structured"), chat_tokenizer, 512)


def _decide(capsys, tmp_path: Path, schema: dict, *args: str) -> dict:
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    assert main(["decide", "--threads", "1", "--max-new-tokens", "150", "--json-schema", str(path), *args,
                 CONTEXT]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("schema, path", [(FORM, "decision"), (SCHEMA, "grammar")], ids=["form", "json_schema"])
def test_clover_decide_on_llamacpp_equals_the_torch_runner(exported, capsys, tmp_path, schema, path):
    checkpoint, gguf = exported
    want = _decide(capsys, tmp_path, schema, "--model", str(checkpoint))
    got = _decide(capsys, tmp_path, schema, "--runner", "llamacpp", "--model", str(gguf))
    assert got["path"] == want["path"] == path
    jsonschema_rs.validate(schema, got["values"])
    assert (got["values"], got["forward_passes"]) == (want["values"], want["forward_passes"])
    if path == "decision":
        parse_form(schema).validate(got["values"])
        assert got["order"] == want["order"]
        assert got["probabilities"] == pytest.approx(want["probabilities"], rel=1e-2)
    else:
        assert (got["tokens"], got["forced_tokens"]) == (want["tokens"], want["forced_tokens"])


def test_response_format_on_llamacpp_equals_the_torch_runner(exported, chat_tokenizer):
    """A form (decision mode, in the scheduler) and a general JSON Schema (the grammar path, exact mode), streamed
    and not: the llama.cpp runner's answers (f32 KV) are the torch model's, and valid."""
    checkpoint, gguf = exported
    runners = {"torch": CloverForBlockDiffusion.from_pretrained(checkpoint).eval(),
               "llamacpp": LlamaCppRunner(gguf, threads=1, kv_type="f32", max_rows=4)}
    messages = [{"role": "user", "content": CONTEXT}]
    answers: dict[str, list] = {}
    for name, runner in runners.items():
        app = create_app(runner, chat_tokenizer, ServerOptions(served_model_name="tiny", max_running=4))
        with server_thread(app) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
            answers[name] = []
            for schema in (FORM, SCHEMA):
                fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
                reply = client.chat.completions.create(model="tiny", messages=messages, response_format=fmt,
                                                       max_tokens=200)
                assert reply.choices[0].finish_reason == "stop"
                content = reply.choices[0].message.content
                jsonschema_rs.validate(schema, json.loads(content))
                stream = client.chat.completions.create(model="tiny", messages=messages, response_format=fmt,
                                                        max_tokens=200, stream=True)
                assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == content
                answers[name].append((content, (reply.model_extra or {}).get("decision", {}).get("forward_passes")))
    assert answers["llamacpp"] == answers["torch"]
    assert answers["torch"][0][1] is not None  # the form was decided (decision mode), the schema was not
    assert sorted(runners["llamacpp"]._free) == list(range(runners["llamacpp"].max_rows))
