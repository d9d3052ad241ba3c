"""Layerwise intrinsic dimension (ID) of a causal LM's hidden states with the TwoNN estimator.

TwoNN (Facco, d'Errico, Rodriguez, Laio, "Estimating the intrinsic dimension of datasets by a minimal neighborhood
information", Sci. Rep. 7, 12140, 2017): for every point, mu = r2 / r1, the ratio of its second to first
nearest-neighbour distance, follows a Pareto law with shape d, so -log(1 - F(mu)) = d log(mu). With the ratios
sorted, F_emp(mu_(i)) = i / n; the largest `discard_fraction` of the ratios (10% in the paper, and in arXiv
2610.14644 section 4.1) are dropped and d is the least-squares slope of -log(1 - F_emp) against log(mu) through the
origin. Same estimate as `skdim.id.TwoNN(discard_fraction=...)` (scikit-dimension), the reference the tests use,
except that neighbour distances here are exact: skdim (through scikit-learn's `euclidean_distances`) computes them
as |a|^2 + |b|^2 - 2 a.b, which rounds near-duplicate pairs of large-norm vectors (common among LM hidden states)
to 0 and drops them as duplicates; on SmolLM2-135M hidden states the two estimates differed by up to 0.7%.

The shaping paper (arXiv 2610.14644 section 4.1, appendix E.2) measures the profile at every block boundary on
20,000 non-padding token representations, of which 5,000 are kept at random; `collect_hidden_states` does that for
any causal LM of transformers through `output_hidden_states`.
"""

import math
import random
import warnings
from collections.abc import Sequence

import torch


def nearest_neighbour_distances(
    points: torch.Tensor, chunk_size: int = 1024, candidates: int = 8
) -> tuple[torch.Tensor, torch.Tensor]:
    """Euclidean distances r1, r2 of every point to its first and second nearest other point.

    Candidates are found with |a - b|^2 = |a|^2 + |b|^2 - 2 a.b (one matmul per chunk, as scikit-learn's
    `euclidean_distances`), then the `candidates` closest are re-measured exactly as |a - b|, so duplicates give
    exactly 0 and close pairs keep full float64 precision.

    Args:
        points: (n, p) float tensor, n >= 3.
        chunk_size: rows of the (chunk, n) distance block computed at once (memory: 8 chunk n bytes).
        candidates: neighbours re-measured exactly per point (>= 2).

    Returns:
        r1, r2: (n,) float64 tensors. Duplicate points give r1 = 0.
    """
    x = points.to(torch.float64)
    n = x.shape[0]
    top = min(max(2, candidates), n - 1)
    r1 = torch.empty(n, dtype=torch.float64)
    r2 = torch.empty(n, dtype=torch.float64)
    squared_norms = (x * x).sum(dim=1)
    for start in range(0, n, chunk_size):
        stop = min(start + chunk_size, n)
        block = squared_norms[start:stop, None] + squared_norms[None, :] - 2.0 * (x[start:stop] @ x.T)
        rows = torch.arange(start, stop)
        block[rows - start, rows] = math.inf  # a point is not its own neighbour
        nearest = torch.topk(block, top, dim=1, largest=False).indices  # (chunk, top)
        exact = (x[start:stop, None, :] - x[nearest]).norm(dim=2)  # (chunk, top)
        two = torch.topk(exact, 2, dim=1, largest=False).values
        r1[start:stop], r2[start:stop] = two[:, 0], two[:, 1]
    return r1, r2


def twonn(points, discard_fraction: float = 0.1) -> float:
    """TwoNN intrinsic dimension of a point cloud (Facco et al. 2017, the linear-fit estimator).

    Args:
        points: (n, p) array-like (torch tensor, numpy array, nested lists) of n points in p dimensions.
        discard_fraction: fraction in [0, 1) of the largest ratios mu = r2/r1 left out of the fit (0.1 in the paper);
            at least the largest one is always left out (its F_emp is 1).

    Returns:
        The slope d of -log(1 - i/n) against log(mu_(i)) over the kept i (a float, not rounded).

    Raises:
        ValueError: `points` is not 2-D with n >= 3 and p >= 1, has non-finite values, `discard_fraction` is outside
            [0, 1), or fewer than 2 ratios remain.

    Points with r1 = 0 (duplicates) have no finite ratio; they are dropped with a warning, as skdim does.
    """
    x = torch.as_tensor(points)
    if x.ndim != 2 or x.shape[0] < 3 or x.shape[1] < 1:
        raise ValueError(f"`points` must be a 2-D (n, p) array with n >= 3 and p >= 1, got shape {tuple(x.shape)}.")
    if not torch.is_floating_point(x):
        x = x.to(torch.float64)
    if not torch.isfinite(x).all():
        raise ValueError("`points` must be finite (found NaN or inf).")
    if isinstance(discard_fraction, bool) or not 0.0 <= discard_fraction < 1.0:
        raise ValueError(f"`discard_fraction` must be in [0, 1), got {discard_fraction!r}.")
    r1, r2 = nearest_neighbour_distances(x)
    finite = r1 > 0
    if not finite.all():
        warnings.warn(
            f"Dropping {int((~finite).sum())} points with zero distance to their nearest neighbour (duplicates).",
            stacklevel=2,
        )
    mu = torch.sort(r2[finite] / r1[finite]).values
    n = mu.numel()
    # F_emp of the largest kept ratio must stay below 1 (-log(1 - F) is infinite at F = 1), so even
    # discard_fraction = 0 leaves out the single largest ratio.
    n_keep = min(int(n * (1 - discard_fraction)), n - 1)
    if n_keep < 2:
        raise ValueError(f"Fewer than 2 ratios left to fit ({n} points, discard_fraction={discard_fraction}).")
    log_mu = torch.log(mu[:n_keep])
    empirical_cdf = torch.arange(1, n_keep + 1, dtype=torch.float64) / n
    y = -torch.log1p(-empirical_cdf)
    return float((log_mu * y).sum() / (log_mu * log_mu).sum())


def _as_sequences(input_ids, attention_mask) -> list[list[int]]:
    """Token lists without padding, from a (batch, T) tensor plus mask, or a list of variable-length lists."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.ndim != 2:
            raise ValueError(f"`input_ids` must be (batch, T), got shape {tuple(input_ids.shape)}.")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"`attention_mask` must have the shape of `input_ids` {tuple(input_ids.shape)}, "
                f"got {tuple(attention_mask.shape)}."
            )
        return [ids[mask.bool()].tolist() for ids, mask in zip(input_ids, attention_mask, strict=True)]
    if attention_mask is not None:
        raise ValueError("`attention_mask` is only accepted with a tensor `input_ids`; pass unpadded lists instead.")
    if not isinstance(input_ids, Sequence) or not all(isinstance(seq, Sequence) for seq in input_ids):
        raise ValueError("`input_ids` must be a (batch, T) tensor or a list of token-id lists.")
    return [list(seq) for seq in input_ids]


@torch.no_grad()
def collect_hidden_states(
    model,
    input_ids,
    attention_mask=None,
    *,
    max_tokens: int = 20000,
    num_samples: int = 5000,
    batch_size: int = 8,
    seed: int = 0,
    pad_token_id: int = 0,
    return_positions: bool = False,
):
    """Hidden states of a causal LM at every block boundary, for a random sample of its non-padding tokens.

    The first `max_tokens` non-padding tokens of the input (in order) are the pool; `num_samples` of them, drawn
    uniformly with `random.Random(seed)`, are kept, the same tokens at every boundary (arXiv 2610.14644 appendix E.2:
    20,000 pooled, 5,000 kept). Sequences are run right-padded in batches with `output_hidden_states=True`.

    Boundary i < L is the hidden state entering block i (boundary 0 is the embedding output); boundary L is the last
    block's output *before* the final norm (docs/design.md section 4): `config.tie_last_hidden_states` is set to False for
    the call (and restored), which every transformers 5.x model built on `capture_outputs` honours.

    Args:
        model: any transformers causal LM (or base model) accepting `input_ids`, `attention_mask` and
            `output_hidden_states`; put it in eval mode and on the device you want first.
        input_ids: (batch, T) LongTensor with `attention_mask` (1 = token, 0 = padding, either side), or a list of
            token-id lists of any lengths.
        attention_mask: (batch, T) mask for a tensor `input_ids`.
        max_tokens: pool size (positive).
        num_samples: tokens kept (positive; fewer when the pool is smaller).
        batch_size: sequences per forward pass.
        seed: seed of the token sample.
        pad_token_id: id written into padding positions (they are masked out; any valid id works).
        return_positions: also return, for each kept token, (sequence index, position among that sequence's
            non-padding tokens).

    Returns:
        (num_boundaries, n, D) float32 CPU tensor, num_boundaries = L + 1 for an L-block model, n = min(num_samples,
        pool size); with `return_positions`, a tuple (tensor, list of n (sequence, position) pairs).

    Raises:
        ValueError: bad sizes, no non-padding token, or a model that returns no hidden states.
    """
    for name, value in (("max_tokens", max_tokens), ("num_samples", num_samples), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
    sequences = _as_sequences(input_ids, attention_mask)
    pool, kept_per_sequence = 0, []
    for seq in sequences:
        take = min(len(seq), max_tokens - pool)
        kept_per_sequence.append(take)
        pool += take
    if pool == 0:
        raise ValueError("`input_ids` holds no non-padding token.")
    chosen = sorted(random.Random(seed).sample(range(pool), min(num_samples, pool)))
    # Map pooled token index -> (sequence, position); sequences past the pool are not run.
    wanted: dict[int, list[int]] = {}
    offset, cursor = 0, 0
    for seq_idx, take in enumerate(kept_per_sequence):
        while cursor < len(chosen) and chosen[cursor] < offset + take:
            wanted.setdefault(seq_idx, []).append(chosen[cursor] - offset)
            cursor += 1
        offset += take
    device = next(model.parameters()).device
    config = model.config
    had_tie = "tie_last_hidden_states" in config.__dict__
    previous_tie = getattr(config, "tie_last_hidden_states", None)
    config.tie_last_hidden_states = False
    collected: list[torch.Tensor] = []
    try:
        order = sorted(wanted)
        for start in range(0, len(order), batch_size):
            batch = order[start : start + batch_size]
            lengths = [max(wanted[i]) + 1 for i in batch]  # tokens after the last kept one are not needed
            width = max(lengths)
            ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, (seq_idx, length) in enumerate(zip(batch, lengths, strict=True)):
                ids[row, :length] = torch.tensor(sequences[seq_idx][:length], dtype=torch.long)
                mask[row, :length] = 1
            out = model(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True)
            hidden = getattr(out, "hidden_states", None)
            if not hidden:
                raise ValueError(f"{type(model).__name__} returned no `hidden_states` with output_hidden_states=True.")
            rows = torch.tensor([row for row, i in enumerate(batch) for _ in wanted[i]])
            cols = torch.tensor([pos for i in batch for pos in wanted[i]])
            collected.append(torch.stack([h[rows, cols].float().cpu() for h in hidden]))
    finally:
        if had_tie:
            config.tie_last_hidden_states = previous_tie
        else:
            config.__dict__.pop("tie_last_hidden_states", None)
    states = torch.cat(collected, dim=1)
    if return_positions:
        return states, [(i, pos) for i in sorted(wanted) for pos in wanted[i]]
    return states


def intrinsic_dimension_profile(
    hidden_states, discard_fraction: float = 0.1, return_duplicates: bool = False
) -> list[float] | tuple[list[float], list[int]]:
    """TwoNN ID at each boundary of a (num_boundaries, n, D) stack from `collect_hidden_states`.

    Repeated tokens give identical vectors at the embedding boundary; TwoNN leaves such points out (as skdim does,
    without its warning here). With `return_duplicates`, also the number of points per boundary that have an
    identical twin, so that a report can say how many each estimate lost.

    Returns:
        The IDs (one per boundary), or (IDs, duplicate counts) with `return_duplicates`.

    Raises:
        ValueError: `hidden_states` is not 3-D, or as `twonn`.
    """
    stack = torch.as_tensor(hidden_states)
    if stack.ndim != 3:
        raise ValueError(f"`hidden_states` must be (num_boundaries, n, D), got shape {tuple(stack.shape)}.")
    profile, duplicates = [], []
    for layer in stack:
        counts = torch.unique(layer, dim=0, return_counts=True)[1]
        duplicates.append(int(counts[counts > 1].sum()))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Dropping .* duplicates", category=UserWarning)
            profile.append(twonn(layer, discard_fraction))
    return (profile, duplicates) if return_duplicates else profile


def tokenize_texts(tokenizer, texts: Sequence[str], max_length: int = 512) -> list[list[int]]:
    """Token-id lists of `texts` (no padding; each truncated to `max_length`), for `collect_hidden_states`."""
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2:
        raise ValueError(f"`max_length` must be an integer >= 2, got {max_length!r}.")
    encoded = tokenizer(list(texts), truncation=True, max_length=max_length)["input_ids"]
    return [ids for ids in encoded if ids]
