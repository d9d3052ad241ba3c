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
"""Checking a converted model against its source: the oracle is the source's own `LlamaForCausalLM`."""

from __future__ import annotations

import logging

import torch

from .source import ConversionError, DenseLlamaSource


logger = logging.getLogger(__name__)


@torch.no_grad()
def max_logit_difference(
    model, source: DenseLlamaSource, input_ids: torch.Tensor | None = None, *, seed: int = 0, num_tokens: int = 32
) -> float:
    """max |logits(model) - logits(source LLaMA)| over `input_ids` (default: 2 x `num_tokens` random tokens).

    Args:
        model: the converted model (any causal LM taking `input_ids`).
        source: its `DenseLlamaSource`; `source.build_llama()` is the oracle.
        input_ids: (B, T) token ids; None draws them uniformly from the vocabulary with `seed`.

    Returns:
        The largest absolute difference of the (B, T, vocab) logits, computed in fp32.
    """
    if input_ids is None:
        generator = torch.Generator().manual_seed(seed)
        input_ids = torch.randint(0, source.config.vocab_size, (2, num_tokens), generator=generator)
    reference = source.build_llama()
    expected = reference(input_ids=input_ids).logits.float()
    del reference
    was_training = model.training
    actual = model.eval()(input_ids=input_ids, use_cache=False).logits.float()
    model.train(was_training)
    return (actual - expected).abs().max().item()


def verify_logits(model, source: DenseLlamaSource, atol: float = 1e-4, *, seed: int = 0) -> float:
    """`max_logit_difference` of `model` against `source` on random tokens drawn with `seed`, which must be <= `atol`
    (the check behind `verify=True` / `--verify`; docs/design.md section 6: a conversion is exact before sparsity).

    Returns:
        The max |logit difference| (fp32 logits; a float, logged at INFO).

    Raises:
        ConversionError: the difference exceeds `atol` (or is NaN); the message gives both numbers.
    """
    diff = max_logit_difference(model, source, seed=seed)
    logger.info("verify (the exact model at full activation vs the source): max |logit difference| = %.3g", diff)
    if not diff <= atol:
        raise ConversionError(
            f"verify=True (--verify) failed: logits differ from the source by {diff:.3g} > atol={atol}.", "failed"
        )
    return diff


__all__ = ["max_logit_difference", "verify_logits"]
