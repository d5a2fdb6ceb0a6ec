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
#| default_exp data

# %%
#| export
from __future__ import annotations

import copy
import io
import itertools
import json
import logging
import os
import random
import signal
import tarfile
from dataclasses import asdict, dataclass, field
from functools import partial

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, get_worker_info

from powerclip.parsing import ParsedCaption, caption_problem, parse_caption, tree_problems
from powerclip.tokens import TreeTokens, collate_trees, default_tokenizer, tree_tokens
from powerclip.regions import GridConfig, decode_regions, random_box_masks, select_masks, superpixel_masks
from powerclip.seeds import derive_seed, key_index, mix_seed, sample_generator
from powerclip.subcaptions import subcaption_tokens
from powerclip.seeds import run_seeds  # noqa: F401  (re-exported: `from powerclip.data import run_seeds`)
from powerclip.world import WorldConfig, WorldDataset

logger = logging.getLogger(__name__)

# %%
#| hide
import tempfile
import time
from pathlib import Path

from fastcore.test import test_eq, test_fail


# %% [markdown]
# # Data
#
# > Batches from the built-in world or CC12M-style shards, with only what the method asked for.
#
# Images and caption tokens always, parse-tree masks and region masks on the patch grid when needed; the model's geometry;
# the run seed's streams; and an account of every sample skipped.

# %% [markdown]
# A batch is the dict of the batch contract (see `40_methods` for its consumers). Every batch has
#
# | key | shape | what |
# |---|---|---|
# | `image` | `(C, 3, H, W)` float | normalised with CLIP's mean and std, at the model's image size |
# | `tokens` | `(C, L)` long | open_clip token ids at the model's context length |
# | `index` | `(C,)` long | sample ids: the world index, or a stable hash of the shard key |
#
# and, only when the method asks for them (`BatchNeeds`, below):
#
# | key | shape | asked by | what |
# |---|---|---|---|
# | `leaf_tokens`, `leaf_valid` | `(C, W, L)`, `(C, W)` bool | `tree` | token mask $P_{m'}$ of each word (Eq. 4) |
# | `incidence`, `node_valid` | `(C, K, W)`, `(C, K)` bool | `tree` | which words each parse node covers (Eq. 3) |
# | `node_np` | `(C, K)` bool | `node_np` | the node's label is `NP` (the noun-phrase concepts of C2LIP, `45_c2lip`); pads False |
# | `region_masks`, `region_valid` | `(C, M, N)`, `(C, M)` bool | `regions = M` | region masks $R_m$ on the row-major patch grid (Eq. 2) |
# | `sub_tokens` | `(C, K, L)` long | `subcaptions = K` | $K$ sub-captions of the caption, tokenised (FLAIR, `22b_subcaptions`) |
#
# With a tree the tokens are built by `tokens.tree_tokens`, so each word's BPE positions are known; without one the
# caption is tokenised as it stands by the model's tokenizer (`caption_tokens`), and on shards no caption is parsed
# at all. A CLIP run therefore draws no region mask and parses nothing.
#
# Two sources feed it. **The world** (`22_world`): sample $i$ is a pure function of `(seed, i)`, with a gold
# parse tree and gold object masks, so training on it is exactly reproducible and resumable. **Shards**: CC12M
# as img2dataset writes it (`{key}.jpg`, `{key}.txt`, `{key}.json` in tar files), optionally annotated by
# `data_prep` (`data_prep/README.md`: from CC12M's url list to annotated shards) with `{key}.tree.json` (a
# `ParsedCaption.to_dict()`) and `{key}.regions.npz` (segmentation masks on the patch grid,
# `regions.encode_regions`). Web data is dirty: every sample that cannot be used is **skipped, counted by reason and
# logged**, never a crash in the middle of an epoch.
#
# Region masks come from one of three places: `random` boxes (PowerCLIP-R, Sec. 3.2), `gold` world object
# masks, or `stored` segmentation masks of which $M$ are drawn at random (PowerCLIP-S, Sec. 5.1). Random
# draws use a generator seeded by `(region seed, epoch, index)`, so they do not depend on the worker that made the
# sample or on the order of the samples.

# %% [markdown]
# ## What fixes a batch
#
# Four things, each from the place that owns it:
#
# - `DataConfig`: where the data comes from and how it is loaded (the run config's `data` section);
# - `Geometry`: the image size, patch size and context length, which are the *model's* (read from its open_clip
#   config by `powerclip.model.model_geometry` before the model is built); the world renders at that size and
#   shards are resized to it;
# - `BatchNeeds`: what the *method* reads of a batch (`Method.needs()`); the pipeline builds that and nothing more;
# - the *run seed*, from which the data order, the world's training scenes and the region draws are derived by name
#   (`22a_seeds`).
#
# `BatchSpec` holds the four; `make_loader(spec, epoch, ...)` makes the batches.

# %%
#| export
@dataclass
class DataConfig:
    "Where batches come from and how they are loaded; the run writes it next to its outputs."
    source: str = 'world'          # 'world': the built-in procedural world; 'wds': webdataset shards (CC12M layout)
    shards: str = ''               # wds: shard paths/urls, brace patterns allowed ('cc12m/{00000..01242}.tar'), '::'
                                   # separated
    batch_size: int = 64           # per process
    workers: int = 2               # DataLoader worker processes (0: load in the main process)
    world_length: int = 100_000    # world: samples per epoch (indices 0 .. world_length-1 of the 'train' split)
    world: dict = field(default_factory=dict)  # world: extra WorldConfig fields (max_objects, relations, ...); its
                                   # image and patch size are the model's, its seed derives from the run seed
    shuffle_buffer: int = 1000     # wds: each worker shuffles its stream in blocks of this many samples (0: shard
                                   # order)
    samples_per_epoch: int | None = None  # wds: samples per process per epoch (None: one pass over its shards)
    parse_missing: bool = True     # wds, methods that need a tree: parse captions without {key}.tree.json on the fly
                                   # (else skip them)

    def __post_init__(self):
        # each message starts with the field's name: the trainer's config reader prefixes the section ('data.')
        if self.source not in ('world', 'wds'):
            raise ValueError(f"source: must be 'world' or 'wds', got {self.source!r}")
        if self.source == 'wds' and not self.shards:
            raise ValueError("shards: source 'wds' needs shard paths or urls (e.g. 'cc12m/{00000..01242}.tar')")
        for k, lo in (('batch_size', 1), ('workers', 0), ('world_length', 1), ('shuffle_buffer', 0)):
            if getattr(self, k) < lo:
                raise ValueError(f'{k}: must be at least {lo}, got {getattr(self, k)}')
        if self.samples_per_epoch is not None and self.samples_per_epoch < 1:
            raise ValueError('samples_per_epoch: must be at least 1 or null (one pass over the shards), got '
                             f'{self.samples_per_epoch}')
        owned = sorted({'image_size', 'patch_size', 'seed'} & set(self.world))
        if owned:
            raise ValueError(f"world: may not set {owned}: image and patch size are the model's, the seed "
                             "derives from the run seed")

@dataclass(frozen=True)
class Geometry:
    "The model's input geometry (`powerclip.model.model_geometry` reads it from the model config)."
    image_size: int      # H = W in pixels
    patch_size: int      # ViT patch side: the patch grid is (image_size // patch_size)^2, row-major
    context_length: int  # text tokens

    def __post_init__(self):
        if self.image_size % self.patch_size:
            raise ValueError(f'image_size {self.image_size} is not a multiple of patch_size {self.patch_size}')

    @property
    def grid(self) -> int: return self.image_size // self.patch_size


REGION_SOURCES = ('random', 'gold', 'superpixel', 'stored')


@dataclass(frozen=True)
class BatchNeeds:
    "What a method reads of a batch beyond image, tokens and index; the pipeline builds exactly this."
    tree: bool = False             # leaf_tokens, leaf_valid, incidence, node_valid (the caption's parse tree)
    node_np: bool = False          # node_np: which nodes are noun phrases (needs tree)
    regions: int = 0               # M region masks per image (0: none)
    region_source: str = 'random'  # 'random' boxes | 'gold' world masks | 'superpixel' SLIC | 'stored' shard masks
    subcaptions: int = 0           # sub_tokens: K sub-captions per caption (FLAIR's, 22b_subcaptions; 0: none)

    def __post_init__(self):
        if self.node_np and not self.tree:
            raise ValueError('node_np needs tree=True (the labels are the parse tree\'s)')
        if self.regions < 0 or self.subcaptions < 0:
            raise ValueError(f'regions and subcaptions must be >= 0, got {self.regions}, {self.subcaptions}')
        if self.region_source not in REGION_SOURCES:
            raise ValueError(f"region_source must be one of {REGION_SOURCES}, got {self.region_source!r}")

    def keys(self) -> tuple[str, ...]:
        "The batch keys these needs add to those of every batch (image, tokens, index)."
        return (('leaf_tokens', 'leaf_valid', 'incidence', 'node_valid') * self.tree + ('node_np',) * self.node_np
                + ('region_masks', 'region_valid') * bool(self.regions) + ('sub_tokens',) * bool(self.subcaptions))


@dataclass(frozen=True)
class BatchSpec:
    "Everything that fixes the batches of a run (see above)."
    data: DataConfig
    geometry: Geometry
    needs: BatchNeeds = BatchNeeds()
    seed: int = 0                  # the run seed: data order, world scenes and region draws derive from it by name

    def __post_init__(self):
        src, n = self.needs.region_source, self.needs.regions
        if n and src in ('gold', 'superpixel') and self.data.source != 'world':
            raise ValueError(f"region masks {src!r} need data.source='world' (for shards, store masks: "
                             "data_prep, masks 'stored')")
        if n and src == 'stored' and self.data.source != 'wds':
            raise ValueError("region masks 'stored' need data.source='wds'")

    @property
    def order_seed(self) -> int: return derive_seed(self.seed, 'data')
    @property
    def world_seed(self) -> int: return derive_seed(self.seed, 'world')
    @property
    def region_seed(self) -> int: return derive_seed(self.seed, 'regions')


# %%
test_eq(Geometry(64, 8, 77).grid, 8)
test_fail(lambda: Geometry(60, 8, 77), contains='multiple')
test_fail(lambda: DataConfig(source='wds'), contains='shards')
test_fail(lambda: DataConfig(world={'image_size': 32}), contains="model's")
test_fail(lambda: BatchSpec(DataConfig(source='wds', shards='x.tar'), Geometry(64, 8, 77),
                            BatchNeeds(regions=4, region_source='gold')), contains='gold')
test_fail(lambda: BatchNeeds(node_np=True), contains='tree')
test_eq(BatchNeeds().keys(), ())
test_eq(BatchNeeds(tree=True, regions=3).keys()[-2:], ('region_masks', 'region_valid'))

# %% [markdown]
# ## Skip accounting
#
# Every sample that cannot be used is skipped under one of the reasons below, logged with its key, and counted.
# A `SampleSkipCounter` counts the skips of one stream (one worker of one process); the loader adds the counts to the
# batches, so that a count is part of what the main process *consumed*, not of what the workers happened to have
# decoded ahead of it (see "Counting skips" below).

# %%
#| export
SAMPLE_SKIP_REASONS = ('shard_error',   # unreadable / truncated tar or a read error inside it
                       'no_image',      # no member with an image extension (IMAGE_EXTS)
                       'bad_image',     # the image bytes do not decode
                       'no_caption',    # missing .txt, or a caption parsing.caption_problem rejects (not UTF-8, no
                                        # letter or digit)
                       'bad_tree',      # tree needed: unparsable .tree.json, a tree without a valid node, or no tree
                                        # when parsing is off
                       'no_regions',    # stored masks needed: no .regions.npz or no non-empty mask in it
                       'bad_regions')   # stored masks needed: masks on another grid or unreadable

class SampleSkipCounter:
    "Per-reason counts of the samples one stream skipped; each skip is also logged with its key and reason."
    def __init__(self):
        self.counts = dict.fromkeys(SAMPLE_SKIP_REASONS, 0)

    def add(self, reason: str, key: str = '', detail: str = ''):
        if reason not in self.counts:
            raise ValueError(f'unknown skip reason {reason!r}; reasons: {SAMPLE_SKIP_REASONS}')
        self.counts[reason] += 1
        logger.warning('skipped sample %r: %s %s', key, reason, detail)

    def take(self) -> dict[str, int]:
        "The counts since the last `take` (and start again from zero)."
        out, self.counts = self.counts, dict.fromkeys(SAMPLE_SKIP_REASONS, 0)
        return out

    def total(self) -> int: return sum(self.counts.values())


def add_counts(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    "Reason-wise sum of two skip counts."
    return {k: a.get(k, 0) + b.get(k, 0) for k in dict.fromkeys([*SAMPLE_SKIP_REASONS, *a, *b])}


# %%
sc = SampleSkipCounter()
sc.add('bad_image', 'k1', 'test')
sc.add('shard_error', 'a.tar', "ReadError('unexpected end of data')")
test_eq(sc.total(), 2)
_t = sc.take()
test_eq((_t['bad_image'], _t['shard_error'], sc.total()), (1, 1, 0))
test_eq(add_counts(_t, _t)['bad_image'], 2)
test_fail(lambda: sc.add('no_such_reason'), contains='unknown skip reason')


# %% [markdown]
# ## One sample, any source
#
# `make_item` turns what a source knows about a sample (a normalised image tensor, its caption, its parse tree
# when the method needs one, optionally a pool of candidate masks) into the per-sample part of the batch:
#
# - tokens: with a tree, `tokens.tree_tokens` (the word positions come with them); without, `caption_tokens`,
#   the caption as the model's tokenizer encodes it;
# - region masks, when asked for: `random` gives $M$ boxes (`regions.random_box_masks`), all valid; `gold` and
#   `stored` draw $\min(R, M)$ of the pool uniformly without replacement (`regions.select_masks`), padded with
#   invalid all-`False` rows.
#
# The tree is tokenised here, in the worker, so the main process only stacks.

# %%
#| export
def caption_tokens(text: str, context_length: int) -> torch.Tensor:
    "(L,) long: the caption as the model's tokenizer (open_clip's CLIP BPE) encodes it: SOT, pieces, EOT, zeros."
    return default_tokenizer()([text], context_length=context_length)[0]

def region_masks(mode: str, grid: int, M: int, gen: torch.Generator,
                 pool: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    "`(M, N)` bool masks and `(M,)` validity: random boxes, or M drawn from `pool` `(R, N)` (gold/stored)."
    if mode == 'random':
        return random_box_masks(grid, grid, M, gen)
    if pool is None:
        raise ValueError(f'masks={mode!r} needs a pool of masks')
    pool = pool[pool.any(1)]                      # empty masks carry no region
    return select_masks(pool, M, gen)

def make_item(image: torch.Tensor, text: str, parsed: ParsedCaption | TreeTokens | None, index: int, spec: BatchSpec,
              epoch: int, pool: torch.Tensor | None = None) -> dict:
    """Per-sample tensors: image (3, H, W), tree (TreeTokens) or tokens (L,), region_masks (M, N) and region_valid (M,)
    if asked, index."""
    needs, L = spec.needs, spec.geometry.context_length
    item = dict(image=image, index=index)
    if needs.tree:
        if parsed is None:
            raise ValueError('the method needs a parse tree and the sample has none')
        item['tree'] = parsed if isinstance(parsed, TreeTokens) else tree_tokens(parsed, context_length=L)
    else:
        item['tokens'] = caption_tokens(text, L)
    if needs.regions:
        item['region_masks'], item['region_valid'] = region_masks(
            needs.region_source, spec.geometry.grid, needs.regions,
            sample_generator(spec.region_seed, epoch, index), pool)
    if needs.subcaptions:
        item['sub_tokens'] = subcaption_tokens(text, needs.subcaptions, (spec.seed, epoch, index), L)   # (K, L)
    return item

def collate(items: list[dict], node_np: bool = True) -> dict:
    "Stack `make_item` outputs into the batch contract dict (trees padded by `collate_trees`; `node_np` kept if asked)."
    if 'tree' in items[0]:
        out = collate_trees([it['tree'] for it in items])
        if not node_np:
            del out['node_np']
    else:
        out = dict(tokens=torch.stack([it['tokens'] for it in items]))        # (C, L)
    out['image'] = torch.stack([it['image'] for it in items])                  # (C, 3, H, W)
    for k in ('region_masks', 'region_valid', 'sub_tokens'):                  # (C, M, N), (C, M), (C, K, L)
        if k in items[0]:
            out[k] = torch.stack([it[k] for it in items])
    out['index'] = torch.tensor([it['index'] for it in items], dtype=torch.long)
    return out


# %%
_geo = Geometry(64, 8, 77)
_spec = BatchSpec(DataConfig(), _geo, BatchNeeds(tree=True, node_np=True, regions=4))
_pc = ParsedCaption('a red circle', ['a', 'red', 'circle'], [(0, 3)], ['NP'], 'gold', [])
_it = make_item(torch.zeros(3, 64, 64), _pc.text, _pc, 5, _spec, epoch=0)
test_eq(_it['region_masks'].shape, (4, 64))
assert _it['region_valid'].all() and _it['region_masks'].any(1).all()
# same (seed, epoch, index)
test_eq(_it['region_masks'], make_item(torch.zeros(3, 64, 64), _pc.text, _pc, 5, _spec, 0)['region_masks'])
# new epoch
assert not torch.equal(_it['region_masks'],
                       make_item(torch.zeros(3, 64, 64), _pc.text, _pc, 5, _spec, 1)['region_masks'])
assert not torch.equal(_it['region_masks'], make_item(torch.zeros(3, 64, 64), _pc.text, _pc, 5,
                                                      BatchSpec(**{**_spec.__dict__, 'seed': 1}), 0)['region_masks'])
_pool = torch.eye(3, 64, dtype=torch.bool)
_pool = torch.cat([_pool, torch.zeros(1, 64, dtype=torch.bool)])
m, v = region_masks('gold', 8, 4, torch.Generator().manual_seed(0), _pool)
test_eq(v.tolist(), [True, True, True, False])
assert not m[3].any()   # the empty pool mask is not drawn
_pc2 = ParsedCaption('a b', ['a', 'b'], [(0, 2), (1, 2)], ['NP', 'NP'], 'gold', [])
_b = collate([_it, make_item(torch.zeros(3, 64, 64), _pc2.text, _pc2, 7, _spec, 0)])
test_eq({k: tuple(t.shape) for k, t in _b.items()},
        dict(tokens=(2, 77), leaf_tokens=(2, 3, 77), leaf_valid=(2, 3), incidence=(2, 2, 3), node_valid=(2, 2),
             node_np=(2, 2), image=(2, 3, 64, 64), region_masks=(2, 4, 64), region_valid=(2, 4), index=(2,)))
# a method that needs nothing beyond the tokens gets image, tokens and index only, and the same tokens
_spec0 = BatchSpec(DataConfig(), _geo)
_b0 = collate([make_item(torch.zeros(3, 64, 64), p.text, None, i, _spec0, 0) for i, p in ((5, _pc), (7, _pc2))])
test_eq(set(_b0), {'image', 'tokens', 'index'})
test_eq(_b0['tokens'], _b['tokens'])


# %% [markdown]
# ## The world source and exact resume
#
# An epoch of the world is a permutation of the indices $0..n-1$ drawn from `(data seed, epoch)`; batch $b$ of
# the epoch is the slice $[bB, (b+1)B)$ of it. With $G$ processes, step $s$ of rank $r$ is batch $sG+r$.
# Everything about batch $b$ (which samples, their images and trees, their region masks) is therefore a pure
# function of `(run seed, epoch, b)`. To resume at `(epoch, step)`, `EpochBatchSampler` simply starts at
# `start_step`: the earlier batches are never generated, and the rest are bit-identical to those of an
# uninterrupted run, whatever the number of workers. The last incomplete batch is dropped, so every step
# has the same size and every rank the same number of steps.

# %%
#| export
class EpochBatchSampler(Sampler):
    "Batches of indices of one epoch: a permutation from (seed, epoch), sliced; rank r takes batch s*G + r at step s."
    def __init__(self, n: int, batch_size: int, seed: int, epoch: int, start_step: int = 0,
                 rank: int = 0, world_size: int = 1):
        if not 0 <= rank < world_size:
            raise ValueError(f'rank {rank} not in [0, {world_size})')
        self.n, self.B, self.seed, self.epoch, self.rank, self.G = n, batch_size, seed, epoch, rank, world_size
        self.steps = n // (batch_size * world_size)      # full steps per epoch and rank
        if not 0 <= start_step <= self.steps:
            raise ValueError(f'start_step {start_step} not in [0, {self.steps}]')
        self.start_step = start_step

    def __len__(self): return self.steps - self.start_step

    def __iter__(self):
        perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(mix_seed(self.seed, self.epoch)))
        for s in range(self.start_step, self.steps):
            b = s * self.G + self.rank
            yield perm[b * self.B:(b + 1) * self.B].tolist()


# %%
_s = EpochBatchSampler(100, 8, seed=0, epoch=0)
_all = list(_s)
test_eq(len(_all), 12)
test_eq(len(set(itertools.chain(*_all))), 96)   # no repeats
test_eq(list(EpochBatchSampler(100, 8, 0, 0, start_step=5)), _all[5:])                     # resume = suffix
assert list(EpochBatchSampler(100, 8, 0, 1)) != _all                                        # new epoch, new order
_r = [list(EpochBatchSampler(100, 8, 0, 0, rank=r, world_size=2)) for r in range(2)]
test_eq(len(_r[0]), 6)
assert not set(itertools.chain(*_r[0])) & set(itertools.chain(*_r[1]))  # ranks disjoint
test_eq(_r[1][2], _all[2 * 2 + 1])


# %% [markdown]
# `WorldItems` wraps `world.WorldDataset`: it renders sample $i$ and its gold tree and masks, then `make_item`
# adds the tokens and the region masks of this epoch.

# %%
#| export
def world_config(cfg: DataConfig, geometry: Geometry, seed: int | None = None) -> WorldConfig:
    """The WorldConfig of a run: rendered at the model's image and patch size; `seed`: the training stream (the run's
    `world` seed), or None for the world's own default, the fixed benchmark of held-out scenes."""
    extra = {} if seed is None else {'seed': seed}
    return WorldConfig(**{**cfg.world, 'image_size': geometry.image_size, 'patch_size': geometry.patch_size, **extra})

class WorldItems(Dataset):
    "Map-style dataset of batch items from the world; item i is a pure function of (spec, epoch, i)."
    def __init__(self, spec: BatchSpec, epoch: int = 0, split: str = 'train'):
        self.spec, self.epoch = spec, epoch
        src = spec.needs.region_source if spec.needs.regions else None
        self.world = WorldDataset(world_config(spec.data, spec.geometry, spec.world_seed), spec.data.world_length,
                                  split, rgb=src == 'superpixel')

    def __len__(self): return len(self.world)

    def __getitem__(self, i: int) -> dict:
        s = self.world[i]
        pool = (world_region_pool(s, self.spec.needs.region_source, self.spec.geometry.grid)
                if self.spec.needs.regions else None)
        return make_item(s['image'], s['text'], s['parsed'], int(s['index']), self.spec, self.epoch, pool)


def world_region_pool(sample: dict, source: str, grid: int) -> torch.Tensor | None:
    """The masks `(R, N)` a world sample offers to `region_masks`: its valid gold object masks ('gold'), the SLIC
    segments of its pixels on the `grid x grid` patch grid ('superpixel'; the sample needs `rgb`), None for 'random'."""
    if source == 'gold':
        return sample['masks'][sample['mask_valid']]
    if source == 'superpixel':
        return superpixel_masks(sample['rgb'].numpy(), GridConfig(grid, grid, crop='full')).masks
    return None


# %% [markdown]
# The world's gold trees carry labels, so its batches say which nodes are noun phrases (`node_np`): the root of
# a multi-object caption and every object mention are `NP`, the relation is `PP`.

# %%
_wi = WorldItems(BatchSpec(DataConfig(world_length=8), _geo, BatchNeeds(tree=True, node_np=True)))
_wb = collate([_wi[i] for i in range(4)])
for c in range(4):
    _gold = _wi.world[c]['parsed']
    test_eq(_wb['node_np'][c, :len(_gold.labels)].tolist(), [lab == 'NP' for lab in _gold.labels])
    assert not _wb['node_np'][c, len(_gold.labels):].any()
print(_wi.world[0]['parsed'].labels, _wb['node_np'][0].tolist())
# the world's captions tokenise the same with and without their tree
_wt = collate([WorldItems(BatchSpec(DataConfig(world_length=8), _geo))[i] for i in range(4)])
test_eq(_wt['tokens'], _wb['tokens'])
assert 'leaf_tokens' not in _wt and 'region_masks' not in _wt

# %% [markdown]
# ## Webdataset shards
#
# The pipeline of one worker, all in `WdsItems`:
#
# 1. **shards**: the shard list in an order drawn from `(data seed, epoch)`; process $r$ of $G$ with worker $w$ of
#    $n_w$ takes every $(Gn_w)$-th shard starting at $r n_w + w$ (so shards are split across both);
# 2. **read**: `read_shard` reads one tar with `webdataset.tarfile_to_samples` and a handler that keeps going
#    on read errors: of a truncated or corrupt tar the samples before the damage are kept, and the shard ends with
#    one *shard-error record* in the stream, which is skipped as one `shard_error` (its samples after the damage are
#    lost and cannot be counted: the index is gone);
# 3. **shuffle**: the worker's raw stream, in blocks of $K$ = `shuffle_buffer` samples, each block permuted (below);
# 4. **decode**: `decode_sample` reads the image and the caption, and the tree and the stored masks only if the
#    method needs them; on any problem it counts the reason, logs the key and returns `None`, and the sample is skipped;
# 5. **batch**: every $B$ usable samples make a batch (the last incomplete one is dropped), collated in the worker.
#
# Images go through open_clip's preprocessing (resize the short side, centre-crop, normalise). The default is
# the evaluation transform: `stored` masks were computed on the centred square (`regions.GridConfig(crop=
# 'center')`), so a random-resized crop would misplace them; pass another `preprocess` when masks are random.
#
# ### Exact resume: positions, not steps
#
# On the world, batch $b$ is a pure function of `(seed, epoch, b)`, so a step count is a position. On shards it is
# not: how many raw samples a batch used depends on how many bad ones were among them. So the loader counts
# **raw positions**, and the shuffle and every skip decision are pure functions of them.
#
# Let $x_0, x_1, \dots$ be worker $w$'s raw stream (samples and shard-error records, in its shard order) and
# $K = \max(1, \texttt{shuffle\_buffer})$. The shuffle emits, at output position $q$,
#
# $$y_q = x_{jK + \pi_j(t)}, \qquad j = \lfloor q / K \rfloor,\quad t = q \bmod K,$$
#
# where $\pi_j$ is a permutation of block $j$ (of its $n_j \le K$ samples; only the last block is shorter) drawn from
# `(data seed, epoch, r, w, j)`. Whether $y_q$ is skipped depends on its bytes alone. So everything from output
# $p$ on is fixed by $p$: to resume there, read the raw stream from the first sample of block $\lfloor p/K \rfloor$,
# permute the block again, and drop its first $p \bmod K$ outputs *without decoding them*: the same outputs follow,
# the same ones are skipped, the same batches are made. Skipped samples do not shift anything, because $p$ counts
# them too.
#
# What a worker must remember is therefore $p_w$ (outputs consumed) and where block $\lfloor p_w/K \rfloor$ starts
# in its shards, `at` = (shard index, raw samples into that shard), so that a resume opens that shard directly
# instead of reading the shards before it. Each batch carries its worker's $(p_w, \text{at})$ after its last sample;
# the main process keeps, per worker, those of the last batch it consumed: a `StreamPosition`, which the trainer
# saves in its checkpoint. A sample is held at most $K$ raw samples back, as webdataset's buffer holds it; we do not use
# that buffer because its state (up to $K$ raw samples, images included, per worker) would have to be saved or rebuilt
# from an unbounded distance back, while a block is rebuilt from $K$ samples.
#
# **Which worker's batch comes next.** The DataLoader asks its workers in turn, $0, 1, \dots, n_w - 1, 0, \dots$,
# passing over workers whose stream has ended, and the main process checks that every batch arrives in that turn.
# The position records $n$, the worker after the one whose batch (or end, below) came last; a resumed loader's
# physical worker $i$ plays the stream of worker $(i + n) \bmod n_w$, so the turns continue where they stopped. The
# streams are split by worker, so a run resumes with as many workers as it started with ($0$ and $1$ are the same
# single stream).
#
# ### Counting skips
#
# A batch carries the skips of its worker since that worker's previous batch, and each worker ends its stream with an
# *end record* carrying the skips after its last batch (those decoded for the dropped incomplete batch included). The
# main process adds the counts of what it consumes, and reads one item ahead, so that the end records that follow a
# batch are counted with it. The counts are therefore a function of the batches consumed, not of how far the workers
# had decoded ahead: the same in a straight and a resumed run, whatever the number of workers, and after a full pass
# they are every bad sample of the process's shards.

# %%
#| export
# image file suffixes; a shard member's key is the suffix without its dot
IMAGE_EXTS = ('.jpg', '.jpeg', '.png', '.webp', '.bmp')

def shard_urls(shards: str | list[str]) -> list[str]:
    "Expand '::'-separated brace patterns ('a/{000..009}.tar::b.tar') into a list of shard urls."
    import webdataset as wds
    if isinstance(shards, (list, tuple)):
        return [u for s in shards for u in shard_urls(s)]
    return list(wds.shardlists.expand_urls(shards))

def eval_transform(image_size: int):
    "open_clip's evaluation transform (resize, centre-crop, CLIP normalisation) at `image_size`."
    from open_clip import image_transform
    return image_transform(image_size, is_train=False)

def to_rgb(im: Image.Image) -> Image.Image:
    """An opened image as 8-bit RGB, by value: 16-bit grey ('I;16', or 'I' holding 0..65535, as Pillow opens 16-bit
    PNG) scaled to 0..255, not clipped at 255 (which `convert('RGB')` does: a white image); the 8-bit modes through
    Pillow (palette, grey, alpha dropped, CMYK). A ValueError for what has no known range (32-bit float 'F', 'I' beyond
    16 bits): the caller skips the image, saying why."""
    if im.mode.startswith('I;16') or im.mode == 'I':
        a = np.asarray(im).astype(np.int64)
        if a.size and (a.min() < 0 or a.max() > 65535):
            raise ValueError(f'mode {im.mode} image with values {a.min()}..{a.max()}: outside 16 bits, no known range')
        return Image.fromarray(((a * 255 + 32767) // 65535).astype(np.uint8), 'L').convert('RGB')
    if im.mode in ('F', 'I;32', 'I;32B', 'I;32L'):
        raise ValueError(f'mode {im.mode} image (32-bit values): no known range to map to 8 bits')
    return im.convert('RGB')


def tar_end_problem(path) -> str | None:
    """Why the plain `.tar` file `path` does not end as a complete tar (None when it does, or when it is no local plain
    tar): its end-of-archive blocks must follow the last member. Python's tarfile ends quietly at a header cut short
    (the rest of the shard silently missing); the annotator (`data_prep`) checks the same."""
    if not str(path).endswith('.tar') or not os.path.isfile(path):
        return None
    try:
        with tarfile.open(path, 'r:') as tf:
            tf.getmembers()
            end = tf.offset
        with open(path, 'rb') as f:
            f.seek(end)
            tail = f.read(1024)
    except (tarfile.TarError, OSError, EOFError) as e:
        return f'{type(e).__name__}: {e}'
    if len(tail) < 1024 or tail.strip(b'\0'):
        return f'no end-of-archive marker after byte {end} (file cut short?)'
    return None


def decode_sample(s: dict, spec: BatchSpec, epoch: int, preprocess, counter: SampleSkipCounter) -> dict | None:
    """A raw webdataset sample (bytes per extension) -> a batch item, or None (counted and logged) when unusable.
    Reads a tree (stored, or parsed on the fly) and stored masks only when the method needs them."""
    key, needs, cfg, geo = s.get('__key__', '?'), spec.needs, spec.data, spec.geometry
    def skip(reason, detail=''):
        counter.add(reason, f"{s.get('__url__', '')}:{key}", detail)
        return None
    if '__shard_error__' in s:
        return skip('shard_error', s['__shard_error__'])
    img = next((s[e[1:]] for e in IMAGE_EXTS if e[1:] in s), None)
    if img is None:
        return skip('no_image')
    try:
        with Image.open(io.BytesIO(img)) as im:
            im.load()
            im = to_rgb(im)            # by value: 16-bit scaled, not clipped; an image of no known range skipped
    except Exception as e:
        return skip('bad_image', repr(e)[:200])
    if why := caption_problem(s.get('txt')):
        return skip('no_caption', why)   # the annotator's rule (20_parsing)
    text = s['txt'].decode('utf-8') if isinstance(s['txt'], bytes) else s['txt']
    tt = None
    if needs.tree:
        if 'tree.json' in s:
            try:
                parsed = ParsedCaption.from_dict(json.loads(s['tree.json']))
                problems = tree_problems(parsed)
            except Exception as e:
                return skip('bad_tree', repr(e)[:200])
            if problems:
                return skip('bad_tree', '; '.join(problems)[:200])
        elif cfg.parse_missing:
            parsed = parse_caption(text)
        else:
            return skip('bad_tree', 'no .tree.json and parse_missing=False')
        tt = tree_tokens(parsed, context_length=geo.context_length)
        if not tt.node_valid.any():
            return skip('bad_tree', 'no node with a word')
    pool = None
    if needs.regions and needs.region_source == 'stored':
        if 'regions.npz' not in s:
            return skip('no_regions', 'no .regions.npz')
        try:
            pool, meta = decode_regions(s['regions.npz'])
        except Exception as e:
            return skip('bad_regions', repr(e)[:200])
        if (meta['grid_h'], meta['grid_w']) != (geo.grid, geo.grid):
            return skip('bad_regions', f"masks on a {meta['grid_h']}x{meta['grid_w']} grid, the model "
                                       f"has {geo.grid}x{geo.grid}")
        if not pool.any(1).any():
            return skip('no_regions', 'all stored masks empty')
    return make_item(preprocess(im), text, tt, key_index(key), spec, epoch, pool)

def read_shard(url: str):
    """Raw samples of one tar; read errors (a truncated or corrupt tar, or a local tar without its end-of-archive
    blocks: cut inside a header, `tar_end_problem`) end the shard with one shard-error record (`{'__shard_error__':
    what, '__url__': url}`), which `decode_sample` skips as a `shard_error`."""
    import webdataset as wds
    errors = []
    def handler(exn):
        errors.append(exn)
        return True
    yield from wds.tarfile_to_samples(handler=handler)(iter([dict(url=url)]))
    if not errors and (why := tar_end_problem(url)):   # cut inside a header: tarfile ends quietly, the tail is lost
        errors.append(why)
    if errors:
        yield {'__key__': url, '__url__': url, '__shard_error__': f'{len(errors)} read '
                                                                  f'error(s), first {errors[0]!r}'[:300]}


@dataclass
class StreamPosition:
    "Where one process's epoch stands after the batches it consumed (see above); the trainer checkpoints it."
    workers: int                   # streams n_w = max(1, data.workers): shards are split by worker
    step: int = 0                  # batches consumed in this epoch
    next: int = 0                  # the worker whose turn comes next
    pos: list = None               # per worker: outputs p_w of its shuffle consumed (skipped samples included)
    at: list = None                # per worker: [shard index, raw samples into it] where block p_w // K starts
    ended: list = None             # per worker: its end record was consumed
    skipped: dict = None           # skips among the consumed outputs of this epoch, by reason

    def __post_init__(self):
        n = self.workers
        self.pos = list(self.pos or [0] * n)
        self.at = [list(a) for a in (self.at or [[0, 0]] * n)]
        self.ended = list(self.ended or [False] * n)
        self.skipped = add_counts({}, self.skipped or {})
        if not len(self.pos) == len(self.at) == len(self.ended) == n:
            raise ValueError(f'a position of {n} workers needs {n} entries each')

    def due(self) -> int | None:
        "The worker whose batch comes next: the next in turn whose stream has not ended (None: all ended)."
        return next(((self.next + k) % self.workers for k in range(self.workers)
                     if not self.ended[(self.next + k) % self.workers]), None)

    def consume(self, meta: dict) -> None:
        "Account for one consumed batch or end record of worker `meta['worker']`."
        w = meta['worker']
        if w != self.due():
            raise RuntimeError(f'worker {w} delivered out of turn (worker {self.due()} was due): exact resume '
                                               "relies on the DataLoader asking its workers in turn")
        self.pos[w], self.at[w], self.ended[w] = meta['pos'], list(meta['at']), meta['end']
        self.skipped = add_counts(self.skipped, meta['skips'])
        self.next = (w + 1) % self.workers

    def to_dict(self) -> dict: return asdict(self)


def n_streams(cfg: DataConfig) -> int:
    "Worker streams of a shard epoch: 0 and 1 DataLoader workers are the same single stream."
    return max(1, cfg.workers)


class WdsItems(IterableDataset):
    "Batches (collated in the worker, each with its `_meta`) of webdataset shards, from a `StreamPosition` (see above)."
    def __init__(self, spec: BatchSpec, epoch: int = 0, position: StreamPosition | None = None, preprocess=None,
                 rank: int = 0, world_size: int = 1):
        self.spec, self.cfg, self.epoch, self.rank, self.G = spec, spec.data, epoch, rank, world_size
        self.position = position or StreamPosition(n_streams(spec.data))
        self.preprocess = preprocess or eval_transform(spec.geometry.image_size)
        self.urls = shard_urls(spec.data.shards)
        if not self.urls:
            raise ValueError(f'no shards in {spec.data.shards!r}')

    def shards(self, w: int) -> list[str]:
        "Worker w's shards in this epoch: the epoch's shard order, every (G n_w)-th from r n_w + w."
        urls, nw = list(self.urls), self.position.workers
        random.Random(mix_seed(self.spec.order_seed, self.epoch)).shuffle(urls)
        return urls[self.rank * nw + w::self.G * nw]

    def __iter__(self):
        info, P = get_worker_info(), self.position
        if (1 if info is None else info.num_workers) != P.workers:
            raise RuntimeError(f'a position of {P.workers} worker streams read by {info.num_workers} workers')
        w = ((0 if info is None else info.id) + P.next) % P.workers   # physical worker i plays stream (i + n) mod n_w
        if not P.ended[w]:
            yield from self.stream(w)

    def raw(self, shards: list[str], at) -> itertools.chain:
        "(raw sample, where the stream stands after it) from `at` = [shard index, raw samples into it] on."
        for i in range(at[0], len(shards)):
            for k, s in enumerate(read_shard(shards[i]), 1):
                if i > at[0] or k > at[1]:
                    yield s, [i, k]

    def stream(self, w: int):
        "Worker w's batches from its position on, then its end record."
        P, B = self.position, self.cfg.batch_size
        K = max(1, self.cfg.shuffle_buffer)
        p0, head = P.pos[w], list(P.at[w])
        j, end = p0 // K, p0                     # block of the first output due; outputs of the stream so far
        raw, skips, items = self.raw(self.shards(w), head), SampleSkipCounter(), []
        while block := list(itertools.islice(raw, K)):
            start, head = head, block[-1][1]      # where block j starts, and where block j + 1 does
            order = list(range(len(block)))
            random.Random(mix_seed(self.spec.order_seed, self.epoch, self.rank, w, j)).shuffle(order)   # pi_j
            for t, b in enumerate(order):
                q = j * K + t                     # output position of this sample
                if q < p0:
                    continue               # consumed before the resume: neither decoded nor counted again
                s = block[b][0]
                try:
                    item = decode_sample(s, self.spec, self.epoch, self.preprocess, skips)
                except Exception as e:   # a bug or a case we did not foresee: still count it, never kill the epoch
                    skips.add('bad_image' if 'image' in repr(e).lower() else 'bad_tree',
                              s.get('__key__', '?'), repr(e)[:200])
                    item = None
                if item is None:
                    continue
                items.append(item)
                if len(items) == B:
                    p = q + 1
                    batch = collate(items, node_np=self.spec.needs.node_np)
                    items = []
                    batch['_meta'] = dict(worker=w, pos=p, at=start if p % K else head, skips=skips.take(), end=False)
                    yield batch
            end = j * K + len(block)
            j += 1
        yield {'_meta': dict(worker=w, pos=end, at=head, skips=skips.take(), end=True, left=len(items))}


# %% [markdown]
# ## The loader
#
# `make_loader(spec, epoch, start_step | position)` is what the trainer calls once per epoch. It returns a `Loader`:
# iterate it for batches, `len()` for the remaining steps (when known), `skipped()` for the skip counts of this epoch
# so far (summed over the batches consumed), `state()` for the position to save in a checkpoint. The world resumes
# from a step alone; shards need the position saved with it.

# %%
#| export
def _as_is(x): return x        # the DataLoader's collate for items that are batches already (picklable)


def quiet_worker(worker_id: int) -> None:
    """A DataLoader worker ignores SIGINT and SIGTERM: a Ctrl-C reaches the whole process group, and the main process
    decides where to stop (the trainer, at a step boundary); it ends its workers itself."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class Loader:
    """Batches of one epoch from a position on, with the skips among the samples consumed and the position reached;
    `usable`: the usable samples the workers' streams ended with, fewer than a batch (dropped)."""
    def __init__(self, dataloader: DataLoader, steps: int | None, position: StreamPosition):
        self.dataloader, self.steps, self.position = dataloader, steps, copy.deepcopy(position)
        self.usable = 0

    def __iter__(self):
        P, it = self.position, iter(self.dataloader)
        def pull():   # the next batch, consuming the end records before it; None when the workers are done
            for x in it:
                meta = x.pop('_meta', None) if isinstance(x, dict) else None
                if meta is None or not meta['end']:
                    return x, meta
                P.consume(meta)
                self.usable += meta.get('left', 0)
            return None
        nxt = None if self.steps is not None and P.step >= self.steps else pull()
        while nxt is not None:
            batch, meta = nxt
            if meta is not None:
                P.consume(meta)
            P.step += 1
            # read one ahead: the end records that follow this batch are counted with it (none after the last step)
            nxt = pull() if self.steps is None or P.step < self.steps else None
            yield batch

    def __len__(self):
        if self.steps is None:
            raise TypeError('the number of steps of a shard epoch is unknown: set samples_per_epoch')
        return max(0, self.steps - self.position.step)

    def skipped(self) -> dict[str, int]: return dict(self.position.skipped)
    def state(self) -> StreamPosition: return copy.deepcopy(self.position)


def steps_per_epoch(cfg: DataConfig, world_size: int = 1) -> int | None:
    "Full steps per epoch and process: world: world_length // (B G); wds: samples_per_epoch // B or None."
    if cfg.source == 'world':
        return cfg.world_length // (cfg.batch_size * world_size)
    return None if cfg.samples_per_epoch is None else cfg.samples_per_epoch // cfg.batch_size

def make_loader(spec: BatchSpec, epoch: int = 0, start_step: int = 0, preprocess=None, rank: int = 0,
                world_size: int = 1, position: StreamPosition | dict | None = None,
                pin_memory: bool = False) -> Loader:
    """The loader of one epoch for process `rank` of `world_size`, from `start_step` (the world) or from `position`
    (`Loader.state()` of an earlier loader of this epoch; shards need it to resume). `pin_memory`: batches in
    page-locked host memory, so that a GPU's non-blocking copies overlap compute (the trainer asks for it on CUDA)."""
    cfg = spec.data
    if isinstance(position, dict):
        position = StreamPosition(**position)
    if position is None:
        if start_step and cfg.source == 'wds':
            raise ValueError('shards resume from the position a loader reached (Loader.state()), not from a step alone')
        position = StreamPosition(n_streams(cfg), step=start_step)
    elif start_step not in (0, position.step):
        raise ValueError(f'start_step {start_step} is not the position\'s step {position.step}')
    if cfg.source == 'world':
        sampler = EpochBatchSampler(cfg.world_length, cfg.batch_size, spec.order_seed, epoch, position.step,
                                    rank, world_size)
        dl = DataLoader(WorldItems(spec, epoch), batch_sampler=sampler, num_workers=cfg.workers,
                        collate_fn=partial(collate, node_np=spec.needs.node_np), pin_memory=pin_memory,
                        worker_init_fn=quiet_worker if cfg.workers else None)
        return Loader(dl, sampler.steps, position)
    if position.workers != n_streams(cfg):
        raise ValueError(f'data.workers: the shard position was reached with {position.workers} worker stream(s); '
                         f'shards are split by worker, so resume with data.workers={position.workers}'
                         + (' (or 0)' if position.workers == 1 else ''))
    ds = WdsItems(spec, epoch, position, preprocess, rank, world_size)
    dl = DataLoader(ds, batch_size=None, num_workers=cfg.workers, collate_fn=_as_is, pin_memory=pin_memory,
                    worker_init_fn=quiet_worker if cfg.workers else None)
    return Loader(dl, steps_per_epoch(cfg, world_size), position)


# %% [markdown]
# ### The world loader
#
# A small world epoch; with 2 workers the batches are identical to those with none, and resuming at step 2
# gives exactly the remaining batches of the uninterrupted epoch.

# %%
_gold = BatchNeeds(tree=True, regions=4, region_source='gold')
wspec = BatchSpec(DataConfig(batch_size=8, workers=0, world_length=40), _geo, _gold)
t0 = time.time()
full = list(make_loader(wspec, epoch=0))
print(f'{len(full)} world batches of 8 in {time.time() - t0:.2f} s (main process)')
b = full[0]
test_eq(len(full), 5)
test_eq(b['image'].shape, (8, 3, 64, 64))
test_eq(b['region_masks'].shape, (8, 4, 64))
test_eq(b['tokens'].shape, (8, 77))
test_eq(b['tokens'].dtype, torch.long)
assert all(b['region_masks'][c][b['region_valid'][c]].any(1).all() for c in range(8))   # valid masks non-empty
assert not b['region_masks'][~b['region_valid']].any()                                   # padding all False
# gold masks: every valid region is one of the sample's gold object masks
s0 = WorldDataset(world_config(wspec.data, _geo, wspec.world_seed), 40)[int(b['index'][0])]
gold = {tuple(r.tolist()) for r in s0['masks'][s0['mask_valid']]}
assert {tuple(r.tolist()) for r in b['region_masks'][0][b['region_valid'][0]]} <= gold
test_eq(sorted(torch.cat([x['index'] for x in full]).tolist()), list(range(40)))          # an epoch is a permutation
# superpixels: M of the image's SLIC segments on the patch grid (Table 7's third mask source); shards store theirs
_sp = BatchSpec(wspec.data, _geo, BatchNeeds(tree=True, regions=4, region_source='superpixel'))
bs = next(iter(make_loader(_sp, epoch=0)))
s0 = WorldDataset(world_config(wspec.data, _geo, wspec.world_seed), 40, rgb=True)[int(bs['index'][0])]
test_eq(s0['rgb'].shape, (64, 64, 3))
test_eq(s0['rgb'].dtype, torch.uint8)
segs = {tuple(r.tolist()) for r in superpixel_masks(s0['rgb'].numpy(), GridConfig(8, 8, crop='full')).masks}
assert len(segs) > 4 and {tuple(r.tolist()) for r in bs['region_masks'][0][bs['region_valid'][0]]} <= segs
test_eq(bs['region_valid'].all(), True)
test_fail(lambda: BatchSpec(DataConfig(source='wds', shards='x.tar'), _geo,
                            BatchNeeds(regions=4, region_source='superpixel')),
          contains="need data.source='world'")
def same(xs, ys): return len(xs) == len(ys) and all(torch.equal(x[k], y[k]) for x, y in zip(xs, ys) for k in x)
assert same(list(make_loader(wspec, 0, start_step=2)), full[2:])                          # exact resume
_w2 = BatchSpec(DataConfig(batch_size=8, workers=2, world_length=40), _geo, _gold)
assert same(list(make_loader(_w2, 0)), full)                                             # 2 workers == 0 workers
test_eq(len(make_loader(wspec, 0, start_step=2)), 3)
# another run seed: other batches
assert not same(list(make_loader(BatchSpec(wspec.data, _geo, _gold, seed=1), 0)), full)
# a CLIP run on the same data: the same images and tokens, no tree and no region mask
_clip = list(make_loader(BatchSpec(wspec.data, _geo, BatchNeeds()), epoch=0))
test_eq(set(_clip[0]), {'image', 'tokens', 'index'})
assert all(torch.equal(x[k], y[k]) for x, y in zip(_clip, full) for k in ('image', 'tokens', 'index'))

# %% [markdown]
# What the loss sees: world images with their caption and, on the $8\times8$ patch grid, the gold object masks
# (top) and $M=4$ random boxes of this epoch (bottom), each region in its own colour.

# %%
import textwrap

import matplotlib.pyplot as plt
from powerclip.world import CLIP_MEAN, CLIP_STD
rb = next(iter(make_loader(BatchSpec(wspec.data, _geo, BatchNeeds(tree=True, regions=4)), epoch=0)))
fig, axs = plt.subplots(2, 4, figsize=(10, 5.4))
cols = plt.cm.tab10(np.arange(4))[:, :3]
for row, bb in enumerate((b, rb)):
    for c in range(4):
        img = (bb['image'][c].permute(1, 2, 0) * torch.tensor(CLIP_STD) + torch.tensor(CLIP_MEAN)).clamp(0, 1).numpy()
        over = np.zeros((8, 8, 4))
        for m in range(4):
            if bb['region_valid'][c, m]:
                over[bb['region_masks'][c, m].view(8, 8).numpy()] = [*cols[m], 0.35]
        ax = axs[row, c]
        ax.imshow(img)
        ax.imshow(over, extent=(0, 64, 64, 0))
        ax.set_xticks([])
        ax.set_yticks([])
        if row == 0:
            s_ = WorldDataset(world_config(wspec.data, _geo, wspec.world_seed), 40)[int(bb['index'][c])]
            ax.set_title('\n'.join(textwrap.wrap(s_['text'], 30)), fontsize=7)
axs[0, 0].set_ylabel('gold masks')
axs[1, 0].set_ylabel('random boxes')
plt.tight_layout()
plt.show()


# %% [markdown]
# ## Shards: a tiny CC12M in a temporary folder
#
# `write_shard` writes samples in img2dataset's layout. The test shards hold 6 good samples and, on purpose,
# one of each kind of bad sample: a corrupt JPEG, an empty caption, a sample without image, an unparsable
# tree, stored masks on the wrong grid, and a third shard cut off in the middle of a member (a truncated
# download).

# %%
#| export
def write_shard(path, samples: list[dict]):
    "Write a webdataset tar: each sample a dict with '__key__' and extension -> bytes/str (img2dataset layout)."
    import webdataset as wds
    with wds.TarWriter(str(path)) as w:
        for s in samples:
            w.write({k: (v.encode() if isinstance(v, str) and k != '__key__' else v) for k, v in s.items()})


# %%
def jpeg(seed, size=(80, 60)):
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (*size[::-1], 3), dtype=np.uint8)).save(buf, 'JPEG')
    return buf.getvalue()

def good(i, tree=True):
    s = {'__key__': f'{i:09d}', 'jpg': jpeg(i), 'txt': f'a photo of a red car number {i}',
         'json': json.dumps({'key': f'{i:09d}', 'status': 'success'})}
    words = s['txt'].split()
    if tree:
        s['tree.json'] = json.dumps(ParsedCaption(s['txt'], words, [(0, len(words)), (0, 3), (3, len(words))],
                                                      ['NP', 'NP', 'PP'], 'gold', []).to_dict())
    from powerclip.regions import encode_regions
    s['regions.npz'] = encode_regions(torch.eye(3, 64, dtype=torch.bool), 8, 8, 'test')
    return s

def build_shards(root):
    root = Path(root)
    bad = [dict(good(100), jpg=b'\xff\xd8 not a jpeg'), dict(good(101), txt='  '),
           {k: v for k, v in good(102).items() if k != 'jpg'}, dict(good(103), **{'tree.json': '{"words": 3'}),
           dict(good(104), **{'regions.npz': encode_regions(torch.ones(2, 49, dtype=torch.bool), 7, 7)})]
    write_shard(root / '00000.tar', [good(0), bad[0], good(1), bad[1], good(2, tree=False)])
    write_shard(root / '00001.tar', [good(3), bad[2], good(4), bad[3], good(5), bad[4]])
    write_shard(root / 'full.tar', [good(i) for i in range(200, 208)])
    data = (root / 'full.tar').read_bytes()
    (root / '00002.tar').write_bytes(data[:len(data) // 2 + 700])      # cut in the middle of a member
    (root / 'full.tar').unlink()
    return str(root / '{00000..00002}.tar')

from powerclip.regions import encode_regions
tmp = tempfile.TemporaryDirectory()
pattern = build_shards(tmp.name)
with tarfile.open(Path(tmp.name) / '00001.tar') as t:
    print(t.getnames()[:6])

# %% [markdown]
# Reading all three shards with `stored` masks: the good samples come through (the truncated shard gives the
# members before the cut), each bad one is counted under its reason, and nothing raises.

# %%
scfg = BatchSpec(DataConfig(source='wds', shards=pattern, batch_size=2, workers=0, shuffle_buffer=0), _geo,
                 BatchNeeds(tree=True, node_np=True, regions=4, region_source='stored'))
ld = make_loader(scfg, epoch=0)
batches = list(ld)
n_good = sum(len(x['index']) for x in batches)
print(n_good, 'samples in', len(batches), 'batches; skipped:', {k: v for k, v in ld.skipped().items() if v})
test_eq({k: ld.skipped()[k] for k in ('bad_image', 'no_caption', 'no_image', 'bad_tree', 'bad_regions')},
        dict(bad_image=1, no_caption=1, no_image=1, bad_tree=1, bad_regions=1))
test_eq(ld.skipped()['shard_error'], 1)                            # the truncated shard
b = batches[0]
test_eq(b['image'].shape, (2, 3, 64, 64))
test_eq(b['region_masks'].shape, (2, 4, 64))
test_eq(b['region_valid'].sum(1).tolist(), [3, 3])                 # 3 stored masks, 1 padding row
assert n_good >= 6 + 1                                             # 6 good samples + the intact part of the truncated
                                                                   # shard
assert abs(float(b['image'].mean())) < 3                           # normalised, not raw 0..255
# the labels of the stored {key}.tree.json (NP, NP, PP) reach the batch as `node_np`
assert all(x['node_np'].shape == x['node_valid'].shape for x in batches)
assert any(r[:3].tolist() == [True, True, False] for x in batches for r in x['node_np'])

# %% [markdown]
# A CLIP run on the same shards reads no tree, parses no caption and decodes no mask: only image and caption
# problems skip samples, and the batches hold image, tokens and index.

# %%
ld0 = make_loader(BatchSpec(scfg.data, _geo), epoch=0)
b0 = list(ld0)
test_eq({k: v for k, v in ld0.skipped().items() if v}, dict(shard_error=1, no_image=1, bad_image=1, no_caption=1))
test_eq(set(b0[0]), {'image', 'tokens', 'index'})
assert sum(len(x['index']) for x in b0) == n_good + 2   # the bad tree and the bad masks do not matter to CLIP

# %% [markdown]
# Counted, not guessed. A shard cut inside a tar header ends quietly in Python's `tarfile` (the samples after the cut
# simply missing), so the end of a local tar is checked as the annotator checks it (`tar_end_problem`): it counts as a
# `shard_error`. Images are converted by value: a 16-bit PNG is scaled to 8 bits (`convert('RGB')` clips it to white),
# an image of 32-bit floats, whose range is unknown, is skipped as a `bad_image` with that reason. An epoch whose
# samples were all skipped gives no batch, and the loader knows why: its skip counts, and no usable sample left over.

# %%
with tempfile.TemporaryDirectory() as d:
    d = Path(d)
    write_shard(d / 'full.tar', [good(i, tree=False) for i in range(300, 304)])
    raw = (d / 'full.tar').read_bytes()
    with tarfile.open(d / 'full.tar') as t:
        cut = t.getmembers()[-2].offset + 100            # inside the header of the last sample's second-last member
    (d / 'cut.tar').write_bytes(raw[:cut])
    test_eq(tar_end_problem(d / 'full.tar'), None)
    assert 'no end-of-archive marker' in tar_end_problem(d / 'cut.tar')
    _ld = make_loader(BatchSpec(DataConfig(source='wds', shards=str(d / 'cut.tar'), batch_size=1, workers=0,
                                           shuffle_buffer=0), _geo), epoch=0)
    # the 3 whole samples before the cut; the cut one lacks its caption; and the cut itself is counted
    test_eq((len(list(_ld)), _ld.skipped()['no_caption'], _ld.skipped()['shard_error']), (3, 1, 1))
    buf16, bufF = io.BytesIO(), io.BytesIO()
    Image.fromarray(np.full((40, 40), 32768, dtype=np.uint16)).save(buf16, 'PNG')      # 16-bit mid-grey
    Image.fromarray(np.full((40, 40), 0.5, dtype=np.float32)).save(bufF, 'TIFF')       # 32-bit floats
    with Image.open(io.BytesIO(buf16.getvalue())) as _im:
        test_eq(np.asarray(to_rgb(_im))[0, 0].tolist(), [128, 128, 128])               # not 255 (clipped)
    _nojpg = lambda i: {k: v for k, v in good(i, tree=False).items() if k != 'jpg'}
    write_shard(d / 'odd.tar', [dict(_nojpg(400), png=buf16.getvalue()), dict(_nojpg(401), png=bufF.getvalue())])
    _c = SampleSkipCounter()
    _items = [decode_sample(x, BatchSpec(DataConfig(), _geo), 0, eval_transform(64), _c)
              for x in read_shard(str(d / 'odd.tar'))]
    assert _items[0] is not None and _items[1] is None and _c.counts['bad_image'] == 1, _c.counts
    # every sample skipped: the counts say so, and no usable sample was left over
    write_shard(d / 'bad.tar', [dict(good(i, tree=False), jpg=b'not a jpeg') for i in range(3)])
    _ld = make_loader(BatchSpec(DataConfig(source='wds', shards=str(d / 'bad.tar'), batch_size=2, workers=0), _geo),
                      epoch=0)
    test_eq((list(_ld), _ld.usable, _ld.skipped()['bad_image']), ([], 0, 3))


# %% [markdown]
# ### Exact resume on shards
#
# The same shards with the bad samples, a shuffle block of $K=3$ (so blocks straddle shards and bad samples), in the
# main process and with 2 workers: stopped after *every* step and resumed from the position it reached, the loader
# gives exactly the remaining batches, and its skip counts end where the straight pass's do, which are all the bad
# samples of the shards, the one decoded for the dropped incomplete last batch included.

# %%
def with_positions(spec, epoch=0, position=None):
    "Every batch of an epoch with the loader's position after it."
    ld = make_loader(spec, epoch, position=position)
    return [(b, ld.state()) for b in ld], ld

_clip_all = BatchSpec(DataConfig(source='wds', shards=pattern, batch_size=2, workers=0, shuffle_buffer=3), _geo)
t0 = time.time()
for nw in (0, 2):
    rspec = BatchSpec(DataConfig(**{**_clip_all.data.__dict__, 'workers': nw}), _geo)
    run, ld = with_positions(rspec, epoch=1)
    full, states = [b for b, _ in run], [st for _, st in run]
    test_eq(ld.skipped(),
            dict(shard_error=1, no_image=1, bad_image=1, no_caption=1, bad_tree=0, no_regions=0, bad_regions=0))
    for s, st in enumerate(states[:-1], 1):
        rest, ld_r = with_positions(rspec, epoch=1, position=st)
        assert same([b for b, _ in rest], full[s:]), (nw, s)
        test_eq(ld_r.skipped(), ld.skipped())
        test_eq(ld_r.state(), ld.state())
    # the shuffle is a shuffle: another epoch, another order; the same epoch again, the same order
    assert not same(list(make_loader(rspec, epoch=2)), full) and same(list(make_loader(rspec, epoch=1)), full)
print(f'{len(full)} shard batches, resumed after each step with 0 and 2 workers: exact ({time.time() - t0:.1f} s)')
# a step is not a shard position
test_fail(lambda: make_loader(rspec, 1, start_step=2), contains='position')
test_fail(lambda: make_loader(BatchSpec(DataConfig(**{**rspec.data.__dict__, 'workers': 3}), _geo), 1,
                              position=states[1]),
          contains='data.workers=2')
