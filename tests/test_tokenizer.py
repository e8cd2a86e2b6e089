"""`clover.tokenizer.Tokenizer` (on `tokenizers`, without `transformers`) answers as `transformers`' fast tokenizer
does on the same files: ids, text, special tokens, vocabulary and chat templates rendered byte for byte."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from clover.chat_template import CLOVER_CHAT_TEMPLATE, render_chat
from clover.tokenizer import Tokenizer, load_tokenizer

TEXTS = ["Hello world.", "def add(x, y):\n    return x + y\n", "<|im_start|>user\nhi<|im_end|>\n", "  spaced  ",
         "ünïcödé ✓ 21 °C", ""]
# a template using what transformers' template environment provides: tojson with options, namespace, loop
# controls, raise_exception, the special tokens and extra keyword arguments
TEMPLATE = (
    "{%- set ns = namespace(n=0) -%}{{ bos_token }}"
    "{%- for m in messages -%}{%- if m.role == 'skip' %}{% continue %}{% endif -%}"
    "{%- set ns.n = ns.n + 1 -%}[{{ m.role }}|{{ m.content | tojson(indent=1) }}]"
    "{%- endfor -%}{{ tools | tojson }}{{ ns.n }}{% if add_generation_prompt %}<gen{{ flag }}>{% endif %}"
    "{%- if messages | length > 9 %}{{ raise_exception('too many') }}{% endif %}{{ eos_token }}")
MESSAGES = [{"role": "system", "content": "Be <b>brief</b> & \"exact\"."}, {"role": "skip", "content": "x"},
            {"role": "user", "content": "Ça va? 日本"}]


@pytest.fixture
def pair(chat_tokenizer: PreTrainedTokenizerFast, tmp_path: Path) -> tuple[Tokenizer, PreTrainedTokenizerFast]:
    chat_tokenizer.save_pretrained(tmp_path)
    return load_tokenizer(tmp_path), PreTrainedTokenizerFast.from_pretrained(str(tmp_path))


def test_ids_and_text_equal_transformers(pair) -> None:
    ours, ref = pair
    for text in TEXTS:
        for special in (True, False):
            assert ours(text, add_special_tokens=special)["input_ids"] == ref(text, add_special_tokens=special)[
                "input_ids"]
    assert ours(TEXTS, add_special_tokens=False)["input_ids"] == ref(TEXTS, add_special_tokens=False)["input_ids"]
    ids = ref("<|im_start|>assistant\nHello world.<|im_end|><|mask|>", add_special_tokens=False)["input_ids"]
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
        assert ours.batch_decode([ids, ids[:3]], skip_special_tokens=skip) == ref.batch_decode(
            [ids, ids[:3]], skip_special_tokens=skip)
    assert ours.decode(ids[0]) == ref.decode(ids[0])


def test_vocabulary_and_special_tokens_equal_transformers(pair) -> None:
    ours, ref = pair
    assert ours.get_vocab() == ref.get_vocab()
    assert (len(ours), ours.vocab_size) == (len(ref), ref.vocab_size)
    for name in ("bos_token", "eos_token", "unk_token", "pad_token", "mask_token"):
        assert (getattr(ours, name), getattr(ours, f"{name}_id")) == (getattr(ref, name), getattr(ref, f"{name}_id"))
    assert ours.all_special_ids == sorted(ref.all_special_ids)
    assert ours.convert_tokens_to_ids(["<|im_end|>", "<|mask|>"]) == ref.convert_tokens_to_ids(["<|im_end|>",
                                                                                               "<|mask|>"])
    assert ours.convert_ids_to_tokens([1, 2, 50]) == ref.convert_ids_to_tokens([1, 2, 50])


def test_chat_templates_render_as_transformers_renders_them(pair) -> None:
    ours, ref = pair
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for generation in (True, False):
        kwargs = dict(tools=tools, add_generation_prompt=generation, tokenize=False, flag="!")
        assert ours.apply_chat_template(MESSAGES, chat_template=TEMPLATE, **kwargs) == ref.apply_chat_template(
            MESSAGES, chat_template=TEMPLATE, **kwargs)
        chat = [{"role": "user", "content": "Weather in Paris?"}]
        assert render_chat(ours, chat, tools, add_generation_prompt=generation, enable_thinking=generation) == \
            render_chat(ref, chat, tools, add_generation_prompt=generation, enable_thinking=generation)
    assert ours.chat_template == CLOVER_CHAT_TEMPLATE
    ids = ours.apply_chat_template(MESSAGES, chat_template=TEMPLATE)  # tokenized by default, as in transformers
    assert ours.decode(ids) == ours.apply_chat_template(MESSAGES, chat_template=TEMPLATE, tokenize=False)
    with pytest.raises(Exception, match="too many"):
        ours.apply_chat_template(MESSAGES * 4, chat_template=TEMPLATE, tokenize=False)


def test_saved_tokenizer_reads_back_in_both(pair, tmp_path: Path) -> None:
    ours, _ = pair
    ours.save(tmp_path / "copy")
    again, ref = load_tokenizer(tmp_path / "copy"), PreTrainedTokenizerFast.from_pretrained(str(tmp_path / "copy"))
    assert again.get_vocab() == ref.get_vocab() == ours.get_vocab()
    assert again.chat_template == ref.chat_template == CLOVER_CHAT_TEMPLATE
    assert again.encode(TEXTS[1]) == ref.encode(TEXTS[1])


def test_bad_tokenizer_files_are_named(pair, tmp_path: Path) -> None:
    ours, _ = pair
    ours.save(tmp_path / "bad")
    config = tmp_path / "bad" / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "eos_token": "<|nope|>"}))
    with pytest.raises(ValueError, match="eos_token '<\\|nope\\|>'"):
        load_tokenizer(tmp_path / "bad")
    config.write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json: not valid JSON"):
        load_tokenizer(tmp_path / "bad")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(tmp_path / "empty")
