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
#| default_exp report

# %%
#| export
from __future__ import annotations

import csv, json, math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from powerclip.eval.world_scores import FOLDER_HEADLINE, HEADLINE
from powerclip.runrecord import records_line, table_record
from powerclip.stats import Interval, bootstrap_paired, holm, paired_detectable, paired_difference, paired_seeds
from powerclip.trainlog import plot_metrics

# %%
#| hide
import tempfile

from fastcore.test import test_close, test_eq, test_fail

# %% [markdown]
# # The comparison's report
#
# > What a comparison (`70_compare`) or an experiment (`71_experiments`) writes from its per-seed numbers.
#
# Means and spreads over seeds, paired differences to the reference row with their seed and scene intervals, the
# smallest differences the seeds can detect, verdicts, and the Markdown tables, `summary.csv`, `summary.json` and the
# learning curves (mean over seeds, and each seed's).

# %% [markdown]
# The numbers come from the world evaluation (`68_eval_world_scores`), whose `HEADLINE` names the ones that get paired
# differences and verdicts (hard-negative mean, R@1 both ways, pointing) and how the tables call them. Nothing here
# trains or evaluates.

# %%
#| export
# the row every paired difference is taken to, same seed, unless a plan names another (`71_experiments`)
REFERENCE = "CLIP"


# %% [markdown]
# ## The comparison

# %%
#| export
@dataclass
class Comparison:
    "What a comparison returns (and writes to `summary.json`)."
    per_seed: dict                # {seed: {row: numbers of its final weights on the test scenes (with per_scene
                                  # shares)}}
    curves: dict                  # {row: [{step, seconds, hn_mean, R@1, ...} mean over seeds]}
    summary: dict                 # {row: mean and sd over seeds}
    stats: dict                   # {row: {metric: {'t': Interval, 'boot': Interval, 'mdd': Interval, 'holm': p,
                                  # 'signs': {pos, neg, n}}}}
    sweeps: dict                  # {row: {key, candidates, chosen}}
    meta: dict
    seed_curves: dict = field(default_factory=dict)   # {row: {seed: [{step, seconds, hn_mean, R@1, ...}]}}: each
                                                      # seed's curve (`curves_per_seed.csv`); empty when not kept


# %% [markdown]
# ## Statistics over seeds
#
# `summarize_seeds` gives the mean and sample standard deviation over seeds of every number of every row, and each
# row's time per step relative to the reference (the ratio taken within each seed, then averaged). `paired_stats` gives,
# for each row and headline number, the t interval over seeds of the paired differences to the reference (`t`, the
# verdict), the paired bootstrap over scenes (`boot`), and the smallest true difference the design detects with 80 %
# power (`mdd`: two-sided paired t test at $\alpha = 0.05$ on the row's seeds, its sd the paired sd, with the 95 %
# interval from the chi-square interval of that sd; `69_stats`, "How large a difference the design can see").
#
# Beside each difference, `paired_stats` keeps its **Holm-adjusted p** (`holm`: the family is the row's headline
# numbers against the same reference, `69_stats`, "Several numbers at once") and its **sign count** (`signs`: on how
# many of the n seeds the difference is above 0, below 0).
#
# **Verdicts.** `verdicts` reads each number of a row: *better* or *worse* where the Holm-adjusted p over the row's
# numbers is below 0.05; *suggestive* (with the sign: "HN mean (+)") where only the raw 95 % seed interval excludes 0;
# else *no difference shown*. A seed interval of zero width (every seed the same difference, `69_stats`, "A degenerate
# interval") gives no p-value and no verdict of its own. We then read the scene bootstrap, and mark the number so ("i2t
# R@1 (+, scene bootstrap, seed sd 0)"): it is the one interval with a spread, and a difference that is the same on
# every seed is at least not training luck; but it knows only test-set sampling, and it has no p-value over seeds for
# Holm's correction to adjust. So **such a number is at most *suggestive***, and in its row's family it counts without
# being rejectable (`holm` with a NaN), which makes the other numbers' correction no weaker. Where there is no bootstrap
# (a merged report keeps no per-scene shares) the number is listed as *degenerate interval*, with no verdict. The other
# choices: to call such a number *no difference shown* would deny a difference every seed shows; to call it *better*
# on the t interval would claim a certainty three equal draws do not give.

# %%
#| export
def summarize_seeds(per_seed: dict, base: str = REFERENCE) -> dict[str, dict]:
    """Mean and sample sd (`_sd`) over seeds of every number of every row (a number named `*_min` or `*_max`, a range
    within each run: its minimum or maximum over seeds instead), and `time_ratio`: s/step relative to `base`, within
    each seed."""
    names = list(dict.fromkeys(n for res in per_seed.values() for n in res))
    out = {}
    for n in names:
        rows = [res[n] for res in per_seed.values() if n in res]
        keys = list(dict.fromkeys(k for r in rows for k, v in r.items() if isinstance(v, (int, float))
                                  and not isinstance(v, bool)))
        agg = dict(seeds=len(rows))
        for k in ("scorer", "regime"):
            if isinstance(rows[0].get(k), str):
                agg[k] = rows[0][k]
        for k in keys:
            v = [float(r[k]) for r in rows if k in r]
            if k.endswith(("_min", "_max")):                 # the range of a logged quantity: over every seed's run
                agg[k] = float(min(v) if k.endswith("_min") else max(v))
                continue
            agg[k] = float(np.mean(v))
            agg[k + "_sd"] = float(np.std(v, ddof=1)) if len(v) > 1 else float("nan")
        v = [res[n]["s_per_step"] / res[base]["s_per_step"] for res in per_seed.values()
             if n in res and base in res and res[n].get("s_per_step") and res[base].get("s_per_step")]
        if v:
            agg["time_ratio"], agg["time_ratio_sd"] = (float(np.mean(v)),
                                                       float(np.std(v, ddof=1)) if len(v) > 1 else float("nan"))
        out[n] = agg
    return out


def paired_stats(per_seed: dict, base: str = REFERENCE, metrics=HEADLINE, n_boot: int = 2000) -> dict:
    """{row: {metric: {'t': Interval over seeds, 'boot': Interval over scenes or None, 'mdd': smallest difference
    detectable with 80 % power, with its interval}}} of row - `base`, same seed (`69_stats`)."""
    names = list(dict.fromkeys(n for res in per_seed.values() for n in res if n != base))
    out = {}
    for n in names:
        for m in metrics:
            a = {s: r[n][m] for s, r in per_seed.items() if n in r and m in r[n]}
            b = {s: r[base][m] for s, r in per_seed.items() if base in r and m in r[base]}
            if not a or not b:
                continue
            common = [s for s in sorted(set(a) & set(b)) if m in per_seed[s][n].get("per_scene", {})
                      and m in per_seed[s][base].get("per_scene", {})]
            boot = None
            if common:
                x = np.array([per_seed[s][n]["per_scene"][m] for s in common])
                y = np.array([per_seed[s][base]["per_scene"][m] for s in common])
                if x.shape == y.shape:
                    boot = bootstrap_paired(x, y, n_boot=n_boot)
            d = paired_seeds(a, b)[1]
            out.setdefault(n, {})[m] = dict(t=paired_difference(a, b), boot=boot, mdd=paired_detectable(a, b),
                                            signs=dict(pos=int((d > 0).sum()), neg=int((d < 0).sum()), n=len(d)))
        by = out.get(n, {})
        for m, h in zip(by, holm([x["t"].p for x in by.values()])):     # the row's family: its numbers
            by[m]["holm"] = float(h)
    return out


# how a verdict read from the scene bootstrap (the seed interval of zero width) is marked
_FROM_BOOT = "scene bootstrap, seed sd 0"


ALPHA = 0.05      # the family-wise error rate of a row's verdicts (Holm over its numbers)


def metric_verdict(x: dict, p_holm: float | None = None) -> str:
    """The verdict on one number from its {'t': seed interval, 'boot': scene interval or None} and its Holm-adjusted p
    (None: a family of one, the raw p): 'better' | 'worse' where that p < `ALPHA`, 'suggestive (+)' | 'suggestive (-)'
    where only the raw interval excludes 0, else 'no difference shown'; a degenerate seed interval: the scene
    bootstrap's reading, at most suggestive, marked `_FROM_BOOT`, else 'degenerate interval' (see above)."""
    t = x["t"]
    sign = "+" if t.mean > 0 else "-"
    v = t.verdict()
    if v == "degenerate interval":
        boot = x.get("boot")
        if boot is None or boot.degenerate or math.isnan(boot.lo):
            return v
        return f"suggestive ({sign}, {_FROM_BOOT})" if boot.excludes_zero else f"no difference shown ({_FROM_BOOT})"
    if v == "no difference shown":
        return v
    p = t.p if p_holm is None else p_holm
    return v if p < ALPHA else f"suggestive ({sign})"


def verdicts(stats: dict, metrics=HEADLINE) -> dict[str, str]:
    """One phrase per row: 'better: ...; worse: ...; suggestive: ...' (Holm over the row's numbers; a suggestive
    number with its sign, one read from the scene bootstrap marked so), the numbers whose seed interval is degenerate
    with no bootstrap to read, or 'no difference shown'."""
    out = {}
    for n, by in stats.items():
        ms = [m for m in metrics if m in by]
        v = {m: metric_verdict(by[m], float(h)) for m, h in zip(ms, holm([by[m]["t"].p for m in ms]))}
        name = lambda m, x: metrics[m] + (f" ({x.split(' (', 1)[1]}" if x.startswith("suggestive") else "")
        groups = {k: [name(m, x) for m, x in v.items() if x.split(" (")[0] == k]
                  for k in ("better", "worse", "suggestive", "degenerate interval")}
        one = all(by[m]["t"].n < 2 for m in v)
        out[n] = ("one seed: no verdict" if one
                  else "; ".join(f"{k}: " + ", ".join(g) for k, g in groups.items() if g) or "no difference shown")
    return out


# %% [markdown]
# On hand-made results: means and sample standard deviations, ratios to CLIP within each seed, a paired t interval
# that sees a small difference which the seed spread hides, and a bootstrap over scenes.

# %%
_rng = np.random.default_rng(0)
_scenes = lambda p: (100 * (_rng.random(200) < p)).tolist()
_ps = {s: {"CLIP": dict(hn_mean=60.0 + 10 * s, s_per_step=1.0 + s, per_scene={"hn_mean": _scenes(0.6)}),
           "X": dict(hn_mean=63.0 + 10 * s + 0.1 * (-1) ** s, s_per_step=2.0 + s, scorer="late",
                     per_scene={"hn_mean": _scenes(0.7)})}
       for s in range(3)}
_sm = summarize_seeds(_ps)
test_close((_sm["X"]["hn_mean"], _sm["X"]["hn_mean_sd"]),
           (np.mean([63.1, 72.9, 83.1]), np.std([63.1, 72.9, 83.1], ddof=1)))
test_close(_sm["X"]["time_ratio"], np.mean([2 / 1, 3 / 2, 4 / 3]))
test_eq(_sm["X"]["scorer"], "late")
_st = paired_stats(_ps)
test_eq(_st["X"]["hn_mean"]["t"].verdict(), "better")
assert _st["X"]["hn_mean"]["boot"].n == 200
test_eq(verdicts(_st), {"X": "better: HN mean"})
assert _st["X"]["hn_mean"]["mdd"].n == 3 and _st["X"]["hn_mean"]["mdd"].method == "mdd"
# a seed interval of zero width: the scene bootstrap's verdict, marked; without a bootstrap no verdict
_deg = {s: {"CLIP": _ps[s]["CLIP"], "X": dict(_ps[s]["CLIP"], hn_mean=_ps[s]["CLIP"]["hn_mean"] + 5.0,
                                              per_scene={"hn_mean": _scenes(0.8)})} for s in _ps}
_sd0 = paired_stats(_deg)
test_eq(_sd0["X"]["hn_mean"]["t"].verdict(), "degenerate interval")
assert math.isnan(_sd0["X"]["hn_mean"]["mdd"].mean)                      # no spread: no power to estimate
test_eq(verdicts(_sd0), {"X": f"suggestive: HN mean (+, {_FROM_BOOT})"})   # its scenes 80 % against 60 %
_sd0["X"]["hn_mean"]["boot"] = None
test_eq(verdicts(_sd0), {"X": "degenerate interval: HN mean"})
# pairing removes the seed's share
assert _sm["X"]["hn_mean_sd"] > 9 and _st["X"]["hn_mean"]["t"].hi - _st["X"]["hn_mean"]["t"].lo < 2
# Holm over a row's numbers: HN mean's interval excludes 0 (p 0.040) but not after the correction over the row's three
# numbers (0.080): suggestive, with its sign; i2t R@1 (p 0.001, adjusted 0.003) stays worse
_d = {"hn_mean": [1.0, 2.0, 0.5, 1.5, 0.1], "i2t_R@1": [-3.0, -2.5, -4.0, -3.5, -2.0],
      "t2i_R@1": [0.5, -0.5, 1.0, -1.0, 0.2]}
_fam = {s: {"CLIP": {m: 50.0 for m in _d}, "X": {m: 50.0 + v[s] for m, v in _d.items()}} for s in range(5)}
_hs = paired_stats(_fam)["X"]
assert _hs["hn_mean"]["t"].excludes_zero and _hs["i2t_R@1"]["t"].excludes_zero
test_close(_hs["hn_mean"]["holm"], 2 * _hs["hn_mean"]["t"].p, eps=1e-12)
test_close(_hs["i2t_R@1"]["holm"], 3 * _hs["i2t_R@1"]["t"].p, eps=1e-12)
test_eq((_hs["hn_mean"]["signs"], _hs["t2i_R@1"]["signs"]), (dict(pos=5, neg=0, n=5), dict(pos=3, neg=2, n=5)))
test_eq(verdicts({"X": _hs}), {"X": "worse: i2t R@1; suggestive: HN mean (+)"})
test_eq(metric_verdict(_hs["hn_mean"]), "better")                                 # alone (a family of one) it is
# another family's numbers are named by that family's labels (the long table's long-caption retrieval)
_lf = {"long_i2t_R@1": "long i2t R@1", "long_t2i_R@1": "long t2i R@1"}
_fl = {s: {"CLIP": {m: 50.0 for m in _lf}, "X": {"long_i2t_R@1": 60.0 + s % 3, "long_t2i_R@1": 50.0 + (-1) ** s}}
       for s in range(8)}
test_eq(verdicts(paired_stats(_fl, metrics=_lf), _lf), {"X": "better: long i2t R@1"})


# %% [markdown]
# ## Tables and the plot
#
# `summary.md` holds, in this order: the headline table (the README quotes part of it: mean ± sd over seeds of the
# headline numbers, the paired differences to CLIP with their seed intervals, the verdict, time per step relative to
# CLIP), the paired differences with the scene bootstrap, every hard-negative kind, the sweep, and the rows left out.

# %%
#| export
def _cell(r: dict, k: str, fmt: str = "{:.1f}") -> str:
    v, sd = r.get(k, float("nan")), r.get(k + "_sd", float("nan"))
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return fmt.format(v) + ("" if sd is None or math.isnan(sd) else " ± " + fmt.format(sd))


def _label(name: str, r: dict) -> str:
    "A row's label, with its headline scorer when it is not the global cosine: 'FILIP [late]'."
    return name if r.get("scorer", "global") == "global" else f"{name} [{r['scorer']}]"


def _other(r: dict) -> str:
    "The numbers of a second scorer, for rows whose headline is not the global cosine."
    s = sorted({k.split(":")[0] for k in r if ":" in k and not k.endswith("_sd")})
    shown = list(FOLDER_HEADLINE)[:2]                 # the hard-negative mean and image-to-text R@1
    return "; ".join(f"{x}: " + ", ".join(f"{HEADLINE[k]} {_cell(r, f'{x}:{k}')}" for k in shown) for x in s) or ""


def headline_table(summary: dict, stats: dict, base: str = REFERENCE) -> str:
    "Markdown: mean ± sd over seeds, paired difference to `base` [95 % t interval over seeds], verdict, time per step."
    v = verdicts(stats)
    most = max((r.get("seeds", 0) for r in summary.values()), default=0)
    head = ["run", "regime", *HEADLINE.values(), *(f"Δ {h} vs {base}" for h in HEADLINE.values()),
            "verdict (seed intervals, Holm)", f"time/step vs {base}", "other scorer"]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (2 * len(HEADLINE)) + "---|---:|---|"]
    for n, r in summary.items():
        d = [stats.get(n, {}).get(m, {}).get("t") for m in HEADLINE]
        few = f" ({r['seeds']} seed{'s' if r['seeds'] > 1 else ''})" if r.get("seeds", most) < most else ""
        cells = [_label(n, r) + few, r.get("regime", ""), *(_cell(r, m) for m in HEADLINE),
                 *("-" if x is None else x.format() for x in d), v.get(n, "reference" if n == base else "-"),
                 _cell(r, "time_ratio", "{:.2f}") + ("x" if "time_ratio" in r else ""), _other(r)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def mdd_cell(x: dict | None) -> str:
    "'9.7 [5.0, 61.0]': the smallest detectable difference [95 % interval]; 'sd 0' for a degenerate seed interval."
    if x is None:
        return "-"
    if x["t"].degenerate:
        return "sd 0"
    d = x.get("mdd")
    return "-" if d is None or math.isnan(d.mean) else f"{d.mean:.1f} [{d.lo:.1f}, {d.hi:.1f}]"


def _per_run(stats: dict, head, cell) -> str:
    "Markdown: a row per run of `stats` (its seeds, then `cell(stats of a headline number)`), a column per number."
    lines = ["| run | seeds | " + " | ".join(head(HEADLINE[m]) for m in HEADLINE) + " |",
             "|---|---:|" + "---:|" * len(HEADLINE)]
    for n, by in stats.items():
        lines.append(f"| {n} | {max((x['t'].n for x in by.values()), default=0)} | "
                     + " | ".join(cell(by.get(m)) for m in HEADLINE) + " |")
    return "\n".join(lines)


def detectable_table(stats: dict, base: str = REFERENCE) -> str:
    """Markdown: for each paired difference to `base`, the smallest true difference detectable with 80 % power
    [95 % interval] (`paired_stats`' 'mdd')."""
    return _per_run(stats, lambda h: f"detectable Δ {h}", mdd_cell)


def p_cell(x: dict | None) -> str:
    "'0.022 / 0.065 / 7 of 8': raw p / Holm-adjusted p / seeds whose difference is above 0; 'sd 0' for no spread."
    if x is None:
        return "-"
    f = lambda v: "-" if math.isnan(v) else "<0.001" if v < 0.001 else f"{v:.3f}"
    sg = x.get("signs") or {}
    k = f" / {sg['pos']} of {sg['n']}" if sg.get("n") else ""
    if x["t"].degenerate:
        return "sd 0" + k
    return f"{f(x['t'].p)} / {f(x.get('holm', math.nan))}{k}"


def holm_table(stats: dict, base: str = REFERENCE) -> str:
    """Markdown: for each paired difference to `base`, its raw p, its Holm-adjusted p over the row's numbers and on how
    many seeds it is above 0 (`paired_stats`' 'holm' and 'signs')."""
    return _per_run(stats, lambda h: f"{h}: p / Holm p / seeds > 0", p_cell)


# what a method's runs log while training that the report shows: the trainer's `metrics.csv` column -> (the methods
# that log it, by name prefix; what it is). The comparison keeps, per run, its mean over the logged steps under the
# column's name without the underscore, with `_min` and `_max` (`70_compare`).
_LOGGED = {"_pgs_drop_ratio": ("clip-pgs", "patch drop ratio")}


def logged_numbers(rows: list[dict]) -> dict[str, float]:
    """A run's numbers from the rows of its `metrics.csv` (`read_metrics`): of each `_LOGGED` column it has, the mean
    over the logged steps (named without the underscore) and its `_min` and `_max`."""
    out = {}
    for col in _LOGGED:
        v = [float(r[col]) for r in rows if col in r]
        if v:
            k = col.lstrip("_")
            out.update({k: float(np.mean(v)), k + "_min": min(v), k + "_max": max(v)})
    return out


def logged_lines(summary: dict, per_seed: dict) -> list[str]:
    "One line per row whose method logs a `_LOGGED` column: its mean over the runs, sd, per seed and range; or why not."
    out = []
    for col, (prefix, what) in _LOGGED.items():
        k = col.lstrip("_")
        for n in summary:
            runs = [res[n] for res in per_seed.values() if n in res]
            if not any(str(r.get("method", "")).startswith(prefix) for r in runs):
                continue
            have = [float(r[k]) for r in runs if k in r]
            if not have:
                out.append(f"{n}: {what} not recorded in this report (`{col}` of its runs' metrics.csv; the report was "
                           "written before the comparison read it)")
                continue
            r, sd = summary[n], summary[n].get(k + "_sd", float("nan"))
            out.append(f"{n}: {what} as its runs logged it (`{col}` in metrics.csv, mean over each run's logged "
                       f"steps): {r[k]:.3f}{'' if sd is None or math.isnan(sd) else f' ± {sd:.3f}'} over "
                       f"{len(have)} seed(s) (per seed {', '.join(f'{v:.3f}' for v in have)}); every logged step "
                       f"between {r.get(k + '_min', float('nan')):.3f} and {r.get(k + '_max', float('nan')):.3f}")
    return out


def bootstrap_table(stats: dict, base: str = REFERENCE) -> str:
    "Markdown: paired differences to `base` with the 95 % bootstrap interval over held-out scenes."
    lines = ["| run | " + " | ".join(f"Δ {HEADLINE[m]}" for m in HEADLINE) + " |", "|---|" + "---:|" * len(HEADLINE)]
    for n, by in stats.items():
        lines.append(f"| {n} | " + " | ".join("-" if by.get(m, {}).get("boot") is None else by[m]["boot"].format()
                                              for m in HEADLINE) + " |")
    return "\n".join(lines)


def kinds_table(summary: dict) -> str:
    """Markdown: mean ± sd over seeds of the hard-negative accuracy of every kind, R@5 both ways, IoU, the region
    numbers."""
    from powerclip.world import NEGATIVE_KINDS
    cols = ([(f"hn_{k}", k) for k in NEGATIVE_KINDS]
            + [("i2t_R@5", "i2t R@5"), ("t2i_R@5", "t2i R@5"), ("mean_iou", "IoU"),
                                                         ("region_ap50", "region AP50"),
               ("region_crop_acc", "region top-1 crop"),
                                                         ("region_crop_ap50", "region AP50 crop"),
                                                         ("region_shape_acc", "region top-1 shape"),
               ("train_s_total", "train s")])
    cols = [c for c in cols if any(c[0] in r for r in summary.values())]
    lines = ["| run | " + " | ".join(h for _, h in cols) + " |", "|---|" + "---:|" * len(cols)]
    lines += [f"| {_label(n, r)} | "
              + " | ".join(_cell(r, k, "{:.0f}" if k == "train_s_total" else "{:.1f}") for k, _ in cols) + " |"
              for n, r in summary.items()]
    return "\n".join(lines)


def sweep_table(sweep: dict) -> str:
    "Markdown: the validation numbers of each candidate value of a sweep, and the value kept."
    lines = [f"| {sweep['key']} | " + " | ".join(f"val {h}" for h in FOLDER_HEADLINE.values()) + " | seeds | kept |",
             "|---:|" + "---:|" * len(FOLDER_HEADLINE) + "---:|---|"]
    for v, r in sweep["candidates"].items():
        lines.append(f"| {v} | " + " | ".join(_cell(r, k) for k in FOLDER_HEADLINE) + f" | {r['seeds']} | "
                     f"{'**kept**' if float(v) == float(sweep['chosen']) else ''} |")
    return "\n".join(lines)


def plot_curves(curves: dict, path=None, title: str = ""):
    """Hard-negative mean, R@1 (mean of both directions) and, when scored, region top-1 against steps and against
    training seconds, mean over seeds: one figure, every row (a fine-tuned row's curve starts at its base's
    snapshot)."""
    from matplotlib.figure import Figure
    panels = [("hn_mean", "hard-negative mean (%)"), ("R@1", "R@1, mean of both directions (%)")]
    if any("region_acc" in p for pts in curves.values() for p in pts):
        panels.append(("region_acc", "region top-1, pooled (%)"))
    fig = Figure(figsize=(10, 3.2 * len(panels)))
    axes = fig.subplots(len(panels), 2)
    import matplotlib
    colours = matplotlib.colormaps["tab20"].colors   # 20 distinct colours: the default cycle repeats after 10 rows
    for k, (name, pts) in enumerate(curves.items()):
        if not pts:
            continue
        style = dict(color=colours[(2 * k) % 20 + (k // 10) % 2], ls="-" if k < 10 else "--", marker="o", ms=3,
                     lw=1.2, label=name)
        for i, (key, lab) in enumerate(panels):
            if not all(key in p for p in pts):
                continue
            for j, x in enumerate(("step", "seconds")):
                axes[i][j].plot([p[x] for p in pts], [p[key] for p in pts], **style)
                axes[i][j].set_ylabel(lab)
                axes[i][j].set_xlabel("training step" if x == "step" else "training wall-clock (s)")
    axes[0][0].legend(fontsize=7, ncol=2)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig


# %% [markdown]
# The detectable differences of the hand-made rows above, and a CLIP-PGS row's logged drop ratio: each run's mean
# over its logged steps, then the mean over seeds, with the range over every logged step of every seed. A comparison
# written before the runs' log was read says so instead of a number.

# %%
assert "| X | 3 | " in detectable_table(_st) and "sd 0" in detectable_table(paired_stats(_deg))
assert ("| X | 5 | 0.040 / 0.080 / 5 of 5 | 0.001 / 0.003 / 0 of 5 | 0.916 / 0.916 / 3 of 5 | - |"
        in holm_table({"X": _hs}))
assert "| X | 3 | sd 0 / 3 of 3 |" in holm_table(paired_stats(_deg))
_log = [logged_numbers([{"step": 10, "_pgs_drop_ratio": a}, {"step": 20, "_pgs_drop_ratio": b}, {"step": 30}])
        for a, b in ((0.30, 0.40), (0.32, 0.36))]
test_eq(_log[0], dict(pgs_drop_ratio=0.35, pgs_drop_ratio_min=0.30, pgs_drop_ratio_max=0.40))
test_eq(logged_numbers([{"step": 10, "loss": 1.0}]), {})
_pgs = {s: {"CLIP": dict(hn_mean=60.0), "CLIP-PGS": dict(hn_mean=61.0, method="clip-pgs-0.3", **_log[s])}
        for s in (0, 1)}
_sm = summarize_seeds(_pgs)
test_close((_sm["CLIP-PGS"]["pgs_drop_ratio"], _sm["CLIP-PGS"]["pgs_drop_ratio_min"],
            _sm["CLIP-PGS"]["pgs_drop_ratio_max"]), (0.345, 0.30, 0.40), eps=1e-12)
print(logged_lines(_sm, _pgs)[0])
assert "0.345 ± 0.007 over 2 seed(s) (per seed 0.350, 0.340); every logged step between 0.300 and 0.400" in \
    logged_lines(_sm, _pgs)[0]
_old = {s: {n: {k: v for k, v in r.items() if "pgs" not in k} for n, r in res.items()} for s, res in _pgs.items()}
assert "not recorded" in logged_lines(summarize_seeds(_old), _old)[0]
test_eq(logged_lines(_sm, {s: {"CLIP": r["CLIP"]} for s, r in _pgs.items()}), [])   # no CLIP-PGS row: no line


# %% [markdown]
# ## The files
#
# `write_outputs` writes, under the report folder: `summary.md` (the header line with the budget, the machine and the
# command, then the tables above, the smallest detectable differences beside the headline table, and what the runs
# logged), `summary.csv` (the headline table as tidy rows, for a spreadsheet or pandas, with each difference's smallest
# detectable difference), `summary.json` (everything, the per-scene shares left out), `curves.png` (the curves' mean
# over seeds), `curves_per_seed.csv` (each seed's curve: row, seed, step and every curve key; when the comparison kept
# them) and `loss_curves.png` (the first seed's training losses).

# %%
#| export
def summary_rows(cmp: Comparison) -> list[dict]:
    """The headline table as tidy rows (run, metric): mean, sd and seeds, the paired difference to the reference with
    its t interval, its raw and Holm-adjusted p and sign count, the smallest difference detectable with 80 % power
    with its interval, and the verdict."""
    ref, rows = cmp.meta.get("reference", REFERENCE), []
    for n, r in cmp.summary.items():
        for m in HEADLINE:
            if m not in r:
                continue
            x = cmp.stats.get(n, {}).get(m, {})
            t, d, sg = x.get("t"), x.get("mdd"), x.get("signs") or {}
            rows.append(dict(run=n, regime=r.get("regime", ""), metric=m, mean=r[m], sd=r.get(m + "_sd"),
                             seeds=r["seeds"],
                             reference=ref, delta=t.mean if t else None, lo=t.lo if t else None, hi=t.hi if t else None,
                             p=t.p if t else None, p_holm=x.get("holm"), seeds_above_0=sg.get("pos"),
                             mdd=d.mean if d else None, mdd_lo=d.lo if d else None, mdd_hi=d.hi if d else None,
                             verdict=metric_verdict(x, x.get("holm")) if t else ("reference" if n == ref else "")))
    return rows


_SEED_CSV = "curves_per_seed.csv"


def write_seed_curves(seed_curves: dict, path) -> None:
    "`seed_curves` ({row: {seed: [points]}}) as a CSV: row, seed, step, then every other key of the points."
    keys = list(dict.fromkeys(k for per in seed_curves.values() for pts in per.values() for p in pts for k in p
                              if k != "step"))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, ["row", "seed", "step", *keys])
        w.writeheader()
        w.writerows({"row": n, "seed": s, **p} for n, per in seed_curves.items() for s, pts in sorted(per.items())
                    for p in pts)


def read_seed_curves(folder) -> dict:
    "The `curves_per_seed.csv` of `folder` as {row: {seed: [points]}} (empty cells left out); {} when there is none."
    f = Path(folder) / _SEED_CSV
    if not f.is_file():
        return {}
    out = {}
    try:
        with open(f, newline="") as fh:
            for r in csv.DictReader(fh):
                p = {k: float(v) for k, v in r.items() if k not in ("row", "seed") and v not in ("", None)}
                p["step"] = int(p["step"])
                out.setdefault(r["row"], {}).setdefault(int(r["seed"]), []).append(p)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{f}: not a file of per-seed curves ({type(e).__name__}: {e})") from None
    return out


def write_outputs(cmp: Comparison, out, losses: dict | None = None) -> None:
    """`summary.md`, `summary.csv`, `summary.json`, `curves.png`, `curves_per_seed.csv` (when the comparison kept
    each seed's curve) and `loss_curves.png` (with `losses`) of a comparison."""
    out, m = Path(out), cmp.meta
    head = (f"{len(m['seeds'])} seed(s) {m['seeds']}, T = {m['steps']} steps (fine-tunes: F = {m['finetune_steps']}), "
            f"preset {m['preset']}{', overrides ' + str(m['overrides']) if m['overrides'] else ''}; {m['eval_images']} "
            f"held-out test scenes, pointing on {m['grounding_scenes']}; {m['device']}, {m['machine']['cores']} cores, "
            f"torch {m['machine']['torch']}; started {m['started']}, {m['seconds']} s (training loops of the table's "
            f"runs: {m['train_seconds']} s, sweeps apart)"
            + (f"; `{m['command']}`" if m.get("command") else "")
            + ("; merged from " + ", ".join(f"{x['folder']} (seeds {x['seeds']}, started {x['started']})"
                                            for x in m["merged_from"]) if m.get("merged_from") else ""))
    ref = m.get("reference", REFERENCE)
    runs_line, mixed = records_line(cmp.per_seed, m.get("threads"))   # mixed commits or thread counts: in the header
    parts = [*([mixed, ""] if mixed else []), head, "", runs_line, "",
             f"Mean ± sd over seeds (%); Δ: paired difference to {ref} on the same seed, mean [95 % t "
             "interval over seeds]; the verdict reads the seed intervals with Holm's correction over each row's "
             "numbers (better/worse only where the Holm-adjusted p < 0.05; suggestive, with its sign, where only the "
             "raw interval excludes 0; where every seed gives the same difference, a seed interval of zero width, it "
             f"reads the scene bootstrap, says so, '{_FROM_BOOT}', and says at most suggestive).", "",
             headline_table(cmp.summary, cmp.stats, ref)]
    if cmp.stats:
        parts += ["", f"Each difference to {ref}: its raw p (paired t test over seeds), its Holm-adjusted p over the "
                      "row's numbers (the verdict's), and on how many seeds it is above 0 ('sd 0': every seed gave the "
                      "same difference, no p-value):", "", holm_table(cmp.stats, ref)]
        parts += ["", f"Smallest true difference to {ref} each row's seeds detect with 80 % power (two-sided paired t "
                      "test, alpha 0.05, on the row's seeds, the paired sd of its seeds as the true sd; `69_stats`), "
                      "[95 % interval from the chi-square interval of that sd]: a 'no difference shown' does not "
                      "rule out a difference below what is detectable ('sd 0': every seed gave the same difference).",
                  "", detectable_table(cmp.stats, ref)]
    logged = logged_lines(cmp.summary, cmp.per_seed)
    if logged:
        parts += ["", "Logged in training:", "", *(f"- {x}" for x in logged)]
    if any(x.get("boot") is not None for by in cmp.stats.values() for x in by.values()):   # none after a merge
        parts += ["", f"Paired differences to {ref} with the 95 % bootstrap interval over held-out scenes (test-set "
                            "sampling only; not the verdict):", "", bootstrap_table(cmp.stats, ref)]
    parts += ["", "Every hard-negative kind, R@5, IoU of the pointing maps, training seconds:", "",
              kinds_table(cmp.summary)]
    for n, s in cmp.sweeps.items():
        parts += ["", f"{n}: {s['key']} chosen on {m['eval_images']} validation scenes (seeds "
                      f"{s['seeds']}; {s['criterion']}):", "",
                  sweep_table(s)]
    if m.get("skipped"):
        parts += ["", "Left out: " + "; ".join(f"{k} ({v})" for k, v in m["skipped"].items())]
    (out / "summary.md").write_text("\n".join(parts) + "\n")
    rows = summary_rows(cmp)
    with open(out / "summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, list(rows[0]) if rows else ["run"])
        w.writeheader()
        w.writerows(rows)
    plain = lambda x: asdict(x) if isinstance(x, Interval) else x
    stats = {n: {k: {a: plain(b) for a, b in v.items()} for k, v in by.items()} for n, by in cmp.stats.items()}
    numbers = {s: {n: {**({} if n == "untrained" else {"record": table_record(None, r)}),   # older runs: their
                       **{k: v for k, v in r.items() if k != "per_scene"}} for n, r in res.items()}   # threads, if kept
               for s, res in cmp.per_seed.items()}
    (out / "summary.json").write_text(json.dumps(dict(meta=m, summary=cmp.summary, stats=stats, sweeps=cmp.sweeps,
                                                      curves=cmp.curves, per_seed=numbers), indent=1, default=str))
    plot_curves(cmp.curves, out / "curves.png", title=f"mean over seeds {m['seeds']}; T = {m['steps']}")
    if cmp.seed_curves:
        write_seed_curves(cmp.seed_curves, out / _SEED_CSV)
    else:                   # an earlier report's, which this one would seem to have written
        (out / _SEED_CSV).unlink(missing_ok=True)
    if losses:
        plot_metrics(losses, out / "loss_curves.png", title=f"training loss, seed {m['seeds'][0]}")


# %% [markdown]
# ## Seeds run apart, read together
#
# A comparison over many seeds is long on a small machine, and a session can end before the last seed does. The seeds
# of one plan can then run at different times, or on different machines of the same kind, and be read together:
# `load_comparison` reads a finished comparison back from its `summary.json`, and `merge_comparisons` joins several
# over disjoint seeds into one. The per-seed numbers are what the seed statistics need, so the means, spreads, paired
# differences and verdicts are the ones a single run over all the seeds would give; the learning curves are averaged
# with each comparison weighted by its number of seeds (the same mean of the seeds' curves). What a merge cannot give
# is the bootstrap over scenes: `summary.json` does not keep the per-scene shares, so a merged report has the seed
# intervals (the verdict) and leaves the scene column empty.
#
# Merging is refused, with one line naming the first field that differs, unless the comparisons are the same plan:
# the same budget, preset and overrides, held-out scenes and device (`MERGE_SAME`), and the same sweep choice and
# regime for a row both have. The rows may differ (a row left out of a later part, say, for lack of time): a row's numbers
# are then those of the seeds that ran it, the table says how many after its name, and with one seed it gets no
# verdict. Two
# comparisons may share a seed when they ran different rows of it (the class-token rows of seeds 3-7 in one session,
# the average-pooling rows of the same seeds in another): what is refused is one row of one seed in two parts, which
# would count one run as two. The chance line (`untrained`), which every part evaluates for each of its seeds, is the
# exception: it is the same network on the same scenes, so two parts must agree on it (timings aside), and it counts
# once.

# %%
#| export
# what must agree between comparisons read together: the budget and regime, the test scenes, the device
MERGE_SAME = ("preset", "overrides", "steps", "finetune_steps", "finetune_share", "eval_images", "grounding_scenes",
              "curve_points", "reference", "device")


def trained_stats(per_seed: dict, ref: str) -> dict:
    "`paired_stats` of the trained rows: the chance line (`untrained`) gets no difference or verdict."
    return paired_stats({s: {n: r for n, r in res.items() if n != "untrained"} for s, res in per_seed.items()}, ref)


def load_comparison(folder) -> Comparison:
    """A finished comparison read back from `folder/summary.json` (per-seed numbers, curves, sweeps, meta; the paired
    differences recomputed from the per-seed numbers, seed intervals only)."""
    f = Path(folder) / "summary.json"
    if not f.is_file():
        raise ValueError(f"{folder}: no summary.json (not a finished comparison)")
    try:   # every shape a merge reads, checked here: a malformed file is one line naming it, before anything trains
        d = json.loads(f.read_text())
        per_seed = {int(s): {n: dict(r) for n, r in res.items()} for s, res in d["per_seed"].items()}
        meta = dict(d["meta"], folder=str(folder))
        curves, summary, sweeps = (dict(d.get(k, {})) for k in ("curves", "summary", "sweeps"))
        if any(not isinstance(v, (int, float)) for pts in curves.values() for p in pts for v in p.values()):
            raise TypeError("a learning curve's point holds a value that is not a number")
        stats = trained_stats(per_seed, meta.get("reference", REFERENCE))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{f}: not a comparison's summary ({type(e).__name__}: {e})") from None
    return Comparison(per_seed, curves, summary, stats, sweeps, meta, read_seed_curves(folder))


def _untimed(r: dict) -> dict:
    "A row's numbers without its timings (`eval_s`, ...): what must agree where one run is read twice."
    return {k: v for k, v in r.items() if not k.endswith("_s")}


def merge_comparisons(cmps: list[Comparison]) -> Comparison:
    """One comparison from `cmps`, the same plan (`MERGE_SAME`) over disjoint runs (a seed may be in two parts for
    different rows; its chance line, which each part evaluates, must agree): per-seed numbers joined (without
    per-scene shares), means, spreads, paired differences and verdicts recomputed, curves averaged weighted by seeds,
    the rows of every part (in the order they first appear), each seed's curves joined where the parts kept them,
    `meta['merged_from']` naming each part."""
    if len(cmps) < 2:
        raise ValueError(f"merge: need at least 2 comparisons, got {len(cmps)}")
    first = cmps[0].meta
    plain = lambda v: json.loads(json.dumps(v, default=str))     # as summary.json holds it: a tuple is a list there
    for c in cmps[1:]:
        for k in MERGE_SAME:
            if plain(c.meta.get(k)) != plain(first.get(k)):
                raise ValueError(f"merge: {k} differs ({first.get(k)!r} in {first.get('folder', 'the first')}, "
                                 f"{c.meta.get(k)!r} in {c.meta.get('folder', 'another')}): not the same plan")
    chosen = {}
    for c in cmps:
        for n, v in (c.meta.get("chosen") or {}).items():
            if chosen.setdefault(n, v) != v:
                raise ValueError(f"merge: row {n} swept to {chosen[n]} in one part and {v} in another: not the same "
                                 "runs")
    regime = {}
    for c in cmps:
        for n, r in ((n, r) for res in c.per_seed.values() for n, r in res.items() if r.get("regime")):
            if regime.setdefault(n, r["regime"]) != r["regime"]:
                raise ValueError(f"merge: row {n} is {regime[n]!r} in one part and {r['regime']!r} in another: not "
                                 "the same runs")
    per_seed = {}
    for c in cmps:
        for s, res in c.per_seed.items():
            have = per_seed.setdefault(s, {})
            for n, r in res.items():
                r = {k: v for k, v in r.items() if k != "per_scene"}
                if n in have and n != "untrained":
                    raise ValueError(f"merge: {n} of seed {s} is in two comparisons: each run may count once")
                if n in have and _untimed(have[n]) != _untimed(r):
                    raise ValueError(f"merge: the chance line of seed {s} differs between two comparisons: not the "
                                     "same initialisation or test scenes")
                have.setdefault(n, r)
    per_seed = dict(sorted(per_seed.items()))
    ref = first.get("reference", REFERENCE)
    runs = list(dict.fromkeys(n for c in cmps for n in c.meta.get("runs", [])))
    curves = {}
    for n in runs:
        cs = [(sum(n in res for res in c.per_seed.values()), c.curves[n]) for c in cmps if c.curves.get(n)]
        cs = [(w, c) for w, c in cs if w > 0]      # a part's curve of a row none of its seeds has: nothing to weigh
        k = min((len(c) for _, c in cs), default=0)
        curves[n] = [{key: sum(w * c[i][key] for w, c in cs) / sum(w for w, _ in cs) for key in cs[0][1][i]}
                     for i in range(k)]
    parts = [dict(folder=c.meta.get("folder", "this run"), seeds=sorted(c.per_seed), started=c.meta.get("started"),
                  command=c.meta.get("command"), machine=c.meta.get("machine")) for c in cmps]
    meta = dict(first, runs=runs, chosen=chosen, seeds=sorted(per_seed),
                started=min(str(c.meta.get("started")) for c in cmps),
                seconds=sum(c.meta.get("seconds", 0) for c in cmps),
                train_seconds=sum(c.meta.get("train_seconds", 0) for c in cmps), merged_from=parts, command=None)
    meta.pop("folder", None)
    seed_curves = {n: {s: pts for c in cmps for s, pts in c.seed_curves.get(n, {}).items()} for n in runs}
    return Comparison(per_seed, curves, summarize_seeds(per_seed, ref), trained_stats(per_seed, ref),
                      cmps[0].sweeps, meta, {n: per for n, per in seed_curves.items() if per})


# %% [markdown]
# Three seeds run as one comparison and as two (seed 0, then seeds 1 and 2) give the same means, spreads and seed
# intervals; the curves are the mean of the three seeds' curves; plans that differ, or share a run, are refused.

# %%
def _cmp(seeds, **meta):
    ps = {s: {"untrained": dict(hn_mean=50.0 + s, regime="chance line"),
              **{n: {k: v for k, v in r.items() if k != "per_scene"} for n, r in _ps[s].items()}} for s in seeds}
    curves = {n: [dict(step=10, seconds=1.0, hn_mean=float(np.mean([_ps[s][n]["hn_mean"] for s in seeds])))]
              for n in ("CLIP", "X")}
    m = dict(runs=["CLIP", "X"], preset="demo", overrides={}, steps=10, finetune_steps=2, eval_images=200,
             grounding_scenes=0, curve_points=[1.0], seeds=list(seeds), started=f"day {seeds[0]}", seconds=5,
             train_seconds=4, device="cpu", machine=dict(cores=2, torch="x"))
    trained = {s: {n: r for n, r in res.items() if n != "untrained"} for s, res in ps.items()}
    return Comparison(ps, curves, summarize_seeds(ps), paired_stats(trained), {}, {**m, **meta})


_all, _parts = _cmp([0, 1, 2]), [_cmp([0]), _cmp([1, 2])]
with tempfile.TemporaryDirectory() as _d:
    for _i, _c in enumerate(_parts):
        (Path(_d) / f"p{_i}").mkdir()
        write_outputs(_c, Path(_d) / f"p{_i}")
    _m = merge_comparisons([load_comparison(Path(_d) / f"p{_i}") for _i in range(2)])
    write_outputs(_m, _d)
    assert "merged from" in (Path(_d) / "summary.md").read_text()
    assert "bootstrap interval over" not in (Path(_d) / "summary.md").read_text()   # no per-scene shares after a merge
test_eq(_m.meta["seeds"], [0, 1, 2])
test_eq(_m.meta["train_seconds"], 8)
for _k in ("hn_mean", "hn_mean_sd"):
    test_close(_m.summary["X"][_k], _all.summary["X"][_k], eps=1e-9)
test_close(_m.stats["X"]["hn_mean"]["t"].lo, _all.stats["X"]["hn_mean"]["t"].lo, eps=1e-9)
test_eq(_m.stats["X"]["hn_mean"]["boot"], None)
test_eq(set(_m.stats), {"X"})                      # the chance line: no difference, no verdict
test_close(_m.curves["X"][0]["hn_mean"], _all.curves["X"][0]["hn_mean"], eps=1e-9)
test_fail(lambda: merge_comparisons([_cmp([0]), _cmp([1]), _cmp([2], steps=20)]), contains="steps differs")
test_fail(lambda: merge_comparisons([_cmp([0]), _cmp([0, 1])]), contains="CLIP of seed 0 is in two comparisons")
# one seed in two parts, different rows of it (CLIP in one, X in the other): joined, the chance line counted once
_a, _b = _cmp([0, 1]), _cmp([0, 1])
for _s in (0, 1):
    del _a.per_seed[_s]["X"]
    del _b.per_seed[_s]["CLIP"]
    _b.per_seed[_s]["untrained"]["eval_s"] = 7.0          # a timing: not a number that must agree
_m4 = merge_comparisons([_a, _b])
test_eq({s: sorted(r) for s, r in _m4.per_seed.items()}, {s: ["CLIP", "X", "untrained"] for s in (0, 1)})
test_close(_m4.stats["X"]["hn_mean"]["t"].lo, _cmp([0, 1]).stats["X"]["hn_mean"]["t"].lo, eps=1e-9)
_b.per_seed[1]["untrained"]["hn_mean"] += 1
test_fail(lambda: merge_comparisons([_a, _b]), contains="the chance line of seed 1 differs")
test_fail(lambda: merge_comparisons([_cmp([0], chosen={"X": 1.0}), _cmp([1], chosen={"X": 5.0})]), contains="swept")
# a row that only the first part ran: its numbers from that part's seeds, one seed, no verdict
_y = _cmp([1, 2])
_y.per_seed = {s: {n: r[n] for n in ("untrained", "CLIP")} for s, r in _y.per_seed.items()}
_y.meta["runs"], _y.curves = ["CLIP"], {"CLIP": _y.curves["CLIP"]}
_m2 = merge_comparisons([_cmp([0]), _y])
test_eq((_m2.meta["runs"], _m2.summary["X"]["seeds"], _m2.summary["CLIP"]["seeds"]), (["CLIP", "X"], 1, 3))
test_eq(verdicts(_m2.stats)["X"], "one seed: no verdict")
assert "| X [late] (1 seed) |" in headline_table(_m2.summary, _m2.stats)
_w, _z = _cmp([0]), _cmp([1])
_w.per_seed[0]["X"]["regime"], _z.per_seed[1]["X"]["regime"] = "pre-train 10", "pre-train 20"
test_fail(lambda: merge_comparisons([_w, _z]), contains="row X is")
test_close(_m2.curves["X"][0]["hn_mean"], _ps[0]["X"]["hn_mean"], eps=1e-9)
_y.curves["X"] = _cmp([1]).curves["X"]            # a curve left over for a row its seeds lack: weighs nothing
test_close(merge_comparisons([_cmp([0]), _y]).curves["X"][0]["hn_mean"], _ps[0]["X"]["hn_mean"], eps=1e-9)
test_fail(lambda: load_comparison("/nonexistent"), contains="no summary.json")
with tempfile.TemporaryDirectory() as _d:   # malformed per-seed numbers or curves: one line naming the file
    for _bad in (dict(per_seed={"0": [1, 2]}), dict(per_seed={"0": {"CLIP": {"hn_mean": "x"}, "X": {"hn_mean": 1}}}),
                 dict(per_seed={}, curves={"CLIP": [{"step": "late"}]})):
        (Path(_d) / "summary.json").write_text(json.dumps(dict(meta={}, **_bad)))
        test_fail(lambda: load_comparison(_d), contains=f"{Path(_d) / 'summary.json'}: not a comparison's summary")

# %% [markdown]
# Each seed's curve travels with its part: written to `curves_per_seed.csv`, read back by `load_comparison` and joined
# by the merge; the detectable differences are recomputed with the rest.

# %%
with tempfile.TemporaryDirectory() as _d:
    for _i, _c in enumerate(_parts):
        _c.seed_curves = {n: {s: [dict(step=10, seconds=1.5, hn_mean=_ps[s][n]["hn_mean"])] for s in _c.per_seed}
                          for n in ("CLIP", "X")}
        (Path(_d) / f"p{_i}").mkdir()
        write_outputs(_c, Path(_d) / f"p{_i}")
    _back = load_comparison(Path(_d) / "p1")
    test_eq(_back.seed_curves, _parts[1].seed_curves)
    _m3 = merge_comparisons([load_comparison(Path(_d) / f"p{_i}") for _i in range(2)])
    write_outputs(_m3, _d)
    test_eq(read_seed_curves(_d)["X"][2], [dict(step=10, seconds=1.5, hn_mean=_ps[2]["X"]["hn_mean"])])
    assert "detectable" in (Path(_d) / "summary.md").read_text()
    with open(Path(_d) / "summary.csv") as _f:
        _row = next(r for r in csv.DictReader(_f) if r["run"] == "X" and r["metric"] == "hn_mean")
    test_close(float(_row["mdd"]), _all.stats["X"]["hn_mean"]["mdd"].mean, eps=1e-9)
    (Path(_d) / _SEED_CSV).write_text("row,seed,step\nX,zero,1\n")
    test_fail(lambda: load_comparison(_d), contains="not a file of per-seed curves")
test_eq(sorted(_m3.seed_curves["X"]), [0, 1, 2])
test_close(_m3.stats["X"]["hn_mean"]["mdd"].hi, _all.stats["X"]["hn_mean"]["mdd"].hi, eps=1e-9)


# %% [markdown]
# ## A finished report, rewritten
#
# When the report gains a column, the committed results get it without retraining: `rewrite_outputs` reads a folder's
# `summary.json` (`load_comparison`: the seed statistics recomputed from the per-seed numbers), puts back the scene
# bootstrap as the file recorded it (the per-scene shares it came from are not kept), and writes the files again with
# this version of `write_outputs`. It refuses when a recomputed seed interval differs from the recorded one (the
# numbers would not be the file's). `loss_curves.png` needs the runs and is left as it is.

# %%
#| export
def rewrite_outputs(folder) -> Comparison:
    "Rewrite `folder`'s summary files from its `summary.json` with this version of the report (see above)."
    c = load_comparison(folder)
    d = json.loads((Path(folder) / "summary.json").read_text())
    for n, by in c.stats.items():
        for m, x in by.items():
            rec = d.get("stats", {}).get(n, {}).get(m, {})
            t = rec.get("t") or {}
            if any(not math.isclose(getattr(x["t"], k), t.get(k, math.nan), rel_tol=1e-9, abs_tol=1e-12)
                   for k in ("mean", "lo", "hi") if not math.isnan(getattr(x["t"], k))):
                raise ValueError(f"{folder}: the seed interval of {n} {m} recomputes to {x['t'].format()}, not the "
                                 f"recorded {t}: not rewritten")
            x["boot"] = Interval(**rec["boot"]) if rec.get("boot") else None
    c.meta.pop("folder", None)
    write_outputs(c, folder)
    return c


# %%
with tempfile.TemporaryDirectory() as _d:
    write_outputs(_all, _d)
    _before = {f: (Path(_d) / f).read_bytes() for f in ("summary.md", "summary.csv", "summary.json")}
    _re = rewrite_outputs(_d)
    test_eq({f: (Path(_d) / f).read_bytes() for f in _before}, _before)       # the same report, byte for byte
    test_eq(_re.stats["X"]["hn_mean"]["boot"], _all.stats["X"]["hn_mean"]["boot"])
    _j = json.loads((Path(_d) / "summary.json").read_text())
    _j["per_seed"]["0"]["X"]["hn_mean"] += 1
    (Path(_d) / "summary.json").write_text(json.dumps(_j))
    test_fail(lambda: rewrite_outputs(_d), contains="recomputes to")
