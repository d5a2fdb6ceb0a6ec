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
#| default_exp powerset_fast

# %%
#| export
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from powerclip.powerset import (
    NLA_T1_ACTS, NLA_T2_INTEGRALS, nla_t1, nla_t2, powerset_scores, r2t_singletons, t2r_singletons,
)

# %%
#| hide
import json
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

from torch.autograd import gradcheck
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode



# %% [markdown]
# # The powerset loss at scale
#
# > Packed tree nodes, segment reductions over them, and $\bar S$ in column blocks recomputed in the backward pass.
#
# The memory of the powerset loss no longer grows with $M\times K$.

# %% [markdown]
# `10_powerset` computes $\bar S=\text{NLA-T1}+\text{NLA-T2}$ from the score tensor
# $Q\in\mathbb R^{C_i\times C_j\times M\times K}$, with $K$ padded to the longest caption. That is the readable
# reference, and at the paper's scale it is the problem:
#
# * **Padding.** Parsed real captions have about 8 tree nodes on average, but the longest caption of a gathered
#   batch of thousands has several times as many (CC3M: `benchmarks/results/cc3m_node_counts.json`), and every
#   text is padded to it: most of $Q$ is padding.
# * **Autograd keeps $Q$-sized tensors.** The aggregators' intermediate results ($Q$, $Q/\tau$, the activation,
#   its mask, ...) are saved for backward, in both directions of the local-row loss (local images against all
#   texts, all images against local texts): about 27 bytes per element of $R\times C\times M\times K_{\max}$ in
#   fp32 (`benchmarks/results/powerset_scale_cpu.md`). At the paper's setting (global batch 4096 on 8 GPUs:
#   $R=512$, $C=4096$, $M=10$, $K_{\max}\approx64$) that would be about 35 GB for the loss alone.
#
# This notebook removes both, without changing the result beyond rounding:
#
# 1. **Packed nodes.** The phrases of a batch travel as one $(P, D)$ matrix, $P=\sum_jK_j$, with the text index
#    of each node (`node_text`, sorted). Every packed node is valid, so the node masks disappear; the sums,
#    maxima and log-sum-exps over a text's nodes become **segment reductions** over contiguous runs of
#    `node_text`.
# 2. **Blocks of columns, recomputed in backward.** $\bar S$ is $(C_i, C_j)$; its column $j$ needs only the
#    scores of text $j$'s nodes. We compute the scores of a block of whole texts, reduce them to their
#    $(C_i, \text{block})$ piece of $\bar S$, and drop them. Backward recomputes each block's scores (one
#    matrix product) and applies the analytic gradients of NLA-T1 and NLA-T2. What is kept for backward is
#    the inputs plus one $(C_i, C_j)$ log-sum-exp table; the transient memory is one block, bounded by a byte
#    budget (`block_bytes`).
#
# The dense functions of `10_powerset` stay the reference (and its $2^M$ enumeration the oracle); every
# function here is checked against them in float64, values and gradients, for every activation of Table 8
# and every ablation switch.

# %% [markdown]
# ## Packed nodes
#
# | symbol | code | shape |
# |---|---|---|
# | $p_B$ of all texts' valid nodes, text by text | `phrases` | `(P, D)` |
# | text of each node, non-decreasing | `node_text` | `(P,)` long |
# | $K_j$, nodes of text $j$ ($\ge1$: the root) | `counts` | `(C_j,)` |
#
# Across processes the packed matrices are concatenated in rank order and each process's `node_text` is
# shifted by the number of texts before it, which keeps it sorted (`powerclip.dist.gather` returns the row
# counts needed for the shift).
#
# **Sizes known on the host.** On a GPU, any op whose output size depends on the data makes the host wait for the
# device: packing with a boolean mask (`phrases[node_valid]` calls `nonzero`), `repeat_interleave` without its
# `output_size`, `bincount`, and reading the counts back (`.tolist()`, `int()`, `bool()`). The counts are no
# secret: the data pipeline builds `node_valid` on the CPU, so the number of nodes of each text, $K_j$, can be read
# there before the batch moves to the device (`PowerCLIP.prepare_batch` does, `40_methods`). With those **host
# counts** (`counts`, a list of ints) every function below knows its output sizes in advance and reads nothing
# back: `pack_nodes` takes the valid nodes' flat indices with `nonzero_static` (the size given: $P=\sum_jK_j$) and
# one `index_select`; `unpack_nodes` pads to $K_{\max}=\max_jK_j$ from the host. Without them they read the
# sizes from the device, and check the layout there, as they always did. `check_counts` is the host-side check of
# the counts against the shapes (which cost nothing to read): one-line errors, no sync.

# %%
#| export
def check_counts(
    counts,            # K_j of each text, on the host (a list or tuple of ints)
    n_texts: int,      # C_j
    n_nodes: int | None = None,  # P, the packed nodes (a shape: free to read), if packed
    k_max: int | None = None,    # K, the padded width, if padded
) -> list[int]:        # the counts as a list of ints
    "Host-side check of the host counts against the shapes: one-line errors, nothing read from the device."
    counts = [int(k) for k in counts]
    if len(counts) != n_texts:
        raise ValueError(f"node counts: {len(counts)} given for {n_texts} texts")
    if counts and min(counts) < 1:
        raise ValueError("every text needs at least one valid tree node (the root); the node counts hold a 0")
    if n_nodes is not None and sum(counts) != n_nodes:
        raise ValueError(f"node counts: they sum to {sum(counts)}, but {n_nodes} packed nodes are given")
    if k_max is not None and counts and max(counts) > k_max:
        raise ValueError(f"node counts: a text with {max(counts)} nodes, but the padded width is {k_max}")
    return counts


def pack_nodes(
    phrases: torch.Tensor,     # (C, K, D) padded phrase embeddings
    node_valid: torch.Tensor,  # (C, K) bool
    counts=None,               # K_j of each text on the host (node_valid's row sums, read on the CPU), or None
) -> tuple[torch.Tensor, torch.Tensor]:  # phrases (P, D), node_text (P,) long: the valid nodes, text by text
    "Padded -> packed: keep the valid nodes in text order, with the text index of each (no host sync given counts)."
    C, K = node_valid.shape
    if counts is None:   # the packed size is read from the device (a host sync on a GPU)
        node_text = torch.arange(C, device=phrases.device).repeat_interleave(node_valid.sum(1))  # (P,)
        return phrases[node_valid], node_text  # row-major boolean indexing keeps text order
    P = sum(check_counts(counts, C, k_max=K))
    flat = torch.nonzero_static(node_valid.reshape(-1), size=P).squeeze(1)   # (P,) c * K + k, row-major: text order
    return phrases.reshape(C * K, -1).index_select(0, flat), flat.div(K, rounding_mode="floor")


def node_counts(
    node_text: torch.Tensor,  # (P,) long
    n_texts: int,             # C_j
) -> torch.Tensor:            # (C_j,) long K_j
    "Nodes per text, after checking the packed layout (one-line errors for a malformed `node_text`)."
    if node_text.dim() != 1 or node_text.dtype != torch.long:
        raise ValueError(f"node_text must be a 1-D long tensor, got {tuple(node_text.shape)} {node_text.dtype}")
    if node_text.numel() and (int(node_text.min()) < 0 or int(node_text.max()) >= n_texts):
        raise ValueError(f"node_text holds text indices outside [0, {n_texts})")
    if node_text.numel() > 1 and bool((node_text[1:] < node_text[:-1]).any()):
        raise ValueError("node_text must be sorted (the nodes of a text are contiguous, texts in order)")
    counts = torch.bincount(node_text, minlength=n_texts)  # (C_j,)
    if bool((counts == 0).any()):
        raise ValueError("every text needs at least one valid tree node (the root); got a text with none")
    return counts


def unpack_nodes(
    phrases: torch.Tensor,    # (P, D) packed
    node_text: torch.Tensor,  # (P,) long, sorted
    n_texts: int,             # C_j
    counts=None,              # K_j of each text on the host, or None (read from the device, and checked there)
) -> tuple[torch.Tensor, torch.Tensor]:  # phrases (C_j, K_max, D) zero-padded, node_valid (C_j, K_max)
    "Packed -> padded (for the dense reference and the exact oracle); differentiable in `phrases`."
    if counts is None:
        k = node_counts(node_text, n_texts)                        # (C_j,)
        K = int(k.max())
    else:
        K = max(check_counts(counts, n_texts, n_nodes=node_text.shape[0]), default=1)
        k = torch.zeros(n_texts, dtype=torch.long, device=node_text.device).index_add_(
            0, node_text, torch.ones_like(node_text))              # (C_j,) on the device, no sync
    start = k.cumsum(0) - k                                         # (C_j,) first node of each text
    slot = torch.arange(node_text.numel(), device=node_text.device) - start[node_text]  # (P,) position in its text
    out = phrases.new_zeros(n_texts, K, phrases.shape[1]).index_put((node_text, slot), phrases)  # (C_j, K, D)
    valid = torch.zeros(n_texts, K, dtype=torch.bool, device=phrases.device)
    valid[node_text, slot] = True
    return out, valid


# %%
_g = torch.Generator().manual_seed(0)
_ph = torch.randn(3, 4, 2, generator=_g, dtype=torch.float64)
_nv = torch.tensor([[1, 0, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
_pp, _nt = pack_nodes(_ph, _nv)
assert _nt.tolist() == [0, 0, 1, 2, 2, 2, 2] and _pp.shape == (7, 2)
assert_close(_pp[1], _ph[0, 2])
assert_close(_pp[3], _ph[2, 0])
_up, _uv = unpack_nodes(_pp, _nt, 3)
assert _uv.tolist() == [[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]]
assert_close(_up[0, :2], _ph[0, [0, 2]]) and assert_close(_up[2], _ph[2])
assert (_up[1, 1:] == 0).all()
for bad, msg in ((torch.tensor([0, 2, 1]), "sorted"), (torch.tensor([0, 1, 3]), "outside"),
                 (torch.tensor([0, 0, 2]), "at least one"), (torch.tensor([0., 1, 2]), "long")):
    try:
        node_counts(bad, 3)
        raise AssertionError(msg)
    except ValueError as e:
        assert msg in str(e), (msg, e)

# %% [markdown]
# With the host counts, the same packing and padding (bitwise), and the counts checked against the shapes on the host:

# %%
_kc = _nv.sum(1).tolist()                                   # [2, 1, 4]: what the CPU side reads before the move
_pp2, _nt2 = pack_nodes(_ph, _nv, _kc)
assert torch.equal(_pp2, _pp) and torch.equal(_nt2, _nt)
_up2, _uv2 = unpack_nodes(_pp, _nt, 3, _kc)
assert torch.equal(_up2, _up) and torch.equal(_uv2, _uv)
for args, msg in (((_kc[:2], 3), "2 given for 3 texts"), (([2, 0, 4], 3), "hold a 0"),
                  ((_kc, 3, 6), "sum to 7, but 6 packed"), ((_kc, 3, None, 3), "4 nodes, but the padded width is 3")):
    try:
        check_counts(*args)
        raise AssertionError(msg)
    except ValueError as e:
        assert msg in str(e), (msg, e)


# %% [markdown]
# ## Segment reductions
#
# Over the last axis, with `seg` the (block-local) text index of each node: a sum is `index_add_`; a maximum
# is `scatter_reduce_('amax')`; a log-sum-exp subtracts each segment's maximum before `exp`, as
# `torch.logsumexp` does, because at $\tau=10^{-3}$ the NLA-T2 exponents reach thousands. Segments are never
# empty (every text has a node), so no $-\infty$ survives. The shifted exponents are floored at $-80$: a term
# below $e^{-80}$ of its segment's largest cannot change the sum, and float32 `exp` is about ten times slower
# where its result would be subnormal (below $e^{-87}$).

# %%
#| export
def segment_sum(x: torch.Tensor, seg: torch.Tensor, n: int) -> torch.Tensor:
    "(..., P) -> (..., n): sum over the entries of each segment of the last axis."
    return x.new_zeros(*x.shape[:-1], n).index_add_(-1, seg, x)


def segment_max(x: torch.Tensor, seg: torch.Tensor, n: int) -> torch.Tensor:
    "(..., P) -> (..., n): max over the entries of each (non-empty) segment of the last axis."
    out = x.new_full((*x.shape[:-1], n), float("-inf"))
    return out.scatter_reduce_(-1, seg.expand_as(x), x, "amax")


_EXP_FLOOR = -80.0  # exponents below this are raised to it: e^-80 is negligible, and float32 subnormals are slow


def segment_logsumexp(x: torch.Tensor, seg: torch.Tensor, n: int) -> torch.Tensor:
    "(..., P) -> (..., n): log sum exp over each (non-empty) segment of the last axis, max-shifted."
    m = segment_max(x, seg, n)                                   # (..., n)
    return segment_sum((x - m.index_select(-1, seg)).clamp_(min=_EXP_FLOOR).exp_(), seg, n).log_() + m


# %%
_x = torch.randn(2, 7, generator=_g, dtype=torch.float64) * 1e3
_xp, _xv = unpack_nodes(_x.T, _nt, 3)  # (3, K, 2): the same numbers padded
_xp = _xp.permute(2, 0, 1)              # (2, 3, K)
assert_close(segment_sum(_x, _nt, 3), (_xp * _xv).sum(-1))
assert_close(segment_max(_x, _nt, 3), _xp.masked_fill(~_xv, float("-inf")).amax(-1))
assert_close(segment_logsumexp(_x, _nt, 3), _xp.masked_fill(~_xv, float("-inf")).logsumexp(-1))


# %% [markdown]
# ## The analytic gradients
#
# Write $q_{imp}=\langle\phi^{(i)}_m,p_p\rangle$ for region $m$ of image $i$ and packed node $p$ of text
# $j=j(p)$, $v_{im}\in\{0,1\}$ for region validity, $x=q/2\tau$, and $G=\partial L/\partial\bar S$.
#
# **NLA-T1** $=\frac1{K_j}\sum_{p\in j}\sum_m v_{im}\,\tau\mathrm{Act}(q_{imp}/\tau)$, so
# $$\frac{\partial\,\text{T1}_{ij}}{\partial q_{imp}}=\frac{v_{im}}{K_j}\mathrm{Act}'(q_{imp}/\tau).$$
# **NLA-T2** $=\tau\,\mathrm{LSE}_{p\in j}\,s_{ip}-\tau(1-\alpha)\log K_j$ with
# $s_{ip}=\sum_m\zeta_\alpha(x_{imp})$ and $\zeta_\alpha'(x)=1+\alpha\mathrm{Act}(x)$ (Definition 2), so with the
# segment softmax $\pi_{ip}=e^{s_{ip}-\mathrm{LSE}_{p'\in j}s_{ip'}}$,
# $$\frac{\partial\,\text{T2}_{ij}}{\partial q_{imp}}=\pi_{ip}\,\frac{1+\alpha\,\mathrm{Act}(x_{imp})}{2}\,v_{im}.$$
# The debiasing term $\tau\alpha M_i\log2$ is constant. Then, with
# $\delta_{imp}=G_{ij(p)}\,\partial\bar S_{ij(p)}/\partial q_{imp}$,
# $$\frac{\partial L}{\partial\phi^{(i)}_m}=\sum_p\delta_{imp}\,p_p,\qquad
#   \frac{\partial L}{\partial p_p}=\sum_{i,m}\delta_{imp}\,\phi^{(i)}_m:$$
# two matrix products per block. Only $\mathrm{LSE}_{p\in j}s_{ip}$, a $(C_i,C_j)$ table, is kept from the
# forward pass; $q$, $\mathrm{Act}$ and $\pi$ are recomputed.
#
# **Without region sets** (`region_sets=False`, see `10_powerset`) the hard maxima route $G$ to the
# maximising region (T2R) or node (R2T), shared evenly between exact ties, exactly as torch's `amax` does.
#
# **The default pair shares its work.** With $z=q/\tau$, $\log\cosh(z/2)=\mathrm{softplus}(z)-z/2-\log2$, so
# NLA-T2 with tanh has $\zeta_\alpha(z/2)=\frac{1-\alpha}2z+\alpha\,\mathrm{softplus}(z)-\alpha\log2$: the paper's
# default activations (softplus for NLA-T1, tanh for NLA-T2) need the *same* per-score quantity. Per pair
# $(i,p)$ both terms are functions of two sums over regions, $\Sigma_z=\sum_mz_{imp}$ and
# $\Sigma_+=\sum_m\mathrm{softplus}(z_{imp})$:
# $$\textstyle\sum_mv_{im}\tau\,\mathrm{softplus}(z_{imp})=\tau\big(\Sigma_+-(M-M_i)\log2\big),\qquad
#   s_{ip}=\frac{1-\alpha}2\Sigma_z+\alpha\big(\Sigma_+-M\log2\big)$$
# (an invalid region has $z=0$ and $\mathrm{softplus}(0)=\log2$), and since $\tanh(z/2)=2\sigma(z)-1$,
# $$\delta_{imp}=v_{im}\Big[\sigma(z_{imp})\Big(\frac{G_{ij}}{K_j}+\alpha\,G_{ij}\pi_{ip}\Big)+\frac{1-\alpha}2G_{ij}\pi_{ip}\Big]:$$
# one softplus per score forward, one softplus and one sigmoid per score backward, instead of four
# transcendental functions and a dozen passes. Other activations take the general path.
#
# The derivatives are those of the functions `10_powerset` computes (`softplus_exact` has no threshold), so
# the gradients equal autograd's through the dense reference to rounding.

# %%
#| export
def _gelu_grad(z: torch.Tensor) -> torch.Tensor:
    "d/dz gelu(z) = Phi(z) + z phi(z) (exact erf form, as F.gelu's default)."
    return 0.5 * (1.0 + torch.erf(z * math.sqrt(0.5))) + z * torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)


def _silu_grad(z: torch.Tensor) -> torch.Tensor:
    "d/dz z sigmoid(z) = sigmoid(z) (1 + z (1 - sigmoid(z)))."
    s = torch.sigmoid(z)
    return s * (1.0 + z * (1.0 - s))


NLA_T1_GRADS = {
    # d/dq of NLA_T1_ACTS[act](q, tau) = tau * Act(q / tau): Act'(q / tau)
    "softplus": lambda q, tau: torch.sigmoid(q / tau),
    "relu": lambda q, tau: (q > 0).to(q.dtype),  # torch's relu'(0) = 0
    "gelu": lambda q, tau: _gelu_grad(q / tau),
    "swish": lambda q, tau: _silu_grad(q / tau),
}

NLA_T2_ACTS = {
    # Act = d/dx NLA_T2_INTEGRALS[act](x), so that zeta_alpha'(x) = 1 + alpha * Act(x)
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "softsign": F.softsign,
}


def _softplus_sums(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    "z (rb, M, pb) -> (sum_m z, sum_m softplus(z)), each (rb, pb), in few passes over z."
    a = z.abs()
    s_abs, s_z = a.sum(1), z.sum(1)
    # sum_m log(1 + e^-|z|) as softplus_exact, but with log(1 + x) for log1p(x): torch's float32 log1p is not
    # vectorised on CPU (about 15x slower than log), and for x = e^-|z| in (0, 1] the two differ by at most
    # one rounding of 1 + x, an absolute 6e-8 (float32) or 1e-16 (float64) per score
    s_log = a.clamp_(max=60.0).neg_().exp_().add_(1.0).log_().sum(1)
    return s_z, 0.5 * (s_z + s_abs) + s_log                     # relu(z) = (z + |z|) / 2


# %% [markdown]
# Each derivative against autograd of the forward function, in float64, over $|q/\tau|$ from 0 to $10^4$,
# and the shared sums against their definition:

# %%
_q = torch.cat([torch.linspace(-30, 30, 601), torch.logspace(-3, 4, 50), -torch.logspace(-3, 4, 50)]).double()
for tau in (1.0, 0.1, 1e-3):
    for a, f in NLA_T1_ACTS.items():
        q = (_q * tau).requires_grad_()
        (g,) = torch.autograd.grad(f(q, tau).sum(), q)
        assert_close(NLA_T1_GRADS[a](q.detach(), tau), g, rtol=1e-12, atol=1e-14, msg=a)
for a, f in NLA_T2_INTEGRALS.items():
    x = _q.clone().requires_grad_()
    (g,) = torch.autograd.grad(f(x).sum(), x)
    assert_close(NLA_T2_ACTS[a](x.detach()), g, rtol=1e-12, atol=1e-14, msg=a)
_z = (torch.randn(3, 5, 7, generator=_g, dtype=torch.float64)
      * torch.tensor([0.1, 10, 1e3, 1e4, 0.0]).double()[None, :, None])
_sz, _sp = _softplus_sums(_z)
assert_close(_sz, _z.sum(1))
assert_close(_sp, NLA_T1_ACTS["softplus"](_z, 1.0).sum(1), rtol=1e-14, atol=1e-12)
_sp1 = NLA_T1_ACTS["softplus"](_z, 1.0)  # the shared identity, at alpha = 0.75
assert_close(0.5 * _z + 0.75 * NLA_T2_INTEGRALS["tanh"](0.5 * _z), 0.125 * _z + 0.75 * (_sp1 - math.log(2)),
             rtol=1e-13, atol=1e-10)


# %% [markdown]
# ## One block
#
# A block is rows $[r_0,r_1)$ (images) by whole texts $[j_0,j_1)$, i.e. packed nodes $[p_0,p_1)$. Its scores
# `q (rb, M, pb)` are one matrix product; the two functions below map them to the block of $\bar S$ and,
# in backward, to $\delta$. They are the part a fused kernel would replace.

# %%
#| export
@dataclass(frozen=True)
class SbarSpec:
    "What S-bar is made of (the loss config's switches) and how it is computed (block budget)."
    tau: float = 1e-3            # NLA temperature
    alpha: float = 0.75          # NLA-T2 interpolation
    t1_act: str = "softplus"     # NLA_T1_ACTS key
    t2_act: str = "tanh"         # NLA_T2_INTEGRALS key
    use_t2r: bool = True         # add the T2R term (NLA-T1, or the singleton max)
    use_r2t: bool = True         # add the R2T term (NLA-T2, or the singleton max)
    debias_t2: bool = False      # add tau * alpha * M_i * log 2 to NLA-T2
    region_sets: bool = True     # False: single regions only, hard max (Table 6 "w/o region sets")
    block_bytes: int = 16 << 20  # budget for one block of scores (rb, M, pb) in the aggregation dtype (a CPU's)

    @property
    def needs_lse(self) -> bool:
        return self.region_sets and self.use_r2t

    @property
    def shared(self) -> bool:
        "softplus + tanh: both NLAs from the same two sums per (row, node) (see above)."
        return self.region_sets and self.t1_act == "softplus" and self.t2_act == "tanh"


def _block_forward(
    q: torch.Tensor,     # (rb, M, pb) scores, zero at invalid regions
    rv: torch.Tensor | None,  # (rb, M) bool region validity; None: all valid
    seg: torch.Tensor,   # (pb,) long text of each node, 0..cb-1
    K: torch.Tensor,     # (cb,) nodes per text, aggregation dtype
    spec: SbarSpec,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # S-bar block (rb, cb), LSE_p s (rb, cb) or None
    "S-bar of one block from its scores: NLA-T1 + NLA-T2 (or the singleton maxima), per spec."
    rb, M, _ = q.shape
    cb, tau, alpha, log2 = K.shape[0], spec.tau, spec.alpha, math.log(2.0)
    Mi = q.new_full((rb, 1), M) if rv is None else rv.sum(1, keepdim=True).to(q.dtype)  # (rb, 1) valid regions
    S, lse = q.new_zeros(rb, cb), None
    if spec.shared:
        s_z, s_plus = _softplus_sums(q * (1.0 / tau))                               # (rb, pb) each
        if spec.use_t2r:
            S += segment_sum(tau * (s_plus - (M - Mi) * log2), seg, cb) / K        # invalid z = 0 gave log 2
        if spec.use_r2t:
            s = (0.5 * (1.0 - alpha)) * s_z + alpha * (s_plus - M * log2)           # sum_m zeta(z / 2)
            lse = segment_logsumexp(s, seg, cb)
    elif spec.region_sets:
        if spec.use_t2r:
            a = NLA_T1_ACTS[spec.t1_act](q, tau)                                   # (rb, M, pb)
            S += segment_sum((a if rv is None else a * rv[:, :, None]).sum(1), seg, cb) / K
        if spec.use_r2t:
            x = q / (2.0 * tau)                                                     # (rb, M, pb)
            s = (x + alpha * NLA_T2_INTEGRALS[spec.t2_act](x)).sum(1)              # (rb, pb); zeta(0) = 0
            lse = segment_logsumexp(s, seg, cb)                                     # (rb, cb)
    else:
        if spec.use_t2r:
            qm = q if rv is None else q.masked_fill(~rv[:, :, None], float("-inf"))
            best = qm.amax(1).masked_fill(Mi == 0, 0.0)                            # (rb, pb) best region; none: 0
            S += segment_sum(best, seg, cb) / K
        if spec.use_r2t:
            best = segment_max(q, seg, cb)                                          # (rb, M, cb) best node
            S += (best if rv is None else best * rv[:, :, None]).sum(1) / Mi.clamp_min(1)
    if lse is not None:
        S += tau * (lse - (1.0 - alpha) * torch.log(K))
        if spec.debias_t2:
            S += (tau * alpha * log2) * Mi
    return S, lse


def _block_backward(
    q: torch.Tensor,     # (rb, M, pb) recomputed scores, zero at invalid regions
    rv: torch.Tensor | None,  # (rb, M) bool; None: all valid
    seg: torch.Tensor,   # (pb,) long, 0..cb-1
    K: torch.Tensor,     # (cb,) aggregation dtype
    G: torch.Tensor,     # (rb, cb) dL/dS-bar of the block
    lse: torch.Tensor | None,  # (rb, cb) saved by the forward pass (NLA-T2 only)
    spec: SbarSpec,
) -> torch.Tensor:       # (rb, M, pb) delta = dL/dq
    "The analytic gradient of the block's S-bar with respect to its scores (see the derivation above)."
    rb, M, _ = q.shape
    cb, tau, alpha = K.shape[0], spec.tau, spec.alpha
    c1 = (G / K).index_select(1, seg) if spec.use_t2r else None                   # (rb, pb) dT2R-mean weights
    if spec.region_sets and spec.use_r2t:                                          # pi * G: (rb, pb)
        z = q * (1.0 / tau)
        if spec.shared:
            s_z, s_plus = _softplus_sums(z)
            s = (0.5 * (1.0 - alpha)) * s_z + alpha * (s_plus - M * math.log(2.0))
        else:
            x = 0.5 * z
            s = (x + alpha * NLA_T2_INTEGRALS[spec.t2_act](x)).sum(1)
        piG = (s - lse.index_select(1, seg)).clamp_(min=_EXP_FLOOR).exp_() * G.index_select(1, seg)
    if spec.shared:
        coef = alpha * piG if spec.use_r2t else 0.0
        if spec.use_t2r:
            coef = coef + c1
        d = torch.sigmoid(q * (1.0 / tau)).mul_(coef[:, None, :])
        if spec.use_r2t:
            d += (0.5 * (1.0 - alpha)) * piG[:, None, :]
    elif spec.region_sets:
        d = torch.zeros_like(q)
        if spec.use_t2r:
            d += NLA_T1_GRADS[spec.t1_act](q, tau) * c1[:, None, :]
        if spec.use_r2t:
            d += (1.0 + alpha * NLA_T2_ACTS[spec.t2_act](0.5 * z)) * (0.5 * piG)[:, None, :]
    else:
        d = torch.zeros_like(q)
        rvf = None if rv is None else rv.to(q.dtype)[:, :, None]                   # (rb, M, 1)
        Mi = q.new_full((rb, 1), M) if rv is None else rvf.sum(1)                  # (rb, 1)
        if spec.use_t2r:
            qm = q if rv is None else q.masked_fill(~rv[:, :, None], float("-inf"))
            hit = (qm == qm.amax(1, keepdim=True)).to(q.dtype)                     # (rb, M, pb) argmax regions
            d += hit * (c1 * (Mi > 0))[:, None, :] / hit.sum(1, keepdim=True)       # ties share evenly
        if spec.use_r2t:
            hit = (q == segment_max(q, seg, cb).index_select(-1, seg)).to(q.dtype)  # (rb, M, pb) argmax nodes
            c = (G / Mi.clamp_min(1))[:, None, :] / segment_sum(hit, seg, cb)      # (rb, M, cb)
            d += hit * (c if rvf is None else c * rvf).index_select(-1, seg)
        return d
    return d if rv is None else d.mul_(rv[:, :, None])


# %% [markdown]
# ## The blocked function
#
# **Custom `autograd.Function` or checkpointed blocks?** Both keep only the inputs across forward and
# backward. We write the backward by hand because
#
# * it is cheaper: a checkpointed block re-runs the forward *and* lets autograd save and walk every
#   intermediate of it (about ten block-sized tensors for NLA-T1 + NLA-T2, the scatter-based log-sum-exp
#   included), while the analytic backward is one recomputed product, a few elementwise passes and the two
#   gradient products;
# * the only state it needs from the forward pass is the log-sum-exp table $(C_i, C_j)$, so the softmax of
#   NLA-T2 is exact in backward without re-reducing;
# * it is the form a fused kernel needs anyway (scores, $\delta$ and the two products in one pass).
#
# Checkpointing would be simpler to trust, since autograd derives the gradient; the price of writing it by
# hand is the parity tests below, against autograd through the dense reference, to $10^{-9}$ in float64.
#
# **Blocks.** The budget `block_bytes` bounds one block of scores `(rb, M, pb)` in the aggregation dtype;
# the transient memory of a block is a small multiple of it (the scores and a few elementwise temporaries).
# Blocks hold whole texts, so every segment reduction stays inside a block; rows are split too when even the
# longest single text does not fit with all rows. The default, 16 MiB, was chosen on a CPU, where a block
# should stay near the caches; on a GPU a larger budget means fewer, larger kernels: every block costs a few dozen
# kernel launches, and at the paper's size (R = 512 against C = 4,096, M = 10) 16 MiB makes 83 blocks
# (issue 37). `device_block_bytes` is the budget for a device: 16 MiB on a CPU; on CUDA 1/128 of the GPU's memory,
# within [256 MiB, 1 GiB] (596 MiB on an 80 GB GPU, 1 GiB on a 141 GB one, 256 MiB below 34 GB), so that a block's
# few transient copies stay a few GB at most. It asks the CUDA runtime for the memory, so it is called once, when a
# run is built (`PowerCLIP.setup_model` resolves the loss config's `block_bytes='auto'`, `40_methods`), never in a
# step. The larger budget is not yet measured against 16 MiB on a GPU (the GPU check's paths part does).
#
# **Host facts.** The block plan needs the node counts $K_j$ on the host, and skipping the masking passes needs to
# know that every region is valid. `sbar_blocked` takes both as host arguments (`counts`, `all_valid`), which the
# caller read on the CPU before the batch moved (`11_loss`'s `PowersetInputs` carries them); the $K_j$ the
# aggregation divides by are then summed on the device from `node_text` (a segment sum of ones) instead of copied
# from the host, and nothing is read back: the forward and backward passes make no host sync. Without them it reads
# the counts and the regions' validity from the device and checks the layout there (`node_counts`), as it always
# did: a few host syncs per call on a GPU.
#
# **Precision.** Scores are reduced in float32 at least (float64 stays float64), as in `10_powerset`. Under
# autocast the two score products run in the autocast dtype, like the dense reference's einsum, and the
# reduction in float32; the gradient products use the same dtype.

# %%
#| export
def block_plan(
    n_rows: int, M: int, counts: list[int],  # rows C_i, regions per row, nodes per text K_j
    itemsize: int, block_bytes: int,         # bytes per score, budget per block
) -> tuple[int, list[tuple[int, int, int, int]]]:  # (rows per block, [(j0, j1, p0, p1), ...] text and node ranges)
    "Split C_i x P scores into blocks of at most block_bytes (rows x whole texts; at least one row and one text)."
    per_node = max(1, M) * itemsize
    rows = max(1, min(n_rows, block_bytes // (per_node * max(counts, default=1))))  # the longest text must fit
    cap = max(1, block_bytes // (per_node * rows))                                  # nodes per block
    blocks, j0, p0, p = [], 0, 0, 0
    for j, k in enumerate(counts):
        if p + k - p0 > cap and j > j0:
            blocks.append((j0, j, p0, p))
            j0, p0 = j, p
        p += k
    if len(counts) > j0:
        blocks.append((j0, len(counts), p0, p))
    return rows, blocks


CPU_BLOCK_BYTES = 16 << 20   # the block budget on a CPU (and wherever no device was asked)


def device_block_bytes(device) -> int:
    """The block budget for `device`: 16 MiB on a CPU; on CUDA 1/128 of the GPU's memory within [256 MiB, 1 GiB], whole
    MiB. Asks the CUDA runtime: call it once, when a run is built."""
    device = torch.device(device)
    if device.type != "cuda":
        return CPU_BLOCK_BYTES
    total = torch.cuda.get_device_properties(device).total_memory
    return min(max(total // 128, 256 << 20), 1 << 30) >> 20 << 20


def _nodes_per_text(node_text: torch.Tensor, n_texts: int, dtype: torch.dtype) -> torch.Tensor:
    "(C_j,) K_j on the device, from node_text (no host sync: a segment sum of ones)."
    return torch.zeros(n_texts, dtype=dtype, device=node_text.device).index_add_(
        0, node_text, torch.ones(node_text.shape, dtype=dtype, device=node_text.device))


class _SbarBlocked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, regions, phrases, region_valid, node_text, counts, all_valid, spec, mm_dtype):
        agg = torch.promote_types(torch.promote_types(regions.dtype, phrases.dtype), torch.float32)
        Ci, M, D = regions.shape
        Cj = len(counts)
        rows, blocks = block_plan(Ci, M, counts, agg.itemsize, spec.block_bytes)  # on the host, from host counts
        K = _nodes_per_text(node_text, Cj, agg)                                       # (C_j,)
        S = regions.new_zeros(Ci, Cj, dtype=agg)
        lse = regions.new_zeros(Ci, Cj, dtype=agg) if spec.needs_lse else None
        ph = phrases.to(mm_dtype)                                                     # (P, D)
        with torch.autocast(regions.device.type, enabled=False):
            for r0 in range(0, Ci, rows):
                r1 = min(Ci, r0 + rows)
                reg = regions[r0:r1].to(mm_dtype).reshape(-1, D)                       # (rb*M, D)
                rv = None if all_valid else region_valid[r0:r1]
                for j0, j1, p0, p1 in blocks:
                    q = (reg @ ph[p0:p1].T).to(agg).view(r1 - r0, M, p1 - p0)         # (rb, M, pb)
                    if rv is not None:
                        q *= rv[:, :, None]
                    Sb, lb = _block_forward(q, rv, node_text[p0:p1] - j0, K[j0:j1], spec)
                    S[r0:r1, j0:j1] = Sb
                    if lb is not None:
                        lse[r0:r1, j0:j1] = lb
        ctx.save_for_backward(regions, phrases, region_valid, node_text, lse)
        ctx.plan, ctx.spec, ctx.mm_dtype, ctx.counts, ctx.all_valid = (rows, blocks), spec, mm_dtype, counts, all_valid
        return S

    @staticmethod
    def backward(ctx, G):
        regions, phrases, region_valid, node_text, lse = ctx.saved_tensors
        spec, mm, (rows, blocks) = ctx.spec, ctx.mm_dtype, ctx.plan
        Ci, M, D = regions.shape
        agg = G.dtype
        K = _nodes_per_text(node_text, len(ctx.counts), agg)                         # recomputed: not kept
        need_r, need_p = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g_reg = torch.zeros(Ci, M, D, dtype=agg, device=G.device) if need_r else None
        g_ph = torch.zeros(phrases.shape, dtype=agg, device=G.device) if need_p else None
        ph = phrases.to(mm)
        with torch.autocast(G.device.type, enabled=False):
            for r0 in range(0, Ci, rows):
                r1 = min(Ci, r0 + rows)
                reg = regions[r0:r1].to(mm).reshape(-1, D)                              # (rb*M, D)
                rv = None if ctx.all_valid else region_valid[r0:r1]
                for j0, j1, p0, p1 in blocks:
                    q = (reg @ ph[p0:p1].T).to(agg).view(r1 - r0, M, p1 - p0)          # recomputed (rb, M, pb)
                    if rv is not None:
                        q *= rv[:, :, None]
                    d = _block_backward(q, rv, node_text[p0:p1] - j0, K[j0:j1], G[r0:r1, j0:j1],
                                        None if lse is None else lse[r0:r1, j0:j1], spec)
                    d = d.view(-1, p1 - p0).to(mm)                                        # (rb*M, pb)
                    if need_r:
                        g_reg[r0:r1] += (d @ ph[p0:p1]).view(r1 - r0, M, D)
                    if need_p:
                        g_ph[p0:p1] += d.T @ reg                                 # (pb, D)
        return (None if g_reg is None else g_reg.to(regions.dtype),
                None if g_ph is None else g_ph.to(phrases.dtype), None, None, None, None, None, None)


def sbar_blocked(
    regions: torch.Tensor,       # (C_i, M, D) region embeddings phi(I_i | R_m)
    region_valid: torch.Tensor,  # (C_i, M) bool
    phrases: torch.Tensor,       # (P, D) packed phrase embeddings of C_j texts
    node_text: torch.Tensor,     # (P,) long, sorted: the text of each node; every text has >= 1 node
    n_texts: int,                # C_j
    spec: SbarSpec = SbarSpec(),
    counts=None,                 # K_j of each text on the host (list of ints), or None: read from node_text
    all_valid: bool | None = None,  # every region valid (host), or None: read from region_valid
) -> torch.Tensor:               # (C_i, C_j) S-bar, float32 at least
    """S-bar of every image against every text from packed nodes, in blocks; backward recomputes the scores. With the
    host facts `counts` and `all_valid` it reads nothing back from the device (no host sync on a GPU)."""
    if spec.t1_act not in NLA_T1_ACTS or spec.t2_act not in NLA_T2_INTEGRALS:
        raise ValueError(f"unknown activation: t1_act={spec.t1_act!r} (one of {sorted(NLA_T1_ACTS)}), "
                         f"t2_act={spec.t2_act!r} (one of {sorted(NLA_T2_INTEGRALS)})")
    if regions.shape[-1] != phrases.shape[-1] or regions.shape[:2] != region_valid.shape:
        raise ValueError(f"shapes do not match: regions {tuple(regions.shape)}, region_valid "
                         f"{tuple(region_valid.shape)}, phrases {tuple(phrases.shape)}")
    if counts is None:   # no host facts: the counts from the device, the layout checked there (host syncs on a GPU)
        counts = node_counts(node_text, n_texts).tolist()
    else:
        counts = check_counts(counts, n_texts, n_nodes=node_text.shape[0])
    if all_valid is None:
        all_valid = bool(region_valid.all())   # a host sync on a GPU; True: no masking passes
    dev, mm = regions.device.type, torch.promote_types(regions.dtype, phrases.dtype)
    if torch.is_autocast_enabled(dev) and mm == torch.float32:
        mm = torch.get_autocast_dtype(dev)  # the score products in the autocast dtype, as the dense einsum
    return _SbarBlocked.apply(regions, phrases, region_valid.bool(), node_text, counts, bool(all_valid), spec, mm)


# %% [markdown]
# ## Parity with the dense reference
#
# The reference: pad the nodes, build $Q$ with `powerset_scores` and aggregate with the functions of
# `10_powerset`, autograd for the gradient. Random cases in float64 with ragged $M$ (an image with no valid
# region among them), ragged $K$ (texts with a single node among them), a block budget small enough to force
# many blocks *and* split rows, every activation of Table 8 and every switch. Values and gradients (regions
# and phrases) agree to $10^{-9}$.

# %%
#| export
def ragged_case(Ci=5, Cj=6, M=4, D=8, Kmax=5, seed=0, dtype=torch.float64, scale=1.0):
    """Random ragged inputs (regions `(Ci, M, D)`, their validity `(Ci, M)`, packed phrases `(sum K, D)`, node_text
    `(sum K,)`): image 1 has no valid region, text 0 a single node (these tests; the GPU check's S-bar parity)."""
    g = torch.Generator().manual_seed(seed)
    regions = F.normalize(torch.randn(Ci, M, D, generator=g, dtype=dtype), dim=-1) * scale
    rv = torch.rand(Ci, M, generator=g) < 0.7
    rv[0] = True
    rv[1] = False
    k = torch.randint(1, Kmax + 1, (Cj,), generator=g)
    k[0] = 1
    node_text = torch.arange(Cj).repeat_interleave(k)
    phrases = torch.randn(int(k.sum()), D, generator=g, dtype=dtype) * scale
    return regions, rv, phrases, node_text


# %%
#| export
def sbar_dense(
    regions: torch.Tensor,       # (C_i, M, D)
    region_valid: torch.Tensor,  # (C_i, M) bool
    phrases: torch.Tensor,       # (P, D) packed
    node_text: torch.Tensor,     # (P,) long, sorted
    n_texts: int,                # C_j
    spec: SbarSpec = SbarSpec(),
) -> torch.Tensor:               # (C_i, C_j)
    "The reference of every fast path: S-bar from the padded Q of 10_powerset's functions (float64 in the tests)."
    rv = region_valid
    ph, nv = unpack_nodes(phrases, node_text, n_texts)
    Q = powerset_scores(regions, rv, ph)  # (Ci, Cj, M, K)
    S = 0
    if spec.use_t2r:
        S = S + (nla_t1(Q, rv, nv, spec.tau, spec.t1_act) if spec.region_sets else t2r_singletons(Q, rv, nv))
    if spec.use_r2t:
        S = S + (nla_t2(Q, rv, nv, spec.tau, spec.alpha, spec.t2_act, spec.debias_t2) if spec.region_sets
                 else r2t_singletons(Q, rv, nv))
    return S


# %%
_SPECS = ([SbarSpec(tau=0.3, t1_act=a) for a in NLA_T1_ACTS] + [SbarSpec(tau=0.3, t2_act=a) for a in NLA_T2_INTEGRALS]
          + [SbarSpec(tau=0.3, use_t2r=False), SbarSpec(tau=0.3, use_r2t=False), SbarSpec(tau=0.3, debias_t2=True),
             SbarSpec(tau=0.05, alpha=0.0), SbarSpec(tau=0.05, alpha=1.0), SbarSpec(tau=1e-3),
             SbarSpec(region_sets=False), SbarSpec(region_sets=False, use_t2r=False),
             SbarSpec(region_sets=False, use_r2t=False)])


def _parity(spec, Ci, Cj, seed, budget):
    reg, rv, ph, nt = ragged_case(Ci, Cj, seed=seed)
    fast_spec = replace(spec, block_bytes=budget)
    out = {}
    for name, f in (("dense", sbar_dense), ("fast", sbar_blocked)):
        r, p = reg.clone().requires_grad_(), ph.clone().requires_grad_()
        S = f(r, rv, p, nt, Cj, fast_spec if name == "fast" else spec)
        W = torch.randn(S.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=S.dtype)
        gr, gp = torch.autograd.grad((S * W).sum(), (r, p))
        out[name] = (S.detach(), gr, gp)
    for a, b, what in zip(out["fast"], out["dense"], ("S", "d regions", "d phrases")):
        assert_close(a, b, rtol=0, atol=1e-9, msg=lambda m: f"{spec} {what}: {m}")
    return max(float((a - b).abs().max()) for a, b in zip(out["fast"], out["dense"]))


_worst = 0.0
for i, spec in enumerate(_SPECS):
    # square, the local-image form (few rows, many texts) and the local-text form (many rows, few texts);
    # budgets from one node of one row (rows split) to everything in one block
    for Ci, Cj, budget in ((5, 6, 1), (3, 9, 600), (9, 3, 10**9)):
        _worst = max(_worst, _parity(spec, Ci, Cj, seed=10 * i + Ci, budget=budget))
print(f"fast == dense (values, d regions, d phrases) in float64: {len(_SPECS)} specs x 3 shapes, "
      f"largest difference {_worst:.1e}")

# %% [markdown]
# **The host facts change nothing but where the sizes come from.** Given `counts` and `all_valid`, `sbar_blocked`
# returns the same numbers bitwise, forward and backward, and dispatches none of the ops that make a GPU's host wait:
# the scalar reads (`_local_scalar_dense`, under `.item()`, `bool()`, `int()`) and the ops whose output size depends
# on the data. (`.tolist()` dispatches nothing on a CPU tensor; its `bincount` does.) `tests/test_cuda_dry_run.py`
# counts the same, with their sites, on a simulated GPU, through the whole training step.

# %%
_SYNCING = {"_local_scalar_dense", "nonzero", "bincount", "masked_select", "_unique2", "unique_consecutive"}


class _HostReads(TorchDispatchMode):
    "The ops dispatched that would make a GPU's host wait (a small version of tests/cuda_sim.py's counter)."
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        mask = func is torch.ops.aten.index.Tensor and any(i is not None and i.dtype == torch.bool for i in args[1])
        ri = name == "repeat_interleave" and (kwargs or {}).get("output_size") is None and torch.is_tensor(args[0])
        if name in _SYNCING or mask or ri:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


for spec in (SbarSpec(tau=0.3, block_bytes=600), SbarSpec(region_sets=False, block_bytes=600)):
    for rv_all in (False, True):
        reg, rv, ph, nt = ragged_case(5, 6, seed=3)
        rv = rv | rv_all                                     # ragged_case has an image without a valid region
        out = []
        for facts in ({}, dict(counts=torch.bincount(nt, minlength=6).tolist(), all_valid=bool(rv.all()))):
            r, p = reg.clone().requires_grad_(), ph.clone().requires_grad_()
            with _HostReads() as seen:
                S = sbar_blocked(r, rv, p, nt, 6, spec, **facts)
                S.backward(torch.ones_like(S))
            out.append((S.detach(), r.grad, p.grad, seen.seen))
        assert out[1][3] == [] and out[0][3], out[0][3]     # with the host facts: nothing read back
        assert all(torch.equal(a, b) for a, b in zip(out[0][:3], out[1][:3]))
print("without host facts sbar_blocked dispatches", sorted(set(out[0][3])), "; with them, none")

# %% [markdown]
# The block plan at the budgets used above, for the record: one node of one row per block, and everything
# at once.

# %%
assert block_plan(5, 4, [1, 3, 2], 8, 1) == (1, [(0, 1, 0, 1), (1, 2, 1, 4), (2, 3, 4, 6)])
assert block_plan(5, 4, [1, 3, 2], 8, 10**9) == (5, [(0, 3, 0, 6)])
assert block_plan(2, 4, [1, 3, 2], 8, 2 * 4 * 8 * 4) == (2, [(0, 2, 0, 4), (2, 3, 4, 6)])

# %% [markdown]
# The budget per device, with the GPU's memory answered by hand (16, 80 and 141 GB: the lower bound, 1/128, the upper
# bound); the budget at the paper's size, in blocks, against 16 MiB:

# %%
assert device_block_bytes("cpu") == device_block_bytes(torch.device("cpu")) == CPU_BLOCK_BYTES == SbarSpec().block_bytes
for gb, mib in ((16, 256), (80, 596), (141, 1024)):
    props = SimpleNamespace(total_memory=gb * 10**9)
    with mock.patch.object(torch.cuda, "get_device_properties", lambda d, props=props: props):
        assert device_block_bytes("cuda:0") == mib << 20, (gb, device_block_bytes("cuda:0") >> 20)
_kp = (1 + torch.poisson(torch.full((4096,), 7.1), generator=_g)).long().tolist()   # about CC3M's mean of 8.1 nodes


def _n_blocks(Ci, counts, budget):
    rows, blocks = block_plan(Ci, 10, counts, 4, budget)
    return -(-Ci // rows) * len(blocks)


print({f"{b >> 20} MiB": _n_blocks(512, _kp, b) + _n_blocks(4096, _kp[:512], b) for b in (16 << 20, 596 << 20)},
      "blocks per loss call at R = 512, C = 4,096, M = 10, fp32 (both directions)")

# %% [markdown]
# `gradcheck` on the Function itself (finite differences, not the reference), and the local-row form of the
# loss: local images against all texts, all images against local texts, each block of rows against the
# gathered columns equals the same rows of the full matrix.

# %%
_reg, _rv, _ph, _nt = ragged_case(4, 4, M=3, D=5, Kmax=3, seed=7)
for spec in (SbarSpec(tau=0.3, block_bytes=200), SbarSpec(region_sets=False, block_bytes=200)):
    assert gradcheck(lambda r, p: sbar_blocked(r, _rv, p, _nt, 4, spec),
                     (_reg.clone().requires_grad_(), _ph.clone().requires_grad_()), eps=1e-6, atol=1e-6)

_reg, _rv, _ph, _nt = ragged_case(6, 6, seed=8)
_full = sbar_blocked(_reg, _rv, _ph, _nt, 6, SbarSpec(tau=0.1))
_loc = slice(2, 4)                                  # this process's rows
_lt = (_nt >= 2) & (_nt < 4)                        # its texts' nodes
# S_img (R, C)
assert_close(sbar_blocked(_reg[_loc], _rv[_loc], _ph, _nt, 6, SbarSpec(tau=0.1)), _full[_loc])
# S_txt (R, C)
assert_close(sbar_blocked(_reg, _rv, _ph[_lt], _nt[_lt] - 2, 2, SbarSpec(tau=0.1)).T, _full[:, _loc].T)

# %% [markdown]
# ## Stability at $\tau=10^{-3}$, float32 and bf16 autocast
#
# Scores of size up to $\sim 20$ (unnormalised phrases), $\tau=10^{-3}$: values and gradients stay finite in
# float32 and under bf16 autocast, float32 matches float64, and bf16 is close to float32 (its scores are
# rounded to 8 bits of mantissa before reduction, as in the dense path).

# %%
_reg, _rv, _ph, _nt = ragged_case(6, 8, M=10, D=32, Kmax=12, seed=9, scale=3.0)
_W = torch.randn(6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
_res = {}
for name, dtype, autocast in (("fp64", torch.float64, False), ("fp32", torch.float32, False),
                              ("bf16", torch.float32, True)):
    r, p = _reg.to(dtype, copy=True).requires_grad_(), _ph.to(dtype, copy=True).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        S = sbar_blocked(r, _rv, p, _nt, 8, SbarSpec(tau=1e-3, block_bytes=4096))
    (S * _W.to(S.dtype)).sum().backward()
    assert S.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert torch.isfinite(S).all() and torch.isfinite(r.grad).all() and torch.isfinite(p.grad).all(), name
    _res[name] = (S.detach().double(), r.grad.double(), p.grad.double())
for a, b in zip(_res["fp32"], _res["fp64"]):
    assert_close(a, b, rtol=1e-4, atol=1e-3)
_rel = lambda a, b: float((a - b).norm() / b.norm())
print("bf16 vs fp32 relative error: S %.1e, d regions %.1e, d phrases %.1e"
      % tuple(_rel(a, b) for a, b in zip(_res["bf16"], _res["fp32"])))
assert _rel(_res["bf16"][0], _res["fp32"][0]) < 2e-2


# %% [markdown]
# ## What is kept for backward
#
# `saved_tensor_bytes` counts, through `torch.autograd.graph.saved_tensors_hooks`, the bytes of every tensor
# autograd keeps for backward while a function runs (each storage once). For the blocked function that is
# the inputs and the $(C_i,C_j)$ log-sum-exp table, whatever $M$ and $K$; the benchmark uses the same counter
# on the whole loss.

# %%
#| export
@contextmanager
def saved_tensor_bytes():
    """with saved_tensor_bytes() as n: ...; n['bytes']: bytes of the distinct storages autograd saved for backward,
    n['storages']: {data_ptr: bytes} of each (to tell apart, e.g., the inputs a caller holds anyway)."""
    n = {"bytes": 0, "storages": {}}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in n["storages"]:
            n["storages"][s.data_ptr()] = s.nbytes()
            n["bytes"] += s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield n


# %%
def _saved(M, Kmax, Ci=4, Cj=16, D=8):
    reg, rv, ph, nt = ragged_case(Ci, Cj, M=M, D=D, Kmax=Kmax, seed=1, dtype=torch.float32)
    reg.requires_grad_()
    ph.requires_grad_()
    with saved_tensor_bytes() as n:
        sbar_blocked(reg, rv, ph, nt, Cj, SbarSpec(block_bytes=1024))
    inputs = sum(t.untyped_storage().nbytes() for t in (reg, rv, ph, nt))
    return n["bytes"] - inputs

assert _saved(5, 4) == _saved(32, 40) == 4 * 16 * 4  # beyond the inputs: the (Ci, Cj) float32 LSE table only

# %% [markdown]
# ## Cost: the Fig. 9 analogue
#
# `benchmarks/powerset_scale.py` times forward + backward of the whole loss (`powerclip_loss` in its
# local-row form: $R$ local rows against $C$ gathered columns) and counts what it keeps for backward, for the
# blocked path, the dense path of `10_powerset` and the CLIP loss alone, over $R$, $C$, $M$, with node counts
# drawn from real parsed CC3M captions, each configuration in a fresh process. The plot below reads its
# committed results; the numbers and the machine are in `benchmarks/results/powerset_scale_cpu.md`.
#
# What to look for: the dense path's saved memory grows linearly with $M$ (and with $K_{\max}$); the fast
# path's grows only with its inputs, the regions $(C, M, D)$ it receives, and beyond them stays a few
# $(R, C)$ tables. The exact path runs out of the memory budget after $M=5$, as the paper's does after
# $M=7$ (Fig. 9). The fast path's time still grows with $M$ (it does $O(RCM\bar K)$ work, as any NLA must),
# but with the mean node count $\bar K$ instead of $K_{\max}$.

# %%
_bench = next((p for p in (Path("../benchmarks/results/powerset_scale_cpu.json"),
                            Path("benchmarks/results/powerset_scale_cpu.json")) if p.exists()), None)
if _bench is None:
    print("no benchmarks/results/powerset_scale_cpu.json yet: run `python benchmarks/powerset_scale.py`")
else:
    import matplotlib.pyplot as plt
    _data = json.loads(_bench.read_text())
    _rows = [r for r in _data["rows"] if r.get("ok") and r["precision"] == "fp32"]
    _RC = sorted({(r["R"], r["C"]) for r in _rows})
    fig, ax = plt.subplots(2, len(_RC), figsize=(3.2 * len(_RC), 5.6), squeeze=False)
    for col, (R, C) in enumerate(_RC):
        for impl, style in (("fast", "o-"), ("dense", "s--"), ("exact", "^:"), ("clip", "k-")):
            pts = sorted((r["M"], r) for r in _rows if (r["R"], r["C"], r["impl"]) == (R, C, impl))
            if not pts:
                continue
            Ms = [m for m, _ in pts]
            ax[0, col].plot(Ms, [r["time_s"] * 1e3 for _, r in pts], style, label=impl)
            ax[1, col].plot(Ms, [r["saved_bytes"] / 2**20 for _, r in pts], style, label=impl)
            if impl == "fast":
                ax[1, col].plot(Ms, [r["saved_other_bytes"] / 2**20 for _, r in pts], "o:", color="C0", alpha=0.6,
                                label="fast, beyond inputs")
        ax[0, col].set(title=f"R={R}, C={C}", yscale="log", xlabel="regions M")
        ax[1, col].set(yscale="log", xlabel="regions M")
    ax[0, 0].set_ylabel("fwd+bwd time (ms)")
    ax[1, 0].set_ylabel("saved for backward (MiB)")
    ax[0, 0].legend(fontsize=8)
    ax[1, 0].legend(fontsize=8)
    fig.suptitle(f"powerset loss cost, fp32 ({_data['meta']['machine']})", fontsize=10)
    fig.tight_layout()
    plt.show()
    _get = lambda impl, M: next(r for r in _rows if (r["impl"], r["R"], r["C"], r["M"]) == (impl, 64, 512, M))
    print("R=64, C=512: dense / fast time at M=10 = %.1fx; fast saved at M=32 / M=5 = %.2fx beyond the inputs, "
          "%.2fx with them" % (_get("dense", 10)["time_s"] / _get("fast", 10)["time_s"],
                               _get("fast", 32)["saved_other_bytes"] / _get("fast", 5)["saved_other_bytes"],
                               _get("fast", 32)["saved_bytes"] / _get("fast", 5)["saved_bytes"]))
