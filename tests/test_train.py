"""The trainer in-process: bad steps are skipped, counted and logged, and too many in a row abort; `main(cfg)`
works from Python; configs reject unknown keys; the presets load."""
import math

import pytest
import torch

from powerclip.methods import CLIP, METHODS, register
from powerclip.config import TrainConfig, load_config
from powerclip.train import main, read_metrics, train


class _NanAt(CLIP):
    "CLIP whose loss is NaN on the steps listed in `bad` (1-based), for failure injection."
    bad: set = set()
    calls = 0

    def loss(self, out, batch, dist):
        type(self).calls += 1
        terms = super().loss(out, batch, dist)
        if type(self).calls in self.bad:
            terms["clip"] = terms["clip"] * float("nan")
        return terms


if "_test_nan" not in METHODS:
    register("_test_nan")(_NanAt)


def _cfg(tmp_path, **kw):
    return load_config("smoke", {"out_dir": str(tmp_path), **kw}, method="_test_nan")


def _params(run_dir):
    return torch.load(run_dir / "checkpoints" / "last.pt", weights_only=False)["model"]


def test_nonfinite_steps_are_skipped_and_counted(tmp_path, capsys):
    _NanAt.calls, _NanAt.bad = 0, {2, 4}
    s = train(_cfg(tmp_path))
    assert s["steps"] == 6 and s["bad_total"] == 2
    rows = read_metrics(tmp_path / "metrics.csv")
    assert [r["bad_total"] for r in rows] == [0, 1, 1, 2, 2, 2]
    assert math.isnan(rows[1]["loss"]) and all(math.isfinite(r["loss"]) for i, r in enumerate(rows) if i not in (1, 3))
    assert "non-finite loss or gradient, update skipped" in capsys.readouterr().err
    assert all(torch.isfinite(v).all() for v in _params(tmp_path).values())  # no NaN reached the weights


def test_too_many_bad_steps_in_a_row_abort(tmp_path):
    _NanAt.calls, _NanAt.bad = 0, set(range(1, 100))
    with pytest.raises(RuntimeError, match="3 non-finite steps in a row"):
        train(_cfg(tmp_path, max_bad_in_row=3))


def test_main_from_the_command_line_and_config_written(tmp_path, capsys):
    _NanAt.calls, _NanAt.bad = 0, set()
    argv = ["--preset", "smoke", "--method", "_test_nan", f"out_dir={tmp_path}", "max_steps=2"]
    assert main(argv) == 0                                     # an exit status (the console script's), not the summary
    assert "steps: 2" in capsys.readouterr().out               # the summary is printed
    cfg = load_config("smoke", {"out_dir": str(tmp_path), "max_steps": 2}, method="_test_nan")
    assert (tmp_path / "config.yaml").is_file() and (tmp_path / "loss.png").is_file()
    assert load_config(str(tmp_path / "config.yaml")) == cfg  # the written config reads back to the same run
    import yaml
    from powerclip.data import run_seeds
    derived = yaml.safe_load((tmp_path / "config.yaml").read_text())["derived"]   # with what the run derived from it
    assert (derived["seeds"] == run_seeds(cfg.seed)
            and derived["geometry"] == dict(image_size=32, patch_size=8, context_length=77))
    # CLIP's: tokens only
    assert derived["needs"] == dict(tree=False, node_np=False, regions=0, region_source="random", subcaptions=0)


def test_config_errors_are_clear():
    with pytest.raises(ValueError, match="optim.learnig_rate: unknown key"):
        load_config("demo", ["optim.learnig_rate=1"])
    with pytest.raises(ValueError, match="method_cfg.lamda: unknown key"):
        load_config("demo", ["method_cfg.lamda=1"])
    with pytest.raises(ValueError, match="method: unknown method 'no-such-method' \\(registered"):
        load_config("demo", method="no-such-method")
    with pytest.raises(FileNotFoundError, match="known"):
        load_config("no-such-preset")
    with pytest.raises(ValueError, match="optim.lr: must be a number, got 'abc'"):
        load_config("demo", ["optim.lr=abc"])


def test_from_dict_checks_scalar_types():
    from powerclip.config import from_dict
    ok = from_dict(TrainConfig, {"seed": 3, "device": None, "progress": False, "optim": {"lr": 1, "grad_clip": "0.5"},
                                 "out_dir": 2024, "data": {"samples_per_epoch": 10.0}})
    assert (ok.optim.lr, ok.optim.grad_clip, ok.out_dir, ok.data.samples_per_epoch) == (1.0, 0.5, "2024", 10)
    assert isinstance(ok.optim.lr, float) and isinstance(ok.data.samples_per_epoch, int)
    for d, msg in [({"seed": "x"}, "seed: must be an integer, got 'x'"),
                   ({"progress": 1}, "progress: must be true or false"),
                   ({"epochs": None}, "epochs: may not be null"), ({"device": 3.5}, "device: must be cpu, cuda"),
                   ({"optim": {"grad_clip": "no"}}, "optim.grad_clip: must be a number or null, got 'no'"),
                   ({"model": {"compile": "yes please"}}, "model.compile: must be true or false"),
                   ({"optim": {"betas": 0.9}}, "optim.betas: must be a list"),
                   ({"data": []}, "data: must be a section")]:
        with pytest.raises(ValueError, match=msg.replace("(", "\\(")):
            from_dict(TrainConfig, d)


def test_presets_load():
    p = load_config("paper")
    assert ((p.model.name, p.global_batch_size, p.optim.lr, p.optim.weight_decay, p.epochs)
            == ("ViT-B-16", 4096, 1e-3, 0.2, 32))
    assert p.method_cfg == {"lam": 0.1, "tau": 1e-3, "alpha": 0.75, "M": 10, "masks": "random"}
    assert p.model.grad_checkpointing   # 512 local rows of ViT-B/16 fit 80 GB only so
                                        # (benchmarks/results/paper_memory.md)
    assert p.model.pool == "avg"        # the authors' model: average pooling in both towers (30_model, "Pooling")
    d = load_config("demo", method="clip")
    assert d.method == "clip" and d.method_cfg == {} and d.data.source == "world"


def test_run_isolated_returns_result_or_error():
    "A function run in a fresh process hands back its dict, or the error it raised, never hangs or raises here."
    from powerclip.measure import run_isolated
    assert run_isolated(dict, [("a", 1)]) == {"ok": True, "a": 1}
    bad = run_isolated(dict, 5)
    assert bad["ok"] is False and bad["error"].startswith("TypeError")


@pytest.mark.parametrize("method", ["clip", "powerclip"])
def test_pooling_trained_is_pooling_scored(tmp_path, method):
    """A run trained with average pooling is evaluated with average pooling: the evaluator's global scorer (which calls
    open_clip's encode_image / encode_text) gives the embeddings the training forward pass (`encode`) computes, and they
    are the means of the projected patch and token embeddings, not the class token and EOT."""
    from powerclip.eval.models import load_model
    from powerclip.model import encode, pool_of
    cfg = load_config("smoke", {"out_dir": str(tmp_path), "max_steps": 2, "model.pool": "avg", "progress": False,
                                "tensorboard": False}, method=method)
    train(cfg)
    lm = load_model(checkpoint=tmp_path)
    assert pool_of(lm.model) == "avg" and lm.spec["pool"] == "avg" and lm.ckpt_id.endswith("-avg")
    torch.manual_seed(0)
    x = torch.randn(3, 3, 32, 32)
    tok = lm.tokenizer(["a red circle", "a blue square left of a green cross", "two crosses"])
    g = lm.scorers["global"]
    with torch.no_grad():
        e = encode(lm.model, x, tok)
        torch.testing.assert_close(g.image_features(lm.model, x)["image"], e["image"])
        torch.testing.assert_close(g.text_features(lm.model, tok)["text"], e["text"])
        w = (tok != 0).float()[..., None]
        torch.testing.assert_close(e["image"], torch.nn.functional.normalize(e["patches"].mean(1), dim=-1))
        torch.testing.assert_close(e["text"],
                                   torch.nn.functional.normalize((e["tokens"] * w).sum(1) / w.sum(1), dim=-1))
    tok_model = load_model(checkpoint=tmp_path, pool="tok").model          # the same weights read the other way differ
    with torch.no_grad():
        assert not torch.allclose(tok_model.encode_text(tok, normalize=True), e["text"], atol=1e-3)
