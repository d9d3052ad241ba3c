"""Interoperability with other model families' checkpoints (docs/design.md section 4, "Interop")."""

from .gguf_export import LlamaCppExportError, check_llama_cpp_compatible, export_to_gguf
from .nemotron_h import (
    NemotronHInteropError,
    export_to_nemotron_h,
    from_nemotron_h,
    import_from_nemotron_h,
    latent_moe_config_from_nemotron_h,
    nemotron_h_config_from_latent_moe,
    to_nemotron_h,
)


__all__ = [
    "LlamaCppExportError",
    "NemotronHInteropError",
    "check_llama_cpp_compatible",
    "export_to_gguf",
    "export_to_nemotron_h",
    "from_nemotron_h",
    "import_from_nemotron_h",
    "latent_moe_config_from_nemotron_h",
    "nemotron_h_config_from_latent_moe",
    "to_nemotron_h",
]
