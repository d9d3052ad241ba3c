"""A small Accelerate training loop for any causal LM (MoHD, LatentMoE, Llama, ...), resumable to the same loss curve.

`train(config)` reads top to bottom: data -> tokenizer -> model -> optimizer and schedule -> resume -> loop. The
extras live in small helpers around the loop (checkpoints, logs, evaluation), so the loop itself stays short.

Resumption is exact: a checkpoint (Accelerate `save_state`) holds the model, the AdamW moments, the schedule, the RNG
states of every process and the data position (epoch, micro-step); the data order is a function of (seed, epoch)
only. A checkpoint is written to a temporary folder and renamed when complete, so an interruption at any moment
leaves the previous checkpoint intact, and resuming from it replays exactly the steps that were lost.
"""

import ast
import dataclasses
import functools
import json
import logging
import math
import os
import pickle
import re
import shutil
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import NoReturn

import torch
from torch.optim.lr_scheduler import LambdaLR

from ..atomic_folder import move_folder_into_place, write_folder_atomically
from ..evaluation.perplexity import evaluate_perplexity
from ..log_filters import filtered_loggers
from .config import TrainConfig, TrainConfigError, architecture_config
from .data import PackedBatches, load_documents, pack, split_documents, train_bpe_tokenizer
from .distill import (
    hidden_basis,
    load_teacher,
    nested_backward,
    nested_healing,
    select_trainable,
    step_activations,
    student_objective,
)


CHECKPOINT_PATTERN = re.compile(r"^step_(\d+)$")


@dataclass
class TrainerState:
    """Counters saved with every checkpoint (through `Accelerator.register_for_checkpointing`).

    Attributes:
        step: optimizer steps done.
        epoch, index: data position: the next micro-batch is micro-step `index` of epoch `epoch`.
        tokens: training tokens consumed, all processes together.
        window_loss, window_aux, window_steps: sums over the optimizer steps since the last log record (this
            process), so that a run resumed between two records logs the same averages.
    """

    step: int = 0
    epoch: int = 0
    index: int = 0
    tokens: int = 0
    window_loss: float = 0.0
    window_aux: float = 0.0
    window_steps: int = 0

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


@dataclass
class TrainResult:
    """What a run produced. Losses are mean cross-entropy in nats per token; perplexity is exp(loss)."""

    output_dir: str
    final_model_dir: str | None
    steps: int
    tokens: int
    seconds: float
    num_parameters: int
    train_log: list[dict] = field(default_factory=list)
    eval_loss: float | None = None
    eval_perplexity: float | None = None
    model: torch.nn.Module | None = field(default=None, repr=False)  # the trained model, unwrapped, in memory


def warmup_cosine(warmup_steps: int, max_steps: int, min_ratio: float):
    """LR multiplier: linear 0 -> 1 over `warmup_steps`, then cosine 1 -> `min_ratio` at `max_steps`."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: weight decay on matrices and 3-D expert weights; none on norms, biases and 1-D tensors."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def resolve_mixed_precision(setting: str) -> str:
    """'auto' -> 'bf16' on a CUDA device with bf16 support, else 'no' (fp32; this project's CPUs lack bf16)."""
    if setting != "auto":
        return setting
    return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"


def latest_checkpoint(output_dir: str) -> str | None:
    """The newest complete checkpoint folder `output_dir/checkpoints/step_<n>`, or None."""
    root = os.path.join(output_dir, "checkpoints")
    if not os.path.isdir(root):
        return None
    steps = [(int(m.group(1)), name) for name in os.listdir(root) if (m := CHECKPOINT_PATTERN.match(name))]
    return os.path.join(root, max(steps)[1]) if steps else None


def prepare_tokenizer(config: TrainConfig, train_texts: list[str]):
    """The run's tokenizer: `model.tokenizer`, else the one of `model.init_from`, else BPE trained on the corpus.

    A trained tokenizer is saved in `output_dir/tokenizer` at once, so that a resumed run reuses it.
    """
    from transformers import AutoTokenizer

    saved = os.path.join(config.output_dir, "tokenizer")
    source = config.model.tokenizer or config.model.init_from
    if os.path.isdir(saved):
        return AutoTokenizer.from_pretrained(saved)
    if source:
        kwargs = {"gguf_file": config.model.gguf_file} if config.model.gguf_file and not config.model.tokenizer else {}
        if not kwargs:
            _check_tokenizer_folder(source, "model.tokenizer" if config.model.tokenizer else "model.init_from")
        return AutoTokenizer.from_pretrained(source, trust_remote_code=config.model.trust_remote_code, **kwargs)
    return train_bpe_tokenizer(train_texts, config.model.tokenizer_vocab_size)


def _check_tokenizer_folder(source: str, field: str) -> None:
    """A local tokenizer source must exist and hold tokenizer files (Hub ids are left to `from_pretrained`)."""
    from ..evaluation.harness import TOKENIZER_FILES

    path = os.path.expanduser(source)
    if not os.path.exists(path) and (os.path.isabs(path) or source.startswith((".", "~"))):
        raise TrainConfigError(
            f"`{field}` {source!r} does not exist (expected a folder with tokenizer files or a Hub id).", "missing"
        )
    if os.path.isdir(path) and not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        raise TrainConfigError(
            f"`{field}` {source!r} has no tokenizer files (expected one of {list(TOKENIZER_FILES)}); set "
            "`model.tokenizer` to a folder or Hub id that has them.",
            "wrong_type",
        )


def build_model(config: TrainConfig, tokenizer):
    """A fresh model from `model.architecture` (vocabulary and special ids from the tokenizer) or `init_from`, with the
    experts kernel and the MoHD strategy the config asks for.

    Raises:
        TrainConfigError: `model.sparse_implementation` set for a model that is not MoHD.
    """
    from transformers import AutoModelForCausalLM

    import hf_mohd  # noqa: F401  (registers the model types with the Auto classes)

    kwargs = (
        {"experts_implementation": config.model.experts_implementation} if config.model.experts_implementation else {}
    )
    if config.model.init_from:
        if config.model.gguf_file:
            kwargs["gguf_file"] = config.model.gguf_file
        model = AutoModelForCausalLM.from_pretrained(
            config.model.init_from, dtype=torch.float32, trust_remote_code=config.model.trust_remote_code, **kwargs
        )
    else:
        model_config = architecture_config(
            config.model.architecture,
            vocab_size=len(tokenizer),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        model = AutoModelForCausalLM.from_config(model_config, dtype=torch.float32, **kwargs)
    if config.model.sparse_implementation:
        if not ModelSupport.of(model).sparse_implementation:
            raise TrainConfigError(
                f"`model.sparse_implementation` chooses a MoHD model's execution strategy; this model is "
                f"{model.config.model_type!r}. Leave it empty."
            )
        model.set_sparse_implementation(config.model.sparse_implementation)  # the saved config keeps its own
    return model


def router_kwargs(model, enabled: bool) -> dict:
    """`output_router_logits=True` for models with a router aux loss (they add coef * aux to `loss`)."""
    return {"output_router_logits": True} if enabled and hasattr(model.config, "output_router_logits") else {}


class RunLog:
    """JSONL records (main process) plus Accelerate trackers (TensorBoard). On resume, records after the resumed step
    are dropped, so the file reads like one uninterrupted run."""

    def __init__(self, accelerator, path: str, resume_step: int):
        self.accelerator, self.path = accelerator, path
        self.records: list[dict] = []
        if os.path.exists(path):
            with open(path, encoding="utf-8") as handle:
                self.records = [r for r in map(json.loads, handle) if r.get("step", 0) <= resume_step]
        if accelerator.is_main_process:
            with open(path, "w", encoding="utf-8") as handle:
                handle.writelines(json.dumps(r) + "\n" for r in self.records)

    def write(self, record: dict) -> None:
        self.records.append(record)
        if self.accelerator.is_main_process:
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(record) + "\n")
        scalars = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
        self.accelerator.log(scalars, step=record["step"])


class TiedWeightsSaveFilter(logging.Filter):
    """Drops Accelerate's "Removed shared tensor {...} while saving" warning (`clean_state_dict_for_safetensors`) when
    every removed name is one side of a weight tie the model declares (`all_tied_weights_keys`, e.g. `lm_head.weight`
    tied to `model.embed_tokens.weight`): loading re-ties those, so nothing is lost. Any other removed tensor keeps
    the warning.

    Args:
        tied_names: parameter names that take part in a declared tie (both sides).
    """

    PATTERN = re.compile(r"Removed shared tensor (\{.*?\}) while saving")

    def __init__(self, tied_names: set[str]):
        super().__init__()
        self.tied_names = tied_names

    def filter(self, record: logging.LogRecord) -> bool:
        match = self.PATTERN.search(record.getMessage())
        if match is None:
            return True
        try:
            removed = ast.literal_eval(match.group(1))
        except (ValueError, SyntaxError):
            return True
        return not (isinstance(removed, set) and removed <= self.tied_names)


def tied_parameter_names(accelerator) -> set[str]:
    """Both sides of every weight tie declared by the models `accelerator` prepared (`all_tied_weights_keys`)."""
    names = set()
    for model in accelerator._models:
        ties = getattr(accelerator.unwrap_model(model), "all_tied_weights_keys", None) or {}
        names.update(ties.keys(), ties.values())
    return names


def save_checkpoint(accelerator, output_dir: str, step: int, keep: int) -> str:
    """`save_state` into a temporary folder, then rename it to `checkpoints/step_<n>` (atomic on POSIX,
    `hf_mohd.atomic_folder.move_folder_into_place`) and prune.

    Older checkpoints are pruned (down to `keep`) only once the new one is in place, so at every moment the newest
    `step_<n>` folder is complete (`latest_checkpoint` never sees the `.tmp_step_<n>` folder being written).

    Raises:
        OSError: writing failed (e.g. `errno.ENOSPC`, a full disk); the partial temporary folder is removed, the
            previous checkpoints are untouched, and the message names both, so a rerun resumes from the previous one.
    """
    root = os.path.join(output_dir, "checkpoints")
    final = os.path.join(root, f"step_{step:07d}")
    tmp = os.path.join(root, f".tmp_step_{step:07d}")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(root, exist_ok=True)
    accelerator.wait_for_everyone()
    try:
        with filtered_loggers(TiedWeightsSaveFilter(tied_parameter_names(accelerator)), "accelerate.utils.other"):
            accelerator.save_state(tmp)
    except OSError as error:
        shutil.rmtree(tmp, ignore_errors=True)  # frees the space the partial files took
        previous = latest_checkpoint(output_dir)
        kept = f"the previous checkpoint {previous} is intact" if previous else "there is no previous checkpoint"
        raise OSError(
            error.errno,
            f"Writing checkpoint {final} failed ({error.strerror or error}); {kept}, and a rerun with resume='auto' "
            "starts from it.",
        ) from error
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        move_folder_into_place(tmp, final)
        done = sorted(n for n in os.listdir(root) if CHECKPOINT_PATTERN.match(n))
        for name in done[:-keep]:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator, checkpoint: str) -> None:
    """`load_state` of a checkpoint folder written by `save_checkpoint`.

    Raises:
        ValueError: a damaged checkpoint (missing, truncated or corrupted files: safetensors, pickle or shape errors);
            the message names the folder and how to resume from an earlier one.
    """
    from safetensors import SafetensorError

    try:
        accelerator.load_state(checkpoint)
    except (OSError, ValueError, RuntimeError, KeyError, EOFError, pickle.UnpicklingError, SafetensorError) as error:
        raise ValueError(
            f"Checkpoint {checkpoint} cannot be loaded ({type(error).__name__}: {error}); expected the complete "
            "Accelerate state `save_checkpoint` writes. Delete that folder to resume from the previous checkpoint, "
            "or set resume: never to start afresh."
        ) from error


def saveable(model: torch.nn.Module) -> torch.nn.Module:
    """`model`, or for a model sharded by FSDP2 a weightless (meta-device) instance of its own class and config.

    `fully_shard` changes the class of the module it shards to a subclass `FSDP<Name>` defined in torch, which
    `save_pretrained` would record in `config.json`'s `auto_map` (copying torch's source files for remote code);
    the weights are given to `save_pretrained` as a gathered state dict anyway.
    """
    from torch.distributed.fsdp import FSDPModule
    from transformers import PreTrainedModel

    if not isinstance(model, FSDPModule) or not isinstance(model, PreTrainedModel):
        return model
    own = next(c for c in type(model).__mro__ if issubclass(c, PreTrainedModel) and not issubclass(c, FSDPModule))
    with torch.device("meta"):
        plain = own(model.config)
    plain.generation_config = model.generation_config
    return plain


def save_final_model(accelerator, model, tokenizer, final_dir: str) -> None:
    """`save_pretrained` of the unwrapped model and the tokenizer into a temporary sibling of `final_dir`, renamed
    into place when complete (`hf_mohd.atomic_folder.write_folder_atomically`; an older `final_dir` is replaced only
    then), so that an interruption never leaves a partial folder that `from_pretrained` would load. Every process
    must call it (FSDP / ZeRO-3 gather the weights).
    """
    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(model)  # gathers FSDP / ZeRO-3 shards; every process calls it
    if accelerator.is_main_process:
        # Gathered shards are separate copies: restore the aliases of tied weights (e.g. lm_head = embed_tokens), so
        # that save_pretrained, which finds tied weights by storage, writes them once as for an unsharded model.
        for target, source in getattr(accelerator.unwrap_model(model), "all_tied_weights_keys", {}).items():
            if target in state_dict and source in state_dict and torch.equal(state_dict[target], state_dict[source]):
                state_dict[target] = state_dict[source]
        with write_folder_atomically(os.path.normpath(final_dir)) as staging:
            saveable(accelerator.unwrap_model(model)).save_pretrained(staging, state_dict=state_dict)
            tokenizer.save_pretrained(staging)
    accelerator.wait_for_everyone()


def exit_process(status: int = 0) -> NoReturn:
    """Ends this process of a multi-process (gloo) run with exit `status`, skipping the interpreter's finalization.

    torch's gloo process group keeps its worker threads (`pt_gloo_runloop`) until its last reference goes, and an
    FSDP2 model keeps one (`FSDPMeshInfo.shard_process_group`), so `destroy_process_group` does not stop them. Such a
    thread drops each finished collective's work, and with it the work's tensors, only after `wait()` has returned
    in the main thread; a tensor whose Python object is gone then needs the GIL to free it. When that drop comes
    after the interpreter has begun finalizing (the thread was descheduled, as on oversubscribed CPUs), Python
    answers the GIL request with `pthread_exit`, whose unwinding reaches a `noexcept` frame of
    `ProcessGroupGloo::runLoop`: the process aborts ("terminate called without an active exception", SIGABRT)
    after the run has finished and saved. Traced on torch 2.13 (C++ backtrace: `runLoop` ->
    `TensorImpl::decref_pyobject` -> `PyEval_AcquireThread` -> `pthread_exit`); a 2-process script that keeps a
    reference to its group and exits after collectives aborts this way in 4 of 15 runs, 0 of 15 with this exit.

    Call it last, after `train` has returned on every rank: stdout, stderr and logging are flushed here, and every
    file the trainer writes (checkpoints, `final/`, `log.jsonl`, TensorBoard) is complete and closed by then.
    """
    import sys

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def make_accelerator(config: TrainConfig):
    """The run's `Accelerator`, with FSDP2 and DeepSpeed made to work on CPU-only machines (gloo).

    `accelerate launch` starts one process per rank with torchrun and passes the FSDP settings of the config file as
    `ACCELERATE_USE_FSDP` / `FSDP_*` environment variables. On a machine without a GPU, Accelerate 1.15 then needs
    `cpu=True` (else every process silently trains alone), and with it it sets up gloo as `MULTI_CPU`, where it
    ignores the FSDP request without a word (`AcceleratorState` turns `ACCELERATE_USE_FSDP` into `DistributedType.FSDP`
    for GPU-like devices only) and wraps the model in DDP. Here the request is honoured: the state is switched to
    FSDP with the plugin read from the same environment variables, as Accelerate does on GPUs, so that its own
    FSDP2 code does the rest (`fully_shard` of every `_no_split_modules` layer and of the root on a CPU device mesh,
    `no_sync`, clipping of sharded gradients, sharded `save_state` / `load_state`, the full state dict of
    `get_state_dict`). torch's FSDP2 runs on CPU with gloo (tested with torch 2.13, Accelerate 1.15).

    DeepSpeed (`ACCELERATE_USE_DEEPSPEED`, `ACCELERATE_DEEPSPEED_*`) is ignored on CPU the same way and honoured the
    same way: the state is switched to `DistributedType.DEEPSPEED` with a `DeepSpeedPlugin` read from those variables,
    and `prepare` then calls `deepspeed.initialize` on the gloo process group (DeepSpeed's CPU accelerator; ZeRO-2
    tested with DeepSpeed 0.19.8). Under DeepSpeed, on any device, `train_micro_batch_size_per_gpu` is set to
    `config.micro_batch_size`: Accelerate reads it from a DataLoader, and the trainer prepares none.

    Raises:
        ValueError: the launcher started several processes (`WORLD_SIZE` > 1) but Accelerate set up a single one;
            under DeepSpeed, `grad_accum_steps` (or the DeepSpeed config's gradient_accumulation_steps) is not 1.
    """
    from accelerate import Accelerator, DeepSpeedPlugin, FullyShardedDataParallelPlugin, PartialState
    from accelerate.utils import DistributedType, ProjectConfiguration

    accelerator = Accelerator(
        cpu=not torch.accelerator.is_available(),
        mixed_precision=resolve_mixed_precision(config.mixed_precision),
        log_with="tensorboard",
        project_config=ProjectConfiguration(
            project_dir=config.output_dir, logging_dir=os.path.join(config.output_dir, "tensorboard")
        ),
    )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > accelerator.num_processes:
        raise ValueError(
            f"The launcher started WORLD_SIZE={world} processes but Accelerate set up {accelerator.num_processes} "
            f"(distributed type {accelerator.distributed_type}); on a machine without GPUs set ACCELERATE_USE_CPU=1."
        )
    wants_fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    wants_deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    if wants_fsdp and accelerator.distributed_type == DistributedType.MULTI_CPU:
        plugin = FullyShardedDataParallelPlugin()  # reads the FSDP_* variables `accelerate launch` set
        if accelerator.mixed_precision != "no":
            plugin.set_mixed_precision(accelerator.mixed_precision)
        PartialState().distributed_type = DistributedType.FSDP  # both shared states, as AcceleratorState does on GPU
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
    elif wants_deepspeed and accelerator.distributed_type == DistributedType.MULTI_CPU:
        plugin = DeepSpeedPlugin()  # reads the ACCELERATE_DEEPSPEED_* variables `accelerate launch` set
        plugin.set_mixed_precision(accelerator.mixed_precision)
        plugin.select(_from_accelerator_state=True)
        PartialState().distributed_type = DistributedType.DEEPSPEED
        accelerator.state.distributed_type = DistributedType.DEEPSPEED
        accelerator.state.deepspeed_plugins = plugin
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        # `prepare` is given no DataLoader (the trainer batches itself), so DeepSpeed is told the micro-batch size.
        deepspeed_config = accelerator.state.deepspeed_plugin.deepspeed_config
        deepspeed_config["train_micro_batch_size_per_gpu"] = config.micro_batch_size
        # DeepSpeed steps its optimizer inside `backward` at its own accumulation boundaries and scales the loss
        # itself, so the trainer's accumulation loop on top of it would train with other steps than it counts.
        if config.grad_accum_steps != 1 or deepspeed_config.get("gradient_accumulation_steps", 1) not in (1, "auto"):
            raise ValueError(
                f"`grad_accum_steps` is {config.grad_accum_steps} and the DeepSpeed config's "
                f"gradient_accumulation_steps is {deepspeed_config.get('gradient_accumulation_steps')}: under "
                "DeepSpeed both must be 1 (raise `micro_batch_size` for a larger batch)."
            )
    return accelerator


# What a checkpoint's weights and data order depend on: a resumed run must have the same (the rest, such as
# `max_steps` or the learning rate, may change between calls).
RUN_IDENTITY_FIELDS = ("model", "data.path", "data.seq_len", "seed")
# execution choices under `model` (the same function and gradients either way): free to change between calls
EXECUTION_FIELDS = ("model.experts_implementation", "model.sparse_implementation")


def field_default(name: str):
    """The default of the dotted `TrainConfig` field `name` (e.g. "model.trainable"); None for an unknown one."""
    import dataclasses

    value = TrainConfig
    for part in name.split("."):
        fields = {f.name: f for f in dataclasses.fields(value)} if dataclasses.is_dataclass(value) else {}
        if part not in fields:
            return None
        found = fields[part]
        if found.default is not dataclasses.MISSING:
            value = found.default
        elif found.default_factory is not dataclasses.MISSING:
            value = found.default_factory()
        else:
            return None
    return value


def check_same_run(config: TrainConfig) -> None:
    """Refuses to resume the checkpoints of `output_dir` with another model, data or seed.

    A field the saved file lacks (added to the trainer after the run began) counts as its default, which is what
    the run used; `EXECUTION_FIELDS` may differ.

    Raises:
        TrainConfigError: a field of `RUN_IDENTITY_FIELDS` differs from the run's saved `train_config.json` while a
            checkpoint would be resumed; the message names the field, both values, and the two ways out.
    """
    saved = os.path.join(config.output_dir, "train_config.json")
    if config.resume != "auto" or not os.path.isfile(saved) or not latest_checkpoint(config.output_dir):
        return
    with open(saved, encoding="utf-8") as handle:
        before = json.load(handle)
    now = config.to_dict()

    def flat(values, prefix=""):
        if not isinstance(values, dict):
            return {prefix[:-1]: values}
        return {k: v for key, value in values.items() for k, v in flat(value, f"{prefix}{key}.").items()}

    before, now = flat(before), flat(now)
    for name in sorted(set(before) | set(now)):
        if not name.startswith(RUN_IDENTITY_FIELDS) or name in EXECUTION_FIELDS:
            continue
        was, is_now = before.get(name, field_default(name)), now.get(name, field_default(name))
        if was != is_now:
            raise TrainConfigError(
                f"`{name}` is {is_now!r}, but the checkpoints in {config.output_dir!r} were trained with {was!r}: "
                "set another `output_dir`, or `resume: never` to start afresh in this one."
            )


@dataclass(frozen=True)
class ModelSupport:
    """What a model lets the trainer do, read once from its class flags (transformers' style, like
    `supports_gradient_checkpointing`); a model without them (a LLaMA, any Hub model) supports none.

    Attributes:
        weight_layout: `to_weight_layout("row_major")` stores the weights contiguous, as FSDP2 and DeepSpeed need
            (both families, whose `generate` stores column-major weights).
        sparse_implementation: `set_sparse_implementation(name)` chooses the execution strategy (MoHD).
        active_sub_dims: `set_active_sub_dims(k)` runs the model at k routed sub-dimensions (MoHD): nested healing.
        router_bias_update: `update_router_biases()` after every optimizer step (LatentMoE's aux-loss-free
            balancing).
    """

    weight_layout: bool = False
    sparse_implementation: bool = False
    active_sub_dims: bool = False
    router_bias_update: bool = False

    @classmethod
    def of(cls, model: torch.nn.Module) -> "ModelSupport":
        """The flags `supports_<name>` of `model` (unwrapped), False where the model does not declare one."""
        return cls(**{f.name: bool(getattr(model, f"supports_{f.name}", False)) for f in dataclasses.fields(cls)})


@dataclass
class Run:
    """Everything one `train` call works with: the prepared model and optimizer, the data, the log, and the running
    window of the loop (losses since the last record, their timing)."""

    config: TrainConfig
    accelerator: object
    tokenizer: object
    batches: PackedBatches
    eval_blocks: torch.Tensor
    model: torch.nn.Module
    unwrapped: torch.nn.Module
    support: ModelSupport
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR
    state: TrainerState
    log: "RunLog"
    num_parameters: int
    teacher: torch.nn.Module | None = None
    hidden_basis_q: torch.Tensor | None = None
    forward_kwargs: dict = field(default_factory=dict)
    aux_coef: float = 0.0
    tokens_per_step: int = 0
    nested: bool = False
    last_activations: list | None = None  # nested healing: the (k, weight) pairs of the last step
    target_k: int | None = None
    full_k: int | None = None
    started: float = 0.0
    steps_this_call: int = 0
    window_kd: float = 0.0  # distillation KL since the last record (this process call)
    window_kd_steps: int = 0
    window_started: float = 0.0
    window_resumed_steps: int = 0


def prepare_data(config: TrainConfig, accelerator) -> tuple[object, PackedBatches, torch.Tensor]:
    """(tokenizer, training batches, evaluation blocks). The main process goes first (it fills the `datasets` cache
    and saves the tokenizer and the config), then the others read what it wrote, so every process holds the same
    tokenizer."""
    with accelerator.main_process_first():
        documents = load_documents(config.data)
        train_texts, eval_texts = split_documents(documents, config.data.eval_fraction, config.seed)
        tokenizer = prepare_tokenizer(config, train_texts)
        if accelerator.is_main_process:
            tokenizer.save_pretrained(os.path.join(config.output_dir, "tokenizer"))
    if accelerator.is_main_process:
        with open(os.path.join(config.output_dir, "train_config.json"), "w", encoding="utf-8") as handle:
            json.dump(config.to_dict(), handle, indent=2)
    train_blocks = pack(train_texts, tokenizer, config.data.seq_len)
    eval_blocks = pack(eval_texts, tokenizer, config.data.seq_len) if eval_texts else train_blocks[:0]
    batches = PackedBatches(
        train_blocks, config.micro_batch_size, config.seed, accelerator.process_index, accelerator.num_processes
    )
    return tokenizer, batches, eval_blocks


def resume_checkpoint(config: TrainConfig) -> str | None:
    """The checkpoint folder `config.resume` asks for: the latest one ("auto"), none ("never") or the one named.

    Raises:
        TrainConfigError: `resume` is none of those.
    """
    if config.resume == "auto":
        return latest_checkpoint(config.output_dir)
    if config.resume == "never":
        return None
    if not os.path.isdir(config.resume):
        raise TrainConfigError(f"`resume` {config.resume!r} is neither 'auto', 'never' nor a checkpoint folder.")
    return config.resume


def prepare_run(config: TrainConfig, accelerator, tokenizer, batches: PackedBatches, eval_blocks) -> Run:
    """The model (`build_model`, the distillation teacher, the trainable selection), AdamW and its schedule prepared
    by Accelerate, resumed from a checkpoint where `config.resume` says so, and the loop's constants.

    Raises:
        TrainConfigError: nested healing asked of a model that cannot run at several activations, or a bad `resume`.
    """
    from accelerate.utils import DistributedType

    model = build_model(config, tokenizer)
    support = ModelSupport.of(model)
    num_parameters = sum(p.numel() for p in model.parameters())
    teacher = load_teacher(config.distill, model, accelerator.device, config.model.trust_remote_code)
    hidden_basis_q = None  # intermediate distillation: the student's residual-stream basis in the teacher's
    if teacher is not None and config.distill.hidden_weight > 0:
        # from the weights the run starts from, before a checkpoint's trained embedding replaces them: one fixed basis
        # for the whole run, resumed or not
        hidden_basis_q = hidden_basis(teacher, model)
    model = select_trainable(model, config.model)
    if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED) and support.weight_layout:
        # FSDP2 shards and DeepSpeed flattens (and views as bytes to broadcast) contiguous parameters only: a model
        # that has decoded (`generate` stores column-major weights) goes back to row-major.
        model.to_weight_layout("row_major")
    nested = nested_healing(config.distill)
    if nested and not support.active_sub_dims:
        raise TrainConfigError(
            "`distill.active_sub_dims`, `distill.random_active_weight` and `distill.schedule_fraction` train a "
            f"MoHD model at several activations; this model is {type(model).__name__}."
        )
    optim = config.optim
    optimizer = torch.optim.AdamW(
        param_groups(model, optim.weight_decay), lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps
    )
    scheduler = LambdaLR(optimizer, warmup_cosine(optim.warmup_steps, config.max_steps, optim.min_lr_ratio))
    model, optimizer = accelerator.prepare(model, optimizer)
    state = TrainerState()
    # The schedule is stepped by hand once per optimizer step (a prepared scheduler would step once per process).
    accelerator.register_for_checkpointing(scheduler, state)
    resume_from = resume_checkpoint(config)
    if resume_from:
        load_checkpoint(accelerator, resume_from)
    log = RunLog(accelerator, os.path.join(config.output_dir, "log.jsonl"), state.step)
    scalars = {"seq_len": config.data.seq_len, "lr": optim.lr, "micro_batch_size": config.micro_batch_size}
    accelerator.init_trackers("train", config=scalars)

    unwrapped = accelerator.unwrap_model(model)
    forward_kwargs = router_kwargs(unwrapped, config.router_aux_loss)
    if hidden_basis_q is not None:
        forward_kwargs = {**forward_kwargs, "output_hidden_states": True}
    sequences_per_step = config.micro_batch_size * config.grad_accum_steps * accelerator.num_processes
    run = Run(
        config=config,
        accelerator=accelerator,
        tokenizer=tokenizer,
        batches=batches,
        eval_blocks=eval_blocks,
        model=model,
        unwrapped=unwrapped,
        support=support,
        optimizer=optimizer,
        scheduler=scheduler,
        state=state,
        log=log,
        num_parameters=num_parameters,
        teacher=teacher,
        hidden_basis_q=hidden_basis_q,
        forward_kwargs=forward_kwargs,
        aux_coef=float(getattr(unwrapped.config, "router_aux_loss_coef", 0.0) or 0.0),
        tokens_per_step=sequences_per_step * config.data.seq_len,
        nested=nested,
    )
    if nested:  # the model's own k: its config's default, which stands for its per-layer budgets when it has them
        run.target_k, run.full_k = unwrapped.config.num_routed_sub_dims_per_tok, unwrapped.config.num_routed_sub_dims
    return run


def train_step(run: Run, stream) -> float | None:
    """One optimizer step: `grad_accum_steps` micro-batches from `stream` (forward, objective, backward; nested
    healing runs each at the step's activations), clipping, AdamW, the schedule and the model's post-step update.
    Adds the micro-batches' losses to the state's window. Returns the gradient norm (None where DeepSpeed clips)."""
    config, accelerator, model, state = run.config, run.accelerator, run.model, run.state
    activations = None  # nested healing (`distill.active_sub_dims`, schedule): the (k, weight) of this step
    if run.nested:
        activations = step_activations(
            config.distill, state.step, config.max_steps, run.target_k, run.full_k, config.seed
        )
    run.last_activations = activations
    for micro in range(config.grad_accum_steps):
        state.epoch, state.index, input_ids = next(stream)
        input_ids = input_ids.to(accelerator.device)
        sync = micro == config.grad_accum_steps - 1
        with nullcontext() if sync else accelerator.no_sync(model):
            teacher_logits = teacher_hidden = None
            if run.teacher is not None:  # the teacher's logits of this micro-batch (kept in memory only)
                with torch.no_grad():
                    teacher_out = run.teacher(input_ids=input_ids, output_hidden_states=run.hidden_basis_q is not None)
                    teacher_logits, teacher_hidden = teacher_out.logits, teacher_out.hidden_states

            forward = functools.partial(model, input_ids=input_ids, labels=input_ids, **run.forward_kwargs)
            objective_of = functools.partial(
                student_objective,
                teacher_logits=teacher_logits,
                config=config.distill,
                aux_coef=run.aux_coef,
                teacher_hidden=teacher_hidden,
                basis=run.hidden_basis_q,
            )

            def backward(objective):
                accelerator.backward(objective / config.grad_accum_steps)

            if activations is None:
                outputs = forward()
                objective, kd = objective_of(outputs)
                backward(objective)
            else:  # nested healing: the same weights at each k of this step, gradients summed
                outputs, kd = nested_backward(
                    run.unwrapped, activations, forward, objective_of, backward, own_k=run.target_k
                )
            run.window_kd += kd / config.grad_accum_steps
        aux = getattr(outputs, "aux_loss", None)
        aux = aux.detach().item() if aux is not None else 0.0
        state.window_loss += (outputs.loss.item() - run.aux_coef * aux) / config.grad_accum_steps
        state.window_aux += aux / config.grad_accum_steps
    grad_norm = accelerator.clip_grad_norm_(model.parameters(), config.optim.grad_clip or float("inf"))
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    if run.support.router_bias_update:  # aux-loss-free balancing (LatentMoE)
        run.unwrapped.update_router_biases()
    state.step += 1
    state.tokens += run.tokens_per_step
    run.steps_this_call += 1
    state.window_steps += 1
    run.window_kd_steps += 1
    return grad_norm


def log_window(run: Run, grad_norm) -> dict:
    """Writes the record of the steps since the last one (mean loss and aux loss over every process, learning rate,
    gradient norm, tokens, tokens/s of this process call; the distillation KL and the step's activations where they
    apply), opens the next window, and returns the record."""
    state, accelerator = run.state, run.accelerator
    timed_steps = state.window_steps - run.window_resumed_steps  # steps run (and timed) in this process call
    elapsed = time.perf_counter() - run.window_started
    window = torch.tensor([state.window_loss, state.window_aux], dtype=torch.float64) / state.window_steps
    loss, aux_loss = accelerator.reduce(window.to(accelerator.device), "mean").tolist()  # all processes
    record = {
        "step": state.step,
        "loss": loss,
        "aux_loss": aux_loss,
        "lr": run.scheduler.get_last_lr()[0],
        "grad_norm": float("nan") if grad_norm is None else float(grad_norm),  # None: DeepSpeed clips
        "tokens": state.tokens,
        "tokens_per_s": timed_steps * run.tokens_per_step / max(elapsed, 1e-9),
    }
    if run.teacher is not None:
        record["distill_kl"] = run.window_kd / max(run.window_kd_steps, 1)
        run.window_kd, run.window_kd_steps = 0.0, 0
    if run.last_activations is not None:
        record["active_sub_dims"] = [k for k, _ in run.last_activations]
    run.log.write(record)
    state.window_loss, state.window_aux, state.window_steps = 0.0, 0.0, 0
    run.window_started, run.window_resumed_steps = time.perf_counter(), 0
    return record


def evaluate_and_log(run: Run) -> None:
    """Held-out loss and perplexity on at most `eval_batches` batches, written to the log; its time is not counted
    in the window's tokens/s."""
    eval_started = time.perf_counter()
    config = run.config
    eval_loss, ppl = evaluate_perplexity(
        run.model, run.eval_blocks, config.micro_batch_size, run.accelerator, config.eval_batches
    )
    run.log.write({"step": run.state.step, "eval_loss": eval_loss, "eval_perplexity": ppl})
    run.window_started += time.perf_counter() - eval_started  # tokens/s counts training time only


def run_steps(run: Run) -> None:
    """The loop: optimizer steps until `max_steps` (or `stop_after_steps` in this call), with records every
    `log_every`, evaluations every `eval_every` and checkpoints every `save_every` steps and at an interruption."""
    from tqdm.auto import tqdm

    config, state = run.config, run.state
    stream = run.batches.iterate(state.epoch, state.index)
    bar = tqdm(
        total=config.max_steps,
        initial=state.step,
        disable=not (run.accelerator.is_main_process and config.progress_bar),
        desc=os.path.basename(os.path.normpath(config.output_dir)),
    )
    run.window_started, run.window_resumed_steps = time.perf_counter(), state.window_steps
    run.model.train()
    while state.step < config.max_steps:
        grad_norm = train_step(run, stream)
        bar.update(1)
        if state.step % config.log_every == 0 or state.step == config.max_steps:
            record = log_window(run, grad_norm)
            bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
        if config.eval_every and state.step % config.eval_every == 0 and len(run.eval_blocks):
            evaluate_and_log(run)
        interrupted = config.stop_after_steps and run.steps_this_call >= config.stop_after_steps
        if (config.save_every and state.step % config.save_every == 0) or interrupted:
            save_checkpoint(run.accelerator, config.output_dir, state.step, config.keep_checkpoints)
        if interrupted and state.step < config.max_steps:
            break
    bar.close()
    if run.nested:  # the final evaluation and the saved model run at the model's own k
        run.unwrapped.set_active_sub_dims(None)


def finish(run: Run) -> TrainResult:
    """The result of the call; for a finished run also the final full evaluation (read back from the log when a
    rerun trained nothing), the last checkpoint and the final model folder (`save_final`)."""
    config, accelerator, state, log = run.config, run.accelerator, run.state, run.log
    result = TrainResult(
        output_dir=config.output_dir,
        final_model_dir=None,
        steps=state.step,
        tokens=state.tokens,
        seconds=time.perf_counter() - run.started,
        num_parameters=run.num_parameters,
        train_log=[r for r in log.records if "loss" in r],
    )
    if state.step >= config.max_steps:
        # a rerun of a finished run trains nothing; its final evaluation is already in the log
        finals = [r for r in log.records if r.get("eval_full") and r.get("step") == state.step]
        done = finals[-1] if finals and not run.steps_this_call else None
        if done:
            result.eval_loss, result.eval_perplexity = done["eval_loss"], done["eval_perplexity"]
            accelerator.print(
                f"{config.output_dir}: already complete ({state.step} of {config.max_steps} steps); "
                "final evaluation read from log.jsonl"
            )
        elif len(run.eval_blocks):
            result.eval_loss, result.eval_perplexity = evaluate_perplexity(
                run.model, run.eval_blocks, config.micro_batch_size, accelerator
            )
            final = {"eval_loss": result.eval_loss, "eval_perplexity": result.eval_perplexity, "eval_full": True}
            log.write({"step": state.step, **final})
        if not latest_checkpoint(config.output_dir) or not latest_checkpoint(config.output_dir).endswith(
            f"step_{state.step:07d}"
        ):
            save_checkpoint(accelerator, config.output_dir, state.step, config.keep_checkpoints)
        if config.save_final:
            result.final_model_dir = os.path.join(config.output_dir, "final")
            # a finished run's final folder stays as it is (a model card or results added there are kept)
            if not (done and os.path.isfile(os.path.join(result.final_model_dir, "config.json"))):
                save_final_model(accelerator, run.model, run.tokenizer, result.final_model_dir)
    result.model = accelerator.unwrap_model(run.model)
    return result


def train(config: TrainConfig) -> TrainResult:
    """Run (or resume) one training run described by `config`; see `TrainConfig` for every knob: data and tokenizer
    (`prepare_data`), model, optimizer and resumption (`prepare_run`), the loop (`run_steps`: `train_step`,
    `log_window`, `evaluate_and_log`, checkpoints), the final evaluation and save (`finish`)."""
    from accelerate.utils import set_seed

    accelerator = make_accelerator(config)
    os.makedirs(config.output_dir, exist_ok=True)
    check_same_run(config)  # before any data is read
    set_seed(config.seed)
    tokenizer, batches, eval_blocks = prepare_data(config, accelerator)
    run = prepare_run(config, accelerator, tokenizer, batches, eval_blocks)
    run.started = time.perf_counter()
    run_steps(run)
    result = finish(run)
    # every rank's collectives (the final save's among them) finish before `end_training` destroys the process group;
    # a process of a multi-process run should then end through `exit_process` (gloo's teardown race, see there)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return result
