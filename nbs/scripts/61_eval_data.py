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
#| default_exp eval.data

# %%
#| export
from __future__ import annotations

import io
import json
import logging
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from powerclip.data import IMAGE_EXTS
from powerclip.eval.items import BadData, ItemSkips, MissingData, _field, _read_json, check_caption, check_image
from powerclip.parsing import caption_problem
from powerclip.world import NEGATIVE_KINDS, WorldConfig, benchmark_scene, caption_tree, generate, render

log = logging.getLogger(__name__)

# %%
#| hide
import tempfile
from fastcore.test import test_eq, test_fail
from powerclip.eval.items import read_image


# %% [markdown]
# # Benchmark data on disk
#
# > Readers of the benchmark folders the evaluation scores, and the one writer of the world's benchmark folder.
#
# The readers take retrieval lists, SugarCrepe, classification sets, Winoground and Karpathy's test splits; the writer
# writes the built-in world's benchmark folder in those same formats.

# %% [markdown]
# Readers return plain lists of absolute paths and strings; nothing is downloaded. A missing data set stops with
# `MissingData`, whose message names the files to put where; a bad *item* inside an existing data set (an image file
# that is missing or does not decode, a caption that is not text) is skipped, counted by reason and named
# (`ItemSkips`, `60a_eval_items`), or, in strict mode, stops with one line naming the file.
#
# | task | data (local files) |
# |---|---|
# | retrieval | Karpathy-style list `[{image, caption: [..]}]` (images in `images/`), Karpathy's `dataset_*.json`, clip_benchmark's `coco_test_karpathy.json` / `flickr*_test_karpathy.txt`, or `coco_sample/captions.jsonl` |
# | sugarcrepe | `data/{category}.json` (`{id: {filename, caption, negative_caption}}`) + `images/`, clip_benchmark's flat `{category}.json` + `val2017/`, or coco_sample's `sugarcrepe` field |
# | zeroshot, linear_probe | `classification.json`: class names, prompt templates, labelled images in `train`/`val`/`test`; or image folders `{train,val,test}/<class>/*.jpg` |
# | winoground | `data/examples.jsonl` + `data/images/*.png` (the Hugging Face layout) |
#
# The built-in world writes one folder that every task reads (`write_world_benchmark`, below): the demo's
# held-out scenes and `powerclip-eval make-world` are the same writer.
# The region task's reader, of COCO-format instances files, is `61a_eval_region_data`'s.

# %% [markdown]
# ### Retrieval

# %%
#| export
@dataclass
class RetrievalSet:
    images: list            # list[Path]
    captions: list          # list[list[str]], one list per image, every one non-empty
    skips: ItemSkips = field(default_factory=ItemSkips)   # what the reader dropped (missing or bad image, bad caption,
                                                          # no caption)

    @property
    def skipped(self) -> int: return len(self.skips)

    def flat(self) -> tuple[list[str], torch.Tensor]:
        "All captions `(T,)` and the image index of each `(T,)`."
        texts = [c for cs in self.captions for c in cs]
        return texts, torch.tensor([i for i, cs in enumerate(self.captions) for _ in cs], dtype=torch.long)

def _need(path: Path, what: str) -> Path:
    if not Path(path).exists():
        raise MissingData(f'{what}: expected {path}')
    return Path(path)

def _as_list(caps) -> list:
    "A row's captions as a list (a single string, or null, is one caption)."
    return list(caps) if isinstance(caps, (list, tuple)) else [caps]

def retrieval_set(rows: list, what: str, strict: bool = False, skips: ItemSkips | None = None) -> RetrievalSet:
    """`rows` `[(image path, [caption, ..])]` checked item by item (see the table above): bad captions removed, images
    missing, bad or left without a caption dropped. Raises `MissingData` when nothing is left."""
    skips = skips if skips is not None else ItemSkips(strict)
    images, captions = [], []
    for img, caps in rows:
        if not check_image(img, skips):
            continue
        good = [c.strip() for j, c in enumerate(caps) if check_caption(c, skips, img, f'caption {j}')]
        if not good:
            skips.add('no_caption', img, 'no usable caption: image dropped')
            continue
        images.append(Path(img))
        captions.append(good)
    skips.log(what, len(rows))
    if not images:
        raise MissingData(f'{what}: no usable item ({len(rows)} listed; {skips.counts() or "none"})')
    return RetrievalSet(images, captions, skips)

def load_retrieval(path, image_root=None, split: str = 'test', strict: bool = False) -> RetrievalSet:
    """A Karpathy-style retrieval json: either a list `[{image, caption: [str, ..]}]` (clip_benchmark's
    flickr/coco format, what `write_world_benchmark` writes) or Karpathy's `dataset_*.json`
    (`{images: [{filename, filepath?, split, sentences: [{raw}]}]}`, rows of `split` only)."""
    path = _need(Path(path), 'retrieval captions (Karpathy json)')
    root = Path(image_root) if image_root else path.parent / 'images'
    d = _read_json(path)
    if isinstance(d, dict) and 'images' in d:      # Karpathy's own file
        what = "Karpathy's {images: [{filename, split, sentences: [{raw}]}]}"
        rows = [(root / (r.get('filepath') or '') / _field(r, 'filename', path, what),
                 [s.get('raw') if isinstance(s, dict) else s for s in _as_list(_field(r, 'sentences', path, what))])
                for r in _field(d, 'images', path, what) if r.get('split') == split]
    elif isinstance(d, list):
        what = '[{"image", "caption": [..]}]'
        rows = [(root / str(_field(r, 'image', path, what)), _as_list(_field(r, 'caption', path, what))) for r in d]
    else:
        raise BadData(f'{path}: expected a list [{{"image", "caption": [..]}}] or Karpathy\'s {{"images": '
                      f'[..]}}, got {type(d).__name__}')
    return retrieval_set(rows, str(path), strict)

def load_coco_sample(root, split: str | None = None, strict: bool = False) -> RetrievalSet:
    "`coco_sample/captions.jsonl` (+ `images/`) as a retrieval set; `split` 'val2017' / 'train2017' / None (all)."
    root = Path(root)
    f = _need(root / 'captions.jsonl', 'coco_sample')
    rows = [r for r in _read_json(f, jsonl=True) if split is None or r.get('split') == split]
    what = 'coco_sample rows {"file_name", "captions": [..]}'
    return retrieval_set([(root / 'images' / str(_field(r, 'file_name', f, what)),
                           _as_list(_field(r, 'captions', f, what))) for r in rows],
                         str(root), strict)

def load_coco_karpathy(ann, image_root, strict: bool = False) -> RetrievalSet:
    """clip_benchmark's `coco_test_karpathy.json` (COCO format: images `{id, file_name}`, annotations `{image_id,
    caption}`)."""
    ann = Path(ann)
    d = _read_json(ann)
    what = 'COCO format {"images": [{"id", "file_name"}], "annotations": [{"image_id", "caption"}]}'
    caps = {}
    for a in _field(d, 'annotations', ann, what):
        caps.setdefault(_field(a, 'image_id', ann, what), []).append(a.get('caption'))
    rows = [(Path(image_root) / str(_field(im, 'file_name', ann, what)), caps.get(_field(im, 'id', ann, what), []))
            for im in _field(d, 'images', ann, what)]
    return retrieval_set(rows, str(ann), strict)

def load_flickr_karpathy(txt, image_root, strict: bool = False) -> RetrievalSet:
    "clip_benchmark's `flickr{8k,30k}_test_karpathy.txt`: a header line, then `name.jpg,caption` lines."
    caps, skips, txt = {}, ItemSkips(strict), Path(txt)
    for n, line in enumerate(txt.read_text(encoding='utf-8', errors='replace').splitlines()[1:], 2):
        if not line.strip():
            continue
        if '.jpg,' not in line:
            skips.add('bad_caption', txt, f'line {n}: no "<name>.jpg," before the caption')
            continue
        img, cap = line.strip().split('.jpg,', 1)      # captions may hold commas
        caps.setdefault(img + '.jpg', []).append(cap)
    return retrieval_set([(Path(image_root) / k, v) for k, v in caps.items()], str(txt), strict, skips)


# %% [markdown]
# SugarCrepe: the 7 categories, each `data/{category}.json`. The full benchmark text can be paired with any image
# folder (`image_root`): items whose photo is absent are skipped and counted. `coco_sample/captions.jsonl` carries
# its own 211 items in a `sugarcrepe` field. The world's hard negatives are written in this format, one file per
# kind (the kinds are SugarCrepe's categories).

# %%
#| export
SUGARCREPE = ('add_att', 'add_obj', 'replace_att', 'replace_obj', 'replace_rel', 'swap_att', 'swap_obj')

def load_sugarcrepe(root, image_root=None, categories=SUGARCREPE, strict: bool = False) -> tuple[dict, ItemSkips]:
    """`{category: [(image path, caption, negative caption)]}` and the `ItemSkips` (grouped by category) from
    `root/data/{category}.json` (images in `image_root`, default `root/images`), from clip_benchmark's
    `root/{category}.json` (images in `root/val2017`), or from `root/captions.jsonl` (coco_sample). Categories without
    an item are left out."""
    root = Path(root)
    image_root = Path(image_root) if image_root else root / 'images'
    skips, out = ItemSkips(strict), {}
    what = 'SugarCrepe items {"filename", "caption", "negative_caption"}'
    if (root / 'captions.jsonl').is_file() and not (root / 'data').is_dir():
        f = root / 'captions.jsonl'
        items = {c: [] for c in categories}
        for r in _read_json(f, jsonl=True):
            for s in r.get('sugarcrepe') or []:
                if s.get('category') in items:
                    items[s['category']].append((image_root / str(_field(r, 'file_name', f, what)), s.get('caption'),
                                                 s.get('negative_caption')))
    else:
        # clip_benchmark's layout: ROOT/{c}.json, ROOT/val2017/
        flat = any((root / f'{c}.json').is_file() for c in categories)
        if flat and image_root == root / 'images' and not image_root.is_dir():
            image_root = root / 'val2017'
        files = {c: (root if flat else root / 'data') / f'{c}.json' for c in categories}
        if not any(f.is_file() for f in files.values()):
            raise MissingData(f'SugarCrepe: expected {root}/data/{{{",".join(categories)}}}.json (from '
                              'github.com/RAIVNLab/sugar-crepe, folder data/) and the COCO '
                              f'val2017 images in {image_root}')
        items = {}
        for c, f in files.items():
            if not f.is_file():
                log.warning('SugarCrepe: %s missing, category skipped', f)
                continue
            d = _read_json(f)
            if not isinstance(d, dict):
                raise BadData(f'{f}: expected {{id: {{"filename", "caption", '
                              f'"negative_caption"}}}}, got {type(d).__name__}')
            items[c] = [(image_root / str(_field(r, 'filename', f, what)), r.get('caption'), r.get('negative_caption'))
                        for r in d.values()]
    for c, rows in items.items():
        # an item needs its photo, its caption and its negative; the photo is checked first (the full benchmark's text
        # against a subset of the photos: most items are missing_image, and their captions are not looked at)
        out[c] = [(img, pos.strip(), neg.strip()) for img, pos, neg in rows
                  if check_image(img, skips, c) and check_caption(pos, skips, img, f'{c} caption', group=c)
                  and check_caption(neg, skips, img, f'{c} negative', 'bad_negative', c)]
    skips.log(f'SugarCrepe under {root}', sum(map(len, items.values())))
    out = {c: v for c, v in out.items() if v}
    if not out:
        raise MissingData(f'SugarCrepe under {root}: no usable item (images looked for in {image_root}; '
                          f'{skips.counts() or "no item"})')
    return out, skips


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
    skips: ItemSkips = field(default_factory=ItemSkips)   # images dropped (missing or bad), grouped by split


def classification_from_folders(root) -> dict:
    """The `classification.json` content of an image-folder layout `root/{train,val,test}/<class>/*.jpg` (class
    names from the folder names, `_` read as a space; templates from `root/templates.txt`, one a line, else
    `a photo of a {c}.`): local copies of CIFAR, ImageNet etc. exported as folders."""
    root = Path(root)
    splits = [s for s in ('train', 'val', 'test') if (root / s).is_dir()]
    folders = sorted({d.name for s in splits for d in (root / s).iterdir() if d.is_dir()})
    if not folders:
        raise MissingData(f'classification: expected {root}/classification.json or image folders '
                          f'{root}/test/<class>/*.jpg')
    tf = root / 'templates.txt'
    templates = [l.strip() for l in tf.read_text().splitlines() if l.strip()] if tf.is_file() else ['a photo of a {c}.']
    rows = {s: [dict(image=str(p.relative_to(root)), label=k) for k, c in enumerate(folders) if (root / s / c).is_dir()
                for p in sorted((root / s / c).iterdir()) if p.suffix.lower() in IMAGE_EXTS] for s in splits}
    return dict(classnames=[c.replace('_', ' ') for c in folders], templates=templates, splits=rows)

CLASSIFICATION_FORMAT = ('classification set: {"classnames", "templates", "splits": '
                         '{"train"|"val"|"test": [{"image", "label"}]}}')

def load_classification(path, strict: bool = False) -> ClassificationSet:
    """A `classification.json` (or a folder holding one), or an image-folder layout; images that are missing or bad are
    skipped per split."""
    path = Path(path)
    if (path.is_dir() and not (path / 'classification.json').is_file()
        and any((path / s).is_dir() for s in ('train', 'val', 'test'))):
        d, path = classification_from_folders(path), path / 'classification.json'   # image paths relative to the folder
    else:
        if path.is_dir():
            path = path / 'classification.json'
        d = _read_json(_need(path, CLASSIFICATION_FORMAT))
    classnames, templates, rows_of = (_field(d, k, path, CLASSIFICATION_FORMAT)
                                      for k in ('classnames', 'templates', 'splits'))
    K, splits, skips = len(classnames), {}, ItemSkips(strict)
    if not templates or any(not isinstance(t, str) or '{c}' not in t for t in templates):
        raise BadData(f'{path}: every template needs a {{c}} slot')
    if any(caption_problem(c) for c in classnames):
        raise BadData(f'{path}: a class name that is not text: {next(c for c in classnames if caption_problem(c))!r}')
    for name, rows in rows_of.items():
        label = lambda r: _field(r, 'label', path, CLASSIFICATION_FORMAT)
        bad = [r for r in rows if not (isinstance(label(r), int) and 0 <= label(r) < K)]
        if bad:
            raise BadData(f'{path}: {len(bad)} labels of split {name} are not integers in [0, '
                          f'{K}), e.g. {label(bad[0])!r}')
        rows = [r for r in rows
                if check_image(path.parent / str(_field(r, 'image', path, CLASSIFICATION_FORMAT)), skips, name)]
        splits[name] = ([path.parent / r['image'] for r in rows],
                        torch.tensor([r['label'] for r in rows], dtype=torch.long))
    skips.log(str(path), sum(map(len, rows_of.values())))
    return ClassificationSet(list(classnames), list(templates), splits, skips)

WINOGROUND_HELP = ('Winoground is not on this machine and is never downloaded. Get it from '
                   'https://huggingface.co/datasets/facebook/winoground (accept its licence) and put '
                   '{root}/data/examples.jsonl and the images as {root}/data/images/<image_0|image_1>.png')

def load_winoground(root, strict: bool = False) -> tuple[list[tuple[Path, Path, str, str]], ItemSkips]:
    """`[(image_0, image_1, caption_0, caption_1)]` from the Hugging Face layout under `root`, and the `ItemSkips` (an
    item needs both images and both captions)."""
    root = Path(root)
    f = root / 'data' / 'examples.jsonl'
    if not f.is_file():
        raise MissingData(WINOGROUND_HELP.format(root=root))
    what = 'Winoground rows {"image_0", "image_1", "caption_0", "caption_1"}'
    img = lambda r, k: root / 'data' / 'images' / f'{_field(r, f"image_{k}", f, what)}.png'
    rows = [(img(r, 0), img(r, 1), r.get('caption_0'), r.get('caption_1')) for r in _read_json(f, jsonl=True)]
    skips = ItemSkips(strict)
    items = [(i0, i1, c0.strip(), c1.strip()) for i0, i1, c0, c1 in rows
             if check_image(i0, skips) and check_image(i1, skips)
             and check_caption(c0, skips, i0, 'caption_0') and check_caption(c1, skips, i1, 'caption_1')]
    skips.log(str(f), len(rows))
    if not items:
        raise MissingData(WINOGROUND_HELP.format(root=root) + ' (examples.jsonl found, but no '
                                                              f'usable pair: {skips.counts()})')
    return items, skips


# %% [markdown]
# Karpathy's test splits as clip_benchmark distributes them: a caption may hold commas, an annotation without its
# photo is counted.

# %%
_scratch = tempfile.TemporaryDirectory(prefix="powerclip-nb-")  # holds every scratch folder below; see the last cell
_kr = Path(tempfile.mkdtemp(dir=_scratch.name))
(_kr / 'val2014').mkdir()
for _n in ('a', 'b'):
    Image.new('RGB', (8, 8)).save(_kr / 'val2014' / f'{_n}.jpg')
(_kr / 'coco_test_karpathy.json').write_text(json.dumps(dict(images=[dict(id=1, file_name='a.jpg'),
                                                                     dict(id=2, file_name='b.jpg'),
                                                                     dict(id=3, file_name='c.jpg')],
    annotations=[dict(image_id=1, caption='one '), dict(image_id=2, caption='two'), dict(image_id=1, caption='uno'),
                 dict(image_id=3, caption='gone')])))
_r = load_coco_karpathy(_kr / 'coco_test_karpathy.json', _kr / 'val2014')
test_eq((_r.captions, _r.skipped, _r.skips.counts()), ([['one', 'uno'], ['two']], 1, {'missing_image': 1}))
Image.new('RGB', (8, 8)).save(_kr / 'x.jpg')
(_kr / 'flickr8k_test_karpathy.txt').write_text('image,caption\nx.jpg,a dog, running\nx.jpg,a dog\n')
test_eq(load_flickr_karpathy(_kr / 'flickr8k_test_karpathy.txt', _kr).captions, [['a dog, running', 'a dog']])

# %% [markdown]
# Every kind of bad item in one retrieval folder: a truncated JPEG, a scrambled one, a zero-byte file, a text file
# named `.jpg`, a missing image, and captions that are null, empty, a number, or punctuation only. The good items
# stay; each bad one is counted under its reason with its file; the image whose captions are all bad goes as
# `no_caption`. Strict mode stops at the first, naming it.

# %%
_bd = Path(tempfile.mkdtemp(dir=_scratch.name))
(_bd / 'images').mkdir()
_rng = np.random.default_rng(0)
for _n in ('ok0', 'ok1', 'ok2', 'trunc', 'scram', 'caps'):
    Image.fromarray(_rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)).save(_bd / 'images' / f'{_n}.jpg', quality=90)
_b = (_bd / 'images' / 'trunc.jpg').read_bytes()
(_bd / 'images' / 'trunc.jpg').write_bytes(_b[:len(_b) // 2])
_b = (_bd / 'images' / 'scram.jpg').read_bytes()
(_bd / 'images' / 'scram.jpg').write_bytes(_b[:16] + _rng.integers(0, 255, len(_b) - 16, dtype=np.uint8).tobytes())
(_bd / 'images' / 'zero.jpg').write_bytes(b'')
(_bd / 'images' / 'text.jpg').write_text('not an image')
(_bd / 'retrieval.json').write_text(json.dumps([
    dict(image='ok0.jpg', caption=['a red square', None, '']), dict(image='ok1.jpg', caption='a blue circle'),
    dict(image='ok2.jpg', caption=['a green cross', 7]), dict(image='caps.jpg', caption=['!!!', '   ']),
    *[dict(image=f'{_n}.jpg', caption=['fine words']) for _n in ('trunc', 'scram', 'zero', 'text', 'gone')]]))
_bs = load_retrieval(_bd / 'retrieval.json')
test_eq(([p.name for p in _bs.images], _bs.captions),
        (['ok0.jpg', 'ok1.jpg', 'ok2.jpg'], [['a red square'], ['a blue circle'], ['a green cross']]))
_rep = _bs.skips.report()
test_eq(_rep['counts'], dict(missing_image=1, bad_image=4, bad_caption=5, no_caption=1))
test_eq({Path(i['file']).name for i in _rep['items'] if i['reason'] == 'bad_image'},
        {'trunc.jpg', 'scram.jpg', 'zero.jpg', 'text.jpg'})
test_eq([i['detail'] for i in _rep['items'] if i['reason'] == 'bad_caption'][:3],
        ['caption 1: no caption', 'caption 2: empty caption', 'caption 1: caption is int, not text (7)'])
test_eq(texts_ti := _bs.flat()[1].tolist(), [0, 1, 2])               # the ground truth follows the kept images
test_fail(lambda: load_retrieval(_bd / 'retrieval.json', strict=True), contains='ok0.jpg: bad caption (caption 1: '
                                                                                'no caption) [strict mode]')
test_fail(lambda: read_image(_bd / 'images' / 'trunc.jpg'), contains='trunc.jpg: bad image')
(_bd / 'broken.json').write_text('[{"image": "ok0.jpg", "caption": ["a"]')
test_fail(lambda: load_retrieval(_bd / 'broken.json'), contains='broken.json: not valid JSON')
{i['reason']: i['detail'] for i in _rep['items']}


# %% [markdown]
# ## The world's benchmark folder
#
# `write_world_benchmark` writes held-out scenes of the built-in world (`world.benchmark_scene`) in the formats above,
# so every task reads the world with the same readers as real data. Under `out_dir`:
#
# - `images/world_{index:06d}.png`, the scenes;
# - `data/{kind}.json`, the hard negatives in SugarCrepe's format `{id: {filename, caption, negative_caption}}`, one
#   file per kind as in the real benchmark (`../shared/data/sugarcrepe/data/`), the training-style caption as `caption`;
# - `retrieval.json`, `[{"image": filename, "caption": [captions]}]` with `captions_per_image` full captions; a
#   caption text that another image already has is dropped, so every caption belongs to one image (an image left
#   with none is skipped and counted);
# - `annotations/instances_shape.json` and `annotations/instances_colour_shape.json`, every object of every scene in
#   the COCO instances format (box, pixel mask as uncompressed RLE), labelled by its shape ("circle") or by its colour
#   and shape ("red circle": the attribute-bound, compositional vocabulary): the region task's data, read by
#   `load_regions` (`61a_eval_region_data`) like any COCO file;
# - `retrieval_long.json`, the same format with one caption per scene: its long description (`WorldConfig(caption=
#   'long')`, `22_world`'s `describe_long`: a sentence per object with all its attributes, then its relations), the
#   long-caption retrieval task (`64_eval_tasks`); written for every world, short or long, since the scenes are the
#   same (a folder written before it gets it, as the regions below). As in `retrieval.json`, every text belongs to
#   one image: a scene whose description an earlier scene already has is left out and counted (one-object scenes of
#   the same size, colour and shape read alike: 45 of the 300 test scenes of the long table). Were both kept, two
#   scenes with one text would tie exactly under every model, and a tie counts as a miss (`60_eval_metrics`), so such
#   scenes would score 0 i2t R@1 even for a perfect model (its long R@1 76 % there, not 100 %). In a long-caption world the hard negatives keep
#   the short caption as their positive, the one they edit, so their items are those of the short world;
# - `scenes.json`, per file name its `index`, scene, gold tree and gold patch masks, and `parses.json`, the gold tree
#   of every caption and negative;
# - `config.json`, the `WorldConfig`, and `summary.json`, the counts and what was asked for.
#
# With `extras` (what `powerclip-eval make-world` writes) the folder also holds a classification set
# (`classification.json`: single-object scenes of the same world labelled by shape, templates `a photo of a {c}.` /
# `a {c}.`, with train/val/test splits for the linear probe from the world's own split streams, so no scene is shared),
# the same set as clip_benchmark's webdataset export (`wds_shape/`: tar shards of `.png` and `.cls` members plus
# `classnames.txt` and `zeroshot_classification_templates.txt`, which clip_benchmark's own `build_wds_dataset`
# reads, `63_eval_benchmarks`), and a Winoground-*format* file of pairs of scenes. That last one exercises the
# task's files and scoring; it is not a minimal-pair benchmark.
#
# A folder that already holds what is asked for (same request in `summary.json`) is not written again: the
# comparison's seeds share one folder of held-out scenes.

# %%
#| export
def write_wds_classification(out_dir, cls: ClassificationSet, splits=('train', 'test')) -> dict:
    "Write a `ClassificationSet` as clip_benchmark's webdataset export (one shard per split); returns counts per split."
    import tarfile
    out = Path(out_dir)
    counts = {}
    for split in splits:
        paths, labels = cls.splits[split]
        (out / split).mkdir(parents=True, exist_ok=True)
        with tarfile.open(out / split / '0.tar', 'w') as tar:
            for i, (p, y) in enumerate(zip(paths, labels.tolist())):
                for ext, data in (('png', Path(p).read_bytes()), ('cls', str(y).encode())):
                    info = tarfile.TarInfo(f'{i:06d}.{ext}')
                    info.size = len(data)
                    info.mtime = 0
                    tar.addfile(info, io.BytesIO(data))
        (out / split / 'nshards.txt').write_text('1\n')
        counts[split] = len(paths)
    (out / 'classnames.txt').write_text('\n'.join(cls.classnames) + '\n')
    (out / 'zeroshot_classification_templates.txt').write_text('\n'.join(cls.templates) + '\n')
    return counts

WORLD_TEMPLATES = ('a photo of a {c}.', 'a {c}.')

def write_world_classification(out_dir, n: dict | None = None, attribute: str = 'shape',
                               cfg: WorldConfig | None = None) -> dict:
    """Single-object scenes of the world `cfg` labelled by `attribute` ('shape' | 'colour') ->
    `out_dir/classification.json`; returns counts."""
    if attribute not in ('shape', 'colour'):
        raise ValueError(f"attribute must be 'shape' or 'colour', got {attribute!r}")
    out = Path(out_dir)
    (out / 'cls_images').mkdir(parents=True, exist_ok=True)
    cfg = replace(cfg or WorldConfig(), min_objects=1, max_objects=1)
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
    (out / 'classification.json').write_text(json.dumps(dict(classnames=classes,
                                                             templates=list(WORLD_TEMPLATES), splits=splits,
                                                             attribute=attribute, world_config=asdict(cfg)), indent=1))
    return {k: len(v) for k, v in splits.items()}

def write_world_winoground(out_dir, n_pairs: int = 50, cfg: WorldConfig | None = None) -> int:
    """Winoground-format pairs of world scenes (split 'val') under `out_dir/data/`; returns the number of pairs. Two
    random scenes make a pair: unlike Winoground the two captions are not word permutations of each other, so the
    score is no compositionality measure (the world's hard negatives are)."""
    out = Path(out_dir)
    (out / 'data' / 'images').mkdir(parents=True, exist_ok=True)
    cfg, rows = cfg or WorldConfig(), []
    for k in range(n_pairs):
        a, b = generate(cfg, 2 * k, 'val'), generate(cfg, 2 * k + 1, 'val')
        if a['text'] == b['text']:
            continue      # a pair needs two different captions
        for j, s in enumerate((a, b)):
            Image.fromarray(s['image']).save(out / 'data' / 'images' / f'wg_{k}_{j}.png')
        rows.append(dict(id=k, image_0=f'wg_{k}_0', image_1=f'wg_{k}_1', caption_0=a['text'], caption_1=b['text']))
    (out / 'data' / 'examples.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
    return len(rows)

def rle_counts(mask: np.ndarray) -> list[int]:
    "A `(H, W)` bool mask as COCO's uncompressed RLE counts: run lengths in column-major order, starting with zeros."
    flat = np.asarray(mask, bool).T.reshape(-1)
    bounds = np.concatenate([[0], np.flatnonzero(np.diff(flat.astype(np.int8))) + 1, [flat.size]])
    runs = np.diff(bounds).astype(int).tolist()
    return ([0] + runs) if flat.size and flat[0] else runs

WORLD_REGION_VOCABULARIES = ('shape', 'colour_shape')   # the world's region classes: 'circle', or 'red circle'

def _world_instances(images: list, objects: list, cfg: WorldConfig) -> dict:
    """COCO-format instances of the world's objects, one file per vocabulary: `images` [(id, file, W, H)], `objects`
    [(image id, WorldObject, pixel mask (H, W) bool)]."""
    names = dict(shape=list(cfg.shapes), colour_shape=[f'{c} {s}' for c in cfg.colours for s in cfg.shapes])
    out = {}
    for vocab, cats in names.items():
        ids = {n: k + 1 for k, n in enumerate(cats)}
        ann = []
        for j, (im, o, m) in enumerate(objects):
            rows, cols = np.nonzero(m)
            box = [int(cols.min()), int(rows.min()), int(cols.max() - cols.min() + 1), int(rows.max() - rows.min() + 1)]
            name = o.shape if vocab == 'shape' else f'{o.colour} {o.shape}'
            ann.append(dict(id=j + 1, image_id=im, category_id=ids[name], bbox=box, area=int(m.sum()), iscrowd=0,
                            segmentation=dict(counts=rle_counts(m), size=list(m.shape))))
        out[vocab] = dict(images=[dict(id=i, file_name=f, width=w, height=h) for i, f, w, h in images], annotations=ann,
                          categories=[dict(id=k, name=n) for n, k in ids.items()])
    return out

def write_world_regions(out, cfg: WorldConfig, n_images: int, split: str = 'test', captions_per_image: int = 2) -> int:
    """`out/annotations/instances_{shape,colour_shape}.json`: the objects of the benchmark folder's `n_images` scenes
    (the same scenes, drawn again from their seeds) in the COCO format; returns the number of regions."""
    images, objects = [], []
    for i in range(n_images):
        s = benchmark_scene(cfg, i, split, captions_per_image)['sample']
        images.append((i, f'world_{i:06d}.png', s['image'].shape[1], s['image'].shape[0]))
        objects += [(i, o, m) for o, m in zip(s['scene'].objects, render(s['scene'], cfg)[1]) if m.any()]
    (Path(out) / 'annotations').mkdir(parents=True, exist_ok=True)
    for vocab, inst in _world_instances(images, objects, cfg).items():
        (Path(out) / 'annotations' / f'instances_{vocab}.json').write_text(json.dumps(inst))
    return len(objects)

def _world_scenes(out: Path, cfg: WorldConfig, n_images: int, split: str, captions_per_image: int) -> dict:
    "Images, hard negatives, retrieval list, scenes and gold trees of `n_images` scenes; returns their counts."
    (out / 'images').mkdir(parents=True, exist_ok=True)
    (out / 'data').mkdir(exist_ok=True)
    sugar = {k: {} for k in NEGATIVE_KINDS}
    retrieval, scenes, parses, seen = [], {}, {}, set()
    dropped_captions = skipped_images = 0
    for i in range(n_images):
        b = benchmark_scene(cfg, i, split, captions_per_image)
        s, fname = b['sample'], f'world_{i:06d}.png'
        Image.fromarray(s['image']).save(out / 'images' / fname)
        scenes[fname] = dict(index=i, split=split, caption=s['text'], tree=s['parsed'].to_dict(),
                             scene=s['scene'].to_dict(),
                             order=s['order'], masks=s['masks'][s['mask_valid']].astype(int).tolist())
        parses[s['text']] = s['parsed'].to_dict()
        # the negatives edit the short caption: in a long-caption world it stays their positive (today's items)
        pos = caption_tree(s['spec'])[0] if cfg.caption == 'long' else s['parsed']
        parses[pos.text] = pos.to_dict()
        for kind, neg in b['negatives'].items():
            parses[neg.text] = neg.to_dict()
            sugar[kind][str(len(sugar[kind]))] = dict(filename=fname, caption=pos.text, negative_caption=neg.text)
        caps = []
        for c in b['captions']:
            if c.text in seen:
                dropped_captions += 1
                continue
            seen.add(c.text)
            caps.append(c.text)
            parses[c.text] = c.to_dict()
        if caps:
            retrieval.append(dict(image=fname, caption=caps))
        else:
            skipped_images += 1
    def dump(obj, name):
        (out / name).write_text(json.dumps(obj, indent=1))
    for kind, items in sugar.items():
        dump(items, f'data/{kind}.json')
    dump(retrieval, 'retrieval.json')
    dump(scenes, 'scenes.json')
    dump(parses, 'parses.json')
    return dict(sugarcrepe={k: len(v) for k, v in sugar.items()},
                retrieval_images=len(retrieval), retrieval_captions=sum(len(r['caption']) for r in retrieval),
                retrieval_dropped_duplicate_captions=dropped_captions, retrieval_skipped_images=skipped_images)

def write_world_long_retrieval(out, cfg: WorldConfig, n_images: int, split: str = 'test') -> dict:
    """`out/retrieval_long.json`: each of the folder's `n_images` scenes with its long caption (`describe_long`, the
    same scene drawn again from its seed in the long-caption world), its gold tree added to `parses.json`; a scene
    whose long caption an earlier scene already has is left out and counted (see "Long captions" above). Returns
    {'images': scenes written, 'skipped_repeated_images': scenes left out}."""
    out, lcfg = Path(out), replace(cfg, caption='long')
    parses = json.loads((out / 'parses.json').read_text()) if (out / 'parses.json').is_file() else {}
    items, seen = [], set()
    for i in range(n_images):
        s = generate(lcfg, i, split)
        parses[s['text']] = s['parsed'].to_dict()
        if s['text'] not in seen:
            seen.add(s['text'])
            items.append(dict(image=f'world_{i:06d}.png', caption=[s['text']]))
    (out / 'parses.json').write_text(json.dumps(parses, indent=1))
    (out / 'retrieval_long.json').write_text(json.dumps(items, indent=1))
    return dict(images=len(items), skipped_repeated_images=n_images - len(items))

class WorldFolderTaken(FileExistsError):
    "A folder that holds something other than the world asked for: it is not written over."


def _request_of(out: Path) -> dict | None:
    "The request a world folder was written for (its `summary.json`), None when it holds none."
    try:
        return json.loads((out / 'summary.json').read_text()).get('request')
    except (OSError, ValueError, AttributeError):
        return None


def write_world_benchmark(out_dir, n_images: int = 100, cfg: WorldConfig | None = None, split: str = 'test',
                          extras: bool = True, captions_per_image: int = 2, replace: bool = True) -> dict:
    """The world's benchmark folder (see above) of `n_images` scenes of `split`; `extras`: also the classification
    set, its webdataset export and the Winoground-format pairs. Returns the summary (also `summary.json`); a folder
    that already holds this request is left as it is. A folder holding another world is written anew as a whole
    (`replace`, the callers that own the folder: the trainer's and the comparison's evaluation worlds; its old files
    never left beside the new ones) or refused (`replace=False`: `powerclip-eval make-world`); a non-empty folder that
    holds no world is always refused (`WorldFolderTaken`): nothing of it is touched."""
    cfg, out = cfg or WorldConfig(), Path(out_dir)
    request = json.loads(json.dumps(dict(n_images=n_images, split=split, extras=extras,
                                         captions_per_image=captions_per_image, config=asdict(cfg))))
    regions = [out / 'annotations' / f'instances_{v}.json' for v in WORLD_REGION_VOCABULARIES]
    if (out / 'summary.json').is_file():
        old = json.loads((out / 'summary.json').read_text())
        if old.get('request') == request:
            # a folder written before it had regions gets them: the same scenes, so the rest (and its request) stands
            if not all(f.is_file() for f in regions):
                old['regions'] = write_world_regions(out, cfg, n_images, split, captions_per_image)
                (out / 'summary.json').write_text(json.dumps(old, indent=1))
            # likewise the long captions (they came later; a folder from before repeated texts were left out holds
            # their count alone, and every scene)
            if not (out / 'retrieval_long.json').is_file() or not isinstance(old.get('retrieval_long'), dict):
                old['retrieval_long'] = write_world_long_retrieval(out, cfg, n_images, split)
                (out / 'summary.json').write_text(json.dumps(old, indent=1))
            return old
    if out.is_dir() and any(out.iterdir()):
        had = _request_of(out)
        if had is None or not replace:
            what = (f"another world ({', '.join(f'{k} {had.get(k)}' for k in ('n_images', 'split', 'extras'))}, "
                    f"seed {had.get('config', {}).get('seed')})" if had else 'files that are not a world folder')
            raise WorldFolderTaken(f'{out} holds {what}: give an empty or new folder (nothing there is written over)')
        import shutil
        fresh = out.with_name(f'{out.name}.new-{os.getpid()}')
        write_world_benchmark(fresh, n_images, cfg, split, extras, captions_per_image)
        gone = out.with_name(f'{out.name}.old-{os.getpid()}')
        os.replace(out, gone)                          # the old world out, the new one in, then the old one removed:
        os.replace(fresh, out)                         # its images would otherwise stay beside the new ones
        shutil.rmtree(gone)
        return json.loads((out / 'summary.json').read_text())
    out.mkdir(parents=True, exist_ok=True)
    summary = dict(n_images=n_images, split=split, **_world_scenes(out, cfg, n_images, split, captions_per_image),
                   regions=write_world_regions(out, cfg, n_images, split, captions_per_image),
                   retrieval_long=write_world_long_retrieval(out, cfg, n_images, split))
    if extras:
        summary['classification'] = write_world_classification(out, dict(train=n_images, val=n_images // 2,
                                                                         test=n_images), cfg=cfg)
        summary['winoground_pairs'] = write_world_winoground(out, max(1, n_images // 4), cfg=cfg)
        summary['wds_shape'] = write_wds_classification(out / 'wds_shape', load_classification(out))
    summary['request'] = request
    (out / 'config.json').write_text(json.dumps(asdict(cfg), indent=1))
    (out / 'summary.json').write_text(json.dumps(summary, indent=1))
    return summary


# %% [markdown]
# Written and read back: every file is what the readers above expect, the images are the scenes (PNG is
# lossless), every negative is false and every caption true of its scene, and the gold trees are there for every
# text. A second call with the same request writes nothing.

# %%
from powerclip.parsing import ParsedCaption
from powerclip.world import Scene, caption_truth, spec_from_text
tmp = Path(tempfile.mkdtemp(dir=_scratch.name))
world_summary = write_world_benchmark(tmp / 'world', n_images=60)
cfg = WorldConfig()
ret = load_retrieval(tmp / 'world' / 'retrieval.json')
sc, sc_skipped = load_sugarcrepe(tmp / 'world')
cls = load_classification(tmp / 'world')
wg, _ = load_winoground(tmp / 'world')
test_eq(len(ret.images), world_summary['retrieval_images'])
test_eq({c: len(v) for c, v in sc.items()}, {c: v for c, v in world_summary['sugarcrepe'].items() if v})
test_eq({k: len(v[0]) for k, v in cls.splits.items()}, dict(train=60, val=30, test=60))
scenes = json.loads((tmp / 'world' / 'scenes.json').read_text())
parses = json.loads((tmp / 'world' / 'parses.json').read_text())
for kind, items in sc.items():
    for path, cap, neg in items:
        scene = Scene.from_dict(scenes[path.name]['scene'])
        test_eq(np.asarray(Image.open(path).convert('RGB')), render(scene, cfg)[0])
        test_eq(cap, scenes[path.name]['caption'])
        assert (caption_truth(spec_from_text(cap, cfg), scene, cfg) is True
                and caption_truth(spec_from_text(neg, cfg), scene, cfg) is False)
        assert ParsedCaption.from_dict(parses[neg]).text == neg
texts, _ = ret.flat()
test_eq(len(texts), len(set(texts)))
assert all(t in parses for t in texts)
_mtime = (tmp / 'world' / 'retrieval.json').stat().st_mtime_ns
# the same request: nothing written
test_eq(write_world_benchmark(tmp / 'world', n_images=60), world_summary)
for _f in (tmp / 'world' / 'annotations').glob('*.json'):
    _f.unlink()                        # a folder from before the regions
test_eq(write_world_benchmark(tmp / 'world', n_images=60)['request'], world_summary['request'])
test_eq(len(json.loads((tmp / 'world' / 'annotations' / 'instances_shape.json').read_text())['annotations']),
        world_summary['regions'])
test_eq((tmp / 'world' / 'retrieval.json').stat().st_mtime_ns, _mtime)                       # the rest untouched
# another world in the folder: written anew as a whole by its owners (no stale image left), refused with replace=False;
# a folder of other files is never written into
test_fail(lambda: write_world_benchmark(tmp / 'world', n_images=8, replace=False), contains='holds another world '
          '(n_images 60, split test, extras True, seed 0): give an empty or new folder')
_small = write_world_benchmark(tmp / 'world2', n_images=12)
write_world_benchmark(tmp / 'world2', n_images=6)
write_world_benchmark(tmp / 'world3', n_images=6)
test_eq(sorted(p.name for p in (tmp / 'world2').rglob('*')), sorted(p.name for p in (tmp / 'world3').rglob('*')))
(tmp / 'mine').mkdir()
(tmp / 'mine' / 'notes.txt').write_text('mine')
test_fail(lambda: write_world_benchmark(tmp / 'mine', n_images=8), contains='holds files that are not a world folder')
test_eq(sorted(p.name for p in (tmp / 'mine').iterdir()), ['notes.txt'])
test_eq((tmp / 'world' / 'retrieval.json').stat().st_mtime_ns, _mtime)
test_fail(lambda: load_winoground(tmp / 'nowhere'), contains='data/examples.jsonl')
test_fail(lambda: load_sugarcrepe(tmp / 'nowhere'), contains='sugar-crepe')
{k: v for k, v in world_summary.items() if k != 'request'}, cls.classnames, len(wg)

# %% [markdown]
# The long captions: one per scene whose description no earlier scene has, each sentence true of it, their trees in
# `parses.json`; a scene left out has the description of one kept; a folder from before them gets them, and a folder
# from before repeats were left out has its long file written again.

# %%
_long = load_retrieval(tmp / 'world' / 'retrieval_long.json')
_lsum = world_summary['retrieval_long']
test_eq((len(_long.images), _lsum['images'] + _lsum['skipped_repeated_images']), (_lsum['images'], 60))
assert _lsum['skipped_repeated_images'] > 0                   # 60 scenes hold repeats (one-object scenes alike)
_kept = {c for (c,) in _long.captions}
test_eq(len(_kept), len(_long.captions))                       # every text belongs to one image
for _img, (_cap,) in zip(_long.images, _long.captions):
    _sc = scenes[Path(_img).name]
    _g = generate(replace(cfg, caption='long'), _sc['index'], 'test')
    test_eq(_cap, _g['text'])
    assert _cap in parses and _cap.count('.') == len(_g['specs']) >= 1        # one sentence a spec
    assert all(caption_truth(sp, Scene.from_dict(_sc['scene']), cfg) is True for sp in _g['specs'])
_left = [i for i in range(60) if f'world_{i:06d}.png' not in {Path(p).name for p in _long.images}]
assert all(generate(replace(cfg, caption='long'), i, 'test')['text'] in _kept for i in _left)
(tmp / 'world' / 'retrieval_long.json').unlink()              # a folder from before the long captions
test_eq(write_world_benchmark(tmp / 'world', n_images=60)['retrieval_long'], _lsum)
test_eq(load_retrieval(tmp / 'world' / 'retrieval_long.json').captions, _long.captions)
_old = json.loads((tmp / 'world' / 'summary.json').read_text())   # from before repeats were left out: a count alone
(tmp / 'world' / 'summary.json').write_text(json.dumps({**_old, 'retrieval_long': 60}))
(tmp / 'world' / 'retrieval_long.json').write_text('[]')
test_eq(write_world_benchmark(tmp / 'world', n_images=60)['retrieval_long'], _lsum)
test_eq(load_retrieval(tmp / 'world' / 'retrieval_long.json').captions, _long.captions)
write_world_benchmark(tmp / 'wlong', n_images=20, cfg=WorldConfig(caption='long'), extras=False)
write_world_benchmark(tmp / 'wshort', n_images=20, extras=False)
for _f in ('retrieval_long.json', 'retrieval.json', *(f'data/{k}.json' for k in NEGATIVE_KINDS)):
    test_eq((tmp / 'wlong' / _f).read_text(), (tmp / 'wshort' / _f).read_text())

# %% [markdown]
# The real sample (skipped when `../shared/data` is absent): 239 photos with 5 captions each, and the 211
# SugarCrepe items on its val2017 photos. Paired with the complete SugarCrepe text, only the items on those
# photos are kept and the rest is counted as skipped. The world's hard-negative files have the real benchmark's keys.

# %%
DATA = Path('../../shared/data') if Path('../../shared/data').is_dir() else Path('../shared/data')
if (DATA / 'coco_sample').is_dir():
    coco = load_coco_sample(DATA / 'coco_sample')
    coco_sc, _ = load_sugarcrepe(DATA / 'coco_sample')
    full_sc, full_skipped = load_sugarcrepe(DATA / 'sugarcrepe', image_root=DATA / 'coco_sample' / 'images')
    test_eq((len(coco.images), sum(map(len, coco.captions))), (239, 1195))
    test_eq(sum(map(len, coco_sc.values())), 211)
    real = json.loads((DATA / 'sugarcrepe' / 'data' / 'swap_att.json').read_text())
    test_eq(set(next(iter(real.values()))),
            set(json.loads((tmp / 'world' / 'data' / 'swap_att.json').read_text())['0']))
    test_eq((coco.skipped, full_skipped.counts()), (0, {'missing_image': 7511 - 211}))
    print({c: len(v) for c, v in coco_sc.items()}, 'full benchmark kept', sum(map(len, full_sc.values())), 'skipped',
          full_skipped.counts())
else:
    print('skipped: ../shared/data is absent')

# %% [markdown]
# Every scratch folder made above lives under one temporary folder, removed here, so running the notebook
# leaves nothing behind (a training run's checkpoints take hundreds of MB).

# %%
_scratch.cleanup()
