"""Shared by every test: without a GPU, Triton kernels run in Triton's interpreter on CPU tensors
(`powerclip.sbar_triton`, tests/test_sbar_triton.py). The variable must be set before the kernels are defined, so
here, before any test imports powerclip; it changes nothing on the CPU paths (no other code runs Triton there)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
