"""Host-side paged KV block allocator for continuous batching, with a prefix cache.

The device keeps per-layer KV buffers of shape
[num_blocks, block_size, kv_heads, head_dim]; this module only decides which
block holds which tokens. Pure Python + numpy, no jax.

Model
-----
* Every block has a refcount: the number of sequence tables it appears in.
  A block is on the free list exactly when its refcount is 0.
* Prefix cache: a full block whose K/V is computed can be registered under a
  content key (`cache_block`; the key is the hash chain of every token up to
  the block's end, see `jtp.core.block_hash`). Registered blocks keep their key when
  their last sequence lets go: they stay on the free list, in least-recently-
  freed order, and a later sequence with the same prefix revives them
  (`lookup`, then `reserve(..., prefix=blocks)`). A cached block loses its key
  only when the free list hands it out again (LRU eviction) or on `reset_cache`.
* Admission reserves the worst case up front (`reserve`), so an admitted
  sequence can always grow to its declared maximum (`append_slots` never runs
  out of blocks). A reservation is a count, not specific blocks: the pool
  guarantees `reserved <= free`, so any reserved block can be drawn from the
  free list when it is actually needed. Reviving a cached block takes it off
  the free list, so admission counts it like a new one.
* Block 0 is an ordinary block; padding slots (-1) are handled by callers.

Usage for one request::

    pool.can_ever_fit(max_tokens)              # submit time; False -> reject
    prefix = pool.lookup(keys_of_prompt_blocks)  # optional: cached full blocks
    if pool.reserve(seq, max_tokens, prefix):  # admission; False -> stay queued
        pool.append_slots(seq, prompt_len)     # then +1 per decode step
        slots = pool.slot_mapping(seq, start, end)
        pool.cache_block(seq, i, key)          # once block i's K/V is written
    pool.free(seq)                             # finish or abort, exactly once

A snapshot pins cached blocks the same way: `reserve(snap, n * block_size, blocks)`.

Errors: an unknown sequence id raises KeyError (including a second `free`:
the engine frees exactly once, so a double free is a bug we want loud);
malformed arguments raise ValueError; growing past a reservation raises
ReservationExceeded.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np


class ReservationExceeded(RuntimeError):
    """A sequence tried to grow beyond what it reserved (a caller bug)."""


@dataclass
class _Sequence:
    table: list[int] = field(default_factory=list)
    num_tokens: int = 0
    # None until `reserve`; a sequence that only holds shared blocks cannot grow.
    max_tokens: int | None = None
    # Blocks promised to this sequence but not allocated yet.
    reserved: int = 0


class PagePool:
    """Refcounted KV block allocator with worst-case admission reservations."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.total_blocks = num_blocks
        self.block_size = block_size
        self._refcount = [0] * num_blocks
        # FIFO: a freed block goes to the back, so blocks are reused in
        # least-recently-freed order. That is the prefix cache's LRU eviction
        # order (a freed block's KV stays intact as long as possible), and a fresh
        # pool hands out 0, 1, 2, ... which keeps plans easy to read. Ordered so a
        # revived cached block leaves from the middle in O(1).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._seqs: dict[Hashable, _Sequence] = {}
        self._num_reserved = 0
        self._block_of_key: dict[bytes, int] = {}
        self._key_of_block: dict[int, bytes] = {}
        self.num_evicted = 0  # cached blocks handed out again (a count for tests and metrics)

    # ---- accounting -------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with refcount > 0 (every block is either free or used)."""
        return self.total_blocks - len(self._free)

    @property
    def num_reserved_blocks(self) -> int:
        """Blocks promised to admitted sequences but not allocated yet."""
        return self._num_reserved

    @property
    def num_available_blocks(self) -> int:
        """What a new reservation can take: free blocks nobody was promised."""
        return len(self._free) - self._num_reserved

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (in use or not)."""
        return len(self._block_of_key)

    def usage(self) -> dict[str, int]:
        return {
            "total_blocks": self.total_blocks,
            "free_blocks": self.num_free_blocks,
            "used_blocks": self.num_used_blocks,
            "reserved_blocks": self.num_reserved_blocks,
            "available_blocks": self.num_available_blocks,
            "shared_blocks": sum(1 for rc in self._refcount if rc > 1),
            "num_seqs": len(self._seqs),
            "cached_blocks": self.num_cached_blocks,
        }

    # ---- sizing -----------------------------------------------------------

    def blocks_needed(self, num_tokens: int) -> int:
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.block_size)

    def can_ever_fit(self, max_total_tokens: int) -> bool:
        """Whether a request of this size could be admitted into an empty pool."""
        return self.blocks_needed(max_total_tokens) <= self.total_blocks

    # ---- per-sequence queries ---------------------------------------------

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def block_table(self, seq_id: Hashable) -> list[int]:
        return list(self._get(seq_id).table)

    def num_tokens(self, seq_id: Hashable) -> int:
        return self._get(seq_id).num_tokens

    def num_blocks(self, seq_id: Hashable) -> int:
        return len(self._get(seq_id).table)

    def blocks_from(self, seq_id: Hashable, start: int) -> list[int]:
        """The sequence's blocks from index `start` on (a copy): what a mirror of its table lacks."""
        return self._get(seq_id).table[start:]

    def slot_mapping(self, seq_id: Hashable, start: int, end: int) -> np.ndarray:
        """Flat slot (block * block_size + offset) of each position in [start, end)."""
        seq = self._get(seq_id)
        if not 0 <= start <= end <= seq.num_tokens:
            raise ValueError(
                f"slot range [{start}, {end}) outside the {seq.num_tokens} tokens of sequence {seq_id!r}"
            )
        positions = np.arange(start, end, dtype=np.int64)
        blocks = np.asarray(seq.table, dtype=np.int64)[positions // self.block_size]
        return (blocks * self.block_size + positions % self.block_size).astype(np.int32)

    # ---- lifecycle --------------------------------------------------------

    def reserve(self, seq_id: Hashable, max_total_tokens: int, prefix: Sequence[int] = ()) -> bool:
        """Start a sequence with the cached blocks `prefix` (from `lookup`) and reserve enough
        blocks for it to reach `max_total_tokens`.

        Returns False, changing nothing, if the pool cannot take it now. A size that can never
        fit raises ValueError: callers must reject those at submit time (`can_ever_fit`), else
        they block the queue.
        """
        if not self.can_ever_fit(max_total_tokens):
            raise ValueError(
                f"sequence {seq_id!r} needs {self.blocks_needed(max_total_tokens)} blocks "
                f"but the pool only has {self.total_blocks}"
            )
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already holds a reservation")
        prefix = list(prefix)
        if len(prefix) * self.block_size > max_total_tokens:
            raise ValueError(
                f"a prefix of {len(prefix)} blocks exceeds the {max_total_tokens} tokens sequence {seq_id!r} reserves"
            )
        if len(set(prefix)) != len(prefix) or any(b not in self._key_of_block for b in prefix):
            raise ValueError(f"the prefix of sequence {seq_id!r} must be distinct cached blocks (from lookup)")
        revived = sum(1 for b in prefix if self._refcount[b] == 0)
        needed = self.blocks_needed(max_total_tokens) - len(prefix)
        if needed + revived > self.num_available_blocks:
            return False
        for block in prefix:
            if self._refcount[block] == 0:
                del self._free[block]
            self._refcount[block] += 1
        self._seqs[seq_id] = _Sequence(
            table=prefix, num_tokens=len(prefix) * self.block_size, max_tokens=max_total_tokens, reserved=needed
        )
        self._num_reserved += needed
        return True

    def append_slots(self, seq_id: Hashable, new_num_tokens: int) -> None:
        """Grow the sequence to cover `new_num_tokens` tokens, from its reservation."""
        seq = self._get(seq_id)
        if seq.max_tokens is None:
            raise ReservationExceeded(f"sequence {seq_id!r} has no reservation; call reserve() first")
        if new_num_tokens > seq.max_tokens:
            raise ReservationExceeded(
                f"sequence {seq_id!r} asked for {new_num_tokens} tokens but reserved only {seq.max_tokens}"
            )
        if new_num_tokens < seq.num_tokens:
            raise ValueError(
                f"sequence {seq_id!r} cannot shrink from {seq.num_tokens} to {new_num_tokens} tokens"
            )
        grow = self.blocks_needed(new_num_tokens) - len(seq.table)
        # Holds by construction (table + reserved == blocks for max_tokens); guard anyway.
        assert grow <= seq.reserved <= len(self._free), "reservation accounting broken"
        for _ in range(grow):
            block, _ = self._free.popitem(last=False)
            key = self._key_of_block.pop(block, None)
            if key is not None:  # the least recently used cached block: evicted
                del self._block_of_key[key]
                self.num_evicted += 1
            self._refcount[block] = 1
            seq.table.append(block)
        seq.reserved -= grow
        self._num_reserved -= grow
        seq.num_tokens = new_num_tokens

    def truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Shrink the sequence to `num_tokens` tokens (rejected speculative tokens): blocks past them
        go back to its reservation, so it can grow again up to what it reserved. They hold no
        cached key (their K/V never became a full block of known tokens)."""
        seq = self._get(seq_id)
        if not 0 <= num_tokens <= seq.num_tokens:
            raise ValueError(f"sequence {seq_id!r} cannot truncate from {seq.num_tokens} to {num_tokens} tokens")
        keep = self.blocks_needed(num_tokens)
        for block in reversed(seq.table[keep:]):
            assert self._refcount[block] == 1 and block not in self._key_of_block, "truncating a shared block"
            self._refcount[block] = 0
            self._free[block] = None
        dropped = len(seq.table) - keep
        del seq.table[keep:]
        seq.reserved += dropped
        self._num_reserved += dropped
        seq.num_tokens = num_tokens

    # ---- prefix cache -----------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `keys` (one key per full block, in order)."""
        blocks = []
        for key in keys:
            block = self._block_of_key.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def cached_blocks(self) -> dict[int, bytes]:
        """Block -> key of every cached block, in eviction order: the unheld ones (on the free list)
        least recently freed first, then those sequences hold. Read-only (for saving the cache)."""
        out = {b: self._key_of_block[b] for b in self._free if b in self._key_of_block}
        out.update((b, k) for b, k in self._key_of_block.items() if self._refcount[b])
        return out

    def cache_block(self, seq_id: Hashable, index: int, key: bytes) -> bool:
        """Register block `index` of the sequence (full, K/V written) under `key`.

        False when the key already names a block (another sequence computed the same prefix) or
        the block already has a key: the first registration stays, nothing changes.
        """
        seq = self._get(seq_id)
        if not 0 <= index < seq.num_tokens // self.block_size:
            raise ValueError(f"block {index} of sequence {seq_id!r} is not a full block")
        block = seq.table[index]
        if key in self._block_of_key or block in self._key_of_block:
            return False
        self._block_of_key[key] = block
        self._key_of_block[block] = key
        return True

    def reset_cache(self) -> int:
        """Forget every cached block nobody holds (e.g. after a failed step); returns how many."""
        dropped = [b for b in self._key_of_block if self._refcount[b] == 0]
        for block in dropped:
            del self._block_of_key[self._key_of_block.pop(block)]
        return len(dropped)

    def free(self, seq_id: Hashable) -> None:
        """Drop the sequence: decref its blocks and release its unused reservation.

        Raises KeyError for an unknown (or already freed) id.
        """
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise KeyError(f"free(): unknown or already freed sequence {seq_id!r}")
        # Tail first: with the FIFO free list the tail is then reused before the
        # prefix blocks, which are the ones a prefix cache is most likely to revive.
        for block in reversed(seq.table):
            self._refcount[block] -= 1
            if self._refcount[block] == 0:
                self._free[block] = None
        self._num_reserved -= seq.reserved

    # ---- checking ---------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (kept under -O)."""

        def check(cond: bool, msg: str) -> None:
            if not cond:
                raise AssertionError(msg)

        free_set = set(self._free)
        check(len(free_set) == len(self._free), "a block is on the free list twice")
        check(all(0 <= b < self.total_blocks for b in free_set), "free list holds an out-of-range block")

        appearances = [0] * self.total_blocks
        total_reserved = 0
        for seq_id, seq in self._seqs.items():
            check(len(set(seq.table)) == len(seq.table), f"sequence {seq_id!r} owns a block twice")
            check(
                len(seq.table) == self.blocks_needed(seq.num_tokens),
                f"sequence {seq_id!r}: {len(seq.table)} blocks for {seq.num_tokens} tokens",
            )
            check(seq.reserved >= 0, f"sequence {seq_id!r} has a negative reservation")
            if seq.max_tokens is None:
                check(seq.reserved == 0, f"unreserved sequence {seq_id!r} holds reserved blocks")
            else:
                check(seq.num_tokens <= seq.max_tokens, f"sequence {seq_id!r} grew past its reservation")
                check(
                    len(seq.table) + seq.reserved == self.blocks_needed(seq.max_tokens),
                    f"sequence {seq_id!r}: table + reserved != worst case",
                )
            total_reserved += seq.reserved
            for block in seq.table:
                check(0 <= block < self.total_blocks, f"sequence {seq_id!r} holds out-of-range block {block}")
                appearances[block] += 1

        for block, rc in enumerate(self._refcount):
            check(rc == appearances[block], f"block {block}: refcount {rc} but in {appearances[block]} tables")
            check((rc == 0) == (block in free_set), f"block {block}: refcount {rc} disagrees with free list")

        used = sum(1 for rc in self._refcount if rc > 0)
        check(used == self.num_used_blocks, "used count disagrees with refcounts")
        check(self.num_free_blocks + used == self.total_blocks, "free + used != total")
        check(sum(len(s.table) for s in self._seqs.values()) >= used, "tables cover fewer blocks than are used")
        check(total_reserved == self._num_reserved, "reserved total disagrees with per-sequence reservations")
        check(0 <= self._num_reserved <= self.num_free_blocks, "reserved exceeds free")
        check(len(self._block_of_key) == len(self._key_of_block), "cache index and its inverse differ in size")
        for key, block in self._block_of_key.items():
            check(self._key_of_block.get(block) == key, f"cached block {block} does not map back to its key")

    def _get(self, seq_id: Hashable) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence {seq_id!r}") from None
