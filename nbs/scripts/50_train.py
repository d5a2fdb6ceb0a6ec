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

import contextlib, csv, dataclasses, json, math, os, random, sys, time, typing, warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import yaml

from powerclip import dist as pdist
from powerclip.data import BatchNeeds, BatchSpec, DataConfig, Geometry, Loader, make_loader, mix_seed, run_seeds, steps_per_epoch
from powerclip.measure import PeakMemory
from powerclip.methods import Method, get_method, method_config

# %%
#| hide
import tempfile
from fastcore.test import test_close, test_eq, test_fail
from torch.testing import assert_close


# %% [markdown]
# # The trainer
#
# > One trainer for every method: a config per component, one run seed, `build_run` that assembles a run once, AdamW with cosine warm-up, precision, exact resume from checkpoints, skipped bad steps, progress, CSV/TensorBoard logs and plots, data-parallel on any number of processes.

# %% [markdown]
# The trainer composes the pieces of the earlier notebooks and knows none of them by name:
#
# - a **model** from `powerclip.model.create_model(name)` (open_clip towers), whose geometry (image size, patch
#   size, context length) `powerclip.model.model_geometry` reads from its config before it is built;
# - a **method** from the registry of `40_methods`, which says what the data must build (`needs()`), what the
#   forward pass returns and which named loss terms to add; the trainer sums the terms whose names do not start
#   with `_` and logs all of them;
# - **batches** from `powerclip.data.make_loader(spec, epoch, start_step, rank, world_size)`, where the spec holds
#   the data config, the model's geometry, the method's needs and the run seed, and batch $b$ of epoch $e$ is a pure
#   function of `(spec, e, b)`;
# - **processes** through `powerclip.dist` (the only module that touches process groups), and time and memory
#   through `powerclip.measure`.
#
# `build_run(cfg, ctx)` assembles these once, for the trainer, `benchmarks/train_step_ratio.py` and
# `tests/test_ddp.py` alike. The run's config is one dataclass of dataclasses, read from a small YAML preset plus
# `key=value` overrides, and written next to the run's outputs with what was derived from it (every random stream's
# seed, the geometry, the method's batch needs).

# %% [markdown]
# ## Configuration

# %%
#| export
@dataclass
class ModelConfig:
    name: str = "powerclip-tiny"       # open_clip architecture name (ViT-B-16, or powerclip/model_configs/*.json)
    pretrained: str | None = None      # a local checkpoint file, or None (random init); nothing is downloaded.
                                       # 'required': the preset fine-tunes (C2LIP, SmartCLIP): the run stops
                                       # until model.pretrained=PATH is given
    grad_checkpointing: bool = False   # recompute activations in backward (less memory, ~30% more time)
    compile: bool = False              # torch.compile the forward pass
    kwargs: dict = field(default_factory=dict)  # open_clip model_kwargs overriding the architecture's config
                                       # (whole entries, e.g. a text_cfg with a shorter context_length); the
                                       # geometry of the data follows it


@dataclass
class OptimConfig:
    lr: float = 5e-4                   # peak learning rate
    betas: tuple = (0.9, 0.98)         # AdamW betas (open_clip / CLIP)
    eps: float = 1e-6                  # AdamW eps
    weight_decay: float = 0.2          # not applied to biases, norms, logit_scale and embeddings
    warmup_steps: int = 100            # linear warm-up from lr/warmup to lr, then cosine to min_lr
    min_lr: float = 0.0                # end of the cosine
    grad_clip: float | None = None     # clip the global gradient norm (None: no clipping, norm still checked)


@dataclass
class TrainConfig:
    "A whole run. `method_cfg` holds the options of `method` (see `powerclip.methods`)."
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    method: str = "powerclip"          # a name registered in powerclip.methods
    method_cfg: dict = field(default_factory=dict)  # options of that method (e.g. lam, tau, alpha)
    optim: OptimConfig = field(default_factory=OptimConfig)
    epochs: int = 1                    # passes over the data (an epoch = steps_per_epoch(data))
    max_steps: int | None = None       # stop after this many steps (overrides epochs; needed for unsized shards)
    stop_at: int | None = None         # leave early after this step, with a checkpoint (time-limited jobs); the
                                       # schedule still runs to the full length, and resuming continues it
    global_batch_size: int | None = None  # if set: data.batch_size = global_batch_size / processes
    precision: str = "auto"            # 'fp32' | 'bf16' (autocast) | 'auto' (bf16 on GPU, fp32 on CPU) | 'fp64' (exactness checks)
    seed: int = 0                      # the run seed: every random stream (init, data order, world scenes, region
                                       # draws, method noise, forward pass) derives from it by name (config.yaml)
    out_dir: str = "runs/run"          # config.yaml, metrics.csv, tb/, checkpoints/, loss.png
    log_every: int = 10                # steps between metric rows
    ckpt_every: int = 500              # steps between checkpoints (and one at the end)
    resume: str = "auto"               # 'auto' (out_dir/checkpoints/last.pt if present) | 'never' | a checkpoint path
    max_bad_in_row: int = 20           # abort after this many consecutive non-finite steps
    device: str | None = None          # 'cpu' | 'cuda' | None (cuda when available)
    progress: bool = True              # tqdm progress bar on the main process
    tensorboard: bool = True           # also write TensorBoard events to out_dir/tb
    find_unused_parameters: bool = False  # DDP option, for methods that leave parameters unused
    snapshot_steps: tuple = ()         # after these steps also write snapshots/step{N}/ (model.pt, method_modules.pt,
                                       # config.yaml, snapshot.json with the training seconds so far): learning curves,
                                       # and the start of a fine-tune from the middle of a run
    start_batch: int = 0               # the first batch is this batch of the run seed's data order (a fine-tune that
                                       # continues its base run's data: the base run's step); the schedule starts at 0

    def __post_init__(self):
        if self.precision not in ("fp32", "bf16", "auto", "fp64"): raise ValueError(f"precision must be fp32|bf16|auto|fp64, got {self.precision!r}")
        if self.resume not in ("auto", "never") and not str(self.resume).endswith(".pt"):
            raise ValueError(f"resume must be 'auto', 'never' or a .pt checkpoint path, got {self.resume!r}")
        if self.log_every < 1 or self.ckpt_every < 1: raise ValueError("log_every and ckpt_every must be >= 1")
        if self.start_batch < 0 or any(int(n) != n or n < 1 for n in self.snapshot_steps):
            raise ValueError(f"need start_batch >= 0 and snapshot_steps >= 1 (integers), got {self.start_batch}, {list(self.snapshot_steps)}")


# %% [markdown]
# Configs travel as plain nested dicts (YAML). `from_dict` builds the dataclasses back, checking every key, so
# a typo in a preset or an override is an error, never a silently ignored option.

# %%
#| export
def from_dict(cls, d: dict):
    "A (nested) config dataclass from a plain dict; unknown keys are an error; lists become tuples where typed so."
    if not isinstance(d, dict): raise TypeError(f"{cls.__name__} needs a mapping, got {type(d).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown: raise ValueError(f"unknown key(s) {unknown} for {cls.__name__}; known: {sorted(names)}")
    kw = {}
    for k, v in d.items():
        t = hints[k]
        if dataclasses.is_dataclass(t) and isinstance(v, dict): v = from_dict(t, v)
        elif t is tuple or typing.get_origin(t) is tuple: v = tuple(v)
        elif isinstance(v, str) and float in _types(t):
            try: v = float(v)  # YAML 1.1 reads '1e-3' as a string
            except ValueError: pass
        kw[k] = v
    return cls(**kw)


def _types(t) -> tuple:
    return typing.get_args(t) if typing.get_origin(t) in (typing.Union, getattr(__import__("types"), "UnionType", None)) else (t,)


def to_dict(cfg) -> dict:
    "Plain nested dict of a config (tuples as lists: what YAML writes)."
    def plain(x):
        if isinstance(x, dict): return {k: plain(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)): return [plain(v) for v in x]
        return x
    return plain(asdict(cfg))


# %%
_c = from_dict(TrainConfig, {"optim": {"lr": "1e-3", "betas": [0.9, 0.95]}, "data": {"batch_size": 8}, "method": "clip"})
test_eq((_c.optim.lr, _c.optim.betas, _c.data.batch_size, _c.method), (1e-3, (0.9, 0.95), 8, "clip"))
test_eq(from_dict(TrainConfig, to_dict(_c)), _c)
test_fail(lambda: from_dict(TrainConfig, {"optim": {"learning_rate": 1.0}}), contains="unknown key")

# %% [markdown]
# ### Presets and overrides
#
# Presets are small YAML files in `powerclip/presets/`. A preset may hold a `method_cfgs` table with the
# options of several methods; the run picks the entry of its `method`, so `--method clip` on the PowerCLIP
# preset is a fair CLIP baseline with everything else equal. Overrides are `key=value` with dotted keys,
# values read as YAML (`optim.lr=1e-3`, `method_cfg.masks=gold`, `method_cfg.lam=0.2`, `max_steps=null`). A run's
# own `config.yaml` is a preset too; its `derived` section (what the run computed from the seed and the model) is a
# record and is not read back.

# %%
#| export
PRESET_DIR = Path(__import__("powerclip").__file__).parent / "presets"  # shipped as package data


def preset_path(name: str) -> Path:
    "A preset name ('demo', 'paper') or a path to a YAML file."
    p = Path(name)
    if p.suffix in (".yaml", ".yml") and p.is_file(): return p
    p = PRESET_DIR / f"{name}.yaml"
    if not p.is_file():
        raise FileNotFoundError(f"no preset {name!r}; known: {sorted(q.stem for q in PRESET_DIR.glob('*.yaml'))} (or give a .yaml path)")
    return p


def set_dotted(d: dict, key: str, value) -> None:
    "d['a']['b'] = value for key 'a.b' (creating the inner dicts)."
    *head, last = key.split(".")
    for k in head: d = d.setdefault(k, {})
    d[last] = value


def parse_override(s: str) -> tuple[str, object]:
    if "=" not in s: raise ValueError(f"override {s!r} is not key=value")
    k, v = s.split("=", 1)
    return k.strip(), yaml.safe_load(v)


def load_config(preset: str | None = "demo", overrides: list[str] | dict | None = (), method: str | None = None) -> TrainConfig:
    "TrainConfig from a preset, a method name and `key=value` overrides (applied in that order)."
    d = yaml.safe_load(preset_path(preset).read_text()) if preset else {}
    d = d or {}
    d.pop("derived", None)  # a run's record of what it derived (seeds, geometry, needs): recomputed, never read
    method_cfgs = d.pop("method_cfgs", {}) or {}
    if method: d["method"] = method
    m = d.get("method", TrainConfig.method)
    d["method_cfg"] = {**(method_cfgs.get(m) or {}), **(d.get("method_cfg") or {})}
    items = overrides.items() if isinstance(overrides, dict) else map(parse_override, overrides or ())
    for k, v in items: set_dotted(d, k, v)
    cfg = from_dict(TrainConfig, d)
    method_config(cfg.method, cfg.method_cfg)  # an unknown method or option fails here, not after the model is built
    return cfg


# %%
_c = load_config("demo", ["optim.lr=2e-3", "method_cfg.masks=gold", "method_cfg.lam=0.3"])
test_eq((_c.optim.lr, _c.method_cfg["masks"], _c.method, _c.method_cfg["lam"]), (2e-3, "gold", "powerclip", 0.3))
test_eq(load_config("demo", method="clip").method_cfg, {})
test_fail(lambda: load_config("nope"), contains="known")
print(preset_path("demo").read_text())


# %% [markdown]
# ## Optimiser and schedule
#
# AdamW as in CLIP and open_clip: weight decay on the weight matrices only, none on biases, norm gains,
# the temperature and the embeddings (positional, class, token). The learning rate rises linearly over
# `warmup_steps`, then follows a cosine to `min_lr` at the last step.

# %%
#| export
def no_decay(name: str, p: torch.Tensor) -> bool:
    "Parameters without weight decay: biases, norms, gains (all < 2-D), logit_scale, and embeddings."
    return p.ndim < 2 or "logit_scale" in name or "embedding" in name or ".ln" in name or name.startswith("ln")


def make_optimizer(model: torch.nn.Module, cfg: OptimConfig, modules: torch.nn.Module | None = None,
                   modules_lr: float | None = None) -> torch.optim.AdamW:
    """AdamW over the model (and a method's training-time `modules` at their own peak `modules_lr`), with and
    without weight decay. The schedule scales every group's peak rate by the same factor."""
    groups = []
    for mod, lr in ((model, cfg.lr), (modules, cfg.lr if modules_lr is None else modules_lr)):
        if mod is None: continue
        decay, rest = [], []
        for n, p in mod.named_parameters():
            if p.requires_grad: (rest if no_decay(n, p) else decay).append(p)
        groups += [dict(params=decay, weight_decay=cfg.weight_decay, lr=lr), dict(params=rest, weight_decay=0.0, lr=lr)]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)


def lr_factor(step: int, total: int, warmup: int, min_ratio: float = 0.0) -> float:
    "Multiplier of the peak lr at `step` (0-based): linear warm-up, then cosine down to `min_ratio`."
    if step < warmup: return (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))


def make_scheduler(opt, cfg: OptimConfig, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    ratio = cfg.min_lr / cfg.lr if cfg.lr > 0 else 0.0
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, total, cfg.warmup_steps, ratio))


# %%
from powerclip.model import create_model
_m, _, _ = create_model("powerclip-micro")
_opt = make_optimizer(_m, OptimConfig())
_nd = {n for n, p in _m.named_parameters() if no_decay(n, p)}
assert {"logit_scale", "positional_embedding", "token_embedding.weight", "visual.class_embedding"} <= _nd
assert not any(n.endswith("attn.in_proj_weight") or n.endswith("mlp.c_fc.weight") for n in _nd)
print(f"{len(_opt.param_groups[0]['params'])} tensors with weight decay, {len(_nd)} without")
_f = [lr_factor(s, 100, 10) for s in range(100)]
assert _f[0] == 0.1 and _f[9] == 1.0 and abs(_f[-1]) < 1e-3 and all(a >= b for a, b in zip(_f[9:], _f[10:]))


# %% [markdown]
# ## Checkpoints that resume exactly
#
# A run killed at any moment and resumed from its last checkpoint must continue as if it had never stopped.
# So a checkpoint holds, besides the weights: the optimiser's moments, the scheduler's position, every random
# generator (Python, NumPy, torch, CUDA; one set per process), and the data position `(epoch, step in epoch)`,
# from which `make_loader` regenerates exactly the batches that were not yet seen. It is written to a temporary
# file and renamed, so a kill during the write leaves the previous checkpoint intact.

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
    seconds: float = 0.0      # wall-clock seconds of the training loop so far, across resumes


def rng_state() -> dict:
    return dict(python=random.getstate(), numpy=np.random.get_state(), torch=torch.get_rng_state(),
                cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)


def set_rng_state(s: dict) -> None:
    random.setstate(s["python"]); np.random.set_state(s["numpy"]); torch.set_rng_state(s["torch"])
    if s.get("cuda") is not None and torch.cuda.is_available(): torch.cuda.set_rng_state_all(s["cuda"])


def seed_all(seed: int) -> None:
    random.seed(seed); np.random.seed(seed % 2**32); torch.manual_seed(seed)


def _atomic_save(obj, path: Path) -> Path:
    "torch.save to a temporary name, then rename: a kill mid-write leaves the previous file intact."
    path = Path(path); path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)
    return path


def save_checkpoint(path, model, opt, sched, state: TrainState, cfg: TrainConfig, rngs: list[dict], scaler=None,
                    modules: torch.nn.Module | None = None) -> Path:
    """Atomic write of everything needed to resume (`rngs`: one RNG state per process). The open_clip weights
    (`model`) and a method's training-time modules (`method_modules`) are separate entries."""
    ckpt = dict(model=model.state_dict(), method_modules=None if modules is None else modules.state_dict(),
                optimizer=opt.state_dict(), scheduler=sched.state_dict(),
                scaler=None if scaler is None else scaler.state_dict(), state=asdict(state), rng=rngs,
                config=to_dict(cfg), torch_version=torch.__version__)
    return _atomic_save(ckpt, path)


def export_weights(run_dir, model, modules: torch.nn.Module | None = None) -> dict[str, Path]:
    """`run_dir/model.pt`: the open_clip state dict alone, which plain open_clip loads
    (`open_clip.create_model_and_transforms(name, pretrained=path)` after `powerclip.model.register_configs()`),
    whatever the method; `run_dir/method_modules.pt` beside it when the method trained modules of its own."""
    out = dict(model=_atomic_save(model.state_dict(), Path(run_dir) / "model.pt"))
    if modules is not None: out["method_modules"] = _atomic_save(modules.state_dict(), Path(run_dir) / "method_modules.pt")
    return out


def save_snapshot(run_dir, step: int, seconds: float, model, modules: torch.nn.Module | None = None) -> Path:
    """`run_dir/snapshots/step{step}/`: the weights as `export_weights` writes them, the run's `config.yaml` (so the
    folder loads like a run folder) and, written last, `snapshot.json` (step, training seconds so far): a folder
    without it is incomplete."""
    d = Path(run_dir) / "snapshots" / f"step{step}"
    export_weights(d, model, modules)
    for name, text in (("config.yaml", (Path(run_dir) / "config.yaml").read_text()),
                       ("snapshot.json", json.dumps(dict(step=step, seconds=seconds)))):
        tmp = d / (name + ".tmp"); tmp.write_text(text); os.replace(tmp, d / name)
    return d


def load_checkpoint(path, map_location="cpu") -> dict:
    # our own file: it holds Python and NumPy RNG states, which the weights-only loader refuses
    return torch.load(path, map_location=map_location, weights_only=False)


# %%
with tempfile.TemporaryDirectory() as d:
    seed_all(3); _s0 = rng_state(); _a = (random.random(), np.random.rand(), torch.rand(1))
    set_rng_state(_s0); assert (random.random(), np.random.rand(), torch.rand(1)) == _a
    _sch = make_scheduler(_opt, OptimConfig(warmup_steps=2), 10); _opt.step(); _sch.step()
    p = save_checkpoint(Path(d) / "c" / "last.pt", _m, _opt, _sch, TrainState(step=1), TrainConfig(), [_s0])
    ck = load_checkpoint(p)
    test_eq(ck["state"]["step"], 1); test_eq(ck["scheduler"]["last_epoch"], 1)
    assert_close(ck["model"]["logit_scale"], _m.logit_scale.detach())
    assert not list(Path(d, "c").glob("*.tmp"))


# %% [markdown]
# ## Metrics: CSV, TensorBoard, plot
#
# One row per `log_every` steps, with every loss term the method returned. Rows are kept in memory and the CSV
# is rewritten when a new column appears (a method may add a term later). On resume, rows after the
# checkpoint's step (written by the killed run after its last checkpoint) are dropped, so the file reads as one
# uninterrupted run.

# %%
#| export
class MetricLogger:
    "metrics.csv (+ TensorBoard) in `run_dir`; inactive on processes other than the main one."
    def __init__(self, run_dir, enabled: bool = True, resume_step: int | None = None, tensorboard: bool = True):
        self.path, self.enabled, self.rows, self.tb = Path(run_dir) / "metrics.csv", enabled, [], None
        if not enabled: return
        if resume_step is not None and self.path.is_file():
            self.rows = [r for r in read_metrics(self.path) if r["step"] <= resume_step]
        self.cols = list(dict.fromkeys(k for r in self.rows for k in r))
        self._rewrite()
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(str(Path(run_dir) / "tb"), purge_step=None if resume_step is None else resume_step + 1)

    def _rewrite(self):
        with open(self.path, "w", newline="") as f:
            w = csv.DictWriter(f, self.cols); w.writeheader(); w.writerows(self.rows)

    def log(self, row: dict) -> None:
        if not self.enabled: return
        row = {k: (float(v) if isinstance(v, torch.Tensor) else v) for k, v in row.items()}
        self.rows.append(row)
        if any(k not in self.cols for k in row):
            self.cols += [k for k in row if k not in self.cols]; self._rewrite()
        else:
            with open(self.path, "a", newline="") as f: csv.DictWriter(f, self.cols).writerow(row)
        if self.tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)): self.tb.add_scalar(k.lstrip("_"), v, row["step"])

    def close(self):
        if self.tb is not None: self.tb.close()


def read_metrics(path) -> list[dict]:
    "Rows of a metrics.csv with numbers parsed (empty cells dropped)."
    def num(v):
        try: return int(v)
        except ValueError: return float(v)
    with open(path, newline="") as f:
        return [{k: num(v) for k, v in r.items() if v not in ("", None)} for r in csv.DictReader(f)]


def plot_metrics(runs: dict[str, list[dict]] | list[dict], path=None, title: str = ""):
    "Loss terms (every key without '_' that is a loss), lr and throughput against step; one line per run."
    from matplotlib.figure import Figure  # no pyplot: works under any backend, never switches the notebook's
    runs = {"": runs} if isinstance(runs, list) else runs
    skip = {"step", "epoch", "lr", "img_per_s", "time", "bad_total", "loss"}
    terms = sorted({k for rows in runs.values() for r in rows for k in r if k not in skip and not k.startswith("_")
                    and not k.startswith("skipped")})
    panels = ["loss"] + terms + ["lr", "img_per_s"]
    fig = Figure(figsize=(3.2 * len(panels), 2.8))
    axes = fig.subplots(1, len(panels))
    for ax, key in zip(np.atleast_1d(axes), panels):
        for name, rows in runs.items():
            xs = [r["step"] for r in rows if key in r]
            if xs: ax.plot(xs, [r[key] for r in rows if key in r], label=name or None, lw=1)
        ax.set_title(key); ax.set_xlabel("step")
    if len(runs) > 1: np.atleast_1d(axes)[0].legend(fontsize=7)
    if title: fig.suptitle(title)
    fig.tight_layout()
    if path is not None: fig.savefig(path, dpi=110)
    return fig


# %%
with tempfile.TemporaryDirectory() as d:
    lg = MetricLogger(d, tensorboard=False)
    lg.log(dict(step=1, loss=2.0, clip=2.0)); lg.log(dict(step=2, loss=1.5, clip=1.4, powerset=torch.tensor(0.5)))
    test_eq(read_metrics(Path(d) / "metrics.csv")[1], dict(step=2, loss=1.5, clip=1.4, powerset=0.5))
    test_eq(len(MetricLogger(d, resume_step=1, tensorboard=False).rows), 1)  # the row after the checkpoint is dropped


# %% [markdown]
# ## One step
#
# The method's forward pass runs inside an `nn.Module` (`MethodForward`), so that DistributedDataParallel wraps
# it: DDP synchronises gradients only for computations that pass through its `forward`. The loss is averaged
# over the processes *before* deciding whether the step is bad, so every process skips the same steps (a
# process that skipped alone would leave the others waiting in the gradient all-reduce).

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
    if modules is not None: modules.to(next(model.parameters()).device)
    return MethodForward(model, method, modules)


def to_device(batch: dict, device) -> dict:
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def autocast_for(precision: str, device: torch.device):
    "bf16 autocast, or nothing (fp32, fp64). 'auto': bf16 on GPU, fp32 on CPU."
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def forward_loss(fwd, method, batch: dict, ctx: pdist.DistContext, precision: str = "fp32") -> tuple[torch.Tensor, dict]:
    "(total loss, named terms) of one batch: the sum of the terms without a leading underscore."
    with autocast_for(precision, ctx.device):
        out = fwd(batch)
        terms = method.loss(out, batch, ctx)
    summed = [v for k, v in terms.items() if not k.startswith("_")]
    if not summed: raise ValueError(f"method {method.name!r} returned no loss term (only {sorted(terms)})")
    return sum(summed), terms


def train_step(fwd, method, batch, ctx, opt, sched, state: TrainState, cfg: TrainConfig, model) -> dict:
    "Forward, backward, optimiser and scheduler step; a non-finite loss or gradient norm skips the update."
    loss, terms = forward_loss(fwd, method, batch, ctx, cfg.precision)
    loss_all = pdist.all_mean(loss.float())
    opt.zero_grad(set_to_none=True)
    ok = bool(torch.isfinite(loss_all))
    gnorm = torch.tensor(float("nan"))
    if ok:
        loss.backward()
        params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]  # model + method modules
        gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip or float("inf"))
        ok = bool(torch.isfinite(gnorm))  # gradients are all-reduced already: every process agrees
    if ok:
        opt.step()
        with torch.no_grad():  # as CLIP: the temperature stays below 100
            if hasattr(model, "logit_scale"): model.logit_scale.clamp_(0, math.log(100))
        state.bad_in_row = 0
    else:
        opt.zero_grad(set_to_none=True)
        state.bad_total += 1; state.bad_in_row += 1
    lr = opt.param_groups[0]["lr"]  # the rate this step used (logged), before the schedule moves on
    with warnings.catch_warnings():  # a skipped first step makes torch warn about the call order; the
        warnings.simplefilter("ignore", UserWarning)  # schedule is indexed by step, so nothing is lost
        sched.step()
    return dict(loss=loss_all, grad_norm=gnorm.detach(), ok=ok, lr=lr, **{k: v.detach() for k, v in terms.items()})


# %% [markdown]
# ## A run, assembled once
#
# `build_run(cfg, ctx)` turns a config into everything a step needs, in this order:
#
# 1. the **seeds**: every random stream of the run derived from `cfg.seed` by name (`powerclip.data.run_seeds`);
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
    fwd: torch.nn.Module             # MethodForward(model, method, modules), in DDP when distributed (compiled if asked)
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    total: int                       # optimiser steps of the schedule
    geometry: Geometry               # the model's image size, patch size, context length
    spec: BatchSpec                  # what the loader builds (data config, geometry, the method's needs, the run seed)
    seeds: dict                      # every random stream's seed, derived from cfg.seed by name

    def loader(self, epoch: int = 0, start_step: int = 0) -> Loader:
        "This process's batches of `epoch`, from `start_step` on."
        return make_loader(self.spec, epoch, start_step, rank=self.ctx.rank, world_size=self.ctx.world_size)

    def prepare(self, batch: dict) -> dict:
        "A host batch made ready for `fwd`: the method's derived inputs, on the device (float64 under precision fp64)."
        batch = to_device(self.method.prepare_batch(batch), self.ctx.device)
        if self.cfg.precision == "fp64":
            batch = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in batch.items()}
        return batch

    def step(self, batch: dict, state: TrainState) -> dict:
        "One training step on a prepared batch (see `train_step`)."
        return train_step(self.fwd, self.method, batch, self.ctx, self.opt, self.sched, state, self.cfg, self.model)

    def derived(self) -> dict:
        "What the run derived from its config (written into config.yaml as a record)."
        return dict(seeds=dict(self.seeds), geometry=asdict(self.geometry), needs=asdict(self.spec.needs))


def build_run(cfg: TrainConfig, ctx: pdist.DistContext, total: int | None = None) -> Run:
    "Model, method, forward, modules, optimiser and schedule of a run, assembled once (see above). `total`: schedule length (None: from cfg)."
    from powerclip.model import create_model, geometry_of, model_geometry
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data))  # never mutate the caller's config
    if cfg.global_batch_size is not None:
        if cfg.global_batch_size % ctx.world_size: raise ValueError(f"global_batch_size {cfg.global_batch_size} is not divisible by {ctx.world_size} processes")
        cfg.data.batch_size = cfg.global_batch_size // ctx.world_size
    if cfg.model.pretrained == "required":
        raise ValueError(f"this preset fine-tunes a pretrained {cfg.model.name}: give its weights with "
                         "model.pretrained=/path/to/open_clip_state_dict.pt (nothing is downloaded)")
    seeds = run_seeds(cfg.seed)
    method = get_method(cfg.method, cfg.method_cfg, seed=seeds["method"])
    geometry = model_geometry(cfg.model.name, cfg.model.kwargs)
    spec = BatchSpec(cfg.data, geometry, method.needs(), cfg.seed)
    seed_all(seeds["init"])  # the same initial weights on every process
    model, _, _ = create_model(cfg.model.name, cfg.model.pretrained, **cfg.model.kwargs)
    if geometry_of(model) != geometry: raise RuntimeError(f"model geometry {geometry_of(model)} is not its config's {geometry}")
    model.to(ctx.device)
    if cfg.precision == "fp64": model.double()
    if cfg.model.grad_checkpointing: model.set_grad_checkpointing(True)
    mf = method_forward(model, method)  # the model as the method changes it, and the method's own modules
    if cfg.precision == "fp64": mf.double()
    mf.train()
    fwd = pdist.wrap_ddp(mf, ctx, cfg.find_unused_parameters)
    if cfg.model.compile: fwd = torch.compile(fwd)
    opt = make_optimizer(model, cfg.optim, mf.modules_, method.modules_lr(cfg.optim.lr))
    total = _total_steps(cfg, steps_per_epoch(cfg.data, ctx.world_size)) if total is None else total
    sched = make_scheduler(opt, cfg.optim, total)
    seed_all(mix_seed(seeds["forward"], ctx.rank))  # per-process streams for whatever is random in the forward pass
    return Run(cfg, ctx, model, method, mf.modules_, fwd, opt, sched, total, geometry, spec, seeds)


def _total_steps(cfg: TrainConfig, spe: int | None) -> int:
    if cfg.max_steps is not None: return cfg.max_steps
    if spe is None: raise ValueError("the data has no known epoch length (shards without samples_per_epoch): set max_steps")
    return cfg.epochs * spe


# %% [markdown]
# The smoke preset's run: the geometry is the micro model's, the loader builds what PowerCLIP needs at that geometry
# (and a CLIP run of the same config neither trees nor masks), and a step trains.

# %%
_run = build_run(load_config("smoke", {"max_steps": 2}), pdist.init_distributed("cpu"))
test_eq((_run.geometry, _run.total), (Geometry(32, 8, 77), 2))
_b = next(iter(_run.loader()))
test_eq((_b["image"].shape[-1], _b["tokens"].shape[-1], tuple(_b["region_masks"].shape[1:])), (32, 77, (4, 16)))
test_eq(set(next(iter(build_run(load_config("smoke", method="clip"), pdist.init_distributed("cpu")).loader()))), {"image", "tokens", "index"})
_out = _run.step(_run.prepare(_b), TrainState())
assert _out["ok"] and set(_run.derived()) == {"seeds", "geometry", "needs"} and _run.derived()["needs"]["regions"] == 4


# %% [markdown]
# ## The loop

# %%
#| export
def _resume_path(cfg: TrainConfig) -> Path | None:
    if cfg.resume == "never": return None
    if cfg.resume == "auto":
        p = Path(cfg.out_dir) / "checkpoints" / "last.pt"
        return p if p.is_file() else None
    if not Path(cfg.resume).is_file(): raise FileNotFoundError(f"resume checkpoint {cfg.resume} not found")
    return Path(cfg.resume)


def _log(msg: str, ctx: pdist.DistContext):
    if ctx.is_main: print(f"[powerclip.train] {msg}", file=sys.stderr, flush=True)


def train(cfg: TrainConfig) -> dict:
    "Run (or resume) a training run; returns a summary dict (run_dir, steps, last metrics, bad steps, seconds)."
    ctx = pdist.init_distributed(cfg.device)
    try:
        return _train(cfg, ctx)
    finally:
        pdist.cleanup(ctx)


def _train(cfg: TrainConfig, ctx: pdist.DistContext) -> dict:
    run = build_run(cfg, ctx)
    cfg, model, method, modules, opt, sched, total = run.cfg, run.model, run.method, run.modules, run.opt, run.sched, run.total
    run_dir = Path(cfg.out_dir)
    if ctx.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False) + "# what the run derived from the "
                                             "config above (a record: change seed or model, not these)\n"
                                             + yaml.safe_dump(dict(derived=run.derived()), sort_keys=False))
    state = TrainState()
    if cfg.start_batch:  # a fine-tune continuing its base run's data order (a resumed run takes its checkpoint's place)
        spe = steps_per_epoch(cfg.data, ctx.world_size)
        state.epoch, state.step_in_epoch = divmod(cfg.start_batch, spe) if spe else (0, cfg.start_batch)

    ck_path = _resume_path(cfg)
    if ck_path is not None:
        ck = load_checkpoint(ck_path, map_location=ctx.device)
        model.load_state_dict(ck["model"]); opt.load_state_dict(ck["optimizer"]); sched.load_state_dict(ck["scheduler"])
        if modules is not None:
            if ck.get("method_modules") is None:
                raise ValueError(f"{ck_path} has no state for {cfg.method}'s own modules (a checkpoint of another method, or from "
                                 "before methods kept their modules beside the model): resume=never starts afresh")
            modules.load_state_dict(ck["method_modules"])
        state = TrainState(**ck["state"])
        rngs = ck["rng"]
        set_rng_state(rngs[ctx.rank] if len(rngs) == ctx.world_size else rngs[0])
        if len(rngs) != ctx.world_size: _log(f"checkpoint has {len(rngs)} processes, this run {ctx.world_size}: resume is not exact", ctx)
        _log(f"resumed from {ck_path} at step {state.step} (epoch {state.epoch}, batch {state.step_in_epoch})", ctx)
    logger = MetricLogger(run_dir, ctx.is_main, state.step if ck_path else None, cfg.tensorboard)

    def checkpoint():
        rngs = pdist.all_gather_object(rng_state())
        if ctx.is_main: save_checkpoint(run_dir / "checkpoints" / "last.pt", model, opt, sched, state, cfg, rngs, modules=modules)
        pdist.barrier()

    from tqdm.auto import tqdm
    bar = tqdm(total=total, initial=state.step, disable=not (ctx.is_main and cfg.progress), unit="step",
               dynamic_ncols=True, mininterval=1.0, file=sys.stderr)
    t_start = t_last = time.time(); n_since, last_row, skipped = 0, {}, {}
    seconds0, snapshots = state.seconds, set(cfg.snapshot_steps)
    mem = PeakMemory(ctx.device.type); mem.start()
    first_step = state.step
    global_batch = cfg.data.batch_size * ctx.world_size
    while state.step < min(total, cfg.stop_at or total):
        loader = run.loader(state.epoch, state.step_in_epoch)
        n_batches = 0
        for batch in loader:
            n_batches += 1
            method.on_step(state.step, total)
            out = run.step(run.prepare(batch), state)
            state.step += 1; state.step_in_epoch += 1; n_since += 1
            state.seconds = seconds0 + time.time() - t_start
            if not out["ok"]:
                _log(f"step {state.step}: non-finite loss or gradient, update skipped ({state.bad_in_row} in a row, {state.bad_total} in all)", ctx)
                if state.bad_in_row >= cfg.max_bad_in_row:
                    raise RuntimeError(f"{state.bad_in_row} non-finite steps in a row (max_bad_in_row={cfg.max_bad_in_row}): aborting at step {state.step}")
            bar.update(1)
            if state.step % cfg.log_every == 0 or state.step == total:
                now = time.time()
                terms = {k: float(pdist.all_mean(v.float())) for k, v in sorted(out.items()) if k not in ("loss", "ok", "lr")}
                skipped = {f"skipped_{k}": v for k, v in loader.skipped().items() if v} if hasattr(loader, "skipped") else {}
                last_row = dict(step=state.step, epoch=state.epoch, lr=out["lr"], loss=float(out["loss"]),
                                **terms, img_per_s=global_batch * n_since / max(now - t_last, 1e-9),
                                time=now - t_start, bad_total=state.bad_total, **skipped)
                logger.log(last_row)
                bar.set_postfix(loss=f"{last_row['loss']:.4f}", img_s=f"{last_row['img_per_s']:.0f}", refresh=False)
                t_last, n_since = now, 0
            if state.step in snapshots and ctx.is_main: save_snapshot(run_dir, state.step, state.seconds, model, modules)
            if state.step % cfg.ckpt_every == 0 and state.step < total: checkpoint()
            if state.step >= min(total, cfg.stop_at or total): break
        else:  # the epoch ran out
            if n_batches == 0 and state.step_in_epoch == 0:
                raise RuntimeError(f"epoch {state.epoch} yielded no batch: too little data for batch_size {cfg.data.batch_size}")
            state.epoch += 1; state.step_in_epoch = 0
    bar.close()
    checkpoint()
    if ctx.is_main: export_weights(run_dir, model, modules)
    logger.close()
    if ctx.is_main and logger.rows:
        plot_metrics(logger.rows, run_dir / "loss.png", title=f"{cfg.method} ({cfg.model.name})")
    return dict(run_dir=str(run_dir), steps=state.step, last=last_row, bad_total=state.bad_total,
                seconds=time.time() - t_start, world_size=ctx.world_size, checkpoint=str(run_dir / "checkpoints" / "last.pt"),
                weights=str(run_dir / "model.pt"),
                # the peak of the steps this call took (NaN when it took none: a finished run called again)
                peak_mib=mem.mib() if state.step > first_step else float("nan"))


# %% [markdown]
# ## Command line
#
# `python -m powerclip.train --preset demo [--method clip] [key=value ...]`, or the console script
# `powerclip-train`. Under `torchrun --nproc_per_node G` the same command trains data-parallel.

# %%
#| export
def parse_args(argv: list[str] | None = None) -> TrainConfig:
    import argparse
    ap = argparse.ArgumentParser(prog="powerclip-train", description="Train CLIP / PowerCLIP / ... with one trainer.")
    ap.add_argument("--preset", default="demo", help="preset name (powerclip/presets/*.yaml) or a YAML path")
    ap.add_argument("--method", default=None, help="method name (registered in powerclip.methods)")
    ap.add_argument("overrides", nargs="*", help="key=value, dotted keys: optim.lr=1e-3 method_cfg.masks=gold out_dir=runs/x")
    a = ap.parse_intermixed_args(argv)  # options and key=value pairs in any order
    return load_config(a.preset, a.overrides, a.method)


def main(cfg: TrainConfig | list[str] | None = None) -> dict:
    "Train from a TrainConfig, or from command-line arguments (None: sys.argv)."
    if not isinstance(cfg, TrainConfig): cfg = parse_args(cfg)
    summary = train(cfg)
    if int(os.environ.get("RANK", 0)) == 0:
        print(yaml.safe_dump({k: v for k, v in summary.items()}, sort_keys=False))
    return summary


# a notebook kernel also runs as __main__, but has no __file__: only `python -m powerclip.train` trains here
if __name__ == "__main__" and "__file__" in globals(): main()


# %% [markdown]
# ## A short run
#
# The `smoke` preset (the micro model on a small world, a few steps), then the same run stopped after half of
# its steps and resumed: the losses agree to the last digit. (`tests/test_train_resume.py` does the same across processes
# and with `kill -9`; `tests/test_ddp.py` checks two processes against one.)

# %%
def _micro(out_dir, **kw):  # the `smoke` preset: the micro model, 32-pixel scenes, batches of 8, 6 steps
    return load_config("smoke", dict(out_dir=str(out_dir), **kw))

_tmp = Path(tempfile.mkdtemp())
_s = train(_micro(_tmp / "straight"))
_a = read_metrics(_tmp / "straight" / "metrics.csv")
print(f"{_s['steps']} steps in {_s['seconds']:.1f}s; losses", [round(r["loss"], 4) for r in _a])
train(_micro(_tmp / "resumed", stop_at=3)); _r = train(_micro(_tmp / "resumed"))  # second call resumes at step 3
_b = read_metrics(_tmp / "resumed" / "metrics.csv")
test_eq([r["step"] for r in _b], list(range(1, 7)))
assert_close(torch.tensor([r["loss"] for r in _b]), torch.tensor([r["loss"] for r in _a]), rtol=0, atol=1e-6)

# %% [markdown]
# Whatever the method, the run leaves `model.pt`: the open_clip weights alone, which plain open_clip loads (the
# project's configs registered), so that evaluation treats every method alike. A preset that fine-tunes says
# `model.pretrained: required` and stops until it gets a local file.

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
assert all(torch.equal(v, torch.load(_tmp / "base" / "model.pt")[k]) for k, v in torch.load(_tmp / "base" / "snapshots" / "step6" / "model.pt").items())
_ft = train(_clip(_tmp / "ft0", max_steps=2, start_batch=3, **{"optim.lr": 0.0,
                  "model.pretrained": str(_tmp / "base" / "snapshots" / "step3" / "model.pt")}))
test_close(read_metrics(_tmp / "ft0" / "metrics.csv")[0]["loss"], read_metrics(_tmp / "base" / "metrics.csv")[3]["loss"], eps=1e-6)
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
