"""Shared fixtures, and the suite's own Clover cache.

Every test, and every process a test starts (servers, CLI runs, torchrun), keeps Clover's cache (`CLOVER_CACHE`:
cost tables, converted tokenizers, compiled kernels, built models) in one temporary directory per session, so a
run leaves nothing in the user's `~/.cache/clover` and reads nothing stale from it. The one thing copied in is the
compiled CPU kernel of the current sources (`extensions/woq-<tag>`, ~1.5 MB; compiling it takes minutes on two
cores), when the user's cache has it: a build product named by the hash of what it was built from, copied, never
linked, so nothing the suite does can reach the original. The default model's builds are not copied: the tests that
need them (tests/test_smol.py) build them from its package as they test the build itself, once per session.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

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


@pytest.fixture(scope="session", autouse=True)
def suite_clover_cache(tmp_path_factory) -> Iterator[Path]:
    """The session's Clover cache (module docstring), set in the environment, which subprocesses inherit."""
    from clover.ops import woq
    from clover.paths import cache_root

    cache = tmp_path_factory.mktemp("clover-cache")
    kernel = Path("extensions") / f"woq-{woq.kernel_tag()}"
    if (cache_root() / kernel).is_dir():  # copy2 keeps the files' times: ninja finds the build up to date
        shutil.copytree(cache_root() / kernel, cache / kernel, ignore=shutil.ignore_patterns("lock"))
    previous = os.environ.get("CLOVER_CACHE")
    os.environ["CLOVER_CACHE"] = str(cache)
    try:
        yield cache
    finally:
        if previous is None:
            os.environ.pop("CLOVER_CACHE", None)
        else:
            os.environ["CLOVER_CACHE"] = previous


@pytest.fixture
def temp_clover_cache(suite_clover_cache) -> Path:
    """The suite's temporary Clover cache (every test has it; a test names this fixture to get its path)."""
    return suite_clover_cache


LLAMA_CPP_SDIST = "llama-cpp-python==0.3.36"  # its sdist vendors llama.cpp's tree: models/templates/, the converter


def llama_cpp_sdist(request, tmp_path_factory, name: str, keep: Callable[[str], str | None]) -> Path:
    """A directory of files read from the llama-cpp-python sdist on the package index at first use and kept in
    pytest's cache as `name` (not copied into the repository; under `-p no:cacheprovider`, this session's temporary
    directory): `keep(member name)` gives a file's path inside it, or None to skip the member."""
    cache = getattr(request.config, "cache", None)
    target = cache.mkdir(name) if cache is not None else tmp_path_factory.mktemp(name)
    if not (target / "complete").exists():
        with tempfile.TemporaryDirectory() as tmp:
            got = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                                  "--quiet", "-d", tmp, LLAMA_CPP_SDIST], capture_output=True, text=True)
            if got.returncode:
                pytest.fail(f"could not download {LLAMA_CPP_SDIST} for {name}: {got.stderr[-2000:]}")
            with tarfile.open(next(Path(tmp).glob("*.tar.gz"))) as tar:
                for member in tar.getmembers():
                    inside = keep(member.name) if member.isfile() else None
                    if inside is None:
                        continue
                    out = target / inside
                    out.parent.mkdir(parents=True, exist_ok=True)
                    staged = out.with_name(out.name + ".tmp")
                    staged.write_bytes(tar.extractfile(member).read())
                    staged.replace(out)
        (target / "complete").touch()
    return target


@pytest.fixture(scope="session")
def real_templates(request, tmp_path_factory) -> Path:
    """llama.cpp's `models/templates/`: chat templates of real model repositories (Qwen3.5, Qwen3-Coder, Llama 3,
    ...), from the llama-cpp-python sdist (`llama_cpp_sdist`). `CLOVER_TEST_TEMPLATES` names a directory that
    already holds them."""
    if os.environ.get("CLOVER_TEST_TEMPLATES"):
        return Path(os.environ["CLOVER_TEST_TEMPLATES"])
    return llama_cpp_sdist(request, tmp_path_factory, "llama-cpp-templates", lambda member: Path(member).name if
                           "/models/templates/" in member and member.endswith(".jinja") else None)


@pytest.fixture(scope="session")
def qwen35_tokenizer(chat_tokenizer, real_templates):
    """The tests' chat tokenizer carrying Qwen3.5's real chat template (XML tool calls, `<think>` opened by
    default), as a Qwen3.5-family checkpoint converted by Clover keeps it."""
    tok = copy.deepcopy(chat_tokenizer)
    tok.chat_template = (real_templates / "Qwen3.5-4B.jinja").read_text(encoding="utf-8")
    return tok
