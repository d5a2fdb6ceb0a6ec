"""Bad input, serialisation, truncation, collation, failure injection, multi-process parsing and real captions
for powerclip.parsing and powerclip.tokens (what notebook cells cannot cover comfortably)."""
import json, logging
from pathlib import Path

import pytest
import torch

from powerclip import parsing
from powerclip.parsing import (ParsedCaption, ParserConfig, ParserUnavailable, caption_problem, parse_caption,
                               parse_captions, tree_problems)
from powerclip.tokens import collate_trees, default_tokenizer, tree_tokens

DATA = Path(__file__).resolve().parents[1] / '..' / 'shared' / 'data'


def check_tokens(pc: ParsedCaption, tt, L=77, spell=True):
    """Every invariant that links a ParsedCaption to its TreeTokens. `spell`: each valid leaf's pieces spell the
    caption text under its words as the tokenizer cleans it (true unless ftfy rewrites across a leaf boundary)."""
    tok = default_tokenizer()
    W, K = len(pc.words), len(pc.spans)
    assert tt.tokens.shape == (L,) and tt.leaf_tokens.shape == (W, L) and tt.leaf_head.shape == (W,)
    assert tt.leaf_valid.shape == (W,) and tt.incidence.shape == (K, W) and tt.node_valid.shape == (K,)
    assert torch.equal(tt.tokens, tok([pc.text], context_length=L)[0])    # the ids evaluation uses
    ids = tt.tokens.tolist()
    assert ids[0] == tok.sot_token_id
    eot = ids.index(tok.eot_token_id)
    assert not tt.leaf_tokens[:, 0].any() and not tt.leaf_tokens[:, eot:].any()
    assert (tt.leaf_tokens.sum(0) <= 1).all()                             # a position belongs to one leaf
    head = tt.leaf_head.tolist()
    assert all(head[w] <= w and head[head[w]] == head[w] for w in range(W)) and head == sorted(head)
    assert all(not tt.leaf_valid[w] and not tt.leaf_tokens[w].any() for w in range(W) if head[w] != w)
    first_pos = []
    for w in range(W):
        pos = tt.leaf_tokens[w].nonzero().flatten().tolist()
        if tt.leaf_valid[w]:
            assert pos == list(range(pos[0], pos[0] + len(pos)))            # contiguous
            first_pos.append(pos[0])
            last = max(u for u in range(W) if head[u] == w)
            s, e = pc.offsets[w][0], pc.offsets[last][1]
            if spell:
                assert tok.decode([ids[p] for p in pos]).replace(' ', '') == tok.clean_fn(pc.text[s:e]).replace(' ', '')
        else:
            assert pos == []
    assert first_pos == sorted(first_pos)                                 # leaves in caption order
    assert torch.equal(tt.node_valid, tt.incidence.any(1))
    sets = [{head[w] for w in range(s, e) if tt.leaf_valid[head[w]]} for s, e in pc.spans]
    kept = [sets[k] for k in range(K) if tt.node_valid[k]]
    for k in range(K):                            # a node covers the valid leaves of its words, or was removed
        cov = set(tt.incidence[k].nonzero().flatten().tolist())
        if tt.node_valid[k]:
            assert cov == sets[k]
        else:
            assert (not cov
                    and (not sets[k] or sets[k] in kept or any(not (sets[k] <= o or o <= sets[k] or not sets[k] & o)
                                                                        for o in kept))), k
    assert len(kept) == len({frozenset(x) for x in kept})                 # no two nodes with the same tokens
    if W and tt.leaf_valid.any():
        assert tt.node_valid[0]                 # the root keeps every valid leaf
    if tt.node_valid[0]:
        assert tt.incidence[0].tolist() == tt.leaf_valid.tolist()


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


def test_html_entities_are_unescaped_for_the_parser_only():
    text = 'tom &amp; jerry &quot;on&quot; the sofa &amp;amp; more'
    pc, tt = parse_ok(text)
    assert pc.text == text and '&' in pc.words and '"' in pc.words and not any('&amp;' in w for w in pc.words)
    assert [text[slice(*pc.offsets[w])] for w in range(3)] == ['tom', '&amp;', 'jerry']
    assert text[slice(*pc.offsets[pc.words.index('&', 2)])] == '&amp;amp;'
    assert 'unescaped HTML entities' in pc.notes and tt.leaf_valid.all()


def test_urls_are_removed_with_a_note():
    pc, tt = parse_ok('a cat on a mat https://example.com/a/b?c=d www.example.org/x see')
    assert not any('http' in w or 'www' in w for w in pc.words) and pc.words == ['a', 'cat', 'on', 'a', 'mat', 'see']
    assert 'removed 2 URL(s)' in pc.notes
    # the URL's pieces are in the tokens (evaluation encodes them too) but belong to no leaf
    n_pieces = tt.tokens.tolist().index(default_tokenizer().eot_token_id) - 1
    assert n_pieces > int(tt.leaf_tokens.sum()) == 6 and tt.leaf_valid.all()
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
    assert not any('\x00' in w or '\x07' in w for w in pc.words) and tt.node_valid[0]


def test_caption_over_77_tokens_is_truncated_as_the_tokenizer_does():
    text = ' '.join(['a supercalifragilistic photograph of hippopotamuses'] * 12)   # ~ 12*10 pieces
    pc, tt = parse_ok(text, ParserConfig(max_words=1000))
    n_valid = int(tt.leaf_valid.sum())
    assert 0 < n_valid < len(pc.words) and tt.leaf_valid[:n_valid].all() and not tt.leaf_valid[n_valid:].any()
    assert tt.tokens[-1] == default_tokenizer().eot_token_id and int(tt.leaf_tokens.sum()) <= 75
    assert tt.node_valid[0] and not tt.node_valid.all()
    assert any(n.startswith('truncated to 77 tokens') for n in tt.notes)
    # the first word that does not fit whole is no leaf (its kept pieces stay in the ids, as in evaluation)
    nxt = len(default_tokenizer().encode(pc.words[n_valid]))
    assert int(tt.leaf_tokens.sum()) + nxt > 75


def test_truncation_leaves_no_two_nodes_with_the_same_tokens():
    "Nodes that differ only in words past the 77 tokens become the same set of positions: one of them stays."
    words = ('a dog ' * 36 + 'near a supercalifragilistic wall').split()        # 74 pieces, then the cut
    text = ' '.join(words)
    W = len(words)
    pc = ParsedCaption(text, words, [(0, W), (0, W - 1), (2, 4)], ['NP', 'NP', 'NP'], 'gold')
    tt = tree_tokens(pc)
    check_tokens(pc, tt)
    assert not tt.leaf_valid[W - 1] and tt.node_valid.tolist() == [True, False, True]
    assert any('same tokens' in n for n in tt.notes)


def test_shorter_context_length():
    pc = parse_caption('a dog sitting on a red chair')
    tt = tree_tokens(pc, context_length=6)
    assert tt.tokens.shape == (6,) and tt.leaf_valid.tolist() == [True] * 4 + [False] * 3
    assert torch.equal(tt.tokens, default_tokenizer()([pc.text], context_length=6)[0])
    check_tokens(pc, tt, L=6)


def test_very_long_caption_is_capped_before_parsing(monkeypatch):
    """A 250k-character caption is cut to max_chars before the parser sees it (what keeps it quick: the parser's cost
    grows with the text), and to max_words after; what the parser was given is recorded, not the time it took."""
    seen = []
    load = parsing.load_pipeline

    class Spy:                                  # the real pipeline, noting the length of each text it is given
        def __init__(self, nlp):
            self.nlp = nlp

        def pipe(self, texts, **kw):
            texts = list(texts)
            seen.extend(map(len, texts))
            return self.nlp.pipe(texts, **kw)

        def __call__(self, text):
            seen.append(len(text))
            return self.nlp(text)
    monkeypatch.setattr(parsing, 'load_pipeline', lambda *a, **kw: Spy(load(*a, **kw)))
    text = 'the quick brown fox jumps over the lazy dog and ' * 5000      # ~ 250k characters
    pc, tt = parse_ok(text)
    assert seen and max(seen) <= ParserConfig().max_chars, seen
    assert (pc.text == text and pc.offsets[-1][1] <= ParserConfig().max_chars
            and len(pc.words) == ParserConfig().max_words)
    assert any(n.startswith('cut ') for n in pc.notes) and any('max_words' in n for n in pc.notes)
    pc, _ = parse_ok('x' * 5000)                                           # one huge "word"
    assert pc.words == ['x' * ParserConfig().max_chars]


def test_serialisation_round_trip_of_many_parses():
    pcs = parse_captions(['a dog sitting on a red chair', '', 'two dogs. one cat!', 'http://x.y', 'a &lt;b&gt;'])
    back = [ParsedCaption.from_dict(d) for d in json.loads(json.dumps([p.to_dict() for p in pcs]))]
    assert back == pcs and all(isinstance(s, tuple) for p in back for s in p.spans)


def test_collate_shapes_and_padding():
    pcs = parse_captions(['a dog sitting on a red chair', '', 'two cats', 'a man and a woman riding bikes on a road'])
    items = [tree_tokens(p) for p in pcs]
    b = collate_trees(items)
    W = max(len(p.words) for p in pcs)
    K = max(len(p.spans) for p in pcs)
    assert b['tokens'].shape == (4, 77) and b['tokens'].dtype == torch.long
    assert b['leaf_tokens'].shape == (4, W, 77) and b['leaf_valid'].shape == (4, W)
    assert b['incidence'].shape == (4, K, W) and b['node_valid'].shape == (4, K)
    for c, (p, t) in enumerate(zip(pcs, items)):
        w, k = len(p.words), len(p.spans)
        assert torch.equal(b['incidence'][c, :k, :w], t.incidence) and not b['incidence'][c, k:].any()
        assert (not b['incidence'][c, :, w:].any() and not b['leaf_valid'][c, w:].any()
                and not b['node_valid'][c, k:].any())
    assert b['node_valid'].any(1).tolist() == [True, False, True, True]


def test_collate_all_empty_batch_has_no_empty_axis():
    b = collate_trees([tree_tokens(parse_caption('')) for _ in range(3)])
    assert b['leaf_tokens'].shape == (3, 1, 77) and b['incidence'].shape == (3, 1, 1) and not b['node_valid'].any()


def test_parser_failure_gives_flat_fallback_tree(monkeypatch):
    def boom(*a, **k):
        raise RuntimeError('injected')
    monkeypatch.setattr(parsing, 'spacy_doc_to_parsed', boom)
    pcs = parse_captions(['a dog sitting on a red chair', ''])
    assert pcs[0].parser == 'fallback' and pcs[0].spans == [(0, 7)] and 'injected' in pcs[0].notes[-1]
    assert pcs[1].spans == [(0, 0)] and tree_problems(pcs[0]) == []


def test_batch_failure_retries_one_by_one(monkeypatch):
    nlp = parsing.load_pipeline('spacy')
    class Flaky:        # pipe() fails, single calls work
        def pipe(self, *a, **k):
            raise RuntimeError('batch broke')
        def __call__(self, t): return nlp(t)
    monkeypatch.setattr(parsing, 'load_pipeline', lambda *a, **k: Flaky())
    pcs = parse_captions(['a dog', 'two cats on a mat'], ParserConfig('spacy'))
    assert [p.parser for p in pcs] == ['spacy', 'spacy'] and pcs[1].words == ['two', 'cats', 'on', 'a', 'mat']


def test_benepar_code_path_up_to_model_load(caplog):
    import benepar  # noqa: F401  the package itself must import
    ok, why = parsing.benepar_status()
    if ok:
        pytest.skip(f'benepar model installed ({why}); the fallback path is not exercised')
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


@pytest.fixture(scope='module')
def real_captions():
    "{'COCO': [...], 'CC3M': [...]}: every caption of the shared COCO sample and of the CC3M validation set."
    coco, cc3m = (DATA / 'coco_sample' / 'captions.jsonl',
                  DATA / 'cc3m_validation' / 'Validation_GCC-1.1.0-Validation.tsv')
    if not coco.exists() or not cc3m.exists():
        pytest.skip(f'shared data absent under {DATA.resolve()}')
    with open(cc3m) as f:
        cc = [line.rstrip('\n').split('\t')[0] for line in f]
    return {'COCO': [c for line in open(coco) for c in json.loads(line)['captions']], 'CC3M': cc}


@pytest.mark.parametrize('name', ['COCO', 'CC3M'])
def test_training_tokens_are_evaluation_tokens(real_captions, name):
    """Training's ids (`tree_tokens(parse_caption(c)).tokens`) and evaluation's (`tokenizer([c])`) on every real
    caption (all 15,833 CC3M validation captions: ~20 s on 2 cores), and the trees are proper trees."""
    caps = real_captions[name]
    tok = default_tokenizer()
    pcs = parse_captions(caps)
    assert len(pcs) == len(caps)
    diff = []
    for c, p in zip(caps, pcs):
        assert tree_problems(p) == [] and p.text == c, (c, p)
        tt = tree_tokens(p)
        if not torch.equal(tt.tokens, tok([c])[0]):
            diff.append(c)
        if caption_problem(c) is None:
            assert tt.node_valid[0], c          # every usable caption keeps its root
    assert diff == [], f'{len(diff)} of {len(caps)} captions differ, e.g. {diff[:3]}'
    for p in pcs[:300]:
        check_tokens(p, tree_tokens(p))


HARD = [  # caption, the leaves (as the tokenizer spells them) that it must give
    ("the person doesn't", ['the', 'person', "doesn't"]),
    ("The person doesn\u2019t", ['the', 'person', "doesn't"]),      # ftfy uncurls the quote
    ('you cannot park here', ['you', 'cannot', 'park', 'here']),
    ('Im happy', ['im', 'happy']),
    ('we wed in june', ['we', 'wed', 'in', 'june']),
    ('i dont know', ['i', 'dont', 'know']),
    ('he said "stop."', ['he', 'said', '"', 'stop', '."']),
    ('""quoted"" text', ['""', 'quoted', '""', 'text']),
    ("'''triple''' quotes", ["'''", 'triple', "'''", 'quotes']),
    ('Tom &amp; Jerry &quot;live&quot;', ['tom', '&', 'jerry', '"', 'live', '"']),
    ('a cat http://t.co/x on a mat', ['a', 'cat', 'on', 'a', 'mat']),
    ("it's 3pm", ['it', "'s", '3pm']),
]


@pytest.mark.parametrize('caption,leaves', HARD)
def test_hard_cases(caption, leaves):
    pc = parse_caption(caption)
    tt = tree_tokens(pc)
    tok = default_tokenizer()
    assert torch.equal(tt.tokens, tok([caption])[0])
    got = [tok.decode(tt.tokens[tt.leaf_tokens[w]].tolist()).replace(' ', '') for w in range(len(pc.words))
           if tt.leaf_valid[w]]
    assert got == leaves, (pc.words, got)
    check_tokens(pc, tt)


def test_old_tree_json_without_offsets_still_works():
    "A tree stored before offsets existed (text = the parser's cleaned text) loads and tokenises its text."
    old = dict(text='Tom & Jerry on a sofa', words=['Tom', '&', 'Jerry', 'on', 'a', 'sofa'],
               spans=[[0, 6], [0, 3], [3, 6], [4, 6]], labels=['NP', 'NP', 'PP', 'NP'], parser='spacy', notes=[])
    pc = ParsedCaption.from_dict(old)
    assert pc.offsets == [(0, 3), (4, 5), (6, 11), (12, 14), (15, 16), (17, 21)] and tree_problems(pc) == []
    check_tokens(pc, tree_tokens(pc))
    with pytest.raises(ValueError, match='not found'):
        ParsedCaption.from_dict(dict(old, words=['Tom', 'Jerry', '&']))


def test_stored_offsets_are_checked():
    pc = parse_caption('a dog on a chair')
    d = pc.to_dict()
    assert d['offsets'] == [[0, 1], [2, 5], [6, 8], [9, 10], [11, 16]]
    assert tree_problems(ParsedCaption.from_dict(dict(d, offsets=d['offsets'][:-1])))
    assert tree_problems(ParsedCaption.from_dict(dict(d, offsets=[[0, 1]] * 5)))
    assert tree_problems(ParsedCaption.from_dict(dict(d, offsets=[[0, 1], [2, 5], [6, 8], [9, 10], [11, 99]])))


@pytest.mark.parametrize('raw,why', [
    (b'a dog on a red chair', None), ('Ein Hund \U0001f436', None), ('\u4e00\u53ea\u72d7', None), (b'42', None),
    (b'\xff\xfe caf\xe9', 'not UTF-8: invalid start byte at byte 0 of 7'), (b'caf\xe9', 'not UTF-8'),
    (None, 'no caption'), (b'', 'empty caption'), (b'  \n\t', 'empty caption'),
    ('!!! \U0001f600\U0001f389 ... ?!', 'no letter or digit'), ('&amp; &quot;', 'no letter or digit'),
    ('http://example.com/a.jpg', 'no letter or digit outside URLs'), ('\x00\x07', 'no letter or digit (only control'),
])
def test_caption_problem(raw, why):
    got = caption_problem(raw)
    assert (got is None) if why is None else got.startswith(why), got


def test_a_caption_of_only_punctuation_and_emoji_is_unusable_but_still_parses():
    "The parser never raises (many 'words' here); whether to train on it is caption_problem's call."
    text = '!!! \U0001f600\U0001f600 ... ?!?! \U0001f389\U0001f389 *** ~~ :) :( #### @@ ^^ ++ -- ..'
    assert caption_problem(text) == 'no letter or digit'
    pc, tt = parse_ok(text)
    assert len(pc.words) > 1
