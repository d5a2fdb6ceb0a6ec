"""A-CLIP and E-CLIP (powerclip.baselines.aclip / .eclip, notebooks 47_aclip and 48_eclip) through the trainer.

The pieces (crops, colour augmentation, EMA scores, heads, cluster masking, hidden tokens) are checked in the notebooks;
here what needs the trainer: the presets of the papers' recipes, a few steps on the demo preset with the logged ratios,
bf16 autocast (finite, close to float32), and that training leaves the open_clip model plain. Two-process parity is in
tests/test_ddp.py, training by name and exact resume in tests/test_baselines.py.
"""
import math

import pytest
import torch

from powerclip.methods import METHODS, get_method


def _rows(tmp_path, method, preset="smoke", **over):
    from powerclip.config import load_config
    from powerclip.train import read_metrics, train
    cfg = {"out_dir": str(tmp_path), "progress": False, "tensorboard": False, "log_every": 1, **over}
    train(load_config(preset, cfg, method=method))
    return read_metrics(tmp_path / "metrics.csv")


def test_registry_and_presets():
    import powerclip.baselines.aclip as aclip, powerclip.baselines.eclip as eclip
    from powerclip.config import load_config
    assert METHODS["aclip"] is aclip.ACLIP and METHODS["eclip"] is eclip.ECLIP
    a = load_config("aclip")
    assert (a.method, a.model.name, a.global_batch_size, a.epochs) == ("aclip", "ViT-B-16", 4096, 25)
    assert (a.optim.lr, a.optim.weight_decay, a.optim.min_lr, a.optim.eps) == (5e-4, 0.5, 1e-5, 1e-8)
    cfg = get_method("aclip", a.method_cfg).cfg
    assert ((cfg.keep_ratio, cfg.views, cfg.crop_scale, cfg.momentum, cfg.simclr_tau, cfg.byol_weight)
            == (0.5, 2, (0.5, 1.0), 0.996, 0.1, 2.0))
    e = load_config("eclip")
    assert ((e.method, e.model.name, e.global_batch_size, e.epochs, e.optim.lr, e.optim.warmup_steps)
            == ("eclip", "ViT-B-16", 2048, 32, 5e-4, 2000))
    cfg = get_method("eclip", e.method_cfg).cfg
    assert ((cfg.anchor_ratio, cfg.threshold, cfg.min_ratio, cfg.hide_clusters, cfg.use_embed)
            == (0.03, 0.5, 0.3, True, False))
    assert (get_method("aclip").scorers().keys() == {"ema", "global"}
            and list(get_method("eclip").scorers()) == ["global"])


@pytest.mark.parametrize("method", ["aclip", "eclip"])
def test_model_stays_plain_open_clip(method):
    "A training forward pass leaves the model's state_dict keys as they were and nothing installed in its vision tower."
    from powerclip.model import create_model
    model = create_model("powerclip-micro")[0].train()
    keys = set(model.state_dict())
    m = get_method(method)
    m.setup_model(model)
    mods = m.build_modules(model)
    tokens = torch.zeros(2, 77, dtype=torch.long)
    tokens[:, 0], tokens[:, 1], tokens[:, 2] = 49406, 320, 49407
    m.forward(model, {"image": torch.randn(2, 3, 32, 32), "tokens": tokens}, mods)
    v = model.visual
    assert set(model.state_dict()) == keys and isinstance(v.patch_dropout, torch.nn.Identity)
    assert not {"forward", "forward_intermediates"} & set(vars(v.transformer)) and not v.ln_post._forward_hooks


@pytest.mark.parametrize("method,opts",
                         [("aclip", {}), ("aclip", {"method_cfg.views": 1, "method_cfg.color_aug": False}),
                                         ("eclip", {}), ("eclip", {"method_cfg.use_embed": True})])
def test_demo_trainer_steps(tmp_path, method, opts):
    "The demo preset shrunk to batch 16 and 4 steps: finite losses and the logged shares where they must be."
    rows = _rows(tmp_path, method, "demo", **{"data.batch_size": 16, "max_steps": 4, "optim.warmup_steps": 1,
                                            "data.workers": 0, **opts})
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert math.isfinite(r["loss"]) and math.isfinite(r["clip"]) and r["bad_total"] == 0
        if method == "aclip":
            # 9 of 16 2x2 blocks of the 8x8 grid
            assert r["_keep_ratio"] == 36 / 64 and 0.996 - 1e-7 <= r["_momentum"] <= 1
            assert ("simclr" in r) == (opts.get("method_cfg.views", 2) == 2) and math.isfinite(r["byol"])
        else:
            assert r["_eclip_drop_ratio"] >= 20 / 64 and 0 <= r["_eclip_hidden_ratio"] <= 1 - r["_eclip_drop_ratio"]
    print(method, opts, [round(r["loss"], 4) for r in rows])


@pytest.mark.parametrize("method", ["aclip", "eclip"])
def test_bf16_autocast_close_to_fp32(tmp_path, method):
    "The first step's loss (same weights, same batch) under bf16 autocast is finite and within 5 % of float32's."
    f32 = _rows(tmp_path / "f32", method, precision="fp32", max_steps=2)
    b16 = _rows(tmp_path / "b16", method, precision="bf16", max_steps=2)
    assert all(math.isfinite(r["loss"]) for r in b16) and b16[-1]["bad_total"] == 0
    assert abs(b16[0]["loss"] - f32[0]["loss"]) < 0.05 * f32[0]["loss"], (b16[0]["loss"], f32[0]["loss"])
