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
#| default_exp baselines.aclip

# %%
#| export
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from powerclip.baselines.aclip_views import color_augment, crop_boxes, crop_resize, enclosing_box
from powerclip.baselines.clip_pgs import hash_uniform
from powerclip.dist import DistContext, gather
from powerclip.loss import clip_loss
from powerclip.methods import CLIP, GlobalScorer, StepClock, register, sample_keys
from powerclip.powerset import pool_normalize

# %%
#| hide
from fastcore.test import test_close, test_eq
from torch.autograd import gradcheck
from torch.testing import assert_close


# %% [markdown]
# # A-CLIP
#
# > Attentive Mask CLIP (Yang et al., ICCV 2023).
#
# Keep the image tokens that an EMA copy of the vision encoder attends to from its class token, drop the rest before the
# vision transformer, and add two self-supervised terms between the online and the EMA encoder.

# %% [markdown]
# A-CLIP is FLIP with an informed choice of the kept tokens plus auxiliary image-only losses. Per training step
# (authors' code, `microsoft/A-CLIP`, `models.py` `ACLIP.forward`, `losses.py` `ACLIPLoss`):
#
# 1. **EMA update.** Before anything else, every parameter $\bar\theta$ of the EMA towers moves towards the
#    online one, $\bar\theta\leftarrow m\bar\theta+(1-m)\theta$, with $m$ on a cosine schedule from $m_0=0.996$ to 1
#    over the whole run (`main.py`: `cosine_scheduler(args.momentum_ema, 1, epochs, iters, 0)`).
# 2. **Scores.** The EMA vision encoder runs, without gradient and **without masking**, on a third crop that
#    encloses the two training crops. Its attention probabilities are averaged over **all layers and all heads**,
#    and row 0 (the **class-token query**) is read over the patch keys:
#    $a_j=\frac1{LH}\sum_{l,h}\mathrm{softmax}_k\big(q^{(l,h)}_{\mathrm{cls}}\cdot k^{(l,h)}_k/\sqrt{d}\big)_j$,
#    $j=1..N$ (`forward_features(..., need_attn=True)`: `attn.mean(0)[:, :, 0, 1:].mean(1)`). The query is the
#    image's own class token, **not the caption**: "semantic correlation to the text" in the abstract is the
#    claim that the class token, trained against the text, attends to what the text describes.
# 3. **Selection.** The $14\times14$ map is resampled onto each training crop (`get_mask`), averaged in $2\times2$
#    blocks (a bilinear resize to $7\times7$, which is exactly a $2\times2$ mean), and the $\lfloor 49\cdot0.5\rfloor+1=25$
#    highest blocks are kept: 100 of 196 tokens (`get_att_mask(ratio=0.5)`; `ratio` is the *kept* share). The others
#    are removed from the sequence after the positional embedding (`mask_model`), as FLIP's dropout.
# 4. **Losses.** With $z^{(v)}$ the online embeddings of the two masked crops $v=1,2$, $c^{(v)}$ the online class
#    tokens (768-d, before the image projection) and $\bar c$ the EMA class token of the enclosing crop:
#
# $$\mathcal L=\tfrac12\mathcal L_{\text{CLIP}}(z^{(1)},t)+\tfrac12\mathcal L_{\text{CLIP}}(z^{(2)},t)
#   +\underbrace{\mathcal L_{\text{SimCLR}}\big(g(c^{(1)}),g(c^{(2)})\big)}_{\tau=0.1}
#   +2\cdot\underbrace{\tfrac1{2B}\sum_{v,i}\Big(2-2\cos\big(p(h(c^{(v)}_i)),\ \mathrm{sg}\,\bar h(\bar c_i)\big)\Big)}_{\text{online}\to\text{EMA}},$$
#
# with $g$ a 3-layer MLP head (768-4096-4096-256, BatchNorm), $h$ a 2-layer projector (768-4096-256), $p$ a
# 2-layer predictor (256-4096-256) and $\bar h$ the EMA copy of $h$ (BYOL). The EMA towers cover the vision
# encoder, the image projection, $h$, and the text transformer and projection (the text EMA is used only at
# evaluation; token embedding, positional embedding and final norm are shared).
#
# ## The authors' code against the paper (what we follow)
#
# The paper body (arXiv 2212.08653) could not be read from this environment, only its abstract; the facts above
# are from the code, and where the code looks wrong we say so and do what the method evidently intends:
#
# | what | authors' code | here |
# |---|---|---|
# | SimCLR term | `aug1_embed = aug2_embed = image_ssl_embed[:bs]` (losses.py l. 48-49): view 1 against *itself*, view 2 gets no SimCLR gradient | `simclr_loss(view 1, view 2)`, the two views as the abstract's "instance contrastive learning tasks between these views" |
# | EMA crop | the union box of the two crops, randomly extended towards the image border (`GetThreeRandomResizedCrop`), with two slips: the left edge is `min(ret1[1], ret2[2])`, crop 1's *left* against crop 2's *height* (datasets.py l. 263), and the extended height is drawn from the union's height *before* the top moved up, so the box need not reach the crops' bottom (l. 270-271) | the union box, each side extended towards the border by a uniform integer amount: it always encloses both crops |
# | views | three crops of the *original* photo (two `RandomResizedCrop(224, scale=(0.5, 1))` and the EMA's), made by the data loader | made by the method, on the batch's image tensor (already at the model's size; the data pipeline is unchanged): crops resized back by bilinear interpolation, so a crop has less detail than one cut from the original photo |
# | colour augmentation | PIL/torchvision transforms on the two online views (below) | the same list as tensor operations on the de-normalised batch, per-sample parameters from hashed noise (`color_aug`, default on) |
# | masking switch | applied only if `--mask-ratio > 0`, which the README's command does not pass (default 0: no token removal) | always on in training |
# | kept order | `argsort(mask.long())` (not stable): the kept tokens' order is unspecified | ascending patch index (the positional embedding is already added, so order does not change the output; it makes runs reproducible) |
# | ties | `argsort(attention, descending=True)` (not stable) | stable: among equal scores the lower index is kept |
# | patch projection | `patch_embed.proj` frozen (`requires_grad=False`, MoCo-v3 style) in both encoders | frozen by default (`freeze_patch_embed`) |
# | heads | 768-4096-256 (ViT-B; 4096 and 256 are written out for every width) | the same at width $\ge 768$; a smaller model gets width $\to$ 4 width $\to$ its embedding dimension (`head_hidden`, `head_out` override) |
# | BatchNorm in the heads | `SyncBatchNorm` under DDP (`main.py` `get_model`), running statistics kept but never used (the heads exist only in training) | `GlobalBatchNorm`: the statistics of the **global** batch through `powerclip.dist.gather` (exactly SyncBatchNorm's, on CPU and GPU alike), no running statistics |
# | heads' precision | presumably under the training loop's mixed precision with the rest of the model (SLIP's `amp.autocast`, fp16; not checked in A-CLIP's copy) | float32 under autocast (below: rounding before BatchNorm put the heads' gradients 0.32-0.36 off float64 in bf16) |
# | EMA update | every forward (per micro-batch under gradient accumulation) | once per training step, at the start of the method's forward (accumulating: in `accum_begin`, before the first micro-batch), momentum from the trainer's step |
#
# Evaluation in the authors' code: `eval_zeroshot.py` (the downstream tables) uses the **EMA** towers
# (`encode_image(..., ema=True)`, `encode_text(..., ema=True)`); `main.py` logs both the online and the EMA
# ImageNet accuracy and selects checkpoints by the online one; linear probing (`main_linear.py`) loads the online
# `visual`. Nothing is masked at evaluation.

# %% [markdown]
# ## Class-token attention of one block
#
# open_clip's blocks call `nn.MultiheadAttention` with `need_weights=False`, so the probabilities are never
# formed. Only the class-token row is needed, and it is cheap: one query against $T=1+N$ keys per head, from the
# block's input after `ln_1` and its `in_proj` weights. A hook on each block's `ln_1` of the EMA encoder can call
# this (checked below against `nn.MultiheadAttention(need_weights=True)` and on an open_clip tower).

# %%
#| export
def cls_attention(
    x: torch.Tensor,                     # (C, T, W) a block's attention input (after ln_1), class token first
    in_proj_weight: torch.Tensor,        # (3W, W) the block's q, k, v projections stacked (nn.MultiheadAttention)
    in_proj_bias: torch.Tensor | None,   # (3W,)
    n_heads: int,
) -> torch.Tensor:                       # (C, n_heads, T) softmax over the T keys of the class-token query
    "Attention probabilities of the class token (query 0) over all tokens, per head, at least float32."
    C, T, W = x.shape
    if W % n_heads:
        raise ValueError(f"width {W} is not a multiple of {n_heads} heads")
    dh = W // n_heads
    bq = bk = None
    if in_proj_bias is not None:
        bq, bk = in_proj_bias[:W], in_proj_bias[W:2 * W]
    q = F.linear(x[:, :1], in_proj_weight[:W], bq).reshape(C, n_heads, dh)             # (C, H, dh) class query
    k = F.linear(x, in_proj_weight[W:2 * W], bk).reshape(C, T, n_heads, dh)            # (C, T, H, dh)
    dtype = torch.promote_types(q.dtype, torch.float32)
    logits = torch.einsum("chd,cthd->cht", q.to(dtype), k.to(dtype)) / math.sqrt(dh)   # (C, H, T)
    return logits.softmax(-1)


def attentive_scores(
    cls_attn: torch.Tensor,  # (L, C, H, 1 + N) class-token attention of L layers (key 0: the class token itself)
) -> torch.Tensor:           # (C, N) A-CLIP's score of each patch
    "Mean over layers and heads of the class-token attention, read over the patch keys (the class key dropped)."
    return cls_attn.mean(dim=(0, 2))[:, 1:]


# %%
_g = torch.Generator().manual_seed(0)
_C, _T, _W, _H = 3, 7, 12, 3
_mha = torch.nn.MultiheadAttention(_W, _H, batch_first=True)
_x = torch.randn(_C, _T, _W, generator=_g)
with torch.no_grad():
    _ref = _mha(_x, _x, _x, need_weights=True, average_attn_weights=False)[1][:, :, 0]   # (C, H, T)
    _a = cls_attention(_x, _mha.in_proj_weight, _mha.in_proj_bias, _H)
assert_close(_a, _ref)
assert_close(_a.sum(-1), torch.ones(_C, _H))
_L = torch.rand(4, _C, _H, _T, generator=_g).softmax(-1)                                  # 4 layers
_naive = torch.stack([torch.stack([sum(_L[l, c, h, 1 + j] for l in range(4) for h in range(_H)) / (4 * _H)
                                   for j in range(_T - 1)]) for c in range(_C)])
assert_close(attentive_scores(_L), _naive)
print("class-token attention matches nn.MultiheadAttention; scores", tuple(attentive_scores(_L).shape))

# %% [markdown]
# On an open_clip vision tower (the micro model, random weights): a hook on every block's `ln_1` collects the
# class-token rows during an ordinary forward pass; each equals what the block's own attention module returns
# when asked for its weights. This is how the Method class can read the EMA encoder's attention without
# changing open_clip.

# %%
from powerclip.model import create_model, register_configs

register_configs()
torch.manual_seed(0)
_model = create_model("powerclip-micro")[0].eval()
_blocks = _model.visual.transformer.resblocks
_rows, _ins = [], []

def _hook(block):
    def f(mod, args, y):
        _ins.append(y.detach())
        _rows.append(cls_attention(y, block.attn.in_proj_weight, block.attn.in_proj_bias, block.attn.num_heads))
    return f

_hs = [b.ln_1.register_forward_hook(_hook(b)) for b in _blocks]
with torch.no_grad():
    _model.visual(torch.randn(2, 3, 32, 32, generator=_g))
for h in _hs:
    h.remove()
assert len(_rows) == len(_blocks)
for b, y, r in zip(_blocks, _ins, _rows):
    assert b.attn.batch_first and y.shape[1] == 1 + 16                      # (C, 1 + N, width), class token first
    with torch.no_grad():
        w = b.attn(y, y, y, need_weights=True, average_attn_weights=False)[1][:, :, 0]
    assert_close(r, w, atol=1e-6, rtol=1e-5)
_sc = attentive_scores(torch.stack(_rows))
print(f"{len(_rows)} blocks, scores {tuple(_sc.shape)}, row sums {_sc.sum(-1).tolist()} (< 1: the "
      "class key's share is dropped)")


# %% [markdown]
# ## From the EMA crop to a training crop
#
# The EMA encoder sees a crop that encloses both training crops, so its score map has to be carried over to
# each training crop's grid. Boxes are `(top, left, height, width)` in pixels of the original image (the order of
# torchvision's `RandomResizedCrop.get_params`, which the authors pass along as `pos`). Each output cell takes the
# bilinear value of the source map at the cell's centre. The authors do the same in three steps (upsample the
# map to the EMA crop's pixel size, crop the training box, resize to $14\times14$); sampling at the centres
# directly gives the same values up to their integer-pixel crop.

# %%
#| export
def transfer_scores(
    scores: torch.Tensor,    # (C, gh, gw) score map on the source crop's patch grid
    src_box: torch.Tensor,   # (C, 4) source crop (top, left, height, width) in original-image pixels
    dst_box: torch.Tensor,   # (C, 4) target crop, inside the source crop
    out_hw: tuple[int, int], # (oh, ow) patch grid of the target crop
) -> torch.Tensor:           # (C, oh, ow) the source map sampled at the target cells' centres (bilinear)
    "Carry a patch-score map from one crop of an image to another crop of the same image."
    C, gh, gw = scores.shape
    oh, ow = out_hw
    src, dst = src_box.to(torch.float64), dst_box.to(torch.float64)
    ys = (torch.arange(oh, dtype=torch.float64, device=dst.device) + 0.5) / oh             # (oh,) in [0, 1] of dst
    xs = (torch.arange(ow, dtype=torch.float64, device=dst.device) + 0.5) / ow
    py = dst[:, 0, None] + ys[None] * dst[:, 2, None]                                       # (C, oh) image pixels
    px = dst[:, 1, None] + xs[None] * dst[:, 3, None]                                       # (C, ow)
    ny = 2 * (py - src[:, 0, None]) / src[:, 2, None] - 1                                   # (C, oh) in [-1, 1] of src
    nx = 2 * (px - src[:, 1, None]) / src[:, 3, None] - 1
    grid = torch.stack([nx[:, None, :].expand(C, oh, ow), ny[:, :, None].expand(C, oh, ow)], -1)  # (C, oh, ow, 2)
    x = scores[:, None].to(torch.promote_types(scores.dtype, torch.float32))
    out = F.grid_sample(x, grid.to(x.dtype), mode="bilinear", padding_mode="border", align_corners=False)
    return out[:, 0]


# %% [markdown]
# Checks: the same box is the identity; against a loop that does the bilinear interpolation by hand; a crop of a
# map that is linear in the column index gives the line's values at the crop's cells (bilinear interpolation is
# exact for linear functions away from the border).

# %%
def _naive_transfer(S, src, dst, oh, ow):
    gh, gw = S.shape
    out = torch.zeros(oh, ow, dtype=torch.float64)
    for i in range(oh):
        for j in range(ow):
            py, px = dst[0] + (i + 0.5) / oh * dst[2], dst[1] + (j + 0.5) / ow * dst[3]
            u = min(max((py - src[0]) / src[2] * gh - 0.5, 0.0), gh - 1.0)                 # source row, clamped
            v = min(max((px - src[1]) / src[3] * gw - 0.5, 0.0), gw - 1.0)
            i0, j0 = int(math.floor(u)), int(math.floor(v))
            i1, j1 = min(i0 + 1, gh - 1), min(j0 + 1, gw - 1)
            a, b = u - i0, v - j0
            out[i, j] = ((1 - a) * (1 - b) * S[i0, j0] + (1 - a) * b * S[i0, j1]
                         + a * (1 - b) * S[i1, j0] + a * b * S[i1, j1])
    return out

_S = torch.rand(2, 14, 14, generator=_g, dtype=torch.float64)
_src = torch.tensor([[10.0, 20.0, 300.0, 280.0], [0.0, 0.0, 224.0, 224.0]])
assert_close(transfer_scores(_S, _src, _src, (14, 14)), _S)
_dst = torch.tensor([[50.0, 40.0, 200.0, 150.0], [0.0, 100.0, 124.0, 124.0]])
_t = transfer_scores(_S, _src, _dst, (14, 14))
for c in range(2):
    assert_close(_t[c], _naive_transfer(_S[c], _src[c].tolist(), _dst[c].tolist(), 14, 14))
_ramp = torch.arange(14.0)[None, None].expand(1, 14, 14)                                  # value = column index
_mid = transfer_scores(_ramp, torch.tensor([[0.0, 0.0, 224.0, 224.0]]),
                       torch.tensor([[0.0, 56.0, 224.0, 112.0]]), (14, 14))
assert_close(_mid[0, 0], (56 + (torch.arange(14.0) + 0.5) * 8) / 16 - 0.5)                # the middle half of the line
print("transferred row of a ramp:", [round(v, 2) for v in _mid[0, 0].tolist()])


# %% [markdown]
# ## Attentive selection
#
# Scores are averaged over `block x block` groups of patches (the authors' $2\times2$), the
# $\min(n_b, \lfloor n_b\cdot r\rfloor+1)$ best blocks are kept ($r$ = `keep_ratio`, the authors' count: 25 of 49
# blocks for $r=0.5$), and their patches are returned in ascending row-major order, the order of open_clip's patch
# tokens. Ties go to the lower block index (a stable sort), a NaN score counts as the lowest, so the choice is a
# function of the scores alone.

# %%
#| export
def aclip_keep_count(n_blocks: int, keep_ratio: float) -> int:
    "Blocks kept out of `n_blocks`: the authors' `int(n * ratio) + 1` (25 of 49 at 0.5), at most all of them."
    if not 0 < keep_ratio <= 1:
        raise ValueError(f"keep_ratio must be in (0, 1], got {keep_ratio}")
    return min(n_blocks, int(n_blocks * keep_ratio) + 1)


def block_scores(scores: torch.Tensor, grid: tuple[int, int], block: int = 2) -> torch.Tensor:
    "scores `(C, gh * gw)` row-major -> `(C, (gh // block) * (gw // block))` mean over each block, row-major."
    gh, gw = grid
    if gh % block or gw % block:
        raise ValueError(f"grid {gh}x{gw} is not a multiple of the block size {block}")
    C = scores.shape[0]
    x = scores.reshape(C, gh // block, block, gw // block, block)                          # (C, bh, b, bw, b)
    return x.mean(dim=(2, 4)).flatten(1)


def attentive_keep(
    scores: torch.Tensor,        # (C, N) patch scores, N = gh * gw row-major
    grid: tuple[int, int],       # (gh, gw)
    keep_ratio: float = 0.5,     # kept share of blocks (the authors' `ratio`)
    block: int = 2,              # side of the blocks chosen together (the authors' 2)
) -> torch.Tensor:               # (C, n_keep * block**2) long, kept patch indices, ascending
    "A-CLIP's kept tokens: the highest-scoring blocks of patches of each image."
    gh, gw = grid
    if scores.shape[1] != gh * gw:
        raise ValueError(f"{scores.shape[1]} scores for a {gh}x{gw} grid")
    b = block_scores(scores.float(), grid, block).nan_to_num(nan=-math.inf)               # (C, nb)
    bw = gw // block
    k = aclip_keep_count(b.shape[1], keep_ratio)
    # (C, k) best first, ties: low index
    top = torch.sort(-b, dim=1, stable=True).indices[:, :k]
    # (C, k) top-left patch of the block
    r0, c0 = (top // bw) * block, (top % bw) * block
    d = torch.arange(block, device=scores.device)
    rows = r0[:, :, None, None] + d[None, None, :, None]                                    # (C, k, b, 1)
    cols = c0[:, :, None, None] + d[None, None, None, :]                                    # (C, k, 1, b)
    idx = (rows * gw + cols).flatten(1)                                                     # (C, k b^2)
    return idx.sort(dim=1).values


# %% [markdown]
# Hand cases on a $4\times4$ grid with $2\times2$ blocks ($n_b=4$, kept $\lfloor4\cdot0.5\rfloor+1=3$ blocks): the one
# block of low scores goes; with all scores equal, the last block goes (ties favour low indices); the kept set
# is the same for every monotone transform of the scores; at ViT-B/16 size 100 of 196 tokens are kept.

# %%
_s = torch.ones(2, 16)
_s[0, [10, 11, 14, 15]] = 0.0                       # image 0: bottom-right block is dull
_k = attentive_keep(_s, (4, 4))
assert _k[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13]
assert _k[1].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13]              # all equal: block 3 (bottom-right) goes
assert torch.equal(attentive_keep(_s.exp() * 3 - 1, (4, 4)), _k)           # monotone transforms keep the choice
_s2 = torch.rand(5, 196, generator=_g)
_k2 = attentive_keep(_s2, (14, 14))
assert _k2.shape == (5, 100) and (_k2.diff(dim=1) > 0).all()
# every kept block beats (or ties with a higher index) every dropped block
_bs = block_scores(_s2, (14, 14))
_kb = torch.zeros(5, 49, dtype=torch.bool)
_kb.scatter_(1, ((_k2 // 14) // 2) * 7 + (_k2 % 14) // 2, True)
assert _kb.sum(1).eq(25).all()
assert all(_bs[c][_kb[c]].min() >= _bs[c][~_kb[c]].max() for c in range(5))
assert_close(block_scores(_s2, (14, 14), 2),
             F.interpolate(_s2.reshape(5, 1, 14, 14), (7, 7), mode="bilinear").flatten(1))
assert attentive_keep(torch.full((1, 16), float("nan")), (4, 4)).shape == (1, 12)
assert aclip_keep_count(49, 0.5) == 25 and aclip_keep_count(4, 1.0) == 4
print("ViT-B/16: kept", _k2.shape[1], "of 196 tokens; the 2x2 mean equals the authors' bilinear 14 -> 7 resize")


# %% [markdown]
# ## EMA
#
# The momentum follows a cosine from $m_0$ at step 0 to 1 at the end,
# $m(s)=1-\tfrac12(1-m_0)\big(1+\cos(\pi s/S)\big)$, the authors' `cosine_scheduler(m0, 1, ...)` without warm-up.
# The update is in place, without gradient, on lists of tensors (one fused `lerp` per list): the Method class
# passes the EMA module's parameters and the online model's, in the same order, and calls it **before** the EMA
# forward pass of each step, as the authors do.

# %%
#| export
def ema_momentum(step: int, total: int, base: float = 0.996, final: float = 1.0) -> float:
    "Cosine schedule of the EMA momentum: `base` at step 0, `final` at step `total` (clamped outside [0, total])."
    if total < 1:
        raise ValueError(f"total must be >= 1, got {total}")
    s = min(max(step, 0), total)
    return final + 0.5 * (base - final) * (1 + math.cos(math.pi * s / total))


@torch.no_grad()
def ema_update_(ema: list[torch.Tensor], online: list[torch.Tensor], momentum: float) -> None:
    "In place: `e <- m * e + (1 - m) * o` for each pair (same shapes and dtypes)."
    if len(ema) != len(online):
        raise ValueError(f"{len(ema)} EMA tensors for {len(online)} online tensors")
    for e, o in zip(ema, online):
        if e.shape != o.shape or e.dtype != o.dtype:
            raise ValueError(f"EMA tensor {tuple(e.shape)} {e.dtype} does not match online {tuple(o.shape)} {o.dtype}")
    if not 0 <= momentum <= 1:
        raise ValueError(f"momentum must be in [0, 1], got {momentum}")
    if ema:
        torch._foreach_lerp_(ema, online, 1.0 - momentum)


# %% [markdown]
# Checks: the schedule's ends and midpoint; the fused update against the formula; $m=1$ freezes, $m=0$ copies;
# against a constant online model the gap shrinks as $m^t$; online parameters that require gradient are read,
# not touched, and no graph is built.

# %%
assert ema_momentum(0, 100) == 0.996 and ema_momentum(100, 100) == 1.0 and abs(ema_momentum(50, 100) - 0.998) < 1e-12
assert all(ema_momentum(s, 100) <= ema_momentum(s + 1, 100) for s in range(100))
_e = [torch.randn(3, 4, generator=_g), torch.randn(5, generator=_g)]
_o = [torch.randn(3, 4, generator=_g, requires_grad=True), torch.randn(5, generator=_g, requires_grad=True)]
_e0 = [t.clone() for t in _e]
ema_update_(_e, _o, 0.9)
for a, a0, o in zip(_e, _e0, _o):
    assert_close(a, 0.9 * a0 + 0.1 * o.detach())
    assert not a.requires_grad
_c = [t.clone() for t in _e]
ema_update_(_c, _o, 1.0)
for a, b in zip(_c, _e):
    assert torch.equal(a, b)
_c = [t.clone() for t in _e]
ema_update_(_c, _o, 0.0)
for a, o in zip(_c, _o):
    assert torch.equal(a, o.detach())
_z, _one = [torch.zeros(4, dtype=torch.float64)], [torch.ones(4, dtype=torch.float64)]
for _ in range(10):
    ema_update_(_z, _one, 0.8)
assert_close(_z[0], torch.full((4,), 1 - 0.8 ** 10, dtype=torch.float64))
try:
    ema_update_([torch.zeros(2)], [torch.zeros(3)], 0.5)
    raise AssertionError
except ValueError as e:
    print("refused:", e)


# %% [markdown]
# ## Auxiliary losses
#
# **Online to EMA (BYOL).** Each view's online prediction $p_i^{(v)}$ against the EMA target $\bar z_i$ of the same
# image (one target for all views): $\frac1{VR}\sum_{v,i}\big(2-2\cos(p^{(v)}_i,\bar z_i)\big)$, the target without
# gradient. A loss within each image: no gathering, the mean over processes is the full-batch loss.
#
# **SimCLR between the views** (SLIP's `SIMCLRLoss`, which the authors reuse): with $\hat a,\hat b$ the
# L2-normalised head outputs of views 1 and 2 and temperature $\tau$, image $i$ of view 1 is classified among all
# view-2 embeddings and all *other* view-1 embeddings, and symmetrically:
#
# $$\ell^a_i=-\log\frac{e^{\hat a_i\cdot\hat b_i/\tau}}{\sum_j e^{\hat a_i\cdot\hat b_j/\tau}+\sum_{j\ne i}e^{\hat a_i\cdot\hat a_j/\tau}},\qquad
#   \mathcal L_{\text{SimCLR}}=\frac1{2R}\sum_i(\ell^a_i+\ell^b_i).$$
#
# Data parallel as `11_loss`: local rows against gathered columns, own column at `offset + i`.

# %%
#| export
def byol_loss(
    pred: torch.Tensor,     # (V, R, D) online predictions of V views
    target: torch.Tensor,   # (R, D) EMA targets (no gradient is taken through them)
) -> torch.Tensor:          # scalar: mean over views and images of 2 - 2 cos
    "A-CLIP's online-to-EMA term (BYOL's normalised squared distance)."
    dtype = torch.promote_types(pred.dtype, torch.float32)
    p = F.normalize(pred.to(dtype), dim=-1)
    z = F.normalize(target.detach().to(dtype), dim=-1)
    return (2 - 2 * (p * z[None]).sum(-1)).mean()


def simclr_loss(
    a: torch.Tensor, b: torch.Tensor,   # (R, D) head outputs of views 1 and 2 of the local images
    tau: float = 0.1,                   # temperature (the authors' --ssl-temp)
    a_all: torch.Tensor | None = None,  # (C, D) gathered view-1 outputs (None: the local ones)
    b_all: torch.Tensor | None = None,  # (C, D) gathered view-2 outputs
    offset: int = 0,                    # index in the gathered rows of the first local image
) -> torch.Tensor:                      # scalar: (mean_i l^a_i + mean_i l^b_i) / 2 over the local rows
    "SimCLR's NT-Xent between two views, as SLIP and A-CLIP write it (other images of both views as negatives)."
    dtype = torch.promote_types(a.dtype, torch.float32)
    with torch.autocast(a.device.type, enabled=False):
        a, b = F.normalize(a.to(dtype), dim=-1), F.normalize(b.to(dtype), dim=-1)
        a_all = a if a_all is None else F.normalize(a_all.to(dtype), dim=-1)
        b_all = b if b_all is None else F.normalize(b_all.to(dtype), dim=-1)
        R = a.shape[0]
        labels = torch.arange(R, device=a.device) + offset                            # (R,) own column
        own = F.one_hot(labels, a_all.shape[0]).bool()                                 # (R, C) self-similarity
        ab, ba = a @ b_all.T / tau, b @ a_all.T / tau                                   # (R, C) other view
        aa = (a @ a_all.T / tau).masked_fill(own, -math.inf)                           # (R, C) same view, self out
        bb = (b @ b_all.T / tau).masked_fill(own, -math.inf)
        la = F.cross_entropy(torch.cat([ab, aa], 1), labels)
        lb = F.cross_entropy(torch.cat([ba, bb], 1), labels)
    return (la + lb) / 2


# %% [markdown]
# Checks of `byol_loss`: zero for aligned vectors, 4 for opposite ones, invariant to positive scaling, no
# gradient into the target, `gradcheck`. Checks of `simclr_loss`: against the formula as loops (float64, value and
# gradient), `gradcheck`, symmetric in the views, unchanged by a common permutation of the images and by scaling,
# and two simulated processes (local rows, gathered columns) average to the one-process loss.

# %%
_p = torch.randn(2, 5, 8, generator=_g, dtype=torch.float64)
_z = torch.randn(5, 8, generator=_g, dtype=torch.float64)
assert_close(byol_loss(_z[None].expand(3, -1, -1) * 2.5, _z), torch.tensor(0.0, dtype=torch.float64))
assert_close(byol_loss(-_z[None], _z), torch.tensor(4.0, dtype=torch.float64))
assert_close(byol_loss(_p * 7, _z * 0.1), byol_loss(_p, _z))
_naive_byol = (sum(2 - 2 * torch.dot(_p[v, i], _z[i]) / (_p[v, i].norm() * _z[i].norm()) for v in range(2)
                   for i in range(5)) / 10)
assert_close(byol_loss(_p, _z), _naive_byol)
_zt = _z.clone().requires_grad_()
_pt = _p.clone().requires_grad_()
byol_loss(_pt, _zt).backward()
assert _zt.grad is None and _pt.grad is not None
assert gradcheck(lambda p: byol_loss(p, _z), (_p.clone().requires_grad_(),))


def _naive_simclr(a, b, tau):
    a, b = a / a.norm(dim=-1, keepdim=True), b / b.norm(dim=-1, keepdim=True)
    R, tot = a.shape[0], 0
    for x, y in ((a, b), (b, a)):
        for i in range(R):
            den = (sum(torch.exp(x[i] @ y[j] / tau) for j in range(R))
                   + sum(torch.exp(x[i] @ x[j] / tau) for j in range(R) if j != i))
            tot = tot - torch.log(torch.exp(x[i] @ y[i] / tau) / den)
    return tot / (2 * R)

_A, _B = torch.randn(6, 5, generator=_g, dtype=torch.float64), torch.randn(6, 5, generator=_g, dtype=torch.float64)
_a1, _a2 = ((_A.clone().requires_grad_(), _B.clone().requires_grad_()),
            (_A.clone().requires_grad_(), _B.clone().requires_grad_()))
_l, _ref = simclr_loss(*_a1, 0.5), _naive_simclr(*_a2, 0.5)
assert_close(_l, _ref)
_l.backward()
_ref.backward()
for x, y in zip(_a1, _a2):
    assert_close(x.grad, y.grad)
assert gradcheck(lambda a, b: simclr_loss(a, b, 0.5), _a1, eps=1e-6, atol=1e-5)
assert_close(simclr_loss(_B, _A, 0.5), _l.detach())                                     # symmetric in the views
_perm = torch.randperm(6, generator=_g)
assert_close(simclr_loss(_A[_perm], _B[_perm], 0.5), _l.detach())                       # image order does not matter
assert_close(simclr_loss(3 * _A, 0.2 * _B, 0.5), _l.detach())                           # normalised inside
_parts = [simclr_loss(_A[s], _B[s], 0.5, _A, _B, o) for s, o in ((slice(0, 3), 0), (slice(3, 6), 3))]
assert_close(sum(_parts) / 2, _l.detach())                                             # two processes = one
# identical views (what the authors' code feeds it) against independent ones, at their tau = 0.1
print(f"simclr at tau 0.1: identical views {float(simclr_loss(_A, _A, 0.1)):.4f}, independent views "
      f"{float(simclr_loss(_A, _B, 0.1)):.4f}")

# %% [markdown]
# Finite under bf16 autocast at A-CLIP's sizes (256-d heads, a batch of 256), in float32 inside:

# %%
_A16, _B16 = torch.randn(256, 256, generator=_g).requires_grad_(), torch.randn(256, 256, generator=_g).requires_grad_()
with torch.autocast("cpu", dtype=torch.bfloat16):
    _lin = torch.nn.Linear(256, 256)
    _ls = simclr_loss(_lin(_A16), _lin(_B16))
    _lb = byol_loss(torch.stack([_lin(_A16), _lin(_B16)]), _lin(_A16))
(_ls + _lb).backward()
assert _ls.dtype == torch.float32 and torch.isfinite(_ls) and torch.isfinite(_lb) and torch.isfinite(_A16.grad).all()
print(f"bf16 autocast: simclr {float(_ls.detach()):.4f}, byol {float(_lb.detach()):.4f}")


# %% [markdown]
# ## Views and colour augmentation
#
# The three crops (two training views and the EMA's enclosing crop) and the colour augmentation of the online views are
# made from the batch's image tensor by `46a_aclip_views` (`crop_boxes`, `enclosing_box`, `crop_resize`,
# `color_augment`): torchvision's transforms as batched tensor operations, every random choice read from the hashed
# noise `hash_uniform(index, step, seed, n)`, so that a sample's views are the same on every process and after a resume.
# On the built-in world, whose captions name colours, a comparison should also run `views=1, color_aug=False` (below).

# %% [markdown]
# ## Heads with BatchNorm over the global batch
#
# The SimCLR head $g$ (Linear-BN-ReLU-Linear-BN-ReLU-Linear, with biases, SLIP's), the BYOL projector $h$ and predictor
# $p$ (Linear-BN-ReLU-Linear, no biases) normalise with BatchNorm in training mode, and the authors convert it to
# `SyncBatchNorm` under DDP: the statistics are those of the global batch. torch's `SyncBatchNorm` runs on GPUs only,
# and a per-process BatchNorm would make two processes differ from one. `GlobalBatchNorm` computes the statistics
# of the global batch itself, with gradient: each process sends its row count, mean and sum of squared deviations,
# $(n_p, m_p, M_p)$, in one `powerclip.dist.gather`, and every process combines them (Chan et al.'s parallel variance),
#
# $$N=\sum_p n_p,\qquad \mu=\frac1N\sum_p n_p m_p,\qquad \sigma^2=\frac1N\sum_p\big(M_p+n_p(m_p-\mu)^2\big),\qquad
#   y=\gamma\,\frac{x-\mu}{\sqrt{\sigma^2+\epsilon}}+\beta,$$
#
# exactly BatchNorm's training-mode output on the concatenated batch (the biased variance, $\epsilon=10^{-5}$), and the
# gather's backward returns each process the gradient of every process's loss through $\mu,\sigma^2$, as SyncBatchNorm
# does. It keeps no running statistics: the heads serve only the training losses, never evaluation. The statistics are
# in at least float32 (under bf16 autocast too). A head is applied in the method's `loss`, where the process context is
# known; the views are normalised together (the authors stack both views into one batch for the heads).
#
# **The heads compute in float32 under autocast too** (autocast is off inside `Head.forward`; the authors' heads ran
# under fp16 AMP), as open_clip computes its logits in float32: they belong to the loss. Under bf16 autocast their
# Linear layers would round the class tokens to 8 bits before the first BatchNorm, and BatchNorm then divides by the
# rows' spread. When the rows of a batch are close to one another (a model at initialisation: the smoke model's class
# tokens differ by about 6 % of their norm), that rounding is a large share of what BatchNorm keeps: on the GPU check's
# loss parity (`benchmarks/gpu_check.py`, batch 16 to 128) the gradient of the BYOL and SimCLR terms w.r.t. the class
# tokens was 0.32-0.36 off float64, and with float32 heads it is within 1e-3 (the CLIP term's rounding). It was a loss
# computed in bf16, not an inherent limit: what remains inherent is the conditioning itself. The class tokens that a
# bf16 forward pass produces carry bf16 rounding of their own, and at such a batch the loss's gradient moves by a
# comparable share when its *input* is rounded (printed below); the fix keeps the loss from adding its own. The cost
# is small: the heads (about 26 M multiply-adds per row at ViT-B) are well under 1 % of a step's matrix products.

# %%
#| export
class GlobalBatchNorm(nn.Module):
    """BatchNorm1d in training mode with the statistics of the global batch (through `powerclip.dist.gather`), no
    running stats."""
    def __init__(self, dim: int, affine: bool = True, eps: float = 1e-5):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None
        self.bias = nn.Parameter(torch.zeros(dim)) if affine else None

    def forward(self, x: torch.Tensor, ctx: DistContext) -> torch.Tensor:   # (R, dim) -> (R, dim), at least float32
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        m = xf.mean(0)                                                                 # (dim,)
        M = (xf - m).square().sum(0)                                                   # (dim,)
        # (G, 1 + 2 dim)
        s = gather(ctx, {"stats": torch.cat([xf.new_full((1,), xf.shape[0]), m, M])[None]}).all["stats"]
        n, ms, Ms = s[:, :1], s[:, 1:1 + self.dim], s[:, 1 + self.dim:]
        N = n.sum()
        mu = (n * ms).sum(0) / N
        var = (Ms + n * (ms - mu).square()).sum(0) / N
        y = (xf - mu) * torch.rsqrt(var + self.eps)
        return y if self.weight is None else y * self.weight + self.bias


class Head(nn.Module):
    "An MLP of Linear, ReLU and GlobalBatchNorm layers (the latter get the process context)."
    def __init__(self, *layers: nn.Module):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor, ctx: DistContext) -> torch.Tensor:   # (R, dim) -> (R, out), at least float32
        # at least float32 under autocast too: a bf16 Linear before a BatchNorm loses the rows' spread (see above)
        with torch.autocast(x.device.type, enabled=False):
            x = x.to(torch.promote_types(x.dtype, torch.float32))
            for l in self.layers:
                x = l(x, ctx) if isinstance(l, GlobalBatchNorm) else l(x)
        return x


def simclr_head(dim: int, hidden: int, out: int) -> Head:
    "SLIP's SimCLR head `_build_mlp`: Linear-BN-ReLU-Linear-BN-ReLU-Linear (with biases)."
    return Head(nn.Linear(dim, hidden), GlobalBatchNorm(hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                GlobalBatchNorm(hidden), nn.ReLU(), nn.Linear(hidden, out))


def byol_mlp(dim: int, hidden: int, out: int) -> Head:
    "A-CLIP's `_build_mlp_byol(2, dim, hidden, out, last_bn=False)`: Linear-BN-ReLU-Linear, no biases."
    return Head(nn.Linear(dim, hidden, bias=False), GlobalBatchNorm(hidden), nn.ReLU(),
                nn.Linear(hidden, out, bias=False))


# %% [markdown]
# Checks: in one process, `GlobalBatchNorm` is `nn.BatchNorm1d` in training mode (values and gradients, float64); the
# combination of per-part statistics equals the statistics of the whole (what two processes compute; the real
# two-process test is `tests/test_ddp.py`); the heads against the same layers written with `nn.BatchNorm1d`.

# %%
_one = DistContext()
_xb = torch.randn(10, 6, generator=_g, dtype=torch.float64) * 3 + 1
_gbn, _tbn = GlobalBatchNorm(6).double(), nn.BatchNorm1d(6, track_running_stats=False).double()
with torch.no_grad():
    for m_ in (_gbn, _tbn):
        m_.weight.copy_(torch.linspace(0.5, 2, 6))
        m_.bias.copy_(torch.linspace(-1, 1, 6))
_x1, _x2 = _xb.clone().requires_grad_(), _xb.clone().requires_grad_()
_w = torch.randn(10, 6, generator=_g, dtype=torch.float64)
(_gbn(_x1, _one) * _w).sum().backward()
(_tbn(_x2) * _w).sum().backward()
assert_close(_gbn(_xb, _one), _tbn(_xb))
assert_close(_x1.grad, _x2.grad)
assert_close(_gbn.weight.grad, _tbn.weight.grad)
_parts = [_xb[:3], _xb[3:]]                                                      # two "processes" of 3 and 7 rows
_st = torch.stack([torch.cat([torch.tensor([float(len(p))], dtype=torch.float64), p.mean(0),
                              (p - p.mean(0)).square().sum(0)]) for p in _parts])
_n = _st[:, :1]
_mu = (_n * _st[:, 1:7]).sum(0) / _n.sum()
assert_close(_mu, _xb.mean(0))
assert_close((_st[:, 7:] + _n * (_st[:, 1:7] - _mu) ** 2).sum(0) / _n.sum(), _xb.var(0, unbiased=False))
_h = simclr_head(6, 16, 4).double()
_ref = nn.Sequential(*[nn.BatchNorm1d(l.dim, track_running_stats=False) if isinstance(l, GlobalBatchNorm) else l
                       for l in _h.layers]).double()
assert_close(_h(_xb, _one), _ref(_xb))
assert byol_mlp(6, 16, 4).layers[0].bias is None and len(byol_mlp(6, 16, 4).layers) == 4
with torch.autocast("cpu", dtype=torch.bfloat16):
    _yb16 = byol_mlp(6, 16, 4)(_xb.float(), _one)
assert torch.isfinite(_yb16).all()

# %% [markdown]
# The heads' precision (above): class tokens of the micro model at initialisation (random weights, 32 images), the
# gradient of SimCLR + BYOL w.r.t. them under bf16 autocast against float64, with the heads as they are (float32
# inside), with every head layer under autocast (as before), and with the heads in float64 but the class tokens rounded
# to bf16 first (the conditioning, which no loss precision removes).

# %%
_cl = []
_hk = _model.visual.ln_post.register_forward_hook(lambda mod, args, y: _cl.append(y[:, 0] if y.dim() == 3 else y))
with torch.no_grad():
    _model.visual(torch.randn(32, 3, 32, 32, generator=_g))
_hk.remove()
_x64 = _cl[0].double()                                                       # (32, 64) class tokens, 2 views x 16
torch.manual_seed(0)
_hs = [simclr_head(64, 256, 32), byol_mlp(64, 256, 32), byol_mlp(32, 256, 32)]   # g, h, p


def _old_head(head, y):
    "A head as it was: every layer under the caller's autocast."
    for l in head.layers:
        y = l(y, _one) if isinstance(l, GlobalBatchNorm) else l(y)
    return y


def _head_loss(x, heads, old=False):
    "SimCLR + BYOL of 2 x 16 class tokens `x` (the target from the same tokens); `old`: every layer under autocast."
    run = _old_head if old else (lambda h, y: h(y, _one))
    g, h, p = heads
    s = run(g, x).reshape(2, 16, -1)
    return simclr_loss(s[0], s[1]) + byol_loss(run(p, run(h, x)).reshape(2, 16, -1), run(h, x[:16]).detach())


def _grad_err(dtype, autocast, old=False, round_in=False):
    x = (_x64.to(torch.bfloat16) if round_in else _x64).to(dtype).detach().clone().requires_grad_()
    heads = [copy.deepcopy(h).to(dtype) for h in _hs]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = _head_loss(x, heads, old)
    loss.backward()                                     # outside autocast, as the trainer does
    return x.grad.double()


_gref = _grad_err(torch.float64, False)
_err = {k: float((_grad_err(*a).double() - _gref).norm() / _gref.norm())
        for k, a in {"float32 heads (now)": (torch.float32, True), "bf16 heads (before)": (torch.float32, True, True),
                     "input rounded to bf16, float64": (torch.float64, False, False, True)}.items()}
print(f"class-token spread / norm {float(_x64.std(0).norm() / _x64.mean(0).norm()):.3f};",
      "gradient error against float64:", {k: f"{v:.1e}" for k, v in _err.items()})
assert _err["float32 heads (now)"] < 1e-4


# %% [markdown]
# ## The EMA towers
#
# `ACLIPModules` (what `build_modules` returns, trained and saved by the trainer beside the model) holds:
#
# - the EMA copies, with `requires_grad=False` (the optimiser takes only parameters that require gradient): the vision
#   tower with its projection (`visual_ema`, open_clip's `VisionTransformer`, so `visual_ema(images)` is the EMA image
#   embedding), the text transformer and projection (`transformer_ema`, `text_projection_ema`; token embedding,
#   positional embedding and final norm are the online model's, as the authors'), and the BYOL projector's copy
#   (`byol_proj_ema`);
# - the trained heads: `simclr` (two views only), `byol_proj`, `byol_pred`.
#
# `update(model, m)` moves every EMA tensor towards its online twin (`ema_update_`, one fused `lerp`), the pairs matched
# by name. `ema_attention(images)` runs the EMA vision tower without gradient and returns A-CLIP's patch scores, read by
# hooks on each block's `ln_1` (`cls_attention`, averaged over layers and heads by `attentive_scores`), and the EMA class
# token after `ln_post` (the BYOL target's input). `encode_text_ema` is open_clip's `encode_text` with the EMA transformer
# and projection.

# %%
#| export
def head_dims(width: int, embed_dim: int, hidden: int = 0, out: int = 0) -> tuple[int, int]:
    """(hidden, out) of the heads: the authors' 4096 and 256 at width >= 768; else 4 * width and the embedding dim;
    non-zero given values win."""
    h, o = (4096, 256) if width >= 768 else (4 * width, embed_dim)
    return hidden or h, out or o


class ACLIPModules(nn.Module):
    "A-CLIP's training-time modules: EMA towers (no gradient) and the SimCLR / BYOL heads (trained)."
    def __init__(self, model, views: int = 2, hidden: int = 0, out: int = 0):
        super().__init__()
        v = model.visual
        width, embed = v.transformer.width, v.output_dim
        hidden, out = head_dims(width, embed, hidden, out)
        self.visual_ema = copy.deepcopy(v)
        self.transformer_ema = copy.deepcopy(model.transformer)
        tp = model.text_projection
        self.text_projection_ema = copy.deepcopy(tp) if isinstance(tp, nn.Module) else nn.Parameter(tp.detach().clone())
        self.simclr = simclr_head(width, hidden, out) if views == 2 else None
        self.byol_proj = byol_mlp(width, hidden, out)
        self.byol_pred = byol_mlp(out, hidden, out)
        self.byol_proj_ema = copy.deepcopy(self.byol_proj)
        for p in self.ema_parameters():
            p.requires_grad_(False)

    def _pairs(self, model) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        "(name, EMA tensor, online tensor) of every parameter the EMA follows, matched by name."
        tp = model.text_projection
        mods = [(self.visual_ema, model.visual), (self.transformer_ema, model.transformer),
                (self.byol_proj_ema, self.byol_proj)]
        if isinstance(tp, nn.Module):
            mods.append((self.text_projection_ema, tp))
        out = []
        for me, mo in mods:
            e, o = dict(me.named_parameters()), dict(mo.named_parameters())
            if list(e) != list(o):
                raise ValueError(f"EMA parameters {sorted(set(e) ^ set(o))} do not match the online ones")
            out += [(n, e[n], o[n]) for n in e]
        if not isinstance(tp, nn.Module):
            out.append(("text_projection", self.text_projection_ema, tp))
        return out

    def ema_parameters(self) -> list[nn.Parameter]:
        ps = [*self.visual_ema.parameters(), *self.transformer_ema.parameters(), *self.byol_proj_ema.parameters()]
        return (ps + ([self.text_projection_ema] if isinstance(self.text_projection_ema, nn.Parameter)
                      else [*self.text_projection_ema.parameters()]))

    @torch.no_grad()
    def update(self, model, momentum: float) -> None:
        "The EMA step: every EMA tensor <- m * EMA + (1 - m) * online."
        pairs = self._pairs(model)
        ema_update_([e for _, e, _ in pairs], [o.detach() for _, _, o in pairs], momentum)

    @torch.no_grad()
    def ema_attention(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        "images (C, 3, H, W) -> A-CLIP's patch scores (C, N) and the EMA class token after ln_post (C, width)."
        v, rows, cls = self.visual_ema, [], []
        def on_ln1(b):
            return lambda mod, args, y: rows.append(cls_attention(y, b.attn.in_proj_weight, b.attn.in_proj_bias,
                                                                  b.attn.num_heads))
        hooks = [b.ln_1.register_forward_hook(on_ln1(b)) for b in v.transformer.resblocks]
        hooks.append(v.ln_post.register_forward_hook(lambda mod, args, y: cls.append(y[:, 0] if y.dim() == 3 else y)))
        try:
            v(images)
        finally:
            for h in hooks:
                h.remove()
        if len(rows) != len(v.transformer.resblocks) or len(cls) != 1:
            raise RuntimeError("EMA attention hooks fired unexpectedly")
        return attentive_scores(torch.stack(rows)), cls[0]

    def encode_text_ema(self, model, tokens: torch.Tensor) -> torch.Tensor:
        """open_clip's `encode_text` with the EMA transformer and projection (token/positional embedding, ln_final: the
        model's)."""
        from open_clip.transformer import text_global_pool
        cast = self.transformer_ema.get_cast_dtype()
        x = model.token_embedding(tokens).to(cast) + model.positional_embedding.to(cast)
        x = model.ln_final(self.transformer_ema(x, attn_mask=model.attn_mask))
        x = text_global_pool(x, tokens, model.text_pool_type, eos_token_id=getattr(model, "text_eos_id", None))
        tp = self.text_projection_ema
        return tp(x) if isinstance(tp, nn.Module) else x @ tp


# %% [markdown]
# ## The method
#
# Per training step, `ACLIP.forward(model, batch, modules)`:
#
# 1. **EMA step**: `modules.update(model, m)` with $m$ = `ema_momentum(step, total, 0.996)` from the trainer's
#    `on_step` (before anything reads the EMA, as the authors).
# 2. **Views**: with `views=2`, two crop boxes, the EMA's enclosing box, the three crops resized to the model's input
#    size; the online views colour-augmented (`color_aug`) on the de-normalised image (the model's `image_mean`,
#    `image_std`). With `views=1` (the README's "1x50%"), the batch image itself is the one online view (augmented if
#    `color_aug`) and the EMA sees it unaugmented.
# 3. **Scores**: `modules.ema_attention(EMA crop)`, carried onto each view's grid with `transfer_scores`, and the kept
#    patches `attentive_keep(..., keep_ratio, block)` (25 of 49 blocks at ViT-B/16; 3 of 4 at the micro model's
#    $4\times4$ grid, 9 of 16 at the demo model's $8\times8$).
# 4. **Online pass**: the views of all images in one batch through the vision tower inside `select_patch_tokens`, and
#    the captions once through the text tower; a hook on `ln_post` keeps each view's class token for the heads.
#
# `loss(out, batch, ctx)` then applies the heads, which `forward` hands over as `out['heads']` (their BatchNorms need the
# process context, which only `loss` receives; under DDP their parameters get their gradients all the same, as the
# two-process test checks), and returns the weighted
# terms `clip` ($\frac1V\sum_v$ CLIP of view $v$ against the texts, each gathered with gradient; the authors'
# $0.5+0.5$), `simclr` ($\tau=0.1$, weight 1, views 1 against 2) and `byol` (weight 2), and logs each view's CLIP loss,
# the momentum and the kept share. One `gather` carries the views' embeddings, the texts and the SimCLR outputs.
#
# **Gradient accumulation** (`accum_steps`, `49c_accum`) is exact for A-CLIP: what is not a function of one sample
# alone stays out of the micro-batches' forward passes. The EMA step runs once, in `accum_begin`, before the first
# micro-batch reads the EMA (forward then skips it); the heads, whose BatchNorm normalises over the global batch, run in
# `loss`, once, on the joined outputs, so their statistics are the whole batch's; the crops, colours and kept patches
# are keyed by the sample (`hash_uniform`). So the forward pass returns its per-view outputs sample-major, `image`
# `(C, V, D)` and `cls` `(C, V, width)`, which join along the rows; `loss` reads the views back out.
#
# **The paper's words and the code's.** The abstract keeps "tokens with a strong semantic correlation to the
# corresponding text"; the code (followed here) scores patches by the EMA image encoder's own class-token attention,
# never looking at the caption. The claim is that the class token, trained to match the caption, attends to what the
# caption describes; nothing in the selection enforces it, and at the start of training (random EMA weights) the
# selection is close to random.
#
# **Scoring.** `scorers(modules)` gives `'ema'` first (the authors' `eval_zeroshot.py` scores with the EMA towers),
# then `'global'` (the online model, what their checkpoint selection and linear probe read). The EMA scorer needs the
# trained modules; without them (no `method_modules.pt` beside `model.pt`) it stops with one line.
#
# **The EMA's horizon in a short run.** The momentum schedule $0.996\to1$ was set for the authors' run of about 90k
# steps (SLIP's recipe, which A-CLIP's code follows: 25 epochs of YFCC-15M at batch 4096). Squeezed into a run of $T$
# steps it averages over far more of the run: the weight an EMA still gives its initial copy after the whole cosine
# schedule is $\prod_t m_t$, which at $T=150$ is $\exp(-0.3)\approx 74\,\%$ (measured: the comparison's EMA
# scorer read near chance). `momentum_steps` rescales the schedule so that the EMA averages over the same **share** of
# the run as in the paper: $1-m_0$ becomes $(1-m_0)\,\frac{\texttt{momentum\_steps}}{T}$ (at most 1, i.e.
# $m_0 \ge 0$), with the same cosine to 1. At the paper's own length it changes nothing. Near the end of the paper's
# run the EMA's weights are on average 13 % of the run old (the mean age, over the run, of the online weights it
# averages: $1-m_t$ falls as $(\pi s/T)^2$ at $s$ steps from the end, so the last steps barely move it); rescaled,
# a run of 400 steps has the same 13 %, one of 150 steps 18 % (the cap at $m_0=0$), against 69 % unscaled (checked
# below). The comparison sets `momentum_steps=90_000` (`70_compare`);
# the default `None` keeps the authors' schedule unscaled.
#
# **Pooling.** A-CLIP pools by the class token and EOT (its paper and code; its EMA text tower, above, re-implements
# that head): it refuses `model.pool=avg` (`30_model`, "Pooling").

# %%
#| export
@dataclass
class ACLIPConfig:
    "A-CLIP's options: the authors' code (`microsoft/A-CLIP`) where it sets them."
    keep_ratio: float = 0.5          # kept share of blocks of patches (get_att_mask ratio: 25 of 49 blocks, 100 of 196
                                     # tokens)
    block: int = 2                   # side of the blocks chosen together (their 2 x 2)
    views: int = 2                   # 2: two crops + the enclosing crop for the EMA (their "2x50%"); 1: the batch image
                                     # ("1x50%")
    crop_scale: tuple = (0.5, 1.0)   # area share of the two crops (GetThreeRandomResizedCrop(224, scale=(0.5, 1.0)))
    color_aug: bool = True           # ColorJitter(0.4, 0.4, 0.2, 0.1) p 0.8, grayscale 0.2, blur 0.1, solarize 0.2
                                     # (main.py)
    momentum: float = 0.996          # EMA momentum at step 0, cosine to 1 at the end (--momentum-ema)
    momentum_steps: int | None = None  # the run length `momentum` was set for (the paper's ~90k steps): 1 - momentum
                                     # is scaled by momentum_steps / T (m0 >= 0), the EMA's horizon the same share
                                     # of the run (above); None: unscaled
    clip_weight: float = 1.0         # weight of the mean over views of the CLIP loss (their 0.5 + 0.5)
    simclr_weight: float = 1.0       # weight of SimCLR between the two views (their 1; --ssl-scale is unused)
    simclr_tau: float = 0.1          # SimCLR temperature (--ssl-temp)
    byol_weight: float = 2.0         # weight of the online-to-EMA (BYOL) term (their 2)
    head_hidden: int = 0             # hidden width of the heads; 0: 4096 at width >= 768 (theirs), else 4 * width
    head_out: int = 0                # output width of the heads; 0: 256 at width >= 768 (theirs), else the embedding
                                     # dim
    freeze_patch_embed: bool = True  # keep the patch projection at its initial weights (their MoCo-v3 trick)

    def __post_init__(self):
        self.crop_scale = tuple(self.crop_scale)
        if not 0 < self.keep_ratio <= 1:
            raise ValueError(f"keep_ratio must be in (0, 1], got {self.keep_ratio}")
        if self.block < 1:
            raise ValueError(f"block must be >= 1, got {self.block}")
        if self.views not in (1, 2):
            raise ValueError(f"views must be 1 or 2, got {self.views}")
        if len(self.crop_scale) != 2 or not 0 < self.crop_scale[0] <= self.crop_scale[1] <= 1:
            raise ValueError(f"crop_scale must be (lo, hi) with 0 < lo <= hi <= 1, got {self.crop_scale}")
        if not 0 <= self.momentum <= 1:
            raise ValueError(f"momentum must be in [0, 1], got {self.momentum}")
        if self.momentum_steps is not None and self.momentum_steps < 1:
            raise ValueError(f"momentum_steps must be at least 1 or None, got {self.momentum_steps}")
        if min(self.clip_weight, self.simclr_weight, self.byol_weight) < 0:
            raise ValueError("loss weights must be >= 0")
        if self.simclr_tau <= 0:
            raise ValueError(f"simclr_tau must be > 0, got {self.simclr_tau}")
        if self.head_hidden < 0 or self.head_out < 0:
            raise ValueError("head_hidden and head_out must be >= 0 (0: automatic)")


def _need(modules) -> ACLIPModules:
    "A-CLIP's training-time modules, or one line saying how to build them."
    if not isinstance(modules, ACLIPModules):
        raise RuntimeError("A-CLIP needs its EMA towers and heads: pass modules=method.build_modules(model)")
    return modules


_NOISE = 110   # hashed noise per sample and step: 2 x 40 crop draws, 4 for the EMA box, 2 x 13 colour draws


class EMAScorer(GlobalScorer):
    "A-CLIP's evaluation (their eval_zeroshot.py): cosine of the EMA towers' global embeddings."
    name = "ema"

    def __init__(self, modules: ACLIPModules | None):
        self.modules = modules

    def _mods(self) -> ACLIPModules:
        if self.modules is None:
            raise ValueError("A-CLIP's 'ema' scorer needs the trained EMA towers (method_modules.pt beside model.pt, "
                             "or a trainer checkpoint); none were found: evaluate with the 'global' "
                             "scorer or give the run folder")
        return self.modules

    @torch.no_grad()
    def image_features(self, model, images):
        return {"image": F.normalize(self._mods().visual_ema(images), dim=-1).float()}     # (B, D)

    @torch.no_grad()
    def text_features(self, model, tokens):
        return {"text": F.normalize(self._mods().encode_text_ema(model, tokens), dim=-1).float()}   # (B, D)

    @torch.no_grad()
    def region_features(self, model, images, masks):
        "Regions of the EMA image tower: its projected patch embeddings pooled as PowerCLIP's Eq. 2, `(B, R, D)`."
        v = self._mods().visual_ema
        x = v.forward_intermediates(images, indices=1, output_fmt="NLC",
                                    intermediates_only=True)["image_intermediates"][-1]
        return pool_normalize(v.ln_post(x) @ v.proj, masks.to(x.device)).float()

    @torch.no_grad()
    def crop_features(self, model, images):
        return self.image_features(model, images)["image"]

    @torch.no_grad()
    def class_features(self, model, tokens):
        return self.text_features(model, tokens)["text"]


@register("aclip")
class ACLIP(StepClock, CLIP):
    "A-CLIP: attentive token removal by an EMA encoder, two views, CLIP + SimCLR + BYOL losses; config `ACLIPConfig`."
    Config = ACLIPConfig
    needs_patches = False
    pools = ("tok",)       # its paper's class-token / EOT pooling, which its EMA towers re-implement

    def __init__(self, cfg=None, seed: int = 0):
        super().__init__(cfg, seed)
        self.last: dict = {}   # boxes, kept patches and scores of the last training forward pass (checks, figures)
        self._ema_moved = False   # an accumulated step's EMA step is done (by accum_begin): forward must not repeat it

    def accum_begin(self, model, micro_batches, modules=None, dist=None):
        "An accumulated step: the EMA step once, before any micro-batch reads the EMA (forward then skips it)."
        _need(modules).update(model, self.momentum)
        self._ema_moved = True

    def accum_end(self):
        self._ema_moved = False

    def setup_model(self, model) -> None:
        if self.cfg.freeze_patch_embed:
            for p in model.visual.conv1.parameters():
                p.requires_grad_(False)

    def build_modules(self, model) -> ACLIPModules:
        return ACLIPModules(model, self.cfg.views, self.cfg.head_hidden, self.cfg.head_out)


    @property
    def start_momentum(self) -> float:
        "m0 of the schedule: the config's, rescaled to this run's length when `momentum_steps` is given (above)."
        m0, ref = self.cfg.momentum, self.cfg.momentum_steps
        if ref is None or not self.total:
            return m0
        return max(0.0, 1.0 - (1.0 - m0) * ref / self.total)

    @property
    def momentum(self) -> float:
        return ema_momentum(self.step, self.total, self.start_momentum) if self.total else self.cfg.momentum

    def scorers(self, modules=None):
        return {"ema": EMAScorer(modules), "global": GlobalScorer()}

    def _views(self, model, image, u):
        "The online views (V C, 3, H, W), the EMA's input (C, 3, H, W), the boxes [(C, 4)] * V and the EMA box (C, 4)."
        cfg, (C, _, H, W) = self.cfg, image.shape
        v = model.visual
        # constants sent without waiting: a blocking copy from the host would make a GPU's host wait for the device
        mean = torch.tensor(getattr(v, "image_mean", None) or (0.48145466, 0.4578275, 0.40821073),
                            dtype=image.dtype).to(image.device, non_blocking=True)
        std = torch.tensor(getattr(v, "image_std", None) or (0.26862954, 0.26130258, 0.27577711),
                           dtype=image.dtype).to(image.device, non_blocking=True)
        full = torch.tensor([0.0, 0.0, H, W], dtype=torch.float64).to(image.device, non_blocking=True).expand(C, 4)
        if cfg.views == 2:
            boxes = [crop_boxes(u[:, 40 * i:40 * (i + 1)], (H, W), cfg.crop_scale) for i in range(2)]
            ema_box = enclosing_box(*boxes, u[:, 80:84], (H, W))
            views = [crop_resize(image, b, (H, W)) for b in boxes]
            ema_in = crop_resize(image, ema_box, (H, W))
        else:
            boxes, ema_box, views, ema_in = [full], full, [image], image
        if cfg.color_aug:
            # the model's normalisation undone
            un = lambda x: (x * std[:, None, None] + mean[:, None, None]).clamp(0, 1)
            views = [(color_augment(un(x), u[:, 84 + 13 * i:97 + 13 * i]) - mean[:, None, None]) / std[:, None, None]
                     for i, x in enumerate(views)]
        return torch.cat(views), ema_in, boxes, ema_box

    def forward(self, model, batch, modules=None):
        # late: keeps this module importable without open_clip
        from powerclip.model import encode, grid_size, select_patch_tokens
        image, tokens = batch["image"], batch["tokens"]
        if not model.visual.training:                            # evaluation: the online model, every patch
            return encode(model, image, tokens, need_patches=False)
        modules = _need(modules)
        cfg, C = self.cfg, image.shape[0]
        m = self.momentum
        if not self._ema_moved:
            modules.update(model, m)                             # 1. the EMA step, before the EMA is read
        keys = sample_keys(batch, image)
        u = hash_uniform(keys, self.step, self.seed, _NOISE)     # (C, 110)
        gh, gw = grid_size(model)
        with torch.no_grad():
            with torch.autocast(image.device.type, enabled=False):                    # pixels in the batch's precision
                views, ema_in, boxes, ema_box = self._views(model, image, u)        # 2. (V C, 3, H, W), (C, 3, H, W)
            scores, cls_ema = modules.ema_attention(ema_in)                          # 3. (C, N), (C, width)
            smap = scores.reshape(C, gh, gw)
            keep = torch.cat([attentive_keep(transfer_scores(smap, ema_box, b, (gh, gw)).flatten(1), (gh, gw),
                                             cfg.keep_ratio, cfg.block)
                              for b in boxes])                                       # (V C, K)
        cls = []
        hook = model.visual.ln_post.register_forward_hook(
            lambda mod, args, y: cls.append(y[:, 0] if y.dim() == 3 else y))
        try:
            with select_patch_tokens(model, lambda x: keep):                         # 4. the online views, selected
                img = encode(model, views, None, need_patches=False)
        finally:
            hook.remove()
        txt = encode(model, None, tokens)
        self.tick()
        self.last = dict(boxes=boxes, ema_box=ema_box, keep=keep, scores=scores, views=views, ema_in=ema_in)
        # per sample (C, V, ...): micro-batches join along the rows (`49c_accum`); the loss reads the views back out
        V = cfg.views
        return dict(image=img["image"].unflatten(0, (V, C)).transpose(0, 1), text=txt["text"],
                    logit_scale=txt["logit_scale"], cls=cls[0].unflatten(0, (V, C)).transpose(0, 1), cls_ema=cls_ema,
                    heads=modules, momentum=torch.full((), m, device=image.device),          # fills: no host copy
                    keep_ratio=torch.full((), keep.shape[1] / (gh * gw), device=image.device))

    def loss(self, out, batch, dist):
        cfg, mods = self.cfg, out["heads"]
        V, C = cfg.views, out["text"].shape[0]
        z = out["image"].transpose(0, 1)                                             # (V, C, D) each view's embeddings
        cls = out["cls"].transpose(0, 1).flatten(0, 1)                               # (V C, width) view-major
        pred = mods.byol_pred(mods.byol_proj(cls, dist), dist).reshape(V, C, -1)     # (V, C, out)
        with torch.no_grad():
            target = mods.byol_proj_ema(out["cls_ema"].detach(), dist)  # (C, out)
        send = {f"image{v}": z[v] for v in range(V)} | {"text": out["text"]}
        if V == 2:
            ssl = mods.simclr(cls, dist).reshape(2, C, -1)                           # (2, C, out)
            send |= {"ssl1": ssl[0], "ssl2": ssl[1]}
        g = gather(dist, send)
        a = g.all
        clips = [clip_loss(z[v], out["text"], out["logit_scale"], a[f"image{v}"], a["text"], g.offset)
                 for v in range(V)]
        terms = {"clip": cfg.clip_weight * sum(clips) / V, "byol": cfg.byol_weight * byol_loss(pred, target)}
        if V == 2:
            terms["simclr"] = (cfg.simclr_weight
                               * simclr_loss(ssl[0], ssl[1], cfg.simclr_tau, a["ssl1"], a["ssl2"], g.offset))
        terms |= {f"_clip_view{v + 1}": c.detach() for v, c in enumerate(clips)}
        terms |= {"_momentum": out["momentum"], "_keep_ratio": out["keep_ratio"],
                  "_logit_scale": out["logit_scale"].detach()}
        return terms


# %% [markdown]
# The EMA's horizon (above): the share of the initial weights left in the EMA after a run, and the mean age of the
# online weights it averages, as a share of the run, for the authors' run, for a 150-step run unscaled, and rescaled.

# %%
def _ema_age(T: int, m0: float) -> tuple[float, float]:
    "(initial weights' share, mean age / T) of the EMA at the end of a T-step run whose momentum goes m0 -> 1."
    m = torch.tensor([ema_momentum(t, T, m0) for t in range(T)], dtype=torch.float64)    # (T,) update t uses m_t
    later = torch.cat([m.flip(0).cumprod(0).flip(0)[1:], torch.ones(1, dtype=torch.float64)])   # prod_{s > t} m_s
    w = (1 - m) * later                                                                  # the weight of step t's online
    return float(m.prod()), float((w * (T - torch.arange(T))).sum() / w.sum() / T)

_a = ACLIP(ACLIPConfig(momentum_steps=90_000))
_a.on_step(0, 150)
test_eq((_a.start_momentum, _a.momentum), (0.0, 0.0))                                   # capped: m0 = 0 at T = 150
_a.on_step(0, 90_000)
test_close(_a.start_momentum, 0.996, eps=1e-12)                   # the paper's length: unchanged
_a.on_step(0, 400)
test_close(_a.start_momentum, 1 - 0.004 * 90_000 / 400, eps=1e-12)
test_eq(ACLIP(ACLIPConfig()).start_momentum, 0.996)                                     # None: the authors' schedule
_paper, _short, _scaled = _ema_age(90_000, 0.996), _ema_age(150, 0.996), _ema_age(150, 0.0)
test_close(_short[0], 0.739, eps=1e-3)                                                  # 74 % initial weights unscaled
assert _paper[0] < 1e-50 and _scaled[0] == 0.0
test_close((_paper[1], _ema_age(400, 1 - 0.004 * 90_000 / 400)[1]), (0.135, 0.134), eps=2e-3)   # the same share
test_close((_short[1], _scaled[1]), (0.687, 0.179), eps=2e-3)
print(f"mean age / T: paper {_paper[1]:.3f}, T = 150 unscaled {_short[1]:.3f}, rescaled {_scaled[1]:.3f}")

# %% [markdown]
# ### Checks on a model
#
# The micro model (32 px, 8-px patches, a $4\times4$ grid, width 64, random weights): the registry and the config; the
# patch projection frozen; the modules (EMA copies without gradient, heads 64-256-32); in training the vision tower sees
# $2C$ views of $1+12$ tokens (3 of 4 blocks), the EMA scores are the layer- and head-mean of the class-token attention
# that `nn.MultiheadAttention` itself returns; the EMA step is $m\bar\theta+(1-m)\theta$ at the trainer's momentum; the
# loss terms equal the formulas recomputed from the outputs; gradients reach the model and the heads, never the EMA
# copies; the same (seed, step, index) give the same loss; evaluation is the plain online model.

# %%
from powerclip.data import BatchNeeds
from powerclip.methods import METHODS, get_method
from powerclip.model import encode

assert METHODS["aclip"] is ACLIP and get_method("aclip").needs() == BatchNeeds()
for bad in ({"views": 3}, {"keep_ratio": 0.0}, {"crop_scale": [0.6, 0.5]}, {"momentum": 1.5}):
    try:
        get_method("aclip", bad)
        raise AssertionError(bad)
    except ValueError as e:
        print("refused:", e)
assert get_method("aclip", {"crop_scale": [0.4, 1.0]}).cfg.crop_scale == (0.4, 1.0)   # YAML lists become tuples
assert head_dims(768, 512) == (4096, 256) and head_dims(64, 32) == (256, 32) and head_dims(64, 32, 100) == (100, 32)

torch.manual_seed(0)
_model = create_model("powerclip-micro")[0]
_keys = set(_model.state_dict())
_am = get_method("aclip", seed=3)
_am.setup_model(_model)
_mods = _am.build_modules(_model)
assert not _model.visual.conv1.weight.requires_grad and set(_model.state_dict()) == _keys
assert (not any(p.requires_grad for p in _mods.ema_parameters())
        and all(p.requires_grad for p in _mods.byol_pred.parameters()))
assert [l.out_features for l in _mods.simclr.layers if isinstance(l, nn.Linear)] == [256, 256, 32]
assert {n.split(".")[0] for n, p in _mods.named_parameters() if p.requires_grad} == {"simclr", "byol_proj", "byol_pred"}
_img = torch.randn(4, 3, 32, 32, generator=_g)
_tok = torch.zeros(4, 77, dtype=torch.long)
_tok[:, 0], _tok[:, 1:4], _tok[:, 4] = 49406, torch.arange(100, 112).reshape(4, 3), 49407
_batch = {"image": _img, "tokens": _tok, "index": torch.tensor([5, 6, 7, 8])}

# EMA scores against nn.MultiheadAttention's own weights, and the EMA class token against open_clip's pooled output
with torch.no_grad():
    _sc, _ce = _mods.ema_attention(_img)
    _ws = []
    _hk = [b.ln_1.register_forward_hook(lambda mod, a, y, b=b: _ws.append(
               b.attn(y, y, y, need_weights=True, average_attn_weights=False)[1][:, :, 0]))
           for b in _mods.visual_ema.transformer.resblocks]
    _pooled = _mods.visual_ema(_img)
    for h in _hk:
        h.remove()
assert_close(_sc, torch.stack(_ws).mean(dim=(0, 2))[:, 1:])
assert_close(_ce @ _mods.visual_ema.proj, _pooled)

# a training step: tokens seen, the EMA step, the loss terms, the gradients
_seen = []
_hk = _model.visual.ln_pre.register_forward_hook(lambda mod, args, y: _seen.append(tuple(args[0].shape)))
# move the online model away from its EMA copy, to see the EMA step
with torch.no_grad():
    for p in _model.parameters():
        p.add_(0.01 * torch.randn(p.shape, generator=_g))
_before = {n: e.detach().clone() for n, e, _ in _mods._pairs(_model)}
_snap = copy.deepcopy((_model.state_dict(), _mods.state_dict()))
_model.train()
_mods.train()
_am.on_step(40, 100)
_out = _am.forward(_model, _batch, _mods)
_hk.remove()
_mom = ema_momentum(40, 100)
assert abs(float(_out["momentum"]) - _mom) < 1e-7
for n, e, o in _mods._pairs(_model):
    assert_close(e, _mom * _before[n] + (1 - _mom) * o.detach())
# 2 views x 4 images, 12 of 16 patches
assert _seen == [(8, 1 + 12, 64)], _seen
assert _out["image"].shape == (4, 2, 32) and _out["cls"].shape == (4, 2, 64) and _out["cls_ema"].shape == (4, 64)
_terms = _am.loss(_out, _batch, DistContext())
# the terms, recomputed from the outputs
_z = _out["image"].transpose(0, 1)                                                     # (2 views, 4, 32)
_cv = _out["cls"].transpose(0, 1).flatten(0, 1)                                         # (2 x 4, 64) view-major
_c = [clip_loss(_z[v], _out["text"], _out["logit_scale"]) for v in range(2)]
assert_close(_terms["clip"], (_c[0] + _c[1]) / 2)
_ss = _mods.simclr(_cv, DistContext()).reshape(2, 4, -1)
assert_close(_terms["simclr"], simclr_loss(_ss[0], _ss[1], 0.1))
_pr = _mods.byol_pred(_mods.byol_proj(_cv, DistContext()), DistContext()).reshape(2, 4, -1)
assert_close(_terms["byol"], 2 * byol_loss(_pr, _mods.byol_proj_ema(_out["cls_ema"], DistContext())))
(_terms["clip"] + _terms["simclr"] + _terms["byol"]).backward()
assert (_model.visual.transformer.resblocks[0].attn.in_proj_weight.grad is not None
        and _model.visual.conv1.weight.grad is None)
assert all(p.grad is not None for n, p in _mods.named_parameters() if p.requires_grad)
assert all(p.grad is None for p in _mods.ema_parameters())
print({k: round(float(v.detach()), 4) for k, v in _terms.items()})

# deterministic in (seed, step, index): from the same weights, the same step gives the same views, patches and loss
_kp, _b40 = _am.last["keep"], _am.last["boxes"][0]
_model.load_state_dict(_snap[0])
_mods.load_state_dict(_snap[1])
_am.on_step(40, 100)
_terms2 = _am.loss(_am.forward(_model, _batch, _mods), _batch, DistContext())
assert (torch.equal(_am.last["keep"], _kp)
        and all(torch.equal(_terms2[k], _terms[k].detach()) for k in ("clip", "simclr", "byol")))
_am.on_step(41, 100)
_am.forward(_model, _batch, _mods)
assert not torch.equal(_am.last["boxes"][0], _b40)                                     # another step, other crops
# evaluation: the plain online model
_model.eval()
with torch.no_grad():
    _ev, _ref = _am.forward(_model, _batch, _mods), encode(_model, _img, _tok, need_patches=False)
assert torch.equal(_ev["image"], _ref["image"]) and isinstance(_model.visual.patch_dropout, nn.Identity)

# %% [markdown]
# With `views=1` (the README's "1x50%"): no SimCLR head and no SimCLR term, one view per image (the batch image,
# here without colour augmentation), the EMA sees the same image and the kept patches are the best blocks of its
# scores directly. The scorers: with fresh modules (EMA = online) the EMA scorer gives the global scorer's scores; the
# EMA scorer without modules stops with one line. bf16 autocast: finite, close to float32.

# %%
_a1 = get_method("aclip", {"views": 1, "color_aug": False}, seed=3)
_m1 = create_model("powerclip-micro")[0]
_a1.setup_model(_m1)
_md1 = _a1.build_modules(_m1)
_m1.train()
_md1.train()
assert _md1.simclr is None
_o1 = _a1.forward(_m1, _batch, _md1)
assert torch.equal(_a1.last["views"], _img) and torch.equal(_a1.last["ema_in"], _img)
assert torch.equal(_a1.last["keep"], attentive_keep(_a1.last["scores"], (4, 4)))
_t1 = _a1.loss(_o1, _batch, DistContext())
assert set(k for k in _t1 if not k.startswith("_")) == {"clip", "byol"} and "_clip_view2" not in _t1
(_t1["clip"] + _t1["byol"]).backward()
print({k: round(float(v.detach()), 4) for k, v in _t1.items()})

_m1.eval()
_md1.eval()
_sc1 = _a1.scorers(_md1)
assert list(_sc1) == ["ema", "global"]
_ids = torch.zeros(3, 77, dtype=torch.long)
_ids[:, 0], _ids[:, 1:3], _ids[:, 3] = 49406, torch.arange(300, 306).reshape(3, 2), 49407
_fresh = ACLIPModules(_m1, 1).eval()                                                     # EMA = online
_se, _sg = EMAScorer(_fresh), _sc1["global"]
assert_close(_se.scores(_se.image_features(_m1, _img), _se.text_features(_m1, _ids)),
             _sg.scores(_sg.image_features(_m1, _img), _sg.text_features(_m1, _ids)))
try:
    _a1.scorers(None)["ema"].image_features(_m1, _img)
    raise AssertionError
except ValueError as e:
    assert "\n" not in str(e)
    print("refused:", e)

_model.train()
_mods.train()
_am.on_step(7, 100)
_l32 = _am.loss(_am.forward(_model, _batch, _mods), _batch, DistContext())
with torch.autocast("cpu", dtype=torch.bfloat16):
    _am.on_step(7, 100)
    _l16 = _am.loss(_am.forward(_model, _batch, _mods), _batch, DistContext())
for k in ("clip", "simclr", "byol"):
    a, b = float(_l16[k].detach()), float(_l32[k].detach())
    assert math.isfinite(a) and abs(a - b) < 0.05 * abs(b) + 0.02, (k, a, b)
print("fp32:", {k: round(float(_l32[k].detach()), 4) for k in ("clip", "simclr", "byol")},
      " bf16:", {k: round(float(_l16[k].detach()), 4) for k in ("clip", "simclr", "byol")})
_model.eval();
