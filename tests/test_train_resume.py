"""Exact resume, across fresh processes, through the command line.

A run of N steps straight; the same run stopped at N/2 (stop_at) and resumed in a new process; and the same
run killed with SIGKILL at an arbitrary moment after its first checkpoint, then resumed. The per-step losses
of all three agree to 1e-6, and the metrics file of a resumed run reads as one uninterrupted run.
"""
import os, signal, subprocess, sys, time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
N = 16


def _cmd(out_dir, *extra):
    return [sys.executable, "-m", "powerclip.train", "--preset", "smoke", "data.workers=1",
            f"max_steps={N}", "ckpt_every=3", "optim.warmup_steps=3", f"out_dir={out_dir}", *extra]


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def _run(out_dir, *extra):
    r = subprocess.run(_cmd(out_dir, *extra), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _losses(out_dir):
    from powerclip.train import read_metrics
    rows = read_metrics(Path(out_dir) / "metrics.csv")
    return [r["step"] for r in rows], [r["loss"] for r in rows], rows


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    d = tmp_path_factory.mktemp("straight")
    _run(d)
    steps, losses, _ = _losses(d)
    assert steps == list(range(1, N + 1))  # the epoch boundary (64 / 8 = 8 steps) is crossed
    return losses


def test_stop_and_resume_in_new_process(tmp_path, straight):
    _run(tmp_path, f"stop_at={N // 2}")
    assert _losses(tmp_path)[0] == list(range(1, N // 2 + 1))
    r = _run(tmp_path)
    assert f"at step {N // 2}" in r.stderr
    steps, losses, rows = _losses(tmp_path)
    assert steps == list(range(1, N + 1))
    assert max(abs(a - b) for a, b in zip(losses, straight)) < 1e-6
    assert {r["epoch"] for r in rows} == {0, 1}
    assert (tmp_path / "config.yaml").is_file() and (tmp_path / "loss.png").is_file()


def test_kill_9_then_resume(tmp_path, straight):
    ck = tmp_path / "checkpoints" / "last.pt"
    p = subprocess.Popen(_cmd(tmp_path), cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.time()
    while not ck.exists() and p.poll() is None and time.time() - t0 < 240: time.sleep(0.05)
    time.sleep(0.3)  # somewhere after the first checkpoint, possibly in the middle of writing a later one
    p.send_signal(signal.SIGKILL); p.wait()
    assert p.returncode == -signal.SIGKILL, "the run finished before it could be killed: make N larger"
    import torch
    killed_at = torch.load(ck, weights_only=False)["state"]["step"]
    assert 0 < killed_at < N
    r = _run(tmp_path)
    assert f"at step {killed_at}" in r.stderr
    steps, losses, _ = _losses(tmp_path)
    assert steps == list(range(1, N + 1))  # rows logged after the checkpoint by the killed run were dropped
    assert max(abs(a - b) for a, b in zip(losses, straight)) < 1e-6
