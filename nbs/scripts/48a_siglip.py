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
#| default_exp baselines.siglip

# %%
#| export
from __future__ import annotations

from powerclip.dist import DistContext, gather
from powerclip.loss import siglip_loss
from powerclip.methods import SIGLIP_INIT, Method, register

# %%
#| hide
import math

import torch
from fastcore.test import test_fail
from torch.testing import assert_close


# %% [markdown]
# # SigLIP
#
# > Sigmoid loss for language-image pre-training (Zhai et al., ICCV 2023), with the model's own scale and bias.
#
# The pairwise sigmoid loss of `11_loss` (`siglip_loss`: equal to open_clip's `SigLipLoss` on every rank) on the
# pooled embeddings, with $t$ and $b$ held by the model as open_clip's SigLIP models hold them.

# %% [markdown]
# **t and b are the model's.** open_clip's SigLIP models keep $t'$ in `logit_scale` (so $t=e^{t'}$, what `encode`
# returns) and $b$ in `logit_bias`, a parameter of the model built with `init_logit_bias`; SigLIP initialises
# $t'=\log 10$ and $b=-10$ (Sec. 3 of the paper). The method asks the trainer for exactly that model
# (`model_kwargs`: `SIGLIP_INIT`, under the run's own `model.kwargs`), so both are in the model's `state_dict`, trained
# with it at the run's learning rate, saved with it, and a SigLIP snapshot carries them into a fine-tune (`45_c2lip`'s
# "C2LIP (SigLIP)" uses them). The run's config records the kwargs, so the evaluator builds the same model.
#
# **Any pooling.** The loss reads the two pooled vectors only, so it trains under `tok`, `avg` and `map` (SigLIP's own
# image tower, `30_model`, "MAP"); the smoke preset included. **Deviation, written down:** the text tower stays CLIP's
# (BPE tokenizer, EOT pooling, causal mask) because SigLIP's SentencePiece tokenizer is not available offline, and
# released SigLIP weights (timm towers) do not load; this is SigLIP's loss, $t$, $b$ and image head on CLIP's text
# tower.
#
# **Across processes.** Only the texts are gathered (one collective with gradient, `powerclip.dist.gather`): each
# process sums its own images against every text. Each step makes no host sync of its own
# (`tests/test_cuda_dry_run.py`), and gradient accumulation is exact (`49c_accum`): the loss reads the joined outputs.

# %%
#| export
@register("siglip")
class SigLIP(Method):
    "SigLIP: the pairwise sigmoid loss with the model's own t (`logit_scale`) and b (`logit_bias`)."
    pools = ("tok", "avg", "map")

    def model_kwargs(self) -> dict:
        return dict(SIGLIP_INIT)

    def loss(self, out, batch, dist: DistContext):
        if "logit_bias" not in out:
            raise ValueError("siglip needs the model's own logit_bias: build the model with "
                             "model.kwargs.init_logit_bias (the trainer does, from model_kwargs)")
        g = gather(dist, {"text": out["text"]})                                       # (C, D)
        return {"siglip": siglip_loss(out["image"], out["text"], out["logit_scale"], out["logit_bias"],
                                      g.all["text"], g.offset),
                "_logit_scale": out["logit_scale"].detach(), "_logit_bias": out["logit_bias"].detach()}


# %% [markdown]
# On the micro model built as the trainer builds it: $t$ starts at 10 and $b$ at $-10$ in the model's `state_dict`, the
# loss is `siglip_loss` on the pooled vectors, and both get gradients; a model without $b$ is refused in one line.
# Under each pooling, MAP included.

# %%
from powerclip.methods import get_method
from powerclip.model import create_model, encode
from powerclip.tokens import default_tokenizer

_m = get_method("siglip")
_tok = default_tokenizer()(["a red cube", "two blue spheres", "a green cone left of a cube"])
for _pool in _m.pools:
    torch.manual_seed(0)
    _model = create_model("powerclip-micro", pool=_pool, **_m.model_kwargs())[0]
    assert {"logit_scale", "logit_bias"} <= set(_model.state_dict())
    assert abs(float(_model.logit_scale.exp()) - 10) < 1e-5 and float(_model.logit_bias) == -10.0
    _batch = {"image": torch.randn(3, 3, 32, 32), "tokens": _tok}
    _out = _m.forward(_model, _batch)
    _terms = _m.loss(_out, _batch, DistContext())
    assert_close(_terms["siglip"], siglip_loss(_out["image"], _out["text"], _out["logit_scale"], _out["logit_bias"]))
    _terms["siglip"].backward()
    assert _model.logit_scale.grad is not None and _model.logit_bias.grad is not None
    print(_pool, {k: round(float(v), 4) for k, v in _terms.items()})
_plain = create_model("powerclip-micro")[0]
test_fail(lambda: _m.loss(encode(_plain, _batch["image"], _tok), _batch, DistContext()), contains="logit_bias")
assert math.isclose(SIGLIP_INIT["init_logit_scale"], math.log(10))
