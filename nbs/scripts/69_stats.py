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
#| default_exp stats

# %%
#| export
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats as _st

# %%
#| hide
from fastcore.test import test_fail


# %% [markdown]
# # Statistics for comparisons
#
# > When is one method better than another?
#
# Paired differences over seeds with a t interval, a bootstrap over held-out scenes, and the rule that "better" needs an
# interval that excludes zero.

# %% [markdown]
# A comparison trains every method with the same budget on the same seeds and scores it on the same held-out
# scenes. A number such as "hard-negative accuracy 69.7 for CLIP, 66.1 for FLIP" mixes three things: what the
# method does, the luck of its training run (initial weights, data order, region draws, method noise, all drawn
# from the run's seed), and the luck of the test set. To say that FLIP is *worse* we need the difference to be
# larger than both kinds of luck.
#
# **Pairing.** Seed $s$ of every method sees the same data order and starts from the same initial weights
# (methods share the seed's streams), so the per-seed difference
# $$d_s = \text{metric}(\text{method}, s) - \text{metric}(\text{CLIP}, s)$$
# cancels whatever the seed does to both alike. Its mean over $S$ seeds estimates the effect of the method.
#
# **Seed interval (the verdict).** Treating $d_1, \dots, d_S$ as independent draws, the 95 % interval for their
# expectation is Student's
# $$\bar d \pm t_{0.975,\,S-1}\, \frac{s_d}{\sqrt S},$$
# with $s_d$ the sample standard deviation. With $S = 3$ the quantile is $t_{0.975,2} = 4.30$: three seeds only
# separate methods whose difference is large against its spread. This interval answers "would another training
# run give the same sign?", which is the question a reader of the comparison asks.
#
# **Scene interval (the test-set part).** The held-out scenes are one sample of the world. A paired bootstrap
# resamples the scenes (the same resampled scenes for every seed, since all seeds are scored on one set) and
# recomputes $\bar d$; the 2.5 and 97.5 percentiles bound how much a different draw of test scenes would move it.
# It says nothing about training luck, so it is reported beside the seed interval, never instead of it.
#
# **The rule.** A row of the comparison says *better* or *worse* only when the seed interval excludes zero;
# otherwise *no difference shown* (which is not "equal": the interval says how large a difference could hide).

# %%
#| export
@dataclass
class Interval:
    "An estimate with its 95 % (or `conf`) interval; NaN bounds when it cannot be computed (one seed)."
    mean: float           # the point estimate
    lo: float             # lower bound
    hi: float             # upper bound
    n: int                # number of observations it rests on (seeds, or scenes for the bootstrap)
    conf: float = 0.95
    method: str = "t"     # 't' (Student over seeds) | 'bootstrap' (paired, over scenes)

    @property
    def excludes_zero(self) -> bool:
        "True when the whole interval is on one side of 0 (NaN bounds: False)."
        return bool(self.lo > 0 or self.hi < 0)

    def verdict(self, higher_is_better: bool = True) -> str:
        "'better' | 'worse' | 'no difference shown' for a difference method - reference."
        if not self.excludes_zero:
            return "no difference shown"
        return "better" if (self.mean > 0) == higher_is_better else "worse"

    def format(self, scale: float = 1.0, digits: int = 1) -> str:
        """'+2.1 [-0.5, +4.7]' (scaled, e.g. 100 for percent); '+2.1 [-]' without an interval (one seed); '-' without a
        mean."""
        f = lambda v: f"{scale * v:+.{digits}f}"
        if math.isnan(self.mean):
            return "-"
        if math.isnan(self.lo) or math.isnan(self.hi):
            return f"{f(self.mean)} [-]"
        return f"{f(self.mean)} [{f(self.lo)}, {f(self.hi)}]"


def t_interval(x, conf: float = 0.95) -> Interval:
    "Student's t interval for the mean of `x` (1-D, NaNs dropped); NaN bounds when fewer than 2 values."
    x = np.asarray(x, dtype=np.float64).ravel()
    x = x[~np.isnan(x)]
    n = len(x)
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0, conf)
    m = float(x.mean())
    if n < 2:
        return Interval(m, math.nan, math.nan, n, conf)
    half = float(_st.t.ppf(0.5 + conf / 2, n - 1)) * float(x.std(ddof=1)) / math.sqrt(n)
    return Interval(m, m - half, m + half, n, conf)


# %% [markdown]
# The interval must cover the true mean 95 % of the time, also with 3 seeds. We check it by simulation: 20,000
# experiments of 3 normal draws each (a coverage estimate has a standard error of 0.15 % at this size).

# %%
_rng = np.random.default_rng(0)
_x = _rng.normal(1.0, 2.0, size=(20_000, 3))
_half = _st.t.ppf(0.975, 2) * _x.std(1, ddof=1) / np.sqrt(3)
_cover = np.mean(np.abs(_x.mean(1) - 1.0) <= _half)
assert abs(_cover - 0.95) < 0.006, _cover
_iv = t_interval(_x[0])
assert abs((_iv.hi - _iv.lo) / 2 - _half[0]) < 1e-12 and _iv.n == 3
print(f"coverage of the t interval with 3 seeds: {_cover:.4f}; t_0.975,2 = {_st.t.ppf(0.975, 2):.3f}")

# %%
assert math.isnan(t_interval([0.3]).lo) and t_interval([0.3]).mean == 0.3   # one seed: no interval
assert t_interval([0.3]).format(100) == "+30.0 [-]" and t_interval([]).format() == "-"   # printed without NaN
assert t_interval([2.0, 2.0, 2.0]).lo == 2.0 and t_interval([2.0, 2.0, 2.0]).excludes_zero  # no spread
assert t_interval([1.0, -1.0, 0.5]).verdict() == "no difference shown"
assert t_interval([0.10, 0.12, 0.11]).verdict() == "better" and t_interval([-0.10, -0.12, -0.11]).verdict() == "worse"
assert t_interval([-0.10, -0.12, -0.11]).verdict(higher_is_better=False) == "better"
assert (t_interval([0.021, 0.047, -0.005]).format(100)
        == "+2.1 [-4.4, +8.6]"), t_interval([0.021, 0.047, -0.005]).format(100)


# %% [markdown]
# ## Paired differences over seeds
#
# Results come as `{seed: value}` per method. Only seeds that both have are paired; a missing seed is dropped,
# not imputed.

# %%
#| export
def paired_seeds(method: dict, reference: dict) -> tuple[list, np.ndarray]:
    "(seeds both have, sorted; the per-seed differences method - reference), NaN values dropped with their seed."
    seeds = sorted(s for s in set(method) & set(reference)
                   if not (math.isnan(float(method[s])) or math.isnan(float(reference[s]))))
    return seeds, np.array([float(method[s]) - float(reference[s]) for s in seeds])


def paired_difference(method: dict, reference: dict, conf: float = 0.95) -> Interval:
    "t interval over seeds of `method[s] - reference[s]` (dicts seed -> value)."
    return t_interval(paired_seeds(method, reference)[1], conf)


# %%
_clip = {0: 0.697, 1: 0.71, 2: 0.68}
_m = {0: 0.66, 1: 0.67, 2: 0.65, 3: 0.9}      # seed 3 has no CLIP partner: left out
assert paired_seeds(_m, _clip)[0] == [0, 1, 2]
_iv = paired_difference(_m, _clip)
assert _iv.n == 3 and abs(_iv.mean - np.mean([0.66 - 0.697, 0.67 - 0.71, 0.65 - 0.68])) < 1e-12
assert _iv.verdict() == "worse", _iv
assert paired_difference({0: 1.0, 1: float("nan")}, {0: 0.5, 1: 0.5}).n == 1

# %% [markdown]
# Pairing matters: when the seed moves both methods alike, the paired interval is much narrower than the
# difference of two independent means would suggest. Here the seed adds up to ±5 points to both, the method
# adds 1 point, and only the paired interval sees it.

# %%
_seed_luck = np.array([0.05, -0.04, 0.01, 0.03, -0.05])
_ref = dict(enumerate(0.70 + _seed_luck))
_new = dict(enumerate(0.71 + _seed_luck + np.array([0.001, -0.002, 0.0, 0.002, -0.001])))
_paired = paired_difference(_new, _ref)
_unpaired_half = _st.t.ppf(0.975, 8) * math.sqrt(np.var(list(_ref.values()), ddof=1) * 2 / 5)
assert _paired.verdict() == "better" and _unpaired_half > 0.01, (_paired, _unpaired_half)
print("paired:", _paired.format(100), f"| unpaired half-width: ±{100 * _unpaired_half:.1f}")


# %% [markdown]
# ## Paired bootstrap over held-out scenes
#
# Per-item scores (1 when the item is answered right, 0 when not; or any per-item number) of the method and of the
# reference, as arrays of shape (seeds, items), the items being the same scenes in the same order for every seed.
# Each bootstrap replicate draws $N$ item indices with replacement, the same for every seed and both methods, and
# recomputes the mean over seeds of the mean difference. The interval is the percentile interval of the replicates.
# The generator is seeded, so the interval is a pure function of its inputs.

# %%
#| export
def bootstrap_paired(method, reference, n_boot: int = 2000, conf: float = 0.95, seed: int = 0,
                     chunk: int = 250) -> Interval:
    """Percentile interval of mean_seeds mean_items (method - reference) under resampling of the items.
    `method`, `reference`: (S, N) per-item scores on the same N items for each of S seeds (a 1-D array: one seed)."""
    a, b = np.atleast_2d(np.asarray(method, np.float64)), np.atleast_2d(np.asarray(reference, np.float64))
    if a.shape != b.shape:
        raise ValueError(f"method and reference need the same (seeds, items) shape, got {a.shape} and {b.shape}")
    if np.isnan(a).any() or np.isnan(b).any():
        raise ValueError("per-item scores contain NaN")
    d = (a - b).mean(0)                                    # (N,) mean over seeds of each item's difference
    N = d.shape[0]
    if N == 0:
        return Interval(math.nan, math.nan, math.nan, 0, conf, "bootstrap")
    rng = np.random.default_rng(seed)
    reps = np.concatenate([d[rng.integers(0, N, size=(min(chunk, n_boot - i), N))].mean(1)
                           for i in range(0, n_boot, chunk)])     # (n_boot,)
    lo, hi = np.quantile(reps, [(1 - conf) / 2, (1 + conf) / 2])
    return Interval(float(d.mean()), float(lo), float(hi), N, conf, "bootstrap")


# %%
_a = np.array([[1, 1, 0, 1, 0, 1] * 50, [1, 0, 0, 1, 1, 1] * 50], float)    # 2 seeds x 300 items
_iv = bootstrap_paired(_a, _a)
assert (_iv.mean, _iv.lo, _iv.hi) == (0.0, 0.0, 0.0)                       # identical answers: no difference at all
_b = _a.copy()
_b[:, :30] = 1 - _b[:, :30]
_iv = bootstrap_paired(_a, _b)
assert abs(_iv.mean - (_a - _b).mean()) < 1e-12 and _iv.lo < _iv.mean < _iv.hi and _iv.n == 300
assert bootstrap_paired(_a, _b, seed=1).lo != _iv.lo and bootstrap_paired(_a, _b).lo == _iv.lo   # seeded
test_fail(lambda: bootstrap_paired(_a, _b[:, :10]), contains="same (seeds, items) shape")

# %% [markdown]
# Its coverage for a known effect: items answered right with probability 0.70 by one method and 0.75 by the other
# (independently), 400 items, 500 simulated test sets: the interval should hold the true difference (+5 points)
# about 95 % of the time.

# %%
_rng = np.random.default_rng(1)
_hits = 0
for _ in range(500):
    _x, _y = (_rng.random((1, 400)) < 0.75).astype(float), (_rng.random((1, 400)) < 0.70).astype(float)
    _iv = bootstrap_paired(_x, _y, n_boot=400, seed=int(_rng.integers(1 << 30)))
    _hits += _iv.lo <= 0.05 <= _iv.hi
assert 0.90 <= _hits / 500 <= 0.985, _hits / 500
print(f"bootstrap coverage over 500 simulated test sets: {_hits / 500:.3f}")
