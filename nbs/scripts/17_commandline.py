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
#| default_exp commandline

# %%
#| export
from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys

# %%
#| hide
import io

from fastcore.test import test_eq, test_fail


# %% [markdown]
# # Command lines
#
# > One convention for every entry point: a user's mistake is one line on stderr and exit status 2.
#
# The line names the argument and what is allowed, and it comes before any model is built; `--debug` (or
# `POWERCLIP_DEBUG=1`) shows the traceback.

# %% [markdown]
# Every command of the project (`powerclip.train`, `powerclip-eval`, `powerclip-heatmaps`, `powerclip.compare`,
# `data_prep/annotate_shards.py`, the benchmark scripts) follows the same rules:
#
# - **A mistake of the user's is one line.** An unknown method, a config key that does not exist, `optim.lr=abc`,
#   a preset that is not there, an output folder that is a file, shards that do not exist: one line on stderr,
#   `prog: error: <argument>: <what is wrong> (<what is allowed>)`, and exit status 2. No traceback: the user did
#   nothing a traceback would help with.
# - **Checked before the work starts.** A command validates its arguments, its config and its paths first, so the
#   line comes in a second, not after the model is built or the data is half read.
# - **A bug is a traceback.** Only the validation phase turns exceptions into one line; whatever fails later is
#   unexpected and keeps its traceback.
# - **`--debug`** (any command) or the environment variable `POWERCLIP_DEBUG=1` shows the traceback of a usage error
#   too.
#
# The pieces: `UsageError` (raise it with the line to print), `usage_errors()` (a context in which the validation's
# `ValueError`, `TypeError`, `KeyError` and `FileNotFoundError` become `UsageError`s), `ArgumentParser` (argparse's
# own errors, an unknown flag or a missing value, as one line too) and `run_main` (calls a command's main and turns a
# `UsageError` into the line and the exit status).
#
# **Overrides after a list.** The training commands take config overrides as `key=value` positionals, anywhere on the
# line. argparse gives a flag of several values (`--seeds 0 1`, `--merge DIR ...`) every word up to the next flag, so
# `--seeds 0 1 progress=false` would read `progress=false` as a seed. With `key_values=True` the parser moves each
# `key=value` word to the front first, where only positionals are read; a word right after a one-value flag stays
# that flag's value (`--out lr=1e-3` is a folder, given with the flag's full name). A word with a `/` before its first
# `=` is never taken for an override (`./lr=1e-3`); one like `runs=old/x` after a flag of several values is, so give
# such a folder as `./runs=old/x`. A name after a flag of several values is read as one of its values too
# (`--steps 100 table6`): put the names first, as the examples do.

# %%
#| export
class UsageError(Exception):
    "A mistake in a command's arguments, config or paths: printed as one line, exit status 2."


def debug_requested(argv=None) -> bool:
    "`--debug` among the arguments, or POWERCLIP_DEBUG set to anything but '', '0', 'false'."
    argv = sys.argv[1:] if argv is None else argv
    return "--debug" in argv or os.environ.get("POWERCLIP_DEBUG", "").lower() not in ("", "0", "false")


@contextlib.contextmanager
def usage_errors(*types: type):
    """Inside this block (a command's validation: arguments, config, paths), exceptions of `types` (default: ValueError,
    TypeError, KeyError, FileNotFoundError) are the user's: they leave as `UsageError` with the same message."""
    types = types or (ValueError, TypeError, KeyError, FileNotFoundError)
    try:
        yield
    except UsageError:
        raise
    except types as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)   # a KeyError's str() adds quotes
        raise UsageError(str(msg).strip().replace("\n", " ")) from e


KEY_VALUE = re.compile(r"[A-Za-z_][\w.]*=")    # a config override, `optim.lr=1e-3`


class ArgumentParser(argparse.ArgumentParser):
    """argparse, whose errors (unknown flag, missing or malformed value) are a `UsageError`, not usage text + exit.
    `key_values=True` (a command whose positionals take `key=value` overrides): an override may follow a flag of
    several values, `--seeds 0 1 optim.lr=1e-3`, without being read as one of them."""
    def __init__(self, *args, key_values: bool = False, **kw):
        super().__init__(*args, **kw)
        self.key_values = key_values

    def error(self, message):
        raise UsageError(message)

    # both entry points: Python >= 3.12.8 / 3.13.1 parses intermixed arguments without calling `parse_known_args`
    # (gh-125355); moving the overrides twice is the same as once
    def parse_known_args(self, args=None, namespace=None):
        return super().parse_known_args(self._key_values_first(args), namespace)

    def parse_known_intermixed_args(self, args=None, namespace=None):
        return super().parse_known_intermixed_args(self._key_values_first(args), namespace)

    def _key_values_first(self, args):
        "`args` with the `key=value` overrides moved to the front (in their order), where only positionals are read."
        args = sys.argv[1:] if args is None else list(args)
        if not self.key_values:
            return args
        kv, rest = [], []
        for i, x in enumerate(args):
            flag = self._option_string_actions.get(args[i - 1]) if i else None
            takes_it = flag is not None and flag.nargs in (None, "?")    # `--out a=b`: a one-value flag's value
            (kv if KEY_VALUE.match(x) and not takes_it else rest).append(x)
        return kv + rest


def run_main(main, argv=None, prog: str | None = None) -> int:
    """`main(argv)` -> its exit status (None counts as 0). A `UsageError` is printed as `prog: error: message` on
    stderr with status 2, unless `debug_requested(argv)`, which re-raises it with its traceback."""
    argv = sys.argv[1:] if argv is None else list(argv)
    prog = prog or os.path.basename(sys.argv[0]) or "powerclip"
    try:
        rc = main(argv)
    except UsageError as e:
        if debug_requested(argv):
            raise
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0 if rc is None else int(rc)


def check_device(flag: str, name: str, hint: str = "cpu") -> str:
    """`name` as a device that exists here (cpu, cuda, cuda:N with at least N + 1 GPUs), else a ValueError whose message
    starts with `flag`, the argument the user typed; `hint`: what to give instead when no GPU is there. Every command
    and the trainer's `validate` check a device here."""
    import torch   # here, not at the top: the convention itself needs no torch
    try:
        d = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"{flag}: {name!r} is not a device (cpu, cuda, cuda:N)") from None
    if d.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise ValueError(f"{flag}: {name!r} asks for a GPU and none is available ({hint})")
        if d.index is not None and d.index >= n:
            raise ValueError(f"{flag}: {name!r}, but there are {n} GPU(s) (cuda:0 .. cuda:{n - 1})")
    return name


# %% [markdown]
# **Devices.** `check_device` is the one check of a `--device` (or the trainer's `device`): a name torch reads as a
# device, and, for a GPU, one that is there. Every command calls it in its validation, so a missing GPU is one line.

# %% [markdown]
# A small command shows every path: a good call, a bad value caught in validation, a bad flag caught by the parser,
# `--debug`, and a bug after validation, which keeps its traceback.

# %%
def _toy(argv):
    ap = ArgumentParser(prog="toy")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--debug", action="store_true")
    with usage_errors():
        a = ap.parse_args(argv)
        if a.steps < 1:
            raise ValueError(f"--steps: must be at least 1, got {a.steps}")
    if a.steps == 13:
        raise RuntimeError("a bug")      # after validation: not the user's fault
    return 0

def _run(argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = run_main(_toy, argv, prog="toy")
    return rc, err.getvalue()

test_eq(_run(["--steps", "3"]), (0, ""))
test_eq(_run(["--steps", "0"]), (2, "toy: error: --steps: must be at least 1, got 0\n"))
rc, msg = _run(["--steps", "x"])
assert rc == 2 and msg.count("\n") == 1 and "invalid int value: 'x'" in msg, msg
rc, msg = _run(["--nope"])
assert rc == 2 and msg.count("\n") == 1 and "unrecognized arguments: --nope" in msg, msg
test_fail(lambda: run_main(_toy, ["--steps", "0", "--debug"]), contains="at least 1")   # --debug: the traceback
test_fail(lambda: run_main(_toy, ["--steps", "13"]), contains="a bug")                   # a bug is never swallowed
os.environ["POWERCLIP_DEBUG"] = "1"
try:
    test_fail(lambda: run_main(_toy, ["--steps", "0"]), contains="at least 1")
finally:
    del os.environ["POWERCLIP_DEBUG"]
with contextlib.suppress(UsageError):
    with usage_errors():
        {}["method"]
try:
    with usage_errors():
        raise KeyError("unknown method 'x'; registered: ['clip']")
except UsageError as e:
    test_eq(str(e), "unknown method 'x'; registered: ['clip']")   # no repr quotes
# `key=value` after a flag of several values is an override, not one of its values; after a one-value flag it is
# that flag's value (a folder may have "=" in its name)
_kv = ArgumentParser(prog="toy", key_values=True)
_kv.add_argument("--seeds", nargs="+", type=int)
_kv.add_argument("--out")
_kv.add_argument("overrides", nargs="*")
_a = _kv.parse_intermixed_args(["--seeds", "0", "1", "optim.lr=1e-3", "--out", "a=b", "progress=false"])
test_eq((_a.seeds, _a.out, _a.overrides), ([0, 1], "a=b", ["optim.lr=1e-3", "progress=false"]))
_a, _rest = _kv.parse_known_intermixed_args(["--seeds", "0", "x=1"])     # the entry point newer Pythons take alone
test_eq((_a.seeds, _a.overrides, _rest), ([0], ["x=1"], []))
_kv.add_argument("--merge", nargs="+")
_a = _kv.parse_args(["x=1", "--seeds", "2", "--merge", "a", "./z=3", "y=2"])
test_eq((_a.seeds, _a.merge, _a.overrides), ([2], ["a", "./z=3"], ["x=1", "y=2"]))   # a path is no override
_plain = ArgumentParser(prog="toy")                  # without key_values: argparse's reading
_plain.add_argument("--seeds", nargs="+", type=int)
_plain.add_argument("overrides", nargs="*")
test_fail(lambda: _plain.parse_intermixed_args(["--seeds", "0", "x=1"]), contains="invalid int value")
test_eq(check_device("--device", "cpu"), "cpu")
test_fail(lambda: check_device("--device", "tpu"), contains="--device: 'tpu' is not a device (cpu, cuda, cuda:N)")
if not __import__("torch").cuda.is_available():
    test_fail(lambda: check_device("--device", "cuda:1"), contains="'cuda:1' asks for a GPU "
                                                                   "and none is available (cpu)")
