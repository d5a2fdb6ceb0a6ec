"""torch.compile (inductor, on this CPU) computes what eager computes: the trainer's compiled step
(`model.compile=true`) and the blocked S-bar of `powerset_fast` with its custom backward (issue 22). A GPU day then only
has speed to find out (`benchmarks/gpu_check.py`, part `compile`).

Inductor needs a C++ compiler (gcc here). Compiling takes more than a minute on 2 cores with a cold inductor cache
(measured: the training step 82 s, S-bar 47 s; 18 s and 10 s once `TORCHINDUCTOR_CACHE_DIR` holds their kernels), so
both tests run only with POWERCLIP_SLOW=1:

    POWERCLIP_SLOW=1 .venv/bin/python -m pytest -q tests/test_compile.py

S-bar compiles with graph breaks at its host reads of the node counts (`node_counts(...).tolist()`, the range check
in `node_counts`): between them inductor compiles the blocks' arithmetic; the result is the same to 1e-12 in float64.
"""
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None and shutil.which("gcc") is None,
                                reason="inductor needs a C++ compiler")
slow = pytest.mark.skipif(not os.environ.get("POWERCLIP_SLOW"), reason="about a minute of compiling: "
                                                                       "POWERCLIP_SLOW=1 runs it")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@slow
def test_compiled_training_step_equals_eager():
    "Two steps of PowerCLIP on the smoke preset, fp32: losses, terms, gradient norms and weights, compiled vs eager."
    from powerclip import dist as pdist
    from powerclip.train import TrainState, build_run, load_config
    res = {}
    for compiled in (False, True):
        cfg = load_config("smoke", ["resume=never", f"model.compile={str(compiled).lower()}"], method="powerclip")
        run = build_run(cfg, pdist.DistContext())
        it, state, outs = iter(run.loader()), TrainState(), []
        for i in range(2):
            run.method.on_step(i, run.total)
            outs.append(run.step(run.prepare(next(it)), state))
        res[compiled] = outs, [p.detach().clone() for p in run.model.parameters()]
    (eager, w_e), (comp, w_c) = res[False], res[True]
    for a, b in zip(comp, eager):
        assert a["ok"] and b["ok"]
        for k in ("loss", "clip", "powerset", "grad_norm"):
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)
    # AdamW's first steps move each weight by about lr * sign(g): the weights agree as a whole
    d = torch.cat([(a - b).flatten() for a, b in zip(w_c, w_e)]).norm() / torch.cat([b.flatten() for b in w_e]).norm()
    assert float(d) < 1e-5


@slow
def test_compiled_sbar_blocked_equals_eager():
    "S-bar's blocked path under inductor, float64: values and both gradients, with rows split across blocks."
    from powerclip.powerset_fast import SbarSpec, sbar_blocked
    g = torch.Generator().manual_seed(0)
    Ci, Cj, M, D = 5, 6, 4, 8
    reg = F.normalize(torch.randn(Ci, M, D, generator=g, dtype=torch.float64), dim=-1)
    rv = torch.rand(Ci, M, generator=g) < 0.7
    rv[0] = True
    rv[1] = False
    k = torch.randint(1, 6, (Cj,), generator=g)
    k[0] = 1
    nt = torch.arange(Cj).repeat_interleave(k)
    ph = torch.randn(int(k.sum()), D, generator=g, dtype=torch.float64)
    W = torch.randn(Ci, Cj, generator=g, dtype=torch.float64)
    spec = SbarSpec(tau=0.3, block_bytes=600)
    f = lambda r, p: sbar_blocked(r, rv, p, nt, Cj, spec)
    out = []
    for fn in (f, torch.compile(f)):
        r, p = reg.clone().requires_grad_(), ph.clone().requires_grad_()
        S = fn(r, p)
        (S * W).sum().backward()
        out.append((S.detach(), r.grad, p.grad))
    for a, b in zip(*out):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
