"""A Qwen3 twin adapted end to end at tiny scale: `clover convert --from qwen3`, `clover train` (the BD3-LM recipe),
then exact mode decodes exactly what block size 1 decodes (docs/families.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from clover import CloverForBlockDiffusion
from clover.cli.main import main
from clover.training.checkpointing import latest_checkpoint
from clover.training.data import write_token_shards
from training_helpers import documents


@pytest.mark.slow
def test_qwen3_twin_adapted_by_the_recipe_decodes_in_exact_mode_as_block_size_one(tmp_path: Path) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=8, intermediate_size=64,
                                 tie_word_embeddings=True, eos_token_id=254)).save_pretrained(tmp_path / "qwen3")
    assert main(["convert", "--from", "qwen3", str(tmp_path / "qwen3"), str(tmp_path / "base")]) == 0
    docs = [(ids.tolist(), mask.int().tolist()) for ids, mask, _ in documents(32)]
    write_token_shards(docs, tmp_path / "shards", max_len=None)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"init": str(tmp_path / "base"), "train_data": str(tmp_path / "shards"),
                                   "output_dir": str(tmp_path / "run"), "batch_size": 4, "micro_batch_size": 4,
                                   "precision": "fp32", "block_size": 4, "lr": 3e-3, "warmup_steps": 1}))
    assert main(["train", str(cfg), "--max_steps", "6", "--progress", "false"]) == 0
    model = CloverForBlockDiffusion.from_pretrained(latest_checkpoint(tmp_path / "run"))
    assert model.config.family == "clover" and model.config.token_shift
    prompts = [[3, 17, 42, 99], [7, 7, 128]]
    exact = model.generate(prompts, max_new_tokens=24, block_size=4, rule="exact", eos_token_ids=[]).sequences
    ar = model.generate(prompts, max_new_tokens=24, block_size=1, eos_token_ids=[]).sequences
    assert exact == ar and all(len(s) == 24 for s in exact)
