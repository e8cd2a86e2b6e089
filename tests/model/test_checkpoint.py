"""Checkpoint directories: round trip, sharding, strict loading, atomic writes, tokenizer files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import clover.checkpoint as ckpt
from clover import CloverConfig, CloverForBlockDiffusion
from clover.checkpoint import load_state_dict_strict, save_checkpoint
from clover.tokenizer import load_tokenizer


def tiny(preset: str = "clover-tiny", seed: int = 0) -> CloverForBlockDiffusion:
    torch.manual_seed(seed)
    return CloverForBlockDiffusion(CloverConfig.from_preset(preset)).eval()


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("preset", ["clover-tiny", "clover-tiny-dense"])
def test_save_then_load_round_trips_weights_and_logits(tmp_path: Path, preset: str) -> None:
    model = tiny(preset)
    model.save_pretrained(tmp_path / "ck")
    loaded = CloverForBlockDiffusion.from_pretrained(tmp_path / "ck")
    assert_same_weights(model, loaded)
    ids = torch.randint(0, 200, (1, 9))
    with torch.no_grad():
        # weights are bit-equal (above); kernels may sum in another order on differently aligned memory
        torch.testing.assert_close(model(ids).logits, loaded(ids).logits, rtol=0, atol=1e-6)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors"]


def test_tied_head_is_not_stored(tmp_path: Path) -> None:
    model = tiny("clover-tiny-dense")
    save_checkpoint(model, tmp_path / "ck")
    stored = load_file(tmp_path / "ck" / "model.safetensors")
    assert "lm_head.weight" not in stored and "model.embed_tokens.weight" in stored
    loaded = CloverForBlockDiffusion.from_pretrained(tmp_path / "ck")
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()


def test_generation_config_carries_token_ids_and_decoding_defaults(tmp_path: Path) -> None:
    save_checkpoint(tiny(), tmp_path / "ck")
    gen = json.loads((tmp_path / "ck" / "generation_config.json").read_text())
    config = CloverConfig.from_preset("clover-tiny")
    assert gen == {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id,
                   "pad_token_id": config.pad_token_id, "mask_token_id": config.mask_token_id,
                   "block_size": config.block_size, "threshold": config.threshold}


def test_large_checkpoints_are_sharded_with_an_index(tmp_path: Path) -> None:
    model = tiny()
    save_checkpoint(model, tmp_path / "ck", max_shard_bytes=64 * 1024)
    index = json.loads((tmp_path / "ck" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert not (tmp_path / "ck" / "model.safetensors").exists()
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert_same_weights(model, CloverForBlockDiffusion.from_pretrained(tmp_path / "ck"))


def _edit_file(directory: Path, edit) -> None:
    path = directory / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    save_checkpoint(tiny(), tmp_path / "ck")
    _edit_file(tmp_path / "ck", lambda t: t.pop("model.layers.1.linear_attn.A_log"))
    with pytest.raises(ValueError, match=r"missing tensors: 'model\.layers\.1\.linear_attn\.A_log'"):
        CloverForBlockDiffusion.from_pretrained(tmp_path / "ck")


def test_misshaped_tensor_is_named_with_both_shapes(tmp_path: Path) -> None:
    save_checkpoint(tiny(), tmp_path / "ck")
    name = "model.layers.3.self_attn.k_proj.weight"
    _edit_file(tmp_path / "ck", lambda t: t.__setitem__(name, torch.zeros(16, 64)))
    with pytest.raises(ValueError, match=rf"'{name}' has shape \[16, 64\], expected \[32, 64\]"):
        CloverForBlockDiffusion.from_pretrained(tmp_path / "ck")


def test_unexpected_tensor_is_named(tmp_path: Path) -> None:
    save_checkpoint(tiny(), tmp_path / "ck")
    _edit_file(tmp_path / "ck", lambda t: t.__setitem__("model.layers.0.bogus", torch.zeros(2)))
    with pytest.raises(ValueError, match=r"unexpected tensors: 'model\.layers\.0\.bogus'"):
        CloverForBlockDiffusion.from_pretrained(tmp_path / "ck")


def test_strict_load_touches_nothing_when_it_fails(tmp_path: Path) -> None:
    save_checkpoint(tiny(seed=1), tmp_path / "ck")
    _edit_file(tmp_path / "ck", lambda t: t.pop("model.norm.weight"))
    model = tiny(seed=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError):
        load_state_dict_strict(model, tmp_path / "ck")
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


class Boom(RuntimeError):
    pass


def _failing_save_file(monkeypatch: pytest.MonkeyPatch, after: int) -> None:
    calls = {"n": 0}
    real = ckpt.save_file

    def save_file(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > after:
            raise Boom("simulated crash while writing a shard")
        return real(*args, **kwargs)

    monkeypatch.setattr(ckpt, "save_file", save_file)


def test_interrupted_save_leaves_no_partial_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _failing_save_file(monkeypatch, after=1)  # the first shard is written, the second one crashes
    with pytest.raises(Boom):
        save_checkpoint(tiny(), tmp_path / "ck", max_shard_bytes=64 * 1024)
    assert not (tmp_path / "ck").exists()
    assert leftovers(tmp_path) == []


def test_interrupted_overwrite_keeps_the_old_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old = tiny(seed=1)
    save_checkpoint(old, tmp_path / "ck")
    _failing_save_file(monkeypatch, after=0)
    with pytest.raises(Boom):
        save_checkpoint(tiny(seed=2), tmp_path / "ck")
    assert leftovers(tmp_path) == []
    monkeypatch.undo()
    assert_same_weights(old, CloverForBlockDiffusion.from_pretrained(tmp_path / "ck"))


def test_overwrite_replaces_a_checkpoint_but_never_an_unrelated_directory(tmp_path: Path) -> None:
    save_checkpoint(tiny(seed=1), tmp_path / "ck")
    new = tiny(seed=2)
    save_checkpoint(new, tmp_path / "ck")
    assert_same_weights(new, CloverForBlockDiffusion.from_pretrained(tmp_path / "ck"))
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a checkpoint directory"):
        save_checkpoint(new, tmp_path / "notes")
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"


def _tiny_tokenizer_dir(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(20)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<eos>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    fast.save_pretrained(str(path))
    return path


def test_tokenizer_files_are_copied_and_load(tmp_path: Path) -> None:
    tokdir = _tiny_tokenizer_dir(tmp_path / "tok")
    tiny().save_pretrained(tmp_path / "ck", tokenizer_dir=tokdir)
    tok = load_tokenizer(tmp_path / "ck")
    assert tok("w3 w7").input_ids == [5, 9]
    assert tok.apply_chat_template([{"role": "user", "content": "w1"}], tokenize=False) == "w1"


def test_load_tokenizer_without_files_says_so(tmp_path: Path) -> None:
    save_checkpoint(tiny(), tmp_path / "ck")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(tmp_path / "ck")
