"""This repository's training loader against open_clip's, on the same real photos (issue 45, item 3).

`make real-shards`' COCO shards (239 photos, 1,195 captions, one sample per caption, 224 px JPEGs in 16 webdataset
shards, annotated with spaCy trees and slic regions) are read, one pass each, by

- `ours-random`: the trainer's loader (`powerclip.data.make_loader`, as `Run.loader` calls it) with PowerCLIP's fields:
  the image through the trainer's transform (open_clip's evaluation transform at 224), the stored parse tree as
  tokens and nodes, M = 10 random boxes on ViT-B/16's 14 x 14 grid;
- `ours-slic`: the same with the shards' stored slic regions (`method_cfg.masks=stored`);
- `open_clip`: `open_clip_train.data.get_wds_dataset` with open_clip's own training preprocessing
  (`open_clip.image_transform(224, is_train=True)`: random resized crop, CLIP normalisation) and its tokenizer,
  from the same tars (it reads, and decodes, every member of a sample, as it would on these shards);

each with 1 and 2 DataLoader worker processes, batch 32. A rate is the images after the first batch over the time
after it (the workers' start apart), and per worker = that / workers. The configurations are interleaved (every
configuration once, then every one again, `--rounds` times) so that a busy machine's load falls on all of them alike;
the report gives each round's ratio to open_clip's rate of the same round, and the median. Cores one GPU needs =
its images/s / the per-worker rate (a worker is one process, one core). `--profile` adds cProfile of one pass of
each configuration in this process (no workers): the functions by their own time.

    .venv/bin/python benchmarks/loader_throughput.py [--shards runs/real_shards/annotated] [--rounds 3] [--profile]

Writes benchmarks/results/loader_cpu.md and .json (`--out`).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import statistics
import sys
import time
from functools import partial
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CONFIGS = ("ours-random", "ours-slic", "open_clip")
GPU_RATES = (1510, 3000)        # images/s of one GPU: CLIP's ViT-B/16 step at 512 on the H200, and twice that


def pattern(shards: Path) -> str:
    "The shards' brace pattern ('dir/{00000..00015}.tar')."
    tars = sorted(Path(shards).glob("*.tar"))
    if not tars:
        raise ValueError(f"--shards: no *.tar in {str(shards)!r}: `make real-shards` builds them")
    return str(Path(shards) / f"{{{tars[0].stem}..{tars[-1].stem}}}.tar") if len(tars) > 1 else str(tars[0])


def count_samples(shards: Path) -> int:
    "Samples (by key) in the shards."
    import tarfile
    keys = set()
    for t in sorted(Path(shards).glob("*.tar")):
        with tarfile.open(t) as f:
            keys.update((t.name, m.name.split(".", 1)[0]) for m in f.getmembers() if m.isfile())
    return len(keys)


def ours_loader(shards: Path, workers: int, batch: int, masks: str):
    "The trainer's loader over the shards: PowerCLIP at ViT-B/16 geometry, `masks` random or stored (slic)."
    from powerclip.data import make_loader
    from powerclip.train import load_config, validate
    cfg = load_config("paper", ["data.source=wds", f"data.shards={pattern(shards)}", f"data.workers={workers}",
                                f"data.batch_size={batch}", "global_batch_size=null", "resume=never",
                                "max_steps=100000", f"method_cfg.masks={masks}", "model.pool=tok"], method="powerclip")
    return make_loader(validate(cfg, world_size=1).spec)


def open_clip_loader(shards: Path, workers: int, batch: int, n: int):
    "open_clip_train's webdataset loader with its training preprocessing and tokenizer (one process, one node)."
    import open_clip
    import open_clip_train.data as ocd
    from open_clip_train.data import get_wds_dataset
    from webdataset.tariterators import tar_file_expander
    # open_clip_train 3.3 pins webdataset <= 0.2.86; webdataset 1.x (ours) ends each shard with an EOF record ({}),
    # which its group_by_keys_nothrow reads as a file (KeyError 'fname'): the records of 0.2.x, no EOF record
    ocd.tar_file_expander = partial(tar_file_expander, eof_value=None)
    args = argparse.Namespace(train_data=pattern(shards), val_data=None, train_num_samples=n, dataset_resampled=False,
                              seed=0, batch_size=batch, world_size=1, workers=workers,
                              train_data_upsampling_factors=None)
    pre = open_clip.image_transform(224, is_train=True)
    return get_wds_dataset(args, pre, is_train=True, epoch=0, tokenizer=open_clip.get_tokenizer("ViT-B-16")).dataloader


def make(kind: str, shards: Path, workers: int, batch: int, n: int):
    if kind == "open_clip":
        return open_clip_loader(shards, workers, batch, n)
    return ours_loader(shards, workers, batch, "random" if kind == "ours-random" else "stored")


def images_of(b) -> int:
    return (b["image"] if isinstance(b, dict) else b[0]).shape[0]


def one_pass(kind: str, shards: Path, workers: int, batch: int, n: int) -> dict:
    "One pass: images, the first batch's seconds (the workers' start), images/s after it, per worker."
    t0 = time.perf_counter()
    it, images, first = iter(make(kind, shards, workers, batch, n)), 0, None
    for b in it:
        images += images_of(b)
        if first is None:
            first, t1, n0 = time.perf_counter() - t0, time.perf_counter(), images
    t = time.perf_counter() - t1
    rate = (images - n0) / t if t > 0 else float("nan")
    return dict(config=kind, workers=workers, images=images, first_batch_s=first, seconds=t, images_per_s=rate,
                per_worker=rate / max(1, workers))


def profile(kind: str, shards: Path, batch: int, n: int, top: int = 12) -> dict:
    """cProfile of one pass in this process (no workers), on one thread as a DataLoader worker runs (torch sets 1 in
    each worker; on a busy machine torch's default threads spend ~20 ms in every small tensor op): the functions by
    their own time."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _profile(kind, shards, batch, n, top)
    finally:
        torch.set_num_threads(threads)


def _profile(kind: str, shards: Path, batch: int, n: int, top: int) -> dict:
    make(kind, shards, 0, batch, n)            # imports and the tokenizer's first build, outside the profile
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    images = sum(images_of(b) for b in make(kind, shards, 0, batch, n))
    pr.disable()
    wall = time.perf_counter() - t0
    st = pstats.Stats(pr)
    rows = sorted(((v[2], v[3], k) for k, v in st.stats.items()), reverse=True)[:top]     # (own s, cum s, func)
    out = [dict(function=f"{Path(k[0]).name}:{k[1]}({k[2]})", own_s=own, cum_s=cum, share=own / wall)
           for own, cum, k in rows]
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(25)
    return dict(config=kind, images=images, wall_s=wall, images_per_s=images / wall, top_own=out,
                cumulative=s.getvalue()[-6000:])


def machine() -> dict:
    load = os.getloadavg()
    return dict(host=platform.node(), cpus=os.cpu_count(), python=platform.python_version(),
                load_1_5_15=[round(x, 2) for x in load], date=time.strftime("%Y-%m-%d %H:%M:%S %Z"))


def report(d: dict) -> str:
    runs, m = d["runs"], d["machine"]
    kinds = [k for k in CONFIGS if any(r["config"] == k for r in runs)]
    med = {}
    for kind in kinds:
        for w in d["workers"]:
            xs = [r["per_worker"] for r in runs if r["config"] == kind and r["workers"] == w]
            med[kind, w] = statistics.median(xs) if xs else float("nan")
    lines = ["# The training loader against open_clip's, on real photos (CPU)", "",
             f"`{d['command']}` on {m['host']} ({m['cpus']} cores, Python {m['python']}), {m['date']}. **The machine "
             f"was busy** (other engineers' jobs: load average {m['load_1_5_15'][0]} at the start, "
             f"{d['load_end'][0]} at the end, on {m['cpus']} cores): absolute rates are low and noisy; the "
             "configurations were interleaved round by round, so the ratios within a round are the reading.", "",
             f"The shards: `make real-shards` ({d['samples']} samples: COCO photos at 224 px, one sample per "
             "caption, 16 shards, annotated with spaCy trees and slic regions). One pass per run, batch "
             f"{d['batch']}; images/s after the first batch (the workers' start apart, its seconds in the JSON); "
             "per worker = images/s / workers. ours-random: this repository's training loader with PowerCLIP's fields "
             "(tokens and parse nodes from the stored tree, M = 10 random boxes on the 14 x 14 grid); ours-slic: the "
             "stored slic regions instead; open_clip: `open_clip_train.data.get_wds_dataset` with its training "
             f"transform and tokenizer (image and caption only), reading {d.get('open_clip_shards', d['shards'])}.",
             "",
             "| config | workers | " + " | ".join(f"round {i + 1} per worker" for i in range(d["rounds"]))
             + " | median per worker | / open_clip (median of rounds' ratios) |",
             "|---|---:|" + "---:|" * d["rounds"] + "---:|---:|"]
    for kind in kinds:
        for w in d["workers"]:
            mine = [r for r in runs if r["config"] == kind and r["workers"] == w]
            ref = {r["round"]: r for r in runs if r["config"] == "open_clip" and r["workers"] == w}
            ratios = [r["per_worker"] / ref[r["round"]]["per_worker"] for r in mine if r["round"] in ref]
            lines.append(f"| {kind} | {w} | " + " | ".join(f"{r['per_worker']:.0f}" for r in mine)
                         + f" | {med[kind, w]:.0f} | {statistics.median(ratios) if ratios else float('nan'):.2f} |")
    best = {k: max(med[k, w] for w in d["workers"]) for k in kinds}
    lines += ["", "Loader cores (worker processes) one GPU needs, at the best median per-worker rate above:", "",
              "| config | per worker | " + " | ".join(f"cores at {g:,} images/s" for g in GPU_RATES) + " |",
              "|---|---:|" + "---:|" * len(GPU_RATES)]
    for k in kinds:
        lines.append(f"| {k} | {best[k]:.0f} | " + " | ".join(f"{g / best[k]:.1f}" for g in GPU_RATES) + " |")
    if d.get("profiles"):
        lines += ["", "## Where the time goes (cProfile, one pass in one process, no workers)", ""]
        for p in d["profiles"]:
            lines += [f"**{p['config']}**: {p['images']} images in {p['wall_s']:.1f} s ({p['images_per_s']:.0f} "
                      "images/s under the profiler). The functions by their own time:", "",
                      "| function | own s | share of the pass | cumulative s |", "|---|---:|---:|---:|"]
            lines += [f"| `{r['function']}` | {r['own_s']:.2f} | {r['share']:.0%} | {r['cum_s']:.2f} |"
                      for r in p["top_own"]]
            lines.append("")
    if d.get("notes"):
        lines += ["## Reading", "", *d["notes"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from powerclip.commandline import ArgumentParser, usage_errors
    ap = ArgumentParser(prog="loader_throughput.py", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=Path, default=ROOT / "runs" / "real_shards" / "annotated")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    ap.add_argument("--open-clip-shards", type=Path, default=None, help="the shards open_clip reads (default --shards; "
                                                                       "runs/real_shards/raw: the same photos and "
                                                                       "captions without the annotations)")
    ap.add_argument("--profile", action="store_true", help="cProfile one pass of each configuration (no workers)")
    ap.add_argument("--notes", type=Path, default=None, help="a text file of reading notes to add to the report")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--tag", default="loader_cpu")
    ap.add_argument("--debug", action="store_true")
    with usage_errors():
        a = ap.parse_args(argv)
        pat = pattern(a.shards)
        src = {k: (a.open_clip_shards if k == "open_clip" and a.open_clip_shards else a.shards) for k in CONFIGS}
        pattern(src["open_clip"])
        if min(a.workers) < 1 or a.rounds < 1 or a.batch < 1:
            raise ValueError("--workers, --rounds and --batch: at least 1")
    n = count_samples(a.shards)
    d = dict(command="python benchmarks/loader_throughput.py " + " ".join(sys.argv[1:] if argv is None else argv),
             machine=machine(), shards=pat, open_clip_shards=pattern(src["open_clip"]), samples=n, batch=a.batch,
             workers=a.workers, rounds=a.rounds, runs=[])
    for rnd in range(a.rounds):
        for w in a.workers:
            for kind in a.configs:
                r = dict(one_pass(kind, src[kind], w, a.batch, n), round=rnd)
                d["runs"].append(r)
                print(f"round {rnd + 1} {kind:12s} {w} worker(s): {r['images']} images, {r['images_per_s']:.0f} "
                      f"images/s ({r['per_worker']:.0f} per worker), first batch {r['first_batch_s']:.1f} s",
                      flush=True)
    if a.profile:
        d["profiles"] = [profile(kind, src[kind], a.batch, n) for kind in a.configs]
    d["load_end"] = [round(x, 2) for x in os.getloadavg()]
    d["notes"] = a.notes.read_text().splitlines() if a.notes else []
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"{a.tag}.json").write_text(json.dumps(d, indent=1))
    (a.out / f"{a.tag}.md").write_text(report(d))
    print(report(d))
    return 0


if __name__ == "__main__":
    from powerclip.commandline import run_main
    sys.exit(run_main(main, prog="loader_throughput.py"))
