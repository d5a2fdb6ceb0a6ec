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
import pytest
import torch

from powerclip.runrecord import run_threads
from test_accum import ROWS, _config, _rel_errors, _spec, _steps
import test_train_resume as resume

one_thread = resume.one_thread   # its fixture: one torch thread (autouse); `shards`, `straight`: conftest.py


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


def test_accum_resume_is_exact(tmp_path, straight):
    """tests/test_train_resume.py's runner (smoke preset, N steps, one thread): plain (`straight`, the session's run of
    that runner), straight with accumulation and its first half in this process, the resume in a new one."""
    N, ref = resume.N, straight
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    with run_threads(1):                          # as the runner's processes (OMP_NUM_THREADS=1)
        resume._main(resume._args(straight, "accum_steps=2"))
        resume._main(resume._args(resumed, "accum_steps=2", f"stop_at={N // 2}"))
    steps, acc, _ = resume._losses(straight)
    assert steps == list(range(1, N + 1)) and max(abs(a - b) for a, b in zip(acc, ref)) < 1e-4, (ref, acc)
    assert resume._losses(resumed)[0] == list(range(1, N // 2 + 1))
    r = resume._run(resumed, "accum_steps=2")
    assert f"at step {N // 2}" in r.stderr
    steps, again, _ = resume._losses(resumed)
    assert steps == list(range(1, N + 1)) and max(abs(a - b) for a, b in zip(again, acc)) < 1e-6, (acc, again)


def test_accum_on_shards_resumes_exactly(tmp_path, request):
    shards = request.getfixturevalue("shards")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    resume._main(resume._shard_args(straight, shards, 0, "accum_steps=2"))
    for stop in (3, 9):                                              # mid-epoch, and in the second epoch
        resume._main(resume._shard_args(resumed, shards, 0, "accum_steps=2", f"stop_at={stop}"))
    resume._main(resume._shard_args(resumed, shards, 0, "accum_steps=2"))
    resume._assert_same_run(straight, resumed)
