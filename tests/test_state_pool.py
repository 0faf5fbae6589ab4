"""StatePool: hand-checked unit cases plus a Hypothesis state machine.

The state machine simulates the device's state slots: every write (a fresh `allocate`, or an
in-place write by the one holder of an exclusive slot) stores a unique value, and every holder
and every checkpoint must keep seeing the value it expects. A slot handed out while someone
still holds it, or a checkpoint overwritten while it can still be looked up, shows up as a
changed value. The machine also models refs, the free set, the LRU order of unreferenced
checkpoints and the reservation count exactly.
"""

import sys

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from jtp.core.state_pool import StatePool

# ---- unit tests -------------------------------------------------------------


def _take(pool: StatePool) -> int:
    assert pool.reserve()
    return pool.allocate()


def test_allocate_uses_up_a_reservation():
    pool = StatePool(3)
    assert pool.available() == 3 and pool.num_reserved == 0
    assert pool.reserve() and pool.reserve()
    assert pool.available() == 1 and pool.num_reserved == 2
    a, b = pool.allocate(), pool.allocate()
    assert {a, b} == {0, 1} and pool.num_reserved == 0 and pool.available() == 1
    assert pool.refs(a) == pool.refs(b) == 1
    assert pool.reserve() and not pool.reserve()  # the last slot is promised
    pool.unreserve()
    assert pool.available() == 1
    with pytest.raises(AssertionError):
        pool.allocate()  # no reservation held
    pool.check_invariants()


def test_exclusive_means_one_holder_and_no_key():
    pool = StatePool(2)
    s = _take(pool)
    assert pool.is_exclusive(s)
    pool.acquire(s)  # a second holder (a checkpoint freezing it): copy on write
    assert pool.refs(s) == 2 and not pool.is_exclusive(s)
    pool.release(s)
    assert pool.is_exclusive(s)
    assert pool.cache(s, b"k")  # a registered checkpoint is never written in place
    assert pool.refs(s) == 1 and not pool.is_exclusive(s)
    pool.check_invariants()


def test_checkpoint_outlives_its_holders_until_evicted():
    pool = StatePool(2)
    s = _take(pool)
    assert pool.cache(s, b"k") and pool.num_cached == 1
    pool.release(s)  # unreferenced but cached: evictable, still found, still counted as available
    assert pool.lookup(b"k") == s and pool.refs(s) == 0 and pool.available() == 2
    pool.acquire(s)  # a restore holds it: not evictable now
    assert pool.refs(s) == 1 and pool.available() == 1
    other = _take(pool)
    assert other != s and not pool.reserve()  # the held checkpoint is never evicted
    pool.release(s)
    pool.release(other)
    assert pool.available() == 2 and pool.lookup(b"k") == s
    pool.check_invariants()


def test_acquiring_a_checkpoint_takes_a_spare_slot():
    """An unreferenced checkpoint counts as available; holding it takes it out, so a caller
    must have a spare slot for it (Scheduler._admit acquires, then reserves, else releases)."""
    pool = StatePool(2)
    s = _take(pool)
    assert pool.cache(s, b"k")
    pool.release(s)
    assert pool.reserve() and pool.available() == 1
    pool.acquire(s)
    assert pool.available() == 0 and not pool.reserve()
    pool.release(s)
    assert pool.reserve() and pool.available() == 0  # both slots promised, the checkpoint among them
    pool.acquire(s)
    assert pool.available() == -1  # a reservation is broken: the caller must release at once
    pool.release(s)
    pool.check_invariants()
    assert pool.allocate() != pool.allocate() and pool.num_evicted == 1


def test_free_slots_go_before_checkpoints_and_checkpoints_leave_lru_first():
    pool = StatePool(4)
    slots = [_take(pool) for _ in range(3)]
    for i, s in enumerate(slots):
        assert pool.cache(s, b"k%d" % i)
    for i in (1, 0, 2):  # released in this order: LRU order 1, 0, 2
        pool.release(slots[i])
    assert _take(pool) == 3 and pool.num_evicted == 0  # a free slot first
    assert _take(pool) == slots[1] and pool.num_evicted == 1 and pool.lookup(b"k1") is None
    # A restore touches slot 0: released again, it is the most recently used.
    pool.acquire(slots[0])
    pool.release(slots[0])
    assert _take(pool) == slots[2] and pool.lookup(b"k2") is None
    assert _take(pool) == slots[0] and pool.lookup(b"k0") is None
    assert pool.num_evicted == 3 and pool.num_cached == 0 and pool.available() == 0
    pool.check_invariants()


def test_cache_refuses_duplicates_and_unheld_slots():
    pool = StatePool(3)
    a, b = _take(pool), _take(pool)
    assert pool.cache(a, b"k")
    assert not pool.cache(b, b"k")  # the key has a slot: the first stays
    assert not pool.cache(a, b"k2")  # the slot has a key
    assert pool.lookup(b"k") == a and pool.lookup(b"k2") is None and pool.num_cached == 1
    pool.release(b)
    with pytest.raises(ValueError, match="held"):
        pool.cache(b, b"k3")
    pool.check_invariants()


def test_uncache_and_reset_cache():
    pool = StatePool(4)
    a, b, c = _take(pool), _take(pool), _take(pool)
    for s, k in ((a, b"a"), (b, b"b"), (c, b"c")):
        assert pool.cache(s, k)
    pool.release(a)
    pool.release(b)
    pool.uncache(a)  # unreferenced: becomes free
    assert pool.lookup(b"a") is None and pool.num_cached == 2 and pool.available() == 3
    pool.uncache(c)  # held: just loses its key, and may be written in place again
    assert pool.lookup(b"c") is None and pool.is_exclusive(c)
    pool.uncache(c)  # no key: no-op
    assert pool.cache(c, b"c")
    assert pool.reset_cache() == 1  # only b: c is held
    assert pool.lookup(b"b") is None and pool.lookup(b"c") == c and pool.num_evicted == 0
    pool.release(c)
    assert pool.reset_cache() == 1 and pool.num_cached == 0 and pool.available() == 4
    pool.check_invariants()


def test_misuse_raises():
    with pytest.raises(ValueError):
        StatePool(0)
    pool = StatePool(2)
    with pytest.raises(ValueError, match="free"):
        pool.acquire(0)  # neither held nor cached
    with pytest.raises(ValueError, match="released more often"):
        pool.release(0)
    with pytest.raises(AssertionError):
        pool.unreserve()
    s = _take(pool)
    pool.release(s)
    with pytest.raises(ValueError):
        pool.release(s)
    pool.check_invariants()
    assert pool.available() == 2


# ---- stateful test ----------------------------------------------------------

KEYS = [b"k%d" % i for i in range(6)]


class StatePoolMachine(RuleBasedStateMachine):
    @initialize(num_slots=st.integers(1, 6))
    def make_pool(self, num_slots):
        self.pool = StatePool(num_slots)
        self.n = num_slots
        # Model.
        self.refs = [0] * num_slots
        self.free = set(range(num_slots))
        self.lru = []  # unreferenced checkpoints, least recently used first
        self.slot_of_key, self.key_of_slot = {}, {}
        self.reserved = 0
        self.evicted = 0
        # Simulated device contents: slot -> value; what each holder and checkpoint expects.
        self.value = [None] * num_slots
        self.counter = 0
        self.handles = []  # [slot, expected value], one per hold
        self.checkpoint_value = {}  # key -> value

    def _available(self):
        return len(self.free) + len(self.lru) - self.reserved

    def _write(self, slot):
        self.counter += 1
        self.value[slot] = self.counter
        return self.counter

    def _held_slots(self):
        return sorted({h[0] for h in self.handles})

    # -- rules --

    @rule()
    def reserve(self):
        expect = self._available() >= 1
        assert self.pool.reserve() == expect
        self.reserved += expect

    @precondition(lambda self: self.reserved)
    @rule()
    def unreserve(self):
        self.pool.unreserve()
        self.reserved -= 1

    @precondition(lambda self: self.reserved)
    @rule()
    def allocate(self):
        self._allocate()

    def _allocate(self):
        slot = self.pool.allocate()
        assert self.refs[slot] == 0, "allocated a held slot"
        if self.free:
            assert slot in self.free, "evicted a checkpoint while a free slot was there"
            self.free.remove(slot)
        else:
            assert slot == self.lru[0], "not the least recently used checkpoint"
            event("evicted a checkpoint")
            self.lru.pop(0)
            del self.slot_of_key[self.key_of_slot.pop(slot)]
            self.evicted += 1
        self.reserved -= 1
        self.refs[slot] = 1
        self.handles.append([slot, self._write(slot)])

    @rule(key=st.sampled_from(KEYS), keep=st.booleans())
    def make_checkpoint(self, key, keep):
        """What a request does: write a fresh slot, register it, and (usually) let go of it."""
        if not self.pool.reserve():
            assert self._available() < 1
            return
        self.reserved += 1
        self._allocate()
        slot = self.handles[-1][0]
        expect = key not in self.slot_of_key
        assert self.pool.cache(slot, key) == expect
        if expect:
            self.slot_of_key[key], self.key_of_slot[slot] = slot, key
            self.checkpoint_value[key] = self.value[slot]
        if not keep:
            self._release(self.handles[-1])

    @precondition(lambda self: self.handles)
    @rule(data=st.data())
    def write_in_place(self, data):
        """A holder writes its slot in place exactly when it is exclusive (else copy on write)."""
        handle = data.draw(st.sampled_from(self.handles))
        slot = handle[0]
        exclusive = self.refs[slot] == 1 and slot not in self.key_of_slot
        assert self.pool.is_exclusive(slot) == exclusive
        if exclusive:
            handle[1] = self._write(slot)

    @precondition(lambda self: self.handles or self.lru)
    @rule(data=st.data())
    def acquire(self, data):
        """A restore, a snapshot or a checkpoint: one more holder of a held or cached slot."""
        slot = data.draw(st.sampled_from(self._held_slots() + self.lru))
        if slot in self.lru and self._available() < 1:
            # Every spare slot is promised: taking this checkpoint would break a reservation. What
            # Scheduler._admit does then: acquire, fail to reserve, release (now the MRU checkpoint).
            self.pool.acquire(slot)
            assert self.pool.available() == -1 and not self.pool.reserve()
            self.pool.release(slot)
            self.lru.remove(slot)
            self.lru.append(slot)
            return
        self.pool.acquire(slot)
        if self.refs[slot] == 0:
            self.lru.remove(slot)
        self.refs[slot] += 1
        self.handles.append([slot, self.value[slot]])

    @precondition(lambda self: self.handles)
    @rule(data=st.data())
    def release(self, data):
        self._release(data.draw(st.sampled_from(self.handles)))

    def _release(self, handle):
        self.handles.remove(handle)
        slot = handle[0]
        self.pool.release(slot)
        self.refs[slot] -= 1
        if self.refs[slot] == 0:
            (self.lru.append if slot in self.key_of_slot else self.free.add)(slot)

    @precondition(lambda self: self.handles)
    @rule(data=st.data(), key=st.sampled_from(KEYS))
    def cache(self, data, key):
        slot = data.draw(st.sampled_from(self._held_slots()))
        expect = key not in self.slot_of_key and slot not in self.key_of_slot
        assert self.pool.cache(slot, key) == expect
        if expect:
            self.slot_of_key[key], self.key_of_slot[slot] = slot, key
            self.checkpoint_value[key] = self.value[slot]

    @rule(slot=st.integers(0, 5))
    def uncache(self, slot):
        if slot >= self.n:
            return
        self.pool.uncache(slot)
        key = self.key_of_slot.pop(slot, None)
        if key is not None:
            del self.slot_of_key[key]
            if self.refs[slot] == 0:
                self.lru.remove(slot)
                self.free.add(slot)

    @rule()
    def reset_cache(self):
        assert self.pool.reset_cache() == len(self.lru)
        for slot in self.lru:
            del self.slot_of_key[self.key_of_slot.pop(slot)]
        self.free |= set(self.lru)
        self.lru = []

    @rule(slot=st.integers(0, 5), op=st.sampled_from(["acquire", "release", "cache"]))
    def misuse_raises(self, slot, op):
        """Acquiring a free slot, releasing or caching an unheld one: ValueError, nothing changes."""
        if slot >= self.n or self.refs[slot] or (op == "acquire" and slot in self.lru):
            return
        before = (self.pool.available(), self.pool.num_cached, self.pool.num_reserved)
        with pytest.raises(ValueError):
            if op == "cache":
                self.pool.cache(slot, b"misuse")
            else:
                getattr(self.pool, op)(slot)
        assert (self.pool.available(), self.pool.num_cached, self.pool.num_reserved) == before

    # -- invariants --

    @invariant()
    def bookkeeping_is_consistent(self):
        self.pool.check_invariants()

    @invariant()
    def matches_model(self):
        pool = self.pool
        assert pool.available() == self._available() >= 0
        assert pool.num_reserved == self.reserved and pool.num_cached == len(self.slot_of_key)
        assert pool.num_evicted == self.evicted
        assert [pool.refs(s) for s in range(self.n)] == self.refs
        assert sorted(h[0] for h in self.handles) == sorted(s for s in range(self.n) for _ in range(self.refs[s]))
        for key in KEYS:
            assert pool.lookup(key) == self.slot_of_key.get(key)

    @invariant()
    def nothing_is_overwritten(self):
        for slot, expected in self.handles:
            assert self.value[slot] == expected, f"a holder of slot {slot} sees another's state"
        for key, slot in self.slot_of_key.items():
            assert self.value[slot] == self.checkpoint_value[key], f"checkpoint {key!r} was overwritten"

    def teardown(self):
        if not hasattr(self, "pool") or sys.exc_info()[0] is not None:
            return  # (a failing step is being reported)
        for slot, _ in self.handles:
            self.pool.release(slot)
        for _ in range(self.reserved):
            self.pool.unreserve()
        self.pool.check_invariants()
        assert self.pool.available() == self.n and self.pool.num_reserved == 0
        assert self.pool.num_cached == len(self.slot_of_key)  # unreferenced checkpoints stay until reset
        assert self.pool.reset_cache() == len(self.slot_of_key) and self.pool.num_cached == 0
        assert all(self.pool.refs(s) == 0 and self.pool.is_exclusive(s) is False for s in range(self.n))
        self.pool.check_invariants()


StatePoolMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
test_state_pool_state_machine = StatePoolMachine.TestCase
