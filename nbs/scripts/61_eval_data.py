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
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from PIL import Image

from powerclip.data import IMAGE_EXTS
from powerclip.world import NEGATIVE_KINDS, WorldConfig, benchmark_scene, generate

log = logging.getLogger(__name__)

# %%
#| hide
import tempfile
import numpy as np
from fastcore.test import test_eq, test_fail


# %% [markdown]
# # Benchmark data on disk
#
# > Readers of the benchmark folders the evaluation scores (retrieval lists, SugarCrepe, classification sets, Winoground, Karpathy's test splits), and the one writer of the built-in world's benchmark folder in those same formats.

# %% [markdown]
# Readers return plain lists of absolute paths and strings; nothing is downloaded. A missing file stops with
# `MissingData`, whose message names the files to put where; a missing image inside an existing data set is a
# counted, logged skip.
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
    flickr/coco format, what `write_world_benchmark` writes) or Karpathy's `dataset_*.json`
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

def load_coco_karpathy(ann, image_root) -> RetrievalSet:
    "clip_benchmark's `coco_test_karpathy.json` (COCO format: images `{id, file_name}`, annotations `{image_id, caption}`)."
    d = json.loads(Path(ann).read_text())
    caps = {}
    for a in d['annotations']: caps.setdefault(a['image_id'], []).append(a['caption'].strip())
    rows = [(Path(image_root) / im['file_name'], caps.get(im['id'], [])) for im in d['images']]
    n = len(rows)
    rows, _ = _keep_existing([r for r in rows if r[1]], lambda r: r[0], str(ann))
    if not rows: raise MissingData(f'{ann}: no image found under {image_root}')
    return RetrievalSet([r[0] for r in rows], [r[1] for r in rows], skipped=n - len(rows))

def load_flickr_karpathy(txt, image_root) -> RetrievalSet:
    "clip_benchmark's `flickr{8k,30k}_test_karpathy.txt`: a header line, then `name.jpg,caption` lines."
    caps = {}
    for line in Path(txt).read_text().splitlines()[1:]:
        if line.strip():
            img, cap = line.strip().split('.jpg,', 1)      # captions may hold commas
            caps.setdefault(img + '.jpg', []).append(cap)
    rows = [(Path(image_root) / k, v) for k, v in caps.items()]
    n = len(rows)
    rows, _ = _keep_existing(rows, lambda r: r[0], str(txt))
    if not rows: raise MissingData(f'{txt}: no image found under {image_root}')
    return RetrievalSet([r[0] for r in rows], [r[1] for r in rows], skipped=n - len(rows))


# %% [markdown]
# SugarCrepe: the 7 categories, each `data/{category}.json`. The full benchmark text can be paired with any image
# folder (`image_root`): items whose photo is absent are skipped and counted. `coco_sample/captions.jsonl` carries
# its own 211 items in a `sugarcrepe` field. The world's hard negatives are written in this format, one file per
# kind (the kinds are SugarCrepe's categories).

# %%
#| export
SUGARCREPE = ('add_att', 'add_obj', 'replace_att', 'replace_obj', 'replace_rel', 'swap_att', 'swap_obj')

def load_sugarcrepe(root, image_root=None, categories=SUGARCREPE) -> tuple[dict, dict]:
    """`{category: [(image path, caption, negative caption)]}` and `{category: skipped}` from `root/data/{category}.json`
    (images in `image_root`, default `root/images`), from clip_benchmark's `root/{category}.json` (images in
    `root/val2017`), or from `root/captions.jsonl` (coco_sample). Categories without an item are left out."""
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
        flat = any((root / f'{c}.json').is_file() for c in categories)       # clip_benchmark's layout: ROOT/{c}.json, ROOT/val2017/
        if flat and image_root == root / 'images' and not image_root.is_dir(): image_root = root / 'val2017'
        files = {c: (root if flat else root / 'data') / f'{c}.json' for c in categories}
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
# Karpathy's test splits as clip_benchmark distributes them: a caption may hold commas, an annotation without its
# photo is counted.

# %%
_kr = Path(tempfile.mkdtemp()); (_kr / 'val2014').mkdir()
for _n in ('a', 'b'): Image.new('RGB', (8, 8)).save(_kr / 'val2014' / f'{_n}.jpg')
(_kr / 'coco_test_karpathy.json').write_text(json.dumps(dict(images=[dict(id=1, file_name='a.jpg'), dict(id=2, file_name='b.jpg'), dict(id=3, file_name='c.jpg')],
    annotations=[dict(image_id=1, caption='one '), dict(image_id=2, caption='two'), dict(image_id=1, caption='uno'), dict(image_id=3, caption='gone')])))
_r = load_coco_karpathy(_kr / 'coco_test_karpathy.json', _kr / 'val2014')
test_eq((_r.captions, _r.skipped), ([['one', 'uno'], ['two']], 1))
Image.new('RGB', (8, 8)).save(_kr / 'x.jpg')
(_kr / 'flickr8k_test_karpathy.txt').write_text('image,caption\nx.jpg,a dog, running\nx.jpg,a dog\n')
test_eq(load_flickr_karpathy(_kr / 'flickr8k_test_karpathy.txt', _kr).captions, [['a dog, running', 'a dog']])


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
    out = Path(out_dir); counts = {}
    for split in splits:
        paths, labels = cls.splits[split]
        (out / split).mkdir(parents=True, exist_ok=True)
        with tarfile.open(out / split / '0.tar', 'w') as tar:
            for i, (p, y) in enumerate(zip(paths, labels.tolist())):
                for ext, data in (('png', Path(p).read_bytes()), ('cls', str(y).encode())):
                    info = tarfile.TarInfo(f'{i:06d}.{ext}'); info.size = len(data); info.mtime = 0
                    tar.addfile(info, io.BytesIO(data))
        (out / split / 'nshards.txt').write_text('1\n')
        counts[split] = len(paths)
    (out / 'classnames.txt').write_text('\n'.join(cls.classnames) + '\n')
    (out / 'zeroshot_classification_templates.txt').write_text('\n'.join(cls.templates) + '\n')
    return counts

WORLD_TEMPLATES = ('a photo of a {c}.', 'a {c}.')

def write_world_classification(out_dir, n: dict | None = None, attribute: str = 'shape', cfg: WorldConfig | None = None) -> dict:
    "Single-object scenes of the world `cfg` labelled by `attribute` ('shape' | 'colour') -> `out_dir/classification.json`; returns counts."
    if attribute not in ('shape', 'colour'): raise ValueError(f"attribute must be 'shape' or 'colour', got {attribute!r}")
    out = Path(out_dir); (out / 'cls_images').mkdir(parents=True, exist_ok=True)
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
    (out / 'classification.json').write_text(json.dumps(dict(classnames=classes, templates=list(WORLD_TEMPLATES), splits=splits,
                                                             attribute=attribute, world_config=asdict(cfg)), indent=1))
    return {k: len(v) for k, v in splits.items()}

def write_world_winoground(out_dir, n_pairs: int = 50, cfg: WorldConfig | None = None) -> int:
    """Winoground-format pairs of world scenes (split 'val') under `out_dir/data/`; returns the number of pairs. Two
    random scenes make a pair: unlike Winoground the two captions are not word permutations of each other, so the
    score is no compositionality measure (the world's hard negatives are)."""
    out = Path(out_dir); (out / 'data' / 'images').mkdir(parents=True, exist_ok=True)
    cfg, rows = cfg or WorldConfig(), []
    for k in range(n_pairs):
        a, b = generate(cfg, 2 * k, 'val'), generate(cfg, 2 * k + 1, 'val')
        if a['text'] == b['text']: continue      # a pair needs two different captions
        for j, s in enumerate((a, b)): Image.fromarray(s['image']).save(out / 'data' / 'images' / f'wg_{k}_{j}.png')
        rows.append(dict(id=k, image_0=f'wg_{k}_0', image_1=f'wg_{k}_1', caption_0=a['text'], caption_1=b['text']))
    (out / 'data' / 'examples.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
    return len(rows)

def _world_scenes(out: Path, cfg: WorldConfig, n_images: int, split: str, captions_per_image: int) -> dict:
    "Images, hard negatives, retrieval list, scenes and gold trees of `n_images` scenes; returns their counts."
    (out / 'images').mkdir(parents=True, exist_ok=True); (out / 'data').mkdir(exist_ok=True)
    sugar = {k: {} for k in NEGATIVE_KINDS}
    retrieval, scenes, parses, seen = [], {}, {}, set()
    dropped_captions = skipped_images = 0
    for i in range(n_images):
        b = benchmark_scene(cfg, i, split, captions_per_image)
        s, fname = b['sample'], f'world_{i:06d}.png'
        Image.fromarray(s['image']).save(out / 'images' / fname)
        scenes[fname] = dict(index=i, split=split, caption=s['text'], tree=s['parsed'].to_dict(), scene=s['scene'].to_dict(),
                             order=s['order'], masks=s['masks'][s['mask_valid']].astype(int).tolist())
        parses[s['text']] = s['parsed'].to_dict()
        for kind, neg in b['negatives'].items():
            parses[neg.text] = neg.to_dict()
            sugar[kind][str(len(sugar[kind]))] = dict(filename=fname, caption=s['text'], negative_caption=neg.text)
        caps = []
        for c in b['captions']:
            if c.text in seen: dropped_captions += 1; continue
            seen.add(c.text); caps.append(c.text); parses[c.text] = c.to_dict()
        if caps: retrieval.append(dict(image=fname, caption=caps))
        else: skipped_images += 1
    def dump(obj, name): (out / name).write_text(json.dumps(obj, indent=1))
    for kind, items in sugar.items(): dump(items, f'data/{kind}.json')
    dump(retrieval, 'retrieval.json'); dump(scenes, 'scenes.json'); dump(parses, 'parses.json')
    return dict(sugarcrepe={k: len(v) for k, v in sugar.items()},
                retrieval_images=len(retrieval), retrieval_captions=sum(len(r['caption']) for r in retrieval),
                retrieval_dropped_duplicate_captions=dropped_captions, retrieval_skipped_images=skipped_images)

def write_world_benchmark(out_dir, n_images: int = 100, cfg: WorldConfig | None = None, split: str = 'test',
                          extras: bool = True, captions_per_image: int = 2) -> dict:
    """The world's benchmark folder (see above) of `n_images` scenes of `split`; `extras`: also the classification
    set, its webdataset export and the Winoground-format pairs. Returns the summary (also `summary.json`); a folder
    that already holds this request is left as it is."""
    cfg, out = cfg or WorldConfig(), Path(out_dir)
    request = json.loads(json.dumps(dict(n_images=n_images, split=split, extras=extras, captions_per_image=captions_per_image,
                                         config=asdict(cfg))))
    if (out / 'summary.json').is_file():
        old = json.loads((out / 'summary.json').read_text())
        if old.get('request') == request: return old
    out.mkdir(parents=True, exist_ok=True)
    summary = dict(n_images=n_images, split=split, **_world_scenes(out, cfg, n_images, split, captions_per_image))
    if extras:
        summary['classification'] = write_world_classification(out, dict(train=n_images, val=n_images // 2, test=n_images), cfg=cfg)
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
from powerclip.world import Scene, caption_truth, render, spec_from_text
tmp = Path(tempfile.mkdtemp())
world_summary = write_world_benchmark(tmp / 'world', n_images=60)
cfg = WorldConfig()
ret = load_retrieval(tmp / 'world' / 'retrieval.json')
sc, sc_skipped = load_sugarcrepe(tmp / 'world')
cls = load_classification(tmp / 'world')
wg = load_winoground(tmp / 'world')
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
        assert caption_truth(spec_from_text(cap, cfg), scene, cfg) is True and caption_truth(spec_from_text(neg, cfg), scene, cfg) is False
        assert ParsedCaption.from_dict(parses[neg]).text == neg
texts, _ = ret.flat()
test_eq(len(texts), len(set(texts))); assert all(t in parses for t in texts)
_mtime = (tmp / 'world' / 'retrieval.json').stat().st_mtime_ns
test_eq(write_world_benchmark(tmp / 'world', n_images=60), world_summary)                      # the same request: nothing written
test_eq((tmp / 'world' / 'retrieval.json').stat().st_mtime_ns, _mtime)
test_fail(lambda: load_winoground(tmp / 'nowhere'), contains='data/examples.jsonl')
test_fail(lambda: load_sugarcrepe(tmp / 'nowhere'), contains='sugar-crepe')
{k: v for k, v in world_summary.items() if k != 'request'}, cls.classnames, len(wg)

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
    test_eq(set(next(iter(real.values()))), set(json.loads((tmp / 'world' / 'data' / 'swap_att.json').read_text())['0']))
    print({c: len(v) for c, v in coco_sc.items()}, 'full benchmark kept', sum(map(len, full_sc.values())), 'skipped', sum(full_skipped.values()))
else: print('skipped: ../shared/data is absent')
