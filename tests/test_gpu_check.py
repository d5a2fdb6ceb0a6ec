"""`benchmarks/gpu_check.py` without a GPU: one line and exit status 2; with `--dry-run`, the parts run on the CPU at
toy sizes inside `--budget`, each unit recorded the moment it is done, the results folder small (summary.md,
results.json, the log), a second run continues where the first stopped; a part cut by its share of the budget, or
by a kill of the driver (SIGTERM or SIGKILL), leaves no process running and what it finished marked complete or
partial. (Its argument mistakes are in tests/test_cli.py's table.) Minutes on 2 busy cores; the issue's whole
command (`--dry-run --budget 180`, every part, each complete or deferred by the budget) with POWERCLIP_SLOW=1.
"""
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from argparse import Namespace
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")
slow = pytest.mark.skipif(not os.environ.get("POWERCLIP_SLOW"), reason="minutes: POWERCLIP_SLOW=1 runs it")
sys.path.insert(0, str(ROOT / "benchmarks"))


def _env(marker=""):
    # without Triton's interpreter (tests/conftest.py sets it): the dry run skips the triton rows, saying why
    return {**os.environ, "OMP_NUM_THREADS": "1", "POWERCLIP_DEBUG": "", "GPU_CHECK_TEST_MARKER": marker,
            "TRITON_INTERPRET": "0"}


def _run(*args, timeout=900):
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=_env())


def _marked(marker: str) -> list[int]:
    "Every process whose environment holds `marker` (the driver, its parts, the guards, whatever they started)."
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if f"GPU_CHECK_TEST_MARKER={marker}".encode() in (d / "environ").read_bytes().split(b"\0"):
                pids.append(int(d.name))
        except OSError:          # gone meanwhile, or not ours to read
            continue
    return pids


def _results(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())


@NO_GPU
def test_without_a_gpu_one_line_and_status_2():
    r = _run()
    assert r.returncode == 2 and r.stdout == "", r.stderr[-2000:]
    lines = r.stderr.splitlines()
    assert (len(lines) == 1 and lines[0].startswith("gpu_check.py: error: --device: no CUDA GPU here")
            and "--dry-run" in lines[0])


def test_device_slug():
    from gpu_check import slug
    assert (slug("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3"
            and slug("Tesla V100-SXM2-32GB") == "tesla_v100_sxm2_32gb")


def test_parts_in_order_of_value():
    "Issue 38's order; the compiled half of step-C4096 where the budget allows, the comparison last."
    from gpu_check import PARTS
    assert PARTS == ("parity", "step-C4096", "step-B512", "compile", "paths-Kcc3m", "step-B256", "steps-other",
                     "real-shards", "memory", "ddp", "accum", "paths-K16", "compile-C4096", "compare")


def test_plan_against_the_h200_timings(tmp_path):
    """`--plan --budget 600` prints every part with its seconds, without importing torch: each from the H200's
    timings file (its units times their seconds, said measured / extrapolated / estimate as the file says), the parts
    that fit run in order and the others are deferred; units recorded in the state folder cost nothing."""
    import gpu_plan
    tm = gpu_plan.load_timings()
    # torch imported by the plan would fail: a `torch` that raises on import stands first on the path
    fake = tmp_path / "no_torch"
    fake.mkdir()
    (fake / "torch.py").write_text("raise ImportError('the plan imported torch')\n")
    r = subprocess.run([sys.executable, str(SCRIPT), "--plan", "--budget", "600"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60, env={**_env(), "PYTHONPATH": str(fake)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.splitlines()[1].startswith("  limits: peak of NVIDIA H200 (H200 SXM): 989.4 TFLOP/s bf16")
    lines = {ln.split()[0]: ln for ln in r.stdout.splitlines()[2:-1]}
    assert list(lines) == list(gpu_plan.PARTS), r.stdout
    left = 600 - min(10.0, 0.05 * 600) - tm["startup_s"]["seconds"]
    deferred = []
    for part, line in lines.items():
        keys = gpu_plan.unit_keys(part)
        want = sum(gpu_plan.unit_seconds(tm, part, k) for k in keys)
        seconds = float(line.split()[1])
        assert line.split()[2] == "s" and abs(seconds - want) <= 0.5, line
        assert f"{tm['parts'][part]['basis']}: " in line and f"({len(keys)} unit(s))" in line, line
        if gpu_plan.fits(part, want, left):
            left -= min(want, left)
            assert " runs " in line or " partly " in line, line
        else:
            deferred.append(part)
            assert "DEFERRED" in line, line
    assert r.stdout.splitlines()[-1].endswith("deferred: " + ", ".join(deferred))
    # the measured parts are the H200's seconds of 2026-11-28 (each part's units in one process): step-B512 16.9 s,
    # memory 28.4 s; step-C4096 and real-shards measured there, compare never
    assert abs(float(lines["step-B512"].split()[1]) - 16.9) <= 0.5 and abs(float(lines["memory"].split()[1]) - 28.4) < 1
    assert {p for p, t in tm["parts"].items() if t["basis"] == "estimate"} >= {"compare"}
    assert {p for p, t in tm["parts"].items() if t["basis"] == "measured"} >= {"parity", "step-C4096", "paths-Kcc3m",
                                                                              "paths-K16", "real-shards", "compile"}
    # a unit recorded in the state folder is done
    (tmp_path / "step-B512.jsonl").write_text(json.dumps(dict(key="clip", value={}, seconds=30)) + "\n")
    r = subprocess.run([sys.executable, str(SCRIPT), "--plan", "--budget", "600", "--state", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60, env=_env())
    line = next(ln for ln in r.stdout.splitlines() if ln.split()[0] == "step-B512")
    assert "1 of 2 unit(s) left" in line and abs(float(line.split()[1]) - 8.45) <= 0.5, line


def test_the_plan_and_the_run_have_the_same_units():
    "Each part's units as the worker builds them (dry run) are the plan's, in the same order; the methods agree."
    import gpu_check
    import gpu_plan
    from powerclip.methods import METHODS, _import_baselines
    _import_baselines()
    assert gpu_plan.registered_methods() == sorted(m for m in METHODS if not m.startswith("_"))
    a = Namespace(dry_run=True, device="cpu", methods=None, parity_batch=8, compile_backend="aot_eager",
                  compile_steps=1, state=Path("/nonexistent"), real_shards=Path("/nonexistent"), real_seconds=1,
                  runs_dir=None, compare_steps=1, compare_seeds=[0])
    for part in gpu_plan.PARTS:
        if part in ("ddp", "memory", "compare", "real-shards"):
            continue                                            # need a state folder; checked by the dry runs
        assert [k for k, _ in gpu_check._units(a, part)] == gpu_plan.unit_keys(part), part


def test_headline_parts_resume_and_force(tmp_path):
    out, state = tmp_path / "out", tmp_path / "state"
    args = ["--dry-run", "--budget", "600", "--parts", "parity", "step-B256", "--methods", "clip", "powerclip",
            "--out", str(out), "--state", str(state)]
    r = _run(*args)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.log", "results.json", "summary.md"]
    d = _results(out)
    assert d["meta"]["dry_run"] and d["env"]["device"] == "CPU (dry run)" and d["env"]["torch"] == torch.__version__
    assert {p: d["parts"][p]["status"] for p in ("parity", "step-B256")} == {"parity": "complete",
                                                                             "step-B256": "complete"}
    loss = d["parts"]["parity"]["results"]["loss"]
    assert {"clip", "powerclip", "powerclip:impl=dense", "powerclip:impl=fast"} <= set(loss)
    assert all(loss[m]["fp32"]["ok"] for m in loss)                              # fp32 on the CPU: to rounding
    steps = d["parts"]["step-B256"]["results"]
    assert set(steps) == {"clip", "powerclip"} and all(steps[m]["ms_per_step"] > 0 for m in steps)
    assert steps["clip"]["time_ratio"] == 1 and steps["powerclip"]["time_ratio"] > 0
    summary = (out / "summary.md").read_text()
    assert summary.startswith("# gpu-check: CPU (dry run)") and "| parity | complete |" in summary
    assert (state / "parity.jsonl").is_file() and (state / "status.json").is_file()
    # the same command again: everything is kept, nothing measured again
    before = (state / "step-B256.jsonl").read_text()
    r = _run(*args)
    assert r.returncode == 0 and "step-B256: complete in an earlier run, kept" in r.stdout
    assert (state / "step-B256.jsonl").read_text() == before
    r = _run(*args[:4], *args[5:], "--force")                  # --parts step-B256 --force
    assert r.returncode == 0 and (state / "step-B256.jsonl").read_text() != before, r.stdout[-2000:]
    assert {"parity", "step-B256"} <= set(_results(out)["parts"])       # what an earlier job measured stays


def test_targets_are_judged_only_under_their_conditions():
    """PowerCLIP <= 1.10x CLIP and its whole peak within 80 GB are the targets of step-C4096 (512 local, C = 4096,
    eager): judged there, in GiB, only where a peak was measured (90 GiB NOT met, 60 GiB met, a CPU's NaN not
    measured); step-B512 (C = R) states its ratio and conditions and judges nothing. Every headline names its
    conditions."""
    import gpu_check_parts as P

    def values(gib, ratio=1.05):
        r = dict(ms_per_step=100.0, images_per_s=5120.0, peak_mib=1000.0, peak_total_mib=40 * 1024.0,
                 peak_reserved_mib=2000.0, spread=1.1)
        return {"clip": r, "powerclip": dict(r, ms_per_step=100.0 * ratio, peak_total_mib=gib * 1024)}

    a = Namespace(dry_run=False, device="cuda")
    over, under, cpu = (P.report_step(a, values(g), "step-C4096") for g in (90.0, 60.0, float("nan")))
    assert over["ok"] is False and "whole peak 90.0 GiB (target <= 79.6 GiB: NOT met)" in over["headline"], over
    assert under["ok"] is True and "whole peak 60.0 GiB (target <= 79.6 GiB: met)" in under["headline"], under
    assert cpu["ok"] is True and "whole peak not measured" in cpu["headline"], cpu["headline"]
    slow = P.report_step(a, values(60.0, 1.39), "step-C4096")
    assert slow["ok"] is False and "target <= 1.10x: NOT met" in slow["headline"]
    for h in (under["headline"], slow["headline"]):
        assert "C = 4096 against R = 512 (7 simulated peers, CC3M node counts)" in h and "eager" in h, h
        assert "class-token pooling" in h and "median of 8 timed steps" in h, h
    b512 = P.report_step(a, values(90.0, 1.2), "step-B512")
    assert b512["ok"] is None and "no target here" in b512["headline"] and "C = 512 against R = 512" in b512["headline"]
    assert "world captions <= 6 nodes" in b512["headline"]


def test_loss_syncs_are_reported_under_the_debug_mode():
    """The parity part's PowerCLIP rows carry one loss call's host syncs under `torch.cuda.set_sync_debug_mode("error")`
    (issue 37): off CUDA the call is not made ("-", the simulated device of tests/cuda_sim.py counts them instead);
    on a GPU the report lists each call and the headline counts those that made none. The debug mode itself needs a
    GPU: this checks the reading of its rows."""
    import gpu_check_parts as P
    assert P.loss_syncs(None, {}, {}, "cpu", False) == "-"
    row = dict(kind="loss", precision="fp32", value_err=1e-7, grad_err=1e-6, terms={}, ok=True)
    rows = [dict(row, what="powerclip", syncs="none"), dict(row, what="powerclip:impl=triton", syncs="none"),
            dict(row, what="powerclip:masks=gold", syncs="called a synchronizing CUDA operation"),
            dict(row, what="clip")]
    r = P.report_parity(Namespace(parity_batch=8), {"loss": rows})
    assert "loss syncs: 2 of 3 calls make none" in r["headline"], r["headline"]
    assert "- powerclip:masks=gold fp32: called a synchronizing CUDA operation" in r["md"], r["md"]
    cpu = P.report_parity(Namespace(parity_batch=8), {"loss": [dict(row, what="powerclip", syncs="-")]})
    assert "syncs" not in cpu["headline"] and not any("sync_debug_mode" in x for x in cpu["md"])


def test_simulated_peers_deliver_what_ddp_would():
    """The step-C4096 stand-in for `gather`: this process's rows (with gradient) then 7 peers' (detached), each peer's
    captions with CC3M node counts (`node_text` counted from 0 per peer, PowerCLIP's `facts`), C = 8 R."""
    import train_step_ratio as T
    from powerclip.dist import DistContext
    R, M, D = 4, 3, 8
    counts = T.cc3m_counts(7 * R)
    assert 1 <= min(counts) and max(counts) <= 39
    peers = T.SimulatedPeers(7, counts)
    x = {"image": torch.randn(R, D, requires_grad=True), "regions": torch.randn(R, M, D),
         "region_valid": torch.ones(R, M, dtype=torch.bool), "phrases": torch.randn(10, D),
         "node_text": torch.tensor([0, 0, 1, 1, 1, 2, 2, 3, 3, 3]), "facts": torch.tensor([[2, M], [3, M], [2, M],
                                                                                              [3, M]])}
    g = peers(DistContext(), x)
    assert g.offset == 0 and g.all["image"].shape == (8 * R, D) and g.rows["image"] == [R] * 8
    assert g.all["image"].requires_grad and torch.equal(g.all["image"][:R], x["image"])
    assert g.rows["phrases"] == g.rows["node_text"] and sum(g.rows["phrases"]) == g.all["phrases"].shape[0]
    assert g.rows["phrases"][1:] == [sum(counts[p * R:(p + 1) * R]) for p in range(7)]
    assert torch.equal(g.all["facts"][R:, 0], torch.tensor(counts)) and (g.all["facts"][R:, 1] == M).all()
    assert torch.equal(g.all["node_text"][10:10 + counts[0]], torch.zeros(counts[0], dtype=torch.long))
    assert g.all["region_valid"].all() and peers.context(DistContext()).world_size == 8
    assert peers(DistContext(), x).all["regions"][R:].data_ptr() != 0           # drawn once, kept: the same rows
    assert torch.equal(peers(DistContext(), x).all["regions"][R:], g.all["regions"][R:])


@NO_GPU
def test_new_parts_dry_run(tmp_path):
    """The new parts' code at toy sizes: step-C4096 (7 simulated peers), the S-bar parity's triton rows skipped with
    the reason (no Triton interpreter here), real-shards skipped with one line naming `make real-shards` when the
    shards are absent, and FLAIR's step in steps-other (the shared batches carry its K sub-captions)."""
    out = tmp_path / "out"
    r = _run("--dry-run", "--budget", "600", "--parts", "step-C4096", "steps-other", "real-shards", "--methods", "clip",
             "powerclip", "flair", "--out", str(out), "--state", str(tmp_path / "state"), "--real-shards",
             str(tmp_path / "none"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    d = _results(out)["parts"]
    c = d["step-C4096"]["results"]
    assert set(c) == {"clip", "powerclip"} and c["powerclip"]["columns"] == 64 and c["powerclip"]["peers"] == 7
    assert d["steps-other"]["status"] == "complete" and d["steps-other"]["results"]["flair"]["ms_per_step"] > 0
    assert "C = 64 against R = 8 (7 simulated peers" in d["step-C4096"]["headline"]
    assert d["real-shards"]["headline"].startswith("skipped: no shards in") and "make real-shards" in \
        d["real-shards"]["headline"]


def test_a_part_past_its_share_is_stopped_whole(tmp_path):
    """The driver's `_worker` with 2 seconds for the comparison (`--part-timeout`; it trains in a child process): the
    worker stops the part and kills what it started, nothing survives, and the part reads deferred (nothing done)."""
    import gpu_check
    marker = uuid.uuid4().hex
    a = Namespace(argv=["--dry-run", "--parts", "compare", "--runs-dir", str(tmp_path / "runs")], out=tmp_path / "out",
                  state=tmp_path / "state", device="cpu", part_timeout=2, parts=["compare"], dry_run=True, budget=600)
    a.out.mkdir()
    a.state.mkdir()
    old = os.environ.get("GPU_CHECK_TEST_MARKER")
    os.environ["GPU_CHECK_TEST_MARKER"] = marker
    try:
        with open(a.out / "gpu_check.log", "a") as log:
            ended = gpu_check._worker(a, ["compare"], time.time() + 600, log)
    finally:
        os.environ.pop("GPU_CHECK_TEST_MARKER")
        if old is not None:
            os.environ["GPU_CHECK_TEST_MARKER"] = old
    assert ended["compare"][0] == "deferred" and "cut by the budget" in ended["compare"][1], ended
    assert gpu_check._status(a)["compare"]["status"] == "deferred" and not gpu_check._values(a, "compare")
    time.sleep(1)
    assert _marked(marker) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_killed_driver_leaves_no_process(tmp_path, sig):
    """The whole dry run, its driver killed once a unit is recorded and a part runs (the driver, the part's guard and
    the part alive): no process of it is left, and every part that recorded a unit reads complete or partial."""
    out, marker = tmp_path / "out", uuid.uuid4().hex
    p = subprocess.Popen([sys.executable, str(SCRIPT), "--dry-run", "--budget", "900", "--out", str(out), "--state",
                          str(tmp_path / "state")], cwd=ROOT, env=_env(marker), start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.time()
    try:
        while time.time() - t0 < 240:
            done = (out / "results.json").is_file() and any(x["units_done"]
                                                            for x in _results(out)["parts"].values())
            marked = _marked(marker)
            if done and len(marked) >= 3:           # the driver, a part's guard, the part
                break
            assert p.poll() is None, "the dry run ended before it was killed"
            time.sleep(0.5)
        assert done and len(marked) >= 3, marked
        p.send_signal(sig)
        p.wait(timeout=60)
        deadline = time.time() + 30                 # SIGKILL: the guard sees the pipe close and kills the group
        while _marked(marker) and time.time() < deadline:
            time.sleep(0.5)
        assert _marked(marker) == []
    finally:
        for pid in _marked(marker):                 # a failed test leaves nothing behind either
            os.kill(pid, signal.SIGKILL)
    parts = _results(out)["parts"]
    started = {k: v for k, v in parts.items() if v["units_done"]}
    assert started and all(v["status"] in ("complete", "partial") for v in started.values()), parts
    if sig == signal.SIGTERM:
        assert any("stopped by a signal" in v["note"] for v in parts.values()), parts


COCO = ROOT.parent / "shared" / "data" / "coco_sample"


@NO_GPU
@pytest.mark.skipif(not (COCO / "captions.jsonl").is_file(), reason=f"shared data absent: {COCO}")
def test_real_shards_dry_run(tmp_path):
    """`make real-shards` in small: 40 COCO captions packed as img2dataset shards (`data_prep/pack_coco_sample.py`),
    annotated with spaCy trees and slic regions (`data_prep/annotate_shards.py`), then the dry run's real-shards part on
    them: the loader with 1, 4 and 8 workers and PowerCLIP's step fed by it, every unit recorded."""
    sys.path.insert(0, str(ROOT / "data_prep"))
    import pack_coco_sample as pack
    from data_prep.annotate_shards import AnnotateConfig, expand_inputs, run
    from powerclip.data import write_shard
    rows = pack.samples(COCO, 224, 70)[:40]
    raw, ann = tmp_path / "raw", tmp_path / "annotated"
    raw.mkdir()
    for s in range(8):
        write_shard(raw / f"{s:05d}.tar", rows[s::8])
    summary = run(expand_inputs([str(raw)]), AnnotateConfig(out=str(ann), regions="slic", parser="spacy"),
                  progress=False)
    assert (summary["written"], summary["n_bad"]) == (40, 0)
    out = tmp_path / "out"
    r = _run("--dry-run", "--budget", "600", "--parts", "real-shards", "--real-shards", str(ann), "--real-seconds", "5",
             "--out", str(out), "--state", str(tmp_path / "state"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    part = _results(out)["parts"]["real-shards"]
    res = part["results"]
    assert part["status"] == "complete" and set(res) == {"loader 1 workers", "loader 4 workers", "loader 8 workers",
                                                         "powerclip step fed by the loader"}, part
    assert res["loader 1 workers"]["images"] == 40 and res["loader 8 workers"]["images"] >= 32   # each worker: a batch
    assert res["powerclip step fed by the loader"]["steps"] >= 1 and 0 <= res["powerclip step fed by the loader"][
        "wait_share"] <= 1
    assert "loader 8 worker(s)" in part["headline"] and "waits for data" in part["headline"]


@slow
def test_the_issue_command(tmp_path):
    """`--dry-run --budget 180`: exit 0, at most 8 files; CLIP's and PowerCLIP's step against 4096
    simulated columns there (the worker's start-up takes 40-120 s of the 180 on 2 cores, so what else fits depends on
    the machine's load: each part is complete, or deferred with the seconds it needed)."""
    out = tmp_path / "out"
    r = _run("--dry-run", "--budget", "180", "--out", str(out), "--state", str(tmp_path / "state"), timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert 1 <= len(list(out.iterdir())) <= 8
    d = _results(out)
    assert {"clip", "powerclip"} <= set(d["parts"]["step-C4096"]["results"])
    assert all(v["status"] in ("complete", "partial", "deferred") for v in d["parts"].values())
    assert all("budget" in v["note"] for v in d["parts"].values() if v["status"] == "deferred")


def test_flop_counts_match_the_flop_counter():
    """The analytic counts of `benchmarks/gpu_limits.py` against `torch.utils.flop_counter.FlopCounterMode` on small
    shapes, on the CPU: the two towers of an open_clip ViT (forward, forward + backward, and with activation
    checkpointing: the blocks' forward once more), and the loss's products on the blocked path (the counter cannot see
    inside the Triton op): one process (one S-bar call) and gathered columns (two calls), ragged node counts,
    forward + backward = the useful products + the backward's recomputed scores + CLIP's logits."""
    from torch.utils.flop_counter import FlopCounterMode
    import gpu_limits as L
    from powerclip.loss import PowerCLIPLossConfig, powerclip_loss
    import powerset_scale as ps

    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.checkpoint import set_checkpoint_early_stop
    from powerclip.model import create_model

    def counted(fn):
        # PyTorch's math attention: the counter does not see inside the CPU's fused attention kernel
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
            fn()
        return fc.get_total_flops()
    model = create_model("powerclip-micro")[0]
    B = 3
    img, txt = torch.randn(B, 3, 32, 32), torch.randint(0, 1000, (B, 77))
    want = L.tower_flops(L.tower_shapes(model))

    def train():
        (model.encode_image(img).sum() + model.encode_text(txt).sum()).backward()
    assert counted(lambda: (model.encode_image(img), model.encode_text(txt))) == B * want["forward"]
    assert counted(train) == B * want["train"] < 3 * B * want["forward"]
    model.set_grad_checkpointing(True)
    with set_checkpoint_early_stop(False):                  # every checkpointed block's forward recomputed whole
        assert counted(train) == B * want["train_ckpt"]
    assert B * want["train"] < counted(train) <= B * want["train_ckpt"]       # torch's early stop: at most that
    vit = L.vit_b16_flops()             # ViT-B/16, 224 px: 17.6 + 3.0 G multiply-adds forward (open_clip's table)
    assert vit == L.tower_flops(L.tower_shapes(create_model("ViT-B-16", pool="tok")[0]))
    assert 35.0e9 < vit["image"] < 35.3e9 and 5.9e9 < vit["text"] < 6.0e9, vit
    for R, C in ((4, 4), (3, 7)):
        M, D = 3, 8
        counts = [1 + (i * 5) % 4 for i in range(C)]
        leaves, local, gathered, _ = ps._inputs(R, C, M, D, counts, "fast")
        cfg = PowerCLIPLossConfig(impl="fast", tau=0.1)
        g = None if R == C else gathered
        a_img, a_txt = (None, None) if R == C else (leaves["image_all"], leaves["text_all"])
        if R == C:
            for k in ("regions", "phrases"):
                leaves[k] = leaves[k + "_all"]
            local = gathered

        def step():
            out = powerclip_loss(leaves["image"] if R != C else leaves["image_all"],
                                 leaves["text"] if R != C else leaves["text_all"], torch.tensor(10.0), local, cfg,
                                 a_img, a_txt, g, 0)
            (out["clip"] + out["powerset"]).backward()
        f = L.loss_flops(R, C, M, D, counts)
        assert counted(step) == f["sbar_useful"] + f["sbar_recompute"] + f["clip"], (R, C, f)
        assert f["scores"] == (R * M * sum(counts) if R == C else R * M * sum(counts) + C * M * sum(counts[:R]))


def test_every_figure_beside_the_card_limit():
    """The table of peaks recognises the cards by `torch.cuda.get_device_name` (not their neighbours: A100 40GB, H100
    PCIe, A10G), and the reports put each time beside its fraction of that peak: the paths' useful TFLOP/s and % of
    peak with the 20th-80th percentiles, the steps' MFU from the towers' FLOPs; an unknown card gets no fraction and
    one line saying so."""
    import gpu_check_parts as P
    import gpu_limits as L
    names = {"NVIDIA H100 80GB HBM3": "H100 SXM", "NVIDIA H200": "H200 SXM", "NVIDIA A100-SXM4-80GB": "A100 SXM 80GB",
             "NVIDIA L40S": "L40S", "NVIDIA GeForce RTX 4090": "RTX 4090", "NVIDIA A10": "A10",
             "NVIDIA A100-SXM4-40GB": None, "NVIDIA H100 PCIe": None, "NVIDIA A10G": None, "CPU (dry run)": None}
    assert {n: (L.card(n) or {}).get("card") for n in names} == names
    assert all(p["source"] and p["tflops"] > 0 and p["gbs"] > 0 for p in L.PEAKS.values())
    assert L.limits_line("NVIDIA A10G").startswith("no fraction of peak: 'NVIDIA A10G' is not in the table")
    counts = [8] * 64
    f = L.loss_flops(16, 64, 10, 32, counts, local=False)
    row = dict(path="triton", M=10, R=16, C=64, dim=32, K_max=8, K_mean=8.0, node_counts="x", flops=f, ok=True,
               time_s=1e-3, p20_s=0.9e-3, p80_s=1.2e-3, peak_mib=10.0, block_mib=None)
    h200 = Namespace(dry_run=False, device="cuda", card="NVIDIA H200")
    r = P.report_paths(h200, {"M=10 triton": row})
    want = f["useful"] / 1e-3 / 989.4e12
    assert f"triton 1.0 ms ({100 * want:.1f} % of peak)" in r["headline"], r["headline"]
    assert any(f"| 10 | 8 | triton | 1.00 | 0.90-1.20 | {f['useful'] / 1e12:.3g} |" in x for x in r["md"]), r["md"]
    other = P.report_paths(Namespace(dry_run=False, device="cuda", card="NVIDIA A10G"), {"M=10 triton": row})
    assert "(- of peak)" in other["headline"] and "no fraction of peak: 'NVIDIA A10G'" in other["headline"]
    step = dict(ms_per_step=100.0, images_per_s=5120.0, peak_mib=1.0, peak_total_mib=1.0, peak_reserved_mib=1.0,
                spread=1.1, tower_flops=L.vit_b16_flops())
    s = P.report_step(h200, {"clip": step, "powerclip": dict(step, ms_per_step=110.0, images_per_s=5120 / 1.1)},
                      "step-B512")
    mfu = 5120 * L.vit_b16_flops()["train"] / 989.4e12
    assert f"clip 100 ms, 5120 images/s, MFU {100 * mfu:.1f} %" in s["headline"], s["headline"]
    assert s["results"]["clip"]["mfu"] == pytest.approx(mfu) and s["results"]["clip"]["mfu_ckpt"] > mfu
