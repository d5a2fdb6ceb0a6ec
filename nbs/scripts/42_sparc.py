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
import torch.nn as nn
import torch.nn.functional as F

from powerclip.dist import DistContext, all_sum, gather
from powerclip.loss import clip_loss
from powerclip.methods import GlobalScorer, Method, Scorer, register
from powerclip.model import text_token_mask
from powerclip.powerset import pool_normalize

# %%
#| hide
from torch.autograd import gradcheck
from torch.testing import assert_close


# %% [markdown]
# # SPARC
#
# > Sparse fine-grained contrastive alignment (Bica et al., ICML 2024).
#
# Each caption token gathers the patches it is most similar to into a language-grouped vision embedding, and is contrasted
# with it against the other tokens of the same caption.

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
# with $\mathcal L_g$ the global CLIP loss of `11_loss` on SPARC's global embeddings (below).
#
# **What the paper fixes** (Bica et al., arXiv 2401.09865 v1; quoted in the project's research notes, section 3):
#
# - *Weights.* App. D.4: "we set the global loss weight $\lambda_g = 0.5$ and we sweep the local loss weight in
#   $\lambda_f\in[0.5, 1.0, 5.0, 10.0]$"; the value it kept is not stated. So `lambda_global=0.5` is the default and
#   `lambda_fine` (default 1.0, one of the four) is to be chosen by a sweep over those four values on validation data
#   (`method_cfg.lambda_fine=...`). Listing 1 already halves each term (`0.5 * (loss_vl + loss_lv)`), as our losses
#   average their two directions.
# - *Global embeddings.* Sec. 2: $v_i = g_v(h_v(\mathrm{avg\_pool}(\{f_v(x_p)\})))$ and
#   $t_i = g_t(\mathrm{avg\_pool}(\{f_t(x_l)\}))$, with $h_v$ "a single non-linear layer" and $g_v, g_t$ the linear
#   adapters that also map the patches and tokens ($v_{i,p}=g_v(f_v(x_p))$); App. D.3: "we do not use the [CLS]
#   token but instead use average pooling". App. D.7 passes patch embeddings "through the extra dense layer and the
#   adapter", so $h_v$ is a layer of the model, trained with it. (Listing 1 pools the adapted embeddings without
#   $h_v$; we follow the text.)
# - *Temperature.* One learned temperature for both losses (Eqs. 1, 6; App. D.4): the model's `logit_scale`.
# - *Fine loss normalisation.* Eq. 6 averages over each caption's tokens, then over captions (above);
#   Listing 1 (`masked_pairwise_contrastive_loss`) divides the sum over all tokens of the batch by their count, which
#   weighs long captions more. `fine_norm='caption'` (default, Eq. 6) or `'tokens'` (the listing).
#
# **How that maps onto open_clip's towers.** `encode` (`30_model`) gives the patches as `ln_post(x_p) @ visual.proj`
# and the tokens as `ln_final(y_l) @ text_projection`: $f_v$ is the vision trunk with `ln_post`, $g_v$ is
# `visual.proj`, $f_t$ the text trunk with `ln_final`, $g_t$ is `text_projection`. With `global_pool='mean'`
# (default):
#
# - image: $v = g_v(h_v(\tfrac1N\sum_p f_v(x_p)))$, where $h_v(z)=\mathrm{GELU}(Wz+\beta)$ is one linear layer of
#   the vision width with the towers' activation (`SPARCHead`, a training-time module of the method, saved beside
#   the model in `method_modules.pt`; fresh when the run starts from a plain open_clip checkpoint);
# - text: $t = g_t(\tfrac1{|T|}\sum_{l\in T} f_t(x_l))$ over the caption's positions $T$ (SOT, words and EOT; not
#   the padding, which Listing 1's unmasked mean would include). The adapter is linear, so this is the mean of the
#   projected tokens. CLIP's text tower is causal: only EOT has seen the whole caption, which is why it is kept
#   in the mean. The class token and EOT pooling of open_clip (`global_pool='cls'`) remain as an option.
#
# The loss's global term uses the configured pooling, and so does SPARC's own scorer at evaluation (`scorers`:
# `'sparc'` first, then `'global'`, open_clip's class-token/EOT cosine that every method offers).
#
# **Our choices for the fine loss, written down.** Tokens: those of `text_token_mask` (not padding, not SOT/EOT; see
# `30_model`), so $M_k$ counts words only. Steps 1-5 use the projected, *un-normalised* embeddings of `encode`
# (min-max normalisation makes step 2 independent of the token's norm; the patches keep their norms as in the
# paper's weighted sum), and $\varphi$ normalises. A token whose similarities are all equal (range 0) gets uniform
# weights. Gradient flows through the alignment weights (no stop-gradient). $1/\tau$ is the model's learnable
# logit scale unless `fine_scale` fixes it. The fine loss only involves a pair's own image and caption, so it needs
# nothing from other processes: each process averages its own pairs, and DDP's averaging gives the global mean
# (for `fine_norm='tokens'`, each process divides by its share of the batch's token count, one scalar all-reduce).

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
    P = v.shape[0]
    sigma = 1 / P if sigma is None else sigma
    out = []
    for r in range(e.shape[0]):
        s = [e[r] @ v[j] for j in range(P)]
        lo, hi = min(s), max(s)
        s_bar = [(x - lo) / (hi - lo) if (x - lo) / (hi - lo) >= sigma else 0 * x for x in s]
        tot = sum(s_bar)
        out.append(sum(s_bar[j] / tot * v[j] for j in range(P)))
    return torch.stack(out)

_g = torch.Generator().manual_seed(0)
_V, _E = (torch.randn(3, 8, 4, generator=_g, dtype=torch.float64),
          torch.randn(3, 5, 4, generator=_g, dtype=torch.float64))
_c, _a = grouped_embeddings(_V, _E)
for k in range(3):
    assert_close(_c[k], _naive_grouped(_V[k], _E[k]))
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
    norm: str = "caption",       # 'caption': mean over each caption's tokens, then over captions (Eq. 6)
                                 # 'tokens': sum over all tokens / their count (Listing 1)
    token_count: torch.Tensor | float | None = None,  # 'tokens': the divisor, this process's share of the batch's
                                 # token count (all_sum(count) / processes); None: this batch's own count
) -> torch.Tensor:               # scalar: the two-way InfoNCE averaged as `norm` says, halved
    "SPARC's sequence-wise loss: each token against its language-grouped vision embedding, within its own pair."
    if norm not in ("caption", "tokens"):
        raise ValueError(f"norm must be 'caption' or 'tokens', got {norm!r}")
    if not token_valid.any(-1).all():
        raise ValueError("every caption needs at least one valid token")
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
    if norm == "caption":
        return (per_tok.sum(-1) / token_valid.sum(-1)).mean() / 2
    return per_tok.sum() / (token_valid.sum() if token_count is None else token_count) / 2


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
            Lk = (Lk - torch.log(torch.exp(scale * cos(c[r], E[k, r]))
                                 / sum(torch.exp(scale * cos(c[r], E[k, s])) for s in rs)))
            Lk = (Lk - torch.log(torch.exp(scale * cos(E[k, r], c[r]))
                                 / sum(torch.exp(scale * cos(E[k, r], c[s])) for s in rs)))
        tot = tot + Lk / len(rs)
    return tot / (2 * V.shape[0])

_valid = torch.tensor([[True, True, True, False, False], [True, False, False, False, False],
                       [True, True, True, True, True], [True, True, False, True, False]])
_g = torch.Generator().manual_seed(1)
_V, _E = (torch.randn(4, 8, 4, generator=_g, dtype=torch.float64),
          torch.randn(4, 5, 4, generator=_g, dtype=torch.float64))
_args1 = (_V.clone().requires_grad_(), _E.clone().requires_grad_())
_args2 = (_V.clone().requires_grad_(), _E.clone().requires_grad_())
_l, _ref = sparc_fine_loss(*_args1, _valid, 5.0), _naive_fine(*_args2, _valid, 5.0)
assert_close(_l, _ref)
_l.backward()
_ref.backward()
for a, b in zip(_args1, _args2):
    assert_close(a.grad, b.grad)
assert gradcheck(lambda v, e: sparc_fine_loss(v, e, _valid, 5.0), _args1, eps=1e-6, atol=1e-5)
assert_close((sparc_fine_loss(_V[:2], _E[:2], _valid[:2], 5.0) + sparc_fine_loss(_V[2:], _E[2:], _valid[2:], 5.0))
             / 2, _l.detach())
print(f"fine loss {float(_l.detach()):.4f} (naive {float(_ref.detach()):.4f})")
# Listing 1's token-weighted mean: the naive per-caption sums (L_k times M_k), over all tokens; two processes
# dividing by their share of the token count (6 + 8 tokens, 7 each) give the same mean
_per_cap = torch.stack([_naive_fine(_V[k:k + 1], _E[k:k + 1], _valid[k:k + 1], 5.0) * 2 * _valid[k].sum()
                        for k in range(4)])
_lt = sparc_fine_loss(_V, _E, _valid, 5.0, norm="tokens")
assert_close(_lt, _per_cap.sum() / _valid.sum() / 2)
_half = _valid.sum() / 2
assert_close((sparc_fine_loss(_V[:2], _E[:2], _valid[:2], 5.0, norm="tokens", token_count=_half)
              + sparc_fine_loss(_V[2:], _E[2:], _valid[2:], 5.0, norm="tokens", token_count=_half)) / 2, _lt)
assert not torch.allclose(_lt, _l.detach())              # captions of 3, 1, 5 and 3 words: the two means differ

# %% [markdown]
# `gradcheck` passes because the random inputs keep every normalised similarity away from the threshold $\sigma$,
# where the weights jump. Finite under bf16 autocast at ViT-B/16 sizes, with a large scale:

# %%
_P = torch.randn(4, 196, 32, generator=_g).requires_grad_()
_T = torch.randn(4, 77, 32, generator=_g).requires_grad_()
_ids77 = torch.zeros(4, 77, dtype=torch.long)
_ids77[:, 0] = 49406
_ids77[:, 1:12] = 5
_ids77[:, 12] = 49407
with torch.autocast("cpu", dtype=torch.bfloat16):
    _lin = torch.nn.Linear(32, 32)                       # a bf16 layer in front, as the towers' projections
    _lb = sparc_fine_loss(_lin(_P), _lin(_T), text_token_mask(_ids77), torch.tensor(20.0))
_lb.backward()
assert torch.isfinite(_lb) and torch.isfinite(_P.grad).all() and torch.isfinite(_T.grad).all()
_l32 = sparc_fine_loss(_lin(_P).detach(), _lin(_T).detach(), text_token_mask(_ids77), torch.tensor(20.0))
print(f"bf16 autocast: {float(_lb.detach()):.4f} ({_lb.dtype}), float32: {float(_l32):.4f}")
assert _lb.dtype == torch.float32 and abs(float(_lb.detach()) - float(_l32)) < 0.05 * float(_l32)


# %% [markdown]
# ## Global embeddings
#
# `vision_patch_features` is the vision side of `encode` stopped before the adapter: the last block's patch tokens
# through `ln_post`, $f_v(x_p)$ of width `visual.width` (no class token). `SPARCHead` is $h_v$. `sparc_encode` gives
# what `encode` gives, with `image` and `text` replaced by SPARC's pooled global embeddings.

# %%
#| export
def vision_patch_features(model, image: torch.Tensor) -> torch.Tensor:
    "image `(C, 3, H, W)` -> `(C, N, width)`: the patch tokens of the last block after `ln_post`, before `visual.proj`."
    v = model.visual
    x = v.forward_intermediates(image, indices=1, output_fmt="NLC", intermediates_only=True)["image_intermediates"][-1]
    return v.ln_post(x)                                                   # (C, N, width) f_v(x_p)


class SPARCHead(nn.Module):
    "h_v of SPARC's image embedding: one linear layer of the vision width and a GELU (`(..., width) -> (..., width)`)."
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc(x))


def sparc_encode(model, image: torch.Tensor | None, tokens: torch.Tensor | None, head: SPARCHead | None) -> dict:
    """As `powerclip.model.encode` (patches and tokens projected, not normalised; logit_scale), with `image` `(C, D)`
    = normalise(g_v(h_v(mean_p f_v(x_p)))) and `text` `(C, D)` = normalise(mean of the projected tokens over the
    caption's positions, padding excluded). A tower whose input is None is not run."""
    from powerclip.model import encode                                    # late: importable without open_clip loaded
    out = encode(model, None, tokens) if tokens is not None else dict(logit_scale=model.logit_scale.exp())
    if tokens is not None:
        pos = text_token_mask(tokens.to(out["tokens"].device), special_tokens=True)   # (C, L) SOT, words, EOT
        out["text"] = pool_normalize(out["tokens"], pos[:, None, :])[:, 0]            # (C, D)
    if image is not None:
        if head is None:
            raise RuntimeError("SPARC's mean-pooled image embedding needs its head h_v (method.build_modules)")
        f = vision_patch_features(model, image)                                        # (C, N, width)
        proj = model.visual.proj
        out["patches"] = f @ proj                                                      # (C, N, D) as encode's
        out["image"] = F.normalize(head(f.mean(1)) @ proj.to(f.dtype), dim=-1)         # (C, D)
    return out


class SPARCScorer(Scorer):
    "SPARC's own score at evaluation: the cosine of its mean-pooled global embeddings (with its trained h_v)."
    name = "sparc"

    def __init__(self, head: SPARCHead):
        self.head = head

    @torch.no_grad()
    def image_features(self, model, images):
        return {"image": sparc_encode(model, images, None, self.head)["image"].float()}   # (B, D)

    @torch.no_grad()
    def text_features(self, model, tokens):
        return {"text": sparc_encode(model, None, tokens, None)["text"].float()}          # (B, D)

    def scores(self, img, txt):
        return img["image"] @ txt["text"].to(img["image"].device).T                      # (I, T)

    @torch.no_grad()
    def region_features(self, model, images, masks):
        "SPARC's pooling on a region: normalise(g_v(h_v(mean of f_v over the region's patches))) `(B, R, D)`."
        f = vision_patch_features(model, images)                                          # (B, N, width)
        w = masks.to(f.device, f.dtype)                                                  # (B, R, N)
        mean = (w @ f) / w.sum(-1, keepdim=True).clamp_min(1)                            # (B, R, width)
        return F.normalize(self.head(mean) @ model.visual.proj.to(f.dtype), dim=-1).float()

    @torch.no_grad()
    def crop_features(self, model, images):
        return self.image_features(model, images)["image"]

    @torch.no_grad()
    def class_features(self, model, tokens):
        return self.text_features(model, tokens)["text"]


# %% [markdown]
# Checks on the micro model (random weights): the patches are `encode`'s; the text pool is the normalised mean of
# the projected tokens over the caption's positions; the image pool is $g_v(h_v(\cdot))$ of the mean of
# $f_v(x_p)$, and, $g_v$ being linear, without $h_v$ it would be the mean of the projected patches (the listing's form).

# %%
from powerclip.model import create_model, encode, register_configs
register_configs()
torch.manual_seed(0)
_model = create_model("powerclip-micro")[0].eval()
_img = torch.randn(3, 3, 32, 32, generator=_g)
_ids3 = torch.zeros(3, 77, dtype=torch.long)
_ids3[:, 0] = 49406
_ids3[:, 1:4] = 320
_ids3[:, 4] = 49407
_ids3[2, 4:9] = 7
_ids3[2, 9] = 49407
_head = SPARCHead(_model.visual.proj.shape[0])
with torch.no_grad():
    _enc, _sp = encode(_model, _img, _ids3), sparc_encode(_model, _img, _ids3, _head)
    assert_close(_sp["patches"], _enc["patches"])
    assert_close(_sp["tokens"], _enc["tokens"])
    _n = (_ids3 != 0).sum(1, keepdim=True)
    assert_close(_sp["text"], F.normalize((_enc["tokens"] * (_ids3 != 0)[..., None]).sum(1) / _n, dim=-1))
    _f = vision_patch_features(_model, _img)
    assert_close(_sp["image"], F.normalize(F.gelu(_head.fc(_f.mean(1))) @ _model.visual.proj, dim=-1))
    assert_close(_f.mean(1) @ _model.visual.proj, _enc["patches"].mean(1))          # g_v linear: pool, then adapt
    assert (not torch.allclose(_sp["image"], _enc["image"])
            and set(sparc_encode(_model, None, _ids3, None)) == {"text", "tokens", "logit_scale"})
print({k: tuple(v.shape) for k, v in _sp.items()})


# %% [markdown]
# ## The method
#
# Registered as `sparc`. Only the global loss gathers (image and text embeddings, as `clip`); the fine loss runs
# on the local pairs. With `global_pool='mean'` the method builds $h_v$ (`build_modules`), which the trainer trains
# at the run's learning rate, synchronises under DDP and saves beside the model (`method_modules.pt`); the
# evaluator loads it back for the `'sparc'` scorer.

# %%
#| export
@dataclass
class SPARCConfig:
    lambda_global: float = 0.5      # lambda_g, App. D.4: 0.5
    lambda_fine: float = 1.0        # lambda_f, App. D.4 sweeps {0.5, 1, 5, 10} (pick it on validation data)
    global_pool: str = "mean"       # 'mean': Sec. 2's average-pooled embeddings, image through h_v | 'cls': CLS / EOT
    fine_norm: str = "caption"      # 'caption': Eq. 6's per-caption token mean | 'tokens': Listing 1's token-weighted
                                    # mean
    threshold: float | None = None  # sparsity threshold sigma (None: 1/P, the paper's choice)
    fine_scale: float | None = None # fixed 1/tau of the fine loss (None: the model's learnable logit scale, one for
                                    # both)
    special_tokens: bool = False    # count SOT and EOT as caption tokens of the fine loss (default: words only)

    def __post_init__(self):
        if self.lambda_global < 0 or self.lambda_fine < 0 or self.lambda_global + self.lambda_fine == 0:
            raise ValueError("need lambda_global, lambda_fine >= 0, not both 0; got "
                             f"{self.lambda_global}, {self.lambda_fine}")
        if self.threshold is not None and not 0 <= self.threshold <= 1:
            raise ValueError(f"threshold must be in [0, 1] (min-max normalised similarities), got {self.threshold}")
        if self.global_pool not in ("mean", "cls"):
            raise ValueError(f"global_pool must be 'mean' or 'cls', got {self.global_pool!r}")
        if self.fine_norm not in ("caption", "tokens"):
            raise ValueError(f"fine_norm must be 'caption' or 'tokens', got {self.fine_norm!r}")


LAMBDA_FINE_SWEEP = (0.5, 1.0, 5.0, 10.0)   # App. D.4: the values of lambda_f the paper sweeps (lambda_g = 0.5)


@register("sparc")
class SPARC(Method):
    """SPARC (Bica et al. 2024): lambda_g * CLIP loss on pooled embeddings + lambda_f * sparse fine-grained loss, config
    `SPARCConfig`."""
    Config = SPARCConfig
    needs_patches = True

    def build_modules(self, model) -> SPARCHead | None:
        "h_v of the mean-pooled image embedding (None with `global_pool='cls'`)."
        return SPARCHead(model.visual.proj.shape[0]) if self.cfg.global_pool == "mean" else None

    def forward(self, model, batch, modules=None):
        if self.cfg.global_pool == "cls":
            return super().forward(model, batch)
        if not isinstance(modules, SPARCHead):
            raise RuntimeError("SPARC needs its head h_v: pass modules=method.build_modules(model)")
        return sparc_encode(model, batch["image"], batch["tokens"], modules)

    def loss(self, out, batch, dist: DistContext):
        s = out["logit_scale"]
        terms = {}
        if self.cfg.lambda_global > 0:
            g = gather(dist, {"image": out["image"], "text": out["text"]})
            terms["clip"] = (self.cfg.lambda_global
                             * clip_loss(out["image"], out["text"], s, g.all["image"], g.all["text"], g.offset))
        if self.cfg.lambda_fine > 0:
            valid = text_token_mask(batch["tokens"].to(out["tokens"].device), self.cfg.special_tokens)  # (R, L)
            scale = s if self.cfg.fine_scale is None else self.cfg.fine_scale
            count = all_sum(valid.sum().to(s.dtype)) / dist.world_size if self.cfg.fine_norm == "tokens" else None
            terms["sparc_fine"] = self.cfg.lambda_fine * sparc_fine_loss(out["patches"], out["tokens"], valid, scale,
                                                                         self.cfg.threshold, self.cfg.fine_norm, count)
        terms["_logit_scale"] = s.detach()
        return terms

    def scorers(self, modules=None) -> dict[str, Scorer]:
        "SPARC's pooled embeddings first (what its paper evaluates), then open_clip's CLS/EOT cosine."
        if self.cfg.global_pool == "cls":
            return {"global": GlobalScorer()}
        if not isinstance(modules, SPARCHead):
            raise ValueError("SPARC's scorer needs its trained head h_v (method_modules.pt beside model.pt, "
                             "or the trainer checkpoint)")
        return {"sparc": SPARCScorer(modules), "global": GlobalScorer()}


# %% [markdown]
# The loss on model outputs built by hand, and the method on the micro model: forward, loss and backward reach the
# head and both towers; the head stays out of the model's `state_dict`; the `'sparc'` scorer scores with the
# embeddings the loss trains.

# %%
from powerclip.methods import METHODS, get_method

assert METHODS["sparc"] is SPARC and get_method("sparc").cfg.lambda_global == 0.5
_ids = torch.tensor([[49406, 7, 8, 9, 49407, 0], [49406, 7, 49407, 0, 0, 0], [49406, 1, 2, 3, 4, 49407],
                     [49406, 5, 6, 49407, 0, 0]])
_out = dict(image=F.normalize(torch.randn(4, 4, dtype=torch.float64), dim=-1),
            text=F.normalize(torch.randn(4, 4, dtype=torch.float64), dim=-1),
            patches=_V, tokens=torch.randn(4, 6, 4, generator=_g, dtype=torch.float64),
            logit_scale=torch.tensor(5.0, dtype=torch.float64))
_terms = get_method("sparc", {"lambda_fine": 0.5, "lambda_global": 1.0}).loss(_out, {"tokens": _ids}, DistContext())
assert_close(_terms["sparc_fine"], 0.5 * sparc_fine_loss(_V, _out["tokens"], text_token_mask(_ids), 5.0))
assert_close(_terms["clip"], clip_loss(_out["image"], _out["text"], _out["logit_scale"]))
_tt = get_method("sparc", {"fine_norm": "tokens"}).loss(_out, {"tokens": _ids}, DistContext())
assert_close(_tt["sparc_fine"], sparc_fine_loss(_V, _out["tokens"], text_token_mask(_ids), 5.0, norm="tokens"))
print({k: round(float(v), 4) for k, v in _terms.items()})

# %%
_model.train()
_m = get_method("sparc")
_mods = _m.build_modules(_model)
_keys = set(_model.state_dict())
_b = {"image": _img, "tokens": _ids3}
_terms = _m.loss(_m.forward(_model, _b, _mods), _b, DistContext())
sum(v for k, v in _terms.items() if not k.startswith("_")).backward()
assert (_mods.fc.weight.grad.abs().sum() > 0 and _model.visual.conv1.weight.grad is not None
        and _model.token_embedding.weight.grad is not None)
assert set(_model.state_dict()) == _keys
_model.eval()
_sc = _m.scorers(_mods)
assert list(_sc) == ["sparc", "global"]
with torch.no_grad():
    # (3, 3)
    _S = _sc["sparc"].scores(_sc["sparc"].image_features(_model, _img), _sc["sparc"].text_features(_model, _ids3))
    _o = _m.forward(_model, _b, _mods)
assert_close(_S, _o["image"] @ _o["text"].T)
assert (list(get_method("sparc", {"global_pool": "cls"}).scorers()) == ["global"]
        and get_method("sparc", {"global_pool": "cls"}).build_modules(_model) is None)
try:
    _m.scorers(None)
    raise AssertionError("no head, no scorer")
except ValueError as e:
    print("refused:", e)
print({k: round(float(v.detach()), 4) for k, v in _terms.items()})
