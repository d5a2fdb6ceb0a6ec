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
#| default_exp baselines.sparc

# %%
#| export
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from powerclip.dist import DistContext, gather
from powerclip.loss import clip_loss
from powerclip.methods import Method, register
from powerclip.model import text_token_mask

# %%
#| hide
from torch.autograd import gradcheck
from torch.testing import assert_close


# %% [markdown]
# # SPARC
#
# > Sparse fine-grained contrastive alignment (Bica et al., ICML 2024): each caption token gathers the patches it is most similar to into a language-grouped vision embedding, and is contrasted with it against the other tokens of the same caption.

# %% [markdown]
# For one image-caption pair with patch embeddings $v_1..v_P$ and real token embeddings $e_1..e_M$:
#
# 1. similarities $s_{rj}=\langle e_r, v_j\rangle$;
# 2. min-max normalised per token over the patches, $\hat s_{rj}=\dfrac{s_{rj}-\min_k s_{rk}}{\max_k s_{rk}-\min_k s_{rk}}\in[0,1]$;
# 3. sparsified below $\sigma=1/P$: $\bar s_{rj}=\hat s_{rj}\,[\hat s_{rj}\ge\sigma]$;
# 4. renormalised into alignment weights $a_{rj}=\bar s_{rj}/\sum_k\bar s_{rk}$ (the best patch has $\hat s=1\ge\sigma$, so the sum is at least 1);
# 5. the language-grouped vision embedding $c_r=\sum_j a_{rj}v_j$;
# 6. a fine-grained InfoNCE *within the pair*, over the tokens of the same caption, both directions, with cosine
#    similarity $\varphi$ and temperature $\tau$:
#
# $$\mathcal L_f=\frac1{2B}\sum_{k=1}^{B}\frac1{M_k}\sum_{r=1}^{M_k}\Big[-\log\frac{e^{\varphi(c_{kr},e_{kr})/\tau}}{\sum_{s}e^{\varphi(c_{kr},e_{ks})/\tau}}
#   -\log\frac{e^{\varphi(e_{kr},c_{kr})/\tau}}{\sum_{s}e^{\varphi(e_{kr},c_{ks})/\tau}}\Big],\qquad
#   \mathcal L_{\text{SPARC}}=\lambda_g\mathcal L_{g}+\lambda_f\mathcal L_f ,$$
#
# with $\mathcal L_g$ the global CLIP loss of `11_loss`.
#
# **Our choices, written down.** Tokens: those of `text_token_mask` (not padding, not SOT/EOT; see `30_model`),
# so $M_k$ counts words only. Steps 1-5 use the projected, *un-normalised* embeddings of `encode` (min-max
# normalisation makes step 2 independent of the token's norm; the patches keep their norms as in the paper's
# weighted sum), and $\varphi$ normalises. A token whose similarities are all equal (range 0) gets uniform
# weights. Gradient flows through the alignment weights (no stop-gradient). $1/\tau$ is the model's learnable
# logit scale unless `fine_scale` fixes it. The fine loss only involves a pair's own image and caption, so it
# needs nothing from other processes: each process averages its own pairs, and DDP's averaging gives the global
# mean. Weights: $\lambda_g=\lambda_f=1$ by default — the paper writes the total as $\lambda_g\mathcal L_g+
# \lambda_f\mathcal L_f$; its exact values could not be checked from here (only the abstract is reachable in
# this environment), so set them in the method config of a preset.

# %% [markdown]
# ## Alignment weights and grouped embeddings

# %%
#| export
def sparc_weights(
    sim: torch.Tensor,           # (C, L, P) token-patch similarities of each pair
    threshold: float | None = None,  # sparsity threshold sigma (None: 1/P, the paper's choice)
) -> torch.Tensor:               # (C, L, P) alignment weights, each row sums to 1
    "Min-max normalise over patches, zero what falls below sigma, renormalise (SPARC's alignment weights)."
    P = sim.shape[-1]
    sigma = 1.0 / P if threshold is None else threshold
    lo, hi = sim.amin(-1, keepdim=True), sim.amax(-1, keepdim=True)    # (C, L, 1)
    rng = hi - lo
    s_hat = torch.where(rng > 0, (sim - lo) / rng.clamp_min(torch.finfo(sim.dtype).tiny), torch.ones_like(sim))
    s_bar = s_hat * (s_hat >= sigma)                                   # (C, L, P) sparse
    return s_bar / s_bar.sum(-1, keepdim=True)                         # sum >= 1: the best patch has s_hat = 1


def grouped_embeddings(
    patches: torch.Tensor,       # (C, P, D) patch embeddings
    tokens: torch.Tensor,        # (C, L, D) token embeddings
    threshold: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # (grouped (C, L, D), weights (C, L, P))
    "Language-grouped vision embeddings c_r = sum_j a_rj v_j of every token of every pair."
    dtype = torch.promote_types(torch.promote_types(patches.dtype, tokens.dtype), torch.float32)
    # at least float32 even under autocast: min-max and the 1/P threshold need more than bf16's 8 bits
    with torch.autocast(patches.device.type, enabled=False):
        patches, tokens = patches.to(dtype), tokens.to(dtype)
        sim = torch.einsum("cld,cpd->clp", tokens, patches)            # (C, L, P)
        a = sparc_weights(sim, threshold)                              # (C, L, P)
        return torch.einsum("clp,cpd->cld", a, patches), a


# %%
def _naive_grouped(v, e, sigma=None):
    "One pair, one token at a time, as steps 1-5 say. v (P, D), e (L, D) -> (L, D)"
    P = v.shape[0]; sigma = 1 / P if sigma is None else sigma
    out = []
    for r in range(e.shape[0]):
        s = [e[r] @ v[j] for j in range(P)]
        lo, hi = min(s), max(s)
        s_bar = [(x - lo) / (hi - lo) if (x - lo) / (hi - lo) >= sigma else 0 * x for x in s]
        tot = sum(s_bar)
        out.append(sum(s_bar[j] / tot * v[j] for j in range(P)))
    return torch.stack(out)

_g = torch.Generator().manual_seed(0)
_V, _E = torch.randn(3, 8, 4, generator=_g, dtype=torch.float64), torch.randn(3, 5, 4, generator=_g, dtype=torch.float64)
_c, _a = grouped_embeddings(_V, _E)
for k in range(3): assert_close(_c[k], _naive_grouped(_V[k], _E[k]))
assert_close(_a.sum(-1), torch.ones(3, 5, dtype=torch.float64))
print(f"patches kept per token (P=8, sigma=1/8): mean {float((_a > 0).sum(-1).double().mean()):.2f} of 8")
# a token equally similar to every patch: uniform weights, not NaN
assert_close(sparc_weights(torch.zeros(1, 1, 4)), torch.full((1, 1, 4), 0.25))


# %% [markdown]
# ## The fine-grained loss

# %%
#| export
def sparc_fine_loss(
    patches: torch.Tensor,       # (R, P, D) patch embeddings of the local pairs (projected, not normalised)
    tokens: torch.Tensor,        # (R, L, D) token embeddings of the local pairs
    token_valid: torch.Tensor,   # (R, L) bool, every caption with at least one valid token
    scale: torch.Tensor | float, # 1/tau of the fine-grained InfoNCE
    threshold: float | None = None,  # sigma (None: 1/P)
) -> torch.Tensor:               # scalar: mean over pairs of the token-averaged two-way InfoNCE
    "SPARC's sequence-wise loss: each token against its language-grouped vision embedding, within its own pair."
    if not token_valid.any(-1).all(): raise ValueError("every caption needs at least one valid token")
    L = int(token_valid.any(0).nonzero().max()) + 1                             # trailing slots are padding everywhere
    tokens, token_valid = tokens[:, :L], token_valid[:, :L]                     # (R, L', D): exact, and cheaper
    c, _ = grouped_embeddings(patches, tokens, threshold)                       # (R, L, D), float32 or float64
    with torch.autocast(patches.device.type, enabled=False):                    # per-pair (R, L, L): cheap in float32
        e = F.normalize(tokens.to(c.dtype), dim=-1)
        logits = scale * torch.einsum("crd,csd->crs", F.normalize(c, dim=-1), e)  # (R, L, L) [grouped r, token s]
    pad = ~token_valid[:, None, :]                                              # (R, 1, L) padded columns
    lp_c2t = logits.masked_fill(pad, float("-inf")).log_softmax(-1).diagonal(dim1=1, dim2=2)       # (R, L)
    lp_t2c = logits.transpose(1, 2).masked_fill(pad, float("-inf")).log_softmax(-1).diagonal(dim1=1, dim2=2)
    per_tok = -(lp_c2t + lp_t2c).masked_fill(~token_valid, 0.0)                 # (R, L), padded rows dropped
    return (per_tok.sum(-1) / token_valid.sum(-1)).mean() / 2


# %% [markdown]
# Against the formula as loops over pairs and tokens (float64, forward and gradient), `gradcheck`, and two
# simulated processes: the fine loss needs no gathering, so the mean of the per-process losses is the full-batch loss.

# %%
def _naive_fine(V, E, valid, scale):
    tot = 0
    for k in range(V.shape[0]):
        rs = [r for r in range(E.shape[1]) if valid[k, r]]
        c = _naive_grouped(V[k], E[k])
        cos = lambda a, b: a @ b / (a.norm() * b.norm())
        Lk = 0
        for r in rs:
            Lk = Lk - torch.log(torch.exp(scale * cos(c[r], E[k, r])) / sum(torch.exp(scale * cos(c[r], E[k, s])) for s in rs))
            Lk = Lk - torch.log(torch.exp(scale * cos(E[k, r], c[r])) / sum(torch.exp(scale * cos(E[k, r], c[s])) for s in rs))
        tot = tot + Lk / len(rs)
    return tot / (2 * V.shape[0])

_valid = torch.tensor([[True, True, True, False, False], [True, False, False, False, False],
                       [True, True, True, True, True], [True, True, False, True, False]])
_g = torch.Generator().manual_seed(1)
_V, _E = torch.randn(4, 8, 4, generator=_g, dtype=torch.float64), torch.randn(4, 5, 4, generator=_g, dtype=torch.float64)
_args1 = (_V.clone().requires_grad_(), _E.clone().requires_grad_())
_args2 = (_V.clone().requires_grad_(), _E.clone().requires_grad_())
_l, _ref = sparc_fine_loss(*_args1, _valid, 5.0), _naive_fine(*_args2, _valid, 5.0)
assert_close(_l, _ref)
_l.backward(); _ref.backward()
for a, b in zip(_args1, _args2): assert_close(a.grad, b.grad)
assert gradcheck(lambda v, e: sparc_fine_loss(v, e, _valid, 5.0), _args1, eps=1e-6, atol=1e-5)
assert_close((sparc_fine_loss(_V[:2], _E[:2], _valid[:2], 5.0) + sparc_fine_loss(_V[2:], _E[2:], _valid[2:], 5.0)) / 2, _l.detach())
print(f"fine loss {float(_l.detach()):.4f} (naive {float(_ref.detach()):.4f})")

# %% [markdown]
# `gradcheck` passes because the random inputs keep every normalised similarity away from the threshold $\sigma$,
# where the weights jump. Finite under bf16 autocast at ViT-B/16 sizes, with a large scale:

# %%
_P = torch.randn(4, 196, 32, generator=_g).requires_grad_()
_T = torch.randn(4, 77, 32, generator=_g).requires_grad_()
_ids77 = torch.zeros(4, 77, dtype=torch.long); _ids77[:, 0] = 49406; _ids77[:, 1:12] = 5; _ids77[:, 12] = 49407
with torch.autocast("cpu", dtype=torch.bfloat16):
    _lin = torch.nn.Linear(32, 32)                       # a bf16 layer in front, as the towers' projections
    _lb = sparc_fine_loss(_lin(_P), _lin(_T), text_token_mask(_ids77), torch.tensor(20.0))
_lb.backward()
assert torch.isfinite(_lb) and torch.isfinite(_P.grad).all() and torch.isfinite(_T.grad).all()
_l32 = sparc_fine_loss(_lin(_P).detach(), _lin(_T).detach(), text_token_mask(_ids77), torch.tensor(20.0))
print(f"bf16 autocast: {float(_lb.detach()):.4f} ({_lb.dtype}), float32: {float(_l32):.4f}")
assert _lb.dtype == torch.float32 and abs(float(_lb.detach()) - float(_l32)) < 0.05 * float(_l32)


# %% [markdown]
# ## The method
#
# Registered as `sparc`. Only the global loss gathers (image and text embeddings, as `clip`); the fine loss runs
# on the local pairs.

# %%
#| export
@dataclass
class SPARCConfig:
    lambda_global: float = 1.0      # weight of the global CLIP loss (lambda_g)
    lambda_fine: float = 1.0        # weight of the fine-grained loss (lambda_f)
    threshold: float | None = None  # sparsity threshold sigma (None: 1/P, the paper's choice)
    fine_scale: float | None = None # fixed 1/tau of the fine loss (None: the model's learnable logit scale)
    special_tokens: bool = False    # count SOT and EOT as caption tokens (default: words only)

    def __post_init__(self):
        if self.lambda_global < 0 or self.lambda_fine < 0 or self.lambda_global + self.lambda_fine == 0:
            raise ValueError(f"need lambda_global, lambda_fine >= 0, not both 0; got {self.lambda_global}, {self.lambda_fine}")
        if self.threshold is not None and not 0 <= self.threshold <= 1:
            raise ValueError(f"threshold must be in [0, 1] (min-max normalised similarities), got {self.threshold}")


@register("sparc")
class SPARC(Method):
    "SPARC (Bica et al. 2024): lambda_g * CLIP loss + lambda_f * sparse token-to-grouped-patches loss, config `SPARCConfig`."
    Config = SPARCConfig
    needs_patches = True

    def loss(self, out, batch, dist: DistContext):
        s = out["logit_scale"]
        terms = {}
        if self.cfg.lambda_global > 0:
            g = gather(dist, {"image": out["image"], "text": out["text"]})
            terms["clip"] = self.cfg.lambda_global * clip_loss(out["image"], out["text"], s, g.all["image"], g.all["text"], g.offset)
        if self.cfg.lambda_fine > 0:
            valid = text_token_mask(batch["tokens"].to(out["tokens"].device), self.cfg.special_tokens)  # (R, L)
            scale = s if self.cfg.fine_scale is None else self.cfg.fine_scale
            terms["sparc_fine"] = self.cfg.lambda_fine * sparc_fine_loss(out["patches"], out["tokens"], valid, scale, self.cfg.threshold)
        terms["_logit_scale"] = s.detach()
        return terms


# %%
from powerclip.methods import METHODS, get_method

assert METHODS["sparc"] is SPARC
_ids = torch.tensor([[49406, 7, 8, 9, 49407, 0], [49406, 7, 49407, 0, 0, 0], [49406, 1, 2, 3, 4, 49407], [49406, 5, 6, 49407, 0, 0]])
_out = dict(image=F.normalize(torch.randn(4, 4, dtype=torch.float64), dim=-1), text=F.normalize(torch.randn(4, 4, dtype=torch.float64), dim=-1),
            patches=_V, tokens=torch.randn(4, 6, 4, generator=_g, dtype=torch.float64), logit_scale=torch.tensor(5.0, dtype=torch.float64))
_terms = get_method("sparc", {"lambda_fine": 0.5}).loss(_out, {"tokens": _ids}, DistContext())
assert_close(_terms["sparc_fine"], 0.5 * sparc_fine_loss(_V, _out["tokens"], text_token_mask(_ids), 5.0))
assert_close(_terms["clip"], clip_loss(_out["image"], _out["text"], _out["logit_scale"]))
print({k: round(float(v), 4) for k, v in _terms.items()})
