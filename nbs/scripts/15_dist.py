# ---
# jupyter:
#   jupytext:
#     formats: nbs///ipynb,nbs/scripts///py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %%
#| default_exp dist

# %%
#| export
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as td
import torch.nn.functional as F

# %%
#| hide
from torch.testing import assert_close


# %% [markdown]
# # Distributed helpers
#
# > The only module that touches process groups: start from `torchrun`'s environment, gather with gradient, pad ragged tensors before gathering, and fall back to one process.

# %% [markdown]
# Data-parallel contrastive training needs each process to see the embeddings of *every* process's samples
# (the negatives), while each process computes the loss of its own rows only (see `11_loss`). The gathered
# tensors must carry gradient back to the process that made them: open_clip's `gather_features` with
# `gather_with_grad=True` uses `torch.distributed.nn.functional.all_gather`, whose backward sums the
# gradients of every process's loss with respect to a process's inputs (a reduce-scatter). DDP then averages
# parameter gradients over the $G$ processes, so each parameter receives
# $\frac1G\sum_q \partial L_q/\partial\theta$, the gradient of the mean of the per-process losses, which is
# the loss of the whole batch when every process holds the same number of rows.
#
# Everything here works unchanged in one process (no process group): gathering returns its input, and the
# rank is 0 of 1. The trainer, the methods and the tests never call `torch.distributed` themselves.

# %% [markdown]
# ## Reading the launcher's environment

# %%
#| export
@dataclass
class DistContext:
    "Who this process is in the run, and how to reach the others. `gather` keeps gradient."
    rank: int = 0                 # global rank
    world_size: int = 1           # number of processes
    local_rank: int = 0           # rank on this machine (picks the GPU)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None    # 'gloo' | 'nccl' | None (single process)

    @property
    def is_main(self) -> bool: return self.rank == 0
    @property
    def distributed(self) -> bool: return self.world_size > 1

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        "(R, ...) -> (G*R, ...) concatenated in rank order, with gradient. See `gather_with_grad`."
        return gather_with_grad(x) if self.distributed else x

    def gather_padded(self, x: torch.Tensor, dim: int = 1, value=0) -> torch.Tensor:
        "Like `gather`, after padding `dim` to its maximum over the processes (ragged K, W or M)."
        return gather_padded(x, dim, value) if self.distributed else x

    def gather_many(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        "Several (R, ...) float tensors gathered with gradient in ONE collective. See `gather_many`."
        return gather_many(xs) if self.distributed else list(xs)


def env_world() -> tuple[int, int, int]:
    "(rank, world_size, local_rank) from the variables torchrun (or `torch.multiprocessing` tests) set."
    return (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
            int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", 0))))


def init_distributed(device: str | None = None, backend: str | None = None) -> DistContext:
    """Join the process group that torchrun's environment describes (gloo on CPU, nccl on GPU), or return a
    single-process context when WORLD_SIZE is absent or 1. `device`: 'cpu' | 'cuda' | None (cuda when available)."""
    rank, world, local = env_world()
    dev_type = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(f"cuda:{local}") if dev_type == "cuda" else torch.device(dev_type)
    if dev.type == "cuda": torch.cuda.set_device(dev)
    if world <= 1: return DistContext(0, 1, 0, dev, None)
    backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
    if not td.is_initialized():
        if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
            raise RuntimeError("WORLD_SIZE > 1 but MASTER_ADDR/MASTER_PORT are not set: launch with torchrun")
        td.init_process_group(backend=backend, rank=rank, world_size=world)
    return DistContext(td.get_rank(), td.get_world_size(), local, dev, backend)


def cleanup(ctx: DistContext) -> None:
    "Leave the process group (no-op in one process)."
    if ctx.distributed and td.is_initialized(): td.destroy_process_group()


# %%
_ctx = init_distributed("cpu")
assert (_ctx.rank, _ctx.world_size, _ctx.is_main, _ctx.distributed) == (0, 1, True, False)
_x = torch.randn(3, 4, requires_grad=True)
assert _ctx.gather(_x) is _x and _ctx.gather_padded(_x) is _x


# %% [markdown]
# ## Gathering, with and without gradient
#
# Float tensors that feed the loss are gathered with gradient. Masks (bool) and counters carry none, and
# some backends cannot all-gather bool, so they travel as `uint8` through the plain collective. A method that
# gathers several tensors with gradient must use `gather_many` (one collective), not several `gather` calls:
# see its docstring for the silent failure it avoids (`tests/test_ddp.py` caught it).

# %%
#| export
def gather_with_grad(x: torch.Tensor) -> torch.Tensor:
    "(R, ...) -> (G*R, ...): all_gather whose backward returns to each process the sum of every loss's gradient."
    if not (td.is_available() and td.is_initialized()) or td.get_world_size() == 1: return x
    if not x.is_floating_point():
        return gather_no_grad(x)
    import torch.distributed.nn.functional as dnf  # imported late: it registers autograd functions
    return torch.cat(dnf.all_gather(x.contiguous()), 0)


def gather_many(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """[(R, ...) float tensors] -> [(G*R, ...)], with gradient, through a single all_gather.

    Why one collective: every gather with gradient issues a collective in the *backward* pass too, in the order
    the autograd engine reaches it. That order follows the graph, and the graphs of two processes differ when
    one pads a ragged tensor and the other does not; collectives issued in different orders on different
    processes pair up the wrong tensors (silently, when shapes agree). Packing all tensors into one leaves a
    single backward collective, so there is nothing to order."""
    if not (td.is_available() and td.is_initialized()) or td.get_world_size() == 1: return list(xs)
    R = xs[0].shape[0]
    if any(x.shape[0] != R for x in xs): raise ValueError(f"all tensors need the same number of rows, got {[x.shape[0] for x in xs]}")
    dtype = xs[0].dtype
    for x in xs[1:]: dtype = torch.promote_types(dtype, x.dtype)
    flat = torch.cat([x.to(dtype).reshape(R, -1) for x in xs], 1)  # (R, sum of trailing sizes)
    parts = gather_with_grad(flat).split([x[0].numel() for x in xs], 1)  # each (G*R, n_i)
    return [p.reshape(-1, *x.shape[1:]).to(x.dtype) for p, x in zip(parts, xs)]


def gather_no_grad(x: torch.Tensor) -> torch.Tensor:
    "(R, ...) -> (G*R, ...) without gradient; bool tensors are sent as uint8."
    if not (td.is_available() and td.is_initialized()) or td.get_world_size() == 1: return x
    y = x.detach().to(torch.uint8) if x.dtype == torch.bool else x.detach().contiguous()
    out = [torch.empty_like(y) for _ in range(td.get_world_size())]
    td.all_gather(out, y)
    out = torch.cat(out, 0)
    return out.bool() if x.dtype == torch.bool else out


def all_max(n: int, device=None) -> int:
    "Maximum of an integer over the processes."
    if not (td.is_available() and td.is_initialized()): return int(n)
    t = torch.tensor([int(n)], device=device or _default_device())
    td.all_reduce(t, op=td.ReduceOp.MAX)
    return int(t.item())


def all_mean(x: torch.Tensor) -> torch.Tensor:
    "Mean of a (detached) tensor over the processes: for logging, and so that every process skips the same bad step."
    if not (td.is_available() and td.is_initialized()) or td.get_world_size() == 1: return x.detach()
    y = x.detach().clone().to(_default_device())
    td.all_reduce(y)
    return (y / td.get_world_size()).to(x.device)


def _default_device():
    return torch.device("cuda", torch.cuda.current_device()) if td.get_backend() == "nccl" else torch.device("cpu")


def barrier() -> None:
    if td.is_available() and td.is_initialized(): td.barrier()


def all_gather_object(obj) -> list:
    "[obj of rank 0, obj of rank 1, ...] (picklable objects, e.g. RNG states for a checkpoint)."
    if not (td.is_available() and td.is_initialized()) or td.get_world_size() == 1: return [obj]
    out = [None] * td.get_world_size()
    td.all_gather_object(out, obj)
    return out


def wrap_ddp(module: torch.nn.Module, ctx: DistContext, find_unused_parameters: bool = False) -> torch.nn.Module:
    "DistributedDataParallel around `module` when there are several processes; the module itself otherwise."
    if not ctx.distributed: return module
    from torch.nn.parallel import DistributedDataParallel
    ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return DistributedDataParallel(module, device_ids=ids, find_unused_parameters=find_unused_parameters)


# %% [markdown]
# ## Ragged tensors
#
# Captions have different numbers of words $W$ and tree nodes $K$, so one process's phrase embeddings may be
# `(R, 12, D)` and another's `(R, 15, D)`. Before gathering, each pads to the largest size over the processes;
# padded nodes are invalid (`node_valid` pads with False), so they never enter the loss.

# %%
#| export
def pad_dim(x: torch.Tensor, size: int, dim: int = 1, value=0) -> torch.Tensor:
    "Pad `x` along `dim` at the end up to `size` with `value` (no-op when already that size)."
    n = x.shape[dim]
    if n > size: raise ValueError(f"cannot pad dim {dim} of size {n} down to {size}")
    if n == size: return x
    shape = list(x.shape); shape[dim] = size - n
    return torch.cat([x, x.new_full(shape, value)], dim)


def gather_padded(x: torch.Tensor, dim: int = 1, value=0) -> torch.Tensor:
    "Pad `dim` to its maximum over the processes, then gather (with gradient for float tensors)."
    return gather_with_grad(pad_dim(x, all_max(x.shape[dim], x.device if x.device.type == "cuda" else None), dim, value))


# %%
_p = pad_dim(torch.ones(2, 3, 4), 5, dim=1)
assert _p.shape == (2, 5, 4) and _p[:, 3:].abs().sum() == 0 and _p[:, :3].eq(1).all()
assert pad_dim(torch.ones(2, 3, dtype=torch.bool), 4, 1, False).tolist() == [[True] * 3 + [False]] * 2
assert all_max(7) == 7 and gather_padded(_x) is _x and gather_many([_x])[0] is _x  # one process: nothing to do
assert all_gather_object({"a": 1}) == [{"a": 1}] and wrap_ddp(_lin := torch.nn.Linear(2, 2), _ctx) is _lin

# %% [markdown]
# The two-process behaviour (gradients that match one process on the whole batch) is tested with real `gloo`
# process groups in `tests/test_ddp.py`; a notebook cell cannot start them.
