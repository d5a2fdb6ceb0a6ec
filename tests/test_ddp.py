"""Two CPU processes (gloo) against one process on the whole batch.

0. `powerclip.dist.gather` itself: tensors whose ragged dims (M, K) and row counts (packed tensors) differ between
   the processes arrive padded, in rank order, with the right offsets and row counts, and the gradient that comes
   back to each process is the sum over every process's loss.
1. One step of every method (CLIP, PowerCLIP and the baselines, C2LIP in each of its variants) through the
   trainer's own path (MethodForward in DDP, the method's loss with gathering and K/W padding): the mean loss
   and every parameter gradient (the method's own modules included) equal those of one process on the
   concatenated batch, in float64 to 1e-9. The data seed makes the two processes hold different numbers of
   concepts per caption, so C2LIP's padding of K across processes is exercised.
2. The whole trainer under torchrun (`python -m torch.distributed.run --nproc_per_node 2 -m powerclip.train`):
   the logged losses of 3 steps equal those of a 1-process run with twice the per-process batch.
"""
import os, socket, subprocess, sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
# case -> (method, its config for the test) (tau large enough that the NLAs are smooth at float64 precision)
CASES = {"clip": ("clip", None), "powerclip": ("powerclip", {"tau": 0.05}), "filip": ("filip", {"clip_weight": 0.5}),
         "sparc": ("sparc", None), "smartclip": ("smartclip", {"heads": 2}), "clip-pgs": ("clip-pgs", None),
         "clip-pgs-0.3": ("clip-pgs-0.3", None), "c2lip": ("c2lip", None), "c2lip-clip": ("c2lip", {"base": "clip"}),
         "c2lip-encode": ("c2lip", {"concept_embedding": "encode", "xac_weight": 0.5}),
         "c2lip-all-capped": ("c2lip", {"concepts": "all", "max_concepts": 2}),
         "powerclip-ragged-M": ("powerclip", {"tau": 0.05})}
RAGGED = {"powerclip-ragged-M"}  # cases whose second process holds one region mask fewer (M = 4 and 3)
B = 4  # rows per process


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); return s.getsockname()[1]


def _data_cfg(batch_size):
    from powerclip.data import DataConfig
    # seed 2: the two processes hold 2 and 3 base noun-phrase concepts per caption at most (C2LIP pads K)
    return DataConfig(batch_size=batch_size, workers=0, world_length=64, M=4, image_size=32, masks="random", seed=2)


def _ragged(batch, rows: slice, drop: bool):
    "The last region mask of `rows` made invalid (empty, one process's view) or, with `drop`, removed from the batch."
    b = dict(batch)
    b["region_masks"], b["region_valid"] = b["region_masks"].clone(), b["region_valid"].clone()
    b["region_masks"][rows, -1] = False; b["region_valid"][rows, -1] = False
    if drop: b["region_masks"], b["region_valid"] = b["region_masks"][:, :-1], b["region_valid"][:, :-1]
    return b


def _step(case, batch, ctx):
    "Loss and gradients of one step, exactly as powerclip.train computes them."
    from powerclip.dist import wrap_ddp
    from powerclip.methods import get_method
    from powerclip.model import create_model
    from powerclip.train import loss_terms, method_forward, to_device
    torch.manual_seed(0)
    model = create_model("powerclip-micro")[0]
    method = get_method(*CASES[case])
    mf = method_forward(model, method).double()  # a method's own modules: same seed, same weights on every process
    fwd = wrap_ddp(mf, ctx)
    batch = to_device(method.prepare_batch(batch), ctx.device)
    batch["image"] = batch["image"].double()
    loss, terms = loss_terms(fwd, method, batch, ctx, "fp32")
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in mf.named_parameters() if p.grad is not None}


def _worker(rank, world, port, out):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from powerclip.data import make_loader
    from powerclip.dist import all_mean, cleanup, init_distributed
    ctx = init_distributed("cpu")
    batch = next(iter(make_loader(_data_cfg(B), epoch=0, rank=rank, world_size=world)))
    from powerclip.dist import all_max
    from powerclip.methods import get_method
    res = {}
    for m in CASES:
        loss, grads = _step(m, _ragged(batch, slice(None), drop=True) if m in RAGGED and rank == 1 else batch, ctx)
        k = get_method("c2lip").prepare_batch(dict(batch))["concept_valid"].shape[1]
        res[m] = (all_mean(loss), grads, (all_max(k), -all_max(-k)))  # (max, min) concepts per caption over processes
    if rank == 0: torch.save(res, out)
    cleanup(ctx)


def test_two_processes_equal_one():
    from powerclip.data import make_loader
    from powerclip.dist import DistContext
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"ddp_{os.getpid()}.pt"
    mp.start_processes(_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True, start_method="spawn")
    res = torch.load(out, weights_only=False); out.unlink()
    full = next(iter(make_loader(_data_cfg(2 * B), epoch=0)))  # the same 8 samples in one batch
    assert any(kmax != kmin for _, _, (kmax, kmin) in res.values()), "K was the same on both processes: padding not exercised"
    for m in CASES:
        loss1, grads1 = _step(m, _ragged(full, slice(B, None), drop=False) if m in RAGGED else full, DistContext())
        loss2, grads2, _ = res[m]
        torch.testing.assert_close(loss2, loss1, rtol=0, atol=1e-9, msg=f"{m}: loss")
        assert grads1.keys() == grads2.keys() and len(grads1) > 10
        if CASES[m][0] in ("c2lip", "smartclip"): assert any(n.startswith("modules_.") for n in grads1), m  # own modules
        for n in grads1:
            d = (grads2[n] - grads1[n]).abs().max() / grads1[n].abs().max().clamp_min(1e-12)
            assert d < 1e-9, f"{m}: grad of {n} differs by {float(d):.2e} relative to its largest entry"


def _gather_inputs(rank):
    "What process `rank` holds: rows of 3, M = 2 or 4 regions, packed rows 1 or 5 (float64, from a per-rank seed)."
    g = torch.Generator().manual_seed(10 + rank)
    M, P = (2, 4)[rank], (1, 5)[rank]
    return {"image": torch.randn(3, 2, generator=g, dtype=torch.float64).requires_grad_(),
            "regions": torch.randn(3, M, 2, generator=g, dtype=torch.float64).requires_grad_(),
            "region_valid": torch.rand(3, M, generator=g) < 0.7,
            "packed": torch.randn(P, 2, generator=g, dtype=torch.float64).requires_grad_(),
            "owner": torch.randint(0, 3, (P,), generator=g)}


def _weights(rank, shapes):
    "The loss of process `rank` is sum(w * gathered) with weights from a per-rank seed."
    g = torch.Generator().manual_seed(100 + rank)
    return {k: torch.randn(*s, generator=g, dtype=torch.float64) for k, s in shapes.items()}


PAD = {"regions": {1: 0.0}, "region_valid": {1: False}}


def _gather_worker(rank, world, port, out):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from powerclip.dist import cleanup, gather, init_distributed
    ctx = init_distributed("cpu")
    x = _gather_inputs(rank)
    g = gather(ctx, x, pad=PAD)
    w = _weights(rank, {k: g.all[k].shape for k in ("image", "regions", "packed")})
    sum((w[k] * g.all[k]).sum() for k in w).backward()
    res = dict(all={k: v.detach() for k, v in g.all.items()}, offset=g.offset, rows=g.rows, starts=g.starts("packed"),
               grads={k: x[k].grad for k in ("image", "regions", "packed")})
    torch.save(res, f"{out}.{rank}")
    cleanup(ctx)


def test_gather_ragged_and_packed(tmp_path):
    from powerclip.dist import pad_dim
    out = tmp_path / "gather"
    mp.start_processes(_gather_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True, start_method="spawn")
    res = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]
    x = [_gather_inputs(r) for r in range(2)]
    # values: rank order, M padded to 4 (zeros, False), packed rows concatenated 1 + 5
    want = {"image": torch.cat([x[0]["image"], x[1]["image"]]),
            "regions": torch.cat([pad_dim(x[0]["regions"], 4), x[1]["regions"]]),
            "region_valid": torch.cat([pad_dim(x[0]["region_valid"], 4, 1, False), x[1]["region_valid"]]),
            "packed": torch.cat([x[0]["packed"], x[1]["packed"]]), "owner": torch.cat([x[0]["owner"], x[1]["owner"]])}
    for r in range(2):
        assert res[r]["offset"] == 3 * r and res[r]["rows"]["packed"] == [1, 5] and res[r]["starts"] == [0, 1]
        for k, v in want.items():
            assert res[r]["all"][k].dtype == v.dtype, k
            torch.testing.assert_close(res[r]["all"][k], v.detach(), rtol=0, atol=0, msg=k)
    # gradients: process r's tensor gets the sum over both losses of the weights at its rows (padding cut off)
    shapes = {k: want[k].shape for k in ("image", "regions", "packed")}
    w = [_weights(q, shapes) for q in range(2)]
    rows = {"image": [slice(0, 3), slice(3, 6)], "regions": [slice(0, 3), slice(3, 6)], "packed": [slice(0, 1), slice(1, 6)]}
    for r in range(2):
        for k in shapes:
            exp = (w[0][k] + w[1][k])[rows[k][r]]
            if k == "regions": exp = exp[:, :x[r]["regions"].shape[1]]
            torch.testing.assert_close(res[r]["grads"][k], exp, rtol=0, atol=1e-12, msg=f"rank {r} {k}")


def _run(args, out_dir, nproc=1):
    common = ["--preset", "smoke", "max_steps=3", "optim.warmup_steps=1", f"out_dir={out_dir}"] + args
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(_free_port()),
                 "-m", "powerclip.train"] if nproc > 1 else [sys.executable, "-m", "powerclip.train"])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(launcher + common, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    from powerclip.train import read_metrics
    return read_metrics(Path(out_dir) / "metrics.csv")


@pytest.mark.parametrize("method", ["powerclip"])
def test_torchrun_trainer_matches_one_process(tmp_path, method):
    two = _run([f"--method={method}", "data.batch_size=4"], tmp_path / "two", nproc=2)
    one = _run([f"--method={method}", "data.batch_size=8"], tmp_path / "one")
    assert [r["step"] for r in two] == [1, 2, 3]
    for a, b in zip(two, one):
        for k in ("loss", "clip", "powerset"):
            assert abs(a[k] - b[k]) < 1e-4, (k, a, b)
