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

import csv, json, os, sys, time
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
    def __init__(self, run_dir, enabled: bool = True, resume_step: int | None = None, tensorboard: bool = True,
                 warn=None):
        self.path, self.enabled, self.rows, self.tb = Path(run_dir) / "metrics.csv", enabled, [], None
        if not enabled:
            return
        if resume_step is not None and self.path.is_file():
            self.rows = _resumed_rows(self.path, resume_step, warn or _stderr)
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


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _num(v: str):
    try:
        return int(v)
    except ValueError:
        return float(v)


def parse_metrics(path) -> tuple[list[dict], int]:
    """(the rows of a metrics.csv that parse, numbers parsed and empty cells dropped; how many rows do not): a row with
    a NUL byte, fewer or more fields than the header, or a cell that is not a number is damaged."""
    text = Path(path).read_bytes().decode("utf-8", "replace")
    lines = [ln for ln in text.splitlines() if ln.strip()]    # a NUL-only line is damage, not blank
    if not lines:
        return [], 0
    head, rows, bad = next(csv.reader([lines[0]])), [], 0
    for line in lines[1:]:
        try:
            if "\x00" in line or "\x00" in lines[0]:
                raise ValueError("NUL bytes")
            cells = next(csv.reader([line]))
            if len(cells) != len(head):
                raise ValueError("another number of fields than the header")
            rows.append({k: _num(v) for k, v in zip(head, cells) if v != ""})
        except ValueError:
            bad += 1
    return rows, bad


def read_metrics(path, warn=_stderr) -> list[dict]:
    "Rows of a metrics.csv with numbers parsed (empty cells dropped); damaged rows skipped with one warning line."
    rows, bad = parse_metrics(path)
    if bad and warn is not None:
        warn(f"{path}: {bad} damaged row(s) skipped (a cut or NUL-filled line, e.g. after a power cut); "
             f"{len(rows)} read")
    return rows


def _resumed_rows(path: Path, step: int, warn) -> list[dict]:
    "The rows a resume at `step` keeps; a damaged file is set aside (`metrics.csv.damaged-<time>`) and said in a line."
    rows, bad = parse_metrics(path)
    kept = [r for r in rows if r.get("step", step + 1) <= step]
    if bad:
        aside = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
        os.replace(path, aside)
        warn(f"{path}: {bad} damaged row(s) (a cut or NUL-filled line, e.g. after a power cut): kept {len(kept)} "
             f"row(s) up to step {step}, dropped {len(rows) + bad - len(kept)}; the file as it was is kept as "
             f"{aside.name}")
    return kept


def read_record(path, warn=_stderr) -> dict | None:
    "A run's JSON record (`train.json`, `eval.json`), or None with one warning line when it cannot be read (recompute)."
    try:
        d = json.loads(Path(path).read_bytes().decode("utf-8"))
        if not isinstance(d, dict):
            raise ValueError("not a JSON object")
        return d
    except (OSError, ValueError) as e:
        warn(f"{path} cannot be read ({type(e).__name__}: {str(e)[:80]}): computed again")
        return None


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
    # a power cut's NUL tail and a cut row: the rows up to the checkpoint kept, the file as it was set aside
    _m = Path(d) / "metrics.csv"
    _m.write_bytes(b"step,loss\n1,2.0\n2,1.5\n3,1e-" + b"\x00" * 30)
    _said = []
    test_eq(read_metrics(_m, _said.append), [dict(step=1, loss=2.0), dict(step=2, loss=1.5)])
    test_eq(MetricLogger(d, resume_step=1, tensorboard=False, warn=_said.append).rows, [dict(step=1, loss=2.0)])
    assert "kept 1 row(s) up to step 1, dropped 2" in _said[1] and len(list(Path(d).glob("metrics.csv.damaged-*"))) == 1
    test_eq(read_metrics(_m), [dict(step=1, loss=2.0)])
