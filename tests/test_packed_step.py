"""PackedStep: a step packed into two buffers, and the framed bytes the leader sends its followers."""
import subprocess
import sys

import jax
import numpy as np
import pytest

from jtp.core.sampling_params import SamplingParams, pack_logit_bias, pack_penalty_tokens, pack_sampling
from jtp.core.packed_step import PackedStep
from jtp.core.step_input import StepInput
from jtp.worker.input_batch import InputBatch


def engine_step_input(engine, prompts, params):
    """The StepInput the engine's real scheduler builds for the first step of these prompts."""
    for p in prompts:
        engine.submit(p, params)
    engine.apply_inbox()
    rows = engine.scheduler.schedule()
    sched = engine.scheduler
    batch = InputBatch(sched.max_num_seqs, engine.max_model_len, engine.pool.block_size, sched.buckets)
    plan = batch.prepare(sched.output(rows)).to_step_input().plan
    B = len(plan.context_lens)
    sampling = pack_sampling([params] * len(rows), B, [r.request.seed for r in rows], [0] * len(rows))
    penalty = pack_penalty_tokens([r.request.prompt_ids for r in rows], [[] for _ in rows], B)
    return StepInput(plan, sampling, penalty, logit_bias=pack_logit_bias([params] * len(rows), B)), rows


def assert_same(a: StepInput, b: StepInput):
    for x, y in zip(jax.tree.leaves((a.plan.__dict__, a.sampling, a.penalty_tokens, a.logit_bias)),
                    jax.tree.leaves((b.plan.__dict__, b.sampling, b.penalty_tokens, b.logit_bias))):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        np.testing.assert_array_equal(x, y)
    assert a.plan.max_row_len == b.plan.max_row_len


@pytest.fixture(scope="module")
def engine():
    from jtp.config.engine_args import EngineArgs
    from jtp.demo import ensure_demo_checkpoint
    from jtp.engine.engine import Engine

    return Engine.from_args(EngineArgs(
        model=ensure_demo_checkpoint(), dtype="float32", num_blocks=64, block_size=4, max_num_seqs=4,
        max_num_batched_tokens=32, max_model_len=64, skip_tokenizer_init=True))


def test_round_trip_and_the_decoded_step_runs_the_same(engine):
    params = SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9, repetition_penalty=1.2, seed=3,
                            logit_bias={"7": 2.5, 11: -100})
    step, _ = engine_step_input(engine, [[1, 2, 3, 4, 5], [9, 8, 7]], params)
    assert step.logit_bias[0][0, :3].tolist() == [7, 11, -1] and step.logit_bias[1][1, :3].tolist() == [2.5, -100, 0]
    packed = PackedStep.from_step_input(step)
    data = packed.encode()
    assert isinstance(data, bytes) and data[:4] == PackedStep.MAGIC
    decoded = PackedStep.decode(data)
    assert decoded.layout == packed.layout
    assert_same(step, decoded.to_step_input())
    # The runner consumes the decoded copy exactly like the original: same sampled tokens.
    cache_before = jax.tree.map(np.asarray, engine.runner.cache)
    first = jax.device_get(engine.runner.dispatch(step))
    engine.runner.cache = jax.tree.map(jax.numpy.asarray, cache_before)
    second = jax.device_get(engine.runner.dispatch(decoded))
    np.testing.assert_array_equal(first.tokens, second.tokens)


def test_without_penalties_and_bad_messages(engine):
    step, _ = engine_step_input(engine, [[4, 4, 4]], SamplingParams(max_tokens=2))
    step = StepInput(step.plan, step.sampling)
    data = PackedStep.from_step_input(step).encode()
    assert PackedStep.decode(data).to_step_input().penalty_tokens is None
    assert PackedStep.decode(data).to_step_input().logit_bias is None
    with pytest.raises(ValueError, match="penalty_tokens"):  # a bias rides the penalised variant
        PackedStep.from_step_input(StepInput(step.plan, step.sampling, logit_bias=pack_logit_bias([None], 1)))
    with pytest.raises(ValueError, match="magic"):
        PackedStep.decode(b"XXXX" + data[4:])
    with pytest.raises(ValueError, match="its layout needs"):
        PackedStep.decode(data[:-4])
    with pytest.raises(ValueError, match="its layout needs"):
        PackedStep.decode(data + b"\0")


def test_imports_numpy_only():
    code = "import sys, jtp.core.packed_step; sys.exit('jax' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0, "jtp.core.packed_step imported jax"


@pytest.mark.parametrize("verify, penalty_len", [(0, 0), (0, 256), (4, 1024)])
def test_the_sampling_part_is_the_int_buffers_tail_and_the_forward_part_its_head(verify, penalty_len):
    """The runner's two programs read one buffer: the forward program its head (everything but the
    penalty history), the sampling program its tail from seq_slots on. Both must see the fields the
    whole layout puts there."""
    from jtp.core.packed_step import NO_FLAGS, StepLayout
    from jtp.core.step_input import SamplingFlags

    flags = SamplingFlags(True, bool(penalty_len), 20)
    layout = StepLayout(64, 8, 16, 16, verify, penalty_len, flags)
    _, _, n_int, n_float = layout.offsets()
    ints, floats = np.arange(n_int, dtype=np.int32), np.arange(n_float, dtype=np.float32)
    whole = layout.views(ints, floats)
    tail = layout.sampling.views(ints[layout.sampling_start():], floats)
    assert set(tail) == {"seq_slots", "top_k", "seed", "step", "logprobs", "stop_ids", "num_steps", "temperature",
                         "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"} | (
                            {"penalty_ids", "penalty_is_output", "logit_bias_ids", "logit_bias"}
                            if penalty_len else set())
    for name, view in tail.items():
        np.testing.assert_array_equal(view, whole[name], err_msg=name)
    forward = layout.forward
    assert forward.flags == NO_FLAGS and forward.penalty_len == 0
    head = forward.views(ints[: forward.offsets()[2]])
    assert set(head) == set(whole) - {"penalty_ids", "penalty_is_output", "logit_bias_ids"} - set(layout.offsets()[1])
    for name, view in head.items():
        np.testing.assert_array_equal(view, whole[name], err_msg=name)
