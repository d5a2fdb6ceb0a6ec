"""The GPU check's plan (issue 38): its parts in order of value, the units of each, and the seconds each unit is
expected to take, from the seconds one GPU measured (`results/gpu_nvidia_h200/timings.json`). No torch:
`gpu_check.py --plan` answers in about a second.

    python benchmarks/gpu_check.py --plan --budget 600          # what a 600 s job would run, and what it defers

Each part's line gives its expected seconds as `N s` and where they come from: `measured` (the same units took that long
on the GPU of the timings file), `extrapolated` (some of its units were measured, or the same work in another layout),
`estimate` (never measured: the basis is said). Units already recorded in the state folder (`--state`, the real run's)
cost nothing. The parts are taken in order; a part whose seconds do not fit in what is left of the budget is deferred
(a later, smaller part may still fit), exactly as the real run decides when each part's turn comes, with the seconds
the parts before it really took. The real run gives a part at most `MARGIN` times its expected seconds before it cuts
it (its finished units are kept: the same command continues).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
TIMINGS = RESULTS / "gpu_nvidia_h200" / "timings.json"
# the order of value (issue 38): a part the budget defers waits for the next job
PARTS = ("parity", "step-C4096", "step-B512", "compile", "paths-Kcc3m", "step-B256", "steps-other", "real-shards",
         "memory", "ddp", "accum", "paths-K16", "compile-C4096", "compare")
HEAD = ("clip", "powerclip")
# the loss's paths (issue 37): the Triton kernel, the blocked path at 16 MiB and at the device's budget, the dense
# reference, CLIP's loss, SigLIP's (issue 43); M = 10 (the paper's) first
PATHS = ("triton", "fast", "fast-device", "dense", "clip", "siglip")
PATH_MS = (10, 5, 15)
ACCUM_KS = (1, 2, 4)
LOADER_WORKERS = (1, 4, 8)
# the S-bar parity cases (gpu_check_parts.sbar_cases: every NLA activation and switch, then the exact 2^M enumeration)
SBAR_CASES = ("default", "t1_act=softplus", "t1_act=relu", "t1_act=gelu", "t1_act=swish", "t2_act=tanh",
              "t2_act=sigmoid", "t2_act=softsign", "use_t2r=False", "use_r2t=False", "debias_t2=True", "alpha=0.0",
              "alpha=1.0", "region_sets=False", "region_sets=False+use_t2r=False", "region_sets=False+use_r2t=False",
              "tau=0.05", "exact 2^M")
# variants the steps-other part measures beside the methods' defaults: PowerCLIP's blocked path, and the two masking
# methods whose kept-token count moves from batch to batch with that count rounded to a multiple of 8 (issue 38)
STEP_VARIANTS = ("powerclip:impl=fast", "clip-pgs-0.3:drop_multiple=8", "eclip:drop_multiple=8")
MARGIN = 1.5          # the real run cuts a part at MARGIN x its expected seconds (plus SLACK_S)
SLACK_S = 20
# parts that keep their progress inside a unit (the comparison trains run by run and resumes a cut run): they take
# whatever is left once this many seconds are (one run), instead of waiting for their whole time
RESUMABLE = {"compare": 120}
# each part's figures beside the card's limit (issue 45): the columns its table adds, '-' until a GPU measures them
LIMIT_COLUMNS = {"paths-K": "ms median, ms p20-p80, TFLOP/s, % of bf16 peak, G scores/s",
                 "step": "images/s, MFU %, MFU ckpt %", "real-shards": "images/s per worker process"}


def limit_columns(part: str) -> str:
    "The limit columns a part's table shows ('' where it has none)."
    key = ("step" if part.startswith("step") else "paths-K" if part.startswith("paths-K") else part)
    return LIMIT_COLUMNS.get(key, "")


# the dry run's seconds per unit on this project's 2 busy CPU cores at its toy sizes, as dry runs of 2026-11-27 took
# them (`--dry-run` checks the code: its plan is not a GPU's)
_DRY_UNIT_S = {"parity": 0.5, "step-C4096": 4, "step-B512": 1.5, "compile": {"eager": 18, "compiled": 60},
               "paths-Kcc3m": 2.5, "step-B256": 1.5, "steps-other": 5, "real-shards": {"workers": 40, "loader": 25},
               "memory": 2, "ddp": 12, "accum": 5, "paths-K16": 2.5, "compile-C4096": 60, "compare": 60}
DRY_TIMINGS = {"device": "CPU (dry run)", "startup_s": {"seconds": 60, "basis": "estimate", "from": "2 busy cores"},
               "parts": {p: {"unit_s": s, "basis": "dry run", "from": "2 busy CPU cores, toy sizes"}
                         for p, s in _DRY_UNIT_S.items()}}


def registered_methods() -> list[str]:
    "The methods' names, read from the package's `@register('name')` lines (no import: the plan needs no torch)."
    names = set()
    for f in (ROOT / "powerclip").rglob("*.py"):
        names.update(re.findall(r"""^@register\(["']([^"']+)["']\)""", f.read_text(), flags=re.M))
    return sorted(n for n in names if not n.startswith("_"))


def ordered(names) -> list[str]:
    "CLIP and PowerCLIP first (the headline), then the others."
    return [m for m in HEAD if m in names] + [m for m in names if m not in HEAD]


def unit_keys(part: str, methods: list[str] | None = None) -> list[str]:
    "The keys of `part`'s units, in the order they run (`methods`: the parity and step parts' methods)."
    ms = ordered(methods if methods is not None else registered_methods())
    head, others = [m for m in ms if m in HEAD], [m for m in ms if m not in HEAD]
    pc = "powerclip" in ms
    if part == "parity":
        return ([f"loss {m}" for m in head] + [f"loss powerclip:impl={i}" for i in ("dense", "fast", "triton") if pc]
                + [f"loss powerclip:impl=triton,region_sets=False,{s}" for s in ("use_r2t=False", "use_t2r=False")
                   if pc]
                + [f"sbar {c}" for c in SBAR_CASES] + [f"loss {m}" for m in others])
    if part in ("step-C4096", "step-B512", "step-B256"):
        return head
    if part == "compile":
        return [f"{m} {h}" for m in reversed(head) for h in ("eager", "compiled")]          # PowerCLIP first
    if part == "compile-C4096":
        return [f"{m} compiled" for m in reversed(head)]
    if part.startswith("paths-K"):
        return [f"M={M} {p}" for M in PATH_MS for p in PATHS]
    if part == "steps-other":   # the shared batches carry FLAIR's sub-captions too (`host_batches`)
        return others + [v for v in STEP_VARIANTS if v.split(":")[0] in ms]
    if part == "real-shards":
        return [f"loader {w} workers" for w in LOADER_WORKERS] + ["powerclip step fed by the loader"]
    if part == "memory":
        return ["paper_memory"]
    if part == "ddp":
        return ["ddp one process", "train 50 and resume"]
    if part == "accum":
        return [f"{m}:k={k}" for m in head for k in ACCUM_KS]
    if part == "compare":
        return ["compare"]
    raise ValueError(f"unknown part {part!r}")


def default_state(out: Path) -> Path:
    "The state folder of the results folder `out` (gpu_check.py's default: runs/gpu_check/<name>-<hash of its path>)."
    import hashlib
    h = hashlib.sha1(str(Path(out).resolve()).encode()).hexdigest()[:8]
    return ROOT / "runs" / "gpu_check" / f"{Path(out).resolve().name}-{h}"


def from_results(d: dict, base: dict) -> dict:
    """A timings file from a GPU check's results.json (each unit's seconds, `unit_seconds`): a part's seconds per unit
    the mean of its recorded units', per kind where the H200's file has kinds; the parts it did not run from `base`."""
    out = dict(base, device=d["meta"]["device"], source=f"results.json of {d['meta']['device']} "
               f"({d['meta']['updated']})", parts=dict(base["parts"]))
    for part, v in d["parts"].items():
        secs = v.get("unit_seconds") or {}
        if part not in out["parts"] or not secs:
            continue
        kinds = base["parts"][part]["unit_s"]
        mean = lambda xs: sum(xs) / len(xs)
        if isinstance(kinds, dict):
            by = {k: [t for key, t in secs.items() if key.split()[-1] == k] for k in kinds}
            unit = {k: (mean(t) if t else kinds[k]) for k, t in by.items()}
        else:
            unit = mean(list(secs.values()))
        said = f"{len(secs)} unit(s) on {d['meta']['device']}, {sum(secs.values()):.0f} s"
        out["parts"][part] = dict(unit_s=unit, basis="measured" if v["status"] == "complete" else "extrapolated",
                                  **{"from": said})
    return out


def load_timings(path: Path = TIMINGS) -> dict:
    """The timings file: {'device', 'startup_s', 'parts': {part: {'unit_s': s or {kind: s}, 'basis', 'from'}}}; or a
    newer GPU check's results.json (`from_results`, the H200's file for what it lacks)."""
    d = json.loads(Path(path).read_text())
    if "meta" in d and any("unit_seconds" in v for v in d.get("parts", {}).values()):
        d = from_results(d, json.loads(TIMINGS.read_text()))
    missing = [p for p in PARTS if p not in d.get("parts", {})]
    if missing:
        raise ValueError(f"{path}: no seconds for part(s) {', '.join(missing)}")
    return d


def unit_seconds(timings: dict, part: str, key: str) -> float:
    "Expected seconds of one unit: the part's `unit_s`, or its entry for the unit's kind (the key's last word)."
    u = timings["parts"][part]["unit_s"]
    if isinstance(u, dict):
        kind = key.split()[-1]
        return float(u.get(kind, u.get("default", max(u.values()))))
    return float(u)


def expected(timings: dict, part: str, keys: list[str], done=()) -> float:
    "Seconds of the units of `keys` not in `done`."
    return sum(unit_seconds(timings, part, k) for k in keys if k not in done)


def fits(part: str, need: float, left_s: float) -> bool:
    "Whether a part runs now: its seconds fit, or it keeps progress within a unit and one run's seconds fit."
    return need <= left_s or (part in RESUMABLE and left_s >= RESUMABLE[part])


def schedule(parts: list[str], left_s: float, cost: dict) -> tuple[list[str], list[str]]:
    "(run, deferred): the parts in order, each run when it `fits` what is left, else deferred."
    run, deferred = [], []
    for p in parts:
        if fits(p, cost[p], left_s):
            run.append(p)
            left_s -= min(cost[p], left_s)
        else:
            deferred.append(p)
    return run, deferred


def recorded(state: Path | None, part: str) -> set:
    "The keys of `part`'s units recorded in the state folder (the real run skips them)."
    f = None if state is None else Path(state) / f"{part}.jsonl"
    out = set()
    for line in (f.read_text().splitlines() if f is not None and f.is_file() else []):
        try:
            out.add(json.loads(line)["key"])
        except (ValueError, KeyError):
            continue
    return out


def plan(parts: list[str], budget: float, timings: dict, state: Path | None = None,
         methods: list[str] | None = None) -> dict:
    "Each part's units, expected seconds and basis, and which parts a job of `budget` seconds runs and defers."
    rows, cost = [], {}
    for p in parts:
        keys = unit_keys(p, methods)
        done = recorded(state, p) & set(keys)
        t = timings["parts"][p]
        cost[p] = expected(timings, p, keys, done)
        rows.append(dict(part=p, seconds=cost[p], units=len(keys), done=len(done), basis=t["basis"],
                         source=t.get("from", "")))
    startup = float(timings.get("startup_s", {}).get("seconds", 0))
    left = budget - min(10.0, 0.05 * budget) - startup
    run, deferred = schedule([r["part"] for r in rows if r["seconds"] > 0], left, cost)
    used = 0.0
    for r in rows:
        r["runs"] = r["part"] in run or r["seconds"] == 0
        if r["part"] in run:
            r["partly"] = r["seconds"] > left - used          # a resumable part given what is left
            used += min(r["seconds"], left - used)
    return dict(rows=rows, run=run, deferred=deferred, startup_s=startup, left_s=left, budget_s=budget,
                device=timings.get("device", "?"))


def render(p: dict) -> str:
    "The plan as text: one line per part."
    w = max(len(r["part"]) for r in p["rows"])
    import gpu_limits
    lines = [f"plan for --budget {p['budget_s']:g} s (seconds measured on {p['device']}; start-up "
             f"{p['startup_s']:.0f} s and the last publish counted): {len(p['run'])} part(s) run, "
             f"{len(p['deferred'])} deferred to the next job",
             f"  limits: {gpu_limits.limits_line(p['device'])}; the card that runs it is read from "
             "torch.cuda.get_device_name (an unknown card: no fraction)"]
    for r in p["rows"]:
        state = ("done" if r["seconds"] == 0 else "DEFERRED" if not r["runs"] else
                 "partly" if r.get("partly") else "runs")
        units = f"{r['units'] - r['done']} of {r['units']} unit(s) left" if r["done"] else f"{r['units']} unit(s)"
        cols = limit_columns(r["part"])
        cols = f" [vs limit: {', '.join(c + ' -' for c in cols.split(', '))}]" if cols else ""
        lines.append(f"  {r['part']:<{w}}  {r['seconds']:6.0f} s  {state:<8}  {r['basis']}: {r['source']} ({units})"
                     + cols)
    used = min(sum(r["seconds"] for r in p["rows"] if r["part"] in p["run"]), p["left_s"])
    partly = [r["part"] for r in p["rows"] if r.get("partly")]
    lines.append(f"expected: {used + p['startup_s']:.0f} s of {p['budget_s']:g} s"
                 + (f" ({', '.join(partly)} takes what is left and continues in the next job)" if partly else "")
                 + f"; deferred: {', '.join(p['deferred']) or 'none'}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    "`gpu_check.py --plan ...`: the plan, printed (the real run's other arguments are accepted and ignored)."
    from powerclip.commandline import ArgumentParser, usage_errors
    ap = ArgumentParser(prog="gpu_check.py --plan", description=__doc__.split("\n")[0])
    ap.add_argument("--plan", action="store_true")
    ap.add_argument("--budget", type=float, default=540)
    ap.add_argument("--parts", nargs="+", default=list(PARTS))
    ap.add_argument("--out", type=Path, default=None, help="the real run's --out (its default state folder)")
    ap.add_argument("--state", type=Path, default=None, help="the real run's state folder (its recorded units count "
                                                               "as done; default: --out's, else none)")
    ap.add_argument("--timings", type=Path, default=TIMINGS, help="seconds measured on a GPU: a timings file or a "
                                                                   "newer check's results.json (default the H200's)")
    ap.add_argument("--methods", nargs="+", default=None)
    ap.add_argument("--debug", action="store_true")
    with usage_errors():
        a, _ = ap.parse_known_args(argv)
        unknown = [p for p in a.parts if p not in PARTS]
        if unknown:
            raise ValueError(f"--parts: unknown part {unknown[0]!r} (known: {', '.join(PARTS)})")
        if a.budget < 1:
            raise ValueError(f"--budget: must be at least 1, got {a.budget:g}")
        if not a.timings.is_file():
            raise ValueError(f"--timings: no file {str(a.timings)!r}")
        timings = load_timings(a.timings)
        if a.state is None and a.out is not None:
            a.state = default_state(a.out)
    print(render(plan([p for p in PARTS if p in a.parts], a.budget, timings, a.state, a.methods)))
    return 0
