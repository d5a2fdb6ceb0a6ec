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
#| default_exp eval.tasks

# %%
#| export
from __future__ import annotations

import hashlib
import json
import logging
import math
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from powerclip.eval.benchmarks import BENCHMARKS, KARPATHY_TEST_IMAGES, BenchmarkData, benchmark_data, open_wds, select
from powerclip.eval.data import (ClassificationSet, MissingData, RetrievalSet, Skips, load_classification, load_coco_sample,
                                 load_retrieval, load_sugarcrepe, load_winoground)
from powerclip.eval.metrics import (LAMBDAS, chance_recall, classification_metrics, hard_negative_accuracy, linear_probe,
                                    outranks, retrieval_recall, winoground_scores)
from powerclip.eval.models import Evaluator
from powerclip.methods import GlobalScorer
from powerclip.world import NEGATIVE_KINDS

log = logging.getLogger(__name__)

# %%
#| hide
import tempfile
from fastcore.test import test_close, test_eq, test_fail


# %% [markdown]
# # Evaluation tasks
#
# > The five tasks (retrieval, hard negatives, zero-shot classification, linear probe, Winoground) on an `Evaluator`, for each scorer the checkpoint's method offers; one run of a checkpoint on a data folder, the suite of the paper's benchmarks, and the world evaluation of the demo.

# %% [markdown]
# ## The five tasks
#
# Each task takes an `Evaluator`, loaded data (`61_eval_data`, `63_eval_benchmarks`) and a scorer name (default: the
# headline, the method's own) and returns a flat dict of numbers in percent, computed by `60_eval_metrics`:
#
# | task | scores | metric |
# |---|---|---|
# | retrieval | every image against every caption | R@1/5/10 both ways, and the chance level |
# | sugarcrepe | each image against its caption and its hard negative | accuracy per category (ties counted), their mean |
# | zeroshot | every image against every class prompt | top-1/top-5, mean per-class recall, the majority share |
# | linear_probe | none: a probe on the frozen global image features | test accuracy, chosen $\lambda$ |
# | winoground | each pair of images against its two captions | text, image and group scores |
#
# **Zero-shot prompts.** With the global scorer the class embedding is CLIP's prompt ensemble: the mean of the
# normalised embeddings of every template filled with the class name, normalised again. A scorer without a single
# embedding per caption (FILIP's late interaction) cannot average embeddings; its class score is the mean of its
# scores over the templates.
#
# **The linear probe** reads the global image embeddings whatever the method (every method offers `'global'`): it is
# computed once, with the headline scorer's run, not once per scorer.
#
# **Skipped items.** Each task's numbers carry how many bad parts its reader dropped (`skipped`; SugarCrepe per
# category, `<category>_skipped`); which ones and why go into the result JSON (`skipped_items`, below).

# %%
#| export
def task_retrieval(ev: Evaluator, data: RetrievalSet, scorer: str | None = None, ks=(1, 5, 10)) -> dict:
    texts, text_image = data.flat()
    sim = ev.scores(ev.image_features(data.images, scorer), ev.text_features(texts, scorer), scorer)   # (I, T)
    per = len(texts) / len(data.images)
    return dict(retrieval_recall(sim, text_image, ks), n_images=len(data.images), n_texts=len(texts), skipped=data.skipped,
                **{f'chance_{k}': v for k, v in chance_recall(len(data.images), round(per), ks).items()} if per == round(per) else {})

def _index(items: list) -> tuple[list, dict]:
    "The distinct items (categories share photos and captions, each is embedded once) and item -> row."
    uniq = list(dict.fromkeys(items))
    return uniq, {x: i for i, x in enumerate(uniq)}

def task_sugarcrepe(ev: Evaluator, data: dict, skipped: Skips | None = None, scorer: str | None = None) -> dict:
    """`data`: {category: [(image, caption, negative caption)]}, `skipped`: the reader's `Skips` -> accuracy (%) per
    category, `_n`, `_ties`, `_skipped`, and their `mean`."""
    rows = [r for rs in data.values() for r in rs]
    images, vi = _index([r[0] for r in rows])
    texts, ti = _index([t for r in rows for t in r[1:]])
    V, T = ev.image_features(images, scorer), ev.text_features(texts, scorer)
    img = [vi[r[0]] for r in rows]
    pos = ev.pair_scores(V, T, img, [ti[r[1]] for r in rows], scorer)          # (n,) all categories at once
    neg = ev.pair_scores(V, T, img, [ti[r[2]] for r in rows], scorer)
    out, start = {}, 0
    for c, rs in data.items():
        a = hard_negative_accuracy(pos[start:start + len(rs)], neg[start:start + len(rs)]); start += len(rs)
        out.update({f'{c}': a['acc'], f'{c}_n': a['n'], f'{c}_ties': a['ties']})
        if skipped is not None: out[f'{c}_skipped'] = skipped.count(c)
    out['mean'] = float(np.mean([out[c] for c in data]))
    return out

def zeroshot_logits(ev: Evaluator, img: dict, classnames: list, templates: list, scorer: str | None = None) -> torch.Tensor:
    "`(n, K)` class scores of `n` images' features: CLIP's prompt ensemble for the global scorer, else the mean score over templates."
    K, P = len(classnames), len(templates)
    txt = ev.text_features([tpl.format(c=c) for c in classnames for tpl in templates], scorer)   # K * P rows
    if isinstance(ev.scorer(scorer), GlobalScorer):
        w = F.normalize(txt['text'].view(K, P, -1).mean(1), dim=-1)                            # (K, D)
        return ev.scores(img, {'text': w}, scorer)
    return ev.scores(img, txt, scorer).view(-1, K, P).mean(2)

def _labelled(ev: Evaluator, data, split: str, scorer: str | None) -> tuple[dict, torch.Tensor]:
    "Features and labels of a split of a ClassificationSet (image files) or a BenchmarkData (a clip_benchmark data set)."
    if isinstance(data, ClassificationSet):
        paths, labels = data.splits[split]
        return ev.image_features(paths, scorer), labels
    return ev.dataset_features(lambda: data.open(split, ev.preprocess), data.key(split), scorer, desc=f'{data.name} {split}')

def task_zeroshot(ev: Evaluator, data, split: str = 'test', scorer: str | None = None) -> dict:
    "`data`: a `ClassificationSet` (image files) or a `BenchmarkData` (a clip_benchmark data set)."
    x, y = _labelled(ev, data, split, scorer)
    if y.max() >= len(data.classnames): raise ValueError(f'{getattr(data, "name", "data")}: label {int(y.max())} but {len(data.classnames)} class names')
    logits = zeroshot_logits(ev, x, data.classnames, data.templates, scorer)                 # (n, K)
    return dict(classification_metrics(logits, y), n=len(y), n_classes=len(data.classnames),
                chance_top1=100 * float(torch.bincount(y).max()) / len(y),
                **(dict(layout=data.layout) if isinstance(data, BenchmarkData) else dict(skipped=data.skips.count(split))))

def task_linear_probe(ev: Evaluator, data, lambdas=LAMBDAS, val_share: float = 0.2, seed: int = 0) -> dict:
    """A probe on the global image features. A `ClassificationSet` brings train/val/test splits; a clip_benchmark data
    set brings train/test, and the validation split is a seeded `val_share` of train (clip_benchmark's `val_proportion`)."""
    g = lambda split: (lambda x, y: (x['image'], y))(*_labelled(ev, data, split, 'global'))
    if isinstance(data, ClassificationSet):
        need = {'train', 'val', 'test'} - set(data.splits)
        if need: raise MissingData(f'linear probe needs train/val/test splits in classification.json; missing {sorted(need)}')
        tr, va, te = g('train'), g('val'), g('test')
    else:
        if 'train' not in data.splits: raise MissingData(f'{data.name}: the linear probe needs the train split too (train/nshards.txt or the raw train files)')
        (x, y), te = g('train'), g('test')
        perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
        nv = max(1, int(round(val_share * len(y))))
        tr, va = (x[perm[nv:]], y[perm[nv:]]), (x[perm[:nv]], y[perm[:nv]])
    r = linear_probe(tr, va, te, len(data.classnames), lambdas)
    return dict(acc=r['acc'], **{'lambda': r['lambda']}, n_train=r['n_train'], n_val=r['n_val'], n_test=r['n_test'],
                **{f'val_acc@{k}': v for k, v in r['val_acc'].items()},
                **(dict(skipped=len(data.skips)) if isinstance(data, ClassificationSet) else {}))

def task_winoground(ev: Evaluator, items: list, skipped: Skips | None = None, scorer: str | None = None) -> dict:
    "`items`: [(image_0, image_1, caption_0, caption_1)], `skipped`: the reader's `Skips` -> text, image and group scores (%)."
    n = len(items)
    I = ev.image_features([r[0] for r in items] + [r[1] for r in items], scorer)           # rows: i0 then i1
    C = ev.text_features([r[2] for r in items] + [r[3] for r in items], scorer)            # rows: c0 then c1
    k = torch.arange(n)
    s = lambda c, i: ev.pair_scores(I, C, k + i * n, k + c * n, scorer)                      # (n,) caption c, image i
    out = winoground_scores(torch.stack([torch.stack([s(0, 0), s(0, 1)], 1), torch.stack([s(1, 0), s(1, 1)], 1)], 1))  # (n, caption, image)
    return dict(out, **(dict(skipped=len(skipped)) if skipped is not None else {}))


# %% [markdown]
# ## One run: checkpoint x data set x tasks
#
# `load_task_data` finds each task's files under a data root (a `coco_sample` folder, a world folder, a SugarCrepe
# folder, a Winoground folder, a webdataset export). With `require` (tasks asked for by name) a task whose files are
# absent stops with the `MissingData` message; otherwise (`tasks='all'`) it is skipped and the reason is written into
# the results. With `strict` the readers stop at the first bad item (`BadData`, naming the file) instead of skipping
# and counting it; `skip_report` gives what they dropped, per task, for the result JSON. `evaluate` runs the tasks
# with one scorer; `evaluate_scorers` with each scorer of the checkpoint's method, from the same loaded data.

# %%
#| export
TASKS = ('retrieval', 'sugarcrepe', 'zeroshot', 'linear_probe', 'winoground')

def load_task_data(task: str, root, image_root=None, strict: bool = False) -> tuple:
    "The arguments of task `task`'s runner (after the evaluator) read from `root`; `strict`: a bad item raises `BadData`."
    root = Path(root)
    if task == 'retrieval':
        if (root / 'captions.jsonl').is_file(): return (load_coco_sample(root, strict=strict),)
        if root.is_file(): return (load_retrieval(root, image_root, strict=strict),)
        for name in ('retrieval.json', 'dataset_coco.json', 'dataset_flickr30k.json', 'dataset_flickr8k.json'):
            if (root / name).is_file(): return (load_retrieval(root / name, image_root, strict=strict),)
        raise MissingData(f'retrieval: expected {root}/retrieval.json ([{{"image", "caption": [..]}}], images in {root}/images), '
                          f"Karpathy's {root}/dataset_coco.json, or a coco_sample-style {root}/captions.jsonl")
    if task == 'sugarcrepe': return load_sugarcrepe(root, image_root, strict=strict)
    if task in ('zeroshot', 'linear_probe'):
        if (root / 'test' / 'nshards.txt').is_file(): return (open_wds(root),)     # clip_benchmark's webdataset export
        return (load_classification(root, strict),)
    if task == 'winoground': return load_winoground(root, strict)
    raise ValueError(f'unknown task {task!r}; known: {TASKS}')

def item_skips(task: str, args: tuple) -> Skips:
    "The `Skips` of a task's loaded data (`load_task_data`'s answer); empty for clip_benchmark's data sets."
    if task == 'retrieval': return args[0].skips
    if task in ('sugarcrepe', 'winoground'): return args[1]
    return getattr(args[0], 'skips', None) or Skips()

def skip_report(found: dict) -> dict:
    "`{task: Skips.report()}` of the tasks whose reader dropped something: the result JSON's `skipped_items`."
    return {t: item_skips(t, a).report() for t, a in found.items() if len(item_skips(t, a))}

RUNNERS = dict(retrieval=task_retrieval, sugarcrepe=task_sugarcrepe, zeroshot=task_zeroshot,
               linear_probe=task_linear_probe, winoground=task_winoground)
UNSCORED = ('linear_probe',)        # tasks that read the global image features whatever the scorer: run once

def find_data(root, tasks=TASKS, image_root=None, require: bool = True, strict: bool = False) -> tuple[dict, dict]:
    """`({task: loaded data}, {task: reason skipped})`; `require`: a task without data raises `MissingData`;
    `strict`: a bad item raises `BadData` (else it is skipped and counted, `skip_report`)."""
    found, skipped = {}, {}
    for task in tasks:
        if task not in RUNNERS: raise ValueError(f'unknown task {task!r}; known: {TASKS}')
        try: found[task] = load_task_data(task, root, image_root, strict)
        except MissingData as e:
            if require: raise
            skipped[task] = str(e)          # not logged here: a command line validating its data prints one line, or none
    return found, skipped

def _run_tasks(ev: Evaluator, data: dict, scorer: str, require: bool = True) -> tuple[dict, dict]:
    "`{task: metrics}` of one scorer on loaded data, and `{task: reason}` of tasks whose data turned out to be missing."
    metrics, skipped = {}, {}
    for task, d in data.items():
        if task in UNSCORED and scorer != ev.headline: continue
        t0 = time.time()
        try: metrics[task] = RUNNERS[task](ev, *d) if task in UNSCORED else RUNNERS[task](ev, *d, scorer=scorer)
        except MissingData as e:           # e.g. a probe without a train split: the zero-shot number still counts
            if require: raise
            skipped[task] = str(e); continue
        metrics[task]['seconds'] = round(time.time() - t0, 3)
    return metrics, skipped

def evaluate(ev: Evaluator, root, tasks=TASKS, image_root=None, require: bool = True, found: tuple | None = None,
             scorer: str | None = None, strict: bool = False) -> tuple[dict, dict]:
    "`({task: metrics}, {task: reason skipped})` with one scorer (default: the headline); `found`: `find_data`'s answer when the caller has it."
    data, skipped = found or find_data(root, tasks, image_root, require, strict)
    return _run_tasks(ev, data, scorer or ev.headline)[0], skipped

def evaluate_scorers(ev: Evaluator, root, tasks=TASKS, image_root=None, require: bool = True, found: tuple | None = None,
                     strict: bool = False) -> tuple[dict, dict]:
    "`({scorer: {task: metrics}}, {task: reason skipped})` for every scorer of the checkpoint's method, the headline first."
    found = found or find_data(root, tasks, image_root, require, strict)
    return {s: evaluate(ev, root, found=found, scorer=s)[0] for s in ev.scorers}, found[1]


# %% [markdown]
# A randomly initialised `powerclip-micro` through every task on a world benchmark folder. Random embeddings are
# near chance: retrieval near `chance_*`, hard negatives near 50% (a coin flip per pair), zero-shot near the majority
# share, Winoground text/image near 25% and group near 1/6 (Winoground's paper). The second pass is served by the cache.

# %%
from powerclip.eval.data import write_world_benchmark
tmp = Path(tempfile.mkdtemp())
write_world_benchmark(tmp / 'world', n_images=60)
ev = Evaluator.build('powerclip-micro', None, cache_dir=tmp / 'cache', progress=False)
t0 = time.time(); m1, _ = evaluate(ev, tmp / 'world'); t1 = time.time() - t0
ev2 = Evaluator.build('powerclip-micro', None, cache_dir=tmp / 'cache', progress=False)
t0 = time.time(); m2, _ = evaluate(ev2, tmp / 'world'); t2 = time.time() - t0
strip = lambda m: {t: {k: v for k, v in d.items() if k != 'seconds'} for t, d in m.items()}
test_eq(strip(m1), strip(m2)); test_eq(ev2.cache.misses, 0); assert ev2.cache.hits > 0
print(f'first run {t1:.1f}s, cached rerun {t2:.1f}s ({ev2.cache.hits} cache hits)')
{t: {k: round(v, 1) for k, v in d.items() if k in ('i2t_R@1', 't2i_R@1', 'chance_t2i_R@1', 'mean', 'top1', 'chance_top1', 'acc', 'text', 'image', 'group')} for t, d in m1.items()}

# %% [markdown]
# A model that gives NaN features (NaN weights put into a loaded model, past the loader's check) cannot produce a
# number: every task stops with `NonFiniteFeatures`, and so does the world evaluation below, which runs them (a
# checkpoint file with such weights is refused earlier, by `load_model`; `tests/test_eval.py` runs both ends).

# %%
from powerclip.eval.models import NonFiniteFeatures, load_model
_nan = load_model('powerclip-micro')
with torch.no_grad(): [q.fill_(float('nan')) for q in _nan.model.parameters()]
_nev = Evaluator.of(_nan, progress=False)
_found, _ = find_data(tmp / 'world')
for _task, _args in _found.items():
    test_fail(lambda: _run_tasks(_nev, {_task: _args}, 'global'), contains='non-finite')

# %% [markdown]
# The tasks through `pair_scores` give what the full score matrix gives: hard negatives and Winoground recomputed
# from all-pairs cosines of the global features agree to rounding.

# %%
sc, _ = load_sugarcrepe(tmp / 'world')
_rows = [r for rs in sc.values() for r in rs]
_V = ev.image_features([r[0] for r in _rows])['image']; _P, _N = (ev.text_features([r[k] for r in _rows])['text'] for k in (1, 2))
_acc = [hard_negative_accuracy((_V * _P).sum(1)[a:a + len(rs)], (_V * _N).sum(1)[a:a + len(rs)])['acc']
        for a, rs in zip(np.cumsum([0] + [len(rs) for rs in sc.values()]), sc.values())]
test_close(_acc, [m1['sugarcrepe'][c] for c in sc])
wg, _ = load_winoground(tmp / 'world')
_i0, _i1 = (ev.image_features([r[k] for r in wg])['image'] for k in (0, 1)); _c0, _c1 = (ev.text_features([r[k] for r in wg])['text'] for k in (2, 3))
_s = torch.stack([torch.stack([(_c0 * _i0).sum(1), (_c0 * _i1).sum(1)], 1), torch.stack([(_c1 * _i0).sum(1), (_c1 * _i1).sum(1)], 1)], 1)
test_eq(winoground_scores(_s), {k: v for k, v in m1['winoground'].items() if k not in ('seconds', 'skipped')})

# %% [markdown]
# The same classification images through clip_benchmark's reader (the world set's webdataset export) and through
# ours (`classification.json`) give the same numbers, zero-shot and probe.

# %%
cls = load_classification(tmp / 'world')
wdata = open_wds(tmp / 'world' / 'wds_shape')
_zs_wds, _zs_json = task_zeroshot(ev, wdata), task_zeroshot(ev, cls)
test_eq({k: _zs_wds[k] for k in ('top1', 'mean_per_class_recall', 'n')}, {k: _zs_json[k] for k in ('top1', 'mean_per_class_recall', 'n')})
test_eq(_zs_wds['layout'], 'wds')
_lp = task_linear_probe(ev, wdata)
test_eq((_lp['n_train'] + _lp['n_val'], _lp['n_test']), (60, 60))
{k: round(v, 1) for k, v in _zs_wds.items() if isinstance(v, float)}, _lp['acc']

# %% [markdown]
# A method with two scorers: a FILIP run folder (its `config.yaml` names the method) is scored by late interaction
# (the headline) and by the global cosine; the probe is computed once; the zero-shot logits of the late scorer are
# the mean of its scores over the templates.

# %%
from powerclip.eval.models import load_model
from powerclip.model import create_model
(tmp / 'filip').mkdir()
torch.manual_seed(2); torch.save(create_model('powerclip-micro')[0].state_dict(), tmp / 'filip' / 'model.pt')
(tmp / 'filip' / 'config.yaml').write_text('model:\n  name: powerclip-micro\n  kwargs: {}\nmethod: filip\nmethod_cfg: {}\n')
fev = Evaluator.of(load_model(checkpoint=tmp / 'filip'), cache_dir=tmp / 'cache', progress=False)
by, _ = evaluate_scorers(fev, tmp / 'world', tasks=('retrieval', 'zeroshot', 'linear_probe'))
test_eq({s: sorted(m) for s, m in by.items()}, {'late': ['linear_probe', 'retrieval', 'zeroshot'], 'global': ['retrieval', 'zeroshot']})
assert by['late']['retrieval']['i2t_R@1'] != by['global']['retrieval']['i2t_R@1'] or by['late']['zeroshot'] != by['global']['zeroshot']
_x = fev.image_features(cls.splits['test'][0][:3], 'late')
_full = fev.scores(_x, fev.text_features([t.format(c=c) for c in cls.classnames for t in cls.templates], 'late'), 'late')
torch.testing.assert_close(zeroshot_logits(fev, _x, cls.classnames, cls.templates, 'late'), _full.view(3, len(cls.classnames), -1).mean(2))
{s: {t: round(m[t].get('i2t_R@1', m[t].get('top1', m[t].get('acc'))), 1) for t in m} for s, m in by.items()}

# %% [markdown]
# ## The world evaluation of the demo
#
# `evaluate_world` is what the comparison (`70_compare`) reports for each run on its held-out world folder
# (`write_world_benchmark`): the hard-negative accuracy per kind (`hn_<kind>`, NaN when the folder has no item of that
# kind) and their mean (`hn_mean`), and retrieval R@1 and R@5 both ways, all in percent. The headline scorer's numbers
# carry these keys and `scorer` names it; the other scorers' numbers carry the same keys prefixed `<scorer>:`.
#
# Captions go through the model's tokenizer. On the world's captions that gives exactly the ids of the gold-tree
# tokens a run trains on (`parsing.tree_tokens`), checked below on every caption and negative of the folder, so the
# evaluation reads captions as training does.
#
# **Per item.** With `per_item=True` the result also holds, under `items`, each scorer's answer item by item: for every
# hard negative, every image (image to text) and every caption (text to image), the scene it belongs to (its image file)
# and a hit (1) or a miss (0) under the same tie rule; the mean of the hits is the number above (per kind, R@1). The
# comparison's bootstrap over held-out scenes (`69_stats`) resamples them. An evaluator with a feature cache computes
# the features once for both.

# %%
#| export
WORLD_KEYS = ('i2t_R@1', 'i2t_R@5', 't2i_R@1', 't2i_R@5')

def recall1_hits(sim: torch.Tensor, text_image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    "Per-item R@1 of `retrieval_recall` (same ranks, same tie rule): `(I,)` image-to-text hits (images without a caption: False), `(T,)` text-to-image hits."
    I, T = sim.shape
    sim, text_image = sim.float(), torch.as_tensor(text_image, dtype=torch.long)
    own = torch.zeros(I, T, dtype=torch.bool); own[text_image, torch.arange(T)] = True
    pos_t = sim[text_image, torch.arange(T)]                                                   # (T,)
    t2i = ((outranks(sim, pos_t[None]) & ~own).sum(0) < 1) & ~pos_t.isnan()                   # (T,)
    best_i = sim.masked_fill(~own | sim.isnan(), -math.inf).max(1).values                     # (I,)
    best_i = best_i.masked_fill(best_i == -math.inf, math.nan)
    i2t = ((outranks(sim, best_i[:, None]) & ~own).sum(1) < 1) & ~best_i.isnan()              # (I,)
    return i2t, t2i

def world_items(ev: Evaluator, found: dict, scorer: str | None = None) -> dict:
    """`evaluate_world`'s answers item by item (see above), from `find_data`'s loaded `found`:
    `{'hn': {kind: {'image': [file name], 'hit': [0/1]}}, 'i2t_R@1': {...}, 't2i_R@1': {...}}`."""
    sc, ret = found['sugarcrepe'][0], found['retrieval'][0]
    rows = [r for rs in sc.values() for r in rs]
    images, vi = _index([r[0] for r in rows])
    texts, ti = _index([t for r in rows for t in r[1:]])
    V, T = ev.image_features(images, scorer), ev.text_features(texts, scorer)
    img = [vi[r[0]] for r in rows]
    pos = ev.pair_scores(V, T, img, [ti[r[1]] for r in rows], scorer)                          # (n,)
    neg = ev.pair_scores(V, T, img, [ti[r[2]] for r in rows], scorer)
    hit, out, start = (~outranks(neg, pos)).int().tolist(), {'hn': {}}, 0
    for c, rs in sc.items():
        out['hn'][c] = dict(image=[Path(r[0]).name for r in rs], hit=hit[start:start + len(rs)]); start += len(rs)
    captions, text_image = ret.flat()
    i2t, t2i = recall1_hits(ev.scores(ev.image_features(ret.images, scorer), ev.text_features(captions, scorer), scorer), text_image)
    has = torch.zeros(len(ret.images), dtype=torch.bool); has[torch.as_tensor(text_image, dtype=torch.long)] = True
    names = [Path(p).name for p in ret.images]
    out['i2t_R@1'] = dict(image=[n for n, h in zip(names, has.tolist()) if h], hit=i2t[has].int().tolist())
    out['t2i_R@1'] = dict(image=[names[i] for i in torch.as_tensor(text_image).tolist()], hit=t2i.int().tolist())
    return out

def evaluate_world(ev: Evaluator, root, per_item: bool = False) -> dict:
    "The comparison's numbers (%) on a world benchmark folder, for every scorer: `hn_<kind>`, `hn_mean`, R@1/R@5 both ways; `per_item`: also `items` (see above)."
    found = find_data(root, ('sugarcrepe', 'retrieval'))
    out = dict(scorer=ev.headline)
    for s in ev.scorers:
        m, _ = evaluate(ev, root, found=found, scorer=s)
        hn = {f'hn_{k}': m['sugarcrepe'].get(k, math.nan) for k in NEGATIVE_KINDS}
        res = {**hn, 'hn_mean': m['sugarcrepe']['mean'], **{k: m['retrieval'][k] for k in WORLD_KEYS}}
        out.update({(k if s == ev.headline else f'{s}:{k}'): v for k, v in res.items()})
    if per_item: out['items'] = {s: world_items(ev, found[0], s) for s in ev.scorers}
    return out


# %%
import json
from powerclip.parsing import ParsedCaption, tree_tokens
_parses = json.loads((tmp / 'world' / 'parses.json').read_text())
_tok = torch.stack([tree_tokens(ParsedCaption.from_dict(p), context_length=ev.model.context_length).tokens for p in _parses.values()])
test_eq(ev.tokenizer(list(_parses)), _tok)
res = evaluate_world(ev, tmp / 'world')
test_eq(res['scorer'], 'global'); assert set(res) >= {'hn_swap_att', 'hn_mean', 'i2t_R@1', 't2i_R@5'}
assert all(0 <= v <= 100 for v in res.values() if isinstance(v, float) and v == v)
test_eq(res['hn_mean'], m1['sugarcrepe']['mean']); test_eq(res['i2t_R@5'], m1['retrieval']['i2t_R@5'])
fres = evaluate_world(fev, tmp / 'world', per_item=True)
test_eq(fres['scorer'], 'late'); assert 'global:hn_mean' in fres and 'late:hn_mean' not in fres
for _s, _pre in (('late', ''), ('global', 'global:')):             # the items' means are the numbers, for each scorer
    _it = fres['items'][_s]
    test_close([100 * np.mean(_it['hn'][k]['hit']) for k in _it['hn']], [fres[f'{_pre}hn_{k}'] for k in _it['hn']])
    test_close(np.mean([100 * np.mean(_it['hn'][k]['hit']) for k in _it['hn']]), fres[f'{_pre}hn_mean'])
    test_close([100 * np.mean(_it[k]['hit']) for k in ('i2t_R@1', 't2i_R@1')], [fres[f'{_pre}i2t_R@1'], fres[f'{_pre}t2i_R@1']])
test_eq(len(fres['items']['late']['t2i_R@1']['image']), len(load_retrieval(tmp / 'world' / 'retrieval.json').flat()[0]))
_sim, _ti = torch.tensor([[1.0, 1.0, 1.0], [0.0, 2.0, 1.0]]), torch.tensor([0, 1, 1])
_i2t, _t2i = recall1_hits(_sim, _ti)                                 # ties count against: image 0 and caption 2 miss
test_eq((_i2t.tolist(), _t2i.tolist()), ([False, True], [True, True, False]))
test_close([100 * _i2t.float().mean().item(), 100 * _t2i.float().mean().item()], [retrieval_recall(_sim, _ti, (1,))[k] for k in ('i2t_R@1', 't2i_R@1')])
{k: round(v, 1) for k, v in res.items() if k != 'scorer'}


# %% [markdown]
# ## Results on disk, and the suite
#
# `write_result` writes one JSON per (checkpoint, data set), `<out>/<label>/<data set>.json`: the headline scorer's
# metrics (`metrics`), its name (`scorer`) and the other scorers' metrics (`other_scorers`), the method, the
# checkpoint's path and sha256 (`random-init` for none) and `checkpoint_id`, the model, the data root, the tasks
# skipped for want of data (`skipped`, with the reason), the items the readers dropped (`skipped_items`: per task the
# count per reason and the files, `Skips.report()`), and the exact command. `65_eval_tables` lays them out, one column
# per label.
#
# **Two checkpoints never share a label.** The label defaults to the run's name: the folder's name for a run folder,
# for its `model.pt` and for its `checkpoints/last.pt` (every run exports a `model.pt`, so the file's stem would be
# `model` for all of them); else the checkpoint file's stem; `random-init` without a checkpoint. Before writing,
# `result_label` looks at the results already under `<out>/<label>/`: if they belong to another checkpoint (another
# `checkpoint_id`), this one is written under `<label>-<sha8>` (the first 8 hex digits of its sha256; of its id for a
# random initialisation), and a warning says so. The same checkpoint evaluated again replaces its own results.
#
# `run_suite` evaluates the named benchmarks (default: all 28 of the paper, as 27 data sets since the linear probes
# share CIFAR and ImageNet) found under `root/<folder>` (`63_eval_benchmarks`), and returns the reasons of those it
# skipped. Naming benchmarks explicitly (`require`) stops at the first absent one. Its JSONs are written at the end,
# when every benchmark has been scored: a checkpoint that stops the evaluation (non-finite features) leaves no result.

# %%
#| export
def default_label(checkpoint) -> str:
    "The run folder's name for a run folder, its `model.pt` or its `checkpoints/last.pt`; else the file's stem; 'random-init' for None."
    if checkpoint is None: return 'random-init'
    p = Path(checkpoint).resolve()
    if p.is_dir(): return p.name
    if p.name == 'model.pt': return p.parent.name
    if p.name == 'last.pt': return p.parent.parent.name if p.parent.name == 'checkpoints' else p.parent.name
    return p.stem

def result_label(out_dir, label: str, ckpt_id: str) -> str:
    "`label`, or `label-<sha8>` when results of another checkpoint already hold `out_dir/<label>/` (see above)."
    others = set()
    for f in sorted((Path(out_dir) / label).glob('*.json')):
        try: r = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError): continue              # not a result of ours
        if isinstance(r, dict) and 'metrics' in r: others.add(r.get('checkpoint_id') or r.get('sha256') or f'unknown ({f.name})')
    others.discard(ckpt_id)
    if not others: return label
    sha8 = (ckpt_id if not ckpt_id.startswith('random-init') else hashlib.sha256(ckpt_id.encode()).hexdigest())[:8]
    new = f'{label}-{sha8}'
    log.warning('result label %r in %s holds another checkpoint (%s); this one (%s) is written under %r', label, out_dir,
                ', '.join(sorted(o[:16] for o in others)), ckpt_id[:16], new)
    return new

def write_result(out_dir, metrics: dict, skipped: dict, *, model, checkpoint, ckpt_id: str, data_root,
                 name: str | None = None, label: str | None = None, command: str | None = None,
                 method: str | None = None, scorer: str = 'global', other_scorers: dict | None = None,
                 skipped_items: dict | None = None) -> Path:
    "`out_dir/<label>/<name>.json`; label: `label` or `default_label(checkpoint)`, made unique by `result_label`."
    label = result_label(out_dir, label or default_label(checkpoint), ckpt_id)
    name = name or Path(data_root).name
    res = dict(checkpoint=None if checkpoint is None else str(checkpoint), label=label,
               sha256='random-init' if checkpoint is None else ckpt_id, checkpoint_id=ckpt_id, model=model, method=method,
               dataset=name, data_root=str(data_root), scorer=scorer, metrics=metrics, other_scorers=other_scorers or {},
               skipped=skipped, skipped_items=skipped_items or {}, command=command or shlex.join(sys.argv),
               time=time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime()), torch=torch.__version__)
    f = Path(out_dir) / label / f'{name}.json'
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(json.dumps(res, indent=1))
    return f

def write_scored(out_dir, ev: Evaluator, by_scorer: dict, skipped: dict, **kw) -> Path:
    "`write_result` of `evaluate_scorers`' answer: the headline's metrics, the others beside them."
    return write_result(out_dir, by_scorer[ev.headline], skipped, model=ev.spec, ckpt_id=ev.ckpt_id, method=ev.method,
                        scorer=ev.headline, other_scorers={s: m for s, m in by_scorer.items() if s != ev.headline}, **kw)

def run_suite(ev: Evaluator, root, names=('all',), out_dir='results/eval', label: str | None = None, checkpoint=None,
              require: bool = False, command: str | None = None, strict: bool = False) -> tuple[dict, dict]:
    "`({benchmark: result JSON path}, {benchmark: reason skipped})`; `require`: an absent benchmark raises; `strict`: a bad item raises."
    results, skipped = {}, {}
    for name in tqdm(select(names), desc='benchmarks', disable=not ev.progress):
        b = BENCHMARKS[name]
        try: data = benchmark_data(name, Path(root) / b.folder, strict)
        except MissingData as e:
            if require: raise
            log.warning('%s skipped: %s', name, e); skipped[name] = str(e); continue
        by, task_skipped = {}, {}
        for s in ev.scorers:
            by[s], sk = _run_tasks(ev, data, s, require)
            task_skipped.update(sk)
            if name in KARPATHY_TEST_IMAGES and 'retrieval' in by[s]:
                ok = by[s]['retrieval']['n_images'] == KARPATHY_TEST_IMAGES[name]
                by[s]['retrieval']['karpathy_size_ok'] = ok
                if not ok and s == ev.headline:
                    log.warning('%s: %d test images, the Karpathy test split has %d', name, by[s]['retrieval']['n_images'], KARPATHY_TEST_IMAGES[name])
        results[name] = (by, task_skipped, skip_report(data))
    written = {name: write_scored(out_dir, ev, by, task_skipped, checkpoint=checkpoint, data_root=Path(root) / BENCHMARKS[name].folder,
                                  name=BENCHMARKS[name].folder, label=label, command=command, skipped_items=items)
               for name, (by, task_skipped, items) in results.items()}
    return written, skipped


# %%
f1 = write_scored(tmp / 'results', fev, by, {}, checkpoint=tmp / 'filip' / 'model.pt', data_root=tmp / 'world', command='notebook')
r1 = json.loads(f1.read_text())
test_eq((r1['label'], r1['method'], r1['scorer'], list(r1['other_scorers'])), ('filip', 'filip', 'late', ['global']))
test_eq(r1['metrics'], by['late']); test_eq(r1['sha256'], fev.ckpt_id)

# %% [markdown]
# Labels: a run folder, its `model.pt` and its `checkpoints/last.pt` are all the run's name. Another checkpoint under
# the same label goes to `<label>-<sha8>`; the first one evaluated again keeps its label and replaces its result.

# %%
test_eq([default_label(x) for x in (tmp / 'filip', tmp / 'filip' / 'model.pt', tmp / 'r7' / 'checkpoints' / 'last.pt',
                                    tmp / 'ck' / 'step_100.pt', None)], ['filip', 'filip', 'r7', 'step_100', 'random-init'])
_other = dict(model=fev.spec, data_root=tmp / 'world', command='notebook')
f2 = write_result(tmp / 'results', {}, {}, checkpoint=tmp / 'x' / 'filip' / 'model.pt', ckpt_id='ab' * 32, **_other)
test_eq(f2.parent.name, 'filip-abababab')
test_eq(write_scored(tmp / 'results', fev, by, {}, checkpoint=tmp / 'filip' / 'model.pt', data_root=tmp / 'world', command='notebook'), f1)
test_eq(write_result(tmp / 'results', {}, {}, checkpoint=None, ckpt_id='random-init-powerclip-micro-seed1', **_other).parent.name, 'random-init')
_f3 = write_result(tmp / 'results', {}, {}, checkpoint=None, ckpt_id='random-init-powerclip-micro-seed2', **_other)
test_eq(_f3.parent.name, 'random-init-' + hashlib.sha256(b'random-init-powerclip-micro-seed2').hexdigest()[:8])
