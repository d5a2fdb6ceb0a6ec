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
#| default_exp trainlog

# %%
#| export
from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import torch

# %%
#| hide
import tempfile
from fastcore.test import test_eq


# %% [markdown]
# # The training log
#
# > metrics.csv (and TensorBoard) written while a run trains, read back as numbers, and plotted.
#
# One row per `log_every` steps, with every loss term the method returned. Rows are kept in memory and the CSV
# is rewritten when a new column appears (a method may add a term later). On resume, rows after the
# checkpoint's step (written by the killed run after its last checkpoint) are dropped, so the file reads as one
# uninterrupted run.
#
# The trainer (`50_train`) logs from the main process only (`enabled`) and plots the run's curves into `loss.png` at
# the end. `read_metrics` reads a `metrics.csv` back as numbers (the tests, the comparison and its report read runs
# this way), and `plot_metrics` draws the curves of one run or of several side by side (the report's
# `loss_curves.png`).

# %%
#| export
class MetricLogger:
    "metrics.csv (+ TensorBoard) in `run_dir`; inactive on processes other than the main one."
    def __init__(self, run_dir, enabled: bool = True, resume_step: int | None = None, tensorboard: bool = True):
        self.path, self.enabled, self.rows, self.tb = Path(run_dir) / "metrics.csv", enabled, [], None
        if not enabled:
            return
        if resume_step is not None and self.path.is_file():
            self.rows = [r for r in read_metrics(self.path) if r["step"] <= resume_step]
        self.cols = list(dict.fromkeys(k for r in self.rows for k in r))
        self._rewrite()
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(str(Path(run_dir) / "tb"),
                                    purge_step=None if resume_step is None else resume_step + 1)

    def _rewrite(self):
        with open(self.path, "w", newline="") as f:
            w = csv.DictWriter(f, self.cols)
            w.writeheader()
            w.writerows(self.rows)

    def log(self, row: dict) -> None:
        if not self.enabled:
            return
        row = {k: (float(v) if isinstance(v, torch.Tensor) else v) for k, v in row.items()}
        self.rows.append(row)
        if any(k not in self.cols for k in row):
            self.cols += [k for k in row if k not in self.cols]
            self._rewrite()
        else:
            with open(self.path, "a", newline="") as f:
                csv.DictWriter(f, self.cols).writerow(row)
        if self.tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k.lstrip("_"), v, row["step"])

    def close(self):
        if self.tb is not None:
            self.tb.close()


def read_metrics(path) -> list[dict]:
    "Rows of a metrics.csv with numbers parsed (empty cells dropped)."
    def num(v):
        try:
            return int(v)
        except ValueError:
            return float(v)
    with open(path, newline="") as f:
        return [{k: num(v) for k, v in r.items() if v not in ("", None)} for r in csv.DictReader(f)]


def plot_metrics(runs: dict[str, list[dict]] | list[dict], path=None, title: str = ""):
    "Loss terms (every key without '_' that is a loss), lr and throughput against step; one line per run."
    from matplotlib.figure import Figure  # no pyplot: works under any backend, never switches the notebook's
    runs = {"": runs} if isinstance(runs, list) else runs
    skip = {"step", "epoch", "lr", "img_per_s", "time", "bad_total", "loss"}
    terms = sorted({k for rows in runs.values() for r in rows for k in r if k not in skip and not k.startswith("_")
                    and not k.startswith(("skipped", "eval/"))})
    panels = ["loss"] + terms + ["lr", "img_per_s"]
    fig = Figure(figsize=(3.2 * len(panels), 2.8))
    axes = fig.subplots(1, len(panels))
    for ax, key in zip(np.atleast_1d(axes), panels):
        for name, rows in runs.items():
            xs = [r["step"] for r in rows if key in r]
            if xs:
                ax.plot(xs, [r[key] for r in rows if key in r], label=name or None, lw=1)
        ax.set_title(key)
        ax.set_xlabel("step")
    if len(runs) > 1:
        np.atleast_1d(axes)[0].legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig


# %%
with tempfile.TemporaryDirectory() as d:
    lg = MetricLogger(d, tensorboard=False)
    lg.log(dict(step=1, loss=2.0, clip=2.0))
    lg.log(dict(step=2, loss=1.5, clip=1.4, powerset=torch.tensor(0.5)))
    test_eq(read_metrics(Path(d) / "metrics.csv")[1], dict(step=2, loss=1.5, clip=1.4, powerset=0.5))
    test_eq(len(MetricLogger(d, resume_step=1, tensorboard=False).rows), 1)  # the row after the checkpoint is dropped
