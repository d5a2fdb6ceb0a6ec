"""Everything a GPU can show about this repository, one job's time at a time (`--budget`, issues 22, 29, 37 and 38).

The parts, in order of value (`gpu_plan.PARTS`; `--plan` prints which a job of `--budget` seconds runs, from the seconds
each part's units took on the GPU of `results/gpu_nvidia_h200/timings.json`, without running anything):

  (environment) device, driver, torch, CUDA, cuDNN, NCCL, triton, TF32 and bf16 switches: read first, always
  parity       the loss on the device, fp32 and bf16 autocast, against float64 on the CPU: CLIP and PowerCLIP (every
               impl, triton where it can run) first, then S-bar for every activation, switch and path, then the others;
               each PowerCLIP loss call also once under torch.cuda.set_sync_debug_mode("error") (no host sync expected)
  step-C4096   PowerCLIP's and CLIP's ViT-B/16 bf16 step at 512 local images whose loss sees what 7 more processes
               would send (3,584 further captions with CC3M node counts and images, detached): C = 4096, the paper's
               scale, in one process (targets: PowerCLIP <= 1.10x CLIP's time eager, its whole peak within 80 GB)
  step-B512    the same at 512 local, C = R = 512 (one process, no peers)
  compile      torch.compile of the training step against eager, PowerCLIP then CLIP, each half (eager, compiled) a
               unit: parity, speed-up, compile time, graphs, recompiles and graph breaks
  paths-Kcc3m  each path of the loss (triton, fast at 16 MiB and at the device's budget, dense, CLIP's loss) at
               R = 512, C = 4096, M = 10, 5, 15, real CC3M node counts: one path and one M a unit
  step-B256    step-B512's measurement at 256 local (C = R = 256)
  steps-other  every other method's step at 256 (and PowerCLIP's blocked path), against CLIP's of step-B256, with
               each step's spread (max / min) and the papers' relative training times
  real-shards  COCO photos in webdataset shards (`make real-shards`): the loader's images/s with 1, 4 and 8 workers,
               then PowerCLIP's step fed by the loader for a minute (skipped, with one line, without the shards)
  memory       paper_memory.py on the device, beside its CPU measurement
  ddp          DistributedDataParallel in a one-process NCCL group; the trainer's loop for 50 steps, its checkpoint
               written from the device and resumed (the losses must agree)
  accum        CLIP's and PowerCLIP's ViT-B/16 bf16 step at 256 in k = 1, 2, 4 micro-batches (accum_steps, no
               checkpointing): time and peak memory of the timed steps against k = 1
  paths-K16    the loss's paths with K = 16 nodes per caption
  compile-C4096  step-C4096 compiled (its eager halves are step-C4096's): where the budget allows
  compare      python -m powerclip.compare --runs all --steps 2000 --device cuda --precision bf16, run by run (several
               jobs: the plan says how long)

The parts run one after another in a worker process (one start-up for all), in its own process group under a guard
that kills the whole group when the worker ends, when the running part passes its deadline (a new worker then goes on
with the next part), or when this process dies (even by SIGKILL): nothing is left running. When a part's turn comes,
it runs if its expected seconds (its units not yet recorded) fit in what is left of the job, with a deadline of
`gpu_plan.MARGIN` times them; else it is deferred to the next job, and a later, smaller part may run. A part records
each unit (a method, a case, a half, a path) the moment it finishes, under the state folder (`--state`, default
runs/gpu_check/NAME-HASH/, which also holds inductor's cache: TORCHINDUCTOR_CACHE_DIR, so a second job compiles warm);
the same command run again skips what is recorded and continues (`--force` redoes). Results, small enough to copy back
from any cluster, in `--out` (three files): summary.md (one table, then each part's), results.json (everything, the
step results of each method under its name: parts.step-C4096.results.clip, .powerclip; each unit's seconds) and
gpu_check.log.

    python benchmarks/gpu_check.py --plan --budget 600    # the plan: each part's seconds, what the budget defers
    python benchmarks/gpu_check.py                        # one 10-minute job (--budget 540); run again to continue
    python benchmarks/gpu_check.py --budget 300 --parts parity step-C4096
    python benchmarks/gpu_check.py --dry-run --budget 180 --out /tmp/gpu_dry   # no GPU: the code path at toy sizes

Without a GPU it stops with one line and exit status 2, unless `--dry-run`: then the parts run on the CPU at toy
sizes, which checks the code and measures nothing. Exit status 0 when every part finished or was deferred by the
budget (the summary names those: run again to continue), 1 when a part failed, 2 for a mistake in the arguments.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path



def _process_start() -> float:
    "When this process started (Linux: from /proc; else now): the budget counts the interpreter's start-up too."
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(int(x.split()[1]) for x in Path("/proc/stat").read_text().splitlines() if x.startswith("btime"))
        return min(time.time(), boot + ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, StopIteration):
        return time.time()


T_START = _process_start()     # before the heavy imports: the budget counts them (a fresh process takes seconds)
if __name__ == "__main__" and "--plan" in sys.argv[1:]:     # the plan: no torch, no GPU, a second
    import gpu_plan
    from powerclip.commandline import run_main
    sys.exit(run_main(gpu_plan.main, sys.argv[1:], prog="gpu_check.py --plan"))
import torch

import _checks
import gpu_check_parts as P
import gpu_limits
import gpu_plan
from powerclip.commandline import ArgumentParser, run_main, usage_errors

HERE, ROOT, RESULTS = P.HERE, P.ROOT, P.RESULTS
PARTS = gpu_plan.PARTS        # the order is the order of value
MIN_START_S = 5          # a part with less time than this left is deferred, not started
GRACE_S = 3              # SIGTERM, then this long, then SIGKILL
CUT_GRACE_S = 10         # a worker asked to cut its part (SIGUSR1) that has not within this long: its group is killed
RUNNING = "running (if cut here, the next run continues it)"
# kills its own process group (the part and all it started) when the driver closes the pipe or dies
GUARD = "import os, signal, sys; sys.stdin.buffer.read(); os.killpg(0, signal.SIGKILL)"


def slug(name: str) -> str:
    "A device name as a folder name: 'NVIDIA H100 80GB HBM3' -> 'nvidia_h100_80gb_hbm3'."
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or "device"


def device_name(a) -> str:
    return "CPU (dry run)" if a.dry_run else torch.cuda.get_device_name(torch.device(a.device))


# ------------------------------------------------------------------------------------------------ environment
def _nccl():
    "NCCL's version as 'major.minor.patch' (a tuple or an int, by torch release), or None."
    if not torch.distributed.is_nccl_available():
        return None
    v = torch.cuda.nccl.version()
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def environment(a) -> dict:
    "Device, driver, torch, CUDA, cuDNN and the precision switches, as a fresh process sees them (read in the driver)."
    import platform
    import warnings
    import numpy
    e = dict(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda,
             numpy=numpy.__version__, host=platform.node(), cpus=os.cpu_count(), dry_run=a.dry_run)
    from importlib.metadata import PackageNotFoundError, version
    from importlib.util import find_spec
    for key, dist in (("open_clip", "open_clip_torch"), ("triton", "triton")):     # without importing them (seconds)
        try:
            e[key] = version(dist)
        except PackageNotFoundError:
            e[key] = "missing"
    e["sbar_triton"] = "present" if find_spec("powerclip.sbar_triton") else "absent (no powerclip.sbar_triton)"
    e["triton_interpret"] = os.environ.get("TRITON_INTERPRET", "")
    e["inductor_cache"] = os.environ.get("TORCHINDUCTOR_CACHE_DIR", "")
    with warnings.catch_warnings():              # torch >= 2.9 warns that allow_tf32 gives way to fp32_precision
        warnings.simplefilter("ignore")
        e.update(matmul_allow_tf32=torch.backends.cuda.matmul.allow_tf32,
                 cudnn_allow_tf32=torch.backends.cudnn.allow_tf32,
                 float32_matmul_precision=torch.get_float32_matmul_precision(),
                 cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None)
    if a.dry_run:
        e.update(device="CPU (dry run)")
        return e
    d = torch.device(a.device)
    p = torch.cuda.get_device_properties(d)
    e.update(device=torch.cuda.get_device_name(d), capability=f"{p.major}.{p.minor}", memory_gib=p.total_memory / 2**30,
             peak=gpu_limits.limits_line(torch.cuda.get_device_name(d)),
             sms=p.multi_processor_count, bf16_supported=torch.cuda.is_bf16_supported(),
             nccl=_nccl(),
             visible_gpus=torch.cuda.device_count())
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i",
                            str(d.index or 0)], capture_output=True, text=True, timeout=15)
        e["driver"] = q.stdout.strip() or q.stderr.strip()[:200]
    except (OSError, subprocess.TimeoutExpired) as err:
        e["driver"] = f"unknown ({type(err).__name__})"
    return e


# ------------------------------------------------------------------------------------------------ parts and state
def _units(a, part: str):
    "The part's units, `(key, thunk)` in order (their keys: `gpu_plan.unit_keys`)."
    raw = a.state / "raw" / part
    raw.mkdir(parents=True, exist_ok=True)
    if part == "parity":
        return P.units_parity(a)
    if part.startswith("step"):
        return P.units_step(a, part)
    if part == "ddp":
        return P.units_ddp(a, raw)
    if part.startswith("compile-") or part == "compile":
        return P.units_compile(a, part)
    if part.startswith("paths-K"):
        return P.units_paths(a, None if part == "paths-Kcc3m" else int(part[7:]))
    if part == "real-shards":
        return P.units_real(a)
    if part == "memory":
        return [("paper_memory", lambda: P.memory_unit(a, raw))]
    if part == "accum":
        return P.units_accum(a)
    return [("compare", lambda: P.compare_unit(a))]


def _report(a, part: str, values: dict, every: dict) -> dict:
    if part == "parity":
        return P.report_parity(a, values)
    if part == "steps-other":
        return P.report_step(a, values, part, clip=every.get("step-B256", {}).get("clip"))
    if part.startswith("step"):
        return P.report_step(a, values, part)
    if part.startswith("compile"):
        return P.report_compile(a, values, part, every)
    report = {"ddp": P.report_ddp, "memory": P.report_memory, "accum": P.report_accum, "compare": P.report_compare,
              "real-shards": P.report_real}.get(part)
    return report(a, values) if report else P.report_paths(a, values)


def _write(path: Path, text: str) -> None:
    "Whole or not at all (a kill never leaves half a file)."
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _values(a, part: str) -> dict:
    "The recorded units of a part: key -> value (a value with 'error' is a unit that raised)."
    f, out = a.state / f"{part}.jsonl", {}
    for line in (f.read_text().splitlines() if f.is_file() else []):
        try:
            d = json.loads(line)
        except json.JSONDecodeError:       # the last line of a process killed while writing it
            continue
        out[d["key"]] = d["value"]
    return out


def _unit_seconds(a, part: str) -> dict:
    "The recorded units of a part: key -> the seconds it took (what a timings file is made of)."
    f, out = a.state / f"{part}.jsonl", {}
    for line in (f.read_text().splitlines() if f.is_file() else []):
        try:
            d = json.loads(line)
        except json.JSONDecodeError:
            continue
        out[d["key"]] = round(float(d.get("seconds", 0)), 2)
    return out


def _status(a) -> dict:
    f = a.state / "status.json"
    return json.loads(f.read_text()) if f.is_file() else {}


def _set_status(a, part: str, status: str, note: str = "", seconds: float | None = None) -> None:
    st = _status(a)
    st[part] = dict(status=status, note=note, seconds=seconds, at=time.time(),
                    updated=time.strftime("%Y-%m-%d %H:%M:%S"))
    _write(a.state / "status.json", json.dumps(st, indent=1))


def publish(a) -> None:
    "summary.md and results.json in --out from everything recorded so far (the driver's and each unit's moment)."
    env = json.loads((a.state / "env.json").read_text()) if (a.state / "env.json").is_file() else {}
    st, every = _status(a), {p: _values(a, p) for p in PARTS}
    shown = [p for p in PARTS if p in a.parts or p in st or every[p]]     # this job's parts and all recorded before
    parts, table, details = {}, [], []
    for part in shown:
        vals = every[part]
        good = {k: v for k, v in vals.items() if not (isinstance(v, dict) and "error" in v)}
        errors = {k: v["error"] for k, v in vals.items() if k not in good}
        try:
            rep = _report(a, part, good, every) if good else dict(headline="-", ok=None, md=[], results={})
        except Exception as e:   # a report that cannot read a value: say so, publish the rest
            rep = dict(headline=f"report failed: {type(e).__name__}: {e}", ok=None, md=[], results={})
        s = st.get(part, dict(status="not run", note=""))
        parts[part] = dict(status=s["status"], note=s.get("note", ""), seconds=s.get("seconds"), units_done=len(vals),
                           units_failed=errors, unit_seconds=_unit_seconds(a, part), headline=rep["headline"],
                           ok=rep["ok"], results=rep["results"])
        ok = rep["ok"]
        table.append(f"| {part} | {s['status']}{': ' + s['note'] if s.get('note') else ''} | {len(vals)} | "
                     f"{rep['headline']} | {'-' if ok is None else 'met' if ok else 'NOT met'} |")
        if vals:
            details += ["", f"## {part}", "", f"**{rep['headline']}**", "", *rep["md"]]
            details += [f"- unit `{k}` failed: {e}" for k, e in errors.items()]
    deferred = [p for p in shown if parts[p]["status"] in ("deferred", "partial", "not run")]
    head = [f"# gpu-check: {env.get('device', '?')}", "",
            f"torch {env.get('torch')}, CUDA {env.get('cuda')}, driver {env.get('driver', '-')}, budget {a.budget:g} s"
            + (" (DRY RUN on the CPU: not measurements)" if a.dry_run else ""), "",
            f"Limits: {gpu_limits.limits_line(env.get('device'))}.", "",
            "| part | status | units | result | target |", "|---|---|---:|---|---|", *table, ""]
    if deferred:
        head.append(f"Not finished (deferred by the budget or cut): {', '.join(deferred)}; the same command continues "
                    f"them (state in {a.state}).")
    envmd = ["", "## environment", "", "| | |", "|---|---|", *[f"| {k} | {v} |" for k, v in env.items()]]
    _write(a.out / "summary.md", "\n".join(head + envmd + details) + "\n")
    meta = dict(device=env.get("device"), dry_run=a.dry_run, budget_s=a.budget, state=str(a.state), out=str(a.out),
                updated=time.strftime("%Y-%m-%d %H:%M:%S"), deferred=deferred)
    _write(a.out / "results.json", json.dumps(dict(meta=meta, env=env, parts=parts), indent=1, default=str))


# ---------------------------------------------------------------------------------------------- one part, its process
class Cut(BaseException):
    "The driver's SIGUSR1 to the worker: the running part's time is up (a BaseException: a unit's handler lets it by)."


class CutSignal:
    """The worker's SIGUSR1 handler and its state: it raises `Cut` while a part's unit runs, and holds it back while a
    unit is being recorded (a record is whole or not there), raising it right after."""
    def __init__(self):
        self.active, self.recording, self.pending = False, False, False

    def __call__(self, sig, frame):
        if self.active and not self.recording:
            raise Cut()
        self.pending = self.active

    def recorded(self):
        self.recording = False
        if self.pending:
            self.pending = False
            raise Cut()


def _kill_descendants() -> int:
    "SIGKILL every process this one started, and theirs (Linux: read from /proc); how many."
    children = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int(d.joinpath("stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):     # gone meanwhile
            continue
        children.setdefault(ppid, []).append(int(d.name))
    todo, n = list(children.get(os.getpid(), [])), 0
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            os.kill(pid, signal.SIGKILL)
            n += 1
        except ProcessLookupError:
            pass
    return n


def _device_broken(a) -> str | None:
    "Why the worker's CUDA context can no longer run anything (a sticky error), or None (fine, or not CUDA)."
    if a.dry_run or not str(a.device).startswith("cuda") or not torch.cuda.is_initialized():
        return None
    try:
        torch.cuda.synchronize(a.device)
        (torch.ones(1, device=a.device) + 1).item()
        return None
    except RuntimeError as e:
        return f"{e}".splitlines()[0][:200]


def run_part(a, part: str, cut: CutSignal, units=None) -> int:
    """In the worker: the part's units not yet recorded, each recorded and published the moment it is done. On the
    driver's cut, the processes the unit started are killed and the part is marked partial (or deferred)."""
    values, failed = _values(a, part), 0
    t_part = time.time()
    cut.active = True
    try:
        _set_status(a, part, "partial", RUNNING)
        for key, thunk in (units if units is not None else _units(a, part)):
            if key in values:
                continue
            t0 = time.time()
            print(f"-- {part}: {key}", flush=True)
            try:
                v = thunk()
            except Exception as e:
                traceback.print_exc()
                v = dict(error=f"{type(e).__name__}: {e}"[:500])
            cut.recording = True
            failed += isinstance(v, dict) and "error" in v
            with open(a.state / f"{part}.jsonl", "a") as f:
                f.write(json.dumps(dict(key=key, value=v, seconds=time.time() - t0), default=str) + "\n")
            publish(a)
            broken = _device_broken(a) if failed else None
            if broken:         # a sticky CUDA error (an illegal address...): every later unit of this process would
                _set_status(a, part, "failed", f"the device is unusable after unit {key!r}: {broken}; the next part "
                            "runs in a fresh worker", time.time() - t_part)
                publish(a)
                print(f"== {part}: {broken}: this worker ends, a fresh one continues", flush=True)
                os._exit(3)    # fail too, so the driver starts a fresh worker (a new CUDA context) for the rest
            cut.recorded()
        cut.active = False
    except Cut:
        cut.active = cut.recording = cut.pending = False
        killed = _kill_descendants()
        n = len(_values(a, part))
        _set_status(a, part, "partial" if n else "deferred",
                    f"cut by the budget after {time.time() - t_part:.0f} s; {n} unit(s) kept", time.time() - t_part)
        publish(a)
        print(f"== {part}: cut by the budget ({n} unit(s) kept, {killed} process(es) it started killed)", flush=True)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        return 0
    bad = failed or any(isinstance(v, dict) and "error" in v for v in _values(a, part).values())
    _set_status(a, part, "failed" if bad else "complete", "a unit failed (see its line)" if bad else "",
                time.time() - t_part)
    publish(a)
    return 1 if bad else 0


def timings(a) -> dict:
    "The seconds the plan expects of each unit: `--timings` (a GPU's), or the dry run's own on a CPU."
    return gpu_plan.DRY_TIMINGS if a.dry_run else gpu_plan.load_timings(a.timings)


def run_worker(a, parts: list[str]) -> int:
    """One process for `parts` in order (one start-up for all: seconds each on a busy machine). When a part's turn
    comes, it runs if the seconds its units not yet recorded are expected to take (`gpu_plan`) fit in what is left of
    the job, until a deadline of MARGIN times them (in STATE/plan.json for the driver, which cuts the part when it
    passes it); else it is deferred, and the next part is considered."""
    for module in ("powerclip.model", "powerclip.train"):    # open_clip, timm: start-up, before the shares count
        importlib.import_module(module)
    plan, tm = json.loads((a.state / "plan.json").read_text()), timings(a)
    cut = CutSignal()
    signal.signal(signal.SIGUSR1, cut)
    deadline, rc = {}, 0
    for part in parts:
        units = _units(a, part)
        need = gpu_plan.expected(tm, part, [k for k, _ in units], set(_values(a, part)))
        left = plan["end"] - time.time()
        if left < MIN_START_S or not gpu_plan.fits(part, need, left):
            _set_status(a, part, "partial" if _values(a, part) else "deferred",
                        f"deferred by the budget (needs about {need:.0f} s, {max(left, 0):.0f} s left)")
            publish(a)
            print(f"== {part}: deferred (needs about {need:.0f} s, {max(left, 0):.0f} s left)", flush=True)
            continue
        deadline[part] = time.time() + min(left, gpu_plan.MARGIN * need + gpu_plan.SLACK_S)
        _write(a.state / "plan.json", json.dumps(dict(plan, deadline=deadline)))
        print(f"== {part} (expected {need:.0f} s; until {time.strftime('%H:%M:%S', time.localtime(deadline[part]))})",
              flush=True)
        rc |= run_part(a, part, cut, units)
    return rc


# ------------------------------------------------------------------------------------------------ the driver
class Stopped(Exception):
    "This process got SIGTERM, SIGINT or SIGHUP."


def _on_signal(sig, frame):
    raise Stopped(sig)


def _stop_group(pg: int, proc) -> None:
    "SIGTERM to the worker's whole group, then SIGKILL to whatever is left."
    for sig, wait in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, 10)):
        try:
            os.killpg(pg, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            pass


def _group(pg: int) -> dict:
    "Popen's arguments that put the new process into group `pg` (0: a group of its own), in this process's session."
    if sys.version_info >= (3, 11):
        return dict(process_group=pg)
    return dict(preexec_fn=lambda: os.setpgid(0, pg))


def _running(a):
    "(part, seconds since it started) of the part a worker is running, or None."
    for part, s in _status(a).items():
        if s.get("note") == RUNNING:
            return part, time.time() - s["at"]
    return None


def _worker(a, parts: list[str], end: float, log) -> dict:
    """Run `parts` in one worker process, in its own process group under a guard, each part until its deadline (the
    worker's plan; `--part-timeout` at most), all by `end`; returns {part: (status, note)} of the parts it ended (the
    rest: to start again)."""
    _write(a.state / "plan.json", json.dumps(dict(end=end)))
    r, w = os.pipe()
    guard = subprocess.Popen([sys.executable, "-c", GUARD], stdin=r, stdout=log, stderr=log, **_group(0))
    os.close(r)
    argv = [sys.executable, str(Path(__file__).resolve()), *a.argv, "--worker", *parts, "--out", str(a.out),
            "--state", str(a.state), "--device", a.device]
    t0, cut, shown, asked = time.time(), None, None, None
    try:
        p = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=log, **_group(guard.pid))
        while p.poll() is None:
            time.sleep(0.5)
            cur = _running(a)
            deadline = json.loads((a.state / "plan.json").read_text()).get("deadline", {})
            if cur and cur[0] != shown:
                shown = cur[0]
                until = time.strftime("%H:%M:%S", time.localtime(deadline.get(shown, end)))
                print(f"== {shown} (until {until})", flush=True)
            over = cur and (time.time() > deadline.get(cur[0], end) or cur[1] > a.part_timeout)
            if over and asked is None:    # the worker stops the part and goes on with the next (no new start-up)
                asked = (cur[0], time.time())
                os.kill(p.pid, signal.SIGUSR1)
            elif asked and (not cur or cur[0] != asked[0]):
                asked = None
            if (over and asked and time.time() - asked[1] > CUT_GRACE_S) or time.time() > end + GRACE_S:
                cut = cur                 # it did not answer, or the job's end: the whole group
                _stop_group(guard.pid, p)
    except Stopped:
        cur = _running(a)
        _stop_group(guard.pid, p)
        if cur:
            _set_status(a, cur[0], "partial", "stopped by a signal; finished units kept", cur[1])
        raise
    finally:
        os.close(w)                       # the guard kills whatever the worker left behind, then itself
        guard.wait()
    ended, st = {}, _status(a)
    for part in parts:
        s = st.get(part, {})
        if cut and part == cut[0]:
            n = len(_values(a, part))
            ended[part] = (("partial", f"cut by the budget after {cut[1]:.0f} s; {n} unit(s) kept") if n else
                           ("deferred", f"deferred by the budget (cut after {cut[1]:.0f} s, before its first unit)"))
        elif s.get("note") == RUNNING:    # the worker died in it
            ended[part] = ("failed", f"the worker died (exit status {p.returncode}); see gpu_check.log")
        elif s.get("at", 0) >= t0:
            ended[part] = (s["status"], s.get("note", ""))
    for part, (status, note) in ended.items():
        if (status, note) != (st.get(part, {}).get("status"), st.get(part, {}).get("note")):
            _set_status(a, part, status, note, (cut[1] if cut and part == cut[0] else None))
    return ended


def _say(log, text: str) -> None:
    print(text, flush=True)
    log.write(text + "\n")
    log.flush()


def drive(a) -> int:
    env = environment(a)
    _write(a.state / "env.json", json.dumps(env, indent=1, default=str))
    st = _status(a)
    for part, v in st.items():            # a job that was killed (SIGKILL) left its running part so
        if v.get("note") == RUNNING:
            v.update(status="partial" if _values(a, part) else "deferred", note="cut: the job ended while it ran")
    for part in a.parts:
        if a.force:
            (a.state / f"{part}.jsonl").unlink(missing_ok=True)
            st.pop(part, None)
    _write(a.state / "status.json", json.dumps(st, indent=1))
    todo = [p for p in a.parts if st.get(p, {}).get("status") != "complete"]
    # the budget less what the last publish and a kill's grace need; each worker shares what is left when it is ready
    end = T_START + a.budget - min(10.0, 0.05 * a.budget)
    failed = False
    with open(a.out / "gpu_check.log", "a") as log:
        _say(log, f"== gpu-check {time.strftime('%Y-%m-%d %H:%M:%S')}: {env['device']}, torch {env['torch']}, "
                  f"budget {a.budget:g} s, parts to do: {' '.join(todo) or 'none'} (state {a.state})")
        for part in a.parts:
            if part not in todo:
                _say(log, f"== {part}: complete in an earlier run, kept (--force redoes it)")
        publish(a)
        remaining = list(todo)
        while remaining and end - time.time() >= MIN_START_S:
            try:
                ended = _worker(a, remaining, end, log)
            except Stopped as e:
                publish(a)
                _say(log, f"== stopped by signal {e.args[0]}: the running part is marked partial; results in {a.out}")
                return 128 + int(e.args[0])
            if not ended:                 # no progress (cannot happen but must not loop): defer the first
                ended = {remaining[0]: ("deferred", "deferred: the worker ended without it")}
                _set_status(a, remaining[0], *ended[remaining[0]])
            for part, (status, note) in ended.items():
                failed |= status == "failed"
                _say(log, f"== {part}: {status}{', ' + note if note else ''}")
            remaining = [p for p in remaining if p not in ended]
        for part in remaining:
            _set_status(a, part, "partial" if _values(a, part) else "deferred", "deferred by the budget")
            _say(log, f"== {part}: deferred by the budget")
        publish(a)
        _say(log, f"== done in {time.time() - T_START:.0f} s: {a.out / 'summary.md'}")
    print((a.out / "summary.md").read_text().split("\n## environment")[0])
    return 1 if failed else 0


def main(argv=None):
    ap = ArgumentParser(prog="gpu_check.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=540, help="seconds this job may take in all (default 540: one "
                                                              "10-minute job with a margin for start-up)")
    ap.add_argument("--parts", nargs="+", default=list(PARTS), help=f"parts to run (default all: {' '.join(PARTS)})")
    ap.add_argument("--force", action="store_true", help="redo the chosen parts' recorded units")
    ap.add_argument("--dry-run", action="store_true", help="no GPU needed: every part on the CPU at toy sizes (checks "
                                                           "the code, measures nothing)")
    ap.add_argument("--device", default="cuda", help="the GPU: cuda | cuda:N")
    ap.add_argument("--out", type=Path, default=None, help="the results to copy back: summary.md, results.json, "
                                                           "gpu_check.log (default benchmarks/results/gpu_<device>)")
    ap.add_argument("--state", type=Path, default=None, help="recorded units, raw outputs, the comparison's runs "
                                                             "(default runs/gpu_check/<out name>-<hash of its path>)")
    ap.add_argument("--part-timeout", type=float, default=600, help="seconds one part may take at most")
    ap.add_argument("--plan", action="store_true", help="print the plan (each part's expected seconds, what the budget "
                                                        "defers) and stop: no GPU, no torch, a second")
    ap.add_argument("--timings", type=Path, default=gpu_plan.TIMINGS, help="seconds measured on a GPU, the plan's "
                                                                           "(default: the H200's)")
    ap.add_argument("--real-shards", type=Path, default=P.REAL_SHARDS, help="annotated webdataset shards of real "
                                                                            "photos (default: `make real-shards`'s)")
    ap.add_argument("--real-seconds", type=float, default=60, help="seconds of PowerCLIP's step fed by the loader "
                                                                   "(real-shards)")
    ap.add_argument("--methods", nargs="+", default=None, help="methods of the parity and step parts "
                                                               "(default: all registered)")
    ap.add_argument("--parity-batch", type=int, default=128, help="batch of the loss parity")
    ap.add_argument("--compile-backend", default="inductor", help="torch.compile backend of the compile part")
    ap.add_argument("--compile-steps", type=int, default=5, help="timed steps of the compile part")
    ap.add_argument("--compare-steps", type=int, default=2000, help="T of the comparison")
    ap.add_argument("--compare-seeds", type=int, nargs="+", default=[0], help="seeds of the comparison")
    ap.add_argument("--runs-dir", type=Path, default=None, help="folder of the comparison's runs (default "
                                                                "STATE/compare)")
    ap.add_argument("--worker", nargs="+", choices=PARTS, default=None, help=argparse.SUPPRESS)   # the worker process
    ap.add_argument("--debug", action="store_true", help="show the traceback of a usage error")
    with usage_errors():
        a = ap.parse_args(argv)
        if a.plan:                                # when called as a function (the command line takes the short way)
            return gpu_plan.main(sys.argv[1:] if argv is None else list(argv))
        a.argv = [x for x in (sys.argv[1:] if argv is None else argv)]
        unknown = [p for p in a.parts if p not in PARTS]
        if unknown:
            raise ValueError(f"--parts: unknown part {unknown[0]!r} (known: {', '.join(PARTS)})")
        a.parts = [p for p in PARTS if p in a.parts]
        _checks.at_least(a, 1, "parity-batch", "compile-steps", "compare-steps", "budget", "real-seconds")
        if not a.dry_run:
            try:
                gpu_plan.load_timings(_checks.existing("--timings", a.timings))
            except (ValueError, KeyError) as e:
                raise ValueError(f"--timings: {e}") from None
        from powerclip.commandline import check_number
        check_number("--part-timeout", a.part_timeout, 0, lo_open=True)     # seconds; NaN passes a `<= 0` check
        if a.dry_run:
            if a.parity_batch == 128:
                a.parity_batch = 16
            if a.compile_backend == "inductor":
                a.compile_backend = "aot_eager"
            if a.real_seconds == 60:
                a.real_seconds = 10
            a.device = "cpu"
        else:
            try:
                d = torch.device(a.device)
            except RuntimeError:
                raise ValueError(f"--device: {a.device!r} is not a device (cuda, cuda:N)") from None
            if d.type != "cuda":
                raise ValueError(f"--device: {a.device!r} is not a GPU (cuda, cuda:N; --dry-run for the CPU)")
            if not torch.cuda.is_available():
                raise ValueError("--device: no CUDA GPU here (torch.cuda.is_available() is False): run it on a machine "
                                 "with one, or with --dry-run to check every part's code on the CPU")
            _checks.device(a.device)
        if a.methods:
            from powerclip.methods import get_method
            for m in a.methods:
                try:
                    get_method(m)
                except KeyError as e:
                    raise ValueError(f"--methods: {e.args[0]}") from None
        if a.out is None:
            a.out = RESULTS / ("gpu_dry_run" if a.dry_run else f"gpu_{slug(device_name(a))}")
        _checks.out_dir("--out", a.out)
        if a.state is None:
            h = hashlib.sha1(str(a.out.resolve()).encode()).hexdigest()[:8]
            a.state = ROOT / "runs" / "gpu_check" / f"{a.out.resolve().name}-{h}"
        _checks.out_dir("--state", a.state)
        if a.runs_dir is not None:
            _checks.out_dir("--runs-dir", a.runs_dir)
    a.out.mkdir(parents=True, exist_ok=True)
    a.state.mkdir(parents=True, exist_ok=True)
    # inductor's compiled kernels in the state folder: a second job (and its other parts) compile warm
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str((a.state / "inductor").resolve()))
    if a.worker:
        return run_worker(a, a.worker)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    return drive(a)


if __name__ == "__main__":
    sys.exit(run_main(main, prog="gpu_check.py"))
