"""Resume: how many batches each process has written for good.

Each process keeps one small JSON file, `.progress/process-<i>.json`, with
the number of leading batches whose writes have all completed (chunk files on
disk). It is rewritten atomically (at most five times a second, and when a
run ends or stops at a bad batch), so a process killed at any point leaves a
count it really wrote. A new run starts at the smallest count of all
processes and rewrites any later batch a process had begun: its rows come out
the same, so nothing is missing, duplicated or torn. When a run ends, the
count moves into the manifest and these files are removed.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import time

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
    """Tracks which batches of this process have landed; records the leading run of them.

    The count on disk is rewritten at most every `every` seconds (and by
    `flush`): a kill then costs a re-run of that much work, not a file
    rewrite per batch.
    """

    def __init__(self, path: pathlib.Path, process: int, first: int, every: float = 0.2):
        self._file = _file(path, process)
        self._file.parent.mkdir(exist_ok=True)
        self.committed = self._saved = first
        self._landed: set[int] = set()
        self._every, self._last = every, time.monotonic()

    def landed(self, batch: int) -> None:
        self._landed.add(batch)
        while self.committed in self._landed:
            self._landed.remove(self.committed)
            self.committed += 1
        if time.monotonic() - self._last >= self._every:
            self.flush()

    def flush(self) -> None:
        if self.committed != self._saved:
            replace_text(self._file, json.dumps({"batches": self.committed}))
            self._saved, self._last = self.committed, time.monotonic()


def clear(path: pathlib.Path) -> None:
    shutil.rmtree(path / FOLDER, ignore_errors=True)
