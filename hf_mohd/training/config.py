"""Training configuration: small dataclasses whose every field has a default and a documented meaning.

A run is described by one `TrainConfig` (sections `model`, `data`, `optim`, plus run-level fields). It is read from
YAML or JSON with `load_train_config(path)`; unknown keys and wrong types raise `ValueError` naming the field and the
file, so a typo never silently falls back to a default.
"""

import dataclasses
import difflib
import json
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any


class TrainConfigError(ValueError):
    """A training run that cannot start as configured, found before its first step (a data path that matches no
    file, an architecture field its config class does not have, a run folder trained with another model). The message
    names the field and what was expected; `hf-mohd train` prints it as one line, with the exit status of `kind` (a
    key of `hf_mohd.commands.EXIT_STATUS`: "config", the default, "missing", "wrong_type" or "damaged")."""

    def __init__(self, message: str, kind: str = "config"):
        super().__init__(message)
        self.kind = kind


def architecture_config(architecture: dict, **extra):
    """The model config of `model.architecture` (its `model_type` and fields, updated by `extra`).

    Raises:
        TrainConfigError: the config class rejects a field or a value.
    """
    from transformers import AutoConfig

    import hf_mohd  # noqa: F401  (registers the model types with the Auto classes)

    fields = {k: v for k, v in architecture.items() if k != "model_type"} | extra
    model_type = architecture["model_type"]
    try:
        return AutoConfig.for_model(model_type, **fields)
    except (ValueError, TypeError) as error:
        raise TrainConfigError(f"`model.architecture` (model_type {model_type!r}) is invalid: {error}") from None


def check_architecture(architecture: dict) -> None:
    """Builds the model config of `model.architecture` once, before any data is read.

    Raises:
        TrainConfigError: `model_type` is not a registered model type (with the closest names), a key is not a field
            of its config class (a typo would otherwise be stored as an extra attribute and the default used), or
            the config class rejects a value.
    """
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    import hf_mohd  # noqa: F401  (registers the model types with the Auto classes)

    fields = {k: v for k, v in architecture.items() if k != "model_type"}
    model_type = architecture["model_type"]
    if model_type not in CONFIG_MAPPING:
        close = difflib.get_close_matches(str(model_type), list(CONFIG_MAPPING.keys()), n=3)
        raise TrainConfigError(
            f"`model.architecture.model_type` {model_type!r} is not a registered model type"
            + (f"; did you mean {close}?" if close else " (e.g. 'mohd', 'latent_moe', 'llama').")
        )
    built = architecture_config(architecture).to_dict()
    config_class = CONFIG_MAPPING[model_type]
    # `per_layer_config` is a field of every config (transformers' `PreTrainedConfig.__init__`, heterogeneous
    # layers) that a default instance does not serialise
    known = set(config_class().to_dict()) | {"per_layer_config"}
    # a key the class does not consume stays as an extra attribute of the built config
    unknown = sorted(k for k in fields if k in built and k not in known)
    if unknown:
        hints = {k: difflib.get_close_matches(k, sorted(known), n=1) for k in unknown}
        listed = ", ".join(
            f"`model.architecture.{k}`" + (f" (did you mean {h[0]!r}?)" if h else "") for k, h in hints.items()
        )
        raise TrainConfigError(f"{listed}: not a field of {config_class.__name__} ({model_type!r}).")


@dataclass
class ModelConfig:
    """What to train.

    Attributes:
        init_from: folder or Hub id of a pretrained causal LM (continued training, or a converted checkpoint such as
            the output of `hf_mohd` conversion). Empty: build a fresh model from `architecture`.
        gguf_file: name of a GGUF file inside `init_from` (transformers dequantises it), or empty.
        architecture: for a model trained from scratch, the keyword arguments of its config; must contain
            `model_type` ("mohd", "latent_moe", "llama", or any type `AutoConfig` knows). `vocab_size`, `bos_token_id`,
            `eos_token_id` and `pad_token_id` are filled in from the tokenizer.
        tokenizer: folder or Hub id of a tokenizer. Empty: the tokenizer of `init_from`, or, from scratch, a byte-level
            BPE tokenizer trained on the training split (docs/design.md section 7, last item) and saved with the model.
        tokenizer_vocab_size: vocabulary size (tokens) of that trained BPE tokenizer.
        trust_remote_code: passed to `from_pretrained` (models saved elsewhere with `auto_map`).
        trainable: which parameters train: "all"; "ffn" (every decoder layer's feed-forward sublayer `mlp`: a
            carved model's experts, shared expert and routers; attention, norms and embeddings frozen);
            "routers_norms" (MoHD / LatentMoE routers, MoHD group fusion and
            every norm weight; the rest frozen); or "lora" (LoRA adapters through PEFT on q/k/v/o and gate/up/down,
            rank `lora_rank`, scale `lora_alpha` / rank, the base weights frozen; `final/` then holds the adapter,
            loadable with `peft.PeftModel.from_pretrained(base, folder)`).
        lora_rank, lora_alpha: LoRA rank r and alpha (only with `trainable: lora`).
        experts_implementation: the experts kernel of a mixture-of-experts model while it trains (`from_pretrained`'s
            `experts_implementation`: "eager", "grouped_mm", "batched_mm", "dense_masked", or one registered with
            transformers' `ExpertsInterface`); empty: the model's default. "dense_masked" is the fast one for many
            experts per token (a carved model), where the grouped kernel copies every token once per picked expert.
        sparse_implementation: the MoHD execution strategy while it trains ("gather" or "masked", as
            `MoHDForCausalLM.set_sparse_implementation`); empty: the model's own. Both compute the same function and
            gradients; "masked" (every block computed, then masked) runs a training step of a few thousand tokens with
            fewer, larger products. The saved model keeps its config's strategy. Only for MoHD models.
    """

    init_from: str = ""
    gguf_file: str = ""
    architecture: dict[str, Any] = field(default_factory=dict)
    tokenizer: str = ""
    tokenizer_vocab_size: int = 4096
    trust_remote_code: bool = False
    trainable: str = "all"
    lora_rank: int = 8
    lora_alpha: float = 16.0
    experts_implementation: str = ""
    sparse_implementation: str = ""


TRAINABLE_CHOICES = ("all", "ffn", "routers_norms", "lora")


@dataclass
class DistillConfig:
    """Healing by distillation: train the model towards a teacher's next-token distributions (Hinton et al. 2015,
    arXiv 1503.02531), e.g. a converted MoHD model towards the dense LLaMA it came from.

    The loss per token is `kl_weight` * T^2 * KL(softmax(teacher / T) || softmax(student / T)) + `lm_weight` * the
    LM cross-entropy (+ the router aux loss, as without distillation). The teacher runs in eval mode without
    gradient on the same micro-batch; its logits are never written to disk. The teacher and the student must share
    the vocabulary (checked: `vocab_size`).

    Attributes:
        teacher: folder of the teacher causal LM (or a folder holding `teacher_gguf_file`). Empty: no distillation.
        teacher_gguf_file: name of a GGUF file inside `teacher`, or empty.
        kl_weight: weight of the distillation term (>= 0).
        temperature: T (> 0) of both softmaxes; the term is scaled by T^2 so its gradient does not shrink with T.
        lm_weight: weight of the LM cross-entropy on the data (>= 0; 0: distillation only).
        active_sub_dims: nested healing of a MoHD student (MatFormer arXiv 2310.07707, DynaBERT arXiv 2004.04037):
            the routed sub-dimensions per token k at which the same weights are trained in every step, the loss
            summed over them (e.g. [2, 10]: the target and, for N_r = 10, full activation, which keeps the dense
            function of an exact conversion). Empty: the model's own k alone. Each k in [1, N_r] (checked at load).
            The model's own k is its config's `num_routed_sub_dims_per_tok`; a student with per-layer budgets
            (`per_layer_config`) runs each sublayer at its own k there, and every other k of the set (or of the
            schedule) applies to all sublayers alike.
        active_weights: the weight of each k's loss (one per `active_sub_dims` entry, > 0); empty: 1 each.
        random_active_weight: > 0 adds, in each step, one more k drawn uniformly strictly between the smallest and the
            largest of `active_sub_dims` (when there is such an integer), with this weight; seeded by `seed` and the
            step, so a resumed run draws the same ks.
        schedule_fraction: gradual schedule (Zhu and Gupta, arXiv 1710.01878): over this share of `max_steps` (in
            [0, 1]; 0: off) the model's target k starts at full activation N_r and falls to the target, in place of
            the target in `active_sub_dims` (or alone). k at step t < T = fraction * max_steps is
            round(k_target + (N_r - k_target) * (1 - t / T)^p), p = 1 ("linear") or 3 ("cubic"); computed from the
            step, so it resumes mid-schedule. The k of every step is logged as `active_sub_dims`.
        schedule_curve: "linear" or "cubic" (fast at first, slow near the target, as Zhu and Gupta's sparsity ramp).
        hidden_weight: weight (>= 0; 0: off) of intermediate distillation: the mean over the decoder layers but the
            last of ||h_s - h_t Q||^2 / ||h_t Q||^2 (each over the layer's tokens), h the residual stream after the
            layer, Q the change of basis from the teacher's residual stream to the student's, recovered from the
            embeddings (E_student = E_teacher Q, least squares; the identity for an unrotated conversion, the PCA
            rotation of `--rotate pca`). Needs a teacher of the student's width.
    """

    teacher: str = ""
    teacher_gguf_file: str = ""
    kl_weight: float = 1.0
    temperature: float = 1.0
    lm_weight: float = 0.0
    active_sub_dims: list[int] = field(default_factory=list)
    active_weights: list[float] = field(default_factory=list)
    random_active_weight: float = 0.0
    schedule_fraction: float = 0.0
    schedule_curve: str = "linear"
    hidden_weight: float = 0.0


@dataclass
class DataConfig:
    """Where the text comes from and how it is cut.

    Attributes:
        path: a `datasets` Hub id (online), or a local file, folder or glob of .txt / .json / .jsonl / .parquet files
            (offline). A folder saved with `Dataset.save_to_disk` also works.
        name: dataset configuration name for Hub datasets (e.g. "wikitext-2-raw-v1"), or empty.
        split: split to read ("train"); the held-out split is cut from it (see `eval_fraction`).
        text_field: column holding the text (plain .txt files give "text").
        eval_fraction: fraction of documents (0 <= f < 1) held out for evaluation perplexity, chosen by `seed`.
        max_documents: read at most this many documents (0: all); for quick runs.
        seq_len: tokens per packed training sequence. Documents are tokenised, joined with the EOS token and cut into
            blocks of exactly `seq_len` tokens (the remainder is dropped), so no token is padding.
        num_workers: DataLoader worker processes (0: load in the training process).
    """

    path: str = ""
    name: str = ""
    split: str = "train"
    text_field: str = "text"
    eval_fraction: float = 0.05
    max_documents: int = 0
    seq_len: int = 256
    num_workers: int = 0


@dataclass
class OptimConfig:
    """AdamW with linear warmup and cosine decay (as in the LLaMA recipe).

    Attributes:
        lr: peak learning rate, reached after `warmup_steps` optimizer steps.
        min_lr_ratio: the cosine decays to `lr * min_lr_ratio` at `max_steps`.
        warmup_steps: optimizer steps of linear warmup from 0.
        weight_decay: decoupled weight decay of AdamW, applied to matrices only (not to norms, biases, router biases).
        beta1, beta2, eps: AdamW moments and epsilon.
        grad_clip: maximum global L2 norm of the gradients (0: no clipping).
    """

    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0


@dataclass
class TrainConfig:
    """One training run.

    Attributes:
        output_dir: run folder: `checkpoints/step_<n>/` (Accelerate `save_state`), `final/` (model + tokenizer,
            loadable with `AutoModelForCausalLM`), `log.jsonl`, `tensorboard/`, `train_config.json`.
        model, data, optim, distill: see `ModelConfig`, `DataConfig`, `OptimConfig`, `DistillConfig`.
        max_steps: optimizer steps to run.
        micro_batch_size: sequences per process per forward pass.
        grad_accum_steps: forward/backward passes per optimizer step (the batch is micro_batch_size x grad_accum_steps
            x processes sequences of `data.seq_len` tokens).
        mixed_precision: "auto" (bf16 autocast when the accelerator supports bf16, else fp32), "bf16", or "no".
        router_aux_loss: ask models that have a router load-balance loss for it (`output_router_logits=True`); the
            model adds `router_aux_loss_coef * aux` to its loss. Models without routers ignore it.
        seed: seed of weights, data order and held-out split.
        log_every: optimizer steps between log records (JSONL, TensorBoard, progress bar).
        eval_every: optimizer steps between held-out perplexity evaluations (0: only at the end).
        eval_batches: held-out micro-batches per periodic evaluation (0: all); the final one always uses all.
        save_every: optimizer steps between checkpoints (0: only at the end).
        keep_checkpoints: most recent checkpoints kept on disk (older ones are deleted).
        resume: "auto" resumes from the newest complete checkpoint in `output_dir` if there is one, "never" starts
            afresh, any other value is a checkpoint folder to resume from.
        stop_after_steps: stop (after saving a checkpoint) once this many optimizer steps have run in this process
            call, without finishing the run (0: run to `max_steps`); used to test interruption and for time slicing.
        progress_bar: show a tqdm bar with loss and tokens/s on the main process.
        save_final: write `final/` with `save_pretrained` at the end.
    """

    output_dir: str = "runs/default"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    max_steps: int = 200
    micro_batch_size: int = 8
    grad_accum_steps: int = 1
    mixed_precision: str = "auto"
    router_aux_loss: bool = True
    seed: int = 0
    log_every: int = 10
    eval_every: int = 0
    eval_batches: int = 0
    save_every: int = 100
    keep_checkpoints: int = 2
    resume: str = "auto"
    stop_after_steps: int = 0
    progress_bar: bool = True
    save_final: bool = True

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Range checks; each `ValueError` names the field."""
        positive = {
            "max_steps": self.max_steps,
            "micro_batch_size": self.micro_batch_size,
            "grad_accum_steps": self.grad_accum_steps,
            "log_every": self.log_every,
            "keep_checkpoints": self.keep_checkpoints,
            "data.seq_len": self.data.seq_len,
            "model.tokenizer_vocab_size": self.model.tokenizer_vocab_size,
        }
        for name, value in positive.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
        for name in ("eval_every", "eval_batches", "save_every", "stop_after_steps", "optim.warmup_steps"):
            value = _get(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"`{name}` must be an integer >= 0, got {value!r}.")
        if not 0 <= self.data.eval_fraction < 1:
            raise ValueError(f"`data.eval_fraction` must be in [0, 1), got {self.data.eval_fraction}.")
        if self.mixed_precision not in ("auto", "bf16", "no"):
            raise ValueError(f"`mixed_precision` must be one of ['auto', 'bf16', 'no'], got {self.mixed_precision!r}.")
        if self.optim.lr <= 0 or not 0 <= self.optim.min_lr_ratio <= 1:
            raise ValueError(
                f"`optim.lr` must be > 0 and `optim.min_lr_ratio` in [0, 1], got {self.optim.lr}, "
                f"{self.optim.min_lr_ratio}."
            )
        if not self.model.init_from and "model_type" not in self.model.architecture:
            raise ValueError(
                "Set either `model.init_from` (a pretrained folder or Hub id) or `model.architecture` with a "
                "`model_type` (e.g. {model_type: llama, hidden_size: 128, ...})."
            )
        if not self.model.init_from:
            check_architecture(self.model.architecture)
        if self.model.trainable not in TRAINABLE_CHOICES:
            raise ValueError(
                f"`model.trainable` must be one of {list(TRAINABLE_CHOICES)}, got {self.model.trainable!r}."
            )
        if self.model.experts_implementation:
            from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

            from ..models import modeling_latent_moe  # noqa: F401  (registers "dense_masked")

            known = ["eager", *ALL_EXPERTS_FUNCTIONS.keys()]
            if self.model.experts_implementation not in known:
                raise ValueError(
                    f"`model.experts_implementation` must be empty or one of {known}, got "
                    f"{self.model.experts_implementation!r}."
                )
        if self.model.sparse_implementation:
            from ..models.mohd_strategies import ALL_SPARSE_IMPLEMENTATIONS

            if self.model.sparse_implementation not in ALL_SPARSE_IMPLEMENTATIONS:
                raise ValueError(
                    f"`model.sparse_implementation` must be empty or one of {list(ALL_SPARSE_IMPLEMENTATIONS)}, got "
                    f"{self.model.sparse_implementation!r}."
                )
        if not isinstance(self.model.lora_rank, int) or self.model.lora_rank < 1 or self.model.lora_alpha <= 0:
            raise ValueError(
                f"`model.lora_rank` must be a positive integer and `model.lora_alpha` > 0, got "
                f"{self.model.lora_rank!r}, {self.model.lora_alpha!r}."
            )
        distill = self.distill
        if distill.temperature <= 0 or distill.kl_weight < 0 or distill.lm_weight < 0:
            raise ValueError(
                f"`distill.temperature` must be > 0 and `distill.kl_weight`, `distill.lm_weight` >= 0, got "
                f"{distill.temperature}, {distill.kl_weight}, {distill.lm_weight}."
            )
        if distill.teacher and distill.kl_weight == 0 and distill.lm_weight == 0:
            raise ValueError("`distill.kl_weight` and `distill.lm_weight` are both 0: nothing to train on.")
        if not isinstance(distill.active_sub_dims, list) or any(
            isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in distill.active_sub_dims
        ):
            raise ValueError(
                f"`distill.active_sub_dims` must be a list of ints >= 1, got {distill.active_sub_dims!r}."
            )
        weights = distill.active_weights
        if weights and (len(weights) != len(distill.active_sub_dims) or any(w <= 0 for w in weights)):
            raise ValueError(
                f"`distill.active_weights` must hold one weight > 0 per `distill.active_sub_dims` entry "
                f"({len(distill.active_sub_dims)}), got {weights!r}."
            )
        if distill.random_active_weight < 0 or not 0 <= distill.schedule_fraction <= 1:
            raise ValueError(
                f"`distill.random_active_weight` must be >= 0 and `distill.schedule_fraction` in [0, 1], got "
                f"{distill.random_active_weight}, {distill.schedule_fraction}."
            )
        if not distill.hidden_weight >= 0 or (distill.hidden_weight > 0 and not distill.teacher):
            raise ValueError(
                f"`distill.hidden_weight` must be >= 0 and needs `distill.teacher`, got {distill.hidden_weight} with "
                f"teacher {distill.teacher!r}."
            )
        if distill.schedule_curve not in ("linear", "cubic"):
            raise ValueError(f"`distill.schedule_curve` must be 'linear' or 'cubic', got {distill.schedule_curve!r}.")
        if not self.data.path:
            raise ValueError("`data.path` is empty: give a Hub dataset id or local text/JSON/parquet files.")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _get(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _build(cls, values: dict, where: str, source: str):
    """Instantiate dataclass `cls` from a mapping, checking keys and scalar types; errors name `where` and `source`."""
    if not isinstance(values, dict):
        raise ValueError(f"{source}: `{where or 'top level'}` must be a mapping, got {type(values).__name__}.")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        prefix = f"{where}." if where else ""
        raise ValueError(f"{source}: unknown field(s) {[prefix + k for k in unknown]}; known: {sorted(names)}.")
    kwargs = {}
    for key, value in values.items():
        name = f"{where}.{key}" if where else key
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = _build(hint, value, name, source)
            continue
        base = typing.get_origin(hint) or hint
        if isinstance(base, type) and base is not types.NoneType:
            ok = isinstance(value, base) and not (base in (int, float) and isinstance(value, bool))
            if base is float and isinstance(value, int) and not isinstance(value, bool):
                value, ok = float(value), True
            if base is float and isinstance(value, str):  # YAML 1.1 reads `1e-3` (no dot) as a string
                try:
                    value, ok = float(value), True
                except ValueError:
                    pass
            if not ok:
                raise ValueError(f"{source}: `{name}` must be {base.__name__}, got {value!r}.")
        kwargs[key] = value
    return cls(**kwargs)


def train_config_from_dict(values: dict, source: str = "<dict>") -> TrainConfig:
    """Build a `TrainConfig` from nested plain values (as read from YAML/JSON)."""
    try:
        return _build(TrainConfig, values, "", source)
    except ValueError as error:
        message = str(error)
        raise ValueError(message if message.startswith(source) else f"{source}: {message}") from None


def load_train_config(path: str | os.PathLike) -> TrainConfig:
    """Read a `TrainConfig` from a .yaml/.yml or .json file.

    Raises:
        FileNotFoundError: no such file.
        TrainConfigError: (kind "damaged") a file that is not UTF-8, holds no text or does not parse.
        ValueError: unknown field, wrong type or out-of-range value (the message names the field).
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Training config {path!r} does not exist.")
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except UnicodeDecodeError as error:
        raise TrainConfigError(f"{path}: cannot read it as UTF-8 text ({error}).", "damaged") from error
    if not text.strip():
        raise TrainConfigError(f"{path}: holds no text; expected YAML or JSON training fields.", "damaged")
    try:
        if path.endswith((".yaml", ".yml")):
            import yaml

            values = yaml.safe_load(text) or {}
        else:
            values = json.loads(text)
    except Exception as error:
        raise TrainConfigError(f"{path}: cannot parse ({error}).", "damaged") from error
    return train_config_from_dict(values, source=path)
