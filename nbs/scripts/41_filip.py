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
#| default_exp baselines.filip

# %%
#| export
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from powerclip.dist import DistContext, gather
from powerclip.loss import clip_loss, contrastive_rows, symmetric_infonce
from powerclip.methods import GlobalScorer, Method, Scorer, register
from powerclip.model import text_token_mask

# %%
#| hide
from torch.autograd import gradcheck
from torch.testing import assert_close


# %% [markdown]
# # FILIP
#
# > Token-wise late interaction (Yao et al., ICLR 2022).
#
# An image and a caption are as similar as their patches are to their best-matching words, and their words to their
# best-matching patches.

# %% [markdown]
# FILIP replaces CLIP's one-vector-per-side similarity by a late interaction between the $N$ patch embeddings
# $x^I_{i,n}$ of image $i$ and the $L_j$ real token embeddings $x^T_{j,l}$ of caption $j$, all L2-normalised:
#
# $$s^I_{ij}=\frac1N\sum_{n=1}^{N}\max_{l\le L_j}\langle x^I_{i,n},x^T_{j,l}\rangle,\qquad
#   s^T_{ij}=\frac1{L_j}\sum_{l=1}^{L_j}\max_{n\le N}\langle x^I_{i,n},x^T_{j,l}\rangle .$$
#
# $s^I$ (image-to-text: every patch picks its word) is the logit matrix of the image-to-text InfoNCE, $s^T$
# (text-to-image: every word picks its patch) that of the text-to-image InfoNCE; the two matrices are *not*
# transposes of each other. The loss is $\frac12[\mathrm{CE}(s\,s^I, y)+\mathrm{CE}(s\,(s^T)^\top, y)]$ with the
# model's learnable logit scale $s$, exactly as the CLIP loss of `11_loss` with its similarities swapped.
#
# **Which tokens count.** `powerclip.model.text_token_mask` (see `30_model`): not padding and, by default, neither
# the start token (its output is the same for every caption) nor the end token (the pooled sentence embedding,
# which CLIP's loss already uses; FILIP is about words); an empty caption keeps its EOT so that its scores stay
# defined. `special_tokens=True` counts SOT and EOT as tokens too.
#
# **Patches.** All $N$ patch embeddings of the grid (the class token is not a patch). FILIP's own recipe also
# reduces the embedding dimension and gathers in half precision to save memory; here memory is bounded instead by
# computing the score matrices in chunks of captions (`chunk`).
#
# **Data parallel.** As in `11_loss`: a process computes its $R$ image rows of $s^I$ against the gathered captions
# and its $R$ caption rows of $(s^T)^\top$ against the gathered images, positives at `offset = rank * R`.

# %% [markdown]
# ## Scores
#
# One einsum gives the $(C_i, C_j, N, L)$ patch-token similarities of a chunk of captions; both scores are
# reductions of it. `max(...).values` (not `amax`) keeps only the argmax indices for the backward pass, so a
# chunk's 4-d tensor is freed once reduced. Reductions run in at least float32 (bf16 sums of 196 terms lose digits).

# %%
#| export
def filip_scores(
    patches: torch.Tensor,      # (Ci, N, D) L2-normalised patch embeddings
    tokens: torch.Tensor,       # (Cj, L, D) L2-normalised token embeddings
    token_valid: torch.Tensor,  # (Cj, L) bool, see `text_token_mask`; every caption needs one valid token
    chunk: int | None = None,   # captions per block of the (Ci, chunk, N, L) similarity tensor (None: all)
) -> tuple[torch.Tensor, torch.Tensor]:  # (s_i2t (Ci, Cj), s_t2i (Ci, Cj)), both indexed [image, caption]
    """FILIP's image-to-text (mean over patches of the max over words) and text-to-image (mean over words of the max
    over patches) scores."""
    if not token_valid.any(-1).all():
        raise ValueError("every caption needs at least one valid token")
    L = int(token_valid.any(0).nonzero().max()) + 1                        # slots after the longest caption: padding
    tokens, token_valid = tokens[:, :L], token_valid[:, :L]                 # (Cj, L', D): exact, and 77 -> ~15 slots
    dtype = torch.promote_types(torch.promote_types(patches.dtype, tokens.dtype), torch.float32)
    chunk = chunk or tokens.shape[0]
    i2t, t2i = [], []
    for j in range(0, tokens.shape[0], chunk):
        tok, val = tokens[j:j + chunk], token_valid[j:j + chunk]            # (c, L, D), (c, L)
        sim = torch.einsum("ind,jld->ijnl", patches, tok).to(dtype)         # (Ci, c, N, L)
        word_max = sim.masked_fill(~val[None, :, None, :], float("-inf")).max(-1).values  # (Ci, c, N)
        i2t.append(word_max.mean(-1))                                       # (Ci, c)
        patch_max = sim.max(2).values                                       # (Ci, c, L)
        t2i.append((patch_max * val).sum(-1) / val.sum(-1))                 # (Ci, c) masked mean over words
    return torch.cat(i2t, 1), torch.cat(t2i, 1)


# %% [markdown]
# Checked against the definition written as loops over pairs, patches and tokens, in float64:

# %%
def _naive_scores(p, t, v):
    "Per pair, per patch, per token loops: the definition above."
    Ci, Cj, N = p.shape[0], t.shape[0], p.shape[1]
    s_i2t, s_t2i = torch.zeros(Ci, Cj, dtype=p.dtype), torch.zeros(Ci, Cj, dtype=p.dtype)
    for i in range(Ci):
        for j in range(Cj):
            ls = [l for l in range(t.shape[1]) if v[j, l]]
            s_i2t[i, j] = sum(max(p[i, n] @ t[j, l] for l in ls) for n in range(N)) / N
            s_t2i[i, j] = sum(max(p[i, n] @ t[j, l] for n in range(N)) for l in ls) / len(ls)
    return s_i2t, s_t2i

def _inputs(C=4, N=5, L=6, D=3, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    p = F.normalize(torch.randn(C, N, D, generator=g, dtype=dtype), dim=-1)
    t = F.normalize(torch.randn(C, L, D, generator=g, dtype=dtype), dim=-1)
    ids = torch.zeros(C, L, dtype=torch.long)
    for c in range(C):                                   # captions of 0..L-2 words, SOT/EOT around them
        n = int(torch.randint(0, L - 1, (1,), generator=g))
        ids[c, 0] = 49406
        ids[c, 1:1 + n] = torch.randint(1, 49000, (n,), generator=g)
        ids[c, 1 + n] = 49407
    return p, t, ids

_p, _t, _ids = _inputs()
_v = text_token_mask(_ids)
for got, ref in zip(filip_scores(_p, _t, _v), _naive_scores(_p, _t, _v)):
    assert_close(got, ref)
for got, ref in zip(filip_scores(_p, _t, _v, chunk=3), filip_scores(_p, _t, _v)):
    assert_close(got, ref)
print(_ids.tolist())


# %% [markdown]
# ## Loss

# %%
#| export
def filip_loss(
    patches: torch.Tensor,           # (R, N, D) L2-normalised local patch embeddings
    tokens: torch.Tensor,            # (R, L, D) L2-normalised local token embeddings
    token_valid: torch.Tensor,       # (R, L) bool
    logit_scale: torch.Tensor,       # () exp of the learnable log-temperature
    patches_all: torch.Tensor | None = None,     # (C, N, D) gathered (None: the local ones)
    tokens_all: torch.Tensor | None = None,      # (C, L, D) gathered
    token_valid_all: torch.Tensor | None = None, # (C, L) gathered
    offset: int = 0,                 # rank * R
    chunk: int | None = None,        # see `filip_scores`
) -> torch.Tensor:                   # scalar
    "Symmetric InfoNCE on FILIP's token-wise scores: local image rows of s_i2t, local caption rows of s_t2i^T."
    # a pair: (s_i2t, s_t2i), both [image, caption]
    sim = lambda p, tv: filip_scores(p, tv[0], tv[1], chunk)
    txt_all = None if tokens_all is None else (tokens_all, token_valid_all)
    S_img, S_txt = contrastive_rows(sim, patches, (tokens, token_valid), patches_all, txt_all)  # (R, C) each
    return symmetric_infonce(logit_scale * S_img, logit_scale * S_txt, offset)


# %% [markdown]
# Against a per-sample loop over the naive scores (forward and gradient, float64); two simulated processes of
# two rows each, averaged, give the full-batch loss; `gradcheck` on tiny shapes.

# %%
def _naive_loss(p, t, v, s):
    s_i2t, s_t2i = _naive_scores(p, t, v)
    C = p.shape[0]
    return (sum(-torch.log_softmax(s * s_i2t[i], 0)[i] - torch.log_softmax(s * s_t2i[:, i], 0)[i]
                for i in range(C)) / (2 * C))

_s = torch.tensor(7.0, dtype=torch.float64)
_pa, _ta = _p.clone().requires_grad_(), _t.clone().requires_grad_()
_pb, _tb = _p.clone().requires_grad_(), _t.clone().requires_grad_()
_l, _ref = filip_loss(_pa, _ta, _v, _s), _naive_loss(_pb, _tb, _v, _s)
assert_close(_l, _ref)
_l.backward()
_ref.backward()
assert_close(_pa.grad, _pb.grad)
assert_close(_ta.grad, _tb.grad)
_parts = [filip_loss(_p[sl], _t[sl], _v[sl], _s, _p, _t, _v, off) for sl, off in ((slice(0, 2), 0), (slice(2, 4), 2))]
assert_close(sum(_parts) / 2, _l.detach())
assert gradcheck(lambda p, t: filip_loss(p, t, _v, _s), (_pa, _ta), eps=1e-6, atol=1e-5)
print(f"FILIP loss {float(_l.detach()):.4f} (naive {float(_ref.detach()):.4f})")

# %% [markdown]
# Finite under bf16 autocast at a ViT-B/16 grid ($N=196$, $L=77$) with a large logit scale:

# %%
_g = torch.Generator().manual_seed(1)
_P = torch.randn(4, 196, 32, generator=_g).requires_grad_()
_T = torch.randn(4, 77, 32, generator=_g).requires_grad_()
_ids77 = torch.zeros(4, 77, dtype=torch.long)
_ids77[:, 0] = 49406
_ids77[:, 1:9] = 5
_ids77[:, 9] = 49407
_args = (F.normalize(_P, dim=-1), F.normalize(_T, dim=-1), text_token_mask(_ids77), torch.tensor(100.0))
with torch.autocast("cpu", dtype=torch.bfloat16):
    _lb = filip_loss(*_args)
_lb.backward()
assert torch.isfinite(_lb) and torch.isfinite(_P.grad).all() and torch.isfinite(_T.grad).all()
_l32 = filip_loss(*(a.detach() for a in _args))
print(f"bf16 autocast: {float(_lb.detach()):.4f} ({_lb.dtype}), float32: {float(_l32):.4f}")
# the einsum runs in bf16 (similarities to ~4e-3, times the logit scale); reductions and the loss in float32
assert _lb.dtype == torch.float32 and abs(float(_lb.detach()) - float(_l32)) < 0.05 * float(_l32) + 0.05


# %% [markdown]
# ## The method
#
# Registered as `filip` in the trainer's registry (`powerclip.methods`). It normalises the projected patch and
# token embeddings of `powerclip.model.encode`, reads the token ids of the batch for the mask, and gathers
# patches, tokens and masks in one call (`powerclip.dist.gather`: one collective with gradient, one without). `clip_weight > 0` adds CLIP's global
# loss on top; FILIP as published trains on the token-wise loss alone (`clip_weight = 0`).

# %%
#| export
@dataclass
class FILIPConfig:
    special_tokens: bool = False  # count SOT and EOT as caption tokens (default: words only, see above)
    clip_weight: float = 0.0      # weight of an added global CLIP loss (FILIP as published: 0)
    chunk: int | None = None      # captions per similarity block, to bound memory (None: all at once)

    def __post_init__(self):
        if self.clip_weight < 0:
            raise ValueError(f"clip_weight must be >= 0, got {self.clip_weight}")
        if self.chunk is not None and self.chunk < 1:
            raise ValueError(f"chunk must be >= 1 or None, got {self.chunk}")


@register("filip")
class FILIP(Method):
    "FILIP (Yao et al. 2022): symmetric InfoNCE on token-wise late-interaction scores, config `FILIPConfig`."
    Config = FILIPConfig
    needs_patches = True

    def loss(self, out, batch, dist: DistContext):
        # (R, N, D), (R, L, D)
        patches, tokens = F.normalize(out["patches"], dim=-1), F.normalize(out["tokens"], dim=-1)
        valid = text_token_mask(batch["tokens"].to(tokens.device), self.cfg.special_tokens)    # (R, L)
        s = out["logit_scale"]
        local = {"patches": patches, "tokens": tokens, "token_valid": valid}
        if self.cfg.clip_weight > 0:
            local.update(image=out["image"], text=out["text"])
        g = gather(dist, local)
        a = g.all
        terms = {"filip": filip_loss(patches, tokens, valid, s, a["patches"], a["tokens"], a["token_valid"], g.offset,
                                     self.cfg.chunk)}
        if self.cfg.clip_weight > 0:
            terms["clip"] = (self.cfg.clip_weight
                             * clip_loss(out["image"], out["text"], s, a["image"], a["text"], g.offset))
        terms["_logit_scale"] = s.detach()
        return terms

    def scorers(self, modules=None) -> dict[str, Scorer]:
        "Late interaction first (FILIP's own way of scoring), then the global cosine every method offers."
        return {"late": LateInteractionScorer(self.cfg.special_tokens, self.cfg.chunk), "global": GlobalScorer()}


# %% [markdown]
# ## Scoring at evaluation
#
# A FILIP model is evaluated as it is trained: by token-wise late interaction, not by its pooled vectors. The late
# score of image $i$ and caption $j$ is the mean of the two directions, $\frac12(s^I_{ij}+s^T_{ij})$, as FILIP
# scores pairs at inference, with the same tokens counted as in training (`special_tokens`). The features the
# evaluator caches are the L2-normalised patch embeddings of each image `(N, D)` and the normalised token
# embeddings of each caption `(L, D)` with their validity; the scores are computed in blocks of images and captions,
# so that the $(I, T, N, L)$ similarity tensor never exists at once.

# %%
#| export
class LateInteractionScorer(Scorer):
    "FILIP's inference score: the mean of the image-to-text and text-to-image token-wise similarities."
    name = "late"

    def __init__(self, special_tokens: bool = False, chunk: int | None = None, image_block: int = 128):
        self.special_tokens = special_tokens   # count SOT and EOT (as the method's config)
        self.chunk = chunk or 64               # captions per similarity block
        self.image_block = image_block         # images per similarity block

    @torch.no_grad()
    def image_features(self, model, images):
        from powerclip.model import encode
        return {"patches": F.normalize(encode(model, images, None)["patches"], dim=-1).float()}   # (B, N, D)

    @torch.no_grad()
    def text_features(self, model, tokens):
        from powerclip.model import encode
        return {"tokens": F.normalize(encode(model, None, tokens)["tokens"], dim=-1).float(),     # (B, L, D)
                "token_valid": text_token_mask(tokens, self.special_tokens).cpu()}                # (B, L)

    def scores(self, img, txt):
        p, dev = img["patches"], img["patches"].device
        t, v = txt["tokens"].to(dev), txt["token_valid"].to(dev)
        rows = []
        for i in range(0, p.shape[0], self.image_block):
            s_i2t, s_t2i = filip_scores(p[i:i + self.image_block], t, v, self.chunk)   # (b, T) each
            rows.append((s_i2t + s_t2i) / 2)
        return torch.cat(rows, 0)                                                        # (I, T)


# %% [markdown]
# On model outputs built by hand (no model needed):

# %%
from powerclip.methods import METHODS, get_method

assert METHODS["filip"] is FILIP
_m = get_method("filip", {"clip_weight": 0.5})
_out = dict(image=F.normalize(torch.randn(4, 3, dtype=torch.float64), dim=-1),
            text=F.normalize(torch.randn(4, 3, dtype=torch.float64), dim=-1),
            patches=3 * _p, tokens=2 * _t, logit_scale=_s)   # encode's patches/tokens are not normalised
_terms = _m.loss(_out, {"tokens": _ids}, DistContext())
assert_close(_terms["filip"], _l.detach())
assert_close(_terms["clip"], 0.5 * clip_loss(_out["image"], _out["text"], _s))
print({k: round(float(v), 4) for k, v in _terms.items()})

# %% [markdown]
# The scorers on a model (the micro architecture, random weights): FILIP offers late interaction first and the
# global cosine second; the late scores are the mean of `filip_scores`' two directions on the normalised patch and
# token embeddings of `encode`, whatever the block sizes.

# %%
from powerclip.model import create_model, encode

torch.manual_seed(0)
_model = create_model("powerclip-micro")[0].eval()
_imgs = torch.randn(5, 3, 32, 32, generator=torch.Generator().manual_seed(2))
_tok = torch.zeros(3, 77, dtype=torch.long)
_tok[:, 0], _tok[0, 1:3], _tok[0, 3] = 49406, torch.tensor([320, 1929]), 49407
_tok[1, 1:5], _tok[1, 5], _tok[2, 1] = torch.tensor([320, 1000, 2000, 3000]), 49407, 49407   # caption 2 is empty
_sc = get_method("filip").scorers()
assert list(_sc) == ["late", "global"]
_fi, _ft = _sc["late"].image_features(_model, _imgs), _sc["late"].text_features(_model, _tok)
_S = _sc["late"].scores(_fi, _ft)
with torch.no_grad():
    _e = encode(_model, _imgs, _tok[[0, 1, 2, 0, 1]])
    _ref = filip_scores(F.normalize(_e["patches"], dim=-1), F.normalize(_e["tokens"][:3], dim=-1),
                        text_token_mask(_tok))
assert _S.shape == (5, 3)
assert_close(_S, (_ref[0] + _ref[1]) / 2)
assert_close(LateInteractionScorer(chunk=1, image_block=2).scores(_fi, _ft), _S)
print(_S)
