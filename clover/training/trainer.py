"""The training loop: BD3-LM objective, AdamW + warmup/cosine, accumulation, DDP / FSDP2, exact resume.

(Over the ~450-line mark on purpose: one role, the `Trainer`'s state machine — stream position, accumulation,
evaluation, checkpoint and exact resume read and write the same state; the pieces that stand alone already live
beside it: batches.py, objective.py, checkpointing.py, distributed.py, stream.py.)

    Trainer(config).train()            # or clover.training.train(config)

One optimizer step consumes `batch_size` documents of a deterministic stream (a seeded permutation per epoch):
step `s` takes stream positions `[s * batch_size, (s + 1) * batch_size)`; under `torchrun` rank `r` takes the
`r`-th contiguous share and splits it into micro-batches of `micro_batch_size`. A document's noise is drawn from
a seed derived from (seed, stream position), so it depends neither on the batch it lands in nor on the number of
processes. The loss normalisers (masked / supervised tokens) are summed over all micro-batches and ranks before
the first forward, so accumulation and data parallelism give exactly the gradient of one big batch.

Every `save_every` steps and at the end the state goes to `output_dir/checkpoints/step-XXXXXXXX/` (what a
checkpoint holds, how it is written atomically and resumed: `checkpointing`); resuming restores all of it, so a
killed and resumed run has the same loss curve as an uninterrupted one. The data order is `stream`, process groups
and DDP / FSDP2 wrapping `distributed`; this module is the loop: set-up, one step, evaluation, logging, signals.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import signal
import sys
import threading
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from clover.atomic_files import atomic_write_text
from clover.config import PRESETS, CloverConfig
from clover.model import CloverForBlockDiffusion
from clover.model.lora import adapters_disabled, apply_lora, is_gated
from clover.training.checkpointing import (CHECKPOINTS, COUNTERS, TRAINER_DIR, checkpoint_name, latest_checkpoint,
                                           load_training_state, load_weights, remove_stale_temporaries,
                                           save_training_checkpoint)
from clover.training.config import TrainConfig, native_bf16
from clover.training.distributed import close_distributed, init_distributed, parallelize
from clover.training.batches import Batch, collate, document_shape
from clover.training.objective import Noise, bd3_loss, loss_denominators, sample_noise
from clover.training.stream import DocumentStream, load_documents, mix_seed

logger = logging.getLogger(__name__)

LOG_FILE = "train_log.jsonl"
SAVE_RETRY_DELAYS = (5.0, 30.0)  # seconds before the second and the third try of a failed checkpoint save
# per-step sums reduced across micro-batches and ranks
_SUM_KEYS = ("loss", "diffusion_sum", "ce_sum", "first_sum", "masked_tokens", "first_tokens", "correct",
             "supervised_tokens", "ar_sum", "kl_sum", "confidence_sum", "confident", "draft_kl_sum", "tokens",
             "diffusion_den", "ar_den")


# -- model -----------------------------------------------------------------------------------------------------
def build_model(config: TrainConfig) -> CloverForBlockDiffusion:
    """`init`: a checkpoint directory (weights loaded in fp32) or a preset name (random init from `seed`)."""
    init = config.init
    if Path(init).is_dir():
        if config.model_overrides:
            raise ValueError("model_overrides applies to presets only; init is a checkpoint directory")
        model = CloverForBlockDiffusion.from_pretrained(init, dtype=torch.float32)
    elif init in PRESETS:
        torch.manual_seed(config.seed)
        model = CloverForBlockDiffusion(CloverConfig.from_preset(init, **config.model_overrides))
    else:
        raise FileNotFoundError(f"init {init!r} is neither a checkpoint directory nor a preset "
                                f"({', '.join(sorted(PRESETS))})")
    if model.config.mask_token_id is None:
        raise ValueError(f"the model at {init!r} has no mask_token_id; block diffusion needs a [MASK] token "
                         "(set it in config.json / model_overrides, or convert with one)")
    return model


class ObjectiveModule(nn.Module):
    """The whole per-micro-batch computation as one module, so DDP sees one forward per backward."""

    def __init__(self, model: CloverForBlockDiffusion, config: TrainConfig,
                 reference: nn.Module | None = None) -> None:
        super().__init__()
        self.model = model
        self.cfg = config
        self._reference = [reference]  # a list: not registered as a submodule (frozen, not trained or synced)

    def reference_logits(self, ids: torch.Tensor, attention: torch.Tensor | None, keep: int) -> torch.Tensor:
        ref = self._reference[0]
        if ref is None:  # LoRA: the base model is the model with its adapters switched off
            with adapters_disabled(self.model):
                return self.model(ids, 1, attention_mask=attention, logits_to_keep=keep).logits
        return ref(ids, 1, attention_mask=attention, logits_to_keep=keep).logits

    def forward(self, batch: Batch, noise: Noise, block_size: int,
                denominators: dict[str, float]) -> tuple[torch.Tensor, dict[str, float]]:
        return bd3_loss(self.model, batch, block_size, noise, ar_weight=self.cfg.ar_weight,
                        kl_weight=self.cfg.kl_weight, confidence_weight=self.cfg.confidence_weight,
                        reference=self.reference_logits if self.cfg.kl_weight else None,
                        denominators=denominators, ce_weight=self.cfg.ce_weight,
                        draft_kl_weight=self.cfg.draft_kl_weight)


# -- the trainer ---------------------------------------------------------------------------------------------
@dataclass
class TrainResult:
    step: int
    losses: list[float]  # training loss of each step run by this call
    eval_losses: list[tuple[int, float]]
    checkpoint: Path | None
    stopped_early: bool


class Trainer:
    """Builds model, data, optimizer and parallel wrappers from a TrainConfig; `train()` runs the loop.

    `train_documents` / `eval_documents` (sequences of `(input_ids, loss_mask, prompt_len)`) replace
    `train_data` / `eval_data` when given (tests, notebooks).
    """

    def __init__(self, config: TrainConfig, *, train_documents: Sequence[Any] | None = None,
                 eval_documents: Sequence[Any] | None = None) -> None:
        self.config = config
        if config.threads:
            torch.set_num_threads(config.threads)
        self.dist = init_distributed(config)
        d = self.dist
        per_rank = config.batch_size // d.world
        if config.batch_size % (d.world * config.micro_batch_size):
            raise ValueError(f"batch_size {config.batch_size} must be a multiple of micro_batch_size "
                             f"{config.micro_batch_size} x {d.world} processes")
        self.accum = per_rank // config.micro_batch_size
        self.bf16 = config.precision == "bf16" or (config.precision == "auto" and native_bf16(d.device.type))
        if config.precision == "auto" and d.rank == 0:
            logger.info("precision auto: %s on this %s", "bf16 autocast" if self.bf16 else "fp32", d.device.type)
        self.output_dir = Path(config.output_dir)
        self.ckpt_root = self.output_dir / CHECKPOINTS

        train_docs = train_documents if train_documents is not None else load_documents(config, "train", d)
        self.eval_docs = eval_documents if eval_documents is not None else load_documents(config, "eval", d)
        self.stream = DocumentStream(train_docs, config.seed, config.shuffle)

        resume_from = self._resume_path()
        self.model = build_model(config)
        mcfg = self.model.config
        self.mask_id, self.eos_id = mcfg.mask_token_id, (mcfg.eos_token_ids[0] if mcfg.eos_token_ids else None)
        if config.pad_target == "eos" and self.eos_id is None:
            raise ValueError("pad_target is 'eos' but the model config has no eos_token_id")
        shard_mask = getattr(train_docs, "mask_token_id", None)
        if shard_mask is not None and shard_mask != self.mask_id:
            logger.warning("the data was prepared with mask_token_id %s but the model's is %s",
                           shard_mask, self.mask_id)
        self.lora = config.lora.rank > 0
        if self.lora:
            apply_lora(self.model, config.lora)
        self.state: dict[str, Any] = dict.fromkeys(COUNTERS, 0)
        if resume_from is not None:
            load_weights(self.model, resume_from, self.lora)
        self.model.to(d.device)
        self.model.gradient_checkpointing = config.gradient_checkpointing
        reference = None
        if config.kl_weight and not self.lora:
            reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.module = ObjectiveModule(self.model, config, reference)
        self.wrapped: nn.Module = parallelize(self.module, self.model, d, config.parallel)
        self.optimizer = self._build_optimizer()
        if resume_from is not None:
            self.state = load_training_state(resume_from, self.model, self.optimizer, config, d)
            logger.info("resumed from %s at step %d", resume_from, self.state["step"])
        else:
            torch.manual_seed(mix_seed(config.seed, 0x7A1, d.rank))  # dropout etc.: distinct per rank
        self.resumed_from = resume_from
        self._stop_signal = False

    # -- setup ---------------------------------------------------------------------------------------------
    def _resume_path(self) -> Path | None:
        mode = self.config.resume
        if mode == "never":
            return None
        if mode == "auto":
            return latest_checkpoint(self.output_dir)
        path = Path(mode)
        if not (path / TRAINER_DIR / "state.json").is_file():
            raise FileNotFoundError(f"resume: {path} is not a training checkpoint (no {TRAINER_DIR}/state.json)")
        return path

    def _build_optimizer(self) -> torch.optim.Optimizer:
        decay, no_decay = [], []
        for name, param in self.model.named_parameters():
            if not param.requires_grad:
                continue
            plain = param.ndim < 2 or "embed_tokens" in name or "row_delta" in name
            (no_decay if plain else decay).append(param)
        if not decay and not no_decay:
            raise ValueError("no trainable parameters")
        c = self.config
        groups = [{"params": decay, "weight_decay": c.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW([g for g in groups if g["params"]], lr=c.lr, betas=(c.beta1, c.beta2),
                                 eps=c.adam_eps)

    @property
    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    # -- batches -------------------------------------------------------------------------------------------
    def _micro_batches(self, step: int, block_size: int) -> list[tuple[Batch, Noise]]:
        c, d = self.config, self.dist
        per_rank = c.batch_size // d.world
        docs = self.stream.take(step * c.batch_size + d.rank * per_rank, per_rank)
        # Documents of like shape share a micro-batch: each pads to its longest prompt and response (grouping
        # cuts the padding of a chat + tool-call mix). The step's gradient does not depend
        # on the grouping: noise is drawn per document and the loss normalisers are global.
        docs.sort(key=lambda item: (*document_shape(item[1]), item[0]))
        out = []
        for i in range(0, per_rank, c.micro_batch_size):
            chunk = docs[i: i + c.micro_batch_size]
            batch = collate([doc for _, doc in chunk], block_size, mask_token_id=self.mask_id,
                            eos_token_id=self.eos_id, pad_target=c.pad_target, max_seq_len=c.max_seq_len,
                            seeds=[mix_seed(c.seed, pos) for pos, _ in chunk])
            out.append((batch, sample_noise(batch, block_size, c.noise)))
        return out

    def _autocast(self):
        if self.bf16:
            return torch.autocast(self.dist.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def _no_sync(self, last: bool):
        if last or not self.dist.distributed:
            return nullcontext()
        if hasattr(self.wrapped, "no_sync"):  # DDP
            return self.wrapped.no_sync()
        return nullcontext()

    # -- one step ------------------------------------------------------------------------------------------
    def train_step(self, step: int) -> dict[str, float]:
        c, d = self.config, self.dist
        block_size = c.block_size_at(step)
        micro = self._micro_batches(step, block_size)
        keys = ("diffusion", "ar", "masked", "draft")
        local_den = torch.zeros(len(keys), dtype=torch.float64)
        frozen = is_gated(self.model)
        for batch, noise in micro:
            den = loss_denominators(batch, noise, frozen_starts=frozen)
            local_den += torch.tensor([den[k] for k in keys], dtype=torch.float64)
        den = dict(zip(keys, d.all_sum(local_den).tolist()))
        lr = c.lr_at(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.wrapped.train()
        sums = dict.fromkeys(_SUM_KEYS, 0.0)
        fsdp = d.distributed and c.parallel == "fsdp"
        for i, (batch, noise) in enumerate(micro):
            last = i == len(micro) - 1
            if fsdp:
                self.model.set_requires_gradient_sync(last)
            with self._no_sync(last):
                with self._autocast():
                    loss, metrics = self.wrapped(batch.to(d.device), noise, block_size, den)
                (loss * d.world).backward()  # DDP / FSDP average gradients over ranks; the loss is a global sum
            for key in _SUM_KEYS:
                sums[key] += metrics.get(key, 0.0)
            sums["tokens"] += batch.num_tokens
        clip = c.grad_clip if c.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable_parameters, clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        total = d.all_sum(torch.tensor([sums[k] for k in _SUM_KEYS], dtype=torch.float64))
        s = dict(zip(_SUM_KEYS, total.tolist()))
        out = {
            "loss": s["loss"],
            "diffusion_loss": s["diffusion_sum"] / max(den["diffusion"], 1e-12),  # a w-weighted count may be < 1
            "masked_ce": s["ce_sum"] / max(s["masked_tokens"], 1.0),
            "first_ce": s["first_sum"] / max(s["first_tokens"], 1.0),
            "inner_ce": (s["ce_sum"] - s["first_sum"]) / max(s["masked_tokens"] - s["first_tokens"], 1.0),
            "accuracy": s["correct"] / max(s["masked_tokens"], 1.0),
            "step_tokens": s["tokens"],
            "supervised_tokens": den["ar"],
            "grad_norm": float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm),
            "lr": lr,
            "block_size": block_size,
        }
        if c.ar_weight or c.kl_weight:
            out["ar_loss"] = s["ar_sum"] / max(den["ar"], 1.0)
        if c.kl_weight:
            out["kl"] = s["kl_sum"] / max(den["ar"], 1.0)
        if c.confidence_weight:
            out["confident_entropy"] = s["confidence_sum"] / max(s["confident"], 1.0)
        if c.draft_kl_weight:
            out["draft_kl"] = s["draft_kl_sum"] / max(den["draft"], 1e-12)
        return out

    # -- evaluation ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, step: int) -> dict[str, float]:
        """Held-out loss on the first `eval_documents` documents, with fixed noise (comparable across steps)."""
        c, d = self.config, self.dist
        docs = list(self.eval_docs[i] for i in range(min(c.eval_documents, len(self.eval_docs))))
        docs = docs[: len(docs) - len(docs) % d.world]
        if not docs:
            return {}
        block_size = c.block_size_at(step)
        mine = list(range(d.rank, len(docs), d.world))
        self.model.eval()
        sums = torch.zeros(6, dtype=torch.float64)
        for i in range(0, len(mine), c.micro_batch_size):
            idx = mine[i: i + c.micro_batch_size]
            batch = collate([docs[k] for k in idx], block_size, mask_token_id=self.mask_id, eos_token_id=self.eos_id,
                            pad_target=c.pad_target, max_seq_len=c.max_seq_len,
                            seeds=[mix_seed(c.seed, 0xE7A1, k) for k in idx])
            noise = sample_noise(batch, block_size, c.noise)
            den = loss_denominators(batch, noise, frozen_starts=is_gated(self.model))
            with self._autocast():
                _, m = bd3_loss(self.model, batch.to(d.device), block_size, noise, ar_weight=c.ar_weight,
                                denominators=den)
            sums += torch.tensor([m["diffusion_sum"], den["diffusion"], m.get("ar_sum", 0.0), den["ar"],
                                  m["correct"], m["masked_tokens"]], dtype=torch.float64)
        self.model.train()
        s = d.all_sum(sums).tolist()
        out = {"eval_diffusion_loss": s[0] / max(s[1], 1.0), "eval_accuracy": s[4] / max(s[5], 1.0)}
        out["eval_loss"] = out["eval_diffusion_loss"]
        if c.ar_weight:
            out["eval_ar_loss"] = s[2] / max(s[3], 1.0)
            out["eval_loss"] += c.ar_weight * out["eval_ar_loss"]
        return out

    # -- checkpoints ---------------------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        """Write a complete checkpoint of the current state, atomically; then point `latest` at it. A failed
        save is tried again after each of `SAVE_RETRY_DELAYS` (a full disk may be cleared, a network filesystem
        come back); when the last try fails too, its RuntimeError stops training: a run that cannot save would
        otherwise spend its budget on steps a crash loses."""
        for delay in SAVE_RETRY_DELAYS:
            try:
                return self._save_once()
            except RuntimeError as exc:  # raised on every rank alike, so every rank retries (or stops) together
                logger.error("%s; trying again in %g s", exc, delay)
                time.sleep(delay)
        return self._save_once()

    def _save_once(self) -> Path:
        return save_training_checkpoint(self.ckpt_root, self.model, self.optimizer, self.state, self.config,
                                        self.dist)

    # -- logging -------------------------------------------------------------------------------------------
    def _open_log(self) -> Any:
        if self.dist.rank != 0:
            return None
        self.output_dir.mkdir(parents=True, exist_ok=True)
        path = self.output_dir / LOG_FILE
        kept = []
        if self.resumed_from is not None and path.is_file():  # drop entries after the resumed step
            for line in path.read_text().splitlines():
                try:
                    if json.loads(line).get("step", 0) <= self.state["step"]:
                        kept.append(line)
                except json.JSONDecodeError:  # a line a kill cut short
                    continue
        # replaced whole (a kill now leaves the old log or the kept one), then appended to, a line at a time
        atomic_write_text(path, "".join(line + "\n" for line in kept))
        return open(path, "a", buffering=1)

    # -- the loop ------------------------------------------------------------------------------------------
    def train(self) -> TrainResult:
        c, d = self.config, self.dist
        start_time = time.monotonic()
        if d.rank == 0:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.output_dir / "config.yaml", c.to_yaml())
            self.ckpt_root.mkdir(parents=True, exist_ok=True)
            remove_stale_temporaries(self.ckpt_root)
        log_file = self._open_log()
        previous = signal.getsignal(signal.SIGTERM) if _main_thread() else None
        if previous is not None:
            signal.signal(signal.SIGTERM, self._on_sigterm)
        bar = None
        if d.rank == 0 and c.progress:
            bar = tqdm(total=c.max_steps, initial=self.state["step"], unit="step", dynamic_ncols=True,
                       mininterval=1.0 if sys.stderr.isatty() else 30.0, desc="train")
        losses: list[float] = []
        eval_losses: list[tuple[int, float]] = []
        last_saved = self.state["step"] if self.resumed_from is not None else -1
        step_time = 0.0
        # a resumed run whose budget is spent stops before training: its next step (estimated by the mean so far)
        # would cross the budget, as the check after each step would have found
        mean_step_cpu = self.state["cpu_s"] / self.state["step"] if self.state["step"] else 0.0
        stopped_early = self.resumed_from is not None and self._out_of_time(start_time, 0.0, mean_step_cpu)
        try:
            while self.state["step"] < c.max_steps and not stopped_early:
                t0, cpu0 = time.monotonic(), time.process_time()
                metrics = self.train_step(self.state["step"])
                step_time = time.monotonic() - t0
                # CPU time, every thread of every rank: a budget in CPU-hours is kept on a shared machine too
                step_cpu = float(d.all_sum(torch.tensor([time.process_time() - cpu0], dtype=torch.float64))[0])
                self.state["cpu_s"] += step_cpu
                self.state["step"] += 1
                self.state["tokens"] += int(metrics["step_tokens"])
                self.state["supervised_tokens"] += int(metrics["supervised_tokens"])
                step = self.state["step"]
                losses.append(metrics["loss"])
                record = {"step": step, "loss": metrics["loss"], "lr": metrics["lr"], "tokens": self.state["tokens"],
                          "tokens_per_s": metrics["step_tokens"] / max(step_time, 1e-9),
                          "grad_norm": metrics["grad_norm"], "block_size": metrics["block_size"],
                          **{k: metrics[k] for k in ("diffusion_loss", "ar_loss", "kl", "draft_kl", "masked_ce",
                                                     "first_ce", "inner_ce", "accuracy", "confident_entropy")
                             if k in metrics},
                          "supervised_tokens": self.state["supervised_tokens"],
                          "cpu_hours": self.state["cpu_s"] / 3600, "elapsed_s": time.monotonic() - start_time}
                if not math.isfinite(metrics["loss"]):
                    raise FloatingPointError(f"loss is {metrics['loss']} at step {step}; lower lr or check the data")
                do_eval = self.eval_docs is not None and (
                    (c.eval_every and step % c.eval_every == 0) or step == c.max_steps)
                budget_hit = self._out_of_time(start_time, step_time, step_cpu)
                if do_eval or (budget_hit and self.eval_docs is not None):
                    ev = self.evaluate(step)
                    record.update(ev)
                    if "eval_loss" in ev:
                        eval_losses.append((step, ev["eval_loss"]))
                if log_file is not None and (step % c.log_every == 0 or "eval_loss" in record or step == c.max_steps):
                    log_file.write(json.dumps(record) + "\n")
                if bar is not None:
                    bar.update(1)
                    post = {"loss": f"{metrics['loss']:.4f}", "tok/s": f"{record['tokens_per_s']:.0f}"}
                    if "eval_loss" in record:
                        post["eval"] = f"{record['eval_loss']:.4f}"
                    bar.set_postfix(post, refresh=False)
                if budget_hit or self._stop_requested():
                    stopped_early = step < c.max_steps
                    break
                if c.save_every and step % c.save_every == 0:
                    self.save_checkpoint()
                    last_saved = step
            if self.state["step"] != last_saved:
                self.save_checkpoint()
                last_saved = self.state["step"]
        finally:
            if bar is not None:
                bar.close()
            if log_file is not None:
                log_file.close()
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
        if stopped_early and d.rank == 0:
            logger.info("stopped at step %d of %d (%s); resume with the same command", self.state["step"],
                        c.max_steps, "SIGTERM" if self._stop_signal else "time or CPU budget")
        ckpt = self.ckpt_root / checkpoint_name(last_saved) if last_saved >= 0 else None
        return TrainResult(self.state["step"], losses, eval_losses, ckpt, stopped_early)

    def _out_of_time(self, start: float, step_time: float, step_cpu: float) -> bool:
        c = self.config
        if not c.max_minutes and not c.max_cpu_hours:
            return False
        # stop when the next step would cross a budget (rank 0 decides, so every rank stops together)
        hit = bool(c.max_minutes) and time.monotonic() - start + step_time >= c.max_minutes * 60.0
        hit |= bool(c.max_cpu_hours) and self.state["cpu_s"] + step_cpu >= c.max_cpu_hours * 3600.0
        return bool(self.dist.broadcast(hit))

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self._stop_signal = True

    def _stop_requested(self) -> bool:
        flag = torch.tensor([float(self._stop_signal)])
        return bool(self.dist.all_sum(flag)[0] > 0)

    def close(self) -> None:
        close_distributed(self.dist)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def train(config: TrainConfig, **kwargs: Any) -> TrainResult:
    """Build a Trainer and run it (`clover train` calls this)."""
    trainer = Trainer(config, **kwargs)
    try:
        result = trainer.train()
        # every rank leaves its last collective before any destroys the group: under gloo, tearing it down while
        # the peer is still in the final checkpoint broadcast aborted rank 0 (SIGABRT) in ~1 run of 5
        trainer.dist.barrier()
        return result
    finally:
        trainer.close()
