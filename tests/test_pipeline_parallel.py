"""Issue 30, second part: --pipeline-parallel-size P, the layers in P stages on disjoint devices
(jtp/worker/pipeline.py), and the engine's steps of disjoint requests, one per stage in flight.

- A staggered greedy batch gives the tokens of one engine at tp=1 with PP=2, PP=2 x TP=2 and
  DP=2 x PP=2, on the demo checkpoint, a tiny Qwen3 MoE and a tiny hybrid (DeltaNet and attention
  layers in different stages).
- The steps in flight hold disjoint requests, each about half of them, and two are in flight at
  once; each stage holds only its own layers' weights and cache.
- Served: an openai-client chat, streamed and not, equals the engine's own greedy tokens; /stats
  and /metrics count each stage's steps (as many as the engine dispatched).
- Snapshots saved and loaded through a pipeline continue like one engine's, and load into one.
- Bad settings are one-line errors.
"""

from __future__ import annotations

import functools
import time

import httpx
import pytest
from loopback import CHAT, chat_whole_and_streamed, serving_engine
from prometheus_client.parser import text_string_to_metric_families
from staggered import ENGINE_ARGS, run_staggered, snapshot_roundtrip

from jtp.config.engine_args import EngineArgs
from jtp.core.sampling_params import SamplingParams
from jtp.engine.data_parallel import build_engine
from jtp.engine.engine import Engine
from jtp.errors import ConfigError
from jtp.worker.pipeline import PipelineRunner, StageClock, stage_layers


def staggered_tokens(args: EngineArgs) -> list[list[int]]:
    with build_engine(args) as engine:
        return run_staggered(engine, engine.cfg.vocab_size)


def base_args(model: str) -> dict:
    return dict(ENGINE_ARGS, model=model, skip_tokenizer_init=True, dtype="float32")


@functools.cache  # the one-engine reference, shared by the tests of one model
def one_engine_tokens(model: str) -> list[list[int]]:
    return staggered_tokens(EngineArgs(**base_args(model)))


def test_stages_give_the_tokens_of_one_engine(staggered_model, demo_dir):
    base = base_args(staggered_model)
    expected = one_engine_tokens(staggered_model)
    splits = [dict(pipeline_parallel_size=2), dict(pipeline_parallel_size=2, tensor_parallel_size=2)]
    if staggered_model == str(demo_dir):
        splits.append(dict(pipeline_parallel_size=2, data_parallel_size=2))
        with build_engine(EngineArgs(**base, pipeline_parallel_size=2, data_parallel_size=2)) as engine:
            # What a failed replica is rebuilt on: all its stages' devices, none shared between replicas.
            assert [len(d) for d in engine.devices] == [2, 2] and len({d.id for ds in engine.devices for d in ds}) == 4
    for split in splits:
        assert staggered_tokens(EngineArgs(**base, **split)) == expected, split


@pytest.mark.parametrize("stages", [2, 3])
def test_after_warm_up_a_pipeline_compiles_nothing(stages, demo_dir, request):
    """Warm-up lowers every stage's program, hand-off and sampling program ahead (two stages' equal
    code stays two executables: 3 stages of the 4-layer hybrid); a staggered batch afterwards
    compiles nothing (JAX's own compile log, which sees every jit) and gives one engine's tokens."""
    import logging

    import jax

    model = str(demo_dir) if stages == 2 else str(request.getfixturevalue("hybrid_hk4")[1])
    base = base_args(model)
    expected = one_engine_tokens(model)
    compiled: list[str] = []

    class Compiles(logging.Handler):
        def emit(self, record):
            if "Finished XLA compilation" in record.getMessage():
                compiled.append(record.getMessage())

    with Engine.from_args(EngineArgs(**{**base, "warmup": True}, pipeline_parallel_size=stages)) as engine:
        assert engine.warmup() > 0
        handler, logger = Compiles(), logging.getLogger("jax")
        logger.addHandler(handler)
        try:
            with jax.log_compiles(True):
                tokens = run_staggered(engine, engine.cfg.vocab_size)
        finally:
            logger.removeHandler(handler)
    assert tokens == expected and compiled == []


def test_stage_layers_balance_parameter_counts_like_a_brute_force_search():
    import itertools
    import random

    assert stage_layers([1] * 28, 4) == [range(0, 7), range(7, 14), range(14, 21), range(21, 28)]
    assert stage_layers([1] * 36, 2, head_cost=3.3) == [range(0, 20), range(20, 36)]  # the LM head weighs 3.3 layers
    rng = random.Random(0)
    for _ in range(200):
        costs = [rng.randint(1, 9) for _ in range(rng.randint(2, 9))]
        stages, head = rng.randint(1, min(4, len(costs))), rng.choice([0, 3, 12])

        def worst(bounds):
            return max(sum(costs[a:b]) + (head if b == len(costs) else 0) for a, b in zip(bounds, bounds[1:]))

        best = min(worst((0, *cuts, len(costs))) for cuts in itertools.combinations(range(1, len(costs)), stages - 1))
        got = stage_layers(costs, stages, head)
        assert [r.start for r in got] == [0, *(r.stop for r in got[:-1])] and got[-1].stop == len(costs)
        assert all(len(r) for r in got) and worst((0, *(r.stop for r in got))) == best, (costs, stages, head)
    with pytest.raises(ConfigError, match="only 2 layers"):
        stage_layers([1, 1], 3)


def test_stage_clock_counts_busy_time_and_bubbles_of_a_hand_drawn_timeline():
    """Two stages, two steps: step 0 dispatched at 0 (stage 0 ends at 1; stage 1's input is ready at
    1, it ends at 2), step 1 at 0.5 (stage 0 waits for itself until 1 and ends at 2; stage 1's input
    is ready at 2, it ends at 3). Each stage is busy 2 of the 3 active seconds: stage 1 idle in
    [0, 1], stage 0 in [2, 3]. Across processes the bubble is unknown."""
    clock = StageClock([True, True])
    try:
        for stage, dispatched, input_at, end in [(0, 0.0, 0.0, 1.0), (1, 0.0, 1.0, 2.0), (0, 0.5, 0.5, 2.0),
                                                 (1, 0.5, 2.0, 3.0)]:
            clock._done(stage, dispatched, input_at, end)
        for stage in (0, 1):
            stats = clock.stats(stage)
            assert stats["steps"] == 2 and stats["busy_seconds"] == 2.0 and stats["active_seconds"] == 3.0
            assert stats["mean_step_ms"] == 1000.0 and stats["bubble_fraction"] == round(1 - 2 / 3, 4)
    finally:
        clock.close()
    remote = StageClock([False, True])  # the leader of a two-process pipeline: the last stage
    try:
        remote._done(1, 0.0, 1.0, 2.0)
        assert remote.stats(1)["busy_seconds"] == 1.0 and remote.stats(1)["bubble_fraction"] is None
    finally:
        remote.close()


PIPE_ARGS = dict(max_num_seqs=8, max_num_batched_tokens=64, block_size=8, num_blocks=64, max_model_len=128,
                 warmup=False, skip_tokenizer_init=True, pipeline_parallel_size=2)


@pytest.fixture(scope="module")
def pipe_engine(demo_dir):
    with Engine.from_args(EngineArgs(model=str(demo_dir), **PIPE_ARGS)) as engine:
        yield engine


def test_steps_in_flight_hold_disjoint_requests_one_per_stage(pipe_engine, demo_dir):
    engine = pipe_engine
    runner = engine.runner
    assert isinstance(runner, PipelineRunner) and runner.pipeline_depth == 2
    # Each stage holds its own layers' weights and cache entries, on its own devices.
    (first, last) = runner.stages
    assert [bool(layer) for layer in first.params["layers"]] == [i in first.layer_ids for i in range(engine.cfg.num_layers)]
    assert "embed" in first.params and "final_norm" not in first.params and "final_norm" in last.params
    assert not {d.id for d in first.mesh.devices.flat} & {d.id for d in last.mesh.devices.flat}
    for stage in runner.stages:
        for entry in runner.cache[stage.layer_ids.start:stage.layer_ids.stop]:
            assert entry.k.sharding.mesh.devices.flat[0] == stage.mesh.devices.flat[0]

    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = [[3 + i, 9, 27, 81 % 97, i] for i in range(6)]
    rids = [engine.submit(p, greedy) for p in prompts]
    steps_before = runner.clock.stats(0)["steps"]
    most_in_flight = 0
    while engine.has_unfinished():
        engine.step()
        in_flight = [[row.request.id for row in rows] for rows, _ in engine._inflight]
        flat = [rid for rows in in_flight for rid in rows]
        assert len(flat) == len(set(flat)), f"a request in two steps in flight: {in_flight}"
        assert all(len(rows) <= 3 for rows in in_flight), in_flight  # half of the six requests
        most_in_flight = max(most_in_flight, len(in_flight))
    results = [engine.result(rid).token_ids for rid in rids]
    assert most_in_flight == 2

    # The same prompts one at a time (nothing to pipeline) give the same tokens.
    for prompt, tokens in zip(prompts, results):
        assert engine.generate([prompt], greedy)[0].token_ids == tokens
    # Both stages ran every step the engine dispatched.
    stats, deadline = runner.stage_stats(), time.monotonic() + 10
    while stats[0]["steps"] != stats[1]["steps"] and time.monotonic() < deadline:  # the watchers catch up
        time.sleep(0.01)
        stats = runner.stage_stats()
    assert stats[0]["steps"] == stats[1]["steps"] > steps_before


@pytest.mark.parametrize("kind", ["qwen3", "hybrid"])
def test_snapshots_of_a_pipeline_continue_like_one_engine_and_load_into_one(kind, demo_dir, request, tmp_path):
    """Save / load through a pipeline (pages and, for the hybrid, state slots gathered and scattered
    stage by stage): the continuation is one engine's; and the pipeline's files load into an engine
    without stages (the layers keep their global names) with the same continuation."""
    model = str(demo_dir) if kind == "qwen3" else str(request.getfixturevalue("hybrid_hk4")[1])
    args = dict(ENGINE_ARGS, model=model, skip_tokenizer_init=True, dtype="float32", enable_prefix_caching=True)
    with Engine.from_args(EngineArgs(**args)) as engine:
        solo = snapshot_roundtrip(engine, str(tmp_path / "solo"))
    with Engine.from_args(EngineArgs(**args, pipeline_parallel_size=2)) as engine:
        assert snapshot_roundtrip(engine, str(tmp_path / "pipe")) == solo and solo["hits"] > 0
    with Engine.from_args(EngineArgs(**args)) as engine:
        (loaded,) = engine.load_snapshots(str(tmp_path / "pipe"))
        greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        assert engine.result(engine.restore(loaded, [3, 1, 4, 1, 5], greedy)).token_ids == solo["follow"]
        assert engine.stats().prefix_cache_hits > 0


def test_bad_settings_are_one_line_errors(demo_dir):
    with pytest.raises(ConfigError, match=r"--pipeline-parallel-size 4 x --tensor-parallel-size 4 needs 16 devices"):
        Engine.from_args(EngineArgs(model=str(demo_dir), pipeline_parallel_size=4, tensor_parallel_size=4))
    with pytest.raises(ConfigError, match="only 2 layers"):
        Engine.from_args(EngineArgs(model=str(demo_dir), pipeline_parallel_size=3, num_blocks=16))
    for bad, why in ((dict(num_processes=3), "must divide --tensor-parallel-size x --pipeline-parallel-size"), (dict(num_scheduler_steps=4), "--num-scheduler-steps"),
                     (dict(pipeline_parallel_size=0), "at least 1")):
        with pytest.raises(ConfigError, match=why):
            EngineArgs(model=str(demo_dir), **{"pipeline_parallel_size": 2, **bad}).validate()


def test_served_chat_stream_and_stage_stats(demo_dir):
    args = EngineArgs(model=str(demo_dir), pipeline_parallel_size=2, max_num_seqs=4, max_num_batched_tokens=32,
                      max_model_len=128, block_size=8, num_blocks=64, warmup=False)
    with serving_engine(args) as (engine, url, client):
        whole = chat_whole_and_streamed(client, args.model_name(), logprobs=True)
        # The engine's own greedy tokens for the same prompt.
        prompt = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True))
        own = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))[0]
        assert engine.tokenizer.decode(own.token_ids) == whole.choices[0].message.content
        stats = httpx.get(f"{url}/stats").json()
        text = httpx.get(f"{url}/metrics").text
    stages = stats["stages"]
    assert [s["stage"] for s in stages] == [0, 1] and [s["layers"] for s in stages] == [[0, 1], [1, 2]]
    assert all(s["steps"] > 0 and s["mean_step_ms"] > 0 for s in stages)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    steps = {s.labels["stage"]: s.value for s in families["jtp:pipeline_stage_steps"].samples
             if s.name.endswith("_total")}
    assert set(steps) == {"0", "1"} and all(v > 0 for v in steps.values())
