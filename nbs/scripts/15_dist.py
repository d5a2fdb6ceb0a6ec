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

import functools
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as td


# %% [markdown]
# # Distributed helpers
#
# > The only module that touches process groups: start from `torchrun`'s environment, gather, offsets, sums.
#
# It gathers a batch's tensors in one call (ragged dimensions padded, one collective for the tensors with gradient, one
# for the masks), gives the local-row offset and sums of counts, and treats one process as the trivial case.

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
# rank is 0 of 1. The trainer and the methods never call `torch.distributed` themselves.

# %% [markdown]
# ## Reading the launcher's environment

# %%
#| export
@dataclass
class DistContext:
    "Who this process is in the run, and how to reach the others (see `gather` for the tensors of a batch)."
    rank: int = 0                 # global rank
    world_size: int = 1           # number of processes
    local_rank: int = 0           # rank on this machine (picks the GPU)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None    # 'gloo' | 'nccl' | None (single process)

    @property
    def is_main(self) -> bool: return self.rank == 0
    @property
    def distributed(self) -> bool: return self.world_size > 1


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
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world <= 1:
        return DistContext(0, 1, 0, dev, None)
    backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
    if not td.is_initialized():
        if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
            raise RuntimeError("WORLD_SIZE > 1 but MASTER_ADDR/MASTER_PORT are not set: launch with torchrun")
        td.init_process_group(backend=backend, rank=rank, world_size=world)
    return DistContext(td.get_rank(), td.get_world_size(), local, dev, backend)


def cleanup(ctx: DistContext) -> None:
    "Leave the process group (no-op in one process), after every process has arrived."
    # The barrier first: a process that tears gloo's connections down while its peer is still in a collective makes
    # the peer's background thread abort the process ("terminate called without an active exception", SIGABRT).
    if ctx.distributed and td.is_initialized():
        td.barrier()
        td.destroy_process_group()


# %%
_ctx = init_distributed("cpu")
assert (_ctx.rank, _ctx.world_size, _ctx.is_main, _ctx.distributed) == (0, 1, True, False)

# %% [markdown]
# ## Gathering a batch's tensors: one call, two collectives
#
# A loss needs several tensors of every process: CLIP its image and text embeddings, PowerCLIP also the region
# and phrase embeddings and their validity masks, C2LIP its concepts. `gather(ctx, tensors, pad)` takes them as a
# dict and returns them gathered, in rank order, with the index of this process's first row:
#
# ```python
# g = gather(ctx, {"image": img, "text": txt, "regions": reg, "region_valid": rv},   # (R, D), (R, D), (R, M, D), (R, M)
#            pad={"regions": {1: 0.0}, "region_valid": {1: False}})
# g.all["image"]   # (C, D): every process's rows, in rank order; float tensors keep gradient
# g.offset         # where this process's rows start in g.all (rank * R when every process holds R rows)
# g.rows["image"]  # [R_0, R_1, ...]: the rows each process contributed
# ```
#
# **Why one collective for the tensors with gradient.** Every gather with gradient issues a collective in the
# *backward* pass too, in the order the autograd engine reaches it. That order follows the graph, and the graphs
# of two processes differ when one pads a ragged tensor and the other does not; collectives issued in different
# orders on different processes pair up the wrong tensors, silently when their shapes agree (`tests/test_ddp.py`
# caught it once). So all float tensors are packed into one flat buffer and travel in a single `all_gather` with
# gradient: one backward collective, nothing to order. Masks and integer tensors carry no gradient and travel in
# one plain `all_gather` (as `uint8` when they are all bool: some backends cannot gather bool).
#
# **Ragged tensors.** Captions have different numbers of words $W$ and tree nodes $K$, images different numbers
# of regions $M$, so one process's phrase embeddings may be `(R, 12, D)` and another's `(R, 15, D)`. A dimension
# named in `pad` is padded at the end to its largest size over the processes, with the value given (invalid
# entries: `False` in a validity mask, so they never enter the loss). Any other dimension but the first must agree.
#
# **Packed tensors.** The first dimension may differ between processes (a tensor of all concepts of a batch,
# `(P, D)` with $P$ different on each process): rows are concatenated in rank order and `g.rows[name]` says how
# many came from each process, so that indices into the packed rows can be shifted by `g.starts(name)[rank]`.
# To send tensors of unequal size through `all_gather`, each is padded to the largest shape first, and the padding
# rows are cut off again after the collective.
#
# One small collective comes first: the shapes of every tensor of every process (one integer tensor), from which
# each process knows the padded sizes and the rows to keep. In one process there is nothing to do: `g.all` *is* the
# dict that was passed (no copy), `g.offset` is 0, and `11_loss`'s skeleton recognises the local tensors.

# %%
#| export
_MAX_DIMS = 8  # tensors of up to 8 dimensions; the shape exchange has a fixed width


@dataclass
class Gathered:
    "The tensors of every process (see `gather`)."
    all: dict[str, torch.Tensor]   # name -> rows of every process in rank order (one process: the dict passed in)
    offset: int                    # index in all[first name] of this process's first row
    rows: dict[str, list[int]]     # name -> rows contributed by each process, in rank order

    def starts(self, name: str) -> list[int]:
        "Index in `all[name]` of each process's first row (to shift indices into packed rows)."
        out, n = [], 0
        for r in self.rows[name]:
            out.append(n)
            n += r
        return out


def pad_dim(x: torch.Tensor, size: int, dim: int = 1, value=0) -> torch.Tensor:
    "Pad `x` along `dim` at the end up to `size` with `value` (no-op when already that size)."
    n = x.shape[dim]
    if n > size:
        raise ValueError(f"cannot pad dim {dim} of size {n} down to {size}")
    if n == size:
        return x
    shape = list(x.shape)
    shape[dim] = size - n
    return torch.cat([x, x.new_full(shape, value)], dim)


def gather(ctx: DistContext, tensors: dict[str, torch.Tensor],
           pad: dict[str, dict[int, object]] | None = None) -> Gathered:
    """Every process's rows of each tensor, in rank order: float tensors with gradient in ONE collective, the others
    (bool masks, integer ids) in one more. `pad[name] = {dim: value}`: dims whose size differs between processes,
    padded at the end to their maximum with `value`. Dim 0 may differ too (packed rows, see `Gathered.rows`)."""
    pad = pad or {}
    unknown = sorted(set(pad) - set(tensors))
    if unknown:
        raise ValueError(f"pad names tensors that are not gathered: {unknown}")
    if not ctx.distributed:
        return Gathered(tensors, 0, {k: [v.shape[0]] for k, v in tensors.items()})
    if not tensors:
        return Gathered({}, 0, {})
    names = list(tensors)
    for k in names:
        if tensors[k].dim() > _MAX_DIMS or tensors[k].dim() == 0:
            raise ValueError(f"{k!r}: need 1 to {_MAX_DIMS} dims, got {tensors[k].dim()}")
        if 0 in pad.get(k, {}):
            raise ValueError(f"{k!r}: dim 0 (rows) needs no padding: processes may hold different row counts")
    # 1. every process's shapes, (G, n, 1 + _MAX_DIMS): [ndim, size_0, size_1, ...]
    dev = next(iter(tensors.values())).device
    shape = torch.tensor([[t.dim(), *t.shape, *[0] * (_MAX_DIMS - t.dim())] for t in tensors.values()], device=dev)
    shapes = torch.stack(_all_gather(shape)).cpu()                       # (G, n, 1 + _MAX_DIMS)
    full, rows = {}, {}
    for i, k in enumerate(names):
        t, s = tensors[k], shapes[:, i]                                   # (G, 1 + _MAX_DIMS)
        if (s[:, 0] != t.dim()).any():
            raise ValueError(f"{k!r} has different numbers of dims on different processes")
        size = s[:, 1:1 + t.dim()]                                        # (G, ndim)
        for d in range(1, t.dim()):
            if d not in pad.get(k, {}) and (size[:, d] != size[0, d]).any():
                raise ValueError(f"dim {d} of {k!r} differs between processes ({size[:, d].tolist()}): name it in pad")
        rows[k] = size[:, 0].tolist()
        full[k] = size.max(0).values.tolist()                             # the padded shape, the same everywhere
    # 2. pad every tensor to the common shape: ragged dims with their value, missing rows with zeros (cut off below)
    padded = {}
    for k in names:
        x = tensors[k]
        for d, value in pad.get(k, {}).items():
            x = pad_dim(x, full[k][d], d, value)
        padded[k] = pad_dim(x, full[k][0], 0, False if x.dtype == torch.bool else 0)
    # 3. one collective per kind, flat buffers of the same size on every process
    out = {}
    floats = [k for k in names if padded[k].is_floating_point()]
    others = [k for k in names if not padded[k].is_floating_point()]
    if floats:
        dtype = functools.reduce(torch.promote_types, [padded[k].dtype for k in floats])
        flat = torch.cat([padded[k].to(dtype).reshape(-1) for k in floats])          # (sum of numels,)
        out.update(_unpack(_all_gather_grad(flat), floats, padded, rows))
    if others:
        dtype = torch.uint8 if all(padded[k].dtype == torch.bool for k in others) else torch.int64
        flat = torch.cat([padded[k].detach().to(dtype).reshape(-1) for k in others])
        out.update(_unpack(_all_gather(flat), others, padded, rows))
    return Gathered({k: out[k] for k in names}, sum(rows[names[0]][:ctx.rank]), rows)


def _unpack(parts: list[torch.Tensor], names: list[str], padded: dict, rows: dict) -> dict[str, torch.Tensor]:
    "Per-process flat buffers -> name -> (sum of rows, ...) in rank order, padding rows cut, original dtypes."
    sizes = [padded[k].numel() for k in names]
    per = [dict(zip(names, p.split(sizes))) for p in parts]              # per process: name -> flat
    return {k: torch.cat([q[k].reshape(padded[k].shape)[:rows[k][r]] for r, q in enumerate(per)]).to(padded[k].dtype)
            for k in names}


def _all_gather_grad(x: torch.Tensor) -> list[torch.Tensor]:
    """[x of rank 0, x of rank 1, ...] (same shapes): all_gather whose backward returns each process the sum of every
    loss's gradient."""
    import torch.distributed.nn.functional as dnf  # imported late: it registers autograd functions
    return list(dnf.all_gather(x.contiguous()))


def _all_gather(x: torch.Tensor) -> list[torch.Tensor]:
    "[x of rank 0, x of rank 1, ...] (same shapes), without gradient."
    out = [torch.empty_like(x) for _ in range(td.get_world_size())]
    td.all_gather(out, x.detach().contiguous())
    return out


# %% [markdown]
# In one process `gather` hands back what it was given, and refuses to pad a name it is not gathering:

# %%
_x = torch.randn(3, 4, requires_grad=True)
_g = gather(_ctx, _d := {"image": _x, "valid": torch.ones(3, 2, dtype=torch.bool)}, pad={"valid": {1: False}})
assert _g.all is _d and _g.offset == 0 and _g.rows == {"image": [3], "valid": [3]} and _g.starts("image") == [0]
try:
    gather(_ctx, {"image": _x}, pad={"text": {1: 0.0}})
    raise AssertionError
except ValueError as e:
    print(e)
_p = pad_dim(torch.ones(2, 3, 4), 5, dim=1)
assert _p.shape == (2, 5, 4) and _p[:, 3:].abs().sum() == 0 and _p[:, :3].eq(1).all()
assert pad_dim(torch.ones(2, 3, dtype=torch.bool), 4, 1, False).tolist() == [[True] * 3 + [False]] * 2


# %% [markdown]
# The two-process behaviour (values in rank order, padding, packed rows of different counts, and gradients that
# match one process on the whole batch for every method) is tested with real `gloo` process groups in
# `tests/test_ddp.py`; a notebook cell cannot start them.

# %% [markdown]
# ## Sums, maxima and means over the processes
#
# For counts and logging: a method that needs a batch-wide number (CLIP-PGS's mean drop count over the global
# batch) sums it with `all_sum`; the trainer averages the loss with `all_mean`, so that every process skips the
# same bad step (a process that skipped alone would leave the others waiting in the gradient all-reduce).

# %%
#| export
def _on() -> bool:
    return td.is_available() and td.is_initialized() and td.get_world_size() > 1


def _default_device():
    return torch.device("cuda", torch.cuda.current_device()) if td.get_backend() == "nccl" else torch.device("cpu")


def all_sum(x: torch.Tensor) -> torch.Tensor:
    "Sum of a (detached) tensor over the processes (the tensor itself in one process)."
    if not _on():
        return x
    y = x.detach().clone().to(_default_device())
    td.all_reduce(y)
    return y.to(x.device)


def all_max(n: int) -> int:
    "Maximum of an integer over the processes."
    if not _on():
        return int(n)
    t = torch.tensor([int(n)], device=_default_device())
    td.all_reduce(t, op=td.ReduceOp.MAX)
    return int(t.item())


def all_mean(x: torch.Tensor) -> torch.Tensor:
    "Mean of a (detached) tensor over the processes: for logging, and so that every process skips the same bad step."
    if not _on():
        return x.detach()
    return all_sum(x) / td.get_world_size()


def barrier() -> None:
    if td.is_available() and td.is_initialized():
        td.barrier()


def all_gather_object(obj) -> list:
    "[obj of rank 0, obj of rank 1, ...] (picklable objects, e.g. RNG states for a checkpoint)."
    if not _on():
        return [obj]
    out = [None] * td.get_world_size()
    td.all_gather_object(out, obj)
    return out


def wrap_ddp(module: torch.nn.Module, ctx: DistContext, find_unused_parameters: bool = False) -> torch.nn.Module:
    "DistributedDataParallel around `module` when there are several processes; the module itself otherwise."
    if not ctx.distributed:
        return module
    from torch.nn.parallel import DistributedDataParallel
    ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return DistributedDataParallel(module, device_ids=ids, find_unused_parameters=find_unused_parameters)


# %%
_t = torch.tensor([2.0, 3.0])
assert all_sum(_t) is _t and all_max(7) == 7 and torch.equal(all_mean(_t), _t)  # one process: nothing to do
assert all_gather_object({"a": 1}) == [{"a": 1}] and wrap_ddp(_lin := torch.nn.Linear(2, 2), _ctx) is _lin


# %% [markdown]
# ## Iterating together
#
# Processes that step through data of their own in lockstep (the trainer on shards whose epochs may differ in length
# between processes, `50_train`) must stop together: a process that ran out and went on to its next collective would
# leave the others waiting in theirs until the timeout. `Lockstep(iterable)` yields an item only while every process
# has one (a sum of "I have one" flags per item: one small all-reduce), and stops all when one has none. A process
# that still had items says so in `cut`; the rest is not read (on a large imbalance, reading it could outlast the
# others' collective timeout).

# %%
#| export
class Lockstep:
    "The items of `iterable` while every process still has one; `cut`: this process still had items at the stop."
    def __init__(self, iterable):
        self.iterable, self.cut = iterable, False

    def __iter__(self):
        world = td.get_world_size() if _on() else 1
        it = iter(self.iterable)
        while True:
            item = next(it, None)
            if int(all_sum(torch.tensor([int(item is not None)]))) < world:
                self.cut = item is not None
                return
            yield item


# %%
_ls = Lockstep(range(3))
assert list(_ls) == [0, 1, 2] and not _ls.cut     # one process: every item (two: tests/test_epoch_lockstep.py)


# %% [markdown]
# ## Waiting while the main process works alone
#
# The trainer evaluates on the main process only (`50_train`, "Evaluation while training"); the other processes wait
# for it. A plain `barrier` on the run's process group would wait under that group's timeout (by default 30 minutes
# for gloo, 10 for nccl): an evaluation that takes longer kills the run (nccl's watchdog aborts the process, gloo raises).
# So the wait goes through a process group of its own, `wait_group(ctx, timeout_s)`, made once by every process at the
# same point, on gloo whatever the run's backend (a CPU barrier: no GPU stream is held while waiting), with its own long
# timeout; `wait_for_main(group)` is a barrier on it. The run's own group is left idle meanwhile, with no collective in
# flight, so its timeout does not run. In one process both do nothing. `tests/test_eval_every.py` runs two gloo
# processes whose run group has a timeout of two seconds, the main one busy for longer: the plain barrier fails, this
# wait does not, and the run group still works afterwards.

# %%
#| export
def wait_group(ctx: DistContext, timeout_s: float):
    "A gloo group of every process with a timeout of `timeout_s` seconds, for `wait_for_main` (None in one process)."
    if not ctx.distributed:
        return None
    from datetime import timedelta
    return td.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def wait_for_main(group) -> None:
    "Every process waits here until all have arrived, under `group`'s own timeout (see above); no-op for None."
    if group is not None:
        td.barrier(group=group)


# %%
assert wait_group(_ctx, 60) is None
wait_for_main(None)
