"""Structured outputs: JSON schemas, regexes, choices and grammars enforced by a token mask in the step.

The model is the demo checkpoint (a tiny trained model: left alone it writes prose, never JSON),
sampled at temperature 1 with several seeds, so only the grammar can make its outputs valid. Each
output is checked independently of the grammar library: `json.loads` and the schema's constraints
checked by hand, `re.fullmatch`, membership. A constrained row beside an unconstrained greedy one
leaves that row's tokens as its solo run gives them. Through a live `jtp serve`-style app on
loopback, the real `openai` client's response_format / extra_body fields and forced tool calls
(tool_choice "required" and a named function) come back valid, streamed and whole alike, and a bad
schema, regex or grammar is a 400 naming its field.
"""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from loopback import serving

from jtp.config.engine_args import EngineArgs
from jtp.core.sampling_params import SamplingParams
from jtp.engine.engine import Engine
from jtp.entrypoints.server import build_app
from jtp.errors import RequestError

ARGS = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=1024, block_size=32, num_blocks=128, warmup=False)
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 0},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
                         "ok": {"type": "boolean"}}}
PROMPT = "Tell me about a person:"


def is_person(value) -> bool:
    """PERSON's constraints, checked by hand."""
    return (isinstance(value, dict) and set(value) - {"ok"} == {"name", "age", "tags"}
            and isinstance(value["name"], str) and len(value["name"]) <= 10
            and type(value["age"]) is int and value["age"] >= 0
            and isinstance(value["tags"], list) and len(value["tags"]) <= 3 and set(value["tags"]) <= {"a", "b"}
            and type(value.get("ok", True)) is bool)


@pytest.fixture(scope="module")
def engine(demo_dir):
    with Engine.from_args(EngineArgs(model=str(demo_dir), **ARGS)) as eng:
        yield eng


def generate(engine, params: list[SamplingParams], prompt: str = PROMPT) -> list[tuple[str, str]]:
    """(text, finish reason) of each request."""
    ids = engine.tokenizer.encode(prompt)
    return [(engine.tokenizer.decode(r.token_ids), r.finish_reason)
            for r in engine.generate([ids] * len(params), params)]


def test_every_sampled_output_follows_its_structure(engine):
    """A bounded structure (a schema with bounded strings and arrays, a regex, a choice) always ends
    within max_tokens; an unbounded one (any object, a repeating grammar) may run out of tokens, as a
    real model's may, so its outputs that end are checked, and most must end."""
    grammar = 'start: "(" item ("," item)* ")"\nitem: /[0-9]{1,3}/ | "x"'
    cases = [
        ({"json": PERSON}, True, lambda t: is_person(json.loads(t))),
        ({"regex": r"[A-Z][a-z]{2,6}-[0-9]{2}"}, True, lambda t: re.fullmatch(r"[A-Z][a-z]{2,6}-[0-9]{2}", t)),
        ({"choice": ["red", "green", 'blue "sky"']}, True, lambda t: t in ("red", "green", 'blue "sky"')),
        ({"json_object": True}, False, lambda t: isinstance(json.loads(t), dict)),
        ({"grammar": grammar}, False, lambda t: re.fullmatch(r"\((?:[0-9]{1,3}|x)(?:,(?:[0-9]{1,3}|x))*\)", t)),
    ]
    seeds = 4
    params = [SamplingParams(max_tokens=160, temperature=1.0, seed=seed, structured_outputs=spec)
              for spec, _, _ in cases for seed in range(seeds)]
    outputs = generate(engine, params)
    for k, (spec, bounded, valid) in enumerate(cases):
        mine = outputs[seeds * k: seeds * (k + 1)]
        ended = [text for text, reason in mine if reason == "stop"]
        assert len(ended) == seeds if bounded else 2 * len(ended) >= seeds, (spec, mine)
        for text in ended:
            assert valid(text), (spec, text)
    plain = generate(engine, [SamplingParams(max_tokens=40, temperature=1.0, seed=s) for s in range(4)])
    assert not any(t.lstrip().startswith("{") for t, _ in plain), plain  # left alone, the model writes no JSON


def test_a_constrained_row_leaves_its_neighbours_tokens_alone(engine):
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    seeded = SamplingParams(max_tokens=24, temperature=0.8, seed=7)
    ids = engine.tokenizer.encode(PROMPT)
    solo = [r.token_ids for r in engine.generate([ids, ids], [greedy, seeded])]
    constrained = SamplingParams(max_tokens=60, temperature=1.0, seed=1, structured_outputs={"json": PERSON})
    mixed = engine.generate([ids, ids, ids], [greedy, constrained, seeded])
    assert [mixed[0].token_ids, mixed[2].token_ids] == solo
    assert is_person(json.loads(engine.tokenizer.decode(mixed[1].token_ids)))


def test_masks_filled_late_give_the_lockstep_tokens(engine):
    """Overlapped (the forward of step N+1 enqueued before step N's tokens advance the grammars, the
    masks filled after) and lockstep (every step processed before the next is built) runs of the
    same seeded requests sample the same tokens."""
    params = [SamplingParams(max_tokens=60, temperature=1.0, seed=s, structured_outputs=spec)
              for s, spec in enumerate([{"json": PERSON}, {"regex": "[a-z]{3,9}( [a-z]{2,5}){1,3}"}, None, None])]
    ids = engine.tokenizer.encode(PROMPT)
    done = engine.step_done
    try:
        runs = []
        for finished in (lambda result: True, lambda result: False):  # lockstep, then always overlapped
            engine.step_done = finished
            runs.append([r.token_ids for r in engine.generate([ids] * len(params), params)])
    finally:
        engine.step_done = done
    assert runs[0] == runs[1]
    assert is_person(json.loads(engine.tokenizer.decode(runs[1][0])))


def test_think_first_leaves_the_think_block_free_then_applies_the_structure(engine):
    """think_first "open" (the prompt ends inside <think>): free text, </think> (biased to come soon),
    then the structure, of every kind; "optional": a think block or none, then the structure."""
    tok = engine.tokenizer
    start, end = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    cases = [({"json": PERSON}, lambda t: is_person(json.loads(t))),
             ({"regex": "[0-9]{3}"}, lambda t: re.fullmatch("[0-9]{3}", t)),
             ({"choice": ["red", "green"]}, lambda t: t in ("red", "green")),
             ({"grammar": 'root ::= "(" [a-z] [a-z] ")"'}, lambda t: re.fullmatch(r"\([a-z]{2}\)", t))]
    params = [SamplingParams(max_tokens=160, temperature=1.0, seed=3, structured_outputs=spec, think_first="open",
                             logit_bias={end: 10}) for spec, _ in cases]
    for (spec, valid), (text, reason) in zip(cases, generate(engine, params, "<think>\nA person")):
        thought, answer = text.split("</think>")
        assert thought.strip() and valid(answer.lstrip("\n")) and reason == "stop", (spec, text)
    optional = [SamplingParams(max_tokens=160, temperature=1.0, seed=1, structured_outputs={"json": PERSON},
                               think_first="optional", logit_bias={start: bias, end: 10}) for bias in (-100, 100)]
    (plain, _), (thinking, _) = generate(engine, optional)
    assert is_person(json.loads(plain))
    assert thinking.startswith("<think>") and is_person(json.loads(thinking.split("</think>")[1])), thinking
    with pytest.raises(ValueError, match="think_first"):
        SamplingParams(think_first="always").validate()


def test_bad_structures_are_request_errors_and_the_engine_keeps_serving(engine):
    for spec in ({"json": {"type": "nonsense"}}, {"regex": "[a-"}, {"grammar": "start: undefined_rule"},
                 {"json": "{not json"}, {"json": 3}, {"choice": []}, {"regex": "a", "choice": ["a"]}):
        with pytest.raises((RequestError, ValueError)):
            engine.submit([1, 2, 3], SamplingParams(max_tokens=4, structured_outputs=spec))
    assert generate(engine, [SamplingParams(max_tokens=8, temperature=0.0)])[0][0]  # still serving


def test_an_engine_that_cannot_mask_refuses_structured_outputs(demo_dir):
    with Engine.from_args(EngineArgs(model=str(demo_dir), num_scheduler_steps=4, **ARGS)) as eng:
        with pytest.raises(RequestError, match="num-scheduler-steps"):
            eng.submit([1, 2], SamplingParams(structured_outputs={"regex": "a+"}))


# ----------------------------------------------------------------------------- through the server

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "days": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {},
                                                                    "additionalProperties": False}}},
]


@pytest.fixture(scope="module")
def served(engine):
    engine.start()  # the step loop a server runs on (warm-up skipped: ready by hand)
    engine.ready.set()
    with serving(build_app(engine, "demo", tool_parser="hermes")) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120), url


def test_response_format_and_vllm_fields_through_the_openai_client(served):
    client, _ = served
    messages = [{"role": "user", "content": "Describe a person."}]
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in range(3):
        reply = client.chat.completions.create(model="demo", messages=messages, response_format=schema,
                                               temperature=1.0, seed=seed, max_tokens=120)
        assert is_person(json.loads(reply.choices[0].message.content)), reply
        streamed = client.chat.completions.create(model="demo", messages=messages, response_format=schema,
                                                  temperature=1.0, seed=seed, max_tokens=120, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed) == reply.choices[0].message.content
    reply = client.chat.completions.create(model="demo", messages=messages, response_format={"type": "json_object"},
                                           temperature=1.0, seed=5, max_tokens=120)
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    for extra, valid in [
        ({"structured_outputs": {"regex": "[0-9]{4}"}}, lambda t: re.fullmatch("[0-9]{4}", t)),
        ({"guided_choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta")),
        ({"guided_regex": "(ab)+"}, lambda t: re.fullmatch("(ab)+", t)),
    ]:
        text = client.completions.create(model="demo", prompt="Once", temperature=1.0, seed=2, max_tokens=40,
                                         extra_body=extra).choices[0].text
        assert valid(text), (extra, text)


def test_forced_tool_calls_have_valid_arguments(served):
    client, _ = served
    messages = [{"role": "user", "content": "What is the weather?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(3):
        reply = client.chat.completions.create(model="demo", messages=messages, tools=TOOLS, tool_choice=named,
                                               temperature=1.0, seed=seed, max_tokens=80)
        choice = reply.choices[0]
        assert choice.finish_reason == "stop" and not choice.message.content
        (call,) = choice.message.tool_calls
        args = json.loads(call.function.arguments)
        assert call.function.name == "get_weather" and set(args) == {"city", "days"} and type(args["days"]) is int

        required = client.chat.completions.create(model="demo", messages=messages, tools=TOOLS, tool_choice="required",
                                                  parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=120)
        choice = required.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        for call in choice.message.tool_calls:
            args = json.loads(call.function.arguments)
            assert (call.function.name, sorted(args)) in (("get_weather", ["city", "days"]), ("now", []))

        calls: dict[int, dict] = {}
        for chunk in client.chat.completions.create(model="demo", messages=messages, tools=TOOLS,
                                                    tool_choice="required", parallel_tool_calls=False,
                                                    temperature=1.0, seed=seed, max_tokens=120, stream=True):
            for part in chunk.choices[0].delta.tool_calls or []:
                entry = calls.setdefault(part.index, {"name": "", "arguments": ""})
                entry["name"] += part.function.name or ""
                entry["arguments"] += part.function.arguments or ""
        assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == [
            (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]


def test_bad_structures_are_400s_naming_their_field(served):
    _, url = served
    chat = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    cases = [
        ({**chat, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
         "response_format"),
        ({**chat, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({**chat, "response_format": {"type": "yaml"}}, "response_format"),
        ({**chat, "structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
        ({**chat, "structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({**chat, "guided_grammar": "start: nowhere"}, "guided_grammar"),
        ({**chat, "guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
        ({**chat, "tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
    ]
    for body, param in cases:
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.text)
    assert httpx.post(url + "/v1/chat/completions", json=chat, timeout=60).status_code == 200


@pytest.fixture(scope="module")
def served_thinking(served, engine):
    """The same engine behind a server with the Qwen3 reasoning parser."""
    with serving(build_app(engine, "demo", reasoning_parser="qwen3")) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_with_a_reasoning_parser_the_schema_applies_after_the_thinking(served, served_thinking, engine):
    """As vLLM's: the model thinks freely (the opening <think> forced by logit_bias, </think> biased to
    come soon), then the content follows the schema, whole and streamed alike; with enable_thinking
    false (the prompt closes the think block) or without the parser, the schema applies from the first
    token, so the forced <think> cannot come."""
    tok = engine.tokenizer
    bias = {str(tok.token_to_id("<think>")): 100, str(tok.token_to_id("</think>")): 10}
    ask = dict(model="demo", messages=[{"role": "user", "content": "Describe a person."}], temperature=1.0, seed=0,
               max_tokens=160, logit_bias=bias,
               response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    message = served_thinking.chat.completions.create(**ask).choices[0].message
    assert message.reasoning_content and is_person(json.loads(message.content)), message
    reasoning = content = ""
    for chunk in served_thinking.chat.completions.create(**ask, stream=True):
        reasoning += getattr(chunk.choices[0].delta, "reasoning_content", None) or ""
        content += chunk.choices[0].delta.content or ""
    assert (reasoning, content) == (message.reasoning_content, message.content)

    off = served_thinking.chat.completions.create(**ask, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.reasoning_content is None and is_person(json.loads(off.choices[0].message.content))
    plain = served[0].chat.completions.create(**ask).choices[0].message
    assert is_person(json.loads(plain.content)), plain
