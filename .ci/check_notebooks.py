"""CI guard: the three forms of each notebook agree.

1. every `nbs/NAME.ipynb` has its jupytext twin `nbs/scripts/NAME.py` (and back), with the same cells;
2. the notebooks are clean (`nbdev_clean` would change nothing);
3. the package is exported (`nbdev_export` would change nothing in `powerclip/`);
4. reading order is dependency order: a notebook imports (in any cell, exported or not) only names that a
   lower-numbered notebook, or itself, exports;
5. the package's lines are at most 120 characters long, like the notebooks' code that ruff checks (ruff.toml), the
   lines nbdev writes itself included: a module's docstring is its notebook's `> subtitle`.
Checks 2 and 3 run on copies, so the working tree is never modified.
"""
import ast, filecmp, re, shutil, subprocess, sys, tempfile
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
        skip = shutil.ignore_patterns(".venv", ".git", "_docs", "_proc", "_site", "runs", "outputs", "__pycache__",
                                      ".pytest_cache", ".ruff_cache")
        shutil.copytree(ROOT, work, ignore=skip)
        subprocess.run([BIN / "nbdev_clean"], cwd=work, check=True)
        errs += [f"nbs/{p}: not clean (run `nbdev_clean`)" for p in dirs_differ(NBS, work / "nbs", "*.ipynb")]
        subprocess.run([BIN / "nbdev_export"], cwd=work, check=True)
        errs += [f"powerclip/{p}: out of date with the notebooks (run `nbdev_export`)"
                 for p in dirs_differ(LIB, work / "powerclip", "**/*.py")]
    return errs


def _number(stem: str) -> tuple:
    "'45_c2lip' -> (45, ''), '10a_fast' -> (10, 'a'): the reading-order key of a notebook."
    m = re.match(r"(\d+)([a-z]?)_", stem)
    return (int(m.group(1)), m.group(2)) if m else (10**6, stem)


def check_import_order():
    """Every `from powerclip.X import a, b` / `import powerclip.X` in a notebook names things exported by
    notebooks that come before it in reading order (or by itself)."""
    nbs = sorted(NBS.glob("[0-9]*.ipynb"))
    module_of, defined_in, module_nbs = {}, {}, {}
    parsed = {}
    for f in nbs:
        nb = jupytext.read(f)
        parsed[f.stem] = nb
        mod = None
        for c in nb.cells:
            m = re.search(r"^#\|\s*default_exp\s+(\S+)", c.source, re.M)
            if c.cell_type == "code" and m:
                mod = "powerclip." + m.group(1)
        if mod is None:
            continue
        module_of[f.stem] = mod
        module_nbs.setdefault(mod, []).append(f.stem)
        for c in nb.cells:
            if c.cell_type != "code" or not re.search(r"^#\|\s*export", c.source, re.M):
                continue
            try:
                tree = ast.parse(c.source)
            except SyntaxError:
                continue
            for node in tree.body:
                names = []
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names = [node.name]
                elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    names = [t.id for t in targets if isinstance(t, ast.Name)]
                for n in names:
                    defined_in.setdefault((mod, n), f.stem)
    errs = []
    for stem, nb in parsed.items():
        me = _number(stem)
        for c in nb.cells:
            if c.cell_type != "code":
                continue
            src = "\n".join(l for l in c.source.splitlines() if not l.lstrip().startswith(("%", "!")))
            try:
                tree = ast.parse(src)
            except SyntaxError:
                continue
            for node in ast.walk(tree):
                deps = []
                if (isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("powerclip")
                    and node.level == 0):
                    if node.module == "powerclip":   # from powerclip import dist
                        deps = [(f"powerclip.{a.name}", None) for a in node.names]
                    else:
                        deps = [(node.module, a.name) for a in node.names]
                elif isinstance(node, ast.Import):
                    deps = [(a.name, None) for a in node.names if a.name.startswith("powerclip.")]
                for mod, name in deps:
                    if mod not in module_nbs:
                        continue   # a subpackage or a module no notebook exports
                    src_nb = defined_in.get((mod, name)) if name else None
                    owners = [src_nb] if src_nb else module_nbs[mod]
                    if module_of.get(stem) == mod:
                        continue   # a module's own notebooks may use each other
                    late = [o for o in owners if _number(o) >= me]
                    if late and (src_nb or all(_number(o) >= me for o in owners)):
                        what = f"{mod}.{name}" if name else mod
                        errs.append(f"nbs/{stem}: imports {what} from {late[0]}, which comes later in reading order")
    return sorted(set(errs))


LINE_LENGTH = 120


def check_line_lengths():
    """Lines of `powerclip/` over LINE_LENGTH characters. Exempt: nbdev's index `_modidx.py`, and nbdev's `__all__`
    line, which it wraps at 120 characters before it puts `__all__ = ` in front (and writes on one line for a module
    that several notebooks export into, `theory`)."""
    errs = []
    for p in sorted(LIB.glob("**/*.py")):
        if p.name == "_modidx.py":
            continue
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            if len(line) > LINE_LENGTH and not line.startswith("__all__ = "):
                why = "a notebook's `> subtitle` is at most 114 characters" if i == 1 else "see `ruff check`"
                errs.append(f"{p.relative_to(ROOT)}:{i}: {len(line)} characters, more than {LINE_LENGTH} ({why})")
    return errs


if __name__ == "__main__":
    errs = check_pairs() + check_import_order() + check_clean_and_export() + check_line_lengths()
    for e in errs:
        print("FAIL", e)
    n = len(list(NBS.glob("*.ipynb")))
    print(f"check_notebooks: {n} notebooks, {len(errs)} problems")
    sys.exit(1 if errs else 0)
