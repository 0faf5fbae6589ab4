"""The OpenAI-compatible HTTP API against live uvicorn servers on loopback.

Two real engines serve through `build_app`: the demo checkpoint (dense Qwen3) and a tiny
Qwen3.5 hybrid with the demo's tokenizer (behind an API key, with a tiny waiting queue for the
429 case). The real `openai` client and raw SSE over httpx check that greedy text equals the
engine's own output both ways, and every error case returns its status and OpenAI-shaped body
while the server keeps serving. Engines skip warm-up (`ready` is set by hand) so a run compiles
only the shapes the tests use.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import openai
import pytest
from cpu_env import cpu_env
from loopback import serving
from prometheus_client.parser import text_string_to_metric_families
from scripted_engine import ScriptedEngine

from jtp.config.engine_args import EngineArgs
from jtp.core.sampling_params import SamplingParams
from jtp.engine.engine import Engine
from jtp.entrypoints.server import build_app
from jtp.entrypoints.server.errors import APIError
from jtp.entrypoints.server.protocol import (
    parse_chat_request,
    parse_completion_request,
    sampling_params,
)
from jtp.entrypoints.server.reasoning import Qwen3ReasoningParser, think_first

# Small buckets keep the shapes compiled in a run few (large blocks: few blocks-per-row buckets).
DENSE_ARGS = dict(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128, block_size=32, num_blocks=32,
                  warmup=False)
HYBRID_ARGS = dict(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64, block_size=64, num_blocks=4,
                   max_waiting_requests=2, warmup=False)
API_KEY = "test-key"
PROMPTS = ["Hello, world", "The capital of France is", "Once upon a time", "A language model",
           "Numbers: 1 2 3", "The quick brown fox", "Guten Morgen", "def generate(model"]
CHAT = [{"role": "user", "content": "Hello! How are you today?"}]


# ----------------------------------------------------------------------------- serving


@dataclasses.dataclass
class Served:
    engine: object  # the serving engine, or (for a server in another process) a reference engine
    url: str
    model: str
    api_key: str | None = None
    remote: bool = False  # served by a `jtp serve` process: its pool is read from /metrics

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "unused", max_retries=0,
                             timeout=120)

    def post(self, path: str, body=None, content: bytes | None = None, headers: dict | None = None,
             timeout: float = 120) -> httpx.Response:
        return httpx.post(self.url + path, json=body, content=content, timeout=timeout,
                          headers=self.headers if headers is None else headers)

    def stream_raw(self, path: str, body: dict) -> str:
        with httpx.stream("POST", self.url + path, json={**body, "stream": True}, headers=self.headers,
                          timeout=120) as r:
            assert r.status_code == 200, r.read()
            assert r.headers["content-type"].startswith("text/event-stream")
            return r.read().decode()

    def metrics(self, **labels) -> dict[str, float]:
        """The samples of /metrics that carry `labels`, summed over their other labels, by name."""
        totals: dict[str, float] = {}
        for family in text_string_to_metric_families(httpx.get(self.url + "/metrics").text):
            for sample in family.samples:
                if labels.items() <= sample.labels.items():
                    totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
        return totals

    def kv_in_use(self) -> float:
        if self.remote:
            return self.metrics()["jtp:kv_cache_usage_perc"]
        return self.engine.pool.total_blocks - self.engine.pool.num_free_blocks

    def num_running(self) -> int:
        if self.remote:
            return int(self.metrics()["jtp:num_requests_running"])
        return self.engine.stats().num_running

    def pool_returns_to_full(self, timeout: float = 30) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.kv_in_use() == 0:
                return True
            time.sleep(0.05)
        return False

    def reference(self, prompt_ids: list[int], **params):
        """The engine's own result for a request, outside the server."""
        return self.engine.generate([prompt_ids], SamplingParams(**params))[0]

    def chat_prompt_ids(self, messages: list[dict], **template_kwargs) -> list[int]:
        tok = self.engine.tokenizer
        return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, **template_kwargs))


def parse_sse(raw: str) -> list[dict]:
    """The data events of a complete, well-formed stream: `data: {json}` blocks, then [DONE]."""
    blocks = raw.split("\n\n")
    assert blocks[-1] == "" and blocks[-2] == "data: [DONE]", raw[-200:]
    events = []
    for block in blocks[:-2]:
        assert block.startswith("data: ") and "\n" not in block, block
        events.append(json.loads(block[len("data: "):]))
    return events


def assert_openai_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code
    return error


def split_reasoning(text: str, prompt: str = "") -> tuple[str, str]:
    parser = Qwen3ReasoningParser(Qwen3ReasoningParser.prompt_ends_in_think(prompt))
    reasoning, content = parser.feed(text)
    more_reasoning, more_content = parser.finish()
    return reasoning + more_reasoning, content + more_content


def start_engine(args: EngineArgs):
    engine = Engine.from_args(args)
    engine.start()
    return engine


def start_serve(devices: int, *flags: str) -> tuple[subprocess.Popen, str, list[str]]:
    """`jtp serve` with the dense settings on a free port in a subprocess (`devices` forced CPU
    devices); returns it, its base URL and its stderr lines (collected on) once /ready answers."""
    env = cpu_env(devices)
    proc = subprocess.Popen(
        [sys.executable, "-m", "jtp.entrypoints.cli", "serve", "--port", "0", "--no-warmup", *flags,
         *(f"--{k.replace('_', '-')}={v}" for k, v in DENSE_ARGS.items() if k != "warmup")],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env, text=True)
    log: list[str] = []
    try:
        for line in proc.stderr:
            log.append(line)
            if match := re.search(r"on (http://\S+?)/v1", line):
                break
        assert match, "".join(log)
        threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True).start()
        deadline = time.monotonic() + 120
        while httpx.get(match.group(1) + "/ready").status_code != 200:
            assert time.monotonic() < deadline and proc.poll() is None, "".join(log)
            time.sleep(0.1)
    except BaseException:
        proc.kill()
        raise
    return proc, match.group(1), log


@pytest.fixture(scope="module")
def dense():
    args = EngineArgs(**DENSE_ARGS)
    engine = start_engine(args)
    engine.ready.set()  # no warm-up: each test compiles only the shapes it uses
    try:
        with serving(build_app(engine, args.model_name(), reasoning_parser="qwen3")) as url:
            yield Served(engine, url, args.model_name())
    finally:
        engine.close()


def serve_group(dense, *flags: str):
    """`jtp serve --num-processes 2 FLAGS` (2 forced CPU devices each) with the dense settings; the
    one-process `dense` engine is the reference its answers must equal. Drains on SIGTERM at the end."""
    proc, url, log = start_serve(2, "--reasoning-parser", "qwen3", "--num-processes", "2", *flags)
    try:
        yield Served(dense.engine, url, dense.model, remote=True)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, "".join(log[-50:])
    finally:
        proc.kill()


@pytest.fixture(scope="module")
def dense_group(dense):
    """A tp=4 group over two processes."""
    yield from serve_group(dense, "--tensor-parallel-size", "4")


# (Data-parallel replicas and pipeline stages serve the openai client in test_data_parallel and
# test_pipeline_parallel / test_launcher: on a loaded CI machine the disconnect test here could not
# catch their 120-token request running.)
SERVED = {"one process": "dense", "2 processes x 2 devices": "dense_group"}


@pytest.fixture(scope="module", params=[
    "one process", *(pytest.param(name, marks=pytest.mark.distributed) for name in list(SERVED)[1:])])
def served(request):
    """The OpenAI-client tests run against one process and against a two-process tp=4 group; the
    one-process engine is every reference."""
    return request.getfixturevalue(SERVED[request.param])


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    pytest.importorskip("torch")
    import transformers
    from hf_hybrid import COMMON, ROPE, save

    from jtp.demo import ensure_demo_checkpoint

    # A tiny Qwen3.5 hybrid speaking the demo's vocabulary, so it can use the demo's tokenizer.
    demo = ensure_demo_checkpoint()
    vocab_size = json.loads((demo / "config.json").read_text())["vocab_size"]
    config = transformers.Qwen3_5TextConfig(**{**COMMON, "vocab_size": vocab_size}, intermediate_size=96,
                                            rope_parameters=ROPE)
    path = save(transformers.Qwen3_5ForCausalLM(config).eval(), tmp_path_factory.mktemp("hybrid"))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(demo / name, path / name)

    args = EngineArgs(model=str(path), served_model_name="tiny-hybrid", **HYBRID_ARGS)
    engine = start_engine(args)
    try:
        with serving(build_app(engine, args.model_name(), api_key=API_KEY)) as url:
            served = Served(engine, url, args.model_name(), API_KEY)
            # Before warm-up ends the server is alive but not ready, and refuses generation.
            assert httpx.get(url + "/health").status_code == 200
            assert httpx.get(url + "/ready").status_code == 503
            r = served.post("/v1/completions", {"model": served.model, "prompt": "Hi", "max_tokens": 1})
            assert_openai_error(r, 503, "not_ready")
            engine.ready.set()
            assert httpx.get(url + "/ready").status_code == 200
            yield served
    finally:
        engine.close()


# ----------------------------------------------------------------------------- unit: reasoning parser

REASONING_CASES = [
    # (output, prompt ends inside <think>, expected (reasoning, content))
    ("<think>\nThe user says hi.\n\nGreet back.\n</think>\n\nHello there!", False,
     ("The user says hi.\n\nGreet back.", "Hello there!")),
    ("\n<think>a</think>b", False, ("a", "b")),
    ("<think>\n\n</think>\n\nJust content.", False, ("", "Just content.")),
    ("No thinking here, <think> later is content.", False, ("", "No thinking here, <think> later is content.")),
    ("<think>\ncut off while thinking </thi", False, ("cut off while thinking </thi", "")),
    ("<thinking>? not a tag", False, ("", "<thinking>? not a tag")),
    ("<thi", False, ("", "<thi")),
    ("  \n", False, ("", "  \n")),
    ("reasoning from the prompt's open tag\n</think>\n\nanswer\n", True,
     ("reasoning from the prompt's open tag", "answer\n")),
]


@pytest.mark.parametrize("text, opened, expected", REASONING_CASES)
def test_reasoning_parser_gives_the_same_split_wherever_the_stream_is_cut(text, opened, expected):
    prompt = "<|im_start|>assistant\n<think>\n" if opened else "<|im_start|>assistant\n"
    assert split_reasoning(text, prompt) == expected
    for cuts in itertools.chain(itertools.combinations(range(1, len(text)), 1),
                                itertools.combinations(range(1, len(text)), 2)):
        parser = Qwen3ReasoningParser(opened)
        reasoning = content = ""
        for start, end in zip((0, *cuts), (*cuts, len(text))):
            r, c = parser.feed(text[start:end])
            reasoning, content = reasoning + r, content + c
        r, c = parser.finish()
        assert (reasoning + r, content + c) == expected, cuts


def test_reasoning_parser_one_character_at_a_time_never_leaks_a_tag():
    text = REASONING_CASES[0][0]
    parser = Qwen3ReasoningParser()
    for ch in text:
        reasoning, content = parser.feed(ch)
        assert "<" not in reasoning + content and ">" not in reasoning + content


def test_prompt_ends_in_think():
    assert Qwen3ReasoningParser.prompt_ends_in_think("x<|im_start|>assistant\n<think>\n")
    assert not Qwen3ReasoningParser.prompt_ends_in_think("assistant\n<think>\n\n</think>\n\n")
    assert not Qwen3ReasoningParser.prompt_ends_in_think("assistant\n")
    # a tag in a user's text opens no block for the model
    user_text = "<|im_start|>user\nWhat is the <think> tag for?<|im_end|>\n<|im_start|>assistant\n"
    assert not Qwen3ReasoningParser.prompt_ends_in_think(user_text)
    assert think_first(user_text) == "optional" and think_first(user_text + "<think>\n") == "open"
    assert think_first(user_text + "<think>\n\n</think>\n\n") is None  # enable_thinking false


# ----------------------------------------------------------------------------- unit: request checks


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "max_tokens": "8"}, "max_tokens"),
    ({"prompt": "x", "temperature": True}, "temperature"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "stop": 3}, "stop"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "x", "logit_bias": [1]}, "logit_bias"),
    ({"prompt": "x", "min_tokens": "2"}, "min_tokens"),
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "x", "echo": "yes"}, "echo"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),  # vLLM's: only with stream
    ({"prompt": "x", "stream": False, "stream_options": {"include_usage": False}}, "stream_options"),
    # vLLM's fields that would change the output and are not served: refused, not ignored
    ({"prompt": "x", "bad_words": ["a"]}, "bad_words"),
    ({"prompt": "x", "allowed_token_ids": [1, 2]}, "allowed_token_ids"),
])
def test_completion_request_errors_name_the_field(body, param):
    with pytest.raises(APIError) as e:
        parse_completion_request(body)
    assert e.value.status == 400 and e.value.param == param


@pytest.mark.parametrize("body, param", [
    ({"messages": "hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": CHAT, "logprobs": 1}, "logprobs"),
    ({"messages": CHAT, "chat_template_kwargs": []}, "chat_template_kwargs"),
    ({"messages": CHAT, "response_format": {"type": "yaml"}}, "response_format"),
    ({"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": CHAT, "max_tokens": -3}, "max_tokens"),
    ({"messages": CHAT, "stream_options": {"include_usage": False}}, "stream_options"),
    # content may be null (or left out) only in an assistant message
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "system", "content": "x"}, {"role": "user"}]}, "messages[1].content"),
    ({"messages": [*CHAT, {"role": "tool", "tool_call_id": "c", "content": None}]}, "messages[1].content"),
    # vLLM's fields that would change the output and are not served: refused, not ignored
    ({"messages": CHAT, "chat_template": "{{ messages[0].content }}"}, "chat_template"),
    ({"messages": CHAT, "echo": True}, "echo"),
])
def test_chat_request_errors_name_the_field(body, param):
    with pytest.raises(APIError) as e:
        parse_chat_request(body)
    assert e.value.status == 400 and e.value.param == param


def test_requests_ignore_unknown_fields_and_nulls_and_join_text_parts():
    req = parse_chat_request({
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        "user": "someone", "metadata": {"x": 1}, "temperature": None, "max_completion_tokens": 5, "max_tokens": 9,
        "stream": True, "stream_options": {"include_usage": True}, "logprobs": True,
        "bad_words": [], "allowed_token_ids": None, "echo": False,  # vLLM's no-op values
    })
    assert req.messages[0]["content"] == "a\nb"
    assert req.max_tokens == 5 and "temperature" not in req.sampling
    assert req.include_usage and req.num_logprobs == 0
    # an assistant turn with null content and no tool calls: taken, as vLLM takes it
    req = parse_chat_request({"messages": [*CHAT, {"role": "assistant", "content": None}, *CHAT]})
    assert req.messages[1] == {"role": "assistant", "content": ""}
    parse_completion_request({"prompt": "x", "stream_options": {}})  # empty: vLLM's check lets it pass
    for body, accepted in (({"bad_words": ["a"]}, "only null"), ({"use_beam_search": True}, "only false or null")):
        with pytest.raises(APIError, match=f"is not supported by this server \\({accepted}\\)"):
            parse_completion_request({"prompt": "x", **body})
    req = parse_completion_request({"prompt": ["a", [1, 2]], "temperature": 0, "stop": "x", "seed": 3})
    assert req.prompts == ["a", [1, 2]] and req.sampling == {"temperature": 0, "stop": "x"} and req.seed == 3


# ----------------------------------------------------------------------------- dense: results


def test_completions_equal_the_engine_streamed_or_not(served):
    client = served.client()
    prompt = PROMPTS[1]
    ref = served.reference(served.engine.tokenizer.encode(prompt), max_tokens=12, temperature=0)
    whole = client.completions.create(model=served.model, prompt=prompt, max_tokens=12, temperature=0)
    assert whole.choices[0].text == ref.text and whole.choices[0].finish_reason == ref.finish_reason
    assert whole.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert whole.usage.completion_tokens == len(ref.token_ids)
    assert whole.usage.total_tokens == len(ref.prompt_token_ids) + len(ref.token_ids)
    assert whole.usage.prompt_tokens_details.cached_tokens == 0
    assert whole.object == "text_completion" and whole.model == served.model

    chunks = list(client.completions.create(model=served.model, prompt=prompt, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert all(c.usage is None for c in chunks[:-1])

    # A token id prompt is the same request.
    by_ids = client.completions.create(model=served.model, prompt=ref.prompt_token_ids, max_tokens=12,
                                       temperature=0)
    assert by_ids.choices[0].text == ref.text


def test_chat_equals_the_engine_streamed_or_not(served):
    client = served.client()
    ids = served.chat_prompt_ids(CHAT)
    ref = served.reference(ids, max_tokens=16, temperature=0)
    reasoning, content = split_reasoning(ref.text)
    whole = client.chat.completions.create(model=served.model, messages=CHAT, max_completion_tokens=16,
                                           temperature=0)
    message = whole.choices[0].message
    assert message.role == "assistant" and message.content == content
    assert getattr(message, "reasoning_content", None) == (reasoning or None)
    assert whole.choices[0].finish_reason == ref.finish_reason
    assert whole.usage.prompt_tokens == len(ids) and whole.usage.completion_tokens == len(ref.token_ids)

    chunks = list(client.chat.completions.create(model=served.model, messages=CHAT, max_tokens=16,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == content
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason

    # No max_tokens: the rest of the context, so the model's own end of turn (or the context) stops it.
    default = served.reference(ids, max_tokens=served.engine.max_model_len - len(ids), temperature=0)
    whole = client.chat.completions.create(model=served.model, messages=CHAT, temperature=0)
    assert whole.choices[0].message.content == split_reasoning(default.text)[1]


def test_enable_thinking_reaches_the_chat_template(served):
    client = served.client()
    on = client.chat.completions.create(model=served.model, messages=CHAT, max_tokens=1, temperature=0)
    off = client.chat.completions.create(model=served.model, messages=CHAT, max_tokens=1, temperature=0,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert on.usage.prompt_tokens == len(served.chat_prompt_ids(CHAT))
    assert off.usage.prompt_tokens == len(served.chat_prompt_ids(CHAT, enable_thinking=False)) > on.usage.prompt_tokens


def test_logprobs_in_both_shapes_match_the_engine(served):
    tok = served.engine.tokenizer
    ids = tok.encode(PROMPTS[0])
    ref = served.reference(ids, max_tokens=6, temperature=0, logprobs=3)
    r = served.post("/v1/completions", {"model": served.model, "prompt": PROMPTS[0], "max_tokens": 6,
                                       "temperature": 0, "logprobs": 3}).json()
    lp = r["choices"][0]["logprobs"]
    assert lp["tokens"] == [tok.decode([t], skip_special_tokens=False) for t in ref.token_ids]
    assert lp["token_logprobs"] == pytest.approx(ref.logprobs, abs=1e-5)
    for top, token in zip(lp["top_logprobs"], lp["tokens"]):
        assert token in top and 3 <= len(top) <= 4
    assert lp["text_offset"][0] == 0
    events = parse_sse(served.stream_raw("/v1/completions", {"model": served.model, "prompt": PROMPTS[0],
                                                            "max_tokens": 6, "temperature": 0, "logprobs": 3}))
    streamed = [t for e in events for t in (e["choices"][0]["logprobs"] or {}).get("tokens", [])]
    assert streamed == lp["tokens"]

    chat_ref = served.reference(served.chat_prompt_ids(CHAT), max_tokens=6, temperature=0, logprobs=2)
    r = served.client().chat.completions.create(model=served.model, messages=CHAT, max_tokens=6, temperature=0,
                                                logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(chat_ref.logprobs, abs=1e-5)
    for entry in content:
        if "\ufffd" not in entry.token:  # a whole character or more: its bytes spell its text
            assert bytes(entry.bytes).decode() == entry.token
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_every_sampling_field_reaches_the_engine_parameters():
    fields = dict(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, presence_penalty=0.5, frequency_penalty=-0.5,
                  repetition_penalty=1.1, stop=["\n\n", "END"], stop_token_ids=[7], ignore_eos=True)
    req = parse_chat_request({"messages": CHAT, "seed": 5, "logprobs": True, "top_logprobs": 3, **fields})
    params = sampling_params(req, max_tokens=9, choice=2, defaults={"temperature": 0.1, "top_k": 3})
    assert params == SamplingParams(max_tokens=9, seed=7, logprobs=3, **fields)
    req = parse_completion_request({"prompt": "x", "stop": "END", "logprobs": 0})
    params = sampling_params(req, max_tokens=16, choice=1, defaults={})
    assert params.stop == ["END"] and params.seed is None and params.logprobs == 0 and params.temperature == 1.0


def test_n_choices_with_a_seed_are_the_engine_requests_with_seed_plus_i(served):
    sampling = dict(temperature=0.9, top_p=0.9, top_k=40, min_p=0.02)
    ids = served.engine.tokenizer.encode(PROMPTS[2])
    r = served.post("/v1/completions", {"model": served.model, "prompt": PROMPTS[2], "max_tokens": 8, "n": 3,
                                       "seed": 11, **sampling})
    r = openai.types.Completion.model_validate(r.json())
    assert [c.index for c in r.choices] == [0, 1, 2]
    for choice in r.choices:
        ref = served.reference(ids, max_tokens=8, seed=11 + choice.index, **sampling)
        assert choice.text == ref.text
    assert r.usage.prompt_tokens == len(ids)  # the prompt counts once for all n choices


def test_unset_sampling_fields_take_the_generation_config(served):
    """vLLM's --generation-config auto: the checkpoint's temperature / top_k / top_p, read here from its file."""
    config = json.loads((served.engine.model_dir / "generation_config.json").read_text())
    asked = {k: config[k] for k in ("temperature", "top_k", "top_p")}
    ids = served.engine.tokenizer.encode(PROMPTS[1])
    r = served.post("/v1/completions", {"model": served.model, "prompt": PROMPTS[1], "max_tokens": 16, "seed": 3})
    implicit = r.json()["choices"][0]["text"]
    assert implicit == served.reference(ids, max_tokens=16, seed=3, **asked).text
    assert implicit != served.reference(ids, max_tokens=16, seed=3).text  # SamplingParams' defaults differ
    chat = served.client().chat.completions.create(model=served.model, messages=CHAT, max_tokens=16, seed=3)
    ref = served.reference(served.chat_prompt_ids(CHAT), max_tokens=16, seed=3, **asked)
    assert chat.choices[0].message.content == ref.text


def test_echoed_prompt_logprobs_are_the_engines(served):
    """Through one process and a tp=4 group (the prompt targets cross to the followers with the step)."""
    ids = served.engine.tokenizer.encode(PROMPTS[3])
    r = served.post("/v1/completions", {"model": served.model, "prompt": PROMPTS[3], "max_tokens": 3,
                                        "temperature": 0, "logprobs": 1, "echo": True}).json()
    ref = served.reference(ids, max_tokens=3, temperature=0, prompt_logprobs=1)
    lp = r["choices"][0]["logprobs"]
    assert r["choices"][0]["text"].startswith(PROMPTS[3]) and lp["token_logprobs"][0] is None
    np.testing.assert_allclose(lp["token_logprobs"][1:len(ids)], ref.prompt_logprobs.logprobs[1:], atol=1e-4)


def test_completions_default_max_tokens_is_16_capped_by_the_room_left(served):
    """vLLM's rule when max_tokens is unset: 16, or what the context (128 here) has left."""
    r = served.post("/v1/completions", {"model": served.model, "prompt": PROMPTS[1], "temperature": 0,
                                        "ignore_eos": True}).json()
    assert r["usage"]["completion_tokens"] == 16
    long_prompt = [5] * 120  # 8 tokens of room
    r = served.post("/v1/completions", {"model": served.model, "prompt": long_prompt, "temperature": 0,
                                        "ignore_eos": True}).json()
    assert r["usage"]["completion_tokens"] == 8 and r["choices"][0]["finish_reason"] == "length", r


def test_stop_strings_batched_prompts_and_ignore_eos(served):
    client = served.client()
    tok = served.engine.tokenizer
    ref = served.reference(tok.encode(PROMPTS[3]), max_tokens=16, temperature=0, ignore_eos=True)
    assert len(ref.token_ids) == 16
    stop = ref.text[len(ref.text) // 2:][:3]
    assert stop
    r = client.completions.create(model=served.model, prompt=PROMPTS[3], max_tokens=16, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == ref.text[:ref.text.index(stop)] and r.choices[0].finish_reason == "stop"

    refs = [served.reference(tok.encode(p), max_tokens=5, temperature=0) for p in PROMPTS[:2]]
    r = client.completions.create(model=served.model, prompt=PROMPTS[:2], max_tokens=5, temperature=0, n=2)
    assert [c.text for c in r.choices] == [refs[0].text] * 2 + [refs[1].text] * 2
    assert r.usage.prompt_tokens == sum(len(x.prompt_token_ids) for x in refs)


def test_include_stop_str_in_output_keeps_the_stop_string_whole_and_streamed(served):
    """vLLM's include_stop_str_in_output: the text is the one cut before the stop string, plus it."""
    for path, ask in (("/v1/completions", {"prompt": PROMPTS[2]}), ("/v1/chat/completions", {"messages": CHAT})):
        body = {"model": served.model, **ask, "max_tokens": 20, "temperature": 0, "ignore_eos": True}
        text = (lambda c: c["text"]) if "prompt" in ask else (lambda c: c["message"]["content"])
        full = text(served.post(path, body).json()["choices"][0])
        stop = full[len(full) // 2:][:3]
        assert stop.strip(), full
        body["stop"] = [stop]
        plain, kept = (served.post(path, {**body, "include_stop_str_in_output": flag}).json()["choices"][0]
                       for flag in (False, True))
        assert text(plain) == full[:full.index(stop)]
        assert text(kept) == text(plain) + stop and kept["finish_reason"] == "stop" and kept["stop_reason"] == stop
        events = parse_sse(served.stream_raw(path, {**body, "include_stop_str_in_output": True}))
        pieces = [c.get("text") or c.get("delta", {}).get("content") or "" for e in events for c in e["choices"]]
        assert "".join(pieces) == text(kept), path
    # a stop token id: its text is kept too (vLLM's), not only a stop string's
    tok = served.engine.tokenizer
    ids = tok.encode(PROMPTS[2])
    ref = served.reference(ids, max_tokens=20, temperature=0, ignore_eos=True)
    k = ref.token_ids.index(ref.token_ids[5])
    body = {"model": served.model, "prompt": ids, "max_tokens": 20, "temperature": 0, "ignore_eos": True,
            "stop_token_ids": [ref.token_ids[k]]}
    for flag, upto in ((False, k), (True, k + 1)):
        choice = served.post("/v1/completions", {**body, "include_stop_str_in_output": flag}).json()["choices"][0]
        assert choice["text"] == tok.decode(ref.token_ids[:upto]) and choice["stop_reason"] == ref.token_ids[k]


# ----------------------------------------------------------------------------- dense: load and metrics


def test_64_concurrent_streams_equal_their_solo_results_and_metrics_add_up(served):
    tok = served.engine.tokenizer
    jobs = []  # (kind, prompt text, prompt ids, max_tokens)
    for i in range(64):
        prompt = PROMPTS[i % len(PROMPTS)]
        kind = ("completion", "chat", "raw")[i % 3]
        ids = served.chat_prompt_ids([{"role": "user", "content": prompt}]) if kind == "chat" else tok.encode(prompt)
        jobs.append((kind, prompt, ids, 4 + i % 9))
    solo = {(tuple(ids), n): None for _, _, ids, n in jobs}
    for key in solo:
        solo[key] = served.reference(list(key[0]), max_tokens=key[1], temperature=0)

    def run(job):
        kind, prompt, ids, n = job
        body = dict(model=served.model, max_tokens=n, temperature=0, stream_options={"include_usage": True})
        if kind == "raw":
            events = parse_sse(served.stream_raw("/v1/completions", {**body, "prompt": prompt}))
            text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
            return text, events[-1]["usage"]["completion_tokens"]
        client = served.client()
        if kind == "chat":
            chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": prompt}],
                                                         stream=True, **body))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            chunks = list(client.completions.create(prompt=prompt, stream=True, **body))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
        return text, chunks[-1].usage.completion_tokens

    before = served.metrics()
    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        results = list(pool.map(run, jobs))
    after = served.metrics()

    for (kind, _, ids, n), (text, completion_tokens) in zip(jobs, results):
        ref = solo[(tuple(ids), n)]
        expected = split_reasoning(ref.text)[1] if kind == "chat" else ref.text
        assert text == expected and completion_tokens == len(ref.token_ids), (kind, n)

    def grew(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert grew("jtp:prompt_tokens_total") == sum(len(ids) for _, _, ids, _ in jobs)
    assert grew("jtp:generation_tokens_total") == sum(tokens for _, tokens in results)
    assert grew("jtp:request_success_total") == 64
    for histogram in ("jtp:time_to_first_token_seconds", "jtp:e2e_request_latency_seconds"):
        assert grew(histogram + "_count") == 64
    phase = {p: f"jtp:request_{p}_time_seconds_sum" for p in ("queue", "prefill", "decode", "inference")}
    for name in phase.values():
        assert grew(name.replace("_sum", "_count")) == 64
    # The engine's phases lie inside the server's spans: submitted before arrival, first token seen after.
    assert grew(phase["queue"]) + grew(phase["prefill"]) <= grew("jtp:time_to_first_token_seconds_sum")
    assert grew(phase["queue"]) + grew(phase["inference"]) <= grew("jtp:e2e_request_latency_seconds_sum")
    assert grew(phase["inference"]) == pytest.approx(grew(phase["prefill"]) + grew(phase["decode"]), rel=1e-6)
    assert after["jtp:num_requests_running"] == after["jtp:num_requests_waiting"] == 0
    assert served.pool_returns_to_full()


def test_models_health_ready_metrics(served):
    models = served.client().models.list()
    assert [m.id for m in models.data] == [served.model]
    assert httpx.get(served.url + "/health").json() == {"status": "ok"}
    assert httpx.get(served.url + "/ready").status_code == 200
    text = httpx.get(served.url + "/metrics").text
    for name in ("jtp:time_to_first_token_seconds_bucket", "jtp:time_per_output_token_seconds_count",
                 "jtp:e2e_request_latency_seconds_sum", "jtp:num_requests_running", "jtp:num_requests_waiting",
                 "jtp:kv_cache_usage_perc", "jtp:prompt_tokens_total", "jtp:generation_tokens_total",
                 "jtp:request_success_total", "jtp:request_queue_time_seconds_bucket",
                 "jtp:request_prefill_time_seconds_count", "jtp:request_decode_time_seconds_sum",
                 "jtp:request_inference_time_seconds_count"):
        assert name in text


# ----------------------------------------------------------------------------- dense: errors


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(dense, monkeypatch):
    model = dense.model
    assert_openai_error(dense.post("/v1/completions", content=b'{"prompt": "x",'), 400)
    assert_openai_error(dense.post("/v1/completions", content=b"\xff\xfe"), 400)
    assert_openai_error(dense.post("/v1/chat/completions", content=b"[1, 2]"), 400)
    error = assert_openai_error(dense.post("/v1/completions", {"model": model, "prompt": "x", "max_tokens": "8"}),
                                400)
    assert error["param"] == "max_tokens" and error["type"] == "invalid_request_error"
    assert_openai_error(dense.post("/v1/completions", {"model": model, "prompt": "x", "temperature": -1}), 400)
    assert_openai_error(dense.post("/v1/completions", {"model": model, "prompt": "x", "top_k": 10**6}), 400)
    assert_openai_error(dense.post("/v1/completions", {"model": model, "prompt": [10**7]}), 400)
    assert_openai_error(dense.post("/v1/completions", {"model": model, "prompt": ""}), 400)
    assert_openai_error(dense.post("/v1/completions", {"model": "other", "prompt": "x"}), 404, "model_not_found")
    assert_openai_error(dense.post("/v1/chat/completions", {"model": model, "messages": [
        {"role": "system", "content": "a"}, {"role": "system", "content": "b"}]}), 400)  # the template refuses
    error = assert_openai_error(dense.post("/v1/chat/completions", {"model": model, "messages": [
        {"role": "user", "content": None}]}), 400)  # refused before the template sees it
    assert error["param"] == "messages[0].content" and "required" in error["message"]
    long_prompt = [5] * 100
    assert_openai_error(dense.post("/v1/completions", {"model": model, "prompt": long_prompt, "max_tokens": 64}),
                        400, "context_length_exceeded")
    chat = [{"role": "user", "content": "word " * 200}]
    assert_openai_error(dense.post("/v1/chat/completions", {"model": model, "messages": chat}), 400,
                        "context_length_exceeded")
    assert_openai_error(httpx.get(dense.url + "/v1/nothing"), 404)
    assert_openai_error(httpx.get(dense.url + "/v1/completions"), 405)

    # The openai client raises its typed errors from these bodies.
    with pytest.raises(openai.BadRequestError) as e:
        dense.client().completions.create(model=model, prompt=long_prompt, max_tokens=64)
    assert e.value.code == "context_length_exceeded"

    # An unexpected failure inside a handler is a 500 in the same shape, and nothing else breaks.
    def broken_submit(*args, **kwargs):
        raise RuntimeError("injected failure")

    with monkeypatch.context() as patch:
        patch.setattr(dense.engine, "submit", broken_submit)
        error = assert_openai_error(dense.post("/v1/completions", {"model": model, "prompt": "x"}), 500)
        assert "injected failure" in error["message"]

    # Unknown fields are ignored; the server still serves.
    r = dense.post("/v1/completions", {"model": model, "prompt": "x", "max_tokens": 2, "temperature": 0,
                                       "user": "u", "metadata": {"a": 1}, "temperature_unknown": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert dense.pool_returns_to_full()


def test_client_disconnect_aborts_its_request_and_frees_the_pool(served, monkeypatch):
    body = {"model": served.model, "prompt": PROMPTS[0], "max_tokens": 120, "temperature": 0, "ignore_eos": True}
    if not served.remote:
        # The in-process engine can finish 120 tokens before a loaded CI machine's client reads its
        # first event; a few milliseconds per step keep the request running until the hang-up.
        dispatch = served.engine.runner.dispatch

        def slow_dispatch(step_input):
            time.sleep(0.01)
            return dispatch(step_input)

        monkeypatch.setattr(served.engine.runner, "dispatch", slow_dispatch)

    def aborted() -> float:
        return served.metrics(finished_reason="abort").get("jtp:request_success_total", 0.0)

    for _ in range(20):  # a loaded machine may read the first event only after the last one was sent
        before = aborted()
        with httpx.stream("POST", served.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            assert next(line for line in r.iter_lines() if line.startswith("data: "))
        # Hung up after the first event: the engine aborts the request (unless it had finished: again).
        assert served.pool_returns_to_full()
        deadline = time.monotonic() + 0.5
        while not (was_aborted := aborted() == before + 1) and time.monotonic() < deadline:
            time.sleep(0.01)
        if was_aborted:
            break
    assert was_aborted, "every request finished before the client hung up"
    assert aborted() == before + 1 and served.pool_returns_to_full()

    # Not streamed: the client hangs up while its request runs.
    payload = json.dumps(body).encode()
    url = httpx.URL(served.url)
    with socket.create_connection((url.host, url.port)) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        deadline = time.monotonic() + 30
        while served.num_running() == 0:
            assert time.monotonic() < deadline
            time.sleep(0.002)
    assert served.pool_returns_to_full()
    assert aborted() == before + 2
    r = served.post("/v1/completions", {**body, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


# ----------------------------------------------------------------------------- reasoning, live


def test_reasoning_content_live(dense):
    output = "<think>\nThe user greets me.\nI greet back.\n</think>\n\nHello there!"
    engine = ScriptedEngine(dense.engine.tokenizer, output)
    with serving(build_app(engine, "scripted", reasoning_parser="qwen3")) as url:
        served = Served(engine, url, "scripted")
        whole = served.client().chat.completions.create(model="scripted", messages=CHAT)
        message = whole.choices[0].message
        assert message.reasoning_content == "The user greets me.\nI greet back."
        assert message.content == "Hello there!"
        events = parse_sse(served.stream_raw("/v1/chat/completions", {"model": "scripted", "messages": CHAT}))
        deltas = [e["choices"][0]["delta"] for e in events]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == message.reasoning_content
        assert "".join(d.get("content", "") for d in deltas) == message.content
    with serving(build_app(engine, "scripted")) as url:  # without the parser the tags stay in the content
        r = Served(engine, url, "scripted").client().chat.completions.create(model="scripted", messages=CHAT)
        assert r.choices[0].message.content == output


# ----------------------------------------------------------------------------- hybrid


def test_hybrid_completions_and_chat_equal_the_engine(hybrid):
    # Every hybrid request uses the chat prompt's tokens, greedy: one prefill and one decode shape.
    client = hybrid.client()
    ids = hybrid.chat_prompt_ids(CHAT)
    ref = hybrid.reference(ids, max_tokens=10, temperature=0)
    whole = client.chat.completions.create(model=hybrid.model, messages=CHAT, max_tokens=10, temperature=0)
    assert whole.choices[0].message.content == ref.text
    chunks = client.chat.completions.create(model=hybrid.model, messages=CHAT, max_tokens=10, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text

    whole = client.completions.create(model=hybrid.model, prompt=ids, max_tokens=10, temperature=0)
    assert whole.choices[0].text == ref.text
    chunks = client.completions.create(model=hybrid.model, prompt=ids, max_tokens=10, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in chunks) == ref.text


def test_api_key_guards_v1_only(hybrid):
    body = {"model": hybrid.model, "prompt": hybrid.chat_prompt_ids(CHAT), "max_tokens": 1, "temperature": 0}
    assert_openai_error(hybrid.post("/v1/completions", body, headers={}), 401, "invalid_api_key")
    assert_openai_error(hybrid.post("/v1/completions", body, headers={"Authorization": "Bearer wrong"}), 401)
    assert_openai_error(hybrid.post("/v1/completions", body, headers={"Authorization": API_KEY}), 401)
    assert_openai_error(httpx.get(hybrid.url + "/v1/models"), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=hybrid.url + "/v1", api_key="wrong", max_retries=0).models.list()
    for open_path in ("/health", "/ready", "/metrics"):
        assert httpx.get(hybrid.url + open_path).status_code == 200
    assert hybrid.post("/v1/completions", body).status_code == 200


def test_full_waiting_queue_is_429_with_retry_after(hybrid, monkeypatch):
    body = {"model": hybrid.model, "prompt": hybrid.chat_prompt_ids(CHAT), "max_tokens": 4, "temperature": 0}
    # 3 choices against 2 waiting places can never be queued whole: a 400, not "retry later".
    assert_openai_error(hybrid.post("/v1/completions", {**body, "n": 3}), 400)
    # A queue that is full now is a 429: 2 long requests run (2 slots), 2 wait, one more is refused.
    dispatch = hybrid.engine.runner.dispatch

    def slow_dispatch(step_input):
        time.sleep(0.02)  # keeps the first requests running while the others arrive
        return dispatch(step_input)

    monkeypatch.setattr(hybrid.engine.runner, "dispatch", slow_dispatch)
    long = {**body, "max_tokens": 40, "ignore_eos": True, "n": 2}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = pool.submit(hybrid.post, "/v1/completions", long)
        deadline = time.monotonic() + 30
        while hybrid.num_running() < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        waiting = pool.submit(hybrid.post, "/v1/completions", long)
        while hybrid.engine.stats().num_waiting < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        r = hybrid.post("/v1/completions", body)
        assert_openai_error(r, 429, "queue_full")
        assert int(r.headers["Retry-After"]) >= 1
        assert running.result().status_code == waiting.result().status_code == 200
    monkeypatch.undo()
    assert hybrid.pool_returns_to_full()
    r = hybrid.post("/v1/completions", {**body, "n": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2


# ----------------------------------------------------------------------------- jtp serve


def test_jtp_serve_ctrl_c_ends_open_streams_and_exits():
    proc, url, log = start_serve(1, "--api-key", API_KEY, "--reasoning-parser", "qwen3")
    try:
        served = Served(None, url, "jtp-demo", API_KEY)
        body = {"model": served.model, "prompt": PROMPTS[0], "max_tokens": 100, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", served.url + "/v1/completions", json=body, headers=served.headers,
                          timeout=60) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGINT)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"  # the cut stream says why, in an error event (no "abort" reason)
        assert json.loads(rest[-2][len("data: "):])["error"]["code"] == "server_shutting_down"
        assert proc.wait(30) == 130, "".join(log)  # the CLI's quiet Ctrl-C status
    finally:
        proc.kill()


def test_jtp_serve_ctrl_c_twice_exits_130_quietly():
    """A second Ctrl-C forces the exit (no waiting for connections) with requests running and
    queued; every request still ends, and the exit is still quiet."""
    proc, url, log = start_serve(1)
    try:
        body = {"model": "jtp-demo", "prompt": PROMPTS[0], "max_tokens": 100, "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            whole = [pool.submit(httpx.post, url + "/v1/completions", json=body, timeout=60) for _ in range(12)]
            with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
                lines = r.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))
                proc.send_signal(signal.SIGINT)
                time.sleep(0.05)  # (two at once are one to Python's handler)
                proc.send_signal(signal.SIGINT)
                assert [line for line in lines if line][-1] == "data: [DONE]"
            assert {f.result().status_code for f in whole} <= {200, 503}
        assert proc.wait(30) == 130, "".join(log)
        time.sleep(0.2)  # the log reader's last lines
        assert "Traceback" not in "".join(log), "".join(log)
    finally:
        proc.kill()
