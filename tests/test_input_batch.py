"""The persistent input batch lays each step out exactly as the per-row construction it replaced.

A real Scheduler runs randomized workloads (chunked prefills, decodes, multi-step decodes,
n-gram drafts, prefix-cache hits, hybrid state slots, penalties, logprobs, aborts) against a
simulated device that samples random tokens, with the engine's overlap (a step's tokens are
seen by the host one step late). Every step, the `PackedStep` the InputBatch builds from the
`SchedulerOutput` must unpack to the arrays a plain-Python construction from the `Request`s
gives (`reference_step` below: the row-by-row logic of the old `Scheduler.build_plan`,
`pack_sampling`, `pack_penalty_tokens`, `pack_logit_bias` and `pack_stop_ids`).
"""
from __future__ import annotations

import random

import numpy as np
import pytest

from jtp.config.speculative import SpeculativeConfig
from jtp.core.block_hash import root_key
from jtp.core.packed_step import PackedStep
from jtp.core.page_pool import PagePool
from jtp.core.sampling_params import SamplingParams, pack_logit_bias, pack_penalty_tokens, pack_sampling
from jtp.core.scheduler import Request, Scheduler, Status
from jtp.core.state_pool import StatePool
from jtp.core.step_input import STOP_IDS_WIDTH, StepInput, StepPlan
from jtp.worker.input_batch import InputBatch

BLOCK = 4
MAX_LEN = 96


def reference_plan(sched: Scheduler, rows) -> StepPlan:
    """Row by row, from the requests and the pool: the layout the input batch must reproduce."""
    total = sum(r.num_tokens for r in rows)
    T, B, max_row_len = sched.buckets.step_shape(total, len(rows), max(r.num_tokens for r in rows))
    tables = [sched.pool.block_table(r.request.id) for r in rows]
    plan = StepPlan.padding(T, B, max_row_len, sched.buckets.table_width)
    plan.row_starts[:] = total
    plan.num_steps = rows[0].steps
    verify = any(r.drafts for r in rows)
    if verify:
        plan.logits_indices = np.zeros((sched.speculative.verify_positions, B), np.int32)
    cursor = 0
    for b, (row, table) in enumerate(zip(rows, tables)):
        req, end = row.request, row.start + row.num_tokens
        for i, p in enumerate(range(row.start, end)):
            t = cursor + i
            draft = p - (end - len(row.drafts))
            plan.token_ids[t] = row.drafts[draft] if draft >= 0 else req.token(p)
            plan.positions[t] = p
            plan.slot_mapping[t] = table[p // BLOCK] * BLOCK + p % BLOCK
            plan.token_rows[t] = b
        plan.block_tables[b, : len(table)] = table
        plan.context_lens[b] = end
        plan.row_starts[b], plan.row_lens[b], plan.seq_slots[b] = cursor, row.num_tokens, req.seq_slot
        plan.state_reads[b], plan.state_writes[b], plan.state_keeps[b] = row.state_read, row.state_write, row.state_keep
        last = cursor + row.num_tokens - 1
        if verify:
            for j in range(len(plan.logits_indices)):
                plan.logits_indices[j, b] = min(last - len(row.drafts) + j, last)
        else:
            plan.logits_indices[b] = last
        cursor += row.num_tokens
    return plan


def reference_step(sched: Scheduler, rows) -> StepInput:
    plan = reference_plan(sched, rows)
    B = len(plan.context_lens)
    params = [r.request.params if r.picks_next_token else None for r in rows]
    sampling = pack_sampling(params, B, [r.request.seed for r in rows], [r.request.num_generated for r in rows])
    penalty = logit_bias = None
    if any(p is not None and p.has_penalties for p in params):  # a logit bias too
        reqs = [r.request if r.picks_next_token else None for r in rows]
        penalty = pack_penalty_tokens([q.prompt_ids if q else None for q in reqs],
                                      [q.output_ids if q else None for q in reqs], B, sched.max_model_len)
        logit_bias = pack_logit_bias(params, B)
    stop_ids = np.full((B, STOP_IDS_WIDTH), -1, np.int32)
    for b, row in enumerate(rows):
        ids = sorted(row.request.stop_ids)[:STOP_IDS_WIDTH]
        stop_ids[b, : len(ids)] = ids
    return StepInput(plan, sampling, penalty, stop_ids, logit_bias=logit_bias)


def assert_same(got: StepInput, want: StepInput, where: str):
    for name in StepPlan.__dataclass_fields__:
        a, b = getattr(got.plan, name), getattr(want.plan, name)
        if isinstance(b, np.ndarray):
            np.testing.assert_array_equal(a, b, err_msg=f"{where}: plan.{name}")
        else:
            assert a == b, f"{where}: plan.{name} {a} != {b}"
    for name in want.sampling._fields:
        a, b = getattr(got.sampling, name), getattr(want.sampling, name)
        assert a.dtype == b.dtype, f"{where}: sampling.{name} dtype"
        np.testing.assert_array_equal(a, b, err_msg=f"{where}: sampling.{name}")
    assert (got.penalty_tokens is None) == (want.penalty_tokens is None), where
    if want.penalty_tokens is not None:
        for a, b in zip(got.penalty_tokens + got.logit_bias, want.penalty_tokens + want.logit_bias, strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"{where}: penalty")
    np.testing.assert_array_equal(got.stop_ids, want.stop_ids, err_msg=f"{where}: stop ids")


def random_params(rng: random.Random, penalties: bool) -> SamplingParams:
    kind = rng.randrange(6 if penalties else 4)
    max_tokens = rng.randint(1, 20)
    if kind == 5:  # a logit bias: the penalised variant, neutral penalties; min_tokens caps multi-step decodes
        bias = {t: rng.uniform(-100, 100) for t in rng.sample(range(60), rng.randint(1, 8))}
        return SamplingParams(max_tokens=max_tokens, temperature=0.5, logit_bias=bias,
                              min_tokens=rng.randint(0, max_tokens))
    if kind == 0:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0)
    if kind == 1:
        return SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.9, seed=rng.randrange(2**40))
    if kind == 2:
        return SamplingParams(max_tokens=max_tokens, temperature=1.0, top_k=5, min_p=0.1, logprobs=rng.choice([0, 3]))
    if kind == 3:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=rng.sample(range(2, 40), 6),
                              ignore_eos=True)
    return SamplingParams(max_tokens=max_tokens, temperature=0.7, repetition_penalty=1.2, frequency_penalty=0.3)


def run_workload(seed: int, hybrid: bool, speculative: bool, steps: int, penalties: bool):
    rng = random.Random(seed)
    pool = PagePool(400, BLOCK)
    states = StatePool(40) if hybrid else None
    spec = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3}) if speculative else None
    sched = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=MAX_LEN, states=states,
                      cache_root=root_key("test"), num_scheduler_steps=1 if speculative else 3, speculative=spec)
    batch = InputBatch(8, MAX_LEN, BLOCK, sched.buckets, spec.verify_positions if spec else 0)
    shared = [rng.randrange(2, 50) for _ in range(3 * BLOCK)]  # prefixes the cache can hit
    live: list[Request] = []
    inflight = None
    checked = 0

    def process(rows, sampled):
        for row in rows:
            req = row.request
            if not row.picks_next_token:
                continue
            if row.drafts:  # accept a random number of drafts, as a verify step does
                accepted = rng.randint(0, len(row.drafts))
                sched.accepted(row, accepted)
                req.num_unseen_tokens -= 1
                new = list(row.drafts[:accepted]) + [sampled()]
            else:
                req.num_unseen_tokens -= row.steps
                new = [sampled() for _ in range(row.steps)]
            for token in new:
                if req.status is not Status.RUNNING:
                    break
                req.output_ids.append(token)
                if token in req.stop_ids or len(req.output_ids) >= req.params.max_tokens:
                    sched.remove(req)

    for step in range(steps):
        for _ in range(rng.choice([0, 0, 1, 2])):
            n = rng.randint(1, 40)
            prompt = (shared[: rng.choice([0, BLOCK, 2 * BLOCK, 3 * BLOCK])] + [rng.randrange(2, 50) for _ in range(n)])
            params = random_params(rng, penalties)
            if len(prompt) + params.max_tokens > MAX_LEN:
                continue
            req = Request(f"r{step}-{len(live)}", prompt, params, seed=rng.randrange(2**40),
                          stop_ids=frozenset(params.stop_token_ids) | ({1} if not params.ignore_eos else set()))
            live.append(req)
            sched.add(req)
        if rng.random() < 0.05 and sched.running:  # an abort
            sched.remove(rng.choice(sched.running))
        # Lockstep (the engine's rule for drafts and penalties), else the engine's overlap.
        lockstep = speculative or any(r.params.has_penalties for r in sched.running)
        if inflight is not None and lockstep:
            process(*inflight)
            inflight = None
        rows = sched.schedule()
        if rows:
            want = reference_step(sched, rows)
            got = batch.prepare(sched.output(rows)).to_step_input()
            assert_same(got, want, f"seed {seed} step {step}")
            checked += 1
            sched.dispatched(rows)
        if inflight is not None:
            process(*inflight)
        inflight = (rows, lambda: rng.randrange(1, 60)) if rows else None
    return checked


@pytest.mark.parametrize("hybrid", [False, True])
@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_input_batch_matches_row_by_row_layout(seed, hybrid, speculative):
    assert run_workload(seed, hybrid, speculative, steps=150, penalties=not speculative) > 100


def test_packed_step_round_trips_and_refuses_bad_bytes():
    rng = random.Random(3)
    pool = PagePool(64, BLOCK)
    sched = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=MAX_LEN)
    for i in range(3):
        params = SamplingParams(max_tokens=4, temperature=0.5, repetition_penalty=1.1, logprobs=2)
        sched.add(Request(f"q{i}", [rng.randrange(50) for _ in range(7)], params, seed=2**33 + i, stop_ids=frozenset({1})))
    rows = sched.schedule()
    packed = InputBatch(4, MAX_LEN, BLOCK, sched.buckets).prepare(sched.output(rows))
    data = packed.encode()
    again = PackedStep.decode(data)
    assert again.layout == packed.layout
    np.testing.assert_array_equal(again.ints, packed.ints)
    np.testing.assert_array_equal(again.floats, packed.floats)
    # The explicit StepInput packs to the very same buffers.
    repacked = PackedStep.from_step_input(packed.to_step_input())
    assert repacked.layout == packed.layout
    np.testing.assert_array_equal(repacked.ints, packed.ints)
    np.testing.assert_array_equal(repacked.floats, packed.floats)
    for bad in (b"XXXX" + data[4:], data[:-4], data + b"\0"):
        with pytest.raises(ValueError):
            PackedStep.decode(bad)
