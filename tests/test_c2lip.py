"""C2LIP (powerclip.baselines.c2lip) through the trainer's code paths.

The loss functions, concept selection and the method on hand-made inputs are tested in nbs/45_c2lip.ipynb. Here:
1. A few trainer steps on the built-in world (demo preset shrunk) run and log finite terms, for both base losses and
   under bf16 autocast; t and b are saved beside the model (method_modules.pt), never inside model.pt.
2. Two gloo processes equal one process on the concatenated batch (loss and every gradient, float64), for the
   variants that tests/test_ddp.py does not run (base='clip', concept_embedding='encode', all NPs, a cap).
3. The paper preset asks for a local pretrained checkpoint.
"""
import math
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import powerclip.baselines.c2lip  # noqa: F401 (registers 'c2lip')

VARIANTS = {"clip_base": {"base": "clip"}, "encode": {"concept_embedding": "encode", "xac_weight": 0.5},
            "all_capped": {"concepts": "all", "max_concepts": 2}}
B = 4  # rows per process


def _run(tmp_path, overrides, method_cfg=None, preset="demo"):
    from powerclip.train import load_config, read_metrics, train
    ov = {"out_dir": str(tmp_path), "data.batch_size": 16, "max_steps": 6, "optim.warmup_steps": 1, "log_every": 1,
          "progress": False, "tensorboard": False, "data.workers": 0, **overrides}
    for k, v in (method_cfg or {}).items(): ov[f"method_cfg.{k}"] = v
    res = train(load_config(preset, ov, method="c2lip"))
    return res, read_metrics(Path(tmp_path) / "metrics.csv")


@pytest.mark.parametrize("base,terms", [("siglip", ["siglip", "npc", "xac"]), ("clip", ["clip", "npc", "xac"])])
def test_trainer_steps_finite(tmp_path, base, terms):
    torch.set_num_threads(1)
    res, rows = _run(tmp_path, {}, {"base": base})
    assert [r["step"] for r in rows] == list(range(1, 7))
    for r in rows:
        for k in ["loss", "_t", "_b", "_concepts"] + terms: assert math.isfinite(r[k]), (k, r)
        assert r["_concepts"] >= 1   # world captions: one concept per object mention
    assert abs(rows[0]["loss"] - sum(rows[0][k] for k in terms)) < 1e-4 * max(1.0, abs(rows[0]["loss"]))
    mods = torch.load(Path(res["run_dir"]) / "method_modules.pt", weights_only=True)
    assert set(mods) == {"log_scale", "bias"} and mods["bias"].item() != -10.0        # trained
    weights = torch.load(Path(res["run_dir"]) / "model.pt", weights_only=True)
    assert not any(k in weights for k in ("log_scale", "bias")) and "logit_scale" in weights


def test_trainer_steps_bf16(tmp_path):
    torch.set_num_threads(1)
    _, rows = _run(tmp_path, {"precision": "bf16", "max_steps": 3}, {"xac_weight": 1.0})
    assert len(rows) == 3 and all(math.isfinite(r[k]) for r in rows for k in ("loss", "siglip", "npc", "xac"))


def test_preset_needs_pretrained(tmp_path):
    from powerclip.train import load_config, train
    cfg = load_config("c2lip", {"out_dir": str(tmp_path)})
    assert cfg.method == "c2lip" and cfg.model.pretrained == "required" and cfg.optim.lr == 1e-5
    assert cfg.global_batch_size == 768 and cfg.epochs == 5
    assert cfg.method_cfg == {"base": "siglip", "npc_weight": 1.0, "xac_weight": 0.01, "concepts": "base",
                              "concept_embedding": "pool"}
    with pytest.raises(ValueError, match="model.pretrained="): train(cfg)


# --- two processes against one -------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); return s.getsockname()[1]


def _data_cfg(batch_size):
    from powerclip.data import DataConfig
    # seed 2: the two ranks hold 2 and 3 base concepts per caption at most, so the K padding is exercised
    return DataConfig(batch_size=batch_size, workers=0, world_length=64, M=4, image_size=32, masks="random", seed=2)


def _step(cfg, batch, ctx):
    "Loss and gradients (model and t, b) of one step, as powerclip.train computes them."
    from powerclip.dist import wrap_ddp
    from powerclip.methods import get_method
    from powerclip.model import create_model
    from powerclip.train import loss_terms, method_forward, to_device
    torch.manual_seed(0)
    model = create_model("powerclip-micro")[0]
    method = get_method("c2lip", cfg)
    mf = method_forward(model, method).double()
    fwd = wrap_ddp(mf, ctx)
    batch = to_device(method.prepare_batch(batch), ctx.device)
    batch["image"] = batch["image"].double()
    loss, _ = loss_terms(fwd, method, batch, ctx, "fp32")
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in mf.named_parameters() if p.grad is not None}


def _worker(rank, world, port, out):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from powerclip.data import make_loader
    from powerclip.dist import all_max, all_mean, cleanup, init_distributed
    from powerclip.methods import get_method
    ctx = init_distributed("cpu")
    batch = next(iter(make_loader(_data_cfg(B), epoch=0, rank=rank, world_size=world)))
    res = {}
    for name, cfg in VARIANTS.items():
        loss, grads = _step(cfg, batch, ctx)
        k = get_method("c2lip", cfg).prepare_batch(batch)["concept_valid"].shape[1]
        res[name] = (all_mean(loss), grads, (all_max(k), -all_max(-k)))   # (max, min) concepts per caption over ranks
    if rank == 0: torch.save(res, out)
    cleanup(ctx)


def test_two_processes_equal_one():
    from powerclip.data import make_loader
    from powerclip.dist import DistContext
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"c2lip_ddp_{os.getpid()}.pt"
    mp.start_processes(_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True, start_method="spawn")
    res = torch.load(out, weights_only=False); out.unlink()
    full = next(iter(make_loader(_data_cfg(2 * B), epoch=0)))  # the same 8 samples in one batch
    assert any(kmax != kmin for _, _, (kmax, kmin) in res.values()), 'K was the same on both ranks: padding not exercised'
    for name, cfg in VARIANTS.items():
        loss1, grads1 = _step(cfg, full, DistContext())
        loss2, grads2, _ = res[name]
        torch.testing.assert_close(loss2, loss1, rtol=0, atol=1e-9, msg=f"{name}: loss")
        assert grads1.keys() == grads2.keys() and len(grads1) > 10
        assert any("log_scale" in n for n in grads1)                     # t and b are trained and synchronised
        for n in grads1:
            d = (grads2[n] - grads1[n]).abs().max() / grads1[n].abs().max().clamp_min(1e-12)
            assert d < 1e-9, f"{name}: grad of {n} differs by {float(d):.2e} relative to its largest entry"
