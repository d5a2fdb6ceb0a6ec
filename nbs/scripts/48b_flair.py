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

# %%
#| default_exp baselines.flair

# %%
#| export
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from powerclip.data import BatchNeeds
from powerclip.dist import DistContext, gather
from powerclip.methods import GlobalScorer, Method, Scorer, StepClock, hash_uniform, register, sample_keys

# %%
#| hide
from fastcore.test import test_eq, test_fail
from torch.testing import assert_close


# %% [markdown]
# # FLAIR
#
# > Text-conditioned attention pooling over sub-captions of long captions (Xiao et al., CVPR 2025).
#
# Every caption gets an image embedding of its own: the image's patch tokens pooled by attention whose query is the
# caption. FLAIR trains it with a sigmoid loss over $K$ sub-captions sampled from each image's long caption.

# %% [markdown]
# FLAIR's paper is not among this repository's papers; its public code (`ExplainableML/flair`, built on open_clip) is
# the specification, read for this notebook: `src/flair/model.py` (`FLAIR`), `src/flair/transformer.py`
# (`PureAttentionPoolingBlock`, `VisionPostProcess`), `src/flair/loss.py` (`FlairLoss`), `src/flair/data.py`
# (`sample_dict`: our `22b_subcaptions`) and `src/flair/train.py` (`--inference-with-flair`).
#
# **The towers.** FLAIR's image tower is CLIP's ViT with `ln_post` applied to every token, the class token projected
# as the global image embedding $v_i$ and the patch tokens projected by the same matrix as the local tokens
# $P_i \in \mathbb{R}^{N \times D}$ (class token excluded); the text tower's end token, projected, is the global text
# embedding $t$. These are exactly `powerclip.model.encode`'s `image`, `patches` and `text` (`30_model`), so the model
# stays plain open_clip. One difference: our `text` is already L2-normalised where FLAIR's query is not; the pooling's
# first step is a LayerNorm of the query, which removes the scale (up to its $\epsilon$).
#
# **The pooling** (`PureAttentionPoolingBlock`): multi-head attention (8 heads) whose query is the text, keys and
# values the patch tokens, each through its own LayerNorm, with `add_zero_attn` (a zero key and value appended, so a
# text may attend to nothing), no projection after it:
# $$v_{i\mid t} = \mathrm{MHA}(\mathrm{LN}_q(t),\ \mathrm{LN}_k(P_i),\ \mathrm{LN}_v(P_i)).$$
# It lives in the method's modules (`build_modules`), beside the sigmoid's bias $b$ (init $-10$, FLAIR's
# `init_logit_bias`); the scale $t = e^{t'}$ is the model's own logit scale (init $1/0.07$, clamped at $\ln 100$ by the
# trainer as by open_clip's loop).
#
# **The loss** (`FlairLoss` with `added_mps_loss=True`), on a batch of $B$ images with $K$ sub-captions each
# ($t_{j,k}$):
# - *text-conditioned* (tcs): image $i$ is paired with its own $K$ sub-captions (positives) and with one sub-caption of
#   every other image (negatives, which one drawn at random: `downsample_text_features`), $K + B - 1$ texts; each
#   pair's logit is $s\,\langle \hat v_{i\mid t}, \hat t\rangle + b$ (hats: L2-normalised), and
#   $$\mathcal L_{tcs} = \frac{1}{K + B - 1}\sum_{i=1}^{B}\sum_{t} -\log\sigma(y_{it}\,\mathrm{logit}_{it});$$
# - *multi-positive* (mps): the global image $v_i$ against all $BK$ sub-captions, positives its own $K$,
#   $$\mathcal L_{mps} = \frac{1}{BK}\sum_{i=1}^{B}\sum_{j,k} -\log\sigma(y_{i,jk}(s\,\langle\hat v_i,\hat t_{jk}\rangle + b));$$
# - the total $(\mathcal L_{tcs} + \mathcal L_{mps})/2$. Note the sums over the images are not averaged (FLAIR's code
#   divides by the number of texts per row only).
#
# **Across processes.** FLAIR exchanges text features around a ring (`neighbour_exchange`): each rank adds, for every
# other rank, a negatives-only loss of its own images against *that rank's* $(B, K + B - 1)$ texts (each of its
# images meets all $K$ sub-captions of the other rank's image in the same row and one of each of its other images),
# each term normalised by its own $K + B - 1$ and $BK$; the loss so grows with the number of ranks and depends on how
# the batch is split. We follow this repository's one contract instead (`15_dist`): the loss is FLAIR's loss of the
# *gathered* batch of $C$ images, each process computing its own rows (against $K + C - 1$ texts and all $CK$
# sub-captions) scaled by $C/R$, so that the mean over the processes is the loss of the whole batch, and two processes
# equal one (`tests/test_ddp.py`). The other images' sub-captions are chosen by a keyed hash of (run seed, step, the
# two sample ids) (`pair_uniform`), not by an unseeded draw on each rank: the choice does not depend on the process,
# the batch split or a micro-batch (`49c_accum`).
#
# **Sub-captions.** $K$ per image, 8 as FLAIR's recipes (`num_cap_per_img`), drawn by the data pipeline
# (`BatchNeeds(subcaptions=K)`, `22b_subcaptions`). FLAIR trains on the sub-captions only; the batch's whole caption
# is not read. On the world's short captions every sub-caption is the caption itself.
#
# **Scoring** (`--inference-with-flair`): the score of image $i$ and text $t$ is $\langle \hat v_{i\mid t}, \hat t\rangle$,
# the text-conditioned embedding of the pair (FLAIR multiplies by $s$, which does not change a ranking). The heat map
# of a text over an image is the pooling's attention weights, averaged over heads, on the $N$ patches (the zero key
# dropped), as FLAIR's `visualization.py` draws them.

# %% [markdown]
# ## The pooling

# %%
#| export
class AttentionPool(nn.Module):
    "FLAIR's `PureAttentionPoolingBlock`: MHA of LN(query) over LN(keys), LN(values), with add_zero_attn."
    def __init__(self, dim: int, heads: int = 8):
        super().__init__()
        if dim % heads:
            raise ValueError(f"the embedding dimension {dim} is not a multiple of {heads} heads")
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True, add_zero_attn=True)
        self.ln_q, self.ln_k, self.ln_v = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)

    def forward(self, q: torch.Tensor, kv: torch.Tensor, weights: bool = False):
        """q `(B, Q, D)` texts, kv `(B, N, D)` patch tokens -> `(B, Q, D)`; with `weights`, also the head-averaged
        attention `(B, Q, N + 1)` (the last column: the zero key)."""
        out, w = self.attn(self.ln_q(q), self.ln_k(kv), self.ln_v(kv), need_weights=weights)
        return (out, w) if weights else out


class FlairModules(nn.Module):
    "What FLAIR trains besides the model: the text-conditioned pooling and the sigmoid's bias b."
    def __init__(self, dim: int, heads: int = 8, init_bias: float = -10.0):
        super().__init__()
        self.pool = AttentionPool(dim, heads)
        self.logit_bias = nn.Parameter(torch.tensor(float(init_bias)))


# %% [markdown]
# A query attends to its own image's patches only, a text with no stake in them can attend to the zero key, and the
# output is the weighted sum of the value projections (checked against the attention written out for one head):

# %%
torch.manual_seed(0)
_pool = AttentionPool(8, heads=1).double()
_q, _kv = torch.randn(2, 3, 8, dtype=torch.float64), torch.randn(2, 5, 8, dtype=torch.float64)
_out, _w = _pool(_q, _kv, weights=True)
test_eq(tuple(_w.shape), (2, 3, 6))
_a = _pool.attn
_Wq, _Wk, _Wv = _a.in_proj_weight.chunk(3)
_bq, _bk, _bv = _a.in_proj_bias.chunk(3)
_k = torch.cat([_pool.ln_k(_kv) @ _Wk.T + _bk, torch.zeros(2, 1, 8, dtype=torch.float64)], 1)    # the zero key
_v = torch.cat([_pool.ln_v(_kv) @ _Wv.T + _bv, torch.zeros(2, 1, 8, dtype=torch.float64)], 1)
_att = torch.softmax((_pool.ln_q(_q) @ _Wq.T + _bq) @ _k.transpose(1, 2) / 8 ** 0.5, -1)          # (2, 3, 6)
assert_close(_w, _att)
assert_close(_out, (_att @ _v) @ _a.out_proj.weight.T + _a.out_proj.bias)
test_fail(lambda: AttentionPool(12, heads=8), contains="multiple")


# %% [markdown]
# ## The loss
#
# `pair_uniform` gives each (image, other image) pair a uniform number from the two sample ids, the run seed and the
# step (`hash_uniform` of `40_methods`, chained over the two ids); `conditioned_columns` picks, for each local image,
# its own $K$ sub-captions and one of every other image's, as indices into the gathered $(CK)$ sub-captions (own
# first: the loss is a sum, so the order FLAIR's sort gives them does not matter). No host sync: every index is
# built on the device from shapes the host knows.

# %%
#| export
def pair_uniform(row_keys: torch.Tensor, col_keys: torch.Tensor, step: int, seed: int) -> torch.Tensor:
    """`(R,)`, `(C,)` non-negative sample ids -> `(R, C)` uniform in [0, 1), a pure function of (seed, step, row id,
    column id)."""
    h = lambda k, s: (hash_uniform(k, step, s, 1)[:, 0] * (1 << 24)).long()       # 24-bit hash of each id
    pair = (h(row_keys, seed)[:, None] << 24) | h(col_keys, seed ^ 0x5A5A5A5A)[None, :]   # (R, C) 48 bits
    return hash_uniform(pair.flatten(), step, seed, 1).view(len(row_keys), len(col_keys))


def conditioned_columns(R: int, C: int, K: int, offset: int, u: torch.Tensor) -> torch.Tensor:
    """(R, K + C - 1) indices into the gathered (C K) sub-captions: local image i (global index offset + i) gets its
    own K, then one of each other image's, which one `floor(K u[i, j])` (u `(R, C)` from `pair_uniform`)."""
    dev = u.device
    rows = offset + torch.arange(R, device=dev)                      # (R,) global index of each local image
    own = rows[:, None] * K + torch.arange(K, device=dev)            # (R, K)
    j = torch.arange(C - 1, device=dev)[None, :]
    j = j + (j >= rows[:, None]).long()                              # (R, C - 1) every image but image i
    pick = (u.gather(1, j) * K).long().clamp_max(K - 1)              # (R, C - 1) which of its K
    return torch.cat([own, j * K + pick], 1)


def _f32(x: torch.Tensor) -> torch.Tensor:
    "At least float32 (the sigmoid's sums over K + C - 1 and C K terms lose digits in bf16); float64 stays."
    return x.to(torch.promote_types(x.dtype, torch.float32))


def flair_loss(
    image: torch.Tensor,          # (R, D) global image embeddings of the local images
    patches: torch.Tensor,        # (R, N, D) their projected patch tokens
    text: torch.Tensor,           # (R, K, D) their K sub-captions' global embeddings
    pool: nn.Module,              # AttentionPool
    scale: torch.Tensor,          # () t = exp(t')
    bias: torch.Tensor,           # () b
    u: torch.Tensor,              # (R, C) pair_uniform of (local, gathered) sample ids
    text_all: torch.Tensor | None = None,   # (C, K, D) gathered (None: the local ones)
    offset: int = 0,              # index of the first local image in the gathered batch
    mps: bool = True,             # FLAIR's added_mps_loss
) -> dict[str, torch.Tensor]:     # {'tcs': ..., 'mps': ...} summing to this process's share (see above)
    "FLAIR's loss (tcs + mps) / 2 of the gathered batch, this process's rows, scaled by C / R."
    R, K, _ = text.shape
    text_all = text if text_all is None else text_all
    C = text_all.shape[0]
    flat = text_all.flatten(0, 1)                                     # (C K, D)
    q = flat[conditioned_columns(R, C, K, offset, u)]                 # (R, K + C - 1, D)
    cond = F.normalize(_f32(pool(q, patches)), dim=-1)               # (R, K + C - 1, D) text-conditioned images
    logits = scale * (cond * F.normalize(_f32(q), dim=-1)).sum(-1) + bias
    y = torch.ones_like(logits)
    y[:, K:] = -1
    share, half = C / R, 0.5 if mps else 1.0
    terms = {"tcs": share * half * -F.logsigmoid(y * logits).sum() / (K + C - 1)}
    if mps:
        g = scale * F.normalize(_f32(image), dim=-1) @ F.normalize(_f32(flat), dim=-1).T + bias     # (R, C K)
        rows = offset + torch.arange(R, device=g.device)
        own = torch.arange(C * K, device=g.device)[None, :] // K == rows[:, None]
        terms["mps"] = share * half * -F.logsigmoid(torch.where(own, g, -g)).sum() / (C * K)
    return terms


# %% [markdown]
# Checked against FLAIR's computation written out in float64 on one process: its own $K$ first and one sub-caption of
# each other image, sums over images, divided by $K + B - 1$ and $BK$; two simulated processes (the gathered batch,
# rows split) give the same loss as their mean; each other image's pick is one of its $K$, and the picks differ
# between pairs.

# %%
def _ref_loss(image, patches, text, pool, s, b, pick):
    "FLAIR's FlairLoss on one process, with pick[i][j] the sub-caption of image j paired with image i."
    B, K, _ = text.shape
    tcs = mps = 0.0
    for i in range(B):
        texts = [text[i, k] for k in range(K)] + [text[j, pick[i][j]] for j in range(B) if j != i]
        q = torch.stack(texts)[None]
        v = F.normalize(pool(q, patches[i:i + 1])[0], dim=-1)
        for n, t in enumerate(texts):
            y = 1.0 if n < K else -1.0
            tcs = tcs - F.logsigmoid(torch.tensor(y) * (s * (v[n] @ F.normalize(t, dim=0)) + b))
        for j in range(B):
            for k in range(K):
                y = 1.0 if j == i else -1.0
                z = s * (F.normalize(image[i], dim=0) @ F.normalize(text[j, k], dim=0)) + b
                mps = mps - F.logsigmoid(torch.tensor(y) * z)
    return (tcs / (K + B - 1) + mps / (B * K)) / 2

_B, _K, _N, _D = 4, 3, 5, 8
_gen = torch.Generator().manual_seed(1)
_img, _pat = torch.randn(_B, _D, generator=_gen, dtype=torch.float64), torch.randn(_B, _N, _D, generator=_gen,
                                                                                     dtype=torch.float64)
_txt = torch.randn(_B, _K, _D, generator=_gen, dtype=torch.float64)
_pool = AttentionPool(_D, heads=2).double()
_s, _b = torch.tensor(3.0, dtype=torch.float64), torch.tensor(-1.0, dtype=torch.float64)
_keys = torch.tensor([7, 3, 11, 2])
_u = pair_uniform(_keys, _keys, step=5, seed=9)
_pick = (_u * _K).long().tolist()
_t = flair_loss(_img, _pat, _txt, _pool, _s, _b, _u)
assert_close(sum(_t.values()), _ref_loss(_img, _pat, _txt, _pool, _s, _b, _pick))
_parts = [flair_loss(_img[sl], _pat[sl], _txt[sl], _pool, _s, _b, _u[sl], _txt, off)
          for sl, off in ((slice(0, 2), 0), (slice(2, 4), 2))]
assert_close(sum(sum(p.values()) for p in _parts) / 2, sum(_t.values()))
assert len({tuple(r) for r in _pick}) > 1 and all(0 <= p < _K for r in _pick for p in r)
assert_close(pair_uniform(_keys[2:], _keys, 5, 9), _u[2:])                  # a function of the ids, not the rows
assert not torch.equal(pair_uniform(_keys, _keys, 6, 9), _u)                # another step draws anew
print({k: round(float(v), 4) for k, v in _t.items()})


# %% [markdown]
# ## The method
#
# Registered as `flair`. It asks the pipeline for $K$ sub-captions per image, encodes the $CK$ sub-captions and the
# images (`encode`: global embeddings and patch tokens), and computes the loss on the gathered sub-captions and sample
# ids (one collective each kind, `15_dist`). FLAIR pools by the class token (`pools = ('tok',)`). `modules_lr`: the
# pooling and $b$ train at the run's learning rate, as in FLAIR (one optimiser for everything).

# %%
#| export
@dataclass
class FLAIRConfig:
    K: int = 8                    # sub-captions per image (FLAIR's num_cap_per_img)
    heads: int = 8                # attention heads of the pooling (FLAIR's PureAttentionPoolingBlock)
    init_bias: float = -10.0      # the sigmoid's bias b at initialisation (FLAIR's init_logit_bias)
    mps: bool = True              # add the multi-positive loss on the global embeddings (FLAIR's added_mps_loss)

    def __post_init__(self):
        if self.K < 1 or self.heads < 1:
            raise ValueError(f"K and heads must be >= 1, got {self.K}, {self.heads}")


@register("flair")
class FLAIR(StepClock, Method):
    "FLAIR (Xiao et al. 2025): text-conditioned sigmoid loss over K sub-captions + multi-positive sigmoid loss."
    Config = FLAIRConfig
    needs_patches = True
    pools = ("tok",)

    def needs(self) -> BatchNeeds:
        return BatchNeeds(subcaptions=self.cfg.K)

    def prepare_batch(self, batch: dict) -> dict:
        "Checks that the batch holds K sub-captions per image (`sub_tokens (C, K, L)`)."
        batch = super().prepare_batch(batch)
        if batch["sub_tokens"].shape[1] != self.cfg.K:
            raise ValueError(f"FLAIR with K={self.cfg.K} got {batch['sub_tokens'].shape[1]} sub-captions per image")
        return batch

    def build_modules(self, model) -> FlairModules:
        return FlairModules(model.visual.output_dim, self.cfg.heads, self.cfg.init_bias)

    def forward(self, model, batch, modules=None):
        from powerclip.model import encode   # late: methods stay importable without open_clip loaded
        if not isinstance(modules, FlairModules):
            raise RuntimeError("FLAIR needs its pooling and bias: pass modules=method.build_modules(model)")
        sub = batch["sub_tokens"]                                            # (C, K, L)
        enc = encode(model, batch["image"], sub.flatten(0, 1))
        self.tick()
        return dict(image=enc["image"], patches=enc["patches"], text=enc["text"].unflatten(0, sub.shape[:2]),
                    logit_scale=enc["logit_scale"], flair=modules)

    def loss(self, out, batch, dist: DistContext):
        mods, text = out["flair"], out["text"]                               # (R, K, D)
        keys = sample_keys(batch, text)
        g = gather(dist, {"text": text, "keys": keys})
        u = pair_uniform(keys, g.all["keys"], self.step, self.seed)          # (R, C)
        terms = flair_loss(out["image"], out["patches"], text, mods.pool, out["logit_scale"], mods.logit_bias, u,
                           g.all["text"], g.offset, self.cfg.mps)
        terms |= {"_logit_scale": out["logit_scale"].detach(), "_logit_bias": mods.logit_bias.detach()}
        return terms

    def scorers(self, modules=None) -> dict[str, Scorer]:
        "The text-conditioned score first (FLAIR's --inference-with-flair), then the global cosine."
        return {"flair": FlairScorer(modules), "global": GlobalScorer()}


# %% [markdown]
# **Cost, and $K$ on the world.** A FLAIR step encodes $K$ texts per image and pools every image once per text it is
# paired with ($K + C - 1$ queries over $N$ patches). Measured on this repository's CPU (process time, one thread, the
# demo recipe's batch of 64 on `powerclip-demo-long` and long world captions, 4 steps after a warm-up, the machine
# shared and loaded): CLIP 0.73-0.75 CPU s per step, PowerCLIP-R 0.73, FLAIR 3.03 at $K = 8$ (4.1x CLIP's) and 1.65 at
# $K = 4$; building a batch costs 0.07 s (CLIP), 0.14 s (FLAIR, $K = 8$: 512 sub-captions tokenised) and 0.13 s
# (PowerCLIP's trees and boxes). $K$ stays FLAIR's 8: a 1,600-step run is then about 1.4 CPU hours against CLIP's
# 0.36, affordable for 8 seeds (about 20 CPU hours for CLIP, a sigmoid control, FLAIR and PowerCLIP-R together).
# Measured again with the trainer's whole step on the idle CPU (two threads, training paused; `python
# benchmarks/train_step_ratio.py --methods clip siglip flair powerclip:masks=random --set data.world.caption=long
# model.name=powerclip-demo-long --rounds 3 --tag demo_long_cpu`, medians of 3 alternating rounds): FLAIR's step is
# 5.1x CLIP's (1.23 s against 0.24), SigLIP's 1.02x, PowerCLIP-R's 1.21x; FLAIR's peak memory 880 MiB against CLIP's
# 54 (the CPU's peaks move by tens of MiB between rounds; this gap does not).

# %% [markdown]
# ## Scoring at evaluation
#
# The features cached are each image's patch tokens `(N, D)` and each text's global embedding; `scores` pools every
# image for every text, in blocks of images (`(b, T, N)` attention at a time). `heatmaps` gives the attention of each
# text over the patches of one image, the pointing game's map (`67_heatmaps`).

# %%
#| export
class FlairScorer(Scorer):
    "FLAIR's inference score: cosine of the text-conditioned image embedding with the text."
    name = "flair"

    def __init__(self, modules: FlairModules | None, image_block: int = 64):
        self.modules, self.image_block = modules, image_block

    def _pool(self) -> AttentionPool:
        if self.modules is None:
            raise ValueError("FLAIR's 'flair' scorer needs its trained pooling (method_modules.pt beside model.pt, "
                             "or a trainer checkpoint); none were found: evaluate with the 'global' scorer or give the "
                             "run folder")
        return self.modules.pool

    @torch.no_grad()
    def image_features(self, model, images):
        from powerclip.model import encode
        return {"patches": encode(model, images, None)["patches"].float()}              # (B, N, D)

    @torch.no_grad()
    def text_features(self, model, tokens):
        from powerclip.model import encode
        return {"text": encode(model, None, tokens)["text"].float()}                    # (B, D)

    @torch.no_grad()
    def scores(self, img, txt):
        pool = self._pool()
        p = img["patches"]
        par = next(pool.parameters())
        t = txt["text"].to(par.device, par.dtype)                                        # (T, D)
        rows = []
        for i in range(0, p.shape[0], self.image_block):
            kv = p[i:i + self.image_block].to(par.device, par.dtype)                     # (b, N, D)
            v = F.normalize(pool(t[None].expand(kv.shape[0], -1, -1), kv), dim=-1)      # (b, T, D)
            rows.append((v * F.normalize(t, dim=-1)[None]).sum(-1).float().to(p.device))      # (b, T)
        return torch.cat(rows, 0)                                                        # (I, T)

    @torch.no_grad()
    def heatmaps(self, model, image: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """image `(3, H, W)`, tokens `(T, L)` -> `(T, N)`: each text's head-averaged attention over the patches
        (FLAIR's attention map; the zero key dropped)."""
        pool = self._pool()
        p = self.image_features(model, image[None])["patches"]                          # (1, N, D)
        t = self.text_features(model, tokens)["text"]                                    # (T, D)
        par = next(pool.parameters())
        _, w = pool(t[None].to(par.device, par.dtype), p.to(par.device, par.dtype), weights=True)   # (1, T, N + 1)
        return w[0, :, :-1].float()
