"""Resume: how many batches each process has written for good.

Each process keeps one small JSON file, `.progress/process-<i>.json`, with
the number of leading batches whose writes have all completed (chunk files on
disk). It is rewritten atomically after each batch, so a process killed at any
point leaves a count it really wrote. A new run starts at the smallest count
of all processes, and rewrites any later batch a process had begun: its rows
come out the same, so nothing is missing, duplicated or torn. When a run ends,
the count moves into the manifest and these files are removed.
"""

from __future__ import annotations

import json
import pathlib
import shutil

from ._manifest import replace_text

FOLDER = ".progress"


def _file(path: pathlib.Path, process: int) -> pathlib.Path:
    return path / FOLDER / f"process-{process}.json"


def start(path: pathlib.Path, processes: int, finished: int) -> int:
    """The first batch to write: every process has written all batches before it.

    `finished` is the manifest's count, which a process without a file (it
    committed nothing in the interrupted run) has written at least.
    """
    counts = [finished] * processes
    for file in (path / FOLDER).glob("process-*.json"):
        index = int(file.stem.removeprefix("process-"))
        count = json.loads(file.read_text())["batches"]
        if index < processes:
            counts[index] = count
        else:  # a process of an earlier run with more processes
            counts.append(count)
    return min(counts)


class Committer:
    """Tracks which batches of this process have landed; records the leading run of them."""

    def __init__(self, path: pathlib.Path, process: int, first: int):
        self._file = _file(path, process)
        self._file.parent.mkdir(exist_ok=True)
        self.committed = first
        self._landed: set[int] = set()

    def landed(self, batch: int) -> None:
        self._landed.add(batch)
        moved = False
        while self.committed in self._landed:
            self._landed.remove(self.committed)
            self.committed += 1
            moved = True
        if moved:
            replace_text(self._file, json.dumps({"batches": self.committed}))


def clear(path: pathlib.Path) -> None:
    shutil.rmtree(path / FOLDER, ignore_errors=True)
