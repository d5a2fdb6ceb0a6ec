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
#| default_exp baselines.c2lip

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
# # C2LIP concept losses
#
# > The noun-phrase concept (npc) and cross-attended concept (xac) sigmoid losses of C2LIP (paper `003` in `/work/shared/papers`), as pure functions: every image against every noun-phrase concept of the batch, positives being the concepts of its own caption.

# %% [markdown]
# C2LIP adds to SigLIP's sigmoid loss (Eq. 4) two concept losses (Eqs. 5, 7), total
# $\mathcal L=\mathcal L_{\text{contrastive}}+\lambda_{npc}\mathcal L_{npc}+\lambda_{xac}\mathcal L_{xac}$ with
# $\lambda_{npc}=1$, $\lambda_{xac}=0.01$ (Sec. 4.1). With $z_{ij}=+1$ when concept $j$ belongs to image $i$'s
# caption and $-1$ otherwise, learnable scale $t$ and bias $b$:
#
# $$\mathcal L_{npc}=-\frac1{|B|}\sum_{i}\sum_{j\le K}\log\sigma\big(z_{ij}(t\,v_i\cdot c_j+b)\big),\qquad
#   \mathcal L_{xac}=-\frac1{|B|}\sum_{i}\sum_{j\le K}\log\sigma\big(z_{ij}(t\,\hat v_i(c_j)\cdot c_j+b)\big),$$
#
# where $K$ is the number of concepts in the whole batch and $\hat v_i(c)=\sum_n \mathrm{softmax}_n(c\cdot v'_{i,n}/\sqrt D)\,v'_{i,n}$
# is image $i$'s patch embeddings $v'$ pooled with the concept as the attention query (Eq. 6, no new parameters).
#
# **Our choices, written down.** The attention uses the $1/\sqrt D$ scaling of dot-product attention (the paper
# does not print one); $\hat v$ is not re-normalised, so $\hat v\cdot c=\sum_n w_n\,(c\cdot v'_n)$ and the
# $(R, C, K, D)$ pooled tensor is never formed, only the $(R, C, K, N)$ scores. Concepts are passed padded,
# $(C, K, D)$ with a validity mask $(C, K)$. The sum over concepts is not averaged (as Eq. 5), so the loss grows with
# the number of concepts per batch. Data parallel: a process sums over its $R$ images against all gathered
# concepts and divides by $R$; the mean over processes is the full-batch loss.
#
# **Not done here (issue 6):** which parse nodes are noun phrases is not part of the batch contract (the batch
# carries `incidence` and `node_valid` but no node labels), so there is no registered `c2lip` method yet: it needs
# a batch key such as `node_np (C, K) bool` from `23_data` (from `ParsedCaption.labels == 'NP'`), a learnable bias
# (SigLIP's init $b=-10$), and SigLIP's sigmoid loss as the base term.

# %%
#| export
def concept_targets(
    R: int,                      # local images
    concept_valid: torch.Tensor, # (C, K) bool, the gathered concepts
    offset: int = 0,             # rank * R
) -> torch.Tensor:               # (R, C, K) float: +1 own caption's concepts, -1 others, 0 padding
    "z_ij of Eqs. 5 and 7 for the local images against every concept of the batch."
    C = concept_valid.shape[0]
    own = torch.arange(C, device=concept_valid.device)[None, :] == (torch.arange(R, device=concept_valid.device) + offset)[:, None]  # (R, C)
    z = torch.where(own[:, :, None], 1.0, -1.0).expand(R, C, concept_valid.shape[1])
    return z * concept_valid[None]                               # padding: 0, dropped by the masked sum


def _sigmoid_nll(logits: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    "(R, ...) logits and targets in {+1, -1, 0 = ignore} -> -(1/R) sum log sigma(z * logits)."
    z = z.to(logits.dtype)
    return -(F.logsigmoid(z * logits) * (z != 0)).sum() / logits.shape[0]


def npc_loss(
    image: torch.Tensor,          # (R, D) L2-normalised local image embeddings
    concepts: torch.Tensor,       # (C, K, D) L2-normalised concept embeddings of all captions (padded)
    concept_valid: torch.Tensor,  # (C, K) bool
    scale: torch.Tensor, bias: torch.Tensor,  # () SigLIP's t and b
    offset: int = 0,              # rank * R
) -> torch.Tensor:                # scalar
    "Noun-phrase concept loss (Eq. 5): each image against every concept, positives its own caption's."
    sim = torch.einsum("id,jkd->ijk", image, concepts)                              # (R, C, K)
    logits = scale * sim.to(torch.promote_types(sim.dtype, torch.float32)) + bias
    return _sigmoid_nll(logits, concept_targets(image.shape[0], concept_valid, offset))


def xac_loss(
    patches: torch.Tensor,        # (R, N, D) projected patch embeddings v' of the local images
    concepts: torch.Tensor,       # (C, K, D) concept embeddings of all captions (padded)
    concept_valid: torch.Tensor,  # (C, K) bool
    scale: torch.Tensor, bias: torch.Tensor,
    offset: int = 0,
) -> torch.Tensor:                # scalar
    "Cross-attended concept loss (Eqs. 6-7): the concept pools each image's patches as an attention query."
    s = torch.einsum("ind,jkd->ijkn", patches, concepts)                           # (R, C, K, N) c . v'_n
    s = s.to(torch.promote_types(s.dtype, torch.float32))                          # softmax and sums in >= float32
    w = (s / math.sqrt(patches.shape[-1])).softmax(-1)                             # (R, C, K, N) attention over patches
    logits = scale * (w * s).sum(-1) + bias                                        # (R, C, K) v_hat(c) . c
    return _sigmoid_nll(logits, concept_targets(patches.shape[0], concept_valid, offset))


# %% [markdown]
# Against Eqs. 5-7 written as loops over images and concepts (float64, forward and gradient, the attention
# pooling formed explicitly), `gradcheck`, two simulated processes, and bf16 autocast.

# %%
def _naive(image, patches, concepts, valid, t, b):
    R, D = image.shape[0], image.shape[1]
    npc = xac = 0
    for i in range(R):
        for j in range(concepts.shape[0]):
            for k in range(concepts.shape[1]):
                if not valid[j, k]: continue
                z = 1.0 if i == j else -1.0
                c = concepts[j, k]
                npc = npc - F.logsigmoid(z * (t * image[i] @ c + b))
                w = torch.softmax(torch.stack([c @ patches[i, n] for n in range(patches.shape[1])]) / D ** 0.5, 0)
                v_hat = sum(w[n] * patches[i, n] for n in range(patches.shape[1]))
                xac = xac - F.logsigmoid(z * (t * v_hat @ c + b))
    return npc / R, xac / R

_g = torch.Generator().manual_seed(0)
_img = F.normalize(torch.randn(4, 5, generator=_g, dtype=torch.float64), dim=-1)
_pat = torch.randn(4, 6, 5, generator=_g, dtype=torch.float64)
_con = F.normalize(torch.randn(4, 3, 5, generator=_g, dtype=torch.float64), dim=-1)
_val = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]], dtype=torch.bool)   # the last caption has no concept
_t, _b = torch.tensor(3.0, dtype=torch.float64), torch.tensor(-2.0, dtype=torch.float64)
_a1 = tuple(x.clone().requires_grad_() for x in (_img, _pat, _con))
_a2 = tuple(x.clone().requires_grad_() for x in (_img, _pat, _con))
_npc, _xac = npc_loss(_a1[0], _a1[2], _val, _t, _b), xac_loss(_a1[1], _a1[2], _val, _t, _b)
_rn, _rx = _naive(*_a2[:2], _a2[2], _val, _t, _b)
assert_close(_npc, _rn); assert_close(_xac, _rx)
(_npc + _xac).backward(); (_rn + _rx).backward()
for a, b in zip(_a1, _a2): assert_close(a.grad, b.grad)
assert gradcheck(lambda i, p, c: npc_loss(i, c, _val, _t, _b) + xac_loss(p, c, _val, _t, _b), _a1, eps=1e-6, atol=1e-5)
for f, x in ((npc_loss, _img), (xac_loss, _pat)):
    parts = [f(x[sl], _con, _val, _t, _b, off) for sl, off in ((slice(0, 2), 0), (slice(2, 4), 2))]
    assert_close(sum(parts) / 2, f(x, _con, _val, _t, _b))
print(f"npc {float(_npc.detach()):.4f} (naive {float(_rn.detach()):.4f}), xac {float(_xac.detach()):.4f} (naive {float(_rx.detach()):.4f})")

# %%
_P32 = torch.randn(4, 196, 32, generator=_g).requires_grad_()
_C32 = torch.randn(4, 6, 32, generator=_g).requires_grad_()
_I32 = torch.randn(4, 32, generator=_g).requires_grad_()
_v32 = torch.rand(4, 6, generator=_g) < 0.7
with torch.autocast("cpu", dtype=torch.bfloat16):
    _lb = (npc_loss(F.normalize(_I32, dim=-1), F.normalize(_C32, dim=-1), _v32, torch.tensor(10.0), torch.tensor(-10.0))
           + 0.01 * xac_loss(_P32, F.normalize(_C32, dim=-1), _v32, torch.tensor(10.0), torch.tensor(-10.0)))
_lb.backward()
assert torch.isfinite(_lb) and all(torch.isfinite(x.grad).all() for x in (_P32, _C32, _I32))
print(_lb.dtype, float(_lb.detach()))
