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
#| default_exp powerset

# %%
#| export
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# %%
#| hide
import itertools

from torch.autograd import gradcheck
from torch.testing import assert_close


# %% [markdown]
# # Powerset alignment as tensor functions
#
# > Region and phrase embeddings, the score tensor Q, exact R2T/T2R by enumeration, NLA-T1, NLA-T2, the triplet loss.
#
# Q holds the region-node scores; NLA-T1 and NLA-T2 are the paper's non-linear aggregators.

# %% [markdown]
# This notebook turns Sections 3-4 of the paper (and Appendices A-B of its supplement) into small pure tensor
# functions. The theory notebooks (`01`-`03`) derive why they agree; here every fast function is checked
# against a slow oracle that enumerates the powerset, in float64.
#
# **Notation.** A batch holds $C$ image-text pairs. Image $i$ has $M$ region masks over its $N$ patches
# (some of them padding, marked by `region_valid`); text $j$ has $W$ leaves (words) and $K$ tree nodes (some
# padding, marked by `node_valid`). $D$ is the shared embedding width.
#
# | symbol | code | shape |
# |---|---|---|
# | $\phi(I_i\mid R_m)$ (Eq. 2) | `regions` | `(C, M, D)` |
# | $\psi(T_j\mid P_{m'})$ (Eq. 4) | `leaves` | `(C, W, D)` |
# | $p_B$ (Eq. 3) | `phrases` | `(C, K, D)` |
# | $Q_{i,j,m,B}$ (Eq. 18 of the supplement) | `Q` | `(Ci, Cj, M, K)` |
# | $Q^{\leftarrow}_{i,j}$ (T2R, Eq. 7), $Q^{\rightarrow}_{i,j}$ (R2T, Eq. 6 / 42) | `t2r_exact`, `r2t_exact` | `(Ci, Cj)` |
# | NLA-T1 (Def. 1), NLA-T2 (Def. 2) | `nla_t1`, `nla_t2` | `(Ci, Cj)` |
# | $\Phi_\gamma$ (Eq. 9) | `triplet` | scalar |

# %% [markdown]
# ## Region and leaf embeddings (Eqs. 2 and 4)
#
# A region embedding is the L2-normalised sum of the patch embeddings under its mask,
# $\phi(I\mid R_m) = r_m/\lVert r_m\rVert$ with $r_m = \sum_n R_{mn} v_n$; a leaf embedding is the same
# operation on token embeddings under a token mask (Eq. 4). One function serves both. An empty mask (a
# padding row) gives the zero vector rather than NaN, so padding contributes exactly zero to every score below.

# %%
#| export
def pool_normalize(
    x: torch.Tensor,      # (C, N, D) patch (or token) embeddings
    masks: torch.Tensor,  # (C, M, N) region (or leaf) masks, bool or float weights
    eps: float = 1e-6,    # norms below eps are treated as empty masks
) -> torch.Tensor:        # (C, M, D) L2-normalised masked sums; all-zero rows for empty masks
    "Eqs. 2 and 4: masked sum over the N axis, then L2-normalise each of the M pooled vectors."
    pooled = torch.einsum("cmn,cnd->cmd", masks.to(x.dtype), x)  # (C, M, D)
    return F.normalize(pooled, dim=-1, eps=eps)


# %%
_x = torch.randn(2, 5, 3, dtype=torch.float64)
_m = torch.zeros(2, 2, 5, dtype=torch.bool)
_m[0, 0, [1, 3]] = True
_m[1, 0, 4] = True  # row 1 of each: empty
_p = pool_normalize(_x, _m)
assert_close(_p[0, 0], F.normalize(_x[0, 1] + _x[0, 3], dim=0))
assert_close(_p[1, 0], F.normalize(_x[1, 4], dim=0))
assert (_p[:, 1] == 0).all() and torch.isfinite(_p).all()


# %% [markdown]
# ## Phrase embeddings and region-node scores (Eqs. 3, 5, 18-19)
#
# A tree node $B$ is a set of leaves; its phrase embedding $p_B=\sum_{P_{m'}\in B}\psi(T\mid P_{m'})$ is a sum
# of unit vectors, **not** normalised again (Eq. 3), so a node with more words has a larger score range.
# With the node-by-leaf incidence matrix $\mathbb{1}[P_{m'}\in B]$ this is one batched matrix product.
#
# By bilinearity, the score of a *subset* $A$ of regions with node $B$ is a sum of per-region scores,
# $$Q_{i,j,A,B} = \langle r^{(i)}_A, p^{(j)}_B\rangle = \sum_{R_m\in A} Q_{i,j,m,B},\qquad
#   Q_{i,j,m,B} = \langle \phi(I_i\mid R_m), p^{(j)}_B\rangle = \sum_{P_{m'}\in B} S^{(0)}_{i,j,m,m'} .$$
# So everything below needs only the $(C_i, C_j, M, K)$ tensor `Q`; the powerset never has to be built
# except by the exact oracle. Scores of invalid regions are set to zero here, once, so that no later
# function needs to know about region padding beyond counting $M_i$.

# %%
#| export
def phrase_embeddings(
    leaves: torch.Tensor,     # (C, W, D) L2-normalised leaf (word) embeddings psi(T | P_m')
    incidence: torch.Tensor,  # (C, K, W) node-by-leaf incidence, bool
) -> torch.Tensor:            # (C, K, D) phrase embeddings p_B (unnormalised sums, Eq. 3)
    "Eq. 3: p_B = sum of the leaf embeddings under node B."
    return torch.einsum("ckw,cwd->ckd", incidence.to(leaves.dtype), leaves)


def powerset_scores(
    regions: torch.Tensor,       # (Ci, M, D) region embeddings phi(I_i | R_m)
    region_valid: torch.Tensor,  # (Ci, M) bool, False for padding regions
    phrases: torch.Tensor,       # (Cj, K, D) phrase embeddings p_B
) -> torch.Tensor:               # (Ci, Cj, M, K) Q[i, j, m, B] = <phi_m^(i), p_B^(j)>, 0 for invalid m
    "Per-region, per-node scores Q (supplement Eq. 18); subset scores are sums of these over m."
    Q = torch.einsum("imd,jkd->ijmk", regions, phrases)  # (Ci, Cj, M, K)
    return Q * region_valid[:, None, :, None].to(Q.dtype)


# %%
_C, _M, _W, _K, _D = 3, 4, 5, 3, 8
_regions = F.normalize(torch.randn(_C, _M, _D, dtype=torch.float64), dim=-1)
_leaves = F.normalize(torch.randn(_C, _W, _D, dtype=torch.float64), dim=-1)
_inc = torch.rand(_C, _K, _W) < 0.5
_ph = phrase_embeddings(_leaves, _inc)
_rv = torch.ones(_C, _M, dtype=torch.bool)
_rv[1, 3] = False
_Q = powerset_scores(_regions, _rv, _ph)
assert _Q.shape == (_C, _C, _M, _K)
# Q[i, j, m, B] equals the sum over the node's leaves of the leaf-region inner products S^(0) (Eq. 18)
_S0 = torch.einsum("imd,jwd->ijmw", _regions, _leaves)
assert_close(_Q[0], torch.einsum("jmw,jkw->jmk", _S0[0], _inc.double()))
assert (_Q[1, :, 3] == 0).all()


# %% [markdown]
# ## The exact similarities by enumeration (the oracle)
#
# The powerset of $M$ regions is the set of rows of the $2^M\times M$ 0/1 matrix whose row $a$ is the binary
# expansion of $a$; row 0 is the **empty subset**. We include it: the supplement's proofs need it (the
# product $\prod_m(1+e^{x_m})$ in Eq. 37 expands into a sum over *all* subsets, the empty one giving the
# term $1$, and the Jensen step of Eq. 78 uses the uniform distribution over all $2^M$ subsets), and
# Corollary 1 ("ReLU gives T2R exactly") holds only with it, since
# $\max_{A\subseteq\mathcal M}\sum_{m\in A}Q_m=\sum_m\max(Q_m,0)$ picks the empty set when every $Q_m<0$.
#
# $$Q^{\leftarrow}_{i,j}=\frac{1}{K_j}\sum_{B\in\mathcal T_j}\max_{A\subseteq\mathcal M_i}Q_{i,j,A,B}
#   \quad\text{(T2R, Eq. 7)},\qquad
#   Q^{\rightarrow}_{i,j}=\frac{1}{2^{M}}\sum_{A\subseteq\mathcal M_i}\max_{B\in\mathcal T_j}Q_{i,j,A,B}
#   \quad\text{(R2T, supplement Eq. 42)}.$$
#
# The main text prints the R2T normaliser as $1/(2M)$; that is a lost superscript: the supplement's
# $1/2^M$ makes $Q^{\rightarrow}$ an average over the $2^M$ subsets, which the sandwich of Theorem 2 needs.
#
# **Padding.** Image $i$ may have $M_i<M$ valid regions. Its invalid regions have $Q=0$, so every subset
# that contains some of them scores the same as the valid subset without them. The max over subsets is then
# unchanged, and each valid subset appears exactly $2^{M-M_i}$ times, so the *mean* over all $2^M$ rows equals
# the mean over the $2^{M_i}$ valid subsets. The oracle therefore needs no per-sample loop.
# Invalid *nodes* are excluded from the max over $B$ and from the average over $B$.
#
# Cost: $O(C_iC_j2^MK)$ time and memory, which is why this is the oracle and not the training path.

# %%
#| export
def subset_matrix(M: int, dtype=torch.float32, device=None) -> torch.Tensor:
    "(2^M, M) 0/1 matrix: row a is the subset {m : bit m of a is 1}; row 0 is the empty subset."
    a = torch.arange(2**M, device=device)[:, None]  # (2^M, 1)
    return ((a >> torch.arange(M, device=device)) & 1).to(dtype)  # (2^M, M)


def subset_scores(Q: torch.Tensor) -> torch.Tensor:
    "(Ci, Cj, M, K) -> (Ci, Cj, 2^M, K): Q[i, j, A, B] = sum_{m in A} Q[i, j, m, B] for every subset A."
    return torch.einsum("am,ijmk->ijak", subset_matrix(Q.shape[2], Q.dtype, Q.device), Q)


def _check_nodes(node_valid: torch.Tensor):
    if not bool(node_valid.any(-1).all()):
        raise ValueError("every text needs at least one valid tree node (the root); got a text with none")


def t2r_exact(
    Q: torch.Tensor,             # (Ci, Cj, M, K) from powerset_scores
    region_valid: torch.Tensor,  # (Ci, M) bool (its effect is already in Q; kept for a uniform signature)
    node_valid: torch.Tensor,    # (Cj, K) bool
) -> torch.Tensor:               # (Ci, Cj)
    "T2R by enumeration (Eq. 7): mean over valid nodes B of the max over all 2^M region subsets A."
    _check_nodes(node_valid)
    best = subset_scores(Q).amax(2)  # (Ci, Cj, K) best subset per node
    w = node_valid.to(Q.dtype)[None]  # (1, Cj, K)
    return (best * w).sum(-1) / w.sum(-1)


def r2t_exact(
    Q: torch.Tensor,             # (Ci, Cj, M, K) from powerset_scores
    region_valid: torch.Tensor,  # (Ci, M) bool (its effect is already in Q; see the padding argument above)
    node_valid: torch.Tensor,    # (Cj, K) bool
) -> torch.Tensor:               # (Ci, Cj)
    "R2T by enumeration (supplement Eq. 42): mean over all 2^M subsets A of the max over valid nodes B."
    _check_nodes(node_valid)
    QA = subset_scores(Q).masked_fill(~node_valid[None, :, None, :], float("-inf"))  # (Ci, Cj, 2^M, K)
    return QA.amax(-1).mean(-1)


# %% [markdown]
# The oracle itself is checked against the definitions written as plain Python loops over subsets
# (`itertools.combinations`), with padding on both sides:

# %%
def _naive(Qij, M_valid, nodes):
    "Eqs. 6-7 for one pair, straight from the definitions: Qij (M, K) float64, valid regions 0..M_valid-1."
    subsets = [s for r in range(M_valid + 1) for s in itertools.combinations(range(M_valid), r)]
    score = lambda A, B: sum(float(Qij[m, B]) for m in A)
    t2r = sum(max(score(A, B) for A in subsets) for B in nodes) / len(nodes)
    r2t = sum(max(score(A, B) for B in nodes) for A in subsets) / len(subsets)
    return t2r, r2t

_g = torch.Generator().manual_seed(0)
_C, _M, _K = 3, 5, 4
_Q = torch.randn(_C, _C, _M, _K, generator=_g, dtype=torch.float64) * 3
_rv = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
_nv = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)
_Q = _Q * _rv[:, None, :, None]  # as powerset_scores leaves it
_t2r, _r2t = t2r_exact(_Q, _rv, _nv), r2t_exact(_Q, _rv, _nv)
for i in range(_C):
    for j in range(_C):
        Mi = int(_rv[i].sum())
        nodes = _nv[j].nonzero().flatten().tolist()
        t, r = _naive(_Q[i, j], Mi, nodes)
        assert abs(t - float(_t2r[i, j])) < 1e-12 and abs(r - float(_r2t[i, j])) < 1e-12, (i, j)
print("exact oracle == loop definitions on", _C * _C, "padded pairs")


# %% [markdown]
# ## NLA-T1: T2R in O(M) (Definition 1, Theorem 1)
#
# $\sigma_1(x)=\tau\,\mathrm{Act}(x/\tau)$, $\sigma_2=\sigma_3=\mathrm{Id}$, $\alpha=0$:
# $$\mathrm{NLA\text{-}T1}_{i,j}=\frac1{K_j}\sum_{B}\sum_{m=1}^{M_i}\tau\,\mathrm{Act}\!\Big(\frac{Q_{i,j,m,B}}{\tau}\Big).$$
# With $\mathrm{Act}=\mathrm{softplus}$ the inner sum is $\tau\log\prod_m(1+e^{Q_m/\tau})=\tau\log\sum_{A}e^{Q_{A}/\tau}$
# (supplement Eqs. 33-39), a log-sum-exp over the powerset, hence within $\tau M_i\log 2$ of the exact max
# (Lemma A.1), and in fact never below it. With ReLU it *is* the exact max (Corollary 1). GELU and Swish are
# the paper's Table 8 alternatives; they carry no such guarantee.
#
# **Padding.** $\tau\,\mathrm{softplus}(0)=\tau\log 2\neq 0$, so invalid regions must be masked *after* the
# activation, not just by their zero score; invalid nodes are left out of the mean.
#
# **Stability.** Softplus is evaluated as $\mathrm{softplus}(z)=\max(z,0)+\log(1+e^{-|z|})$ (`softplus_exact`),
# which never overflows, so scores of size 20+ at $\tau=10^{-3}$ ($z=2\cdot10^4$) keep their value and gradient.
# Two details of floating point decide the form (a small autograd Function, so that backward keeps only its
# input, as `F.softplus` does). `F.softplus` returns $z$ itself above $z=20$, dropping up to
# $e^{-20}\approx2\cdot10^{-9}$; we keep the exact function (so the theory notebooks need no allowance, and the
# fast path of `10a_powerset_fast` matches this one to rounding). And at $\tau=10^{-3}$ most $|z|$ are in the
# hundreds, where float32 $e^{-|z|}$ is a subnormal number and `exp` runs about ten times slower on x86; the
# exponent is therefore floored at $-60$, whose $e^{-60}\approx9\cdot10^{-27}$ is below the rounding of every
# result here. All aggregation runs in at least float32, also under bf16 autocast.

# %%
#| export
def _agg_dtype(t: torch.Tensor) -> torch.dtype:
    "Aggregate in float32 at least (float64 stays float64): bf16/fp16 scores divided by tau=1e-3 would be noise."
    return torch.promote_types(t.dtype, torch.float32)


class _SoftplusExact(torch.autograd.Function):
    # an autograd Function so that backward keeps only x (as F.softplus does), not the five intermediates
    @staticmethod
    def forward(ctx, x, beta):
        z = x * beta
        ctx.save_for_backward(x)
        ctx.beta = beta
        return (F.relu(z) + torch.log1p(torch.exp(-z.abs().clamp(max=60.0)))) / beta

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * torch.sigmoid(x * ctx.beta), None


def softplus_exact(x: torch.Tensor, beta: float = 1.0) -> torch.Tensor:
    "log(1 + e^(beta x)) / beta for every finite x, as (max(z, 0) + log1p(e^-|z|)) / beta, z = beta x; no threshold."
    return _SoftplusExact.apply(x, beta)


NLA_T1_ACTS = {
    # tau * Act(x / tau), written so that no intermediate overflows for |x / tau| up to ~1e38.
    "softplus": lambda x, tau: softplus_exact(x, 1.0 / tau),
    "relu": lambda x, tau: F.relu(x),
    "gelu": lambda x, tau: tau * F.gelu(x / tau),
    "swish": lambda x, tau: tau * F.silu(x / tau),
}


def nla_t1(
    Q: torch.Tensor,             # (Ci, Cj, M, K) from powerset_scores
    region_valid: torch.Tensor,  # (Ci, M) bool
    node_valid: torch.Tensor,    # (Cj, K) bool
    tau: float = 1e-3,           # temperature; |NLA-T1 - T2R| <= tau * M_i * log 2 for softplus
    act: str = "softplus",       # one of NLA_T1_ACTS (paper Table 8)
) -> torch.Tensor:               # (Ci, Cj) approximation of the T2R similarity
    "NLA-T1 (Def. 1): mean over nodes of sum over regions of tau*Act(Q/tau); O(M) per (i, j, B)."
    with torch.autocast(Q.device.type, enabled=False):
        dt = _agg_dtype(Q)
        S1 = NLA_T1_ACTS[act](Q.to(dt), tau)                 # (Ci, Cj, M, K) layer 1
        S2 = (S1 * region_valid[:, None, :, None]).sum(2)     # (Ci, Cj, K)    layer 2: sum over regions
        w = node_valid.to(dt)[None]                           # (1, Cj, K)
        return (S2 * w).sum(-1) / w.sum(-1).clamp_min(1)      # layer 3: mean over valid nodes (alpha = 0)


# %% [markdown]
# Check Theorem 1 and Corollary 1 against the oracle, in float64, on random padded cases with scores up
# to size 10 (the bound is one-sided: log-sum-exp is never below the max):

# %%
_g = torch.Generator().manual_seed(1)
for trial in range(20):
    C, M, K = 3, int(torch.randint(1, 9, (1,), generator=_g)), int(torch.randint(1, 6, (1,), generator=_g))
    Q = torch.randn(C, C, M, K, generator=_g, dtype=torch.float64) * 5
    rv = torch.rand(C, M, generator=_g) < 0.8
    nv = torch.rand(C, K, generator=_g) < 0.7
    nv[:, 0] = True
    Q = Q * rv[:, None, :, None]
    exact = t2r_exact(Q, rv, nv)
    assert_close(nla_t1(Q, rv, nv, act="relu"), exact, rtol=0, atol=1e-12)  # Corollary 1
    for tau in (1.0, 0.1, 1e-3):
        gap = nla_t1(Q, rv, nv, tau) - exact                                  # (C, C)
        bound = tau * rv.sum(1).double()[:, None] * math.log(2)               # tau * M_i * log 2
        assert (gap >= -1e-12).all() and (gap <= bound + 1e-12).all(), (trial, tau)
print("NLA-T1: ReLU exact, softplus inside [T2R, T2R + tau M log 2] on all cases")
# softplus_exact is F.softplus without its threshold: equal below z = 20, and above it closer to log(1 + e^z)
_z = torch.linspace(-800, 800, 16001, dtype=torch.float64)
assert_close(softplus_exact(_z)[_z <= 20], F.softplus(_z)[_z <= 20], rtol=1e-15, atol=1e-26)
_hi = (_z > 20) & (_z < 30)  # where F.softplus returns z itself
assert_close(softplus_exact(_z)[_hi] - _z[_hi], torch.exp(-_z[_hi]), rtol=0.05, atol=0)
assert torch.isfinite(softplus_exact(_z.float())).all()
_zz = (_z[::50] / 300).requires_grad_()
assert gradcheck(lambda x: softplus_exact(x, 30.0), (_zz,))

# %% [markdown]
# ## NLA-T2: R2T in O(M) (Definition 2, Theorem 2)
#
# $\sigma_1(x)=\zeta_\alpha(x/2\tau)$ with $\zeta_\alpha(x)=x+\alpha\int\mathrm{Act}$, $\sigma_2=\exp$,
# $\sigma_3=\tau\log$, and the $1/K_j^{1-\alpha}$ factor of Eq. 13:
# $$\mathrm{NLA\text{-}T2}_{i,j}=\tau\log\Big(\frac{1}{K_j^{1-\alpha}}\sum_B\exp\sum_{m}\zeta_\alpha\big(\tfrac{Q_{i,j,m,B}}{2\tau}\big)\Big)
#  =\tau\,\mathrm{LSE}_B\Big(\sum_m\zeta_\alpha\big(\tfrac{Q_{m,B}}{2\tau}\big)\Big)-\tau(1-\alpha)\log K_j .$$
# We evaluate it exactly in this log-sum-exp form: $\sigma_2=\exp$ followed by $\sigma_3=\log$ would overflow
# in float32 as soon as $\sum_m Q_m/2\tau>88$, i.e. for scores above $0.18$ at $\tau=10^{-3}$.
# With $\mathrm{Act}=\tanh$, $\int\tanh=\log\cosh$ and the cosh powerset identity (Lemma B.1) turn this into
# $\bar\Lambda(\tau,\alpha)-\tau Z^\alpha_j$, with $Z^\alpha_j=\alpha M_i\log2+(1-\alpha)\log K_j$ (supplement
# Eqs. 71-75), sandwiched as $\Lambda(\alpha)-\tau Z^\alpha\le\mathrm{NLA\text{-}T2}\le\Lambda(\alpha)+\tau\alpha\log K_j$ (Eq. 76).
#
# The antiderivatives, each with $\zeta(0)=0$ as Definition 2 requires, in overflow-free forms:
#
# | Act | $\int\mathrm{Act}$ | stable form |
# |---|---|---|
# | tanh | $\log\cosh x$ | $\lvert x\rvert+\mathrm{softplus}(-2\lvert x\rvert)-\log 2$ |
# | sigmoid | $\log(1+e^x)-\log 2$ | $\mathrm{softplus}(x)-\log 2$ |
# | softsign | $\lvert x\rvert-\log(1+\lvert x\rvert)$ | as is (`log1p`) |
#
# Padding: $\zeta_\alpha(0)=0$, so a zero score of an invalid region adds nothing; invalid nodes get
# $-\infty$ inside the log-sum-exp, and $K_j$ counts valid nodes only.
#
# **The $-\tau Z$ bias (a choice).** The paper's NLA-T2 output is $\bar\Lambda-\tau Z^\alpha$, biased below
# $\Lambda(\alpha)$ by up to $\tau Z^\alpha$. We keep the paper's definition by default (`debias=False`) and
# offer `debias=True`, which adds back $\tau\alpha M_i\log 2$ (so that the output is
# $\bar\Lambda-\tau(1-\alpha)\log K_j\in[\Lambda(\alpha)-\tau(1-\alpha)\log K_j,\;\Lambda(\alpha)+\tau\alpha\log K_j]$).
# At $\tau=10^{-3}$ the whole correction is below $0.01$, against score differences of order 1 in the triplet
# loss, so the choice matters only at large $\tau$; `14_approximation` measures it.

# %%
#| export
_LOG2 = math.log(2.0)

NLA_T2_INTEGRALS = {
    # integral of Act with value 0 at 0, overflow-free for any finite x
    "tanh": lambda x: x.abs() + softplus_exact(-2.0 * x.abs()) - _LOG2,  # log cosh x
    "sigmoid": lambda x: softplus_exact(x) - _LOG2,                      # log(1 + e^x) - log 2
    "softsign": lambda x: x.abs() - torch.log1p(x.abs()),            # |x| - log(1 + |x|)
}


def nla_t2(
    Q: torch.Tensor,             # (Ci, Cj, M, K) from powerset_scores
    region_valid: torch.Tensor,  # (Ci, M) bool
    node_valid: torch.Tensor,    # (Cj, K) bool
    tau: float = 1e-3,           # temperature
    alpha: float = 0.75,         # 0: lower bound Lambda(0), 1: upper bound Lambda(1) of R2T (Thm. 2)
    act: str = "tanh",           # one of NLA_T2_INTEGRALS (paper Table 8)
    debias: bool = False,        # add back tau*alpha*M_i*log 2 (see the choice above)
) -> torch.Tensor:               # (Ci, Cj) approximation of the R2T similarity
    "NLA-T2 (Def. 2) in log-sum-exp form: tau*LSE_B(sum_m zeta_alpha(Q/2tau)) - tau(1-alpha) log K_j."
    _check_nodes(node_valid)
    with torch.autocast(Q.device.type, enabled=False):
        dt = _agg_dtype(Q)
        x = Q.to(dt) / (2.0 * tau)                                     # (Ci, Cj, M, K)
        S1 = x + alpha * NLA_T2_INTEGRALS[act](x)                      # layer 1: zeta_alpha, zero at 0
        s = S1.sum(2).masked_fill(~node_valid[None], float("-inf"))    # (Ci, Cj, K) log of layer 2
        K = node_valid.sum(-1).to(dt)                                   # (Cj,)
        out = tau * (torch.logsumexp(s, dim=-1) - (1.0 - alpha) * torch.log(K))  # layer 3
        if debias:
            out = out + tau * alpha * _LOG2 * region_valid.sum(-1).to(dt)[:, None]
        return out


# %% [markdown]
# Check against the oracle: Lemma B.1 turns the NLA-T2 output into $\bar\Lambda-\tau Z$; the sandwich of
# Eq. 76 and the Jensen bracket $\Lambda(0)\le Q^{\rightarrow}\le\Lambda(1)$ (Eq. 78) must hold on every case.
# $\Lambda(\alpha)=\max_B\big[\tfrac{1-\alpha}2\bar Q_B+\alpha\max_A Q_{A,B}\big]$ is computed from the enumeration.

# %%
def _Lambda(Q, nv, alpha):
    "Eq. 47 by enumeration: (Ci, Cj)."
    QA = subset_scores(Q)                                    # (Ci, Cj, 2^M, K)
    gamma = (1 - alpha) / 2 * Q.sum(2) + alpha * QA.amax(2)  # (Ci, Cj, K)
    return gamma.masked_fill(~nv[None], float("-inf")).amax(-1)

_g = torch.Generator().manual_seed(2)
for trial in range(20):
    C, M, K = 3, int(torch.randint(1, 9, (1,), generator=_g)), int(torch.randint(1, 6, (1,), generator=_g))
    Q = torch.randn(C, C, M, K, generator=_g, dtype=torch.float64) * 5
    rv = torch.rand(C, M, generator=_g) < 0.8
    nv = torch.rand(C, K, generator=_g) < 0.7
    nv[:, 0] = True
    Q = Q * rv[:, None, :, None]
    r2t = r2t_exact(Q, rv, nv)
    assert (_Lambda(Q, nv, 0.0) <= r2t + 1e-12).all() and (r2t <= _Lambda(Q, nv, 1.0) + 1e-12).all()  # Eq. 78
    Kj = nv.sum(1).double()[None, :]
    Mi = rv.sum(1).double()[:, None]
    for tau in (1.0, 0.1, 1e-3):
        for alpha in (0.0, 0.25, 0.5, 0.75, 1.0):
            s3, lam = nla_t2(Q, rv, nv, tau, alpha), _Lambda(Q, nv, alpha)
            Z = alpha * Mi * math.log(2) + (1 - alpha) * torch.log(Kj)
            # Eq. 76
            assert (lam - tau * Z - 1e-9 <= s3).all() and (s3 <= lam + tau * alpha * torch.log(Kj) + 1e-9).all()
            assert_close(nla_t2(Q, rv, nv, tau, alpha, debias=True), s3 + tau * alpha * Mi * math.log(2))
print("NLA-T2: inside the Eq. 76 sandwich and R2T inside [Lambda(0), Lambda(1)] on all cases")

# %% [markdown]
# Lemma B.1 directly, in the form NLA-T2 uses it: for $\alpha=1$ and large $\tau$ (no saturation), the
# NLA-T2 log-partition equals the log of the powerset sum $E_B=\sum_A e^{Q_{A,B}/\tau}$ scaled by $2^{-M}$:

# %%
_Q = torch.randn(2, 2, 6, 3, generator=_g, dtype=torch.float64)
_rv, _nv = torch.ones(2, 6, dtype=torch.bool), torch.ones(2, 3, dtype=torch.bool)
_tau = 0.7
_lhs = nla_t2(_Q, _rv, _nv, _tau, alpha=1.0)
_E = torch.logsumexp(subset_scores(_Q) / _tau, dim=2)  # (2, 2, K): log E_B
_rhs = _tau * (torch.logsumexp(_E, -1) - 6 * math.log(2))
assert_close(_lhs, _rhs, rtol=1e-13, atol=1e-13)


# %% [markdown]
# ## Without region sets: the Table 6 ablation
#
# Table 6's row "w/o region sets" replaces region *sets* by *individual* regions: the families of subsets
# in Eqs. 6-7 shrink to the $M_i$ singletons $\{R_m\}$, so
# $$Q^{\leftarrow,1}_{i,j}=\frac1{K_j}\sum_{B\in\mathcal T_j}\max_{m\le M_i}Q_{i,j,m,B},\qquad
#   Q^{\rightarrow,1}_{i,j}=\frac1{M_i}\sum_{m\le M_i}\max_{B\in\mathcal T_j}Q_{i,j,m,B}.$$
# We compute these **exactly, with a hard max**: the NLAs exist only because the max (and the mean) over
# $2^M$ subsets cannot be enumerated; over $M_i$ singletons the max costs $O(M)$, the same as an NLA, so an
# approximation would buy nothing and would mix a second change ($\tau$-smoothing) into the ablation. The
# switch therefore ignores `tau`, `alpha`, the activations and `exact`. The empty set is not a singleton, so
# the T2R max may be negative (unlike $\max_A Q_{A,B}\ge0$ with the empty set). An image with no valid region
# has no candidate at all; it scores $0$, the value both powerset forms give it (its only subset is the
# empty one). The gradient is torch's subgradient of `amax`: it flows to the maximising region (node), shared
# evenly between exact ties.

# %%
#| export
def t2r_singletons(
    Q: torch.Tensor,             # (Ci, Cj, M, K) from powerset_scores
    region_valid: torch.Tensor,  # (Ci, M) bool
    node_valid: torch.Tensor,    # (Cj, K) bool
) -> torch.Tensor:               # (Ci, Cj)
    "T2R w/o region sets: mean over valid nodes B of the max over valid single regions m (0 with no region)."
    _check_nodes(node_valid)
    best = Q.masked_fill(~region_valid[:, None, :, None], float("-inf")).amax(2)  # (Ci, Cj, K)
    best = best.masked_fill(~region_valid.any(1)[:, None, None], 0.0)            # no region: 0, not -inf
    w = node_valid.to(Q.dtype)[None]                                              # (1, Cj, K)
    return (best * w).sum(-1) / w.sum(-1)


def r2t_singletons(
    Q: torch.Tensor,             # (Ci, Cj, M, K) from powerset_scores
    region_valid: torch.Tensor,  # (Ci, M) bool
    node_valid: torch.Tensor,    # (Cj, K) bool
) -> torch.Tensor:               # (Ci, Cj)
    "R2T w/o region sets: mean over valid single regions m of the max over valid nodes B (0 with no region)."
    _check_nodes(node_valid)
    best = Q.masked_fill(~node_valid[None, :, None, :], float("-inf")).amax(-1)  # (Ci, Cj, M)
    w = region_valid.to(Q.dtype)[:, None]                                         # (Ci, 1, M)
    return (best * w).sum(-1) / w.sum(-1).clamp_min(1)


# %% [markdown]
# Against the definitions as loops, with padding on both sides and an image without any valid region:

# %%
_g = torch.Generator().manual_seed(5)
_Q = torch.randn(3, 3, 4, 3, generator=_g, dtype=torch.float64)
_rv = torch.tensor([[1, 1, 1, 1], [0, 1, 0, 1], [0, 0, 0, 0]], dtype=torch.bool)
_nv = torch.tensor([[1, 1, 1], [0, 1, 0], [1, 0, 1]], dtype=torch.bool)
_Q = _Q * _rv[:, None, :, None]
_a, _b = t2r_singletons(_Q, _rv, _nv), r2t_singletons(_Q, _rv, _nv)
for i in range(3):
    for j in range(3):
        ms, bs = _rv[i].nonzero().flatten().tolist(), _nv[j].nonzero().flatten().tolist()
        t = sum(max(float(_Q[i, j, m, B]) for m in ms) for B in bs) / len(bs) if ms else 0.0
        r = sum(max(float(_Q[i, j, m, B]) for B in bs) for m in ms) / len(ms) if ms else 0.0
        assert abs(t - float(_a[i, j])) < 1e-12 and abs(r - float(_b[i, j])) < 1e-12, (i, j)
assert (t2r_singletons(_Q, _rv, _nv) <= t2r_exact(_Q, _rv, _nv) + 1e-12).all()  # singletons are a sub-family


# %% [markdown]
# ## The triplet loss (Eq. 9)
#
# $\Phi_\gamma(X)=\frac1C\sum_i\max\big(\max_{j\ne i}X_{i,j}-X_{i,i}+\gamma,\,0\big)$: the hardest negative
# of each row against its positive. For data-parallel training a process holds only some rows
# (its local images against all texts), so the function takes a rectangular block of rows and the column of
# each row's positive. A row with no negative (a batch of one) contributes zero.
#
# **The margin $\gamma$ (a choice).** The paper does not give it. The scores $\bar Q=Q^{\rightarrow}+Q^{\leftarrow}$
# are sums of inner products of unit vectors over regions and words, typically of size 1-10, so we take
# $\gamma=1$ (the margin of the triplet loss of Balntas et al., the paper's ref. [2]); it is a
# config field (`PowerCLIPLossConfig.gamma` in `11_loss`).

# %%
#| export
def triplet(
    X: torch.Tensor,          # (R, C) similarities of R rows (e.g. local images) against C columns (all texts)
    positives: torch.Tensor,  # (R,) long, the column of each row's positive pair
    gamma: float = 1.0,       # margin
) -> torch.Tensor:            # scalar: mean over rows of the hardest-negative hinge
    "Phi_gamma of Eq. 9 on a block of rows: mean_i relu(max_{j != pos_i} X_ij - X_i,pos_i + gamma)."
    pos = X.gather(1, positives[:, None]).squeeze(1)  # (R,)
    neg = X.scatter(1, positives[:, None], float("-inf")).amax(1)  # (R,) hardest negative
    return F.relu(neg - pos + gamma).mean()


# %%
_X = torch.tensor([[3.0, 1.0, 2.5], [0.0, 1.0, 4.0], [1.0, 1.0, 1.0]])
# rows: max(2.5-3+1, 0)=0.5; max(4-1+1, 0)=4; max(1-1+1, 0)=1
assert_close(triplet(_X, torch.arange(3)), torch.tensor((0.5 + 4 + 1) / 3))
assert_close(triplet(_X[1:], torch.tensor([1, 2])), torch.tensor((4 + 1) / 2))  # a block of rows
assert triplet(torch.ones(1, 1), torch.zeros(1, dtype=torch.long)) == 0  # no negative: no loss, no NaN

# %% [markdown]
# ## Gradients and stability
#
# `gradcheck` in float64 on every aggregator and activation, through the embeddings (away from the kinks of
# ReLU and |x| at exactly 0, which random inputs never hit).

# %%
_g = torch.Generator().manual_seed(3)
_C, _M, _W, _K, _N, _D = 2, 3, 4, 3, 6, 5
_patches = torch.randn(_C, _N, _D, dtype=torch.float64, generator=_g, requires_grad=True)
_tokens = torch.randn(_C, _W, _D, dtype=torch.float64, generator=_g, requires_grad=True)
_rmask = torch.rand(_C, _M, _N, generator=_g) < 0.5
_rmask[:, :, 0] = True
_rv = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
_inc = torch.rand(_C, _K, _W, generator=_g) < 0.6
_inc[:, 0] = True
_nv = torch.tensor([[1, 1, 1], [1, 0, 1]], dtype=torch.bool)

def _pipeline(patches, tokens, agg):
    regions = pool_normalize(patches, _rmask)
    leaves = F.normalize(tokens, dim=-1)
    Q = powerset_scores(regions, _rv, phrase_embeddings(leaves, _inc))
    return agg(Q)

for name, agg in {
    **{f"t1-{a}": (lambda Q, a=a: nla_t1(Q, _rv, _nv, 0.3, a)) for a in NLA_T1_ACTS},
    **{f"t2-{a}": (lambda Q, a=a: nla_t2(Q, _rv, _nv, 0.3, 0.75, a)) for a in NLA_T2_INTEGRALS},
    "t2r-exact": lambda Q: t2r_exact(Q, _rv, _nv), "r2t-exact": lambda Q: r2t_exact(Q, _rv, _nv),
    "t2r-single": lambda Q: t2r_singletons(Q, _rv, _nv), "r2t-single": lambda Q: r2t_singletons(Q, _rv, _nv),
    "triplet": lambda Q: triplet(nla_t1(Q, _rv, _nv, 0.3) + nla_t2(Q, _rv, _nv, 0.3), torch.arange(_C)),
}.items():
    assert gradcheck(lambda p, t: _pipeline(p, t, agg), (_patches, _tokens), eps=1e-6, atol=1e-5), name
print("gradcheck passed for", len(NLA_T1_ACTS) + len(NLA_T2_INTEGRALS) + 5, "functions")

# %% [markdown]
# At the paper's $\tau=10^{-3}$, with scores of size 20 and more, in float32 and under bf16 autocast, every
# output and gradient is finite, and the float32 results match float64 to float32 precision:

# %%
_g = torch.Generator().manual_seed(4)
_Q64 = (torch.randn(4, 4, 10, 20, generator=_g, dtype=torch.float64) * 25)
_rv, _nv = torch.ones(4, 10, dtype=torch.bool), torch.ones(4, 20, dtype=torch.bool)
_nv[1, 5:] = False
_rv[2, 7:] = False
_Q64 = _Q64 * _rv[:, None, :, None]
for dtype, autocast in ((torch.float32, False), (torch.bfloat16, True)):
    Q = _Q64.to(dtype).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        s1, s2 = nla_t1(Q, _rv, _nv, 1e-3), nla_t2(Q, _rv, _nv, 1e-3, 0.75)
        loss = triplet(s1 + s2, torch.arange(4)) + triplet((s1 + s2).T, torch.arange(4))
    loss.backward()
    assert s1.dtype == torch.float32 and torch.isfinite(s1).all() and torch.isfinite(s2).all()
    assert torch.isfinite(Q.grad).all(), dtype
_ref1, _ref2 = nla_t1(_Q64, _rv, _nv, 1e-3), nla_t2(_Q64, _rv, _nv, 1e-3, 0.75)
assert_close(nla_t1(_Q64.float(), _rv, _nv, 1e-3), _ref1.float(), rtol=1e-5, atol=1e-4)
assert_close(nla_t2(_Q64.float(), _rv, _nv, 1e-3, 0.75), _ref2.float(), rtol=1e-5, atol=1e-4)
print(f"tau=1e-3, |Q| up to {_Q64.abs().max():.0f}: finite in fp32 and bf16 autocast; fp32 == fp64 to 1e-5")

# %% [markdown]
# ## Cost
#
# NLA-T1 and NLA-T2 touch each of the $C_iC_jMK$ scores a constant number of times: $O(M)$ per
# (pair, node), against $O(2^M)$ for the oracle. But the functions above *materialise* `Q`, with $K$ padded
# to the longest caption, and autograd keeps several tensors of its size for backward: memory $O(C_iC_jMK)$.
# They stay as the readable reference; `10a_powerset_fast` computes the same $\bar S$ from packed tree nodes
# in column blocks whose backward recomputes the scores (memory $O(C_iC_j)$ beyond the inputs), tested
# against these functions, and `benchmarks/powerset_scale.py` measures both (the analogue of the
# supplement's Fig. 9).
