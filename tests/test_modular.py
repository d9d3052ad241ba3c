"""The generated `modeling_<family>.py` files agree with their `modular_<family>.py` (scripts/modular_converter.py),
show each model's forward in their own classes, and import no modular source."""

import ast
import importlib.util
import textwrap
from pathlib import Path

import pytest

from hf_mohd.models import modeling_latent_moe, modeling_mohd


ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "hf_mohd" / "models"


def load_converter():
    spec = importlib.util.spec_from_file_location("modular_converter", ROOT / "scripts" / "modular_converter.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


converter = load_converter()


def write(tmp_path, text, name="modular_toy.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


@pytest.mark.parametrize("family", ["mohd", "latent_moe"])
def test_generated_file_matches_its_modular_file(family):
    """The committed modeling file is exactly what the converter writes from the modular file (run
    `python scripts/modular_converter.py` after editing a modular file or modular_common.py)."""
    generated = converter.convert(MODELS / f"modular_{family}.py")
    assert generated == (MODELS / f"modeling_{family}.py").read_text(), (
        f"modeling_{family}.py is stale: run `python scripts/modular_converter.py`"
    )


def test_converter_lists_both_families_and_check_mode_passes(capsys):
    assert [path.name for path in converter.modular_files()] == ["modular_latent_moe.py", "modular_mohd.py"]
    assert converter.main(["--check"]) == 0
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize(
    "module, classes",
    [
        (modeling_mohd, ("MoHDModel", "MoHDForCausalLM")),
        (modeling_latent_moe, ("LatentMoEModel", "LatentMoEForCausalLM")),
    ],
)
def test_forward_is_written_in_each_family_file(module, classes):
    """Each family's base model and causal LM define `forward` in their own class body, in their own file, and no
    class of the shared modular source is a base at run time."""
    tree = ast.parse(Path(module.__file__).read_text())
    bodies = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not any("modular" in (name or "") for name in imported)
    for name in classes:
        methods = {item.name for item in bodies[name].body if isinstance(item, ast.FunctionDef)}
        assert "forward" in methods, name
        cls = getattr(module, name)
        assert "forward" in vars(cls)
        assert not [base for base in cls.__mro__ if base.__module__.endswith("modular_common")]
    causal_lm = getattr(module, classes[1])
    assert {"save_pretrained", "_prepare_cache_for_generation"} <= set(vars(causal_lm))


def test_converter_keeps_a_method_the_class_defines_and_copies_the_rest(tmp_path):
    """Override semantics: an attribute or method the modular class writes itself wins over the mixin's; the mixin's
    other attributes and methods (and its base mixin's) are copied, the mixin leaves the bases, and the names the
    copies use are imported."""
    modular = write(
        tmp_path,
        '''\
        """A toy family."""

        from transformers.modeling_utils import PreTrainedModel

        from .modular_common import RoutedCausalLMMixin


        class ToyForCausalLM(RoutedCausalLMMixin, PreTrainedModel):
            _pp_plan = None

            def forward(self, input_ids):
                return input_ids
        ''',
    )
    out = converter.convert(modular)
    tree = ast.parse(out)
    (toy,) = [node for node in tree.body if isinstance(node, ast.ClassDef)]
    assert [ast.unparse(base) for base in toy.bases] == ["PreTrainedModel"]
    methods = [item.name for item in toy.body if isinstance(item, ast.FunctionDef)]
    # its own forward first and once; then RoutedCausalLMMixin's save_pretrained, then its base's cache hook
    assert methods == ["forward", "save_pretrained", "_prepare_cache_for_generation"]
    # the mixin's attributes open the body, except the one the class sets itself
    attributes = [ast.unparse(item) for item in toy.body if isinstance(item, ast.Assign)]
    assert [text.split(" =")[0] for text in attributes] == ["_tied_weights_keys", "_tp_plan", "_pp_plan"]
    assert attributes[-1] == "_pp_plan = None"
    assert "# both tied weights sharded on the vocabulary" in out  # a comment above a copied attribute comes along
    assert "return input_ids" in out and "slice_logits_to_keep" not in out
    assert "from transformers.cache_utils import DynamicCache, StaticCache" in out
    assert "from .modeling_common import logger" in out
    assert all("modular" not in (node.module or "") for node in ast.walk(tree) if isinstance(node, ast.ImportFrom))


def test_converter_rejects_a_base_modular_common_does_not_define(tmp_path):
    modular = write(
        tmp_path,
        '"""Bad."""\n\nfrom .modular_common import NoSuchMixin, RoutedCausalLMMixin\n\n\n'
        "class Bad(NoSuchMixin, RoutedCausalLMMixin):\n    pass\n",
        name="modular_bad.py",
    )
    with pytest.raises(converter.ModularConversionError, match="modular_bad.py: class Bad inherits 'NoSuchMixin'"):
        converter.convert(modular)


def test_converter_accepts_any_header_layout_and_keeps_keywords_and_comments(tmp_path):
    """A header over several lines (as ruff formats a long one), a keyword base, a comment in the header and a body
    that opens with a comment or a decorated method all convert."""
    modular = write(
        tmp_path,
        '''\
        """A toy family."""

        from transformers.modeling_utils import PreTrainedModel

        from .modular_common import RoutedCausalLMMixin


        class ToyForCausalLM(
            RoutedCausalLMMixin,
            PreTrainedModel,
            metaclass=type,
        ):  # noqa: B024
            # a comment opening the body
            @property
            def width(self):
                return 1
        ''',
    )
    out = converter.convert(modular)
    assert "class ToyForCausalLM(PreTrainedModel, metaclass=type):  # noqa: B024" in out
    tree = ast.parse(out)
    (toy,) = [node for node in tree.body if isinstance(node, ast.ClassDef)]
    assert [item.name for item in toy.body if isinstance(item, ast.FunctionDef)][:2] == ["width", "save_pretrained"]
    assert "# a comment opening the body" in out


def test_converter_rejects_super_call_to_a_dropped_mixin(tmp_path):
    """An override that calls super() on the mixin's method would reach the next base once the mixin is dropped."""
    modular = write(
        tmp_path,
        '''\
        """A toy family."""

        from transformers.modeling_utils import PreTrainedModel

        from .modular_common import RoutedCausalLMMixin


        class ToyForCausalLM(RoutedCausalLMMixin, PreTrainedModel):
            def forward(self, **kwargs):
                return super().forward(**kwargs)
        ''',
    )
    with pytest.raises(converter.ModularConversionError, match=r"ToyForCausalLM.forward calls super\(\).forward"):
        converter.convert(modular)


def test_converter_rejects_a_family_name_that_shadows_what_the_mixin_imports(tmp_path):
    """A family-level `RoutingCache` would silently replace the one the copied forward means."""
    modular = write(
        tmp_path,
        '''\
        """A toy family."""

        from transformers.modeling_utils import PreTrainedModel

        from .modular_common import RoutedDecoderMixin


        class RoutingCache:
            pass


        class ToyModel(RoutedDecoderMixin, PreTrainedModel):
            pass
        ''',
    )
    with pytest.raises(converter.ModularConversionError, match="modular_toy.py binds 'RoutingCache' otherwise"):
        converter.convert(modular)


def test_check_mode_reports_a_conversion_error_as_one_line(tmp_path, monkeypatch, capsys):
    bad = write(
        tmp_path,
        '"""Bad."""\n\nfrom .modular_common import NoSuchMixin\n\n\nclass Bad(NoSuchMixin):\n    pass\n',
        name="modular_bad.py",
    )
    monkeypatch.setattr(converter, "modular_files", lambda: [bad])
    assert converter.main(["--check"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: modular_bad.py: class Bad inherits 'NoSuchMixin'") and err.count("\n") == 1


def test_converter_rejects_a_mixin_helper_defined_in_the_modular_source(tmp_path, monkeypatch):
    """A generated file must not import a modular file, so a helper the mixins use must come from modeling_common."""
    common = write(
        tmp_path,
        '''\
        """Shared modular source."""


        def _count_layers(model):
            return len(model.layers)


        class CountMixin:
            def num_layers(self):
                return _count_layers(self)
        ''',
        name="modular_common.py",
    )
    monkeypatch.setattr(converter, "COMMON", common)
    modular = write(
        tmp_path,
        '"""Toy."""\n\nfrom .modular_common import CountMixin\n\n\nclass Toy(CountMixin):\n    pass\n',
    )
    with pytest.raises(converter.ModularConversionError, match="CountMixin.num_layers uses '_count_layers', which"):
        converter.convert(modular)
