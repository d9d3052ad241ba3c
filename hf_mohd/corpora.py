"""The English Wikipedia sample shipped in the PyPI `gensim` wheel: the real text of the demo, of the default
calibration text of the conversions and of the SmolLM2 experiments.

The sample (`gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2`, CC BY-SA,
attribution: Wikipedia contributors; docs/design.md section 8) holds 206 pages; 106 are articles (the others are
redirects). The demo and the replication runs read it as a JSONL file (`wikipedia_corpus`), the SmolLM2 experiments
and the benchmarks as `Document`s (`wikipedia_articles`), and the conversions' default calibration text is its first
articles.

One cleaning function, `clean_wiki_markup`, with two layouts of the same plain text:

- "paragraphs" (the default): paragraphs separated by a blank line, headings kept as their own line. What the demo
  and the replication runs train on.
- "lines": one line per paragraph, white space collapsed, lines under 40 characters (headings, list stubs, captions)
  dropped. Frozen: it is the held-out text of every committed SmolLM2 result (`experiments/smollm2/results/*.json`)
  and the calibration and healing text of the perplexity and healing runs, reproduced character for character.

Both layouts reproduce what the two former readers wrote exactly (tests/test_corpora.py pins them). The default
calibration text of the conversions (`hf_mohd.conversion.calibration.default_calibration_text`, which the committed
carving results calibrated on) is the "paragraphs" layout.

Articles are in dump order; redirects and articles whose cleaned text is under `MIN_ARTICLE_CHARS` characters are
dropped (the same 106 articles in both layouts). The SmolLM2 experiments hold out the *last* 8 articles and
calibrate on the *first* 8 (`hf_mohd.conversion.calibration.HELD_OUT_ARTICLES`, `CALIBRATION_ARTICLES`).

`token_windows` cuts text into the non-overlapping token windows that calibration, perplexity and the demo read.

`Document` (id, title, cleaned text) is the one record of a document in the repository: the experiments' other
sources (`experiments/smollm2/corpora.py`: An Anarchist FAQ, the Python documentation, the Brown Corpus, the King
James Bible) return it too. Only the standard library is imported at module level.
"""

from __future__ import annotations

import bz2
import functools
import importlib.util
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path


WIKIPEDIA_SAMPLE = "test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
WIKIPEDIA_ORIGIN = "English Wikipedia dump enwiki-latest-pages-articles1.xml-p000000010p000030302 (shortened)"
WIKIPEDIA_LICENCE = (
    "CC BY-SA (Wikipedia text; https://creativecommons.org/licenses/by-sa/4.0/), attribution: Wikipedia contributors"
)
LAYOUTS = ("paragraphs", "lines")
MIN_ARTICLE_CHARS = 200  # shorter cleaned pages are stubs, dropped like redirects
MIN_LINE_CHARS = 40  # layout "lines": shorter lines (headings, list stubs, captions) are dropped


@dataclass(frozen=True)
class Document:
    """One document of a corpus: a stable id (unique within its source; a Wikipedia article's is its title), a title
    and the cleaned text (paragraphs separated by one blank line, or one a line in the layout "lines")."""

    id: str
    title: str
    text: str


def wikipedia_sample_path() -> Path:
    """Path of the bz2 XML dump inside the installed `gensim` package.

    Raises:
        FileNotFoundError: gensim is not installed (the `demo` extra: pip install gensim), or its wheel lacks the
            sample.
    """
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"The Wikipedia sample ({WIKIPEDIA_SAMPLE}) ships in the PyPI gensim wheel, which is not installed "
            "(pip install gensim, or the `demo` extra)."
        )
    path = Path(spec.submodule_search_locations[0]) / WIKIPEDIA_SAMPLE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the corpus ships in the PyPI gensim wheel (pip install gensim).")
    return path


def clean_wiki_markup(markup: str, layout: str = "paragraphs") -> str:
    """Plain text of one page's wiki markup: `gensim.corpora.wikicorpus.filter_wiki` (links, templates, tables,
    references and tags removed), then, by `layout`:

    - "paragraphs": runs of two or more `'` (bold, italic) removed, `== heading ==` marks removed (the heading text
      stays, as its own line), runs of blank lines cut to one blank line, leading and trailing white space stripped.
    - "lines": `'''` then `''` removed (a run of four leaves one `'`), the white space of each line collapsed to
      single spaces, lines under `MIN_LINE_CHARS` characters dropped (so are most headings; a heading line of 40
      characters or more keeps its `=` marks), the rest joined by one newline. The frozen text of the committed
      SmolLM2 results.

    Raises:
        ValueError: an unknown `layout`.
    """
    from gensim.corpora.wikicorpus import filter_wiki

    if layout not in LAYOUTS:
        raise ValueError(f"`layout` must be one of {LAYOUTS}, got {layout!r}.")
    text = filter_wiki(markup)
    if layout == "lines":
        text = text.replace("'''", "").replace("''", "")
        lines = (re.sub(r"\s+", " ", line).strip() for line in text.splitlines())
        return "\n".join(line for line in lines if len(line) >= MIN_LINE_CHARS)
    text = re.sub(r"'{2,}", "", text)
    text = re.sub(r"^=+\s*(.*?)\s*=+\s*$", r"\1", text, flags=re.M)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


def is_redirect(markup: str) -> bool:
    """Whether a page's markup is a redirect (`#REDIRECT [[...]]`)."""
    return markup.lstrip().lower().startswith("#redirect")


@functools.lru_cache(maxsize=len(LAYOUTS))
def _articles(layout: str) -> tuple[tuple[Document, ...], int]:
    from gensim.corpora.wikicorpus import extract_pages

    kept, pages = [], 0
    with bz2.open(wikipedia_sample_path()) as xml:
        for title, markup, _page_id in extract_pages(xml):
            pages += 1
            if is_redirect(markup):
                continue
            text = clean_wiki_markup(markup, layout)
            if len(text) >= MIN_ARTICLE_CHARS:
                kept.append(Document(title, title, text))
    return tuple(kept), pages


def wikipedia_articles(layout: str = "paragraphs") -> list[Document]:
    """Every article of the sample (id and title: its title), in dump order, cleaned with `clean_wiki_markup(markup, layout)`: redirects and
    articles under `MIN_ARTICLE_CHARS` characters dropped (106 articles in either layout). Read once per process and
    layout. Slice it for a selection: `[:8]` the first articles (calibration), `[-8:]` the last (held out).

    Raises:
        FileNotFoundError: gensim (which ships the sample) is not installed.
        ValueError: an unknown `layout`.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"`layout` must be one of {LAYOUTS}, got {layout!r}.")
    return list(_articles(layout)[0])


def wikipedia_provenance(layout: str = "paragraphs") -> dict:
    """Where the text comes from, its licence, how it was cleaned, and its size (pages, articles, characters)."""
    import gensim

    articles, pages = _articles(layout)
    return {
        "source": f"gensim {gensim.__version__} wheel (PyPI), {WIKIPEDIA_SAMPLE}",
        "origin": WIKIPEDIA_ORIGIN,
        "licence": WIKIPEDIA_LICENCE,
        "processing": "gensim.corpora.wikicorpus.filter_wiki, bold/italic quotes and heading '=' removed, "
        f"redirects and pages under {MIN_ARTICLE_CHARS} characters dropped"
        + ("" if layout == "paragraphs" else f" (hf_mohd.corpora layout {layout!r})"),
        "pages": pages,
        "articles": len(articles),
        "characters": sum(len(article.text) for article in articles),
    }


def wikipedia_corpus(folder: str | os.PathLike, layout: str = "paragraphs") -> tuple[str, dict]:
    """Write the articles (`wikipedia_articles(layout)`) as `folder`/enwiki_sample.jsonl, one {"title", "text"}
    object per line (what `hf_mohd.training` reads); returns (path, `wikipedia_provenance(layout)`).

    Raises:
        FileNotFoundError: gensim (which ships the sample) is not installed.
    """
    articles = wikipedia_articles(layout)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "enwiki_sample.jsonl")
    with open(path, "w", encoding="utf-8") as out:
        for article in articles:
            out.write(json.dumps({"title": article.title, "text": article.text}) + "\n")
    return path, wikipedia_provenance(layout)


def token_windows(tokenizer, texts: list[str] | tuple[str, ...], window: int, max_tokens: int, *, name: str = "text"):
    """(W, `window`) int64 token ids: the documents `texts` joined by one blank line, tokenized in one call without
    special tokens, cut into W = min(tokens, `max_tokens`) // `window` non-overlapping windows (the tail dropped).

    Args:
        tokenizer: a Hugging Face tokenizer (called as `tokenizer(text, add_special_tokens=False)`).
        texts: the documents, in order.
        window: tokens per window (>= 1).
        max_tokens: at most this many tokens are kept.
        name: how an error names the text (a file, a held-out source).

    Raises:
        ValueError: `window` < 1, or the text holds less than one window within `max_tokens`; the message names
            `name`, the token count and the window.
    """
    import torch

    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"The token window must be an integer >= 1, got {window!r}.")
    ids = tokenizer("\n\n".join(texts), add_special_tokens=False)["input_ids"]
    count = min(len(ids), max_tokens) // window
    if count == 0:
        raise ValueError(
            f"{name}: {len(ids)} tokens (max_tokens={max_tokens}), less than one window of {window} tokens."
        )
    return torch.tensor(ids[: count * window]).view(count, window)


__all__ = [
    "LAYOUTS",
    "MIN_ARTICLE_CHARS",
    "MIN_LINE_CHARS",
    "WIKIPEDIA_LICENCE",
    "WIKIPEDIA_ORIGIN",
    "WIKIPEDIA_SAMPLE",
    "Document",
    "clean_wiki_markup",
    "is_redirect",
    "token_windows",
    "wikipedia_articles",
    "wikipedia_corpus",
    "wikipedia_provenance",
    "wikipedia_sample_path",
]
