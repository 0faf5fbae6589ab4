"""Issue 30, first part: --data-parallel-size N, N engine replicas on disjoint devices behind one
engine (jtp/engine/data_parallel.py).

- A staggered greedy batch gives the tokens of one engine at tp=1, with 2 replicas of tp=1 and of
  tp=2, on the demo checkpoint, a tiny Qwen3 MoE and a tiny hybrid.
- Routing: distinct prompts spread over the replicas; a conversation resent with its history goes
  to the replica that served it (its prefix-cache hits count there, none elsewhere).
- Served: an openai-client chat, streamed and not, through a real loopback uvicorn over a
  DataParallelEngine; /metrics has each replica's gauges and counters, labelled.
- Health: a replica whose step fails ends its requests with retryable errors (served: 503s) and
  leaves the routing while the other keeps serving (the tokens of a solo run); it is rebuilt and
  serves again; with none left, submit is a 503-style error and `ready` clears until one is back.
  Each replica's steps, tokens and restarts add up to what its requests got, in `replica_health()`
  and /metrics.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from loopback import chat_whole_and_streamed, serving, serving_engine
from prometheus_client.parser import text_string_to_metric_families
from staggered import ENGINE_ARGS, run_staggered

from jtp.config.engine_args import EngineArgs
from jtp.core.sampling_params import SamplingParams
from jtp.engine.data_parallel import DataParallelEngine, build_engine
from jtp.engine.engine import Engine
from jtp.entrypoints.server.metrics import ServerMetrics
from jtp.errors import ConfigError, NoReplicaError


def staggered_tokens(args: EngineArgs) -> list[list[int]]:
    with build_engine(args) as engine:
        if args.data_parallel_size > 1:
            assert isinstance(engine, DataParallelEngine)
            devices = [{d.id for d in r.runner.mesh.devices.flat} for r in engine.replicas]
            assert len(set().union(*devices)) == sum(map(len, devices)), "replicas share a device"
        return run_staggered(engine, engine.cfg.vocab_size)


def test_replicas_give_the_tokens_of_one_engine(staggered_model):
    base = dict(ENGINE_ARGS, model=staggered_model, skip_tokenizer_init=True, dtype="float32")
    expected = staggered_tokens(EngineArgs(**base))
    for dp, tp in ((2, 1), (2, 2)):
        assert staggered_tokens(EngineArgs(**base, data_parallel_size=dp, tensor_parallel_size=tp)) == expected, (dp, tp)


def test_too_few_devices_or_several_processes_are_one_line_errors(demo_dir):
    with pytest.raises(ConfigError, match=r"--data-parallel-size 3 x --tensor-parallel-size 4 needs 12 devices, but 8"):
        build_engine(EngineArgs(model=str(demo_dir), data_parallel_size=3, tensor_parallel_size=4))
    with pytest.raises(ConfigError, match="--num-processes"):
        EngineArgs(model=str(demo_dir), data_parallel_size=2, num_processes=2, tensor_parallel_size=2).validate()
    with pytest.raises(ConfigError, match="at least 1"):
        EngineArgs(data_parallel_size=0).validate()


ROUTING_ARGS = dict(max_num_seqs=4, max_num_batched_tokens=32, block_size=8, num_blocks=64, max_model_len=128,
                    warmup=False, skip_tokenizer_init=True, data_parallel_size=2)


@pytest.fixture(scope="module")
def dp_engine(demo_dir):
    with DataParallelEngine.from_args(EngineArgs(model=str(demo_dir), **ROUTING_ARGS)) as engine:
        yield engine


def test_distinct_prompts_spread_and_a_resent_conversation_returns_to_its_replica(dp_engine):
    engine = dp_engine
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    other, convo = [7] * 20 + [1, 2, 3], list(range(10, 50))
    rids = [engine.submit(other, greedy), engine.submit(convo, greedy)]  # the second goes to the idle replica
    homes = [engine.replica_index(rid) for rid in rids]
    assert sorted(homes) == [0, 1]
    replies = [engine.result(rid) for rid in rids]
    hits = [s.prefix_cache_hits for s in engine.replica_stats()]

    # Both idle now: least-loaded alone would pick replica 0; the conversation's prefix picks its own.
    turn = convo + replies[1].token_ids + [5, 6, 7, 8]
    rid = engine.submit(turn, greedy)
    assert engine.replica_index(rid) == homes[1]
    engine.result(rid)
    gained = [s.prefix_cache_hits - h for s, h in zip(engine.replica_stats(), hits)]
    assert gained[homes[1]] >= 40 and gained[homes[0]] == 0, gained

    # A batch of distinct prompts lands on both replicas, about evenly.
    prompts = [[100 + i] * 12 + [i] for i in range(8)]
    rids = [engine.submit(p, greedy) for p in prompts]
    where = [engine.replica_index(rid) for rid in rids]
    assert where.count(0) == where.count(1) == 4, where
    for rid in rids:
        engine.result(rid)


def test_a_shared_prefix_stays_home_until_its_replica_batch_is_full(dp_engine):
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    system = list(range(60, 84))  # three blocks every prompt shares
    rids = [dp_engine.submit(system + [i, i + 1], greedy) for i in range(6)]
    where = [dp_engine.replica_index(rid) for rid in rids]
    home = where[0]
    # max_num_seqs (4) requests fill the home replica's batch; the rest go to the idle one.
    assert where[:4] == [home] * 4 and where[4] == 1 - home, where
    for rid in rids:
        dp_engine.result(rid)


def test_request_ids_are_unique_across_replicas(dp_engine):
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    a = dp_engine.submit([1, 2, 3], greedy, request_id="same")
    with pytest.raises(Exception, match="already in use"):
        dp_engine.submit([9, 9, 9, 9], greedy, request_id="same")  # would route to the other replica
    assert dp_engine.result(a).token_ids
    dp_engine.result(dp_engine.submit([4, 5], greedy, request_id="same"))  # free again once consumed
    assert dp_engine.abort("never-submitted") is False


def test_stats_add_up_the_replicas(dp_engine):
    per, total = dp_engine.replica_stats(), dp_engine.stats()
    assert total.kv_blocks_total == sum(s.kv_blocks_total for s in per) == 2 * per[0].kv_blocks_total
    assert total.prefix_cache_hits == sum(s.prefix_cache_hits for s in per)


def test_served_chat_and_stream_and_metrics_per_replica(demo_dir):
    args = EngineArgs(model=str(demo_dir), data_parallel_size=2, max_num_seqs=4, max_num_batched_tokens=32,
                      max_model_len=128, block_size=8, num_blocks=64, warmup=False)
    with serving_engine(args) as (engine, url, client):
        whole = chat_whole_and_streamed(client, args.model_name())
        assert whole.usage.completion_tokens == 8
        # A different chat, while both replicas are idle, still answers (whichever replica).
        other = client.chat.completions.create(model=args.model_name(), max_tokens=4, temperature=0,
                                               messages=[{"role": "user", "content": "Numbers: 1 2 3"}])
        assert other.choices[0].finish_reason in ("stop", "length")
        text = httpx.get(f"{url}/metrics").text
        stats = httpx.get(f"{url}/stats").json()
    replicas = stats["replicas"]
    assert [r["replica"] for r in replicas] == [0, 1] and all(r["state"] == "healthy" for r in replicas)
    assert sum(r["tokens"] for r in replicas) == 8 + 8 + 4 and stats["engine"]["kv_blocks_total"] == 128
    families = {f.name: f for f in text_string_to_metric_families(text)}
    running = families["jtp:num_requests_running"].samples
    assert sorted(s.labels["replica"] for s in running) == ["0", "1"]
    queries = families["jtp:prefix_cache_queries"].samples
    assert {s.labels["replica"] for s in queries if s.name.endswith("_total")} == {"0", "1"}
    # The resent (identical) chat found its prefix in one replica's cache.
    assert sum(s.value for s in families["jtp:prefix_cache_hits"].samples if s.name.endswith("_total")) > 0


def test_build_engine_is_a_plain_engine_for_one_replica(demo_dir):
    with build_engine(EngineArgs(model=str(demo_dir), **dict(ENGINE_ARGS, data_parallel_size=1))) as engine:
        assert type(engine) is Engine


def wait_until(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def break_replica(engine: DataParallelEngine, r: int, monkeypatch) -> None:
    """Replica r's next step raises, as a device error would."""

    def broken(*args, **kwargs):
        raise RuntimeError("injected device failure")

    monkeypatch.setattr(engine.replicas[r].runner, "dispatch", broken)


def hold_rebuilds(engine: DataParallelEngine, monkeypatch) -> threading.Event:
    """Rebuilds wait for the event returned (the test looks at the engine meanwhile)."""
    gate, build = threading.Event(), engine.build_replica
    monkeypatch.setattr(engine, "build_replica", lambda r: (gate.wait(60), build(r))[1])
    return gate


def test_a_failed_replica_leaves_the_routing_is_rebuilt_and_serves_again(demo_dir, monkeypatch):
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[100 + i] * 12 + [i] for i in range(6)]
    with DataParallelEngine.from_args(EngineArgs(model=str(demo_dir), **ROUTING_ARGS)) as engine:
        engine.start()
        engine.ready.set()  # no warm-up: the test compiles only what it uses
        solo = [engine.result(engine.submit(p, greedy)).token_ids for p in prompts]  # one at a time
        engine.reset_prefix_cache()  # routed by load alone from here
        gate = hold_rebuilds(engine, monkeypatch)
        try:
            check_failures_and_rebuilds(engine, greedy, prompts, solo, gate, monkeypatch)
        finally:
            gate.set()  # (a failed check must not leave close() waiting on a held rebuild)


def check_failures_and_rebuilds(engine, greedy, prompts, solo, gate, monkeypatch) -> None:
    # Requests on both replicas, routed by load (queued while the loops are stopped, so none has
    # finished before the last is routed); replica 1's first step fails.
    engine.stop()
    break_replica(engine, 1, monkeypatch)
    rids = [engine.submit(p, greedy) for p in prompts[:4]]
    where = [engine.replica_index(rid) for rid in rids]
    engine.start()
    assert sorted(where) == [0, 0, 1, 1], where
    done = [engine.result(rid, timeout=60) for rid in rids]
    for i, (r, completion) in enumerate(zip(where, done)):
        if r == 1:
            assert completion.finish_reason == "error" and completion.retryable, completion
            assert "injected device failure" in completion.error
        else:
            assert completion.finish_reason == "length" and completion.token_ids == solo[i]

    # While it is rebuilt the other replica takes every request, and the engine stays ready.
    health = engine.replica_health()
    assert [h.state for h in health] == ["healthy", "restarting"] and engine.ready.is_set()
    assert "injected device failure" in health[1].failure
    rids = [engine.submit(p, greedy) for p in prompts[4:]]
    assert [engine.replica_index(rid) for rid in rids] == [0, 0]
    assert [engine.result(rid, timeout=60).token_ids for rid in rids] == solo[4:]

    # Replica 0 fails too: nothing serves, submit is a retryable (503) error and ready clears.
    break_replica(engine, 0, monkeypatch)
    failed = engine.result(engine.submit(prompts[0], greedy), timeout=60)
    assert failed.finish_reason == "error" and failed.retryable
    assert not engine.ready.is_set()
    with pytest.raises(NoReplicaError) as refused:
        engine.submit(prompts[1], greedy)
    assert refused.value.status == 503

    # Both come back on their devices: ready again, one restart each, the solo run's tokens on both.
    gate.set()
    wait_until(lambda: all(h.serving for h in engine.replica_health()))
    assert engine.ready.is_set() and [h.restarts for h in engine.replica_health()] == [1, 1]
    assert [{d.id for d in e.runner.mesh.devices.flat} for e in engine.replicas] == [
        {d.id for d in devices} for devices in engine.devices]
    engine.stop()  # (both queued before either steps: one each)
    rids = [engine.submit(p, greedy) for p in prompts[:2]]
    engine.start()
    assert sorted(engine.replica_index(rid) for rid in rids) == [0, 1]
    assert [engine.result(rid, timeout=60).token_ids for rid in rids] == solo[:2]


def test_replica_health_counts_each_replica_steps_and_tokens(dp_engine):
    before = dp_engine.replica_health()
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    rids = [dp_engine.submit([200 + i] * 9, greedy) for i in range(4)]
    where = [dp_engine.replica_index(rid) for rid in rids]
    tokens = [len(dp_engine.result(rid).token_ids) for rid in rids]
    after = dp_engine.replica_health()
    for r in (0, 1):
        assert after[r].tokens - before[r].tokens == sum(n for n, home in zip(tokens, where) if home == r) > 0
        assert after[r].steps - before[r].steps >= 5  # a token a step at most, without speculation
        assert after[r].state == "healthy" and after[r].restarts == 0 and after[r].mean_step_seconds > 0

    families = {f.name: f for f in text_string_to_metric_families(ServerMetrics(dp_engine, "m").render().decode())}
    for name, value in (("jtp:replica_healthy", lambda h: 1.0), ("jtp:replica_restarts", lambda h: h.restarts),
                        ("jtp:replica_steps", lambda h: h.steps),
                        ("jtp:replica_generation_tokens", lambda h: h.tokens)):
        samples = [s for s in families[name].samples if not s.name.endswith("_created")]
        assert {s.labels["replica"]: s.value for s in samples} == {
            str(r): value(h) for r, h in enumerate(dp_engine.replica_health())}, name


def test_served_replica_failures_are_503s_and_the_server_serves_again_once_rebuilt(demo_dir, monkeypatch):
    from jtp.entrypoints.server import build_app

    args = EngineArgs(model=str(demo_dir), **dict(ROUTING_ARGS, skip_tokenizer_init=False))
    engine = build_engine(args)
    engine.start()
    engine.ready.set()
    gate = hold_rebuilds(engine, monkeypatch)
    body = {"model": args.model_name(), "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
            "temperature": 0}
    try:
        with serving(build_app(engine, args.model_name())) as url:
            expected = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
            for r in (0, 1):
                break_replica(engine, r, monkeypatch)
            # Each replica fails the chat it gets (the first leaves the routing, so the second goes to
            # the other): a 503 to retry after; then none serves and the server is not ready.
            for _ in (0, 1):
                failed = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
                assert failed.status_code == 503 and failed.headers["retry-after"], failed.text
                assert "injected device failure" in failed.json()["error"]["message"]
            assert httpx.get(f"{url}/ready").status_code == 503
            assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).status_code == 503
            gate.set()
            wait_until(lambda: httpx.get(f"{url}/ready").status_code == 200)
            again = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
            assert again["choices"][0]["message"] == expected["choices"][0]["message"]
            restarts = [f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
                        if f.name == "jtp:replica_restarts"][0].samples
    finally:
        gate.set()
        engine.close()
    assert sorted(s.value for s in restarts if s.name.endswith("_total")) == [1.0, 1.0]
