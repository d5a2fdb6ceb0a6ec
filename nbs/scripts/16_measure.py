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
#| default_exp measure

# %%
#| export
from __future__ import annotations

import os

import torch


# %% [markdown]
# # Measuring
#
# > A fresh process per measurement, its peak memory, and waiting for the GPU.
#
# This is what the trainer, the comparison and the benchmark scripts share to report time and memory honestly.

# %% [markdown]
# Three small tools, each used by more than one caller (the trainer reports a run's peak memory, the comparison in
# `70_compare` trains each method in a fresh process, and every script in `benchmarks/` times and measures):
#
# - `run_isolated(fn, *args)` runs `fn(*args) -> dict` in a freshly spawned process, so that what it measures (its
#   peak memory above all) is its own and not the caller's; a child that dies without answering (killed for memory,
#   or by a signal) is reported as an error instead of hanging the caller; a SIGINT or SIGTERM the caller receives
#   meanwhile is passed on to the child and noted in the result (the comparison's runner then stops after the run,
#   which stopped at a step boundary with its checkpoint: `70_compare`);
# - `PeakMemory` measures the peak memory of what runs between `start()` and `mib()`: CUDA peak allocated memory above
#   what was allocated at `start` on a GPU; on a CPU, the process's peak resident set size above its size at `start`
#   (so a run in a fresh process reports what its steps needed, not the interpreter's own size). The CPU number is
#   coarser: the peak resident set of a process only grows, so in a process that already peaked higher it reports
#   that older peak;
# - `sync(device)` waits for the GPU's queued work, so that a wall-clock time measures it.

# %%
#| export
def sync(device) -> None:
    "Wait for queued GPU work, so that wall-clock times measure it (no-op on a CPU)."
    if str(device).split(":")[0] == "cuda":
        torch.cuda.synchronize()


class PeakMemory:
    """Peak memory of what runs between `start()` and `mib()`: CUDA peak allocated memory above what was allocated at
    `start` on a GPU; on a CPU, the process's peak resident set size above its size at `start`."""
    def __init__(self, device):
        self.device, self.base = str(device).split(":")[0], 0

    def start(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/statm") as f:
                self.base = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def mib(self) -> float:
        import resource
        peak = (torch.cuda.max_memory_allocated() if self.device == "cuda"
                else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        return max(peak - self.base, 0) / 2**20


def _isolated_child(fn, args, threads, q) -> None:
    try:
        if threads:
            torch.set_num_threads(threads)
        q.put(dict(ok=True, **fn(*args)))
    except BaseException as e:  # e.g. out of memory: report it, do not kill the caller's sweep
        # a run stopped by a signal at a step boundary (`17_commandline`, `Interrupted`) says which, and its line
        # and a write the machine refused (`WriteFailed`, exit status 3: a full disk) its status, to be passed on
        q.put(dict(ok=False, error=f"{type(e).__name__}: {e}", **({"signal": e.signum, "message": str(e)}
                                                                   if hasattr(e, "signum") else
                                                                   {"status": e.status, "message": str(e)}
                                                                   if isinstance(getattr(e, "status", None), int)
                                                                   else {})))


def run_isolated(fn, *args, threads: int | None = None) -> dict:
    """`fn(*args) -> dict` in a fresh spawned process (so that, e.g., its peak memory is its own); returns
    `{'ok': True, **result}` or `{'ok': False, 'error': ...}`, also when the child dies without answering.
    `threads`: torch threads in the child (None: torch's default). `fn` must be importable by the child. SIGINT and
    SIGTERM received while waiting are passed on to the child (a trainer there stops at its next step boundary) and
    noted: the result then holds `signal`, the first one (and, from a child that stopped for it, its `message`)."""
    import multiprocessing as mp, queue, signal, threading
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_isolated_child, args=(fn, args, threads, q))
    got, old = [], {}

    def forward(signum, frame):
        got.append(signum)
        if p.pid is not None and p.is_alive():
            os.kill(p.pid, signum)      # a Ctrl-C reached the child too (same process group): it stops once
    p.start()
    if threading.current_thread() is threading.main_thread():
        old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:  # poll: a child killed for memory (or by a signal) never answers
            try:
                res = q.get(timeout=5)
                break  # before join: a large result would otherwise block the child's exit
            except queue.Empty:
                if not p.is_alive() and q.empty():
                    res = dict(ok=False, error=f"the process died with exit code {p.exitcode} (killed for memory?)")
                    break
        p.join()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if got:
        res.setdefault("signal", got[0])
    return res


# %% [markdown]
# A function in a fresh process hands back its dict, or the error it raised; neither hangs nor raises here. The child
# imports what it runs, so the check goes through the exported module (what this notebook defines lives in the
# kernel's `__main__`, which a spawned child cannot import), and built-in functions stand in for a measurement.

# %%
from powerclip import measure
assert measure.run_isolated(dict, [("a", 1)]) == {"ok": True, "a": 1}
_bad = measure.run_isolated(dict, 5)
assert _bad["ok"] is False and _bad["error"].startswith("TypeError"), _bad

# %% [markdown]
# Touching 128 MiB between `start` and `mib` shows up (at least that much: the peak of a process only grows):

# %%
_mem = PeakMemory("cpu")
_mem.start()
_x = torch.ones(32 * 2**20)          # 128 MiB of float32, written
print(f"peak above start: {_mem.mib():.0f} MiB")
assert _mem.mib() >= 100
del _x
sync("cpu")
