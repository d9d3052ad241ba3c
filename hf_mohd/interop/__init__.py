"""Interoperability with other model families' checkpoints (DESIGN section 4, "Interop")."""

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
    "NemotronHInteropError",
    "export_to_nemotron_h",
    "from_nemotron_h",
    "import_from_nemotron_h",
    "latent_moe_config_from_nemotron_h",
    "nemotron_h_config_from_latent_moe",
    "to_nemotron_h",
]
