"""hf-mohd: MoHD and LatentMoE sparse Transformers as first-class Hugging Face models.

Importing this package registers the configurations and models with the Auto classes and marks them for
`register_for_auto_class`, so that `save_pretrained` / `push_to_hub` write `auto_map` and the code files. It first
checks that transformers, accelerate and torch are within the supported ranges (`hf_mohd.versions`): outside them
the import fails with `UnsupportedVersionError` naming the installed and the supported versions.
"""

from .versions import UnsupportedVersionError, check_supported_versions


check_supported_versions()  # before anything imports transformers' model API

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM  # noqa: E402

from .models.configuration_latent_moe import LatentMoEConfig  # noqa: E402
from .models.configuration_mohd import MoHDConfig  # noqa: E402
from .models.modeling_latent_moe import LatentMoEForCausalLM, LatentMoEModel, LatentMoEPreTrainedModel  # noqa: E402
from .models.modeling_mohd import MoHDForCausalLM, MoHDModel, MoHDPreTrainedModel  # noqa: E402
from .models.routing_cache import RoutingCache, RoutingRecord  # noqa: E402


__version__ = "0.1.0"


def _register(config_class, model_class, causal_lm_class) -> None:
    AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    AutoModel.register(config_class, model_class, exist_ok=True)
    AutoModelForCausalLM.register(config_class, causal_lm_class, exist_ok=True)
    config_class.register_for_auto_class()
    model_class.register_for_auto_class("AutoModel")
    causal_lm_class.register_for_auto_class("AutoModelForCausalLM")


_register(MoHDConfig, MoHDModel, MoHDForCausalLM)
_register(LatentMoEConfig, LatentMoEModel, LatentMoEForCausalLM)

__all__ = [
    "LatentMoEConfig",
    "LatentMoEForCausalLM",
    "LatentMoEModel",
    "LatentMoEPreTrainedModel",
    "MoHDConfig",
    "MoHDForCausalLM",
    "MoHDModel",
    "MoHDPreTrainedModel",
    "RoutingCache",
    "RoutingRecord",
    "UnsupportedVersionError",
]
