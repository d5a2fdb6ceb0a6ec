# ---
# jupyter:
#   jupytext:
#     formats: nbs///ipynb,nbs/scripts///py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %%
#| default_exp eval.models

# %%
#| export
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from PIL import Image
from tqdm import tqdm

from powerclip.checkpoint import CheckpointFiles, CheckpointLayoutError, find_weights, load_error_line, read_params
from powerclip.eval.items import BadData, MissingData, read_image
from powerclip.methods import GlobalScorer, Scorer, get_method

log = logging.getLogger(__name__)

# %%
#| hide
import tempfile
from fastcore.test import test_eq, test_fail


# %% [markdown]
# # Models, scorers and the feature cache
#
# > The one way a checkpoint is loaded for evaluation, the scorers its method offers, and an `Evaluator`.
#
# A checkpoint is a file, a run folder (ours or open_clip's), an open_clip release or a random initialisation, with the
# architecture and the method read from what the checkpoint records; the `Evaluator` turns images and captions into
# cached features and scores.

# %% [markdown]
# ## Loading a checkpoint
#
# `load_model` builds the architecture with `powerclip.model.create_model` (our configs registered with open_clip)
# and loads a local checkpoint, whatever a user has:
#
# - a plain open_clip `state_dict` (`runs/NAME/model.pt`), open_clip's `{'state_dict': ..}`, or the trainer's
#   `{'model': ..}` (`runs/NAME/checkpoints/last.pt`), with `module.` / `model.` prefixes (DDP, `model.Encoder`)
#   stripped;
# - a run folder: its `model.pt`, else `checkpoints/last.pt`;
# - open_clip's two folders (`49b_checkpoint`, `find_weights`): a release as on a model hub (`open_clip_config.json`
#   beside `open_clip_model.safetensors` or `open_clip_pytorch_model.bin`, a `.safetensors` file read by the
#   `safetensors` package) and a run of open_clip's training script (`logs/NAME/`: its latest `checkpoints/epoch_N.pt`;
#   another epoch by giving its file);
# - nothing: a random initialisation from `seed` (the untrained row of the comparison, and tests).
#
# **What the run says.** A trainer checkpoint carries its run config; a plain `model.pt` has the run's
# `config.yaml` beside it (or one folder up). From it come the architecture (`model.name`), its overrides
# (`model.kwargs`: fewer layers, context length 32, ..., applied, and the tokenizer uses the model's context
# length) and the **method** (`method`, `method_cfg`). A name given by the caller wins (`--model`, `--method`); the
# run's kwargs only apply to the architecture the run names. open_clip's folders record less, in their own files
# (found beside the weights or one folder up, after our `config.yaml`): a run's `params.txt` names the architecture
# (`model: ViT-B-16`) and whether QuickGELU was forced (its other `force_*` options are not applied: a warning says
# so); a release's `model_cfg` is built as it is, from the registered architecture closest to it (fewest differing
# entries: usually the same config, then no kwargs) with the entries that differ as kwargs, and with the release's
# own `preprocess_cfg` (mean, std, interpolation, resize mode) and tokenizer. `checkpoint_record` reads all of these
# into the run config's form. So both open_clip folders load without `--model`.
#
# **How it is scored.** The evaluator asks the method: `Method.scorers()` maps names to `Scorer`s
# (`40_methods`), the method's own way first (FILIP: `'late'` interaction, then `'global'`), and every method offers
# `'global'`, the cosine of the L2-normalised pooled embeddings. Every metric is computed for each scorer; the first
# is the headline. A checkpoint whose method is unknown (a plain state dict with no run config, no `--method`) is
# scored the global way only.
# A method that trained modules of its own beside the model (`build_modules`: SmartCLIP's mask network, SPARC's
# pooling head, A-CLIP's EMA towers) gets them back from `method_modules.pt` beside `model.pt` (or from inside a
# trainer checkpoint) and passes them to its scorers, `Method.scorers(modules)`.
#
# **Identity.** A checkpoint is its file's sha256, or `random-init-<arch>-seed<k>` (plus a hash of the model kwargs);
# features are cached under it (below).
#
# **A broken checkpoint is refused before anything is built.** A diverged run saves NaN or infinite weights; scored,
# such a model gets whatever the comparisons of NaN give (before the tie rule of `60_eval_metrics`, R@1 = 100 both
# ways on coco_sample). Every float tensor of the state dict (and of the method's modules) is checked when the file is
# read: a non-finite one stops with `NonFiniteWeights`, one line naming the checkpoint, how many tensors and which.
# The other ways a checkpoint cannot be evaluated (no architecture named, weights that do not fit it, an unknown
# method) are `CheckpointError`s too, so a command line can tell them from bugs.
#
# **What the log says.** open_clip logs "No pretrained weights loaded ... Model initialized randomly" whenever it
# builds an architecture without one of its own pretrained tags, which is every time here, also just before the
# checkpoint's weights are loaded: a user would read that the evaluated model is random. `load_model` drops that
# line while it builds the model, and says in its own words, once, when the model really is a random initialisation.

# %%
#| export
class CheckpointError(ValueError):
    """A checkpoint that cannot be evaluated: no architecture named, weights that do not fit it, an unknown method,
    non-finite weights."""

class NonFiniteWeights(CheckpointError):
    "A checkpoint holding NaN or infinite weights (a diverged run): it is never scored."

def nonfinite_tensors(sd: dict) -> dict[str, str]:
    "`{name: 'NaN' | 'Inf' | 'NaN and Inf'}` of the float tensors of a state dict that hold non-finite values."
    out = {}
    for k, v in sd.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point() and not torch.isfinite(v).all():
            nan, inf = bool(v.isnan().any()), bool(v.isinf().any())
            out[k] = 'NaN and Inf' if nan and inf else 'NaN' if nan else 'Inf'
    return out

def check_finite(sd: dict, where: str):
    "Raise `NonFiniteWeights` naming `where` and the tensors when a float tensor of `sd` is not finite."
    bad = nonfinite_tensors(sd)
    if bad:
        n = sum(isinstance(v, torch.Tensor) and v.is_floating_point() for v in sd.values())
        names = ', '.join(f'{k} ({w})' for k, w in list(bad.items())[:3]) + (', ..' if len(bad) > 3 else '')
        raise NonFiniteWeights(f'{where} holds non-finite weights in {len(bad)} of {n} float tensors: {names}; '
                               'the run diverged, and a model with such weights is never scored')

class _DropMessage(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record): return self.text not in record.getMessage()

@contextlib.contextmanager
def _quiet_open_clip_random_init():
    "While open_clip builds a model, drop its root-logger line 'No pretrained weights loaded ... initialized randomly'."
    f, root = _DropMessage('initialized randomly'), logging.getLogger()
    root.addFilter(f)
    try:
        yield
    finally:
        root.removeFilter(f)

def sha256_file(path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, 'rb') as f:
        for b in iter(lambda: f.read(chunk), b''):
            h.update(b)
    return h.hexdigest()

def _state_dict(ck) -> dict:
    for k in ('state_dict', 'model'):
        if isinstance(ck, dict) and k in ck and isinstance(ck[k], dict):
            ck = ck[k]
            break
    sd = {}
    for k, v in ck.items():
        for p in ('module.', 'model.'):
            if k.startswith(p):
                k = k[len(p):]
        sd[k] = v
    return sd

def checkpoint_files(path) -> CheckpointFiles:
    "`find_weights` (`49b_checkpoint`) of a checkpoint file or folder; a path in no known layout is `MissingData`."
    try:
        return find_weights(path)
    except CheckpointLayoutError as e:
        raise MissingData(str(e)) from None

def checkpoint_file(path) -> Path:
    """The weights file of a checkpoint file or folder: a run folder's `model.pt` (else its `checkpoints/last.pt`),
    an open_clip release's weights, an open_clip run's latest `epoch_N.pt`."""
    return checkpoint_files(path).weights

def run_config(checkpoint, ck=None) -> dict:
    """The config of the run a checkpoint belongs to: the one inside a trainer checkpoint `ck`, else `config.yaml`
    beside the file or one folder up ({} when none)."""
    if isinstance(ck, dict) and isinstance(ck.get('config'), dict):
        return ck['config']
    import yaml
    p = Path(checkpoint)
    for d in (p.parent, p.parent.parent):
        if (d / 'config.yaml').is_file():
            return yaml.safe_load((d / 'config.yaml').read_text()) or {}
    return {}

def _release_record(f: Path) -> dict:
    """A release's `open_clip_config.json` in the run config's form: the registered architecture closest to its
    `model_cfg` (`model.name`), the entries that make it that config (`model.kwargs`), its pooling (its vision
    `pool_type`, set apart), the `preprocess_cfg` and the folder (`release`)."""
    import open_clip
    from powerclip.model import register_configs
    try:
        cfg = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f'{f}: not a JSON file ({type(e).__name__}: {e})') from None
    mc = cfg.get('model_cfg') if isinstance(cfg, dict) else None
    if not isinstance(mc, dict) or not {'embed_dim', 'vision_cfg', 'text_cfg'} <= set(mc):
        raise CheckpointError(f'{f}: no open_clip model config ("model_cfg" with embed_dim, vision_cfg, text_cfg)')
    register_configs()
    (bare, pool), best = _unpooled(mc), None
    for n in sorted(open_clip.list_models()):
        c, cp = _unpooled(open_clip.get_model_config(n))
        if set(c) <= set(mc):                    # an entry of c that mc lacks could not be overridden away
            kw = {k: v for k, v in bare.items() if c.get(k) != v}
            score = (len(kw), cp != pool)          # fewest differing entries, then the same pooling
            if best is None or score < best[0]:
                best = (score, n, kw)
    if best is None:
        raise CheckpointError(f'{f}: its model_cfg has entries no open_clip architecture here has: pass --model')
    return dict(model=dict(name=best[1], kwargs=best[2], pool=pool), release=str(f.parent),
                preprocess_cfg=cfg.get('preprocess_cfg') or {})

def _unpooled(cfg: dict) -> tuple[dict, str]:
    "An open_clip model config without its vision `pool_type` (the pooling is set apart, `pool=`), and that pooling."
    v = dict(cfg.get('vision_cfg') or {})
    return {**cfg, 'vision_cfg': v}, v.pop('pool_type', 'tok')

def _params_record(f: Path) -> dict:
    "An open_clip run's `params.txt` in the run config's form: the architecture it trained, with QuickGELU if forced."
    p = read_params(f)
    ignored = [k for k in ('force_image_size', 'force_patch_dropout', 'force_context_length')
               if p.get(k, 'None') not in ('None', '')]
    if ignored:
        log.warning('%s: %s not applied here (pass --model-kwargs)', f, ', '.join(f'{k} {p[k]}' for k in ignored))
    kw = {'quick_gelu': True} if p.get('force_quick_gelu') == 'True' else {}
    return dict(model=dict(name=p.get('model') or None, kwargs=kw))

def checkpoint_record(files: CheckpointFiles, ck=None) -> tuple[dict, str | None]:
    """How a checkpoint was trained, in the run config's form (`model.name`, `.kwargs`, `.pool`, `method`, ..), and
    where it was read: the config inside a trainer checkpoint `ck`, else `files.record` (our `config.yaml`, open_clip's
    `params.txt` or a release's `open_clip_config.json`); `({}, None)` when nothing records it."""
    if isinstance(ck, dict) and isinstance(ck.get('config'), dict):
        return ck['config'], f'the config inside {files.weights}'
    r = files.record
    if r is None:
        return {}, None
    if r.name == 'params.txt':
        return _params_record(r), str(r)
    if r.name == 'open_clip_config.json':
        return _release_record(r), str(r)
    return run_config(files.weights), str(r)

def _trained_pool(run_model: dict) -> str | None:
    """The pooling a run config records: `model.pool`, else its architecture's own; None when it names no known one
    (our configs registered: `register_configs`)."""
    from powerclip.model import arch_pool
    if run_model.get('pool') is not None or run_model.get('name') is None:
        return run_model.get('pool')
    try:
        return arch_pool(run_model['name'], run_model.get('kwargs'))
    except (TypeError, NotImplementedError):        # an architecture unknown here, or pooled another way
        return None

def choose_pool(asked: str | None, trained: str | None, default: str | None, named: bool,
                source: str | None) -> tuple[str | None, str | None]:
    """`(pool, warning or None)`: the pooling `asked` (`--pool`) if any, else the one the checkpoint was `trained`
    with (read from `source`), else None (the architecture's own, `default`). `named`: the caller named the
    architecture, whose own pooling is `default`."""
    if asked is not None:
        if trained is not None and 'map' in (asked, trained) and trained != asked:   # a head of weights, not a switch
            raise CheckpointError(f"pooling: the checkpoint was trained pooling by {trained!r} ({source}); 'map' is an "
                                  f"architecture (30_model, \"MAP\"), --pool {asked} cannot read it")
        if trained is not None and trained != asked:
            return asked, (f'pooling: {asked!r} as --pool asks, though the checkpoint was trained pooling by '
                           f'{trained!r} ({source})')
        return asked, None
    if trained is not None and named and default is not None and trained != default:
        return trained, (f'pooling: {trained!r}, as the checkpoint was trained ({source}), where the architecture '
                         f'named pools by {default!r}; --pool {default} scores it that way')
    return trained, None

def _method(method: str | None, method_cfg: dict | None):
    if method is None:
        return None
    try:
        return get_method(method, method_cfg or {})
    except KeyError as e:
        raise CheckpointError(e.args[0]) from None     # an unknown method: one line, not a KeyError repr
    except (TypeError, ValueError) as e:
        raise CheckpointError(f'method {method!r} with config {method_cfg}: {e}') from None

def method_modules(m, model, checkpoint=None, ck=None):
    """The method's own trained modules (`build_modules`, e.g. SPARC's pooling head, A-CLIP's EMA towers) with the run's
    weights: `method_modules` inside a trainer checkpoint `ck`, else `method_modules.pt` beside the checkpoint file.
    None when the method has none, or when its weights are not found (a scorer that needs them then says so);
    freshly built ones for a random initialisation (`checkpoint` None)."""
    mods = None if m is None else m.build_modules(model)
    if mods is None or checkpoint is None:
        return None if mods is None else mods.eval()
    sd = ck.get('method_modules') if isinstance(ck, dict) and isinstance(ck.get('method_modules'), dict) else None
    f = Path(checkpoint).parent / 'method_modules.pt'
    if sd is None and f.is_file():
        sd, checkpoint = torch.load(f, map_location='cpu', weights_only=True), f
    if sd is None:
        log.info('no trained modules of method %s beside %s', type(m).__name__, checkpoint)
        return None
    check_finite(sd, f'the method modules of {checkpoint}')
    try:
        mods.load_state_dict(sd)
    except RuntimeError as e:
        raise CheckpointError(f'the method modules of {checkpoint} do not fit {type(m).__name__}: {e}') from None
    return mods.eval()

@dataclass
class LoadedModel:
    model: object           # open_clip CLIP, eval mode
    preprocess: object      # the architecture's validation transform
    tokenizer: object       # open_clip tokenizer at the model's context length
    ckpt_id: str            # sha256 of the checkpoint file, or 'random-init-<arch>-seed<k>'
    spec: dict              # name, open_clip model_kwargs and pooling ('tok' | 'avg') the model was built with
    method: str | None = None                              # the training method, when known
    scorers: dict = field(default_factory=lambda: {'global': GlobalScorer()})   # name -> Scorer, the headline first
    modules: object = None  # the method's trained modules (`method_modules`), when it has any
    weights: str | None = None  # the file the weights were read from (a folder's latest epoch, ..); None: random init

def _read_checkpoint(f: Path):
    "What a weights file holds: a `.safetensors` file's tensors, else what `torch.load` reads."
    if f.suffix == '.safetensors':
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise CheckpointError(f'{f}: reading a .safetensors file needs the safetensors package '
                                  '(pip install safetensors)') from None
        try:
            return load_file(str(f), device='cpu')
        except Exception as e:
            raise CheckpointError(f'{f}: not a safetensors file ({type(e).__name__}: {e})') from None
    try:
        return torch.load(f, map_location='cpu', weights_only=True)
    except Exception as e:   # the trainer's checkpoints also hold RNG states and configs
        log.info('weights_only load failed (%s); loading %s as a trusted local pickle', type(e).__name__, f)
        try:
            return torch.load(f, map_location='cpu', weights_only=False)
        except Exception as e2:
            raise CheckpointError(f'{f}: not a checkpoint torch can read ({type(e2).__name__}: {e2})') from None

def load_model(model_name: str | None = None, checkpoint=None, seed: int = 0, device: str = 'cpu',
               model_kwargs: dict | None = None, method: str | None = None, method_cfg: dict | None = None,
               pool: str | None = None) -> LoadedModel:
    """Build the architecture and load a checkpoint file or folder (None = random init from `seed`). What the
    checkpoint records (`checkpoint_record`) names the architecture, its kwargs, its pooling and the method;
    `model_name` / `method` given here win, and `pool` (see "Pooling" below). Raises `CheckpointError`
    (`NonFiniteWeights`) before building anything for a checkpoint that cannot be evaluated."""
    # here, not at the top: `--help`, `table`, `make-world` stay fast
    import open_clip
    from powerclip.model import arch_pool, create_model, pool_of, register_configs
    register_configs()
    sd, run, ck, source = None, {}, None, None
    if checkpoint is not None:
        files = checkpoint_files(checkpoint)
        checkpoint = files.weights
        log.info('checkpoint: %s (%s)', checkpoint, files.layout)
        ck = _read_checkpoint(checkpoint)
        if not isinstance(ck, dict):
            raise CheckpointError(f'{checkpoint}: not a state dict or a trainer checkpoint (a {type(ck).__name__})')
        sd, (run, source) = _state_dict(ck), checkpoint_record(files, ck)
        check_finite(sd, f'checkpoint {checkpoint}')
    run_model = run.get('model') or {}
    name = model_name or run_model.get('name')
    if name is None:
        raise CheckpointError('no model name given: pass --model' if checkpoint is None else
                              f'no model name given, and neither {checkpoint} nor a config.yaml, params.txt or '
                              'open_clip_config.json beside it names one: pass --model')
    same = run_model.get('name') in (None, name)         # the run's kwargs only fit the architecture it names
    kw = dict(run_model.get('kwargs') or {}) if same else {}
    kw.update(model_kwargs or {})
    try:
        default = arch_pool(name, kw)
    except (TypeError, NotImplementedError):             # unknown here (create_model says so) or pooled another way
        default = None
    pool, warning = choose_pool(pool, _trained_pool(run_model), default, model_name is not None, source)
    if warning:
        log.warning(warning)
    # a release built as its own config says: its preprocessing, its tokenizer (our architecture is only the closest)
    release = run.get('release') if same else None
    pre = (run.get('preprocess_cfg') or {}) if release else {}
    extra = {f'image_{k}': pre[k] for k in ('mean', 'std', 'interpolation', 'resize_mode') if k in pre}
    method = method or run.get('method')
    if method_cfg is None:
        method_cfg = (run.get('method_cfg') or {}) if run.get('method') == method else {}
    m = _method(method, method_cfg)                      # an unknown method stops here, before the model is built
    torch.manual_seed(seed)
    with _quiet_open_clip_random_init():
        try:
            model, _, preprocess = create_model(name, pool=pool, **kw, **extra)
        except (ValueError, NotImplementedError) as e:   # an unknown architecture name, or pooled another way
            where = f' (named by {source})' if model_name is None and source else ''
            raise CheckpointError(f'{e}{where}') from None
    arch = name                                          # architecture names only (no aliases)
    pooled = pool_of(model)
    if m is not None and pooled not in m.pools:
        raise CheckpointError(f"method {method!r} pools by {' or '.join(m.pools)}, the model by {pooled!r}")
    # the same weights pooled another way are another model: its features must not share the cache ('tok' ids unchanged)
    tag = '' if pooled == 'tok' else f'-{pooled}'
    if sd is None:
        ckpt_id = (f'random-init-{arch}-seed{seed}'
                   + (f'-{hashlib.sha256(json.dumps(kw, sort_keys=True).encode()).hexdigest()[:8]}'
                      if kw else '') + tag)
        log.warning('no checkpoint given: %s is a random initialisation (seed %d), an untrained model', arch, seed)
    else:
        ckpt_id = sha256_file(checkpoint) + tag
        try:
            missing, unexpected = model.load_state_dict(sd, strict=False)
        except RuntimeError as e:   # shape mismatches: torch's line per tensor as one line
            raise CheckpointError(f'{checkpoint} does not fit {arch} {kw}: {load_error_line(e)}') from None
        if missing or unexpected:
            raise CheckpointError(f'{checkpoint} does not fit {arch} {kw}: missing {missing[:5]}.. ({len(missing)}), '
                                  f'unexpected {unexpected[:5]}.. ({len(unexpected)})')
    try:
        tok = open_clip.get_tokenizer(f'local-dir:{release}' if release else arch, context_length=model.context_length)
    except Exception as e:   # a release naming a Hugging Face tokenizer that is not here (nothing downloads)
        raise CheckpointError(f'the tokenizer of {release or arch} cannot be built ({type(e).__name__}: {e})') from None
    modules = method_modules(m, model, checkpoint, ck)
    if modules is not None:
        modules.to(device)
    scorers = {'global': GlobalScorer()} if m is None else dict(m.scorers(modules))
    return LoadedModel(model.to(device).eval(), preprocess, tok, ckpt_id, dict(name=name, kwargs=kw, pool=pooled),
                       method, scorers, modules, None if checkpoint is None else str(checkpoint))


# %% [markdown]
# Every form a user has gives the same weights: a trainer checkpoint (weights under `model`, its config inside),
# the run's plain `model.pt` beside its `config.yaml` (which also names the method: FILIP's scorers come with it), and
# the run folder itself. A plain state dict with no config and no name, or a folder with no checkpoint, stops with
# one line.

# %%
from powerclip.model import create_model
_scratch = tempfile.TemporaryDirectory(prefix="powerclip-nb-")  # holds every scratch folder below; see the last cell
d = Path(tempfile.mkdtemp(dir=_scratch.name))
torch.manual_seed(1)
_sd = create_model('powerclip-micro')[0].state_dict()
(d / 'run' / 'checkpoints').mkdir(parents=True)
(d / 'run' / 'config.yaml').write_text('model:\n  name: powerclip-micro\n  kwargs: {}\nmethod: filip\nmethod_cfg: {}\n')
torch.save(_sd, d / 'run' / 'model.pt')
torch.save(dict(model=_sd, config=dict(model=dict(name='powerclip-micro', kwargs={}), method='clip'), step=3),
           d / 'run' / 'checkpoints' / 'last.pt')
a, b, c = (load_model(checkpoint=d / 'run'), load_model(checkpoint=d / 'run' / 'model.pt'),
           load_model(checkpoint=d / 'run' / 'checkpoints' / 'last.pt'))
test_eq(a.ckpt_id, b.ckpt_id)
assert not a.ckpt_id.startswith('random')
assert all(torch.equal(v, c.model.state_dict()[k]) for k, v in a.model.state_dict().items())
test_eq((a.method, list(a.scorers)), ('filip', ['late', 'global']))
# the trainer checkpoint's own config
test_eq((c.method, list(c.scorers)), ('clip', ['global']))
test_eq(list(load_model(checkpoint=d / 'run', method='clip').scorers), ['global'])   # --method wins
test_eq(load_model('powerclip-micro').ckpt_id, 'random-init-powerclip-micro-seed0')
(d / 'bare').mkdir()
torch.save(_sd, d / 'bare' / 'model.pt')
test_fail(lambda: load_model(checkpoint=d / 'bare' / 'model.pt'), contains='config.yaml')
test_fail(lambda: load_model(checkpoint=d), contains='no checkpoint in a known layout')
(d / 'notes.pt').write_text('not a checkpoint')
test_fail(lambda: load_model('powerclip-micro', d / 'notes.pt'), contains='not a checkpoint torch can read')
test_fail(lambda: load_model('powerclip-micro', method='nosuch'), contains='unknown method')
test_fail(lambda: load_model(), contains='pass --model')

# %% [markdown]
# **Pooling and the authors' checkpoints.** How the model pools (`'tok'`: class token and EOT; `'avg'`: the mean of
# the patch and caption tokens, the PowerCLIP authors' model; `30_model`, "Pooling") is the one the checkpoint was
# trained with, as its record says (the run's `model.pool`, else its architecture's: `ViT-B-16-avg` pools by the
# mean; a release's `vision_cfg.pool_type`), unless the caller names one (`pool=`, `--pool`), and the architecture's
# own when nothing records it. We honour the record over the architecture a caller names, because the weights were
# trained to be read that way: `--model ViT-B-16` on a checkpoint trained as `ViT-B-16-avg` builds ViT-B/16 pooled
# by the mean. Where the choice disagrees with something (a `--pool` against the record, or the record against the
# named architecture's own pooling), one warning line says which pooling is used, why, and how to get the other
# (`choose_pool`); an explicit `--pool` is obeyed. It reaches
# every scorer, because they read `encode_image` / `encode_text` or `encode`, which all pool the model's way; the
# checkpoint id of an `'avg'` model carries `-avg`, so the same weights pooled two ways never share cached features.
# The PowerCLIP authors trained with open_clip's training script, whose checkpoints are `epoch_N.pt` files holding
# `{'epoch', 'name', 'state_dict', 'optimizer', ...}` with `module.` in front of every key under DDP: that form loads
# as it is (`powerclip-eval suite --model ViT-B-16-avg --checkpoint epoch_32.pt`; a state dict saved alone too). Below,
# a synthetic checkpoint written in that form (the micro model stands in for ViT-B/16; nothing downloads), evaluated
# with average pooling: the global scorer gives the means, not the class token.

# %%
from powerclip.model import encode, pool_of
torch.manual_seed(2)
_avg = create_model('powerclip-micro', pool='avg')[0].eval()
(d / 'authors').mkdir()
torch.save(dict(epoch=32, name='powerclip-micro-avg',
                state_dict={f'module.{k}': v for k, v in _avg.state_dict().items()},
                optimizer={'state': {}, 'param_groups': []}), d / 'authors' / 'epoch_32.pt')
_la = load_model('powerclip-micro', d / 'authors' / 'epoch_32.pt', pool='avg')
test_eq((pool_of(_la.model), _la.spec['pool'], _la.ckpt_id[-4:], list(_la.scorers)), ('avg', 'avg', '-avg', ['global']))
assert all(torch.equal(v, _avg.state_dict()[k]) for k, v in _la.model.state_dict().items())
_lt = load_model('powerclip-micro', d / 'authors' / 'epoch_32.pt')                     # the same weights, class token
test_eq((pool_of(_lt.model), _lt.ckpt_id, _la.ckpt_id), ('tok', _la.ckpt_id[:-4], _lt.ckpt_id + '-avg'))
_x = torch.randn(2, 3, 32, 32)
_tk = _la.tokenizer(['a red circle', 'two blue squares'])
with torch.no_grad():
    _e = encode(_avg, _x, _tk)
    torch.testing.assert_close(_la.scorers['global'].image_features(_la.model, _x)['image'], _e['image'])
    torch.testing.assert_close(_la.scorers['global'].text_features(_la.model, _tk)['text'], _e['text'])
    assert not torch.allclose(_lt.scorers['global'].text_features(_lt.model, _tk)['text'], _e['text'])
# a run folder's config.yaml says how it pools; a method that cannot pool that way is refused
(d / 'avgrun').mkdir()
torch.save(_avg.state_dict(), d / 'avgrun' / 'model.pt')
(d / 'avgrun' / 'config.yaml').write_text('model: {name: powerclip-micro, pool: avg}\nmethod: clip\nmethod_cfg: {}\n')
test_eq(pool_of(load_model(checkpoint=d / 'avgrun').model), 'avg')
test_fail(lambda: load_model(checkpoint=d / 'avgrun', method='aclip'), contains="method 'aclip' pools by tok")

# %% [markdown]
# **open_clip's folders.** The same average-pooled weights as open_clip would leave them, the micro model standing in:
# a release (its `model_cfg` the micro config with `pool_type: avg`, its own normalisation, the weights as
# `open_clip_pytorch_model.bin`, then as `open_clip_model.safetensors`) and a training run (`params.txt` naming the
# architecture, `epoch_2.pt` and `epoch_10.pt` under `module.`): each loads with no name given, the run folder as its
# latest epoch (10, not 2), another epoch by its file. A release whose config differs from every registered one is
# built from the closest, the difference as kwargs. The release is trained pooling by the mean: named as
# `powerclip-micro` (which pools by the class token) it is still pooled by the mean, with one warning line; an
# explicit `pool='tok'` is obeyed, with one warning line too.

# %%
import io as _io
from safetensors.torch import save_file
import open_clip
_cfg = open_clip.get_model_config('powerclip-micro')
_cfg['vision_cfg']['pool_type'] = 'avg'
(d / 'hub').mkdir()
(d / 'hub' / 'open_clip_config.json').write_text(json.dumps(dict(model_cfg=_cfg, preprocess_cfg=dict(
    mean=[0.5, 0.5, 0.5], std=[0.5, 0.5, 0.5]))))
torch.save(_avg.state_dict(), d / 'hub' / 'open_clip_pytorch_model.bin')
_lr = load_model(checkpoint=d / 'hub')
test_eq((_lr.spec, _lr.ckpt_id, list(_lr.scorers)),
        (dict(name='powerclip-micro', kwargs={}, pool='avg'), sha256_file(d / 'hub' / 'open_clip_pytorch_model.bin')
         + '-avg', ['global']))
assert all(torch.equal(v, _avg.state_dict()[k]) for k, v in _lr.model.state_dict().items())
test_eq(_lr.preprocess.transforms[-1].mean, (0.5, 0.5, 0.5))                  # the release's own normalisation
save_file({k: v.contiguous() for k, v in _avg.state_dict().items()}, d / 'hub' / 'open_clip_model.safetensors')
_ls = load_model(checkpoint=d / 'hub')                                         # safetensors first, as open_clip
test_eq((_ls.ckpt_id, _ls.spec['pool']), (sha256_file(d / 'hub' / 'open_clip_model.safetensors') + '-avg', 'avg'))
assert all(torch.equal(v, _avg.state_dict()[k]) for k, v in _ls.model.state_dict().items())
(d / 'logs' / 'r1' / 'checkpoints').mkdir(parents=True)
(d / 'logs' / 'r1' / 'params.txt').write_text('batch_size: 8\nforce_quick_gelu: False\nmodel: powerclip-micro\n')
for _n, _m in ((2, _avg), (10, create_model('powerclip-micro')[0])):
    torch.save(dict(epoch=_n, name='r1', state_dict={f'module.{k}': v for k, v in _m.state_dict().items()},
                    optimizer={}), d / 'logs' / 'r1' / 'checkpoints' / f'epoch_{_n}.pt')
_l10 = load_model(checkpoint=d / 'logs' / 'r1')
_l2 = load_model(checkpoint=d / 'logs' / 'r1' / 'checkpoints' / 'epoch_2.pt')
assert all(torch.equal(v, _m.state_dict()[k]) for k, v in _l10.model.state_dict().items())
test_eq(Path(_l10.weights).name, 'epoch_10.pt')
assert all(torch.equal(v, _avg.state_dict()[k]) for k, v in _l2.model.state_dict().items())
test_eq((_l10.spec['name'], _l10.spec['pool']), ('powerclip-micro', 'tok'))     # params.txt: micro, class token
_cfg16 = dict(_cfg, embed_dim=16)
(d / 'hub16').mkdir()
(d / 'hub16' / 'open_clip_config.json').write_text(json.dumps(dict(model_cfg=_cfg16, preprocess_cfg={})))
torch.manual_seed(0)
_m16 = open_clip.create_model('powerclip-micro', embed_dim=16)
torch.save(_m16.state_dict(), d / 'hub16' / 'open_clip_pytorch_model.bin')
test_eq(load_model(checkpoint=d / 'hub16').spec, dict(name='powerclip-micro', kwargs=dict(embed_dim=16), pool='avg'))
_h = logging.StreamHandler(_buf := _io.StringIO())
logging.getLogger().addHandler(_h)
try:
    test_eq(load_model('powerclip-micro', d / 'hub').spec['pool'], 'avg')
    _said_named = _buf.getvalue()
    _buf.truncate(0)
    _buf.seek(0)
    test_eq(load_model('powerclip-micro', d / 'hub', pool='tok').spec['pool'], 'tok')
    _said_asked = _buf.getvalue()
finally:
    logging.getLogger().removeHandler(_h)
print(_said_named + _said_asked)
assert _said_named.count('pooling:') == 1 and "'avg', as the checkpoint was trained" in _said_named, _said_named
assert _said_asked.count('pooling:') == 1 and "'tok' as --pool asks" in _said_asked, _said_asked
test_eq(choose_pool(None, None, 'tok', True, None), (None, None))              # nothing recorded: the architecture's
test_eq(choose_pool(None, 'avg', 'avg', True, 'x'), ('avg', None))
test_eq(choose_pool(None, 'avg', 'tok', False, 'x'), ('avg', None))            # nothing named: nothing to disagree
test_eq(choose_pool('avg', 'avg', 'tok', True, 'x'), ('avg', None))

# %% [markdown]
# A folder in no layout, a release without weights, a config that is not JSON or holds no `model_cfg`, an unreadable
# `.safetensors`, and a `params.txt` naming an architecture unknown here: one line each.

# %%
(d / 'empty').mkdir()
test_fail(lambda: load_model(checkpoint=d / 'empty'), contains='no checkpoint in a known layout')
(d / 'noweights').mkdir()
(d / 'noweights' / 'open_clip_config.json').write_text('{}')
test_fail(lambda: load_model(checkpoint=d / 'noweights'), contains='no weights beside it')
(d / 'noweights' / 'open_clip_pytorch_model.bin').write_bytes((d / 'hub' / 'open_clip_pytorch_model.bin').read_bytes())
test_fail(lambda: load_model(checkpoint=d / 'noweights'), contains='no open_clip model config')
(d / 'noweights' / 'open_clip_config.json').write_text('{"model_cfg": ')
test_fail(lambda: load_model(checkpoint=d / 'noweights'), contains='not a JSON file')
(d / 'badst').mkdir()
(d / 'badst' / 'open_clip_model.safetensors').write_bytes(b'not safetensors')
test_fail(lambda: load_model('powerclip-micro', d / 'badst'), contains='not a safetensors file')
(d / 'logs' / 'r1' / 'params.txt').write_text('model: no-such-arch\n')
test_fail(lambda: load_model(checkpoint=d / 'logs' / 'r1'), contains='(named by')

# %% [markdown]
# A method with modules of its own (SmartCLIP's mask network here) gets them back with the run's weights, from
# `method_modules.pt` beside `model.pt` or from inside a trainer checkpoint, and hands them to its scorers:

# %%
_mods = get_method('smartclip', {'heads': 2}).build_modules(create_model('powerclip-micro')[0])
with torch.no_grad():
    [q.add_(1.0) for q in _mods.parameters()]                    # weights no fresh module has
(d / 'sc').mkdir()
torch.save(_sd, d / 'sc' / 'model.pt')
torch.save(_mods.state_dict(), d / 'sc' / 'method_modules.pt')
(d / 'sc' / 'config.yaml').write_text('model: {name: powerclip-micro}\nmethod: smartclip\nmethod_cfg: {heads: 2}\n')
_lm = load_model(checkpoint=d / 'sc')
assert all(torch.equal(v, _mods.state_dict()[k]) for k, v in _lm.modules.state_dict().items())
torch.save(dict(model=_sd, method_modules=_mods.state_dict(),
                config=dict(model=dict(name='powerclip-micro'), method='smartclip',
                                                                          method_cfg=dict(heads=2))),
           d / 'sc' / 'last.pt')
assert all(torch.equal(v, _mods.state_dict()[k])
           for k, v in load_model(checkpoint=d / 'sc' / 'last.pt').modules.state_dict().items())
assert load_model(checkpoint=d / 'run').modules is None                               # FILIP trains no module


# %% [markdown]
# ## The feature cache
#
# Features are cached under `cache_dir/<checkpoint id>/<name>-<key>.pt`: the name says what (image, text or data
# set features), by which scorer (with a hash of its settings, if it has any) and at which precision; the key hashes
# the inputs (paths with size and mtime, or texts). A rerun reads them back instead of running the model. The
# full checkpoint id names the folder: a prefix could merge two seeds.

# %%
#| export
class FeatureCache:
    "Feature dicts on disk under `root/<checkpoint id>/<name>-<key>.pt`; `root=None` disables caching."
    def __init__(self, root, ckpt_id: str):
        self.dir = None if root is None else Path(root) / ckpt_id
        self.hits = self.misses = 0
    @staticmethod
    def key(items: list) -> str:
        def ident(x):
            if isinstance(x, Path):
                st = x.stat()
                return [str(x.resolve()), st.st_size, st.st_mtime_ns]
            return x
        return hashlib.sha256(json.dumps([ident(x) for x in items]).encode()).hexdigest()[:24]
    def get(self, name: str, items: list, compute):
        if self.dir is None:
            return compute()
        f = self.dir / f'{name}-{self.key(items)}.pt'
        if f.is_file():
            try:
                x = torch.load(f, weights_only=True)
                self.hits += 1
                return x
            except Exception as e:   # cut short, zeroed, not a torch file: never trusted, computed again and replaced
                print(f"feature cache: {f} cannot be read ({type(e).__name__}: {str(e).strip().splitlines()[0][:80]}"
                      "): computed again", file=sys.stderr, flush=True)
        self.misses += 1
        x = compute()
        f.parent.mkdir(parents=True, exist_ok=True)
        tmp = f.with_suffix('.tmp')
        torch.save(x, tmp)
        tmp.replace(f)   # atomic: a killed run leaves no half file
        return x


# %% [markdown]
# ## The evaluator
#
# An `Evaluator` holds a loaded model, its scorers and the cache. For a scorer (default: the headline) it gives
# `image_features(paths)` and `text_features(texts)` (dicts of tensors with one row per input, float32 on the CPU,
# cached), `dataset_features` for a torch data set of `(image, label)` (clip_benchmark's readers), `scores(img, txt)`
# `(I, T)` computed in blocks of images, and `pair_scores` for a list of (image, caption) pairs (hard negatives,
# Winoground) without the full matrix. Images go through the model's own `preprocess`; captions through its tokenizer
# (on the world's captions the same ids as the gold-tree tokens of training, `68_eval_world_scores`).
#
# `device` 'cuda' moves batches there (default: where the model is); `precision` 'bf16' runs the towers under
# `torch.autocast` (bfloat16, on CUDA or CPU) and caches its features apart from fp32 ones.
#
# **Nothing non-finite is scored.** Finite weights can still give non-finite features (a forward pass that overflows,
# e.g. in bfloat16) or scores. Features are checked when computed and when read from the cache, scores when computed:
# either stops the evaluation with `NonFiniteFeatures`, one line naming the checkpoint, the scorer and the precision.
# An image file that does not decode at feature time (it changed after the readers checked it) stops with `BadData`
# naming it; so does a bad file inside a data set read by clip_benchmark's readers (`dataset_features`), which cannot
# skip it: the line names the data set and, for a webdataset, the shard and the sample's key.

# %%
#| export
class NonFiniteFeatures(ValueError):
    "A scorer returned NaN or infinite features or scores (non-finite weights, or a forward pass that overflows)."

def _reader_failed(e: Exception) -> str:
    """One line for an error raised by a data set's own reader (clip_benchmark's; webdataset's DecodingError has no
    message, only where)."""
    where = {k: getattr(e, k) for k in ('url', 'key', 'k') if getattr(e, k, None)}
    what = str(e) or ', '.join(f'{k} {v}' for k, v in where.items())
    return (f"the data set's reader failed on a file it holds ({type(e).__name__}: {what}); it cannot skip "
            "bad files: remove or fix it")

def _rows(d: dict, idx) -> dict:
    "Rows `idx` (a slice or an index tensor) of every tensor of a feature dict."
    return {k: v[idx] for k, v in d.items()}

def _cat(ds: list) -> dict:
    return {k: torch.cat([d[k] for d in ds]) for k in ds[0]}

@dataclass
class Evaluator:
    lm: LoadedModel
    cache: FeatureCache
    batch_size: int = 64
    device: str | None = None       # None: where the model is
    progress: bool = True
    precision: str = 'fp32'
    workers: int = 0                # DataLoader workers for the benchmark data sets
    score_block: int = 1024         # images per block of `scores`

    def __post_init__(self):
        if self.precision not in ('fp32', 'bf16'):
            raise ValueError(f"precision must be 'fp32' or 'bf16', got {self.precision!r}")
        if self.device is None:
            self.device = str(next(self.lm.model.parameters()).device)

    model = property(lambda self: self.lm.model)
    preprocess = property(lambda self: self.lm.preprocess)
    tokenizer = property(lambda self: self.lm.tokenizer)
    ckpt_id = property(lambda self: self.lm.ckpt_id)
    spec = property(lambda self: self.lm.spec)
    method = property(lambda self: self.lm.method)
    scorers = property(lambda self: self.lm.scorers)

    @property
    def headline(self) -> str:
        "The name of the method's own scorer (the first)."
        return next(iter(self.scorers))

    def scorer(self, name: str | None = None) -> Scorer:
        name = name or self.headline
        if name not in self.scorers:
            raise ValueError(f'scorer {name!r} is not offered by method {self.method!r}: {list(self.scorers)}')
        return self.scorers[name]

    def _name(self, kind: str, scorer: str | None) -> str:
        "Cache name: what, which scorer (and a hash of its settings), which precision."
        name = scorer or self.headline
        settings = {k: v for k, v in sorted(vars(self.scorer(name)).items())}
        tag = f'{kind}-{name}' + (f'-{hashlib.sha256(repr(settings).encode()).hexdigest()[:8]}' if settings else '')
        return tag if self.precision == 'fp32' else f'{tag}-{self.precision}'

    def _autocast(self):
        return torch.autocast(device_type=torch.device(self.device).type, dtype=torch.bfloat16,
                              enabled=self.precision == 'bf16')

    def _finite(self, f: dict, what: str, scorer: str | None) -> dict:
        "`f` itself, or `NonFiniteFeatures` when one of its float tensors is not finite."
        bad = [k for k, v in f.items() if v.is_floating_point() and not torch.isfinite(v).all()]
        if bad:
            hint = ('; in bfloat16 a forward pass overflows sooner: try --precision fp32'
                    if self.precision == 'bf16' else '')
            raise NonFiniteFeatures(f'non-finite {what} {bad} from checkpoint {self.ckpt_id[:16]} (scorer '
                                    f'{scorer or self.headline!r}, precision {self.precision}): non-finite weights or '
                                    f'a forward pass that overflows{hint}')
        return f

    def _features(self, fn, x, what: str, scorer: str | None) -> dict:
        with torch.no_grad(), self._autocast():
            f = fn(self.model, x.to(self.device, non_blocking=True))
        return self._finite({k: (v.float() if v.is_floating_point() else v).cpu() for k, v in f.items()},
                            f'{what} features', scorer)

    def encode_images(self, x: torch.Tensor, scorer: str | None = None) -> dict:
        "`(B, 3, H, W)` preprocessed batch -> the scorer's image features, B rows each, float32 on the CPU."
        return self._features(self.scorer(scorer).image_features, x, 'image', scorer)

    def encode_texts(self, texts: list, scorer: str | None = None) -> dict:
        "B captions -> the scorer's text features, B rows each."
        return self._features(self.scorer(scorer).text_features, self.tokenizer(list(texts)), 'text', scorer)

    def image_features(self, paths: list, scorer: str | None = None) -> dict:
        "Features of image files (cached)."
        paths = [Path(p) for p in paths]
        def compute():
            out = []
            for i in tqdm(range(0, len(paths), self.batch_size), desc='images', disable=not self.progress, leave=False):
                x = torch.stack([self.preprocess(read_image(p)) for p in paths[i:i + self.batch_size]])
                out.append(self.encode_images(x, scorer))
            return _cat(out)
        return self._finite(self.cache.get(self._name('img', scorer), paths, compute), 'image features', scorer)

    def text_features(self, texts: list, scorer: str | None = None) -> dict:
        "Features of captions (cached)."
        texts = list(texts)
        def compute():
            return _cat([self.encode_texts(texts[i:i + self.batch_size], scorer)
                         for i in tqdm(range(0, len(texts), self.batch_size), desc='texts',
                                       disable=not self.progress, leave=False)])
        return self._finite(self.cache.get(self._name('txt', scorer), texts, compute), 'text features', scorer)

    def dataset_features(self, make_ds, key: list, scorer: str | None = None,
                         desc: str = 'images') -> tuple[dict, torch.Tensor]:
        """Features and labels `(n,)` of the torch data set `make_ds()` (yielding `(image tensor, label)`), cached under
        `key`: a cache hit does not even open the data set."""
        def compute():
            from torch.utils.data import DataLoader
            ds, xs, ys = make_ds(), [], []
            loader = DataLoader(ds, batch_size=self.batch_size, num_workers=self.workers,
                                pin_memory=torch.device(self.device).type == 'cuda')
            batches = iter(tqdm(loader, desc=desc, disable=not self.progress, leave=False))
            while True:
                try:
                    x, y = next(batches)
                except StopIteration:
                    break
                except Exception as e:
                    # a bad file inside a data set we do not read ourselves
                    raise BadData(f'{desc}: ' + _reader_failed(e)) from e
                xs.append(self.encode_images(x, scorer))
                ys.append(torch.as_tensor(y).long().reshape(-1))
            if not xs:
                raise MissingData(f'{desc}: the data set yielded no image')
            return dict(x=_cat(xs), y=torch.cat(ys))
        d = self.cache.get(self._name('ds', scorer), key, compute)
        return self._finite(d['x'], 'image features', scorer), d['y']

    @torch.no_grad()
    def scores(self, img: dict, txt: dict, scorer: str | None = None) -> torch.Tensor:
        "Features of I images and T captions -> `(I, T)` float32 scores on the CPU, in blocks of `score_block` images."
        s, n = self.scorer(scorer), len(next(iter(img.values())))
        txt = {k: v.to(self.device) for k, v in txt.items()}
        S = torch.cat([s.scores({k: v.to(self.device) for k, v in _rows(img, slice(i, i + self.score_block)).items()},
                                txt).float().cpu()
                       for i in range(0, n, self.score_block)]) if n else torch.zeros(0, len(next(iter(txt.values()))))
        return self._finite({'scores': S}, 'scores', scorer)['scores']

    def pair_scores(self, img: dict, txt: dict, rows, cols, scorer: str | None = None) -> torch.Tensor:
        "Scores `(n,)` of the pairs (image `rows[j]`, caption `cols[j]`), one block of images at a time."
        rows, cols = torch.as_tensor(rows, dtype=torch.long), torch.as_tensor(cols, dtype=torch.long)
        out, images = torch.empty(len(rows)), rows.unique()
        for i in range(0, len(images), self.score_block):
            block = images[i:i + self.score_block]                              # (B,) image rows of this block
            sel = torch.isin(rows, block).nonzero().flatten()                   # pairs with an image in the block
            need = cols[sel].unique()                                           # (C,) captions they need
            S = self.scores(_rows(img, block), _rows(txt, need), scorer)        # (B, C)
            out[sel] = S[torch.searchsorted(block, rows[sel]), torch.searchsorted(need, cols[sel])]
        return out

    @classmethod
    def of(cls, lm: LoadedModel, cache_dir=None, **kw) -> 'Evaluator':
        "An evaluator of a loaded model; `cache_dir` None: no feature cache."
        return cls(lm, FeatureCache(cache_dir, lm.ckpt_id), **kw)

    @classmethod
    def build(cls, model_name: str | None, checkpoint=None, cache_dir=None, seed: int = 0, device: str = 'cpu',
              model_kwargs: dict | None = None, method: str | None = None, pool: str | None = None,
              **kw) -> 'Evaluator':
        "`load_model` then `of`."
        lm = load_model(model_name, checkpoint, seed, device, model_kwargs, method, pool=pool)
        return cls.of(lm, cache_dir, device=device, **kw)


# %% [markdown]
# The global scorer's features are the cosine-ready embeddings, and `scores` is their product; FILIP's checkpoint
# above is scored both ways, its features cached apart. On the CPU, bfloat16 autocast gives embeddings within a few
# hundredths of float32 ones (cosine > 0.99), and the cache keeps the two apart. `pair_scores` picks the same numbers
# out of the full matrix, in any block size.

# %%
_ev = Evaluator.build('powerclip-micro', None, progress=False)
_ev16 = Evaluator.build('powerclip-micro', None, progress=False, precision='bf16')
_x = torch.randn(3, 3, 32, 32)
_f, _f16 = _ev.encode_images(_x), _ev16.encode_images(_x)
test_eq(list(_f), ['image'])
test_eq(_f16['image'].dtype, torch.float32)
_cos = (_f['image'] * _f16['image']).sum(1)
assert _cos.min() > 0.99, _cos
_t = _ev.encode_texts(['a red circle', 'a blue square'])
assert (_t['text'] * _ev16.encode_texts(['a red circle', 'a blue square'])['text']).sum(1).min() > 0.99
torch.testing.assert_close(_ev.scores(_f, _t), _f['image'] @ _t['text'].T)
test_eq((_ev._name('img', None), _ev16._name('img', None)), ('img-global', 'img-global-bf16'))
test_fail(lambda: Evaluator.build('powerclip-micro', None, precision='fp8'), contains='precision')

_fe = Evaluator.of(a, cache_dir=d / 'cache', progress=False, score_block=2)
test_eq((_fe.headline, _fe._name('img', 'global')), ('late', 'img-global'))
assert _fe._name('img', 'late').startswith('img-late-')
_paths = []
for i in range(5):
    _paths.append(d / f'im{i}.png')
    Image.fromarray(torch.randint(0, 255, (32, 32, 3), dtype=torch.uint8).numpy()).save(_paths[-1])
_caps = ['a red circle', 'a small blue square', 'a cross', 'two green diamonds']
for _s in ('late', 'global'):
    _I, _T = _fe.image_features(_paths, _s), _fe.text_features(_caps, _s)
    _S = _fe.scores(_I, _T, _s)                                                  # (5, 4), in blocks of 2 images
    test_eq(_S.shape, (5, 4))
    _r, _c = torch.tensor([4, 0, 0, 3, 1, 4]), torch.tensor([1, 3, 0, 3, 2, 0])
    torch.testing.assert_close(_fe.pair_scores(_I, _T, _r, _c, _s), _S[_r, _c])
test_eq((_fe.cache.misses, _fe.cache.hits), (4, 0))
_fe.image_features(_paths, 'late')
test_eq(_fe.cache.hits, 1)
for _f in Path(_fe.cache.dir).glob('*.pt'):                                   # every entry cut short
    _f.write_bytes(_f.read_bytes()[:100])
with contextlib.redirect_stderr(_io.StringIO()) as _err:
    torch.testing.assert_close(_fe.image_features(_paths, 'late'), _I_late := _fe.image_features(_paths, 'late'))
assert 'cannot be read' in _err.getvalue() and 'computed again' in _err.getvalue(), _err.getvalue()
test_eq(_fe.cache.hits, 2)                                                   # the recomputed entry replaced the cut one
test_fail(lambda: _fe.scorer('nosuch'), contains='not offered')


# %% [markdown]
# A diverged checkpoint is refused when it is read: all weights NaN, one NaN tensor, one infinite value, in a plain
# state dict or a trainer checkpoint, before a model is built. Finite weights that give non-finite features (here a
# model modified in memory, and below one that overflows only in bfloat16) stop at the first batch; one line each.

# %%
def _broken(kind):
    sd = {k: v.clone() for k, v in _sd.items()}
    if kind == 'all NaN':
        sd = {k: torch.full_like(v, float('nan')) if v.is_floating_point() else v for k, v in sd.items()}
    if kind == 'one NaN tensor':
        sd['visual.proj'].fill_(float('nan'))
    if kind == 'one Inf value':
        sd['text_projection'][3, 1] = float('-inf')
    return sd
for _kind, _trainer in [('all NaN', False), ('one NaN tensor', True), ('one Inf value', False)]:
    _f = d / f'broken-{_kind}.pt'
    torch.save(dict(model=_broken(_kind), config=dict(model=dict(name='powerclip-micro'))) if _trainer
               else _broken(_kind), _f)
    test_fail(lambda: load_model('powerclip-micro', _f), contains='non-finite weights')
    try:
        load_model('powerclip-micro', _f)
    except NonFiniteWeights as e:
        print(e)
_bad = load_model('powerclip-micro')
with torch.no_grad():
    _bad.model.visual.proj.fill_(float('nan'))
test_fail(lambda: Evaluator.of(_bad).encode_images(_x), contains='non-finite image features')


# %% [markdown]
# Finite weights whose features are finite in float32 but not in bfloat16: the last LayerNorm outputs a one-hot
# vector (weight 0, bias $e_0$) and the projection's first row holds $3.4 \cdot 10^{38}$, below float32's largest
# number but above bfloat16's ($3.39 \cdot 10^{38}$). In float32 the embedding's norm overflows and normalising
# gives zeros (finite, and useless); autocast rounds the projection to bfloat16 infinities and the features are NaN.

# %%
def overflow_bf16(lm):
    "Make a micro model's image features overflow in bfloat16 only (finite weights)."
    with torch.no_grad():
        v = lm.model.visual
        v.ln_post.weight.zero_()
        v.ln_post.bias.zero_()
        v.ln_post.bias[0] = 1.0
        v.proj.zero_()
        v.proj[0] = 3.4e38
    return lm
_ov = overflow_bf16(load_model('powerclip-micro'))
assert not nonfinite_tensors(_ov.model.state_dict())
assert torch.isfinite(Evaluator.of(_ov).encode_images(_x)['image']).all()
test_fail(lambda: Evaluator.of(_ov, precision='bf16').encode_images(_x), contains='try --precision fp32')

# %% [markdown]
# The log: loading a checkpoint says nothing about a random initialisation; a random initialisation says so once,
# in our words.

# %%
import io as _io
_h = logging.StreamHandler(_buf := _io.StringIO())
logging.getLogger().addHandler(_h)
try:
    load_model(checkpoint=d / 'run')
    _loaded_log = _buf.getvalue()
    _buf.truncate(0)
    _buf.seek(0)
    load_model('powerclip-micro', seed=3)
    _random_log = _buf.getvalue()
finally:
    logging.getLogger().removeHandler(_h)
assert 'initialized randomly' not in _loaded_log + _random_log and 'random initialisation' not in _loaded_log
test_eq(_random_log.count('random initialisation (seed 3)'), 1)

# %% [markdown]
# Every scratch folder made above lives under one temporary folder, removed here, so running the notebook
# leaves nothing behind (a training run's checkpoints take hundreds of MB).

# %%
_scratch.cleanup()
