r"""Peak memory and step time of gradient accumulation (`accum_steps`, `powerclip.accum`) against k, at a fixed batch.

Each (method, k) goes through the trainer's own run and step (`powerclip.train.build_run`, `Run.step`: the k
micro-batches embedded without gradient, the loss once, each micro-batch re-embedded with gradient) on the same world
batches with the same seed, in its own subprocess so that its peak memory is its own (`powerclip.measure.run_isolated`;
on a CPU the peak resident set above the size after the warm-up steps, i.e. mostly activations). The values of k
alternate `--rounds` times so that a drift in machine load hits all alike; the time per step is the median over all
timed steps. k = 1 is the trainer's plain step (no accumulation), the reference of the ratios.

    python benchmarks/accum_memory.py                                   # CPU: the demo preset's tiny model, batch 128
    python benchmarks/accum_memory.py --methods clip powerclip --ks 1 2 4 8 --batch 128
    python benchmarks/accum_memory.py --preset paper --device cuda --batch 512 --precision bf16 --ks 1 2 4

Results: `--out`/accum_memory_TAG.json and .md (rewritten after every measurement, marked partial until the end).
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


def config(method: str, k: int, a):
    "The run config of `method` with `accum_steps=k` under the benchmark's settings."
    from powerclip.train import load_config
    over = [f"data.batch_size={a.batch}", f"precision={a.precision}", "data.source=world", "data.workers=0",
            f"data.world_length={max(a.batch * (a.warmup + a.steps), 64)}", "global_batch_size=null",
            f"max_steps={a.warmup + a.steps + 10}", "resume=never", f"accum_steps={k}",
            f"model.grad_checkpointing={a.grad_checkpointing}"]
    return load_config(a.preset, over, method=method)


def measure(method: str, k: int, a, batches=None) -> dict:
    """The time of each timed step and the peak memory of the timed steps. On a GPU the peak is CUDA's allocated peak
    of the timed steps alone, above what is allocated before them (weights, gradients, AdamW's moments, the batches);
    on a CPU the resident set's peak from before the warm-up (a page the warm-up touched is not seen again).
    `batches`: host batches to cycle through (None: the run's own loader, one per step)."""
    from powerclip import dist as pdist
    from powerclip.train import TrainState, build_run
    ctx = pdist.DistContext(rank=0, world_size=1, local_rank=0, device=torch.device(a.device), backend=None)
    run = build_run(config(method, k, a), ctx)
    n = a.warmup + a.steps
    if batches is None:
        it = iter(run.loader())
        batches = [next(it) for _ in range(n)]
    prepared = [run.prepare(b) for b in batches[:n]]
    state = TrainState()
    mem = PeakMemory(a.device)
    cuda = a.device.startswith("cuda")
    if not cuda:
        mem.start()
    for i in range(a.warmup):
        run.method.on_step(state.step, run.total)
        run.step(prepared[i % len(prepared)], state)
        state.step += 1
    if cuda:
        mem.start()
    times = []
    for b in (prepared[i % len(prepared)] for i in range(a.warmup, n)):
        run.method.on_step(state.step, run.total)
        sync(a.device)
        t0 = time.perf_counter()
        run.step(b, state)
        sync(a.device)
        times.append(time.perf_counter() - t0)
        state.step += 1
    return dict(times=times, peak_mib=mem.mib(), model=run.cfg.model.name,
                peak_of="timed steps" if cuda else "warm-up and timed steps")


def write(a, res: dict, failed: dict, done: bool) -> None:
    "JSON and Markdown of what was measured so far; ratios against k = 1 of the same method."
    rows = []
    for (m, k), outs in res.items():
        if not outs:
            continue
        t = statistics.median([x for o in outs for x in o["times"]])
        rows.append(dict(method=m, k=k, micro_batch=a.batch // k, ms_per_step=t * 1e3,
                         peak_mib=max(o["peak_mib"] for o in outs), rounds=len(outs)))
    for r in rows:
        base = next((b for b in rows if b["method"] == r["method"] and b["k"] == 1), None)
        r["time_ratio"] = r["ms_per_step"] / base["ms_per_step"] if base else float("nan")
        r["mem_ratio"] = r["peak_mib"] / max(base["peak_mib"], 1e-9) if base else float("nan")
    first = next((o[0] for o in res.values() if o), {})
    meta = dict(preset=a.preset, model=first.get("model"), device=a.device, batch=a.batch, precision=a.precision,
                cpu=platform.processor() or platform.machine(), cores=os.cpu_count(), torch=torch.__version__,
                gpu=torch.cuda.get_device_name(torch.device(a.device)) if a.device.startswith("cuda") else None,
                partial=not done, failed={f"{m}:k={k}": e for (m, k), e in failed.items()},
                command="python benchmarks/accum_memory.py " + " ".join(sys.argv[1:]),
                args={k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()})
    a.out.mkdir(parents=True, exist_ok=True)
    tag = a.tag or f"{a.preset}_{a.device}_B{a.batch}_{a.precision}"
    (a.out / f"accum_memory_{tag}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    lines = [f"# Gradient accumulation: {meta['model']} ({a.preset} preset), {a.device}, batch {a.batch} per step, "
             f"{a.precision}" + ("" if done else " (partial: still running or stopped)"), "",
             f"`{meta['command']}` ({meta['cores']} cores, torch {meta['torch']}); peak memory: "
             + ("CUDA peak allocated" if a.device.startswith("cuda") else "peak resident set above the size before "
                "the first step (activations, gradients and AdamW's moments once allocated)"), "",
             "| method | k | micro-batch | ms/step | peak MiB | time / k=1 | memory / k=1 |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['method']} | {r['k']} | {r['micro_batch']} | {r['ms_per_step']:.1f} | {r['peak_mib']:.1f} | "
              f"{r['time_ratio']:.2f}x | {r['mem_ratio']:.2f}x |" for r in rows]
    lines += [f"| {m} | {k} | failed: {e[:200]} | | | | |" for (m, k), e in failed.items()]
    (a.out / f"accum_memory_{tag}.md").write_text("\n".join(lines) + "\n")
    if done:
        print("\n".join(lines))


def main(argv=None):
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="demo")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=128, help="per-device batch of a step (fixed over k)")
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8], help="accum_steps values")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--steps", type=int, default=4, help="timed steps per round")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--grad-checkpointing", action="store_true")
    ap.add_argument("--methods", nargs="+", default=["clip", "powerclip"])
    ap.add_argument("--out", type=Path, default=OUT, help="folder of the results")
    ap.add_argument("--tag", default=None, help="name of the results (default: PRESET_DEVICE_BBATCH_PRECISION)")
    ap.add_argument("--debug", action="store_true", help="show the traceback of a usage error")
    with usage_errors():     # every config is checked here, before any process builds a model
        a = ap.parse_args(argv)
        _checks.at_least(a, 1, "batch", "steps", "rounds", "ks")
        _checks.at_least(a, 0, "warmup")
        _checks.device(a.device)
        _checks.out_dir("--out", a.out)
        from powerclip.train import validate
        for m in a.methods:
            for k in a.ks:
                try:
                    validate(config(m, k, a), world_size=1)
                except ValueError as e:
                    raise ValueError(f"--methods {m} --ks {k}: {e}") from None
    res, failed = {(m, k): [] for m in a.methods for k in a.ks}, {}
    for r in range(a.rounds):
        for m in a.methods:
            for k in a.ks:
                if (m, k) in failed:
                    continue
                out = run_isolated(measure, m, k, a, threads=os.cpu_count() or 1)
                if not out["ok"]:
                    print(f"{m} k={k}: {out['error']}", flush=True)
                    failed[m, k] = out["error"]
                else:
                    res[m, k].append(out)
                    print(f"round {r} {m:10s} k={k}: {statistics.median(out['times']) * 1e3:9.1f} ms/step  peak "
                          f"{out['peak_mib']:8.1f} MiB", flush=True)
                write(a, res, failed, done=r == a.rounds - 1 and m == a.methods[-1] and k == a.ks[-1])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(run_main(main, prog="accum_memory.py"))
