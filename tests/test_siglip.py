"""`powerclip.loss.siglip_loss` against open_clip's `SigLipLoss`, the reference no one here wrote.

On the same features, in one process and in 2 and 3 gloo processes (3 because open_clip's `bidir` with 2 processes runs
only its one-way remainder), for each of open_clip's four `dist_impl` (bidir, shift, reduce, gather): the loss each
process returns and the gradient of every input (the local image and text features, the scale and the bias), relative
error at most 1e-12 in float64 and 1e-6 in float32. Ours gathers the texts through `powerclip.dist.gather` (the one
contract `clip_loss` uses: one collective with gradient, the positives at `offset + arange(R)`); open_clip exchanges
them its own ways. The gradient of a process's text features is, on both sides, the sum over every process's loss
(the gather's backward; open_clip's exchanges send theirs back).

Also: the promotion of the similarities to at least float32 under bf16 autocast (C2LIP's, kept in the shared loss),
and that C2LIP calls the shared loss (no copy of its own).
"""
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

IMPLS = ("bidir", "shift", "reduce", "gather")
R = 3            # rows per process
D = 5
TOL = {torch.float64: 1e-12, torch.float32: 1e-6}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _inputs(rank: int, dtype):
    "Process `rank`'s features (unit vectors: the regime of the loss), t = exp(log 10) and b = -10."
    g = torch.Generator().manual_seed(7 + rank)
    img = F.normalize(torch.randn(R, D, generator=g, dtype=torch.float64), dim=-1).to(dtype)
    txt = F.normalize(img.double() + 0.8 * torch.randn(R, D, generator=g, dtype=torch.float64), dim=-1).to(dtype)
    scale, bias = torch.tensor(10.0, dtype=dtype), torch.tensor(-10.0, dtype=dtype)   # SigLIP's init
    return [x.clone().requires_grad_() for x in (img, txt, scale, bias)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def _ours(x, ctx):
    from powerclip.dist import gather
    from powerclip.loss import siglip_loss
    img, txt, scale, bias = x
    g = gather(ctx, {"text": txt})
    loss = siglip_loss(img, txt, scale, bias, g.all["text"], g.offset)
    return loss, torch.autograd.grad(loss, x)


def _theirs(x, rank, world, impl):
    from open_clip.loss import SigLipLoss
    img, txt, scale, bias = x
    loss = SigLipLoss(rank=rank, world_size=world, dist_impl=impl)(img, txt, scale, bias)
    return loss, torch.autograd.grad(loss, x)


def _worker(rank, world, port, out):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from powerclip.dist import cleanup, init_distributed
    ctx = init_distributed("cpu")
    res = {}
    for dtype in TOL:
        ours = _ours(_inputs(rank, dtype), ctx)
        for impl in IMPLS:
            res[(dtype, impl)] = (ours, _theirs(_inputs(rank, dtype), rank, world, impl))
    torch.save(res, f"{out}.{rank}")
    cleanup(ctx)


def _check(ours, theirs, dtype, what):
    (l1, g1), (l2, g2) = ours, theirs
    assert l1.dtype == dtype
    assert _rel(l1, l2) <= TOL[dtype], f"{what}: loss {float(l1)} vs {float(l2)}"
    for name, a, b in zip(("image", "text", "logit_scale", "logit_bias"), g1, g2):
        assert _rel(a, b) <= TOL[dtype], f"{what}: grad of {name} differs by {_rel(a, b):.2e}"


@pytest.mark.parametrize("dtype", list(TOL), ids=["fp64", "fp32"])
def test_one_process(dtype):
    from powerclip.dist import DistContext
    for impl in IMPLS:
        _check(_ours(_inputs(0, dtype), DistContext()), _theirs(_inputs(0, dtype), 0, 1, impl), dtype, impl)


@pytest.mark.parametrize("world", [2, 3])
def test_processes(world, tmp_path):
    out = tmp_path / "siglip"
    mp.start_processes(_worker, args=(world, _free_port(), str(out)), nprocs=world, join=True, start_method="spawn")
    for rank in range(world):
        res = torch.load(f"{out}.{rank}", weights_only=False)
        assert len(res) == len(TOL) * len(IMPLS)
        for (dtype, impl), (ours, theirs) in res.items():
            _check(ours, theirs, dtype, f"{world} processes, rank {rank}, {impl}, {dtype}")


def test_processes_mean_is_the_full_batch():
    "The mean of the per-process losses (what DDP's averaging trains) is the one-process loss on the whole batch."
    from powerclip.loss import siglip_loss
    xs = [_inputs(r, torch.float64) for r in range(3)]
    img, txt = torch.cat([x[0] for x in xs]).detach(), torch.cat([x[1] for x in xs]).detach()
    s, b = xs[0][2].detach(), xs[0][3].detach()
    parts = [siglip_loss(img[r * R:(r + 1) * R], txt[r * R:(r + 1) * R], s, b, txt, r * R) for r in range(3)]
    torch.testing.assert_close(sum(parts) / 3, siglip_loss(img, txt, s, b), rtol=1e-14, atol=0)
    # the positives sit at offset + arange(R): a wrong offset gives another loss
    assert abs(float(siglip_loss(img[R:2 * R], txt[R:2 * R], s, b, txt, 0) - parts[1])) > 1e-3


def test_promotion_under_autocast():
    "bf16 similarities are promoted to float32 before t * s + b: the loss is float32 and equals that computation."
    from powerclip.loss import siglip_loss
    img, txt, _, _ = (x.detach() for x in _inputs(0, torch.float32))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = siglip_loss(img, txt, torch.tensor(117.0), torch.tensor(-12.3))
    sim = (img.bfloat16() @ txt.bfloat16().T).float()
    want = -F.logsigmoid((2 * torch.eye(R) - 1) * (117.0 * sim - 12.3)).sum() / R
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=0)
    # in bf16 throughout, t * s + b loses its low bits: a different number, which the promotion avoids
    bf = -F.logsigmoid(((2 * torch.eye(R) - 1) * (torch.tensor(117.0).bfloat16() * sim.bfloat16()
                                                 + torch.tensor(-12.3).bfloat16())).float()).sum() / R
    assert abs(float(bf - want)) > 1e-4


def test_c2lip_calls_the_shared_loss():
    import powerclip.baselines.c2lip as c2lip
    import powerclip.loss as loss
    assert c2lip.siglip_loss is loss.siglip_loss
