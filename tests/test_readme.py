"""README.md and the guides in docs/ cannot drift from the code: every code block marked `runnable` runs, and every
other code block says why it does not.

A fenced block's info string is the language, then a marker (README.md, "Code blocks in these pages"):
- `runnable`, then optional flags: "```python runnable", "```bash runnable slow hub", "```python runnable continues".
  `slow` runs in the full tier only; `hub` runs against the local Hub server (`tests/hub_server.py`; `HF_ENDPOINT` set
  before `huggingface_hub` is imported) and implies slow; `continues` runs a Python block in the namespace of the
  previous runnable Python block of its page (which must run in the same interpreter, right before it).
- one reason the block is not run, for `python` or `bash`: `long` (minutes to hours), `gpu` (needs CUDA GPUs),
  `install` (installs packages), `own-files` (reads files of the reader's own).
- or nothing after a data language: `yaml`, `json`, `text`.

Each page (README.md, docs/*.md, model_cards/README.md, conversion/README.md) runs in a scratch directory of its own: fast blocks first, then
slow ones, each group in file order (a block may read what an earlier block of the same page, or any fast block of
it, wrote). Each Python block runs in a fresh namespace (`continues` excepted; consecutive Python blocks share one
interpreter, to pay the torch import once), each bash block in its own shell, with `HF_HUB_OFFLINE=1`. Tracebacks
point at the page's lines.
"""

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GUIDES = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *GUIDES, ROOT / "model_cards" / "README.md", ROOT / "conversion" / "README.md"]
LANGUAGES = ("python", "bash")
RUN_FLAGS = ("slow", "hub", "continues")
NOT_RUN = ("long", "gpu", "install", "own-files")  # why a python or bash block is not run
DATA_LANGUAGES = ("yaml", "json", "text")  # data or output, not code

RUNNER = """
import json, sys, traceback
namespace = None
for block in json.load(open(sys.argv[1])):
    if not block["continues"]:
        namespace = {"__name__": "__main__"}
    try:
        exec(compile("\\n" * block["line"] + block["code"], block["source"], "exec"), namespace)
    except BaseException:
        traceback.print_exc()
        sys.exit(f"{block['source']}: the block opened at line {block['line']} failed")
"""


@dataclass
class Block:
    lang: str
    flags: frozenset
    code: str
    line: int  # line of the opening fence
    source: str = "README.md"

    @property
    def slow(self) -> bool:
        return "slow" in self.flags or "hub" in self.flags


def name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def fences(text: str) -> list[tuple[int, str, str]]:
    """(line of the opening fence, info string, code) of every fenced block; a block ends at a line that is ```."""
    lines = text.split("\n")
    found, i = [], 0
    while i < len(lines):
        if lines[i].startswith("```"):
            j = i + 1
            while j < len(lines) and lines[j].rstrip() != "```":
                j += 1
            assert j < len(lines), f"the block opened at line {i + 1} is never closed"
            found.append((i + 1, lines[i][3:].strip(), "".join(f"{line}\n" for line in lines[i + 1 : j])))
            i = j
        i += 1
    return found


def runnable_blocks(text: str, source: str = "README.md") -> list[Block]:
    blocks = []
    for line, info, code in fences(text):
        words = info.split()
        if words[1:2] == ["runnable"]:
            blocks.append(Block(words[0], frozenset(words[2:]), code, line, source))
    return blocks


def page_blocks(page: Path) -> list[Block]:
    return runnable_blocks(page.read_text(), name(page))


def marker_error(info: str) -> str | None:
    """Why an info string is not one of the documented markers, or None."""
    words = info.split()
    if not words:
        return "no language"
    lang, rest = words[0], words[1:]
    if lang in DATA_LANGUAGES:
        return f"data ({lang}) takes no marker, got {rest}" if rest else None
    if lang not in LANGUAGES:
        return f"language {lang!r} is neither code {LANGUAGES} nor data {DATA_LANGUAGES}"
    if rest[:1] == ["runnable"]:
        unknown = [f for f in rest[1:] if f not in RUN_FLAGS]
        return f"unknown flags {unknown}; known: {RUN_FLAGS}" if unknown else None
    if len(rest) == 1 and rest[0] in NOT_RUN:
        return None
    return f"expected `runnable [{' '.join(RUN_FLAGS)}]` or one of {NOT_RUN}, got {rest}"


def run_blocks(blocks: list[Block], cwd: Path, hub=None) -> None:
    """Run `blocks` in order in `cwd`; consecutive Python blocks of the same kind share one interpreter."""
    base_env = {
        **os.environ,
        "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(cwd / ".hf-home"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    hub_env = {"HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_XET": "1", "HF_TOKEN": "hf_local_readme_token"}
    groups: list[list[Block]] = []
    for block in blocks:
        same = groups and block.lang == "python" == groups[-1][0].lang
        if same and ("hub" in block.flags) == ("hub" in groups[-1][0].flags):
            groups[-1].append(block)
        else:
            assert "continues" not in block.flags, f"{block.source}:{block.line} continues no Python block"
            groups.append([block])
    for group in groups:
        env = dict(base_env)
        if "hub" in group[0].flags:
            assert hub is not None, "a `hub` block needs the local Hub"
            env.update(hub_env, HF_ENDPOINT=hub.endpoint)
        if group[0].lang == "python":
            spec = cwd / ".readme-blocks.json"
            spec.write_text(
                json.dumps(
                    [
                        {"line": b.line, "code": b.code, "source": b.source, "continues": "continues" in b.flags}
                        for b in group
                    ]
                )
            )
            command = [sys.executable, "-c", RUNNER, str(spec)]
        else:
            command = ["bash", "-euo", "pipefail", "-c", group[0].code]
        proc = subprocess.run(
            command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=900
        )
        lines = ", ".join(f"{b.source}:{b.line}" for b in group)
        assert proc.returncode == 0, f"block(s) at {lines} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def test_every_code_block_is_runnable_or_says_why_not():
    """Every fenced block of README.md and docs/*.md carries one of the documented markers (the module docstring)."""
    bad = []
    for page in PAGES:
        text = page.read_text()
        for line, info, _ in fences(text):
            if error := marker_error(info):
                bad.append(f"{name(page)}:{line}: ```{info}: {error}")
        # a fence indented under a list item would escape the checks above
        code_lines = {n for line, _, code in fences(text) for n in range(line, line + code.count("\n") + 2)}
        for number, text_line in enumerate(text.split("\n"), 1):
            if number not in code_lines and text_line.lstrip().startswith("```"):
                bad.append(f"{name(page)}:{number}: an indented fence")
    assert not bad, "\n".join(bad)


def test_runnable_blocks_are_well_formed():
    blocks = [b for page in PAGES for b in page_blocks(page)]
    assert len(blocks) >= 10, "the pages lost their runnable examples"
    assert all(b.lang in LANGUAGES for b in blocks), [
        (b.source, b.line, b.lang) for b in blocks if b.lang not in LANGUAGES
    ]
    for page in PAGES:
        # a `continues` block runs right after the Python block it continues, in the same interpreter
        for tier in ([b for b in page_blocks(page) if not b.slow], [b for b in page_blocks(page) if b.slow]):
            for i, block in enumerate(tier):
                before = tier[i - 1] if i else None
                if "continues" in block.flags:
                    assert block.lang == "python" and before is not None and before.lang == "python", block.line
                    assert ("hub" in before.flags) == ("hub" in block.flags), (block.source, block.line)
    # Every section the guides document has a runnable example.
    code = "\n".join(b.code for b in blocks)
    for needle in ("pipeline(", "Trainer(", "get_peft_model(", "merge_and_unload(", "lm-eval run", "render_model_card(",
                   "publish(", "hf-mohd publish", "trust_remote_code=True", "hf-mohd train", "hf-mohd convert"):  # fmt: skip
        assert needle in code, f"no runnable block shows {needle!r}"


def anchors(text: str) -> set[str]:
    """GitHub's anchors of a page's headings (outside code blocks)."""
    code_lines = {n for line, _, code in fences(text) for n in range(line, line + code.count("\n") + 2)}
    slugs = set()
    for number, line in enumerate(text.split("\n"), 1):
        if number not in code_lines and (m := re.match(r"#+ (.*)", line)):
            slugs.add(re.sub(r"[^\w\- ]", "", m[1].strip().lower()).replace(" ", "-"))
    return slugs


def test_relative_links_resolve():
    """Links between the pages (and to the repository's files) point at files that exist, and at headings they have."""
    bad = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                bad.append(f"{name(page)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved.read_text()):
                bad.append(f"{name(page)}: {target} (no such heading)")
    assert not bad, "\n".join(bad)


def test_readme_links_every_guide():
    text = README.read_text()
    missing = [name(g) for g in GUIDES if f"]({name(g)})" not in text]
    assert not missing, f"README.md does not link {missing}"


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """Per page: the directory its blocks run in, and whether its fast blocks already ran there."""
    dirs = {}

    def of(page: Path) -> dict:
        if page not in dirs:
            dirs[page] = {"path": tmp_path_factory.mktemp(re.sub(r"\W", "-", name(page))), "fast_done": False}
        return dirs[page]

    return of


FAST_PAGES = [p for p in PAGES if any(not b.slow for b in page_blocks(p))]
SLOW_PAGES = [p for p in PAGES if any(b.slow for b in page_blocks(p))]


@pytest.mark.parametrize("page", FAST_PAGES, ids=name)
def test_fast_readme_blocks_run(page, scratch):
    run_blocks([b for b in page_blocks(page) if not b.slow], scratch(page)["path"])
    scratch(page)["fast_done"] = True


@pytest.mark.slow
@pytest.mark.parametrize("page", SLOW_PAGES, ids=name)
def test_slow_readme_blocks_run(page, scratch, local_hub):
    """Slow blocks run after the page's fast ones (they may read what any of them wrote), reusing the fast run's
    files."""
    blocks = page_blocks(page)
    if not scratch(page)["fast_done"]:
        run_blocks([b for b in blocks if not b.slow], scratch(page)["path"])
        scratch(page)["fast_done"] = True
    run_blocks([b for b in blocks if b.slow], scratch(page)["path"], hub=local_hub)
