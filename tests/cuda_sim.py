"""A simulated CUDA device for checking the GPU code path on a machine without one (tests/test_cuda_dry_run.py).

A `SimCuda` tensor holds a real CPU tensor and says it lives on `cuda:0`. Inside `sim_cuda()`:

* every aten op sees the devices of its tensors as a GPU run would: a CPU tensor of one or more dimensions that
  meets a `cuda` one raises the error CUDA raises ("Expected all tensors to be on the same device ... cuda:0 and
  cpu!"); 0-dim CPU tensors mix, as on a GPU; `copy_`, `.to(device)`, CPU index tensors into a `cuda` tensor and
  the other ops a GPU lets cross devices do so (the rules of `torch._subclasses.fake_tensor`, whose device logic this
  mirrors: `_find_common_device`, `index_tensor`, `index_put_impl`, `multi_device_op_default`);
* factories with `device='cuda'` (`torch.zeros(..., device=x.device)`, `x.new_ones`, `torch.randn_like`, ...) make
  `SimCuda` tensors, and `.to('cuda', non_blocking=True)` moves a CPU tensor there (counted in `SimStats`, with
  whether its source was pinned);
* `torch.autocast('cuda', dtype=torch.bfloat16)` casts as it does on a GPU (a `SimCuda` tensor carries CUDA's
  dispatch keys, AutocastCUDA among them), so the bf16 path is exercised too;
* the values are real: the op runs on the CPU tensors, so data-dependent code (`.item()`, `bool(t)`,
  `nonzero`, boolean masks, `.tolist()`) runs as it would on a GPU. This is why the simulation is not
  `FakeTensorMode`: fake tensors have no values, and half the methods ask their tensors a question;
* host syncs are counted with where they came from (`sync_sites`: the first frame outside torch), so that a test can
  bound them per training step (`counted()` counts a section, e.g. `Run.step`), in four kinds: `scalars` (`.item()`,
  `bool()`, `int()` of a cuda tensor), `d2h` (a copy to the host, `.tolist()`), `shape` (an op whose output's size
  depends on the data, so the host waits for the device to learn it: `nonzero`, and `argwhere` and one-argument
  `torch.where`, which call it; indexing with a boolean mask, `x[mask]`, and `x[mask] = t` unless CUDA turns it into
  `masked_fill_` (one mask on the tensor's device, a one-element value on the CPU); `masked_select`; `bincount`, whose
  `minlength` does not bound its size; `repeat_interleave` without `output_size`; `unique`, `unique_consecutive`)
  and `h2d_blocking` (a copy from the host made without `non_blocking=True`, such as `torch.tensor(list,
  device='cuda')`, or a CPU index tensor into a cuda tensor, which ATen copies: CUDA's copy then waits for the
  stream);
* `torch.autocast` regions are tracked: an op on `cuda` whose result is bf16 / fp16 inside a region that the code
  opened with `enabled=False` but that left CUDA's autocast on (a hard-coded `autocast('cpu', enabled=False)`: float32
  on the CPU, bf16 on a GPU) is counted in `SimStats.autocast_leaks` with the region's site. Regions torch opens itself
  (checkpointing restores the CPU's autocast state) are not the code's and are left out.

Backward: autograd's C++ engine cannot run a graph that holds `cuda` tensors without a CUDA driver (it asks the
driver whether device 0 has a context: "hasPrimaryContext expects a valid device index"). `sim_backward` is a small
engine in Python instead: it walks the graph from the loss (`grad_fn.next_functions`), calls every node's own
backward formula (`node(*grads)`, the formulas the C++ engine calls; a custom `autograd.Function`'s `backward`;
activation checkpointing's recomputation), checks every gradient against the metadata the node recorded
(`_input_metadata`: dtype, shape and device, as the engine's `validate_outputs` does, including its cast of dtypes and
its device rule: a 0-dim gradient on another device than the input's is moved there, any other is "invalid gradient
... expected device cuda:0 but got cpu") and accumulates the leaves' `.grad`. What it does not do: the engine's CUDA
streams and events (each node's stream, the synchronisation between streams), its device threads, tensor and node
hooks (none in this project's training step outside DDP, which is not simulated), reentrant checkpointing.

What `sim_cuda()` changes in the process while it is open, so that code written for a GPU runs on without one:
`torch.cuda`'s queries (`_CUDA_API`: `is_available()` True, `device_count`, `current_device`, `set_device`,
`synchronize`, the memory counters (0), `get_device_name`, `get_device_capability`, `get_device_properties` (an
80 GiB GPU), `is_bf16_supported`, `is_current_stream_capturing` False), each only where this torch release has it;
the optimisers' CUDA-graph capture
health checks (`Optimizer.*graph_capture_health_check`, whatever a release calls it: torch 2.11's AdamW asks
`torch.cuda.is_current_stream_capturing()`, which reaches the CUDA runtime) do nothing; no simulated code asks the CUDA
runtime anything (tests/test_cuda_dry_run.py runs a step with every `torch._C._cuda_*` refusing); `Tensor.to('cuda')`
gets the index 0 (C++ would ask the driver for the current device); `Tensor.backward`, `torch.autograd.backward` and
`torch.autograd.grad` go to `sim_backward`; `module.to()` replaces parameters instead of assigning `.data`; the
optimisers' and `clip_grad_norm_`'s multi-tensor (foreach) paths accept SimCuda tensors, as they take them on a GPU;
`torch.tensor(..., device='cuda')` is made on the CPU and then moved (as under FakeTensorMode). For the rest of the
process (on a machine without CUDA only): CUDA's device guard is a no-op (`torch._C._ensureCUDADeviceGuardSet`, what
FakeTensorMode does), so autograd's per-tensor stream bookkeeping asks no driver. The mode sits in the dispatcher's
FAKE slot, which tells C++ to skip CUDA's lazy initialisation; code that looks for a FakeTensorMode there
(`torch.compile`, `torch.load` of fake tensors) must not run inside `sim_cuda()`.

Not simulated at all: kernels (CUDA's flash/memory-efficient attention become the math path: `_fused_sdp_choice`
answers math), memory, speed, numerics of CUDA kernels (the CPU's run), streams, NCCL (a test fakes the process
group), CUDA's random generators (the CPU's draw), `torch.save` of SimCuda tensors.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import types
from collections import Counter, defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

aten = torch.ops.aten
CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")


class SimDeviceMismatch(RuntimeError):
    "A CPU tensor met a `cuda` one where a GPU would refuse it."


@dataclasses.dataclass
class SimStats:
    "What the simulation saw (read by the tests)."
    ops: int = 0                       # aten ops that touched a `cuda` tensor
    h2d: int = 0                       # CPU -> cuda copies
    h2d_non_blocking: int = 0          # ... of them non_blocking
    h2d_pinned: int = 0                # ... of them from pinned memory
    pinned: int = 0                    # tensors pinned (`pin_memory()`)
    d2h: int = 0                       # cuda -> CPU copies (a host sync on a GPU)
    scalars: int = 0                   # `.item()` / `bool()` of a cuda tensor (a host sync on a GPU)
    shape: int = 0                     # ops on cuda whose output size depends on the data (a host sync on a GPU)
    h2d_blocking: int = 0              # CPU -> cuda copies without non_blocking (CUDA waits for the stream)
    bf16_ops: int = 0                  # ops on cuda with a bfloat16 result (autocast at work)
    op_names: set = dataclasses.field(default_factory=set)
    # where each host sync came from: 'scalar' / 'd2h' / 'shape (op)' / 'h2d_blocking' at the first frame outside
    # torch ('path:line in function')
    sync_sites: Counter = dataclasses.field(default_factory=Counter)
    # ops on cuda with a bf16 / fp16 result inside a `torch.autocast(..., enabled=False)` that left CUDA's autocast
    # on (a hard-coded `autocast('cpu', enabled=False)`): (where the region was entered, op) -> count
    autocast_leaks: Counter = dataclasses.field(default_factory=Counter)

    @property
    def syncs(self) -> int:
        "Host syncs of every kind."
        return self.scalars + self.d2h + self.shape + self.h2d_blocking

    def add(self, other: SimStats) -> None:
        "Add `other`'s counts to these (a section's counts back into the run's)."
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if isinstance(a, set):
                a |= b
            elif isinstance(a, Counter):
                a.update(b)
            else:
                setattr(self, f.name, a + b)


STATS = SimStats()
_REAL_GPU = torch.cuda.is_available()   # asked once, at import: inside the simulation nothing asks the CUDA runtime


@contextlib.contextmanager
def counted():
    "Inside `sim_cuda()`: a fresh `SimStats` for the section (a training step), added to the run's at the end."
    global STATS
    outer, STATS = STATS, SimStats()
    try:
        yield STATS
    finally:
        mine, STATS = STATS, outer
        outer.add(mine)


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_SKIP_FILES = (__file__, contextlib.__file__)
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _site(depth: int = 2) -> str:
    "The first frame of the caller's stack outside torch and this module: 'path:line in function' (path from the repo)."
    f = sys._getframe(depth)
    while f is not None and (f.f_code.co_filename.startswith(_TORCH_DIR) or f.f_code.co_filename in _SKIP_FILES
                             or "unittest" + os.sep + "mock" in f.f_code.co_filename):
        f = f.f_back
    if f is None:
        return "?"
    path = f.f_code.co_filename
    path = path[len(_ROOT):] if path.startswith(_ROOT) else path
    return f"{path}:{f.f_lineno} in {f.f_code.co_name}"


def _sync(kind: str, what: str = "") -> None:
    "Count a host sync of `kind` ('scalar', 'd2h', 'shape', 'h2d_blocking'; `what`: the op) and where it came from."
    field = "scalars" if kind == "scalar" else kind
    setattr(STATS, field, getattr(STATS, field) + 1)
    STATS.sync_sites[f"{kind}{f' ({what})' if what else ''} at {_site(3)}"] += 1


# ops whose output's size depends on the values of their input: CUDA computes it on the device and the host waits
_SHAPE_SYNC = {aten.nonzero.default, aten.masked_select.default, aten.bincount.default, aten._unique.default,
               aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default,
               aten.unique_dim_consecutive.default}
_INDEX_PUT = {aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


def _is_mask(i) -> bool:
    return isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)


def _shape_sync(func, args, kwargs) -> bool:
    """Whether the op, on cuda, waits for the device to size its output (see the module's docstring): the ops of
    `_SHAPE_SYNC`, `repeat_interleave` without `output_size`, and boolean-mask indexing (`index_put` with a mask only
    where CUDA cannot make it a `masked_fill_`: ATen's `canDispatchToMaskedFill`)."""
    if func in _SHAPE_SYNC:
        return True
    if func is aten.repeat_interleave.Tensor:
        return kwargs.get("output_size", args[1] if len(args) > 1 else None) is None
    if func is aten.index.Tensor or func in _INDEX_PUT:
        indices = [i for i in (args[1] if len(args) > 1 else kwargs["indices"]) if i is not None]
        if not any(_is_mask(i) for i in indices):
            return False
        if func is aten.index.Tensor:
            return True
        value = args[2] if len(args) > 2 else kwargs["values"]
        fill = (len(indices) == 1 and _dev(indices[0]) == _dev(args[0]) and value.numel() == 1
                and _dev(value).type == "cpu")
        return not fill
    return False


def _cpu_index(func, args, kwargs) -> bool:
    "An indexing op on a cuda tensor with an index tensor (not 0-dim, not a mask) on the CPU: ATen copies it over."
    if func is not aten.index.Tensor and func not in _INDEX_PUT:
        return False
    indices = args[1] if len(args) > 1 else kwargs["indices"]
    return _dev(args[0]).type == "cuda" and any(isinstance(i, torch.Tensor) and not _is_mask(i) and i.dim() > 0
                                                 and _dev(i).type == "cpu" for i in indices if i is not None)


# ------------------------------------------------------------------------------------------------ the tensor
class SimCuda(torch.Tensor):
    """A real CPU tensor (`_host`) that says it is on cuda:0. As `FakeTensor` does, the C++ tensor is a `meta` tensor
    with CUDA's dispatch keys (autocast, autograd), so that nothing in C++ asks the CUDA runtime about it; Python sees
    `device == cuda:0`, and every op lands in `__torch_dispatch__`, which runs it on `_host`."""
    _host: torch.Tensor

    @staticmethod
    def __new__(cls, real: torch.Tensor, requires_grad: bool | None = None):
        if isinstance(real, SimCuda):
            raise TypeError("SimCuda of a SimCuda")
        if real.device.type != "cpu":
            raise TypeError(f"SimCuda holds a CPU tensor, got {real.device}")
        with torch._C._DisableTorchDispatch():
            n = max(real.untyped_storage().nbytes() // max(real.element_size(), 1), real.storage_offset() + 1)
            meta = torch.empty(n, dtype=real.dtype, device="meta").as_strided(real.size(), real.stride(),
                                                                              real.storage_offset())
        rg = real.requires_grad if requires_grad is None else requires_grad
        r = torch.Tensor._make_subclass(cls, meta, rg, dispatch_device=True, device_for_backend_keys=CUDA)
        r._host = real.detach() if real.requires_grad else real
        return r

    @property
    def device(self) -> torch.device:
        return CUDA

    def __repr__(self, *, tensor_contents=None):
        return f"SimCuda({self._host!r})"

    def tolist(self):                  # C++'s tolist reads the storage: a host sync on a GPU, here the CPU tensor
        _sync("d2h")
        return self._host.tolist()

    def numpy(self, *, force: bool = False):
        if force:
            return self.cpu().numpy()
        raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the "
                        "tensor to host memory first.")

    def __array__(self, dtype=None, copy=None):
        return self.numpy()

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})


def to_sim(t: torch.Tensor) -> SimCuda:
    "A CPU tensor's values on the simulated GPU (a Parameter stays a Parameter)."
    s = SimCuda(t.detach().clone())
    return (torch.nn.Parameter(s, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter)
            else s.requires_grad_(t.requires_grad))


def real(t):
    "The CPU tensor behind a SimCuda tensor (anything else as it is)."
    return t._host if isinstance(t, SimCuda) else t


def module_to_sim(module: torch.nn.Module) -> torch.nn.Module:
    "Move a module's parameters and buffers to the simulated GPU, in place (what `module.to('cuda')` does on a GPU)."
    for m in module.modules():
        for k, p in list(m._parameters.items()):
            if p is not None and not isinstance(p, SimCuda):
                m._parameters[k] = to_sim(p)
        for k, b in list(m._buffers.items()):
            if b is not None and not isinstance(b, SimCuda):
                m._buffers[k] = to_sim(b)
    return module


# ------------------------------------------------------------------------------------------------ device rules
def _dev(t) -> torch.device:
    "A tensor's device as a GPU run would have it (a SimCuda tensor, or autograd metadata of one: cuda:0)."
    d = CUDA if isinstance(t, SimCuda) else t.device
    return CUDA if d.type == "meta" else d


def _mismatch(func, a, b):
    raise SimDeviceMismatch(f"Expected all tensors to be on the same device, but found at least two devices, {a} and "
                            f"{b}! (simulated CUDA, in {func})")


def _common_device(func, tensors) -> torch.device | None:
    "FakeTensor._find_common_device's rule: one device; a 0-dim CPU tensor defers to any other."
    common, common_cpu0 = None, False
    for t in tensors:
        d, cpu0 = _dev(t), _dev(t).type == "cpu" and t.dim() == 0
        if common is None:
            common, common_cpu0 = d, cpu0
            continue
        if d == common:
            common_cpu0 = common_cpu0 and cpu0
            continue
        if cpu0:
            continue
        if common_cpu0:
            common, common_cpu0 = d, cpu0
            continue
        _mismatch(func, common, d)
    return common


# ops that take tensors on several devices on a GPU (fake_tensor's multi_device_op_default): output on the input's
# device
_CROSS = {aten.copy_.default, aten.copy.default, aten._unsafe_index_put.default, aten.slice_scatter.default,
          aten.diagonal_scatter.default, aten._foreach_copy_.default, aten._foreach_copy.default}
_INDEX = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default,
          aten._unsafe_index.Tensor}
_PIN = {aten._pin_memory.default, aten.pin_memory.default}


def _device_arg(func, args, kwargs):
    "The explicit `device=` of a factory / like-constructor / `_to_copy`, or None."
    if "device" in kwargs and kwargs["device"] is not None:
        return torch.device(kwargs["device"])
    if func in (aten.to.device, aten.to.prim_Device):
        return torch.device(args[1])
    return None


def _check(func, args, kwargs) -> torch.device:
    "The device of the op's outputs, or SimDeviceMismatch where a GPU would refuse the op."
    flat = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    dev = _device_arg(func, args, kwargs)
    if dev is not None:
        return CUDA if dev.type == "cuda" else dev
    if not flat:
        return CPU
    if func in _CROSS:
        return _dev(args[0])
    if func in _INDEX:
        self, indices = args[0], args[1]
        for i in indices if isinstance(indices, (list, tuple)) else [indices]:
            if i is not None and _dev(i) not in (CPU, _dev(self)):
                _mismatch(func, _dev(self), _dev(i))
        if func is not aten.index.Tensor:
            values = args[2] if len(args) > 2 else kwargs["values"]
            if _dev(values) != _dev(self) and values.dim() != 0:
                _mismatch(func, _dev(self), _dev(values))
        return _dev(self)
    if func.name().startswith("aten::_foreach_"):
        lists = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
        others = [a for a in args if isinstance(a, torch.Tensor)]
        for i in range(len(lists[0]) if lists else 0):
            _common_device(func, [l[i] for l in lists] + others)
        return _dev(lists[0][0]) if lists else _common_device(func, flat)
    return _common_device(func, flat)


# ------------------------------------------------------------------------------------------------ dispatch
def _unwrap(x):
    if isinstance(x, SimCuda):
        return x._host
    if isinstance(x, torch.device) and x.type == "cuda":
        return CPU
    return x


def _dispatch(func, args, kwargs):
    flat_in = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    on_sim = any(isinstance(t, SimCuda) for t in flat_in)
    if func is torch.ops.prim.device.default:                           # what C++ asks a tensor's device
        return _dev(args[0])
    if func is aten._fused_sdp_choice.default and on_sim:
        return 0                                                        # SDPBackend.math: no CUDA attention kernel here
    if func is aten.is_pinned.default:
        return bool(getattr(real(args[0]), "_sim_pinned", False))
    if func in _PIN:
        STATS.pinned += 1
        out = real(args[0]).clone()
        out._sim_pinned = True
        return out
    dev = _check(func, args, kwargs)
    if on_sim or dev.type == "cuda":
        STATS.ops += 1
        STATS.op_names.add(func.name())
        if func is aten._local_scalar_dense.default:
            _sync("scalar")
        elif _shape_sync(func, args, kwargs):
            _sync("shape", func.name().replace("aten::", ""))
        elif _cpu_index(func, args, kwargs):
            _sync("h2d_blocking", func.name().replace("aten::", "") + " with a CPU index")
    if func is aten._to_copy.default and flat_in:
        src = args[0]
        if dev.type == "cuda" and not isinstance(src, SimCuda):
            STATS.h2d += 1
            STATS.h2d_non_blocking += bool(kwargs.get("non_blocking"))
            STATS.h2d_pinned += bool(getattr(src, "_sim_pinned", False))
            if not kwargs.get("non_blocking"):
                _sync("h2d_blocking")
        elif dev.type == "cpu" and isinstance(src, SimCuda):
            _sync("d2h")
    if func is aten.copy_.default and isinstance(args[1], SimCuda) and not isinstance(args[0], SimCuda):
        _sync("d2h")
    if (func is aten.copy_.default and isinstance(args[0], SimCuda) and not isinstance(args[1], SimCuda)
            and args[1].dim() > 0 and not (args[2] if len(args) > 2 else kwargs.get("non_blocking"))):
        _sync("h2d_blocking", "copy_")
    kw = dict(kwargs)
    if kw.get("pin_memory"):
        kw["pin_memory"] = False                   # a CPU tensor cannot be pinned without CUDA
    u_args, u_kwargs = tree_map(_unwrap, (args, kw))
    out = func(*u_args, **u_kwargs)
    ids = {id(t._host): t for t in flat_in if isinstance(t, SimCuda)}   # in-place ops return their input
    plain = {id(t) for t in flat_in if not isinstance(t, SimCuda)}

    low = dev.type == "cuda" and [o.dtype for o in tree_flatten(out)[0]
                                  if isinstance(o, torch.Tensor) and o.dtype in (torch.bfloat16, torch.float16)]
    if low:
        STATS.bf16_ops += low.count(torch.bfloat16) > 0
        if _AUTOCAST and _AUTOCAST[-1] is not None:
            STATS.autocast_leaks[(_AUTOCAST[-1], func.name())] += 1

    def wrap(o):
        if not isinstance(o, torch.Tensor):
            return o
        if id(o) in ids:
            return ids[id(o)]
        if dev.type != "cuda" or id(o) in plain:
            return o
        return SimCuda(o)
    return tree_map(wrap, out)


# `torch.autocast` regions open while the simulation runs, innermost last: where the code entered a region that asked
# for autocast off (`enabled=False`) but left CUDA's on (its device type is not 'cuda'), None for any other region
_AUTOCAST: list = []


def _from_user_code() -> bool:
    """Whether the autocast region being entered was opened by code outside torch (directly or as a decorator), not by
    torch itself (checkpointing's recomputation restores the CPU's autocast state with `autocast('cpu', ...)`)."""
    f = sys._getframe(2)
    while f is not None and f.f_code.co_filename == torch.amp.autocast_mode.__file__:
        f = f.f_back
    return f is not None and not f.f_code.co_filename.startswith(_TORCH_DIR)


def _autocast_enter(orig):
    def enter(self):
        r = orig(self)
        off = getattr(self, "_enabled", True) is False
        _AUTOCAST.append(_site(2) if off and torch.is_autocast_enabled("cuda") and _from_user_code() else None)
        return r
    return enter


def _autocast_exit(orig):
    def exit_(self, *exc):
        if _AUTOCAST:
            _AUTOCAST.pop()
        return orig(self, *exc)
    return exit_


class SimCudaMode(TorchDispatchMode):
    "Inside: factories asked for `cuda` make SimCuda tensors; every op follows a GPU's device rules."
    # C++ skips CUDA's lazy initialisation (which needs a driver) when a mode in the FAKE slot is active
    _mode_key = torch._C._TorchDispatchModeKey.FAKE
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})


# what `torch.cuda.get_device_properties` answers inside `sim_cuda()`: an 80 GiB GPU of capability 9.0 (an H100's)
_SIM_PROPERTIES = types.SimpleNamespace(name="simulated CUDA (a CPU)", major=9, minor=0, total_memory=80 << 30,
                                        multi_processor_count=132, is_integrated=False)

# what `torch.cuda` answers inside `sim_cuda()`: a one-GPU machine that is not capturing a CUDA graph. A name this torch
# release lacks is skipped, so that no release's set of queries is assumed; any other query that reaches the CUDA
# runtime fails loudly (tests/test_cuda_dry_run.py checks that a training step asks the runtime nothing).
_CUDA_API = dict(
    synchronize=lambda *a, **k: None, current_device=lambda: 0, set_device=lambda *a: None,
    is_available=lambda: True, is_bf16_supported=lambda *a, **k: True, device_count=lambda: 1,
    reset_peak_memory_stats=lambda *a: None, memory_allocated=lambda *a: 0, max_memory_allocated=lambda *a: 0,
    memory_reserved=lambda *a: 0, max_memory_reserved=lambda *a: 0, empty_cache=lambda: None,
    get_device_name=lambda *a: "simulated CUDA (a CPU)", get_device_capability=lambda *a: (9, 0),
    is_current_stream_capturing=lambda: False, get_arch_list=lambda: ["sm_90"],
    get_device_properties=lambda *a, **k: _SIM_PROPERTIES)


def _optimizer_capture_checks() -> list[str]:
    """The optimisers' CUDA-graph capture health checks this torch release has (`_cuda_graph_capture_health_check`,
    `_accelerator_graph_capture_health_check`, ...): they ask the CUDA runtime whether the current stream is capturing,
    which the simulation has no stream to answer (no CUDA graphs are simulated)."""
    return [n for n in dir(torch.optim.Optimizer) if n.endswith("graph_capture_health_check")]


@contextlib.contextmanager
def sim_cuda(patch_cuda_api: bool = True):
    """The simulated GPU. `patch_cuda_api`: `torch.cuda` answers as on a one-GPU machine (`_CUDA_API`:
    `is_available` True, `synchronize`, `current_device`, the memory counters, not capturing a graph), so code that
    asks runs on; the optimisers skip their graph-capture check."""
    global STATS
    STATS = SimStats()
    _AUTOCAST.clear()
    if _REAL_GPU:
        raise RuntimeError("a real GPU is present: run the real thing (make gpu-check)")
    # as FakeTensorMode does on a machine without CUDA: CUDA's device guard becomes a no-op (for the rest of the
    # process), so that autograd's bookkeeping of a `cuda` tensor (its stream) asks no driver
    torch._C._ensureCUDADeviceGuardSet()
    with contextlib.ExitStack() as stack:
        if patch_cuda_api:
            from unittest import mock
            for name, value in _CUDA_API.items():
                if hasattr(torch.cuda, name):
                    stack.enter_context(mock.patch.object(torch.cuda, name, value))
            if hasattr(torch.cuda, "graphs") and hasattr(torch.cuda.graphs, "is_current_stream_capturing"):
                stack.enter_context(mock.patch.object(torch.cuda.graphs, "is_current_stream_capturing",
                                                      _CUDA_API["is_current_stream_capturing"]))
            for name in _optimizer_capture_checks():
                stack.enter_context(mock.patch.object(torch.optim.Optimizer, name, lambda self: None))
            # autocast regions are tracked: an op that a region meant to run in float32 but that CUDA's autocast
            # still casts is counted in `SimStats.autocast_leaks`
            ac = torch.amp.autocast_mode.autocast
            stack.enter_context(mock.patch.object(ac, "__enter__", _autocast_enter(ac.__enter__)))
            stack.enter_context(mock.patch.object(ac, "__exit__", _autocast_exit(ac.__exit__)))
            # `x.to('cuda')` asks the CUDA runtime for the current device before any dispatch (`ensure_has_index`)
            orig_to = torch.Tensor.to
            def to(self, *args, **kwargs):
                args = tuple(_indexed(a) for a in args)
                if "device" in kwargs:
                    kwargs["device"] = _indexed(kwargs["device"])
                return orig_to(self, *args, **kwargs)
            stack.enter_context(mock.patch.object(torch.Tensor, "to", to))
            # `module.to('cuda')` replaces each parameter by a new one (`param.data = ...` would give a plain
            # Parameter the simulated tensor's meta storage); references taken before the move are stale, as after
            # `model.to()` on a GPU with this flag
            stack.enter_context(mock.patch.object(torch.__future__, "_overwrite_module_params_on_conversion", True))
            # the optimiser and clip_grad_norm_ take their foreach (multi-tensor) kernels on `cuda`, as on a GPU
            import torch.optim.optimizer as _optim, torch.utils._foreach_utils as _fe
            for mod in (_optim, _fe):
                stack.enter_context(mock.patch.object(mod, "_foreach_supported_types",
                                                      [*mod._foreach_supported_types, SimCuda]))
            # autograd's engine cannot run a graph with `cuda` tensors here: `loss.backward()` runs `sim_backward`
            stack.enter_context(mock.patch.object(torch.Tensor, "backward", _backward))
            stack.enter_context(mock.patch.object(torch.autograd, "backward", lambda tensors, grad_tensors=None, **k:
                                                  sim_backward(tensors, grad_tensors) and None))
            stack.enter_context(mock.patch.object(torch.autograd, "grad", _grad))
            stack.enter_context(mock.patch.object(torch.Tensor, "cuda",
                                                  lambda self, device=None, non_blocking=False, **k:
                                                  self.to(CUDA, non_blocking=non_blocking)))
        # `torch.tensor(data, device='cuda')`, `x.new_tensor(...)`: made on the CPU and then moved (a dispatched
        # `_to_copy`), instead of C++ asking the driver first (FakeTensorMode does the same)
        prev = torch._C._only_lift_cpu_tensors()
        torch._C._set_only_lift_cpu_tensors(True)
        stack.callback(torch._C._set_only_lift_cpu_tensors, prev)
        stack.enter_context(SimCudaMode())
        yield STATS


def _backward(t, gradient=None, retain_graph=None, create_graph=False, inputs=None):
    if create_graph or inputs is not None:
        raise NotImplementedError("sim_backward: create_graph / inputs")
    sim_backward(t, gradient)


def _grad(outputs, inputs, grad_outputs=None, retain_graph=None, create_graph=False, only_inputs=True,
          allow_unused=None, is_grads_batched=False, materialize_grads=False):
    if create_graph or is_grads_batched:
        raise NotImplementedError("sim_backward: create_graph / is_grads_batched")
    inputs = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
    out = sim_backward(outputs, grad_outputs, inputs)
    if not allow_unused and not materialize_grads and any(g is None for g in out):
        raise RuntimeError("One of the differentiated Tensors appears to not have been used in the graph. Set "
                           "allow_unused=True if this is the desired behavior.")
    return tuple(torch.zeros_like(t) if g is None and materialize_grads else g for g, t in zip(out, inputs))

def _indexed(d):
    "'cuda' -> cuda:0 (a device argument of `Tensor.to`; anything else as it is)."
    if isinstance(d, str) and d == "cuda":
        return CUDA
    if isinstance(d, torch.device) and d.type == "cuda" and d.index is None:
        return CUDA
    return d


# ------------------------------------------------------------------------------------------------ backward
def _node_call(node, grads):
    if hasattr(node, "apply") and not hasattr(node, "variable") and type(node).__name__ != "AccumulateGrad":
        # a custom autograd.Function's node (BackwardCFunction): its Python backward
        try:
            return node.apply(*grads)
        except TypeError:
            pass
    return node(*grads)


def _md_device(md) -> torch.device:
    "The device autograd recorded for a node's input, as a GPU run has it (a SimCuda tensor's: cuda:0)."
    d = md.device
    return CUDA if d.type in ("meta", "cuda") else d


def _validate(node_next, nr, g):
    """The engine's validate_outputs for one gradient flowing into input `nr` of `node_next`: shape (summed to size),
    device and dtype (cast) from the metadata the node recorded. Device as the engine on a GPU: a 0-dim gradient on
    another device is moved to the input's (`grad.to(metadata.device())`: a CUDA scalar gradient of a loss computed on
    the host reaches it, a host copy on a GPU, counted), any other gradient on the wrong device is an error."""
    md = node_next._input_metadata[nr]
    want = _md_device(md)
    if _dev(g) != want:
        if g.dim() != 0:
            raise SimDeviceMismatch(f"invalid gradient at index {nr} for {node_next.name()} - expected device {want} "
                                    f"but got {_dev(g)}")
        g = g.to(want)
    if tuple(g.shape) != tuple(md.shape):
        try:
            g = g.sum_to_size(tuple(md.shape))
        except RuntimeError:
            raise RuntimeError(f"invalid gradient shape {tuple(g.shape)} for {node_next.name()}, "
                               f"expected {tuple(md.shape)}") from None
    if g.dtype != md.dtype:
        g = g.to(md.dtype)
    return g


def sim_backward(outputs, grads=None, inputs=None):
    """`torch.autograd.backward(outputs, grads)` by hand (see the module's docstring): every node's backward formula,
    gradients checked as the engine checks them. Without `inputs`, the leaves' `.grad` are accumulated and the number
    of nodes run is returned; with `inputs` (leaves), their gradients are returned as a tuple (None where unused) and
    no `.grad` changes: `torch.autograd.grad`. Works on plain CPU graphs too (then it equals autograd's engine)."""
    outputs = [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)
    grads = [None] * len(outputs) if grads is None else [grads] if isinstance(grads, torch.Tensor) else list(grads)
    want = None if inputs is None else {id(t): i for i, t in enumerate(inputs)}
    found = [None] * (0 if inputs is None else len(inputs))
    if want is not None and any(t.grad_fn is not None for t in inputs):
        raise NotImplementedError("sim_backward: gradients with respect to non-leaf tensors")
    roots = []
    for t, g in zip(outputs, grads):
        if t.grad_fn is None:
            raise RuntimeError("element of the outputs does not require grad and does not have a grad_fn")
        roots.append((t.grad_fn, t.output_nr, torch.ones_like(t) if g is None else g))
    # dependencies: how many edges point at each node
    deps, seen, stack = defaultdict(int), {r for r, _, _ in roots}, [r for r, _, _ in roots]
    while stack:
        n = stack.pop()
        for nxt, _ in n.next_functions:
            if nxt is None:
                continue
            deps[nxt] += 1
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    buffers = defaultdict(dict)
    for node, nr, g in roots:
        g = _validate(node, nr, g)
        buffers[node][nr] = g if nr not in buffers[node] else buffers[node][nr] + g
    ready, ran = [r for r in dict.fromkeys(r for r, _, _ in roots) if deps[r] == 0], 0
    while ready:
        n = ready.pop()
        buf = buffers.pop(n, {})
        if type(n).__name__ == "AccumulateGrad":
            v, g = n.variable, buf.get(0)
            if g is not None:
                if _dev(g) != _dev(v) and g.dim() == 0:
                    g = g.to(_dev(v))       # as the engine moves 0-dim gradients
                if _dev(g) != _dev(v):
                    raise SimDeviceMismatch(f"gradient of a leaf on {_dev(g)}, the leaf on {_dev(v)}")
                if want is not None:
                    if id(v) in want:
                        found[want[id(v)]] = g
                else:
                    with torch.no_grad():
                        v.grad = g.detach().clone() if v.grad is None else v.grad + g
            ran += 1
            continue
        ins = [buf.get(i) for i in range(len(n._input_metadata))]
        if any(g is not None for g in ins):
            outs = _node_call(n, ins)
            ran += 1
        else:
            outs = [None] * len(n.next_functions)
        if isinstance(outs, torch.Tensor) or outs is None:
            outs = (outs,)
        for (nxt, nr), g in zip(n.next_functions, outs):
            if nxt is None:
                continue
            if g is not None:
                g = _validate(nxt, nr, g)
                b = buffers[nxt]
                b[nr] = g if b.get(nr) is None else b[nr] + g
            deps[nxt] -= 1
            if deps[nxt] == 0:
                ready.append(nxt)
    return ran if want is None else tuple(found)
