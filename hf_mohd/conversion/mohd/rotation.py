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
"""Change of basis of a dense LLaMA's residual stream by computational invariance (SliceGPT, Ashkboos et al.,
ICLR 2024, arXiv 2401.15024, section 3).

A pretrained residual stream spreads its features over all hidden channels, so no choice of consecutive channels
(and no permutation of them) makes good always-active MoHD blocks. An orthogonal change of basis can:

1. Fold every RMSNorm weight into the linears that read it (SliceGPT section 3.2): RMSNorm(h) = h / rms(h) * gamma,
   so a reader W (out x D) of the normed stream becomes W diag(gamma) and the norm weight becomes 1. The LM head
   reads the final norm, so its fold gives W_head diag(gamma_final): with tied embeddings the head is **untied**
   (one more vocab_size x D matrix). `rotate_llama` unties it always, even when gamma_final is all ones (then the
   rotated head equals the rotated embedding, stored twice).
2. Rotate the stream by one orthogonal Q (D x D): h -> h Q (row vectors). h / rms(h) commutes with Q because
   rms(h Q) = rms(h) (SliceGPT section 3.1), so: embedding E -> E Q; every reader (q, k, v, gate, up, LM head)
   W -> W Q; every writer (o, down) W -> Q^T W and its bias b -> b Q. Attention, RoPE and the SwiGLU act on head and
   intermediate widths, which do not change.

This module builds the **single global Q** variant: one Q for the whole residual stream, exact (the rotated model is
the same function up to float rounding), with no extra matrices. SliceGPT section 3.3's alternative, one Q per layer
with a D x D shortcut rotation on every residual connection, is not built.

Q is the PCA basis of calibration hidden states (SliceGPT section 3.3 computes it from the outputs of the norms): the
eigenvectors of the second moment C = sum over tokens and sublayers of x^T x, with x = h / rms(h) the normalised input
of every attention and FFN sublayer, pooled over all of them, accumulated in float64; the eigenvectors are sorted by
decreasing eigenvalue, so the first channels (MoHD's shared blocks) hold the leading components. Each eigenvector's
sign is fixed so that its largest-magnitude entry is positive (the basis is deterministic).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch

from ..pca import pca_rotation
from ..source import ConversionError, DenseLlamaSource


logger = logging.getLogger(__name__)

ROTATIONS = ("pca",)
# Per sublayer: (its norm, the router name of MoHD's sublayer, the projections reading the normed input, writers).
SUBLAYER_NORMS = (
    ("input_layernorm", "attn", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",)),
    ("post_attention_layernorm", "mlp", ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",)),
)


def fold_rmsnorm_weights(state_dict: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """The same LLaMA with every RMSNorm weight folded into the linears that read its output (SliceGPT section 3.2).

    Readers W (out x D) of a norm with weight gamma (D,) become W diag(gamma), in float64, then cast back to their
    dtype; every norm weight becomes ones. The final norm folds into `lm_head.weight`, which is then a tensor of its
    own (untied from the embedding). Other tensors are returned as is (the same objects).

    Raises:
        ConversionError: a tensor the fold needs is missing from `state_dict`.
    """
    folded = dict(state_dict)
    try:
        for layer in range(num_layers):
            prefix = f"model.layers.{layer}."
            for norm, _, readers, _ in SUBLAYER_NORMS:
                gamma = state_dict[f"{prefix}{norm}.weight"]
                for name in readers:
                    weight = state_dict[f"{prefix}{name}.weight"]
                    folded[f"{prefix}{name}.weight"] = (weight.double() * gamma.double()).to(weight.dtype)
                folded[f"{prefix}{norm}.weight"] = torch.ones_like(gamma)
        gamma = state_dict["model.norm.weight"]
        head = state_dict["lm_head.weight"]
    except KeyError as err:
        raise ConversionError(
            f"Folding the RMSNorm weights needs tensor {err} (a LlamaForCausalLM state dict)."
        ) from err
    folded["lm_head.weight"] = (head.double() * gamma.double()).to(head.dtype)
    folded["model.norm.weight"] = torch.ones_like(gamma)
    return folded


def rotate_hidden_basis(
    state_dict: dict[str, torch.Tensor], rotation: torch.Tensor, num_layers: int
) -> dict[str, torch.Tensor]:
    """The same LLaMA in the residual basis h -> h Q (SliceGPT section 3.1); exact only with folded norms.

    Args:
        state_dict: a norm-folded `LlamaForCausalLM` state dict (`fold_rmsnorm_weights`: every norm weight 1; an
            RMSNorm weight other than ones does not commute with Q) with its own `lm_head.weight`.
        rotation: Q, (D, D) orthogonal (columns are the new basis vectors); products run in float64.
        num_layers: the config's `num_hidden_layers`.

    Returns:
        A new state dict: embedding and readers (q, k, v, gate, up, LM head) W Q, writers (o, down) Q^T W, writer
        biases b Q, everything in its original dtype; the rest unchanged.

    Raises:
        ConversionError: Q is not square of the hidden width, not orthogonal (|Q^T Q - I| > 1e-6), or a norm weight
            is not all ones.
    """
    embed = state_dict["model.embed_tokens.weight"]
    width = embed.shape[1]
    q = rotation.double()
    if q.shape != (width, width):
        raise ConversionError(f"`rotation` must be ({width}, {width}) for hidden_size {width}, got {tuple(q.shape)}.")
    error = (q.T @ q - torch.eye(width, dtype=torch.float64)).abs().max().item()
    if error > 1e-6:
        raise ConversionError(f"`rotation` is not orthogonal: max |Q^T Q - I| = {error:.3g} (> 1e-6).")
    norms = [name for name in state_dict if name.endswith("norm.weight")]
    unfolded = [name for name in norms if not torch.all(state_dict[name] == 1)]
    if unfolded:
        raise ConversionError(f"Fold the RMSNorm weights before rotating (fold_rmsnorm_weights): {unfolded[:3]}.")
    readers = ["model.embed_tokens.weight", "lm_head.weight"]
    writers = []
    for layer in range(num_layers):
        prefix = f"model.layers.{layer}."
        for _, _, reads, writes in SUBLAYER_NORMS:
            readers += [f"{prefix}{name}.weight" for name in reads]
            writers += [f"{prefix}{name}" for name in writes]
    rotated = dict(state_dict)
    for name in readers:
        tensor = state_dict[name]
        rotated[name] = (tensor.double() @ q).to(tensor.dtype)
    for name in writers:
        tensor = state_dict[f"{name}.weight"]
        rotated[f"{name}.weight"] = (q.T @ tensor.double()).to(tensor.dtype)
        bias = state_dict.get(f"{name}.bias")
        if bias is not None:
            rotated[f"{name}.bias"] = (bias.double() @ q).to(bias.dtype)
    return rotated


@torch.no_grad()
def for_each_sublayer_input(
    model, input_ids: torch.Tensor, callback: Callable[[int, str, torch.Tensor], None], batch_size: int = 4
) -> None:
    """Run a `LlamaForCausalLM` on (B, T) `input_ids` and hand every sublayer's normalised input to `callback`.

    callback(layer index, "attn" or "mlp", x) with x = h / sqrt(mean(h^2) + eps), (B' * T, D) float64, computed from
    the residual stream h entering that sublayer's RMSNorm (without the norm weight, so the same in a folded model).
    Batches of `batch_size` rows; no cache.
    """
    handles = []
    for idx, layer in enumerate(model.model.layers):
        for norm_name, router, _, _ in SUBLAYER_NORMS:
            norm = getattr(layer, norm_name)
            eps = norm.variance_epsilon

            def hook(module, args, idx=idx, router=router, eps=eps):
                hidden = args[0].detach().double().flatten(0, -2)
                callback(idx, router, hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps))

            handles.append(norm.register_forward_pre_hook(hook))
    try:
        for start in range(0, input_ids.shape[0], batch_size):
            model(input_ids=input_ids[start : start + batch_size], use_cache=False)
    finally:
        for handle in handles:
            handle.remove()


def hidden_state_second_moment(source: DenseLlamaSource, input_ids: torch.Tensor, batch_size: int = 4) -> torch.Tensor:
    """C = mean over tokens and sublayers of x^T x, (D, D) float64, x the normalised sublayer inputs
    (`for_each_sublayer_input`) of the source on calibration `input_ids` (B, T).

    Raises:
        ConversionError: fewer calibration tokens than hidden channels (C would be rank-deficient: its trailing
            eigenvectors, and so the routed blocks, would be arbitrary).
    """
    width = source.config.hidden_size
    if input_ids.ndim != 2 or input_ids.numel() < width:
        raise ConversionError(
            f"Calibration text for the PCA rotation is {input_ids.numel()} tokens of shape {tuple(input_ids.shape)}; "
            f"expected (batch, seq) with at least hidden_size = {width} tokens (more is better: thousands)."
        )
    moment = torch.zeros(width, width, dtype=torch.float64)
    count = 0

    def accumulate(layer, router, x):
        nonlocal moment, count
        moment += x.T @ x
        count += x.shape[0]

    for_each_sublayer_input(source.build_llama(), input_ids, accumulate, batch_size)
    return moment / count


def rotate_llama(
    source: DenseLlamaSource,
    calibration_ids: torch.Tensor | None = None,
    *,
    rotation: torch.Tensor | None = None,
    batch_size: int = 4,
) -> tuple[DenseLlamaSource, dict]:
    """The source LLaMA with folded norms, rotated into the PCA basis of its calibration hidden states.

    Args:
        source: the dense LLaMA (any floating dtype; the rotation is computed and applied in float64).
        calibration_ids: (B, T) token ids of calibration text (at least hidden_size tokens), used when `rotation`
            is None.
        rotation: an explicit orthogonal Q (D, D) instead of the PCA basis.
        batch_size: rows per calibration forward.

    Returns:
        (rotated source, info). The rotated `DenseLlamaSource` has `tie_word_embeddings=False` (the final norm is
        folded into its own LM head), every norm weight 1, and computes the source's logits up to float rounding
        (its `build_llama()` is a `LlamaForCausalLM`). info: "rotation" ("pca" or "given"), "calibration_tokens",
        "eigenvalues" (D,) float64 or None, "untied_parameters" (the LM head's elements added by untying, 0 when the
        source was untied).

    Raises:
        ConversionError: neither `calibration_ids` nor `rotation`, too little calibration text, or a bad `rotation`.
    """
    config = source.config
    eigenvalues = None
    if rotation is None:
        if calibration_ids is None:
            raise ConversionError("The PCA rotation needs calibration text: pass `calibration_ids` (B, T) token ids.")
        second_moment = hidden_state_second_moment(source, calibration_ids, batch_size)
        rotation, eigenvalues = pca_rotation(second_moment)
        logger.info(
            "PCA basis of %d calibration tokens x %d sublayers: leading eigenvalue share %.3f",
            calibration_ids.numel(),
            2 * config.num_hidden_layers,
            (eigenvalues[0] / eigenvalues.sum()).item(),
        )
    tied = source.state_dict["lm_head.weight"] is source.state_dict["model.embed_tokens.weight"]
    folded = fold_rmsnorm_weights(source.state_dict, config.num_hidden_layers)
    state_dict = rotate_hidden_basis(folded, rotation, config.num_hidden_layers)
    new_config = config.__class__.from_dict(config.to_dict())
    new_config.tie_word_embeddings = False
    what = "the PCA basis" if eigenvalues is not None else "a given orthogonal basis"
    tokens = None if calibration_ids is None or eigenvalues is None else int(calibration_ids.numel())
    rotated = dataclasses.replace(
        source,
        config=new_config,
        state_dict=state_dict,
        description=f"{source.description}; RMSNorm weights folded and the residual stream rotated into {what}"
        + (f" of {tokens} calibration tokens" if tokens else ""),
    )
    untied = source.state_dict["lm_head.weight"].numel() if tied else 0
    info = {
        "rotation": "pca" if eigenvalues is not None else "given",
        "calibration_tokens": tokens,
        "eigenvalues": eigenvalues,
        "untied_parameters": untied,
        "basis": rotation.double(),
    }
    return rotated, info


__all__ = [
    "ROTATIONS",
    "SUBLAYER_NORMS",
    "fold_rmsnorm_weights",
    "for_each_sublayer_input",
    "hidden_state_second_moment",
    "rotate_hidden_basis",
    "rotate_llama",
]
