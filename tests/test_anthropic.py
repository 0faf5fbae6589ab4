"""Anthropic's Messages API (`POST /v1/messages`) through the real `anthropic` client, on loopback.

A real engine (the demo checkpoint) serves behind an API key sent as `x-api-key`: at temperature 0
a Messages request gives the same text as the chat completion of the same conversation (the
independent reference: the OpenAI endpoint and client), streamed and whole; stop sequences and
max_tokens end it with Anthropic's stop reasons; a forced tool (`tool_choice` of type tool) comes
back as a tool_use block whose input follows its schema. A scripted engine that replays a Qwen3
tool call shows tool_use blocks streamed as Anthropic streams them, and a tool_result turn rendered
into the next prompt. Bad requests are 400s in Anthropic's error shape.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
from loopback import serving
from scripted_engine import RecordingEngine

from jtp.config.engine_args import EngineArgs
from jtp.engine.engine import Engine
from jtp.engine.tokenizer import Tokenizer
from jtp.entrypoints.server import build_app

KEY = "anthropic-test-key"
ARGS = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=1024, block_size=32, num_blocks=96, warmup=False)
WEATHER = {"name": "get_weather", "description": "Weather for a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "days": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["city", "days"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def served(demo_dir):
    with Engine.from_args(EngineArgs(model=str(demo_dir), **ARGS)) as engine:
        engine.start()
        engine.ready.set()
        with serving(build_app(engine, "demo", api_key=KEY, tool_parser="hermes")) as url:
            yield (anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=120),
                   openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120), url)


SYSTEM = "You are brief."
GREEDY = {"temperature": 0.0}  # (newer anthropic clients take sampling fields only as extra body fields)
TURNS = [{"role": "user", "content": "Tell me a story about a cat."}]


def test_messages_give_the_chat_completion_text_whole_and_streamed(served):
    client, chat, _ = served
    choice = chat.chat.completions.create(model="demo", messages=[{"role": "system", "content": SYSTEM}, *TURNS],
                                          temperature=0.0, max_tokens=24).choices[0]
    reference, reason = choice.message.content, {"length": "max_tokens", "stop": "end_turn"}[choice.finish_reason]
    message = client.messages.create(model="demo", system=SYSTEM, messages=TURNS, max_tokens=24, extra_body=GREEDY)
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [b.type for b in message.content] == ["text"] and message.content[0].text == reference
    assert message.stop_reason == reason and 0 < message.usage.output_tokens <= 24 and message.usage.input_tokens > 0

    with client.messages.stream(model="demo", system=[{"type": "text", "text": SYSTEM}], messages=TURNS,
                                max_tokens=24, extra_body=GREEDY) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 1 and "".join(pieces) == reference
    assert final.content[0].text == reference and final.stop_reason == reason


def test_a_stop_sequence_ends_the_message(served):
    client, _, _ = served
    text = client.messages.create(model="demo", messages=TURNS, max_tokens=40, extra_body=GREEDY).content[0].text
    word = next(w for w in text.split()[1:] if w.isalpha() and len(w) > 2)
    stopped = client.messages.create(model="demo", messages=TURNS, max_tokens=40, extra_body=GREEDY,
                                     stop_sequences=[word, "zzzz-never"])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert stopped.content[0].text == text[: text.index(word)]


def test_a_forced_tool_comes_back_as_a_tool_use_block(served):
    client, _, _ = served
    for seed_temperature in (0.0, 1.0):
        message = client.messages.create(model="demo", messages=[{"role": "user", "content": "Weather in Bern?"}],
                                         tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"},
                                         max_tokens=80, extra_body={"temperature": seed_temperature})
        (block,) = message.content
        assert block.type == "tool_use" and block.name == "get_weather" and block.id
        assert set(block.input) == {"city", "days"} and type(block.input["days"]) is int
        # Anthropic's reason whenever the model called a tool, forced or not (the chat path says "stop")
        assert message.stop_reason == "tool_use"
    with client.messages.stream(model="demo", messages=[{"role": "user", "content": "Weather in Bern?"}],
                                tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"},
                                max_tokens=80, extra_body={"temperature": 0.0}) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["tool_use"] and final.stop_reason == "tool_use"


def test_a_final_assistant_message_is_continued(served, demo_dir):
    """Anthropic's prefill: the response continues the last assistant message, as a completion of the
    rendered conversation followed by that text does."""
    client, chat, _ = served
    prompt = Tokenizer.from_dir(demo_dir).render_chat(TURNS) + "The sea is"
    reference = chat.completions.create(model="demo", prompt=prompt, max_tokens=12, temperature=0.0).choices[0].text
    message = client.messages.create(model="demo", messages=[*TURNS, {"role": "assistant", "content": "The sea is"}],
                                     max_tokens=12, extra_body=GREEDY)
    assert message.content[0].text == reference


def test_bad_requests_are_anthropic_errors(served):
    client, _, url = served
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
            model="demo", messages=TURNS, max_tokens=4)
    for body, needle in [
        ({"model": "demo", "messages": TURNS}, "max_tokens"),
        ({"model": "demo", "messages": [], "max_tokens": 4}, "messages"),
        ({"model": "demo", "messages": [{"role": "robot", "content": "hi"}], "max_tokens": 4}, "messages.0.role"),
        ({"model": "demo", "messages": TURNS, "max_tokens": 4, "tool_choice": {"type": "tool"}}, "tool_choice"),
        ({"model": "demo", "messages": TURNS, "max_tokens": 4, "tools": [WEATHER],
          "tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
        ({"model": "other", "messages": TURNS, "max_tokens": 4}, "other"),
    ]:
        r = httpx.post(url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=30)
        assert r.status_code in (400, 404), (body, r.text)
        error = r.json()
        assert error["type"] == "error" and error["error"]["type"] in ("invalid_request_error", "not_found_error")
        assert needle in error["error"]["message"], (body, error)
    assert client.messages.create(model="demo", messages=TURNS, max_tokens=2).stop_reason == "max_tokens"
    # An earlier assistant turn of a thinking block alone has no text: served, not refused as null content.
    turns = [*TURNS, {"role": "assistant", "content": [{"type": "thinking", "thinking": "Hm.", "signature": "s"}]},
             {"role": "user", "content": "Go on."}]
    assert client.messages.create(model="demo", messages=turns, max_tokens=2).stop_reason == "max_tokens"


# ----------------------------------------------------------------------------- tool use, scripted


def test_tool_use_blocks_whole_streamed_and_answered(demo_dir):
    output = ('<think>\nNeed the weather.\n</think>\n\nChecking.\n<tool_call>\n'
              '{"name": "get_weather", "arguments": {"city": "Bern", "days": 2}}\n</tool_call>')
    engine = RecordingEngine(Tokenizer.from_dir(demo_dir), output)
    app = build_app(engine, "scripted", reasoning_parser="qwen3", tool_parser="hermes")
    with serving(app) as url:
        client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
        ask = dict(model="scripted", max_tokens=100, tools=[WEATHER],
                   messages=[{"role": "user", "content": "Weather in Bern?"}])
        message = client.messages.create(**ask)
        assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
        assert message.content[0].thinking == "Need the weather." and message.content[1].text == "Checking."
        use = message.content[2]
        assert (use.name, use.input) == ("get_weather", {"city": "Bern", "days": 2}) and message.stop_reason == "tool_use"

        with client.messages.stream(**ask) as stream:
            events = [e.type for e in stream]
            final = stream.get_final_message()
        assert events[0] == "message_start" and events[-1] == "message_stop"
        assert events.count("content_block_start") == events.count("content_block_stop") == 3
        assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
        assert (final.content[2].name, final.content[2].input) == ("get_weather", {"city": "Bern", "days": 2})
        assert final.stop_reason == "tool_use"

        follow_up = ask["messages"] + [
            {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                              {"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21 C"}]},
        ]
        client.messages.create(**{**ask, "messages": follow_up})
        prompt = engine.prompts[-1]
        assert '{"name": "get_weather", "arguments": {"city": "Bern", "days": 2}}' in prompt
        assert "sunny, 21 C" in prompt and prompt.index("Checking.") < prompt.index("sunny, 21 C")
        assert json.dumps(WEATHER["input_schema"])[:20] in prompt.replace(", ", ", ")
