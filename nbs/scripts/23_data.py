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

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, get_worker_info

from powerclip.parsing import ParsedCaption, TreeTokens, caption_problem, collate_trees, parse_caption, tree_problems, tree_tokens
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
# > Batches for PowerCLIP from the built-in world or from CC12M-style webdataset shards: images, caption tokens with their parse-tree masks, region masks on the patch grid, and an account of every sample skipped.

# %% [markdown]
# A batch is the dict of the batch contract (see `30_model` for its consumer):
#
# | key | shape | what |
# |---|---|---|
# | `image` | `(C, 3, H, W)` float | normalised with CLIP's mean and std |
# | `tokens` | `(C, L=77)` long | open_clip token ids, built by `parsing.tree_tokens` so each word's BPE positions are known |
# | `leaf_tokens`, `leaf_valid` | `(C, W, L)`, `(C, W)` bool | token mask $P_{m'}$ of each word (Eq. 4) |
# | `incidence`, `node_valid` | `(C, K, W)`, `(C, K)` bool | which words each parse node covers (Eq. 3) |
# | `node_np` | `(C, K)` bool | the node's label is `NP` (the noun-phrase concepts of C2LIP, `45_c2lip`); pads False |
# | `region_masks`, `region_valid` | `(C, M, N)`, `(C, M)` bool | region masks $R_m$ on the row-major patch grid (Eq. 2) |
# | `index` | `(C,)` long | sample ids: the world index, or a stable hash of the shard key |
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
# draws use a generator seeded by `(seed, epoch, index)`, so they do not depend on the worker that made the
# sample or on the order of the samples.

# %% [markdown]
# ## Configuration

# %%
#| export
@dataclass
class DataConfig:
    "Where batches come from and how they are made; the run writes it next to its outputs."
    source: str = 'world'          # 'world': the built-in procedural world; 'wds': webdataset shards (CC12M layout)
    shards: str = ''               # wds: shard paths/urls, brace patterns allowed ('cc12m/{00000..01242}.tar'), '::' separated
    batch_size: int = 64           # per process
    workers: int = 2               # DataLoader worker processes (0: load in the main process)
    M: int = 10                    # region masks per image (Sec. 5.1)
    masks: str = 'random'          # 'random' boxes | 'gold' world object masks | 'stored' {key}.regions.npz masks
    seed: int = 0                  # with (epoch, index) fixes the order, the world samples and the region draws
    image_size: int = 64           # model input side in pixels: the world renders at it, shards are resized to it
    patch_size: int = 8            # ViT patch side: the patch grid is (image_size // patch_size)^2, row-major
    context_length: int = 77       # text tokens
    world_length: int = 100_000    # world: samples per epoch (indices 0 .. world_length-1 of the 'train' split)
    world: dict = field(default_factory=dict)  # world: extra WorldConfig fields (max_objects, relations, ...)
    shuffle_buffer: int = 1000     # wds: per-worker sample shuffle buffer (0: shard order only)
    samples_per_epoch: int | None = None  # wds: samples per process per epoch (None: one pass over its shards)
    parse_missing: bool = True     # wds: parse captions that have no {key}.tree.json on the fly (else skip them)

    def __post_init__(self):
        if self.source not in ('world', 'wds'): raise ValueError(f"source must be 'world' or 'wds', got {self.source!r}")
        if self.masks not in ('random', 'gold', 'stored'): raise ValueError(f"masks must be 'random', 'gold' or 'stored', got {self.masks!r}")
        if self.masks == 'gold' and self.source != 'world': raise ValueError("masks='gold' needs source='world'")
        if self.masks == 'stored' and self.source != 'wds': raise ValueError("masks='stored' needs source='wds'")
        if self.source == 'wds' and not self.shards: raise ValueError("source='wds' needs shards")
        if self.image_size % self.patch_size: raise ValueError(f'image_size {self.image_size} is not a multiple of patch_size {self.patch_size}')
        if self.batch_size < 1 or self.M < 1 or self.workers < 0: raise ValueError('need batch_size >= 1, M >= 1, workers >= 0')

    @property
    def grid(self) -> int: return self.image_size // self.patch_size


# %%
test_eq(DataConfig().grid, 8)
test_fail(lambda: DataConfig(masks='gold', source='wds', shards='x.tar'), contains='gold')
test_fail(lambda: DataConfig(source='wds'), contains='shards')
test_fail(lambda: DataConfig(image_size=60), contains='multiple')


# %% [markdown]
# ## Seeds from (seed, epoch, index)
#
# `mix_seed` hashes a tuple of non-negative integers into one 63-bit seed with NumPy's `SeedSequence`, whose
# purpose is exactly this: nearby tuples give unrelated streams. Shard samples have no integer index, so
# `key_index` turns the shard key into a stable 56-bit id (a hash, identical on every machine and run).

# %%
#| export
def mix_seed(*xs: int) -> int:
    "One 63-bit seed from non-negative integers (e.g. seed, epoch, index)."
    return int(np.random.SeedSequence([int(x) for x in xs]).generate_state(1, np.uint64)[0] >> np.uint64(1))

def key_index(key: str) -> int:
    "A stable non-negative 56-bit id for a shard sample key."
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=7).digest(), 'big')

def sample_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    "The torch generator of one sample's random draws (region masks) in one epoch."
    return torch.Generator().manual_seed(mix_seed(seed, epoch, index))


# %%
test_eq(mix_seed(0, 1, 2), mix_seed(0, 1, 2)); assert mix_seed(0, 1, 2) != mix_seed(0, 2, 1)
assert 0 <= mix_seed(2**40, 7) < 2**63
test_eq(key_index('000123456'), key_index('000123456')); assert key_index('a') != key_index('b') and key_index('a') < 2**56

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
                'no_image',      # no .jpg/.jpeg/.png/.webp member
                'bad_image',     # the image bytes do not decode
                'no_caption',    # missing or empty .txt
                'bad_tree',      # unparsable .tree.json, a tree without a valid node, or no tree when parsing is off
                'no_regions',    # masks='stored': no .regions.npz or no non-empty mask in it
                'bad_regions')   # masks='stored': masks on another grid or unreadable

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
# `make_item` turns what a source knows about a sample (a normalised image tensor, a parse tree, optionally a
# pool of candidate masks) into the per-sample part of the batch. Region masks:
#
# - `random`: $M$ boxes (`regions.random_box_masks`), all valid;
# - `gold` / `stored`: the pool of masks, $\min(R, M)$ of them drawn uniformly without replacement
#   (`regions.select_masks`), padded with invalid all-`False` rows.
#
# The tree is tokenised here, in the worker (`parsing.tree_tokens`), so the main process only stacks.

# %%
#| export
def region_masks(mode: str, grid: int, M: int, gen: torch.Generator,
                 pool: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    "`(M, N)` bool masks and `(M,)` validity: random boxes, or M drawn from `pool` `(R, N)` (gold/stored)."
    if mode == 'random': return random_box_masks(grid, grid, M, gen)
    if pool is None: raise ValueError(f'masks={mode!r} needs a pool of masks')
    pool = pool[pool.any(1)]                      # empty masks carry no region
    return select_masks(pool, M, gen)

def make_item(image: torch.Tensor, parsed: ParsedCaption | TreeTokens, index: int, cfg: DataConfig, epoch: int,
              pool: torch.Tensor | None = None) -> dict:
    "Per-sample tensors: image (3, H, W), tree (TreeTokens), region_masks (M, N), region_valid (M,), index."
    tt = parsed if isinstance(parsed, TreeTokens) else tree_tokens(parsed, context_length=cfg.context_length)
    masks, valid = region_masks(cfg.masks, cfg.grid, cfg.M, sample_generator(cfg.seed, epoch, index), pool)
    return dict(image=image, tree=tt, region_masks=masks, region_valid=valid, index=index)

def collate(items: list[dict]) -> dict:
    "Stack `make_item` outputs into the batch contract dict (trees padded by `collate_trees`)."
    out = collate_trees([it['tree'] for it in items])
    out['image'] = torch.stack([it['image'] for it in items])                  # (C, 3, H, W)
    out['region_masks'] = torch.stack([it['region_masks'] for it in items])    # (C, M, N)
    out['region_valid'] = torch.stack([it['region_valid'] for it in items])    # (C, M)
    out['index'] = torch.tensor([it['index'] for it in items], dtype=torch.long)
    return out


# %%
_cfg = DataConfig(M=4)
_pc = ParsedCaption('a red circle', ['a', 'red', 'circle'], [(0, 3)], ['NP'], 'gold', [])
_it = make_item(torch.zeros(3, 64, 64), _pc, 5, _cfg, epoch=0)
test_eq(_it['region_masks'].shape, (4, 64)); assert _it['region_valid'].all() and _it['region_masks'].any(1).all()
test_eq(_it['region_masks'], make_item(torch.zeros(3, 64, 64), _pc, 5, _cfg, 0)['region_masks'])    # same (seed, epoch, index)
assert not torch.equal(_it['region_masks'], make_item(torch.zeros(3, 64, 64), _pc, 5, _cfg, 1)['region_masks'])  # new epoch
_pool = torch.eye(3, 64, dtype=torch.bool); _pool = torch.cat([_pool, torch.zeros(1, 64, dtype=torch.bool)])
m, v = region_masks('gold', 8, 4, torch.Generator().manual_seed(0), _pool)
test_eq(v.tolist(), [True, True, True, False]); assert not m[3].any()   # the empty pool mask is not drawn
_b = collate([_it, make_item(torch.zeros(3, 64, 64), ParsedCaption('a b', ['a', 'b'], [(0, 2), (1, 2)], ['NP', 'NP'], 'gold', []), 7, _cfg, 0)])
test_eq({k: tuple(t.shape) for k, t in _b.items()},
        dict(tokens=(2, 77), leaf_tokens=(2, 3, 77), leaf_valid=(2, 3), incidence=(2, 2, 3), node_valid=(2, 2), node_np=(2, 2),
             image=(2, 3, 64, 64), region_masks=(2, 4, 64), region_valid=(2, 4), index=(2,)))


# %% [markdown]
# ## The world source and exact resume
#
# An epoch of the world is a permutation of the indices $0..n-1$ drawn from `(seed, epoch)`; batch $b$ of
# the epoch is the slice $[bB, (b+1)B)$ of it. With $G$ processes, step $s$ of rank $r$ is batch $sG+r$.
# Everything about batch $b$ (which samples, their images and trees, their region masks) is therefore a pure
# function of `(seed, epoch, b)`. To resume at `(epoch, step)`, `EpochBatchSampler` simply starts at
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
def world_config(cfg: DataConfig) -> WorldConfig:
    "The WorldConfig of a DataConfig: the world renders at the model's image and patch size."
    return WorldConfig(**{'image_size': cfg.image_size, 'patch_size': cfg.patch_size, 'seed': cfg.seed, **cfg.world})

class WorldItems(Dataset):
    "Map-style dataset of batch items from the world; item i is a pure function of (cfg, epoch, i)."
    def __init__(self, cfg: DataConfig, epoch: int = 0, split: str = 'train'):
        self.cfg, self.epoch = cfg, epoch
        self.world = WorldDataset(world_config(cfg), cfg.world_length, split)

    def __len__(self): return len(self.world)

    def __getitem__(self, i: int) -> dict:
        s = self.world[i]
        pool = s['masks'][s['mask_valid']] if self.cfg.masks == 'gold' else None   # (R, N) valid gold masks
        return make_item(s['image'], s['parsed'], int(s['index']), self.cfg, self.epoch, pool)


# %% [markdown]
# The world's gold trees carry labels, so its batches say which nodes are noun phrases (`node_np`): the root of
# a multi-object caption and every object mention are `NP`, the relation is `PP`.

# %%
_wi = WorldItems(DataConfig(M=4, world_length=8))
_wb = collate([_wi[i] for i in range(4)])
for c in range(4):
    _gold = _wi.world[c]['parsed']
    test_eq(_wb['node_np'][c, :len(_gold.labels)].tolist(), [lab == 'NP' for lab in _gold.labels])
    assert not _wb['node_np'][c, len(_gold.labels):].any()
print(_wi.world[0]['parsed'].labels, _wb['node_np'][0].tolist())

# %% [markdown]
# ## Webdataset shards
#
# The pipeline of one worker, all in `WdsItems.__iter__`:
#
# 1. **shards**: the shard list in an order drawn from `(seed, epoch)`; process $r$ of $G$ with worker $w$ of
#    $n_w$ takes every $(Gn_w)$-th shard starting at $r n_w + w$ (so shards are split across both);
# 2. **read**: `read_shard` reads one tar with `webdataset.tarfile_to_samples` and a handler that keeps going
#    on read errors: of a truncated or corrupt tar the samples before the damage are kept, and the shard counts
#    one `shard_error` (its samples after the damage are lost and cannot be counted: the index is gone);
# 3. **resume skip**: drop this worker's share of already consumed samples *before decoding* (below);
# 4. **shuffle**: a buffer of `shuffle_buffer` samples with a generator from `(seed, epoch, rank, worker)`;
# 5. **decode**: `decode_sample` reads image, caption, tree and masks; on any problem it counts the reason,
#    logs the key and returns `None`, and the sample is skipped.
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
IMAGE_EXTS = ('jpg', 'jpeg', 'png', 'webp')

def shard_urls(shards: str | list[str]) -> list[str]:
    "Expand '::'-separated brace patterns ('a/{000..009}.tar::b.tar') into a list of shard urls."
    import webdataset as wds
    if isinstance(shards, (list, tuple)): return [u for s in shards for u in shard_urls(s)]
    return list(wds.shardlists.expand_urls(shards))

def eval_transform(image_size: int):
    "open_clip's evaluation transform (resize, centre-crop, CLIP normalisation) at `image_size`."
    from open_clip import image_transform
    return image_transform(image_size, is_train=False)

def decode_sample(s: dict, cfg: DataConfig, epoch: int, preprocess, counter: SkipCounter) -> dict | None:
    "A raw webdataset sample (bytes per extension) -> a batch item, or None (counted and logged) when unusable."
    key = s.get('__key__', '?')
    def skip(reason, detail=''):
        counter.add(reason, f"{s.get('__url__', '')}:{key}", detail); return None
    img = next((s[e] for e in IMAGE_EXTS if e in s), None)
    if img is None: return skip('no_image')
    try:
        with Image.open(io.BytesIO(img)) as im: im.load(); im = im.convert('RGB')
    except Exception as e: return skip('bad_image', repr(e)[:200])
    if why := caption_problem(s.get('txt')): return skip('no_caption', why)   # the annotator's rule (20_parsing)
    text = s['txt'].decode('utf-8') if isinstance(s['txt'], bytes) else s['txt']
    if 'tree.json' in s:
        try:
            parsed = ParsedCaption.from_dict(json.loads(s['tree.json']))
            problems = tree_problems(parsed)
        except Exception as e: return skip('bad_tree', repr(e)[:200])
        if problems: return skip('bad_tree', '; '.join(problems)[:200])
    elif cfg.parse_missing: parsed = parse_caption(text)
    else: return skip('bad_tree', 'no .tree.json and parse_missing=False')
    tt = tree_tokens(parsed, context_length=cfg.context_length)
    if not tt.node_valid.any(): return skip('bad_tree', 'no node with a word')
    pool = None
    if cfg.masks == 'stored':
        if 'regions.npz' not in s: return skip('no_regions', 'no .regions.npz')
        try: pool, meta = decode_regions(s['regions.npz'])
        except Exception as e: return skip('bad_regions', repr(e)[:200])
        if (meta['grid_h'], meta['grid_w']) != (cfg.grid, cfg.grid):
            return skip('bad_regions', f"masks on a {meta['grid_h']}x{meta['grid_w']} grid, the model has {cfg.grid}x{cfg.grid}")
        if not pool.any(1).any(): return skip('no_regions', 'all stored masks empty')
    return make_item(preprocess(im), tt, key_index(key), cfg, epoch, pool)

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
    def __init__(self, cfg: DataConfig, epoch: int = 0, start_step: int = 0, preprocess=None,
                 counter: SkipCounter | None = None, rank: int = 0, world_size: int = 1):
        self.cfg, self.epoch, self.start_step, self.rank, self.G = cfg, epoch, start_step, rank, world_size
        self.preprocess = preprocess or eval_transform(cfg.image_size)
        self.counter = counter or SkipCounter(cfg.workers)
        self.urls = shard_urls(cfg.shards)
        if not self.urls: raise ValueError(f'no shards in {cfg.shards!r}')

    def __iter__(self):
        import webdataset as wds
        w = get_worker_info()
        nw = 1 if w is None else w.num_workers
        # the DataLoader asks its workers in turn, starting with worker 0; after start_step batches the next one is
        # due from the worker start_step % nw of the original run, so physical worker i plays that run's worker wid
        wid = (0 if w is None else w.id + self.start_step) % nw
        urls = list(self.urls)
        random.Random(mix_seed(self.cfg.seed, self.epoch)).shuffle(urls)
        mine = urls[self.rank * nw + wid::self.G * nw]
        samples = itertools.chain.from_iterable(read_shard(u, self.counter) for u in mine)
        done = max(0, math.ceil((self.start_step - wid) / nw)) * self.cfg.batch_size   # this worker's consumed share
        samples = itertools.islice(samples, done, None)
        if self.cfg.shuffle_buffer > 0:
            samples = _shuffled(samples, self.cfg.shuffle_buffer, random.Random(mix_seed(self.cfg.seed, self.epoch, self.rank, wid)))
        for s in samples:
            try: item = decode_sample(s, self.cfg, self.epoch, self.preprocess, self.counter)
            except Exception as e:   # a bug or a case we did not foresee: still count it, never kill the epoch
                self.counter.add('bad_image' if 'image' in repr(e).lower() else 'bad_tree', s.get('__key__', '?'), repr(e)[:200])
                item = None
            if item is not None: yield item


# %% [markdown]
# ## The loader
#
# `make_loader(cfg, epoch, start_step)` is what the trainer calls once per epoch. It returns a `Loader`:
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

def make_loader(cfg: DataConfig, epoch: int = 0, start_step: int = 0, preprocess=None, rank: int = 0,
                world_size: int = 1, counter: SkipCounter | None = None) -> Loader:
    "The loader of one epoch for process `rank` of `world_size`, resuming at `start_step` (see above)."
    counter = counter or SkipCounter(cfg.workers)
    kw = dict(num_workers=cfg.workers, collate_fn=collate)
    if cfg.source == 'world':
        sampler = EpochBatchSampler(cfg.world_length, cfg.batch_size, cfg.seed, epoch, start_step, rank, world_size)
        dl = DataLoader(WorldItems(cfg, epoch), batch_sampler=sampler, **kw)
        return Loader(dl, counter, sampler.steps, start_step)
    ds = WdsItems(cfg, epoch, start_step, preprocess, counter, rank, world_size)
    dl = DataLoader(ds, batch_size=cfg.batch_size, drop_last=True, **kw)
    return Loader(dl, counter, steps_per_epoch(cfg, world_size), start_step)


# %% [markdown]
# ### The world loader
#
# A small world epoch; with 2 workers the batches are identical to those with none, and resuming at step 2
# gives exactly the remaining batches of the uninterrupted epoch.

# %%
wcfg = DataConfig(batch_size=8, workers=0, world_length=40, M=4, masks='gold')
t0 = time.time()
full = list(make_loader(wcfg, epoch=0))
print(f'{len(full)} world batches of 8 in {time.time() - t0:.2f} s (main process)')
b = full[0]
test_eq(len(full), 5); test_eq(b['image'].shape, (8, 3, 64, 64)); test_eq(b['region_masks'].shape, (8, 4, 64))
test_eq(b['tokens'].shape, (8, 77)); test_eq(b['tokens'].dtype, torch.long)
assert all(b['region_masks'][c][b['region_valid'][c]].any(1).all() for c in range(8))   # valid masks non-empty
assert not b['region_masks'][~b['region_valid']].any()                                   # padding all False
# gold masks: every valid region is one of the sample's gold object masks
s0 = WorldDataset(world_config(wcfg), 40)[int(b['index'][0])]
gold = {tuple(r.tolist()) for r in s0['masks'][s0['mask_valid']]}
assert {tuple(r.tolist()) for r in b['region_masks'][0][b['region_valid'][0]]} <= gold
test_eq(sorted(torch.cat([x['index'] for x in full]).tolist()), list(range(40)))          # an epoch is a permutation
def same(xs, ys): return len(xs) == len(ys) and all(torch.equal(x[k], y[k]) for x, y in zip(xs, ys) for k in x)
assert same(list(make_loader(wcfg, 0, start_step=2)), full[2:])                           # exact resume
assert same(list(make_loader(DataConfig(**{**wcfg.__dict__, 'workers': 2}), 0)), full)    # 2 workers == 0 workers
test_eq(len(make_loader(wcfg, 0, start_step=2)), 3)

# %% [markdown]
# What the loss sees: world images with their caption and, on the $8\times8$ patch grid, the gold object masks
# (top) and $M=4$ random boxes of this epoch (bottom), each region in its own colour.

# %%
import textwrap

import matplotlib.pyplot as plt
from powerclip.world import CLIP_MEAN, CLIP_STD
rb = next(iter(make_loader(DataConfig(**{**wcfg.__dict__, 'masks': 'random'}), epoch=0)))
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
            s_ = WorldDataset(world_config(wcfg), 40)[int(bb['index'][c])]
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
scfg = DataConfig(source='wds', shards=pattern, batch_size=2, workers=0, M=4, masks='stored', shuffle_buffer=0)
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
