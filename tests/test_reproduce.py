"""A run records what made it (`run.json`, `49h_runrecord`), with the thread count of the process that trained it, and
`python -m powerclip.reproduce` (`72_reproduce`) remakes it and says where it parts (issue 44).

One `smoke` CLIP run (6 steps) is trained once for the module, by the comparison's own path (`compare.train_job` in a
spawned child) from a parent at 1 thread with a plan at 2: the record must say 2, the child's count. The tests then
read it or rerun it."""
import json
import shutil

import pytest
import torch

from powerclip.compare import make_plan, train_job
from powerclip.reproduce import main
from powerclip.runrecord import RECORD, run_threads


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    "(the run's folder, its train.json): trained in a spawned child at 2 threads, asked for by a parent at 1."
    out = tmp_path_factory.mktemp("repro")
    with run_threads(1):
        plan = make_plan(["CLIP"], seeds=[0], steps=6, out_dir=out, preset="smoke", log=lambda m: None,
                         overrides={"threads": 2})
        job = plan.job("CLIP", 0)
        rec = train_job(job, isolate=True, log=lambda m: None)
    return job.dir, rec


def test_the_record_holds_the_childs_thread_count(trained):
    run, rec = trained
    record = json.loads((run / RECORD).read_text())
    seg = record["segments"][0]
    assert (record["threads"], seg["threads"], seg["from_step"]) == (2, 2, 0)
    # train.json and the table's row say the child's count, not the parent's 1
    assert json.loads((run / "train.json").read_text())["threads"] == 2 and rec["record"]["threads"] == 2
    assert len(record["commit"]) == 40 and all(c in "0123456789abcdef" for c in record["commit"])
    assert set(record["versions"]) == {"python", "torch", "open_clip", "numpy", "spacy"}
    assert record["device"] == "cpu" and isinstance(record["dirty"], bool) and len(record["host_sha256"]) == 16
    assert record["cpu_capability"] == torch.backends.cpu.get_cpu_capability()      # the child's, e.g. AVX512
    ck = torch.load(run / "checkpoints" / "last.pt", weights_only=False)
    assert ck["record"]["threads"] == 2                                   # and in the checkpoint


def test_the_plan_gives_every_child_its_count():
    "Without threads=N, the plan passes this process's count explicitly (not left to the child's OMP_NUM_THREADS)."
    with run_threads(1):
        plan = make_plan(["CLIP", "C2LIP"], seeds=[0, 1], steps=10, out_dir="/nonexistent/plan", preset="smoke",
                         log=lambda m: None)
    assert {j.cfg.threads for j in plan.jobs.values()} == {1} and plan.meta["threads"] == 1


def test_reproduce_a_fresh_run_is_bitwise_equal(trained, capsys):
    run, _ = trained
    assert main([str(run)]) == 0
    out = capsys.readouterr().out
    assert "bitwise equal through step" in out and "weights at step" in out, out
    assert "differ between then and now: none" in out, out


def test_reproduce_at_another_thread_count_parts(trained, capsys, tmp_path):
    "At 1 thread the rerun parts from the 2-thread run, and every recorded fact that differs is named."
    run, _ = trained
    moved = tmp_path / "moved"                # as if trained on a machine without AVX-512
    shutil.copytree(run, moved)
    rec = json.loads((moved / RECORD).read_text())
    for seg in rec["segments"]:
        seg["cpu_capability"] = "AVX2" if torch.backends.cpu.get_cpu_capability() != "AVX2" else "AVX512"
    (moved / RECORD).write_text(json.dumps(rec))
    assert main([str(moved), "--steps", "6", "--threads", "1"]) == 1
    out = capsys.readouterr().out
    assert "parted at step " in out and "threads 2 then, 1 now" in out, out
    assert f"CPU vector instructions {rec['segments'][0]['cpu_capability']} then" in out, out


def test_a_folder_without_a_record_is_refused_in_one_line(trained, tmp_path, capsys):
    run, _ = trained
    old = tmp_path / "old_run"
    shutil.copytree(run, old)
    (old / RECORD).unlink()
    assert main([str(old)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no run.json" in err and "Traceback" not in err, err


def test_a_fine_tune_without_its_base_is_refused(trained, tmp_path, capsys):
    run, _ = trained
    ft = tmp_path / "ft"
    shutil.copytree(run, ft)
    cfg = (ft / "config.yaml").read_text().replace("pretrained: null", f"pretrained: {tmp_path / 'gone' / 'model.pt'}")
    (ft / "config.yaml").write_text(cfg)
    assert main([str(ft)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "which is missing" in err, err
    assert main([str(run), "--steps", "0"]) == 2 and "--steps" in capsys.readouterr().err


def test_a_resume_adds_a_segment_and_may_change_the_count(tmp_path):
    "Stopped at step 3 on one thread, resumed on two: two entries, the second saying from what count it changed."
    from powerclip.config import load_config
    from powerclip.train import train
    before = torch.get_num_threads()
    kw = dict(out_dir=str(tmp_path / "run"), progress=False, tensorboard=False)
    train(load_config("smoke", dict(kw, stop_at=3, threads=1), "clip"))
    train(load_config("smoke", dict(kw, threads=2), "clip"))
    assert torch.get_num_threads() == before                               # the count put back after each run
    record = json.loads((tmp_path / "run" / RECORD).read_text())
    segs = record["segments"]
    assert [(s["from_step"], s["threads"]) for s in segs] == [(0, 1), (3, 2)]
    assert segs[1]["threads_changed_from"] == 1 and record["threads"] == [1, 2]
