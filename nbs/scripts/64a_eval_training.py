# ---
# jupyter:
#   jupytext:
#     formats: nbs///ipynb,nbs/scripts///py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %%
#| default_exp eval.training

# %%
#| export
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from powerclip.config import TrainConfig
from powerclip.data import world_config
from powerclip.eval.data import write_world_benchmark
from powerclip.eval.items import BadData, MissingData
from powerclip.eval.models import Evaluator, LoadedModel, NonFiniteFeatures
from powerclip.eval.tasks import TASKS, evaluate_scorers, find_data
from powerclip.methods import get_method
from powerclip.model import model_geometry, pool_of

# %%
#| hide
import tempfile
from fastcore.test import test_eq, test_fail


# %% [markdown]
# # Evaluation while training
#
# > powerclip-eval's tasks on a training run's model in memory, every `eval_every` steps (the trainer's `evaluate`).

# %% [markdown]
# The trainer (`50_train`, "Evaluation while training") comes before the evaluator in reading order, so it takes its
# evaluation as a callable and, when `eval_every` is set and none is given, asks this module for it by name
# (`train_evaluator(cfg)`). Here that callable is made from the evaluation's own pieces, the ones `powerclip-eval run`
# uses: the folder is read by `find_data` (once, before the first step), the model in memory is wrapped as the
# `LoadedModel` that `load_model` would give for its weights (the architecture's evaluation transform, its tokenizer,
# the method's scorers with its trained modules), and `evaluate_scorers` scores every task with every scorer of the
# method. Nothing is written to disk and no feature is cached (the weights change from one evaluation to the next).
#
# **The folder.** `eval_data` names any folder `powerclip-eval run --data` reads; without it, a run on the world
# evaluates on the world's held-out test scenes at the model's geometry (the comparison's benchmark, `70_compare`):
# `eval_images` of them, written once to `out_dir/eval_world` with the classification set and the Winoground pairs, so
# zero-shot classification, the linear probe and Winoground run beside retrieval, the hard negatives and the regions.
# Shards have no held-out folder of their own: there `eval_data` must be given. `eval_tasks` names tasks, each of which
# must find its data; empty, every task the folder holds runs and the others are named in one line. Whatever cannot
# serve is a `ValueError` whose message starts with `eval_data:` or `eval_tasks:`, before the model is built: on the
# command line one line and exit status 2 (`17_commandline`).
#
# **The numbers.** Every number of every task's answer (the times excepted), as `eval/<task>/<metric>` for the headline
# scorer and `eval/<scorer>:<task>/<metric>` for the method's other scorers, and `eval/seconds`. A model whose features
# are not finite (a diverged run) gives no number: the evaluation says so in one line and the training goes on.

# %%
#| export
def eval_folder(cfg: TrainConfig) -> Path:
    "The folder `cfg.eval_every` evaluates on (see above); the world's default is written here (kept when present)."
    if cfg.eval_data is not None:
        return Path(cfg.eval_data)
    if cfg.data.source != "world":
        raise ValueError("eval_data: shards have no held-out folder of their own: name one (any folder powerclip-eval "
                         "run --data reads), or eval_every=null")
    root = Path(cfg.out_dir) / "eval_world"
    write_world_benchmark(root, cfg.eval_images, world_config(cfg.data, model_geometry(cfg.model.name,
                                                                                      cfg.model.kwargs)), split="test")
    return root


@dataclass
class TrainingEvaluation:
    "`(model, modules, step) -> {name: number}`: the trainer's `evaluate` on a folder read once (see above)."
    cfg: TrainConfig
    root: Path
    found: tuple          # `find_data`'s answer: ({task: loaded data}, {task: reason skipped})

    def loaded(self, model: torch.nn.Module, modules, step: int) -> LoadedModel:
        "The model in memory as `load_model` would give it for its weights (transform, tokenizer, scorers, modules)."
        import open_clip
        pre = open_clip.image_transform(model.visual.image_size, is_train=False,
                                        **{k: v for k, v in open_clip.get_model_preprocess_cfg(model).items()
                                           if k in ("mean", "std", "interpolation", "resize_mode", "fill_color")})
        tok = open_clip.get_tokenizer(self.cfg.model.name, context_length=model.context_length)
        method = get_method(self.cfg.method, self.cfg.method_cfg)
        spec = dict(name=self.cfg.model.name, kwargs=dict(self.cfg.model.kwargs), pool=pool_of(model))
        return LoadedModel(model, pre, tok, f"training-{self.cfg.out_dir}-step{step}", spec, self.cfg.method,
                           dict(method.scorers(modules)), modules)

    def __call__(self, model: torch.nn.Module, modules, step: int) -> dict:
        t0 = time.time()
        p = next(model.parameters())
        bf16 = self.cfg.precision == "bf16" or (self.cfg.precision == "auto" and p.device.type == "cuda")
        ev = Evaluator.of(self.loaded(model, modules, step), None, progress=False, precision="bf16" if bf16 else "fp32")
        try:
            by, _ = evaluate_scorers(ev, self.root, found=self.found)
        except (NonFiniteFeatures, BadData, MissingData) as e:
            print(f"[powerclip.train] step {step}: no evaluation: {e}", file=sys.stderr, flush=True)
            return {}
        out = {}
        for s, tasks in by.items():
            pre = "eval/" if s == ev.headline else f"eval/{s}:"
            out.update({f"{pre}{t}/{k}": float(v) for t, m in tasks.items() for k, v in m.items()
                        if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "seconds"})
        return dict(out, **{"eval/seconds": time.time() - t0})


def train_evaluator(cfg: TrainConfig) -> TrainingEvaluation | None:
    """The trainer's evaluation for `cfg` (None without `eval_every`), its folder read now: a ValueError naming
    `eval_data` or `eval_tasks` when it cannot serve (see above)."""
    if cfg.eval_every is None:
        return None
    if cfg.precision == "fp64":
        raise ValueError("eval_every: the evaluation reads float32 images, not with precision=fp64 (exactness checks)")
    unknown = [t for t in cfg.eval_tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"eval_tasks: unknown task {unknown[0]!r} (known: {', '.join(TASKS)})")
    root = eval_folder(cfg)
    if not root.exists():
        raise ValueError(f"eval_data: {root} does not exist (a folder powerclip-eval run --data reads)")
    try:
        found = find_data(root, cfg.eval_tasks or tuple(TASKS), require=bool(cfg.eval_tasks))
    except (MissingData, BadData) as e:
        raise ValueError(f"eval_data: {e}") from None
    if not found[0]:
        raise ValueError(f"eval_data: {root} holds no data set powerclip-eval reads (see powerclip-eval run --help)")
    print(f"[powerclip.train] evaluating every {cfg.eval_every} steps on {root}: {', '.join(found[0])}"
          + (f" (no data for {', '.join(found[1])})" if found[1] else ""), file=sys.stderr, flush=True)
    return TrainingEvaluation(cfg, root, found)


# %% [markdown]
# A random `powerclip-micro` scored through this module and through `powerclip-eval`'s path (`load_model`, then
# `evaluate_scorers`) on the world's default folder gives the same numbers: the same transform, tokenizer and tasks.
# A folder that cannot serve is one `ValueError` naming its key.

# %%
from powerclip.config import load_config
from powerclip.eval.models import load_model
_scratch = tempfile.TemporaryDirectory(prefix="powerclip-nb-")  # holds every scratch folder below; see the last cell
_tmp = Path(tempfile.mkdtemp(dir=_scratch.name))
_cfg = load_config("smoke", dict(out_dir=str(_tmp / "run"), eval_every=2, eval_images=16))
_te = train_evaluator(_cfg)
test_eq(_te.root, _tmp / "run" / "eval_world")
_lm = load_model("powerclip-micro", seed=3)
_ours = _te(_lm.model, None, 2)
_by, _ = evaluate_scorers(Evaluator.of(_lm, None, progress=False), _te.root)
test_eq({k: v for k, v in _ours.items() if k != "eval/seconds"},
        {f"eval/{t}/{k}": float(v) for t, m in _by["global"].items() for k, v in m.items()
         if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "seconds"})
test_eq(sorted({k.split("/")[1] for k in _ours if k != "eval/seconds"}), sorted(TASKS))
print(f"{len(_ours)} numbers in {_ours['eval/seconds']:.1f}s, e.g. i2t R@1 {_ours['eval/retrieval/i2t_R@1']:.1f}")
for ov, msg in [(dict(eval_data=str(_tmp / "none")), "eval_data: "), (dict(eval_tasks=["nope"]), "eval_tasks: unknown"),
                (dict(eval_data=str(_tmp)), "eval_data: "), ({"data.source": "wds", "data.shards": "x.tar"},
                                                             "eval_data: shards have no held-out folder"),
                (dict(precision="fp64"), "eval_every: ")]:
    test_fail(lambda: train_evaluator(load_config("smoke", dict(out_dir=str(_tmp / "run"), eval_every=2, **ov))),
              contains=msg)

# %% [markdown]
# Every scratch folder made above lives under one temporary folder, removed here, so running the notebook
# leaves nothing behind (a training run's checkpoints take hundreds of MB).

# %%
_scratch.cleanup()
