"""Data parallelism on CPU (gloo): two processes give the loss curve of one process with the same global batch.

Tolerance: 1e-5 (fp32, 3 steps, tiny model). Each process takes a contiguous half of every global batch; the
loss normalisers are summed over both before the forward, and DDP / FSDP2 average the gradients, so the
gradient is that of the whole batch; only the order of the floating-point sums differs.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from clover.training.config import config_from_dict
from clover.training.checkpointing import latest_checkpoint
from clover.training.trainer import train
from training_helpers import documents

TOLERANCE = 1e-5


def settings(out: str, parallel: str, preset: str) -> dict:
    return dict(init=preset, output_dir=out, max_steps=3, batch_size=4, micro_batch_size=2, lr=1e-3,
                warmup_steps=1, precision="fp32", progress=False, resume="never", parallel=parallel, ar_weight=0.5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, cfg: dict, result_file: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    result = train(config_from_dict(cfg), train_documents=documents())
    if rank == 0:
        Path(result_file).write_text(json.dumps(result.losses))


def run_two_processes(tmp_path: Path, parallel: str, preset: str) -> list[float]:
    cfg = settings(str(tmp_path / parallel), parallel, preset)
    result_file = str(tmp_path / f"{parallel}.json")
    mp.start_processes(_worker, args=(2, _free_port(), cfg, result_file), nprocs=2, join=True,
                       start_method="spawn")
    return json.loads(Path(result_file).read_text())


@pytest.mark.parametrize("parallel,preset", [
    ("ddp", "clover-tiny-dense"),
    pytest.param("ddp", "clover-tiny", marks=pytest.mark.slow),
    pytest.param("fsdp", "clover-tiny", marks=pytest.mark.slow),
])
def test_two_process_data_parallel_matches_one_process(tmp_path, parallel, preset):
    torch.set_num_threads(1)
    single = train(config_from_dict(settings(str(tmp_path / "single"), "ddp", preset)),
                   train_documents=documents()).losses
    double = run_two_processes(tmp_path, parallel, preset)
    assert len(single) == len(double) == 3
    assert max(abs(a - b) for a, b in zip(single, double)) < TOLERANCE
    ckpt = latest_checkpoint(tmp_path / parallel)  # rank 0 wrote one complete checkpoint, with both RNG states
    assert ckpt is not None and (ckpt / "model.safetensors").is_file()
    assert sorted(p.name for p in (ckpt / "trainer").glob("rng-rank*")) == ["rng-rank0.safetensors",
                                                                          "rng-rank1.safetensors"]


@pytest.mark.slow
def test_torchrun_cli(tmp_path):
    from clover.training.data import write_token_shards

    docs = [(ids.tolist(), mask.int().tolist()) for ids, mask, _ in documents()]
    write_token_shards(docs, tmp_path / "shards", max_len=None)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(json.dumps({**settings(str(tmp_path / "out"), "ddp", "clover-tiny-dense"),
                               "train_data": str(tmp_path / "shards")}))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(_free_port()), "-m", "clover.cli.main", "train", str(cfg), "--max_steps", "2"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "step 2/2" in done.stdout
    log = (tmp_path / "out" / "train_log.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in log] == [1, 2]


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_process_run_resumes_exactly(tmp_path, parallel):
    """2 processes: 2 steps, stop, resume for 1 more (sharded optimizer state reloaded under FSDP2) == 3 steps
    of one process."""
    torch.set_num_threads(1)
    single = train(config_from_dict(settings(str(tmp_path / "single"), "ddp", "clover-tiny")),
                   train_documents=documents()).losses
    cfg = {**settings(str(tmp_path / parallel), parallel, "clover-tiny"), "resume": "auto"}
    losses = []
    for steps in (2, 3):
        result_file = str(tmp_path / f"{parallel}-{steps}.json")
        mp.start_processes(_worker, args=(2, _free_port(), {**cfg, "max_steps": steps}, result_file), nprocs=2,
                           join=True, start_method="spawn")
        losses += json.loads(Path(result_file).read_text())
    assert len(losses) == 3
    assert max(abs(a - b) for a, b in zip(single, losses)) < TOLERANCE
