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

import torch
import torch.nn.functional as F

# %%
#| hide
import numpy as np
from fastcore.test import test_close, test_eq, test_fail


# %% [markdown]
# # Evaluation metrics
#
# > One implementation of each metric the project reports (retrieval recall, classification accuracy, hard-negative accuracy, Winoground scores, the linear probe), with one rule for ties and NaNs, in percent.

# %% [markdown]
# The evaluation package `powerclip.eval` is read in this order:
#
# | notebook | module | job |
# |---|---|---|
# | `60_eval_metrics` | `eval.metrics` | the metrics (this notebook): pure tensor functions of scores |
# | `61_eval_data` | `eval.data` | readers of benchmark folders on disk, and the one writer of the world's benchmark folder |
# | `62_eval_models` | `eval.models` | the one model loader, the scorers a method offers, the feature cache, the `Evaluator` |
# | `63_eval_benchmarks` | `eval.benchmarks` | the paper's 28 benchmarks: registry, clip_benchmark's readers and CLI, with downloads refused |
# | `64_eval_tasks` | `eval.tasks` | the five tasks on an `Evaluator`, one run (checkpoint x data x tasks), the suite, the world evaluation |
# | `65_eval_tables` | `eval.tables` | result tables side by side and in the paper's layouts |
# | `66_eval_cli`, `66a_eval_main` | `eval.cli`, `eval.__main__` | `powerclip-eval` / `python -m powerclip.eval` |
#
# The heatmaps (`67_heatmaps`) and the comparison (`70_compare`) come after and use these modules.
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
    "Elementwise (broadcast) bool: the wrong candidate's score is not strictly below the right one's (ties and NaN: True)."
    return ~(wrong < right)


# %%
test_eq(outranks(torch.tensor([0.1, 0.5, 0.9, float('nan'), 0.2]), torch.tensor([0.5, 0.5, 0.5, 0.5, float('nan')])).tolist(),
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
def retrieval_recall(sim: torch.Tensor, text_image: torch.Tensor, ks=(1, 5, 10)) -> dict[str, float]:
    """sim `(I, T)` image-caption scores, text_image `(T,)` long: the image of each caption.
    Returns `i2t_R@k` and `t2i_R@k` in percent (see the tie rule above)."""
    I, T = sim.shape
    text_image = torch.as_tensor(text_image, dtype=torch.long)
    if text_image.shape != (T,): raise ValueError(f'text_image must be ({T},), got {tuple(text_image.shape)}')
    if T and (text_image.min() < 0 or text_image.max() >= I): raise ValueError('text_image holds an index outside [0, I)')
    own = torch.zeros(I, T, dtype=torch.bool); own[text_image, torch.arange(T)] = True
    has = own.any(1)                                                            # images without captions: text->image distractors only
    if not has.any(): raise ValueError('no image has a caption')
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
    out = {}
    for k in ks: out[f'i2t_R@{k}'] = 100 * ((rank_i < k) & hit_i)[has].double().mean().item()
    for k in ks: out[f't2i_R@{k}'] = 100 * ((rank_t < k) & hit_t).double().mean().item()
    return out

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
sim = torch.tensor([[0.9, 0.0], [0.8, 0.0], [0.7, 0.2], [0.4, 0.3]])   # caption 0 of image 2 sits third; image 3 prefers caption 0
test_eq(retrieval_recall(sim, torch.tensor([2, 3]), ks=(1, 2, 3)), {'i2t_R@1': 50.0, 'i2t_R@2': 100.0, 'i2t_R@3': 100.0,
                                                                    't2i_R@1': 50.0, 't2i_R@2': 50.0, 't2i_R@3': 100.0})
test_fail(lambda: retrieval_recall(torch.ones(3, 0), torch.zeros(0, dtype=torch.long)), contains='no image has a caption')
test_close(chance_recall(100, 1, ks=(1,))['i2t_R@1'], 1.0)
test_close(chance_recall(239, 5)['t2i_R@5'], 500 / 239)
# Monte-Carlo check of the image->text formula
sims = torch.rand(400, 10, 30, generator=g); ti = torch.arange(10).repeat_interleave(3)
mc = np.mean([retrieval_recall(s, ti, ks=(1, 5))['i2t_R@5'] for s in sims])
test_close(mc, chance_recall(10, 3, ks=(5,))['i2t_R@5'], eps=4)

# %% [markdown]
# Where the tie rule and `topk` part: the demo's world evaluation used to take the top k with `topk`, which puts
# the first of several tied candidates on top. Without ties the two agree (image 0 owns captions 0 and 2, image 1
# caption 1); with a tie, `topk` counted a hit that the rule here does not:

# %%
_sim = torch.tensor([[0.9, 0.1, 0.8], [0.2, 0.7, 0.1]])
test_eq(retrieval_recall(_sim, torch.tensor([0, 1, 0]), ks=(1,)), {'i2t_R@1': 100.0, 't2i_R@1': 100.0})
_sim = torch.tensor([[0.1, 0.9, 0.8], [0.2, 0.7, 0.1]])                    # captions 0 and 1 are closer to the other image
_r = retrieval_recall(_sim, torch.tensor([0, 1, 0]), ks=(1, 2))
test_close(list(_r.values()), [50.0, 100.0, 100 / 3, 100.0]); test_eq(list(_r), ['i2t_R@1', 'i2t_R@2', 't2i_R@1', 't2i_R@2'])
_tie = torch.tensor([[0.5, 0.5], [0.5, 0.5]])                               # every score tied
_topk_hits = (_tie.topk(1, dim=0).indices == torch.arange(2)[None]).any(0).float().mean().item()
test_eq((_topk_hits, retrieval_recall(_tie, torch.arange(2), ks=(1,))['t2i_R@1']), (0.5, 0.0))

# %% [markdown]
# NaN scores: a caption whose own score is NaN is a miss however large k is; a NaN on a wrong image counts against
# the correct one; an image keeps its best finite caption.

# %%
_sim = torch.tensor([[float('nan'), 0.1, 0.9], [0.2, 0.7, 0.1]])           # image 0 owns captions 0 and 2
_r = retrieval_recall(_sim, torch.tensor([0, 1, 0]), ks=(1, 2))
test_eq(list(_r), ['i2t_R@1', 'i2t_R@2', 't2i_R@1', 't2i_R@2']); test_close(list(_r.values()), [100.0, 100.0, 200 / 3, 200 / 3])
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
def classification_metrics(logits: torch.Tensor, labels: torch.Tensor, ks=(1, 5)) -> dict[str, float]:
    "logits `(n, K)`, labels `(n,)` long -> `top{k}` accuracy and `mean_per_class_recall` in percent."
    n, K = logits.shape
    labels = torch.as_tensor(labels, dtype=torch.long)
    if labels.shape != (n,): raise ValueError(f'labels must be ({n},), got {tuple(labels.shape)}')
    if n == 0: raise ValueError('no samples')
    if labels.min() < 0 or labels.max() >= K: raise ValueError(f'labels outside [0, {K})')
    true = logits.gather(1, labels[:, None])                                    # (n, 1)
    other = torch.ones_like(logits, dtype=torch.bool).scatter(1, labels[:, None], False)   # (n, K)
    rank = (outranks(logits, true) & other).sum(1)                              # (n,) other classes that outrank the true one
    rank = rank.masked_fill(true[:, 0].isnan(), K)                              # a NaN true logit is never a hit
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
test_close(m['top1'], 40.0); test_close(m['mean_per_class_recall'], 25.0); test_eq(m['top2'], 40.0)  # ties: others at 0
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
    if pos.shape != neg.shape or pos.ndim != 1: raise ValueError(f'pos and neg must be (n,), got {tuple(pos.shape)}, {tuple(neg.shape)}')
    if len(pos) == 0: raise ValueError('no items')
    return dict(acc=100 * (~outranks(neg, pos)).double().mean().item(), n=len(pos), ties=int((pos == neg).sum()))

def winoground_scores(s: torch.Tensor) -> dict[str, float]:
    "s `(n, 2, 2)`: s[:, c, i] = score of caption c and image i -> `text`, `image`, `group` scores (%), `n`."
    s = torch.as_tensor(s).float()
    if s.ndim != 3 or s.shape[1:] != (2, 2): raise ValueError(f's must be (n, 2, 2), got {tuple(s.shape)}')
    beats = lambda right, wrong: ~outranks(wrong, right)
    text = beats(s[:, 0, 0], s[:, 1, 0]) & beats(s[:, 1, 1], s[:, 0, 1])
    image = beats(s[:, 0, 0], s[:, 0, 1]) & beats(s[:, 1, 1], s[:, 1, 0])
    return dict(text=100 * text.double().mean().item(), image=100 * image.double().mean().item(),
                group=100 * (text & image).double().mean().item(), n=len(s))


# %%
test_eq(hard_negative_accuracy(torch.tensor([0.5, 0.2, 0.3]), torch.tensor([0.5, 0.2, 0.3])), dict(acc=0.0, n=3, ties=3))
test_eq(hard_negative_accuracy(torch.tensor([0.6, 0.2, 0.3, 0.9]), torch.tensor([0.5, 0.4, 0.3, 0.1])), dict(acc=50.0, n=4, ties=1))
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
def fit_logreg(x: torch.Tensor, y: torch.Tensor, n_classes: int, lam: float, max_iter: int = 100) -> tuple[torch.Tensor, torch.Tensor]:
    "x `(n, D)`, y `(n,)` -> W `(D, K)`, b `(K,)` of the L2-regularised multinomial logistic regression."
    threads = torch.get_num_threads()
    # small problems: thread start-up dominates, and on a busy machine many threads are 10-20x slower than one
    if x.numel() < 1_000_000: torch.set_num_threads(1)
    try: return _fit_logreg(x, y, n_classes, lam, max_iter)
    finally: torch.set_num_threads(threads)

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
        if len(x) == 0 or len(x) != len(y): raise ValueError(f'{name} split: {len(x)} features, {len(y)} labels')
        # argmax puts NaN first: a NaN probe would "predict" whatever class index a NaN lands on
        if not torch.isfinite(torch.as_tensor(x)).all(): raise ValueError(f'{name} split: non-finite features')
    def acc(W, b, x, y): return 100 * ((x.double() @ W + b).argmax(1) == torch.as_tensor(y)).double().mean().item()
    val_acc = {}
    for lam in lambdas:
        W, b = fit_logreg(*train, n_classes, lam)
        val_acc[lam] = acc(W, b, *val)
    best = max(sorted(lambdas, reverse=True), key=lambda l: val_acc[l])     # first max = largest lambda on ties
    W, b = fit_logreg(torch.cat([train[0], val[0]]), torch.cat([torch.as_tensor(train[1]), torch.as_tensor(val[1])]), n_classes, best)
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
test_fail(lambda: linear_probe(*noise[:2], (torch.full((5, 8), float('nan')), torch.zeros(5, dtype=torch.long)), 3), contains='test split: non-finite')
res['acc'], res['lambda'], res_noise['acc']
