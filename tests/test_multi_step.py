"""Multi-step decode (`--num-scheduler-steps`): a pure decode step runs several decode steps in one
dispatch, on the device. Whatever the number of steps per dispatch, every request must get exactly
the tokens, logprobs and finish reasons of one step per dispatch (the reference here), at any tensor
parallelism, on dense and hybrid models, with prefix caching and its state checkpoints.
"""

import random

import jax
import numpy as np
import pytest
from test_engine import run_staggered

from jtp.config.engine_args import EngineArgs
from jtp.core.sampling_params import SamplingParams
from jtp.engine.engine import Engine

KW = dict(dtype="float32", skip_tokenizer_init=True, num_blocks=128, block_size=4, max_num_seqs=8,
          max_num_batched_tokens=32, max_model_len=96)


class StepSpy:
    """Records each dispatched plan's decode steps, and the results of the dispatch."""

    def __init__(self, engine: Engine):
        self.steps: list[int] = []
        self.results: list = []
        inner = engine.runner.dispatch

        def dispatch(step_input):
            result = inner(step_input)
            self.steps.append(step_input.num_steps)
            self.results.append(result)
            return result

        engine.runner.dispatch = dispatch


def workload(seed: int, vocab: int):
    """Mixed requests: greedy, seeded sampling with truncation, logprobs, a stop token, lengths 1..14."""
    rng = random.Random(seed)
    prompts, params = [], []
    for i in range(10):
        prompts.append([rng.randrange(vocab) for _ in range(rng.randint(2, 30))])
        kind = i % 4
        if kind == 0:
            p = SamplingParams(max_tokens=rng.randint(1, 14), temperature=0, ignore_eos=True)
        elif kind == 1:
            p = SamplingParams(max_tokens=rng.randint(5, 14), temperature=0.9, top_p=0.8, seed=100 + i, ignore_eos=True)
        elif kind == 2:
            p = SamplingParams(max_tokens=rng.randint(5, 14), temperature=0.7, seed=200 + i, logprobs=2, ignore_eos=True)
        else:  # stops on some token it is likely to sample: a frequent one under random weights
            p = SamplingParams(max_tokens=14, temperature=1.0, seed=300 + i, stop_token_ids=list(range(0, vocab, 3)),
                               ignore_eos=True)
        params.append(p)
    return prompts, params


def outputs(completions):
    return [(c.token_ids, c.finish_reason, c.logprobs, c.top_logprobs) for c in completions]


def assert_same_outputs(got, expected):
    """Tokens and finish reasons exactly; logprobs to float32 rounding (rows batch differently, tp reduces in another order)."""
    assert [(t, r) for t, r, _, _ in got] == [(t, r) for t, r, _, _ in expected]
    for (_, _, lp, top), (_, _, lp_ref, top_ref) in zip(got, expected):
        assert (lp is None) == (lp_ref is None)
        if lp is not None:
            np.testing.assert_allclose(lp, lp_ref, rtol=1e-5, atol=1e-4)
            assert [list(t) for t in top] == [list(t) for t in top_ref]
            np.testing.assert_allclose([list(t.values()) for t in top], [list(t.values()) for t in top_ref], rtol=1e-5, atol=1e-4)


@pytest.fixture(scope="module")
def dense_path():
    from jtp.demo import ensure_demo_checkpoint

    return ensure_demo_checkpoint()


@pytest.mark.parametrize("tp", [1, 2])
def test_dense_multi_step_equals_one_step_per_dispatch(dense_path, tp):
    reference = Engine.from_args(EngineArgs(model=dense_path, **KW, num_scheduler_steps=1))
    prompts, params = workload(seed=1, vocab=reference.cfg.vocab_size)
    expected = outputs(run_staggered(reference, prompts, params))
    assert any(reason == "stop" for _, reason, _, _ in expected), "the workload exercises stop tokens"

    engine = Engine.from_args(EngineArgs(model=dense_path, tensor_parallel_size=tp, **KW, num_scheduler_steps=4))
    spy = StepSpy(engine)
    assert_same_outputs(outputs(run_staggered(engine, prompts, params)), expected)
    assert max(spy.steps) == 4 and 1 in spy.steps, spy.steps
    assert engine.pool.num_free_blocks == engine.pool.total_blocks
    # Fewer dispatches than tokens: the point of it.
    assert len(spy.steps) < sum(len(tokens) for tokens, *_ in expected)


def test_decode_loop_stops_early_once_every_row_has_stopped(dense_path):
    engine = Engine.from_args(EngineArgs(model=dense_path, **KW, num_scheduler_steps=8))
    prompt = [5, 6, 7, 8]
    free_run = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].token_ids
    stop = free_run[2]  # the third decode token; stop there
    first = free_run.index(stop)
    spy = StepSpy(engine)
    (c,) = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[stop]))
    assert c.token_ids == free_run[: first + 1] and c.finish_reason == "stop"
    # The dispatch that sampled the stop token ran no step after it: its later entries were never
    # written (zero logprob; a sampled token's logprob is negative).
    steps = [i for i, n in enumerate(spy.steps) if n > 1]
    logprobs = np.asarray(jax.device_get(spy.results[steps[0]]).logprob)[:, 0]
    ran = int(np.sum(logprobs != 0))
    assert ran < spy.steps[steps[0]] and np.all(logprobs[ran:] == 0)


def test_penalties_run_one_step_per_dispatch(dense_path):
    engine = Engine.from_args(EngineArgs(model=dense_path, **KW, num_scheduler_steps=4))
    spy = StepSpy(engine)
    params = SamplingParams(max_tokens=8, temperature=0, repetition_penalty=1.3, ignore_eos=True)
    (c,) = engine.generate([[3, 3, 3, 4]], params)
    assert spy.steps == [1] * len(spy.steps) and len(spy.steps) >= 8
    reference = Engine.from_args(EngineArgs(model=dense_path, **KW, num_scheduler_steps=1))
    assert c.token_ids == reference.generate([[3, 3, 3, 4]], params)[0].token_ids


@pytest.fixture(scope="module")
def hybrid_path(shallow_hybrid_hk4_dir):
    return shallow_hybrid_hk4_dir


def run_with_follow_ups(engine):
    """The staggered workload, then a follow-up turn of four of its conversations: (outputs,
    follow-up tokens, prefix-cache hits of the follow-ups)."""
    prompts, params = workload(seed=2, vocab=128)
    out = outputs(run_staggered(engine, prompts, params))
    follow = [p + out[i][0] + [1, 2] for i, p in enumerate(prompts[:4])]
    hits = engine.scheduler.prefix_hits
    again = engine.generate(follow, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    return out, [c.token_ids for c in again], engine.scheduler.prefix_hits - hits


@pytest.fixture(scope="module")
def hybrid_one_step_per_dispatch(hybrid_path):
    with Engine.from_args(EngineArgs(model=hybrid_path, **KW, num_scheduler_steps=1)) as engine:
        return run_with_follow_ups(engine)


@pytest.mark.parametrize("tp", [1, 2])
def test_hybrid_multi_step_equals_one_step_per_dispatch_with_checkpoints(hybrid_path, hybrid_one_step_per_dispatch, tp):
    """DeltaNet state advances in place across the loop's steps; with prefix caching a dispatch
    stops at each block boundary so decode checkpoints are taken where one step per dispatch takes
    them: a follow-up turn that resends prompt + answer finds as many cached tokens."""
    expected = hybrid_one_step_per_dispatch
    assert expected[2] > 0, "follow-ups hit decode checkpoints"
    engine = Engine.from_args(EngineArgs(model=hybrid_path, tensor_parallel_size=tp, **KW, num_scheduler_steps=4))
    spy = StepSpy(engine)
    got = run_with_follow_ups(engine)
    assert_same_outputs(got[0], expected[0])
    assert got[1:] == expected[1:]
    assert max(spy.steps) > 1
    assert engine.states.available() == engine.states.num_slots, "a state slot leaked"
