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
#| default_exp model

# %%
#| export
from __future__ import annotations

import types
from contextlib import contextmanager
from importlib import resources
from pathlib import Path

import open_clip
import torch
import torch.nn as nn
import torch.nn.functional as F

from powerclip.data import Geometry

# %%
#| hide
import tempfile
import time

from open_clip.factory import _MODEL_CONFIG_PATHS

from fastcore.test import test_eq, test_fail
from torch.testing import assert_close


# %% [markdown]
# # The model
#
# > open_clip's dual encoder: projected patch and token embeddings from one forward pass per tower.
#
# One way to drop patch tokens before the vision transformer, and the caption tokens that count as words. The model knows
# no method, no training and no distribution.

# %% [markdown]
# PowerCLIP changes the loss, not the architecture: the towers are open_clip's. What the loss needs beyond
# CLIP's two pooled vectors are the **patch embeddings** $[v_1,\dots,v_N]$ and the **token embeddings**
# $[t_1,\dots,t_L]$, both in the shared $D$-dimensional space (Sec. 3, "Problem Setting"). open_clip computes
# them on its way to the pooled vectors but returns them *before* the last norm and projection, so this
# notebook finishes the job with each tower's own final layers, and checks the result against open_clip's
# pooled outputs.
#
# ## Architectures as open_clip model configs
#
# The paper's model (Sec. 5.1) is ViT-B/16 at $224\times224$ with a 12-layer, 8-head, width-512 text
# Transformer and a 512-d shared space: exactly open_clip's built-in `ViT-B-16`. For CPU runs we add small
# architectures **in open_clip's own format**: JSON files in `powerclip/model_configs/` (package data,
# shipped with the wheel), registered with the public `open_clip.add_model_config(path)`. So every checkpoint
# the trainer writes loads back with plain open_clip:
#
# ```python
# powerclip.model.register_configs()
# model, _, preprocess = open_clip.create_model_and_transforms('powerclip-demo', pretrained='runs/demo/seed0/CLIP/model.pt')
# ```
#
# We chose files over inserting dicts into open_clip's private `_MODEL_CONFIGS`: `add_model_config` is
# open_clip's documented way, and `_rescan_model_configs` rebuilds the registry from the registered *paths*,
# so a dict inserted by hand is only safe as long as open_clip keeps the current merge behaviour. The JSON
# files are data, written once by hand; the cell after `register_configs` shows them and checks them.

# %%
#| export
def config_dir() -> Path:
    "The package's `model_configs/` folder: open_clip JSON model configs shipped as package data."
    return Path(str(resources.files('powerclip') / 'model_configs'))

def register_configs() -> list[str]:
    "Add `powerclip/model_configs/*.json` to open_clip's model registry (idempotent); returns their names."
    names = sorted(p.stem for p in config_dir().glob('*.json'))
    if not set(names) <= set(open_clip.list_models()):
        open_clip.add_model_config(config_dir())
    return names


# %%
names = register_configs()
assert register_configs() == names and sum(Path(p) == config_dir() for p in _MODEL_CONFIG_PATHS) == 1  # idempotent
for n in names:
    cfg = open_clip.get_model_config(n)
    v, t = cfg['vision_cfg'], cfg['text_cfg']
    # powerclip-demo reads 32 tokens (world captions are shorter than 20): shorter contexts are allowed, not longer
    assert v['image_size'] % v['patch_size'] == 0 and t['context_length'] <= 77 and t['vocab_size'] == 49408
    print(f"{n:16s} D={cfg['embed_dim']:4d}  vision {v['image_size']}px/{v['patch_size']} "
          f"{v['layers']}x{v['width']}  text {t['layers']}x{t['width']} ({t['heads']} heads)")
test_eq(open_clip.get_model_config('ViT-B-16')['text_cfg'] | {},
        dict(context_length=77, vocab_size=49408, width=512, heads=8, layers=12))

# %% [markdown]
# `create_model` builds a model by architecture name (an open_clip config: the paper's `ViT-B-16`, or one of ours).
# It never downloads: `pretrained` is `None` (random initialisation) or a path to a local checkpoint, and a
# pretrained *tag* is refused with a clear error. It returns open_clip's triple `(model, preprocess_train,
# preprocess_val)`, the model pooling as `pool` says (below: "Pooling").
#
# **Geometry.** The image size, the patch size and the text context length are the model's, and the data pipeline
# must produce exactly those. `model_geometry` reads them from the architecture's config and the run's
# `model.kwargs` (which replace whole entries, as open_clip's `model_kwargs` do), *before* the model is built, so
# that the loader and the model are made from the same numbers and nothing has to reconcile them afterwards.

# %% [markdown]
# **Pooling** (the section "Pooling: class token or average" below says what and why): a model pools both towers the
# same way, `'tok'` (CLIP: the class token and the caption's end token) or `'avg'` (the PowerCLIP authors' model: the
# mean of the patch tokens and of the caption's tokens). These are the helpers `create_model` applies; the checks
# come after `encode`.

# %%
#| export
# class token / EOT (CLIP) | mean of the patch tokens / of the caption's tokens (PowerCLIP's authors): weight-free
POOLS = ('tok', 'avg')
# SigLIP's attention-pooled image tower (one learned query; the text tower by EOT): an architecture, with weights
MAP = 'map'
ALL_POOLS = (*POOLS, MAP)

def _is_map_cfg(v: dict) -> bool:
    "A vision config that builds open_clip's one-query attentional pooler (the only MAP head supported)."
    ap = v.get('attentional_pool', False)
    if not ap:
        return False
    if ap is not True or v.get('attn_pooler_queries', 256) != 1 or v.get('pool_type', 'tok') != 'tok':
        raise NotImplementedError("vision attentional_pool: only the one-query pooler (attentional_pool true, "
                                  "attn_pooler_queries 1, pool_type tok) is supported")
    return True

def arch_pool(name: str, kwargs: dict | None = None) -> str:
    """The pooling architecture `name` (with `kwargs`) asks for: 'map' for a one-query attentional pooler, else its
    vision config's `pool_type`, 'tok' when not given."""
    v = {**open_clip.get_model_config(name), **(kwargs or {})}.get('vision_cfg') or {}
    if _is_map_cfg(v):
        return MAP
    pool = v.get('pool_type', 'tok')
    if pool not in POOLS:
        raise NotImplementedError(f"{name}: vision pool_type {pool!r} (supported: {', '.join(POOLS)})")
    return pool

def token_mean(
    tokens: torch.Tensor,  # (C, L, D) projected token embeddings
    ids: torch.Tensor,     # (C, L) long open_clip ids, 0 = padding
) -> torch.Tensor:         # (C, D)
    "The mean over each caption's tokens, SOT and EOT included, padding excluded (the text tower's 'avg' pooling)."
    w = (ids != 0).to(tokens.dtype)                                           # (C, L)
    return (tokens * w[..., None]).sum(1) / w.sum(1, keepdim=True).clamp_min(1)

def patch_mean(
    patches: torch.Tensor,                # (C, N, D) projected patch embeddings
    visible: torch.Tensor | None = None,  # (C, N) bool: the patches that count (hidden tokens do not), None: all
) -> torch.Tensor:                        # (C, D)
    "The mean over each image's (visible) patch embeddings (the image tower's 'avg' pooling)."
    if visible is None:
        return patches.mean(1)
    w = visible.to(patches.dtype)
    return (patches * w[..., None]).sum(1) / w.sum(1, keepdim=True).clamp_min(1)

def _encode_text_avg(self, text: torch.Tensor, normalize: bool = False) -> torch.Tensor:
    "open_clip's `encode_text` with 'avg' pooling: text `(C, L)` -> `(C, D)` (set on a model by `set_pool`)."
    y = self.forward_intermediates(None, text, text_indices=1, intermediates_only=True)['text_intermediates'][-1]
    x = token_mean(_text_proj(self, self.ln_final(y)), text)                 # (C, D)
    return F.normalize(x, dim=-1) if normalize else x

def _has_map(model) -> bool:
    return getattr(model.visual, 'attn_pool', None) is not None

def set_pool(model, pool: str):
    """Make both towers of an open_clip CLIP pool by `pool` ('tok' or 'avg'), in place: the image tower by open_clip's
    own `visual.pool_type`, the text tower by an instance-level `encode_text`; the weights are untouched. 'map' is an
    architecture (a trained head): a MAP model stays 'map' (its text tower by EOT); no model switches to or from it."""
    if pool not in ALL_POOLS:
        raise ValueError(f"pool: must be one of {', '.join(ALL_POOLS)}, got {pool!r}")
    if not isinstance(model, open_clip.CLIP) or not hasattr(model.visual, 'pool_type'):
        raise NotImplementedError(f'set_pool supports open_clip.CLIP with a ViT, got {type(model).__name__}')
    if (pool == MAP) != _has_map(model):
        have = 'its trained MAP head' if _has_map(model) else f'{model.visual.pool_type!r}'
        raise ValueError(f"pool: this model pools its image tower by {have}; 'map' is an architecture with weights, "
                         f"not a switch: build the model with create_model(name, pool={pool!r}) and train it")
    if pool == MAP:
        vars(model).pop('encode_text', None)
        return model
    model.visual.pool_type = pool
    if pool == 'avg':
        model.encode_text = types.MethodType(_encode_text_avg, model)
    else:
        vars(model).pop('encode_text', None)
    return model

def pool_of(model) -> str:
    "How `model` pools, 'tok', 'avg' or 'map'; a model whose two towers pool differently is refused."
    text = 'avg' if getattr(vars(model).get('encode_text'), '__func__', None) is _encode_text_avg else 'tok'
    if _has_map(model):
        if text != 'tok':
            raise NotImplementedError("a MAP model pools its text tower by EOT: set_pool(model, 'map')")
        return MAP
    if model.visual.pool_type != text:
        raise NotImplementedError(f"the image tower pools by {model.visual.pool_type!r}, the text tower by {text!r}: "
                                  "set_pool(model, pool) sets both")
    return text


# %%
#| export
def _known(name: str) -> None:
    register_configs()
    if name not in open_clip.list_models():
        raise ValueError(f'unknown model {name!r}: an open_clip architecture, e.g. ViT-B-16 or ours '
                         f'{sorted(p.stem for p in config_dir().glob("*.json"))}')

def map_kwargs(name: str, kw: dict, pool: str | None) -> dict:
    """The model kwargs that build `name` pooled by `pool`: for 'map' on an architecture without the head, its vision
    config with open_clip's one-query attentional pooler (heads: the tower's, or the most below them that divide D);
    a MAP architecture asked for 'tok' or 'avg' is refused (its head is weights, not a switch)."""
    arch = arch_pool(name, kw)
    if pool is None or (pool == MAP) == (arch == MAP):
        return kw
    if arch == MAP:
        raise ValueError(f"pool: {name} pools by its trained MAP head, not {pool!r} ('map' is an architecture)")
    cfg = {**open_clip.get_model_config(name), **kw}
    v = dict(cfg['vision_cfg'])
    heads = v['width'] // v.get('head_width', 64)
    heads = max(h for h in range(1, heads + 1) if cfg['embed_dim'] % h == 0)
    v.pop('pool_type', None)
    return {**kw, 'vision_cfg': {**v, 'attentional_pool': True, 'attn_pooler_queries': 1, 'attn_pooler_heads': heads}}

def create_model(name: str, pretrained: str | Path | None = None, pool: str | None = None, **kw):
    """`(model, preprocess_train, preprocess_val)` for an architecture name; `pretrained`: None or a local file;
    `pool`: 'tok' or 'avg' for both towers, 'map' (the image tower with a one-query attentional pooler, see "MAP"
    below), None: the architecture's own (`arch_pool`)."""
    _known(name)
    if pool is not None and pool not in ALL_POOLS:
        raise ValueError(f"pool: must be one of {', '.join(ALL_POOLS)}, got {pool!r}")
    kw = map_kwargs(name, kw, pool)
    if pretrained is not None and not Path(pretrained).is_file():
        raise FileNotFoundError('pretrained must be a local checkpoint file (nothing is '
                                f'downloaded), got {pretrained!r}')
    model, pre_train, pre_val = open_clip.create_model_and_transforms(
        name, pretrained=None if pretrained is None else str(pretrained), **kw)
    set_pool(model, pool or arch_pool(name, kw))
    return model, pre_train, pre_val

def _side(x, what: str) -> int:
    "An open_clip size (int or (h, w)) as one int; non-square sizes are not supported."
    if isinstance(x, (tuple, list)):
        if len(set(x)) != 1:
            raise NotImplementedError(f'non-square {what} {tuple(x)}')
        x = x[0]
    return int(x)

def model_geometry(name: str, kwargs: dict | None = None) -> Geometry:
    """Image size, patch size and context length of architecture `name` with `kwargs` (whole config entries), without
    building it."""
    _known(name)
    cfg = {**open_clip.get_model_config(name), **(kwargs or {})}
    v, t = cfg.get('vision_cfg') or {}, cfg.get('text_cfg') or {}
    if 'image_size' not in v or 'patch_size' not in v:
        raise NotImplementedError(f'{name}: not a ViT vision tower (no patch size)')
    return Geometry(_side(v['image_size'], 'image size'), _side(v['patch_size'], 'patch size'),
                    int(t.get('context_length', 77)))

def geometry_of(model) -> Geometry:
    "The geometry of a built model (to check it against `model_geometry`)."
    v = model.visual
    return Geometry(_side(v.image_size, 'image size'), _side(v.patch_size, 'patch size'), int(model.context_length))

def grid_size(model) -> tuple[int, int]:
    "`(gh, gw)`: the patch grid of the visual tower; N = gh * gw patch embeddings, row-major."
    return tuple(model.visual.grid_size)


# %%
torch.manual_seed(0)
model, _, preprocess = create_model('powerclip-tiny')
test_eq(grid_size(model), (8, 8))
print(f"powerclip-tiny: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters; "
      f"eval transform: {preprocess}")
test_fail(lambda: create_model('ViT-B-16', pretrained='openai'), contains='local checkpoint')
test_fail(lambda: create_model('demo'), contains='unknown model')   # architecture names only
# the geometry read from the configs is the built model's
test_eq(model_geometry('powerclip-tiny'), geometry_of(model))
test_eq(model_geometry('powerclip-tiny'), Geometry(64, 8, 77))
test_eq(model_geometry('ViT-B-16'), Geometry(224, 16, 77))
test_eq(model_geometry('powerclip-demo').context_length, 32)
_kw = dict(text_cfg=dict(context_length=32, vocab_size=49408, width=128, heads=4, layers=4))
test_eq(model_geometry('powerclip-tiny', _kw), Geometry(64, 8, 32))


# %% [markdown]
# ## Patch and token embeddings in one pass
#
# `CLIP.forward_intermediates` runs each tower once and returns, besides the pooled and projected vectors,
# the output of the last block: the $N$ patch tokens (class token removed) and the $L$ text tokens. These
# are still in the towers' widths. The pooled vectors are `proj(ln_post(x_cls))` for the image and
# `text_projection(ln_final(x_eot))` for the text; applying the same `ln_post` + `proj` to every patch token
# and `ln_final` + `text_projection` to every text token puts them in the shared space:
#
# $$v_n = W_v^\top\,\mathrm{LN}_{\text{post}}(x_n),\qquad t_l = W_t^\top\,\mathrm{LN}_{\text{final}}(y_l).$$
#
# They are returned **unnormalised**: Eqs. 2 and 4 sum them under a mask and normalise the sum. Only the
# standard ViT head (class-token pooling, norm before pooling, no attention pooler) is supported; other heads
# are refused with an error rather than silently projected the wrong way.
#
# A method may remove patch tokens before the transformer (FLIP, CLIP-PGS: see "Dropping patch tokens" below);
# the survivors are no longer on the grid, so such a method asks for no patches (`need_patches=False`), and
# `encode` refuses patches it cannot place.

# %%
#| export
def _check_heads(model) -> str:
    "The model's pooling ('tok' or 'avg'), after checking that its heads are the ones `encode` knows how to project."
    v = model.visual
    if not isinstance(model, open_clip.CLIP):
        raise TypeError(f'encode supports open_clip.CLIP models, got {type(model).__name__}')
    if _has_map(model):
        if v.attn_pool_contrastive is not None or v.attn_pool.query.shape[0] != 1 or v.proj is None:
            raise NotImplementedError('encode needs a MAP head of one query (open_clip attentional_pool=true, '
                                      'attn_pooler_queries=1)')
    elif v.final_ln_after_pool or v.pool_type not in POOLS or v.proj is None:
        raise NotImplementedError('encode needs the standard ViT head (class token or average pooling, ln_post before '
                                  'pooling, proj) or a one-query MAP head')
    if model.text_pool_type != 'argmax' or model.text_projection is None:
        raise NotImplementedError('encode needs the standard CLIP text head (EOT pooling, text_projection)')
    return pool_of(model)

def _text_proj(model, x: torch.Tensor) -> torch.Tensor:
    p = model.text_projection
    return p(x) if isinstance(p, nn.Linear) else x @ p

def _visible(model) -> torch.Tensor | None:
    "`(C, N')` bool: the patch tokens of the last forward pass that no selection hid (None: all of them)."
    sel = model.visual.patch_dropout
    mask = sel.key_mask if isinstance(sel, PatchTokenSelect) else None       # (C, 1 + n), True: hidden
    return None if mask is None else ~mask[:, 1:]

def map_patches(model, x: torch.Tensor) -> torch.Tensor:
    """A MAP model's patch embeddings: `(C, N, width)` last-block patch tokens -> `(C, N, D)`, each patch through the
    head as the head's output would be with all its attention on that patch (see "MAP" below)."""
    ap = model.visual.attn_pool
    a = ap.attn
    E = a.embed_dim
    w = a.in_proj_weight[2 * E:] if a._qkv_same_embed_dim else a.v_proj_weight           # (D, width) value projection
    b = None if a.in_proj_bias is None else a.in_proj_bias[2 * E:]
    v = a.out_proj(F.linear(ap.ln_k(x), w, b))                                          # (C, N, D)
    return model.visual.ln_post(v) @ model.visual.proj

def encode(model, image: torch.Tensor | None, tokens: torch.Tensor | None, need_patches: bool = True) -> dict:
    """One forward pass per tower. image `(C, 3, H, W)`, tokens `(C, L)` -> image `(C, D)`, text `(C, D)`
    (L2-normalised, pooled as the model pools: `pool_of`), patches `(C, N, D)`, tokens `(C, L, D)` (projected, not
    normalised; patches None unless `need_patches`), logit_scale `()` (exponentiated). A tower whose input is None is
    not run: its keys are absent (the evaluator encodes images and texts apart)."""
    pool = _check_heads(model)
    out = model.forward_intermediates(image, tokens, image_indices=1, text_indices=1, normalize=True,
                                      image_output_fmt='NLC', output_logit_scale_bias=True)
    enc = dict(logit_scale=out['logit_scale'])
    if out.get('logit_bias') is not None:                    # SigLIP's b, on models built with init_logit_bias
        enc['logit_bias'] = out['logit_bias']
    if image is not None:
        x = out['image_intermediates'][-1]                   # (C, N', width_v) last block, class token removed
        if need_patches and x.shape[1] != grid_size(model)[0] * grid_size(model)[1]:
            raise ValueError(f'{x.shape[1]} patch tokens reached the transformer, the grid has '
                             f'{grid_size(model)[0] * grid_size(model)[1]}: selected patches are off the '
                             'grid (need_patches=False)')
        if pool == MAP:
            p = map_patches(model, x) if need_patches else None                    # (C, N, D) through the head
        else:
            p = model.visual.ln_post(x) @ model.visual.proj if need_patches or pool == 'avg' else None   # (C, N', D)
        # 'tok', 'map': open_clip's pooled vector (class token; the MAP head); 'avg': the mean of the visible patches
        img = F.normalize(patch_mean(p, _visible(model)), dim=-1) if pool == 'avg' else out['image_features']
        enc.update(image=img, patches=p if need_patches else None)
    if tokens is not None:
        y = out['text_intermediates'][-1]                    # (C, L, width_t) last block
        t = _text_proj(model, model.ln_final(y))             # (C, L, D)
        txt = F.normalize(token_mean(t, tokens), dim=-1) if pool == 'avg' else out['text_features']   # 'map': EOT
        enc.update(text=txt, tokens=t)
    return enc


# %% [markdown]
# `encode` calls `forward_intermediates`, not `forward`. Under `DistributedDataParallel` the forward pass must
# go through the wrapper's `__call__` (that is where DDP prepares the gradient all-reduce), so `Encoder` is
# `encode` as a module: wrap `DDP(Encoder(model))`, and save `encoder.model.state_dict()` so that checkpoints
# keep open_clip's key names.

# %%
#| export
class Encoder(nn.Module):
    "`encode` as an `nn.Module` (for DDP and hooks); `self.model` is the open_clip model, saved as is."
    def __init__(self, model):
        super().__init__()
        self.model = model
    def forward(self, image: torch.Tensor, tokens: torch.Tensor, need_patches: bool = True) -> dict:
        return encode(self.model, image, tokens, need_patches)


# %% [markdown]
# The checks: the pooled vectors equal `encode_image` / `encode_text`; the projected class token and the
# projected EOT token are exactly those pooled vectors before normalisation (so the projection applied to
# the other tokens is the right one); the patch grid is row-major, which we test by perturbing one pixel
# block and finding the patch embedding that changes first-most. Everything in `eval()` mode.

# %%
from powerclip.parsing import ParsedCaption
from powerclip.tokens import collate_trees, tree_tokens
model.eval()
C = 2
img = torch.randn(C, 3, 64, 64, generator=torch.Generator().manual_seed(0))
pcs = [ParsedCaption('a red circle left of a blue square', 'a red circle left of a blue square'.split(),
                     [(0, 8), (0, 3), (3, 8), (3, 5), (5, 8)], ['S', 'NP', 'PP', 'ADVP', 'NP'], 'gold', []),
       ParsedCaption('a green cross', ['a', 'green', 'cross'], [(0, 3)], ['NP'], 'gold', [])]
tt = collate_trees([tree_tokens(p) for p in pcs])
with torch.no_grad():
    enc = encode(model, img, tt['tokens'])
    test_eq(enc['patches'].shape, (C, 64, 128))
    test_eq(enc['tokens'].shape, (C, 77, 128))
    test_eq(enc['image'].shape, (C, 128))
    test_eq(enc['logit_scale'].shape, ())
    assert_close(enc['image'], model.encode_image(img, normalize=True))
    assert_close(enc['text'], model.encode_text(tt['tokens'], normalize=True))
    assert_close(enc['logit_scale'], model.logit_scale.exp())
    assert all(torch.equal(enc[k], v) for k, v in Encoder(model)(img, tt['tokens']).items())
    # one tower at a time: the same numbers, only that tower's keys
    test_eq(set(encode(model, img, None)), {'image', 'patches', 'logit_scale'})
    test_eq(set(encode(model, None, tt['tokens'])), {'text', 'tokens', 'logit_scale'})
    assert_close(encode(model, img, None)['patches'], enc['patches'])
    assert_close(encode(model, None, tt['tokens'])['tokens'], enc['tokens'])
    # the same head on the pooled positions gives open_clip's unnormalised features
    fi = model.visual.forward_intermediates(img, indices=1, output_fmt='NLC', output_extra_tokens=True)
    cls = fi['image_intermediates_prefix'][-1][:, 0]                       # (C, width_v)
    assert_close(model.visual.ln_post(cls) @ model.visual.proj, model.encode_image(img))
    eot = tt['tokens'].argmax(-1)
    assert_close(enc['tokens'][torch.arange(C), eot], model.encode_text(tt['tokens']))
    # row-major grid: changing the pixels of patch (row 2, col 5) changes patch embedding 2 * 8 + 5 most
    img2 = img.clone()
    img2[:, :, 16:24, 40:48] += 3
    delta = (encode(model, img2, tt['tokens'])['patches'] - enc['patches']).norm(dim=-1)  # (C, N)
    test_eq(delta.argmax(-1).tolist(), [2 * 8 + 5] * C)


# %% [markdown]
# Gradient checkpointing (`model.set_grad_checkpointing`) recomputes the blocks in the backward pass;
# `forward_intermediates` honours it, so `encode` gives the same values and the same gradients with it on.

# %%
def _grads(m, ckpt):
    m.train()
    m.set_grad_checkpointing(ckpt)
    m.zero_grad()
    e = encode(m, img, tt['tokens'])
    (e['patches'].square().mean() + e['tokens'].square().mean()
     + e['logit_scale'] * (e['image'] * e['text']).sum()).backward()
    g = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.set_grad_checkpointing(False)
    m.eval()
    return e, g
e0, g0 = _grads(model, False)
e1, g1 = _grads(model, True)
assert_close(e0['patches'], e1['patches'])
test_eq(g0.keys(), g1.keys())
for n in g0:
    assert_close(g0[n], g1[n], rtol=1e-4, atol=1e-6)
assert len(g0) == sum(p.requires_grad for p in model.parameters())  # every parameter gets a gradient


# %% [markdown]
# ## Dropping patch tokens before the transformer
#
# FLIP drops a random half of the patch tokens of each training image, CLIP-PGS a chosen 30-50 %, and other
# methods choose by attention or by other rules; all of them take tokens out of the sequence right after the patch
# and position embeddings, so that the transformer really runs on fewer tokens. That is where open_clip's
# `VisionTransformer` calls `self.patch_dropout(x)` on the sequence `(C, 1 + N, width)` (class token first), in
# `forward` and `forward_intermediates` alike.
#
# `select_patch_tokens(model, keep)` is the one way to do it here: a context manager that puts a `PatchTokenSelect`
# in that place for the forward passes inside the `with` block, and puts back what was there when the block ends.
# `keep(x)` receives the token sequence and returns the indices `(C, K)` of the patches to keep (0-based among the
# $N$ patches); the class token always stays. A method therefore says explicitly, in its own `forward`, when and
# how tokens are selected, with whatever context its rule needs (pixels, noise, the step) held by `keep`; outside
# the block the model is plain open_clip, so evaluation, the `state_dict` and exported checkpoints never see a
# selection. The selecting module has no parameters or buffers.
#
# **Hidden tokens.** A batch runs at one sequence length, so a method whose images should lose *different* numbers
# of patches (E-CLIP: every patch of a random cluster) drops a common number and must hide the rest. `hide` marks
# kept tokens `(C, K)` bool that no query may attend to: they stay in the sequence (their own queries still run,
# see nothing of the hidden ones and feed nothing back), but every attention of the vision tower gives them a zero
# weight, as a key-padding mask: with $m_k=-\infty$ for a hidden key $k$ and 0 otherwise,
#
# $$\mathrm{softmax}_k\big(q_i\cdot k_k/\sqrt{d}+m_k\big)\quad\text{for every query } i \text{ of every block and head}.$$
#
# The class token and the visible patches then never see a hidden token, in any layer, so the image embedding is
# exactly that of the sequence with the hidden tokens removed (checked below): hiding is dropping, at the cost of
# carrying the hidden tokens along. `hide` is a tensor, or a function called with the same `x` right after
# `keep(x)` (for a rule that decides both at once inside the tower). The mask enters as the `attn_mask` argument of
# the vision transformer's blocks (open_clip passes it to `nn.MultiheadAttention` as an additive mask,
# `(C * heads, T, T)` with $-\infty$ on the hidden columns): within the block, the vision transformer's `forward` and
# `forward_intermediates` pass it on. Being an argument of each block, it is saved with the block's inputs by
# gradient checkpointing, so the recomputation in the backward pass, after the block has ended, masks alike (a hook
# that lived only inside the block would not). The text tower is untouched.

# %%
#| export
class PatchTokenSelect(nn.Module):
    """In place of open_clip's `visual.patch_dropout`: x `(C, 1 + N, width)` -> `(C, 1 + K, width)`, the class token and
    the patches `keep(x)` names."""
    def __init__(self, keep, hide=None):
        super().__init__()
        self.keep = keep                                        # x (C, 1 + N, width) -> (C, K) long in [0, N)
        self.hide = hide                                        # None | (C, K) bool | x -> (C, K) bool: kept but hidden
        self.key_mask: torch.Tensor | None = None               # (C, 1 + K) bool of the last call, True: no query sees
                                                                # it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx = self.keep(x)                                      # (C, K)
        if idx.dim() != 2 or idx.shape[0] != x.shape[0]:
            raise ValueError(f'keep must return (C, K) patch indices for C = {x.shape[0]}, got {tuple(idx.shape)}')
        hide = self.hide(x) if callable(self.hide) else self.hide
        if hide is None:
            self.key_mask = None
        else:
            if hide.shape != idx.shape or hide.dtype != torch.bool:
                raise ValueError(f'hide must be (C, K) = {tuple(idx.shape)} bool, got {tuple(hide.shape)} {hide.dtype}')
            cls = torch.zeros(x.shape[0], 1, dtype=torch.bool, device=x.device)
            self.key_mask = torch.cat([cls, hide.to(x.device)], dim=1)      # (C, 1 + K), the class token always visible
        idx = (idx.to(x.device) + 1)[..., None].expand(-1, -1, x.shape[-1])   # (C, K, width), past the class token
        return torch.cat([x[:, :1], x.gather(1, idx)], dim=1)   # (C, 1 + K, width), class token first


def _key_mask_bias(key_mask: torch.Tensor, heads: int, dtype) -> torch.Tensor:
    "key_mask `(C, T)` bool (True: hidden) -> the additive attention mask `(C * heads, T, T)` of nn.MultiheadAttention."
    C, T = key_mask.shape
    bias = torch.zeros(C, T, dtype=dtype, device=key_mask.device).masked_fill(key_mask, float('-inf'))  # (C, T)
    return bias[:, None, None, :].expand(C, heads, T, T).reshape(C * heads, T, T)        # row b * heads + h: image b


@contextmanager
def select_patch_tokens(model, keep, hide=None):
    """Within the block, the vision tower keeps the class token and the patch tokens `keep(x)` returns; `hide`
    (C, K) bool (or `hide(x)`) marks kept tokens that no query may attend to (see above)."""
    v = model.visual
    if getattr(v, 'class_embedding', None) is None or not hasattr(v, 'patch_dropout'):
        raise NotImplementedError("patch selection needs open_clip's VisionTransformer with a class token")
    old = v.patch_dropout
    if not isinstance(old, nn.Identity):
        raise ValueError(f'the vision tower already drops patches ({type(old).__name__}): one selection at a time')
    sel = v.patch_dropout = PatchTokenSelect(keep, hide)
    tr, wrapped = v.transformer, []
    if hide is not None:
        heads = tr.resblocks[0].attn.num_heads
        for name in ('forward', 'forward_intermediates'):      # the two ways open_clip's ViT enters its blocks
            if name in vars(tr):
                raise ValueError(f'the vision transformer already has an instance-level {name}')
            def masked(x, attn_mask=None, *args, _f=getattr(tr, name), **kw):
                if attn_mask is not None:
                    raise NotImplementedError('the vision transformer already has an attention mask')
                m = None if sel.key_mask is None else _key_mask_bias(sel.key_mask, heads, x.dtype)
                return _f(x, m, *args, **kw)
            setattr(tr, name, masked)
            wrapped.append(name)
    try:
        yield
    finally:
        v.patch_dropout = old
        for name in wrapped:
            delattr(tr, name)


# %% [markdown]
# Keeping patches 5, 0 and 9 of every image: the tokens entering the transformer (after `ln_pre`, which acts per
# token) are the class token and those three rows of the full sequence; outside the block nothing is selected, the
# state_dict is unchanged, and `encode` refuses patches while tokens are selected.

# %%
_seen = []
_hk = model.visual.ln_pre.register_forward_hook(lambda mod, args, y: _seen.append(args[0].detach().clone()))
_keys = set(model.state_dict())
with torch.no_grad():
    with select_patch_tokens(model, lambda x: torch.tensor([[5, 0, 9]]).expand(x.shape[0], -1)):
        _sel = encode(model, img, tt['tokens'], need_patches=False)
        test_fail(lambda: encode(model, img, tt['tokens']), contains='off the grid')
        assert set(model.state_dict()) == _keys
    _full = encode(model, img, tt['tokens'])
_hk.remove()
test_eq([s.shape[1] for s in _seen], [4, 4, 65])          # the refused call ran the tower too
assert_close(_seen[0], _seen[2][:, [0, 6, 1, 10]])
assert _sel['patches'] is None and isinstance(model.visual.patch_dropout, nn.Identity)
assert_close(_full['image'], enc['image'])
assert not torch.allclose(_sel['image'], enc['image'])
test_fail(lambda: PatchTokenSelect(lambda x: torch.zeros(3, dtype=torch.long))(torch.zeros(2, 5, 4)), contains='(C, K)')


# %% [markdown]
# Hidden tokens, against the attention written out by hand (float64, every block: `ln_1`, the heads' softmax with the
# hidden keys at $-\infty$, `out_proj`, the MLP; then `ln_post` of the class token and `proj`); and against dropping
# them: image 0 keeping patches `[5, 0, 9, 12]` with 0 and 12 hidden gives exactly the embedding of keeping `[5, 9]`
# (image 1 likewise), while the mask does change the embedding (against keeping all four visible). With gradient
# checkpointing the recomputation masks too; the text tower is untouched and nothing is left installed after the block.

# %%
def _manual_image(m, image, keep, hide):
    "The vision tower by hand, with a key mask: (C, 3, H, W) -> (C, D) unnormalised."
    v = m.visual
    x = v.conv1(image).flatten(2).transpose(1, 2)                                         # (C, N, width)
    x = torch.cat([v.class_embedding.expand(x.shape[0], 1, -1), x], 1) + v.positional_embedding   # (C, 1 + N, width)
    x = torch.cat([x[:, :1], x[:, 1:].gather(1, keep[..., None].expand(-1, -1, x.shape[-1]))], 1)  # (C, 1 + K, width)
    x = v.ln_pre(x)
    km = torch.cat([torch.zeros(x.shape[0], 1, dtype=torch.bool), hide], 1)              # (C, 1 + K)
    for b in v.transformer.resblocks:
        H, (C, T, W) = b.attn.num_heads, x.shape
        q, k, val = F.linear(b.ln_1(x), b.attn.in_proj_weight, b.attn.in_proj_bias).chunk(3, -1)
        q, k, val = (t.reshape(C, T, H, W // H).transpose(1, 2) for t in (q, k, val))   # (C, H, T, dh)
        logits = (q @ k.transpose(-1, -2) / (W // H) ** 0.5).masked_fill(km[:, None, None, :], float('-inf'))
        att = (logits.softmax(-1) @ val).transpose(1, 2).reshape(C, T, W)                # (C, T, width)
        x = x + b.attn.out_proj(att)
        x = x + b.mlp(b.ln_2(x))
    return v.ln_post(x[:, 0]) @ v.proj

_m64 = create_model('powerclip-tiny')[0].double().eval()
_img64 = img.double()
_kp = torch.tensor([[5, 0, 9, 12], [1, 2, 3, 60]])
_hd = torch.tensor([[False, True, False, True], [True, False, False, False]])
with torch.no_grad():
    with select_patch_tokens(_m64, lambda x: _kp, hide=_hd):
        _hid = encode(_m64, _img64, tt['tokens'], need_patches=False)
    with select_patch_tokens(_m64, lambda x: _kp, hide=lambda x: _hd):          # hide as a function of x
        _hid2 = encode(_m64, _img64, None, need_patches=False)
    with select_patch_tokens(_m64, lambda x: _kp):
        _vis = encode(_m64, _img64, None, need_patches=False)                    # nothing hidden
    _drop = []                                                                   # the hidden ones removed instead
    for c, kc in enumerate(([5, 9], [2, 3, 60])):
        with select_patch_tokens(_m64, lambda x: torch.tensor([kc])):
            _drop.append(encode(_m64, _img64[c:c + 1], None, need_patches=False)['image'])
    _man = F.normalize(_manual_image(_m64, _img64, _kp, _hd), dim=-1)
    _txt = encode(_m64, None, tt['tokens'])
assert_close(_hid['image'], _man, rtol=0, atol=1e-12)                            # = the attention by hand
assert torch.equal(_hid2['image'], _hid['image']) and torch.equal(_hid['text'], _txt['text'])
assert_close(_hid['image'], torch.cat(_drop), rtol=0, atol=1e-12)                 # hiding = dropping, per image
assert not torch.allclose(_vis['image'], _hid['image'])                          # the mask does act
assert isinstance(_m64.visual.patch_dropout, nn.Identity)
assert not {'forward', 'forward_intermediates'} & set(vars(_m64.visual.transformer))  # the class's methods again
# gradient checkpointing: the recomputation in backward (after the block) masks too (same values, same gradients)
_m64.train()
def _hidden_grads(ckpt):
    _m64.set_grad_checkpointing(ckpt)
    _m64.zero_grad()
    with select_patch_tokens(_m64, lambda x: _kp, hide=_hd):
        e = encode(_m64, _img64, None, need_patches=False)
    (e['image'] * torch.arange(e['image'].shape[1], dtype=torch.float64)).sum().backward()
    return e['image'].detach(), _m64.visual.transformer.resblocks[0].attn.in_proj_weight.grad.clone()
_e0, _g0 = _hidden_grads(False)
_e1, _g1 = _hidden_grads(True)
_m64.set_grad_checkpointing(False)
_m64.eval()
assert_close(_e0, _hid['image'])
assert_close(_e1, _e0)
assert_close(_g1, _g0)
test_fail(lambda: PatchTokenSelect(lambda x: _kp, hide=_hd[:, :3])(torch.zeros(2, 65, 4)), contains='hide must be')

# %% [markdown]
# ## Pooling: class token or average
#
# CLIP's image embedding is the class token of the last block, projected ($\mathrm{proj}(\mathrm{LN}(x_{\text{cls}}))$),
# and its text embedding the end token's ($\mathrm{proj}(\mathrm{LN}(y_{\text{eot}}))$). The PowerCLIP authors' code
# (github.com/Masakichi210/PowerCLIP, its README) says their model uses **average pooling for both the vision and the
# text encoder** instead. With `pool='avg'` the two global embeddings are
#
# $$\bar v=\frac1N\sum_{n=1}^N v_n,\qquad \bar t=\frac1{|\mathcal T|}\sum_{l\in\mathcal T} t_l,$$
#
# (then L2-normalised), the means of the same projected patch and token embeddings $v_n$, $t_l$ that PowerCLIP's
# region and phrase embeddings sum under masks (Eqs. 2-4). This is why pooling is not a detail for this method: under
# average pooling the global image embedding is the region embedding of the mask that covers the whole grid, so the
# CLIP term and the triplet term act on one representation; under class-token pooling they meet only through the shared
# trunk. `71_experiments`' anatomy measures what that does to their gradients.
#
# **Which tokens count in $\mathcal T$.** Every token of the caption but padding: the start token (SOT), the word
# pieces and the end token (EOT). This is a choice (their README does not say): a mean over the attention mask, SOT to
# EOT, is what an average pooling written for open_clip's tokenizer gives (the tokenizer pads with 0, and every other
# position is attended to), and it is the variant measured first on the world (the issue that asked for it). The
# alternative, the word pieces only, would make $\bar t$ the root node's phrase embedding exactly. If the authors'
# checkpoint pooled over the words only, evaluating it here would not fall to chance: SOT's output is the same for every
# caption and EOT's is close to the mean, so retrieval would lose a little, not everything. A first zero-shot number
# far below the paper's is the sign to try the other set.
#
# **How it is built.** open_clip has average pooling for the image tower (`vision_cfg.pool_type: avg`: the mean of
# the patch tokens after `ln_post`, then `proj`, which is linear, so it is the mean of the projected $v_n$); a model
# config that sets it loads in plain open_clip with the right image embedding. open_clip's text tower has no average
# pooling (`text_global_pool` knows first, last, argmax and eos), so `set_pool` gives the model an instance-level
# `encode_text` that takes the mean: every caller of `model.encode_text` (the evaluator's global scorer, the heat maps,
# C2LIP's concept embeddings, clip_benchmark's zero-shot classifier) then pools the same way, and `encode` (training)
# computes the same means from its projected tokens. A checkpoint trained with `'avg'` must therefore be loaded through
# `powerclip.model` (`create_model(name, pool='avg')`, or a run folder, whose `config.yaml` says `model.pool`): plain
# open_clip would pool its text tower by EOT.
#
# `ViT-B-16-avg` (in `model_configs/`) is the paper's ViT-B/16 with average pooling: `create_model('ViT-B-16-avg')`
# pools both towers by the mean, and it is the architecture to evaluate the authors' released checkpoints with.
#
# A method that hides tokens (E-CLIP's clusters) keeps them in the sequence: under `'avg'` `encode` averages the
# patches a selection left visible, which is what dropping the hidden ones would give. A-CLIP keeps class-token pooling
# (its EMA towers re-implement the CLIP heads, and its paper pools by the class token): it refuses `'avg'`.
#
# The checks: under `'avg'`, `encode`'s embeddings equal the means written out by hand, open_clip's own `encode_image`
# and the installed `encode_text` (what the evaluator calls), in float64; the pooling survives `copy.deepcopy` (A-CLIP's
# and the EMA's way of copying a model) and a state-dict round trip changes nothing (the weights are the same, only
# the heads' reading differs); hidden tokens do not count; a model whose towers disagree is refused.

# %%
import copy
_ma = create_model('powerclip-tiny', pool='avg')[0].double().eval()
_mt = create_model('powerclip-tiny')[0].double().eval()
_mt.load_state_dict(_ma.state_dict())
test_eq((pool_of(_ma), pool_of(_mt), arch_pool('ViT-B-16-avg'), arch_pool('ViT-B-16')), ('avg', 'tok', 'avg', 'tok'))
with torch.no_grad():
    _ea, _et = encode(_ma, img.double(), tt['tokens']), encode(_mt, img.double(), tt['tokens'])
    _L = (tt['tokens'] != 0).double()                                                       # (C, L)
    _t_hand = F.normalize((_et['tokens'] * _L[..., None]).sum(1) / _L.sum(1, keepdim=True), dim=-1)
    assert_close(_ea['image'], F.normalize(_et['patches'].mean(1), dim=-1), rtol=0, atol=1e-12)   # mean of the v_n
    assert_close(_ea['text'], _t_hand, rtol=0, atol=1e-12)                                      # mean of the t_l
    assert_close(_ea['image'], _ma.encode_image(img.double(), normalize=True), rtol=0, atol=1e-12)   # open_clip's avg
    assert_close(_ea['text'], _ma.encode_text(tt['tokens'], normalize=True), rtol=0, atol=1e-12)     # the installed one
    assert torch.equal(_ea['patches'], _et['patches']) and torch.equal(_ea['tokens'], _et['tokens'])
    assert not torch.allclose(_ea['image'], _et['image']) and not torch.allclose(_ea['text'], _et['text'])
    _cp = copy.deepcopy(_ma)
    test_eq(pool_of(_cp), 'avg')
    assert_close(_cp.encode_text(tt['tokens']), _ma.encode_text(tt['tokens']), rtol=0, atol=0)
    # hidden tokens do not count: hiding patches 0 and 12 of [5, 0, 9, 12] averages over 5 and 9 alone
    with select_patch_tokens(_ma, lambda x: _kp, hide=_hd):
        _h = encode(_ma, img.double(), None, need_patches=False)['image']
    for c, kc in enumerate(([5, 9], [2, 3, 60])):
        with select_patch_tokens(_ma, lambda x: torch.tensor([kc])):
            assert_close(_h[c:c + 1], encode(_ma, img.double()[c:c + 1], None, need_patches=False)['image'],
                         rtol=0, atol=1e-12)
set_pool(_mt, 'avg')
test_eq(pool_of(_mt), 'avg')
set_pool(_mt, 'tok')
test_eq(pool_of(_mt), 'tok')
assert 'encode_text' not in vars(_mt)                                                     # back to open_clip's own
_mt.visual.pool_type = 'avg'                                                              # one tower changed by hand
test_fail(lambda: encode(_mt, img.double(), None), contains='set_pool(model, pool) sets both')
test_fail(lambda: create_model('powerclip-tiny', pool='mean'), contains='pool: must be one of')

# %% [markdown]
# ## MAP: SigLIP's attention-pooled image tower
#
# SigLIP pools its image tower by multihead attention pooling (MAP): a learned query attends over the last block's
# tokens. `model.pool=map` builds it as **open_clip's own attentional pooler with one query** (`vision_cfg`:
# `attentional_pool: true, attn_pooler_queries: 1`): `ln_post(MHA(ln_q(q), ln_k(x), ln_k(x))) @ proj`. We take it over
# SigLIP's full MAP head (big_vision's `MAPHead`: the same attention followed by a LayerNorm and a residual MLP)
# because it is what open_clip builds natively: the weights load in plain open_clip from its model config, no timm tower
# and no module of our own, and `encode_image` (what the evaluator calls) runs the head the model trained. The price is
# the MLP: SigLIP's head has one more block after the attention, ours a LayerNorm and the projection. A second
# difference comes with open_clip's tower: it keeps its class token, and the pooler attends over it with the patches
# (SigLIP's ViT has no class token, so its MAP head sees patches alone); the class token is then one more key the
# query may use, learned like the rest, and the tower's other outputs are unchanged. The text tower
# stays CLIP's (BPE tokenizer, EOT pooling, causal mask): SigLIP's SentencePiece tokenizer is not available offline,
# so released SigLIP weights do not load here; the model is SigLIP's in its loss, its $t$ and $b$ and its image head.
#
# **An architecture, not a switch.** `tok` and `avg` read the same weights two ways (`set_pool`); the MAP head is
# weights. So `create_model(name, pool='map')` builds the head (its heads: the tower's, or the most below them that
# divide $D$), a MAP architecture (`ViT-B-16-map`, below) asked for `tok` or `avg` is refused, and so is `set_pool`
# to or from `map` on a built model: one line each.
#
# **Its patch embeddings.** The regions (PowerCLIP's Eq. 2), C2LIP's xac, the pointing game and region top-1 read
# projected patch embeddings $v_n$ in the shared $D$-dimensional space. A MAP model's $v_n$ is what its head outputs
# when all of its attention is on patch $n$:
#
# $$v_n=\mathrm{proj}^\top\,\mathrm{LN}_{\text{post}}\big(W_o\,(W_v\,\mathrm{LN}_k(x_n)+b_v)+b_o\big),$$
#
# the head's value path applied to one patch (`map_patches`; every head of the attention then reads the same patch, so
# the heads' split does not matter). The pooled image embedding is the head on the attention-weighted mix of the same
# values, so $v_n$ lives where the pooled vector lives, with the head's own weights; the class-token path
# (`ln_post` of width `width` before the projection) is not even of the right width here, and nothing falls back to it.
#
# `ViT-B-16-map` (in `model_configs/`) is the paper-scale SigLIP model: ViT-B/16 with the MAP head (8 heads: 512 =
# 8 x 64), $t$ initialised at 10 and $b$ at $-10$ (`init_logit_scale`, `init_logit_bias`: open_clip's CLIP then holds
# `logit_bias` and `encode` returns it).
#
# The checks: the MAP image embedding is the head's output written by hand and `encode_image`'s; a patch embedding is
# the head with its attention masked to that one patch; the heads are refused as switches.

# %%
_mm = create_model('powerclip-tiny', pool='map')[0].double().eval()
test_eq((pool_of(_mm), arch_pool('ViT-B-16-map'), arch_pool('powerclip-tiny', map_kwargs('powerclip-tiny', {}, 'map'))),
        ('map', 'map', 'map'))
with torch.no_grad():
    _em = encode(_mm, img.double(), tt['tokens'])
    _full = _mm.visual.transformer(_mm.visual._embeds(img.double()))                  # (C, 1 + N, width)
    _ap = _mm.visual.attn_pool
    _q = _ap.ln_q(_ap.query)[None].expand(img.shape[0], -1, -1)
    _k = _ap.ln_k(_full)
    _head = _ap.attn(_q, _k, _k, need_weights=False)[0][:, 0]                        # (C, D) the one query's output
    assert_close(_em['image'], F.normalize(_mm.visual.ln_post(_head) @ _mm.visual.proj, dim=-1), rtol=0, atol=1e-12)
    assert_close(_em['image'], _mm.encode_image(img.double(), normalize=True), rtol=0, atol=1e-12)
    assert_close(_em['text'], _mm.encode_text(tt['tokens'], normalize=True), rtol=0, atol=1e-12)  # EOT, as CLIP
    # v_n: the head with its attention on patch n alone (every other key masked)
    for n in (0, 17, 63):
        keep = torch.ones(img.shape[0], _full.shape[1], dtype=torch.bool)
        keep[:, n + 1] = False                                                        # True: ignored
        one = _ap.attn(_q, _k, _k, key_padding_mask=keep, need_weights=False)[0][:, 0]
        assert_close(_em['patches'][:, n], _mm.visual.ln_post(one) @ _mm.visual.proj, rtol=0, atol=1e-12)
    test_eq(_em['patches'].shape, (img.shape[0], 64, _mm.text_projection.shape[1]))          # N x D, as 'tok'
test_fail(lambda: set_pool(_mm, 'tok'), contains="not a switch")
test_fail(lambda: set_pool(create_model('powerclip-tiny')[0], 'map'), contains="not a switch")
test_fail(lambda: create_model('ViT-B-16-map', pool='avg'), contains="pools by its trained MAP head")
_cfg = open_clip.get_model_config('ViT-B-16-map')
test_eq((_cfg['vision_cfg']['attn_pooler_heads'], _cfg['init_logit_bias']), (8, -10.0))


# %% [markdown]
# ## The caption tokens that are words
#
# Token-wise methods (FILIP's late interaction, SPARC's token-to-patch grouping, SmartCLIP's mask network) need to
# know which of the $L$ token positions of a caption are real. Padding (id 0) never counts. By default the start
# token (SOT: under the text tower's causal mask its output is the same for every caption, so it can only add a
# constant) and the end token (EOT: it is the pooled sentence embedding, which the global loss already uses) do not
# count either. The EOT is found as open_clip's text pooling finds it, at the argmax of the ids. A caption with no
# word left (an empty caption) keeps its EOT, so that its scores stay defined. `special_tokens=True` counts SOT and
# EOT as tokens too.

# %%
#| export
def text_token_mask(
    ids: torch.Tensor,            # (C, L) long open_clip token ids: SOT, word pieces, EOT, zero padding
    special_tokens: bool = False, # True: SOT and EOT count as tokens too
) -> torch.Tensor:                # (C, L) bool
    "The caption tokens that take part in token-wise interaction: not padding, and (default) not SOT/EOT."
    valid = ids != 0
    if not valid.any(-1).all():
        raise ValueError(f"captions {(~valid.any(-1)).nonzero().flatten().tolist()} have no token at all (all padding)")
    if special_tokens:
        return valid
    eot = ids.argmax(-1)                                      # (C,) open_clip's EOT position (its text pooling)
    words = valid.clone()
    words[:, 0] = False                                       # SOT
    words[torch.arange(ids.shape[0], device=ids.device), eot] = False
    empty = ~words.any(-1)                                    # captions with no word piece: keep their EOT
    words[empty.nonzero().flatten(), eot[empty]] = True
    return words


# %%
_ids = torch.tensor([[49406, 320, 1929, 49407, 0, 0],       # "a dog"
                     [49406, 49407, 0, 0, 0, 0],            # empty caption: its EOT stands in
                     [49406, 1, 2, 3, 4, 49407]])           # truncated: EOT at the last position
test_eq(text_token_mask(_ids).tolist(), [[False, True, True, False, False, False],
                                         [False, True, False, False, False, False],
                                         [False, True, True, True, True, False]])
test_eq(text_token_mask(_ids, special_tokens=True).tolist(), (_ids != 0).tolist())
test_fail(lambda: text_token_mask(torch.zeros(2, 4, dtype=torch.long)), contains='no token at all')

# %% [markdown]
# On the batch contract's own tokens (`powerclip.tokens.tree_tokens`), the counted tokens are exactly the BPE
# pieces of the caption's words, `leaf_tokens.any(0)`:

# %%
for _c in range(C):
    assert torch.equal(text_token_mask(tt['tokens'][_c:_c + 1])[0], tt['leaf_tokens'][_c].any(0))

# %% [markdown]
# ## Checkpoints load with plain open_clip
#
# A state dict saved from a registered architecture loads through `open_clip.create_model_and_transforms`
# (here via `create_model`, which only adds the registration and the no-download guard).

# %%
with tempfile.TemporaryDirectory() as d:
    torch.save(model.state_dict(), Path(d) / 'ckpt.pt')
    m2, _, _ = open_clip.create_model_and_transforms('powerclip-tiny', pretrained=str(Path(d) / 'ckpt.pt'))
    m2.eval()
    with torch.no_grad():
        assert_close(encode(m2, img, tt['tokens'])['patches'], enc['patches'])

# %% [markdown]
# ## The paper's architecture
#
# ViT-B/16 with its text tower (about 150 M parameters) builds on the CPU in seconds; one forward pass at batch 2 gives the
# $14\times14=196$ patch embeddings of Sec. 5.1 in the 512-d shared space.

# %%
#| slow
t0 = time.time()
big, _, _ = create_model('ViT-B-16')
big.eval()
test_eq(grid_size(big), (14, 14))
with torch.no_grad():
    xb = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    eb = encode(big, xb, tt['tokens'])
    test_eq(eb['patches'].shape, (2, 196, 512))
    test_eq(eb['tokens'].shape, (2, 77, 512))
    assert_close(eb['image'], big.encode_image(xb, normalize=True))
    assert_close(eb['text'], big.encode_text(tt['tokens'], normalize=True))
print(f'ViT-B-16: {sum(p.numel() for p in big.parameters()) / 1e6:.0f} M parameters, build + forward '
      f'{time.time() - t0:.1f} s')
