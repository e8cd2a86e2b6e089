"""The trainer: config keys, exact resume, atomic checkpoints, time budget, LoRA, accumulation, CLI and plot."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml

from clover import CloverConfig, CloverForBlockDiffusion
from clover.cli.main import main
from clover.model import lora as lora_mod
from clover.training import checkpointing
from clover.training.checkpointing import latest_checkpoint
from clover.training.config import LoraConfig, TrainConfig, config_from_dict, load_train_config, parse_overrides
from clover.training import trainer as trainer_mod
from clover.training.trainer import Trainer, train
from training_helpers import documents


def config(tmp_path: Path, **overrides) -> TrainConfig:
    base = dict(init="clover-tiny-dense", output_dir=str(tmp_path / "run"), max_steps=6, batch_size=4,
                micro_batch_size=2, lr=1e-3, warmup_steps=2, precision="fp32", progress=False, ar_weight=0.5)
    return config_from_dict({**base, **overrides})


# -- config ------------------------------------------------------------------------------------------------
def test_unknown_config_keys_are_errors_naming_them(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("lr: 1.0e-4\nlearning_rate: 3\n")
    with pytest.raises(ValueError, match="'learning_rate'"):
        load_train_config(path)
    path.write_text("noise: {t_mim: 0.1}\n")
    with pytest.raises(ValueError, match="'noise.t_mim'"):
        load_train_config(path)
    path.write_text("lr: 1.0e-4\n")
    with pytest.raises(ValueError, match="'lora.rnak'"):
        load_train_config(path, ["--lora.rnak", "8"])
    with pytest.raises(ValueError, match="max_steps: input should be a valid integer"):
        load_train_config(path, ["--max_steps", "many"])
    with pytest.raises(ValueError, match="noise.weighting must be one of"):
        load_train_config(path, ["--noise.weighting", "elbo"])



def test_draft_objective_settings_are_checked(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("lr: 1.0e-4\n")
    for args, message in ((["--noise.full_mask_prob", "2"], "noise.full_mask_prob"),
                          (["--noise.position_decay", "0"], "noise.position_decay"),
                          (["--ce_weight", "-1"], "ce_weight must be >= 0"),
                          (["--ce_weight", "0"], "nothing trains"),
                          (["--draft_kl_weight", "1"], "lora.gated")):
        with pytest.raises(ValueError, match=message):
            load_train_config(path, args)
    cfg = load_train_config(path, ["--ce_weight", "0", "--draft_kl_weight", "1", "--lora.rank", "4",
                                   "--lora.gated", "true"])
    assert cfg.ce_weight == 0 and cfg.draft_kl_weight == 1

def test_every_key_is_settable_from_the_command_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("lr: 1.0e-4\nnoise: {t_min: 0.2}\n")
    cfg = load_train_config(path, ["--lr", "3e-4", "--noise.t_max=0.8", "--lora.targets", "q_proj,v_proj",
                                   "--block_curriculum", "[[0, 2], [10, 4]]", "--model_overrides.hidden_size", "96",
                                   "--gradient-checkpointing", "true"])
    assert cfg.lr == 3e-4 and cfg.noise.t_min == 0.2 and cfg.noise.t_max == 0.8
    assert cfg.lora.targets == ["q_proj", "v_proj"] and cfg.model_overrides == {"hidden_size": 96}
    assert cfg.gradient_checkpointing is True
    assert [cfg.block_size_at(s) for s in (0, 9, 10, 100)] == [2, 2, 4, 4]
    assert parse_overrides(["--a.b", "1"]) == {"a": {"b": 1}}
    again = config_from_dict(yaml.safe_load(cfg.to_yaml()))  # the resolved config round-trips
    assert again == cfg


def test_lr_warms_up_linearly_then_decays_by_cosine_to_its_floor():
    cfg = TrainConfig(lr=1.0, warmup_steps=4, max_steps=12, min_lr_ratio=0.1)
    assert [cfg.lr_at(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert cfg.lr_at(4) == 1.0 and cfg.lr_at(8) == pytest.approx(0.55)  # half-way through the cosine
    assert cfg.lr_at(12) == pytest.approx(0.1) and cfg.lr_at(50) == pytest.approx(0.1)


# -- training ----------------------------------------------------------------------------------------------
def test_killed_and_resumed_run_has_the_same_loss_curve(tmp_path):
    docs = documents()
    full = train(config(tmp_path / "a", max_steps=6, eval_every=3), train_documents=docs, eval_documents=docs[:8])
    first = train(config(tmp_path / "b", max_steps=3), train_documents=docs)
    assert latest_checkpoint(tmp_path / "b" / "run").name == "step-00000003"
    second = train(config(tmp_path / "b", max_steps=6), train_documents=docs)  # resume="auto"
    resumed = first.losses + second.losses
    assert len(resumed) == 6 and second.step == 6
    assert max(abs(a - b) for a, b in zip(full.losses, resumed)) < 1e-6
    log = [json.loads(line) for line in (tmp_path / "b" / "run" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5, 6]
    for key in ("step", "loss", "lr", "tokens", "tokens_per_s", "grad_norm", "ar_loss", "diffusion_loss"):
        assert key in log[-1]
    cpu = [r["cpu_hours"] for r in log]  # counted across the resume, never restarting from 0
    assert cpu[0] > 0 and all(b > a for a, b in zip(cpu, cpu[1:]))
    full_log = [json.loads(x) for x in (tmp_path / "a" / "run" / "train_log.jsonl").read_text().splitlines()]
    assert "eval_loss" in full_log[2] and "eval_loss" in full_log[5]


def test_gradient_accumulation_equals_one_big_batch(tmp_path):
    docs = documents()
    one = train(config(tmp_path / "one", max_steps=3, micro_batch_size=4), train_documents=docs)
    for micro in (1, 2):  # 2: documents grouped by shape into micro-batches
        acc = train(config(tmp_path / f"acc{micro}", max_steps=3, micro_batch_size=micro), train_documents=docs)
        assert max(abs(a - b) for a, b in zip(one.losses, acc.losses)) < 1e-5


def test_failed_save_leaves_latest_on_the_previous_complete_checkpoint(tmp_path, monkeypatch):
    docs = documents()
    trainer = Trainer(config(tmp_path, max_steps=2, save_every=1), train_documents=docs)
    real = checkpointing._write_tensors
    calls = {"n": 0}

    def flaky(tensors, path):
        calls["n"] += 1
        if calls["n"] >= 2:  # from the second checkpoint's optimizer state on, the disk is full
            real(tensors, path)  # half a file gets written...
            raise OSError(28, "No space left on device")
        real(tensors, path)

    monkeypatch.setattr(checkpointing, "_write_tensors", flaky)
    monkeypatch.setattr(trainer_mod, "SAVE_RETRY_DELAYS", (0.0, 0.0))
    with pytest.raises(RuntimeError, match="still points to the previous complete checkpoint"):
        trainer.train()  # the save at step 2 fails, is tried twice more, and the third failure is raised
    assert calls["n"] == 4  # step 1's save, then three tries of step 2's
    root = tmp_path / "run" / "checkpoints"
    assert (root / "latest").read_text().strip() == "step-00000001"
    assert latest_checkpoint(tmp_path / "run").name == "step-00000001"
    assert not (root / "step-00000002").exists()
    assert not [p.name for p in root.iterdir() if p.name.startswith(".")]  # the temporary directory is cleaned up
    model = CloverForBlockDiffusion.from_pretrained(root / "step-00000001")  # and the latest one loads
    assert model.config.vocab_size == 256


def test_a_save_that_keeps_failing_stops_training_after_its_retries(tmp_path, monkeypatch):
    """A periodic save that fails once is tried again and training goes on; one that fails every try stops the
    run at that step (it would otherwise train on with nothing to resume from)."""
    docs = documents()
    real = checkpointing._write_tensors
    failures = {"left": 1}

    def flaky(tensors, path):
        if failures["left"]:
            failures["left"] -= 1
            raise OSError(5, "Input/output error")
        real(tensors, path)

    monkeypatch.setattr(checkpointing, "_write_tensors", flaky)
    monkeypatch.setattr(trainer_mod, "SAVE_RETRY_DELAYS", (0.0, 0.0))
    result = train(config(tmp_path / "once", max_steps=2, save_every=1), train_documents=docs)
    assert result.step == 2 and latest_checkpoint(tmp_path / "once" / "run").name == "step-00000002"

    failures["left"] = 3  # every try of the first save
    with pytest.raises(RuntimeError, match="checkpoint at step 1 failed"):
        train(config(tmp_path / "always", max_steps=4, save_every=1), train_documents=docs)
    log = (tmp_path / "always" / "run" / "train_log.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in log] == [1]  # no step trained after the failed save
    assert latest_checkpoint(tmp_path / "always" / "run") is None


def test_a_save_killed_before_latest_moves_leaves_no_temporaries_after_the_resume(tmp_path, monkeypatch):
    """A kill between renaming the step directory and replacing `latest` (simulated: `os.replace` onto `latest`
    never returns; under `kill -9` it also leaves `.latest.tmp-*`, planted here); temporaries of every kind a save
    writes are gone once the run resumes, and it resumes from the complete checkpoint `latest` still names."""
    docs = documents()
    real_replace = os.replace

    def killed(src, dst):
        if Path(dst).name == "latest" and Path(src).read_text().strip() == "step-00000002":
            raise KeyboardInterrupt  # a BaseException: no `except Exception` cleans up, as after SIGKILL
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        train(config(tmp_path, max_steps=2, save_every=1), train_documents=docs)
    monkeypatch.setattr(os, "replace", real_replace)
    root = tmp_path / "run" / "checkpoints"
    assert (root / "step-00000002").is_dir()
    (root / ".latest.tmp-0badc0de").write_text("step-00000002\n")  # what the kill itself would have left
    assert latest_checkpoint(tmp_path / "run").name == "step-00000001"
    # what kills at the other points of a save leave (a directory being written, replaced, or written inside)
    for name in (".tmp-step-00000003-0badc0de", ".old-step-00000002-0badc0de",
                 "..tmp-step-00000003-0badc0de.tmp-feedf00d", "..tmp-step-00000003-0badc0de.old-feedf00d"):
        (root / name / "trainer").mkdir(parents=True)
        (root / name / "trainer" / "state.json").write_text("{}")
    result = train(config(tmp_path, max_steps=3, save_every=1), train_documents=docs)
    assert result.step == 3 and len(result.losses) == 2  # resumed at step 1
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000002", "step-00000003"]  # keep 2
    assert latest_checkpoint(tmp_path / "run").name == "step-00000003"


def test_stale_temporaries_of_this_and_the_previous_save_layout_are_removed(tmp_path):
    root = tmp_path / "checkpoints"
    kept = ["latest", "step-00000001", "step-00000002"]
    stale = [".step-00000003.tmp-0badc0de", ".step-00000002.old-0badc0de",  # atomic_directory's
             ".tmp-step-00000003-0badc0de", ".old-step-00000002-0badc0de"]  # the trainer's own, before it
    for name in kept[1:] + stale:
        (root / name / "trainer").mkdir(parents=True)
    (root / "latest").write_text("step-00000002\n")
    (root / ".latest.tmp-0badc0de").write_text("step-00000003\n")  # a file, from the pointer's replacement
    removed = checkpointing.remove_stale_temporaries(root)
    assert sorted(p.name for p in removed) == sorted(stale + [".latest.tmp-0badc0de"])
    assert sorted(p.name for p in root.iterdir()) == kept


def test_time_budget_stops_cleanly_with_a_checkpoint_and_resumes(tmp_path):
    docs = documents()
    result = train(config(tmp_path, max_steps=50, max_minutes=1e-6), train_documents=docs)
    assert result.stopped_early and result.step == 1
    assert latest_checkpoint(tmp_path / "run").name == "step-00000001"
    rest = train(config(tmp_path, max_steps=3), train_documents=docs)
    assert rest.step == 3 and not rest.stopped_early and len(rest.losses) == 2


def test_cpu_budget_counts_across_sessions(tmp_path):
    docs = documents()
    first = train(config(tmp_path, max_steps=4), train_documents=docs)
    spent = json.loads((latest_checkpoint(tmp_path / "run") / "trainer" / "state.json").read_text())["cpu_s"]
    # a budget already spent by the first session: the resumed run trains nothing and leaves the checkpoint as it was
    more = train(config(tmp_path, max_steps=50, max_cpu_hours=spent / 3600), train_documents=docs)
    assert first.step == 4 and more.stopped_early and more.step == 4 and not more.losses
    assert latest_checkpoint(tmp_path / "run").name == "step-00000004"
    # room for more steps: the run takes them, then stops at the budget
    again = train(config(tmp_path, max_steps=50, max_cpu_hours=spent * 1.5 / 3600), train_documents=docs)
    assert again.stopped_early and 4 < again.step < 50


def test_bf16_autocast_and_block_curriculum_train(tmp_path):
    docs = documents()
    result = train(config(tmp_path, init="clover-tiny", max_steps=3, precision="bf16",
                          block_curriculum=[[0, 2], [2, 4]], gradient_checkpointing=True), train_documents=docs)
    log = [json.loads(x) for x in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert [r["block_size"] for r in log] == [2, 2, 4]
    assert all(torch.isfinite(torch.tensor(x)) for x in result.losses)


@pytest.mark.parametrize("native", [True, False])
def test_auto_precision_takes_bf16_only_where_the_cpu_multiplies_it_natively(tmp_path, monkeypatch, native):
    from clover.training import trainer as trainer_mod

    monkeypatch.setattr(trainer_mod, "native_bf16", lambda device_type: native)
    trainer = Trainer(config(tmp_path, precision="auto", max_steps=1), train_documents=documents())
    assert trainer.bf16 is native
    with trainer._autocast():
        assert torch.is_autocast_enabled("cpu") is native


def test_native_bf16_reads_the_cpu_flags(monkeypatch, tmp_path):
    from clover.training import config as config_mod

    flags = tmp_path / "cpuinfo"
    real_open = open

    def fake_open(path, *args, **kwargs):
        return real_open(flags if path == "/proc/cpuinfo" else path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", fake_open)
    flags.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 fma\n")
    assert not config_mod.native_bf16("cpu")
    flags.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n")
    assert config_mod.native_bf16("cpu")
    assert config_mod.native_bf16("cuda") and not config_mod.native_bf16("mps")


# -- LoRA --------------------------------------------------------------------------------------------------
def test_lora_trains_only_adapters_and_saves_only_them(tmp_path):
    docs = documents()
    cfg = config(tmp_path, init="clover-tiny", max_steps=3, lr=1e-2, kl_weight=0.1,
                 lora={"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj", "in_proj_qkv", "out_proj"]})
    trainer = Trainer(cfg, train_documents=docs)
    base = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    trainer.train()
    for name, param in trainer.model.named_parameters():
        if name in base:
            assert torch.equal(param, base[name]), name  # frozen weights untouched
    ckpt = latest_checkpoint(tmp_path / "run")
    stored = set(json.loads((ckpt / "adapter_config.json").read_text())["tensors"])
    assert stored == {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert any("row_delta" in n for n in stored) and any("conv1d_right" in n for n in stored)
    assert not (ckpt / "model.safetensors").exists()
    row = trainer.model.model.embed_tokens.row_delta
    assert row.abs().sum() > 0  # the [MASK] embedding learned something


def test_a_committed_milestone_resumes_the_run_on_a_fresh_machine(tmp_path):
    """Milestone (adapter + bf16 moments + log) -> a fresh output_dir resumes from it and follows the
    uninterrupted run within the moments' rounding."""
    docs = documents()
    lora = {"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj", "in_proj_qkv", "out_proj"]}
    full = train(config(tmp_path / "a", init="clover-tiny", max_steps=6, lora=lora), train_documents=docs)
    train(config(tmp_path / "b", init="clover-tiny", max_steps=3, lora=lora), train_documents=docs)
    ckpt = latest_checkpoint(tmp_path / "b" / "run")
    counters = checkpointing.save_milestone(ckpt, tmp_path / "milestone", log=tmp_path / "b" / "run" / "train_log.jsonl")
    assert counters["step"] == 3 and counters["cpu_s"] > 0
    moments = tmp_path / "milestone" / "trainer" / "optimizer.safetensors"
    assert moments.stat().st_size < 0.6 * (ckpt / "trainer" / "optimizer.safetensors").stat().st_size

    fresh = tmp_path / "c" / "run"
    assert checkpointing.restore_milestone(tmp_path / "milestone", fresh) == 3
    assert checkpointing.restore_milestone(tmp_path / "milestone", fresh) is None  # not over a checkpoint as new
    resumed = train(config(tmp_path / "c", init="clover-tiny", max_steps=6, lora=lora), train_documents=docs)
    assert resumed.step == 6
    assert max(abs(a - b) for a, b in zip(full.losses[3:], resumed.losses)) < 1e-2
    log = [json.loads(line) for line in (fresh / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5, 6] and log[3]["cpu_hours"] > log[2]["cpu_hours"]


def test_a_milestone_refuses_a_full_model_run(tmp_path):
    train(config(tmp_path, max_steps=1), train_documents=documents())
    with pytest.raises(ValueError, match="LoRA runs only"):
        checkpointing.save_milestone(latest_checkpoint(tmp_path / "run"), tmp_path / "milestone")
    assert not (tmp_path / "milestone").exists()


def test_lora_merge_unmerge_and_export(tmp_path):
    torch.manual_seed(0)
    model = CloverForBlockDiffusion(CloverConfig.from_preset("clover-tiny")).eval()
    ids = torch.randint(0, 250, (2, 9))
    before = model(ids, 4, prefix_len=1).logits
    lora_mod.apply_lora(model, LoraConfig(rank=4, alpha=8))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name or "row_delta" in name:
                param.normal_(0, 0.05)
        ids[0, 3] = 255  # a [MASK] token, so the row delta matters
        adapted = model(ids, 4, prefix_len=1).logits
        with lora_mod.adapters_disabled(model):
            assert torch.allclose(model(ids, 4, prefix_len=1).logits[1], before[1], atol=1e-5)
        lora_mod.merge_lora(model)
        assert torch.allclose(model(ids, 4, prefix_len=1).logits, adapted, atol=1e-5)
        lora_mod.unmerge_lora(model)
        assert torch.allclose(model(ids, 4, prefix_len=1).logits, adapted, atol=1e-5)
        lora_mod.save_adapter(model, tmp_path / "adapter", LoraConfig(rank=4, alpha=8), base="clover-tiny")
        fresh = CloverForBlockDiffusion(CloverConfig.from_preset("clover-tiny")).eval()
        fresh.load_state_dict({k: v for k, v in model.state_dict().items()
                               if "lora_" not in k and "row_delta" not in k})
        lora_mod.load_adapter(fresh, tmp_path / "adapter")
        assert torch.allclose(fresh(ids, 4, prefix_len=1).logits, adapted, atol=1e-5)
        lora_mod.merge_and_unload(model)
        model.save_pretrained(tmp_path / "merged")
        merged = CloverForBlockDiffusion.from_pretrained(tmp_path / "merged")
        assert torch.allclose(merged(ids, 4, prefix_len=1).logits, adapted, atol=1e-5)
    with pytest.raises(ValueError, match="match no nn.Linear"):
        lora_mod.apply_lora(CloverForBlockDiffusion(CloverConfig.from_preset("clover-tiny")),
                            LoraConfig(rank=2, targets=["nope"]))



def test_gated_lora_training_keeps_the_causal_path_the_base_and_resumes_gated(tmp_path):
    docs = documents()
    cfg = config(tmp_path, max_steps=3, lr=1e-2, confidence_weight=0.1, pad_target="eos", draft_kl_weight=0.5,
                 noise={"full_mask_prob": 0.5, "position_decay": 0.8},
                 lora={"rank": 4, "alpha": 8, "gated": True, "extra_trainable": []})
    trainer = Trainer(cfg, train_documents=docs)
    assert trainer.model.config.context_reading == "causal"
    trainer.train()
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert all(entry["draft_kl"] > 0 for entry in log if "draft_kl" in entry) and any("draft_kl" in e for e in log)
    ckpt = latest_checkpoint(tmp_path / "run")
    assert json.loads((ckpt / "adapter_config.json").read_text())["lora"]["gated"] is True
    fresh = CloverForBlockDiffusion(CloverConfig.from_preset("clover-tiny-dense")).eval()
    adapter = lora_mod.adapter_tensor_names(trainer.model)
    fresh.load_state_dict({k: v for k, v in trainer.model.state_dict().items() if k not in adapter})
    lora_mod.load_adapter(fresh, ckpt)  # the adapter directory alone restores the gating
    ids = torch.randint(0, 250, (2, 9))
    with torch.no_grad():
        with lora_mod.adapters_disabled(trainer.model):
            base = trainer.model(ids, 1).logits
        assert torch.equal(trainer.model(ids, 1).logits, base)  # trained, yet the causal path is the base
        query = torch.full((2, 4), 255)
        trained = trainer.model(ids, 4, prefix_len=2, query_ids=query).query_logits
        assert torch.equal(fresh(ids, 4, prefix_len=2, query_ids=query).query_logits, trained)
        with lora_mod.adapters_disabled(trainer.model):
            assert not torch.allclose(trainer.model(ids, 4, prefix_len=2, query_ids=query).query_logits, trained)


# -- CLI ---------------------------------------------------------------------------------------------------
def test_cli_train_on_token_shards_then_plot(tmp_path, capsys):
    from clover.training.data import write_token_shards

    docs = [(ids.tolist(), mask.int().tolist()) for ids, mask, _ in documents(16)]
    write_token_shards(docs, tmp_path / "shards", max_len=None)
    write_token_shards(docs[:4], tmp_path / "eval", max_len=None)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"init": "clover-tiny-dense", "train_data": str(tmp_path / "shards"),
                                   "eval_data": str(tmp_path / "eval"), "output_dir": str(tmp_path / "out"),
                                   "batch_size": 4, "micro_batch_size": 4, "precision": "fp32"}))
    assert main(["train", str(cfg), "--max_steps", "2", "--eval_every", "1", "--progress", "false"]) == 0
    assert "step 2/2" in capsys.readouterr().out
    log = tmp_path / "out" / "train_log.jsonl"
    assert len(log.read_text().splitlines()) == 2 and "eval_loss" in log.read_text()
    assert main(["plot", str(log), "-o", str(tmp_path / "curve.png")]) == 0
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["train", str(cfg), "--lr", "1e-4", "--no_such_key", "1"]) == 2
    assert "'no_such_key'" in capsys.readouterr().err


def test_cli_reports_broken_jsonl_with_file_and_line(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<eos>", "[MASK]", "hello", "world"])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", mask_token="[MASK]",
                            unk_token="<unk>").save_pretrained(tmp_path / "tok")
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "hello world"}\n{"text": "hello" \n')
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"init": "clover-tiny-dense", "train_data": str(data), "data_kind": "jsonl",
                                   "tokenizer": str(tmp_path / "tok"), "output_dir": str(tmp_path / "out")}))
    assert main(["train", str(cfg)]) == 2
    assert f"{data}:2" in capsys.readouterr().err


def test_init_must_be_a_checkpoint_or_preset(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a checkpoint directory nor a preset"):
        Trainer(config(tmp_path, init=str(tmp_path / "missing")), train_documents=documents())


def test_checkpoint_init_and_full_checkpoint_is_a_loadable_model(tmp_path):
    docs = documents()
    train(config(tmp_path / "a", max_steps=1), train_documents=docs)
    ckpt = latest_checkpoint(tmp_path / "a" / "run")
    result = train(config(tmp_path / "b", init=str(ckpt), max_steps=1), train_documents=docs)
    assert result.step == 1
    assert checkpointing.STATE_VERSION == json.loads((ckpt / "trainer" / "state.json").read_text())["version"]
