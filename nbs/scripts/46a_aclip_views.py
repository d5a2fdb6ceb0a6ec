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
#| default_exp baselines.aclip_views

# %%
#| export
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# %%
#| hide
from torch.testing import assert_close

from powerclip.baselines.clip_pgs import hash_uniform


# %% [markdown]
# # A-CLIP's views
#
# > The crops and colour augmentation of A-CLIP's views: torchvision's transforms, batched, driven by given noise.
#
# A-CLIP (`47_aclip`) trains on two crops of each image and scores patches on a third crop that encloses both, and
# colour-augments the two training crops. This notebook makes those views from the batch's image tensor, every random
# choice read from given uniform noise, so that the method can draw them from hashed noise per sample and step.

# %% [markdown]
# ## Views, made in the method
#
# The data pipeline gives each sample one image tensor, normalised, at the model's size. A-CLIP needs three crops of
# it: two training views and, for the EMA encoder, a crop that encloses both. The method makes them itself, from
# hashed uniform noise `hash_uniform(index, step, seed, n)` (`46_clip_pgs`), so that a sample's views are a function of
# (method seed, step, sample id) only: the same on every process and after a resume.
#
# **Crop boxes** follow torchvision's `RandomResizedCrop.get_params` exactly, with the noise in place of torch's
# generator: up to 10 attempts of an area share $s\sim U(0.5, 1)$ and a log-uniform aspect ratio in $[3/4, 4/3]$,
# $w=\mathrm{round}\sqrt{sHW\,a}$, $h=\mathrm{round}\sqrt{sHW/a}$; the first attempt that fits takes a uniform integer
# position; if none fits, the central crop of the largest allowed aspect. **The EMA's box** is the union of the two
# boxes with each side moved towards the image border by a uniform integer amount (the authors' "zoom out", without
# their two slips, see the table in `47_aclip`). **Cropping** samples the box bilinearly at the output pixels'
# centres, with the sample positions clamped to the box's outer pixels: exactly `F.interpolate` (bilinear,
# `align_corners=False`) of the cropped tensor, i.e. torchvision's `resized_crop` on tensors, but batched over boxes of
# different sizes.

# %%
#| export
def crop_boxes(
    u: torch.Tensor,                            # (C, 40) uniform noise in [0, 1): 10 attempts x (area, ratio, top,
                                                # left)
    size: tuple[int, int],                      # (H, W) of the image
    scale: tuple[float, float] = (0.5, 1.0),    # area share of a crop (the authors' RandomResizedCrop scale)
    ratio: tuple[float, float] = (3 / 4, 4 / 3),  # aspect ratio w / h (torchvision's default)
) -> torch.Tensor:                              # (C, 4) float64 boxes (top, left, height, width), integer-valued
    "torchvision's `RandomResizedCrop.get_params` for a batch, driven by the given noise."
    H, W = size
    C = u.shape[0]
    if u.shape[1] < 40:
        raise ValueError(f"need 40 noise columns per crop, got {u.shape[1]}")
    a = u[:, :40].double().reshape(C, 10, 4)                                            # (C, 10, 4)
    target = H * W * (scale[0] + (scale[1] - scale[0]) * a[..., 0])                    # (C, 10)
    lr0, lr1 = math.log(ratio[0]), math.log(ratio[1])
    aspect = torch.exp(lr0 + (lr1 - lr0) * a[..., 1])
    w, h = torch.round(torch.sqrt(target * aspect)), torch.round(torch.sqrt(target / aspect))  # (C, 10)
    ok = (w > 0) & (w <= W) & (h > 0) & (h <= H)
    first = ok.to(torch.uint8).argmax(1, keepdim=True)                                  # (C, 1) first attempt that fits
    pick = lambda t: t.gather(1, first)[:, 0]                                           # (C,)
    hh, ww = pick(h), pick(w)
    top = torch.floor(pick(a[..., 2]) * (H - hh + 1))
    left = torch.floor(pick(a[..., 3]) * (W - ww + 1))
    in_ratio = W / H                                                                    # fallback: central crop
    if in_ratio < min(ratio):
        fw, fh = W, int(round(W / min(ratio)))
    elif in_ratio > max(ratio):
        fh, fw = H, int(round(H * max(ratio)))
    else:
        fw, fh = W, H
    fb = torch.tensor([(H - fh) // 2, (W - fw) // 2, fh, fw], dtype=torch.float64).to(u.device, non_blocking=True)
    box = torch.stack([top, left, hh, ww], 1)                                           # (C, 4)
    return torch.where(ok.any(1, keepdim=True), box, fb)


def enclosing_box(
    a: torch.Tensor, b: torch.Tensor,   # (C, 4) boxes (top, left, height, width)
    u: torch.Tensor,                    # (C, 4) uniform noise: how far each side moves out
    size: tuple[int, int],              # (H, W)
) -> torch.Tensor:                      # (C, 4) float64: encloses a and b, inside the image
    "The EMA's crop: the union of two boxes, each side moved towards the border by a uniform integer amount."
    H, W = size
    a, b, u = a.double(), b.double(), u.double()
    t0, l0 = torch.minimum(a[:, 0], b[:, 0]), torch.minimum(a[:, 1], b[:, 1])
    b0, r0 = torch.maximum(a[:, 0] + a[:, 2], b[:, 0] + b[:, 2]), torch.maximum(a[:, 1] + a[:, 3], b[:, 1] + b[:, 3])
    t = torch.floor(u[:, 0] * (t0 + 1))
    l = torch.floor(u[:, 1] * (l0 + 1))             # in [0, t0], [0, l0]
    bt = b0 + torch.floor(u[:, 2] * (H - b0 + 1))
    rt = r0 + torch.floor(u[:, 3] * (W - r0 + 1))   # in [b0, H], [r0, W]
    return torch.stack([t, l, bt - t, rt - l], 1)


def crop_resize(
    image: torch.Tensor,       # (C, ch, H, W)
    box: torch.Tensor,         # (C, 4) (top, left, height, width) in pixels, inside the image
    out_hw: tuple[int, int],   # (oh, ow)
) -> torch.Tensor:             # (C, ch, oh, ow): each box resized (bilinear, as F.interpolate of the crop)
    "Crop a box of each image and resize it, batched: torchvision's tensor `resized_crop` (bilinear, no antialias)."
    C, _, H, W = image.shape
    oh, ow = out_hw
    bx = box.to(torch.float64)
    t, l, h, w = bx.unbind(1)                                                           # (C,) each
    # (C, oh)
    ys = t[:, None] + (torch.arange(oh, dtype=torch.float64, device=bx.device) + 0.5) * (h / oh)[:, None] - 0.5
    xs = l[:, None] + (torch.arange(ow, dtype=torch.float64, device=bx.device) + 0.5) * (w / ow)[:, None] - 0.5
    ys = torch.minimum(torch.maximum(ys, t[:, None]), (t + h - 1)[:, None])             # clamped to the box's pixels
    xs = torch.minimum(torch.maximum(xs, l[:, None]), (l + w - 1)[:, None])
    # align_corners=False coordinates
    ny, nx = (2 * ys + 1) / H - 1, (2 * xs + 1) / W - 1
    grid = torch.stack([nx[:, None, :].expand(C, oh, ow), ny[:, :, None].expand(C, oh, ow)], -1)  # (C, oh, ow, 2)
    return F.grid_sample(image, grid.to(image.dtype), mode="bilinear", padding_mode="border", align_corners=False)


# %% [markdown]
# Checks: the boxes are those of torchvision's algorithm written as a loop over the same numbers, inside the image, of
# area share $[0.5, 1]$ and aspect $[3/4, 4/3]$ up to rounding; over many draws their statistics match torchvision's own
# `get_params`; the enclosing box encloses and stays inside; cropping equals torchvision's `resized_crop` of each image
# (antialias off: the crops are only ever enlarged), and the full box is the identity.

# %%
import torchvision.transforms.functional as TF
from torchvision.transforms import RandomResizedCrop


def _loop_box(u, H, W, scale=(0.5, 1.0), ratio=(3 / 4, 4 / 3)):
    "torchvision's get_params with the uniform draws taken from u (40 numbers)."
    for k in range(10):
        ta = H * W * (scale[0] + (scale[1] - scale[0]) * float(u[4 * k]))
        ar = math.exp(math.log(ratio[0]) + (math.log(ratio[1]) - math.log(ratio[0])) * float(u[4 * k + 1]))
        w, h = int(round(math.sqrt(ta * ar))), int(round(math.sqrt(ta / ar)))
        if 0 < w <= W and 0 < h <= H:
            return [math.floor(float(u[4 * k + 2]) * (H - h + 1)), math.floor(float(u[4 * k + 3]) * (W - w + 1)), h, w]
    return [0, 0, H, W]

_u = hash_uniform(torch.arange(3000), step=0, seed=1, n=44)
for H, W in ((224, 224), (32, 32), (64, 48)):
    _bx = crop_boxes(_u, (H, W))
    assert all(_bx[i].tolist() == _loop_box(_u[i], H, W) for i in range(0, 3000, 7)), (H, W)
    assert (_bx[:, :2] >= 0).all() and (_bx[:, 0] + _bx[:, 2] <= H).all() and (_bx[:, 1] + _bx[:, 3] <= W).all()
_bx = crop_boxes(_u, (224, 224))
_area, _asp = _bx[:, 2] * _bx[:, 3] / 224 ** 2, _bx[:, 3] / _bx[:, 2]
assert (_area > 0.49).all() and (_area <= 1).all() and (_asp > 0.74).all() and (_asp < 1.35).all()
torch.manual_seed(0)
_tv = torch.tensor([RandomResizedCrop.get_params(torch.zeros(3, 224, 224), [0.5, 1.0], [3 / 4, 4 / 3])
                    for _ in range(3000)], dtype=torch.float64)
_tv_area, _tv_asp = _tv[:, 2] * _tv[:, 3] / 224 ** 2, _tv[:, 3] / _tv[:, 2]
print(f"mean area share: ours {float(_area.mean()):.4f}, torchvision {float(_tv_area.mean()):.4f}; "
      f"mean aspect: ours {float(_asp.mean()):.4f}, torchvision {float(_tv_asp.mean()):.4f}")
# 3000 draws: std ~ 0.003
assert abs(float(_area.mean() - _tv_area.mean())) < 0.01 and abs(float(_asp.mean() - _tv_asp.mean())) < 0.01
_b2 = crop_boxes(_u[:, 4:44], (224, 224))
_e = enclosing_box(_bx, _b2, hash_uniform(torch.arange(3000), 0, 2, 4), (224, 224))
for b in (_bx, _b2):
    assert (_e[:, 0] <= b[:, 0]).all() and (_e[:, 1] <= b[:, 1]).all()
    assert (_e[:, 0] + _e[:, 2] >= b[:, 0] + b[:, 2]).all() and (_e[:, 1] + _e[:, 3] >= b[:, 1] + b[:, 3]).all()
assert (_e[:, :2] >= 0).all() and (_e[:, 0] + _e[:, 2] <= 224).all() and (_e[:, 1] + _e[:, 3] <= 224).all()
print(f"EMA crop area share: mean {float((_e[:, 2] * _e[:, 3]).mean() / 224 ** 2):.3f} (views "
      f"{float(_area.mean()):.3f})")

_g = torch.Generator().manual_seed(0)
_im = torch.randn(6, 3, 32, 32, generator=_g, dtype=torch.float64)
_cb = crop_boxes(hash_uniform(torch.arange(6), 0, 5, 40), (32, 32))
_cr = crop_resize(_im, _cb, (32, 32))
for i in range(6):
    t, l, h, w = (int(v) for v in _cb[i])
    assert_close(_cr[i], TF.resized_crop(_im[i], t, l, h, w, [32, 32], antialias=False), rtol=0, atol=1e-12)
assert_close(crop_resize(_im, torch.tensor([[0.0, 0, 32, 32]]).expand(6, 4), (32, 32)), _im, rtol=0, atol=1e-12)
assert_close(crop_resize(_im, _cb, (16, 24))[2],
             TF.resized_crop(_im[2], *(int(v) for v in _cb[2]), [16, 24], antialias=False), rtol=0, atol=1e-12)

# %% [markdown]
# ## Colour augmentation
#
# The authors' online views go through (`main.py`): `ColorJitter(0.4, 0.4, 0.2, 0.1)` with probability 0.8,
# `RandomGrayscale(0.2)`, `GaussianBlur` with $\sigma\in[0.1, 2]$ with probability 0.1, `Solarize` with probability 0.2;
# the EMA's crop gets none of them. `color_augment` is that list as tensor operations on images in $[0, 1]$, batched,
# with every random choice taken from 13 noise values per image (`u[:, 0]` applies the jitter, `u[:, 1:5]` its
# brightness, contrast, saturation and hue factors, `u[:, 5:9]` the order of the four, which torchvision also draws at
# random, then grayscale, blur and its $\sigma$, solarize). The operations are torchvision's tensor functionals
# (blend-and-clamp for brightness, contrast, saturation; hue through HSV), checked one by one against them below.
# Two adaptations: the blur's $\sigma$ is in pixels of a 224-pixel image and scales with the image size (at 32 pixels
# $\sigma\le 0.29$), with a Gaussian kernel of $2\lceil3\sigma_{\max}\rceil+1$ taps and reflected borders (torchvision's
# tensor blur; the authors' PIL blur approximates a Gaussian by box filters); solarize inverts values $\ge 128/255$, as
# PIL does on 8-bit images.
#
# **On the built-in world** a caption names colours ("a red circle"), so a hue shift or a grayscale view changes what the
# caption says of the image. The paper's regime is `color_aug=True`; a comparison on the world should also run
# `views=1, color_aug=False` (`47_aclip`), which keeps A-CLIP's attentive masking and its online-to-EMA term.

# %%
#| export
_GRAY = (0.2989, 0.587, 0.114)   # torchvision's rgb_to_grayscale weights


def _gray(x: torch.Tensor) -> torch.Tensor:
    "(C, 3, H, W) -> (C, 1, H, W)"
    r, g, b = x.unbind(1)
    return (_GRAY[0] * r + _GRAY[1] * g + _GRAY[2] * b)[:, None]


def _blend(x: torch.Tensor, y: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    "torchvision's `_blend`: f x + (1 - f) y, clamped to [0, 1]; f (C,)."
    f = f.to(x.dtype)[:, None, None, None]
    return (f * x + (1 - f) * y).clamp(0, 1)


def _rgb_to_hsv(x: torch.Tensor) -> torch.Tensor:
    "torchvision's `_rgb2hsv`: (..., 3, H, W) in [0, 1] -> h, s, v in [0, 1]."
    r, g, b = x.unbind(-3)
    maxc, minc = x.max(-3).values, x.min(-3).values
    eqc = maxc == minc
    cr = maxc - minc
    ones = torch.ones_like(maxc)
    s = cr / torch.where(eqc, ones, maxc)
    crd = torch.where(eqc, ones, cr)
    rc, gc, bc = (maxc - r) / crd, (maxc - g) / crd, (maxc - b) / crd
    h = ((maxc == r) * (bc - gc) + ((maxc == g) & (maxc != r)) * (2.0 + rc - bc)
         + ((maxc != g) & (maxc != r)) * (4.0 + gc - rc))
    return torch.stack([torch.fmod(h / 6.0 + 1.0, 1.0), s, maxc], -3)


def _hsv_to_rgb(x: torch.Tensor) -> torch.Tensor:
    "torchvision's `_hsv2rgb`."
    h, s, v = x.unbind(-3)
    i = torch.floor(h * 6.0)
    f = h * 6.0 - i
    i = i.to(torch.int32) % 6
    p, q, t = ((v * (1.0 - s)).clamp(0, 1), (v * (1.0 - s * f)).clamp(0, 1), (v * (1.0 - s * (1.0 - f))).clamp(0, 1))
    mask = (i[..., None, :, :] == torch.arange(6, device=i.device).view(-1, 1, 1)).to(x.dtype)   # (..., 6, H, W)
    a = torch.stack([torch.stack(c, -3) for c in ((v, q, p, p, t, v), (t, v, v, q, p, p), (p, p, t, v, v, q))], -4)
    return torch.einsum("...ijk,...xijk->...xjk", mask, a)


def _jitter_op(x: torch.Tensor, op: int, f: torch.Tensor) -> torch.Tensor:
    "One ColorJitter operation with per-image factors f (C,): 0 brightness, 1 contrast, 2 saturation, 3 hue."
    if op == 0:
        return _blend(x, torch.zeros_like(x), f)
    if op == 1:
        return _blend(x, _gray(x).mean(dim=(1, 2, 3), keepdim=True), f)
    if op == 2:
        return _blend(x, _gray(x), f)
    hsv = _rgb_to_hsv(x)
    h = torch.remainder(hsv[:, 0] + f.to(x.dtype)[:, None, None], 1.0)
    return _hsv_to_rgb(torch.stack([h, hsv[:, 1], hsv[:, 2]], 1))


def _blur(x: torch.Tensor, sigma: torch.Tensor, k: int) -> torch.Tensor:
    "Gaussian blur with a per-image sigma (C,), k taps, reflected borders: torchvision's `gaussian_blur`, batched."
    C, ch, H, W = x.shape
    t = torch.arange(k, dtype=x.dtype, device=x.device) - (k - 1) / 2
    g = torch.exp(-0.5 * (t[None] / sigma.to(x.dtype)[:, None]) ** 2)
    g = (g / g.sum(1, keepdim=True)).repeat_interleave(ch, 0)                            # (C ch, k)
    y = F.pad(x.reshape(1, C * ch, H, W), (k // 2,) * 4, mode="reflect")
    y = F.conv2d(y, g[:, None, :, None], groups=C * ch)                                   # vertical
    y = F.conv2d(y, g[:, None, None, :], groups=C * ch)                                   # horizontal
    return y.reshape(C, ch, H, W)


@torch.no_grad()
def color_augment(
    x: torch.Tensor,   # (C, 3, H, W) images in [0, 1]
    u: torch.Tensor,   # (C, 13) uniform noise
    jitter: tuple[float, float, float, float] = (0.4, 0.4, 0.2, 0.1),  # brightness, contrast, saturation, hue
    p_jitter: float = 0.8, p_gray: float = 0.2, p_blur: float = 0.1, p_solarize: float = 0.2,
    sigma: tuple[float, float] = (0.1, 2.0),   # blur sigma in pixels of a 224-pixel image
) -> torch.Tensor:     # (C, 3, H, W) in [0, 1]
    """A-CLIP's colour augmentation of the online views (ColorJitter, RandomGrayscale, GaussianBlur, Solarize), batched.
    Each operation runs on the whole batch and `torch.where` keeps it for the images the noise gave it to: no index of
    the chosen images, whose count a GPU's host would wait for (the cost: every jitter operation at every position, 16
    instead of 4 passes, and the blur on every image)."""
    C, _, H, W = x.shape
    u = u.to(torch.float64)
    lo = torch.tensor([1 - jitter[0], 1 - jitter[1], 1 - jitter[2], -jitter[3]], dtype=torch.float64)
    hi = torch.tensor([1 + jitter[0], 1 + jitter[1], 1 + jitter[2], jitter[3]], dtype=torch.float64)
    lo[:3] = lo[:3].clamp_min(0)
    lo, hi = lo.to(u.device, non_blocking=True), hi.to(u.device, non_blocking=True)    # sent without waiting
    fac = lo + (hi - lo) * u[:, 1:5]                                                       # (C, 4)
    order = u[:, 5:9].argsort(1)                                                           # (C, 4) a random permutation
    rows = lambda m: m[:, None, None, None]                                                # (C,) -> (C, 1, 1, 1)
    on = u[:, 0] < p_jitter
    for pos in range(4):                     # each image one operation per position: the four choices are disjoint
        for op in range(4):
            x = torch.where(rows(on & (order[:, pos] == op)), _jitter_op(x, op, fac[:, op]), x)
    x = torch.where(rows(u[:, 9] < p_gray), _gray(x).expand(-1, 3, -1, -1), x)
    scale = min(H, W) / 224
    s = (sigma[0] + (sigma[1] - sigma[0]) * u[:, 11]) * scale                              # (C,)
    x = torch.where(rows(u[:, 10] < p_blur), _blur(x, s, 2 * math.ceil(3 * sigma[1] * scale) + 1), x)
    return torch.where(rows(u[:, 12] < p_solarize) & (x >= 128 / 255), 1 - x, x)


# %% [markdown]
# Checks, image by image against torchvision's functionals: each jitter operation, the blur; then the whole chain
# against torchvision's functionals applied in the order and with the factors the noise gave. The share of images
# each step touches matches its probability.

# %%
_x01 = torch.rand(8, 3, 16, 16, generator=_g, dtype=torch.float64)
_f = torch.linspace(0.6, 1.4, 8, dtype=torch.float64)
_hf = torch.linspace(-0.1, 0.1, 8, dtype=torch.float64)
for op, fn, fs in ((0, TF.adjust_brightness, _f), (1, TF.adjust_contrast, _f), (2, TF.adjust_saturation, _f),
                   (3, TF.adjust_hue, _hf)):
    _y = _jitter_op(_x01, op, fs)
    for i in range(8):
        assert_close(_y[i], fn(_x01[i], float(fs[i])), rtol=0, atol=1e-5 if op == 3 else 1e-12, msg=fn.__name__)
_sg = torch.linspace(0.3, 1.9, 8, dtype=torch.float64)
_yb = _blur(_x01, _sg, 7)
for i in range(8):
    assert_close(_yb[i], TF.gaussian_blur(_x01[i], [7, 7], [float(_sg[i])] * 2), rtol=0, atol=1e-12)
assert_close(_gray(_x01)[:, 0], TF.rgb_to_grayscale(_x01)[:, 0])


def _tv_chain(x, u, H=16):
    "The same chain with torchvision's functionals, one image."
    lo, hi = [0.6, 0.6, 0.8, -0.1], [1.4, 1.4, 1.2, 0.1]
    fac = [lo[j] + (hi[j] - lo[j]) * float(u[1 + j]) for j in range(4)]
    fns = [TF.adjust_brightness, TF.adjust_contrast, TF.adjust_saturation, TF.adjust_hue]
    if u[0] < 0.8:
        for op in u[5:9].argsort().tolist():
            x = fns[op](x, fac[op])
    if u[9] < 0.2:
        x = TF.rgb_to_grayscale(x, 3)
    if u[10] < 0.1:
        s = (0.1 + 1.9 * float(u[11])) * H / 224
        x = TF.gaussian_blur(x, [2 * math.ceil(3 * 2.0 * H / 224) + 1] * 2, [s, s])
    if u[12] < 0.2:
        x = TF.solarize(x, 128 / 255)
    return x

_uc = hash_uniform(torch.arange(400), 0, 3, 13)
_uc[:, 10] = _uc[:, 10] * 0.2                                                 # blur more often, to test it
_xc = torch.rand(400, 3, 16, 16, generator=_g, dtype=torch.float64)
_ya = color_augment(_xc, _uc)
for i in range(400):
    assert_close(_ya[i], _tv_chain(_xc[i], _uc[i]), rtol=0, atol=1e-5, msg=str(i))  # torchvision's hue runs in float32
assert (_ya >= 0).all() and (_ya <= 1).all() and torch.equal(color_augment(_xc[5:9], _uc[5:9]), _ya[5:9])
_touched = (_ya - _xc).abs().flatten(1).amax(1) > 0
print(f"images changed: {float(_touched.double().mean()):.3f} (jitter 0.8, grayscale 0.2, blur, solarize 0.2)")
