"""Shared by the benchmark scripts: run one measurement in a fresh process, and its peak memory.

Each configuration runs in its own spawned process so that its peak memory is its own: CUDA peak allocated
memory on a GPU, peak resident set size above a baseline on a CPU (the baseline is taken after warm-up, so the
number is the extra memory one step needs, not the interpreter, the model or the inputs).
"""
from __future__ import annotations

import multiprocessing as mp
import os

import torch
from powerclip.train import PeakMemory  # noqa: F401 (the trainer's own measure, re-exported for the scripts)


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
