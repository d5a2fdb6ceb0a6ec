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
import math
import numbers
import os
import re
import signal
import sys
import threading

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


class Interrupted(Exception):
    """A run stopped by SIGINT or SIGTERM at a step boundary, its checkpoint written: `run_main` prints the message
    (when there is one: the other processes of a distributed run stay quiet) and exits with 128 + the signal's
    number."""
    def __init__(self, signum: int, message: str = ""):
        super().__init__(message)
        self.signum, self.message = int(signum), message

    @property
    def status(self) -> int: return 128 + self.signum


class WriteFailed(Exception):
    """A write the machine refused (a full disk, a quota, a file-size limit), the run stopped cleanly at that step:
    `run_main` prints the message (when there is one: the other processes of a distributed run stay quiet) and exits
    with status 3. Not a usage error (2): the command was right, the machine was not."""
    status = 3

    def __init__(self, message: str = ""):
        super().__init__(message)
        self.message = message


class Diverged(RuntimeError):
    """A run whose weights or losses stopped being finite (too high a learning rate, an overflow) stopped before it
    wrote anything that is not finite, its last finite checkpoint kept: `run_main` prints the message (on rank 0 only:
    every rank of a distributed run stops on the same weights) and exits with status 4. The command and the machine
    were right; the run was not, and resuming it as it is would diverge again."""
    status = 4

    @property
    def message(self) -> str: return str(self) if os.environ.get("RANK", "0") == "0" else ""


def run_main(main, argv=None, prog: str | None = None) -> int:
    """`main(argv)` -> its exit status (None counts as 0). A `UsageError` is printed as `prog: error: message` on
    stderr with status 2, unless `debug_requested(argv)`, which re-raises it with its traceback. An `Interrupted` run
    is its one line and 128 + its signal (130 for SIGINT, 143 for SIGTERM); a Ctrl-C anywhere else is one line and
    130. A `WriteFailed` (a full disk, a file-size limit) is its one line and status 3, a `Diverged` run its one line
    and status 4."""
    argv = sys.argv[1:] if argv is None else list(argv)
    prog = prog or os.path.basename(sys.argv[0]) or "powerclip"
    try:
        rc = main(argv)
    except UsageError as e:
        if debug_requested(argv):
            raise
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        return 2
    except (Interrupted, WriteFailed, Diverged) as e:
        if debug_requested(argv):
            raise
        if e.message:   # a refused write and a divergence are errors; an interruption is news
            print(f"{prog}: {'error: ' * (not isinstance(e, Interrupted))}{e.message}", file=sys.stderr, flush=True)
        return e.status
    except KeyboardInterrupt:
        if debug_requested(argv):
            raise
        print(f"{prog}: interrupted (Ctrl-C)", file=sys.stderr, flush=True)
        return 128 + signal.SIGINT
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
    elif d.type != "cpu":          # mps, xpu, ...: a device torch knows, which this machine may lack
        backend = getattr(torch.backends, d.type, None) or getattr(torch, d.type, None)
        available = getattr(backend, "is_available", lambda: False)
        if not available():
            raise ValueError(f"{flag}: {name!r} is a device torch knows but this machine lacks (cpu, cuda, cuda:N)")
    return name


def _bound_words(lo, hi, lo_open: bool, hi_open: bool) -> str:
    "What `check_number` asks, in words: 'at least 0', 'above 0', 'in (0, 1]'."
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{'above' if lo_open else 'at least'} {lo:g}"
    if hi is not None:
        return f"{'below' if hi_open else 'at most'} {hi:g}"
    return ""


def check_number(flag: str, x, lo=None, hi=None, lo_open: bool = False, hi_open: bool = False,
                 integer: bool = False):
    """`x` if it is a finite number (an integer when `integer`) in the bounds (`lo`, `hi`: None for none; `lo_open`,
    `hi_open`: the bound itself excluded), else a ValueError whose message starts with `flag`. The one check of a number
    for every command and config (see "Numbers" above): NaN passes every `x < lo`, so finiteness comes first."""
    words = _bound_words(lo, hi, lo_open, hi_open)
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise ValueError(f"{flag}: must be {'an integer' if integer else 'a number'}{' ' + words if words else ''}, "
                         f"got {x!r}")
    if not math.isfinite(x):
        raise ValueError(f"{flag}: must be a finite number{' ' + words if words else ''}, got {x}")
    if integer and int(x) != x:
        raise ValueError(f"{flag}: must be an integer{' ' + words if words else ''}, got {x}")
    if ((lo is not None and (x <= lo if lo_open else x < lo)) or (hi is not None and (x >= hi if hi_open else x > hi))):
        raise ValueError(f"{flag}: must be {words}, got {x}")
    return x


class StopSignals:
    """While active (a `with` block on the main thread), SIGINT and SIGTERM are recorded, not raised: `signum` is the
    first one received (0: none), `count` how many came; `on_signal(signum)`, if given, runs on each (e.g. to pass it
    on to a child process). The previous handlers are put back at the end. On another thread it does nothing."""
    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, on_signal=None):
        self.signum, self.count, self.on_signal, self._old = 0, 0, on_signal, {}

    def _handle(self, signum, frame):
        self.signum = self.signum or signum
        self.count += 1
        if self.on_signal is not None:
            self.on_signal(signum)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}
        return False

    @property
    def name(self) -> str: return signal.Signals(self.signum).name if self.signum else ""


# %% [markdown]
# **Devices.** `check_device` is the one check of a `--device` (or the trainer's `device`): a name torch reads as a
# device, and, for a GPU, one that is there; any other kind torch knows (`mps`, `xpu`) must be available here. Every
# command calls it in its validation, so a missing GPU is one line.
#
# **Numbers.** `check_number(flag, x, lo, hi)` is the one check of a number, for every command's flags and every float
# of the trainer's config (`49a_config` calls it for each number it reads): a number, finite, an integer where asked,
# within its bounds, else a ValueError naming the flag. Finiteness comes first because NaN passes every comparison
# check (`nan < 0` is False): `optim.lr=nan`, `--budget nan`, `method_cfg.lam=nan` were accepted before it.
#
# **Interruptions.** `StopSignals` records SIGINT and SIGTERM instead of raising them, so that a long job (the trainer,
# `50_train`) stops where it chooses: at the next step boundary, after a checkpoint. It then raises `Interrupted(signum,
# line)`, which `run_main` prints as its one line and turns into the shell's exit status for that signal, 128 + its
# number (130 for SIGINT, 143 for SIGTERM). A Ctrl-C elsewhere (no handler installed) is one line and 130 too, not a
# traceback.
#
# **A machine's refusal.** A write that fails for a full disk, a quota or a file-size limit (`49g_faults`) stops the run
# cleanly and raises `WriteFailed(line)`: one line and exit status 3, so that a script tells it from a usage error (2),
# a signal (128 + its number) and a bug (1, with its traceback). A run that diverged (its weights, or too many losses
# in a row, not finite: `49g_faults`) raises `Diverged(line)`: one line naming the finite checkpoint kept, status 4.

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
if not __import__("torch").backends.mps.is_available():
    test_fail(lambda: check_device("--device", "mps"), contains="'mps' is a device torch knows but this machine lacks")

# %% [markdown]
# Every way a number can be wrong, each one line naming the flag; and `Interrupted`, `StopSignals` in a command.

# %%
test_eq(check_number("--n", 3, 1, integer=True), 3)
test_eq(check_number("--frac", 1.0, 0, 1, lo_open=True), 1.0)
for args, kw, msg in [(("--lr", float("nan"), 0), {}, "--lr: must be a finite number at least 0, got nan"),
                      (("--lr", float("inf")), {}, "--lr: must be a finite number, got inf"),
                      (("--budget", -1.0, 1), {}, "--budget: must be at least 1, got -1.0"),
                      (("--frac", 5.0, 0, 1), dict(lo_open=True), "--frac: must be in (0, 1], got 5.0"),
                      (("--frac", 0.0, 0, 1), dict(lo_open=True), "--frac: must be in (0, 1], got 0.0"),
                      (("--eps", 0.0, 0), dict(lo_open=True), "--eps: must be above 0, got 0.0"),
                      (("--n", 1.5, 1), dict(integer=True), "--n: must be an integer at least 1, got 1.5"),
                      (("--n", 0, 1), dict(integer=True), "--n: must be at least 1, got 0"),
                      (("--n", "3"), {}, "--n: must be a number, got '3'"), (("--n", True), {}, "must be a number")]:
    test_fail(lambda: check_number(*args, **kw), contains=msg)

_before = signal.getsignal(signal.SIGINT)
def _stopped(argv):
    with StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGTERM)         # recorded, not raised: the work decides where to stop
        os.kill(os.getpid(), signal.SIGINT)
    test_eq((stop.signum, stop.count, stop.name), (signal.SIGTERM, 2, "SIGTERM"))
    raise Interrupted(stop.signum, "interrupted at step 3 (SIGTERM); resume with the same command")

_err = io.StringIO()
with contextlib.redirect_stderr(_err):
    test_eq(run_main(_stopped, [], prog="toy"), 143)
    test_eq(run_main(lambda a: (_ for _ in ()).throw(KeyboardInterrupt()), [], prog="toy"), 130)
    test_eq(run_main(lambda a: (_ for _ in ()).throw(Interrupted(signal.SIGINT)), [], prog="toy"), 130)  # quiet
    test_eq(run_main(lambda a: (_ for _ in ()).throw(WriteFailed("writing x failed")), [], prog="toy"), 3)
    test_eq(run_main(lambda a: (_ for _ in ()).throw(Diverged("the weights are not finite")), [], prog="toy"), 4)
test_eq(_err.getvalue(), "toy: interrupted at step 3 (SIGTERM); resume with the same command\ntoy: interrupted "
                         "(Ctrl-C)\ntoy: error: writing x failed\ntoy: error: the weights are not finite\n")
assert signal.getsignal(signal.SIGINT) is _before                          # the handlers are put back
