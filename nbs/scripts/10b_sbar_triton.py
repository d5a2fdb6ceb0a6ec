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
#| default_exp sbar_triton

# %%
#| export
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from powerclip.powerset_fast import (NLA_T1_GRADS, NLA_T2_ACTS, SbarSpec, check_counts, node_counts, ragged_case,
                                     sbar_dense)

try:
    import triton
    import triton.language as tl
except ImportError:            # the package works without triton: impl='triton' then says so in one line
    triton = None

# %%
#| hide
# Without a GPU the kernels run in Triton's interpreter, on CPU tensors (slow, exact enough for tests). The variable is
# read when a kernel is defined: it is set here, before the cells below define them (tests/conftest.py does the same).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode

from powerclip.powerset_fast import sbar_blocked

# %% [markdown]
# # $\bar S$ as fused Triton kernels
#
# > The powerset similarity of every image against every text in three kernels that never write the scores: a forward
# > with a per-text online log-sum-exp, and two backward kernels that recompute the scores and each own their output.
#
# `10a_powerset_fast` made the memory of $\bar S$ independent of $M\times K$: scores are computed block by block and
# recomputed in the backward pass. On a GPU that path is slow for another reason. At the paper's per-GPU scale ($R=512$
# local images against $C=4096$ gathered captions, $M=10$ regions, CC3M's node counts: about 33,000 tree nodes), one
# NVIDIA H200 took **114 ms** for the loss's forward and backward, against 2.5 ms for CLIP's loss
# (`benchmarks/results/gpu_nvidia_h200/`, from the repository's GPU check). The arithmetic is about 1.4 TFLOP, two
# milliseconds of that GPU: the time went to dispatch, about 7,500 small PyTorch operations (segment sums through
# `index_add_`, a segment log-sum-exp of nine kernels, a block loop) and host synchronisations.
#
# This notebook writes the same $\bar S$ as three [Triton](https://triton-lang.org) kernels. Triton programs are
# written once per *tile*: a block of image rows against a block of nodes, with the matrix product on the tensor cores
# and everything after it (activations, sums over regions, sums and log-sum-exps over each text's nodes) in registers.
# `10a`'s blocked path stays the fallback on the CPU and the reference the kernels are tested against, together with
# `10_powerset`'s dense float64 reference.
#
# ## What one forward program computes
#
# Recall (`10_powerset`, `10a`) the per-region, per-node score $q_{imp}=\langle\phi_m^{(i)},p_p\rangle$ of image $i$,
# region $m$ and tree node $p$ (nodes are *packed*: the nodes of text $j$ are the contiguous range
# $[s_j, s_{j+1})$ of the $P$ nodes, $K_j=s_{j+1}-s_j$), $z=q/\tau$, and only valid regions $m\in V_i$, $M_i=|V_i|$:
#
# $$\bar S_{ij}=\underbrace{\frac{1}{K_j}\sum_{p\in j}\sum_{m\in V_i}\tau\,\mathrm{Act}_1(z_{imp})}_{\text{NLA-T1}}
#   \;+\;\underbrace{\tau\Big(\log\sum_{p\in j} e^{\,s_{ip}} - (1-\alpha)\log K_j\Big)}_{\text{NLA-T2 (R2T)}},
# \qquad s_{ip}=\sum_{m\in V_i}\zeta_\alpha\!\Big(\frac{q_{imp}}{2\tau}\Big).$$
#
# A forward program owns a tile of $B_R$ images and a *group* of $B_J$ consecutive texts. Its image rows are loaded
# once as a $(B_R B_M)\times D$ tile ($B_M$: $M$ rounded up to a power of two, the padding masked), so that one matrix
# product gives the scores of every region of those images at once. It then walks the group's nodes in chunks of $B_P$
# (a loop whose bounds $s_{j_0}$ and $s_{j_0+B_J}$ it reads from memory: texts are ragged, so a chunk may hold the end
# of one text and the start of the next, and a long text spans several chunks). The chunks start at multiples of
# $B_P$ in the packed node order, not at the group's first node (the nodes of a chunk outside the group are masked):
# every kernel, forward and backward, then computes the score of a given image and node in the same tile position of
# a product of the same shape, and so gets the same bits. That matters more than it seems: at $\tau=10^{-3}$,
# $s_{ip}$ is of order $M\cdot|q|/2\tau\approx 10^4$, where one float32 rounding is $10^{-3}$, and the backward's
# softmax weight $e^{s_{ip}-\mathrm{LSE}_{ij}}$ is only right if its recomputed $s_{ip}$ is bitwise the forward's. (A
# first version aligned the chunks to each group; on `10a`'s stability case below its gradients were off by 8 %.)
# For each chunk:
#
# 1. $q = A\,P_c^\top$, a $(B_R B_M)\times B_P$ product (fp32 accumulation; inputs in the training's precision);
# 2. per node, the sums over regions: $\sum_m\tau\mathrm{Act}_1(z)$ and $s_{ip}=\sum_m\zeta_\alpha(z/2)$ (a reshape
#    to $B_R\times B_M\times B_P$ and a sum over the middle axis);
# 3. per text, the chunk's contribution: node $p$ belongs to slot $j(p)-j_0$ of the group, and a one-hot
#    $B_P\times B_J$ mask turns "sum over the text's nodes" into a masked sum over the chunk axis;
# 4. the log-sum-exp **online**, as FlashAttention's softmax: each text keeps its running maximum $\mu_{ij}$ and sum
#    $\ell_{ij}=\sum_p e^{s_{ip}-\mu_{ij}}$; a chunk with a larger maximum $\mu'$ rescales the sum by
#    $e^{\mu-\mu'}$ before adding its own terms. The maximum is each *text's* own (exact per segment), not the
#    chunk's: at $\tau=10^{-3}$ the values $s$ of different texts differ by hundreds, and a shared shift would
#    underflow the smaller texts to $\log 0$.
#
# At the end the program writes $\bar S$ for its tile and $\mathrm{LSE}_{ij}=\mu_{ij}+\log\ell_{ij}$, which the
# backward pass needs; nothing of size rows $\times$ regions $\times$ nodes ever reaches memory.
#
# **Without region sets** (Table 6's ablation: single regions, hard maxima) the T2R term is the mean over nodes of
# $\max_{m\in V_i} q$, and the R2T term the mean over valid regions of $\max_{p\in j} q$. The latter is a maximum per
# (image, region, text) across chunks; the program keeps it online too, with the number of nodes that attain it
# (ties share the gradient evenly, as torch's `amax` and `10a` share it) and the first node that does (its index in
# the packed order), and writes the three, $C_i\times M\times C_j$ tensors: still no nodes axis.
#
# **Why the argmax is kept.** A maximum is not smooth: its gradient goes to whichever node attains it, so the
# backward must pick the same node as the forward. Recomputing the scores and comparing them with the saved maximum
# picks it only if the recomputed score is the forward's bit for bit. The kernels are written so that it is (same
# tile shapes and positions, above), but the backward kernels run with another launch configuration (8 warps, the
# forward 4), and on a GPU the number of warps decides how a product is laid out over the tensor cores and may change
# its rounding; one unit in the last place less and the node's gradient would vanish. So the backward sends the
# gradient to the forward's saved argmax by its index, as fused MaxSim (late-interaction) kernels do, and compares
# scores only for exact ties (count above 1): there the tied nodes are duplicates of one another, each computed in
# the same tile position by the same instructions, hence equal to each other in any configuration. Their shares
# still come from the forward's count; only where the backward's product rounds a tie differently from the forward's
# can a tied node other than the first miss its share (never a non-maximal node receive one). The T2R maximum over
# an image's regions needs none of this: all of an image's regions lie in one tile, so the backward finds the best
# region(s) and their count in its own recomputed tile, consistently, and the gradient $G_{ij}/K_j$ of each node is
# always delivered in full, to regions that are maximal in the backward's rounding.

# %% [markdown]
# ## The activations, in Triton
#
# Each is the one of `10_powerset` (`NLA_T1_ACTS`, `NLA_T2_INTEGRALS`) and its derivative that of `10a`
# (`NLA_T1_GRADS`, `NLA_T2_ACTS`), written to be overflow-free in float32 for any score: $\mathrm{softplus}(x) =
# \max(x,0)+\log(1+e^{-|x|})$, $\sigma(x)$ from $e^{-|x|}$ only. The tests below compare the whole $\bar S$ and its
# gradients with the float64 references for every activation.

# %%
#| export
_T1 = {"softplus": 0, "relu": 1, "gelu": 2, "swish": 3}     # NLA_T1_ACTS keys, as the kernels' constants
_T2 = {"tanh": 0, "sigmoid": 1, "softsign": 2}              # NLA_T2_INTEGRALS keys
assert set(_T1) == set(NLA_T1_GRADS) and set(_T2) == set(NLA_T2_ACTS)

if triton is not None:
    # sums and maxima through tl.reduce with triton.language's own combine functions: the interpreter recognises
    # them and reduces with numpy, where any other combine function is called element by element; and unlike tl.sum
    # and tl.max, which are jit functions made when triton was imported, they are never called by the interpreter,
    # so the kernels also run when TRITON_INTERPRET was set after triton's import
    _SUM, _MAX, _MIN = tl.standard._sum_combine, tl.standard._elementwise_max, tl.standard._elementwise_min

    @triton.jit
    def _softplus(x):
        "log(1 + e^x) = max(x, 0) + log(1 + e^-|x|): no overflow."
        return tl.maximum(x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x)))

    @triton.jit
    def _sigmoid(x):
        "1 / (1 + e^-x) from e^-|x| only."
        e = tl.exp(-tl.abs(x))
        return tl.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))

    @triton.jit
    def _t1(q, tau, T1: tl.constexpr):
        "tau * Act_1(q / tau) (NLA_T1_ACTS)."
        z = q / tau
        if T1 == 0:
            out = tau * _softplus(z)
        elif T1 == 1:
            out = tl.maximum(q, 0.0)
        elif T1 == 2:
            out = q * 0.5 * (1.0 + tl.erf(z * 0.7071067811865476))      # tau * z * Phi(z)
        else:
            out = q * _sigmoid(z)                                        # tau * z * sigmoid(z)
        return out

    @triton.jit
    def _t1_grad(q, tau, T1: tl.constexpr):
        "d/dq tau * Act_1(q / tau) = Act_1'(q / tau) (NLA_T1_GRADS)."
        z = q / tau
        if T1 == 0:
            out = _sigmoid(z)
        elif T1 == 1:
            out = tl.where(q > 0, 1.0, 0.0)                              # torch's relu'(0) = 0
        elif T1 == 2:
            out = 0.5 * (1.0 + tl.erf(z * 0.7071067811865476)) + z * tl.exp(-0.5 * z * z) * 0.3989422804014327
        else:
            s = _sigmoid(z)
            out = s * (1.0 + z * (1.0 - s))
        return out

    @triton.jit
    def _zeta(q, tau, alpha, T2: tl.constexpr):
        "zeta_alpha(x) = x + alpha * I(x) at x = q / (2 tau); I of NLA_T2_INTEGRALS, I(0) = 0."
        x = q / (2.0 * tau)
        a = tl.abs(x)
        if T2 == 0:
            integral = a + _softplus(-2.0 * a) - 0.6931471805599453     # log cosh x
        elif T2 == 1:
            integral = _softplus(x) - 0.6931471805599453
        else:
            integral = a - tl.log(1.0 + a)
        return x + alpha * integral

    @triton.jit
    def _zeta_grad(q, tau, alpha, T2: tl.constexpr):
        "tau * d/dq zeta_alpha(q / 2tau) = (1 + alpha * Act_2(q / 2tau)) / 2 (NLA_T2_ACTS)."
        x = q / (2.0 * tau)
        if T2 == 0:
            act = 2.0 * _sigmoid(2.0 * x) - 1.0                          # tanh x
        elif T2 == 1:
            act = _sigmoid(x)
        else:
            act = x / (1.0 + tl.abs(x))
        return 0.5 * (1.0 + alpha * act)

# %% [markdown]
# ## The forward kernel
#
# The grid is (image tiles) $\times$ (text groups). Shapes in the comments: `BRM` $=B_RB_M$ rows of the region tile,
# `BP` nodes of a chunk, `BJ` texts of a group, `BD` the embedding width rounded up to a power of two. `_region_tile`
# is shared with the backward kernels: row $k$ of the tile is region $k \bmod B_M$ of image $r_0+\lfloor k/B_M\rfloor$.
# Matrix products of float32 inputs run with `input_precision="ieee"`: a GPU's default for float32 is TF32, whose
# 10-bit mantissa would miss float32 parity by orders of magnitude; bf16 and fp16 inputs use the tensor cores as they
# are, with float32 accumulation.

# %%
#| export
if triton is not None:
    @triton.jit
    def _region_tile(reg_ptr, rv_ptr, r0, R, M, D, BR: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr):
        "Images r0 .. r0+BR as a (BR*BM, BD) tile of regions, with each row's validity, mask, image and region."
        k = tl.arange(0, BR * BM)
        rk = r0 + k // BM                                                    # (BRM,) image of the row
        mk = k % BM                                                          # (BRM,) region of the row
        dd = tl.arange(0, BD)
        kmask = (rk < R) & (mk < M)
        valid = tl.load(rv_ptr + rk * M + mk, mask=kmask, other=0) != 0
        a = tl.load(reg_ptr + (rk * M + mk)[:, None] * D + dd[None, :], mask=kmask[:, None] & (dd[None, :] < D),
                    other=0.0)                                               # (BRM, BD)
        return a, valid, kmask, rk, mk

    @triton.jit
    def _mm(x, y, PREC: tl.constexpr):
        "x @ y, float32 accumulation: PREC 'ieee' (float32 inputs), None (bf16 / fp16), 'widen' (see _precision)."
        if PREC == "widen":
            out = tl.dot(x.to(tl.float32), y.to(tl.float32), input_precision="ieee")
        else:
            out = tl.dot(x, y, input_precision=PREC)
        return out

    @triton.jit
    def _node_tile(ph_ptr, offs, pm, D, BD: tl.constexpr):
        "Nodes `offs` (masked by `pm`) as a (BP, BD) tile."
        dd = tl.arange(0, BD)
        return tl.load(ph_ptr + offs[:, None] * D + dd[None, :], mask=pm[:, None] & (dd[None, :] < D), other=0.0)

    @triton.jit
    def _valid_per_image(rv_ptr, r0, R, M, BR: tl.constexpr, BM: tl.constexpr):
        "(BR,) M_i: valid regions of images r0 .. r0+BR."
        rows = r0 + tl.arange(0, BR)
        mm = tl.arange(0, BM)
        v = tl.load(rv_ptr + rows[:, None] * M + mm[None, :], mask=(rows[:, None] < R) & (mm[None, :] < M), other=0)
        return tl.reduce(tl.where(v != 0, 1.0, 0.0), 1, _SUM)

    @triton.jit
    def _sbar_fwd_kernel(reg_ptr, rv_ptr, ph_ptr, nt_ptr, st_ptr, s_ptr, lse_ptr, xm_ptr, xn_ptr, xi_ptr,
                         R, C, P, M, D, tau, alpha,
                         T1: tl.constexpr, T2: tl.constexpr, USE_T2R: tl.constexpr, USE_R2T: tl.constexpr,
                         SETS: tl.constexpr, DEBIAS: tl.constexpr, PREC: tl.constexpr,
                         BR: tl.constexpr, BM: tl.constexpr, BP: tl.constexpr, BJ: tl.constexpr, BD: tl.constexpr):
        r0 = tl.program_id(0) * BR
        j0 = tl.program_id(1) * BJ
        a, valid, kmask, rk, mk = _region_tile(reg_ptr, rv_ptr, r0, R, M, D, BR, BM, BD)
        Mi = _valid_per_image(rv_ptr, r0, R, M, BR, BM)                          # (BR,)
        jj = tl.arange(0, BJ)
        js = j0 + jj                                                             # (BJ,) the group's texts
        jmask = js < C
        Kj = (tl.load(st_ptr + js + 1, mask=jmask, other=1) - tl.load(st_ptr + js, mask=jmask, other=0))
        Kj = Kj.to(tl.float32)                                                   # (BJ,) nodes per text
        p_lo = tl.load(st_ptr + j0)
        p_hi = tl.load(st_ptr + tl.minimum(j0 + BJ, C))
        pp = tl.arange(0, BP)
        t2r = tl.full((BR, BJ), 0.0, tl.float32)                               # sum over nodes of the T1 sums
        run_m = tl.full((BR, BJ), float("-inf"), tl.float32)                     # online LSE: running max ...
        run_l = tl.full((BR, BJ), 0.0, tl.float32)                             # ... and sum of e^(s - max)
        x_m = tl.full((BR * BM, BJ), float("-inf"), tl.float32)                  # no sets: max over the text's nodes
        x_n = tl.full((BR * BM, BJ), 0.0, tl.float32)                          # ... how many attain it
        x_i = tl.full((BR * BM, BJ), -1, tl.int32)                               # ... and the first that does
        for c0 in range(p_lo // BP * BP, p_hi, BP):                             # chunks at multiples of BP
            offs = c0 + pp
            pm = (offs >= p_lo) & (offs < p_hi)
            slot = tl.load(nt_ptr + offs, mask=pm, other=-1) - j0
            oh = (slot[:, None] == jj[None, :]) & pm[:, None]                    # (BP, BJ) node -> text of the group
            q = _mm(a, tl.trans(_node_tile(ph_ptr, offs, pm, D, BD)), PREC)                     # (BRM, BP)
            vq = valid[:, None] & pm[None, :]
            if SETS:
                if USE_T2R:
                    n1 = tl.reduce(tl.reshape(tl.where(vq, _t1(q, tau, T1), 0.0), (BR, BM, BP)), 1, _SUM)   # (BR, BP)
                    t2r += tl.reduce(tl.where(oh[None, :, :], n1[:, :, None], 0.0), 1, _SUM)
                if USE_R2T:
                    s2 = tl.reduce(tl.reshape(tl.where(vq, _zeta(q, tau, alpha, T2), 0.0), (BR, BM, BP)), 1, _SUM)
                    cm = tl.reduce(tl.where(oh[None, :, :], s2[:, :, None], float("-inf")), 1, _MAX)        # (BR, BJ)
                    new = tl.maximum(run_m, cm)
                    shift = tl.where(new == float("-inf"), 0.0, run_m - tl.where(new == float("-inf"), 0.0, new))
                    node_m = tl.reduce(tl.where(oh[None, :, :], new[:, None, :], 0.0), 2, _SUM)            # (BR, BP)
                    e = tl.where(pm[None, :], tl.exp(tl.maximum(s2 - node_m, -80.0)), 0.0)
                    run_l = run_l * tl.exp(shift) + tl.reduce(tl.where(oh[None, :, :], e[:, :, None], 0.0), 1, _SUM)
                    run_m = new
            else:
                if USE_T2R:
                    best = tl.reduce(tl.reshape(tl.where(valid[:, None], q, float("-inf")), (BR, BM, BP)), 1, _MAX)
                    best = tl.where((Mi[:, None] > 0) & pm[None, :], best, 0.0)                       # (BR, BP)
                    t2r += tl.reduce(tl.where(oh[None, :, :], best[:, :, None], 0.0), 1, _SUM)
                if USE_R2T:
                    cm = tl.reduce(tl.where(oh[None, :, :], q[:, :, None], float("-inf")), 1, _MAX)        # (BRM, BJ)
                    node_m = tl.reduce(tl.where(oh[None, :, :], cm[:, None, :], 0.0), 2, _SUM)             # (BRM, BP)
                    at = oh[None, :, :] & (q == node_m)[:, :, None]                  # (BRM, BP, BJ) the chunk's maxima
                    ties = tl.reduce(tl.where(at, 1.0, 0.0), 1, _SUM)
                    first = tl.reduce(tl.where(at, offs[None, :, None], P), 1, _MIN).to(tl.int32)   # (BRM, BJ)
                    new = tl.maximum(x_m, cm)
                    x_n = tl.where(x_m == new, x_n, 0.0) + tl.where(cm == new, ties, 0.0)
                    x_i = tl.where((x_m == new) & (x_i >= 0), x_i, tl.where(cm == new, first, x_i))
                    x_m = new
        rows = r0 + tl.arange(0, BR)
        out = (rows < R)[:, None] & jmask[None, :]
        S = tl.full((BR, BJ), 0.0, tl.float32)
        if USE_T2R:
            S += t2r / Kj[None, :]
        if USE_R2T:
            if SETS:
                lse = run_m + tl.log(tl.where(out, run_l, 1.0))
                S += tau * (lse - (1.0 - alpha) * tl.log(Kj)[None, :])
                if DEBIAS:
                    S += (tau * alpha * 0.6931471805599453) * Mi[:, None]
                tl.store(lse_ptr + rows[:, None] * C + js[None, :], lse, mask=out)
            else:
                best = tl.reduce(tl.reshape(tl.where(valid[:, None], x_m, 0.0), (BR, BM, BJ)), 1, _SUM)   # (BR, BJ)
                S += best / tl.maximum(Mi, 1.0)[:, None]
                xo = (rk * M + mk)[:, None] * C + js[None, :]                    # (BRM, BJ) into (R, M, C)
                tl.store(xm_ptr + xo, x_m, mask=kmask[:, None] & jmask[None, :])
                tl.store(xn_ptr + xo, x_n, mask=kmask[:, None] & jmask[None, :])
                tl.store(xi_ptr + xo, x_i, mask=kmask[:, None] & jmask[None, :])
        tl.store(s_ptr + rows[:, None] * C + js[None, :], S, mask=out)

# %% [markdown]
# ## The backward kernels
#
# Given $G=\partial L/\partial\bar S$, the gradient with respect to each score is the one `10a` derives, now per
# (image, region, node) of a recomputed tile; with $j=j(p)$ the text of node $p$:
#
# $$\frac{\partial L}{\partial q_{imp}} = [m\in V_i]\Big(\frac{G_{ij}}{K_j}\,\mathrm{Act}_1'(z_{imp})
#   + \pi_{ip}\,G_{ij}\,\tfrac12\big(1+\alpha\,\mathrm{Act}_2(z_{imp}/2)\big)\Big),
# \qquad \pi_{ip} = e^{\,s_{ip}-\mathrm{LSE}_{ij}},$$
#
# the softmax weight of node $p$ within its text, from the saved $\mathrm{LSE}$ and the recomputed $s_{ip}$ (a sum
# over all regions of image $i$: every tile holds all of an image's regions for this reason). Without region sets the
# two hard maxima pass $G_{ij}/K_j$ to the best region(s) of each node and $G_{ij}/M_i$ to the best node(s) of each
# (region, text), ties evenly: for the nodes, the forward's saved argmax, maxima and counts say which (above).
#
# Then $\partial L/\partial\phi_m^{(i)} = \sum_p \delta_{imp}\,p_p$ and $\partial L/\partial p_p =
# \sum_{i,m}\delta_{imp}\,\phi_m^{(i)}$. Each gradient is written by programs that **own** its rows, so no two
# programs add into the same memory (no atomics, a deterministic sum order):
#
# * `_sbar_bwd_regions`: a program per image tile loops over all nodes in chunks, recomputes $q$ and $\delta$, and
#   accumulates $\delta P_c$ into its $(B_RB_M)\times D$ region gradient;
# * `_sbar_bwd_nodes`: a program per chunk of nodes loops over all image tiles and accumulates $\delta^\top A$ into its
#   $B_P\times D$ node gradient.
#
# The price is computing the scores three times (forward and each backward kernel) and $\delta$ twice; they are
# products of tiles already in fast memory, which is what the blocked path could not exploit.

# %%
#| export
if triton is not None:
    @triton.jit
    def _dscores(q, valid, rk, mk, offs, pm, Mi, nt_ptr, st_ptr, g_ptr, lse_ptr, xm_ptr, xn_ptr, xi_ptr, R, C, M,
                 tau, alpha,
                 T1: tl.constexpr, T2: tl.constexpr, USE_T2R: tl.constexpr, USE_R2T: tl.constexpr,
                 SETS: tl.constexpr, BR: tl.constexpr, BM: tl.constexpr, BP: tl.constexpr):
        "delta = dL/dq (BRM, BP) of a recomputed tile: images rk, regions mk (their M_i: Mi (BR,)), nodes offs."
        j = tl.load(nt_ptr + offs, mask=pm, other=0)                                 # (BP,) text of each node
        Kn = (tl.load(st_ptr + j + 1, mask=pm, other=1) - tl.load(st_ptr + j, mask=pm, other=0)).to(tl.float32)
        gm = (rk < R)[:, None] & pm[None, :]
        go = rk[:, None] * C + j[None, :]                                            # (BRM, BP) into (R, C)
        G = tl.load(g_ptr + go, mask=gm, other=0.0)
        vq = valid[:, None] & pm[None, :]
        d = tl.full((BR * BM, BP), 0.0, tl.float32)
        if SETS:
            if USE_T2R:
                d += _t1_grad(q, tau, T1) * (G / Kn[None, :])
            if USE_R2T:
                s2 = tl.reduce(tl.reshape(tl.where(vq, _zeta(q, tau, alpha, T2), 0.0), (BR, BM, BP)), 1, _SUM)
                s2 = tl.reshape(tl.broadcast_to(s2[:, None, :], (BR, BM, BP)), (BR * BM, BP))  # each region's row
                pi = tl.exp(tl.maximum(s2 - tl.load(lse_ptr + go, mask=gm, other=0.0), -80.0))
                d += _zeta_grad(q, tau, alpha, T2) * pi * G
        else:
            if USE_T2R:
                qm = tl.where(valid[:, None], q, float("-inf"))
                best = tl.reduce(tl.reshape(qm, (BR, BM, BP)), 1, _MAX)                    # (BR, BP)
                hit = vq & (qm == tl.reshape(tl.broadcast_to(best[:, None, :], (BR, BM, BP)), (BR * BM, BP)))
                nh = tl.reduce(tl.reshape(tl.where(hit, 1.0, 0.0), (BR, BM, BP)), 1, _SUM)
                nh = tl.reshape(tl.broadcast_to(nh[:, None, :], (BR, BM, BP)), (BR * BM, BP))
                d += tl.where(hit, G / Kn[None, :] / tl.maximum(nh, 1.0), 0.0)
            if USE_R2T:
                Mk = tl.reshape(tl.broadcast_to(Mi[:, None], (BR, BM)), (BR * BM,))     # (BRM,) M_i of the row
                xo = (rk * M + mk)[:, None] * C + j[None, :]
                ties = tl.load(xn_ptr + xo, mask=vq, other=1.0)
                hit = vq & (offs[None, :] == tl.load(xi_ptr + xo, mask=vq, other=-1))     # the forward's argmax
                hit = hit | (vq & (ties > 1.0) & (q == tl.load(xm_ptr + xo, mask=vq, other=float("inf"))))
                d += tl.where(hit, G / tl.maximum(Mk, 1.0)[:, None] / ties, 0.0)
        return tl.where(vq, d, 0.0)

    @triton.jit
    def _sbar_bwd_regions(reg_ptr, rv_ptr, ph_ptr, nt_ptr, st_ptr, g_ptr, lse_ptr, xm_ptr, xn_ptr, xi_ptr, out_ptr,
                          R, C, P, M, D, tau, alpha,
                          T1: tl.constexpr, T2: tl.constexpr, USE_T2R: tl.constexpr, USE_R2T: tl.constexpr,
                          SETS: tl.constexpr, PREC: tl.constexpr,
                          BR: tl.constexpr, BM: tl.constexpr, BP: tl.constexpr, BD: tl.constexpr):
        r0 = tl.program_id(0) * BR
        a, valid, kmask, rk, mk = _region_tile(reg_ptr, rv_ptr, r0, R, M, D, BR, BM, BD)
        Mi = _valid_per_image(rv_ptr, r0, R, M, BR, BM)
        pp = tl.arange(0, BP)
        acc = tl.full((BR * BM, BD), 0.0, tl.float32)                              # this tile's region gradient
        for c0 in range(0, P, BP):
            offs = c0 + pp
            pm = offs < P
            ph = _node_tile(ph_ptr, offs, pm, D, BD)
            q = _mm(a, tl.trans(ph), PREC)
            d = _dscores(q, valid, rk, mk, offs, pm, Mi, nt_ptr, st_ptr, g_ptr, lse_ptr, xm_ptr, xn_ptr, xi_ptr,
                         R, C, M, tau, alpha, T1, T2, USE_T2R, USE_R2T, SETS, BR, BM, BP)
            acc += _mm(d.to(ph.dtype), ph, PREC)
        dd = tl.arange(0, BD)
        tl.store(out_ptr + (rk * M + mk)[:, None] * D + dd[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=kmask[:, None] & (dd[None, :] < D))

    @triton.jit
    def _sbar_bwd_nodes(reg_ptr, rv_ptr, ph_ptr, nt_ptr, st_ptr, g_ptr, lse_ptr, xm_ptr, xn_ptr, xi_ptr, out_ptr,
                        R, C, P, M, D, tau, alpha,
                        T1: tl.constexpr, T2: tl.constexpr, USE_T2R: tl.constexpr, USE_R2T: tl.constexpr,
                        SETS: tl.constexpr, PREC: tl.constexpr,
                        BR: tl.constexpr, BM: tl.constexpr, BP: tl.constexpr, BD: tl.constexpr):
        offs = tl.program_id(0) * BP + tl.arange(0, BP)
        pm = offs < P
        ph = _node_tile(ph_ptr, offs, pm, D, BD)
        acc = tl.full((BP, BD), 0.0, tl.float32)                                   # this chunk's node gradient
        for r0 in range(0, R, BR):
            a, valid, kmask, rk, mk = _region_tile(reg_ptr, rv_ptr, r0, R, M, D, BR, BM, BD)
            Mi = _valid_per_image(rv_ptr, r0, R, M, BR, BM)
            q = _mm(a, tl.trans(ph), PREC)
            d = _dscores(q, valid, rk, mk, offs, pm, Mi, nt_ptr, st_ptr, g_ptr, lse_ptr, xm_ptr, xn_ptr, xi_ptr,
                         R, C, M, tau, alpha, T1, T2, USE_T2R, USE_R2T, SETS, BR, BM, BP)
            acc += _mm(tl.trans(d.to(a.dtype)), a, PREC)
        dd = tl.arange(0, BD)
        tl.store(out_ptr + offs[:, None] * D + dd[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=pm[:, None] & (dd[None, :] < D))


# %% [markdown]
# ## Tiles, the op, and when it can run
#
# **Tile sizes.** `Tiles` holds them: `rows` is $B_RB_M$, the region rows of a tile ($B_R = $ `rows` $/B_M$ images,
# at least one), `nodes` $B_P$, `texts` $B_J$. `default_tiles` picks them by dtype and spec: sizes that compile for
# an H100/H200 (sm_90) without spilling registers to memory at the paper's $M=10$, $D=512$, which this machine can
# check without a GPU, since Triton compiles ahead of time with the `ptxas` it ships (`compile_report`, below, and
# `benchmarks/sbar_triton_compile.py`). Which of them is fastest needs a GPU: the GPU check's paths part times them.
# Tests use small tiles so that texts cross chunk and group boundaries.
#
# **On the H200.** The kernels' first GPU run (one NVIDIA H200, bf16, default tiles;
# `benchmarks/results/gpu_nvidia_h200_2026-11-28/`) agreed with float64 in every parity row (170 of 170, the
# ablation's "w/o region sets" rows too) and made no host sync, but was not fast. The loss's forward and backward at
# $R=512$ against $C=4096$ with CC3M node counts took 34.5 / 62.0 / 62.8 ms at $M=5$ / 10 / 15 (1.6 / 1.7 / 2.6 % of
# the card's bf16 peak on the useful products, about 5-8 G scores/s), with 16 nodes per caption 62.4 / 113.5 /
# 114.5 ms; the blocked path at the device's budget took 22.4 / 33.6 / 47.2 ms (CC3M) and 32.4 / 51.3 / 69.4 ms
# (16 nodes), faster everywhere, so `impl='auto'` takes it (`11_loss`, *Which path on a GPU*), and the 5 ms target
# is far. Two readings of the table: the time follows $B_M$, $M$ rounded up to a power of two, not $M$ ($M=10$
# and 15 cost the same: at $M=10$ 6 of each image's 16 region rows are padding), and it doubles with the nodes: it
# grows with the number of tiles, each a small product ($32\times32$ by default in bf16) and its activations.
# What the next GPU run should try: a sweep of `Tiles` (rows 64 - 128, nodes 64 - 128, warps 4 / 8, stages) at
# $M=10$, and then a `triton.autotune` over the few that compile without spills; $B_M$ without the power-of-two
# padding (two images' regions sharing rows); and the split of the time between the forward and the two backward
# kernels, which this run did not measure (it timed the whole loss only; a profile of one call would say).
#
# **One op.** `sbar_triton` wraps the kernels in `torch.library.custom_op`s, a forward `powerclip::sbar_fwd` and a
# backward `powerclip::sbar_bwd`, with fake implementations that give only shapes: `torch.compile` then keeps the
# loss in one graph without tracing into Triton, and the autograd formula registered for the forward calls the
# backward op. The wrapper does in PyTorch only what is not arithmetic on the scores: the casts to the autocast
# dtype (as `10a` does), the text boundaries $s_j$ from the sorted `node_text` (`torch.searchsorted`, no host
# synchronisation) and the output buffers. The texts are trusted to have at least one node each (a text without nodes
# would give $K_j=0$, a division by zero): `10a`'s checks read the node counts back to the host, which this path is
# built to avoid; the batch builder guarantees a root node per caption.
#
# **Where it runs.** On CUDA tensors, where `triton` imports; on CPU tensors only under Triton's interpreter
# (`TRITON_INTERPRET=1` set before `powerclip` is imported, as the tests do). `unavailable(x)` says in one line why
# not, or None. A tensor subclass other than autograd's `Parameter` and `torch.compile`'s fake tensors is refused: it
# has no memory a kernel can read (the test suite's simulated GPU is one), so `impl='auto'` stays on the blocked path
# there.

# %%
#| export
@dataclass(frozen=True)
class Tiles:
    "Tile sizes of the kernels (powers of two; `rows` counts region rows, images x padded regions)."
    rows: int = 32          # region rows of a tile (B_R images x B_M regions)
    nodes: int = 32         # nodes of a chunk
    texts: int = 16         # forward: texts of a group
    warps: int = 4          # forward's warps
    bwd_warps: int = 8      # backward's warps (their accumulators are rows x D and nodes x D)

    def __post_init__(self):
        for k in ("rows", "nodes", "texts"):
            v = getattr(self, k)
            if v < 1 or v & (v - 1):
                raise ValueError(f"Tiles.{k}: need a power of two, got {v}")
        if min(self.rows, self.nodes) < 16:
            raise ValueError("Tiles: rows and nodes need at least 16 (a matrix product's smallest tile)")


def default_tiles(dtype: torch.dtype, spec: SbarSpec = SbarSpec()) -> Tiles:
    """Tiles for products in `dtype`: bf16 / fp16 32 x 32 with groups of 16 texts; without region sets 16 x 16 with 8
    (their maxima per region and text take BR*BM x BP x BJ registers); float32 16 x 16 (its 'ieee' products take more
    registers). At M = 10, D = 512 each compiles for sm_90 without spills, but for 8 bytes a thread in the ablation's
    node gradient (`compile_report`, benchmarks/results/sbar_triton_sm90.md)."""
    if dtype == torch.float32:
        return Tiles(rows=16, nodes=16, texts=16)
    return Tiles(rows=32, nodes=32, texts=16) if spec.region_sets else Tiles(rows=16, nodes=16, texts=8)


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def unavailable(x: torch.Tensor | torch.device | str) -> str | None:
    "None when the kernels can run on `x` (a tensor or a device), else why not, in one line."
    if triton is None:
        return "impl='triton': triton is not installed (pip install triton; it comes with torch's CUDA builds)"
    dev = torch.device(x.device if isinstance(x, torch.Tensor) else x)
    if isinstance(x, torch.Tensor) and type(x) not in _PLAIN:
        from torch._subclasses.fake_tensor import FakeTensor
        if not isinstance(x, FakeTensor):
            return f"impl='triton': a {type(x).__name__} tensor has no memory a kernel can read"
    if dev.type == "cuda" and not _interpret() and torch.cuda.is_available():
        cc = torch.cuda.get_device_capability(dev)
        if cc < (8, 0):     # bf16 tensor cores, and the backward's shared memory (up to 91 KiB a block)
            return (f"impl='triton' needs a GPU of compute capability 8.0 or more (A100, H100, ...), this one has "
                    f"{cc[0]}.{cc[1]}: use impl='fast'")
    if dev.type == "cuda" or (dev.type == "cpu" and _interpret()):
        return None
    if dev.type == "cpu":
        return ("impl='triton' needs a CUDA GPU (on the CPU: set TRITON_INTERPRET=1 before importing powerclip, "
                "slow, for tests); use impl='fast' here")
    return f"impl='triton': no Triton kernels on {dev.type}; use impl='fast'"


def _grid_sizes(M: int, D: int, rows: int) -> tuple[int, int, int]:
    "(B_R, B_M, B_D): images per tile, padded regions, padded width."
    BM = triton.next_power_of_2(M)
    return max(1, rows // BM), BM, max(16, triton.next_power_of_2(D))


def _precision(dtype: torch.dtype) -> str | None:
    """The products' `input_precision`: 'ieee' for float32 (a GPU's default, TF32, rounds the inputs to 10 bits);
    bf16 and fp16 as they are; under the interpreter, bf16 and fp16 tiles widened to float32 first ('widen': Triton
    3.8's interpreter multiplies bf16 tiles wrongly, its numpy having no bf16), the product the tensor cores compute."""
    if dtype == torch.float32:
        return "ieee"
    return "widen" if _interpret() else None


def _flags(spec: SbarSpec) -> int:
    return spec.use_t2r | spec.use_r2t << 1 | spec.region_sets << 2 | spec.debias_t2 << 3


def _launch_args(regions, region_valid, phrases, node_text, tau, alpha, t1, t2, flags):
    "What every kernel reads, and its constant switches."
    prec = _precision(regions.dtype)
    rv = region_valid.view(torch.uint8)
    switches = (t1, t2, bool(flags & 1), bool(flags & 2), bool(flags & 4))
    return (regions, rv, phrases, node_text), switches, prec


# %% [markdown]
# The ops. Their arguments are what a schema can hold (tensors, floats, ints): the spec's switches as integers, the
# tiles as a tuple of ints. The forward returns $\bar S$ and what the backward needs (the LSE, or the hard maxima and
# their counts; empty tensors for what a spec does not use) and the text boundaries.

# %%
#| export
@torch.library.custom_op("powerclip::sbar_fwd", mutates_args=())
def _sbar_fwd_op(regions: torch.Tensor, region_valid: torch.Tensor, phrases: torch.Tensor, node_text: torch.Tensor,
                 n_texts: int, tau: float, alpha: float, t1: int, t2: int, flags: int,
                 tiles: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                            torch.Tensor]:
    R, M, D = regions.shape
    C, dev = n_texts, regions.device
    starts = torch.searchsorted(node_text, torch.arange(C + 1, device=dev, dtype=node_text.dtype))   # (C + 1,)
    S = torch.zeros(R, C, device=dev, dtype=torch.float32)
    sets, r2t = bool(flags & 4), bool(flags & 2)
    lse = torch.empty(R, C, device=dev, dtype=torch.float32) if sets and r2t else S.new_empty(0)
    xm = torch.empty(R, M, C, device=dev, dtype=torch.float32) if r2t and not sets else S.new_empty(0)
    xn = torch.empty_like(xm)
    xi = torch.empty_like(xm, dtype=torch.int32)
    if R == 0 or C == 0:
        return S, lse, xm, xn, xi, starts
    rows, nodes, texts, warps, _ = tiles
    BR, BM, BD = _grid_sizes(M, D, rows)
    ins, sw, prec = _launch_args(regions, region_valid, phrases, node_text, tau, alpha, t1, t2, flags)
    _sbar_fwd_kernel[(triton.cdiv(R, BR), triton.cdiv(C, texts))](
        *ins, starts, S, lse, xm, xn, xi, R, C, phrases.shape[0], M, D, tau, alpha, *sw, bool(flags & 8), prec, BR, BM,
        nodes, texts, BD, num_warps=warps)
    return S, lse, xm, xn, xi, starts


@_sbar_fwd_op.register_fake
def _(regions, region_valid, phrases, node_text, n_texts, tau, alpha, t1, t2, flags, tiles):
    R, M, _ = regions.shape
    sets, r2t = bool(flags & 4), bool(flags & 2)
    S = regions.new_empty(R, n_texts, dtype=torch.float32)
    lse = S.new_empty(R, n_texts) if sets and r2t else S.new_empty(0)
    xm = S.new_empty(R, M, n_texts) if r2t and not sets else S.new_empty(0)
    return S, lse, xm, torch.empty_like(xm), torch.empty_like(xm, dtype=torch.int32), node_text.new_empty(n_texts + 1)


@torch.library.custom_op("powerclip::sbar_bwd", mutates_args=())
def _sbar_bwd_op(G: torch.Tensor, regions: torch.Tensor, region_valid: torch.Tensor, phrases: torch.Tensor,
                 node_text: torch.Tensor, starts: torch.Tensor, lse: torch.Tensor, xm: torch.Tensor,
                 xn: torch.Tensor, xi: torch.Tensor, tau: float, alpha: float, t1: int, t2: int, flags: int,
                 tiles: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    R, M, D = regions.shape
    P, C = phrases.shape[0], starts.shape[0] - 1
    g_reg, g_ph = torch.zeros_like(regions), torch.zeros_like(phrases)
    if R == 0 or C == 0 or P == 0:
        return g_reg, g_ph
    rows, nodes, _, _, warps = tiles
    BR, BM, BD = _grid_sizes(M, D, rows)
    ins, sw, prec = _launch_args(regions, region_valid, phrases, node_text, tau, alpha, t1, t2, flags)
    G = G.contiguous().float()
    common = (*ins, starts, G, lse, xm, xn, xi)
    _sbar_bwd_regions[(triton.cdiv(R, BR),)](*common, g_reg, R, C, P, M, D, tau, alpha, *sw, prec, BR, BM, nodes,
                                             BD, num_warps=warps)
    _sbar_bwd_nodes[(triton.cdiv(P, nodes),)](*common, g_ph, R, C, P, M, D, tau, alpha, *sw, prec, BR, BM, nodes,
                                              BD, num_warps=warps)
    return g_reg, g_ph


@_sbar_bwd_op.register_fake
def _(G, regions, region_valid, phrases, node_text, starts, lse, xm, xn, xi, tau, alpha, t1, t2, flags, tiles):
    return torch.empty_like(regions), torch.empty_like(phrases)


def _setup(ctx, inputs, output):
    regions, region_valid, phrases, node_text, _, tau, alpha, t1, t2, flags, tiles = inputs
    _, lse, xm, xn, xi, starts = output
    ctx.save_for_backward(regions, region_valid, phrases, node_text, starts, lse, xm, xn, xi)
    ctx.args = (tau, alpha, t1, t2, flags, tiles)


def _backward(ctx, G, *_):
    regions, region_valid, phrases, node_text, starts, lse, xm, xn, xi = ctx.saved_tensors
    g_reg, g_ph = _sbar_bwd_op(G, regions, region_valid, phrases, node_text, starts, lse, xm, xn, xi, *ctx.args)
    return g_reg, None, g_ph, None, None, None, None, None, None, None, None


_sbar_fwd_op.register_autograd(_backward, setup_context=_setup)


# %% [markdown]
# The function has `10a`'s `sbar_blocked` signature and result, plus the tiles.

# %%
#| export
def sbar_triton(
    regions: torch.Tensor,       # (C_i, M, D) region embeddings phi(I_i | R_m)
    region_valid: torch.Tensor,  # (C_i, M) bool
    phrases: torch.Tensor,       # (P, D) packed phrase embeddings of C_j texts
    node_text: torch.Tensor,     # (P,) long, sorted: the text of each node; every text has >= 1 node
    n_texts: int,                # C_j
    spec: SbarSpec = SbarSpec(),
    tiles: Tiles | None = None,  # None: default_tiles for the products' dtype and the spec
    counts=None,                 # K_j of each text on the host (list of ints), or None
) -> torch.Tensor:               # (C_i, C_j) S-bar, float32
    """S-bar of every image against every text from packed nodes, as fused Triton kernels (forward and backward).
    A text without a node is refused in one line, from the host `counts` where given, else from `node_text` where
    reading it costs no host sync (a CPU tensor); on a GPU without `counts` it is not checked."""
    why = unavailable(regions)
    if why:
        raise RuntimeError(why)
    if spec.t1_act not in _T1 or spec.t2_act not in _T2:
        raise ValueError(f"unknown activation: t1_act={spec.t1_act!r} (one of {sorted(_T1)}), "
                         f"t2_act={spec.t2_act!r} (one of {sorted(_T2)})")
    if regions.shape[-1] != phrases.shape[-1] or regions.shape[:2] != region_valid.shape or phrases.dim() != 2 \
            or node_text.shape != phrases.shape[:1]:
        raise ValueError(f"shapes do not match: regions {tuple(regions.shape)}, region_valid "
                         f"{tuple(region_valid.shape)}, phrases {tuple(phrases.shape)}, node_text "
                         f"{tuple(node_text.shape)}")
    if counts is not None:
        check_counts(counts, n_texts, n_nodes=node_text.shape[0])
    elif node_text.device.type == "cpu" and type(node_text) in _PLAIN and not torch.compiler.is_compiling():
        node_counts(node_text, n_texts)         # on the host already: no sync to check the layout
    dev, mm = regions.device.type, torch.promote_types(regions.dtype, phrases.dtype)
    if torch.is_autocast_enabled(dev) and mm == torch.float32:
        mm = torch.get_autocast_dtype(dev)      # the score products in the autocast dtype, as the blocked path
    if mm not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"impl='triton' computes in float32, bfloat16 or float16, got {mm}; use impl='fast'")
    tiles = tiles or default_tiles(mm, spec)
    t = (tiles.rows, tiles.nodes, tiles.texts, tiles.warps, tiles.bwd_warps)
    S = _sbar_fwd_op(regions.to(mm).contiguous(), region_valid.bool().contiguous(), phrases.to(mm).contiguous(),
                     node_text.long().contiguous(), int(n_texts), float(spec.tau), float(spec.alpha),
                     _T1[spec.t1_act], _T2[spec.t2_act], _flags(spec), list(t))[0]
    return S


# %% [markdown]
# ## Compiled for a GPU, without one
#
# The interpreter checks what the kernels compute, not that they compile: a GPU compiler refuses some programs the
# interpreter runs (shapes it cannot lay out, types it cannot convert), and the register budget decides whether a
# kernel runs at speed. `compile_report` compiles the three kernels for a given CUDA architecture with Triton's own
# toolchain (to PTX, then `ptxas` to a cubin; no GPU, no driver) and reads each kernel's registers per thread, its
# stack (bytes per thread spilled to local memory: 0 is the aim) and its shared memory per block (at most 227 KiB on
# sm_90). It needs `TRITON_INTERPRET` unset (interpreted kernels do not compile), so the tests run it in a fresh
# process (`benchmarks/sbar_triton_compile.py`, which writes `benchmarks/results/sbar_triton_sm90.md`).
#
# What it found, with Triton 3.8 on this CPU: at the default bf16 tiles and the paper's $M=10$, $D=512$, the forward
# takes 168 registers a thread and the two backward kernels 180 and 226, none spills, and their shared memory is 36,
# 89 and 82 KiB (sm_90); for an A100 (sm_80) 197, 246 and 255 registers, still without spills. Larger tiles spill
# (32 x 64 nodes; groups of 32 texts push the forward to 240 registers), and so does $D=768$ at these tiles (its
# $B_D$ is 1,024); the float32 parity path spills at 32 x 32 and not at 16 x 16, hence its own default. Compiling
# says nothing of speed: that is the GPU check's paths part.

# %%
#| export
def _signature(kernel: str, ptr: str) -> dict:
    "The argument types of a kernel, for ahead-of-time compilation (`ptr`: '*bf16', '*fp16' or '*fp32')."
    fwd = [("reg_ptr", ptr), ("rv_ptr", "*u8"), ("ph_ptr", ptr), ("nt_ptr", "*i64"), ("st_ptr", "*i64")]
    out = [("R", "i32"), ("C", "i32")]
    if kernel == "_sbar_fwd_kernel":
        rest = [("s_ptr", "*fp32"), ("lse_ptr", "*fp32"), ("xm_ptr", "*fp32"), ("xn_ptr", "*fp32"), ("xi_ptr", "*i32"),
                *out, ("P", "i32")]
    else:
        rest = [("g_ptr", "*fp32"), ("lse_ptr", "*fp32"), ("xm_ptr", "*fp32"), ("xn_ptr", "*fp32"), ("xi_ptr", "*i32"),
                ("out_ptr", ptr),
                *out, ("P", "i32")]
    return dict(fwd + rest + [("M", "i32"), ("D", "i32"), ("tau", "fp32"), ("alpha", "fp32")])


def compile_report(
    arch: int = 90,                     # CUDA compute capability x 10 (90: H100 / H200)
    dtype: torch.dtype = torch.bfloat16,
    spec: SbarSpec = SbarSpec(),
    tiles: Tiles | None = None,         # None: default_tiles
    M: int = 10, D: int = 512,
) -> dict[str, dict]:                   # kernel -> {'regs', 'stack', 'shared'} (None where cuobjdump is missing)
    "Compile the three kernels for `arch` without a GPU; each one's registers per thread, stack bytes and shared bytes."
    import re
    import subprocess
    import tempfile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    if _interpret():
        raise RuntimeError("compile_report: unset TRITON_INTERPRET (interpreted kernels do not compile)")
    tiles = tiles or default_tiles(dtype, spec)
    BR, BM, BD = _grid_sizes(M, D, tiles.rows)
    ptr = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}[dtype]
    sw = dict(T1=_T1[spec.t1_act], T2=_T2[spec.t2_act], USE_T2R=spec.use_t2r, USE_R2T=spec.use_r2t,
              SETS=spec.region_sets, PREC=_precision(dtype), BR=BR, BM=BM, BP=tiles.nodes, BD=BD)
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    out = {}
    for kernel, const, warps in (("_sbar_fwd_kernel", dict(sw, DEBIAS=spec.debias_t2, BJ=tiles.texts), tiles.warps),
                                 ("_sbar_bwd_regions", sw, tiles.bwd_warps), ("_sbar_bwd_nodes", sw, tiles.bwd_warps)):
        sig = {**_signature(kernel, ptr), **{k: "constexpr" for k in const}}
        k = triton.compile(ASTSource(fn=globals()[kernel], signature=sig, constexprs=const),
                           target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
        use = {"regs": None, "stack": None}
        if os.path.isfile(tool):
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(k.asm["cubin"])
                f.flush()
                res = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
            m = re.search(r"REG:(\d+).*?STACK:(\d+)", res, re.S)
            use = {"regs": int(m.group(1)), "stack": int(m.group(2))} if m else use
        out[kernel] = dict(use, shared=int(k.metadata.shared), warps=warps)
    return out


# %% [markdown]
# ## Checks against the references
#
# The oracle is `10a`'s `sbar_dense`, the dense $\bar S$ of `10_powerset`'s functions, in float64, through `10a`'s
# ragged inputs: image 1 has no valid region, text 0 a single node, and the other texts up to `Kmax` nodes. Small tiles
# (16 rows, 16 nodes, 4 texts) make texts longer than a chunk, chunks that cut texts, groups of several chunks and
# tiles with padded images. Every switch of `SbarSpec` (Table 8's activations, each aggregator alone, the debias,
# region sets off) at $\tau$ down to $10^{-3}$: float32 values within $10^{-5}$ relative, gradients within $10^{-4}$
# of the largest.
#
# `tests/test_sbar_triton.py` adds what a parity on random float32 inputs cannot see, each test shown to fail on the
# bug it guards (a bug planted in the kernels, the test run, the bug removed): **precision** as FlashAttention's tests
# judge it, on bf16 inputs with long sums (texts of 64 nodes, 1,024 nodes in 64 chunks): the kernels' largest error
# against float64 on the same rounded inputs at most twice the blocked path's in bf16 (3x for gradients; a forward
# T1 sum or a backward accumulator kept in bf16 errs 22 and 60 times the blocked path), and each $\bar S$ entry of bf16
# inputs within $10^{-5}$ of float64; **exact ties** (duplicate regions, nodes duplicated within and across chunks)
# split as torch's `amax` splits them; every activation at a score of exactly 0 (ReLU's derivative there is 0);
# transposed and expanded upstream gradients and strided inputs; bf16 operands reaching the ops under autocast;
# image tiles and text groups cut short that hold valid regions, with texts of several chunks, in every switch; and a
# text without a node refused in one line. Triton's interpreter turns float32 into bf16 by truncation, where torch
# and a GPU round to nearest: there a bf16 rounding errs up to twice as much, always towards zero, and the tolerances
# hold under both (the kernels' gradient error on the CPU is 2.5 times the blocked path's, from that truncation of its
# output; the accumulator bugs 60 times).

# %%
#| export
def triton_parity(
    spec: SbarSpec = SbarSpec(),
    tiles: Tiles | None = None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    **case,                      # ragged_case's arguments (sizes, seed, scale)
) -> tuple[float, float]:        # (value error, gradient error)
    """`sbar_triton` in `dtype` against `sbar_dense` in float64 on `ragged_case(**case)`: the largest value error
    relative to |S-bar| (floored at 0.01), and the largest gradient error relative to the largest gradient (this
    notebook's tests, tests/test_sbar_triton.py, the GPU check's parity)."""
    regions, rv, phrases, nt = (t.to(device) for t in ragged_case(**case))
    regions.requires_grad_(True)
    phrases.requires_grad_(True)
    n = int(case.get("Cj", 6))
    ref = sbar_dense(regions, rv, phrases, nt, n, spec)
    G = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(device)
    g64 = torch.autograd.grad(ref, (regions, phrases), G)
    r = regions.detach().to(dtype).requires_grad_(True)
    p = phrases.detach().to(dtype).requires_grad_(True)
    S = sbar_triton(r, rv, p, nt, n, spec, tiles)
    g = torch.autograd.grad(S, (r, p), G.float())
    ev = ((S.double() - ref).abs() / ref.abs().clamp_min(1e-2)).max().item()
    eg = max(((a.double() - b).abs().max() / b.abs().max()).item() for a, b in zip(g, g64))
    return ev, eg


# %%
_SMALL = Tiles(rows=16, nodes=16, texts=4)
_SPECS = {
    "softplus/tanh": SbarSpec(),
    "relu/tanh": SbarSpec(t1_act="relu", tau=1e-2),
    "gelu/sigmoid": SbarSpec(t1_act="gelu", t2_act="sigmoid", tau=0.1),
    "swish/softsign": SbarSpec(t1_act="swish", t2_act="softsign", tau=0.05),
    "T2R only": SbarSpec(use_r2t=False),
    "R2T only, alpha 0.3": SbarSpec(use_t2r=False, alpha=0.3),
    "debias, tau 0.1": SbarSpec(debias_t2=True, tau=0.1),
    "no region sets": SbarSpec(region_sets=False),
    "no sets, T2R only": SbarSpec(region_sets=False, use_r2t=False),
    "no sets, R2T only": SbarSpec(region_sets=False, use_t2r=False),
}
_rows = []
for _name, _spec in _SPECS.items():                  # 7 images (image 1 without regions) x 13 texts of 1 to 27 nodes
    _ev, _eg = triton_parity(_spec, _SMALL, Ci=7, Cj=13, M=10, D=24, Kmax=27, seed=3)
    _rows.append((_name, _ev, _eg))
    assert _ev < 1e-5 and _eg < 1e-4, (_name, _ev, _eg)
print(f"{'spec':<22}{'value err':>10}{'grad err':>10}")
for _r in _rows:
    print(f"{_r[0]:<22}{_r[1]:>10.1e}{_r[2]:>10.1e}")

# %% [markdown]
# The same numbers as the blocked path, and the two forms a process computes under DDP: its local images against every
# gathered text ($\bar S$'s rows $[o, o+R)$) and every gathered image against its local texts (its columns). Each
# form is its own call, with its own tiles over a different grid; they agree with the full matrix to float32's
# rounding.

# %%
_reg, _rv, _ph, _nt = ragged_case(9, 11, M=6, D=16, Kmax=9, seed=5, dtype=torch.float32)
_spec = SbarSpec(tau=1e-3)
_full = sbar_triton(_reg, _rv, _ph, _nt, 11, _spec, _SMALL)
assert_close(_full, sbar_blocked(_reg, _rv, _ph, _nt, 11, _spec), rtol=1e-5, atol=1e-6)
_o, _R = 3, 4                                                         # this process: images / texts 3 .. 6
_loc = slice(_o, _o + _R)
_mine = (_nt >= _o) & (_nt < _o + _R)                                 # its texts' nodes
assert_close(sbar_triton(_reg[_loc], _rv[_loc], _ph, _nt, 11, _spec, _SMALL), _full[_loc], rtol=1e-6, atol=1e-6)
assert_close(sbar_triton(_reg, _rv, _ph[_mine], _nt[_mine] - _o, _R, _spec, _SMALL), _full[:, _loc], rtol=1e-6,
             atol=1e-6)

# %% [markdown]
# ## Stability at $\tau=10^{-3}$, float32 and bf16 autocast
#
# `10a`'s case: scores up to about 20 (unnormalised phrases) at $\tau=10^{-3}$. Values and gradients stay finite in
# float32 and under bf16 autocast; float32 matches float64; bf16 is about as close to float32 as the blocked path's
# bf16 (within a factor of 2: the kernels keep the scores in float32 where the blocked path rounds each to bf16,
# and round $\delta$ to bf16 for the gradient products, as the blocked path does).

# %%
_reg, _rv, _ph, _nt = ragged_case(6, 8, M=10, D=32, Kmax=12, seed=9, scale=3.0)
_W = torch.randn(6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
_res = {}
for _name, _f, _dtype, _ac in (("fp64", sbar_dense, torch.float64, False),
                               ("fp32", sbar_triton, torch.float32, False),
                               ("bf16", sbar_triton, torch.float32, True),
                               ("bf16 blocked", sbar_blocked, torch.float32, True)):
    _r, _p = _reg.to(_dtype, copy=True).requires_grad_(), _ph.to(_dtype, copy=True).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=_ac):
        _S = _f(_r, _rv, _p, _nt, 8, SbarSpec(tau=1e-3))
    (_S * _W.to(_S.dtype)).sum().backward()
    assert _S.dtype == (torch.float64 if _dtype == torch.float64 else torch.float32)
    assert torch.isfinite(_S).all() and torch.isfinite(_r.grad).all() and torch.isfinite(_p.grad).all(), _name
    _res[_name] = (_S.detach().double(), _r.grad.double(), _p.grad.double())
for _a, _b in zip(_res["fp32"], _res["fp64"]):
    assert_close(_a, _b, rtol=1e-4, atol=1e-3)
_rel = lambda a, b: float((a - b).norm() / b.norm())
for _name in ("bf16", "bf16 blocked"):
    print(f"{_name:>12} vs fp32: relative error S %.1e, d regions %.1e, d phrases %.1e"
          % tuple(_rel(a, b) for a, b in zip(_res[_name], _res["fp32"])))
for _a, _b, _c in zip(_res["bf16"], _res["bf16 blocked"], _res["fp32"]):
    assert _rel(_a, _c) <= 2 * _rel(_b, _c) + 1e-3


# %% [markdown]
# ## One op, nothing else
#
# The promise of the kernels is that a call dispatches no PyTorch operation on the scores: no matrix product, no
# segment reduction (`index_add`, `scatter`), no activation. A `TorchDispatchMode` records every ATen operation of a
# forward and backward call: what remains is the two custom ops, the text boundaries (`searchsorted`), casts, and the
# buffers. The call is given the host counts, as the loss gives them (without them a CPU call checks `node_text` for
# a text without a node, with a few reductions).

# %%
class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(func._schema.name)
        return func(*args, **(kwargs or {}))


_FORBIDDEN = ("mm", "bmm", "addmm", "matmul", "einsum", "index_add", "scatter", "segment", "softplus", "logsumexp",
              "log1p", "sigmoid", "tanh", "exp", "log", "gelu", "silu", "relu", "amax", "max", "sum")
_reg, _rv, _ph, _nt = ragged_case(4, 5, M=4, D=8, Kmax=4, seed=2, dtype=torch.float32)
_counts = torch.bincount(_nt, minlength=5).tolist()
for _spec in (SbarSpec(), SbarSpec(region_sets=False)):
    _r, _p = _reg.clone().requires_grad_(), _ph.clone().requires_grad_()
    with _Ops() as _ops:
        _S = sbar_triton(_r, _rv, _p, _nt, 5, _spec, _SMALL, counts=_counts)
        torch.autograd.grad(_S, (_r, _p), torch.ones_like(_S))
    _names = sorted({n.split("::")[-1] for n in _ops.seen})
    print(f"region_sets={_spec.region_sets}: {', '.join(_names)}")
    assert {"powerclip::sbar_fwd", "powerclip::sbar_bwd"} <= set(_ops.seen)
    assert not [n for n in _names if n.split(".")[0] in _FORBIDDEN], _names

# %% [markdown]
# **In a compiled region.** The ops' fake implementations give `torch.compile` the shapes, so the loss compiles into
# one graph around them (`fullgraph=True` fails on any graph break); `aot_eager` traces forward and backward through
# AOTAutograd, as inductor does, without generating code. `torch.library.opcheck` checks the registrations themselves
# (schema, fake implementation against the real one, the autograd formula).

# %%
_r, _p = _reg.clone().requires_grad_(), _ph.clone().requires_grad_()
_f = torch.compile(lambda r, p: (sbar_triton(r, _rv, p, _nt, 5, SbarSpec(), _SMALL) ** 2).sum(), fullgraph=True,
                   backend="aot_eager")
_g = torch.autograd.grad(_f(_r, _p), (_r, _p))
_r2, _p2 = _reg.clone().requires_grad_(), _ph.clone().requires_grad_()
_g2 = torch.autograd.grad((sbar_triton(_r2, _rv, _p2, _nt, 5, SbarSpec(), _SMALL) ** 2).sum(), (_r2, _p2))
for _a, _b in zip(_g, _g2):
    assert_close(_a, _b)
_args = (_reg, _rv, _ph, _nt, 5, 1e-3, 0.75, 0, 0, _flags(SbarSpec()), [16, 16, 4, 4, 8])
torch.library.opcheck(_sbar_fwd_op, _args, test_utils=("test_schema", "test_faketensor"))

# %% [markdown]
# ## When it cannot run
#
# One line, never a traceback from inside Triton: on the CPU without the interpreter, on a device Triton has no
# kernels for, and on a tensor with no memory of its own.

# %%
_env = os.environ.pop("TRITON_INTERPRET", None)
try:
    print(unavailable("cpu"))
    assert "needs a CUDA GPU" in unavailable(torch.zeros(1))
    assert "no Triton kernels on mps" in unavailable("mps")
    assert unavailable("cuda") is None if triton is not None else "not installed" in unavailable("cuda")
    try:
        sbar_triton(_reg, _rv, _ph, _nt, 5)
        raise AssertionError("ran on the CPU without the interpreter")
    except RuntimeError as e:
        assert "\n" not in str(e) and "impl='fast'" in str(e)
finally:
    if _env is not None:
        os.environ["TRITON_INTERPRET"] = _env


class _Sub(torch.Tensor):
    pass


assert "no memory" in unavailable(_reg.as_subclass(_Sub))
