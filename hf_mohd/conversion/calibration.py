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
"""Calibration text of a conversion, as token ids of the source tokenizer: shared by both targets (MoHD's rotation,
fitted routers and routed budgets; LatentMoE's carving).

The text is a UTF-8 file the user gives, or, where a conversion has a default (carving), the first
`CALIBRATION_ARTICLES` articles of the English Wikipedia sample of the PyPI `gensim` wheel (`hf_mohd.corpora`,
layout "paragraphs", CC BY-SA), built in memory. Evaluations hold out the *last* `HELD_OUT_ARTICLES` articles, so the
default never overlaps them. Either text is cut into non-overlapping windows by `hf_mohd.corpora.token_windows`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..corpora import token_windows
from .source import ConversionError, DenseLlamaSource


CALIBRATION_ARTICLES = 8  # first articles of the Wikipedia sample: the default calibration text
HELD_OUT_ARTICLES = 8  # last articles of the sample: what the conversion evaluations hold out


def default_calibration_text(num_articles: int = CALIBRATION_ARTICLES) -> tuple[str, str]:
    """The first `num_articles` articles of the Wikipedia sample (`hf_mohd.corpora.wikipedia_articles`, layout
    "paragraphs"), joined by one blank line.

    Returns:
        (text, description naming the articles and the licence).

    Raises:
        ConversionError: `gensim` (which ships the sample) is not installed, or `num_articles` is not in
            [1, articles - `HELD_OUT_ARTICLES`] (it would reach the articles evaluations hold out).
    """
    try:
        from ..corpora import wikipedia_articles

        articles = wikipedia_articles()
    except (ImportError, FileNotFoundError) as err:
        raise ConversionError(
            f"The default calibration text is the Wikipedia sample of the `gensim` wheel ({err}): pip install gensim, "
            "or give a calibration text file (`calibration_text`, --calibration-text)."
        ) from err
    if (
        isinstance(num_articles, bool)
        or not isinstance(num_articles, int)
        or not (1 <= num_articles <= len(articles) - HELD_OUT_ARTICLES)
    ):
        raise ConversionError(
            f"`calibration_articles` must be in [1, {len(articles) - HELD_OUT_ARTICLES}] (the sample has "
            f"{len(articles)} articles; the last {HELD_OUT_ARTICLES} are held out for evaluation), got {num_articles!r}."
        )
    chosen = articles[:num_articles]
    titles = ", ".join(article.title for article in chosen)
    text = "\n\n".join(article.text for article in chosen)
    return text, f"the first {num_articles} articles of gensim's English Wikipedia sample (CC BY-SA): {titles}"


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        kind = "missing" if isinstance(err, FileNotFoundError) else "damaged"
        raise ConversionError(f"Calibration text {path}: cannot read it as UTF-8 ({err}).", kind) from err


def calibration_ids(
    source: DenseLlamaSource,
    text_file: str | Path | None = None,
    *,
    window: int = 256,
    max_tokens: int = 16384,
) -> tuple[torch.Tensor, str]:
    """Calibration token ids of a conversion and a line describing them (for the model card).

    Args:
        source: the dense LLaMA; its tokenizer tokenizes the text (no special tokens).
        text_file: a UTF-8 text file; None: `default_calibration_text()`.
        window: tokens per row (>= 1).
        max_tokens: at most this many tokens.

    Returns:
        ((rows, `window`) int64 token ids, description: the file or the articles, and the token count).

    Raises:
        ConversionError: the source has no tokenizer, the file cannot be read as UTF-8, `window` < 1, or the text
            holds fewer than max(hidden_size, `window`) tokens within `max_tokens` (the PCA and the router fits need
            at least hidden_size tokens; thousands are better).
    """
    where = "the default calibration text" if text_file is None else f"Calibration text {Path(text_file)}"
    if source.tokenizer is None:
        raise ConversionError(f"{source.path} has no tokenizer, so {where} cannot be tokenized.", "wrong_type")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ConversionError(f"The calibration window must be an integer >= 1 token, got {window!r}.")
    if text_file is None:
        text, articles = default_calibration_text()
    else:
        text = _read_text(Path(text_file))
    needed = max(source.config.hidden_size, window)
    try:
        ids = token_windows(source.tokenizer, [text], window, max_tokens, name=where)
    except ValueError:
        ids = torch.zeros(0, window, dtype=torch.long)
    if ids.numel() < needed:
        count = len(source.tokenizer(text, add_special_tokens=False)["input_ids"])
        raise ConversionError(
            f"{where} holds {count} tokens ({ids.shape[0]} rows of {window} within max_tokens={max_tokens}); "
            f"the PCA rotation and the router fits need at least hidden_size = {source.config.hidden_size} tokens "
            "(thousands are better).",
            "damaged",
        )
    if text_file is None:
        return ids, f"{articles}; {ids.numel()} tokens"
    return ids, f"`{text_file}`, {ids.numel()} tokens"


def calibration_token_ids(
    source: DenseLlamaSource, text_file: str | Path, window: int = 256, max_tokens: int = 16384
) -> torch.Tensor:
    """(rows, `window`) token ids of a UTF-8 calibration text file: `calibration_ids` without the description.

    Raises:
        ConversionError: as `calibration_ids`.
    """
    return calibration_ids(source, text_file, window=window, max_tokens=max_tokens)[0]


__all__ = [
    "CALIBRATION_ARTICLES",
    "HELD_OUT_ARTICLES",
    "calibration_ids",
    "calibration_token_ids",
    "default_calibration_text",
]
