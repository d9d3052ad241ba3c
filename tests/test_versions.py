"""The supported-version check made when `hf_mohd` is imported, and the version record of result files."""

import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from hf_mohd.versions import (
    UnsupportedVersionError,
    check_supported_versions,
    library_versions,
    supported_ranges,
)


ROOT = Path(__file__).resolve().parents[1]
RANGES = {"transformers": ">=5.24,<6", "accelerate": ">=1.15", "torch": ">=2.10"}
GOOD = {"transformers": "5.25.0", "accelerate": "1.16.0", "torch": "2.13.0+cpu"}


def test_supported_ranges_are_the_pyproject_dependencies():
    """The ranges checked at import are read back from the installed metadata: the pyproject's `dependencies`."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    expected = {Requirement(line).name: str(Requirement(line).specifier) for line in dependencies}
    assert supported_ranges() == expected
    assert set(expected) >= {"transformers", "accelerate", "torch"}


@pytest.mark.parametrize(
    "library, version",
    [("transformers", "5.23.0"), ("transformers", "6.0.0"), ("accelerate", "1.14.0"), ("torch", "2.9.1+cpu")],
)
def test_a_version_outside_the_range_is_refused_naming_both(library, version):
    with pytest.raises(UnsupportedVersionError) as error:
        check_supported_versions(GOOD | {library: version}, RANGES)
    message = str(error.value)
    assert f"{library} {version} is installed" in message
    assert f"supports {library}{RANGES[library]}" in message
    assert "constraints.txt" in message


@pytest.mark.parametrize(
    "library, version",
    [("transformers", "5.24.0"), ("transformers", "5.99.1"), ("torch", "2.13.0+cpu"), ("transformers", "5.26.0rc1")],
)
def test_a_version_inside_the_range_passes(library, version):
    check_supported_versions(GOOD | {library: version}, RANGES)  # raises nothing


def test_importing_hf_mohd_with_an_unsupported_transformers_fails_with_the_message():
    """End to end, in a fresh interpreter whose metadata reports transformers 5.23.0: the import of `hf_mohd` itself
    fails with the message, not a later AttributeError from a changed API."""
    code = (
        "import importlib.metadata as m\n"
        "real = m.version\n"
        "m.version = lambda name: '5.23.0' if name == 'transformers' else real(name)\n"
        "import hf_mohd\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 1
    assert "UnsupportedVersionError: hf-mohd supports transformers" in result.stderr
    assert "but transformers 5.23.0 is installed" in result.stderr


def test_library_versions_name_the_installed_libraries():
    import accelerate
    import torch
    import transformers

    versions = library_versions()
    assert versions["torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert versions["transformers"] == transformers.__version__
    assert versions["accelerate"] == accelerate.__version__
    assert versions["python"] == ".".join(map(str, sys.version_info[:3]))
