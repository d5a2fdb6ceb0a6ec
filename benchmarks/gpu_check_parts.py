"""The parts of `benchmarks/gpu_check.py`: what each measures, in units that are recorded the moment they finish.

Each part is `units(a)`, a list of `(key, thunk)` run in order (a unit whose key is recorded is not run again; the keys
are `gpu_plan.unit_keys`'s, so that the plan and the run agree), and `report(a, values)`, which turns the recorded
values (all of them, or the first few of a part that was cut) into a headline, a verdict (`ok`: True, False, or None
where there is no target, or where the conditions are not the target's) and a Markdown table. The driver runs a part's
units in the part's own process and calls `report` whenever it publishes. Every headline says its conditions: one
process or several, the columns C the loss sees against the local rows R, the captions' node counts, the pooling,
eager or compiled, how many timed steps and which statistic.

The step parts run every method in the part's one process: the model is built once and copied for each method
(`one_model`), and the batches are built once for all (`host_batches`: the union of every method's needs), so that a
method's unit costs its steps, not a process start, a model's initialisation and thousands of rendered images.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import importlib
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import gpu_limits as L
from gpu_plan import ACCUM_KS, LOADER_WORKERS, PATHS, ordered, unit_keys

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
TIME_TARGET = 1.10          # PowerCLIP's step / CLIP's at ViT-B/16 bf16, C = 4096 eager (issues 15, 37)
MEMORY_TARGET_GIB = 79.6    # PowerCLIP's whole peak at 512 local, C = 4096: within an 80 GB card (an H100: 79.6 GiB)
LOSS_TARGET_MS = 5.0        # the loss with impl="triton" at R = 512, C = 4096, M = 10 (issue 37): a target
TOL = {"fp32": (1e-4, 1e-3), "bf16": (3e-2, 1e-1)}   # relative error allowed: (values, gradients)
NAN = float("nan")
PEERS = 7                   # step-C4096: 7 simulated processes beside this one, C = 8 x 512
REAL_SHARDS = ROOT / "runs" / "real_shards" / "annotated"    # `make real-shards`
# the papers' relative training times (CLIP-PGS paper, Table 1, R.T.T. against CLIP's 1.0x: 32 epochs on 8 V100s)
PAPER_RTT = {"flip": "0.5x (50 % masking)", "clip-pgs": "0.5x", "clip-pgs-0.3": "0.6x", "eclip": "0.6x",
             "aclip": "1.1x"}


def script(name: str):
    "A benchmark script beside this one, as a module (its `main(argv)`): spawned processes import it by that name."
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    return importlib.import_module(name)


def methods(a) -> list[str]:
    "CLIP and PowerCLIP first (the headline), then every other registered method (or `--methods`)."
    from powerclip.methods import METHODS, _import_baselines
    _import_baselines()
    return ordered(a.methods or sorted(m for m in METHODS if not m.startswith("_")))


def rel(x, y) -> float:
    "||x - y|| / ||y|| (the difference itself when y is 0)."
    x, y = x.detach().double().cpu().flatten(), y.detach().double().cpu().flatten()
    d, n = float((x - y).norm()), float(y.norm())
    return d / n if n > 0 else d


def fmt(x, spec=".1e") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def median(xs) -> float:
    "The true median (the mean of the middle two of an even count)."
    return statistics.median(xs)


def spread(xs) -> float:
    "max / min of the timed steps: 1.00 is a steady step."
    return max(xs) / min(xs) if xs and min(xs) > 0 else NAN


def triton_unavailable(device) -> str | None:
    """Why `impl="triton"` cannot run on `device` (None: it can): the package without `powerclip.sbar_triton`, a loss
    config that does not take `impl="triton"` yet, or the kernel's own reason (`unavailable(device)`: on the CPU
    without TRITON_INTERPRET, no triton, ...)."""
    try:
        from powerclip.sbar_triton import unavailable
    except ImportError:
        return "no powerclip.sbar_triton"
    from powerclip import loss
    try:
        loss.PowerCLIPLossConfig(impl="triton")
    except ValueError:
        return "PowerCLIPLossConfig does not take impl='triton' yet"
    own = getattr(loss, "triton_unavailable", None)            # the loss's own test where it has one
    return own(torch.device(device)) if own else unavailable(torch.device(device))


def card_name(a) -> str:
    """The device's name as `torch.cuda.get_device_name` gives it (the table of peaks is keyed by it); `a.card` where a
    caller names one (a report read on another machine); 'CPU (dry run)' off a GPU."""
    if getattr(a, "card", None):
        return a.card
    if a.dry_run or not str(a.device).startswith("cuda") or not torch.cuda.is_available():
        return "CPU (dry run)"
    return torch.cuda.get_device_name(torch.device(a.device))


def free_memory(device) -> None:
    "What the last unit left, given back (the next unit's peaks are its own)."
    gc.collect()
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------ one model, one set
_MODELS: dict = {}
_BATCHES: dict = {}


@contextlib.contextmanager
def one_model():
    """Within the block, `build_run`'s model is a copy of the first one built with the same arguments (on the host):
    a part initialises its model once, and every method starts from the same weights."""
    import powerclip.model as pm
    real = pm.create_model

    def create(*args, **kw):
        key = repr((args, sorted(kw.items())))
        if key not in _MODELS:
            _MODELS.clear()                                     # one model at a time in host memory
            _MODELS[key] = real(*args, **kw)
        model, *rest = _MODELS[key]
        return (copy.deepcopy(model), *rest)
    old = pm.create_model
    pm.create_model = create
    try:
        yield
    finally:
        pm.create_model = old


def host_batches(a, ns, n: int) -> list[dict]:
    """`n` host batches of `ns`'s preset and batch size with what every method asks (parse trees, noun-phrase labels,
    M random region boxes, FLAIR's K sub-captions per caption), built once in this process for every part and method
    of that size."""
    from dataclasses import replace
    from powerclip.data import BatchNeeds, make_loader
    from powerclip.train import validate
    key = (ns.preset, ns.batch, tuple(ns.set), n)
    if key not in _BATCHES:
        _BATCHES.clear()                                        # one size at a time in host memory
        tsr = script("train_step_ratio")
        ok = validate(tsr.config("powerclip", ns), world_size=1)
        k = validate(tsr.config("flair", ns), world_size=1).spec.needs.subcaptions
        needs = BatchNeeds(tree=True, node_np=True, regions=ok.spec.needs.regions, region_source="random",
                           subcaptions=k)
        it = iter(make_loader(replace(ok.spec, needs=needs)))
        _BATCHES[key] = [next(it) for _ in range(n)]
    return _BATCHES[key]


# ------------------------------------------------------------------------------------------------ parity
def _grads_of(total, leaves):
    gs = torch.autograd.grad(total, leaves, allow_unused=True)
    return torch.cat([(torch.zeros_like(x) if g is None else g).double().cpu().flatten() for g, x in zip(gs, leaves)])


def _inputs_at(out, batch, device, dtype):
    "The forward outputs (the floating ones as gradient leaves) and the batch, cast to `dtype` on `device`."
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
    return leaves, x, b


def _loss_terms(method, x, b, device, autocast):
    from powerclip.dist import DistContext
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=autocast):
        terms = method.loss(x, b, DistContext(device=torch.device(device)))
    return terms, sum(v for k, v in terms.items() if not k.startswith("_"))


def _loss_at(method, out, batch, device, dtype, autocast):
    """A method's loss terms and the gradient of their sum w.r.t. the forward outputs, from `out` cast to `dtype` on
    `device`."""
    leaves, x, b = _inputs_at(out, batch, device, dtype)
    terms, total = _loss_terms(method, x, b, device, autocast)
    return {k: v.detach().double().cpu() for k, v in terms.items()}, _grads_of(total, leaves)


def loss_syncs(method, out, batch, device, autocast) -> str:
    """One loss call, forward and backward, under `torch.cuda.set_sync_debug_mode("error")` (issue 37: the blocked
    and the triton paths wait for the GPU nowhere in the loss): "none", or the first sync's error. The inputs reach the
    device before the mode is set (their copies are the batch's, not the loss's). "-" off CUDA, where the simulated
    device of `tests/cuda_sim.py` counts the same syncs."""
    if torch.device(device).type != "cuda":
        return "-"
    leaves, x, b = _inputs_at(out, batch, device, torch.float32)
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        _, total = _loss_terms(method, x, b, device, autocast)
        torch.autograd.grad(total, leaves, allow_unused=True)
        return "none"
    except RuntimeError as e:
        return f"{e}".splitlines()[0][:200]
    finally:
        torch.cuda.set_sync_debug_mode(0)


def loss_parity(a, spec: str) -> list[dict]:
    "One method's loss (with ':options') on the device (fp32, bf16) against float64 on the CPU, same forward outputs."
    from powerclip import dist as pdist
    from powerclip.train import build_run, load_config
    from dataclasses import replace
    name, _, opts = spec.partition(":")
    B = a.parity_batch
    kvs = [kv for kv in opts.split(",") if kv]
    triton = "impl=triton" in kvs              # the reference on the CPU takes the default path; the device the kernel
    cfg = load_config("smoke", ["resume=never", "precision=fp64", f"data.batch_size={B}",
                                f"data.world_length={max(64, 2 * B)}",
                                *[f"method_cfg.{kv}" for kv in kvs if kv != "impl=triton"]], method=name)
    run = build_run(cfg, pdist.DistContext())
    batch = run.prepare(next(iter(run.loader())))
    run.method.on_step(0, run.total)
    out = run.fwd(batch)                                           # float64 forward outputs on the CPU
    ref_t, ref_g = _loss_at(run.method, out, batch, "cpu", torch.float64, False)
    if triton:
        run.method.cfg = replace(run.method.cfg, impl="triton")
    rows = []
    for prec in ("fp32", "bf16"):
        t, g = _loss_at(run.method, out, batch, a.device, torch.float32, prec == "bf16")
        errs = {k: rel(t[k], ref_t[k]) for k in ref_t if not k.startswith("_")}
        tv, tg = TOL[prec]
        worst, gerr = max(errs.values()), rel(g, ref_g)
        rows.append(dict(kind="loss", what=spec, precision=prec, value_err=worst, grad_err=gerr, terms=errs,
                         ok=bool(worst <= tv and gerr <= tg and all(torch.isfinite(v).all() for v in t.values()))))
        if name == "powerclip":
            rows[-1]["syncs"] = loss_syncs(run.method, out, batch, a.device, prec == "bf16")
    return rows


def sbar_cases():
    "(name, PowerCLIPLossConfig) for every NLA activation and switch, then the exact 2^M enumeration."
    from dataclasses import replace
    from powerclip.loss import PowerCLIPLossConfig
    from powerclip.powerset import NLA_T1_ACTS, NLA_T2_INTEGRALS
    specs = ([dict()] + [dict(t1_act=x) for x in NLA_T1_ACTS] + [dict(t2_act=x) for x in NLA_T2_INTEGRALS]
             + [dict(use_t2r=False), dict(use_r2t=False), dict(debias_t2=True), dict(alpha=0.0), dict(alpha=1.0),
                dict(region_sets=False), dict(region_sets=False, use_t2r=False), dict(region_sets=False, use_r2t=False),
                dict(tau=0.05)])
    cases = [("+".join(f"{k}={v}" for k, v in s.items()) or "default", replace(PowerCLIPLossConfig(tau=0.1), **s))
             for s in specs]
    return cases + [("exact 2^M", PowerCLIPLossConfig(tau=0.1, exact=True))]


def _skipped(kind: str, what: str, why: str) -> list[dict]:
    return [dict(kind=kind, what=what, precision=p, ok=None, skipped=why) for p in ("fp32", "bf16")]


def sbar_parity(a, name: str, cfg) -> list[dict]:
    """S-bar of one case on the device (each path: dense, fast, auto, and triton where it can run; a row skipped with
    the reason where it cannot), fp32 and bf16, against the float64 dense CPU reference."""
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
    for impl in (("dense",) if cfg.exact else ("dense", "fast", "auto", "triton")):
        why = triton_unavailable(a.device) if impl == "triton" else None
        if why:
            rows += _skipped("sbar", f"{name} [{impl}]", why)
            continue
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
    cases = dict(sbar_cases())
    out = []
    for key in unit_keys("parity", methods(a)):
        kind, what = key.split(" ", 1)
        if kind == "sbar":
            out.append((key, lambda n=what: sbar_parity(a, n, cases[n])))
        elif "impl=triton" in what and triton_unavailable(a.device):
            out.append((key, lambda w=what: _skipped("loss", w, triton_unavailable(a.device))))
        else:
            out.append((key, lambda m=what: _guard("loss", m, lambda: loss_parity(a, m))))
    return out


def report_parity(a, values: dict) -> dict:
    rows = [r for v in values.values() for r in v]
    skipped = [r for r in rows if "skipped" in r]
    rows_run = [r for r in rows if "skipped" not in r]
    bad = [r for r in rows_run if not r["ok"]]

    def worst(kind, prec, key):
        return max((r.get(key, 0) for r in rows_run if r["kind"] == kind and r["precision"] == prec), default=NAN)
    md = ["Relative error ||device - reference|| / ||reference|| against float64 on the CPU; allowed: fp32 "
          f"{TOL['fp32'][0]:g} (values) / {TOL['fp32'][1]:g} (gradients), bf16 {TOL['bf16'][0]:g} / "
          f"{TOL['bf16'][1]:g}. Loss rows: a method's loss terms (the largest error among them) and the gradient "
          f"of their sum w.r.t. the forward outputs, from the same float64 forward outputs (batch {a.parity_batch}). "
          "S-bar rows: `powerset_similarity` on ragged inputs, every NLA activation and switch, each path (triton: "
          "the fused kernel, `impl=\"triton\"`, where it can run; a skipped row says why).", "",
          "| kind | what | precision | value error | gradient error | ok |", "|---|---|---|---:|---:|---|"]
    for r in rows:
        if "skipped" in r:
            md.append(f"| {r['kind']} | {r['what']} | {r['precision']} | skipped: {r['skipped']} | | - |")
        elif "error" in r:
            md.append(f"| {r['kind']} | {r['what']} | {r['precision']} | {r['error']} | | no |")
        else:
            md.append(f"| {r['kind']} | {r['what']} | {r['precision']} | {r['value_err']:.1e} | {r['grad_err']:.1e} | "
                      f"{'yes' if r['ok'] else 'NO'} |")
    why = sorted({r["skipped"] for r in skipped})
    synced = [f"{r['what']} {r['precision']}: {r['syncs']}" for r in rows_run if r.get("syncs", "-") != "-"]
    if synced:
        md += ["", "Host syncs of one PowerCLIP loss call, forward and backward, under "
               "`torch.cuda.set_sync_debug_mode(\"error\")` (none expected on the blocked and triton paths):", "",
               *[f"- {x}" for x in synced]]
    head = (f"{len(rows_run) - len(bad)}/{len(rows_run)} within tolerance; worst loss error fp32 "
            f"{fmt(worst('loss', 'fp32', 'value_err'))} (grad {fmt(worst('loss', 'fp32', 'grad_err'))}), bf16 "
            f"{fmt(worst('loss', 'bf16', 'value_err'))} (grad {fmt(worst('loss', 'bf16', 'grad_err'))})"
            + (f"; {len(skipped)} triton row(s) skipped ({'; '.join(why)})" if skipped else "")
            + (f"; loss syncs: {sum(x.endswith(': none') for x in synced)} of {len(synced)} calls make none"
               if synced else ""))
    by = {}
    for r in rows_run:
        if r["kind"] == "loss":
            by.setdefault(r["what"], {})[r["precision"]] = {k: v for k, v in r.items() if k not in ("kind", "what")}
    return dict(headline=head, ok=not bad if rows_run else None, md=md, results=dict(loss=by, rows=rows))


# ------------------------------------------------------------------------------------------------ train steps
def step_args(a, batch: int, peers: int = 0) -> argparse.Namespace:
    """train_step_ratio.py's settings: the paper preset (ViT-B/16, 224 px), bf16, checkpointing, class-token pooling
    for every method (A-CLIP pools only so), 2 warm-up and 8 timed steps cycling through 4 batches (a toy model on the
    CPU in a dry run). `peers`: simulated data-parallel processes whose rows the loss sees (C = (1 + peers) batch)."""
    if a.dry_run:
        return argparse.Namespace(preset="smoke", batch=8, precision="bf16", steps=3, warmup=1,
                                  grad_checkpointing=False, set=["model.pool=tok"], device=a.device, peers=peers)
    return argparse.Namespace(preset="paper", batch=batch, precision="bf16", steps=8, warmup=2, grad_checkpointing=True,
                              set=["model.pool=tok"], device=a.device, peers=peers)


N_BATCHES = 4       # distinct batches a step part builds and its steps cycle through


def measure_step(a, method: str, ns) -> dict:
    "One method's step time and peak memory through train_step_ratio's `measure`, in this process (`one_model`)."
    tsr = script("train_step_ratio")
    try:
        with one_model():
            out = tsr.measure(method, ns, host_batches(a, ns, min(N_BATCHES, ns.warmup + ns.steps)))
    finally:
        free_memory(a.device)
    t = out["times"]
    p20, _, p80 = L.quantiles(t)
    return dict(ms_per_step=1e3 * median(t), images_per_s=ns.batch / median(t), spread=spread(t), times=t,
                p20_ms=1e3 * p20, p80_ms=1e3 * p80, tower_flops=model_flops(),
                peak_mib=out["peak_mib"], peak_total_mib=out["peak_total_mib"],
                peak_reserved_mib=out.get("peak_reserved_mib", NAN), model=out["model"], params=out["params"],
                columns=out["columns"], peers=out["peers"], pool=out["pool"], batches=out["batches"])


def model_flops() -> dict | None:
    """The towers' FLOPs per sample (`gpu_limits.tower_flops`) of the model `one_model` built last, from its shapes
    (None where it is not a plain ViT and text transformer)."""
    try:
        model = next(iter(_MODELS.values()))[0]
        return L.tower_flops(L.tower_shapes(model))
    except (StopIteration, AttributeError, NotImplementedError, IndexError):
        return None


def mfu(r: dict, name: str, ckpt: bool = False) -> float | None:
    """Model FLOPs utilisation of a step result: images/s x the towers' training FLOPs per sample (forward + backward;
    `ckpt`: with the blocks' forward recomputed under checkpointing, the hardware's work) / the card's bf16 peak."""
    f = r.get("tower_flops")
    if not f or "images_per_s" not in r:
        return None
    return L.fraction(f["train_ckpt" if ckpt else "train"] * r["images_per_s"], 1.0, name)


def units_step(a, part: str):
    ms = methods(a)
    batch = 256 if part == "steps-other" else 512 if part == "step-C4096" else int(part[6:])
    ns = step_args(a, batch, PEERS if part == "step-C4096" else 0)
    return [(m, lambda m=m: measure_step(a, m, ns)) for m in unit_keys(part, ms)]


def step_conditions(a, ns, res: dict) -> str:
    "The conditions of a step table, in words."
    model = next((r["model"] for r in res.values() if "model" in r), "?")
    where = ("in this part's one process (the model built once and copied, the same batches for every method)"
             if not a.dry_run else "in one process (dry run)")
    loss = (f"the loss sees C = {ns.batch * (1 + ns.peers)} columns: this process's {ns.batch} and {ns.peers} "
            f"simulated processes' {ns.batch * ns.peers} (detached, as DDP's all-gather delivers them; their captions "
            "with CC3M node counts, mean 8.1; the all-gather's communication not timed)" if ns.peers else
            f"one process, so the loss sees C = R = {ns.batch} columns (the world's captions, at most 6 nodes)")
    return (f"{ns.preset} preset ({model}), {a.device}, local batch {ns.batch}, {ns.precision}, gradient checkpointing "
            f"{'on' if ns.grad_checkpointing else 'off'}, class-token pooling for all, eager; {loss}; median of "
            f"{ns.steps} timed steps after {ns.warmup} warm-up, cycling through {N_BATCHES} batches of the built-in "
            f"world, {where}; spread = the slowest timed step / the fastest. 'peak' = what the timed steps allocated "
            "above what was there before them; 'whole' = the whole allocated peak since the method's model was built "
            "(weights, gradients, AdamW's moments, its prepared batches); 'reserved' = the caching allocator's peak.")


def report_step(a, values: dict, part: str, clip: dict | None = None) -> dict:
    "The step table; `clip`: CLIP's result when it is another part's (steps-other takes step-B256's)."
    batch = 256 if part == "steps-other" else 512 if part == "step-C4096" else int(part[6:])
    ns = step_args(a, batch, PEERS if part == "step-C4096" else 0)
    base = values.get("clip") or clip or {}
    res = {}
    for m, r in values.items():
        r = dict(r)
        if "error" not in r and "ms_per_step" in base:
            r["time_ratio"] = r["ms_per_step"] / base["ms_per_step"]
            r["mem_ratio"] = r["peak_mib"] / base["peak_mib"] if base["peak_mib"] > 0 else NAN   # a CPU's RSS: 0
        res[m] = r
    other = part == "steps-other"
    rtt = (" Beside each method, its paper's relative training time (the CLIP-PGS paper's Table 1, R.T.T. against "
           "CLIP's 1.0x: whole trainings of 32 epochs on 8 V100s, not one step) where it gives one." if other else "")
    name = card_name(a)
    tf = next((r["tower_flops"] for r in res.values() if r.get("tower_flops")), None)
    work = ("MFU = images/s x the two towers' training FLOPs per sample (`gpu_limits.tower_flops`, counted from the "
            "model's shapes: matrix products, forward + backward = 3 x forward"
            + (f", {tf['train'] / 1e9:.3g} GFLOP; with checkpointing's recomputed blocks "
               f"{tf['train_ckpt'] / 1e9:.3g} GFLOP: 'MFU ckpt'" if tf else "")
            + ") / the card's bf16 peak: " + L.limits_line(name)
            + ". The loss and the methods' own heads are not counted; masking methods are counted at every token.")
    md = [step_conditions(a, ns, res) + rtt, "", work, "",
          "| method | ms/step | p20-p80 ms | spread | images/s | MFU | MFU ckpt | peak GiB | whole GiB | "
          "reserved GiB | time / CLIP | memory / CLIP |" + (" paper's R.T.T. |" if other else ""),
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---|" if other else "")]
    for m, r in res.items():
        if "error" in r:
            md.append(f"| {m} | {r['error']} | | | | | | | | | | |" + (" |" if other else ""))
            continue
        r["mfu"], r["mfu_ckpt"] = mfu(r, name), mfu(r, name, True)
        md.append(f"| {m} | {r['ms_per_step']:.1f} | {fmt(r.get('p20_ms'), '.1f')}-{fmt(r.get('p80_ms'), '.1f')} | "
                  f"{fmt(r.get('spread', NAN), '.2f')} | {r['images_per_s']:.0f} | {L.pct(r['mfu'])} | "
                  f"{L.pct(r['mfu_ckpt'])} | "
                  f"{fmt(r['peak_mib'] / 1024, '.2f')} | {fmt(r['peak_total_mib'] / 1024, '.2f')} | "
                  f"{fmt(r['peak_reserved_mib'] / 1024, '.2f')} | {fmt(r.get('time_ratio'), '.2f')}x | "
                  f"{fmt(r.get('mem_ratio'), '.2f')}x |"
                  + (f" {PAPER_RTT.get(m.split(':')[0], '-')} |" if other else ""))
    if other:
        md += ["", "CLIP's row is step-B256's (the same conditions, its own part)."]
    pc = res.get("powerclip", {})
    cond = (f"one process, C = {ns.batch * (1 + ns.peers)} against R = {ns.batch}"
            + (f" ({ns.peers} simulated peers, CC3M node counts)" if ns.peers
               else " (C = R: world captions <= 6 nodes)")
            + f", class-token pooling, eager, median of {ns.steps} timed steps")
    if "time_ratio" not in pc:
        sp = ", ".join(f"{m} {fmt(r.get('spread', NAN), '.2f')}" for m, r in res.items() if "error" not in r)
        mf = ", ".join(f"{m} MFU {L.pct(r.get('mfu'))}" for m, r in res.items() if "error" not in r)
        return dict(headline=f"{len(res)} method(s) measured ({cond}; spread max/min: {sp or '-'}; {mf or '-'})"
                    + ("; PowerCLIP or CLIP missing" if not other and clip is None else ""),
                    ok=None if not any("error" in r for r in res.values()) else False, md=md, results=res)
    target = part == "step-C4096"            # the targets' conditions: 512 local, C = 4096, eager
    gib = pc["peak_total_mib"] / 1024
    measured = not math.isnan(gib) and not a.dry_run
    ok_time = pc["time_ratio"] <= TIME_TARGET
    ok_mem = gib <= MEMORY_TARGET_GIB if measured else True
    times = "; ".join(f"{m} {res[m]['ms_per_step']:.0f} ms, {res[m]['images_per_s']:.0f} images/s, MFU "
                      f"{L.pct(res[m].get('mfu'))}" for m in ("powerclip", "clip") if "ms_per_step" in res.get(m, {}))
    head = (f"PowerCLIP {pc['time_ratio']:.2f}x CLIP's step time ({times}), memory {fmt(pc['mem_ratio'], '.2f')}x "
            f"({cond}; "
            f"spread CLIP {fmt(base.get('spread', NAN), '.2f')}, PowerCLIP {fmt(pc.get('spread', NAN), '.2f')})")
    if target and not a.dry_run:
        head += (f"; target <= {TIME_TARGET:.2f}x: {'met' if ok_time else 'NOT met'}; whole peak "
                 + (f"{gib:.1f} GiB (target <= {MEMORY_TARGET_GIB} GiB: {'met' if ok_mem else 'NOT met'})"
                    if measured else "not measured"))
    elif target:
        head += f"; dry run: the targets (<= {TIME_TARGET:.2f}x, whole peak <= {MEMORY_TARGET_GIB} GiB) not judged"
    else:
        head += ((f"; whole peak {gib:.1f} GiB" if measured else "; whole peak not measured (no GPU)")
                 + f"; no target here (PowerCLIP <= {TIME_TARGET:.2f}x is judged at step-C4096, the paper's C = 4096)")
    bad = any("error" in r for r in res.values())
    ok = (ok_time and ok_mem and not bad) if target and not a.dry_run else (False if bad else None)
    return dict(headline=head, ok=ok, md=md, results=res)


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
def _recording(backend: str, graphs: list):
    """`backend` (a name torch.compile takes) that first records each graph it is given: dynamo's compile id ('F/N':
    frame F, its N-th compilation, N > 0 a recompile) and the graph's node count."""
    from torch._dynamo import lookup_backend
    from torch._guards import CompileContext
    inner = lookup_backend(backend)

    def record(gm, example_inputs):
        cid = CompileContext.current_compile_id()
        graphs.append(dict(id=str(cid), frame=getattr(cid, "frame_id", None),
                           recompile=(getattr(cid, "frame_compile_id", 0) or 0) > 0, nodes=len(gm.graph.nodes)))
        return inner(gm, example_inputs)
    return record


def compile_measure(a, method: str, compiled: bool, batch: int = 256, peers: int = 0) -> dict:
    """The training step of `method`, eager or compiled (`model.compile=true`), on the step parts' batches and model:
    per-step times, losses, the first step's time, and what dynamo compiled (graphs, recompiles, graph breaks)."""
    from torch._dynamo import reset as dynamo_reset
    from torch._dynamo.utils import counters
    from unittest import mock
    from powerclip import dist as pdist
    from powerclip import methods as pmethods
    from powerclip.measure import sync
    from powerclip.train import TrainState, build_run
    tsr = script("train_step_ratio")
    ns = step_args(a, batch, peers)
    ns.steps, ns.set = (a.compile_steps if not a.dry_run else 3), [*ns.set, f"model.compile={str(compiled).lower()}"]
    host = host_batches(a, step_args(a, batch, peers), min(N_BATCHES, ns.warmup + 8))
    dynamo_reset()
    counters.clear()
    graphs: list = []
    backend = _recording(a.compile_backend, graphs)
    real_compile = torch.compile
    gather = tsr.SimulatedPeers(peers, tsr.cc3m_counts(peers * ns.batch)) if peers else pmethods.gather
    try:
        with one_model(), mock.patch.object(torch, "compile",
                                            lambda f, **k: real_compile(f, **{**k, "backend": backend})):
            run = build_run(tsr.config(method, ns), pdist.DistContext(device=torch.device(a.device)))
            if peers:
                run.ctx = gather.context(run.ctx)
            prepared = [run.prepare(b) for b in host]
            state, times, outs = TrainState(), [], []
            with mock.patch.object(pmethods, "gather", gather):
                for i in range(2 + ns.steps):
                    run.method.on_step(i, run.total)
                    sync(a.device)
                    t0 = time.perf_counter()
                    out = run.step(prepared[i % len(prepared)], state)
                    sync(a.device)
                    times.append(time.perf_counter() - t0)
                    outs.append({k: float(v) for k, v in out.items() if k in ("loss", "grad_norm")})
            del run, prepared
    finally:
        free_memory(a.device)
    breaks = {str(k): v for k, v in counters["graph_break"].items()}
    return dict(first_s=times[0], ms_per_step=1e3 * median(times[2:]), spread=spread(times[2:]), steps=outs,
                timed=len(times) - 2, graph_breaks=sum(breaks.values()), break_reasons=dict(list(breaks.items())[:10]),
                graphs=len(graphs), frames=len({g["frame"] for g in graphs}),
                recompiles=sum(g["recompile"] for g in graphs), graph_ids=[f"{g['id']}:{g['nodes']}" for g in graphs],
                unique_graphs=counters["stats"].get("unique_graphs", 0), batch=ns.batch, columns=ns.batch * (1 + peers),
                tower_flops=model_flops())


def units_compile(a, part: str = "compile"):
    """Each half apart (a half is recorded when whole: a cut compile keeps the eager half, and the inductor cache in the
    state folder keeps what it compiled). compile: 256 local, C = R; compile-C4096: 512 local, C = 4096 (7 peers), its
    eager halves being step-C4096's."""
    out = []
    for key in unit_keys(part, methods(a)):
        m, half = key.split()
        if part == "compile":
            out.append((key, lambda m=m, h=half: compile_measure(a, m, h == "compiled")))
        else:
            out.append((key, lambda m=m: compile_measure(a, m, True, 512, PEERS)))
    return out


def _joined(values: dict, eager_of, name: str | None = None) -> dict:
    "{method: its eager and compiled halves joined} for every method whose compiled half is recorded."
    res = {}
    for key, c in values.items():
        m, half = key.split()
        if half != "compiled" or "error" in c:
            continue
        e = eager_of(m)
        r = dict(compiled_ms=c["ms_per_step"], compiled_spread=c["spread"], graphs=c["graphs"], frames=c["frames"],
                 recompiles=c["recompiles"], graph_breaks=c["graph_breaks"], break_reasons=c["break_reasons"],
                 graph_ids=c["graph_ids"], first_s=c["first_s"])
        if c.get("tower_flops") and c.get("batch"):      # MFU of the compiled step (the towers' model FLOPs)
            r["mfu"] = mfu(dict(tower_flops=c["tower_flops"], images_per_s=c["batch"] / c["ms_per_step"] * 1e3), name)
        if e and "error" not in e:
            r.update(eager_ms=e["ms_per_step"], speedup=e["ms_per_step"] / c["ms_per_step"])
            if "first_s" in e:
                r["compile_s"] = c["first_s"] - e["first_s"]
            if "steps" in e:
                r["loss_rel_err"] = max(abs(x["loss"] - y["loss"]) / abs(y["loss"])
                                        for x, y in zip(c["steps"][:2], e["steps"][:2]))
                r["grad_norm_rel_err"] = (abs(c["steps"][0]["grad_norm"] - e["steps"][0]["grad_norm"])
                                          / abs(e["steps"][0]["grad_norm"]))
        res[m] = r
    return res


def report_compile(a, values: dict, part: str = "compile", every: dict | None = None) -> dict:
    c4096 = part == "compile-C4096"
    ref = (every or {}).get("step-C4096", {}) if c4096 else values
    res = _joined(values, (lambda m: ref.get(m)) if c4096 else (lambda m: values.get(f"{m} eager")), card_name(a))
    tol = 1e-4 if a.dry_run else 2e-2
    for r in res.values():
        r["ok"] = bool(r.get("loss_rel_err", 0) <= tol and r.get("grad_norm_rel_err", 0) <= 10 * tol)
    where = ("smoke preset on the CPU (dry run)" if a.dry_run else
             "ViT-B/16, 224 px, bf16, gradient checkpointing, class-token pooling (as the step parts)")
    cols = ("local batch 512, the loss against C = 4096 (7 simulated peers, as step-C4096; its eager times are "
            "step-C4096's)" if c4096 else "local batch 256, one process (C = R = 256)")
    md = [f"The training step with `model.compile=true` (torch.compile of the model's forward as the method defines "
          f"it, backend {a.compile_backend}; the loss, backward and optimiser eager) against eager, same model and "
          f"batches: {where}, {cols}; median of the timed steps after 2; 'compile s' = the first compiled step's "
          "time less the first eager step's. Graphs: each graph dynamo handed the backend, by compile id 'F/N' "
          "(frame F's N-th compilation: a frame is the forward or a function dynamo resumes after a graph break, "
          "N > 0 a recompile) with its node count; graph breaks as dynamo counts them. Parity: the loss of the first "
          "two steps and the first gradient norm.", "",
          "| method | eager ms/step | compiled ms/step | speed-up | compile s | graphs (frames, recompiles) | "
          "graph breaks | graph ids:nodes | loss rel. diff | grad norm rel. diff | ok |",
          "|---|---:|---:|---:|---:|---|---:|---|---:|---:|---|"]
    for m, r in res.items():
        md.append(f"| {m} | {fmt(r.get('eager_ms'), '.1f')} | {r['compiled_ms']:.1f} | {fmt(r.get('speedup'), '.2f')}x"
                  f" | {fmt(r.get('compile_s'), '.0f')} | {r['graphs']} ({r['frames']}, {r['recompiles']}) | "
                  f"{r['graph_breaks']} | {' '.join(r['graph_ids'][:8])} | {fmt(r.get('loss_rel_err'))} | "
                  f"{fmt(r.get('grad_norm_rel_err'))} | {'yes' if r['ok'] else 'NO'} |")
    halves = [k for k in values if k.split()[0] not in res]
    if halves:
        md += ["", "Recorded halves without their pair yet: " + ", ".join(halves) + " (the next job continues)."]
    ns = step_args(a, 512 if c4096 else 256, PEERS if c4096 else 0)
    cond = (f"{ns.batch} local, C = {ns.batch * (1 + ns.peers)}" + ("" if c4096 else " = R")
            + f", class-token pooling, {ns.precision}, checkpointing {'on' if ns.grad_checkpointing else 'off'}, "
            f"median of {a.compile_steps if not a.dry_run else 3} timed steps")
    head = "; ".join(f"{m} {fmt(r.get('speedup'), '.2f')}x compiled ({r['compiled_ms']:.0f} ms, MFU "
                     f"{L.pct(r.get('mfu'))}; {r['graphs']} graph(s), {r['recompiles']} "
                     f"recompile(s), {r['graph_breaks']} graph break(s))" for m, r in res.items())
    if c4096 and {"clip", "powerclip"} <= set(res) and "compiled_ms" in res["clip"]:
        head += f"; PowerCLIP / CLIP compiled {res['powerclip']['compiled_ms'] / res['clip']['compiled_ms']:.2f}x"
    head = f"{head} ({cond})" if head else f"{len(values)} half(s) recorded ({cond})"
    bad = any("error" in v for v in values.values())
    return dict(headline=head, ok=(all(r["ok"] for r in res.values()) and not bad) if res else (False if bad else None),
                md=md, results=dict(joined=res, halves=values))


# ------------------------------------------------------------------------------------------------ the loss's paths
def device_block_bytes(device) -> int:
    """The blocked path's budget for a device: 16 MiB on a CPU; on a GPU 1/128 of its memory within 256 MiB - 1 GiB
    (the range issue 37 gives; the package's own where it has one: `powerclip.powerset_fast.device_block_bytes`)."""
    try:
        from powerclip.powerset_fast import device_block_bytes as own
        return int(own(torch.device(device)))
    except ImportError:
        pass
    if not str(device).startswith("cuda"):
        return 16 << 20
    total = torch.cuda.get_device_properties(torch.device(device)).total_memory
    return int(min(1 << 30, max(256 << 20, total // 128)))


def paths_unit(a, K: int | None, M: int, path: str) -> dict:
    """One path of the loss at one M, forward + backward in this process (powerset_scale.measure): R = 512 local rows
    against C = 4096 gathered, D = 512, bf16, CC3M node counts (or K per caption); a row that cannot run says why."""
    ps = script("powerset_scale")
    R, C, D, reps = (8, 16, 16, 3) if a.dry_run else (512, 4096, 512, 10)
    hist = ps.node_count_hist()
    counts = [K] * C if K else ps.draw_counts(hist["hist"], C, 0)
    row = dict(path=path, M=M, R=R, C=C, dim=D, K_max=max(counts), K_mean=sum(counts) / C,
               node_counts=f"fixed: K = {K} nodes per caption" if K else hist["source"],
               flops=L.loss_flops(R, C, M, D, counts, local=False))
    impl, block = {"fast": ("fast", 16 << 20), "fast-device": ("fast", device_block_bytes(a.device)),
                   "triton": ("triton", 16 << 20)}.get(path, (path, 16 << 20))
    row["block_mib"] = block / 2**20 if impl == "fast" else None
    why = triton_unavailable(a.device) if path == "triton" else None
    if why is None and path == "dense":
        budget = (8.0 if a.dry_run else
                  0.6 * torch.cuda.get_device_properties(torch.device(a.device)).total_memory / 2**30)
        need = ps.predicted_gib("dense", R, C, M, max(counts))
        why = f"~{need:.0f} GiB saved for backward > {budget:.0f} GiB" if need > budget else None
    if why:
        return dict(row, ok=False, why=why)
    try:
        r = ps.measure(impl, R, C, M, D, counts, "bf16", reps, block, 0, a.device)
    finally:
        free_memory(a.device)
    p20, _, p80 = L.quantiles(r.get("times", [r["time_s"]]))
    return dict(row, ok=True, p20_s=p20, p80_s=p80, **r)


def path_work(r: dict) -> float:
    """The useful FLOPs of a paths row: CLIP's logits alone for the clip path, half of them for the siglip path (one
    R x C block: the local images against the gathered texts, where CLIP's loss has a block each way), else S-bar's
    useful products + CLIP's."""
    f = r["flops"]
    return {"clip": f["clip"], "siglip": f["clip"] / 2}.get(r["path"], f["useful"])


def units_paths(a, K: int | None):
    part = "paths-K16" if K else "paths-Kcc3m"
    return [(key, lambda M=int(key.split()[0][2:]), p=key.split()[1]: paths_unit(a, K, M, p))
            for key in unit_keys(part)]


def report_paths(a, values: dict) -> dict:
    rows = [v for v in values.values() if isinstance(v, dict) and "path" in v]
    if not rows:
        return dict(headline="-", ok=None, md=[], results={})
    name = card_name(a)

    def get(path, M):
        return next((r for r in rows if r["path"] == path and r["M"] == M), None)

    def ms(r):
        return "-" if r is None else (f"{r['time_s'] * 1e3:.1f}" if r.get("ok") else f"skipped: {r.get('why', '?')}")

    def frac(r):
        return L.fraction(path_work(r), r["time_s"], name) if r is not None and r.get("ok") and "flops" in r else None
    r0 = rows[0]
    dev_mib = next((r["block_mib"] for r in rows if r["path"] == "fast-device"), None)
    md = [f"Forward + backward of `powerclip_loss` (both directions, CLIP loss included) at R = {r0['R']} local "
          f"rows against C = {r0['C']} gathered columns, bf16 autocast, D = {r0['dim']}; node counts: "
          f"{r0['node_counts']}; each path and M a unit, in this part's one process; the median and the 20th-80th "
          "percentiles of the timed steps after a warm-up; peak = memory the step adds. triton = the fused S-bar "
          "kernel (`impl=\"triton\"`), fast = the blocked path with its default 16 MiB blocks, fast-device = the same "
          f"with the device's budget ({fmt(dev_mib, '.0f')} MiB), dense = the (R, C, M, K) reference, clip = CLIP's "
          "loss alone, siglip = SigLIP's sigmoid loss alone (`siglip_loss`: the local images against every gathered "
          "text; M plays no part in either).", "",
          "Work (`gpu_limits.loss_flops`, from the shapes): the useful products, unpadded (each caption's own node "
          "count): the scores q = <region, phrase> forward and the two gradient products (regions, phrases), plus "
          "CLIP's logits forward and backward; not counted: the backward's recomputed scores (the blocked and the "
          "Triton paths: one product more), the dense path's padding to K_max, the activations (their scores are "
          "counted apart: 'G scores/s' = the scores of one pass, forward, through the activations, per second). "
          "TFLOP/s = useful FLOPs / the median time; % of peak against " + L.limits_line(name) + ".", "",
          "| M | K_max | path | ms median | ms p20-p80 | useful TFLOP | TFLOP/s | % of peak | G scores/s | peak MiB |",
          "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for M in sorted({r["M"] for r in rows}):
        kmax = next(r["K_max"] for r in rows if r["M"] == M)
        for p in PATHS:
            r = get(p, M)
            if r is None:
                continue
            if not r.get("ok"):
                md.append(f"| {M} | {kmax} | {p} | {ms(r)} | | | | | | |")
                continue
            work, t = path_work(r), r["time_s"]
            sc = r["flops"]["scores"] if p not in ("clip", "siglip") else None
            md.append(f"| {M} | {kmax} | {p} | {t * 1e3:.2f} | {fmt(r.get('p20_s', NAN) * 1e3, '.2f')}-"
                      f"{fmt(r.get('p80_s', NAN) * 1e3, '.2f')} | {work / 1e12:.3g} | {work / t / 1e12:.3g} | "
                      f"{L.pct(frac(r))} | {fmt(sc / t / 1e9 if sc else None, '.3g')} | {r['peak_mib']:.0f} |")
    M0 = 10 if any(r["M"] == 10 for r in rows) else rows[0]["M"]
    cond = (f"R = {r0['R']}, C = {r0['C']}, M = {M0}, "
            + ("K = " + str(r0["K_max"]) if r0["node_counts"].startswith("fixed") else "CC3M node counts")
            + ", bf16, forward + backward, median; % of the card's bf16 peak on the useful products")
    parts = [f"{p} {ms(get(p, M0))} ms ({L.pct(frac(get(p, M0)))} of peak)" if get(p, M0).get("ok")
             else f"{p} {ms(get(p, M0))}" for p in PATHS if get(p, M0) is not None]
    tri = get("triton", M0)
    target = ""
    if M0 == 10 and r0["R"] == 512 and r0["C"] == 4096 and tri is not None and tri.get("ok"):
        t = tri["time_s"] * 1e3
        target = f"; target triton <= {LOSS_TARGET_MS:g} ms: {'met' if t <= LOSS_TARGET_MS else 'NOT met'}"
    judged = bool(target) and not a.dry_run
    unknown = "" if L.card(name) else f"; {L.limits_line(name)}"
    return dict(headline=f"{', '.join(parts)} ({cond}){target}{unknown}",
                ok=(tri["time_s"] * 1e3 <= LOSS_TARGET_MS) if judged else None, md=md, results=rows)


# ------------------------------------------------------------------------------------------------ real photos
def real_shards(a) -> str | None:
    "The annotated shards' brace pattern (`make real-shards`), or None when they are not there."
    d = Path(a.real_shards)
    tars = sorted(d.glob("*.tar")) if d.is_dir() else []
    if not tars:
        return None
    return str(d / f"{{{tars[0].stem}..{tars[-1].stem}}}.tar") if len(tars) > 1 else str(tars[0])


def real_config(a, workers: int, batch: int, step: bool = False):
    """PowerCLIP (masks: the shards' stored slic regions, on ViT-B/16's 14 x 14 grid) on the real shards, ViT-B/16 bf16
    with checkpointing. The dry run's step (`step`) takes the smoke preset's model, whose 4 x 4 grid cannot take the
    stored masks: random boxes there (its loader units read the shards as ViT-B/16 would, masks included)."""
    from powerclip.train import load_config
    toy = a.dry_run and step
    base = ["data.source=wds", f"data.shards={real_shards(a)}", f"data.workers={workers}",
            f"data.batch_size={batch}", "data.shuffle_buffer=0", "global_batch_size=null", "resume=never",
            "max_steps=100000", f"method_cfg.masks={'random' if toy else 'stored'}", "model.pool=tok"]
    base += (["precision=fp32"] if toy else ["precision=bf16", "model.grad_checkpointing=true"])
    return load_config("smoke" if toy else "paper", base, method="powerclip")


def real_batch(a) -> int:
    "A batch every worker fills: 1,195 captions in 16 shards, 2 shards (about 150 samples) a worker at 8 workers."
    return 4 if a.dry_run else 64


def loader_unit(a, workers: int) -> dict:
    "The loader's images/s over one pass of the shards with `workers` worker processes (its start counted apart)."
    from powerclip.train import validate
    from powerclip.data import make_loader
    spec = validate(real_config(a, workers, real_batch(a)), world_size=1).spec
    t0 = time.perf_counter()
    it, n, first = iter(make_loader(spec, pin_memory=str(a.device).startswith("cuda"))), 0, None
    for b in it:
        n += b["image"].shape[0]
        if first is None:
            first, t1, n0 = time.perf_counter() - t0, time.perf_counter(), n
    t = time.perf_counter() - t1 if first is not None else NAN
    rate = (n - n0) / t if first is not None and t > 0 else NAN
    return dict(workers=workers, batch=real_batch(a), images=n, first_batch_s=first, images_per_s=rate,
                per_worker=rate / workers, cores_at_1510=1510 / (rate / workers) if rate > 0 else NAN)


def fed_unit(a) -> dict:
    """PowerCLIP's step fed by the loader (8 workers) for `a.real_seconds`: images/s, and the share of the time the
    GPU waited for data (the host blocked on the loader while the device had nothing queued: each step synchronises)."""
    from powerclip import dist as pdist
    from powerclip.measure import sync
    from powerclip.train import TrainState, build_run
    workers = max(LOADER_WORKERS)
    try:
        with one_model():
            run = build_run(real_config(a, workers, real_batch(a), step=True),
                            pdist.DistContext(device=torch.device(a.device)))
            state, wait, busy, n, steps, epoch = TrainState(), 0.0, 0.0, 0, 0, 0
            it, t0 = iter(run.loader(0)), time.perf_counter()
            run.step(run.prepare(next(it)), state)          # the first (workers' start, kernels' first use) apart
            sync(a.device)
            warm, t_end = time.perf_counter() - t0, time.perf_counter() + a.real_seconds
            while time.perf_counter() < t_end:              # the seconds count from here
                t0 = time.perf_counter()
                b = next(it, None)
                if b is None:                               # the epoch's end: the next one (workers start again)
                    epoch += 1
                    it = iter(run.loader(epoch))
                    continue
                t1 = time.perf_counter()
                run.step(run.prepare(b), state)
                sync(a.device)
                t2 = time.perf_counter()
                wait, busy, n, steps = wait + t1 - t0, busy + t2 - t1, n + b["image"].shape[0], steps + 1
            del run
    finally:
        free_memory(a.device)
    total = wait + busy
    return dict(workers=workers, batch=real_batch(a), steps=steps, images=n, epochs=epoch, first_step_s=warm,
                images_per_s=n / total if total > 0 else NAN, wait_share=wait / total if total > 0 else NAN,
                ms_per_step=1e3 * busy / steps if steps else NAN)


def units_real(a):
    keys = unit_keys("real-shards")
    if real_shards(a) is None:
        return [(keys[0], lambda: dict(skipped=f"no shards in {a.real_shards}: `make real-shards` builds them"))]
    return [(k, lambda w=w: loader_unit(a, w)) for k, w in zip(keys, LOADER_WORKERS)] + [(keys[-1],
                                                                                           lambda: fed_unit(a))]


def report_real(a, values: dict) -> dict:
    skip = next((v["skipped"] for v in values.values() if "skipped" in v), None)
    if skip:
        return dict(headline=f"skipped: {skip}", ok=None, md=[f"Skipped: {skip}."], results=values)
    md = [f"COCO photos (`make real-shards`: ../shared/data/coco_sample's 239 photos and 1,195 captions, one sample "
          f"per caption, 224 px JPEGs in 16 webdataset shards, annotated with spaCy trees and slic regions) read by "
          f"the trainer's loader ({real_shards(a)}), batch {real_batch(a)}: images/s over one pass after the first "
          "batch (the workers' start apart). Then PowerCLIP's step (" + ("the smoke preset's model on the CPU, random "
                                                                         "boxes: dry run" if a.dry_run else
                                                                         "ViT-B/16, bf16, gradient checkpointing, "
                                                                         "class-token pooling, masks: the stored slic "
                                                                         "regions")
          + f") fed by the loader with {max(LOADER_WORKERS)} workers for {a.real_seconds:g} s: images/s and the share "
          "of the time the GPU waited for data (the host waiting on the loader; each step synchronises).", "",
          "Per worker = images/s / workers (the loader's rate per process: benchmarks/loader_throughput.py's "
          "measure on the CPU); cores at 1,510/s = the worker processes one GPU at step-B512's CLIP rate would need "
          "at that rate.", "",
          "| unit | workers | images/s | per worker | cores at 1,510/s | first batch / step s | waits for data |",
          "|---|---:|---:|---:|---:|---:|---:|"]
    head = []
    for k, v in values.items():
        if "error" in v:
            md.append(f"| {k} | {v['error']} | | | | | |")
            continue
        if "wait_share" in v:
            md.append(f"| {k} | {v['workers']} | {v['images_per_s']:.0f} | - | - | {fmt(v['first_step_s'], '.1f')} | "
                      f"{v['wait_share']:.0%} |")
            head.append(f"step fed by the loader {v['images_per_s']:.0f} images/s, waits for data "
                        f"{v['wait_share']:.0%} of the time ({v['steps']} steps)")
        else:
            pw = v.get("per_worker", v["images_per_s"] / v["workers"])
            cores = 1510 / pw if pw > 0 else NAN
            md.append(f"| {k} | {v['workers']} | {v['images_per_s']:.0f} | {pw:.0f} | {fmt(cores, '.1f')} | "
                      f"{fmt(v['first_batch_s'], '.1f')} | - |")
            head.append(f"loader {v['workers']} worker(s) {v['images_per_s']:.0f} images/s ({pw:.0f} per worker)")
    return dict(headline="; ".join(head) + f" (batch {real_batch(a)}, one process)" if head else "-",
                ok=None if not any("error" in v for v in values.values()) else False, md=md, results=values)


# ------------------------------------------------------------------------------------------------ accumulation
def accum_args(a) -> argparse.Namespace:
    """accum_memory.py's settings: ViT-B/16 (the paper preset), 256 per GPU, bf16, without checkpointing, so that the
    activations accumulation saves are there to see (a toy model on the CPU in a dry run)."""
    if a.dry_run:
        return argparse.Namespace(preset="smoke", batch=8, precision="bf16", steps=2, warmup=1,
                                  grad_checkpointing=False, device=a.device, set=["model.pool=tok"], peers=0)
    return argparse.Namespace(preset="paper", batch=256, precision="bf16", steps=4, warmup=1,
                              grad_checkpointing=False, device=a.device, set=["model.pool=tok"], peers=0)


def measure_accum(a, method: str, k: int) -> dict:
    "One method's step at `accum_steps=k` through accum_memory's `measure`, in this process (`one_model`)."
    ns = accum_args(a)
    try:
        with one_model():
            host = host_batches(a, ns, min(N_BATCHES, ns.warmup + ns.steps))
            out = script("accum_memory").measure(method, k, ns, host)
    finally:
        free_memory(a.device)
    return dict(k=k, micro_batch=ns.batch // k, ms_per_step=1e3 * median(out["times"]), spread=spread(out["times"]),
                times=out["times"], peak_mib=out["peak_mib"], peak_of=out.get("peak_of"), model=out["model"],
                images_per_s=ns.batch / median(out["times"]), tower_flops=model_flops())


def units_accum(a):
    return [(key, lambda m=key.split(":")[0], k=int(key.split("=")[1]): measure_accum(a, m, k))
            for key in unit_keys("accum", methods(a))]


def report_accum(a, values: dict) -> dict:
    ns = accum_args(a)
    md = [f"{ns.preset} preset, {a.device}, {ns.batch} per step in k micro-batches (`accum_steps`), {ns.precision}, "
          f"no gradient checkpointing, class-token pooling, one process; the median of {ns.steps} timed steps (the "
          "mean of the middle two) after "
          f"{ns.warmup} warm-up; peak = " + ("what the timed steps allocated above what was there before them (the "
                                              "warm-up not included)" if not a.dry_run else
                                              "the CPU's resident set (dry run: measures nothing)")
          + ". Ratios against k = 1 of the same method.", "",
          "| method | k | micro-batch | ms/step | spread | peak GiB | time / k=1 | memory / k=1 |",
          "|---|---:|---:|---:|---:|---:|---:|---:|"]
    head = []
    for key, r in values.items():
        m = key.split(":")[0]
        if "error" in r:
            md.append(f"| {key} | {r['error']} | | | | | | |")
            continue
        base = values.get(f"{m}:k=1", {})
        tr = r["ms_per_step"] / base["ms_per_step"] if "ms_per_step" in base else NAN
        mr = r["peak_mib"] / base["peak_mib"] if base.get("peak_mib") else NAN
        md.append(f"| {m} | {r['k']} | {r['micro_batch']} | {r['ms_per_step']:.1f} | {fmt(r.get('spread'), '.2f')} | "
                  f"{r['peak_mib'] / 1024:.2f} | {fmt(tr, '.2f')}x | {fmt(mr, '.2f')}x |")
        if r["k"] == max(ACCUM_KS):
            head.append(f"{m} k={r['k']}: time {fmt(tr, '.2f')}x ({r['ms_per_step']:.0f} ms, MFU "
                        f"{L.pct(mfu(r, card_name(a)))}), memory {fmt(mr, '.2f')}x")
    cond = f"256 per step, bf16, no checkpointing, median of {ns.steps} timed steps, peak of the timed steps"
    return dict(headline=("; ".join(head) or f"{len(values)} unit(s)") + f" ({cond})",
                ok=None if not any("error" in r for r in values.values()) else False, md=md, results=values)


# ------------------------------------------------------------------------------------------------ memory
def memory_unit(a, raw: Path) -> dict:
    argv = ["--arch", "powerclip-micro", "--R", "8", "--M", "4"] if a.dry_run else []
    rc = script("paper_memory").main([*argv, "--device", a.device, "--out", str(raw), "--device-bytes", "none"])
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
        return "-" if r is None else format(r.get(f"{k}_cpu", r[k]), spec)
    md = [f"{dev['meta']['arch']}, loss at R = {dev['rows'][0]['R_measured']}, C = 8 R: saved-for-backward bytes "
          f"measured on {dev['meta']['measured_on']} beside those measured on the CPU (results/paper_memory.json's "
          f"own CPU measurement); budget {dev['meta']['gpu_gib']:.0f} GiB less {dev['meta']['reserve']:.0%}.", "",
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
    head += f" (saved-for-backward bytes on this device, budget {dev['meta']['gpu_gib']:.0f} GiB less 10 %)"
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
    if r.returncode:   # 4: a run diverged (its line above), which a rerun repeats
        why = "a run diverged: its line above" if r.returncode == 4 else "run again to continue"
        raise RuntimeError(f"powerclip.compare exited with {r.returncode} ({why})")
    text = (runs / "summary.md").read_text() if (runs / "summary.md").is_file() else "(no summary.md)"
    return dict(command="python -m powerclip.compare " + " ".join(argv), runs=str(runs), summary=text)


def report_compare(a, values: dict) -> dict:
    runs = compare_dir(a)
    done = sorted(str(p.parent.relative_to(runs)) for p in runs.glob("**/train.json")) if runs.is_dir() else []
    v = values.get("compare")
    size = ("its size: every row of the comparison (15, and SPARC's sweep) at 2000 steps, seed 0, bf16: about 30 "
            "minutes on an H100/H200 by the plan's estimate, so it takes what is left of each job (it keeps each run "
            "it finishes and resumes a cut one) and runs over several jobs")
    md = ([f"`{v['command']}` (runs in {v['runs']}); {size}.", "", v["summary"]] if v else
          [f"Not finished: {len(done)} run(s) trained so far under {runs} ({', '.join(done) or 'none'}); the next "
           f"job continues it; {size}."])
    return dict(headline=f"{len(done)} run(s) trained" + ("; summary below" if v else " (several jobs: see below)"),
                ok=None, md=md, results=dict(runs_done=done, summary=v["summary"] if v else None))
