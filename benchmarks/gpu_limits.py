"""What a GPU allows, beside what the GPU check measured (issue 45, item 2): a table of the cards' peaks, and the work
of the loss and of the two towers counted from their shapes. No torch at import (the plan reads the table without
it).

The peaks are the vendors' data-sheet numbers, written here (no network at run time): bf16 dense tensor-core TFLOP/s
with float32 accumulation (the data sheets' "with sparsity" figures halved where they give only those), and memory
bandwidth in GB/s. A card is recognised by `torch.cuda.get_device_name`; another card gets no fraction and one line
saying so (a guessed peak would be a wrong fraction).

The counts are matrix products only (2 FLOP per multiply-add), as `torch.utils.flop_counter.FlopCounterMode` counts
them (`tests/test_gpu_check.py::test_flop_counts_match_the_flop_counter` checks both on small shapes):

- the loss (`loss_flops`): the S-bar scores q = <region, phrase> of every (image, region, text, node) the loss pairs,
  unpadded (each caption's own node count, not the longest caption's), forward (1 product) and backward (the
  gradients of the regions and of the phrases: 2 products) are the useful work; the blocked and the Triton paths
  also recompute the scores in their backward (1 product more, counted apart as `recompute`); CLIP's logits beside.
  Activations (NLA-T1's softplus, NLA-T2's log-cosh integral, ...) are not FLOPs of a tensor core: they are counted
  as scores through the activations (`scores`), once per pass.
- the towers (`tower_flops`): per sample, forward = patch embedding + every block's attention and MLP products +
  the projection (the image tower's tokens; the text tower's context length, its causal attention counted whole as
  the kernels compute it); training = 3 x forward (forward, then the gradients of activations and of weights) less
  the patch embedding's input gradient (the pixels need none); with activation checkpointing each checkpointed
  block's forward once more: what torch recomputes with `set_checkpoint_early_stop(False)`; its default early stop
  recomputes less (on open_clip's blocks about 2/3 of a block), so 'train_ckpt' is an upper bound of the work.
  Attention is counted as its products (FlopCounterMode sees them through PyTorch's math attention; its fused CPU
  kernel is not counted by it).
"""
from __future__ import annotations

import re

# card -> its peaks and their source. The name patterns match `torch.cuda.get_device_name` (full match).
PEAKS = {
    "H100 SXM": dict(tflops=989.4, gbs=3350, pattern=r"NVIDIA H100( 80GB HBM3| SXM5? ?\S*)",
                     source="NVIDIA H100 Tensor Core GPU data sheet, H100 SXM column: BF16 Tensor Core 1,979 TFLOPS "
                            "with sparsity (989.4 dense), GPU memory bandwidth 3.35 TB/s"),
    "H200 SXM": dict(tflops=989.4, gbs=4800, pattern=r"NVIDIA H200( SXM\S*| 141GB HBM3e)?",
                     source="NVIDIA H200 Tensor Core GPU data sheet, H200 SXM column: BF16 Tensor Core 1,979 TFLOPS "
                            "with sparsity (989.4 dense), GPU memory bandwidth 4.8 TB/s"),
    "A100 SXM 80GB": dict(tflops=312.0, gbs=2039, pattern=r"NVIDIA A100[- ]SXM4?[- ]80GB",
                          source="NVIDIA A100 Tensor Core GPU data sheet, A100 80GB SXM column: BF16 Tensor Core 312 "
                                 "TFLOPS (624 with sparsity), GPU memory bandwidth 2,039 GB/s"),
    "L40S": dict(tflops=362.05, gbs=864, pattern=r"NVIDIA L40S",
                 source="NVIDIA L40S GPU data sheet: BF16 Tensor Core 362.05 TFLOPS (733 with sparsity), GPU memory "
                        "bandwidth 864 GB/s"),
    "RTX 4090": dict(tflops=165.2, gbs=1008, pattern=r"NVIDIA GeForce RTX 4090",
                     source="NVIDIA Ada GPU Architecture white paper, Appendix A (GeForce RTX 4090): peak BF16 Tensor "
                            "TFLOPS with FP32 accumulate 165.2 (330.4 with sparsity), memory bandwidth 1,008 GB/s"),
    "A10": dict(tflops=125.0, gbs=600, pattern=r"NVIDIA A10",
                source="NVIDIA A10 Tensor Core GPU data sheet: BF16 Tensor Core 125 TFLOPS (250 with sparsity), GPU "
                       "memory bandwidth 600 GB/s"),
}


def card(name: str | None) -> dict | None:
    "The table's entry of a device named `name` (`torch.cuda.get_device_name`), with its key as 'card'; else None."
    for key, p in PEAKS.items():
        if name and re.fullmatch(p["pattern"], name.strip()):
            return dict(p, card=key)
    return None


def limits_line(name: str | None) -> str:
    "One line: the card's peaks and their source, or why there is no fraction of peak."
    c = card(name)
    if c is None:
        return (f"no fraction of peak: {name or 'no device'!r} is not in the table of peaks "
                f"(gpu_limits.PEAKS: {', '.join(PEAKS)})")
    return (f"peak of {name} ({c['card']}): {c['tflops']:g} TFLOP/s bf16 dense with fp32 accumulation, "
            f"{c['gbs']:,} GB/s memory ({c['source']})")


def fraction(flop: float | None, seconds: float | None, name: str | None) -> float | None:
    "Achieved FLOP/s of `flop` in `seconds` as a fraction of the card's bf16 peak (None: unknown card or no time)."
    c = card(name)
    if c is None or not flop or not seconds or seconds != seconds or seconds <= 0:
        return None
    return flop / seconds / (c["tflops"] * 1e12)


def pct(x: float | None) -> str:
    "A fraction as '12.3 %', '-' where there is none."
    return "-" if x is None or x != x else f"{100 * x:.1f} %"


# ------------------------------------------------------------------------------------------------ the loss
def loss_flops(R: int, C: int, M: int, D: int, counts: list[int], local: bool | None = None) -> dict:
    """The loss's work at R local rows against C gathered columns, M regions per image, D dimensions, `counts` the C
    captions' node counts (the first R the local ones). `local` (default: R == C): one process, one S-bar call
    (images against texts, S and its transpose); else two calls, as `contrastive_rows` makes them: the R local images
    against the C texts and the C images against the R local texts.

    Returns FLOPs: 'sbar_forward' (one product), 'sbar_useful' (forward + the two gradient products), 'sbar_recompute'
    (the backward's recomputed scores: the blocked and the Triton paths), 'clip' (CLIP's logits, forward and
    backward), 'useful' (S-bar's useful + CLIP's) and 'scores' (the scores of one pass through the activations)."""
    local = R == C if local is None else local
    P_all, P_loc = sum(counts), sum(counts[:R])
    scores = R * M * P_all if local else R * M * P_all + C * M * P_loc
    fwd = 2 * D * scores
    clip_fwd = 2 * D * R * C * (1 if local else 2)            # the logits (one matrix, or a row block each way)
    clip = 3 * clip_fwd                                        # forward, and the gradients of both sides
    return dict(scores=scores, sbar_forward=fwd, sbar_useful=3 * fwd, sbar_recompute=fwd, clip=clip,
                useful=3 * fwd + clip)


# ------------------------------------------------------------------------------------------------ the towers
def _block(n: int, d: int, hidden: int) -> int:
    "One transformer block's forward FLOPs on n tokens of width d (qkv, q k^T, attention x v, out, MLP)."
    return 2 * n * d * 3 * d + 2 * n * n * d + 2 * n * n * d + 2 * n * d * d + 2 * 2 * n * d * hidden


def tower_shapes(model) -> dict:
    "The shapes `tower_flops` needs, read from an open_clip CLIP model (a ViT image tower, a transformer text tower)."
    v, t = model.visual, model.transformer

    def blocks(tr):
        b = tr.resblocks
        return len(b), b[0].mlp.c_fc.out_features
    if getattr(v, "attn_pool", None) is not None or not hasattr(v, "conv1"):
        raise NotImplementedError("tower_flops counts open_clip's plain ViT image tower (no attentional pooler)")
    vl, vh = blocks(v.transformer)
    tl, th = blocks(t)
    def shape(p, width):       # a parameter (width, embed), an nn.Linear, or None (no projection)
        if p is None:
            return (width, 0)
        return tuple(p.shape) if hasattr(p, "shape") else (p.in_features, p.out_features)
    proj, tproj = shape(v.proj, v.transformer.width), shape(model.text_projection, t.width)
    return dict(image_tokens=v.positional_embedding.shape[0], patches=v.grid_size[0] * v.grid_size[1],
                patch_in=v.conv1.in_channels * v.conv1.kernel_size[0] * v.conv1.kernel_size[1],
                image_width=v.transformer.width, image_layers=vl, image_hidden=vh, image_proj=tuple(proj),
                pooled_tokens=1, text_tokens=model.positional_embedding.shape[0], text_width=t.width,
                text_layers=tl, text_hidden=th, text_proj=tuple(tproj))


def tower_flops(s: dict) -> dict:
    """Per sample, from `tower_shapes`: 'image' and 'text' forward FLOPs, 'forward' (both), 'train' (3 x forward:
    forward + backward), 'train_ckpt' (train + the blocks' forward recomputed under activation checkpointing)."""
    vb = s["image_layers"] * _block(s["image_tokens"], s["image_width"], s["image_hidden"])
    tb = s["text_layers"] * _block(s["text_tokens"], s["text_width"], s["text_hidden"])
    patch = 2 * s["patches"] * s["patch_in"] * s["image_width"]
    image = patch + vb + 2 * s["pooled_tokens"] * s["image_proj"][0] * s["image_proj"][1]
    text = tb + 2 * s["text_proj"][0] * s["text_proj"][1]
    fwd = image + text
    train = 3 * fwd - patch          # the pixels need no gradient: the patch embedding's backward is one product
    return dict(image=image, text=text, forward=fwd, train=train, train_ckpt=train + vb + tb, blocks=vb + tb)


def vit_b16_flops() -> dict:
    "tower_flops of ViT-B/16 at 224 px with 77 tokens (open_clip's ViT-B-16: 197 tokens of 768, 12 + 12 blocks)."
    return tower_flops(dict(image_tokens=197, patches=196, patch_in=3 * 16 * 16, image_width=768, image_layers=12,
                            image_hidden=3072, image_proj=(768, 512), pooled_tokens=1, text_tokens=77, text_width=512,
                            text_layers=12, text_hidden=2048, text_proj=(512, 512)))


def quantiles(xs) -> tuple[float, float, float]:
    "(20th percentile, median, 80th percentile) of `xs`, linearly interpolated (numpy's default)."
    s = sorted(float(x) for x in xs)
    if not s:
        return (float("nan"),) * 3

    def q(p):
        i = p * (len(s) - 1)
        lo = int(i)
        hi = min(lo + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (i - lo)
    return q(0.2), q(0.5), q(0.8)
