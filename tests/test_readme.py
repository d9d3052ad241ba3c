"""README.md cannot drift from the code: every code block marked `runnable` runs.

A block's info string is the language, `runnable`, then optional flags: "```python runnable", "```bash runnable slow
hub". Blocks run in one scratch directory, fast ones first, then slow ones, each group in file order (a block may read
what an earlier block or any fast block wrote). Each Python block runs in a fresh namespace (consecutive Python blocks
share one interpreter, to pay the torch import once), each bash block in its own shell, with `HF_HUB_OFFLINE=1`.
Flags: `slow` runs in the full tier only; `hub` runs against the local Hub server (`tests/hub_server.py`;
`HF_ENDPOINT` set before `huggingface_hub` is imported) and implies slow.
Tracebacks point at README.md lines.
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
OTHER_READMES = [ROOT / "model_cards" / "README.md"]  # their runnable blocks run with the fast ones
FENCE = re.compile(r"^```(?P<lang>\w+) runnable(?P<flags>[^\n]*)\n(?P<code>.*?)^```[ \t]*$", re.S | re.M)
LANGUAGES = ("python", "bash")

RUNNER = """
import json, sys, traceback
for block in json.load(open(sys.argv[1])):
    try:
        exec(compile("\\n" * block["line"] + block["code"], block["source"], "exec"), {"__name__": "__main__"})
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


def runnable_blocks(text: str, source: str = "README.md") -> list[Block]:
    return [
        Block(m["lang"], frozenset(m["flags"].split()), m["code"], text.count("\n", 0, m.start()) + 1, source)
        for m in FENCE.finditer(text)
    ]


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
            groups.append([block])
    for group in groups:
        env = dict(base_env)
        if "hub" in group[0].flags:
            assert hub is not None, "a `hub` block needs the local Hub"
            env.update(hub_env, HF_ENDPOINT=hub.endpoint)
        if group[0].lang == "python":
            spec = cwd / ".readme-blocks.json"
            spec.write_text(json.dumps([{"line": b.line, "code": b.code, "source": b.source} for b in group]))
            command = [sys.executable, "-c", RUNNER, str(spec)]
        else:
            command = ["bash", "-euo", "pipefail", "-c", group[0].code]
        proc = subprocess.run(
            command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=900
        )
        lines = ", ".join(f"{b.source}:{b.line}" for b in group)
        assert proc.returncode == 0, (
            f"README block(s) at {lines} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )


def test_runnable_blocks_are_well_formed():
    blocks = runnable_blocks(README.read_text())
    assert len(blocks) >= 10, "README.md lost its runnable examples"
    assert all(b.lang in LANGUAGES for b in blocks), [(b.line, b.lang) for b in blocks if b.lang not in LANGUAGES]
    unknown = {(b.line, f) for b in blocks for f in b.flags if f not in ("slow", "hub")}
    assert not unknown, f"unknown flags {unknown}"
    # Every README section this issue documents has a runnable example.
    code = "\n".join(b.code for b in blocks)
    for needle in ("pipeline(", "Trainer(", "get_peft_model(", "merge_and_unload(", "lm-eval run", "render_model_card(",
                   "publish(", "hf-mohd publish", "trust_remote_code=True"):  # fmt: skip
        assert needle in code, f"no runnable README block shows {needle!r}"


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """The directory the blocks run in, and whether the fast blocks already ran there."""
    return {"path": tmp_path_factory.mktemp("readme"), "fast_done": False}


def test_fast_readme_blocks_run(scratch):
    others = [b for p in OTHER_READMES for b in runnable_blocks(p.read_text(), str(p.relative_to(ROOT)))]
    assert others and not any(b.slow for b in others)
    run_blocks([b for b in runnable_blocks(README.read_text()) if not b.slow] + others, scratch["path"])
    scratch["fast_done"] = True


@pytest.mark.slow
def test_slow_readme_blocks_run(scratch, local_hub):
    """Slow blocks run after all fast ones (they may read what any fast block wrote), reusing the fast run's files."""
    blocks = runnable_blocks(README.read_text())
    if not scratch["fast_done"]:
        run_blocks([b for b in blocks if not b.slow], scratch["path"])
        scratch["fast_done"] = True
    run_blocks([b for b in blocks if b.slow], scratch["path"], hub=local_hub)
