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
    python benchmarks/train_step_ratio.py --methods clip siglip flair powerclip:masks=random \
        --set data.world.caption=long model.name=powerclip-demo-long --tag demo_long_cpu   # FLAIR on long captions

`--methods` takes any name of the method registry (`powerclip.methods`), each checked by the trainer's `validate`
before anything runs: FLAIR's step (`flair`: K = 8 sub-captions per image, the text-conditioned pooling O(images x
texts x patches)) is measured against CLIP's like any other, best on the long captions it trains on (above).

A method may carry options after a colon: `c2lip:base=clip,concept_embedding=encode`; `--set key=value` overrides the
config of every method (`benchmarks/gpu_check.py` uses it for `torch.compile`). Results: `--out`/train_step_ratio_TAG.*,
rewritten after every method (marked partial until the end), so a run that is stopped keeps what it measured; a method
that fails is listed and the others go on (exit status 1 at the end).

**The loss at the paper's scale in one process** (`--peers 7`, issue 37): the step of R local images whose loss sees
what 7 more processes of a data-parallel run would send, as `powerclip.dist.gather` delivers it to rank 0: after this
process's rows (with gradient) 7 R further captions' global and phrase embeddings (node counts drawn from real CC3M
captions, `results/cc3m_node_counts.json`) and 7 R further images' global and region embeddings, all detached (unit
vectors, every region valid), drawn once. It is a stand-in for the collective (`SimulatedPeers`, patched in for the
measurement only): the methods' code runs unchanged, the all-gather's and its backward's communication are not in the
time. At `--batch 512 --peers 7` the loss sees C = 4096 columns, the paper's 8 x 512.

    python benchmarks/train_step_ratio.py --preset paper --device cuda --batch 512 --precision bf16 \
        --grad-checkpointing --set model.pool=tok --peers 7 --tag paper_C4096
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


PACKED = ("phrases", "node_text")     # gathered tensors whose rows are nodes (a caption's count each), not samples


def cc3m_counts(n: int, seed: int = 0) -> list[int]:
    "Tree-node counts of `n` captions drawn from the CC3M histogram (`results/cc3m_node_counts.json`)."
    hist = json.loads((OUT / "cc3m_node_counts.json").read_text())["hist"]
    ks = torch.tensor([int(k) for k in hist])
    w = torch.tensor([float(v) for v in hist.values()])
    return ks[torch.multinomial(w, n, replacement=True, generator=torch.Generator().manual_seed(seed))].tolist()


class SimulatedPeers:
    """`powerclip.dist.gather` for rank 0 of `1 + peers` processes, in one process: each gathered tensor is this
    process's (with its gradient) followed by `peers` processes' rows, detached, as DDP's all-gather delivers them.
    A peer holds as many samples as this process; its captions have `counts` tree nodes (`PACKED` tensors: one row per
    node, `node_text` counting its captions from 0; `facts`, PowerCLIP's host facts: each caption's node count and
    each image's valid regions); its float rows are random unit vectors, its masks all valid. The peers' tensors are
    drawn once (the first step) and kept on the device: no time of the step is spent on them. The loss must see a
    context of `1 + peers` processes (`context`), so that the method takes its data-parallel path."""
    def __init__(self, peers: int, counts: list[int], seed: int = 0):
        self.peers, self.counts, self.seed, self.made = peers, counts, seed, {}

    def context(self, ctx):
        "`ctx` as rank 0 of 1 + peers processes (only the loss sees it: no process group is asked for anything)."
        import dataclasses
        return dataclasses.replace(ctx, rank=0, world_size=1 + self.peers)

    def _peer(self, name: str, x: torch.Tensor, samples: int, regions: int) -> tuple[torch.Tensor, list[int]]:
        key = (name, x.dtype, tuple(x.shape[1:]), samples)
        if key not in self.made:
            g = torch.Generator().manual_seed(self.seed)
            k = torch.tensor(self.counts[:self.peers * samples])                       # (peers R,) nodes per caption
            if len(k) < self.peers * samples:
                raise ValueError(f"{len(self.counts)} node counts for {self.peers * samples} peer captions")
            rows = int(k.sum()) if name in PACKED else self.peers * samples
            if name == "node_text":                       # each peer counts its captions from 0, as every process does
                t = torch.arange(samples).repeat(self.peers).repeat_interleave(k)                  # (P_peers,)
            elif name == "facts":                         # (peers R, 2): nodes of each caption, valid regions
                t = torch.stack([k, torch.full_like(k, regions)], 1)
            elif x.is_floating_point():
                t = torch.nn.functional.normalize(torch.randn(rows, *x.shape[1:], generator=g), dim=-1)
            elif x.dtype == torch.bool:
                t = torch.ones(rows, *x.shape[1:], dtype=torch.bool)
            else:
                raise ValueError(f"{name!r}: no simulated rows for a {x.dtype} tensor")
            self.made[key] = (t.to(x.device, x.dtype), [int(v) for v in k.reshape(self.peers, samples).sum(1)]
                              if name in PACKED else [samples] * self.peers)
        return self.made[key]

    def __call__(self, ctx, tensors: dict, pad: dict | None = None):
        from powerclip.dist import Gathered
        samples = next(v.shape[0] for k, v in tensors.items() if k not in PACKED)   # this process's samples
        regions = tensors["region_valid"].shape[1] if "region_valid" in tensors else 0
        all_, rows = {}, {}
        for name, x in tensors.items():
            t, r = self._peer(name, x, samples, regions)
            all_[name] = torch.cat([x, t])
            rows[name] = [x.shape[0], *r]
        return Gathered(all_, 0, rows)


def measure(method, a, batches=None):
    """The time of each timed step, and peak memory (the whole process's since this call on a GPU). `batches`: host
    batches to cycle through (None: the run's own loader, one per step); `a.peers` > 0: the loss sees that many more
    processes' rows (`SimulatedPeers`)."""
    from unittest import mock
    from powerclip import dist as pdist
    from powerclip import methods as pmethods
    from powerclip.train import TrainState, build_run
    cuda = a.device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats(torch.device(a.device))
    cfg = config(method, a)
    ctx = pdist.DistContext(rank=0, world_size=1, local_rank=0, device=torch.device(a.device), backend=None)
    run = build_run(cfg, ctx)
    n = a.warmup + a.steps
    if batches is None:
        it = iter(run.loader())
        batches = [next(it) for _ in range(n)]
    prepared = [run.prepare(b) for b in batches[:n]]
    peers = getattr(a, "peers", 0)
    gather = pmethods.gather
    if peers:
        gather = SimulatedPeers(peers, cc3m_counts(peers * a.batch))
        run.ctx = gather.context(run.ctx)         # the loss's view; the run itself was built for one process
    state, times = TrainState(), []
    with mock.patch.object(pmethods, "gather", gather):
        for i in range(a.warmup):
            run.step(prepared[i % len(prepared)], state)
        sync(a.device)
        mem = PeakMemory(a.device)
        mem.start()
        for i in range(a.warmup, n):
            sync(a.device)
            t0 = time.perf_counter()
            run.step(prepared[i % len(prepared)], state)
            sync(a.device)
            times.append(time.perf_counter() - t0)
    # on a GPU also the whole peak: weights, gradients, AdamW's moments and the prepared batches included
    cuda = a.device.startswith("cuda")
    total = torch.cuda.max_memory_allocated(torch.device(a.device)) / 2**20 if cuda else float("nan")
    # and what the caching allocator held at its peak (what decides an out-of-memory error)
    reserved = torch.cuda.max_memory_reserved(torch.device(a.device)) / 2**20 if cuda else float("nan")
    return dict(times=times, peak_mib=mem.mib(), peak_total_mib=total, peak_reserved_mib=reserved, model=cfg.model.name,
                params=sum(p.numel() for p in run.model.parameters()), peers=peers,
                columns=a.batch * (1 + peers), pool=cfg.model.pool, batches=len(prepared))


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
    ap.add_argument("--peers", type=int, default=0, help="simulated data-parallel peers whose rows the loss sees "
                                                         "(7: C = 8 x batch, the paper's 4096 at 512; see above)")
    ap.add_argument("--out", type=Path, default=OUT, help="folder of the results")
    ap.add_argument("--tag", default=None, help="name of the results (default: PRESET_DEVICE_BBATCH_PRECISION)")
    ap.add_argument("--debug", action="store_true", help="show the traceback of a usage error")
    with usage_errors():     # every method's whole config is checked here, before any process builds a model
        a = ap.parse_args(argv)
        _checks.at_least(a, 1, "batch", "steps", "rounds")
        _checks.at_least(a, 0, "warmup", "peers")
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
    meta = dict(preset=a.preset, model=first.get("model"), params=first.get("params"), device=a.device, peers=a.peers,
                columns=a.batch * (1 + a.peers),
                gpu=torch.cuda.get_device_name(torch.device(a.device)) if a.device.startswith("cuda") else None,
                cpu=platform.processor() or platform.machine(), partial=not done, failed=failed,
                cores=os.cpu_count(), torch=torch.__version__,
                args={k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()})
    a.out.mkdir(parents=True, exist_ok=True)
    tag = a.tag or f"{a.preset}_{a.device}_B{a.batch}_{a.precision}"
    (a.out / f"train_step_ratio_{tag}.json").write_text(json.dumps(dict(meta=meta, summary=summary), indent=1))
    lines = [f"# Train step: {meta['model']} ({a.preset} preset), {a.device}, batch {a.batch}, {a.precision}"
             + (f", the loss against C = {a.batch * (1 + a.peers)} columns ({a.peers} simulated peers)" if a.peers
                else "") + ("" if done else " (partial: still running or stopped)"), "",
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
