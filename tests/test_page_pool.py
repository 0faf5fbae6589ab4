"""PagePool: hand-checked unit cases plus a Hypothesis state machine.

The state machine also simulates the device KV buffer: every appended token writes
(the token prefix it ends, a unique write serial) into its slot, and every live
sequence must read back exactly its own prefixes with the serials it expects
(its own writes, or those of the cached blocks it revived). Any block handed to
two owners at once, reused while still referenced, or handed out while its cached
content was still expected shows up as a corrupted read. The machine also models
the free list's LRU order and the cache index exactly.
"""
import sys

import numpy as np
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

from jtp.core.block_hash import block_keys, root_key
from jtp.core.page_pool import PagePool, ReservationExceeded

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


def test_truncate_gives_blocks_back_to_the_reservation():
    """Rejected speculative tokens: the pool shrinks to the kept tokens, the freed blocks stay
    promised to the sequence (it may grow there again), and nothing leaks when it ends."""
    pool = PagePool(num_blocks=6, block_size=4)
    assert pool.reserve("a", 20)  # 5 blocks promised
    pool.append_slots("a", 13)  # 4 blocks held, 1 reserved
    held = pool.block_table("a")
    pool.truncate("a", 6)  # blocks 3 and 4 held only rejected tokens
    assert pool.block_table("a") == held[:2] and pool.num_tokens("a") == 6
    assert pool.num_reserved_blocks == 3 and pool.num_available_blocks == 1  # the other sequence's share unchanged
    pool.check_invariants()
    with pytest.raises(ValueError, match="truncate"):
        pool.truncate("a", 7)
    pool.append_slots("a", 20)
    assert len(pool.block_table("a")) == 5 and pool.num_reserved_blocks == 0
    pool.free("a")
    assert pool.num_free_blocks == 6
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


def _filled(pool, seq, num_tokens, max_tokens=None, prefix=()):
    assert pool.reserve(seq, num_tokens if max_tokens is None else max_tokens, prefix)
    pool.append_slots(seq, num_tokens)
    return pool.block_table(seq)


def test_prefix_blocks_stay_allocated_until_last_holder_frees():
    pool = PagePool(num_blocks=6, block_size=4)
    assert _filled(pool, "src", 10) == [0, 1, 2]  # block 2 is partial
    assert pool.cache_block("src", 0, b"k0") and pool.cache_block("src", 1, b"k1")
    prefix = pool.lookup([b"k0", b"k1", b"k2"])
    assert prefix == [0, 1]
    assert pool.reserve("dst", 12, prefix)  # the 2 cached blocks plus 1 reserved
    assert pool.block_table("dst") == [0, 1] and pool.num_tokens("dst") == 8
    assert pool.num_reserved_blocks == 1 and pool.usage()["shared_blocks"] == 2
    pool.check_invariants()

    pool.free("src")  # block 2 is freed, 0 and 1 are still dst's
    pool.check_invariants()
    assert pool.num_used_blocks == 2 and pool.num_free_blocks == 4
    np.testing.assert_array_equal(pool.slot_mapping("dst", 0, 8), np.arange(8))
    pool.append_slots("dst", 12)
    assert pool.block_table("dst")[:2] == [0, 1] and pool.block_table("dst")[2] not in (0, 1)
    pool.free("dst")
    pool.check_invariants()
    assert pool.num_free_blocks == 6 and pool.num_used_blocks == 0 and pool.num_reserved_blocks == 0
    assert pool.num_cached_blocks == 2 and pool.lookup([b"k0", b"k1"]) == [0, 1]  # still revivable


def test_reserve_rejects_malformed_prefixes():
    pool = PagePool(num_blocks=6, block_size=4)
    _filled(pool, "a", 12)  # blocks 0, 1, 2
    assert pool.cache_block("a", 0, b"k0") and pool.cache_block("a", 1, b"k1")
    before = pool.usage()
    with pytest.raises(ValueError, match="distinct cached blocks"):
        pool.reserve("b", 16, [0, 2])  # block 2 is not cached
    with pytest.raises(ValueError, match="distinct cached blocks"):
        pool.reserve("b", 16, [0, 0])
    with pytest.raises(ValueError, match="exceeds"):
        pool.reserve("b", 7, [0, 1])  # 2 blocks are 8 tokens
    with pytest.raises(ValueError, match="already holds"):
        pool.reserve("a", 16, [0])
    assert pool.usage() == before and "b" not in pool
    pool.check_invariants()


def test_lookup_stops_at_first_miss():
    pool = PagePool(num_blocks=4, block_size=2)
    _filled(pool, "a", 8)
    assert pool.cache_block("a", 0, b"k0") and pool.cache_block("a", 2, b"k2")  # block 1 not cached
    assert pool.lookup([b"k0", b"k1", b"k2"]) == [0]
    assert pool.lookup([b"k2"]) == [2]
    assert pool.lookup([b"x", b"k0"]) == []
    assert pool.lookup([]) == []
    assert pool.num_cached_blocks == 2


def test_cache_block_refuses_duplicate_key_and_rekeying():
    pool = PagePool(num_blocks=6, block_size=4)
    _filled(pool, "a", 8)  # blocks 0, 1
    assert pool.cache_block("a", 0, b"k0")
    assert not pool.cache_block("a", 1, b"k0")  # the key names block 0 already: the first stays
    assert not pool.cache_block("a", 0, b"k1")  # block 0 has a key already
    assert pool.lookup([b"k0"]) == [0] and pool.lookup([b"k1"]) == [] and pool.num_cached_blocks == 1
    assert pool.cache_block("a", 1, b"k1")
    # A second sequence that computed the same prefix itself cannot register it again.
    _filled(pool, "b", 8)
    assert not pool.cache_block("b", 0, b"k0")
    assert pool.lookup([b"k0", b"k1"]) == [0, 1]
    # A sequence that revived the block cannot re-register it under another key either.
    assert pool.reserve("c", 4, pool.lookup([b"k0"]))
    assert not pool.cache_block("c", 0, b"other")
    _filled(pool, "d", 6, 8)
    with pytest.raises(ValueError, match="not a full block"):
        pool.cache_block("d", 1, b"partial")
    with pytest.raises(ValueError, match="not a full block"):
        pool.cache_block("d", -1, b"negative")
    with pytest.raises(KeyError):
        pool.cache_block("nope", 0, b"x")
    pool.check_invariants()
    assert pool.num_cached_blocks == 2


def test_eviction_is_least_recently_freed_first():
    pool = PagePool(num_blocks=5, block_size=1)
    for seq, key in (("a", b"ka"), ("b", b"kb"), ("c", b"kc")):
        _filled(pool, seq, 1)
        assert pool.cache_block(seq, 0, key)
    assert [pool.block_table(s) for s in "abc"] == [[0], [1], [2]]
    for seq in "bac":
        pool.free(seq)  # free list now: 3, 4 (never used), then 1 (b), 0 (a), 2 (c)
    assert pool.num_cached_blocks == 3 and pool.num_evicted == 0
    assert _filled(pool, "d", 3) == [3, 4, 1]  # uncached blocks first, then b's: the LRU one
    assert pool.num_evicted == 1 and pool.lookup([b"kb"]) == []
    assert pool.lookup([b"ka"]) == [0] and pool.lookup([b"kc"]) == [2]
    # Reviving a's block takes it out of the middle of the free list: c's goes next.
    assert pool.reserve("e", 1, pool.lookup([b"ka"]))
    assert _filled(pool, "f", 1) == [2]
    assert pool.num_evicted == 2 and pool.lookup([b"kc"]) == [] and pool.lookup([b"ka"]) == [0]
    pool.check_invariants()
    assert pool.num_free_blocks == 0 and pool.num_cached_blocks == 1
    # A block freed again goes to the back, as the most recently used.
    for seq in "dfe":
        pool.free(seq)
    assert _filled(pool, "g", 4) == [1, 4, 3, 2]  # d's blocks tail first, then f's; e's block 0 last
    assert pool.lookup([b"ka"]) == [0] and pool.num_evicted == 2


def test_free_returns_tail_first_so_prefix_blocks_survive_longest():
    pool = PagePool(num_blocks=3, block_size=1)
    _filled(pool, "a", 3)
    keys = block_keys(root_key("t"), [5, 6, 7], 1)
    for i, key in enumerate(keys):
        assert pool.cache_block("a", i, key)
    pool.free("a")
    assert _filled(pool, "b", 1) == [2]  # the last block goes first
    assert pool.lookup(keys) == [0, 1]  # the prefix is intact
    assert pool.num_evicted == 1


def test_admission_counts_revived_blocks_exactly():
    pool = PagePool(num_blocks=4, block_size=4)
    assert _filled(pool, "a", 8) == [0, 1]
    assert pool.cache_block("a", 0, b"k0") and pool.cache_block("a", 1, b"k1")
    pool.free("a")  # free list: 2, 3, 1, 0
    assert _filled(pool, "h", 4) == [2]  # an uncached block: no eviction
    prefix = pool.lookup([b"k0", b"k1"])
    assert prefix == [0, 1] and pool.num_available_blocks == 3
    before = pool.usage()
    # 2 revived + 2 new = 4 > 3: does not fit, nothing changes.
    assert not pool.reserve("x", 16, prefix)
    assert pool.usage() == before and "x" not in pool
    # 2 revived + 1 new = 3: just fits.
    assert pool.reserve("x", 12, prefix)
    assert pool.num_free_blocks == 1 and pool.num_reserved_blocks == 1 and pool.num_available_blocks == 0
    # Held blocks are not revived: they cost nothing.
    assert pool.reserve("y", 8, prefix)
    assert pool.usage()["shared_blocks"] == 2
    assert not pool.reserve("z", 12, prefix)  # ... but one new block is one too many
    pool.append_slots("x", 12)
    assert pool.block_table("x") == [0, 1, 3] and pool.num_evicted == 0
    pool.check_invariants()
    for seq in "xyh":
        pool.free(seq)
    pool.check_invariants()
    assert pool.num_free_blocks == 4 and pool.num_reserved_blocks == 0


def test_pinned_prefix_survives_pressure_and_is_revivable_after_unpin():
    pool = PagePool(num_blocks=4, block_size=2)
    _filled(pool, "a", 4)
    assert pool.cache_block("a", 0, b"k0") and pool.cache_block("a", 1, b"k1")
    pool.free("a")
    snap = ("snapshot", "s")
    assert pool.reserve(snap, 4, pool.lookup([b"k0", b"k1"]))  # a pin: exactly its blocks, no growth
    assert pool.num_reserved_blocks == 0 and pool.num_tokens(snap) == 4
    with pytest.raises(ReservationExceeded):
        pool.append_slots(snap, 5)
    assert not pool.reserve("big", 6)  # the pinned blocks are not available
    assert _filled(pool, "fill", 4) == [2, 3]
    assert pool.num_evicted == 0 and pool.lookup([b"k0", b"k1"]) == [0, 1]
    pool.free("fill")
    pool.free(snap)
    pool.check_invariants()
    assert pool.lookup([b"k0", b"k1"]) == [0, 1] and pool.num_free_blocks == 4


def test_reset_cache_drops_only_unheld_blocks():
    pool = PagePool(num_blocks=4, block_size=2)
    _filled(pool, "a", 4)
    _filled(pool, "b", 4)
    for seq, keys in (("a", (b"a0", b"a1")), ("b", (b"b0", b"b1"))):
        for i, key in enumerate(keys):
            assert pool.cache_block(seq, i, key)
    pool.free("a")
    assert pool.reset_cache() == 2
    assert pool.lookup([b"a0"]) == [] and pool.lookup([b"b0", b"b1"]) == [2, 3]
    assert pool.num_cached_blocks == 2 and pool.num_free_blocks == 2
    pool.free("b")
    assert pool.reset_cache() == 2 and pool.num_cached_blocks == 0
    pool.check_invariants()
    assert _filled(pool, "c", 8) == [1, 0, 3, 2] and pool.num_evicted == 0  # tail first, nothing cached


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

ALPHABET = st.integers(0, 2)  # few distinct tokens: prefixes repeat and the cache hits


class PagePoolMachine(RuleBasedStateMachine):
    """Random admit (cold or from the cache) / grow / register / free / pin / reset_cache
    against a model of the free list (LRU order), the cache index and the device KV buffer."""

    @initialize(num_blocks=st.integers(1, 12), block_size=st.sampled_from([1, 2, 3, 4]))
    def make_pool(self, num_blocks, block_size):
        self.pool = PagePool(num_blocks, block_size)
        self.bs = block_size
        self.capacity = num_blocks * block_size
        self.root = root_key("page-pool-test")
        # Simulated KV buffer: per slot, the token prefix whose K/V it holds and the write serial.
        self.kv = [None] * self.capacity
        self.serial = 0
        # Live sequences: seq -> {"tokens", "serials" (expected per position), "max", "plan" (tokens to come)}.
        self.seqs = {}
        self.history = []  # token lists of every sequence seen (sources of shared prefixes)
        # Model of the pool.
        self.free_order = list(range(num_blocks))  # front = next handed out
        self.registry = {}  # key -> (block, expected kv entries of the block)
        self.key_of_block = {}
        self.evicted = 0
        self.next_seq = 0

    # -- helpers --

    def _new_seq(self):
        self.next_seq += 1
        return self.next_seq

    def _expected(self, seq, positions):
        s = self.seqs[seq]
        return [(tuple(s["tokens"][: p + 1]), s["serials"][p]) for p in positions]

    def _growable(self):
        return [s for s, m in self.seqs.items() if len(m["tokens"]) < m["max"]]

    def _with_full_blocks(self):
        return [s for s, m in self.seqs.items() if len(m["tokens"]) >= self.bs]

    def _model_reserved(self):
        return sum(self.pool.blocks_needed(m["max"]) - len(self.pool.block_table(s)) for s, m in self.seqs.items())

    def _source_tokens(self, data):
        """A token list that often shares a prefix with an earlier or live sequence."""
        cached = [list(entries[-1][0]) for _, entries in self.registry.values()]  # prefixes ending at a cached block
        sources = self.history[-8:] + [m["tokens"] for m in self.seqs.values()] + cached
        base = data.draw(st.sampled_from(sources)) if sources and data.draw(st.integers(0, 3)) else []
        cut = data.draw(st.one_of(st.just(len(base)), st.integers(0, len(base))))
        extra = data.draw(st.lists(ALPHABET, max_size=2 * self.bs + 1))
        return (list(base[:cut]) + extra)[: self.capacity]

    def _lookup(self, tokens):
        """lookup(), checked against the model: the longest prefix of registered keys."""
        keys = block_keys(self.root, tokens, self.bs)
        found = self.pool.lookup(keys)
        expected = []
        for key in keys:
            if key not in self.registry:
                break
            expected.append(self.registry[key][0])
        assert found == expected, "lookup disagrees with the cache model"
        return found

    def _admit(self, seq, tokens, prefix, max_tokens):
        """reserve(seq, max_tokens, prefix) checked against the model; True if admitted."""
        revived = [b for b in prefix if b in self.free_order]
        needed = self.pool.blocks_needed(max_tokens) - len(prefix)
        assert self.pool.num_available_blocks == len(self.free_order) - self._model_reserved()
        expect = needed + len(revived) <= self.pool.num_available_blocks
        before = self.pool.usage()
        ok = self.pool.reserve(seq, max_tokens, prefix)
        assert ok == expect, f"reserve -> {ok}, model expects {expect}"
        event(f"reserve: {'ok' if ok else 'refused'}, {'revives' if revived else 'no revival'}")
        if not ok:
            assert self.pool.usage() == before
            return False
        for block in revived:
            self.free_order.remove(block)
        n = len(prefix) * self.bs
        serials = [self.registry[self.key_of_block[b]][1][i][1] for b in prefix for i in range(self.bs)]
        self.seqs[seq] = {"tokens": list(tokens[:n]), "serials": serials, "max": max_tokens, "plan": list(tokens[n:])}
        assert self.pool.block_table(seq) == list(prefix) and self.pool.num_tokens(seq) == n
        return True

    def _grow(self, seq, new_len, data):
        s = self.seqs[seq]
        old_len, old_blocks = len(s["tokens"]), len(self.pool.block_table(seq))
        held_by_others = {b for o in self.seqs if o != seq for b in self.pool.block_table(o)}
        self.pool.append_slots(seq, new_len)  # never fails for an admitted sequence
        new_blocks = self.pool.block_table(seq)[old_blocks:]
        # The free list hands out its least recently freed blocks, never a held one.
        assert new_blocks == self.free_order[: len(new_blocks)], "not the LRU blocks"
        assert not set(new_blocks) & held_by_others, "a held block was handed out again"
        del self.free_order[: len(new_blocks)]
        for block in new_blocks:
            key = self.key_of_block.pop(block, None)
            if key is not None:  # evicted: its cached content is no longer expected
                event("evicted a cached block")
                del self.registry[key]
                self.evicted += 1
        assert self.pool.num_evicted == self.evicted
        for p in range(old_len, new_len):
            token = s["plan"].pop(0) if s["plan"] else data.draw(ALPHABET)
            s["tokens"].append(token)
            self.serial += 1
            s["serials"].append(self.serial)
        slots = self.pool.slot_mapping(seq, old_len, new_len)
        for p, slot in zip(range(old_len, new_len), slots):
            self.kv[slot] = (tuple(s["tokens"][: p + 1]), s["serials"][p])

    def _free(self, seq):
        table = self.pool.block_table(seq)
        self.pool.free(seq)
        s = self.seqs.pop(seq)
        self.history.append(s["tokens"])
        held = {b for o in self.seqs for b in self.pool.block_table(o)}
        for block in reversed(table):  # tail first
            if block not in held:
                self.free_order.append(block)

    # -- rules --

    @rule(data=st.data())
    def admit(self, data):
        """Admit a sequence from the longest cached prefix of its tokens (or a part of it), then
        usually compute its prompt and offer the prompt's full blocks to the cache."""
        tokens = self._source_tokens(data)
        found = self._lookup(tokens)
        prefix = found[: data.draw(st.integers(0, len(found)))] if data.draw(st.booleans()) else found
        low = max(len(tokens), len(prefix) * self.bs)
        size = data.draw(st.sampled_from(["small", "any", "edge"]))
        if size == "edge":  # exactly what is available, counting revived blocks, or one block more
            revived = sum(b in self.free_order for b in prefix)
            blocks = len(prefix) + self.pool.num_available_blocks - revived + data.draw(st.integers(0, 1))
            max_tokens = max(low, blocks * self.bs - data.draw(st.integers(0, self.bs - 1)))
        else:
            max_tokens = data.draw(st.integers(low, low + 2 * self.bs if size == "small" else self.capacity))
        event(f"admit: {'cache hit' if found else 'cold'}")
        seq = self._new_seq()
        if self._admit(seq, tokens, prefix, min(max_tokens, self.capacity)) and data.draw(st.integers(0, 3)):
            self._grow(seq, len(tokens), data)
            if data.draw(st.integers(0, 3)):
                for index in range(len(tokens) // self.bs):
                    self._cache(seq, index)

    @precondition(lambda self: self._growable())
    @rule(data=st.data(), to_max=st.booleans())
    def grow(self, data, to_max):
        seq = data.draw(st.sampled_from(self._growable()))
        s = self.seqs[seq]
        self._grow(seq, s["max"] if to_max else data.draw(st.integers(len(s["tokens"]), s["max"])), data)

    def _cache(self, seq, index):
        s = self.seqs[seq]
        key = block_keys(self.root, s["tokens"], self.bs)[index]
        block = self.pool.block_table(seq)[index]
        expect = key not in self.registry and block not in self.key_of_block
        assert self.pool.cache_block(seq, index, key) == expect
        if expect:
            self.registry[key] = (block, self._expected(seq, range(index * self.bs, (index + 1) * self.bs)))
            self.key_of_block[block] = key

    @precondition(lambda self: self._with_full_blocks())
    @rule(data=st.data(), every=st.booleans())
    def cache_block(self, data, every):
        """Offer one full block, or (what the scheduler does) every full block in order."""
        seq = data.draw(st.sampled_from(self._with_full_blocks()))
        full = len(self.seqs[seq]["tokens"]) // self.bs
        for index in range(full) if every else [data.draw(st.integers(0, full - 1))]:
            self._cache(seq, index)

    @rule(data=st.data())
    def pin(self, data):
        """Snapshot-style: hold the cached prefix of a sequence, exactly its blocks, no growth."""
        tokens = self._source_tokens(data)
        blocks = self._lookup(tokens)
        self._admit(("snapshot", self._new_seq()), tokens, blocks, len(blocks) * self.bs)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), register=st.booleans())
    def free(self, data, register):
        """Finish, abort or unpin (registering the full blocks first, as the scheduler does, or
        not): cached blocks stay revivable until evicted."""
        seq = data.draw(st.sampled_from(sorted(self.seqs, key=str)))
        if register:
            for index in range(len(self.seqs[seq]["tokens"]) // self.bs):
                self._cache(seq, index)
        self._free(seq)

    @rule()
    def reset_cache(self):
        dropped = [k for k, (b, _) in self.registry.items() if b in self.free_order]
        assert self.pool.reset_cache() == len(dropped)
        for key in dropped:
            del self.key_of_block[self.registry.pop(key)[0]]

    @rule()
    def free_everything(self):
        for seq in list(self.seqs):
            self._free(seq)
        self._assert_empty()

    @rule(data=st.data(), kind=st.sampled_from(["too big", "bad prefix", "past reservation", "partial block", "unknown"]))
    def misuse_raises(self, data, kind):
        """Caller bugs raise and change nothing."""
        before = self.pool.usage()
        seqs = sorted(self.seqs, key=str)
        uncached = [b for b in range(self.pool.total_blocks) if b not in self.key_of_block]
        if kind == "too big":
            with pytest.raises(ValueError):
                self.pool.reserve(self._new_seq(), self.capacity + data.draw(st.integers(1, 5)))
        elif kind == "bad prefix" and uncached:
            prefix = sorted(self.key_of_block)[:2] + [data.draw(st.sampled_from(uncached))]
            with pytest.raises(ValueError):
                self.pool.reserve(self._new_seq(), self.capacity, data.draw(st.permutations(prefix)))
        elif kind == "past reservation" and seqs:
            seq = data.draw(st.sampled_from(seqs))
            with pytest.raises(ReservationExceeded):
                self.pool.append_slots(seq, self.seqs[seq]["max"] + data.draw(st.integers(1, 5)))
        elif kind == "partial block" and seqs:
            seq = data.draw(st.sampled_from(seqs))
            with pytest.raises(ValueError):
                self.pool.cache_block(seq, len(self.seqs[seq]["tokens"]) // self.bs, b"partial")
        elif kind == "unknown":
            with pytest.raises(KeyError):
                self.pool.free(-1)
        assert self.pool.usage() == before

    # -- invariants --

    def _assert_empty(self):
        pool = self.pool
        assert pool.num_free_blocks == pool.total_blocks and pool.num_used_blocks == 0
        assert pool.num_reserved_blocks == 0 and pool.num_available_blocks == pool.total_blocks
        assert sorted(self.free_order) == list(range(pool.total_blocks))

    @invariant()
    def bookkeeping_is_consistent(self):
        self.pool.check_invariants()

    @invariant()
    def accounting_matches_model(self):
        pool = self.pool
        appearances = {}
        for seq in self.seqs:
            table = pool.block_table(seq)
            assert len(set(table)) == len(table)
            for block in table:
                appearances[block] = appearances.get(block, 0) + 1
        assert not set(appearances) & set(self.free_order), "a held block is on the free list"
        assert set(appearances) | set(self.free_order) == set(range(pool.total_blocks))
        assert pool.num_free_blocks == len(self.free_order) and pool.num_used_blocks == len(appearances)
        # Only cached blocks (revived through lookup) are ever in two tables.
        assert all(b in self.key_of_block for b, n in appearances.items() if n > 1), "an uncached block is shared"
        assert pool.num_reserved_blocks == self._model_reserved()
        assert 0 <= pool.num_reserved_blocks <= pool.num_free_blocks
        assert pool.num_evicted == self.evicted

    @invariant()
    def cache_holds_what_was_registered(self):
        assert self.pool.num_cached_blocks == len(self.registry)
        for key, (block, entries) in self.registry.items():
            assert self.pool.lookup([key]) == [block]
            assert self.kv[block * self.bs : (block + 1) * self.bs] == entries, "a cached block was overwritten"

    @invariant()
    def every_sequence_reads_back_its_tokens(self):
        for seq, s in self.seqs.items():
            n = len(s["tokens"])
            assert self.pool.num_tokens(seq) == n
            got = [self.kv[slot] for slot in self.pool.slot_mapping(seq, 0, n)]
            assert got == self._expected(seq, range(n)), f"sequence {seq!r} reads another's K/V"

    def teardown(self):
        if hasattr(self, "pool") and sys.exc_info()[0] is None:  # (else a failing step is being reported)
            for seq in list(self.seqs):
                self._free(seq)
            self.pool.check_invariants()
            self._assert_empty()
            assert self.pool.num_cached_blocks == len(self.registry)  # freed blocks stay revivable
            assert self.pool.reset_cache() == len(self.registry) and self.pool.num_cached_blocks == 0
            self.pool.check_invariants()


PagePoolMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
test_page_pool_state_machine = PagePoolMachine.TestCase
