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

# %%
#| default_exp subcaptions

# %%
#| export
from __future__ import annotations

import re

import torch

from powerclip.seeds import derive_seed, sample_generator

# %%
#| hide
from collections import Counter

from fastcore.test import test_eq

# %% [markdown]
# # Sub-captions
#
# > FLAIR's sampling of $K$ sub-captions from a long caption (`sample_dict` in `src/flair/data.py`).
#
# FLAIR (`45`..`48b`: `48b_flair`) trains on long captions by cutting each into sentences and drawing $K$
# sub-captions per image (its `num_cap_per_img`, 8 in its recipes), each of $m$ sentences with $m$ uniform in
# $\{1, \dots, 3\}$ (its `max_merged_num`):
#
# - $m = 1$: one sentence, uniformly;
# - $m \ge 2$, half the time a **window** of $m$ consecutive sentences, half the time $m$ sentences from **random
#   places**, distinct, in random order (Python's `random.sample`); sentences are joined by `'. '`.
#
# Two details are FLAIR's code and are kept: its window starts are drawn from $\{0, \dots, n - m - 1\}$
# (`draw_numbers(n - m)`, so the window that ends on the last sentence is never drawn), and a window of $m \ge n$
# sentences is the whole caption. One is ours: where the random-places draw asks for more sentences than the caption
# has ($m > n$), FLAIR draws with replacement (`random.choice` $m$ times, so a sentence may repeat); we take the whole
# caption instead, so that the $K$ sub-captions of a one-sentence caption (the world's short captions) are that
# sentence, never "s. s". FLAIR's captions (DreamLIP's, several captioners' sentences concatenated) almost never have
# fewer than three sentences, so this changes nothing there. The world's long captions have 1, 3 or 6 sentences (one
# per object, then one per relation: scenes of 1, 2 or 3 objects, about a third each), so it does touch the third of
# scenes with one object: FLAIR's code would make a third of their $K$ draws ($m \ge 2$, random places) the sentence
# repeated, ours the sentence. Either is a positive that says nothing new; only its tokens differ.
#
# **Randomness.** FLAIR draws from the data workers' global `random` state. Here each sample's draws come from its own
# generator, seeded by the run seed's `subcaptions` stream, the epoch and the sample id (`22a_seeds`:
# `sample_generator`), so they do not depend on the worker, the process or the order, and a resumed run draws the same.

# %%
#| export
MAX_MERGED = 3     # FLAIR's max_merged_num: a sub-caption has 1 to 3 sentences


def split_sentences(text: str) -> list[str]:
    "FLAIR's `split_caption`: the sentences of a caption (split at '.', newlines and '</s>'), stripped, none empty."
    return [s.strip() for s in re.split(r'\n|</s>|[.]', text) if s.strip()]


def _randint(gen: torch.Generator, n: int) -> int:
    "Uniform in {0, ..., n - 1}."
    return int(torch.randint(n, (1,), generator=gen))


def sample_subcaptions(text: str, k: int, gen: torch.Generator, max_merged: int = MAX_MERGED) -> list[str]:
    """`k` sub-captions of `text` as FLAIR's `sample_dict` draws them (see above), from `gen`. A caption without a
    sentence gives itself k times."""
    sents = split_sentences(text)
    n = len(sents)
    if n == 0:
        return [text] * k
    out = []
    for _ in range(k):
        m = 1 + _randint(gen, max_merged)
        if m == 1:
            out.append(sents[_randint(gen, n)])
            continue
        window = float(torch.rand((), generator=gen)) < 0.5
        if m >= n if window else m > n:
            out.append('. '.join(sents))                   # FLAIR's window of m >= n; ours for m > n random places
        elif window:
            start = _randint(gen, n - m)                   # FLAIR: draw_numbers(n - m), starts 0 .. n - m - 1
            out.append('. '.join(sents[start:start + m]))
        else:
            pick = torch.randperm(n, generator=gen)[:m].tolist()   # m <= n distinct sentences, in random order
            out.append('. '.join(sents[i] for i in pick))
    return out


def subcaption_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    "The generator of one sample's sub-captions in one epoch: the run seed's `subcaptions` stream (`22a_seeds`)."
    return sample_generator(derive_seed(seed, 'subcaptions'), epoch, index)


def subcaption_tokens(text: str, k: int, at: tuple[int, int, int], context_length: int) -> torch.Tensor:
    """(k, L) long: `sample_subcaptions` of `text`, drawn by `subcaption_generator(*at)` (at = run seed, epoch, sample
    id), tokenised as the model's tokenizer encodes a caption."""
    from powerclip.tokens import default_tokenizer   # late: this module stays importable without open_clip loaded
    return default_tokenizer()(sample_subcaptions(text, k, subcaption_generator(*at)), context_length=context_length)


# %% [markdown]
# ## Checks
#
# A one-sentence caption gives that sentence $K$ times; a caption of six sentences gives sub-captions of one to three
# sentences in the shares FLAIR's draw implies: $m$ uniform over $\{1, 2, 3\}$, and for $m \ge 2$ windows and
# random picks half each (a window is a run of consecutive sentences in order; a random pick is one in another order
# about $1 - 1/m!$ of the time). Windows never end on the last sentence (FLAIR's starts).

# %%
_g = torch.Generator().manual_seed(0)
test_eq(sample_subcaptions('a red circle left of a blue square', 8, _g), ['a red circle left of a blue square'] * 8)
test_eq(sample_subcaptions('', 2, _g), ['', ''])
_s = [f's{i}' for i in range(6)]
_text = '. '.join(_s) + '.'
test_eq(split_sentences(_text), _s)
_draws = sample_subcaptions(_text, 6000, torch.Generator().manual_seed(2))
_idx = [[_s.index(w) for w in d.split('. ')] for d in _draws]
_m = Counter(len(i) for i in _idx)
assert all(abs(_m[m] / 6000 - 1 / 3) < 0.03 for m in (1, 2, 3)), _m
assert all(len(set(i)) == len(i) for i in _idx)                       # no sentence twice
_two = Counter(tuple(i) for i in _idx if len(i) == 2)
# m = 2: a window starts at 0..3 (1/4 each, half the draws); a random pick is any of the 30 ordered pairs
assert abs(_two[(0, 1)] / _m[2] - (0.5 / 4 + 0.5 / 30)) < 0.03
assert abs(_two[(4, 5)] / _m[2] - 0.5 / 30) < 0.015                  # the last window: random picks only
assert abs(sum(v for k, v in _two.items() if k[1] == k[0] + 1) / _m[2] - (0.5 + 0.5 * 5 / 30)) < 0.04
