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
#| default_exp demo

# %%
#| export
from __future__ import annotations

import argparse, json, math, statistics, sys, time
from pathlib import Path

import numpy as np
import torch

from powerclip.data import derive_seed, world_config
from powerclip.eval.data import write_world_benchmark
from powerclip.eval.models import Evaluator, load_model
from powerclip.eval.tasks import evaluate_world
from powerclip.measure import run_isolated
from powerclip.model import model_geometry
from powerclip.train import TrainConfig, from_dict, load_config, parse_override, plot_metrics, read_metrics, to_dict, train

# %%
#| hide
import tempfile
from fastcore.test import test_eq, test_fail

# %% [markdown]
# # The demo and the comparison: every method on the world
#
# > Tiny models trained with the same data, steps and seed (CLIP, PowerCLIP with random boxes or the world's gold object masks, and every baseline), compared on held-out hard negatives, retrieval and grounding, over several seeds, with each method's time per step and memory relative to CLIP.

# %% [markdown]
# `python -m powerclip.demo` trains, one after the other on the `demo` preset (the `powerclip-demo` model,
# 64-pixel scenes of the built-in world):
#
# | run | method | region masks (`method_cfg.masks`) |
# |---|---|---|
# | CLIP | `clip` | (none) |
# | PowerCLIP-R | `powerclip` | 10 random boxes per image (the paper's PowerCLIP-R) |
# | PowerCLIP-gold | `powerclip` | the world's object masks (what a perfect segmenter, e.g. SAM, would give) |
#
# Everything else is equal: the images and captions of every batch (a pure function of the run seed, epoch and
# step), the initial weights, the optimiser and the number of steps. A seed of the comparison is the run seed, from
# which every random stream of a run derives (`23_data`). Each run is an ordinary `powerclip.train` run in its own
# folder, so rerunning the demo resumes unfinished runs and reuses the evaluation of finished ones. The evaluation
# package scores every model, and the untrained initial model as the chance line, on the same held-out test scenes
# (`write_world_benchmark` of `61_eval_data`): `evaluate_world` (`64_eval_tasks`) gives the hard-negative accuracy per
# kind and retrieval R@1/R@5 in percent, with a tie counting against the correct candidate, for every scorer the run's
# method offers; the table shows the first (the method's own: FILIP's late interaction, the global cosine for the
# others), the JSON files hold the others too (`global:hn_mean`, ...). Models load through the one loader
# (`load_model`: the run folder's `model.pt` and `config.yaml`).
#
# `python -m powerclip.demo --runs all --seeds 0 1 2` is the comparison of every method (the baselines of
# `41`-`46` next to PowerCLIP) at the same budget, repeated over seeds: one table of means and spreads, plus each
# method's time per step and peak memory relative to CLIP, the ratio taken within each seed. Each run trains in a
# fresh process, so its peak memory is its own (CUDA peak allocated on a GPU; on a CPU the growth of the
# process's resident set during training, a coarser number). Times are those of the training runs themselves:
# a run reused from an earlier invocation keeps the times of that invocation, so compare times only from runs
# made on an equally loaded machine; `benchmarks/train_step_ratio.py` measures them in alternating fresh
# processes, the cleaner number.

# %%
#| export
# run name -> (method, overrides of the run). Every run sees the same images and captions; only PowerCLIP asks for
# region masks (its method_cfg says how many and from where), PowerCLIP and C2LIP for parse trees.
RUNS = {"CLIP": ("clip", {}),
        "FLIP": ("flip", {}),
        "CLIP-PGS": ("clip-pgs", {}),
        "C2LIP": ("c2lip", {}),                                  # SigLIP base loss, as the paper
        "C2LIP-CLIP": ("c2lip", {"method_cfg.base": "clip"}),    # CLIP base loss, like the other methods
        "SmartCLIP": ("smartclip", {}),
        "FILIP": ("filip", {}),
        "SPARC": ("sparc", {}),
        "PowerCLIP-R": ("powerclip", {"method_cfg.masks": "random"}),
        "PowerCLIP-gold": ("powerclip", {"method_cfg.masks": "gold"})}
DEMO_RUNS = ("CLIP", "PowerCLIP-R", "PowerCLIP-gold")  # `make demo`: CLIP against PowerCLIP


def run_configs(out_dir, seed: int = 0, steps: int | None = None, overrides: dict | None = None, preset: str = "demo",
                runs=DEMO_RUNS):
    "[(name, TrainConfig)] of the runs: the same preset, seed, steps and overrides, each in its own folder."
    unknown = [r for r in runs if r not in RUNS]
    if unknown: raise KeyError(f"unknown run(s) {unknown}; known: {list(RUNS)}")
    out = []
    for name in runs:
        method, extra = RUNS[name]
        ov = {**(overrides or {}), **extra, "seed": seed, "out_dir": str(Path(out_dir) / name)}
        if steps is not None: ov["max_steps"] = steps
        out.append((name, load_config(preset, ov, method)))
    return out


def _untrained(cfg):
    "The run's model before training: random init from the run's init stream (scored the global way)."
    return load_model(cfg.model.name, None, seed=derive_seed(cfg.seed, "init"), model_kwargs=cfg.model.kwargs)


def _world_eval(lm, test_root) -> dict:
    "The eval package's world numbers (%) of a loaded model, for every scorer its method offers."
    return evaluate_world(Evaluator.of(lm, progress=False, batch_size=128), test_root)


def _train_from_dict(cfg_dict: dict) -> dict:
    return train(from_dict(TrainConfig, cfg_dict))


def train_isolated(cfg: TrainConfig) -> dict:
    "`train(cfg)` in a fresh spawned process (its peak memory is its own); returns the trainer's summary."
    res = run_isolated(_train_from_dict, to_dict(cfg))
    if not res.pop("ok"): raise RuntimeError(f"run {cfg.out_dir} failed: {res['error']}; rerun to resume it")
    return res


def step_seconds(rows: list[dict], batch_size: int) -> float:
    "Median seconds per step over the logged rows, leaving out the first (start-up and warm-up); `batch_size`: global."
    s = [batch_size / r["img_per_s"] for r in rows[1:] if r.get("img_per_s")]
    return statistics.median(s) if s else float("nan")


def _grounding(lm, cfg, n_scenes: int) -> dict:
    """Pointing game, pointing at any object, pointing with the map's minimum and mean IoU (%) of the run's text-to-patch
    heatmaps against the world's object masks (`67_heatmaps`)."""
    from powerclip.heatmaps import grounding_table
    rows, _ = grounding_table({"run": lm}, n_scenes=n_scenes, cfg=_held_out_world(cfg), baselines=False)
    return {k: rows[0][k] for k in GROUNDING_KEYS}


def _held_out_world(cfg: TrainConfig):
    "The world of the held-out scenes at the run's model geometry: a fixed benchmark, not derived from the run seed."
    return world_config(cfg.data, model_geometry(cfg.model.name, cfg.model.kwargs))


def run_demo(out_dir="runs/demo", seed: int = 0, steps: int | None = None, eval_images: int = 300,
             overrides: dict | None = None, preset: str = "demo", runs=DEMO_RUNS, grounding_scenes: int = 0,
             isolate: bool = True, test_dir=None) -> dict:
    """Train the runs (each in a fresh process when `isolate`), evaluate them and the untrained model on held-out
    world scenes (written once to `test_dir`, default `out_dir/world_test`; and grounding on `grounding_scenes`
    scenes); write the table and plots. A finished run is not
    trained again, and its evaluation (`eval.json` beside its weights) is reused while the weights are unchanged."""
    out = Path(out_dir); out.mkdir(parents=True, exist_ok=True)
    cfgs = run_configs(out, seed, steps, overrides, preset, runs)
    test_root = Path(test_dir or out / "world_test")
    write_world_benchmark(test_root, eval_images, _held_out_world(cfgs[0][1]), split="test", extras=False)
    results, curves = {}, {}
    results["untrained"] = dict(steps=0, train_s=0.0, **_world_eval(_untrained(cfgs[0][1]), test_root))
    # eval 2: the eval package (percent, ties count against, every scorer); an eval.json of another kind is redone
    eval_key = dict(eval_images=eval_images, grounding_scenes=grounding_scenes, eval=2)
    for name, cfg in cfgs:
        run_dir = Path(cfg.out_dir)
        cached, weights = run_dir / "eval.json", run_dir / "model.pt"
        # eval.json: what training measured (kept while model.pt is the file it describes) and the evaluation
        prev = json.loads(cached.read_text()) if cached.is_file() else {}
        trained = prev.get("train") if weights.is_file() and prev.get("weights_mtime") == weights.stat().st_mtime \
            and prev.get("train", {}).get("steps") == cfg.max_steps else None
        curves[name] = read_metrics(run_dir / "metrics.csv") if trained else []
        if trained and prev.get("eval_key") == eval_key:
            results[name] = {**trained, **prev["eval"]}
            print(f"== {name}: reused {cached}", file=sys.stderr, flush=True)
            continue
        if trained is None:
            print(f"== {name}: {cfg.method} {cfg.method_cfg or ''}, {cfg.max_steps} steps, seed {cfg.seed}", file=sys.stderr, flush=True)
            s = train_isolated(cfg) if isolate else train(cfg)
            rows = curves[name] = read_metrics(run_dir / "metrics.csv")
            trained = dict(method=cfg.method, steps=s["steps"], train_s=rows[-1]["time"] if rows else float("nan"),
                           s_per_step=step_seconds(rows, cfg.data.batch_size * s["world_size"]),
                           # a process's peak RSS only grows: in-process runs after the first have no peak of their own
                           peak_mib=s["peak_mib"] if isolate else float("nan"),
                           final_clip_loss=rows[-1].get("clip", float("nan")) if rows else float("nan"))
        lm = load_model(checkpoint=weights)                 # the run's config.yaml beside it names model and method
        res = _world_eval(lm, test_root)
        if grounding_scenes: res.update(_grounding(lm, cfg, grounding_scenes))
        results[name] = {**trained, **res}
        cached.write_text(json.dumps(dict(weights_mtime=weights.stat().st_mtime, train=trained, eval_key=eval_key, eval=res), indent=1))
    table = run_table(results)
    (out / "results.json").write_text(json.dumps(dict(seed=seed, steps=cfgs[0][1].max_steps, eval_images=eval_images,
                                                      results=results), indent=1))
    (out / "results.md").write_text(table + "\n")
    plot_metrics(curves, out / "loss_curves.png", title="training loss (same data, steps, seed)")
    plot_results(results, out / "comparison.png")
    print(table)
    return results


# %% [markdown]
# ## The table and the plots

# %%
#| export
GROUNDING_KEYS = ("pointing", "pointing_any_object", "pointing_inverted", "mean_iou")  # from `_grounding`, if asked


def _columns(results: dict[str, dict]) -> list[tuple[str, str, str]]:
    "(key, header, format) of the columns the results have: steps, time, HN kinds, HN mean, R@1/5, grounding."
    first = next(iter(results.values()))
    kinds = [k for k in first if k.startswith("hn_") and k != "hn_mean" and not k.endswith("_sd")]
    have = {k for r in results.values() for k in r}
    cols = [("steps", "steps", "{:.0f}"), ("train_s", "train s", "{:.0f}")]
    cols += [("s_per_step", "s/step", "{:.3f}")] if "s_per_step" in have else []
    cols += [(k, k[3:], "{:.1f}") for k in kinds] + [("hn_mean", "HN mean", "{:.1f}")]
    cols += [(k, k.replace("_", " "), "{:.1f}") for k in ("i2t_R@1", "i2t_R@5", "t2i_R@1", "t2i_R@5")]
    heads = dict(pointing="point", pointing_any_object="on object", pointing_inverted="inv. point", mean_iou="IoU")
    cols += [(k, heads[k], "{:.1f}") for k in GROUNDING_KEYS if k in have]
    return cols


def _cell(v, fmt: str, k: str, spread=None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)): return "-"
    return fmt.format(v) + ("" if spread is None or math.isnan(spread) else " ± " + fmt.format(spread))


def _label(name: str, r: dict) -> str:
    "A run's row label, with its headline scorer when that is not the global cosine: 'FILIP [late]'."
    return name if r.get("scorer", "global") == "global" else f"{name} [{r['scorer']}]"


def run_table(results: dict[str, dict]) -> str:
    "Markdown table of the runs: hard-negative accuracy per kind (%), their mean, retrieval R@1/R@5 both ways (%), grounding (%)."
    cols = _columns(results)
    lines = ["| model | " + " | ".join(c[1] for c in cols) + " |", "|---|" + "---:|" * len(cols)]
    for name, r in results.items():
        lines.append(f"| {_label(name, r)} | " + " | ".join(_cell(r.get(k, float("nan")), fmt, k) for k, _, fmt in cols) + " |")
    return "\n".join(lines)


def summarize_seeds(per_seed: dict[int, dict[str, dict]], base: str = "CLIP") -> dict[str, dict]:
    """Mean and sample standard deviation over seeds of every number of every run, plus each run's time per step
    and peak memory relative to `base` (the ratio taken within each seed's invocation, then averaged)."""
    names = list(dict.fromkeys(n for res in per_seed.values() for n in res))
    out = {}
    for n in names:
        rows = [res[n] for res in per_seed.values() if n in res]
        keys = [k for k in rows[0] if isinstance(rows[0][k], (int, float)) and not isinstance(rows[0][k], bool)]
        agg = dict(seeds=len(rows))
        if isinstance(rows[0].get("scorer"), str): agg["scorer"] = rows[0]["scorer"]   # the headline scorer (the same every seed)
        for k in keys:
            v = [float(r[k]) for r in rows if k in r]
            agg[k] = float(np.mean(v)); agg[k + "_sd"] = float(np.std(v, ddof=1)) if len(v) > 1 else float("nan")
        for k, rk in (("s_per_step", "time_ratio"), ("peak_mib", "mem_ratio")):
            v = [res[n][k] / res[base][k] for res in per_seed.values()
                 if n in res and base in res and k in res[n] and res[base].get(k)]
            if v: agg[rk], agg[rk + "_sd"] = float(np.mean(v)), float(np.std(v, ddof=1)) if len(v) > 1 else float("nan")
        out[n] = agg
    return out


def summary_table(summary: dict[str, dict], base: str = "CLIP") -> str:
    "Markdown: mean ± sd over seeds of each column of `run_table`, then time and memory relative to `base`."
    cols = [c for c in _columns(summary) if c[0] not in ("train_s",)]
    head = ["model", "seeds"] + [c[1] for c in cols] + [f"time / {base}", f"memory / {base}"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for name, r in summary.items():
        cells = [str(r["seeds"])] + [_cell(r.get(k, float("nan")), fmt, k, r.get(k + "_sd")) for k, _, fmt in cols]
        ratios = [_cell(r.get(rk, float("nan")), "{:.2f}", rk, r.get(rk + "_sd")) for rk in ("time_ratio", "mem_ratio")]
        cells += [c if c == "-" else c + "x" for c in ratios]  # no 'x' after a missing ratio
        lines.append(f"| {_label(name, r)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_results(results: dict[str, dict], path=None):
    "Grouped bars: accuracy per hard-negative kind and R@1 / R@5, one bar per model."
    from matplotlib.figure import Figure
    keys = [k for k in next(iter(results.values())) if k.startswith("hn_")] + ["i2t_R@1", "i2t_R@5", "t2i_R@1", "t2i_R@5"]
    fig = Figure(figsize=(1.0 * len(keys) + 2, 3.2))
    ax = fig.subplots()
    w = 0.8 / len(results)
    for i, (name, r) in enumerate(results.items()):
        ax.bar(np.arange(len(keys)) + i * w, [r.get(k, float("nan")) for k in keys], w, label=_label(name, r))
    ax.axhline(50, color="grey", lw=0.6, ls="--")
    ax.set_xticks(np.arange(len(keys)) + 0.4 - w / 2, [k.replace("hn_", "") for k in keys], rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("%"); ax.legend(fontsize=7); fig.tight_layout()
    if path is not None: fig.savefig(path, dpi=110)
    return fig


# %% [markdown]
# ## Command line

# %%
#| export
def compare(out_dir="runs/compare", seeds=(0, 1, 2), runs=tuple(RUNS), steps: int | None = None,
            eval_images: int = 300, grounding_scenes: int = 200, overrides: dict | None = None, preset: str = "demo",
            isolate: bool = True) -> dict:
    "`run_demo` for each seed (in `out_dir/seed{S}`), then the mean ± sd table over seeds (`summary.md`, `summary.json`)."
    out = Path(out_dir); out.mkdir(parents=True, exist_ok=True)
    per_seed = {s: run_demo(out / f"seed{s}", s, steps, eval_images, overrides, preset, runs, grounding_scenes, isolate,
                            test_dir=out / "world_test")  # the same held-out scenes for every seed
                for s in seeds}
    summary = summarize_seeds(per_seed)
    table = summary_table(summary)
    meta = dict(seeds=list(seeds), runs=list(runs), steps=steps, eval_images=eval_images, grounding_scenes=grounding_scenes,
                preset=preset, overrides=overrides or {}, torch=torch.__version__,
                device="cuda" if torch.cuda.is_available() else "cpu", cores=__import__("os").cpu_count())
    (out / "summary.json").write_text(json.dumps(dict(meta=meta, summary=summary, per_seed=per_seed), indent=1))
    (out / "summary.md").write_text(f"{len(seeds)} seeds {list(seeds)}, {steps or 'preset'} steps each, preset {preset}; "
                                    f"mean ± sd over seeds (%)\n\n{table}\n")
    print(table)
    return summary


def demo_main(argv: list[str] | None = None) -> dict:
    "`python -m powerclip.demo [--runs NAME ...|all] [--seeds S ...] [--steps N] [--eval-images N] [key=value ...]`"
    ap = argparse.ArgumentParser(prog="python -m powerclip.demo", description=__doc__ or "CLIP vs PowerCLIP on the built-in world")
    ap.add_argument("--out", default=None, help="folder of the runs, the test scenes, the tables and plots "
                                                "(default runs/demo, or runs/compare with several seeds or --runs all)")
    ap.add_argument("--runs", nargs="+", default=list(DEMO_RUNS), help=f"runs to train, or 'all': {', '.join(RUNS)}")
    ap.add_argument("--seeds", "--seed", nargs="+", type=int, default=[0], help="one or more seeds")
    ap.add_argument("--steps", type=int, default=None, help="training steps per model (default: the preset's max_steps)")
    ap.add_argument("--eval-images", type=int, default=300, help="held-out test scenes")
    ap.add_argument("--grounding", type=int, default=None, help="scenes for the grounding score (default: 0 for the "
                                                               "demo, 200 for a comparison; 0 = none)")
    ap.add_argument("--preset", default="demo")
    ap.add_argument("--in-process", action="store_true", help="train in this process (no per-run peak memory)")
    ap.add_argument("overrides", nargs="*", help="key=value for all runs, e.g. data.batch_size=32 optim.lr=2e-3")
    a = ap.parse_intermixed_args(argv)  # options and key=value pairs in any order
    runs = tuple(RUNS) if a.runs == ["all"] else tuple(a.runs)
    many = len(a.seeds) > 1 or a.runs == ["all"]
    out = a.out or ("runs/compare" if many else "runs/demo")
    ground = a.grounding if a.grounding is not None else (200 if many else 0)
    ov = dict(map(parse_override, a.overrides))
    t0 = time.time()
    if many: res = compare(out, a.seeds, runs, a.steps, a.eval_images, ground, ov, a.preset, not a.in_process)
    else: res = run_demo(out, a.seeds[0], a.steps, a.eval_images, ov, a.preset, runs, ground, not a.in_process)
    print(f"demo: {time.time() - t0:.0f} s in all; results in {out}/{'summary' if many else 'results'}.md, plots in "
          f"{out}/{'seed*/' if many else ''}*.png", file=sys.stderr)
    return res


# a notebook kernel also runs as __main__, but has no __file__: only `python -m powerclip.demo` runs here
if __name__ == "__main__" and "__file__" in globals(): demo_main()

# %% [markdown]
# ## A miniature run
#
# The whole pipeline with the micro model for a few steps (a check that it runs end to end, not a result):

# %%
with tempfile.TemporaryDirectory() as d:
    _res = demo_main(["--out", d, "--preset", "smoke", "--steps", "4", "--eval-images", "24", "--in-process"])
    assert (Path(d) / "results.md").is_file() and (Path(d) / "comparison.png").is_file()
    _again = run_demo(d, 0, 4, 24, preset="smoke", isolate=False)  # finished runs: evaluations reused, not retrained
    _ground = run_demo(d, 0, 4, 24, preset="smoke", isolate=False, runs=("CLIP",), grounding_scenes=4)  # evaluated again only
test_eq(list(_res), ["untrained", "CLIP", "PowerCLIP-R", "PowerCLIP-gold"])
assert all(r["steps"] == 4 for k, r in _res.items() if k != "untrained")
assert json.dumps(_again, sort_keys=True) == json.dumps(_res, sort_keys=True)
assert json.dumps(_ground["CLIP"]["peak_mib"]) == json.dumps(_res["CLIP"]["peak_mib"]) and 0 <= _ground["CLIP"]["pointing"] <= 100
assert all(0 <= r["hn_mean"] <= 100 and r["scorer"] == "global" for r in _res.values())   # percent; CLIP and PowerCLIP score globally

# %% [markdown]
# The summary over seeds, on hand-made results: means, sample standard deviations, and ratios to CLIP taken
# within each seed.

# %%
_ps = {0: {"CLIP": dict(hn_mean=60.0, s_per_step=1.0, peak_mib=100.0), "X": dict(hn_mean=70.0, s_per_step=2.0, peak_mib=150.0, scorer="late")},
       1: {"CLIP": dict(hn_mean=80.0, s_per_step=2.0, peak_mib=100.0), "X": dict(hn_mean=90.0, s_per_step=3.0, peak_mib=150.0, scorer="late")}}
_sm = summarize_seeds(_ps)
assert abs(_sm["X"]["hn_mean"] - 80.0) < 1e-12 and abs(_sm["X"]["hn_mean_sd"] - 10 * 2 ** 0.5) < 1e-12
assert abs(_sm["X"]["time_ratio"] - 1.75) < 1e-12 and abs(_sm["X"]["mem_ratio"] - 1.5) < 1e-12
print(summary_table(_sm))
_x_row = next(l for l in summary_table(_sm).splitlines() if l.startswith("| X [late] | 2 |"))   # the headline scorer in the label
assert "| 80.0 ± 14.1 |" in _x_row
test_fail(lambda: run_configs("/tmp/x", runs=("CLIP", "NoSuch")), contains="unknown run")
