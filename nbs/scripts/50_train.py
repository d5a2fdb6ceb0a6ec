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

import contextlib, csv, dataclasses, json, math, os, random, re, sys, time, typing, warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import yaml

from powerclip import dist as pdist
from powerclip.data import (SKIP_REASONS, BatchNeeds, BatchSpec, DataConfig, Geometry, Loader, StreamPosition, add_counts, make_loader,
                            mix_seed, n_streams, run_seeds, shard_urls, steps_per_epoch, world_config)
from powerclip.cli import ArgumentParser, UsageError, run_main, usage_errors
from powerclip.measure import PeakMemory
from powerclip.methods import METHODS, Method, get_method, method_config

# %%
#| hide
import tempfile
from fastcore.test import test_close, test_eq, test_fail
from powerclip.data import write_shard
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
# - **batches** from `powerclip.data.make_loader(spec, epoch, start_step | position, rank, world_size)`, where the spec
#   holds the data config, the model's geometry, the method's needs and the run seed; batch $b$ of epoch $e$ is a pure
#   function of `(spec, e, b)` on the world, and of `(spec, e)` and the loader's position on shards;
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
    pool: str | None = None            # 'tok' (class token / EOT, CLIP) | 'avg' (mean of the patch / caption tokens,
                                       # the PowerCLIP authors' model) for both towers; None: the architecture's
                                       # (`30_model`, "Pooling": 'tok', 'avg' for ViT-B-16-avg)
    grad_checkpointing: bool = False   # recompute activations in backward (less memory, ~30% more time)
    compile: bool = False              # torch.compile the forward pass
    kwargs: dict = field(default_factory=dict)  # open_clip model_kwargs overriding the architecture's config
                                       # (whole entries, e.g. a text_cfg with a shorter context_length); the
                                       # geometry of the data follows it

    def __post_init__(self):
        if not self.name: raise ValueError("name: needs an open_clip architecture name (e.g. ViT-B-16, powerclip-tiny)")
        if self.pool not in (None, "tok", "avg"):
            raise ValueError(f"pool: must be tok, avg or null (the architecture's), got {self.pool!r}")


@dataclass
class OptimConfig:
    lr: float = 5e-4                   # peak learning rate
    betas: tuple = (0.9, 0.98)         # AdamW betas (open_clip / CLIP)
    eps: float = 1e-6                  # AdamW eps
    weight_decay: float = 0.2          # not applied to biases, norms, logit_scale and embeddings
    warmup_steps: int = 100            # linear warm-up from lr/warmup to lr, then cosine to min_lr
    min_lr: float = 0.0                # end of the cosine
    grad_clip: float | None = None     # clip the global gradient norm (None: no clipping, norm still checked)

    def __post_init__(self):
        for k in ("lr", "weight_decay", "min_lr", "warmup_steps"):
            if getattr(self, k) < 0: raise ValueError(f"{k}: must be at least 0, got {getattr(self, k)}")
        if self.eps <= 0: raise ValueError(f"eps: must be above 0, got {self.eps}")
        if self.grad_clip is not None and self.grad_clip <= 0: raise ValueError(f"grad_clip: must be above 0 or null (no clipping), got {self.grad_clip}")
        if len(self.betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas: must be two numbers in [0, 1), got {list(self.betas)}")


PRECISIONS = ("fp32", "bf16", "auto", "fp64")


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
    resume: str = "auto"               # 'auto' (out_dir/checkpoints/last.pt, else prev.pt, if present) | 'never' | a checkpoint path
    max_bad_in_row: int = 20           # abort after this many consecutive non-finite steps
    device: str | None = None          # 'cpu' | 'cuda' | 'cuda:N' | None (cuda when available)
    progress: bool = True              # tqdm progress bar on the main process
    tensorboard: bool = True           # also write TensorBoard events to out_dir/tb
    find_unused_parameters: bool = False  # DDP option, for methods that leave parameters unused
    snapshot_steps: tuple = ()         # after these steps also write snapshots/step{N}/ (model.pt, method_modules.pt,
                                       # config.yaml, snapshot.json with the training seconds so far): learning curves,
                                       # and the start of a fine-tune from the middle of a run
    start_batch: int = 0               # the first batch is this batch of the run seed's data order (a fine-tune that
                                       # continues its base run's data: the base run's step); the schedule starts at 0

    def __post_init__(self):
        # each message starts with the field's name (what the user typed: `precision=fp16`)
        if self.precision not in PRECISIONS: raise ValueError(f"precision: must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.resume not in ("auto", "never") and not str(self.resume).endswith(".pt"):
            raise ValueError(f"resume: must be auto, never or a .pt checkpoint path, got {self.resume!r}")
        for k in ("epochs", "log_every", "ckpt_every", "max_bad_in_row"):
            if getattr(self, k) < 1: raise ValueError(f"{k}: must be at least 1, got {getattr(self, k)}")
        for k in ("max_steps", "stop_at", "global_batch_size"):
            if getattr(self, k) is not None and getattr(self, k) < 1: raise ValueError(f"{k}: must be at least 1 or null, got {getattr(self, k)}")
        if self.seed < 0: raise ValueError(f"seed: must be at least 0, got {self.seed}")
        if self.device is not None and not (self.device in ("cpu", "cuda") or (self.device.startswith("cuda:") and self.device[5:].isdigit())):
            raise ValueError(f"device: must be cpu, cuda, cuda:N or null (cuda when available), got {self.device!r}")
        if not self.out_dir: raise ValueError("out_dir: needs a folder for the run's outputs")
        if not self.method: raise ValueError("method: needs a method name (e.g. powerclip, clip)")
        if self.start_batch < 0: raise ValueError(f"start_batch: must be at least 0, got {self.start_batch}")
        if self.start_batch and getattr(self.data, "source", None) == "wds":   # shards position by a checkpoint's StreamPosition
            raise ValueError("start_batch: continues a run's data order on the built-in world only; on shards, resume the base run's checkpoint")
        if any(int(n) != n or n < 1 for n in self.snapshot_steps):
            raise ValueError(f"snapshot_steps: must be integers of at least 1, got {list(self.snapshot_steps)}")


# %% [markdown]
# Configs travel as plain nested dicts (YAML). `from_dict` builds the dataclasses back, checking every key and the type
# of every scalar, so a typo in a preset or an override is an error, never a silently ignored option, and the error
# names the dotted key the user typed: `optim.lr: must be a number, got 'abc'`. A dataclass's own checks
# (`__post_init__`) start their messages with the field's name, and `from_dict` puts the section in front.

# %%
#| export
def from_dict(cls, d: dict, path: str = ""):
    """A (nested) config dataclass from a plain dict. An unknown key, a scalar of the wrong type (float, int, bool, str,
    None: YAML's own) or a value the dataclass refuses is a ValueError naming the dotted key; lists become tuples where
    typed so. `path`: the dotted name of `d` in the whole config ('' for the top)."""
    where = f"{path}." if path else ""
    if not isinstance(d, dict): raise ValueError(f"{path or cls.__name__}: must be a section of key: value entries, got {d!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for k in d:
        if k not in names: raise ValueError(f"{where}{k}: unknown key (known: {', '.join(sorted(names))})")
    kw = {k: _typed(hints[k], v, where + k) for k, v in d.items()}
    try: return cls(**kw)
    except (ValueError, TypeError) as e: raise ValueError(_name_key(cls, str(e), path, kw)) from None


def _name_key(cls, msg: str, path: str, kw: dict) -> str:
    """A dataclass check's message with the dotted key in front: the field its message starts with, else the one given
    value the dataclass refuses on its own (the others at their defaults), else the section."""
    where = f"{path}." if path else ""
    if msg.split(":", 1)[0].strip() in kw: return where + msg
    def refused(k):
        try: cls(**{k: kw[k]}); return False
        except (ValueError, TypeError): return True
    alone = [k for k in kw if refused(k)]
    if len(alone) == 1: return f"{where}{alone[0]}: {msg}"
    return f"{path}: {msg}" if path else msg


_TYPE_WORDS = {float: "a number", int: "an integer", bool: "true or false", str: "text", tuple: "a list", list: "a list",
               dict: "a section of key: value entries"}


def _typed(t, v, key: str):
    "`v` as the annotation `t` wants it, or a ValueError naming `key` (see `from_dict`)."
    if dataclasses.is_dataclass(t): return from_dict(t, v, key)
    opts = _types(t)
    if v is None:
        if type(None) in opts or t is typing.Any: return None
        raise ValueError(f"{key}: may not be null (give {' or '.join(_TYPE_WORDS.get(o, str(o)) for o in opts)})")
    for o in opts:
        o = typing.get_origin(o) or o
        if o is bool and isinstance(v, bool): return v
        if o is int and not isinstance(v, bool):
            if isinstance(v, int): return v
            n = _number(v)
            if n is not None and n.is_integer(): return int(n)
        if o is float and _number(v) is not None: return _number(v)
        if o is str and isinstance(v, str): return v
        if o is str and isinstance(v, (int, float)) and not isinstance(v, bool): return str(v)   # out_dir=2024
        if o in (tuple, list) and isinstance(v, (list, tuple)): return o(v)
        if o is dict and isinstance(v, dict): return v
        if o not in _TYPE_WORDS and o is not type(None): return v                                 # not checked here
    want = " or ".join(_TYPE_WORDS.get(typing.get_origin(o) or o, str(o)) for o in opts if o is not type(None))
    raise ValueError(f"{key}: must be {want}{' or null' if type(None) in opts else ''}, got {v!r}")


def _number(v) -> float | None:
    "A number as float (YAML 1.1 reads '1e-3' as a string), or None."
    if isinstance(v, bool): return None
    if isinstance(v, (int, float)): return float(v)
    if isinstance(v, str):
        try: return float(v)
        except ValueError: return None
    return None


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
test_fail(lambda: from_dict(TrainConfig, {"optim": {"learning_rate": 1.0}}), contains="optim.learning_rate: unknown key")
# every message names the dotted key
for d, msg in [({"optim": {"lr": "abc"}}, "optim.lr: must be a number, got 'abc'"),
               ({"data": {"batch_size": 0}}, "data.batch_size: must be at least 1, got 0"),
               ({"data": {"workers": 1.5}}, "data.workers: must be an integer, got 1.5"),
               ({"max_steps": -1}, "max_steps: must be at least 1 or null, got -1"),
               ({"progress": "maybe"}, "progress: must be true or false, got 'maybe'"),
               ({"precision": "fp16"}, "precision: must be one of fp32, bf16, auto, fp64, got 'fp16'"),
               ({"optim": 3}, "optim: must be a section"), ({"model": {"kwargs": [1]}}, "model.kwargs: must be a section")]:
    test_fail(lambda: from_dict(TrainConfig, d), contains=msg)
test_eq(from_dict(TrainConfig, {"max_steps": "1e3", "optim": {"weight_decay": 0}}).max_steps, 1000)  # YAML 1.1 strings
assert isinstance(from_dict(TrainConfig, {"optim": {"weight_decay": 0}}).optim.weight_decay, float)

# %% [markdown]
# ### Presets and overrides
#
# Presets are small YAML files in `powerclip/presets/`. A preset may hold a `method_cfgs` table with the
# options of several methods; the run picks the entry of its `method`, so `--method clip` on the PowerCLIP
# preset is a fair CLIP baseline with everything else equal. Overrides are `key=value` with dotted keys,
# values read as YAML (`optim.lr=1e-3`, `method_cfg.masks=gold`, `method_cfg.lam=0.2`, `max_steps=null`). A run's
# own `config.yaml` is a preset too; its `derived` section (what the run computed from the seed and the model) is a
# record and is not read back. The method's options go through the same checks, against the method's config
# dataclass: `method_cfg.tau=-1` is refused by that dataclass, with the key named.
#
# The presets: `smoke` (the micro model, seconds: the tests), `demo` (the tiny model on the world, 2 CPU cores),
# `paper` (Sec. 5.1: ViT-B/16 at 224 px on CC12M shards, global batch 4096, AdamW at $10^{-3}$, weight decay 0.2,
# 32 epochs, 10,000 warm-up steps, $M = 10$, $\tau = 10^{-3}$, $\alpha = 0.75$, $\lambda = 0.1$), and one per baseline
# whose paper gives its own recipe (`clip-pgs`, `aclip`, `eclip`, `c2lip`, `smartclip`). Each preset's comments say
# where its values come from.

# %%
#| export
PRESET_DIR = Path(__import__("powerclip").__file__).parent / "presets"  # shipped as package data


def preset_path(name: str) -> Path:
    "A preset name ('demo', 'paper') or a path to a YAML file."
    p = Path(name)
    known = ", ".join(sorted(q.stem for q in PRESET_DIR.glob("*.yaml")))
    if p.suffix in (".yaml", ".yml"):
        if p.is_file(): return p
        raise FileNotFoundError(f"--preset: no file {name!r} (a preset name: {known}; or a path to a .yaml file)")
    p = PRESET_DIR / f"{name}.yaml"
    if not p.is_file(): raise FileNotFoundError(f"--preset: no preset {name!r} (known: {known}; or a path to a .yaml file)")
    return p


def set_dotted(d: dict, key: str, value) -> None:
    "d['a']['b'] = value for key 'a.b' (creating the inner dicts)."
    *head, last = key.split(".")
    if not all(head + [last]): raise ValueError(f"{key}: not a dotted key (e.g. optim.lr)")
    for i, k in enumerate(head):
        d = d.setdefault(k, {})
        if not isinstance(d, dict): raise ValueError(f"{key}: {'.'.join(head[:i + 1])} is not a section of the config")
    d[last] = value


def parse_override(s: str) -> tuple[str, object]:
    "'key=value' -> (key, value read as YAML; a value YAML cannot read stays the text given)."
    if "=" not in s or not s.split("=", 1)[0].strip():
        raise ValueError(f"override {s!r}: not key=value (e.g. optim.lr=1e-3 data.batch_size=32)")
    k, v = s.split("=", 1)
    try: v = yaml.safe_load(v)
    except yaml.YAMLError: pass
    return k.strip(), v


def method_options(method: str, cfg: dict) -> dict:
    """The options of `method` checked against its config dataclass (unknown keys, types, the dataclass's own checks:
    a ValueError naming `method_cfg.KEY`), with values as the dataclass typed them."""
    try: cls = type(method_config(method))
    except KeyError: raise ValueError(f"method: unknown method {method!r} (registered: {', '.join(sorted(METHODS))})") from None
    opts = from_dict(cls, dict(cfg or {}), "method_cfg")
    return {k: getattr(opts, k) for k in (cfg or {})}


def load_config(preset: str | None = "demo", overrides: list[str] | dict | None = (), method: str | None = None) -> TrainConfig:
    "TrainConfig from a preset, a method name and `key=value` overrides (applied in that order)."
    d = {}
    if preset:
        path = preset_path(preset)
        try: d = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e: raise ValueError(f"--preset: {path} is not valid YAML ({str(e).splitlines()[0]})") from None
        if not isinstance(d, dict): raise ValueError(f"--preset: {path} must hold key: value entries, got {type(d).__name__}")
    d.pop("derived", None)  # a run's record of what it derived (seeds, geometry, needs): recomputed, never read
    method_cfgs = d.pop("method_cfgs", {}) or {}
    if method: d["method"] = method
    m = d.get("method", TrainConfig.method)
    d["method_cfg"] = {**(method_cfgs.get(m) or {}), **(d.get("method_cfg") or {})}
    items = overrides.items() if isinstance(overrides, dict) else map(parse_override, overrides or ())
    for k, v in items: set_dotted(d, k, v)
    cfg = from_dict(TrainConfig, d)
    cfg.method_cfg = method_options(cfg.method, cfg.method_cfg)  # an unknown method or option fails here, not after the model is built
    return cfg


# %%
_c = load_config("demo", ["optim.lr=2e-3", "method_cfg.masks=gold", "method_cfg.lam=0.3"])
test_eq((_c.optim.lr, _c.method_cfg["masks"], _c.method, _c.method_cfg["lam"]), (2e-3, "gold", "powerclip", 0.3))
test_eq(load_config("demo", method="clip").method_cfg, {})
test_fail(lambda: load_config("nope"), contains="known")
for ov, msg in [(["method_cfg.lamda=1"], "method_cfg.lamda: unknown key"), (["method_cfg.tau=-1"], "method_cfg.tau: need tau > 0"),
                (["method_cfg.M=0"], "method_cfg.M: M must be >= 1"), (["method_cfg.tau=abc"], "method_cfg.tau: must be a number"),
                (["lr"], "override 'lr': not key=value"), (["optim.lr.x=1"], "optim.lr.x: optim.lr is not a section")]:
    test_fail(lambda: load_config("demo", ov), contains=msg)
test_fail(lambda: load_config("demo", method="nope"), contains="method: unknown method 'nope' (registered: ")
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
    without weight decay. `modules` may carry its own `weight_decay` attribute (SmartCLIP's mask network: 0; None or
    absent: the run's). The schedule scales every group's peak rate by the same factor."""
    groups = []
    for mod, lr in ((model, cfg.lr), (modules, cfg.lr if modules_lr is None else modules_lr)):
        if mod is None: continue
        wd = getattr(mod, "weight_decay", None) if mod is modules else None
        decay, rest = [], []
        for n, p in mod.named_parameters():
            if p.requires_grad: (rest if no_decay(n, p) else decay).append(p)
        groups += [dict(params=decay, weight_decay=cfg.weight_decay if wd is None else wd, lr=lr),
                   dict(params=rest, weight_decay=0.0, lr=lr)]
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
# generator (Python, NumPy, torch, CUDA; one set per process), the step and epoch, and each process's data position
# (`powerclip.data.StreamPosition`: on the world its step in the epoch, from which `make_loader` regenerates exactly the
# batches not yet seen; on shards also where every worker's stream stands, see `23_data`), and the skip counts of the
# epochs already done.
#
# **Written so that it can always be read.** A checkpoint is written to a temporary file, flushed to the disk
# (`fsync`), and renamed over `last.pt`; the `last.pt` it replaces becomes `prev.pt`. A kill during the write leaves
# both intact. A `last.pt` that cannot be read all the same (a full disk, a file copied over it, a zero-byte file)
# is reported in one line, set aside as `last.pt.damaged`, and the run resumes from `prev.pt`; if neither can be read,
# the run stops with one line saying so and how to start afresh (`resume=never`). Both are read *before* the model is
# built. Resume with the same number of processes and the same `data.workers`: the data streams are split by both.

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
    random.setstate(s["python"]); np.random.set_state(s["numpy"]); torch.set_rng_state(s["torch"])
    if s.get("cuda") is not None and torch.cuda.is_available(): torch.cuda.set_rng_state_all(s["cuda"])


def seed_all(seed: int) -> None:
    random.seed(seed); np.random.seed(seed % 2**32); torch.manual_seed(seed)


def previous_checkpoint(path) -> Path:
    "Where the checkpoint that `path` replaced is kept: `prev.pt` beside `last.pt` (`NAME.prev.pt` beside another name)."
    path = Path(path)
    return path.with_name("prev.pt" if path.name == "last.pt" else f"{path.stem}.prev{path.suffix}")


def _fsync_dir(d: Path) -> None:
    "Make a rename in folder `d` durable (where the file system lets a folder be opened)."
    try: fd = os.open(d, os.O_RDONLY)
    except OSError: return
    try: os.fsync(fd)
    except OSError: pass
    finally: os.close(fd)


def _atomic_save(obj, path: Path, keep_previous: bool = False) -> Path:
    """torch.save to a temporary name, fsync, then rename: a kill or a crash mid-write leaves the previous file intact.
    `keep_previous`: the file replaced is kept as `previous_checkpoint(path)`."""
    path = Path(path); path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush(); os.fsync(f.fileno())   # on the disk before the rename makes it the checkpoint
    if keep_previous and path.exists(): os.replace(path, previous_checkpoint(path))
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    return path


def save_checkpoint(path, model, opt, sched, state: TrainState, cfg: TrainConfig, rngs: list[dict], scaler=None,
                    modules: torch.nn.Module | None = None, loader: list[dict] | None = None) -> Path:
    """Atomic, fsynced write of everything needed to resume (`rngs`: one RNG state per process; `loader`: one data
    position per process, `StreamPosition.to_dict()`); the checkpoint it replaces becomes `prev.pt`. The open_clip
    weights (`model`) and a method's training-time modules (`method_modules`) are separate entries."""
    ckpt = dict(model=model.state_dict(), method_modules=None if modules is None else modules.state_dict(),
                optimizer=opt.state_dict(), scheduler=sched.state_dict(),
                scaler=None if scaler is None else scaler.state_dict(), state=asdict(state), rng=rngs, loader=loader,
                config=to_dict(cfg), torch_version=torch.__version__)
    return _atomic_save(ckpt, path, keep_previous=True)


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


CHECKPOINT_KEYS = ("model", "optimizer", "scheduler", "state", "rng")


def read_resume(cfg: TrainConfig, warn=print, set_aside: bool = True) -> tuple[Path | None, dict | None]:
    """The checkpoint a run resumes from, read (on the CPU): `last.pt` (or the `resume` path), else, with a warning, the
    checkpoint it replaced; (None, None) to start afresh. Neither readable: a `UsageError` saying how to start afresh.
    `set_aside` (the main process): an unreadable `last.pt` becomes `last.pt.damaged`, so that the next checkpoint
    does not push it over the good `prev.pt`."""
    if cfg.resume == "never": return None, None
    last = Path(cfg.out_dir) / "checkpoints" / "last.pt" if cfg.resume == "auto" else Path(cfg.resume)
    prev = previous_checkpoint(last)
    if not last.is_file() and not prev.is_file():
        if cfg.resume == "auto": return None, None
        raise UsageError(f"resume: no checkpoint {cfg.resume!r} (auto, never, or an existing .pt file)")
    problems = []
    for p in (last, prev):
        if not p.is_file(): problems.append(f"{p} is missing"); continue
        try:
            ck = load_checkpoint(p)
            if not isinstance(ck, dict) or not set(CHECKPOINT_KEYS) <= set(ck): raise ValueError("not a trainer checkpoint")
        except Exception as e:   # a torn or foreign file: say what, then try the older one
            problems.append(f"{p} cannot be read ({type(e).__name__}: {str(e).strip().split('. ')[0][:120]})"); continue
        if problems:
            kept = ""
            if set_aside and last.is_file():
                os.replace(last, last.with_name(last.name + ".damaged")); kept = f" ({last.name} kept as {last.name}.damaged)"
            warn(f"{problems[0]}: resuming from the previous checkpoint {p} (step {ck['state']['step']}){kept}")
        return p, ck
    raise UsageError(f"resume: {'; '.join(problems)}; no checkpoint to resume from. Start afresh with resume=never "
                     f"(or move {last.parent} away)")


# %%
with tempfile.TemporaryDirectory() as d:
    seed_all(3); _s0 = rng_state(); _a = (random.random(), np.random.rand(), torch.rand(1))
    set_rng_state(_s0); assert (random.random(), np.random.rand(), torch.rand(1)) == _a
    _sch = make_scheduler(_opt, OptimConfig(warmup_steps=2), 10); _opt.step(); _sch.step()
    p = save_checkpoint(Path(d) / "checkpoints" / "last.pt", _m, _opt, _sch, TrainState(step=1), TrainConfig(), [_s0])
    ck = load_checkpoint(p)
    test_eq(ck["state"]["step"], 1); test_eq(ck["scheduler"]["last_epoch"], 1)
    assert_close(ck["model"]["logit_scale"], _m.logit_scale.detach())
    assert not list(Path(d, "checkpoints").glob("*.tmp"))
    # the second save keeps the first as prev.pt; a damaged last.pt falls back to it, with one line
    save_checkpoint(p, _m, _opt, _sch, TrainState(step=2), TrainConfig(), [_s0])
    test_eq(load_checkpoint(Path(d) / "checkpoints" / "prev.pt")["state"]["step"], 1)
    _cfg = TrainConfig(out_dir=d); _said = []
    test_eq(read_resume(_cfg, _said.append)[1]["state"]["step"], 2); test_eq(_said, [])
    p.write_bytes(p.read_bytes()[:1000])                      # a torn last.pt
    _path, _ck = read_resume(_cfg, _said.append)
    test_eq((_path.name, _ck["state"]["step"]), ("prev.pt", 1))
    assert len(_said) == 1 and "last.pt cannot be read" in _said[0] and "step 1" in _said[0], _said
    assert not p.exists() and p.with_name("last.pt.damaged").is_file()   # set aside: the next save keeps prev.pt
    p.write_bytes(b"")                                                   # a zero-byte last.pt and prev.pt:
    (Path(d) / "checkpoints" / "prev.pt").write_bytes(b"")              # nothing to resume from
    test_fail(lambda: read_resume(_cfg), contains="resume=never")
    test_eq(read_resume(TrainConfig(out_dir=d, resume="never")), (None, None))


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
# ## Checking a run before it is built
#
# A mistake in a config should cost a second, not the minutes of building a model and reading data before it
# shows. `validate(cfg, world_size)` checks everything that can be known without the model, and raises a
# `ValueError` whose message starts with the key to change: the method and its options; the model's name and
# geometry (from its config file, `powerclip.model.model_geometry`) and a pretrained file; the batch against the
# data (the world's `world_length`, or for shards every shard path, which must exist unless it is a url, and an epoch
# length); the global batch against the processes; the output folder (not a file) and the checkpoint to resume from;
# a GPU when `device` asks for one. `build_run` calls it first, and the command line inside `usage_errors()`, where
# its message becomes the one line of a usage error (`17_cli`).

# %%
#| export
def _is_url(u: str) -> bool: return "://" in u or u.startswith("pipe:")


def validate(cfg: TrainConfig, world_size: int | None = None) -> Geometry:
    """Check a run before its model is built (see above); a ValueError naming the key, else the model's geometry.
    `world_size`: processes (None: torchrun's WORLD_SIZE, else 1). The checks that need no import come first."""
    G = world_size or int(os.environ.get("WORLD_SIZE", 1))
    method = get_method(cfg.method, method_options(cfg.method, cfg.method_cfg))
    B = cfg.data.batch_size
    if cfg.global_batch_size is not None:
        if cfg.global_batch_size % G: raise ValueError(f"global_batch_size: {cfg.global_batch_size} is not divisible by the {G} processes (give a multiple of {G})")
        B = cfg.global_batch_size // G
    pre = cfg.model.pretrained
    if pre == "required":
        raise ValueError(f"model.pretrained: this preset fine-tunes a pretrained {cfg.model.name}: give its weights with "
                         "model.pretrained=/path/to/open_clip_state_dict.pt (nothing is downloaded)")
    if pre is not None and not Path(pre).is_file(): raise ValueError(f"model.pretrained: no file {pre!r} (a local open_clip state dict; nothing is downloaded)")
    data = dataclasses.replace(cfg.data, batch_size=B)
    if data.source == "world" and B * G > data.world_length:
        raise ValueError(f"data.batch_size: {B} per process x {G} process(es) is more than data.world_length={data.world_length}: "
                         "an epoch would have no step (a smaller batch or a longer world)")
    if data.source == "wds":
        urls = shard_urls(data.shards)
        missing = [u for u in urls if not _is_url(u) and not Path(u).is_file()]
        if not urls or missing:
            raise ValueError(f"data.shards: {len(missing)} of {len(urls)} shard file(s) do not exist, e.g. {(missing or [data.shards])[0]!r} "
                             "(give files, brace patterns such as cc12m/{00000..01242}.tar, or urls)")
        if data.samples_per_epoch is not None and data.samples_per_epoch < B:
            raise ValueError(f"data.samples_per_epoch: {data.samples_per_epoch} is less than one batch of {B}")
        if cfg.max_steps is None and data.samples_per_epoch is None:
            raise ValueError("max_steps: shards without data.samples_per_epoch have no known epoch length: set max_steps (or data.samples_per_epoch)")
    out = Path(cfg.out_dir)
    if out.exists() and not out.is_dir(): raise ValueError(f"out_dir: {cfg.out_dir!r} is a file (give a folder; it is created if missing)")
    if any(a.exists() and not a.is_dir() for a in out.parents): raise ValueError(f"out_dir: {cfg.out_dir!r} is inside a file (give a folder)")
    if cfg.resume not in ("auto", "never") and not Path(cfg.resume).is_file() and not previous_checkpoint(cfg.resume).is_file():
        raise ValueError(f"resume: no checkpoint {cfg.resume!r} (auto, never, or an existing .pt file)")
    if cfg.device is not None and cfg.device.startswith("cuda"):
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0: raise ValueError(f"device: {cfg.device!r} asks for a GPU and none is available (device=cpu, or null: a GPU when there is one)")
        if ":" in cfg.device and int(cfg.device[5:]) >= n: raise ValueError(f"device: {cfg.device!r}, but there are {n} GPU(s) (cuda:0 .. cuda:{n - 1})")
    from powerclip.model import arch_pool, model_geometry   # imports open_clip: seconds
    try:
        geometry = model_geometry(cfg.model.name, cfg.model.kwargs)
        pool = cfg.model.pool or arch_pool(cfg.model.name, cfg.model.kwargs)
    except (ValueError, TypeError, NotImplementedError) as e: raise ValueError(f"model: {e}") from None
    if pool not in method.pools:
        raise ValueError(f"model.pool: method {cfg.method!r} pools by {' or '.join(method.pools)}, not {pool!r} (see its notebook)")
    try: BatchSpec(data, geometry, method.needs(), cfg.seed)
    except ValueError as e: raise ValueError(f"method_cfg: {e}") from None      # e.g. stored masks on the world
    if data.source == "world":
        try: world_config(data, geometry)
        except (TypeError, ValueError) as e: raise ValueError(f"data.world: {e}") from None
    return geometry


# %%
with tempfile.TemporaryDirectory() as d:
    _file = Path(d) / "a_file"; _file.write_text("")
    test_eq(validate(load_config("smoke")), Geometry(32, 8, 77))
    for ov, msg in [({"data.batch_size": 65}, "data.batch_size: 65 per process x 1 process(es) is more than data.world_length=64"),
                    ({"out_dir": str(_file)}, "out_dir: "), ({"out_dir": str(_file / "x")}, "is inside a file"),
                    ({"resume": f"{d}/none.pt"}, "resume: no checkpoint"), ({"global_batch_size": 9}, None),
                    ({"model.name": "ViT-X"}, "model: unknown model 'ViT-X'"), ({"method_cfg.masks": "stored"}, "method_cfg: region masks 'stored'"),
                    ({"data.source": "wds", "data.shards": f"{d}/{{0..3}}.tar"}, "data.shards: 4 of 4 shard file(s) do not exist"),
                    ({"data.world": {"max_objectz": 2}}, "data.world: "), ({"model.pretrained": "required"}, "model.pretrained=/path"),
                    ({"model.pool": "mean"}, "model.pool: must be tok, avg or null")]:
        if msg: test_fail(lambda: validate(load_config("smoke", ov)), contains=msg)
    test_fail(lambda: validate(load_config("smoke", {"global_batch_size": 9}), world_size=2), contains="global_batch_size: 9 is not divisible by the 2")
    # a method that works with one pooling refuses the other (A-CLIP's EMA towers pool by the class token)
    test_fail(lambda: validate(load_config("smoke", {"model.pool": "avg"}, "aclip")), contains="model.pool: method 'aclip' pools by tok")
    if not torch.cuda.is_available(): test_fail(lambda: validate(load_config("smoke", {"device": "cuda"})), contains="device: 'cuda' asks for a GPU")
    for n in range(4): write_shard(Path(d) / f"{n}.tar", [])
    test_fail(lambda: validate(load_config("smoke", {"data.source": "wds", "data.shards": f"{d}/{{0..3}}.tar", "max_steps": None})),
              contains="max_steps: shards")


# %% [markdown]
# ## A run, assembled once
#
# `build_run(cfg, ctx)` checks the config (`validate`), then turns it into everything a step needs, in this order:
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

    def loader(self, epoch: int = 0, start_step: int = 0, position: StreamPosition | dict | None = None) -> Loader:
        "This process's batches of `epoch`, from `start_step` on, or from `position` (a checkpoint's; shards need it)."
        return make_loader(self.spec, epoch, start_step, rank=self.ctx.rank, world_size=self.ctx.world_size, position=position)

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
    validate(cfg, ctx.world_size)  # everything that can be checked before the model is built
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data))  # never mutate the caller's config
    if cfg.global_batch_size is not None: cfg.data.batch_size = cfg.global_batch_size // ctx.world_size
    seeds = run_seeds(cfg.seed)
    method = get_method(cfg.method, cfg.method_cfg, seed=seeds["method"])
    geometry = model_geometry(cfg.model.name, cfg.model.kwargs)
    spec = BatchSpec(cfg.data, geometry, method.needs(), cfg.seed)
    seed_all(seeds["init"])  # the same initial weights on every process
    model, _, _ = create_model(cfg.model.name, cfg.model.pretrained, cfg.model.pool, **cfg.model.kwargs)
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
#
# Steps until `max_steps` (or the epochs' steps), an epoch's loader at a time; a metrics row every `log_every` steps and
# a checkpoint every `ckpt_every`. On shards a row also counts the samples skipped, summed over the processes, in
# this epoch (`skipped`, `skipped_<reason>`) and since the run began (`skipped_cum`, `skipped_cum_<reason>`): the
# loader counts the skips among the samples it consumed (`23_data`), and the checkpoint keeps the epoch's count in
# its data position and the finished epochs' in the `TrainState`, so a resumed run logs the same numbers.

# %%
#| export
def _resume_position(cfg: TrainConfig, ctx: pdist.DistContext, ck: dict | None, path: Path | None) -> dict | None:
    "This process's data position in the checkpoint `ck` (None: from the step alone); one line if shards cannot resume from it."
    if ck is None: return None
    positions, step = ck.get("loader"), ck["state"]["step_in_epoch"]
    ok = positions is not None and len(positions) == ctx.world_size and positions[ctx.rank] is not None
    if cfg.data.source != "wds" or (step == 0 and not ok): return positions[ctx.rank] if ok else None
    if positions is None:
        raise UsageError(f"resume: {path} holds no data position (written before shard runs resumed exactly): resume=never starts afresh")
    if len(positions) != ctx.world_size:
        raise UsageError(f"resume: {path} was written by {len(positions)} process(es), this run has {ctx.world_size}: shards are split by "
                         f"process, so resume with {len(positions)}")
    if positions[ctx.rank]["workers"] != n_streams(cfg.data):
        w = positions[ctx.rank]["workers"]
        raise UsageError(f"data.workers: {path} was written with {w} worker stream(s); shards are split by worker, so resume with "
                         f"data.workers={w}" + (" (or 0)" if w == 1 else ""))
    return positions[ctx.rank]


def _skip_columns(epoch: dict, before: dict, ctx: pdist.DistContext) -> dict:
    "The metrics row's skip columns: this epoch's and the run's counts, each summed over the processes."
    n = pdist.all_sum(torch.tensor([epoch.get(k, 0) for k in SKIP_REASONS], device=ctx.device)).tolist()
    ep = dict(zip(SKIP_REASONS, n)); cum = add_counts(before, ep)
    return dict(skipped=sum(ep.values()), skipped_cum=sum(cum[k] for k in SKIP_REASONS),
                **{f"skipped_{k}": ep[k] for k in SKIP_REASONS}, **{f"skipped_cum_{k}": cum[k] for k in SKIP_REASONS})


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
    ck_path, ck = read_resume(cfg, lambda m: _log(m, ctx), ctx.is_main)   # before the model: a damaged checkpoint is one line
    position = _resume_position(cfg, ctx, ck, ck_path)
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

    if ck is not None:
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

    saved_at = state.step if ck is not None else None   # the step of the newest checkpoint on disk

    def checkpoint(position):
        nonlocal saved_at
        if saved_at == state.step: return   # stopped right after a checkpoint: writing it again would make prev.pt the same
        saved_at = state.step
        rngs = pdist.all_gather_object(rng_state())
        positions = pdist.all_gather_object(position.to_dict() if isinstance(position, StreamPosition) else position)
        if ctx.is_main: save_checkpoint(run_dir / "checkpoints" / "last.pt", model, opt, sched, state, cfg, rngs, modules=modules,
                                        loader=positions)
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
        loader = run.loader(state.epoch, state.step_in_epoch, position)
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
                skipped = _skip_columns(loader.skipped(), state.skipped, ctx) if cfg.data.source == "wds" else {}
                last_row = dict(step=state.step, epoch=state.epoch, lr=out["lr"], loss=float(out["loss"]),
                                **terms, img_per_s=global_batch * n_since / max(now - t_last, 1e-9),
                                time=now - t_start, bad_total=state.bad_total, **skipped)
                logger.log(last_row)
                bar.set_postfix(loss=f"{last_row['loss']:.4f}", img_s=f"{last_row['img_per_s']:.0f}", refresh=False)
                t_last, n_since = now, 0
            if state.step in snapshots and ctx.is_main: save_snapshot(run_dir, state.step, state.seconds, model, modules)
            if state.step % cfg.ckpt_every == 0 and state.step < total: checkpoint(loader.state())
            if state.step >= min(total, cfg.stop_at or total): break
        else:  # the epoch ran out
            if n_batches == 0 and state.step_in_epoch == 0:
                raise RuntimeError(f"epoch {state.epoch} yielded no batch: too little data for batch_size {cfg.data.batch_size}")
            if cfg.data.source == "wds":   # the finished epoch's skips, over all processes, join the run's count
                state.skipped = add_counts(state.skipped, dict(zip(SKIP_REASONS, pdist.all_sum(
                    torch.tensor([loader.skipped()[k] for k in SKIP_REASONS], device=ctx.device)).tolist())))
            state.epoch += 1; state.step_in_epoch = 0; loader = None
        position = None if loader is None else loader.state()
    bar.close()
    checkpoint(position)
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
# `powerclip-train`. Under `torchrun --nproc_per_node G` the same command trains data-parallel. As every command of the
# project (`17_cli`), it reads and checks the arguments, the config and its paths (`load_config`, `validate`) before it
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
# A run writes to its `out_dir`: `config.yaml` (with what was derived from it), `checkpoints/last.pt` and `prev.pt`,
# `metrics.csv`, TensorBoard logs, a plot of the curves and, at the end, `model.pt` (below).

# %%
#| export
def parse_args(argv: list[str] | None = None) -> TrainConfig:
    "Command line -> TrainConfig (a UsageError or a ValueError naming the argument for what cannot work)."
    ap = ArgumentParser(prog="powerclip-train", description="Train CLIP / PowerCLIP / ... with one trainer.")
    ap.add_argument("--preset", default="demo", help="preset name (powerclip/presets/*.yaml) or a YAML path")
    ap.add_argument("--method", default=None, help="method name (registered in powerclip.methods)")
    ap.add_argument("--debug", action="store_true", help="show the traceback of a usage error")
    ap.add_argument("overrides", nargs="*", help="key=value, dotted keys: optim.lr=1e-3 method_cfg.masks=gold out_dir=runs/x")
    a = ap.parse_intermixed_args(argv)  # options and key=value pairs in any order
    return load_config(a.preset, a.overrides, a.method)


def _main(argv: list[str]) -> int:
    with usage_errors():     # the user's mistakes, found before the model is built: one line (powerclip.cli)
        cfg = parse_args(argv)
        validate(cfg)
    summary = train(cfg)
    if int(os.environ.get("RANK", 0)) == 0: print(yaml.safe_dump(summary, sort_keys=False))
    return 0


def main(argv: list[str] | None = None) -> int:
    "The command line (None: sys.argv): exit status 0, or 2 with one line on stderr for a mistake in the arguments."
    return run_main(_main, argv, "powerclip-train")


# a notebook kernel also runs as __main__, but has no __file__: only `python -m powerclip.train` trains here
if __name__ == "__main__" and "__file__" in globals(): sys.exit(main())


# %%
import contextlib as _cl, io as _io
def _cli(*argv):
    err = _io.StringIO()
    with _cl.redirect_stderr(err): rc = main(list(argv))
    return rc, err.getvalue()
for argv, key in [(["optim.lr=abc"], "optim.lr: must be a number, got 'abc'"), (["--method", "nope"], "method: unknown method"),
                  (["max_steps"], "override 'max_steps': not key=value"), (["--nope"], "unrecognized arguments: --nope"),
                  (["data.batch_size=1000"], "data.batch_size: 1000 per process")]:
    rc, err = _cli("--preset", "smoke", *argv)
    assert rc == 2 and err.count("\n") == 1 and err.startswith("powerclip-train: error: ") and key in err, (argv, err)
rc, err = _cli("--preset", "nope"); assert rc == 2 and "--preset: no preset 'nope'" in err, err
test_fail(lambda: main(["--preset", "smoke", "optim.lr=abc", "--debug"]), contains="optim.lr")    # --debug: the traceback

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
# on one run. On a GPU, cuDNN and cuBLAS choices add the same kind of difference.
