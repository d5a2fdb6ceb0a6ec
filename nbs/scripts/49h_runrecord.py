# ---
# jupyter:
#   jupytext:
#     formats: nbs///ipynb,nbs/scripts///py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %%
#| default_exp runrecord

# %%
#| export
from __future__ import annotations

import contextlib, hashlib, json, os, platform, shlex, socket, subprocess, sys, time
from importlib import metadata
from pathlib import Path

import torch

# %%
#| hide
import tempfile
from fastcore.test import test_eq

# %% [markdown]
# # What made a run
#
# > `run.json`: the commit, the libraries, the thread count and the machine of every stretch of a run.
#
# A number is only checkable when one knows what made it. A run is bitwise equal to itself on the same machine at the
# same thread count (`50_train`, "Same command, same numbers?"), and parts from itself after a step or two at another
# count: a CPU matrix product splits its sums by thread, and float addition is not associative. So a run records, in
# `run.json` at the top of its folder (beside `config.yaml`) and in each of its checkpoints:
#
# - the **code**: the commit as its full 40 hex digits, whether the tree was dirty and a hash of the difference
#   (`git diff HEAD` and the untracked files' names and contents): two dirty runs with the same hash ran the same code;
# - the **libraries**: Python, torch, open_clip, NumPy, spaCy;
# - the **thread count read inside the training process** (`threads`, an integer): not the count of the process that
#   asked for the run, which is another process when a comparison trains in a spawned child (`16_measure`); the
#   config key `threads` sets it there (None: what the environment gives);
# - the **device** and its name (the GPU's, or the CPU's model), the number of processes, the command line, and a hash
#   of the host's name (which machine, without naming it);
# - the **CPU's vector instructions** torch dispatches to (`cpu_capability`: AVX512, AVX2, ...; on a GPU run too, for
#   its CPU-side work): a kernel with wider vectors sums in another order, and the same commit at the same thread count
#   parts from itself on a machine with other instructions. Virtual machines often name their CPU only "Intel(R)
#   Xeon(R) Processor", so the model alone does not tell; `71a_plateau` ("Why the two CLIP tables differ") shows a run
#   parting this way (`ATEN_CPU_CAPABILITY=avx2` on an AVX-512 machine).
#
# A resumed run adds one entry per segment (`segments`, each with the step it started from); a resume may change the
# thread count, and its entry then says from what (`threads_changed_from`). The top of `run.json` holds what every
# segment shares, and a list where segments differ. `python -m powerclip.reproduce RUN_DIR` (`72_reproduce`) retrains
# a run from this record and says where it parts; the comparison's tables list each run's record (`69a_report`).

# %%
#| export
RECORD = "run.json"
NOT_RECORDED = "not recorded"
# the libraries whose version changes what a run computes or how its data is read: name in the record -> distribution
LIBRARIES = {"torch": "torch", "open_clip": "open_clip_torch", "numpy": "numpy", "spacy": "spacy"}
FACTS = ("commit", "dirty", "diff_sha256", "threads", "versions", "device", "device_name", "cpu_capability",
         "world_size", "host_sha256")


def _git(root: Path, *args: str) -> bytes | None:
    "git's output in `root`, or None (no git, not a checkout)."
    try:
        r = subprocess.run(["git", "-C", str(root), *args], capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


def code_state(root=None) -> dict:
    """`commit` (40 hex digits), `dirty` and `diff_sha256` of the checkout holding the `powerclip` package (or
    `root`); `NOT_RECORDED` where it is not a git checkout (an installed package)."""
    root = Path(root) if root is not None else Path(__import__("powerclip").__file__).resolve().parent.parent
    head = _git(root, "rev-parse", "HEAD")
    if not head:
        return dict(commit=NOT_RECORDED, dirty=NOT_RECORDED, diff_sha256=NOT_RECORDED)
    status = _git(root, "status", "--porcelain") or b""
    h = hashlib.sha256(_git(root, "diff", "HEAD", "--binary") or b"")
    for name in sorted((_git(root, "ls-files", "--others", "--exclude-standard", "-z") or b"").split(b"\0")):
        f = root / os.fsdecode(name)
        if name and f.is_file():     # an untracked notebook or module changes the code as much as an edit does
            h.update(name + b"\0" + f.read_bytes())
    dirty = bool(status.strip())
    return dict(commit=head.decode().strip(), dirty=dirty, diff_sha256=h.hexdigest() if dirty else None)


def versions() -> dict:
    "Python's and the libraries' versions (`LIBRARIES`; 'not installed' for one that is not)."
    def v(dist):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"
    return dict(python=platform.python_version(), **{k: v(d) for k, d in LIBRARIES.items()})


def device_name(device) -> str:
    "The GPU's name, or the CPU's model (from /proc/cpuinfo where there is one)."
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def host_hash() -> str:
    "A hash of the host's name: whether two runs shared a machine, without naming it."
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:16]


@contextlib.contextmanager
def run_threads(threads: int | None):
    """torch's CPU threads set to `threads` (None: left as the environment gave them) while the run trains, put back
    after (a run trained inside another program leaves its count as it found it); yields the count in force."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def segment_entry(device, step: int = 0, world_size: int = 1) -> dict:
    "What makes this stretch of a run, read here, in the training process (see above); `step`: where it starts."
    return dict(from_step=step, started=time.strftime("%Y-%m-%d %H:%M:%S %Z"), **code_state(), versions=versions(),
                threads=torch.get_num_threads(), device=str(device), device_name=device_name(device),
                cpu_capability=torch.backends.cpu.get_cpu_capability(), world_size=world_size,
                command=shlex.join(sys.argv), host_sha256=host_hash())


def facts(segments: list[dict]) -> dict:
    "What the segments share, fact by fact (`FACTS`); a fact that differs between segments: the list of its values."
    out = {}
    for k in FACTS:
        vals = [s.get(k, NOT_RECORDED) for s in segments]
        distinct = [v for i, v in enumerate(vals) if v not in vals[:i]]
        out[k] = distinct[0] if len(distinct) == 1 else distinct
    return out


def read_record(run_dir) -> dict | None:
    "The run's `run.json`, or None where there is none (a run from before runs recorded what made them)."
    f = Path(run_dir) / RECORD if run_dir is not None else None
    if f is None or not f.is_file():
        return None
    try:
        rec = json.loads(f.read_text())
    except ValueError:
        return None
    return rec if isinstance(rec, dict) and isinstance(rec.get("segments"), list) else None


def begin_segment(run_dir, device, step: int = 0, ck: dict | None = None, world_size: int = 1,
                  write: bool = True) -> dict:
    """The run's record with this segment added (see above), written to `run_dir/run.json` when `write` (the main
    process): from the checkpoint `ck` the run resumes from (its record, else `run.json`), the segments before `step`
    kept (one that ran past its last checkpoint is gone with its steps), a fresh record when the run starts at 0."""
    old = ((ck or {}).get("record") or read_record(run_dir) or {}) if ck is not None else {}
    segs = [s for s in old.get("segments", []) if s.get("from_step", 0) < step]
    entry = segment_entry(device, step, world_size)
    if segs and segs[-1].get("threads") != entry["threads"]:
        entry["threads_changed_from"] = segs[-1].get("threads")
    segs.append(entry)
    rec = dict(format=1, **facts(segs), segments=segs)
    if write:
        f = Path(run_dir) / RECORD
        f.parent.mkdir(parents=True, exist_ok=True)
        tmp = f.with_name(RECORD + ".tmp")
        tmp.write_text(json.dumps(rec, indent=1))
        os.replace(tmp, f)
    return rec


# %% [markdown]
# A fresh record, then a resume at step 3 on another thread count: two segments, the second saying what changed, and
# the top listing both counts. In this checkout the commit is 40 hex digits.

# %%
with tempfile.TemporaryDirectory() as d, run_threads(1):
    _r = begin_segment(d, "cpu")
    test_eq((_r["threads"], len(_r["commit"]), _r["segments"][0]["from_step"]), (1, 40, 0))
    assert set(_r["versions"]) == {"python", *LIBRARIES} and _r["device"] == "cpu"
    assert _r["cpu_capability"] == torch.backends.cpu.get_cpu_capability() and _r["cpu_capability"]
    with run_threads(2):
        _r2 = begin_segment(d, "cpu", step=3, ck=dict(record=_r))
    test_eq((_r2["threads"], _r2["segments"][1]["threads_changed_from"]), ([1, 2], 1))
    test_eq(json.loads((Path(d) / RECORD).read_text())["threads"], [1, 2])
    test_eq(len(begin_segment(d, "cpu", step=3)["segments"]), 1)   # no checkpoint: a fresh record
    test_eq(torch.get_num_threads(), 1)                                # put back
print({k: _r[k] for k in ("commit", "dirty", "threads", "versions", "device_name", "cpu_capability")})

# %% [markdown]
# ## Records in a table
#
# A comparison's table (`70_compare`, `71_experiments`, the fine-tune table of `71a_plateau`) lists each run's record
# in `summary.json` (`table_record`: commit, dirty and the hash of the difference, threads, versions, device; from a run
# folder without `run.json`, "not recorded", with the thread count its `train.json` kept where it kept one), and
# `summary.md` says in one line whether every run came from one commit and one thread count, or which differ
# (`records_line`). A table that mixes commits says so in its header, and so does one that reused a run whose thread
# count is not the plan's.

# %%
#| export
PARENT_COUNT = "train.json: the comparison's process, not necessarily the training process's"


def table_record(run_dir, kept: dict | None = None) -> dict:
    """A run's record as a table lists it: commit, dirty, diff_sha256, threads, versions, device_name (`facts` of
    `run.json`); without `run.json` every fact `NOT_RECORDED`, but the thread count `kept` (its `train.json`) holds."""
    rec = read_record(run_dir)
    if rec is None:
        out = {k: NOT_RECORDED for k in ("commit", "dirty", "diff_sha256", "threads", "versions", "device_name")}
        if isinstance((kept or {}).get("threads"), int):   # before run.json: the count of the process that asked
            out.update(threads=kept["threads"], threads_from=PARENT_COUNT)
        return out
    return {k: rec.get(k, NOT_RECORDED) for k in ("commit", "dirty", "diff_sha256", "threads", "versions",
                                                  "device_name")}


def _short(v) -> str:
    if isinstance(v, list):
        return " then ".join(_short(x) for x in v)
    return v[:7] if isinstance(v, str) and len(v) == 40 else str(v)


def records_line(per_seed: dict, plan_threads: int | None = None) -> tuple[str, str | None]:
    """(one line on the runs' records, a warning for the table's header or None): whether every trained run of
    `per_seed` ({seed: {row: numbers with 'record'}}) came from one commit and one thread count, or which differ;
    the warning names mixed commits and runs whose thread count is not the plan's (`plan_threads`)."""
    runs = {(s, n): r.get("record") or table_record(None, r) for s, res in per_seed.items() for n, r in res.items()
            if n != "untrained"}
    if not runs:
        return "Runs: none trained.", None
    def groups(key):
        g = {}
        for (s, n), rec in runs.items():
            v = rec.get(key, NOT_RECORDED)
            if key == "commit":
                v = _short(v) + (" (dirty)" if rec.get("dirty") is True else "")
            g.setdefault(_short(v) if key != "commit" else v, []).append(f"{n} seed {s}")
        return g
    said, warn = [], []
    for key, what in (("commit", "commit"), ("threads", "thread count")):
        g = groups(key)
        if list(g) == [NOT_RECORDED]:
            said.append(f"{what} {NOT_RECORDED}")
        elif len(g) == 1:
            said.append(f"one {what}, {next(iter(g))}")
        else:
            said.append(f"{what}s differ: " + "; ".join(f"{v} ({len(w)}: {', '.join(w[:3])}"
                                                        f"{', ...' if len(w) > 3 else ''})" for v, w in g.items()))
    commits = groups("commit")
    if len(commits) > 1:
        warn.append(f"the runs come from {len(commits)} commits ({', '.join(commits)})")
    if plan_threads is not None:
        off = [f"{n} seed {s} ({_short(r.get('threads'))})" for (s, n), r in runs.items()
               if r.get("threads") != plan_threads]
        if off:
            warn.append(f"{len(off)} reused run(s) trained at another thread count than the plan's {plan_threads}: "
                        + ", ".join(off[:6]) + (", ..." if len(off) > 6 else ""))
    every = "all from " if all(x.startswith("one ") for x in said) else ""
    parent = sum(r.get("threads_from") == PARENT_COUNT for r in runs.values())
    line = (f"Runs ({len(runs)}): {every}" + "; ".join(said)
            + (f" (the count of {parent} run(s) without run.json is the one their train.json kept, the comparison "
               "process's, which a spawned training process need not have had)" if parent else "")
            + " (each run's record: summary.json, per_seed, 'record').")
    return line, ("**Mixed:** " + "; ".join(warn) + ".") if warn else None


# %%
_ps = {0: {"untrained": {}, "CLIP": dict(record=dict(commit="a" * 40, dirty=False, threads=1)),
           "X": dict(record=dict(commit="a" * 40, dirty=False, threads=1))},
       1: {"CLIP": dict(record=dict(commit="b" * 40, dirty=True, threads=2)), "X": dict(threads=1)}}
_line, _warn = records_line(_ps, plan_threads=1)
print(_line, _warn, sep="\n")
assert "commits differ" in _line and "aaaaaaa (2" in _line and "bbbbbbb (dirty)" in _line and "not recorded" in _line
assert "3 commits" in _warn and "CLIP seed 1 (2)" in _warn
assert "the count of 1 run(s) without run.json" in _line
_line, _warn = records_line({0: {"CLIP": dict(record=dict(commit="a" * 40, dirty=False, threads=1))}}, 1)
test_eq((_line.startswith("Runs (1): all from one commit, aaaaaaa; one thread count, 1"), _warn), (True, None))
