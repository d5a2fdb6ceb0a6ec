"""Bad input, serialisation, truncation, collation, failure injection, multi-process parsing and real captions
for powerclip.parsing (what notebook cells cannot cover comfortably)."""
import json, logging, time
from pathlib import Path

import pytest
import torch

from powerclip import parsing
from powerclip.parsing import (ParsedCaption, ParserConfig, ParserUnavailable, collate_trees, default_tokenizer,
                               parse_caption, parse_captions, tree_problems, tree_tokens)

DATA = Path(__file__).resolve().parents[1] / '..' / 'shared' / 'data'


def check_tokens(pc: ParsedCaption, tt, L=77):
    "Every invariant that links a ParsedCaption to its TreeTokens."
    tok = default_tokenizer()
    W, K = len(pc.words), len(pc.spans)
    assert tt.tokens.shape == (L,) and tt.leaf_tokens.shape == (W, L)
    assert tt.leaf_valid.shape == (W,) and tt.incidence.shape == (K, W) and tt.node_valid.shape == (K,)
    ids = tt.tokens.tolist()
    assert ids[0] == tok.sot_token_id
    eot = ids.index(tok.eot_token_id)
    assert all(i == 0 for i in ids[eot + 1:])
    assert not tt.leaf_tokens[:, 0].any() and not tt.leaf_tokens[:, eot:].any()
    assert (tt.leaf_tokens.sum(0) <= 1).all()                             # a position belongs to one word
    assert int(tt.leaf_tokens.sum()) == eot - 1                           # every piece belongs to a word
    for w in range(W):
        pos = tt.leaf_tokens[w].nonzero().flatten().tolist()
        if tt.leaf_valid[w]:
            assert pos == list(range(pos[0], pos[0] + len(pos)))            # contiguous
            assert [ids[p] for p in pos] == tok.encode(pc.words[w])        # exactly the word's pieces
        else: assert pos == []
    valid = tt.leaf_valid.tolist()
    kept = [v for v, word in zip(valid, pc.words) if tok.encode(word)]    # words that have pieces at all
    assert kept == sorted(kept, reverse=True)                             # truncation cuts a suffix only
    for k, (s, e) in enumerate(pc.spans):
        assert tt.incidence[k].tolist() == [s <= w < e and valid[w] for w in range(W)]
    assert torch.equal(tt.node_valid, tt.incidence.any(1))


def parse_ok(text, cfg=None):
    pc = parse_caption(text, cfg)
    assert tree_problems(pc) == [], (text, pc)
    assert ParsedCaption.from_dict(json.loads(json.dumps(pc.to_dict()))) == pc
    tt = tree_tokens(pc)
    check_tokens(pc, tt)
    return pc, tt


@pytest.mark.parametrize('text', ['', '   ', '\n\t ', None])
def test_empty_caption_is_a_single_invalid_root(text):
    pc, tt = parse_ok(text)
    assert pc.words == [] and pc.spans == [(0, 0)] and pc.labels == ['TOP'] and pc.parser == 'fallback'
    assert 'empty caption' in pc.notes
    assert tt.node_valid.tolist() == [False] and tt.leaf_valid.shape == (0,)
    assert tt.tokens[:2].tolist() == [default_tokenizer().sot_token_id, default_tokenizer().eot_token_id]


def test_non_string_caption_is_converted_with_a_note():
    pc, _ = parse_ok(12345)
    assert pc.words == ['12345'] and any('converted to str' in n for n in pc.notes)


@pytest.mark.parametrize('text', ['dog', 'Dogs!', '😀', '...'])
def test_one_word_caption_has_a_valid_root(text):
    pc, tt = parse_ok(text)
    assert pc.spans[0] == (0, len(pc.words)) and tt.node_valid[0]


def test_html_entities_are_unescaped():
    pc, _ = parse_ok('tom &amp; jerry &quot;on&quot; the sofa &amp;amp; more')
    assert '&amp;' not in pc.text and '&quot;' not in pc.text and '&' in pc.words and '"' in pc.text
    assert 'unescaped HTML entities' in pc.notes


def test_urls_are_removed_with_a_note():
    pc, _ = parse_ok('a cat on a mat https://example.com/a/b?c=d www.example.org/x see')
    assert 'http' not in pc.text and 'www' not in pc.text and pc.words[:5] == ['a', 'cat', 'on', 'a', 'mat']
    assert 'removed 2 URL(s)' in pc.notes
    pc, tt = parse_ok('http://only.a/url')
    assert pc.words == [] and tt.node_valid.tolist() == [False] and pc.notes == ['removed 1 URL(s)', 'empty caption']


def test_emoji_are_kept_as_words():
    pc, tt = parse_ok('a happy dog 🐶🐶 in the park 🌳')
    assert any('🐶' in w for w in pc.words) and tt.leaf_valid.all()


@pytest.mark.parametrize('text', ['一只狗坐在红色的椅子上', 'собака сидит на красном стуле', 'كلب يجلس على كرسي'])
def test_non_latin_text_gets_a_tree_and_a_note(text):
    pc, tt = parse_ok(text)
    assert tt.node_valid[0] and any('non-Latin' in n for n in pc.notes)


def test_control_characters_and_zero_width():
    pc, tt = parse_ok('a\x00dog\x07 on\u200b a chair\r\n')
    assert '\x00' not in pc.text and tt.node_valid[0]


def test_caption_over_77_tokens_is_truncated_at_a_word_boundary():
    text = ' '.join(['a supercalifragilistic photograph of hippopotamuses'] * 12)   # ~ 12*10 pieces
    pc, tt = parse_ok(text, ParserConfig(max_words=1000))
    n_valid = int(tt.leaf_valid.sum())
    assert 0 < n_valid < len(pc.words) and tt.leaf_valid[:n_valid].all() and not tt.leaf_valid[n_valid:].any()
    assert tt.tokens[-1] in (0, default_tokenizer().eot_token_id) and int(tt.leaf_tokens.sum()) <= 75
    assert tt.node_valid[0] and not tt.node_valid.all()
    assert any(n.startswith('truncated to 77 tokens') for n in tt.notes)
    # a word that would not fit whole is dropped, never half-encoded
    nxt = len(default_tokenizer().encode(pc.words[n_valid]))
    assert int(tt.leaf_tokens.sum()) + nxt > 75


def test_shorter_context_length():
    pc = parse_caption('a dog sitting on a red chair')
    tt = tree_tokens(pc, context_length=6)
    assert tt.tokens.shape == (6,) and tt.leaf_valid.tolist() == [True] * 4 + [False] * 3
    check_tokens(pc, tt, L=6)


def test_very_long_caption_is_capped_quickly():
    text = 'the quick brown fox jumps over the lazy dog and ' * 5000      # ~ 250k characters
    t0 = time.time()
    pc, tt = parse_ok(text)
    assert time.time() - t0 < 10
    assert len(pc.text) <= ParserConfig().max_chars and len(pc.words) == ParserConfig().max_words
    assert any(n.startswith('cut ') for n in pc.notes) and any('max_words' in n for n in pc.notes)
    pc, _ = parse_ok('x' * 5000)                                           # one huge "word"
    assert len(pc.text) == ParserConfig().max_chars


def test_serialisation_round_trip_of_many_parses():
    pcs = parse_captions(['a dog sitting on a red chair', '', 'two dogs. one cat!', 'http://x.y', 'a &lt;b&gt;'])
    back = [ParsedCaption.from_dict(d) for d in json.loads(json.dumps([p.to_dict() for p in pcs]))]
    assert back == pcs and all(isinstance(s, tuple) for p in back for s in p.spans)


def test_collate_shapes_and_padding():
    pcs = parse_captions(['a dog sitting on a red chair', '', 'two cats', 'a man and a woman riding bikes on a road'])
    items = [tree_tokens(p) for p in pcs]
    b = collate_trees(items)
    W = max(len(p.words) for p in pcs); K = max(len(p.spans) for p in pcs)
    assert b['tokens'].shape == (4, 77) and b['tokens'].dtype == torch.long
    assert b['leaf_tokens'].shape == (4, W, 77) and b['leaf_valid'].shape == (4, W)
    assert b['incidence'].shape == (4, K, W) and b['node_valid'].shape == (4, K)
    for c, (p, t) in enumerate(zip(pcs, items)):
        w, k = len(p.words), len(p.spans)
        assert torch.equal(b['incidence'][c, :k, :w], t.incidence) and not b['incidence'][c, k:].any()
        assert not b['incidence'][c, :, w:].any() and not b['leaf_valid'][c, w:].any() and not b['node_valid'][c, k:].any()
    assert b['node_valid'].any(1).tolist() == [True, False, True, True]


def test_collate_all_empty_batch_has_no_empty_axis():
    b = collate_trees([tree_tokens(parse_caption('')) for _ in range(3)])
    assert b['leaf_tokens'].shape == (3, 1, 77) and b['incidence'].shape == (3, 1, 1) and not b['node_valid'].any()


def test_parser_failure_gives_flat_fallback_tree(monkeypatch):
    def boom(*a, **k): raise RuntimeError('injected')
    monkeypatch.setattr(parsing, 'spacy_doc_to_parsed', boom)
    pcs = parse_captions(['a dog sitting on a red chair', ''])
    assert pcs[0].parser == 'fallback' and pcs[0].spans == [(0, 7)] and 'injected' in pcs[0].notes[-1]
    assert pcs[1].spans == [(0, 0)] and tree_problems(pcs[0]) == []


def test_batch_failure_retries_one_by_one(monkeypatch):
    nlp = parsing.load_pipeline('spacy')
    class Flaky:        # pipe() fails, single calls work
        def pipe(self, *a, **k): raise RuntimeError('batch broke')
        def __call__(self, t): return nlp(t)
    monkeypatch.setattr(parsing, 'load_pipeline', lambda *a, **k: Flaky())
    pcs = parse_captions(['a dog', 'two cats on a mat'], ParserConfig('spacy'))
    assert [p.parser for p in pcs] == ['spacy', 'spacy'] and pcs[1].words == ['two', 'cats', 'on', 'a', 'mat']


def test_benepar_code_path_up_to_model_load(caplog):
    import benepar  # noqa: F401  the package itself must import
    ok, why = parsing.benepar_status()
    if ok: pytest.skip(f'benepar model installed ({why}); the fallback path is not exercised')
    with pytest.raises(ParserUnavailable, match='benepar_en3'):
        parse_captions(['a dog'], ParserConfig('benepar'))
    with pytest.raises(ParserUnavailable, match='benepar_en3'):
        parsing.load_pipeline('benepar')
    parsing._logged.clear()
    with caplog.at_level(logging.WARNING, logger='powerclip.parsing'):
        pc = parse_caption('a dog', ParserConfig('auto'))
    assert pc.parser == 'spacy' and any('falling back to spaCy' in r.message for r in caplog.records)


def test_unknown_parser_name():
    with pytest.raises(ValueError, match='unknown parser'):
        parse_captions(['a dog'], ParserConfig('stanza'))


def test_two_processes_give_the_same_parses():
    caps = [f'a dog number {i} sitting on a red chair' for i in range(40)] + ['', 'http://x.y', '😀']
    assert parse_captions(caps, n_process=2) == parse_captions(caps)


def _real_captions():
    coco, cc3m = DATA / 'coco_sample' / 'captions.jsonl', DATA / 'cc3m_validation' / 'Validation_GCC-1.1.0-Validation.tsv'
    if not coco.exists() or not cc3m.exists(): pytest.skip(f'shared data absent under {DATA.resolve()}')
    caps = [c for line in open(coco) for c in json.loads(line)['captions']]
    with open(cc3m) as f: caps += [line.split('\t')[0] for line, _ in zip(f, range(2000))]
    return caps


def test_real_captions_parse_without_crash():
    caps = _real_captions()
    pcs = parse_captions(caps)
    assert len(pcs) == len(caps)
    for c, p in zip(caps, pcs):
        assert tree_problems(p) == [], (c, p)
        tt = tree_tokens(p)
        assert tt.node_valid[0], c                      # every real caption keeps a valid root
        assert len(p.spans) == len(p.labels) >= 1
