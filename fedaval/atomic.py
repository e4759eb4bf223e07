"""Files replaced in one step: written to a temporary name, then renamed over
the target, so a kill at any moment leaves the previous complete version
(results.json, config.json, checkpoints, offloaded clients, dataset caches)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


@contextmanager
def atomic_file(path: Path, mode: str = "wb", sync: bool = True) -> Iterator[IO]:
    """Open ``path.tmp`` for writing; when the block ends without error, flush
    it (and fsync it, with ``sync``) and rename it to ``path``. On an error
    (a full disk, say) the temporary file is removed and ``path`` is left as
    it was; a temporary file left by a kill is simply overwritten next time."""
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
