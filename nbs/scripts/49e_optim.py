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
#| default_exp optim

# %%
#| export
from __future__ import annotations

import math

import torch

from powerclip.config import OptimConfig

# %%
#| hide
from fastcore.test import test_eq

from powerclip.model import create_model


# %% [markdown]
# # Optimiser and schedule
#
# > AdamW with weight decay on the weight matrices only, and its warm-up and cosine learning-rate schedule.
#
# AdamW with weight decay on the weight matrices only, none on biases, norm gains, the temperature and the embeddings
# (positional, class, token). **A choice between open_clip's two rules**: `open_clip_train`'s AdamW exempts tensors
# under 2-D and names holding `bn`, `ln`, `bias` or `logit_scale`, so it decays the 2-D token and positional
# embeddings; open_clip's models declare the positional embeddings and the class token exempt (`no_weight_decay()`, what
# its timm-optimizer path reads), as timm's ViTs do. We exempt those, and the token embedding too (an embedding is a
# lookup table, not a map whose scale decay should bound). The choice is the same for every method and every row, so it
# moves no comparison; the check below names where it parts from each rule. The learning rate rises linearly over
# `warmup_steps`, then follows a cosine to `min_lr` at the last step.
#
# With the peak rate $\eta$ (`lr`), $W$ warm-up steps, $T$ steps in all and $r = $ `min_lr` $/\,\eta$, step $s$
# (counted from 0) runs at the rate $\eta\,f(s)$, where
#
# $$f(s) = \frac{s+1}{W} \quad (s < W), \qquad
# f(s) = r + \frac{1-r}{2}\Big(1 + \cos\big(\pi\,\min(1, \tfrac{s-W}{T-W})\big)\Big) \quad (s \ge W).$$
#
# `lr_factor` is $f$; `make_scheduler` multiplies every parameter group's peak rate by it. The trainer's `build_run`
# (`50_train`) makes both from the run's `optim` section, with a method's own modules (`Method.modules_lr`) at their
# own peak rate.

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
        if mod is None:
            continue
        wd = getattr(mod, "weight_decay", None) if mod is modules else None
        decay, rest = [], []
        for n, p in mod.named_parameters():
            if p.requires_grad:
                (rest if no_decay(n, p) else decay).append(p)
        groups += [dict(params=decay, weight_decay=cfg.weight_decay if wd is None else wd, lr=lr),
                   dict(params=rest, weight_decay=0.0, lr=lr)]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)


def lr_factor(step: int, total: int, warmup: int, min_ratio: float = 0.0) -> float:
    "Multiplier of the peak lr at `step` (0-based): linear warm-up, then cosine down to `min_ratio`."
    if step < warmup:
        return (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))


def make_scheduler(opt, cfg: OptimConfig, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    ratio = cfg.min_lr / cfg.lr if cfg.lr > 0 else 0.0
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, total, cfg.warmup_steps, ratio))


# %%
_m, _, _ = create_model("powerclip-micro")
_opt = make_optimizer(_m, OptimConfig())
_nd = {n for n, p in _m.named_parameters() if no_decay(n, p)}
assert {"logit_scale", "positional_embedding", "token_embedding.weight", "visual.class_embedding"} <= _nd
assert not any(n.endswith("attn.in_proj_weight") or n.endswith("mlp.c_fc.weight") for n in _nd)
_oc = lambda n, p: p.ndim < 2 or "bn" in n or "ln" in n or "bias" in n or "logit_scale" in n   # open_clip_train/main.py
_oc_nd = {n for n, p in _m.named_parameters() if _oc(n, p)}
test_eq((sorted(_nd - _oc_nd), _oc_nd - _nd), (["positional_embedding", "token_embedding.weight",
                                                 "visual.positional_embedding"], set()))   # where the rules part
test_eq(_nd - _oc_nd - _m.no_weight_decay(), {"token_embedding.weight"})                  # and from the model's own
print(f"{len(_opt.param_groups[0]['params'])} tensors with weight decay, {len(_nd)} without")
_f = [lr_factor(s, 100, 10) for s in range(100)]
assert _f[0] == 0.1 and _f[9] == 1.0 and abs(_f[-1]) < 1e-3 and all(a >= b for a, b in zip(_f[9:], _f[10:]))
