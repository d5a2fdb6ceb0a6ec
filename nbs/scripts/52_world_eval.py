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
#| default_exp world_eval

# %%
#| export
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from powerclip.parsing import ParsedCaption, default_tokenizer, tree_tokens
from powerclip.world import NEGATIVE_KINDS, WorldConfig, read_sugarcrepe, to_clip_tensor, write_test_splits

# %%
#| hide
import tempfile
from fastcore.test import test_close, test_eq


# %% [markdown]
# # Evaluation on the world
#
# > A small evaluation for the demo: image-to-text accuracy on each kind of hard negative, and retrieval recall in both directions, on held-out scenes of the built-in world.

# %% [markdown]
# `22_world` writes a test split in the formats of the real benchmarks: SugarCrepe-style files
# (`data/{kind}.json`: image, true caption, hard negative) and a retrieval list (`retrieval.json`: each image
# with its true captions), plus the gold parse of every caption (`parses.json`). This notebook scores any
# open_clip model on them with the global embeddings only (`encode_image`, `encode_text`), so CLIP and PowerCLIP
# are judged by the same rule:
#
# - **hard negatives**: an item is right when $\cos(v, t^+) > \cos(v, t^-)$; accuracy per kind
#   (swap_att, swap_obj, replace_att, replace_obj, add_obj, add_att, replace_rel);
# - **retrieval**: image-to-text R@k (one of the image's captions among the $k$ most similar) and text-to-image
#   R@k (the caption's image among the $k$ most similar images).
#
# Captions are tokenised from their gold trees with `parsing.tree_tokens`, exactly as in training. The full
# benchmark suite on real data lives in `60_eval`; this module does not import the trainer.

# %%
#| export
def world_test_set(out_dir, cfg: WorldConfig | None = None, n_images: int = 500, split: str = "test") -> Path:
    "Write (once) the world's hard-negative and retrieval files for `n_images` scenes of `split`; returns the folder."
    out = Path(out_dir)
    want = dict(n_images=n_images, split=split)
    summary = out / "summary.json"
    if summary.is_file() and all(json.loads(summary.read_text()).get(k) == v for k, v in want.items()) \
            and (out / "config.json").is_file() and json.loads((out / "config.json").read_text()) == _cfg_json(cfg):
        return out
    write_test_splits(out, cfg or WorldConfig(), n_images=n_images, split=split)
    return out


def _cfg_json(cfg):
    from dataclasses import asdict
    return json.loads(json.dumps(asdict(cfg or WorldConfig())))


def caption_tokens(texts: list[str], parses: dict | None = None, context_length: int = 77) -> torch.Tensor:
    "(T, L) token ids: from the caption's stored tree when there is one (as in training), else the BPE tokenizer."
    parses = parses or {}
    rows = []
    for t in texts:
        if t in parses: rows.append(tree_tokens(ParsedCaption.from_dict(parses[t]), context_length=context_length).tokens)
        else: rows.append(torch.as_tensor(default_tokenizer()([t])[0][:context_length]))
    return torch.stack(rows)


@torch.no_grad()
def embed_images(model, paths: list, batch_size: int = 128) -> torch.Tensor:
    "(N, D) L2-normalised image embeddings of image files (CLIP-normalised as in training; no resizing)."
    dev = next(model.parameters()).device
    out = []
    for i in range(0, len(paths), batch_size):
        x = torch.stack([to_clip_tensor(np.asarray(Image.open(p).convert("RGB"))) for p in paths[i:i + batch_size]])
        out.append(model.encode_image(x.to(dev), normalize=True).float().cpu())
    return torch.cat(out)


@torch.no_grad()
def embed_texts(model, texts: list[str], parses: dict | None = None, batch_size: int = 256) -> torch.Tensor:
    "(T, D) L2-normalised text embeddings."
    dev = next(model.parameters()).device
    L = int(model.positional_embedding.shape[0]) if hasattr(model, "positional_embedding") else 77
    out = []
    for i in range(0, len(texts), batch_size):
        out.append(model.encode_text(caption_tokens(texts[i:i + batch_size], parses, L).to(dev), normalize=True).float().cpu())
    return torch.cat(out)


# %% [markdown]
# ## Scores

# %%
#| export
def recall_at_k(sim: torch.Tensor, img_of_text: torch.Tensor, ks=(1, 5)) -> dict[str, float]:
    """sim (I, T) image-text similarities; img_of_text (T,) the image of each caption.
    i2t R@k: share of images with one of their captions in their top k; t2i R@k: share of captions whose image is in their top k."""
    I, T = sim.shape
    own = torch.zeros(I, T, dtype=torch.bool); own[img_of_text, torch.arange(T)] = True
    out = {}
    for k in ks:
        top_t = sim.topk(min(k, T), dim=1).indices                        # (I, k)
        out[f"i2t_R@{k}"] = own.gather(1, top_t).any(1).float().mean().item()
        top_i = sim.topk(min(k, I), dim=0).indices                        # (k, T)
        out[f"t2i_R@{k}"] = (top_i == img_of_text[None]).any(0).float().mean().item()
    return out


# %%
_sim = torch.tensor([[0.9, 0.1, 0.8], [0.2, 0.7, 0.1]])   # image 0 owns captions 0 and 2, image 1 caption 1
test_eq(recall_at_k(_sim, torch.tensor([0, 1, 0]), ks=(1,)), {"i2t_R@1": 1.0, "t2i_R@1": 1.0})
_sim = torch.tensor([[0.1, 0.9, 0.8], [0.2, 0.7, 0.1]])
# captions 0 and 1 are closer to the other image; caption 2 to its own
_r = recall_at_k(_sim, torch.tensor([0, 1, 0]), ks=(1, 2))
test_close(list(_r.values()), [0.5, 1 / 3, 1.0, 1.0]); test_eq(list(_r), ["i2t_R@1", "t2i_R@1", "i2t_R@2", "t2i_R@2"])


# %%
#| export
def hard_negative_accuracy(model, root, kinds=NEGATIVE_KINDS, parses: dict | None = None) -> dict[str, float]:
    "Per kind: share of items whose image is closer to the true caption than to the hard negative (NaN when empty)."
    out = {}
    for kind in kinds:
        items = read_sugarcrepe(root, kind) if (Path(root) / "data" / f"{kind}.json").is_file() else []
        if not items: out[kind] = float("nan"); continue
        paths = sorted({p for p, _, _ in items}); row = {p: i for i, p in enumerate(paths)}
        v = embed_images(model, paths)                                          # (I, D)
        texts = sorted({t for _, a, b in items for t in (a, b)}); col = {t: j for j, t in enumerate(texts)}
        t = embed_texts(model, texts, parses)                                   # (T, D)
        i = torch.tensor([row[p] for p, _, _ in items])
        pos = (v[i] * t[torch.tensor([col[a] for _, a, _ in items])]).sum(1)
        neg = (v[i] * t[torch.tensor([col[b] for _, _, b in items])]).sum(1)
        out[kind] = (pos > neg).float().mean().item()
    return out


def retrieval(model, root, parses: dict | None = None, ks=(1, 5)) -> dict[str, float]:
    "R@k both ways on `retrieval.json` ([{image, caption: [...]}, ...]) of a test folder."
    items = json.loads((Path(root) / "retrieval.json").read_text())
    v = embed_images(model, [Path(root) / "images" / it["image"] for it in items])        # (I, D)
    texts, owner = [c for it in items for c in it["caption"]], [i for i, it in enumerate(items) for _ in it["caption"]]
    t = embed_texts(model, texts, parses)                                                 # (T, D)
    return recall_at_k(v @ t.T, torch.tensor(owner), ks)


def evaluate_world(model, root) -> dict[str, float]:
    "Hard-negative accuracy per kind (+ their mean) and retrieval recall of `model` on a world test folder."
    parses_path = Path(root) / "parses.json"
    parses = json.loads(parses_path.read_text()) if parses_path.is_file() else None
    was_training = model.training
    model.eval()
    try:
        acc = hard_negative_accuracy(model, root, parses=parses)
        vals = [a for a in acc.values() if a == a]
        res = {**{f"hn_{k}": a for k, a in acc.items()}, "hn_mean": float(np.mean(vals)) if vals else float("nan")}
        res.update(retrieval(model, root, parses))
    finally:
        model.train(was_training)
    return res


# %% [markdown]
# ## An untrained model is at chance
#
# A randomly initialised micro model on 40 test scenes: hard-negative accuracies scatter around 0.5, and
# R@1 is near 1/40. (The demo in `70_demo` trains the models that are compared here.)

# %%
from powerclip.model import create_model
_m = create_model("powerclip-micro")[0]
with tempfile.TemporaryDirectory() as d:
    root = world_test_set(d, WorldConfig(image_size=32, patch_size=8), n_images=40)
    assert world_test_set(d, WorldConfig(image_size=32, patch_size=8), n_images=40) == root  # cached
    res = evaluate_world(_m, root)
print({k: round(v, 3) for k, v in res.items()})
assert set(res) >= {"hn_swap_att", "hn_mean", "i2t_R@1", "t2i_R@5"} and all(0 <= v <= 1 for v in res.values() if v == v)
