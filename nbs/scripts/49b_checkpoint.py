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
#| default_exp checkpoint

# %%
#| export
from __future__ import annotations

import json, os, random, re, time, zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from powerclip.commandline import UsageError
from powerclip.config import TrainConfig, to_dict
from powerclip.methods import method_config
from powerclip.data import n_streams
from powerclip.dist import DistContext

# %%
#| hide
import tempfile
from fastcore.test import test_eq, test_fail
from powerclip.config import from_dict
from torch.testing import assert_close


# %% [markdown]
# # Checkpoints
#
# > What a run leaves on disk and reads back.
#
# Checkpoints that resume exactly (weights, optimiser, schedule, every random generator, data positions), written
# atomically with the previous one kept; the open_clip weights alone; snapshots for learning curves; the one reading
# of a checkpoint to resume from; and where the weights are in the folders open_clip itself leaves.

# %% [markdown]
# ## Checkpoints that resume exactly
#
# A run killed at any moment and resumed from its last checkpoint must continue as if it had never stopped.
# So a checkpoint holds, besides the weights: the optimiser's moments, the scheduler's position, every random
# generator (Python, NumPy, torch, CUDA; one set per process), the step and epoch, and each process's data position
# (`powerclip.data.StreamPosition`: on the world its step in the epoch, from which `make_loader` regenerates exactly the
# batches not yet seen; on shards also where every worker's stream stands, see `23_data`), and the skip counts of the
# epochs already done.
#
# **Written so that it can always be read.** A checkpoint is written to a temporary file, flushed to the disk
# (`fsync`), and renamed over `last.pt`; the `last.pt` it replaces becomes `prev.pt`. A kill during the write leaves
# both intact. A `last.pt` that cannot be read all the same (a full disk, a file copied over it, a zero-byte file)
# is reported in one line, set aside as `last.pt.damaged`, and the run resumes from `prev.pt`; if neither can be read,
# the run stops with one line saying so and how to start afresh without losing anything (another `out_dir`, or
# `resume=never overwrite=true`, which moves the folder aside). Both are read *before* the model is built. Resume with
# the same number of processes and the same `data.workers`: the data streams are split by both.
# `read_resume` finds and reads the checkpoint to resume from; `resume_position` gives each process its data position
# in it, and says in one line when shards cannot resume from it (another number of processes or workers).

# %%
#| export
@dataclass
class TrainState:
    "Where a run is; saved in every checkpoint."
    step: int = 0             # optimiser steps taken (skipped bad steps included: data was consumed)
    epoch: int = 0            # current epoch
    step_in_epoch: int = 0    # batches of this epoch already consumed (per process)
    bad_total: int = 0        # steps skipped for a non-finite loss or gradient
    bad_in_row: int = 0       # consecutive such steps
    skipped: dict = field(default_factory=dict)  # samples skipped in the finished epochs, by reason, over all processes
    seconds: float = 0.0      # wall-clock seconds of the training loop so far, across resumes


def rng_state() -> dict:
    return dict(python=random.getstate(), numpy=np.random.get_state(), torch=torch.get_rng_state(),
                cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)


def set_rng_state(s: dict) -> None:
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])
    if s.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def previous_checkpoint(path) -> Path:
    """Where the checkpoint that `path` replaced is kept: `prev.pt` beside `last.pt` (`NAME.prev.pt` beside another
    name)."""
    path = Path(path)
    return path.with_name("prev.pt" if path.name == "last.pt" else f"{path.stem}.prev{path.suffix}")


def _fsync_dir(d: Path) -> None:
    "Make a rename in folder `d` durable (where the file system lets a folder be opened)."
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic_save(obj, path: Path, keep_previous: bool = False) -> Path:
    """torch.save to a temporary name, fsync, then rename: a kill or a crash mid-write leaves the previous file intact.
    `keep_previous`: the file replaced is kept as `previous_checkpoint(path)`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())   # on the disk before the rename makes it the checkpoint
    except BaseException:          # a full disk, a size limit, a kill: no half-written file left (49g_faults)
        tmp.unlink(missing_ok=True)
        raise
    if keep_previous and path.exists():
        os.replace(path, previous_checkpoint(path))
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    return path


def save_checkpoint(path, model, opt, sched, state: TrainState, cfg: TrainConfig, rngs: list[dict], scaler=None,
                    modules: torch.nn.Module | None = None, loader: list[dict] | None = None,
                    record: dict | None = None) -> Path:
    """Atomic, fsynced write of everything needed to resume (`rngs`: one RNG state per process; `loader`: one data
    position per process, `StreamPosition.to_dict()`); the checkpoint it replaces becomes `prev.pt`. The open_clip
    weights (`model`) and a method's training-time modules (`method_modules`) are separate entries. `record`: what
    made the run (`run.json`, `49h_runrecord`), kept in the checkpoint too."""
    ckpt = dict(model=model.state_dict(), method_modules=None if modules is None else modules.state_dict(),
                optimizer=opt.state_dict(), scheduler=sched.state_dict(),
                scaler=None if scaler is None else scaler.state_dict(), state=asdict(state), rng=rngs, loader=loader,
                config=to_dict(cfg), torch_version=torch.__version__, record=record)
    return _atomic_save(ckpt, path, keep_previous=True)


def export_weights(run_dir, model, modules: torch.nn.Module | None = None) -> dict[str, Path]:
    """`run_dir/model.pt`: the open_clip state dict alone, which plain open_clip loads
    (`open_clip.create_model_and_transforms(name, pretrained=path)` after `powerclip.model.register_configs()`),
    whatever the method; `run_dir/method_modules.pt` beside it when the method trained modules of its own."""
    out = dict(model=_atomic_save(model.state_dict(), Path(run_dir) / "model.pt"))
    if modules is not None:
        out["method_modules"] = _atomic_save(modules.state_dict(), Path(run_dir) / "method_modules.pt")
    return out


def save_snapshot(run_dir, step: int, seconds: float, model, modules: torch.nn.Module | None = None) -> Path:
    """`run_dir/snapshots/step{step}/`: the weights as `export_weights` writes them, the run's `config.yaml` (so the
    folder loads like a run folder) and, written last, `snapshot.json` (step, training seconds so far): a folder
    without it is incomplete."""
    d = Path(run_dir) / "snapshots" / f"step{step}"
    export_weights(d, model, modules)
    for name, text in (("config.yaml", (Path(run_dir) / "config.yaml").read_text()),
                       ("snapshot.json", json.dumps(dict(step=step, seconds=seconds)))):
        tmp = d / (name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, d / name)
    return d


def load_checkpoint(path, map_location="cpu") -> dict:
    # our own file: it holds Python and NumPy RNG states, which the weights-only loader refuses
    return torch.load(path, map_location=map_location, weights_only=False)


CHECKPOINT_KEYS = ("model", "optimizer", "scheduler", "state", "rng")


def read_resume(cfg: TrainConfig, warn=print, set_aside: bool = True,
                world_size: int = 1) -> tuple[Path | None, dict | None]:
    """The checkpoint a run resumes from, read (on the CPU): `last.pt` (or the `resume` path), else, with a warning, the
    checkpoint it replaced; (None, None) to start afresh. Neither readable: a `UsageError` saying how to start afresh.
    Its config is compared with `cfg` before anything is written (`resume_changes`: a `UsageError` naming what a resume
    may not change; `world_size`: this run's processes). `set_aside` (the main process): an unreadable `last.pt`
    becomes `last.pt.damaged`, so that the next checkpoint does not push it over the good `prev.pt`."""
    if cfg.resume == "never":
        return None, None
    last = Path(cfg.out_dir) / "checkpoints" / "last.pt" if cfg.resume == "auto" else Path(cfg.resume)
    prev = previous_checkpoint(last)
    if not last.is_file() and not prev.is_file():
        if cfg.resume == "auto":
            return None, None
        raise UsageError(f"resume: no checkpoint {cfg.resume!r} (auto, never, or an existing .pt file)")
    problems = []
    for p in (last, prev):
        if not p.is_file():
            problems.append(f"{p} is missing")
            continue
        try:
            ck = load_checkpoint(p)
            if not isinstance(ck, dict) or not set(CHECKPOINT_KEYS) <= set(ck):
                raise ValueError("not a trainer checkpoint")
        except Exception as e:   # a torn or foreign file: say what, then try the older one
            problems.append(f"{p} cannot be read ({type(e).__name__}: {str(e).strip().split('. ')[0][:120]})")
            continue
        resume_changes(cfg, ck, p, world_size)      # what may not change: refused here, before any file is touched
        if problems:
            kept = ""
            if set_aside and last.is_file():
                os.replace(last, last.with_name(last.name + ".damaged"))
                kept = f" ({last.name} kept as {last.name}.damaged)"
            warn(f"{problems[0]}: resuming from the previous checkpoint {p} (step {ck['state']['step']}){kept}")
        return p, ck
    raise UsageError(f"resume: {'; '.join(problems)}; no checkpoint to resume from. Start afresh in another out_dir, "
                     f"or with resume=never overwrite=true (moves {Path(cfg.out_dir)} aside, deletes nothing)")


# What a resume may change, each applied for real (`50_train`): how long, how often it logs, evaluates and
# checkpoints, where it writes, what it shows, the loader's workers (shards: the checkpoint's count, see
# `resume_position`), the learning rate and its schedule (into the optimiser's groups and the scheduler), and how a step
# is executed without changing what it computes (device, accumulation, checkpointing, compilation, DDP's option), and
# the CPU thread count (which changes the last digits: the run's record, `run.json`, says so per segment).
# Anything else (the method and its options, the model, the batch, the data and its order, the seed, the precision,
# the optimiser's other settings) is refused.
RESUME_MAY_CHANGE = ("epochs", "max_steps", "stop_at", "log_every", "ckpt_every", "snapshot_steps", "eval_every",
                     "eval_data", "eval_tasks", "eval_images", "eval_timeout_s", "out_dir", "progress", "tensorboard",
                     "resume", "overwrite", "max_bad_in_row", "device", "find_unused_parameters", "accum_steps",
                     "data.workers", "optim.lr", "optim.warmup_steps", "optim.min_lr", "optim.grad_clip",
                     "model.grad_checkpointing", "model.compile", "threads")


def _flat(d: dict, path: str = "") -> dict:
    "A nested config dict as {dotted key: value} (sections opened, lists kept whole)."
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{path}{k}."))
        else:
            out[f"{path}{k}"] = v
    return out


def _method_options(d: dict) -> dict:
    "The method's options as its config dataclass fills them (defaults included), so given and default values agree."
    try:
        return {f"method_cfg.{k}": v for k, v in to_dict(method_config(d["method"], d.get("method_cfg"))).items()}
    except Exception:                       # a method this version no longer knows: compare as written
        return {f"method_cfg.{k}": v for k, v in (d.get("method_cfg") or {}).items()}


def resume_changes(cfg: TrainConfig, ck: dict, path, world_size: int = 1) -> dict:
    """`{key: (the checkpoint's value, this run's)}` of what differs between the checkpoint's config and `cfg`, every
    key one a resume may change (`RESUME_MAY_CHANGE`); else a `UsageError` naming the keys that may not. The batch is
    compared as the global batch (processes x per-process batch): a resume on another number of processes keeps it."""
    saved = ck.get("config")
    if not isinstance(saved, dict):
        return {}                           # a checkpoint from before configs were saved in it: nothing to compare
    new, old = to_dict(cfg), saved
    a = {**_flat({k: v for k, v in old.items() if k != "method_cfg"}), **_method_options(old)}
    b = {**_flat({k: v for k, v in new.items() if k != "method_cfg"}), **_method_options(new)}
    for d in (a, b):
        d.pop("data.batch_size", None)
        d.pop("global_batch_size", None)
    old_world = len(ck.get("rng") or [None])
    old_batch = old["data"]["batch_size"] * old_world
    new_batch = cfg.global_batch_size or cfg.data.batch_size * world_size
    diff = {k: (a.get(k), b.get(k)) for k in sorted(set(a) & set(b)) if a[k] != b[k]}
    if a.get("method") != b.get("method"):   # another method's options are not comparable: the method says it
        diff = {k: v for k, v in diff.items() if not k.startswith("method_cfg.")}
    if old_batch != new_batch:
        diff["global_batch_size" if cfg.global_batch_size else "data.batch_size"] = (
            f"{old_batch} ({old['data']['batch_size']} x {old_world} process(es))",
            f"{new_batch} ({cfg.data.batch_size if not cfg.global_batch_size else new_batch // world_size} x "
            f"{world_size} process(es))")
    fixed = {k: v for k, v in diff.items() if k not in RESUME_MAY_CHANGE}
    if fixed:
        shown = "; ".join(f"{k} {o!r} there, {n!r} now" for k, (o, n) in list(fixed.items())[:4])
        more = f" (and {len(fixed) - 4} more)" if len(fixed) > 4 else ""
        raise UsageError(f"resume: {path} was trained with other {', '.join(fixed)}: {shown}{more}. A resume may not "
                         "change the method and its options, the model, the batch size, the data and its order, the "
                         "seed or the precision: give the checkpoint's values, or another out_dir for a new run")
    return diff


def resume_position(cfg: TrainConfig, ctx: DistContext, ck: dict | None, path: Path | None) -> dict | None:
    """This process's data position in the checkpoint `ck` (None: from the step alone); one line if shards cannot resume
    from it."""
    if ck is None:
        return None
    positions, step = ck.get("loader"), ck["state"]["step_in_epoch"]
    ok = positions is not None and len(positions) == ctx.world_size and positions[ctx.rank] is not None
    if cfg.data.source != "wds" or (step == 0 and not ok):
        return positions[ctx.rank] if ok else None
    if positions is None:
        raise UsageError(f"resume: {path} holds no data position (written before shard runs resumed exactly): "
                         "start afresh in another out_dir")
    if len(positions) != ctx.world_size:
        raise UsageError(f"resume: {path} was written by {len(positions)} process(es), this run has {ctx.world_size}: "
                         f"shards are split by process, so resume with {len(positions)}")
    if positions[ctx.rank]["workers"] != n_streams(cfg.data):
        w = positions[ctx.rank]["workers"]
        raise UsageError(f"data.workers: {path} was written with {w} worker stream(s); shards are split by worker, so "
                         f"resume with data.workers={w}" + (" (or 0)" if w == 1 else ""))
    return positions[ctx.rank]


# %%
from powerclip.model import create_model
_m, _, _ = create_model("powerclip-micro")
_opt = torch.optim.AdamW(_m.parameters())
with tempfile.TemporaryDirectory() as d:
    seed_all(3)
    _s0 = rng_state()
    _a = (random.random(), np.random.rand(), torch.rand(1))
    set_rng_state(_s0)
    assert (random.random(), np.random.rand(), torch.rand(1)) == _a
    _sch = torch.optim.lr_scheduler.LambdaLR(_opt, lambda s: 1.0)
    _opt.step()
    _sch.step()
    p = save_checkpoint(Path(d) / "checkpoints" / "last.pt", _m, _opt, _sch, TrainState(step=1), TrainConfig(), [_s0])
    ck = load_checkpoint(p)
    test_eq(ck["state"]["step"], 1)
    test_eq(ck["scheduler"]["last_epoch"], 1)
    assert_close(ck["model"]["logit_scale"], _m.logit_scale.detach())
    assert not list(Path(d, "checkpoints").glob("*.tmp"))
    # the second save keeps the first as prev.pt; a damaged last.pt falls back to it, with one line
    save_checkpoint(p, _m, _opt, _sch, TrainState(step=2), TrainConfig(), [_s0])
    test_eq(load_checkpoint(Path(d) / "checkpoints" / "prev.pt")["state"]["step"], 1)
    _cfg = TrainConfig(out_dir=d)
    _said = []
    test_eq(read_resume(_cfg, _said.append)[1]["state"]["step"], 2)
    test_eq(_said, [])
    p.write_bytes(p.read_bytes()[:1000])                      # a torn last.pt
    _path, _ck = read_resume(_cfg, _said.append)
    test_eq((_path.name, _ck["state"]["step"]), ("prev.pt", 1))
    assert len(_said) == 1 and "last.pt cannot be read" in _said[0] and "step 1" in _said[0], _said
    assert not p.exists() and p.with_name("last.pt.damaged").is_file()   # set aside: the next save keeps prev.pt
    p.write_bytes(b"")                                                   # a zero-byte last.pt and prev.pt:
    (Path(d) / "checkpoints" / "prev.pt").write_bytes(b"")              # nothing to resume from
    test_fail(lambda: read_resume(_cfg), contains="resume=never overwrite=true (moves")
    test_eq(read_resume(TrainConfig(out_dir=d, resume="never")), (None, None))

# %% [markdown]
# A resume compares the checkpoint's config with the new one, key by key, before anything is written: what a resume may
# change comes back (the trainer applies it and logs it), anything else is one line naming the keys.

# %%
with tempfile.TemporaryDirectory() as d:
    _old = TrainConfig(out_dir=d)
    save_checkpoint(Path(d) / "checkpoints" / "last.pt", _m, _opt, _sch, TrainState(step=2), _old, [_s0])
    _ck = load_checkpoint(Path(d) / "checkpoints" / "last.pt")
    test_eq(resume_changes(_old, _ck, "last.pt"), {})
    _new = from_dict(TrainConfig, {**to_dict(_old), "max_steps": 50, "optim": {"lr": 1e-3}, "progress": False})
    test_eq(resume_changes(_new, _ck, "last.pt"), {"max_steps": (None, 50), "optim.lr": (5e-4, 1e-3),
                                                   "progress": (True, False)})
    test_eq(resume_changes(from_dict(TrainConfig, {**to_dict(_old), "method_cfg": {"lam": 0.1}}), _ck, "x"), {})
    for ov, keys in [({"method": "clip"}, "other method:"), ({"seed": 3}, "other seed:"),
                     ({"model": {"name": "powerclip-micro"}}, "other model.name: model.name 'powerclip-tiny' there"),
                     ({"method_cfg": {"lam": 0.3}}, "other method_cfg.lam: method_cfg.lam 0.1 there, 0.3 now"),
                     ({"data": {"batch_size": 32}}, "other data.batch_size: data.batch_size '64 (64 x 1 process(es))'"),
                     ({"precision": "fp64", "optim": {"eps": 1e-8}}, "other optim.eps, precision:")]:
        test_fail(lambda: resume_changes(from_dict(TrainConfig, {**to_dict(_old), **ov}), _ck, "x"), contains=keys)
    # the global batch is what counts: 2 processes of 32 resume a run of 1 x 64
    resume_changes(from_dict(TrainConfig, {**to_dict(_old), "data": {"batch_size": 32}}), _ck, "x", world_size=2)

# %% [markdown]
# ## A run's folder is never overwritten
#
# `resume=never` into a folder that already holds a run (its checkpoints, weights, metrics or config) is refused with
# one line that names the run and the ways on: `resume=auto` continues it, another `out_dir` starts a new one beside
# it, and `overwrite=true` moves the old run aside to `OUT_DIR.old-<time>` (a rename: nothing is deleted) before the
# new one starts. `check_run_folder` also checks, before the first step, that every place the run will write is
# writable: a run that trained for an hour must not fail at its first checkpoint.

# %%
#| export
RUN_MARKS = ("checkpoints/last.pt", "checkpoints/prev.pt", "model.pt", "metrics.csv", "config.yaml", "snapshots")
# what a run writes inside its folder: the folders must be writable folders, the files written in place writable files
RUN_DIRS, RUN_FILES = ("checkpoints", "snapshots", "tb", "eval_world"), ("metrics.csv", "config.yaml")


def run_marks(folder) -> list[str]:
    "The marks of a run (`RUN_MARKS`) that `folder` holds: [] for a folder that holds no run (or does not exist)."
    folder = Path(folder)
    return [m for m in RUN_MARKS if (folder / m).exists()]


def aside_path(folder) -> Path:
    "`NAME.old-<date>-<time>` beside `folder`, a name not taken yet: where `overwrite=true` moves an old run."
    folder = Path(folder)
    base = folder.with_name(f"{folder.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
    p, n = base, 1
    while p.exists():
        n += 1
        p = base.with_name(f"{base.name}-{n}")
    return p


def _writable(p: Path) -> bool:
    return os.access(p, os.W_OK | (os.X_OK if p.is_dir() else 0))


def stale_run(folder) -> list[str]:
    """The run marks of `folder` when it holds no checkpoint to resume from: a finished run whose `checkpoints/` was
    deleted, or files the trainer did not write; [] when there is nothing to refuse. A run of ours stopped before its
    first checkpoint (its `config.yaml` records what it derived, and it left no `model.pt`) may start over."""
    folder = Path(folder)
    marks = [m for m in run_marks(folder) if not m.startswith("checkpoints/")]
    ckpts = folder / "checkpoints"
    if not marks or (ckpts.is_dir() and any(ckpts.glob("*.pt*"))):
        return []
    config = folder / "config.yaml"
    try:
        ours = config.is_file() and "\nderived:" in config.read_text(errors="replace")
    except OSError:
        ours = False
    return [] if ours and "model.pt" not in marks else marks


def check_run_folder(cfg: TrainConfig) -> None:
    """Before anything is written: `resume=never` into a folder holding a run is refused (`overwrite=false`), and so is
    any `resume` into a folder holding a finished run without its checkpoints or files the trainer did not write
    (`stale_run`); every place the run writes must be writable. A `UsageError` naming `out_dir` (see above)."""
    out = Path(cfg.out_dir)
    marks = run_marks(out)
    if cfg.resume == "never" and marks and not cfg.overwrite:
        raise UsageError(f"out_dir: {str(out)!r} holds a run ({', '.join(marks)}) and resume=never would start over "
                         "it: resume=auto continues it, another out_dir starts a new run beside it, overwrite=true "
                         f"moves it aside to {out.name}.old-<time> (nothing is deleted)")
    stale = cfg.resume != "never" and stale_run(out)
    if stale and not cfg.overwrite:
        raise UsageError(f"out_dir: {str(out)!r} holds a finished run or files the trainer did not write "
                         f"({', '.join(stale)}) and no checkpoint to resume from: another out_dir starts a new run "
                         f"beside it, overwrite=true moves it aside to {out.name}.old-<time> (nothing is deleted)")
    moving = (cfg.resume == "never" or stale) and marks and cfg.overwrite
    parent = next((a for a in [out, *out.parents] if a.exists()), None)
    if moving or not out.exists():
        parent = next((a for a in out.parents if a.exists()), Path("."))
        if not (parent.is_dir() and _writable(parent)):
            what = "moved aside" if moving else "created"
            raise UsageError(f"out_dir: {str(out)!r} cannot be {what}: {str(parent)!r} is not writable")
        if moving:
            return
    if not _writable(parent):
        raise UsageError(f"out_dir: {str(out)!r} is not writable (give a folder this user may write)")
    for name in RUN_DIRS + RUN_FILES:
        p = out / name
        if not p.exists():
            continue
        if name in RUN_DIRS and not p.is_dir():
            raise UsageError(f"out_dir: {str(p)!r} is a file where the run writes a folder (give another out_dir)")
        if not _writable(p):
            raise UsageError(f"out_dir: {str(p)!r} is not writable: the run would fail when it first writes there "
                             "(give a folder this user may write)")


def move_aside(folder) -> Path:
    "Rename `folder` to `aside_path(folder)` (a rename, never a deletion); returns where it went."
    dest = aside_path(folder)
    os.replace(folder, dest)
    return dest


# %%
with tempfile.TemporaryDirectory() as d:
    _run = Path(d) / "run"
    check_run_folder(TrainConfig(out_dir=str(_run), resume="never"))           # a new folder: fine
    (_run / "checkpoints").mkdir(parents=True)
    (_run / "metrics.csv").write_text("step,loss\n1,2.0\n")
    test_eq(run_marks(_run), ["metrics.csv"])
    test_fail(lambda: check_run_folder(TrainConfig(out_dir=str(_run), resume="never")),
              contains="holds a run (metrics.csv) and resume=never would start over it: resume=auto continues it")
    (_run / "checkpoints" / "last.pt").write_bytes(b"")
    check_run_folder(TrainConfig(out_dir=str(_run)))                           # resume=auto continues it
    check_run_folder(TrainConfig(out_dir=str(_run), resume="never", overwrite=True))
    _old = move_aside(_run)
    assert not _run.exists() and (_old / "metrics.csv").is_file() and _old.name.startswith("run.old-")
    _run.mkdir()
    (_run / "checkpoints").write_text("")                                       # a file where a folder goes
    test_fail(lambda: check_run_folder(TrainConfig(out_dir=str(_run))), contains="is a file where the run writes")
    (_run / "checkpoints").unlink()
    (_run / "checkpoints").symlink_to("/proc/sys")                              # a folder no one may write
    test_fail(lambda: check_run_folder(TrainConfig(out_dir=str(_run))), contains="checkpoints' is not writable")
    test_fail(lambda: check_run_folder(TrainConfig(out_dir="/proc/sys/powerclip_run")), contains="cannot be created")
    # a finished run without its checkpoints, or a user's own files: refused under resume=auto too
    _run = Path(d) / "done"
    _run.mkdir()
    (_run / "model.pt").write_bytes(b"x")
    test_fail(lambda: check_run_folder(TrainConfig(out_dir=str(_run))), contains="holds a finished run or files the "
              "trainer did not write (model.pt) and no checkpoint to resume from")
    check_run_folder(TrainConfig(out_dir=str(_run), overwrite=True))             # moved aside by the trainer
    (_run / "model.pt").unlink()
    (_run / "config.yaml").write_text("seed: 0\nderived:\n  seeds: {}\n")      # ours, stopped before a checkpoint
    test_eq(stale_run(_run), [])


# %% [markdown]
# ## Weights a run starts from, read before the model is built
#
# `model.pretrained` is checked before the model is built: a file cut short (a copy interrupted) or not a checkpoint
# at all is one line (`weights_problem`), not open_clip's traceback. A checkpoint of another model size is found when
# its weights meet the model; `shape_mismatch` (from the two state dicts) and `load_error_line` (from torch's error of
# one line per tensor) make it one line naming the first tensor whose size differs, its size in the checkpoint and in
# the model, and how many differ.

# %%
#| export
def bias_kwargs(path) -> dict:
    """`{'init_logit_bias': -10.0}` when the weights file `path` holds SigLIP's `logit_bias` (its model had one: a
    SigLIP snapshot), so that the model built for it holds one too and the weights load (their b replaces the -10);
    else `{}`. Memory-mapped: no tensor is read."""
    if path is None or path == "required":
        return {}
    sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    sd = sd.get("state_dict", sd) if isinstance(sd, dict) else {}
    return {"init_logit_bias": -10.0} if any(k.removeprefix("module.").removeprefix("model.") == "logit_bias"
                                            for k in sd) else {}


def weights_problem(path) -> str | None:
    """Why the weights file `path` cannot be read (None when it can): a torch zip file's directory, a safetensors
    header and its extent, or an older torch file read whole. Cheap for the usual formats (no tensor is read)."""
    p = Path(path)
    try:
        size = p.stat().st_size
        if size == 0:
            return "an empty file"
        if zipfile.is_zipfile(p):
            with zipfile.ZipFile(p) as z:
                if not any(n.endswith("data.pkl") for n in z.namelist()):
                    return "a zip file, not a torch checkpoint"
            return None
        with open(p, "rb") as f:
            if p.suffix == ".safetensors":
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
                end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
                return None if 8 + n + end <= size else f"cut short ({size} bytes, its header needs {8 + n + end})"
        torch.load(p, map_location="cpu", weights_only=True)        # an older (not zip) torch file: read it whole
        return None
    except Exception as e:
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"


def is_trainer_checkpoint(path) -> bool:
    """Whether `path` is one of the trainer's checkpoints (`checkpoints/last.pt`: weights with the optimiser's and
    random generators' states), found in its pickle's bytes without unpickling it."""
    try:
        with zipfile.ZipFile(path) as z:
            pkl = next((n for n in z.namelist() if n.endswith("data.pkl")), None)
            raw = z.read(pkl) if pkl else b""
    except (OSError, zipfile.BadZipFile):
        return False
    return all(k in raw for k in (b"optimizer", b"scheduler", b"rng", b"torch_version"))


def weights_of_run(path) -> str:
    "Where a run keeps its weights, for a checkpoint `path` inside `RUN/checkpoints/`: `RUN/model.pt` or a snapshot's."
    p = Path(path)
    run = p.parent.parent if p.parent.name == "checkpoints" else Path("RUN")
    return f"{run / 'model.pt'} or {run / 'snapshots' / 'stepN' / 'model.pt'}"


def shape_mismatch(sd: dict, own: dict) -> str | None:
    """One line naming the first tensor whose size differs between the state dict `sd` (a checkpoint's; `state_dict`
    and `module.` wrappings undone) and `own` (the model's), with how many differ; None when every shared one fits."""
    sd = sd.get("state_dict", sd) if isinstance(sd, dict) else {}
    sd = {k.removeprefix("module."): v for k, v in sd.items()}
    bad = [(k, tuple(v.shape), tuple(own[k].shape)) for k, v in sd.items()
           if k in own and torch.is_tensor(v) and tuple(v.shape) != tuple(own[k].shape)]
    if not bad:
        return None
    k, a, b = bad[0]
    return (f"{k} is {a} in the checkpoint, {b} in the model; {len(bad)} tensors differ in size (a checkpoint of "
            "another model size: give its model)")


def load_error_line(e: BaseException) -> str:
    "torch's `load_state_dict` error (a line per tensor) as one line: the first size that differs, and the counts."
    msg = str(e)
    sizes = re.findall(r"size mismatch for ([\w.]+): copying a param with shape torch\.Size\(\[([\d, ]*)\]\) from "
                       r"checkpoint, the shape in current model is torch\.Size\(\[([\d, ]*)\]\)", msg)
    if not sizes:
        return re.sub(r"\s+", " ", msg).strip()[:300]
    counts = ""
    for what in ("Missing", "Unexpected"):
        keys = re.search(what + r" key\(s\) in state_dict: (.*)", msg)
        if keys:
            n = len(re.findall(r'"[^"]+"', keys[1]))
            counts += f", {n} {what.lower()}"
    name, ck, model = sizes[0]
    return (f"{name} is ({ck}) in the checkpoint, ({model}) in the model; {len(sizes)} tensors differ in size{counts} "
            "(a checkpoint of another model size: give its model)")


# %%
with tempfile.TemporaryDirectory() as d:
    _w = Path(d) / "w.pt"
    torch.save({"a": torch.ones(3)}, _w)
    test_eq(weights_problem(_w), None)
    _w.write_bytes(_w.read_bytes()[:200])                                       # a copy cut short
    assert "central directory" in weights_problem(_w), weights_problem(_w)
    _w.write_bytes(b"")
    test_eq(weights_problem(_w), "an empty file")
_a = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
_b = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2), torch.nn.Linear(2, 2))
test_eq(shape_mismatch({"state_dict": {"module." + k: v for k, v in _a.state_dict().items()}}, _b.state_dict()),
        "0.weight is (4, 3) in the checkpoint, (5, 3) in the model; 3 tensors differ in size (a checkpoint of another "
        "model size: give its model)")
test_eq(shape_mismatch(_a.state_dict(), _a.state_dict()), None)
try:
    _b.load_state_dict(_a.state_dict())
except RuntimeError as _e:
    test_eq(load_error_line(_e), "0.weight is (4, 3) in the checkpoint, (5, 3) in the model; 3 tensors differ in "
                                 "size, 2 missing (a checkpoint of another model size: give its model)")

# %% [markdown]
# ## open_clip's checkpoints
#
# Weights trained elsewhere are read too, in the two layouts open_clip leaves (`62_eval_models` builds the model
# from what they record):
#
# - a **release**, the folder open_clip writes for a model hub (`push_to_hf_hub`): `open_clip_config.json`, holding
#   `{"model_cfg": .., "preprocess_cfg": ..}`, beside `open_clip_model.safetensors` or `open_clip_pytorch_model.bin`;
# - a **training run** of open_clip's script, `logs/NAME/`: `params.txt` (`key: value` lines, `model: ViT-B-16`
#   among them) and `checkpoints/epoch_N.pt` (`{'epoch', 'name', 'state_dict', 'optimizer', ..}`). The folder means
#   its latest epoch: `epoch_latest.pt` when the run kept one (`--save-most-recent`), else the largest N, compared as
#   numbers (`epoch_10` after `epoch_9`). Another epoch is chosen by giving its file.
#
# `find_weights` turns what a user gives (a file, our run folder, either open_clip folder, or a run's `checkpoints/`)
# into the file holding the weights and the file recording how they were trained: our `config.yaml`, else open_clip's
# `params.txt`, else `open_clip_config.json`, beside the weights or one folder up. A folder in none of these
# layouts, or a release with no weights beside its config, is a `CheckpointLayoutError`: one line naming the layouts.

# %%
#| export
RELEASE_CONFIG = "open_clip_config.json"
# open_clip's own order of preference in a release folder (`open_clip.factory._find_checkpoint_in_dir`)
RELEASE_WEIGHTS = ("open_clip_model.safetensors", "open_clip_pytorch_model.safetensors", "open_clip_pytorch_model.bin",
                   "open_clip_pytorch_model.pth")
RECORDS = ("config.yaml", "params.txt", RELEASE_CONFIG)   # what a checkpoint's training is read from, in this order
LAYOUTS = ("model.pt or checkpoints/last.pt (a powerclip run), open_clip_config.json with open_clip_model.safetensors "
           "or open_clip_pytorch_model.bin (an open_clip release), checkpoints/epoch_N.pt (an open_clip run)")


class CheckpointLayoutError(FileNotFoundError):
    "A path holding no checkpoint in a known layout."


@dataclass
class CheckpointFiles:
    weights: Path               # the file holding the weights
    layout: str                 # 'file' | 'powerclip run' | 'open_clip release' | 'open_clip run'
    record: Path | None = None  # config.yaml, params.txt or open_clip_config.json: how the weights were trained


def latest_epoch(folder) -> Path | None:
    "`folder/epoch_latest.pt`, else the `epoch_N.pt` of largest N (None when there is none)."
    folder = Path(folder)
    if (folder / "epoch_latest.pt").is_file():
        return folder / "epoch_latest.pt"
    epochs = [(int(p.stem[6:]), p) for p in folder.glob("epoch_*.pt") if p.stem[6:].isdigit() and p.is_file()]
    return max(epochs)[1] if epochs else None


def _record(weights: Path) -> Path | None:
    for name in RECORDS:
        for d in (weights.parent, weights.parent.parent):
            if (d / name).is_file():
                return d / name
    return None


def find_weights(path) -> CheckpointFiles:
    "The weights file and the training record of a checkpoint file or folder (see above); `CheckpointLayoutError`."
    path = Path(path)
    if path.is_file():
        return CheckpointFiles(path, "file", _record(path))
    if not path.is_dir():
        raise CheckpointLayoutError(f"{path} does not exist (a checkpoint file, or a folder holding {LAYOUTS})")
    for f in (path / "model.pt", path / "checkpoints" / "last.pt"):
        if f.is_file():
            return CheckpointFiles(f, "powerclip run", _record(f))
    release = next((path / n for n in RELEASE_WEIGHTS if (path / n).is_file()), None)
    if (path / RELEASE_CONFIG).is_file() or release is not None:
        if release is None:
            raise CheckpointLayoutError(f"{path} has {RELEASE_CONFIG} but no weights beside it "
                                        f"({' or '.join(RELEASE_WEIGHTS[::2])})")
        return CheckpointFiles(release, "open_clip release", _record(release))
    epoch = latest_epoch(path / "checkpoints") or latest_epoch(path)
    if epoch is not None:
        return CheckpointFiles(epoch, "open_clip run", _record(epoch))
    raise CheckpointLayoutError(f"{path} holds no checkpoint in a known layout: {LAYOUTS}")


def read_params(path) -> dict[str, str]:
    "open_clip's `params.txt`: `{key: value}` of its `key: value` lines, values as written."
    out = {}
    for line in Path(path).read_text(errors="replace").splitlines():
        k, sep, v = line.partition(":")
        if sep and k.strip() and " " not in k.strip():
            out[k.strip()] = v.strip()
    return out


# %% [markdown]
# Each layout, built in a temporary folder with stand-in files: the latest epoch is found numerically and
# `epoch_latest.pt` wins, a named epoch is taken as it is (its run's `params.txt` two folders up), and a folder in
# no layout says which layouts it could have been.

# %%
with tempfile.TemporaryDirectory() as d:
    d = Path(d)
    (d / "logs" / "r1" / "checkpoints").mkdir(parents=True)
    (d / "logs" / "r1" / "params.txt").write_text("batch_size: 8\nmodel: ViT-B-16\nname: r1\npretrained: \n")
    for n in (2, 9, 10):
        (d / "logs" / "r1" / "checkpoints" / f"epoch_{n}.pt").write_bytes(b"x")
    _f = find_weights(d / "logs" / "r1")
    test_eq((_f.weights.name, _f.layout, _f.record.name), ("epoch_10.pt", "open_clip run", "params.txt"))
    test_eq(find_weights(d / "logs" / "r1" / "checkpoints").weights.name, "epoch_10.pt")
    _f = find_weights(d / "logs" / "r1" / "checkpoints" / "epoch_2.pt")
    test_eq((_f.weights.name, _f.layout, _f.record.name), ("epoch_2.pt", "file", "params.txt"))
    (d / "logs" / "r1" / "checkpoints" / "epoch_latest.pt").write_bytes(b"x")
    test_eq(find_weights(d / "logs" / "r1").weights.name, "epoch_latest.pt")
    test_eq(read_params(d / "logs" / "r1" / "params.txt"), dict(batch_size="8", model="ViT-B-16", name="r1",
                                                                pretrained=""))
    (d / "hub").mkdir()
    (d / "hub" / RELEASE_CONFIG).write_text('{"model_cfg": {}}')
    test_fail(lambda: find_weights(d / "hub"), contains="no weights beside it")
    (d / "hub" / "open_clip_pytorch_model.bin").write_bytes(b"x")
    (d / "hub" / "open_clip_model.safetensors").write_bytes(b"x")
    _f = find_weights(d / "hub")
    test_eq((_f.weights.name, _f.layout, _f.record.name), ("open_clip_model.safetensors", "open_clip release",
                                                           RELEASE_CONFIG))
    test_fail(lambda: find_weights(d / "logs"), contains="no checkpoint in a known layout")
    test_fail(lambda: find_weights(d / "nothing"), contains="does not exist")
