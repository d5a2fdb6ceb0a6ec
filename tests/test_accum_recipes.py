"""The README's recipes for the paper's batch on fewer GPUs (issue 32) are what `benchmarks/accum_recipes.py` computes
from the committed bytes (`benchmarks/results/paper_memory.json`), and the script refuses bad input with one line."""
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
    # with checkpointing (the preset's): none on >= 2 GPUs of 24 GB or one of 48 / 80 GB, 2 on one 24 GB GPU
    assert all(_k(recipes, ckpt=True, card=c, gpus=g) == 1 for c in ("24 GB", "48 GB", "80 GB") for g in (2, 4, 8))
    assert _k(recipes, ckpt=True, card="48 GB", gpus=1) == _k(recipes, ckpt=True, card="80 GB", gpus=1) == 1
    assert _k(recipes, ckpt=True, card="24 GB", gpus=1) == 2
    assert "`accum_steps=2` on a single 24 GB GPU" in text
    # without: 2 / 4 / 8 / 16 on 8 / 4 / 2 / 1 GPUs of 80 GB, twice at 48 GB, four times at 24 GB
    for g, k in {8: 2, 4: 4, 2: 8, 1: 16}.items():
        assert (_k(recipes, card="80 GB", gpus=g), _k(recipes, card="48 GB", gpus=g),
                _k(recipes, card="24 GB", gpus=g)) == (k, 2 * k, 4 * k), g
    assert "`accum_steps` 2 / 4 / 8 / 16 on 8 / 4 / 2 / 1 GPUs of 80 GB, twice that at 48 GB and four times" in text
    # CLIP's 32k on 8 x 80 GB: none with checkpointing, 16 without
    assert (_k(recipes, "clip", ckpt=True), _k(recipes, "clip", ckpt=False)) == (1, 16)
    assert "with checkpointing and no accumulation, or with `accum_steps=16` without" in text


def test_accum_recipes_bad_input_is_one_line(tmp_path):
    bad = tmp_path / "paper_memory.json"
    for content, says in ((None, "is missing"), ("{", "is not paper_memory.py's output")):
        if content is not None:
            bad.write_text(content)
        p = subprocess.run([sys.executable, str(SCRIPT), "--memory", str(bad), "--out", str(tmp_path)],
                           capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert p.returncode == 2 and says in p.stderr and "Traceback" not in p.stderr, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr
