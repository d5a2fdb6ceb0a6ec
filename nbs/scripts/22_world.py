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
#| default_exp world

# %%
#| export
from __future__ import annotations
import functools, itertools, json, math, operator
from dataclasses import dataclass, field, asdict
from statistics import NormalDist

import numpy as np
import torch

from powerclip.parsing import ParsedCaption

# %%
import os, time
from IPython.display import Markdown, display
import matplotlib.pyplot as plt
from fastcore.test import test_eq, test_fail


# %% [markdown]
# # A built-in compositional world
#
# > Procedural scenes of coloured shapes with captions from a tiny grammar, gold trees and masks, hard negatives
#
# The gold parse trees come with the captions, the gold object masks are on the patch grid, and the hard negatives are
# SugarCrepe-style.

# %% [markdown]
# PowerCLIP aligns **sets of image regions** with **nodes of a caption's parse tree**. To see whether that
# helps, we want data where we *know* the answer: which words go with which pixels, and which captions are
# false for an image only because of how their words are bound together. Real photos cannot give us that,
# and they cost a download. This notebook builds a small world that can:
#
# - a **scene** is 1 to 3 non-overlapping objects, each a *shape* (the noun), a *colour* and a *size*
#   (the adjectives), at a position; it renders to a 64 x 64 image with numpy, and each object has its gold
#   pixel mask;
# - its **caption** comes from a grammar, so its constituency tree is known exactly (`parser='gold'`):
#
#   `(NP (NP a small red circle) (PP left of (NP (NP a large blue square) and (NP a green triangle))))`
#
# - the **meaning** of a caption is checked against the scene, so every positive caption is true and every
#   hard negative (swapped attributes, swapped objects, a replaced word, an added object or attribute, a
#   replaced relation) is *false* for its image;
# - everything is a pure function of `(seed, split, index)`: a data-loader worker makes thousands of samples
#   per second, any sample can be made again (exact resume), and nothing is downloaded.
#
# The split written to disk has the format of the real SugarCrepe benchmark, so the evaluation code reads both.

# %% [markdown]
# ## Configuration
#
# Shapes are predicates on pixel offsets `(dx, dy)` from the object's centre, all inscribed in the circle of the
# object's radius `r`; that circle is what the no-occlusion rule keeps apart. Colours are RGB triples far from the
# dark, noisy background.

# %%
#| export
def _circle(dx, dy, r): return dx * dx + dy * dy <= r * r
def _square(dx, dy, r): return np.maximum(np.abs(dx), np.abs(dy)) <= r / math.sqrt(2)
def _diamond(dx, dy, r): return np.abs(dx) + np.abs(dy) <= r
def _triangle(dx, dy, r):
    "Equilateral, pointing up, vertices on the circle of radius `r` (y grows downwards)."
    s3 = math.sqrt(3)
    return (dy <= r / 2) & (s3 * dx - dy <= r) & (-s3 * dx - dy <= r)
def _cross(dx, dy, r):
    "A plus sign; arm length 0.94 r and half-width r/3 keep its corners inside the circle."
    a, w = 0.94 * r, r / 3
    adx, ady = np.abs(dx), np.abs(dy)
    return ((adx <= w) & (ady <= a)) | ((ady <= w) & (adx <= a))

SHAPE_FNS = dict(circle=_circle, square=_square, triangle=_triangle, diamond=_diamond, cross=_cross)
COLOURS = dict(red=(220, 50, 50), green=(50, 190, 70), blue=(60, 90, 235), yellow=(235, 220, 50),
               purple=(160, 70, 210), orange=(245, 150, 40), white=(235, 235, 235))
RELATIONS = ('left of', 'right of', 'above', 'below')
SPLITS = dict(train=0, val=1, test=2)  # each split is its own random stream, so splits never share a sample

# CLIP's image normalisation, equal to open_clip.constants.OPENAI_DATASET_MEAN/STD (tests/test_world.py checks);
# copied so that a data-loader worker does not pay the open_clip import.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


# %%
#| export
@dataclass
class WorldConfig:
    "Everything that defines the world; a run writes it next to its outputs."
    image_size: int = 64                # H = W in pixels
    patch_size: int = 8                 # ViT patch side: gold masks live on the (image_size // patch_size)^2 grid
    shapes: tuple = tuple(SHAPE_FNS)    # nouns; each a key of SHAPE_FNS
    colours: tuple = tuple(COLOURS)     # colour adjectives; each a key of COLOURS
    sizes: dict = field(default_factory=lambda: dict(small=0.1, large=0.19))  # size adjective -> radius / image_size
    min_objects: int = 1                # objects per scene, drawn uniformly in [min_objects, max_objects]
    max_objects: int = 3
    relations: tuple = RELATIONS        # spatial prepositions a caption may use (a subset of RELATIONS)
    relation_margin: float = 0.15       # 'a left of b' is true when b's centre is >= margin * image_size to the right
                                        # of a's, false when it is >= that far to the left; in between: never said
    gap: float = 1.0                    # pixels between the circles of two objects: no object hides another
    background: float = 40.0            # grey level of the background
    noise: float = 10.0                 # std of the Gaussian noise on the background (grey levels)
    colour_jitter: int = 10             # an object's colour moves by up to this much per channel (uniform integers)
    size_prob: float = 0.7              # probability that a training caption names an object's size
    patch_threshold: float = 0.25       # a patch belongs to an object's gold mask when the object covers this
                                        # fraction of it (the patch holding most of the object always does)
    num_regions: int | None = None      # M rows of the gold masks; None -> max_objects; extra rows are padding
    max_tries: int = 200                # rejection-sampling attempts per scene before a clear error
    caption: str = 'short'              # 'short': one sentence (the default); 'long': several (`describe_long`)
    seed: int = 0                       # with (split, index) it fixes every sample

    def __post_init__(self):
        self.shapes, self.colours, self.relations = tuple(self.shapes), tuple(self.colours), tuple(self.relations)
        bad = [s for s in self.shapes if s not in SHAPE_FNS] + [c for c in self.colours if c not in COLOURS] \
            + [r for r in self.relations if r not in RELATIONS]
        if bad:
            raise ValueError(f'unknown shapes/colours/relations {bad}; known: {list(SHAPE_FNS)}, '
                             f'{list(COLOURS)}, {RELATIONS}')
        if self.image_size % self.patch_size:
            raise ValueError(f'image_size {self.image_size} is not a multiple of patch_size {self.patch_size}')
        if not 1 <= self.min_objects <= self.max_objects:
            raise ValueError(f'need 1 <= min_objects <= max_objects, got {self.min_objects}, {self.max_objects}')
        if self.max_objects > len(self.shapes) * len(self.colours):
            raise ValueError('fewer (shape, colour) pairs than max_objects')
        if self.max_objects > 1 and not self.relations:
            raise ValueError('scenes with several objects need at least one relation')
        if self.M < self.max_objects:
            raise ValueError(f'num_regions {self.num_regions} < max_objects {self.max_objects}')
        if not self.sizes:
            raise ValueError('need at least one size')
        if self.caption not in ('short', 'long'):
            raise ValueError(f"caption must be 'short' or 'long', got {self.caption!r}")
        bad = {k: v for k, v in self.sizes.items() if not (isinstance(v, (int, float)) and 0 < v <= 0.5)}
        if bad:   # a radius as a share of the image: below 0 it used to fail at drawing ("could not broadcast")
            raise ValueError(f'sizes {bad}: each is a radius / image_size in (0, 0.5]')
        if not (isinstance(self.max_tries, int) and self.max_tries >= 1):
            raise ValueError(f'max_tries: must be an integer at least 1, got {self.max_tries!r}')

    @property
    def M(self) -> int: return self.num_regions or self.max_objects
    @property
    def grid(self) -> int: return self.image_size // self.patch_size
    @property
    def margin_px(self) -> float: return self.relation_margin * self.image_size


# %%
cfg = WorldConfig()
test_eq((cfg.M, cfg.grid, cfg.margin_px), (3, 8, 0.15 * 64))
test_fail(lambda: WorldConfig(shapes=('circle', 'hexagon')), contains='hexagon')
test_fail(lambda: WorldConfig(image_size=60), contains='multiple')
test_fail(lambda: WorldConfig(num_regions=2), contains='num_regions')
assert json.loads(json.dumps(asdict(cfg)))['sizes'] == dict(small=0.1, large=0.19)


# %% [markdown]
# ## Scenes and their rendering
#
# A scene stores its objects and the seed of its background noise, so `render` is a pure function of the scene:
# the image, and one gold pixel mask per object. Objects never overlap (their circles stay `gap` pixels apart),
# so each mask is the whole shape and the masks are disjoint.

# %%
#| export
@dataclass
class WorldObject:
    "One object of a scene; (cx, cy) in pixels, x to the right and y downwards."
    shape: str
    colour: str
    size: str
    cx: float
    cy: float
    radius: float                        # pixels; the shape is inscribed in this circle
    rgb: tuple                           # the colour actually painted (jittered)

@dataclass
class Scene:
    objects: list                        # list[WorldObject]
    noise_seed: int                      # seed of the background noise
    image_size: int = 64

    def to_dict(self) -> dict:
        return dict(objects=[asdict(o) for o in self.objects], noise_seed=self.noise_seed, image_size=self.image_size)
    @classmethod
    def from_dict(cls, d: dict) -> 'Scene':
        return cls([WorldObject(**{**o, 'rgb': tuple(o['rgb'])}) for o in d['objects']], d['noise_seed'],
                   d['image_size'])

@functools.lru_cache(maxsize=16)
def _noise_lut(background: float, noise: float) -> np.ndarray:
    "(256,) uint8: random byte -> background + Gaussian noise, the byte read as one of 256 equally likely quantiles."
    q = [NormalDist().inv_cdf((b + 0.5) / 256) for b in range(256)]
    return np.clip(np.rint(background + noise * np.array(q)), 0, 255).astype(np.uint8)

def render(scene: Scene, cfg: WorldConfig) -> tuple[np.ndarray, np.ndarray]:
    "Image (H, W, 3) uint8 and gold pixel masks (n_obj, H, W) bool of `scene`."
    S = scene.image_size
    # random bytes through a quantile table: Gaussian noise at a fraction of the cost of drawing normals
    noise = np.frombuffer(np.random.default_rng(scene.noise_seed).bytes(S * S * 3), np.uint8).reshape(S, S, 3)
    img = _noise_lut(cfg.background, cfg.noise)[noise]                                    # (H, W, 3)
    masks = np.zeros((len(scene.objects), S, S), dtype=bool)                              # (n_obj, H, W)
    for k, o in enumerate(scene.objects):
        # only the object's bounding box is evaluated: that is what makes rendering fast
        x0, x1 = max(int(o.cx - o.radius), 0), min(int(o.cx + o.radius) + 2, S)
        y0, y1 = max(int(o.cy - o.radius), 0), min(int(o.cy + o.radius) + 2, S)
        dx = (np.arange(x0, x1, dtype=np.float32) + 0.5 - o.cx)[None, :]   # pixel centres, (1, w)
        dy = (np.arange(y0, y1, dtype=np.float32) + 0.5 - o.cy)[:, None]   # (h, 1)
        m = SHAPE_FNS[o.shape](dx, dy, o.radius)                            # (h, w)
        masks[k, y0:y1, x0:x1] = m
        img[y0:y1, x0:x1][m] = o.rgb
    return img, masks


# %% [markdown]
# Sampling draws the number of objects, distinct (shape, colour) pairs, sizes, and positions; a position that
# brings two circles closer than `gap` is drawn again. A layout is kept only if some object stands in one of the
# relations to *all* the others with the margin, because that is what every multi-object caption says.

# %%
#| export
def relation_value(a: WorldObject, b: WorldObject, rel: str) -> float:
    "Signed displacement in pixels: positive when 'a `rel` b' holds."
    if rel == 'left of':
        return b.cx - a.cx
    if rel == 'right of':
        return a.cx - b.cx
    if rel == 'above':
        return b.cy - a.cy       # y grows downwards
    if rel == 'below':
        return a.cy - b.cy
    raise ValueError(f'unknown relation {rel!r}')

def relation_truth(a: WorldObject, b: WorldObject, rel: str, margin: float) -> bool | None:
    "True / False when the displacement clears the margin one way or the other, None (ambiguous) in between."
    v = relation_value(a, b, rel)
    return True if v >= margin else False if v <= -margin else None

def anchors(scene: Scene, cfg: WorldConfig) -> list[tuple[int, str]]:
    "(object index, relation) pairs such that the object clearly stands in `relation` to every other object."
    objs = scene.objects
    return [(i, rel) for i in range(len(objs)) for rel in cfg.relations
            if all(relation_truth(objs[i], o, rel, cfg.margin_px) is True for j, o in enumerate(objs) if j != i)]


# %%
#| export
def sample_scene(cfg: WorldConfig, rng: np.random.Generator) -> Scene:
    "A random scene: `min_objects..max_objects` non-overlapping objects with distinct (shape, colour) pairs."
    S, n = cfg.image_size, int(rng.integers(cfg.min_objects, cfg.max_objects + 1))
    size_names = list(cfg.sizes)
    for _ in range(cfg.max_tries):
        pairs = rng.choice(len(cfg.shapes) * len(cfg.colours), size=n, replace=False)
        objs = []
        for p in pairs:
            shape, colour = cfg.shapes[p // len(cfg.colours)], cfg.colours[p % len(cfg.colours)]
            size = size_names[int(rng.integers(len(size_names)))]
            r = cfg.sizes[size] * S
            for _ in range(20):   # positions for this object; the first that keeps clear of the others
                cx, cy = rng.uniform(r, S - r, size=2)
                if all(math.hypot(cx - o.cx, cy - o.cy) >= r + o.radius + cfg.gap for o in objs):
                    break
            else:
                break
            jit = rng.integers(-cfg.colour_jitter, cfg.colour_jitter + 1, size=3)
            rgb = tuple(int(v) for v in np.clip(np.array(COLOURS[colour]) + jit, 0, 255))
            objs.append(WorldObject(shape, colour, size, float(cx), float(cy), float(r), rgb))
        if len(objs) < n:
            continue
        scene = Scene(objs, int(rng.integers(2**62)), S)
        if n == 1 or anchors(scene, cfg):
            return scene
    raise RuntimeError(f'no valid scene with {n} objects in {cfg.max_tries} tries: objects too large for image_size?')


# %%
scene = sample_scene(cfg, np.random.default_rng(3))
img, pix = render(scene, cfg)
test_eq((img.shape, img.dtype, pix.shape), ((64, 64, 3), np.uint8, (len(scene.objects), 64, 64)))
for _seed in range(200):   # gold masks are the rendering: non-empty, disjoint, painted exactly in the object's colour
    sc = sample_scene(cfg, np.random.default_rng(_seed))
    im, pm = render(sc, cfg)
    assert pm.any((1, 2)).all() and pm.sum(0).max() <= 1
    for o, m in zip(sc.objects, pm):
        assert (im[m] == o.rgb).all()
    assert len(sc.objects) == 1 or anchors(sc, cfg)
    assert Scene.from_dict(json.loads(json.dumps(sc.to_dict()))) == sc
# every shape stays inside its circle (the no-occlusion rule relies on it) and has a sensible area
_d = np.arange(-20, 20, dtype=np.float32) + 0.5
for name, fn in SHAPE_FNS.items():
    m = fn(_d[None], _d[:, None], 15.0)
    assert not (m & ~_circle(_d[None], _d[:, None], 15.0)).any(), name
    assert 0.35 < m.sum() / (math.pi * 15 ** 2) < 1.05, name


# %% [markdown]
# ## Captions: a grammar with a meaning
#
# A caption is a `CaptionSpec`: mentions of objects (each a shape, optionally a colour and a size) and, with two or
# more mentions, one relation. Its grammar and its meaning:
#
# | mentions | caption | true in a scene when |
# |---|---|---|
# | 1 | `a small red circle` | some object is a small red circle |
# | 2 | `A left of B` | distinct objects $a, b$ match A, B and $a$ is left of $b$ |
# | 3+ | `A left of B and C` | distinct $a, b, c$ match and $a$ is left of $b$ **and** of $c$ |
#
# The PP takes the coordinated NP as its object, so the gold tree and the meaning agree: the relation holds to every
# coordinated object. A caption's truth value in a scene is three-valued: `True` when some assignment of distinct
# objects to mentions makes every relation clearly true, `False` when every assignment has a clearly false relation
# (or none matches), `None` otherwise. Positives must be `True`, hard negatives `False`, so an ambiguous relation is
# never used for either.

# %%
#| export
@dataclass(frozen=True)
class Mention:
    shape: str
    colour: str | None = None            # None: the caption does not say
    size: str | None = None

@dataclass(frozen=True)
class CaptionSpec:
    mentions: tuple                      # tuple[Mention]; mentions[0] is the subject
    relation: str | None = None          # None iff there is one mention

def matches(m: Mention, o: WorldObject) -> bool:
    return m.shape == o.shape and m.colour in (None, o.colour) and m.size in (None, o.size)

def caption_truth(spec: CaptionSpec, scene: Scene, cfg: WorldConfig) -> bool | None:
    "Three-valued truth of `spec` in `scene` (see the table above)."
    objs, out = scene.objects, False
    for perm in itertools.permutations(range(len(objs)), len(spec.mentions)):
        if not all(matches(m, objs[k]) for m, k in zip(spec.mentions, perm)):
            continue
        vals = [relation_truth(objs[perm[0]], objs[k], spec.relation, cfg.margin_px) for k in perm[1:]]
        if all(v is True for v in vals):
            return True
        if False not in vals:
            out = None
    return out


# %%
#| export
def mention_words(m: Mention) -> list[str]:
    "'a small red circle'; 'an orange square'."
    body = [w for w in (m.size, m.colour, m.shape) if w]
    return ['an' if body[0][0] in 'aeiou' else 'a'] + body

def caption_tree(spec: CaptionSpec) -> tuple[ParsedCaption, list[int]]:
    "The gold tree of `spec` and, per mention, the index of its NP node."
    words, spans, labels, nodes = [], [], [], []
    def add(label, start, end=None):
        spans.append((start, end))
        labels.append(label)
        return len(spans) - 1
    def np_(m):
        k = add('NP', len(words))
        words.extend(mention_words(m))
        spans[k] = (spans[k][0], len(words))
        nodes.append(k)
    if len(spec.mentions) == 1:
        np_(spec.mentions[0])
    else:
        root = add('NP', 0)
        np_(spec.mentions[0])
        pp = add('PP', len(words))
        words.extend(spec.relation.split())
        co = add('NP', len(words)) if len(spec.mentions) > 2 else None   # coordination: (NP (NP B) and (NP C))
        for i, m in enumerate(spec.mentions[1:]):
            if i:
                words.append('and')
            np_(m)
        for k in (root, pp, co):
            if k is not None:
                spans[k] = (spans[k][0], len(words))
    text = ' '.join(words)
    return ParsedCaption(text, words, spans, labels, 'gold'), nodes

def caption_text(spec: CaptionSpec) -> str: return caption_tree(spec)[0].text

def spec_from_text(text: str, cfg: WorldConfig) -> CaptionSpec:
    "The inverse of `caption_text` for captions of this grammar (so that text read from disk can be checked)."
    words, i = text.split(), 0
    def take(vocab):
        nonlocal i
        if i < len(words) and words[i] in vocab:
            i += 1
            return words[i - 1]
    def mention():
        if not take(('a', 'an')):
            raise ValueError(f'expected a/an at word {i} of {text!r}')
        size, colour, shape = take(cfg.sizes), take(cfg.colours), take(cfg.shapes)
        if shape is None:
            raise ValueError(f'expected a shape at word {i} of {text!r}')
        return Mention(shape, colour, size)
    ms, rel = [mention()], None
    if i < len(words):
        rel = next((r for r in cfg.relations if words[i:i + len(r.split())] == r.split()), None)
        if rel is None:
            raise ValueError(f'expected a relation at word {i} of {text!r}')
        i += len(rel.split())
        ms.append(mention())
        while i < len(words):
            if not take(('and',)):
                raise ValueError(f'expected "and" at word {i} of {text!r}')
            ms.append(mention())
    return CaptionSpec(tuple(ms), rel)


# %%
from powerclip.parsing import draw_tree, to_nltk_tree, tree_problems
def bracket(p: ParsedCaption) -> str: return to_nltk_tree(p).pformat(margin=10 ** 6)

_m = [Mention('circle', 'red', 'small'), Mention('square', 'blue', 'large'), Mention('triangle', 'green')]
p, nodes = caption_tree(CaptionSpec(tuple(_m), 'left of'))
test_eq(p.text, 'a small red circle left of a large blue square and a green triangle')
test_eq(bracket(p), '(NP (NP a small red circle) (PP left of (NP (NP a large blue square) and (NP a green triangle))))')
test_eq([p.words[slice(*p.spans[k])] for k in nodes],
        [['a', 'small', 'red', 'circle'], ['a', 'large', 'blue', 'square'], ['a', 'green', 'triangle']])
test_eq(caption_text(CaptionSpec((Mention('circle', 'orange'),))), 'an orange circle')
p1, n1 = caption_tree(CaptionSpec((Mention('cross', 'white', 'large'),)))
test_eq((p1.spans, p1.labels, p1.parser, n1), ([(0, 4)], ['NP'], 'gold', [0]))
test_eq(bracket(caption_tree(CaptionSpec(tuple(_m[:2]), 'above'))[0]),
        '(NP (NP a small red circle) (PP above (NP a large blue square)))')
for _spec in [CaptionSpec(tuple(_m), 'left of'), CaptionSpec(tuple(_m[:2]), 'below'),
              CaptionSpec((Mention('cross', 'orange'),))]:
    test_eq(spec_from_text(caption_text(_spec), cfg), _spec)
test_fail(lambda: spec_from_text('a red circle near a blue square', cfg), contains='relation')
test_fail(lambda: spec_from_text('a red', cfg), contains='shape')
assert not tree_problems(p) and not tree_problems(p1)   # a proper tree by the rules of 20_parsing


# %% [markdown]
# The meaning, on a hand-made scene: a red circle at x=10, a blue square at x=40 and a green triangle at x=43
# (3 px from the square: neither left nor right of it, with the 9.6 px margin).

# %%
def _obj(shape, colour, size, cx, cy): return WorldObject(shape, colour, size, cx, cy, 6.0, COLOURS[colour])
hand = Scene([_obj('circle', 'red', 'small', 10, 20), _obj('square', 'blue', 'large', 40, 20),
              _obj('triangle', 'green', 'small', 43, 50)], 0)
def truth(*ms, rel=None): return caption_truth(CaptionSpec(tuple(Mention(*m) for m in ms), rel), hand, cfg)
test_eq(truth(('circle', 'red')), True)
test_eq(truth(('circle', 'blue')), False)
test_eq(truth(('circle', None, 'large')), False)
test_eq(truth(('circle', 'red'), ('square', 'blue'), rel='left of'), True)
test_eq(truth(('square', 'blue'), ('circle', 'red'), rel='left of'), False)              # swapped objects
test_eq(truth(('circle', 'red'), ('square', 'blue'), ('triangle',), rel='left of'), True)
test_eq(truth(('square',), ('triangle',), rel='left of'), None)                            # 3 px apart: ambiguous
# true for one, ambiguous for the other
test_eq(truth(('square',), ('circle',), ('triangle',), rel='right of'), None)
test_eq(truth(('circle',), ('circle',), rel='left of'), False)                             # needs two distinct circles
test_eq(anchors(hand, cfg), [(0, 'left of'), (2, 'below')])


# %% [markdown]
# A training caption names every object of the scene: the subject is an anchor (it stands in the relation to all
# other objects), the others follow in random order; the colour is always said, the size with probability
# `size_prob` (or always, for `full=True`, the retrieval captions).

# %%
#| export
def describe(scene: Scene, cfg: WorldConfig, rng: np.random.Generator,
             full: bool = False) -> tuple[CaptionSpec, list[int]]:
    "A true caption naming every object, and the scene index of the object of each mention."
    objs = scene.objects
    if len(objs) == 1:
        order, rel = [0], None
    else:
        cands = anchors(scene, cfg)
        a, rel = cands[int(rng.integers(len(cands)))]
        order = [a] + [int(j) for j in rng.permutation([j for j in range(len(objs)) if j != a])]
    ms = tuple(Mention(objs[k].shape, objs[k].colour, objs[k].size if full or rng.random() < cfg.size_prob else None)
               for k in order)
    return CaptionSpec(ms, rel), order


# %%
for _seed in range(300):
    _rng = np.random.default_rng(_seed)
    sc = sample_scene(cfg, _rng)
    spec, order = describe(sc, cfg, _rng)
    assert caption_truth(spec, sc, cfg) is True
    test_eq(sorted(order), list(range(len(sc.objects))))
    assert not tree_problems(caption_tree(spec)[0])
    assert all(matches(m, sc.objects[k]) for m, k in zip(spec.mentions, order))


# %% [markdown]
# ### Long captions
#
# With `caption='long'` a scene is described in several sentences, as the long captions FLAIR, DreamLIP or Long-CLIP
# train on: first one sentence per object with all its attributes (colour and size), in the order the short caption
# mentions them, then one sentence per pair of objects that stand in a clear relation (a relation drawn among those
# that hold; a pair in none, say two objects side by side within the margin, gets no sentence). Each sentence is a
# caption of the world's grammar and true of the scene (`caption_truth`). The caption's tree puts every sentence's
# nodes under one root over the whole text (`long_caption_tree`), so PowerCLIP aligns its regions with the phrases of
# every sentence; each object's region goes with the NP of its own sentence. A three-object scene reads, e.g., "a
# small red circle. a large blue square. a small green cross. a small red circle left of a large blue square. ...":
# about 45 CLIP tokens, more than `powerclip-demo`'s 32, hence the model `powerclip-demo-long` (`30_model`: the same
# architecture with a context of 64). Short captions stay the default, so every existing run and table is unchanged.

# %%
#| export
def describe_long(scene: Scene, cfg: WorldConfig, rng: np.random.Generator, order: list[int]) -> list[CaptionSpec]:
    """The sentences of a long caption (see above): each object in `order` with all its attributes, then each pair
    (in that order) in a relation that holds, drawn among those that do."""
    objs = scene.objects
    full = [Mention(objs[k].shape, objs[k].colour, objs[k].size) for k in order]
    specs = [CaptionSpec((m,)) for m in full]
    for i in range(len(order)):
        for j in range(i + 1, len(order)):
            rels = [r for r in cfg.relations if relation_truth(objs[order[i]], objs[order[j]], r, cfg.margin_px)]
            if rels:
                specs.append(CaptionSpec((full[i], full[j]), rels[int(rng.integers(len(rels)))]))
    return specs

def long_caption_tree(specs: list[CaptionSpec]) -> tuple[ParsedCaption, list[int]]:
    """One tree for the sentences `specs` ('. '-joined, a full stop at the end): every sentence's nodes under a root
    over all words (the sentence's own root when there is one sentence), and the NP node of each one-mention
    sentence."""
    trees = [caption_tree(sp) for sp in specs]
    text = '. '.join(t.text for t, _ in trees) + '.'
    words, spans, labels, nodes = [], [(0, 0)] if len(trees) > 1 else [], ['S'] if len(trees) > 1 else [], []
    for sp, (t, ns) in zip(specs, trees):
        off, base = len(words), len(spans)
        words += t.words
        spans += [(a + off, b + off) for a, b in t.spans]
        labels += t.labels
        if len(sp.mentions) == 1:
            nodes.append(base + ns[0])
    spans[0] = (0, len(words))
    return ParsedCaption(text, words, spans, labels, 'gold'), nodes


# %% [markdown]
# Every sentence is true of its scene and parses back to itself; the tree is a proper tree whose nodes are those of
# the sentences (plus the root), and the node of object $k$ spans its own sentence:

# %%
_nsent = []
for _seed in range(300):
    _rng = np.random.default_rng(_seed)
    sc = sample_scene(cfg, _rng)
    spec, order = describe(sc, cfg, _rng)
    specs = describe_long(sc, cfg, _rng, order)
    assert all(caption_truth(sp, sc, cfg) is True for sp in specs)
    assert all(spec_from_text(caption_text(sp), cfg) == sp for sp in specs)
    pc, nodes = long_caption_tree(specs)
    assert not tree_problems(pc)
    sents = pc.text[:-1].split('. ')
    test_eq(sents, [caption_text(sp) for sp in specs])
    test_eq(len(pc.spans), sum(len(caption_tree(sp)[0].spans) for sp in specs) + (len(specs) > 1))
    test_eq([' '.join(pc.words[slice(*pc.spans[k])]) for k in nodes], sents[:len(order)])
    _nsent.append(len(specs))
print('sentences per long caption:', sorted((n, _nsent.count(n)) for n in set(_nsent)))
test_fail(lambda: WorldConfig(caption='medium'), contains='caption')


# %% [markdown]
# ## Gold masks on the patch grid
#
# The region masks of PowerCLIP live on the ViT's $g \times g$ patch grid ($N = g^2$, row-major, the order of the
# patch tokens). An object's pixel mask becomes the set of patches it covers by at least `patch_threshold` of the
# patch's area; a small object that straddles patch borders could cover none by that much, so the patch with most of
# the object always belongs to it. That is the rule of `powerclip.regions.masks_to_patch_grid`; here the image is
# exactly `g` patches wide, so a reshape and a mean compute it several times faster than the general routine (which
# handles crops and non-aligned grids), and the test below holds the two equal.
#
# The rows are the objects **in the order the caption mentions them**, so region $k$ goes with the NP node
# `mention_nodes[k]`, padded to $M$ rows with `valid = False`. With these masks PowerCLIP's regions are the objects
# themselves.

# %%
#| export
def pixel_to_patch_masks(masks: np.ndarray, patch_size: int, threshold: float) -> np.ndarray:
    "(n, H, W) bool, H and W multiples of `patch_size` -> (n, N) bool, row-major; a non-empty mask keeps >= 1 patch."
    n, H, W = masks.shape
    f = masks.reshape(n, H // patch_size, patch_size, W // patch_size, patch_size).mean((2, 4)).reshape(n, -1)  # (n, N)
    out = f >= threshold
    out[np.arange(n), f.argmax(1)] |= f.max(1) > 0                    # the patch with most of the object
    return out


# %%
from powerclip.regions import GridConfig, masks_to_patch_grid
_pm = np.zeros((2, 16, 16), bool)
_pm[0, 0:8, 0:8] = True
_pm[1, 7:9, 7:9] = True    # 2 x 2 px on 4 patches
test_eq(pixel_to_patch_masks(_pm, 8, 0.25), np.array([[1, 0, 0, 0], [1, 0, 0, 0]], bool))
test_eq(pixel_to_patch_masks(_pm, 8, 0.01)[1], np.array([1, 1, 1, 1], bool))
_grid = GridConfig(grid_h=8, grid_w=8, min_frac=cfg.patch_threshold, keep_best=True, crop='full')
for _seed in range(100):   # the same rule as the general routine of 21_regions
    sc = sample_scene(cfg, np.random.default_rng(_seed))
    _, pm = render(sc, cfg)
    test_eq(pixel_to_patch_masks(pm, 8, cfg.patch_threshold), masks_to_patch_grid(pm, _grid).masks.numpy())


# %% [markdown]
# ## A sample, from `(seed, split, index)`
#
# `generate` is the whole pipeline for one sample with numpy only (usable in `data_prep/` tools);
# `WorldDataset` turns it into tensors: the image normalised with CLIP's mean and std, `(3, H, W)`. Every sample
# has its own generator seeded with `(seed, split, index)`, so it does not depend on which worker makes it or on
# what was made before: a resumed run regenerates exactly the samples it would have seen.

# %%
#| export
def sample_rng(cfg: WorldConfig, split: str, index: int) -> np.random.Generator:
    if split not in SPLITS:
        raise ValueError(f'unknown split {split!r}; known: {list(SPLITS)}')
    if index < 0:
        raise IndexError(f'index {index} < 0')
    return np.random.default_rng([cfg.seed, SPLITS[split], index])

def generate(cfg: WorldConfig, index: int, split: str = 'train', full: bool = False) -> dict:
    """One sample as numpy: image (H, W, 3) uint8, text, parsed (gold ParsedCaption), masks (M, N) bool,
    mask_valid (M,) bool, attrs (M, 3) int64 (shape, colour, size ids; -1 = padding), mention_nodes (M,) int64
    (NP node of region k; -1 = padding), scene, spec (the short caption's), order (scene index of each mention),
    specs (the sentences of the caption: [spec], or `describe_long`'s with `cfg.caption='long'`)."""
    rng = sample_rng(cfg, split, index)
    scene = sample_scene(cfg, rng)
    spec, order = describe(scene, cfg, rng, full)
    specs = describe_long(scene, cfg, rng, order) if cfg.caption == 'long' else [spec]
    parsed, nodes = long_caption_tree(specs) if cfg.caption == 'long' else caption_tree(spec)
    img, pix = render(scene, cfg)
    n, M = len(order), cfg.M
    masks = np.zeros((M, cfg.grid ** 2), bool)
    masks[:n] = pixel_to_patch_masks(pix[order], cfg.patch_size, cfg.patch_threshold)
    attrs, mention_nodes = np.full((M, 3), -1, np.int64), np.full(M, -1, np.int64)
    sizes = list(cfg.sizes)
    for k, j in enumerate(order):
        o = scene.objects[j]
        attrs[k] = cfg.shapes.index(o.shape), cfg.colours.index(o.colour), sizes.index(o.size)
    mention_nodes[:n] = nodes
    return dict(image=img, text=parsed.text, parsed=parsed, masks=masks, mask_valid=np.arange(M) < n, attrs=attrs,
                mention_nodes=mention_nodes, scene=scene, spec=spec, order=order, index=index, specs=specs)


# %% [markdown]
# A long-caption world draws the same scenes, images, masks and mention order as the short one (its extra draws come
# after); only the caption and its tree differ, and each region's node is its object's sentence:

# %%
_lcfg = WorldConfig(caption='long')
for _i in range(20):
    _s, _l = generate(cfg, _i), generate(_lcfg, _i)
    assert np.array_equal(_s['image'], _l['image']) and np.array_equal(_s['masks'], _l['masks'])
    test_eq((_s['order'], _s['spec'], _s['specs']), (_l['order'], _l['spec'], [_s['spec']]))
    assert all(caption_truth(sp, _l['scene'], _lcfg) is True for sp in _l['specs'])
    _p = _l['parsed']
    test_eq([' '.join(_p.words[slice(*_p.spans[k])]) for k in _l['mention_nodes'][_l['mask_valid']]],
            [caption_text(sp) for sp in _l['specs'][:len(_l['order'])]])
print(_l['text'])

# %%
#| export
# (3, 256): channel c, grey level v -> (v / 255 - mean_c) / std_c; a table look-up is cheaper than the arithmetic
_CLIP_LUT = ((np.arange(256)[None] / 255 - np.array(CLIP_MEAN)[:, None])
             / np.array(CLIP_STD)[:, None]).astype(np.float32)

def to_clip_tensor(img: np.ndarray) -> torch.Tensor:
    "(H, W, 3) uint8 -> (3, H, W) float32, normalised with CLIP's mean and std."
    out = np.empty((3, *img.shape[:2]), np.float32)                      # (3, H, W)
    for c in range(3):
        np.take(_CLIP_LUT[c], img[..., c], out=out[c])
    return torch.from_numpy(out)

class WorldDataset(torch.utils.data.Dataset):
    "Map-style dataset of `length` world samples of one split; item i is a pure function of (cfg.seed, split, i)."
    def __init__(self, cfg: WorldConfig | None = None, length: int = 1_000_000, split: str = 'train',
                 full: bool = False,
                 rgb: bool = False):   # rgb: also the rendered pixels (for what segments the image, e.g. superpixels)
        self.cfg, self.length, self.split, self.full, self.rgb = cfg or WorldConfig(), length, split, full, rgb
        sample_rng(self.cfg, split, 0)   # fail early on a bad split
    def __len__(self): return self.length
    def __getitem__(self, i: int) -> dict:
        """image (3, H, W) float, text str, parsed ParsedCaption, masks (M, N) bool, mask_valid (M,) bool,
        attrs (M, 3) long, mention_nodes (M,) long, index int; with `rgb`, rgb (H, W, 3) uint8."""
        i = operator.index(i)   # ints, numpy ints, 0-d tensors
        if not -self.length <= i < self.length:
            raise IndexError(f'index {i} out of range for {self.length} samples')
        s = generate(self.cfg, i % self.length, self.split, self.full)
        out = dict(image=to_clip_tensor(s['image']), text=s['text'], parsed=s['parsed'],
                   masks=torch.from_numpy(s['masks']), mask_valid=torch.from_numpy(s['mask_valid']),
                   attrs=torch.from_numpy(s['attrs']), mention_nodes=torch.from_numpy(s['mention_nodes']),
                   index=s['index'])
        if self.rgb:
            out['rgb'] = torch.from_numpy(s['image'])
        return out

def collate_world(batch: list[dict]) -> dict:
    "Stack the tensors (image (C, 3, H, W), masks (C, M, N), ...); text and parsed stay lists."
    out = {k: torch.stack([b[k] for b in batch]) for k in ('image', 'masks', 'mask_valid', 'attrs', 'mention_nodes')}
    out['index'] = torch.tensor([b['index'] for b in batch])
    out['text'], out['parsed'] = [b['text'] for b in batch], [b['parsed'] for b in batch]
    return out


# %%
ds = WorldDataset(cfg, length=1000)
a, b = ds[7], ds[7]
for k in a:
    if torch.is_tensor(a[k]):
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    else:
        test_eq(a[k], b[k])
test_eq((a['image'].shape, a['image'].dtype, a['masks'].shape), ((3, 64, 64), torch.float32, (3, 64)))
assert ds[8]['text'] != a['text'] or not torch.equal(ds[8]['image'], a['image'])
assert ds[-1]['index'] == 999 and ds[np.int64(5)]['text'] == ds[torch.tensor(5)]['text'] == ds[5]['text']
test_fail(lambda: ds[1000], contains='out of range')
test_fail(lambda: WorldDataset(cfg, split='dev'), contains='unknown split')
# splits are different streams; the seed changes everything
assert (generate(cfg, 0, 'test')['text'] != generate(cfg, 0, 'train')['text']
        or not (generate(cfg, 0, 'test')['image'] == generate(cfg, 0, 'train')['image']).all())
assert not (generate(WorldConfig(seed=1), 0)['image'] == generate(cfg, 0)['image']).all()
# the normalisation inverts back to the uint8 image
s = generate(cfg, 7)
_mean, _std = torch.tensor(CLIP_MEAN).view(3, 1, 1), torch.tensor(CLIP_STD).view(3, 1, 1)
torch.testing.assert_close(a['image'], (torch.from_numpy(s['image']).permute(2, 0, 1) / 255 - _mean) / _std)
# masks: valid rows non-empty, padding rows empty, region k is the object of mention k, attrs consistent
for i in range(100):
    s = generate(cfg, i)
    n = len(s['order'])
    test_eq(s['mask_valid'].sum(), n)
    assert s['masks'][:n].any(1).all() and not s['masks'][n:].any() and (s['attrs'][n:] == -1).all()
    for k, j in enumerate(s['order']):
        o = s['scene'].objects[j]
        test_eq(s['parsed'].words[slice(*s['parsed'].spans[s['mention_nodes'][k]])][-1], o.shape)
        test_eq(cfg.shapes[s['attrs'][k, 0]], o.shape)
        r, c = int(o.cy // 8), int(o.cx // 8)          # the patch under the object's centre is in its mask
        assert s['masks'][k, r * 8 + c] or not render(s['scene'], cfg)[1][j, int(o.cy), int(o.cx)]
batch = collate_world([ds[i] for i in range(4)])
test_eq((batch['image'].shape, batch['masks'].shape, len(batch['parsed'])), ((4, 3, 64, 64), (4, 3, 64), 4))


# %% [markdown]
# Some scenes with their captions, and the gold patch masks of one of them (region $k$ outlined in the colour of its
# object; the grid is the 8 x 8 ViT patch grid).

# %%
def show_grid(cfg, n=12, split='train'):
    fig, axs = plt.subplots(2, n // 2, figsize=(2.3 * n // 2, 5.6))
    for i, ax in enumerate(axs.flat):
        s = generate(cfg, i, split)
        ax.imshow(s['image'])
        ax.set_axis_off()
        words = s['text'].split()
        cut = (len(words) + 1) // 2
        ax.set_title(' '.join(words[:cut]) + '\n' + ' '.join(words[cut:]), fontsize=7)
    plt.tight_layout()
    plt.show()
show_grid(cfg)


# %%
def show_masks(cfg, index):
    s = generate(cfg, index)
    g, P = cfg.grid, cfg.patch_size
    fig, axs = plt.subplots(1, 1 + len(s['order']), figsize=(2.6 * (1 + len(s['order'])), 2.8))
    axs[0].imshow(s['image'])
    axs[0].set_title('image', fontsize=8)
    for k, j in enumerate(s['order']):
        ax = axs[k + 1]
        ax.imshow(s['image'])
        m = s['masks'][k].reshape(g, g)
        ax.imshow(np.kron(m, np.ones((P, P))), cmap='gray', alpha=0.55, vmin=0, vmax=1)
        node = s['parsed'].spans[s['mention_nodes'][k]]
        ax.set_title(f"region {k}: '{' '.join(s['parsed'].words[slice(*node)])}'", fontsize=8)
    for ax in axs:
        ax.set_xticks(np.arange(0, cfg.image_size + 1, P) - 0.5)
        ax.set_yticks(np.arange(0, cfg.image_size + 1, P) - 0.5)
        ax.set_xticklabels([])
        ax.set_yticklabels([])
        ax.grid(color='w', lw=0.3)
    plt.tight_layout()
    plt.show()
    print(s['text'])
    print(bracket(s['parsed']))
i3 = next(i for i in range(100) if len(generate(cfg, i)['order']) == 3)   # the first scene with 3 objects
show_masks(cfg, i3)

# %% [markdown]
# The gold tree of that caption, drawn, and the gold trees of the first samples with the node each region goes with:

# %%
print(draw_tree(generate(cfg, i3)['parsed']))

# %%
for i in range(6):
    s = generate(cfg, i)
    print(f"{bracket(s['parsed']):100s} regions -> nodes {s['mention_nodes'].tolist()}")

# %% [markdown]
# ## Hard negatives, SugarCrepe style
#
# SugarCrepe (Hsieh et al., 2023) tests compositionality with one true caption and one minimally changed false
# caption per item, in seven categories. Here each is an edit of the `CaptionSpec`, and a candidate is kept only if
# its truth value in the scene is `False` (not `None`) and its text differs from the positive:
#
# | category | edit | example (positive: `a small red circle left of a large blue square`) |
# |---|---|---|
# | `swap_att` | swap the colours (or sizes) of two mentions | `a small blue circle left of a large red square` |
# | `swap_obj` | swap two mentions (who is left of whom) | `a large blue square left of a small red circle` |
# | `replace_att` | replace one colour or size | `a small red circle left of a large green square` |
# | `replace_obj` | replace one shape | `a small red diamond left of a large blue square` |
# | `add_obj` | add a mention of a (shape, colour) not in the scene | `a small red circle left of a large blue square and a white cross` |
# | `add_att` | give an unsized mention the wrong size | `a red circle ...` -> `a large red circle ...` |
# | `replace_rel` | replace the relation | `a small red circle above a large blue square` |
#
# Candidates are tried in a random order from the item's own generator, so the choice is deterministic too.

# %%
#| export
NEGATIVE_KINDS = ('swap_att', 'swap_obj', 'replace_att', 'replace_obj', 'add_obj', 'add_att', 'replace_rel')

def _with(spec: CaptionSpec, i: int, **kw) -> CaptionSpec:
    ms = list(spec.mentions)
    ms[i] = Mention(**{**asdict(ms[i]), **kw})
    return CaptionSpec(tuple(ms), spec.relation)

def negative_candidates(kind: str, spec: CaptionSpec, scene: Scene, cfg: WorldConfig) -> list[CaptionSpec]:
    "Every edit of `kind` of `spec` (true or not: `hard_negatives` filters)."
    ms, n, out = spec.mentions, len(spec.mentions), []
    if kind == 'swap_att':
        for i, j in itertools.combinations(range(n), 2):
            for att in ('colour', 'size'):
                a, b = getattr(ms[i], att), getattr(ms[j], att)
                if a and b and a != b:
                    out.append(_with(_with(spec, i, **{att: b}), j, **{att: a}))
    elif kind == 'swap_obj':
        for i, j in itertools.combinations(range(n), 2):
            l = list(ms)
            l[i], l[j] = l[j], l[i]
            out.append(CaptionSpec(tuple(l), spec.relation))
    elif kind == 'replace_att':
        for i in range(n):
            out += [_with(spec, i, colour=c) for c in cfg.colours if ms[i].colour and c != ms[i].colour]
            out += [_with(spec, i, size=z) for z in cfg.sizes if ms[i].size and z != ms[i].size]
    elif kind == 'replace_obj':
        out = [_with(spec, i, shape=s) for i in range(n) for s in cfg.shapes if s != ms[i].shape]
    elif kind == 'add_obj':
        present = {(o.shape, o.colour) for o in scene.objects}
        rels = [spec.relation] if spec.relation else list(cfg.relations)
        out = [CaptionSpec(ms + (Mention(s, c),), r) for s in cfg.shapes for c in cfg.colours
               if (s, c) not in present for r in rels]
    elif kind == 'add_att':
        out = [_with(spec, i, size=z) for i in range(n) for z in cfg.sizes if ms[i].size is None]
    elif kind == 'replace_rel':
        out = [CaptionSpec(ms, r) for r in cfg.relations if spec.relation and r != spec.relation]
    else:
        raise ValueError(f'unknown negative kind {kind!r}; known: {NEGATIVE_KINDS}')
    return out

def hard_negatives(spec: CaptionSpec, scene: Scene, cfg: WorldConfig, rng: np.random.Generator,
                   kinds: tuple = NEGATIVE_KINDS) -> dict[str, CaptionSpec]:
    "At most one negative per kind, each clearly false in `scene`; kinds with no false candidate are absent."
    pos, out = caption_text(spec), {}
    for kind in kinds:
        cands = negative_candidates(kind, spec, scene, cfg)
        for k in rng.permutation(len(cands)):
            c = cands[int(k)]
            if caption_text(c) != pos and caption_truth(c, scene, cfg) is False:
                out[kind] = c
                break
    return out


# %%
neg_rows, counts = [], dict.fromkeys(NEGATIVE_KINDS, 0)
for i in range(300):
    s = generate(cfg, i, 'test')
    negs = hard_negatives(s['spec'], s['scene'], cfg, sample_rng(cfg, 'test', i))
    for kind, c in negs.items():
        assert caption_truth(c, s['scene'], cfg) is False and caption_text(c) != s['text']
        counts[kind] += 1
    if i < 3:
        neg_rows += [(i, s['text'], kind, caption_text(c)) for kind, c in negs.items()]
assert all(counts.values()), counts     # every category occurs
test_eq(hard_negatives(s['spec'], s['scene'], cfg, sample_rng(cfg, 'test', 299)), negs)   # deterministic
test_fail(lambda: negative_candidates('swap_rel', s['spec'], s['scene'], cfg), contains='unknown negative kind')
print('items per category out of 300 test scenes:', counts)
display(Markdown('| scene | positive | category | negative |\n|---|---|---|---|\n'
                 + '\n'.join(f'| {i} | {t} | `{k}` | {n} |' for i, t, k, n in neg_rows)))


# %% [markdown]
# ## Held-out scenes for the benchmarks
#
# `benchmark_scene` gives what an evaluation needs of one scene of a split: the sample itself (`generate`), one hard
# negative per kind where the scene allows it, and up to `captions_per_image` full captions for retrieval (every
# size said, the subjects and relations varied), each as a gold tree. The negatives and captions come from a random
# stream of their own, apart from the sample's, so the scene is the same one `generate` gives. The folder these
# scenes are written to (SugarCrepe-format hard negatives, a Karpathy-style retrieval list, the gold trees) is the
# evaluation's business: `powerclip.eval.data.write_world_benchmark` (`61_eval_data`).

# %%
#| export
def retrieval_captions(scene: Scene, cfg: WorldConfig, rng: np.random.Generator, k: int) -> list[CaptionSpec]:
    "Up to `k` distinct true full captions of `scene` (different subjects / relations when there are several)."
    out, texts = [], set()
    for _ in range(8 * k):
        spec, _ = describe(scene, cfg, rng, full=True)
        if caption_text(spec) not in texts:
            texts.add(caption_text(spec))
            out.append(spec)
        if len(out) == k:
            break
    return out

def benchmark_scene(cfg: WorldConfig, index: int, split: str = 'test', captions_per_image: int = 2) -> dict:
    """Scene `index` of `split` for a benchmark: `sample` (what `generate` returns), `negatives` {kind: gold tree of a
    false caption} and `captions` [gold trees of true full captions], both ParsedCaption."""
    s = generate(cfg, index, split)
    rng = np.random.default_rng([cfg.seed, SPLITS[split], index, 1])      # a stream of its own, apart from the sample's
    negatives = {kind: caption_tree(neg)[0] for kind, neg in hard_negatives(s['spec'], s['scene'], cfg, rng).items()}
    captions = [caption_tree(spec)[0] for spec in retrieval_captions(s['scene'], cfg, rng, captions_per_image)]
    return dict(sample=s, negatives=negatives, captions=captions)


# %%
for i in range(60):
    b = benchmark_scene(cfg, i)
    s, sc = b['sample'], b['sample']['scene']
    test_eq(s['image'], generate(cfg, i, 'test')['image'])                   # the scene generate gives
    for kind, neg in b['negatives'].items():
        assert (caption_truth(spec_from_text(neg.text, cfg), sc, cfg) is False
                and neg.text != s['text']), (kind, neg.text)
    texts = [c.text for c in b['captions']]
    test_eq(len(texts), len(set(texts)))
    assert 1 <= len(texts) <= 2
    for c in b['captions']:   # every retrieval caption is true for its image, and names all its objects
        spec = spec_from_text(c.text, cfg)
        assert caption_truth(spec, sc, cfg) is True and len(spec.mentions) == len(sc.objects)
        test_eq(c.words, c.text.split())
# deterministic
test_eq({k: v.text for k, v in benchmark_scene(cfg, 59)['negatives'].items()},
        {k: v.text for k, v in b['negatives'].items()})

# %% [markdown]
# ## Throughput
#
# One process makes samples (tensors included) at this rate on this machine; the data-loader workers of a training
# run each do as much. Samples per CPU-second do not depend on what else the machine runs; samples per second do.
# (Measured, not asserted: `benchmarks/world_throughput.py` gives the numbers with the machine.)

# %%
_ds = WorldDataset(cfg, length=10 ** 6)
_ds[0]
t0, c0 = time.perf_counter(), time.process_time()
for i in range(1000):
    _ds[i]
dt, dc = time.perf_counter() - t0, time.process_time() - c0
print(f'{1000 / dt:.0f} samples per second, {1000 / dc:.0f} samples per CPU-second of this process '
      f'(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)')
