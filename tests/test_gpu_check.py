"""`make gpu-check` (benchmarks/gpu_check.py) without a GPU: one line and exit status 2; with `--dry-run`, the parts
run on the CPU at toy sizes, write their results, are kept on a second run and redone with `--force`, and the table
at the end names the device. (Its argument mistakes are in tests/test_cli.py's table.) The parity and memory parts
run here by default (about a minute); every part, the comparison included, with POWERCLIP_SLOW=1 (several minutes).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")
slow = pytest.mark.skipif(not os.environ.get("POWERCLIP_SLOW"), reason="several minutes: POWERCLIP_SLOW=1 runs it")


def _run(*args, timeout=900):
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1", "POWERCLIP_DEBUG": ""})


@NO_GPU
def test_without_a_gpu_one_line_and_status_2():
    r = _run()
    assert r.returncode == 2 and r.stdout == "", r.stderr[-2000:]
    lines = r.stderr.splitlines()
    assert (len(lines) == 1 and lines[0].startswith("gpu_check.py: error: --device: no CUDA GPU here")
            and "--dry-run" in lines[0])


def test_device_slug():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_check import slug
    assert (slug("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3"
            and slug("Tesla V100-SXM2-32GB") == "tesla_v100_sxm2_32gb")


def _check_parts(out: Path, parts):
    for p in parts:
        d = json.loads((out / f"{p}.json").read_text())
        assert d["meta"]["dry_run"] and d["meta"]["device"] == "CPU (dry run)" and d["headline"]
        assert (out / f"{p}.md").read_text().startswith(f"# gpu-check {p}: CPU (dry run)")


def test_dry_run_parts_resume_and_force(tmp_path):
    out, parts = tmp_path / "gpu", ["parity", "memory"]
    r = _run("--dry-run", "--parts", *parts, "--methods", "clip", "powerclip", "--out", str(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    _check_parts(out, parts)
    assert "# gpu-check: CPU (dry run)" in r.stdout and "| parity | done" in r.stdout and "| memory | done" in r.stdout
    rows = json.loads((out / "parity.json").read_text())["rows"]
    assert {(x["kind"], x["what"]) for x in rows if x["kind"] == "loss"} == {("loss", "clip"), ("loss", "powerclip")}
    assert all(x["ok"] for x in rows if x["precision"] == "fp32")                    # fp32 on the CPU: to rounding
    assert any(x["what"].startswith("exact") for x in rows) and any("[fast]" in x["what"] for x in rows)
    assert (out / "summary.md").read_text().splitlines()[0] == "# gpu-check: CPU (dry run)"
    # a second run keeps what is there; --force redoes it
    before = (out / "memory.json").stat().st_mtime_ns
    r = _run("--dry-run", "--parts", "memory", "--out", str(out))
    assert r.returncode == 0 and "| memory | kept" in r.stdout and (out / "memory.json").stat().st_mtime_ns == before
    r = _run("--dry-run", "--parts", "memory", "--force", "--out", str(out))
    assert r.returncode == 0 and "| memory | done" in r.stdout and (out / "memory.json").stat().st_mtime_ns != before


def test_a_part_over_its_time_is_stopped_and_resumable(tmp_path):
    out = tmp_path / "gpu"
    r = _run("--dry-run", "--parts", "memory", "--part-timeout", "2", "--out", str(out))
    assert r.returncode == 1 and "timed out after 2 s (run again to continue)" in r.stdout
    assert not (out / "memory.json").exists()


@slow
def test_dry_run_every_part(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_check import PARTS
    out = tmp_path / "gpu"
    r = _run("--dry-run", "--methods", "clip", "powerclip", "--out", str(out), "--runs-dir",
             str(tmp_path / "runs"), timeout=3600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    _check_parts(out, PARTS)
