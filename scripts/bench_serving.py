#!/usr/bin/env python
"""Load generator for an OpenAI-compatible server (`jtp serve`, vLLM, SGLang): throughput and latency.

    python scripts/bench_serving.py --base-url http://127.0.0.1:8000 --num-prompts 64 \\
        --input-len 1024 --output-len 128 --max-concurrency 8 [--json-out result.json]

Requests stream (server-sent events) from `--endpoint` (/v1/completions or /v1/chat/completions)
with `ignore_eos` so every completion is exactly `--output-len` tokens long. Prompts are random:
`--input-len` random token ids sent as a token-id prompt (completions), or random words (chat,
multi-turn, or `--prompt-kind text`; then the length is about `--input-len` tokens, and the
server's usage reports the real count). `--words placeholder` draws the words as `t<id>`, which the
placeholder tokenizer of scripts/make_random_checkpoint.py reads as one distinct token each (it
reads every English word as the same unknown token, so English prompts would all be one prefix).

Arrivals: `--request-rate inf` (default) sends everything at once; a finite rate spaces the
starts by a Poisson process (`--arrival poisson`) or evenly (`--arrival constant`).
`--max-concurrency N` caps the requests in flight (N clients). `--multi-turn T` makes each of the
`--num-prompts` conversations T requests in a row, each resending the whole history (earlier user
turns and the server's answers) plus a new user turn of `--input-len` (`--follow-up-len` for
turns 2..T); a conversation holds its concurrency slot from its first turn to its last, like one
user in a chat.

Per request (timed on the client, so network and server overheads are included):
  TTFT  time to first token: request sent -> first chunk carrying generated text
  TPOT  time per output token after the first: (e2e - TTFT) / (output tokens - 1)
  ITL   inter-token latency: every gap between consecutive text chunks
  E2E   request sent -> stream ended
Reported like vLLM's benchmark_serving: request / output / total token throughput over the whole
run, and mean, median and percentiles (`--percentiles`, default 99) of each latency. Also TTFT by
turn index (what a prefix cache changes: turn N resends turns 1..N-1), and the prompt tokens the
server says it served from its prefix cache (`usage.prompt_tokens_details.cached_tokens`; absent = 0).
Where the server's /metrics has vLLM's request phase histograms (`jtp:` or `vllm:`
`request_{queue,prefill,decode,inference}_time_seconds`), the mean of each over the timed run: where
a TTFT goes on the server's own clock (waiting for a row, then the prefill). Against `jtp serve`, the
step programs the server compiled during the timed run (`jtp:compilations_total`): a run that met new
step shapes timed their compiles too, and says so.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import re
import sys
import time
from pathlib import Path
from typing import NamedTuple

import httpx
import numpy as np

WORDS = (
    "time person year way day thing man world life hand part child eye woman place work week case point "
    "number group problem fact river light stone music paper water city story garden window morning"
).split()


# What --structured-fraction asks for: one long string, so a constrained request runs to max_tokens like
# the others (any token but a quote or a control character continues it), a mask in every step.
STRUCTURED = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}


@dataclasses.dataclass
class RequestResult:
    ok: bool = False
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    e2e: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)  # gaps between text chunks
    text: str = ""
    start: float = 0.0  # seconds since the run began
    turn: int = 1  # 1-based index within its conversation
    cached_tokens: int = 0  # prompt tokens the server took from its prefix cache

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


# ----------------------------------------------------------------------------- workload


@dataclasses.dataclass
class Workload:
    endpoint: str
    model: str
    input_len: int
    output_len: int
    prompt_kind: str  # "tokens" or "text"
    vocab_size: int
    ignore_eos: bool
    rng: random.Random
    follow_up_len: int | None = None  # user-turn length of turns 2..T (None: input_len)
    words: str = "english"  # or "placeholder": t<id> words
    range_ratio: float = 0.0  # lengths drawn uniformly from [len x (1 - r), len x (1 + r)]
    structured_fraction: float = 0.0  # share of requests that ask for STRUCTURED (a token mask per step)

    def _length(self, n: int) -> int:
        if not self.range_ratio:
            return n
        return self.rng.randint(max(1, round(n * (1 - self.range_ratio))), max(1, round(n * (1 + self.range_ratio))))

    def user_turn(self, turn: int = 1) -> str | list[int]:
        n = self._length(self.input_len if turn == 1 or self.follow_up_len is None else self.follow_up_len)
        if self.prompt_kind == "tokens":
            return [self.rng.randrange(self.vocab_size) for _ in range(n)]
        if self.words == "placeholder":
            return "".join(f" t{self.rng.randrange(self.vocab_size)}" for _ in range(n))
        return "".join(" " + self.rng.choice(WORDS) for _ in range(n))

    def payload(self, history: list[dict]) -> dict:
        """The request body for a conversation so far (`history`: chat messages, last one the user's)."""
        body = {"model": self.model, "max_tokens": self._length(self.output_len), "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": self.ignore_eos, "temperature": 0.0}
        if self.structured_fraction and self.rng.random() < self.structured_fraction:
            body["structured_outputs"] = {"json": STRUCTURED}
        if self.endpoint.endswith("/chat/completions"):
            body["messages"] = history
        elif len(history) == 1:
            body["prompt"] = history[0]["content"]  # a string or token ids
        else:
            body["prompt"] = "".join(m["content"] for m in history)  # the conversation as one text
        return body


def arrival_gaps(n: int, rate: float, arrival: str, rng: random.Random) -> list[float]:
    """Seconds to wait before each of n starts: 0 for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * n
    if arrival == "poisson":
        return [rng.expovariate(rate) for _ in range(n)]
    return [1.0 / rate] * n


# ----------------------------------------------------------------------------- one request


def cached_tokens(usage: dict) -> int:
    """usage.prompt_tokens_details.cached_tokens; 0 where a server leaves any of it out (or null)."""
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if isinstance(cached, int) else 0


def _chunk_text(data: dict) -> str:
    """The generated text a completions or chat chunk carries ("" for role / finish / usage chunks)."""
    pieces = []
    for choice in data.get("choices") or []:
        if "text" in choice:
            pieces.append(choice["text"] or "")
        delta = choice.get("delta") or {}
        pieces.append(delta.get("content") or "")
        pieces.append(delta.get("reasoning_content") or "")
    return "".join(pieces)


async def send(client: httpx.AsyncClient, url: str, body: dict, headers: dict, run_start: float) -> RequestResult:
    result = RequestResult()
    sent = time.perf_counter()
    result.start = sent - run_start
    last = None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')[:300]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[len("data:"):].strip()
                if payload == "[DONE]":
                    break
                now = time.perf_counter()
                data = json.loads(payload)
                if "error" in data:
                    result.error = f"error event: {data['error'].get('message', data['error'])}"
                    return result
                if data.get("usage"):
                    result.prompt_tokens = data["usage"].get("prompt_tokens", 0)
                    result.output_tokens = data["usage"].get("completion_tokens", 0)
                    result.cached_tokens = cached_tokens(data["usage"])
                text = _chunk_text(data)
                if text:
                    if last is None:
                        result.ttft = now - sent
                    else:
                        result.itl.append(now - last)
                    last = now
                    result.text += text
    except (httpx.HTTPError, ValueError) as e:  # ValueError: a chunk that is not JSON
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.e2e = time.perf_counter() - sent
    if last is None:
        result.error = "the stream carried no text"
    elif result.output_tokens == 0:
        result.error = "no usage in the stream (the server ignored stream_options.include_usage)"
    else:
        result.ok = True
    return result


# ----------------------------------------------------------------------------- the run


PHASES = ("queue", "prefill", "decode", "inference")
_PHASE_LINE = re.compile(r"^(?:jtp|vllm):request_(" + "|".join(PHASES) + r")_time_seconds_(sum|count)(?:\{[^}]*\})? (\S+)$",
                         re.M)
_COMPILATIONS_LINE = re.compile(r"^jtp:compilations_total(?:\{[^}]*\})? (\S+)$", re.M)


class ServerCounters(NamedTuple):
    """What the timed run reads from the server's /metrics before and after it."""

    phases: dict[str, tuple[float, float]]  # {phase: (seconds summed, requests)}, every label set added up
    compilations: float | None  # step programs compiled so far (jtp only)


def server_counters(base_url: str) -> ServerCounters:
    """The server's request phase histograms and compile count; empty / None where its /metrics has
    none (or it has no /metrics)."""
    try:
        text = httpx.get(base_url.rstrip("/") + "/metrics", timeout=10.0).text
    except httpx.HTTPError:
        return ServerCounters({}, None)
    totals: dict[str, list[float]] = {}
    for phase, field, value in _PHASE_LINE.findall(text):
        totals.setdefault(phase, [0.0, 0.0])[field == "count"] += float(value)
    compiled = _COMPILATIONS_LINE.findall(text)
    return ServerCounters({phase: (total, count) for phase, (total, count) in totals.items()},
                          sum(map(float, compiled)) if compiled else None)


def phase_means_ms(before: dict, after: dict) -> dict[str, float]:
    """Each phase's mean (ms) over the requests that finished between two `server_counters` reads."""
    means = {}
    for phase, (total, count) in after.items():
        total0, count0 = before.get(phase, (0.0, 0.0))
        if count > count0:
            means[phase] = 1000.0 * (total - total0) / (count - count0)
    return means


async def run_benchmark(args: argparse.Namespace, workload: Workload) -> tuple[list[RequestResult], float, dict,
                                                                               int | None]:
    """The requests' results, the run's seconds, the server's mean request phases (ms) over it and the
    step programs it compiled meanwhile (None: not a jtp server)."""
    url = args.base_url.rstrip("/") + args.endpoint
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limit = asyncio.Semaphore(args.max_concurrency or args.num_prompts)
    results: list[RequestResult] = []
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    pool = httpx.Limits(max_connections=None, max_keepalive_connections=None)

    async with httpx.AsyncClient(timeout=timeout, limits=pool) as client:
        if not args.skip_test_request:  # fails fast on a wrong URL / model; compiles the first shapes
            test = await send(client, url, workload.payload([{"role": "user", "content": workload.user_turn()}]),
                              headers, time.perf_counter())
            if not test.ok:
                raise SystemExit(f"error: the test request failed: {test.error}")

        async def conversation() -> None:
            async with limit:
                history: list[dict] = []
                for turn in range(1, args.multi_turn + 1):
                    history.append({"role": "user", "content": workload.user_turn(turn)})
                    result = await send(client, url, workload.payload(history), headers, run_start)
                    result.turn = turn
                    results.append(result)
                    if not result.ok:
                        return  # the rest of this conversation has no history to build on
                    history.append({"role": "assistant", "content": result.text})

        gaps = arrival_gaps(args.num_prompts, args.request_rate, args.arrival, workload.rng)
        before = await asyncio.to_thread(server_counters, args.base_url)  # the test request's are not the run's
        run_start = time.perf_counter()
        tasks = []
        for gap in gaps:
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(conversation()))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - run_start
    after = await asyncio.to_thread(server_counters, args.base_url)
    compiled = None  # not a jtp server, or a restarted one (its counter began again)
    if None not in (before.compilations, after.compilations) and after.compilations >= before.compilations:
        compiled = int(after.compilations - before.compilations)
    return results, duration, phase_means_ms(before.phases, after.phases), compiled


# ----------------------------------------------------------------------------- statistics


def _ms(values: list[float]) -> np.ndarray:
    return np.asarray(values, dtype=np.float64) * 1000.0


def ttft_by_turn(done: list[RequestResult]) -> list[dict]:
    """Per turn index: requests, mean prompt / cached tokens, mean and median TTFT (ms)."""
    rows = []
    for turn in sorted({r.turn for r in done}):
        of_turn = [r for r in done if r.turn == turn]
        ttft = _ms([r.ttft for r in of_turn])
        rows.append({"turn": turn, "requests": len(of_turn),
                     "mean_prompt_tokens": float(np.mean([r.prompt_tokens for r in of_turn])),
                     "mean_cached_tokens": float(np.mean([r.cached_tokens for r in of_turn])),
                     "mean_ttft_ms": float(ttft.mean()), "median_ttft_ms": float(np.median(ttft))})
    return rows


def summarize(results: list[RequestResult], duration: float, percentiles: list[float]) -> dict:
    """vLLM-style summary: counts, throughputs, and mean / median / percentiles (ms) of each latency;
    then the prefix-cache share of the prompt tokens and TTFT by turn."""
    done = [r for r in results if r.ok]
    prompt_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    cached_tokens = sum(r.cached_tokens for r in done)
    summary = {
        "duration_s": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration,
    }
    samples = {
        "ttft": [r.ttft for r in done],
        "tpot": [r.tpot for r in done if r.tpot is not None],
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.e2e for r in done],
    }
    for name, values in samples.items():
        ms = _ms(values)
        summary[f"mean_{name}_ms"] = float(ms.mean()) if ms.size else None
        summary[f"median_{name}_ms"] = float(np.median(ms)) if ms.size else None
        for p in percentiles:
            summary[f"p{p:g}_{name}_ms"] = float(np.percentile(ms, p)) if ms.size else None
    summary["prompt_tokens"] = prompt_tokens  # = total_input_tokens, named beside the cached count
    summary["cached_prompt_tokens"] = cached_tokens
    summary["cached_prompt_fraction"] = cached_tokens / prompt_tokens if prompt_tokens else None
    summary["ttft_by_turn"] = ttft_by_turn(done)
    return summary


SECTIONS = (
    ("ttft", "Time to First Token", "TTFT"),
    ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
    ("itl", "Inter-token Latency", "ITL"),
    ("e2el", "End-to-end Latency", "E2EL"),
)


def format_table(summary: dict, percentiles: list[float]) -> str:
    width = 50

    def row(label: str, value) -> str:
        shown = "n/a" if value is None else (f"{value:.2f}" if isinstance(value, float) else str(value))
        return f"{label:<40}{shown:>10}"

    lines = [" Serving Benchmark Result ".center(width, "="),
             row("Successful requests:", summary["completed"]),
             row("Failed requests:", summary["failed"]),
             row("Benchmark duration (s):", summary["duration_s"]),
             row("Total input tokens:", summary["total_input_tokens"]),
             row("Total generated tokens:", summary["total_output_tokens"]),
             row("Request throughput (req/s):", summary["request_throughput"]),
             row("Output token throughput (tok/s):", summary["output_throughput"]),
             row("Total token throughput (tok/s):", summary["total_token_throughput"])]
    for key, title, short in SECTIONS:
        lines.append(f" {title} ".center(width, "-"))
        lines.append(row(f"Mean {short} (ms):", summary[f"mean_{key}_ms"]))
        lines.append(row(f"Median {short} (ms):", summary[f"median_{key}_ms"]))
        lines += [row(f"P{p:g} {short} (ms):", summary[f"p{p:g}_{key}_ms"]) for p in percentiles]
    if summary.get("server_phases_ms"):
        lines.append(" Server's Request Phases (mean ms) ".center(width, "-"))
        lines += [row(f"{phase.capitalize()}:", ms) for phase, ms in summary["server_phases_ms"].items()]
    if summary.get("server_compilations") is not None:
        lines.append(" Server's Compilations ".center(width, "-"))
        lines.append(row("Step programs compiled during the run:", summary["server_compilations"]))
    fraction = summary["cached_prompt_fraction"]
    lines += [" Prefix Cache (server's usage) ".center(width, "-"),
              row("Cached prompt tokens:", summary["cached_prompt_tokens"]),
              row("Cached / prompt tokens (%):", None if fraction is None else 100.0 * fraction)]
    if len(summary["ttft_by_turn"]) > 1:  # one turn would repeat the TTFT section
        lines += [" TTFT by Turn (mean tokens, ms) ".center(width, "-"),
                  f"{'Turn':>4}{'Reqs':>6}{'Prompt':>9}{'Cached':>9}{'Mean':>11}{'Median':>11}"]
        lines += [f"{t['turn']:>4}{t['requests']:>6}{t['mean_prompt_tokens']:>9.0f}{t['mean_cached_tokens']:>9.0f}"
                  f"{t['mean_ttft_ms']:>11.2f}{t['median_ttft_ms']:>11.2f}" for t in summary["ttft_by_turn"]]
    lines.append("=" * width)
    return "\n".join(lines)


# ----------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (default: %(default)s)")
    ap.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"],
                    help="API route to load (default: %(default)s)")
    ap.add_argument("--model", help="model name to send (default: the first of GET /v1/models)")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                    help="bearer token (default: $OPENAI_API_KEY, else none)")
    ap.add_argument("--num-prompts", type=int, default=64, help="requests, or conversations with --multi-turn")
    ap.add_argument("--input-len", type=int, default=1024, help="prompt tokens per request (per turn)")
    ap.add_argument("--output-len", type=int, default=128, help="generated tokens per request")
    ap.add_argument("--random-range-ratio", type=float, default=0.0, metavar="R",
                    help="draw each prompt's and output's length uniformly from [len x (1 - R), len x (1 + R)] "
                         "(as vLLM's benchmark; default 0: every length exactly --input-len / --output-len)")
    ap.add_argument("--structured-fraction", type=float, default=0.0, metavar="F",
                    help="share of requests sent with vLLM's structured_outputs (a JSON schema of one long string): "
                         "what constrained decoding costs the batch (default: 0)")
    ap.add_argument("--prompt-kind", choices=["auto", "tokens", "text"], default="auto",
                    help="random token ids or random words (auto: token ids for single-turn completions)")
    ap.add_argument("--vocab-size", type=int, default=1000,
                    help="random token ids (and placeholder words t<id>) are drawn from [0, N); "
                         "keep N below the model's special tokens")
    ap.add_argument("--words", choices=["english", "placeholder"], default="english",
                    help="text prompts: English words, or t<id> words (one distinct token each for the "
                         "placeholder tokenizer of make_random_checkpoint.py, which maps English to one token)")
    ap.add_argument("--request-rate", type=float, default=math.inf,
                    help="requests (conversations) started per second; inf = all at once (default)")
    ap.add_argument("--arrival", choices=["poisson", "constant"], default="poisson",
                    help="with a finite rate: exponential (Poisson process) or equal gaps between starts")
    ap.add_argument("--max-concurrency", type=int, default=None, help="most requests (conversations) in flight")
    ap.add_argument("--multi-turn", type=int, default=1, metavar="T", help="turns per conversation (default: 1)")
    ap.add_argument("--follow-up-len", type=int, default=None,
                    help="user-turn tokens of turns 2..T (default: --input-len)")
    ap.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                    help="let requests stop at end-of-sequence (output lengths then vary)")
    ap.add_argument("--percentiles", default="99", help="comma-separated latency percentiles (default: 99)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random prompts and arrivals")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    ap.add_argument("--skip-test-request", action="store_true", help="start the run without a first probe request")
    ap.add_argument("--json-out", type=Path, help="write config, summary and per-request results here")
    return ap


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("num_prompts", "input_len", "output_len", "multi_turn", "vocab_size"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if not 0 <= args.random_range_ratio < 1:
        ap.error("--random-range-ratio must be in [0, 1)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        ap.error("--max-concurrency must be at least 1")
    if args.follow_up_len is not None and args.follow_up_len < 1:
        ap.error("--follow-up-len must be at least 1")
    if not args.request_rate > 0:
        ap.error("--request-rate must be positive (inf: all at once)")
    if args.prompt_kind == "auto":
        single_completions = args.endpoint == "/v1/completions" and args.multi_turn == 1
        args.prompt_kind = "tokens" if single_completions else "text"
    elif args.prompt_kind == "tokens" and (args.endpoint != "/v1/completions" or args.multi_turn > 1):
        ap.error("token-id prompts need single-turn /v1/completions (chat and multi-turn resend text)")
    try:
        args.percentiles = [float(p) for p in args.percentiles.split(",")]
    except ValueError:
        ap.error(f"--percentiles {args.percentiles!r}: expected numbers like 50,90,99")
    if not all(0 <= p <= 100 for p in args.percentiles):
        ap.error("--percentiles must lie in [0, 100]")


def served_model(base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30.0)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    check_args(ap, args)
    try:
        model = args.model or served_model(args.base_url, args.api_key)
    except httpx.HTTPError as e:
        print(f"error: cannot list the models at {args.base_url}: {e}", file=sys.stderr)
        return 1
    workload = Workload(args.endpoint, model, args.input_len, args.output_len, args.prompt_kind,
                        args.vocab_size, args.ignore_eos, random.Random(args.seed), args.follow_up_len, args.words,
                        args.random_range_ratio, args.structured_fraction)
    results, duration, phases, compiled = asyncio.run(run_benchmark(args, workload))
    summary = summarize(results, duration, args.percentiles)
    summary["server_phases_ms"], summary["server_compilations"] = phases, compiled
    print(format_table(summary, args.percentiles))
    if compiled:
        print(f"warning: the server compiled {compiled} step program(s) during the timed run, so its figures "
              "include compile time: not a steady state (warm the server's step shapes first)", file=sys.stderr)
    for r in results:
        if r.error:
            print(f"failed: {r.error}", file=sys.stderr)
            break
    if args.json_out:
        config = {k: v for k, v in vars(args).items() if k not in ("api_key", "json_out")}
        record = {
            "config": {**config, "model": model, "request_rate": str(args.request_rate)},
            "summary": summary,
            "requests": [{k: v for k, v in dataclasses.asdict(r).items() if k != "text"} for r in results],
        }
        args.json_out.write_text(json.dumps(record, indent=1) + "\n")
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
