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

import argparse, json, math, sys, time
from pathlib import Path

import numpy as np
import torch

from powerclip.data import world_config
from powerclip.train import load_checkpoint, load_config, parse_override, plot_metrics, read_metrics, train
from powerclip.world_eval import evaluate_world, world_test_set

# %%
#| hide
import tempfile
from fastcore.test import test_eq

# %% [markdown]
# # The demo: CLIP vs PowerCLIP on the world
#
# > Three tiny models trained with the same data, steps and seed (CLIP, PowerCLIP with random boxes, PowerCLIP with the world's gold object masks), then compared on held-out hard negatives and retrieval.

# %% [markdown]
# `python -m powerclip.demo` trains, one after the other on the `demo` preset (the `powerclip-tiny` model,
# 64-pixel scenes of the built-in world):
#
# | run | method | region masks |
# |---|---|---|
# | CLIP | `clip` | (none) |
# | PowerCLIP-R | `powerclip` | 10 random boxes per image (the paper's PowerCLIP-R) |
# | PowerCLIP-gold | `powerclip` | the world's object masks (what a perfect segmenter, e.g. SAM, would give) |
#
# Everything else is equal: the batches (a pure function of the seed, epoch and step), the initial weights,
# the optimiser and the number of steps. Each run is an ordinary `powerclip.train` run in its own folder, so
# rerunning the demo resumes unfinished runs and only re-evaluates finished ones. The evaluation
# (`52_world_eval`) scores every model, and the untrained initial model as the chance line, on the same
# held-out test scenes.

# %%
#| export
RUNS = (("CLIP", "clip", {}),
        ("PowerCLIP-R", "powerclip", {"data.masks": "random"}),
        ("PowerCLIP-gold", "powerclip", {"data.masks": "gold"}))


def run_configs(out_dir, seed: int = 0, steps: int | None = None, overrides: dict | None = None, preset: str = "demo"):
    "[(name, TrainConfig)] of the three runs: the same preset, seed, steps and overrides, each in its own folder."
    out = []
    for name, method, extra in RUNS:
        ov = {**(overrides or {}), **extra, "seed": seed, "out_dir": str(Path(out_dir) / name)}
        if steps is not None: ov["max_steps"] = steps
        out.append((name, load_config(preset, ov, method)))
    return out


def _load_trained(cfg, path=None):
    from powerclip.model import create_model
    torch.manual_seed(cfg.seed)
    model = create_model(cfg.model.name, **cfg.model.kwargs)[0]
    if path is not None: model.load_state_dict(load_checkpoint(path)["model"])
    return model.eval()


def run_demo(out_dir="runs/demo", seed: int = 0, steps: int | None = None, eval_images: int = 300,
             overrides: dict | None = None, preset: str = "demo") -> dict:
    "Train the three runs, evaluate them (and the untrained model) on held-out world scenes; write the table and plots."
    out = Path(out_dir); out.mkdir(parents=True, exist_ok=True)
    cfgs = run_configs(out, seed, steps, overrides, preset)
    test_root = world_test_set(out / "world_test", world_config(cfgs[0][1].data), n_images=eval_images, split="test")
    results, curves = {}, {}
    results["untrained"] = dict(steps=0, train_s=0.0, **evaluate_world(_load_trained(cfgs[0][1]), test_root))
    for name, cfg in cfgs:
        print(f"== {name}: {cfg.method}, masks={cfg.data.masks}, {cfg.max_steps} steps, seed {cfg.seed}", file=sys.stderr, flush=True)
        s = train(cfg)
        rows = read_metrics(Path(cfg.out_dir) / "metrics.csv")
        curves[name] = rows
        res = evaluate_world(_load_trained(cfg, s["checkpoint"]), test_root)
        results[name] = dict(steps=s["steps"], train_s=rows[-1]["time"] if rows else float("nan"),
                             final_clip_loss=rows[-1].get("clip", float("nan")) if rows else float("nan"), **res)
    table = results_table(results)
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
def results_table(results: dict[str, dict]) -> str:
    "Markdown table: hard-negative accuracy per kind (%), their mean, retrieval R@1/R@5 both ways (%)."
    kinds = [k for k in next(iter(results.values())) if k.startswith("hn_") and k != "hn_mean"]
    cols = [("steps", "steps", "{:.0f}"), ("train_s", "train s", "{:.0f}")] \
        + [(k, k[3:], "{:.1f}") for k in kinds] + [("hn_mean", "HN mean", "{:.1f}")] \
        + [(k, k.replace("_", " "), "{:.1f}") for k in ("i2t_R@1", "i2t_R@5", "t2i_R@1", "t2i_R@5")]
    pct = lambda k: k.startswith("hn_") or "R@" in k
    lines = ["| model | " + " | ".join(c[1] for c in cols) + " |", "|---|" + "---:|" * len(cols)]
    for name, r in results.items():
        cells = []
        for k, _, fmt in cols:
            v = r.get(k, float("nan"))
            cells.append("-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(100 * v if pct(k) else v))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_results(results: dict[str, dict], path=None):
    "Grouped bars: accuracy per hard-negative kind and R@1 / R@5, one bar per model."
    from matplotlib.figure import Figure
    keys = [k for k in next(iter(results.values())) if k.startswith("hn_")] + ["i2t_R@1", "i2t_R@5", "t2i_R@1", "t2i_R@5"]
    fig = Figure(figsize=(1.0 * len(keys) + 2, 3.2))
    ax = fig.subplots()
    w = 0.8 / len(results)
    for i, (name, r) in enumerate(results.items()):
        ax.bar(np.arange(len(keys)) + i * w, [100 * r.get(k, float("nan")) for k in keys], w, label=name)
    ax.axhline(50, color="grey", lw=0.6, ls="--")
    ax.set_xticks(np.arange(len(keys)) + 0.4 - w / 2, [k.replace("hn_", "") for k in keys], rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("%"); ax.legend(fontsize=7); fig.tight_layout()
    if path is not None: fig.savefig(path, dpi=110)
    return fig


# %% [markdown]
# ## Command line

# %%
#| export
def demo_main(argv: list[str] | None = None) -> dict:
    "`python -m powerclip.demo [--out DIR] [--seed S] [--steps N] [--eval-images N] [key=value ...]`"
    ap = argparse.ArgumentParser(prog="python -m powerclip.demo", description=__doc__ or "CLIP vs PowerCLIP on the built-in world")
    ap.add_argument("--out", default="runs/demo", help="folder of the three runs, the test scenes, the table and plots")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=None, help="training steps per model (default: the preset's max_steps)")
    ap.add_argument("--eval-images", type=int, default=300, help="held-out test scenes")
    ap.add_argument("--preset", default="demo")
    ap.add_argument("overrides", nargs="*", help="key=value for all three runs, e.g. data.batch_size=32 optim.lr=2e-3")
    a = ap.parse_intermixed_args(argv)  # options and key=value pairs in any order
    t0 = time.time()
    res = run_demo(a.out, a.seed, a.steps, a.eval_images, dict(map(parse_override, a.overrides)), a.preset)
    print(f"demo: {time.time() - t0:.0f} s in all; results in {a.out}/results.md, plots in {a.out}/*.png", file=sys.stderr)
    return res


# a notebook kernel also runs as __main__, but has no __file__: only `python -m powerclip.demo` runs here
if __name__ == "__main__" and "__file__" in globals(): demo_main()

# %% [markdown]
# ## A miniature run
#
# The whole pipeline with the micro model for a few steps (a check that it runs end to end, not a result):

# %%
with tempfile.TemporaryDirectory() as d:
    _res = demo_main(["--out", d, "--preset", "smoke", "--steps", "4", "--eval-images", "24"])
    assert (Path(d) / "results.md").is_file() and (Path(d) / "comparison.png").is_file()
test_eq(list(_res), ["untrained", "CLIP", "PowerCLIP-R", "PowerCLIP-gold"])
assert all(r["steps"] == 4 for k, r in _res.items() if k != "untrained")
