"""`clover serve --engine vllm`: every option is passed to vLLM with its meaning or refused by name (the command
line it would run; vLLM is not started)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from clover.cli import serve
from clover.serving.vllm.launch import vllm_serve_argv
from model_helpers import tiny_model

XML_TEMPLATE = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
                "{#- calls: <tool_call>\n<function=name>\n<parameter=city>\nParis\n</parameter>\n</function> #}"
                "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, chat_tokenizer) -> Path:
    directory = tmp_path_factory.mktemp("vllm-options") / "tiny-dense"
    model = tiny_model("clover-tiny-dense", head_dim=32, vocab_size=len(chat_tokenizer),
                       mask_token_id=chat_tokenizer.mask_token_id, eos_token_id=chat_tokenizer.eos_token_id)
    tok_dir = directory.parent / "tokenizer"
    chat_tokenizer.save_pretrained(tok_dir)
    model.save_pretrained(directory, tokenizer_dir=tok_dir)
    return directory


def _argv(checkpoint: Path, *flags: str) -> list[str]:
    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--engine", "vllm", "--model", str(checkpoint), *flags])
    return vllm_serve_argv(checkpoint, ["tiny"], args, serve.given_options(args))


def _after(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


@pytest.fixture(autouse=True)
def vllm_python(monkeypatch):
    monkeypatch.setenv("CLOVER_VLLM_PYTHON", sys.executable)


def test_the_tool_call_parser_is_the_one_the_template_writes(checkpoint, tmp_path):
    """Qwen3.5's XML calls need vLLM's qwen3_coder parser (hermes cannot read them); the format is read from the
    template vLLM renders with, or taken from --tool-call-parser."""
    template = tmp_path / "qwen35.jinja"
    template.write_text(XML_TEMPLATE)
    argv = _argv(checkpoint, "--chat-template", str(template))
    assert _after(argv, "--chat-template") == str(template.resolve())
    assert _after(argv, "--tool-call-parser") == "qwen3_coder"
    assert _after(_argv(checkpoint, "--tool-call-parser", "qwen3_coder"), "--tool-call-parser") == "qwen3_coder"
    argv = _argv(checkpoint)  # the checkpoint's own template (Clover's <tool_call> JSON)
    assert "--chat-template" not in argv and _after(argv, "--tool-call-parser") == "hermes"
    argv = _argv(checkpoint, "--chat-template", "clover")
    assert "<tool_call>" in _after(argv, "--chat-template") and _after(argv, "--tool-call-parser") == "hermes"


def test_shared_options_are_passed_with_their_meaning(checkpoint):
    argv = _argv(checkpoint, "--port", "8123", "--max-num-seqs", "4", "--max-model-len", "1024", "--log-level",
                 "warning", "--prefix-cache-mb", "0")
    for flag, value in (("--port", "8123"), ("--max-num-seqs", "4"), ("--max-model-len", "1024"),
                        ("--uvicorn-log-level", "warning")):
        assert _after(argv, flag) == value
    assert "--no-enable-prefix-caching" in argv


@pytest.mark.parametrize("flags", [("--record-requests", "log.jsonl"), ("--draft-memory", "shared"),
                                   ("--max-body-mb", "1"), ("--draft-memory-tokens", "10"), ("--block-size", "4"),
                                   ("--prefix-cache-mb", "1024"), ("--responses-store-mb", "1"), ("--max-queue", "3")])
def test_an_option_vllm_cannot_honour_is_refused_by_name(checkpoint, flags):
    with pytest.raises(SystemExit, match=f"{flags[0]} is not served by vLLM"):
        _argv(checkpoint, *flags)
