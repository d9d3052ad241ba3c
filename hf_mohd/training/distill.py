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


def student_objective(
    outputs, teacher_logits, config: DistillConfig, aux_coef: float, teacher_hidden=None, basis=None
):
    """The loss one student forward contributes: `kl_weight` * KL to the teacher + `lm_weight` * LM loss + the
    router aux loss (`outputs.loss` alone without a teacher, `teacher_logits` None), + `hidden_weight` * the
    intermediate term (`hidden_distillation_loss` of `outputs.hidden_states` against `teacher_hidden` in `basis`)
    when `hidden_weight` > 0.

    Returns:
        (objective, kd): the scalar to differentiate and the detached distillation KL (0.0 without a teacher).
    """
    if teacher_logits is None:
        return outputs.loss, 0.0
    kd = distillation_loss(outputs.logits, teacher_logits, config.temperature)
    aux_part = aux_coef * outputs.aux_loss if getattr(outputs, "aux_loss", None) is not None else 0.0
    lm_part = outputs.loss - aux_part
    objective = config.kl_weight * kd + config.lm_weight * lm_part + aux_part
    if config.hidden_weight > 0:
        objective = objective + config.hidden_weight * hidden_distillation_loss(
            outputs.hidden_states, teacher_hidden, basis
        )
    return objective, kd.detach().item()


def hidden_basis(teacher, student) -> torch.Tensor:
    """Q (D, D), float64, with E_student = E_teacher Q: the change of basis from the teacher's residual stream to the
    student's, from their input embeddings by least squares (exact for a conversion that copies or rotates the
    embedding: the identity, a channel permutation, or `--rotate pca`'s orthogonal Q).

    Raises:
        TrainConfigError: the embeddings differ in shape, or E_teacher Q misses E_student by more than 1e-4 of its
            norm (the student's residual stream is not a change of basis of the teacher's).
    """
    source = teacher.get_input_embeddings().weight.detach().double().cpu()
    target = student.get_input_embeddings().weight.detach().double().cpu()
    if source.shape != target.shape:
        raise TrainConfigError(
            f"`distill.hidden_weight` compares residual streams: the teacher's embedding is {tuple(source.shape)}, "
            f"the student's {tuple(target.shape)}."
        )
    basis = torch.linalg.lstsq(source, target).solution
    miss = ((source @ basis - target).norm() / target.norm().clamp_min(1e-30)).item()
    if miss > 1e-4:
        raise TrainConfigError(
            f"`distill.hidden_weight`: the student's embedding is not a change of basis of the teacher's (relative "
            f"miss {miss:.2e}), so their residual streams cannot be compared."
        )
    return basis


def hidden_distillation_loss(student_hidden, teacher_hidden, basis: torch.Tensor) -> torch.Tensor:
    """Mean over the decoder layers but the last of ||h_s - h_t Q||^2 / ||h_t Q||^2, each sum over the layer's
    tokens and width (fp32 or wider): elements 1 .. L - 1 of the two `hidden_states` tuples (element 0 is the
    embedding, the same by construction; the last layer is what the logits' KL sees).

    Args:
        student_hidden, teacher_hidden: tuples of L + 1 (B, T, D) tensors (`output_hidden_states=True`).
        basis: Q (D, D) from `hidden_basis`.

    Raises:
        ValueError: the tuples differ in length (another depth).
    """
    if len(student_hidden) != len(teacher_hidden):
        raise ValueError(
            f"`distill.hidden_weight`: the student has {len(student_hidden) - 1} layers, the teacher "
            f"{len(teacher_hidden) - 1}."
        )
    losses = []
    for student, teacher in zip(student_hidden[1:-1], teacher_hidden[1:-1], strict=True):
        dtype = torch.promote_types(student.dtype, torch.float32)
        target = teacher.to(dtype) @ basis.to(device=teacher.device, dtype=dtype)
        losses.append((student.to(dtype) - target).pow(2).sum() / target.pow(2).sum().clamp_min(1e-30))
    return torch.stack(losses).mean()


def nested_healing(config: DistillConfig) -> bool:
    """Whether `config` asks for training at other activations than the model's own k (nested set or schedule)."""
    return bool(config.active_sub_dims) or config.random_active_weight > 0 or config.schedule_fraction > 0


def scheduled_active_sub_dims(config: DistillConfig, step: int, max_steps: int, target: int, full: int) -> int:
    """The gradual schedule's k at `step` (0-based): from `full` (N_r) at step 0 to `target` at step
    T = `schedule_fraction` * `max_steps` and after, k = round(target + (full - target) * (1 - step / T)^p), p = 1
    ("linear") or 3 ("cubic", Zhu and Gupta arXiv 1710.01878, eq. 1); `target` when the schedule is off."""
    horizon = config.schedule_fraction * max_steps
    if step >= horizon:
        return target
    power = 3 if config.schedule_curve == "cubic" else 1
    return round(target + (full - target) * (1 - step / horizon) ** power)


def step_activations(
    config: DistillConfig, step: int, max_steps: int, target: int, full: int, seed: int
) -> list[tuple[int, float]]:
    """The (k, weight) pairs a nested-healing step trains at, the scheduled target first (`DistillConfig`):
    `active_sub_dims` with `active_weights` (the model's own k alone when empty), the target replaced by the
    schedule's k (`scheduled_active_sub_dims`), plus one k drawn strictly between the set's extremes with weight
    `random_active_weight` (torch generator seeded by `seed` and `step`: a resumed run draws the same); equal ks merge
    by adding their weights.

    Args:
        step: 0-based optimizer step; max_steps: the run's; target: the model's k (its config's); full: N_r.

    Raises:
        ValueError: a k outside [1, full], or a schedule with an `active_sub_dims` that lacks the target (the message
            names the field and the model's k).
    """
    ks = list(config.active_sub_dims) or [target]
    weights = list(config.active_weights) or [1.0] * len(ks)
    bad = [k for k in ks if not 1 <= k <= full]
    if bad:
        raise TrainConfigError(
            f"`distill.active_sub_dims` {ks}: each k must be in [1, {full}] (the model's routed sub-dimensions)."
        )
    if config.schedule_fraction > 0 and target not in ks:
        raise TrainConfigError(
            f"`distill.schedule_fraction` moves the model's own k ({target}) from {full} to {target}, but "
            f"`distill.active_sub_dims` {ks} does not hold it."
        )
    scheduled = scheduled_active_sub_dims(config, step, max_steps, target, full)
    pairs = [(scheduled if k == target else k, w) for k, w in zip(ks, weights, strict=True)]
    low, high = min(ks), max(ks)
    if config.random_active_weight > 0 and high - low >= 2:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
        drawn = int(torch.randint(low + 1, high, (1,), generator=generator))
        pairs.append((drawn, config.random_active_weight))
    merged: dict[int, float] = {}
    for k, weight in sorted(pairs, key=lambda pair: pair[0] != scheduled):  # the scheduled k first
        merged[k] = merged.get(k, 0.0) + weight
    return list(merged.items())


def nested_backward(model, activations, forward, objective_of, backward, own_k: int | None = None):
    """One micro-batch of nested healing: for each (k, weight) of `activations`, `model.set_active_sub_dims(k)`, a
    forward, and `backward(weight * objective)`; so the gradients accumulate to those of the weighted sum of the
    separate losses, with one forward's activations alive at a time. `model` is left at the first k.

    Args:
        model: the (unwrapped) MoHD model; forward: () -> outputs; objective_of: outputs -> (objective, kd) as
            `student_objective`; backward: scalar -> None (e.g. `accelerator.backward` with the accumulation scale).
        own_k: the k that stands for the model's own activation (its config's `num_routed_sub_dims_per_tok`): at
            that k each sublayer runs at its configured k (`set_active_sub_dims(None)`), per-layer budgets included.

    Returns:
        (outputs of the first k, weighted sum of the kds).
    """
    first, kd_total = None, 0.0
    for k, weight in reversed(activations):  # the first k last, so that the model stays there
        model.set_active_sub_dims(None if k == own_k else k)
        outputs = forward()
        objective, kd = objective_of(outputs)
        backward(weight * objective)
        kd_total += weight * kd
        first = outputs
    return first, kd_total


def select_trainable(model, config: ModelConfig):
    """Apply `model.trainable`: "all" (unchanged), "ffn" (only the feed-forward sublayers, every `model.layers[i].mlp`
    with its experts, shared expert, latent projections and router, train; attention, norms and embeddings stay as
    they are), "routers_norms" (only the parameters of MoHD / LatentMoE routers, MoHD group fusion and the RMSNorm /
    LayerNorm modules train) or "lora" (PEFT LoRA adapters on `LORA_TARGET_MODULES`; returns the `PeftModel`).

    Raises:
        ValueError: "ffn" or "routers_norms" on a model without such parameters; "lora" without the `peft` package.
    """
    if config.trainable == "all":
        return model
    if config.trainable == "ffn":
        layers = getattr(getattr(model, "model", model), "layers", ())
        blocks = [layer.mlp for layer in layers if isinstance(getattr(layer, "mlp", None), torch.nn.Module)]
        if not blocks:
            raise TrainConfigError("`model.trainable: ffn`: the model has no `model.layers[i].mlp` modules.")
        model.requires_grad_(False)
        for block in blocks:
            block.requires_grad_(True)
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


__all__ = [
    "LORA_TARGET_MODULES",
    "distillation_loss",
    "load_teacher",
    "nested_backward",
    "nested_healing",
    "scheduled_active_sub_dims",
    "select_trainable",
    "step_activations",
    "student_objective",
]
