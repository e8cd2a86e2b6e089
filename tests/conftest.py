"""Shared fixtures."""

from __future__ import annotations

import pytest


def build_chat_tokenizer():
    """A small byte-level BPE with Clover's special tokens (`<|im_start|>`, `<|im_end|>`, `<|mask|>`) and chat
    template, trained in-process on chat-like text with tools and reasoning (so its merges look like a real
    chat tokenizer's). Builds in well under a second."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from clover.chat_template import CLOVER_CHAT_TEMPLATE

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    corpus = [
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is the weather in Paris?"
        "<|im_end|>\n<|im_start|>assistant\n<think>\nThe user wants the weather. I should call get_weather.\n"
        "</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n{\"temp_c\": 21}\n</tool_response><|im_end|>\n",
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n",
        "def add(x, y):\n    return x + y\n\nHello world. The weather is sunny and it is 21 degrees.\n",
    ] * 8
    tk.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", mask_token="<|mask|>")
    tok.chat_template = CLOVER_CHAT_TEMPLATE
    return tok


@pytest.fixture(scope="session")
def chat_tokenizer():
    return build_chat_tokenizer()


@pytest.fixture
def temp_clover_cache(tmp_path_factory, monkeypatch):
    """Clover's cache directory (a GGUF's converted tokenizer, built extensions) in a temporary one."""
    monkeypatch.setenv("CLOVER_CACHE", str(tmp_path_factory.getbasetemp() / "clover-cache"))
