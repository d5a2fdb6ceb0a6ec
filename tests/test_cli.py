"""Every command line answers a user's mistake with one line on stderr naming the argument, exit status 2, before any
model is built (the convention of `powerclip.commandline`, nbs/17_commandline).

One table of cases over all entry points: powerclip.train, powerclip-heatmaps, data_prep/annotate_shards.py, the
benchmark scripts, powerclip-eval and the demo. Each case runs in this process through the command's own `main` (which
goes through `powerclip.commandline.run_main`), with every way of building a model or starting the work replaced by a
tripwire: a case that gets that far fails, whatever it would have printed later. A few cases run as real commands in a
fresh process, to check the exit status and the single line end to end (a model built there would add open_clip's "No
pretrained weights loaded" warning line), and that they answer within the time of a process start.
"""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))            # the benchmark scripts import their `_checks` beside them
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: device=cuda is not a mistake here")
NO_MPS = pytest.mark.skipif(torch.backends.mps.is_available(), reason="mps is present: --device mps is no mistake here")


class Built(BaseException):
    "Raised by a tripwire: the command went past its validation (a BaseException, so no handler swallows it)."


def _tripwire(what):
    def f(*a, **k):
        raise Built(f"{what} was called: the mistake was not caught before the work started")
    return f


@pytest.fixture
def tripwires(monkeypatch):
    "Replace every way an entry point builds a model or starts its work."
    import open_clip.factory
    import powerclip.measure
    import powerclip.model
    import powerclip.train
    monkeypatch.setattr(powerclip.model, "create_model", _tripwire("powerclip.model.create_model"))
    monkeypatch.setattr(open_clip.factory, "create_model", _tripwire("open_clip.create_model"))
    monkeypatch.setattr(powerclip.measure, "run_isolated", _tripwire("run_isolated"))
    monkeypatch.setattr(powerclip.train, "train", _tripwire("powerclip.train.train"))
    monkeypatch.setattr(subprocess, "run", _tripwire("subprocess.run"))
    import data_prep.annotate_shards as ann
    monkeypatch.setattr(ann, "run", _tripwire("annotate_shards.run"))
    for mod in ("powerclip.compare", "powerclip.experiments", "powerclip.eval.cli"):
        try:
            m = importlib.import_module(mod)
        except ImportError:
            continue
        for name in ("train", "run_isolated", "load_model"):
            if hasattr(m, name):
                monkeypatch.setattr(m, name, _tripwire(f"{mod}.{name}"))


def _bench(name):
    "A benchmark script as its command line runs it: `run_main(main, argv, prog)`."
    from powerclip.commandline import run_main
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return lambda argv: run_main(mod.main, argv, f"{name}.py")


def _entry(kind):
    if kind == "train":
        from powerclip.train import main
        return main
    if kind == "heatmaps":
        from powerclip.heatmaps import main
        return main
    if kind == "annotate":
        from data_prep.annotate_shards import main
        return main
    if kind == "eval":
        from powerclip.eval.cli import main
        return main
    if kind == "demo":
        from powerclip.compare import main
        return main
    if kind == "experiments":
        from powerclip.experiments import main
        return main
    return _bench(kind)


# ------------------------------------------------------------------------------------------------ the table
# (entry point, argv, the name the line must hold, marks); '{tmp}' is a fresh folder holding 'a_file' (an ordinary
# file), 'shard.tar' (a valid shard of one sample) and 'cut.pt' (a torch file cut short); '{env:K=V}' as the first word
# sets an environment variable.
T = ["--preset", "smoke"]
CASES = [
    # powerclip.train: the cases, then more
    ("train", [*T, "--method", "nope"], "method"),
    ("train", [*T, "optim.learnig_rate=1"], "optim.learnig_rate"),
    ("train", [*T, "method_cfg.lamda=1"], "method_cfg.lamda"),
    ("train", [*T, "method_cfg.tau=-1"], "method_cfg.tau"),
    ("train", [*T, "method_cfg.M=0"], "method_cfg.M"),
    ("train", [*T, "optim.lr=abc"], "optim.lr"),
    ("train", ["--preset", "nope"], "--preset"),
    ("train", ["--preset", "{tmp}/missing.yaml"], "--preset"),
    ("train", [*T, "out_dir={tmp}/a_file"], "out_dir"),
    ("train", [*T, "data.batch_size=1000"], "data.batch_size"),
    ("train", [*T, "data.source=wds", "data.shards={tmp}/nope/{00000..00003}.tar", "max_steps=5"], "data.shards"),
    ("train", ["{env:WORLD_SIZE=2}", *T, "global_batch_size=9"], "global_batch_size"),
    ("train", [*T, "resume={tmp}/missing.pt"], "resume"),
    ("train", [*T, "device=cuda"], "device", NO_GPU),
    ("train", [*T, "precision=fp16"], "precision"),
    ("train", [*T, "max_steps=-1"], "max_steps"),
    ("train", [*T, "data.workers=-1"], "data.workers"),
    ("train", [*T, "max_steps"], "max_steps"),                                    # no '='
    ("train", [*T, "--nope"], "--nope"),
    ("train", [*T, "method_cfg.masks=stored"], "method_cfg"),                     # stored masks on the world
    ("train", [*T, "model.name=ViT-X"], "model"),
    ("train", [*T, "model.pretrained={tmp}/missing.pt"], "model.pretrained"),
    ("train", [*T, "data.source=wds", "data.shards={tmp}/shard.tar", "max_steps=null"], "max_steps"),  # no epoch length
    ("train", [*T, "progress=maybe"], "progress"),
    ("train", [*T, "optim.betas=[0.9]"], "optim.betas"),
    ("train", [*T, "data.world={max_objectz: 2}"], "data.world"),
    # issue 40: numbers are finite numbers in their range, model.kwargs typed, out_dir writable, pretrained readable
    ("train", [*T, "optim.lr=nan"], "optim.lr"),
    ("train", [*T, "optim.lr=.inf"], "optim.lr"),
    ("train", [*T, "method_cfg.lam=nan"], "method_cfg.lam"),
    ("train", [*T, "method_cfg.lam=-0.1"], "method_cfg.lam"),
    ("train", [*T, "optim.min_lr=1e-2"], "optim.min_lr"),                        # above the smoke preset's lr 1e-3
    ("train", [*T, "optim.grad_clip=.nan"], "optim.grad_clip"),
    ("train", [*T, "eval_timeout_s=.inf"], "eval_timeout_s"),
    ("train", [*T, "data.world={max_objects: 2, noise: .nan}"], "data.world.noise"),
    ("train", [*T, "model.kwargs.embed_dim=abc"], "model.kwargs.embed_dim"),
    ("train", [*T, "model.kwargs.depth=3"], "model.kwargs.depth"),
    ("train", [*T, "out_dir=/proc/sys/powerclip_run"], "out_dir"),
    ("train", [*T, "model.pretrained={tmp}/cut.pt"], "model.pretrained"),
    ("annotate", ["{tmp}/shard.tar", "--out", "{tmp}/out", "--min-frac", "5"], "--min-frac"),
    ("annotate", ["{tmp}/shard.tar", "--out", "{tmp}/out", "--min-frac", "nan"], "--min-frac"),
    ("annotate", ["{tmp}/shard.tar", "--out", "{tmp}/out", "--fz-scale", "nan"], "--fz-scale"),
    ("annotate", ["{tmp}/shard.tar", "--out", "{tmp}"], "--out"),                      # the input's own folder
    ("gpu_check", ["--dry-run", "--budget", "nan"], "--budget"),
    ("gpu_check", ["--dry-run", "--budget", "inf"], "--budget"),
    ("demo", ["--out", "{tmp}/demo", "--finetune-share", "nan"], "--finetune-share"),
    ("demo", ["--out", "{tmp}/demo", "--curve-points", "0.5", "nan"], "--curve-points"),
    ("demo", ["--out", "{tmp}/demo", "optim.lr=nan"], "optim.lr"),
    ("experiments", ["table14", "method_cfg.lam=nan", "--out", "{tmp}/exp"], "method_cfg.lam"),
    ("eval", ["run", "--model", "powerclip-micro", "--data", "{tmp}", "--device", "mps"], "--device", NO_MPS),
    ("eval", ["make-world", "{tmp}"], "out"),                                     # a folder of other files
    # powerclip-heatmaps
    ("heatmaps", ["--image", "{tmp}/a_file", "--text", "a dog"], "--checkpoint"),
    ("heatmaps", ["--checkpoint", "{tmp}/nope/last.pt", "--grounding", "2"], "--checkpoint"),
    ("heatmaps", ["--checkpoint", "{tmp}", "--grounding", "2"], "--checkpoint"),      # a folder without a checkpoint
    ("heatmaps", ["--checkpoint", "random:ViT-X", "--grounding", "2"], "--checkpoint"),
    ("heatmaps", ["--checkpoint", "a=", "--grounding", "2"], "--checkpoint"),
    ("heatmaps", ["--checkpoint", "random:powerclip-micro", "--image", "{tmp}/nope.png", "--text", "x"], "--image"),
    # not an image
    ("heatmaps", ["--checkpoint", "random:powerclip-micro", "--image", "{tmp}/a_file", "--text", "x"], "--image"),
    ("heatmaps", ["--checkpoint", "random:powerclip-micro"], "--grounding"),
    ("heatmaps", ["--checkpoint", "random:powerclip-micro", "--grounding", "-1"], "--grounding"),
    ("heatmaps", ["--checkpoint", "random:powerclip-micro", "--grounding", "2", "--device", "cuda"],
     "--device", NO_GPU),
    ("heatmaps", ["--checkpoint", "random:powerclip-micro", "--grounding", "2", "--out", "{tmp}/a_file"], "--out"),
    ("heatmaps", ["--checkpoint", "random:powerclip-micro", "--grounding", "x"], "--grounding"),
    # data_prep/annotate_shards.py
    ("annotate", ["{tmp}/nope.tar", "--out", "{tmp}/out"], "shards"),
    ("annotate", ["{tmp}/shard.tar", "--out", "{tmp}/a_file"], "--out"),
    ("annotate", ["{tmp}/shard.tar", "--out", "{tmp}/out", "--workers", "0"], "--workers"),
    ("annotate", ["{tmp}/shard.tar", "--out", "{tmp}/out", "--grid", "3y"], "--grid"),
    ("annotate", ["{tmp}/shard.tar", "--out", "{tmp}/out", "--regions", "sam2"], "--sam2-checkpoint"),
    # the benchmark scripts
    ("baselines_cost", ["--batch", "0"], "--batch"),
    ("baselines_cost", ["--device", "cuda"], "--device", NO_GPU),
    ("powerset_scale", ["--reps", "0"], "--reps"),
    ("powerset_scale", ["--M", "10", "0"], "--M"),
    ("powerset_scale", ["--report-only", "--tag", "nope"], "--tag"),
    ("paper_memory", ["--R", "0"], "--R"),
    ("data_model_throughput", ["--model", "ViT-X"], "--model"),
    ("data_model_throughput", ["--workers", "-1"], "--workers"),
    ("parse_throughput", ["--tsv", "{tmp}/missing.tsv"], "--tsv"),
    ("parse_throughput", ["--tsv", "{tmp}/a_file", "--procs", "1", "0"], "--procs"),
    ("pgs_cost", ["--arch", "nope"], "--arch"),
    ("regions_speed", ["--images", "{tmp}/nope"], "--images"),
    ("regions_speed", ["--n", "0"], "--n"),
    ("train_step_ratio", ["--methods", "clip", "nope"], "--methods nope"),
    ("train_step_ratio", ["--methods", "powerclip:M=0"], "method_cfg.M"),
    ("train_step_ratio", ["--preset", "nope"], "--preset"),
    ("train_step_ratio", ["--batch", "0"], "--batch"),
    ("train_step_ratio", ["--out", "{tmp}/a_file"], "--out"),
    ("powerset_scale", ["--K", "0"], "--K"),
    ("powerset_scale", ["--device", "cuda"], "--device", NO_GPU),
    ("paper_memory", ["--arch", "ViT-X"], "--arch"),
    ("paper_memory", ["--device", "cuda"], "--device", NO_GPU),
    ("gpu_check", [], "--device", NO_GPU),                                     # no GPU here: one line, before anything
    ("gpu_check", ["--device", "cpu"], "--device"),
    ("gpu_check", ["--parts", "parity", "nope"], "--parts"),
    ("gpu_check", ["--dry-run", "--methods", "nope"], "--methods"),
    ("gpu_check", ["--dry-run", "--part-timeout", "0"], "--part-timeout"),
    ("gpu_check", ["--dry-run", "--part-timeout", "nan"], "--part-timeout"),
    ("gpu_check", ["--dry-run", "--compare-steps", "0"], "--compare-steps"),
    ("gpu_check", ["--dry-run", "--out", "{tmp}/a_file"], "--out"),
    ("world_throughput", ["--workers", "-1"], "--workers"),
    ("world_throughput", ["--out", "{tmp}"], "--out"),
    ("annotate_throughput", ["--coco", "{tmp}/nope"], "--coco"),
    ("annotate_throughput", ["--regions", "sam9"], "--regions"),
    # powerclip-eval and the comparison (`make demo`, `make compare`)
    ("eval", ["run", "--checkpoint", "{tmp}/nope.pt", "--data", "{tmp}", "--out", "{tmp}/res", "--cache", "none"],
     "--checkpoint"),
    ("eval", ["run", "--model", "ViT-X", "--data", "{tmp}", "--out", "{tmp}/res", "--cache", "none"], "--model"),
    ("eval", ["run", "--model", "powerclip-micro", "--data", "{tmp}/nope", "--out", "{tmp}/res"], "--data"),
    ("eval", ["run", "--model", "powerclip-micro", "--data", "{tmp}", "--batch-size", "0"], "--batch-size"),
    ("eval", ["tables", "{tmp}/nope.json"], "results"),
    ("eval", ["run", "--model", "powerclip-micro", "--data", "{tmp}"], "--data"),        # no data set in it
    ("demo", ["--out", "{tmp}/demo", "--runs", "nope"], "--runs"),
    ("demo", ["--out", "{tmp}/demo", "--steps", "0"], "--steps"),
    ("demo", ["--out", "{tmp}/demo", "optim.lr=abc"], "optim.lr"),
    ("demo", ["--out", "{tmp}/demo", "--eval-images", "-1"], "--eval-images"),
    ("demo", ["--out", "{tmp}/a_file"], "--out"),
    ("demo", ["--out", "{tmp}/demo", "--preset", "nope"], "--preset"),
    ("experiments", ["table99"], "table99"),
    ("experiments", ["table14", "--steps", "0", "--out", "{tmp}/exp"], "--steps"),
    ("experiments", ["table14", "optim.lr=abc", "--out", "{tmp}/exp"], "optim.lr"),
    ("experiments", ["table14", "--seeds", "0", "0", "--out", "{tmp}/exp"], "--seeds"),
    ("experiments", ["anatomy", "--steps", "1", "--out", "{tmp}/exp"], "--steps"),
    ("experiments", ["anatomy", "--seeds", "-1", "--out", "{tmp}/exp"], "--seeds"),
    ("experiments", ["table6", "--merge", "{tmp}/exp", "--out", "{tmp}/exp"], "--merge"),
    ("experiments", ["plateau", "--steps", "8", "--rows", "FILIP", "--out", "{tmp}/exp"], "--rows"),
    ("experiments", ["plateau", "--steps", "8", "--merge", "{tmp}/nowhere", "--out", "{tmp}/exp"], "nowhere"),
    ("experiments", ["plateau", "--merge", "{tmp}/nowhere", "--out", "{tmp}/exp"], "--steps"),
]


def _params(cases):
    out = []
    for c in cases:
        kind, argv, key, *marks = c
        out.append(pytest.param(kind, argv, key, marks=marks, id=f"{kind}:{' '.join(argv)}"[:90]))
    return out


@pytest.fixture
def tmp(tmp_path):
    from powerclip.data import write_shard
    (tmp_path / "a_file").write_text("not an image, not a folder\n")
    write_shard(tmp_path / "shard.tar", [{"__key__": "000000000", "txt": "a dog", "jpg": b"\xff\xd8"}])
    torch.save({"w": torch.ones(64)}, tmp_path / "cut.pt")
    (tmp_path / "cut.pt").write_bytes((tmp_path / "cut.pt").read_bytes()[:300])     # a copy cut short
    return tmp_path


def _argv(argv, tmp, monkeypatch=None):
    out = []
    for a in argv:
        if a.startswith("{env:"):
            k, v = a[5:-1].split("=", 1)
            if monkeypatch is not None:
                monkeypatch.setenv(k, v)
            continue
        out.append(a.replace("{tmp}", str(tmp)))
    return out


@pytest.mark.parametrize("kind,argv,key", _params(CASES))
def test_mistake_is_one_line_before_any_model(kind, argv, key, tmp, tripwires, monkeypatch, capsys):
    monkeypatch.chdir(tmp)                      # nothing a command writes by default lands in the repository
    monkeypatch.delenv("POWERCLIP_DEBUG", raising=False)
    main = _entry(kind)
    capsys.readouterr()
    try:
        rc = main(_argv(argv, tmp, monkeypatch))
    except SystemExit as e:
        rc = e.code         # argparse's own exit (an unconverted command)
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert rc == 2, f"exit status {rc!r}, stderr: {err[-2000:]}"
    assert len(lines) == 1 and ": error: " in lines[0], f"not one line: {err[-2000:]}"
    assert key in lines[0], f"{key!r} not named in: {lines[0]}"


def test_debug_shows_the_traceback(tmp, tripwires, capsys):
    from powerclip.commandline import UsageError
    from powerclip.train import main
    with pytest.raises(UsageError, match="optim.lr"):
        main([*T, "optim.lr=abc", "--debug"])
    with pytest.raises(UsageError, match="--checkpoint"):
        _entry("heatmaps")(["--grounding", "2", "--debug"])
    with pytest.raises(UsageError, match="--batch"):
        _entry("baselines_cost")(["--batch", "0", "--debug"])


# ------------------------------------------------------------------------------------------------ real commands
CMDS = [
    ([sys.executable, "-m", "powerclip.train", *T, "optim.lr=abc"], "optim.lr"),
    ([sys.executable, "-m", "powerclip.train", *T, "data.source=wds", "data.shards={tmp}/nope/{0..3}.tar",
      "max_steps=5"], "data.shards"),
    ([sys.executable, "-m", "powerclip.heatmaps", "--checkpoint", "random:powerclip-micro", "--image", "{tmp}/nope.png",
      "--text", "a dog"], "--image"),
    ([sys.executable, "data_prep/annotate_shards.py", "{tmp}/nope.tar", "--out", "{tmp}/out"], "shards"),
    ([sys.executable, "benchmarks/train_step_ratio.py", "--methods", "nope"], "--methods"),
    ([sys.executable, "benchmarks/world_throughput.py", "--n", "0"], "--n"),
    ([sys.executable, "benchmarks/sigmoid_temperatures.py", "{tmp}"], "no seed folders"),
]


@pytest.mark.parametrize("cmd,key", [pytest.param(c, k, id=" ".join(c[1:4])) for c, k in CMDS])
def test_real_command(cmd, key, tmp):
    r = subprocess.run(_argv(cmd, tmp), cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "POWERCLIP_DEBUG": ""})
    lines = r.stderr.splitlines()
    # nothing but the one line: open_clip logs a warning line on stderr when it builds a model, so a command that got
    # as far as a model would print two (test_mistake_is_one_line_before_any_model's tripwires check it in-process);
    # not the time it took, which says more about the machine's load than about the command
    assert r.returncode == 2 and len(lines) == 1 and key in lines[0] and r.stdout == "", r.stderr[-2000:]
