"""The comparison runner (`powerclip.compare`) end to end on the smoke preset, each run in this process (a spawned
child per run, `isolate=True`, is the path of tests/test_reproduce.py's run and test_interrupt's runner): fine-tune
chaining (a fine-tune starts from its base's snapshot and reads the batches its base reads next), a killed run that
resumes, finished runs and evaluations reused, the paired statistics from the per-seed and per-scene numbers, and the
command line's one-line errors."""
import dataclasses
import json, os
import subprocess
import sys

import numpy as np
import pytest
import torch

from powerclip.compare import RUNS, RunSpec, compare, make_plan
from powerclip.stats import bootstrap_paired, paired_difference
from powerclip.train import read_metrics, train

STEPS, SEEDS = 10, [0, 1]
KW = dict(preset="smoke", eval_images=20, grounding_scenes=3, curve_points=(0.5, 1.0), log=lambda m: None,
          isolate=False)
# CLIP-ft0: CLIP fine-tuned from CLIP's snapshot at learning rate 0, so its weights stay the snapshot's
ROWS = {"CLIP": RUNS["CLIP"], "CLIP-ft0": RunSpec("clip", {"optim.lr": 0.0}, base="CLIP", warmup_share=0.5)}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("cmp")
    plan = make_plan(ROWS, SEEDS, STEPS, out, **KW)
    # a run killed after 4 of its 10 steps: its checkpoint is there, its train.json is not
    killed = plan.job("CLIP", 1).cfg
    train(dataclasses.replace(killed, stop_at=4))
    assert ((out / "seed1" / "CLIP" / "checkpoints" / "last.pt").is_file()
            and not (out / "seed1" / "CLIP" / "train.json").exists())
    cmp = compare(ROWS, SEEDS, STEPS, out, **KW)
    return out, plan, cmp


def test_finetune_chaining(run):
    out, plan, cmp = run
    F = plan.finetune
    assert (plan.steps, F) == (10, 2)
    for s in SEEDS:
        cfg = plan.job("CLIP-ft0", s).cfg
        snap = out / f"seed{s}" / "CLIP" / "snapshots" / f"step{STEPS - F}"
        assert cfg.model.pretrained == str(snap / "model.pt") and cfg.start_batch == STEPS - F and cfg.max_steps == F
        # lr 0: the fine-tune's weights are the snapshot's, and its first batch is the one CLIP reads at step T - F + 1
        ft = torch.load(out / f"seed{s}" / "CLIP-ft0" / "model.pt")
        assert all(torch.equal(v, ft[k]) for k, v in torch.load(snap / "model.pt").items())
        first = read_metrics(out / f"seed{s}" / "CLIP-ft0" / "metrics.csv")[0]["loss"]
        base = read_metrics(out / f"seed{s}" / "CLIP" / "metrics.csv")[STEPS - F]["loss"]
        assert first == pytest.approx(base, abs=1e-6)
        r = cmp.per_seed[s]["CLIP-ft0"]
        assert r["regime"] == f"fine-tune {F} from CLIP@{STEPS - F}" and r["train_s_total"] > r["train_s"] > 0
    assert [p["step"] for p in cmp.curves["CLIP-ft0"]] == [8, 9, 10]
    assert cmp.curves["CLIP-ft0"][0] == cmp.curves["CLIP"][1]              # the fine-tune's curve starts at CLIP@8


def test_killed_run_resumed(run, tmp_path):
    out, plan, _ = run
    cfg = plan.job("CLIP", 1).cfg
    straight = dataclasses.replace(cfg, out_dir=str(tmp_path / "straight"))
    train(straight)
    resumed = read_metrics(out / "seed1" / "CLIP" / "metrics.csv")
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([r["loss"] for r in resumed],
                               [r["loss"] for r in read_metrics(tmp_path / "straight" / "metrics.csv")],
                               rtol=0, atol=1e-6)


def test_reuse(run):
    out, plan, cmp = run
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.suffix in (".json", ".pt")
              and p.name != "summary.json"
              and "world_" not in str(p)}
    again = compare(ROWS, SEEDS, STEPS, out, **KW)
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps          # nothing trained or evaluated again
    assert json.dumps(again.summary, sort_keys=True) == json.dumps(cmp.summary, sort_keys=True)
    # another budget in the same folder is refused before anything trains
    with pytest.raises(ValueError, match="holds a run of another config"):
        make_plan(ROWS, SEEDS, STEPS + 2, out, **KW)
    # the same folder named by a relative path is the same runs (the path is not part of a run's identity)
    rel = os.path.relpath(out)
    assert rel != str(out) and make_plan(ROWS, SEEDS, STEPS, rel, **KW).job("CLIP", SEEDS[0]).cfg.max_steps == STEPS


def test_paired_statistics(run):
    _, _, cmp = run
    for m in ("hn_mean", "i2t_R@1", "t2i_R@1", "pointing"):
        a = {s: cmp.per_seed[s]["CLIP-ft0"][m] for s in SEEDS}
        b = {s: cmp.per_seed[s]["CLIP"][m] for s in SEEDS}
        iv = cmp.stats["CLIP-ft0"][m]["t"]
        assert iv.n == 2 and iv.mean == pytest.approx(paired_difference(a, b).mean) and (iv.lo, iv.hi) == pytest.approx(
            (paired_difference(a, b).lo, paired_difference(a, b).hi), nan_ok=True)
        x = np.array([cmp.per_seed[s]["CLIP-ft0"]["per_scene"][m] for s in SEEDS])
        y = np.array([cmp.per_seed[s]["CLIP"]["per_scene"][m] for s in SEEDS])
        boot = cmp.stats["CLIP-ft0"][m]["boot"]
        assert boot.n == x.shape[1] == (3 if m == "pointing" else 20)
        assert boot.mean == pytest.approx(iv.mean, abs=1e-9)             # the shares' mean is the number
        assert (boot.lo, boot.hi) == pytest.approx((bootstrap_paired(x, y).lo, bootstrap_paired(x, y).hi))
    assert cmp.summary["CLIP"]["hn_mean"] == pytest.approx(np.mean([cmp.per_seed[s]["CLIP"]["hn_mean"] for s in SEEDS]))


# the first through the real command (`python -m powerclip.compare`: its exit status and stderr), the others through
# the same `main` in this process (a new process costs its imports, tens of seconds, and checks nothing more)
@pytest.mark.parametrize("argv, msg, real",
                         [(["--runs", "CLIP", "Nope"], "unknown run(s) ['Nope']", True),
                          (["--seeds", "0", "-1"], "--seeds", False),
                          (["--preset", "smoke", "optim.nope=1"], "unknown key", False)])
def test_cli_errors(argv, msg, real, tmp_path, capsys, monkeypatch):
    argv = ["--out", str(tmp_path / "x"), *argv]
    if real:
        p = subprocess.run([sys.executable, "-m", "powerclip.compare", *argv], capture_output=True, text=True,
                           timeout=600)
        rc, err = p.returncode, p.stderr
    else:
        from powerclip.compare import main
        monkeypatch.delenv("POWERCLIP_DEBUG", raising=False)
        capsys.readouterr()
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
        err = capsys.readouterr().err
    assert rc == 2 and msg in err and err.strip().count("\n") == 0, err
    assert not (tmp_path / "x").exists()                                    # nothing was started
