"""Shared by every test: without a GPU, Triton kernels run in Triton's interpreter on CPU tensors
(`powerclip.sbar_triton`, tests/test_sbar_triton.py). The variable must be set before the kernels are defined, so
here, before any test imports powerclip; it changes nothing on the CPU paths (no other code runs Triton there)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

# ------------------------------------------------------------------------------------------------ shared runs
# The straight runs that several modules compare against (tests/test_train_resume.py, test_accum_modes.py,
# test_interrupt.py), made once per test session (once per xdist worker; GROUPS below keeps their modules on one
# worker) instead of once per module. The helpers that make them stay in test_train_resume.py.


@pytest.fixture(scope="session")
def straight(tmp_path_factory):
    "test_train_resume's world run (smoke preset, N steps, one thread, in a new process): its per-step losses."
    import test_train_resume as resume
    d = tmp_path_factory.mktemp("straight")
    resume._run(d)
    steps, losses, _ = resume._losses(d)
    assert steps == list(range(1, resume.N + 1))  # the epoch boundary (64 / 8 = 8 steps) is crossed
    return losses


@pytest.fixture(scope="session")
def shards(tmp_path_factory):
    "test_train_resume's webdataset shards with bad samples and a truncated last shard (its `make_shards`)."
    import test_train_resume as resume
    return resume.make_shards(tmp_path_factory.mktemp("shards"))


@pytest.fixture(scope="session")
def shard_straight(tmp_path_factory, shards):
    "The straight shard runs (in this process, on one torch thread as the resumed ones), with 0 and 2 workers."
    import test_train_resume as resume
    from powerclip.runrecord import run_threads
    out = {}
    with run_threads(1):
        for w in (0, 2):
            d = tmp_path_factory.mktemp(f"straight_w{w}")
            resume._main(resume._shard_args(d, shards, w))
            out[w] = d
    return out


# ------------------------------------------------------------------------------------------------ xdist balance
# `pytest -n 2` (make test): each group below runs whole on one worker, so a module's set-up (a trained run, a
# comparison, spawned gloo processes) is made once, not once on each worker that got some of its tests, and the three
# modules of the shared straight runs above share them; the groups go out first, longest first, so that the short
# tests, sent one by one, fill both workers at the end. A module not named is spread test by test. (xdist's own
# `--dist loadgroup` cannot do it here: it marks a group in the test's id, which pytest 9 no longer lets it change.)
GROUPS = [("test_interrupt", "test_train_resume", "test_accum_modes"), ("test_faults",), ("test_compare",),
          ("test_eval_every",), ("test_reproduce",),
          ("test_power",), ("test_accum",), ("test_accum_recipes",), ("test_annotate",), ("test_eval",),
          ("test_parsing",), ("test_checkpoints_released",), ("test_data",), ("test_heatmaps",)]
_RANK = {m: i for i, mods in enumerate(GROUPS) for m in mods}


def _rank(path: str) -> int:
    "The group of the test file at `path` (its index in GROUPS), or len(GROUPS) for a module not named."
    return _RANK.get(path.split("::")[0].rsplit("/", 1)[-1].removesuffix(".py"), len(GROUPS))


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda it: _rank(it.nodeid))         # stable: the rest in their order


try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:                                      # without xdist: no scheduler to make (and no such hook)
    LoadScopeScheduling = None
else:
    class GroupScheduling(LoadScopeScheduling):
        "xdist's scheduling by scope (one scope whole on one worker), a scope being a group of GROUPS or one test."

        def __init__(self, config, log=None):
            super().__init__(config, log)
            config.option.loadscopereorder = False       # the order is the collection's: the groups first

        def _split_scope(self, nodeid: str) -> str:
            i = _rank(nodeid)
            return GROUPS[i][0] if i < len(GROUPS) else nodeid

    def pytest_xdist_make_scheduler(config, log):
        "For `-n N` (xdist's default `--dist load`); another --dist asked for by name is xdist's own."
        return GroupScheduling(config, log) if config.getvalue("dist") == "load" else None
