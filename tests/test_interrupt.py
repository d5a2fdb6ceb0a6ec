"""SIGINT and SIGTERM end a run at a step boundary, with a checkpoint of that step, one line and exit status 130 / 143;
the same command then resumes it exactly (issue 40, group 4).

1. Ctrl-C as a terminal sends it, to the whole process group (the trainer and its 2 DataLoader workers), at the
   epoch boundary of the world (step 8 of 16, where the next epoch's workers start): exit 130, one line, a checkpoint;
   the resumed run's losses are the straight run's.
2. SIGTERM to the trainer alone (a scheduler's notice), on webdataset shards with 2 workers, mid-epoch: exit 143, and
   the resumed run is the straight run, every metrics column and every weight.
3. Under torchrun with two processes, SIGTERM to rank 1 only: both ranks stop at the same step (the flag rides in the
   loss's all-reduce, `train_step`), the checkpoint holds both ranks, rank 0 prints the one line; the resumed
   torchrun run's losses are the straight torchrun run's.
4. The comparison's runner (`python -m powerclip.compare`, each run in a spawned process): SIGTERM to the runner
   alone is passed on to the run it is training, which stops with its checkpoint; the runner exits 143 with the run's
   line. The experiments' runner is the same code (`run_plan`).
"""
import os, signal, subprocess, sys, time
from pathlib import Path

import torch

import test_train_resume as resume

ROOT = Path(__file__).resolve().parents[1]
N = 16
one_thread = resume.one_thread   # its fixture (autouse); `shards`, `shard_straight`, `straight`: conftest.py


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "POWERCLIP_DEBUG": ""}


def _world_cmd(out, *extra):
    return [sys.executable, "-m", "powerclip.train", "--preset", "smoke", "data.workers=2", f"max_steps={N}",
            "ckpt_every=5", "optim.warmup_steps=3", f"out_dir={out}", *extra]


def _steps_logged(out) -> int:
    "The last step in metrics.csv (log_every=1: every step), 0 while there is none."
    try:
        lines = (Path(out) / "metrics.csv").read_text().strip().splitlines()
        return int(lines[-1].split(",")[0]) if len(lines) > 1 else 0
    except (OSError, ValueError):
        return 0


def _start(cmd, err_file, **kw):
    "The command in the background, its stderr into `err_file` (a pipe could fill and stall it)."
    return subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=open(err_file, "w"), **kw)


def _signal_when(p, out, step, send, err_file, timeout=300):
    "Wait until the run has logged `step`, then `send()`; the process's exit status and stderr."
    t0 = time.time()
    while _steps_logged(out) < step and p.poll() is None and time.time() - t0 < timeout:
        time.sleep(0.01)
    assert p.poll() is None, "the run ended before it could be signalled: " + Path(err_file).read_text()[-2000:]
    send()
    p.wait(timeout=timeout)
    return p.returncode, Path(err_file).read_text()


def _kill_group(p):
    "Whatever is left of the process group `p` leads (spawned runs, torchrun's ranks), killed."
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _stop_line(err: str, name: str) -> tuple[int, str]:
    "The one line of an interrupted run (the last of stderr), and its step; no traceback anywhere."
    assert "Traceback" not in err, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith("powerclip-train: interrupted (" + name + ") at step "), err[-2000:]
    assert "resume with the same command and resume=auto" in line, line
    return int(line.split(" at step ")[1].split()[0]), line


def _ck_step(out) -> int:
    return torch.load(Path(out) / "checkpoints" / "last.pt", weights_only=False)["state"]["step"]


def test_ctrl_c_to_the_group_with_workers_at_the_epoch_boundary(tmp_path, straight):
    """The straight run is the session's (tests/conftest.py: test_train_resume's runner, the same N steps with 1
    DataLoader worker and checkpoints every 3 steps): neither the worker count nor the checkpoints change a loss."""
    p = _start(_world_cmd(tmp_path), tmp_path / "err.txt", start_new_session=True)    # its own group, as a job's
    try:
        rc, err = _signal_when(p, tmp_path, 8, lambda: os.killpg(p.pid, signal.SIGINT),    # epoch 0 ends at step 8
                               tmp_path / "err.txt")
    finally:
        _kill_group(p)                                                         # its workers, whatever happened
    assert rc == 130, (rc, err[-3000:])
    step, _ = _stop_line(err, "SIGINT")
    assert 8 <= step < N and _ck_step(tmp_path) == step and not (tmp_path / "model.pt").exists()
    assert [r["step"] for r in resume._losses(tmp_path)[2]] == list(range(1, step + 1))
    r = subprocess.run(_world_cmd(tmp_path), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and f"at step {step}" in r.stderr, r.stderr[-3000:]
    steps, losses, _ = resume._losses(tmp_path)
    assert steps == list(range(1, N + 1)) and max(abs(a - b) for a, b in zip(losses, straight)) < 1e-6


def test_sigterm_mid_epoch_on_shards_with_workers(tmp_path, shards, shard_straight):
    cmd = [sys.executable, "-m", "powerclip.train", *resume._shard_args(tmp_path, shards, 2, "log_every=1")]
    p = _start(cmd, tmp_path.parent / f"{tmp_path.name}.err")
    rc, err = _signal_when(p, tmp_path, 3, lambda: p.send_signal(signal.SIGTERM),   # the trainer alone
                           tmp_path.parent / f"{tmp_path.name}.err")
    assert rc == 143, (rc, err[-3000:])
    step, _ = _stop_line(err, "SIGTERM")
    assert 3 <= step < resume.SHARD_N and _ck_step(tmp_path) == step
    r = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    resume._assert_same_run(shard_straight[2], tmp_path)


def _torchrun(out, *extra):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
            str(resume_free_port()), "-m", "powerclip.train", "--preset", "smoke", "data.batch_size=4",
            "data.workers=0", f"max_steps={N}", "ckpt_every=5", "optim.warmup_steps=3", f"out_dir={out}", *extra]


def resume_free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(p, rank: int, timeout=120):
    "The trainer process of `rank` under torchrun `p`."
    import psutil
    t0 = time.time()
    while time.time() - t0 < timeout:
        for c in psutil.Process(p.pid).children(recursive=True):
            try:
                if "powerclip.train" in " ".join(c.cmdline()) and c.environ().get("RANK") == str(rank):
                    return c
            except psutil.Error:
                continue
        time.sleep(0.1)
    raise AssertionError(f"no rank {rank} under torchrun")


def test_torchrun_ranks_stop_at_the_same_step(tmp_path):
    straight = tmp_path / "straight"
    r = subprocess.run(_torchrun(straight), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    run = tmp_path / "run"
    p = _start(_torchrun(run), tmp_path / "err.txt", start_new_session=True)
    try:
        rank1 = _rank(p, 1)
        rc, err = _signal_when(p, run, 3, lambda: rank1.send_signal(signal.SIGTERM),     # one rank only
                               tmp_path / "err.txt")
    finally:
        _kill_group(p)
    lines = [line for line in err.splitlines() if "interrupted (SIGTERM) at step" in line]
    assert len(lines) == 1 and lines[0].startswith("powerclip-train: "), err[-3000:]   # rank 0's line, once
    step = int(lines[0].split(" at step ")[1].split()[0])
    ck = torch.load(run / "checkpoints" / "last.pt", weights_only=False)
    assert ck["state"]["step"] == step and 3 <= step < N and len(ck["rng"]) == 2   # written by both, at one step
    r = subprocess.run(_torchrun(run), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and f"at step {step}" in r.stderr, r.stderr[-3000:]
    a, b = resume._losses(straight), resume._losses(run)
    assert b[0] == list(range(1, N + 1)) and max(abs(x - y) for x, y in zip(a[1], b[1])) < 1e-6


def test_compare_runner_passes_sigterm_on_and_stops(tmp_path):
    out = tmp_path / "cmp"
    cmd = [sys.executable, "-m", "powerclip.compare", "--preset", "smoke", "--runs", "CLIP", "--seeds", "0",
           "--steps", "40", "--eval-images", "8", "--out", str(out), "log_every=1"]
    run = out / "seed0" / "CLIP"
    p = _start(cmd, tmp_path / "err.txt", start_new_session=True)
    try:
        rc, err = _signal_when(p, run, 3, lambda: p.send_signal(signal.SIGTERM),   # the runner, not its child
                               tmp_path / "err.txt")
    finally:
        _kill_group(p)
    assert rc == 143, (rc, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith("python -m powerclip.compare: interrupted (SIGTERM) at step "), err[-2000:]
    assert "rerun the comparison to go on" in line, line
    step = int(line.split(" at step ")[1].split()[0])
    assert 3 <= step < 40 and _ck_step(run) == step and not (run / "train.json").exists()
