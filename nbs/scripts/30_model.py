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

from importlib import resources
from pathlib import Path

import open_clip
import torch
import torch.nn as nn
import torch.nn.functional as F

from powerclip.loss import PowersetInputs
from powerclip.powerset import phrase_embeddings, pool_normalize

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
# > open_clip's dual encoder, with projected patch and token embeddings from one forward pass per tower, and the region (Eq. 2), leaf (Eq. 4) and phrase (Eq. 3) embeddings the powerset loss needs.

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
# model, _, preprocess = open_clip.create_model_and_transforms('powerclip-demo', pretrained='runs/demo/CLIP/model.pt')
# ```
#
# We chose files over inserting dicts into open_clip's private `_MODEL_CONFIGS`: `add_model_config` is
# open_clip's documented way, and `_rescan_model_configs` rebuilds the registry from the registered *paths*,
# so a dict inserted by hand is only safe as long as open_clip keeps the current merge behaviour. The JSON
# files are data, written once by hand; the cell after `register_configs` shows them and checks them.

# %%
#| export
PRESETS = {'paper': 'ViT-B-16', 'demo': 'powerclip-tiny'}  # preset name -> open_clip architecture

def config_dir() -> Path:
    "The package's `model_configs/` folder: open_clip JSON model configs shipped as package data."
    return Path(str(resources.files('powerclip') / 'model_configs'))

def register_configs() -> list[str]:
    "Add `powerclip/model_configs/*.json` to open_clip's model registry (idempotent); returns their names."
    names = sorted(p.stem for p in config_dir().glob('*.json'))
    if not set(names) <= set(open_clip.list_models()): open_clip.add_model_config(config_dir())
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
test_eq(open_clip.get_model_config('ViT-B-16')['text_cfg'] | {}, dict(context_length=77, vocab_size=49408, width=512, heads=8, layers=12))


# %% [markdown]
# `create_model` builds a model by architecture or preset name. It never downloads: `pretrained` is `None`
# (random initialisation) or a path to a local checkpoint, and a pretrained *tag* is refused with a clear
# error. It returns open_clip's triple `(model, preprocess_train, preprocess_val)`.

# %%
#| export
def create_model(name: str = 'demo', pretrained: str | Path | None = None, **kw):
    "`(model, preprocess_train, preprocess_val)` for an architecture or preset name; `pretrained`: None or a local file."
    register_configs()
    arch = PRESETS.get(name, name)
    if arch not in open_clip.list_models():
        raise ValueError(f'unknown model {name!r}; presets {list(PRESETS)}, or an open_clip architecture')
    if pretrained is not None and not Path(pretrained).is_file():
        raise FileNotFoundError(f'pretrained must be a local checkpoint file (nothing is downloaded), got {pretrained!r}')
    return open_clip.create_model_and_transforms(arch, pretrained=None if pretrained is None else str(pretrained), **kw)

def grid_size(model) -> tuple[int, int]:
    "`(gh, gw)`: the patch grid of the visual tower; N = gh * gw patch embeddings, row-major."
    return tuple(model.visual.grid_size)


# %%
torch.manual_seed(0)
model, _, preprocess = create_model('demo')
test_eq(grid_size(model), (8, 8))
print(f"powerclip-tiny: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters; eval transform: {preprocess}")
test_fail(lambda: create_model('ViT-B-16', pretrained='openai'), contains='local checkpoint')
test_fail(lambda: create_model('no-such-model'), contains='unknown model')


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
# FLIP's patch dropout (open_clip's `PatchDropout`) removes patch tokens at random during training; the
# survivors no longer sit on the grid, so `encode` returns `patches=None` then (a method that drops patches
# does not use them) and raises if patches were asked for. In `eval()` mode `PatchDropout` is the identity.

# %%
#| export
def set_patch_dropout(model, prob: float):
    "FLIP-style patch dropout on the visual tower (0 turns it off); active in `train()` mode only."
    from open_clip.transformer import PatchDropout
    if not 0 <= prob < 1: raise ValueError(f'patch dropout must be in [0, 1), got {prob}')
    model.visual.patch_dropout = PatchDropout(prob) if prob > 0 else nn.Identity()
    return model

def _patch_dropout_active(model) -> bool:
    pd = model.visual.patch_dropout
    return model.visual.training and getattr(pd, 'prob', 0.0) > 0

def _check_heads(model):
    v = model.visual
    if not isinstance(model, open_clip.CLIP):
        raise TypeError(f'encode supports open_clip.CLIP models, got {type(model).__name__}')
    if getattr(v, 'attn_pool', None) is not None or v.final_ln_after_pool or v.pool_type != 'tok' or v.proj is None:
        raise NotImplementedError('encode needs the standard ViT head (class token, ln_post before pooling, proj)')
    if model.text_pool_type != 'argmax' or model.text_projection is None:
        raise NotImplementedError('encode needs the standard CLIP text head (EOT pooling, text_projection)')

def _text_proj(model, x: torch.Tensor) -> torch.Tensor:
    p = model.text_projection
    return p(x) if isinstance(p, nn.Linear) else x @ p

def encode(model, image: torch.Tensor | None, tokens: torch.Tensor | None, need_patches: bool = True) -> dict:
    """One forward pass per tower. image `(C, 3, H, W)`, tokens `(C, L)` ->
    image `(C, D)`, text `(C, D)` (L2-normalised), patches `(C, N, D)`, tokens `(C, L, D)` (projected, not
    normalised; patches None under active patch dropout), logit_scale `()` (exponentiated).
    A tower whose input is None is not run: its keys are absent (the evaluator encodes images and texts apart)."""
    _check_heads(model)
    dropped = image is not None and _patch_dropout_active(model)
    if dropped and need_patches: raise ValueError('patch dropout is active: patch embeddings are off the grid')
    out = model.forward_intermediates(image, tokens, image_indices=1, text_indices=1, normalize=True,
                                      image_output_fmt='NLC', output_logit_scale_bias=True)
    enc = dict(logit_scale=out['logit_scale'])
    if image is not None:
        x = out['image_intermediates'][-1]                   # (C, N, width_v) last block, class token removed
        enc.update(image=out['image_features'],
                   patches=None if dropped else model.visual.ln_post(x) @ model.visual.proj)  # (C, N, D)
    if tokens is not None:
        y = out['text_intermediates'][-1]                    # (C, L, width_t) last block
        enc.update(text=out['text_features'], tokens=_text_proj(model, model.ln_final(y)))  # (C, L, D)
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
from powerclip.parsing import ParsedCaption, collate_trees, tree_tokens
model.eval()
C = 2
img = torch.randn(C, 3, 64, 64, generator=torch.Generator().manual_seed(0))
pcs = [ParsedCaption('a red circle left of a blue square', 'a red circle left of a blue square'.split(),
                     [(0, 8), (0, 3), (3, 8), (3, 5), (5, 8)], ['S', 'NP', 'PP', 'ADVP', 'NP'], 'gold', []),
       ParsedCaption('a green cross', ['a', 'green', 'cross'], [(0, 3)], ['NP'], 'gold', [])]
tt = collate_trees([tree_tokens(p) for p in pcs])
with torch.no_grad():
    enc = encode(model, img, tt['tokens'])
    test_eq(enc['patches'].shape, (C, 64, 128)); test_eq(enc['tokens'].shape, (C, 77, 128))
    test_eq(enc['image'].shape, (C, 128)); test_eq(enc['logit_scale'].shape, ())
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
    img2 = img.clone(); img2[:, :, 16:24, 40:48] += 3
    delta = (encode(model, img2, tt['tokens'])['patches'] - enc['patches']).norm(dim=-1)  # (C, N)
    test_eq(delta.argmax(-1).tolist(), [2 * 8 + 5] * C)


# %% [markdown]
# Gradient checkpointing (`model.set_grad_checkpointing`) recomputes the blocks in the backward pass;
# `forward_intermediates` honours it, so `encode` gives the same values and the same gradients with it on.

# %%
def _grads(m, ckpt):
    m.train(); m.set_grad_checkpointing(ckpt); m.zero_grad()
    e = encode(m, img, tt['tokens'])
    (e['patches'].square().mean() + e['tokens'].square().mean() + e['logit_scale'] * (e['image'] * e['text']).sum()).backward()
    g = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.set_grad_checkpointing(False); m.eval()
    return e, g
e0, g0 = _grads(model, False)
e1, g1 = _grads(model, True)
assert_close(e0['patches'], e1['patches']); test_eq(g0.keys(), g1.keys())
for n in g0: assert_close(g0[n], g1[n], rtol=1e-4, atol=1e-6)
assert len(g0) == sum(p.requires_grad for p in model.parameters())  # every parameter gets a gradient

# %% [markdown]
# Patch dropout: in training mode with dropout on, `encode` refuses patches and gives the global embeddings
# only; in eval mode the same model gives the full grid and the same pooled vectors as without dropout.

# %%
set_patch_dropout(model, 0.5).train()
test_fail(lambda: encode(model, img, tt['tokens']), contains='patch dropout')
with torch.no_grad(): e = encode(model, img, tt['tokens'], need_patches=False)
assert e['patches'] is None and e['image'].shape == (C, 128)
model.eval()
with torch.no_grad(): assert_close(encode(model, img, tt['tokens'])['image'], enc['image'])
set_patch_dropout(model, 0.0)
test_fail(lambda: set_patch_dropout(model, 1.0), contains='[0, 1)')


# %% [markdown]
# ## Region, leaf and phrase embeddings
#
# With the batch's masks (see `23_data`): region embeddings $\phi(I\mid R_m)$ of Eq. 2 pool the patch
# embeddings under region masks, leaf embeddings $\psi(T\mid P_{m'})$ of Eq. 4 pool the token embeddings under
# each word's BPE positions, and phrase embeddings $p_B$ of Eq. 3 sum the leaves under each parse node. The
# padding conventions carry through: an invalid region or word has an all-`False` mask, so its embedding is
# the zero vector, and invalid nodes cover no word.

# %%
#| export
def powerset_inputs(enc: dict, batch: dict) -> PowersetInputs:
    """Regions `(C, M, D)` (Eq. 2), phrases `(C, K, D)` (Eqs. 3-4) and validity masks from `encode`'s output and
    a batch with `region_masks (C, M, N)`, `region_valid (C, M)`, `leaf_tokens (C, W, L)`, `incidence (C, K, W)`,
    `node_valid (C, K)`."""
    if enc['patches'] is None: raise ValueError('no patch embeddings (patch dropout active?)')
    masks = batch['region_masks'].to(enc['patches'].device)
    if masks.shape[-1] != enc['patches'].shape[1]:
        raise ValueError(f"region masks have {masks.shape[-1]} patches, the model {enc['patches'].shape[1]}")
    regions = pool_normalize(enc['patches'], masks)                                   # (C, M, D)
    leaves = pool_normalize(enc['tokens'], batch['leaf_tokens'].to(enc['tokens'].device))  # (C, W, D)
    phrases = phrase_embeddings(leaves, batch['incidence'].to(leaves.device))         # (C, K, D)
    return PowersetInputs(regions, batch['region_valid'].to(regions.device), phrases,
                          batch['node_valid'].to(phrases.device))


# %%
gh, gw = grid_size(model)
masks = torch.zeros(C, 3, gh * gw, dtype=torch.bool)
masks[:, 0, :8] = True; masks[:, 1, 9] = True                       # row 0; patch (1, 1); row 2 is padding
batch = dict(tt, region_masks=masks, region_valid=masks.any(-1))
with torch.no_grad(): pi = powerset_inputs(enc, batch)
test_eq(pi.regions.shape, (C, 3, 128)); test_eq(pi.phrases.shape, (C, 5, 128))
assert_close(pi.regions[:, 0], F.normalize(enc['patches'][:, :8].sum(1), dim=-1))
assert_close(pi.regions[:, 1], F.normalize(enc['patches'][:, 9], dim=-1))
assert not pi.regions[:, 2].any() and pi.region_valid[:, 2].logical_not().all()
# phrase 'a blue square' of caption 0 (node 4: words 5..7): the sum of its three normalised word embeddings
words = [F.normalize(enc['tokens'][0][tt['leaf_tokens'][0, w]].sum(0), dim=-1) for w in (5, 6, 7)]
assert_close(pi.phrases[0, 4], sum(words))
# caption 1 has one node; nodes 1..4 are padding: zero and invalid
assert not pi.phrases[1, 1:].any(); test_eq(pi.node_valid[1].tolist(), [True, False, False, False, False])
test_fail(lambda: powerset_inputs(enc, dict(batch, region_masks=masks[..., :10])), contains='patches')

# %% [markdown]
# The whole path feeds the loss and back-propagates into both towers:

# %%
from powerclip.loss import PowerCLIPLossConfig, powerclip_loss
model.train()
e = encode(model, img, tt['tokens'])
terms = powerclip_loss(e['image'], e['text'], e['logit_scale'], powerset_inputs(e, batch), PowerCLIPLossConfig())
model.zero_grad(); (terms['clip'] + terms['powerset']).backward()
assert model.visual.conv1.weight.grad.abs().sum() > 0 and model.token_embedding.weight.grad.abs().sum() > 0
model.eval()
{k: round(v.item(), 4) for k, v in terms.items() if not v.requires_grad} | {k: round(v.detach().item(), 4) for k, v in terms.items() if v.requires_grad}

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
    with torch.no_grad(): assert_close(encode(m2, img, tt['tokens'])['patches'], enc['patches'])

# %% [markdown]
# ## The paper's architecture
#
# ViT-B/16 with its text tower (about 150 M parameters) builds on the CPU in seconds; one forward pass at batch 2 gives the
# $14\times14=196$ patch embeddings of Sec. 5.1 in the 512-d shared space.

# %%
#| slow
t0 = time.time()
big, _, _ = create_model('paper')
big.eval()
test_eq(grid_size(big), (14, 14))
with torch.no_grad():
    xb = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    eb = encode(big, xb, tt['tokens'])
    test_eq(eb['patches'].shape, (2, 196, 512)); test_eq(eb['tokens'].shape, (2, 77, 512))
    assert_close(eb['image'], big.encode_image(xb, normalize=True))
    assert_close(eb['text'], big.encode_text(tt['tokens'], normalize=True))
print(f'ViT-B-16: {sum(p.numel() for p in big.parameters()) / 1e6:.0f} M parameters, build + forward {time.time() - t0:.1f} s')
