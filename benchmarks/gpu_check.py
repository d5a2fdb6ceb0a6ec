"""Everything a GPU can show about this repository, in one command (`make gpu-check`, issue 22).

Each part runs in a fresh process under `--part-timeout` (10 minutes) and writes `PART.json` and `PART.md` to
`benchmarks/results/gpu_<device name>/`; a part whose `PART.json` is there is skipped (`--force` redoes it), so a run
that was stopped continues where it stood. At the end one table names the device and every part's result.

  parity       every method's loss terms and their gradients on the GPU, fp32 and bf16 autocast, against the float64
               CPU reference; S-bar (dense, blocked, auto; exact 2^M) for every activation and switch, the same way
  step-B256    benchmarks/train_step_ratio.py at ViT-B/16, 224 px, bf16, gradient checkpointing, local batch 256:
               every method's step time and peak memory against CLIP's (target: PowerCLIP <= 1.10x CLIP)
  step-B512    the same at 512 local, the paper's 4096 on 8 GPUs (target: the whole peak within 80 GB)
  memory       benchmarks/paper_memory.py measured on the GPU, beside the CPU projection (results/paper_memory.json)
  paths-Kcc3m  benchmarks/powerset_scale.py at R = 512, C = 4096: the loss's paths (dense, fast = blocked, auto) and
               CLIP's, against M, with real CC3M node counts per caption
  paths-K16    the same with K = 16 nodes per caption
  compile      torch.compile of the training step (`model.compile=true`) against eager: the first steps' parity, the
               time per step, the compile time (CLIP and PowerCLIP, ViT-B/16 at 256, bf16)
  compare      python -m powerclip.compare --runs all --steps 2000 --device cuda --precision bf16: the world comparison
               at a longer budget (its runs under runs/gpu_<device>/compare; a part that runs out of time is taken up
               again next time from the runs' checkpoints)

    make gpu-check                                    # every part (estimated an hour or two; never run on a GPU yet)
    python benchmarks/gpu_check.py --parts parity step-B256 --force
    python benchmarks/gpu_check.py --dry-run --out /tmp/gpu_dry   # no GPU: every part on the CPU at toy sizes

Without a GPU it stops with one line and exit status 2 (`--device`), unless `--dry-run`: then each part runs on the
CPU at toy sizes (tiny models, small batches; the compile part with the `aot_eager` backend), which checks the code
path and nothing else; its numbers are not measurements. Exit status 0 when every part is done (or kept), 1 when one
failed or ran out of time (its line in the table says which; run again to continue), 2 for a mistake in the arguments.
"""
from __future__ import annotations

import argparse
import copy
import importlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

import _checks
from powerclip.commandline import ArgumentParser, run_main, usage_errors

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
PARTS = ("parity", "step-B256", "step-B512", "memory", "paths-Kcc3m", "paths-K16", "compile", "compare")
TIME_TARGET = 1.10          # PowerCLIP's step / CLIP's at ViT-B/16 bf16 (issue 15)
MEMORY_TARGET_GB = 80       # the whole peak of PowerCLIP's step at 512 local


def slug(name: str) -> str:
    "A device name as a folder name: 'NVIDIA H100 80GB HBM3' -> 'nvidia_h100_80gb_hbm3'."
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or "device"


def device_name(a) -> str:
    return "CPU (dry run)" if a.dry_run else torch.cuda.get_device_name(torch.device(a.device))


def _script(name: str):
    """A benchmark script beside this one, as a module (its `main(argv)`), under its own name: its fresh processes
    import it."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    return importlib.import_module(name)


def _methods(a) -> list[str]:
    "CLIP first (the baseline of the ratios), then every other registered method."
    from powerclip.methods import METHODS, _import_baselines
    _import_baselines()
    names = a.methods or sorted(m for m in METHODS if not m.startswith("_"))
    return ["clip"] + [m for m in names if m != "clip"]


def _rel(a, b) -> float:
    "||a - b|| / ||b|| (0 when both are 0)."
    a, b = a.detach().double().cpu().flatten(), b.detach().double().cpu().flatten()
    d, n = float((a - b).norm()), float(b.norm())
    return d / n if n > 0 else d


# ------------------------------------------------------------------------------------------------ parity
TOL = {"fp32": (1e-4, 1e-3), "bf16": (3e-2, 1e-1)}   # relative error allowed: (values, gradients)


def _grads_of(total, leaves):
    gs = torch.autograd.grad(total, leaves, allow_unused=True)
    return torch.cat([(torch.zeros_like(x) if g is None else g).double().cpu().flatten() for g, x in zip(gs, leaves)])


def _loss_at(method, out, batch, device, dtype, autocast):
    """A method's loss terms and the gradient of their sum w.r.t. the forward outputs, from `out` cast to `dtype` on
    `device`."""
    from powerclip.dist import DistContext
    leaves, x = [], {}
    for k, v in out.items():
        if torch.is_tensor(v) and v.is_floating_point():
            x[k] = v.detach().to(device, dtype).requires_grad_()
            leaves.append(x[k])
        elif isinstance(v, torch.nn.Module):
            x[k] = copy.deepcopy(v).to(device, dtype)   # a method's heads (A-CLIP)
        else:
            x[k] = v.to(device) if torch.is_tensor(v) else v
    b = {k: (v.to(device, dtype) if v.is_floating_point() else v.to(device)) if torch.is_tensor(v) else v
         for k, v in batch.items()}
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=autocast):
        terms = method.loss(x, b, DistContext(device=torch.device(device)))
    total = sum(v for k, v in terms.items() if not k.startswith("_"))
    return {k: v.detach().double().cpu() for k, v in terms.items()}, _grads_of(total, leaves)


def loss_parity(a) -> list[dict]:
    "Every method's loss on the device (fp32, bf16) against float64 on the CPU, from the same forward outputs."
    from powerclip import dist as pdist
    from powerclip.train import build_run, load_config
    rows, B = [], a.parity_batch
    for m in _methods(a):
        try:
            cfg = load_config("smoke", ["resume=never", "precision=fp64", f"data.batch_size={B}",
                                        f"data.world_length={max(64, 2 * B)}"], method=m)
            run = build_run(cfg, pdist.DistContext())
            batch = run.prepare(next(iter(run.loader())))
            run.method.on_step(0, run.total)
            out = run.fwd(batch)                                           # float64 forward outputs on the CPU
            ref_t, ref_g = _loss_at(run.method, out, batch, "cpu", torch.float64, False)
            for prec in ("fp32", "bf16"):
                t, g = _loss_at(run.method, out, batch, a.device, torch.float32, prec == "bf16")
                errs = {k: _rel(t[k], ref_t[k]) for k in ref_t if not k.startswith("_")}
                tv, tg = TOL[prec]
                worst = max(errs.values())
                gerr = _rel(g, ref_g)
                rows.append(dict(kind="loss", what=m, precision=prec, value_err=worst, grad_err=gerr, terms=errs,
                                 ok=worst <= tv and gerr <= tg and all(torch.isfinite(v).all() for v in t.values())))
        except Exception as e:   # a method whose loss cannot be fed this way: say so, go on
            rows.append(dict(kind="loss", what=m, precision="-", ok=False, error=f"{type(e).__name__}: {e}"[:300]))
    return rows


def _sbar_case(Ci, Cj, M, D, Kmax, seed=0):
    "Ragged inputs as 10a_powerset_fast's tests: image 1 without a valid region, text 0 with one node."
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(seed)
    regions = F.normalize(torch.randn(Ci, M, D, generator=g, dtype=torch.float64), dim=-1)
    rv = torch.rand(Ci, M, generator=g) < 0.7
    rv[0] = True
    rv[1] = False
    k = torch.randint(1, Kmax + 1, (Cj,), generator=g)
    k[0] = 1
    node_text = torch.arange(Cj).repeat_interleave(k)
    phrases = torch.randn(int(k.sum()), D, generator=g, dtype=torch.float64)
    return regions, rv, phrases, node_text


def sbar_parity(a) -> list[dict]:
    """S-bar on the device (each path, every activation and switch), fp32 and bf16, against the float64 dense CPU
    reference."""
    from dataclasses import replace
    from powerclip.loss import PowerCLIPLossConfig, PowersetInputs, powerset_similarity
    from powerclip.powerset import NLA_T1_ACTS, NLA_T2_INTEGRALS
    Ci, Cj, M, D, K = (5, 6, 4, 8, 5) if a.dry_run else (24, 32, 10, 64, 12)
    specs = ([dict(t1_act=x) for x in NLA_T1_ACTS] + [dict(t2_act=x) for x in NLA_T2_INTEGRALS]
             + [dict(use_t2r=False), dict(use_r2t=False), dict(debias_t2=True), dict(alpha=0.0), dict(alpha=1.0),
                dict(region_sets=False), dict(tau=0.05), dict()])
    reg, rv, ph, nt = _sbar_case(Ci, Cj, M, D, K)
    W = torch.randn(Ci, Cj, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    rows = []

    def run(cfg, device, dtype, autocast):
        r, p = reg.to(device, dtype).requires_grad_(), ph.to(device, dtype).requires_grad_()
        images = PowersetInputs(r, rv.to(device), p, node_text=nt.to(device))                 # its regions are read
        texts = PowersetInputs(torch.zeros(Cj, M, D, device=device, dtype=dtype),
                               torch.ones(Cj, M, dtype=torch.bool, device=device),
                               p, node_text=nt.to(device))                                     # its phrases are read
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=autocast):
            S = powerset_similarity(images, texts, cfg)                                        # (Ci, Cj)
        gr, gp = torch.autograd.grad((S * W.to(device, S.dtype)).sum(), (r, p))
        return S.detach(), torch.cat([gr.flatten(), gp.flatten()]).detach()

    cases = [(f"{'+'.join(f'{k}={v}' for k, v in s.items()) or 'default'}",
              replace(PowerCLIPLossConfig(tau=0.1), **s)) for s in specs]
    cases.append(("exact 2^M", PowerCLIPLossConfig(tau=0.1, exact=True)))
    for name, cfg in cases:
        ref = run(replace(cfg, impl="dense"), "cpu", torch.float64, False)
        for impl in (("dense",) if cfg.exact else ("dense", "fast", "auto")):
            for prec in ("fp32", "bf16"):
                try:
                    S, g = run(replace(cfg, impl=impl, block_bytes=4096 if impl == "fast" else cfg.block_bytes),
                               a.device, torch.float32, prec == "bf16")
                    e_s, e_g = _rel(S, ref[0]), _rel(g, ref[1])
                    tv, tg = TOL[prec]
                    rows.append(dict(kind="sbar", what=f"{name} [{impl}]", precision=prec, value_err=e_s, grad_err=e_g,
                                     ok=e_s <= tv and e_g <= tg and bool(torch.isfinite(S).all())))
                except Exception as e:
                    rows.append(dict(kind="sbar", what=f"{name} [{impl}]", precision=prec, ok=False,
                                     error=f"{type(e).__name__}: {e}"[:300]))
    return rows


def part_parity(a, raw: Path) -> dict:
    rows = loss_parity(a) + sbar_parity(a)
    bad = [r for r in rows if not r["ok"]]
    worst = lambda kind, prec, key: max((r.get(key, 0) for r in rows if r["kind"] == kind and r["precision"] == prec),
                                        default=float("nan"))
    md = ["Relative error ||device - reference|| / ||reference|| against float64 on the CPU; allowed: fp32 "
          f"{TOL['fp32'][0]:g} (values) / {TOL['fp32'][1]:g} (gradients), bf16 {TOL['bf16'][0]:g} / "
          f"{TOL['bf16'][1]:g}. Loss rows: every method's loss terms (the largest error among them) and the gradient "
          f"of their sum w.r.t. the forward outputs, from the same float64 forward outputs (batch {a.parity_batch}). "
          "S-bar rows: `powerset_similarity` on ragged inputs (an image without a valid region, a text with one node), "
          "every NLA activation and switch, each path.", "",
          "| kind | what | precision | value error | gradient error | ok |", "|---|---|---|---:|---:|---|"]
    for r in rows:
        if "error" in r:
            md.append(f"| {r['kind']} | {r['what']} | {r['precision']} | {r['error']} | | no |")
            continue
        md.append(f"| {r['kind']} | {r['what']} | {r['precision']} | {r['value_err']:.1e} | {r['grad_err']:.1e} | "
                  f"{'yes' if r['ok'] else 'NO'} |")
    head = (f"{len(rows) - len(bad)}/{len(rows)} within tolerance; worst loss error fp32 "
            f"{worst('loss', 'fp32', 'value_err'):.1e} (grad {worst('loss', 'fp32', 'grad_err'):.1e}), bf16 "
            f"{worst('loss', 'bf16', 'value_err'):.1e} (grad {worst('loss', 'bf16', 'grad_err'):.1e})")
    return dict(headline=head, ok=not bad, rows=rows, md=md)


# ------------------------------------------------------------------------------------------------ train step
def part_step(a, raw: Path, batch: int) -> dict:
    methods = _methods(a) + ([] if a.methods else ["powerclip:impl=fast"])
    argv = (["--preset", "smoke", "--batch", "8", "--precision", "bf16", "--steps", "2", "--warmup", "1",
             "--rounds", "1"]
            if a.dry_run
            else ["--preset", "paper", "--batch", str(batch), "--precision", "bf16", "--grad-checkpointing",
                               "--steps", "5", "--warmup", "2", "--rounds", "1"])
    tag = f"B{batch}"
    # every method with CLIP's class-token pooling: A-CLIP pools only so (the paper preset's avg pooling is a mean over
    # the tokens, nothing a step's time or memory would show)
    rc = _script("train_step_ratio").main([*argv, "--device", a.device, "--methods", *methods, "--set",
                                           "model.pool=tok", "--out", str(raw), "--tag", tag])
    if rc:
        raise RuntimeError(f"train_step_ratio.py exited with {rc}")
    d = json.loads((raw / f"train_step_ratio_{tag}.json").read_text())
    s = d["summary"]
    pc = s.get("powerclip", {})
    total_gb = pc.get("peak_total_mib", float("nan")) * 2**20 / 1e9
    ok_time = pc.get("time_ratio", float("inf")) <= TIME_TARGET
    ok_mem = batch < 512 or not (total_gb > MEMORY_TARGET_GB)          # NaN (no GPU) does not fail
    g = d["meta"]["args"]
    md = [f"{d['meta']['model']} ({g['preset']} preset), {d['meta']['gpu'] or a.device}, local batch {g['batch']}, "
          f"{g['precision']}, gradient checkpointing {'on' if g['grad_checkpointing'] else 'off'}; {g['rounds']} "
          f"round(s) of {g['steps']} timed steps after {g['warmup']} warm-up steps, each method in a fresh process, on "
          "the built-in world's images, class-token pooling for all (A-CLIP pools only so). 'peak' is "
          "the memory the timed steps added to what was allocated before them; 'whole peak' includes the weights, "
          "gradients, AdamW's moments and the prepared batches.", "",
          "| method | ms/step | images/s | peak GiB | whole peak GiB | time / CLIP | memory / CLIP |",
          "|---|---:|---:|---:|---:|---:|---:|"]
    md += [f"| {m} | {r['ms_per_step']:.1f} | {r['images_per_s']:.0f} | {r['peak_mib'] / 1024:.2f} | "
           f"{r.get('peak_total_mib', float('nan')) / 1024:.2f} | {r['time_ratio']:.2f}x "
           f"| {r['mem_ratio']:.2f}x |" for m, r in s.items()]
    head = (f"PowerCLIP {pc.get('time_ratio', float('nan')):.2f}x CLIP's step time "
            f"({'met' if ok_time else 'NOT met'}: <= {TIME_TARGET:.2f}x), memory "
            f"{pc.get('mem_ratio', float('nan')):.2f}x"
            + (f", whole peak {total_gb:.1f} GB ({'met' if ok_mem else 'NOT met'}: <= {MEMORY_TARGET_GB} GB)"
               if batch >= 512 else ""))
    return dict(headline=head, ok=ok_time and ok_mem, rows=[dict(method=m, **r) for m, r in s.items()], md=md)


# ------------------------------------------------------------------------------------------------ memory
def part_memory(a, raw: Path) -> dict:
    argv = ["--arch", "powerclip-micro", "--R", "8", "--M", "4"] if a.dry_run else []
    _script("paper_memory").main([*argv, "--device", a.device, "--out", str(raw)])
    dev = json.loads((raw / "paper_memory.json").read_text())
    cpu_f = RESULTS / "paper_memory.json"
    cpu = json.loads(cpu_f.read_text()) if cpu_f.is_file() else {"rows": []}
    key = lambda r: (r["precision"], r["checkpointing"], r["M"])
    cpu_rows = {key(r): r for r in cpu["rows"] if cpu.get("meta", {}).get("arch", "ViT-B-16") == dev["meta"]["arch"]}
    f = lambda r, k, fmt: "-" if r is None else format(r[k], fmt)
    md = [f"{dev['meta']['arch']}, loss at R = {dev['rows'][0]['R_measured']}, C = 8 R: saved-for-backward bytes "
          f"measured on {dev['meta']['measured_on']} (GPU) beside the projection from the bytes measured on the CPU "
          f"(results/paper_memory.json); budget {dev['meta']['gpu_gib']:.0f} GB less {dev['meta']['reserve']:.0%}. The "
          "GPU columns 'peak' are what CUDA's allocator reached while measuring (towers: "
          "for the measured samples).", "",
          "| precision | grad ckpt | M | towers MiB/sample CPU | GPU | loss GiB at R CPU | GPU | GPU loss peak GiB | "
          "total GiB at R CPU | GPU | largest local batch CPU | GPU |",
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in dev["rows"]:
        c = cpu_rows.get(key(r))
        md.append(f"| {r['precision']} | {'yes' if r['checkpointing'] else 'no'} | {r['M']} | "
                  f"{f(c, 'towers_mib_per_sample', '.1f')} | {r['towers_mib_per_sample']:.1f} | "
                  f"{f(c, 'loss_gib_at_R', '.2f')} | {r['loss_gib_at_R']:.2f} | "
                  f"{r.get('loss_peak_gib', float('nan')):.2f} | {f(c, 'total_gib_at_R', '.1f')} | "
                  f"{r['total_gib_at_R']:.1f} | {f(c, 'max_local_batch', 'd')} | {r['max_local_batch']} |")
    best = [r for r in dev["rows"] if r["precision"] == "bf16" and r["checkpointing"]]
    head = ("bf16 + checkpointing: " + ", ".join(f"M={r['M']} {r['total_gib_at_R']:.1f} GiB at R={r['R_measured']} "
                                                   f"(largest {r['max_local_batch']})" for r in best))
    return dict(headline=head, ok=all(r["fits_at_R"] for r in best), rows=dev["rows"], md=md)


# ------------------------------------------------------------------------------------------------ the loss's paths
def part_paths(a, raw: Path, K: int | None) -> dict:
    tag = f"K{K or 'cc3m'}"
    if a.dry_run:
        argv = ["--R", "8", "--C", "16", "--M", "3", "5", "--dim", "16", "--reps", "1"]
    else:
        free = torch.cuda.get_device_properties(torch.device(a.device)).total_memory / 2**30
        argv = ["--R", "512", "--C", "4096", "--M", "5", "10", "32", "--dim", "512", "--reps", "3", "--budget-gib",
                f"{0.6 * free:.0f}"]
    argv += ["--impl", "fast", "dense", "auto", "clip", "--precision", "bf16", "--device", a.device, "--tag", tag,
             "--out", str(raw)]
    _script("powerset_scale").main(argv + (["--K", str(K)] if K else []))
    d = json.loads((raw / f"powerset_scale_{tag}.json").read_text())
    rows = d["rows"]
    get = lambda impl, M: next((r for r in rows if r["impl"] == impl and r["M"] == M), None)
    ms = lambda r: "-" if r is None else (f"{r['time_s'] * 1e3:.1f}" if r.get("ok") else r.get("why", "failed"))
    mib = lambda r: "-" if r is None or not r.get("ok") else f"{r['peak_mib']:.0f}"
    Ms = sorted({r["M"] for r in rows})
    R, C = rows[0]["R"], rows[0]["C"]
    md = [f"Forward + backward of `powerclip_loss` (both directions, CLIP loss included) at R = {R} local rows against "
          f"C = {C} gathered columns, bf16 autocast, D = {d['meta']['args']['dim']}; node counts: "
          f"{d['meta']['node_counts']['source']}. fast = blocked S-bar (`10a_powerset_fast`), dense = the (R, C, M, K) "
          "reference, auto = the loss's default (dense when its scores fit one block of 16 MiB, else fast). Median of "
          "the timed steps; peak = memory the step adds.",
          "", "| M | K_max | fast ms | dense ms | auto ms | CLIP ms | fast peak MiB | dense peak MiB | auto peak MiB |",
          "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for M in Ms:
        f, de, au, cl = (get(i, M) for i in ("fast", "dense", "auto", "clip"))
        md.append(f"| {M} | {rows[0]['K_max'] if f is None else f['K_max']} | {ms(f)} | {ms(de)} | {ms(au)} | {ms(cl)} "
                  f"| {mib(f)} | {mib(de)} | {mib(au)} |")
    M10 = 10 if 10 in Ms else Ms[0]
    f, au, cl = get("fast", M10), get("auto", M10), get("clip", M10)
    head = (f"M={M10}: fast {ms(f)} ms, auto {ms(au)} ms, CLIP loss {ms(cl)} ms" if f and f.get("ok")
            else "see the table")
    return dict(headline=head, ok=None, rows=rows, md=md)


# ------------------------------------------------------------------------------------------------ torch.compile
def _compile_measure(a, method: str, compiled: bool) -> dict:
    from unittest import mock
    from powerclip import dist as pdist
    from powerclip.measure import sync
    from powerclip.train import TrainState, build_run, load_config
    over = (["data.batch_size=8", "precision=fp32"] if a.dry_run else
            ["data.batch_size=256", "precision=bf16", "model.grad_checkpointing=true", "data.world_length=2048"])
    over += ["data.source=world", "data.workers=0", "global_batch_size=null", "max_steps=100", "resume=never",
             f"model.compile={str(compiled).lower()}"]
    cfg = load_config("smoke" if a.dry_run else "paper", over, method=method)
    backend = {} if a.compile_backend == "inductor" else {"backend": a.compile_backend}
    real_compile = torch.compile
    with mock.patch.object(torch, "compile", lambda f, **k: real_compile(f, **{**k, **backend})):
        run = build_run(cfg, pdist.DistContext(device=torch.device(a.device)))
        it, state, times, outs = iter(run.loader()), TrainState(), [], []
        batches = [run.prepare(next(it)) for _ in range(2 + a.compile_steps)]
        for i, b in enumerate(batches):
            run.method.on_step(i, run.total)
            sync(a.device)
            t0 = time.perf_counter()
            out = run.step(b, state)
            sync(a.device)
            times.append(time.perf_counter() - t0)
            outs.append({k: float(v) for k, v in out.items() if k in ("loss", "grad_norm")})
    return dict(first_s=times[0], ms_per_step=1e3 * sorted(times[2:])[len(times[2:]) // 2], steps=outs)


def part_compile(a, raw: Path) -> dict:
    rows, ok = [], True
    for m in ("clip", "powerclip"):
        e, c = _compile_measure(a, m, False), _compile_measure(a, m, True)
        loss_err = max(abs(x["loss"] - y["loss"]) / abs(y["loss"]) for x, y in zip(c["steps"][:2], e["steps"][:2]))
        gn_err = abs(c["steps"][0]["grad_norm"] - e["steps"][0]["grad_norm"]) / abs(e["steps"][0]["grad_norm"])
        tol = 1e-4 if a.dry_run else 2e-2
        rows.append(dict(method=m, eager_ms=e["ms_per_step"], compiled_ms=c["ms_per_step"],
                         speedup=e["ms_per_step"] / c["ms_per_step"],
                         compile_s=c["first_s"] - e["first_s"], loss_rel_err=loss_err, grad_norm_rel_err=gn_err,
                         ok=loss_err <= tol and gn_err <= 10 * tol))
        ok = ok and rows[-1]["ok"]
    md = ["The training step with `model.compile=true` (torch.compile of the model's forward as the method defines "
          f"it, backend {a.compile_backend}) against eager, same seed and batches: "
          + ("smoke preset on the CPU (dry run)" if a.dry_run else "ViT-B/16, 224 px, local batch 256, "
                                                                   "bf16, gradient checkpointing")
          + f"; median of {a.compile_steps} steps after 2; 'compile s' = the first step's extra time. Parity: the loss "
          "of the first two steps and the first gradient norm, relative.", "",
          "| method | eager ms/step | compiled ms/step | speed-up | compile s | loss rel. diff | "
          "grad norm rel. diff | ok |",
          "|---|---:|---:|---:|---:|---:|---:|---|"]
    md += [f"| {r['method']} | {r['eager_ms']:.1f} | {r['compiled_ms']:.1f} | {r['speedup']:.2f}x | "
           f"{r['compile_s']:.0f} | {r['loss_rel_err']:.1e} | {r['grad_norm_rel_err']:.1e} | "
           f"{'yes' if r['ok'] else 'NO'} |" for r in rows]
    head = "; ".join(f"{r['method']} {r['speedup']:.2f}x faster compiled (compile {r['compile_s']:.0f} s)"
                     for r in rows)
    return dict(headline=head, ok=ok, rows=rows, md=md)


# ------------------------------------------------------------------------------------------------ the comparison
def part_compare(a, raw: Path) -> dict:
    runs = ROOT / "runs" / a.out.name / "compare" if a.runs_dir is None else Path(a.runs_dir)
    argv = (["--runs", "CLIP", "PowerCLIP-R", "--steps", "3", "--seeds", "0", "--eval-images", "16", "--grounding", "0",
             "--device", "cpu", "--precision", "fp32"] if a.dry_run else
            ["--runs", "all", "--steps", str(a.compare_steps), "--seeds", *map(str, a.compare_seeds), "--device",
             a.device, "--precision", "bf16"])
    cmd = [sys.executable, "-m", "powerclip.compare", *argv, "--out", str(runs)]
    print("$", " ".join(cmd), flush=True)
    r = subprocess.run(cmd, cwd=ROOT)
    if r.returncode:
        raise RuntimeError(f"powerclip.compare exited with {r.returncode}")
    for name in ("summary.md", "summary.csv"):
        if (runs / name).is_file():
            shutil.copy(runs / name, raw / name)
    text = (runs / "summary.md").read_text() if (runs / "summary.md").is_file() else "(no summary.md)"
    return dict(headline=f"{' '.join(argv[:argv.index('--device')])}: runs in {runs}, summary in compare.md", ok=None,
                rows=[], md=["`" + " ".join(["python -m powerclip.compare", *argv]) + "`", "", text])


RUNNERS = {"parity": part_parity, "step-B256": lambda a, raw: part_step(a, raw, 256),
           "step-B512": lambda a, raw: part_step(a, raw, 512),
           "memory": part_memory, "paths-Kcc3m": lambda a, raw: part_paths(a, raw, None),
           "paths-K16": lambda a, raw: part_paths(a, raw, 16), "compile": part_compile, "compare": part_compare}


# ------------------------------------------------------------------------------------------------ one part, the driver
def run_part(a, part: str) -> int:
    "In the part's own process: run it, write PART.json and PART.md."
    raw = a.out / "raw" / part
    raw.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    res = RUNNERS[part](a, raw)
    meta = dict(part=part, device=device_name(a), torch=torch.__version__, cuda=torch.version.cuda, dry_run=a.dry_run,
                seconds=time.time() - t0, host=platform.node(), argv=sys.argv[1:])
    md = res.pop("md")
    (a.out / f"{part}.md").write_text("\n".join([f"# gpu-check {part}: {meta['device']}", "",
                                                 f"**{res['headline']}**", "", *md,
                                                 "",
                                                 f"torch {meta['torch']}, CUDA "
                                                 f"{meta['cuda']}, {meta['seconds']:.0f} s"]) + "\n")
    (a.out / f"{part}.json").write_text(json.dumps(dict(meta=meta, **res), indent=1, default=str))
    return 0


def _child(a, part: str) -> tuple[str, float]:
    "Run one part in a fresh process group, at most `--part-timeout` seconds; (status, seconds)."
    argv = [sys.executable, str(Path(__file__).resolve()), "--part", part, "--out", str(a.out), "--device", a.device,
            "--parity-batch", str(a.parity_batch), "--compile-backend", a.compile_backend, "--compile-steps",
            str(a.compile_steps),
            "--compare-steps", str(a.compare_steps), "--compare-seeds", *map(str, a.compare_seeds)]
    if a.dry_run:
        argv.append("--dry-run")
    if a.methods:
        argv += ["--methods", *a.methods]
    if a.runs_dir:
        argv += ["--runs-dir", str(a.runs_dir)]
    t0 = time.time()
    p = subprocess.Popen(argv, cwd=ROOT, start_new_session=True)
    try:
        rc = p.wait(timeout=a.part_timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        return f"timed out after {a.part_timeout:.0f} s (run again to continue)", time.time() - t0
    return (("done" if rc == 0 and (a.out / f"{part}.json").is_file() else f"failed (exit status {rc})"),
            time.time() - t0)


def summary(a, status: dict) -> str:
    lines = [f"# gpu-check: {device_name(a)}", "",
             f"torch {torch.__version__}, CUDA {torch.version.cuda}; results in {a.out}"
             + (" (DRY RUN on the CPU: not measurements)" if a.dry_run else ""), "",
             "| part | status | result | target |", "|---|---|---|---|"]
    for part in a.parts:
        f = a.out / f"{part}.json"
        d = json.loads(f.read_text()) if f.is_file() else {}
        ok = d.get("ok")
        lines.append(f"| {part} | {status.get(part, 'not run')} | {d.get('headline', '-')} | "
                     f"{'-' if ok is None else 'met' if ok else 'NOT met'} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = ArgumentParser(prog="gpu_check.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", default=list(PARTS), help="parts to run, in order "
                                                                    f"(default all: {' '.join(PARTS)})")
    ap.add_argument("--force", action="store_true", help="redo parts whose results are there")
    ap.add_argument("--dry-run", action="store_true", help="no GPU needed: every part on the CPU at toy sizes (checks "
                                                           "the code, measures nothing)")
    ap.add_argument("--device", default="cuda", help="the GPU: cuda | cuda:N")
    ap.add_argument("--out", type=Path, default=None, help="results folder (default "
                                                           "benchmarks/results/gpu_<device name>)")
    ap.add_argument("--part-timeout", type=float, default=600, help="seconds a part may take")
    ap.add_argument("--methods", nargs="+", default=None, help="methods of the parity and step parts "
                                                               "(default: all registered)")
    ap.add_argument("--parity-batch", type=int, default=128, help="batch of the loss parity")
    ap.add_argument("--compile-backend", default="inductor", help="torch.compile backend of the compile part")
    ap.add_argument("--compile-steps", type=int, default=5, help="timed steps of the compile part")
    ap.add_argument("--compare-steps", type=int, default=2000, help="T of the comparison")
    ap.add_argument("--compare-seeds", type=int, nargs="+", default=[0], help="seeds of the comparison")
    ap.add_argument("--runs-dir", type=Path, default=None, help="folder of the comparison's runs (default "
                                                                "runs/gpu_<device>/compare)")
    ap.add_argument("--part", choices=PARTS, default=None, help=argparse.SUPPRESS)      # the child process of one part
    ap.add_argument("--debug", action="store_true", help="show the traceback of a usage error")
    with usage_errors():
        a = ap.parse_args(argv)
        unknown = [p for p in a.parts if p not in PARTS]
        if unknown:
            raise ValueError(f"--parts: unknown part {unknown[0]!r} (known: {', '.join(PARTS)})")
        _checks.at_least(a, 1, "parity-batch", "compile-steps", "compare-steps")
        if a.part_timeout <= 0:
            raise ValueError(f"--part-timeout: must be above 0 seconds, got {a.part_timeout:g}")
        if a.dry_run:
            if a.parity_batch == 128:
                a.parity_batch = 16
            if a.compile_backend == "inductor":
                a.compile_backend = "aot_eager"
            a.device = "cpu"
        else:
            try:
                d = torch.device(a.device)
            except RuntimeError:
                raise ValueError(f"--device: {a.device!r} is not a device (cuda, cuda:N)") from None
            if d.type != "cuda":
                raise ValueError(f"--device: {a.device!r} is not a GPU (cuda, cuda:N; --dry-run for the CPU)")
            if not torch.cuda.is_available():
                raise ValueError("--device: no CUDA GPU here (torch.cuda.is_available() is False): run it on a machine "
                                 "with one, or with --dry-run to check every part's code on the CPU")
            _checks.device(a.device)
        if a.methods:
            from powerclip.methods import get_method
            for m in a.methods:
                try:
                    get_method(m)
                except KeyError as e:
                    raise ValueError(f"--methods: {e.args[0]}") from None
        if a.out is None:
            a.out = RESULTS / ("gpu_dry_run" if a.dry_run else f"gpu_{slug(device_name(a))}")
        _checks.out_dir("--out", a.out)
        if a.runs_dir is not None:
            _checks.out_dir("--runs-dir", a.runs_dir)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.part:
        return run_part(a, a.part)
    status = {}
    for part in a.parts:
        if (a.out / f"{part}.json").is_file() and not a.force:
            status[part] = "kept (--force redoes it)"
            print(f"== {part}: results there, kept", flush=True)
            continue
        print(f"== {part} (at most {a.part_timeout:.0f} s)", flush=True)
        if a.force:
            (a.out / f"{part}.json").unlink(missing_ok=True)
        status[part], sec = _child(a, part)
        status[part] += f", {sec:.0f} s"
    text = summary(a, status)
    (a.out / "summary.md").write_text(text)
    print(text)
    return 0 if all(s.startswith(("done", "kept")) for s in status.values()) else 1


if __name__ == "__main__":
    sys.exit(run_main(main, prog="gpu_check.py"))
