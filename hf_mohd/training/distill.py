"""Healing by distillation and the choice of trainable parameters (the `distill` and `model.trainable` settings).

A sparsified conversion (e.g. `hf-mohd convert mohd --preset compression_75`) is healed by training it towards the
dense model it came from: KL(teacher || student) on temperature-softened next-token distributions, scaled by T^2
(Hinton et al., "Distilling the Knowledge in a Neural Network", arXiv 1503.02531, section 2), optionally plus the LM
loss. The teacher is run on each micro-batch without gradient; nothing of it is saved (resuming reloads it).
"""

import torch
import torch.nn.functional as F

from .config import DistillConfig, ModelConfig, TrainConfigError


LORA_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """T^2 * mean over tokens of KL(softmax(teacher / T) || softmax(student / T)), in nats, computed in fp32.

    Args:
        student_logits, teacher_logits: (..., V) logits of the same tokens (any leading shape, the same for both).
        temperature: T > 0.

    Raises:
        ValueError: the shapes differ (e.g. another vocabulary).
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"Student logits {tuple(student_logits.shape)} and teacher logits {tuple(teacher_logits.shape)} differ: "
            "distillation needs the same tokens and vocabulary."
        )
    vocab = student_logits.shape[-1]
    student = F.log_softmax(student_logits.float().reshape(-1, vocab) / temperature, dim=-1)
    teacher = F.log_softmax(teacher_logits.float().reshape(-1, vocab) / temperature, dim=-1)
    return F.kl_div(student, teacher, log_target=True, reduction="batchmean") * temperature**2


def load_teacher(config: DistillConfig, student, device, trust_remote_code: bool = False):
    """The frozen teacher (eval mode, no gradient, on `device`), or None without `config.teacher`.

    Raises:
        ValueError: the teacher cannot be loaded, or its `vocab_size` differs from the student's (the message names
            `distill.teacher`).
    """
    if not config.teacher:
        return None
    from transformers import AutoModelForCausalLM

    import hf_mohd  # noqa: F401  (registers the model types)

    kwargs = {"gguf_file": config.teacher_gguf_file} if config.teacher_gguf_file else {}
    try:
        teacher = AutoModelForCausalLM.from_pretrained(
            config.teacher, dtype=torch.float32, trust_remote_code=trust_remote_code, **kwargs
        )
    except (OSError, ValueError) as error:
        raise TrainConfigError(
            f"`distill.teacher` {config.teacher!r} cannot be loaded as a causal LM: {error}"
        ) from error
    if teacher.config.vocab_size != student.config.vocab_size:
        raise TrainConfigError(
            f"`distill.teacher` {config.teacher!r} has vocab_size {teacher.config.vocab_size}, the student "
            f"{student.config.vocab_size}: distillation needs the same tokenizer."
        )
    teacher.requires_grad_(False)
    return teacher.eval().to(device)


def select_trainable(model, config: ModelConfig):
    """Apply `model.trainable`: "all" (unchanged), "routers_norms" (only the parameters of MoHD / LatentMoE routers,
    MoHD group fusion and the RMSNorm / LayerNorm modules train) or "lora" (PEFT LoRA adapters on
    `LORA_TARGET_MODULES`; returns the `PeftModel`).

    Raises:
        ValueError: "routers_norms" on a model without such parameters; "lora" without the `peft` package.
    """
    if config.trainable == "all":
        return model
    if config.trainable == "routers_norms":
        from ..models.modeling_latent_moe import LatentMoERouter
        from ..models.modeling_mohd import MoHDGroupFusion, MoHDRouter

        model.requires_grad_(False)
        chosen = 0
        for module in model.modules():
            norm = type(module).__name__.endswith(("RMSNorm", "LayerNorm"))
            if norm or isinstance(module, (MoHDRouter, MoHDGroupFusion, LatentMoERouter)):
                for param in module.parameters(recurse=False):
                    param.requires_grad_(True)
                    chosen += 1
        if not chosen:
            raise TrainConfigError(
                "`model.trainable: routers_norms`: the model has no router, group fusion or norm weights."
            )
        return model
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as error:
        raise TrainConfigError("`model.trainable: lora` needs PEFT: pip install 'hf-mohd[peft]'.") from error
    lora = LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha, target_modules=LORA_TARGET_MODULES)
    return get_peft_model(model, lora)


__all__ = ["LORA_TARGET_MODULES", "distillation_loss", "load_teacher", "select_trainable"]
