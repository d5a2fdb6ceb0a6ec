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
#| default_exp eval.world_scores

# %%
#| export
from __future__ import annotations

import json
import math
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from powerclip.eval.metrics import outranks, recall_hits
from powerclip.eval.models import Evaluator, load_model
from powerclip.eval.tasks import TASKS, evaluate, find_data, unique_index
from powerclip.heatmaps import grounding_score, model_heat_fn
from powerclip.trainlog import read_record
from powerclip.world import NEGATIVE_KINDS, WorldConfig

# %%
#| hide
from fastcore.test import test_close, test_eq
from powerclip.config import load_config
from powerclip.data import world_config
from powerclip.eval.data import load_retrieval, write_world_benchmark
from powerclip.model import create_model, model_geometry

# %% [markdown]
# # Scores on the world
#
# > A run's numbers on the world's held-out scenes, as the comparison reports them.
#
# Hard negatives and retrieval from the evaluation's tasks, the pointing game from the heatmaps, each scene's share of
# every headline number (the bootstrap over scenes), cached beside the weights.

# %% [markdown]
# The comparison (`70_compare`) and the experiments (`71_experiments`) score every run on the same held-out world
# folder (`write_world_benchmark`, `61_eval_data`). This notebook is that score, built on the one implementation of
# each part: the hard-negative and retrieval tasks of the task registry (`64_eval_tasks`), their ranks under the one
# tie rule (`60_eval_metrics`: `retrieval_ranks` under both `retrieval_recall` and the per-item `recall_hits`), and the
# pointing game of `67_heatmaps` (`grounding_score`, which also gives each scene's share).
#
# **The headline numbers.** `WORLD_TASKS` names the tasks the world evaluation runs and the key each of their metrics
# gets in its answer; `HEADLINE` is the comparison's headline, in the order of its tables, with the display names the
# task registry gives them (and the pointing game's). The comparison's tables, its statistics, its sweeps and its
# curves read them from here.

# %%
#| export
# the world evaluation's tasks, in the order of its answer: each task's metric -> its key in the answer
WORLD_TASKS = {'sugarcrepe': {**{k: f'hn_{k}' for k in NEGATIVE_KINDS}, 'mean': 'hn_mean'},
               'retrieval': {k: k for k in ('i2t_R@1', 'i2t_R@5', 't2i_R@1', 't2i_R@5')}}
# the comparison's headline numbers scored on the benchmark folder: key -> display name (the task registry's)
FOLDER_HEADLINE = {WORLD_TASKS[t][m]: TASKS[t].headline[m]
                   for t, m in (('sugarcrepe', 'mean'), ('retrieval', 'i2t_R@1'),
                                                                       ('retrieval', 't2i_R@1'))}
POINTING = {'pointing': 'pointing'}        # the pointing game's headline number (`grounding_score`)
# the region task on the folder's objects (`63a_eval_regions`): its own evaluation, cached apart (see "Regions" below)
REGION_TASKS = {'regions': {'pooled_top1': 'region_acc', 'pooled_ap50': 'region_ap50', 'crop_top1': 'region_crop_acc',
                            'crop_ap50': 'region_crop_ap50', 'shape/pooled_top1': 'region_shape_acc'}}
REGION_HEADLINE = {'region_acc': TASKS['regions'].headline['pooled_top1']}
# key -> display name: paired differences, verdicts, in order
HEADLINE = {**FOLDER_HEADLINE, **POINTING, **REGION_HEADLINE}
# long-caption retrieval (`64_eval_tasks`) on the folder's long captions: cached apart, as the regions; reported beside
# the headline, never in its Holm family (see "Long captions" below)
LONG_TASKS = {'long_retrieval': {k: f'long_{k}' for k in ('i2t_R@1', 'i2t_R@5', 't2i_R@1', 't2i_R@5')}}
LONG_HEADLINE = {f'long_{m}': TASKS['long_retrieval'].headline[m] for m in ('i2t_R@1', 't2i_R@1')}

# %%
test_eq(HEADLINE, {'hn_mean': 'HN mean', 'i2t_R@1': 'i2t R@1', 't2i_R@1': 't2i R@1', 'pointing': 'pointing',
                   'region_acc': 'region top-1 (pooled)'})
test_eq(LONG_HEADLINE, {'long_i2t_R@1': 'long i2t R@1', 'long_t2i_R@1': 'long t2i R@1'})


# %% [markdown]
# ## The world evaluation
#
# `evaluate_world` is what the comparison (`70_compare`) reports for each run on its held-out world folder
# (`write_world_benchmark`): the hard-negative accuracy per kind (`hn_<kind>`, NaN when the folder has no item of that
# kind) and their mean (`hn_mean`), and retrieval R@1 and R@5 both ways, all in percent. The headline scorer's numbers
# carry these keys and `scorer` names it; the other scorers' numbers carry the same keys prefixed `<scorer>:`.
#
# Captions go through the model's tokenizer. On the world's captions that gives exactly the ids of the gold-tree
# tokens a run trains on (`tokens.tree_tokens`), checked below on every caption and negative of the folder, so the
# evaluation reads captions as training does.
#
# **Per item.** With `per_item=True` the result also holds, under `items`, each scorer's answer item by item: for every
# hard negative, every image (image to text) and every caption (text to image), the scene it belongs to (its image file)
# and a hit (1) or a miss (0) under the same tie rule; the mean of the hits is the number above (per kind, R@1). The
# comparison's bootstrap over held-out scenes (`69_stats`) resamples them. An evaluator with a feature cache computes
# the features once for both.

# %%
#| export
def world_items(ev: Evaluator, found: dict, scorer: str | None = None) -> dict:
    """`evaluate_world`'s answers item by item (see above), from `find_data`'s loaded `found`:
    `{'hn': {kind: {'image': [file name], 'hit': [0/1]}}, 'i2t_R@1': {...}, 't2i_R@1': {...}}`."""
    sc, ret = found['sugarcrepe'][0], found['retrieval'][0]
    rows = [r for rs in sc.values() for r in rs]
    images, vi = unique_index([r[0] for r in rows])
    texts, ti = unique_index([t for r in rows for t in r[1:]])
    V, T = ev.image_features(images, scorer), ev.text_features(texts, scorer)
    img = [vi[r[0]] for r in rows]
    pos = ev.pair_scores(V, T, img, [ti[r[1]] for r in rows], scorer)                          # (n,)
    neg = ev.pair_scores(V, T, img, [ti[r[2]] for r in rows], scorer)
    hit, out, start = (~outranks(neg, pos)).int().tolist(), {'hn': {}}, 0
    for c, rs in sc.items():
        out['hn'][c] = dict(image=[Path(r[0]).name for r in rs], hit=hit[start:start + len(rs)])
        start += len(rs)
    captions, text_image = ret.flat()
    i2t, t2i = recall_hits(ev.scores(ev.image_features(ret.images, scorer), ev.text_features(captions, scorer),
                                     scorer), text_image)
    has = torch.zeros(len(ret.images), dtype=torch.bool)
    has[torch.as_tensor(text_image, dtype=torch.long)] = True
    names = [Path(p).name for p in ret.images]
    out['i2t_R@1'] = dict(image=[n for n, h in zip(names, has.tolist()) if h], hit=i2t[has].int().tolist())
    out['t2i_R@1'] = dict(image=[names[i] for i in torch.as_tensor(text_image).tolist()], hit=t2i.int().tolist())
    return out

def evaluate_world(ev: Evaluator, root, per_item: bool = False, tasks: dict = WORLD_TASKS) -> dict:
    """The comparison's numbers (%) on a world benchmark folder, for every scorer: `tasks` {task: {metric: key}}, by
    default `hn_<kind>`, `hn_mean`, R@1/R@5 both ways; `per_item`: also `items` (see above)."""
    found = find_data(root, tuple(tasks))
    out = dict(scorer=ev.headline)
    for s in ev.scorers:
        m, _ = evaluate(ev, root, found=found, scorer=s)
        res = {key: m[t].get(k, math.nan) for t, keys in tasks.items() for k, key in keys.items()}
        out.update({(k if s == ev.headline else f'{s}:{k}'): v for k, v in res.items()})
    if per_item:
        out['items'] = {s: world_items(ev, found[0], s) for s in ev.scorers}
    return out


# %% [markdown]
# A random `powerclip-micro` and a FILIP run folder (two scorers: late interaction, then the global cosine) on a small
# world folder: the answers carry every scorer's numbers, their items' means are the numbers, and the captions are
# tokenised as training tokenises them.

# %%
from powerclip.parsing import ParsedCaption
from powerclip.tokens import tree_tokens
_scratch = tempfile.TemporaryDirectory(prefix="powerclip-nb-")  # holds every scratch folder below; see the last cell
tmp = Path(tempfile.mkdtemp(dir=_scratch.name))
write_world_benchmark(tmp / 'world', n_images=60)
ev = Evaluator.build('powerclip-micro', None, cache_dir=tmp / 'cache', progress=False)
m1, _ = evaluate(ev, tmp / 'world', tasks=tuple(WORLD_TASKS))
(tmp / 'filip').mkdir()
torch.manual_seed(2)
torch.save(create_model('powerclip-micro')[0].state_dict(), tmp / 'filip' / 'model.pt')
(tmp / 'filip' / 'config.yaml').write_text('model:\n  name: powerclip-micro\n  kwargs: '
                                           '{}\nmethod: filip\nmethod_cfg: {}\n')
fev = Evaluator.of(load_model(checkpoint=tmp / 'filip'), cache_dir=tmp / 'cache', progress=False)
_parses = json.loads((tmp / 'world' / 'parses.json').read_text())
_tok = torch.stack([tree_tokens(ParsedCaption.from_dict(p), context_length=ev.model.context_length).tokens
                    for p in _parses.values()])
test_eq(ev.tokenizer(list(_parses)), _tok)
res = evaluate_world(ev, tmp / 'world')
test_eq(res['scorer'], 'global')
assert set(res) >= {'hn_swap_att', 'hn_mean', 'i2t_R@1', 't2i_R@5'}
assert all(0 <= v <= 100 for v in res.values() if isinstance(v, float) and v == v)
test_eq(res['hn_mean'], m1['sugarcrepe']['mean'])
test_eq(res['i2t_R@5'], m1['retrieval']['i2t_R@5'])
fres = evaluate_world(fev, tmp / 'world', per_item=True)
test_eq(fres['scorer'], 'late')
assert 'global:hn_mean' in fres and 'late:hn_mean' not in fres
for _s, _pre in (('late', ''), ('global', 'global:')):             # the items' means are the numbers, for each scorer
    _it = fres['items'][_s]
    test_close([100 * np.mean(_it['hn'][k]['hit']) for k in _it['hn']], [fres[f'{_pre}hn_{k}'] for k in _it['hn']])
    test_close(np.mean([100 * np.mean(_it['hn'][k]['hit']) for k in _it['hn']]), fres[f'{_pre}hn_mean'])
    test_close([100 * np.mean(_it[k]['hit']) for k in ('i2t_R@1', 't2i_R@1')],
               [fres[f'{_pre}i2t_R@1'], fres[f'{_pre}t2i_R@1']])
test_eq(len(fres['items']['late']['t2i_R@1']['image']), len(load_retrieval(tmp / 'world' / 'retrieval.json').flat()[0]))
{k: round(v, 1) for k, v in res.items() if k != 'scorer'}


# %% [markdown]
# ## Evaluation, per scene
#
# A folder with a `model.pt` (a run, or one of its snapshots) is scored on the held-out test scenes by the evaluation
# package (`evaluate_world`, every scorer of its method, the headline first) and, when asked, by the pointing game of
# `67_heatmaps` on the first scenes of the test split. Both also give each scene's share of the headline numbers, for
# the bootstrap: `scene_shares` weights each item as its number does (a hard negative by one over its kind's count and
# the number of kinds; an image or caption by one over their count) and `grounding_score(per_scene=True)` each phrase
# by one over the phrases; scaled by the number of scenes, the mean of the shares is the number. The result is cached beside the
# weights (`eval.json`, or `eval_val.json` on the validation split) and reused while the weights and the evaluation's
# settings are those it describes.
#
# **Regions.** The region task (`REGION_TASKS`: region top-1 and AP50 of the pooled and the cropped embeddings on the
# attribute-bound vocabulary, and the pooled top-1 on the shapes alone) is scored on the same folder's objects and
# cached in a file of its own beside the weights (`eval_regions.json`, `eval_val_regions.json`): it came after the
# other numbers, and a cache of its own lets every run scored before it keep its numbers while it adds this one. It has
# no per-scene shares (the bootstrap leaves it out; its verdict, like every verdict, reads the seeds).
#
# **Long captions.** Long-caption retrieval (`LONG_TASKS`: R@1 and R@5 both ways on the folder's `retrieval_long.json`,
# each held-out scene with its long description, `61_eval_data`) is scored on every folder that has them, every scorer,
# and cached in a file of its own for the same reason (`eval_long.json`, `eval_val_long.json`). Its R@1 numbers
# (`LONG_HEADLINE`) are reported beside the headline (the long-caption table of `71a_plateau`), with their own paired
# intervals; the headline's Holm family stays its five numbers, so no earlier verdict changes. In a long-caption world
# the five are scored on the same items as in the short one (the folder's hard negatives and retrieval captions, and
# the pointing game on the short captions' noun phrases of the same scenes), so a "(long)" row reads like any other.

# %%
#| export
def scene_names(root) -> list[str]:
    "The held-out scenes of a world benchmark folder: its image files, in order."
    return sorted(p.name for p in (Path(root) / "images").glob("*.png"))


def scene_shares(items: dict, scenes: list[str]) -> dict[str, list[float]]:
    """Each scene's share (%) of `hn_mean`, `i2t_R@1`, `t2i_R@1` from `world_items`' answers; the mean over `scenes` is
    the number."""
    at, N = {s: i for i, s in enumerate(scenes)}, len(scenes)
    def shares(pairs) -> list[float]:
        c = np.zeros(N)
        for scene, v in pairs:
            c[at[scene]] += v
        return (100 * N * c).tolist()
    hn = {k: v for k, v in items["hn"].items() if v["hit"]}
    out = {"hn_mean": shares((im, h / (len(hn) * len(v["hit"]))) for v in hn.values()
                             for im, h in zip(v["image"], v["hit"]))}
    for m in ("i2t_R@1", "t2i_R@1"):              # world_items' retrieval items
        out[m] = shares((im, h / len(items[m]["hit"])) for im, h in zip(items[m]["image"], items[m]["hit"]))
    return out


def evaluate_folder(folder, root, world: WorldConfig, grounding: int = 0, device: str = "cpu", cache: str = "eval.json",
                    lm=None) -> dict:
    """The numbers (%) of the weights in `folder` on the benchmark folder `root` (every scorer; `scorer` names the
    headline), `per_scene` shares of the headline numbers, and with `grounding` the pointing game on that many scenes;
    cached in `folder/cache`. `lm`: a loaded model instead of `folder/model.pt` (the untrained row; `folder` holds its
    cache)."""
    folder, root = Path(folder), Path(root)
    stamp = None if lm is not None else (folder / "model.pt").stat().st_mtime_ns
    key = dict(root=str(root.resolve()), summary=json.loads((root / "summary.json").read_text()).get("request"),
               grounding=grounding, split=json.loads((root / "summary.json").read_text()).get("split"), eval=3,
               model=getattr(lm, "ckpt_id", None))
    f = folder / cache
    if f.is_file():
        c = read_record(f) or {}          # a damaged cache: one line, and evaluated again
        if c.get("key") == key and c.get("weights_mtime_ns") == stamp:
            return {**c["results"], **_region_numbers(folder, root, key, stamp, cache, lm, device),
                    **_long_numbers(folder, root, key, stamp, cache, lm, device)}
    t0 = time.time()
    lm = lm or load_model(checkpoint=folder, device=device)
    with tempfile.TemporaryDirectory() as d:         # features computed once for the numbers and the items
        res = evaluate_world(Evaluator.of(lm, cache_dir=d, progress=False, batch_size=128), root, per_item=True)
    res["per_scene"] = scene_shares(res.pop("items")[res["scorer"]], scene_names(root))
    if grounding:
        cpu = lm if device == "cpu" else load_model(checkpoint=folder)              # the heat maps run on the CPU
        # the headline scorer's own map where it draws one (FLAIR's attention), else the cosine map (`67_heatmaps`)
        heat = model_heat_fn(cpu.model, cpu.tokenizer, next(iter(cpu.scorers.values()), None))
        # the short captions' noun phrases in a long-caption world too: the pointing game of every table (see above)
        g = grounding_score(heat, grounding, replace(world, caption="short"), per_scene=True)
        res["per_scene"]["pointing"] = g["per_scene"]
        res.update({k: g[k] for k in ("pointing", "mean_iou", "n_phrases")})   # the comparison's (eval=3) numbers
    res["eval_s"] = time.time() - t0
    folder.mkdir(parents=True, exist_ok=True)
    tmp = f.with_suffix(".tmp")
    tmp.write_text(json.dumps(dict(key=key, weights_mtime_ns=stamp, results=res)))
    tmp.replace(f)
    return {**res, **_region_numbers(folder, root, key, stamp, cache, lm, device),
            **_long_numbers(folder, root, key, stamp, cache, lm, device)}


def _region_numbers(folder: Path, root: Path, key: dict, stamp, cache: str, lm, device: str) -> dict:
    "The region task's numbers of the weights in `folder` (every scorer), cached in `folder/<cache stem>_regions.json`."
    if not any((root / 'annotations').glob('instances_*.json')):
        return {}     # a folder without objects to name
    return _apart(folder, root, dict(key, eval=None, regions=1), stamp, cache, lm, device, REGION_TASKS, "regions")


def _long_numbers(folder: Path, root: Path, key: dict, stamp, cache: str, lm, device: str) -> dict:
    "Long-caption retrieval of the weights in `folder` (every scorer), cached in `folder/<cache stem>_long.json`."
    if not (root / 'retrieval_long.json').is_file():
        return {}     # a folder from before the long captions
    # long=2: scored on the folder's long captions without repeated texts (`61_eval_data`); a cache of long=1 (every
    # scene, repeated descriptions tied) is scored again
    return _apart(folder, root, dict(key, eval=None, long=2), stamp, cache, lm, device, LONG_TASKS, "long")


def _apart(folder: Path, root: Path, key: dict, stamp, cache: str, lm, device: str, tasks: dict, name: str) -> dict:
    "`tasks`' numbers of the weights in `folder` (every scorer), cached apart in `folder/<cache stem>_<name>.json`."
    f = folder / f"{Path(cache).stem}_{name}.json"
    if f.is_file():
        c = read_record(f) or {}
        if c.get("key") == key and c.get("weights_mtime_ns") == stamp:
            return c["results"]
    t0 = time.time()
    lm = lm or load_model(checkpoint=folder, device=device)
    with tempfile.TemporaryDirectory() as d:
        res = evaluate_world(Evaluator.of(lm, cache_dir=d, progress=False, batch_size=128), root, tasks=tasks)
    res = {k: v for k, v in res.items() if k != "scorer"}
    res[f"{name.removesuffix('s')}_eval_s"] = time.time() - t0
    tmp = f.with_suffix(".tmp")
    tmp.write_text(json.dumps(dict(key=key, weights_mtime_ns=stamp, results=res)))
    tmp.replace(f)
    return res


# %% [markdown]
# The shares on a random micro model: their means are the evaluation package's numbers, and the pointing numbers are
# `grounding_score`'s.

# %%
_tmp = tmp
_lm = load_model("powerclip-micro", seed=3)
_wcfg = world_config(load_config("smoke").data, model_geometry("powerclip-micro"))
write_world_benchmark(_tmp / "wt", 40, _wcfg, split="test", extras=False)
_r = evaluate_folder(_tmp / "untrained", _tmp / "wt", _wcfg, grounding=6, lm=_lm)
for _k in ("hn_mean", "i2t_R@1", "t2i_R@1", "pointing"):
    test_close(np.mean(_r["per_scene"][_k]), _r[_k], eps=1e-9)
test_eq(len(_r["per_scene"]["hn_mean"]), 40)
test_eq(len(_r["per_scene"]["pointing"]), 6)
_g = grounding_score(model_heat_fn(_lm.model, _lm.tokenizer), 6, _wcfg)
test_close((_r["pointing"], _r["mean_iou"], _r["n_phrases"]),
           (_g["pointing"], _g["mean_iou"], _g["n_phrases"]), eps=1e-9)
# read back from the caches
assert _r == evaluate_folder(_tmp / "untrained", _tmp / "wt", _wcfg, grounding=6, lm=_lm)
_cached = {**json.loads((_tmp / "untrained" / "eval.json").read_text())["results"],
           **json.loads((_tmp / "untrained" / "eval_regions.json").read_text())["results"],
           **json.loads((_tmp / "untrained" / "eval_long.json").read_text())["results"]}
test_eq(_cached, _r)
assert 0 <= _r["region_acc"] <= 100 and {"region_ap50", "region_crop_acc", "region_shape_acc"} <= set(_r)
# long-caption retrieval, cached apart: the evaluation package's numbers on the long captions
_lm_ev = Evaluator.of(_lm, cache_dir=_tmp / "lcache", progress=False)
# a long-caption world: the five numbers on the same items as the short world's (pointing on the short phrases)
_lw = replace(_wcfg, caption="long")
write_world_benchmark(_tmp / "wtl", 40, _lw, split="test", extras=False)
_rl = evaluate_folder(_tmp / "untrained_long", _tmp / "wtl", _lw, grounding=6, lm=_lm)
test_close([_rl[k] for k in (*HEADLINE, *LONG_HEADLINE)], [_r[k] for k in (*HEADLINE, *LONG_HEADLINE)], eps=1e-9)
_lres = evaluate(_lm_ev, _tmp / "wt", tasks=("long_retrieval",))[0]["long_retrieval"]
test_eq({k: _r[f"long_{k}"] for k in ("i2t_R@1", "t2i_R@5")}, {k: _lres[k] for k in ("i2t_R@1", "t2i_R@5")})
# a long cache from before repeated descriptions were left out (key long=1) is scored again, not read
_lc = _tmp / "untrained" / "eval_long.json"
_old = json.loads(_lc.read_text())
_lc.write_text(json.dumps({**_old, "key": {**_old["key"], "long": 1}, "results": {"long_i2t_R@1": -1.0}}))
test_eq(evaluate_folder(_tmp / "untrained", _tmp / "wt", _wcfg, grounding=6, lm=_lm)["long_i2t_R@1"],
        _r["long_i2t_R@1"])
test_eq(json.loads(_lc.read_text())["key"]["long"], 2)

# %% [markdown]
# Every scratch folder made above lives under one temporary folder, removed here, so running the notebook
# leaves nothing behind (a training run's checkpoints take hundreds of MB).

# %%
_scratch.cleanup()
