"""Shared by the benchmark scripts: run one measurement in a fresh process, and its peak memory.

Each configuration runs in its own spawned process so that its peak memory is its own: CUDA peak allocated
memory on a GPU, peak resident set size above a baseline on a CPU (the baseline is taken after warm-up, so the
number is the extra memory one step needs, not the interpreter, the model or the inputs).
"""
from __future__ import annotations

import os

import torch
from powerclip.train import PeakMemory  # noqa: F401 (the trainer's own measure, re-exported for the scripts)
from powerclip.train import run_isolated as _run_isolated


def sync(device: str) -> None:
    "Wait for queued GPU work, so that wall-clock times measure it."
    if device == "cuda": torch.cuda.synchronize()


def run_isolated(fn, *args) -> dict:
    "fn(*args) -> dict, in a fresh spawned process using every core; {'ok': True, **result} or {'ok': False, 'error': ...}."
    return _run_isolated(fn, *args, threads=os.cpu_count() or 1)
