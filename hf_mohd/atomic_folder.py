"""Writing a model folder atomically: into a hidden temporary sibling that is renamed into place when complete.

A crash or an interrupt never leaves a half-written folder under the destination name for a later `from_pretrained`
to load, and an existing folder is replaced only once the new one is complete. Used by the LLaMA conversions
(`hf_mohd.conversion.save_converted`, docs/design.md section 6) and the Nemotron-H interop
(`hf_mohd.interop.nemotron_h`, section 4 "Interop").
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def staged_folder(out: Path) -> Iterator[Path]:
    """Yields a fresh folder `.<name>.<random>.partial` next to `out` to write into; renamed to `out` when the block
    completes, removed (and the exception re-raised) when it raises, including `KeyboardInterrupt`.

    An existing `out` is first moved into a `.<name>.<random>.old` sibling and deleted only after the new folder is
    in place. The staging folder gets the umask-derived mode (`mkdtemp` makes it owner-only); the files written into
    it follow the umask already. `out.parent` must exist.

    Raises:
        OSError: the staging folder cannot be created, or a rename fails (then `out`, if it existed, is untouched
            or still in the `.old` sibling).
    """
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)
    try:
        yield staging
        if out.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
            os.replace(out, retired / out.name)
            os.replace(staging, out)
            shutil.rmtree(retired)
        else:
            os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


__all__ = ["staged_folder"]
