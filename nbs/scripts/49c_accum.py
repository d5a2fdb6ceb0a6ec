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
#| default_exp accum

# %%
#| export
from __future__ import annotations

import contextlib
from typing import Callable

import torch

from powerclip.dist import DistContext
from powerclip.methods import Method, StepClock

# %%
#| hide
from fastcore.test import test_eq, test_fail
from torch.testing import assert_close


# %% [markdown]
# # Gradient accumulation
#
# > The gradient of a whole batch, computed a micro-batch at a time (gradient caching).
#
# `accum_steps = k` in the run config splits each process's batch into $k$ micro-batches; the step's gradient is the
# gradient of the whole batch's loss, while only one micro-batch's activations are alive at a time.

# %% [markdown]
# A contrastive loss is not a sum over micro-batches: every sample is a negative of every other, so summing the
# losses of $k$ micro-batches trains another objective (with $k$ times fewer negatives). But the loss depends on the
# parameters $\theta$ only through the per-sample outputs $z = (z_1, \dots, z_k)$ of the forward pass (embeddings,
# patch and token embeddings, a mask, concepts; the micro-batch $i$ gives $z_i$), so by the chain rule
#
# $$\frac{\partial L}{\partial\theta} = \sum_{i=1}^{k} \frac{\partial L}{\partial z_i}\,\frac{\partial z_i}{\partial\theta}.$$
#
# GradCache (Gao et al. 2021) computes it in three passes, which `accumulate` follows:
#
# 1. **embed** every micro-batch without gradient (its outputs $z_i$ kept, its random state noted);
# 2. **loss** once on the joined outputs $z$ (made leaves that require gradient; gathered across processes as
#    always, `15_dist`) and its gradient with respect to $z$ (the logit scale, SmartCLIP's mask, C2LIP's $t$ and $b$
#    are outputs of the forward pass too) and to the parameters the loss reads itself (A-CLIP's heads);
# 3. **re-embed** each micro-batch with gradient, replaying its random state, and back-propagate its slice
#    $\partial L/\partial z_i$ into the parameters (`torch.autograd.backward(z_i, grad)`), which sums the $k$
#    terms of the chain rule in the parameters' `.grad`.
#
# Outputs that are not per sample (0-dimensional: the logit scale, C2LIP's $t$ and $b$) are the same in every
# micro-batch; their gradient goes back once, through the last micro-batch. Under DDP the first $k-1$ backward passes
# run in `no_sync()`, and the last one all-reduces the summed gradients, once per step. The gradient $g$ of a parameter
# $p$ that the loss reads itself (A-CLIP's heads, applied to the joined batch because their BatchNorm normalises over
# it) joins that last pass as the term $\sum p\,g$, whose gradient is $g$: DDP reduces a gradient only in a backward
# pass that follows its synchronised forward, so a backward of the loss alone, before it, would leave these gradients
# local to each process (and a DDP without `find_unused_parameters` waiting for them). The cost: one more forward pass
# per step. Measured on this repository's idle 2-core CPU (`benchmarks/results/accum_memory_demo_cpu_B128_fp32.md`:
# the demo model, 128 per step, fp32, 4 rounds), a step took 1.49x / 1.56x / 1.73x (CLIP) and 1.36x / 1.29x / 1.25x
# (PowerCLIP) the time of the plain step at k = 2 / 4 / 8 (the rounds' medians vary by about 15 %; small micro-batches
# also use a CPU less well), for 0.68x / 0.47x / 0.38x (CLIP) and 0.68x / 0.48x / 0.47x (PowerCLIP) of its peak memory
# above the weights: the activations shrink as $1/k$, what stays (gradients, AdamW's moments, the joined outputs and
# PowerCLIP's loss) does not. On a GPU the GPU check's `accum` part measures ViT-B/16.
#
# **What exactness asks of a method.** Its `forward` must be a function of each sample alone: randomness keyed by the
# sample (`hash_uniform`, `40_methods`), not drawn from a global stream whose position depends on the batch; no
# state changed in `forward` (A-CLIP's EMA step moves once per step, in `accum_begin`); no batch statistic computed
# inside the forward pass, or else computed over the whole batch beforehand by `Method.accum_begin` (CLIP-PGS-0.3's
# drop count, E-CLIP's smallest cluster) and read by every micro-batch, or applied in the loss to the joined outputs
# (A-CLIP's BatchNorm heads). Every registered method meets this; a method that cannot names why in
# `accum_obstacle`, and `accum_steps > 1` is refused with that line. (Replaying the
# random state of the global generators, done here as well, keeps any remaining draw, e.g. dropout, the same in
# both passes, so the gradient is that of the loss computed; it would still differ from one batch of $k$ times the
# size.)

# %% [markdown]
# ## Splitting and joining
#
# A batch splits along its rows: every tensor (or list) whose first dimension is the batch's row count is cut into
# $k$ equal parts, anything else (a 0-dimensional value) is handed to each part. The outputs join back: per-sample
# tensors are concatenated in order, 0-dimensional ones are taken from the last micro-batch. A per-sample output
# whose other dimensions differ between micro-batches cannot be joined and is an error naming it.

# %%
#| export
def batch_rows(batch: dict) -> int:
    "The batch's row count: the rows of its `image` (else `tokens`)."
    x = batch.get("image", batch.get("tokens"))
    if not torch.is_tensor(x):
        raise ValueError(f"a batch needs an image or tokens tensor to count its rows; it has {sorted(batch)}")
    return x.shape[0]


def split_batch(batch: dict, k: int) -> list[dict]:
    "`batch` of C rows -> k micro-batches of C / k rows each (per-row tensors and lists cut, anything else shared)."
    C = batch_rows(batch)
    if k < 1 or C % k:
        raise ValueError(f"accum_steps: {C} rows per process do not split into {k} equal micro-batches")
    m = C // k
    def part(v, i):
        if (torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == C) or (isinstance(v, (list, tuple)) and len(v) == C):
            return v[i * m:(i + 1) * m]
        return v
    return [{n: part(v, i) for n, v in batch.items()} for i in range(k)]


def join_outputs(outs: list[dict], rows: list[int]) -> tuple[dict, set]:
    """The forward outputs of k micro-batches (`rows[i]` rows each) as one batch's, and the names of the per-sample
    ones. Float tensors come back as detached leaves that require gradient (what `accumulate` differentiates)."""
    joined, per_sample = {}, set()
    for name, last in outs[-1].items():
        vals = [o[name] for o in outs]
        if torch.is_tensor(last) and last.dim() > 0:
            if any(v.shape[0] != r for v, r in zip(vals, rows)):
                raise ValueError(f"forward output {name!r} is neither per sample (rows first) nor 0-dimensional: "
                                 f"shapes {[tuple(v.shape) for v in vals]} for micro-batches of {rows} rows")
            if any(v.shape[1:] != last.shape[1:] for v in vals):
                raise ValueError(f"forward output {name!r} differs in shape between micro-batches "
                                 f"({[tuple(v.shape) for v in vals]}): it cannot be joined")
            last = torch.cat(vals)
            per_sample.add(name)
        if torch.is_tensor(last) and last.is_floating_point():
            last = last.detach().requires_grad_()
        joined[name] = last
    return joined, per_sample


# %%
_b = dict(image=torch.arange(12.).reshape(6, 2), tokens=torch.zeros(6, 3), index=torch.arange(6), scale=torch.ones(()),
          names=list("abcdef"))
_mb = split_batch(_b, 3)
test_eq([m["index"].tolist() for m in _mb], [[0, 1], [2, 3], [4, 5]])
test_eq(_mb[2]["names"], ["e", "f"])
assert all(m["scale"] is _b["scale"] for m in _mb)
test_fail(lambda: split_batch(_b, 4), contains="6 rows per process do not split into 4")
_j, _ps = join_outputs([dict(image=m["image"], s=torch.tensor(2.0)) for m in _mb], [2, 2, 2])
assert_close(_j["image"], _b["image"])
assert _ps == {"image"} and _j["image"].requires_grad and _j["s"].dim() == 0
test_fail(lambda: join_outputs([dict(x=torch.ones(2, 3)), dict(x=torch.ones(2, 4))], [2, 2]), contains="'x' differs")
test_fail(lambda: join_outputs([dict(x=torch.ones(5, 3)), dict(x=torch.ones(5, 3))], [2, 2]), contains="neither")


# %% [markdown]
# ## The accumulated step
#
# `accumulate` does passes 1 and 2 at once and returns the loss, its terms and a `backward` that does the rest (the
# loss's gradients, then pass 3): the trainer decides between them whether the step is bad (a non-finite loss skips
# the update on every process, `50_train`), exactly as with `loss.backward` when $k=1$. `fwd` is the trainer's
# forward module (`MethodForward`, possibly in DDP or compiled), `amp` the precision's autocast context.

# %%
#| export
def _rng_state(device: torch.device) -> tuple:
    "The global generators' states: the CPU's, and the device's when it is a GPU."
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


def _set_rng_state(state: tuple, device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def _inner(fwd: torch.nn.Module) -> torch.nn.Module:
    "The MethodForward inside DDP and/or torch.compile."
    fwd = getattr(fwd, "_orig_mod", fwd)          # torch.compile's wrapper
    return getattr(fwd, "module", fwd)            # DDP's


def _no_sync(fwd: torch.nn.Module):
    "DDP's `no_sync()` (the gradients stay local until the last micro-batch), or nothing in one process."
    ddp = getattr(fwd, "_orig_mod", fwd)
    return ddp.no_sync() if hasattr(ddp, "no_sync") else contextlib.nullcontext()


def accumulate(fwd: torch.nn.Module, method: Method, batch: dict, ctx: DistContext, k: int,
               amp: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
               ) -> tuple[torch.Tensor, dict, Callable[[], None]]:
    """(total loss, named terms, backward) of one batch in `k` micro-batches: the loss of the whole batch, computed
    once; `backward()` puts its gradient into the parameters' `.grad` (see above). A method with an
    `accum_obstacle` is refused (ValueError)."""
    if method.accum_obstacle:
        raise ValueError(f"accum_steps: method {method.name!r} cannot accumulate gradients exactly: "
                         f"{method.accum_obstacle}")
    if "index" not in batch:
        raise ValueError("accum_steps: the batch has no 'index' (its sample ids): keyed noise would follow the rows of "
                         "each micro-batch, not the samples, and the gradient would not be the whole batch's")
    if isinstance(method, StepClock) and not method._hooked:
        raise ValueError(f"accum_steps: method {method.name!r} keeps a step clock that was not set: call "
                         "method.on_step(step, total) before each step (the trainer does); counted by its forward "
                         "passes, it would advance 2k times a step")
    micros = split_batch(batch, k)
    rows = [batch_rows(m) for m in micros]
    inner = _inner(fwd)
    states, outs = [], []
    try:
        with torch.no_grad():
            with amp():
                method.accum_begin(inner.model, micros, inner.modules_, ctx)   # batch statistics, before any forward
            for m in micros:                                                   # 1. embed, no gradient
                states.append(_rng_state(ctx.device))
                with amp():
                    outs.append(fwd(m))
        after = _rng_state(ctx.device)
        joined, per_sample = join_outputs(outs, rows)
        del outs
        with amp():                                                            # 2. the loss, once
            terms = method.loss(joined, batch, ctx)
    except BaseException:
        method.accum_end()
        raise
    summed = [v for n, v in terms.items() if not n.startswith("_")]
    if not summed:
        method.accum_end()
        raise ValueError(f"method {method.name!r} returned no loss term (only {sorted(terms)})")
    loss = sum(summed)
    starts = [sum(rows[:i]) for i in range(k + 1)]

    def backward() -> None:
        try:
            names = [n for n, v in joined.items() if torch.is_tensor(v) and v.requires_grad]
            params = [p for p in inner.parameters() if p.requires_grad]
            got = torch.autograd.grad(loss, [joined[n] for n in names] + params, allow_unused=True)
            dz = dict(zip(names, got[:len(names)]))                            # dL/dz of the joined outputs
            # parameters the loss reads itself (A-CLIP's heads); sum(p * dL/dp) has the gradient dL/dp, exactly
            direct = [(p, g) for p, g in zip(params, got[len(names):]) if g is not None]
            for i, m in enumerate(micros):                                     # 3. re-embed, back-propagate a slice
                last = i == k - 1
                _set_rng_state(states[i], ctx.device)
                with contextlib.nullcontext() if last else _no_sync(fwd):
                    with amp():
                        out = fwd(m)
                    pairs = []
                    for name in names:
                        if dz[name] is None or not out[name].requires_grad:
                            continue
                        if name in per_sample:
                            pairs.append((out[name], dz[name][starts[i]:starts[i + 1]]))
                        elif last:                                             # shared: its gradient once
                            pairs.append((out[name], dz[name]))
                    if last and direct:
                        # into the last, synchronised backward pass: DDP all-reduces these gradients with the rest
                        # (a backward of the loss alone would run before DDP expects gradients, and stay local)
                        surrogate = sum((p * g.to(p.dtype)).sum() for p, g in direct)
                        pairs.append((surrogate, torch.ones_like(surrogate)))
                    if pairs:
                        torch.autograd.backward([t for t, _ in pairs], [g.to(t.dtype) for t, g in pairs])
            _set_rng_state(after, ctx.device)
        finally:
            method.accum_end()

    return loss, terms, backward


# %% [markdown]
# Two things `accumulate` cannot see for itself are refused: a batch without `index` (the sample ids that keyed noise,
# `hash_uniform`, is drawn by: without them each micro-batch would key it by its own row positions, and the two
# passes would still agree, but not with the whole batch), and a method with a step clock (`StepClock`) that the
# caller did not set with `on_step` (counted by forward passes instead, it would move $2k$ times in one step).
#
# On the micro model, CLIP's gradient in 4 micro-batches of 4 equals that of the batch of 16 (float64); a batch that
# does not split evenly is refused. `tests/test_accum.py` checks every method, in float64 and float32, and two
# processes with micro-batches against one without; `50_train` calls `accumulate` when `accum_steps > 1`.

# %%
from powerclip.methods import get_method
from powerclip.model import create_model, encode

torch.manual_seed(0)
_model = create_model("powerclip-micro")[0].double().train()
_clip = get_method("clip")


class _Fwd(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model, self.modules_ = model, None

    def forward(self, b):
        return encode(self.model, b["image"], b["tokens"], need_patches=False)


_ids = torch.zeros(16, 77, dtype=torch.long)
_ids[:, 0], _ids[:, 1], _ids[:, 2] = 49406, torch.arange(300, 316), 49407
_batch = dict(image=torch.randn(16, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1)),
              tokens=_ids, index=torch.arange(16))
_f = _Fwd(_model)
_full = _clip.loss(_f(_batch), _batch, DistContext())["clip"]
_full.backward()
_g1 = {n: p.grad.clone() for n, p in _model.named_parameters() if p.grad is not None}
_model.zero_grad(set_to_none=True)
_loss, _terms, _bw = accumulate(_f, _clip, _batch, DistContext(), 4)
_bw()
_g4 = {n: p.grad.clone() for n, p in _model.named_parameters() if p.grad is not None}
assert_close(_loss.detach(), _full.detach(), rtol=1e-12, atol=0)
test_eq(set(_g4), set(_g1))
_err = max(float((_g4[n] - _g1[n]).abs().max() / _g1[n].abs().max().clamp_min(1e-300)) for n in _g1)
print(f"{len(_g1)} gradient tensors; largest relative difference {_err:.1e}")
assert _err < 1e-10
test_fail(lambda: accumulate(_f, _clip, _batch, DistContext(), 3), contains="16 rows per process do not split into 3")
test_fail(lambda: accumulate(_f, _clip, {k: v for k, v in _batch.items() if k != "index"}, DistContext(), 4),
          contains="the batch has no 'index'")

# %% [markdown]
# A-CLIP is the method with parameters inside its loss: its SimCLR and BYOL heads, applied to the joined batch because
# their BatchNorm normalises over it, get their gradient in pass 2 and hand it to the last backward pass (above). Its
# EMA step moves once, in `accum_begin`. From the same EMA towers (the online weights moved away from them, so that the
# EMA step changes them), 4 micro-batches of 4 give the gradient of the batch of 16, heads included (float64).

# %%
import copy

from powerclip.methods import _import_baselines

_import_baselines()
_ac = get_method("aclip", seed=0)
_am = create_model("powerclip-micro")[0].double().train()
_ac.setup_model(_am)
_heads = _ac.build_modules(_am).double().train()
with torch.no_grad():                    # the online weights away from the EMA's, so that the EMA step moves them
    for _p in _am.parameters():
        _p.add_(0.05 * torch.randn(_p.shape, dtype=_p.dtype, generator=torch.Generator().manual_seed(_p.numel())))
_ema0 = copy.deepcopy(_heads.state_dict())


class _AFwd(torch.nn.Module):
    def __init__(self, model, modules):
        super().__init__()
        self.model, self.modules_ = model, modules

    def forward(self, b):
        return _ac.forward(self.model, b, self.modules_)


_af, _ab = _AFwd(_am, _heads), dict(_batch, index=torch.arange(16))
_named = [*_am.named_parameters(), *(("heads." + n, p) for n, p in _heads.named_parameters())]
test_fail(lambda: accumulate(_af, _ac, _ab, DistContext(), 4), contains="step clock that was not set")
_ac.on_step(3, 10)
_t = _ac.loss(_af(_ab), _ab, DistContext())
sum(v for n, v in _t.items() if not n.startswith("_")).backward()
_a1 = {n: p.grad.clone() for n, p in _named if p.grad is not None}
_am.zero_grad(set_to_none=True)
_heads.zero_grad(set_to_none=True)
_heads.load_state_dict(_ema0)                       # the EMA towers as before the first step's EMA move
_bw = accumulate(_af, _ac, _ab, DistContext(), 4)[2]
_bw()
_a4 = {n: p.grad.clone() for n, p in _named if p.grad is not None}
test_eq(set(_a4), set(_a1))
assert any(n.startswith("heads.") for n in _a1)
_err = max(float((_a4[n] - _a1[n]).abs().max() / _a1[n].abs().max()) for n in _a1 if _a1[n].abs().max() > 1e-12)
print(f"A-CLIP: {len(_a1)} gradient tensors; largest relative difference {_err:.1e}")
assert _err < 1e-10
