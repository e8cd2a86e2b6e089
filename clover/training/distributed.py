"""Distributed set-up for training: torchrun's environment, the process group, and the DDP / FSDP2 wrapping.

    info = init_distributed(config)          # rank, world, device; starts the process group when world > 1
    wrapped = parallelize(module, model, info, config.parallel)
    ...
    close_distributed(info)                  # destroys the group only if `init_distributed` created it

One process alone never touches `torch.distributed`: every helper of `DistInfo` is the identity then.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

from clover.model import CloverForBlockDiffusion
from clover.training.config import TrainConfig


@dataclass
class DistInfo:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    owns_group: bool = False

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def all_sum(self, values: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            values = values.to(self.device)
            dist.all_reduce(values)
        return values.cpu()

    def broadcast(self, obj: Any) -> Any:
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj: Any) -> list[Any] | None:
        """`obj` of every rank, in rank order, on rank 0; None on the other ranks."""
        if not self.distributed:
            return [obj]
        out = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0)
        return out


def init_distributed(config: TrainConfig) -> DistInfo:
    """Read torchrun's environment; start the process group (nccl on GPU, gloo on CPU) if there are several."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise ValueError("device is 'cuda' but torch sees no CUDA device")
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    owns = False
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
        owns = True
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    return DistInfo(rank, world, local_rank, device, owns)


def close_distributed(info: DistInfo) -> None:
    """Destroy the process group if `init_distributed` started it (one started by the caller is theirs)."""
    if info.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def parallelize(module: nn.Module, model: CloverForBlockDiffusion, info: DistInfo, parallel: str) -> nn.Module:
    """The module the loop calls: `module` itself alone; wrapped in DDP, or with `model` sharded by FSDP2.

    DDP wraps the whole objective `module` (both forwards of a step in one DDP call). FSDP2 shards in place:
    `fully_shard` on every decoder layer and on the root `model`, and `module` is returned as is.
    """
    if not info.distributed:
        return module
    if parallel == "ddp":
        return DDP(module, device_ids=[info.device.index] if info.device.type == "cuda" else None)
    from torch.distributed.fsdp import fully_shard  # deferred: slow imports, for FSDP runs only

    # the logits are views (slices of one LM-head output); nothing here modifies them in place
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    mesh = init_device_mesh(info.device.type, (info.world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return module
