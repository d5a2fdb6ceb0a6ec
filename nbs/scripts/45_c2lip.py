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
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from powerclip.data import BatchNeeds
from powerclip.dist import DistContext, gather
from powerclip.loss import clip_loss, siglip_loss
from powerclip.methods import Method, register
from powerclip.powerset import pool_normalize

# %%
#| hide
from fastcore.test import test_fail
from torch.autograd import gradcheck
from torch.testing import assert_close


# %% [markdown]
# # C2LIP
#
# > C2LIP (paper `003` in `/work/shared/papers`) as a training method.
#
# SigLIP's sigmoid loss plus the noun-phrase concept (npc) and cross-attended concept (xac) losses, every image against
# every noun-phrase concept of the batch, positives being the concepts of its own caption.

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
# does not print one; the authors' code has none: a softmax of raw dot products). $\hat v$ replaces $v$, which is
# L2-normalised (Eq. 4 compares unit vectors), so by default $\hat v$ is L2-normalised too, as in the authors' code
# (`xac_normalize=True`): $\hat v\cdot c=\sum_n w_n\,(c\cdot v'_n)\,/\,\lVert\hat v\rVert$ with
# $\lVert\hat v\rVert^2=w^\top G\,w$ and $G=V'V'^\top$ the $(N, N)$ Gram matrix of the image's patches, so the
# $(R, C, K, D)$ pooled tensor is never formed, only the $(R, C, K, N)$ scores. Without the normalisation the logits
# grow with the patches' norms: fine-tuning the demo's CLIP checkpoint (below) starts at $\mathcal L_{xac}\approx 3000$,
# which at $\lambda_{xac}=0.01$ is most of the loss. Concepts are passed padded, $(C, K, D)$ with a validity mask
# $(C, K)$. The sum over concepts is not averaged, so the loss grows with the number of concepts per batch.
# Labels are by membership, as Eq. 5 reads and as the authors' code sets them (by each concept's caption index, not its
# text): a concept of another caption with the same words is a negative of image $i$ even when $i$'s own caption has
# it. On web captions that is rare; on the world's small vocabulary it is common (in the sigmoid table's batches an
# image has about as many such identical negatives as positives), and CLIP's causal text tower embeds a phrase that
# opens its caption identically wherever it appears, so one vector is then labelled $+1$ and $-1$ for one image. Kept:
# the method as defined, and its cost is a small irreducible part of the loss beside the unsatisfied positives
# (`71a_plateau`, the sigmoid table's qualifier).
#
# **Normalisation of npc and xac** (`npc_norm`). The paper divides by the batch size, $1/|B|$ (Eqs. 5, 7:
# `'batch'`, the default); the authors' code (SamsungLabs/concept_centric_clip, `src/open_clip/loss.py`, `C2LIP_Loss`)
# divides the same sums by the number of noun-phrase concepts of the batch, $1/K$ (`'concepts'`), i.e. the loss
# times $|B|/K$, smaller by the mean number of concepts per caption (its SigLIP term divides by $|B|$, as Eq. 4).
# Data parallel: a process sums over its $R$ images against all gathered concepts and divides by $R$ (times $C/K$
# for `'concepts'`, with $C$ and $K$ counted over the gathered batch); the mean over processes is the full-batch
# loss. (The authors' code divides each process's sum by the gathered $K$, so its mean over processes is the
# full-batch value divided by the number of processes; we keep the full-batch value.)

# %%
#| export
def concept_targets(
    R: int,                      # local images
    concept_valid: torch.Tensor, # (C, K) bool, the gathered concepts
    offset: int = 0,             # rank * R
) -> torch.Tensor:               # (R, C, K) float: +1 own caption's concepts, -1 others, 0 padding
    "z_ij of Eqs. 5 and 7 for the local images against every concept of the batch."
    C = concept_valid.shape[0]
    # (R, C)
    own = (torch.arange(C, device=concept_valid.device)[None, :]
           == (torch.arange(R, device=concept_valid.device) + offset)[:, None])
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
    concepts: torch.Tensor,       # (C, K, D) L2-normalised concept embeddings of all captions (padded)
    concept_valid: torch.Tensor,  # (C, K) bool
    scale: torch.Tensor, bias: torch.Tensor,
    offset: int = 0,
    normalize: bool = True,       # L2-normalise v_hat(c) (as v in Eq. 5; the authors' code)
    eps: float = 1e-8,            # floor of |v_hat|
) -> torch.Tensor:                # scalar
    "Cross-attended concept loss (Eqs. 6-7): the concept pools each image's patches as an attention query."
    s = torch.einsum("ind,jkd->ijkn", patches, concepts)                           # (R, C, K, N) c . v'_n
    with torch.autocast(patches.device.type, enabled=False):                       # softmax, sums, Gram in >= float32
        s = s.to(torch.promote_types(s.dtype, torch.float32))
        w = (s / math.sqrt(patches.shape[-1])).softmax(-1)                         # (R, C, K, N) attention over patches
        dot = (w * s).sum(-1)                                                      # (R, C, K) v_hat(c) . c
        if normalize:
            p = patches.to(s.dtype)
            # (R, N, N) Gram of each image's patches
            G = p @ p.transpose(1, 2)
            sq = (torch.einsum("ijkn,inm->ijkm", w, G) * w).sum(-1)                # (R, C, K) |v_hat(c)|^2 = w G w
            dot = dot / sq.clamp_min(eps * eps).sqrt()
        logits = scale * dot + bias
    return _sigmoid_nll(logits, concept_targets(patches.shape[0], concept_valid, offset))


# %% [markdown]
# Against Eqs. 5-7 written as loops over images and concepts (float64, forward and gradient, the attention
# pooling formed explicitly), `gradcheck`, two simulated processes, and bf16 autocast.

# %%
def _naive(image, patches, concepts, valid, t, b, normalize=True):
    R, D = image.shape[0], image.shape[1]
    npc = xac = 0
    for i in range(R):
        for j in range(concepts.shape[0]):
            for k in range(concepts.shape[1]):
                if not valid[j, k]:
                    continue
                z = 1.0 if i == j else -1.0
                c = concepts[j, k]
                npc = npc - F.logsigmoid(z * (t * image[i] @ c + b))
                w = torch.softmax(torch.stack([c @ patches[i, n] for n in range(patches.shape[1])]) / D ** 0.5, 0)
                v_hat = sum(w[n] * patches[i, n] for n in range(patches.shape[1]))
                if normalize:
                    v_hat = v_hat / v_hat.norm()
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
assert_close(_npc, _rn)
assert_close(_xac, _rx)
(_npc + _xac).backward()
(_rn + _rx).backward()
for a, b in zip(_a1, _a2):
    assert_close(a.grad, b.grad)
assert gradcheck(lambda i, p, c: npc_loss(i, c, _val, _t, _b) + xac_loss(p, c, _val, _t, _b), _a1, eps=1e-6, atol=1e-5)
for f, x in ((npc_loss, _img), (xac_loss, _pat)):
    parts = [f(x[sl], _con, _val, _t, _b, off) for sl, off in ((slice(0, 2), 0), (slice(2, 4), 2))]
    assert_close(sum(parts) / 2, f(x, _con, _val, _t, _b))
# the paper's printed Eq. 7 without the normalisation of v_hat (xac_normalize=False)
assert_close(xac_loss(_pat, _con, _val, _t, _b, normalize=False),
             _naive(_img, _pat, _con, _val, _t, _b, normalize=False)[1])
print(f"npc {float(_npc.detach()):.4f} (naive {float(_rn.detach()):.4f}), xac {float(_xac.detach()):.4f} (naive "
      f"{float(_rx.detach()):.4f})")

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


# %% [markdown]
# ## SigLIP's sigmoid loss, the base term
#
# Eq. 4 (SigLIP, Zhai et al. 2023): every image against every caption of the batch, $z_{ij}=+1$ on the diagonal and
# $-1$ elsewhere, $\mathcal L=-\frac1{|B|}\sum_{i,j}\log\sigma\big(z_{ij}(t\,v_i\cdot t_j+b)\big)$. A process computes
# its $R$ local images against the gathered captions and divides by $R$ (as open_clip's `SigLipLoss` divides by its
# local batch), so the mean over processes is the full-batch loss. Unlike CLIP's loss it needs no images of other
# processes: the images' side of each pair is summed on the process that holds the image. It is `11_loss`'s
# `siglip_loss` (the one copy, equal to open_clip's `SigLipLoss` on every rank: `tests/test_siglip.py`), with its
# promotion of the similarities to at least float32 under autocast; the checks below hold it to the pair-by-pair sum
# once more, through C2LIP's names.

# %%
def _naive_siglip(v, t, tau, b):
    return (-sum(F.logsigmoid((1.0 if i == j else -1.0) * (tau * v[i] @ t[j] + b)) for i in range(v.shape[0])
                 for j in range(t.shape[0])) / v.shape[0])

_v = F.normalize(torch.randn(4, 5, generator=_g, dtype=torch.float64), dim=-1)
_tx = F.normalize(torch.randn(4, 5, generator=_g, dtype=torch.float64), dim=-1)
_s1 = [x.clone().requires_grad_() for x in (_v, _tx, _t, _b)]
_s2 = [x.clone().requires_grad_() for x in (_v, _tx, _t, _b)]
_ls, _lr = siglip_loss(*_s1), _naive_siglip(*_s2)
assert_close(_ls, _lr)
_ls.backward()
_lr.backward()
for a, b in zip(_s1, _s2):
    assert_close(a.grad, b.grad)                         # t and b get their gradients too
assert gradcheck(lambda v, t, s, b: siglip_loss(v, t, s, b), _s1, eps=1e-6, atol=1e-5)
_parts = [siglip_loss(_v[sl], _tx[sl], _t, _b, _tx, off) for sl, off in ((slice(0, 2), 0), (slice(2, 4), 2))]
assert_close(sum(_parts) / 2, _ls.detach())                                     # two processes: the full batch
print(f"siglip {float(_ls.detach()):.4f} (naive {float(_lr.detach()):.4f})")


# %% [markdown]
# ## Noun-phrase concepts from the parse tree
#
# The paper finds noun phrases with spaCy's dependency parse (Sec. 4.1, "traverse the dependency trees to extract
# the noun-phrase concepts"), i.e. spaCy's noun chunks: short phrases of one object and its attributes (Sec. 5,
# "short segments that correspond to a single object and its attributes"). Here they come from this project's
# constituency tree (`20_parsing`, batch key `node_np`: the node's label is `NP`), no LLM. Constituency NPs
# nest (`(NP (NP a dog) (VP sitting on (NP a red chair)))`), so `concepts='base'` (default) keeps the NPs that
# contain no other NP, the analogue of noun chunks (`a dog`, `a red chair`); `concepts='all'` keeps every NP.
# A caption without any NP takes its whole text as its one concept, as the authors' released code does
# (`no_concept='caption'`; `'none'`: the caption has no concept). The paper does not cap the number of concepts
# per caption; `max_concepts` can, keeping the longest NPs first (ties: left to right), and the kept concepts
# are ordered longest first.
#
# **The concept embedding.** Sec. 3.2: the concept representations "are computed by pooling the representations
# of the text tokens corresponding to the respective noun-phrase" (also Fig. 1b: "pooling the text encoder
# output tokens into concept embeddings"). So by default (`concept_embedding='pool'`) a concept is the
# L2-normalised mean of the caption's projected token embeddings over the NP's BPE positions: no extra pass of
# the text tower, and the concept sees the context of its caption. The authors' released code instead encodes
# every noun phrase as a text of its own (a second text-tower pass over all phrases); `concept_embedding='encode'`
# does that, building each phrase's token sequence `SOT pieces EOT` from the caption's own token ids in
# `prepare_batch`.

# %%
#| export
def select_concepts(
    incidence: torch.Tensor,   # (C, K, W) bool node-by-word incidence
    node_valid: torch.Tensor,  # (C, K) bool
    node_np: torch.Tensor,     # (C, K) bool node label is NP
    mode: str = "base",        # 'base': NPs containing no other NP | 'all': every NP
    no_concept: str = "caption",  # a caption without NP: 'caption' (node 0, the root) | 'none'
    max_concepts: int | None = None,  # keep at most this many per caption, the longest first
) -> tuple[torch.Tensor, torch.Tensor]:  # (C, Kc) long node indices, (C, Kc) bool valid; longest first
    "The noun-phrase nodes that are C2LIP's concepts of each caption, longest first."
    if mode not in ("base", "all"):
        raise ValueError(f"concepts must be 'base' or 'all', got {mode!r}")
    if no_concept not in ("caption", "none"):
        raise ValueError(f"no_concept must be 'caption' or 'none', got {no_concept!r}")
    inc = incidence.bool()
    sel = node_np.bool() & node_valid.bool()                                        # (C, K)
    # inside[c, k, j]: node j's words are a subset of node k's (after truncation, two nodes can cover the same words)
    inside = ~(inc[:, None, :, :] & ~inc[:, :, None, :]).any(-1)                     # (C, K, K)
    same = inside & inside.transpose(1, 2)                                          # (C, K, K) equal word sets
    K = inc.shape[1]
    earlier = torch.ones(K, K, dtype=torch.bool, device=inc.device).tril(-1)        # [k, j]: j < k
    sel = sel & ~(same & earlier & sel[:, None, :]).any(-1)                         # one node per word set
    if mode == "base":
        sel = sel & ~(inside & ~same & sel[:, None, :]).any(-1)      # no NP strictly inside
    if no_concept == "caption":
        sel[:, 0] |= ~sel.any(1) & node_valid[:, 0].bool()                          # the whole caption
    length = torch.where(sel, inc.sum(-1), -1)                                      # (C, K) words; -1 unselected
    order = torch.sort(length, dim=1, descending=True, stable=True).indices         # longest first, ties in order
    valid = torch.gather(sel, 1, order)
    n = max(1, int(valid.sum(1).max())) if valid.numel() else 1
    if max_concepts is not None:
        n = min(n, max_concepts)
    return order[:, :n], valid[:, :n]


def concept_token_masks(
    incidence: torch.Tensor,    # (C, K, W) bool
    leaf_tokens: torch.Tensor,  # (C, W, L) bool
    index: torch.Tensor,        # (C, Kc) long nodes
    valid: torch.Tensor,        # (C, Kc) bool
) -> torch.Tensor:              # (C, Kc, L) bool BPE positions of each concept
    "The token positions each concept covers (the union of its words' pieces); invalid concepts cover nothing."
    inc = torch.gather(incidence.bool(), 1, index[:, :, None].expand(-1, -1, incidence.shape[2]))  # (C, Kc, W)
    tok = torch.einsum("ckw,cwl->ckl", inc.float(), leaf_tokens.float()) > 0       # (C, Kc, L)
    return tok & valid[:, :, None]


def concept_token_ids(
    tokens: torch.Tensor,       # (C, L) long caption token ids
    masks: torch.Tensor,        # (C, Kc, L) bool concept positions
    sot: int, eot: int,         # the tokenizer's start and end ids
) -> torch.Tensor:              # (C, Kc, L) long: SOT, the concept's pieces in order, EOT, zeros
    "Each concept as a text of its own, from the caption's token ids (for `concept_embedding='encode'`)."
    C, Kc, L = masks.shape
    n = masks.sum(-1)                                                               # (C, Kc) pieces (at most L - 2)
    # (C, Kc, L) 1-based slot of each piece
    dest = masks.long().cumsum(-1)
    out = torch.zeros(C, Kc, L + 1, dtype=torch.long, device=tokens.device)         # slot L: dump for non-pieces
    out.scatter_(2, torch.where(masks, dest, L), tokens[:, None, :].expand(C, Kc, L))
    out = out[..., :L]
    out[..., 0] = sot
    out.scatter_(2, (n + 1).clamp(max=L - 1)[..., None], eot)
    return out


# %%
from powerclip.parsing import parse_caption
from powerclip.tokens import collate_trees, default_tokenizer, tree_tokens
_caps = ["a dog sitting on a red chair", "A woman wearing red dress stands next to a fireplace at a university",
         "two cats", "sitting quietly", ""]
_pcs = [parse_caption(c) for c in _caps]
_tb = collate_trees([tree_tokens(p) for p in _pcs])
def _phrases(c, idx, val, pcs=_pcs):
    return [" ".join(pcs[c].words[slice(*pcs[c].spans[k])]) for k, v in zip(idx[c].tolist(), val[c].tolist()) if v]
for mode in ("base", "all"):
    _idx, _val = select_concepts(_tb["incidence"], _tb["node_valid"], _tb["node_np"], mode)
    print(mode, [_phrases(c, _idx, _val) for c in range(len(_caps))])
_idx, _val = select_concepts(_tb["incidence"], _tb["node_valid"], _tb["node_np"], "base")
assert _phrases(0, _idx, _val) == ["a red chair", "a dog"]                      # longest first
assert _phrases(2, _idx, _val) == ["two cats"] and _phrases(3, _idx, _val) == ["sitting quietly"]  # no NP: the caption
assert not _val[4].any()                                                         # the empty caption: nothing
_i1, _v1 = select_concepts(_tb["incidence"], _tb["node_valid"], _tb["node_np"], "base", "none", max_concepts=2)
assert _v1.shape[1] == 2 and not _v1[3].any() and _phrases(1, _i1, _v1) == _phrases(1, _idx, _val)[:2]
_ia, _va = select_concepts(_tb["incidence"], _tb["node_valid"], _tb["node_np"], "all")
assert _phrases(0, _ia, _va) == ["a dog sitting on a red chair", "a red chair", "a dog"]
# token masks and stand-alone token ids of the concepts
_tok = default_tokenizer()
_cm = concept_token_masks(_tb["incidence"], _tb["leaf_tokens"], _idx, _val)
_ids = concept_token_ids(_tb["tokens"], _cm, _tok.sot_token_id, _tok.eot_token_id)
for c in range(len(_caps)):
    for k, ph in enumerate(_phrases(c, _idx, _val)):
        assert _tok.decode(_tb["tokens"][c][_cm[c, k]].tolist()).strip() == ph.lower()
        assert torch.equal(_ids[c, k], torch.as_tensor(_tok([ph])[0]))           # = open_clip tokenising the phrase
assert not _cm[~_val].any()

# %% [markdown]
# Truncation: two nested NPs that keep the same words stay one concept; an NP that lost all its words is no
# concept (hand-made tree, checked directly on the masks).

# %%
_inc = torch.tensor([[[1, 1, 0], [1, 1, 0], [0, 0, 0], [1, 1, 0]]], dtype=torch.bool)  # nodes 1, 3 same words
_nv, _np = _inc.any(-1), torch.tensor([[False, True, True, True]])
_i, _v = select_concepts(_inc, _nv, _np, "base")
assert _i[0][_v[0]].tolist() == [1]


# %% [markdown]
# ## The method
#
# Registered as `c2lip`. The total loss is Eq. 8, $\mathcal L_{\text{base}}+\lambda_{npc}\mathcal L_{npc}+\lambda_{xac}\mathcal L_{xac}$,
# with SigLIP's loss as the base term (`base='siglip'`, the paper) or CLIP's (`base='clip'`: `clip_loss` with the
# model's own `logit_scale`, to compare with the other methods on the same footing). The sigmoid losses share a
# learnable scale $t=e^{t'}$ and bias $b$, initialised as SigLIP ($t'=\log 10$, $b=-10$, Zhai et al. 2023, Sec. 3);
# they live in a training-time module (`build_modules`) that the trainer trains, synchronises and saves beside
# the model, never inside the open_clip weights, when the model has none: a CLIP model or snapshot (the comparison's
# row "C2LIP", C2LIP from CLIP), so they start from SigLIP's init.
#
# **On a SigLIP model** (one that holds `logit_bias`: built with `init_logit_bias`, `48a_siglip`, or any model whose
# pretrained weights hold one, which the trainer then builds with it, `50_train`'s `validate`) the sigmoid terms use
# **the model's own** $t$ (`logit_scale`, exponentiated) and $b$, as C2LIP's paper fine-tunes SigLIP: nothing is created
# fresh, `build_modules` returns None, and $t, b$ train with the model's parameters at the run's learning rate
# (open_clip keeps them out of weight decay). `modules_lr` and `init_scale` / `init_bias` then apply to nothing: there
# are no modules. This is the row "C2LIP (SigLIP)" of `71a_plateau`'s `sigmoid` table.
#
# **t and b** (`modules_lr`, `init_scale`). Fresh $t, b$ trained at the fine-tune's learning rate cannot leave their
# init: Adam moves $t'=\log t$ by at most about lr per step, so at C2LIP's $10^{-5}$ over a fine-tune of $10^4$ steps
# $t$ stays within $e^{0.1}$ of 10, where a trained SigLIP sits near 100; and at $t=10, b=-10$ almost all of the npc
# gradient comes from the positive pairs (pull only). A pretrained SigLIP would bring its own $t, b$; starting from
# CLIP's towers we have none, so $t, b$ get their own learning rate, $10^{-3}$ by default (ours; `modules_lr=None`
# gives them the run's), which lets them travel a factor $e$ in $10^3$ steps; `init_scale='model'` starts $t$ at the
# model's CLIP temperature instead. The trainer logs them as `_t` and `_b` in `metrics.csv`, so a run shows whether
# they move (the comparison's C2LIP rows, `70_compare`).
#
# **Across processes.** Each process pools its own captions' concepts; the number of concepts $K$ differs, so
# they are padded to the largest $K$ over the processes and gathered, together with the image and text
# embeddings, in one call (`powerclip.dist.gather`: one collective with gradient, the validity masks in one without).
# `concept_targets` marks the concepts of caption `rank * R + i` positive for local image $i$: the gathered
# concepts are in rank order, so the offset points into the gathered batch. The cross-attention pools the
# *local* images' patches with every gathered concept, so patches are never gathered.

# %%
#| export
@dataclass
class C2LIPConfig:
    base: str = "siglip"           # Eq. 4 / Sec. 3.1: SigLIP is the base model and loss; 'clip': clip_loss (compare)
    npc_weight: float = 1.0        # lambda_npc, Eq. 8; Sec. 4.1 "empirically chosen as 1 and 0.01" (Tab. A2)
    xac_weight: float = 0.01       # lambda_xac, Eq. 8; Sec. 4.1
    concepts: str = "base"         # 'base': NPs with no NP inside (spaCy noun chunks, Sec. 4.1) | 'all': every NP
    no_concept: str = "caption"    # caption without NP: its whole text (the authors' code) | 'none'
    max_concepts: int | None = None  # no cap in the paper; if set, the longest NPs are kept
    concept_embedding: str = "pool"  # 'pool' the caption's token outputs (Sec. 3.2, Fig. 1b) | 'encode' (authors' code)
    npc_norm: str = "batch"        # npc and xac divided by 'batch' |B| (Eqs. 5, 7) | 'concepts' K (authors' code)
    xac_normalize: bool = True     # L2-normalise the concept-pooled v_hat(c) as v is (authors' code) | False
    init_scale: float | str = 10.0 # t at init: SigLIP's 10 (Zhai et al. 2023) | 'model': the model's CLIP temperature
    init_bias: float = -10.0       # b at init (SigLIP's -10)
    modules_lr: float | None = 1e-3  # peak lr of t and b (ours, see "t and b" below); None: the run's

    def __post_init__(self):
        if self.base not in ("siglip", "clip"):
            raise ValueError(f"base must be 'siglip' or 'clip', got {self.base!r}")
        if self.concepts not in ("base", "all"):
            raise ValueError(f"concepts must be 'base' or 'all', got {self.concepts!r}")
        if self.no_concept not in ("caption", "none"):
            raise ValueError(f"no_concept must be 'caption' or 'none', got {self.no_concept!r}")
        if self.concept_embedding not in ("pool", "encode"):
            raise ValueError(f"concept_embedding must be 'pool' or 'encode', got {self.concept_embedding!r}")
        if self.npc_weight < 0 or self.xac_weight < 0:
            raise ValueError("npc_weight and xac_weight must be >= 0")
        if self.max_concepts is not None and self.max_concepts < 1:
            raise ValueError("max_concepts must be >= 1 or None")
        if self.npc_norm not in ("batch", "concepts"):
            raise ValueError(f"npc_norm must be 'batch' or 'concepts', got {self.npc_norm!r}")
        if isinstance(self.init_scale, str):
            if self.init_scale != "model":
                raise ValueError(f"init_scale must be a number > 0 or 'model', got {self.init_scale!r}")
        elif self.init_scale <= 0:
            raise ValueError(f"init_scale must be > 0 or 'model', got {self.init_scale}")
        if self.modules_lr is not None and self.modules_lr <= 0:
            raise ValueError("modules_lr must be > 0 or None")


class SigmoidScaleBias(nn.Module):
    "SigLIP's learnable scale t = exp(t') and bias b of the sigmoid losses."
    def __init__(self, init_scale: float = 10.0, init_bias: float = -10.0):
        super().__init__()
        self.log_scale = nn.Parameter(torch.tensor(math.log(init_scale)))
        self.bias = nn.Parameter(torch.tensor(float(init_bias)))

    def forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.log_scale.exp(), self.bias


def c2lip_terms(
    image: torch.Tensor, text: torch.Tensor,  # (R, D) local, L2-normalised
    patches: torch.Tensor | None,             # (R, N, D) local projected patch embeddings (None: no xac)
    concepts: torch.Tensor,                   # (C, K, D) L2-normalised concepts of all captions
    concept_valid: torch.Tensor,              # (C, K) bool
    scale: torch.Tensor | None, bias: torch.Tensor | None,  # () sigmoid t and b (None: no sigmoid term)
    logit_scale: torch.Tensor,                # () the model's CLIP temperature (base='clip')
    cfg: C2LIPConfig,
    image_all: torch.Tensor | None = None, text_all: torch.Tensor | None = None,  # (C, D) gathered
    offset: int = 0,                          # rank * R
) -> dict[str, torch.Tensor]:
    "Named terms of Eq. 8 on the local rows: the base loss, then the weighted npc and xac ('_' keys: logs)."
    if cfg.base == "siglip":
        # + 0 * the model's CLIP temperature, which the sigmoid losses do not use: DDP (find_unused_parameters=False)
        # all-reduces a gradient bucket only when every parameter in it got a gradient, so an unused one would
        # leave its bucket's gradients unsynchronised (and fail the next step). Its gradient is exactly 0.
        terms = {"siglip": siglip_loss(image, text, scale, bias, text_all, offset) + 0.0 * logit_scale}
    else:
        terms = {"clip": clip_loss(image, text, logit_scale, image_all, text_all, offset)}
    # 'concepts': the authors' 1/K instead of Eq. 5's 1/|B|, both counted over the gathered batch
    norm = 1.0 if cfg.npc_norm == "batch" else concept_valid.shape[0] / concept_valid.sum().clamp_min(1)
    if cfg.npc_weight > 0:
        npc = npc_loss(image, concepts, concept_valid, scale, bias, offset) * norm
        terms["npc"], terms["_npc"] = cfg.npc_weight * npc, npc.detach()
    if cfg.xac_weight > 0:
        if patches is None:
            raise ValueError("xac needs patch embeddings (patch dropout active?)")
        xac = xac_loss(patches, concepts, concept_valid, scale, bias, offset, cfg.xac_normalize) * norm
        terms["xac"], terms["_xac"] = cfg.xac_weight * xac, xac.detach()
    return terms


# %%
#| export
def _holds_bias(model) -> bool:
    "Whether the open_clip model holds SigLIP's t and b (`logit_bias`, built with `init_logit_bias`)."
    return getattr(model, "logit_bias", None) is not None


@register("c2lip")
class C2LIP(Method):
    """C2LIP: base (SigLIP or CLIP) + lambda_npc * npc + lambda_xac * xac over noun-phrase concepts, config
    `C2LIPConfig`."""
    Config = C2LIPConfig
    needs_patches = True
    pools = ("tok", "avg", "map")

    def needs(self) -> BatchNeeds:
        "The parse tree with its noun-phrase labels (the concepts); no region mask."
        return BatchNeeds(tree=True, node_np=True)

    @property
    def _sigmoid(self) -> bool:   # any term that needs t and b
        return self.cfg.base == "siglip" or self.cfg.npc_weight > 0 or self.cfg.xac_weight > 0

    def build_modules(self, model) -> SigmoidScaleBias | None:
        """t and b of the sigmoid losses (trained and saved beside the model, not in its state_dict); None when the
        model holds SigLIP's own (`logit_bias`: a SigLIP model or snapshot), whose t and b are then used."""
        if not self._sigmoid or _holds_bias(model):
            return None
        t = float(model.logit_scale.detach().exp()) if self.cfg.init_scale == "model" else self.cfg.init_scale
        return SigmoidScaleBias(t, self.cfg.init_bias)

    def modules_lr(self, lr: float) -> float:
        return lr if self.cfg.modules_lr is None else self.cfg.modules_lr

    def prepare_batch(self, batch: dict) -> dict:
        """Adds `concept_tokens (C, Kc, L)` bool (each concept's BPE positions), `concept_valid (C, Kc)` and, for
        `concept_embedding='encode'`, `concept_ids (C, Kc, L)` long (each concept as a text of its own)."""
        batch = super().prepare_batch(batch)
        idx, valid = select_concepts(batch["incidence"], batch["node_valid"], batch["node_np"],
                                     self.cfg.concepts, self.cfg.no_concept, self.cfg.max_concepts)
        batch = dict(batch, concept_tokens=concept_token_masks(batch["incidence"], batch["leaf_tokens"], idx, valid),
                     concept_valid=valid)
        if self.cfg.concept_embedding == "encode":
            from powerclip.tokens import default_tokenizer
            tok = default_tokenizer()
            batch["concept_ids"] = concept_token_ids(batch["tokens"], batch["concept_tokens"], tok.sot_token_id,
                                                     tok.eot_token_id)
        return batch

    def forward(self, model, batch, modules=None):
        own = _holds_bias(model)
        if self._sigmoid and not own and not isinstance(modules, SigmoidScaleBias):
            raise RuntimeError("C2LIP needs its sigmoid scale and bias: pass modules=method.build_modules(model)")
        out = super().forward(model, batch)
        if self._sigmoid and own:         # the SigLIP model's own t = exp(t') and b
            out["sigmoid_scale"], out["sigmoid_bias"] = out["logit_scale"], out["logit_bias"]
        if self.cfg.concept_embedding == "pool":
            out["concepts"] = pool_normalize(out["tokens"], batch["concept_tokens"])        # (C, Kc, D)
        else:   # one more text-tower pass, over the valid concepts only
            ids, valid = batch["concept_ids"], batch["concept_valid"]                        # (C, Kc, L), (C, Kc)
            enc = model.encode_text(ids[valid], normalize=True)                              # (P, D)
            out["concepts"] = enc.new_zeros(*valid.shape, enc.shape[-1]).index_put((valid,), enc)  # (C, Kc, D)
        if modules is not None:
            out["sigmoid_scale"], out["sigmoid_bias"] = modules()
        return out

    def loss(self, out, batch, dist: DistContext):
        image, text = out["image"], out["text"]
        # ragged K: padded to the largest over the processes; concepts with gradient, their mask without
        g = gather(dist,
                   {"image": image, "text": text, "concepts": out["concepts"], "concept_valid": batch["concept_valid"]},
                   pad={"concepts": {1: 0.0}, "concept_valid": {1: False}})
        a = g.all
        terms = c2lip_terms(image, text, out["patches"] if self.cfg.xac_weight > 0 else None, a["concepts"],
                            a["concept_valid"],
                            out.get("sigmoid_scale"), out.get("sigmoid_bias"), out["logit_scale"], self.cfg,
                            a["image"], a["text"], g.offset)
        terms["_concepts"] = batch["concept_valid"].sum(1).float().mean()
        if "sigmoid_scale" in out:
            terms["_t"], terms["_b"] = out["sigmoid_scale"].detach(), out["sigmoid_bias"].detach()
        terms["_logit_scale"] = out["logit_scale"].detach()
        return terms


# %% [markdown]
# Two processes simulated: each computes its terms with its own rows, the gathered tensors and its offset; the
# mean over processes equals one process on the whole batch, in value and gradient, for both base losses
# (float64).

# %%
def _sim(cfg, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = dict(image=F.normalize(torch.randn(4, 6, generator=g, dtype=torch.float64), dim=-1),
             text=F.normalize(torch.randn(4, 6, generator=g, dtype=torch.float64), dim=-1),
             patches=torch.randn(4, 5, 6, generator=g, dtype=torch.float64),
             concepts=F.normalize(torch.randn(4, 3, 6, generator=g, dtype=torch.float64), dim=-1))
    x = {k: v.requires_grad_() for k, v in x.items()}
    val = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]], dtype=torch.bool)
    t, b, ls = (torch.tensor(5.0, dtype=torch.float64), torch.tensor(-3.0, dtype=torch.float64),
                torch.tensor(7.0, dtype=torch.float64))
    full = c2lip_terms(x["image"], x["text"], x["patches"], x["concepts"], val, t, b, ls, cfg)
    parts = [c2lip_terms(x["image"][sl], x["text"][sl], x["patches"][sl], x["concepts"], val, t, b, ls, cfg,
                         x["image"], x["text"], off) for sl, off in ((slice(0, 2), 0), (slice(2, 4), 2))]
    tot = lambda d: sum(v for k, v in d.items() if not k.startswith("_"))
    g1 = torch.autograd.grad(tot(full), list(x.values()))
    g2 = torch.autograd.grad((tot(parts[0]) + tot(parts[1])) / 2, list(x.values()))
    for k in full:
        if not k.startswith("_"):
            assert_close((parts[0][k] + parts[1][k]) / 2, full[k])
    for a, b_ in zip(g1, g2):
        assert_close(a, b_)
    return full

for _base in ("siglip", "clip"):
    _full = _sim(C2LIPConfig(base=_base, xac_weight=0.5))
    print(_base, {k: round(float(v.detach()), 4) for k, v in _full.items()})
assert "clip" in _full and "siglip" not in _full

# %% [markdown]
# On the micro model (random weights), from captions through `prepare_batch`, `forward` and `loss`: every
# term is finite, $t$ and $b$ get gradients and stay out of the model's `state_dict`, both concept embeddings run,
# and the pooled concept of a one-NP caption equals its caption's token pool.

# %%
from powerclip.methods import get_method
from powerclip.model import create_model, register_configs
register_configs()
torch.manual_seed(0)
_model = create_model("powerclip-micro")[0]
_keys = set(_model.state_dict())
_batch = dict(_tb, image=torch.randn(len(_caps), 3, 32, 32))
for _emb in ("pool", "encode"):
    _meth = get_method("c2lip", {"concept_embedding": _emb})
    _mods = _meth.build_modules(_model)
    _pb = _meth.prepare_batch(_batch)
    _out = _meth.forward(_model, _pb, _mods)
    _terms = _meth.loss(_out, _pb, DistContext())
    _model.zero_grad()
    sum(v for k, v in _terms.items() if not k.startswith("_")).backward()
    assert all(torch.isfinite(v) for v in _terms.values()) and set(_terms) >= {"siglip", "npc", "xac"}
    assert (_mods.log_scale.grad is not None and _mods.bias.grad is not None
            and _model.visual.conv1.weight.grad is not None)
    print(_emb, {k: round(float(v.detach()), 4) for k, v in _terms.items()})
assert set(_model.state_dict()) == _keys                                          # t, b live beside the model
assert abs(float(_mods()[0]) - 10.0) < 1e-5 and float(_mods()[1]) == -10.0        # SigLIP's init
test_fail(lambda: get_method("c2lip").forward(_model, _pb), contains="build_modules")
test_fail(lambda: get_method("c2lip", {"base": "softmax"}), contains="base must be")
test_fail(lambda: get_method("c2lip").prepare_batch({k: v for k, v in _batch.items() if k != "node_np"}),
          contains="node_np")
assert get_method("c2lip", {"base": "clip", "npc_weight": 0, "xac_weight": 0}).build_modules(_model) is None
# a SigLIP model (it holds logit_bias): its own t and b, nothing fresh, the gradients reach them
_sm = create_model("powerclip-micro", init_logit_scale=math.log(10), init_logit_bias=-10.0)[0]
_meth = get_method("c2lip")
assert _meth.build_modules(_sm) is None
_out = _meth.forward(_sm, _pb)
assert _out["sigmoid_scale"] is _out["logit_scale"] and _out["sigmoid_bias"] is _out["logit_bias"]
sum(v for k, v in _meth.loss(_out, _pb, DistContext()).items() if not k.startswith("_")).backward()
assert _sm.logit_bias.grad is not None and _sm.logit_scale.grad is not None

# %% [markdown]
# Under bf16 autocast (as the paper trains, and as the trainer's `precision=bf16` runs) the terms and gradients
# stay finite: the similarities are cast to float32 before the scale, bias, softmax and log-sigmoid.

# %%
_meth = get_method("c2lip", {"xac_weight": 1.0})
_mods = _meth.build_modules(_model)
with torch.autocast("cpu", dtype=torch.bfloat16):
    _out = _meth.forward(_model, _pb, _mods)
    _terms = _meth.loss(_out, _pb, DistContext())
_model.zero_grad()
sum(v for k, v in _terms.items() if not k.startswith("_")).backward()
assert all(torch.isfinite(v) for v in _terms.values())
assert all(torch.isfinite(p.grad).all() for p in list(_model.parameters()) + list(_mods.parameters())
           if p.grad is not None)
print({k: (round(float(v.detach()), 4), v.dtype) for k, v in _terms.items() if not k.startswith("_")})
