"""vLLM plugin: serves both families' saved folders in vLLM with the execution paths they need.

vLLM loads a plugin's `register` at start-up in every process through the `vllm.general_plugins` entry point that
hf-mohd's pyproject declares, so `pip install hf-mohd` beside vLLM is the whole set-up; `vllm serve FOLDER
--trust-remote-code` and `LLM(model=FOLDER, trust_remote_code=True)` then build the classes of
`hf_mohd.interop.vllm_models` for the architectures a folder's config names. Without the plugin vLLM's Transformers
modeling backend still runs MoHD exactly (every block computed, then masked) but routes LatentMoE's experts into one
fused MoE shape at `hidden_size`, which a model with a latent width or per-layer expert shapes does not have.

This module imports no vLLM at import time: only `register` does, when vLLM calls it.
"""

# config.architectures[0] of each family -> the vLLM model class that serves it
VLLM_MODEL_CLASSES = {
    "MoHDForCausalLM": "hf_mohd.interop.vllm_models:MoHDForCausalLM",
    "LatentMoEForCausalLM": "hf_mohd.interop.vllm_models:LatentMoEForCausalLM",
}


def register() -> None:
    """Registers both families' vLLM model classes with `vllm.ModelRegistry` (lazily, by "module:class" name, so
    vLLM imports them only in the processes that build a model). Called by vLLM through the `vllm.general_plugins`
    entry point; calling it again changes nothing."""
    from vllm import ModelRegistry

    supported = set(ModelRegistry.get_supported_archs())
    for architecture, model_class in VLLM_MODEL_CLASSES.items():
        if architecture not in supported:
            ModelRegistry.register_model(architecture, model_class)
