"""Accelerate training of causal LMs (MoHD, LatentMoE, Llama, ...): config, data, the loop. See `hf-mohd train`."""

from .config import (
    DataConfig,
    DistillConfig,
    ModelConfig,
    OptimConfig,
    TrainConfig,
    TrainConfigError,
    load_train_config,
    train_config_from_dict,
)
from .distill import distillation_loss, select_trainable
from .trainer import ModelSupport, TrainResult, evaluate_perplexity, exit_process, latest_checkpoint, train


__all__ = [
    "DataConfig",
    "DistillConfig",
    "distillation_loss",
    "select_trainable",
    "ModelConfig",
    "ModelSupport",
    "OptimConfig",
    "TrainConfig",
    "TrainConfigError",
    "TrainResult",
    "evaluate_perplexity",
    "exit_process",
    "latest_checkpoint",
    "load_train_config",
    "train",
    "train_config_from_dict",
]
