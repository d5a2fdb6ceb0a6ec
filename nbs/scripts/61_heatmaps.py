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
#| default_exp heatmaps

# %%
#| export
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from powerclip.world import WorldConfig, generate, to_clip_tensor

# %%
#| hide
from fastcore.test import test_close, test_eq


# %% [markdown]
# # Text-to-patch heatmaps and a grounding score
#
# > Where does a text look in an image: the cosine of its embedding with every projected patch embedding, and, on the built-in world where every object's mask is known, the pointing-game accuracy and mean IoU of that map against the object the phrase names.

# %% [markdown]
# For a text embedding $t$ (L2-normalised, `encode_text`) and the projected patch embeddings $p_n$
# (`powerclip.model.encode`: `ln_post` then `proj`, the same projection the class token gets), the heatmap is
# $h_n = t^\top p_n / \|p_n\|$ on the $g_h \times g_w$ patch grid (row-major, as everywhere in this project),
# upsampled bilinearly over the image for display.
#
# The paper shows these maps (Fig. 6, 10, 11) without a number. On the world we know the gold patch mask
# $G$ of the object each noun phrase names, so we score:
# - **pointing game**: the argmax patch of $h$ lies in $G$; chance is $|G|/N$ (a random patch);
# - **pointing at any object**: the argmax lies on *some* object of the scene. A random network already points
#   at objects far above chance (bright objects on a dark noisy background move every patch feature), so
#   `pointing - pointing_any_object` is what tells a model that finds *the named* object from one that finds objects;
# - **IoU** of $\{n : \hat h_n \ge 0.5\}$ with $G$, where $\hat h$ is $h$ min-max normalised per map.
#
# The heatmap is resampled to the world's grid when the model's grid differs.

# %%
#| export
@torch.no_grad()
def text_patch_heatmaps(model, image: torch.Tensor, texts: list, tokenizer) -> torch.Tensor:
    "image `(3, H, W)` (CLIP-normalised, model resolution), texts: T strings -> cosines `(T, gh, gw)`."
    from powerclip.model import encode, grid_size
    tok = tokenizer(texts)                                                      # (T, L)
    enc = encode(model, image[None].expand(len(texts), -1, -1, -1), tok)        # one image per text: encode pairs rows
    p = F.normalize(enc['patches'], dim=-1)                                     # (T, N, D)
    h = (p * enc['text'][:, None]).sum(-1)                                      # (T, N)
    return h.view(len(texts), *grid_size(model))

def upsample(heat: torch.Tensor, size: tuple) -> torch.Tensor:
    "`(T, gh, gw)` -> `(T, *size)` bilinear (for overlays and for resampling to another grid)."
    return F.interpolate(heat[:, None].float(), size=size, mode='bilinear', align_corners=False)[:, 0]

def pointing_hit(heat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    "heat `(T, g, g)`, mask `(T, g*g)` bool -> `(T,)` bool: the argmax patch is in the mask."
    return mask.gather(1, heat.flatten(1).argmax(1, keepdim=True))[:, 0]

def heat_iou(heat: torch.Tensor, mask: torch.Tensor, thresh: float = 0.5) -> torch.Tensor:
    "`(T,)` IoU of the min-max normalised map thresholded at `thresh` with the mask `(T, g*g)`."
    h = heat.flatten(1)
    lo, hi = h.min(1, keepdim=True).values, h.max(1, keepdim=True).values
    pred = (h - lo) / (hi - lo).clamp_min(1e-12) >= thresh
    return (pred & mask).sum(1) / (pred | mask).sum(1).clamp_min(1)


# %% [markdown]
# Hand cases: a map peaked inside the mask hits and, when it is exactly the mask, has IoU 1; a map peaked
# outside misses.

# %%
mask = torch.zeros(2, 16, dtype=torch.bool); mask[:, [5, 6]] = True
heat = torch.zeros(2, 4, 4); heat[0].view(-1)[[5, 6]] = 1.0; heat[1].view(-1)[0] = 1.0
test_eq(pointing_hit(heat, mask).tolist(), [True, False])
test_close(heat_iou(heat, mask), torch.tensor([1.0, 0.0]))
test_eq(upsample(heat, (8, 8)).shape, (2, 8, 8))


# %% [markdown]
# ## The grounding score on the world
#
# For each test scene, every mentioned object's noun phrase (the NP node `mention_nodes[k]` of the gold tree)
# is a text; its gold mask is `masks[k]`.

# %%
#| export
def np_phrases(sample: dict) -> list[tuple[str, np.ndarray]]:
    "`[(noun phrase text, gold patch mask (N,) bool)]` for each mentioned object of a `world.generate` sample."
    parsed, out = sample['parsed'], []
    for k, node in enumerate(sample['mention_nodes']):
        if node < 0 or not sample['mask_valid'][k]: continue
        a, b = parsed.spans[node]
        out.append((' '.join(parsed.words[a:b]), sample['masks'][k]))
    return out

@torch.no_grad()
def grounding_score(model, tokenizer, n_scenes: int = 100, cfg: WorldConfig | None = None, split: str = 'test') -> dict:
    "Pointing-game accuracy, its chance level and mean IoU (%) over the NPs of `n_scenes` world scenes."
    cfg = cfg or WorldConfig()
    size = model.visual.image_size if isinstance(model.visual.image_size, int) else model.visual.image_size[0]
    hits, any_hits, ious, chance = [], [], [], []
    for i in range(n_scenes):
        s = generate(cfg, i, split)
        phrases = np_phrases(s)
        if not phrases: continue
        img = to_clip_tensor(s['image'])
        if img.shape[-1] != size: img = F.interpolate(img[None], size=(size, size), mode='bilinear', align_corners=False)[0]
        heat = upsample(text_patch_heatmaps(model, img, [p for p, _ in phrases], tokenizer), (cfg.grid, cfg.grid))
        mask = torch.from_numpy(np.stack([m for _, m in phrases]))              # (T, G*G)
        objects = torch.from_numpy(s['masks'][s['mask_valid']].any(0))[None].expand_as(mask)   # any object of the scene
        hits.append(pointing_hit(heat, mask)); any_hits.append(pointing_hit(heat, objects))
        ious.append(heat_iou(heat, mask)); chance.append(mask.float().mean(1))
    pct = lambda xs: 100 * torch.cat(xs).double().mean().item()
    return dict(pointing=pct(hits), pointing_chance=pct(chance), pointing_any_object=pct(any_hits),
                mean_iou=pct(ious), n_phrases=len(torch.cat(hits)))


# %% [markdown]
# A randomly initialised micro model (image 32 px, 4 x 4 grid, resampled to the world's 8 x 8 grid).

# %%
from powerclip.eval import load_model
m = load_model('powerclip-micro')
s = generate(WorldConfig(), 0, 'test')
test_eq(len(np_phrases(s)), int(s['mask_valid'].sum()))
g = grounding_score(m.model, m.tokenizer, n_scenes=20)
assert 0 <= g['pointing'] <= g['pointing_any_object'] <= 100 and g['n_phrases'] >= 20
g

# %% [markdown]
# An overlay: the scene, then one heatmap per noun phrase, upsampled over the image.

# %%
import matplotlib.pyplot as plt
phr = np_phrases(s)
img = F.interpolate(to_clip_tensor(s['image'])[None], size=(32, 32), mode='bilinear', align_corners=False)[0]
hm = upsample(text_patch_heatmaps(m.model, img, [p for p, _ in phr], m.tokenizer), s['image'].shape[:2])
fig, ax = plt.subplots(1, 1 + len(phr), figsize=(2.2 * (1 + len(phr)), 2.4))
ax = np.atleast_1d(ax); ax[0].imshow(s['image']); ax[0].set_title(s['text'][:28], fontsize=7)
for a, (p, _), h in zip(ax[1:], phr, hm):
    a.imshow(s['image']); a.imshow(h, alpha=0.5, cmap='jet'); a.set_title(p, fontsize=7)
for a in ax: a.axis('off')
plt.tight_layout()


# %% [markdown]
# ## Command line
#
# `powerclip-heatmaps --model powerclip-tiny [--checkpoint ckpt.pt] --image photo.jpg --texts "a dog" "a red ball" --out maps/`
# writes one overlay PNG per text (and `grid.png` with all of them); `--grounding N` prints the world grounding
# score over N test scenes as JSON.

# %%
#| export
def save_overlays(image_path, texts: list, model, preprocess, tokenizer, out_dir) -> list:
    "One PNG per text (heatmap over the image, as the model sees it after `preprocess`) plus `grid.png`; returns the paths."
    import matplotlib; matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    from pathlib import Path
    from PIL import Image
    out = Path(out_dir); out.mkdir(parents=True, exist_ok=True)
    x = preprocess(Image.open(image_path).convert('RGB'))                      # (3, S, S)
    shown = (x * torch.tensor((0.26862954, 0.26130258, 0.27577711))[:, None, None]
             + torch.tensor((0.48145466, 0.4578275, 0.40821073))[:, None, None]).clamp(0, 1).permute(1, 2, 0).numpy()
    hm = upsample(text_patch_heatmaps(model, x, texts, tokenizer), x.shape[-2:]).numpy()
    paths, fig_all = [], plt.figure(figsize=(2.6 * (len(texts) + 1), 2.8))
    ax0 = fig_all.add_subplot(1, len(texts) + 1, 1); ax0.imshow(shown); ax0.axis('off'); ax0.set_title('image', fontsize=8)
    for j, (t, h) in enumerate(zip(texts, hm)):
        fig, ax = plt.subplots(figsize=(3, 3.2))
        for a in (ax, fig_all.add_subplot(1, len(texts) + 1, j + 2)):
            a.imshow(shown); a.imshow(h, alpha=0.5, cmap='jet'); a.set_title(t[:40], fontsize=8); a.axis('off')
        p = out / f'{j:02d}.png'; fig.savefig(p, dpi=100, bbox_inches='tight'); plt.close(fig); paths.append(p)
    p = out / 'grid.png'; fig_all.savefig(p, dpi=100, bbox_inches='tight'); plt.close(fig_all)
    return paths + [p]

def main(argv=None) -> int:
    import argparse, json, sys
    from powerclip.eval import load_model
    ap = argparse.ArgumentParser(prog='powerclip-heatmaps', description='Text-to-patch heatmaps and the world grounding score.')
    ap.add_argument('--model', default=None); ap.add_argument('--checkpoint', default=None)
    ap.add_argument('--image'); ap.add_argument('--texts', nargs='+'); ap.add_argument('--out', default='heatmaps')
    ap.add_argument('--grounding', type=int, default=0, help='world test scenes to score (0: none)')
    a = ap.parse_args(argv)
    if not a.grounding and not (a.image and a.texts): ap.error('give --image and --texts, or --grounding N')
    m = load_model(a.model, a.checkpoint)
    if a.image and a.texts:
        for p in save_overlays(a.image, a.texts, m.model, m.preprocess, m.tokenizer, a.out): print(p)
    if a.grounding: print(json.dumps(dict(checkpoint=a.checkpoint, checkpoint_id=m.ckpt_id, model=m.spec,
                                          **grounding_score(m.model, m.tokenizer, a.grounding))))
    return 0


# %%
#| export
# a notebook kernel also runs as __main__, but has no __file__: only `python -m powerclip.heatmaps` runs here
if __name__ == '__main__' and '__file__' in globals(): raise SystemExit(main())

# %%
import tempfile
from pathlib import Path
from PIL import Image
d = Path(tempfile.mkdtemp())
Image.fromarray(s['image']).save(d / 'scene.png')
outs = save_overlays(d / 'scene.png', [p for p, _ in phr], m.model, m.preprocess, m.tokenizer, d / 'maps')
test_eq(len(outs), len(phr) + 1); assert all(p.stat().st_size > 0 for p in outs)
