r"""Per-step time and peak memory of PowerCLIP against CLIP under the same settings, as a ratio in one run.

Both methods go through the trainer's own run (`powerclip.train.build_run`: model, method, forward, AdamW,
schedule) and step (forward, loss, backward, update) with the same model config, the same world images and captions
and the same seed; each gets the batch parts it asks for (`Method.needs`). Each method runs in its own subprocess so
that its peak memory is its own (`powerclip.measure.run_isolated`), and the methods alternate `--rounds` times so
that a drift in machine load hits all alike. The time per step is the median over all timed steps of a method.

    python benchmarks/train_step_ratio.py                                   # CPU: the demo preset's tiny model
    python benchmarks/train_step_ratio.py --preset paper --device cuda --batch 256 --precision bf16   # ViT-B/16
    python benchmarks/train_step_ratio.py --methods clip flip clip-pgs c2lip c2lip:base=clip smartclip filip sparc \
        powerclip
    python benchmarks/train_step_ratio.py --preset paper --device cuda --batch 256 --precision bf16 \
        --set model.compile=true

A method may carry options after a colon: `c2lip:base=clip,concept_embedding=encode`; `--set key=value` overrides the
config of every method (`benchmarks/gpu_check.py` uses it for `torch.compile`). Results: `--out`/train_step_ratio_TAG.*,
rewritten after every method (marked partial until the end), so a run that is stopped keeps what it measured; a method
that fails is listed and the others go on (exit status 1 at the end).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import _checks
from powerclip.commandline import ArgumentParser, run_main, usage_errors
from powerclip.measure import PeakMemory, run_isolated, sync

OUT = Path(__file__).parent / "results"


def _spec(method: str) -> tuple[str, list[str]]:
    "'name:key=value,key=value' -> (name, ['method_cfg.key=value', ...])."
    name, _, opts = method.partition(":")
    return name, [f"method_cfg.{kv}" for kv in opts.split(",") if kv]


def config(method, a):
    "The run config of `method` (with ':options') under the benchmark's settings."
    from powerclip.train import load_config
    # the built-in world in the preset's model geometry (the paper preset reads shards: use the world instead)
    over = [f"data.batch_size={a.batch}", f"precision={a.precision}", "data.source=world", "data.workers=0",
            f"data.world_length={max(a.batch * (a.warmup + a.steps), 64)}", "global_batch_size=null",
            f"max_steps={a.warmup + a.steps + 10}", "resume=never", *a.set]
    name, opts = _spec(method)
    return load_config(a.preset, over + opts + [f"model.grad_checkpointing={a.grad_checkpointing}"], method=name)


def measure(method, a):
    "In a fresh process: the time of each timed step, and peak memory."
    from powerclip import dist as pdist
    from powerclip.train import TrainState, build_run
    cfg = config(method, a)
    ctx = pdist.DistContext(rank=0, world_size=1, local_rank=0, device=torch.device(a.device), backend=None)
    run = build_run(cfg, ctx)
    it = iter(run.loader())
    batches = [run.prepare(next(it)) for _ in range(a.warmup + a.steps)]
    state = TrainState()
    for b in batches[:a.warmup]:
        run.step(b, state)
    sync(a.device)
    mem = PeakMemory(a.device)
    mem.start()
    times = []
    for b in batches[a.warmup:]:
        sync(a.device)
        t0 = time.perf_counter()
        run.step(b, state)
        sync(a.device)
        times.append(time.perf_counter() - t0)
    # on a GPU also the whole peak: weights, gradients, AdamW's moments and the prepared batches included
    cuda = a.device.startswith("cuda")
    total = torch.cuda.max_memory_allocated(torch.device(a.device)) / 2**20 if cuda else float("nan")
    # and what the caching allocator held at its peak (what decides an out-of-memory error)
    reserved = torch.cuda.max_memory_reserved(torch.device(a.device)) / 2**20 if cuda else float("nan")
    return dict(times=times, peak_mib=mem.mib(), peak_total_mib=total, peak_reserved_mib=reserved, model=cfg.model.name,
                params=sum(p.numel() for p in run.model.parameters()))


def main(argv=None):
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="demo")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=64, help="per-device batch")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--steps", type=int, default=8, help="timed steps per round")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--grad-checkpointing", action="store_true")
    ap.add_argument("--methods", nargs="+", default=["clip", "powerclip"])
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="config overrides for every "
                                                                              "method (model.compile=true)")
    ap.add_argument("--out", type=Path, default=OUT, help="folder of the results")
    ap.add_argument("--tag", default=None, help="name of the results (default: PRESET_DEVICE_BBATCH_PRECISION)")
    ap.add_argument("--debug", action="store_true", help="show the traceback of a usage error")
    with usage_errors():     # every method's whole config is checked here, before any process builds a model
        a = ap.parse_args(argv)
        _checks.at_least(a, 1, "batch", "steps", "rounds")
        _checks.at_least(a, 0, "warmup")
        _checks.device(a.device)
        _checks.out_dir("--out", a.out)
        from powerclip.train import validate
        for m in a.methods:
            try:
                validate(config(m, a), world_size=1)
            except ValueError as e:
                raise ValueError(f"--methods {m}: {e}") from None

    res, failed = {m: [] for m in a.methods}, {}
    for r in range(a.rounds):
        for m in a.methods:
            if m in failed:
                continue
            out = run_isolated(measure, m, a, threads=os.cpu_count() or 1)
            if not out["ok"]:   # say so, keep the others: the results so far are written after every method
                print(f"{m}: {out['error']}", flush=True)
                failed[m] = out["error"]
            else:
                res[m].append(out)
                print(f"round {r} {m:10s} {statistics.median(out['times'])*1e3:9.1f} ms/step  peak "
                      f"{out['peak_mib']:8.1f} MiB", flush=True)
            write(a, res, failed, done=r == a.rounds - 1 and m == a.methods[-1])
    return 1 if failed else 0


def write(a, res: dict, failed: dict, done: bool) -> None:
    """The JSON and Markdown results of every method measured so far (`partial` until the last round's last method;
    a method that failed is listed under `failed`); time and memory against the first method when it is there."""
    base = a.methods[0]
    summary = {}
    for m in a.methods:
        if not res[m]:
            continue
        t = statistics.median([x for o in res[m] for x in o["times"]])
        summary[m] = dict(ms_per_step=t * 1e3, images_per_s=a.batch / t, peak_mib=max(o["peak_mib"] for o in res[m]),
                          peak_total_mib=max(o.get("peak_total_mib", float("nan")) for o in res[m]),
                          peak_reserved_mib=max(o.get("peak_reserved_mib", float("nan")) for o in res[m]),
                          rounds=len(res[m]))
    for m, s in summary.items():
        if base in summary:
            s["time_ratio"] = s["ms_per_step"] / summary[base]["ms_per_step"]
            s["mem_ratio"] = s["peak_mib"] / max(summary[base]["peak_mib"], 1e-9)
    first = next((o[0] for o in res.values() if o), {})
    meta = dict(preset=a.preset, model=first.get("model"), params=first.get("params"), device=a.device,
                gpu=torch.cuda.get_device_name(torch.device(a.device)) if a.device.startswith("cuda") else None,
                cpu=platform.processor() or platform.machine(), partial=not done, failed=failed,
                cores=os.cpu_count(), torch=torch.__version__,
                args={k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()})
    a.out.mkdir(parents=True, exist_ok=True)
    tag = a.tag or f"{a.preset}_{a.device}_B{a.batch}_{a.precision}"
    (a.out / f"train_step_ratio_{tag}.json").write_text(json.dumps(dict(meta=meta, summary=summary), indent=1))
    lines = [f"# Train step: {meta['model']} ({a.preset} preset), {a.device}, batch {a.batch}, {a.precision}"
             + ("" if done else " (partial: still running or stopped)"), "",
             f"| method | ms/step | images/s | peak MiB | time / {base} | memory / {base} |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {m} | {s['ms_per_step']:.1f} | {s['images_per_s']:.1f} | {s['peak_mib']:.1f} | "
              f"{s.get('time_ratio', float('nan')):.2f}x | {s.get('mem_ratio', float('nan')):.2f}x |"
              for m, s in summary.items()]
    lines += [f"| {m} | failed: {e[:200]} | | | | |" for m, e in failed.items()]
    (a.out / f"train_step_ratio_{tag}.md").write_text("\n".join(lines) + "\n")
    if done:
        print("\n".join(lines))

if __name__ == "__main__":
    sys.exit(run_main(main, prog="train_step_ratio.py"))
