"""Two CPU processes (gloo) against one process on the whole batch.

0. `powerclip.dist.gather` itself: tensors whose ragged dims (M, K) and row counts (packed tensors) differ between
   the processes arrive padded, in rank order, with the right offsets and row counts, and the gradient that comes
   back to each process is the sum over every process's loss.
1. One step of every method (CLIP, PowerCLIP and the baselines, C2LIP, SPARC and SmartCLIP in their variants, A-CLIP
   with its EMA towers and global-batch BatchNorm heads, E-CLIP with its global drop count) through the
   trainer's own path (`powerclip.train.build_run` with precision fp64: MethodForward in DDP, the method's loss with
   its gathering): the mean loss and every parameter gradient (the method's own modules included) equal those of one
   process on the concatenated batch, in float64 to 1e-9. The run seed makes the two processes hold different numbers
   of tree nodes and of concepts per caption, so the padding of K across processes is exercised; one PowerCLIP case
   gives the two processes different numbers of region masks (M = 4 and 3); one E-CLIP case (no 30 % floor) gives them
   different smallest clusters, so the drop count must come from the global batch.
2. The whole trainer under torchrun (`python -m torch.distributed.run --nproc_per_node 2 -m powerclip.train`):
   the logged losses of 3 steps equal those of a 1-process run with twice the per-process batch (PowerCLIP, and
   A-CLIP, whose EMA towers move with the online model from step to step).
"""
import os, socket, subprocess, sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
# case -> (method, its config for the test) (tau large enough that the NLAs are smooth at float64 precision)
CASES = {"clip": ("clip", None), "powerclip": ("powerclip", {"tau": 0.05}), "filip": ("filip", {"clip_weight": 0.5}),
         "sparc": ("sparc", None), "sparc-cls-tokens": ("sparc", {"global_pool": "cls", "fine_norm": "tokens"}),
         "smartclip": ("smartclip", {"heads": 2}),
         "smartclip-attached": ("smartclip", {"heads": 2, "detach_mask_input": False}), "clip-pgs": ("clip-pgs", None),
         "clip-pgs-0.3": ("clip-pgs-0.3", None), "c2lip": ("c2lip", None), "c2lip-clip": ("c2lip", {"base": "clip"}),
         "c2lip-encode": ("c2lip", {"concept_embedding": "encode", "xac_weight": 0.5}),
         "c2lip-all-capped": ("c2lip", {"concepts": "all", "max_concepts": 2}),
         "c2lip-concepts": ("c2lip", {"npc_norm": "concepts", "xac_normalize": False}),
         "powerclip-ragged-M": ("powerclip", {"tau": 0.05}),
         "aclip": ("aclip", None), "aclip-1view": ("aclip", {"views": 1, "color_aug": False}),
         "eclip": ("eclip", None), "eclip-visible": ("eclip", {"hide_clusters": False}),
         "eclip-no-floor": ("eclip", {"min_ratio": 0.0, "threshold": 0.3, "anchor_ratio": 0.2}),
         "flair": ("flair", {"K": 3}), "flair-tcs": ("flair", {"K": 3, "mps": False}),
         # SigLIP's loss with the model's own t and b (SIGLIP_INIT), alone and under PowerCLIP's triplet term
         "siglip": ("siglip", None), "powerclip-siglip": ("powerclip", {"tau": 0.05, "global_loss": "siglip"})}
RAGGED = {"powerclip-ragged-M"}  # cases whose second process holds one region mask fewer (M = 4 and 3)
# E-CLIP without its 30 % floor (and larger clusters): the batch drops as many patches as the smallest cluster of the
# GLOBAL batch, and the two processes' own smallest clusters differ (asserted): a per-process count would differ
NO_FLOOR = "eclip-no-floor"
B = 4  # rows per process


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SEED = 4  # the run seed: the two processes then hold different numbers of tree nodes and of NP concepts per caption


def _spec(batch_size):
    "Batches with what every method needs (the tree, its NP labels, 4 random boxes, 3 sub-captions), micro geometry."
    from powerclip.data import BatchNeeds, BatchSpec, DataConfig
    from powerclip.model import model_geometry
    return BatchSpec(DataConfig(batch_size=batch_size, workers=0, world_length=64), model_geometry("powerclip-micro"),
                     BatchNeeds(tree=True, node_np=True, regions=4, subcaptions=3), seed=SEED)


def _ragged(batch, rows: slice, drop: bool):
    "The last region mask of `rows` made invalid (empty, one process's view) or, with `drop`, removed from the batch."
    b = dict(batch)
    b["region_masks"], b["region_valid"] = b["region_masks"].clone(), b["region_valid"].clone()
    b["region_masks"][rows, -1] = False
    b["region_valid"][rows, -1] = False
    if drop:
        b["region_masks"], b["region_valid"] = b["region_masks"][:, :-1], b["region_valid"][:, :-1]
    return b


def _step(case, batch, ctx):
    "Loss and gradients of one step, exactly as powerclip.train computes them (the smoke preset's model, in float64)."
    from powerclip.train import build_run, forward_loss
    from powerclip.config import load_config
    method, mcfg = CASES[case]
    ov = {"precision": "fp64", "max_steps": 1, "seed": SEED, **{f"method_cfg.{k}": v for k, v in (mcfg or {}).items()}}
    run = build_run(load_config("smoke", ov, method=method), ctx)  # same init seed: the same weights on every process
    loss, terms = forward_loss(run.fwd, run.method, run.prepare(batch), ctx, run.cfg.precision)
    loss.backward()
    grads = {f"model.{n}": p.grad.clone() for n, p in run.model.named_parameters() if p.grad is not None}
    if run.modules is not None:
        grads.update({f"modules_.{n}": p.grad.clone() for n, p in run.modules.named_parameters() if p.grad is not None})
    last = getattr(run.method, "last", None)   # E-CLIP: this process's smallest cluster and the batch's drop count
    info = (int(last.masked.sum(1).min()), last.n_drop) if hasattr(last, "n_drop") and hasattr(last, "masked") else None
    return loss.detach(), grads, info


def _worker(rank, world, port, out):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from powerclip.data import make_loader
    from powerclip.dist import all_mean, cleanup, init_distributed
    ctx = init_distributed("cpu")
    batch = next(iter(make_loader(_spec(B), epoch=0, rank=rank, world_size=world)))
    from powerclip.dist import all_max
    from powerclip.methods import get_method
    res = {}
    k = get_method("c2lip").prepare_batch(dict(batch))["concept_valid"].shape[1], batch["node_valid"].shape[1]
    ks = [(all_max(x), -all_max(-x)) for x in k]   # (max, min) over the processes of concepts and of tree nodes
    for m in CASES:
        loss, grads, info = _step(m,
                                  _ragged(batch, slice(None), drop=True) if m in RAGGED and rank == 1 else batch, ctx)
        if info is not None:
            info = (all_max(info[0]), -all_max(-info[0]), all_max(info[1]), -all_max(-info[1]))
        res[m] = (all_mean(loss), grads, ks, info)  # info: (max, min) over processes of the smallest cluster, of n_drop
    if rank == 0:
        torch.save(res, out)
    cleanup(ctx)


def test_two_processes_equal_one():
    from powerclip.data import make_loader
    from powerclip.dist import DistContext
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"ddp_{os.getpid()}.pt"
    mp.start_processes(_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True, start_method="spawn")
    res = torch.load(out, weights_only=False)
    out.unlink()
    full = next(iter(make_loader(_spec(2 * B), epoch=0)))  # the same 8 samples in one batch
    (cmax, cmin), (kmax, kmin) = next(iter(res.values()))[2]
    assert (cmax != cmin
            and kmax != kmin), "the processes hold the same numbers of concepts or nodes: padding not exercised"
    for m in CASES:
        loss1, grads1, info1 = _step(m,
                                     _ragged(full, slice(B, None), drop=False) if m in RAGGED else full, DistContext())
        loss2, grads2, _, info2 = res[m]
        if info1 is not None:  # E-CLIP: both processes drop what one process drops on the whole batch
            assert info2[2] == info2[3] == info1[1] and info2[1] == info1[0], (m, info1, info2)
        if m == NO_FLOOR:
            assert (info2[0] != info2[1]
                    and info1[1] == info1[0]), f"{m}: the processes' smallest clusters are equal: {info2}"
        torch.testing.assert_close(loss2, loss1, rtol=0, atol=1e-9, msg=f"{m}: loss")
        assert grads1.keys() == grads2.keys() and len(grads1) > 10
        if CASES[m][0] in ("c2lip", "smartclip", "aclip", "flair") or m == "sparc":
            assert any(n.startswith("modules_.") for n in grads1), m  # own modules
        for n in grads1:
            if max(grads1[n].abs().max(), grads2[n].abs().max()) < 1e-12:
                continue  # zero in exact arithmetic (A-CLIP's
            # biases right before a BatchNorm, whose mean removes them): rounding noise on both sides, no relative error
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
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
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
    rows = {"image": [slice(0, 3), slice(3, 6)], "regions": [slice(0, 3), slice(3, 6)],
            "packed": [slice(0, 1), slice(1, 6)]}
    for r in range(2):
        for k in shapes:
            exp = (w[0][k] + w[1][k])[rows[k][r]]
            if k == "regions":
                exp = exp[:, :x[r]["regions"].shape[1]]
            torch.testing.assert_close(res[r]["grads"][k], exp, rtol=0, atol=1e-12, msg=f"rank {r} {k}")


def _run(args, out_dir, nproc=1):
    common = ["--preset", "smoke", "max_steps=3", "optim.warmup_steps=1", f"out_dir={out_dir}"] + args
    from powerclip.runrecord import run_threads
    from powerclip.train import main, read_metrics
    if nproc == 1:           # the one-process reference: the trainer's command line in this process, on one thread
        with run_threads(1):
            assert main(common) == 0
        return read_metrics(Path(out_dir) / "metrics.csv")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
                str(_free_port()), "-m", "powerclip.train"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(launcher + common, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    return read_metrics(Path(out_dir) / "metrics.csv")


# A-CLIP: its EMA towers are carried from step to step; in float64, since in float32 its BatchNorm over 8 rows and
# SimCLR at tau 0.1 let the rounding of 1 against 2 processes reach 1e-5 of its loss (~8) by step 2
@pytest.mark.parametrize("method,terms,extra", [("powerclip", ("clip", "powerset"), []),
                                                ("aclip", ("clip", "simclr", "byol"), ["precision=fp64"])])
def test_torchrun_trainer_matches_one_process(tmp_path, method, terms, extra):
    two = _run([f"--method={method}", "data.batch_size=4", *extra], tmp_path / "two", nproc=2)
    one = _run([f"--method={method}", "data.batch_size=8", *extra], tmp_path / "one")
    assert [r["step"] for r in two] == [1, 2, 3]
    for a, b in zip(two, one):
        for k in ("loss",) + terms:
            assert abs(a[k] - b[k]) < 1e-4, (k, a, b)
