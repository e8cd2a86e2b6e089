"""Grammar-constrained decoding (clover.engine.constraints.grammar): exact mode under a grammar is constrained
block-size-1 greedy decoding token for token (alone, batched, with drafts accepted and rejected), every answer follows
the grammar, forced tokens cost no forward, and what the engine cannot enforce is refused by name."""

from __future__ import annotations

import json

import jsonschema_rs
import pytest

from clover.engine import Engine, RequestOptions, generate
from clover.engine.decoding import ExactRule
from clover.engine.constraints.grammar import GrammarError, json_schema_grammar, tool_call_grammar
from clover.engine.reference import constrained_greedy
from model_helpers import tiny_model
from test_exact_mode import OracleLoop

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    "size": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999}, {"type": "null"}]},
    "ok": {"type": "boolean"}}, "required": ["name", "tags", "size", "ok"], "additionalProperties": False}
MAX_NEW = 40


@pytest.fixture(scope="module")
def model(chat_tokenizer):
    return tiny_model("clover-tiny", vocab_size=len(chat_tokenizer), mask_token_id=chat_tokenizer.mask_token_id,
                      eos_token_id=chat_tokenizer.eos_token_id, logit_scale=3.0)


@pytest.fixture(scope="module")
def grammar(chat_tokenizer):
    return json_schema_grammar(SCHEMA, chat_tokenizer)


def _prompts(tok):
    return [tok("Describe a thing as JSON:", add_special_tokens=False)["input_ids"],
            tok("def add(x, y):", add_special_tokens=False)["input_ids"],
            tok("The weather is", add_special_tokens=False)["input_ids"]]


def _eos(tok):
    return [tok.eos_token_id]


def test_exact_mode_under_a_grammar_equals_constrained_block_size_1_greedy(model, chat_tokenizer, grammar):
    prompts, eos = _prompts(chat_tokenizer), _eos(chat_tokenizer)
    want = [constrained_greedy(model, p, MAX_NEW, grammar, eos) for p in prompts]
    for block_size in (1, 4):
        got = generate(model, prompts, MAX_NEW, block_size=block_size, rule="exact", eos_token_ids=eos,
                       grammar=grammar).sequences
        assert got == want, block_size
    for p, w in zip(prompts, want):  # alone as in the batch
        assert generate(model, [p], MAX_NEW, block_size=4, rule="exact", eos_token_ids=eos,
                        grammar=grammar).sequences[0] == w


@pytest.mark.parametrize("wrong", [0.0, 0.3])
def test_drafts_checked_against_the_masked_choice(model, chat_tokenizer, grammar, wrong):
    """Drafts from the reference continuation (some wrong): accepted while equal to the masked causal choice."""
    prompts, eos = _prompts(chat_tokenizer), _eos(chat_tokenizer)
    want = [constrained_greedy(model, p, MAX_NEW, grammar, eos) for p in prompts]
    engine = Engine(model, 4, rule="exact", eos_token_ids=eos)
    engine.loop = OracleLoop(engine, dict(enumerate(want)), wrong)
    out = [[] for _ in prompts]
    for ev in engine.run(prompts, MAX_NEW, RequestOptions.of(grammar=grammar)):
        if hasattr(ev, "token_ids"):
            out[ev.seq_id] += ev.token_ids
    assert out == want


@pytest.fixture(scope="module")
def greedy_answers(model, chat_tokenizer, grammar):
    return generate(model, _prompts(chat_tokenizer), 200, block_size=4, rule="exact",
                    eos_token_ids=_eos(chat_tokenizer), grammar=grammar)


def test_answers_follow_the_schema_and_forced_tokens_cost_no_forward(chat_tokenizer, greedy_answers):
    result = greedy_answers
    for ids, stats in zip(result.sequences, result.stats):
        assert stats["finish_reason"] == "eos"
        jsonschema_rs.validate(SCHEMA, json.loads(chat_tokenizer.decode(ids)))
        assert stats["forced_tokens"] > 0
        # every token is decided by a forward or forced (the last forced one may be the EOS, not counted)
        assert stats["forward_passes"] <= stats["tokens"] - stats["forced_tokens"] + 2


def test_sampling_under_a_grammar_follows_it(model, chat_tokenizer, grammar, greedy_answers):
    """Sampled answers (not the greedy ones) all end and all validate: the schema is bounded (a 12-character name,
    at most 3 tags, a 3-digit size), so within 200 tokens every answer must be complete."""
    result = generate(model, _prompts(chat_tokenizer), 200, block_size=4, rule="exact",
                      eos_token_ids=_eos(chat_tokenizer), grammar=grammar, temperature=1.0, seed=3)
    for ids, stats in zip(result.sequences, result.stats):
        assert stats["finish_reason"] == "eos", chat_tokenizer.decode(ids)
        jsonschema_rs.validate(SCHEMA, json.loads(chat_tokenizer.decode(ids)))
    assert result.sequences != greedy_answers.sequences  # sampling ran


def test_a_tool_call_grammar_gives_arguments_of_the_schema(model, chat_tokenizer):
    params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
    noop = {"type": "object", "properties": {}, "additionalProperties": False}
    grammar = tool_call_grammar([("get_weather", params), ("noop", noop)], chat_tokenizer,
                                head='{{"name": {name}, "arguments": ', tail="}\n</tool_call>")
    ids = generate(model, _prompts(chat_tokenizer)[:1], 100, rule="exact", block_size=4,
                   eos_token_ids=_eos(chat_tokenizer), grammar=grammar).sequences[0]
    text = chat_tokenizer.decode(ids)
    assert text.endswith("}\n</tool_call>")
    call = json.loads(text[: -len("\n</tool_call>")])
    jsonschema_rs.validate(params if call["name"] == "get_weather" else {"type": "object"}, call["arguments"])


def _accepts(grammar, tok, text: str) -> bool:
    """Whether `text` is a whole answer of `grammar` (fed as the tokenizer splits it)."""
    matcher = grammar.matcher(len(tok), _eos(tok))
    try:
        matcher.consume(tok(text, add_special_tokens=False)["input_ids"])
    except RuntimeError:
        return False
    return matcher.m.is_accepting()


def test_a_calls_grammar_takes_one_or_more_calls_or_the_json_answer(chat_tokenizer):
    params = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    loose = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}, "required": ["tags"]}
    head, tail = '<tool_call>\n{{"name": {name}, "arguments": ', "}\n</tool_call>"
    tools = [("get_weather", params), ("tag", loose, False)]  # not strict: `uniqueItems` ignored, not refused
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    other = '<tool_call>\n{"name": "tag", "arguments": {"tags": [1, 1]}}\n</tool_call>'
    one = tool_call_grammar(tools, chat_tokenizer, head, tail)
    several = tool_call_grammar(tools, chat_tokenizer, head, tail, more="\n", json_answer=SCHEMA)
    answer = json.dumps({"name": "x", "tags": [], "size": None, "ok": True})
    assert _accepts(one, chat_tokenizer, call) and _accepts(one, chat_tokenizer, other)
    assert not _accepts(one, chat_tokenizer, call + "\n" + other)
    assert _accepts(several, chat_tokenizer, call + "\n" + other) and _accepts(several, chat_tokenizer, answer)
    assert not _accepts(several, chat_tokenizer, call.replace('"Paris"', "3"))  # the schema still holds
    assert not _accepts(several, chat_tokenizer, call + "\n" + answer) and not _accepts(one, chat_tokenizer, answer)
    with pytest.raises(GrammarError, match="uniqueItems"):
        tool_call_grammar([("tag", loose)], chat_tokenizer, head, tail)  # strict (the default): refused


def test_objects_hold_only_the_properties_they_list(chat_tokenizer):
    """An object schema that lists its properties and says nothing of others gets those only (as xgrammar's strict
    mode, vLLM's and SGLang's default), in tool arguments and response formats: LangChain and instructor send such
    schemas, and a model allowed undeclared keys can nest them past any budget. Objects that list none, or allow
    others explicitly, stay open."""
    head, tail = '<tool_call>\n{{"name": {name}, "arguments": ', "}\n</tool_call>"
    listed = {"type": "object", "properties": {"city": {"type": "string"}, "where": {
        "type": "object", "properties": {"lat": {"type": "number"}}}}, "required": ["city"]}
    open_ = {"type": "object", "properties": {"city": {"type": "string"}}, "additionalProperties": True}
    grammar = tool_call_grammar([("get_weather", listed, False), ("free", None), ("open", open_)], chat_tokenizer,
                                head, tail)

    def call(name: str, arguments: dict) -> str:
        return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'

    assert _accepts(grammar, chat_tokenizer, call("get_weather", {"city": "Paris", "where": {"lat": 1.5}}))
    assert not _accepts(grammar, chat_tokenizer, call("get_weather", {"city": "Paris", "x": 1}))
    assert not _accepts(grammar, chat_tokenizer, call("get_weather", {"city": "Paris", "where": {"lat": 1, "x": 1}}))
    assert _accepts(grammar, chat_tokenizer, call("free", {"x": {"y": 1}}))
    assert _accepts(grammar, chat_tokenizer, call("open", {"city": "Paris", "x": 1}))
    answer = json_schema_grammar(listed, chat_tokenizer)
    assert _accepts(answer, chat_tokenizer, '{"city": "Paris"}')
    assert not _accepts(answer, chat_tokenizer, '{"city": "Paris", "x": 1}')
    assert _accepts(json_schema_grammar(None, chat_tokenizer), chat_tokenizer, '{"x": {"y": 1}}')  # json_object


def test_what_the_engine_cannot_enforce_is_refused_by_name(chat_tokenizer):
    with pytest.raises(GrammarError, match="uniqueItems") as err:
        json_schema_grammar({"type": "array", "uniqueItems": True}, chat_tokenizer)
    assert err.value.keyword == "uniqueItems"


def test_block_decoding_refuses_a_grammar(model, chat_tokenizer, grammar):
    with pytest.raises(ValueError, match="cannot follow a grammar"):
        generate(model, _prompts(chat_tokenizer)[:1], 8, block_size=4, rule="threshold", grammar=grammar)


SMALL = {"type": "object", "properties": {"ok": {"type": "boolean"}, "tags": {"type": "array", "items": {
    "enum": ["red", "blue"]}, "maxItems": 2}}, "required": ["ok", "tags"], "additionalProperties": False}


@pytest.mark.parametrize("schema", [SMALL, {"type": "integer", "minimum": 0, "maximum": 99999}],
                         ids=["object", "number"])
def test_ignore_eos_under_a_grammar_ends_where_the_grammar_can_only_end(model, chat_tokenizer, schema):
    """With no EOS ids (ignore_eos) the model cannot stop where the grammar could go on (a number may take more
    digits); the answer ends, with the model's EOS, where the grammar is complete: constrained block-size-1 greedy
    decoding under the same rule, token for token, and valid."""
    grammar, prompts = json_schema_grammar(schema, chat_tokenizer), _prompts(chat_tokenizer)
    want = [constrained_greedy(model, p, MAX_NEW, grammar, []) for p in prompts]
    for block_size in (1, 4):
        result = generate(model, prompts, MAX_NEW, block_size=block_size, rule="exact", eos_token_ids=[],
                          grammar=grammar)
        assert result.sequences == want, block_size
    for ids, stats in zip(result.sequences, result.stats):
        assert stats["finish_reason"] == "eos"
        jsonschema_rs.validate(schema, json.loads(chat_tokenizer.decode(ids)))
    if schema is SMALL:  # an object's end is the grammar's only end: the same answers as with the EOS
        eos = _eos(chat_tokenizer)
        assert want == [constrained_greedy(model, p, MAX_NEW, grammar, eos) for p in prompts]
