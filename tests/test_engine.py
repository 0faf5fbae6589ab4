"""Engine acceptance tests: continuous batching must not change what a request produces.

Every check compares the engine with something independent of the batch it ran in:
the same request run alone (a separate engine, nothing else in flight) and HF transformers'
greedy `generate` on the very checkpoint the engine loads (tests/hf_models.py).

The engines are kept tiny (vocab 128, 3 layers) and use a small token budget (64) and small
blocks (4 tokens), so prompts are chunked across steps, chunks share steps with decodes and
sequences cross block boundaries all the time.
"""
from __future__ import annotations

import dataclasses
import random
import time

import pytest
from hf_models import make_hf_checkpoint

from jtp.config.engine_args import EngineArgs
from jtp.core.page_pool import PagePool
from jtp.core.sampling_params import MAX_LOGPROBS, SamplingParams
from jtp.core.scheduler import Request, Scheduler, Status
from jtp.engine.engine import Completion, Engine, RequestError

VOCAB = 128
ENGINE_KW = dict(
    skip_tokenizer_init=True, num_blocks=256, block_size=4, max_num_seqs=16, max_num_batched_tokens=64, max_model_len=128
)


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def make_engine(path, **overrides) -> Engine:
    return Engine.from_args(EngineArgs(model=path, **{**ENGINE_KW, **overrides}))


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def workload(seed: int, num: int, min_len=3, max_len=70, min_new=1, max_new=20):
    """`num` (prompt, max_tokens) pairs; the extremes of both ranges are always included."""
    rng = random.Random(seed)
    lengths = [min_len, max_len] + [rng.randint(min_len, max_len) for _ in range(num - 2)]
    news = [max_new, min_new] + [rng.randint(min_new, max_new) for _ in range(num - 2)]
    rng.shuffle(lengths)
    return [(random_prompt(rng, n), m) for n, m in zip(lengths, news)]


def stream_all(engine: Engine, rid: str):
    """Consume a request's stream (which releases it); its events and the Completion they add up to."""
    events = list(engine.stream(rid))
    last = events[-1]
    logprobs = [lp for ev in events for lp in ev.logprobs or []]
    top = [t for ev in events for t in ev.top_logprobs or []]
    completion = Completion(
        rid, [], [t for ev in events for t in ev.token_ids], "".join(ev.text for ev in events),
        last.finish_reason, logprobs or None, top or None, last.error,
    )
    return events, completion


# ----------------------------------------------------------------------------- instrumentation


class ScheduleSpy:
    """Wraps `engine.scheduler.schedule` and records, per step, the rows and the running count."""

    def __init__(self, engine: Engine):
        self.steps: list[list[tuple[str, int, int, int, int]]] = []  # (id, start, n, prompt_len, num_tokens)
        self.running: list[int] = []
        inner = engine.scheduler.schedule

        def schedule(*args, **kwargs):
            rows = inner(*args, **kwargs)
            if rows:
                self.steps.append(
                    [(r.request.id, r.start, r.num_tokens, len(r.request.prompt_ids), r.request.num_tokens) for r in rows]
                )
                self.running.append(len(engine.scheduler.running))
            return rows

        engine.scheduler.schedule = schedule

    def saw_mixed_step(self) -> bool:
        """Some step fed a partial prompt chunk and a decode token together."""
        for rows in self.steps:
            partial = any(start + n < plen for _, start, n, plen, _ in rows)
            decode = any(start >= plen for _, start, n, plen, _ in rows)
            if partial and decode:
                return True
        return False

    def max_chunks_per_prompt(self) -> int:
        chunks: dict[str, int] = {}
        for rows in self.steps:
            for rid, start, n, plen, _ in rows:
                if start < plen:
                    chunks[rid] = chunks.get(rid, 0) + 1
        return max(chunks.values(), default=0)


def run_staggered(engine: Engine, prompts, params, waves=(3, 2, 4, 1, 3), gaps=(2, 1, 3, 2, 1), max_steps=2000):
    """Submit in waves with `engine.step()` calls in between, then drain; Completions in input order."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    rids, i, steps = [], 0, 0
    for wave, gap in zip(waves, gaps):
        for p, sp in zip(prompts[i : i + wave], params[i : i + wave]):
            rids.append(engine.submit(p, sp))
        i += wave
        for _ in range(gap):
            engine.step()
            steps += 1
    for p, sp in zip(prompts[i:], params[i:]):
        rids.append(engine.submit(p, sp))
    while engine.has_unfinished():
        engine.step()
        steps += 1
        assert steps < max_steps, f"engine did not drain within {max_steps} steps"
    return [engine.result(rid) for rid in rids]  # result() releases each request


# ----------------------------------------------------------------------------- fixtures


class Model:
    """One tiny HF checkpoint: the HF model, its directory, a solo engine and cached references."""

    def __init__(self, kind: str, path):
        self.kind = kind
        self.hf, self.path = make_hf_checkpoint(kind, path)
        self._solo_engine: Engine | None = None
        self._solo: dict = {}
        self._hf: dict = {}

    @property
    def solo_engine(self) -> Engine:
        if self._solo_engine is None:
            self._solo_engine = make_engine(self.path)
        return self._solo_engine

    def solo(self, prompt, params: SamplingParams):
        """The request run alone: nothing else is in flight in the solo engine while it runs."""
        key = (tuple(prompt), repr(params))
        if key not in self._solo:
            eng = self.solo_engine
            assert not eng.has_unfinished()
            (c,) = eng.generate([prompt], params)
            assert eng.pool.num_free_blocks == eng.pool.total_blocks
            self._solo[key] = c
        return self._solo[key]

    def hf_greedy(self, prompt, n: int) -> list[int]:
        key = (tuple(prompt), n)
        if key not in self._hf:
            import torch

            ids = torch.tensor([prompt])
            with torch.no_grad():
                out = self.hf.generate(
                    ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, min_new_tokens=0,
                    eos_token_id=None, pad_token_id=0, num_beams=1,
                )
            self._hf[key] = out[0, len(prompt) :].tolist()
            assert len(self._hf[key]) == n, "HF stopped early: eos must be disabled"
        return self._hf[key]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    cache: dict[str, Model] = {}

    def get(kind: str) -> Model:
        if kind not in cache:
            cache[kind] = Model(kind, tmp_path_factory.mktemp("ckpt") / kind)
        return cache[kind]

    return get


@pytest.fixture(scope="module")
def qwen3(models) -> Model:
    return models("qwen3")


@pytest.fixture(scope="module")
def engine(qwen3) -> Engine:
    """A shared batching engine for the tests that do not count compilations."""
    return make_engine(qwen3.path)


@pytest.fixture(scope="module")
def batch_workload():
    return workload(seed=7, num=16)


@pytest.fixture(scope="module")
def tp1_results(qwen3, batch_workload):
    """The staggered run of the 16-request workload at tp=1 (shared by the tp>1 comparisons)."""
    eng = make_engine(qwen3.path)
    spy = ScheduleSpy(eng)
    prompts = [p for p, _ in batch_workload]
    params = [greedy(n) for _, n in batch_workload]
    results = run_staggered(eng, prompts, params)
    return results, spy, eng


# ----------------------------------------------------------------------------- 1. batch invariance


def _check_against_references(model: Model, work, results, check_hf=True):
    for i, ((prompt, n), c) in enumerate(zip(work, results)):
        where = f"request {i} (prompt {len(prompt)} tokens, max_tokens {n})"
        assert c.finish_reason == "length", where
        assert c.prompt_token_ids == prompt, where
        assert len(c.token_ids) == n, where
        solo = model.solo(prompt, greedy(n))
        assert c.token_ids == solo.token_ids, f"{where}: batched {c.token_ids} != alone {solo.token_ids}"
        if check_hf:
            hf = model.hf_greedy(prompt, n)
            assert c.token_ids == hf, f"{where}: engine {c.token_ids} != HF generate {hf}"


def test_batch_invariance_qwen3(qwen3, batch_workload, tp1_results):
    results, spy, eng = tp1_results
    # The workload really exercised chunked prefill mixed with decodes and concurrency.
    assert spy.saw_mixed_step(), "no step mixed a partial prefill chunk with decode tokens"
    assert spy.max_chunks_per_prompt() >= 2, "no prompt was split over several steps"
    assert max(spy.running) >= 6, f"too little concurrency: at most {max(spy.running)} running"
    _check_against_references(qwen3, batch_workload, results)
    assert eng.pool.num_free_blocks == eng.pool.total_blocks
    eng.pool.check_invariants()


@pytest.mark.parametrize("tp", [2, 4])
def test_batch_invariance_tensor_parallel(qwen3, batch_workload, tp1_results, tp):
    """tp=4 over 2 KV heads exercises KV-head replication."""
    eng = make_engine(qwen3.path, tensor_parallel_size=tp)
    assert eng.runner.tp == tp
    prompts = [p for p, _ in batch_workload]
    results = run_staggered(eng, prompts, [greedy(n) for _, n in batch_workload])
    ref, _, _ = tp1_results
    for i, (c, r) in enumerate(zip(results, ref)):
        assert c.token_ids == r.token_ids, f"tp={tp} request {i}: {c.token_ids} != tp=1 {r.token_ids}"
    # and, transitively, HF (checked directly too: cheap, cached)
    _check_against_references(qwen3, batch_workload, results)
    assert eng.pool.num_free_blocks == eng.pool.total_blocks


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2"])
def test_batch_invariance_other_families(models, kind):
    model = models(kind)
    # A smaller budget (32) still chunks these shorter prompts, with fewer shapes to compile.
    work = workload(seed=11, num=6, max_len=40, max_new=10)
    eng = make_engine(model.path, max_num_batched_tokens=32)
    spy = ScheduleSpy(eng)
    results = run_staggered(eng, [p for p, _ in work], [greedy(n) for _, n in work], waves=(2, 2), gaps=(2, 1))
    assert spy.max_chunks_per_prompt() >= 2
    _check_against_references(model, work, results)


# ----------------------------------------------------------------------------- 2. backpressure


def test_backpressure_pool_fits_three(qwen3):
    # Every request's worst case is exactly 20 tokens = 5 blocks of 4; the pool has 15 blocks.
    rng = random.Random(3)
    work = []
    for _ in range(20):
        n = rng.randint(4, 16)
        work.append((random_prompt(rng, n), 20 - n))
    eng = make_engine(qwen3.path, num_blocks=15)
    spy = ScheduleSpy(eng)
    rids = [eng.submit(p, greedy(m)) for p, m in work]
    bound = sum(-(-len(p) // 64) + m for p, m in work)  # fully serial execution, one request at a time
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
        assert steps <= bound, f"no progress after {steps} steps: deadlock?"
        assert len(eng.scheduler.running) <= 3
        eng.pool.check_invariants()
    assert max(spy.running) == 3, f"at most {max(spy.running)} ran at once; expected the pool to admit exactly 3"
    assert all(n <= 3 for n in spy.running)
    for rid, (p, m) in zip(rids, work):
        c = eng.result(rid)
        assert c.finish_reason == "length" and len(c.token_ids) == m
        assert c.token_ids == qwen3.solo(p, greedy(m)).token_ids, f"{rid} differs from its solo result"
    assert eng.pool.num_free_blocks == 15


@pytest.mark.parametrize("max_num_seqs", [1, 2])
def test_finished_events_time_each_phase(qwen3, max_num_seqs):
    """The finished event's RequestTiming (the server's jtp:request_*_time_seconds): with one row,
    the second request queues while the first runs (its queue time covers the first's whole
    inference); with two rows neither waits a step. Phases add up: inference = prefill + decode,
    and queue + inference fits in the wall time of the run."""
    eng = make_engine(qwen3.path, max_num_seqs=max_num_seqs)
    start = time.monotonic()
    first, second = (eng.submit(list(range(3 + i, 11 + i)), greedy(6)) for i in range(2))
    timings = [list(eng.stream(rid))[-1].timing for rid in (first, second)]
    wall = time.monotonic() - start
    for t in timings:
        assert None not in t and min(t) >= 0, t
        assert t.inference == pytest.approx(t.prefill + t.decode, abs=1e-9)
        assert t.queue + t.inference <= wall
    a, b = timings
    if max_num_seqs == 1:
        assert b.queue >= a.inference > 0, timings  # admitted only once the first had finished
    else:
        assert b.queue < a.prefill + a.decode / 2, timings  # admitted in the first one's step


def test_submit_errors(engine):
    pool_engine = engine  # (a request larger than the pool: see test_request_larger_than_pool)
    with pytest.raises(RequestError, match="context length") as e:
        pool_engine.submit(list(range(100)), greedy(50))
    assert "150" in str(e.value) and "128" in str(e.value)
    with pytest.raises(RequestError, match="temperature"):
        pool_engine.submit([1, 2, 3], SamplingParams(temperature=-1.0))
    with pytest.raises(RequestError, match="top_p"):
        pool_engine.submit([1, 2, 3], SamplingParams(top_p=0.0))
    with pytest.raises(RequestError, match="max_tokens"):
        pool_engine.submit([1, 2, 3], SamplingParams(max_tokens=0))
    with pytest.raises(RequestError, match="empty"):
        pool_engine.submit([], greedy(3))
    with pytest.raises(RequestError, match="vocabulary"):
        pool_engine.submit([1, VOCAB], greedy(3))
    # Nothing was queued by the rejected submits.
    assert not pool_engine.has_unfinished()
    assert pool_engine.pool.num_free_blocks == pool_engine.pool.total_blocks


def test_request_larger_than_pool(qwen3):
    eng = make_engine(qwen3.path, num_blocks=15)
    with pytest.raises(RequestError, match="blocks") as e:
        eng.submit(list(range(10)), greedy(60))  # 70 tokens = 18 blocks > 15, yet < max_model_len
    assert "18" in str(e.value) and "15" in str(e.value)
    assert not eng.has_unfinished()
    # A request that fits exactly (60 tokens = 15 blocks) is served.
    (c,) = eng.generate([list(range(10))], greedy(50))
    assert len(c.token_ids) == 50 and eng.pool.num_free_blocks == 15


# ----------------------------------------------------------------------------- 3. abort


def _request(engine: Engine, rid: str) -> Request:
    return engine.request(rid)


def test_abort_mid_stream(qwen3, engine):
    pool = engine.pool
    total = pool.total_blocks
    assert pool.num_free_blocks == total
    rng = random.Random(5)
    others = [(random_prompt(rng, 9), 12), (random_prompt(rng, 70), 6), (random_prompt(rng, 30), 15)]
    victim_prompt = random_prompt(rng, 21)
    long_prompt = random_prompt(rng, 110)  # prefilled over several steps, aborted part-way

    ids = [engine.submit(p, greedy(m)) for p, m in others]
    victim = engine.submit(victim_prompt, greedy(40))
    streamed = []
    events = engine.stream(victim)
    for ev in events:
        assert not ev.finished
        streamed += ev.token_ids
        if len(streamed) == 5:
            break
    held = len(pool.block_table(victim))
    # Blocks grow with the K/V computed (or being computed by the step in flight), not the worst case.
    computed = _request(engine, victim).num_computed
    assert len(victim_prompt) + 4 <= computed < len(victim_prompt) + 40
    assert held == -(-computed // pool.block_size) < pool.blocks_needed(len(victim_prompt) + 40)
    free_before = pool.num_free_blocks
    assert engine.abort(victim) is True
    # Every block comes back at once, and the unused reservation with it.
    assert victim not in pool
    assert pool.num_free_blocks == free_before + held
    pool.check_invariants()
    held_by_others = sum(len(pool.block_table(r.id)) for r in engine.scheduler.running)
    assert pool.num_free_blocks == total - held_by_others
    assert pool.num_available_blocks == total - sum(
        pool.blocks_needed(r.max_total_tokens) for r in engine.scheduler.running
    )
    rest = list(events)
    assert len(rest) == 1 and rest[0].finished and rest[0].finish_reason == "abort" and rest[0].token_ids == []
    assert engine.abort(victim) is False  # already finished
    with pytest.raises(KeyError):  # the stream consumed the finished event: the request is released
        engine.result(victim)
    assert streamed == qwen3.solo(victim_prompt, greedy(40)).token_ids[:5]

    # Abort in the middle of a chunked prefill.
    long_id = engine.submit(long_prompt, greedy(5))
    for _ in range(10):
        engine.step()
        req = _request(engine, long_id)
        if req.status is Status.RUNNING and 0 < req.num_computed < len(long_prompt):
            break
    else:
        pytest.fail("the long prompt never was part-way through its prefill")
    assert engine.abort(long_id)
    assert long_id not in pool
    pool.check_invariants()
    assert long_id not in engine.outputs  # aborted by its owner, nobody streaming it: released

    # Abort a request that is still waiting (never scheduled): it never touches the pool.
    waiting_id = engine.submit([1, 2, 3], greedy(4))
    assert _request(engine, waiting_id).status is Status.WAITING
    events = engine.stream(waiting_id)  # a consumer that claimed it before the abort still hears of it
    assert engine.abort(waiting_id)
    assert [ev.finish_reason for ev in events] == ["abort"]
    assert engine.abort("no-such-request") is False

    # The others are unaffected.
    for rid, (p, m) in zip(ids, others):
        c = engine.result(rid)
        assert c.finish_reason == "length"
        assert c.token_ids == qwen3.solo(p, greedy(m)).token_ids, f"{rid} changed by the aborts"
    assert not engine.has_unfinished()
    assert pool.num_free_blocks == total
    pool.check_invariants()
    assert not engine.outputs, "every consumed request is released"


# ----------------------------------------------------------------------------- 4. compilations


def _varied_params(rng: random.Random, max_tokens: int) -> SamplingParams:
    kind = rng.choice(["greedy", "temp", "top_p", "top_k", "penalty", "logprobs", "mix"])
    seed = rng.randrange(2**31)
    base = dict(max_tokens=max_tokens, ignore_eos=True, seed=seed)
    if kind == "greedy":
        return SamplingParams(temperature=0.0, **base)
    if kind == "temp":
        return SamplingParams(temperature=0.7, **base)
    if kind == "top_p":
        return SamplingParams(temperature=1.0, top_p=0.8, **base)
    if kind == "top_k":
        return SamplingParams(temperature=0.9, top_k=5, min_p=0.05, **base)
    if kind == "penalty":
        return SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5, **base)
    if kind == "logprobs":
        return SamplingParams(temperature=0.0, logprobs=rng.choice([0, 1, 5]), **base)
    return SamplingParams(
        temperature=0.8, top_p=0.9, presence_penalty=0.4, logprobs=rng.choice([2, MAX_LOGPROBS]), **base
    )


def _compile_workload():
    rng = random.Random(2024)
    work = workload(seed=99, num=50, min_len=1, max_len=90, min_new=1, max_new=24)
    return [(p, _varied_params(rng, m)) for p, m in work]


def test_compilation_count_is_bounded(qwen3):
    eng = make_engine(qwen3.path)
    runner = eng.runner
    variants, signatures = set(), set()
    inner = runner.dispatch

    def dispatch(step):
        # The packed step's layout: its shapes (tokens, rows, blocks, row bucket, verify positions,
        # penalty length) and sampling flags, everything that selects a compiled variant.
        variants.add(step.layout.flags)
        signatures.add(step.layout)
        return inner(step)

    runner.dispatch = dispatch
    work = _compile_workload()
    prompts, params = [p for p, _ in work], [sp for _, sp in work]

    first = run_staggered(eng, prompts, params, waves=(5, 10, 3, 12, 7), gaps=(3, 2, 4, 1, 2))
    compiled = runner.compilations
    # A step runs a forward program (its shape's) and a sampling program (its rows bucket's, variant's
    # and penalty length's): the sampling variants never multiply the forward programs.
    forward, sampling = {s.forward for s in signatures}, {s.sampling for s in signatures}
    buckets = eng.scheduler.buckets
    rows = len({B for _, B, _ in buckets.shapes()})  # the rows buckets and a lone token's 1
    bound = len(buckets.shapes()) + rows * len(variants) * len({s.penalty_len for s in signatures})
    print(
        f"\ncompilations: {compiled} (forward programs {len(forward)}, sampling programs {len(sampling)}, "
        f"{len(variants)} sampling-flag variants, bound {bound})"
    )
    assert compiled <= bound, f"{compiled} compilations exceed shapes + rows buckets x variants x lengths = {bound}"
    assert compiled == len(forward) + len(sampling), "a program was traced more than once for the same layout"
    for c, (p, sp) in zip(first, work):
        assert c.finish_reason == "length" and len(c.token_ids) == sp.max_tokens
        if sp.logprobs is not None:
            assert len(c.logprobs) == sp.max_tokens
            if sp.logprobs:
                assert [len(t) for t in c.top_logprobs] == [sp.logprobs] * sp.max_tokens
            else:
                assert c.top_logprobs is None
        else:
            assert c.logprobs is None

    second = run_staggered(eng, prompts, params, waves=(5, 10, 3, 12, 7), gaps=(3, 2, 4, 1, 2))
    assert runner.compilations == compiled, f"the repeated workload compiled {runner.compilations - compiled} more"
    # Explicit seeds: the repeat is token-for-token identical, sampled rows included.
    for a, b in zip(first, second):
        assert a.token_ids == b.token_ids


# ----------------------------------------------------------------------------- 5. seeded sampling


def test_seeded_sampling_is_batch_invariant(qwen3, engine):
    rng = random.Random(8)
    prompt = random_prompt(rng, 17)
    seeded = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=1234, ignore_eos=True)
    alone = qwen3.solo(prompt, seeded)

    others = [
        (random_prompt(rng, 40), greedy(10)),
        (random_prompt(rng, 5), SamplingParams(max_tokens=12, temperature=1.2, ignore_eos=True)),
        (random_prompt(rng, 66), SamplingParams(max_tokens=8, temperature=0.5, top_k=3, ignore_eos=True)),
        (random_prompt(rng, 12), SamplingParams(max_tokens=20, temperature=0.9, repetition_penalty=1.5, seed=1)),
        (random_prompt(rng, 3), greedy(18, logprobs=4)),
        (random_prompt(rng, 28), SamplingParams(max_tokens=14, temperature=1.0, min_p=0.2, ignore_eos=True)),
        (random_prompt(rng, 50), SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=1234)),
    ]
    prompts = [p for p, _ in others[:4]] + [prompt] + [p for p, _ in others[4:]]
    params = [sp for _, sp in others[:4]] + [seeded] + [sp for _, sp in others[4:]]
    results = run_staggered(engine, prompts, params, waves=(2, 3), gaps=(3, 2))
    assert results[4].token_ids == alone.token_ids, "the seeded request changed with its batch"
    assert len(alone.token_ids) == 16
    # Sampling really happened: the same seed twice agrees, another seed (almost surely) not.
    solo_engine = qwen3.solo_engine
    (again,) = solo_engine.generate([prompt], seeded)
    assert again.token_ids == alone.token_ids
    reseeded = [dataclasses.replace(seeded, seed=s) for s in (1, 2, 3)]
    other_seeds = [c.token_ids for c in solo_engine.generate([prompt] * 3, reseeded)]
    assert any(t != alone.token_ids for t in other_seeds), "seed has no effect: is the row sampled greedily?"


# ----------------------------------------------------------------------------- 6. stop conditions


def test_stop_token_and_length(qwen3, engine):
    rng = random.Random(9)
    prompt = random_prompt(rng, 13)
    ref = qwen3.solo(prompt, greedy(20)).token_ids
    # Stop at the first occurrence of the 4th generated token (it may occur earlier too).
    stop = ref[3]
    cut = ref.index(stop) + 1
    rid = engine.submit(prompt, greedy(20, stop_token_ids=[stop]))
    events, c = stream_all(engine, rid)
    assert c.finish_reason == "stop"
    assert c.token_ids == ref[:cut] and c.token_ids[-1] == stop
    assert [t for ev in events for t in ev.token_ids] == c.token_ids
    assert [ev.finished for ev in events] == [False] * (len(events) - 1) + [True]
    assert events[-1].finish_reason == "stop"

    # Without ignore_eos the same stop token ends it too (the tiny config has no eos id).
    rid = engine.submit(prompt, SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[stop]))
    assert engine.result(rid).token_ids == ref[:cut]

    rid = engine.submit(prompt, greedy(7))
    events, c = stream_all(engine, rid)
    assert c.finish_reason == "length" and c.token_ids == ref[:7]
    assert [t for ev in events for t in ev.token_ids] == c.token_ids
    assert sum(ev.finished for ev in events) == 1 and events[-1].finish_reason == "length"

    # logprobs come back per token, consistent with greedy choice (the chosen token is the top one).
    rid = engine.submit(prompt, greedy(5, logprobs=3))
    events, c = stream_all(engine, rid)
    assert c.token_ids == ref[:5]
    assert len(c.logprobs) == 5 and len(c.top_logprobs) == 5
    for tok, lp, top in zip(c.token_ids, c.logprobs, c.top_logprobs):
        assert len(top) == 3 and max(top, key=top.get) == tok
        assert lp == pytest.approx(top[tok]) and lp <= 0
    assert [lp for ev in events for lp in ev.logprobs] == c.logprobs
    assert not engine.has_unfinished()


# ----------------------------------------------------------------------------- 7. fairness


def test_decode_and_prefill_never_starved(qwen3):
    budget = 64
    eng = make_engine(qwen3.path, block_size=16, num_blocks=64, max_model_len=512, max_num_batched_tokens=budget)
    spy = ScheduleSpy(eng)
    rng = random.Random(10)
    decoders = [(random_prompt(rng, rng.randint(3, 9)), 24) for _ in range(4)]
    dec_ids = [eng.submit(p, greedy(m)) for p, m in decoders]
    while not all(len(_request(eng, r).output_ids) >= 1 for r in dec_ids):
        eng.step()
    long_prompt = random_prompt(rng, 300)
    long_id = eng.submit(long_prompt, greedy(4))
    first = len(spy.steps)

    prefill_steps = 0
    while _request(eng, long_id).num_computed < len(long_prompt):
        before = {r: _request(eng, r).num_generated for r in dec_ids}  # sampled, seen or still on the device
        computed = _request(eng, long_id).num_computed
        eng.step()
        rows = {rid: (start, n) for rid, start, n, _, _ in spy.steps[-1]}
        # decode never starved: every decoding request advanced by exactly one token
        for r in dec_ids:
            assert rows[r][1] == 1, f"step {len(spy.steps)}: decode of {r} got {rows.get(r)}"
            assert _request(eng, r).num_generated == before[r] + 1
        # prefill never starved: the prompt took all of the leftover budget (or its remainder)
        assert rows[long_id] == (computed, min(budget - len(dec_ids), len(long_prompt) - computed))
        prefill_steps += 1
    assert prefill_steps == -(-300 // (budget - 4))
    assert len(spy.steps) - first == prefill_steps

    results = {rid: eng.result(rid).token_ids for rid in dec_ids + [long_id]}
    assert results[long_id] == qwen3.hf_greedy(long_prompt, 4)
    for rid, (p, m) in zip(dec_ids, decoders):
        assert results[rid] == qwen3.hf_greedy(p, m)


def _fake_step(sched: Scheduler, rows):
    """What the engine does at dispatch and after the device step, with a dummy sampled token."""
    sched.dispatched(rows)
    for row in rows:
        if row.picks_next_token:
            row.request.num_unseen_tokens -= 1
            row.request.output_ids.append(0)


def _finish_done(sched: Scheduler):
    for r in list(sched.running):
        if len(r.output_ids) >= r.params.max_tokens:
            sched.remove(r)


def test_scheduler_order_and_budget_unit():
    """Host-only: decodes first, prompt chunks from the leftover budget, FCFS admission by blocks."""
    pool = PagePool(30, 4)
    sched = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=256)

    def req(rid, n, m):
        return Request(rid, list(range(n)), greedy(m), 0, frozenset())

    a, b = req("a", 3, 10), req("b", 40, 3)
    sched.add(a)
    rows = sched.schedule()
    assert [(r.request.id, r.start, r.num_tokens) for r in rows] == [("a", 0, 3)]
    _fake_step(sched, rows)
    sched.add(b)
    rows = sched.schedule()  # a decodes (1), b gets the other 15
    assert [(r.request.id, r.start, r.num_tokens) for r in rows] == [("a", 3, 1), ("b", 0, 15)]
    _fake_step(sched, rows)
    rows = sched.schedule()
    assert [(r.request.id, r.start, r.num_tokens) for r in rows] == [("a", 4, 1), ("b", 15, 15)]
    _fake_step(sched, rows)
    # c does not fit in blocks yet (a: 13 tokens = 4 blocks, b: 43 = 11 blocks; 15 left; c needs 17)
    # and d (fits) must not overtake it.
    c, d = req("c", 60, 8), req("d", 2, 2)
    sched.add(c)
    sched.add(d)
    rows = sched.schedule()
    assert [(r.request.id, r.start, r.num_tokens) for r in rows] == [("a", 5, 1), ("b", 30, 10)]
    assert list(sched.waiting) == [c, d]
    _fake_step(sched, rows)
    steps = 0
    while sched.has_work():
        rows = sched.schedule()
        ids = [r.request.id for r in rows]
        decoding = [r for r in sched.running if r.num_tokens - r.num_computed == 1]
        assert all(r.id in ids for r in decoding), "a decoding request was skipped"
        assert sum(r.num_tokens for r in rows) <= 16 and len(rows) <= 4
        # decode rows come first, then prompt chunks
        kinds = [r.num_tokens == 1 and r.start >= len(r.request.prompt_ids) for r in rows]
        assert kinds == sorted(kinds, reverse=True)
        _fake_step(sched, rows)
        _finish_done(sched)
        pool.check_invariants()
        steps += 1
        assert steps < 100
    assert pool.num_free_blocks == 30 and len(sched.free_seq_slots) == 4


def test_host_dispatches_next_step_before_waiting_for_the_previous(engine, monkeypatch):
    """No host stalls: step N+1 is on the device queue before step N's tokens are fetched.

    Decode rows of step N+1 feed step N's sampled tokens from device memory (token id -1),
    so the tokens must still equal a lockstep run (the batch-invariance tests check that too).
    """
    import jax

    log = []
    monkeypatch.setattr(engine, "step_done", lambda result: False)  # a device slower than the host
    inner_dispatch = engine.runner.dispatch
    monkeypatch.setattr(engine.runner, "dispatch", lambda *a, **k: (log.append("dispatch"), inner_dispatch(*a, **k))[1])
    real_get = jax.device_get
    monkeypatch.setattr(jax, "device_get", lambda x: (log.append("wait"), real_get(x))[1])
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)  # 7 steps of up to 4 decode steps
    overlapped = engine.generate(prompts, params)
    # Every wait but the last (the drain) comes after the next step was dispatched.
    waits = [i for i, e in enumerate(log) if e == "wait"]
    assert len(waits) >= 6
    for w in waits[:-1]:
        assert log[:w].count("dispatch") >= log[:w].count("wait") + 2, log
    monkeypatch.undo()
    solo = [engine.generate([p], params)[0].token_ids for p in prompts]
    assert [c.token_ids for c in overlapped] == solo


def test_finished_step_is_processed_before_the_next_is_built(engine, monkeypatch):
    """A host-bound engine (step N already done when step N+1 is built) hands out step N's tokens
    first: a first token is not held back by a whole host step. Same tokens either way."""
    import jax

    log = []
    monkeypatch.setattr(engine, "step_done", lambda result: True)
    inner_dispatch = engine.runner.dispatch
    monkeypatch.setattr(engine.runner, "dispatch", lambda *a, **k: (log.append("dispatch"), inner_dispatch(*a, **k))[1])
    real_get = jax.device_get
    monkeypatch.setattr(jax, "device_get", lambda x: (log.append("wait"), real_get(x))[1])
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    rid = engine.submit([1, 2, 3, 4], params)
    assert engine.step() == [] and log == ["dispatch"]
    events = engine.step()
    assert log == ["dispatch", "wait", "dispatch"] and events[0].token_ids, "processed before the next dispatch"
    tokens = [t for e in engine.stream(rid) for t in e.token_ids]  # (the stream has that event too)
    monkeypatch.undo()
    assert tokens == engine.generate([[1, 2, 3, 4]], params)[0].token_ids
