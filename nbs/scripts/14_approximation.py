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
#| hide
import json
import re
import sys
import time
from pathlib import Path

import matplotlib.pyplot as plt
import torch

from powerclip.powerset import (
    nla_t1, nla_t2, phrase_embeddings, pool_normalize, powerset_scores, r2t_exact, t2r_exact, triplet,
)
from powerclip.theory import (
    CheckRow, alpha_star, check_cosh_identity, check_lse_bound, check_softplus_expansion,
    check_theorem1, check_theorem2, format_table, random_tree, theory_cases, unit_vector_scores,
)


# %% [markdown]
# # Theory III: how well do the NLAs approximate the loss? (Fig. 5 / Fig. 7)
#
# > The paper's approximation experiment redone, plus the paper's ambiguities and our choices.
#
# Pearson correlation between the exact triplet-loss terms $\Phi_\gamma(\bar Q)$, $\Phi_\gamma(\bar Q^\top)$ and their NLA
# approximations over $\tau\times\alpha$, on two kinds of random inputs.

# %% [markdown]
# ## What the paper reports
#
# Sec. 5.3 ("NLA Accuracy", Fig. 5): *"Figure 5 analyzes the approximation accuracy of NLAs for the two
# triplet loss terms $\Phi_\gamma(Q)$ and $\Phi_\gamma(Q^\top)$. [...] loss values approximated by NLAs closely
# match the exact values when τ is small (0.001 or 0.01), consistently achieving Pearson correlations above
# 0.98 across all tested α. The highest correlation (0.999) was obtained with τ = 0.001 and α = 0.75."*
# Appendix C (Fig. 7) compares the similarities themselves, *"computed on synthetic data (randomly generated
# input vectors) with all parameters initialized randomly"*, and notes that $\alpha=1$ and $\alpha=0$ give the
# upper and lower bounds of R2T and that at $\tau=0.1$ the approximations are biased.
#
# The paper does not say which random vectors, which batch size, how many batches, which trees, or which
# margin $\gamma$. So we say exactly what we use, and we try two input distributions:
#
# * **(a) random unit vectors**: region embeddings $\phi(I_i\mid R_m)$ and word embeddings
#   $\psi(T_j\mid P_{m'})$ drawn uniformly on the unit sphere of $\mathbb R^{512}$ (normalised Gaussians), $M=10$
#   regions per image (all valid, as with random boxes), 4-12 words per caption (uniform), a random binary
#   bracketing of the words as the tree with all its $2W-1$ nodes (single words included);
# * **(b) a randomly initialised tiny open_clip model** (no weights downloaded): a 2-layer ViT (width 128,
#   patch 16, $112\times112$ images, a $7\times7$ patch grid) and a 2-layer text transformer (width 128),
#   with a 32-token context, both projected to $D=512$, on uniform-noise images and **real COCO captions** from
#   `../shared/data/coco_sample/captions.jsonl` (up to 16 words). Region masks: $M=10$ random boxes on the patch
#   grid (uniform centre, height and width, Sec. 3.2). Leaves: words (lower-cased alphanumeric runs), each
#   word's BPE tokens pooled by its token mask (Eq. 4). Tree: a random binary bracketing of the words, as in
#   (a) (`powerclip.parsing` is not used here, so that this notebook needs no parser).
#
# Each batch holds $C$ image-text pairs; the exact $\bar Q=Q^{\rightarrow}+Q^{\leftarrow}$ is enumerated over
# all $2^{10}$ subsets; the approximation is $\bar S=\mathrm{NLA\text{-}T1}+\mathrm{NLA\text{-}T2}$ (Eq. 16).
# One batch gives one point $(\Phi_\gamma(\bar Q),\Phi_\gamma(\bar S))$ per loss term; the Pearson $r$ is taken
# over batches, for every $(\tau,\alpha)$ of the paper's grid, with $\gamma=1$.

# %% [markdown]
# ## Ambiguities and our choices
#
# | question | the paper | our choice | why |
# |---|---|---|---|
# | R2T normaliser | main text Eq. 6: $\frac1{2M}$; supplement Eq. 42: $\frac1{2^M}$ | $\frac1{2^M}$ | a mean over the $2^M$ subsets; Jensen (Eq. 78) and $\Lambda(0)\le Q^\rightarrow\le\Lambda(1)$ need it; $\frac1{2M}$ is a lost superscript |
# | loss weight $\lambda$ | Sec. 3.4: 0.2; Appendix F: "we use $\lambda=0.1$ in all experiments" | 0.1 | Appendix F is the later, explicit statement (Table 14 ablation) |
# | triplet margin $\gamma$ | not given | 1.0 | the margin of the triplet loss of ref. [2]; scores $\bar Q$ are of order 1-10 |
# | empty subset $\varnothing$ in $2^{\mathcal M}$ | implicit | included | the expansion $\prod_m(1+e^{x_m})=\sum_A e^{x_A}$ (Eq. 37) has the term 1 from $\varnothing$; Corollary 1 fails without it (`01`) |
# | $-\tau Z^\alpha$ in NLA-T2's output (Eq. 75) | part of the definition | kept (`debias=False`); `debias=True` adds back $\tau\alpha M_i\log2$ | faithful by default; the bias is measured below |
# | leaves | "token masks" of leaf nodes (Sec. 3.3) | words, each pooling its BPE tokens | a leaf of a constituency tree is a word; a word may have several BPE tokens |
# | which tree nodes | "sentence-level or phrase-level constituents" | here: all nodes of a random binary bracketing, single words included | the theory holds for any node sets; the parser notebook decides for training |
# | $\bar Q$ before the loss | Eq. 8 and Eq. 16 | $\bar Q=Q^{\rightarrow}+Q^{\leftarrow}$, one triplet loss on the sum, in both directions | as written in Eqs. 8, 16 |
# | $\Phi_\gamma(Q)$, $\Phi_\gamma(Q^\top)$ in Sec. 5.3 | the "two triplet loss terms" | $\Phi_\gamma(\bar Q)$ and $\Phi_\gamma(\bar Q^\top)$ of Eq. 8 | the only two loss terms there are |
# | random inputs of Fig. 5/7 | "randomly generated input vectors [...] all parameters initialized randomly" | (a) and (b) above | both readings; results differ, see below |
# | NLA-T2's $\zeta_\alpha$ | Definition 2 (Eq. 15): $\zeta_\alpha(x)=x+\alpha\int\mathrm{Act}(x)\,dx$, with tanh $x+\alpha\log\cosh x$; Sec. 5.1: "the function $\zeta_\alpha(x)$ is given by $\log\cosh(x)$" | $x+\alpha\log\cosh x$ (`10_powerset`, `13_theory_r2t`) | Sec. 5.1 names the antiderivative of tanh, the part that the activation decides; read alone it would drop the residual $x$ and the weight $\alpha$, which Sec. 5.1 sets to 0.75 in the same sentence and Theorem 2's sandwich needs ($\zeta_\alpha'(x)=1+\alpha\tanh x\ge 1-\alpha$) |

# %% [markdown]
# ## What the loss can and cannot see: a Lipschitz bound
#
# $\Phi_\gamma$ of Eq. 9 is a mean over rows of $\mathrm{relu}(\max_{j\ne i}X_{ij}-X_{ii}+\gamma)$. Both the max
# and the relu are 1-Lipschitz, so for any two score matrices
# $$|\Phi_\gamma(X)-\Phi_\gamma(Y)|\le2\max_{i,j}|X_{ij}-Y_{ij}| ,$$
# and with $X=\bar Q$, $Y=\bar S$, the loss error is at most twice the worst similarity error, which `01` and
# `02` bound by $\tau M\log2+|{\rm NLA\text{-}T2}-Q^\rightarrow|$. Two further facts decide what Fig. 5 can show:
#
# * adding to $X$ a term $c_i$ that depends only on the **row** changes nothing in $\Phi_\gamma(X)$. In
#   $\Phi_\gamma(\bar S)$ the rows are images: NLA-T2's $-\tau\alpha M_i\log 2$ cancels there; its
#   $-\tau(1-\alpha)\log K_j$ does not. In $\Phi_\gamma(\bar S^\top)$ the rows are texts: the $K_j$ term cancels and
#   the $M_i$ term does not, unless every image has the same number $M_i$ of regions, as with $M=10$ random
#   boxes. **So `debias=True` changes neither loss term when all $M_i$ are equal**, and the experiment below
#   needs padded regions to see it at all;
# * a bias that is the same for every pair (e.g. $\Lambda(0.75)-Q^\rightarrow$ when $\alpha^\ast$ hardly varies)
#   shifts the approximate loss without hurting the correlation: Pearson $r$ measures agreement up to an
#   affine map, not equality.
#
# `check_triplet_lipschitz` checks the bound with the real NLA outputs on the theory cases of `01`:

# %%
#| export theory
def loss_terms(X: torch.Tensor, gamma: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    "(C, C) scores, positives on the diagonal -> (Phi_gamma(X), Phi_gamma(X^T)), the two terms of Eq. 8."
    pos = torch.arange(X.shape[0], device=X.device)
    return triplet(X, pos, gamma), triplet(X.T, pos, gamma)


def check_triplet_lipschitz(n_cases: int = 60, M_max: int = 10, seed: int = 2, tol: float = 1e-12,
                            taus=(1.0, 0.1, 1e-2, 1e-3), alphas=(0.0, 0.5, 0.75, 1.0)) -> CheckRow:
    "|Phi(Qbar) - Phi(Sbar)| <= 2 max|Qbar - Sbar| for both loss terms, Sbar = NLA-T1 + NLA-T2 (Eq. 16)."
    worst, n = 0.0, 0
    for _, Q, rv, nv in theory_cases(n_cases, M_max, seed):
        exact = t2r_exact(Q, rv, nv) + r2t_exact(Q, rv, nv)                    # (C, C)
        le = loss_terms(exact)
        for tau in taus:
            t1 = nla_t1(Q, rv, nv, tau)
            for alpha in alphas:
                approx = t1 + nla_t2(Q, rv, nv, tau, alpha)
                lim = 2 * float((approx - exact).abs().max())
                for a, b in zip(le, loss_terms(approx)):
                    worst = max(worst, max(0.0, abs(float(a - b)) - lim) / max(1.0, abs(float(a))))
                    n += 1
    return CheckRow("Eq. 9: |Phi(Qbar) - Phi(Sbar)| <= 2 max|Qbar - Sbar| (viol.)", n, worst, tol, worst <= tol)


# %%
_X = torch.randn(5, 5, dtype=torch.float64)
_c = torch.randn(5, 1, dtype=torch.float64)
torch.testing.assert_close(loss_terms(_X + _c)[0], loss_terms(_X)[0])  # a row term cancels in Phi(X)
torch.testing.assert_close(loss_terms(_X + _c.T)[1], loss_terms(_X)[1])  # a column term cancels in Phi(X^T)
_row = check_triplet_lipschitz()
print(format_table([_row]))
assert _row.passed

# %% [markdown]
# ## The inputs
#
# Distribution (a) is `unit_vector_scores` of `01`. Distribution (b) needs a model, captions, word masks and
# boxes; the helpers below stay in this notebook (they are experiment scaffolding, not library code).

# %%
# from the repo root or nbs/
DATA = Path("../shared/data") if Path("../shared/data").exists() else Path("../../shared/data")


def load_captions(limit: int = 5000) -> list[str]:
    "Real COCO captions (all 5 per photo) from the shared data folder; [] when it is absent."
    f = DATA / "coco_sample" / "captions.jsonl"
    if not f.exists():
        return []
    rows = [json.loads(l) for l in f.read_text().splitlines() if l.strip()]
    return [c for r in rows for c in r["captions"]][:limit]


def random_boxes(gh: int, gw: int, M: int, g: torch.Generator) -> torch.Tensor:
    "(M, gh*gw) bool: M boxes with uniform centre, height and width (Sec. 3.2), clipped to the grid, row-major."
    cy, cx = torch.rand(M, generator=g) * gh, torch.rand(M, generator=g) * gw
    h, w = 1 + torch.rand(M, generator=g) * (gh - 1), 1 + torch.rand(M, generator=g) * (gw - 1)
    y0 = (cy - h / 2).floor().clamp(0, gh - 1)
    y1 = torch.maximum((cy + h / 2).ceil().clamp(max=gh), y0 + 1)
    x0 = (cx - w / 2).floor().clamp(0, gw - 1)
    x1 = torch.maximum((cx + w / 2).ceil().clamp(max=gw), x0 + 1)
    ys, xs = torch.arange(gh)[None, :, None], torch.arange(gw)[None, None, :]
    box = (ys >= y0[:, None, None]) & (ys < y1[:, None, None]) & (xs >= x0[:, None, None]) & (xs < x1[:, None, None])
    return box.reshape(M, gh * gw)  # every box has >= 1 patch


def word_tokens(caption: str, tokenizer, max_words: int = 16, context_length: int = 32):
    "Words of a caption, the token ids (L,) SOT + BPE pieces + EOT, and the (W, L) bool token mask of each word."
    words = re.findall(r"[a-z0-9']+", caption.lower())[:max_words] or ["empty"]
    ids, masks = [tokenizer.sot_token_id], []
    for w in words:
        pieces = tokenizer.encode(w)
        masks.append(list(range(len(ids), len(ids) + len(pieces))))
        ids += pieces
    if len(ids) + 1 > context_length:
        raise ValueError(f"{len(words)} words need {len(ids) + 1} tokens > "
                         f"context_length={context_length}: {caption!r}")
    ids.append(tokenizer.eot_token_id)
    tok = torch.zeros(context_length, dtype=torch.long)
    tok[: len(ids)] = torch.tensor(ids)
    leaf = torch.zeros(len(words), context_length, dtype=torch.bool)
    for k, pos in enumerate(masks):
        leaf[k, pos] = True
    return words, tok, leaf


def tiny_clip(seed: int = 0, D: int = 512):
    """A randomly initialised 2+2-layer open_clip CLIP (112 px, patch 16, width 128, 32 tokens, embed D); nothing
    downloaded."""
    import open_clip
    from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg
    torch.manual_seed(seed)
    model = CLIP(embed_dim=D,
                 vision_cfg=CLIPVisionCfg(layers=2, width=128, head_width=32, patch_size=16, image_size=112),
                 text_cfg=CLIPTextCfg(context_length=32, layers=2, width=128, heads=4)).eval()  # 16 words fit in 32
    return model, open_clip.get_tokenizer("ViT-B-32")


@torch.no_grad()
def tiny_clip_scores(model, tokenizer, captions: list[str], M: int, g: torch.Generator):
    """Q (C, C, M, K) float64 for C noise images and C captions: boxes -> regions (Eq. 2), words -> leaves (Eq. 4),
    random trees."""
    C = len(captions)
    items = [word_tokens(c, tokenizer) for c in captions]
    W = max(len(w) for w, _, _ in items)
    K = 2 * W - 1
    tokens = torch.stack([t for _, t, _ in items])                                  # (C, L)
    leaf = torch.zeros(C, W, tokens.shape[1], dtype=torch.bool)                     # (C, W, L)
    inc = torch.zeros(C, K, W, dtype=torch.bool)
    nv = torch.zeros(C, K, dtype=torch.bool)
    for c, (words, _, lm) in enumerate(items):
        leaf[c, : len(words)] = lm
        t = random_tree(len(words), g)                                               # (2W_c-1, W_c)
        inc[c, : t.shape[0], : t.shape[1]] = t
        nv[c, : t.shape[0]] = True
    images = torch.rand(C, 3, 112, 112, generator=g)
    out = model.forward_intermediates(image=images, text=tokens, image_indices=1, text_indices=1,
                                      normalize_intermediates=True, intermediates_only=True, image_output_fmt="NLC")
    patches = out["image_intermediates"][-1] @ model.visual.proj                    # (C, 49, D) projected patches
    toks = out["text_intermediates"][-1] @ model.text_projection                    # (C, L, D) projected tokens
    masks = torch.stack([random_boxes(7, 7, M, g) for _ in range(C)])               # (C, M, 49)
    regions = pool_normalize(patches.double(), masks)                               # (C, M, D)
    leaves = pool_normalize(toks.double(), leaf)                                    # (C, W, D), zero rows for padding
    rv = torch.ones(C, M, dtype=torch.bool)
    return powerset_scores(regions, rv, phrase_embeddings(leaves, inc)), rv, nv


# %%
_g = torch.Generator().manual_seed(0)
_m = random_boxes(7, 7, 10, _g)
assert _m.shape == (10, 49) and _m.any(1).all()
CAPTIONS = load_captions()
if CAPTIONS:
    MODEL, TOKENIZER = tiny_clip()
    _w, _t, _l = word_tokens(CAPTIONS[0], TOKENIZER)
    assert _l.sum(1).min() >= 1 and not (_l.sum(0) > 1).any()  # every word has tokens, no token in two words
    print(CAPTIONS[0], "->", _w, "tokens per word:", _l.sum(1).tolist())
    _Q, _rv, _nv = tiny_clip_scores(MODEL, TOKENIZER, CAPTIONS[:4], 10, _g)
    print("Q", tuple(_Q.shape), f"std of Q over valid nodes: {float(_Q.permute(0, 1, 3, 2)[:, _nv].std()):.3f}")
else:
    print("SKIP distribution (b): ../shared/data/coco_sample is absent (no real captions on this machine)")

# %% [markdown]
# ## The experiment
#
# `fig5` draws `n_batches` random batches of one distribution and returns, per batch, the exact loss terms and
# the approximate ones on the $\tau\times\alpha$ grid, plus the per-pair similarities (Fig. 7). Everything is
# float64; the exact side enumerates $2^{10}$ subsets.

# %%
TAUS, ALPHAS = (0.1, 0.01, 0.001), (0.0, 0.25, 0.5, 0.75, 1.0)


def batches(kind: str, n: int, C: int, seed: int = 0):
    "Yield n batches (Q (C, C, 10, K), region_valid, node_valid) of distribution 'a', 'a-padded' or 'b'."
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        if kind == "a":          # all 10 regions valid, 4-12 words
            yield unit_vector_scores(C, 10, 12, pad=True, generator=g, M_min=10, W_min=4)
        elif kind == "a-padded":  # 5-10 valid regions per image: the only case where debias can matter
            yield unit_vector_scores(C, 10, 12, pad=True, generator=g, M_min=5, W_min=4)
        elif kind == "b":
            idx = torch.randperm(len(CAPTIONS), generator=g)[:C].tolist()
            yield tiny_clip_scores(MODEL, TOKENIZER, [CAPTIONS[k] for k in idx], 10, g)
        else:
            raise ValueError(f"unknown input distribution {kind!r}")


def fig5(kind: str, n_batches: int, C: int, seed: int = 0, gamma: float = 1.0, debias: bool = False) -> dict:
    "Exact and NLA loss terms per batch, and per-pair similarities, on the TAUS x ALPHAS grid."
    T, A = len(TAUS), len(ALPHAS)
    exact, approx = torch.zeros(n_batches, 2), torch.zeros(T, A, n_batches, 2)      # [..., term]
    sims = {"t2r": [], "r2t": [], "t1": [], "t2": [], "astar": []}
    for b, (Q, rv, nv) in enumerate(batches(kind, n_batches, C, seed)):
        q_t2r, q_r2t = t2r_exact(Q, rv, nv), r2t_exact(Q, rv, nv)                    # (C, C) each, by enumeration
        exact[b] = torch.stack(loss_terms(q_t2r + q_r2t, gamma))
        t1 = torch.stack([nla_t1(Q, rv, nv, t) for t in TAUS])                       # (T, C, C)
        # (T, A, C, C)
        t2 = torch.stack([torch.stack([nla_t2(Q, rv, nv, t, a, debias=debias) for a in ALPHAS]) for t in TAUS])
        for i in range(T):
            for j in range(A):
                approx[i, j, b] = torch.stack(loss_terms(t1[i] + t2[i, j], gamma))
        sims["t2r"].append(q_t2r.flatten())
        sims["r2t"].append(q_r2t.flatten())
        sims["t1"].append(t1.flatten(1))
        sims["t2"].append(t2.flatten(2))
        sims["astar"].append(alpha_star(Q, rv, nv, q_r2t).flatten())
    cat = {k: torch.cat(v, dim=-1) for k, v in sims.items()}
    return dict(kind=kind, C=C, n=n_batches, debias=debias, exact=exact, approx=approx, **cat)


def pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    "Pearson correlation of two 1-d samples (nan if either is constant)."
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    return float((x * y).sum() / (x.norm() * y.norm()))


def r_table(res: dict) -> torch.Tensor:
    "(T, A, 2) Pearson r over batches between exact and approximate loss terms."
    return torch.tensor([[[pearson(res["exact"][:, k], res["approx"][i, j, :, k]) for k in range(2)]
                          for j in range(len(ALPHAS))] for i in range(len(TAUS))])


def print_r_table(res: dict):
    r = r_table(res)
    print(f"({res['kind']}{', debias' if res['debias'] else ''}: {res['n']} batches of C={res['C']}, M=10)  "
          "Pearson r, Phi(Qbar) / Phi(Qbar^T)")
    print("tau \\ alpha " + "".join(f"{a:>16.2f}" for a in ALPHAS))
    for i, t in enumerate(TAUS):
        print(f"{t:<12g}" + "".join(f"{r[i, j, 0]:>9.4f}/{r[i, j, 1]:.4f}" for j in range(len(ALPHAS))))
    return r


def plot_fig5(res: dict):
    "Exact vs approximate loss terms for every (tau, alpha), r in each panel (the paper's Fig. 5, top)."
    T, A = len(TAUS), len(ALPHAS)
    r = r_table(res)
    fig, axs = plt.subplots(T, A, figsize=(2.4 * A, 2.3 * T))
    for i in range(T):
        for j in range(A):
            ax = axs[i, j]
            for k, (lab, c) in enumerate(((r"$\Phi(\bar Q)$", "C0"), (r"$\Phi(\bar Q^\top)$", "C1"))):
                ax.plot(res["exact"][:, k], res["approx"][i, j, :, k], ".", ms=2.5, color=c, label=lab)
            lo = min(float(res["exact"].min()), float(res["approx"][i, j].min()))
            hi = max(float(res["exact"].max()), float(res["approx"][i, j].max()))
            ax.plot([lo, hi], [lo, hi], "k:", lw=0.7)
            ax.set_title(rf"$\tau$={TAUS[i]:g} $\alpha$={ALPHAS[j]:g}" + f"\nr={r[i, j, 0]:.3f} / "
                                                                         f"{r[i, j, 1]:.3f}", fontsize=8)
            ax.tick_params(labelsize=6)
    axs[0, 0].legend(fontsize=6, markerscale=3)
    fig.supxlabel("exact loss term")
    fig.supylabel("NLA loss term")
    fig.suptitle(f"Fig. 5 redone, distribution ({res['kind']}), {res['n']} batches of C={res['C']}", fontsize=10)
    plt.tight_layout()
    plt.show()


def plot_fig7(res: dict):
    "Per-pair similarities: NLA-T1 vs T2R and NLA-T2 vs R2T at alpha in {0, 0.75, 1} (the paper's Fig. 7)."
    T = len(TAUS)
    cols = [("T2R", None)] + [("R2T", a) for a in (0, 3, 4)]
    fig, axs = plt.subplots(T, len(cols), figsize=(2.6 * len(cols), 2.4 * T))
    for i in range(T):
        for c, (name, a) in enumerate(cols):
            ax = axs[i, c]
            x = res["t2r"] if a is None else res["r2t"]
            y = res["t1"][i] if a is None else res["t2"][i, a]
            ax.plot(x, y, ".", ms=1.5, alpha=0.4, color="C2" if a is None else "C4")
            lo, hi = float(min(x.min(), y.min())), float(max(x.max(), y.max()))
            ax.plot([lo, hi], [lo, hi], "k:", lw=0.7)
            lab = "NLA-T1" if a is None else f"NLA-T2 a={ALPHAS[a]:g}"
            ax.set_title(rf"$\tau$={TAUS[i]:g}: {lab} vs {name}" + f"\nr={pearson(x, y):.4f}", fontsize=8)
            ax.tick_params(labelsize=6)
    fig.suptitle(f"Fig. 7 redone, distribution ({res['kind']}): per-pair similarities", fontsize=10)
    plt.tight_layout()
    plt.show()


# %% [markdown]
# ### Distribution (a): random unit vectors
#
# At CI size (40 batches of $C=8$); the full-size run (300 batches of $C=16$) is the `slow` cell further down.

# %%
_t0 = time.time()
RES_A = fig5("a", n_batches=40, C=8, seed=0)
R_A = print_r_table(RES_A)
print(f"({time.time() - _t0:.1f} s)")
assert torch.isfinite(R_A).all()

# %% [markdown]
# ### Distribution (b): a random tiny open_clip on noise images and real captions

# %%
if CAPTIONS:
    _t0 = time.time()
    RES_B = fig5("b", n_batches=30, C=8, seed=0)
    R_B = print_r_table(RES_B)
    print(f"({time.time() - _t0:.1f} s)")
    assert torch.isfinite(R_B).all()
else:
    RES_B = None
    print("SKIP distribution (b): no captions")


# %% [markdown]
# ### The paper's claims, checked on what we measured
#
# The cell prints, for each distribution, whether the two claims of Sec. 5.3 hold on our numbers: (1) $r>0.98$
# for $\tau\le0.01$ and every $\alpha$, both loss terms; (2) the best $r$ is at $\tau=0.001$, $\alpha=0.75$.

# %%
def paper_claims(res: dict) -> str:
    r = r_table(res)                                                    # (T, A, 2)
    small = r[1:]                                                       # tau in {0.01, 0.001}
    best = torch.stack(torch.unravel_index(r.mean(-1).argmax(), r.shape[:2])).tolist()
    return (f"({res['kind']}) claim 1, r > 0.98 for tau <= 0.01: "
            f"{'holds' if bool((small > 0.98).all()) else 'does NOT hold'} (min r = {float(small.min()):.4f});  claim "
            f"2, best at tau=0.001, alpha=0.75: {'holds' if best == [2, 3] else 'does NOT hold'} (best mean r = "
            f"{float(r.mean(-1).max()):.4f} at tau={TAUS[best[0]]:g}, alpha={ALPHAS[best[1]]:g}; at tau=0.001, "
            f"alpha=0.75: {float(r[2, 3].mean()):.4f})")


for _res in (RES_A, RES_B):
    if _res is not None:
        print(paper_claims(_res))

# %% [markdown]
# ### Where the best $\alpha$ comes from: $\alpha^\ast$ on these inputs
#
# `02` showed that each pair has its own $\alpha^\ast$ with $\Lambda(\alpha^\ast)=Q^\rightarrow$. Here is its
# distribution on the pairs of the batches above. As $\tau\to0$, NLA-T2 with a fixed $\alpha$ tends to
# $\Lambda(\alpha)$, so the loss correlation is best near the $\alpha$ where the pairs' $\alpha^\ast$ concentrate
# (and where their spread hurts least), not necessarily at the paper's 0.75.

# %%
fig, axs = plt.subplots(1, 2, figsize=(9, 3))
for ax, res in zip(axs, (RES_A, RES_B)):
    if res is None:
        ax.set_title("(b) skipped: no captions")
        continue
    a = res["astar"]
    ax.hist(a.numpy(), bins=40, range=(0, 1))
    ax.axvline(0.75, color="C3", ls="--", label=r"paper $\alpha=0.75$")
    ax.axvline(float(a.mean()), color="k", label=rf"mean $\alpha^\ast$={float(a.mean()):.2f}")
    ax.set(title=f"({res['kind']}) {a.numel()} pairs", xlabel=r"$\alpha^\ast$")
    ax.legend(fontsize=7)
plt.tight_layout()
plt.show()

# %% [markdown]
# ### `debias`
#
# As derived above, `debias=True` adds $\tau\alpha M_i\log2$, a per-image constant: with all $M_i=10$ it cannot
# change either loss term. We check that, and measure it where it can matter, with 5-10 valid regions per
# image (distribution "a-padded").

# %%
_d0, _d1 = fig5("a", 10, 8, seed=1), fig5("a", 10, 8, seed=1, debias=True)
assert torch.allclose(_d0["approx"], _d1["approx"], atol=1e-6), "debias changed a loss term with equal M_i"
print("equal M_i: debias changes the loss terms by at most", float((_d0["approx"] - _d1["approx"]).abs().max()))
_t0 = time.time()
RES_P0, RES_P1 = fig5("a-padded", 30, 8, seed=0), fig5("a-padded", 30, 8, seed=0, debias=True)
_ = print_r_table(RES_P0)
_ = print_r_table(RES_P1)
print(f"({time.time() - _t0:.1f} s)")

# %% [markdown]
# ## Full size (slow)
#
# The same experiment at the size we report: 200 batches of $C=16$ pairs for (a) and (b), 100 batches for the
# padded debias comparison, $M=10$, exact enumeration of $2^{10}$ subsets per pair. The committed outputs of
# these cells are the numbers quoted in the summary; `nbdev_test` skips them (`#| slow`), `make nbs` reruns
# them (about 15 minutes on 2 CPU cores).

# %%
#| slow
_t0 = time.time()
FULL_A = fig5("a", n_batches=200, C=16, seed=10)
_ = print_r_table(FULL_A)
print(paper_claims(FULL_A))
print(f"({time.time() - _t0:.0f} s)")
plot_fig5(FULL_A)
plot_fig7(FULL_A)

# %%
#| slow
if CAPTIONS:
    _t0 = time.time()
    FULL_B = fig5("b", n_batches=200, C=16, seed=10)
    _ = print_r_table(FULL_B)
    print(paper_claims(FULL_B))
    print(f"({time.time() - _t0:.0f} s)")
    plot_fig5(FULL_B)
    plot_fig7(FULL_B)
    _a = FULL_B["astar"]
    print(f"(b) alpha*: mean {float(_a.mean()):.3f}, share of pairs with alpha* = 0: "
          f"{float((_a == 0).double().mean()):.3f}")

# %%
#| slow
_t0 = time.time()
FULL_P0 = fig5("a-padded", n_batches=100, C=16, seed=10)
FULL_P1 = fig5("a-padded", n_batches=100, C=16, seed=10, debias=True)
_ = print_r_table(FULL_P0)
_ = print_r_table(FULL_P1)
print(f"({time.time() - _t0:.0f} s)")


# %% [markdown]
# ## Summary: what we measure, against the paper
#
# Full size, Pearson $r$ over 200 batches of $C=16$, $M=10$, $\gamma=1$, `debias=False`; each cell is
# $r\big(\Phi(\bar Q),\Phi(\bar S)\big)$ / $r\big(\Phi(\bar Q^\top),\Phi(\bar S^\top)\big)$ (copied from the slow-cell outputs above):
#
# **(a) random unit vectors, random trees**
#
# | $\tau$ \ $\alpha$ | 0 | 0.25 | 0.5 | 0.75 | 1 |
# |---|---|---|---|---|---|
# | 0.1 | 0.968 / 0.979 | 0.982 / 0.986 | 0.986 / 0.988 | 0.982 / 0.984 | 0.972 / 0.977 |
# | 0.01 | 0.990 / 0.992 | 0.990 / 0.990 | 0.980 / 0.978 | 0.964 / 0.963 | 0.944 / 0.945 |
# | 0.001 | 0.990 / 0.992 | 0.990 / 0.989 | 0.980 / 0.977 | 0.962 / 0.962 | 0.942 / 0.943 |
#
# **(b) random tiny open_clip, noise images, real COCO captions, random boxes, random trees**
#
# | $\tau$ \ $\alpha$ | 0 | 0.25 | 0.5 | 0.75 | 1 |
# |---|---|---|---|---|---|
# | 0.1 | 0.981 / 0.868 | 0.986 / 0.893 | 0.988 / 0.910 | 0.989 / 0.921 | 0.989 / 0.929 |
# | 0.01 | 1.000 / 0.999 | 1.000 / 0.995 | 0.999 / 0.985 | 0.999 / 0.974 | 0.998 / 0.960 |
# | 0.001 | 1.000 / 1.000 | 1.000 / 0.993 | 0.999 / 0.979 | 0.999 / 0.965 | 0.998 / 0.950 |
#
# Plainly:
#
# * **The NLA losses track the exact losses closely** on both distributions ($r\ge0.94$ everywhere at
#   $\tau\le0.01$), and NLA-T1 is essentially exact at $\tau=10^{-3}$ (Fig. 7 panels: $r=1.0000$), as `01` predicts.
#   The qualitative picture of the paper's Appendix C is reproduced: $\alpha=0$ and $\alpha=1$ bracket R2T from
#   below and above, and $\tau=0.1$ is visibly biased.
# * **The paper's first claim ($r>0.98$ for $\tau\le0.01$ at every $\alpha$) does not hold on our inputs**: it fails
#   at $\alpha\ge0.5$ on (a) (down to 0.942 at $\alpha=1$) and, on (b), for $\Phi(\bar Q^\top)$ at $\alpha\ge0.75$
#   ($\tau=0.01$) and $\alpha\ge0.5$ ($\tau=0.001$), down to 0.950.
# * **Its second claim (best $r=0.999$ at $\tau=0.001$, $\alpha=0.75$) is not reproduced**: our best $\alpha$ is 0 or
#   0.25, and at $\tau=0.001$, $\alpha=0.75$ we get 0.962 / 0.962 on (a) and 0.999 / 0.965 on (b).
# * **Why, in the theory's terms**: as $\tau\to0$ NLA-T2 tends to $\Lambda(\alpha)$ and is exact for a pair only at
#   its own $\alpha^\ast$ (`02`). On our random inputs $\alpha^\ast$ sits near 0.2 for (a) and at 0 for most pairs of
#   (b) (mean 0.004: one node is the best node for nearly every region subset, so Jensen's lower bound is
#   tight). The correlation peaks where the pairs' $\alpha^\ast$ are, not at 0.75. The paper's result would follow
#   if its synthetic inputs had $\alpha^\ast$ near 0.75; it does not say what they were, and random inputs of
#   either of our kinds do not have that property. Trained embeddings may; that is a measurement for the
#   trained models, not something random inputs can settle.
# * **(b) is sensitive to the random model's details**: an earlier run of this notebook with a 77-token text
#   context (a different random initialisation) gave 0.996 / 0.9996 at $\tau=0.001$, $\alpha=0.75$ at CI size. The
#   committed numbers are for the 32-token model defined above; the ordering over $\alpha$ was the same.
# * **`debias=True`** is a no-op when every image has the same number of regions (checked above). With 5-10
#   valid regions per image it leaves $\Phi(\bar Q)$ unchanged (a per-image term cancels there, as derived) and
#   changes $r$ for $\Phi(\bar Q^\top)$ by at most 0.003 at $\tau\le0.01$, but it *lowers* it at $\tau=0.1$
#   (e.g. 0.909 to 0.721 at $\alpha=0.75$): NLA-T1's upward bias (up to $\tau M_i\log2$) and NLA-T2's $-\tau\alpha M_i\log2$
#   partly cancel in $\bar S$, and debiasing removes the cancellation. We keep `debias=False` as the default.

# %% [markdown]
# ## The command-line check
#
# `python -m powerclip.theory` (`make theory`, or the console script `powerclip-theory`) runs the float64 checks
# of all three notebooks at a reduced number of cases and prints one table; it exits with status 1 if any
# check fails. (The Fig. 5 correlations are measurements, not theorems, so they are not in the table.) The checks:
# Lemma A.1, the softplus and cosh powerset identities, Theorems 1-2, the $\alpha^\ast$ solve and the loss's Lipschitz
# bound, each against exact enumeration of up to $2^{12}$ subsets; the table gives per check the cases, the largest
# error, the bound and PASS or FAIL. It took 8 s on this repository's 2-core CPU, beside other jobs.

# %%
#| export theory
def run_checks(cases: int = 60, seed: int = 0) -> list[CheckRow]:
    "Every numerical check of notebooks 01-03 (float64, exact enumeration up to 2^12 subsets), as table rows."
    return [
        check_lse_bound(cases, seed),
        check_softplus_expansion(seed=seed),
        *check_theorem1(cases, seed=seed + 1),
        check_cosh_identity(seed=seed),
        *check_theorem2(cases, seed=seed + 1),
        check_triplet_lipschitz(max(1, cases // 2), seed=seed + 2),
    ]


def main(argv: list[str] | None = None) -> int:
    "Console entry point: run the theory checks, print the table, return 1 if any check fails."
    import argparse
    p = argparse.ArgumentParser(prog="powerclip-theory", description="Numerical checks of the PowerCLIP theory "
                                "(Lemma A.1, Thm. 1, Cor. 1, Lemmas B.1-B.2, Thm. 2, alpha*) "
                                "against exact enumeration.")
    p.add_argument("--cases", type=int, default=60, help="random padded cases per check (default 60)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    args = p.parse_args(argv)
    t0 = time.time()
    rows = run_checks(args.cases, args.seed)
    print(format_table(rows))
    failed = [r.check for r in rows if not r.passed]
    print(f"\n{len(rows) - len(failed)}/{len(rows)} checks passed in {time.time() - t0:.1f} s "
          f"(float64; errors relative to max(1, |value|); bound rows report the worst violation)")
    return 1 if failed else 0


# %%
assert main(["--cases", "8"]) == 0
_bad = CheckRow("a failing row", 1, 1.0, 0.0, False)
assert "FAIL" in format_table([_bad])


# %%
#| export theory
def _in_ipython() -> bool:
    "True inside a Jupyter kernel or nbdev_test's shell, where __name__ is also '__main__'."
    ip = sys.modules.get("IPython")  # never imports IPython itself
    return ip is not None and ip.get_ipython() is not None


if __name__ == "__main__" and not _in_ipython():  # `python -m powerclip.theory`
    sys.exit(main())
