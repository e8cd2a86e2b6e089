"""`clover generate` and `clover chat` on a tiny checkpoint with a character tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from model_helpers import tiny_model


# -- the CLI ------------------------------------------------------------------------------------------------
def _char_tokenizer(directory: Path) -> None:
    """A 256-id character tokenizer (ids 0-252 are printable characters; 253 <eos>... 255 <mask>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(0x21, 0x7F)] + [chr(c) for c in range(0xA1, 0xA1 + 253 - 94)]
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({"<pad>": 253, "<eos>": 254, "<mask>": 255})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>",
                                   additional_special_tokens=["<mask>"])
    fast.chat_template = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
    fast.save_pretrained(str(directory))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ckpt")
    _char_tokenizer(root / "tok")
    tiny_model("clover-tiny").save_pretrained(root / "model", tokenizer_dir=root / "tok")
    return root / "model"


def test_cli_generate_json(checkpoint: Path, capsys) -> None:
    from clover.cli.main import main

    assert main(["generate", "hello", "--model", str(checkpoint), "--max-new-tokens", "9", "--json",
                 "--threshold", "0.5", "--block-size", "4", "--threads", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"text", "tokens", "forward_passes", "tokens_per_forward", "tokens_per_second"} <= set(out)
    assert out["tokens"] == len(out["token_ids"]) <= 9 and out["forward_passes"] >= 1
    assert main(["generate", "hello", "--model", str(checkpoint), "--max-new-tokens", "9",
                 "--threshold", "0.5", "--block-size", "4", "--chat", "--show-steps", "--seed", "1",
                 "--temperature", "0.7", "--rule", "no_adjacent_repeat"]) == 0
    assert "step" in capsys.readouterr().err


def test_cli_generate_repetition_options(checkpoint: Path, capsys) -> None:
    """DRY and the loop guard are on by default (docs/decoding.md "Repetition"); `--dry-multiplier 0 --loop-guard 0`
    gives the model's own tokens; the guard's cut reports finish_reason "repetition"; a bad value is an error."""
    from clover.cli.main import main
    from clover.engine.constraints.repetition import RepeatGuard

    def run(*flags: str) -> dict:
        assert main(["generate", "hello", "--model", str(checkpoint), "--max-new-tokens", "40", "--json",
                     "--block-size", "1", "--threads", "1", "--no-chat", *flags]) == 0
        return json.loads(capsys.readouterr().out)

    off = run("--dry-multiplier", "0", "--loop-guard", "0")
    strong = run("--dry-multiplier", "4", "--dry-allowed-length", "1", "--dry-sequence-breaker", "", "--loop-guard", "0")
    assert strong["token_ids"] != off["token_ids"]
    guard = RepeatGuard(2, 1)
    cut = next(i + 1 for i, t in enumerate(off["token_ids"]) if guard.feed(t))  # the tiny model repeats a pair
    guarded = run("--dry-multiplier", "0", "--loop-guard", "2", "--loop-guard-repeats", "1")
    assert guarded["token_ids"] == off["token_ids"][:cut] and guarded["finish_reason"] == "repetition"
    assert main(["generate", "hello", "--model", str(checkpoint), "--dry-base", "0.5", "--threads", "1"]) != 0
    assert "dry_base must be" in capsys.readouterr().err


def test_cli_generate_uses_the_chat_template_unless_told_not_to(checkpoint: Path, capsys) -> None:
    from clover.cli.main import main

    def prompt_tokens(*flags: str) -> int:
        assert main(["generate", "hello", "--model", str(checkpoint), "--max-new-tokens", "4", "--json",
                     "--threads", "1", *flags]) == 0
        return json.loads(capsys.readouterr().out)["prompt_tokens"]

    assert prompt_tokens() == prompt_tokens("--chat") > prompt_tokens("--no-chat") == len("hello")


def test_cli_chat_answers_each_turn(checkpoint: Path, capsys, monkeypatch) -> None:
    import io

    from clover.cli.main import main

    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n/reset\nagain\n/exit\nnever read\n"))
    assert main(["chat", "--model", str(checkpoint), "--max-new-tokens", "6", "--rule", "left_to_right",
                 "--dtype", "bfloat16", "--threads", "1"]) == 0
    captured = capsys.readouterr()
    assert captured.out.count("clover> ") == 2 and captured.err.count("tokens/forward") == 2


def test_cli_generate_streams_text_and_reports_a_missing_default_model(checkpoint: Path, capsys, monkeypatch) -> None:
    import io

    from clover.cli.main import main

    monkeypatch.setattr("sys.stdin", io.StringIO("from stdin"))
    assert main(["generate", "--model", str(checkpoint), "--max-new-tokens", "8", "--threshold", "1.0"]) == 0
    text = capsys.readouterr().out
    assert main(["generate", "from stdin", "--model", str(checkpoint), "--max-new-tokens", "8", "--threshold", "1.0",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == text.rstrip("\n")
    monkeypatch.setattr("clover.smol.ASSET_DIR", checkpoint / "no-such-adapter")  # the default model, unavailable
    assert main(["generate", "hi"]) == 2
    assert "clover-smol" in capsys.readouterr().err


def test_cli_generate_quantises_at_load(checkpoint: Path, capsys) -> None:
    """`--quant fp32` (packed weights, the kernel's path) writes what the reference path writes; a format the
    CLI does not know is refused by name."""
    from clover.cli.main import main

    args = ["generate", "hello", "--model", str(checkpoint), "--max-new-tokens", "9", "--json", "--block-size", "4",
            "--threads", "1"]
    outputs = []
    for quant in ("none", "fp32"):
        assert main([*args, "--quant", quant]) == 0
        outputs.append(json.loads(capsys.readouterr().out)["token_ids"])
    assert outputs[0] == outputs[1]
    with pytest.raises(SystemExit):
        main([*args, "--quant", "int3"])
    assert "invalid choice: 'int3'" in capsys.readouterr().err


def test_cli_default_model_at_int4_loads_its_quantised_build(checkpoint: Path, tmp_path, capsys, monkeypatch) -> None:
    """Without --model, `--quant int4` loads the default model's quantised build (clover.smol.clover_smol_dir)
    as it is stored (its adapter kept beside the base), not the merged checkpoint quantised at load."""
    from clover.cli.main import main
    from clover.model import quantize
    from clover.model.lora import LoraConfig, apply_lora

    model = tiny_model("clover-tiny")
    apply_lora(model, LoraConfig(rank=2, alpha=4.0))
    quantised = quantize(model, "int4")
    quantised.save_pretrained(tmp_path / "int4", tokenizer_dir=checkpoint)
    ranks = list(quantised.quantization["low_rank"].values())  # a fused projection's is the sum of its parts
    asked = []

    def clover_smol_dir(quant: str = "none") -> Path:
        asked.append(quant)
        return tmp_path / "int4" if quant == "int4" else checkpoint

    monkeypatch.setattr("clover.smol.clover_smol_dir", clover_smol_dir)
    args = ["generate", "hello", "--max-new-tokens", "6", "--json", "--threads", "1", "--quant", "int4"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert asked == ["int4"] and out["model"] == str(tmp_path / "int4")
    # the per-layer low-rank table, counted by rank
    assert ranks and out["quantization"]["low_rank"] == {
        "layers": len(ranks), "layers_by_rank": {str(r): ranks.count(r) for r in sorted(set(ranks))}}
    assert main([*args, "--model", str(tmp_path / "int4")]) == 0  # the same checkpoint named: the same answer
    assert json.loads(capsys.readouterr().out)["token_ids"] == out["token_ids"]


def test_cli_generate_json_schema(chat_tokenizer, tmp_path: Path, capsys) -> None:
    """`--json-schema FILE`: the answer is JSON valid against it (an enum and a boolean end within the limit)."""
    from clover.cli.main import main
    from server_helpers import build_checkpoint

    checkpoint = build_checkpoint(tmp_path / "model", chat_tokenizer, preset="clover-tiny")

    schema = {"type": "object", "properties": {"pick": {"enum": ["yes", "no"]}, "ok": {"type": "boolean"}},
              "required": ["pick", "ok"], "additionalProperties": False}
    (tmp_path / "s.json").write_text(json.dumps(schema))
    assert main(["generate", "hello", "--model", str(checkpoint), "--max-new-tokens", "40", "--json",
                 "--block-size", "4", "--threads", "1", "--json-schema", str(tmp_path / "s.json")]) == 0
    out = json.loads(capsys.readouterr().out)
    answer = json.loads(out["text"])
    assert answer["pick"] in ("yes", "no") and isinstance(answer["ok"], bool) and out["forced_tokens"] > 0
    (tmp_path / "bad.json").write_text(json.dumps({"type": "array", "uniqueItems": True}))
    assert main(["generate", "hello", "--model", str(checkpoint), "--json-schema", str(tmp_path / "bad.json")]) != 0
    assert "uniqueItems" in capsys.readouterr().err


def test_cli_thinking_token_budget(chat_tokenizer, tmp_path: Path, capsys) -> None:
    """`--think --thinking-token-budget N`: N reasoning tokens, then the template's closing text, then the answer
    (`generate` and `chat`); a negative budget is a usage error naming the option."""
    import io

    from clover.cli.main import main
    from clover.engine.constraints.thinking import thinking_budget
    from server_helpers import build_checkpoint

    checkpoint = build_checkpoint(tmp_path / "model", chat_tokenizer, preset="clover-tiny")
    closing = list(thinking_budget(3, chat_tokenizer).closing_ids)
    assert main(["generate", "hello", "--model", str(checkpoint), "--max-new-tokens", "12", "--json", "--think",
                 "--thinking-token-budget", "3", "--block-size", "4", "--threads", "1", "--rule", "threshold",
                 "--dry-multiplier", "0", "--loop-guard", "0"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"][3:3 + len(closing)] == closing and out["reasoning_tokens"] == 3
    assert out["text"].count("</think>") == 1
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("sys.stdin", io.StringIO("hello\n/exit\n"))
        assert main(["chat", "--model", str(checkpoint), "--max-new-tokens", "12", "--think",
                     "--thinking-token-budget", "0", "--threads", "1", "--no-stats"]) == 0
    assert capsys.readouterr().out.startswith("clover> \n</think>\n\n")
    with pytest.raises(SystemExit):
        main(["generate", "hello", "--model", str(checkpoint), "--thinking-token-budget", "-1"])
    assert "--thinking-token-budget: expected an integer >= 0" in capsys.readouterr().err
