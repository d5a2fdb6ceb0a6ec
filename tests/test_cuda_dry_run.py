"""The GPU code path, run on a simulated CUDA device on a machine without one (issue 22).

`tests/cuda_sim.py` makes tensors that say `cuda:0` and hold real CPU values; every op checks devices as CUDA does, so a
CPU tensor of one or more dimensions that meets a `cuda` one stops the test with CUDA's "Expected all tensors to be on
the same device" (a 0-dim CPU tensor is allowed, as on a GPU). Values are real: data-dependent code runs as it would.

Covered, for every registered method (`powerclip.methods.METHODS`), in fp32 and under `torch.autocast('cuda',
bfloat16)`, through the trainer's own objects (`train.build_run` with a `cuda:0` context, `Run.prepare`, `Run.step`):

* `model.to(device)` and the method's modules on the device; the batch's host-to-device copies (`to_device`,
  non-blocking, from the training loader's page-locked batches: `Run.loader` pins memory on CUDA, and the simulation
  counts the pins and the copies that come from pinned memory);
* the forward pass as the method defines it, every loss term, the sum the trainer takes, the all-mean for logging and
  the finite checks (`.item()`/`bool()` syncs);
* backward: every node of the autograd graph runs its own backward formula on the simulated device (the C++ formulas,
  the custom `autograd.Function`s of `powerset_fast`, activation checkpointing's recomputation), through
  `cuda_sim.sim_backward`, a small engine in Python, because autograd's C++ engine needs a CUDA driver for a graph that
  holds `cuda` tensors ("hasPrimaryContext expects a valid device index"). Checked: each gradient's dtype and shape
  against the node's record, its device by every op that meets it and at the leaf. Not covered: the engine's streams,
  events and device threads (the GPU-only part of the engine);
* `clip_grad_norm_` and AdamW with the multi-tensor (foreach) kernels a GPU run takes, the temperature clamp, the
  schedule; the values match the same step on the CPU (fp32);
* PowerCLIP's loss on each path (`impl` dense, fast, auto; exact enumeration), with region masks from boxes and from
  the world's gold masks, tree and word nodes, and with gradient checkpointing; every method that allows it with
  `model.pool=avg`; the anatomy's two-term gradients (`experiments.term_gradients`, through `torch.autograd.grad`);
  with POWERCLIP_SLOW=1, the `paper` preset itself (ViT-B/16, avg pooling, checkpointing, precision auto: bf16);
* a planted CPU tensor in a loss, and one in a custom backward, are caught (while the same code runs on the CPU);
* the evaluator (`eval.models.load_model(device='cuda')`, `Evaluator`: `encode_images`, `encode_texts`, `scores`,
  `pair_scores`, `dataset_features` with its pinned-memory DataLoader) for every scorer of every method, fp32 and bf16;
* the heatmaps (`image_heatmaps`, `grounding_score` of a model on `cuda`);
* `dist`: `init_distributed` under torchrun's environment chooses NCCL and `cuda:LOCAL_RANK`, `wrap_ddp` passes that
  device; and every method's loss with a faked two-process NCCL group (collectives copy this process's tensors and
  refuse any that is not on `cuda`, as NCCL does): `gather`'s shape exchange, padding and packing, `all_mean`,
  `all_sum`, `all_max`, the gradient through `all_gather` (reduce-scatter).

The simulation runs the step's values on the CPU (the fp32 step equals the CPU's, checked below), so a test here takes
about a second; the whole file about a minute on 2 cores.

Not covered (a GPU day checks them): CUDA kernels themselves (flash / memory-efficient attention: the simulation takes
the math path), their numerics in bf16 (CPU kernels compute here), memory and speed, streams, a real NCCL and
DistributedDataParallel's bucketing, `torch.compile` on CUDA, checkpoint files written from `cuda` tensors
(`torch.save`) and reading them back with `map_location='cuda'` (`experiments.loss_anatomy` does), CUDA's random
generators (the CPU's draw here), the trainer's loop around the step (`train`: checkpoints, logging, resume).
"""
import contextlib
import math
import os
from unittest import mock

import numpy as np
import pytest
import torch
import torch.distributed as td

from cuda_sim import SimCuda, SimDeviceMismatch, sim_backward, sim_cuda
from powerclip import dist as pdist
from powerclip.methods import CLIP, METHODS, _import_baselines, register
from powerclip.train import TrainState, build_run, load_config

_import_baselines()
ALL = sorted(m for m in METHODS if not m.startswith("_"))
CUDA = torch.device("cuda", 0)
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: make gpu-check runs the real thing")


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _run(method, precision="fp32", device=CUDA, overrides=(), ctx=None):
    "build_run of the smoke preset on `device` and one prepared batch (the trainer's own objects)."
    cfg = load_config("smoke", ["resume=never", f"precision={precision}", *overrides], method=method)
    run = build_run(cfg, ctx or pdist.DistContext(device=device))
    loader = run.loader()
    assert loader.dataloader.pin_memory == (run.ctx.device.type == "cuda")   # the copies below can overlap compute
    batch = run.prepare(next(iter(loader)))
    return run, batch


def _on_cuda(t) -> bool:
    return isinstance(t, SimCuda) and t.device == CUDA


def _step(method, precision, overrides=()):
    "One training step as the trainer runs it, on the simulated GPU: (run, batch, step output, stats, params before)."
    with sim_cuda() as st:
        run, batch = _run(method, precision, overrides=overrides)
        run.method.on_step(0, run.total)
        before = [p.detach().clone() for p in run.model.parameters()]
        out = run.step(batch, TrainState())
        out = {k: v.cpu() if torch.is_tensor(v) else v for k, v in out.items()}   # what the trainer logs, on the host
        assert not any(isinstance(v, SimCuda) for v in out.values())
    return run, batch, out, st, before


# ------------------------------------------------------------------------------------------------ the training step
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("method", ALL)
def test_training_step_on_cuda(method, precision):
    run, batch, out, st, before = _step(method, precision)
    # model, method modules, batch on the device; the batch moved by non-blocking copies
    tensors = [*run.model.parameters(), *run.model.buffers()]
    if run.modules is not None:
        tensors += [*run.modules.parameters(), *run.modules.buffers()]
    assert all(_on_cuda(t) for t in tensors)
    assert all(_on_cuda(v) for v in batch.values() if torch.is_tensor(v))
    assert st.h2d_non_blocking >= sum(torch.is_tensor(v) for v in batch.values())
    assert st.pinned > 0 and st.h2d_pinned > 0                  # from the loader's page-locked batches
    # the step was taken: finite loss, every gradient and optimiser moment on the device, weights moved
    assert out["ok"] and math.isfinite(float(out["loss"])) and math.isfinite(float(out["grad_norm"]))
    grads = [p.grad for p in run.opt.param_groups[0]["params"] + run.opt.param_groups[-1]["params"]
             if p.grad is not None]
    assert grads and all(_on_cuda(g) for g in grads)
    moments = [s[k] for s in run.opt.state.values() for k in ("exp_avg", "exp_avg_sq")]
    assert moments and all(_on_cuda(m) for m in moments)
    assert any(not torch.equal(p.detach().cpu(), b.cpu()) for p, b in zip(run.model.parameters(), before))
    assert any("_foreach_" in n for n in st.op_names)                       # AdamW / clip_grad_norm_ as on a GPU
    if precision == "bf16":
        assert st.bf16_ops > 0                          # autocast('cuda') was on
    else:
        assert st.bf16_ops == 0


@pytest.mark.parametrize("method", ["clip", "powerclip", "filip", "sparc", "smartclip", "c2lip", "aclip"])
def test_simulated_step_equals_the_cpu_step(method):
    "fp32: the simulation computes what the CPU computes (it only adds device checks), loss, terms and gradients."
    run, _, out, _, before = _step(method, "fp32")
    cpu, batch = _run(method, "fp32", torch.device("cpu"))
    cpu.method.on_step(0, cpu.total)
    ref = cpu.step(batch, TrainState())
    for k in ref:
        if k == "ok":
            continue
        torch.testing.assert_close(torch.as_tensor(out[k]).double(), torch.as_tensor(ref[k]).double(), rtol=2e-4,
                                   atol=1e-5, msg=k)
    for p, q in zip(run.model.parameters(), cpu.model.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if q.grad is not None:    # other kernels (attention's math path, multi-tensor sums): rounding-level differences
            torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-3, atol=1e-4 * float(q.grad.abs().max()) + 1e-8)
    # AdamW's first step is about lr * sign(g): a gradient near 0 can move its weight differently; the update as a whole
    # is the same
    d_sim = torch.cat([(p.detach().cpu() - b.cpu()).flatten() for p, b in zip(run.model.parameters(), before)])
    d_cpu = torch.cat([(q.detach() - b.cpu()).flatten() for q, b in zip(cpu.model.parameters(), before)])
    assert float((d_sim - d_cpu).norm() / d_cpu.norm()) < 0.02


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("overrides", [["method_cfg.impl=dense"], ["method_cfg.impl=fast"],
                                       ["method_cfg.impl=fast", "method_cfg.block_bytes=4096"],
                                       ["method_cfg.exact=true"], ["method_cfg.masks=gold"], ["method_cfg.nodes=words"],
                                       ["model.grad_checkpointing=true"]], ids=lambda o: " ".join(o))
def test_powerclip_loss_paths_on_cuda(overrides, precision):
    run, _, out, st, _ = _step("powerclip", precision, overrides)
    assert out["ok"] and math.isfinite(float(out["powerset"])) and float(out["powerset"]) > 0


@pytest.mark.parametrize("method", [m for m in ALL if "avg" in getattr(METHODS[m], "pools", ())])
def test_average_pooling_step_on_cuda(method):
    "`model.pool=avg` (mean of the patch and caption tokens, `30_model`) for every method that allows it, bf16."
    _, _, out, _, _ = _step(method, "bf16", ["model.pool=avg"])
    assert out["ok"] and math.isfinite(float(out["loss"]))


@pytest.mark.skipif(not os.environ.get("POWERCLIP_SLOW"), reason="minutes (ViT-B/16 on the CPU): "
                                                                 "POWERCLIP_SLOW=1 runs it")
def test_paper_preset_step_on_cuda():
    """The paper's run as users start it: ViT-B/16 at 224 px, avg pooling, gradient checkpointing, M = 10, precision
    auto (bf16 on a GPU)."""
    over = ["data.source=world", "data.batch_size=2", "data.world_length=8", "global_batch_size=null",
            "data.workers=0", "max_steps=10"]
    cfg = load_config("paper", ["resume=never", *over], method="powerclip")
    assert cfg.precision == "auto" and cfg.model.grad_checkpointing and cfg.model.name == "ViT-B-16"
    with sim_cuda() as st:
        run = build_run(cfg, pdist.DistContext(device=CUDA))
        out = run.step(run.prepare(next(iter(run.loader()))), TrainState())
        out = {k: float(v) for k, v in out.items()}
    assert out["ok"] and math.isfinite(out["powerset"]) and st.bf16_ops > 0


# ------------------------------------------------------------------------------------------------ planted bugs
class _CpuOnes(CLIP):
    "CLIP whose loss meets a CPU tensor: runs on the CPU, fails on a GPU."
    def loss(self, out, batch, dist):
        terms = super().loss(out, batch, dist)
        terms["clip"] = (terms["clip"] + torch.ones(1)).sum()                # torch.ones(1): on the CPU, one dimension
        return terms


class _CpuInBackward(torch.autograd.Function):
    "Identity whose backward multiplies by a mask made on the CPU."
    @staticmethod
    def forward(ctx, x): return x.clone()
    @staticmethod
    def backward(ctx, g): return g * torch.ones(g.shape[-1])


class _CpuBackward(CLIP):
    def forward(self, model, batch, modules=None):
        out = super().forward(model, batch, modules)
        out["image"] = _CpuInBackward.apply(out["image"])
        return out


class _CpuScalar(CLIP):
    "A 0-dim CPU tensor is legal on a GPU (CUDA kernels take CPU scalars): the simulation must not refuse it."
    def loss(self, out, batch, dist):
        terms = super().loss(out, batch, dist)
        terms["clip"] = terms["clip"] * torch.tensor(1.0)
        return terms


for _name, _cls in (("_planted_cpu_ones", _CpuOnes), ("_planted_cpu_backward", _CpuBackward),
                    ("_cpu_scalar", _CpuScalar)):
    if _name not in METHODS:
        register(_name)(_cls)


@pytest.mark.parametrize("method,where", [("_planted_cpu_ones", "aten.add"), ("_planted_cpu_backward", "aten.mul")])
def test_a_planted_cpu_tensor_is_caught(method, where):
    cpu, batch = _run(method, "fp32", torch.device("cpu"))
    assert cpu.step(batch, TrainState())["ok"]                              # the CPU never notices
    for precision in ("fp32", "bf16"):
        with pytest.raises(SimDeviceMismatch, match="cuda:0 and cpu|cpu and cuda:0") as e:
            _step(method, precision)
        assert where in str(e.value)


def test_a_cpu_scalar_is_not_a_mismatch():
    _, _, out, _, _ = _step("_cpu_scalar", "fp32")
    assert out["ok"]


def test_sim_backward_is_autograd():
    "The engine in Python gives autograd's gradients (CPU, no simulation): PowerCLIP's step, fast path, checkpointing."
    grads = []
    for engine in ("autograd", "sim"):
        run, batch = _run("powerclip", "fp32", torch.device("cpu"),
                          ["method_cfg.impl=fast", "model.grad_checkpointing=true"])
        from powerclip.train import forward_loss
        loss, _ = forward_loss(run.fwd, run.method, batch, run.ctx, "fp32")
        if engine == "sim":
            assert sim_backward(loss) > 50
        else:
            loss.backward()
        grads.append([p.grad for p in run.model.parameters()])
        if engine == "sim":  # torch.autograd.grad by hand too
            loss, _ = forward_loss(run.fwd, run.method, batch, run.ctx, "fp32")
            g = sim_backward(loss, inputs=list(run.model.parameters()))
            for a, b in zip(g, grads[0]):
                if b is None:
                    assert a is None
                else:
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    for a, b in zip(*grads):
        if a is None:
            assert b is None
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_experiments_term_gradients_on_cuda():
    "The anatomy's two-term gradients (torch.autograd.grad, a mask built on S-bar's device: the bug found by reading)."
    from powerclip.experiments import term_gradients
    with sim_cuda():
        run, batch = _run("powerclip", "fp32")
        res = term_gradients(run, batch)
    assert all(math.isfinite(v) for v in res.values())


# ------------------------------------------------------------------------------------------------ evaluation, heatmaps
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("method", ALL)
def test_evaluator_every_scorer_on_cuda(method, precision):
    from powerclip.eval.models import Evaluator, load_model
    x, texts = torch.randn(5, 3, 32, 32), ["a red cube", "two blue balls left of a cube", "a green sphere", "x", "dog"]
    with sim_cuda() as st:
        lm = load_model("powerclip-micro", method=method, device="cuda")
        assert all(_on_cuda(p) for p in lm.model.parameters())
        if lm.modules is not None:
            assert all(_on_cuda(p) for p in lm.modules.parameters())
        ev = Evaluator.of(lm, None, device="cuda", precision=precision, progress=False)
        for name in lm.scorers:
            img, txt = ev.encode_images(x, name), ev.encode_texts(texts, name)
            # features come back to the host
            assert all(not isinstance(v, SimCuda) for v in [*img.values(), *txt.values()])
            S = ev.scores(img, txt, name)
            P = ev.pair_scores(img, txt, [0, 1, 4], [0, 2, 4], name)
            f, y = ev.dataset_features(lambda: torch.utils.data.TensorDataset(x, torch.arange(5)), [method, name], name)
            assert S.shape == (5, 5) and torch.isfinite(S).all() and not isinstance(S, SimCuda)
            assert torch.allclose(P, S[[0, 1, 4], [0, 2, 4]]) and len(y) == 5
    assert st.pinned > 0 and st.h2d_pinned > 0                              # the data set's batches were pinned


def test_heatmaps_on_cuda():
    from powerclip.heatmaps import _loaded, grounding_score, image_heatmaps, model_heat_fn
    with sim_cuda():
        lm = _loaded("random:powerclip-micro", device="cuda")
        h = image_heatmaps(lm, np.zeros((40, 40, 3), np.uint8), ["a red cube", "a ball"])
        r = grounding_score(model_heat_fn(lm.model, lm.tokenizer), n_scenes=3)
    assert h.shape == (2, 4, 4) and not isinstance(h, SimCuda) and math.isfinite(r["pointing"])


# ------------------------------------------------------------------------------------------------ distributed
def test_torchrun_on_gpus_chooses_nccl_and_the_local_gpu(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    calls = {}
    with sim_cuda(), mock.patch.object(torch.cuda, "set_device", lambda d: calls.setdefault("set_device", d)), \
         mock.patch.object(td, "is_initialized", lambda: False), mock.patch.object(td, "get_rank", lambda *a: 1), \
         mock.patch.object(td, "get_world_size", lambda *a: 2), \
         mock.patch.object(td, "init_process_group", lambda **k: calls.setdefault("init", k)):
        ctx = pdist.init_distributed("cuda")
    assert calls["init"]["backend"] == "nccl" and ctx.backend == "nccl"
    assert ctx.device == torch.device("cuda", 1) and calls["set_device"] == torch.device("cuda", 1)
    assert (ctx.rank, ctx.world_size, ctx.local_rank) == (1, 2, 1)
    with mock.patch("torch.nn.parallel.DistributedDataParallel", lambda m, **k: ("ddp", k)):
        assert pdist.wrap_ddp(torch.nn.Linear(2, 2), ctx) == ("ddp", dict(device_ids=[1], find_unused_parameters=False))


@contextlib.contextmanager
def _fake_nccl(world: int = 2, rank: int = 0):
    """A process group of `world` processes that all hold this process's tensors, with NCCL's rule: every tensor of a
    collective is on the GPU."""
    def cuda_only(*ts):
        for t in ts:
            if not _on_cuda(t):
                raise RuntimeError(f"NCCL: a tensor of a collective is on {t.device}, not on the GPU")

    def all_gather(out, x, group=None, async_op=False):
        cuda_only(x, *out)
        for o in out:
            o.copy_(x)

    def all_reduce(x, op=td.ReduceOp.SUM, group=None, async_op=False):
        cuda_only(x)
        if op == td.ReduceOp.SUM:
            x.mul_(world)

    def reduce_scatter(out, inputs, op=td.ReduceOp.SUM, group=None, async_op=False):
        cuda_only(out, *inputs)
        out.copy_(inputs[rank] * world)

    patches = dict(is_available=lambda: True, is_initialized=lambda: True, get_world_size=lambda *a, **k: world,
                   get_rank=lambda *a, **k: rank, get_backend=lambda *a, **k: "nccl", all_gather=all_gather,
                   all_reduce=all_reduce, reduce_scatter=reduce_scatter, barrier=lambda *a, **k: None,
                   all_gather_object=lambda out, obj, group=None: out.__setitem__(slice(None), [obj] * world))
    with contextlib.ExitStack() as s:
        for k, v in patches.items():
            s.enter_context(mock.patch.object(td, k, v))
        yield pdist.DistContext(rank=rank, world_size=world, local_rank=rank, device=CUDA, backend="nccl")


@pytest.mark.parametrize("method", ALL)
def test_every_loss_with_a_two_gpu_nccl_group(method):
    "The loss of a data-parallel step: gathered batches, collectives on the GPU, gradients back through all_gather."
    from powerclip.train import forward_loss
    with sim_cuda():
        run, batch = _run(method, "bf16")
        run.method.on_step(0, run.total)
        with _fake_nccl() as ctx:
            loss, terms = forward_loss(run.fwd, run.method, batch, ctx, "bf16")
            assert _on_cuda(loss) and math.isfinite(float(pdist.all_mean(loss.float())))
            loss.backward()
            assert pdist.all_max(3) == 3 and _on_cuda(pdist.all_sum(torch.ones(2, device=CUDA)))
            g = pdist.gather(ctx,
                             {"x": torch.ones(3, 2, device=CUDA), "m": torch.ones(3, 4, dtype=torch.bool, device=CUDA)},
                             pad={"m": {1: False}})
            assert g.all["x"].shape == (6, 2) and _on_cuda(g.all["m"])
    assert all(_on_cuda(p.grad) for p in run.model.parameters() if p.grad is not None)


def test_skip_counts_summed_on_the_gpu():
    "The shard skip counts are summed over processes on the device (`train._skip_columns`)."
    from powerclip.data import SAMPLE_SKIP_REASONS
    from powerclip.train import _skip_columns
    with sim_cuda(), _fake_nccl() as ctx:
        cols = _skip_columns({SAMPLE_SKIP_REASONS[0]: 2}, {}, ctx)
    assert cols["skipped"] == 4 and cols["skipped_cum"] == 4
