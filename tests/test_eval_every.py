"""Evaluation while training (`eval_every`, `50_train` and `64a_eval_training`).

1. It changes nothing in the training: 6 steps of the smoke preset (PowerCLIP, one CPU thread) with `eval_every=2` on
   the world's held-out scenes leave every parameter bitwise equal (`torch.equal`) to the same run without it, and
   the same losses; the numbers are in metrics.csv (steps 2, 4, 6) and in TensorBoard.
2. Exact resume is unchanged: the same run stopped at step 3 and resumed ends with the same weights.
3. A missing or broken evaluation folder, a task without its data, or shards without a folder: one line from the
   command line, exit status 2, before the first step (no metrics, no checkpoint).
4. The other processes wait for the main one's evaluation under a timeout of their own: two gloo processes whose run
   group has a timeout of 2 s, the main one busy for 6 s; a plain barrier fails there, `wait_for_main` does not, and
   the run group works afterwards. The whole trainer under torchrun (2 processes, rank 0 evaluating) logs the losses
   of one process with the doubled batch.
"""
import contextlib, io, os, socket, subprocess, sys, time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
EVAL = dict(eval_every=2, eval_images=16)


def _cfg(out_dir, **kw):
    from powerclip.config import load_config
    return load_config("smoke", dict(out_dir=str(out_dir), progress=False, **kw))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    "The smoke run without and with evaluation, one CPU thread (bitwise comparisons need the same reduction order)."
    from powerclip.train import train
    from powerclip.runrecord import run_threads
    d = tmp_path_factory.mktemp("eval_every")
    with run_threads(1):
        train(_cfg(d / "plain", tensorboard=False))
        t0 = time.time()
        train(_cfg(d / "eval", tensorboard=True, **EVAL))
        print(f"smoke run with eval_every=2: {time.time() - t0:.1f}s")
        train(_cfg(d / "resumed", stop_at=3, **EVAL))
        train(_cfg(d / "resumed", **EVAL))
    return d


def _weights(run_dir):
    return torch.load(Path(run_dir) / "model.pt", weights_only=True)


def test_eval_every_changes_no_weight(runs):
    from powerclip.train import read_metrics
    a, b = _weights(runs / "plain"), _weights(runs / "eval")
    assert a.keys() == b.keys() and len(a) > 10
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:5]
    plain, ev = read_metrics(runs / "plain" / "metrics.csv"), read_metrics(runs / "eval" / "metrics.csv")
    # the smoke preset logs every step: the same rows, the same losses, to the last digit
    assert [r["step"] for r in plain] == [r["step"] for r in ev] == list(range(1, 7))
    assert all(p[k] == e[k] for p, e in zip(plain, ev) for k in ("loss", "clip", "powerset", "grad_norm"))
    steps = [r["step"] for r in ev if "eval/retrieval/i2t_R@1" in r]
    assert steps == [2, 4, 6]
    row = ev[1]
    for k in ("eval/retrieval/i2t_R@1", "eval/sugarcrepe/mean", "eval/zeroshot/top1", "eval/winoground/group",
              "eval/linear_probe/acc", "eval/regions/pooled_top1", "eval/seconds"):
        assert k in row and 0 <= row[k] <= (100 if k != "eval/seconds" else 1e4), (k, row.get(k))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(runs / "eval" / "tb"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert any(t.startswith("eval/retrieval/i2t_R") for t in tags), tags
    assert [e.step for e in acc.Scalars(next(t for t in tags if t.startswith("eval/retrieval/i2t_R")))] == [2, 4, 6]


def test_eval_every_resume_exact(runs):
    from powerclip.train import read_metrics
    a, b = _weights(runs / "eval"), _weights(runs / "resumed")
    assert all(torch.equal(a[k], b[k]) for k in a)
    straight, resumed = (read_metrics(runs / d / "metrics.csv") for d in ("eval", "resumed"))
    assert [r["step"] for r in resumed] == list(range(1, 7))
    for s, r in zip(straight, resumed):
        assert {k: v for k, v in s.items() if k.startswith("eval/") and k != "eval/seconds"} == \
               {k: v for k, v in r.items() if k.startswith("eval/") and k != "eval/seconds"}
        assert s["loss"] == r["loss"]


def _cli(*argv):
    from powerclip.train import main
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return rc, err.getvalue()


def test_eval_every_bad_folder_is_one_line(tmp_path):
    from powerclip.eval.data import write_world_benchmark
    write_world_benchmark(tmp_path / "small", 8, extras=False)          # no classification set, no Winoground pairs
    (tmp_path / "empty").mkdir()
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "retrieval.json").write_text("{not json")
    cases = [(f"eval_data={tmp_path / 'none'}", "eval_data: "), (f"eval_data={tmp_path / 'empty'}", "eval_data: "),
             (f"eval_data={tmp_path / 'broken'}", "eval_data: "),
             ("eval_tasks=[winoground]", "eval_data: "), ("eval_tasks=[nope]", "eval_tasks: unknown task 'nope'"),
             ("data.source=wds", "eval_data: shards have no held-out folder")]
    for arg, msg in cases:
        out = tmp_path / "run"
        extra = ([f"data.shards={tmp_path / 'x.tar'}", "max_steps=2"] if arg == "data.source=wds"
                 else [f"eval_data={tmp_path / 'small'}"] if arg.startswith("eval_tasks=[w") else [])
        if extra and arg == "data.source=wds":
            (tmp_path / "x.tar").write_bytes(b"")
        rc, err = _cli("--preset", "smoke", "eval_every=2", f"out_dir={out}", arg, *extra)
        assert rc == 2 and err.count("\n") == 1, (arg, rc, err)
        assert err.startswith("powerclip-train: error: ") and msg in err, (arg, err)
        assert not (out / "metrics.csv").exists() and not (out / "checkpoints").exists(), arg


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _waiter(rank, port, plain, out):
    "Rank 0 works alone for 6 s (an evaluation) while rank 1 waits: on the run group (2 s timeout) or `wait_for_main`."
    import torch.distributed as td
    from powerclip import dist as pdist
    torch.set_num_threads(1)
    td.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                          timeout=timedelta(seconds=2))
    ctx = pdist.DistContext(rank, 2, rank, torch.device("cpu"), "gloo")
    group = pdist.wait_group(ctx, 120)
    res = "ok"
    if rank == 0:
        time.sleep(6)
    try:
        td.barrier() if plain else pdist.wait_for_main(group)
        x = torch.ones(1) * (rank + 1)
        td.all_reduce(x)                       # the run group still works
        res = f"ok {int(x)}"
    except RuntimeError as e:
        res = f"error {type(e).__name__}"
    Path(f"{out}.{rank}").write_text(res)
    # leave without tearing the groups down: the plain barrier's group is broken, and gloo's teardown at interpreter
    # exit aborted a healthy rank once ("terminate called without an active exception", SIGABRT) on the idle machine
    os._exit(0)


@pytest.mark.parametrize("plain", [False, True])
def test_eval_every_others_wait_past_the_run_timeout(tmp_path, plain):
    out = tmp_path / "wait"
    ctx = mp.start_processes(_waiter, args=(_free_port(), plain, str(out)), nprocs=2, join=False,
                             start_method="spawn")
    ctx.join(timeout=120)
    res = Path(f"{out}.1").read_text()
    if plain:     # rank 1's barrier on the run group times out while rank 0 is busy
        assert res.startswith("error"), res
    else:
        assert res == "ok 3" and Path(f"{out}.0").read_text() == "ok 3"
    for p in ctx.processes:
        if p.is_alive():
            p.kill()


def test_eval_every_torchrun_rank0_evaluates(tmp_path):
    common = ["--preset", "smoke", "max_steps=3", "optim.warmup_steps=1", "progress=false", "tensorboard=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          str(_free_port()), "-m", "powerclip.train", *common, "data.batch_size=4", "eval_every=2",
                          "eval_images=16", "eval_tasks=[retrieval]", f"out_dir={tmp_path / 'two'}"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    from powerclip.runrecord import run_threads
    from powerclip.train import read_metrics, train
    with run_threads(1):
        train(_cfg(tmp_path / "one", **{"max_steps": 3, "optim.warmup_steps": 1, "tensorboard": False,
                                         "data.batch_size": 8}))
    a, b = read_metrics(tmp_path / "two" / "metrics.csv"), read_metrics(tmp_path / "one" / "metrics.csv")
    assert [r["step"] for r in a if "eval/retrieval/i2t_R@1" in r] == [2, 3]
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) < 1e-4, (x, y)
