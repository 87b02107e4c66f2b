"""Data-parallel training across processes started by torchrun (torch.distributed).

    torchrun --standalone --nproc_per_node 2 -m s2s train CONFIG -o RUN_DIR

Every rank computes the same batch order from (seed, epoch).  One update takes
``update_freq * world_size`` consecutive batches; rank r trains on batches
r, r + world_size, ... of them.  Each rank back-propagates its summed loss;
one all-reduce sums the gradients together with the token count, the loss and
the token counters, and the gradients are divided by the update's target
token count afterwards:

    g = (1 / sum_r n_r) * sum_r grad(L_r)

which is the gradient one process computes over all those batches
(``update_freq * world_size`` of them), up to the order of floating-point sums.
Rank 0 alone validates, logs and writes checkpoints; whether to stop (time
budget, step limit, early stopping, a signal on any rank) is agreed by a
one-number all-reduce before every update, so no rank waits for another that
has left.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import Tensor


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on at least one."""
        if self.size == 1:
            return flag
        import torch.distributed as dist

        t = torch.tensor([1.0 if flag else 0.0], device=_comm_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item() > 0)

    def barrier(self) -> None:
        if self.size > 1:
            import torch.distributed as dist

            dist.barrier()


def _comm_device() -> torch.device:
    """Where collective buffers live: the rank's GPU under NCCL, else the CPU (gloo)."""
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_world(device: str = "auto") -> tuple[World, torch.device]:
    """The process group torchrun describes in the environment (WORLD_SIZE, RANK,
    LOCAL_RANK, MASTER_ADDR, MASTER_PORT), and this rank's device: gloo on CPUs,
    NCCL with one GPU per local rank.  Without torchrun: one process, rank 0.
    ``device`` (train.device): auto takes the GPU when there is one."""
    from s2s.device import resolve_device

    wanted = resolve_device(device, "train.device")
    cuda = wanted.type == "cuda"
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World(), wanted
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    return World(dist.get_rank(), dist.get_world_size()), device


def all_reduce_update(params: Iterable[torch.nn.Parameter], extras: Tensor) -> Tensor:
    """Sum every parameter's gradient and the numbers in ``extras`` over all ranks,
    in one flat all-reduce.  A parameter without a gradient on this rank (no batch,
    or unused) contributes zeros.  Returns the summed ``extras``."""
    import torch.distributed as dist

    params = [p for p in params if p.requires_grad]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads] + [extras.to(grads[0].dtype).reshape(-1)])
    comm = flat.to(_comm_device())
    dist.all_reduce(comm)
    flat = comm.to(flat.device)
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[offset:offset + n].view_as(g).clone()
        offset += n
    return flat[offset:]


def shard(group: list, world: World) -> list:
    """This rank's batches of an update: every ``world.size``-th, starting at its rank."""
    return group[world.rank::world.size]
