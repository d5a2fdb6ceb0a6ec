"""The baseline methods (FILIP, SPARC, FLIP, SmartCLIP, CLIP-PGS, C2LIP, A-CLIP, E-CLIP) through the trainer's own code
paths. Their two-process (gloo) parity with one process is tested with every other method in tests/test_ddp.py.

1. They are in the registry once `powerclip.baselines` modules are imported, and their configs reject bad options.
2. A few trainer steps of each method on the built-in world run and log finite losses, and every method's
   exported weights (model.pt) load in plain open_clip, its own modules (if any) saved beside them.
3. A run stopped and resumed equals a straight run, for the methods with modules of their own (SmartCLIP, C2LIP,
   A-CLIP's EMA towers and heads) and for E-CLIP's hashed cluster draws; A-CLIP's EMA scorer reads the saved towers.
"""
import math

import pytest

import powerclip.baselines.filip, powerclip.baselines.flip  # importing a method's module registers it
import powerclip.baselines.smartclip, powerclip.baselines.sparc  # noqa: F401 (registers)
from powerclip.methods import METHODS, get_method


def test_registered_and_configs_checked():
    get_method("c2lip")
    get_method("clip-pgs")  # imports every baseline module
    assert ({"filip", "sparc", "flip", "smartclip", "clip-pgs", "clip-pgs-0.3", "c2lip", "aclip", "eclip"}
            <= set(METHODS))
    assert get_method("sparc", {"lambda_fine": 0.5}).cfg.lambda_fine == 0.5
    with pytest.raises(ValueError, match="unknown option"):
        get_method("filip", {"chunks": 2})
    with pytest.raises(ValueError, match="ratio"):
        get_method("flip", {"ratio": 1.0})
    with pytest.raises(ValueError, match="threshold"):
        get_method("sparc", {"threshold": 2.0})
    with pytest.raises(ValueError, match="views"):
        get_method("aclip", {"views": 3})
    with pytest.raises(ValueError, match="threshold"):
        get_method("eclip", {"threshold": 2.0})


def test_registry_imports_baselines_on_demand():
    "The trainer imports only powerclip.methods: asking for a baseline by name must find it."
    import subprocess, sys
    code = ("from powerclip.methods import get_method; "
            "print(sorted(type(get_method(n)).__name__ for n in ('filip', 'sparc', 'flip', 'smartclip', "
            "'c2lip', 'aclip', 'eclip')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "['ACLIP', 'C2LIP', 'ECLIP', 'FILIP', 'FLIP', 'SPARC', 'SmartCLIP']"


@pytest.mark.parametrize("method,terms", [("filip", ["filip"]), ("sparc", ["clip", "sparc_fine"]), ("flip", ["clip"]),
                                          ("smartclip", ["modular", "sparsity"]), ("clip-pgs", ["clip"]),
                                          ("c2lip", ["siglip", "npc", "xac"]), ("aclip", ["clip", "simclr", "byol"]),
                                          ("eclip", ["clip", "_eclip_drop_ratio"])])
def test_trainer_steps(tmp_path, method, terms):
    import open_clip, torch
    from powerclip.model import register_configs
    from powerclip.config import load_config
    from powerclip.train import read_metrics, train
    s = train(load_config("smoke", {"out_dir": str(tmp_path), "max_steps": 2, "optim.warmup_steps": 1}, method=method))
    rows = read_metrics(tmp_path / "metrics.csv")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        for k in ["loss"] + terms:
            assert math.isfinite(r[k]), (k, r)
    register_configs()
    model = open_clip.create_model_and_transforms("powerclip-micro", pretrained=s["weights"])[0]  # plain open_clip
    own = torch.load(s["checkpoint"], weights_only=False)
    assert all(torch.equal(v, own["model"][k]) for k, v in model.state_dict().items())  # the final weights
    assert ((tmp_path / "method_modules.pt").is_file() == (method in ("smartclip", "c2lip", "sparc", "aclip"))
            == (own["method_modules"] is not None))


@pytest.mark.parametrize("method", ["smartclip", "c2lip", "sparc", "aclip", "eclip"])
def test_resume_restores_method_modules(tmp_path, method):
    """A run stopped and resumed equals a straight run, for methods whose own modules (and their Adam state) resume too
    (A-CLIP: the EMA towers, which have no gradient, and the heads; its momentum follows the trainer's step), and for
    E-CLIP, whose clusters are drawn from (seed, step, sample id)."""
    import torch
    from powerclip.config import load_config
    from powerclip.train import read_metrics, train
    ov = {"max_steps": 4, "log_every": 1, "optim.warmup_steps": 1, "progress": False, "tensorboard": False}
    train(load_config("smoke", {**ov, "out_dir": str(tmp_path / "a")}, method=method))
    train(load_config("smoke", {**ov, "out_dir": str(tmp_path / "b"), "stop_at": 2}, method=method))
    train(load_config("smoke", {**ov, "out_dir": str(tmp_path / "b")}, method=method))
    a, b = (read_metrics(tmp_path / d / "metrics.csv") for d in "ab")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b)) < 1e-6
    if method == "eclip":
        return                                                    # no modules of its own
    ma, mb = (torch.load(tmp_path / d / "method_modules.pt") for d in "ab")
    assert ma.keys() == mb.keys() and all(torch.allclose(ma[k], mb[k], atol=1e-6) for k in ma)
    if method == "aclip":
        assert (any(k.startswith("visual_ema.") for k in ma)
                and [r["_momentum"] for r in a] == [r["_momentum"] for r in b])


def test_smartclip_mask_network_gets_its_own_learning_rate():
    "The trainer's optimiser gives SmartCLIP's mask network its peak rate (paper: 1e-3) and the towers theirs."
    from powerclip.dist import DistContext
    from powerclip.train import build_run
    from powerclip.config import load_config
    run = build_run(load_config("smoke", {"optim.lr": 1e-6}, method="smartclip"), DistContext())
    assert {g["initial_lr"] for g in run.opt.param_groups} == {1e-6, 1e-3}
    mask = set(map(id, run.modules.parameters()))
    assert all(g["initial_lr"] == (1e-3 if id(g["params"][0]) in mask else 1e-6) for g in run.opt.param_groups)
    # no weight decay on the mask network (issue 13: the authors' code); the towers' matrices keep the run's
    assert all(g["weight_decay"] == 0.0 for g in run.opt.param_groups if id(g["params"][0]) in mask)
    assert ({g["weight_decay"] for g in run.opt.param_groups if id(g["params"][0]) not in mask}
            == {0.0, run.cfg.optim.weight_decay})
    run = build_run(load_config("smoke", {"method_cfg.mask_weight_decay": None}, method="smartclip"), DistContext())
    assert ({g["weight_decay"] for g in run.opt.param_groups} == {0.0, run.cfg.optim.weight_decay}
            and len(run.opt.param_groups) == 4)


def test_finetune_from_plain_open_clip_weights(tmp_path):
    """A fine-tune from a plain open_clip state dict (`model.pretrained=PATH`, as the fine-tuning presets ask): the
    towers start from those weights, the method's own modules (SmartCLIP's mask network, C2LIP's t and b, SPARC's h_v)
    start fresh, and the modules get their own learning rate."""
    import torch
    from powerclip.dist import DistContext
    from powerclip.train import build_run
    from powerclip.config import load_config
    ref = build_run(load_config("smoke", {"seed": 7}, method="clip"), DistContext()).model
    torch.save(ref.state_dict(), tmp_path / "clip.pt")
    for method, extra in (("smartclip", {}), ("c2lip", {"method_cfg.modules_lr": 0.01}), ("sparc", {})):
        cfgs = [load_config("smoke",
                            {"model.pretrained": str(tmp_path / "clip.pt"), "seed": s, "optim.lr": 1e-5, **extra},
                            method=method) for s in (0, 1)]
        runs = [build_run(c, DistContext()) for c in cfgs]
        for run in runs:
            assert all(torch.equal(v, ref.state_dict()[k]) for k, v in run.model.state_dict().items()), method
        m0, m1 = (run.modules.state_dict() for run in runs)     # fresh, from each run's own init stream
        if method != "c2lip":
            assert any(not torch.equal(m0[k], m1[k]) for k in m0), method
        lrs = {g["initial_lr"] for g in runs[0].opt.param_groups}
        assert lrs == {1e-5, runs[0].method.modules_lr(1e-5)}, (method, lrs)
        if method == "c2lip":   # t and b start at the configured init, not from the checkpoint (which has none)
            t, b = runs[0].modules()
            assert abs(t.item() - 10.0) < 1e-5 and b.item() == -10.0


def test_smartclip_preset_is_the_finetuning_recipe(tmp_path):
    """The smartclip preset is SmartCLIP's fine-tuning recipe (Sec. 6.1, Long-CLIP's settings elsewhere): it asks for
    weights."""
    from powerclip.config import load_config
    from powerclip.train import train
    cfg = load_config("smartclip", {"out_dir": str(tmp_path)})
    assert cfg.method == "smartclip" and cfg.model.pretrained == "required" and cfg.global_batch_size == 1024
    assert cfg.optim.lr == 1e-6 and cfg.method_cfg["mask_lr"] == 1e-3 and cfg.method_cfg["mask_weight_decay"] == 0.0
    assert cfg.method_cfg["detach_mask_input"] is True
    with pytest.raises(ValueError, match="model.pretrained="):
        train(cfg)


def test_aclip_ema_scorer_reads_the_saved_towers(tmp_path):
    """The evaluator's loader brings A-CLIP's EMA towers back from method_modules.pt; its 'ema' scorer then differs from
    'global'."""
    import torch
    from powerclip.eval.models import load_model
    from powerclip.config import load_config
    from powerclip.train import train
    train(load_config("smoke", {"out_dir": str(tmp_path), "max_steps": 3, "optim.warmup_steps": 1}, method="aclip"))
    lm = load_model(checkpoint=tmp_path / "model.pt")
    assert list(lm.scorers) == ["ema", "global"] and lm.modules is not None
    saved = torch.load(tmp_path / "method_modules.pt")
    assert all(torch.equal(v.cpu(), saved[k]) for k, v in lm.modules.state_dict().items())
    img = torch.randn(2, 3, 32, 32)
    e, g = (lm.scorers[k].image_features(lm.model, img)["image"] for k in ("ema", "global"))
    assert e.shape == g.shape and not torch.allclose(e, g)        # the EMA lags the online model after 3 steps
