"""C2LIP (powerclip.baselines.c2lip) through the trainer's code paths.

The loss functions, concept selection and the method on hand-made inputs are tested in nbs/45_c2lip.ipynb. Here:
1. A few trainer steps on the built-in world (demo preset shrunk) run and log finite terms, for both base losses and
   under bf16 autocast; t and b are saved beside the model (method_modules.pt), never inside model.pt.
2. The paper preset asks for a local pretrained checkpoint.
Two processes against one, for each C2LIP variant, are in tests/test_ddp.py with every other method.
"""
import math
from pathlib import Path

import pytest
import torch

import powerclip.baselines.c2lip  # noqa: F401 (registers 'c2lip')



def _run(tmp_path, overrides, method_cfg=None, preset="demo"):
    from powerclip.config import load_config
    from powerclip.train import read_metrics, train
    ov = {"out_dir": str(tmp_path), "data.batch_size": 16, "max_steps": 6, "optim.warmup_steps": 1, "log_every": 1,
          "progress": False, "tensorboard": False, "data.workers": 0, **overrides}
    for k, v in (method_cfg or {}).items():
        ov[f"method_cfg.{k}"] = v
    res = train(load_config(preset, ov, method="c2lip"))
    return res, read_metrics(Path(tmp_path) / "metrics.csv")


@pytest.mark.parametrize("base,terms", [("siglip", ["siglip", "npc", "xac"]), ("clip", ["clip", "npc", "xac"])])
def test_trainer_steps_finite(tmp_path, base, terms):
    torch.set_num_threads(1)
    res, rows = _run(tmp_path, {}, {"base": base})
    assert [r["step"] for r in rows] == list(range(1, 7))
    for r in rows:
        for k in ["loss", "_t", "_b", "_concepts"] + terms:
            assert math.isfinite(r[k]), (k, r)
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
    from powerclip.config import load_config
    from powerclip.train import train
    cfg = load_config("c2lip", {"out_dir": str(tmp_path)})
    assert cfg.method == "c2lip" and cfg.model.pretrained == "required" and cfg.optim.lr == 1e-5
    assert cfg.global_batch_size == 768 and cfg.epochs == 5
    assert cfg.method_cfg == {"base": "siglip", "npc_weight": 1.0, "xac_weight": 0.01, "concepts": "base",
                              "concept_embedding": "pool"}
    with pytest.raises(ValueError, match="model.pretrained="):
        train(cfg)


