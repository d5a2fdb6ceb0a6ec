"""Build the docs site from the notebooks, offline: `make docs` (or `python docs/build_site.py`).

1. Prepare the pages in `_proc/site_src/`: every `nbs/NN_*.ipynb` through nbdev's notebook processor (without Quarto):
   cells flagged `#| hide` dropped, `#| ...` directive lines stripped, the `#| default_exp` cell gone; the committed
   outputs kept as they are (nothing is executed). A backticked notebook name in the prose (`70_compare`) becomes a
   link to its page. `00_index` is the home page. The hand-written pages of `docs/pages/*.md` (each starting with its
   `# Title`) join as the section "Guides". One reference page per module of the package (mkdocstrings reads the
   docstrings with griffe, without importing the package). A local copy of MathJax (from `jupyter-server-mathjax`).
2. Write the navigation, in reading order, to `_proc/nav.yml` (`mkdocs.yml`'s hook, docs/mkdocs_hooks.py, reads it).
3. `mkdocs build --strict` into `_site/`: a warning fails the build, and so does a notebook that does not convert.
4. Check the built site: every relative link and image resolves to a file of the site, and no page loads a script,
   style sheet, font or image from the network.

Exit status 0 when the site is built and passes the checks, 1 otherwise.
"""
import html.parser, os, re, shutil, subprocess, sys, time
from pathlib import Path
from urllib.parse import unquote, urlsplit

ROOT = Path(__file__).resolve().parents[1]
NBS, LIB = ROOT / "nbs", ROOT / "powerclip"
PAGES = ROOT / "docs" / "pages"    # hand-written Markdown pages (what each command answers to a mistake): "Guides"
PROC = ROOT / "_proc"
SRC, SITE = PROC / "site_src", ROOT / "_site"
BIN = Path(sys.executable).parent

# Navigation sections by the tens of the notebook number (the groups of 00_index's reading-order table).
SECTIONS = {1: "Loss, theory, processes", 2: "Inputs", 3: "Model", 4: "Methods", 5: "Training", 6: "Evaluation",
            7: "Comparison and experiments"}
# Notebooks numbered just below a group because they come before it in reading order, but belong to it: the trainer's
# config, checkpoints, accumulation, evaluation, optimiser and log (read before `50_train`), the comparison's report
# (read before `70_compare`).
SECTION_OF = {"49a_config": 5, "49b_checkpoint": 5, "49c_accum": 5, "49d_train_eval": 5, "49e_optim": 5,
              "49f_trainlog": 5, "49g_faults": 5, "49h_runrecord": 5,
              "69a_report": 7}

# MathJax 2 as jupyter-server-mathjax ships it has the STIX-Web fonts only (MathJax's default is its TeX fonts);
# mkdocs.yml's custom_mathjax_url loads this file after the combined config.
MATHJAX_LOCAL = """MathJax.Hub.Config({
  "HTML-CSS": {availableFonts: [], preferredFont: null, webFont: "STIX-Web", imageFont: null}
});
MathJax.Ajax.loadComplete("[MathJax]/config/local/powerclip.js");
"""


def page_name(stem: str) -> str:
    "The page a notebook becomes: `00_index` is the home page."
    return "index" if stem == "00_index" else stem


def linkify(md: str, stems: set) -> str:
    "Turn `NN_name` (a notebook's name in backticks) into a link to its page, outside code blocks and existing links."
    out, fenced = [], False
    for line in md.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if not fenced:
            line = re.sub(r"(?<!\[)`(\d\d[a-z]?_\w+)`(?!\])",
                          lambda m: f"[`{m[1]}`]({page_name(m[1])}.html)" if m[1] in stems else m[0], line)
        out.append(line)
    return "\n".join(out)


def default_exp_(cell, *args):
    "nbdev processor: drop the `#| default_exp` cell (nbdev leaves a cell of directives alone in place)."
    del cell["source"]


# Lines of a cell's stderr that say nothing about the notebook: warnings of the machine that ran it.
NOISE = re.compile(r"TqdmWarning|from \.autonotebook import|No pretrained weights loaded for model")


def drop_noise(cell) -> None:
    "Remove the NOISE lines from a code cell's stderr, and the stream when nothing is left."
    outs = []
    for o in cell.get("outputs", []):
        if o.get("output_type") == "stream" and o.get("name") == "stderr":
            text = o["text"] if isinstance(o["text"], str) else "".join(o["text"])
            text = "".join(l for l in text.splitlines(True) if not NOISE.search(l))
            if not text.strip():
                continue
            o["text"] = text
        outs.append(o)
    if cell.cell_type == "code":
        cell["outputs"] = outs


def prepare_notebook(src: Path, dst: Path, stems: set) -> str:
    "Write the page source of one notebook; return its title (the first `# ` heading)."
    from execnb.nbio import write_nb
    from nbdev.process import NBProcessor
    from nbdev.processors import hide_, strip_ansi, strip_hidden_metadata
    proc = NBProcessor(src, procs=[hide_, default_exp_, strip_ansi, strip_hidden_metadata], rm_directives=True)
    proc.process()
    nb = proc.nb
    nb.cells = [c for c in nb.cells if c.source.strip() or c.get("outputs")]
    heads = [i for i, c in enumerate(nb.cells) if c.cell_type == "markdown" and re.match(r"# \S", c.source)]
    if not heads:
        raise SystemExit(f"{src.relative_to(ROOT)}: no markdown cell that starts with a `# Title`")
    nb.cells.insert(0, nb.cells.pop(heads[0]))   # the title first, above the notebook's import cell
    title = re.match(r"# (.+)", nb.cells[0].source)[1].strip()
    for c in nb.cells:
        if c.cell_type == "markdown":
            c.source = linkify(c.source, stems)
        drop_noise(c)
    write_nb(nb, dst)
    return title


def modules() -> list[str]:
    "Dotted names of the package's modules, in path order (`_modidx` and `__main__` left out)."
    out = []
    for p in sorted(LIB.rglob("*.py")):
        rel = p.relative_to(ROOT).with_suffix("")
        if p.name in ("_modidx.py", "__main__.py"):
            continue
        parts = rel.parts[:-1] if p.name == "__init__.py" else rel.parts
        out.append(".".join(parts))
    return out


def prepare() -> list:
    "Write _proc/site_src and return the navigation."
    if SRC.exists():
        shutil.rmtree(SRC)
    (SRC / "reference").mkdir(parents=True)
    (SRC / "assets").mkdir()
    nbs = sorted(NBS.glob("[0-9][0-9]*_*.ipynb"))
    stems = {p.stem for p in nbs}
    sections: dict = {}
    home = None
    for p in nbs:
        title = prepare_notebook(p, SRC / f"{page_name(p.stem)}.ipynb", stems)
        if p.stem == "00_index":
            home = {"Home": "index.ipynb"}
            continue
        sec = SECTIONS.get(SECTION_OF.get(p.stem, int(p.stem[0])), "Other")
        label = p.stem.split("_")[0] + " · " + re.sub(r"[$\\`]", "", title)   # no LaTeX in the navigation
        sections.setdefault(sec, []).append({label: f"{p.stem}.ipynb"})
    guides = []
    for p in sorted(PAGES.glob("*.md")):
        text = p.read_text()
        head = re.match(r"# (.+)", text)
        if not head:
            raise SystemExit(f"{p.relative_to(ROOT)}: no `# Title` on its first line")
        (SRC / p.name).write_text(linkify(text, stems))
        guides.append({head[1].strip(): p.name})
    if guides:
        sections["Guides"] = guides
    ref = []
    for mod in modules():
        page = SRC / "reference" / f"{mod}.md"
        page.write_text(f"# `{mod}`\n\n::: {mod}\n    options:\n      show_root_heading: false\n")
        ref.append({mod: f"reference/{mod}.md"})
    shutil.copy(ROOT / "docs" / "extra.css", SRC / "assets" / "extra.css")
    import jupyter_server_mathjax
    mathjax = SRC / "assets" / "mathjax"
    shutil.copytree(Path(jupyter_server_mathjax.__file__).parent / "static", mathjax)
    (mathjax / "config" / "local").mkdir(exist_ok=True)
    (mathjax / "config" / "local" / "powerclip.js").write_text(MATHJAX_LOCAL)
    return [home] + [{k: v} for k, v in sections.items()] + [{"Module reference": ref}]


def write_nav(nav: list) -> None:
    "The navigation, for docs/mkdocs_hooks.py."
    import yaml
    (PROC / "nav.yml").write_text("# Written by docs/build_site.py, read by docs/mkdocs_hooks.py.\n"
                                  + yaml.safe_dump(nav, sort_keys=False, allow_unicode=True))


class _Refs(html.parser.HTMLParser):
    "Collects (tag, attribute, value) of every href/src in a page."
    def __init__(self):
        super().__init__()
        self.refs = []

    def handle_starttag(self, tag, attrs):
        for k, v in attrs:
            if k in ("href", "src") and v is not None:
                self.refs.append((tag, k, v, dict(attrs).get("rel", "")))


def check_site() -> list[str]:
    "Broken relative links, and resources loaded from the network, in every built page."
    errs = []
    for page in sorted(SITE.rglob("*.html")):
        if page.name == "404.html":
            continue                        # links from the server's root, for a 404 on a web server
        parser = _Refs()
        parser.feed(page.read_text(encoding="utf-8"))
        for tag, attr, url, rel in parser.refs:
            parts = urlsplit(url)
            if parts.scheme in ("http", "https") or url.startswith("//"):
                loads = tag in ("script", "img", "iframe", "source") or (tag == "link" and rel != "canonical")
                if loads:
                    errs.append(f"{page.relative_to(SITE)}: <{tag} {attr}={url}> loads from the network")
                continue
            if parts.scheme or not parts.path:
                continue                    # mailto:, data:, javascript:, or a fragment of this page
            base = SITE if parts.path.startswith("/") else page.parent
            target = (base / unquote(parts.path).lstrip("/")).resolve()
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                errs.append(f"{page.relative_to(SITE)}: <{tag} {attr}={url}> points to nothing")
    for css in SITE.rglob("*.css"):
        for m in re.finditer(r"url\(\s*['\"]?(https?:)?//", css.read_text(encoding="utf-8", errors="replace")):
            errs.append(f"{css.relative_to(SITE)}: a url() that loads from the network")
    return errs


def main() -> int:
    t0 = time.time()
    nav = prepare()
    write_nav(nav)
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    cmd = [BIN / "mkdocs", "build", "--quiet", "--strict", "--clean", "-f", ROOT / "mkdocs.yml"]
    r = subprocess.run(cmd, cwd=ROOT, env=env)
    if r.returncode != 0:
        print(f"docs: mkdocs build failed (exit {r.returncode})", file=sys.stderr)
        return 1
    errs = check_site()
    for e in errs:
        print("docs:", e, file=sys.stderr)
    if errs:
        return 1
    n = len(list(SITE.rglob("*.html")))
    print(f"docs: {n} pages in {SITE.relative_to(ROOT)}/ ({time.time() - t0:.0f} s); open _site/index.html")
    return 0


if __name__ == "__main__":
    sys.exit(main())
