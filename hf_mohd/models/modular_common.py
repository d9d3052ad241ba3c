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
"""Modular source shared by both families: the forwards of the base model and of the causal LM, and the cache hook
of `generate`, written once as mixins.

No model imports this file at run time. `scripts/modular_converter.py` writes these methods into the classes of
`modeling_mohd.py` and `modeling_latent_moe.py` that list a mixin among their bases in `modular_mohd.py` and
`modular_latent_moe.py` (as transformers' modular files inherit from another model's classes), so each family's
flat modeling file shows its own forward. The methods may use only names that `modeling_common.py` or installed
packages provide: the converter imports them from there.
"""

import torch
from transformers.cache_utils import DynamicCache, StaticCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.modeling_utils import slice_logits_to_keep
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, auto_docstring, can_return_tuple
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .modeling_common import deprecate_past_key_values, logger
from .routing_cache import RoutingCache


class RoutingGenerationMixin:
    """Makes `generate` use a `RoutingCache` (key/value cache plus routing record) by default.

    `GenerationMixin._prepare_cache_for_generation` builds a plain `DynamicCache`; this swaps it for a
    `RoutingCache` with the same layer structure (docs/design.md section 5). A static cache keeps working, without a
    record.
    """

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        user_cache = model_kwargs.get("cache")
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        cache = model_kwargs.get("cache")
        if user_cache is None and type(cache) is DynamicCache and not cache.offloading:
            model_kwargs["cache"] = RoutingCache(config=self.config.get_text_config(decoder=True))
            if generation_config.is_assistant:
                model_kwargs["cache"].activate_past_recording()
        elif isinstance(cache, StaticCache):
            logger.warning_once(
                "A static cache keeps keys and values only: the routing record (indices and weights per token) is "
                "not available with cache_implementation='static'. Use the default cache to read it."
            )


class RoutedDecoderMixin:
    """`forward` of both families' base models (the `LlamaModel` flow): embed, create the `RoutingCache`, positions
    and causal mask once, run the decoder layers, final norm. The model defines `embed_tokens`, `layers`, `norm` and
    `rotary_emb` (a module returning None when the family has no positional embedding).
    """

    @deprecate_past_key_values
    @merge_with_config_defaults
    @capture_outputs
    @auto_docstring(
        custom_intro="""
        The decoder stack. Besides the arguments below, takes `routing_replay`
        (`dict[tuple[int, str], RoutingRecord]`, *optional*): a routing record (e.g. `RoutingCache.routing_record` of a
        generation) whose indices, (B, T, k) per (layer, router), replace the routers' own top-k; the gates are
        recomputed by the current routers, so the routers keep their gradient (docs/design.md section 3). Ids out of
        a router's range (the engines' -1) are allowed in padding rows (`attention_mask` 0) only, and ignored there.
        """
    )
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: RoutingCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> MoeModelOutputWithPast:
        r"""
        cache (`RoutingCache`, *optional*):
            Keys, values and the routing record (indices and gates per token and router, docs/design.md section 5);
            created when `use_cache` and none is given.

        Returns:
            `MoeModelOutputWithPast` with `last_hidden_state` (B, T, D) and the cache; hidden states, attentions and
            router logits when requested.
        """
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = RoutingCache(config=self.config)
        if position_ids is None:
            past_seen_tokens = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)
        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            cache=cache,
            position_ids=position_ids,
        )
        # (B, T): 1 at the real tokens of this forward, for the routers (replayed padding rows, expert loads)
        token_mask = None
        if attention_mask is not None and attention_mask.ndim == 2:
            token_mask = attention_mask[:, -inputs_embeds.shape[1] :]
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=causal_mask,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                token_mask=token_mask,
                **kwargs,
            )
        hidden_states = self.norm(hidden_states)
        return MoeModelOutputWithPast(last_hidden_state=hidden_states, cache=cache)


class RoutedCausalLMMixin(RoutingGenerationMixin):
    """`forward` of both families' causal LMs (the `MixtralForCausalLM` flow): LM head on the kept positions, LM
    loss, and `router_aux_loss_coef` times the family's `load_balancing_loss(router_logits, attention_mask,
    routing_replay)` when `output_router_logits` (the family returns None where routing is balanced otherwise).
    """

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    # both tied weights sharded on the vocabulary, as in `LlamaForCausalLM.tp_plan`
    _tp_plan = {"model.embed_tokens": "embedding_rowwise", "lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def save_pretrained(self, save_directory, *args, **kwargs):
        """`PreTrainedModel.save_pretrained`, with `auto_map.AutoModel` naming the base model class too.

        transformers writes `auto_map` entries for the saved class only (`AutoModelForCausalLM`); serving engines that
        load remote code through `AutoModel` (vLLM's Transformers modeling backend) need the base class as well, which
        sits in the same copied code file.
        """
        base = type(self.model)
        if getattr(base, "_auto_class", None) == "AutoModel":
            auto_map = dict(getattr(self.config, "auto_map", None) or {})
            auto_map.setdefault("AutoModel", f"{base.__module__.rsplit('.', 1)[-1]}.{base.__name__}")
            self.config.auto_map = auto_map
        return super().save_pretrained(save_directory, *args, **kwargs)

    @deprecate_past_key_values
    @can_return_tuple
    @auto_docstring(
        custom_intro="""
        The causal LM: LM head on the kept positions, LM loss, and the load-balance loss when `output_router_logits`.
        Besides the arguments below, takes `routing_replay` (a routing record whose indices replace the routers' own
        top-k, as in the base model's forward; the load-balance loss then counts the replayed routes).
        """
    )
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: RoutingCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_router_logits: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> MoeCausalLMOutputWithPast:
        r"""
        cache (`RoutingCache`, *optional*):
            Keys, values and the routing record (indices and gates per token and router, docs/design.md section 5).
        output_router_logits (`bool`, *optional*):
            Whether to return the router logits, one (B*T, choices) fp32 tensor per router, and to add
            `router_aux_loss_coef` times the family's load-balance loss to the loss.

        Returns:
            `MoeCausalLMOutputWithPast`: logits (B, T', vocab), loss = LM loss + coef * aux loss, aux_loss, cache.

        Example:

        ```python
        >>> out = model.generate(input_ids, max_new_tokens=8, return_dict_in_generate=True)
        >>> out.cache.routing_record[(0, "mlp")].indices.shape  # (batch, seq, k); "moe" for LatentMoE
        ```"""
        output_router_logits = (
            output_router_logits if output_router_logits is not None else self.config.output_router_logits
        )
        outputs: MoeModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_router_logits=output_router_logits,
            **kwargs,
        )
        hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.vocab_size, **kwargs)
        aux_loss = None
        if output_router_logits:
            aux_loss = self.load_balancing_loss(outputs.router_logits, attention_mask, kwargs.get("routing_replay"))
            if labels is not None and aux_loss is not None:
                loss = loss + self.config.router_aux_loss_coef * aux_loss.to(loss.device, loss.dtype)
        return MoeCausalLMOutputWithPast(
            loss=loss,
            aux_loss=aux_loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=outputs.router_logits,
        )
