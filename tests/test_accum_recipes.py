"""The README's recipes for the paper's batch on fewer GPUs (issue 32) are what `benchmarks/accum_recipes.py` computes
from the committed bytes (`benchmarks/results/paper_memory.json`: the towers' per sample as one H200 measured them,
issue 38), and the script refuses bad input with one line. `paper_memory.py --reproject` gives the committed
projection from the CPU's bytes without measuring: with `--device-bytes none` exactly the CPU's own projection."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "accum_recipes.py"
COMMITTED = ROOT / "benchmarks" / "results" / "accum_recipes.json"


def _k(recipes, method="powerclip", precision="bf16", ckpt=False, card="80 GB", gpus=8):
    return next(r["k"] for r in recipes if (r["method"], r["precision"], r["checkpointing"], r["card"], r["gpus"])
                == (method, precision, ckpt, card, gpus))


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    out = tmp_path_factory.mktemp("recipes")
    p = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True, cwd=ROOT,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads((out / "accum_recipes.json").read_text())["recipes"]


def test_accum_recipes_reproduce_the_committed_table(fresh):
    committed = json.loads(COMMITTED.read_text())["recipes"]
    key = lambda r: (r["method"], r["precision"], r["checkpointing"], r["card"], r["gpus"])
    assert {key(r): r["k"] for r in fresh} == {key(r): r["k"] for r in committed}


def test_readme_recipes_are_the_table():
    "Each number of the README's training paragraph, read from the committed table."
    recipes = json.loads(COMMITTED.read_text())["recipes"]
    text = " ".join((ROOT / "README.md").read_text().split())
    # with checkpointing (the preset's), from the towers' bytes one H200 measured (8.7 MiB per sample in bf16): none on
    # >= 4 GPUs of 24 GB or on any number of 48 / 80 GB, 2 on two 24 GB GPUs, 4 on one
    assert all(_k(recipes, ckpt=True, card=c, gpus=g) == 1 for c in ("48 GB", "80 GB") for g in (1, 2, 4, 8))
    assert all(_k(recipes, ckpt=True, card="24 GB", gpus=g) == 1 for g in (4, 8))
    assert (_k(recipes, ckpt=True, card="24 GB", gpus=2), _k(recipes, ckpt=True, card="24 GB", gpus=1)) == (2, 4)
    assert ("no accumulation on 4 or more GPUs of 24 GB or on one of 48 or 80 GB, `accum_steps=2` on two 24 GB GPUs "
            "and `accum_steps=4` on a single one") in text
    assert {r["towers_from"] for r in recipes} == {"NVIDIA H200"}        # every setting's bytes: the H200 measured them
    # without: 2 / 4 / 8 / 16 on 8 / 4 / 2 / 1 GPUs of 80 GB, twice at 48 GB, four times at 24 GB
    for g, k in {8: 2, 4: 4, 2: 8, 1: 16}.items():
        assert (_k(recipes, card="80 GB", gpus=g), _k(recipes, card="48 GB", gpus=g),
                _k(recipes, card="24 GB", gpus=g)) == (k, 2 * k, 4 * k), g
    assert "`accum_steps` 2 / 4 / 8 / 16 on 8 / 4 / 2 / 1 GPUs of 80 GB, twice that at 48 GB and four times" in text
    # CLIP's 32k on 8 x 80 GB: none with checkpointing, 16 without
    assert (_k(recipes, "clip", ckpt=True), _k(recipes, "clip", ckpt=False)) == (1, 16)
    assert "with checkpointing and no accumulation, or with `accum_steps=16` without" in text


def test_paper_memory_reprojects_without_measuring(tmp_path):
    """The committed projection again from its own CPU bytes (seconds, nothing measured): with the H200's towers it is
    the committed table; with none, the CPU's alone, as the H200's check printed beside it (largest local batch in bf16
    with checkpointing, M = 10: 7,629 from the CPU's 7.6 MiB per sample, 6,896 from the H200's 8.7)."""
    committed = json.loads((ROOT / "benchmarks" / "results" / "paper_memory.json").read_text())
    for extra, want in (([], 6896), (["--device-bytes", "none"], 7629)):
        out = tmp_path / (extra[-1] if extra else "h200")
        p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "paper_memory.py"), "--reproject",
                            str(ROOT / "benchmarks" / "results" / "paper_memory.json"), "--out", str(out), *extra],
                           capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        rows = json.loads((out / "paper_memory.json").read_text())["rows"]
        row = next(r for r in rows if (r["precision"], r["checkpointing"], r["M"]) == ("bf16", True, 10))
        assert row["max_local_batch"] == want, row
        if not extra:
            assert [r["max_local_batch"] for r in rows] == [r["max_local_batch"] for r in committed["rows"]]
            assert row["towers_from"] == "NVIDIA H200" and abs(row["towers_mib_per_sample_cpu"] - 7.6) < 0.05


def test_accum_recipes_bad_input_is_one_line(tmp_path):
    bad = tmp_path / "paper_memory.json"
    for content, says in ((None, "is missing"), ("{", "is not paper_memory.py's output")):
        if content is not None:
            bad.write_text(content)
        p = subprocess.run([sys.executable, str(SCRIPT), "--memory", str(bad), "--out", str(tmp_path)],
                           capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert p.returncode == 2 and says in p.stderr and "Traceback" not in p.stderr, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr
