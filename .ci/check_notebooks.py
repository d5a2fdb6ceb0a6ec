"""CI guard: the three forms of each notebook agree.

1. every `nbs/NAME.ipynb` has its jupytext twin `nbs/scripts/NAME.py` (and back), with the same cells;
2. the notebooks are clean (`nbdev_clean` would change nothing);
3. the package is exported (`nbdev_export` would change nothing in `powerclip/`).
Checks 2 and 3 run on copies, so the working tree is never modified.
"""
import filecmp, shutil, subprocess, sys, tempfile
from pathlib import Path

import jupytext

ROOT = Path(__file__).resolve().parents[1]
NBS, SCRIPTS, LIB = ROOT / "nbs", ROOT / "nbs" / "scripts", ROOT / "powerclip"
BIN = Path(sys.executable).parent


def cells(nb):
    "(type, source) of each non-empty cell: what both forms must share."
    return [(c.cell_type, c.source.strip()) for c in nb.cells if c.source.strip()]


def check_pairs():
    errs = []
    nbs = {p.stem for p in NBS.glob("*.ipynb")}
    pys = {p.stem for p in SCRIPTS.glob("*.py")}
    for s in sorted(nbs ^ pys):
        errs.append(f"{s}: has only one of nbs/{s}.ipynb and nbs/scripts/{s}.py (run `make sync`)")
    for s in sorted(nbs & pys):
        a, b = cells(jupytext.read(NBS / f"{s}.ipynb")), cells(jupytext.read(SCRIPTS / f"{s}.py"))
        if a != b:
            i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            errs.append(f"{s}: notebook and script differ from cell {i} on (run `make sync`)")
    return errs


def dirs_differ(a, b, pattern):
    out = []
    for p in sorted(Path(a).glob(pattern)):
        q = Path(b) / p.relative_to(a)
        if not q.exists() or not filecmp.cmp(p, q, shallow=False):
            out.append(str(p.relative_to(a)))
    for q in sorted(Path(b).glob(pattern)):
        if not (Path(a) / q.relative_to(b)).exists():
            out.append(str(q.relative_to(b)) + " (new)")
    return out


def check_clean_and_export():
    errs = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "repo"
        shutil.copytree(ROOT, work, ignore=shutil.ignore_patterns(".venv", ".git", "_docs", "_proc", "runs", "outputs"))
        subprocess.run([BIN / "nbdev_clean"], cwd=work, check=True)
        errs += [f"nbs/{p}: not clean (run `nbdev_clean`)" for p in dirs_differ(NBS, work / "nbs", "*.ipynb")]
        subprocess.run([BIN / "nbdev_export"], cwd=work, check=True)
        errs += [f"powerclip/{p}: out of date with the notebooks (run `nbdev_export`)"
                 for p in dirs_differ(LIB, work / "powerclip", "**/*.py")]
    return errs


if __name__ == "__main__":
    errs = check_pairs() + check_clean_and_export()
    for e in errs: print("FAIL", e)
    n = len(list(NBS.glob("*.ipynb")))
    print(f"check_notebooks: {n} notebooks, {len(errs)} problems")
    sys.exit(1 if errs else 0)
