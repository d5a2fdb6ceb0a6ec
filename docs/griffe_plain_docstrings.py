"""A griffe extension for the module reference: nbdev docstrings are plain prose, not Markdown.

They write indexing and lists as code reads (`d['a']['b']`, `[nan, nan]`), which Markdown would take for reference
links (and mkdocs-autorefs for cross-references it cannot find). This extension escapes square brackets outside
backtick code spans, so a docstring renders as written.
"""
import re

import griffe

_CODE = re.compile(r"(`+)(.+?)\1", re.DOTALL)


def escape_brackets(text: str) -> str:
    "Backslash-escape [ and ] everywhere but inside `code spans`."
    out, pos = [], 0
    for m in _CODE.finditer(text):
        out.append(re.sub(r"([\[\]])", r"\\\1", text[pos:m.start()]))
        out.append(m.group(0))
        pos = m.end()
    out.append(re.sub(r"([\[\]])", r"\\\1", text[pos:]))
    return "".join(out)


class PlainDocstrings(griffe.Extension):
    def on_object(self, *, obj, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = escape_brackets(obj.docstring.value)
