"""TRL's trainers (`SFTTrainer`, `DPOTrainer`, the pinned TRL 1.16.0) on MoHD and LatentMoE with the model's own
router load-balance loss: `prepare_trl_trainer(trainer)` after building the trainer, before `train()`.

Why a step is needed (TRL 1.16.0, `trl/trainer/utils.py::add_fused_lm_head`): both trainers replace the model's
`forward` by a fused LM head that runs the backbone alone and, for any config with `output_router_logits`, adds
Mixtral's `load_balancing_loss_func` with `config.num_experts` and `config.num_experts_per_tok`. MoHD has no
`num_experts` (an AttributeError at the first step); LatentMoE gets Mixtral's formula (k times the Switch loss of the
routers' pooled counts) instead of its own (the mean over routers of each router's Switch loss at its own k), also
under sigmoid routing, which balances by router-bias updates and has no loss. `SFTTrainer` also writes
`output_router_logits = True` into the config it saves. No config attribute changes the formula TRL imports, and
`SFTConfig(router_aux_loss_coef=0.0)` drops the loss and saves the coefficient 0.0; see
docs/fine-tuning-and-evaluation.md ("Fine-tune with TRL") for the choice.

This module imports TRL only through the trainer it is given; hf-mohd does not need TRL installed otherwise.
"""

import functools
import types

from transformers import TrainerCallback

from ..models.modeling_common import counted_tokens


def _routed_model(model):
    """The MoHD / LatentMoE causal LM under `model` (a PEFT wrapper's base model), or None for another model."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base if hasattr(base, "load_balancing_loss") and hasattr(base, "built_router_settings") else None


def _has_aux_loss(model) -> bool:
    """Whether the family balances its routers with a loss (MoHD; LatentMoE with softmax routing) rather than
    router-bias updates (LatentMoE with sigmoid routing)."""
    return getattr(model.config, "router_score_func", "softmax") == "softmax"


def _own_aux_loss_forward(model) -> None:
    """Wraps TRL's fused forward (installed on `model` by `add_fused_lm_head`): with `fused_lm_head=True` and router
    logits asked for, the backbone runs without TRL's Mixtral loss, the routers' logits are collected by forward hooks
    in call order (the order of `router_logits`), and `aux_loss` is the model's own `load_balancing_loss` on the
    tokens `attention_mask` marks real (no mask: every token, as for TRL's padding-free batches); the fused output's
    `loss` gets `router_aux_loss_coef * aux_loss` as the model's own forward adds it. Other calls pass through."""
    fused = vars(model).get("forward")
    if fused is None or getattr(fused, "_hf_mohd_own_aux_loss", False):
        return
    routers = [module for module in model.modules() if hasattr(module, "router_name") and hasattr(module, "top_k")]

    @functools.wraps(fused)
    def forward(self, *args, fused_lm_head=False, **kwargs):
        if not fused_lm_head:
            return fused(*args, **kwargs)
        wanted = kwargs.pop("output_router_logits", None)
        if wanted is None:
            wanted = bool(getattr(self.config, "output_router_logits", False))
        if not wanted or not _has_aux_loss(self):
            return fused(*args, fused_lm_head=True, output_router_logits=False, **kwargs)
        collected = []
        handles = [
            router.register_forward_hook(lambda module, inputs, out: collected.append(out[0])) for router in routers
        ]
        try:
            outputs = fused(*args, fused_lm_head=True, output_router_logits=False, **kwargs)
        finally:
            for handle in handles:
                handle.remove()
        ids = kwargs.get("input_ids", args[0] if args else None)
        batch, tokens = (ids if ids is not None else kwargs["inputs_embeds"]).shape[:2]
        token_mask = counted_tokens(kwargs.get("attention_mask"), batch, tokens)
        aux_loss = self.load_balancing_loss(tuple(collected), token_mask, kwargs.get("routing_replay"))
        outputs.aux_loss = aux_loss
        outputs.loss = outputs.loss + self.config.router_aux_loss_coef * aux_loss.to(outputs.loss.dtype)
        return outputs

    forward._hf_mohd_own_aux_loss = True
    model.forward = types.MethodType(forward, model)


class RouterBiasUpdate(TrainerCallback):
    """Aux-loss-free balancing of sigmoid-routed LatentMoE (DeepSeek-V3, arXiv 2412.19437 section 2.1.2): one
    `update_router_biases()` after each optimizer step, as `hf-mohd train` does."""

    def __init__(self, model):
        self.model = model

    def on_step_end(self, args, state, control, **kwargs):
        self.model.update_router_biases()


def prepare_trl_trainer(trainer):
    """Makes a TRL trainer (`SFTTrainer`, `DPOTrainer`; TRL 1.16.0) train a MoHD or LatentMoE model (full or LoRA)
    with the model's own balancing. Call it after building the trainer, before `train()`.

    - Softmax routing (MoHD; LatentMoE `router_score_func="softmax"`): TRL's fused forward (of the policy and of a
      reference model) returns the model's own `load_balancing_loss` as `aux_loss`, which the trainer adds times
      `router_aux_loss_coef` (the config's, or the trainer argument's when set); it is on when the trainer asks for it
      (a non-zero coefficient), as for TRL's MoE models.
    - Sigmoid routing (LatentMoE): no aux loss (TRL's is turned off) and a `RouterBiasUpdate` callback instead.
    - The model's config gets back the `output_router_logits` and `router_aux_loss_coef` it was built with
      (`SFTTrainer` rewrites them), so the saved config is the user's.

    Args:
        trainer: a built `trl.SFTTrainer` or `trl.DPOTrainer` whose model (or PEFT model) is MoHD or LatentMoE.

    Returns:
        The same trainer.

    Raises:
        ValueError: when the trainer's model is not a MoHD or LatentMoE model, or the trainer has not installed TRL's
            fused LM head (another TRL version: the pinned one is in constraints.txt).
    """
    model = _routed_model(trainer.model)
    if model is None:
        raise ValueError(
            f"prepare_trl_trainer: trainer.model is {type(trainer.model).__name__}; expected a MoHD or LatentMoE causal "
            "LM (or a PEFT model of one)."
        )
    if "forward" not in vars(model):
        raise ValueError(
            "prepare_trl_trainer: the trainer did not replace the model's forward by TRL's fused LM head "
            "(trl.trainer.utils.add_fused_lm_head); expected TRL 1.16.0, the version pinned in constraints.txt."
        )
    for name, value in model.built_router_settings.items():
        setattr(model.config, name, value)
    _own_aux_loss_forward(model)
    reference = getattr(trainer, "ref_model", None)  # DPO's frozen reference, when it is a separate model
    if reference is not None and _routed_model(reference) is not None:
        _own_aux_loss_forward(_routed_model(reference))
    if not _has_aux_loss(model):
        trainer.aux_loss_enabled = False
        if not any(isinstance(callback, RouterBiasUpdate) for callback in trainer.callback_handler.callbacks):
            trainer.add_callback(RouterBiasUpdate(model))
    return trainer


__all__ = ["RouterBiasUpdate", "prepare_trl_trainer"]
