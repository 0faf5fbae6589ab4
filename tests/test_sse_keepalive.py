"""SSE keep-alive comments (`: keep-alive`) on streams that have been silent for a while, as while a
long prompt prefills, so that proxies with idle timeouts do not cut them.

The wrapper on its own: events in order, comments only while the next event is late, the inner
generator closed with it. On loopback, behind a scripted engine whose first token comes late: on the
raw bytes of all four streaming endpoints the comments arrive before the first token's event (and
none with the interval at 0); the openai and anthropic clients read the same text either way; a
client that leaves during the silence still aborts its request.
"""

from __future__ import annotations

import asyncio
import time

import anthropic
import httpx
import openai
import pytest
from loopback import serving
from scripted_engine import ScriptedEngine

from jtp.demo import ensure_demo_checkpoint
from jtp.engine.tokenizer import Tokenizer
from jtp.entrypoints.cli import build_serve_parser
from jtp.entrypoints.server import ServerArgs, add_server_args, build_app
from jtp.entrypoints.server.sse import KEEPALIVE, keepalive
from jtp.errors import ConfigError

INTERVAL = 0.05
FIRST_TOKEN_DELAY = 0.6  # about a dozen intervals: the prefill of a long prompt, scaled down
OUTPUT = "Hello there, said the model after a long prefill."
COMMENT = ": keep-alive"  # the wire text, blank line aside
TURNS = [{"role": "user", "content": "Hi"}]
STREAMS = {
    "completions": ("/v1/completions", {"prompt": "Hi", "max_tokens": 64}),
    "chat": ("/v1/chat/completions", {"messages": TURNS}),
    "responses": ("/v1/responses", {"input": "Hi"}),
    "messages": ("/v1/messages", {"messages": TURNS, "max_tokens": 64}),
}


# ----------------------------------------------------------------------------- the wrapper alone


async def collect(events) -> list[str]:
    return [event async for event in events]


@pytest.mark.unit
def test_events_keep_their_order_and_comments_come_only_while_one_is_late():
    async def script():
        yield "a"
        yield "b"
        await asyncio.sleep(0.3)
        yield "c"
        yield "d"

    got = asyncio.run(collect(keepalive(script(), INTERVAL)))
    late = got.index("c")
    assert got[:2] == ["a", "b"] and got[late:] == ["c", "d"], got
    assert set(got[2:late]) == {KEEPALIVE} and late - 2 >= 2, got  # ~6 intervals of silence


@pytest.mark.unit
def test_an_error_of_the_inner_generator_comes_through():
    async def broken():
        yield "a"
        await asyncio.sleep(0.2)
        raise ValueError("boom")

    async def main():
        seen = []
        with pytest.raises(ValueError, match="boom"):
            async for event in keepalive(broken(), INTERVAL):
                seen.append(event)
        return seen

    seen = asyncio.run(main())
    assert seen[0] == "a" and set(seen[1:]) == {KEEPALIVE}


@pytest.mark.unit
def test_closing_the_wrapper_closes_the_inner_generator():
    closed = []

    async def slow():
        try:
            yield "a"
            await asyncio.sleep(30)
            yield "never"
        finally:
            closed.append(True)

    async def main():
        # Closed after an event: the inner generator waits at its yield.
        wrapped = keepalive(slow(), INTERVAL)
        assert await anext(wrapped) == "a"
        await wrapped.aclose()
        assert closed == [True]
        # Closed after a comment: the inner generator is mid-step, in a task of its own.
        wrapped = keepalive(slow(), INTERVAL)
        assert [await anext(wrapped), await anext(wrapped)] == ["a", KEEPALIVE]
        await wrapped.aclose()
        assert closed == [True, True]
        # Its reader cancelled while it waits for the next event (a client's disconnect).
        reader = asyncio.ensure_future(collect(keepalive(slow(), 10.0)))
        await asyncio.sleep(0.1)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        assert closed == [True, True, True]

    asyncio.run(asyncio.wait_for(main(), 10))


@pytest.mark.unit
def test_the_flag_defaults_to_15_seconds_and_0_turns_the_comments_off():
    parser = build_serve_parser(add_server_args)
    assert "--sse-keepalive-interval" in parser.format_help()

    def server_args(*argv: str) -> ServerArgs:
        return ServerArgs.from_cli_args(parser.parse_args(list(argv)))

    assert server_args().sse_keepalive_interval == 15.0
    off = server_args("--sse-keepalive-interval", "0")
    off.validate()
    assert off.sse_keepalive_interval == 0
    with pytest.raises(ConfigError, match="--sse-keepalive-interval -1"):
        server_args("--sse-keepalive-interval", "-1").validate()


# ----------------------------------------------------------------------------- on loopback


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(ensure_demo_checkpoint())


@pytest.fixture(scope="module")
def servers(tokenizer):
    """{interval: URL}: the same late-starting scripted engine behind keep-alives on and off."""
    engine = ScriptedEngine(tokenizer, OUTPUT, max_model_len=512, first_token_delay=FIRST_TOKEN_DELAY)
    with serving(build_app(engine, "scripted", sse_keepalive_interval=INTERVAL)) as on:
        with serving(build_app(engine, "scripted", sse_keepalive_interval=0)) as off:
            yield {INTERVAL: on, 0: off}


def raw_blocks(url: str, path: str, body: dict) -> list[str]:
    """The stream's bytes as they came, cut into its blank-line-separated blocks."""
    with httpx.stream("POST", url + path, json={"model": "scripted", **body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200, r.read()
        raw = r.read().decode()
    assert raw.endswith("\n\n"), raw[-200:]
    return raw[:-2].split("\n\n")


@pytest.mark.parametrize("endpoint", STREAMS)
def test_comments_arrive_before_the_first_token_and_none_when_off(servers, endpoint):
    path, body = STREAMS[endpoint]
    blocks = raw_blocks(servers[INTERVAL], path, body)
    first_token = next(i for i, b in enumerate(blocks) if OUTPUT[:3] in b)
    comments = [i for i, b in enumerate(blocks) if b.startswith(":")]
    assert all(blocks[i] == COMMENT for i in comments), blocks
    assert len([i for i in comments if i < first_token]) >= 3, blocks  # ~12 intervals of prefill
    if endpoint == "completions":  # the only stream with no opening event: the comments come first of all
        assert blocks[0] == COMMENT, blocks

    plain = raw_blocks(servers[0], path, body)
    assert not any(b.startswith(":") for b in plain), plain
    events = [b for b in blocks if not b.startswith(":")]

    def framing(bs: list[str]) -> list[str]:  # ids and timestamps differ between the two requests
        return [b.partition("\n")[0] if b.startswith("event:") else b[:6] for b in bs]

    assert framing(events) == framing(plain)


def test_the_clients_read_the_same_text_with_and_without_comments(servers):
    texts = {}
    for interval, url in servers.items():
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
        chat = client.chat.completions.create(model="scripted", messages=TURNS, stream=True)
        completion = client.completions.create(model="scripted", prompt="Hi", max_tokens=64, stream=True)
        response = client.responses.create(model="scripted", input="Hi", stream=True)
        with anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=30).messages.stream(
                model="scripted", messages=TURNS, max_tokens=64) as message:
            message_text = "".join(message.text_stream)
        texts[interval] = (
            "".join(c.choices[0].delta.content or "" for c in chat if c.choices),
            "".join(c.choices[0].text for c in completion),
            "".join(e.delta for e in response if e.type == "response.output_text.delta"),
            message_text,
        )
    assert texts[INTERVAL] == texts[0] == (OUTPUT,) * 4


def test_a_client_that_leaves_during_the_silence_aborts_its_request(tokenizer):
    engine = ScriptedEngine(tokenizer, OUTPUT, max_model_len=512, first_token_delay=60)
    with serving(build_app(engine, "scripted", sse_keepalive_interval=INTERVAL)) as url:
        with httpx.stream("POST", url + "/v1/chat/completions", timeout=30,
                          json={"model": "scripted", "messages": TURNS, "stream": True}) as r:
            lines = r.iter_lines()
            while next(lines) != COMMENT:  # past the role chunk, into the prefill's silence
                pass
            assert engine.aborted == []
        deadline = time.monotonic() + 10
        while not engine.aborted and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(engine.aborted) == 1 and engine.aborted[0].startswith("chatcmpl-"), engine.aborted
