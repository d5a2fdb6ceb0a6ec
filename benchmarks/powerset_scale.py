"""The powerset loss at scale: the blocked fast path vs the dense reference vs the CLIP loss (issue 15).

The analogue of the PowerCLIP supplement's Fig. 9, on the axes that decide the cost of the loss itself. For
each configuration -- R local rows, C gathered columns, M regions per image, fp32 or bf16 autocast, and an
implementation -- one process runs forward + backward of `powerclip_loss` in its data-parallel form (R local
images and texts against C gathered ones, both directions of the triplet loss, plus the CLIP loss) and reports

* the median wall-clock time of `--reps` steps after one warm-up step;
* the bytes autograd saves for backward, counted with `torch.autograd.graph.saved_tensors_hooks` (each storage
  once), split into the loss's own inputs (embeddings the caller holds anyway) and everything else;
* the peak resident set size above the process's size once its inputs exist (CPU; CUDA peak on a GPU).

Implementations: `fast` (packed nodes, blocked, analytic backward: `powerclip.powerset_fast`), `dense` (the
(R, C, M, K_max) reference of `powerclip.powerset`, nodes padded to the gathered batch's longest caption, as
the method gathers them today), `exact` (the 2^M enumeration) and `clip` (the CLIP loss alone, the floor).
`dense` and `exact` are skipped where their predicted saved memory exceeds `--budget-gib`.

Tree-node counts K_j are drawn from real captions: a few thousand CC3M validation captions parsed once with
`powerclip.parsing.parse_captions` and tokenised as the data pipeline does (`tree_tokens`: nodes that keep a
word), cached as a histogram in results/cc3m_node_counts.json. Without the data the counts come from a stated
synthetic distribution instead. Every configuration runs in a fresh process (`isolated.py`).

    python benchmarks/powerset_scale.py                          # the full grid (see --help), about an hour
    python benchmarks/powerset_scale.py --R 64 --C 512 --M 5 10 --precision fp32 --tag quick
    python benchmarks/powerset_scale.py --device cuda --R 512 --C 4096 --M 5 10 32 --K 16 --impl fast dense auto clip \
        --precision bf16 --tag gpu_K16 --out benchmarks/results/gpu_x     # a GPU (benchmarks/gpu_check.py)

`auto` is the loss's default (`PowerCLIPLossConfig.impl='auto'`: dense when its scores fit one block, else fast);
`triton` the fused kernel (`powerclip.sbar_triton`, issue 37) where the package has it;
`--K` gives every caption K nodes instead of the CC3M counts. Results: `--out`/powerset_scale_TAG.{md,json,png}.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import _checks
from powerclip.commandline import ArgumentParser, run_main, usage_errors

OUT = Path(__file__).parent / "results"
CC3M = (Path(__file__).resolve().parents[1].parent / "shared" / "data" / "cc3m_validation"
        / "Validation_GCC-1.1.0-Validation.tsv")
SYNTHETIC = "synthetic: K = 1 + Poisson(6.5), capped at 64 (CC3M validation captions not found)"


# ---------------------------------------------------------------------------------------------- node counts
def node_count_hist(tsv: Path = CC3M, n_captions: int = 4000, seed: int = 0) -> dict:
    "{'source', 'hist': {K: count} or None, stats}: tree nodes per real caption, parsed once and cached."
    cache = OUT / "cc3m_node_counts.json"
    if cache.exists():
        return json.loads(cache.read_text())
    if not tsv.exists():
        return dict(source=SYNTHETIC, hist=None)
    from powerclip.parsing import parse_captions
    from powerclip.tokens import tree_tokens
    lines = [l.split("\t")[0] for l in tsv.read_text(encoding="utf-8").splitlines() if l.strip()]
    texts = random.Random(seed).sample(lines, min(n_captions, len(lines)))
    t0 = time.perf_counter()
    parsed = parse_captions(texts)
    ks = [int(tree_tokens(p).node_valid.sum()) for p in parsed]
    ks = [k for k in ks if k > 0]  # a caption without a usable word never reaches the loss
    hist = {k: ks.count(k) for k in sorted(set(ks))}
    srt = sorted(ks)
    res = dict(source=f"CC3M validation: {len(ks)} of {len(texts)} captions sampled with seed {seed}, parsed with "
                      f"powerclip.parsing.parse_captions ({parsed[0].parser}) and tokenised with tree_tokens "
                      f"(nodes that keep a word), {time.perf_counter() - t0:.0f} s",
               hist=hist, mean=sum(ks) / len(ks), p99=srt[int(0.99 * (len(srt) - 1))], max=srt[-1], n=len(ks))
    OUT.mkdir(exist_ok=True)
    cache.write_text(json.dumps(res, indent=1))
    return res


def draw_counts(hist: dict | None, C: int, seed: int) -> list[int]:
    "K_j of C texts, from the histogram (or the synthetic distribution)."
    g = torch.Generator().manual_seed(seed)
    if hist is None:
        return (1 + torch.poisson(torch.full((C,), 6.5), generator=g)).clamp_(max=64).long().tolist()
    ks = torch.tensor([int(k) for k in hist])
    w = torch.tensor([float(v) for v in hist.values()])
    return ks[torch.multinomial(w, C, replacement=True, generator=g)].tolist()


# ---------------------------------------------------------------------------------------------- one configuration
def _inputs(R, C, M, D, counts, impl, seed=0, device="cpu"):
    "Local (R rows) and gathered (C rows) embeddings with grad, as the loss receives them in a DDP step."
    from powerclip.loss import PowersetInputs
    g = torch.Generator().manual_seed(seed)
    unit = lambda *s: F.normalize(torch.randn(*s, generator=g), dim=-1)
    P = sum(counts)
    node_text = torch.arange(C).repeat_interleave(torch.tensor(counts))                  # (P,)
    # a phrase is a sum of unit word vectors (Eq. 3): norm between 1 and ~3 for short phrases
    phrases = unit(P, D) * (1 + 2 * torch.rand(P, 1, generator=g))                        # (P, D)
    leaves = dict(image_all=unit(C, D), text_all=unit(C, D), regions_all=unit(C, M, D), phrases_all=phrases)
    leaves.update(image=leaves["image_all"][:R].clone(), text=leaves["text_all"][:R].clone(),
                  regions=leaves["regions_all"][:R].clone(), phrases=phrases[node_text < R].clone())
    # drawn on the CPU: the same on any device
    leaves, node_text = {k: v.to(device) for k, v in leaves.items()}, node_text.to(device)
    for t in leaves.values():
        t.requires_grad_()
    rv_all = torch.ones(C, M, dtype=torch.bool, device=device)  # random boxes: every region valid (PowerCLIP-R)
    if impl in ("fast", "auto", "triton"):
        local = PowersetInputs(leaves["regions"], rv_all[:R], leaves["phrases"], node_text=node_text[node_text < R])
        gathered = PowersetInputs(leaves["regions_all"], rv_all, leaves["phrases_all"], node_text=node_text)
    else:  # padded to the longest caption: locally of the local batch, gathered of the global one
        from powerclip.powerset_fast import unpack_nodes
        ph_loc, nv_loc = unpack_nodes(leaves["phrases"].detach(), node_text[node_text < R], R)
        ph_all, nv_all = unpack_nodes(leaves["phrases_all"].detach(), node_text, C)
        leaves.update(phrases=ph_loc.requires_grad_(), phrases_all=ph_all.requires_grad_())
        local = PowersetInputs(leaves["regions"], rv_all[:R], leaves["phrases"], nv_loc)
        gathered = PowersetInputs(leaves["regions_all"], rv_all, leaves["phrases_all"], nv_all)
    others = [rv_all, node_text, local.node_valid, local.node_text, gathered.node_valid, gathered.node_text]
    return leaves, local, gathered, [t for t in others if t is not None]


def measure(impl, R, C, M, D, counts, precision, reps, block_bytes, seed=0, device="cpu"):
    "In a fresh process: time, saved-for-backward bytes and peak memory of forward + backward of the loss."
    from powerclip.loss import PowerCLIPLossConfig, clip_loss, powerclip_loss, siglip_loss
    from powerclip.powerset_fast import saved_tensor_bytes
    from powerclip.measure import PeakMemory, sync
    leaves, local, gathered, others = _inputs(R, C, M, D, counts, impl, seed, device)
    cfg = PowerCLIPLossConfig(impl={"dense": "dense", "exact": "dense", "auto": "auto", "triton": "triton"}.get(impl,
                                                                                                         "fast"),
                              exact=impl == "exact", block_bytes=block_bytes)
    scale = torch.tensor(100.0, device=device)
    sig_t, sig_b = torch.tensor(10.0, device=device), torch.tensor(-10.0, device=device)  # SigLIP: t, b at start
    inputs = {t.untyped_storage().data_ptr() for t in [*leaves.values(), *others]}

    def step():
        for t in leaves.values():
            t.grad = None
        with saved_tensor_bytes() as n, torch.autocast(torch.device(device).type, dtype=torch.bfloat16,
                                                       enabled=precision == "bf16"):
            if impl == "clip":
                loss = clip_loss(leaves["image"], leaves["text"], scale, leaves["image_all"], leaves["text_all"], 0)
            elif impl == "siglip":     # the local images against every gathered text (open_clip's SigLipLoss's sum)
                loss = siglip_loss(leaves["image"], leaves["text"], sig_t, sig_b, leaves["text_all"], 0)
            else:
                out = powerclip_loss(leaves["image"], leaves["text"], scale, local, cfg,
                                     leaves["image_all"], leaves["text_all"], gathered, 0)
                loss = out["clip"] + out["powerset"]
        loss.backward()
        assert torch.isfinite(loss) and all(torch.isfinite(t.grad).all() for t in leaves.values() if t.grad is not None)
        return n

    mem = PeakMemory(device)
    mem.start()
    t0 = time.perf_counter()
    n = step()
    sync(device)
    first = time.perf_counter() - t0  # warm-up
    times = []
    for _ in range(reps if first < 30 else 1):  # a step of minutes is timed once
        sync(device)
        t0 = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - t0)
    saved_inputs = sum(b for p, b in n["storages"].items() if p in inputs)
    return dict(time_s=statistics.median(times), reps=len(times), times=times, saved_bytes=n["bytes"],
                saved_input_bytes=saved_inputs, saved_other_bytes=n["bytes"] - saved_inputs, peak_mib=mem.mib())


def predicted_gib(impl, R, C, M, kmax) -> float:
    "Rough saved-for-backward size of the dense paths (both directions), to skip what would not fit the budget."
    if impl == "dense":
        return 2 * 30 * R * C * M * kmax / 2**30          # ~27 B per element of R x C x M x K measured (issue 15)
    if impl == "exact":
        return 2 * 16 * R * C * 2**M * kmax / 2**30       # a few (R, C, 2^M, K) float32 tensors
    return 0.0


def run_one(impl, R, C, M, precision, counts, a) -> dict:
    "One configuration in a fresh process (the one place that calls the fresh-process runner)."
    from powerclip.measure import run_isolated
    return run_isolated(measure, impl, R, C, M, a.dim, counts, precision, a.reps, a.block_mib << 20, 0, a.device,
                        threads=a.threads)


# ---------------------------------------------------------------------------------------------- report
def _fmt_ms(r): return "-" if r is None else (f"{r['time_s'] * 1e3:.0f}" if r.get("ok") else r.get("why", "failed"))
def _fmt_mib(r, k="saved_bytes"): return "-" if r is None or not r.get("ok") else f"{r[k] / 2**20:.1f}"


def report(rows, meta, tag, out=OUT):
    out.mkdir(parents=True, exist_ok=True)
    (out / f"powerset_scale_{tag}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    get = lambda impl, R, C, M, p: next((r for r in rows if (r["impl"], r["R"], r["C"], r["M"], r["precision"])
                                         == (impl, R, C, M, p)), None)
    nc = meta["node_counts"]
    lines = [f"# The powerset loss at scale ({meta['machine']})", "",
             f"Forward + backward of `powerclip_loss` in its DDP form (R local rows against C gathered columns, both "
             f"directions, CLIP loss included), D = {meta['args']['dim']}, median of {meta['args']['reps']} steps "
             f"after a warm-up, each configuration in a fresh process, {meta['threads']} "
             f"threads, torch {meta['torch']}.",
             f"Node counts: {nc['source']}"
             + (f"; mean {nc['mean']:.1f}, p99 {nc['p99']}, max {nc['max']}." if nc.get("hist") else "."),
             f"Fast path block budget {meta['args']['block_mib']} MiB. dense / exact skipped above a predicted "
             f"{meta['args']['budget_gib']} GiB saved for backward. 'saved' = bytes autograd keeps for backward "
             "(saved_tensors_hooks, each storage once); 'beyond inputs' leaves out the embeddings the loss receives "
             "(which the caller holds anyway); peak = peak RSS above the size once the inputs exist. The machine is "
             "shared with other jobs: a timing of seconds varies by tens of percent between runs.", "",
             "| prec | R | C | M | K_max | fast ms | dense ms | exact ms | CLIP ms | dense / fast | fast saved MiB "
             "(beyond inputs) | dense saved MiB | exact saved MiB | CLIP saved MiB | fast peak MiB | dense peak MiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    keys = sorted({(r["precision"], r["R"], r["C"], r["M"]) for r in rows},
                  key=lambda k: (k[0] != "fp32", k[1], k[2], k[3]))
    for p, R, C, M in keys:
        f, d, x, c = (get(i, R, C, M, p) for i in ("fast", "dense", "exact", "clip"))
        kmax = next(r["K_max"] for r in rows if (r["precision"], r["R"], r["C"], r["M"]) == (p, R, C, M))
        ratio = f"{d['time_s'] / f['time_s']:.1f}x" if f and d and f.get("ok") and d.get("ok") else "-"
        fs = f"{_fmt_mib(f)} ({_fmt_mib(f, 'saved_other_bytes')})" if f and f.get("ok") else _fmt_ms(f)
        peak = lambda r: f"{r['peak_mib']:.0f}" if r and r.get("ok") else "-"
        lines.append(f"| {p} | {R} | {C} | {M} | {kmax} | {_fmt_ms(f)} | {_fmt_ms(d)} | {_fmt_ms(x)} | {_fmt_ms(c)} | "
                     f"{ratio} | {fs} | {_fmt_mib(d)} | {_fmt_mib(x)} | {_fmt_mib(c)} | {peak(f)} | {peak(d)} |")
    lines += ["", "## Targets (issue 15, this CPU)", ""] + targets(get)
    (out / f"powerset_scale_{tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(rows, meta, out / f"powerset_scale_{tag}.png")


def targets(get) -> list[str]:
    out = []
    f5, f32 = get("fast", 64, 512, 5, "fp32"), get("fast", 64, 512, 32, "fp32")
    if f5 and f32 and f5.get("ok") and f32.get("ok"):
        r_all, r_oth = f32["saved_bytes"] / f5["saved_bytes"], f32["saved_other_bytes"] / f5["saved_other_bytes"]
        out.append(f"- R=64, C=512, fp32, fast path, saved for backward at M=32 / M=5: {r_oth:.2f}x beyond the inputs "
                   f"({'met' if r_oth <= 2 else 'NOT met'}: at most 2x); {r_all:.2f}x including the inputs, whose "
                   "regions (C, M, D) grow with M by themselves "
                   f"({'met' if r_all <= 2 else 'NOT met'} on that reading).")
    f10, d10 = get("fast", 64, 512, 10, "fp32"), get("dense", 64, 512, 10, "fp32")
    if f10 and d10 and f10.get("ok") and d10.get("ok"):
        r = d10["time_s"] / f10["time_s"]
        out.append(f"- R=64, C=512, M=10, fp32, real node counts: dense / fast time = {r:.1f}x "
                   f"({'met' if r >= 3 else 'NOT met'}: at least 3x).")
    return out or ["- (the target configurations were not in this run)"]


def plot(rows, meta, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ok = [r for r in rows if r.get("ok") and r["precision"] == "fp32"]
    RC = sorted({(r["R"], r["C"]) for r in ok})
    if not RC:
        return
    fig, ax = plt.subplots(2, len(RC), figsize=(3.3 * len(RC), 6), squeeze=False)
    for col, (R, C) in enumerate(RC):
        for impl, style in (("fast", "o-"), ("dense", "s--"), ("exact", "^:"), ("clip", "k-")):
            pts = sorted((r["M"], r) for r in ok if (r["R"], r["C"], r["impl"]) == (R, C, impl))
            if not pts:
                continue
            ax[0, col].plot([m for m, _ in pts], [r["time_s"] * 1e3 for _, r in pts], style, label=impl)
            ax[1, col].plot([m for m, _ in pts], [r["saved_bytes"] / 2**20 for _, r in pts], style, label=impl)
            if impl == "fast":
                ax[1, col].plot([m for m, _ in pts], [r["saved_other_bytes"] / 2**20 for _, r in pts], "o:",
                                color="C0", alpha=0.6, label="fast, beyond inputs")
        ax[0, col].set(title=f"R={R}, C={C}", yscale="log", xlabel="regions M")
        ax[1, col].set(yscale="log", xlabel="regions M")
    ax[0, 0].set_ylabel("fwd+bwd time (ms)")
    ax[1, 0].set_ylabel("saved for backward (MiB)")
    ax[0, 0].legend(fontsize=8)
    ax[1, 0].legend(fontsize=8)
    fig.suptitle(f"powerset loss, fp32, {meta['machine']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---------------------------------------------------------------------------------------------- main
def main(argv=None):
    ap = ArgumentParser(prog="powerset_scale.py", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--R", type=int, nargs="+", default=[64, 256], help="local rows per process")
    ap.add_argument("--C", type=int, nargs="+", default=[512, 2048], help="gathered columns (global batch)")
    ap.add_argument("--M", type=int, nargs="+", default=[5, 10, 15, 32], help="regions per image")
    ap.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument("--impl", nargs="+", default=["fast", "dense", "exact", "clip"],
                    choices=["fast", "dense", "exact", "clip", "auto", "triton", "siglip"])
    ap.add_argument("--K", type=int, default=None, help="nodes per caption, the same for every caption "
                                                        "(default: real CC3M counts)")
    ap.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    ap.add_argument("--out", type=Path, default=OUT, help="folder of the results")
    ap.add_argument("--dim", type=int, default=256, help="embedding width D")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--block-mib", type=int, default=16, help="fast path: PowerCLIPLossConfig.block_bytes in MiB")
    ap.add_argument("--budget-gib", type=float, default=6.0, help="skip dense/exact predicted to save more than this")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per configuration (on a shared machine, 1 "
                    "is steadier: two OpenMP threads that lose their core to another process wait for each other)")
    ap.add_argument("--cc3m", type=Path, default=CC3M, help="CC3M validation TSV for the node counts")
    ap.add_argument("--tag", default="cpu")
    ap.add_argument("--report-only", action="store_true", help="rewrite the md and png from "
                                                               "results/powerset_scale_TAG.json")
    ap.add_argument("--debug", action="store_true", help="show the traceback of a usage error")
    with usage_errors():
        a = ap.parse_args(argv)
        _checks.at_least(a, 1, "R", "C", "M", "dim", "reps", "block-mib", "threads")
        if a.K is not None:
            _checks.at_least(a, 1, "K")
        if a.budget_gib <= 0:
            raise ValueError(f"--budget-gib: must be > 0, got {a.budget_gib}")
        _checks.device(a.device)
        _checks.out_dir("--out", a.out)
        if a.report_only:
            _checks.existing("--tag", a.out / f"powerset_scale_{a.tag}.json", hint="run without --report-only first")
    if a.report_only:
        data = json.loads((a.out / f"powerset_scale_{a.tag}.json").read_text())
        return report(data["rows"], data["meta"], a.tag, a.out)

    nc = node_count_hist(a.cc3m) if a.K is None else dict(source=f"fixed: K = {a.K} nodes per caption", hist=None)
    print("node counts:", nc["source"])
    cpu = (next((l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                if l.startswith("model name")), platform.machine()) if Path("/proc/cpuinfo").exists()
           else platform.machine())
    if a.device.startswith("cuda"):
        cpu = f"{torch.cuda.get_device_name(torch.device(a.device))} (host: {cpu})"
    meta = dict(machine=f"{cpu}, {os.cpu_count()} cores, {a.threads} thread(s) per run", threads=a.threads,
                torch=torch.__version__, device=a.device,
                args={k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
                node_counts={k: v for k, v in nc.items() if k != "hist"} | {"hist": bool(nc.get("hist"))})
    rows = []
    for precision in a.precision:
        for R in a.R:
            for C in a.C:
                if R > C:
                    continue
                counts = [a.K] * C if a.K else draw_counts(nc.get("hist"), C, seed=C)
                kmax = max(counts)
                for M in a.M:
                    for impl in a.impl:
                        base = dict(impl=impl, R=R, C=C, M=M, precision=precision, K_max=kmax, P=sum(counts))
                        if impl in ("clip", "siglip") and M != a.M[0]:  # neither loss depends on M: measure once
                            prev = next(r for r in rows
                                        if (r["impl"], r["R"], r["C"], r["precision"]) == (impl, R, C, precision))
                            rows.append({**prev, **base})
                            continue
                        gib = predicted_gib(impl, R, C, M, kmax)
                        if gib > a.budget_gib:
                            r = dict(ok=False, why=f"skipped: ~{gib:.3g} GiB > {a.budget_gib:g} GiB")
                        else:
                            r = run_one(impl, R, C, M, precision, counts, a)
                            if not r.get("ok"):
                                r["why"] = "failed"
                        rows.append({**base, **r})
                        print(f"{precision} R={R} C={C} M={M} {impl:5s} " + (
                            f"{r['time_s'] * 1e3:8.0f} ms  saved {r['saved_bytes'] / 2**20:8.1f} MiB "
                            f"(beyond inputs {r['saved_other_bytes'] / 2**20:7.1f})  peak {r['peak_mib']:7.0f} MiB"
                            if r.get("ok") else r.get("error", r.get("why"))), flush=True)
    report(rows, meta, a.tag, a.out)


if __name__ == "__main__":
    sys.exit(run_main(main, prog="powerset_scale.py"))
