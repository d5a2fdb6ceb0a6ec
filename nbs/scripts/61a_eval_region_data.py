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
#| default_exp eval.region_data

# %%
#| export
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from powerclip.eval.data import BadData, ItemSkips, MissingData, _field, _need, _read_json, check_image

# %%
#| hide
import json
import tempfile

from fastcore.test import test_eq, test_fail
from PIL import Image

# %% [markdown]
# # Region data on disk
#
# > The COCO-format region reader: ground-truth boxes, masks and classes, with OV-COCO's base and novel split.
#
# The region task reads the ground-truth objects of a detection data set: per region its image, box, mask and class.
# This notebook reads them from the COCO instances format, with the same rules as the other readers (`61_eval_data`):
# nothing is downloaded, a missing file stops with `MissingData`, and a bad annotation is skipped, counted by reason
# and named (`ItemSkips`), or, in strict mode, stops with one line naming the file.

# %% [markdown]
# ## The COCO instances format
#
# The region task (`63a_eval_regions`, `64_eval_tasks`) classifies ground-truth regions: every annotated object of an
# image, its box, its mask and its class. It reads the **COCO instances format** (`instances_*.json`: `images` with
# `id`, `file_name`, `width`, `height`; `annotations` with `image_id`, `category_id`, `bbox` as `[x, y, w, h]`,
# `segmentation` as polygons or RLE, `area`, `iscrowd`; `categories` with `id`, `name`), whatever wrote it: COCO itself,
# `coco_sample`'s two files, a user's own detection set, or the world's benchmark folder (`61_eval_data`), which writes
# its objects in the same format. Images are looked for in `image_root`, else in `images/` or the folder named like the
# file's split (`val2017/`) beside the `annotations/` folder.
#
# **The vocabulary.** By default every category in the file is a class. `vocabulary='ov-coco'` keeps the 65 classes
# of the open-vocabulary COCO split of Zareian et al. (OVR-CNN, CVPR 2021), which RegionCLIP, CLIM and the PowerCLIP
# paper's Table 15 use: 48 **base** classes (seen in detector training) and 17 **novel** ones (never seen), the other
# 15 COCO classes left out (counted as `outside_vocabulary`). Whenever the classes include OV-COCO's, the set carries
# the two groups so that novel classes are reported apart.

# %%
#| export
OV_COCO_BASE = ('person', 'bicycle', 'car', 'motorcycle', 'train', 'truck', 'boat', 'bench', 'bird', 'horse', 'sheep',
                'bear', 'zebra', 'giraffe', 'backpack', 'handbag', 'suitcase', 'frisbee', 'skis', 'kite', 'surfboard',
                'bottle', 'fork', 'spoon', 'bowl', 'banana', 'apple', 'sandwich', 'orange', 'broccoli',
                'carrot', 'pizza',
                'donut', 'chair', 'bed', 'toilet', 'tv', 'laptop', 'mouse', 'remote', 'microwave', 'oven', 'toaster',
                'refrigerator', 'book', 'clock', 'vase', 'toothbrush')        # 48 (OVR-CNN's split)
OV_COCO_NOVEL = ('airplane', 'bus', 'cat', 'dog', 'cow', 'elephant', 'umbrella', 'tie', 'snowboard', 'skateboard',
                 'cup', 'knife', 'cake', 'couch', 'keyboard', 'sink', 'scissors')   # 17
REGION_TEMPLATES = ('a photo of a {c}.', 'a photo of the {c}.', 'a cropped photo of a {c}.', 'a {c}.')

@dataclass
class RegionSet:
    "Ground-truth regions to classify: the images, and per region its image, box, segmentation and class."
    images: list            # [Path]
    sizes: list             # [(width, height)] of each image, as the annotations say
    regions: list           # [dict(image=i, box=(x0, y0, x1, y1) pixels, segmentation=COCO's, label=k, id=annotation
                            # id)]
    classnames: list        # [str] K class names
    templates: list         # prompt templates with '{c}'
    groups: dict            # {'base': [k..], 'novel': [k..]} when the classes include OV-COCO's, else {}
    skips: ItemSkips        # the annotations and images left out, by reason
    unseen: set = field(default_factory=set)   # ids of regions an evaluation found outside the model's view (counted
                                               # once)

def _region_images(path: Path, image_root) -> Path:
    "Where the images of an instances file are: `image_root`, else `images/` or `<split>/` beside `annotations/`."
    if image_root is not None:
        return _need(Path(image_root), 'the images folder of the instances file')
    base = path.parent.parent if path.parent.name == 'annotations' else path.parent
    split = path.stem.split('_', 1)[-1]                                          # instances_val2017 -> val2017
    for d in (base / 'images', base / split):
        if d.is_dir():
            return d
    raise MissingData(f'{path}: no images folder found (looked for {base / "images"} and '
                      f'{base / split}): pass image_root')

def _bad_box(box, width: int, height: int) -> str | None:
    "Why a COCO box `[x, y, w, h]` cannot be a region of a `width x height` image (None: it can)."
    if not (isinstance(box, (list, tuple)) and len(box) == 4 and all(isinstance(v, (int, float)) for v in box)):
        return f'box {box!r:.40} is not [x, y, w, h]'
    x, y, w, h = map(float, box)
    if not all(math.isfinite(v) for v in (x, y, w, h)):
        return f'box {box} is not finite'
    if w <= 0 or h <= 0:
        return f'degenerate box {box} (no width or height)'
    if x < -1 or y < -1 or x + w > width + 1 or y + h > height + 1:
        return f'box {box} outside the {width}x{height} image'
    return None

def load_regions(path, image_root=None, vocabulary: str = 'all', templates=REGION_TEMPLATES,
                 strict: bool = False) -> RegionSet:
    """The regions of a COCO-format instances file (see above); `vocabulary` 'all' (every category of the file) or
    'ov-coco' (OV-COCO's 48 base + 17 novel classes). Bad annotations are skipped, counted and named (`ItemSkips`)."""
    path = _need(Path(path), 'a COCO-format instances file (instances_*.json)')
    if vocabulary not in ('all', 'ov-coco'):
        raise ValueError(f"vocabulary must be 'all' or 'ov-coco', got {vocabulary!r}")
    d = _read_json(path)
    what = 'COCO instances: {"images", "annotations", "categories"}'
    cats = {c['id']: c['name'] for c in _field(d, 'categories', path, what) if isinstance(c, dict) and 'id' in c
            and 'name' in c}
    names = list(dict.fromkeys(cats.values())) if vocabulary == 'all' else [*OV_COCO_BASE, *OV_COCO_NOVEL]
    if vocabulary == 'ov-coco' and not set(names) <= set(cats.values()):
        raise BadData(f'{path}: vocabulary ov-coco needs COCO category names; missing '
                      f'{sorted(set(names) - set(cats.values()))[:5]}')
    index = {n: k for k, n in enumerate(names)}
    root, skips = _region_images(path, image_root), ItemSkips(strict)
    images, sizes, at, bad_images = [], [], {}, set()
    for im in _field(d, 'images', path, what):
        f = root / str(_field(im, 'file_name', path, what))
        if not check_image(f, skips):
            bad_images.add(im.get('id'))
            continue
        at[im.get('id')] = len(images)
        images.append(f)
        sizes.append((int(im.get('width', 0)), int(im.get('height', 0))))
    regions = []
    for a in _field(d, 'annotations', path, what):
        if not isinstance(a, dict) or a.get('image_id') in bad_images:
            continue          # its image is already counted
        where = f"{path.name} annotation {a.get('id')}"
        if a.get('image_id') not in at:
            skips.add('missing_image', where, f"image id {a.get('image_id')} not listed")
            continue
        i = at[a['image_id']]
        if a.get('category_id') not in cats:
            skips.add('unknown_category', where, f"category id {a.get('category_id')}")
            continue
        if a.get('iscrowd'):
            skips.add('crowd_region', where, cats[a['category_id']])
            continue
        if cats[a['category_id']] not in index:
            skips.add('outside_vocabulary', where, cats[a['category_id']])
            continue
        why = _bad_box(a.get('bbox'), *sizes[i])
        seg = a.get('segmentation')
        if why is None and (not seg or float(a.get('area', 1)) <= 0):
            why = 'empty area or segmentation'
        if why is None and isinstance(seg, dict) and isinstance(seg.get('counts'), str):
            why = 'compressed RLE segmentation (a string of counts; this reader decodes polygons and uncompressed RLE)'
        if why:
            skips.add('bad_region', where, why)
            continue
        x, y, w, h = map(float, a['bbox'])
        regions.append(dict(image=i, box=(x, y, x + w, y + h), segmentation=a['segmentation'],
                            label=index[cats[a['category_id']]], id=a.get('id')))
    groups = {}
    if set(OV_COCO_BASE) | set(OV_COCO_NOVEL) <= set(names):
        groups = {g: [index[n] for n in ns] for g, ns in (('base', OV_COCO_BASE), ('novel', OV_COCO_NOVEL))}
    skips.log(str(path), len(d.get('annotations') or []))
    if not regions:
        raise MissingData(f'{path}: no usable region ({skips.counts() or "no annotations"})')
    return RegionSet(images, sizes, regions, names, list(templates), groups, skips)


# %% [markdown]
# Every kind of bad annotation in one hand-written file: an empty segmentation, a degenerate box, a box outside its
# image, an unknown category id, a crowd region, an annotation of an image that is not listed, and one whose image
# file is missing (its image counted once). The good regions stay, with their boxes in pixels; strict mode stops at
# the first bad one. With the OV-COCO vocabulary the classes are the split's 65 and the groups index them.

# %%
_rd = Path(tempfile.mkdtemp())
(_rd / 'images').mkdir()
(_rd / 'annotations').mkdir()
for _n in ('a', 'b'):
    Image.new('RGB', (40, 30)).save(_rd / 'images' / f'{_n}.png')
_sq = [[2, 2, 12, 2, 12, 12, 2, 12]]                                             # a 10 x 10 square polygon
_ann = [dict(id=1, image_id=1, category_id=1, bbox=[2, 2, 10, 10], segmentation=_sq, area=100, iscrowd=0),
        dict(id=2, image_id=1, category_id=2, bbox=[20, 5, 8, 6], segmentation=_sq, area=48, iscrowd=0),
        dict(id=3, image_id=1, category_id=1, bbox=[2, 2, 10, 10], segmentation=[], area=0, iscrowd=0),      # empty
        # degenerate
        dict(id=4, image_id=1, category_id=1, bbox=[5, 5, 0, 4], segmentation=_sq, area=10, iscrowd=0),
        dict(id=5, image_id=2, category_id=2, bbox=[35, 20, 20, 20], segmentation=_sq, area=10, iscrowd=0),  # outside
        # unknown cat
        dict(id=6, image_id=2, category_id=9, bbox=[1, 1, 5, 5], segmentation=_sq, area=25, iscrowd=0),
        dict(id=7, image_id=2, category_id=1, bbox=[1, 1, 5, 5], segmentation=_sq, area=25, iscrowd=1),      # crowd
        # no such image
        dict(id=8, image_id=7, category_id=1, bbox=[1, 1, 5, 5], segmentation=_sq, area=25, iscrowd=0),
        # image file gone
        dict(id=9, image_id=3, category_id=1, bbox=[1, 1, 5, 5], segmentation=_sq, area=25, iscrowd=0),
        dict(id=10, image_id=2, category_id=2, bbox=[1, 1, 5, 5], segmentation=_sq, area=25, iscrowd=0)]
(_rd / 'annotations' / 'instances_val.json').write_text(json.dumps(dict(
    images=[dict(id=1, file_name='a.png', width=40, height=30), dict(id=2, file_name='b.png', width=40, height=30),
            dict(id=3, file_name='c.png', width=40, height=30)],
    annotations=_ann, categories=[dict(id=1, name='dog'), dict(id=2, name='red circle')])))
_rs = load_regions(_rd / 'annotations' / 'instances_val.json')
test_eq([(r['id'], r['image'], r['box'], r['label']) for r in _rs.regions],
        [(1, 0, (2.0, 2.0, 12.0, 12.0), 0), (2, 0, (20.0, 5.0, 28.0, 11.0), 1), (10, 1, (1.0, 1.0, 6.0, 6.0), 1)])
test_eq((_rs.classnames, _rs.groups, [p.name for p in _rs.images]), (['dog', 'red circle'], {}, ['a.png', 'b.png']))
test_eq(_rs.skips.counts(), dict(missing_image=2, bad_region=3, unknown_category=1, crowd_region=1))
test_eq(sorted(i['detail'] for i in _rs.skips.report()['items'] if i['reason'] == 'bad_region'),
        ['box [35, 20, 20, 20] outside the 40x30 image', 'degenerate box [5, 5, 0, 4] (no width or height)',
         'empty area or segmentation'])
test_fail(lambda: load_regions(_rd / 'annotations' / 'instances_val.json', strict=True),
          contains='c.png: missing image')
test_fail(lambda: load_regions(_rd / 'annotations' / 'instances_val.json', vocabulary='ov-coco'),
          contains='needs COCO category names')
test_fail(lambda: load_regions(_rd / 'nothing.json'), contains='instances_*.json')

# %% [markdown]
# The world's benchmark folder (`61_eval_data`) read back as regions: every object of every scene, its pixel mask and
# box, under both vocabularies (the shape, and the colour and shape).

# %%
import numpy as np

from powerclip.eval.data import WORLD_REGION_VOCABULARIES, write_world_benchmark
from powerclip.world import Scene, WorldConfig, render

tmp = Path(tempfile.mkdtemp())
world_summary = write_world_benchmark(tmp / 'world', n_images=60, extras=False)
cfg = WorldConfig()
scenes = json.loads((tmp / 'world' / 'scenes.json').read_text())
# the regions: every object of every scene, its pixel mask and box, under both vocabularies
from powerclip.regions import coco_mask
_wr = {v: load_regions(tmp / 'world' / 'annotations' / f'instances_{v}.json') for v in WORLD_REGION_VOCABULARIES}
test_eq(len(_wr['shape'].regions), world_summary['regions'])
test_eq(len(_wr['colour_shape'].classnames), 35)
for _r0, _r1 in zip(_wr['shape'].regions[:20], _wr['colour_shape'].regions[:20]):
    _im = _wr['shape'].images[_r0['image']]
    _sc = Scene.from_dict(scenes[_im.name]['scene'])
    _m = coco_mask(_r0['segmentation'], 64, 64)
    _k = next(k for k, m in enumerate(render(_sc, cfg)[1]) if np.array_equal(m, _m))   # the object it is
    _o = _sc.objects[_k]
    test_eq((_wr['shape'].classnames[_r0['label']], _wr['colour_shape'].classnames[_r1['label']]),
            (_o.shape, f'{_o.colour} {_o.shape}'))
    _rows, _cols = np.nonzero(_m)
    test_eq(_r0['box'], (float(_cols.min()), float(_rows.min()), float(_cols.max() + 1), float(_rows.max() + 1)))

# %% [markdown]
# The real sample (skipped when `../shared/data` is absent): COCO's instance annotations of the sample's photos, all 80
# classes and OV-COCO's 65.

# %%
DATA = Path('../../shared/data') if Path('../../shared/data').is_dir() else Path('../shared/data')
if (DATA / 'coco_sample').is_dir():
    # the real regions: COCO's instance annotations of the sample's photos, all 80 classes and OV-COCO's 65
    for _split in ('val2017', 'train2017'):
        for _v in ('all', 'ov-coco'):
            _cr = load_regions(DATA / 'coco_sample' / 'annotations' / f'instances_{_split}.json', vocabulary=_v)
            assert _cr.regions and all(0 <= r['label'] < len(_cr.classnames) for r in _cr.regions)
            test_eq(sorted(_cr.groups), ['base', 'novel'])
            test_eq(len(_cr.groups['novel']), 17)
            print(f"{_split} {_v}: {len(_cr.regions)} regions of {len(_cr.classnames)} classes on {len(_cr.images)} "
                  f"photos, novel {sum(r['label'] in _cr.groups['novel'] for r in _cr.regions)}; left "
                  f"out {_cr.skips.counts()}")
else:
    print('skipped: ../shared/data is absent')
