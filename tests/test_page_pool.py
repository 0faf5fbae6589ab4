"""PagePool: hand-checked unit cases plus a Hypothesis state machine.

The state machine also simulates the device KV buffer: every appended token
writes a unique value into its slot, and every live sequence must read back
exactly its own tokens (and its shared prefix). Any block handed to two owners
at once, or reused while still referenced, shows up as a corrupted read.
"""
import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jtp.page_pool import PagePool, ReservationExceeded

# ---- unit tests -------------------------------------------------------------


def test_slot_mapping_across_block_boundary():
    pool = PagePool(num_blocks=8, block_size=4)
    assert pool.reserve("a", 8) and pool.reserve("b", 8)
    pool.append_slots("a", 2)  # a: block 0
    pool.append_slots("b", 2)  # b: block 1
    pool.append_slots("a", 6)  # a crosses into block 2
    pool.check_invariants()
    assert pool.block_table("a") == [0, 2]
    assert pool.num_tokens("a") == 6
    got = pool.slot_mapping("a", 2, 6)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, [0 * 4 + 2, 0 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1])
    np.testing.assert_array_equal(pool.slot_mapping("b", 0, 2), [4, 5])
    assert pool.slot_mapping("a", 3, 3).shape == (0,)
    with pytest.raises(ValueError):
        pool.slot_mapping("a", 0, 7)  # past the allocated tokens


def test_blocks_needed_and_can_ever_fit():
    pool = PagePool(num_blocks=4, block_size=16)
    assert [pool.blocks_needed(n) for n in (0, 1, 16, 17, 64)] == [0, 1, 1, 2, 4]
    assert pool.can_ever_fit(0) and pool.can_ever_fit(64)
    assert not pool.can_ever_fit(65)
    with pytest.raises(ValueError, match="only has 4"):
        pool.reserve("big", 65)  # must have been rejected at submit time
    pool.check_invariants()


def test_reserve_fails_when_full_and_succeeds_after_free():
    pool = PagePool(num_blocks=4, block_size=4)
    assert pool.reserve("a", 10)  # 3 blocks
    assert pool.num_reserved_blocks == 3 and pool.num_available_blocks == 1
    before = pool.usage()
    assert not pool.reserve("b", 8)  # needs 2, only 1 available
    assert pool.usage() == before and "b" not in pool
    pool.check_invariants()
    pool.append_slots("a", 5)
    pool.free("a")
    pool.check_invariants()
    assert pool.num_free_blocks == 4 and pool.num_reserved_blocks == 0
    assert pool.reserve("b", 8)
    pool.check_invariants()


def test_exceeding_reservation_raises():
    pool = PagePool(num_blocks=8, block_size=4)
    assert pool.reserve("a", 5)
    pool.append_slots("a", 5)
    before = pool.usage()
    with pytest.raises(ReservationExceeded, match="reserved only 5"):
        pool.append_slots("a", 6)  # still inside block 2, but past the declared max
    with pytest.raises(ValueError, match="shrink"):
        pool.append_slots("a", 4)
    assert pool.usage() == before and pool.num_tokens("a") == 5
    pool.check_invariants()


def test_free_unknown_or_twice_raises_keyerror():
    pool = PagePool(num_blocks=2, block_size=4)
    with pytest.raises(KeyError, match="unknown"):
        pool.free("nope")
    assert pool.reserve("a", 4)
    pool.free("a")
    with pytest.raises(KeyError, match="already freed"):
        pool.free("a")
    pool.check_invariants()


def test_shared_block_stays_allocated_until_last_owner_frees():
    pool = PagePool(num_blocks=6, block_size=4)
    assert pool.reserve("src", 10)
    pool.append_slots("src", 10)  # blocks [0, 1, 2]; block 2 is partial
    assert pool.share("src", "dst", 10) == 8  # only the two full blocks
    assert pool.block_table("dst") == [0, 1]
    assert pool.num_tokens("dst") == 8
    pool.check_invariants()
    assert pool.usage()["shared_blocks"] == 2

    pool.free("src")  # block 2 is freed, 0 and 1 are still dst's
    pool.check_invariants()
    assert pool.num_used_blocks == 2 and pool.num_free_blocks == 4
    np.testing.assert_array_equal(pool.slot_mapping("dst", 0, 8), np.arange(8))

    with pytest.raises(ReservationExceeded, match="no reservation"):
        pool.append_slots("dst", 9)  # sharing alone does not admit
    assert pool.reserve("dst", 12)  # counts the 2 shared blocks: reserves 1 more
    assert pool.num_reserved_blocks == 1
    pool.append_slots("dst", 12)
    pool.free("dst")
    pool.check_invariants()
    assert pool.num_free_blocks == 6 and pool.num_used_blocks == 0


def test_share_into_reserved_sequence_returns_reservation():
    pool = PagePool(num_blocks=6, block_size=4)
    assert pool.reserve("src", 8)
    pool.append_slots("src", 8)
    assert pool.reserve("dst", 12)  # 3 blocks reserved
    assert pool.num_available_blocks == 1
    assert pool.share("src", "dst", 8) == 8
    assert pool.num_available_blocks == 3  # two reserved blocks replaced by shared ones
    pool.check_invariants()
    pool.append_slots("dst", 12)
    assert pool.block_table("dst")[:2] == pool.block_table("src")
    pool.check_invariants()
    with pytest.raises(ValueError, match="already holds blocks"):
        pool.share("src", "dst", 4)
    with pytest.raises(ValueError, match="holds 8"):
        pool.share("src", "other", 9)


def test_free_list_is_fifo():
    pool = PagePool(num_blocks=3, block_size=1)
    assert pool.reserve("a", 1) and pool.reserve("b", 1)
    pool.append_slots("a", 1)
    pool.append_slots("b", 1)
    pool.free("a")  # block 0 goes behind never-used block 2
    assert pool.reserve("c", 2)
    pool.append_slots("c", 2)
    assert pool.block_table("c") == [2, 0]


# ---- stateful test ----------------------------------------------------------


class PagePoolMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(1, 12), block_size=st.sampled_from([1, 2, 3, 4, 8]))
    def make_pool(self, num_blocks, block_size):
        self.pool = PagePool(num_blocks, block_size)
        self.capacity = num_blocks * block_size
        self.kv = np.full(self.capacity, -1, dtype=np.int64)  # simulated KV buffer
        self.max_tokens = {}  # seq -> declared max, None if never admitted
        self.tokens = {}  # seq -> values it must read back
        self.next_seq = 0
        self.next_value = 0

    # -- helpers --

    def _new_seq(self):
        self.next_seq += 1
        return self.next_seq

    def _admitted(self, growable=None):
        return [
            s for s, m in self.max_tokens.items()
            if m is not None and (growable is None or (len(self.tokens[s]) < m) == growable)
        ]

    def _reserve(self, seq, max_tokens):
        """Reserve and check the outcome against the model; returns success."""
        held = self.pool.blocks_needed(len(self.tokens.get(seq, [])))
        expect = self.pool.blocks_needed(max_tokens) - held <= self.pool.num_available_blocks
        before = self.pool.usage()
        ok = self.pool.reserve(seq, max_tokens)
        assert ok == expect
        if ok:
            self.max_tokens[seq] = max_tokens
            self.tokens.setdefault(seq, [])
        else:
            assert self.pool.usage() == before
        return ok

    def _grow(self, seq, new_len):
        old_len = len(self.tokens[seq])
        self.pool.append_slots(seq, new_len)  # must never fail for an admitted sequence
        values = list(range(self.next_value, self.next_value + new_len - old_len))
        self.next_value += len(values)
        self.kv[self.pool.slot_mapping(seq, old_len, new_len)] = values
        self.tokens[seq] += values

    def _free(self, seq):
        self.pool.free(seq)
        del self.max_tokens[seq], self.tokens[seq]

    # -- rules --

    @rule(data=st.data())
    def reserve(self, data):
        max_tokens = data.draw(st.integers(0, self.capacity + self.capacity // 4 + 1))
        seq = self._new_seq()
        if not self.pool.can_ever_fit(max_tokens):
            with_error = self.pool.usage()
            with pytest.raises(ValueError):
                self.pool.reserve(seq, max_tokens)
            assert self.pool.usage() == with_error
            return
        self._reserve(seq, max_tokens)

    @precondition(lambda self: self._admitted(growable=True))
    @rule(data=st.data())
    def append_slots(self, data):
        seq = data.draw(st.sampled_from(self._admitted(growable=True)))
        new_len = data.draw(st.integers(len(self.tokens[seq]), self.max_tokens[seq]))
        self._grow(seq, new_len)

    @precondition(lambda self: self._admitted(growable=True))
    @rule(data=st.data())
    def grow_to_max(self, data):
        seq = data.draw(st.sampled_from(self._admitted(growable=True)))
        self._grow(seq, self.max_tokens[seq])

    @precondition(lambda self: self._admitted())
    @rule(data=st.data())
    def append_past_reservation(self, data):
        seq = data.draw(st.sampled_from(self._admitted()))
        before = self.pool.usage()
        with pytest.raises(ReservationExceeded):
            self.pool.append_slots(seq, self.max_tokens[seq] + data.draw(st.integers(1, 5)))
        assert self.pool.usage() == before

    @precondition(lambda self: any(self.tokens.values()))
    @rule(data=st.data())
    def share_then_reserve(self, data):
        """Prefix-cache style: share first, then reserve the rest (or stay unadmitted)."""
        src = data.draw(st.sampled_from([s for s, t in self.tokens.items() if t]))
        num_tokens = data.draw(st.integers(0, len(self.tokens[src])))
        dst = self._new_seq()
        shared = self.pool.share(src, dst, num_tokens)
        assert shared == num_tokens // self.pool.block_size * self.pool.block_size
        self.max_tokens[dst] = None
        self.tokens[dst] = self.tokens[src][:shared]
        if data.draw(st.booleans()):
            self._reserve(dst, data.draw(st.integers(shared, self.capacity)))

    @precondition(lambda self: [s for s, m in self.max_tokens.items() if m is None])
    @rule(data=st.data())
    def reserve_unadmitted(self, data):
        seq = data.draw(st.sampled_from([s for s, m in self.max_tokens.items() if m is None]))
        self._reserve(seq, data.draw(st.integers(len(self.tokens[seq]), self.capacity)))

    @precondition(lambda self: any(self.tokens.values()))
    @rule(data=st.data())
    def reserve_then_share(self, data):
        src = data.draw(st.sampled_from([s for s, t in self.tokens.items() if t]))
        dst = self._new_seq()
        if not self._reserve(dst, data.draw(st.integers(0, self.capacity))):
            return
        num_tokens = data.draw(st.integers(0, min(len(self.tokens[src]), self.max_tokens[dst])))
        available = self.pool.num_available_blocks
        shared = self.pool.share(src, dst, num_tokens)
        # The shared blocks replace reserved ones, which become available again.
        assert self.pool.num_available_blocks == available + shared // self.pool.block_size
        self.tokens[dst] = self.tokens[src][:shared]

    @precondition(lambda self: self._admitted(growable=False))
    @rule(data=st.data())
    def free_finished(self, data):
        self._free(data.draw(st.sampled_from(self._admitted(growable=False))))

    @precondition(lambda self: self.max_tokens)
    @rule(data=st.data())
    def abort_mid_stream(self, data):
        """Free a sequence that has not reached its max (or was never admitted)."""
        candidates = [s for s, m in self.max_tokens.items() if m is None or len(self.tokens[s]) < m]
        if candidates:
            self._free(data.draw(st.sampled_from(candidates)))

    @rule()
    def free_unknown_raises(self):
        with pytest.raises(KeyError):
            self.pool.free(-1)

    @rule()
    def free_everything(self):
        for seq in list(self.max_tokens):
            self._free(seq)
        self._assert_empty()

    # -- invariants --

    def _assert_empty(self):
        pool = self.pool
        assert pool.num_free_blocks == pool.total_blocks and pool.num_used_blocks == 0
        assert pool.num_reserved_blocks == 0 and pool.num_available_blocks == pool.total_blocks

    @invariant()
    def bookkeeping_is_consistent(self):
        self.pool.check_invariants()

    @invariant()
    def accounting_matches_model(self):
        pool = self.pool
        tables = {s: pool.block_table(s) for s in self.max_tokens}
        appearances = {}
        for table in tables.values():
            assert len(set(table)) == len(table)
            for block in table:
                appearances[block] = appearances.get(block, 0) + 1
        assert pool.num_used_blocks == len(appearances)
        assert pool.num_free_blocks + pool.num_used_blocks == pool.total_blocks
        expected_reserved = sum(
            pool.blocks_needed(m) - len(tables[s]) for s, m in self.max_tokens.items() if m is not None
        )
        assert pool.num_reserved_blocks == expected_reserved
        assert 0 <= pool.num_reserved_blocks <= pool.num_free_blocks

    @invariant()
    def every_sequence_reads_back_its_tokens(self):
        for seq, values in self.tokens.items():
            assert self.pool.num_tokens(seq) == len(values)
            slots = self.pool.slot_mapping(seq, 0, len(values))
            np.testing.assert_array_equal(self.kv[slots], values)

    def teardown(self):
        if hasattr(self, "pool"):
            for seq in list(self.max_tokens):
                self._free(seq)
            self.pool.check_invariants()
            self._assert_empty()


PagePoolMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
test_page_pool_state_machine = PagePoolMachine.TestCase
