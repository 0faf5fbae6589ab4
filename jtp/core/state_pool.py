"""Host-side pool of recurrent-state slots (Gated DeltaNet conv + delta-rule state) for hybrid models.

A slot holds one sequence's state at one position. Unlike K/V, a state cannot be shared by
pages: a request that continues from a state must not overwrite it if anyone else may still read
it. So slots are refcounted and copy-on-write:

* A running request holds the slot with its current state (`Request.state_slot`, -1 = the zero
  state at position 0). Its next row reads that slot and writes back in place when the slot is
  *exclusive* (one holder, not cached); otherwise (a checkpoint, a restored prefix) it writes a
  fresh slot, and the old one is left as it was. The step names both slots per row explicitly, so
  a row never reads a slot by accident.
* Checkpoints: a slot frozen at a block-aligned position is registered under the KV cache key of
  the block ending there (`cache`). Unreferenced cached slots are evicted least recently used when
  a slot is needed; referenced ones (a running request restoring from it, a snapshot) never are.
* Reservations keep admission exact: every running request that holds no exclusive slot has one
  reserved, so its next row always finds a slot to write. Making a checkpoint takes a spare slot
  (`available() >= 1`) or is skipped; it is an optimisation, never a requirement.
"""

from __future__ import annotations

from collections import OrderedDict


class StatePool:
    def __init__(self, num_slots: int):
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.num_slots = num_slots
        self._refs = [0] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # unreferenced, not cached; pop() gives 0, 1, ...
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced and cached, LRU first
        self._slot_of_key: dict[bytes, int] = {}
        self._key_of_slot: dict[int, bytes] = {}
        self._reserved = 0
        self.num_evicted = 0

    # ---- accounting ---------------------------------------------------------

    def available(self) -> int:
        """Slots a new reservation may count on: free or evictable, minus those promised."""
        return len(self._free) + len(self._evictable) - self._reserved

    @property
    def num_cached(self) -> int:
        return len(self._slot_of_key)

    @property
    def num_reserved(self) -> int:
        return self._reserved

    def refs(self, slot: int) -> int:
        return self._refs[slot]

    def is_exclusive(self, slot: int) -> bool:
        """One holder and no cache key: its owner may overwrite it in place."""
        return self._refs[slot] == 1 and slot not in self._key_of_slot

    # ---- reservations and holding --------------------------------------------

    def reserve(self) -> bool:
        if self.available() < 1:
            return False
        self._reserved += 1
        return True

    def unreserve(self) -> None:
        assert self._reserved > 0, "unreserve without a reservation"
        self._reserved -= 1

    def allocate(self) -> int:
        """Take a slot for writing, against a reservation the caller holds (which it uses up)."""
        self.unreserve()
        if self._free:
            slot = self._free.pop()
        else:
            slot, _ = self._evictable.popitem(last=False)
            del self._slot_of_key[self._key_of_slot.pop(slot)]
            self.num_evicted += 1
        self._refs[slot] = 1
        return slot

    def acquire(self, slot: int) -> None:
        """One more holder of a slot that is held or cached (a restore, a snapshot, a checkpoint)."""
        if self._refs[slot] == 0:
            if slot not in self._evictable:
                raise ValueError(f"state slot {slot} is free: nothing to hold")
            del self._evictable[slot]
        self._refs[slot] += 1

    def release(self, slot: int) -> None:
        if self._refs[slot] <= 0:
            raise ValueError(f"state slot {slot} released more often than held")
        self._refs[slot] -= 1
        if self._refs[slot] == 0:
            if slot in self._key_of_slot:
                self._evictable[slot] = None  # most recently used: evicted last
            else:
                self._free.append(slot)

    # ---- the checkpoint index -------------------------------------------------

    def lookup(self, key: bytes) -> int | None:
        return self._slot_of_key.get(key)

    def cached_slots(self) -> dict[int, bytes]:
        """Slot -> key of every checkpoint, in eviction order: the unreferenced ones least recently
        used first, then those held. Read-only (for saving the cache)."""
        out = {s: self._key_of_slot[s] for s in self._evictable}
        out.update((s, k) for s, k in self._key_of_slot.items() if self._refs[s])
        return out

    def cache(self, slot: int, key: bytes) -> bool:
        """Register a held slot as the state at the end of the block keyed `key`; False (nothing
        changes) if that key already has a slot or this slot a key."""
        if self._refs[slot] <= 0:
            raise ValueError(f"state slot {slot} must be held to be cached")
        if key in self._slot_of_key or slot in self._key_of_slot:
            return False
        self._slot_of_key[key] = slot
        self._key_of_slot[slot] = key
        return True

    def uncache(self, slot: int) -> None:
        """Drop a slot's key (no-op without one); an unreferenced slot becomes free."""
        key = self._key_of_slot.pop(slot, None)
        if key is None:
            return
        del self._slot_of_key[key]
        if self._refs[slot] == 0:
            del self._evictable[slot]
            self._free.append(slot)

    def reset_cache(self) -> int:
        """Forget every unreferenced checkpoint; returns how many."""
        dropped = list(self._evictable)
        for slot in dropped:
            self.uncache(slot)
        return len(dropped)

    # ---- checking ---------------------------------------------------------------

    def check_invariants(self) -> None:
        def check(cond: bool, msg: str) -> None:
            if not cond:
                raise AssertionError(msg)

        free, evictable = set(self._free), set(self._evictable)
        check(len(free) == len(self._free), "a slot is free twice")
        check(not free & evictable, "a slot is both free and evictable")
        for slot in range(self.num_slots):
            refs, cached = self._refs[slot], slot in self._key_of_slot
            check(refs >= 0, f"slot {slot} has negative refs")
            check((slot in free) == (refs == 0 and not cached), f"slot {slot}: free list disagrees (refs {refs})")
            check((slot in evictable) == (refs == 0 and cached), f"slot {slot}: evictable list disagrees")
        check(len(self._slot_of_key) == len(self._key_of_slot), "index and inverse differ")
        for key, slot in self._slot_of_key.items():
            check(self._key_of_slot.get(slot) == key, f"slot {slot} does not map back to its key")
        check(0 <= self._reserved <= len(free) + len(evictable), "more reserved than free or evictable")
