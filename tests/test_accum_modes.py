"""Gradient accumulation (`accum_steps`) under the trainer's other modes (issue 32).

1. Gradient checkpointing: 4 micro-batches of 16 with checkpointed towers equal one batch of 64 (float64, 1e-10), for
   CLIP, PowerCLIP and A-CLIP (whose heads the loss applies).
2. bf16 autocast: the accumulated step is no farther from the float64 gradient than the full batch's bf16 step
   itself (twice its error, plus 1e-3 for ties of rounding), and finite.
3. Exact resume: a run with `accum_steps=2` stopped half-way and resumed in a new process logs the losses of the same
   run straight (1e-6, as tests/test_train_resume.py), and its straight losses are the plain run's (fp32 rounding).
4. On webdataset shards (tests/test_train_resume.py's, bad samples and a truncated shard included): PowerCLIP with
   `accum_steps=2` stopped twice and resumed is the straight run, every metrics column and every weight bitwise.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_accum import ROWS, _config, _rel_errors, _spec, _steps
import test_train_resume as resume
from test_train_resume import _assert_same_run, _main, _shard_args

shards, one_thread = resume.shards, resume.one_thread   # its fixtures: the shards, one torch thread (autouse)

ROOT = Path(__file__).resolve().parents[1]


def _grads_k(method, precision, ckpt, ks=(1, 4)) -> dict:
    "k -> (loss, every gradient) of one world batch of 64 in k micro-batches (test_accum's `_steps`)."
    from powerclip.data import make_loader
    extra = {"model.grad_checkpointing": ckpt}
    assert _config(method, ROWS, 1, precision, extra).model.grad_checkpointing == ckpt
    return _steps(method, next(iter(make_loader(_spec(ROWS), epoch=0))), ks, precision, extra)


@pytest.mark.parametrize("method", ["clip", "powerclip", "aclip"])
def test_accum_with_grad_checkpointing_is_exact(method):
    res = _grads_k(method, "fp64", True)
    (l1, g1), (l4, g4) = res[1], res[4]
    assert abs(l4 - l1) <= 1e-10 * abs(l1), (l1, l4)
    err = _rel_errors(g1, g4, 1e-12)
    worst = max(err, key=err.get)
    assert err[worst] <= 1e-10, f"{method}: grad of {worst} differs by {err[worst]:.2e} with checkpointing"


@pytest.mark.parametrize("method", ["clip", "powerclip"])
def test_accum_in_bf16_within_its_rounding(method):
    ref = _grads_k(method, "fp64", False, ks=(1,))[1][1]
    res = _grads_k(method, "bf16", False)

    def off(g):   # largest relative error over tensors against float64 (tensors zero up to rounding skipped)
        return max(float((g[n].double() - ref[n]).abs().max()) / float(ref[n].abs().max())
                   for n in ref if float(ref[n].abs().max()) >= 1e-7)
    full, acc = off(res[1][1]), off(res[4][1])
    print(f"{method} bf16: full batch {full:.2e} off float64, 4 micro-batches {acc:.2e}")
    assert all(torch.isfinite(v).all() for v in res[4][1].values())
    assert acc <= 2 * full + 1e-3, (full, acc)
    assert abs(res[4][0] - res[1][0]) <= 2e-2 * abs(res[1][0])


N = 8


def _train(out_dir, *extra):
    cmd = [sys.executable, "-m", "powerclip.train", "--preset", "smoke", "data.workers=0", f"max_steps={N}",
           "ckpt_every=2", "optim.warmup_steps=2", f"out_dir={out_dir}", *extra]
    r = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    from powerclip.train import read_metrics
    return r, [row["loss"] for row in read_metrics(Path(out_dir) / "metrics.csv")]


def test_accum_resume_is_exact(tmp_path):
    _, plain = _train(tmp_path / "plain")
    _, straight = _train(tmp_path / "straight", "accum_steps=2")
    assert len(straight) == N and max(abs(a - b) for a, b in zip(straight, plain)) < 1e-4, (plain, straight)
    _, first = _train(tmp_path / "resumed", "accum_steps=2", f"stop_at={N // 2}")
    assert len(first) == N // 2
    r, resumed = _train(tmp_path / "resumed", "accum_steps=2")
    assert f"at step {N // 2}" in r.stderr
    assert len(resumed) == N and max(abs(a - b) for a, b in zip(resumed, straight)) < 1e-6, (straight, resumed)


def test_accum_on_shards_resumes_exactly(tmp_path, request):
    shards = request.getfixturevalue("shards")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    _main(_shard_args(straight, shards, 0, "accum_steps=2"))
    for stop in (3, 9):                                              # mid-epoch, and in the second epoch
        _main(_shard_args(resumed, shards, 0, "accum_steps=2", f"stop_at={stop}"))
    _main(_shard_args(resumed, shards, 0, "accum_steps=2"))
    _assert_same_run(straight, resumed)
