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
import os, resource, signal, socket, subprocess, sys, time
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


class _Ran:
    "What `_here` returns: the command's exit status and its stderr, as `subprocess.run` gives them."
    def __init__(self, returncode: int, stderr: str):
        self.returncode, self.stderr = returncode, stderr


def _here(capfd, out_dir, *extra):
    """The trainer's command line as `_run` runs it, in this process (one thread, as `_env`), without a new
    interpreter's start-up; for the cases where what is checked is the trainer's work, not the process around it."""
    from powerclip.runrecord import run_threads
    from powerclip.train import main
    capfd.readouterr()
    with run_threads(1):
        rc = main([*SMOKE, f"out_dir={out_dir}", *extra])
    return _Ran(rc, capfd.readouterr().err)


def _said(r) -> list[str]:
    "stderr lines that are not the trainer's log (nor open_clip's warning of a model built without weights)"
    return [line for line in r.stderr.splitlines() if line.strip()
            and not line.startswith(("[powerclip.train]", "WARNING:root:No pretrained weights"))]


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
def test_a_damaged_metrics_csv_is_repaired_on_resume(tmp_path, stopped, damage, capfd):
    from powerclip.trainlog import read_metrics
    run = _copy(stopped, tmp_path / "run")
    m = run / "metrics.csv"
    text = m.read_bytes()
    if damage == "nul":       # a hard reset: the file's last blocks are zeros
        damaged = text + b"\x00" * 700
    else:                     # the last row cut short, and a cell no number
        damaged = text + b"3,0,0.001,1e-"
    m.write_bytes(damaged)
    r = _here(capfd, run, "max_steps=4")
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


def _step(ck_file) -> int:
    return torch.load(ck_file, weights_only=False, map_location="cpu")["state"]["step"]


def _finite(ck_file) -> bool:
    ck = torch.load(ck_file, weights_only=False, map_location="cpu")
    return all(bool(torch.isfinite(t).all()) for t in ck["model"].values() if t.is_floating_point())


# ------------------------------------------------------------------------------------------- 2. a full disk
def _fsize_limit(n_bytes):
    "A child's file-size limit (`ulimit -f`): a write past it fails with EFBIG (Python ignores SIGXFSZ)."
    def set_it():
        resource.setrlimit(resource.RLIMIT_FSIZE, (n_bytes, n_bytes))
    return set_it


def test_a_checkpoint_write_under_a_file_size_limit_is_one_line_and_exit_3(tmp_path, stopped):
    run = _copy(stopped, tmp_path / "run")
    size = (run / "checkpoints" / "last.pt").stat().st_size
    before = (run / "checkpoints" / "last.pt").read_bytes()
    # the config, the log and the plot fit under the limit; the step-4 checkpoint does not
    r = _run(run, "max_steps=4", preexec=_fsize_limit(size // 2))
    line = _one_line(r, 3, "writing ", "last.pt", "it needs about", "the file-size limit is",
                     "the last good checkpoint is", "(step 2)")
    assert "ulimit -f" in line
    assert (run / "checkpoints" / "last.pt").read_bytes() == before and _step(run / "checkpoints" / "last.pt") == 2
    assert not list((run / "checkpoints").glob("*.tmp"))                   # the temporary file removed


def test_a_checkpoint_write_to_a_full_disk_is_one_line_and_exit_3(tmp_path, stopped):
    run = _copy(stopped, tmp_path / "run")
    tmp = run / "checkpoints" / "last.pt.tmp"
    tmp.symlink_to("/dev/full")                                            # every write there: ENOSPC
    r = _run(run, "max_steps=4")
    _one_line(r, 3, "writing ", "last.pt", "free on its disk", "the last good checkpoint is", "(step 2)")
    assert not tmp.is_symlink() and not tmp.exists()
    assert _step(run / "checkpoints" / "last.pt") == 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_under_ddp_a_failed_write_ends_both_processes_with_exit_3(tmp_path):
    run, port = tmp_path / "run", _free_port()
    procs = []
    for rank in range(2):
        env = {**_env(), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen(_cmd(run, "max_steps=3", "ckpt_every=1", "data.batch_size=4"), cwd=ROOT,
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      preexec_fn=_fsize_limit(2 * 2**20)))
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [3, 3], [o[1][-2000:] for o in outs]
    assert "Traceback" not in outs[0][1] + outs[1][1]
    assert "the file-size limit is 2.0 MiB" in outs[0][1]                  # the line, from the main process
    assert not (run / "checkpoints" / "last.pt").exists() and not list(run.glob("checkpoints/*.tmp"))


# ------------------------------------------------------------------------------------------- 3. one trainer
def test_a_second_trainer_is_refused_and_a_killed_one_never_blocks(tmp_path, capfd):
    run = tmp_path / "run"
    # with DataLoader workers, which share its lock's open file and outlive its kill -9 by up to 5 s
    first = subprocess.Popen(_cmd(run, "max_steps=100000", "ckpt_every=2", "data.workers=2"), cwd=ROOT, env=_env(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 240
        while not (run / "checkpoints" / "last.pt").is_file():
            assert first.poll() is None and time.time() < deadline, "the first trainer did not checkpoint"
            time.sleep(0.5)
        # stopped, not ended: it still holds its lock, and the two refused commands below have the CPU to themselves
        first.send_signal(signal.SIGSTOP)
        second = _here(capfd, run, "max_steps=100000", "ckpt_every=2")
        _one_line(second, 2, "is being trained by", f"pid {first.pid} on host {socket.gethostname()}",
                  "one trainer per run folder")
        assert first.poll() is None                                        # the first is still there
        overwrite = _here(capfd, run, "resume=never", "overwrite=true")    # nor is it moved aside under it
        _one_line(overwrite, 2, "is being trained by")
        assert first.poll() is None and not list(tmp_path.glob("run.old-*"))
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    step = _step(run / "checkpoints" / "last.pt")
    r = _here(capfd, run, f"max_steps={step + 1}", "ckpt_every=2")         # its lock left behind: taken over, once
    # its workers let go
    assert r.returncode == 0, r.stderr[-3000:]
    assert _step(run / "checkpoints" / "last.pt") == step + 1 and not (run / "train.lock").exists()


# ------------------------------------------------------------------------------------------- 0. nothing finished lost
def test_a_finished_run_without_checkpoints_is_never_replaced(tmp_path, stopped, capfd):
    run = _copy(stopped, tmp_path / "run")
    import shutil
    shutil.rmtree(run / "checkpoints")                                     # deleted to save space
    weights = (run / "model.pt").read_bytes()
    r = _here(capfd, run, "--method", "clip", "max_steps=2")
    _one_line(r, 2, "holds a finished run", "model.pt", "overwrite=true moves it aside")
    assert (run / "model.pt").read_bytes() == weights and not (run / "checkpoints").exists()
    own = tmp_path / "own"                                                 # a user's own files
    own.mkdir()
    (own / "config.yaml").write_text("lr: 1\n")
    (own / "metrics.csv").write_text("step,loss\n1,2\n")
    _one_line(_here(capfd, own, "max_steps=2"), 2, "files the trainer did not write (metrics.csv, config.yaml)")
    assert (own / "config.yaml").read_text() == "lr: 1\n"


def test_a_nan_last_pt_never_rotates_over_a_finite_prev_pt(tmp_path, stopped, capfd):
    "A diverged run stops with one line naming the finite checkpoint it kept, and status 4 (`Diverged`)."
    run = _copy(stopped, tmp_path / "run")
    last, prev = run / "checkpoints" / "last.pt", run / "checkpoints" / "prev.pt"
    good = last.read_bytes()
    prev.write_bytes(good)
    ck = torch.load(last, weights_only=False)
    ck["model"] = {k: torch.full_like(v, float("nan")) if v.is_floating_point() else v for k, v in ck["model"].items()}
    torch.save(ck, last)
    _one_line(_here(capfd, run, "max_steps=6", "ckpt_every=1"), 4, "not finite", f"{prev} (step 2)")
    assert prev.read_bytes() == good and _finite(prev)


# ------------------------------------------------------------------------------------------- 4. a corrupt cache
def test_a_cut_feature_cache_entry_is_recomputed_with_one_warning(tmp_path, capsys):
    from powerclip.eval.models import FeatureCache
    cache, calls = FeatureCache(tmp_path, "ck"), []

    def compute():
        calls.append(1)
        return {"image": torch.arange(6.0).reshape(2, 3)}
    first = cache.get("img", ["a", "b"], compute)
    entry = next((tmp_path / "ck").glob("img-*.pt"))
    entry.write_bytes(entry.read_bytes()[:64])                             # cut short
    capsys.readouterr()
    again = cache.get("img", ["a", "b"], compute)
    assert torch.equal(again["image"], first["image"]) and len(calls) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot be read" in err[0] and "computed again" in err[0], err
    assert torch.equal(torch.load(entry, weights_only=True)["image"], first["image"])   # replaced
    assert torch.equal(cache.get("img", ["a", "b"], compute)["image"], first["image"]) and len(calls) == 2


# ------------------------------------------------------------------------------------------- 5. one line each
def _files(folder) -> dict:
    folder = Path(folder)
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _train_in_process(capsys, *argv):
    from powerclip.train import main
    capsys.readouterr()
    rc = main([*SMOKE, *argv])
    err = [line for line in capsys.readouterr().err.splitlines()
           if line.strip() and not line.startswith(("[powerclip.train]", "WARNING:root:No pretrained weights"))]
    return rc, err


def _refused(rc, err, *words):
    assert rc == 2 and len(err) == 1 and ": error: " in err[0], (rc, err)
    for w in words:
        assert w in err[0], (w, err[0])


def test_config_tracebacks_are_one_line_each(tmp_path, capsys, monkeypatch, stopped):
    monkeypatch.delenv("POWERCLIP_DEBUG", raising=False)
    out = f"out_dir={tmp_path / 'x'}"
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    for argv, words in [
        (["model.kwargs={text_cfg: {context_length: 0}}"], ["model.kwargs: the text tower's context_length is 0"]),
        (["data.world={sizes: {small: -0.1, large: 0.19}}"], ["data.world: sizes {'small': -0.1}"]),
        (["data.world={max_tries: 0}"], ["data.world: max_tries: must be an integer at least 1"]),
        (["data.world={min_objects: 3, max_objects: 3, sizes: {large: 0.5}}"], ["data.world: no scene can be drawn"]),
        (["data.world_length=100000000000000000000"], ["data.world_length: must be in [1, 2^31]"]),
        (["data.batch_size=1"], ["data.batch_size: a global batch of 1 has no negative pair"]),
        ([f"model.pretrained={stopped / 'checkpoints' / 'last.pt'}"],
         ["is a training checkpoint", f"{stopped / 'model.pt'} or {stopped / 'snapshots' / 'stepN' / 'model.pt'}"]),
    ]:
        _refused(*_train_in_process(capsys, out, *argv), *words)
    for link in (loop, dangling):
        _refused(*_train_in_process(capsys, f"out_dir={link}"), "out_dir: ", "symbolic link to nothing")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    _refused(*_train_in_process(capsys, out), "WORLD_SIZE=2 but MASTER_ADDR/MASTER_PORT are not set")
    monkeypatch.delenv("WORLD_SIZE")
    assert not (tmp_path / "x").exists()
    from powerclip.eval.cli import main as eval_main
    capsys.readouterr()
    assert eval_main(["make-world", str(tmp_path / "w"), "--seed", "-1"]) == 2
    assert "--seed" in capsys.readouterr().err and not (tmp_path / "w").exists()


def test_a_resume_past_max_steps_is_one_line_and_writes_nothing(tmp_path, capsys, monkeypatch, stopped):
    monkeypatch.delenv("POWERCLIP_DEBUG", raising=False)
    run = _copy(stopped, tmp_path / "run")
    before = _files(run)
    _refused(*_train_in_process(capsys, f"out_dir={run}", "max_steps=1"), "max_steps: ", "is at step 2, past "
             "max_steps=1")
    assert _files(run) == before


def test_compare_refuses_overrides_it_would_drop(tmp_path, capsys):
    from powerclip.compare import main
    capsys.readouterr()
    assert main(["--runs", "CLIP", "--preset", "smoke", "--out", str(tmp_path / "c"), "seed=5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "seed: the comparison sets it for each run; give --seeds instead" in err[0], err
    assert not (tmp_path / "c").exists()


def test_eval_images_refused_where_not_used(tmp_path, capsys, monkeypatch):
    "Issue 47: `eval run --images` was silently ignored for `captions.jsonl` data (its images are always DATA/images)."
    import json
    from PIL import Image
    from powerclip.eval.cli import main as eval_main
    monkeypatch.delenv("POWERCLIP_DEBUG", raising=False)
    data, other = tmp_path / "data", tmp_path / "other"
    (data / "images").mkdir(parents=True)
    other.mkdir()
    for i in range(2):
        Image.new("RGB", (32, 32), (40 * i, 80, 120)).save(data / "images" / f"{i}.jpg")
        Image.new("RGB", (32, 32), (200, 40 * i, 10)).save(other / f"{i}.jpg")
    (data / "captions.jsonl").write_text("".join(json.dumps(dict(image_id=i, file_name=f"{i}.jpg",
                                                                 captions=[f"a photo {i}"])) + "\n" for i in range(2)))
    base = ["run", "--model", "powerclip-micro", "--data", str(data), "--out", str(tmp_path / "res"), "--cache",
            "none", "--no-progress", "--device", "cpu"]
    capsys.readouterr()
    for tasks in (["retrieval"], ["all"]):
        assert eval_main([*base, "--tasks", *tasks, "--images", str(other)]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and err.count("--images: ") == 1, err
        assert "captions.jsonl" in err and "Traceback" not in err, err
        assert not (tmp_path / "res").exists()
    assert eval_main([*base, "--tasks", "retrieval"]) == 0                  # without --images: evaluated as before
