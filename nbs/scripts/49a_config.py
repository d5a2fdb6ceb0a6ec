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
#| default_exp config

# %%
#| export
from __future__ import annotations

import dataclasses, math, typing
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from powerclip.commandline import check_number
from powerclip.data import DataConfig
from powerclip.methods import METHODS, method_config

# %%
#| hide
from fastcore.test import test_eq, test_fail


# %% [markdown]
# # The run's config
#
# > One dataclass per component (model, data, method, optimiser) composed into a run's `TrainConfig`.
#
# It is read from a small YAML preset plus `key=value` overrides with every key and scalar type checked, the error naming
# the dotted key.

# %% [markdown]
# The trainer (`50_train`) reads a run from one `TrainConfig`. This notebook defines it and reads it: a dataclass per
# component with a comment on each field, `from_dict` (plain nested dicts, as YAML gives them, to the dataclasses,
# every key and type checked), the presets in `powerclip/presets/` and the `key=value` overrides of the command line.
# Nothing here builds a model or touches a file other than the preset; `validate` (`50_train`) checks what needs
# the model's config or the disk.

# %% [markdown]
# ## The components

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
                                       # (`30_model`, "Pooling": 'tok', 'avg' for ViT-B-16-avg); 'map': the image
                                       # tower with SigLIP's attention-pooling head (an architecture: `30_model`, "MAP")
    grad_checkpointing: bool = False   # recompute activations in backward (less memory, ~30% more time)
    compile: bool = False              # torch.compile the forward pass
    kwargs: dict = field(default_factory=dict)  # open_clip model_kwargs overriding the architecture's config
                                       # (whole entries, e.g. a text_cfg with a shorter context_length); the
                                       # geometry of the data follows it

    def __post_init__(self):
        if not self.name:
            raise ValueError("name: needs an open_clip architecture name (e.g. ViT-B-16, powerclip-tiny)")
        if self.pool not in (None, "tok", "avg", "map"):
            raise ValueError(f"pool: must be tok, avg, map or null (the architecture's), got {self.pool!r}")


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
        for k in ("lr", "weight_decay", "min_lr"):
            check_number(k, getattr(self, k), 0)
        check_number("warmup_steps", self.warmup_steps, 0, integer=True)
        check_number("eps", self.eps, 0, lo_open=True)
        if self.grad_clip is not None and not (isinstance(self.grad_clip, (int, float)) and self.grad_clip > 0
                                               and math.isfinite(self.grad_clip)):
            raise ValueError(f"grad_clip: must be a finite number above 0 or null (no clipping), got {self.grad_clip}")
        if len(self.betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas: must be two numbers in [0, 1), got {list(self.betas)}")
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr: {self.min_lr} is above the peak lr {self.lr}: the cosine would climb to it "
                             "(give min_lr <= lr)")


PRECISIONS = ("fp32", "bf16", "auto", "fp64")   # the trainer's: fp64 for exactness checks (tests/test_ddp.py)


def check_precision(flag: str, precision: str) -> str:
    "`precision` if it is one of `PRECISIONS`, else a ValueError whose message starts with `flag` (the one check)."
    if precision not in PRECISIONS:
        raise ValueError(f"{flag}: must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return precision


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
    accum_steps: int = 1               # micro-batches per process batch (gradient caching, `49c_accum`): the same
                                       # gradient as the whole batch, with about 1/accum_steps of the activations
    precision: str = "auto"            # 'fp32' | 'bf16' (autocast) | 'auto' (bf16 on GPU, fp32 on CPU) | 'fp64'
                                       # (exactness checks)
    seed: int = 0                      # the run seed: every random stream (init, data order, world scenes, region
                                       # draws, method noise, forward pass) derives from it by name (config.yaml)
    out_dir: str = "runs/run"          # config.yaml, metrics.csv, tb/, checkpoints/, loss.png
    log_every: int = 10                # steps between metric rows
    ckpt_every: int = 500              # steps between checkpoints (and one at the end)
    resume: str = "auto"               # 'auto' (out_dir/checkpoints/last.pt, else prev.pt, if present) | 'never' | a
                                       # checkpoint path
    overwrite: bool = False            # resume=never into a folder that holds a run: move that run aside to
                                       # OUT_DIR.old-<time> (never deleted) and start afresh; false: refused
    max_bad_in_row: int = 20           # abort after this many consecutive non-finite steps
    device: str | None = None          # 'cpu' | 'cuda' | 'cuda:N' | None (cuda when available)
    threads: int | None = None         # torch's CPU threads in the training process itself (None: what the environment
                                       # gives, OMP_NUM_THREADS or the cores); a run is bitwise reproducible only at
                                       # the same count (`49h_runrecord`); a resume may change it
    progress: bool = True              # tqdm progress bar on the main process
    tensorboard: bool = True           # also write TensorBoard events to out_dir/tb
    find_unused_parameters: bool = False  # DDP option, for methods that leave parameters unused
    snapshot_steps: tuple = ()         # after these steps also write snapshots/step{N}/ (model.pt, method_modules.pt,
                                       # config.yaml, snapshot.json with the training seconds so far): learning curves,
                                       # and the start of a fine-tune from the middle of a run
    start_batch: int = 0               # the first batch is this batch of the run seed's data order (a fine-tune that
                                       # continues its base run's data: the base run's step); the schedule starts at 0
    eval_every: int | None = None      # every this many steps (and at the last) the main process evaluates the model
                                       # on eval_data with powerclip-eval's tasks, into metrics.csv and TensorBoard
                                       # (`50_train`, "Evaluation while training"); None: never
    eval_data: str | None = None       # the evaluation folder (any powerclip-eval data folder); None: on the world,
                                       # its held-out test scenes written to out_dir/eval_world; on shards, none
    eval_tasks: tuple = ()             # powerclip-eval task names, each required in eval_data; (): every task whose
                                       # data the folder holds
    eval_images: int = 100             # held-out scenes of the world's default evaluation folder
    eval_timeout_s: float = 21600.0    # how long the other processes wait for the main process's evaluation

    def __post_init__(self):
        # each message starts with the field's name (what the user typed: `precision=fp16`)
        check_precision("precision", self.precision)
        if self.resume not in ("auto", "never") and not str(self.resume).endswith(".pt"):
            raise ValueError(f"resume: must be auto, never or a .pt checkpoint path, got {self.resume!r}")
        for k in ("epochs", "log_every", "ckpt_every", "max_bad_in_row", "accum_steps"):
            if getattr(self, k) < 1:
                raise ValueError(f"{k}: must be at least 1, got {getattr(self, k)}")
        for k in ("max_steps", "stop_at", "global_batch_size"):
            if getattr(self, k) is not None and getattr(self, k) < 1:
                raise ValueError(f"{k}: must be at least 1 or null, got {getattr(self, k)}")
        if self.seed < 0:
            raise ValueError(f"seed: must be at least 0, got {self.seed}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads: must be at least 1 or null (what the environment gives), got {self.threads}")
        if (self.device is not None and not (self.device in ("cpu", "cuda")
                                             or (self.device.startswith("cuda:") and self.device[5:].isdigit()))):
            raise ValueError(f"device: must be cpu, cuda, cuda:N or null (cuda when available), got {self.device!r}")
        if not self.out_dir:
            raise ValueError("out_dir: needs a folder for the run's outputs")
        if not self.method:
            raise ValueError("method: needs a method name (e.g. powerclip, clip)")
        if self.start_batch < 0:
            raise ValueError(f"start_batch: must be at least 0, got {self.start_batch}")
        # shards position by a checkpoint's StreamPosition
        if self.start_batch and getattr(self.data, "source", None) == "wds":
            raise ValueError("start_batch: continues a run's data order on the built-in world only; on shards, resume "
                             "the base run's checkpoint")
        if self.eval_every is not None and self.eval_every < 1:
            raise ValueError(f"eval_every: must be at least 1 or null (no evaluation), got {self.eval_every}")
        if self.eval_images < 1:
            raise ValueError(f"eval_images: must be at least 1, got {self.eval_images}")
        check_number("eval_timeout_s", self.eval_timeout_s, 0, lo_open=True)
        if not all(isinstance(t, str) and t for t in self.eval_tasks):
            raise ValueError(f"eval_tasks: must be task names, got {list(self.eval_tasks)}")
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
    if not isinstance(d, dict):
        raise ValueError(f"{path or cls.__name__}: must be a section of key: value entries, got {d!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for k in d:
        if k not in names:
            raise ValueError(f"{where}{k}: unknown key (known: {', '.join(sorted(names))})")
    kw = {k: _typed(hints[k], v, where + k) for k, v in d.items()}
    try:
        return cls(**kw)
    except (ValueError, TypeError) as e:
        raise ValueError(_name_key(cls, str(e), path, kw)) from None


def _name_key(cls, msg: str, path: str, kw: dict) -> str:
    """A dataclass check's message with the dotted key in front: the field its message starts with, else the one given
    value the dataclass refuses on its own (the others at their defaults), else the section."""
    where = f"{path}." if path else ""
    if msg.split(":", 1)[0].strip() in kw:
        return where + msg
    def refused(k):
        try:
            cls(**{k: kw[k]})
            return False
        except (ValueError, TypeError):
            return True
    alone = [k for k in kw if refused(k)]
    if len(alone) == 1:
        return f"{where}{alone[0]}: {msg}"
    return f"{path}: {msg}" if path else msg


_TYPE_WORDS = {float: "a number", int: "an integer", bool: "true or false", str: "text", tuple: "a list",
               list: "a list", dict: "a section of key: value entries"}


def _typed(t, v, key: str):
    "`v` as the annotation `t` wants it, or a ValueError naming `key` (see `from_dict`)."
    if dataclasses.is_dataclass(t):
        return from_dict(t, v, key)
    opts = _types(t)
    if v is None:
        if type(None) in opts or t is typing.Any:
            return None
        raise ValueError(f"{key}: may not be null (give {' or '.join(_TYPE_WORDS.get(o, str(o)) for o in opts)})")
    for o in opts:
        o = typing.get_origin(o) or o
        if o is bool and isinstance(v, bool):
            return v
        if o is int and not isinstance(v, bool):
            if isinstance(v, int):
                return v
            n = _number(v)
            if n is not None and n.is_integer():
                return int(n)
        if o is float and _number(v) is not None:
            return check_number(key, _number(v))     # finite: NaN would pass every range check after this
        if o is str and isinstance(v, str):
            return v
        if o is str and isinstance(v, (int, float)) and not isinstance(v, bool):
            return str(v)   # out_dir=2024
        if o in (tuple, list) and isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                if isinstance(x, float):
                    check_number(f"{key}[{i}]", x)
            return o(v)
        if o is dict and isinstance(v, dict):
            return v
        if o not in _TYPE_WORDS and o is not type(None):
            return v                                 # not checked here
    want = " or ".join(_TYPE_WORDS.get(typing.get_origin(o) or o, str(o)) for o in opts if o is not type(None))
    raise ValueError(f"{key}: must be {want}{' or null' if type(None) in opts else ''}, got {v!r}")


def _number(v) -> float | None:
    "A number as float (YAML 1.1 reads '1e-3' as a string), or None."
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return None
    return None


def _types(t) -> tuple:
    return (typing.get_args(t)
            if typing.get_origin(t) in (typing.Union, getattr(__import__("types"), "UnionType", None)) else (t,))


def to_dict(cfg) -> dict:
    "Plain nested dict of a config (tuples as lists: what YAML writes)."
    def plain(x):
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        return x
    return plain(asdict(cfg))


def check_kwargs(fn, kwargs: dict, path: str) -> dict:
    """`kwargs` of the callable `fn` (e.g. open_clip's `CLIP.__init__`, for `model.kwargs`), each key one of its
    parameters and each value of its annotated type, as `from_dict` checks a config (a dataclass parameter, open_clip's
    `CLIPVisionCfg`, is checked field by field); a ValueError naming `path.key`. Returns them typed (the keys given
    only)."""
    hints = {k: v for k, v in typing.get_type_hints(fn).items() if k != "return"}
    out = {}
    for k, v in (kwargs or {}).items():
        if k not in hints:
            raise ValueError(f"{path}.{k}: unknown key (known: {', '.join(sorted(hints))})")
        t = _typed(hints[k], v, f"{path}.{k}")
        out[k] = {f: getattr(t, f) for f in v} if dataclasses.is_dataclass(t) else t
    return out


# %%
_c = from_dict(TrainConfig,
               {"optim": {"lr": "1e-3", "betas": [0.9, 0.95]}, "data": {"batch_size": 8}, "method": "clip"})
test_eq((_c.optim.lr, _c.optim.betas, _c.data.batch_size, _c.method), (1e-3, (0.9, 0.95), 8, "clip"))
test_eq(from_dict(TrainConfig, to_dict(_c)), _c)
test_fail(lambda: from_dict(TrainConfig, {"optim": {"learning_rate": 1.0}}),
          contains="optim.learning_rate: unknown key")
# every message names the dotted key
for d, msg in [({"optim": {"lr": "abc"}}, "optim.lr: must be a number, got 'abc'"),
               ({"data": {"batch_size": 0}}, "data.batch_size: must be at least 1, got 0"),
               ({"data": {"workers": 1.5}}, "data.workers: must be an integer, got 1.5"),
               ({"max_steps": -1}, "max_steps: must be at least 1 or null, got -1"),
               ({"progress": "maybe"}, "progress: must be true or false, got 'maybe'"),
               ({"precision": "fp16"}, "precision: must be one of fp32, bf16, auto, fp64, got 'fp16'"),
               ({"optim": 3}, "optim: must be a section"),
               ({"model": {"kwargs": [1]}}, "model.kwargs: must be a section")]:
    test_fail(lambda: from_dict(TrainConfig, d), contains=msg)
test_eq(from_dict(TrainConfig, {"max_steps": "1e3", "optim": {"weight_decay": 0}}).max_steps, 1000)  # YAML 1.1 strings
assert isinstance(from_dict(TrainConfig, {"optim": {"weight_decay": 0}}).optim.weight_decay, float)
for d, msg in [({"eval_every": 0}, "eval_every: must be at least 1 or null"),
               ({"eval_tasks": ["retrieval", 3]}, "eval_tasks: must be task names"),
               ({"eval_images": 0}, "eval_images: must be at least 1")]:
    test_fail(lambda: from_dict(TrainConfig, d), contains=msg)
# numbers are finite numbers in their range (`17_commandline`, `check_number`): NaN passes every `x < lo`
for d, msg in [({"optim": {"lr": "nan"}}, "optim.lr: must be a finite number, got nan"),
               ({"optim": {"lr": float("inf")}}, "optim.lr: must be a finite number, got inf"),
               ({"optim": {"lr": 1e-3, "min_lr": 1e-2}}, "optim.min_lr: 0.01 is above the peak lr 0.001"),
               ({"optim": {"lr": -1}}, "optim.lr: must be at least 0, got -1.0"),
               ({"optim": {"eps": 0}}, "optim.eps: must be above 0, got 0.0"),
               ({"optim": {"grad_clip": float("inf")}}, "optim.grad_clip: must be a finite number, got inf"),
               ({"optim": {"betas": [0.9, float("nan")]}}, "optim.betas[1]: must be a finite number, got nan"),
               ({"eval_timeout_s": float("nan")}, "eval_timeout_s: must be a finite number, got nan")]:
    test_fail(lambda: from_dict(TrainConfig, d), contains=msg)
# keyword arguments typed by a callable's annotations (the trainer checks `model.kwargs` against open_clip's CLIP)
def _f(width: int, ratio: float = 4.0, name: str | None = None): ...
test_eq(check_kwargs(_f, {"width": 8, "ratio": 2}, "model.kwargs"), {"width": 8, "ratio": 2.0})
test_fail(lambda: check_kwargs(_f, {"width": "abc"}, "model.kwargs"), contains="model.kwargs.width: must be an integer")
test_fail(lambda: check_kwargs(_f, {"depth": 2}, "model.kwargs"), contains="model.kwargs.depth: unknown key")

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
        if p.is_file():
            return p
        raise FileNotFoundError(f"--preset: no file {name!r} (a preset name: {known}; or a path to a .yaml file)")
    p = PRESET_DIR / f"{name}.yaml"
    if not p.is_file():
        raise FileNotFoundError(f"--preset: no preset {name!r} (known: {known}; or a path to a .yaml file)")
    return p


def set_dotted(d: dict, key: str, value) -> None:
    "d['a']['b'] = value for key 'a.b' (creating the inner dicts)."
    *head, last = key.split(".")
    if not all(head + [last]):
        raise ValueError(f"{key}: not a dotted key (e.g. optim.lr)")
    for i, k in enumerate(head):
        d = d.setdefault(k, {})
        if not isinstance(d, dict):
            raise ValueError(f"{key}: {'.'.join(head[:i + 1])} is not a section of the config")
    d[last] = value


def parse_override(s: str) -> tuple[str, object]:
    "'key=value' -> (key, value read as YAML; a value YAML cannot read stays the text given)."
    if "=" not in s or not s.split("=", 1)[0].strip():
        raise ValueError(f"override {s!r}: not key=value (e.g. optim.lr=1e-3 data.batch_size=32)")
    k, v = s.split("=", 1)
    try:
        v = yaml.safe_load(v)
    except yaml.YAMLError:
        pass
    return k.strip(), v


def method_options(method: str, cfg: dict) -> dict:
    """The options of `method` checked against its config dataclass (unknown keys, types, the dataclass's own checks:
    a ValueError naming `method_cfg.KEY`), with values as the dataclass typed them."""
    try:
        cls = type(method_config(method))
    except KeyError:
        raise ValueError(f"method: unknown method {method!r} (registered: {', '.join(sorted(METHODS))})") from None
    opts = from_dict(cls, dict(cfg or {}), "method_cfg")
    return {k: getattr(opts, k) for k in (cfg or {})}


def load_config(preset: str | None = "demo", overrides: list[str] | dict | None = (),
                method: str | None = None) -> TrainConfig:
    "TrainConfig from a preset, a method name and `key=value` overrides (applied in that order)."
    d = {}
    if preset:
        path = preset_path(preset)
        try:
            d = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ValueError(f"--preset: {path} is not valid YAML ({str(e).splitlines()[0]})") from None
        if not isinstance(d, dict):
            raise ValueError(f"--preset: {path} must hold key: value entries, got {type(d).__name__}")
    d.pop("derived", None)  # a run's record of what it derived (seeds, geometry, needs): recomputed, never read
    method_cfgs = d.pop("method_cfgs", {}) or {}
    if method:
        d["method"] = method
    m = d.get("method", TrainConfig.method)
    d["method_cfg"] = {**(method_cfgs.get(m) or {}), **(d.get("method_cfg") or {})}
    items = overrides.items() if isinstance(overrides, dict) else map(parse_override, overrides or ())
    for k, v in items:
        set_dotted(d, k, v)
    cfg = from_dict(TrainConfig, d)
    # an unknown method or option fails here, not after the model is built
    cfg.method_cfg = method_options(cfg.method, cfg.method_cfg)
    return cfg


# %%
_c = load_config("demo", ["optim.lr=2e-3", "method_cfg.masks=gold", "method_cfg.lam=0.3"])
test_eq((_c.optim.lr, _c.method_cfg["masks"], _c.method, _c.method_cfg["lam"]), (2e-3, "gold", "powerclip", 0.3))
test_eq(load_config("demo", method="clip").method_cfg, {})
test_fail(lambda: load_config("nope"), contains="known")
for ov, msg in [(["method_cfg.lamda=1"], "method_cfg.lamda: unknown key"),
                (["method_cfg.tau=-1"], "method_cfg.tau: need tau > 0"),
                (["method_cfg.M=0"], "method_cfg.M: M must be >= 1"),
                (["method_cfg.tau=abc"], "method_cfg.tau: must be a number"),
                (["lr"], "override 'lr': not key=value"), (["optim.lr.x=1"], "optim.lr.x: optim.lr is not a section")]:
    test_fail(lambda: load_config("demo", ov), contains=msg)
test_fail(lambda: load_config("demo", method="nope"), contains="method: unknown method 'nope' (registered: ")
print(preset_path("demo").read_text())
