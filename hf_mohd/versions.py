"""The versions of the libraries hf-mohd runs on: the supported ranges, the check made when `hf_mohd` is imported,
and the record stored with every committed result (with the CPU model, `cpu_model`).

The supported ranges are the package's own requirements (`pyproject.toml`'s `dependencies`, read back from the
installed package's metadata), so that they have one home. The set the test suite was run with is pinned in
`constraints.txt` at the repository root.
"""

import importlib.metadata
import platform
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version


# The libraries whose API the models and the trainer are written against; a version outside the package's
# requirement fails at import with `UnsupportedVersionError` rather than somewhere deep in a forward.
CHECKED_LIBRARIES = ("transformers", "accelerate", "torch")
# What a result records (`library_versions`): the checked libraries and the ones that shape a measurement.
RECORDED_LIBRARIES = ("torch", "transformers", "accelerate", "safetensors", "peft", "lm-eval")


class UnsupportedVersionError(ImportError):
    """An installed library's version is outside the range hf-mohd requires (the message names both)."""


def supported_ranges(distribution: str = "hf-mohd") -> dict[str, str]:
    """The version specifiers of `distribution`'s unconditional requirements, e.g. `{"transformers": ">=5.24,<6"}`.

    Returns an empty dict when the package is not installed (a source tree on `PYTHONPATH`): then nothing is checked.
    """
    try:
        requirements = importlib.metadata.requires(distribution) or []
    except importlib.metadata.PackageNotFoundError:
        return {}
    ranges = {}
    for line in requirements:
        requirement = Requirement(line)
        if requirement.marker is None:  # extras (`extra == "peft"`) are optional: not checked at import
            ranges[requirement.name] = str(requirement.specifier)
    return ranges


def check_supported_versions(installed: dict[str, str] | None = None, ranges: dict[str, str] | None = None) -> None:
    """Raise `UnsupportedVersionError` if a library of `CHECKED_LIBRARIES` is outside its supported range.

    Args:
        installed: library name -> installed version; read from the environment's metadata when omitted.
        ranges: library name -> specifier (`">=5.24,<6"`); `supported_ranges()` when omitted.

    Raises:
        UnsupportedVersionError: naming the library, the installed version, the supported range and the pip
            command that installs a supported version. Local version labels (`2.13.0+cpu`) are compared without
            their label; pre-releases of an allowed release count as allowed.
    """
    ranges = supported_ranges() if ranges is None else ranges
    for name in CHECKED_LIBRARIES:
        specifier = ranges.get(name)
        if not specifier:
            continue
        version = installed[name] if installed is not None else _installed_version(name)
        if version is None:
            continue  # a missing dependency fails at its own import, with pip's message
        if not Requirement(f"{name}{specifier}").specifier.contains(Version(version).public, prereleases=True):
            raise UnsupportedVersionError(
                f"hf-mohd supports {name}{specifier}, but {name} {version} is installed: "
                f"pip install '{name}{specifier}' (the tested set is pinned in hf-mohd's constraints.txt)."
            )


def library_versions() -> dict[str, str | None]:
    """Python and the installed versions of `RECORDED_LIBRARIES` (None where not installed), for result files."""
    versions = {"python": platform.python_version()}
    versions.update({name: _installed_version(name) for name in RECORDED_LIBRARIES})
    return versions


def _installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpuinfo_fields() -> dict:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    fields = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def cpu_model() -> str:
    """The CPU's model name, with vendor, family, model and stepping where /proc/cpuinfo gives them: a VM may name
    only "AMD EPYC", which family 25 model 1 (Zen 3) and family 25 model 17 (Zen 4) share."""
    fields = _cpuinfo_fields()
    name = fields.get("model name") or platform.processor() or "unknown"
    if "cpu family" in fields:
        name += (
            f" ({fields.get('vendor_id', '?')} family {fields['cpu family']} model {fields.get('model', '?')}"
            f" stepping {fields.get('stepping', '?')})"
        )
    return name
