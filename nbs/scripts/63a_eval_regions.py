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
#| default_exp eval.regions

# %%
#| export
from __future__ import annotations

import numpy as np
import torch
from tqdm import tqdm

from powerclip.eval.items import read_image
from powerclip.eval.metrics import chance_average_precision, region_classification_metrics
from powerclip.eval.models import Evaluator
from powerclip.eval.region_data import RegionSet
from powerclip.model import grid_size
from powerclip.regions import GridConfig, coco_mask, masks_to_patch_grid

# %%
#| hide
import json
import tempfile
from pathlib import Path

from fastcore.test import test_close, test_eq
from PIL import Image


# %% [markdown]
# # Region classification
#
# > Given a region of an image, does the model name what is in it?
#
# Every ground-truth region is embedded two ways, pooled from the patch embeddings inside it and cropped as an image of
# its own, and classified against the text embeddings of every class name: the proxy for the paper's region claim (Table
# 15, OV-COCO) that needs no detector.

# %% [markdown]
# PowerCLIP exists to align image regions with phrases, and its paper backs that with Table 15: a detector built on
# PowerCLIP beats one built on CLIP on OV-COCO (+7.2 AP50, +13.9 AP50 on the novel classes). Training a detector is
# out of reach here, so this task asks the question underneath, the way RegionCLIP and CLIM evaluate region
# representations without one: **given a ground-truth region, does the model name what is in it?**
#
# For each region $r$ of an image (an object's mask and box, from a COCO-format instances file,
# `61a_eval_region_data`):
#
# - **pooled**: $\hat v_r=\mathrm{normalise}\big(\frac1{|m_r|}\sum_{n\in m_r} v_n\big)$, the mean of the projected
#   patch embeddings inside the region's patch mask $m_r$, from one forward pass of the whole image: PowerCLIP's region
#   embedding (Eq. 2), the representation its triplet term trains. The pixel mask becomes a patch mask by the rule of
#   `21_regions` (a patch belongs to the region when the region covers at least half of it, and a region that covers no
#   patch that much keeps its best-covered one); a region the model never sees (outside the centred square its
#   preprocessing crops) is skipped and counted (`outside_view`). A method whose paper pools a region otherwise says so
#   in its scorer (`Scorer.region_features`, `40_methods`). The heat maps of `67_heatmaps` read the same embedding with
#   each patch a region of its own, so a map and a region score are one computation at two sizes of region.
# - **crop**: the region's box, grown to a square around its centre (so that the model's preprocessing, which resizes
#   the short side and crops the centre, neither squashes nor cuts it; pixels beyond the image are black), encoded as an
#   image: what a user of plain CLIP does with a box.
#
# Each class $k$ gets the text embedding $\hat t_k$: the class name in every prompt template, each encoded and
# normalised, their mean normalised again (CLIP's zero-shot classifier). The logits are $\ell_{rk}=s\,\hat v_r\cdot\hat
# t_k$ with the model's own logit scale $s$, and `region_classification_metrics` (`60_eval_metrics`) turns them into
# top-1 accuracy, mean per-class recall and AP50 with ground-truth boxes (defined there, with how it relates to a
# detector's AP50), over all classes and over OV-COCO's base and novel classes when the set has them.
#
# **Chance, per group.** A model that knows nothing ranks classes at random: top-1 accuracy and mean per-class recall
# $100/K$, for every group too (a novel region still chooses among all $K$ classes of the vocabulary). Its AP for a
# class depends only on how many of the $R$ scored regions the class has ($E[\mathrm{AP}(P_k, R)]$,
# `chance_average_precision` in `60_eval_metrics`), so chance AP50 is the mean of that expectation over the classes
# with regions, and over the base and the novel classes apart: `chance_ap50`, `chance_ap50_base`, `chance_ap50_novel`,
# `chance_top1_{group}`, computed from the labels of the regions the model sees (the same regions the metrics average
# over), not from a model's scores. Novel AP50 is a headline number, and the novel classes are fewer and rarer, so
# their chance level is not the overall one. Every result carries them, and the comparison has its untrained row too.

# %% [markdown]
# ## Regions to patch masks and crops

# %%
#| export
def region_patch_masks(rs: RegionSet, rows: list[int], grid: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The patch masks `(R, N)` bool of regions `rows` of one image of `rs`, on the model's `grid` (gh, gw) over the
    centred square the preprocessing keeps, and which of them the model sees at all `(R,)` bool."""
    i = rs.regions[rows[0]]['image']
    W, H = rs.sizes[i]
    pix = np.stack([coco_mask(rs.regions[j]['segmentation'], H, W) for j in rows])          # (R, H, W)
    gm = masks_to_patch_grid(pix, GridConfig(grid_h=grid[0], grid_w=grid[1]))
    masks = torch.zeros(len(rows), grid[0] * grid[1], dtype=torch.bool)
    masks[gm.source] = gm.masks
    return masks, masks.any(1)

def square_box(box: tuple, min_side: float = 1.0) -> tuple[int, int, int, int]:
    "A box `(x0, y0, x1, y1)` grown to the square of its longer side around its centre, in whole pixels."
    x0, y0, x1, y1 = box
    side = max(x1 - x0, y1 - y0, min_side)
    cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
    left, top = round(cx - side / 2), round(cy - side / 2)
    return left, top, left + round(side), top + round(side)


# %% [markdown]
# A square polygon in a 40 x 30 image on a 2 x 2 grid over the centred 30 x 30 square (columns 5..35): the region
# covering the top-left patch fully is that patch; a region left of the square is not seen; the crop box of a wide box
# is the square around its centre.

# %%
_rs = RegionSet(images=[Path('x.png')], sizes=[(40, 30)], regions=[
    dict(image=0, box=(5, 0, 20, 15), segmentation=[[5, 0, 20, 0, 20, 15, 5, 15]], label=0, id=1),
    dict(image=0, box=(0, 0, 4, 4), segmentation=[[0, 0, 4, 0, 4, 4, 0, 4]], label=1, id=2)],
    classnames=['a', 'b'], templates=['{c}'], groups={}, skips=None)
_m, _seen = region_patch_masks(_rs, [0, 1], (2, 2))
test_eq(_m.tolist(), [[True, False, False, False], [False] * 4])
test_eq(_seen.tolist(), [True, False])
test_eq(square_box((10, 20, 30, 24)), (10, 12, 30, 32))
test_eq(square_box((3, 3, 3.2, 3.1)), (3, 3, 4, 4))


# %% [markdown]
# ## The task

# %%
#| export
def class_embeddings(ev: Evaluator, classnames: list, templates: list, scorer: str | None = None) -> torch.Tensor:
    "`(K, D)`: each class name in every template, embedded by the scorer (`class_features`), averaged, normalised."
    s, T = ev.scorer(scorer), len(templates)
    prompts = [t.format(c=c) for c in classnames for t in templates]
    def compute():
        out = []
        for i in range(0, len(prompts), ev.batch_size):
            tok = ev.tokenizer(prompts[i:i + ev.batch_size]).to(ev.device)
            with torch.no_grad(), ev._autocast():
                out.append(s.class_features(ev.model, tok).float().cpu())
        return {'text': torch.cat(out)}
    t = ev._finite(ev.cache.get(ev._name('cls', scorer), prompts, compute), 'class prompt features', scorer)['text']
    return torch.nn.functional.normalize(t.view(len(classnames), T, -1).mean(1), dim=-1)   # (K, D)

def region_embeddings(ev: Evaluator, rs: RegionSet, scorer: str | None = None) -> dict:
    """`pooled` and `crop` `(R', D)` embeddings of the regions the model sees, `rows` `(R',)` their indices in
    `rs.regions`; the regions it does not see go into `rs.skips` (`outside_view`)."""
    s, grid = ev.scorer(scorer), grid_size(ev.model)
    by_image = {}
    for j, r in enumerate(rs.regions):
        by_image.setdefault(r['image'], []).append(j)
    def compute():
        pooled, crop, rows, unseen = [], [], [], []
        for i, js in tqdm(by_image.items(), desc='regions', disable=not ev.progress, leave=False):
            masks, seen = region_patch_masks(rs, js, grid)
            unseen += [j for j, ok in zip(js, seen.tolist()) if not ok]
            js, masks = [j for j, ok in zip(js, seen.tolist()) if ok], masks[seen]
            if not js:
                continue
            img = read_image(rs.images[i])
            x = ev.preprocess(img)[None].to(ev.device)                                     # (1, 3, S, S)
            crops = torch.stack([ev.preprocess(img.crop(square_box(rs.regions[j]['box']))) for j in js]).to(ev.device)
            with torch.no_grad(), ev._autocast():
                pooled.append(s.region_features(ev.model, x, masks[None].to(ev.device))[0].float().cpu())   # (R_i, D)
                crop.append(s.crop_features(ev.model, crops).float().cpu())                                  # (R_i, D)
            rows += js
        empty = torch.zeros(0, 0)
        return dict(pooled=torch.cat(pooled) if pooled else empty, crop=torch.cat(crop) if crop else empty,
                    rows=torch.tensor(rows, dtype=torch.long), unseen=torch.tensor(unseen, dtype=torch.long))
    key = [*rs.images, *[(r['image'], r['id'], list(r['box'])) for r in rs.regions]]
    f = ev.cache.get(ev._name('regions', scorer), key, compute)
    for j in f['unseen'].tolist():            # counted once, however many scorers read the set
        if rs.regions[j]['id'] in rs.unseen:
            continue
        rs.unseen.add(rs.regions[j]['id'])
        rs.skips.add('outside_view', rs.images[rs.regions[j]['image']],
                     f"region {rs.regions[j]['id']} outside the centred square")
    return ev._finite({k: v for k, v in f.items() if k != 'unseen'}, 'region features', scorer)

def region_chance(labels: torch.Tensor, K: int, groups: dict | None = None) -> dict:
    """For regions with these `labels` `(R,)` among `K` classes: `chance_top1`, `chance_ap50` and, per group of
    `groups` ({name: class indices}), `chance_top1_{name}`, `chance_ap50_{name}` (NaN for a group without regions);
    the expected numbers of a uniform random scorer (see above), in percent."""
    counts = torch.bincount(torch.as_tensor(labels, dtype=torch.long), minlength=K).tolist()
    present = [k for k in range(K) if counts[k]]
    ap = dict(zip(present, chance_average_precision([counts[k] for k in present], len(labels))))   # {class: E[AP]}
    def mean(classes) -> float:
        aps = [ap[int(k)] for k in classes if int(k) in ap]
        return float(np.mean(aps)) if aps else float('nan')
    out = dict(chance_top1=100 / K, chance_ap50=mean(present))
    for g, classes in (groups or {}).items():
        out[f'chance_top1_{g}'] = 100 / K
        out[f'chance_ap50_{g}'] = mean(classes)
    return out

def region_task(ev: Evaluator, rs: RegionSet, scorer: str | None = None) -> dict:
    """Region classification of `rs` with one scorer: `{pooled: metrics, crop: metrics}`
    (`region_classification_metrics`, without the per-class APs), `n_regions` scored, `classes`, `vocabulary`, and the
    chance numbers (`region_chance`, per group)."""
    cls = class_embeddings(ev, rs.classnames, rs.templates, scorer)                        # (K, D)
    f = region_embeddings(ev, rs, scorer)
    if len(f['rows']) == 0:
        raise ValueError('no region is inside the view of the model')
    labels = torch.tensor([rs.regions[j]['label'] for j in f['rows'].tolist()], dtype=torch.long)
    scale = float(ev.model.logit_scale.detach().exp())
    out = dict(n_regions=len(labels), classes=len(rs.classnames), vocabulary=rs.vocabulary,
               **region_chance(labels, len(rs.classnames), rs.groups))
    for emb in ('pooled', 'crop'):
        m = region_classification_metrics(scale * f[emb].double() @ cls.double().T, labels, rs.groups)
        out[emb] = {k: v for k, v in m.items() if k != 'ap_per_class'}
    return out


# %% [markdown]
# On a random micro model (numbers near chance, a check that it runs) and two hand-made images, whose regions are a
# red and a blue square: both embeddings are computed for every region the model sees, the one outside the view is
# counted, and a second call reads the cache. Then the pooled path against the region embedding written out by
# hand (the normalised mean of `encode`'s projected patches inside the mask, in float64).

# %%
from powerclip.eval.models import load_model
from powerclip.model import encode
_scratch = tempfile.TemporaryDirectory(prefix="powerclip-nb-")  # holds every scratch folder below; see the last cell
_d = Path(tempfile.mkdtemp(dir=_scratch.name))
(_d / 'images').mkdir()
(_d / 'annotations').mkdir()
for _n, (_c, _x) in {'a': ((200, 30, 30), 4), 'b': ((30, 30, 200), 16)}.items():
    _a = np.full((32, 48, 3), 90, np.uint8)
    _a[8:20, 8 + _x:20 + _x] = _c
    Image.fromarray(_a).save(_d / 'images' / f'{_n}.png')
_sq = lambda x0, y0, s: [[x0, y0, x0 + s, y0, x0 + s, y0 + s, x0, y0 + s]]
(_d / 'annotations' / 'instances_toy.json').write_text(json.dumps(dict(
    images=[dict(id=1, file_name='a.png', width=48, height=32), dict(id=2, file_name='b.png', width=48, height=32)],
    annotations=[dict(id=1, image_id=1, category_id=1, bbox=[12, 8, 12, 12], segmentation=_sq(12, 8, 12), area=144),
                 dict(id=2, image_id=2, category_id=2, bbox=[24, 8, 12, 12], segmentation=_sq(24, 8, 12), area=144),
                 dict(id=3, image_id=2, category_id=1, bbox=[0, 0, 6, 6], segmentation=_sq(0, 0, 6), area=36)],
    categories=[dict(id=1, name='red square'), dict(id=2, name='blue square')])))
from powerclip.eval.region_data import load_regions
_lm = load_model('powerclip-micro', seed=0)
_ev = Evaluator.of(_lm, cache_dir=_d / 'cache', progress=False)
_res = region_task(_ev, _toy := load_regions(_d / 'annotations' / 'instances_toy.json'))
test_eq((_res['n_regions'], _res['classes'], _res['chance_top1']), (2, 2, 50.0))
test_eq(_toy.skips.counts(), {'outside_view': 1})
assert set(_res['pooled']) >= {'top1', 'mean_per_class_recall', 'ap50'}
_again = region_task(_ev, load_regions(_d / 'annotations' / 'instances_toy.json'))
test_eq(_again, _res)
assert _ev.cache.hits >= 2
_f = region_embeddings(Evaluator.of(_lm, progress=False), _toy)
with torch.no_grad():
    for _k, _j in enumerate(_f['rows'].tolist()):
        _img = read_image(_toy.images[_toy.regions[_j]['image']])
        _p = encode(_lm.model, _lm.preprocess(_img)[None], None)['patches'][0].double()          # (N, D)
        _mask = region_patch_masks(_toy, [_j], grid_size(_lm.model))[0][0]
        _hand = torch.nn.functional.normalize(_p[_mask].mean(0), dim=-1)
        torch.testing.assert_close(_f['pooled'][_k].double(), _hand, rtol=0, atol=1e-5)
print({k: _res[k] for k in ('n_regions', 'chance_top1', 'chance_ap50')}, _res['pooled'])

# %% [markdown]
# The chance numbers against random logits through the metrics themselves (the mean of 300 draws): 120 regions of 10
# classes, unevenly many per class, in two groups; then, where the real sample is there, the chance levels of
# `coco_sample`'s regions under both vocabularies (every region read, before the model's view is applied).

# %%
_lab = torch.tensor(sum(([k] * n for k, n in enumerate([40, 25, 15, 10, 8, 7, 6, 5, 3, 1])), []))
_grp = dict(base=[0, 1, 2, 3, 4], novel=[5, 6, 7, 8, 9])
_ch = region_chance(_lab, 10, _grp)
_gen = torch.Generator().manual_seed(0)
_draws = [region_classification_metrics(torch.randn(len(_lab), 10, generator=_gen, dtype=torch.float64), _lab, _grp)
          for _ in range(300)]
for _k in ('ap50', 'ap50_base', 'ap50_novel'):
    test_close(_ch[f'chance_{_k}'], np.mean([d[_k] for d in _draws]), eps=1.5)
test_eq((_ch['chance_top1'], _ch['chance_top1_novel']), (10.0, 10.0))
assert _ch['chance_ap50_novel'] < _ch['chance_ap50_base']           # rarer classes: lower chance AP
assert np.isnan(region_chance(_lab[_lab < 5], 10, _grp)['chance_ap50_novel'])
print({k: round(v, 2) for k, v in _ch.items()})
_DATA = next((d for d in (Path('../shared/data'), Path('../../shared/data')) if d.is_dir()), None)
if _DATA is not None and (_DATA / 'coco_sample' / 'annotations').is_dir():
    for _v in ('all', 'ovcoco'):
        _cs = load_regions(_DATA / 'coco_sample' / 'annotations' / 'instances_val2017.json', vocabulary=_v)
        _c = region_chance(torch.tensor([r['label'] for r in _cs.regions]), len(_cs.classnames), _cs.groups)
        print(f'coco_sample val2017, vocabulary {_v} ({len(_cs.classnames)} classes, {len(_cs.regions)} regions): '
              + ', '.join(f'{k} {v:.2f}' for k, v in _c.items()))
else:
    print('skipped the real sample: ../shared/data is absent')

# %% [markdown]
# Every registered method's scorers read regions (on the toy set, a random micro model with its method's freshly built
# modules); SPARC's pooling of the whole grid is its own image embedding, as the default's is the model's under average
# pooling (`40_methods`).

# %%
import powerclip.baselines  # noqa: F401  (registers the baselines)
from powerclip.methods import METHODS
for _name in sorted(METHODS):
    if _name.startswith('_'):
        continue
    _lmm = load_model('powerclip-micro', method=_name, seed=0)
    for _s in _lmm.scorers:
        _r = region_task(Evaluator.of(_lmm, progress=False),
                         load_regions(_d / 'annotations' / 'instances_toy.json'), _s)
        assert _r['n_regions'] == 2 and 0 <= _r['pooled']['top1'] <= 100 and 0 <= _r['crop']['ap50'] <= 100, (_name, _s)
_sp = load_model('powerclip-micro', method='sparc', seed=0)
_x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    _whole = _sp.scorers['sparc'].region_features(_sp.model, _x, torch.ones(2, 1, 16, dtype=torch.bool))[:, 0]
    torch.testing.assert_close(_whole, _sp.scorers['sparc'].image_features(_sp.model, _x)['image'])


# %% [markdown]
# ## A picture: what each model names
#
# The numbers above are averages over every region; the picture below is one image at a time. Each region of the image
# is outlined and numbered, and beside it, per model, the three classes its pooled embedding scores highest, with their
# probabilities (a softmax over every class at the model's logit scale); a check mark is the right class.

# %%
#| export
def region_top_classes(ev: Evaluator, rs: RegionSet, image: int, k: int = 3, scorer: str | None = None) -> dict:
    """For the regions of `rs`'s image `image` that the model sees: `rows` (R,) their indices in `rs.regions`, `top`
    (R, k) the indices of the k classes the pooled embedding scores highest, `prob` (R, k) their probabilities (softmax
    over all classes at the model's logit scale)."""
    e = region_embeddings(ev, rs, scorer)                  # the task's own embeddings (cached): the same numbers
    sel = [n for n, j in enumerate(e['rows'].tolist()) if rs.regions[j]['image'] == image]
    if not sel:
        raise ValueError(f'image {image} has no region inside the view of the model')
    rows, f = e['rows'][sel].tolist(), e['pooled'][sel]                                       # (R,), (R, D)
    cls = class_embeddings(ev, rs.classnames, rs.templates, scorer)                          # (K, D)
    p = (float(ev.model.logit_scale.detach().exp()) * f @ cls.T).softmax(-1)                 # (R, K)
    prob, top = p.topk(min(k, p.shape[1]), dim=-1)
    return dict(rows=rows, top=top, prob=prob)

def region_picture(evs: dict, rs: RegionSet, image: int, k: int = 3, scorer: str | None = None):
    """A figure: image `image` of `rs` with its regions outlined and numbered, then one panel per model of `evs`
    ({label: Evaluator}) with the `k` classes it names for each region (`region_top_classes`)."""
    import matplotlib.pyplot as plt
    from matplotlib import patheffects
    tops = {name: region_top_classes(ev, rs, image, k, scorer) for name, ev in evs.items()}
    rows = next(iter(tops.values()))['rows']
    img = np.asarray(read_image(rs.images[image]))
    H, W = img.shape[:2]
    fig, axes = plt.subplots(1, 1 + len(evs), figsize=(3 + 2.6 * len(evs), 3.2))
    axes[0].imshow(img)
    halo = [patheffects.withStroke(linewidth=3, foreground='black')]
    for n, j in enumerate(rows):
        axes[0].contour(coco_mask(rs.regions[j]['segmentation'], H, W), levels=[0.5], colors='white', linewidths=1.5)
        x0, y0 = rs.regions[j]['box'][:2]
        axes[0].text(x0, y0, str(n + 1), color='white', fontsize=11, weight='bold', path_effects=halo)
    axes[0].set_axis_off()
    axes[0].set_title('regions', fontsize=10)
    step = 0.9 / (len(rows) * (k + 1.4))
    for ax, (name, t) in zip(axes[1:], tops.items()):
        ax.set_axis_off()
        ax.set_title(name, fontsize=10)
        y = 0.97
        for n, j in enumerate(rows):
            truth = rs.regions[j]['label']
            ax.text(0, y, f'{n + 1}. {rs.classnames[truth]}', fontsize=9, weight='bold', va='top',
                    transform=ax.transAxes)
            y -= step
            for c, pr in zip(t['top'][n].tolist(), t['prob'][n].tolist()):
                mark = ' \u2713' if c == truth else ''
                ax.text(0.08, y, f'{rs.classnames[c]}  {pr:.2f}{mark}', fontsize=8.5, va='top', transform=ax.transAxes,
                        color='tab:green' if mark else 'black')
                y -= step
            y -= 0.4 * step
    fig.tight_layout()
    return fig


# %% [markdown]
# On the toy set with the random micro model: the region it sees, its three best classes (here there are only two), in
# order, with probabilities that sum to one over the two classes.

# %%
_t = region_top_classes(_ev, _toy, 1, k=3)
test_eq((_t['rows'], tuple(_t['top'].shape)), ([1], (1, 2)))
assert (_t['prob'][:, :-1] >= _t['prob'][:, 1:]).all() and torch.allclose(_t['prob'].sum(-1), torch.ones(1))
_ev_b = Evaluator.of(load_model('powerclip-micro', seed=1), progress=False)
_fig = region_picture({'random A': _ev, 'random B': _ev_b}, _toy, 1)
test_eq(len(_fig.axes), 3)
import matplotlib.pyplot as plt
plt.close(_fig)

# %% [markdown]
# **Trained models on the world.** The cell below draws test scenes of the world for the models of the comparison at
# T = 1,600 (CLIP still rising; `python -m powerclip.experiments plateau --steps 1600`, `71a_plateau`; seed 0), or,
# where it has not been run, those of `make compare` (T = 150). Read with the numbers of the cell after it (pooled
# top-1 on the 300 test scenes, 35 attribute-bound classes, chance 2.9 %; T = 1,600, seed 0, so no interval yet; the
# comparison's tables have them over seeds):
#
# - **PowerCLIP-R names a region no better than chance** (2.6 %): it gives nearly every region the same answer ("blue
#   triangle" in both pictures). The model trained to align regions with phrases has not learned a region embedding
#   that stands for its class among all classes. What it did learn is *relative*: which patches of an image fit a
#   phrase better than the others (its pointing game on the same runs: 35-40 % against CLIP's 5-6 %, `67_heatmaps`).
# - **Class-token CLIP** (7.6 %) often names the colour of *another* object of the image (the green diamond is
#   "orange", the colour of the square beside it): its patch embeddings were never trained to stand alone, and what
#   they carry is mixed across the scene.
# - **Average pooling** makes every patch part of the global embedding, and the pooled region embedding becomes
#   meaningful: CLIP (avg) 14.2 %, PowerCLIP-R (avg) 16.2 %. Both get the colour right far more often than the shape
#   ("green circle" for the green diamond): colour is a property of every patch of an object, shape only of the patches
#   together. Whether PowerCLIP-R (avg) is better than CLIP (avg) needs the seeds (`70_compare`, `71_experiments`).
# - **Not the text side's fault.** With each class embedded the way PowerCLIP embeds a phrase in training (`phrase`:
#   the sum of its words' normalised token embeddings, Eqs. 3-4) instead of as a prompted sentence, the ordering stays:
#   PowerCLIP-R 5.4 %, CLIP 10.1 %, and the average-pooled models 22.9 % (CLIP) and 16.5 % (PowerCLIP-R).

# %%
#| slow
from powerclip.eval.data import write_world_benchmark
from powerclip.world import WorldConfig
_root = Path("..") if Path("../settings.ini").is_file() else Path(".")   # the repository root, from nbs/ or from it
_runs = next((d for d in (_root / 'runs' / 'plateau' / 'T1600' / 'seed0', _root / 'runs' / 'compare' / 'seed0')
              if (d / 'CLIP' / 'model.pt').is_file() and (d / 'PowerCLIP-R' / 'model.pt').is_file()), None)
if _runs is None:
    print('no trained CLIP and PowerCLIP-R yet: `make compare` (or the plateau experiment) trains them into runs/')
else:
    _labels = {'CLIP': 'CLIP', 'CLIP_avg': 'CLIP (avg)', 'PowerCLIP-R': 'PowerCLIP-R',
               'PowerCLIP-R_avg': 'PowerCLIP-R (avg)'}
    _evs = {lab: Evaluator.of(load_model(checkpoint=_runs / d), progress=False)
            for d, lab in _labels.items() if (_runs / d / 'model.pt').is_file()}
    _w = Path(tempfile.mkdtemp(dir=_scratch.name))
    write_world_benchmark(_w, 8, WorldConfig(), extras=False)        # 8 of the comparison's 300 test scenes
    _wrs = load_regions(_w / 'annotations' / 'instances_colour_shape.json')
    print(f'models of {_runs.relative_to(_root)}')
    for _i in (0, 1):
        plt.show(region_picture(_evs, _wrs, _i))

# %% [markdown]
# The pooled top-1 (%) on the 300 test scenes with the classes embedded two ways: as the task embeds them (prompted
# sentences, each model's own text pooling) and as PowerCLIP embeds a phrase (`phrase`: the class name alone, "a red
# circle", its two words' projected token embeddings normalised and summed, Eqs. 3-4).

# %%
#| slow
if _runs is not None:
    from powerclip.model import encode
    _w3 = Path(tempfile.mkdtemp(dir=_scratch.name))
    write_world_benchmark(_w3, 300, WorldConfig(), extras=False)
    _rs3 = load_regions(_w3 / 'annotations' / 'instances_colour_shape.json')
    for _lab, _e in _evs.items():
        _f = region_embeddings(_e, _rs3)
        _y = torch.tensor([_rs3.regions[j]['label'] for j in _f['rows'].tolist()])
        _tok = _e.tokenizer([f'a {c}' for c in _rs3.classnames])                 # (K, L): SOT a colour shape EOT
        with torch.no_grad():
            _v = encode(_e.model, None, _tok)['tokens']                            # (K, L, D) projected tokens
        _eot = _tok.argmax(-1)
        _phr = torch.stack([torch.nn.functional.normalize(_v[k, _eot[k] - 2:_eot[k]], dim=-1).sum(0)
                            for k in range(len(_tok))])
        _cls = {'prompts': class_embeddings(_e, _rs3.classnames, _rs3.templates),
                'phrase': torch.nn.functional.normalize(_phr, dim=-1)}
        _acc = {n: region_classification_metrics(_f['pooled'].double() @ c.double().T, _y)['top1']
                for n, c in _cls.items()}
        print(f"{_lab:18s} prompts {_acc['prompts']:5.1f}  phrase {_acc['phrase']:5.1f}  (chance {100 / 35:.1f})")

# %% [markdown]
# Every scratch folder made above lives under one temporary folder, removed here, so running the notebook
# leaves nothing behind (a training run's checkpoints take hundreds of MB).

# %%
_scratch.cleanup()
