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
#| default_exp baselines.flip

# %%
#| export
from __future__ import annotations

from dataclasses import dataclass

import torch

from powerclip.methods import CLIP, StepClock, hash_uniform, register, sample_keys

# %%
#| hide
from torch.testing import assert_close


# %% [markdown]
# # FLIP
#
# > Fast language-image pre-training (Li et al., CVPR 2023).
#
# CLIP's loss on images of which a random half of the patches is dropped before the vision transformer, in training only.

# %% [markdown]
# FLIP changes the forward pass, not the loss: after the patch and position embeddings, each training image keeps
# a uniformly random subset of $\lfloor N(1-\rho)\rfloor$ of its $N$ patch tokens (the class token always stays),
# and the transformer runs on those only; at evaluation nothing is dropped. The paper's main setting is
# $\rho=0.5$. The method's `forward` runs `encode` inside `powerclip.model.select_patch_tokens` with `random_keep`,
# which keeps the patches by open_clip's `PatchDropout` rule (the top-$k$ of random noise), in training mode only;
# outside its forward the model is plain open_clip. The noise is keyed by the sample: `hash_uniform(index, step,
# seed)` (`40_methods`), as CLIP-PGS and E-CLIP draw theirs, not Gaussian noise from the process's global stream. A
# sample's kept patches are then the same on any process, in any batch, and in both passes of an accumulated step
# (`49c_accum`), which replays a micro-batch without saving a random state. (Before this, the draws came from the
# global stream: a FLIP run's numbers changed with the switch, not its distribution: each patch is kept with
# probability $1-\rho$, every subset of $k$ equally likely.) Not done:
# FLIP's short unmasked tuning at the end of training (train a few steps more with `ratio=0`, i.e. the `clip`
# method, from the checkpoint).
#
# The kept patches are off the grid, so FLIP cannot be combined with a loss that needs patches; the method asks
# for none.

# %%
#| export
@dataclass
class FLIPConfig:
    ratio: float = 0.5  # fraction of patch tokens dropped per training image (FLIP: 0.5); 0 gives CLIP

    def __post_init__(self):
        if not 0 <= self.ratio < 1:
            raise ValueError(f"ratio must be in [0, 1), got {self.ratio}")


def random_keep(x: torch.Tensor, ratio: float, noise: torch.Tensor | None = None) -> torch.Tensor:
    """x `(C, 1 + N, width)` (class token first) -> `(C, K)` indices of K = max(1, int(N (1 - ratio))) patches per
    image, uniformly at random: open_clip's `PatchDropout` rule (the top-K of noise). `noise` `(C, N)` (FLIP's: keyed
    by sample); None: Gaussian noise from the global stream, open_clip's own draw."""
    C, N = x.shape[0], x.shape[1] - 1
    k = max(1, int(N * (1 - ratio)))
    if noise is None:
        noise = torch.randn(C, N, device=x.device)
    return noise[:, :N].to(x.device).topk(k, dim=-1).indices              # (C, K)


@register("flip")
class FLIP(StepClock, CLIP):
    "FLIP: CLIP's loss with random patch dropout in the vision tower during training, config `FLIPConfig`."
    Config = FLIPConfig
    needs_patches = False

    def forward(self, model, batch, modules=None):
        from powerclip.model import encode, select_patch_tokens  # late: keeps this module importable without open_clip
        if not model.visual.training or self.cfg.ratio == 0:    # evaluation: every patch
            return encode(model, batch["image"], batch["tokens"], need_patches=False)
        image = batch["image"]
        keys = sample_keys(batch, image)
        n = model.visual.grid_size[0] * model.visual.grid_size[1]
        noise = hash_uniform(keys, self.step, self.seed, n)                 # (C, N), a function of the sample
        with select_patch_tokens(model, lambda x: random_keep(x, self.cfg.ratio, noise)):
            out = encode(model, image, batch["tokens"], need_patches=False)
        self.tick()
        return out


# %% [markdown]
# ## Checks
#
# `random_keep` keeps exactly $\lfloor N(1-\rho)\rfloor$ distinct patches per image, each patch equally often, and
# with the same random state (no noise given) it keeps the same tokens as open_clip's `PatchDropout`; with FLIP's
# keyed noise each patch is kept equally often too.

# %%
from open_clip.transformer import PatchDropout
from powerclip.methods import METHODS, get_method
from powerclip.model import PatchTokenSelect

assert METHODS["flip"] is FLIP
try:
    get_method("flip", {"ratio": 1.0})
    raise AssertionError
except ValueError as e:
    print(e)

_B, _N = 4000, 16
_x = torch.arange(1 + _N, dtype=torch.float32)[None, :, None].expand(_B, -1, 1)  # token t carries the value t
torch.manual_seed(0)
_kept = PatchTokenSelect(lambda x: random_keep(x, 0.5))(_x)[..., 0]          # (B, 1 + 8)
assert _kept.shape == (_B, 1 + 8) and (_kept[:, 0] == 0).all()               # the class token stays first
assert all(len(set(r.tolist())) == 8 for r in _kept[:200, 1:])              # distinct patches
_freq = torch.bincount(_kept[:, 1:].long().flatten(), minlength=1 + _N)[1:] / _B
print("keep frequency per patch:", [round(float(f), 3) for f in _freq])
assert (_freq - 0.5).abs().max() < 0.04                                      # 4000 draws: std ~ 0.008
torch.manual_seed(0)
assert torch.equal(PatchDropout(0.5).train()(_x)[..., 0], _kept)            # open_clip's rule, token for token
_hk = PatchTokenSelect(lambda x: random_keep(x, 0.5, hash_uniform(torch.arange(_B), 0, 0, _N)))(_x)[..., 0]
_hf = torch.bincount(_hk[:, 1:].long().flatten(), minlength=1 + _N)[1:] / _B
assert (_hf - 0.5).abs().max() < 0.04 and all(len(set(r.tolist())) == 8 for r in _hk[:200, 1:])

# %% [markdown]
# On a real (micro, random-weight) model: the vision transformer sees $1+N/2$ tokens in training and $1+N$ in
# evaluation, evaluation gives the same embeddings as the model itself, and the model is left as it was.

# %%
from powerclip.dist import DistContext
from powerclip.model import create_model, encode, register_configs

register_configs()
torch.manual_seed(0)
_model = create_model("powerclip-micro")[0]
_img, _tok = torch.randn(3, 3, 32, 32), torch.zeros(3, 77, dtype=torch.long)
_tok[:, 0], _tok[:, 1:4], _tok[:, 4] = 49406, 100, 49407
_model.eval()
with torch.no_grad():
    _ref = encode(_model, _img, _tok, need_patches=False)

_m = get_method("flip")
_seen = []
# right after the selection
_h = _model.visual.ln_pre.register_forward_hook(lambda mod, args, y: _seen.append(y.shape[1]))
_N = _model.visual.grid_size[0] * _model.visual.grid_size[1]
_model.train()
_out = _m.forward(_model, {"image": _img, "tokens": _tok})
_model.eval()
with torch.no_grad():
    _ev = _m.forward(_model, {"image": _img, "tokens": _tok})
_h.remove()
assert _seen == [1 + _N // 2, 1 + _N], _seen
assert_close(_ev["image"], _ref["image"])
assert_close(_ev["text"], _ref["text"])
assert isinstance(_model.visual.patch_dropout, torch.nn.Identity)              # nothing left installed
_terms = _m.loss(_out, {}, DistContext())
_terms["clip"].backward()
assert torch.isfinite(_terms["clip"]) and _model.visual.conv1.weight.grad is not None
print(f"tokens into the vision transformer: train {_seen[0]}, eval {_seen[1]} (N = {_N}); loss "
      f"{float(_terms['clip'].detach()):.4f}")
