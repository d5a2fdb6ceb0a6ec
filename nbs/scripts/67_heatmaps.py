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

import logging
import textwrap
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from powerclip.commandline import ArgumentParser, check_device, run_main, usage_errors
from powerclip.eval.models import LoadedModel, load_model
from powerclip.methods import Scorer
from powerclip.world import WorldConfig, generate, to_clip_tensor

log = logging.getLogger(__name__)

# %%
#| hide
from fastcore.test import test_close, test_eq, test_fail


# %% [markdown]
# # Text-to-patch heatmaps and a grounding score
#
# > Where does a text look in an image: the cosine of its embedding with every projected patch embedding.
#
# Side by side for several checkpoints and for compositional edits of the caption, and, on the built-in world where every
# object's mask is known, the pointing-game accuracy and mean IoU of that map against the object the phrase names.

# %% [markdown]
# For a text embedding $t$ (L2-normalised, `encode_text`) and the projected patch embeddings $p_n$
# (`powerclip.model.encode`: `ln_post` then `proj`, the same projection the class token gets), the heatmap is
# $h_n = t^\top p_n / \|p_n\|$ on the $g_h \times g_w$ patch grid (row-major, as everywhere in this project),
# upsampled bilinearly over the image for display.
#
# The paper shows these maps (Fig. 6, 10, 11) without a number. On the world we know the gold patch mask
# $G$ of the object each noun phrase names, so we score:
# - **pointing game**: the argmax patch of $h$ lies in $G$. Ties (a constant map) count as the expected hit of a
#   patch drawn uniformly among the tied maxima, so a uniform map scores exactly the chance level $|G|/N$. This is
#   not the evaluation's rule for ranking metrics (`60_eval_metrics`: a tie counts against the correct candidate):
#   the pointing game asks where a map points, not whether one candidate beats the others, and its uniform row is
#   there to show chance. As there, a map holding a NaN never counts as a hit;
# - **pointing at any object**: the argmax lies on *some* object of the scene. A random network already points
#   at objects far above chance (bright objects on a dark noisy background move every patch feature), so
#   `named_given_object` = pointing / pointing at any object (the share of the object hits that land on the named
#   object) is what tells a model that finds *the named* object from one that finds objects; the uniform row gives
#   its chance level (an object patch drawn at random);
# - **inverted pointing**: the pointing game played with the *minimum* of $h$. CLIP's patch-text cosines are often
#   inverted (the background is closer to the text than the object is; Li et al., "CLIP Surgery", 2023), and a model
#   whose maps are inverted scores low on pointing but high here: it localises, with the wrong sign;
# - **IoU** of $\{n : \hat h_n \ge 0.5\}$ with $G$, where $\hat h$ is $h$ min-max normalised per map. A constant
#   map carries no information and is read as "everywhere" ($\hat h \equiv 1$): its IoU is $|G|/N$, the IoU of the
#   uniform baseline, rather than 0.
#
# The heatmap is resampled to the world's grid when the model's grid differs.

# %%
#| export
@torch.no_grad()
def text_patch_heatmaps(model, image: torch.Tensor, texts: list, tokenizer) -> torch.Tensor:
    "image `(3, H, W)` (CLIP-normalised, model resolution), texts: T strings -> cosines `(T, gh, gw)` on the CPU."
    from powerclip.model import grid_size
    dev = next(model.parameters()).device                                       # inputs go where the model is
    tok, image = tokenizer(texts).to(dev), image.to(dev)                        # (T, L), (3, H, W)
    # each patch as a region of its own: the region embedding the region task reads (`Scorer.region_features`, Eq. 2)
    one = torch.eye(grid_size(model)[0] * grid_size(model)[1], dtype=torch.bool, device=dev)[None]   # (1, N, N)
    p = Scorer().region_features(model, image[None], one)[0]                   # (N, D) unit vectors
    t = F.normalize(model.encode_text(tok), dim=-1)                             # (T, D) the model's pooling
    return (t @ p.T).view(len(texts), *grid_size(model)).cpu()                 # beside the gold masks and the plots

def upsample(heat: torch.Tensor, size: tuple) -> torch.Tensor:
    "`(T, gh, gw)` -> `(T, *size)` bilinear (for overlays and for resampling to another grid)."
    return F.interpolate(heat[:, None].float(), size=size, mode='bilinear', align_corners=False)[:, 0]

def pointing_hit(heat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """heat `(T, g, g)`, mask `(T, g*g)` bool -> `(T,)` float: 1 when the argmax patch is in the mask; with tied
    maxima, the fraction of them in the mask (the expected hit of a uniformly random tie-break); a map with a NaN: 0."""
    h = heat.flatten(1)
    top = h == h.max(1, keepdim=True).values                                    # (T, N) the tied maxima
    return (top & mask).sum(1) / top.sum(1).clamp_min(1)                         # NaN max: no top patch, no hit

def normalise01(heat: torch.Tensor) -> torch.Tensor:
    "`(T, ...)` min-max normalised per map; a constant map becomes all ones (it does not single out any patch)."
    h = heat.flatten(1).float()
    lo, hi = h.min(1, keepdim=True).values, h.max(1, keepdim=True).values
    flat = (hi - lo) <= 1e-12 * hi.abs().clamp_min(1)
    return torch.where(flat, torch.ones_like(h), (h - lo) / (hi - lo).clamp_min(1e-30)).view_as(heat)

def heat_iou(heat: torch.Tensor, mask: torch.Tensor, thresh: float = 0.5) -> torch.Tensor:
    "`(T,)` IoU of the min-max normalised map thresholded at `thresh` with the mask `(T, g*g)`."
    pred = normalise01(heat).flatten(1) >= thresh
    return (pred & mask).sum(1) / (pred | mask).sum(1).clamp_min(1)


# %% [markdown]
# Hand cases: a map peaked inside the mask hits and, when it is exactly the mask, has IoU 1; a map peaked
# outside misses; a uniform map points at a random patch (expected hit $|G|/N = 2/16$) and claims every patch
# (IoU $2/16$); a map with its maximum tied between one patch inside and one outside scores a half hit.

# %%
mask = torch.zeros(4, 16, dtype=torch.bool)
mask[:, [5, 6]] = True
heat = torch.zeros(4, 4, 4)
heat[0].view(-1)[[5, 6]] = 1.0
heat[1].view(-1)[0] = 1.0
heat[3].view(-1)[[6, 15]] = 2.0                                                  # heat[2] stays uniform
test_close(pointing_hit(heat, mask), torch.tensor([1.0, 0.0, 2 / 16, 0.5]))
test_eq(pointing_hit(torch.full((1, 4, 4), float('nan')), mask[:1]).tolist(), [0.0])
test_close(heat_iou(heat, mask), torch.tensor([1.0, 0.0, 2 / 16, 1 / 3]))
test_eq(upsample(heat, (8, 8)).shape, (4, 8, 8))
# a peak inside the mask on a noisy map still hits; IoU grows with the threshold's selectivity
g = torch.Generator().manual_seed(0)
noisy = torch.rand(1, 4, 4, generator=g) * 0.1
noisy.view(-1)[5] = 1.0
test_eq(pointing_hit(noisy, mask[:1]).item(), 1.0)
test_close(heat_iou(noisy, mask[:1]), torch.tensor([0.5]))                      # predicts {5} of {5, 6}


# %% [markdown]
# ## The grounding score on the world
#
# For each test scene, every mentioned object's noun phrase (the NP node `mention_nodes[k]` of the gold tree)
# is a text; its gold mask is `masks[k]`. The score takes a *heat function* `(image (H, W, 3) uint8, texts) -> (T, gh, gw)`,
# so that a model and the two baselines that tell the reader where chance lies go through the same code:
# a **uniform** map (pointing = chance, IoU = $|G|/N$) and a **centre prior** (the negative distance to the image
# centre: objects are more often near the middle than at the border).
#
# A model's heat function is the cosine map above, unless its method scores with a map of its own: FLAIR's scorer
# (`48b_flair`) draws the attention of its text-conditioned pooling, as its paper's figures do, and
# `model_heat_fn(model, tokenizer, scorer)` uses it (`68_eval_world_scores` passes the run's headline scorer).

# %%
#| export
def np_phrases(sample: dict) -> list[tuple[str, np.ndarray]]:
    "`[(noun phrase text, gold patch mask (N,) bool)]` for each mentioned object of a `world.generate` sample."
    parsed, out = sample['parsed'], []
    for k, node in enumerate(sample['mention_nodes']):
        if node < 0 or not sample['mask_valid'][k]:
            continue
        a, b = parsed.spans[node]
        out.append((' '.join(parsed.words[a:b]), sample['masks'][k]))
    return out

def model_heat_fn(model, tokenizer, scorer=None):
    """A heat function for an open_clip model: the world image resized to the model's resolution. `scorer`: a method's
    scorer with its own `heatmaps(model, image, tokens) -> (T, N)` (FLAIR's attention, `48b_flair`) draws the map;
    otherwise (and by default) the cosine map above."""
    from powerclip.model import grid_size
    size = model.visual.image_size if isinstance(model.visual.image_size, int) else model.visual.image_size[0]
    own = getattr(scorer, 'heatmaps', None)
    def fn(image: np.ndarray, texts: list) -> torch.Tensor:
        x = to_clip_tensor(image)
        if x.shape[-1] != size:
            x = F.interpolate(x[None], size=(size, size), mode='bilinear', align_corners=False)[0]
        if own is not None:
            dev = next(model.parameters()).device
            return own(model, x.to(dev), tokenizer(texts).to(dev)).view(len(texts), *grid_size(model)).cpu()
        return text_patch_heatmaps(model, x, texts, tokenizer)
    return fn

def uniform_heat(image: np.ndarray, texts: list, grid: int = 8) -> torch.Tensor:
    "The same value everywhere: `(T, grid, grid)`."
    return torch.zeros(len(texts), grid, grid)

def centre_heat(image: np.ndarray, texts: list, grid: int = 8) -> torch.Tensor:
    "Minus the distance of each patch centre to the image centre: `(T, grid, grid)`."
    c = torch.arange(grid) + 0.5 - grid / 2
    return (-(c[:, None] ** 2 + c[None] ** 2).sqrt())[None].expand(len(texts), -1, -1).clone()

@torch.no_grad()
def grounding_score(heat_fn, n_scenes: int = 100, cfg: WorldConfig | None = None, split: str = 'test',
                    per_scene: bool = False) -> dict:
    """Pointing-game accuracy, its chance level, pointing at any object, inverted pointing and mean IoU (%) over the NPs
    of `n_scenes` world scenes; `per_scene`: also each scene's share of the pointing number (a phrase weighs one over
    the phrases, a scene without one shares 0), whose mean over the scenes is `pointing` (the comparison's
    bootstrap)."""
    cfg = cfg or WorldConfig()
    hits, any_hits, inv_hits, ious, chance, scenes = [], [], [], [], [], []
    for i in range(n_scenes):
        s = generate(cfg, i, split)
        phrases = np_phrases(s)
        if not phrases:
            scenes.append(torch.zeros(0))
            continue
        heat = heat_fn(s['image'], [p for p, _ in phrases])
        if heat.shape[-2:] != (cfg.grid, cfg.grid):
            heat = upsample(heat, (cfg.grid, cfg.grid))
        mask = torch.from_numpy(np.stack([m for _, m in phrases]))              # (T, G*G)
        objects = torch.from_numpy(s['masks'][s['mask_valid']].any(0))[None].expand_as(mask)   # any object of the scene
        hits.append(pointing_hit(heat, mask))
        any_hits.append(pointing_hit(heat, objects))
        inv_hits.append(pointing_hit(-heat, mask))
        scenes.append(hits[-1])
        ious.append(heat_iou(heat, mask))
        chance.append(mask.float().mean(1))
    if not hits:
        raise ValueError(f'no noun phrase with a mask in {n_scenes} {split} scenes')
    pct = lambda xs: 100 * torch.cat(xs).double().mean().item()
    p, a, n = pct(hits), pct(any_hits), len(torch.cat(hits))
    out = dict(pointing=p, pointing_chance=pct(chance), pointing_any_object=a,
               named_given_object=100 * p / a if a > 0 else float('nan'),
               pointing_inverted=pct(inv_hits), mean_iou=pct(ious), n_phrases=n)
    if per_scene:
        out['per_scene'] = [100 * n_scenes * h.double().sum().item() / n for h in scenes]
    return out


# %% [markdown]
# The baselines, and a randomly initialised micro model (image 32 px, 4 x 4 grid, resampled to the world's 8 x 8 grid).
# The uniform map's pointing equals the chance level by construction, and its IoU is the mean mask fraction.

# %%
m = load_model('powerclip-micro')
s = generate(WorldConfig(), 0, 'test')
test_eq(len(np_phrases(s)), int(s['mask_valid'].sum()))
u = grounding_score(uniform_heat, n_scenes=20)
test_close(u['pointing'], u['pointing_chance'])
test_close(u['mean_iou'], u['pointing_chance'])
test_close(u['pointing_inverted'], u['pointing_chance'])
g = grounding_score(model_heat_fn(m.model, m.tokenizer), n_scenes=20, per_scene=True)
assert 0 <= g['pointing'] <= g['pointing_any_object'] <= 100 and g['n_phrases'] >= 20
test_eq(len(g['per_scene']), 20)
test_close(np.mean(g.pop('per_scene')), g['pointing'])   # the scenes' shares
dict(uniform=u, centre=grounding_score(centre_heat, n_scenes=20), random_micro=g)


# %% [markdown]
# ## Checkpoints
#
# Models load through the evaluation's one loader, `powerclip.eval.models.load_model` (`62_eval_models`): a trainer
# checkpoint (`runs/NAME/checkpoints/last.pt`, which carries its config), a plain open_clip state dict
# (`runs/NAME/model.pt`, the architecture from the `config.yaml` the trainer writes beside it) or a run folder (its
# `model.pt`, else `checkpoints/last.pt`). Where a column is named on the command line or in `grounding_table`,
# `random:ARCH` stands for a randomly initialised model of that architecture, and an already loaded model is taken as it is.

# %%
#| export
def _loaded(spec, device: str = 'cpu') -> LoadedModel:
    "A LoadedModel (as it is), `random:ARCH`, or a checkpoint file or run folder, through `load_model`."
    if isinstance(spec, LoadedModel):
        return spec
    if isinstance(spec, str) and spec.startswith('random:'):
        return load_model(spec[len('random:'):], device=device)
    return load_model(checkpoint=spec, device=device)


# %%
import tempfile
from powerclip.model import create_model
_scratch = tempfile.TemporaryDirectory(prefix="powerclip-nb-")  # holds every scratch folder below; see the last cell
d = Path(tempfile.mkdtemp(dir=_scratch.name))
(d / 'run').mkdir()
(d / 'run' / 'config.yaml').write_text('model:\n  name: powerclip-micro\n  kwargs: {}\n')
torch.manual_seed(1)
torch.save(create_model('powerclip-micro')[0].state_dict(), d / 'run' / 'model.pt')
a, b = _loaded(d / 'run'), _loaded(str(d / 'run' / 'model.pt'))
test_eq(a.ckpt_id, b.ckpt_id)
assert not a.ckpt_id.startswith('random')
test_eq(_loaded('random:powerclip-micro').ckpt_id, m.ckpt_id)
assert _loaded(m) is m

# %% [markdown]
# ## A grounding table for several checkpoints
#
# One row per checkpoint, then three rows that say where chance lies: a random initialisation of the first
# checkpoint's architecture, the uniform map and the centre prior. All rows score the same scenes and phrases.

# %%
#| export
_COLS = [('pointing', 'pointing %'), ('pointing_any_object', 'on some object %'),
         ('named_given_object', 'named, of those on an object %'), ('mean_iou', 'mean IoU %'),
         ('pointing_inverted', 'inverted pointing %')]

def grounding_markdown(rows: list[dict]) -> str:
    "Markdown table of `grounding_table` rows, with the chance level under it."
    head = '| checkpoint | ' + ' | '.join(c for _, c in _COLS) + ' | phrases |'
    lines = [head, '|' + ' --- |' * (len(_COLS) + 2)]
    lines += [f"| {r['name']} | " + ' | '.join(f'{r[k]:.1f}' for k, _ in _COLS)
              + f" | {r['n_phrases']} |" for r in rows]
    if rows:
        lines.append(f"\nPointing chance (a random patch): {rows[0]['pointing_chance']:.1f} %; "
                          f"IoU at threshold 0.5 of the per-map min-max normalised heatmap on the {rows[0]['grid']} x "
                          f"{rows[0]['grid']} world grid.")
    return '\n'.join(lines)

def grounding_table(checkpoints: dict, n_scenes: int = 200, cfg: WorldConfig | None = None, device: str = 'cpu',
                    baselines: bool = True, split: str = 'test') -> tuple[list[dict], str]:
    """`{name: checkpoint (path, run dir, 'random:ARCH' or LoadedModel)}` -> (rows, Markdown): pointing-game accuracy,
    pointing at any object and mean IoU (%) on `n_scenes` world scenes, plus random-init / uniform / centre-prior
    rows."""
    cfg, rows, first = cfg or WorldConfig(), [], None
    def row(name, ckpt, fn):
        r = dict(name=name, checkpoint=ckpt, **grounding_score(fn, n_scenes, cfg, split),
                 n_scenes=n_scenes, grid=cfg.grid)
        log.info('grounding %s: %s', name, r)
        rows.append(r)
    for name, spec in checkpoints.items():
        lm = _loaded(spec, device)
        first = first or lm
        row(name, str(spec) if not hasattr(spec, 'ckpt_id') else spec.ckpt_id, model_heat_fn(lm.model, lm.tokenizer))
    if baselines:
        if first is not None:
            r = load_model(first.spec['name'], device=device, model_kwargs=first.spec['kwargs'])
            row(f"random init ({first.spec['name']})", r.ckpt_id, model_heat_fn(r.model, r.tokenizer))
        row('uniform map (chance)', None, lambda im, t: uniform_heat(im, t, cfg.grid))
        row('centre prior', None, lambda im, t: centre_heat(im, t, cfg.grid))
    return rows, grounding_markdown(rows)


# %%
rows, md = grounding_table({'micro (seed 1)': d / 'run'}, n_scenes=10)
test_eq([r['name'] for r in rows],
        ['micro (seed 1)', 'random init (powerclip-micro)', 'uniform map (chance)', 'centre prior'])
test_eq(len({r['n_phrases'] for r in rows}), 1)
print(md)

# %% [markdown]
# ## Compositional edits of a caption
#
# Two edits in the style of SugarCrepe's `swap_att` and `swap_obj`, made from the project's parse
# (`powerclip.parsing`, spaCy path: the edit needs part-of-speech tags, which the tree alone does not carry):
# - **swap_att**: in the first two *base* noun phrases (NP nodes with no NP inside) that each hold an attribute
#   (an adjective before the head noun, the NP's last word), and whose attributes differ, exchange the attribute
#   nearest to the noun: "a small **red** circle left of a
#   **blue** square" -> "a small **blue** circle left of a **red** square";
# - **swap_obj**: exchange the first two base noun phrases: "**a red circle** left of **a blue square**" ->
#   "**a blue square** left of **a red circle**".
#
# Base NPs lose trailing conjunctions and punctuation; an article directly before a swapped adjective is fixed
# ("an orange" -> "a blue"), and so is sentence-initial capitalisation. An edit that does not apply is absent
# (no second adjective, one noun phrase), never a copy of the caption. Everything is deterministic.

# %%
#| export
_NOUNISH = {'NOUN', 'PROPN', 'PRON', 'NUM'}

def _base_nps(doc, parsed, trim: bool = True) -> list[tuple[int, int]]:
    "Word spans of the NP nodes that contain no other NP node (trimmed to end at a noun when `trim`), in text order."
    nps = [sp for sp, lab in zip(parsed.spans, parsed.labels) if lab == 'NP']
    out = []
    for s, e in nps:
        if any(s <= s2 and e2 <= e and (s2, e2) != (s, e) for s2, e2 in nps):
            continue
        while trim and e > s and doc[e - 1].pos_ not in _NOUNISH:
            e -= 1
        if e > s:
            out.append((s, e))
    return sorted(set(out))

def _article(word: str, following: str) -> str:
    "'a'/'an' (keeping the case of `word`) for the word that now follows it."
    new = 'an' if following[:1].lower() in 'aeiou' else 'a'
    return new.capitalize() if word[:1].isupper() else new

def _render(doc, pieces: list[str]) -> str:
    "The caption with token i replaced by `pieces[i]`, keeping spaCy's whitespace."
    return ''.join(p + t.whitespace_ for p, t in zip(pieces, doc)).strip()

def caption_edits(text, parsed=None) -> dict[str, str]:
    """`{'swap_att': ..., 'swap_obj': ...}` for the edits that apply to `text` (see above); {} when none does.
    `text` may be a ParsedCaption (e.g. the world's gold tree), or `parsed` given: its NP nodes are used instead of
    spaCy's (its words must be spaCy's tokens of the text); spaCy still gives the part-of-speech tags."""
    from powerclip.parsing import ParsedCaption, load_pipeline, normalize_caption, spacy_doc_to_parsed
    if isinstance(text, ParsedCaption):
        text, parsed = text.text, text
    text, _ = normalize_caption(text)
    if not text:
        return {}
    doc = load_pipeline('spacy')(text)
    words, out = [t.text for t in doc], {}
    if parsed is not None and list(parsed.words) != words:
        raise ValueError(f'the given tree\'s words {parsed.words} are not the tokens {words} of {text!r}')
    nps = _base_nps(doc, parsed or spacy_doc_to_parsed(doc, text), trim=parsed is None)
    # the last word of a base NP is its head; an attribute is a word before it that spaCy tags as an adjective
    # (or attaches as `amod`), and, with a given (gold) tree, any word before the head but the determiner:
    # the tagger calls 'white' or 'purple' a noun in "a small white cross" and would miss a gold attribute
    attr = (lambda t: t.pos_ != 'DET') if parsed is not None else (lambda t: t.pos_ == 'ADJ' or t.dep_ == 'amod')
    adj = [(s, e, max(i for i in range(s, e - 1) if attr(doc[i]))) for s, e in nps
           if any(attr(doc[i]) for i in range(s, e - 1))]
    pair = next(((x, y) for k, x in enumerate(adj) for y in adj[k + 1:]
                 if words[x[2]].lower() != words[y[2]].lower()), None)
    if pair:
        (_, _, i), (_, _, j) = pair
        p = list(words)
        p[i], p[j] = words[j], words[i]
        if i == 0 and words[0][:1].isupper():         # a caption that starts with the adjective: "Red apples and ..."
            p[0] = p[0][:1].upper() + p[0][1:]
            if doc[0].pos_ != 'PROPN':
                p[j] = p[j][:1].lower() + p[j][1:]
        for k in (i, j):
            if k > 0 and p[k - 1].lower() in ('a', 'an'):
                p[k - 1] = _article(p[k - 1], p[k])
        out['swap_att'] = _render(doc, p)
    if len(nps) >= 2:
        (s1, e1), (s2, e2) = nps[:2]
        # the tokens from s1 to e2, swapped: s2..e2, then e1..s2, then s1..e1
        # each moved phrase keeps its own inner whitespace; the slot's last whitespace stays with the slot
        seq = [words[k] + doc[k].whitespace_ for k in range(s1)]
        slots = [(s1, e1, range(s2, e2)), (e1, s2, range(e1, s2)), (s2, e2, range(s1, e1))]
        for a, b, src in slots:
            src = list(src)
            for n, k in enumerate(src):
                w = words[k]
                if k == 0 and doc[0].text[:1].isupper() and doc[0].pos_ != 'PROPN' and w != 'I':
                    w = w[0].lower() + w[1:]
                if a == 0 and n == 0:
                    w = w[:1].upper() + w[1:] if doc[0].text[:1].isupper() else w
                seq.append(w + (doc[k].whitespace_ if n < len(src) - 1 else doc[b - 1].whitespace_ if b > a else ''))
        seq += [words[k] + doc[k].whitespace_ for k in range(e2, len(doc))]
        out['swap_obj'] = ''.join(seq).strip()
    return out

def with_edits(texts: list, edits: bool = True) -> list[tuple[str, str]]:
    """`[(label, text)]`: each text ('caption'), followed by its edits when `edits`; a ParsedCaption item uses its own
    tree."""
    out = []
    for t in texts:
        out.append(('caption', getattr(t, 'text', t)))
        if edits:
            out += list(caption_edits(t).items())
    return out


# %% [markdown]
# World captions (the gold grammar) and real COCO captions:

# %%
cases = {
    'a small red circle left of a blue square': dict(swap_att='a small blue circle left of a red square',
                                                     swap_obj='a blue square left of a small red circle'),
    'an orange triangle above a large green cross and a blue diamond':
        dict(swap_att='a green triangle above a large orange cross and a blue diamond',
             swap_obj='a large green cross above an orange triangle and a blue diamond'),
    'a purple circle': {},
    'A white dog sitting on a green couch.': dict(swap_att='A green dog sitting on a white couch.',
                                                  swap_obj='A green couch sitting on a white dog.'),
    'A man in a red shirt holding a black umbrella.': dict(swap_att='A man in a black shirt holding a red umbrella.',
                                                           swap_obj='A red shirt in a man holding a black umbrella.'),
    'Two dogs and a cat.': dict(swap_obj='A cat and two dogs.'),
}
for t, want in cases.items():
    test_eq(caption_edits(t), want)
# spaCy tags 'square' as an adjective here and misparses the first NP; the world's gold tree gets it right
t = 'an orange square right of a blue cross and a small green diamond'
test_eq(caption_edits(t)['swap_obj'], 'a blue cross of an orange square right and a small green diamond')
from powerclip.world import caption_tree, spec_from_text
gold = caption_tree(spec_from_text(t, WorldConfig()))[0]
test_eq(caption_edits(gold), dict(swap_att='a blue square right of an orange cross and a small green diamond',
                                  swap_obj='a blue cross right of an orange square and a small green diamond'))
test_fail(lambda: caption_edits('a red circle', gold), contains='not the tokens')
test_eq(caption_edits(''), {})
test_eq(with_edits(['a purple circle', 'a red circle above a blue cross'])[:2],
        [('caption', 'a purple circle'), ('caption', 'a red circle above a blue cross')])

# %%
import json
# repo root or nbs/
COCO = next((p for p in (Path('../shared/data/coco_sample'), Path('../../shared/data/coco_sample')) if p.is_dir()),
            Path('../shared/data/coco_sample'))
if not (COCO / 'captions.jsonl').is_file():
    print(f'skipped: {COCO} is absent (real COCO captions)')
else:
    rows_coco = [json.loads(l) for l in (COCO / 'captions.jsonl').read_text().splitlines()[:40]]
    caps = [c for r in rows_coco for c in r['captions']]
    ed = [caption_edits(c) for c in caps]
    import re
    bag = lambda t: sorted(w for w in re.findall(r"\w+|[^\w\s]", t.lower()) if w not in ('a', 'an'))
    # an edit moves words, it never adds or loses one (articles aside), and changes the text
    for c, e in zip(caps, ed):
        for v in e.values():
            assert v != c and bag(v) == bag(c), (c, v)
    print(f"{len(caps)} COCO captions: swap_att applies to {sum('swap_att' in e for e in ed)}, swap_obj to "
          f"{sum('swap_obj' in e for e in ed)}")
    for c, e in list(zip(caps, ed))[:6]:
        print(repr(c), '->', e)


# %% [markdown]
# ## Side by side: texts x checkpoints
#
# One figure per image: a row per text (a caption, then its edits), a column per checkpoint. Every model sees the
# image through its own `preprocess` (resize the short side, centre crop); the overlay is drawn on the same
# centre square of the photo at display resolution. Each map is min-max normalised on its own (cosine scales
# differ between checkpoints), so the title gives its cosine range.

# %%
#| export
def _as_pil(image):
    from PIL import Image
    if isinstance(image, Image.Image):
        return image.convert('RGB')
    if isinstance(image, np.ndarray):
        return Image.fromarray(image).convert('RGB')
    return Image.open(image).convert('RGB')

def centre_square(image, size: int = 224) -> np.ndarray:
    """The centre square of an image (what CLIP's resize + centre crop keeps), at `size` x `size`: `(size, size, 3)`
    uint8."""
    from PIL import Image
    im = _as_pil(image)
    w, h = im.size
    s = min(w, h)
    box = ((w - s) // 2, (h - s) // 2, (w - s) // 2 + s, (h - s) // 2 + s)
    return np.asarray(im.crop(box).resize((size, size), Image.BICUBIC))

def image_heatmaps(lm, image, texts: list) -> torch.Tensor:
    "Cosine maps `(T, gh, gw)` of `texts` on `image` (path, PIL or uint8 array) through a LoadedModel's preprocess."
    return text_patch_heatmaps(lm.model, lm.preprocess(_as_pil(image)), texts, lm.tokenizer)

def heatmap_grid(image, texts: list, models: dict, labels: list | None = None, size: int = 224, cell: float = 2.4):
    """Figure of `len(texts)` rows x `len(models)` columns of overlays; `models`: {name: LoadedModel}; `labels` prefix
    the texts."""
    import matplotlib.pyplot as plt
    shown = centre_square(image, size)
    raw = {n: image_heatmaps(lm, image, texts) for n, lm in models.items()}               # (T, gh, gw) each
    maps = {n: normalise01(upsample(h, (size, size))) for n, h in raw.items()}
    fig, axes = plt.subplots(len(texts), len(models),
                             figsize=(cell * len(models), (cell + 0.45) * len(texts)), squeeze=False)
    for r, t in enumerate(texts):
        lab = f'[{labels[r]}] ' if labels else ''
        for c, n in enumerate(models):
            a = axes[r, c]
            a.imshow(shown)
            a.imshow(maps[n][r].numpy(), alpha=0.5, cmap='jet', vmin=0, vmax=1)
            a.axis('off')
            h = raw[n][r]
            a.set_title(f'{n}  cos {h.min():.2f}..{h.max():.2f}\n'
                        + '\n'.join(textwrap.wrap(lab + t, 34)[:3]), fontsize=7)
    fig.tight_layout()
    return fig


# %%
import io
import matplotlib.pyplot as plt
from IPython.display import Image as IPImage, display

def show(fig, dpi: int = 72):
    "Display a figure as a JPEG (heatmap overlays make PNGs of a megabyte each; the notebook keeps its outputs)."
    buf = io.BytesIO()
    fig.savefig(buf, format='jpeg', dpi=dpi, bbox_inches='tight', pil_kwargs=dict(quality=80))
    plt.close(fig)
    display(IPImage(buf.getvalue()))

s = generate(WorldConfig(), 1, 'test')
lab, txt = zip(*with_edits([s['parsed']]))
fig = heatmap_grid(s['image'], list(txt),
                   {'random micro': m, 'micro (seed 1)': load_model(checkpoint=d / 'run')}, list(lab))
test_eq(len(fig.axes), 2 * len(txt))
test_eq(centre_square(np.zeros((40, 60, 3), np.uint8), 32).shape, (32, 32, 3))
show(fig)


# %% [markdown]
# ## Command line
#
# ```
# python -m powerclip.heatmaps --image photo.jpg [--image other.jpg] --text "a dog on a red couch" [--text ...] \
#     --checkpoint CLIP=runs/demo/seed0/CLIP --checkpoint PowerCLIP=runs/demo/seed0/PowerCLIP-R \
#     [--checkpoint random=random:powerclip-tiny] [--edits] --out maps/
# python -m powerclip.heatmaps --checkpoint ... --grounding 200 [--out maps/] [--threads 1]
# ```
# writes one grid PNG per image (`maps/<image stem>.png`, rows = texts and, with `--edits`, their compositional edits;
# columns = checkpoints). `--grounding N` prints the world grounding table over N test scenes as Markdown
# (and writes `grounding.json` and `grounding.md` into `--out` when given).

# %%
#| export
def _parse_checkpoint(arg: str) -> tuple[str, str]:
    "'NAME=PATH' -> (NAME, PATH); a bare PATH is named after its run directory."
    if '=' in arg and not arg.startswith('random:'):
        name, path = arg.split('=', 1)
        if name and path:
            return name, path
        raise ValueError(f'--checkpoint: wants NAME=PATH (or PATH, or random:ARCH), got {arg!r}')
    p = Path(arg)
    return (p.parent.parent.name if p.parent.name == 'checkpoints' else p.stem if p.suffix else p.name) or arg, arg

def save_grids(images: list, texts: list, models: dict, out_dir, edits: bool = False) -> list:
    "One grid PNG per image into `out_dir`; returns the paths."
    import matplotlib.pyplot as plt
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    labels, rows = zip(*with_edits(texts, edits))
    paths, seen = [], set()
    for im in images:
        stem = Path(im).stem
        k = 1
        while stem in seen:
            k += 1
            stem = f'{Path(im).stem}_{k}'      # two images with the same name
        seen.add(stem)
        fig = heatmap_grid(im, list(rows), models, list(labels))
        p = out / f'{stem}.png'
        fig.savefig(p, dpi=110, bbox_inches='tight')
        plt.close(fig)
        paths.append(p)
    return paths

def _check_args(a) -> dict:
    """The command line's mistakes, found before a model is built (`17_commandline`): a ValueError naming the argument.
    Returns {column name: checkpoint spec}."""
    from PIL import Image
    from powerclip.eval.models import checkpoint_file
    from powerclip.model import model_geometry
    if a.threads < 0:
        raise ValueError(f'--threads: must be at least 0 (0: torch default), got {a.threads}')
    if a.grounding < 0:
        raise ValueError(f'--grounding: must be at least 0 (world test scenes; 0: none), got {a.grounding}')
    if not a.checkpoint:
        raise ValueError('--checkpoint: give at least one NAME=PATH (random:ARCH for a random init)')
    if not a.grounding and not (a.image and a.text):
        raise ValueError('--image: give --image and --text, or --grounding N')
    if a.image and not a.text:
        raise ValueError('--text: --image needs at least one --text')
    specs = {}
    for c in a.checkpoint:
        name, path = _parse_checkpoint(c)
        if name in specs:
            raise ValueError(f'--checkpoint: two columns named {name!r} (name them: NAME=PATH)')
        try:
            if path.startswith('random:'):
                model_geometry(path[len('random:'):])   # the architecture exists (nothing built)
            else:
                checkpoint_file(path)                                          # a file, or a run folder holding one
        except (ValueError, FileNotFoundError, NotImplementedError) as e:
            raise ValueError(f'--checkpoint: {e}') from None
        specs[name] = path
    for im in a.image:
        if not Path(im).is_file():
            raise ValueError(f'--image: {im!r} not found')
        try:
            with Image.open(im) as x:
                x.verify()
        except Exception as e:
            raise ValueError(f'--image: {im!r} is not an image ({type(e).__name__})') from None
    if a.out and Path(a.out).exists() and not Path(a.out).is_dir():
        raise ValueError(f'--out: {a.out!r} is a file (give a folder)')
    check_device('--device', a.device)
    return specs

def main(argv=None) -> int:
    """The command line (None: sys.argv): exit status 0, or 2 with one line on stderr for a mistake in the arguments
    (`17_commandline`)."""
    return run_main(_main, argv, 'powerclip-heatmaps')

def _main(argv) -> int:
    import json
    import matplotlib
    matplotlib.use('Agg')     # files only: no window, whatever the environment's default backend
    ap = ArgumentParser(prog='powerclip-heatmaps', description='Text-to-patch heatmaps side by side, and '
                                                               'the world grounding table.')
    ap.add_argument('--image', action='append', default=[], help='image file (repeat for several: one grid each)')
    ap.add_argument('--text', action='append', default=[], help='a text (repeat for several rows)')
    ap.add_argument('--checkpoint', action='append', default=[], metavar='NAME=PATH',
                    help='trainer checkpoint, plain open_clip state dict, run directory, or random:ARCH '
                         '(repeat: one column each)')
    ap.add_argument('--edits', action='store_true', help='add compositional edits of each text (swap_att, swap_obj)')
    ap.add_argument('--out', default=None, help='output folder (default: heatmaps)')
    ap.add_argument('--grounding', type=int, default=0, help='world test scenes for the grounding table (0: none)')
    ap.add_argument('--device', default='cpu')
    ap.add_argument('--threads', type=int, default=0, help='torch CPU threads (0: torch default; 1 is fastest for tiny '
                                                           'models on a busy machine)')
    ap.add_argument('--debug', action='store_true', help='show the traceback of a usage error')
    with usage_errors():
        a = ap.parse_args(argv)
        specs = _check_args(a)
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    # a checkpoint that does not fit its architecture shows only once it is loaded: still the user's file, one line
    with usage_errors(ValueError):
        models = {n: _loaded(p, a.device) for n, p in specs.items()}
    if a.image:
        for p in save_grids(a.image, a.text, models, a.out or 'heatmaps', a.edits):
            print(p)
    if a.grounding:
        rows, md = grounding_table(models, a.grounding, device=a.device)
        for r, (n, lm) in zip(rows, models.items()):
            r['checkpoint'], r['checkpoint_id'] = specs[n], lm.ckpt_id
        print(md)
        if a.out:
            Path(a.out).mkdir(parents=True, exist_ok=True)
            (Path(a.out) / 'grounding.json').write_text(json.dumps(rows, indent=1))
            (Path(a.out) / 'grounding.md').write_text(md + '\n')
    return 0


# %%
#| export
# a notebook kernel also runs as __main__, but has no __file__: only `python -m powerclip.heatmaps` runs here
if __name__ == '__main__' and '__file__' in globals():
    raise SystemExit(main())

# %%
from PIL import Image
Image.fromarray(s['image']).save(d / 'scene.png')
outs = save_grids([d / 'scene.png'], [s['text']], {'random micro': m}, d / 'maps', edits=True)
test_eq([p.name for p in outs], ['scene.png'])
assert outs[0].stat().st_size > 0
test_eq(_parse_checkpoint('runs/demo/CLIP/checkpoints/last.pt'), ('CLIP', 'runs/demo/CLIP/checkpoints/last.pt'))
test_eq(_parse_checkpoint('A=runs/x/model.pt'), ('A', 'runs/x/model.pt'))
test_eq(_parse_checkpoint('random:powerclip-micro'), ('random:powerclip-micro', 'random:powerclip-micro'))

# %% [markdown]
# ## The demo checkpoints
#
# The three runs of `make demo` (`runs/demo/seed0/{CLIP,PowerCLIP-R,PowerCLIP-gold}`: a tiny ViT, 64 px, 8 x 8 patches,
# 360 steps on the world) are not in git; these cells skip when they are absent. They were trained on world scenes
# only, so on COCO photos the maps show what such a model does out of its domain; on world scenes they show whether
# a phrase lights up the object it names, and whether swapping the colours or the objects moves the map.

# %%
#| slow
ROOT = Path('..') if Path('../runs/demo').is_dir() else Path('.')
DEMO = ROOT / 'runs/demo/seed0'
demo = {n: DEMO / n for n in ('CLIP', 'PowerCLIP-R', 'PowerCLIP-gold')}   # run folders: model.pt and config.yaml
have_demo = all((p / 'model.pt').is_file() for p in demo.values())
if not have_demo:
    print(f'skipped: the demo checkpoints are absent ({DEMO.resolve()}); run `make demo` to make them')
else:
    demo_models = {n: load_model(checkpoint=p) for n, p in demo.items()}
    sp = demo_models['CLIP'].spec
    demo_models['random init'] = load_model(sp['name'], model_kwargs=sp['kwargs'])
    for i in (1, 4, 9):                          # scenes with two or three objects
        s = generate(WorldConfig(), i, 'test')
        lab, txt = zip(*with_edits([s['parsed']]))
        txt, lab = list(txt) + [p for p, _ in np_phrases(s)], list(lab) + ['phrase'] * len(np_phrases(s))
        show(heatmap_grid(s['image'], txt, demo_models, lab, size=128, cell=2.0))

# %%
#| slow
if not have_demo:
    print('skipped: the demo checkpoints are absent')
elif not (COCO / 'captions.jsonl').is_file():
    print(f'skipped: {COCO} is absent (real COCO photos)')
else:
    picks = [r for r in (json.loads(l) for l in (COCO / 'captions.jsonl').read_text().splitlines())
             if any('swap_att' in caption_edits(c) for c in r['captions'][:2])][:3]
    for r in picks:
        cap = next(c for c in r['captions'][:2] if 'swap_att' in caption_edits(c))
        lab, txt = zip(*with_edits([cap]))
        print(r['file_name'], r['license_name'], r['flickr_url'])
        show(heatmap_grid(COCO / 'images' / r['file_name'], list(txt), demo_models, list(lab), size=160, cell=2.0))

# %% [markdown]
# The number behind the pictures: pointing game and mean IoU on 200 world test scenes, for the three demo runs and
# the chance rows. From the command line: `python -m powerclip.heatmaps --grounding 200 --checkpoint CLIP=runs/demo/seed0/CLIP
# --checkpoint PowerCLIP-R=runs/demo/seed0/PowerCLIP-R --checkpoint PowerCLIP-gold=runs/demo/seed0/PowerCLIP-gold`.

# %%
#| slow
if not have_demo:
    print('skipped: the demo checkpoints are absent')
else:
    demo_rows, demo_md = grounding_table(demo, n_scenes=200)
    from IPython.display import Markdown, display
    display(Markdown(demo_md))

# %% [markdown]
# How to read it. The random initialisation already points at *some* object far above the uniform and centre rows
# (bright shapes on a dark noisy background dominate the patch features): a trained model has to beat that row, not
# the uniform one. "Named, of those on an object" compares with the uniform row's value, the chance of picking the
# named object among the scene's objects at random: a model can find objects without telling them apart. The
# inverted-pointing column exposes maps with the wrong sign (the named object is the coldest place, as in some
# overlays above). These are 360-step runs of a 3-layer ViT on the world: a measurement of these checkpoints, not
# of the methods at scale.
#
# On the checkpoints of the committed table (the 2-core CPU of this repository): PowerCLIP-R lands on some object
# 94.9 % of the time, but picks the named one among them no more often than a random object of the scene would
# (39.0 % against the uniform row's 42.9 %). CLIP's maps are inverted: its inverted pointing (35.5 %) is above its
# pointing (14.5 %), so the named object is more often the coldest place than the hottest.

# %% [markdown]
# ## Under average pooling the maps point at the background
#
# The same table for the four seed-0 models of the plateau comparison (`python -m powerclip.experiments plateau --steps
# 1600`, `71_experiments`: T = 1,600 steps, class-token and average pooling, `30_model` "Pooling"); the cell skips
# when they are absent.

# %%
#| slow
_root = Path('..') if Path('../settings.ini').is_file() else Path('.')   # the repository root, from nbs/ or from it
PLATEAU = _root / 'runs/plateau/T1600/seed0'
plateau = {n: PLATEAU / d for n, d in (('CLIP', 'CLIP'), ('CLIP (avg)', 'CLIP_avg'), ('PowerCLIP-R', 'PowerCLIP-R'),
                                        ('PowerCLIP-R (avg)', 'PowerCLIP-R_avg'))}
if not all((p / 'model.pt').is_file() for p in plateau.values()):
    print('skipped: the plateau runs are absent; `python -m powerclip.experiments plateau --steps 1600 --seeds 0`')
else:
    from IPython.display import Markdown, display
    display(Markdown(grounding_table(plateau, n_scenes=200, baselines=False)[1]))

# %% [markdown]
# Both average-pooled models point at *no* object: their hottest patch is on the background in every map (0.0 % and
# 1.0 % on some object), and the coldest patch is the named object about as often as chance allows for a map that
# avoids objects (inverted pointing 19.4 % and 24.8 %). Class-token CLIP shows the same tendency more weakly (inverted
# 41.2 % against pointing 5.9 %); PowerCLIP-R with class-token pooling is the one model whose maps find objects (94.9 %)
# and name them better than a random object of the scene would. CLIP preferring the background in its similarity maps is
# known: Li et al., *CLIP Surgery* (arXiv 2304.05653), call it "opposite visualization". A plausible reading here:
# under average pooling every patch is a summand of the global embedding, and the many background patches can carry
# the image's caption-level content (which objects, which colours) as well as any, while an object's own patches stay
# local. Their pooled *regions* still classify well (`63a_eval_regions`: 14-16 % top-1 against 2.6 % for PowerCLIP-R
# with class-token pooling), so a region embedding and a one-patch map are not interchangeable readings of a model,
# although they are one computation: the pointing game scores single patches against a caption-level text embedding.
# These are one seed's models; the comparison's pointing column (`70_compare`) has the intervals.

# %% [markdown]
# Every scratch folder made above lives under one temporary folder, removed here, so running the notebook
# leaves nothing behind (a training run's checkpoints take hundreds of MB).

# %%
_scratch.cleanup()
