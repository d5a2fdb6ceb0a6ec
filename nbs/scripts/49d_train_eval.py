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
#| default_exp train_eval

# %%
#| export
from __future__ import annotations

import importlib

import torch

from powerclip.checkpoint import rng_state, set_rng_state
from powerclip.config import TrainConfig

# %%
#| hide
import random
import numpy as np
from fastcore.test import test_eq

# %% [markdown]
# # Evaluation while training: the trainer's side
#
# > How the trainer (`50_train`) gets its evaluation, and runs it without leaving a trace in the training.

# %% [markdown]
# With `eval_every=N` the main process evaluates the model every $N$ steps and at the last one, and its numbers join
# that step's metrics row and TensorBoard under `eval/<task>/<metric>` (another scorer of the method:
# `eval/<scorer>:<task>/<metric>`). What is evaluated, and on what, is `powerclip-eval`'s: the tasks of its registry
# (`eval_tasks`, default every task the folder holds) on a data folder (`eval_data`, default on the world its held-out
# test scenes, `eval_images` of them written once to `out_dir/eval_world`; shards have no default). A missing or broken
# folder, or a task named without its data, stops the run before its first step with one line naming `eval_data` or
# `eval_tasks`.
#
# **Where the evaluation comes from.** The evaluator is built in later notebooks (`61`-`64`: the data readers, the
# `Evaluator`, the task registry), which the trainer may not import. So the trainer takes the evaluation as a callable,
# `evaluate(model, modules, step) -> {name: number}`, given by its caller (`train(cfg, evaluate)`); when none is given
# and `eval_every` is set, `default_evaluator(cfg)` asks `powerclip.eval.training` (`64a_eval_training`) for it,
# importing that module by its name (`EVALUATOR`, with `importlib`) at run time, and only then: the one place where
# the trainer reaches forward in reading order, by name, as a console script names its module. That module wires the
# one evaluation path of the command line (`find_data`, `evaluate_scorers`) to the model in memory; nothing is
# evaluated a second way.
#
# **It changes nothing in the training.** `evaluate_isolated` saves every random state (python, numpy, torch, CUDA)
# and each module's train/eval mode, evaluates in eval mode without gradient, and puts them all back; the evaluation
# runs on the weights the step left, outside DDP (no collective). So the weights of a run are bitwise those of the
# same run without evaluation on the CPU (on a GPU as far as its kernels are deterministic), and a resumed run is as
# exact as before (`50_train`, and `tests/test_eval_every.py` with the real evaluation, the command line's one-line
# errors and the other processes' wait).

# %%
#| export
EVALUATOR = "powerclip.eval.training"   # the module whose `train_evaluator(cfg)` is the default evaluation (see above)


def default_evaluator(cfg: TrainConfig):
    """The evaluation `cfg.eval_every` asks for (None when unset): `train_evaluator(cfg)` of `EVALUATOR`, imported
    here, when asked (see above); a ValueError naming `eval_data` or `eval_tasks` for a folder that cannot serve."""
    if cfg.eval_every is None:
        return None
    return importlib.import_module(EVALUATOR).train_evaluator(cfg)


def evaluate_isolated(evaluate, fwd: torch.nn.Module, model: torch.nn.Module, modules, step: int) -> dict:
    """`evaluate(model, modules, step)` in eval mode without gradient; every random state and each module of `fwd` in
    its train/eval mode are put back afterwards, so the training goes on as if nothing had run."""
    rng, modes = rng_state(), [(m, m.training) for m in fwd.modules()]
    try:
        fwd.eval()
        with torch.no_grad():
            return evaluate(model, modules, step)
    finally:
        for m, mode in modes:
            m.training = mode
        set_rng_state(rng)


# %% [markdown]
# An evaluation that draws from every random stream and finds the model in eval mode without gradient: afterwards the
# streams continue as if it had not run, and a module that was in eval mode inside a training model is still so.

# %%
_fwd = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5)).train()
_fwd[1].eval()
def _greedy(model, modules, step):
    assert not model.training and not torch.is_grad_enabled()
    return {"eval/draws": float(torch.rand(1) + np.random.rand() + random.random()), "eval/step": step}
torch.manual_seed(0)
np.random.seed(0)
random.seed(0)
_want = (torch.rand(2), np.random.rand(), random.random())
torch.manual_seed(0)
np.random.seed(0)
random.seed(0)
test_eq(evaluate_isolated(_greedy, _fwd, _fwd, None, 4)["eval/step"], 4)
_got = (torch.rand(2), np.random.rand(), random.random())
assert torch.equal(_got[0], _want[0]) and _got[1:] == _want[1:]
test_eq((_fwd.training, _fwd[0].training, _fwd[1].training), (True, True, False))
assert default_evaluator(TrainConfig()) is None
