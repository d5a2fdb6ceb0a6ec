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

import hashlib
import io
import itertools
import json
import logging
import math
import random
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, get_worker_info

from powerclip.parsing import (ParsedCaption, TreeTokens, caption_problem, collate_trees, default_tokenizer, parse_caption,
                               tree_problems, tree_tokens)
from powerclip.regions import decode_regions, random_box_masks, select_masks
from powerclip.world import WorldConfig, WorldDataset

logger = logging.getLogger(__name__)

# %%
#| hide
import tarfile
import tempfile
import time
from pathlib import Path

from fastcore.test import test_eq, test_fail


# %% [markdown]
# # Data
#
# > Batches from the built-in world or from CC12M-style webdataset shards, with only what the method asked for: images and caption tokens always, parse-tree masks and region masks on the patch grid when needed; the model's geometry; the run seed's streams; and an account of every sample skipped.

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
#
# With a tree the tokens are built by `parsing.tree_tokens`, so each word's BPE positions are known; without one the
# caption is tokenised as it stands by the model's tokenizer (`caption_tokens`), and on shards no caption is parsed
# at all. A CLIP run therefore draws no region mask and parses nothing.
#
# Two sources feed it. **The world** (`22_world`): sample $i$ is a pure function of `(seed, i)`, with a gold
# parse tree and gold object masks, so training on it is exactly reproducible and resumable. **Shards**: CC12M
# as img2dataset writes it (`{key}.jpg`, `{key}.txt`, `{key}.json` in tar files), optionally annotated by
# `data_prep` with `{key}.tree.json` (a `ParsedCaption.to_dict()`) and `{key}.regions.npz` (segmentation
# masks on the patch grid, `regions.encode_regions`). Web data is dirty: every sample that cannot be used is
# **skipped, counted by reason and logged**, never a crash in the middle of an epoch.
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
# - the *run seed*, from which the data order, the world's training scenes and the region draws are derived by name.
#
# `BatchSpec` holds the four; `make_loader(spec, epoch, ...)` makes the batches.

# %%
#| export
@dataclass
class DataConfig:
    "Where batches come from and how they are loaded; the run writes it next to its outputs."
    source: str = 'world'          # 'world': the built-in procedural world; 'wds': webdataset shards (CC12M layout)
    shards: str = ''               # wds: shard paths/urls, brace patterns allowed ('cc12m/{00000..01242}.tar'), '::' separated
    batch_size: int = 64           # per process
    workers: int = 2               # DataLoader worker processes (0: load in the main process)
    world_length: int = 100_000    # world: samples per epoch (indices 0 .. world_length-1 of the 'train' split)
    world: dict = field(default_factory=dict)  # world: extra WorldConfig fields (max_objects, relations, ...); its
                                   # image and patch size are the model's, its seed derives from the run seed
    shuffle_buffer: int = 1000     # wds: per-worker sample shuffle buffer (0: shard order only)
    samples_per_epoch: int | None = None  # wds: samples per process per epoch (None: one pass over its shards)
    parse_missing: bool = True     # wds, methods that need a tree: parse captions without {key}.tree.json on the fly (else skip them)

    def __post_init__(self):
        if self.source not in ('world', 'wds'): raise ValueError(f"source must be 'world' or 'wds', got {self.source!r}")
        if self.source == 'wds' and not self.shards: raise ValueError("source='wds' needs shards")
        if self.batch_size < 1 or self.workers < 0: raise ValueError('need batch_size >= 1, workers >= 0')
        owned = sorted({'image_size', 'patch_size', 'seed'} & set(self.world))
        if owned: raise ValueError(f"data.world may not set {owned}: image and patch size are the model's, the seed derives from the run seed")


@dataclass(frozen=True)
class Geometry:
    "The model's input geometry (`powerclip.model.model_geometry` reads it from the model config)."
    image_size: int      # H = W in pixels
    patch_size: int      # ViT patch side: the patch grid is (image_size // patch_size)^2, row-major
    context_length: int  # text tokens

    def __post_init__(self):
        if self.image_size % self.patch_size: raise ValueError(f'image_size {self.image_size} is not a multiple of patch_size {self.patch_size}')

    @property
    def grid(self) -> int: return self.image_size // self.patch_size


REGION_SOURCES = ('random', 'gold', 'stored')


@dataclass(frozen=True)
class BatchNeeds:
    "What a method reads of a batch beyond image, tokens and index; the pipeline builds exactly this."
    tree: bool = False             # leaf_tokens, leaf_valid, incidence, node_valid (the caption's parse tree)
    node_np: bool = False          # node_np: which nodes are noun phrases (needs tree)
    regions: int = 0               # M region masks per image (0: none)
    region_source: str = 'random'  # 'random' boxes | 'gold' world object masks | 'stored' {key}.regions.npz masks

    def __post_init__(self):
        if self.node_np and not self.tree: raise ValueError('node_np needs tree=True (the labels are the parse tree\'s)')
        if self.regions < 0: raise ValueError(f'regions must be >= 0, got {self.regions}')
        if self.region_source not in REGION_SOURCES: raise ValueError(f"region_source must be one of {REGION_SOURCES}, got {self.region_source!r}")

    def keys(self) -> tuple[str, ...]:
        "The batch keys these needs add to those of every batch (image, tokens, index)."
        return ((('leaf_tokens', 'leaf_valid', 'incidence', 'node_valid') if self.tree else ())
                + (('node_np',) if self.node_np else ()) + (('region_masks', 'region_valid') if self.regions else ()))


@dataclass(frozen=True)
class BatchSpec:
    "Everything that fixes the batches of a run (see above)."
    data: DataConfig
    geometry: Geometry
    needs: BatchNeeds = BatchNeeds()
    seed: int = 0                  # the run seed: data order, world scenes and region draws derive from it by name

    def __post_init__(self):
        src, n = self.needs.region_source, self.needs.regions
        if n and src == 'gold' and self.data.source != 'world': raise ValueError("region masks 'gold' need data.source='world'")
        if n and src == 'stored' and self.data.source != 'wds': raise ValueError("region masks 'stored' need data.source='wds'")

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
test_fail(lambda: BatchSpec(DataConfig(source='wds', shards='x.tar'), Geometry(64, 8, 77), BatchNeeds(regions=4, region_source='gold')), contains='gold')
test_fail(lambda: BatchNeeds(node_np=True), contains='tree')
test_eq(BatchNeeds().keys(), ())
test_eq(BatchNeeds(tree=True, regions=3).keys()[-2:], ('region_masks', 'region_valid'))

# %% [markdown]
# ## One run seed, many streams
#
# A run has one seed (`TrainConfig.seed`). Every random stream of the run is derived from it *by name*, so that
# changing the seed changes all of them together (a comparison over seeds then varies the initial weights, the data
# order, the world's training scenes, the region draws and a method's noise), while each stream stays independent
# of the others:
#
# | stream | used for |
# |---|---|
# | `init` | the model's initial weights |
# | `data` | the order of the world indices and of the shards, the shuffle buffer |
# | `world` | the world's training scenes (`WorldConfig.seed`) |
# | `regions` | region masks drawn per sample (random boxes, a subset of gold or stored masks) |
# | `method` | a method's own noise (CLIP-PGS's random candidates) |
# | `forward` | each process's random state during the forward pass (FLIP's dropout), with the rank mixed in |
#
# `derive_seed(seed, name)` hashes the seed and the name with NumPy's `SeedSequence`, whose purpose is exactly this:
# nearby inputs give unrelated streams. `mix_seed` does the same for tuples of integers (seed, epoch, index), and
# `key_index` turns a shard key into a stable 56-bit id (a hash, identical on every machine and run). The values are
# written into the run's `config.yaml`. Held-out evaluation scenes are *not* derived from the run seed: they are a
# fixed benchmark (the world's own default seed, on its `test` split).

# %%
#| export
SEED_STREAMS = ('init', 'data', 'world', 'regions', 'method', 'forward')

def mix_seed(*xs: int) -> int:
    "One 63-bit seed from non-negative integers (e.g. seed, epoch, index)."
    return int(np.random.SeedSequence([int(x) for x in xs]).generate_state(1, np.uint64)[0] >> np.uint64(1))

def key_index(key: str) -> int:
    "A stable non-negative 56-bit id for a shard sample key."
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=7).digest(), 'big')

def derive_seed(seed: int, stream: str) -> int:
    "The seed of the named random stream of a run with seed `seed` (see the table above)."
    if stream not in SEED_STREAMS: raise ValueError(f'unknown random stream {stream!r}; streams: {SEED_STREAMS}')
    return mix_seed(seed, key_index(stream))

def run_seeds(seed: int) -> dict[str, int]:
    "Every stream's seed of a run (what `config.yaml` records)."
    return {s: derive_seed(seed, s) for s in SEED_STREAMS}

def sample_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    "The torch generator of one sample's random draws (region masks) in one epoch."
    return torch.Generator().manual_seed(mix_seed(seed, epoch, index))


# %%
test_eq(mix_seed(0, 1, 2), mix_seed(0, 1, 2)); assert mix_seed(0, 1, 2) != mix_seed(0, 2, 1)
assert 0 <= mix_seed(2**40, 7) < 2**63
test_eq(key_index('000123456'), key_index('000123456')); assert key_index('a') != key_index('b') and key_index('a') < 2**56
_rs = run_seeds(0)
assert len(set(_rs.values())) == len(SEED_STREAMS) and _rs == run_seeds(0) and _rs != run_seeds(1)
test_eq(derive_seed(0, 'data'), _rs['data']); test_fail(lambda: derive_seed(0, 'dat'), contains='unknown random stream')

# %% [markdown]
# ## Skip accounting across worker processes
#
# Samples are decoded in DataLoader worker processes, so a counter in the dataset object would stay in the
# worker. `SkipCounter` keeps a shared-memory table with **one row per worker** (plus one for the main
# process): each process only adds to its own row, so no lock is needed and no count is lost; `counts()`
# sums the rows.

# %%
#| export
SKIP_REASONS = ('shard_error',   # unreadable / truncated tar or a read error inside it
                'no_image',      # no member with an image extension (IMAGE_EXTS)
                'bad_image',     # the image bytes do not decode
                'no_caption',    # missing .txt, or a caption parsing.caption_problem rejects (not UTF-8, no letter or digit)
                'bad_tree',      # tree needed: unparsable .tree.json, a tree without a valid node, or no tree when parsing is off
                'no_regions',    # stored masks needed: no .regions.npz or no non-empty mask in it
                'bad_regions')   # stored masks needed: masks on another grid or unreadable

class SkipCounter:
    "Per-reason counts of skipped samples, summed over DataLoader workers; also a webdataset handler."
    def __init__(self, workers: int = 0):
        self.table = torch.zeros(workers + 1, len(SKIP_REASONS), dtype=torch.long).share_memory_()

    def add(self, reason: str, key: str = '', detail: str = ''):
        w = get_worker_info()
        row = 0 if w is None else min(w.id + 1, self.table.shape[0] - 1)
        self.table[row, SKIP_REASONS.index(reason)] += 1
        logger.warning('skipped sample %r: %s %s', key, reason, detail)

    def counts(self) -> dict[str, int]: return dict(zip(SKIP_REASONS, self.table.sum(0).tolist()))
    def total(self) -> int: return int(self.table.sum())


# %%
sc = SkipCounter(2)
sc.add('bad_image', 'k1', 'test'); sc.add('shard_error', 'a.tar', "ReadError('unexpected end of data')")
test_eq(sc.counts()['bad_image'], 1); test_eq(sc.counts()['shard_error'], 1); test_eq(sc.total(), 2)
test_fail(lambda: sc.add('no_such_reason'))


# %% [markdown]
# ## One sample, any source
#
# `make_item` turns what a source knows about a sample (a normalised image tensor, its caption, its parse tree
# when the method needs one, optionally a pool of candidate masks) into the per-sample part of the batch:
#
# - tokens: with a tree, `parsing.tree_tokens` (the word positions come with them); without, `caption_tokens`,
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
    if mode == 'random': return random_box_masks(grid, grid, M, gen)
    if pool is None: raise ValueError(f'masks={mode!r} needs a pool of masks')
    pool = pool[pool.any(1)]                      # empty masks carry no region
    return select_masks(pool, M, gen)

def make_item(image: torch.Tensor, text: str, parsed: ParsedCaption | TreeTokens | None, index: int, spec: BatchSpec,
              epoch: int, pool: torch.Tensor | None = None) -> dict:
    "Per-sample tensors: image (3, H, W), tree (TreeTokens) or tokens (L,), region_masks (M, N) and region_valid (M,) if asked, index."
    needs, L = spec.needs, spec.geometry.context_length
    item = dict(image=image, index=index)
    if needs.tree:
        if parsed is None: raise ValueError('the method needs a parse tree and the sample has none')
        item['tree'] = parsed if isinstance(parsed, TreeTokens) else tree_tokens(parsed, context_length=L)
    else: item['tokens'] = caption_tokens(text, L)
    if needs.regions:
        item['region_masks'], item['region_valid'] = region_masks(
            needs.region_source, spec.geometry.grid, needs.regions, sample_generator(spec.region_seed, epoch, index), pool)
    return item

def collate(items: list[dict], node_np: bool = True) -> dict:
    "Stack `make_item` outputs into the batch contract dict (trees padded by `collate_trees`; `node_np` kept if asked)."
    if 'tree' in items[0]:
        out = collate_trees([it['tree'] for it in items])
        if not node_np: del out['node_np']
    else: out = dict(tokens=torch.stack([it['tokens'] for it in items]))        # (C, L)
    out['image'] = torch.stack([it['image'] for it in items])                  # (C, 3, H, W)
    if 'region_masks' in items[0]:
        out['region_masks'] = torch.stack([it['region_masks'] for it in items])    # (C, M, N)
        out['region_valid'] = torch.stack([it['region_valid'] for it in items])    # (C, M)
    out['index'] = torch.tensor([it['index'] for it in items], dtype=torch.long)
    return out


# %%
_geo = Geometry(64, 8, 77)
_spec = BatchSpec(DataConfig(), _geo, BatchNeeds(tree=True, node_np=True, regions=4))
_pc = ParsedCaption('a red circle', ['a', 'red', 'circle'], [(0, 3)], ['NP'], 'gold', [])
_it = make_item(torch.zeros(3, 64, 64), _pc.text, _pc, 5, _spec, epoch=0)
test_eq(_it['region_masks'].shape, (4, 64)); assert _it['region_valid'].all() and _it['region_masks'].any(1).all()
test_eq(_it['region_masks'], make_item(torch.zeros(3, 64, 64), _pc.text, _pc, 5, _spec, 0)['region_masks'])    # same (seed, epoch, index)
assert not torch.equal(_it['region_masks'], make_item(torch.zeros(3, 64, 64), _pc.text, _pc, 5, _spec, 1)['region_masks'])  # new epoch
assert not torch.equal(_it['region_masks'], make_item(torch.zeros(3, 64, 64), _pc.text, _pc, 5, BatchSpec(**{**_spec.__dict__, 'seed': 1}), 0)['region_masks'])
_pool = torch.eye(3, 64, dtype=torch.bool); _pool = torch.cat([_pool, torch.zeros(1, 64, dtype=torch.bool)])
m, v = region_masks('gold', 8, 4, torch.Generator().manual_seed(0), _pool)
test_eq(v.tolist(), [True, True, True, False]); assert not m[3].any()   # the empty pool mask is not drawn
_pc2 = ParsedCaption('a b', ['a', 'b'], [(0, 2), (1, 2)], ['NP', 'NP'], 'gold', [])
_b = collate([_it, make_item(torch.zeros(3, 64, 64), _pc2.text, _pc2, 7, _spec, 0)])
test_eq({k: tuple(t.shape) for k, t in _b.items()},
        dict(tokens=(2, 77), leaf_tokens=(2, 3, 77), leaf_valid=(2, 3), incidence=(2, 2, 3), node_valid=(2, 2), node_np=(2, 2),
             image=(2, 3, 64, 64), region_masks=(2, 4, 64), region_valid=(2, 4), index=(2,)))
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
        if not 0 <= rank < world_size: raise ValueError(f'rank {rank} not in [0, {world_size})')
        self.n, self.B, self.seed, self.epoch, self.rank, self.G = n, batch_size, seed, epoch, rank, world_size
        self.steps = n // (batch_size * world_size)      # full steps per epoch and rank
        if not 0 <= start_step <= self.steps: raise ValueError(f'start_step {start_step} not in [0, {self.steps}]')
        self.start_step = start_step

    def __len__(self): return self.steps - self.start_step

    def __iter__(self):
        perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(mix_seed(self.seed, self.epoch)))
        for s in range(self.start_step, self.steps):
            b = s * self.G + self.rank
            yield perm[b * self.B:(b + 1) * self.B].tolist()


# %%
_s = EpochBatchSampler(100, 8, seed=0, epoch=0)
_all = list(_s); test_eq(len(_all), 12); test_eq(len(set(itertools.chain(*_all))), 96)   # no repeats
test_eq(list(EpochBatchSampler(100, 8, 0, 0, start_step=5)), _all[5:])                     # resume = suffix
assert list(EpochBatchSampler(100, 8, 0, 1)) != _all                                        # new epoch, new order
_r = [list(EpochBatchSampler(100, 8, 0, 0, rank=r, world_size=2)) for r in range(2)]
test_eq(len(_r[0]), 6); assert not set(itertools.chain(*_r[0])) & set(itertools.chain(*_r[1]))  # ranks disjoint
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
        self.world = WorldDataset(world_config(spec.data, spec.geometry, spec.world_seed), spec.data.world_length, split)

    def __len__(self): return len(self.world)

    def __getitem__(self, i: int) -> dict:
        s = self.world[i]
        n = self.spec.needs
        pool = s['masks'][s['mask_valid']] if n.regions and n.region_source == 'gold' else None   # (R, N) valid gold masks
        return make_item(s['image'], s['text'], s['parsed'], int(s['index']), self.spec, self.epoch, pool)


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
test_eq(_wt['tokens'], _wb['tokens']); assert 'leaf_tokens' not in _wt and 'region_masks' not in _wt

# %% [markdown]
# ## Webdataset shards
#
# The pipeline of one worker, all in `WdsItems.__iter__`:
#
# 1. **shards**: the shard list in an order drawn from `(data seed, epoch)`; process $r$ of $G$ with worker $w$ of
#    $n_w$ takes every $(Gn_w)$-th shard starting at $r n_w + w$ (so shards are split across both);
# 2. **read**: `read_shard` reads one tar with `webdataset.tarfile_to_samples` and a handler that keeps going
#    on read errors: of a truncated or corrupt tar the samples before the damage are kept, and the shard counts
#    one `shard_error` (its samples after the damage are lost and cannot be counted: the index is gone);
# 3. **resume skip**: drop this worker's share of already consumed samples *before decoding* (below);
# 4. **shuffle**: a buffer of `shuffle_buffer` samples with a generator from `(data seed, epoch, rank, worker)`;
# 5. **decode**: `decode_sample` reads the image and the caption, and the tree and the stored masks only if the
#    method needs them; on any problem it counts the reason, logs the key and returns `None`, and the sample is skipped.
#
# Images go through open_clip's preprocessing (resize the short side, centre-crop, normalise). The default is
# the evaluation transform: `stored` masks were computed on the centred square (`regions.GridConfig(crop=
# 'center')`), so a random-resized crop would misplace them; pass another `preprocess` when masks are random.
#
# **Resume on shards is approximate, and documented as such.** The DataLoader takes batches from its
# workers in turn, so after `start_step` batches worker $w$ has produced $\lceil(\text{start\_step}-w)/n_w\rceil$
# of them, and it skips that many times $B$ raw samples before its shuffle buffer, without decoding them (and
# the resumed loader's worker $i$ plays the part of worker $(i+\text{start\_step}) \bmod n_w$, whose batch is due next). The
# resumed run then sees the same shards in the same order and continues at about the right place; it is not
# bit-identical because skipped (bad) samples and the shuffle buffer move the boundary by up to
# `shuffle_buffer` + (bad samples) samples. The trainer checkpoints `(epoch, step)`; nothing else is needed.

# %%
#| export
IMAGE_EXTS = ('.jpg', '.jpeg', '.png', '.webp', '.bmp')   # image file suffixes; a shard member's key is the suffix without its dot

def shard_urls(shards: str | list[str]) -> list[str]:
    "Expand '::'-separated brace patterns ('a/{000..009}.tar::b.tar') into a list of shard urls."
    import webdataset as wds
    if isinstance(shards, (list, tuple)): return [u for s in shards for u in shard_urls(s)]
    return list(wds.shardlists.expand_urls(shards))

def eval_transform(image_size: int):
    "open_clip's evaluation transform (resize, centre-crop, CLIP normalisation) at `image_size`."
    from open_clip import image_transform
    return image_transform(image_size, is_train=False)

def decode_sample(s: dict, spec: BatchSpec, epoch: int, preprocess, counter: SkipCounter) -> dict | None:
    """A raw webdataset sample (bytes per extension) -> a batch item, or None (counted and logged) when unusable.
    Reads a tree (stored, or parsed on the fly) and stored masks only when the method needs them."""
    key, needs, cfg, geo = s.get('__key__', '?'), spec.needs, spec.data, spec.geometry
    def skip(reason, detail=''):
        counter.add(reason, f"{s.get('__url__', '')}:{key}", detail); return None
    img = next((s[e[1:]] for e in IMAGE_EXTS if e[1:] in s), None)
    if img is None: return skip('no_image')
    try:
        with Image.open(io.BytesIO(img)) as im: im.load(); im = im.convert('RGB')
    except Exception as e: return skip('bad_image', repr(e)[:200])
    if why := caption_problem(s.get('txt')): return skip('no_caption', why)   # the annotator's rule (20_parsing)
    text = s['txt'].decode('utf-8') if isinstance(s['txt'], bytes) else s['txt']
    tt = None
    if needs.tree:
        if 'tree.json' in s:
            try:
                parsed = ParsedCaption.from_dict(json.loads(s['tree.json']))
                problems = tree_problems(parsed)
            except Exception as e: return skip('bad_tree', repr(e)[:200])
            if problems: return skip('bad_tree', '; '.join(problems)[:200])
        elif cfg.parse_missing: parsed = parse_caption(text)
        else: return skip('bad_tree', 'no .tree.json and parse_missing=False')
        tt = tree_tokens(parsed, context_length=geo.context_length)
        if not tt.node_valid.any(): return skip('bad_tree', 'no node with a word')
    pool = None
    if needs.regions and needs.region_source == 'stored':
        if 'regions.npz' not in s: return skip('no_regions', 'no .regions.npz')
        try: pool, meta = decode_regions(s['regions.npz'])
        except Exception as e: return skip('bad_regions', repr(e)[:200])
        if (meta['grid_h'], meta['grid_w']) != (geo.grid, geo.grid):
            return skip('bad_regions', f"masks on a {meta['grid_h']}x{meta['grid_w']} grid, the model has {geo.grid}x{geo.grid}")
        if not pool.any(1).any(): return skip('no_regions', 'all stored masks empty')
    return make_item(preprocess(im), text, tt, key_index(key), spec, epoch, pool)

def read_shard(url: str, counter: SkipCounter):
    "Raw samples of one tar; read errors (truncated or corrupt tar) end the shard and count one `shard_error`."
    import webdataset as wds
    errors = []
    def handler(exn): errors.append(exn); return True
    yield from wds.tarfile_to_samples(handler=handler)(iter([dict(url=url)]))
    if errors: counter.add('shard_error', url, f'{len(errors)} read error(s), first {errors[0]!r}'[:300])

def _shuffled(it, bufsize: int, rng: random.Random):
    "Reservoir-style shuffle buffer (the same law as webdataset.shuffle) with our own seeded generator."
    buf = []
    for x in it:
        if len(buf) < bufsize: buf.append(x); continue
        k = rng.randrange(bufsize); yield buf[k]; buf[k] = x
    rng.shuffle(buf); yield from buf

class WdsItems(IterableDataset):
    "Iterable of batch items from webdataset shards (see the steps above)."
    def __init__(self, spec: BatchSpec, epoch: int = 0, start_step: int = 0, preprocess=None,
                 counter: SkipCounter | None = None, rank: int = 0, world_size: int = 1):
        self.spec, self.cfg, self.epoch, self.start_step, self.rank, self.G = spec, spec.data, epoch, start_step, rank, world_size
        self.preprocess = preprocess or eval_transform(spec.geometry.image_size)
        self.counter = counter or SkipCounter(spec.data.workers)
        self.urls = shard_urls(spec.data.shards)
        if not self.urls: raise ValueError(f'no shards in {spec.data.shards!r}')

    def __iter__(self):
        import webdataset as wds
        w = get_worker_info()
        nw = 1 if w is None else w.num_workers
        # the DataLoader asks its workers in turn, starting with worker 0; after start_step batches the next one is
        # due from the worker start_step % nw of the original run, so physical worker i plays that run's worker wid
        wid = (0 if w is None else w.id + self.start_step) % nw
        urls = list(self.urls)
        random.Random(mix_seed(self.spec.order_seed, self.epoch)).shuffle(urls)
        mine = urls[self.rank * nw + wid::self.G * nw]
        samples = itertools.chain.from_iterable(read_shard(u, self.counter) for u in mine)
        done = max(0, math.ceil((self.start_step - wid) / nw)) * self.cfg.batch_size   # this worker's consumed share
        samples = itertools.islice(samples, done, None)
        if self.cfg.shuffle_buffer > 0:
            samples = _shuffled(samples, self.cfg.shuffle_buffer, random.Random(mix_seed(self.spec.order_seed, self.epoch, self.rank, wid)))
        for s in samples:
            try: item = decode_sample(s, self.spec, self.epoch, self.preprocess, self.counter)
            except Exception as e:   # a bug or a case we did not foresee: still count it, never kill the epoch
                self.counter.add('bad_image' if 'image' in repr(e).lower() else 'bad_tree', s.get('__key__', '?'), repr(e)[:200])
                item = None
            if item is not None: yield item


# %% [markdown]
# ## The loader
#
# `make_loader(spec, epoch, start_step)` is what the trainer calls once per epoch. It returns a `Loader`:
# iterate it for batches, `len()` for the remaining steps (when known), `skipped()` for the skip counts.

# %%
#| export
class Loader:
    "Batches of one epoch (from `start_step`), with the count of skipped samples."
    def __init__(self, dataloader: DataLoader, counter: SkipCounter, steps: int | None, start_step: int):
        self.dataloader, self.counter, self.steps, self.start_step = dataloader, counter, steps, start_step

    def __iter__(self):
        it = iter(self.dataloader)
        return it if self.steps is None else itertools.islice(it, max(0, self.steps - self.start_step))

    def __len__(self):
        if self.steps is None: raise TypeError('the number of steps of a shard epoch is unknown: set samples_per_epoch')
        return max(0, self.steps - self.start_step)

    def skipped(self) -> dict[str, int]: return self.counter.counts()

def steps_per_epoch(cfg: DataConfig, world_size: int = 1) -> int | None:
    "Full steps per epoch and process: world: world_length // (B G); wds: samples_per_epoch // B or None."
    if cfg.source == 'world': return cfg.world_length // (cfg.batch_size * world_size)
    return None if cfg.samples_per_epoch is None else cfg.samples_per_epoch // cfg.batch_size

def make_loader(spec: BatchSpec, epoch: int = 0, start_step: int = 0, preprocess=None, rank: int = 0,
                world_size: int = 1, counter: SkipCounter | None = None) -> Loader:
    "The loader of one epoch for process `rank` of `world_size`, resuming at `start_step` (see above)."
    cfg = spec.data
    counter = counter or SkipCounter(cfg.workers)
    kw = dict(num_workers=cfg.workers, collate_fn=partial(collate, node_np=spec.needs.node_np))
    if cfg.source == 'world':
        sampler = EpochBatchSampler(cfg.world_length, cfg.batch_size, spec.order_seed, epoch, start_step, rank, world_size)
        dl = DataLoader(WorldItems(spec, epoch), batch_sampler=sampler, **kw)
        return Loader(dl, counter, sampler.steps, start_step)
    ds = WdsItems(spec, epoch, start_step, preprocess, counter, rank, world_size)
    dl = DataLoader(ds, batch_size=cfg.batch_size, drop_last=True, **kw)
    return Loader(dl, counter, steps_per_epoch(cfg, world_size), start_step)


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
test_eq(len(full), 5); test_eq(b['image'].shape, (8, 3, 64, 64)); test_eq(b['region_masks'].shape, (8, 4, 64))
test_eq(b['tokens'].shape, (8, 77)); test_eq(b['tokens'].dtype, torch.long)
assert all(b['region_masks'][c][b['region_valid'][c]].any(1).all() for c in range(8))   # valid masks non-empty
assert not b['region_masks'][~b['region_valid']].any()                                   # padding all False
# gold masks: every valid region is one of the sample's gold object masks
s0 = WorldDataset(world_config(wspec.data, _geo, wspec.world_seed), 40)[int(b['index'][0])]
gold = {tuple(r.tolist()) for r in s0['masks'][s0['mask_valid']]}
assert {tuple(r.tolist()) for r in b['region_masks'][0][b['region_valid'][0]]} <= gold
test_eq(sorted(torch.cat([x['index'] for x in full]).tolist()), list(range(40)))          # an epoch is a permutation
def same(xs, ys): return len(xs) == len(ys) and all(torch.equal(x[k], y[k]) for x, y in zip(xs, ys) for k in x)
assert same(list(make_loader(wspec, 0, start_step=2)), full[2:])                          # exact resume
_w2 = BatchSpec(DataConfig(batch_size=8, workers=2, world_length=40), _geo, _gold)
assert same(list(make_loader(_w2, 0)), full)                                             # 2 workers == 0 workers
test_eq(len(make_loader(wspec, 0, start_step=2)), 3)
assert not same(list(make_loader(BatchSpec(wspec.data, _geo, _gold, seed=1), 0)), full)  # another run seed: other batches
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
            if bb['region_valid'][c, m]: over[bb['region_masks'][c, m].view(8, 8).numpy()] = [*cols[m], 0.35]
        ax = axs[row, c]; ax.imshow(img); ax.imshow(over, extent=(0, 64, 64, 0)); ax.set_xticks([]); ax.set_yticks([])
        if row == 0:
            s_ = WorldDataset(world_config(wspec.data, _geo, wspec.world_seed), 40)[int(bb['index'][c])]
            ax.set_title('\n'.join(textwrap.wrap(s_['text'], 30)), fontsize=7)
axs[0, 0].set_ylabel('gold masks'); axs[1, 0].set_ylabel('random boxes')
plt.tight_layout(); plt.show()


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
        for s in samples: w.write({k: (v.encode() if isinstance(v, str) and k != '__key__' else v) for k, v in s.items()})


# %%
def jpeg(seed, size=(80, 60)):
    rng = np.random.default_rng(seed)
    buf = io.BytesIO(); Image.fromarray(rng.integers(0, 255, (*size[::-1], 3), dtype=np.uint8)).save(buf, 'JPEG')
    return buf.getvalue()

def good(i, tree=True):
    s = {'__key__': f'{i:09d}', 'jpg': jpeg(i), 'txt': f'a photo of a red car number {i}',
         'json': json.dumps({'key': f'{i:09d}', 'status': 'success'})}
    words = s['txt'].split()
    if tree: s['tree.json'] = json.dumps(ParsedCaption(s['txt'], words, [(0, len(words)), (0, 3), (3, len(words))],
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
tmp = tempfile.TemporaryDirectory(); pattern = build_shards(tmp.name)
with tarfile.open(Path(tmp.name) / '00001.tar') as t: print(t.getnames()[:6])

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
test_eq(b['image'].shape, (2, 3, 64, 64)); test_eq(b['region_masks'].shape, (2, 4, 64))
test_eq(b['region_valid'].sum(1).tolist(), [3, 3])                 # 3 stored masks, 1 padding row
assert n_good >= 6 + 1                                             # 6 good samples + the intact part of the truncated shard
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
