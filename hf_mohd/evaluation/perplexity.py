"""Perplexity of a causal LM, in one place: exp(mean next-token negative log-likelihood).

Token t + 1 of a sequence is predicted from tokens 0..t; its NLL is the cross-entropy of the model's fp32 logits at
position t against it (natural log, nats). The first token of a sequence is never predicted. With an attention
mask, a target counts only when it and the token before it are real tokens (mask 1), so padding on either side
adds nothing. Perplexity is exp(sum of the counted NLLs / their number), over every sequence together (not a mean
of per-sequence perplexities).

Used by the trainer (`hf_mohd.training`: held-out loss, also across processes), the SmolLM2 experiments
(`experiments/smollm2/`) and the replication study (`bench/replication/`).
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch


def next_token_nll(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **forward_kwargs):
    """(sum of the next-token NLLs, number of predicted tokens) of one batch.

    Args:
        model: a causal LM whose output has `.logits` of shape (B, T, V).
        input_ids: (B, T) token ids.
        attention_mask: (B, T), 1 for real tokens and 0 for padding (left or right); None: every token is real.
        forward_kwargs: passed to the forward (e.g. `routing_replay=`); `use_cache=False` is always passed.

    Returns:
        A 0-dim float32 tensor (the sum, nats, on the model's device) and an int.
    """
    if attention_mask is not None:
        forward_kwargs["attention_mask"] = attention_mask
    logits = model(input_ids=input_ids, use_cache=False, **forward_kwargs).logits[:, :-1].float()
    targets = input_ids[:, 1:]
    if attention_mask is not None:
        counted = attention_mask[:, 1:].bool() & attention_mask[:, :-1].bool()
        targets = targets.masked_fill(~counted, -100)  # cross_entropy's ignore_index
        count = int(counted.sum())
    else:
        count = targets.numel()
    total = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum"
    )
    return total, count


@torch.no_grad()
def perplexity(
    model,
    input_ids: torch.Tensor,
    batch_size: int = 4,
    *,
    attention_mask: torch.Tensor | None = None,
    routing_records=None,
    desc: str | None = None,
) -> float:
    """exp(mean next-token NLL) over every predicted token of the (N, T) `input_ids`, in batches of `batch_size`.

    Args:
        attention_mask: (N, T), 0 at padding (see the module docstring); None: no padding.
        routing_records: one routing record per batch, replayed (`routing_replay=`) by MoHD models.
        desc: show a progress bar (tqdm) with this label.

    Returns:
        The perplexity; nan when no token is predicted.
    """
    batches = range(0, input_ids.shape[0], batch_size)
    if desc is not None:
        from tqdm.auto import tqdm

        batches = tqdm(batches, desc=desc[:40], leave=False)
    total, count = 0.0, 0
    for number, start in enumerate(batches):
        extra = {} if routing_records is None else {"routing_replay": routing_records[number]}
        mask = None if attention_mask is None else attention_mask[start : start + batch_size]
        nll, tokens = next_token_nll(model, input_ids[start : start + batch_size], mask, **extra)
        total, count = total + nll.item(), count + tokens
    return math.exp(total / count) if count else float("nan")


@torch.no_grad()
def evaluate_perplexity(model, blocks: torch.Tensor, batch_size: int, accelerator=None, max_batches: int = 0):
    """(mean next-token NLL in nats/token, perplexity) over packed (N, T) `blocks`, all processes together.

    Each process scores blocks rank, rank + world, ...; sums of token NLLs and token counts are reduced. A sharded
    model (FSDP, DeepSpeed ZeRO) gathers its weights in every forward, all processes together, so there every
    process runs as many forwards as process 0; one whose blocks ran out scores a block with weight 0. The model is
    put in eval mode and restored. `max_batches` (0: all) limits each process's batches.
    """
    from accelerate.utils import DistributedType

    rank, world = (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)
    device = accelerator.device if accelerator else next(model.parameters()).device
    was_training = model.training
    model.eval()
    limit = max_batches * batch_size if max_batches else len(blocks)
    mine = blocks[rank::world][:limit]
    sharded = accelerator is not None and accelerator.distributed_type in (
        DistributedType.FSDP,
        DistributedType.DEEPSPEED,
    )
    most = len(blocks[0::world][:limit]) if sharded else len(mine)  # process 0 has the most blocks
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for start in range(0, most, batch_size):
        batch = mine[start : start + batch_size]
        weight = 1 if len(batch) else 0
        batch = (batch if len(batch) else blocks[:1]).to(device)
        with accelerator.autocast() if accelerator else nullcontext():
            nll, tokens = next_token_nll(model, batch)
        total += torch.tensor([weight * nll.double().item(), weight * tokens], dtype=torch.float64, device=device)
    if accelerator is not None:
        total = accelerator.reduce(total, reduction="sum")
    model.train(was_training)
    if total[1] == 0:
        return float("nan"), float("nan")
    mean = (total[0] / total[1]).item()
    return mean, math.exp(mean)


__all__ = ["evaluate_perplexity", "next_token_nll", "perplexity"]
