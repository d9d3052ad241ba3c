"""The real-text corpus (`hf_mohd.corpora`): the one cleaning function on hand-written markup, in both layouts, and the
sizes of the gensim Wikipedia sample. The "lines" layout is frozen: it is the text every committed SmolLM2 result
(`experiments/smollm2/results/*.json`) was measured on, so a change here (or in gensim's sample or `filter_wiki`)
means those results no longer reproduce."""

import hashlib
import json

import pytest


pytest.importorskip("gensim", reason="the Wikipedia sample ships in the gensim wheel (the `demo` extra)")

from hf_mohd.corpora import (  # noqa: E402
    LAYOUTS,
    clean_wiki_markup,
    is_redirect,
    wikipedia_articles,
    wikipedia_corpus,
    wikipedia_provenance,
)


MARKUP = (
    "'''Albedo''' is the ''fraction'' of light that a [[surface|body]] reflects.<ref>A. Author, 1990.</ref>\n"
    "\n\n\n"
    "== History ==\n"
    "It was   measured by '''''many people''''' over a long time, and ''''carefully''''.\n"
    "=== A heading that is long enough to be kept in lines ===\n"
    "Short line.\n"
)


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


def test_clean_wiki_markup_lines():
    """''' then '' go (a run of four leaves one quote), white space collapses, lines under 40 characters (the short
    heading, "Short line.", the blank lines) are dropped, a long heading keeps its = marks."""
    assert clean_wiki_markup(MARKUP, "lines") == (
        "Albedo is the fraction of light that a body reflects.\n"
        "It was measured by many people over a long time, and 'carefully'.\n"
        "=== A heading that is long enough to be kept in lines ==="
    )


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


@pytest.mark.parametrize("layout", LAYOUTS)
def test_wikipedia_sample_sizes(layout):
    """206 pages, 106 articles in either layout (the same titles in dump order); the calibration (first 8) and
    held-out (last 8) articles of the experiments, character for character."""
    articles = wikipedia_articles(layout)
    characters, last, first = SIZES[layout]
    assert len(articles) == 106 and sum(len(a.text) for a in articles) == characters
    assert [a.title for a in articles[:8]] == FIRST and [a.title for a in articles[-8:]] == LAST
    assert (_digest(articles[-8:]), _digest(articles[:8])) == (last, first)
    provenance = wikipedia_provenance(layout)
    assert (provenance["pages"], provenance["articles"], provenance["characters"]) == (206, 106, characters)
    assert "CC BY-SA" in provenance["licence"]


def test_wikipedia_corpus_writes_the_articles_as_jsonl(tmp_path):
    path, provenance = wikipedia_corpus(tmp_path / "data")
    with open(path, encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle]
    assert [(r["title"], r["text"]) for r in rows] == [(a.title, a.text) for a in wikipedia_articles()]
    assert provenance == wikipedia_provenance() and provenance["characters"] == SIZES["paragraphs"][0]
