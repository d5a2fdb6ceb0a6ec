"""The parts of `benchmarks/gpu_check.py`: what each measures, in units that are recorded the moment they finish.

Each part is `units(a)`, a list of `(key, thunk)` run in order (a unit whose key is recorded is not run again), and
`report(a, values)`, which turns the recorded values (all of them, or the first few of a part that was cut) into a
headline, a verdict (`ok`: True, False, or None where there is no target) and a Markdown table. The driver runs a
part's units in the part's own process and calls `report` whenever it publishes.
"""
from __future__ import annotations

import argparse
import copy
import importlib
import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
TIME_TARGET = 1.10          # PowerCLIP's step / CLIP's at ViT-B/16 bf16 (issue 15)
MEMORY_TARGET_GB = 80       # the whole peak of PowerCLIP's step at 512 local
TOL = {"fp32": (1e-4, 1e-3), "bf16": (3e-2, 1e-1)}   # relative error allowed: (values, gradients)
HEAD = ("clip", "powerclip")                         # the headline's methods: every part does these first
NAN = float("nan")


def script(name: str):
    "A benchmark script beside this one, as a module (its `main(argv)`): spawned processes import it by that name."
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    return importlib.import_module(name)


def methods(a) -> list[str]:
    "CLIP and PowerCLIP first (the headline), then every other registered method (or `--methods`)."
    from powerclip.methods import METHODS, _import_baselines
    _import_baselines()
    names = a.methods or sorted(m for m in METHODS if not m.startswith("_"))
    return [m for m in HEAD if m in names or not a.methods] + [m for m in names if m not in HEAD]


def rel(x, y) -> float:
    "||x - y|| / ||y|| (the difference itself when y is 0)."
    x, y = x.detach().double().cpu().flatten(), y.detach().double().cpu().flatten()
    d, n = float((x - y).norm()), float(y.norm())
    return d / n if n > 0 else d


def fmt(x, spec=".1e") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


# ------------------------------------------------------------------------------------------------ parity
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


def loss_parity(a, spec: str) -> list[dict]:
    "One method's loss (with ':options') on the device (fp32, bf16) against float64 on the CPU, same forward outputs."
    from powerclip import dist as pdist
    from powerclip.train import build_run, load_config
    name, _, opts = spec.partition(":")
    B = a.parity_batch
    cfg = load_config("smoke", ["resume=never", "precision=fp64", f"data.batch_size={B}",
                                f"data.world_length={max(64, 2 * B)}", *[f"method_cfg.{kv}" for kv in opts.split(",")
                                                                         if kv]], method=name)
    run = build_run(cfg, pdist.DistContext())
    batch = run.prepare(next(iter(run.loader())))
    run.method.on_step(0, run.total)
    out = run.fwd(batch)                                           # float64 forward outputs on the CPU
    ref_t, ref_g = _loss_at(run.method, out, batch, "cpu", torch.float64, False)
    rows = []
    for prec in ("fp32", "bf16"):
        t, g = _loss_at(run.method, out, batch, a.device, torch.float32, prec == "bf16")
        errs = {k: rel(t[k], ref_t[k]) for k in ref_t if not k.startswith("_")}
        tv, tg = TOL[prec]
        worst, gerr = max(errs.values()), rel(g, ref_g)
        rows.append(dict(kind="loss", what=spec, precision=prec, value_err=worst, grad_err=gerr, terms=errs,
                         ok=bool(worst <= tv and gerr <= tg and all(torch.isfinite(v).all() for v in t.values()))))
    return rows


def sbar_cases():
    "(name, PowerCLIPLossConfig) for every NLA activation and switch, then the exact 2^M enumeration."
    from dataclasses import replace
    from powerclip.loss import PowerCLIPLossConfig
    from powerclip.powerset import NLA_T1_ACTS, NLA_T2_INTEGRALS
    specs = ([dict()] + [dict(t1_act=x) for x in NLA_T1_ACTS] + [dict(t2_act=x) for x in NLA_T2_INTEGRALS]
             + [dict(use_t2r=False), dict(use_r2t=False), dict(debias_t2=True), dict(alpha=0.0), dict(alpha=1.0),
                dict(region_sets=False), dict(tau=0.05)])
    cases = [("+".join(f"{k}={v}" for k, v in s.items()) or "default", replace(PowerCLIPLossConfig(tau=0.1), **s))
             for s in specs]
    return cases + [("exact 2^M", PowerCLIPLossConfig(tau=0.1, exact=True))]


def sbar_parity(a, name: str, cfg) -> list[dict]:
    "S-bar of one case on the device (each path), fp32 and bf16, against the float64 dense CPU reference."
    from dataclasses import replace
    from powerclip.loss import PowersetInputs, powerset_similarity
    from powerclip.powerset_fast import ragged_case
    Ci, Cj, M, D, K = (5, 6, 4, 8, 5) if a.dry_run else (24, 32, 10, 64, 12)
    reg, rv, ph, nt = ragged_case(Ci, Cj, M, D, K)
    W = torch.randn(Ci, Cj, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def run(c, device, dtype, autocast):
        r, p = reg.to(device, dtype).requires_grad_(), ph.to(device, dtype).requires_grad_()
        images = PowersetInputs(r, rv.to(device), p, node_text=nt.to(device))                 # its regions are read
        texts = PowersetInputs(torch.zeros(Cj, M, D, device=device, dtype=dtype),
                               torch.ones(Cj, M, dtype=torch.bool, device=device),
                               p, node_text=nt.to(device))                                     # its phrases are read
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=autocast):
            S = powerset_similarity(images, texts, c)                                          # (Ci, Cj)
        gr, gp = torch.autograd.grad((S * W.to(device, S.dtype)).sum(), (r, p))
        return S.detach(), torch.cat([gr.flatten(), gp.flatten()]).detach()

    ref = run(replace(cfg, impl="dense"), "cpu", torch.float64, False)
    rows = []
    for impl in (("dense",) if cfg.exact else ("dense", "fast", "auto")):
        for prec in ("fp32", "bf16"):
            try:
                S, g = run(replace(cfg, impl=impl, block_bytes=4096 if impl == "fast" else cfg.block_bytes),
                           a.device, torch.float32, prec == "bf16")
                e_s, e_g = rel(S, ref[0]), rel(g, ref[1])
                tv, tg = TOL[prec]
                rows.append(dict(kind="sbar", what=f"{name} [{impl}]", precision=prec, value_err=e_s, grad_err=e_g,
                                 ok=bool(e_s <= tv and e_g <= tg and torch.isfinite(S).all())))
            except Exception as e:      # one path failing is a row of the table, not the end of the part
                rows.append(dict(kind="sbar", what=f"{name} [{impl}]", precision=prec, ok=False,
                                 error=f"{type(e).__name__}: {e}"[:300]))
    return rows


def _guard(kind, what, fn):
    "A unit whose failure is a row (a method whose loss cannot be fed this way: say so, go on)."
    try:
        return fn()
    except Exception as e:
        return [dict(kind=kind, what=what, precision="-", ok=False, error=f"{type(e).__name__}: {e}"[:300])]


def units_parity(a):
    ms = methods(a)
    head = [m for m in ms if m in HEAD]
    pc = [f"powerclip:impl={i}" for i in ("dense", "fast") if "powerclip" in ms]    # plain powerclip: impl=auto
    out = [(f"loss {m}", lambda m=m: _guard("loss", m, lambda: loss_parity(a, m))) for m in head + pc]
    out += [(f"sbar {n}", lambda n=n, c=c: sbar_parity(a, n, c)) for n, c in sbar_cases()]
    return out + [(f"loss {m}", lambda m=m: _guard("loss", m, lambda: loss_parity(a, m))) for m in ms if m not in HEAD]


def report_parity(a, values: dict) -> dict:
    rows = [r for v in values.values() for r in v]
    bad = [r for r in rows if not r["ok"]]

    def worst(kind, prec, key):
        return max((r.get(key, 0) for r in rows if r["kind"] == kind and r["precision"] == prec), default=NAN)
    md = ["Relative error ||device - reference|| / ||reference|| against float64 on the CPU; allowed: fp32 "
          f"{TOL['fp32'][0]:g} (values) / {TOL['fp32'][1]:g} (gradients), bf16 {TOL['bf16'][0]:g} / "
          f"{TOL['bf16'][1]:g}. Loss rows: a method's loss terms (the largest error among them) and the gradient "
          f"of their sum w.r.t. the forward outputs, from the same float64 forward outputs (batch {a.parity_batch}). "
          "S-bar rows: `powerset_similarity` on ragged inputs, every NLA activation and switch, each path.", "",
          "| kind | what | precision | value error | gradient error | ok |", "|---|---|---|---:|---:|---|"]
    md += [f"| {r['kind']} | {r['what']} | {r['precision']} | {r['error']} | | no |" if "error" in r else
           f"| {r['kind']} | {r['what']} | {r['precision']} | {r['value_err']:.1e} | {r['grad_err']:.1e} | "
           f"{'yes' if r['ok'] else 'NO'} |" for r in rows]
    head = (f"{len(rows) - len(bad)}/{len(rows)} within tolerance; worst loss error fp32 "
            f"{fmt(worst('loss', 'fp32', 'value_err'))} (grad {fmt(worst('loss', 'fp32', 'grad_err'))}), bf16 "
            f"{fmt(worst('loss', 'bf16', 'value_err'))} (grad {fmt(worst('loss', 'bf16', 'grad_err'))})")
    by = {}
    for r in rows:
        if r["kind"] == "loss":
            by.setdefault(r["what"], {})[r["precision"]] = {k: v for k, v in r.items() if k not in ("kind", "what")}
    return dict(headline=head, ok=not bad, md=md, results=dict(loss=by, rows=rows))


# ------------------------------------------------------------------------------------------------ train steps
def step_args(a, batch: int) -> argparse.Namespace:
    "train_step_ratio.py's settings: the paper preset, bf16, checkpointing (a toy model on the CPU in a dry run)."
    if a.dry_run:
        return argparse.Namespace(preset="smoke", batch=8, precision="bf16", steps=2, warmup=1,
                                  grad_checkpointing=False, set=["model.pool=tok"], device=a.device)
    # every method with CLIP's class-token pooling: A-CLIP pools only so
    return argparse.Namespace(preset="paper", batch=batch, precision="bf16", steps=5, warmup=2, grad_checkpointing=True,
                              set=["model.pool=tok"], device=a.device)


def fresh(a, fn, *args) -> dict:
    """`fn(*args)`'s dict in a fresh process on a GPU (its peak memory is its own), in this process in a dry run (a
    CPU's peak RSS measures nothing here anyway); {'error': ...} when it raised."""
    from powerclip.measure import run_isolated
    out = run_isolated(fn, *args, threads=os.cpu_count() or 1) if not a.dry_run else dict(ok=True, **fn(*args))
    return out if out.pop("ok") else dict(error=out["error"][:400])


def measure_step(a, method: str, batch: int) -> dict:
    "One method's step time and peak memory through train_step_ratio's `measure` (`fresh`)."
    ns = step_args(a, batch)
    out = fresh(a, script("train_step_ratio").measure, method, ns)
    if "error" in out:
        return out
    t = sorted(out["times"])
    return dict(ms_per_step=1e3 * t[len(t) // 2], images_per_s=ns.batch / t[len(t) // 2], times=out["times"],
                peak_mib=out["peak_mib"], peak_total_mib=out["peak_total_mib"],
                peak_reserved_mib=out.get("peak_reserved_mib", NAN), model=out["model"], params=out["params"])


def units_step(a, batch: int, which: str):
    ms = methods(a)
    if which == "head":
        chosen = [m for m in ms if m in HEAD]
    else:
        chosen = [m for m in ms if m not in HEAD] + (["powerclip:impl=fast"] if "powerclip" in ms else [])
    return [(m, lambda m=m: measure_step(a, m, batch)) for m in chosen]


def report_step(a, values: dict, batch: int, clip: dict | None = None) -> dict:
    "The step table; `clip`: CLIP's result when it is another part's (the other methods' part takes B256's)."
    ns = step_args(a, batch)
    base = values.get("clip") or clip or {}
    res = {}
    for m, r in values.items():
        r = dict(r)
        if "error" not in r and "ms_per_step" in base:
            r["time_ratio"] = r["ms_per_step"] / base["ms_per_step"]
            r["mem_ratio"] = r["peak_mib"] / base["peak_mib"] if base["peak_mib"] > 0 else NAN   # a CPU's RSS: 0
        res[m] = r
    md = [f"{ns.preset} preset ({next((r['model'] for r in res.values() if 'model' in r), '?')}), {a.device}, local "
          f"batch {ns.batch}, {ns.precision}, gradient checkpointing {'on' if ns.grad_checkpointing else 'off'}; "
          f"median of {ns.steps} timed steps after {ns.warmup} warm-up, "
          + ("each method in a fresh process" if not a.dry_run else "in one process (dry run)")
          + ", the built-in world's images, class-token pooling for all (A-CLIP pools only so). 'peak' = what the "
          "timed steps allocated above what was there before them; 'whole' = the whole allocated peak (weights, "
          "gradients, AdamW's moments, the batches); 'reserved' = the caching allocator's peak.", "",
          "| method | ms/step | images/s | peak GiB | whole GiB | reserved GiB | time / CLIP | memory / CLIP |",
          "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for m, r in res.items():
        if "error" in r:
            md.append(f"| {m} | {r['error']} | | | | | | |")
            continue
        md.append(f"| {m} | {r['ms_per_step']:.1f} | {r['images_per_s']:.0f} | {fmt(r['peak_mib'] / 1024, '.2f')} | "
                  f"{fmt(r['peak_total_mib'] / 1024, '.2f')} | {fmt(r['peak_reserved_mib'] / 1024, '.2f')} | "
                  f"{fmt(r.get('time_ratio'), '.2f')}x | {fmt(r.get('mem_ratio'), '.2f')}x |")
    pc = res.get("powerclip", {})
    if "time_ratio" not in pc:
        return dict(headline=f"{len(res)} method(s) measured" + ("; PowerCLIP or CLIP missing" if clip is None else ""),
                    ok=None if not any("error" in r for r in res.values()) else False, md=md, results=res)
    gb = pc["peak_total_mib"] * 2**20 / 1e9
    measured = not math.isnan(gb)           # NaN: no GPU, no allocator to ask, so the target is neither met nor missed
    ok_time, ok_mem = pc["time_ratio"] <= TIME_TARGET, batch < 512 or not measured or gb <= MEMORY_TARGET_GB
    peak = (f", whole peak {gb:.1f} GB ({'met' if ok_mem else 'NOT met'}: <= {MEMORY_TARGET_GB} GB)" if measured
            else f", whole peak not measured (no GPU; target <= {MEMORY_TARGET_GB} GB)")
    head = (f"PowerCLIP {pc['time_ratio']:.2f}x CLIP's step time ({'met' if ok_time else 'NOT met'}: <= "
            f"{TIME_TARGET:.2f}x), memory {pc['mem_ratio']:.2f}x" + (peak if batch >= 512 else ""))
    return dict(headline=head, ok=ok_time and ok_mem and not any("error" in r for r in res.values()), md=md,
                results=res)


# ------------------------------------------------------------------------------------------------ DDP and the trainer
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ddp_one_process(a) -> dict:
    """DistributedDataParallel in a one-process NCCL group (gloo in a dry run) against the plain module: three
    training steps of PowerCLIP from the same weights and batches; the largest relative difference of the losses."""
    import torch.distributed as td
    from torch.nn.parallel import DistributedDataParallel
    from powerclip import dist as pdist
    from powerclip.train import TrainState, build_run, load_config
    backend = "gloo" if a.dry_run else "nccl"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    td.init_process_group(backend, rank=0, world_size=1)
    try:
        x = torch.ones(4, device=a.device)
        td.all_reduce(x)
        losses = []
        for wrap in (False, True):
            cfg = load_config("smoke", ["resume=never", "precision=fp32", "data.workers=0"], method="powerclip")
            run = build_run(cfg, pdist.DistContext(0, 1, 0, torch.device(a.device), backend))
            if wrap:
                ids = [run.ctx.device.index or 0] if run.ctx.device.type == "cuda" else None
                run.fwd = DistributedDataParallel(run.fwd, device_ids=ids)
            it, state = iter(run.loader()), TrainState()
            losses.append([float(run.step(run.prepare(next(it)), state)["loss"]) for _ in range(3)])
    finally:
        td.destroy_process_group()
    diff = max(abs(p - q) / abs(q) for p, q in zip(losses[1], losses[0]))
    return dict(backend=backend, all_reduce=float(x[0]), plain=losses[0], ddp=losses[1], loss_rel_diff=diff,
                ok=bool(float(x[0]) == 1.0 and diff <= 1e-5))


def train_and_resume(a, raw: Path, steps: int = 50) -> dict:
    """The trainer's loop on the device: `steps` steps straight, and the same run stopped half way (its checkpoint
    written from the device) and resumed in a second call; the largest difference of their per-step losses."""
    from powerclip.train import load_config, read_metrics, train
    prec = "fp32"
    losses = {}
    for name, calls in (("straight", [None]), ("resumed", [steps // 2, None])):
        d = raw / name
        for i, stop in enumerate(calls):   # the first call starts afresh: a run left by an earlier try moved aside
            over = ["data.workers=0", f"max_steps={steps}", f"ckpt_every={steps // 2}", f"precision={prec}",
                    f"device={a.device}", f"out_dir={d}", "resume=never" if i == 0 else "resume=auto",
                    "overwrite=true"]
            train(load_config("smoke", over + ([f"stop_at={stop}"] if stop else []), method="powerclip"))
        losses[name] = [r["loss"] for r in read_metrics(d / "metrics.csv")]
    ck = raw / "resumed" / "checkpoints" / "last.pt"
    diff = max((abs(p - q) for p, q in zip(losses["resumed"], losses["straight"])), default=NAN)
    tol = 1e-6 if a.dry_run else 1e-4
    return dict(steps=len(losses["resumed"]), max_loss_diff=diff, checkpoint_bytes=ck.stat().st_size if ck.is_file()
                else None, ok=bool(len(losses["resumed"]) == steps == len(losses["straight"]) and diff <= tol))


def units_ddp(a, raw: Path):
    return [("ddp one process", lambda: ddp_one_process(a)), ("train 50 and resume", lambda: train_and_resume(a, raw))]


def report_ddp(a, values: dict) -> dict:
    md = ["DDP: `DistributedDataParallel` around the trainer's forward in a one-process process group "
          "(NCCL on a GPU), three PowerCLIP steps from the same weights and batches against the plain module. "
          "Trainer: 50 steps of the smoke preset on the device straight, and stopped at 25 (checkpoint written "
          "from the device) then resumed in a second call; the per-step losses compared.", "",
          "| unit | result | ok |", "|---|---|---|"]
    d, t = values.get("ddp one process"), values.get("train 50 and resume")
    if d:
        md.append(f"| ddp one process | {d['backend']}: all_reduce {d['all_reduce']:g}, loss rel. diff "
                  f"{d['loss_rel_diff']:.1e} | {'yes' if d['ok'] else 'NO'} |")
    if t:
        md.append(f"| train 50 and resume | {t['steps']} steps, largest loss difference {fmt(t['max_loss_diff'])}, "
                  f"checkpoint {fmt((t['checkpoint_bytes'] or NAN) / 2**20, '.1f')} MiB | "
                  f"{'yes' if t['ok'] else 'NO'} |")
    head = "; ".join(([f"DDP {d['backend']} {'ok' if d['ok'] else 'NOT ok'}"] if d else [])
                     + ([f"resume {'exact' if t['ok'] else 'NOT exact'} ({fmt(t['max_loss_diff'])})"] if t else []))
    return dict(headline=head or "-", ok=all(v["ok"] for v in values.values()) if values else None, md=md,
                results=values)


# ------------------------------------------------------------------------------------------------ torch.compile
def compile_measure(a, method: str, compiled: bool) -> dict:
    "The training step of `method`, eager or compiled: per-step times, losses, and dynamo's graph and break counts."
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
    from torch._dynamo import reset as dynamo_reset
    from torch._dynamo.utils import counters
    dynamo_reset()
    counters.clear()
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
    breaks = {str(k): v for k, v in counters["graph_break"].items()}
    return dict(first_s=times[0], ms_per_step=1e3 * sorted(times[2:])[len(times[2:]) // 2], steps=outs,
                graph_breaks=sum(breaks.values()), break_reasons=dict(list(breaks.items())[:10]),
                graphs=counters["stats"].get("unique_graphs", 0))


def compile_unit(a, m: str) -> dict:
    e, c = compile_measure(a, m, False), compile_measure(a, m, True)
    loss_err = max(abs(x["loss"] - y["loss"]) / abs(y["loss"]) for x, y in zip(c["steps"][:2], e["steps"][:2]))
    gn_err = abs(c["steps"][0]["grad_norm"] - e["steps"][0]["grad_norm"]) / abs(e["steps"][0]["grad_norm"])
    tol = 1e-4 if a.dry_run else 2e-2
    return dict(eager_ms=e["ms_per_step"], compiled_ms=c["ms_per_step"], speedup=e["ms_per_step"] / c["ms_per_step"],
                compile_s=c["first_s"] - e["first_s"], loss_rel_err=loss_err, grad_norm_rel_err=gn_err,
                graph_breaks=c["graph_breaks"], graphs=c["graphs"], break_reasons=c["break_reasons"],
                ok=bool(loss_err <= tol and gn_err <= 10 * tol))


def units_compile(a):
    return [(m, lambda m=m: compile_unit(a, m)) for m in HEAD]


def report_compile(a, values: dict) -> dict:
    md = ["The training step with `model.compile=true` (torch.compile of the model's forward as the method defines "
          f"it, backend {a.compile_backend}) against eager, same seed and batches: "
          + ("smoke preset on the CPU (dry run)" if a.dry_run else "ViT-B/16, 224 px, local batch 256, bf16, gradient "
                                                                   "checkpointing")
          + f"; median of {a.compile_steps} steps after 2; 'compile s' = the first step's extra time; graph breaks and "
          "graphs as dynamo counts them. Parity: the loss of the first two steps and the first gradient norm.", "",
          "| method | eager ms/step | compiled ms/step | speed-up | compile s | graph breaks | graphs | "
          "loss rel. diff | grad norm rel. diff | ok |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    md += [f"| {m} | {r['eager_ms']:.1f} | {r['compiled_ms']:.1f} | {r['speedup']:.2f}x | {r['compile_s']:.0f} | "
           f"{r['graph_breaks']} | {r['graphs']} | {r['loss_rel_err']:.1e} | {r['grad_norm_rel_err']:.1e} | "
           f"{'yes' if r['ok'] else 'NO'} |" for m, r in values.items()]
    head = "; ".join(f"{m} {r['speedup']:.2f}x compiled, {r['graph_breaks']} graph break(s)" for m, r in values.items())
    return dict(headline=head or "-", ok=all(r["ok"] for r in values.values()) if values else None, md=md,
                results=values)


# ------------------------------------------------------------------------------------------------ the loss's paths
def paths_unit(a, raw: Path, K: int | None, M: int) -> list[dict]:
    tag = f"K{K or 'cc3m'}_M{M}"
    if a.dry_run:
        argv = ["--R", "8", "--C", "16", "--dim", "16", "--reps", "1"]
    else:
        free = torch.cuda.get_device_properties(torch.device(a.device)).total_memory / 2**30
        argv = ["--R", "512", "--C", "4096", "--dim", "512", "--reps", "3", "--budget-gib", f"{0.6 * free:.0f}"]
    argv += ["--M", str(M), "--impl", "fast", "dense", "auto", "clip", "--precision", "bf16", "--device", a.device,
             "--tag", tag, "--out", str(raw)]
    rc = script("powerset_scale").main(argv + (["--K", str(K)] if K else []))
    if rc:
        raise RuntimeError(f"powerset_scale.py exited with {rc}")
    d = json.loads((raw / f"powerset_scale_{tag}.json").read_text())
    return [dict(r, dim=d["meta"]["args"]["dim"], node_counts=d["meta"]["node_counts"]["source"]) for r in d["rows"]]


def units_paths(a, raw: Path, K: int | None):
    return [(f"M={M}", lambda M=M: paths_unit(a, raw, K, M)) for M in ((3, 5) if a.dry_run else (10, 5, 32))]


def report_paths(a, values: dict) -> dict:
    rows = [r for v in values.values() for r in v]
    if not rows:
        return dict(headline="-", ok=None, md=[], results={})

    def get(impl, M):
        return next((r for r in rows if r["impl"] == impl and r["M"] == M), None)

    def ms(r):
        return "-" if r is None else (f"{r['time_s'] * 1e3:.1f}" if r.get("ok") else r.get("why", "failed"))

    def mib(r):
        return "-" if r is None or not r.get("ok") else f"{r['peak_mib']:.0f}"
    Ms = sorted({r["M"] for r in rows})
    md = [f"Forward + backward of `powerclip_loss` (both directions, CLIP loss included) at R = {rows[0]['R']} local "
          f"rows against C = {rows[0]['C']} gathered columns, bf16 autocast, D = {rows[0]['dim']}; node counts: "
          f"{rows[0]['node_counts']}. fast = blocked S-bar, dense = the (R, C, M, K) reference, auto = the loss's "
          "default. Median of the timed steps; peak = memory the step adds.", "",
          "| M | K_max | fast ms | dense ms | auto ms | CLIP ms | fast peak MiB | dense peak MiB | auto peak MiB |",
          "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for M in Ms:
        f, de, au, cl = (get(i, M) for i in ("fast", "dense", "auto", "clip"))
        md.append(f"| {M} | {(f or rows[0])['K_max']} | {ms(f)} | {ms(de)} | {ms(au)} | {ms(cl)} | {mib(f)} | "
                  f"{mib(de)} | {mib(au)} |")
    M0 = Ms[0]
    head = f"M={M0}: fast {ms(get('fast', M0))} ms, auto {ms(get('auto', M0))} ms, CLIP loss {ms(get('clip', M0))} ms"
    return dict(headline=head, ok=None, md=md, results=rows)


# ------------------------------------------------------------------------------------------------ accumulation
ACCUM_KS = (1, 2, 4)


def accum_args(a) -> argparse.Namespace:
    """accum_memory.py's settings: ViT-B/16 (the paper preset), 256 per GPU, bf16, without checkpointing, so that the
    activations accumulation saves are there to see (a toy model on the CPU in a dry run)."""
    if a.dry_run:
        return argparse.Namespace(preset="smoke", batch=8, precision="bf16", steps=2, warmup=1,
                                  grad_checkpointing=False, device=a.device)
    return argparse.Namespace(preset="paper", batch=256, precision="bf16", steps=4, warmup=1,
                              grad_checkpointing=False, device=a.device)


def measure_accum(a, method: str, k: int) -> dict:
    "One method's step at `accum_steps=k` through accum_memory's `measure` (`fresh`)."
    ns = accum_args(a)
    out = fresh(a, script("accum_memory").measure, method, k, ns)
    if "error" in out:
        return out
    t = sorted(out["times"])
    return dict(k=k, micro_batch=ns.batch // k, ms_per_step=1e3 * t[len(t) // 2], times=out["times"],
                peak_mib=out["peak_mib"], model=out["model"])


def units_accum(a):
    return [(f"{m}:k={k}", lambda m=m, k=k: measure_accum(a, m, k)) for m in methods(a) if m in HEAD for k in ACCUM_KS]


def report_accum(a, values: dict) -> dict:
    ns = accum_args(a)
    md = [f"{ns.preset} preset, {a.device}, {ns.batch} per step in k micro-batches (`accum_steps`), {ns.precision}, "
          "no gradient checkpointing; median of the timed steps, peak = what the timed steps allocated (a CPU's: its "
          "resident set). Ratios against k = 1 of the same method.", "",
          "| method | k | micro-batch | ms/step | peak GiB | time / k=1 | memory / k=1 |",
          "|---|---:|---:|---:|---:|---:|---:|"]
    head = []
    for key, r in values.items():
        m = key.split(":")[0]
        if "error" in r:
            md.append(f"| {key} | {r['error']} | | | | | |")
            continue
        base = values.get(f"{m}:k=1", {})
        tr = r["ms_per_step"] / base["ms_per_step"] if "ms_per_step" in base else NAN
        mr = r["peak_mib"] / base["peak_mib"] if base.get("peak_mib") else NAN
        md.append(f"| {m} | {r['k']} | {r['micro_batch']} | {r['ms_per_step']:.1f} | {r['peak_mib'] / 1024:.2f} | "
                  f"{fmt(tr, '.2f')}x | {fmt(mr, '.2f')}x |")
        if r["k"] == max(ACCUM_KS):
            head.append(f"{m} k={r['k']}: time {fmt(tr, '.2f')}x, memory {fmt(mr, '.2f')}x")
    return dict(headline="; ".join(head) or f"{len(values)} unit(s)",
                ok=None if not any("error" in r for r in values.values()) else False, md=md, results=values)


# ------------------------------------------------------------------------------------------------ memory
def memory_unit(a, raw: Path) -> dict:
    argv = ["--arch", "powerclip-micro", "--R", "8", "--M", "4"] if a.dry_run else []
    rc = script("paper_memory").main([*argv, "--device", a.device, "--out", str(raw)])
    if rc:
        raise RuntimeError(f"paper_memory.py exited with {rc}")
    return json.loads((raw / "paper_memory.json").read_text())


def report_memory(a, values: dict) -> dict:
    dev = values.get("paper_memory")
    if not dev:
        return dict(headline="-", ok=None, md=[], results={})
    cpu_f = RESULTS / "paper_memory.json"
    cpu = json.loads(cpu_f.read_text()) if cpu_f.is_file() else {"rows": []}

    def key(r):
        return r["precision"], r["checkpointing"], r["M"]
    cpu_rows = {key(r): r for r in cpu["rows"] if cpu.get("meta", {}).get("arch", "ViT-B-16") == dev["meta"]["arch"]}

    def f(r, k, spec):
        return "-" if r is None else format(r[k], spec)
    md = [f"{dev['meta']['arch']}, loss at R = {dev['rows'][0]['R_measured']}, C = 8 R: saved-for-backward bytes "
          f"measured on {dev['meta']['measured_on']} beside the projection from the bytes measured on the CPU "
          f"(results/paper_memory.json); budget {dev['meta']['gpu_gib']:.0f} GB less {dev['meta']['reserve']:.0%}.", "",
          "| precision | grad ckpt | M | towers MiB/sample CPU | device | loss GiB at R CPU | device | total GiB at R "
          "CPU | device | largest local batch CPU | device |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in dev["rows"]:
        c = cpu_rows.get(key(r))
        md.append(f"| {r['precision']} | {'yes' if r['checkpointing'] else 'no'} | {r['M']} | "
                  f"{f(c, 'towers_mib_per_sample', '.1f')} | {r['towers_mib_per_sample']:.1f} | "
                  f"{f(c, 'loss_gib_at_R', '.2f')} | {r['loss_gib_at_R']:.2f} | {f(c, 'total_gib_at_R', '.1f')} | "
                  f"{r['total_gib_at_R']:.1f} | {f(c, 'max_local_batch', 'd')} | {r['max_local_batch']} |")
    best = [r for r in dev["rows"] if r["precision"] == "bf16" and r["checkpointing"]]
    head = "bf16 + checkpointing: " + ", ".join(f"M={r['M']} {r['total_gib_at_R']:.1f} GiB at R={r['R_measured']}"
                                                 for r in best)
    return dict(headline=head, ok=all(r["fits_at_R"] for r in best), md=md, results=dev["rows"])


# ------------------------------------------------------------------------------------------------ the comparison
def compare_dir(a) -> Path:
    return a.state / "compare" if a.runs_dir is None else Path(a.runs_dir)


def compare_unit(a) -> dict:
    """powerclip.compare in a child process (the part's process group): it trains run by run, and a run it finds
    finished (or checkpointed) is kept (or resumed), so a cut comparison continues in the next job."""
    runs = compare_dir(a)
    argv = (["--runs", "CLIP", "PowerCLIP-R", "--steps", "3", "--seeds", "0", "--eval-images", "16", "--grounding", "0",
             "--device", "cpu", "--precision", "fp32"] if a.dry_run else
            ["--runs", "all", "--steps", str(a.compare_steps), "--seeds", *map(str, a.compare_seeds), "--device",
             a.device, "--precision", "bf16"])
    cmd = [sys.executable, "-m", "powerclip.compare", *argv, "--out", str(runs)]
    print("$", " ".join(cmd), flush=True)
    r = subprocess.run(cmd, cwd=ROOT)
    if r.returncode:
        raise RuntimeError(f"powerclip.compare exited with {r.returncode} (run again to continue)")
    text = (runs / "summary.md").read_text() if (runs / "summary.md").is_file() else "(no summary.md)"
    return dict(command="python -m powerclip.compare " + " ".join(argv), runs=str(runs), summary=text)


def report_compare(a, values: dict) -> dict:
    runs = compare_dir(a)
    done = sorted(str(p.parent.relative_to(runs)) for p in runs.glob("**/train.json")) if runs.is_dir() else []
    v = values.get("compare")
    md = ([f"`{v['command']}` (runs in {v['runs']})", "", v["summary"]] if v else
          [f"Not finished: {len(done)} run(s) trained so far under {runs} ({', '.join(done) or 'none'}); the next "
           "job continues it."])
    return dict(headline=f"{len(done)} run(s) trained" + ("; summary below" if v else ""), ok=None, md=md,
                results=dict(runs_done=done, summary=v["summary"] if v else None))
