"""`--runner llamacpp` on `clover generate`, `clover decide` and `clover serve`: a GGUF from `clover export --to
gguf` decodes (and fills forms) through the llama.cpp runner, and what it cannot do is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from server_helpers import checkpoint_and_gguf, server_thread

from clover import CloverForBlockDiffusion
from clover.chat_template import render_chat
from clover.cli.main import main
from clover.engine import generate
from clover.engine.loops.decision import decide
from clover.runners.llamacpp import LlamaCppRunner
from clover.serving import ServerOptions, create_app

PROMPT = "Hello world. What is the weather?"
FORM = {"type": "object", "properties": {"category": {"enum": ["billing", "bug", "weather report"]},
                                         "urgent": {"type": "boolean"}, "note": {"type": "string", "maxLength": 4}}}


pytestmark = pytest.mark.usefixtures("temp_clover_cache")  # the GGUF's converted tokenizer is cached there


@pytest.fixture(scope="module")
def exported(tmp_path_factory, chat_tokenizer) -> tuple[Path, Path]:
    return checkpoint_and_gguf(tmp_path_factory.mktemp("runner-cli"), chat_tokenizer, 256)


def _generate(capsys, *args: str) -> dict:
    """`clover generate` without its repetition defaults (DRY, the loop guard): the plain decoding compared here."""
    assert main(["generate", "--no-chat", "--json", "--threads", "1", "--max-new-tokens", "12", "--dry-multiplier",
                 "0", "--loop-guard", "0", *args, PROMPT]) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_with_the_llamacpp_runner(exported, chat_tokenizer, capsys):
    checkpoint, gguf = exported
    out = _generate(capsys, "--runner", "llamacpp", "--model", str(gguf))
    assert out["runner"] == "llamacpp" and out["model"] == str(gguf) and out["block_size"] == 4
    ids = chat_tokenizer(PROMPT)["input_ids"]
    runner = LlamaCppRunner(gguf, threads=1, max_rows=1)  # the CLI's runner: f16 KV, one row
    want = generate(runner, [ids], 12, eos_token_ids=[chat_tokenizer.eos_token_id],
                    vocab_limit=len(chat_tokenizer)).sequences[0]
    assert out["token_ids"] == want
    assert _generate(capsys, "--model", str(checkpoint))["runner"] == "torch"  # --runner auto, by what --model names
    assert _generate(capsys, "--model", str(gguf))["token_ids"] == want  # ... a GGUF file: the llama.cpp runner


def test_decide_with_the_llamacpp_runner(exported, chat_tokenizer, capsys, tmp_path):
    """`clover decide --runner llamacpp` fills the form as decision mode does on the same runner (the CLI's: f16
    KV, one row); decisions equal the torch runner's at f32 KV (tests/engine/test_llamacpp_runner.py)."""
    _, gguf = exported
    schema = tmp_path / "form.json"
    schema.write_text(json.dumps(FORM))
    assert main(["decide", "--runner", "llamacpp", "--model", str(gguf), "--threads", "1", "--schema", str(schema),
                 PROMPT]) == 0
    out = json.loads(capsys.readouterr().out)
    want = decide(LlamaCppRunner(gguf, threads=1, max_rows=1), chat_tokenizer, PROMPT, FORM)
    assert (out["values"], out["forward_passes"], out["order"]) == (want.values, want.forward_passes, want.order)


@pytest.mark.parametrize("args, message", [
    (["--runner", "llamacpp", "--model", "{checkpoint}"], "takes a GGUF file.*clover export --to gguf"),
    (["--runner", "llamacpp", "--model", "{gguf}", "--dtype", "bfloat16"], "--dtype.*GGUF's weight types"),
    (["--runner", "llamacpp", "--model", "{checkpoint}/config.json"], "a file that is not a GGUF file"),
    (["--runner", "llamacpp", "--model", "{checkpoint}/missing.gguf"], "no such file or directory"),
])
def test_runner_misuse_is_a_clear_error(exported, capsys, args, message):
    import re

    checkpoint, gguf = exported
    args = [a.format(checkpoint=checkpoint, gguf=gguf) for a in args]
    assert main(["generate", "--no-chat", *args, PROMPT]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_server_on_the_llamacpp_runner(exported, chat_tokenizer):
    """Chat completions and structured outputs (`response_format`, decided in the scheduler) through the server
    equal the engine's and decision mode's output on the same runner."""
    _, gguf = exported
    runner = LlamaCppRunner(gguf, threads=1, max_rows=4)
    app = create_app(runner, chat_tokenizer, ServerOptions(served_model_name="tiny", max_running=4))
    messages = [{"role": "user", "content": PROMPT}]
    ids = chat_tokenizer(render_chat(chat_tokenizer, messages, add_generation_prompt=True),
                         add_special_tokens=False)["input_ids"]
    with server_thread(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16)
        want = generate(runner, [ids], 16, eos_token_ids=[chat_tokenizer.eos_token_id],
                        vocab_limit=len(chat_tokenizer)).sequences[0]
        assert reply.choices[0].message.content == chat_tokenizer.decode(want, skip_special_tokens=True).strip()
        assert reply.usage.completion_tokens == len(want)
        reply = client.chat.completions.create(model="tiny", messages=messages, response_format={
            "type": "json_schema", "json_schema": {"name": "f", "schema": FORM}})
        want = decide(runner, chat_tokenizer, messages, FORM)
        assert json.loads(reply.choices[0].message.content) == want.values
        assert reply.model_extra["decision"]["forward_passes"] == want.forward_passes
        assert sorted(runner._free) == list(range(runner.max_rows))  # the decision gave its row back


def test_scheduler_refuses_more_rows_than_the_runner_holds(exported, chat_tokenizer):
    _, gguf = exported
    runner = LlamaCppRunner(gguf, threads=1, max_rows=2)
    with pytest.raises(ValueError, match="max_running=4 exceeds the llamacpp runner's 2 rows"):
        create_app(runner, chat_tokenizer, ServerOptions(max_running=4))


def test_the_exported_gguf_runs_ar_in_plain_llama_cpp(exported):
    """llama.cpp's plain generation (one causal sequence, greedy) of the export equals Clover's block-size-1
    decoding."""
    from clover.runners.llamacpp_ar import LlamaCppAR

    checkpoint, gguf = exported
    model = CloverForBlockDiffusion.from_pretrained(checkpoint)
    prompt = [5, 17, 3, 99, 42, 7, 11]
    want = generate(model, [prompt], 12, block_size=1, eos_token_ids=[]).sequences[0]
    got = list(LlamaCppAR(gguf, threads=1, n_ctx=128, n_batch=4).generate(prompt, len(want)))  # 2 prompt chunks
    assert got == want


def test_a_gated_model_exports_its_causal_path_and_decodes_its_own_answer_on_llamacpp(exported, tmp_path, capsys):
    """`clover export` refuses a gated adapter by naming --drop-gated-adapter; with it, the GGUF is the causal path,
    on which exact mode gives what block size 1 gives, and block size 1 what the gated model gives on torch."""
    from clover.model.lora import LoraConfig, apply_lora

    checkpoint, _ = exported
    model = CloverForBlockDiffusion.from_pretrained(checkpoint)
    apply_lora(model, LoraConfig(rank=2, gated=True, extra_trainable=[]))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0.0, 0.2)
    model.save_pretrained(tmp_path / "gated", tokenizer_dir=checkpoint)
    gguf = tmp_path / "gated.gguf"
    assert main(["export", str(tmp_path / "gated"), str(gguf), "--quant", "f32"]) == 2
    assert "--drop-gated-adapter" in capsys.readouterr().err and not gguf.exists()
    assert main(["export", str(tmp_path / "gated"), str(gguf), "--quant", "f32", "--drop-gated-adapter"]) == 0
    capsys.readouterr()
    torch_b1 = _generate(capsys, "--model", str(tmp_path / "gated"), "--block-size", "1")
    llama_b1 = _generate(capsys, "--runner", "llamacpp", "--model", str(gguf), "--block-size", "1")
    llama_exact = _generate(capsys, "--runner", "llamacpp", "--model", str(gguf), "--rule", "exact")
    assert llama_exact["token_ids"] == llama_b1["token_ids"] == torch_b1["token_ids"]
