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

from powerclip.eval.data import _need
from powerclip.eval.items import ITEM_SKIP_REASONS, BadData, ItemSkips, MissingData, _field, _read_json, check_image

# %%
#| hide
import json
import tempfile

import numpy as np
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
# **The vocabulary** (`--vocab` of the evaluator). By default (`all`) every category in the file is a class.
# `vocabulary='ovcoco'` keeps the 65 classes of the open-vocabulary COCO split of Zareian et al. (OVR-CNN, CVPR 2021),
# which RegionCLIP, CLIM and the PowerCLIP paper's Table 15 use: 48 **base** classes (seen in detector training) and 17
# **novel** ones (never seen), the other 15 COCO classes left out (counted as `outside_vocabulary`). This is OV-COCO's
# *generalized* setting: a region of a base or a novel class is classified among the 65 classes only, never among the
# 15 that OV-COCO leaves out, so its distractors are the ones OV-COCO's numbers have. Whenever the classes include
# OV-COCO's, the set carries the two groups so that base and novel classes are reported apart; with `all` on COCO
# they are then scored among all 80 classes, a harder task than OV-COCO's, and the set's `vocabulary` says which one
# was used (the result and the side-by-side table carry it, `64_eval_tasks`, `65_eval_tables`).
#
# **Broken annotations and legitimate exclusions are told apart.** Every annotation is checked when it is read, before
# any model is built, so a segmentation that cannot be drawn never reaches `21_regions`' `coco_mask` (which would stop
# the run with a ValueError in the middle of the evaluation). What is wrong with it is one of three reasons:
#
# - `bad_polygon`: the polygons are not a list of lists of an even number of finite coordinates (a flat list
#   `[x0, y0, ..]`, an odd count, a string or NaN coordinate);
# - `bad_rle`: the RLE's `size` is not the image's `[height, width]`, its counts are not non-negative integers that sum
#   to height x width, or a compressed string of counts does not parse (a compressed string that parses is decoded
#   here, by pycocotools' own rule, and kept);
# - `degenerate`: the annotation is well formed but has nothing to see: an empty segmentation, polygons that enclose
#   no area (a one-point or collinear polygon: the shoelace area is 0), an RLE without a foreground pixel, a box without
#   width or height, an `area` of 0.
#
# A box that is not `[x, y, w, h]` of finite numbers or lies outside its image, an area that is not a number, an
# unknown category id and an image entry without a usable width and height are broken too (`bad_region`,
# `unknown_category`, `bad_image`, with an undecodable image file). The **legitimate exclusions** are a crowd region
# (`crowd_region`: COCO's evaluation ignores them too), a class outside the vocabulary (`outside_vocabulary`), an
# annotation whose image is not listed or whose file is not there (`missing_image`: a sample of a data set's photos),
# and, later, a region outside the centred square the model sees (`outside_view`, `63a_eval_regions`). Both kinds are
# counted and named in the result; `strict` (`--strict`) stops only on the broken kinds (`REGION_BROKEN`), in one
# line naming the file and the annotation id, so a valid COCO file passes it whatever its crowd regions and image
# sizes are. An annotation is checked before the vocabulary is applied, so `--strict` judges a file the same way under
# either vocabulary; a crowd region is not checked (it is never used).

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
VOCABULARIES = ('all', 'ovcoco')
# the reasons that mean a broken annotation or file (strict mode stops on them); the others are legitimate exclusions
REGION_BROKEN = ('bad_polygon', 'bad_rle', 'degenerate', 'bad_region', 'unknown_category', 'bad_image')

@dataclass
class RegionSkips(ItemSkips):
    "`ItemSkips` whose strict mode stops only on a broken annotation (`REGION_BROKEN`), not a legitimate exclusion."
    def add(self, reason: str, file, detail: str = '', group: str | None = None):
        if reason not in ITEM_SKIP_REASONS:
            raise ValueError(f'unknown skip reason {reason!r}; known: {ITEM_SKIP_REASONS}')
        if self.strict and reason in REGION_BROKEN:
            raise BadData(f'{file}: {reason.replace("_", " ")}' + (f' ({detail})' if detail else '') + ' [strict mode]')
        self.items.append((reason, str(file), detail, group))

def _finite_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0

def rle_counts(s: str) -> list[int]:
    """The run lengths of COCO's compressed RLE string (pycocotools' `rleFrString`: 6-bit groups from '0', the last
    of a number flagged by bit 5 clear, sign-extended, each count after the second a delta on the one two before);
    ValueError when it does not parse."""
    counts, p = [], 0
    while p < len(s):
        x, k, more = 0, 0, True
        while more:
            if p >= len(s):
                raise ValueError('the string ends inside a number')
            c = ord(s[p]) - 48
            if not 0 <= c < 64:
                raise ValueError(f'character {s[p]!r} at {p} is not one of RLE\'s 64')
            x |= (c & 0x1f) << 5 * k
            more = bool(c & 0x20)
            p, k = p + 1, k + 1
            if not more and c & 0x10:
                x |= -1 << 5 * k
        counts.append(x + counts[-2] if len(counts) > 2 else x)
    return counts

def segmentation_problem(seg, width: int, height: int) -> tuple[str, str] | None:
    """Why a COCO `segmentation` cannot be a region of a `width x height` image: `(reason, detail)` with reason
    `bad_polygon`, `bad_rle` or `degenerate` (see above); None when it can."""
    if seg is None or (isinstance(seg, (list, dict)) and not seg):
        return 'degenerate', 'empty segmentation'
    if isinstance(seg, list):
        if all(_finite_number(v) for v in seg):
            return 'bad_polygon', f'a flat list of {len(seg)} numbers, not a list of polygons [[x0, y0, x1, y1, ..]]'
        area = 0.0
        for k, poly in enumerate(seg):
            if not isinstance(poly, list) or not poly:
                return 'bad_polygon', f'polygon {k} is {poly!r:.40}, not a list of coordinates'
            bad = [v for v in poly if not _finite_number(v)]
            if bad:
                return 'bad_polygon', f'polygon {k} has a coordinate {bad[0]!r:.20} that is not a finite number'
            if len(poly) % 2:
                return 'bad_polygon', f'polygon {k} has an odd number of coordinates ({len(poly)})'
            x, y = poly[0::2], poly[1::2]
            area += abs(sum(x[i] * y[i - 1] - x[i - 1] * y[i] for i in range(len(x)))) / 2   # shoelace
        if area <= 0:
            return 'degenerate', f'polygons of {sum(len(q) // 2 for q in seg)} points that enclose no area'
        return None
    if not isinstance(seg, dict):
        return 'bad_polygon', f'segmentation {seg!r:.40} is neither a list of polygons nor an RLE'
    size, counts = seg.get('size'), seg.get('counts')
    if not (isinstance(size, (list, tuple)) and len(size) == 2 and all(_count(v) for v in size)):
        return 'bad_rle', f'size {size!r:.40} is not [height, width]'
    if list(size) != [height, width]:
        return 'bad_rle', f"size {list(size)} (height, width) is not the image's [{height}, {width}]"
    if isinstance(counts, str):
        try:
            counts = rle_counts(counts)
        except ValueError as e:
            return 'bad_rle', f'compressed counts: {e}'
    if not (isinstance(counts, list) and all(_count(c) for c in counts)):
        return 'bad_rle', f'counts {counts!r:.40} are not non-negative integers'
    if sum(counts) != height * width:
        return 'bad_rle', f'counts sum to {sum(counts)}, not height x width = {height * width}'
    if not any(counts[1::2]):
        return 'degenerate', 'an RLE without a foreground pixel'
    return None

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
    vocabulary: str = 'all'                    # the vocabulary the classes come from (`VOCABULARIES`)

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
    if not (isinstance(box, (list, tuple)) and len(box) == 4
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in box)):
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
    'ovcoco' (OV-COCO's 48 base + 17 novel classes). Bad annotations are skipped, counted and named (`RegionSkips`);
    `strict`: a broken one (`REGION_BROKEN`) raises `BadData` naming the file and the annotation id."""
    path = _need(Path(path), 'a COCO-format instances file (instances_*.json)')
    if vocabulary not in VOCABULARIES:
        raise ValueError(f'vocabulary must be one of {VOCABULARIES}, got {vocabulary!r}')
    d = _read_json(path)
    what = 'COCO instances: {"images", "annotations", "categories"}'
    cats = {c['id']: c['name'] for c in _field(d, 'categories', path, what) if isinstance(c, dict) and 'id' in c
            and 'name' in c}
    names = list(dict.fromkeys(cats.values())) if vocabulary == 'all' else [*OV_COCO_BASE, *OV_COCO_NOVEL]
    if vocabulary == 'ovcoco' and not set(names) <= set(cats.values()):
        raise BadData(f'{path}: vocabulary ovcoco needs COCO category names; missing '
                      f'{sorted(set(names) - set(cats.values()))[:5]}')
    index = {n: k for k, n in enumerate(names)}
    root, skips = _region_images(path, image_root), RegionSkips(strict)
    images, sizes, at, bad_images = [], [], {}, set()
    for im in _field(d, 'images', path, what):
        f = root / str(_field(im, 'file_name', path, what))
        W, H = im.get('width'), im.get('height')
        if not (_count(W) and _count(H) and W * H > 0):
            skips.add('bad_image', f'{path} image {im.get("id")}', f'width {W!r:.20} and height {H!r:.20} are not '
                      'positive integers')
            bad_images.add(im.get('id'))
            continue
        if not check_image(f, skips):
            bad_images.add(im.get('id'))
            continue
        at[im.get('id')] = len(images)
        images.append(f)
        sizes.append((W, H))
    regions = []
    for a in _field(d, 'annotations', path, what):
        if not isinstance(a, dict) or a.get('image_id') in bad_images:
            continue          # its image is already counted
        where = f"{path} annotation {a.get('id')}"
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
        bad = _annotation_problem(a, *sizes[i])
        if bad:
            skips.add(bad[0], where, bad[1])
            continue
        if cats[a['category_id']] not in index:
            skips.add('outside_vocabulary', where, cats[a['category_id']])
            continue
        x, y, w, h = map(float, a['bbox'])
        seg = a['segmentation']
        if isinstance(seg, dict) and isinstance(seg.get('counts'), str):   # compressed: decoded once, here
            seg = dict(size=list(seg['size']), counts=rle_counts(seg['counts']))
        regions.append(dict(image=i, box=(x, y, x + w, y + h), segmentation=seg,
                            label=index[cats[a['category_id']]], id=a.get('id')))
    groups = {}
    if set(OV_COCO_BASE) | set(OV_COCO_NOVEL) <= set(names):
        groups = {g: [index[n] for n in ns] for g, ns in (('base', OV_COCO_BASE), ('novel', OV_COCO_NOVEL))}
    skips.log(str(path), len(d.get('annotations') or []))
    if not regions:
        raise MissingData(f'{path}: no usable region ({skips.counts() or "no annotations"})')
    return RegionSet(images, sizes, regions, names, list(templates), groups, skips, vocabulary=vocabulary)

def _annotation_problem(a: dict, width: int, height: int) -> tuple[str, str] | None:
    "Why annotation `a` (not a crowd) of a `width x height` image cannot be a region: `(reason, detail)`, else None."
    why = _bad_box(a.get('bbox'), width, height)
    if why:
        return ('degenerate' if why.startswith('degenerate') else 'bad_region'), why
    area = a.get('area', 1)
    if not _finite_number(area):
        return 'bad_region', f'area {area!r:.20} is not a number'
    if area <= 0:
        return 'degenerate', f'area {area}'
    return segmentation_problem(a.get('segmentation'), width, height)


# %% [markdown]
# Every kind of bad annotation in one hand-written file: an area of 0, a degenerate box, a box outside its image, an
# unknown category id, a crowd region, an annotation of an image that is not listed, and one whose image file is
# missing (its image counted once). The good regions stay, with their boxes in pixels; strict mode stops at the first
# broken one (the area of 0), not at the missing image or the crowd region before it. The OV-COCO vocabulary needs
# COCO's names.

# %%
_scratch = tempfile.TemporaryDirectory(prefix="powerclip-nb-")  # holds every scratch folder below; see the last cell
_rd = Path(tempfile.mkdtemp(dir=_scratch.name))
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
test_eq(_rs.skips.counts(), dict(missing_image=2, bad_region=1, degenerate=2, unknown_category=1, crowd_region=1))
test_eq(sorted((i['reason'], i['detail']) for i in _rs.skips.report()['items']
               if i['reason'] in ('bad_region', 'degenerate')),
        [('bad_region', 'box [35, 20, 20, 20] outside the 40x30 image'), ('degenerate', 'area 0'),
         ('degenerate', 'degenerate box [5, 5, 0, 4] (no width or height)')])
test_fail(lambda: load_regions(_rd / 'annotations' / 'instances_val.json', strict=True),
          contains='instances_val.json annotation 3: degenerate (area 0) [strict mode]')
test_fail(lambda: load_regions(_rd / 'annotations' / 'instances_val.json', vocabulary='ovcoco'),
          contains='needs COCO category names')
test_fail(lambda: load_regions(_rd / 'nothing.json'), contains='instances_*.json')


# %% [markdown]
# Each broken segmentation, one at a time, on a copy of a good annotation (a 10 x 10 square in a 40 x 30 image): the
# reason and the detail `segmentation_problem` gives, and the same through `load_regions`, which counts the broken
# annotation and keeps the good one, and in strict mode stops with one line naming the file and the annotation id.
# A compressed RLE (written here by pycocotools' `rleToString` rule) is decoded into the mask it stands for.

# %%
def _rle_string(counts: list) -> str:
    "pycocotools' rleToString, written out: the inverse of `rle_counts`."
    out = []
    for i, x in enumerate(counts):
        x = x - counts[i - 2] if i > 2 else x
        more = True
        while more:
            c, x = x & 0x1f, x >> 5
            more = x != -1 if c & 0x10 else x != 0
            out.append(chr((c | 0x20 if more else c) + 48))
    return ''.join(out)

_H, _W = 30, 40
_sq_mask = np.zeros((_H, _W), bool)
_sq_mask[2:12, 2:12] = True
_counts, _v, _n = [], False, 0                     # COCO's RLE: column-major runs, starting with background
for _px in _sq_mask.T.ravel().tolist():
    if _px != _v:
        _counts, _v, _n = _counts + [_n], _px, 0
    _n += 1
_counts.append(_n)
_broken = {
    'odd coordinates': ([[2, 2, 12, 2, 12, 12, 2]], 'bad_polygon', 'polygon 0 has an odd number of coordinates (7)'),
    'string coordinate': ([[2, 2, 12, '2', 12, 12, 2, 12]], 'bad_polygon', "coordinate '2' that is not a finite"),
    'flat list': ([2, 2, 12, 2, 12, 12, 2, 12], 'bad_polygon', 'a flat list of 8 numbers'),
    'NaN coordinate': ([[2, 2, 12, float('nan'), 12, 12, 2, 12]], 'bad_polygon', 'nan'),
    'one point': ([[5, 5]], 'degenerate', 'polygons of 1 points that enclose no area'),
    'collinear': ([[0, 0, 5, 5, 10, 10]], 'degenerate', 'enclose no area'),
    'RLE of another size': (dict(size=[_W, _H], counts=_counts), 'bad_rle', "size [40, 30] (height, width) is not "
                                                                            "the image's [30, 40]"),
    'RLE counts short': (dict(size=[_H, _W], counts=_counts[:-1]), 'bad_rle', 'counts sum to'),
    'RLE negative count': (dict(size=[_H, _W], counts=[-1, 1201]), 'bad_rle', 'not non-negative integers'),
    'RLE bad string': (dict(size=[_H, _W], counts='a~'), 'bad_rle', "compressed counts: character '~'"),
    'RLE no pixel': (dict(size=[_H, _W], counts=[_H * _W]), 'degenerate', 'without a foreground pixel'),
    'empty': ([], 'degenerate', 'empty segmentation'),
    'neither': ('polygon', 'bad_polygon', 'neither a list of polygons nor an RLE')}
from powerclip.regions import coco_mask
for _what, (_seg, _reason, _detail) in _broken.items():
    _why = segmentation_problem(_seg, _W, _H)
    assert _why is not None and _why[0] == _reason and _detail in _why[1], (_what, _why)
    _bd = Path(tempfile.mkdtemp(dir=_scratch.name))
    (_bd / 'images').mkdir()
    Image.new('RGB', (_W, _H)).save(_bd / 'images' / 'a.png')
    _good = dict(id=1, image_id=1, category_id=1, bbox=[2, 2, 10, 10], segmentation=_sq, area=100, iscrowd=0)
    (_bd / 'instances_x.json').write_text(json.dumps(dict(
        images=[dict(id=1, file_name='a.png', width=_W, height=_H)], categories=[dict(id=1, name='dog')],
        annotations=[_good, dict(_good, id=7, segmentation=_seg)])))
    _b = load_regions(_bd / 'instances_x.json')
    test_eq(([r['id'] for r in _b.regions], _b.skips.counts()), ([1], {_reason: 1}))
    test_fail(lambda: load_regions(_bd / 'instances_x.json', strict=True),
              contains=f"instances_x.json annotation 7: {_reason.replace('_', ' ')} (")
# the same square as RLE, uncompressed and compressed: both kept, both the square
for _seg in (dict(size=[_H, _W], counts=_counts), dict(size=[_H, _W], counts=_rle_string(_counts))):
    assert segmentation_problem(_seg, _W, _H) is None
test_eq(rle_counts(_rle_string(_counts)), _counts)
test_eq(rle_counts(_rle_string([3, 700, 2, 0, 495])), [3, 700, 2, 0, 495])             # deltas that go negative
(_bd / 'instances_x.json').write_text(json.dumps(dict(
    images=[dict(id=1, file_name='a.png', width=_W, height=_H)], categories=[dict(id=1, name='dog')],
    annotations=[dict(_good, segmentation=dict(size=[_H, _W], counts=_rle_string(_counts)))])))
_c = load_regions(_bd / 'instances_x.json', strict=True)
test_eq(coco_mask(_c.regions[0]['segmentation'], _H, _W), _sq_mask)
test_eq(coco_mask(_sq, _H, _W).sum(), 121)       # PIL fills the polygon's outline too: the RLE is the 10 x 10 inside
# legitimate exclusions do not stop strict mode: a crowd region (its RLE is not even read), an image not listed
(_bd / 'instances_x.json').write_text(json.dumps(dict(
    images=[dict(id=1, file_name='a.png', width=_W, height=_H)], categories=[dict(id=1, name='dog')],
    annotations=[_good, dict(_good, id=2, iscrowd=1, segmentation=dict(size=[1, 1], counts='?')),
                 dict(_good, id=3, image_id=9)])))
test_eq(load_regions(_bd / 'instances_x.json', strict=True).skips.counts(), dict(missing_image=1, crowd_region=1))

# %% [markdown]
# The world's benchmark folder (`61_eval_data`) read back as regions: every object of every scene, its pixel mask and
# box, under both vocabularies (the shape, and the colour and shape).

# %%
from powerclip.eval.data import WORLD_REGION_VOCABULARIES, write_world_benchmark
from powerclip.world import Scene, WorldConfig, render

tmp = Path(tempfile.mkdtemp(dir=_scratch.name))
world_summary = write_world_benchmark(tmp / 'world', n_images=60, extras=False)
cfg = WorldConfig()
scenes = json.loads((tmp / 'world' / 'scenes.json').read_text())
# the regions: every object of every scene, its pixel mask and box, under both vocabularies
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
        for _v in VOCABULARIES:
            _cr = load_regions(DATA / 'coco_sample' / 'annotations' / f'instances_{_split}.json', vocabulary=_v)
            assert _cr.regions and all(0 <= r['label'] < len(_cr.classnames) for r in _cr.regions)
            test_eq(sorted(_cr.groups), ['base', 'novel'])
            test_eq(len(_cr.groups['novel']), 17)
            print(f"{_split} {_v}: {len(_cr.regions)} regions of {len(_cr.classnames)} classes on {len(_cr.images)} "
                  f"photos, novel {sum(r['label'] in _cr.groups['novel'] for r in _cr.regions)}; left "
                  f"out {_cr.skips.counts()}")
else:
    print('skipped: ../shared/data is absent')

# %% [markdown]
# Every scratch folder made above lives under one temporary folder, removed here, so running the notebook
# leaves nothing behind (a training run's checkpoints take hundreds of MB).

# %%
_scratch.cleanup()
