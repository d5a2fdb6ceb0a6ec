"""The baseline methods (FILIP, SPARC, FLIP, SmartCLIP) through the trainer's own code paths.

1. They are in the registry once `powerclip.baselines` modules are imported, and their configs reject bad options.
2. Two CPU processes (gloo), each with half the batch, give the mean loss and the parameter gradients of one
   process on the whole batch (float64, 1e-9): the gathering of FILIP and SmartCLIP, the per-pair loss of SPARC.
3. A few trainer steps of each method on the built-in world run and log finite losses.
"""
import math, os, socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import powerclip.baselines.filip, powerclip.baselines.flip, powerclip.baselines.smartclip, powerclip.baselines.sparc  # noqa: F401 (registers)
from powerclip.methods import METHODS, get_method

DDP_METHODS = ("filip", "sparc", "smartclip")
B = 4  # rows per process


def test_registered_and_configs_checked():
    assert {"filip", "sparc", "flip", "smartclip"} <= set(METHODS)
    assert get_method("sparc", {"lambda_fine": 0.5}).cfg.lambda_fine == 0.5
    with pytest.raises(ValueError, match="unknown option"): get_method("filip", {"chunks": 2})
    with pytest.raises(ValueError, match="ratio"): get_method("flip", {"ratio": 1.0})
    with pytest.raises(ValueError, match="threshold"): get_method("sparc", {"threshold": 2.0})


def test_registry_imports_baselines_on_demand():
    "The trainer imports only powerclip.methods: asking for a baseline by name must find it."
    import subprocess, sys
    code = "from powerclip.methods import get_method; print(sorted(type(get_method(n)).__name__ for n in ('filip', 'sparc', 'flip', 'smartclip')))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "['FILIP', 'FLIP', 'SPARC', 'SmartCLIP']"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); return s.getsockname()[1]


def _data_cfg(batch_size):
    from powerclip.data import DataConfig
    return DataConfig(batch_size=batch_size, workers=0, world_length=64, M=4, image_size=32, masks="random")


def _step(method_name, batch, ctx):
    "Loss and gradients of one step, as powerclip.train computes them."
    import powerclip.baselines.filip, powerclip.baselines.smartclip, powerclip.baselines.sparc  # noqa: F401
    from powerclip.dist import wrap_ddp
    from powerclip.model import create_model
    from powerclip.train import MethodForward, loss_terms, to_device
    torch.manual_seed(0)
    model = create_model("powerclip-micro")[0]
    method = get_method(method_name, {"filip": {"clip_weight": 0.5}, "smartclip": {"heads": 2}}.get(method_name))
    method.setup_model(model)  # SmartCLIP's mask network: same seed, same initial weights on every process
    model = model.double()
    fwd = wrap_ddp(MethodForward(model, method), ctx)
    batch = to_device(method.prepare_batch(batch), ctx.device)
    batch["image"] = batch["image"].double()
    loss, terms = loss_terms(fwd, method, batch, ctx, "fp32")
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _worker(rank, world, port, out):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from powerclip.data import make_loader
    from powerclip.dist import all_mean, cleanup, init_distributed
    ctx = init_distributed("cpu")
    batch = next(iter(make_loader(_data_cfg(B), epoch=0, rank=rank, world_size=world)))
    res = {}
    for m in DDP_METHODS:
        loss, grads = _step(m, batch, ctx)
        res[m] = (all_mean(loss), grads)
    if rank == 0: torch.save(res, out)
    cleanup(ctx)


def test_two_processes_equal_one():
    # fork, not spawn: the children inherit the imported open_clip instead of importing it again (~20 s each)
    import powerclip.model  # noqa: F401
    from powerclip.data import make_loader
    from powerclip.dist import DistContext
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"ddp_baselines_{os.getpid()}.pt"
    mp.start_processes(_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True, start_method="fork")
    res = torch.load(out, weights_only=False); out.unlink()
    full = next(iter(make_loader(_data_cfg(2 * B), epoch=0)))  # the same 8 samples in one batch
    for m in DDP_METHODS:
        loss1, grads1 = _step(m, full, DistContext())
        loss2, grads2 = res[m]
        torch.testing.assert_close(loss2, loss1, rtol=0, atol=1e-9, msg=f"{m}: loss")
        assert grads1.keys() == grads2.keys() and len(grads1) > 10
        for n in grads1:
            d = (grads2[n] - grads1[n]).abs().max() / grads1[n].abs().max().clamp_min(1e-12)
            assert d < 1e-9, f"{m}: grad of {n} differs by {float(d):.2e} relative to its largest entry"


@pytest.mark.parametrize("method,terms", [("filip", ["filip"]), ("sparc", ["clip", "sparc_fine"]), ("flip", ["clip"]),
                                          ("smartclip", ["modular", "sparsity"])])
def test_trainer_steps(tmp_path, method, terms):
    from powerclip.train import load_config, read_metrics, train
    train(load_config("smoke", {"out_dir": str(tmp_path), "max_steps": 2, "optim.warmup_steps": 1}, method=method))
    rows = read_metrics(tmp_path / "metrics.csv")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        for k in ["loss"] + terms: assert math.isfinite(r[k]), (k, r)
