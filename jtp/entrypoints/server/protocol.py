"""Request bodies of the OpenAI API, checked and turned into jtp's terms.

Known fields are type-checked (a wrong type is a 400 naming the field); fields this server
does not know, such as `user` or `metadata`, are ignored as OpenAI clients expect. Fields
that would change the result but are not implemented (`suffix`, the legacy
`functions`, ...) are refused rather than silently ignored. `null` means "not given" for every optional field.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from jtp.core.sampling_params import MAX_LOGPROBS, SamplingParams, check_stop_strings, check_structured_outputs
from jtp.entrypoints.server.errors import APIError

MAX_N = 128  # choices per request; each is a separate engine request

# field -> accepted JSON types; a `float` field also takes an int, an `int` field never a bool
_SAMPLING_FIELDS: dict[str, tuple] = {
    "temperature": (float,),
    "top_p": (float,),
    "top_k": (int,),
    "min_p": (float,),
    "presence_penalty": (float,),
    "frequency_penalty": (float,),
    "repetition_penalty": (float,),
    "stop": (str, list),
    "stop_token_ids": (list,),
    "ignore_eos": (bool,),
    "speculate": (bool,),  # jtp: false opts this request out of speculative decoding
    "logit_bias": (dict,),  # token id -> bias; its keys and values are checked with the others (SamplingParams)
    "min_tokens": (int,),
    "include_stop_str_in_output": (bool,),  # vLLM's: the matched stop string ends the text
    "skip_special_tokens": (bool,),
}
_COMMON_FIELDS: dict[str, tuple] = {
    **_SAMPLING_FIELDS,
    "model": (str,),
    "n": (int,),
    "stream": (bool,),
    "stream_options": (dict,),
    "max_tokens": (int,),
    "seed": (int,),
    "prompt_logprobs": (int,),  # vLLM's: each prompt token's logprob and the top n there
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its legacy guided_* names
    "response_format": (dict,),
    "structured_outputs": (dict,),
    "guided_json": (dict, str),
    "guided_regex": (str,),
    "guided_choice": (list,),
    "guided_grammar": (str,),
}
_COMPLETION_FIELDS: dict[str, tuple] = {
    **_COMMON_FIELDS,
    "prompt": (str, list),
    "logprobs": (int,),
    "echo": (bool,),
    "suffix": (str,),
    "best_of": (int,),
    "tools": (list,),
    "tool_choice": (str, dict),
}
_CHAT_FIELDS: dict[str, tuple] = {
    **_COMMON_FIELDS,
    "messages": (list,),
    "logprobs": (bool,),
    "top_logprobs": (int,),
    "max_completion_tokens": (int,),
    "chat_template_kwargs": (dict,),
    "add_generation_prompt": (bool,),  # vLLM's: false renders the chat without opening the assistant's turn
    "continue_final_message": (bool,),  # vLLM's: the reply goes on from the final (assistant) message's text
    "tools": (list,),
    "tool_choice": (str, dict),
    "parallel_tool_calls": (bool,),
    "functions": (list,),
    "function_call": (str, dict),
}

# vLLM's request fields that this server does not implement, each with its value that changes nothing
# (or null, or an empty list): any other value would change the output, so it is refused, not ignored.
_UNSERVED: dict[str, Any] = {"allowed_token_ids": None, "bad_words": None, "truncate_prompt_tokens": None,
                             "use_beam_search": False, "return_tokens_as_token_ids": False,
                             "spaces_between_special_tokens": True, "guided_whitespace_pattern": None}
_UNSERVED_CHAT: dict[str, Any] = {**_UNSERVED, "chat_template": None, "echo": False}


@dataclasses.dataclass
class GenerationRequest:
    """What both endpoints share: how many choices, how to sample, how to stream."""

    model: str | None
    n: int
    stream: bool
    include_usage: bool
    max_tokens: int | None  # None: the endpoint's default
    seed: int | None
    num_logprobs: int | None  # None: no logprobs; k: the sampled token's plus the top k
    prompt_logprobs: int | None  # None: none; k: each prompt token's logprob plus the top k
    sampling: dict[str, Any]  # the remaining SamplingParams fields that were given
    structure_param: str | None  # the field that asked for a structured output (for its errors), else None


@dataclasses.dataclass
class CompletionRequest(GenerationRequest):
    prompts: list[str | list[int]]  # one or more; each gets n choices
    echo: bool = False  # the prompt first in each choice's text (and its logprobs, with logprobs)
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone (a token is generated and dropped)


@dataclasses.dataclass
class ChatRequest(GenerationRequest):
    messages: list[dict]
    tools: list[dict] | None
    template_kwargs: dict[str, Any]
    # "none", "auto", "required" or a function's name; None when the request has no tools
    tool_choice: str | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # The image parts' URLs (data: URIs) in conversation order; in `messages` each is {"type": "image"}.
    images: list[str] = dataclasses.field(default_factory=list)


def parse_completion_request(body: Any) -> CompletionRequest:
    fields = _checked(body, _COMPLETION_FIELDS)
    _refuse_unserved(body, _UNSERVED)
    if fields.get("suffix"):
        raise APIError("suffix is not supported", param="suffix")
    for name in ("tools", "tool_choice"):
        if name in fields:
            raise APIError(f"{name} is a chat field: /v1/completions takes no tools; use /v1/chat/completions",
                           param=name)
    n = _n(fields)
    if fields.get("best_of", n) != n:
        raise APIError("best_of other than n is not supported", param="best_of")
    logprobs = fields.get("logprobs")
    _check_range("logprobs", logprobs, 0, MAX_LOGPROBS)
    echo, max_tokens = fields.get("echo", False), fields.get("max_tokens")
    echo_only = echo and max_tokens == 0  # scoring a text (lm-eval's loglikelihood), as vLLM serves it
    common = _common(fields, n, 1 if echo_only else max_tokens)
    if echo and logprobs is not None:  # the echoed prompt's tokens carry logprobs too
        common["prompt_logprobs"] = max(common["prompt_logprobs"] or 0, logprobs)
    return CompletionRequest(
        **common,
        num_logprobs=logprobs,
        prompts=_prompts(fields.get("prompt")),
        echo=echo,
        echo_only=echo_only,
    )


def parse_chat_request(body: Any) -> ChatRequest:
    fields = _checked(body, _CHAT_FIELDS)
    _refuse_unserved(body, _UNSERVED_CHAT)
    top = fields.get("top_logprobs")
    _check_range("top_logprobs", top, 0, MAX_LOGPROBS)
    if top is not None and not fields.get("logprobs"):
        raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
    max_tokens = fields.get("max_completion_tokens", fields.get("max_tokens"))
    for name in ("max_completion_tokens", "max_tokens"):  # named as sent (the engine knows only max_tokens)
        if fields.get(name) is not None and fields[name] < 1:
            raise APIError(f"{name} must be >= 1, got {fields[name]}", param=name)
    for legacy, name in (("functions", "tools"), ("function_call", "tool_choice")):
        if legacy in fields:
            raise APIError(f"the legacy {legacy} field is not supported; send {name}", param=legacy)
    tools = _tools(fields.get("tools"))
    n = _n(fields)
    tool_choice = _tool_choice(fields.get("tool_choice"), tools)
    if tool_choice not in (None, "none") and n > 1:
        raise APIError("n > 1 is not supported with tools; ask for one choice", param="n")
    common = _common(fields, n, max_tokens)
    if tool_choice not in (None, "none", "auto"):  # the grammar makes the model call
        if common["structure_param"] is not None:
            raise APIError(f"tool_choice {tool_choice!r} and {common['structure_param']} both constrain the "
                           f"output; give one", param="tool_choice")
        common["sampling"]["structured_outputs"] = {
            "json": forced_calls_schema(tools, tool_choice, fields.get("parallel_tool_calls", True))}
        common["structure_param"] = "tool_choice"
    images: list[str] = []
    req = ChatRequest(
        **common,
        num_logprobs=(top or 0) if fields.get("logprobs") else None,
        messages=_messages(fields.get("messages"), images),
        images=images,
        tools=tools,
        template_kwargs=fields.get("chat_template_kwargs") or {},
        tool_choice=tool_choice,
        parallel_tool_calls=fields.get("parallel_tool_calls", True),
        add_generation_prompt=fields.get("add_generation_prompt", True),
        continue_final_message=fields.get("continue_final_message", False),
    )
    if req.continue_final_message and req.messages[-1]["role"] != "assistant":
        raise APIError("continue_final_message needs an assistant message last", param="continue_final_message")
    return req


def sampling_params(req: GenerationRequest, max_tokens: int, choice: int, defaults: dict) -> SamplingParams:
    """The engine parameters of one choice: the request's fields, `defaults` (the engine's, from the
    generation config) for those it leaves unset. With a seed, choice j samples with seed + j:
    reproducible, yet the n choices differ. Values are checked by the engine at submit."""
    seed = None if req.seed is None else req.seed + choice
    return SamplingParams(**{**defaults, **req.sampling, "max_tokens": max_tokens, "seed": seed,
                             "logprobs": req.num_logprobs, "prompt_logprobs": req.prompt_logprobs})


# ----------------------------------------------------------------------------- helpers


def _checked(body: Any, known: dict[str, tuple]) -> dict[str, Any]:
    """The known, non-null fields of the body, each of an accepted type."""
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, got {type(body).__name__}")
    fields = {k: v for k, v in body.items() if k in known and v is not None}
    for name, value in fields.items():
        if not _is_type(value, known[name]):
            raise APIError(f"{name} must be {_type_names(known[name])}, got {value!r}", param=name)
    return fields


def _refuse_unserved(body: dict, unserved: dict[str, Any]) -> None:
    for name, default in unserved.items():
        value = body.get(name)
        if value is not None and value != default and value != []:
            accepted = "null" if default is None else f"{json.dumps(default)} or null"
            raise APIError(f"{name} is not supported by this server (only {accepted})", param=name)


def _is_type(value: Any, kinds: tuple) -> bool:
    if isinstance(value, bool):  # bool is an int subclass in Python, not in JSON
        return bool in kinds
    if isinstance(value, int):
        return int in kinds or float in kinds
    return isinstance(value, kinds)


def _type_names(kinds: tuple) -> str:
    names = {int: "an integer", float: "a number", bool: "a boolean", str: "a string", list: "an array",
             dict: "an object"}
    return " or ".join(names[k] for k in kinds)


def _check_range(name: str, value: int | None, low: int, high: int) -> None:
    if value is not None and not low <= value <= high:
        raise APIError(f"{name} must be in [{low}, {high}], got {value}", param=name)


def _n(fields: dict[str, Any]) -> int:
    n = fields.get("n", 1)
    _check_range("n", n, 1, MAX_N)
    return n


def _common(fields: dict[str, Any], n: int, max_tokens: int | None) -> dict[str, Any]:
    if fields.get("stream_options") and not fields.get("stream"):  # vLLM's check: {} passes
        raise APIError("stream_options can only be given when stream is true (as in vLLM)", param="stream_options")
    options = fields.get("stream_options") or {}
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise APIError(f"stream_options.include_usage must be a boolean, got {include_usage!r}",
                       param="stream_options")
    stop = fields.get("stop")
    if stop is not None:  # checked before any tokenizing: a huge list is refused at once
        try:
            check_stop_strings([stop] if isinstance(stop, str) else stop)
        except ValueError as e:
            raise APIError(str(e), param="stop") from e
    prompt_logprobs = fields.get("prompt_logprobs")
    _check_range("prompt_logprobs", prompt_logprobs, 0, MAX_LOGPROBS)
    if prompt_logprobs is not None and fields.get("stream"):
        raise APIError("prompt_logprobs are not available when stream is true (as in vLLM)", param="prompt_logprobs")
    sampling = {k: v for k, v in fields.items() if k in _SAMPLING_FIELDS}
    structure, structure_param = _structure(fields)
    if structure is not None:
        sampling["structured_outputs"] = structure
    return dict(
        model=fields.get("model"),
        n=n,
        stream=fields.get("stream", False),
        include_usage=include_usage,
        max_tokens=max_tokens,
        seed=fields.get("seed"),
        prompt_logprobs=prompt_logprobs,
        sampling=sampling,
        structure_param=structure_param,
    )


_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _structure(fields: dict[str, Any]) -> tuple[dict | None, str | None]:
    """(SamplingParams.structured_outputs, the field that asked) from whichever field was given."""
    given = [name for name in ("response_format", "structured_outputs", *_GUIDED) if name in fields]
    if given == ["response_format"] and fields["response_format"].get("type") == "text":
        return None, None
    if len(given) > 1:
        raise APIError(f"{' and '.join(given)} both constrain the output; give one", param=given[1])
    if not given:
        return None, None
    name = given[0]
    value = fields[name]
    if name == "response_format":
        kind = value.get("type")
        if kind == "json_object":
            spec = {"json_object": True}
        elif kind == "json_schema":
            schema = (value.get("json_schema") or {}).get("schema") if isinstance(value.get("json_schema"), dict) else None
            if not isinstance(schema, (dict, bool)):
                raise APIError("response_format json_schema needs json_schema.schema, a JSON schema object",
                               param="response_format")
            spec = {"json": schema}
        else:
            raise APIError(f'response_format type must be "text", "json_object" or "json_schema", got {kind!r}',
                           param="response_format")
    elif name == "structured_outputs":
        spec = {k: v for k, v in value.items() if v is not None and v is not False}
    else:
        spec = {_GUIDED[name]: value}
    try:
        check_structured_outputs(spec)
    except ValueError as e:
        raise APIError(str(e), param=name) from None
    return spec, name


def forced_calls_schema(tools: list[dict], tool_choice: str, parallel: bool = True) -> dict:
    """The JSON the model must write when it has to call: a named function's arguments, or
    ("required") a list of one or more {"name", "parameters"} calls of the declared functions (one
    at most without parallel tool calls)."""
    parameters = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    if tool_choice != "required":
        return parameters[tool_choice]
    calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, schema in parameters.items()]
    return {"type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}), "items": {"anyOf": calls}}


def _prompts(prompt: Any) -> list[str | list[int]]:
    """A string, a token id list, or a list of either (a batch)."""
    if prompt is None:
        raise APIError("prompt is required", param="prompt")
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(_is_type(t, (int,)) for t in prompt):
        return [prompt]
    if prompt and all(isinstance(p, str) or (isinstance(p, list) and p and all(_is_type(t, (int,)) for t in p))
                      for p in prompt):
        return list(prompt)
    raise APIError("prompt must be a string, a non-empty array of token ids, or an array of those",
                   param="prompt")


_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


def _tools(tools: list | None) -> list[dict] | None:
    """Function tools, each {"type": "function", "function": {"name", "description"?, "parameters"?}}."""
    if not tools:
        return None
    names = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise APIError(f"{where} must be an object of type \"function\" (the only tool type served)",
                           param="tools")
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise APIError(f"{where}.function must be an object with a string name", param="tools")
        if not _FUNCTION_NAME.fullmatch(function["name"]):
            raise APIError(f"{where}.function.name {function['name']!r} must be 1-64 letters, digits, "
                           f"underscores, dashes, dots or colons", param="tools")
        if function["name"] in names:
            raise APIError(f"{where}: a second tool named {function['name']!r}", param="tools")
        names.add(function["name"])
        if not isinstance(function.get("parameters", {}), dict):
            raise APIError(f"{where}.function.parameters must be a JSON schema object", param="tools")
    return [{"type": "function", "function": t["function"]} for t in tools]


def _tool_choice(choice: str | dict | None, tools: list[dict] | None) -> str | None:
    """"none", "auto", "required" or the name of a declared function (None: no tools)."""
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise APIError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                           '"function": {"name": ...}}', param="tool_choice")
        if not tools or name not in {t["function"]["name"] for t in tools}:
            raise APIError(f"tool_choice names the function {name!r}, which is not among the request's tools",
                           param="tool_choice")
        return name
    if choice is not None and choice not in ("none", "auto", "required"):
        raise APIError(f'tool_choice must be "none", "auto", "required" or a named function, got {choice!r}',
                       param="tool_choice")
    if choice in ("auto", "required") and not tools:
        raise APIError(f"tool_choice {choice!r} needs tools", param="tool_choice")
    if not tools:
        return None
    return choice or "auto"


def _messages(messages: Any, images: list[str]) -> list[dict]:
    """The messages, each image part's URL appended to `images`."""
    if not messages:
        raise APIError("messages must be a non-empty array", param="messages")
    return [_message(m, i, images) for i, m in enumerate(messages)]


def _message(message: Any, i: int, images: list[str]) -> dict:
    where = f"messages[{i}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise APIError(f"{where} must be an object with a string role", param="messages")
    content = message.get("content")
    if content is None and message["role"] != "assistant":
        # the chat template would fail on it with an obscure error; an assistant turn without text is
        # empty (vLLM takes it so, and OpenAI's own tool-call turns have null content)
        raise APIError(f"{where}.content is required: only an assistant message may leave it null",
                       param=f"{where}.content")
    if isinstance(content, list):
        parts = [_content_part(part, f"{where}.content[{j}]", images) for j, part in enumerate(content)]
        if all(part["type"] == "text" for part in parts):  # text alone: one string, as a text model's template takes
            message = {**message, "content": "\n".join(part["text"] for part in parts)}
        else:  # the parts as the multimodal chat templates take them (Qwen3.5's: text items joined as they are)
            message = {**message, "content": parts}
    elif content is not None and not isinstance(content, str):
        raise APIError(f"{where}.content must be a string, an array of content parts or null", param="messages")
    if message.get("tool_calls") is not None:
        message = {**message, "tool_calls": _message_tool_calls(message["tool_calls"], where)}
    elif content is None:  # an assistant turn without text: empty, for templates that read its content
        message = {**message, "content": ""}
    return message


def _content_part(part: Any, where: str, images: list[str]) -> dict:
    """A text part as it is; an image_url part ({"url": ..., "detail": ...} or the URL alone) as
    {"type": "image"}, its URL appended to `images`."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    if kind == "image_url":
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, dict) else image
        if not isinstance(url, str):
            raise APIError(f"{where}.image_url must be an object with a string url", param="messages")
        images.append(url)
        return {"type": "image"}  # `detail` has no meaning here: the image processor sizes every image alike
    raise APIError(f"{where}: only text and image_url content parts are supported", param="messages")


def _message_tool_calls(calls: Any, where: str) -> list[dict]:
    """An assistant message's earlier calls, their arguments as objects: chat templates iterate over
    them (Qwen3-Coder's) or write them as JSON (Qwen3's), and a string would be written twice quoted."""
    if not isinstance(calls, list):
        raise APIError(f"{where}.tool_calls must be an array", param="messages")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise APIError(f"{where}.tool_calls[{j}].function must be an object with a string name",
                           param="messages")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                raise APIError(f"{where}.tool_calls[{j}].function.arguments is not valid JSON", param="messages") from None
        if not isinstance(arguments, dict):
            raise APIError(f"{where}.tool_calls[{j}].function.arguments must be a JSON object", param="messages")
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out
