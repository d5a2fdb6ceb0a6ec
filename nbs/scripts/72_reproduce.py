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
#| default_exp reproduce

# %%
#| export
from __future__ import annotations

import dataclasses, json, math, shutil, sys, tempfile
from pathlib import Path

import torch

from powerclip.commandline import ArgumentParser, UsageError, check_number, run_main, usage_errors
from powerclip.config import load_config
from powerclip.runrecord import NOT_RECORDED, RECORD, facts, read_record
from powerclip.train import read_metrics, train

# %%
#| hide
import contextlib, io
from fastcore.test import test_eq

# %% [markdown]
# # Remaking a run
#
# > `python -m powerclip.reproduce RUN_DIR`: retrain a recorded run from step 0 and say whether it comes out the same,
# > and if not, where it parts and what changed.

# %% [markdown]
# A committed number is checkable when a reader can remake it. Every run records what made it (`run.json`,
# `49h_runrecord`): the commit, the libraries, the thread count read in the training process, the device. This command
# retrains the run's own config (`config.yaml`) from step 0 into a scratch folder at the recorded thread count, for the
# logged steps up to its first snapshot (all of a run without snapshots; `--steps N` for another length: the schedule
# stays the run's, the rerun stops after N steps), and compares `metrics.csv` column by column, the wall-clock columns
# (`time`, `img_per_s`) aside, and the weights where the rerun ends at a snapshot of the run:
#
# - **bitwise equal through step N** (exit status 0): same code path, same numbers;
# - or **the first step where they part** (exit status 1), the columns that differ there and by how much, and the loss
#   at the last compared step; with, either way, **which recorded facts differ between then and now** (commit, dirty
#   tree and its difference, threads, library versions, device, machine).
#
# `--threads N` reruns at another count, to see what the count alone changes (`50_train`, "Same command, same
# numbers?": a run parts from itself at step 2 at another count). `--eval` also rescores the recorded snapshot on the
# evaluation data its cached evaluation names (`eval.json`, `70_compare`) and compares that with the recorded numbers
# (did the evaluation change?) and with the rerun's snapshot (did training?). A folder without a record (a run from
# before runs recorded what made them) is refused in one line naming what it lacks, as is a fine-tune whose base
# snapshot is gone; a mistake in the arguments is one line and exit status 2.
#
# ```bash
# python -m powerclip.reproduce runs/demo/seed0/CLIP                 # up to its first snapshot, at its thread count
# python -m powerclip.reproduce runs/demo/seed0/CLIP --steps 20 --threads 2   # what another thread count does
# python -m powerclip.reproduce runs/demo/seed0/CLIP --eval          # and the snapshot's evaluation, rescored
# ```

# %%
#| export
WALL_CLOCK = ("time", "img_per_s")     # what a rerun never repeats: seconds and throughput
FACT_WORDS = dict(commit="commit", dirty="dirty tree", diff_sha256="its difference (hash)", threads="threads",
                  device="device", device_name="device name", cpu_capability="CPU vector instructions",
                  world_size="processes", host_sha256="machine (hash)")


@dataclasses.dataclass
class Recorded:
    "A run folder read for a rerun."
    folder: Path
    cfg: object                  # its TrainConfig (config.yaml)
    record: dict                 # run.json
    rows: list                   # metrics.csv

    @property
    def total(self) -> int: return self.cfg.max_steps or max(r["step"] for r in self.rows)


def read_run(folder) -> Recorded:
    "A run folder's config, record and metrics; a `UsageError` in one line naming what it lacks."
    folder = Path(folder)
    if not folder.is_dir():
        raise UsageError(f"RUN_DIR: {folder} is not a folder (give a run's folder: config.yaml, run.json, metrics.csv)")
    missing = [f for f in ("config.yaml", RECORD, "metrics.csv") if not (folder / f).is_file()]
    if missing:
        why = (" (a run from before runs recorded what made them: which code, thread count and libraries is not "
               "known)" if RECORD in missing else "")
        raise UsageError(f"RUN_DIR: {folder} has no {' and no '.join(missing)}{why}: nothing to reproduce")
    record = read_record(folder)
    if record is None or not record["segments"]:
        raise UsageError(f"RUN_DIR: {folder / RECORD} cannot be read as a run's record: nothing to reproduce")
    with usage_errors():
        cfg = load_config(str(folder / "config.yaml"), {})
    pre = cfg.model.pretrained
    if pre and not Path(pre).is_file():
        raise UsageError(f"RUN_DIR: {folder} fine-tunes {pre}, which is missing (its base run's snapshot; run from the "
                         "folder the run was made in, or remake the base run first)")
    rows = read_metrics(folder / "metrics.csv")
    if not rows:
        raise UsageError(f"RUN_DIR: {folder / 'metrics.csv'} holds no row: nothing to compare")
    return Recorded(folder, cfg, record, rows)


def default_steps(run: Recorded) -> int:
    "The logged steps up to the run's first snapshot, or all of a run without one."
    last = max(r["step"] for r in run.rows)
    return min([s for s in run.cfg.snapshot_steps if s <= last] or [last])


def recorded_threads(run: Recorded) -> int | None:
    "The thread count of the segment that trained step 1 (None when not recorded)."
    t = run.record["segments"][0].get("threads")
    return t if isinstance(t, int) else None


# %% [markdown]
# ## Comparing two logs
#
# Two `metrics.csv` are compared step by step over the steps both logged up to N, every column but the wall-clock
# ones: equal means the same float (two NaNs are equal: a skipped step logs NaN both times), a column one of them lacks
# is a difference. The first step with a difference is where the runs part.

# %%
#| export
def _same(a, b) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def compare_rows(then: list[dict], now: list[dict], steps: int) -> dict:
    """{'steps': the steps compared, 'parted': None or {'step', 'columns': {col: (then, now)}}, 'columns': compared,
    'last': (then, now) of the last compared row's loss}: the two logs through `steps`, wall-clock columns aside."""
    a = {r["step"]: r for r in then if r["step"] <= steps}
    b = {r["step"]: r for r in now if r["step"] <= steps}
    both = sorted(set(a) & set(b))
    cols = sorted({k for s in both for r in (a[s], b[s]) for k in r if k not in WALL_CLOCK})
    parted = None
    for s in both:
        diff = {k: (a[s].get(k), b[s].get(k)) for k in cols if not _same(a[s].get(k), b[s].get(k))}
        if diff:
            parted = dict(step=s, columns=diff)
            break
    last = (a[both[-1]].get("loss"), b[both[-1]].get("loss")) if both else (None, None)
    return dict(steps=both, parted=parted, columns=cols, last=last, missing=sorted(set(a) ^ set(b)))


def _num(x) -> str:
    return f"{x:.9g}" if isinstance(x, float) else str(x)


def _by(then, now) -> str:
    "'then -> now (difference d, relative r)' of two numbers."
    if isinstance(then, (int, float)) and isinstance(now, (int, float)):
        d = now - then
        rel = f", relative {abs(d) / abs(then):.1e}" if then else ""
        return f"{_num(then)} then, {_num(now)} now (difference {d:+.3g}{rel})"
    return f"{_num(then)} then, {_num(now)} now"


def fact_differences(then: dict, now: dict) -> list[str]:
    "What differs between two records' facts: 'threads 1 then, 2 now', a library's version, the commit, ..."
    out = []
    for k, word in FACT_WORDS.items():
        a, b = then.get(k, NOT_RECORDED), now.get(k, NOT_RECORDED)
        if a != b and not (k == "diff_sha256" and then.get("dirty") is False and now.get("dirty") is False):
            short = lambda v: v[:12] if isinstance(v, str) and len(v) >= 40 else v
            out.append(f"{word} {short(a)} then, {short(b)} now")
    va, vb = then.get("versions") or {}, now.get("versions") or {}
    if not isinstance(va, dict):
        out.append(f"versions {va} then")
        va = {}
    out += [f"{lib} {va.get(lib, NOT_RECORDED)} then, {vb.get(lib)} now" for lib in vb if va.get(lib) != vb.get(lib)]
    return out


# %%
_then = [dict(step=1, loss=2.0, time=1.0), dict(step=2, loss=1.5, time=2.0), dict(step=3, loss=1.2, time=3.0)]
_now = [dict(step=1, loss=2.0, time=9.0), dict(step=2, loss=1.5000001, time=9.0), dict(step=3, loss=1.3, time=9.0)]
_c = compare_rows(_then, _now, 3)
test_eq((_c["parted"]["step"], list(_c["parted"]["columns"]), _c["columns"]), (2, ["loss"], ["loss", "step"]))
test_eq(compare_rows(_then, _then, 3)["parted"], None)
test_eq(compare_rows(_then, _now, 1)["parted"], None)            # through step 1 they agree
test_eq(fact_differences(dict(threads=1, versions=dict(torch="2.1")), dict(threads=2, versions=dict(torch="2.2"))),
        ["threads 1 then, 2 now", "torch 2.1 then, 2.2 now"])


# %% [markdown]
# ## The rerun
#
# The recorded config, with only what does not change what a run computes changed: its folder (the scratch folder),
# `stop_at=N` (so the learning-rate schedule is the run's whole one), the thread count, no TensorBoard, a progress bar,
# and only the snapshots up to N. It trains in this process.

# %%
#| export
def weights_equal(a, b) -> str:
    "'bitwise equal', or the largest absolute difference of two `model.pt` files."
    sa, sb = (torch.load(p, map_location="cpu", weights_only=True) for p in (a, b))
    if sa.keys() != sb.keys():
        return "not the same tensors"
    worst = max(((sa[k].double() - sb[k].double()).abs().max().item() if sa[k].is_floating_point()
                 else float(not torch.equal(sa[k], sb[k]))) for k in sa)
    return "bitwise equal" if worst == 0 else f"differ (largest difference {worst:.3g})"


def rerun(run: Recorded, steps: int, threads: int | None, scratch: Path) -> dict:
    "Train the recorded config from step 0 for `steps` steps into `scratch` (see above); the trainer's summary."
    cfg = dataclasses.replace(run.cfg, out_dir=str(scratch), stop_at=steps if steps < run.total else None,
                              threads=threads, resume="never", overwrite=False, tensorboard=False, progress=True,
                              snapshot_steps=tuple(s for s in run.cfg.snapshot_steps if s <= steps))
    return train(cfg)


def reproduce(folder, steps: int | None = None, threads: int | None = None, evaluate: bool = False,
              scratch=None, log=print) -> int:
    """Rerun the run in `folder` (see above) and say how it compares; 0 when bitwise equal through the compared steps,
    1 when they part. `scratch`: where the rerun goes (None: a temporary folder, removed after)."""
    run = read_run(folder)
    steps = steps or default_steps(run)
    last = max(r["step"] for r in run.rows)
    if steps > last:
        raise UsageError(f"--steps: {folder} logged up to step {last}, not {steps}")
    threads = threads or recorded_threads(run)
    tmp = scratch is None
    scratch = Path(tempfile.mkdtemp(prefix="powerclip-reproduce-")) / "run" if tmp else Path(scratch)
    said = recorded_threads(run)
    log(f"reproduce: {folder} ({run.cfg.method}, seed {run.cfg.seed}): retraining steps 1-{steps} of {run.total} "
        f"at {threads} thread(s) (recorded: {said if said is not None else NOT_RECORDED}) into {scratch}")
    try:
        rerun(run, steps, threads, scratch)
        res = compare_rows(run.rows, read_metrics(scratch / "metrics.csv"), steps)
        segs = [s for s in run.record["segments"] if s.get("from_step", 0) < steps]   # those that trained 1..N
        diffs = fact_differences(facts(segs), read_record(scratch) or {})
        snap = run.folder / "snapshots" / f"step{steps}" / "model.pt"
        wsaid = (f"; weights at step {steps} {weights_equal(snap, scratch / 'snapshots' / f'step{steps}' / 'model.pt')}"
                 if snap.is_file() and (scratch / "snapshots" / f"step{steps}" / "model.pt").is_file() else "")
        n = len(res["steps"])
        if res["parted"] is None:
            log(f"reproduce: bitwise equal through step {steps} ({n} logged rows, {len(res['columns'])} columns; "
                f"{', '.join(WALL_CLOCK)} aside){wsaid}")
        else:
            p = res["parted"]
            cols = list(p["columns"])
            k = "loss" if "loss" in cols else cols[0]
            also = [c for c in cols if c != k]
            log(f"reproduce: parted at step {p['step']} (first of {n} logged rows through step {steps}): {k} "
                f"{_by(*p['columns'][k])}" + (f"; also {', '.join(also)}" if also else ""))
            if res["steps"][-1] != p["step"] or wsaid:
                log(f"reproduce: at step {res['steps'][-1]} the loss is {_by(*res['last'])}{wsaid}")
        log("reproduce: recorded facts that differ between then and now: " + ("; ".join(diffs) if diffs else "none"))
        if evaluate:
            ok = rescore(run, steps, scratch, log)
            if res["parted"] is None and not ok:
                return 1
        return 0 if res["parted"] is None else 1
    finally:
        if tmp:
            shutil.rmtree(scratch.parent, ignore_errors=True)


# %% [markdown]
# ## Rescoring the recorded snapshot (`--eval`)
#
# A comparison caches each snapshot's evaluation beside its weights (`eval.json`, with the evaluation folder it read:
# `68_eval_world_scores`, `evaluate_folder`). `--eval` copies the recorded snapshot at step N into the scratch folder,
# scores it on that folder again, and compares the numbers with the cached ones (what the evaluation code does now
# against what it did then), then scores the rerun's snapshot and compares it with the recorded one rescored (what
# training does now against then, in evaluation terms).

# %%
#| export
def _numbers(r: dict) -> dict:
    return {k: v for k, v in r.items() if isinstance(v, (int, float)) and not k.endswith("_s")}


def _eval_diff(a: dict, b: dict) -> str:
    a, b = _numbers(a), _numbers(b)
    diff = [k for k in sorted(set(a) | set(b)) if not _same(a.get(k), b.get(k))]
    if not diff:
        return f"equal ({len(a)} numbers)"
    return f"{len(diff)} of {len(set(a) | set(b))} numbers differ: " + "; ".join(
        f"{k} {_by(a.get(k), b.get(k))}" for k in diff[:4]) + (" ..." if len(diff) > 4 else "")


def rescore(run: Recorded, steps: int, scratch: Path, log=print) -> bool:
    "`--eval` (see above): True when both evaluations are the same."
    from powerclip.eval.world_scores import evaluate_folder
    from powerclip.data import world_config
    from powerclip.model import model_geometry
    snap = run.folder / "snapshots" / f"step{steps}" if steps < run.total else run.folder
    cache = snap / "eval.json"
    if not cache.is_file():
        raise UsageError(f"--eval: {snap} has no recorded evaluation (eval.json): nothing to compare a rescoring with")
    c = json.loads(cache.read_text())
    root = Path(c["key"]["root"])
    if not (root / "summary.json").is_file():
        raise UsageError(f"--eval: the recorded evaluation read {root}, which is gone (rerunning the comparison "
                         "writes it)")
    world = world_config(run.cfg.data, model_geometry(run.cfg.model.name, run.cfg.model.kwargs))
    copy = scratch / "recorded_snapshot"
    copy.mkdir(parents=True, exist_ok=True)
    for f in ("model.pt", "method_modules.pt", "config.yaml"):
        if (snap / f).is_file():
            shutil.copy2(snap / f, copy / f)
    g = c["key"].get("grounding", 0)
    log(f"reproduce: rescoring the recorded snapshot {snap} on {root}" + (f" (pointing on {g} scenes)" if g else ""))
    now = evaluate_folder(copy, root, world, g, run.cfg.device or "cpu")
    then = dict(c["results"])
    if (snap / "eval_regions.json").is_file():
        then.update(json.loads((snap / "eval_regions.json").read_text())["results"])
    said = _eval_diff(then, now)
    log(f"reproduce: the recorded snapshot's evaluation, rescored: {said}")
    ok = said.startswith("equal")
    mine = scratch / "snapshots" / f"step{steps}" if steps < run.total else scratch
    if (mine / "model.pt").is_file():
        again = _eval_diff(now, evaluate_folder(mine, root, world, g, run.cfg.device or "cpu"))
        log(f"reproduce: the rerun's snapshot against the recorded one, both scored now: {again}")
        ok = ok and again.startswith("equal")
    return ok


# %% [markdown]
# ## Command line

# %%
#| export
def _parser() -> ArgumentParser:
    ap = ArgumentParser(prog="python -m powerclip.reproduce",
                        description="Retrain a recorded run from step 0 and say whether it comes out the same.")
    ap.add_argument("run_dir", help="a run's folder (config.yaml, run.json, metrics.csv)")
    ap.add_argument("--steps", type=int, default=None, help="steps to retrain and compare (default: the logged steps "
                                                            "up to the first snapshot, or all of a run without one)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads of the rerun (default: the recorded)")
    ap.add_argument("--eval", action="store_true", help="also rescore the recorded snapshot and compare")
    ap.add_argument("--scratch", default=None, help="folder for the rerun, kept (default: a temporary one, removed)")
    ap.add_argument("--debug", action="store_true", help="show the traceback of a usage error")
    return ap


def _main(argv: list[str]) -> int:
    with usage_errors():
        a = _parser().parse_args(argv)
        if a.steps is not None:
            check_number("--steps", a.steps, 1, integer=True)
        if a.threads is not None:
            check_number("--threads", a.threads, 1, integer=True)
    return reproduce(a.run_dir, a.steps, a.threads, a.eval, a.scratch,
                     log=lambda m: print(m, file=sys.stderr if m.startswith("reproduce: retraining") else sys.stdout,
                                         flush=True))


def main(argv: list[str] | None = None) -> int:
    "The command line: 0 bitwise equal, 1 parted, 2 a usage error (one line)."
    return run_main(_main, argv, "python -m powerclip.reproduce")


# a notebook kernel also runs as __main__, but has no __file__: only `python -m powerclip.reproduce` runs here
if __name__ == "__main__" and "__file__" in globals():
    sys.exit(main())

# %% [markdown]
# A `smoke` run (6 steps, a snapshot at 3) remade: bitwise equal up to its snapshot at the recorded count, weights
# included; at another count it parts at step 2; a folder without a record is one line (`tests/test_reproduce.py`
# checks the same through a spawned child whose count is not its parent's).

# %%
from powerclip.runrecord import run_threads
_scratch = tempfile.TemporaryDirectory(prefix="powerclip-nb-")  # holds every scratch folder below; see the last cell
_d = Path(tempfile.mkdtemp(dir=_scratch.name))
with run_threads(1), contextlib.redirect_stderr(io.StringIO()):
    train(load_config("smoke", dict(out_dir=str(_d / "run"), snapshot_steps=[3], tensorboard=False, progress=False,
                                    log_every=1, threads=1), "clip"))
_out = []
with contextlib.redirect_stderr(io.StringIO()):
    test_eq(reproduce(_d / "run", log=_out.append), 0)
print(*_out, sep="\n")
assert "bitwise equal through step 3" in _out[1] and "weights at step 3 bitwise equal" in _out[1], _out
_out = []
with contextlib.redirect_stderr(io.StringIO()):
    test_eq(reproduce(_d / "run", threads=2, log=_out.append), 1)
print(*_out, sep="\n")
assert "parted at step" in _out[1] and "threads 1 then, 2 now" in _out[-1], _out
_err = io.StringIO()
with contextlib.redirect_stderr(_err):
    test_eq(main([str(_d)]), 2)
assert _err.getvalue().count("\n") == 1 and "has no config.yaml and no run.json" in _err.getvalue(), _err.getvalue()

# %% [markdown]
# Every scratch folder made above lives under one temporary folder, removed here, so running the notebook
# leaves nothing behind (a training run's checkpoints take hundreds of MB).

# %%
_scratch.cleanup()
