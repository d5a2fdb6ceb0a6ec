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
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from powerclip.checkpoint import RELEASE_WEIGHTS
from powerclip.eval.benchmarks import BENCHMARKS, KARPATHY_TEST_IMAGES, BenchmarkData, benchmark_data, open_wds, select
from powerclip.eval.data import (SUGARCREPE, ClassificationSet, RetrievalSet, load_classification, load_coco_sample,
                                 load_retrieval, load_sugarcrepe, load_winoground)
from powerclip.eval.items import ItemSkips, MissingData
from powerclip.eval.metrics import (LAMBDAS, chance_recall, classification_metrics, hard_negative_accuracy,
                                    linear_probe, retrieval_recall, winoground_scores)
from powerclip.eval.models import Evaluator
from powerclip.eval.region_data import RegionSet, RegionSkips, load_regions
from powerclip.eval.regions import region_task
from powerclip.methods import GlobalScorer

log = logging.getLogger(__name__)

# %%
#| hide
import tempfile
from fastcore.test import test_close, test_eq, test_fail


# %% [markdown]
# # Evaluation tasks
#
# > The six tasks on an `Evaluator`, one run of a checkpoint on a data folder, and the paper's suite.
#
# The tasks (retrieval, hard negatives, zero-shot classification, linear probe, Winoground, region classification) run for
# each scorer the checkpoint's method offers, each one record of the task registry.

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
    return dict(retrieval_recall(sim, text_image, ks), n_images=len(data.images), n_texts=len(texts),
                skipped=data.skipped,
                **{f'chance_{k}': v for k, v in chance_recall(len(data.images), round(per), ks).items()}
                if per == round(per) else {})

def unique_index(items: list) -> tuple[list, dict]:
    "The distinct items (categories share photos and captions, each is embedded once) and item -> row."
    uniq = list(dict.fromkeys(items))
    return uniq, {x: i for i, x in enumerate(uniq)}

def task_sugarcrepe(ev: Evaluator, data: dict, skipped: ItemSkips | None = None, scorer: str | None = None) -> dict:
    """`data`: {category: [(image, caption, negative caption)]}, `skipped`: the reader's `ItemSkips` -> accuracy (%) per
    category, `_n`, `_ties`, `_skipped`, and their `mean`."""
    rows = [r for rs in data.values() for r in rs]
    images, vi = unique_index([r[0] for r in rows])
    texts, ti = unique_index([t for r in rows for t in r[1:]])
    V, T = ev.image_features(images, scorer), ev.text_features(texts, scorer)
    img = [vi[r[0]] for r in rows]
    pos = ev.pair_scores(V, T, img, [ti[r[1]] for r in rows], scorer)          # (n,) all categories at once
    neg = ev.pair_scores(V, T, img, [ti[r[2]] for r in rows], scorer)
    out, start = {}, 0
    for c, rs in data.items():
        a = hard_negative_accuracy(pos[start:start + len(rs)], neg[start:start + len(rs)])
        start += len(rs)
        out.update({f'{c}': a['acc'], f'{c}_n': a['n'], f'{c}_ties': a['ties']})
        if skipped is not None:
            out[f'{c}_skipped'] = skipped.count(c)
    out['mean'] = float(np.mean([out[c] for c in data]))
    return out

def zeroshot_logits(ev: Evaluator, img: dict, classnames: list, templates: list,
                    scorer: str | None = None) -> torch.Tensor:
    """`(n, K)` class scores of `n` images' features: CLIP's prompt ensemble for the global scorer, else the mean score
    over templates."""
    K, P = len(classnames), len(templates)
    txt = ev.text_features([tpl.format(c=c) for c in classnames for tpl in templates], scorer)   # K * P rows
    if isinstance(ev.scorer(scorer), GlobalScorer):
        w = F.normalize(txt['text'].view(K, P, -1).mean(1), dim=-1)                            # (K, D)
        return ev.scores(img, {'text': w}, scorer)
    return ev.scores(img, txt, scorer).view(-1, K, P).mean(2)

def _labelled(ev: Evaluator, data, split: str, scorer: str | None) -> tuple[dict, torch.Tensor]:
    """Features and labels of a split of a ClassificationSet (image files) or a BenchmarkData (a clip_benchmark data
    set)."""
    if isinstance(data, ClassificationSet):
        paths, labels = data.splits[split]
        return ev.image_features(paths, scorer), labels
    return ev.dataset_features(lambda: data.open(split, ev.preprocess), data.key(split), scorer,
                               desc=f'{data.name} {split}')

def task_zeroshot(ev: Evaluator, data, split: str = 'test', scorer: str | None = None) -> dict:
    "`data`: a `ClassificationSet` (image files) or a `BenchmarkData` (a clip_benchmark data set)."
    x, y = _labelled(ev, data, split, scorer)
    if y.max() >= len(data.classnames):
        raise ValueError(f'{getattr(data, "name", "data")}: label {int(y.max())} but '
                         f'{len(data.classnames)} class names')
    logits = zeroshot_logits(ev, x, data.classnames, data.templates, scorer)                 # (n, K)
    return dict(classification_metrics(logits, y), n=len(y), n_classes=len(data.classnames),
                chance_top1=100 * float(torch.bincount(y).max()) / len(y),
                **(dict(layout=data.layout) if isinstance(data, BenchmarkData)
                   else dict(skipped=data.skips.count(split))))

def task_linear_probe(ev: Evaluator, data, lambdas=LAMBDAS, val_share: float = 0.2, seed: int = 0) -> dict:
    """A probe on the global image features. A `ClassificationSet` brings train/val/test splits; a clip_benchmark data
    set brings train/test, and the validation split is a seeded `val_share` of train (clip_benchmark's
    `val_proportion`)."""
    g = lambda split: (lambda x, y: (x['image'], y))(*_labelled(ev, data, split, 'global'))
    if isinstance(data, ClassificationSet):
        need = {'train', 'val', 'test'} - set(data.splits)
        if need:
            raise MissingData('linear probe needs train/val/test splits in '
                              f'classification.json; missing {sorted(need)}')
        tr, va, te = g('train'), g('val'), g('test')
    else:
        if 'train' not in data.splits:
            raise MissingData(f'{data.name}: the linear probe needs the train split too '
                              '(train/nshards.txt or the raw train files)')
        (x, y), te = g('train'), g('test')
        perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
        nv = max(1, int(round(val_share * len(y))))
        tr, va = (x[perm[nv:]], y[perm[nv:]]), (x[perm[:nv]], y[perm[:nv]])
    r = linear_probe(tr, va, te, len(data.classnames), lambdas)
    return dict(acc=r['acc'], **{'lambda': r['lambda']}, n_train=r['n_train'], n_val=r['n_val'], n_test=r['n_test'],
                **{f'val_acc@{k}': v for k, v in r['val_acc'].items()},
                **(dict(skipped=len(data.skips)) if isinstance(data, ClassificationSet) else {}))

def task_winoground(ev: Evaluator, items: list, skipped: ItemSkips | None = None, scorer: str | None = None) -> dict:
    """`items`: [(image_0, image_1, caption_0, caption_1)], `skipped`: the reader's `ItemSkips` -> text, image and group
    scores (%)."""
    n = len(items)
    I = ev.image_features([r[0] for r in items] + [r[1] for r in items], scorer)           # rows: i0 then i1
    C = ev.text_features([r[2] for r in items] + [r[3] for r in items], scorer)            # rows: c0 then c1
    k = torch.arange(n)
    s = lambda c, i: ev.pair_scores(I, C, k + i * n, k + c * n, scorer)                      # (n,) caption c, image i
    # (n, caption, image)
    out = winoground_scores(torch.stack([torch.stack([s(0, 0), s(0, 1)], 1), torch.stack([s(1, 0), s(1, 1)], 1)], 1))
    return dict(out, **(dict(skipped=len(skipped)) if skipped is not None else {}))


# %% [markdown]
# ## The task registry
#
# A task is one record, `Task`, in one registry, `TASKS`, as a method is one class in `METHODS` (`40_methods`): where
# its data comes from (`load`), how it is scored (`run`), what its reader dropped (`skips`), the numbers its tables
# show with their display names (`headline`: the side-by-side table's rows, `65_eval_tables`, and the comparison's
# headline, `68_eval_world_scores`), and whether it is scored once per scorer of the method or once in all (`scored`:
# the linear probe reads the global image features whatever the scorer). The command line (`--tasks`), the runs and
# the tables read the registry; a new task is a record here (and its functions), nothing else.

# %%
#| export
@dataclass(frozen=True)
class Task:
    "One evaluation task (see above)."
    name: str
    load: Callable        # (root: Path, image_root, strict) -> the runner's arguments after the evaluator; MissingData
                          # when absent
    run: Callable         # (ev, *args[, scorer=]) -> {metric: number} in percent; an unscored task's runner takes no
                          # scorer
    skips: Callable       # load's answer -> the reader's `ItemSkips` (the items it dropped)
    headline: dict        # metric -> display name: the numbers the tables show, in their order
    scored: bool = True   # False: one run with the headline scorer, reading the global image features
    options: tuple = ()   # the keyword options its `load` takes beyond (root, image_root, strict): ('vocabulary',)

TASKS: dict[str, Task] = {}

def register_task(task: Task) -> Task:
    "Add `task` to `TASKS`. A record of the same name with another runner is an error (the same one again replaces it)."
    old = TASKS.get(task.name)
    if old is not None and old.run.__qualname__ != task.run.__qualname__:
        raise ValueError(f'task {task.name!r} is already registered (runner {old.run.__qualname__})')
    TASKS[task.name] = task
    return task

def _retrieval_data(root: Path, image_root=None, strict: bool = False) -> tuple:
    if (root / 'captions.jsonl').is_file():
        return (load_coco_sample(root, strict=strict),)
    if root.is_file():
        return (load_retrieval(root, image_root, strict=strict),)
    for name in ('retrieval.json', 'dataset_coco.json', 'dataset_flickr30k.json', 'dataset_flickr8k.json'):
        if (root / name).is_file():
            return (load_retrieval(root / name, image_root, strict=strict),)
    raise MissingData(f'retrieval: expected {root}/retrieval.json ([{{"image", "caption": [..]}}], images in '
                      f"{root}/images), Karpathy's {root}/dataset_coco.json, or a "
                      f"coco_sample-style {root}/captions.jsonl")

def _classification_data(root: Path, image_root=None, strict: bool = False) -> tuple:
    if (root / 'test' / 'nshards.txt').is_file():
        return (open_wds(root),)         # clip_benchmark's webdataset export
    return (load_classification(root, strict),)

def _own_skips(args: tuple) -> ItemSkips:
    "The skips a data set carries (a `RetrievalSet`, a `ClassificationSet`); none for clip_benchmark's data sets."
    return getattr(args[0], 'skips', None) or ItemSkips()

for _t in [
    Task('retrieval', _retrieval_data, task_retrieval, _own_skips,
         {f'{d}_R@{k}': f'{d} R@{k}' for d in ('i2t', 't2i') for k in (1, 5, 10)}),
    Task('sugarcrepe', lambda root, image_root=None, strict=False: load_sugarcrepe(root, image_root, strict=strict),
         task_sugarcrepe, lambda args: args[1], {**{c: c for c in SUGARCREPE}, 'mean': 'HN mean'}),
    Task('zeroshot', _classification_data, task_zeroshot, _own_skips,
         dict(top1='top-1', top5='top-5', mean_per_class_recall='mean per-class recall')),
    Task('linear_probe', _classification_data, task_linear_probe, _own_skips, dict(acc='accuracy'), scored=False),
    Task('winoground', lambda root, image_root=None, strict=False: load_winoground(root, strict), task_winoground,
         lambda args: args[1], dict(text='text', image='image', group='group')),
]:
    register_task(_t)


# %% [markdown]
# **Regions** (`63a_eval_regions`): the sixth task reads every COCO-format instances file of a folder
# (`annotations/instances_*.json`, or the file itself), files with the same classes merged into one set (`coco_sample`'s
# val2017 and train2017), and classifies their ground-truth regions, pooled and cropped. The set with the most classes
# gives the task's unprefixed numbers (`pooled_top1`, `pooled_ap50`, ...: on the world, the attribute-bound "red circle"
# vocabulary); every other set's numbers carry its name (`shape/pooled_top1`). What the readers dropped and the regions
# outside the model's view are counted in the result's `skipped_items`. The task's one option, `vocabulary` (`--vocab`
# of the command line: `all` or `ovcoco`, `61a_eval_region_data`), picks the classes, and the result records it
# (`vocabulary`) beside the chance levels of every group (`chance_ap50_novel`, ...), so a table of region numbers says
# which vocabulary they were scored in (`65_eval_tables`).

# %%
#| export
def merge_region_sets(sets: list) -> RegionSet:
    "One `RegionSet` of several with the same classes: images and regions concatenated, their skips together."
    images, sizes, regions, skips = [], [], [], RegionSkips(sets[0].skips.strict)
    for rs in sets:
        regions += [dict(r, image=r['image'] + len(images)) for r in rs.regions]
        images += rs.images
        sizes += rs.sizes
        skips.items += rs.skips.items
    return RegionSet(images, sizes, regions, sets[0].classnames, sets[0].templates, sets[0].groups, skips,
                     vocabulary=sets[0].vocabulary)

def region_sets(root: Path, image_root=None, strict: bool = False, vocabulary: str = 'all') -> tuple:
    """`({name: RegionSet}, )`, the set with the most classes first (see above); `MissingData` without instances files;
    `vocabulary`: `load_regions`' ('all' or 'ovcoco')."""
    files = [root] if root.is_file() else sorted((root / 'annotations').glob('instances_*.json'))
    if not files:
        raise MissingData(f'regions: expected COCO-format instance files {root}/annotations/instances_*.json (images '
                          f'in {root}/images or {root}/<split>), or an instances file')
    by_classes = {}
    for f in files:
        rs = load_regions(f, image_root, vocabulary=vocabulary, strict=strict)
        by_classes.setdefault(tuple(rs.classnames), []).append((f.stem.removeprefix('instances_'), rs))
    sets = {'+'.join(n for n, _ in group): merge_region_sets([rs for _, rs in group]) for group in by_classes.values()}
    return (dict(sorted(sets.items(), key=lambda kv: -len(kv[1].classnames))),)

def task_regions(ev: Evaluator, sets: dict, scorer: str | None = None) -> dict:
    """Region classification (`region_task`) of every set: the first set's numbers unprefixed, the others' as
    `name/metric`."""
    out = {}
    for k, (name, rs) in enumerate(sets.items()):
        r = region_task(ev, rs, scorer)
        flat = {**{f'{e}_{m}': v for e in ('pooled', 'crop') for m, v in r[e].items()},
                **{m: v for m, v in r.items() if m in ('n_regions', 'classes', 'vocabulary')
                   or m.startswith('chance_')}}
        out.update({(m if k == 0 else f'{name}/{m}'): v for m, v in flat.items()})
        if k == 0:
            out['set'] = name
    return out

def _region_skips(args: tuple) -> ItemSkips:
    "The skips of every region set of a folder, together."
    out = ItemSkips()
    for rs in args[0].values():
        out.items += rs.skips.items
    return out

register_task(Task('regions', region_sets, task_regions, _region_skips,
                   dict(pooled_top1='region top-1 (pooled)', pooled_ap50='region AP50 (pooled)',
                        pooled_ap50_novel='region AP50 novel (pooled)', chance_ap50_novel='region AP50 novel (chance)',
                        crop_top1='region top-1 (crop)', crop_ap50='region AP50 (crop)'),
                   options=('vocabulary',)))


# %% [markdown]
# **Long-caption retrieval**: retrieval (`task_retrieval`, the same ranks and tie rule) on a folder's
# `retrieval_long.json`, each image with its long description (on the world: `write_world_benchmark`'s long captions of
# the held-out scenes, `61_eval_data`), the question FLAIR, DreamLIP and Long-CLIP train for. Its numbers carry their
# own display names (`long i2t R@1`), so a table shows them beside the short captions' retrieval, never in its place.
# A model whose context is shorter than a caption reads the caption's first tokens, as its tokenizer cuts it.

# %%
#| export
def _long_retrieval_data(root: Path, image_root=None, strict: bool = False) -> tuple:
    if (root / 'retrieval_long.json').is_file():
        return (load_retrieval(root / 'retrieval_long.json', image_root, strict=strict),)
    raise MissingData(f'long_retrieval: expected {root}/retrieval_long.json ([{{"image", "caption": [long '
                      f'captions]}}], images in {root}/images; a world folder has it)')

register_task(Task('long_retrieval', _long_retrieval_data, task_retrieval, _own_skips,
                   {f'{d}_R@{k}': f'long {d} R@{k}' for d in ('i2t', 't2i') for k in (1, 5, 10)}))

# %%
test_eq(list(TASKS)[:5], ['retrieval', 'sugarcrepe', 'zeroshot', 'linear_probe', 'winoground'])
test_eq([t for t, r in TASKS.items() if not r.scored], ['linear_probe'])
test_eq(list(TASKS['retrieval'].headline)[:2], ['i2t_R@1', 'i2t_R@5'])
test_fail(lambda: register_task(Task('retrieval', _retrieval_data, task_zeroshot, _own_skips, {})),
          contains='already registered')


# %% [markdown]
# ## One run: checkpoint x data set x tasks
#
# `load_task_data` finds each task's files under a data root (a `coco_sample` folder, a world folder, a SugarCrepe
# folder, a Winoground folder, a webdataset export) with the task's loader. With `require` (tasks asked for by name) a
# task whose files are absent stops with the `MissingData` message; otherwise (`tasks='all'`) it is skipped and the
# reason is written into the results. With `strict` the readers stop at the first bad item (`BadData`, naming the
# file) instead of skipping and counting it; `skip_report` gives what they dropped, per task, for the result JSON.
# `evaluate` runs the tasks with one scorer; `evaluate_scorers` with each scorer of the checkpoint's method, from the
# same loaded data.

# %%
#| export
def task_record(task: str) -> Task:
    "The registry's record of `task`; a ValueError naming the known tasks for another name."
    if task not in TASKS:
        raise ValueError(f'unknown task {task!r}; known: {tuple(TASKS)}')
    return TASKS[task]

def load_task_data(task: str, root, image_root=None, strict: bool = False, options: dict | None = None) -> tuple:
    """The arguments of task `task`'s runner (after the evaluator) read from `root`; `strict`: a bad item raises
    `BadData`; `options`: keyword options for the loaders, each passed to the tasks that take it (`Task.options`)."""
    t = task_record(task)
    return t.load(Path(root), image_root, strict, **{k: v for k, v in (options or {}).items() if k in t.options})

def item_skips(task: str, args: tuple) -> ItemSkips:
    "The `ItemSkips` of a task's loaded data (`load_task_data`'s answer); empty for clip_benchmark's data sets."
    return task_record(task).skips(args)

def skip_report(found: dict) -> dict:
    "`{task: ItemSkips.report()}` of the tasks whose reader dropped something: the result JSON's `skipped_items`."
    return {t: item_skips(t, a).report() for t, a in found.items() if len(item_skips(t, a))}

def find_data(root, tasks=TASKS, image_root=None, require: bool = True, strict: bool = False,
              options: dict | None = None) -> tuple[dict, dict]:
    """`({task: loaded data}, {task: reason skipped})`; `require`: a task without data raises `MissingData`;
    `strict`: a bad item raises `BadData` (else it is skipped and counted, `skip_report`); `options`: the loaders'
    keyword options (`load_task_data`), e.g. `{'vocabulary': 'ovcoco'}`."""
    found, skipped = {}, {}
    for task in tasks:
        task_record(task)
        try:
            found[task] = load_task_data(task, root, image_root, strict, options)
        except MissingData as e:
            if require:
                raise
            # not logged here: a command line validating its data prints one line, or none
            skipped[task] = str(e)
    return found, skipped

def _run_tasks(ev: Evaluator, data: dict, scorer: str, require: bool = True) -> tuple[dict, dict]:
    "`{task: metrics}` of one scorer on loaded data, and `{task: reason}` of tasks whose data turned out to be missing."
    metrics, skipped = {}, {}
    for task, d in data.items():
        t = task_record(task)
        if not t.scored and scorer != ev.headline:
            continue
        t0 = time.time()
        try:
            metrics[task] = t.run(ev, *d, scorer=scorer) if t.scored else t.run(ev, *d)
        except MissingData as e:           # e.g. a probe without a train split: the zero-shot number still counts
            if require:
                raise
            skipped[task] = str(e)
            continue
        metrics[task]['seconds'] = round(time.time() - t0, 3)
    return metrics, skipped

def evaluate(ev: Evaluator, root, tasks=TASKS, image_root=None, require: bool = True, found: tuple | None = None,
             scorer: str | None = None, strict: bool = False) -> tuple[dict, dict]:
    """`({task: metrics}, {task: reason skipped})` with one scorer (default: the headline); `found`: `find_data`'s
    answer when the caller has it."""
    data, skipped = found or find_data(root, tasks, image_root, require, strict)
    return _run_tasks(ev, data, scorer or ev.headline)[0], skipped

def evaluate_scorers(ev: Evaluator, root, tasks=TASKS, image_root=None, require: bool = True,
                     found: tuple | None = None, strict: bool = False) -> tuple[dict, dict]:
    """`({scorer: {task: metrics}}, {task: reason skipped})` for every scorer of the checkpoint's method, the headline
    first."""
    found = found or find_data(root, tasks, image_root, require, strict)
    return {s: evaluate(ev, root, found=found, scorer=s)[0] for s in ev.scorers}, found[1]


# %% [markdown]
# A randomly initialised `powerclip-micro` through every task on a world benchmark folder. Random embeddings are
# near chance: retrieval near `chance_*`, hard negatives near 50% (a coin flip per pair), zero-shot near the majority
# share, Winoground text/image near 25% and group near 1/6 (Winoground's paper). The second pass is served by the cache.

# %%
from powerclip.eval.data import write_world_benchmark
_scratch = tempfile.TemporaryDirectory(prefix="powerclip-nb-")  # holds every scratch folder below; see the last cell
tmp = Path(tempfile.mkdtemp(dir=_scratch.name))
write_world_benchmark(tmp / 'world', n_images=60)
ev = Evaluator.build('powerclip-micro', None, cache_dir=tmp / 'cache', progress=False)
t0 = time.time()
m1, _ = evaluate(ev, tmp / 'world')
t1 = time.time() - t0
ev2 = Evaluator.build('powerclip-micro', None, cache_dir=tmp / 'cache', progress=False)
t0 = time.time()
m2, _ = evaluate(ev2, tmp / 'world')
t2 = time.time() - t0
strip = lambda m: {t: {k: v for k, v in d.items() if k != 'seconds'} for t, d in m.items()}
test_eq(strip(m1), strip(m2))
test_eq(ev2.cache.misses, 0)
assert ev2.cache.hits > 0
print(f'first run {t1:.1f}s, cached rerun {t2:.1f}s ({ev2.cache.hits} cache hits)')
# regions: the attribute-bound vocabulary (35 classes) first, the shapes (5) beside it, both embeddings
test_eq((m1['regions']['set'], m1['regions']['classes'], m1['regions']['shape/classes']), ('colour_shape', 35, 5))
test_close(m1['regions']['chance_top1'], 100 / 35, eps=1e-9)
assert {'pooled_ap50', 'crop_top1', 'chance_ap50', 'shape/chance_ap50'} <= set(m1['regions'])
test_eq(m1['regions']['vocabulary'], 'all')
# long-caption retrieval: the retrieval runner on the long captions, one per image (a scene whose description an
# earlier one has left out, `61_eval_data`)
_lr = task_retrieval(ev, load_retrieval(tmp / 'world' / 'retrieval_long.json'))
test_eq({k: v for k, v in m1['long_retrieval'].items() if k != 'seconds'}, _lr)
_ls = json.loads((tmp / 'world' / 'summary.json').read_text())['retrieval_long']
test_eq((_lr['n_images'], _lr['n_texts'], _ls['images'] + _ls['skipped_repeated_images']), (_ls['images'],) * 2 + (60,))
test_fail(lambda: find_data(tmp / 'nowhere', ['long_retrieval']), contains='retrieval_long.json')
# the vocabulary option reaches the region reader only: OV-COCO's needs COCO's names, which the world does not have
test_fail(lambda: find_data(tmp / 'world', ['regions'], options=dict(vocabulary='ovcoco')), contains='needs COCO')
test_eq(list(find_data(tmp / 'world', ['retrieval'], options=dict(vocabulary='ovcoco'))[0]), ['retrieval'])
{t: {k: round(v, 1) for k, v in d.items()
     if k in ('i2t_R@1', 't2i_R@1', 'chance_t2i_R@1', 'mean', 'top1', 'chance_top1', 'acc',
                                                    'text', 'image', 'group', 'pooled_top1', 'crop_top1')}
 for t, d in m1.items()}

# %% [markdown]
# A model that gives NaN features (NaN weights put into a loaded model, past the loader's check) cannot produce a
# number: every task stops with `NonFiniteFeatures`, and so does the world evaluation below, which runs them (a
# checkpoint file with such weights is refused earlier, by `load_model`; `tests/test_eval.py` runs both ends).

# %%
from powerclip.eval.models import load_model
_nan = load_model('powerclip-micro')
with torch.no_grad():
    [q.fill_(float('nan')) for q in _nan.model.parameters()]
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
_V = ev.image_features([r[0] for r in _rows])['image']
_P, _N = (ev.text_features([r[k] for r in _rows])['text'] for k in (1, 2))
_acc = [hard_negative_accuracy((_V * _P).sum(1)[a:a + len(rs)], (_V * _N).sum(1)[a:a + len(rs)])['acc']
        for a, rs in zip(np.cumsum([0] + [len(rs) for rs in sc.values()]), sc.values())]
test_close(_acc, [m1['sugarcrepe'][c] for c in sc])
wg, _ = load_winoground(tmp / 'world')
_i0, _i1 = (ev.image_features([r[k] for r in wg])['image'] for k in (0, 1))
_c0, _c1 = (ev.text_features([r[k] for r in wg])['text'] for k in (2, 3))
_s = torch.stack([torch.stack([(_c0 * _i0).sum(1), (_c0 * _i1).sum(1)], 1),
                  torch.stack([(_c1 * _i0).sum(1), (_c1 * _i1).sum(1)], 1)], 1)
test_eq(winoground_scores(_s), {k: v for k, v in m1['winoground'].items() if k not in ('seconds', 'skipped')})

# %% [markdown]
# The same classification images through clip_benchmark's reader (the world set's webdataset export) and through
# ours (`classification.json`) give the same numbers, zero-shot and probe.

# %%
cls = load_classification(tmp / 'world')
wdata = open_wds(tmp / 'world' / 'wds_shape')
_zs_wds, _zs_json = task_zeroshot(ev, wdata), task_zeroshot(ev, cls)
test_eq({k: _zs_wds[k] for k in ('top1', 'mean_per_class_recall', 'n')},
        {k: _zs_json[k] for k in ('top1', 'mean_per_class_recall', 'n')})
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
torch.manual_seed(2)
torch.save(create_model('powerclip-micro')[0].state_dict(), tmp / 'filip' / 'model.pt')
(tmp / 'filip' / 'config.yaml').write_text('model:\n  name: powerclip-micro\n  kwargs: '
                                           '{}\nmethod: filip\nmethod_cfg: {}\n')
fev = Evaluator.of(load_model(checkpoint=tmp / 'filip'), cache_dir=tmp / 'cache', progress=False)
by, _ = evaluate_scorers(fev, tmp / 'world', tasks=('retrieval', 'zeroshot', 'linear_probe'))
test_eq({s: sorted(m) for s, m in by.items()},
        {'late': ['linear_probe', 'retrieval', 'zeroshot'], 'global': ['retrieval', 'zeroshot']})
assert (by['late']['retrieval']['i2t_R@1'] != by['global']['retrieval']['i2t_R@1']
        or by['late']['zeroshot'] != by['global']['zeroshot'])
_x = fev.image_features(cls.splits['test'][0][:3], 'late')
_full = fev.scores(_x,
                   fev.text_features([t.format(c=c) for c in cls.classnames for t in cls.templates], 'late'), 'late')
torch.testing.assert_close(zeroshot_logits(fev, _x, cls.classnames, cls.templates, 'late'),
                           _full.view(3, len(cls.classnames), -1).mean(2))
{s: {t: round(m[t].get('i2t_R@1', m[t].get('top1', m[t].get('acc'))), 1) for t in m} for s, m in by.items()}


# %% [markdown]
# ## Results on disk, and the suite
#
# `write_result` writes one JSON per (checkpoint, data set), `<out>/<label>/<data set>.json` (the data folder's
# name, or a data file's stem: `--data .../instances_val2017.json` writes `instances_val2017.json`, not
# `instances_val2017.json.json`): the headline scorer's metrics (`metrics`), its name (`scorer`) and the other
# scorers' metrics (`other_scorers`), the method, the checkpoint's path, the file its weights were read from
# (`weights`: a folder's `model.pt`, latest `epoch_N.pt`, ..), its sha256 (`random-init` for none) and `checkpoint_id`,
# the model, the data root, the tasks
# skipped for want of data (`skipped`, with the reason), the items the readers dropped (`skipped_items`: per task the
# count per reason and the files, `ItemSkips.report()`), and the exact command. `65_eval_tables` lays them out, one column
# per label.
#
# **Two checkpoints never share a label.** The label defaults to the run's name: the folder's name for a run folder,
# for its `model.pt` and for its `checkpoints/last.pt` (every run exports a `model.pt`, so the file's stem would be
# `model` for all of them), and for an open_clip release's weights; `<run>-epoch_N` for an open_clip run's
# `checkpoints/epoch_N.pt`; else the checkpoint file's stem; `random-init` without a checkpoint. Before writing,
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
    """The run folder's name for a run folder, its `model.pt` or its `checkpoints/last.pt`, and for an open_clip
    release's weights; `<run>-epoch_N` for an open_clip run's `checkpoints/epoch_N.pt`; else the file's stem;
    'random-init' for None."""
    if checkpoint is None:
        return 'random-init'
    p = Path(checkpoint).resolve()
    if p.is_dir():
        return p.name
    if p.name in ('model.pt', *RELEASE_WEIGHTS):
        return p.parent.name
    if p.name == 'last.pt':
        return p.parent.parent.name if p.parent.name == 'checkpoints' else p.parent.name
    if p.stem.startswith('epoch_') and p.parent.name == 'checkpoints':
        return f'{p.parent.parent.name}-{p.stem}'
    return p.stem

def result_label(out_dir, label: str, ckpt_id: str) -> str:
    "`label`, or `label-<sha8>` when results of another checkpoint already hold `out_dir/<label>/` (see above)."
    others = set()
    for f in sorted((Path(out_dir) / label).glob('*.json')):
        try:
            r = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError):
            continue              # not a result of ours
        if isinstance(r, dict) and 'metrics' in r:
            others.add(r.get('checkpoint_id') or r.get('sha256') or f'unknown ({f.name})')
    others.discard(ckpt_id)
    if not others:
        return label
    sha8 = (ckpt_id if not ckpt_id.startswith('random-init') else hashlib.sha256(ckpt_id.encode()).hexdigest())[:8]
    new = f'{label}-{sha8}'
    log.warning('result label %r in %s holds another checkpoint (%s); this one (%s) is written under %r', label,
                out_dir, ', '.join(sorted(o[:16] for o in others)), ckpt_id[:16], new)
    return new

def write_result(out_dir, metrics: dict, skipped: dict, *, model, checkpoint, ckpt_id: str, data_root,
                 name: str | None = None, label: str | None = None, command: str | None = None,
                 method: str | None = None, scorer: str = 'global', other_scorers: dict | None = None,
                 skipped_items: dict | None = None, weights: str | None = None) -> Path:
    """`out_dir/<label>/<name>.json`; label: `label` or `default_label(checkpoint)`, made unique by `result_label`;
    `weights`: the file a checkpoint folder's weights were read from."""
    label = result_label(out_dir, label or default_label(checkpoint), ckpt_id)
    name = name or (Path(data_root).stem if Path(data_root).is_file() else Path(data_root).name)   # x.json: x
    res = dict(checkpoint=None if checkpoint is None else str(checkpoint), weights=weights, label=label,
               sha256='random-init' if checkpoint is None else ckpt_id, checkpoint_id=ckpt_id,
               model=model, method=method,
               dataset=name, data_root=str(data_root), scorer=scorer, metrics=metrics,
               other_scorers=other_scorers or {},
               skipped=skipped, skipped_items=skipped_items or {}, command=command or shlex.join(sys.argv),
               time=time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime()), torch=torch.__version__)
    f = Path(out_dir) / label / f'{name}.json'
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(json.dumps(res, indent=1))
    return f

def write_scored(out_dir, ev: Evaluator, by_scorer: dict, skipped: dict, **kw) -> Path:
    "`write_result` of `evaluate_scorers`' answer: the headline's metrics, the others beside them."
    return write_result(out_dir, by_scorer[ev.headline], skipped, model=ev.spec, ckpt_id=ev.ckpt_id, method=ev.method,
                        scorer=ev.headline, weights=ev.lm.weights,
                        other_scorers={s: m for s, m in by_scorer.items() if s != ev.headline}, **kw)

def run_suite(ev: Evaluator, root, names=('all',), out_dir='results/eval', label: str | None = None, checkpoint=None,
              require: bool = False, command: str | None = None, strict: bool = False) -> tuple[dict, dict]:
    """`({benchmark: result JSON path}, {benchmark: reason skipped})`; `require`: an absent benchmark raises; `strict`:
    a bad item raises."""
    results, skipped = {}, {}
    for name in tqdm(select(names), desc='benchmarks', disable=not ev.progress):
        b = BENCHMARKS[name]
        try:
            data = benchmark_data(name, Path(root) / b.folder, strict)
        except MissingData as e:
            if require:
                raise
            log.warning('%s skipped: %s', name, e)
            skipped[name] = str(e)
            continue
        by, task_skipped = {}, {}
        for s in ev.scorers:
            by[s], sk = _run_tasks(ev, data, s, require)
            task_skipped.update(sk)
            if name in KARPATHY_TEST_IMAGES and 'retrieval' in by[s]:
                ok = by[s]['retrieval']['n_images'] == KARPATHY_TEST_IMAGES[name]
                by[s]['retrieval']['karpathy_size_ok'] = ok
                if not ok and s == ev.headline:
                    log.warning('%s: %d test images, the Karpathy test split has %d', name,
                                by[s]['retrieval']['n_images'], KARPATHY_TEST_IMAGES[name])
        results[name] = (by, task_skipped, skip_report(data))
    written = {name: write_scored(out_dir, ev, by, task_skipped, checkpoint=checkpoint,
                                  data_root=Path(root) / BENCHMARKS[name].folder,
                                  name=BENCHMARKS[name].folder, label=label, command=command, skipped_items=items)
               for name, (by, task_skipped, items) in results.items()}
    return written, skipped


# %%
f1 = write_scored(tmp / 'results', fev, by, {}, checkpoint=tmp / 'filip' / 'model.pt', data_root=tmp / 'world',
                  command='notebook')
r1 = json.loads(f1.read_text())
test_eq((r1['label'], r1['method'], r1['scorer'], list(r1['other_scorers'])), ('filip', 'filip', 'late', ['global']))
test_eq(r1['metrics'], by['late'])
test_eq(r1['sha256'], fev.ckpt_id)

# %% [markdown]
# Labels: a run folder, its `model.pt` and its `checkpoints/last.pt` are all the run's name. Another checkpoint under
# the same label goes to `<label>-<sha8>`; the first one evaluated again keeps its label and replaces its result.

# %%
test_eq([default_label(x) for x in (tmp / 'filip', tmp / 'filip' / 'model.pt', tmp / 'r7' / 'checkpoints' / 'last.pt',
                                    tmp / 'ck' / 'step_100.pt', None, tmp / 'hub' / 'open_clip_model.safetensors',
                                    tmp / 'logs' / 'r2' / 'checkpoints' / 'epoch_32.pt')],
        ['filip', 'filip', 'r7', 'step_100', 'random-init', 'hub', 'r2-epoch_32'])
_other = dict(model=fev.spec, data_root=tmp / 'world', command='notebook')
f2 = write_result(tmp / 'results', {}, {}, checkpoint=tmp / 'x' / 'filip' / 'model.pt', ckpt_id='ab' * 32, **_other)
test_eq(f2.parent.name, 'filip-abababab')
test_eq(write_scored(tmp / 'results', fev, by, {}, checkpoint=tmp / 'filip' / 'model.pt', data_root=tmp / 'world',
                     command='notebook'), f1)
test_eq(write_result(tmp / 'results', {}, {}, checkpoint=None, ckpt_id='random-init-powerclip-micro-seed1',
                     **_other).parent.name, 'random-init')
_f3 = write_result(tmp / 'results', {}, {}, checkpoint=None, ckpt_id='random-init-powerclip-micro-seed2', **_other)
test_eq(_f3.parent.name, 'random-init-' + hashlib.sha256(b'random-init-powerclip-micro-seed2').hexdigest()[:8])
(tmp / 'instances_val2017.json').write_text('{}')                              # a data file: its stem
test_eq(write_result(tmp / 'results', {}, {}, checkpoint=None, ckpt_id='random-init-powerclip-micro-seed1',
                     **dict(_other, data_root=tmp / 'instances_val2017.json')).name, 'instances_val2017.json')

# %% [markdown]
# Every scratch folder made above lives under one temporary folder, removed here, so running the notebook
# leaves nothing behind (a training run's checkpoints take hundreds of MB).

# %%
_scratch.cleanup()
