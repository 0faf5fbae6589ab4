"""Automatic prefix caching and explicit snapshots, through the engine's real step.

Every check compares the cached engine with the same engine run with prefix caching off
(greedy, float32): outputs must be identical, and the prompt tokens the engine prefilled must
drop by exactly what the block arithmetic predicts (counted by the scheduler, per row).
Both families: Qwen3 (attention KV only) and a Qwen3.5 hybrid (KV + recurrent-state
checkpoints, see jtp/core/state_pool.py).
"""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from jtp.config.engine_args import EngineArgs
from jtp.core.sampling_params import SamplingParams
from jtp.core.scheduler import Status
from jtp.engine.engine import Engine, RequestError

BS = 4  # block size: prompts cross many block boundaries
ENGINE_KW = dict(
    dtype="float32", skip_tokenizer_init=True, num_blocks=160, block_size=BS, max_num_seqs=4,
    max_num_batched_tokens=48, max_model_len=256,
)
VOCAB = 120  # below both test models' vocabularies


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen3_path():
    from jtp.demo import ensure_demo_checkpoint

    return ensure_demo_checkpoint()


@pytest.fixture(scope="module")
def hybrid_path(hybrid_qwen3_5_dir):
    return hybrid_qwen3_5_dir


@pytest.fixture(scope="module", params=["qwen3", "hybrid"])
def model(request, qwen3_path):
    """(kind, checkpoint path) of each family."""
    if request.param == "qwen3":
        return "qwen3", qwen3_path
    return "hybrid", request.getfixturevalue("hybrid_path")


def engine_for(path, cache: bool, **kw) -> Engine:
    return Engine.from_args(EngineArgs(model=path, **{**ENGINE_KW, "enable_prefix_caching": cache, **kw}))


_ENGINES: dict = {}


@pytest.fixture
def engines(model):
    """(kind, uncached engine, cached engine with an empty cache), built once per family."""
    kind, path = model
    if kind not in _ENGINES:
        _ENGINES[kind] = (engine_for(path, False), engine_for(path, True))
    plain, cached = _ENGINES[kind]
    for s in cached.list_snapshots():
        cached.drop(s.id)
    cached.reset_prefix_cache()
    assert cached.pool.num_cached_blocks == 0
    return kind, plain, cached


def run_one(engine: Engine, prompt, n: int):
    """Generate alone; (tokens, prompt tokens prefilled, cached tokens)."""
    before = engine.stats().prompt_tokens_computed
    rid = engine.submit(prompt, greedy(n))
    events = list(engine.stream(rid))
    return (
        [t for e in events for t in e.token_ids],
        engine.stats().prompt_tokens_computed - before,
        events[-1].cached_tokens,
    )


def document_questions(seed: int, doc_len: int, num: int):
    rng = random.Random(seed)
    doc = [rng.randrange(VOCAB) for _ in range(doc_len)]
    # Distinct first tokens: no two questions share a block beyond the document.
    firsts = rng.sample(range(VOCAB), num)
    qs = [[f] + [rng.randrange(VOCAB) for _ in range(rng.randint(0, 9))] for f in firsts]
    qs[0] += [rng.randrange(VOCAB) for _ in range(2 * BS)]  # see the hybrid arithmetic below
    return doc, qs


def test_many_questions_over_one_document(engines):
    kind, plain, cached = engines
    doc, qs = document_questions(seed=1, doc_len=90, num=5)
    hits_before, queries_before = cached.stats().prefix_cache_hits, cached.stats().prefix_cache_queries
    shared = len(doc) // BS * BS  # whole blocks of the document
    for i, q in enumerate(qs):
        prompt = doc + q
        want, full, _ = run_one(plain, prompt, 6)
        got, computed, hit = run_one(cached, prompt, 6)
        assert got == want, f"question {i}: cached output differs"
        assert full == len(prompt)
        # Qwen3: every later question reuses the document's blocks.
        # Hybrid: question 0 leaves state checkpoints only at its own prompt end (past the
        # document: it is 2 blocks longer), so question 1 recomputes everything and leaves a
        # checkpoint where it left the cached prefix; questions 2.. restore from there.
        expect_hit = 0 if i == 0 or (kind == "hybrid" and i == 1) else shared
        assert hit == expect_hit, f"question {i}"
        assert computed == len(prompt) - expect_hit, f"question {i}"
    stats = cached.stats()
    assert stats.prefix_cache_hits - hits_before == sum(
        0 if i == 0 or (kind == "hybrid" and i == 1) else shared for i in range(len(qs))
    )
    assert stats.prefix_cache_queries - queries_before == sum(len(doc) + len(q) for q in qs)
    cached.pool.check_invariants()
    if cached.states is not None:
        cached.states.check_invariants()


def _multi_turn_hit(kind: str, prev_prompt_len: int, prev_computed: int, prompt_len: int) -> int:
    """Tokens a follow-up turn restores: the previous turn's computed tokens (its prompt and all
    but the last output token) in whole blocks, leaving one prompt token to compute. On the
    hybrid the prefix must end at a state checkpoint: a block boundary the previous turn's
    decoding crossed, or else its prompt's last block boundary."""
    cap = min(prev_computed // BS, (prompt_len - 1) // BS) * BS
    if kind == "qwen3":
        return cap
    first_past_prompt = -(-prev_prompt_len // BS) * BS
    points = {0, (prev_prompt_len - 1) // BS * BS} | set(range(first_past_prompt, prev_computed + 1, BS))
    return max(p for p in points if p <= cap)


def test_multi_turn_chat(engines):
    kind, plain, cached = engines
    rng = random.Random(7)
    conversation = [rng.randrange(VOCAB) for _ in range(30)]
    prev = None
    for turn in range(4):
        n = 5 + 3 * turn
        want, _, _ = run_one(plain, conversation, n)
        got, computed, hit = run_one(cached, conversation, n)
        assert got == want, f"turn {turn}"
        expect = 0 if prev is None else _multi_turn_hit(kind, *prev, len(conversation))
        assert hit == expect, f"turn {turn}"
        assert computed == len(conversation) - expect
        prev = (len(conversation), len(conversation) + n - 1)  # the last output token is never fed
        conversation = conversation + got + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))]


def test_concurrent_requests_share_cached_blocks(engines):
    """A batch of requests over one prefix, submitted together after a first one finished:
    all hit, the blocks are held by several tables at once, outputs equal the uncached run."""
    kind, plain, cached = engines
    doc, qs = document_questions(seed=3, doc_len=60, num=4)
    params = greedy(5)
    want = [c.token_ids for c in plain.generate([doc + q for q in qs], params)]
    first = cached.generate([doc + qs[0]], params)[0].token_ids
    assert first == want[0]
    # Hybrid: question 1 makes the document checkpoint; then the rest run together.
    if kind == "hybrid":
        assert cached.generate([doc + qs[1]], params)[0].token_ids == want[1]
    rest = qs[2:] if kind == "hybrid" else qs[1:]
    rids = [cached.submit(doc + q, params) for q in rest]
    cached.step()  # admits all of them in one step
    assert cached.stats().num_running == len(rest)
    assert cached.pool.usage()["shared_blocks"] >= len(doc) // BS
    outs = [cached.result(r).token_ids for r in rids]
    assert outs == want[len(qs) - len(rest):]


def test_eviction_under_memory_pressure_keeps_outputs_exact(model):
    """A pool barely larger than one request: cached blocks are evicted LRU to admit new work
    (never a referenced one), and every output still equals the uncached run."""
    kind, path = model
    rng = random.Random(11)
    small = dict(num_blocks=40, max_model_len=96)
    plain, cached = engine_for(path, False, **small), engine_for(path, True, **small)
    bases = [[rng.randrange(VOCAB) for _ in range(50)] for _ in range(3)]
    for i in range(8):
        prompt = bases[i % 3][: 40 + i] + [rng.randrange(VOCAB) for _ in range(5)]
        assert run_one(cached, prompt, 8)[0] == run_one(plain, prompt, 8)[0], f"request {i}"
    assert cached.pool.num_evicted > 0, "the workload was meant to force evictions"
    cached.pool.check_invariants()


def test_caching_off_computes_every_prompt_token(qwen3_path):
    engine = engine_for(qwen3_path, False)
    prompt = list(range(40))
    for _ in range(2):
        _, computed, hit = run_one(engine, prompt, 3)
        assert (computed, hit) == (len(prompt), 0)
    assert engine.stats().prefix_cache_blocks == 0
    with pytest.raises(RequestError, match="prefix caching"):
        engine.snapshot(tokens=prompt)


# ----------------------------------------------------------------------------- snapshots


def finish(engine: Engine, rid: str) -> None:
    while engine.request(rid).status is not Status.FINISHED:
        engine.step()


def test_snapshot_restore_drop(engines):
    kind, plain, cached = engines
    rng = random.Random(5)
    prompt = [rng.randrange(VOCAB) for _ in range(37)]
    rid = cached.submit(prompt, greedy(9))
    finish(cached, rid)
    snap_id = cached.snapshot(rid)  # finished, not yet released
    first = cached.result(rid).token_ids
    snap = cached.list_snapshots()[0]
    assert snap.id == snap_id and snap.tokens == prompt + first and snap.num_cached_tokens > 0
    used = cached.pool.num_used_blocks
    assert used == len(snap.blocks), "a snapshot holds its blocks after its request is gone"
    cached.reset_prefix_cache()  # unpinned entries go; the snapshot's stay
    follow = [rng.randrange(VOCAB) for _ in range(6)]
    before = cached.stats().prompt_tokens_computed
    restored = cached.result(cached.restore(snap_id, follow, greedy(7))).token_ids
    assert restored == plain.generate([prompt + first + follow], greedy(7))[0].token_ids
    assert cached.stats().prompt_tokens_computed - before == len(snap.tokens) + len(follow) - snap.num_cached_tokens
    cached.drop(snap_id)
    assert cached.pool.num_used_blocks == 0 and not cached.list_snapshots()
    with pytest.raises(KeyError, match="unknown snapshot"):
        cached.restore(snap_id)
    if cached.states is not None:
        assert cached.states.available() == cached.states.num_slots


def test_snapshot_of_tokens_prefills_once(engines):
    kind, _, cached = engines
    tokens = list(range(3, 50))
    before = cached.stats().prompt_tokens_computed
    snap_id = cached.snapshot(tokens=tokens)
    computed = cached.stats().prompt_tokens_computed
    assert computed - before == len(tokens)
    snap = cached.snapshots.get(snap_id)
    full = len(tokens) // BS if kind == "qwen3" else (len(tokens) - 1) // BS
    assert snap.num_cached_tokens == full * BS
    again = cached.snapshot(tokens=tokens)  # cached now: no second prefill
    assert cached.stats().prompt_tokens_computed == computed and again != snap_id


def test_snapshot_cap_budget_and_refusal(qwen3_path):
    engine = engine_for(qwen3_path, True, max_snapshots=2)
    ids = [engine.snapshot(tokens=[i] * 20) for i in range(3)]
    assert [s.id for s in engine.list_snapshots()] == ids[1:], "the least recently used one is evicted"
    engine.restore(ids[1])  # now the most recently used
    engine.snapshot(tokens=[9] * 20)
    assert [s.id for s in engine.list_snapshots()][0] == ids[1]
    usage = engine.pool.usage()
    engine.snapshots.budget_bytes = engine.runner.bytes_per_block()  # room for one block only
    with pytest.raises(RequestError, match="snapshot budget"):
        engine.snapshot(tokens=list(range(40)))
    # A refused snapshot holds nothing: no sequence, no reservation (the restored request started
    # above still runs meanwhile, filling blocks of its own reservation, so count what is available).
    after = engine.pool.usage()
    assert (after["num_seqs"], after["available_blocks"]) == (usage["num_seqs"], usage["available_blocks"])
    with pytest.raises(RequestError, match="not both"):
        engine.snapshot("x", tokens=[1])


def test_snapshots_never_hold_a_request_back(qwen3_path):
    """A request that cannot fit beside the pinned snapshots (nothing else running) evicts them,
    least recently used first, instead of waiting for good."""
    engine = engine_for(qwen3_path, True, num_blocks=40, max_model_len=150, snapshot_budget_bytes=10**9)
    first = engine.snapshot(tokens=list(range(60)))
    second = engine.snapshot(tokens=list(range(60, 120)))
    assert engine.pool.num_available_blocks < 30
    big = [7] * 100
    out = engine.generate([big], greedy(10))[0].token_ids
    assert out == engine_for(qwen3_path, False, num_blocks=40, max_model_len=150).generate([big], greedy(10))[0].token_ids
    assert first not in engine.snapshots, "the least recently used snapshot went first"
    assert engine.pool.num_used_blocks == sum(len(s.blocks) for s in engine.list_snapshots())
    del second


# ----------------------------------------------------------------------------- state machine


class CacheMachine(RuleBasedStateMachine):
    """Random interleavings of submit / step / abort / snapshot / restore / drop / evict on a
    small cached engine. Every request that finishes normally must equal the uncached run of
    the same prompt; the pool and state-slot bookkeeping must stay consistent; at the end,
    nothing leaks."""

    path = None  # set per family below

    @initialize()
    def setup(self):
        cls = type(self)
        if getattr(cls, "engines", None) is None:  # one engine pair per family: compile once
            cls.engines = (engine_for(cls.path, True, num_blocks=48, max_model_len=80),
                           engine_for(cls.path, False, num_blocks=48, max_model_len=80))
            cls.reference = {}
        self.engine, self.plain = cls.engines
        self.engine.stop()  # ends any request a failed example left behind
        for s in self.engine.list_snapshots():
            self.engine.drop(s.id)
        self.engine.reset_prefix_cache()  # each example starts from the same (empty) cache
        self.rng = random.Random(0)
        self.bases = [[self.rng.randrange(VOCAB) for _ in range(40)] for _ in range(2)]
        self.live: dict[str, tuple[list[int], int]] = {}
        self.snaps: list[str] = []

    def expected(self, prompt, n):
        key = (tuple(prompt), n)
        if key not in self.reference:
            self.reference[key] = self.plain.generate([prompt], greedy(n))[0].token_ids
        return self.reference[key]

    @rule(base=st.integers(0, 1), cut=st.integers(1, 40), tail=st.integers(0, 6), n=st.integers(1, 8))
    def submit(self, base, cut, tail, n):
        prompt = self.bases[base][:cut] + [self.rng.randrange(VOCAB) for _ in range(tail)]
        self.live[self.engine.submit(prompt, greedy(n))] = (prompt, n)

    @rule(steps=st.integers(1, 4))
    def step(self, steps):
        for _ in range(steps):
            self.engine.step()
        self._collect()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(list(self.live)))
        self.engine.abort(rid)
        self.live.pop(rid)
        self.engine.release(rid)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def snapshot_request(self, data):
        rid = data.draw(st.sampled_from(list(self.live)))
        self._snapshot(lambda: self.engine.snapshot(rid))

    @rule(base=st.integers(0, 1), cut=st.integers(1, 40))
    def snapshot_tokens(self, base, cut):
        self._snapshot(lambda: self.engine.snapshot(tokens=self.bases[base][:cut]))

    def _snapshot(self, make):
        try:
            self.snaps.append(make())
        except RequestError as e:  # the pool cannot pin more now: refused whole, nothing held
            assert "cannot pin" in str(e)
            held = sum(len(s.blocks) for s in self.engine.list_snapshots())
            assert self.engine.pool.usage()["num_seqs"] == len(self.engine.list_snapshots()) + len(
                self.engine.scheduler.running), f"{held} pinned blocks, {e}"

    @precondition(lambda self: self.snaps)
    @rule(data=st.data(), tail=st.integers(0, 4), n=st.integers(1, 6))
    def restore(self, data, tail, n):
        sid = data.draw(st.sampled_from(self.snaps))
        if sid not in self.engine.snapshots:  # evicted by the entry cap
            self.snaps.remove(sid)
            return
        extra = [self.rng.randrange(VOCAB) for _ in range(tail)]
        prompt = self.engine.snapshots.get(sid).tokens + extra
        if len(prompt) + n > self.engine.max_model_len:
            return
        self.live[self.engine.restore(sid, extra, greedy(n))] = (prompt, n)

    @precondition(lambda self: self.snaps)
    @rule(data=st.data())
    def drop(self, data):
        sid = data.draw(st.sampled_from(self.snaps))
        self.snaps.remove(sid)
        if sid in self.engine.snapshots:
            self.engine.drop(sid)

    @rule()
    def evict(self):
        self.engine.reset_prefix_cache()

    def _collect(self):
        for rid in [r for r in self.live if self.engine.request(r).status is Status.FINISHED]:
            prompt, n = self.live.pop(rid)
            assert self.engine.result(rid).token_ids == self.expected(prompt, n)

    @invariant()
    def bookkeeping(self):
        if not hasattr(self, "engine"):
            return
        self.engine.pool.check_invariants()
        if self.engine.states is not None:
            self.engine.states.check_invariants()

    def teardown(self):
        if not hasattr(self, "engine"):
            return
        while self.engine.has_unfinished():
            self.engine.step()
        self._collect()
        for sid in self.snaps:
            if sid in self.engine.snapshots:
                self.engine.drop(sid)
        assert self.engine.pool.num_used_blocks == 0 and self.engine.pool.num_reserved_blocks == 0, "KV leak"
        if self.engine.states is not None:
            assert self.engine.states.available() == self.engine.states.num_slots, "state-slot leak"


MACHINE_SETTINGS = settings(
    max_examples=8, stateful_step_count=20, deadline=None, suppress_health_check=list(HealthCheck)
)


def test_cache_state_machine_qwen3(qwen3_path):
    machine = type("Qwen3CacheMachine", (CacheMachine,), {"path": qwen3_path, "engines": None})
    machine.TestCase.settings = MACHINE_SETTINGS
    machine.TestCase().runTest()


def test_cache_state_machine_hybrid(hybrid_path):
    machine = type("HybridCacheMachine", (CacheMachine,), {"path": hybrid_path, "engines": None})
    machine.TestCase.settings = MACHINE_SETTINGS
    machine.TestCase().runTest()
