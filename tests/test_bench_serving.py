"""scripts/bench_serving.py: its statistics against a stub with known timings, then a real `jtp serve`."""

import asyncio
import json
import random
import re
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import uvicorn
from cpu_env import cpu_env
from scripts_loader import load_script
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

bench = load_script("bench_serving")

FIRST_DELAY, GAP = 0.15, 0.02  # the stub's time to first token and between tokens (s)
TURN_STEP = 0.1  # the stub's extra time to first token per earlier turn of a chat (s)


# ----------------------------------------------------------------------------- statistics alone


def test_summary_of_known_results():
    results = [
        bench.RequestResult(ok=True, prompt_tokens=10, output_tokens=5, ttft=0.1, e2e=0.5, itl=[0.1] * 4),
        bench.RequestResult(ok=True, prompt_tokens=10, output_tokens=3, ttft=0.3, e2e=0.7, itl=[0.2] * 2),
        bench.RequestResult(error="HTTP 500", turn=3),  # failed: in no turn's row
    ]
    s = bench.summarize(results, duration=2.0, percentiles=[50, 99])
    assert (s["completed"], s["failed"], s["total_input_tokens"], s["total_output_tokens"]) == (2, 1, 20, 8)
    assert s["request_throughput"] == 1.0 and s["output_throughput"] == 4.0 and s["total_token_throughput"] == 14.0
    assert s["mean_ttft_ms"] == pytest.approx(200) and s["median_ttft_ms"] == pytest.approx(200)
    assert s["mean_tpot_ms"] == pytest.approx(150)  # (0.5-0.1)/4 = 100 ms and (0.7-0.3)/2 = 200 ms
    assert s["median_itl_ms"] == pytest.approx(100) and s["p99_itl_ms"] == pytest.approx(200)
    assert s["p50_e2el_ms"] == pytest.approx(600)
    assert (s["prompt_tokens"], s["cached_prompt_tokens"], s["cached_prompt_fraction"]) == (20, 0, 0.0)
    assert s["ttft_by_turn"] == [{"turn": 1, "requests": 2, "mean_prompt_tokens": 10.0, "mean_cached_tokens": 0.0,
                                  "mean_ttft_ms": pytest.approx(200), "median_ttft_ms": pytest.approx(200)}]
    table = bench.format_table(s, [50, 99])
    assert "Successful requests:" in table and "P99 ITL (ms):" in table and "Mean TPOT (ms):" in table
    assert "Cached prompt tokens:" in table and "TTFT by Turn" not in table  # one turn: no per-turn rows


def test_summary_by_turn():
    results = [bench.RequestResult(ok=True, prompt_tokens=p, cached_tokens=c, output_tokens=2, ttft=t, e2e=1.0,
                                   turn=turn)
               for turn, p, c, t in [(1, 100, 0, 0.4), (2, 300, 96, 0.1), (1, 102, 0, 0.6), (2, 310, 96, 0.2),
                                     (2, 320, 0, 0.6)]]
    s = bench.summarize(results, duration=1.0, percentiles=[99])
    assert s["cached_prompt_tokens"] == 192 and s["prompt_tokens"] == 1132
    assert s["cached_prompt_fraction"] == pytest.approx(192 / 1132)
    first, second = s["ttft_by_turn"]
    assert (first["turn"], first["requests"], first["mean_prompt_tokens"]) == (1, 2, 101.0)
    assert first["mean_ttft_ms"] == pytest.approx(500) and first["median_ttft_ms"] == pytest.approx(500)
    assert (second["turn"], second["requests"], second["mean_prompt_tokens"], second["mean_cached_tokens"]) == \
        (2, 3, 310.0, 64.0)
    assert second["mean_ttft_ms"] == pytest.approx(300) and second["median_ttft_ms"] == pytest.approx(200)
    table = bench.format_table(s, [99])
    assert "TTFT by Turn" in table and "Cached / prompt tokens (%):" in table
    assert re.search(r"^\s+2\s+3\s+310\s+64\s+300\.00\s+200\.00$", table, re.M), table


@pytest.mark.parametrize("usage, cached", [
    ({"prompt_tokens": 5}, 0),  # no details at all (an older server, or vLLM without prefix caching)
    ({"prompt_tokens_details": None}, 0),
    ({"prompt_tokens_details": {}}, 0),
    ({"prompt_tokens_details": {"cached_tokens": None}}, 0),
    ({"prompt_tokens_details": {"cached_tokens": 48}}, 48),
])
def test_cached_tokens_read_robustly(usage, cached):
    assert bench.cached_tokens(usage) == cached


def test_arrival_gaps():
    rng = random.Random(0)
    assert bench.arrival_gaps(3, float("inf"), "poisson", rng) == [0.0] * 3
    assert bench.arrival_gaps(4, 2.0, "constant", rng) == [0.5] * 4
    gaps = bench.arrival_gaps(4000, 10.0, "poisson", rng)
    assert sum(gaps) / len(gaps) == pytest.approx(0.1, rel=0.05) and len(set(gaps)) == len(gaps)


# ----------------------------------------------------------------------------- against a stub


class Stub:
    """An SSE server with fixed timings that records what it was sent and its peak concurrency.
    A chat's usage counts words as tokens and reports all but the last message as cached (a
    perfect prefix cache); completions' usage is a fixed 7 prompt tokens with no details."""

    def __init__(self):
        self.bodies, self.active, self.peak = [], 0, 0

    async def completions(self, request: Request):
        body = await request.json()
        self.bodies.append(body)
        chat = request.url.path.endswith("/chat/completions")

        async def events():
            self.active += 1
            self.peak = max(self.peak, self.active)
            try:
                if chat:
                    yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})  # no text: not a token
                turn = (len(body["messages"]) + 1) // 2 if chat else 1
                await asyncio.sleep(FIRST_DELAY + TURN_STEP * (turn - 1))
                for i in range(body["max_tokens"]):
                    if i:
                        await asyncio.sleep(GAP)
                    piece = f" w{i}"
                    yield _sse({"choices": [{"index": 0, "delta": {"content": piece}} if chat else
                                            {"index": 0, "text": piece}]})
                yield _sse({"choices": [], "usage": {"completion_tokens": body["max_tokens"],
                                                     **(_chat_usage(body["messages"]) if chat else {"prompt_tokens": 7})}})
                yield "data: [DONE]\n\n"
            finally:
                self.active -= 1

        return StreamingResponse(events(), media_type="text/event-stream")


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


def _chat_usage(messages: list[dict]) -> dict:
    words = [len(m["content"].split()) for m in messages]
    return {"prompt_tokens": sum(words), "prompt_tokens_details": {"cached_tokens": sum(words[:-1])}}


@pytest.fixture
def stub():
    state = Stub()
    app = Starlette(routes=[Route(path, state.completions, methods=["POST"])
                            for path in ("/v1/completions", "/v1/chat/completions")])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    state.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    yield state
    server.should_exit = True
    thread.join(10)


def run_bench(tmp_path, *argv):
    out = tmp_path / "result.json"
    assert bench.main([*argv, "--json-out", str(out)]) == 0
    return json.loads(out.read_text())


def test_timings_against_the_stub(stub, tmp_path):
    result = run_bench(tmp_path, "--base-url", stub.url, "--model", "m", "--num-prompts", "6", "--input-len", "16",
                       "--output-len", "5", "--max-concurrency", "2", "--skip-test-request", "--vocab-size", "50")
    s = result["summary"]
    assert (s["completed"], s["failed"], s["total_output_tokens"], s["total_input_tokens"]) == (6, 0, 30, 42)
    assert stub.peak == 2
    for body in stub.bodies:
        assert len(body["prompt"]) == 16 and all(0 <= t < 50 for t in body["prompt"])
        assert body["ignore_eos"] is True and body["stream"] is True and body["stream_options"]["include_usage"]
    slack = 0.1  # scheduling noise on a loaded machine
    assert FIRST_DELAY <= s["median_ttft_ms"] / 1000 < FIRST_DELAY + slack
    assert GAP * 0.8 <= s["median_itl_ms"] / 1000 < GAP + slack
    assert GAP * 0.8 <= s["median_tpot_ms"] / 1000 < GAP + slack
    for r in result["requests"]:
        assert len(r["itl"]) == 4
        assert (r["e2e"] - r["ttft"]) / 4 == pytest.approx(sum(r["itl"]) / 4, abs=0.01)
    # Two clients, three rounds each of about FIRST_DELAY + 4 * GAP.
    assert s["duration_s"] >= 3 * (FIRST_DELAY + 4 * GAP)
    # Usage without prompt_tokens_details: nothing cached; every request is a turn 1.
    assert (s["cached_prompt_tokens"], s["prompt_tokens"]) == (0, 42)
    assert [(t["turn"], t["requests"]) for t in s["ttft_by_turn"]] == [(1, 6)]


def test_multi_turn_chat_resends_the_history(stub, tmp_path):
    result = run_bench(tmp_path, "--base-url", stub.url, "--model", "m", "--endpoint", "/v1/chat/completions",
                       "--num-prompts", "2", "--multi-turn", "3", "--input-len", "4", "--output-len", "3",
                       "--skip-test-request")
    assert result["summary"]["completed"] == 6 and result["summary"]["total_output_tokens"] == 18
    turns = sorted(len(b["messages"]) for b in stub.bodies)
    assert turns == [1, 1, 3, 3, 5, 5]
    last = next(b["messages"] for b in stub.bodies if len(b["messages"]) == 5)
    assert [m["role"] for m in last] == ["user", "assistant", "user", "assistant", "user"]
    assert last[1]["content"] == last[3]["content"] == " w0 w1 w2"  # the answers, as streamed
    assert len(last[0]["content"].split()) == 4
    # TTFT counts the first chunk with text, not the role chunk sent at once.
    assert result["summary"]["median_ttft_ms"] / 1000 >= FIRST_DELAY
    # By turn: each conversation once per turn; the prompt is 4 words a user turn plus 3 an answer,
    # and the stub reports the history (all but the new user turn) as cached.
    s = result["summary"]
    by_turn = s["ttft_by_turn"]
    assert [(t["turn"], t["requests"]) for t in by_turn] == [(1, 2), (2, 2), (3, 2)]
    assert [t["mean_prompt_tokens"] for t in by_turn] == [4, 11, 18]
    assert [t["mean_cached_tokens"] for t in by_turn] == [0, 7, 14]
    assert (s["prompt_tokens"], s["cached_prompt_tokens"]) == (2 * 33, 2 * 21)
    assert s["cached_prompt_fraction"] == pytest.approx(21 / 33)
    for t in by_turn:  # the stub's first-token delay grows by TURN_STEP a turn
        assert 0 <= t["median_ttft_ms"] / 1000 - (FIRST_DELAY + TURN_STEP * (t["turn"] - 1)) < 0.08
    assert sorted(r["turn"] for r in result["requests"]) == [1, 1, 2, 2, 3, 3]
    assert all(r["cached_tokens"] == r["prompt_tokens"] - 4 for r in result["requests"])


def test_placeholder_words_and_short_follow_ups(stub, tmp_path):
    run_bench(tmp_path, "--base-url", stub.url, "--model", "m", "--endpoint", "/v1/chat/completions",
              "--num-prompts", "1", "--multi-turn", "2", "--input-len", "6", "--follow-up-len", "2",
              "--output-len", "1", "--words", "placeholder", "--vocab-size", "50", "--skip-test-request")
    first, second = (b["messages"] for b in stub.bodies)
    assert re.fullmatch(r"( t\d+){6}", first[0]["content"]) and second[0] == first[0]
    assert re.fullmatch(r"( t\d+){2}", second[2]["content"])
    assert all(int(w[1:]) < 50 for w in (first[0]["content"] + second[2]["content"]).split())


def test_random_range_ratio_draws_lengths_in_range_and_counts_them(stub, tmp_path):
    result = run_bench(tmp_path, "--base-url", stub.url, "--model", "m", "--num-prompts", "40", "--input-len", "20",
                       "--output-len", "10", "--random-range-ratio", "0.5", "--skip-test-request",
                       "--vocab-size", "50")
    prompts = [len(b["prompt"]) for b in stub.bodies]
    outputs = [b["max_tokens"] for b in stub.bodies]
    assert all(10 <= n <= 30 for n in prompts) and all(5 <= n <= 15 for n in outputs)
    assert len(set(prompts)) > 5 and len(set(outputs)) > 3  # they vary
    assert result["summary"]["total_output_tokens"] == sum(outputs)  # the stub streams max_tokens each
    with pytest.raises(SystemExit):
        bench.main(["--base-url", stub.url, "--random-range-ratio", "1.0"])


def test_structured_fraction_asks_for_a_json_string_in_that_share(stub, tmp_path):
    run_bench(tmp_path, "--base-url", stub.url, "--model", "m", "--num-prompts", "40", "--input-len", "4",
              "--output-len", "2", "--structured-fraction", "0.5", "--skip-test-request", "--vocab-size", "50")
    asked = [b["structured_outputs"] for b in stub.bodies if "structured_outputs" in b]
    assert 10 <= len(asked) <= 30 and all(a == {"json": bench.STRUCTURED} for a in asked)


def test_structured_requests_run_to_max_tokens_against_jtp_serve(jtp_server, tmp_path):
    result = run_bench(tmp_path, "--base-url", jtp_server, "--num-prompts", "4", "--input-len", "16",
                       "--output-len", "6", "--structured-fraction", "1", "--skip-test-request")
    assert result["summary"]["completed"] == 4 and all(0 < r["output_tokens"] <= 6 for r in result["requests"])


def test_fixed_request_rate_spaces_the_starts(stub, tmp_path):
    result = run_bench(tmp_path, "--base-url", stub.url, "--model", "m", "--num-prompts", "4", "--input-len", "2",
                       "--output-len", "2", "--request-rate", "5", "--arrival", "constant", "--skip-test-request")
    starts = sorted(r["start"] for r in result["requests"])
    assert [b - a for a, b in zip(starts, starts[1:])] == pytest.approx([0.2] * 3, abs=0.08)


# ----------------------------------------------------------------------------- against jtp serve


@pytest.fixture(scope="module")
def jtp_server(tmp_path_factory):
    """`jtp serve` on the demo checkpoint, on a free port; yields its base URL once /ready says so."""
    from jtp.demo import ensure_demo_checkpoint

    model = ensure_demo_checkpoint(tmp_path_factory.mktemp("demo") / "demo-qwen3")
    env = cpu_env(1)
    proc = subprocess.Popen(
        [sys.executable, "-m", "jtp.entrypoints.cli", "serve", "--model", str(model), "--port", "0", "--no-warmup",
         "--max-num-seqs", "8", "--num-blocks", "256"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env, text=True,
    )
    url, log = None, []
    for line in proc.stderr:
        log.append(line)
        if match := re.search(r"on (http://\S+?)/v1", line):
            url = match.group(1)
            break
    assert url, "".join(log)
    threading.Thread(target=lambda: [log.append(line) for line in proc.stderr], daemon=True).start()
    deadline = time.monotonic() + 120
    while httpx.get(url + "/ready").status_code != 200:
        assert time.monotonic() < deadline and proc.poll() is None, "".join(log)
        time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(60)


def test_completions_against_jtp_serve(jtp_server, tmp_path):
    result = run_bench(tmp_path, "--base-url", jtp_server, "--num-prompts", "8", "--input-len", "32",
                       "--output-len", "8", "--max-concurrency", "4")
    s = result["summary"]
    assert (s["completed"], s["failed"]) == (8, 0)
    assert s["total_input_tokens"] == 8 * 32 and s["total_output_tokens"] == 8 * 8
    assert all(r["output_tokens"] == 8 for r in result["requests"])
    assert 0 < s["median_ttft_ms"] < s["median_e2el_ms"] and s["output_throughput"] > 0


def test_server_phases_of_the_run_against_jtp_serve(jtp_server, tmp_path):
    """The server's request phases over the timed run only (not the test request): one observation
    per request, and on the server's clock inside the client's: queue + prefill within the TTFT the
    client timed, queue + inference within its end-to-end time."""
    result = run_bench(tmp_path, "--base-url", jtp_server, "--num-prompts", "6", "--input-len", "24",
                       "--output-len", "6", "--max-concurrency", "3")
    s, phases = result["summary"], result["summary"]["server_phases_ms"]
    assert set(phases) == {"queue", "prefill", "decode", "inference"}
    assert all(ms >= 0 for ms in phases.values())
    assert phases["queue"] + phases["prefill"] <= s["mean_ttft_ms"]
    assert phases["queue"] + phases["inference"] <= s["mean_e2el_ms"]
    assert phases["inference"] == pytest.approx(phases["prefill"] + phases["decode"], rel=1e-6)


def test_compiles_during_the_run_are_counted_like_the_servers_own_counter(jtp_server, tmp_path, capsys):
    """A prompt length this server has not run yet: its step shapes compile inside the timed run (no
    test request before it), and the bench reports as many as /metrics counted around it, with a warning."""
    def compilations() -> float:
        text = httpx.get(jtp_server + "/metrics").text
        return float(re.search(r"^jtp:compilations_total\{[^}]*\} (\S+)$", text, re.M).group(1))

    before = compilations()
    result = run_bench(tmp_path, "--base-url", jtp_server, "--num-prompts", "2", "--input-len", "300",
                       "--output-len", "2", "--skip-test-request")
    counted = compilations() - before
    out = capsys.readouterr()
    assert counted > 0 and result["summary"]["server_compilations"] == counted
    assert f"compiled {int(counted)} step program(s) during the timed run" in out.err
    assert f"{'Step programs compiled during the run:':<40}{int(counted):>10}" in out.out


def test_phase_means_count_only_the_requests_between_two_reads():
    before = {"queue": (1.0, 2.0), "prefill": (0.5, 2.0)}
    after = {"queue": (4.0, 5.0), "prefill": (0.5, 2.0), "decode": (0.3, 3.0)}
    assert bench.phase_means_ms(before, after) == pytest.approx({"queue": 1000.0, "decode": 100.0})


def test_multi_turn_chat_against_jtp_serve(jtp_server, tmp_path):
    result = run_bench(tmp_path, "--base-url", jtp_server, "--endpoint", "/v1/chat/completions",
                       "--num-prompts", "2", "--multi-turn", "2", "--input-len", "12", "--output-len", "6",
                       "--skip-test-request")
    s = result["summary"]
    assert (s["completed"], s["failed"], s["total_output_tokens"]) == (4, 0, 4 * 6)
    first, second = sorted(r["prompt_tokens"] for r in result["requests"])[::3]
    assert second > first + 6  # the second turn carries the first turn and its answer
    by_turn = s["ttft_by_turn"]
    assert [(t["turn"], t["requests"]) for t in by_turn] == [(1, 2), (2, 2)]  # each conversation once a turn
    assert by_turn[1]["mean_prompt_tokens"] > by_turn[0]["mean_prompt_tokens"] + 6
    assert all(t["mean_ttft_ms"] > 0 for t in by_turn)
    # Cached tokens come from the server's usage: never the whole prompt (its last token is computed).
    assert s["cached_prompt_tokens"] == sum(r["cached_tokens"] for r in result["requests"])
    assert all(0 <= r["cached_tokens"] < r["prompt_tokens"] for r in result["requests"])


def _prompt_tokens_metric(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(float(v) for v in re.findall(r"^jtp:prompt_tokens_total\{[^}]*\} (\S+)$", text, re.M))


def test_prompt_and_cached_tokens_match_jtp_serve(jtp_server, tmp_path):
    """The bench's prompt tokens against the server's own counter, and the usage field it reads
    cached tokens from, as the server streams it."""
    before = _prompt_tokens_metric(jtp_server)
    result = run_bench(tmp_path, "--base-url", jtp_server, "--endpoint", "/v1/chat/completions",
                       "--num-prompts", "1", "--multi-turn", "3", "--input-len", "8", "--output-len", "2",
                       "--skip-test-request")
    assert _prompt_tokens_metric(jtp_server) - before == result["summary"]["prompt_tokens"] > 0
    body = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", jtp_server + "/v1/chat/completions", json=body, timeout=120) as response:
        chunks = [json.loads(line[5:]) for line in response.iter_lines()
                  if line.startswith("data:") and line != "data: [DONE]"]
    usage = chunks[-1]["usage"]
    assert isinstance(usage["prompt_tokens_details"]["cached_tokens"], int)  # the field the bench reads
    assert bench.cached_tokens(usage) == usage["prompt_tokens_details"]["cached_tokens"]
