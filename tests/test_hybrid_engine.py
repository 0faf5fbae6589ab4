"""Issue 4 in the engine: hybrid (DeltaNet) models under continuous batching, and the
recurrent-state slots the scheduler hands out.

Batch invariance: staggered, mixed-length requests (prompts chunked across steps, chunk
boundaries anywhere relative to DeltaNet's 64-token chunks) produce exactly the greedy tokens
each produces alone, at tp = 1, 2 and 4, and the tokens HF generates.
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
from jtp.core.buckets import SHORT_ROW, long_rows
from jtp.core.page_pool import PagePool
from jtp.core.sampling_params import SamplingParams
from jtp.core.scheduler import Request, Scheduler, Status
from jtp.core.state_pool import StatePool
from jtp.worker.input_batch import InputBatch

ENGINE_KW = dict(dtype="float32", num_blocks=256, block_size=4, max_num_seqs=8, max_num_batched_tokens=48, max_model_len=192)


def workload(seed: int, num: int):
    rng = np.random.default_rng(seed)
    lens = rng.integers(3, 110, num)
    news = rng.integers(1, 10, num)
    return [(rng.integers(0, 128, n).tolist(), int(m)) for n, m in zip(lens, news)]


@pytest.fixture(scope="module")
def hybrid(hybrid_hk4):
    return hybrid_hk4  # 4 key heads, 4 KV heads: tp 1, 2, 4 all split


def run_all(path, tp, work, solo=True):
    from test_engine import run_staggered

    from jtp.config.engine_args import EngineArgs
    from jtp.engine.engine import Engine

    engine = Engine.from_args(EngineArgs(model=path, tensor_parallel_size=tp, **ENGINE_KW, skip_tokenizer_init=True))
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for _, m in work]
    batched = run_staggered(engine, [p for p, _ in work], params, waves=(3, 2, 3), gaps=(2, 3, 1))
    solo = [engine.generate([p], sp)[0] for (p, _), sp in zip(work, params)] if solo else []
    assert engine.pool.num_free_blocks == engine.pool.total_blocks
    assert sorted(engine.scheduler.free_seq_slots) == list(range(ENGINE_KW["max_num_seqs"]))
    assert engine.states.available() == engine.states.num_slots, "a state slot leaked"
    return [c.token_ids for c in batched], [c.token_ids for c in solo]


def test_hybrid_batch_invariance_across_tp(hybrid):
    from hf_hybrid import hf_generate

    model, path = hybrid
    work = workload(seed=5, num=10)
    base_batched, base_solo = run_all(path, 1, work)
    assert base_batched == base_solo
    for (prompt, n), tokens in list(zip(work, base_batched))[:3]:
        assert tokens == hf_generate(model, prompt, n)
    for tp in (2, 4):  # the batched tokens at tp=1 are the solo ones: these equal them too
        batched, _ = run_all(path, tp, work, solo=False)
        assert batched == base_batched, f"tp={tp}"


def test_a_lone_request_decodes_one_row(hybrid, monkeypatch):
    """A decode step of one request runs 1 row, not the smallest rows bucket (8): the DeltaNet layers
    update one recurrent state per step instead of also 7 padding rows' (each a whole state read and
    written per layer). Its tokens are HF's (the batched-equals-solo check above covers the rest)."""
    from hf_hybrid import hf_generate

    from jtp.config.engine_args import EngineArgs
    from jtp.engine.engine import Engine

    model, path = hybrid
    shapes = []
    prepare = InputBatch.prepare

    def recording(self, out, masked=False):
        packed = prepare(self, out, masked)
        shapes.append((packed.layout.num_tokens, packed.layout.num_rows, packed.layout.max_row_len))
        return packed

    monkeypatch.setattr(InputBatch, "prepare", recording)
    engine = Engine.from_args(EngineArgs(model=path, **ENGINE_KW, skip_tokenizer_init=True))
    prompt = list(range(3, 40))
    done = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    assert done.token_ids == hf_generate(model, prompt, 6)
    decode = [s for s in shapes if s[2] == 1]
    assert decode and set(decode) == {(1, 1, 1)}, shapes


BS = 4  # block size of the scheduler state machine
TOKENS = st.integers(0, 2)  # prompts from a small alphabet share prefixes: the cache hits


def sampled_token(tokens) -> int:
    """The simulated model: the next token is a function of the sequence so far."""
    return sum((i + 1) * (t + 1) for i, t in enumerate(tokens)) % 5


def test_snapshot_pin_keeps_state_reservations():
    """SnapshotManager.pin may not take an unreferenced (evictable) state checkpoint that a running
    request's state reservation counts on. Bug: it acquires it unconditionally, so
    `states.available()` drops to -1 and the request's next row finds no slot to write
    (KeyError from StatePool.allocate in Scheduler._assign_state_slots). Refusing the pin, or
    pinning a shorter prefix, is fine."""
    from jtp.engine.snapshot_manager import SnapshotManager
    from jtp.errors import RequestError

    root = root_key("test")
    pool, states = PagePool(6, BS), StatePool(2)
    sched = Scheduler(pool, 1, 2, 64, states=states, cache_root=root)
    req = Request("a", [0] * 10, SamplingParams(max_tokens=5), 0, frozenset())
    sched.add(req)

    def step():
        rows = sched.schedule()
        sched.dispatched(rows)
        for row in rows:
            if row.picks_next_token:
                req.num_unseen_tokens -= 1
                req.output_ids.append(0)
        if len(req.output_ids) >= req.params.max_tokens:
            sched.remove(req)

    for _ in range(7):  # the prompt in 2-token rows (a checkpoint at 8), then decodes to 12 (another)
        step()
    # The prompt's checkpoint is cached and unreferenced; the request's reservation counts on it.
    checkpoint = states.lookup(block_keys(root, [0] * 10, BS)[1])
    assert checkpoint is not None and states.refs(checkpoint) == 0
    assert req.state_reserved and states.available() == 0

    snapshots = SnapshotManager(8, 1 << 30, sched, pool, states, bytes_per_block=1, bytes_per_state_slot=1)
    try:
        snapshots.pin([0] * 10)
    except RequestError:
        pass
    assert states.available() >= 0, "the pin took a slot promised to a running request"
    states.check_invariants()
    while sched.has_work():
        step()  # the request's next row writes a fresh slot against its reservation


@pytest.mark.parametrize("caching", [False, True])
def test_steps_with_a_long_row_keep_to_long_rows(caching):
    """A hybrid's DeltaNet layout holds `long_rows(T, B, bound)` rows of several tokens beside a row
    longer than SHORT_ROW: here one long prompt arrives with ten short ones, and the scheduler
    gives the short ones past that room one token (every prompt still completes); without the
    limit the same workload does put more rows of several tokens into such a step."""
    def run(limit):
        pool, states = PagePool(400, BS), StatePool(32)
        sched = Scheduler(pool, 16, 512, 256, states=states, cache_root=root_key("t") if caching else None,
                          limit_long_rows=limit)
        reqs = [Request(str(i), list(range(i, i + n)), SamplingParams(max_tokens=3), 0, frozenset())
                for i, n in enumerate((200,) + (20,) * 10)]
        for r in reqs:
            sched.add(r)
        steps = []
        while sched.has_work():
            rows = sched.schedule()
            sched.dispatched(rows)
            for row in rows:
                if row.picks_next_token:
                    row.request.num_unseen_tokens -= 1
                    row.request.output_ids.append(0)
            lens = [row.num_tokens for row in rows]
            steps.append((lens, sched.buckets.step_shape(sum(lens), len(lens), max(lens))))
            states.check_invariants()
            for r in list(sched.running):
                if len(r.output_ids) >= r.params.max_tokens:
                    sched.remove(r)
            assert len(steps) < 200
        assert all(len(r.output_ids) == 3 for r in reqs)
        return [(sum(n > 1 for n in lens), shape) for lens, shape in steps if shape[2] > SHORT_ROW]

    limited = run(True)
    assert all(several <= long_rows(*shape) for several, shape in limited), limited
    assert limited[0] == (8, (512, 16, 256))  # 400 tokens: room for 4 x 512 // 256 rows of several tokens
    assert any(several > long_rows(*shape) for several, shape in run(False))


def test_a_long_prompt_beside_many_short_ones_decodes_as_each_alone(hybrid, monkeypatch):
    """Through the engine: a long prompt's chunk with eight short prompts beside it, past the
    step's room for rows of several tokens (the short ones are cut to a token, or the long one to
    SHORT_ROW), then the split DeltaNet layout: every request's greedy tokens are its solo ones."""
    from jtp.config.engine_args import EngineArgs
    from jtp.engine.engine import Engine

    _, path = hybrid
    engine = Engine.from_args(EngineArgs(model=path, dtype="float32", num_blocks=256, block_size=4, max_num_seqs=16,
                                         max_num_batched_tokens=128, max_model_len=192, skip_tokenizer_init=True))
    steps, schedule = [], engine.scheduler.schedule

    def spy(*args, **kwargs):
        rows = schedule(*args, **kwargs)
        steps.append([row.num_tokens for row in rows])
        return rows

    monkeypatch.setattr(engine.scheduler, "schedule", spy)
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, 128, 150).tolist()] + [rng.integers(0, 128, 12).tolist() for _ in range(8)]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    batched = [c.token_ids for c in engine.generate(prompts, params)]
    cut = [lens for lens in steps if lens and max(lens) > SHORT_ROW and 1 in lens and sum(n > 1 for n in lens) > 1]
    assert cut, steps  # a step gave a short prompt one token beside the long chunk
    assert batched == [engine.generate([p], params)[0].token_ids for p in prompts]


class PrefixCacheSchedulerMachine(RuleBasedStateMachine):
    """The real Scheduler + PagePool + StatePool with prefix caching on, driven like the engine
    drives them (dispatch, then the host sees the sampled tokens one step later or at once),
    against a simulated device:

    * KV: each slot holds the token prefix whose K/V was written there; a row's attention reads
      (through its block table, after the step's writes) must find exactly its own prefixes;
    * recurrent state: each state slot holds the token sequence whose state it is; a row must
      read the state of exactly its tokens before `row.start` (-1: the zero state, start 0), so
      a restored request never reads a recycled slot; the row writes its tokens' state.
    Cached blocks and checkpoints must always hold what their keys name, snapshots their prefix,
    running requests their state at `num_computed`; refs and reservations are accounted exactly;
    nothing leaks once everything is finished and every snapshot dropped.
    """

    @initialize(
        max_seqs=st.integers(1, 4), num_blocks=st.integers(6, 40), spare_slots=st.integers(1, 4),
        extra_budget=st.integers(1, 16),
    )
    def setup(self, max_seqs, num_blocks, spare_slots, extra_budget):
        self.root = root_key("test")
        self.pool = PagePool(num_blocks, BS)
        self.states = StatePool(max_seqs + spare_slots)
        self.max_seqs, self.max_model_len = max_seqs, 64
        self.sched = Scheduler(
            self.pool, max_seqs, max_seqs + extra_budget, self.max_model_len, states=self.states, cache_root=self.root
        )
        self.batch = InputBatch(max_seqs, self.max_model_len, BS, self.sched.buckets)  # the worker's step layout
        self.ids = 0
        self.dev = {}  # request id -> every token on the device (prompt + sampled, pending included)
        self.kv = {}  # KV slot -> the token prefix whose K/V it holds
        self.state = {}  # state slot -> the token sequence whose state it holds
        self.key_tokens = {}  # every block key seen -> the tokens it names
        self.sources = []  # earlier prompts and finished sequences, to share prefixes with
        self.snaps = {}  # pool id -> (tokens pinned, blocks, state slot)
        self.inflight = None  # the dispatched step's sampled tokens the host has not seen: [(request, token)]

    # -- simulation helpers --

    def _learn(self, tokens):
        for i, key in enumerate(block_keys(self.root, tokens, BS)):
            self.key_tokens.setdefault(key, tuple(tokens[: (i + 1) * BS]))

    def _kv_holds(self, table, tokens, upto):
        """Whether the blocks of `table` hold the K/V of tokens[:upto]."""
        return all(self.kv.get(table[q // BS] * BS + q % BS) == tuple(tokens[: q + 1]) for q in range(upto))

    def _tables_except(self, request):
        tables = [self.pool.block_table(r.id) for r in self.sched.running if r is not request]
        return tables + [blocks for _, blocks, _ in self.snaps.values()]

    def _device(self, rows):
        """Run the step on the simulated device and dispatch it; returns its sampled tokens."""
        plan = self.batch.prepare(self.sched.output(rows)).to_step_input().plan
        step_slots, cursor = set(), 0
        reads = {row.state_read for row in rows if row.state_read >= 0}
        writes = [row.state_write for row in rows]
        assert len(set(writes)) == len(writes), "two rows write one state slot"
        for row in rows:
            r, end = row.request, row.start + row.num_tokens
            dev, known = self.dev[r.id], len(r.prompt_ids) + len(r.output_ids)
            assert row.start == r.num_computed and end <= len(dev)
            span = range(cursor, cursor + row.num_tokens)
            assert [int(plan.token_ids[i]) for i in span] == [dev[p] if p < known else -1 for p in range(row.start, end)]
            # State: written in place only when the slot is exclusive, never into a slot another row reads.
            assert self.states.is_exclusive(row.state_write), "a row writes a shared or cached state slot"
            assert row.state_write == row.state_read or row.state_write not in reads
            # KV: written only into blocks nobody else holds.
            others = {blk for table in self._tables_except(r) for blk in table}
            for p, i in zip(range(row.start, end), span):
                slot = int(plan.slot_mapping[i])
                assert slot // BS not in others, "a row writes K/V into a block another sequence holds"
                assert slot not in step_slots
                step_slots.add(slot)
                self.kv[slot] = tuple(dev[: p + 1])
            cursor += row.num_tokens
        for b, row in enumerate(rows):  # attention reads, after the step's writes
            r, end = row.request, row.start + row.num_tokens
            table = [int(x) for x in plan.block_tables[b]]
            assert self._kv_holds(table, self.dev[r.id], end), f"{r.id} reads K/V that is not its own"
        new_state = {}
        for row in rows:
            r, end = row.request, row.start + row.num_tokens
            if row.state_read < 0:
                assert row.start == 0, "a row continues from the zero state"
            else:
                assert self.state.get(row.state_read) == tuple(self.dev[r.id][: row.start]), (
                    f"{r.id} reads a state slot that does not hold its prefix (a recycled slot)"
                )
                if row.start and row.start == r.cached_tokens:
                    event("a row restores a cached state")
            new_state[row.state_write] = tuple(self.dev[r.id][:end])
        self.state.update(new_state)
        sampled = []
        for row in rows:
            if row.picks_next_token:
                dev = self.dev[row.request.id]
                assert len(dev) == row.start + row.num_tokens
                dev.append(sampled_token(dev))
                sampled.append((row.request, dev[-1]))
        self.sched.dispatched(rows)
        for row in rows:
            self._learn(self.dev[row.request.id])
        return sampled

    def _process(self, sampled):
        """The host sees a step's tokens (Engine._process): finished or aborted requests discard theirs."""
        for req, token in sampled:
            req.num_unseen_tokens -= 1
            if req.status is Status.RUNNING:
                req.output_ids.append(token)
                if token in req.stop_ids or len(req.output_ids) >= req.params.max_tokens:
                    self._remove(req)  # (a stop can leave a step for this request in flight)

    def _remove(self, req):
        self.sched.remove(req)
        self.sources.append(req.prompt_ids + req.output_ids)

    def _finish_inflight_step(self):
        previous, self.inflight = self.inflight, None
        if previous is not None:
            self._process(previous)

    def _draw_tokens(self, data, max_len):
        """Tokens that often continue a prefix of an earlier prompt, sequence or snapshot."""
        pool = self.sources[-10:] + [r.prompt_ids + r.output_ids for r in self.sched.running]
        pool += [list(tokens) for tokens, _, _ in self.snaps.values()]
        base = data.draw(st.sampled_from(pool)) if pool and data.draw(st.integers(0, 3)) else []
        cut = data.draw(st.one_of(st.just(len(base)), st.integers(0, len(base))))
        return (base[:cut] + data.draw(st.lists(TOKENS, max_size=10)))[:max_len]

    # -- rules --

    @rule(data=st.data(), max_tokens=st.lists(st.integers(1, 8), min_size=1, max_size=3))
    def submit(self, data, max_tokens):
        """A few requests, whose prompts often continue earlier ones (a follow-up turn, another
        question about the same document); some stop at token 4."""
        for m in max_tokens:
            self._submit(data, m, data.draw(st.sampled_from([frozenset(), frozenset({4})])))

    def _submit(self, data, max_tokens, stop_ids):
        room = min(self.max_model_len, self.pool.total_blocks * BS) - max_tokens
        prompt = self._draw_tokens(data, min(room, 40)) or [0]
        if len(prompt) > room:
            return
        self.ids += 1
        req = Request(f"r{self.ids}", prompt, SamplingParams(max_tokens=max_tokens), 0, stop_ids)
        self.dev[req.id] = list(prompt)
        self._learn(prompt)
        self.sources.append(prompt)
        self.sched.add(req)

    @rule(lockstep=st.lists(st.booleans(), min_size=1, max_size=16))
    def step(self, lockstep):
        """A few engine steps (one per flag): lockstep or overlapped."""
        for flag in lockstep:
            self._step(flag)

    def _step(self, lockstep):
        """Engine.step: the previous step's tokens are seen before scheduling (lockstep, or a step
        that is already done) or after dispatching the next one (overlap)."""
        previous, self.inflight = self.inflight, None
        if previous is not None and lockstep:
            self._process(previous)
            previous = None
        evicted = (self.pool.num_evicted, self.states.num_evicted)
        rows = self.sched.schedule()
        if rows:
            self.inflight = self._device(rows)
        if previous is not None:
            self._process(previous)
        if self.pool.num_evicted > evicted[0]:
            event("evicted a cached KV block")
        if self.states.num_evicted > evicted[1]:
            event("evicted a state checkpoint")

    @rule()
    def settle(self):
        self._finish_inflight_step()

    @rule()
    def drain(self):
        """Step until every request has finished (checking the invariants after each step)."""
        self._drain()

    def _drain(self):
        for i in range(1000):
            if not (self.sched.has_work() or self.inflight is not None):
                return
            idle = not self.sched.running and self.inflight is None
            self._step(lockstep=i % 3 == 0)
            self.check_all()
            if idle and not self.sched.running:  # nothing ran and nothing was admitted: stuck
                # Only snapshots can hold blocks and state slots while nothing runs; a request that
                # needs them waits until they are dropped (what a client must do).
                head = self.sched.waiting[0]
                assert self.snaps, f"the queue is stuck with nothing pinned (head {head})"
                kv_short = self.pool.num_available_blocks < self.pool.blocks_needed(head.max_total_tokens)
                event(f"dropped a snapshot to unblock the queue ({'KV blocks' if kv_short else 'state slots'})")
                self._drop(next(iter(self.snaps)))
        raise AssertionError("the queue does not drain")

    def check_all(self):
        self.pools_are_consistent()
        self.holds_and_reservations_are_exact()
        self.device_contents_are_what_the_host_thinks()

    @precondition(lambda self: self.sched.running or self.sched.waiting)
    @rule(data=st.data())
    def abort(self, data):
        """Engine.abort (between steps: a step may be in flight)."""
        reqs = list(self.sched.running) + list(self.sched.waiting)
        self._remove(data.draw(st.sampled_from(reqs)))

    @rule()
    def stop(self):
        """Engine.stop: process the step in flight, then abort every unfinished request."""
        self._finish_inflight_step()
        for r in list(self.sched.running) + list(self.sched.waiting):
            self._remove(r)

    @rule(data=st.data(), from_running=st.booleans())
    def pin(self, data, from_running):
        """SnapshotManager.pin: the longest cached prefix that ends at a state checkpoint, held by a
        snapshot (its blocks reserved under ("snapshot", id), its checkpoint acquired)."""
        if from_running and self.sched.running:
            req = data.draw(st.sampled_from(self.sched.running))
            self.sched.register_computed(req)  # what Engine.snapshot does for a running request
            tokens = req.prompt_ids + req.output_ids
        else:
            tokens = self._draw_tokens(data, 64)
        keys = block_keys(self.root, tokens, BS)
        blocks = self.pool.lookup(keys)
        while blocks and self.states.lookup(keys[len(blocks) - 1]) is None:
            blocks.pop()
        slot = self.states.lookup(keys[len(blocks) - 1]) if blocks else -1
        if slot >= 0 and not self.states.refs(slot) and self.states.available() < 1:
            # Acquiring an evictable checkpoint takes a slot that running requests' reservations
            # count on; SnapshotManager.pin once missed this check (test_snapshot_pin_keeps_state_reservations).
            event("a snapshot's checkpoint is not spare")
            return
        self.ids += 1
        pid = ("snapshot", f"s{self.ids}")
        if not self.pool.reserve(pid, len(blocks) * BS, blocks):
            event("a snapshot could not be pinned")
            return
        if slot >= 0:
            self.states.acquire(slot)
        pinned = tuple(tokens[: len(blocks) * BS])
        assert self._kv_holds(blocks, pinned, len(pinned)) and (slot < 0 or self.state.get(slot) == pinned)
        self.snaps[pid] = (pinned, blocks, slot)
        event(f"pinned {'a prefix' if blocks else 'nothing'}")

    @precondition(lambda self: self.snaps)
    @rule(data=st.data())
    def drop(self, data):
        self._drop(data.draw(st.sampled_from(sorted(self.snaps))))

    def _drop(self, pid):
        """SnapshotManager.unpin: the blocks and the checkpoint go back to the ordinary (evictable) cache."""
        _, _, slot = self.snaps.pop(pid)
        self.pool.free(pid)
        if slot >= 0:
            self.states.release(slot)

    @rule()
    def reset_caches(self):
        """Engine._reset_prefix_cache: forget every unreferenced block and checkpoint."""
        self.states.reset_cache()
        self.pool.reset_cache()

    # -- invariants --

    @invariant()
    def pools_are_consistent(self):
        if hasattr(self, "sched"):
            self.pool.check_invariants()
            self.states.check_invariants()

    @invariant()
    def holds_and_reservations_are_exact(self):
        if not hasattr(self, "sched"):
            return
        sched, states = self.sched, self.states
        refs = [0] * states.num_slots
        for r in sched.running:
            assert r.id in self.pool and r.status is Status.RUNNING
            held = ([r.state_slot] if r.state_slot >= 0 else []) + [slot for _, slot in r.pending_checkpoints]
            for slot in held:
                refs[slot] += 1
            # Its next row always finds a slot to write: its own exclusive one, or a reserved one.
            assert r.state_reserved or (r.state_slot >= 0 and states.is_exclusive(r.state_slot))
        for _, _, slot in self.snaps.values():
            if slot >= 0:
                refs[slot] += 1
        assert [states.refs(s) for s in range(states.num_slots)] == refs, "state slot refs leaked or lost"
        assert states.num_reserved == sum(r.state_reserved for r in sched.running)
        assert states.available() >= 0
        for r in sched.waiting:
            assert r.status is Status.WAITING and r.state_slot == -1 and not r.state_reserved and r.id not in self.pool
        reserved = sum(self.pool.blocks_needed(r.max_total_tokens) - len(self.pool.block_table(r.id)) for r in sched.running)
        assert self.pool.num_reserved_blocks == reserved
        assert sorted(sched.free_seq_slots + [r.seq_slot for r in sched.running]) == list(range(self.max_seqs))

    @invariant()
    def device_contents_are_what_the_host_thinks(self):
        if not hasattr(self, "sched"):
            return
        # Every cached block holds the K/V its key names; every checkpoint the state it names.
        blocks_found = slots_found = 0
        for key, tokens in self.key_tokens.items():
            block = self.pool.lookup([key])
            if block:
                blocks_found += 1
                start = len(tokens) - BS
                assert all(
                    self.kv.get(block[0] * BS + j) == tokens[: start + j + 1] for j in range(BS)
                ), "a cached block was overwritten"
            slot = self.states.lookup(key)
            if slot is not None:
                slots_found += 1
                assert self.state.get(slot) == tokens, "a state checkpoint was overwritten"
        assert blocks_found == self.pool.num_cached_blocks and slots_found == self.states.num_cached
        # Running requests: their computed K/V, and their state slot holds their state at num_computed.
        for r in self.sched.running:
            dev = self.dev[r.id]
            assert self._kv_holds(self.pool.block_table(r.id), dev, r.num_computed)
            if r.state_slot >= 0:
                assert self.state.get(r.state_slot) == tuple(dev[: r.num_computed])
            else:
                assert r.num_computed == 0
        for pinned, blocks, slot in self.snaps.values():
            assert self._kv_holds(blocks, pinned, len(pinned)) and (slot < 0 or self.state.get(slot) == pinned)

    def teardown(self):
        if not hasattr(self, "sched") or sys.exc_info()[0] is not None:
            return  # (a failing step is being reported: don't bury it under the drain's failure)
        self._drain()  # every request submitted runs to completion: more prefix hits, checked
        assert not self.sched.running and not self.sched.waiting
        for pid in list(self.snaps):
            self._drop(pid)
        self.pool.check_invariants()
        self.states.check_invariants()
        assert self.pool.num_free_blocks == self.pool.total_blocks and self.pool.num_reserved_blocks == 0
        assert self.states.num_reserved == 0 and self.states.available() == self.states.num_slots, "a state slot leaked"
        assert all(self.states.refs(s) == 0 for s in range(self.states.num_slots))
        assert sorted(self.sched.free_seq_slots) == list(range(self.max_seqs))
        # Unreferenced blocks and checkpoints stay cached (and count as available) until reset.
        cached_blocks, checkpoints = self.pool.num_cached_blocks, self.states.num_cached
        assert self.pool.reset_cache() == cached_blocks and self.states.reset_cache() == checkpoints
        assert self.pool.num_cached_blocks == 0 and self.states.num_cached == 0
        assert self.states.available() == self.states.num_slots and self.pool.num_available_blocks == self.pool.total_blocks


TestStateSlots = PrefixCacheSchedulerMachine.TestCase
TestStateSlots.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
