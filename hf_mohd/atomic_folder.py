"""Atomic writes, in one place: a folder or a file is written under a temporary sibling name and renamed into place
when complete.

A crash or an interrupt never leaves a half-written folder or file under the destination name (for a later
`from_pretrained`, a resumed run or a reader of results to load), and an existing one is replaced only once the new
one is complete.

- `write_folder_atomically(out)`: a context manager yielding a fresh staging folder; used by the LLaMA conversions
  (`hf_mohd.conversion.save_converted`, docs/design.md section 6), the Nemotron-H interop
  (`hf_mohd.interop.nemotron_h`, section 4 "Interop"), the trainer's final model, the demo's report and the
  experiments' model folders.
- `move_folder_into_place(staging, out)`: the rename step alone, for a staging folder whose name must be known in
  advance (the trainer's checkpoints, written by every process of a distributed run).
- `write_text_atomically(path, text)` and `write_json_atomically(path, value)`: one file (results, summaries).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def move_folder_into_place(staging: str | os.PathLike, out: str | os.PathLike) -> None:
    """Renames the complete folder `staging` to `out` (same file system). An existing `out` is first moved into a
    hidden `.<name>.<random>.old` sibling and deleted only after `staging` is in place.

    Raises:
        OSError: a rename fails (then `out`, if it existed, is untouched or still in the `.old` sibling).
    """
    staging, out = Path(staging), Path(out)
    if out.exists():
        retired = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
        os.replace(out, retired / out.name)
        os.replace(staging, out)
        shutil.rmtree(retired)
    else:
        os.replace(staging, out)


@contextlib.contextmanager
def write_folder_atomically(out: str | os.PathLike) -> Iterator[Path]:
    """Yields a fresh folder `.<name>.<random>.partial` next to `out` to write into; renamed to `out` when the block
    completes (`move_folder_into_place`), removed (and the exception re-raised) when it raises, including
    `KeyboardInterrupt`.

    The staging folder gets the umask-derived mode (`mkdtemp` makes it owner-only); the files written into it follow
    the umask already. `out.parent` must exist.

    Raises:
        OSError: the staging folder cannot be created, or a rename fails (then `out`, if it existed, is untouched
            or still in the `.old` sibling).
    """
    out = Path(out)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)
    try:
        yield staging
        move_folder_into_place(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def write_text_atomically(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> Path:
    """Writes `text` to a hidden temporary sibling of `path`, then renames it to `path` (replacing an existing file);
    the temporary file is removed if writing fails. The parent folder is created if needed. Returns `path`.

    Raises:
        OSError: writing or the rename failed (an existing `path` is then untouched).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(descriptor, "w", encoding=encoding) as handle:
            handle.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it owner-only; a plain open would follow the umask
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


def write_json_atomically(path: str | os.PathLike, value, indent: int | None = 2) -> Path:
    """`write_text_atomically(path, json.dumps(value, indent=indent) + "\\n")`. Returns `path`."""
    return write_text_atomically(path, json.dumps(value, indent=indent) + "\n")


__all__ = ["move_folder_into_place", "write_folder_atomically", "write_json_atomically", "write_text_atomically"]
