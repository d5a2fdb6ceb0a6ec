"""SigLIP's model in training and evaluation (issue 43).

1. A MAP model (`model.pool=map`, SigLIP's attention-pooled image tower) trained by the trainer is scored by the head it
   trained: the evaluator's image features are the one-query attention pooler's output written out by hand from the
   saved weights (not the class token's, not the patches' mean), and its region features pool the head's patch
   embeddings (`map_patches`). The run records `model.pool: map` and SigLIP's `init_logit_bias`, so the evaluator
   builds the same model; asked to read it as 'tok' it refuses in one line.
2. `--method siglip` trains with the model's own t and b under every pooling of the smoke preset (their values in
   the model's state_dict move from SigLIP's init), and a method without 'map' in its pools refuses it in one line.
3. C2LIP fine-tuning a SigLIP snapshot uses the snapshot model's t and b: at its first step (metrics.csv's `_t`, `_b`,
   logged from the forward pass before the update) they equal the snapshot's, and no module is created.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from powerclip.config import load_config
from powerclip.train import read_metrics, train, validate

FAST = {"max_steps": 2, "progress": False, "tensorboard": False}


def _head(model, x):
    "The MAP image embedding by hand: ln_post(MHA(ln_q(q), ln_k(tokens), ln_k(tokens))) @ proj, normalised."
    v = model.visual
    tokens = v.transformer(v._embeds(x))                                  # (C, 1 + N, width), the class token kept
    k = v.attn_pool.ln_k(tokens)
    q = v.attn_pool.ln_q(v.attn_pool.query)[None].expand(x.shape[0], -1, -1)
    out = v.attn_pool.attn(q, k, k, need_weights=False)[0][:, 0]
    return F.normalize(v.ln_post(out) @ v.proj, dim=-1)


def test_map_model_is_scored_by_its_trained_head(tmp_path):
    from powerclip.eval.models import CheckpointError, load_model
    from powerclip.model import map_patches, pool_of
    from powerclip.powerset import pool_normalize
    train(load_config("smoke", {"out_dir": str(tmp_path), "model.pool": "map", **FAST}, method="siglip"))
    lm = load_model(checkpoint=tmp_path)
    assert pool_of(lm.model) == "map" and lm.spec["pool"] == "map" and lm.ckpt_id.endswith("-map")
    assert float(lm.model.logit_bias) != -10.0                          # the trained b came back with the weights
    sd = torch.load(tmp_path / "model.pt", weights_only=True)
    assert torch.equal(lm.model.visual.attn_pool.query, sd["visual.attn_pool.query"])
    torch.manual_seed(0)
    x = torch.randn(3, 3, 32, 32)
    g = lm.scorers["global"]
    with torch.no_grad():
        got = g.image_features(lm.model, x)["image"]
        torch.testing.assert_close(got, _head(lm.model, x), rtol=0, atol=1e-6)
        # not the class token through ln_post / proj of another width, not the mean of the patches
        patches = map_patches(lm.model, lm.model.visual.forward_intermediates(x, indices=1, output_fmt="NLC",
                                                                               intermediates_only=True)
                              ["image_intermediates"][-1])
        assert not torch.allclose(got, F.normalize(patches.mean(1), dim=-1), atol=1e-3)
        masks = torch.zeros(3, 2, patches.shape[1], dtype=torch.bool)
        masks[:, 0, :5], masks[:, 1, 7:] = True, True
        torch.testing.assert_close(g.region_features(lm.model, x, masks), pool_normalize(patches, masks))
        torch.testing.assert_close(g.crop_features(lm.model, x), got)
    with pytest.raises(CheckpointError, match="'map' is an architecture"):
        load_model(checkpoint=tmp_path, pool="tok")


@pytest.mark.parametrize("pool", ["tok", "avg", "map"])
def test_siglip_trains_with_the_models_own_t_and_b(tmp_path, pool):
    train(load_config("smoke", {"out_dir": str(tmp_path), "model.pool": pool, **FAST}, method="siglip"))
    sd = torch.load(tmp_path / "model.pt", weights_only=True)
    assert {"logit_scale", "logit_bias"} <= set(sd)
    assert all("_logit_bias" in r and "siglip" in r for r in read_metrics(tmp_path / "metrics.csv"))
    assert float(sd["logit_bias"]) != -10.0 and not (tmp_path / "method_modules.pt").exists()   # b trained
    from powerclip.dist import DistContext
    from powerclip.train import build_run
    run = build_run(load_config("smoke", {"out_dir": str(tmp_path / "fresh"), "model.pool": pool, **FAST},
                                method="siglip"), DistContext())
    assert math.isclose(float(run.model.logit_scale.exp()), 10.0, rel_tol=1e-6)   # SigLIP's init, the model's own
    assert float(run.model.logit_bias) == -10.0 and run.modules is None
    cfg = (tmp_path / "config.yaml").read_text()
    assert "init_logit_bias: -10.0" in cfg


def test_map_refused_by_methods_without_it():
    with pytest.raises(ValueError, match="model.pool: method 'filip' pools by tok or avg, not 'map'"):
        validate(load_config("smoke", {"model.pool": "map"}, method="filip"))
    with pytest.raises(ValueError, match="pools by its trained MAP head"):
        validate(load_config("smoke", {"model.name": "ViT-B-16-map", "model.pool": "tok"}, method="clip"))


def test_c2lip_from_a_siglip_snapshot_starts_at_its_t_and_b(tmp_path):
    base = tmp_path / "siglip"
    train(load_config("smoke", {"out_dir": str(base), **FAST, "optim.lr": 0.05}, method="siglip"))
    sd = torch.load(base / "model.pt", weights_only=True)
    t, b = float(sd["logit_scale"].exp()), float(sd["logit_bias"])
    assert abs(t - 10) > 1e-3 and abs(b + 10) > 1e-3                    # the snapshot's, not SigLIP's init
    from powerclip.dist import DistContext
    from powerclip.train import build_run
    ft = tmp_path / "c2lip"
    cfg = load_config("smoke", {"out_dir": str(ft), "model.pretrained": str(base / "model.pt"), **FAST}, method="c2lip")
    run = build_run(cfg, DistContext())
    assert run.modules is None                                            # nothing created fresh
    b0 = run.prepare(next(iter(_loader(run))))
    out = run.fwd(b0)                                                     # the first step's forward pass
    assert math.isclose(float(out["sigmoid_scale"]), t, rel_tol=1e-6) and float(out["sigmoid_bias"]) == b
    assert run.cfg.model.kwargs["init_logit_bias"] == -10.0              # recorded: the evaluator builds it alike
    train(cfg)                                                            # and the run trains them
    sd2 = torch.load(ft / "model.pt", weights_only=True)
    assert float(sd2["logit_bias"]) != b and not (ft / "method_modules.pt").exists()


def _loader(run):
    from powerclip.data import make_loader
    return make_loader(run.spec, epoch=0)
