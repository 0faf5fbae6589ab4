"""SnapshotManager: the snapshot registry plus the holds it keeps on the page pool and state slots.

`pin` turns the longest cached prefix of a sequence into a snapshot (its KV blocks reserved in the
pool under the snapshot's id, its recurrent-state checkpoint acquired); `unpin` gives them back to
the ordinary evictable cache; `install` pins what `jtp.engine.snapshot_store` read from disk. All
of it is host bookkeeping that runs with the engine's step lock held (the engine's `paused()`);
the only device work is the `scatter` callable `install` is given.
"""

from __future__ import annotations

import time

import numpy as np

from jtp.core.block_hash import block_keys
from jtp.core.page_pool import PagePool
from jtp.core.scheduler import Request, Scheduler, Status
from jtp.core.snapshots import Snapshot, SnapshotRegistry
from jtp.core.state_pool import StatePool
from jtp.errors import RequestError


class LoadedSnapshots(list):
    """What `load_snapshots` returns: the loaded snapshots' ids (a plain list of str otherwise),
    and how many of the saved prefix-cache entries (`include_prefix_cache`) this engine's cache
    now holds, written by the load or already there; the rest did not fit."""

    cache_blocks_saved: int = 0
    cache_blocks_loaded: int = 0
    cache_states_saved: int = 0
    cache_states_loaded: int = 0


class SnapshotManager(SnapshotRegistry):
    """Snapshots by id (LRU, within the entry cap and byte budget) and their pins in the pools."""

    def __init__(
        self, max_entries: int, budget_bytes: int, scheduler: Scheduler, pool: PagePool, states: StatePool | None,
        bytes_per_block: int, bytes_per_state_slot: int,
    ):
        super().__init__(max_entries, budget_bytes)
        self.scheduler, self.pool, self.states = scheduler, pool, states
        self.bytes_per_block, self.bytes_per_state_slot = bytes_per_block, bytes_per_state_slot

    def pin_request(self, req: Request) -> str:
        """Pin a request's prompt and output so far (running, or finished and not yet released)."""
        self._need_prefix_cache()
        if req.status is Status.RUNNING:
            self.scheduler.register_computed(req)  # what the last steps computed
        return self.pin(req.prompt_ids + req.output_ids)

    def pin_tokens(self, seq: list[int]) -> str | None:
        """Pin `seq` if the cache holds all of it; None if it must be prefilled first."""
        self._need_prefix_cache()
        if not seq:
            raise RequestError("cannot snapshot an empty token sequence")
        return self.pin(seq, partial_ok=False)

    def pin(self, seq: list[int], partial_ok: bool = True) -> str | None:
        """Pin the cached prefix of `seq` as a new snapshot; its id. None when `partial_ok` is
        False and less than every cacheable token is cached. RequestError (nothing held) when it
        cannot be made."""
        self._need_prefix_cache()
        sched, bs = self.scheduler, self.pool.block_size
        keys = block_keys(sched.cache_root, seq, bs)
        blocks, slot = sched.restorable(self.pool.lookup(keys), keys)
        # Hybrid: the last state checkpoint of a prompt sits a block before its end.
        full = len(keys) if self.states is None else (len(seq) - 1) // bs
        if not partial_ok and len(blocks) < full:
            return None
        nbytes = len(blocks) * self.bytes_per_block + (self.bytes_per_state_slot if slot >= 0 else 0)
        if nbytes > self.budget_bytes or self.max_entries == 0:
            raise RequestError(
                f"a snapshot of {len(blocks) * bs} cached tokens needs {nbytes} bytes; the snapshot budget is "
                f"{self.budget_bytes} bytes and {self.max_entries} entries"
            )
        for victim in self.victims(nbytes):
            self.unpin(self.pop(victim.id))
        if slot >= 0 and not self.states.refs(slot) and self.states.available() < 1:
            raise RequestError("no spare recurrent-state slot to pin a snapshot now (running requests hold "
                               "them); drop snapshots or retry when fewer requests run")
        snap = Snapshot(self.new_id(), list(seq), len(blocks) * bs, blocks, slot, nbytes)
        if not self.pool.reserve(snap.pool_id, snap.num_cached_tokens, blocks):
            raise RequestError(
                f"the KV pool cannot pin {len(blocks)} more blocks now ({self.pool.num_available_blocks} available); "
                "drop snapshots or retry when fewer requests run"
            )
        if slot >= 0:
            self.states.acquire(slot)
        self.add(snap)
        return snap.id

    def _need_prefix_cache(self) -> None:
        if self.scheduler.cache_root is None:
            raise RequestError("snapshots need prefix caching (the engine runs with enable_prefix_caching=False)")

    def unpin(self, snap: Snapshot) -> None:
        """Give a (popped) snapshot's blocks and state back to the ordinary, evictable cache."""
        self.pool.free(snap.pool_id)
        if snap.state_slot >= 0:
            self.states.release(snap.state_slot)

    def drop(self, snapshot_id: str) -> None:
        self.unpin(self.pop(snapshot_id))

    def evict_oldest(self) -> Snapshot:
        """Drop the least recently used snapshot (a request that does not fit beside them); it."""
        victim = next(iter(self))
        self.drop(victim.id)
        return victim

    def install(
        self, entries, sizes, block_keys_saved, state_keys_saved, arrays, cache_rows, cache_state_rows, scatter
    ) -> LoadedSnapshots:
        """Allocate blocks and state slots for pages a load read, `scatter` them there, register them
        in the prefix cache and pin the snapshots (step lock held). Every check that can fail comes before the first
        change that cannot be undone; a device failure undoes the host bookkeeping. The snapshots go
        all or nothing; then the cache entries (`cache_rows` / `cache_state_rows`, least recently
        used first) take what is left, the most recently used first, and are registered unpinned."""
        pool, states, bs = self.pool, self.states, self.pool.block_size
        stamp = (id(entries), time.monotonic_ns())
        load_id, cache_id = ("snapshot-load", *stamp), ("cache-load", *stamp)
        snap_rows = sorted({r for e in entries for r in e["blocks"]})
        snap_state_rows = sorted({e["state"] for e in entries if e["state"] >= 0})

        # Blocks: what the prefix cache already holds is shared; the rest is written to fresh blocks.
        held = {i: blocks[0] for i in snap_rows if (blocks := pool.lookup([block_keys_saved[i]]))}
        fresh = [i for i in snap_rows if i not in held]
        total = len(snap_rows)
        if total > pool.total_blocks:
            raise RequestError(f"the snapshots need {total} KV blocks but the engine's whole pool has {pool.total_blocks}")

        # State checkpoints likewise. Acquired / reserved first: the pool's block allocation below may
        # evict cached blocks, which cannot be undone, so everything that can refuse goes before it.
        acquired: list[int] = []  # the load's own holds on slots, let go at the end (in this order)
        reserved = 0
        slot_of: dict[int, int] = {}

        def undo_states():
            for _ in range(reserved):
                states.unreserve()
            for slot in acquired:
                states.release(slot)

        fresh_states = []
        for j in snap_state_rows:
            slot = states.lookup(state_keys_saved[j])
            if slot is None:
                fresh_states.append(j)
                continue
            if not states.refs(slot) and states.available() < 1:  # every spare slot is promised to a request
                undo_states()
                raise RequestError("no spare recurrent-state slot to pin a loaded snapshot now (running requests hold "
                                   "them); drop snapshots or retry when fewer requests run")
            states.acquire(slot)
            acquired.append(slot)
            slot_of[j] = slot
        for _ in fresh_states:
            if not states.reserve():
                undo_states()
                raise RequestError(
                    f"no state slots for {len(fresh_states)} snapshot checkpoints ({reserved} available); "
                    "drop snapshots or retry when fewer requests run"
                )
            reserved += 1

        cached_blocks = [held[i] for i in snap_rows if i in held]
        if not pool.reserve(load_id, total * bs, cached_blocks):
            undo_states()
            raise RequestError(
                f"the KV pool cannot take {len(fresh)} more blocks now ({pool.num_available_blocks} available); "
                "drop snapshots or retry when fewer requests run"
            )
        # From here on nothing refuses: the cache entries take what is left, and the only failure is the device's.

        # Cache entries already cached here are kept through the load (revived by its temporary
        # sequence, so its own allocations cannot evict them); the others get fresh blocks, as many as
        # are available, the most recently used first.
        c_keep = [(r, blocks[0]) for r in cache_rows if (blocks := pool.lookup([block_keys_saved[r]]))]
        c_fresh = [r for r in cache_rows if not pool.lookup([block_keys_saved[r]])]
        keep = [b for _, b in c_keep]
        available = pool.num_available_blocks
        revived = 0
        if keep and pool.reserve(cache_id, len(keep) * bs, keep):  # what keeping them costs (revived blocks)
            revived = available - pool.num_available_blocks
            pool.free(cache_id)
        else:
            keep = []
        n = max(0, min(len(c_fresh), available - revived))
        if not pool.reserve(cache_id, (len(keep) + n) * bs, keep):  # n + revived <= available: fits
            raise AssertionError("reserving the available blocks failed")
        # Table order: most recently used first, so freeing it (tail first) leaves them in their saved LRU order.
        c_chosen = c_fresh[len(c_fresh) - n:][::-1]

        pool.append_slots(load_id, total * bs)
        pool.append_slots(cache_id, (len(keep) + n) * bs)
        fresh_blocks = pool.block_table(load_id)[len(cached_blocks):]
        c_fresh_blocks = pool.block_table(cache_id)[len(keep):]
        block_of = dict(held) | dict(zip(fresh, fresh_blocks))
        new_slots = []
        for j in fresh_states:
            slot = states.allocate()  # against the reservation made above
            reserved -= 1
            new_slots.append(slot)
            slot_of[j] = slot
        acquired += new_slots

        # State checkpoints of the cache: only where their KV block is cached (else no hit can end
        # there); those already here are held through the load when that takes no promised slot.
        c_new_slots, c_states = [], []  # most recently used first
        if cache_state_rows:
            cached_keys = {block_keys_saved[r] for r in snap_rows} | {block_keys_saved[r] for r in c_chosen}
            wanted = []
            for j in cache_state_rows:
                key = state_keys_saved[j]
                if key not in cached_keys and not pool.lookup([key]):
                    continue
                slot = states.lookup(key)
                if slot is None:
                    wanted.append(j)
                elif states.refs(slot) or states.available() >= 1:
                    states.acquire(slot)
                    acquired.append(slot)
            for j in reversed(wanted):
                if not states.reserve():
                    break
                reserved += 1
                c_new_slots.append(states.allocate())
                reserved -= 1
                c_states.append(j)

        try:
            b_ids, b_rows = fresh_blocks + c_fresh_blocks, fresh + c_chosen
            s_ids, s_rows = new_slots + c_new_slots, fresh_states + c_states
            if b_ids or s_ids:
                scatter(
                    np.asarray(b_ids, np.int32), np.asarray(b_rows, np.int32), np.asarray(s_ids, np.int32),
                    np.asarray(s_rows, np.int32), arrays,
                )
        except BaseException:
            pool.free(load_id)  # fresh blocks have no key yet: plainly free again
            pool.free(cache_id)
            for slot in c_new_slots:
                states.release(slot)
            undo_states()
            raise

        # The pages are in place: register them in the prefix cache, pin each snapshot, let go of the load's hold.
        for k, row in enumerate(fresh):
            pool.cache_block(load_id, len(cached_blocks) + k, block_keys_saved[row])
        for k, row in enumerate(c_chosen):
            pool.cache_block(cache_id, len(keep) + k, block_keys_saved[row])
        for j, slot in zip(fresh_states, new_slots):
            states.cache(slot, state_keys_saved[j])
        for j, slot in zip(c_states, c_new_slots):
            states.cache(slot, state_keys_saved[j])
        acquired += c_new_slots[::-1]  # released least recently used first: evicted in their saved order
        ids = LoadedSnapshots()
        registry = self
        try:
            for e, nbytes in zip(entries, sizes):
                sid = e["id"] if e["id"] not in registry else registry.new_id()
                blocks = [block_of[r] for r in e["blocks"]]
                slot = slot_of[e["state"]] if e["state"] >= 0 else -1
                for victim in registry.victims(nbytes):
                    self.unpin(registry.pop(victim.id))
                snap = Snapshot(sid, list(e["tokens"]), e["num_cached_tokens"], blocks, slot, nbytes)
                if not pool.reserve(snap.pool_id, snap.num_cached_tokens, blocks):  # held blocks: cannot fail
                    raise AssertionError("pinning held blocks failed")
                if slot >= 0:
                    states.acquire(slot)
                snap.created = e.get("created", snap.created)
                registry.add(snap)
                ids.append(sid)
        except BaseException:
            for sid in ids:
                self.unpin(registry.pop(sid))
            raise
        finally:
            pool.free(cache_id)
            pool.free(load_id)
            for slot in acquired:
                states.release(slot)
        ids.cache_blocks_saved, ids.cache_states_saved = len(cache_rows), len(cache_state_rows)
        ids.cache_blocks_loaded = sum(1 for r in cache_rows if pool.lookup([block_keys_saved[r]]))
        ids.cache_states_loaded = sum(1 for j in cache_state_rows if states.lookup(state_keys_saved[j]) is not None)
        return ids
