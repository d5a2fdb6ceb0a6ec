"""Shared by the benchmark scripts: run one measurement in a fresh process, and its peak memory.

Each configuration runs in its own spawned process so that its peak memory is its own: CUDA peak allocated
memory on a GPU, peak resident set size above a baseline on a CPU (the baseline is taken after warm-up, so the
number is the extra memory one step needs, not the interpreter, the model or the inputs).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import resource

import torch


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakMemory:
    "Call `start()` after warm-up, then `mib()` after the measured steps."
    def __init__(self, device: str):
        self.device, self.base = device, 0

    def start(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); self.base = torch.cuda.memory_allocated()
        else:
            self.base = _rss_bytes()

    def mib(self) -> float:
        peak = (torch.cuda.max_memory_allocated() if self.device == "cuda"
                else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        return max(peak - self.base, 0) / 2**20


def sync(device: str) -> None:
    "Wait for queued GPU work, so that wall-clock times measure it."
    if device == "cuda": torch.cuda.synchronize()


def _child(fn, args, q):
    try:
        torch.set_num_threads(os.cpu_count() or 1)
        q.put(dict(ok=True, **fn(*args)))
    except Exception as e:  # e.g. out of memory: report it, do not kill the sweep
        q.put(dict(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"))


def run_isolated(fn, *args) -> dict:
    "fn(*args) -> dict, in a fresh spawned process; returns {'ok': True, **result} or {'ok': False, 'error': ...}."
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(fn, args, q))
    p.start(); p.join()
    return q.get() if not q.empty() else dict(ok=False, error=f"child exited with code {p.exitcode} (likely killed for memory)")
