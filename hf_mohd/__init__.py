"""hf-mohd: MoHD and LatentMoE sparse Transformers as first-class Hugging Face models.

Importing this package registers the configurations and models with the Auto classes and marks them for
`register_for_auto_class`, so that `save_pretrained` / `push_to_hub` write `auto_map` and the code files.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .models.configuration_latent_moe import LatentMoEConfig
from .models.configuration_mohd import MoHDConfig
from .models.modeling_latent_moe import LatentMoEForCausalLM, LatentMoEModel, LatentMoEPreTrainedModel
from .models.modeling_mohd import MoHDForCausalLM, MoHDModel, MoHDPreTrainedModel
from .models.routing_cache import RoutingCache, RoutingRecord


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
]
