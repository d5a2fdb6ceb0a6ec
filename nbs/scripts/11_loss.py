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
#| default_exp loss

# %%
#| export
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from powerclip.powerset import (
    nla_t1, nla_t2, powerset_scores, r2t_exact, r2t_singletons, t2r_exact, t2r_singletons, triplet,
)
from powerclip.powerset_fast import CPU_BLOCK_BYTES, SbarSpec, check_counts, pack_nodes, sbar_blocked, unpack_nodes

# %%
#| hide
from torch.autograd import gradcheck
from torch.testing import assert_close

if not torch.cuda.is_available():      # impl='triton' below runs in Triton's interpreter (10b_sbar_triton)
    os.environ.setdefault("TRITON_INTERPRET", "1")


# %% [markdown]
# # The PowerCLIP loss
#
# > The local-row contrastive skeleton, the CLIP loss on it, the powerset triplet loss on top, the ablation switches.
#
# The switches are the paper's ablations. Everything is written so that each process of a data-parallel run computes only
# its own rows.

# %% [markdown]
# $$\mathcal L_{\text{total}}=\mathcal L_{\text{CLIP}}+\lambda\,\mathcal L_{\text{triplet}},\qquad
#   \mathcal L_{\text{triplet}}=\Phi_\gamma(\bar S)+\Phi_\gamma(\bar S^\top),\qquad
#   \bar S=\text{NLA-T1}(S^{(0)})+\text{NLA-T2}(S^{(0)})\quad(\text{Eqs. 8, 16}).$$
#
# **Rows, not matrices.** With $G$ processes each holding $R$ local pairs of a global batch of $C=GR$, the
# triplet term of image $i$ needs row $i$ of $\bar S$ (image $i$ against *all* texts), and that of text $j$
# needs column $j$ (all images against text $j$). So a process computes two $R\times C$ blocks: its images
# against the gathered texts and its texts against the gathered images. Memory then grows with the local
# batch, $O(RCMK)$, never with $C^2$. The positives of the local rows sit at columns
# `offset + arange(R)` with `offset = rank * R`, exactly as open_clip's `ClipLoss` labels its local logits.
# Averaging the per-process means (what DDP's gradient averaging does) gives the global mean. Gathering
# itself lives in `powerclip.dist`; the functions here are pure and take the gathered tensors as arguments.
# On one process `*_all` is simply the local batch and the two blocks are one matrix and its transpose,
# which the skeleton below (`contrastive_rows`) computes once; every loss of the project is written on it.
#
# **Packed nodes across processes.** The tree nodes travel packed (`PowersetInputs` with `phrases (P, D)` and
# `node_text (P,)`, `10a_powerset_fast`): the gathered `phrases` are the processes' packed phrases concatenated
# in rank order, and the gathered `node_text` is each process's `node_text` plus the number of rows before it
# (`rank * R` when every process holds R rows), which keeps it sorted. Nothing is padded to the longest
# caption, and the loss keeps $O(RC)$ for backward beyond its inputs, whatever $M$ and $K$.
#
# **Host facts.** The blocked path plans its blocks from the node counts $K_j$, and skips its masking passes when
# every region is valid. On a GPU, reading either from the device makes the host wait for everything queued before
# (a host sync), and so do the ops whose output size depends on the data (boolean-mask indexing, `nonzero`,
# `bincount`, `repeat_interleave` without its size). Both facts are known on the CPU before the batch moves to the
# device, where the data pipeline built `node_valid` and `region_valid`; `PowersetInputs` carries them as optional
# host fields, `node_counts` (a list of ints, one per row) and `all_regions_valid` (a bool), which the caller reads
# from the same masks (`PowerCLIP.prepare_batch` does, `40_methods`). Given both, the blocked path reads nothing
# back (0 host syncs in the loss, forward and backward: `tests/test_cuda_dry_run.py` counts them on a simulated
# GPU). They are trusted: checked against the shapes on the host (one-line errors), never against the masks, which
# would take the sync they save. Without them the loss reads them from the device and checks the layout there, as
# before. The logged means of the positive and negative similarities are taken without boolean indexing too.

# %% [markdown]
# ## The local-row skeleton
#
# Every contrastive loss of this project (CLIP's, FILIP's token-wise one, SmartCLIP's modular one, the powerset
# triplet) has the same shape: a similarity $s(\text{images}, \text{texts})$ that gives an (images $\times$ texts)
# matrix, of which a process needs two blocks, its local images against all texts and all images against its local
# texts. `contrastive_rows` computes them once for all:
#
# $$S_{\text{img}} = s(I_{\text{loc}}, T_{\text{all}})\in\mathbb R^{R\times C},\qquad
#   S_{\text{txt}} = s(I_{\text{all}}, T_{\text{loc}})^\top\in\mathbb R^{R\times C},$$
#
# row $r$ of $S_{\text{img}}$ is image $r$ against every text, row $r$ of $S_{\text{txt}}$ is text $r$ against every
# image, and the positive of row $r$ is at column `offset + r`. On one process the gathered inputs *are* the local
# ones (`powerclip.dist.gather` returns them uncopied, or the caller passes None), and the two blocks are one
# $R\times R$ matrix and its transpose, computed once. The inputs of each side can be anything the similarity
# understands: a tensor, a tuple of tensors (SmartCLIP's texts with their masks), a dataclass (the powerset inputs).
# A similarity may also return a *pair* of matrices, both indexed [image, text]: the first scores the image rows, the
# second the text rows (FILIP's two directions are not transposes of each other).
#
# `symmetric_infonce` is then the symmetric cross-entropy of both blocks with labels `offset + arange(R)`, exactly as
# open_clip's `ClipLoss` labels its local logits.

# %%
#| export
def _is_local(x_all, x) -> bool:
    "True when the 'gathered' side is the local one itself (one process): same object, or same objects inside."
    if x_all is None or x_all is x:
        return True
    if isinstance(x, (tuple, list)) and isinstance(x_all, (tuple, list)):
        return len(x) == len(x_all) and all(a is b for a, b in zip(x_all, x))
    if dataclasses.is_dataclass(x) and type(x_all) is type(x):
        return all(getattr(x_all, f.name) is getattr(x, f.name) for f in dataclasses.fields(x))
    return False


def contrastive_rows(
    sim,                    # sim(images, texts) -> (Ci, Cj), or a pair (image-row scores, text-row scores) both (Ci,
                            # Cj)
    img_local, txt_local,   # this process's R images and R texts (tensors, tuples or dataclasses: what sim reads)
    img_all=None, txt_all=None,  # every process's C images and texts (None, or the local ones: one process)
) -> tuple[torch.Tensor, torch.Tensor]:  # (S_img (R, C), S_txt (R, C)); positives at offset + arange(R)
    "The two blocks a process needs: its images against all texts, and its texts against all images."
    if _is_local(img_all, img_local) and _is_local(txt_all, txt_local):
        S = sim(img_local, txt_local)                                   # (R, R) or a pair
        return (S[0], S[1].T) if isinstance(S, tuple) else (S, S.T)
    S_img = sim(img_local, txt_all)                                      # (R, C)
    S_txt = sim(img_all, txt_local)                                      # (C, R)
    S_img = S_img[0] if isinstance(S_img, tuple) else S_img
    S_txt = S_txt[1] if isinstance(S_txt, tuple) else S_txt
    return S_img, S_txt.T


def symmetric_infonce(
    logits_img: torch.Tensor,  # (R, C) local images against all texts, already scaled
    logits_txt: torch.Tensor,  # (R, C) local texts against all images, already scaled
    offset: int = 0,           # index of this process's first pair in the gathered batch (rank * R)
) -> torch.Tensor:             # scalar
    "(CE(image rows) + CE(text rows)) / 2 with positives at offset + arange(R)."
    labels = torch.arange(logits_img.shape[0], device=logits_img.device) + offset  # (R,)
    return (F.cross_entropy(logits_img, labels) + F.cross_entropy(logits_txt, labels)) / 2


# %% [markdown]
# ## CLIP loss
#
# Symmetric InfoNCE with a learnable temperature (open_clip's `ClipLoss` with `local_loss=True`):
# $\frac12\big[\mathrm{CE}(s\,v_{\text{loc}}t_{\text{all}}^\top,\;y)+\mathrm{CE}(s\,t_{\text{loc}}v_{\text{all}}^\top,\;y)\big]$,
# $y=\text{offset}+[0..R)$, where $s=\exp(\text{logit\_scale})$ is passed already exponentiated, as open_clip's
# models return it.

# %%
#| export
def dot_similarity(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    "(Ci, D), (Cj, D) -> (Ci, Cj) dot products (cosines of L2-normalised embeddings)."
    return a @ b.T


def clip_loss(
    image: torch.Tensor,       # (R, D) L2-normalised local image embeddings
    text: torch.Tensor,        # (R, D) L2-normalised local text embeddings
    logit_scale: torch.Tensor, # () exp of the learnable log-temperature, as open_clip returns it
    image_all: torch.Tensor | None = None,  # (C, D) gathered image embeddings (None: the local ones)
    text_all: torch.Tensor | None = None,   # (C, D) gathered text embeddings (None: the local ones)
    offset: int = 0,           # index of this process's first pair in the gathered batch (rank * R)
) -> torch.Tensor:             # scalar
    "Symmetric InfoNCE on the local rows against all columns (open_clip's local-loss convention)."
    S_img, S_txt = contrastive_rows(dot_similarity, image, text, image_all, text_all)  # (R, C) each
    return symmetric_infonce(logit_scale * S_img, logit_scale * S_txt, offset)


# %%
_g = torch.Generator().manual_seed(0)
_img = F.normalize(torch.randn(6, 4, generator=_g, dtype=torch.float64), dim=-1)
_txt = F.normalize(torch.randn(6, 4, generator=_g, dtype=torch.float64), dim=-1)
_s = torch.tensor(10.0, dtype=torch.float64)
# against a per-sample loop
_ref = sum(-torch.log_softmax(_s * _img[i] @ _txt.T, 0)[i] - torch.log_softmax(_s * _txt[i] @ _img.T, 0)[i]
           for i in range(6)) / 12
assert_close(clip_loss(_img, _txt, _s), _ref)
assert_close(clip_loss(_img, _txt, _s, _img, _txt), _ref)  # the local tensors passed as gathered: one process
# two "processes" of 3 rows each, averaged, give the full-batch loss
assert_close((clip_loss(_img[:3], _txt[:3], _s, _img, _txt, 0)
              + clip_loss(_img[3:], _txt[3:], _s, _img, _txt, 3)) / 2, _ref)
# a similarity that returns a pair: the first scores the image rows, the second the text rows
_pair = lambda a, b: (a @ b.T, 2 * a @ b.T)
_Si, _St = contrastive_rows(_pair, _img[:3], _txt[:3], _img, _txt)
assert_close(_Si, _img[:3] @ _txt.T)
assert_close(_St, 2 * _txt[:3] @ _img.T)
_Si, _St = contrastive_rows(_pair, _img, _txt)
assert_close(_Si, _img @ _txt.T)
assert_close(_St, 2 * _txt @ _img.T)
assert _is_local((_img, _txt), (_img, _txt)) and not _is_local((_img, _txt.clone()), (_img, _txt))


# %% [markdown]
# ## SigLIP's sigmoid loss
#
# SigLIP (Zhai et al. 2023, Eq. 1) scores every image-text pair on its own: with $z_{ij}=+1$ for the positive pair
# and $-1$ for every other, a learnable scale $t=e^{t'}$ and bias $b$,
# $\mathcal L=-\frac1{|B|}\sum_{i,j}\log\sigma\big(z_{ij}(t\,v_i\cdot u_j+b)\big)$. On the local-row contract above, a
# process takes its $R$ images against the $C$ gathered texts (`powerclip.dist.gather`, as `clip_loss`), positives at
# `offset + arange(R)`, and divides the sum over all $R\times C$ entries by $R$: exactly what open_clip's
# `SigLipLoss` returns on one rank whatever its `dist_impl` (`tests/test_siglip.py` checks the four, on 1, 2 and 3
# processes), and the mean over processes is the full-batch loss. Unlike CLIP's, the loss needs no other process's
# images: the sum is over pairs, so each image's row is summed where the image lives. `logit_scale` is $t$ already
# exponentiated, as open_clip's models return it, `logit_bias` is $b$.
#
# **Precision.** Under autocast the similarities come out of the matmul in bf16; the loss promotes them to at least
# float32 before the scale and bias, so that $t\cdot s + b$, with $t$ near 100 and $b$ near $-10$, keeps its low
# bits (and the log-sigmoid of the many negatives, each near 0, is summed in float32).

# %%
#| export
def siglip_loss(
    image: torch.Tensor,          # (R, D) L2-normalised local image embeddings
    text: torch.Tensor,           # (R, D) L2-normalised local text embeddings
    logit_scale: torch.Tensor,    # () t = exp(t'), as open_clip's models return it
    logit_bias: torch.Tensor,     # () b
    text_all: torch.Tensor | None = None,  # (C, D) gathered text embeddings (None: the local ones)
    offset: int = 0,              # rank * R: the column of this process's first positive
) -> torch.Tensor:                # scalar
    "SigLIP's pairwise sigmoid loss: the local images against every text, summed, divided by the local R."
    cols = text if text_all is None else text_all
    sim = image @ cols.T                                                               # (R, C)
    logits = logit_scale * sim.to(torch.promote_types(sim.dtype, torch.float32)) + logit_bias
    R, C = logits.shape
    own = torch.arange(C, device=logits.device)[None, :] == (torch.arange(R, device=logits.device) + offset)[:, None]
    z = torch.where(own, 1.0, -1.0).to(logits.dtype)                                  # (R, C) +1 positive, -1 others
    return -F.logsigmoid(z * logits).sum() / R


# %% [markdown]
# Against the sum written pair by pair, two "processes" of three rows (their mean is the one-process loss, value and
# gradient of every input, $t$ and $b$ included), and the promotion under bf16 autocast: the logits are float32 there,
# and the loss equals the float32 loss on the bf16-rounded similarities.

# %%
_b = torch.tensor(-2.0, dtype=torch.float64)
_args = [x.clone().requires_grad_() for x in (_img, _txt, _s, _b)]
_sl = siglip_loss(*_args)
_ref = -sum(F.logsigmoid((1.0 if i == j else -1.0) * (_s * _img[i] @ _txt[j] + _b)) for i in range(6)
            for j in range(6)) / 6
assert_close(_sl, _ref)
_g1 = torch.autograd.grad(_sl, _args)
_two = sum(siglip_loss(_args[0][sl], _args[1][sl], _args[2], _args[3], _args[1], off)
           for sl, off in ((slice(0, 3), 0), (slice(3, 6), 3))) / 2
assert_close(_two, _sl)
for a, b in zip(torch.autograd.grad(_two, _args), _g1):
    assert_close(a, b)
assert gradcheck(siglip_loss, _args, eps=1e-6, atol=1e-5)
_i32, _t32 = _img.float(), _txt.float()
with torch.autocast("cpu", dtype=torch.bfloat16):
    _lb = siglip_loss(_i32, _t32, torch.tensor(100.0), torch.tensor(-10.0))
_sim16 = (_i32.bfloat16() @ _t32.bfloat16().T).float()
_z = 2 * torch.eye(6) - 1
assert _lb.dtype == torch.float32
assert_close(_lb, -F.logsigmoid(_z * (100.0 * _sim16 - 10.0)).sum() / 6)

# %% [markdown]
# ## The powerset similarity and its ablation switches
#
# One config holds every choice of the loss. Defaults follow the paper where it is explicit and our written
# choices where it is not:
#
# | field | default | source |
# |---|---|---|
# | `lam` | 0.1 | Appendix F: "we use $\lambda=0.1$ in all experiments" (Sec. 3.4 says 0.2; Table 14's 0.1 row matches the main tables) |
# | `tau` | 1e-3 | Sec. 5.1 / Table 10 |
# | `alpha` | 0.75 | Table 10 |
# | `gamma` | 1.0 | not given: our choice, see `10_powerset` |
# | `t1_act`, `t2_act` | softplus, tanh | Table 8 |
# | `use_t2r`, `use_r2t` | True | Table 6 ablations "w/o T2R agg.", "w/o R2T agg." |
# | `region_sets` | True | False: Table 6 ablation "w/o region sets", single regions with a hard max (`10_powerset`) |
# | `exact` | False | enumerate the $2^M$ subsets instead of the NLAs (small $M$ only; Fig. 9 "without approximation") |
# | `impl` | `'auto'` | how $\bar S$ is computed: `'triton'`, the fused kernels (`10b_sbar_triton`, CUDA); `'fast'`, blocked from packed nodes (`10a_powerset_fast`); `'dense'`, the reference; or `'auto'`: dense when its $(C_i, C_j, M, K)$ scores fit in one block and in 16 MiB, else blocked, on a GPU too (there with the device's block budget, below; `'triton'` is opt-in: see *Which path on a GPU*). `exact` is always dense |
# | `block_bytes` | `'auto'` | the blocked path's budget per block: the device's (`device_block_bytes`: 16 MiB on a CPU, 256 MiB - 1 GiB on CUDA), settled when a run is built (`PowerCLIP.setup_model`); elsewhere 16 MiB |
#
# **Which path on a GPU.** `'auto'` takes the blocked path with the device's block budget there, not the fused Triton
# kernels, because that is what one NVIDIA H200 measured (`benchmarks/results/gpu_nvidia_h200_2026-11-28/`, the
# kernels' first GPU run, at the commit before this choice). The loss's forward and backward at the paper's per-GPU
# scale ($R=512$ local images against $C=4096$ gathered captions, CC3M node counts, bf16) took, Triton against the
# blocked path at the device's budget (1 GiB blocks) and at 16 MiB: 62.0 / 33.6 / 89.9 ms at $M=10$ (Triton 1.7 % of
# the card's bf16 peak on the useful products, blocked 3.2 %), 34.5 / 22.4 / 66.0 ms at $M=5$, 62.8 / 47.2 / 140.5 ms
# at $M=15$; with 16 nodes per caption 113.5 / 51.3 / 220.8 ms at $M=10$. The blocked path at the device's budget
# was the fastest at every $M$ in both, and neither met the 5 ms target. The Triton path stays what
# `method_cfg.impl=triton` asks for: it agrees with float64 as closely as the others (170 of 170 parity rows of that
# run), makes no host sync, and holds less memory (322 MiB at $M=10$ against the blocked path's 3.2 GiB), so it is
# the one to try where memory is short; `10b_sbar_triton` says what a next GPU run should try to make it faster. The
# step that run measured against 4,096 gathered captions ran `'auto'` as it then was, Triton: PowerCLIP 394.9 ms against
# CLIP's 339.4 ms (1.16x; the target is 1.10x). With the blocked path the loss should take about 28 ms less
# (62.0 - 33.6), so about 367 ms, 1.08x: **a projection**, until the next GPU run's `step-C4096` measures it.

# %%
#| export
IMPLS = ("auto", "triton", "fast", "dense")   # how S-bar is computed (above)


def triton_unavailable(x: torch.Tensor) -> str | None:
    """None when `impl='triton'` can run on `x` (a tensor or device; `10b_sbar_triton.unavailable`), else why not, in
    one line. Imports the kernels only for a CUDA device, where they can run: on the CPU they run only under Triton's
    interpreter, which must be asked for before the kernels are defined."""
    dev = torch.device(x.device if isinstance(x, torch.Tensor) else x)
    if dev.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return (f"impl='triton' needs a CUDA GPU (on the CPU: TRITON_INTERPRET=1 before importing powerclip, slow, "
                f"for tests); this is {dev.type}: use impl='fast'")
    try:
        from powerclip.sbar_triton import unavailable
    except ImportError as e:
        return f"impl='triton': {e}"
    return unavailable(x)


@dataclass
class PowerCLIPLossConfig:
    lam: float = 0.1          # weight of the triplet loss (Appendix F; Sec. 3.4 prints 0.2)
    tau: float = 1e-3         # NLA temperature (Sec. 5.1, Table 10)
    alpha: float = 0.75       # NLA-T2 interpolation between Lambda(0) and Lambda(1) (Table 10)
    gamma: float = 1.0        # triplet margin (not given by the paper: our choice)
    t1_act: str = "softplus"  # NLA-T1 activation (Table 8): softplus | relu | gelu | swish
    t2_act: str = "tanh"      # NLA-T2 activation (Table 8): tanh | sigmoid | softsign
    use_t2r: bool = True      # False: ablation "w/o T2R agg." (Table 6)
    use_r2t: bool = True      # False: ablation "w/o R2T agg." (Table 6)
    exact: bool = False       # True: exact powerset enumeration instead of the NLAs (O(2^M))
    debias_t2: bool = False   # add tau*alpha*M*log2 back to NLA-T2 (see 10_powerset)
    region_sets: bool = True  # False: ablation "w/o region sets" (Table 6): single regions, exact hard max
    impl: str = "auto"        # 'triton': fused kernels (10b, CUDA; opt-in); 'fast': blocked, packed nodes, memory
                              # O(R x C) (10a); 'dense': the (R, C, M, K) reference; 'auto': dense when its scores
                              # fit in one block and in 16 MiB (small batches), else fast, on a GPU too (see below)
    block_bytes: int | str = "auto"  # 'fast': bytes of one block of scores (rows x M x nodes); bounds the transient
                              # memory. 'auto': the device's budget, settled when a run is built; elsewhere 16 MiB

    def __post_init__(self):
        if not self.lam >= 0:     # NaN too: a negative or NaN weight would drop (or invert) the triplet term silently
            raise ValueError(f"lam: must be at least 0 (0: no triplet term), got {self.lam}")
        if not (self.use_t2r or self.use_r2t):
            raise ValueError("at least one of use_t2r / use_r2t must be on (set lam=0 to drop the triplet loss)")
        if self.tau <= 0 or not 0 <= self.alpha <= 1:
            raise ValueError(f"need tau > 0 and alpha in [0, 1], got tau={self.tau}, alpha={self.alpha}")
        bb = self.block_bytes
        if self.impl not in IMPLS or not (bb == "auto" or (type(bb) is int and bb >= 1)):
            raise ValueError(f"need impl one of {', '.join(map(repr, IMPLS))} and block_bytes 'auto' or an integer "
                             f">= 1, got impl={self.impl!r}, block_bytes={bb!r}")

    @property
    def block_budget(self) -> int:
        "block_bytes in bytes: 'auto' not settled for a device (outside a run) is a CPU's 16 MiB."
        return CPU_BLOCK_BYTES if self.block_bytes == "auto" else self.block_bytes

    def sbar_spec(self) -> SbarSpec:
        "The switches of S-bar, for the fast path."
        return SbarSpec(tau=self.tau, alpha=self.alpha, t1_act=self.t1_act, t2_act=self.t2_act, use_t2r=self.use_t2r,
                        use_r2t=self.use_r2t, debias_t2=self.debias_t2, region_sets=self.region_sets,
                        block_bytes=self.block_budget)


@dataclass
class PowersetInputs:
    """What the powerset loss needs of a batch (local, or gathered across processes). Tree nodes come padded,
    `phrases (C, K, D)` with `node_valid (C, K)`, or packed, `phrases (P, D)` with `node_text (P,)`: the row
    (text) of each node, sorted, every row with at least one node (`10a_powerset_fast`). Optional host facts, read
    on the CPU from the same masks before they moved to the device: `node_counts` (K of each row) and
    `all_regions_valid`; with both the loss reads nothing back from the device."""
    regions: torch.Tensor       # (C, M, D) region embeddings phi(I | R_m) (Eq. 2)
    region_valid: torch.Tensor  # (C, M) bool
    phrases: torch.Tensor       # (C, K, D) padded or (P, D) packed phrase embeddings p_B (Eq. 3)
    node_valid: torch.Tensor | None = None  # (C, K) bool: padded layout
    node_text: torch.Tensor | None = None   # (P,) long: packed layout
    node_counts: list[int] | None = None    # host: valid nodes of each row's text (node_valid's row sums), or None
    all_regions_valid: bool | None = None   # host: region_valid is all True, or None (not known on the host)

    def __post_init__(self):
        if (self.node_valid is None) == (self.node_text is None):
            raise ValueError("PowersetInputs needs exactly one of node_valid (padded phrases) and "
                             "node_text (packed phrases)")
        if self.node_counts is not None:   # against the shapes, on the host (the values are trusted, not read back)
            self.node_counts = check_counts(self.node_counts, self.regions.shape[0],
                                            None if self.node_text is None else self.node_text.shape[0],
                                            None if self.node_valid is None else self.node_valid.shape[1])

    def packed(self) -> tuple[torch.Tensor, torch.Tensor]:  # phrases (P, D), node_text (P,)
        return ((self.phrases, self.node_text) if self.node_valid is None
                else pack_nodes(self.phrases, self.node_valid, self.node_counts))

    def padded(self) -> tuple[torch.Tensor, torch.Tensor]:  # phrases (C, K, D), node_valid (C, K)
        return ((self.phrases, self.node_valid) if self.node_text is None
                else unpack_nodes(self.phrases, self.node_text, self.regions.shape[0], self.node_counts))


DENSE_AUTO_BYTES = 16 << 20   # impl='auto': the dense path only where its scores take at most this (and one block)


def powerset_similarity(
    images: PowersetInputs,   # (Ci, ...): its regions are used
    texts: PowersetInputs,    # (Cj, ...): its phrases are used
    cfg: PowerCLIPLossConfig,
) -> torch.Tensor:            # (Ci, Cj) S-bar: T2R + R2T similarity (Eq. 16), exact or approximated
    "S-bar = NLA-T1 + NLA-T2 of every image of `images` against every text of `texts` (or the exact forms), per cfg."
    if cfg.impl == "triton" and not cfg.exact:
        why = triton_unavailable(images.regions)
        if why:
            raise RuntimeError(why)
        from powerclip.sbar_triton import sbar_triton
        phrases, node_text = texts.packed()
        return sbar_triton(images.regions, images.region_valid, phrases, node_text, texts.regions.shape[0],
                           cfg.sbar_spec(), counts=texts.node_counts)
    if cfg.impl == "auto" and not cfg.exact:   # the dense scores' bytes against one block of the fast path
        Ci, M = images.regions.shape[:2]
        small = min(cfg.block_budget, DENSE_AUTO_BYTES)
        if texts.node_valid is not None:
            dense = Ci * texts.regions.shape[0] * M * texts.node_valid.shape[1] * 4
        elif texts.node_counts is not None:   # K_max from the host
            dense = Ci * texts.regions.shape[0] * M * max(texts.node_counts) * 4
        else:   # packed: K_max >= P / Cj, so Ci * M * P bounds the dense bytes from below without reading the counts,
                # and the host sync of K_max is paid only where the dense path may be taken (small batches)
            dense = Ci * M * texts.node_text.shape[0] * 4
            if dense <= small:
                dense = Ci * texts.regions.shape[0] * M * int(torch.bincount(texts.node_text).max()) * 4
        cfg = dataclasses.replace(cfg, impl="dense" if dense <= small else "fast")
    if cfg.impl == "fast" and not cfg.exact:
        phrases, node_text = texts.packed()
        return sbar_blocked(images.regions, images.region_valid, phrases, node_text, texts.regions.shape[0],
                            cfg.sbar_spec(), counts=texts.node_counts, all_valid=images.all_regions_valid)
    phrases, node_valid = texts.padded()
    rv = images.region_valid
    Q = powerset_scores(images.regions, rv, phrases)  # (Ci, Cj, M, K)
    S = Q.new_zeros(Q.shape[:2], dtype=torch.promote_types(Q.dtype, torch.float32))
    if not cfg.region_sets:  # single regions: exact by definition, whatever cfg.exact says
        if cfg.use_t2r:
            S = S + t2r_singletons(Q, rv, node_valid)
        if cfg.use_r2t:
            S = S + r2t_singletons(Q, rv, node_valid)
        return S
    if cfg.use_t2r:
        S = S + (t2r_exact(Q, rv, node_valid) if cfg.exact else nla_t1(Q, rv, node_valid, cfg.tau, cfg.t1_act))
    if cfg.use_r2t:
        S = S + (r2t_exact(Q, rv, node_valid) if cfg.exact
                 else nla_t2(Q, rv, node_valid, cfg.tau, cfg.alpha, cfg.t2_act, cfg.debias_t2))
    return S


# %% [markdown]
# ## The triplet loss over rows, and the total

# %%
#| export
def powerset_triplet_loss(
    local: PowersetInputs,                 # this process's R pairs
    gathered: PowersetInputs | None = None,  # all C pairs (None: single process, gathered = local)
    offset: int = 0,                       # rank * R
    cfg: PowerCLIPLossConfig = PowerCLIPLossConfig(),
) -> dict[str, torch.Tensor]:              # {'i2t': Phi(S) rows, 't2i': Phi(S^T) rows, 'sim_pos', 'sim_neg'}
    "Phi(S-bar) over the local image rows + Phi(S-bar^T) over the local text rows (Eq. 8)."
    R = local.regions.shape[0]
    pos = torch.arange(R, device=local.regions.device) + offset  # (R,)
    sim = lambda a, b: powerset_similarity(a, b, cfg)                      # regions of images a, phrases of texts b
    S_img, S_txt = contrastive_rows(sim, local, local, gathered, gathered)  # (R, C) each
    with torch.no_grad():  # for logging: mean positive and mean negative similarity of the local image rows
        diag = torch.zeros_like(S_img, dtype=torch.bool).scatter_(1, pos[:, None], True)       # (R, C)
        sim_pos = S_img.gather(1, pos[:, None]).mean()      # no boolean-mask indexing: its size is read back on a GPU
        n_neg = S_img.numel() - R
        sim_neg = S_img.masked_fill(diag, 0).sum() / n_neg if n_neg else S_img.new_zeros(())
    return {"i2t": triplet(S_img, pos, cfg.gamma), "t2i": triplet(S_txt, pos, cfg.gamma),
            "sim_pos": sim_pos, "sim_neg": sim_neg}


# %% [markdown]
# `powerclip_loss` returns the named terms that the trainer sums: `clip` and `powerset` (already weighted by
# $\lambda$), plus unweighted diagnostics under keys starting with `_` that the trainer logs but does not add. Given
# SigLIP's bias $b$ (`logit_bias`), the global term is SigLIP's loss instead (`siglip`, with `logit_scale` as $t$):
# PowerCLIP over SigLIP, the triplet term unchanged.

# %%
#| export
def powerclip_loss(
    image: torch.Tensor, text: torch.Tensor,  # (R, D) each, L2-normalised global embeddings
    logit_scale: torch.Tensor,                # () exp(log-temperature)
    local: PowersetInputs,                    # (R, ...) this process's regions and phrases
    cfg: PowerCLIPLossConfig = PowerCLIPLossConfig(),
    image_all: torch.Tensor | None = None, text_all: torch.Tensor | None = None,  # (C, D) gathered
    gathered: PowersetInputs | None = None,   # (C, ...) gathered regions and phrases
    offset: int = 0,                          # rank * R
    logit_bias: torch.Tensor | None = None,   # () SigLIP's b: the global term is SigLIP's loss ('siglip'), not CLIP's
) -> dict[str, torch.Tensor]:                 # {'clip' or 'siglip', 'powerset', '_triplet_i2t', '_triplet_t2i',
                                              # '_sim_pos', '_sim_neg'}
    "L_total = L_CLIP (or L_SigLIP) + lam * L_triplet, as named terms: sum the keys without a leading underscore."
    if logit_bias is None:
        out = {"clip": clip_loss(image, text, logit_scale, image_all, text_all, offset)}
    else:   # PowerCLIP over SigLIP: the sigmoid loss with the model's t and b, the triplet term unchanged
        out = {"siglip": siglip_loss(image, text, logit_scale, logit_bias, text_all, offset)}
    if cfg.lam > 0:
        t = powerset_triplet_loss(local, gathered, offset, cfg)
        out["powerset"] = cfg.lam * (t["i2t"] + t["t2i"])
        out.update({f"_triplet_{k}" if k in ("i2t", "t2i") else f"_{k}": v.detach() for k, v in t.items()})
    return out


# %% [markdown]
# ### Checks
#
# A random batch, built as the model will build it: patch and token embeddings, region masks and a tree.

# %%
def _batch(C=6, M=4, N=9, W=5, K=4, D=8, seed=0, dtype=torch.float64):
    from powerclip.powerset import phrase_embeddings, pool_normalize
    g = torch.Generator().manual_seed(seed)
    patches, tokens = torch.randn(C, N, D, generator=g, dtype=dtype), torch.randn(C, W, D, generator=g, dtype=dtype)
    rmask = torch.rand(C, M, N, generator=g) < 0.4
    rmask[..., 0] = True
    rv = torch.rand(C, M, generator=g) < 0.8
    rv[:, 0] = True
    inc = torch.rand(C, K, W, generator=g) < 0.5
    inc[:, 0] = True
    nv = torch.rand(C, K, generator=g) < 0.8
    nv[:, 0] = True
    inp = PowersetInputs(pool_normalize(patches, rmask), rv, phrase_embeddings(F.normalize(tokens, dim=-1), inc), nv)
    img, txt = (F.normalize(torch.randn(C, D, generator=g, dtype=dtype), dim=-1),
                F.normalize(torch.randn(C, D, generator=g, dtype=dtype), dim=-1))
    return img, txt, inp

def _rows(inp, sl):
    return PowersetInputs(inp.regions[sl], inp.region_valid[sl], inp.phrases[sl], inp.node_valid[sl])

_img, _txt, _inp = _batch()
_s = torch.tensor(20.0, dtype=torch.float64)
_cfg = PowerCLIPLossConfig(tau=0.05)
_full = powerclip_loss(_img, _txt, _s, _inp, _cfg)
print({k: round(float(v), 4) for k, v in _full.items()})
# over SigLIP: the global term is SigLIP's loss with t = logit_scale and b; the triplet term is the same number
_sg = powerclip_loss(_img, _txt, _s, _inp, _cfg, logit_bias=torch.tensor(-3.0, dtype=torch.float64))
assert "clip" not in _sg and torch.equal(_sg["powerset"], _full["powerset"])
assert_close(_sg["siglip"], siglip_loss(_img, _txt, _s, torch.tensor(-3.0, dtype=torch.float64)))

# %% [markdown]
# The row decomposition: two "processes" of three rows each, computing their blocks against the gathered
# batch, average to the single-process loss, for every ablation switch.

# %%
for cfg in (_cfg, PowerCLIPLossConfig(tau=0.05, use_r2t=False), PowerCLIPLossConfig(tau=0.05, use_t2r=False),
            PowerCLIPLossConfig(tau=0.05, exact=True), PowerCLIPLossConfig(tau=0.05, impl="dense"),
            PowerCLIPLossConfig(region_sets=False)):
    full = powerclip_loss(_img, _txt, _s, _inp, cfg)
    parts = [powerclip_loss(_img[sl], _txt[sl], _s, _rows(_inp, sl), cfg, _img, _txt, _inp, off)
             for sl, off in ((slice(0, 3), 0), (slice(3, 6), 3))]
    for k in ("clip", "powerset"):
        assert_close((parts[0][k] + parts[1][k]) / 2, full[k])


# %% [markdown]
# The fast path against the dense reference through the whole loss, for each switch, with the tree nodes
# padded or packed, on one process and in the local-row form of two: values and gradients (regions,
# phrases, global embeddings) agree to $10^{-9}$ in float64. (`10a_powerset_fast` tests $\bar S$ itself on
# every activation and on ragged cases.)

# %%
def _packed(inp):
    ph, nt = inp.packed()
    return PowersetInputs(inp.regions, inp.region_valid, ph, node_text=nt)

def _grads(cfg, packed, two_procs, dtype=torch.float64):
    "Loss and its gradients w.r.t. regions, phrases (padded layout), image and text embeddings."
    reg, ph, img, txt = (t.to(dtype).clone().requires_grad_() for t in (_inp.regions, _inp.phrases, _img, _txt))
    inp = PowersetInputs(reg, _inp.region_valid, ph, _inp.node_valid)
    inp = _packed(inp) if packed else inp
    if two_procs:
        rows = lambda sl: _packed(_rows(PowersetInputs(reg, _inp.region_valid, ph, _inp.node_valid),
                                        sl)) if packed else _rows(inp, sl)
        outs = [powerclip_loss(img[sl], txt[sl], _s, rows(sl), cfg, img, txt, inp, off)
                for sl, off in ((slice(0, 3), 0), (slice(3, 6), 3))]
        loss = sum(o["clip"] + o["powerset"] for o in outs) / 2
    else:
        out = powerclip_loss(img, txt, _s, inp, cfg)
        loss = out["clip"] + out["powerset"]
    return (loss.detach(), *torch.autograd.grad(loss, (reg, ph, img, txt)))

for kw in (dict(tau=0.05), dict(tau=0.05, t1_act="gelu", t2_act="softsign"), dict(use_r2t=False), dict(use_t2r=False),
           dict(tau=0.05, debias_t2=True), dict(region_sets=False), dict(region_sets=False, use_t2r=False),
           dict(exact=True)):
    ref = _grads(PowerCLIPLossConfig(impl="dense", gamma=5.0, **kw), packed=False, two_procs=False)
    for packed in (False, True):
        for two in (False, True):
            got = _grads(PowerCLIPLossConfig(impl="fast", gamma=5.0, **kw), packed, two)
            for a, b in zip(got, ref):
                assert_close(a, b, rtol=0, atol=1e-9, msg=lambda m: f"{kw} packed={packed} two={two}: {m}")
print("fast == dense through powerclip_loss (padded and packed nodes, one and two processes)")
# 'auto' (the default) is one of the two, picked by the size of the dense scores: here they fit one block (dense);
# with a 1-byte block they do not (fast). Bitwise the same numbers as the path it picked.
for _bb, _path in ((16 << 20, "dense"), (1, "fast")):
    for packed in (False, True):
        got = _grads(PowerCLIPLossConfig(impl="auto", gamma=5.0, tau=0.05, block_bytes=_bb), packed, False)
        want = _grads(PowerCLIPLossConfig(impl=_path, gamma=5.0, tau=0.05, block_bytes=_bb), packed, False)
        for a, b in zip(got, want):
            assert torch.equal(a, b), (_bb, _path, packed)
try:
    PowersetInputs(_inp.regions, _inp.region_valid, _inp.phrases)
    raise AssertionError
except ValueError as e:
    assert "exactly one" in str(e)

# %% [markdown]
# `impl='triton'`, the fused kernels of `10b_sbar_triton`, through the same loss, nodes padded and packed, one process
# and two. The kernels compute in float32 (or bf16), so they are held to the float64 reference within float32's
# reach; here they run in Triton's interpreter on the CPU. Without a GPU and without the interpreter, asking for them is
# one line.

# %%
_worst = 0.0
for kw in (dict(tau=0.05), dict(region_sets=False), dict(use_t2r=False, tau=1e-3)):
    ref = _grads(PowerCLIPLossConfig(impl="dense", gamma=5.0, **kw), packed=False, two_procs=False)
    for packed in (False, True):
        for two in (False, True):
            got = _grads(PowerCLIPLossConfig(impl="triton", gamma=5.0, **kw), packed, two, torch.float32)
            for a, b in zip(got, ref):
                _worst = max(_worst, float((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-12)))
assert _worst < 1e-4, _worst
print(f"triton (float32) against dense (float64): largest relative error {_worst:.1e}")
_env = os.environ.pop("TRITON_INTERPRET", None)
try:
    print(triton_unavailable(torch.device("cpu")))
    assert "needs a CUDA GPU" in triton_unavailable(_inp.regions)
finally:
    if _env is not None:
        os.environ["TRITON_INTERPRET"] = _env


# %% [markdown]
# The host facts change no number: the loss and its gradients with `node_counts` and `all_regions_valid` given equal
# those without, bitwise, on the fast path (padded and packed nodes, one and two processes; a batch with an invalid
# region, and one without). Counts that do not fit the shapes are a one-line error.

# %%
def _with_facts(inp: PowersetInputs) -> PowersetInputs:
    "The same inputs with their host facts (read here from CPU tensors: what the data side does before the move)."
    counts = (inp.node_valid.sum(1) if inp.node_text is None else torch.bincount(inp.node_text,
                                                                                minlength=inp.regions.shape[0]))
    return dataclasses.replace(inp, node_counts=counts.tolist(), all_regions_valid=bool(inp.region_valid.all()))


def _loss_grads(inp, cfg, facts, two):
    reg, ph = inp.regions.clone().requires_grad_(), inp.phrases.clone().requires_grad_()
    full = dataclasses.replace(inp, regions=reg, phrases=ph)
    f = _with_facts if facts else (lambda x: x)
    if two:
        rows = lambda sl: f(_rows(full, sl) if full.node_text is None else _packed(_rows(_padded_of(full), sl)))
        loss = sum(sum(v for k, v in powerclip_loss(_img[sl], _txt[sl], _s, rows(sl), cfg, _img, _txt, f(full),
                                                   off).items() if not k.startswith("_"))
                   for sl, off in ((slice(0, 3), 0), (slice(3, 6), 3)))
    else:
        out = powerclip_loss(_img, _txt, _s, f(full), cfg)
        loss = sum(v for k, v in out.items() if not k.startswith("_"))
    return (loss.detach(), *torch.autograd.grad(loss, (reg, ph)))


def _padded_of(inp):
    ph, nv = inp.padded()
    return PowersetInputs(inp.regions, inp.region_valid, ph, nv)


_all_valid = dataclasses.replace(_inp, region_valid=torch.ones_like(_inp.region_valid))
for inp in (_inp, _packed(_inp), _all_valid, _packed(_all_valid)):
    for cfg in (PowerCLIPLossConfig(impl="fast", tau=0.05, gamma=5.0, block_bytes=600),
                PowerCLIPLossConfig(impl="fast", region_sets=False, gamma=5.0)):
        for two in (False, True):
            a, b = _loss_grads(inp, cfg, False, two), _loss_grads(inp, cfg, True, two)
            assert all(torch.equal(x, y) for x, y in zip(a, b)), (cfg, two)
for bad, msg in ((dict(node_counts=[1] * 5), "5 given for 6 texts"), (dict(node_counts=[9] * 6), "padded width is 4")):
    try:
        dataclasses.replace(_inp, **bad)
        raise AssertionError(msg)
    except ValueError as e:
        assert msg in str(e), (msg, e)
# the logged means: those of the positive pairs and of all the others
_t = powerset_triplet_loss(_inp, cfg=_cfg)
_S = powerset_similarity(_inp, _inp, _cfg)
assert_close(_t["sim_pos"], _S.diagonal().mean())
assert_close(_t["sim_neg"], _S[~torch.eye(6, dtype=torch.bool)].mean())
# block_bytes: 'auto' (16 MiB outside a run) or a positive integer
assert PowerCLIPLossConfig().block_budget == 16 << 20
assert PowerCLIPLossConfig(block_bytes=4096).sbar_spec().block_bytes == 4096
for bb in ("autoo", 0, 1.5):
    try:
        PowerCLIPLossConfig(block_bytes=bb)
        raise AssertionError(bb)
    except ValueError as e:
        assert "block_bytes 'auto' or an integer >= 1" in str(e)
try:
    PowerCLIPLossConfig(impl="cuda")
    raise AssertionError
except ValueError as e:
    assert "impl" in str(e)

# %% [markdown]
# Against a per-pair reference written straight from Eqs. 6-9 with the exact oracle, and the exact switch
# against the NLA at small $\tau$ (where Theorem 1 and 2 say they are close; `14_approximation` measures how close):

# %%
_cfgx = PowerCLIPLossConfig(exact=True, gamma=0.5)
_S = torch.stack([torch.stack([
    (t2r_exact(powerset_scores(_inp.regions[i:i+1], _inp.region_valid[i:i+1], _inp.phrases[j:j+1]),
               _inp.region_valid[i:i+1], _inp.node_valid[j:j+1])
     + r2t_exact(powerset_scores(_inp.regions[i:i+1], _inp.region_valid[i:i+1], _inp.phrases[j:j+1]),
                 _inp.region_valid[i:i+1], _inp.node_valid[j:j+1]))[0, 0]
    for j in range(6)]) for i in range(6)])
_phi = lambda X: sum(max(max(float(X[i, j]) for j in range(6) if j != i) - float(X[i, i]) + 0.5, 0.0)
                     for i in range(6)) / 6
assert abs(float(powerclip_loss(_img, _txt, _s, _inp, _cfgx)["powerset"]) - 0.1 * (_phi(_S) + _phi(_S.T))) < 1e-12
# T2R: NLA-T1 is within tau*M*log2 of exact. R2T: NLA-T2 tends to Lambda(alpha), which only brackets the
# exact R2T (Theorem 2), so its gap is of the order of Lambda(1) - Lambda(0), not of tau.
_r = lambda **kw: powerset_similarity(_inp, _inp, PowerCLIPLossConfig(**kw))
for part, kw in (("T2R", dict(use_r2t=False)), ("R2T", dict(use_t2r=False))):
    gap = (_r(tau=1e-4, **kw) - _r(exact=True, **kw)).abs().max()
    print(f"{part}: max |NLA - exact| at tau=1e-4: {float(gap):.2e}")
assert (_r(tau=1e-4, use_r2t=False) - _r(exact=True, use_r2t=False)).abs().max() <= 1e-4 * 4 * 0.6932


# %% [markdown]
# Gradients in float64 through the embeddings, for the default loss and each ablation:

# %%
def _loss_of(regions, phrases, img, txt, cfg):
    inp = PowersetInputs(regions, _inp.region_valid, phrases, _inp.node_valid)
    return sum(v for k, v in powerclip_loss(img, txt, _s, inp, cfg).items() if not k.startswith("_"))

_args = tuple(t.clone().requires_grad_() for t in (_inp.regions, _inp.phrases, _img, _txt))
for cfg in (PowerCLIPLossConfig(tau=0.3, gamma=5.0), PowerCLIPLossConfig(tau=0.3, gamma=5.0, use_r2t=False),
            PowerCLIPLossConfig(tau=0.3, gamma=5.0, use_t2r=False), PowerCLIPLossConfig(gamma=5.0, exact=True),
            PowerCLIPLossConfig(gamma=5.0, region_sets=False), PowerCLIPLossConfig(tau=0.3, gamma=5.0, impl="dense")):
    assert gradcheck(lambda *a: _loss_of(*a, cfg), _args, eps=1e-6, atol=1e-5)
print("gradcheck: total loss, w/o R2T, w/o T2R, exact, w/o region sets, dense")

# %% [markdown]
# Stable at $\tau=10^{-3}$ under bf16 autocast: the aggregation runs in float32 inside, the loss and every
# gradient stay finite.

# %%
_img32, _txt32, _inp32 = _batch(C=8, M=10, N=64, W=12, K=20, D=32, seed=1, dtype=torch.float32)
_params = [t.clone().requires_grad_() for t in (_inp32.regions, _inp32.phrases, _img32, _txt32)]
with torch.autocast("cpu", dtype=torch.bfloat16):
    _out = powerclip_loss(_params[2], _params[3], torch.tensor(100.0),
                          PowersetInputs(_params[0], _inp32.region_valid, _params[1], _inp32.node_valid))
    _tot = _out["clip"] + _out["powerset"]
_tot.backward()
assert torch.isfinite(_tot) and all(torch.isfinite(p.grad).all() for p in _params)
print({k: round(float(v.detach()), 4) for k, v in _out.items()})
