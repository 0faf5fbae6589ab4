"""Prometheus metrics under vLLM's names with a `jtp:` prefix, so vLLM dashboards carry over.

Each app gets its own CollectorRegistry (tests build several apps in one process). Latency
histograms and token counters are fed by the request handlers as events arrive; the running /
waiting / KV-usage gauges and the prefix cache's counters and gauges are read from
`engine.stats()` when Prometheus scrapes.
Counts are per engine request: a request with n choices counts n times.

Prefix cache (vLLM v1's `prefix_cache_queries` / `prefix_cache_hits`, in tokens, plus the older
hit-rate gauge): queries are the prompt tokens of admitted requests, hits those of them whose KV
came from the cache (a request's `usage.prompt_tokens_details.cached_tokens`). Both stay 0 with
prefix caching off.

Pipeline stages (`jtp:pipeline_stage_*`, labelled `stage`) and GET /stats (`stats_report`, JSON):
each stage's steps, busy seconds and bubble share.

Compilation (`jtp:compilations`, `jtp:compilation_seconds`): the runner's count of step programs
traced and the time they took; after the warm-up it should not move, and when it does, that step
stalled every request in it.

Data parallelism (`--data-parallel-size`): the engine's series above come one per replica, labelled
`replica`, and each replica's health and work beside them (`jtp:replica_*`): 1 while it serves and 0
while it is rebuilt after a failure, its restarts, steps, tokens generated and the steps' time (the
mean step time: step seconds over steps).
"""

from __future__ import annotations

import dataclasses

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# Bucket edges in seconds, spanning a warm GPU decode step to a long generation on a CPU.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)


class _EngineStats(Collector):
    """Gauges and counters sampled from the engine at scrape time; a data-parallel engine's one
    sample per replica, labelled `replica` (sum them for the whole)."""

    def __init__(self, engine, model_name: str):
        self.engine, self.model_name = engine, model_name

    def describe(self):
        return []  # nothing to check at registration, and the engine is not asked until a scrape

    def collect(self):
        per_replica = getattr(self.engine, "replica_stats", None)
        if per_replica is None:
            labels, samples = ["model_name"], [([self.model_name], self.engine.stats())]
        else:
            labels = ["model_name", "replica"]
            samples = [([self.model_name, str(r)], stats) for r, stats in enumerate(per_replica())]
        tables = [(label_values, _values(stats)) for label_values, stats in samples]
        for kind in (GaugeMetricFamily, CounterMetricFamily):
            for i, (name, doc, _) in enumerate(tables[0][1][kind]):
                family = kind(name, doc, labels=labels)
                for label_values, table in tables:
                    family.add_metric(label_values, table[kind][i][2])
                yield family
        health = getattr(self.engine, "replica_health", None)
        if health is not None:
            yield from _replica_health(self.model_name, health())
        stages = stage_stats(self.engine)
        if stages:
            yield from _labelled(STAGE_SERIES, ["model_name", "replica", "stage"],
                                 [([self.model_name, str(s["replica"]), str(s["stage"])], s) for s in stages])


def _replica_health(model_name: str, health: list) -> list:
    """Each replica's health and work (a data-parallel engine's `replica_health()`), labelled `replica`."""
    series = (
        (GaugeMetricFamily, "jtp:replica_healthy", "1 while the replica serves, 0 while it is rebuilt after a failure.",
         lambda h: float(h.serving)),
        (CounterMetricFamily, "jtp:replica_restarts", "Times the replica was rebuilt after a failure.",
         lambda h: h.restarts),
        (CounterMetricFamily, "jtp:replica_steps", "Engine steps the replica ran.", lambda h: h.steps),
        (CounterMetricFamily, "jtp:replica_generation_tokens", "Tokens the replica generated.", lambda h: h.tokens),
        (CounterMetricFamily, "jtp:replica_step_seconds", "Seconds the replica's steps took (over its steps: the "
         "mean step time).", lambda h: h.step_seconds),
    )
    return _labelled(series, ["model_name", "replica"], [([model_name, str(r)], h) for r, h in enumerate(health)])


# Pipeline stages' (`stage_stats`) series; a value None (a bubble across processes, a stage that has
# not reported yet) is left out.
STAGE_SERIES = (
    (CounterMetricFamily, "jtp:pipeline_stage_steps", "Steps a pipeline stage finished.", lambda s: s["steps"]),
    (CounterMetricFamily, "jtp:pipeline_stage_busy_seconds", "Seconds a stage was busy.", lambda s: s["busy_seconds"]),
    (GaugeMetricFamily, "jtp:pipeline_stage_bubble_fraction", "Share of the pipeline's active time a stage sat idle.",
     lambda s: s["bubble_fraction"]),
)


def _labelled(series, labels: list[str], rows: list) -> list:
    """One family per (kind, name, doc, value of a row) in `series`, a sample per (label values, row)."""
    families = []
    for kind, name, doc, value in series:
        family = kind(name, doc, labels=labels)
        for label_values, row in rows:
            if (v := value(row)) is not None:
                family.add_metric(label_values, v)
        families.append(family)
    return families


def _values(stats) -> dict:
    """(name, doc, value) of each gauge and each counter (exposed with a _total suffix)."""
    usage = stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0
    return {
        GaugeMetricFamily: (
            ("jtp:num_requests_running", "Requests in the running batch.", stats.num_running),
            ("jtp:num_requests_waiting", "Requests waiting to be admitted.", stats.num_waiting),
            ("jtp:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).", usage),
            ("jtp:prefix_cache_hit_rate", "Fraction of queried prompt tokens served from the prefix cache.",
             stats.prefix_cache_hit_rate),
            ("jtp:prefix_cache_blocks", "KV cache blocks registered in the prefix cache.",
             stats.prefix_cache_blocks),
            ("jtp:num_snapshots", "Snapshots pinned in the prefix cache.", stats.num_snapshots),
            ("jtp:spec_decode_acceptance_rate", "Fraction of drafted tokens the target model accepted.",
             stats.spec_decode_acceptance_rate),
            ("jtp:spec_decode_mean_accepted_length", "Tokens a verified speculating row emits on average.",
             stats.spec_decode_mean_accepted_length),
        ),
        CounterMetricFamily: (
            ("jtp:prefix_cache_queries", "Prompt tokens of admitted requests looked up in the prefix cache.",
             stats.prefix_cache_queries),
            ("jtp:prefix_cache_hits", "Prompt tokens served from the prefix cache.", stats.prefix_cache_hits),
            ("jtp:spec_decode_num_drafts", "Speculating rows verified.", stats.spec_decode_num_drafts),
            ("jtp:spec_decode_num_draft_tokens", "Tokens drafted.", stats.spec_decode_num_draft_tokens),
            ("jtp:spec_decode_num_accepted_tokens", "Drafted tokens accepted.", stats.spec_decode_num_accepted_tokens),
            ("jtp:spec_decode_num_state_rollbacks", "Hybrid rows whose recurrent state was rolled back "
             "before a rejected draft.", stats.spec_decode_num_state_rollbacks),
            ("jtp:compilations", "Step programs compiled since start, warm-up included (any after /ready "
             "stalled the requests of that step).", stats.compilations),
            ("jtp:compilation_seconds", "Seconds spent compiling step programs (tracing, XLA, cache loads).",
             stats.compile_seconds),
        ),
    }


def stage_stats(engine) -> list[dict]:
    """Each pipeline stage's counts (jtp/worker/pipeline.py), of every replica: [] without a pipeline."""
    replicas = getattr(engine, "replicas", [engine])
    return [{"replica": r, **stage} for r, replica in enumerate(replicas)
            for stage in getattr(replica.runner, "stage_stats", list)()]


def stats_report(engine) -> dict:
    """GET /stats: the engine's counts (summed over replicas), each replica's, each pipeline stage's."""
    report = {"engine": dataclasses.asdict(engine.stats())}
    per_replica = getattr(engine, "replica_stats", None)
    if per_replica is not None:
        report["replicas"] = [
            {"replica": r, "state": health.state, "restarts": health.restarts, "steps": health.steps,
             "tokens": health.tokens, "mean_step_ms": round(1e3 * health.mean_step_seconds, 4),
             "failure": health.failure, **dataclasses.asdict(stats)}
            for r, (stats, health) in enumerate(zip(per_replica(), engine.replica_health()))]
    stages = stage_stats(engine)
    if stages:
        report["stages"] = stages
    return report


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine, model_name: str):
        self.registry = CollectorRegistry()
        label = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(name, doc, label, buckets=buckets, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, label, registry=self.registry).labels(model_name)

        self.time_to_first_token = histogram(
            "jtp:time_to_first_token_seconds", "Time from arrival to the first generated token.", TTFT_BUCKETS)
        self.time_per_output_token = histogram(
            "jtp:time_per_output_token_seconds",
            "Mean time between output tokens after the first, one observation per request.", TPOT_BUCKETS)
        self.e2e_latency = histogram(
            "jtp:e2e_request_latency_seconds", "Time from arrival to the last token.", E2E_BUCKETS)
        # A request's phases on the engine's clock (vLLM's request_*_time_seconds): where TTFT goes.
        self.phases = {
            "queue": histogram("jtp:request_queue_time_seconds",
                                "Time from submission until the scheduler first gave the request a row.", E2E_BUCKETS),
            "prefill": histogram("jtp:request_prefill_time_seconds",
                                 "Time from the request's first row to its first token.", TTFT_BUCKETS),
            "decode": histogram("jtp:request_decode_time_seconds",
                                "Time from the request's first token to its last.", E2E_BUCKETS),
            "inference": histogram("jtp:request_inference_time_seconds",
                                   "Time from the request's first row to its last token.", E2E_BUCKETS),
        }
        self.prompt_tokens = counter("jtp:prompt_tokens", "Prompt tokens prefilled.")
        self.generation_tokens = counter("jtp:generation_tokens", "Tokens generated.")
        self._success = Counter("jtp:request_success", "Requests finished, by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        self._model_name = model_name
        self.registry.register(_EngineStats(engine, model_name))

    def first_token(self, prompt_tokens: int, seconds: float) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.time_to_first_token.observe(seconds)

    def finished(self, reason: str, num_tokens: int, seconds: float, first_token_seconds: float | None) -> None:
        self._success.labels(self._model_name, reason).inc()
        self.e2e_latency.observe(seconds)
        if first_token_seconds is not None and num_tokens > 1:
            self.time_per_output_token.observe((seconds - first_token_seconds) / (num_tokens - 1))

    def request_phases(self, timing) -> None:
        """A finished request's `RequestTiming`: each phase it reached, observed once."""
        for phase, seconds in timing._asdict().items():
            if seconds is not None:
                self.phases[phase].observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
