"""Test helpers shared by several test files: the tiny model families every model test builds from (one set of LLaMA
fields, each family's own fields on top), inputs, greedy decoding, gradients, and fresh-process checks.

A test file's tiny model is `FAMILIES[name].config(**overrides)` / `.build(...)` / `.model(...)` /
`.spread_model(...)`: what differs from the shared fields is written as overrides (`ModelFamily.defaults` gives the
config class's own defaults, to undo a shared field). The `family` fixture (`tests/conftest.py`) runs a test once per
family.
"""

import dataclasses
import json
import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from transformers import LlamaConfig

from bench.vllm_runner import VLLM_PYTHON
from hf_mohd import LatentMoEConfig, LatentMoEForCausalLM, MoHDConfig, MoHDForCausalLM


VOCAB = 97
# The LLaMA part of every tiny config; `LlamaForCausalLM` of these fields is the oracle of the LLaMA behaviours.
LLAMA_FIELDS = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def llama_config(**overrides) -> LlamaConfig:
    """The `LlamaConfig` of `LLAMA_FIELDS` (with `overrides`)."""
    return LlamaConfig(**{**LLAMA_FIELDS, **overrides})


def input_ids(batch: int = 2, length: int = 9, seed: int = 0, vocab_size: int = VOCAB) -> torch.Tensor:
    """(batch, length) token ids in [3, vocab_size): no pad, BOS or EOS id."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (batch, length), generator=generator)


def greedy(model, ids: torch.Tensor, max_new_tokens: int = 6, **kwargs) -> torch.Tensor:
    """`generate` of greedy tokens (pad id 0)."""
    return model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, **kwargs)


def gradients(model) -> dict[str, torch.Tensor]:
    """{parameter name: a copy of its gradient} of the parameters that have one; a sharded (DTensor) gradient is
    gathered whole (a collective: every rank calls it)."""
    grads = {}
    for name, param in model.named_parameters():
        if param.grad is not None:
            grad = param.grad
            grads[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().clone()
    return grads


def routers(model) -> list[torch.nn.Module]:
    """The routers of `model`, in module order: the modules a routing record keys by (`layer_idx`, `router_name`)."""
    return [module for module in model.modules() if hasattr(module, "router_name")]


def routers_by_key(model) -> dict:
    """(layer index, router name) -> the router of that key."""
    return {(module.layer_idx, module.router_name): module for module in routers(model)}


def spread(model, correction_bias: bool = False):
    """Moves the weights away from their initialisation, in parameter order (one draw each from the global RNG):
    MoHD's group fusion perturbed (+ 0.1 N(0, 1), no longer the identity), routers spread (N(0, 0.5), so that routing
    matters), biases random (N(0, 0.02)); with `correction_bias`, LatentMoE's correction-bias buffers too
    (N(0, 0.2)). Returns `model`."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "group_fusion" in name:
                param.add_(0.1 * torch.randn_like(param))
            elif "router" in name or name.endswith(".gate.weight"):
                param.normal_(0, 0.5)
            elif name.endswith("bias"):
                param.normal_(0, 0.02)
        if correction_bias:
            for name, buffer in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buffer.normal_(0, 0.2)
    return model


@dataclass(frozen=True)
class ModelFamily:
    """How to build tiny models of one family.

    Args:
        name: test id.
        config_class, model_class: the family's config and causal LM.
        fields: config fields on top of `LLAMA_FIELDS`.
        unaligned_fields: fields giving widths whose bytes in bf16/fp16 are not a multiple of 16 (36 scalars).
        fast_and_reference: (fast, reference) keyword overrides of the same model: two execution paths that must
            agree (`model(**overrides)`).
        prepare: applied to each built model (e.g. pick the experts implementation).
        assistant_fields: overrides of a smaller draft model for assisted decoding.
        code_files: the remote-code files `save_pretrained` copies next to the weights.
        saved_fields: overrides of the model of the save / reload checks (every optional module present).
        perturb: applied to that model before saving (e.g. a non-zero router bias buffer).
        bad_configs: (overrides of `config()`, regex of the `ValueError` message) of the family's own fields; the
            LLaMA fields both families share are in the common suite's `LLAMA_BAD_CONFIGS`.
    """

    name: str
    config_class: type
    model_class: type
    fields: dict
    unaligned_fields: dict
    fast_and_reference: tuple[dict, dict]
    prepare: Callable = field(default=lambda model, **overrides: model)
    assistant_fields: dict = field(default_factory=lambda: {"num_hidden_layers": 1})
    code_files: tuple = ()
    saved_fields: dict = field(default_factory=dict)
    perturb: Callable = field(default=lambda model: None)
    bad_configs: tuple = ()

    def config(self, **overrides):
        return self.config_class(**{**LLAMA_FIELDS, **self.fields, **overrides})

    def defaults(self, *names: str) -> dict:
        """{name: the config class's default}: overrides that undo shared fields (a config built without them)."""
        fields = {field.name: field.default for field in dataclasses.fields(self.config_class)}
        return {name: fields[name] for name in names}

    def build(self, seed: int = 0, dtype=torch.float64, **overrides):
        """A tiny model as initialised from `seed`, in eval mode and `dtype` (float64 by default: no top-k ties between
        paths), prepared (`experts_implementation` goes to `prepare`, not to the config)."""
        fields = {k: v for k, v in overrides.items() if k != "experts_implementation"}
        torch.manual_seed(seed)
        model = self.model_class(self.config(**fields)).to(dtype).eval()
        return self.prepare(model, **overrides)

    def model(self, seed: int = 0, dtype=torch.float64, **overrides):
        """`build`, routers spread (std 0.5) so that routing matters."""
        model = self.build(seed, dtype, **overrides)
        with torch.no_grad():
            for router in routers(model):
                router.weight.normal_(0, 0.5)
        return model

    def spread_model(self, seed: int = 0, dtype=torch.float64, correction_bias: bool = False, **overrides):
        """`build`, every kind of weight moved away from its initialisation (`spread`): a model whose fusion, biases
        and routers all matter."""
        return spread(self.build(seed, dtype, **overrides), correction_bias)


def _perturb_correction_bias(model) -> None:
    with torch.no_grad():
        for router in routers(model):
            router.e_score_correction_bias.normal_(0, 0.1)


def _prepare_latent_moe(model, experts_implementation="eager", **overrides):
    """Eager experts by default (torch's grouped_mm kernel takes no float64); None keeps the config's choice."""
    if experts_implementation is not None:
        model.set_experts_implementation(experts_implementation)
    return model


FAMILIES = {
    "mohd": ModelFamily(
        name="mohd",
        config_class=MoHDConfig,
        model_class=MoHDForCausalLM,
        fields=dict(num_sub_dims=8, num_shared_sub_dims=3, num_routed_sub_dims_per_tok=2),
        # hidden 144 in 4 sub-dimensions: s = 36 (SmolLM2-135M's 576 at 16 sub-dimensions)
        unaligned_fields=dict(hidden_size=144, num_sub_dims=4, num_shared_sub_dims=1, num_routed_sub_dims_per_tok=2),
        fast_and_reference=({"sparse_implementation": "gather"}, {"sparse_implementation": "masked"}),
        code_files=(
            "modeling_mohd.py",
            "configuration_mohd.py",
            "accounting.py",
            "configuration_layers.py",
            "mohd_geometry.py",
            "mohd_layout.py",
            "mohd_plans.py",
            "mohd_products.py",
            "mohd_strategies.py",
            "mohd_tensor_parallel.py",
            "native_gather.py",
        ),
        saved_fields={"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True},
        bad_configs=(
            ({"num_sub_dims": 7}, "`hidden_size`"),
            ({"num_shared_sub_dims": 9}, "`num_shared_sub_dims`"),
            ({"num_shared_sub_dims": -1}, "`num_shared_sub_dims`"),
            ({"num_routed_sub_dims_per_tok": 6}, "`num_routed_sub_dims_per_tok`"),
            ({"num_shared_sub_dims": 0, "num_routed_sub_dims_per_tok": 0}, "`num_routed_sub_dims_per_tok`"),
            ({"sparse_modules": ["attention", "moe"]}, "`sparse_modules`"),
            ({"sparse_modules": ["ffn", "ffn"]}, "`sparse_modules`"),
            ({"activation_scaling": "sqrt"}, "`activation_scaling`"),
            ({"routed_gate": "sigmoid"}, "`routed_gate`"),
            ({"group_fusion": "dense"}, "`group_fusion`"),
            ({"sparse_implementation": ""}, "`sparse_implementation`"),
            ({"router_aux_loss_coef": -0.1}, "`router_aux_loss_coef`"),
        ),
    ),
    "latent_moe": ModelFamily(
        name="latent_moe",
        config_class=LatentMoEConfig,
        model_class=LatentMoEForCausalLM,
        fields=dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            moe_latent_size=8,
            moe_shared_expert_intermediate_size=24,
            per_layer_config={1: {"num_experts": 6, "num_experts_per_tok": 3, "moe_latent_size": None}},
        ),
        # latent width and expert width 36
        unaligned_fields=dict(hidden_size=144, moe_latent_size=36, moe_intermediate_size=36, per_layer_config=None),
        fast_and_reference=({"experts_implementation": "grouped_mm"}, {"experts_implementation": "eager"}),
        prepare=_prepare_latent_moe,
        assistant_fields={"num_hidden_layers": 1, "per_layer_config": None},
        code_files=(
            "modeling_latent_moe.py",
            "configuration_latent_moe.py",
            "accounting.py",
            "configuration_layers.py",
            "native_gather.py",
        ),
        saved_fields={
            "tie_word_embeddings": True,
            "router_score_func": "sigmoid",
            "experts_implementation": "gather",  # LatentMoE's default kernel, which a reload picks again
        },
        perturb=_perturb_correction_bias,
        # layer 0 takes the global fields; `fields` overrides layer 1 (replaced where a case sets per_layer_config)
        bad_configs=(
            ({"num_experts_per_tok": 9}, r"layer 0: `num_experts_per_tok`"),
            ({"per_layer_config": {1: {"num_experts_per_tok": 9}}}, r"layer 1: `num_experts_per_tok`"),
            ({"per_layer_config": {1: {"mixer_type": "mamba"}}}, r"layer 1: `mixer_type`"),
            ({"per_layer_config": {1: {"moe_latent_size": 0}}}, r"layer 1: `moe_latent_size`"),
            ({"per_layer_config": {0: {"moe_shared_expert_intermediate_size": -1}}}, r"layer 0: `moe_shared_expert"),
            ({"per_layer_config": {1: {"hidden_size": 96}}}, r"per_layer_config\[1\]`.*hidden_size"),
            ({"per_layer_config": {1: {"mlp_gated": False}}}, r"per_layer_config\[1\]`.*mlp_gated"),
            ({"per_layer_config": {1: {"skip": ["mlp"]}}}, r"per_layer_config\[1\]`.*skip"),
            ({"per_layer_config": {0: {"num_experts": 0}}}, r"layer 0: `num_experts`"),
            ({"router_score_func": "relu"}, r"`router_score_func`"),
            ({"position_embedding_type": "alibi"}, r"`position_embedding_type`"),
            ({"router_bias_update_rate": -1.0}, r"`router_bias_update_rate`"),
            ({"routed_scaling_factor": 0.0}, r"`routed_scaling_factor`"),
        ),
    ),
}


# Prepended to code run in a fresh interpreter: any import of `hf_mohd` fails there, as on a machine without it.
BLOCK_HF_MOHD = textwrap.dedent(
    """
    import importlib.abc, sys

    class _BlockHfMohd(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "hf_mohd" or name.startswith("hf_mohd."):
                raise ImportError("hf_mohd is blocked in this process")
            return None

    sys.meta_path.insert(0, _BlockHfMohd())
    try:
        import hf_mohd  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("hf_mohd is still importable")
    """
)


def run_python_without_hf_mohd(code: str, cwd: str, env: dict | None = None, timeout: int = 600) -> dict:
    """Runs `code` in a fresh interpreter where `hf_mohd` cannot be imported; returns the JSON it prints last.

    The code must print one JSON object as its last stdout line. Raises AssertionError with stderr on failure.
    """
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-c", BLOCK_HF_MOHD + textwrap.dedent(code)],
        stdin=subprocess.DEVNULL,
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, (
        f"subprocess failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def reallocate_parameters(model) -> None:
    """Gives every parameter of a `from_pretrained` model freshly allocated memory, in place.

    Loaded tensors can be views of the safetensors file, 8-byte aligned; MKL's AVX2 kernels sum in another order on
    such memory (1 ulp apart on an AMD EPYC), so a reloaded model's logits are compared bit for bit on copies.
    """
    for parameter in model.parameters():
        parameter.data = parameter.data.clone()


# --- serving tests (vLLM, transformers' server) ---------------------------------------------------------------------

# a plain chat template for the tests' tokenizers (role: content lines, then "assistant:")
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def require_vllm_environment() -> None:
    """Skips the calling test module when `.venv-vllm` is absent, except under `HF_MOHD_VLLM=1` (`scripts/test.sh`,
    CI), which sets that environment up: there its absence raises. Call it at module level."""
    if VLLM_PYTHON.exists():
        return
    if os.environ.get("HF_MOHD_VLLM") == "1":
        raise RuntimeError(f"HF_MOHD_VLLM=1 but {VLLM_PYTHON} does not exist: run `bash scripts/setup.sh --vllm`.")
    pytest.skip("no .venv-vllm: `bash scripts/setup.sh --vllm` sets it up", allow_module_level=True)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spread_weights(model, std: float = 0.15):
    """Weights drawn wider than the initialisation (N(0, std); routers N(0, 0.5); MoHD's fusion identity + noise;
    norms kept), so that next-token distributions are peaked (greedy choices far from ties) and routing matters.
    Seeded (1); returns `model` in eval mode."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                continue
            if "group_fusion" in name:
                param.add_(0.1 * torch.randn_like(param))
            elif "router" in name or name.endswith(".gate.weight"):
                param.normal_(0, 0.5)
            else:
                param.normal_(0, std)
    return model.eval()
