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
#| default_exp methods

# %%
#| export
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from powerclip.data import BatchNeeds
from powerclip.dist import DistContext, gather
from powerclip.loss import PowerCLIPLossConfig, PowersetInputs, clip_loss, powerclip_loss, triton_unavailable
from powerclip.powerset import phrase_embeddings, pool_normalize
from powerclip.powerset_fast import device_block_bytes

# %%
#| hide
import torch.nn.functional as F
from fastcore.test import test_eq, test_fail
from torch.testing import assert_close


# %% [markdown]
# # Methods
#
# > A training method is a small object that the trainer asks for by name.
#
# It says what it needs of a batch, what it changes in the forward pass, its loss terms as a dict of named tensors, and
# how evaluation should score with it.

# %% [markdown]
# The trainer (`50_train`) knows no method by name. Once, before the first batch, it asks the method what the data
# pipeline must build (`23_data`):
#
# ```python
# needs = method.needs()                     # BatchNeeds(tree, node_np, regions=M, region_source): nothing more is built
# ```
#
# A CLIP run thus draws no region mask and parses no caption; PowerCLIP asks for the tree and its $M$ masks; C2LIP
# for the tree and its noun-phrase labels. Then, each step:
#
# ```python
# method.on_step(step, total)                # schedules inside a method (CLIP-PGS's mixing weight)
# batch = method.prepare_batch(batch)        # derived inputs (C2LIP's concept masks), on the host
# out = method.forward(model, batch, modules)  # the model's outputs (inside DDP's forward)
# terms = method.loss(out, batch, dist)      # {'clip': ..., 'powerset': ..., '_sim_pos': ...}
# loss = sum(v for k, v in terms.items() if not k.startswith('_'))
# ```
#
# and logs every term. With `accum_steps = k` the trainer splits a batch into $k$ micro-batches, runs `forward` on each
# (twice: without and with gradient) and `loss` once on their outputs joined along the batch (`49c_accum`): so
# `forward`'s outputs are per sample (rows first) or 0-dimensional (the logit scale), a sample's outputs may depend
# on the rest of the batch only through what `accum_begin` computes over the whole batch beforehand, and a method
# whose forward pass cannot meet this says so in `accum_obstacle`. A method that changes the forward pass does it in its own `forward`, explicitly: FLIP and
# CLIP-PGS drop patch tokens through `powerclip.model.select_patch_tokens` around `encode`, SmartCLIP runs its mask
# network after it; the model itself knows no method. `dist` is a `powerclip.dist.DistContext`. A method that needs other processes' rows asks
# `powerclip.dist.gather(dist, {name: tensor}, pad={name: {dim: value}})` once per step, for all its tensors: the
# float tensors travel with gradient in one collective, the masks in another, ragged dimensions are padded (see
# `15_dist` for why one collective), and `g.offset` is where this process's rows start. The loss is then written on
# `11_loss`'s skeleton (`contrastive_rows`, `symmetric_infonce`): local rows against gathered columns, positives at
# `g.offset + arange(R)`. No method imports `torch.distributed`.
#
# Adding a method (FLIP, FILIP, SPARC, ...) is one class with a `Config` dataclass and `@register('name')`;
# its config is what the run config's `method_cfg` holds. The trainer gives it a seed of its own (`self.seed`,
# derived from the run seed) for any noise it draws.
#
# Parameters that a method trains besides the model (SmartCLIP's mask network, C2LIP's sigmoid temperature and
# bias) come from `build_modules(model)`. The trainer keeps them apart from the open_clip model on purpose: the
# model's `state_dict` stays exactly open_clip's, so every method's weights load in plain open_clip
# (`run_dir/model.pt`) and are evaluated alike; the modules are saved beside it (`run_dir/method_modules.pt`, and
# under `method_modules` in the resumable checkpoint). They get their own peak learning rate from `modules_lr`.

# %%
#| export
@dataclass
class NoConfig:
    "For methods without options."


class Method:
    "Base method: CLIP's forward pass and no extra batch keys. Subclasses set `Config` and override `loss`."
    name: str = "base"
    Config: type = NoConfig

    def __init__(self, cfg=None, seed: int = 0):
        self.cfg = cfg if cfg is not None else self.Config()
        # the method's own random stream (CLIP-PGS's candidates); the trainer derives it from the run seed
        self.seed = int(seed)
        if not isinstance(self.cfg, self.Config):
            raise TypeError(f"method {self.name!r} needs a {self.Config.__name__}, got {type(self.cfg).__name__}")

    def setup_model(self, model) -> None:
        """Change the model once before training. Default: nothing. Adds no parameter or buffer: the model's state_dict
        stays plain open_clip. (A change of the forward pass, e.g. dropping patch tokens, belongs in `forward`.)"""

    def build_modules(self, model) -> torch.nn.Module | None:
        """Training-time modules with parameters (SmartCLIP's mask network, C2LIP's sigmoid bias), or None.
        The trainer trains them at `modules_lr`, wraps them in DDP with the model and saves them beside it."""
        return None

    def modules_lr(self, lr: float) -> float:
        "Peak learning rate of `build_modules`' parameters, given the run's peak `lr`. Default: the same."
        return lr

    def model_kwargs(self) -> dict:
        """open_clip model kwargs the method asks of the model it trains (SigLIP's t and b: `SIGLIP_INIT`), under the
        run's own `model.kwargs`; the trainer records them in the run's config, so the evaluator builds the same
        model. Default: none."""
        return {}

    def on_step(self, step: int, total: int) -> None:
        "Called by the trainer before each step (0-based `step` of `total`): for schedules inside a method."

    def needs(self) -> BatchNeeds:
        """What the data pipeline must build besides image, tokens and index (`powerclip.data.BatchNeeds`). Default:
        nothing."""
        return BatchNeeds()

    def device_problem(self, device: str) -> str | None:
        "Why this method's config cannot run on `device` (one line, before anything is built), or None. Default: None."
        return None

    def prepare_batch(self, batch: dict) -> dict:
        """Add derived inputs to a host-side batch before it moves to the device. Default: check that `needs()` was
        built."""
        missing = [k for k in self.needs().keys() if k not in batch]
        if missing:
            raise KeyError(f"method {self.name!r} needs batch keys {missing}; the batch has {sorted(batch)}")
        return batch

    def forward(self, model, batch: dict, modules=None) -> dict:
        """The model's outputs for the loss: `powerclip.model.encode` (image, text, patches, tokens, logit_scale).
        `modules`: what `build_modules` returned."""
        from powerclip.model import encode  # late: methods stay importable without open_clip loaded
        return encode(model, batch["image"], batch["tokens"], need_patches=self.needs_patches)

    needs_patches: bool = False  # the default forward asks `encode` for patch embeddings (losses that read them)
    pools: tuple = ("tok", "avg")  # the model poolings (`model.pool`, `30_model`) the method works with ('map': the
                                   # MAP head, for the methods that read nothing but the pooled vectors and the patches)

    def loss(self, out: dict, batch: dict, dist: DistContext) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    # Gradient accumulation (`accum_steps`, `49c_accum`) re-runs `forward` on each micro-batch and computes `loss` once
    # on the joined outputs. None: exact for this method; else why not (the trainer refuses accum_steps > 1, one line)
    accum_obstacle: str | None = None

    def accum_begin(self, model, micro_batches: list[dict], modules=None, dist: DistContext | None = None) -> None:
        """Before the micro-batches of an accumulated step (no gradient): compute what the forward pass takes from the
        whole batch (CLIP-PGS-0.3's drop count) and keep it for every micro-batch's `forward`. Default: nothing."""

    def accum_end(self) -> None:
        "After an accumulated step: forget what `accum_begin` kept. Default: nothing."

    def scorers(self, modules=None) -> dict[str, "Scorer"]:
        """How evaluation scores image-text pairs: name -> `Scorer`, the method's own way first (what its paper
        reports); every method offers 'global' (see "Scoring for evaluation" below). `modules`: the method's
        trained modules (what `build_modules` made, with the run's weights) when the evaluator has them, for a
        method whose own scorer reads them."""
        return {"global": GlobalScorer()}


METHODS: dict[str, type[Method]] = {}


def register(name: str):
    "Class decorator: make a Method subclass available to `get_method(name)`."
    def deco(cls):
        old = METHODS.get(name)
        # Two different classes may not share a name. The same class defined again (a notebook re-running the
        # cell that its module exports, in a process that already imported the module) replaces the old one.
        if old is not None and old.__qualname__ != cls.__qualname__:
            raise ValueError(f"method {name!r} is already registered by {old.__module__}.{old.__qualname__}")
        cls.name = name
        METHODS[name] = cls
        return cls
    return deco


def method_config(name: str, cfg: dict | None = None):
    "The method's config dataclass from a plain dict (what YAML holds); unknown keys are a clear error."
    cls = _method_cls(name)
    cfg = dict(cfg or {})
    known = {f.name for f in dataclasses.fields(cls.Config)}
    unknown = sorted(set(cfg) - known)
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for method {name!r}; known: {sorted(known)}")
    return cls.Config(**cfg)


def get_method(name: str, cfg: dict | object | None = None, seed: int = 0) -> Method:
    """A method by name, with its config given as a dict, a config object, or None (defaults), and its random stream's
    seed."""
    cls = _method_cls(name)
    return cls(cfg if isinstance(cfg, cls.Config) else method_config(name, cfg), seed)


def _method_cls(name: str) -> type[Method]:
    if name not in METHODS:
        _import_baselines()
    if name not in METHODS:
        raise KeyError(f"unknown method {name!r}; registered: {sorted(METHODS)}")
    return METHODS[name]


def _import_baselines() -> None:
    "Methods in `powerclip/baselines/*.py` register themselves when imported: import them all, once, on demand."
    import importlib, pkgutil
    try:
        import powerclip.baselines as pkg
    except ImportError:
        return
    for m in pkgutil.iter_modules(pkg.__path__):
        importlib.import_module(f"powerclip.baselines.{m.name}")


# %% [markdown]
# ## CLIP
#
# The symmetric InfoNCE of `11_loss`, on the local rows against the embeddings gathered from every process.

# %%
#| export
# SigLIP's t and b as its models hold them (Zhai et al. 2023: t' = log 10, b = -10; open_clip's `init_logit_bias`)
SIGLIP_INIT = {"init_logit_scale": math.log(10), "init_logit_bias": -10.0}


@register("clip")
class CLIP(Method):
    "CLIP (Radford et al. 2021): global image and text embeddings, contrastive loss."
    pools = ("tok", "avg", "map")

    def loss(self, out, batch, dist):
        g = gather(dist, {"image": out["image"], "text": out["text"]})   # (C, D) each
        return {"clip": clip_loss(out["image"], out["text"], out["logit_scale"], g.all["image"],
                                  g.all["text"], g.offset),
                "_logit_scale": out["logit_scale"].detach()}


# %% [markdown]
# Methods whose schedule or noise follows the training step (CLIP-PGS's mixing weight and seed stream, A-CLIP's EMA
# momentum, E-CLIP's cluster noise) mix in `StepClock`: the trainer's `on_step(step, total)` sets the clock, so a
# resumed run continues it exactly; called outside the trainer (a notebook, a test), `tick()` after each training
# forward pass counts the steps instead.

# %%
#| export
class StepClock:
    "Mixin: `step` and `total` from the trainer's `on_step`, or counted by `tick()` when no trainer calls it."
    step: int = 0
    total: int | None = None
    _hooked: bool = False     # set by on_step: the trainer owns the clock

    def on_step(self, step: int, total: int) -> None:
        self.step, self.total, self._hooked = int(step), int(total), True

    def tick(self) -> None:
        "After a training forward pass: one step more, unless the trainer sets the clock."
        if not self._hooked:
            self.step += 1


# %%
_c = StepClock()
_c.tick()
_c.tick()
test_eq((_c.step, _c.total), (2, None))
_c.on_step(5, 10)
_c.tick()
test_eq((_c.step, _c.total), (5, 10))

# %% [markdown]
# ### Keyed noise
#
# What a method draws at random in its forward pass (CLIP-PGS's candidates, FLIP's and E-CLIP's patch order, A-CLIP's
# views) must be a function of the *sample*, not of the process or the batch it lands in: then two processes compute
# exactly what one process computes on the whole batch, a micro-batch of an accumulated step (`49c_accum`) draws the
# same twice, and a resumed run the same as an uninterrupted one. `hash_uniform` is a counter-based generator: a
# 32-bit integer mixing function (the "lowbias32" finaliser) chained over (seed, step, sample index, column), in int64
# arithmetic that never overflows (the 32-bit products are split in 16-bit halves). Its checks are in `46_clip_pgs`.

# %%
#| export
_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    "x * c mod 2**32 for x in [0, 2**32) int64, without int64 overflow."
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def hash_uniform(keys: torch.Tensor, step: int, seed: int, n: int) -> torch.Tensor:
    """keys `(C,)` non-negative int64 sample ids -> `(C, n)` float32 uniform in [0, 1), a pure function of
    (seed, step, key, column): the same on every device, process and batch composition. The ids are checked on the
    host where they are (a ValueError); on a GPU by the device itself (`torch._assert_async`: no wait for the host)."""
    if keys.device.type == "cpu":
        if (keys < 0).any():
            raise ValueError("sample ids must be non-negative")
    else:
        torch._assert_async((keys >= 0).all(), "sample ids must be non-negative")
    k = keys.long()
    h = torch.full_like(k, 0)
    for part in (seed & _M32, seed >> 32, step & _M32, step >> 32):    # fold the scalars in
        h = _mix32(h ^ part)
    h = _mix32(h ^ (k & _M32))
    h = _mix32(h ^ (k >> 32))                # (C,) one stream per sample
    col = _mix32(torch.arange(n, device=k.device) + 0x9E3779B9)          # (n,)
    v = _mix32(h[:, None] ^ col[None, :])                                # (C, n)
    return (v >> 8).float() / float(1 << 24)                             # 24 bits: exact in float32


def sample_keys(batch: dict, image: torch.Tensor) -> torch.Tensor:
    """`(C,)` the batch's sample ids (`index`, what `hash_uniform` keys its noise by) on `image`'s device; without
    them, the rows' positions in the batch."""
    keys = batch.get("index")
    return torch.arange(image.shape[0], device=image.device) if keys is None else keys.to(image.device)


# %% [markdown]
# ## PowerCLIP
#
# CLIP plus $\lambda$ times the powerset triplet loss between the image's region masks and the caption's tree
# nodes. The method's config is the loss config of `11_loss` plus the two things PowerCLIP asks of the data: how
# many region masks per image ($M$, Sec. 5.1) and where they come from: random boxes (PowerCLIP-R), the world's gold
# object masks, or segmentation masks stored beside the shards by `data_prep` (PowerCLIP-S, e.g. SAM's). `needs()`
# hands both to the pipeline, with the parse tree. Phrase embeddings of different
# processes have different numbers of nodes $K$ (and region embeddings of $M$), so `gather` pads them to the
# largest over the processes; all four float tensors travel in one collective, the two masks in another.
#
# **The ablation "w/o parse trees"** (Table 6) replaces the tree's constituents by the caption's words: `nodes='words'`
# makes every word its own node (the incidence the identity over the caption's words), so the triplet loss aligns
# region subsets with single words and never with a phrase. The paper says "individual tokens"; we take words, the unit
# the tree's leaves already are (`20_parsing`), so that the ablation removes the tree's structure and nothing else (a
# word split into several BPE pieces stays one node). (`lam=0` is "w/o triplet loss", `region_sets=False`
# "w/o region sets".)
#
# **What the host knows.** The blocked loss needs two facts of the batch on the host: the number of tree nodes of each
# caption (its block plan) and whether every region is valid (then it skips its masking passes). Read on a GPU they
# would make the host wait for the device (`11_loss`, "Host facts"), so `prepare_batch` reads them from the batch's
# CPU masks before `Run.prepare` moves it: `node_counts` (a list of C ints, of the word nodes under `nodes='words'`)
# and `all_regions_valid` (a bool), two host values in the batch that `to_device` leaves where they are and
# `powerset_inputs` hands to the loss. On one process the loss then makes no host sync at all on the fast path
# (`tests/test_cuda_dry_run.py`). A batch that did not go through `prepare_batch` (a notebook calling `loss` on model
# outputs) still works: the loss reads the facts from the device, as it always did.
#
# **Under DDP** two syncs remain, both in the gather and both needed: `gather`'s shape exchange (the processes'
# shapes, to pad and cut the collectives; `15_dist`), and one copy to the host of the gathered batch's host facts
# (each caption's node count and each image's valid regions, `(C, 2)` integers gathered with the masks), because the
# block plan of the local images against all $C$ texts needs every process's counts on the host, and no process has
# them before the collective. The gathered `node_text` is then built on the device from the gathered counts
# (`repeat_interleave` with its output size known), not gathered and shifted.
#
# **Over SigLIP** (`global_loss='siglip'`): the global term is SigLIP's sigmoid loss (`11_loss`'s `siglip_loss`) with
# the model's own $t$ (`logit_scale`) and $b$ (`logit_bias`, which `model_kwargs` asks the model to hold, initialised
# as SigLIP's, `SIGLIP_INIT`); the triplet term is unchanged. On a MAP model (`model.pool=map`, SigLIP's image tower,
# `30_model`, "MAP") the regions pool the head's patch embeddings; `pools` lists `map` for CLIP, PowerCLIP, SigLIP and
# C2LIP, whose losses read only the pooled vectors and those patch embeddings. The other methods refuse it in one line
# (`validate`): their heads (SPARC's, A-CLIP's EMA towers), token selection (FLIP, CLIP-PGS, E-CLIP) or token-wise
# scores were written for the class-token tower and are not checked on the MAP head.
#
# **The block budget** (`block_bytes='auto'`, the default) is settled for the device once, when the run is built:
# `setup_model`, which the trainer calls with the model on its device, sets it to `device_block_bytes` (16 MiB on a
# CPU; on CUDA 1/128 of the GPU's memory, within 256 MiB - 1 GiB; `10a_powerset_fast`), so no step asks the CUDA
# runtime anything. A number given in the config (`method_cfg.block_bytes=4096`) is kept. `impl='auto'` is left
# as it is: on a GPU, at the paper's size, it is the blocked path with this budget, which one H200 measured faster
# than the fused Triton kernels (`11_loss`, *Which path on a GPU*); those are `method_cfg.impl=triton`.

# %%
#| export
@dataclass
class PowerCLIPConfig(PowerCLIPLossConfig):
    "The loss's options (`PowerCLIPLossConfig`) and the region masks PowerCLIP asks of the data."
    M: int = 10               # region masks per image (Sec. 5.1)
    masks: str = "random"     # 'random' boxes (PowerCLIP-R) | 'gold' world object masks | 'superpixel' world SLIC
                              # segments | 'stored' shard masks (PowerCLIP-S)
    nodes: str = "tree"       # 'tree' the parse tree's constituents (the paper) | 'words' each word alone ("w/o parse
                              # trees")
    global_loss: str = "clip" # 'clip' (the paper) | 'siglip': SigLIP's loss with the model's own t and b (SIGLIP_INIT)

    def __post_init__(self):
        super().__post_init__()
        if self.M < 1:
            raise ValueError(f"M must be >= 1, got {self.M}")
        if self.nodes not in ("tree", "words"):
            raise ValueError(f"nodes must be 'tree' or 'words', got {self.nodes!r}")
        if self.global_loss not in ("clip", "siglip"):
            raise ValueError(f"global_loss must be 'clip' or 'siglip', got {self.global_loss!r}")
        BatchNeeds(tree=True, regions=self.M, region_source=self.masks)   # checks the mask source


@register("powerclip")
class PowerCLIP(Method):
    "PowerCLIP: CLIP (or SigLIP) + lam * powerset triplet loss (NLA-T1 + NLA-T2), config `PowerCLIPConfig`."
    Config = PowerCLIPConfig
    needs_patches = True
    pools = ("tok", "avg", "map")

    def model_kwargs(self) -> dict:
        return dict(SIGLIP_INIT) if self.cfg.global_loss == "siglip" else {}

    def needs(self) -> BatchNeeds:
        return BatchNeeds(tree=True, regions=self.cfg.M, region_source=self.cfg.masks)

    def device_problem(self, device: str) -> str | None:
        "impl='triton' where its kernels cannot run (no GPU, an old one, no triton): one line."
        return triton_unavailable(device) if self.cfg.impl == "triton" and not self.cfg.exact else None

    def setup_model(self, model) -> None:
        """Settle `block_bytes='auto'` for the model's device, once, when the run is built (see above): no question
        asked of the device inside a step. `impl='auto'` stays the blocked path on a GPU too (with that budget), even
        where the fused kernels run: it was the faster on an H200 (`11_loss`, *Which path on a GPU*); `impl='triton'`
        is checked here, so that a GPU that cannot run the kernels is told at once."""
        p = next(model.parameters())
        if self.cfg.block_bytes == "auto":
            self.cfg = dataclasses.replace(self.cfg, block_bytes=device_block_bytes(p.device))
        if self.cfg.impl == "triton" and not self.cfg.exact and (why := triton_unavailable(p)):
            raise ValueError(f"method_cfg.impl: {why}")

    def prepare_batch(self, batch: dict) -> dict:
        "The batch's host facts, read from its CPU masks: `node_counts` (C ints) and `all_regions_valid` (see above)."
        batch = super().prepare_batch(batch)
        nodes = word_nodes(batch) if self.cfg.nodes == "words" else batch
        return {**batch, "node_counts": nodes["node_valid"].sum(1).tolist(),
                "all_regions_valid": bool(batch["region_valid"].all())}

    def loss(self, out, batch, dist):
        if self.cfg.nodes == "words":
            batch = word_nodes(batch)
        padded = powerset_inputs(out, batch)               # (R, M, D), (R, M), (R, K, D), (R, K), host facts if any
        phrases, node_text = padded.packed()               # (P, D), (P,): the valid nodes only, text by text
        local = PowersetInputs(padded.regions, padded.region_valid, phrases, node_text=node_text,
                               node_counts=padded.node_counts, all_regions_valid=padded.all_regions_valid)
        tensors = {"image": out["image"], "text": out["text"], "regions": local.regions,
                   "region_valid": local.region_valid, "phrases": phrases}
        if dist.distributed:   # each caption's nodes and each image's valid regions: the gathered batch's host facts
            tensors["facts"] = torch.stack([padded.node_valid.sum(1), padded.region_valid.sum(1)], 1)   # (R, 2)
        g = gather(dist, tensors, pad={"regions": {1: 0.0}, "region_valid": {1: False}})  # M padded; nodes packed
        a = g.all
        if not dist.distributed:                           # one process: the gathered batch is the local one
            gathered = local
        else:   # one copy to the host (see above): K of every gathered caption, valid regions of every image
            facts = a["facts"].tolist()                                              # (C, 2)
            node_text_all = torch.arange(len(facts), device=phrases.device).repeat_interleave(
                a["facts"][:, 0], output_size=a["phrases"].shape[0])                 # (P_all,) sorted
            gathered = PowersetInputs(a["regions"], a["region_valid"], a["phrases"], node_text=node_text_all,
                                      node_counts=[k for k, _ in facts],
                                      all_regions_valid=all(m == a["region_valid"].shape[1] for _, m in facts))
        bias = None
        if self.cfg.global_loss == "siglip":
            if "logit_bias" not in out:
                raise ValueError("global_loss='siglip' needs the model's own logit_bias (model.kwargs.init_logit_bias)")
            bias = out["logit_bias"]
        terms = powerclip_loss(out["image"], out["text"], out["logit_scale"], local, self.cfg,
                               a["image"], a["text"], gathered, g.offset, bias)
        terms["_logit_scale"] = out["logit_scale"].detach()
        if bias is not None:
            terms["_logit_bias"] = bias.detach()
        return terms


# %% [markdown]
# ### Region, leaf and phrase embeddings
#
# What PowerCLIP's loss reads of `encode`'s output and the batch (see `23_data` for the masks): region embeddings
# $\phi(I\mid R_m)$ of Eq. 2 pool the patch embeddings under region masks, leaf embeddings $\psi(T\mid P_{m'})$ of
# Eq. 4 pool the token embeddings under each word's BPE positions, and phrase embeddings $p_B$ of Eq. 3 sum the
# leaves under each parse node. The padding conventions carry through: an invalid region or word has an
# all-`False` mask, so its embedding is the zero vector, and invalid nodes cover no word.

# %%
#| export
def powerset_inputs(enc: dict, batch: dict) -> PowersetInputs:
    """Regions `(C, M, D)` (Eq. 2), phrases `(C, K, D)` (Eqs. 3-4) and validity masks from `encode`'s output and
    a batch with `region_masks (C, M, N)`, `region_valid (C, M)`, `leaf_tokens (C, W, L)`, `incidence (C, K, W)`,
    `node_valid (C, K)`, and the host facts `node_counts`, `all_regions_valid` where `PowerCLIP.prepare_batch` read
    them."""
    if enc.get('patches') is None:
        raise ValueError('no patch embeddings: encode with need_patches=True')
    masks = batch['region_masks'].to(enc['patches'].device)
    if masks.shape[-1] != enc['patches'].shape[1]:
        raise ValueError(f"region masks have {masks.shape[-1]} patches, the model {enc['patches'].shape[1]}")
    regions = pool_normalize(enc['patches'], masks)                                   # (C, M, D)
    leaves = pool_normalize(enc['tokens'], batch['leaf_tokens'].to(enc['tokens'].device))  # (C, W, D)
    phrases = phrase_embeddings(leaves, batch['incidence'].to(leaves.device))         # (C, K, D)
    return PowersetInputs(regions, batch['region_valid'].to(regions.device), phrases,
                          batch['node_valid'].to(phrases.device), node_counts=batch.get('node_counts'),
                          all_regions_valid=batch.get('all_regions_valid'))


def word_nodes(batch: dict) -> dict:
    """The ablation "w/o parse trees": every word its own node. `incidence (C, W, W)` is the identity over each
    caption's words (`leaf_tokens (C, W, L)` non-empty) and `node_valid (C, W)` those words; the rest of the batch is
    kept."""
    words = batch['leaf_tokens'].any(-1)                                              # (C, W)
    eye = torch.eye(words.shape[1], dtype=torch.bool, device=words.device)
    inc = (eye & words[:, :, None]).to(batch['incidence'].dtype)                     # (C, W, W)
    return {**batch, 'incidence': inc, 'node_valid': words}


# %% [markdown]
# On a model (the micro architecture, random weights, a $4\times4$ patch grid) and two parsed captions:

# %%
from powerclip.model import create_model, encode, grid_size
from powerclip.parsing import ParsedCaption
from powerclip.tokens import collate_trees, tree_tokens

torch.manual_seed(0)
_model = create_model("powerclip-micro")[0].eval()
_pcs = [ParsedCaption('a red circle left of a blue square', 'a red circle left of a blue square'.split(),
                      [(0, 8), (0, 3), (3, 8), (3, 5), (5, 8)], ['S', 'NP', 'PP', 'ADVP', 'NP'], 'gold', []),
        ParsedCaption('a green cross', ['a', 'green', 'cross'], [(0, 3)], ['NP'], 'gold', [])]
_tt = collate_trees([tree_tokens(p) for p in _pcs])
_img = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    _enc = encode(_model, _img, _tt['tokens'])
_gh, _gw = grid_size(_model)
_masks = torch.zeros(2, 3, _gh * _gw, dtype=torch.bool)
_masks[:, 0, :_gw] = True
_masks[:, 1, _gw + 1] = True                 # row 0; patch (1, 1); row 2 is padding
_pb = dict(_tt, region_masks=_masks, region_valid=_masks.any(-1))
_pi = powerset_inputs(_enc, _pb)
D = _enc['image'].shape[1]
assert _pi.regions.shape == (2, 3, D) and _pi.phrases.shape == (2, 5, D)
assert_close(_pi.regions[:, 0], F.normalize(_enc['patches'][:, :_gw].sum(1), dim=-1))
assert_close(_pi.regions[:, 1], F.normalize(_enc['patches'][:, _gw + 1], dim=-1))
assert not _pi.regions[:, 2].any() and _pi.region_valid[:, 2].logical_not().all()
# phrase 'a blue square' of caption 0 (node 4: words 5..7): the sum of its three normalised word embeddings
_words = [F.normalize(_enc['tokens'][0][_tt['leaf_tokens'][0, w]].sum(0), dim=-1) for w in (5, 6, 7)]
assert_close(_pi.phrases[0, 4], sum(_words))
# caption 1 has one node; nodes 1..4 are padding: zero and invalid
assert not _pi.phrases[1, 1:].any() and _pi.node_valid[1].tolist() == [True, False, False, False, False]
test_fail(lambda: powerset_inputs(_enc, dict(_pb, region_masks=_masks[..., :10])), contains='patches')
# w/o parse trees: the nodes are the words, each phrase embedding one normalised word embedding
_pw = powerset_inputs(_enc, word_nodes(_pb))
test_eq(_pw.node_valid.sum(1).tolist(), [8, 3])
assert_close(_pw.phrases[0, 6], _words[1])
assert_close(_pw.phrases[1, 2], F.normalize(_enc['tokens'][1][_tt['leaf_tokens'][1, 2]].sum(0), dim=-1))

# %% [markdown]
# The whole path, from the model through the method's forward and loss, back-propagates into both towers:

# %%
_model.train()
_pm = get_method("powerclip")
_terms = _pm.loss(_pm.forward(_model, dict(_pb, image=_img)), _pb, DistContext())
_model.zero_grad()
(_terms['clip'] + _terms['powerset']).backward()
assert _model.visual.conv1.weight.grad.abs().sum() > 0 and _model.token_embedding.weight.grad.abs().sum() > 0
_tw = get_method("powerclip", {"nodes": "words"}).loss(_pm.forward(_model, dict(_pb, image=_img)), _pb, DistContext())
assert_close(_tw['clip'], _terms['clip'])
assert not torch.allclose(_tw['powerset'], _terms['powerset'])  # only the nodes differ
test_fail(lambda: get_method("powerclip", {"nodes": "tokens"}), contains="nodes")
_model.eval()
print({k: round(float(v.detach()), 4) for k, v in _terms.items()})


# %% [markdown]
# ## Scoring for evaluation
#
# Evaluation (retrieval, zero-shot classification, hard negatives) ranks image-text pairs by a score. For CLIP
# and most methods that is the cosine of the pooled embeddings; a method whose paper scores otherwise at
# inference (FILIP: token-wise late interaction) says so with its own `Scorer`. The evaluator asks the method:
# `method.scorers()` maps a name to a scorer, the first entry being the method's own way (what its paper
# reports), and every method also offers `'global'`, so that all methods can be compared on the same footing.
#
# A scorer splits the work in two so that the evaluator can cache features: `image_features` and
# `text_features` run the towers once per image and per caption (tensors with one row per input, which may
# live on the CPU), and `scores` combines any $I$ images with any $T$ captions into an $(I, T)$ matrix.
#
# A method that trains modules of its own beside the model (`build_modules`) may score with them: the evaluator
# loads them with the run (`method_modules.pt` beside `model.pt`) and passes them to `scorers(modules)`.
#
# **Regions.** The region task (`63a_eval_regions`) asks a scorer for three more things, each a unit vector per row so
# that a cosine compares them: `region_features`, one embedding per region mask on the patch grid; `crop_features`,
# the embedding of a region cropped and encoded as an image; and `class_features`, the text embedding of a class
# prompt. By default they are PowerCLIP's region embedding (Eq. 2: the normalised mean of the projected patch
# embeddings inside the mask, `powerset.pool_normalize`, the representation PowerCLIP trains), the model's own image
# embedding and its own text embedding (each pooled as the model pools, `30_model`). A method whose paper pools a
# region otherwise overrides them (SPARC: its head on the mean of the patch tokens; A-CLIP's EMA scorer: its EMA towers
# for crops and prompts).

# %%
#| export
class Scorer:
    "How evaluation scores image-text pairs with a trained model; features are cached by the evaluator."
    name: str = "global"

    def image_features(self, model, images: torch.Tensor) -> dict[str, torch.Tensor]:
        "images `(B, 3, H, W)` -> features with B rows each."
        raise NotImplementedError

    def text_features(self, model, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        "tokens `(B, L)` open_clip ids -> features with B rows each."
        raise NotImplementedError

    def scores(self, img: dict[str, torch.Tensor], txt: dict[str, torch.Tensor]) -> torch.Tensor:
        "Features of I images and T captions -> `(I, T)` scores, higher is more similar."
        raise NotImplementedError

    @torch.no_grad()
    def region_features(self, model, images: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
        "images `(B, 3, H, W)`, masks `(B, R, N)` bool on the patch grid -> `(B, R, D)` unit region embeddings (Eq. 2)."
        from powerclip.model import encode   # late: methods stay importable without open_clip loaded
        return pool_normalize(encode(model, images, None)["patches"], masks.to(images.device)).float()

    @torch.no_grad()
    def crop_features(self, model, images: torch.Tensor) -> torch.Tensor:
        "crops `(B, 3, H, W)` -> `(B, D)` unit image embeddings (the model's pooling)."
        from powerclip.model import encode
        return encode(model, images, None, need_patches=False)["image"].float()

    @torch.no_grad()
    def class_features(self, model, tokens: torch.Tensor) -> torch.Tensor:
        "prompts `(B, L)` -> `(B, D)` unit text embeddings (the model's pooling)."
        from powerclip.model import encode
        return encode(model, None, tokens)["text"].float()


class GlobalScorer(Scorer):
    "CLIP's score: the dot product of L2-normalised `encode_image` and `encode_text` (the cosine)."
    name = "global"

    @torch.no_grad()
    def image_features(self, model, images):
        return {"image": model.encode_image(images, normalize=True).float()}         # (B, D)

    @torch.no_grad()
    def text_features(self, model, tokens):
        return {"text": model.encode_text(tokens, normalize=True).float()}           # (B, D)

    def scores(self, img, txt):
        return img["image"] @ txt["text"].to(img["image"].device).T                # (I, T)


# %% [markdown]
# ### Checks
#
# The registry, and each method's loss on model outputs built by hand (no model needed): the methods add
# nothing to the loss functions of `11_loss`, they only route the batch to them.

# %%
assert {"clip", "powerclip"} <= set(METHODS)
test_fail(lambda: get_method("nope"), contains="registered")
test_fail(lambda: get_method("powerclip", {"lambda": 0.2}), contains="unknown option")
_m = get_method("powerclip", {"lam": 0.2, "tau": 0.01, "M": 4, "masks": "gold"})
assert isinstance(_m.cfg, PowerCLIPLossConfig) and _m.cfg.lam == 0.2
assert (_m.needs() == BatchNeeds(tree=True, regions=4, region_source="gold")
        and get_method("clip").needs() == BatchNeeds())
test_fail(lambda: get_method("powerclip", {"masks": "sam"}), contains="region_source")
test_fail(lambda: _m.prepare_batch({"image": 0, "tokens": 0}), contains="region_masks")


# %%
def _fake(C=4, N=16, L=10, W=5, K=4, M=3, D=8, seed=0):
    "Model outputs and a batch with the shapes of the batch contract."
    g = torch.Generator().manual_seed(seed)
    out = dict(image=F.normalize(torch.randn(C, D, generator=g), dim=-1),
               text=F.normalize(torch.randn(C, D, generator=g), dim=-1),
               patches=torch.randn(C, N, D, generator=g), tokens=torch.randn(C, L, D, generator=g),
               logit_scale=torch.tensor(10.0))
    leaf = torch.zeros(C, W, L, dtype=torch.bool)
    for w in range(W):
        leaf[:, w, 1 + w] = True
    batch = dict(image=None, tokens=None, leaf_tokens=leaf, leaf_valid=torch.ones(C, W, dtype=torch.bool),
                 incidence=torch.rand(C, K, W, generator=g) < 0.5, node_valid=torch.ones(C, K, dtype=torch.bool),
                 region_masks=torch.rand(C, M, N, generator=g) < 0.3, region_valid=torch.ones(C, M, dtype=torch.bool))
    batch["incidence"][:, :, 0] = True
    batch["region_masks"][:, :, 0] = True
    return out, batch

_out, _b = _fake()
_one = DistContext()
_t = get_method("clip").loss(_out, _b, _one)
assert_close(_t["clip"], clip_loss(_out["image"], _out["text"], _out["logit_scale"]))
_t = get_method("powerclip").loss(_out, _b, _one)
print({k: round(float(v), 4) for k, v in _t.items()})
assert set(_t) >= {"clip", "powerset", "_triplet_i2t", "_logit_scale"} and torch.isfinite(_t["powerset"])

# %% [markdown]
# PowerCLIP's host facts: `prepare_batch` reads them from the CPU masks (the word nodes' counts under `nodes='words'`),
# and the loss with them is the loss without them, bitwise, on each path; `setup_model` settles `block_bytes='auto'`
# for the model's device (a CPU: 16 MiB) and keeps a number given.

# %%
_bf = dict(_b, node_valid=torch.rand(4, 4, generator=torch.Generator().manual_seed(3)) < 0.6,
           region_valid=torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]], dtype=torch.bool))
_bf["node_valid"][:, 0] = True
for kw in ({}, {"nodes": "words"}, {"impl": "fast", "block_bytes": 256}, {"impl": "fast", "region_sets": False},
           {"impl": "dense"}):
    _pm = get_method("powerclip", kw)
    for b in (_b, _bf):
        pb = _pm.prepare_batch(b)
        want = (word_nodes(b) if kw.get("nodes") == "words" else b)["node_valid"].sum(1).tolist()
        test_eq((pb["node_counts"], pb["all_regions_valid"]), (want, bool(b["region_valid"].all())))
        t0, t1 = _pm.loss(_out, b, DistContext()), _pm.loss(_out, pb, DistContext())
        assert all(torch.equal(t0[k], t1[k]) for k in t0), kw
_pm = get_method("powerclip")
test_eq(_pm.cfg.block_bytes, "auto")
_pm.setup_model(torch.nn.Linear(2, 2))
test_eq(_pm.cfg.block_bytes, 16 << 20)
_pm = get_method("powerclip", {"block_bytes": 4096})
_pm.setup_model(torch.nn.Linear(2, 2))
test_eq(_pm.cfg.block_bytes, 4096)
test_fail(lambda: get_method("powerclip", {"block_bytes": "big"}), contains="block_bytes 'auto' or an integer")

# %% [markdown]
# A name belongs to one class: registering another class under a taken name is an error, while the same
# class defined again (as when this notebook re-runs its exported cells) simply replaces the entry.

# %%
try:
    @register("clip")
    class NotCLIP(Method):
        pass
    raise AssertionError("a second class under 'clip' was accepted")
except ValueError as e:
    assert "already registered" in str(e)
assert register("clip")(type("CLIP", (Method,), {})) is METHODS["clip"]  # same name, same qualname: replaced
register("clip")(CLIP)  # restore the real one
assert METHODS["clip"] is CLIP

# %% [markdown]
# The global scorer on a model (the micro architecture, random weights): its scores are the cosines of
# open_clip's own `encode_image` and `encode_text`, and every method offers it.

# %%
from powerclip.model import create_model
torch.manual_seed(0)
_model = create_model("powerclip-micro")[0].eval()
_imgs = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
_ids = torch.zeros(4, 77, dtype=torch.long)
_ids[:, 0], _ids[:, 1:4], _ids[:, 4] = 49406, torch.arange(300, 312).reshape(4, 3), 49407
_sc = get_method("clip").scorers()
assert list(_sc) == ["global"] and list(get_method("powerclip").scorers()) == ["global"]
_S = _sc["global"].scores(_sc["global"].image_features(_model, _imgs), _sc["global"].text_features(_model, _ids))
with torch.no_grad():
    _ref = F.cosine_similarity(_model.encode_image(_imgs)[:, None], _model.encode_text(_ids)[None], dim=-1)  # (3, 4)
assert _S.shape == (3, 4)
assert_close(_S, _ref)

# %% [markdown]
# The region readings by default: a mask of one patch gives that patch's normalised embedding (what the heat maps of
# `67_heatmaps` compare a phrase with); under average pooling the mask of the whole grid gives the image embedding
# itself (the global embedding *is* the region embedding of the whole image, `30_model`); crops and prompts are the
# model's own image and text embeddings.

# %%
from powerclip.model import encode, set_pool
_g = _sc["global"]
with torch.no_grad():
    _e = encode(_model, _imgs, _ids[:3])
    _one = torch.eye(16, dtype=torch.bool)[None].expand(3, -1, -1)                      # (3, 16, 16) one patch each
    assert_close(_g.region_features(_model, _imgs, _one), F.normalize(_e["patches"], dim=-1))
    assert_close(_g.crop_features(_model, _imgs), _e["image"])
    assert_close(_g.class_features(_model, _ids[:3]), _e["text"])
    set_pool(_model, "avg")
    _all = torch.ones(3, 1, 16, dtype=torch.bool)
    assert_close(_g.region_features(_model, _imgs, _all)[:, 0], _model.encode_image(_imgs, normalize=True))
    set_pool(_model, "tok")
