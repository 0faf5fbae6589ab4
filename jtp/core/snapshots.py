"""Explicit KV snapshots: named, pinned prefixes a caller can continue from later.

A snapshot is a token sequence plus a hold on the longest prefix of it that the prefix cache
has: its KV blocks (pinned in the page pool under the sequence id ("snapshot", id)) and, on
hybrid models, the recurrent-state checkpoint at that prefix's end. Restoring submits the tokens
(plus any new ones) as a prompt; admission then finds the pinned prefix and prefills only the
tail, so a restored continuation is exactly the uncached one, only cheaper. The registry here is
host bookkeeping only (LRU order, the entry cap and the byte budget); `Engine.snapshot` does
the pinning under the step lock, and `jtp.engine.snapshot_store` writes snapshots to disk.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import OrderedDict


@dataclasses.dataclass
class Snapshot:
    id: str
    tokens: list[int]  # the whole sequence to continue from
    num_cached_tokens: int  # its leading tokens held in the cache (a multiple of the block size)
    blocks: list[int]  # the pinned KV blocks
    state_slot: int  # the pinned recurrent-state checkpoint (-1: none, or not a hybrid model)
    nbytes: int  # device memory it holds
    created: float = dataclasses.field(default_factory=time.time)

    @property
    def pool_id(self) -> tuple[str, str]:
        return ("snapshot", self.id)


class SnapshotRegistry:
    """Snapshots by id in least-recently-used order, within an entry cap and a byte budget."""

    def __init__(self, max_entries: int, budget_bytes: int):
        self.max_entries = max_entries
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[str, Snapshot] = OrderedDict()
        self._ids = itertools.count()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, snapshot_id: str) -> bool:
        return snapshot_id in self._entries

    def __iter__(self):
        return iter(list(self._entries.values()))

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self._entries.values())

    def new_id(self) -> str:
        while (sid := f"snap-{next(self._ids)}") in self._entries:
            pass
        return sid

    def get(self, snapshot_id: str) -> Snapshot:
        """The snapshot, now the most recently used; KeyError names the id."""
        try:
            self._entries.move_to_end(snapshot_id)
        except KeyError:
            raise KeyError(f"unknown snapshot {snapshot_id!r} (never made, dropped, or evicted)") from None
        return self._entries[snapshot_id]

    def victims(self, nbytes: int) -> list[Snapshot]:
        """The least recently used snapshots to evict so one more of `nbytes` fits."""
        out, count, total = [], len(self._entries), self.nbytes
        for snap in self._entries.values():
            if count < self.max_entries and total + nbytes <= self.budget_bytes:
                break
            out.append(snap)
            count, total = count - 1, total - snap.nbytes
        return out

    def add(self, snap: Snapshot) -> None:
        self._entries[snap.id] = snap

    def pop(self, snapshot_id: str) -> Snapshot:
        snap = self._entries.pop(snapshot_id, None)
        if snap is None:
            raise KeyError(f"unknown snapshot {snapshot_id!r} (never made, dropped, or evicted)")
        return snap
