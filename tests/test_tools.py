"""Tool calling: the parsers of Qwen3's (hermes) and Qwen3-Coder's calls, and calls through the HTTP API.

The parsers are checked on outputs written the way the models write them, fed whole and cut at
every one or two points (a streamed output arrives in arbitrary pieces), against the calls and
content written down independently here. The server is checked through the real `openai` client
against uvicorn on loopback, over a scripted engine that replays one model output (a random tiny
model never writes a tool call): message.tool_calls, the streamed deltas accumulated the way
clients do, the conversation continued with a tool result (the prompt rendered by the chat
template carries the call and the result), and each bad request a 400 naming its field.
"""

from __future__ import annotations

import itertools
import json

import httpx
import openai
import pytest
from loopback import serving
from scripted_engine import RecordingEngine, ScriptedEngine

from jtp.demo import ensure_demo_checkpoint
from jtp.engine.tokenizer import Tokenizer
from jtp.entrypoints.server import build_app
from jtp.entrypoints.server.reasoning import Qwen3ReasoningParser
from jtp.entrypoints.server.tool_parsers import HermesToolParser, Qwen3CoderToolParser

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "hours": {"type": "array"}, "where": {"type": "object"}, "scale": {"type": "number"}},
        "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
    "zone": {"type": "string"}}}}}
TOOLS = [WEATHER, TIME]

HERMES_TWO_CALLS = (
    'Let me check both.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
)
CODER_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n"
    "</parameter>\n<parameter=metric>\nfalse\n</parameter>\n<parameter=hours>\n[1, 2]\n</parameter>\n"
    "<parameter=where>\n{\"lat\": 40.7}\n</parameter>\n<parameter=scale>\n1.5\n</parameter>\n</function>\n"
    "</tool_call>"
)


def parse(parser, pieces: list[str]) -> tuple[str, list[tuple[str, dict]]]:
    text, calls = [], []
    for piece in pieces:
        t, c = parser.feed(piece)
        text.append(t)
        calls += c
    t, c = parser.finish()
    return "".join(text) + t, [(call.name, json.loads(call.arguments)) for call in calls + c]


def cuts(text: str):
    """The text whole, then cut at every point and at every pair of points."""
    yield [text]
    for points in itertools.chain(itertools.combinations(range(1, len(text)), 1),
                                  itertools.combinations(range(1, len(text), 3), 2)):
        bounds = (0, *points, len(text))
        yield [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("make, output, content, calls", [
    (HermesToolParser, HERMES_TWO_CALLS, "Let me check both.",
     [("get_weather", {"city": "Zürich", "days": 2}), ("get_time", {"zone": "CET"})]),
    (Qwen3CoderToolParser, CODER_CALL, "",
     [("get_weather", {"city": "New York", "days": 3, "metric": False, "hours": [1, 2], "where": {"lat": 40.7},
                       "scale": 1.5})]),
    (HermesToolParser, "No tools needed: 2 < 3 and <tool is not a tag.\n", "No tools needed: 2 < 3 and <tool is not a tag.\n",
     []),
], ids=["hermes-two-calls", "qwen3-coder-typed", "plain-text"])
def test_calls_parse_the_same_however_the_stream_is_cut(make, output, content, calls):
    for pieces in cuts(output):
        assert parse(make(TOOLS), pieces) == (content, calls), pieces


@pytest.mark.parametrize("output, content, calls", [
    # not JSON, no name, arguments not an object: the block comes back as text
    ('<tool_call>\n{"name": "get_time", "arguments": {"zone": \n</tool_call>',
     '<tool_call>\n{"name": "get_time", "arguments": {"zone": \n</tool_call>', []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ('<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>',
     '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>', []),
    # arguments written as a JSON string; a block the output ends inside (the stop token took </tool_call>)
    ('<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}</tool_call>', "",
     [("get_time", {"zone": "UTC"})]),
    ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n', "", [("get_time", {"zone": "UTC"})]),
    # cut off inside a block: text
    ('<tool_call>\n{"name": "get_time", "argu', '<tool_call>\n{"name": "get_time", "argu', []),
    # a good call, then a broken one: the call, and the broken block as text (with the line break before it)
    ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n<tool_call>oops</tool_call>',
     "\n<tool_call>oops</tool_call>", [("get_time", {})]),
    # text, then a broken block: the text as the model wrote it, whitespace before the block included
    ('Sure.\n\n<tool_call>\n{"name": "get_time", "arguments": {"zone": }\n</tool_call>',
     'Sure.\n\n<tool_call>\n{"name": "get_time", "arguments": {"zone": }\n</tool_call>', []),
    ('Sure. <tool_call>\n{"name": "get_time", "argu', 'Sure. <tool_call>\n{"name": "get_time", "argu', []),
])
def test_a_malformed_hermes_call_comes_back_as_text(output, content, calls):
    for pieces in cuts(output):
        assert parse(HermesToolParser(TOOLS), pieces) == (content, calls), pieces


def test_qwen3_coder_values_follow_the_schema_and_stay_text_when_they_do_not_convert():
    output = ("<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n<parameter=days>\nmany\n"
              "</parameter>\n<parameter=unknown>\n{\"a\": 1}\n</parameter>\n</function>\n</tool_call>")
    assert parse(Qwen3CoderToolParser(TOOLS), [output]) == (
        "", [("get_weather", {"city": "42", "days": "many", "unknown": {"a": 1}})])
    assert parse(Qwen3CoderToolParser(TOOLS), ["<tool_call>\nno function here\n</tool_call>"]) == (
        "<tool_call>\nno function here\n</tool_call>", [])


def test_parallel_tool_calls_false_keeps_the_first_call():
    assert parse(HermesToolParser(TOOLS, parallel=False), [HERMES_TWO_CALLS]) == (
        "Let me check both.", [("get_weather", {"city": "Zürich", "days": 2})])


# ----------------------------------------------------------------------------- through the server


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(ensure_demo_checkpoint())


@pytest.fixture(scope="module")
def hermes_server(tokenizer):
    output = "<think>\nThe user wants weather and time.\n</think>\n\n" + HERMES_TWO_CALLS
    engine = RecordingEngine(tokenizer, output)
    app = build_app(engine, "tools", reasoning_parser="qwen3", tool_parser="hermes")
    with serving(app) as url:
        yield engine, openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0), url


MESSAGES = [{"role": "user", "content": "Weather in Zürich, and the time?"}]


def test_tool_calls_come_back_in_the_message_and_the_stream_adds_up_to_them(hermes_server):
    _, client, _ = hermes_server
    whole = client.chat.completions.create(model="tools", messages=MESSAGES, tools=TOOLS)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check both."
    assert choice.message.reasoning_content == "The user wants weather and time."
    got = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert got == [("get_weather", {"city": "Zürich", "days": 2}), ("get_time", {"zone": "CET"})]
    assert all(c.type == "function" and c.id for c in choice.message.tool_calls)
    assert len({c.id for c in choice.message.tool_calls}) == 2

    calls: dict[int, dict] = {}  # accumulated by index, as the openai SDK's helpers do
    content, finish, names_first = [], None, True
    for chunk in client.chat.completions.create(model="tools", messages=MESSAGES, tools=TOOLS, stream=True):
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        for part in delta.tool_calls or []:
            entry = calls.setdefault(part.index, {"id": None, "name": None, "arguments": ""})
            if part.id:
                entry["id"] = part.id
            if part.function.name:
                entry["name"] = part.function.name
            elif entry["name"] is None:
                names_first = False
            entry["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert names_first and finish == "tool_calls" and "".join(content) == "Let me check both."
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == got
    assert all(c["id"] for c in calls.values())


def test_a_tool_result_continues_the_conversation(hermes_server):
    engine, client, _ = hermes_server
    first = client.chat.completions.create(model="tools", messages=MESSAGES, tools=TOOLS).choices[0].message
    call = first.tool_calls[0]
    follow_up = MESSAGES + [
        {"role": "assistant", "content": first.content,
         "tool_calls": [{"id": call.id, "type": "function",
                         "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    reply = client.chat.completions.create(model="tools", messages=follow_up, tools=TOOLS)
    assert reply.choices[0].finish_reason == "tool_calls"  # the scripted model calls again; what counts is the prompt
    prompt = engine.prompts[-1]
    # The chat template wrote the earlier call back as Qwen3 does (arguments as an object, not a quoted
    # string) and the result as a tool response.
    assert '{"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}' in prompt
    assert "sunny, 21 C" in prompt and "<tools>" in prompt


def test_tool_choice_none_leaves_the_text_alone(hermes_server):
    _, client, _ = hermes_server
    message = client.chat.completions.create(model="tools", messages=MESSAGES, tools=TOOLS,
                                             tool_choice="none").choices[0].message
    assert message.content == HERMES_TWO_CALLS and not message.tool_calls


def test_bad_tool_requests_are_400s_naming_the_field(hermes_server, tokenizer):
    _, _, url = hermes_server
    chat = {"model": "tools", "messages": MESSAGES}
    cases = [
        ({**chat, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({**chat, "tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({**chat, "tool_choice": "required"}, "tool_choice"),
        ({**chat, "tools": TOOLS, "n": 2}, "n"),
        ({**chat, "tools": [{"type": "retrieval"}]}, "tools"),
        ({**chat, "tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
        ({**chat, "tools": [WEATHER, WEATHER]}, "tools"),
        ({**chat, "functions": [WEATHER["function"]]}, "functions"),
        ({**chat, "messages": MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "x", "type": "function", "function": {"name": "get_time", "arguments": "{not json"}}]}]},
         "messages"),
        ({"model": "tools", "prompt": "hi", "tools": TOOLS}, "tools"),
    ]
    for body, param in cases:
        path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
        r = httpx.post(url + path, json=body, timeout=30)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.text)
    assert httpx.post(url + "/v1/chat/completions", json=chat, timeout=30).status_code == 200  # still serving


def test_auto_tool_choice_needs_the_server_flag(tokenizer):
    app = build_app(ScriptedEngine(tokenizer, HERMES_TWO_CALLS, max_model_len=1024), "plain")
    with serving(app) as url:
        body = {"messages": MESSAGES, "tools": TOOLS}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400 and "--enable-auto-tool-choice" in r.json()["error"]["message"]
        r = httpx.post(url + "/v1/chat/completions", json={**body, "tool_choice": "none"}, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == HERMES_TWO_CALLS


def test_qwen3_coder_calls_through_the_server(tokenizer):
    app = build_app(ScriptedEngine(tokenizer, "Checking.\n" + CODER_CALL, max_model_len=1024), "coder",
                    tool_parser="qwen3_coder")
    with serving(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        message = client.chat.completions.create(model="coder", messages=MESSAGES, tools=TOOLS).choices[0].message
        assert message.content == "Checking."
        assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
            ("get_weather", {"city": "New York", "days": 3, "metric": False, "hours": [1, 2], "where": {"lat": 40.7},
                             "scale": 1.5})]


def test_reasoning_then_calls_split_alike_however_cut():
    """Thinking first, then calls: the two parsers chained as the chat choice chains them."""
    output = "<think>\nweather first\n</think>\n\n" + HERMES_TWO_CALLS
    expected = None
    for pieces in cuts(output):
        reasoning_parser, tools = Qwen3ReasoningParser(), HermesToolParser(TOOLS)
        reasoning, content, calls = [], [], []
        for piece in pieces + [None]:
            r, c = reasoning_parser.feed(piece) if piece is not None else reasoning_parser.finish()
            t, k = tools.feed(c)
            if piece is None:
                t2, k2 = tools.finish()
                t, k = t + t2, k + k2
            reasoning.append(r)
            content.append(t)
            calls += [(x.name, x.arguments) for x in k]
        got = ("".join(reasoning), "".join(content), calls)
        expected = expected or got
        assert got == expected, pieces
    assert expected[0] == "weather first" and expected[1] == "Let me check both." and len(expected[2]) == 2
