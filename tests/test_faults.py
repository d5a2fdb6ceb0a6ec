"""A run survives a real machine's faults, and nothing finished is replaced (issue 47).

1. A damaged `metrics.csv` (a power cut's NUL tail, a row cut short) is repaired on resume: the rows up to the
   checkpoint's step are kept, the file as it was is set aside as `metrics.csv.damaged-<time>`, training goes on;
   the readers (`read_metrics`, `compare`'s `train.json`, `eval.json`) warn in one line and skip what is damaged.
2. A full disk or a file-size limit at a checkpoint write is one line and exit status 3, the temporary file removed
   and the earlier `last.pt` still loadable; under DDP both processes exit 3 together.
3. One trainer per run folder: a second trainer into a running run's folder is refused (exit 2, naming the holder's
   pid and host) while the first goes on; a lock left by a `kill -9` never blocks the resume.
0. Nothing finished is replaced: a finished run whose `checkpoints/` was deleted is refused under `resume=auto`; a NaN
   `last.pt` beside a finite `prev.pt` leaves `prev.pt` finite.
"""
import os, subprocess, sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ["--preset", "smoke", "tensorboard=false", "progress=false", "data.workers=0", "optim.warmup_steps=1"]


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "POWERCLIP_DEBUG": ""}


def _cmd(out_dir, *extra):
    return [sys.executable, "-m", "powerclip.train", *SMOKE, f"out_dir={out_dir}", *extra]


def _run(out_dir, *extra, preexec=None, timeout=300):
    return subprocess.run(_cmd(out_dir, *extra), cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=timeout, preexec_fn=preexec)


def _said(r) -> list[str]:
    "stderr lines that are not the trainer's log"
    return [line for line in r.stderr.splitlines() if line.strip() and not line.startswith("[powerclip.train]")]


def _one_line(r, status, *words):
    lines = _said(r)
    assert r.returncode == status, (r.returncode, r.stderr[-3000:])
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    "A smoke run of 4 steps stopped at step 2 (its checkpoint there), copied by each test that damages it."
    d = tmp_path_factory.mktemp("stopped") / "run"
    r = _run(d, "max_steps=4", "stop_at=2")
    assert r.returncode == 0, r.stderr[-3000:]
    return d


def _copy(src, dst):
    import shutil
    shutil.copytree(src, dst)
    return dst


# ------------------------------------------------------------------------------------------- 1. a damaged log
@pytest.mark.parametrize("damage", ["nul", "cut"])
def test_a_damaged_metrics_csv_is_repaired_on_resume(tmp_path, stopped, damage):
    from powerclip.trainlog import read_metrics
    run = _copy(stopped, tmp_path / "run")
    m = run / "metrics.csv"
    text = m.read_bytes()
    if damage == "nul":       # a hard reset: the file's last blocks are zeros
        damaged = text + b"\x00" * 700
    else:                     # the last row cut short, and a cell no number
        damaged = text + b"3,0,0.001,1e-"
    m.write_bytes(damaged)
    r = _run(run, "max_steps=4")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "metrics.csv" in r.stderr and "kept 2 row(s)" in r.stderr, r.stderr[-2000:]
    aside = list(run.glob("metrics.csv.damaged-*"))
    assert len(aside) == 1 and aside[0].read_bytes() == damaged            # the file as it was, kept
    assert [row["step"] for row in read_metrics(m)] == [1, 2, 3, 4]


def test_readers_skip_damaged_rows_with_one_warning(tmp_path, capsys):
    from powerclip.trainlog import read_metrics
    m = tmp_path / "metrics.csv"
    m.write_bytes(b"step,loss,lr\n1,2.0,0.1\n2,1.5,0.1\n3,1e-\n" + b"\x00" * 50)
    rows = read_metrics(m)
    assert rows == [dict(step=1, loss=2.0, lr=0.1), dict(step=2, loss=1.5, lr=0.1)]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "metrics.csv" in err[0] and "2 damaged row(s) skipped" in err[0], err


def test_a_damaged_train_json_is_retrained_not_a_traceback(tmp_path, capsys):
    from powerclip.trainlog import read_record
    f = tmp_path / "train.json"
    f.write_bytes(b'{"steps": 3, "train_s"' + b"\x00" * 20)
    assert read_record(f) is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.json" in err[0] and "cannot be read" in err[0], err
    f.write_text('{"steps": 3}')
    assert read_record(f) == {"steps": 3}
