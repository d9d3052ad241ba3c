# Copyright 2026 The hf-mohd Authors. All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""Generates each family's flat `modeling_<family>.py` from its `modular_<family>.py`.

transformers writes a model once in `modular_<model>.py`, with inheritance, and generates the flat
`modeling_<model>.py` that a reader (and remote code) sees. Its converter (`utils/modular_model_converter.py` in the
transformers repository) ships in neither the transformers wheel nor its source distribution, and it resolves only
bases inside `transformers.models`; this is the same idea, reduced to what the two families here need.

The rule: a class of the modular file that lists a class imported from `hf_mohd/models/modular_common.py` (a mixin)
among its bases gets that mixin's class attributes written at the top of its body and the mixin's methods after its
own (with those of the mixin's bases that modular_common.py defines, nearest first); an attribute or method the
class defines itself wins, as inheritance would have it.
The mixin is dropped from the bases, the module-level names the copied methods use are imported as
`modular_common.py` imports them (from `modeling_common.py` or an installed package; a generated file never imports
a modular file), and the file is sorted and formatted with ruff under the project's settings. So each family's
modeling file shows its model's `forward`, the code exists once, in `modular_common.py`, and the class hierarchy and
method resolution are the ones the modular file declares (less the mixin itself in `__mro__`).

Usage:
    python scripts/modular_converter.py           # rewrite every generated modeling file
    python scripts/modular_converter.py --check   # exit 1 and name the files that differ from their modular file

Raises (`ModularConversionError`; the command prints it as one `error:` line and exits 2): a base imported from
`.modular_common` that `modular_common.py` does not define; a method that overrides a mixin's and calls
`super().<that method>` (the generated class has no mixin to reach); a copied method that uses a name
`modular_common.py` defines rather than imports, or one the family file binds otherwise (other than `logger`); a
class body on its header line; ruff missing or failing.
"""

import argparse
import ast
import importlib.util
import io
import subprocess
import sys
import tokenize
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "hf_mohd" / "models"
COMMON = MODELS / "modular_common.py"
HEADER = (
    "# Generated from {modular} by scripts/modular_converter.py (in the hf-mohd source repository): do not\n"
    "# edit this file by hand. Edit {modular} (or the shared mixins in modular_common.py) and run\n"
    "# `python scripts/modular_converter.py`; a test checks that the files agree.\n"
)
# The first line of a modular file, which says it is the file to edit; the generated file gets HEADER instead.
SOURCE_MARKER = "# Modular source of "
# A name both files bind that the copied methods may take from the family file: a module's own logger.
FAMILY_OWNED = {"logger"}


class ModularConversionError(RuntimeError):
    """A modular file that the converter cannot turn into a flat modeling file; the message names file and class."""


def _segment(lines: list[str], node: ast.AST) -> str:
    """Source lines of `node` as written (with their indentation): its decorators and the comment lines just above."""
    first = min([node.lineno, *(decorator.lineno for decorator in getattr(node, "decorator_list", []))])
    while first > 1 and lines[first - 2].lstrip().startswith("#"):
        first -= 1
    return "".join(lines[first - 1 : node.end_lineno])


def _attribute_names(item: ast.stmt) -> set[str]:
    """Names a class-level assignment (`name = ...`, `name: type = ...`) binds; empty for anything else."""
    if isinstance(item, ast.Assign):
        return {target.id for target in item.targets if isinstance(target, ast.Name)}
    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
        return {item.target.id}
    return set()


def _module_bindings(tree: ast.Module) -> dict[str, ast.stmt]:
    """Top-level name -> the statement that binds it (import, def, class or assignment)."""
    bindings = {}
    for statement in tree.body:
        if isinstance(statement, (ast.Import, ast.ImportFrom)):
            for alias in statement.names:
                bindings[(alias.asname or alias.name).split(".")[0]] = statement
        elif isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bindings[statement.name] = statement
        elif isinstance(statement, (ast.Assign, ast.AnnAssign)):
            targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    bindings[target.id] = statement
    return bindings


def _import_line(statement: ast.stmt, name: str) -> str:
    """The import of the single name `name` as `statement` (an import of modular_common.py) writes it."""
    for alias in statement.names:
        if (alias.asname or alias.name).split(".")[0] == name:
            as_part = f" as {alias.asname}" if alias.asname else ""
            if isinstance(statement, ast.Import):
                return f"import {alias.name}{as_part}\n"
            module = "." * statement.level + (statement.module or "")
            return f"from {module} import {alias.name}{as_part}\n"
    raise ModularConversionError(f"modular_common.py: no import binds {name!r}")


def _free_names(function: ast.AST) -> set[str]:
    """Names a function (with its decorators) reads but neither takes as an argument nor assigns."""
    loaded = {node.id for node in ast.walk(function) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
    stored = {
        node.id for node in ast.walk(function) if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load)
    }
    arguments = {arg.arg for arg in ast.walk(function) if isinstance(arg, ast.arg)}
    return loaded - stored - arguments


def _header(lines: list[str], node: ast.ClassDef, filename: str) -> tuple[int, str]:
    """(last line of the class header, comments written in it) for a header over any number of lines."""
    text = "".join(lines[node.lineno - 1 :])
    depth, comments, end = 0, [], None
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if end is not None:  # the rest of the header's last line: only a comment or the line end may follow
            if token.type == tokenize.COMMENT:
                comments.append(token.string)
                continue
            if token.type in (tokenize.NEWLINE, tokenize.NL):
                return node.lineno + end - 1, "  ".join(comments)
            raise ModularConversionError(f"{filename}: class {node.name} has its body on the header line")
        if token.type == tokenize.COMMENT:
            comments.append(token.string)
        elif token.type == tokenize.OP and token.string in "([{":
            depth += 1
        elif token.type == tokenize.OP and token.string in ")]}":
            depth -= 1
        elif token.type == tokenize.OP and token.string == ":" and depth == 0:
            end = token.start[0]
    raise ModularConversionError(f"{filename}: class {node.name}: no end of the class header found")


def _calls_super(function: ast.AST, name: str) -> bool:
    """Whether `function` calls `super().<name>(...)`."""
    return any(
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == name
        and isinstance(node.func.value, ast.Call)
        and isinstance(node.func.value.func, ast.Name)
        and node.func.value.func.id == "super"
        for node in ast.walk(function)
    )


def _is_shared(name: str, bindings: dict[str, ast.stmt]) -> bool:
    """Whether the modular file imports `name` from the shared modular source (`from .modular_common import ...`)."""
    statement = bindings.get(name)
    return isinstance(statement, ast.ImportFrom) and statement.level == 1 and statement.module == COMMON.stem


def _mixin_chain(name: str, common_classes: dict[str, ast.ClassDef]) -> list[ast.ClassDef]:
    """The mixin `name` (defined in modular_common.py) and its bases that modular_common.py defines, nearest first
    (single inheritance)."""
    chain = [common_classes[name]]
    for node in chain:
        chain += [
            common_classes[base.id] for base in node.bases if isinstance(base, ast.Name) and base.id in common_classes
        ]
    return chain


def _ruff(source: str, filename: Path) -> str:
    """`ruff check --select I,F401 --fix` then `ruff format`, with the project's settings, on `source`."""
    if importlib.util.find_spec("ruff") is None:
        raise ModularConversionError(
            f"ruff is needed to format {filename.name}: install the test extra (pip install -e '.[test]') into "
            f"{sys.executable}"
        )
    steps = (["check", "--select", "I,F401", "--fix", "--quiet", "--exit-zero"], ["format", "--quiet"])
    for step in steps:
        result = subprocess.run(
            [sys.executable, "-m", "ruff", *step, "--stdin-filename", str(filename), "-"],
            input=source,
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        if result.returncode != 0:
            raise ModularConversionError(f"ruff {step[0]} failed on {filename.name}: {result.stderr.strip()}")
        source = result.stdout
    return source


def convert(modular_path: Path) -> str:
    """The flat modeling file's text for `modular_path` (`.../modular_<family>.py`); see the module docstring."""
    common_source = COMMON.read_text()
    common_tree = ast.parse(common_source)
    common_lines = common_source.splitlines(keepends=True)
    common_bindings = _module_bindings(common_tree)
    common_classes = {node.name: node for node in common_tree.body if isinstance(node, ast.ClassDef)}

    source = modular_path.read_text()
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    own_bindings = _module_bindings(tree)
    edits = []  # (first line, last line, replacement), 1-based inclusive, applied bottom-up
    needed: dict[str, str] = {}  # name a copied method or attribute reads -> "Mixin.method" (for messages)
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        mixins = [base.id for base in node.bases if isinstance(base, ast.Name) and _is_shared(base.id, own_bindings)]
        for name in mixins:
            if name not in common_classes:
                raise ModularConversionError(
                    f"{modular_path.name}: class {node.name} inherits {name!r} from modular_common.py, which does not "
                    f"define it (it defines {', '.join(sorted(common_classes))})"
                )
        if not mixins:
            continue
        own_methods = {
            item.name: item for item in node.body if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
        }
        defined = set(own_methods) | set().union(*(_attribute_names(item) for item in node.body))
        attributes, copied = [], []
        for mixin in mixins:
            for mixin_node in _mixin_chain(mixin, common_classes):
                for item in mixin_node.body:
                    is_method = isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
                    if is_method and item.name in own_methods and _calls_super(own_methods[item.name], item.name):
                        raise ModularConversionError(
                            f"{modular_path.name}: {node.name}.{item.name} calls super().{item.name}, which only "
                            f"{mixin_node.name} provides: the generated class drops the mixin, so that call would "
                            "reach the next base instead; write the whole method, or change the mixin"
                        )
                    if is_method and item.name not in defined:
                        defined.add(item.name)
                        copied.append(_segment(common_lines, item))
                    elif _attribute_names(item) and not _attribute_names(item) & defined:
                        defined |= _attribute_names(item)
                        attributes.append(_segment(common_lines, item))
                    else:
                        continue
                    member = item.name if is_method else ", ".join(sorted(_attribute_names(item)))
                    for name in _free_names(item):
                        needed.setdefault(name, f"{mixin_node.name}.{member}")
        bases = [ast.get_source_segment(source, base) for base in node.bases if ast.unparse(base) not in mixins]
        bases += [ast.get_source_segment(source, keyword) for keyword in node.keywords]
        header_end, header_comment = _header(lines, node, modular_path.name)
        new_header = (
            f"class {node.name}({', '.join(bases)}):" + (f"  {header_comment}" if header_comment else "") + "\n"
        )
        # the mixin's class attributes open the body (after a docstring), its methods close it
        has_docstring = isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
        split = node.body[0].end_lineno if has_docstring else header_end
        body = "".join(lines[header_end:split]) + "".join(attributes) + "".join(lines[split : node.end_lineno])
        edits.append((node.lineno, node.end_lineno, new_header + body + "".join("\n" + text for text in copied)))

    imports = []
    for name, user in sorted(needed.items()):
        statement = common_bindings.get(name)
        if statement is None:
            continue  # a builtin
        if not isinstance(statement, (ast.Import, ast.ImportFrom)):
            raise ModularConversionError(
                f"modular_common.py: {user} uses {name!r}, which modular_common.py defines rather than imports; "
                "define it in modeling_common.py and import it from there, so no generated file imports a modular file"
            )
        line = _import_line(statement, name)
        own = own_bindings.get(name)
        if own is None:
            imports.append(line)
        elif name not in FAMILY_OWNED and not (
            isinstance(own, (ast.Import, ast.ImportFrom)) and _import_line(own, name) == line
        ):
            raise ModularConversionError(
                f"{modular_path.name} binds {name!r} otherwise than modular_common.py ({line.strip()}), and {user} "
                "uses it: the copied method would take the family's; rename one of the two"
            )
    for first, last, replacement in sorted(edits, reverse=True):
        lines[first - 1 : last] = [replacement]
    last_import = max(node.end_lineno for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom)))
    lines.insert(last_import, "".join(imports))
    if lines and lines[0].startswith(SOURCE_MARKER):
        lines = lines[1:]
    text = HEADER.format(modular=modular_path.name) + "".join(lines)
    return _ruff(text, modular_path.with_name(modular_path.name.replace("modular_", "modeling_")))


def modular_files() -> list[Path]:
    """Every family's `modular_<family>.py` in hf_mohd/models (not the shared `modular_common.py`)."""
    return sorted(path for path in MODELS.glob("modular_*.py") if path != COMMON)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="report generated files that differ; write nothing")
    args = parser.parse_args(argv)
    stale = []
    try:
        for modular in modular_files():
            target = modular.with_name(modular.name.replace("modular_", "modeling_"))
            generated = convert(modular)
            if target.exists() and target.read_text() == generated:
                continue
            stale.append((target, modular))
            if not args.check:
                target.write_text(generated)
    except ModularConversionError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for target, modular in stale:
        if args.check:
            print(
                f"{target.relative_to(ROOT)} differs from what {modular.name} and {COMMON.name} give: "
                "run `python scripts/modular_converter.py`"
            )
        else:
            print(f"{target.relative_to(ROOT)} regenerated from {modular.name} and {COMMON.name}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
