"""Attacks on the HTTP server (issue 25), each reproduced against a real uvicorn server on loopback.

One client must never stall the others: oversized or over-complex bodies, text longer than the
context could hold, slow or half-open connections, too many requests at once, stop-string and
chat-template costs. Each attack gets a clear error in the OpenAI shape (or a closed socket),
/health keeps answering in milliseconds, and the server serves normally afterwards.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import json
import random
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
import types

import httpx
import loopback
import pytest
from cpu_env import cpu_env
from scripted_engine import ScriptedEngine

from jtp.config.engine_args import EngineArgs
from jtp.core.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS, SamplingParams
from jtp.demo import ensure_demo_checkpoint
from jtp.engine.engine import Engine
from jtp.engine.stop_strings import StopMatcher
from jtp.engine.tokenizer import Tokenizer
from jtp.entrypoints.server import build_app
from jtp.entrypoints.server.connections import header_timeout_protocol
from jtp.entrypoints.server.limits import ServerLimits

DENSE_ARGS = dict(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128, block_size=32, num_blocks=32,
                  warmup=False)
LIMITS = ServerLimits(max_request_bytes=1 << 20, body_timeout=1.0, header_timeout=0.5, keep_alive_timeout=1.0,
                      limit_concurrency=4, chat_template_timeout=0.5)
KEY = "clé-ü-🔑"  # non-ASCII on purpose: compared as the UTF-8 bytes a client sends


@contextlib.contextmanager
def serving(app, limits: ServerLimits = LIMITS):
    """The loopback server configured as `jtp serve` configures uvicorn; yields the URL."""
    with loopback.serving(app, http=header_timeout_protocol(limits.header_timeout),
                          timeout_keep_alive=limits.keep_alive_timeout) as url:
        yield url


def assert_error(r: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    return error


@pytest.fixture(scope="module")
def dense():
    args = EngineArgs(**DENSE_ARGS)
    engine = Engine.from_args(args)
    engine.start()
    engine.ready.set()  # no warm-up: each test compiles only the shapes it uses
    try:
        with serving(build_app(engine, args.model_name(), api_key=KEY, limits=LIMITS)) as url:
            yield types.SimpleNamespace(engine=engine, url=url, model=args.model_name())
    finally:
        engine.close()


def post(served, path: str, body=None, content: bytes | None = None, timeout: float = 60, **headers):
    headers = {"Authorization": f"Bearer {KEY}".encode(), **headers}
    return httpx.post(served.url + path, json=body, content=content, headers=headers, timeout=timeout)


def greedy(served, prompt: str, max_tokens: int = 8) -> str:
    r = post(served, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                         "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def kv_in_use(engine) -> int:
    return engine.pool.total_blocks - engine.pool.num_free_blocks


def settles(check, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return False


# ----------------------------------------------------------------------------- bounded intake


def test_oversized_bodies_are_413_unread(dense):
    solo = greedy(dense, "Hello, world")
    big = b'{"prompt": "' + b"x" * (2 << 20) + b'"}'
    assert_error(post(dense, "/v1/completions", content=big), 413, "request_too_large")

    def chunks():  # no Content-Length: the limit is counted as the body streams in
        for _ in range(40):
            yield b"x" * 65536

    r = httpx.post(dense.url + "/v1/completions", content=chunks(), timeout=30,
                   headers={"Authorization": f"Bearer {KEY}".encode()})
    assert_error(r, 413, "request_too_large")
    assert greedy(dense, "Hello, world") == solo


def test_text_that_can_never_fit_is_400_before_tokenizing(dense):
    text = "hello " * 150_000  # 900 kB: under the body limit, ~1000 x what 128 tokens can hold
    t = time.perf_counter()
    assert_error(post(dense, "/v1/completions", {"prompt": text}), 400, "context_length_exceeded")
    assert_error(post(dense, "/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}), 400,
                 "context_length_exceeded")
    assert time.perf_counter() - t < 2.0  # tokenizing 900 kB alone takes ~1 s here
    assert_error(post(dense, "/v1/completions", {"prompt": [5] * 128}), 400, "context_length_exceeded")
    # Bodies whose parsing alone would hold the GIL for long are refused from the raw bytes.
    assert_error(post(dense, "/v1/completions", content=b'{"prompt": [' + b"[]," * 30000 + b"[]]}"), 400,
                 "request_too_complex")
    assert_error(post(dense, "/v1/completions", content=b'{"prompt": [' + b"1," * 200_000 + b"1]}"), 400,
                 "request_too_complex")


# The bound on one /health round trip while a hostile request is processed: a request that held the
# GIL (a long C call) would show as seconds; below this is the scheduling noise of two cores shared
# with other test processes' XLA compiles (0.19 s seen once under `pytest -n 3`).
HEALTH_LATENCY_BOUND = 0.5


def health_latencies(url: str, busy: threading.Event) -> list[float]:
    """/health round trips (seconds) while `busy` is set, one every 10 ms, and at least one (the busy
    request may end before the first probe on a loaded machine). Each probe on a new connection: the
    server closes an idle keep-alive one after LIMITS' 1 s, and a probe thread descheduled that long
    on a loaded machine would race the close (a reset, not a slow answer)."""
    out = []
    with httpx.Client(timeout=10, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        client.get(url + "/health")
        while True:
            t = time.perf_counter()
            assert client.get(url + "/health").status_code == 200
            out.append(time.perf_counter() - t)
            if not busy.is_set():
                return out
            time.sleep(0.01)


def test_health_answers_in_milliseconds_while_big_requests_are_processed(dense):
    solo = greedy(dense, "The quick brown fox", 16)
    bodies = [
        b'{"prompt": "' + b"hello " * 170_000 + b'"}',  # ~1 MB of text: parsed, then refused by length
        b'{"messages": [' + b'{"role": "user", "content": "hi"},' * 16000 + b'{"role": "user"}]}',
        b'{"prompt": [' + b"[]," * 300_000 + b"[]]}",  # 900 kB of nested lists: refused from the bytes
    ]
    busy = threading.Event()
    busy.set()
    statuses = []

    def attack():
        try:
            with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {KEY}".encode()}) as client:
                for body in itertools.islice(itertools.cycle(bodies), 30):
                    statuses.append(client.post(dense.url + "/v1/completions", content=body).status_code)
        finally:
            busy.clear()

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        attacker = pool.submit(attack)
        latencies = health_latencies(dense.url, busy)
        attacker.result()
    assert set(statuses) == {400}, statuses
    assert len(latencies) >= 5
    print(f"/health during attack: n={len(latencies)} median={statistics.median(latencies) * 1e3:.1f} ms "
          f"max={max(latencies) * 1e3:.1f} ms")
    assert max(latencies) < HEALTH_LATENCY_BOUND, latencies
    assert greedy(dense, "The quick brown fox", 16) == solo
    assert settles(lambda: kv_in_use(dense.engine) == 0)


# ----------------------------------------------------------------------------- bounds and stop strings


def naive_cut(text: str, stops: list[str]) -> int | None:
    """Where the output ends: at the first character that completes a stop string, cut before the
    longest one ending there."""
    for end in range(1, len(text) + 1):
        lengths = [len(s) for s in stops if s and text.endswith(s, 0, end)]
        if lengths:
            return end - max(lengths)
    return None


def test_stop_matcher_equals_the_naive_reference_on_random_text():
    rng = random.Random(0)
    for _ in range(200):
        alphabet = "abc" if rng.random() < 0.5 else "abcdefgh"
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 64))]
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 300)))
        matcher, fed, got = StopMatcher(stops), 0, None
        while fed < len(text) and got is None:  # in random pieces, as tokens arrive
            piece = text[fed:fed + rng.randint(1, 5)]
            got = matcher.feed(piece)
            fed += len(piece)
            if got is None:  # what is held back is exactly what could still start a match
                assert all(not any(s.startswith(text[k:fed]) for s in stops) for k in range(fed - matcher.pending))
        assert got == naive_cut(text, stops), (stops, text)


def test_bounds_on_n_stop_and_logprobs_are_400s(dense):
    base = {"prompt": "Hi", "max_tokens": 2}
    assert_error(post(dense, "/v1/completions", {**base, "n": 129}), 400, param="n")
    assert_error(post(dense, "/v1/completions", {**base, "stop": ["x"] * (MAX_STOP_STRINGS + 1)}), 400, param="stop")
    assert_error(post(dense, "/v1/completions", {**base, "stop": ["x" * (MAX_STOP_CHARS + 1)]}), 400, param="stop")
    assert_error(post(dense, "/v1/completions", {**base, "logprobs": 21}), 400, param="logprobs")
    assert_error(post(dense, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                      "logprobs": True, "top_logprobs": 21}), 400)


def stream_gaps(served, prompt: str, max_tokens: int) -> tuple[str, list[float]]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    text, gaps, last = [], [], None
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}".encode()}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
                text.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(text), gaps


def test_many_stop_strings_cut_correctly_and_do_not_slow_other_streams(dense):
    prompt, n_tokens = "Once upon a time", 60
    full = greedy(dense, prompt, n_tokens)
    rng = random.Random(1)
    # The most stop strings allowed, all as long as allowed; one of them occurs in the output.
    target = full[20:24]
    length = MAX_STOP_CHARS // MAX_STOP_STRINGS
    stops = ["".join(rng.choice("qzjxkvw") for _ in range(length)) for _ in range(MAX_STOP_STRINGS - 1)] + [target]
    r = post(dense, "/v1/completions", {"prompt": prompt, "max_tokens": n_tokens, "temperature": 0,
                                        "ignore_eos": True, "stop": stops})
    assert r.json()["choices"][0]["text"] == full[:naive_cut(full, stops)]
    assert r.json()["choices"][0]["finish_reason"] == "stop"

    other_prompt = "The capital of France is"
    solo_text, _ = stream_gaps(dense, other_prompt, n_tokens)

    def beside(stop: list[str]) -> list[float]:
        """Another stream's inter-token gaps beside 6 sampled choices with these stop strings."""
        loaded = {"prompt": prompt, "max_tokens": n_tokens, "temperature": 1.0, "ignore_eos": True, "n": 6,
                  "stop": stop}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            load = pool.submit(post, dense, "/v1/completions", loaded)
            text, gaps = stream_gaps(dense, other_prompt, n_tokens)
            assert load.result().status_code == 200
        assert text == solo_text
        return gaps

    # The same six rows with no stop string: what the larger batch costs by itself (a step of 8
    # rows, not the lone row's), the yardstick for what the stop strings add.
    plain = beside([])
    gaps = beside(stops[:-1])  # never matches: every token of every choice runs the matcher
    print(f"inter-token gap beside 6 choices: no stop strings {statistics.median(plain) * 1e3:.2f} ms, "
          f"{MAX_STOP_STRINGS} stop strings {statistics.median(gaps) * 1e3:.2f} ms")
    # 64 stop strings per row must not make the other stream's steps slower.
    assert statistics.median(gaps) < 1.5 * statistics.median(plain) + 0.005


# ----------------------------------------------------------------------------- connection hygiene


def test_slowloris_sockets_are_closed_and_others_are_served(dense):
    solo = greedy(dense, "Hello, world")
    host, port = dense.url.removeprefix("http://").split(":")
    baseline = loopback.open_fds()
    slow = []
    for i in range(60):
        s = socket.create_connection((host, int(port)))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" if i % 2 else b"GET /hea")
        slow.append(s)
    assert greedy(dense, "Hello, world") == solo  # served while the partial requests hang
    t = time.perf_counter()
    assert all(loopback.closed_by_peer(s, 5) for s in slow)
    assert time.perf_counter() - t < LIMITS.header_timeout + 2
    # Complete headers, then a body that never finishes: a 408 in the OpenAI shape after body_timeout.
    s = socket.create_connection((host, int(port)))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
    s.settimeout(5)
    reply = b""
    while b"}}" not in reply:
        chunk = s.recv(4096)
        assert chunk, reply
        reply += chunk
    assert reply.startswith(b"HTTP/1.1 408") and b'"request_timeout"' in reply
    # An idle keep-alive connection is closed after keep_alive_timeout.
    idle = socket.create_connection((host, int(port)))
    idle.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert idle.recv(4096).startswith(b"HTTP/1.1 200")
    assert loopback.closed_by_peer(idle, LIMITS.keep_alive_timeout + 2)
    for sock in (*slow, s, idle):
        sock.close()
    assert settles(lambda: loopback.open_fds() <= baseline)
    assert greedy(dense, "Hello, world") == solo


def test_past_the_concurrency_limit_is_a_clear_503(dense, monkeypatch):
    dispatch = dense.engine.runner.dispatch

    def slow_dispatch(step_input):
        time.sleep(0.02)  # keeps the first requests in flight while the next arrives
        return dispatch(step_input)

    monkeypatch.setattr(dense.engine.runner, "dispatch", slow_dispatch)
    body = {"prompt": "Hello", "max_tokens": 30, "temperature": 0, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(LIMITS.limit_concurrency) as pool:
        held = [pool.submit(post, dense, "/v1/completions", body) for _ in range(LIMITS.limit_concurrency)]
        assert settles(lambda: dense.engine.stats().num_running == LIMITS.limit_concurrency)
        r = post(dense, "/v1/completions", body)
        assert_error(r, 503, "too_many_requests_in_flight")
        assert int(r.headers["Retry-After"]) >= 1
        assert httpx.get(dense.url + "/health").status_code == 200  # health checks are never limited
        assert all(f.result().status_code == 200 for f in held)
    monkeypatch.undo()
    assert post(dense, "/v1/completions", body).status_code == 200


# ----------------------------------------------------------------------------- chat templates

HOSTILE_TEMPLATE = (
    "{% set c = messages[0]['content'] %}"
    "{% if c == 'loop' %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    "{% elif c == 'big' %}{{ 'x' * 300000000 }}"
    "{% elif c == 'long' %}{% for i in range(100000) %}{{ 'abcdefghij' }}{% endfor %}"
    "{% else %}<|im_start|>user\n{{ c }}<|im_end|>\n<|im_start|>assistant\n{% endif %}"
)


def checkpoint_with_template(tmp_path, template: str):
    path = tmp_path / "ckpt"
    shutil.copytree(ensure_demo_checkpoint(), path)
    (path / "chat_template.jinja").write_text(template)
    return path


def test_hostile_chat_templates_are_400s_and_health_stays_fast(tmp_path):
    tokenizer = Tokenizer.from_dir(checkpoint_with_template(tmp_path, HOSTILE_TEMPLATE))
    app = build_app(ScriptedEngine(tokenizer, max_model_len=128), "hostile", limits=LIMITS)
    with serving(app) as url:
        served = types.SimpleNamespace(url=url)

        def chat(content: str) -> httpx.Response:
            return httpx.post(url + "/v1/chat/completions", timeout=30,
                              json={"messages": [{"role": "user", "content": content}]})

        busy = threading.Event()
        busy.set()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            def loop_then_done():
                try:
                    return chat("loop")
                finally:
                    busy.clear()

            looping = pool.submit(loop_then_done)
            latencies = health_latencies(served.url, busy)
            t = time.perf_counter()
            error = assert_error(looping.result(), 400, "chat_template_limit")
            assert "time limit" in error["message"]
        assert max(latencies) < HEALTH_LATENCY_BOUND, latencies
        t = time.perf_counter()
        assert_error(chat("big"), 400, "chat_template_limit")
        assert time.perf_counter() - t < 1.0
        assert_error(chat("long"), 400, "context_length_exceeded")
        r = chat("Hello")
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"


def test_a_long_text_under_the_character_bound_is_counted_in_pieces():
    # A long context makes the character bound loose (here 100k tokens x 13 x 4 characters): a 3 MB
    # text passes it, and must be refused without one multi-second, GIL-holding encode.
    engine = ScriptedEngine(Tokenizer.from_dir(ensure_demo_checkpoint()), max_model_len=100_000)
    limits = ServerLimits(max_request_bytes=8 << 20)
    with serving(build_app(engine, "long", limits=limits), limits) as url:
        busy = threading.Event()
        busy.set()

        def long_prompt():
            try:
                return httpx.post(url + "/v1/completions", json={"prompt": "hello " * 500_000}, timeout=60)
            finally:
                busy.clear()

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            refused = pool.submit(long_prompt)
            latencies = health_latencies(url, busy)
            assert_error(refused.result(), 400, "context_length_exceeded")
        print(f"/health beside a 3 MB prompt: n={len(latencies)} max={max(latencies) * 1e3:.1f} ms")
        assert max(latencies) < HEALTH_LATENCY_BOUND, latencies
        ok = httpx.post(url + "/v1/completions", json={"prompt": "hello " * 20_000}, timeout=60)  # 120 kB: fits
        assert ok.status_code == 200, ok.text


def test_bodies_of_many_clients_together_are_bounded(tmp_path):
    limits = ServerLimits(max_request_bytes=1 << 20, max_buffered_bytes=2 << 20, body_timeout=5.0, header_timeout=5.0)
    app = build_app(ScriptedEngine(Tokenizer.from_dir(ensure_demo_checkpoint()), max_model_len=128), "t", limits=limits)
    with serving(app, limits) as url:
        host, port = url.removeprefix("http://").split(":")
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000000\r\n\r\n"
        held = []
        for _ in range(2):  # two bodies of 800 kB each, still arriving
            s = socket.create_connection((host, int(port)))
            s.sendall(head + b" " * 800_000)
            held.append(s)
        time.sleep(0.3)
        third = socket.create_connection((host, int(port)), timeout=5)
        third.sendall(head + b" " * 800_000)
        reply = b""
        while b"server_busy" not in reply and (chunk := third.recv(4096)):  # headers and body may come apart
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 503") and b"server_busy" in reply, reply[:300]
        for s in (*held, third):
            s.close()
        time.sleep(0.3)
        r = httpx.post(url + "/v1/completions", json={"prompt": "x" * 900_000}, timeout=10)
        assert_error(r, 400, "context_length_exceeded")  # the budget was given back: a 900 kB body is read


def run_jtp(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jtp.entrypoints.cli", *args], capture_output=True, text=True,
                          env={**cpu_env(1), **(env or {})}, timeout=timeout)


def test_a_template_that_fails_its_probe_render_stops_start_up_in_one_line(tmp_path):
    path = checkpoint_with_template(tmp_path, "{% for i in range(100000) %}{% for j in range(100000) %}"
                                              "{% endfor %}{% endfor %}")
    done = run_jtp("serve", "--model", str(path), "--port", "0", "--no-warmup", "--chat-template-timeout", "0.3",
                   *(f"--{k.replace('_', '-')}={v}" for k, v in DENSE_ARGS.items() if k != "warmup"))
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "time limit of 0.3 s" in last and "Traceback" not in done.stderr, done.stderr[-2000:]


# ----------------------------------------------------------------------------- small ones


def test_lone_surrogates_are_400s(dense):
    body = json.dumps({"prompt": "abc\ud800def", "max_tokens": 2}).encode()  # JSON allows the escape
    error = assert_error(post(dense, "/v1/completions", content=body), 400, param="prompt")
    assert "surrogate" in error["message"]
    chat = json.dumps({"messages": [{"role": "user", "content": "hi \udc00"}], "max_tokens": 2}).encode()
    assert "surrogate" in assert_error(post(dense, "/v1/chat/completions", content=chat), 400)["message"]
    assert greedy(dense, "Hello, world")


def raw_status(url: str, request: bytes) -> int:
    """The status of a request sent byte for byte (clients refuse to send some headers as they are)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(request)
        return int(s.recv(4096).split(b" ", 2)[1])


def test_api_key_bytes_empty_tokens_and_empty_keys(dense):
    body = {"prompt": "Hi", "max_tokens": 1}
    assert post(dense, "/v1/completions", body).status_code == 200  # the UTF-8 key matches
    for auth in (b"Bearer ", b"Bearer", b"bearer  ", b"Bearer \t", b"Bearer " + KEY.encode()[:-1], KEY.encode()):
        assert raw_status(dense.url, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: " + auth
                          + b"\r\nConnection: close\r\n\r\n") == 401, auth
    for args, env in (((("--api-key", ""),), {}), ((), {"JTP_API_KEY": ""}), ((("--api-key", "  "),), {})):
        done = run_jtp("serve", "--port", "0", *itertools.chain(*args), env=env, timeout=60)
        assert done.returncode != 0 and "is empty" in done.stderr.strip().splitlines()[-1], done.stderr[-2000:]
    help_text = run_jtp("serve", "--help").stdout
    assert "JTP_API_KEY" in help_text and "--limit-concurrency" in help_text and "--header-timeout" in help_text


def test_sampling_params_refuse_too_many_stop_strings():
    with pytest.raises(ValueError, match="at most"):
        SamplingParams(stop=["a"] * (MAX_STOP_STRINGS + 1)).validate()
    with pytest.raises(ValueError, match="at most"):
        SamplingParams(stop=["a" * (MAX_STOP_CHARS + 1)]).validate()


def test_limits_must_be_positive():
    from jtp.entrypoints.server import ServerArgs
    from jtp.errors import ConfigError

    with pytest.raises(ConfigError, match="--limit-concurrency 0"):
        ServerArgs(limit_concurrency=0).validate()
    with pytest.raises(ConfigError, match="--header-timeout -1"):
        ServerArgs(header_timeout=-1).validate()
    ServerArgs().validate()
