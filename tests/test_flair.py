"""FLAIR (`48b_flair`, `22b_subcaptions`) against its code's computation (`ExplainableML/flair`).

1. The loss equals a float64 reference written here from FlairLoss's computation: for each image its K sub-captions
   (positives) and one sub-caption of every other image (negatives, the one `pair_uniform` picks), (B, K + B - 1)
   text-conditioned logits summed and divided by K + B - 1; the global image against all B K sub-captions, its own K
   positive, summed and divided by B K; the total (tcs + mps) / 2. The inputs make every term and every positive count
   (the K sub-captions of an image differ; both terms are far from each other and from zero).
2. Two gloo processes (two rows each) equal one process on the four rows: the mean of their losses, the pooling's and
   the bias's gradients (averaged, as DDP does) and each input's gradient.
3. The sampler draws as FLAIR's `sample_dict`: m of 1-3 sentences uniformly; for m >= 2 a window of consecutive
   sentences or m distinct sentences in random order, half each; windows start at 0 .. n - m - 1 (FLAIR's
   `draw_numbers(n - m)`); the whole caption when m >= n; a one-sentence caption gives itself K times; the draws are a
   function of (run seed, epoch, sample id).
4. FLAIR's retrieval score of a pair is the text-conditioned one: the cosine of the pooling of the image's patches with
   the text as query, and the text; its heat map is the pooling's attention over the patches.
5. The world's long captions (`22_world`, `caption='long'`): each sentence is true of its scene, the tree holds every
   sentence's nodes, the words fit `powerclip-demo-long`'s context (and not `powerclip-demo`'s 32 tokens).
"""
import os
import socket
from collections import Counter
from pathlib import Path

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from powerclip.baselines.flair import AttentionPool, FlairModules, FlairScorer, pair_uniform
from powerclip.dist import DistContext
from powerclip.methods import get_method
from powerclip.subcaptions import sample_subcaptions, subcaption_generator

B, K, N, D, STEP, SEED = 4, 3, 5, 8, 7, 11


def _inputs():
    "float64 model outputs of B images with K different sub-captions each, and the method's modules."
    g = torch.Generator().manual_seed(0)
    image = torch.randn(B, D, generator=g, dtype=torch.float64)
    patches = torch.randn(B, N, D, generator=g, dtype=torch.float64)
    text = torch.randn(B, K, D, generator=g, dtype=torch.float64)
    torch.manual_seed(1)
    mods = FlairModules(D, heads=2, init_bias=-1.0).double()
    with torch.no_grad():
        for p in mods.pool.parameters():      # LayerNorms away from the identity: every weight matters
            p.add_(0.1 * torch.randn(p.shape, dtype=torch.float64))
    keys = torch.tensor([40, 3, 17, 8])
    return image, patches, text, mods, keys


def _method():
    m = get_method("flair", {"K": K}, seed=SEED)
    m.on_step(STEP, 100)
    return m


def _reference(image, patches, text, mods, scale, keys):
    "FlairLoss (added_mps_loss=True) on one process, written out per image, per text."
    u = pair_uniform(keys, keys, STEP, SEED)
    b = mods.logit_bias
    tcs = mps = torch.zeros((), dtype=torch.float64)
    for i in range(B):
        texts = [text[i, k] for k in range(K)] + [text[j, int(u[i, j] * K)] for j in range(B) if j != i]
        v = mods.pool(torch.stack(texts)[None], patches[i:i + 1])[0]            # (K + B - 1, D)
        for n, t in enumerate(texts):
            y = 1.0 if n < K else -1.0
            tcs = tcs - F.logsigmoid(y * (scale * F.cosine_similarity(v[n], t, dim=0) + b))
        for j in range(B):
            for k in range(K):
                y = 1.0 if j == i else -1.0
                mps = mps - F.logsigmoid(y * (scale * F.cosine_similarity(image[i], text[j, k], dim=0) + b))
    return tcs / (K + B - 1), mps / (B * K)


def _out(image, patches, text, mods, scale):
    return dict(image=image, patches=patches, text=text, logit_scale=scale, flair=mods)


def test_loss_equals_the_float64_reference():
    image, patches, text, mods, keys = _inputs()
    scale = torch.tensor(5.0, dtype=torch.float64)
    tcs, mps = (x.detach() for x in _reference(image, patches, text, mods, scale, keys))
    # every term and positive counts: the terms differ from each other and from zero, and sub-captions of one image
    # give different logits (so which one is a positive or a pick matters)
    assert abs(float(tcs - mps)) > 0.1 and min(float(tcs), float(mps)) > 0.1
    assert len({round(float(x), 6) for x in (patches[0, 0] @ text[0].T)}) == K
    terms = _method().loss(_out(image, patches, text, mods, scale), {"index": keys}, DistContext())
    torch.testing.assert_close(terms["tcs"], tcs / 2, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(terms["mps"], mps / 2, rtol=1e-12, atol=1e-12)
    # without the multi-positive term: the text-conditioned one alone (added_mps_loss=False)
    m = get_method("flair", {"K": K, "mps": False}, seed=SEED)
    m.on_step(STEP, 100)
    alone = m.loss(_out(image, patches, text, mods, scale), {"index": keys}, DistContext())
    assert "mps" not in alone
    torch.testing.assert_close(alone["tcs"], tcs, rtol=1e-12, atol=1e-12)


def test_other_images_captions_are_keyed_by_the_samples():
    "The pick of image j's sub-caption for image i: a function of (seed, step, the two ids), one of its K, varied."
    keys = torch.tensor([40, 3, 17, 8, 90, 5])
    u = pair_uniform(keys, keys, STEP, SEED)
    torch.testing.assert_close(pair_uniform(keys[[4, 1]], keys[[2, 0, 5]], STEP, SEED), u[[4, 1]][:, [2, 0, 5]])
    assert not torch.equal(pair_uniform(keys, keys, STEP + 1, SEED), u)
    assert not torch.equal(pair_uniform(keys, keys, STEP, SEED + 1), u)
    picks = (u * K).long()
    assert picks.min() >= 0 and picks.max() < K and len(set(picks.flatten().tolist())) == K


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _grads(rows, ctx):
    "This process's loss on `rows` of the inputs, and the gradients of its inputs and of the modules."
    image, patches, text, mods, keys = _inputs()
    scale = torch.tensor(5.0, dtype=torch.float64, requires_grad=True)
    leaves = [x[rows].clone().requires_grad_() for x in (image, patches, text)]
    terms = _method().loss(_out(*leaves, mods, scale), {"index": keys[rows]}, ctx)
    loss = sum(v for k, v in terms.items() if not k.startswith("_"))
    loss.backward()
    return (loss.detach(), [x.grad for x in leaves], scale.grad,
            {n: p.grad.clone() for n, p in mods.named_parameters()})


def _worker(rank, world, port, out):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from powerclip.dist import all_mean, cleanup, init_distributed
    ctx = init_distributed("cpu")
    loss, inputs, scale_grad, mods = _grads(slice(2 * rank, 2 * rank + 2), ctx)
    res = (all_mean(loss), inputs, all_mean(scale_grad), {n: all_mean(g) for n, g in mods.items()})
    torch.save(res, f"{out}.{rank}")
    cleanup(ctx)


def test_two_gloo_processes_equal_one():
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"flair_ddp_{os.getpid()}"
    mp.start_processes(_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True, start_method="spawn")
    res = [torch.load(f"{out}.{r}", weights_only=False) for r in (0, 1)]
    for r in (0, 1):
        Path(f"{out}.{r}").unlink()
    loss1, inputs1, scale1, mods1 = _grads(slice(None), DistContext())
    loss2, _, scale2, mods2 = res[0]
    torch.testing.assert_close(loss2, loss1, rtol=0, atol=1e-12)
    torch.testing.assert_close(scale2, scale1, rtol=0, atol=1e-12)
    assert mods1.keys() == mods2.keys() and len(mods1) > 6
    for n in mods1:
        torch.testing.assert_close(mods2[n], mods1[n], rtol=0, atol=1e-12, msg=n)
    for r in (0, 1):   # each input's gradient: the sum over both processes' losses (the gather's backward) / 2
        for g1, g2 in zip(inputs1, res[r][1]):
            torch.testing.assert_close(g2 / 2, g1[2 * r:2 * r + 2], rtol=0, atol=1e-12)


SENTS = [f"s{i}" for i in range(6)]


def _draws(text, n=9000, seed=3):
    return sample_subcaptions(text, n, torch.Generator().manual_seed(seed))


def test_sampler_draws_as_sample_dict():
    idx = [[SENTS.index(w) for w in d.split(". ")] for d in _draws(". ".join(SENTS) + ".")]
    n = len(idx)
    by_m = Counter(len(i) for i in idx)
    for m in (1, 2, 3):   # m uniform over 1..3
        assert abs(by_m[m] / n - 1 / 3) < 0.025, by_m
    assert all(len(set(i)) == len(i) for i in idx)                 # a sentence at most once
    for m in (2, 3):
        drawn = Counter(tuple(i) for i in idx if len(i) == m)
        starts = len(SENTS) - m                                    # FLAIR's window starts: 0 .. n - m - 1
        perms = {2: 30, 3: 120}[m]                                 # ordered picks of m of 6 sentences
        share = lambda key: drawn[key] / by_m[m]
        first = tuple(range(m))                                    # a window (1 / starts of half) or a random pick
        last = tuple(range(len(SENTS) - m, len(SENTS)))             # never a window: random picks only
        assert abs(share(first) - (0.5 / starts + 0.5 / perms)) < 0.03, (m, share(first))
        assert abs(share(last) - 0.5 / perms) < 0.012, (m, share(last))
        consecutive = sum(v for k, v in drawn.items() if k == tuple(range(k[0], k[0] + m))) / by_m[m]
        in_runs = (len(SENTS) - m + 1) / perms                      # a random pick that happens to be a run in order
        assert abs(consecutive - (0.5 + 0.5 * in_runs)) < 0.04, (m, consecutive)
        reversed_ = sum(v for k, v in drawn.items() if list(k) == sorted(k, reverse=True)) / by_m[m]
        assert abs(reversed_ - 0.5 / {2: 2, 3: 6}[m]) < 0.03, (m, reversed_)   # random order: random picks only


def test_sampler_short_captions_and_seeding():
    assert sample_subcaptions("a red circle left of a blue square", 8, torch.Generator().manual_seed(0)) == [
        "a red circle left of a blue square"] * 8
    two = Counter(_draws("One. Two.", 3000))
    assert set(two) == {"One", "Two", "One. Two", "Two. One"}
    # m = 2 = n: a window is the whole caption, random places both sentences in random order; m = 3 > n: the whole
    assert abs(two["One. Two"] / 3000 - (0.75 / 3 + 1 / 3)) < 0.04, two
    assert abs(two["Two. One"] / 3000 - 0.25 / 3) < 0.02, two
    a = sample_subcaptions(". ".join(SENTS), 8, subcaption_generator(5, 1, 42))
    assert a == sample_subcaptions(". ".join(SENTS), 8, subcaption_generator(5, 1, 42))
    assert a != sample_subcaptions(". ".join(SENTS), 8, subcaption_generator(5, 1, 43))
    assert a != sample_subcaptions(". ".join(SENTS), 8, subcaption_generator(5, 2, 42))


def test_the_pipeline_gives_k_subcaptions_per_image():
    from powerclip.data import BatchNeeds, BatchSpec, DataConfig, make_loader
    from powerclip.model import model_geometry
    spec = BatchSpec(DataConfig(batch_size=4, workers=0, world_length=8), model_geometry("powerclip-micro"),
                     BatchNeeds(subcaptions=5), seed=2)
    b = next(iter(make_loader(spec)))
    assert b["sub_tokens"].shape == (4, 5, 77)
    # the world's captions are one sentence: each sub-caption is the caption
    assert torch.equal(b["sub_tokens"], b["tokens"][:, None].expand(-1, 5, -1))


def test_flair_score_is_the_text_conditioned_one():
    from powerclip.model import create_model, encode
    torch.manual_seed(0)
    model = create_model("powerclip-micro")[0].eval()
    method = get_method("flair")
    mods = method.build_modules(model)
    sc = method.scorers(mods)
    assert list(sc) == ["flair", "global"]
    imgs = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    tok = torch.zeros(4, 77, dtype=torch.long)
    tok[:, 0], tok[:, 1:4], tok[:, 4] = 49406, torch.arange(300, 312).reshape(4, 3), 49407
    f = sc["flair"]
    S = f.scores(f.image_features(model, imgs), f.text_features(model, tok))
    with torch.no_grad():
        e = encode(model, imgs, None)
        t = encode(model, None, tok)["text"]
        for i in range(3):
            for j in range(4):
                v = mods.pool(t[j][None, None], e["patches"][i:i + 1])[0, 0]
                torch.testing.assert_close(S[i, j], F.cosine_similarity(v, t[j], dim=0))
        glob = e["image"] @ t.T
    assert not torch.allclose(S, glob, atol=1e-3)
    torch.testing.assert_close(FlairScorer(mods, image_block=2).scores(f.image_features(model, imgs),
                                                                       f.text_features(model, tok)), S)
    heat = f.heatmaps(model, imgs[0], tok)
    assert heat.shape == (4, 16) and (heat >= 0).all() and (heat.sum(1) <= 1 + 1e-6).all()
    with torch.no_grad():
        _, w = mods.pool(t[None], e["patches"][:1], weights=True)
    torch.testing.assert_close(heat, w[0, :, :-1])
    # the pointing game's heat function (`67_heatmaps`) draws FLAIR's map with its scorer, the cosine map without
    from powerclip.heatmaps import model_heat_fn, text_patch_heatmaps
    from powerclip.tokens import default_tokenizer
    from powerclip.world import WorldConfig, generate, to_clip_tensor
    rgb = generate(WorldConfig(image_size=32, patch_size=8), 0)["image"]
    texts = ["a red circle", "a blue square"]
    tk = default_tokenizer()
    own = model_heat_fn(model, tk, f)(rgb, texts)
    torch.testing.assert_close(own, f.heatmaps(model, to_clip_tensor(rgb), tk(texts)).view(2, 4, 4))
    torch.testing.assert_close(model_heat_fn(model, tk, sc["global"])(rgb, texts),
                               text_patch_heatmaps(model, to_clip_tensor(rgb), texts, tk))
    try:
        method.scorers(None)["flair"].scores({"patches": e["patches"]}, {"text": t})
        raise AssertionError("scored without the trained pooling")
    except ValueError as err:
        assert "method_modules.pt" in str(err)


def test_pooling_is_flairs_block():
    "Multi-head attention with add_zero_attn, LayerNorms on q, k, v; FLAIR's t, b and K at their defaults."
    pool = AttentionPool(16, heads=8)
    assert pool.attn.num_heads == 8 and pool.attn.add_zero_attn and pool.attn.batch_first
    assert all(isinstance(getattr(pool, n), torch.nn.LayerNorm) for n in ("ln_q", "ln_k", "ln_v"))
    m = get_method("flair")
    assert (m.cfg.K, m.cfg.init_bias, m.cfg.mps) == (8, -10.0, True) and m.pools == ("tok",)
    from powerclip.model import create_model
    model = create_model("powerclip-micro")[0]
    assert float(m.build_modules(model).logit_bias.detach()) == -10.0
    torch.testing.assert_close(float(model.logit_scale.exp()), 1 / 0.07, rtol=1e-6, atol=0)


def test_long_captions_are_true_sentence_by_sentence():
    """The world's long captions (`WorldConfig(caption='long')`): each sentence true of its scene (the world's truth
    function), the tree's nodes those of every sentence, every word a leaf within `powerclip-demo-long`'s context;
    FLAIR's sub-captions of a long caption are sentences of it."""
    from powerclip.model import model_geometry
    from powerclip.parsing import tree_problems
    from powerclip.subcaptions import split_sentences
    from powerclip.tokens import tree_tokens
    from powerclip.world import WorldConfig, caption_text, caption_tree, caption_truth, generate, spec_from_text
    cfg = WorldConfig(caption="long")
    L = model_geometry("powerclip-demo-long").context_length
    longest, relations = 0, 0
    for split in ("train", "test"):
        for i in range(150):
            s = generate(cfg, i, split)
            sents = split_sentences(s["text"])
            assert sents == [caption_text(sp) for sp in s["specs"]] and len(sents) >= len(s["order"])
            for text in sents:
                assert caption_truth(spec_from_text(text, cfg), s["scene"], cfg) is True, (split, i, text)
            relations += sum(len(sp.mentions) == 2 for sp in s["specs"])
            p = s["parsed"]
            assert not tree_problems(p)
            assert len(p.spans) == sum(len(caption_tree(sp)[0].spans) for sp in s["specs"]) + (len(sents) > 1)
            tt = tree_tokens(p, context_length=L)
            assert bool(tt.leaf_valid.all()) and bool(tt.node_valid.all()), (split, i)
            longest = max(longest, int((tt.tokens != 0).sum()))
            for sub in sample_subcaptions(s["text"], 8, subcaption_generator(0, 0, i)):
                assert set(sub.split(". ")) <= set(sents)
    assert 32 < longest <= L and relations > 100   # beyond powerclip-demo's 32 tokens, within the long model's
    short = generate(WorldConfig(), 0)
    assert short["text"] == caption_text(short["spec"]) and "." not in short["text"]   # short stays the default
