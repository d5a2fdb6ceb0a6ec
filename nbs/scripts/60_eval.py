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
#| default_exp eval

# %%
#| export
from __future__ import annotations

import argparse
import csv
import hashlib
import io
import json
import logging
import math
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from tqdm import tqdm

from powerclip.world import WorldConfig, generate, write_test_splits

log = logging.getLogger(__name__)

# %%
#| hide
import os
import tempfile
from fastcore.test import test_close, test_eq, test_fail


# %% [markdown]
# # Evaluation
#
# > The benchmark suite on any checkpoint: zero-shot retrieval, SugarCrepe, zero-shot classification, linear probe and Winoground, on local data, with cached features, one JSON per (checkpoint, data set) and side-by-side tables.

# %% [markdown]
# Every method (CLIP, PowerCLIP, baselines) is judged by the same rule: only the **global** embeddings
# $v = f(\text{image})$ and $t = g(\text{text})$, L2-normalised, and their cosine $s(v, t) = v^\top t$.
# Checkpoints load through open_clip (`powerclip.model.create_model`), never through the trainer.
#
# | task | data (local files) | metric |
# |---|---|---|
# | retrieval | Karpathy-style list `[{image, caption: [..]}]`, or `coco_sample/captions.jsonl` | R@1/5/10, image→text and text→image (%) |
# | sugarcrepe | `data/{category}.json` (`{id: {filename, caption, negative_caption}}`) + `images/` | accuracy of $s(v,t^+) > s(v,t^-)$ (%) per category |
# | zeroshot | `classification.json`: class names, prompt templates, labelled images | top-1/top-5 accuracy, mean per-class recall (%) |
# | linear_probe | the same `classification.json` with `train`/`val`/`test` splits | test accuracy of a logistic regression on frozen features, $\lambda$ chosen on `val` |
# | winoground | `data/examples.jsonl` + `data/images/*.png` (the Hugging Face layout) | text, image and group scores (%) |
#
# **Ties.** Every comparison here is strict and pessimistic: a correct candidate that *ties* with a wrong one
# counts as ranked below it. So a model whose scores are all equal gets R@k = 0, SugarCrepe accuracy 0 and
# Winoground 0, instead of a number that depends on the order of the files (what `topk` would give). SugarCrepe
# and Winoground use strict `>` in their own papers too; ties are counted and reported.
#
# **clip_benchmark.** `clip-benchmark==1.6.2` installs with `constraints.txt` without moving a pin (it adds
# scikit-learn, pycocotools, pycocoevalcap). It is the tool the papers used, but its data loaders download and
# its entry point wants its own data set names; the path below works on local files without it. Its retrieval
# metric serves as an independent cross-check in `tests/test_eval.py` (it breaks ties by index, so the check uses
# tie-free scores). Its classification `accuracy` (1.6.2) raises `TypeError` under numpy 2
# (`float()` of a 1-element array), one more reason not to depend on it.

# %% [markdown]
# ## Metrics
#
# **Retrieval.** With a similarity matrix $S \in \mathbb{R}^{I \times T}$ and the image $\pi(t)$ of each caption,
# the rank of caption $t$ is $r(t) = |\{i \ne \pi(t) : S_{i t} \ge S_{\pi(t) t}\}|$, and text→image R@k is the share
# of captions with $r(t) < k$. An image has several captions: its rank is that of its best caption,
# $r(i) = |\{t : \pi(t) \ne i,\ S_{i t} \ge \max_{\pi(t')=i} S_{i t'}\}|$ (Karpathy's protocol). Under random
# scores text→image R@k is $k/I$ and image→text R@k is $1 - \binom{T-p}{k}/\binom{T}{k}$ for $p$ captions per image
# (`chance_recall`).

# %%
#| export
def retrieval_recall(sim: torch.Tensor, text_image: torch.Tensor, ks=(1, 5, 10)) -> dict[str, float]:
    """sim `(I, T)` image-caption similarities, text_image `(T,)` long: the image of each caption.
    Returns `i2t_R@k` and `t2i_R@k` in percent; ties count against the correct candidate."""
    I, T = sim.shape
    text_image = torch.as_tensor(text_image, dtype=torch.long)
    if text_image.shape != (T,): raise ValueError(f'text_image must be ({T},), got {tuple(text_image.shape)}')
    if T and (text_image.min() < 0 or text_image.max() >= I): raise ValueError('text_image holds an index outside [0, I)')
    own = torch.zeros(I, T, dtype=torch.bool); own[text_image, torch.arange(T)] = True
    has = own.any(1)                                                            # images without captions: text->image distractors only
    if not has.any(): raise ValueError('no image has a caption')
    sim = sim.float()
    # text -> image: wrong images scoring at least the caption's own image
    pos_t = sim[text_image, torch.arange(T)]                                    # (T,)
    rank_t = ((sim >= pos_t[None]) & ~own).sum(0)                               # (T,)
    # image -> text: wrong captions scoring at least the image's best caption
    best_i = sim.masked_fill(~own, -math.inf).max(1).values                     # (I,)
    rank_i = ((sim >= best_i[:, None]) & ~own).sum(1)                           # (I,)
    out = {}
    for k in ks: out[f'i2t_R@{k}'] = 100 * (rank_i[has] < k).double().mean().item()
    for k in ks: out[f't2i_R@{k}'] = 100 * (rank_t < k).double().mean().item()
    return out

def chance_recall(n_images: int, captions_per_image: int, ks=(1, 5, 10)) -> dict[str, float]:
    "Expected R@k (%) of random scores with `captions_per_image` captions for each of `n_images` images."
    T, p = n_images * captions_per_image, captions_per_image
    out = {f'i2t_R@{k}': 100 * (1 - math.comb(T - p, k) / math.comb(T - p + p, k)) if k <= T - p else 100.0 for k in ks}
    out.update({f't2i_R@{k}': 100 * min(k, n_images) / n_images for k in ks})
    return out


# %% [markdown]
# Hand cases: identical image and text embeddings give R@k = 100; a constant similarity gives 0 (ties are
# pessimistic); a caption whose image sits third gets t2i R@1 = R@2 = 0 and R@3 = 100. Images without a caption
# are distractors for text→image and are left out of image→text.

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
sims = torch.rand(2000, 10, 30, generator=g); ti = torch.arange(10).repeat_interleave(3)
mc = np.mean([retrieval_recall(s, ti, ks=(1, 5))['i2t_R@5'] for s in sims[:400]])
test_close(mc, chance_recall(10, 3, ks=(5,))['i2t_R@5'], eps=4)


# %% [markdown]
# **Classification.** Logits $(n, K)$; the true class is in the top $k$ when fewer than $k$ other classes score at
# least as high (top-k is reported only for k < K). Mean per-class recall averages the accuracy of each class present (what clip_benchmark reports
# beside top-1 for unbalanced sets).

# %%
#| export
def classification_metrics(logits: torch.Tensor, labels: torch.Tensor, ks=(1, 5)) -> dict[str, float]:
    "logits `(n, K)`, labels `(n,)` long -> `top{k}` accuracy and `mean_per_class_recall` in percent (ties pessimistic)."
    n, K = logits.shape
    labels = torch.as_tensor(labels, dtype=torch.long)
    if labels.shape != (n,): raise ValueError(f'labels must be ({n},), got {tuple(labels.shape)}')
    if n == 0: raise ValueError('no samples')
    if labels.min() < 0 or labels.max() >= K: raise ValueError(f'labels outside [0, {K})')
    true = logits.gather(1, labels[:, None])                                    # (n, 1)
    rank = (logits >= true).sum(1) - 1                                          # other classes at least as high
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


# %% [markdown]
# **SugarCrepe** (image-to-text): an item is right when $s(v, t^+) > s(v, t^-)$; a tie is wrong and is counted.
# **Winoground**: for captions $c_0, c_1$ and images $i_0, i_1$ with $s_{ci} = s(c, i)$,
# text score $= [s_{00} > s_{10}] \wedge [s_{11} > s_{01}]$ (each image picks its caption),
# image score $= [s_{00} > s_{01}] \wedge [s_{11} > s_{10}]$ (each caption picks its image), group = both.

# %%
#| export
def sugarcrepe_accuracy(pos: torch.Tensor, neg: torch.Tensor) -> dict[str, float]:
    "pos, neg `(n,)` scores of the true and the negative caption -> `acc` (%), `n`, `ties` (ties count as wrong)."
    pos, neg = torch.as_tensor(pos).float(), torch.as_tensor(neg).float()
    if pos.shape != neg.shape or pos.ndim != 1: raise ValueError(f'pos and neg must be (n,), got {tuple(pos.shape)}, {tuple(neg.shape)}')
    if len(pos) == 0: raise ValueError('no items')
    return dict(acc=100 * (pos > neg).double().mean().item(), n=len(pos), ties=int((pos == neg).sum()))

def winoground_scores(s: torch.Tensor) -> dict[str, float]:
    "s `(n, 2, 2)`: s[:, c, i] = similarity of caption c and image i -> `text`, `image`, `group` scores (%), `n`."
    s = torch.as_tensor(s).float()
    if s.ndim != 3 or s.shape[1:] != (2, 2): raise ValueError(f's must be (n, 2, 2), got {tuple(s.shape)}')
    text = (s[:, 0, 0] > s[:, 1, 0]) & (s[:, 1, 1] > s[:, 0, 1])
    image = (s[:, 0, 0] > s[:, 0, 1]) & (s[:, 1, 1] > s[:, 1, 0])
    return dict(text=100 * text.double().mean().item(), image=100 * image.double().mean().item(),
                group=100 * (text & image).double().mean().item(), n=len(s))


# %%
test_eq(sugarcrepe_accuracy(torch.tensor([0.5, 0.2, 0.3]), torch.tensor([0.5, 0.2, 0.3])), dict(acc=0.0, n=3, ties=3))
test_eq(sugarcrepe_accuracy(torch.tensor([0.6, 0.2, 0.3, 0.9]), torch.tensor([0.5, 0.4, 0.3, 0.1])), dict(acc=50.0, n=4, ties=1))
cases = torch.tensor([[[1.0, 0.0], [0.0, 1.0]],     # perfect: 1, 1, 1
                      [[0.5, 0.6], [0.4, 0.7]],     # each image picks its caption, but caption 0 picks image 1: 1, 0, 0
                      [[0.5, 0.4], [0.6, 0.7]],     # each caption picks its image, image 0 picks caption 1: 0, 1, 0
                      [[0.3, 0.3], [0.3, 0.3]]])    # all tied: 0, 0, 0
test_eq([winoground_scores(c[None]) for c in cases][:3],
        [dict(text=100.0, image=100.0, group=100.0, n=1), dict(text=100.0, image=0.0, group=0.0, n=1),
         dict(text=0.0, image=100.0, group=0.0, n=1)])
test_eq(winoground_scores(cases), dict(text=50.0, image=50.0, group=25.0, n=4))


# %% [markdown]
# **Linear probe.** Multinomial logistic regression on frozen image features $x$ (the L2-normalised
# embeddings): $\min_{W,b}\ \frac1n \sum_j \mathrm{CE}(W x_j + b, y_j) + \frac{\lambda}{2}\|W\|^2$, solved
# full-batch with L-BFGS (strong Wolfe line search) in float64. $\lambda$ runs over a log grid; the one with the
# best validation accuracy wins (ties: the larger $\lambda$), the model is refit on train + val and scored on test.
# With scikit-learn, $\lambda = 1/(nC)$ is `LogisticRegression(C=C)`; the test file checks both agree.

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
res['acc'], res['lambda'], res_noise['acc']


# %% [markdown]
# ## Data sets on disk
#
# Loaders return plain lists of absolute paths and strings. A missing file stops with `MissingData`, whose
# message names the files to put where; a missing image inside an existing data set is a counted, logged skip.

# %%
#| export
class MissingData(FileNotFoundError):
    "A data set (or one of its files) is absent; the message says what to put where (nothing is downloaded)."

@dataclass
class RetrievalSet:
    images: list            # list[Path]
    captions: list          # list[list[str]], one list per image
    skipped: int = 0        # entries dropped (missing image, no caption)

    def flat(self) -> tuple[list[str], torch.Tensor]:
        "All captions `(T,)` and the image index of each `(T,)`."
        texts = [c for cs in self.captions for c in cs]
        return texts, torch.tensor([i for i, cs in enumerate(self.captions) for _ in cs], dtype=torch.long)

def _need(path: Path, what: str) -> Path:
    if not Path(path).exists(): raise MissingData(f'{what}: expected {path}')
    return Path(path)

def _keep_existing(rows: list, image_of, what: str) -> tuple[list, int]:
    keep = [r for r in rows if Path(image_of(r)).is_file()]
    if len(keep) < len(rows): log.warning('%s: skipped %d of %d items whose image file is missing', what, len(rows) - len(keep), len(rows))
    return keep, len(rows) - len(keep)

def load_retrieval(path, image_root=None, split: str = 'test') -> RetrievalSet:
    """A Karpathy-style retrieval json: either a list `[{image, caption: [str, ..]}]` (clip_benchmark's
    flickr/coco format, what `world.write_test_splits` writes) or Karpathy's `dataset_*.json`
    (`{images: [{filename, filepath?, split, sentences: [{raw}]}]}`, rows of `split` only)."""
    path = _need(Path(path), 'retrieval captions (Karpathy json)')
    root = Path(image_root) if image_root else path.parent / 'images'
    d = json.loads(path.read_text())
    if isinstance(d, dict) and 'images' in d:      # Karpathy's own file
        rows = [(root / r.get('filepath', '') / r['filename'], [s['raw'] for s in r['sentences']]) for r in d['images'] if r.get('split') == split]
    else:
        rows = [(root / r['image'], [r['caption']] if isinstance(r['caption'], str) else list(r['caption'])) for r in d]
    n = len(rows)
    rows = [r for r in rows if r[1]]
    rows, missing = _keep_existing(rows, lambda r: r[0], str(path))
    if not rows: raise MissingData(f'{path}: no item has its image under {root}')
    return RetrievalSet([r[0] for r in rows], [r[1] for r in rows], skipped=n - len(rows))

def load_coco_sample(root, split: str | None = None) -> RetrievalSet:
    "`coco_sample/captions.jsonl` (+ `images/`) as a retrieval set; `split` 'val2017' / 'train2017' / None (all)."
    root = Path(root)
    rows = [json.loads(l) for l in _need(root / 'captions.jsonl', 'coco_sample').read_text().splitlines() if l.strip()]
    rows = [r for r in rows if split is None or r['split'] == split]
    n = len(rows)
    rows, _ = _keep_existing([r for r in rows if r['captions']], lambda r: root / 'images' / r['file_name'], str(root))
    return RetrievalSet([root / 'images' / r['file_name'] for r in rows], [list(r['captions']) for r in rows], skipped=n - len(rows))


# %% [markdown]
# SugarCrepe: the 7 categories, each `data/{category}.json`. The full benchmark text can be paired with any image
# folder (`image_root`): items whose photo is absent are skipped and counted. `coco_sample/captions.jsonl` carries
# its own 211 items in a `sugarcrepe` field.

# %%
#| export
SUGARCREPE = ('add_att', 'add_obj', 'replace_att', 'replace_obj', 'replace_rel', 'swap_att', 'swap_obj')

def load_sugarcrepe(root, image_root=None, categories=SUGARCREPE) -> tuple[dict, dict]:
    """`{category: [(image path, caption, negative caption)]}` and `{category: skipped}` from `root/data/{category}.json`
    (images in `image_root`, default `root/images`), or from `root/captions.jsonl` (coco_sample)."""
    root = Path(root)
    image_root = Path(image_root) if image_root else root / 'images'
    out, skipped = {}, {}
    if (root / 'captions.jsonl').is_file() and not (root / 'data').is_dir():
        rows = [json.loads(l) for l in (root / 'captions.jsonl').read_text().splitlines() if l.strip()]
        items = {c: [] for c in categories}
        for r in rows:
            for s in r.get('sugarcrepe') or []:
                if s['category'] in items: items[s['category']].append((image_root / r['file_name'], s['caption'], s['negative_caption']))
    else:
        files = {c: root / 'data' / f'{c}.json' for c in categories}
        if not any(f.is_file() for f in files.values()):
            raise MissingData(f'SugarCrepe: expected {root}/data/{{{",".join(categories)}}}.json (from github.com/RAIVNLab/sugar-crepe, '
                              f'folder data/) and the COCO val2017 images in {image_root}')
        items = {}
        for c, f in files.items():
            if not f.is_file(): log.warning('SugarCrepe: %s missing, category skipped', f); continue
            items[c] = [(image_root / d['filename'], d['caption'], d['negative_caption']) for d in json.loads(f.read_text()).values()]
    for c, rows in items.items():
        out[c], skipped[c] = _keep_existing(rows, lambda r: r[0], f'SugarCrepe {c}')
    out = {c: v for c, v in out.items() if v}
    if not out: raise MissingData(f'SugarCrepe under {root}: no item has its image in {image_root}')
    return out, skipped


# %% [markdown]
# Classification (zero-shot and linear probe) reads one `classification.json`:
# `{"classnames": [..], "templates": ["a photo of a {c}.", ..], "splits": {"train": [{"image", "label"}], "val": .., "test": ..}}`
# (image paths relative to the file's folder). Zero-shot uses `test`; the linear probe all three. An image-folder
# layout `root/{train,val,test}/<class>/*.jpg` (+ optional `templates.txt`) is read as the same thing.
#
# Winoground reads the Hugging Face layout (`data/examples.jsonl`: `id, image_0, image_1, caption_0, caption_1`,
# images `data/images/{image_k}.png`). It cannot be downloaded here (a gated Hugging Face data set): when absent the
# message says where to put the files.

# %%
#| export
@dataclass
class ClassificationSet:
    classnames: list
    templates: list
    splits: dict            # split -> (list[Path], labels (n,) long)
    skipped: dict = field(default_factory=dict)

IMAGE_EXTS = ('.jpg', '.jpeg', '.png', '.bmp', '.webp')

def classification_from_folders(root) -> dict:
    """The `classification.json` content of an image-folder layout `root/{train,val,test}/<class>/*.jpg` (class
    names from the folder names, `_` read as a space; templates from `root/templates.txt`, one a line, else
    `a photo of a {c}.`): local copies of CIFAR, ImageNet etc. exported as folders."""
    root = Path(root)
    splits = [s for s in ('train', 'val', 'test') if (root / s).is_dir()]
    folders = sorted({d.name for s in splits for d in (root / s).iterdir() if d.is_dir()})
    if not folders: raise MissingData(f'classification: expected {root}/classification.json or image folders {root}/test/<class>/*.jpg')
    tf = root / 'templates.txt'
    templates = [l.strip() for l in tf.read_text().splitlines() if l.strip()] if tf.is_file() else ['a photo of a {c}.']
    rows = {s: [dict(image=str(p.relative_to(root)), label=k) for k, c in enumerate(folders) if (root / s / c).is_dir()
                for p in sorted((root / s / c).iterdir()) if p.suffix.lower() in IMAGE_EXTS] for s in splits}
    return dict(classnames=[c.replace('_', ' ') for c in folders], templates=templates, splits=rows)

def load_classification(path) -> ClassificationSet:
    "A `classification.json` (or a folder holding one), or an image-folder layout."
    path = Path(path)
    if path.is_dir() and not (path / 'classification.json').is_file() and any((path / s).is_dir() for s in ('train', 'val', 'test')):
        d, path = classification_from_folders(path), path / 'classification.json'   # image paths relative to the folder
    else:
        if path.is_dir(): path = path / 'classification.json'
        d = json.loads(_need(path, 'classification set: {"classnames", "templates", "splits": {"train"|"val"|"test": [{"image", "label"}]}}').read_text())
    K, splits, skipped = len(d['classnames']), {}, {}
    if not d['templates'] or any('{c}' not in t for t in d['templates']): raise ValueError(f'{path}: every template needs a {{c}} slot')
    for name, rows in d['splits'].items():
        bad = [r for r in rows if not 0 <= int(r['label']) < K]
        if bad: raise ValueError(f'{path}: {len(bad)} labels of split {name} outside [0, {K})')
        rows, skipped[name] = _keep_existing(rows, lambda r: path.parent / r['image'], f'{path} [{name}]')
        splits[name] = ([path.parent / r['image'] for r in rows], torch.tensor([int(r['label']) for r in rows], dtype=torch.long))
    return ClassificationSet(list(d['classnames']), list(d['templates']), splits, skipped)

WINOGROUND_HELP = ('Winoground is not on this machine and is never downloaded. Get it from '
                   'https://huggingface.co/datasets/facebook/winoground (accept its licence) and put '
                   '{root}/data/examples.jsonl and the images as {root}/data/images/<image_0|image_1>.png')

def load_winoground(root) -> list[tuple[Path, Path, str, str]]:
    "`[(image_0, image_1, caption_0, caption_1)]` from the Hugging Face layout under `root`."
    root = Path(root)
    f = root / 'data' / 'examples.jsonl'
    if not f.is_file(): raise MissingData(WINOGROUND_HELP.format(root=root))
    rows = [json.loads(l) for l in f.read_text().splitlines() if l.strip()]
    img = lambda name: root / 'data' / 'images' / f'{name}.png'
    items = [(img(r['image_0']), img(r['image_1']), r['caption_0'], r['caption_1']) for r in rows]
    both = [r for r in items if r[0].is_file() and r[1].is_file()]             # a pair needs both images
    if len(both) < len(items): log.warning('%s: skipped %d of %d pairs with a missing image', f, len(items) - len(both), len(items))
    items = both
    if not items: raise MissingData(WINOGROUND_HELP.format(root=root) + ' (examples.jsonl found, but none of its images)')
    return items


# %% [markdown]
# ## The built-in world as a test bench
#
# `world.write_test_splits` writes SugarCrepe-format hard negatives and a Karpathy-style retrieval list. Here we
# add a classification set (single-object scenes: which shape, or which colour, with templates
# `a photo of a {c}.` / `a {c}.`), train/val/test splits for the linear probe (the world's own split streams,
# so no scene is shared), and a Winoground-*format* file built from pairs of scenes: each pair's captions are
# the two scenes' captions. That last one exercises the pipeline, it is not a minimal-pair benchmark.

# %%
#| export
WORLD_TEMPLATES = ('a photo of a {c}.', 'a {c}.')

def write_world_classification(out_dir, n: dict | None = None, attribute: str = 'shape', seed: int = 0) -> dict:
    "Single-object world scenes labelled by `attribute` ('shape' | 'colour') -> `out_dir/classification.json`; returns counts."
    if attribute not in ('shape', 'colour'): raise ValueError(f"attribute must be 'shape' or 'colour', got {attribute!r}")
    out = Path(out_dir); (out / 'cls_images').mkdir(parents=True, exist_ok=True)
    cfg = WorldConfig(min_objects=1, max_objects=1, seed=seed)
    classes = list(cfg.shapes if attribute == 'shape' else cfg.colours)
    splits = {}
    for split, count in (n or dict(train=200, val=100, test=200)).items():
        rows = []
        for i in range(count):
            s = generate(cfg, i, split)
            fname = f'cls_images/{split}_{i:06d}.png'
            Image.fromarray(s['image']).save(out / fname)
            rows.append(dict(image=fname, label=classes.index(getattr(s['scene'].objects[0], attribute))))
        splits[split] = rows
    (out / 'classification.json').write_text(json.dumps(dict(classnames=classes, templates=list(WORLD_TEMPLATES), splits=splits,
                                                             attribute=attribute, world_config=dict(min_objects=1, max_objects=1, seed=seed)), indent=1))
    return {k: len(v) for k, v in splits.items()}

def write_world_winoground(out_dir, n_pairs: int = 50, seed: int = 0) -> int:
    "Winoground-format pairs of world test scenes under `out_dir/data/`; returns the number of pairs."
    out = Path(out_dir); (out / 'data' / 'images').mkdir(parents=True, exist_ok=True)
    cfg, rows = WorldConfig(seed=seed), []
    for k in range(n_pairs):
        a, b = generate(cfg, 2 * k, 'val'), generate(cfg, 2 * k + 1, 'val')
        if a['text'] == b['text']: continue      # a pair needs two different captions
        for j, s in enumerate((a, b)): Image.fromarray(s['image']).save(out / 'data' / 'images' / f'wg_{k}_{j}.png')
        rows.append(dict(id=k, image_0=f'wg_{k}_0', image_1=f'wg_{k}_1', caption_0=a['text'], caption_1=b['text']))
    (out / 'data' / 'examples.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
    return len(rows)

def write_world_eval_set(out_dir, n_images: int = 100, seed: int = 0) -> dict:
    "Everything the five tasks read, from the built-in world, in one folder; returns the counts."
    summary = write_test_splits(out_dir, WorldConfig(seed=seed), n_images)
    summary['classification'] = write_world_classification(out_dir, dict(train=n_images, val=n_images // 2, test=n_images), seed=seed)
    summary['winoground_pairs'] = write_world_winoground(out_dir, max(1, n_images // 4), seed=seed)
    return summary


# %%
tmp = Path(tempfile.mkdtemp())
world_summary = write_world_eval_set(tmp / 'world', n_images=60)
ret = load_retrieval(tmp / 'world' / 'retrieval.json')
sc, sc_skipped = load_sugarcrepe(tmp / 'world')
cls = load_classification(tmp / 'world')
wg = load_winoground(tmp / 'world')
test_eq(len(ret.images), world_summary['retrieval_images'])
test_eq({c: len(v) for c, v in sc.items()}, {c: v for c, v in world_summary['sugarcrepe'].items() if v})
test_eq({k: len(v[0]) for k, v in cls.splits.items()}, dict(train=60, val=30, test=60))
test_fail(lambda: load_winoground(tmp / 'nowhere'), contains='data/examples.jsonl')
test_fail(lambda: load_sugarcrepe(tmp / 'nowhere'), contains='sugar-crepe')
world_summary, cls.classnames, len(wg)

# %% [markdown]
# The real sample (skipped when `../shared/data` is absent): 239 photos with 5 captions each, and the 211
# SugarCrepe items on its val2017 photos. Paired with the complete SugarCrepe text, only the items on those
# photos are kept and the rest is counted as skipped.

# %%
DATA = Path('../../shared/data') if Path('../../shared/data').is_dir() else Path('../shared/data')
if (DATA / 'coco_sample').is_dir():
    coco = load_coco_sample(DATA / 'coco_sample')
    coco_sc, _ = load_sugarcrepe(DATA / 'coco_sample')
    full_sc, full_skipped = load_sugarcrepe(DATA / 'sugarcrepe', image_root=DATA / 'coco_sample' / 'images')
    test_eq((len(coco.images), sum(map(len, coco.captions))), (239, 1195))
    test_eq(sum(map(len, coco_sc.values())), 211)
    print({c: len(v) for c, v in coco_sc.items()}, 'full benchmark kept', sum(map(len, full_sc.values())), 'skipped', sum(full_skipped.values()))
else: print('skipped: ../shared/data is absent')


# %% [markdown]
# ## Models, features and the cache
#
# `load_model` builds the architecture with `powerclip.model.create_model` (our configs registered with
# open_clip) and loads a local checkpoint: a plain `state_dict`, open_clip's `{'state_dict': ..}`, or the
# trainer's `{'model': ..}`, with `module.` / `model.` prefixes (DDP, `model.Encoder`) stripped. No checkpoint
# means a random initialisation from `seed` (for tests). A trainer checkpoint also carries the architecture
# overrides it was trained with (`config.model.kwargs`, e.g. fewer layers, context length 32): they are applied,
# and the tokenizer uses the model's context length. The checkpoint's identity is its file's sha256, or
# `random-init-<arch>-seed<k>`; features are cached under `cache_dir/<id>/` keyed by the inputs (paths with size
# and mtime, or texts), so a rerun reads them back instead of running the model.

# %%
#| export
def sha256_file(path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, 'rb') as f:
        for b in iter(lambda: f.read(chunk), b''): h.update(b)
    return h.hexdigest()

def _state_dict(ck) -> dict:
    for k in ('state_dict', 'model'):
        if isinstance(ck, dict) and k in ck and isinstance(ck[k], dict): ck = ck[k]; break
    sd = {}
    for k, v in ck.items():
        for p in ('module.', 'model.'):
            if k.startswith(p): k = k[len(p):]
        sd[k] = v
    return sd

@dataclass
class LoadedModel:
    model: object           # open_clip CLIP, eval mode
    preprocess: object      # the architecture's validation transform
    tokenizer: object       # open_clip tokenizer at the model's context length
    ckpt_id: str            # sha256 of the checkpoint file, or 'random-init-<arch>-seed<k>'
    spec: dict              # name and open_clip model_kwargs the model was built with

def load_model(model_name: str | None = None, checkpoint=None, seed: int = 0, device: str = 'cpu',
               model_kwargs: dict | None = None) -> LoadedModel:
    """Build the architecture and load a local checkpoint (None = random init from `seed`). A trainer checkpoint
    carries its model config (`config.model.name`, `.kwargs`): it is used unless `model_name` names another."""
    import open_clip                                     # here, not at the top: `--help`, `table`, `make-world` stay fast
    from powerclip.model import PRESETS, create_model
    sd, ck_model = None, {}
    if checkpoint is not None:
        checkpoint = _need(Path(checkpoint), 'checkpoint')
        try: ck = torch.load(checkpoint, map_location='cpu', weights_only=True)
        except Exception as e:   # the trainer's checkpoints also hold RNG states and configs
            log.info('weights_only load failed (%s); loading %s as a trusted local pickle', type(e).__name__, checkpoint)
            ck = torch.load(checkpoint, map_location='cpu', weights_only=False)
        sd = _state_dict(ck)
        if isinstance(ck, dict) and isinstance(ck.get('config'), dict): ck_model = ck['config'].get('model') or {}
    name = model_name or ck_model.get('name')
    if name is None: raise ValueError('no model name given and the checkpoint does not carry one: pass --model')
    kw = dict(ck_model.get('kwargs') or {}) if ck_model.get('name') in (None, name) else {}
    kw.update(model_kwargs or {})
    torch.manual_seed(seed)
    model, _, preprocess = create_model(name, **kw)
    arch = PRESETS.get(name, name)
    if sd is None: ckpt_id = f'random-init-{arch}-seed{seed}' + (f'-{hashlib.sha256(json.dumps(kw, sort_keys=True).encode()).hexdigest()[:8]}' if kw else '')
    else:
        ckpt_id = sha256_file(checkpoint)
        try: missing, unexpected = model.load_state_dict(sd, strict=False)
        except RuntimeError as e: raise ValueError(f'{checkpoint} does not fit {arch} {kw}: {e}') from e   # shape mismatches
        if missing or unexpected:
            raise ValueError(f'{checkpoint} does not fit {arch} {kw}: missing {missing[:5]}.. ({len(missing)}), unexpected {unexpected[:5]}.. ({len(unexpected)})')
    tok = open_clip.get_tokenizer(arch, context_length=model.context_length)
    return LoadedModel(model.to(device).eval(), preprocess, tok, ckpt_id, dict(name=name, kwargs=kw))


# %%
#| export
class FeatureCache:
    "Tensors on disk under `root/<checkpoint id>/<name>-<key>.pt`; `root=None` disables caching."
    def __init__(self, root, ckpt_id: str):
        self.dir = None if root is None else Path(root) / ckpt_id    # the full id: a prefix could merge two seeds
        self.hits = self.misses = 0
    @staticmethod
    def key(items: list) -> str:
        def ident(x):
            if isinstance(x, Path):
                st = x.stat(); return [str(x.resolve()), st.st_size, st.st_mtime_ns]
            return x
        return hashlib.sha256(json.dumps([ident(x) for x in items]).encode()).hexdigest()[:24]
    def get(self, name: str, items: list, compute) -> torch.Tensor:
        if self.dir is None: return compute()
        f = self.dir / f'{name}-{self.key(items)}.pt'
        if f.is_file():
            self.hits += 1; return torch.load(f, weights_only=True)
        self.misses += 1
        x = compute()
        f.parent.mkdir(parents=True, exist_ok=True)
        tmp = f.with_suffix('.tmp'); torch.save(x, tmp); tmp.replace(f)   # atomic: a killed run leaves no half file
        return x

@dataclass
class Evaluator:
    "A model and the means to embed images and texts of one checkpoint, with the feature cache."
    model: object
    preprocess: object
    tokenizer: object
    ckpt_id: str
    cache: FeatureCache
    batch_size: int = 64
    device: str = 'cpu'
    progress: bool = True

    @torch.no_grad()
    def images(self, paths: list) -> torch.Tensor:
        "`(n, D)` L2-normalised image embeddings of image files."
        paths = [Path(p) for p in paths]
        def compute():
            out = []
            for i in tqdm(range(0, len(paths), self.batch_size), desc='images', disable=not self.progress, leave=False):
                x = torch.stack([self.preprocess(Image.open(p).convert('RGB')) for p in paths[i:i + self.batch_size]])
                out.append(self.model.encode_image(x.to(self.device), normalize=True).float().cpu())
            return torch.cat(out)
        return self.cache.get('img', paths, compute)

    @torch.no_grad()
    def texts(self, texts: list) -> torch.Tensor:
        "`(n, D)` L2-normalised text embeddings."
        texts = list(texts)
        def compute():
            out = []
            for i in tqdm(range(0, len(texts), self.batch_size), desc='texts', disable=not self.progress, leave=False):
                out.append(self.model.encode_text(self.tokenizer(texts[i:i + self.batch_size]).to(self.device), normalize=True).float().cpu())
            return torch.cat(out)
        return self.cache.get('txt', texts, compute)

    spec: dict = field(default_factory=dict)

    @classmethod
    def build(cls, model_name: str | None, checkpoint=None, cache_dir=None, seed: int = 0, device: str = 'cpu',
              model_kwargs: dict | None = None, **kw) -> 'Evaluator':
        m = load_model(model_name, checkpoint, seed, device, model_kwargs)
        return cls(m.model, m.preprocess, m.tokenizer, m.ckpt_id, FeatureCache(cache_dir, m.ckpt_id), device=device, spec=m.spec, **kw)


# %% [markdown]
# ## The five tasks
#
# Each task takes an `Evaluator` and loaded data and returns a flat dict of numbers. Zero-shot classifier
# weights are CLIP's: the mean of the normalised embeddings of every template filled with the class name,
# normalised again.

# %%
#| export
def task_retrieval(ev: Evaluator, data: RetrievalSet, ks=(1, 5, 10)) -> dict:
    texts, text_image = data.flat()
    sim = ev.images(data.images) @ ev.texts(texts).T                           # (I, T)
    per = len(texts) / len(data.images)
    return dict(retrieval_recall(sim, text_image, ks), n_images=len(data.images), n_texts=len(texts), skipped=data.skipped,
                **{f'chance_{k}': v for k, v in chance_recall(len(data.images), round(per), ks).items()} if per == round(per) else {})

def _embed_unique(fn, items: list) -> tuple[torch.Tensor, dict]:
    "Embed each distinct item once (categories share photos and captions): `(U, D)` and item -> row."
    uniq = list(dict.fromkeys(items))
    return fn(uniq), {x: i for i, x in enumerate(uniq)}

def task_sugarcrepe(ev: Evaluator, data: dict, skipped: dict | None = None) -> dict:
    out = {}
    rows_all = [r for rows in data.values() for r in rows]
    V, vi = _embed_unique(ev.images, [r[0] for r in rows_all])
    T, ti = _embed_unique(ev.texts, [t for r in rows_all for t in r[1:]])
    for c, rows in data.items():
        v = V[[vi[r[0]] for r in rows]]                                         # (n, D)
        pos, neg = (v * T[[ti[r[1]] for r in rows]]).sum(1), (v * T[[ti[r[2]] for r in rows]]).sum(1)
        a = sugarcrepe_accuracy(pos, neg)
        out.update({f'{c}': a['acc'], f'{c}_n': a['n'], f'{c}_ties': a['ties']})
        if skipped: out[f'{c}_skipped'] = skipped.get(c, 0)
    out['mean'] = float(np.mean([out[c] for c in data]))
    return out

def zeroshot_weights(ev: Evaluator, classnames: list, templates: list) -> torch.Tensor:
    "`(K, D)` class embeddings: mean over templates of the normalised prompt embeddings, renormalised."
    t = ev.texts([tpl.format(c=c) for c in classnames for tpl in templates])   # (K * P, D)
    return F.normalize(t.view(len(classnames), len(templates), -1).mean(1), dim=-1)

def task_zeroshot(ev: Evaluator, data: ClassificationSet, split: str = 'test') -> dict:
    paths, labels = data.splits[split]
    logits = ev.images(paths) @ zeroshot_weights(ev, data.classnames, data.templates).T   # (n, K)
    return dict(classification_metrics(logits, labels), n=len(paths), n_classes=len(data.classnames),
                chance_top1=100 * float(torch.bincount(labels).max()) / len(labels))

def task_linear_probe(ev: Evaluator, data: ClassificationSet, lambdas=LAMBDAS) -> dict:
    need = {'train', 'val', 'test'} - set(data.splits)
    if need: raise MissingData(f'linear probe needs train/val/test splits in classification.json; missing {sorted(need)}')
    feats = {s: (ev.images(data.splits[s][0]), data.splits[s][1]) for s in ('train', 'val', 'test')}
    r = linear_probe(feats['train'], feats['val'], feats['test'], len(data.classnames), lambdas)
    return dict(acc=r['acc'], **{'lambda': r['lambda']}, n_train=r['n_train'], n_val=r['n_val'], n_test=r['n_test'],
                **{f'val_acc@{k}': v for k, v in r['val_acc'].items()})

def task_winoground(ev: Evaluator, items: list) -> dict:
    i0, i1 = ev.images([r[0] for r in items]), ev.images([r[1] for r in items])
    c0, c1 = ev.texts([r[2] for r in items]), ev.texts([r[3] for r in items])
    s = torch.stack([torch.stack([(c0 * i0).sum(1), (c0 * i1).sum(1)], 1),
                     torch.stack([(c1 * i0).sum(1), (c1 * i1).sum(1)], 1)], 1)  # (n, caption, image)
    return winoground_scores(s)


# %% [markdown]
# ## One run: checkpoint x data set x tasks
#
# `load_task_data` finds each task's files under a data root (a `coco_sample` folder, a world folder, a
# SugarCrepe folder, a Winoground folder). A task asked for by name whose files are absent stops with the
# `MissingData` message; with `tasks='all'` it is skipped and the reason is written into the results.

# %%
#| export
TASKS = ('retrieval', 'sugarcrepe', 'zeroshot', 'linear_probe', 'winoground')

def load_task_data(task: str, root, image_root=None):
    root = Path(root)
    if task == 'retrieval':
        if (root / 'captions.jsonl').is_file(): return (load_coco_sample(root),)
        if root.is_file(): return (load_retrieval(root, image_root),)
        for name in ('retrieval.json', 'dataset_coco.json', 'dataset_flickr30k.json', 'dataset_flickr8k.json'):
            if (root / name).is_file(): return (load_retrieval(root / name, image_root),)
        raise MissingData(f'retrieval: expected {root}/retrieval.json ([{{"image", "caption": [..]}}], images in {root}/images), '
                          f"Karpathy's {root}/dataset_coco.json, or a coco_sample-style {root}/captions.jsonl")
    if task == 'sugarcrepe': return load_sugarcrepe(root, image_root)
    if task in ('zeroshot', 'linear_probe'):
        return (load_classification(root),)
    if task == 'winoground': return (load_winoground(root),)
    raise ValueError(f'unknown task {task!r}; known: {TASKS}')

RUNNERS = dict(retrieval=task_retrieval, sugarcrepe=task_sugarcrepe, zeroshot=task_zeroshot,
               linear_probe=task_linear_probe, winoground=task_winoground)

def find_data(root, tasks=TASKS, image_root=None, strict: bool = True) -> tuple[dict, dict]:
    "`({task: loaded data}, {task: reason skipped})`; `strict`: a task without data raises `MissingData`."
    found, skipped = {}, {}
    for task in tasks:
        if task not in RUNNERS: raise ValueError(f'unknown task {task!r}; known: {TASKS}')
        try: found[task] = load_task_data(task, root, image_root)
        except MissingData as e:
            if strict: raise
            log.warning('%s skipped: %s', task, e); skipped[task] = str(e)
    return found, skipped

def evaluate(ev: Evaluator, root, tasks=TASKS, image_root=None, strict: bool = True, found: tuple | None = None) -> tuple[dict, dict]:
    "`({task: metrics}, {task: reason skipped})`; `found`: `find_data`'s answer when the caller already has it."
    data, skipped = found or find_data(root, tasks, image_root, strict)
    metrics = {}
    for task, d in data.items():
        t0 = time.time()
        metrics[task] = RUNNERS[task](ev, *d)
        metrics[task]['seconds'] = round(time.time() - t0, 3)
    return metrics, skipped


# %% [markdown]
# A randomly initialised `powerclip-micro` through every task on the world folder written above. Random
# embeddings are near chance: retrieval near `chance_*`, SugarCrepe near 50% (a coin flip per pair), zero-shot
# near the majority share, Winoground text/image near 25% and group near 1/6 (Winoground's paper).
# The second pass is served by the cache.

# %%
ev = Evaluator.build('powerclip-micro', None, cache_dir=tmp / 'cache', progress=False)
t0 = time.time(); m1, _ = evaluate(ev, tmp / 'world'); t1 = time.time() - t0
ev2 = Evaluator.build('powerclip-micro', None, cache_dir=tmp / 'cache', progress=False)
t0 = time.time(); m2, _ = evaluate(ev2, tmp / 'world'); t2 = time.time() - t0
strip = lambda m: {t: {k: v for k, v in d.items() if k != 'seconds'} for t, d in m.items()}
test_eq(strip(m1), strip(m2)); test_eq(ev2.cache.misses, 0); assert ev2.cache.hits > 0
print(f'first run {t1:.1f}s, cached rerun {t2:.1f}s ({ev2.cache.hits} cache hits)')
{t: {k: round(v, 1) for k, v in d.items() if k in ('i2t_R@1', 't2i_R@1', 'chance_t2i_R@1', 'mean', 'top1', 'chance_top1', 'acc', 'text', 'image', 'group')} for t, d in m1.items()}


# %% [markdown]
# ## Results on disk and tables
#
# `write_result` writes one JSON per (checkpoint, data set): the metrics, the checkpoint's path and sha256
# (`random-init` for none), the model, the data root, the skipped tasks and the exact command. `results_table`
# reads any number of them and lays out one row per (data set, task, metric) and one column per checkpoint,
# as Markdown and CSV.

# %%
#| export
def write_result(out_dir, metrics: dict, skipped: dict, *, model, checkpoint, ckpt_id: str, data_root,
                 name: str | None = None, label: str | None = None, command: str | None = None) -> Path:
    "`out_dir/<label>/<name>.json`; label defaults to the checkpoint's file stem (or 'random-init')."
    label = label or (Path(checkpoint).stem if checkpoint else 'random-init')
    name = name or Path(data_root).name
    res = dict(checkpoint=None if checkpoint is None else str(checkpoint), label=label,
               sha256='random-init' if checkpoint is None else ckpt_id, checkpoint_id=ckpt_id, model=model,
               dataset=name, data_root=str(data_root), metrics=metrics, skipped=skipped,
               command=command or shlex.join(sys.argv), time=time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime()),
               torch=torch.__version__)
    f = Path(out_dir) / label / f'{name}.json'
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(json.dumps(res, indent=1))
    return f

HEADLINE = dict(retrieval=('i2t_R@1', 'i2t_R@5', 'i2t_R@10', 't2i_R@1', 't2i_R@5', 't2i_R@10'),
                sugarcrepe=SUGARCREPE + ('mean',), zeroshot=('top1', 'top5', 'mean_per_class_recall'),
                linear_probe=('acc',), winoground=('text', 'image', 'group'))

def results_table(paths) -> tuple[list[str], list[list]]:
    "`(header, rows)`: one row per (data set, task, metric), one column per checkpoint label."
    res = [json.loads(Path(p).read_text()) for p in paths]
    labels = list(dict.fromkeys(r['label'] for r in res))
    cells = {}
    for r in res:
        for task, m in r['metrics'].items():
            for k in HEADLINE.get(task, ()):
                if k in m: cells[(r['dataset'], task, k, r['label'])] = m[k]
    keys = list(dict.fromkeys((d, t, k) for d, t, k, _ in cells))
    return ['dataset', 'task', 'metric', *labels], [[*key, *(cells.get((*key, l)) for l in labels)] for key in keys]

def format_table(header: list, rows: list, fmt: str = 'md') -> str:
    cell = lambda v: '' if v is None else f'{v:.1f}' if isinstance(v, float) else str(v)
    if fmt == 'csv':
        s = io.StringIO(); w = csv.writer(s); w.writerow(header); w.writerows([[cell(v) for v in r] for r in rows]); return s.getvalue()
    lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
    return '\n'.join(lines + ['| ' + ' | '.join(cell(v) for v in r) + ' |' for r in rows]) + '\n'


# %%
f1 = write_result(tmp / 'results', m1, {}, model='powerclip-micro', checkpoint=None, ckpt_id=ev.ckpt_id, data_root=tmp / 'world', command='notebook')
f2 = write_result(tmp / 'results', m1, {}, model='powerclip-micro', checkpoint=None, ckpt_id=ev.ckpt_id, data_root=tmp / 'world', label='random-init-copy', command='notebook')
test_eq(json.loads(f1.read_text())['sha256'], 'random-init')
header, rows = results_table([f1, f2])
test_eq(header[-2:], ['random-init', 'random-init-copy'])
assert all(r[-1] == r[-2] for r in rows)
print(format_table(header, rows)[:600])


# %% [markdown]
# ## Command line
#
# ```
# powerclip-eval run --model powerclip-tiny [--checkpoint ckpt.pt] --data ../shared/data/coco_sample \
#     [--tasks retrieval sugarcrepe | all] [--out results/eval] [--cache ~/.cache/powerclip/features]
# powerclip-eval make-world /tmp/world --n-images 100     # the built-in world's evaluation folder
# powerclip-eval table results/eval/*/*.json --out results/eval/table   # table.md and table.csv
# ```
# `python -m powerclip.eval` is the same. `--tasks all` skips, and records, tasks whose data is absent;
# naming a task whose data is absent stops with the message saying what to put where (exit code 2).

# %%
#| export
def parse_args(argv=None):
    p = argparse.ArgumentParser(prog='powerclip-eval', description='Evaluate an open_clip checkpoint on local benchmark files.')
    sub = p.add_subparsers(dest='cmd', required=True)
    r = sub.add_parser('run', help='evaluate one checkpoint on one data root')
    r.add_argument('--model', default=None, help="model config: 'powerclip-tiny', 'powerclip-micro', 'ViT-B-16', a preset "
                   "(default: the one a trainer checkpoint names)")
    r.add_argument('--model-kwargs', default=None, type=json.loads, help='JSON open_clip model_kwargs overriding the config')
    r.add_argument('--checkpoint', default=None, help='local checkpoint file; omitted = random init (tests)')
    r.add_argument('--data', required=True, help='data root (coco_sample, a world folder, a SugarCrepe or Winoground folder)')
    r.add_argument('--images', default=None, help='image folder when it is not DATA/images (e.g. COCO val2017 for SugarCrepe)')
    r.add_argument('--tasks', nargs='+', default=['all'], help=f"some of {' '.join(TASKS)}, or all")
    r.add_argument('--name', default=None, help='data set name in the results (default: the data folder name)')
    r.add_argument('--label', default=None, help='checkpoint column label (default: the checkpoint file stem)')
    r.add_argument('--out', default='results/eval')
    r.add_argument('--cache', default=str(Path.home() / '.cache' / 'powerclip' / 'features'), help="feature cache; 'none' disables")
    r.add_argument('--seed', type=int, default=0, help='random-init seed when no checkpoint is given')
    r.add_argument('--batch-size', type=int, default=64)
    r.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    r.add_argument('--no-progress', action='store_true')
    w = sub.add_parser('make-world', help="write the built-in world's evaluation folder")
    w.add_argument('out'); w.add_argument('--n-images', type=int, default=100); w.add_argument('--seed', type=int, default=0)
    t = sub.add_parser('table', help='side-by-side table of result JSONs')
    t.add_argument('results', nargs='+'); t.add_argument('--out', default=None, help='write OUT.md and OUT.csv')
    return p.parse_args(argv)

def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format='%(levelname)s %(name)s: %(message)s')
    a = parse_args(argv)
    if a.cmd == 'make-world':
        print(json.dumps(write_world_eval_set(a.out, a.n_images, a.seed))); return 0
    if a.cmd == 'table':
        header, rows = results_table(a.results)
        md = format_table(header, rows)
        if a.out:
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out + '.md').write_text(md); Path(a.out + '.csv').write_text(format_table(header, rows, 'csv'))
        print(md); return 0
    tasks = list(TASKS) if a.tasks == ['all'] else a.tasks
    bad = set(tasks) - set(TASKS)
    if bad: print(f'unknown tasks {sorted(bad)}; known: {TASKS}', file=sys.stderr); return 2
    try:
        found = find_data(a.data, tasks, a.images, strict=a.tasks != ['all'])   # before the model: fail fast
        if not found[0]: print(f'no task found its data under {a.data}: {found[1]}', file=sys.stderr); return 2
        ev = Evaluator.build(a.model, a.checkpoint, None if a.cache == 'none' else a.cache, a.seed, a.device,
                             model_kwargs=a.model_kwargs, batch_size=a.batch_size, progress=not a.no_progress)
        metrics, skipped = evaluate(ev, a.data, found=found)
    except MissingData as e:
        print(f'missing data: {e}', file=sys.stderr); return 2
    except ValueError as e:     # no model name, a checkpoint that does not fit the architecture
        print(f'error: {e}', file=sys.stderr); return 2
    cmd = shlex.join(['powerclip-eval', *(sys.argv[1:] if argv is None else argv)])
    f = write_result(a.out, metrics, skipped, model=ev.spec, checkpoint=a.checkpoint, ckpt_id=ev.ckpt_id,
                     data_root=a.data, name=a.name, label=a.label, command=cmd)
    log.info('features: %d cache hits, %d computed', ev.cache.hits, ev.cache.misses)
    print(json.dumps(dict(result=str(f), metrics=metrics, skipped=list(skipped)), indent=1))
    return 0


# %%
#| export
# a notebook kernel also runs as __main__, but has no __file__: only `python -m powerclip.eval` runs here
if __name__ == '__main__' and '__file__' in globals(): sys.exit(main())
