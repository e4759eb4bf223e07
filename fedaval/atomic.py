"""Files replaced in one step: written to a temporary name, then renamed over
the target, so a kill at any moment leaves the previous complete version
(results.json, config.json, checkpoints, offloaded clients, dataset caches)."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


@contextmanager
def atomic_file(path: Path, mode: str = "wb", sync: bool = True, shared: bool = False) -> Iterator[IO]:
    """Open ``path.tmp`` for writing; when the block ends without error, flush
    it (and fsync it, with ``sync``) and rename it to ``path``. On an error
    (a full disk, say) the temporary file is removed and ``path`` is left as
    it was; a temporary file left by a kill is simply overwritten next time.

    ``shared``: other processes may write ``path`` at the same moment (the
    dataset cache, which runs started side by side build together). Each
    writer then gets a temporary file of its own (``path.<random>.tmp``), so
    each renames a complete file and the last rename wins; with one name for
    all, a writer found its file renamed by another and failed. One left by
    a kill is not overwritten later: it stays until removed."""
    if shared:
        handle, name = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
        os.close(handle)
        tmp = Path(name)
    else:
        tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, mode) as fh:
            yield fh
            fh.flush()
            if sync:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise


def atomic_write_json(path: Path, data: Any) -> None:
    with atomic_file(path, "w") as fh:
        json.dump(data, fh, indent=2, sort_keys=False)
