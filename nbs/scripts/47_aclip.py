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

import math

import torch
import torch.nn.functional as F

# %%
#| hide
from torch.autograd import gradcheck
from torch.testing import assert_close


# %% [markdown]
# # A-CLIP
#
# > Attentive Mask CLIP (Yang et al., ICCV 2023): keep the image tokens that an EMA copy of the vision encoder attends to from its class token, drop the rest before the vision transformer, and add two self-supervised terms between the online and the EMA encoder.

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
# | EMA crop | `ret3[1] = min(ret1[1], ret2[2])` (datasets.py l. 263): the left edge mixes crop 1's *left* with crop 2's *height* | not a tensor function here; `transfer_scores` only needs the boxes, whatever the data pipeline draws |
# | masking switch | applied only if `--mask-ratio > 0`, which the README's command does not pass (default 0: no token removal) | always on in training |
# | kept order | `argsort(mask.long())` (not stable): the kept tokens' order is unspecified | ascending patch index (the positional embedding is already added, so order does not change the output; it makes runs reproducible) |
# | ties | `argsort(attention, descending=True)` (not stable) | stable: among equal scores the lower index is kept |
# | patch projection | `patch_embed.proj` frozen (`requires_grad=False`, MoCo-v3 style) | a choice for the Method class, noted here |
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
    if W % n_heads: raise ValueError(f"width {W} is not a multiple of {n_heads} heads")
    dh = W // n_heads
    bq = bk = None
    if in_proj_bias is not None: bq, bk = in_proj_bias[:W], in_proj_bias[W:2 * W]
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
with torch.no_grad(): _model.visual(torch.randn(2, 3, 32, 32, generator=_g))
for h in _hs: h.remove()
assert len(_rows) == len(_blocks)
for b, y, r in zip(_blocks, _ins, _rows):
    assert b.attn.batch_first and y.shape[1] == 1 + 16                      # (C, 1 + N, width), class token first
    with torch.no_grad():
        w = b.attn(y, y, y, need_weights=True, average_attn_weights=False)[1][:, :, 0]
    assert_close(r, w, atol=1e-6, rtol=1e-5)
_sc = attentive_scores(torch.stack(_rows))
print(f"{len(_rows)} blocks, scores {tuple(_sc.shape)}, row sums {_sc.sum(-1).tolist()} (< 1: the class key's share is dropped)")


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
    ys = (torch.arange(oh, dtype=torch.float64) + 0.5) / oh                                # (oh,) in [0, 1] of dst
    xs = (torch.arange(ow, dtype=torch.float64) + 0.5) / ow
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
for c in range(2): assert_close(_t[c], _naive_transfer(_S[c], _src[c].tolist(), _dst[c].tolist(), 14, 14))
_ramp = torch.arange(14.0)[None, None].expand(1, 14, 14)                                  # value = column index
_mid = transfer_scores(_ramp, torch.tensor([[0.0, 0.0, 224.0, 224.0]]), torch.tensor([[0.0, 56.0, 224.0, 112.0]]), (14, 14))
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
    if not 0 < keep_ratio <= 1: raise ValueError(f"keep_ratio must be in (0, 1], got {keep_ratio}")
    return min(n_blocks, int(n_blocks * keep_ratio) + 1)


def block_scores(scores: torch.Tensor, grid: tuple[int, int], block: int = 2) -> torch.Tensor:
    "scores `(C, gh * gw)` row-major -> `(C, (gh // block) * (gw // block))` mean over each block, row-major."
    gh, gw = grid
    if gh % block or gw % block: raise ValueError(f"grid {gh}x{gw} is not a multiple of the block size {block}")
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
    if scores.shape[1] != gh * gw: raise ValueError(f"{scores.shape[1]} scores for a {gh}x{gw} grid")
    b = block_scores(scores.float(), grid, block).nan_to_num(nan=-math.inf)               # (C, nb)
    bw = gw // block
    k = aclip_keep_count(b.shape[1], keep_ratio)
    top = torch.sort(-b, dim=1, stable=True).indices[:, :k]                                 # (C, k) best first, ties: low index
    r0, c0 = (top // bw) * block, (top % bw) * block                                        # (C, k) top-left patch of the block
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
_s = torch.ones(2, 16); _s[0, [10, 11, 14, 15]] = 0.0                       # image 0: bottom-right block is dull
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
assert_close(block_scores(_s2, (14, 14), 2), F.interpolate(_s2.reshape(5, 1, 14, 14), (7, 7), mode="bilinear").flatten(1))
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
    if total < 1: raise ValueError(f"total must be >= 1, got {total}")
    s = min(max(step, 0), total)
    return final + 0.5 * (base - final) * (1 + math.cos(math.pi * s / total))


@torch.no_grad()
def ema_update_(ema: list[torch.Tensor], online: list[torch.Tensor], momentum: float) -> None:
    "In place: `e <- m * e + (1 - m) * o` for each pair (same shapes and dtypes)."
    if len(ema) != len(online): raise ValueError(f"{len(ema)} EMA tensors for {len(online)} online tensors")
    for e, o in zip(ema, online):
        if e.shape != o.shape or e.dtype != o.dtype:
            raise ValueError(f"EMA tensor {tuple(e.shape)} {e.dtype} does not match online {tuple(o.shape)} {o.dtype}")
    if not 0 <= momentum <= 1: raise ValueError(f"momentum must be in [0, 1], got {momentum}")
    if ema: torch._foreach_lerp_(ema, online, 1.0 - momentum)


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
for a, a0, o in zip(_e, _e0, _o): assert_close(a, 0.9 * a0 + 0.1 * o.detach()); assert not a.requires_grad
_c = [t.clone() for t in _e]; ema_update_(_c, _o, 1.0)
for a, b in zip(_c, _e): assert torch.equal(a, b)
_c = [t.clone() for t in _e]; ema_update_(_c, _o, 0.0)
for a, o in zip(_c, _o): assert torch.equal(a, o.detach())
_z, _one = [torch.zeros(4, dtype=torch.float64)], [torch.ones(4, dtype=torch.float64)]
for _ in range(10): ema_update_(_z, _one, 0.8)
assert_close(_z[0], torch.full((4,), 1 - 0.8 ** 10, dtype=torch.float64))
try: ema_update_([torch.zeros(2)], [torch.zeros(3)], 0.5); raise AssertionError
except ValueError as e: print("refused:", e)

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
_naive_byol = sum(2 - 2 * torch.dot(_p[v, i], _z[i]) / (_p[v, i].norm() * _z[i].norm()) for v in range(2) for i in range(5)) / 10
assert_close(byol_loss(_p, _z), _naive_byol)
_zt = _z.clone().requires_grad_(); _pt = _p.clone().requires_grad_()
byol_loss(_pt, _zt).backward()
assert _zt.grad is None and _pt.grad is not None
assert gradcheck(lambda p: byol_loss(p, _z), (_p.clone().requires_grad_(),))


def _naive_simclr(a, b, tau):
    a, b = a / a.norm(dim=-1, keepdim=True), b / b.norm(dim=-1, keepdim=True)
    R, tot = a.shape[0], 0
    for x, y in ((a, b), (b, a)):
        for i in range(R):
            den = sum(torch.exp(x[i] @ y[j] / tau) for j in range(R)) + sum(torch.exp(x[i] @ x[j] / tau) for j in range(R) if j != i)
            tot = tot - torch.log(torch.exp(x[i] @ y[i] / tau) / den)
    return tot / (2 * R)

_A, _B = torch.randn(6, 5, generator=_g, dtype=torch.float64), torch.randn(6, 5, generator=_g, dtype=torch.float64)
_a1, _a2 = (_A.clone().requires_grad_(), _B.clone().requires_grad_()), (_A.clone().requires_grad_(), _B.clone().requires_grad_())
_l, _ref = simclr_loss(*_a1, 0.5), _naive_simclr(*_a2, 0.5)
assert_close(_l, _ref)
_l.backward(); _ref.backward()
for x, y in zip(_a1, _a2): assert_close(x.grad, y.grad)
assert gradcheck(lambda a, b: simclr_loss(a, b, 0.5), _a1, eps=1e-6, atol=1e-5)
assert_close(simclr_loss(_B, _A, 0.5), _l.detach())                                     # symmetric in the views
_perm = torch.randperm(6, generator=_g)
assert_close(simclr_loss(_A[_perm], _B[_perm], 0.5), _l.detach())                       # image order does not matter
assert_close(simclr_loss(3 * _A, 0.2 * _B, 0.5), _l.detach())                           # normalised inside
_parts = [simclr_loss(_A[s], _B[s], 0.5, _A, _B, o) for s, o in ((slice(0, 3), 0), (slice(3, 6), 3))]
assert_close(sum(_parts) / 2, _l.detach())                                             # two processes = one
# identical views (what the authors' code feeds it) against independent ones, at their tau = 0.1
print(f"simclr at tau 0.1: identical views {float(simclr_loss(_A, _A, 0.1)):.4f}, independent views {float(simclr_loss(_A, _B, 0.1)):.4f}")

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
