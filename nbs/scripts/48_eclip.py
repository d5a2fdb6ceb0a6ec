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
#| default_exp baselines.eclip

# %%
#| export
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from powerclip.baselines.clip_pgs import (cosine_matrix, drop_count, hash_uniform, mix_weight, patch_pixels,
                                          probe_selection)
from powerclip.dist import all_max
from powerclip.methods import CLIP, StepClock, register, sample_keys

# %%
#| hide
from torch.testing import assert_close


# %% [markdown]
# # E-CLIP
#
# > Cluster masking (Wei, Pan, Owens, CVPR 2024).
#
# A few random anchor patches each take with them every patch whose normalised pixels are similar to theirs, and these
# clusters leave the image before the vision transformer; CLIP's loss is unchanged.

# %% [markdown]
# E-CLIP changes which patches FLIP drops. Per training image with patches $x_1..x_N$ (the model's normalised
# input pixels, $3p^2$ values each):
#
# 1. **Features.** Each patch is standardised over its own $3p^2$ values, $\hat x_j=(x_j-\mu_j)/\sigma_j$, and
#    patches are compared by cosine similarity, $S_{jk}=\cos(\hat x_j,\hat x_k)$, i.e. the Pearson correlation of
#    their pixel vectors. Optionally the patch embeddings enter too, $S=(1-\alpha)S_{\text{pix}}+\alpha S_{\text{emb}}$
#    with $\alpha$ growing linearly over training (`use_embed`, `ratio = epoch / 32`).
# 2. **Anchors.** A small random set $A$ of patches (3 % in the authors' script: `--force-patch-dropout 0.03`,
#    i.e. $196-\lfloor196\cdot0.97\rfloor=6$ of 196; "less than 5 %" on the project page).
# 3. **Clusters.** Every patch within the threshold of some anchor is masked, $M=A\cup\{k:\max_{a\in A}S_{ak}>r\}$:
#    a union of balls around the anchors in feature space (not a transitive closure, no k-means).
# 4. **One length per batch.** The vision transformer needs one sequence length, so every image of the batch
#    drops the same number of patches, $n_{\text{drop}}=\max\big(N-\lfloor N(1-\rho_{\min})\rfloor,\ \min_i|M_i|\big)$
#    with $\rho_{\min}=0.3$: at least 30 %, and at least the smallest cluster mask of the batch. The dropped
#    patches are removed from the token sequence after the positional embedding (`torch.gather`, as FLIP). An
#    image whose clusters are larger than $n_{\text{drop}}$ keeps the rest of its cluster patches in the
#    sequence, meant to be hidden by an attention mask; one with smaller clusters loses extra patches.
# 5. **Threshold.** $r$ is meant to be found by bisection on a batch so that the batch's mean masked share is the
#    target 0.5 (`PatchDropout.search`, tolerance 0.001), then kept fixed.
#
# Nothing is masked at evaluation; the loss and the scoring are CLIP's (the README evaluates with
# `clip_benchmark`, global embeddings).
#
# ## The authors' code (`Zi-hao-Wei/Efficient-Vision-Language-Pre-training-by-Cluster-Masking`) and what we do
#
# The paper body (arXiv 2405.08815) could not be read from this environment (only its abstract and project
# page); the steps above are from the code, `open_clip/transformer.py` `PatchDropout.forward` / `.search`,
# `training/main.py`, `training/params.py`, and the README's training command.
#
# | what | authors' code | here |
# |---|---|---|
# | threshold actually used | `VisionTransformer.forward` passes `self.target_mask_ratio` (0.5) into the parameter named `sim`: the cosine threshold is 0.5; `search` is never called (`main.py` loads a batch under `if args.sim == 1.1` and only sets `visual.sim`) | `threshold` is its own number; `calibrate_threshold` does the paper's bisection when wanted |
# | `--target_mask_ratio` | parsed without `type=float`, so the README's `--target_mask_ratio 0.5` arrives as the string `'0.5'` | — |
# | embedding mix | the `use_embed` branch reads `imgs_abs` before assigning it (it cannot run); the embeddings there include the positional embedding | `patch_similarity(pix, emb, alpha)`; the method passes the tokens entering the transformer, positional embedding included, as theirs (`use_embed`, off by default as theirs) |
# | flat patches | $\sigma_j=0$ gives a zero vector and a 0/0 = NaN similarity: a flat patch is never in a cluster and never clusters others | two flat patches have similarity 1 (equal after standardisation), flat against textured 0 |
# | hidden cluster patches | kept cluster patches get an attention bias that ends up **+1 on every visible pair** (`attn_mask == 0` is cast to float in `ResidualAttentionBlock.attention`), not $-\infty$: they stay visible, softly down-weighted | `select_kept` returns them as `hidden`; the method hides them as attention keys (`hide_clusters=True`, the paper's intent, default) or leaves them fully visible (`False`: the released behaviour without its +1 bias); see "The method" below |
# | extra drops | the extra patches an image loses are picked by `argsort` of an all-zero key (tie order), not at random | random, from the given noise |
# | per-head masks | `attn_mask.repeat(num_heads, 1, 1)` tiles the whole batch, while `nn.MultiheadAttention` reads row $b\cdot H+h$ as image $b$, head $h$: most (image, head) pairs get another image's bias | one mask per image, the same for every head |
# | batch minimum | over the process's own batch | over the global batch when an `all_min` is given (DDP parity) |
# | everything clustered | $n_{\text{drop}}=N$ is possible (an empty sequence but the class token) | at most $N-1$ |
#
# Everything up to "The method" is a pure function of tensors; the randomness (anchors, drop order) comes in as
# uniform noise, `hash_uniform` of `46_clip_pgs` in the method, so the choice for an image is a function of (seed,
# step, sample index).

# %% [markdown]
# ## Similarity of patches

# %%
#| export
def pixel_similarity(
    pix: torch.Tensor,       # (C, N, P) each patch's pixel values (`patch_pixels` of `46_clip_pgs`)
    flat_std: float = 1e-6,  # a patch whose pixels' standard deviation is at most this is flat
) -> torch.Tensor:           # (C, N, N) cosine of per-patch standardised pixels, at least float32
    "E-CLIP's pixel similarity: the Pearson correlation of two patches' pixel vectors (flat-flat: 1, flat-other: 0)."
    x = pix.to(torch.promote_types(pix.dtype, torch.float32))
    # (C, N, P) centred; scaling cannot change a cosine
    xc = x - x.mean(-1, keepdim=True)
    flat = xc.norm(dim=-1) <= flat_std * math.sqrt(x.shape[-1])            # (C, N)
    S = cosine_matrix(xc)                                                    # (C, N, N)
    either, both = flat[:, :, None] | flat[:, None, :], flat[:, :, None] & flat[:, None, :]
    return torch.where(either, both.to(S.dtype), S)


def patch_similarity(
    pix: torch.Tensor,                # (C, N, P) patch pixels
    emb: torch.Tensor | None = None,  # (C, N, D) patch embeddings (None: pixels only)
    alpha: float = 0.0,               # weight of the embedding similarity
) -> torch.Tensor:                    # (C, N, N) (1 - alpha) S_pix + alpha S_emb
    "The similarity the clusters are drawn in: pixels, optionally mixed with embeddings (`mix_weight` gives alpha)."
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if alpha == 0:
        return pixel_similarity(pix)
    if emb is None:
        raise ValueError("alpha > 0 needs the patch embeddings")
    S_emb = cosine_matrix(emb)
    if alpha == 1:
        return S_emb
    return (1 - alpha) * pixel_similarity(pix) + alpha * S_emb


# %% [markdown]
# Checks: against `torch.corrcoef`; unchanged when a patch's intensities are scaled and shifted (contrast,
# brightness), sign-flipped when inverted; symmetric with a unit diagonal; the flat rule; the mix.

# %%
_g = torch.Generator().manual_seed(0)
_pix = torch.randn(2, 9, 12, generator=_g, dtype=torch.float64)
_S = pixel_similarity(_pix)
for c in range(2):
    assert_close(_S[c], torch.corrcoef(_pix[c]))
_aff = (_pix * torch.rand(2, 9, 1, generator=_g, dtype=torch.float64).add(0.1)
        + torch.randn(2, 9, 1, generator=_g, dtype=torch.float64))
assert_close(pixel_similarity(_aff), _S)
_inv = _pix.clone()
_inv[:, 0] = -_inv[:, 0]
assert_close(pixel_similarity(_inv)[:, 0, 1:], -_S[:, 0, 1:])
assert_close(_S, _S.transpose(1, 2))
assert_close(_S.diagonal(dim1=1, dim2=2), torch.ones(2, 9, dtype=torch.float64))
_fl = _pix.clone()
_fl[0, 2] = 0.7
_fl[0, 5] = -1.3                      # two flat patches of different colours
_Sf = pixel_similarity(_fl)
assert _Sf[0, 2, 5] == 1 and _Sf[0, 2, 2] == 1 and (_Sf[0, 2, [0, 1, 3, 4, 6, 7, 8]] == 0).all()
_emb = torch.randn(2, 9, 4, generator=_g, dtype=torch.float64)
assert_close(patch_similarity(_pix, _emb, 0.25), 0.75 * _S + 0.25 * cosine_matrix(_emb))
assert torch.equal(patch_similarity(_pix), _S) and torch.equal(patch_similarity(_pix, _emb, 1.0), cosine_matrix(_emb))
assert mix_weight(16 / 32) == 0.5                                           # the authors' epoch / 32 at epoch 16
print("pixel similarity = Pearson correlation; flat-flat", float(_Sf[0, 2, 5]), "flat-textured", float(_Sf[0, 2, 0]))


# %% [markdown]
# ## Anchors and clusters
#
# The anchors are the `n_anchor` patches with the smallest noise (ties to the lower index: a stable sort);
# `anchor_count` is the authors' count, FLIP's rounding of the anchor share. A patch is masked if it is an anchor
# or its similarity to some anchor exceeds the threshold (strictly, as the authors' `>`).

# %%
#| export
def anchor_count(n: int, ratio: float = 0.03) -> int:
    """Anchors out of `n` patches: `n - int(n * (1 - ratio))` (the authors' `--force-patch-dropout 0.03`: 6 of 196), at
    least 1."""
    if not 0 < ratio < 1:
        raise ValueError(f"anchor ratio must be in (0, 1), got {ratio}")
    return max(1, drop_count(n, ratio))


def draw_anchors(noise: torch.Tensor, n_anchor: int) -> torch.Tensor:
    "noise `(C, N)` -> `(C, N)` bool: the `n_anchor` patches of smallest noise in each image."
    C, N = noise.shape
    if not 1 <= n_anchor <= N:
        raise ValueError(f"need 1 <= n_anchor <= {N}, got {n_anchor}")
    first = torch.sort(noise, dim=1, stable=True).indices[:, :n_anchor]                  # (C, n_anchor)
    return torch.zeros(C, N, dtype=torch.bool, device=noise.device).scatter_(1, first, True)


def cluster_mask(
    sim: torch.Tensor,       # (C, N, N) patch similarity
    anchors: torch.Tensor,   # (C, N) bool
    threshold: float,        # cosine threshold r
) -> torch.Tensor:           # (C, N) bool: anchors and every patch with similarity > r to some anchor
    "E-CLIP's cluster mask: the union of the balls of similarity > r around the anchors."
    near = (sim > threshold) & anchors[:, :, None]                                       # (C, N, N) rows: anchors only
    return near.any(1) | anchors


# %% [markdown]
# A hand case: an image of four quadrants, each tiled with its own random texture (every patch of a quadrant
# has the same pixels up to a little noise, patches of different quadrants are uncorrelated). One anchor in
# the top-left quadrant masks exactly that quadrant; a second one in the bottom-right adds that one. Against the
# definition as loops, on random similarities: the mask is the union over anchors of the above-threshold patches
# (clusters are balls around anchors in feature space) and shrinks as the threshold grows.

# %%
def _quadrant_image(C=1, H=64, p=8, noise=0.05, seed=0):
    g = torch.Generator().manual_seed(seed)
    tex = torch.randn(4, 3, p, p, generator=g)                                    # one texture per quadrant
    img = torch.zeros(C, 3, H, H)
    h = H // 2
    for q, (r, c) in enumerate([(0, 0), (0, h), (h, 0), (h, h)]):
        img[:, :, r:r + h, c:c + h] = tex[q].repeat(1, h // p, h // p)
    return img + noise * torch.randn(C, 3, H, H, generator=g)

_img = _quadrant_image()
_px = patch_pixels(_img, 8)                                                      # (1, 64, 192), 8 x 8 grid
_Sq = pixel_similarity(_px)
_quad = torch.tensor([(r >= 4) * 2 + (c >= 4) for r in range(8) for c in range(8)])  # quadrant of each patch
_anc = torch.zeros(1, 64, dtype=torch.bool)
_anc[0, 9] = True                   # patch (1, 1): top-left quadrant
assert torch.equal(cluster_mask(_Sq, _anc, 0.5)[0], _quad == 0)
_anc[0, 54] = True                                                               # patch (6, 6): bottom-right
assert torch.equal(cluster_mask(_Sq, _anc, 0.5)[0], (_quad == 0) | (_quad == 3))
print(f"within a quadrant similarity >= {float(_Sq[0][_quad[:, None] == _quad[None]].min()):.3f}, "
      f"across quadrants |similarity| <= {float(_Sq[0][_quad[:, None] != _quad[None]].abs().max()):.3f}")

_Sr = cosine_matrix(torch.randn(3, 30, 6, generator=_g))
_ar = draw_anchors(torch.rand(3, 30, generator=_g), 4)
for thr in (-0.2, 0.3, 0.7):
    m = cluster_mask(_Sr, _ar, thr)
    for c in range(3):
        A = _ar[c].nonzero()[:, 0].tolist()
        assert m[c].tolist() == [j in A or any(float(_Sr[c, a, j]) > thr for a in A) for j in range(30)]
assert (cluster_mask(_Sr, _ar, 0.7) <= cluster_mask(_Sr, _ar, 0.3)).all()       # higher threshold, smaller clusters
assert torch.equal(cluster_mask(_Sr, _ar, 1.0), _ar)                            # above every cosine: anchors only
assert cluster_mask(_Sr, _ar, -1.5).all()                                       # below every cosine: everything
assert anchor_count(196) == 6 and anchor_count(16) == 1 and draw_anchors(torch.zeros(2, 5), 2)[:, :2].all()
_u = hash_uniform(torch.arange(10), step=3, seed=0, n=30)
assert torch.equal(draw_anchors(_u, 4)[4:7], draw_anchors(_u[4:7], 4))         # an image's anchors ignore its batch


# %% [markdown]
# ## How many patches leave, and which
#
# `cluster_drop_count` is step 4's $n_{\text{drop}}$ from the smallest cluster mask of the batch (capped at $N-1$:
# the class token alone carries no image). It changes from batch to batch, and with it the number of tokens the vision
# transformer sees: on a GPU each new count is a new shape (new kernels, new allocations). `drop_multiple` (ours;
# default 1, the authors' count) rounds it down to a multiple, never below the `min_ratio` count: 8 leaves a ViT-B/16
# step a few token counts. The method allows it: every image's cluster still holds the dropped patches, and with
# `hide_clusters` the patches dropped or hidden are the same, only a few more of them kept and hidden. The host reads
# this one number (the smallest cluster) and nothing else: the kept indices come from a stable sort, not `nonzero`. `select_kept` then removes exactly $n_{\text{drop}}$ patches from
# each image: its cluster patches first, in random order, then, if its clusters are smaller, random other
# patches. It returns the kept indices (ascending, the order of open_clip's patch tokens) and which of the kept
# ones are cluster patches (`hidden`). Per image, the patches that are dropped or hidden number
# $\max(|M_i|, n_{\text{drop}})$: `effective_ratio` is their mean share, the quantity the authors' bisection matches
# to the target.

# %%
#| export
def cluster_drop_count(min_masked: int, n: int, min_ratio: float = 0.3, multiple: int = 1) -> int:
    """Patches every image of the batch drops: FLIP-rounded `min_ratio` of `n`, or the batch's smallest cluster mask if
    larger; at most n - 1. `multiple` > 1: rounded down to a multiple of it, not below the `min_ratio` count."""
    if not 0 <= min_ratio < 1:
        raise ValueError(f"min_ratio must be in [0, 1), got {min_ratio}")
    low = drop_count(n, min_ratio)
    d = min(n - 1, max(low, int(min_masked)))
    return max(low, d - d % multiple) if multiple > 1 else d


def select_kept(
    masked: torch.Tensor,   # (C, N) bool cluster masks
    noise: torch.Tensor,    # (C, N) any real noise: the random order within cluster and non-cluster patches
    n_drop: int,            # patches to drop from every image
) -> tuple[torch.Tensor, torch.Tensor]:  # keep (C, N - n_drop) long ascending, hidden (C, N - n_drop) bool
    "Drop `n_drop` patches per image, cluster patches first (random order), then others (random order)."
    C, N = masked.shape
    if not 0 <= n_drop < N:
        raise ValueError(f"need 0 <= n_drop < {N}, got {n_drop}")
    by_noise = torch.sort(noise, dim=1, stable=True).indices                              # (C, N)
    outside = (~masked).gather(1, by_noise).to(torch.uint8)                              # (C, N) 0: cluster, 1: other
    order = by_noise.gather(1, torch.sort(outside, dim=1, stable=True).indices)           # (C, N) drop order
    keep_mask = torch.ones(C, N, dtype=torch.bool, device=masked.device)
    keep_mask.scatter_(1, order[:, :n_drop], False)
    # the kept patches first, ascending (a stable sort: no `nonzero`, whose size a GPU's host would wait for)
    keep = torch.sort(keep_mask.to(torch.uint8), dim=1, descending=True, stable=True).indices[:, :N - n_drop]
    return keep, masked.gather(1, keep)


def effective_ratio(masked: torch.Tensor, min_ratio: float = 0.3) -> float:
    "Mean share of patches dropped or hidden, max(|M_i|, n_drop) / N, for cluster masks `(C, N)` of one batch."
    C, N = masked.shape
    m = masked.sum(1)                                                                     # (C,)
    n_drop = cluster_drop_count(int(m.min()), N, min_ratio)
    return float(m.clamp_min(n_drop).double().mean() / N)


# %% [markdown]
# Checks: the counts of the authors' ViT-B/16 setting; exactly $N-n_{\text{drop}}$ distinct, ascending kept
# patches; cluster patches go before any other; an image with small clusters loses all of them and then random
# others, one with large clusters keeps the rest of them as `hidden`; the result depends only on the image's own
# row (so a sample's choice does not depend on its batch or process, given $n_{\text{drop}}$); the same noise gives
# the same choice.

# %%
assert cluster_drop_count(0, 196) == 59 and cluster_drop_count(80, 196) == 80 and cluster_drop_count(196, 196) == 195
assert cluster_drop_count(3, 16, 0.0) == 3
assert [cluster_drop_count(m, 196, 0.3, 8) for m in (0, 63, 64, 71, 80, 196)] == [59, 59, 64, 64, 80, 192]
_m = torch.zeros(3, 20, dtype=torch.bool)
_m[0, :3] = True
_m[1, 5:15] = True
_m[2, ::2] = True                    # clusters of 3, 10 and 10 patches
_n = hash_uniform(torch.arange(3), 0, 0, 20)
_keep, _hid = select_kept(_m, _n, 6)
assert _keep.shape == (3, 14) and (_keep.diff(dim=1) > 0).all()
_kept = torch.zeros(3, 20, dtype=torch.bool).scatter_(1, _keep, True)
assert not (_kept & _m)[0].any() and (~_kept & ~_m)[0].sum() == 3          # image 0: its 3 cluster patches and 3 others
assert ((~_kept) <= _m)[1:].all() and (_kept & _m)[1:].sum(1).eq(4).all()   # images 1, 2: 6 of 10 cluster patches go
assert torch.equal(_hid, _m.gather(1, _keep))
_k1, _h1 = select_kept(_m[1:2], _n[1:2], 6)
assert torch.equal(_k1, _keep[1:2]) and torch.equal(_h1, _hid[1:2])
assert torch.equal(select_kept(_m, _n, 6)[0], _keep)
assert torch.equal(_keep, _kept.nonzero()[:, 1].reshape(3, 14))       # the oracle: the kept mask's nonzero, in order
assert abs(effective_ratio(_m, 0.3) - (6 + 10 + 10) / 60) < 1e-12      # n_drop = max(20 - 14, 3) = 6
print("kept (image 0):", _keep[0].tolist(), " hidden per image:", _hid.sum(1).tolist())


# %% [markdown]
# ## The threshold for a target ratio
#
# The authors' intended search: bisection on the threshold until the batch's `effective_ratio` is within `tol`
# of the target (0.5). The share of masked patches can only shrink as the threshold grows, so bisection on
# $[-1, 1]$ converges; with finitely many patches the exact target may be out of reach, and the closest threshold
# seen is returned. Under DDP every process must use the same threshold: calibrate once (on one batch, or offline,
# as `46_clip_pgs` calibrated its `sim_threshold`) and keep it in the config.

# %%
#| export
def calibrate_threshold(
    sim: torch.Tensor,       # (C, N, N) patch similarities of a calibration batch
    anchors: torch.Tensor,   # (C, N) bool anchors of that batch
    target: float = 0.5,     # wanted effective_ratio
    min_ratio: float = 0.3,
    tol: float = 1e-3,
    iters: int = 40,
) -> float:                  # the threshold whose effective ratio is closest to the target
    "Bisection on the cluster threshold so that the batch's effective masking ratio meets `target`."
    if not 0 < target < 1:
        raise ValueError(f"target must be in (0, 1), got {target}")
    lo, hi = -1.0, 1.0
    best, best_err = hi, math.inf
    for _ in range(iters):
        mid = (lo + hi) / 2
        r = effective_ratio(cluster_mask(sim, anchors, mid), min_ratio)
        if abs(r - target) < best_err:
            best, best_err = mid, abs(r - target)
        if best_err < tol:
            break
        if r > target:
            lo = mid                                                      # too much masked: raise r
        else:
            hi = mid
    return best


# %%
_imgs = torch.stack([_quadrant_image(seed=s, noise=0.5)[0] for s in range(32)])   # noisier quadrants
_Sc = pixel_similarity(patch_pixels(_imgs, 8))
_ac = draw_anchors(hash_uniform(torch.arange(32), 0, 0, 64), anchor_count(64, 0.05))
_thr = calibrate_threshold(_Sc, _ac, 0.5)
_r = effective_ratio(cluster_mask(_Sc, _ac, _thr))
print(f"calibrated threshold {_thr:.4f}: effective ratio {_r:.4f} (target 0.5); at 0.5: "
      f"{effective_ratio(cluster_mask(_Sc, _ac, 0.5)):.4f}")
assert abs(_r - 0.5) < 1e-3
_rs = [effective_ratio(cluster_mask(_Sc, _ac, t)) for t in torch.linspace(-1, 1, 21).tolist()]
assert all(a >= b for a, b in zip(_rs, _rs[1:]))                                     # non-increasing in the threshold


# %% [markdown]
# ## All of it for a batch
#
# `cluster_masking` chains the steps for a batch whose similarity is given. Two noise tensors: one draws the
# anchors, one orders the drops (e.g. the two halves of `hash_uniform(index, step, seed, 2 * N)`). `all_min`
# takes the batch's smallest cluster size to the global batch's (under DDP, `-dist.all_max(-m)`), so that every
# process drops the same number of patches and two processes choose exactly what one process would on the whole
# batch.

# %%
#| export
@dataclass
class ClusterMasking:
    "What `cluster_masking` chose for a batch."
    keep: torch.Tensor      # (C, N - n_drop) long, kept patch indices, ascending
    hidden: torch.Tensor    # (C, N - n_drop) bool, kept patches that are in a cluster
    masked: torch.Tensor    # (C, N) bool, cluster masks (anchors included)
    anchors: torch.Tensor   # (C, N) bool
    n_drop: int             # patches dropped from every image


def cluster_masking(
    sim: torch.Tensor,            # (C, N, N) patch similarity (`patch_similarity`)
    anchor_noise: torch.Tensor,   # (C, N) uniform noise drawing the anchors
    order_noise: torch.Tensor,    # (C, N) noise ordering the drops
    n_anchor: int,                # anchors per image (`anchor_count`)
    threshold: float,             # cosine threshold r
    min_ratio: float = 0.3,       # least share of patches dropped
    all_min: Callable[[torch.Tensor], torch.Tensor] | None = None,  # min over processes of a scalar tensor
    multiple: int = 1,            # the drop count rounded down to a multiple of this (`cluster_drop_count`)
) -> ClusterMasking:
    """E-CLIP's cluster masking of a batch: anchors, clusters, one drop count, the kept patches. The host reads one
    value: the smallest cluster (`int(m_min)`), which sizes the kept tokens."""
    anchors = draw_anchors(anchor_noise, n_anchor)
    masked = cluster_mask(sim, anchors, threshold)
    m_min = masked.sum(1).min()
    if all_min is not None:
        m_min = all_min(m_min)
    n_drop = cluster_drop_count(int(m_min), masked.shape[1], min_ratio, multiple)
    keep, hidden = select_kept(masked, order_noise, n_drop)
    return ClusterMasking(keep, hidden, masked, anchors, n_drop)


# %% [markdown]
# Two simulated processes with the global minimum give what one process gives on the whole batch; without it,
# each half drops its own count (the authors' behaviour). A flat image is one cluster: any anchor masks it all,
# and one patch stays.

# %%
_imgs2 = torch.stack([_quadrant_image(seed=s, noise=0.3)[0] for s in range(6)])
_S2 = pixel_similarity(patch_pixels(_imgs2, 8))
_u2 = hash_uniform(torch.arange(100, 106), step=7, seed=1, n=128)
_p = cluster_masking(_S2, _u2[:, :64], _u2[:, 64:], 3, 0.4).masked.sum(1).argsort(descending=True, stable=True)
_S2, _u2 = _S2[_p], _u2[_p]                                              # large clusters in the first half
_full = cluster_masking(_S2, _u2[:, :64], _u2[:, 64:], 3, 0.4)
_halves_local = [cluster_masking(_S2[s], _u2[s, :64], _u2[s, 64:], 3, 0.4) for s in (slice(0, 3), slice(3, 6))]
_glob = min(int(h.masked.sum(1).min()) for h in _halves_local)          # what an all-reduce of the minimum returns
_gmin = lambda t: torch.minimum(t, torch.tensor(_glob))
_halves = [cluster_masking(_S2[s], _u2[s, :64], _u2[s, 64:], 3, 0.4, all_min=_gmin) for s in (slice(0, 3), slice(3, 6))]
assert all(h.n_drop == _full.n_drop for h in _halves) and _halves_local[0].n_drop > _full.n_drop
assert (torch.equal(torch.cat([h.keep for h in _halves]), _full.keep)
        and torch.equal(torch.cat([h.hidden for h in _halves]), _full.hidden))
print("cluster sizes:", _full.masked.sum(1).tolist(), " n_drop: one process", _full.n_drop,
      "| per-process without all_min", [h.n_drop for h in _halves_local])
_flat = cluster_masking(pixel_similarity(patch_pixels(torch.full((2, 3, 32, 32), 0.2), 8)),
                        torch.rand(2, 16, generator=_g), torch.rand(2, 16, generator=_g), 1, 0.5)
assert _flat.masked.all() and _flat.n_drop == 15 and _flat.keep.shape == (2, 1) and _flat.hidden.all()

# %% [markdown]
# ### On real photos
#
# COCO photos (`../shared/data/coco_sample`), squashed to 224 x 224 and normalised as a ViT-B/16 sees them
# ($N=196$), with the authors' setting: 6 anchors, threshold 0.5, at least 30 % dropped. How large are the clusters,
# what share is dropped or hidden, and which threshold gives the target 0.5 on these photos? A measurement of
# these photos, not of CC12M.

# %%
from pathlib import Path

_DATA = next((p for p in (Path("../shared/data/coco_sample"), Path("../../shared/data/coco_sample")) if p.is_dir()),
             Path("../shared/data/coco_sample"))                                   # from the repo root or nbs/
_files = sorted((_DATA / "images").glob("*.jpg"))[:64] if (_DATA / "images").is_dir() else []
if not _files:
    print("skipped: ../shared/data/coco_sample is absent (real COCO photos)")
else:
    import numpy as np
    from PIL import Image
    from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD
    _mean, _std = torch.tensor(OPENAI_DATASET_MEAN)[:, None, None], torch.tensor(OPENAI_DATASET_STD)[:, None, None]
    _x = torch.stack([(torch.from_numpy(np.asarray(Image.open(f).convert("RGB").resize((224, 224), Image.BICUBIC),
                                                   np.float32) / 255).permute(2, 0, 1) - _mean) / _std for f in _files])
    _Sp = pixel_similarity(patch_pixels(_x, 16))                                    # (P, 196, 196)
    _un = hash_uniform(torch.arange(len(_files)), 0, 0, 2 * 196)
    _cm = cluster_masking(_Sp, _un[:, :196], _un[:, 196:], anchor_count(196), 0.5)
    _sizes = _cm.masked.sum(1).double() / 196
    _thr_c = calibrate_threshold(_Sp, _cm.anchors, 0.5)
    print(f"{len(_files)} photos, 6 anchors, threshold 0.5: cluster share mean {float(_sizes.mean()):.3f} "
          f"(min {float(_sizes.min()):.3f}, max {float(_sizes.max()):.3f}); n_drop {_cm.n_drop} of 196; "
          f"effective ratio {effective_ratio(_cm.masked):.3f}; hidden per image "
          f"{float(_cm.hidden.sum(1).double().mean()):.1f}")
    print(f"threshold for an effective ratio of 0.5 on these photos: {_thr_c:.3f} "
          f"(gives {effective_ratio(cluster_mask(_Sp, _cm.anchors, _thr_c)):.3f})")
    assert _cm.keep.shape == (len(_files), 196 - _cm.n_drop) and _cm.n_drop >= 59


# %% [markdown]
# ## The method
#
# `eclip` is CLIP (its loss, its gathering, its global scoring) with a training `forward` that runs `encode` inside
# `powerclip.model.select_patch_tokens` with a `ClusterSelector`: for each image of the batch, the anchors and the drop
# order come from `hash_uniform(index, step, seed, 2N)` (the first $N$ columns draw the anchors, the last $N$ order the
# drops), so an image's choice is a function of (method seed, step, sample id) only, whatever process or batch it is
# in, and a resumed run draws what the straight run drew. The drop count $n_{\text{drop}}$ is taken over the **global**
# batch (the smallest cluster mask of any process: `all_min` through `powerclip.dist.all_max` of the negated count), so
# every process runs the same sequence length and two processes choose what one process chooses on the whole batch.
#
# **The cluster patches left in the sequence.** With $n_{\text{drop}}$ common to the batch, an image whose clusters are
# larger keeps some cluster patches. The paper means them to be masked; the released code gives them only a soft
# down-weighting (the +1 bias above). Here `hide_clusters=True` (default) hides them from every query as attention
# keys (`select_patch_tokens(..., hide=...)`, `30_model`): the class token and the visible patches never see them in
# any layer, so the image embedding is exactly that of the image without its clusters (checked below), at the compute
# of a sequence of $1+N-n_{\text{drop}}$ tokens. On the COCO photos above, this is what brings the share of patches the
# class token does not see from the 30 % floor to the printed effective ratio, near the paper's target of one half.
# `hide_clusters=False` drops $n_{\text{drop}}$ and leaves the other cluster
# patches fully visible: the released behaviour without its +1 bias (which softly favours pairs of non-cluster
# tokens, $e^{1}$ against $e^{0}$, and is tiled over the wrong images, see the table above).
#
# **Similarity.** Pixels only by default (`use_embed=False`, the released default; their `use_embed` branch does not
# run). `use_embed=True` mixes in the cosine of the tokens entering the transformer (patch embedding plus positional
# embedding, as their code reads `x`), with weight $\alpha$ = training progress $s/S$ (their `epoch / 32` over 32
# epochs); the trainer's `on_step(step, total)` gives $s, S$. The selection runs without autocast (the similarities
# and the threshold test in at least float32) and without gradient.
#
# The trainer logs `_eclip_drop_ratio` ($n_{\text{drop}}/N$), `_eclip_cluster_ratio` (mean $|M_i|/N$) and
# `_eclip_hidden_ratio` (mean share of hidden tokens; 0 with `hide_clusters=False`), each over the whole batch: the
# forward pass returns them per sample, so that an accumulated step's micro-batches join them (`49c_accum`).

# %% [markdown]
# **Gradient accumulation** (`49c_accum`). The drop count comes from the smallest cluster of the *global* batch,
# found inside the forward pass: a micro-batch alone would find its own smallest cluster and drop another number of
# patches. So an accumulated step first runs `accum_begin`: each micro-batch's selection alone (`probe_selection` of
# `46_clip_pgs`: the vision tower up to the selection, then it stops) gives its smallest cluster, and the minimum over
# the micro-batches and the processes replaces the selector's `all_min` in every micro-batch's forward pass. Anchors
# and drop order are keyed by sample (`hash_uniform`), so both passes of a micro-batch hide and drop the same patches.

# %%
#| export
@dataclass
class ECLIPConfig:
    "E-CLIP's options: the authors' README command where it sets them, their code's defaults otherwise."
    anchor_ratio: float = 0.03   # share of anchor patches (--force-patch-dropout 0.03: 6 of 196), at least 1
    threshold: float = 0.5       # cosine threshold of a cluster (the value their forward passes: target_mask_ratio 0.5)
    min_ratio: float = 0.3       # least share of patches dropped per image (--min_mask_ratio 0.3)
    hide_clusters: bool = True   # hide the cluster patches left after the common drop (the paper's intent); False:
                                 # leave them visible (the released code, without its +1 attention bias)
    use_embed: bool = False      # mix the token similarity in with weight alpha = progress (their use_embed; off)
    drop_multiple: int = 1       # the batch's drop count rounded down to a multiple of this (ours: 8 keeps a GPU's
                                 # token counts to a few shapes; with hide_clusters the dropped or hidden patches are
                                 # the same, only fewer of them dropped; 1, the default: the authors' count)

    def __post_init__(self):
        if not 0 < self.anchor_ratio < 1:
            raise ValueError(f"anchor_ratio must be in (0, 1), got {self.anchor_ratio}")
        if not -1 <= self.threshold <= 1:
            raise ValueError(f"threshold is a cosine, in [-1, 1]; got {self.threshold}")
        if not 0 <= self.min_ratio < 1:
            raise ValueError(f"min_ratio must be in [0, 1), got {self.min_ratio}")
        if self.drop_multiple < 1:
            raise ValueError(f"drop_multiple must be at least 1, got {self.drop_multiple}")


def _all_min(t: torch.Tensor) -> torch.Tensor:
    "Minimum of an integer count over the processes (a tensor, as `cluster_masking` passes it)."
    return torch.tensor(-all_max(-int(t)))


class ClusterSelector:
    """The `keep` (and `hidden`) of `select_patch_tokens` for one forward pass: x `(C, 1 + N, width)` -> `(C, N -
    n_drop)`."""
    def __init__(self, cfg: ECLIPConfig, patch: int, image: torch.Tensor, noise: torch.Tensor, alpha: float):
        # (C, 3, H, W), (C, 2N)
        self.cfg, self.patch, self.image, self.noise, self.alpha = cfg, patch, image, noise, alpha
        self.last: ClusterMasking | None = None   # the choice of the last call
        self.all_min = _all_min                   # the batch's smallest cluster over the processes (accumulated: given)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        N = x.shape[1] - 1
        with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
            pix = patch_pixels(self.image, self.patch)                         # (C, N, 3 p^2)
            if pix.shape[1] != N:
                raise ValueError(f"image has {pix.shape[1]} patches, the token sequence {N}")
            emb = x[:, 1:].detach() if self.alpha > 0 else None                # (C, N, width) with position, as theirs
            sim = patch_similarity(pix, emb, self.alpha)                       # (C, N, N)
            self.last = cluster_masking(sim, self.noise[:, :N], self.noise[:, N:],
                                        anchor_count(N, self.cfg.anchor_ratio),
                                        self.cfg.threshold, self.cfg.min_ratio, all_min=self.all_min,
                                        multiple=self.cfg.drop_multiple)
        return self.last.keep

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        "The kept cluster patches `(C, N - n_drop)` bool of the last call (`hide` of `select_patch_tokens`)."
        return self.last.hidden


@register("eclip")
class ECLIP(StepClock, CLIP):
    "E-CLIP: CLIP's loss with cluster masking of the patch tokens in training, config `ECLIPConfig`."
    Config = ECLIPConfig
    needs_patches = False

    def __init__(self, cfg=None, seed: int = 0):
        super().__init__(cfg, seed)
        self.last: ClusterMasking | None = None    # the masking of the last training forward pass
        self._min: int | None = None                # an accumulated step's smallest cluster, from accum_begin

    @property
    def alpha(self) -> float:
        if not self.cfg.use_embed:
            return 0.0
        return mix_weight(self.step / self.total if self.total else 0.0)

    def forward(self, model, batch, modules=None):
        from powerclip.model import encode, select_patch_tokens  # late: keeps this module importable without open_clip
        image, v = batch["image"], model.visual
        if not v.training:                                       # evaluation: every patch
            return encode(model, image, batch["tokens"], need_patches=False)
        sel, N = self._selector(model, batch)
        with select_patch_tokens(model, sel, hide=sel.hidden if self.cfg.hide_clusters else None):
            out = encode(model, image, batch["tokens"], need_patches=False)
        self.tick()
        self.last = m = sel.last
        # per sample (C,): micro-batches join along the rows (`49c_accum`), so the loss logs the whole batch's means
        per = lambda x: x.to(device=image.device, dtype=torch.float32)
        # made on the device (a fill, not a copy from the host, which a GPU would wait for)
        out["eclip_drop_ratio"] = per(torch.full((image.shape[0],), m.n_drop / N, device=image.device))
        out["eclip_cluster_ratio"] = per(m.masked.sum(1).double() / N)
        out["eclip_hidden_ratio"] = per(m.hidden.sum(1).double() / N if self.cfg.hide_clusters
                                        else torch.zeros(image.shape[0], device=image.device))
        return out

    def _selector(self, model, batch) -> tuple[ClusterSelector, int]:
        "This batch's selector (its noise keyed by sample and step) and the patch count N."
        image, v = batch["image"], model.visual
        patch = int(v.patch_size[0] if isinstance(v.patch_size, (tuple, list)) else v.patch_size)
        N = (image.shape[-2] // patch) * (image.shape[-1] // patch)
        keys = sample_keys(batch, image)
        sel = ClusterSelector(self.cfg, patch, image, hash_uniform(keys, self.step, self.seed, 2 * N), self.alpha)
        if self._min is not None:           # an accumulated step: the whole batch's smallest cluster, found beforehand
            sel.all_min = lambda t: torch.tensor(self._min)
        return sel, N

    def accum_begin(self, model, micro_batches, modules=None, dist=None):
        "The smallest cluster over all micro-batches and processes, before any micro-batch's forward pass."
        if not model.visual.training:
            return
        smallest = []
        for mb in micro_batches:
            sel, _ = self._selector(model, mb)
            sel.all_min = lambda t: t                 # this micro-batch's own smallest cluster
            probe_selection(model, mb["image"], sel)
            smallest.append(int(sel.last.masked.sum(1).min()))
        self._min = int(_all_min(torch.tensor(min(smallest))))

    def accum_end(self):
        self._min = None

    def loss(self, out, batch, dist):
        terms = super().loss(out, batch, dist)
        for k in ("eclip_drop_ratio", "eclip_cluster_ratio", "eclip_hidden_ratio"):
            if k in out:
                terms[f"_{k}"] = out[k].detach().mean()          # over the batch's rows (every micro-batch's)
        return terms


# %% [markdown]
# ### Checks on a model
#
# The micro model (32 px, 8-px patches, $N=16$, random weights) on images of four textured quadrants (each quadrant
# one cluster of 4 patches) and images of two textured halves (clusters of 8), with one anchor per image (3 % of 16,
# at least one) and a floor of 25 % ($n_{\text{drop}}\ge 4$; the default 30 % would drop 5 of 16). First a batch of
# quadrant images: $n_{\text{drop}}=4$ removes each image's cluster and nothing is hidden. In training the vision
# transformer sees $1+N-n_{\text{drop}}$ tokens, exactly the kept rows of the full sequence; at evaluation the embeddings
# are the plain model's; the same (seed, step, index) give the same loss, another step other anchors; the loss
# back-propagates; the state_dict is untouched.

# %%
from powerclip.data import BatchNeeds
from powerclip.dist import DistContext
from powerclip.methods import METHODS, get_method
from powerclip.model import create_model, encode, register_configs, select_patch_tokens

register_configs()
assert METHODS["eclip"] is ECLIP and get_method("eclip").needs() == BatchNeeds()   # pixels only: no tree, no regions
for bad in ({"anchor_ratio": 0.0}, {"threshold": 1.5}, {"min_ratio": 1.0}):
    try:
        get_method("eclip", bad)
        raise AssertionError(bad)
    except ValueError as e:
        print("refused:", e)

torch.manual_seed(0)
_model = create_model("powerclip-micro")[0]
_keys = set(_model.state_dict())
# (4, 3, 32, 32), 4 x 4 grid
_imgq = torch.stack([_quadrant_image(H=32, p=8, noise=0.05, seed=s)[0] for s in range(4)])
_tok = torch.zeros(4, 77, dtype=torch.long)
_tok[:, 0], _tok[:, 1:4], _tok[:, 4] = 49406, 100, 49407
_batch = {"image": _imgq, "tokens": _tok, "index": torch.tensor([3, 1, 4, 1_000_001])}
_m = get_method("eclip", {"min_ratio": 0.25}, seed=7)
_N = 16
_seen = []
_hk = _model.visual.ln_pre.register_forward_hook(lambda mod, args, y: _seen.append(args[0].detach().clone()))
_model.train()
_m.on_step(0, 10)
_out = _m.forward(_model, _batch)
_mk = _m.last
_model.eval()
with torch.no_grad():
    _ev, _ref = _m.forward(_model, _batch), encode(_model, _imgq, _tok, need_patches=False)
_hk.remove()
print(f"cluster sizes {_mk.masked.sum(1).tolist()}, n_drop {_mk.n_drop}, hidden per image {_mk.hidden.sum(1).tolist()}")
assert _mk.masked.sum(1).eq(4).all() and _mk.n_drop == 4 and not _mk.hidden.any()   # one quadrant each, all dropped
assert _seen[0].shape[1] == 1 + _N - _mk.n_drop and _seen[1].shape[1] == 1 + _N
_W = _seen[0].shape[-1]
assert_close(_seen[0][:, 1:], _seen[1][:, 1:].gather(1, _mk.keep[..., None].expand(-1, -1, _W)))
for k in ("image", "text"):
    assert torch.equal(_ev[k], _ref[k])          # evaluation = the plain model
assert set(_model.state_dict()) == _keys and isinstance(_model.visual.patch_dropout, torch.nn.Identity)
_model.train()
_terms = _m.loss(_out, _batch, DistContext())
_terms["clip"].backward()
assert torch.isfinite(_terms["clip"]) and _model.visual.transformer.resblocks[0].attn.in_proj_weight.grad is not None
assert float(_terms["_eclip_drop_ratio"]) == 0.25 and float(_terms["_eclip_hidden_ratio"]) == 0.0
_m.on_step(0, 10)
_l1 = _m.loss(_m.forward(_model, _batch), _batch, DistContext())["clip"]
assert torch.equal(_l1.detach(), _terms["clip"].detach())                  # deterministic in (seed, step, index)
_m.on_step(1, 10)
_m.forward(_model, _batch)
assert not torch.equal(_m.last.anchors, _mk.anchors)                       # another step, other anchors
print(f"tokens into the vision transformer: train {_seen[0].shape[1]}, eval {_seen[1].shape[1]}; loss "
      f"{float(_terms['clip'].detach()):.4f}")


# %% [markdown]
# Clusters of different sizes in one batch: two quadrant images (clusters of 4) and two images of two halves (clusters
# of 8, wherever the anchor falls). $n_{\text{drop}}$ is the smallest cluster, 4, so each half image keeps 4 of its cluster
# patches, hidden. Its embedding is then exactly that of its 8 visible patches alone (the whole cluster gone), computed
# image by image with plain selection; with `hide_clusters=False` (the same tokens kept, none hidden) it is not. bf16
# autocast gives a finite loss close to float32's.

# %%
def _halves_image(H=32, p=8, noise=0.05, seed=0):
    g = torch.Generator().manual_seed(seed)
    tex = torch.randn(2, 3, p, p, generator=g)
    img = torch.cat([tex[0].repeat(1, H // p // 2, H // p), tex[1].repeat(1, H // p // 2, H // p)], 1)   # (3, H, H)
    return img + noise * torch.randn(3, H, H, generator=g)

_batch2 = dict(_batch, image=torch.cat([_imgq[:2], torch.stack([_halves_image(seed=s) for s in (10, 11)])]))
_m.on_step(3, 10)
with torch.no_grad():
    _o1 = _m.forward(_model, _batch2)
_mk2 = _m.last
assert _mk2.masked.sum(1).tolist() == [4, 4, 8, 8] and _mk2.n_drop == 4 and _mk2.hidden.sum(1).tolist() == [0, 0, 4, 4]
with torch.no_grad():
    for c in range(4):
        vis = _mk2.keep[c][~_mk2.hidden[c]]                                      # the patches the class token may see
        assert not _mk2.masked[c, vis].any()
        with select_patch_tokens(_model, lambda x: vis[None]):
            assert_close(encode(_model, _batch2["image"][c:c + 1], None, need_patches=False)["image"],
                         _o1["image"][c:c + 1])
    _mv = get_method("eclip", {"min_ratio": 0.25, "hide_clusters": False}, seed=7)
    _mv.on_step(3, 10)
    _o2 = _mv.forward(_model, _batch2)
assert torch.equal(_mv.last.keep, _mk2.keep)
assert torch.equal(_o2["image"][:2], _o1["image"][:2]) and not torch.allclose(_o2["image"][2:], _o1["image"][2:])
_l32 = _m.loss(_o1, _batch2, DistContext())
with torch.autocast("cpu", dtype=torch.bfloat16):
    _m.on_step(3, 10)
    _l16 = _m.loss(_m.forward(_model, _batch2), _batch2, DistContext())
assert torch.equal(_m.last.keep, _mk2.keep)                               # the selection runs outside autocast
_a, _b = float(_l16["clip"].detach()), float(_l32["clip"].detach())
assert math.isfinite(_a) and abs(_a - _b) < 0.05 * _b
print(f"loss fp32 {_b:.4f}, bf16 autocast {_a:.4f}; hidden ratio {float(_l32['_eclip_hidden_ratio']):.3f}")

# %% [markdown]
# On the built-in world's scenes (64 px, an $8\times8$ grid, the demo model, the default options): how large are the
# clusters, how many patches leave, how many are hidden? A measurement of these scenes (printed, not asserted), to
# read beside the COCO numbers above: where the clusters are smaller than the 30 % floor, E-CLIP is "drop 30 %,
# cluster patches first" and `hide_clusters` changes nothing.

# %%
from powerclip.data import BatchSpec, DataConfig, make_loader
from powerclip.model import model_geometry
_wb = next(iter(make_loader(BatchSpec(DataConfig(batch_size=32, workers=0, world_length=64),
                                      model_geometry("powerclip-demo"), BatchNeeds(), seed=0))))
_me = get_method("eclip")
_md = create_model("powerclip-demo")[0].train()
with torch.no_grad():
    _me.forward(_md, _wb)
_lm = _me.last
print(f"world scenes: cluster share mean {float(_lm.masked.double().mean()):.3f} (min "
      f"{float(_lm.masked.double().mean(1).min()):.3f}, max {float(_lm.masked.double().mean(1).max()):.3f}); n_drop "
      f"{_lm.n_drop} of 64; hidden per image {float(_lm.hidden.sum(1).double().mean()):.1f}; the class token sees "
      f"{float((~_lm.hidden).sum(1).double().mean()):.1f} patches")
_model.eval();
