"""The fused Triton S-bar (`powerclip.sbar_triton`, notebook 10b) against the float64 dense reference, on the CPU
under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 when there is no GPU): every switch of
SbarSpec, ragged inputs whose texts are longer than a tile, tiles that cut texts, an image without a valid region,
one-node texts, tau = 1e-3 in float32 and bf16, the DDP forms, the loss's padded and packed inputs, the op's
dispatch, torch.compile, and the one-line refusal without a GPU or the interpreter."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")

from powerclip.powerset_fast import SbarSpec, ragged_case, sbar_blocked, sbar_dense
from powerclip.sbar_triton import Tiles, sbar_triton, triton_parity, unavailable


def _interpreter_problem() -> str | None:
    "Why the kernels cannot run here (None: they can): no GPU and no interpreter, or an interpreter that fails."
    if torch.cuda.is_available():
        return None
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return "no GPU and TRITON_INTERPRET unset"
    import triton.language as tl

    @triton.jit
    def _loop(x_ptr, lo_ptr, hi_ptr):
        acc = 0.0
        for i in range(tl.load(lo_ptr), tl.load(hi_ptr)):          # a loop with runtime bounds, as the kernels'
            acc += tl.load(x_ptr + i)
        tl.store(x_ptr, acc)

    x = torch.ones(4)
    try:
        _loop[(1,)](x, torch.tensor([1]), torch.tensor([4]))
    except Exception as e:  # torch 2.11's triton 3.6 interpreter under numpy >= 2.4: "only 0-dimensional arrays ..."
        return (f"triton {triton.__version__}'s interpreter cannot run a loop with runtime bounds under numpy "
                f"{np.__version__} ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
    return None if float(x[0]) == 3.0 else "the interpreter's loop gave a wrong sum"


_PROBLEM = _interpreter_problem()
pytestmark = pytest.mark.skipif(_PROBLEM is not None, reason=_PROBLEM or "")

SMALL = Tiles(rows=16, nodes=16, texts=4)      # texts cross chunks and groups at these sizes
DEV = "cuda" if torch.cuda.is_available() else "cpu"   # the interpreter's CPU tensors, or a GPU's
SPECS = {
    "softplus/tanh": SbarSpec(),
    "softplus/tanh alpha 0": SbarSpec(alpha=0.0),
    "softplus/tanh alpha 1": SbarSpec(alpha=1.0),
    "relu/tanh": SbarSpec(t1_act="relu", tau=1e-2),
    "gelu/tanh": SbarSpec(t1_act="gelu", tau=0.1),
    "swish/tanh": SbarSpec(t1_act="swish", tau=0.05),
    "softplus/sigmoid": SbarSpec(t2_act="sigmoid", tau=0.05),
    "softplus/softsign": SbarSpec(t2_act="softsign", tau=0.05),
    "T2R only": SbarSpec(use_r2t=False),
    "R2T only": SbarSpec(use_t2r=False),
    "debias": SbarSpec(debias_t2=True, tau=0.1),
    "no region sets": SbarSpec(region_sets=False),
    "no sets, T2R only": SbarSpec(region_sets=False, use_r2t=False),
    "no sets, R2T only": SbarSpec(region_sets=False, use_t2r=False),
}
CASES = {
    # 7 images in tiles of 4 (images 4-6 a partial tile, with valid regions), 9 texts in groups of 4 (text 8 alone, 24
    # nodes), texts of up to 38 nodes: several chunks of 16 each
    "partial tiles": dict(Ci=7, Cj=9, M=4, D=8, Kmax=40, seed=3),
    "long texts": dict(Ci=7, Cj=13, M=10, D=24, Kmax=27, seed=3),      # texts up to 27 nodes, tiles of 16
    "one-node texts": dict(Ci=6, Cj=9, M=3, D=8, Kmax=1, seed=4),      # every text its root only
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
@pytest.mark.parametrize("spec", SPECS, ids=list(SPECS))
def test_fp32_matches_float64(spec, case):
    "Values within 1e-5 relative, gradients within 1e-4 of the largest (both inputs), against float64."
    ev, eg = triton_parity(SPECS[spec], SMALL, device=DEV, **CASES[case])
    assert ev < 1e-5 and eg < 1e-4, (ev, eg)


def test_default_tiles_and_every_text_its_own_group():
    "The default tiles (the GPU's), and groups of one text, on the long-text case."
    for tiles in (Tiles(), Tiles(rows=16, nodes=16, texts=1)):
        ev, eg = triton_parity(SbarSpec(), tiles, device=DEV, **CASES["long texts"])
        assert ev < 1e-5 and eg < 1e-4, (tiles, ev, eg)


def test_tau_1e3_fp32_and_bf16():
    "Scores up to ~20 at tau = 1e-3: finite; float32 at float64; bf16 within twice the blocked path's bf16 error."
    reg, rv, ph, nt = (t.to(DEV) for t in ragged_case(6, 8, M=10, D=32, Kmax=12, seed=9, scale=3.0))
    W = torch.randn(6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).to(DEV)
    res = {}
    for name, f, dtype, ac in (("fp64", sbar_dense, torch.float64, False), ("fp32", sbar_triton, torch.float32, False),
                               ("bf16", sbar_triton, torch.float32, True),
                               ("bf16 blocked", sbar_blocked, torch.float32, True)):
        r, p = reg.to(dtype, copy=True).requires_grad_(), ph.to(dtype, copy=True).requires_grad_()
        with torch.autocast(DEV, dtype=torch.bfloat16, enabled=ac):
            S = f(r, rv, p, nt, 8, SbarSpec(tau=1e-3))
        g = torch.autograd.grad(S, (r, p), W.to(S.dtype))
        assert all(torch.isfinite(t).all() for t in (S, *g)), name
        res[name] = [t.detach().double() for t in (S, *g)]
    for a, b in zip(res["fp32"], res["fp64"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-3)
    rel = lambda a, b: float((a - b).norm() / b.norm())
    for a, b, c in zip(res["bf16"], res["bf16 blocked"], res["fp32"]):
        assert rel(a, c) <= 2 * rel(b, c) + 1e-3


def test_ddp_forms():
    "Local rows against all columns, and all rows against local columns, are the full matrix's slices."
    reg, rv, ph, nt = (t.to(DEV) for t in ragged_case(9, 11, M=6, D=16, Kmax=9, seed=5, dtype=torch.float32))
    full = sbar_triton(reg, rv, ph, nt, 11, SbarSpec(), SMALL)
    torch.testing.assert_close(full, sbar_blocked(reg, rv, ph, nt, 11, SbarSpec()), rtol=1e-5, atol=1e-6)
    o, R = 3, 4
    mine = (nt >= o) & (nt < o + R)
    torch.testing.assert_close(sbar_triton(reg[o:o + R], rv[o:o + R], ph, nt, 11, SbarSpec(), SMALL), full[o:o + R],
                               rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sbar_triton(reg, rv, ph[mine], nt[mine] - o, R, SbarSpec(), SMALL), full[:, o:o + R],
                               rtol=1e-6, atol=1e-6)


def test_no_valid_region_and_empty_sides():
    "An image without a valid region gets the blocked path's row; no images or no texts give an empty S-bar."
    reg, rv, ph, nt = (t.to(DEV) for t in ragged_case(4, 5, M=4, D=8, Kmax=4, seed=7, dtype=torch.float32))
    rv[:] = False
    torch.testing.assert_close(sbar_triton(reg, rv, ph, nt, 5, SbarSpec(), SMALL),
                               sbar_blocked(reg, rv, ph, nt, 5, SbarSpec()), rtol=1e-5, atol=1e-6)
    assert sbar_triton(reg[:0], rv[:0], ph, nt, 5).shape == (0, 5)


def test_one_op_forward_and_backward():
    "A forward and backward call dispatches no matrix product, segment reduction or activation, only the two ops."
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(func._schema.name.split("::")[-1])
            return func(*args, **(kwargs or {}))

    bad = ("mm", "bmm", "addmm", "matmul", "einsum", "index_add", "index_add_", "scatter", "scatter_add",
           "scatter_reduce", "softplus", "logsumexp", "log1p", "sigmoid", "tanh", "exp", "log", "gelu", "silu", "relu")
    reg, rv, ph, nt = (t.to(DEV) for t in ragged_case(4, 5, M=4, D=8, Kmax=4, seed=2, dtype=torch.float32))
    for spec in (SbarSpec(), SbarSpec(region_sets=False)):
        r, p = reg.clone().requires_grad_(), ph.clone().requires_grad_()
        with Ops() as ops:
            S = sbar_triton(r, rv, p, nt, 5, spec, SMALL, counts=torch.bincount(nt, minlength=5).tolist())
            torch.autograd.grad(S, (r, p), torch.ones_like(S))
        assert {"sbar_fwd", "sbar_bwd"} <= set(ops.seen)
        assert not [n for n in ops.seen if n.split(".")[0] in bad], ops.seen


def test_compiles_in_one_graph():
    "torch.compile(fullgraph=True) through AOTAutograd: no graph break, the same gradients."
    reg, rv, ph, nt = (t.to(DEV) for t in ragged_case(4, 5, M=4, D=8, Kmax=4, seed=2, dtype=torch.float32))
    f = lambda r, p: (sbar_triton(r, rv, p, nt, 5, SbarSpec(), SMALL) ** 2).sum()
    grads = []
    for fn in (torch.compile(f, fullgraph=True, backend="aot_eager"), f):
        r, p = reg.clone().requires_grad_(), ph.clone().requires_grad_()
        grads.append(torch.autograd.grad(fn(r, p), (r, p)))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_refused_in_one_line_without_gpu_or_interpreter():
    "impl='triton' on the CPU without the interpreter: one line naming the way out."
    assert unavailable("mps").startswith("impl='triton'")
    code = ("import torch\nfrom powerclip.powerset_fast import ragged_case\n"
            "from powerclip.sbar_triton import sbar_triton\n"
            "r, rv, p, nt = ragged_case(dtype=torch.float32)\n"
            "try:\n    sbar_triton(r, rv, p, nt, 6)\nexcept RuntimeError as e:\n    print(e)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the kernels run")
    assert out.returncode == 0 and out.stdout.count("\n") == 1 and "needs a CUDA GPU" in out.stdout, out


def test_compiles_for_sm90_without_spills():
    "The kernels at the default bf16 tiles compile for an H100/H200 with Triton's ptxas, no GPU: no register spills."
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "sbar_triton_compile.py"), "--quick"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    last = out.stdout.splitlines()[-1]
    rep = json.loads(last[last.index("{"):])
    assert set(rep) == {"_sbar_fwd_kernel", "_sbar_bwd_regions", "_sbar_bwd_nodes"}
    for k, r in rep.items():
        assert r["stack"] in (0, None) and r["shared"] <= 227 * 1024, (k, r)


def test_trainer_refuses_triton_without_gpu_in_one_line(tmp_path):
    "`method_cfg.impl=triton` on a CPU without the interpreter: exit 2, one line, before any file is written."
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the kernels run")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "powerclip.train", "--preset", "smoke", "--method", "powerclip",
                          "method_cfg.impl=triton", "max_steps=1", f"out_dir={tmp_path / 'run'}", "progress=false"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0, out.stderr
    assert "impl='triton' needs a CUDA GPU" in out.stderr and not (tmp_path / "run").exists()


# The tests below guard what the parity tests above cannot see: a sum kept in bf16, ties, strides, autocast, a text
# without a node. Triton's interpreter turns float32 into bf16 by truncation (1.0048828125 -> 1.0; torch and a GPU
# round to nearest: 1.0078125), so a bf16 rounding here errs up to 2^-8 relative, always towards zero, where a GPU's
# errs up to 2^-9 either way; the tolerances below hold under both.


def _long_case(R=8, C=16, K=64, M=4, D=32, seed=11):
    """R images against C texts of K nodes each (long sums: K = 64, P = 1,024 nodes, 64 chunks of 16), every region
    valid: in bf16 (inputs rounded, then exact in float64), with an upstream gradient G in bf16. With K and M powers of
    two, the hard maxima's and ReLU's score gradients (G / K, G / M) are exact in bf16: the only roundings left in a
    gradient are its accumulators' and its output's."""
    g = torch.Generator().manual_seed(seed)
    regions = torch.nn.functional.normalize(torch.randn(R, M, D, generator=g, dtype=torch.float64), dim=-1)
    phrases = torch.randn(C * K, D, generator=g, dtype=torch.float64)
    G = torch.randn(R, C, generator=g, dtype=torch.float64).bfloat16().double()
    rv = torch.ones(R, M, dtype=torch.bool)
    return regions.bfloat16(), rv, phrases.bfloat16(), torch.arange(C).repeat_interleave(K), G


def _value_and_grads(f, reg, rv, ph, nt, n, spec, G, **kw):
    r, p = reg.detach().requires_grad_(), ph.detach().requires_grad_()      # strides kept
    S = f(r, rv, p, nt, n, spec, **kw)
    return [t.detach().double() for t in (S, *torch.autograd.grad(S, (r, p), G.to(S.dtype)))]


@pytest.mark.parametrize("spec", [SbarSpec(t1_act="relu", tau=0.05, use_r2t=False), SbarSpec(tau=0.05)],
                         ids=["T2R relu", "softplus/tanh"])
def test_bf16_error_within_the_blocked_paths(spec):
    """FlashAttention's rule: on bf16 inputs with long sums (`_long_case`), the kernel's largest error against float64
    (on the same bf16-rounded inputs) is at most 2x the blocked path's in bf16 for S-bar, 3x for the gradients. A sum
    kept in bf16 (the forward's T1 accumulator, the backward's region accumulator) errs many times more."""
    reg, rv, ph, nt, G = (t.to(DEV) for t in _long_case())
    n = G.shape[1]
    ref = _value_and_grads(sbar_dense, reg.double(), rv, ph.double(), nt, n, spec, G)
    kern = _value_and_grads(sbar_triton, reg, rv, ph, nt, n, spec, G, tiles=SMALL)
    blk = _value_and_grads(sbar_blocked, reg, rv, ph, nt, n, spec, G)
    for name, a, b, c, k in zip(("S", "d regions", "d phrases"), kern, blk, ref, (2, 3, 3)):
        ek, eb = float((a - c).abs().max()), float((b - c).abs().max())
        assert ek <= k * eb, (name, ek, eb)


def test_bf16_scores_entry_by_entry():
    """bf16 inputs: each S-bar entry within 1e-5 (relative, floor 1) of float64 on the same rounded inputs (the
    products are exact in float32 and the sums run there); a sum rounded to bf16 misses by ~1e-3 or more."""
    reg, rv, ph, nt, G = (t.to(DEV) for t in _long_case(C=4))
    for spec in (SbarSpec(tau=0.05), SbarSpec(tau=0.05, region_sets=False)):
        S = sbar_triton(reg, rv, ph, nt, 4, spec, SMALL).double()
        ref = sbar_dense(reg.double(), rv, ph.double(), nt, 4, spec)
        torch.testing.assert_close(S, ref, rtol=1e-5, atol=1e-5)


def _ties_case():
    """5 images against 4 texts: image 0's regions 0 and 2 equal (all valid); text 1 has 24 nodes, 8 distinct ones
    thrice (node i = i + 8 = i + 16), so each of its maxima is tied three ways, within a chunk of 16 and across two."""
    reg, rv, ph, nt = ragged_case(5, 4, M=4, D=8, Kmax=5, seed=7, dtype=torch.float32)
    rv[0] = True
    reg[0, 2] = reg[0, 0]
    base = torch.randn(8, 8, generator=torch.Generator().manual_seed(3))
    ph = torch.cat([ph[nt == 0], base.repeat(3, 1), ph[nt >= 2]])
    nt = torch.cat([nt[nt == 0], torch.ones(24, dtype=torch.long), nt[nt >= 2]])
    return reg, rv, ph, nt


@pytest.mark.parametrize("spec", [SbarSpec(region_sets=False, use_r2t=False),
                                  SbarSpec(region_sets=False, use_t2r=False)], ids=["T2R", "R2T"])
def test_exact_ties_split_as_the_dense_path(spec):
    """'w/o region sets' with exact ties (duplicate regions, duplicate nodes within and across chunks): the gradient
    is split evenly among the tied maxima, as torch's amax (the dense path) splits it."""
    reg, rv, ph, nt = (t.to(DEV) for t in _ties_case())
    G = torch.randn(5, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(DEV)
    ref = _value_and_grads(sbar_dense, reg.double(), rv, ph.double(), nt, 4, spec, G)
    got = _value_and_grads(sbar_triton, reg, rv, ph, nt, 4, spec, G, tiles=SMALL)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("act", ["relu", "softplus", "gelu", "swish"])
def test_activations_at_exactly_zero(act):
    """Scores exactly 0 (image 0's regions and text 1's nodes on disjoint coordinates): each activation's derivative
    at 0 is torch's (ReLU's: 0), against autograd through the float64 dense path."""
    reg, rv, ph, nt = ragged_case(4, 3, M=4, D=8, Kmax=4, seed=5, dtype=torch.float32)
    reg[0, :, 4:] = 0.0
    ph[nt == 1, :4] = 0.0
    reg, rv, ph, nt = (t.to(DEV) for t in (reg, rv, ph, nt))
    spec = SbarSpec(t1_act=act, tau=0.1)
    G = torch.randn(4, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(DEV)
    ref = _value_and_grads(sbar_dense, reg.double(), rv, ph.double(), nt, 3, spec, G)
    got = _value_and_grads(sbar_triton, reg, rv, ph, nt, 3, spec, G, tiles=SMALL)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_strided_inputs_and_upstream_gradients():
    """A transposed and an expanded upstream gradient, and transposed / sliced inputs: the contiguous result."""
    reg, rv, ph, nt = (t.to(DEV) for t in ragged_case(5, 6, M=4, D=8, Kmax=5, seed=2, dtype=torch.float32))
    W = torch.randn(6, 5, generator=torch.Generator().manual_seed(4)).to(DEV)
    want = _value_and_grads(sbar_triton, reg, rv, ph, nt, 6, SbarSpec(), W.t().contiguous(), tiles=SMALL)
    got = _value_and_grads(sbar_triton, reg, rv, ph, nt, 6, SbarSpec(), W.t(), tiles=SMALL)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    row = torch.randn(6, generator=torch.Generator().manual_seed(5)).to(DEV)
    want = _value_and_grads(sbar_triton, reg, rv, ph, nt, 6, SbarSpec(), row.expand(5, 6).contiguous(), tiles=SMALL)
    got = _value_and_grads(sbar_triton, reg, rv, ph, nt, 6, SbarSpec(), row.expand(5, 6), tiles=SMALL)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    reg_t = reg.permute(2, 1, 0).contiguous().permute(2, 1, 0)          # (5, 4, 8) with strides (1, 5, 20)
    ph_t = torch.stack([ph, ph], -1)[..., 0]                             # every other float: stride 2
    assert not reg_t.is_contiguous() and not ph_t.is_contiguous() and torch.equal(ph_t, ph)
    G = torch.randn(5, 6, generator=torch.Generator().manual_seed(6)).to(DEV)
    want = _value_and_grads(sbar_triton, reg, rv, ph, nt, 6, SbarSpec(), G, tiles=SMALL)
    got = _value_and_grads(sbar_triton, reg_t, rv, ph_t, nt, 6, SbarSpec(), G, tiles=SMALL)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_autocast_reaches_the_kernels():
    """Under autocast(bfloat16) the ops receive bf16 regions and phrases (forward and backward), and S-bar has the
    blocked path's dtype under the same autocast."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Args(TorchDispatchMode):
        seen = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._schema.name.split("::")[-1]
            if name in ("sbar_fwd", "sbar_bwd"):
                self.seen[name] = [a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
            return func(*args, **(kwargs or {}))

    reg, rv, ph, nt = (t.to(DEV) for t in ragged_case(4, 5, M=4, D=8, Kmax=4, seed=2, dtype=torch.float32))
    r, p = reg.clone().requires_grad_(), ph.clone().requires_grad_()
    with torch.autocast(DEV, dtype=torch.bfloat16):
        with Args() as seen:
            S = sbar_triton(r, rv, p, nt, 5, SbarSpec(), SMALL)
            torch.autograd.grad(S, (r, p), torch.ones_like(S))
        want = sbar_blocked(reg, rv, ph, nt, 5, SbarSpec())
    assert seen.seen["sbar_fwd"][:2] == [torch.bfloat16, torch.bfloat16], seen.seen
    assert seen.seen["sbar_bwd"][1:3] == [torch.bfloat16, torch.bfloat16], seen.seen
    assert S.dtype == want.dtype


def test_text_without_node_refused_in_one_line():
    """A text with no node: one line, as the blocked and dense paths say it, from the host counts or (CPU tensors)
    from node_text; the loss passes its host counts."""
    reg, rv, ph, nt = ragged_case(4, 5, M=4, D=8, Kmax=4, seed=2, dtype=torch.float32)
    gap = torch.where(nt == 2, 1, nt)                                    # text 2 loses its nodes to text 1
    for node_text, kw in ((gap, dict()), (nt, dict(counts=[1, 1, 0, 1, 1]))):
        with pytest.raises(ValueError, match="every text needs at least one valid tree node") as e:
            sbar_triton(reg, rv, ph, node_text, 5, SbarSpec(), SMALL, **kw)
        assert "\n" not in str(e.value)
