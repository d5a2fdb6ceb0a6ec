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
#| default_exp eval.metrics

# %%
#| export
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

# %%
#| hide
from fastcore.test import test_close, test_eq, test_fail


# %% [markdown]
# # Evaluation metrics
#
# > One implementation of each metric the project reports, with one rule for ties and NaNs, in percent.
#
# Retrieval recall, classification accuracy, hard-negative accuracy, Winoground scores, region classification and the
# linear probe.

# %% [markdown]
# The evaluation package `powerclip.eval` is read in this order:
#
# | notebook | module | job |
# |---|---|---|
# | `60_eval_metrics` | `eval.metrics` | the metrics (this notebook): pure tensor functions of scores |
# | `60a_eval_items` | `eval.items` | the errors of the readers (`MissingData`, `BadData`) and the bad items they skip, count and name (`ItemSkips`) |
# | `61_eval_data` | `eval.data` | readers of benchmark folders on disk, and the one writer of the world's benchmark folder |
# | `62_eval_models` | `eval.models` | the one model loader, the scorers a method offers, the feature cache, the `Evaluator` |
# | `63_eval_benchmarks` | `eval.benchmarks` | the paper's 28 benchmarks: registry, clip_benchmark's readers and CLI, with downloads refused |
# | `64_eval_tasks` | `eval.tasks` | the tasks on an `Evaluator`, each a record of the task registry; one run (checkpoint x data x tasks), the suite |
# | `65_eval_tables` | `eval.tables` | result tables side by side and in the paper's layouts |
# | `66_eval_cli`, `66a_eval_main` | `eval.cli`, `eval.__main__` | `powerclip-eval` / `python -m powerclip.eval` |
#
# After the heatmaps (`67_heatmaps`), `68_eval_world_scores` (`eval.world_scores`) scores a run on the world's held-out
# scenes as the comparison (`70_compare`) reports it, from the tasks above and the heatmaps' pointing game.
#
# Every metric here takes **scores**, a higher score meaning "more similar", and never looks at how they were
# made: the cosine of global embeddings, FILIP's late interaction, anything a method's `Scorer` returns
# (`62_eval_models`).
#
# **The tie rule.** A wrong candidate *outranks* the correct one unless it scores strictly lower:
# $\text{outranks}(s_{wrong}, s_{right}) = \lnot(s_{wrong} < s_{right})$. So a correct candidate that ties with a wrong
# one counts as ranked below it, and a model whose scores are all equal gets R@k = 0, hard-negative accuracy 0
# and Winoground 0, instead of a number that depends on the order of the files (what `topk` gives, and what
# the world evaluation of the demo used to give). SugarCrepe and Winoground use strict `>` in their own papers too.
# clip_benchmark breaks ties by index, which favours the correct candidate under `argmax`; on continuous scores
# (no ties) its numbers and ours agree (`tests/test_eval.py`).
#
# **NaN.** The same comparison settles NaN: `x < NaN` and `NaN < x` are false, so a NaN score of a wrong candidate
# outranks the correct one and a NaN score of the correct candidate is never a hit. (Non-finite *features* do not
# get this far: the evaluator stops with one line, `62_eval_models`.)
#
# **Units.** Every accuracy and recall is reported in percent.

# %%
#| export
def outranks(wrong: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """Elementwise (broadcast) bool: the wrong candidate's score is not strictly below the right one's (ties and NaN:
    True)."""
    return ~(wrong < right)


# %%
test_eq(outranks(torch.tensor([0.1, 0.5, 0.9, float('nan'), 0.2]),
                 torch.tensor([0.5, 0.5, 0.5, 0.5, float('nan')])).tolist(),
        [False, True, True, True, True])


# %% [markdown]
# ## Retrieval
#
# With a score matrix $S \in \mathbb{R}^{I \times T}$ and the image $\pi(t)$ of each caption, the rank of caption $t$
# is the number of wrong images that outrank its own, $r(t) = |\{i \ne \pi(t) : \text{outranks}(S_{it}, S_{\pi(t) t})\}|$,
# and text→image R@k is the share of captions with $r(t) < k$. An image has several captions: its rank is that of
# its best caption, $r(i) = |\{t : \pi(t) \ne i,\ \text{outranks}(S_{it}, \max_{\pi(t')=i} S_{it'})\}|$ (Karpathy's
# protocol; a NaN caption score is left out of the max, an image whose captions are all NaN is a miss).
# Under random scores text→image R@k is $k/I$ and image→text R@k is $1 - \binom{T-p}{k}/\binom{T}{k}$ for $p$
# captions per image (`chance_recall`).

# %%
#| export
class RetrievalRanks(NamedTuple):
    "Each image's and each caption's rank under the tie rule (`retrieval_ranks`)."
    rank_i: torch.Tensor   # (I,) long: wrong captions that outrank the image's best caption
    hit_i: torch.Tensor    # (I,) bool: the image has a best caption (one with a caption that is not NaN)
    rank_t: torch.Tensor   # (T,) long: wrong images that outrank the caption's own image
    hit_t: torch.Tensor    # (T,) bool: the caption's score with its own image is not NaN
    has: torch.Tensor      # (I,) bool: the image has a caption (images without one are text->image distractors only)

def retrieval_ranks(sim: torch.Tensor, text_image: torch.Tensor) -> RetrievalRanks:
    """sim `(I, T)` image-caption scores, text_image `(T,)` long: the image of each caption. The ranks of both
    directions (see above), the one rank computation under `retrieval_recall` and `recall_hits`."""
    I, T = sim.shape
    text_image = torch.as_tensor(text_image, dtype=torch.long)
    if text_image.shape != (T,):
        raise ValueError(f'text_image must be ({T},), got {tuple(text_image.shape)}')
    if T and (text_image.min() < 0 or text_image.max() >= I):
        raise ValueError('text_image holds an index outside [0, I)')
    own = torch.zeros(I, T, dtype=torch.bool)
    own[text_image, torch.arange(T)] = True
    # images without captions: text->image distractors only
    has = own.any(1)
    if not has.any():
        raise ValueError('no image has a caption')
    sim = sim.float()
    # text -> image: wrong images that outrank the caption's own image
    pos_t = sim[text_image, torch.arange(T)]                                    # (T,)
    rank_t = (outranks(sim, pos_t[None]) & ~own).sum(0)                         # (T,)
    hit_t = ~pos_t.isnan()                                                      # (T,) a NaN positive is never a hit
    # image -> text: wrong captions that outrank the image's best caption (NaN captions left out of the max)
    best_i = sim.masked_fill(~own | sim.isnan(), -math.inf).max(1).values      # (I,)
    best_i = best_i.masked_fill(best_i == -math.inf, math.nan)                  # every caption NaN: no best caption
    rank_i = (outranks(sim, best_i[:, None]) & ~own).sum(1)                     # (I,)
    hit_i = ~best_i.isnan()                                                     # (I,)
    return RetrievalRanks(rank_i, hit_i, rank_t, hit_t, has)

def retrieval_recall(sim: torch.Tensor, text_image: torch.Tensor, ks=(1, 5, 10)) -> dict[str, float]:
    """sim `(I, T)` image-caption scores, text_image `(T,)` long: the image of each caption.
    Returns `i2t_R@k` and `t2i_R@k` in percent (see the tie rule above)."""
    r = retrieval_ranks(sim, text_image)
    out = {}
    for k in ks:
        out[f'i2t_R@{k}'] = 100 * ((r.rank_i < k) & r.hit_i)[r.has].double().mean().item()
    for k in ks:
        out[f't2i_R@{k}'] = 100 * ((r.rank_t < k) & r.hit_t).double().mean().item()
    return out

def recall_hits(sim: torch.Tensor, text_image: torch.Tensor, k: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """R@k item by item, from the same ranks as `retrieval_recall`: `(I,)` image-to-text hits (an image without a
    caption: False) and `(T,)` text-to-image hits. Their means over the images with a caption and over the captions
    are `retrieval_recall`'s numbers (/ 100)."""
    r = retrieval_ranks(sim, text_image)
    return (r.rank_i < k) & r.hit_i, (r.rank_t < k) & r.hit_t

def chance_recall(n_images: int, captions_per_image: int, ks=(1, 5, 10)) -> dict[str, float]:
    "Expected R@k (%) of random scores with `captions_per_image` captions for each of `n_images` images."
    T, p = n_images * captions_per_image, captions_per_image
    out = {f'i2t_R@{k}': 100 * (1 - math.comb(T - p, k) / math.comb(T, k)) if k <= T - p else 100.0 for k in ks}
    out.update({f't2i_R@{k}': 100 * min(k, n_images) / n_images for k in ks})
    return out


# %% [markdown]
# Hand cases: identical image and text embeddings give R@k = 100; a constant score gives 0 (ties count against);
# a caption whose image sits third gets t2i R@1 = R@2 = 0 and R@3 = 100. Images without a caption are distractors
# for text→image and are left out of image→text.

# %%
g = torch.Generator().manual_seed(0)
e = F.normalize(torch.randn(20, 16, generator=g), dim=-1)
r = retrieval_recall(e @ e.T, torch.arange(20))
assert all(v == 100 for v in r.values()), r
# 2 captions per image, both identical to the image embedding
r = retrieval_recall(e @ e.repeat_interleave(2, 0).T, torch.arange(20).repeat_interleave(2))
assert all(v == 100 for v in r.values()), r
assert all(v == 0 for v in retrieval_recall(torch.ones(20, 20), torch.arange(20)).values())
# caption 0 of image 2 sits third; image 3 prefers caption 0
sim = torch.tensor([[0.9, 0.0], [0.8, 0.0], [0.7, 0.2], [0.4, 0.3]])
test_eq(retrieval_recall(sim, torch.tensor([2, 3]), ks=(1, 2, 3)), {'i2t_R@1': 50.0, 'i2t_R@2': 100.0, 'i2t_R@3': 100.0,
                                                                    't2i_R@1': 50.0, 't2i_R@2': 50.0, 't2i_R@3': 100.0})
test_fail(lambda: retrieval_recall(torch.ones(3, 0), torch.zeros(0, dtype=torch.long)),
          contains='no image has a caption')
# per item (the world evaluation's bootstrap resamples them): ties count against, an image without a caption misses
_sim, _ti = torch.tensor([[1.0, 1.0, 1.0], [0.0, 2.0, 1.0], [0.0, 0.0, 0.0]]), torch.tensor([0, 1, 1])
_i2t, _t2i = recall_hits(_sim, _ti)
test_eq((_i2t.tolist(), _t2i.tolist()), ([False, True, False], [True, True, False]))
test_close([100 * _i2t[:2].float().mean().item(), 100 * _t2i.float().mean().item()],
           [retrieval_recall(_sim, _ti, (1,))[k] for k in ('i2t_R@1', 't2i_R@1')])
test_close(chance_recall(100, 1, ks=(1,))['i2t_R@1'], 1.0)
test_close(chance_recall(239, 5)['t2i_R@5'], 500 / 239)
# Monte-Carlo check of the image->text formula
sims = torch.rand(400, 10, 30, generator=g)
ti = torch.arange(10).repeat_interleave(3)
mc = np.mean([retrieval_recall(s, ti, ks=(1, 5))['i2t_R@5'] for s in sims])
test_close(mc, chance_recall(10, 3, ks=(5,))['i2t_R@5'], eps=4)

# %% [markdown]
# Where the tie rule and `topk` part: the demo's world evaluation used to take the top k with `topk`, which puts
# the first of several tied candidates on top. Without ties the two agree (image 0 owns captions 0 and 2, image 1
# caption 1); with a tie, `topk` counted a hit that the rule here does not:

# %%
_sim = torch.tensor([[0.9, 0.1, 0.8], [0.2, 0.7, 0.1]])
test_eq(retrieval_recall(_sim, torch.tensor([0, 1, 0]), ks=(1,)), {'i2t_R@1': 100.0, 't2i_R@1': 100.0})
# captions 0 and 1 are closer to the other image
_sim = torch.tensor([[0.1, 0.9, 0.8], [0.2, 0.7, 0.1]])
_r = retrieval_recall(_sim, torch.tensor([0, 1, 0]), ks=(1, 2))
test_close(list(_r.values()), [50.0, 100.0, 100 / 3, 100.0])
test_eq(list(_r), ['i2t_R@1', 'i2t_R@2', 't2i_R@1', 't2i_R@2'])
_tie = torch.tensor([[0.5, 0.5], [0.5, 0.5]])                               # every score tied
_topk_hits = (_tie.topk(1, dim=0).indices == torch.arange(2)[None]).any(0).float().mean().item()
test_eq((_topk_hits, retrieval_recall(_tie, torch.arange(2), ks=(1,))['t2i_R@1']), (0.5, 0.0))

# %% [markdown]
# NaN scores: a caption whose own score is NaN is a miss however large k is; a NaN on a wrong image counts against
# the correct one; an image keeps its best finite caption.

# %%
_sim = torch.tensor([[float('nan'), 0.1, 0.9], [0.2, 0.7, 0.1]])           # image 0 owns captions 0 and 2
_r = retrieval_recall(_sim, torch.tensor([0, 1, 0]), ks=(1, 2))
test_eq(list(_r), ['i2t_R@1', 'i2t_R@2', 't2i_R@1', 't2i_R@2'])
test_close(list(_r.values()), [100.0, 100.0, 200 / 3, 200 / 3])
_r = retrieval_recall(torch.tensor([[0.9, 0.1], [float('nan'), 0.7]]), torch.arange(2), ks=(1,))
test_eq(_r, {'i2t_R@1': 50.0, 't2i_R@1': 50.0})                           # the NaN wrong image outranks caption 0's own
assert all(v == 0 for v in retrieval_recall(torch.full((3, 3), float('nan')), torch.arange(3), ks=(1, 5)).values())


# %% [markdown]
# ## Classification
#
# Logits $(n, K)$; the true class is in the top $k$ when fewer than $k$ other classes outrank it (top-k is reported
# only for k < K). Mean per-class recall averages the top-1 accuracy of each class present (what clip_benchmark
# reports beside top-1 for unbalanced sets).

# %%
#| export
def true_class_rank(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """logits `(n, K)`, labels `(n,)` -> `(n,)` long: the other classes that outrank the true one (K when its logit is
    NaN)."""
    true = logits.gather(1, labels[:, None])                                    # (n, 1)
    other = torch.ones_like(logits, dtype=torch.bool).scatter(1, labels[:, None], False)   # (n, K)
    rank = (outranks(logits, true) & other).sum(1)                              # (n,)
    return rank.masked_fill(true[:, 0].isnan(), logits.shape[1])                # a NaN true logit is never a hit

def classification_metrics(logits: torch.Tensor, labels: torch.Tensor, ks=(1, 5)) -> dict[str, float]:
    "logits `(n, K)`, labels `(n,)` long -> `top{k}` accuracy and `mean_per_class_recall` in percent."
    n, K = logits.shape
    labels = torch.as_tensor(labels, dtype=torch.long)
    if labels.shape != (n,):
        raise ValueError(f'labels must be ({n},), got {tuple(labels.shape)}')
    if n == 0:
        raise ValueError('no samples')
    if labels.min() < 0 or labels.max() >= K:
        raise ValueError(f'labels outside [0, {K})')
    rank = true_class_rank(logits, labels)                                      # (n,)
    out = {f'top{k}': 100 * (rank < k).double().mean().item() for k in ks if k < K}   # top-K is always 100: left out
    hit = (rank == 0).double()
    out['mean_per_class_recall'] = 100 * torch.stack([hit[labels == c].mean() for c in labels.unique()]).mean().item()
    return out


# %% [markdown]
# A classifier that always answers class 2 scores the share of class 2; its per-class recall is $1/K_{present}$.

# %%
labels = torch.tensor([0, 1, 2, 2, 2, 3, 3, 1, 2, 0])
always2 = F.one_hot(torch.full((10,), 2), 4).float()
m = classification_metrics(always2, labels, ks=(1, 2))
test_close(m['top1'], 40.0)
test_close(m['mean_per_class_recall'], 25.0)
test_eq(m['top2'], 40.0)  # ties: others at 0
test_eq(classification_metrics(F.one_hot(labels, 4).float(), labels)['top1'], 100.0)
assert 'top5' not in m
test_eq(classification_metrics(torch.full((3, 4), float('nan')), torch.tensor([0, 1, 2]), ks=(1, 3))['top3'], 0.0)


# %% [markdown]
# ## Hard negatives and Winoground
#
# **Hard negatives** (SugarCrepe, and the world's hard negatives in the same format): an item is right when the
# negative caption does not outrank the true one, $s(v, t^-) < s(v, t^+)$; ties are counted and wrong.
# **Winoground**: for captions $c_0, c_1$ and images $i_0, i_1$ with $s_{ci} = s(c, i)$,
# text score $= [s_{00} > s_{10}] \wedge [s_{11} > s_{01}]$ (each image picks its caption),
# image score $= [s_{00} > s_{01}] \wedge [s_{11} > s_{10}]$ (each caption picks its image), group = both.

# %%
#| export
def hard_negative_accuracy(pos: torch.Tensor, neg: torch.Tensor) -> dict[str, float]:
    "pos, neg `(n,)` scores of the true and the negative caption -> `acc` (%), `n`, `ties` (ties count as wrong)."
    pos, neg = torch.as_tensor(pos).float(), torch.as_tensor(neg).float()
    if pos.shape != neg.shape or pos.ndim != 1:
        raise ValueError(f'pos and neg must be (n,), got {tuple(pos.shape)}, {tuple(neg.shape)}')
    if len(pos) == 0:
        raise ValueError('no items')
    return dict(acc=100 * (~outranks(neg, pos)).double().mean().item(), n=len(pos), ties=int((pos == neg).sum()))

def winoground_scores(s: torch.Tensor) -> dict[str, float]:
    "s `(n, 2, 2)`: s[:, c, i] = score of caption c and image i -> `text`, `image`, `group` scores (%), `n`."
    s = torch.as_tensor(s).float()
    if s.ndim != 3 or s.shape[1:] != (2, 2):
        raise ValueError(f's must be (n, 2, 2), got {tuple(s.shape)}')
    beats = lambda right, wrong: ~outranks(wrong, right)
    text = beats(s[:, 0, 0], s[:, 1, 0]) & beats(s[:, 1, 1], s[:, 0, 1])
    image = beats(s[:, 0, 0], s[:, 0, 1]) & beats(s[:, 1, 1], s[:, 1, 0])
    return dict(text=100 * text.double().mean().item(), image=100 * image.double().mean().item(),
                group=100 * (text & image).double().mean().item(), n=len(s))


# %%
test_eq(hard_negative_accuracy(torch.tensor([0.5, 0.2, 0.3]), torch.tensor([0.5, 0.2, 0.3])),
        dict(acc=0.0, n=3, ties=3))
test_eq(hard_negative_accuracy(torch.tensor([0.6, 0.2, 0.3, 0.9]), torch.tensor([0.5, 0.4, 0.3, 0.1])),
        dict(acc=50.0, n=4, ties=1))
test_eq(hard_negative_accuracy(torch.tensor([float('nan'), 0.6]), torch.tensor([0.1, float('nan')]))['acc'], 0.0)
cases = torch.tensor([[[1.0, 0.0], [0.0, 1.0]],     # perfect: 1, 1, 1
                      [[0.5, 0.6], [0.4, 0.7]],     # each image picks its caption, but caption 0 picks image 1: 1, 0, 0
                      [[0.5, 0.4], [0.6, 0.7]],     # each caption picks its image, image 0 picks caption 1: 0, 1, 0
                      [[0.3, 0.3], [0.3, 0.3]]])    # all tied: 0, 0, 0
test_eq([winoground_scores(c[None]) for c in cases][:3],
        [dict(text=100.0, image=100.0, group=100.0, n=1), dict(text=100.0, image=0.0, group=0.0, n=1),
         dict(text=0.0, image=100.0, group=0.0, n=1)])
test_eq(winoground_scores(cases), dict(text=50.0, image=50.0, group=25.0, n=4))

# %% [markdown]
# ## Region classification
#
# The region task (`64_eval_tasks`) scores each ground-truth region of an image against a text embedding of every
# class name: logits $\ell_{rk}$ for region $r$ and class $k$, labels $y_r$. Three numbers come from them:
#
# - **top-1 accuracy** and **mean per-class recall** (`classification_metrics`, the tie rule above: a true class tied
#   with another is not a hit);
# - **AP50 with ground-truth boxes** (`ap50`): each region is a detection of every class with the score
#   $p_{rk}=\mathrm{softmax}_k(\ell_{rk})$, the probability a detector's classification head would give it; for each class
#   $k$ with at least one region, the detections of $k$ are ranked over the whole set by $p_{rk}$ and a detection is a
#   true positive when $y_r=k$; the average precision is COCO's (precision made monotone from the right, read at the
#   101 recalls $0, 0.01, \dots, 1$); `ap50` is its mean over the classes that have regions, in percent.
#
# **COCO's recall grid, to the last bit.** pycocotools reads the precision at `np.linspace(0, 1, 101)` in float64, the
# first rank whose recall is at least the grid point (`np.searchsorted(recall, grid, side='left')`). That grid is not
# $i/100$ at every point: `np.linspace` computes $i \cdot 0.01$, so point 35 is `0.35000000000000003`, above the
# recall $7/20 = 0.35$ of a class's 7th hit out of 20, which therefore does not reach it (the 8th hit does). Ten of the
# 101 points differ from $i/100$ this way (35, 41, 47, 57, 69, 70, 82, 83, 94, 95), and `torch.linspace`, which this
# notebook used before, rounds six points otherwise (35, 41, 47, 56, 68, 81: it gives `0.5599999999999999` at 56 and
# `0.7` at 70), so a class with 20 or 100 positives could be read at another rank than COCO reads it (the hand case
# below moves by 0.05 points). `RECALL_POINTS` is `np.linspace`'s array, and `tests/test_region_edges.py` checks
# `average_precision` against pycocotools' own `COCOeval` where it is installed, and against the algorithm written out
# in NumPy where it is not.
#
# **How it relates to the paper's detector AP50** (Table 15, OV-COCO): a detector proposes boxes and is scored with
# COCO's AP at IoU $\ge 0.5$; here the proposals are the ground-truth boxes themselves, so every box matches its own
# object at IoU 1, no object is missed and no box is a duplicate. What is left is exactly the classification half of
# detection AP50: whether, for each class, the regions of that class get higher scores than the regions of the others.
# It is the "zero-shot inference with ground-truth boxes" that RegionCLIP and CLIM report for region representations
# without a trained detector; it is an upper bound on what the same representation could give inside a detector (which
# also misses and mislocates), and its numbers are not the paper's detector numbers.
#
# **Ties.** The same pessimistic rule as everywhere: within a tie of scores the negatives come first (a detection tied
# with a wrong one is ranked below it); a NaN-scored wrong detection outranks everything and a NaN-scored right one is
# never found (its precision counts as 0). **Groups.** With `groups` (OV-COCO's `base` and `novel` classes), top-1 and
# AP50 are also reported over the regions (for top-1) and the classes (for AP50) of each group, the classifier still
# choosing among all classes (the "generalized" setting of OV-COCO).

# %%
#| export
# COCO's 101 recall thresholds, bit for bit: pycocotools' np.linspace (not i/100, not torch.linspace; see above)
RECALL_POINTS = torch.from_numpy(np.linspace(0.0, 1.0, 101))

def average_precision(scores: torch.Tensor, positive: torch.Tensor) -> float:
    """scores `(n,)`, positive `(n,)` bool -> COCO's 101-point interpolated average precision (%) of ranking by
    score (ties: negatives first; NaN: a negative first, a positive never found); NaN when there is no positive."""
    s, pos = torch.as_tensor(scores).double(), torch.as_tensor(positive, dtype=torch.bool)
    if s.shape != pos.shape or s.ndim != 1:
        raise ValueError(f'scores and positive must be (n,), got {tuple(s.shape)}, {tuple(pos.shape)}')
    P = int(pos.sum())
    if P == 0:
        return math.nan
    key = torch.where(pos, s.nan_to_num(-math.inf), s.nan_to_num(math.inf))     # NaN: negatives first, positives last
    first = torch.argsort(pos.long(), stable=True)                              # negatives before positives ...
    order = first[torch.argsort(-key[first], stable=True)]                      # ... within each tie of scores
    tp = (pos & ~s.isnan())[order].double()                                     # (n,) a NaN positive is never found
    fp = (~pos)[order].double()
    ctp = tp.cumsum(0)
    recall, precision = ctp / P, ctp / (ctp + fp.cumsum(0)).clamp_min(1)
    precision = precision.flip(0).cummax(0).values.flip(0)                      # monotone from the right
    at = torch.searchsorted(recall, RECALL_POINTS, side='left')                 # first rank reaching each recall
    reached = at < len(recall)
    return 100 * float(torch.where(reached, precision[at.clamp_max(len(recall) - 1)], 0.0).mean())

def region_classification_metrics(logits: torch.Tensor, labels: torch.Tensor, groups: dict | None = None) -> dict:
    """logits `(R, K)` of R regions against K classes, labels `(R,)` long -> `top1`, `mean_per_class_recall`, `ap50`
    (mean over classes with regions of `average_precision` of the softmax scores), `n_regions`, `n_classes` (with
    regions), `ap_per_class` ({class index: AP}); with `groups` ({name: class indices}) also `top1_{name}`,
    `ap50_{name}` and `n_regions_{name}`. In percent."""
    logits = torch.as_tensor(logits).double()
    R, K = logits.shape
    labels = torch.as_tensor(labels, dtype=torch.long)
    if labels.shape != (R,):
        raise ValueError(f'labels must be ({R},), got {tuple(labels.shape)}')
    if R == 0:
        raise ValueError('no regions')
    if K < 2:
        raise ValueError(f'need at least 2 classes, got {K}')
    out = classification_metrics(logits, labels, ks=(1,))
    prob = logits.softmax(1)                                                    # (R, K) a detector's class scores
    ap = {k: average_precision(prob[:, k], labels == k) for k in labels.unique().tolist()}
    out.update(ap50=float(sum(ap.values()) / len(ap)), n_regions=R, n_classes=len(ap), ap_per_class=ap)
    hit = true_class_rank(logits, labels) == 0                                  # (R,) top-1 hits, the tie rule
    for name, classes in (groups or {}).items():
        cls = [int(c) for c in classes]
        inside = torch.isin(labels, torch.tensor(cls, dtype=torch.long))
        aps = [ap[c] for c in cls if c in ap]
        out[f'n_regions_{name}'] = int(inside.sum())
        out[f'top1_{name}'] = 100 * hit[inside].double().mean().item() if inside.any() else math.nan
        out[f'ap50_{name}'] = float(sum(aps) / len(aps)) if aps else math.nan
    return out


# %% [markdown]
# The checks, on hand-made scores: a perfect ranking, one positive under two negatives, the tie rules, a class with no
# region (left out of the mean), a single region, groups; then `average_precision` against the definition written out
# in plain Python floats (rank by the tie rule, precision at each rank, made monotone, read at 101 recalls) on random
# cases with ties.

# %%
_ap = average_precision
test_eq(_ap(torch.tensor([0.9, 0.8, 0.1]), torch.tensor([True, True, False])), 100.0)
test_close(_ap(torch.tensor([0.9, 0.8, 0.7]), torch.tensor([False, False, True])), 100 / 3, eps=1e-9)
test_eq(_ap(torch.tensor([0.5, 0.5]), torch.tensor([True, False])), 50.0)            # a tie: the negative first
test_eq(_ap(torch.zeros(4), torch.tensor([True, False, True, False])), 50.0)        # all tied: 1/3, 2/4 -> 1/2
test_eq(_ap(torch.tensor([float('nan'), 0.3]), torch.tensor([True, False])), 0.0)   # a NaN positive is never found
test_eq(_ap(torch.tensor([float('nan'), 0.3]), torch.tensor([False, True])), 50.0)  # a NaN negative comes first
assert math.isnan(_ap(torch.tensor([0.1, 0.2]), torch.tensor([False, False])))        # no positive: no AP
test_fail(lambda: _ap(torch.zeros(3), torch.zeros(2, dtype=torch.bool)), contains='must be (n,)')

_L = torch.tensor([[5., 1., 0., 0.],     # region 0, class 0: right
                   [0., 4., 4., 0.],     # region 1, class 1: tied with class 2, so not a top-1 hit
                   [0., 0., 3., 1.]])    # region 2, class 2: right; class 3 has no region
_m = region_classification_metrics(_L, torch.tensor([0, 1, 2]), groups={'base': [0, 1], 'novel': [2, 3]})
test_close(_m['top1'], 200 / 3, eps=1e-9)
test_eq((_m['n_regions'], _m['n_classes']), (3, 3))
test_eq(sorted(_m['ap_per_class']), [0, 1, 2])                                       # class 3 left out of the mean
test_close(_m['ap50'], sum(_m['ap_per_class'].values()) / 3, eps=1e-12)
test_eq((_m['top1_base'], _m['top1_novel'], _m['n_regions_novel']), (50.0, 100.0, 1))
test_eq(_m['ap50_novel'], _m['ap_per_class'][2])
_one = region_classification_metrics(torch.tensor([[0.1, 2.0, 0.3]]), torch.tensor([1]))   # one region
test_eq((_one['top1'], _one['ap50'], _one['n_classes']), (100.0, 100.0, 1))
test_fail(lambda: region_classification_metrics(torch.zeros(0, 3), torch.zeros(0, dtype=torch.long)),
          contains='no regions')

def _ap_reference(scores: list, positive: list) -> float:
    "The definition in plain floats: rank (score down, negatives first on ties), precision, monotone, 101 recalls."
    key = [(-float('inf') if p else float('inf')) if math.isnan(x) else x for x, p in zip(scores, positive)]
    order = sorted(range(len(scores)), key=lambda i: (-key[i], positive[i]))
    P, tp, fp, prec, rec = sum(positive), 0, 0, [], []
    for i in order:
        found = positive[i] and not math.isnan(scores[i])
        tp, fp = tp + found, fp + (not positive[i])
        prec.append(tp / max(tp + fp, 1))
        rec.append(tp / P)
    for j in range(len(prec) - 2, -1, -1):
        prec[j] = max(prec[j], prec[j + 1])
    grid = np.linspace(0, 1, 101).tolist()                                   # COCO's grid, as pycocotools makes it
    return 100 * sum(next((prec[j] for j in range(len(rec)) if rec[j] >= r), 0.0) for r in grid) / 101

_g = torch.Generator().manual_seed(0)
for _ in range(200):
    n = int(torch.randint(1, 30, (), generator=_g))
    sc = torch.randint(0, 5, (n,), generator=_g).double() / 4                          # few values: many ties
    pos = torch.rand(n, generator=_g) < 0.4
    if not pos.any():
        pos[0] = True
    test_close(_ap(sc, pos), _ap_reference(sc.tolist(), pos.tolist()), eps=1e-9)

# %% [markdown]
# Where the grid matters: 20 positives, the first 14 ranked first, then one negative, then the other 6. The monotone
# precision is 1 up to the 14th hit and 20/21 after it. The 14th hit's recall is $14/20 = 0.7$, below COCO's grid point
# 70 (`0.7000000000000001`), so COCO reads that point at the 15th hit: 70 of the 101 points read 1 and 31 read 20/21.
# On a grid of exact hundredths (or `torch.linspace`'s, whose point 70 is `0.7`) 71 points would read 1.

# %%
_pos20 = torch.tensor([True] * 14 + [False] + [True] * 6)
_coco = 100 * (70 + 31 * 20 / 21) / 101
test_close(_ap(-torch.arange(21.0), _pos20), _coco, eps=1e-12)
test_eq(float(torch.linspace(0, 1, 101, dtype=torch.float64)[70]) == 0.7 < float(RECALL_POINTS[70]), True)
print(f'AP {_ap(-torch.arange(21.0), _pos20):.4f}; on hundredths it would be {100 * (71 + 30 * 20 / 21) / 101:.4f}')


# %% [markdown]
# ## Chance AP
#
# A scorer that knows nothing gives each region iid random logits, so each class's scores (its softmax column) are iid
# over the regions, and the regions of the class land at uniformly random ranks among all $R$ regions, whatever the
# number of classes $K$ is. The AP it gets for a class therefore depends only on the class's count $P$ and on $R$:
# $E[\mathrm{AP}(P, R)]$, the mean AP over uniform random rankings. `chance_average_precision` estimates it from random
# permutations (seeded, 2,000 by default, vectorised: the $P$ positives' ranks are the first $P$ of a random sample of
# ranks without replacement) through the same monotone-precision, 101-point rule as `average_precision`. Chance AP50
# of a set of classes (all, OV-COCO's base, its novel) is the mean of $E[\mathrm{AP}(P_k, R)]$ over its classes with
# regions, exactly what `region_classification_metrics` averages; chance top-1 is $100/K$ for every group, since each
# region still chooses among all $K$ classes. One exact case checks it: with one positive at a uniform rank $j$, AP is
# $1/j$ at every grid point, so $E[\mathrm{AP}(1, R)] = H_R / R$.

# %%
#| export
def chance_average_precision(positives, n: int, draws: int = 2000, seed: int = 0) -> list[float]:
    """For each count `P` of `positives` (ints): the expected `average_precision` (%) of a uniformly random ranking of
    `n` items of which `P` are positive, the mean over `draws` random rankings from `seed` (see above)."""
    ps = [int(p) for p in positives]
    if not ps:
        return []
    if n < 1 or min(ps) < 1 or max(ps) > n:
        raise ValueError(f'each count of positives must be in [1, {n}], got {min(ps)}..{max(ps)}')
    rng, top = np.random.default_rng(seed), max(ps)
    ranks = np.stack([rng.choice(n, top, replace=False) for _ in range(draws)]) + 1   # (draws, top) 1-based ranks
    grid = RECALL_POINTS.numpy()
    out = []
    for P in ps:
        at = np.sort(ranks[:, :P], axis=1)                                     # (draws, P) the hits' ranks
        hits = np.arange(1, P + 1)
        prec = np.maximum.accumulate((hits / at)[:, ::-1], axis=1)[:, ::-1]     # (draws, P) monotone from the right
        idx = np.searchsorted(hits / P, grid, side='left')                     # (101,) the same for every draw
        read = np.where(idx < P, prec[:, np.minimum(idx, P - 1)], 0.0)         # (draws, 101)
        out.append(100 * float(read.mean()))
    return out


# %%
_n = 10
_c = chance_average_precision([1, 3, _n], _n, draws=4000)
test_close(_c[0], 100 * sum(1 / j for j in range(1, _n + 1)) / _n, eps=1.5)     # H_n / n; Monte-Carlo error ~0.4
test_eq(_c[2], 100.0)                                                                # every item positive
_gr = torch.Generator().manual_seed(1)
_mc = np.mean([_ap(torch.rand(_n, generator=_gr), torch.arange(_n) < 3) for _ in range(4000)])
test_close(_c[1], _mc, eps=1.5)                          # the same expectation as random scores through `_ap`
test_eq(chance_average_precision([1, 3], _n, draws=50, seed=3), chance_average_precision([1, 3], _n, draws=50, seed=3))
test_fail(lambda: chance_average_precision([0], 5), contains='in [1, 5]')


# %% [markdown]
# ## Linear probe
#
# Multinomial logistic regression on frozen image features $x$ (the L2-normalised global embeddings):
# $\min_{W,b}\ \frac1n \sum_j \mathrm{CE}(W x_j + b, y_j) + \frac{\lambda}{2}\|W\|^2$, solved full-batch with L-BFGS
# (strong Wolfe line search) in float64. $\lambda$ runs over a log grid; the one with the best validation accuracy
# wins (ties: the larger $\lambda$), the model is refit on train + val and scored on test. With scikit-learn,
# $\lambda = 1/(nC)$ is `LogisticRegression(C=C)`; `tests/test_eval.py` checks both agree. Predictions are an
# `argmax` of the probe's logits, whose ties have measure zero for a fitted probe. `argmax` is no comparison that the
# tie rule governs (it ranks NaN first), so features that are not finite are refused.

# %%
#| export
def fit_logreg(x: torch.Tensor, y: torch.Tensor, n_classes: int, lam: float,
               max_iter: int = 100) -> tuple[torch.Tensor, torch.Tensor]:
    "x `(n, D)`, y `(n,)` -> W `(D, K)`, b `(K,)` of the L2-regularised multinomial logistic regression."
    threads = torch.get_num_threads()
    # small problems: thread start-up dominates, and on a busy machine many threads are 10-20x slower than one
    if x.numel() < 1_000_000:
        torch.set_num_threads(1)
    try:
        return _fit_logreg(x, y, n_classes, lam, max_iter)
    finally:
        torch.set_num_threads(threads)

def _fit_logreg(x, y, n_classes, lam, max_iter):
    x, y = x.double(), torch.as_tensor(y, dtype=torch.long)
    W = torch.zeros(x.shape[1], n_classes, dtype=torch.float64, requires_grad=True)
    b = torch.zeros(n_classes, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([W, b], lr=1, max_iter=max_iter, tolerance_grad=1e-9, tolerance_change=1e-12,
                            history_size=20, line_search_fn='strong_wolfe')
    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(x @ W + b, y) + lam / 2 * (W * W).sum()
        loss.backward()
        return loss
    opt.step(closure)
    return W.detach(), b.detach()

LAMBDAS = tuple(10.0 ** e for e in range(-6, 1))

def linear_probe(train: tuple, val: tuple, test: tuple, n_classes: int, lambdas=LAMBDAS) -> dict:
    "Each split a pair (features `(n, D)`, labels `(n,)`) -> test `acc` (%), chosen `lambda`, `val_acc` per lambda."
    for name, (x, y) in dict(train=train, val=val, test=test).items():
        if len(x) == 0 or len(x) != len(y):
            raise ValueError(f'{name} split: {len(x)} features, {len(y)} labels')
        # argmax puts NaN first: a NaN probe would "predict" whatever class index a NaN lands on
        if not torch.isfinite(torch.as_tensor(x)).all():
            raise ValueError(f'{name} split: non-finite features')
    def acc(W, b, x, y): return 100 * ((x.double() @ W + b).argmax(1) == torch.as_tensor(y)).double().mean().item()
    val_acc = {}
    for lam in lambdas:
        W, b = fit_logreg(*train, n_classes, lam)
        val_acc[lam] = acc(W, b, *val)
    best = max(sorted(lambdas, reverse=True), key=lambda l: val_acc[l])     # first max = largest lambda on ties
    W, b = fit_logreg(torch.cat([train[0], val[0]]), torch.cat([torch.as_tensor(train[1]), torch.as_tensor(val[1])]),
                      n_classes, best)
    return dict(acc=acc(W, b, *test), **{'lambda': best}, val_acc={f'{l:g}': a for l, a in val_acc.items()},
                n_train=len(train[0]), n_val=len(val[0]), n_test=len(test[0]))


# %% [markdown]
# Three Gaussian blobs in 8 dimensions are separable: the probe must reach (near) 100%; on pure noise labels it
# must stay near chance (1/3) on the test split.

# %%
def blobs(n, g, noise=0.3):
    y = torch.randint(0, 3, (n,), generator=g)
    return torch.eye(3, 8)[y] + noise * torch.randn(n, 8, generator=g), y
g = torch.Generator().manual_seed(1)
res = linear_probe(blobs(90, g), blobs(60, g), blobs(150, g), 3)
assert res['acc'] > 95, res
noise = [(torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in (90, 60, 600)]
res_noise = linear_probe(*noise, 3)
assert 20 < res_noise['acc'] < 47, res_noise
test_fail(lambda: linear_probe(*noise[:2], (torch.full((5, 8), float('nan')), torch.zeros(5, dtype=torch.long)), 3),
          contains='test split: non-finite')
res['acc'], res['lambda'], res_noise['acc']
