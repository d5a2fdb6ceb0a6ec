"""Per-step time and peak memory of PowerCLIP against CLIP under the same settings, as a ratio in one run.

Both methods go through the trainer's own `train_step` (forward, loss, backward, AdamW, schedule) with the
same model config, the same batches and the same seed. Each method runs in its own subprocess so that its
peak memory is its own (`isolated.py`), and the two alternate `--rounds` times so that a drift in machine load hits both alike. The time per step is the
median over all timed steps of a method.

    python benchmarks/train_step_ratio.py                                   # CPU: the demo preset's tiny model
    python benchmarks/train_step_ratio.py --preset paper --device cuda --batch 256 --precision bf16   # ViT-B/16
    python benchmarks/train_step_ratio.py --methods clip flip clip-pgs c2lip c2lip:base=clip smartclip filip sparc powerclip

A method may carry options after a colon: `c2lip:base=clip,concept_embedding=encode`.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from isolated import PeakMemory, run_isolated, sync

OUT = Path(__file__).parent / "results"


def _world_batches(cfg, n):
    "n batches of the built-in world in the preset's geometry (the paper preset reads shards: use the world)."
    import dataclasses
    from powerclip.data import make_loader
    dcfg = dataclasses.replace(cfg.data, source="world", workers=0, masks="random",
                               world_length=max(cfg.data.batch_size * n, 64))
    it = iter(make_loader(dcfg))
    return [next(it) for _ in range(n)]


def _spec(method: str) -> tuple[str, list[str]]:
    "'name:key=value,key=value' -> (name, ['method_cfg.key=value', ...])."
    name, _, opts = method.partition(":")
    return name, [f"method_cfg.{kv}" for kv in opts.split(",") if kv]


def measure(method, a):
    "In a fresh process: the time of each timed train_step, and peak memory."
    from powerclip import dist as pdist
    from powerclip.methods import get_method
    from powerclip.model import create_model
    from powerclip.train import (TrainState, load_config, make_optimizer, make_scheduler, method_forward, seed_all,
                                 to_device, train_step)
    over = [f"data.batch_size={a.batch}", f"precision={a.precision}"]
    if a.preset == "paper":  # same geometry as the paper (224 px, patch 16), world images instead of shards
        over += ["data.image_size=224", "data.patch_size=16", "data.context_length=77"]
    name, opts = _spec(method)
    cfg = load_config(a.preset, over + opts, method=name)
    ctx = pdist.DistContext(rank=0, world_size=1, local_rank=0, device=torch.device(a.device), backend=None)
    seed_all(cfg.seed)
    model, _, _ = create_model(cfg.model.name, None, **cfg.model.kwargs)
    model.to(ctx.device).train()
    if a.grad_checkpointing: model.set_grad_checkpointing(True)
    m = get_method(cfg.method, cfg.method_cfg)
    fwd = method_forward(model, m)
    opt = make_optimizer(model, cfg.optim, fwd.modules_, m.modules_lr(cfg.optim.lr))
    sched = make_scheduler(opt, cfg.optim, a.warmup + a.steps + 10)
    state = TrainState()
    batches = [to_device(m.prepare_batch(b), ctx.device) for b in _world_batches(cfg, a.warmup + a.steps)]
    for b in batches[:a.warmup]:
        train_step(fwd, m, b, ctx, opt, sched, state, cfg, model)
    sync(a.device)
    mem = PeakMemory(a.device); mem.start()
    times = []
    for b in batches[a.warmup:]:
        sync(a.device); t0 = time.perf_counter()
        train_step(fwd, m, b, ctx, opt, sched, state, cfg, model)
        sync(a.device); times.append(time.perf_counter() - t0)
    return dict(times=times, peak_mib=mem.mib(), model=cfg.model.name, params=sum(p.numel() for p in model.parameters()))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="demo")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=64, help="per-device batch")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--steps", type=int, default=8, help="timed steps per round")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--grad-checkpointing", action="store_true")
    ap.add_argument("--methods", nargs="+", default=["clip", "powerclip"])
    a = ap.parse_args()

    res = {m: [] for m in a.methods}
    for r in range(a.rounds):
        for m in a.methods:
            out = run_isolated(measure, m, a)
            if not out["ok"]:
                print(f"{m}: {out['error']}"); return 1
            res[m].append(out)
            print(f"round {r} {m:10s} {statistics.median(out['times'])*1e3:9.1f} ms/step  peak {out['peak_mib']:8.1f} MiB", flush=True)
    base = a.methods[0]
    summary = {}
    for m in a.methods:
        t = statistics.median([x for o in res[m] for x in o["times"]])
        mem = max(o["peak_mib"] for o in res[m])
        summary[m] = dict(ms_per_step=t * 1e3, images_per_s=a.batch / t, peak_mib=mem)
    for m in a.methods:
        summary[m]["time_ratio"] = summary[m]["ms_per_step"] / summary[base]["ms_per_step"]
        summary[m]["mem_ratio"] = summary[m]["peak_mib"] / max(summary[base]["peak_mib"], 1e-9)
    meta = dict(preset=a.preset, model=res[base][0]["model"], params=res[base][0]["params"], device=a.device,
                gpu=torch.cuda.get_device_name() if a.device == "cuda" else None, cpu=platform.processor() or platform.machine(),
                cores=os.cpu_count(), torch=torch.__version__, args=vars(a))
    OUT.mkdir(exist_ok=True)
    tag = f"{a.preset}_{a.device}_B{a.batch}_{a.precision}"
    (OUT / f"train_step_ratio_{tag}.json").write_text(json.dumps(dict(meta=meta, summary=summary), indent=1))
    lines = [f"# Train step: {meta['model']} ({a.preset} preset), {a.device}, batch {a.batch}, {a.precision}", "",
             f"| method | ms/step | images/s | peak MiB | time / {base} | memory / {base} |", "|---|---|---|---|---|---|"]
    lines += [f"| {m} | {s['ms_per_step']:.1f} | {s['images_per_s']:.1f} | {s['peak_mib']:.1f} | {s['time_ratio']:.2f}x | {s['mem_ratio']:.2f}x |"
              for m, s in summary.items()]
    (OUT / f"train_step_ratio_{tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
