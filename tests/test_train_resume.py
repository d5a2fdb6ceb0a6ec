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


def _args(out_dir, *extra):
    "The runner's trainer arguments (its command line without the interpreter)."
    return ["--preset", "smoke", "data.workers=1", f"max_steps={N}", "ckpt_every=3", "optim.warmup_steps=3",
            f"out_dir={out_dir}", *extra]


def _cmd(out_dir, *extra):
    return [sys.executable, "-m", "powerclip.train", *_args(out_dir, *extra)]


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


# `straight` (this runner's N steps straight, in a new process: its losses) is tests/conftest.py's, made once a session


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
    while not ck.exists() and p.poll() is None and time.time() - t0 < 240:
        time.sleep(0.05)
    time.sleep(0.3)  # somewhere after the first checkpoint, possibly in the middle of writing a later one
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert p.returncode == -signal.SIGKILL, "the run finished before it could be killed: make N larger"
    import torch
    killed_at = torch.load(ck, weights_only=False)["state"]["step"]
    assert 0 < killed_at < N
    r = _run(tmp_path)
    assert f"at step {killed_at}" in r.stderr
    steps, losses, _ = _losses(tmp_path)
    assert steps == list(range(1, N + 1))  # rows logged after the checkpoint by the killed run were dropped
    assert max(abs(a - b) for a, b in zip(losses, straight)) < 1e-6


# ------------------------------------------------------------------------------------------------ shards
# Webdataset shards with bad samples, the default shuffle buffer: a run stopped or killed anywhere and resumed logs
# exactly the rows of the straight run (every column but wall-clock time and throughput) and ends with the same weights.

BAD = dict(shard_error=1, no_image=1, bad_image=2, no_caption=1, bad_tree=1, no_regions=0, bad_regions=0)  # per pass
SHARD_N = 14


def _jpeg(seed):
    import io
    import numpy as np
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (40, 56, 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


def _good(i):
    import json
    from powerclip.parsing import ParsedCaption
    text = f"a small dog on a red chair number {i}"
    w = text.split()
    tree = ParsedCaption(text, w, [(0, len(w)), (0, 3), (3, len(w))], ["NP", "NP", "PP"], "gold", []).to_dict()
    return {"__key__": f"{i:09d}", "jpg": _jpeg(i), "txt": text, "tree.json": json.dumps(tree)}


def make_shards(root):
    """4 shards of 34 good samples and 6 bad ones (BAD), the last cut short in the middle of a member (the `shards`
    fixture of tests/conftest.py, made once a session)."""
    from powerclip.data import write_shard
    write_shard(root / "0.tar", [_good(i) for i in range(0, 5)] + [dict(_good(100), jpg=b"\xff\xd8 junk")]
                + [_good(i) for i in range(5, 10)])
    write_shard(root / "1.tar",
                [_good(10), dict(_good(101), txt=" "), _good(11), {k: v for k, v in _good(102).items() if k != "jpg"},
                                 *[_good(i) for i in range(12, 18)]])
    write_shard(root / "2.tar", [*[_good(i) for i in range(18, 24)], dict(_good(103), **{"tree.json": "{"}), _good(24),
                                 dict(_good(104), jpg=b"not a jpeg")])
    write_shard(root / "full.tar", [_good(i) for i in range(200, 212)])
    data = (root / "full.tar").read_bytes()
    (root / "full.tar").unlink()
    (root / "3.tar").write_bytes(data[:len(data) // 2 + 300])          # a truncated download
    return str(root / "{0..3}.tar")


def _shard_args(out_dir, shards, workers, *extra):
    return ["--preset", "smoke", f"out_dir={out_dir}", "data.source=wds", f"data.shards={shards}", "data.batch_size=4",
            f"data.workers={workers}", f"max_steps={SHARD_N}", "ckpt_every=2", "optim.warmup_steps=3", *extra]


def _rows(out_dir):
    from powerclip.train import read_metrics
    return [{k: v for k, v in r.items() if k not in ("time", "img_per_s")}
            for r in read_metrics(Path(out_dir) / "metrics.csv")]


def _weights(out_dir):
    import torch
    return torch.load(Path(out_dir) / "model.pt", weights_only=True)


def _assert_same_run(a, b):
    import torch
    ra, rb = _rows(a), _rows(b)
    assert [r["step"] for r in rb] == list(range(1, SHARD_N + 1))
    assert ra == rb                                                  # every column, to the last digit
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def _main(argv):
    from powerclip.train import main
    assert main(argv) == 0


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Every run of this module on one torch thread, in this process as in the subprocesses (`_env`): a result to the
    last digit depends on the thread count, and an earlier test of the session may have left it at 1 or at 2."""
    from powerclip.runrecord import run_threads
    with run_threads(1):
        yield


# `shard_straight` (the straight shard runs with 0 and 2 workers, in this process, one thread) is tests/conftest.py's


@pytest.mark.parametrize("workers", [0, 2])
def test_shards_stopped_twice_resume_exactly(tmp_path, shards, shard_straight, workers):
    for stop in (3, 9):                                              # mid-epoch, and in the second epoch
        _main(_shard_args(tmp_path, shards, workers, f"stop_at={stop}"))
    _main(_shard_args(tmp_path, shards, workers))
    _assert_same_run(shard_straight[workers], tmp_path)


@pytest.mark.parametrize("workers", [0, 2])
def test_shard_skip_counts_are_the_bad_samples(shard_straight, workers):
    rows = _rows(shard_straight[workers])
    epochs = sorted({r["epoch"] for r in rows})
    assert len(epochs) >= 2, "the run must cross an epoch boundary"
    last0 = [r for r in rows if r["epoch"] == 0][-1]
    assert {k: last0[f"skipped_{k}"] for k in BAD} == BAD            # a whole pass: every bad sample, once
    assert last0["skipped"] == last0["skipped_cum"] == sum(BAD.values())
    for r in rows:
        before = BAD if r["epoch"] == 1 else dict.fromkeys(BAD, 0)   # the finished epoch's, then this epoch's so far
        assert all(r[f"skipped_cum_{k}"] == before[k] + r[f"skipped_{k}"] for k in BAD), r
    for a, b in zip(rows, rows[1:]):                                 # per epoch they only grow
        if a["epoch"] == b["epoch"]:
            assert all(b[f"skipped_{k}"] >= a[f"skipped_{k}"] for k in BAD)


def test_shards_killed_twice_resume_exactly(tmp_path, shards, shard_straight):
    """SIGKILL mid-run, twice, in fresh processes with 2 workers: once the first checkpoint a run writes is in place
    and a step past it is logged (so the resume drops logged rows), the files polled every 10 ms. 10 or more of the 14
    steps are left at each kill, so a fast machine cannot finish the run first (a fixed 0.2 s wait after the
    checkpoint did, once)."""
    import torch
    ck = tmp_path / "checkpoints" / "last.pt"
    cmd = [sys.executable, "-m", "powerclip.train", *_shard_args(tmp_path, shards, 2)]

    def written():
        return ck.stat().st_mtime_ns if ck.exists() else None

    def step(): return torch.load(ck, weights_only=False)["state"]["step"]

    def logged():
        rows = (tmp_path / "metrics.csv").read_text().strip().splitlines()
        return int(rows[-1].split(",")[0]) if len(rows) > 1 else 0
    killed = []
    for _ in range(2):
        before, at = written(), None                     # the checkpoint this run resumes from (none the first time)
        p = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=open(tmp_path / "err", "w"))
        t0 = time.time()
        while p.poll() is None and time.time() - t0 < 240:
            try:
                if at is None and written() not in (before, None):
                    at = step()                        # the run's first new checkpoint
                if at is not None and logged() > at:
                    break
            except (OSError, ValueError, RuntimeError, EOFError):
                pass                                   # caught in the middle of a rename or a write
            time.sleep(0.01)
        p.send_signal(signal.SIGKILL)
        p.wait()
        assert p.returncode == -signal.SIGKILL, ("the run ended before it could be killed: "
                                                 + (tmp_path / "err").read_text()[-2000:])
        assert at is not None, "no checkpoint within 240 s"
        killed.append(step())
    assert 0 < killed[0] < killed[1] < SHARD_N, killed
    r = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"at step {killed[1]}" in r.stderr
    _assert_same_run(shard_straight[2], tmp_path)


def test_damaged_last_checkpoint_falls_back_to_the_previous(tmp_path, shards, shard_straight, capsys):
    _main(_shard_args(tmp_path, shards, 2, "stop_at=6"))            # checkpoints at steps 2, 4, 6: last = 6, prev = 4
    ck = tmp_path / "checkpoints"
    ck.joinpath("last.pt").write_bytes(ck.joinpath("last.pt").read_bytes()[:4096])   # half a file
    capsys.readouterr()
    _main(_shard_args(tmp_path, shards, 2))
    err = capsys.readouterr().err
    warn = [l for l in err.splitlines() if "cannot be read" in l]
    assert len(warn) == 1 and "last.pt" in warn[0] and "prev.pt (step 4)" in warn[0], err
    _assert_same_run(shard_straight[2], tmp_path)                    # resuming from step 4 is exact too
    assert ck.joinpath("last.pt.damaged").is_file()                 # set aside, not pushed over the good prev.pt
    from powerclip.checkpoint import load_checkpoint
    assert load_checkpoint(ck / "prev.pt")["state"]["step"] == SHARD_N - SHARD_N % 2 - 2
    # both damaged: one line saying so and how to start afresh, exit status 2
    ck.joinpath("last.pt").write_bytes(b"")
    ck.joinpath("prev.pt").write_bytes(b"PK\x03\x04 torn")
    from powerclip.train import main
    assert main(_shard_args(tmp_path, shards, 2)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("powerclip-train: error: resume: ") and "another out_dir" in err[0], err
    assert "overwrite=true (moves" in err[0] and "deletes nothing" in err[0], err     # never a way that destroys
