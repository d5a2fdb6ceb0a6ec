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
#| default_exp train

# %%
#| export
from __future__ import annotations

import contextlib, dataclasses, math, os, signal, sys, time, warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import yaml

from powerclip import dist as pdist
from powerclip.accum import accumulate
from powerclip.checkpoint import (TrainState, bias_kwargs, check_run_folder, export_weights, load_checkpoint,
                                  move_aside, previous_checkpoint, read_resume, resume_changes, resume_position,
                                  rng_state, run_marks, save_checkpoint, save_snapshot, seed_all, set_rng_state,
                                  shape_mismatch, stale_run, weights_problem)
from powerclip.commandline import (ArgumentParser, Diverged, Interrupted, StopSignals, UsageError, check_device,
                                   check_number, run_main, usage_errors)
from powerclip.config import TrainConfig, check_kwargs, load_config, method_options, to_dict
from powerclip.faults import (Writes, check_geometry, check_resume_end, check_setup, check_world_scene, lock_run,
                              refuse_non_finite, state_bytes)
from powerclip.faults import check_finite, finite as _finite, free_numbers   # _finite: its old name
from powerclip.data import (SAMPLE_SKIP_REASONS, BatchSpec, Geometry, Loader, StreamPosition, add_counts, make_loader,
                            shard_urls, steps_per_epoch, world_config)
from powerclip.measure import PeakMemory
from powerclip.optim import lr_factor, make_optimizer, make_scheduler   # lr_factor: tests import it from here too
from powerclip.runrecord import begin_segment, run_threads
from powerclip.seeds import mix_seed, run_seeds
from powerclip.trainlog import MetricLogger, plot_metrics, read_metrics  # read_metrics: `compare` imports it from here
from powerclip.train_eval import default_evaluator, evaluate_isolated
from powerclip.methods import Method, get_method

# %%
#| hide
import json, tempfile
import numpy as np
from fastcore.test import test_close, test_eq, test_fail
from powerclip.data import write_shard
from torch.testing import assert_close


# %% [markdown]
# # The trainer
#
# > One trainer for every method.
#
# A config per component, one run seed, `build_run` that assembles a run once, AdamW with cosine warm-up, precision, exact
# resume from checkpoints, skipped bad steps, progress, CSV/TensorBoard logs and plots, data-parallel on any number of
# processes.

# %% [markdown]
# The trainer composes the pieces of the earlier notebooks and knows none of them by name:
#
# - a **model** from `powerclip.model.create_model(name)` (open_clip towers), whose geometry (image size, patch
#   size, context length) `powerclip.model.model_geometry` reads from its config before it is built;
# - a **method** from the registry of `40_methods`, which says what the data must build (`needs()`), what the
#   forward pass returns and which named loss terms to add; the trainer sums the terms whose names do not start
#   with `_` and logs all of them;
# - **batches** from `powerclip.data.make_loader(spec, epoch, start_step | position, rank, world_size)`, where the spec
#   holds the data config, the model's geometry, the method's needs and the run seed; batch $b$ of epoch $e$ is a pure
#   function of `(spec, e, b)` on the world, and of `(spec, e)` and the loader's position on shards;
# - **processes** through `powerclip.dist` (the only module that touches process groups), and time and memory
#   through `powerclip.measure`.
#
# `build_run(cfg, ctx)` assembles these once, for the trainer, `benchmarks/train_step_ratio.py` and
# `tests/test_ddp.py` alike. The run's config is one dataclass of dataclasses (`49a_config`), read from a small YAML
# preset plus `key=value` overrides, and written next to the run's outputs with what was derived from it (every random
# stream's seed, the geometry, the method's batch needs). What a run writes and reads back, checkpoints, weights and
# snapshots, is `49b_checkpoint`. The optimiser and its learning-rate schedule are `49e_optim`; the training log
# (`metrics.csv`, TensorBoard, the loss plot) is `49f_trainlog`.

# %% [markdown]
# ## One step
#
# The method's forward pass runs inside an `nn.Module` (`MethodForward`), so that DistributedDataParallel wraps
# it: DDP synchronises gradients only for computations that pass through its `forward`. The loss is averaged
# over the processes *before* deciding whether the step is bad, so every process skips the same steps (a
# process that skipped alone would leave the others waiting in the gradient all-reduce).
#
# **Accumulation.** With `accum_steps = k` a process's batch is $k$ micro-batches and the step computes the gradient
# of the whole batch's loss all the same (`49c_accum`, GradCache): the loss depends on the parameters only through
# the forward outputs $z_i$ of the micro-batches, so $\partial L/\partial\theta = \sum_i (\partial L/\partial z_i)
# \,\partial z_i/\partial\theta$. Every micro-batch is embedded without gradient, the method's loss is computed
# once on the joined outputs (gathered across processes as always) and differentiated with respect to them, then each
# micro-batch is embedded again with gradient, replaying its random state, and its slice of $\partial L/\partial z$
# is back-propagated; under DDP the first $k-1$ of these backward passes run in `no_sync()`. The bad-step decision
# sits between the loss and that backward, as for $k=1$; checkpoints fall between optimiser steps, so resume stays
# exact.

# %%
#| export
class MethodForward(torch.nn.Module):
    """The model's forward pass as the method defines it: `forward(batch) -> method.forward(model, batch, modules)`.
    `modules` (a method's training-time parameters) is a submodule here, so DDP synchronises it with the model."""
    def __init__(self, model: torch.nn.Module, method, modules: torch.nn.Module | None = None):
        super().__init__()
        self.model, self.method, self.modules_ = model, method, modules

    def forward(self, batch: dict) -> dict:
        return self.method.forward(self.model, batch, self.modules_)


def method_forward(model: torch.nn.Module, method) -> MethodForward:
    "Let the method change the model (`setup_model`) and build its modules (on the model's device), then wrap both."
    method.setup_model(model)
    modules = method.build_modules(model)
    if modules is not None:
        modules.to(next(model.parameters()).device)
    return MethodForward(model, method, modules)


def to_device(batch: dict, device) -> dict:
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def autocast_for(precision: str, device: torch.device):
    "bf16 autocast, or nothing (fp32, fp64). 'auto': bf16 on GPU, fp32 on CPU."
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def forward_loss(fwd, method, batch: dict, ctx: pdist.DistContext,
                 precision: str = "fp32") -> tuple[torch.Tensor, dict]:
    "(total loss, named terms) of one batch: the sum of the terms without a leading underscore."
    with autocast_for(precision, ctx.device):
        out = fwd(batch)
        terms = method.loss(out, batch, ctx)
    summed = [v for k, v in terms.items() if not k.startswith("_")]
    if not summed:
        raise ValueError(f"method {method.name!r} returned no loss term (only {sorted(terms)})")
    return sum(summed), terms


def train_step(fwd, method, batch, ctx, opt, sched, state: TrainState, cfg: TrainConfig, model,
               stop: int = 0) -> dict:
    """Forward, backward, optimiser and scheduler step; a non-finite loss or gradient norm skips the update. `stop`: a
    signal this process received (0: none); `out['stop']` is the one every process agrees on (see "Interruptions")."""
    if cfg.accum_steps > 1:   # k micro-batches, the loss once on their joined outputs (49c_accum)
        loss, terms, backward = accumulate(fwd, method, batch, ctx, cfg.accum_steps,
                                           lambda: autocast_for(cfg.precision, ctx.device))
    else:
        loss, terms = forward_loss(fwd, method, batch, ctx, cfg.precision)
        backward = loss.backward
    # one all-reduce, as before: the loss's mean, and whether any process got SIGINT or SIGTERM (the flags' means),
    # made on the device (fills, no copy from the host); and one read of the three, as the loss's finiteness was read
    reduced = torch.zeros(3, device=loss.device, dtype=torch.float32)
    reduced[0] = loss.detach().float()
    if stop:
        reduced[1 if stop == signal.SIGINT else 2] = 1.0
    reduced = pdist.all_mean(reduced)
    loss_all, (value, got_int, got_term) = reduced[0], reduced.tolist()
    stop = signal.SIGTERM if got_term > 0 else signal.SIGINT if got_int > 0 else 0
    opt.zero_grad(set_to_none=True)
    ok = math.isfinite(value)
    gnorm = torch.tensor(float("nan"))
    if ok:
        backward()
        params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]  # model + method modules
        gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip or float("inf"))
        ok = bool(torch.isfinite(gnorm))  # gradients are all-reduced already: every process agrees
    if ok:
        opt.step()
        with torch.no_grad():  # as CLIP: the temperature stays below 100
            if hasattr(model, "logit_scale"):
                model.logit_scale.clamp_(0, math.log(100))
        state.bad_in_row = 0
    else:
        opt.zero_grad(set_to_none=True)
        state.bad_total += 1
        state.bad_in_row += 1
    lr = opt.param_groups[0]["lr"]  # the rate this step used (logged), before the schedule moves on
    with warnings.catch_warnings():  # a skipped first step makes torch warn about the call order; the
        warnings.simplefilter("ignore", UserWarning)  # schedule is indexed by step, so nothing is lost
        sched.step()
    return dict(loss=loss_all, grad_norm=gnorm.detach(), ok=ok, lr=lr, stop=int(stop),
                **{k: v.detach() for k, v in terms.items()})


# %% [markdown]
# ## Checking a run before it is built
#
# A mistake in a config should cost a second, not the minutes of building a model and reading data before it
# shows. `validate(cfg, world_size)` checks everything that can be known without the model, and raises a
# `ValueError` whose message starts with the key to change: the method and its options; the model's name and
# geometry (from its config file, `powerclip.model.model_geometry`), `model.kwargs` typed against open_clip's
# `CLIP` (`check_kwargs`: `model.kwargs.embed_dim=abc` is one line) and a pretrained file that can be read (a copy cut
# short is one line, `weights_problem`; one of another model size is one line when its weights meet the model); the
# batch against the
# data (the world's `world_length`, or for shards every shard path, which must exist unless it is a url, and an epoch
# length); the global batch against the processes; the output folder (not a file) and the checkpoint to resume from;
# a GPU when `device` asks for one (`check_device`). `build_run` calls it first, and the command line inside
# `usage_errors()`, where its message becomes the one line of a usage error (`17_commandline`).
#
# On its way `validate` builds what needs no model: the run's seeds, the method (with its own random stream), the
# geometry and the loader's `BatchSpec`. It returns them (`Checked`), and `build_run` assembles the run from them.

# %%
#| export
def _is_url(u: str) -> bool: return "://" in u or u.startswith("pipe:")


@dataclass
class Checked:
    "What `validate` built on its way, for `build_run`: everything of a run that needs no model."
    cfg: TrainConfig       # a copy of the config, data.batch_size per process (global_batch_size resolved)
    seeds: dict            # every random stream's seed, derived from cfg.seed by name
    method: Method         # the method, with its own random stream (seeds['method'])
    geometry: Geometry     # the model's image size, patch size, context length, from its config
    spec: BatchSpec        # what the loader builds (data config, geometry, the method's needs, the run seed)


def validate(cfg: TrainConfig, world_size: int | None = None) -> Checked:
    """Check a run before its model is built (see above); a ValueError naming the key, else what was built on the way
    (`Checked`). `world_size`: processes (None: torchrun's WORLD_SIZE, else 1). The checks that need no import come
    first."""
    G = world_size or int(os.environ.get("WORLD_SIZE", 1))
    method_options(cfg.method, cfg.method_cfg)       # an unknown method or option: a ValueError naming the key
    seeds = run_seeds(cfg.seed)
    method = get_method(cfg.method, cfg.method_cfg, seed=seeds["method"])
    B = cfg.data.batch_size
    if cfg.global_batch_size is not None:
        if cfg.global_batch_size % G:
            raise ValueError(f"global_batch_size: {cfg.global_batch_size} is not divisible by the {G} processes "
                             f"(give a multiple of {G})")
        B = cfg.global_batch_size // G
    if B % cfg.accum_steps:
        raise ValueError(f"accum_steps: {B} rows per process do not split into {cfg.accum_steps} equal "
                         f"micro-batches (give a divisor of {B})")
    if cfg.accum_steps > 1 and method.accum_obstacle:
        raise ValueError(f"accum_steps: method {cfg.method!r} cannot accumulate gradients exactly: "
                         f"{method.accum_obstacle} (use accum_steps=1)")
    pre = cfg.model.pretrained
    if pre == "required":
        raise ValueError(f"model.pretrained: this preset fine-tunes a pretrained {cfg.model.name}: give its weights "
                         "with model.pretrained=/path/to/open_clip_state_dict.pt (nothing is downloaded)")
    if pre is not None and not Path(pre).is_file():
        raise ValueError(f"model.pretrained: no file {pre!r} (a local open_clip state dict; nothing is downloaded)")
    if pre is not None and (why := weights_problem(pre)):
        raise ValueError(f"model.pretrained: {pre!r} cannot be read ({why}): a damaged or partial copy?")
    check_setup(cfg, B, G)     # a trainer's checkpoint as pretrained, a batch of 1, a dangling out_dir, .. (49g_faults)
    data = dataclasses.replace(cfg.data, batch_size=B)
    if data.source == "world" and B * G > data.world_length:
        raise ValueError(f"data.batch_size: {B} per process x {G} process(es) is more than "
                         f"data.world_length={data.world_length}: an epoch would have no step (a smaller "
                         "batch or a longer world)")
    if data.source == "wds":
        urls = shard_urls(data.shards)
        missing = [u for u in urls if not _is_url(u) and not Path(u).is_file()]
        if not urls or missing:
            raise ValueError(f"data.shards: {len(missing)} of {len(urls)} shard file(s) do not exist, e.g. "
                             f"{(missing or [data.shards])[0]!r} (give files, brace patterns such as "
                             "cc12m/{00000..01242}.tar, or urls)")
        if data.samples_per_epoch is not None and data.samples_per_epoch < B:
            raise ValueError(f"data.samples_per_epoch: {data.samples_per_epoch} is less than one batch of {B}")
        if cfg.max_steps is None and data.samples_per_epoch is None:
            raise ValueError("max_steps: shards without data.samples_per_epoch have no known epoch length: set "
                             "max_steps (or data.samples_per_epoch)")
    out = Path(cfg.out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out_dir: {cfg.out_dir!r} is a file (give a folder; it is created if missing)")
    if any(a.exists() and not a.is_dir() for a in out.parents):
        raise ValueError(f"out_dir: {cfg.out_dir!r} is inside a file (give a folder)")
    if (cfg.resume not in ("auto", "never") and not Path(cfg.resume).is_file()
        and not previous_checkpoint(cfg.resume).is_file()):
        raise ValueError(f"resume: no checkpoint {cfg.resume!r} (auto, never, or an existing .pt file)")
    if cfg.device is not None:
        check_device("device", cfg.device, hint="device=cpu, or null: a GPU when there is one")
    for k, v in free_numbers(data.world, "data.world"):
        check_number(k, v)
    from powerclip.model import arch_pool, map_kwargs, model_geometry   # imports open_clip: seconds
    try:
        model_geometry(cfg.model.name)                        # the architecture exists
    except (ValueError, TypeError, NotImplementedError) as e:
        raise ValueError(f"model: {e}") from None
    import open_clip
    kwargs = check_kwargs(open_clip.CLIP.__init__, cfg.model.kwargs, "model.kwargs")   # typed: embed_dim=abc, one line
    # what the method asks of the model (SigLIP's t, b), a snapshot's b (it loads), then the run's own: all recorded
    kwargs = {**method.model_kwargs(), **bias_kwargs(pre), **kwargs}
    try:
        map_kwargs(cfg.model.name, kwargs, cfg.model.pool)      # a MAP architecture asked for 'tok' or 'avg'
        geometry = model_geometry(cfg.model.name, kwargs)
        pool = cfg.model.pool or arch_pool(cfg.model.name, kwargs)
    except (ValueError, TypeError, NotImplementedError) as e:
        raise ValueError(f"model: {e}") from None
    if pool not in method.pools:
        raise ValueError(f"model.pool: method {cfg.method!r} pools by {' or '.join(method.pools)}, not "
                         f"{pool!r} (see its notebook)")
    if why := method.device_problem(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")):
        raise ValueError(f"method_cfg: {why}")                # e.g. PowerCLIP's impl='triton' without a GPU
    try:
        spec = BatchSpec(data, geometry, method.needs(), cfg.seed)
    except ValueError as e:
        raise ValueError(f"method_cfg: {e}") from None      # e.g. stored masks on the world
    check_geometry(geometry)
    if data.source == "world":
        try:
            world_config(data, geometry)
        except (TypeError, ValueError) as e:
            raise ValueError(f"data.world: {e}") from None
        check_world_scene(data, geometry)       # sizes, tries, more objects than fit: one scene drawn, one line
    return Checked(dataclasses.replace(cfg, data=data, model=dataclasses.replace(cfg.model, kwargs=kwargs)), seeds,
                   method, geometry, spec)


# %%
with tempfile.TemporaryDirectory() as d:
    _file = Path(d) / "a_file"
    _file.write_text("")
    _ck = validate(load_config("smoke", {"global_batch_size": 16}), world_size=2)
    test_eq((_ck.geometry, _ck.cfg.data.batch_size, _ck.spec.data.batch_size, _ck.method.name),
            (Geometry(32, 8, 77), 8, 8, "powerclip"))
    for ov, msg in [({"data.batch_size": 65}, "data.batch_size: 65 per process x 1 process(es) is more "
                                              "than data.world_length=64"),
                    ({"out_dir": str(_file)}, "out_dir: "), ({"out_dir": str(_file / "x")}, "is inside a file"),
                    ({"resume": f"{d}/none.pt"}, "resume: no checkpoint"), ({"global_batch_size": 9}, None),
                    ({"model.name": "ViT-X"}, "model: unknown model 'ViT-X'"),
                    ({"method_cfg.masks": "stored"}, "method_cfg: region masks 'stored'"),
                    ({"data.source": "wds", "data.shards": f"{d}/{{0..3}}.tar"},
                     "data.shards: 4 of 4 shard file(s) do not exist"),
                    ({"data.world": {"max_objectz": 2}}, "data.world: "),
                    ({"model.pretrained": "required"}, "model.pretrained=/path"),
                    ({"model.pool": "mean"}, "model.pool: must be tok, avg, map or null")]:
        if msg:
            test_fail(lambda: validate(load_config("smoke", ov)), contains=msg)
    test_fail(lambda: validate(load_config("smoke", {"global_batch_size": 9}), world_size=2),
              contains="global_batch_size: 9 is not divisible by the 2")
    # a method that works with one pooling refuses the other (A-CLIP's EMA towers pool by the class token)
    test_fail(lambda: validate(load_config("smoke", {"model.pool": "avg"}, "aclip")),
              contains="model.pool: method 'aclip' pools by tok")
    if not torch.cuda.is_available():
        test_fail(lambda: validate(load_config("smoke", {"device": "cuda"})), contains="device: 'cuda' asks for a GPU")
    for n in range(4):
        write_shard(Path(d) / f"{n}.tar", [])
    test_fail(lambda: validate(load_config("smoke", {"data.source": "wds", "data.shards": f"{d}/{{0..3}}.tar",
                                                     "max_steps": None})),
              contains="max_steps: shards")


# %% [markdown]
# ## A run, assembled once
#
# `build_run(cfg, ctx)` checks the config (`validate`), which gives it the first three of what a step needs, then
# builds the rest, in this order:
#
# 1. the **seeds**: every random stream of the run derived from `cfg.seed` by name (`powerclip.seeds.run_seeds`);
# 2. the **method** (with its own seed) and what it needs of a batch;
# 3. the **geometry**, read from the model config before the model exists, and with the data config, the needs and
#    the run seed the `BatchSpec` of the loader;
# 4. the **model**, initialised from the `init` stream (the same weights on every process; DDP also broadcasts rank
#    0's), checked against the geometry, on the device, in float64 for `precision='fp64'`;
# 5. the method's **forward** (`MethodForward`: the model, the method's own modules) in DDP when distributed;
# 6. the **optimiser** over the model and the modules, and the **schedule** over the run's total steps;
# 7. each process's **forward stream** (`forward` seed with the rank mixed in), for what is random in the forward pass.
#
# The trainer, `benchmarks/train_step_ratio.py` and `tests/test_ddp.py` all step what it returns, so there is one
# way to build a run.

# %%
#| export
@dataclass
class Run:
    "A run assembled by `build_run`: what a training step needs."
    cfg: TrainConfig                 # the resolved config (data.batch_size per process)
    ctx: pdist.DistContext
    model: torch.nn.Module           # the open_clip model, on ctx.device
    method: Method
    modules: torch.nn.Module | None  # the method's own trained modules (saved beside the model)
    fwd: torch.nn.Module             # MethodForward(model, method, modules), in DDP when distributed (compiled if
                                     # asked)
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    total: int                       # optimiser steps of the schedule
    geometry: Geometry               # the model's image size, patch size, context length
    spec: BatchSpec                  # what the loader builds (data config, geometry, the method's needs, the run seed)
    seeds: dict                      # every random stream's seed, derived from cfg.seed by name

    def loader(self, epoch: int = 0, start_step: int = 0, position: StreamPosition | dict | None = None) -> Loader:
        "This process's batches of `epoch`, from `start_step` on, or from `position` (a checkpoint's; shards need it)."
        return make_loader(self.spec, epoch, start_step, rank=self.ctx.rank, world_size=self.ctx.world_size,
                           position=position, pin_memory=self.ctx.device.type == 'cuda')

    def prepare(self, batch: dict) -> dict:
        "A host batch made ready for `fwd`: the method's derived inputs, on the device (float64 under precision fp64)."
        batch = to_device(self.method.prepare_batch(batch), self.ctx.device)
        if self.cfg.precision == "fp64":
            batch = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in batch.items()}
        return batch

    def step(self, batch: dict, state: TrainState, stop: int = 0) -> dict:
        "One training step on a prepared batch (see `train_step`; `stop`: a signal this process received)."
        return train_step(self.fwd, self.method, batch, self.ctx, self.opt, self.sched, state, self.cfg, self.model,
                          stop)

    def derived(self) -> dict:
        "What the run derived from its config (written into config.yaml as a record)."
        return dict(seeds=dict(self.seeds), geometry=asdict(self.geometry), needs=asdict(self.spec.needs))


def build_run(cfg: TrainConfig, ctx: pdist.DistContext, total: int | None = None) -> Run:
    """Model, method, forward, modules, optimiser and schedule of a run, assembled once (see above). `total`: schedule
    length (None: from cfg)."""
    from powerclip.model import create_model, geometry_of
    ok = validate(cfg, ctx.world_size)  # everything that can be checked before the model is built, and built on the way
    # cfg: a copy, batch per process
    cfg, seeds, method, geometry, spec = ok.cfg, ok.seeds, ok.method, ok.geometry, ok.spec
    seed_all(seeds["init"])  # the same initial weights on every process
    try:
        model, _, _ = create_model(cfg.model.name, cfg.model.pretrained, cfg.model.pool, **cfg.model.kwargs)
    except (RuntimeError, AssertionError):   # pretrained weights of another model size: one line, not open_clip's
        why = None if cfg.model.pretrained is None else shape_mismatch(
            torch.load(cfg.model.pretrained, map_location="cpu", weights_only=True),
            create_model(cfg.model.name, None, cfg.model.pool, **cfg.model.kwargs)[0].state_dict())
        if why is None:
            raise
        raise UsageError(f"model.pretrained: {cfg.model.pretrained} does not fit {cfg.model.name}: {why}") from None
    if geometry_of(model) != geometry:
        raise RuntimeError(f"model geometry {geometry_of(model)} is not its config's {geometry}")
    model.to(ctx.device)
    if cfg.precision == "fp64":
        model.double()
    if cfg.model.grad_checkpointing:
        model.set_grad_checkpointing(True)
    mf = method_forward(model, method)  # the model as the method changes it, and the method's own modules
    if cfg.precision == "fp64":
        mf.double()
    mf.train()
    fwd = pdist.wrap_ddp(mf, ctx, cfg.find_unused_parameters)
    if cfg.model.compile:
        fwd = torch.compile(fwd)
    opt = make_optimizer(model, cfg.optim, mf.modules_, method.modules_lr(cfg.optim.lr))
    total = _total_steps(cfg, steps_per_epoch(cfg.data, ctx.world_size)) if total is None else total
    sched = make_scheduler(opt, cfg.optim, total)
    seed_all(mix_seed(seeds["forward"], ctx.rank))  # per-process streams for whatever is random in the forward pass
    return Run(cfg, ctx, model, method, mf.modules_, fwd, opt, sched, total, geometry, spec, seeds)


def _total_steps(cfg: TrainConfig, spe: int | None) -> int:
    if cfg.max_steps is not None:
        return cfg.max_steps
    if spe is None:
        raise ValueError("the data has no known epoch length (shards without samples_per_epoch): set max_steps")
    return cfg.epochs * spe


# %% [markdown]
# The smoke preset's run: the geometry is the micro model's, the loader builds what PowerCLIP needs at that geometry
# (and a CLIP run of the same config neither trees nor masks), and a step trains.

# %%
_run = build_run(load_config("smoke", {"max_steps": 2}), pdist.init_distributed("cpu"))
test_eq((_run.geometry, _run.total), (Geometry(32, 8, 77), 2))
_b = next(iter(_run.loader()))
test_eq((_b["image"].shape[-1], _b["tokens"].shape[-1], tuple(_b["region_masks"].shape[1:])), (32, 77, (4, 16)))
test_eq(set(next(iter(build_run(load_config("smoke", method="clip"), pdist.init_distributed("cpu")).loader()))),
        {"image", "tokens", "index"})
_out = _run.step(_run.prepare(_b), TrainState())
assert _out["ok"] and set(_run.derived()) == {"seeds", "geometry", "needs"} and _run.derived()["needs"]["regions"] == 4


# %% [markdown]
# ## Evaluation while training
#
# With `eval_every=N` the main process evaluates the model every $N$ steps and at the last one (`49d_train_eval`: the
# evaluation comes from `powerclip-eval`, its random states and the model's modes are put back afterwards); the numbers
# join that step's metrics row (a row is written at such a step even off `log_every`) and TensorBoard under `eval/...`,
# the evaluation's seconds are left out of the training time and the throughput, and the other processes wait for it
# under a timeout of their own (`eval_timeout_s`, `pdist.wait_for_main`), not the run's collective timeout. The
# weights are bitwise those of the run without it (below; `tests/test_eval_every.py` with the real evaluation).

# %% [markdown]
# ## The loop
#
# Steps until `max_steps` (or the epochs' steps), an epoch's loader at a time; a metrics row every `log_every` steps and
# a checkpoint every `ckpt_every`. On shards a row also counts the samples skipped, summed over the processes, in
# this epoch (`skipped`, `skipped_<reason>`) and since the run began (`skipped_cum`, `skipped_cum_<reason>`): the
# loader counts the skips among the samples it consumed (`23_data`), and the checkpoint keeps the epoch's count in
# its data position and the finished epochs' in the `TrainState`, so a resumed run logs the same numbers.
#
# **Epochs of unequal length.** On shards without `data.samples_per_epoch` an epoch is one pass over each process's own
# shards, and the processes' shards may hold different numbers of samples (shard counts that do not divide by the
# processes, shards of different sizes, samples skipped). A process whose epoch ended first would go on to its epoch-end
# sum and the next epoch while the others wait in a step's gather: the run would hang until the collective timeout. So
# in that setting the loop takes the batches in `pdist.Lockstep` (`15_dist`): before each step the processes sum a flag
# "I have a batch" (one small all-reduce per step), and the epoch ends for all as soon as one has none. The batches the
# others still held are not trained on in this epoch (nor read: on a large imbalance reading them could outlast the
# collective timeout); one line of the log says at which batch the epoch ended and how many processes it cut
# (`data.samples_per_epoch` gives every process the same number of steps and avoids it).

# %%
#| export
def _skip_columns(epoch: dict, before: dict, ctx: pdist.DistContext) -> dict:
    "The metrics row's skip columns: this epoch's and the run's counts, each summed over the processes."
    n = pdist.all_sum(torch.tensor([epoch.get(k, 0) for k in SAMPLE_SKIP_REASONS], device=ctx.device)).tolist()
    ep = dict(zip(SAMPLE_SKIP_REASONS, n))
    cum = add_counts(before, ep)
    return dict(skipped=sum(ep.values()), skipped_cum=sum(cum[k] for k in SAMPLE_SKIP_REASONS),
                **{f"skipped_{k}": ep[k] for k in SAMPLE_SKIP_REASONS},
                **{f"skipped_cum_{k}": cum[k] for k in SAMPLE_SKIP_REASONS})


def _log(msg: str, ctx: pdist.DistContext):
    if ctx.is_main:
        print(f"[powerclip.train] {msg}", file=sys.stderr, flush=True)


def train(cfg: TrainConfig, evaluate=None) -> dict:
    """Run (or resume) a training run; returns a summary dict (run_dir, steps, last metrics, bad steps, seconds).
    `evaluate`: the main process's evaluation every `cfg.eval_every` steps (None: `default_evaluator(cfg)`). SIGINT or
    SIGTERM stop it at the next step boundary with a checkpoint: `Interrupted` (see "Interruptions")."""
    ctx = pdist.init_distributed(cfg.device)
    try:   # one trainer per run folder, locked before any file of the run is read, written or moved (49g_faults)
        with (lock_run(cfg.out_dir, ctx, lambda: check_run_folder(cfg)) as lock, StopSignals() as stops,
              run_threads(cfg.threads)):    # the thread count set here, in the training process
            return _train(cfg, ctx, evaluate, stops, lock)
    finally:
        pdist.cleanup(ctx)


def _apply_resume(cfg: TrainConfig, opt, sched, peaks: list, changes: dict, ctx) -> None:
    """The restored optimiser and schedule, with what the resume changed applied for real: each group's peak rate
    (`initial_lr`, the scheduler's `base_lrs`) is this run's, the schedule's shape (warm-up, min_lr, length) this
    run's `lr_lambdas`, and the rate of the step about to run recomputed from them (bitwise the checkpoint's when
    nothing changed)."""
    for g, peak in zip(opt.param_groups, peaks):
        g["initial_lr"] = peak
    sched.base_lrs = list(peaks)
    for g, base, f in zip(opt.param_groups, sched.base_lrs, sched.lr_lambdas):
        g["lr"] = base * f(sched.last_epoch)
    sched._last_lr = [g["lr"] for g in opt.param_groups]
    if changes:
        said = ", ".join(f"{k} {o} -> {n}" for k, (o, n) in changes.items())
        lr = f"; the next step's lr is {opt.param_groups[0]['lr']:.3g}" if any(k.startswith("optim.") or k in (
            "max_steps", "epochs") for k in changes) else ""
        _log(f"resume changes {said} (applied: the optimiser's peak rates and the schedule are this run's{lr})", ctx)


def _train(cfg: TrainConfig, ctx: pdist.DistContext, evaluate=None, stops: StopSignals | None = None,
           lock=None) -> dict:
    stops = stops or StopSignals()
    check_run_folder(cfg)   # resume=never over a run, a folder it cannot write: one line, before anything is written
    # before the model and before any file is written: a damaged checkpoint, or one of another config, is one line
    ck_path, ck = read_resume(cfg, lambda m: _log(m, ctx), ctx.is_main, ctx.world_size)
    check_resume_end(cfg, ck, ck_path)
    position = resume_position(cfg, ctx, ck, ck_path)
    if ctx.is_main and cfg.eval_every and evaluate is None:
        with usage_errors():
            evaluate = default_evaluator(cfg)   # the evaluation folder checked (the world's written) before the model
    run_dir = Path(cfg.out_dir)
    if ctx.is_main and cfg.overwrite and (cfg.resume == "never" or stale_run(run_dir)) and run_marks(run_dir):
        dest = move_aside(run_dir)
        if lock is not None:
            lock.follow(dest, run_dir)          # its lock went with it: this run's folder locked anew
        _log(f"overwrite=true: the run in {run_dir} moved aside to {dest}", ctx)
    pdist.barrier()                             # the old run is out of the way before any process looks there
    run = build_run(cfg, ctx)
    waiter = pdist.wait_group(ctx, cfg.eval_timeout_s) if cfg.eval_every else None   # every process, here
    cfg, model, method, modules, opt, sched, total = (run.cfg, run.model, run.method, run.modules, run.opt,
                                                      run.sched, run.total)
    wr = Writes(ctx, f"{ck_path} (step {ck['state']['step']})" if ck else "")   # a full disk: every process exits 3

    def write_config():
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False)
                                             + "# what the run derived from the "
                                             "config above (a record: change seed or model, not these)\n"
                                             + yaml.safe_dump(dict(derived=run.derived()), sort_keys=False))
    wr(write_config, run_dir / "config.yaml")
    state = TrainState()
    if cfg.start_batch:  # a fine-tune continuing its base run's data order (a resumed run takes its checkpoint's place)
        spe = steps_per_epoch(cfg.data, ctx.world_size)
        state.epoch, state.step_in_epoch = divmod(cfg.start_batch, spe) if spe else (0, cfg.start_batch)

    if ck is not None:
        peaks = [g["initial_lr"] for g in opt.param_groups]   # this run's peak rates, before the checkpoint's come
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        # what the resume may change (read_resume refused the rest), applied and said
        _apply_resume(cfg, opt, sched, peaks, resume_changes(cfg, ck, ck_path, ctx.world_size), ctx)
        if modules is not None:
            if ck.get("method_modules") is None:
                raise UsageError(f"resume: {ck_path} has no state for {cfg.method}'s own modules (a checkpoint of "
                                 "another method, or from before methods kept their modules beside the model): start "
                                 "afresh in another out_dir")
            modules.load_state_dict(ck["method_modules"])
        state = TrainState(**ck["state"])
        rngs = ck["rng"]
        set_rng_state(rngs[ctx.rank] if len(rngs) == ctx.world_size else rngs[0])
        if len(rngs) != ctx.world_size:
            _log(f"checkpoint has {len(rngs)} processes, this run {ctx.world_size}: resume is not exact", ctx)
        _log(f"resumed from {ck_path} at step {state.step} (epoch {state.epoch}, batch {state.step_in_epoch})", ctx)
    record = begin_segment(run_dir, ctx.device, state.step if ck is not None else 0, ck, ctx.world_size, ctx.is_main)
    logger = wr(lambda: MetricLogger(run_dir, ctx.is_main, state.step if ck_path else None, cfg.tensorboard,
                                     warn=lambda m: _log(m, ctx)),   # a damaged metrics.csv: repaired
                run_dir / "metrics.csv") or MetricLogger(run_dir, False)

    saved_at = state.step if ck is not None else None   # the step of the newest checkpoint on disk

    def checkpoint(position):
        nonlocal saved_at
        if saved_at == state.step:
            return   # stopped right after a checkpoint: writing it again would make prev.pt the same
        refuse_non_finite(_finite(model, modules), state.step, run_dir)   # never rotated over a finite one
        saved_at = state.step
        rngs = pdist.all_gather_object(rng_state())
        positions = pdist.all_gather_object(position.to_dict() if isinstance(position, StreamPosition) else position)
        last = run_dir / "checkpoints" / "last.pt"
        wr(lambda: save_checkpoint(last, model, opt, sched, state, cfg, rngs, modules=modules, loader=positions,
                                   record=record),
           last, state_bytes(model, opt, modules))
        wr.good = f"{last} (step {state.step})"
        pdist.barrier()

    from tqdm.auto import tqdm
    bar = tqdm(total=total, initial=state.step, disable=not (ctx.is_main and cfg.progress), unit="step",
               dynamic_ncols=True, mininterval=1.0, file=sys.stderr)
    t_start = t_last = time.time()
    n_since, last_row, skipped = 0, {}, {}
    seconds0, snapshots = state.seconds, set(cfg.snapshot_steps)
    mem = PeakMemory(ctx.device.type)
    mem.start()
    first_step = state.step
    global_batch = cfg.data.batch_size * ctx.world_size
    # epochs whose length may differ between processes: stepped together (above)
    together = ctx.world_size > 1 and cfg.data.source == "wds" and cfg.data.samples_per_epoch is None
    stopped = 0                                       # the signal every process stopped for (0: none)
    while state.step < min(total, cfg.stop_at or total):
        loader = run.loader(state.epoch, state.step_in_epoch, position)
        batches = pdist.Lockstep(loader) if together else loader
        n_batches = 0
        for batch in batches:
            n_batches += 1
            method.on_step(state.step, total)
            out = run.step(run.prepare(batch), state, stops.signum)
            state.step += 1
            state.step_in_epoch += 1
            n_since += 1
            state.seconds = seconds0 + time.time() - t_start
            if not out["ok"]:
                _log(f"step {state.step}: non-finite loss or gradient, update skipped ({state.bad_in_row} in a row, "
                     f"{state.bad_total} in all)", ctx)
                if state.bad_in_row >= cfg.max_bad_in_row:
                    raise Diverged(f"{state.bad_in_row} non-finite steps in a row (max_bad_in_row="
                                   f"{cfg.max_bad_in_row}): aborting at step {state.step}; a lower optim.lr or "
                                   "optim.grad_clip")
            bar.update(1)
            evaluated, due = {}, bool(cfg.eval_every) and (state.step % cfg.eval_every == 0 or state.step == total)
            if due:
                t_eval = time.time()
                evaluated = evaluate_isolated(evaluate, run.fwd, model, modules, state.step) if ctx.is_main else {}
                pdist.wait_for_main(waiter)
                dt = time.time() - t_eval     # left out of the training time and the throughput
                t_start, t_last = t_start + dt, t_last + dt
            if state.step % cfg.log_every == 0 or state.step == total or due:
                now = time.time()
                terms = {k: float(pdist.all_mean(v.float())) for k, v in sorted(out.items())
                         if k not in ("loss", "ok", "lr", "stop")}
                skipped = _skip_columns(loader.skipped(), state.skipped, ctx) if cfg.data.source == "wds" else {}
                last_row = dict(step=state.step, epoch=state.epoch, lr=out["lr"], loss=float(out["loss"]),
                                **terms, img_per_s=global_batch * n_since / max(now - t_last, 1e-9),
                                time=now - t_start, bad_total=state.bad_total, **skipped, **evaluated)
                wr(lambda: logger.log(last_row), logger.path)
                bar.set_postfix(loss=f"{last_row['loss']:.4f}", img_s=f"{last_row['img_per_s']:.0f}", refresh=False)
                t_last, n_since = now, 0
            if state.step in snapshots:
                check_finite(state, model, modules, "a snapshot")
                wr(lambda: save_snapshot(run_dir, state.step, state.seconds, model, modules), run_dir / "snapshots")
            if state.step % cfg.ckpt_every == 0 and state.step < total:
                checkpoint(loader.state())
            if out["stop"] and state.step < min(total, cfg.stop_at or total):
                stopped = out["stop"]                 # every process has the same (the loss's all-reduce carried it)
                break
            if state.step >= min(total, cfg.stop_at or total):
                break
        else:  # the epoch ran out
            if n_batches == 0 and state.step_in_epoch == 0:
                raise UsageError(_no_batch(loader, cfg, state, ctx, together))
            if together:
                cut = int(pdist.all_sum(torch.tensor([int(batches.cut)], device=ctx.device)))
                if cut:
                    _log(f"epoch {state.epoch} ended at its batch {state.step_in_epoch}, where a process's shards ran "
                         f"out: {cut} of {ctx.world_size} processes still had batches, not trained on this epoch "
                         "(data.samples_per_epoch gives every process the same number of steps)", ctx)
            if cfg.data.source == "wds":   # the finished epoch's skips, over all processes, join the run's count
                state.skipped = add_counts(state.skipped, dict(zip(SAMPLE_SKIP_REASONS, pdist.all_sum(
                    torch.tensor([loader.skipped()[k] for k in SAMPLE_SKIP_REASONS], device=ctx.device)).tolist())))
            state.epoch += 1
            state.step_in_epoch = 0
            loader = None
        position = None if loader is None else loader.state()
        if stopped:
            break
    bar.close()
    checkpoint(position)
    if stopped:
        logger.close()
        line = (f"interrupted ({signal.Signals(stopped).name}) at step {state.step} of {total}; checkpoint "
                f"{run_dir / 'checkpoints' / 'last.pt'}; resume with the same command and resume=auto")
        raise Interrupted(stopped, line if ctx.is_main else "")   # one line, from the main process
    check_finite(state, model, modules, "model.pt")
    wr(lambda: export_weights(run_dir, model, modules), run_dir / "model.pt", state_bytes(model, None, modules))
    logger.close()
    if logger.rows or ctx.world_size > 1:
        wr(lambda: logger.rows and plot_metrics(logger.rows, run_dir / "loss.png",
                                                title=f"{cfg.method} ({cfg.model.name})"), run_dir / "loss.png")
    if stops.signum:
        _log(f"{stops.name} came after the last step: the run is complete", ctx)
    return dict(run_dir=str(run_dir), steps=state.step, last=last_row, bad_total=state.bad_total,
                seconds=time.time() - t_start, world_size=ctx.world_size,
                checkpoint=str(run_dir / "checkpoints" / "last.pt"), weights=str(run_dir / "model.pt"),
                # the peak of the steps this call took (NaN when it took none: a finished run called again)
                peak_mib=mem.mib() if state.step > first_step else float("nan"))


def _no_batch(loader, cfg: TrainConfig, state: TrainState, ctx, together: bool) -> str:
    "The line of an epoch that gave no batch: how many samples were skipped, by reason, and how many were usable."
    skips, usable = loader.skipped(), getattr(loader, "usable", 0)
    if together or ctx.world_size == 1:      # every process is here (in step, or alone): the counts of all of them
        n = pdist.all_sum(torch.tensor([usable] + [skips.get(k, 0) for k in SAMPLE_SKIP_REASONS],
                                       device=ctx.device)).tolist()
        usable, skips = n[0], dict(zip(SAMPLE_SKIP_REASONS, n[1:]))
    by = ", ".join(f"{k} {v}" for k, v in skips.items() if v)
    if cfg.data.source == "wds" and not usable and by:
        return (f"data.shards: every sample of epoch {state.epoch} was skipped ({by}; the log names each sample and "
                "why): no batch to train on")
    return (f"data: epoch {state.epoch} gave no batch of {cfg.data.batch_size}: {usable} usable sample(s)"
            + (f", {sum(skips.values())} skipped ({by})" if by else "") + " (a smaller data.batch_size, or more data)")


# %% [markdown]
# An evaluation that draws from every random stream and leaves the model in eval mode changes nothing: the weights
# after 6 steps with it every 2 steps are bitwise those without it (the real evaluation, on the world's held-out
# scenes, is `64a_eval_training`'s and `tests/test_eval_every.py`'s).

# %%
def _greedy(model, modules, step):
    import random as _random
    model.eval()
    return {"eval/draws": float(torch.rand(3).sum() + np.random.rand() + _random.random()), "eval/step": step}

with tempfile.TemporaryDirectory() as d:
    # FLIP: its patches are dropped with the global torch stream, which the evaluation draws from too
    _plain = train(load_config("smoke", dict(out_dir=f"{d}/plain", tensorboard=False, progress=False), "flip"))
    _evald = train(load_config("smoke", dict(out_dir=f"{d}/eval", tensorboard=False, progress=False, eval_every=2),
                               "flip"), _greedy)
    _w0, _w1 = torch.load(f"{d}/plain/model.pt"), torch.load(f"{d}/eval/model.pt")
    assert all(torch.equal(_w0[k], _w1[k]) for k in _w0) and _w0.keys() == _w1.keys()
    test_eq([r["eval/step"] for r in read_metrics(f"{d}/eval/metrics.csv") if "eval/step" in r], [2, 4, 6])


# %% [markdown]
# ## Command line
#
# `python -m powerclip.train --preset demo [--method clip] [key=value ...]`, or the console script
# `powerclip-train`. Under `torchrun --nproc_per_node G` the same command trains data-parallel. As every command of the
# project (`17_commandline`), it reads and checks the arguments, the config and its paths (`load_config`, `validate`) before it
# builds anything: a mistake is one line, `powerclip-train: error: <key>: <what is wrong> (<what is allowed>)`, and exit
# status 2; `--debug` (or `POWERCLIP_DEBUG=1`) shows its traceback.
#
# ```bash
# python -m powerclip.train --preset demo                       # PowerCLIP-R, the tiny model on the built-in world
# python -m powerclip.train --preset demo --method clip         # the same budget without the powerset loss
# python -m powerclip.train --preset demo --method sparc method_cfg.lambda_fine=0.5   # any method, any option
# python -m powerclip.train --preset demo method_cfg.masks=gold out_dir=runs/gold   # PowerCLIP on the world's masks
# torchrun --nproc_per_node 8 -m powerclip.train --preset paper data.shards='cc12m_annotated/{00000..01242}.tar'
# torchrun --nproc_per_node 8 -m powerclip.train --preset paper data.shards='cc12m_sam2/{00000..01242}.tar' \
#     method_cfg.masks=stored                                   # PowerCLIP-S, on SAM2 masks (data_prep/README.md)
# ```
#
# The methods (`--method`), each a class in its notebook with a config dataclass of its paper's defaults:
#
# | method | notebook | what it adds to CLIP | preset for its paper's recipe |
# |---|---|---|---|
# | `clip` | `40_methods` | symmetric InfoNCE, learnable temperature, local loss + gather with gradient | `paper --method clip` |
# | `powerclip` | `11_loss` | powerset triplet loss (NLA-T1 + NLA-T2) between region subsets and parse-tree nodes | `paper` |
# | `flip` | `43_flip` | 50 % of the patches dropped at random in training | `paper --method flip` |
# | `clip-pgs`, `clip-pgs-0.3` | `46_clip_pgs` | 50 % / 30-50 % of the patches removed by edge-aware, Sinkhorn-normalised similarity growth | `clip-pgs` |
# | `c2lip` | `45_c2lip` | SigLIP (or `method_cfg.base=clip`) + noun-phrase and cross-attended concept losses (1.0, 0.01); sigmoid t, b beside the model | `c2lip` (fine-tunes) |
# | `smartclip` | `44_smartclip` | text-conditioned binary mask over embedding dimensions, modular loss + L1 sparsity; mask net at lr $10^{-3}$, no weight decay | `smartclip` (fine-tunes) |
# | `filip` | `41_filip` | token-wise late interaction (mean of max similarities) | `paper --method filip` |
# | `sparc` | `42_sparc` | 0.5 x global InfoNCE on average-pooled embeddings (image through a GELU layer) + $\lambda_f$ x per-pair sparse token-to-patch grouping loss | `paper --method sparc` |
# | `aclip` | `47_aclip` | half the patches kept (2x2 blocks) by an EMA encoder's class-token attention, two crops; + SimCLR between the views (1) and BYOL to the EMA (2); scored with the EMA towers | `aclip` |
# | `eclip` | `48_eclip` | clusters of similar patches (3 % anchors, pixel correlation > 0.5) removed, at least 30 % per image; leftover cluster patches hidden from attention | `eclip` |
#
# A run writes to its `out_dir`: `config.yaml` (with what was derived from it), `run.json` (what made it: commit,
# libraries, the thread count read in the training process, device; one entry per segment, `49h_runrecord`; also in
# each checkpoint), `checkpoints/last.pt` and `prev.pt`, `metrics.csv`, TensorBoard logs, a plot of the curves and, at
# the end, `model.pt` (below).

# %%
#| export
def parse_args(argv: list[str] | None = None) -> TrainConfig:
    "Command line -> TrainConfig (a UsageError or a ValueError naming the argument for what cannot work)."
    ap = ArgumentParser(prog="powerclip-train", key_values=True,
                        description="Train CLIP / PowerCLIP / ... with one trainer.")
    ap.add_argument("--preset", default="demo", help="preset name (powerclip/presets/*.yaml) or a YAML path")
    ap.add_argument("--method", default=None, help="method name (registered in powerclip.methods)")
    ap.add_argument("--debug", action="store_true", help="show the traceback of a usage error")
    ap.add_argument("overrides", nargs="*", help="key=value, dotted keys: optim.lr=1e-3 "
                                                 "method_cfg.masks=gold out_dir=runs/x")
    a = ap.parse_intermixed_args(argv)  # options and key=value pairs in any order
    return load_config(a.preset, a.overrides, a.method)


def _main(argv: list[str]) -> int:
    with usage_errors():     # the user's mistakes, found before the model is built: one line (powerclip.commandline)
        cfg = parse_args(argv)
        validate(cfg)
        check_run_folder(cfg)   # a run never overwritten, a folder it can write: before any file is touched
    # the checkpoint's config is compared, then the evaluation folder checked (the world's written), in `train`
    summary = train(cfg)
    if int(os.environ.get("RANK", 0)) == 0:
        print(yaml.safe_dump(summary, sort_keys=False))
    return 0


def main(argv: list[str] | None = None) -> int:
    "The command line (None: sys.argv): exit status 0, or 2 with one line on stderr for a mistake in the arguments."
    return run_main(_main, argv, "powerclip-train")


# a notebook kernel also runs as __main__, but has no __file__: only `python -m powerclip.train` trains here
if __name__ == "__main__" and "__file__" in globals():
    sys.exit(main())

# %%
import contextlib as _cl, io as _io
def _cli(*argv):
    err = _io.StringIO()
    with _cl.redirect_stderr(err):
        rc = main(list(argv))
    return rc, err.getvalue()
for argv, key in [(["optim.lr=abc"], "optim.lr: must be a number, got 'abc'"),
                  (["--method", "nope"], "method: unknown method"),
                  (["max_steps"], "override 'max_steps': not key=value"),
                  (["--nope"], "unrecognized arguments: --nope"),
                  (["data.batch_size=1000"], "data.batch_size: 1000 per process")]:
    rc, err = _cli("--preset", "smoke", *argv)
    assert rc == 2 and err.count("\n") == 1 and err.startswith("powerclip-train: error: ") and key in err, (argv, err)
rc, err = _cli("--preset", "nope")
assert rc == 2 and "--preset: no preset 'nope'" in err, err
# --debug: the traceback
test_fail(lambda: main(["--preset", "smoke", "optim.lr=abc", "--debug"]), contains="optim.lr")


# %% [markdown]
# ## A short run
#
# The `smoke` preset (the micro model on a small world, a few steps), then the same run stopped after half of
# its steps and resumed: the losses agree to the last digit. (`tests/test_train_resume.py` does the same across processes
# and with `kill -9`, on the world and on shards with bad samples, comparing every metrics column and the final weights;
# `tests/test_ddp.py` checks two processes against one.)

# %%
def _micro(out_dir, **kw):  # the `smoke` preset: the micro model, 32-pixel scenes, batches of 8, 6 steps
    return load_config("smoke", dict(out_dir=str(out_dir), **kw))

_scratch = tempfile.TemporaryDirectory(prefix="powerclip-nb-")  # holds every scratch folder below; see the last cell
_tmp = Path(tempfile.mkdtemp(dir=_scratch.name))
_s = train(_micro(_tmp / "straight"))
_a = read_metrics(_tmp / "straight" / "metrics.csv")
print(f"{_s['steps']} steps in {_s['seconds']:.1f}s; losses", [round(r["loss"], 4) for r in _a])
train(_micro(_tmp / "resumed", stop_at=3))
_r = train(_micro(_tmp / "resumed"))  # second call resumes at step 3
_b = read_metrics(_tmp / "resumed" / "metrics.csv")
test_eq([r["step"] for r in _b], list(range(1, 7)))
assert_close(torch.tensor([r["loss"] for r in _b]), torch.tensor([r["loss"] for r in _a]), rtol=0, atol=1e-6)

# %% [markdown]
# ### A run is never overwritten, and a resume is what it says
#
# `resume=never` into a folder that holds a run is refused (`49b_checkpoint`, `check_run_folder`): one line naming the
# run, offering `resume=auto`, another `out_dir`, or `overwrite=true`, which moves the old run aside to
# `OUT_DIR.old-<time>` (nothing is deleted). A resume compares the checkpoint's config with the new one key by key
# before any file is written (`resume_changes`): the method and its options, the model, the batch size, the data and
# its order, the seed and the precision may not change (one line naming the keys), while the steps, the logging,
# evaluation and checkpoint cadence, `out_dir`, `progress`, `tensorboard`, the workers (where the data allows) and the
# learning rate and its schedule may, and are applied: the new peak rate and schedule reach the optimiser's groups and
# the scheduler (`_apply_resume`), and the log says so. Below, the stopped run resumed at twice the peak rate: step 4
# runs at the new schedule's rate, not at the checkpoint's.

# %%
test_fail(lambda: train(_micro(_tmp / "straight", resume="never")), contains="holds a run (checkpoints/last.pt")
test_fail(lambda: train(_micro(_tmp / "straight", **{"method_cfg.lam": 0.3})), contains="other method_cfg.lam")
train(_micro(_tmp / "lr2", stop_at=3))
train(_micro(_tmp / "lr2", **{"optim.lr": 2e-3}))
_lr = [r["lr"] for r in read_metrics(_tmp / "lr2" / "metrics.csv")]
_c = load_config("smoke").optim
test_close(_lr[3], 2e-3 * lr_factor(3, 6, _c.warmup_steps), eps=1e-12)           # the new peak, applied at step 4
test_close(_lr[2], 1e-3 * lr_factor(2, 6, _c.warmup_steps), eps=1e-12)           # the steps before, as they ran
_moved = train(_micro(_tmp / "lr2", resume="never", overwrite=True))            # the old run moved aside, not lost
assert list(_tmp.glob("lr2.old-*/metrics.csv")) and _moved["steps"] == 6

# %% [markdown]
# ### Interruptions
#
# SIGINT (Ctrl-C) and SIGTERM (a scheduler's notice) do not kill the trainer where they land. `train` records them
# (`StopSignals`, `17_commandline`) and the loop stops at the next step boundary: the step that was running finishes,
# a checkpoint of it is written, and `train` raises `Interrupted`, which the command line prints as one line,
# `interrupted (SIGINT) at step N of T; checkpoint ...; resume with the same command and resume=auto`, with exit status
# 130 (SIGINT) or 143 (SIGTERM). Rerunning the command resumes exactly there. DataLoader workers ignore both signals
# (`23_data`: a Ctrl-C reaches the whole process group, and a worker killed by it would end the epoch early or take the
# loader down), so it is the same with workers and at an epoch boundary.
#
# **Every process stops at the same step.** Under DDP each process receives its own signal, or only some do (a
# `kill` of one rank, torchrun passing the signal on). The flag travels in the all-reduce the step already makes: the
# mean of the loss is reduced together with two flags, "I got SIGINT" and "I got SIGTERM" (`train_step`: one tensor of
# three numbers instead of one, no new collective and no new sync per step), so every process reads the same answer
# after the same step and stops there, SIGTERM winning when both came. `tests/test_interrupt.py` checks it with workers,
# at an epoch boundary and under torchrun with two processes, and the comparison's runner, which passes the signal on
# to the run it is training (`16_measure`, `run_isolated`).
#
# Below, an evaluation that presses Ctrl-C during step 2: the flag is read by step 3's all-reduce, so the run stops
# after step 3 with its checkpoint, and the resumed run's losses are the straight run's.

# %%
import signal as _signal
def _ctrl_c(model, modules, step):
    if step == 2:
        os.kill(os.getpid(), _signal.SIGINT)       # recorded by the trainer, not raised
    return {}

_before = _signal.getsignal(_signal.SIGINT)
try:
    train(_micro(_tmp / "int", eval_every=2), _ctrl_c)
    raise AssertionError("not interrupted")
except Interrupted as e:
    test_eq((e.status, e.signum), (130, _signal.SIGINT))
    assert "interrupted (SIGINT) at step 3 of 6" in e.message and "resume=auto" in e.message, e.message
test_eq(load_checkpoint(_tmp / "int" / "checkpoints" / "last.pt")["state"]["step"], 3)
assert not (_tmp / "int" / "model.pt").exists()                                  # not finished: no weights yet
train(_micro(_tmp / "int"))
assert_close(torch.tensor([r["loss"] for r in read_metrics(_tmp / "int" / "metrics.csv")]),
             torch.tensor([r["loss"] for r in _a]), rtol=0, atol=1e-6)
assert _signal.getsignal(_signal.SIGINT) is _before                          # the handlers are put back

# %% [markdown]
# Whatever the method, the run leaves `model.pt`: the open_clip weights alone, which plain open_clip loads (the
# project's configs registered), so that evaluation treats every method alike. A method's training-time modules
# (SmartCLIP's mask network, C2LIP's sigmoid temperature and bias, SPARC's pooling layer) go to `method_modules.pt`
# beside it, never inside. A preset that fine-tunes says `model.pretrained: required` and stops until it gets a local
# open_clip state dict (`model.pretrained=/path/to/weights.pt`); nothing is downloaded. The towers start from those
# weights; the method's own modules start fresh and train at the method's own learning rate (`modules_lr`).

# %%
import open_clip
from powerclip.model import register_configs
register_configs()
_oc = open_clip.create_model_and_transforms("powerclip-micro", pretrained=_s["weights"])[0]
_ck = load_checkpoint(_s["checkpoint"])
assert all(torch.equal(_ck["model"][n], p) for n, p in _oc.state_dict().items()) and _ck["method_modules"] is None
test_fail(lambda: train(_micro(_tmp / "ft", **{"model.pretrained": "required"})), contains="model.pretrained=")

# %% [markdown]
# ### Snapshots, and a fine-tune that continues its base run's data
#
# `snapshot_steps` makes a run also leave its weights at those steps, in `snapshots/step{N}/`, a folder that loads like a
# run folder (`config.yaml` beside `model.pt`), with the training seconds so far in `snapshot.json` (the wall-clock of
# the loop, summed across resumes): the learning curves of the comparison (`70_compare`) read them. A fine-tune starts
# from one (`model.pretrained=.../snapshots/step{N}/model.pt`) with a schedule of its own, and `start_batch=N` makes it
# read the batches its base run would have read next. Below, CLIP's snapshot at step 3 fine-tuned at learning rate 0:
# its first loss is the base run's loss at step 4, the same weights on the same batch.

# %%
_clip = lambda out_dir, **kw: load_config("smoke", dict(out_dir=str(out_dir), **kw), method="clip")
_base = train(_clip(_tmp / "base", snapshot_steps=[3, 6]))
_snaps = {n: json.loads((_tmp / "base" / "snapshots" / f"step{n}" / "snapshot.json").read_text()) for n in (3, 6)}
assert 0 < _snaps[3]["seconds"] < _snaps[6]["seconds"] and _snaps[6]["step"] == 6
assert (_tmp / "base" / "snapshots" / "step3" / "config.yaml").is_file()
assert all(torch.equal(v, torch.load(_tmp / "base" / "model.pt")[k])
           for k, v in torch.load(_tmp / "base" / "snapshots" / "step6" / "model.pt").items())
_ft = train(_clip(_tmp / "ft0", max_steps=2, start_batch=3, **{"optim.lr": 0.0,
                  "model.pretrained": str(_tmp / "base" / "snapshots" / "step3" / "model.pt")}))
test_close(read_metrics(_tmp / "ft0" / "metrics.csv")[0]["loss"],
           read_metrics(_tmp / "base" / "metrics.csv")[3]["loss"], eps=1e-6)
test_fail(lambda: _micro(_tmp / "x", snapshot_steps=[0]), contains="snapshot_steps")

# %% [markdown]
# The paper preset's model (ViT-B/16 at 224 pixels, about 150 M parameters) takes one step on CPU at a batch
# of 2 world scenes: the preset builds and trains end to end (minutes, so flagged `slow`).

# %%
#| slow
_p = load_config("paper", {"data.source": "world", "data.shards": "", "data.batch_size": 2, "data.workers": 0,
                           "data.world_length": 4, "global_batch_size": None, "max_steps": 1, "log_every": 1,
                           "progress": False, "tensorboard": False, "out_dir": str(_tmp / "paper")})
_s = train(_p)
print({k: round(v, 4) for k, v in _s["last"].items()})
assert _s["steps"] == 1 and math.isfinite(_s["last"]["loss"]) and _s["last"]["bad_total"] == 0

# %% [markdown]
# ## Same command, same numbers?
#
# On one machine with the same number of threads, yes: two runs of the same command and seed are bitwise equal (every
# random stream derives from the run seed, and resume is exact). Across thread counts or machines, no: floating-point
# sums are reduced in another order. Measured on the 2-core CPU with the `demo` preset, the training losses of a run
# with `OMP_NUM_THREADS=1` and one with 2 threads differ by about $10^{-7}$ (relative) after a few steps, for CLIP and
# PowerCLIP alike. Like any chaotic optimisation, the difference then grows over training, so a single run's metrics
# on another machine land elsewhere within the spread over seeds. How far that moves the comparison's table on another
# machine has not been measured; this is why every claim of `70_compare` rests on paired differences over seeds, not
# on one run. On a GPU, cuDNN and cuBLAS choices add the same kind of difference. The config key `threads` fixes the
# count in the training process (a resume may change it), `run.json` records the count that process ran at, and
# `python -m powerclip.reproduce RUN_DIR` (`72_reproduce`) retrains a run at it and says where the two part.

# %% [markdown]
# Every scratch folder made above lives under one temporary folder, removed here, so running the notebook
# leaves nothing behind (a training run's checkpoints take hundreds of MB).

# %%
_scratch.cleanup()
