"""The collectives a tensor-parallel model runs, over torch.distributed.

`model_group` carries the activations (NCCL on GPUs, gloo on CPUs); `cpu_group` (always gloo) carries
start-up agreements, so they never need a device copy. `step_group` (gloo) carries the header of the
step broadcast, which a worker waits for as long as the core is idle: its timeout is unbounded in
practice, so an idle core keeps its workers (a dead core still fails the wait at once: its sockets close).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from llmserve_core.distributed.sharding import ShardSpec


@dataclass
class TPGroup:
    shard: ShardSpec
    model_group: object
    cpu_group: object
    step_group: object
    device: torch.device
    store: object = None       # the rendezvous TCPStore (rank 0 hosts it)
    driver: object = None      # rank 0: the driver.Driver that announces each call to the workers

    def wrap(self, model):
        """The model the runner steps: on rank 0 one whose calls the workers mirror."""
        if self.driver is None:
            return model
        from llmserve_core.distributed.driver import DrivenModel
        return DrivenModel(model, self.driver)

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def size(self) -> int:
        return self.shard.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.model_group)
        return x

    def gather_vocab(self, local: torch.Tensor) -> torch.Tensor:
        """[N, V/size] per rank -> [N, V] on every rank (padding rows of the vocabulary cut off)."""
        n, v = local.shape
        out = local.new_empty(self.size * n, v)
        dist.all_gather_into_tensor(out, local.contiguous(), group=self.model_group)
        return out.view(self.size, n, v).permute(1, 0, 2).reshape(n, -1)[:, :self.shard.vocab_size]

    def gather_vocab_rows(self, weight: torch.Tensor) -> torch.Tensor:
        """A vocabulary-split [V/size, H] weight -> the full [V, H] on every rank."""
        out = weight.new_empty(self.size * weight.shape[0], weight.shape[1])
        dist.all_gather_into_tensor(out, weight.contiguous(), group=self.model_group)
        return out[:self.shard.vocab_size]

    def agree_min(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())
