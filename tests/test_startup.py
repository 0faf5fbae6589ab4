"""Start-up and stop of `jtp serve`: the ahead-of-time warm-up, the compilation counters on /metrics,
no compilation after /ready under a varied workload, and signals during warm-up and drain.

Real `jtp serve` subprocesses on loopback, on the demo checkpoint with small buckets (few shapes).
"""

from __future__ import annotations

import concurrent.futures
import json
import random
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import jax
import numpy as np
import pytest
from cpu_env import cpu_env
from prometheus_client.parser import text_string_to_metric_families

from jtp.config.engine_args import EngineArgs
from jtp.core.sampling_params import SamplingParams, penalty_lengths
from jtp.engine.engine import Engine
from jtp.engine.tokenizer import Tokenizer

# Small buckets: tokens 16/32, rows 4, blocks per row 1/4 (max_model_len 128, block 32).
SMALL = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, block_size=32, num_blocks=48)
WARMUP_LINE = re.compile(r"warm-up: (\d+) step shapes, (\d+) variants, (\d+) traced, (\d+) XLA programs, (\d+) of them "
                         r"from the persistent compilation cache, (\d+) loaded compiled")


class Serve:
    """`jtp serve` in a subprocess on a free port; its stderr lines are collected as they come."""

    def __init__(self, *flags: str, env: dict | None = None):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jtp.entrypoints.cli", "serve", "--port", "0", *flags],
            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env or cpu_env(1), text=True)
        self.log: list[str] = []
        self.url = None
        for line in self.proc.stderr:
            self.log.append(line)
            if match := re.search(r"on (http://\S+?)/v1", line):
                self.url = match.group(1)
                break
        if self.url is None:
            self.proc.kill()
            raise AssertionError("".join(self.log))
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()

    def text(self) -> str:
        return "".join(self.log)

    def wait_until(self, ok, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not ok():
            assert self.proc.poll() is None and time.monotonic() < deadline, self.text()[-3000:]
            time.sleep(0.05)

    def ready(self) -> None:
        self.wait_until(lambda: httpx.get(self.url + "/ready").status_code == 200)

    def metric(self, name: str) -> float:
        for family in text_string_to_metric_families(httpx.get(self.url + "/metrics").text):
            for sample in family.samples:
                if sample.name == name:
                    return sample.value
        raise AssertionError(f"{name} is not on /metrics")

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> tuple[int, float]:
        """Send `sig`; (exit status, seconds to exit)."""
        t = time.monotonic()
        self.proc.send_signal(sig)
        status = self.proc.wait(timeout)
        return status, time.monotonic() - t

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def small_flags(demo_dir) -> list[str]:
    return ["--model", str(demo_dir), *(f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items())]


# ----------------------------------------------------------------------------- the engine


@pytest.fixture
def empty_store(tmp_path):
    """An empty executable store (it lives in the compilation cache's directory), and JAX's own cache off
    (on XLA:CPU the store cannot take the executables that cache gives): a warm-up traces every program."""
    from jax._src.compilation_cache import reset_cache  # JAX decides once a process whether its cache is used

    before = jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    jax.config.update("jax_enable_compilation_cache", False)
    reset_cache()
    yield tmp_path
    jax.config.update("jax_compilation_cache_dir", before[0])
    jax.config.update("jax_enable_compilation_cache", before[1])
    reset_cache()


@pytest.mark.parametrize("steps", [1, 4], ids=["one step per call", "decode loop of 4"])
def test_ahead_of_time_warmup_gives_the_jitted_steps_results_and_compiles_nothing_after(demo_dir, monkeypatch,
                                                                                      empty_store, steps):
    monkeypatch.setenv("JTP_COMPILE_WORKERS", "2")
    prompts = [list(range(1, 2 + (i * 29) % 90)) for i in range(8)]
    params = [SamplingParams(max_tokens=12, temperature=[0.0, 0.9][i % 2], top_p=[1.0, 0.8][i // 2 % 2], seed=i,
                             ignore_eos=True) for i in range(8)]
    args = dict(model=str(demo_dir), num_scheduler_steps=steps, **SMALL)
    with Engine.from_args(EngineArgs(warmup=False, **args)) as jitted:
        expected = [r.token_ids for r in jitted.generate(prompts, params)]
    with Engine.from_args(EngineArgs(**args)) as eng:
        compiled = eng.warmup()
        report = eng.warmup_report
        assert report.finished and compiled == report.compiled == eng.runner.compilations >= report.programs
        # Each shape of the decode loop: one program per sampling variant (two). Every other shape: one
        # forward program, plus one sampling program per rows bucket and variant (five: plain, truncated,
        # logprobs, which truncates too, and a token mask, alone or with truncation and logprobs),
        # and per rows bucket one penalty variant per history length; and the one prompt-logprobs program.
        shapes = eng.scheduler.buckets.shapes()
        looped = [s for s in shapes if steps > 1 and s[2] == 1]
        apart = [s for s in shapes if s not in looped]
        rows, lengths = len({B for _, B, _ in apart}), len(penalty_lengths(SMALL["max_model_len"]))
        assert lengths == 1  # max_model_len 128: one length, the whole context
        assert compiled == 2 * len(looped) + len(apart) + rows * (5 + lengths) + 1
        assert report.variants == 2 * len(looped) + 3 * len(apart) + rows * (2 + lengths) + 1
        assert eng.runner.compile_seconds > 0
        got = [r.token_ids for r in eng.generate(prompts, params)]
        assert eng.runner.compilations == compiled, "a step compiled after the ahead-of-time warm-up"
    assert got == expected
    # A second engine of the same configuration loads every program from the store: nothing traced, same tokens.
    with Engine.from_args(EngineArgs(**args)) as again:
        assert again.warmup() == 0 and again.warmup_report.stored == again.warmup_report.programs >= report.programs
        assert [r.token_ids for r in again.generate(prompts, params)] == expected
        assert again.runner.compilations == 0, "a step compiled after a warm-up from the executable store"


def test_a_dense_model_on_the_reference_path_ignores_the_tokens_per_row_bound(demo_dir):
    """What lets its buckets drop that dimension (uses_row_len_bound False): the same program for any bound."""
    from jtp.core.sampling_params import pack_sampling
    from jtp.core.step_input import StepInput

    with Engine.from_args(EngineArgs(model=str(demo_dir), warmup=False, **SMALL)) as eng:
        assert not eng.runner.uses_row_len_bound
        assert {q for _, _, q in eng.scheduler.buckets.shapes()} == {1, 16, 32}  # 1, or the step's tokens
        B = eng.scheduler.buckets.rows[-1]
        sampling = pack_sampling([SamplingParams(temperature=1.0)] * B, B, [0] * B, [0] * B)
        texts = {q: [lowered.as_text() for _, lowered in
                     eng.runner.lower(StepInput(eng.scheduler.padding_plan(32, B, q), sampling))]
                 for q in (4, 32)}
        assert texts[4] == texts[32]


# ----------------------------------------------------------------------------- jtp serve


def _request(url: str, tokenizer, rng: random.Random, prefixes: list[str], penalties: bool) -> dict:
    """One random completion request: prompt length, output length, greedy or seeded sampling (top-p
    or not), logprobs (of the echoed prompt too) or prompt logprobs or not, stop strings, n, structured
    outputs or not, and a prompt that repeats an earlier one's prefix (a prefix-cache hit) or not; with
    `penalties`, penalties too."""
    words = "the cat sat on a mat and then it ran to see what the dog did".split()
    prompt = " ".join(rng.choice(words) for _ in range(rng.randint(1, 20)))
    if rng.random() < 0.4:
        prompt = rng.choice(prefixes) + " " + prompt
    room = SMALL["max_model_len"] - len(tokenizer.encode(prompt))
    assert room > 1, prompt
    body = {"prompt": prompt, "max_tokens": rng.randint(1, min(24, room)), "n": rng.choice([1, 1, 2]),
            "stream": rng.random() < 0.5}
    if rng.random() < 0.5:
        body.update(temperature=rng.choice([0.7, 1.0]), seed=rng.randint(0, 99), top_p=rng.choice([1.0, 0.9]))
    else:
        body["temperature"] = 0.0
    if rng.random() < 0.3:
        body["stop"] = [rng.choice(words)]
    if rng.random() < 0.3:
        body["logprobs"] = rng.randint(0, 5)
        body["echo"] = rng.random() < 0.5  # the prompt's logprobs too: the prompt-logprobs program
    elif rng.random() < 0.15 and not body["stream"]:
        body["prompt_logprobs"] = rng.randint(0, 3)
    if rng.random() < 0.2:  # structured outputs: a token mask in the step
        body["structured_outputs"] = rng.choice([{"regex": "[a-z ]{1,40}"}, {"choice": ["yes", "no"]}])
    if penalties and rng.random() < 0.4:
        body[rng.choice(["presence_penalty", "frequency_penalty", "repetition_penalty"])] = 1.2
    r = httpx.post(url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return body


def _workload(serve: Serve, demo_dir, penalties: bool) -> list[dict]:
    prefixes = [" ".join(["a long shared prefix of words"] * k) for k in (3, 4)]  # a block or more
    tokenizer = Tokenizer.from_dir(demo_dir)
    hits = serve.metric("jtp:prefix_cache_hits_total")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        bodies = list(pool.map(lambda i: _request(serve.url, tokenizer, random.Random(i), prefixes, penalties), range(40)))
    assert any(b["n"] > 1 for b in bodies) and any("seed" in b for b in bodies) and any("stop" in b for b in bodies)
    assert any(b.get("logprobs") for b in bodies) and any("structured_outputs" in b for b in bodies)
    assert any(b.get("echo") for b in bodies) and any("prompt_logprobs" in b for b in bodies)
    assert serve.metric("jtp:prefix_cache_hits_total") > hits
    return bodies


@pytest.fixture(scope="module")
def warmed(demo_dir, tmp_path_factory):
    """`jtp serve` with the small buckets, warmed up from a fresh cache: (it, the warm-up line's numbers)."""
    cache = tmp_path_factory.mktemp("xla")
    serve = Serve(*small_flags(demo_dir), "--compile-cache-dir", str(cache))
    try:
        serve.ready()
        match = WARMUP_LINE.search(serve.text())
        assert match, serve.text()
        # The suite's JAX_COMPILATION_CACHE_MAX_SIZE=-1 stands over the CLI's bound: no lock (see conftest.py).
        assert any(cache.iterdir()) and not (cache / ".lockfile").exists()
        yield serve, tuple(map(int, match.groups()))
        status, seconds = serve.stop()
        assert status == 0 and seconds < 10, serve.text()[-2000:]
    finally:
        serve.kill()


def test_serve_compiles_nothing_after_ready_under_a_random_workload(warmed, demo_dir):
    serve, (shapes, variants, compiled, programs, hits, stored) = warmed
    assert variants > 3 * shapes and compiled >= programs > 0 and hits == stored == 0  # a fresh cache: all compiled
    assert serve.metric("jtp:compilation_seconds_total") > 0
    before = serve.metric("jtp:compilations_total")
    _workload(serve, demo_dir, penalties=False)
    after = serve.metric("jtp:compilations_total")
    assert after == before, f"{after - before} step programs compiled after /ready"


def test_penalties_compile_nothing_after_ready(warmed, demo_dir):
    serve, _ = warmed
    before = serve.metric("jtp:compilations_total")
    _workload(serve, demo_dir, penalties=True)
    after = serve.metric("jtp:compilations_total")
    assert after == before, f"{after - before} step programs compiled after /ready"


def test_two_jtp_warmups_share_a_fresh_cache_and_a_server_then_loads_every_program(demo_dir, tmp_path):
    cache = tmp_path / "xla"
    command = [sys.executable, "-m", "jtp.entrypoints.cli", "warmup", *small_flags(demo_dir), "--compile-cache-dir",
               str(cache)]
    env = cpu_env(1)
    del env["JAX_COMPILATION_CACHE_MAX_SIZE"]  # the CLI's own bound, as shipped (the suite runs without one)
    procs = [subprocess.Popen(command, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
             for _ in range(2)]  # at once: both write and read the same entries
    logs = [p.communicate(timeout=600)[1] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
        assert "persistent compilation cache entry" not in log, log[-3000:]  # JAX's warning for a bad entry
    assert (cache / ".lockfile").exists()  # JAX locks every read and write (it does only with a size bound)
    first = [WARMUP_LINE.search(log) for log in logs]
    assert all(first), logs
    serve = Serve(*small_flags(demo_dir), "--compile-cache-dir", str(cache))
    try:
        serve.ready()
        match = WARMUP_LINE.search(serve.text())
        # the warm-ups' shapes and variants; every program loaded compiled, none traced (one file a key:
        # two keys the warm-ups found to share a program are two here)
        shapes, variants, traced, programs, hits, stored = map(int, match.groups()) if match else [0] * 6
        assert (shapes, variants) == tuple(map(int, first[0].group(1, 2))), serve.text()
        assert traced == hits == 0 and stored == programs >= int(first[0].group(4)) > 0, serve.text()
        assert "persistent compilation cache entry" not in serve.text()
    finally:
        serve.kill()


@pytest.mark.parametrize("sig,status", [(signal.SIGTERM, 0), (signal.SIGINT, 130)])
def test_a_stop_during_warm_up_exits_within_2_s_quietly(demo_dir, tmp_path, sig, status):
    # The server's default buckets and an empty cache: warm-up takes minutes on a CPU.
    serve = Serve("--model", str(demo_dir), "--compile-cache-dir", str(tmp_path / "xla"))
    try:
        serve.wait_until(lambda: serve.metric("jtp:compilations_total") >= 2)
        assert httpx.get(serve.url + "/ready").status_code == 503
        got, seconds = serve.stop(sig)
        assert got == status and seconds < 2.0, (seconds, serve.text()[-2000:])
        assert "Traceback" not in serve.text() and "Error" not in serve.text(), serve.text()[-2000:]
    finally:
        serve.kill()


def test_ctrl_c_during_jtp_warmup_exits_130_within_2_s_quietly(demo_dir, tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "jtp.entrypoints.cli", "warmup", "--model", str(demo_dir),
                             "--compile-cache-dir", str(tmp_path / "xla")], env=cpu_env(1), stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True)
    try:
        seen = ""
        while "warm-up: compiling step shapes:   0%" not in seen:  # the progress bar: compile threads busy
            char = proc.stderr.read(1)
            assert char, seen  # the process ended before its warm-up began
            seen += char
        time.sleep(3)
        t = time.monotonic()
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=30)[1]
        assert proc.returncode == 130 and time.monotonic() - t < 2.0, seen + rest
        assert "Traceback" not in rest and "terminate called" not in rest, rest  # XLA aborting under its threads
    finally:
        proc.kill()


def _stream(url: str, body: dict, on_first=None) -> list:
    """The data events of a streamed completion ([DONE] as the string)."""
    events = []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
            if on_first is not None and len(events) == 1:
                on_first()
    return events


def _sigterm_then_knock(serve: Serve, seen: dict) -> None:
    """SIGTERM, then what a new client gets while the running stream drains."""
    serve.proc.send_signal(signal.SIGTERM)
    serve.wait_until(lambda: httpx.get(serve.url + "/health").json()["status"] == "draining", timeout=10)
    refused = httpx.post(serve.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4})
    seen.update(status=refused.status_code, retry_after=refused.headers.get("retry-after"), body=refused.json(),
                ready=httpx.get(serve.url + "/ready").status_code)


def test_drain_finishes_running_streams_then_exits_and_cuts_the_rest_with_an_error(demo_dir):
    # A context long enough for a stream still running when the signal lands (a decode step on the
    # demo takes a few ms): the pool's 48 blocks of 32 tokens, one request.
    long_context = "--max-model-len=1536"
    serve = Serve(*small_flags(demo_dir), long_context, "--no-warmup", "--drain-timeout", "60")
    try:
        serve.ready()
        body = {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True, "temperature": 0}
        seen: dict = {}
        events = _stream(serve.url, body, on_first=lambda: _sigterm_then_knock(serve, seen))
        ended = time.monotonic()
        # While draining the port stays open: a new request is refused in the API's error shape.
        assert seen["status"] == 503 and seen["retry_after"] == "1" and seen["ready"] == 503, seen
        assert seen["body"]["error"]["code"] == "server_shutting_down", seen
        assert seen["body"]["error"]["type"] == "service_unavailable_error", seen
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length", events[-3:]
        assert sum(len(e["choices"]) for e in events[:-1] if e["choices"][0]["text"]) > 0
        assert serve.proc.wait(30) == 0
        assert time.monotonic() - ended < 5, "the server waited after its last request finished"
    finally:
        serve.kill()
    serve = Serve(*small_flags(demo_dir), long_context, "--no-warmup", "--drain-timeout", "0")
    try:
        serve.ready()
        body = {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True, "temperature": 0}
        events = _stream(serve.url, body, on_first=lambda: serve.proc.send_signal(signal.SIGTERM))
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == "server_shutting_down", events[-3:]
        assert all(e["choices"][0]["finish_reason"] in (None, "length") for e in events[:-2]), events
        assert serve.proc.wait(30) == 0
    finally:
        serve.kill()


def test_serve_help_shows_the_drain_timeout_default_and_the_cache_flag():
    out = subprocess.run([sys.executable, "-m", "jtp.entrypoints.cli", "serve", "--help"], env=cpu_env(1),
                         capture_output=True, text=True, timeout=60).stdout
    assert re.search(r"--drain-timeout DRAIN_TIMEOUT\s+on SIGTERM.*\(default: 30\)", out, re.S), out
    assert "--compile-cache-dir DIR" in out


def test_the_executable_store_keys_by_context_and_turns_an_unreadable_file_into_a_compile(empty_store):
    """A stored program runs as the jitted one does; another context is another file; a truncated
    file is a miss that compiles again and rewrites it."""
    from jtp.worker.executable_store import ExecutableStore, StoredProgram, build_context

    devices = jax.devices()[:1]
    fn = jax.jit(lambda a, b: a @ b + 1.0)
    x = jax.numpy.arange(16.0).reshape(4, 4)
    lower = lambda: fn.lower(x, x)  # noqa: E731
    tmp_path = empty_store / "store"
    store = ExecutableStore(tmp_path, build_context(devices, ("cfg", 1), (x,)), tuple(devices))
    key = ("forward", (4, 4))
    assert not store.has(key) and store.load(key) is None
    store.save(key, lower().compile())
    assert store.has(key) and np.array_equal(store.load(key)(x, x), fn(x, x))
    other = ExecutableStore(tmp_path, build_context(devices, ("cfg", 2), (x,)), tuple(devices))
    assert not other.has(key)  # a changed static setting: another key
    (path,) = tmp_path.iterdir()
    path.write_bytes(path.read_bytes()[:100])
    compiled = StoredProgram(store, key, lower).compile()
    assert np.array_equal(compiled(x, x), fn(x, x)) and np.array_equal(store.load(key)(x, x), fn(x, x))
