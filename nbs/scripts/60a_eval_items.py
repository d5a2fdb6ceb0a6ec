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
#| default_exp eval.items

# %%
#| export
from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image, ImageFile

from powerclip.data import to_rgb
from powerclip.parsing import caption_problem

log = logging.getLogger(__name__)

# %%
#| hide
import tempfile
from fastcore.test import test_eq, test_fail


# %% [markdown]
# # Bad benchmark items
#
# > The two errors of the benchmark readers, and the bad items they skip, count and name instead.
#
# The readers of `61_eval_data` and `61a_eval_region_data` stop on a data set that is not there or not in its format,
# and skip, one by one, the items inside it that cannot be scored. This notebook holds what they share: the two
# errors, the record of the skipped items, and the checks of one image file and one caption.
#
# A missing data set (or one of its files) raises `MissingData`, whose message names the files to put where (nothing
# is ever downloaded); a file that cannot be read as its format raises `BadData`, one line naming the file.

# %%
#| export
class MissingData(FileNotFoundError):
    "A data set (or one of its files) is absent; the message says what to put where (nothing is downloaded)."

class BadData(ValueError):
    "A data file that cannot be read as its format, or (strict mode) a bad item: one line naming the file."


# %% [markdown]
# Real folders hold broken files. Every reader checks each item before the model sees it, and drops what cannot be
# scored, recording **why** and **which file**:
#
# | reason | what |
# |---|---|
# | `missing_image` | the image file named by the annotations is not there (e.g. the full SugarCrepe text with a subset of the photos) |
# | `bad_image` | the file does not decode: truncated, scrambled, zero bytes, not an image |
# | `bad_caption` | a caption that `parsing.caption_problem` refuses (null, not a string, empty, no letter or digit): the rule training uses |
# | `bad_negative` | a SugarCrepe item whose negative caption is refused by the same rule |
# | `no_caption` | an image left without any usable caption: dropped from retrieval |
# | `bad_region` | a region annotation whose box is not `[x, y, w, h]` of finite numbers, or lies outside its image, or whose area is not a number |
# | `bad_polygon` | a polygon segmentation that cannot be drawn: a flat list, an odd number of coordinates, a coordinate that is not a finite number |
# | `bad_rle` | an RLE segmentation that cannot be decoded: a size that is not the image's, counts that are not non-negative integers summing to height x width, a compressed string that does not parse |
# | `degenerate` | a region with nothing to see: an empty segmentation, polygons that enclose no area (a one-point polygon), an RLE without a foreground pixel, a box without width or height, an area of 0 |
# | `unknown_category` | a region whose category id the file's `categories` do not list |
# | `crowd_region` | a COCO crowd region (`iscrowd`: many objects in one mask; COCO's evaluation ignores them too) |
# | `outside_vocabulary` | a region of a category outside the chosen vocabulary (OV-COCO's 65 classes leave out 15 of COCO's 80) |
# | `outside_view` | a region the model does not see (outside the centred square its preprocessing crops) |
#
# **Retrieval's ground truth stays consistent.** A bad caption is removed from its image's list; an image whose
# captions are all bad is dropped (`no_caption`), not kept as a text→image distractor, so every image in the set has
# a caption and both directions score the same images (and `chance_recall`'s formula applies when every image keeps
# the same number). A SugarCrepe or Winoground item needs all its parts: any bad part drops the item.
#
# `ItemSkips` holds the records; its `report()` goes into the result JSON (`skipped_items`: counts per reason and the
# items, file and detail, up to 100 names per reason). With `strict=True` the first bad item raises `BadData`
# instead, one line naming the file and the reason. Images are checked by decoding them fully (PIL's `load()`,
# JPEGs at reduced DCT scale, which still reads every byte), with truncated images never padded, and the verdict is
# memoised per (file, size, mtime): the world folder checked once serves every run of the comparison.

# %%
#| export
ITEM_SKIP_REASONS = ('missing_image', 'bad_image', 'bad_caption', 'bad_negative', 'no_caption', 'bad_region',
                     'bad_polygon', 'bad_rle', 'degenerate', 'unknown_category', 'crowd_region', 'outside_vocabulary',
                     'outside_view')

@dataclass
class ItemSkips:
    """The items a reader dropped, `(reason, file, detail, group)` each; `strict`: the first one raises `BadData`
    instead."""
    strict: bool = False
    items: list = field(default_factory=list)

    def add(self, reason: str, file, detail: str = '', group: str | None = None):
        if reason not in ITEM_SKIP_REASONS:
            raise ValueError(f'unknown skip reason {reason!r}; known: {ITEM_SKIP_REASONS}')
        if self.strict:
            raise BadData(f'{file}: {reason.replace("_", " ")}' + (f' ({detail})' if detail else '') + ' [strict mode]')
        self.items.append((reason, str(file), detail, group))

    def __len__(self): return len(self.items)

    def count(self, group: str | None = None) -> int:
        "Items dropped (of `group`: a SugarCrepe category, a classification split)."
        return sum(1 for it in self.items if group is None or it[3] == group)

    def counts(self) -> dict[str, int]:
        "`{reason: n}` of the reasons that occur, in `ITEM_SKIP_REASONS` order."
        n = {r: 0 for r in ITEM_SKIP_REASONS}
        for it in self.items:
            n[it[0]] += 1
        return {r: k for r, k in n.items() if k}

    def report(self, names: int = 100) -> dict:
        """What the result JSON records: `n`, `counts` per reason, `items` (reason, file, detail, group; `names` per
        reason at most), `items_left_out`."""
        kept, per = [], {}
        for r, f, d, g in self.items:
            per[r] = per.get(r, 0) + 1
            if per[r] <= names:
                kept.append(dict(reason=r, file=f, detail=d, **({'group': g} if g is not None else {})))
        return dict(n=len(self), counts=self.counts(), items=kept, items_left_out=len(self) - len(kept))

    def log(self, what: str, total: int | None = None):
        if not self.items:
            return
        r, f, d, _ = self.items[0]
        among = f' in {total} items' if total is not None else ''
        log.warning('%s: %d bad parts skipped%s (%s); first: %s %s (%s)', what, len(self), among,
                    ', '.join(f'{k} {v}' for k, v in self.counts().items()), r, f, d)

@functools.lru_cache(maxsize=1 << 20)
def _decode_problem(path: str, size: int, mtime_ns: int) -> str | None:
    "Why the image file at `path` (of this size and mtime: the memo's key) does not decode; None if it does."
    if size == 0:
        return 'zero bytes'
    # a truncated file is bad, never padded
    truncated, ImageFile.LOAD_TRUNCATED_IMAGES = ImageFile.LOAD_TRUNCATED_IMAGES, False
    try:
        with Image.open(path) as im:
            im.draft('RGB', (64, 64))        # JPEG: decode at 1/8 scale; every byte of the stream is still read
            im.load()
            to_rgb(im)                       # by value (16-bit scaled); an image of no known range is bad
    except Exception as e:                   # PIL raises OSError, SyntaxError, ValueError, DecompressionBombError ..
        return f'{type(e).__name__}: {e}'.replace(path, Path(path).name)
    finally:
        ImageFile.LOAD_TRUNCATED_IMAGES = truncated
    return None

def image_problem(path) -> tuple[str, str] | None:
    "`('missing_image' | 'bad_image', detail)` when the image file cannot be scored, None when it decodes."
    p = Path(path)
    if not p.is_file():
        return 'missing_image', 'no such file'
    st = p.stat()
    bad = _decode_problem(str(p.resolve()), st.st_size, st.st_mtime_ns)
    return None if bad is None else ('bad_image', bad)

def read_image(path) -> Image.Image:
    """An image file as 8-bit RGB, converted by value (`powerclip.data.to_rgb`); a file that does not decode raises
    `BadData` naming it (not PIL's message alone)."""
    try:
        with Image.open(path) as im:
            return to_rgb(im)                # by value: a 16-bit image scaled to 8 bits, not clipped white
    except FileNotFoundError:
        raise MissingData(f'image file not found: {path}') from None
    except Exception as e:
        raise BadData(f'{path}: bad image ({type(e).__name__}: {e})') from None

def check_image(path, skips: ItemSkips, group: str | None = None) -> bool:
    "True if the image decodes; else the problem goes into `skips`."
    bad = image_problem(path)
    if bad:
        skips.add(bad[0], path, bad[1], group)
    return bad is None

def check_caption(text, skips: ItemSkips, file, what: str = 'caption', reason: str = 'bad_caption',
                  group: str | None = None) -> bool:
    "True if `text` is a usable caption (`parsing.caption_problem`); else the problem goes into `skips`, under `file`."
    why = caption_problem(text)
    if why:
        skips.add(reason, file,
                  f'{what}: {why}' + ('' if isinstance(text, str) or text is None else f' ({text!r:.40})'), group)
    return why is None

def _read_json(path: Path, jsonl: bool = False):
    "A JSON (or JSON-lines) file; one that does not parse raises `BadData` naming it and the line."
    text = path.read_text(encoding='utf-8', errors='replace')
    try:
        if not jsonl:
            return json.loads(text)
        return [json.loads(l) for l in text.splitlines() if l.strip()]
    except json.JSONDecodeError as e:
        raise BadData(f'{path}: not valid JSON{"-lines" if jsonl else ""} ({e})') from None

def _field(row, key: str, path: Path, what: str):
    "`row[key]`, or a `BadData` that names the file and says what a row should hold."
    if not isinstance(row, dict) or key not in row:
        raise BadData(f'{path}: an item without {key!r} ({what}); got {str(row)[:80]}')
    return row[key]


# %% [markdown]
# An image that decodes, one that is not there, one of zero bytes and one cut short; captions that the training rule
# takes and refuses; the record, its report, strict mode, and the two errors of the file readers.

# %%
_scratch = tempfile.TemporaryDirectory(prefix="powerclip-nb-")  # holds every scratch folder below; see the last cell
_d = Path(tempfile.mkdtemp(dir=_scratch.name))
Image.new('RGB', (8, 8), 'red').save(_d / 'ok.png')
(_d / 'empty.jpg').write_bytes(b'')
(_d / 'cut.png').write_bytes((_d / 'ok.png').read_bytes()[:40])
test_eq(image_problem(_d / 'ok.png'), None)
test_eq(image_problem(_d / 'nope.jpg'), ('missing_image', 'no such file'))
test_eq(image_problem(_d / 'empty.jpg'), ('bad_image', 'zero bytes'))
test_eq(image_problem(_d / 'cut.png')[0], 'bad_image')
test_eq(read_image(_d / 'ok.png').size, (8, 8))
test_fail(lambda: read_image(_d / 'nope.jpg'), contains='image file not found')
test_fail(lambda: read_image(_d / 'cut.png'), contains='cut.png: bad image')

sk = ItemSkips()
assert check_image(_d / 'ok.png', sk) and not check_image(_d / 'nope.jpg', sk, group='swap_obj')
assert check_caption('a red circle', sk, 'a.json') and not check_caption('', sk, 'a.json')
assert not check_caption(None, sk, 'b.json', what='negative caption', reason='bad_negative', group='swap_obj')
test_eq(sk.counts(), {'missing_image': 1, 'bad_caption': 1, 'bad_negative': 1})
test_eq((len(sk), sk.count(), sk.count('swap_obj')), (3, 3, 2))
_rep = sk.report(names=1)
test_eq((_rep['n'], len(_rep['items']), _rep['items_left_out']), (3, 3, 0))
test_eq(_rep['items'][0],
        dict(reason='missing_image', file=str(_d / 'nope.jpg'), detail='no such file', group='swap_obj'))
sk.add('bad_caption', 'c.json', 'caption: empty')
test_eq(sk.report(names=1)['items_left_out'], 1)                 # one name per reason kept: the second bad caption
test_fail(lambda: sk.add('no_such_reason', 'x.jpg'), contains='unknown skip reason')
test_fail(lambda: ItemSkips(strict=True).add('bad_image', 'x.jpg', 'zero bytes'),
          contains='x.jpg: bad image (zero bytes) [strict mode]')

(_d / 'bad.json').write_text('{"images": ')
test_fail(lambda: _read_json(_d / 'bad.json'), contains='not valid JSON')
(_d / 'rows.jsonl').write_text('{"image": "a.jpg"}\n\n{"image": "b.jpg"}\n')
test_eq(_read_json(_d / 'rows.jsonl', jsonl=True), [{'image': 'a.jpg'}, {'image': 'b.jpg'}])
test_eq(_field({'image': 'a.jpg'}, 'image', _d / 'r.json', 'an image file'), 'a.jpg')
test_fail(lambda: _field({'image': 'a.jpg'}, 'caption', _d / 'r.json', 'a list of captions'),
          contains="without 'caption'")

# %% [markdown]
# Every scratch folder made above lives under one temporary folder, removed here, so running the notebook
# leaves nothing behind (a training run's checkpoints take hundreds of MB).

# %%
_scratch.cleanup()
