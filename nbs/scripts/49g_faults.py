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
#| default_exp faults

# %%
#| export
from __future__ import annotations

import errno, fcntl, os, resource, shutil, socket, time
from pathlib import Path

import torch

from powerclip import dist as pdist
from powerclip.checkpoint import is_trainer_checkpoint, load_checkpoint, weights_of_run
from powerclip.commandline import Diverged, UsageError, WriteFailed
from powerclip.config import TrainConfig
from powerclip.data import Geometry, world_config

# %%
#| hide
import tempfile
from fastcore.test import test_eq, test_fail

# %% [markdown]
# # A real machine's faults
#
# > One trainer per run folder, and a full disk that stops a run cleanly.
#
# Two faults a run meets on a real machine, and what the trainer (`50_train`) does about them.
#
# **One trainer per run folder.** Nothing else stops a second `powerclip.train` started into the folder of a running
# one, and two trainers in one folder append to one `metrics.csv` and move each other's checkpoints. So the trainer
# takes an advisory lock first (`fcntl.flock` on `train.lock` in the run folder), before it reads, writes or moves any
# file of the run (the resume's set-aside of a damaged checkpoint, `overwrite=true`'s move-aside, the evaluator's
# folder, `metrics.csv`'s header), and holds it for the run's life. The lock file records the holder's pid and host
# name; a second trainer is refused in one line naming them (exit 2), while the first goes on. The lock belongs to the
# open file, so the operating system releases it when its process dies: a lock left by `kill -9` never blocks a resume
# (the file stays, with the dead holder's pid, and is taken over). The open file is shared with the processes the
# trainer forked, its DataLoader workers, and a killed trainer's workers outlive it by up to 5 s (PyTorch's watchdog
# looks for their parent that often): while the lock's recorded holder is a process of this host that no longer runs,
# a new trainer waits for them (at most `ORPHAN_WAIT_S`) instead of refusing, so `kill -9` then the same command
# works. A clean stop removes the file, and a folder the lock created and nothing filled is removed too, so a refused
# command leaves no file behind. Under DDP the main process
# takes it and every process learns the answer (a gather), so all exit together. The lock is advisory and local: a
# second trainer on another machine sharing the folder over NFS may not see it.
#
# **A full disk is one line and a clean stop.** A checkpoint or log write can fail for want of space (`ENOSPC`, a
# quota's `EDQUOT`), for a file-size limit (`EFBIG`: `ulimit -f`; Python ignores the SIGXFSZ that comes with it), or as
# the `RuntimeError` torch's zip writer raises for a short write. `write_failure` turns such an error into one line
# naming the file, about how much the checkpoint needs, the free space or the file-size limit (whichever stopped it) and
# the last good checkpoint; the temporary file is removed (`49b_checkpoint`), and `WriteFailed` ends the command with
# exit status 3 (not 2: the user's command was right; `17_commandline`). `written` runs a write on the main process and
# lets every process know how it went (one small all-reduce), so that under DDP all exit 3 together and none is left
# waiting in a barrier.

# %%
#| export
LOCK_NAME = "train.lock"


class RunLock:
    "The advisory lock of a run folder (`take_run_lock`); `release()` removes its file, then frees it."
    def __init__(self, path: Path, fd: int | None, created: Path | None = None):
        self.path, self.fd, self.created = path, fd, created

    def moved_to(self, folder) -> "RunLock":
        "The lock's folder was renamed (`overwrite=true`'s move-aside): its file is now in `folder`."
        self.path, self.created = Path(folder) / LOCK_NAME, None
        return self

    def follow(self, dest, folder) -> None:
        "The locked folder was moved to `dest` (`overwrite=true`'s move-aside): its lock let go there, `folder` locked."
        if self.fd is None:
            return
        self.moved_to(dest).release()
        new = take_run_lock(folder)
        self.path, self.fd, self.created = new.path, new.fd, new.created

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)       # while still held: a waiting trainer re-checks the inode
        finally:
            os.close(self.fd)
            self.fd = None
        if self.created is not None:                # the folders the lock made, when nothing else was written there
            for d in [self.path.parent, *self.path.parent.parents]:
                try:
                    d.rmdir()
                except OSError:
                    break
                if d == self.created:
                    break


ORPHAN_WAIT_S = 30.0     # how long a new trainer waits for the workers of a holder that no longer runs


def _recorded(path: Path) -> tuple[str, str] | None:
    "The (pid, host) a lock file names; None when it cannot be read."
    try:
        pid, host = path.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return pid, host


def _holder(rec: tuple[str, str] | None) -> str:
    "Who holds a lock, from its record `rec` (`_recorded`)."
    if rec is None:
        return "another process"
    return f"pid {rec[0]} on host {rec[1]}" + " (no longer running: processes it started hold the lock)" * _gone(rec)


def _gone(rec: tuple[str, str] | None) -> bool:
    """The holder `rec` (`_recorded`) is a process of this host that no longer runs (its forked workers may still
    hold the lock)."""
    if rec is None or rec[1] != socket.gethostname():
        return False
    try:
        pid = int(rec[0])
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (OSError, ValueError):
        return False
    try:       # a zombie (killed, its parent yet to reap it) has exited too
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def take_run_lock(folder) -> RunLock:
    """Lock the run folder `folder` (created if missing) for this process, or a `UsageError` naming the holder's pid and
    host. An `OSError` when the folder cannot be created or written (the caller's folder check says why)."""
    folder = Path(folder)
    created = None if folder.exists() else next((a for a in [folder, *folder.parents] if a.parent.exists()), folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    deadline = time.monotonic() + ORPHAN_WAIT_S
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            rec = _recorded(path)
            if _gone(rec) and time.monotonic() < deadline:     # a killed holder's workers, about to exit
                time.sleep(0.1)
                continue
            raise UsageError(f"out_dir: {str(folder)!r} is being trained by {_holder(rec)} (its lock {path}): one "
                             "trainer per run folder; wait for it to finish, or give another out_dir") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:   # not a file its holder removed between our open and our lock: ours
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
    return RunLock(path, fd, created if created is not None and created.exists() else None)


def lock_run(folder, ctx: pdist.DistContext, check=None) -> RunLock:
    """`take_run_lock` on the main process; every process raises the same `UsageError` when it is refused (no process
    is left waiting). `check`: called when the folder cannot be made or written, to raise the folder check's line."""
    lock, refused = RunLock(Path(folder) / LOCK_NAME, None), ""
    if ctx.is_main:
        try:
            try:
                lock = take_run_lock(folder)
            except OSError as e:
                if check is not None:
                    check()
                raise UsageError(f"out_dir: {str(folder)!r} cannot be locked for this run ({e.strerror or e})") \
                    from None
        except UsageError as e:
            refused = str(e)
    refused = pdist.all_gather_object(refused)[0]
    if refused:
        raise UsageError(refused)
    return lock


# %% [markdown]
# A second lock on a held folder is refused with the holder named; a released one leaves nothing, and a lock whose
# holder died (its file left behind) is taken over.

# %%
with tempfile.TemporaryDirectory() as d:
    _run = Path(d) / "a" / "run"
    _l = take_run_lock(_run)
    test_eq(_l.path.read_text().split()[0], str(os.getpid()))
    test_fail(lambda: take_run_lock(_run), contains=f"is being trained by pid {os.getpid()} on host")
    _l.release()
    assert not (Path(d) / "a").exists()                            # the folders it created, empty, removed
    _run.mkdir(parents=True)
    (_run / LOCK_NAME).write_text("999999 elsewhere\n")             # a killed holder's file: no lock on it
    _l = take_run_lock(_run)
    _l.release()
    assert _run.is_dir() and not (_run / LOCK_NAME).exists()        # a folder it did not create stays

# %% [markdown]
# A killed trainer's workers: the file names a holder that no longer runs, and another process (here a child that lets
# go when told, half a second later, as a DataLoader worker does when it finds its parent gone) still holds the lock.
# The new trainer waits for it; were the named holder alive, it would be refused at once.

# %%
import subprocess, sys, threading
with tempfile.TemporaryDirectory() as d:
    _run = Path(d)
    _dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (_run / LOCK_NAME).write_text(f"{_dead.stdout.strip()} {socket.gethostname()}\n")   # a pid that has exited
    _worker = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); "
                                "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()",
                                str(_run / LOCK_NAME)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    test_eq(_worker.stdout.readline().strip(), "held")              # it holds the lock until its stdin closes
    assert _gone(_recorded(_run / LOCK_NAME)) and "no longer running" in _holder(_recorded(_run / LOCK_NAME))
    _told = threading.Event()

    def _let_go():
        _told.set()
        _worker.stdin.close()
    threading.Timer(0.5, _let_go).start()
    _l = take_run_lock(_run)                                        # waits for the worker instead of refusing
    assert _told.is_set()                                           # taken only after the worker let go
    test_eq(_worker.wait(timeout=5), 0)
    _l.release()

# %% [markdown]
# ### Writes that fail

# %%
#| export
DISK_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def object_bytes(obj) -> int:
    "The bytes of every tensor inside `obj` (dicts, lists, tuples): about the size of its `torch.save` file."
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(object_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(object_bytes(v) for v in obj)
    return 0


def is_write_failure(e: BaseException) -> bool:
    "A full disk, a quota or a file-size limit: an `OSError` of those, or torch.save's `RuntimeError` of a short write."
    if isinstance(e, OSError):
        return e.errno in DISK_ERRNOS
    return isinstance(e, RuntimeError) and any(w in str(e) for w in ("inline_container", "file write failed",
                                                                       "unexpected pos", "PytorchStreamWriter"))


def write_failure(e: BaseException, path, size: int | None = None, last_good: str = "") -> str:
    """The one line of a failed write of `path` (`size`: about how many bytes it needed): what stopped it, the free
    space or the file-size limit, and `last_good` (the checkpoint that still loads)."""
    path = Path(path)
    where = next((a for a in [path.parent, *path.parents] if a.exists()), Path("."))
    free = shutil.disk_usage(where).free
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    needs = f"; it needs about {_mib(size)}" if size else ""
    if getattr(e, "errno", None) == errno.EFBIG or (limit != resource.RLIM_INFINITY and size and size > limit):
        why = f"the file-size limit is {_mib(limit)} (ulimit -f)" if limit != resource.RLIM_INFINITY else \
            "the file is larger than the file system allows"
    elif getattr(e, "errno", None) == errno.EDQUOT:
        why = "the disk quota is used up"
    else:
        why = f"{_mib(free)} free on its disk"
    kept = f"; the last good checkpoint is {last_good}" if last_good else "; no checkpoint was written before"
    return (f"writing {path} failed ({type(e).__name__}: {str(e).strip().splitlines()[0][:80]}){needs}; {why}{kept} "
            "(free some space, or give another out_dir, then resume with the same command)")


class Writes:
    "A run's writes through `written`, naming `good` (the newest checkpoint that loads) when one fails."
    def __init__(self, ctx: pdist.DistContext, good: str = ""):
        self.ctx, self.good = ctx, good

    def __call__(self, write, what, size: int | None = None):
        return written(self.ctx, write, what, size, self.good)


def written(ctx: pdist.DistContext, write, what, size: int | None = None, last_good: str = ""):
    """`write()` on the main process; a write failure (`is_write_failure`) there stops every process with `WriteFailed`
    (exit status 3), the line from the main one. Every process must call it (one all-reduce under DDP)."""
    failed, out = "", None
    if ctx.is_main:
        try:
            out = write()
        except (OSError, RuntimeError) as e:
            if not is_write_failure(e):
                raise
            failed = write_failure(e, what, size, last_good)
    if ctx.world_size > 1:
        if float(pdist.all_sum(torch.tensor([float(bool(failed))], device=ctx.device))[0]) > 0:
            raise WriteFailed(failed)
    elif failed:
        raise WriteFailed(failed)
    return out


# %% [markdown]
# A write under a file-size limit, one to `/dev/full`, and one that fails for another reason (kept as it is: a bug is
# a traceback).

# %%
_ctx = pdist.init_distributed("cpu")
with tempfile.TemporaryDirectory() as d:
    _p = Path(d) / "x.bin"
    def _full():
        with open("/dev/full", "wb") as f:
            f.write(b"x" * 8192)
            f.flush()
    test_fail(lambda: written(_ctx, _full, _p, 3 * 2**20, "ck.pt (step 2)"),
              contains="; the last good checkpoint is ck.pt (step 2)")
    try:
        written(_ctx, _full, _p, 3 * 2**20)
    except WriteFailed as e:
        assert "it needs about 3.0 MiB" in e.message and "free on its disk" in e.message, e.message
    test_fail(lambda: written(_ctx, lambda: 1 / 0, _p), contains="division by zero")
    test_eq(written(_ctx, lambda: 7, _p), 7)
    test_eq(object_bytes({"a": torch.zeros(4), "b": [torch.zeros(2, dtype=torch.float64), "s"]}), 32)


# %% [markdown]
# ## Checks of a run that were tracebacks
#
# Each a line of `validate` (`50_train`) or of the trainer's resume, found with one command each: a global batch of
# one (a contrastive loss of 0 with a gradient of 0, a `model.pt` all the same), an `out_dir` that is a dangling
# symbolic link or a loop, `WORLD_SIZE` without `MASTER_ADDR`, a world that cannot draw a scene (sizes below 0,
# `max_tries: 0`, more objects than fit, a huge length), and a resume whose checkpoint is past `max_steps`. A weight
# that is not finite at a checkpoint stops the run before the checkpoint is written, so that a non-finite checkpoint
# never rotates a finite one out (`finite_checkpoint` names the one kept).

# %%
#| export
def check_setup(cfg: TrainConfig, B: int, G: int) -> None:
    "What a run's processes, folder and batch need, as one line each (issue 47): checked before the model is built."
    pre = cfg.model.pretrained
    if pre is not None and is_trainer_checkpoint(pre):     # read without unpickling it
        raise ValueError(f"model.pretrained: {pre!r} is a training checkpoint (weights, optimiser and random states): "
                         f"give the run's weights, {weights_of_run(pre)}")
    if B * G < 2:
        raise ValueError(f"data.batch_size: a global batch of {B * G} has no negative pair: a contrastive loss is 0 "
                         "and so is its gradient (give at least 2)")
    out = Path(cfg.out_dir)
    if out.is_symlink() and not out.exists():
        raise ValueError(f"out_dir: {cfg.out_dir!r} is a symbolic link to nothing (dangling, or a loop): give a folder")
    env = os.environ.get("WORLD_SIZE", "1")   # the environment's, not a planned world size (`validate(world_size=)`)
    if env.strip() not in ("", "0", "1") and not ("MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ):
        raise ValueError(f"WORLD_SIZE={env} but MASTER_ADDR/MASTER_PORT are not set: launch with torchrun (or unset "
                         "WORLD_SIZE for one process)")


def check_geometry(geometry: Geometry) -> None:
    if geometry.context_length < 2:
        raise ValueError(f"model.kwargs: the text tower's context_length is {geometry.context_length}: it must be at "
                         "least 2 (a caption's start and end tokens)")


def free_numbers(d, path: str):
    "(dotted key, value) of every float inside a free-form section (`data.world`), to check that each is finite."
    if isinstance(d, dict):
        for k, v in d.items():
            yield from free_numbers(v, f"{path}.{k}")
    elif isinstance(d, (list, tuple)):
        for i, v in enumerate(d):
            yield from free_numbers(v, f"{path}[{i}]")
    elif isinstance(d, float):
        yield path, d


def check_world_scene(data, geometry: Geometry) -> None:
    "One training scene drawn from the world `data` asks for: a world that cannot draw one is a ValueError, one line."
    from powerclip.world import WorldDataset
    if not 1 <= data.world_length <= 2**31:
        raise ValueError(f"data.world_length: must be in [1, 2^31], got {data.world_length}")
    try:
        WorldDataset(world_config(data, geometry), 1, "train")[0]
    except (RuntimeError, ValueError, OverflowError, IndexError, TypeError) as e:
        raise ValueError(f"data.world: no scene can be drawn ({type(e).__name__}: "
                         f"{str(e).strip().splitlines()[0][:160]})") from None


def state_bytes(model, opt, modules) -> int:
    "About the bytes of a checkpoint of these (the weights, the optimiser's moments): named when a write fails."
    return sum(object_bytes(x.state_dict()) for x in (model, opt, modules) if x is not None)


def finite_checkpoint(run_dir: Path) -> str | None:
    "The newest of the run's checkpoints whose weights are all finite, as 'path (step N)' (read only when one is not)."
    for p in (run_dir / "checkpoints" / "last.pt", run_dir / "checkpoints" / "prev.pt"):
        try:
            ck = load_checkpoint(p)
            if all(bool(torch.isfinite(t).all()) for t in ck["model"].values() if t.is_floating_point()):
                return f"{p} (step {ck['state']['step']})"
        except Exception:       # missing or unreadable: the older one
            continue
    return None


def finite(*modules) -> bool:
    "Every parameter and buffer of `modules` (None skipped) finite."
    return all(bool(torch.isfinite(t).all()) for m in modules if m is not None for t in m.state_dict().values()
               if torch.is_tensor(t) and t.is_floating_point())


def check_finite(state, model, modules, what: str) -> None:
    """Before `what` (weights) is written: `Diverged` unless every weight is finite (a diverged run leaves its
    checkpoints, never a NaN model.pt). Every process calls it, not only the one that writes: they hold the same
    weights, so all of them stop together instead of the others waiting for the writer."""
    if not finite(model, modules):
        raise Diverged(f"the weights are not finite after step {state.step}: {what} not written (the run "
                       f"diverged; its checkpoints are in checkpoints/; a lower optim.lr or optim.grad_clip)")


def refuse_non_finite(finite: bool, step: int, run_dir) -> None:
    "Weights not `finite` at a checkpoint: the run stops before writing it, naming the newest finite checkpoint kept."
    if not finite:
        raise Diverged(f"the weights are not finite at step {step}: no checkpoint written (the finite one is "
                       f"kept: {finite_checkpoint(Path(run_dir)) or 'none'}); a lower optim.lr or optim.grad_clip")


def check_resume_end(cfg: TrainConfig, ck: dict | None, path) -> None:
    "A resume whose checkpoint is past `max_steps` is one line, before anything is written (the same step: a no-op)."
    if ck is not None and cfg.max_steps is not None and ck["state"]["step"] > cfg.max_steps:
        raise UsageError(f"max_steps: {path} is at step {ck['state']['step']}, past max_steps={cfg.max_steps}: a "
                         f"resume cannot go back (max_steps={ck['state']['step']} or more continues it; another "
                         "out_dir starts a new run)")
