"""vLLM model classes of both families, on vLLM's Transformers modeling backend (`hf_mohd.interop.vllm` registers them).

The backend builds the family's own transformers modules from the saved folder's remote code and swaps in vLLM's
pieces: its paged attention behind `ALL_ATTENTION_FUNCTIONS` (both families dispatch there from each attention's
forward), its parallel linears and vocabulary embeddings, its fused MoE for modules named `experts`. Two of its
choices do not fit these families, and the classes here change exactly those:

- LatentMoE (`LatentMoEForCausalLM`): the backend builds every fused MoE with the config's one `num_experts`,
  `num_experts_per_tok`, `moe_intermediate_size` and `hidden_size`, and a SiLU-gated activation. LatentMoE's routed
  experts compute at the latent width l (`moe_latent_size`), may differ per layer (`per_layer_config`) and may be
  non-gated (relu2). Here each layer's fused MoE gets that layer's (E, K, l, m) and activation. The model's own
  router still routes (the backend's "external routing": its ids and gates, unit gates included, go to the fused
  kernel as they are) and the latent projections and the shared expert stay outside the experts, as in the model.
  Where this vLLM build has no kernel for the experts' activation (non-gated experts on CPU), the layer keeps the
  model's own experts module.
- MoHD (`MoHDForCausalLM`): the backend replaces every `nn.Linear` with vLLM's linear classes, which MoHD's gather
  strategy cannot read by blocks, so each sublayer falls back to its masked strategy (every block computed, then
  masked: exact, dense cost). Without tensor parallelism or quantisation the projections of MoHD's sparse sublayers
  stay `nn.Linear` here. On the CPU their weights are then prepacked for vLLM's oneDNN products and each sublayer
  computes through `vllm_mohd_cpu`'s operators, which plan by the step's tokens when they run (`HF_MOHD_VLLM_ONEDNN=0`
  keeps the torch strategies). Elsewhere (and for a sublayer those operators do not take) the configured strategy
  reads only the active blocks of the `nn.Linear` weights, the input projections stored block-major in one storage
  per sublayer (q/k/v, gate/up), as `generate` stores them; on the CPU a model configured with the gather strategy is
  served with the sorted one (one sort of the (token, block) pairs and one grouped product per side for the many
  tokens of a continuous batch), on an accelerator with the device's default plans (`DEVICE_DEFAULT_PLANS` of the
  model's strategies file).
"""

import os
from functools import partial

import torch
from torch import nn
from vllm.distributed import get_ep_group
from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe import FusedMoEFactory
from vllm.model_executor.models.transformers import TransformersForCausalLM, TransformersMoEForCausalLM
from vllm.model_executor.models.transformers.base import Base
from vllm.model_executor.models.transformers.moe import (
    TransformersMoERunner,
    TransformersMoEState,
    TransformersRoutedExperts,
)
from vllm.platforms import current_platform

from .vllm_mohd_cpu import pack_sublayer, packable


# under "vllm.", whose handlers vLLM configures (its log level, its format)
logger = init_logger(f"vllm.plugins.{__name__}")

# "0" keeps MoHD's torch strategies on the CPU instead of the prepacked oneDNN products (`vllm_mohd_cpu`)
ONEDNN_ENV = "HF_MOHD_VLLM_ONEDNN"

# `config.hidden_act` of the experts -> vLLM's `MoEActivation` name of the gated form; the non-gated form adds
# "_no_mul" (vLLM `model_executor/layers/fused_moe/activation.py`)
FUSED_MOE_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu2": "relu2",
}


def fused_moe_activation(hidden_act: str, gated: bool) -> str | None:
    """vLLM's fused-MoE activation for experts computing `act(gate) * up` (`gated`) or `act(up)`, or None when vLLM
    has no such activation or this platform's fused MoE refuses it (non-gated experts run only on CUDA, ROCm and XPU
    in vLLM 0.32: `FusedMoEConfig` raises `NotImplementedError` elsewhere)."""
    name = FUSED_MOE_ACTIVATIONS.get(hidden_act)
    if name is None:
        return None
    if gated:
        return name
    if not (current_platform.is_cuda_alike() or current_platform.is_xpu()):
        return None
    return f"{name}_no_mul"


def external_routing(
    hidden_states: torch.Tensor,
    gating_output: torch.Tensor,
    topk: int,
    renormalize: bool,
    moe_state: TransformersMoEState,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused MoE's routing function when the model routes: `gating_output` is the model's (M, K) gates and the
    ids are those `TransformersMoERunner` stored for this call; nothing is renormalised (the model's router already
    applied its rule: softmax or sigmoid scores, renormalisation, scaling factor, unit gates)."""
    if moe_state.topk_ids is None:
        raise RuntimeError("LatentMoE fused experts: no routed ids were stored before the fused MoE ran.")
    return gating_output, moe_state.topk_ids


class LatentMoEForCausalLM(TransformersMoEForCausalLM):
    """LatentMoE in vLLM: the Transformers backend with one fused MoE per layer of that layer's expert shape.

    Every layer whose mixer is a LatentMoE block gets a fused MoE (vLLM's `FusedMoEFactory`, run through the backend's
    `TransformersMoERunner` with the model's routes) of E = the layer's `num_experts`, top_k = its router's k,
    hidden size l (`moe_latent_size`, else `hidden_size`) and intermediate size m, with the activation of
    `hidden_act` gated or not (`mlp_gated`). Tensor and expert parallelism are vLLM's own for the fused experts.
    """

    def recursive_replace(self):
        self._replace_routed_experts()
        # the backend's replacement of everything else (linears, embeddings, attention); `MoEMixin.recursive_replace`
        # is skipped, since it would build the fused MoE of one global shape
        Base.recursive_replace(self)

    def _replace_routed_experts(self) -> None:
        parallel = self.parallel_config
        self.mlp_layers, self.moe_layers = [], []
        num_experts = []
        for layer_idx, layer in enumerate(self.model.layers):
            block = getattr(layer, "mlp", None)
            experts = getattr(block, "experts", None)
            if experts is None or not hasattr(experts, "num_experts"):  # a dense layer, or another pipeline rank's
                continue
            gated = hasattr(experts, "gate_up_proj")
            activation = fused_moe_activation(self.text_config.hidden_act, gated)
            if activation is None:
                logger.info_once(
                    "LatentMoE: %s experts with hidden_act=%r have no fused MoE kernel on this platform; those layers "
                    "keep the model's own experts module.",
                    "gated" if gated else "non-gated",
                    self.text_config.hidden_act,
                )
                continue
            moe_state = TransformersMoEState()
            prefix = f"model.layers.{layer_idx}.mlp.experts"
            fused = FusedMoEFactory(
                num_experts=experts.num_experts,
                top_k=block.gate.top_k,
                hidden_size=experts.hidden_dim,
                intermediate_size=experts.intermediate_dim,
                renormalize=False,
                quant_config=self.quant_config,
                prefix=prefix,
                activation=activation,
                enable_eplb=parallel.enable_eplb,
                num_redundant_experts=parallel.eplb_config.num_redundant_experts,
                has_bias=False,
                routed_experts_cls=TransformersRoutedExperts,
                custom_routing_function=partial(external_routing, moe_state=moe_state),
                runner_cls=TransformersMoERunner,
                runner_args={"moe_state": moe_state},
            )
            block.experts = fused
            self.mlp_layers.append(block)
            self.moe_layers.append(fused)
            num_experts.append(experts.num_experts)
            logger.info_once("LatentMoE: routed experts -> vLLM fused MoE (model routing, per-layer shapes)")
        # `MixtureOfExperts` state (expert load balancing, routed-experts capture)
        self.num_moe_layers = len(self.moe_layers)
        self.num_expert_groups = 1
        self.num_logical_experts = max(num_experts, default=0)
        self.num_physical_experts = self.num_logical_experts + parallel.eplb_config.num_redundant_experts
        self.num_local_physical_experts = self.num_physical_experts // get_ep_group().world_size
        self.num_routed_experts = self.num_logical_experts
        self.num_shared_experts = int(self.text_config.moe_shared_expert_intermediate_size > 0)
        self.num_redundant_experts = parallel.eplb_config.num_redundant_experts


class MoHDForCausalLM(TransformersForCausalLM):
    """MoHD in vLLM: the Transformers backend with the projections of MoHD's sparse sublayers left as `nn.Linear`
    (without tensor parallelism or quantisation): on the CPU prepacked for vLLM's oneDNN products
    (`vllm_mohd_cpu.MoHDOneDNNStrategy`), elsewhere read by blocks by `config.sparse_implementation` (block-major,
    fused per sublayer; "gather" served as "sorted" on the CPU, see the module docstring); with either, the backend's
    parallel or quantised linears and the masked strategy."""

    def recursive_replace(self):
        keep = self.tp_group.world_size == 1 and self.quant_config is None
        kept = []
        if keep:
            for module in self.model.modules():
                if hasattr(module, "sub_dims"):
                    linears = {name: child for name, child in module.named_children() if type(child) is nn.Linear}
                    kept.append((module, linears))
        super().recursive_replace()
        for module, linears in kept:
            for name, linear in linears.items():
                setattr(module, name, linear)
        self.kept_sparse_linears = bool(kept)
        if kept:
            strategy = getattr(self.text_config, "sparse_implementation", "gather")
            logger.info_once("MoHD: sparse sublayers keep nn.Linear projections (strategy %r)", strategy)

    def load_weights(self, weights):
        """The backend's weight loading, then the kept input projections stored block-major, each sublayer's in one
        shared storage (`MoHDPreTrainedModel.to_weight_layout`), the layout in which the plans read only the active
        blocks, contiguously, as `generate` stores them before decoding."""
        loaded = super().load_weights(weights)
        if self.kept_sparse_linears:
            self.model.to_weight_layout("column_major")
            logger.info_once("MoHD: input projections stored block-major (fused q/k/v and gate/up)")
            if self.text_config.sparse_implementation == "gather" and current_platform.is_cpu():
                self.model.set_sparse_implementation("sorted")
                logger.info_once("MoHD: the gather strategy's many-token batches take the sorted plan ('sorted')")
            if current_platform.is_cpu() and os.environ.get(ONEDNN_ENV, "1") != "0":
                self.pack_sparse_sublayers()
        return loaded

    def pack_sparse_sublayers(self) -> None:
        """On the CPU, each sparse sublayer that `vllm_mohd_cpu.packable` accepts computes on prepacked oneDNN
        weights (`vllm_mohd_cpu.MoHDOneDNNStrategy`); the others keep their strategy, with a log line saying why."""
        packed, bytes_packed = 0, 0
        for name, module in self.model.named_modules():
            sub_dims = getattr(module, "sub_dims", None)
            if sub_dims is None:
                continue
            if hasattr(module, "q_proj"):
                inputs, output = (module.q_proj, module.k_proj, module.v_proj), module.o_proj
            else:
                inputs, output = (module.gate_proj, module.up_proj), module.down_proj
            refusal = packable(sub_dims, (*inputs, output))
            if refusal:
                logger.info(
                    "MoHD: %s keeps its %s strategy on the CPU: %s", name, type(sub_dims.strategy).__name__, refusal
                )
                continue
            bytes_packed += sum(linear.weight.nbytes for linear in (*inputs, output))
            sub_dims.strategy = pack_sublayer(sub_dims, inputs, output)
            packed += 1
        if packed:
            logger.info_once(
                "MoHD: %d sparse sublayers on prepacked oneDNN products planned by tokens (%.1f MiB of weights packed "
                "twice: whole and by blocks)",
                packed,
                bytes_packed / 2**20,
            )
