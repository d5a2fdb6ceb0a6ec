"""CLIP-PGS (powerclip.baselines.clip_pgs, notebook 46_clip_pgs) through the trainer.

The selection's own checks (limits, Sinkhorn, edge Monte-Carlo, eval = plain model, token counts) are in the
notebook; here what needs the trainer: a few steps of both presets, bf16, the registry, and exact resume (the
seed stream and the mixing weight follow the trainer's step, `Method.on_step`). Two-process parity of
'clip-pgs' is in tests/test_ddp.py (METHODS).
"""
import math

import pytest
import torch

from powerclip.methods import METHODS, get_method


def _rows(tmp_path, method, preset="smoke", **over):
    from powerclip.config import load_config
    from powerclip.train import read_metrics, train
    cfg = {"out_dir": str(tmp_path), "progress": False, "tensorboard": False, **over}
    train(load_config(preset, cfg, method=method))
    return read_metrics(tmp_path / "metrics.csv")


def test_registry_and_presets():
    import powerclip.baselines.clip_pgs as pgs
    assert METHODS["clip-pgs"] is pgs.CLIPPGS and METHODS["clip-pgs-0.3"] is pgs.CLIPPGS03
    assert (get_method("clip-pgs").cfg.lower, get_method("clip-pgs-0.3").cfg.lower) == (0.5, 0.3)
    with pytest.raises(ValueError, match="lower"):
        get_method("clip-pgs", {"lower": 0.7})
    from powerclip.config import load_config
    cfg = load_config("clip-pgs")
    assert cfg.method == "clip-pgs" and cfg.model.name == "ViT-B-16" and cfg.global_batch_size == 4096
    assert (cfg.optim.lr == 1e-3 and cfg.optim.betas == (0.9, 0.98) and cfg.optim.weight_decay == 0.2
            and cfg.epochs == 32)
    assert load_config("clip-pgs", method="clip-pgs-0.3").method_cfg["lower"] == 0.3
    # the authors' clip-train.sh warms up for 10,000 steps; PowerCLIP's paper adopts CLIP-PGS's setting (Sec. 5.1)
    assert cfg.optim.warmup_steps == 10000 and load_config("paper").optim.warmup_steps == 10000


def test_model_state_dict_unchanged():
    "A training forward pass with the selection leaves the model plain open_clip: the same keys, nothing installed."
    from powerclip.model import create_model
    model = create_model("powerclip-micro")[0].train()
    keys = set(model.state_dict())
    tokens = torch.zeros(2, 77, dtype=torch.long)
    tokens[:, 0], tokens[:, 1], tokens[:, 2] = 49406, 320, 49407
    get_method("clip-pgs").forward(model, {"image": torch.randn(2, 3, 32, 32), "tokens": tokens})
    assert set(model.state_dict()) == keys and isinstance(model.visual.patch_dropout, torch.nn.Identity)


@pytest.mark.parametrize("method,lo,hi", [("clip-pgs", 0.5, 0.5), ("clip-pgs-0.3", 0.3, 0.5)])
def test_demo_trainer_steps(tmp_path, method, lo, hi):
    "The demo preset shrunk to batch 16 and 6 steps: finite losses, the logged drop ratio inside the limits."
    rows = _rows(tmp_path, method, "demo", **{"data.batch_size": 16, "max_steps": 6, "log_every": 1,
                                            "optim.warmup_steps": 1, "data.workers": 0})
    assert [r["step"] for r in rows] == list(range(1, 7))
    for r in rows:
        assert math.isfinite(r["loss"]) and math.isfinite(r["clip"])
        assert lo <= r["_pgs_drop_ratio"] <= hi + 1e-9, r
    print(method, [round(r["loss"], 4) for r in rows])


def test_bf16_autocast_trainer(tmp_path):
    rows = _rows(tmp_path, "clip-pgs-0.3", precision="bf16", max_steps=3)
    assert len(rows) == 3 and all(math.isfinite(r["loss"]) for r in rows) and rows[-1]["bad_total"] == 0


def test_resume_is_exact(tmp_path):
    "Stopping after 3 of 6 steps and resuming gives the losses of the uninterrupted run (same seeds, same alpha)."
    full = _rows(tmp_path / "full", "clip-pgs-0.3")
    _rows(tmp_path / "cut", "clip-pgs-0.3", stop_at=3)
    resumed = _rows(tmp_path / "cut", "clip-pgs-0.3")
    assert [r["step"] for r in resumed][-3:] == [4, 5, 6]
    by_step = {r["step"]: r for r in resumed}
    for r in full:
        assert by_step[r["step"]]["loss"] == pytest.approx(r["loss"], abs=1e-6), (r["step"], by_step[r["step"]], r)


def test_seeds_follow_step_and_sample_not_batch():
    "The random candidates of an image depend on (seed, step, sample index) only."
    from powerclip.baselines.clip_pgs import hash_uniform
    a = hash_uniform(torch.tensor([7, 3, 9]), 5, 0, 16)
    b = hash_uniform(torch.tensor([9, 7]), 5, 0, 16)
    assert torch.equal(a[0], b[1]) and torch.equal(a[2], b[0])
    assert not torch.equal(a, hash_uniform(torch.tensor([7, 3, 9]), 6, 0, 16))


# --- two processes (gloo) against one: PGS_0.3's count is the mean over the *global* batch --------------------
def _pgs03_batch():
    "8 samples: rows 0-3 flat (redundant patches: each wants the upper count), rows 4-7 noise (the lower)."
    g = torch.Generator().manual_seed(0)
    smooth = torch.full((4, 3, 32, 32), 0.5, dtype=torch.float64)
    image = torch.cat([smooth + 0.01 * torch.randn(4, 3, 32, 32, generator=g, dtype=torch.float64),
                       torch.randn(4, 3, 32, 32, generator=g, dtype=torch.float64)])
    tokens = torch.zeros(8, 77, dtype=torch.long)
    tokens[:, 0], tokens[:, 1:4], tokens[:, 4] = 49406, torch.randint(300, 400, (8, 3), generator=g), 49407
    return {"image": image, "tokens": tokens, "index": torch.arange(8)}


def _pgs03_step(batch, ctx):
    from powerclip.train import build_run, forward_loss
    from powerclip.config import load_config
    run = build_run(load_config("smoke", {"precision": "fp64", "max_steps": 1}, method="clip-pgs-0.3"), ctx)
    loss, terms = forward_loss(run.fwd, run.method, run.prepare(batch), ctx, run.cfg.precision)
    loss.backward()
    return (loss.detach(), float(terms["_pgs_drop_ratio"]),
            {n: p.grad.clone() for n, p in run.model.named_parameters() if p.grad is not None})


def _pgs03_worker(rank, world, port, out):
    import os
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from powerclip.dist import all_mean, cleanup, init_distributed
    ctx = init_distributed("cpu")
    b = {k: v[4 * rank: 4 * rank + 4] for k, v in _pgs03_batch().items()}
    loss, ratio, grads = _pgs03_step(b, ctx)
    res = (all_mean(loss), ratio, grads)
    if rank == 0:
        torch.save(res, out)
    cleanup(ctx)


def test_pgs03_two_processes_equal_one(tmp_path):
    import socket
    import torch.multiprocessing as mp
    from powerclip.dist import DistContext
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "ddp.pt"
    mp.start_processes(_pgs03_worker, args=(2, port, str(out)), nprocs=2, join=True, start_method="spawn")
    loss2, ratio2, grads2 = torch.load(out, weights_only=False)
    loss1, ratio1, grads1 = _pgs03_step(_pgs03_batch(), DistContext())
    # N = 16: the counts lie in [5, 8]; flat rows want 8, noise rows 5; the global mean 6.5 rounds to 7
    assert ratio1 == ratio2 == 7 / 16
    torch.testing.assert_close(loss2, loss1, rtol=0, atol=1e-9)
    assert grads1.keys() == grads2.keys() and len(grads1) > 10
    for n in grads1:
        d = (grads2[n] - grads1[n]).abs().max() / grads1[n].abs().max().clamp_min(1e-12)
        assert d < 1e-9, f"grad of {n} differs by {float(d):.2e}"
