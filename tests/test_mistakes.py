"""A user's mistakes with a run, its data and its tools (issue 40): each refusal is one line on stderr, exit status 2,
and no file touched; what a tool accepts, it does what it says. Interruptions are tests/test_interrupt.py, exact
accumulation's guards tests/test_accum.py, and the one-line refusals that need no run tests/test_cli.py.

1. A run is never overwritten: `resume=never` into a folder that holds a run is refused (naming the run and the ways
   on), `overwrite=true` moves it aside, never deletes; `annotate_shards.py --out` that would write over an input is
   refused; `powerclip-eval make-world` into a folder holding another world (or other files) is refused, the same
   world again is a no-op.
2. A resume compares the checkpoint's config with the new one before any file is written: another method, model,
   method option or batch size is one line naming the keys, `config.yaml` untouched (the run still resumes); a new
   learning rate and schedule reach the optimiser's groups and the scheduler, and the log says so.
3. A non-finite weight is never saved as `model.pt` (the refusals of non-finite numbers: tests/test_cli.py).
5. Data counted, not guessed: a shard cut inside a tar header counts as a shard error in the trainer's metrics; a
   16-bit PNG is read by value (not a white image); shards whose every sample is skipped say so, with the counts.
6. One line for what was a traceback: an `out_dir` the run could not write at its first checkpoint, pretrained
   weights of another model size, and `powerclip-eval` on a checkpoint of another model size.
"""
import json, os
from pathlib import Path

import pytest
import torch

SMOKE = ["--preset", "smoke"]


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch):
    monkeypatch.delenv("POWERCLIP_DEBUG", raising=False)


def _files(folder) -> dict:
    "Every file under `folder` with its size and modification time: what 'no file touched' compares."
    folder = Path(folder)
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _train(capsys, *argv):
    "`powerclip.train.main(argv)` in this process: (exit status, stderr lines that are not the trainer's log)."
    from powerclip.train import main
    capsys.readouterr()
    rc = main(list(argv))
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("[powerclip.train]")]
    return rc, err


def _refused(rc, err, *words):
    assert rc == 2, (rc, err)
    assert len(err) == 1 and ": error: " in err[0], err
    for w in words:
        assert w in err[0], (w, err[0])


# ------------------------------------------------------------------------------------------------ 1. never overwritten
def test_resume_never_over_a_run_is_refused_and_overwrite_moves_it_aside(tmp_path, capsys):
    run = tmp_path / "run"
    assert _train(capsys, *SMOKE, f"out_dir={run}")[0] == 0
    before = _files(run)
    rc, err = _train(capsys, *SMOKE, f"out_dir={run}", "resume=never")
    _refused(rc, err, "out_dir: ", str(run), "holds a run (checkpoints/last.pt", "resume=auto continues it",
             "another out_dir", "overwrite=true moves it aside")
    assert _files(run) == before                                       # nothing touched
    assert "nothing is deleted" in err[0] and "resume=never starts" not in err[0]   # no way on that destroys
    # overwrite=true: the old run is moved aside whole (renamed, nothing deleted), the new one starts afresh
    assert _train(capsys, *SMOKE, f"out_dir={run}", "resume=never", "overwrite=true", "max_steps=2")[0] == 0
    old = [p for p in tmp_path.iterdir() if p.name.startswith("run.old-")]
    assert len(old) == 1 and _files(old[0]) == before
    assert json.loads(json.dumps(torch.load(run / "checkpoints" / "last.pt", weights_only=False)["state"]))["step"] == 2


def test_annotate_never_writes_over_an_input(tmp_path, capsys):
    from data_prep.annotate_shards import main
    from powerclip.data import write_shard
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for d, name in (("a", "x.tar"), ("b", "y.tar")):
        write_shard(tmp_path / d / name, [{"__key__": "000000000", "txt": "a dog", "jpg": b"\xff\xd8"}])
    before = _files(tmp_path)
    for argv in ([str(tmp_path / "a" / "x.tar"), "--out", str(tmp_path / "a")],       # the input's own folder
                 [str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "b")],   # the folder of an input
                 [str(tmp_path / "a" / "x.tar"), "--out", str(tmp_path / "a" / ".")]):
        capsys.readouterr()
        rc = main(argv)
        err = capsys.readouterr().err.splitlines()
        _refused(rc, err, "--out: ", "would write over the input")
        assert _files(tmp_path) == before, argv


def test_make_world_refuses_a_folder_with_another_world(tmp_path, capsys):
    from powerclip.eval.cli import main
    w = tmp_path / "world"
    assert main(["make-world", str(w), "--n-images", "12"]) == 0
    before = _files(w)
    assert main(["make-world", str(w), "--n-images", "12"]) == 0                 # the same world: nothing to do
    assert _files(w) == before
    capsys.readouterr()
    rc = main(["make-world", str(w), "--n-images", "8"])
    _refused(rc, capsys.readouterr().err.splitlines(), "out: ", "holds another world (n_images 12",
             "give an empty or new folder")
    assert _files(w) == before                                       # no image rewritten, none left stale
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    rc = main(["make-world", str(tmp_path / "mine")])
    _refused(rc, capsys.readouterr().err.splitlines(), "holds files that are not a world folder")
    assert _files(tmp_path / "mine") == {"notes.txt": _files(tmp_path / "mine")["notes.txt"]}


# ------------------------------------------------------------------------------------------------ 2. resume
@pytest.fixture
def stopped(tmp_path, capsys):
    "A smoke run stopped at step 3 of 6 (its checkpoint at 3)."
    run = tmp_path / "run"
    assert _train(capsys, *SMOKE, f"out_dir={run}", "stop_at=3")[0] == 0
    return run


@pytest.mark.parametrize("argv,keys", [(["--method", "clip"], "other method:"),
                                       (["model.name=powerclip-tiny"], "other model.name: model.name "
                                                                       "'powerclip-micro' there, 'powerclip-tiny' now"),
                                       (["method_cfg.lam=0.5"], "other method_cfg.lam"),
                                       (["data.batch_size=4"], "other data.batch_size"),
                                       (["seed=3"], "other seed")])
def test_resume_refuses_what_it_may_not_change_before_writing(stopped, capsys, argv, keys):
    before = _files(stopped)
    rc, err = _train(capsys, *SMOKE, f"out_dir={stopped}", *argv)
    _refused(rc, err, "resume: ", "last.pt was trained with " + keys, "give the checkpoint's values")
    assert _files(stopped) == before                                 # config.yaml included: the run is intact
    assert _train(capsys, *SMOKE, f"out_dir={stopped}")[0] == 0       # and resumes as it was
    from powerclip.train import read_metrics
    assert [r["step"] for r in read_metrics(stopped / "metrics.csv")] == list(range(1, 7))


def test_resume_applies_a_new_learning_rate_and_schedule(stopped, capsys):
    from powerclip.checkpoint import load_checkpoint
    from powerclip.train import lr_factor, read_metrics
    capsys.readouterr()
    rc, _ = _train(capsys, *SMOKE, f"out_dir={stopped}", "optim.lr=4e-3", "max_steps=8", "optim.warmup_steps=4")
    assert rc == 0
    rows = read_metrics(stopped / "metrics.csv")
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert rows[2]["lr"] == pytest.approx(1e-3 * lr_factor(2, 6, 2), rel=1e-12)          # before: as it ran
    for r in rows[3:]:                                     # after: the new peak and the new schedule's shape and length
        assert r["lr"] == pytest.approx(4e-3 * lr_factor(r["step"] - 1, 8, 4), rel=1e-12), r
    ck = load_checkpoint(stopped / "checkpoints" / "last.pt")
    assert {g["initial_lr"] for g in ck["optimizer"]["param_groups"]} == {4e-3}
    assert set(ck["scheduler"]["base_lrs"]) == {4e-3}


def test_resume_says_what_it_changed(stopped, capsys):
    from powerclip.train import main
    capsys.readouterr()
    assert main([*SMOKE, f"out_dir={stopped}", "optim.lr=2e-3", "log_every=2"]) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if "resume changes" in line]
    assert len(said) == 1 and "log_every 1 -> 2" in said[0] and "optim.lr 0.001 -> 0.002" in said[0], said
    assert "applied" in said[0]


# ------------------------------------------------------------------------------------------------ 3. numbers
def test_non_finite_weights_are_never_saved_as_model_pt(tmp_path):
    "An evaluation at the last step that poisons a weight: the run stops without writing model.pt."
    from powerclip.train import load_config, train

    def poison(model, modules, step):
        with torch.no_grad():
            next(model.parameters()).view(-1)[0] = float("nan")
        return {}
    cfg = load_config("smoke", dict(out_dir=str(tmp_path / "run"), eval_every=6))
    # the last checkpoint comes first, and is not written either: the finite one of step 3 is kept and named (issue 47)
    with pytest.raises(RuntimeError, match=r"the weights are not finite at step 6: no checkpoint written \(the finite "
                                           r"one is kept: .*last.pt \(step 3\)\)"):
        train(cfg, poison)
    assert not (tmp_path / "run" / "model.pt").exists() and (tmp_path / "run" / "checkpoints" / "last.pt").is_file()


# ------------------------------------------------------------------------------------------------ 5. data counted
def _sample(i, **kw):
    import io
    import numpy as np
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(i).integers(0, 255, (40, 48, 3), dtype=np.uint8)).save(buf, "JPEG")
    return {"__key__": f"{i:09d}", "jpg": buf.getvalue(), "txt": f"a small dog number {i}", **kw}


def _shard_argv(out, shards, *extra):
    return [*SMOKE, "--method", "clip", f"out_dir={out}", "data.source=wds", f"data.shards={shards}",
            "data.batch_size=2", "data.workers=0", "data.shuffle_buffer=0", "max_steps=3", *extra]


def test_header_cut_shard_counts_as_a_shard_error(tmp_path, capsys):
    import tarfile
    from powerclip.data import write_shard
    from powerclip.train import read_metrics
    write_shard(tmp_path / "0.tar", [_sample(i) for i in range(6)])
    write_shard(tmp_path / "full.tar", [_sample(i) for i in range(10, 16)])
    with tarfile.open(tmp_path / "full.tar") as t:
        cut = t.getmembers()[-2].offset + 200                          # inside a header: tarfile ends quietly there
    (tmp_path / "1.tar").write_bytes((tmp_path / "full.tar").read_bytes()[:cut])
    rc, err = _train(capsys, *_shard_argv(tmp_path / "run", str(tmp_path / "{0..1}.tar"), "max_steps=5"))
    assert rc == 0, err
    last = read_metrics(tmp_path / "run" / "metrics.csv")[-1]
    assert last["skipped_cum_shard_error"] == 1, last                   # counted, as the annotator counts it


def test_sixteen_bit_png_is_read_by_value():
    import io
    import numpy as np
    from PIL import Image
    from powerclip.data import BatchSpec, DataConfig, Geometry, SampleSkipCounter, decode_sample, eval_transform

    def png(a):
        buf = io.BytesIO()
        Image.fromarray(a).save(buf, "PNG")
        return buf.getvalue()
    spec, pre = BatchSpec(DataConfig(), Geometry(32, 8, 77)), eval_transform(32)
    no_jpg = {k: v for k, v in _sample(1).items() if k != "jpg"}
    grey16 = decode_sample({**no_jpg, "png": png(np.full((40, 40), 32896, np.uint16))}, spec, 0, pre,
                           SampleSkipCounter())
    grey8 = decode_sample({**no_jpg, "png": png(np.full((40, 40), 128, np.uint8))}, spec, 0, pre, SampleSkipCounter())
    assert torch.equal(grey16["image"], grey8["image"])                  # 32896 / 257 = 128, not clipped to 255


def test_every_sample_skipped_says_so_with_the_counts(tmp_path, capsys):
    from powerclip.data import write_shard
    write_shard(tmp_path / "0.tar", [_sample(i, jpg=b"not a jpeg") for i in range(5)]
                + [{k: v for k, v in _sample(9).items() if k != "txt"}])
    rc, err = _train(capsys, *_shard_argv(tmp_path / "run", str(tmp_path / "0.tar")))
    _refused(rc, err, "data.shards: every sample of epoch 0 was skipped (bad_image 5, no_caption 1")


# ------------------------------------------------------------------------------------------------ 6. one line
def test_unwritable_checkpoint_folder_is_refused_before_the_first_step(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").symlink_to("/proc/sys")              # a folder no one may write, root included
    if os.access(run / "checkpoints", os.W_OK):
        pytest.skip("/proc/sys is writable here")
    rc, err = _train(capsys, *SMOKE, f"out_dir={run}")
    _refused(rc, err, "out_dir: ", "checkpoints' is not writable")
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints"]    # no step taken, nothing written


def test_pretrained_of_another_size_is_one_line(tmp_path, capsys):
    from powerclip.model import create_model
    torch.save(create_model("powerclip-micro")[0].state_dict(), tmp_path / "micro.pt")
    rc, err = _train(capsys, *SMOKE, f"out_dir={tmp_path / 'run'}", "model.name=powerclip-tiny",
                     f"model.pretrained={tmp_path / 'micro.pt'}")
    _refused(rc, err, "model.pretrained: ", "does not fit powerclip-tiny", "in the checkpoint", "in the model")
    assert not (tmp_path / "run").exists()


def test_eval_checkpoint_of_another_size_is_one_line(tmp_path, capsys):
    from powerclip.eval.cli import main
    from powerclip.model import create_model
    torch.save(create_model("powerclip-micro")[0].state_dict(), tmp_path / "micro.pt")
    assert main(["make-world", str(tmp_path / "world"), "--n-images", "8"]) == 0
    capsys.readouterr()
    rc = main(["run", "--checkpoint", str(tmp_path / "micro.pt"), "--model", "powerclip-tiny", "--data",
               str(tmp_path / "world"), "--out", str(tmp_path / "res"), "--cache", "none", "--no-progress"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("powerclip-eval")
           or not line.startswith(("INFO ", "WARNING ", "No pretrained"))]
    _refused(rc, err, "--checkpoint: ", "does not fit powerclip-tiny", "in the checkpoint", "in the model",
             "tensors differ in size")
    assert not (tmp_path / "res").exists()
