"""Count-based reference lines of the replication runs: unigram and interpolated Kneser-Ney bigram held-out loss.

A trained model is only past the n-gram regime when its held-out loss is clearly below what token counts alone give
on the same tokens. Both references are fitted on the runner's packed training blocks and scored on its held-out
blocks exactly as the trainer scores a model: every position 1 .. T-1 of each block, given the tokens before it in
that block (a bigram sees only the previous one), in nats per token.

- unigram: add-one (Laplace) smoothed token frequencies over the tokenizer's vocabulary.
- bigram: interpolated Kneser-Ney (Kneser and Ney 1995; Chen and Goodman 1998, "An empirical study of smoothing
  techniques for language modeling", section 2.7), as NLTK's `KneserNeyInterpolated(order=2)` computes it:
  P(w | v) = max(c(v, w) - d, 0) / c(v) + d N1+(v .) / c(v) * P_cont(w), and at the lower order
  P_cont(w) = max(N1+(. w) - d, 0) / N1+(. .) + d |{w : N1+(. w) > 0}| / N1+(. .) / V, with one discount d. A
  context never seen in training (where NLTK divides by zero) backs off to P_cont(w). The default d is Ney's
  estimate n1 / (n1 + 2 n2) from the bigram count-of-counts.

    python -m bench.replication.reference      # bench/results/replication/reference.json
"""

import json
import math
from pathlib import Path

import numpy as np


def _pairs(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(previous, next) token ids of every predicted position of (N, T) blocks."""
    blocks = np.asarray(blocks)
    return blocks[:, :-1].reshape(-1), blocks[:, 1:].reshape(-1)


def unigram_loss(train_blocks, eval_blocks, vocab_size: int) -> float:
    """Held-out nats per token of the add-one smoothed unigram model of the training blocks.

    Args:
        train_blocks, eval_blocks: (N, T) integer token ids (the trainer's packed blocks).
        vocab_size: V, the tokenizer's vocabulary (every id must be < V).

    Raises:
        ValueError: a token id outside [0, V).
    """
    train, evaluate = np.asarray(train_blocks).reshape(-1), _pairs(eval_blocks)[1]
    _check_ids(vocab_size, train, evaluate)
    counts = np.bincount(train, minlength=vocab_size).astype(np.float64)
    log_probs = np.log((counts + 1.0) / (counts.sum() + vocab_size))
    return float(-log_probs[evaluate].mean())


def kneser_ney_bigram(train_blocks, vocab_size: int, discount: float | None = None):
    """The interpolated Kneser-Ney bigram model of the training blocks (see the module docstring).

    Returns:
        (log_prob, discount): `log_prob(previous, next)` gives the natural log-probabilities of next ids after
        previous ids (arrays of the same shape); `discount` is the d used.

    Raises:
        ValueError: a token id outside [0, V), or a discount outside (0, 1).
    """
    previous, following = _pairs(train_blocks)
    _check_ids(vocab_size, previous, following)
    counts = np.zeros((vocab_size, vocab_size), dtype=np.float64)
    np.add.at(counts, (previous, following), 1.0)
    if discount is None:
        n1, n2 = float((counts == 1).sum()), float((counts == 2).sum())
        discount = n1 / (n1 + 2.0 * n2)
    if not 0.0 < discount < 1.0:
        raise ValueError(f"`discount` must be in (0, 1), got {discount}.")
    seen = counts > 0
    continuation = seen.sum(axis=0).astype(np.float64)  # N1+(. w)
    bigram_types = continuation.sum()  # N1+(. .)
    p_cont = np.maximum(continuation - discount, 0.0) / bigram_types
    p_cont += discount * float((continuation > 0).sum()) / bigram_types / vocab_size
    context = counts.sum(axis=1)  # c(v)
    followers = seen.sum(axis=1).astype(np.float64)  # N1+(v .)

    def log_prob(prev: np.ndarray, nxt: np.ndarray) -> np.ndarray:
        prev, nxt = np.asarray(prev), np.asarray(nxt)
        c_v = context[prev]
        safe = np.where(c_v > 0, c_v, 1.0)
        higher = np.maximum(counts[prev, nxt] - discount, 0.0) / safe
        weight = np.where(c_v > 0, discount * followers[prev] / safe, 1.0)
        return np.log(np.where(c_v > 0, higher, 0.0) + weight * p_cont[nxt])

    return log_prob, discount


def bigram_loss(train_blocks, eval_blocks, vocab_size: int, discount: float | None = None) -> float:
    """Held-out nats per token of the interpolated Kneser-Ney bigram model of the training blocks."""
    log_prob, _ = kneser_ney_bigram(train_blocks, vocab_size, discount)
    previous, following = _pairs(eval_blocks)
    _check_ids(vocab_size, previous, following)
    return float(-log_prob(previous, following).mean())


def _check_ids(vocab_size: int, *arrays) -> None:
    for array in arrays:
        if array.size and (array.min() < 0 or array.max() >= vocab_size):
            raise ValueError(f"token ids must be in [0, {vocab_size}), got {array.min()} .. {array.max()}.")


def runner_reference_losses() -> dict:
    """Both references on the replication runner's fixed split, tokenizer and sequence length (its held-out blocks
    are the ones every run's final evaluation scores), fitted on the whole training split and on its first blocks
    as many as one run's budget trains on (max_steps x micro_batch_size blocks)."""
    from transformers import AutoTokenizer

    from bench.replication import runner
    from hf_mohd.training.data import pack, split_documents

    info = runner.prepare_data()
    texts = runner._texts_of(Path(info["corpus"]))
    train_texts, eval_texts = split_documents(texts, runner.EVAL_FRACTION, runner.SPLIT_SEED)
    tokenizer = AutoTokenizer.from_pretrained(info["tokenizer"])
    seq_len = runner.BUDGET["seq_len"]
    train_blocks = pack(train_texts, tokenizer, seq_len).numpy()
    eval_blocks = pack(eval_texts, tokenizer, seq_len).numpy()
    vocab = len(tokenizer)
    budget_blocks = train_blocks[: runner.BUDGET["max_steps"] * runner.BUDGET["micro_batch_size"]]
    fits = {}
    for name, blocks in (("whole_training_split", train_blocks), ("first_budget_blocks", budget_blocks)):
        _, discount = kneser_ney_bigram(blocks, vocab)
        fits[name] = {
            "train_tokens": int(blocks.size),
            "unigram_add_one": unigram_loss(blocks, eval_blocks, vocab),
            "bigram_kneser_ney": bigram_loss(blocks, eval_blocks, vocab),
            "bigram_discount": discount,
        }
    return {
        **fits,
        "held_out_predicted_tokens": int(eval_blocks[:, 1:].size),
        "vocab_size": vocab,
        "seq_len": seq_len,
        "uniform": math.log(vocab),
    }


if __name__ == "__main__":
    from hf_mohd.atomic_folder import write_text_atomically

    text = json.dumps(runner_reference_losses(), indent=2)
    print(text)
    write_text_atomically(
        Path(__file__).resolve().parent.parent / "results" / "replication" / "reference.json", text + "\n"
    )
