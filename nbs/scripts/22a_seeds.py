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
#| default_exp seeds

# %%
#| export
from __future__ import annotations

import hashlib

import numpy as np
import torch

# %%
#| hide
from fastcore.test import test_eq, test_fail

# %% [markdown]
# # Seeds
#
# > One run seed, and every random stream of the run derived from it by name.
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
# | `subcaptions` | FLAIR's sub-captions drawn per sample (`22b_subcaptions`) |
#
# `derive_seed(seed, name)` hashes the seed and the name with NumPy's `SeedSequence`, whose purpose is exactly this:
# nearby inputs give unrelated streams. `mix_seed` does the same for tuples of integers (seed, epoch, index), and
# `key_index` turns a shard key into a stable 56-bit id (a hash, identical on every machine and run). The values are
# written into the run's `config.yaml`. Held-out evaluation scenes are *not* derived from the run seed: they are a
# fixed benchmark (the world's own default seed, on its `test` split).
#
# The functions below need nothing else of the package, and several notebooks use them: the data pipeline
# (`23_data`) draws the order of its samples and the region masks of each sample from these streams, and the trainer
# (`50_train`) writes `run_seeds` into `config.yaml` and seeds the initial weights and each process's forward pass.

# %%
#| export
SEED_STREAMS = ('init', 'data', 'world', 'regions', 'method', 'forward', 'subcaptions')

def mix_seed(*xs: int) -> int:
    "One 63-bit seed from non-negative integers (e.g. seed, epoch, index)."
    return int(np.random.SeedSequence([int(x) for x in xs]).generate_state(1, np.uint64)[0] >> np.uint64(1))

def key_index(key: str) -> int:
    "A stable non-negative 56-bit id for a shard sample key."
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=7).digest(), 'big')

def derive_seed(seed: int, stream: str) -> int:
    "The seed of the named random stream of a run with seed `seed` (see the table above)."
    if stream not in SEED_STREAMS:
        raise ValueError(f'unknown random stream {stream!r}; streams: {SEED_STREAMS}')
    return mix_seed(seed, key_index(stream))

def run_seeds(seed: int) -> dict[str, int]:
    "Every stream's seed of a run (what `config.yaml` records)."
    return {s: derive_seed(seed, s) for s in SEED_STREAMS}

def sample_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    "The torch generator of one sample's random draws (region masks) in one epoch."
    return torch.Generator().manual_seed(mix_seed(seed, epoch, index))


# %%
test_eq(mix_seed(0, 1, 2), mix_seed(0, 1, 2))
assert mix_seed(0, 1, 2) != mix_seed(0, 2, 1)
assert 0 <= mix_seed(2**40, 7) < 2**63
test_eq(key_index('000123456'), key_index('000123456'))
assert key_index('a') != key_index('b') and key_index('a') < 2**56
_rs = run_seeds(0)
assert len(set(_rs.values())) == len(SEED_STREAMS) and _rs == run_seeds(0) and _rs != run_seeds(1)
test_eq(derive_seed(0, 'data'), _rs['data'])
test_fail(lambda: derive_seed(0, 'dat'), contains='unknown random stream')
