"""OpenAI's Responses API (`POST /v1/responses`) through the real `openai` client, on loopback.

A real engine (the demo checkpoint): at temperature 0 a response's text equals the chat completion
of the same conversation (the reference: the chat endpoint), whole and streamed; a follow-up with
`previous_response_id` equals the chat completion of the whole conversation; `text.format` with a
JSON schema gives JSON that follows it (checked by hand); a forced function comes back as a
function_call item whose streamed argument deltas add up to it; bad requests are 400s naming the
field.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from loopback import serving

from jtp.config.engine_args import EngineArgs
from jtp.engine.engine import Engine
from jtp.entrypoints.server import build_app

ARGS = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=1024, block_size=32, num_blocks=96, warmup=False)
INSTRUCTIONS = "You are brief."


@pytest.fixture(scope="module")
def served(demo_dir):
    with Engine.from_args(EngineArgs(model=str(demo_dir), **ARGS)) as engine:
        engine.start()
        engine.ready.set()
        with serving(build_app(engine, "demo")) as url:
            yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120), url


def chat_text(client, messages: list[dict], max_tokens: int) -> tuple[str, str]:
    choice = client.chat.completions.create(model="demo", messages=messages, temperature=0.0,
                                            max_tokens=max_tokens).choices[0]
    return choice.message.content, choice.finish_reason


def test_a_response_is_the_chat_completion_whole_and_streamed(served):
    client, _ = served
    reference, reason = chat_text(client, [{"role": "system", "content": INSTRUCTIONS},
                                           {"role": "user", "content": "Tell me about dogs."}], 24)
    response = client.responses.create(model="demo", instructions=INSTRUCTIONS, input="Tell me about dogs.",
                                       max_output_tokens=24, temperature=0.0)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == reference
    assert response.status == ("incomplete" if reason == "length" else "completed")
    assert response.usage.output_tokens <= 24 and response.usage.input_tokens > 0

    events = list(client.responses.create(model="demo", instructions=INSTRUCTIONS, input="Tell me about dogs.",
                                          max_output_tokens=24, temperature=0.0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == reference
    assert events[-1].response.output_text == reference
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_a_response_cut_at_max_output_tokens_marks_its_message_incomplete(served):
    """OpenAI's: the item the limit cut off is "incomplete", like the response (whole and streamed)."""
    client, _ = served
    assert chat_text(client, [{"role": "user", "content": "Tell me about cats."}], 4)[1] == "length"
    ask = dict(model="demo", input="Tell me about cats.", max_output_tokens=4, temperature=0.0)
    response = client.responses.create(**ask)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert [(item.type, item.status) for item in response.output] == [("message", "incomplete")]
    events = list(client.responses.create(**ask, stream=True))
    (done,) = [e for e in events if e.type == "response.output_item.done"]
    assert done.item.status == "incomplete" and events[-1].type == "response.incomplete"
    assert [item.status for item in events[-1].response.output] == ["incomplete"]


def test_previous_response_id_continues_the_conversation(served):
    client, url = served
    first = client.responses.create(model="demo", input=[{"role": "user", "content": "Name a fruit."}],
                                    max_output_tokens=12, temperature=0.0)
    second = client.responses.create(model="demo", previous_response_id=first.id, input="And a vegetable?",
                                     max_output_tokens=12, temperature=0.0)
    reference, _ = chat_text(client, [{"role": "user", "content": "Name a fruit."},
                                      {"role": "assistant", "content": first.output_text},
                                      {"role": "user", "content": "And a vegetable?"}], 12)
    assert second.output_text == reference and second.previous_response_id == first.id
    r = httpx.post(url + "/v1/responses", json={"input": "hi", "previous_response_id": "resp_unknown"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
    # OpenAI's rule: a previous response's instructions are not carried over to the next one
    briefed = client.responses.create(model="demo", instructions=INSTRUCTIONS, input="Name a fruit.",
                                      max_output_tokens=12, temperature=0.0)
    follow_up = client.responses.create(model="demo", previous_response_id=briefed.id, input="And a vegetable?",
                                        max_output_tokens=12, temperature=0.0)
    conversation = [{"role": "user", "content": "Name a fruit."},
                    {"role": "assistant", "content": briefed.output_text},
                    {"role": "user", "content": "And a vegetable?"}]
    prompt = httpx.post(url + "/tokenize", json={"messages": conversation}, timeout=30).json()["count"]
    assert follow_up.usage.input_tokens == prompt
    assert follow_up.output_text == chat_text(client, conversation, 12)[0]
    unstored = client.responses.create(model="demo", input="hi", max_output_tokens=2, store=False)
    r = httpx.post(url + "/v1/responses", json={"input": "hi", "previous_response_id": unstored.id}, timeout=30)
    assert r.status_code == 400


def test_text_format_and_forced_functions(served):
    client, _ = served
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                               "rank": {"type": "integer", "minimum": 1, "maximum": 5}},
              "required": ["city", "rank"], "additionalProperties": False}
    for temperature in (0.0, 1.0):
        response = client.responses.create(
            model="demo", input="A city and its rank.", max_output_tokens=60, temperature=temperature,
            text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}})
        value = json.loads(response.output_text)
        assert set(value) == {"city", "rank"} and len(value["city"]) <= 10 and 1 <= value["rank"] <= 5

    tool = {"type": "function", "name": "lookup", "description": "Look a word up",
            "parameters": {"type": "object", "properties": {"word": {"type": "string", "maxLength": 8}},
                           "required": ["word"], "additionalProperties": False}}
    ask = dict(model="demo", input="Look up 'cat'.", tools=[tool], tool_choice={"type": "function", "name": "lookup"},
               max_output_tokens=40, temperature=1.0)
    response = client.responses.create(**ask)
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "lookup" and set(json.loads(call.arguments)) == {"word"} and call.call_id
    events = list(client.responses.create(**ask, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == deltas and set(json.loads(deltas)) == {"word"}

    follow_up = client.responses.create(model="demo", previous_response_id=response.id, tools=[tool],
                                        input=[{"type": "function_call_output", "call_id": call.call_id,
                                                "output": "a small animal"}],
                                        max_output_tokens=8, temperature=0.0, tool_choice="none")
    assert follow_up.status in ("completed", "incomplete") and follow_up.output_text


def test_bad_responses_requests_are_400s_naming_the_field(served):
    _, url = served
    for body, param in [
        ({"model": "demo"}, "input"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
         "text.format"),
        ({"input": "hi", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
         "tool_choice"),
    ]:
        r = httpx.post(url + "/v1/responses", json=body, timeout=30)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.text)
