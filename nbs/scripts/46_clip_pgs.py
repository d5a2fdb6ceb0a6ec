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
#| default_exp baselines.clip_pgs

# %%
#| export
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from powerclip.dist import all_sum
from powerclip.methods import CLIP, StepClock, hash_uniform, register, sample_keys

# %%
#| hide
from fastcore.test import test_eq
from torch.testing import assert_close


# %% [markdown]
# # CLIP-PGS
#
# > Patch generation-to-selection (Pei et al., CVPR 2025).
#
# CLIP's loss on images of which 30-50 % of the patches are removed before the vision transformer, chosen from a few
# random seeds by edge strength and optimal-transport-normalised patch similarity instead of uniformly (FLIP).

# %% [markdown]
# CLIP-PGS is FLIP with a smarter choice of *which* patches to drop. The loss is CLIP's, the towers are
# open_clip's, nothing is learned by the selection, and at evaluation nothing is dropped. The paper (Sec. 3.2)
# describes the selection in words and two formulas; per training image:
#
# 1. **Generation.** A few *candidate* (seed) patches are drawn uniformly at random, "the same random masking
#    strategy as FLIP, but with a reduced masking ratio of 5 %".
# 2. **Edge detection (ED).** A Sobel filter "applied to the whole image" gives an edge map; "if a patch is
#    initially marked for removal but exhibits high edge scores, it is retained".
# 3. **Similarity.** Patch-to-patch cosine similarities of features and of pixels are mixed,
#    $S = \alpha S_x + (1-\alpha) S_I$ with $S_x = \hat X\hat X^\top$, "$\alpha$ adjusted based on the training epoch".
# 4. **Optimal transport normalisation (OTN).** Sinkhorn makes $S$ doubly stochastic and $S' = S + \mathrm{Sinkhorn}(S)$ guides the masking.
# 5. **Selection.** "Progressive masking, starting with a small selection of mask patches and gradually
#    expanding based on similarity scores", with the masking ratio kept between a lower and an upper limit:
#    PGS$_{0.5}$ drops exactly 50 %, PGS$_{0.3}$ between 30 % and 50 % (upper limit 0.5 "following FLIP").
#
# The dropped patches are **removed from the token sequence** after the positional embedding, exactly where
# FLIP drops its patches (`powerclip.model.select_patch_tokens`), so the vision transformer really runs on fewer tokens: that is where
# the 0.5x-0.6x training time of the paper's Table 1 comes from.
#
# ## Choices where the paper is silent or ambiguous
#
# | what | paper | here |
# |---|---|---|
# | features of $S_x$ | "normalized embedding matrix" | the patch embeddings entering the transformer, **without** the positional embedding (conv output): both similarities are about content, not position |
# | pixels of $S_I$ | "images" | each patch's $3p^2$ normalised pixel values as a vector |
# | $\alpha$ schedule | "adjusted based on the training epoch" | linear in training progress $s/T$ from `alpha_start=0` (random features at the start: trust pixels) to `alpha_end=1`; $s, T$ come from the trainer's `Method.on_step(step, total)`, so a resumed run continues it exactly |
# | "high edge score" | not quantified | the `edge_top=25 %` patches with the largest mean Sobel magnitude of the image (and a non-zero one) are protected: dropped last, only if the lower limit cannot be met otherwise |
# | Sinkhorn | no $\varepsilon$, no iterations | symmetric log-domain Sinkhorn on $\exp(S/\varepsilon)$, $\varepsilon=0.05$ (SwAV's value), 20 iterations (doubly stochastic within $10^{-3}$, checked below) |
# | $S' = S + \mathrm{Sinkhorn}(S)$ | literally | $S' = S + N\cdot\mathrm{Sinkhorn}(S)$: a doubly stochastic matrix has entries of order $1/N$, so without the factor $N$ (mean entry 1) the OT term would be invisible next to cosines in $[-1,1]$ |
# | "gradually expanding" | no algorithm | greedy growth: the seeds are masked first; then, one at a time, the unmasked patch with the highest $S'$ to any masked patch is masked (the most redundant content goes first) |
# | PGS$_{0.3}$'s ratio | "dynamically adjusts within [0.3, 0.5]" | the growth of an image "wants" to continue while the added patch has plain similarity $S \ge$ `sim_threshold` to the masked set; 0.84 is calibrated on COCO photos (below) to give a mean ratio of 0.4, what the paper's relative training time of 0.6x for PGS$_{0.3}$ (Table 1) implies; that count, clamped to the limits, is averaged over the batch: **one** count per batch, because the patches must really leave the sequence and a batch needs one sequence length (a per-image count would need padding tokens and an attention mask, i.e. no saving). Under DDP the mean is over the global batch (one scalar all-reduce), so every process runs the same sequence length and two processes compute what one computes on the whole batch |
# | counts | ratios | FLIP's rounding: keep $\max(1,\lfloor N(1-r)\rfloor)$, so at $r=0.5$ PGS and FLIP run on the same number of tokens |
# | randomness | — | the seeds come from a counter-based hash of (`seed`, step, sample index): the choice for an image does not depend on which process or batch it is in (DDP parity) and is the same after a resume |
#
#
# **Known limits of these choices** (found in review, left as they are, measured where we could):
# - The OT term dominates $S'$ where it is large: with $\varepsilon=0.05$ the doubly stochastic matrix spreads its
#   mass over a group of near-duplicates, so a unique, tight pair of patches gets $N\cdot P\approx 31$ while each
#   entry of a large, uniform background block gets $\approx 1.3$ ($N=64$). The greedy growth therefore prefers
#   small tight clusters to large redundant backgrounds, which is not what "the most redundant content goes first"
#   promises. The paper also scores candidates against *neighbouring* patches; we use all patches. On COCO photos the
#   edge/OT machinery changes little (object patches kept 0.576 with edges vs 0.565 without, below).
# - $S_x$ uses the patch embeddings entering the transformer, which are a learned *linear* map of the same pixels
#   that $S_I$ uses: the $\alpha$ schedule moves from one linear view of the pixels to another, not to semantic
#   features. Deeper (e.g. last-layer, detached, previous-step) tokens would follow the paper's intent more closely.
# - `sim_threshold=0.84` is calibrated at $\alpha=0$ (pixel similarity only); as $\alpha$ grows the cosine
#   distribution moves and PGS$_{0.3}$'s ratio drifts: the trainer logs the ratio each step (`_pgs_drop_ratio`).
#
# ## The authors' code, and where we do not copy it
#
# The authors' public code (`clip-pgs/CLIP-PGS`, the repository that hosts the released `clip-pgs-0.3.pt` /
# `clip-pgs-0.5.pt`; read at commit cdeb109, `open_clip/transformer.py` `PatchDropout_PGS` and `VisionTransformer.forward`;
# details and line numbers in the project's research notes, section 4a) does the following. We follow the paper where
# the two differ, and say so:
#
# * **The patches do leave the sequence.** `select_mask` gathers the kept indices (`torch.gather(x, 1, ids_keep)`)
#   after the positional embedding and before `ln_pre`, keeping `len_keep = min(int(L (1 - min_mask_ratio)), min_p)`
#   tokens: at least 30 % (PGS$_{0.3}$) or 50 % (PGS$_{0.5}$) of the patches are really removed, as here. Only the
#   *extra* similarity-flagged tokens that remain in the sequence get the E-CLIP treatment: a boolean mask that is
#   True on the visible pairs is cast to float and added to the attention logits, i.e. **+1 on every pair of
#   unflagged tokens** and 0 on pairs with a flagged one, which neither hides the flagged tokens nor saves compute.
#   Here the selected patches are removed and nothing else is flagged.
# * **Edges on a map that is almost zero.** The Sobel filter runs on `gray` = the mean of each patch's 768
#   *per-patch standardised* pixel values, which is about 0 for every patch: a 14 x 14 map of rounding noise,
#   min-max normalised to [0, 1] and added to the random keys as `noise + edge * 1e6`. The seeds are the patches
#   with the *largest* keys, i.e. the largest such "edge" values: the opposite direction from the paper's "if a patch
#   ... exhibits high edge scores, it is retained", and in effect random. The paper applies Sobel "to the whole
#   image"; we do so on the real (normalised) pixels and pool the magnitude per patch (`sobel_patch_edges`), and
#   protect the strongest edges.
# * **Sinkhorn without the exponential.** The code's `sinkhorn` divides the *raw* cosine matrix by its sums over
#   one axis and then over the other (both sums taken before the step, $+10^{-3}$ in the denominators, which is also
#   the stopping tolerance), at most 50 times, with no $\exp(S/\varepsilon)$, then `S += sinkhorn(S)`. The cosines
#   can be negative, so this is not the Sinkhorn scaling of a positive matrix. Ours is the entropic Sinkhorn of
#   $\exp(S/\varepsilon)$ (table above).
# * **$\alpha$ = epoch / 32**, hard-coded to the 32-epoch recipe (`compute_similarity`): a step per epoch, reaching
#   31/32 in the last one. Ours is linear in the trainer's step from 0 to 1 over the run, whatever its length.
# * **A cosine threshold named as a ratio.** `--target-mask-ratio 0.5` is compared with cosine similarities
#   (`generate_mask`), so the upper limit 0.5 is not enforced as a ratio. Our threshold is called `sim_threshold`
#   and the ratios are `lower` and `upper`.
# * **PGS$_{0.3}$ removes exactly 30 %.** `min_p` adds `int(boundary_mask.sum(-1).min())`, about half the patches for a
#   min-max-normalised noise map, so `len_keep` is nearly always `int(0.7 L)` = 137 of 196. Ours removes a count in
#   [0.3, 0.5] per batch, 0.4 on average, calibrated to the paper's 0.6x relative training time (table above).
#
# The recipe (`clip-train.sh`): batch 512 x 8 GPUs = 4096, lr 1e-3, 32 epochs on CC12M (10,968,539 samples), weight
# decay 0.2 (open_clip's default), **`--warmup 10000`** steps (about 3.7 of the ~2,678 steps per epoch),
# `--force-patch-dropout 0.05` (the seeds), `--min-mask-ratio 0.3` / `0.5`, `--use-ed --use-otn`. The `clip-pgs` preset
# follows it; PowerCLIP's paper (Sec. 5.1) adopts "the training setting of [47, 60]", [47] being CLIP-PGS, so the
# `paper` preset warms up for 10,000 steps too.
#
# **Which variant the PowerCLIP paper compares with.** Its "C-PGS" rows (Tables 1-4 and 9) are CLIP-PGS$_{0.3}$'s
# numbers from the CLIP-PGS paper (e.g. Table 1's average 39.5 = CLIP-PGS Table 1's PGS$_{0.3}$; PGS$_{0.5}$ averages
# 37.6): a comparison with PowerCLIP's tables should run `clip-pgs-0.3`.

# %% [markdown]
# ## Pieces
#
# Everything below is a pure function of tensors; the grid is row-major (index `row * gw + col`), the order of
# open_clip's patch tokens. First the per-patch views of an image: the pixel vectors and the Sobel edge strength.

# %%
#| export
def patch_pixels(image: torch.Tensor, patch: int) -> torch.Tensor:
    "image `(C, 3, H, W)` -> `(C, N, 3 * patch**2)`: each patch's pixels, patches row-major."
    C, ch, H, W = image.shape
    if H % patch or W % patch:
        raise ValueError(f"image {H}x{W} is not a multiple of the patch size {patch}")
    x = image.reshape(C, ch, H // patch, patch, W // patch, patch)       # (C, 3, gh, p, gw, p)
    return x.permute(0, 2, 4, 1, 3, 5).reshape(C, (H // patch) * (W // patch), ch * patch * patch)


_SOBEL_X = torch.tensor([[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0], [-1.0, 0.0, 1.0]])


def sobel_kernels(like: torch.Tensor) -> torch.Tensor:
    """`(2, 1, 3, 3)` Sobel d/dx, d/dy (`_SOBEL_X` and its transpose) in `like`'s dtype, made on its device (no copy
    from the host, which a GPU would wait for)."""
    d = torch.arange(-1, 2, device=like.device, dtype=like.dtype)      # (3,) -1, 0, 1: the derivative
    kx = (2 - d.abs())[:, None] * d[None, :]                           # (3, 3) smoothing 1, 2, 1 down the rows
    return torch.stack([kx, kx.T])[:, None]


def sobel_patch_edges(image: torch.Tensor, patch: int) -> torch.Tensor:
    """image `(C, 3, H, W)` -> `(C, N)`: mean Sobel gradient magnitude inside each patch, the filter run on the
    whole image (replicate padding: the image border is no edge), per channel, magnitudes averaged over channels."""
    C, ch, H, W = image.shape
    if H % patch or W % patch:
        raise ValueError(f"image {H}x{W} is not a multiple of the patch size {patch}")
    x = image.to(torch.promote_types(image.dtype, torch.float32))
    x = F.pad(x, (1, 1, 1, 1), mode="replicate")                        # (C, 3, H+2, W+2)
    k = sobel_kernels(x)                                                # (2, 1, 3, 3): d/dx, d/dy
    g = F.conv2d(x.reshape(C * ch, 1, H + 2, W + 2), k)                 # (C*3, 2, H, W)
    mag = g.square().sum(1).sqrt().reshape(C, ch, H, W).mean(1)         # (C, H, W)
    return F.avg_pool2d(mag[:, None], patch).flatten(1)                 # (C, N)


# %% [markdown]
# An image of two halves meets at one vertical line: the patches on either side of that line carry the edge,
# the flat patches none; a constant shift of the pixels (what per-patch mean subtraction does locally) changes nothing
# inside a flat region, which is why the response must come from the whole image, not from each patch alone.

# %%
_img = torch.zeros(1, 3, 32, 32)
_img[..., 16:] = 1.0                  # 4 x 4 grid of 8-px patches
_e = sobel_patch_edges(_img, 8).reshape(4, 4)
print(_e)
assert (_e[:, 1] > 0).all() and (_e[:, 2] > 0).all() and (_e[:, [0, 3]] == 0).all()
assert_close(sobel_patch_edges(_img + 5.0, 8), sobel_patch_edges(_img, 8))
_px = patch_pixels(torch.arange(2 * 3 * 16 * 16.0).reshape(2, 3, 16, 16), 8)
assert _px.shape == (2, 4, 192) and _px[0, 1, 0] == 8 and _px[0, 2, 0] == 8 * 16  # patch (0,1) starts at column 8


# %% [markdown]
# The similarity of Sec. 3.2: cosine matrices of features and pixels, mixed with the weight $\alpha$ of the
# training progress, and the Sinkhorn normalisation. Plain Sinkhorn alternately rescales the rows and the columns of
# $K=\exp(S/\varepsilon)$ to sum to one. Our $S$ is symmetric, and then the doubly stochastic scaling is
# symmetric too, $P = DKD$ (it is unique for a positive matrix); the symmetric iteration
# $d \leftarrow \sqrt{d / (Kd)}$ (Knight, 2008) reaches it in about 10 steps where the alternating one crawls
# (below: after 200 alternating steps the error on a matrix of many near-identical background patches is
# still 100 times larger). Both run in the log domain, so a small $\varepsilon$ cannot overflow; the alternating one stays
# here as the oracle.

# %%
#| export
def cosine_matrix(x: torch.Tensor) -> torch.Tensor:
    "x `(C, N, D)` -> `(C, N, N)` cosine similarities (at least float32; a zero vector has similarity 0 to everything)."
    x = F.normalize(x.to(torch.promote_types(x.dtype, torch.float32)), dim=-1)
    return x @ x.transpose(1, 2)


def mix_weight(progress: float, start: float = 0.0, end: float = 1.0) -> float:
    """alpha of `S = alpha * S_feat + (1 - alpha) * S_pix`: linear from `start` to `end` over training progress in [0,
    1]."""
    p = min(max(float(progress), 0.0), 1.0)
    return start + (end - start) * p


def sinkhorn(S: torch.Tensor, iters: int = 20, eps: float = 0.05) -> torch.Tensor:
    """S `(C, N, N)` symmetric -> `(C, N, N)` doubly stochastic `D exp(S / eps) D` (symmetric Sinkhorn: the
    damped update d <- sqrt(d / (K d)), in the log domain)."""
    logk = S.to(torch.promote_types(S.dtype, torch.float32)) / eps
    log_d = logk.new_zeros(logk.shape[:2])                # (C, N) log of the diagonal scaling
    for _ in range(iters):
        log_d = 0.5 * (log_d - torch.logsumexp(logk + log_d[:, None, :], dim=2))
    return (logk + log_d[:, :, None] + log_d[:, None, :]).exp()


# %%
def _sinkhorn_alternating(S, iters, eps):
    "The textbook iteration: rows, then columns, to sum to one (the oracle)."
    logk = S.float() / eps
    log_r, log_c = torch.zeros(S.shape[:2]), torch.zeros(S.shape[:2])
    for _ in range(iters):
        log_r = -torch.logsumexp(logk + log_c[:, None, :], dim=2)
        log_c = -torch.logsumexp(logk + log_r[:, :, None], dim=1)
    return (logk + log_r[:, :, None] + log_c[:, None, :]).exp()

def _ds_err(P): return float(max((P.sum(1) - 1).abs().max(), (P.sum(2) - 1).abs().max()))

_g = torch.Generator().manual_seed(0)
_S = cosine_matrix(torch.randn(3, 64, 16, generator=_g))
assert_close(_S.diagonal(dim1=1, dim2=2), torch.ones(3, 64))
assert_close(_S, _S.transpose(1, 2))
assert mix_weight(0) == 0 and mix_weight(0.25, 0.2, 1.0) == 0.4 and mix_weight(7) == 1
# many near-identical background patches (cosines close to 1) and a few others: the hard case
_bg = torch.randn(1, 1, 16, generator=_g).expand(2, 48, 16) + 0.05 * torch.randn(2, 48, 16, generator=_g)
_Sbg = cosine_matrix(torch.cat([_bg, torch.randn(2, 16, 16, generator=_g)], 1))
for _name, _SS in [("random features", _S), ("background-heavy", _Sbg)]:
    _P = sinkhorn(_SS)
    print(f"{_name:17s} symmetric, 20 it.: max |row/col sum - 1| = {_ds_err(_P):.1e};  alternating, 200 it.: "
          f"{_ds_err(_sinkhorn_alternating(_SS, 200, 0.05)):.1e}")
    assert _ds_err(_P) < 1e-3 and (_P >= 0).all() and torch.allclose(_P, _P.transpose(1, 2), atol=1e-6)
# the same unique scaling as the oracle where the oracle converges (a milder temperature)
assert_close(sinkhorn(_S, 50, 0.5), _sinkhorn_alternating(_S, 200, 0.5), atol=1e-6, rtol=1e-4)

# %% [markdown]
# The seeds must be random, but a function of the *sample*, not of the process or the batch it lands in (so two
# processes compute exactly what one process computes on the whole batch), and of the step (so each epoch
# draws new seeds, and a resumed run the same ones). `hash_uniform` is a counter-based generator: a 32-bit
# integer mixing function (the "lowbias32" finaliser) chained over (seed, step, sample index, patch index),
# in int64 arithmetic that never overflows (the 32-bit products are split in 16-bit halves). It lives in `40_methods`
# since FLIP (`43_flip`) keys its patch drop by sample in the same way (so that a micro-batch of an accumulated step
# replays its draws, `49c_accum`); this notebook imports it from there.

# %%
_u = hash_uniform(torch.arange(2000), step=3, seed=0, n=64)
assert _u.shape == (2000, 64) and (_u >= 0).all() and (_u < 1).all()
assert torch.equal(_u[5:9], hash_uniform(torch.arange(5, 9), 3, 0, 64))          # batch composition does not matter
assert not torch.equal(_u, hash_uniform(torch.arange(2000), 4, 0, 64))          # another step, other draws
assert not torch.equal(_u, hash_uniform(torch.arange(2000), 3, 1, 64))          # another seed, other draws
_h = torch.histc(_u, 10, 0, 1) / _u.numel()
print("decile frequencies:", [round(float(f), 4) for f in _h], " mean", round(float(_u.mean()), 4),
      " corr(neighbour columns)", round(float(torch.corrcoef(torch.stack([_u[:, 0], _u[:, 1]]))[0, 1]), 4))
assert (_h - 0.1).abs().max() < 0.005                                            # 128 000 draws: std ~ 0.0008
assert hash_uniform(torch.tensor([2**55 + 1]), 0, 0, 4).shape == (1, 4)         # 56-bit shard keys are fine


# %% [markdown]
# ## Selection
#
# `select_patches` takes the mixed similarity $S$ `(C, N, N)`, the edge scores `(C, N)` and uniform noise (or a
# `torch.Generator` to draw it), and returns which patches stay. The growth is a loop of `n_hi` steps over the
# whole batch at once; each step is a handful of `(C, N)` operations. Priorities: unmasked seeds first (unless
# edge-protected), then the highest $S'$ to the masked set, edge-protected patches last.

# %%
#| export
def drop_count(n: int, ratio: float) -> int:
    "Patches dropped out of `n` at `ratio`, with FLIP's rounding (open_clip `PatchDropout` keeps max(1, int(n(1-r))))."
    return n - max(1, int(n * (1 - ratio)))


def bucketed(n: int, lo: int, hi: int, multiple: int = 1) -> int:
    """`n` rounded to the nearest multiple of `multiple` (ties up), kept within [lo, hi]: a batch's drop count from a
    few values, so that a GPU sees few token counts (new shapes: new kernels and allocations). `multiple=1`: `n`."""
    if multiple <= 1:
        return n
    return min(max(multiple * ((2 * n + multiple) // (2 * multiple)), lo), hi)


def edge_protected(edges: torch.Tensor, top: float) -> torch.Tensor:
    "edges `(C, N)` -> `(C, N)` bool: the `round(top * N)` strongest-edge patches of each image (non-zero only)."
    C, N = edges.shape
    k = int(round(top * N))
    prot = torch.zeros(C, N, dtype=torch.bool, device=edges.device)
    if k > 0:
        prot.scatter_(1, edges.topk(k, dim=1).indices, True)
    return prot & (edges > 0)


@dataclass
class Selection:
    "What `select_patches` chose."
    keep: torch.Tensor     # (C, N - n_drop) long, kept patch indices, ascending
    order: torch.Tensor    # (C, n_hi) long, patches in the order they were masked
    counts: torch.Tensor   # (C,) long, each image's own count in [n_lo, n_hi] (PGS-0.3's per-image wish)
    n_drop: int            # patches dropped from every image of the batch
    seeds: torch.Tensor    # (C, N) bool, the random candidates (before edge protection)
    protected: torch.Tensor  # (C, N) bool, edge-protected patches


def select_patches(sim: torch.Tensor, edges: torch.Tensor | None, n_seed: int, n_lo: int, n_hi: int,
                   noise: torch.Tensor | None = None, generator: torch.Generator | None = None,
                   edge_top: float = 0.25, sim_threshold: float = 0.84,
                   ot_iters: int = 20, ot_eps: float = 0.05, all_sum=None, multiple: int = 1) -> Selection:
    """sim `(C, N, N)` mixed cosine similarity, edges `(C, N)` (None: no edge protection), noise `(C, N)` uniform
    (None: drawn from `generator`) -> `Selection` dropping between `n_lo` and `n_hi` patches per image
    (`ot_iters=0`: no OT normalisation). `all_sum`: sums a tensor over the processes, so that the batch's count
    is the rounded mean over the *global* batch (None: this batch only); `multiple`: that count rounded to the
    nearest multiple of it within [n_lo, n_hi] (`bucketed`; 1: the rounded mean itself). Nothing here waits for the
    device but the count of the 0.3 variant (n_lo < n_hi), which sizes the kept tokens."""
    C, N, _ = sim.shape
    if not 1 <= n_seed <= n_hi or not 0 <= n_lo <= n_hi < N:
        raise ValueError(f"need 1 <= n_seed <= n_hi, 0 <= n_lo <= n_hi < N; got n_seed={n_seed}, "
                         f"n_lo={n_lo}, n_hi={n_hi}, N={N}")
    dev, ar = sim.device, torch.arange(C, device=sim.device)
    if noise is None:
        noise = torch.rand(C, N, generator=generator).to(dev)
    sim = sim.to(torch.promote_types(sim.dtype, torch.float32))
    rank_sim = sim + N * sinkhorn(sim, ot_iters, ot_eps) if ot_iters > 0 else sim   # S' (C, N, N)
    seeds = torch.zeros(C, N, dtype=torch.bool, device=dev)
    seeds.scatter_(1, noise.topk(n_seed, dim=1, largest=False).indices, True)
    prot = edge_protected(edges, edge_top) if edges is not None else torch.zeros_like(seeds)
    active = seeds & ~prot                                                # protected seeds are retained
    lonely = ~active.any(1, keepdim=True)                                 # (C, 1) every seed protected: keep one,
    first = (noise + 2.0 * prot).argmin(1, keepdim=True)                  # (C, 1) the first unprotected one by noise
    active |= torch.zeros_like(active).scatter_(1, first, True) & lonely
    big = 4.0 * (N + 2)                                                   # > any |S'| (<= 1 + N)
    masked = torch.zeros_like(seeds)
    best_rank = sim.new_full((C, N), -big)                     # max S' to the masked set
    best_cos = sim.new_full((C, N), -1.0)                      # max S to the masked set
    order, gains = [], []
    for _ in range(n_hi):
        prio = torch.where(active, 2 * big, best_rank) - big * prot.to(sim.dtype)
        prio = prio.masked_fill(masked, -math.inf)
        j = prio.argmax(1)                                                # (C,)
        gains.append(torch.where(active[ar, j], 2.0, best_cos[ar, j]))   # seeds always count
        order.append(j)
        masked[ar, j] = True
        active[ar, j] = False
        best_rank = torch.maximum(best_rank, rank_sim[ar, j])
        best_cos = torch.maximum(best_cos, sim[ar, j])
    order = torch.stack(order, 1)                                         # (C, n_hi)
    want = (torch.stack(gains, 1) >= sim_threshold).long().cumprod(1).sum(1)   # (C,) prefix above threshold
    counts = want.clamp(n_lo, n_hi)
    if n_lo == n_hi:
        n_drop = n_hi
    else:                                                                 # round(sum / images), in integers
        tot = torch.stack([counts.sum(), torch.full_like(counts[0], C)])  # (2,) made on the device: no copy
        if all_sum is not None:
            tot = all_sum(tot)
        n_drop = bucketed(int((2 * tot[0] + tot[1]) // (2 * tot[1])), n_lo, n_hi, multiple)   # the one host read
    keep_mask = torch.ones(C, N, dtype=torch.bool, device=dev)
    keep_mask.scatter_(1, order[:, :n_drop], False)
    # the kept patches first, each image's in ascending order (a stable sort: no `nonzero`, whose size the host reads)
    keep = torch.sort(keep_mask.to(torch.uint8), dim=1, descending=True, stable=True).indices[:, :N - n_drop]
    return Selection(keep, order, counts, n_drop, seeds, prot)


# %% [markdown]
# Checks on random similarities: the same noise gives the same choice; the generator path is deterministic
# from its seed; the counts respect the limits; the kept indices are distinct and sorted; seeds that are not
# protected are masked first.

# %%
def _rand_inputs(C=6, N=64, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return cosine_matrix(torch.randn(C, N, D, generator=g)), torch.rand(C, N, generator=g), g

_S, _E, _g = _rand_inputs()
_n_lo, _n_hi = drop_count(64, 0.3), drop_count(64, 0.5)
print("N = 64: drop between", _n_lo, "and", _n_hi)
_a = select_patches(_S, _E, 3, _n_lo, _n_hi, generator=torch.Generator().manual_seed(1))
_b = select_patches(_S, _E, 3, _n_lo, _n_hi, generator=torch.Generator().manual_seed(1))
_c = select_patches(_S, _E, 3, _n_lo, _n_hi, generator=torch.Generator().manual_seed(2))
assert torch.equal(_a.keep, _b.keep) and torch.equal(_a.order, _b.order) and not torch.equal(_a.order, _c.order)
for s in (_a, _c, select_patches(_S, _E, 3, 32, 32, noise=torch.rand(6, 64, generator=_g))):
    N_keep = s.keep.shape[1]
    assert 0.3 <= s.n_drop / 64 <= 0.5 and N_keep == 64 - s.n_drop
    assert ((s.counts >= _n_lo) & (s.counts <= _n_hi)).all()
    assert (s.keep.diff(dim=1) > 0).all()                                          # distinct, ascending
    assert all(len(set(o.tolist())) == s.order.shape[1] for o in s.order)          # nothing masked twice
    kept = torch.zeros(6, 64, dtype=torch.bool).scatter_(1, s.keep, True)
    assert not kept.gather(1, s.order[:, :s.n_drop]).any()                         # the dropped are not kept
    act = s.seeds & ~s.protected
    assert act.gather(1, s.order[:, :1])[act.any(1)].all()                          # an unprotected seed goes first
print("PGS-0.3 per-image counts:", _a.counts.tolist(), "-> batch drops", _a.n_drop)

# %% [markdown]
# **Nothing here waits for a GPU** but the 0.3 variant's count (issue 38): a training step on a GPU runs ahead of the
# device until the host needs a value, and each such read stalls the queue while the host goes on launching the next
# of the selection's few hundred small operators. The image whose seeds are all protected gets its seed by a scatter
# (not by boolean-mask indexing, which reads the mask's count), the kept indices come from a stable sort of the keep
# mask (not `nonzero`, which reads its size), and the Sobel kernels are made on the device. The kept indices are the
# ones `nonzero` gives, in the same order; `drop_multiple` rounds PGS$_{0.3}$'s batch count to a multiple (8 keeps a
# ViT-B/16 step among 7 token counts instead of 40; the default, 1, is the rounded mean), within the limits.

# %%
for _s in (_a, _c):
    _km = torch.ones(6, 64, dtype=torch.bool).scatter_(1, _s.order[:, :_s.n_drop], False)
    assert torch.equal(_s.keep, _km.nonzero()[:, 1].reshape(6, 64 - _s.n_drop))            # the oracle: nonzero
_ed = torch.rand(6, 64, generator=_g) + 0.1                 # seeds = the strongest edges: every seed protected
_lone = select_patches(_S, _ed, 3, 32, 32, noise=1 - _ed / 2)
assert (_lone.seeds & ~_lone.protected).sum() == 0 and _lone.keep.shape == (6, 32)
assert torch.equal(_lone.order[:, 0], (1 - _ed / 2 + 2.0 * _lone.protected).argmin(1))     # the first unprotected
assert torch.equal(sobel_kernels(torch.zeros(1))[:, 0], torch.stack([_SOBEL_X, _SOBEL_X.T]))
test_eq([bucketed(n, 59, 98, 8) for n in (59, 60, 63, 64, 67, 68, 95, 97, 98)], [59, 64, 64, 64, 64, 72, 96, 96, 96])
test_eq(bucketed(77, 59, 98), 77)
_b8 = select_patches(_S, _E, 3, _n_lo, _n_hi, generator=torch.Generator().manual_seed(1), multiple=8)
assert _b8.n_drop % 8 == 0 and _n_lo <= _b8.n_drop <= _n_hi and abs(_b8.n_drop - _a.n_drop) <= 4, _b8.n_drop
print(f"PGS-0.3's batch count {_a.n_drop}, rounded to a multiple of 8: {_b8.n_drop}")

# %% [markdown]
# ## The edge test: what the selection keeps
#
# An image of a smooth grey gradient with one textured object, a 4 x 4 block of patches of random pixels
# (strong edges everywhere inside it) in a grid of 8 x 8. The edge-protected patches are the object's. Over
# many random seeds, PGS$_{0.5}$ keeps the object's patches far more often than FLIP's uniform dropout
# (open_clip's `PatchDropout`, which keeps each patch with probability 1/2), and drops the redundant
# background instead. A Monte-Carlo count over 400 draws each; the standard error of a frequency is below 0.025.

# %%
from open_clip.transformer import PatchDropout

_H, _p = 64, 8
_gen = torch.Generator().manual_seed(0)
_img = torch.linspace(-1.0, 0.5, _H)[None, None, None, :].expand(1, 3, _H, _H).clone()   # smooth background
_img[..., 16:48, 16:48] = torch.randn(1, 3, 32, 32, generator=_gen)                      # textured object
_obj = torch.zeros(8, 8, dtype=torch.bool)
_obj[2:6, 2:6] = True
_obj = _obj.flatten()  # its 16 patches
_edges = sobel_patch_edges(_img, _p)                                                       # (1, 64)
_R = 400
_sim = cosine_matrix(patch_pixels(_img, _p)).expand(_R, -1, -1)                           # pixels only (alpha = 0)
_sel = select_patches(_sim, _edges.expand(_R, -1), 3, 32, 32, noise=hash_uniform(torch.arange(_R), 0, 0, 64))
assert torch.equal(_sel.protected[0], _obj)                                                # the object is protected
_kept_pgs = torch.zeros(_R, 64).scatter_(1, _sel.keep, 1.0)
torch.manual_seed(0)
_tok = torch.arange(65.0)[None, :, None].expand(_R, -1, 1)                                 # token t carries t
_kept_flip = torch.zeros(_R, 65).scatter_(1, PatchDropout(0.5).train()(_tok)[..., 0].long(), 1.0)[:, 1:]
_f_pgs, _f_flip = float(_kept_pgs[:, _obj].mean()), float(_kept_flip[:, _obj].mean())
print(f"object patches (16 of 64) kept: PGS-0.5 {_f_pgs:.3f}, FLIP {_f_flip:.3f}; "
      f"background patches kept: PGS-0.5 {float(_kept_pgs[:, ~_obj].mean()):.3f}, FLIP "
      f"{float(_kept_flip[:, ~_obj].mean()):.3f}")
assert _f_pgs > _f_flip + 0.3
# without edge protection the similarity alone still favours the object: its random patches are dissimilar to
# each other and to the background, so they are the least redundant
_sel_ne = select_patches(_sim, None, 3, 32, 32, noise=hash_uniform(torch.arange(_R), 0, 0, 64))
_f_ne = float(torch.zeros(_R, 64).scatter_(1, _sel_ne.keep, 1.0)[:, _obj].mean())
print(f"object patches kept without edge protection: {_f_ne:.3f}")

# %%
import matplotlib.pyplot as plt

def _overlay(ax, img, keep, p, title):
    "The image (first channel) with dropped patches greyed out."
    g = img.shape[-1] // p
    kept = torch.zeros(g * g)
    kept[keep] = 1
    ax.imshow(img[0], cmap="gray")
    ax.imshow(kept.reshape(g, g).repeat_interleave(p, 0).repeat_interleave(p, 1) == 0,
                                              cmap="Reds", alpha=0.45, vmin=0, vmax=1)
    ax.set_title(title, fontsize=9)
    ax.axis("off")

_fig, _ax = plt.subplots(1, 4, figsize=(11, 3))
_ax[0].imshow(_edges.reshape(8, 8))
_ax[0].set_title("Sobel per patch", fontsize=9)
_ax[0].axis("off")
_overlay(_ax[1], _img[0], _sel.keep[0], _p, "PGS-0.5, draw 0 (red: dropped)")
_overlay(_ax[2], _img[0], _sel.keep[1], _p, "PGS-0.5, draw 1")
_overlay(_ax[3], _img[0], _kept_flip[0].nonzero()[:, 0], _p, "FLIP, draw 0")
plt.tight_layout()

# %% [markdown]
# ### On real photos
#
# COCO photos (`../shared/data/coco_sample`, the val photos with instance masks), squashed to 224 x 224 as a
# ViT-B/16 sees them ($N = 196$). Which share of the patches covered by an annotated object (at least half of
# the patch) does each scheme keep? PGS$_{0.5}$ here runs at the start of training ($\alpha = 0$: pixel
# similarity only, the feature half needs a trained model); 20 draws per photo. This is a measurement, not a
# claim: COCO backgrounds are busy, and edge protection favours texture wherever it is. The same photos
# calibrate PGS$_{0.3}$'s `sim_threshold` (the batch's drop ratio for a few thresholds); with $\alpha > 0$ the
# feature cosines of the model being trained enter, and the ratio a run actually uses is logged by the trainer
# as `_pgs_drop_ratio`.

# %%
from pathlib import Path
import json
import numpy as np
from PIL import Image
from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD

_DATA = next((p for p in (Path("../shared/data/coco_sample"), Path("../../shared/data/coco_sample")) if p.is_dir()),
             Path("../shared/data/coco_sample"))                                   # from the repo root or nbs/
if not (_DATA / "annotations" / "instances_val2017.json").is_file():
    print("skipped: ../shared/data/coco_sample is absent (real COCO photos)")
else:
    from powerclip.regions import coco_mask
    _inst = json.loads((_DATA / "annotations" / "instances_val2017.json").read_text())
    _by = {}
    for a in _inst["annotations"]:
        if isinstance(a["segmentation"], list):
            _by.setdefault(a["image_id"], []).append(a)
    _files = {im["id"]: im for im in _inst["images"]}
    _ids = sorted(_by)[:40]
    _mean, _std = torch.tensor(OPENAI_DATASET_MEAN)[:, None, None], torch.tensor(OPENAI_DATASET_STD)[:, None, None]
    _imgs, _objs = [], []
    for i in _ids:
        im = _files[i]
        pil = Image.open(_DATA / "images" / im["file_name"]).convert("RGB")
        fg = np.any([coco_mask(a["segmentation"], im["height"], im["width"]) for a in _by[i]], axis=0)
        x = torch.from_numpy(np.asarray(pil.resize((224, 224), Image.BICUBIC), np.float32) / 255).permute(2, 0, 1)
        _imgs.append((x - _mean) / _std)
        m = torch.from_numpy(np.asarray(Image.fromarray(fg).resize((224, 224), Image.NEAREST), np.float32))
        _objs.append(F.avg_pool2d(m[None, None], 16).flatten() >= 0.5)               # (196,)
    _imgs, _objs = torch.stack(_imgs), torch.stack(_objs)                              # (P, 3, 224, 224), (P, 196)
    _P, _D = len(_ids), 20
    _edges = sobel_patch_edges(_imgs, 16)                                              # (P, 196)
    _simc = cosine_matrix(patch_pixels(_imgs, 16))                                      # (P, 196, 196)
    _ns, _hi = round(0.05 * 196), drop_count(196, 0.5)                                 # 10 seeds, 98 dropped
    _rows = []
    for _name, _lo_, _edge in [("PGS-0.5", _hi, True), ("PGS-0.5 without ED", _hi, False),
                               ("PGS-0.3", drop_count(196, 0.3), True)]:
        kept = torch.zeros(_D, _P, 196)
        drops = []
        for d in range(_D):
            s = select_patches(_simc, _edges if _edge else None, _ns, _lo_, _hi,
                               noise=hash_uniform(torch.arange(_P), d, 0, 196))
            kept[d].scatter_(1, s.keep, 1.0)
            drops.append(s.n_drop / 196)
        _rows.append((_name, float(kept[:, _objs].mean()), float(kept[:, ~_objs].mean()), float(np.mean(drops))))
    torch.manual_seed(0)
    _kf = torch.zeros(_D * _P, 197).scatter_(
        1, PatchDropout(0.5).train()(torch.arange(197.0)[None, :, None].expand(_D * _P, -1, 1))[..., 0].long(),
        1.0)[:, 1:]
    _rows.append(("FLIP 0.5", float(_kf.reshape(_D, _P, 196)[:, _objs].mean()),
                  float(_kf.reshape(_D, _P, 196)[:, ~_objs].mean()), 98 / 196))
    print(f"{_P} COCO photos, {int(_objs.sum())} object patches of {_objs.numel()}, {_D} draws each")
    # the calibration of PGS-0.3's sim_threshold: the batch's drop ratio against the threshold
    print("PGS-0.3 drop ratio by sim_threshold:",
          {t: round(select_patches(_simc, _edges, _ns, drop_count(196, 0.3), _hi,
          noise=hash_uniform(torch.arange(_P), 0, 0, 196), sim_threshold=t).n_drop / 196, 3)
           for t in (0.5, 0.8, 0.84, 0.9)})
    print(f"{'scheme':20s} {'object kept':>12s} {'background kept':>16s} {'drop ratio':>11s}")
    for r in _rows:
        print(f"{r[0]:20s} {r[1]:12.3f} {r[2]:16.3f} {r[3]:11.3f}")
    assert all(0.3 - 1e-9 <= r[3] <= 0.5 + 1e-9 for r in _rows)
    _fig, _ax = plt.subplots(2, 3, figsize=(7.5, 5), dpi=60)
    _sel5 = select_patches(_simc[:3], _edges[:3], _ns, _hi, _hi, noise=hash_uniform(torch.arange(3), 0, 0, 196))
    for k in range(3):
        rgb = (_imgs[k] * _std + _mean).clamp(0, 1)
        _ax[0, k].imshow(rgb.permute(1, 2, 0))
        _ax[0, k].axis("off")
        _ax[0, k].set_title(_files[_ids[k]]["file_name"], fontsize=8)
        kept = torch.zeros(196)
        kept[_sel5.keep[k]] = 1
        _ax[1, k].imshow((rgb
                          * kept.reshape(14, 14).repeat_interleave(16, 0).repeat_interleave(16, 1)).permute(1, 2, 0))
        _ax[1, k].axis("off")
        _ax[1, k].set_title("PGS-0.5 keeps (alpha = 0)", fontsize=8)
    plt.tight_layout()

# %% [markdown]
# ### On the built-in world
#
# The world's scenes are a few flat shapes on a grey background with a little noise: almost every pair of background
# patches has a pixel cosine above 0.98 (measured below: the median over 256 scenes is 0.981 at the demo model's
# $8\times8$ grid). At the COCO threshold 0.84 the growth therefore never stops before the upper limit, and
# PGS$_{0.3}$ removes 50 % of the patches on every batch, which is PGS$_{0.5}$ (a comparison measured exactly that:
# 0.500 on every batch). The threshold must be calibrated on the data it runs on, as we did on COCO: on world batches
# at $\alpha=0$ the drop ratio falls from 0.47 to 0.31 between thresholds 0.982 and 0.985, and
# `WORLD_SIM_THRESHOLD = 0.984` gives a mean of about 0.38, the nearest to the 0.4 that the COCO calibration aims at
# (the ratio moves in steps of 1/64 at this grid). The comparison's CLIP-PGS row uses it (`70_compare`); as $\alpha$
# grows the model's feature cosines enter and the ratio a run actually uses is logged (`_pgs_drop_ratio`), which the
# comparison reports.

# %%
#| export
WORLD_SIM_THRESHOLD = 0.984   # PGS_0.3's sim_threshold on the built-in world at the demo model's 8 x 8 grid (below)

# %%
from powerclip.world import WorldConfig, generate, to_clip_tensor
_wimgs = torch.stack([to_clip_tensor(generate(WorldConfig(), i)["image"]) for i in range(256)])   # (256, 3, 64, 64)
_wN = 64
_wsim, _wedges = cosine_matrix(patch_pixels(_wimgs, 8)), sobel_patch_edges(_wimgs, 8)
print(f"pixel cosine of world patches: median {_wsim.flatten().median():.3f}")

def _world_drop(t: float) -> list[float]:
    "PGS_0.3's drop ratio on four world batches of 64 at alpha = 0, sim_threshold `t`."
    return [select_patches(_wsim[b:b + 64], _wedges[b:b + 64], round(0.05 * _wN), drop_count(_wN, 0.3),
                           drop_count(_wN, 0.5),
                           noise=hash_uniform(torch.arange(b, b + 64), 0, 0, _wN), sim_threshold=t).n_drop / _wN
            for b in range(0, 256, 64)]

_cal = {t: _world_drop(t) for t in (0.84, 0.98, 0.983, WORLD_SIM_THRESHOLD, 0.985, 0.99)}
print("PGS-0.3 drop ratio on world batches by sim_threshold:", {t: [round(r, 3) for r in v] for t, v in _cal.items()})
# COCO's threshold: always the upper limit
test_eq(set(_cal[0.84]), {0.5})
assert all(0.3 <= r <= 0.5 for r in _cal[WORLD_SIM_THRESHOLD]) and 0.35 <= np.mean(_cal[WORLD_SIM_THRESHOLD]) <= 0.45


# %% [markdown]
# ## The selection inside the vision tower
#
# The patches leave the token sequence `(C, 1 + N, width)` (class token first) right after the positional
# embedding, through `powerclip.model.select_patch_tokens`, the one mechanism every patch-dropping method uses
# (`43_flip`). Its `keep` function here is a `PGSSelector`, made by the method for one training forward pass and
# holding what the choice needs besides the tokens: the pixels, the noise, $\alpha$, and the positional embedding to
# subtract from the tokens (without an `index` key in the batch, the row number stands in for the sample id). It
# has no parameters and no buffers, so the checkpoint stays plain open_clip; at evaluation the method does not
# select, and outside its forward the model is the plain model.

# %%
#| export
@dataclass
class PGSConfig:
    "Options of CLIP-PGS; defaults are PGS_0.5 (paper Sec. 3.2) and our choices where the paper gives none."
    lower: float = 0.5          # lower limit of the masking ratio: 0.5 for PGS_0.5, 0.3 for PGS_0.3 (Sec. 3.2)
    upper: float = 0.5          # upper limit, 0.5 in both variants "following FLIP" (Sec. 3.2)
    seed_ratio: float = 0.05    # initial random (candidate) masking ratio: 5 % (Sec. 3.2; Fig. 6 ablation)
    edges: bool = True          # Sobel edge protection (ED, Table 6)
    edge_top: float = 0.25      # fraction of patches with the strongest edges that is protected (ours)
    ot: bool = True             # optimal-transport normalisation (OTN, Table 6)
    ot_iters: int = 20          # Sinkhorn iterations (ours: doubly stochastic within 1e-3)
    ot_eps: float = 0.05        # Sinkhorn temperature (ours: SwAV's value)
    alpha_start: float = 0.0    # weight of the feature similarity at the start of training (ours)
    alpha_end: float = 1.0      # ... at the end, linear in step / total in between (ours)
    sim_threshold: float = 0.84  # PGS_0.3: grow while the added patch has cosine >= this (ours, calibrated below)
    drop_multiple: int = 1      # PGS_0.3: the batch's drop count rounded to a multiple of this within the limits (ours:
                                # 8 keeps a GPU's token counts to a few shapes; 1, the default, is the rounded mean)

    def __post_init__(self):
        if not 0 <= self.lower <= self.upper < 1:
            raise ValueError(f"need 0 <= lower <= upper < 1, got {self.lower}, {self.upper}")
        if not 0 < self.seed_ratio <= self.upper:
            raise ValueError(f"seed_ratio must be in (0, upper], got {self.seed_ratio}")
        if not 0 <= self.edge_top < 1:
            raise ValueError(f"edge_top must be in [0, 1), got {self.edge_top}")
        if self.ot_iters < 1 or self.ot_eps <= 0:
            raise ValueError("need ot_iters >= 1 and ot_eps > 0")
        if not -1 <= self.sim_threshold <= 1:
            raise ValueError(f"sim_threshold is a cosine, in [-1, 1]; got {self.sim_threshold}")
        if self.drop_multiple < 1:
            raise ValueError(f"drop_multiple must be at least 1, got {self.drop_multiple}")

    def counts(self, n: int) -> tuple[int, int, int]:
        "(n_seed, n_lo, n_hi) for `n` patches."
        n_lo, n_hi = drop_count(n, self.lower), drop_count(n, self.upper)
        if n_hi < 1:
            raise ValueError(f"{n} patches at ratio {self.upper}: nothing to drop")
        return min(max(1, round(self.seed_ratio * n)), n_hi), n_lo, n_hi


class PGSSelector:
    """The `keep` of `select_patch_tokens` for one forward pass: x `(C, 1 + N, width)` -> kept patch indices `(C,
    N_keep)`."""
    def __init__(self, cfg: PGSConfig, patch: int, image: torch.Tensor, noise: torch.Tensor, alpha: float,
                 pos: torch.Tensor):
        self.cfg, self.patch = cfg, patch
        # (C, 3, H, W), (C, N), (), (1 + N, width)
        self.image, self.noise, self.alpha, self.pos = image, noise, alpha, pos
        self.last: Selection | None = None     # the choice of the last call (for logging and checks)
        self.all_sum = all_sum                 # the batch's count over the processes (an accumulated step: given)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        cfg, N = self.cfg, x.shape[1] - 1
        n_seed, n_lo, n_hi = cfg.counts(N)
        with torch.no_grad():
            feat = x[:, 1:] - self.pos[1:].to(x.dtype)                      # (C, N, width) content, no position
            pix = patch_pixels(self.image, self.patch)                      # (C, N, 3 p^2)
            if pix.shape[1] != N:
                raise ValueError(f"image has {pix.shape[1]} patches, the token sequence {N}")
            a = self.alpha
            sim = a * cosine_matrix(feat) + (1 - a) * cosine_matrix(pix)    # (C, N, N)
            edges = sobel_patch_edges(self.image, self.patch) if cfg.edges else None
            self.last = select_patches(sim, edges, n_seed, n_lo, n_hi, noise=self.noise, edge_top=cfg.edge_top,
                                       sim_threshold=cfg.sim_threshold, ot_iters=cfg.ot_iters if cfg.ot else 0,
                                       ot_eps=cfg.ot_eps, all_sum=self.all_sum, multiple=cfg.drop_multiple)
        return self.last.keep                                              # (C, N_keep) ascending


# %% [markdown]
# ## The method
#
# `CLIPPGS` is CLIP (its loss, its gathering) with a `forward` that, in training, runs `encode` inside
# `select_patch_tokens` with a `PGSSelector`. The trainer calls `on_step(step, total)` before every step; that fixes
# $\alpha$ and the step of the random stream. Outside the trainer (a notebook calling `forward` by hand), the
# method counts its own training forward calls instead. The random candidates come from the method's own stream,
# `self.seed`, which the trainer derives from the run seed. Two registered names, two presets of the paper:
# `clip-pgs` is PGS$_{0.5}$ and `clip-pgs-0.3` is PGS$_{0.3}$ (a subclass whose config defaults to
# `lower=0.3`); any other limits are `method_cfg.lower=...`.

# %% [markdown]
# **Gradient accumulation** (`49c_accum`). PGS$_{0.3}$'s drop count is the rounded mean of the images' own counts over
# the *global* batch, computed inside the forward pass: a micro-batch alone would round its own mean, and its images
# would lose another number of patches than in the whole batch. So an accumulated step first runs `accum_begin`: for
# each micro-batch the vision tower up to the selection only (`probe_selection`: the patch embedding, then it stops),
# which gives its images' counts; their sum over the micro-batches and the processes is then handed to every
# micro-batch's selection in place of its own `all_sum`. The candidates are keyed by sample (`hash_uniform`), so both
# passes of a micro-batch choose the same patches. PGS$_{0.5}$ drops a fixed count and needs nothing of the kind.

# %%
#| export
class _Probed(Exception):
    "Raised by `probe_selection` right after the selection: the rest of the forward pass is not needed."


def probe_selection(model, image: torch.Tensor, keep) -> None:
    """Run the vision tower on `image` `(C, 3, H, W)` up to the patch selection, call `keep(x)` (a selector, which
    records its choice) on its tokens, and stop there."""
    from powerclip.model import encode, select_patch_tokens  # late: keeps this module importable without open_clip
    def stop(x):
        keep(x)
        raise _Probed
    try:
        with select_patch_tokens(model, stop):
            encode(model, image, None, need_patches=False)
    except _Probed:
        pass


# %%
#| export
@register("clip-pgs")
class CLIPPGS(StepClock, CLIP):
    """CLIP-PGS_0.5: CLIP's loss with patch generation-to-selection in the vision tower during training, config
    `PGSConfig`."""
    Config = PGSConfig
    needs_patches = False

    def __init__(self, cfg=None, seed: int = 0):
        super().__init__(cfg, seed)
        self.last: Selection | None = None     # the selection of the last training forward pass
        self._total: torch.Tensor | None = None   # an accumulated step's (sum of counts, images), from accum_begin

    @property
    def alpha(self) -> float:
        progress = self.step / max(1, self.total - 1) if self.total else 0.0
        return mix_weight(progress, self.cfg.alpha_start, self.cfg.alpha_end)

    def _selector(self, model, batch) -> tuple[PGSSelector, int]:
        "This batch's selector (its noise keyed by sample and step) and the patch count N."
        image, v = batch["image"], model.visual
        patch = int(v.patch_size[0] if isinstance(v.patch_size, (tuple, list)) else v.patch_size)
        N = (image.shape[-2] // patch) * (image.shape[-1] // patch)
        keys = sample_keys(batch, image)
        sel = PGSSelector(self.cfg, patch, image, noise=hash_uniform(keys, self.step, self.seed, N), alpha=self.alpha,
                          pos=v.positional_embedding.detach())
        if self._total is not None:       # an accumulated step: the whole batch's total, summed beforehand
            sel.all_sum = lambda t: self._total.to(t.device)
        return sel, N

    def forward(self, model, batch, modules=None):
        from powerclip.model import encode, select_patch_tokens  # late: keeps this module importable without open_clip
        image = batch["image"]
        if not model.visual.training:                            # evaluation: every patch
            return encode(model, image, batch["tokens"], need_patches=False)
        sel, N = self._selector(model, batch)
        with select_patch_tokens(model, sel):
            out = encode(model, image, batch["tokens"], need_patches=False)
        self.tick()
        self.last = sel.last
        out["pgs_drop_ratio"] = torch.full((), sel.last.n_drop / N, device=image.device)   # a fill: no host copy
        return out

    def accum_begin(self, model, micro_batches, modules=None, dist=None):
        "PGS-0.3: every image's count, over all micro-batches and processes, before any micro-batch's forward pass."
        if self.cfg.lower == self.cfg.upper or not model.visual.training:
            return                                   # PGS-0.5: one fixed count, nothing shared
        tot = None
        for mb in micro_batches:
            sel, _ = self._selector(model, mb)
            sel.all_sum = None                       # this micro-batch's counts only
            probe_selection(model, mb["image"], sel)
            part = torch.stack([sel.last.counts.sum(), sel.last.counts.new_tensor(len(sel.last.counts))])
            tot = part if tot is None else tot + part
        self._total = all_sum(tot)

    def accum_end(self):
        self._total = None

    def loss(self, out, batch, dist):
        terms = super().loss(out, batch, dist)
        if "pgs_drop_ratio" in out:
            terms["_pgs_drop_ratio"] = out["pgs_drop_ratio"]
        return terms


@dataclass
class PGS03Config(PGSConfig):
    "PGS_0.3: masking ratio between 0.3 and 0.5 (paper Sec. 3.2)."
    lower: float = 0.3


@register("clip-pgs-0.3")
class CLIPPGS03(CLIPPGS):
    "CLIP-PGS_0.3: as `clip-pgs`, with a masking ratio in [0.3, 0.5] per batch, config `PGS03Config`."
    Config = PGS03Config


# %% [markdown]
# ## Checks on a model
#
# The micro model (32 px, 8-px patches, $N=16$) with random weights: the state_dict keys do not change; in
# training the vision transformer sees $1 + N/2$ tokens (PGS$_{0.5}$) and the dropped patches are really absent
# (the tokens entering `ln_pre` are exactly the kept ones); in evaluation the embeddings are those of the plain
# model; the loss back-propagates; the same batch and step give the same loss; bf16 autocast gives no NaN.

# %%
from powerclip.dist import DistContext
from powerclip.methods import METHODS, get_method
from powerclip.model import create_model, encode, register_configs

register_configs()
assert METHODS["clip-pgs"] is CLIPPGS and METHODS["clip-pgs-0.3"] is CLIPPGS03
assert get_method("clip-pgs-0.3").cfg.lower == 0.3 and get_method("clip-pgs").cfg.lower == 0.5
for bad in ({"lower": 0.6}, {"seed_ratio": 0.0}, {"sim_threshold": 2.0}):
    try:
        get_method("clip-pgs", bad)
        raise AssertionError(bad)
    except ValueError as e:
        print("refused:", e)

torch.manual_seed(0)
_model = create_model("powerclip-micro")[0]
_keys = set(_model.state_dict())
_img = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(3))
_tok = torch.zeros(4, 77, dtype=torch.long)
_tok[:, 0], _tok[:, 1:4], _tok[:, 4] = 49406, 100, 49407
_batch = {"image": _img, "tokens": _tok, "index": torch.tensor([10, 11, 12, 13])}
_model.eval()
with torch.no_grad():
    _ref = encode(_model, _img, _tok, need_patches=False)

_m = get_method("clip-pgs")
_N = _model.visual.grid_size[0] * _model.visual.grid_size[1]
_seen = []
_hk = _model.visual.ln_pre.register_forward_hook(lambda mod, args, y: _seen.append(args[0].detach().clone()))
_model.train()
_m.on_step(0, 10)
_out = _m.forward(_model, _batch)
_sel = _m.last
# nothing left behind
assert set(_model.state_dict()) == _keys and isinstance(_model.visual.patch_dropout, torch.nn.Identity)
_model.eval()
with torch.no_grad():
    _ev = _m.forward(_model, _batch)
_hk.remove()
assert _seen[0].shape[1] == 1 + _N // 2 and _seen[1].shape[1] == 1 + _N, [s.shape for s in _seen]
# the tokens after selection are exactly the kept rows of the full sequence (eval pass: nothing dropped)
_W = _seen[0].shape[-1]
assert_close(_seen[0][:, 1:], _seen[1][:, 1:].gather(1, _sel.keep[..., None].expand(-1, -1, _W)))
assert_close(_seen[0][:, 0], _seen[1][:, 0])
for k in ("image", "text"):
    assert torch.equal(_ev[k], _ref[k])  # evaluation = the plain model, bit for bit
_terms = _m.loss(_out, _batch, DistContext())
_terms["clip"].backward()
assert (torch.isfinite(_terms["clip"]) and _model.visual.conv1.weight.grad is not None
        and _terms["_pgs_drop_ratio"] == 0.5)
print(f"tokens into the vision transformer: train {_seen[0].shape[1]}, eval {_seen[1].shape[1]} (N = {_N}); "
      f"loss {float(_terms['clip'].detach()):.4f}")
_model.train()
_m.on_step(0, 10)
_l1 = _m.loss(_m.forward(_model, _batch), _batch, DistContext())["clip"]
_m.on_step(0, 10)
_l2 = _m.loss(_m.forward(_model, _batch), _batch, DistContext())["clip"]
assert torch.equal(_l1, _l2)                                   # deterministic given (seed, step, index)
with torch.autocast("cpu", dtype=torch.bfloat16):
    _m.on_step(5, 10)
    _ob = _m.forward(_model, _batch)
    _lb = _m.loss(_ob, _batch, DistContext())["clip"]
assert torch.isfinite(_lb) and torch.isfinite(_ob["image"].float()).all()
print(f"bf16 autocast loss {float(_lb.detach()):.4f}, alpha at step 5 of 10 = {_m.alpha:.3f}")
_model.eval()
