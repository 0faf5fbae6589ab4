"""Sampling parameters of a request, checked at submit, and their per-step numpy packing.

`SamplingParams` is what a caller asks for (vLLM's / OpenAI's field names); `pack_sampling`,
`pack_penalty_tokens` and `pack_logit_bias` lay a step's rows out as the numpy arrays the device
sampler reads (`jtp.worker.sampler`). Host only: numpy, never jax.
"""
from __future__ import annotations

import dataclasses
import math
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, NoReturn, Sequence

import numpy as np

from jtp.core.step_input import GREEDY_EPS, SamplingBatch, bucket_sizes

MAX_LOGPROBS = 20
# Stop strings live in a per-request automaton on the step thread: bound its size.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 8192  # all of a request's stop strings together
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 300  # logit_bias entries of a request (OpenAI's bound): the width of a step's bias arrays
MAX_BIAS = 100.0  # |bias| (OpenAI's range)


class SamplingParamError(ValueError):
    """A sampling parameter out of its type or range; `param` names the field (an API error's param)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


# ----------------------------------------------------------------------------- host side


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 => greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 or -1 => disabled
    min_p: float = 0.0  # [0, 1]
    repetition_penalty: float = 1.0  # > 0; HF semantics, over prompt + generated tokens
    presence_penalty: float = 0.0  # [-2, 2]; OpenAI semantics, over generated tokens
    frequency_penalty: float = 0.0  # [-2, 2]; OpenAI semantics, over generated tokens
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # host-side stop strings
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None => none; n >= 0 => chosen logprob + top-n
    # vLLM's prompt_logprobs: None => none; n >= 0 => each prompt token's logprob (teacher-forced, from
    # the raw distribution) + the top n at its position. Such a request computes its whole prompt.
    prompt_logprobs: int | None = None
    speculate: bool = True  # False: never draft for this request (when the engine speculates)
    # vLLM's structured outputs: exactly one of {"json": schema, "json_object": true, "regex": str,
    # "choice": [str, ...], "grammar": Lark or GBNF text}; the output then follows it (a token mask).
    structured_outputs: dict | None = None
    # Where structured_outputs starts for a thinking model (vLLM's with a reasoning parser): None, at the first
    # token; "optional", after the think block the output may open with (`<think>...</think>`, free text);
    # "open", after the think block the prompt left open (the output first closes it with `</think>`).
    think_first: str | None = None
    # OpenAI's: token id (an int, or its string as JSON keys are) -> bias in [-100, 100], added to the logit.
    logit_bias: dict | None = None
    min_tokens: int = 0  # vLLM's: no stop token or stop string ends the output before it has this many tokens
    include_stop_str_in_output: bool = False  # vLLM's: the matched stop string stays at the end of the text
    skip_special_tokens: bool = True  # vLLM's: False keeps special tokens (<|im_end|>, ...) in the output text

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def structure(self) -> tuple[str, Any] | None:
        """(kind, spec) of the structured output asked for, else None (validate first)."""
        return next(iter(self.structured_outputs.items())) if self.structured_outputs else None

    @property
    def has_penalties(self) -> bool:
        """Whether the sampler's penalty stage applies: a penalty, or a logit bias (it rides the penalised
        sampling variant, whose steps carry the token history: lockstep, one decode step per dispatch)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0 or bool(self.logit_bias))

    def mask_limit(self, num_generated: int) -> int:
        """The output count at which the token mask of a request with `num_generated` outputs next
        changes: min_tokens while it is short of it (its stop tokens masked), else max_tokens."""
        return self.min_tokens if num_generated < self.min_tokens else self.max_tokens

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise SamplingParamError naming the field, its value and the allowed range. Normalises `stop`
        to a list and `logit_bias` to int token ids and float biases."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name, kinds in _FIELD_TYPES.items():
            value = getattr(self, name)
            if not _is_type(value, kinds):
                raise SamplingParamError(name, f"{name} must be {_type_names(kinds)}, got {value!r}")

        def check(name: str, ok: bool, allowed: str) -> None:
            if not ok:
                raise SamplingParamError(name, f"{name} must be {allowed}, got {getattr(self, name)!r}")

        check("max_tokens", self.max_tokens >= 1, ">= 1")
        check("min_tokens", 0 <= self.min_tokens <= self.max_tokens, f"in [0, max_tokens ({self.max_tokens})]")
        check("temperature", math.isfinite(self.temperature) and self.temperature >= 0,
              "a finite number >= 0")
        check("top_p", 0.0 < self.top_p <= 1.0, "in (0, 1]")
        if vocab_size is None:
            check("top_k", self.top_k >= -1, "-1, 0 (disabled) or >= 1")
        else:
            check("top_k", -1 <= self.top_k <= vocab_size,
                  f"-1, 0 (disabled) or in [1, {vocab_size}] (the vocab size)")
        check("min_p", 0.0 <= self.min_p <= 1.0, "in [0, 1]")
        check("repetition_penalty",
              math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0, "> 0")
        check("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "in [-2, 2]")
        check("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "in [-2, 2]")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                check(name, 0 <= getattr(self, name) <= MAX_LOGPROBS, f"None or in [0, {MAX_LOGPROBS}]")
        check_stop_strings(self.stop)
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise SamplingParamError("stop_token_ids", f"stop_token_ids holds {len(self.stop_token_ids)} ids; at most "
                                     f"{MAX_STOP_TOKEN_IDS} are allowed")
        check_structured_outputs(self.structured_outputs)
        check("think_first", self.think_first in THINK_FIRST, f"one of {THINK_FIRST}")
        for t in self.stop_token_ids:
            if not _is_type(t, (int,)) or t < 0 or (vocab_size is not None and t >= vocab_size):
                allowed = "ints >= 0" if vocab_size is None else f"ints in [0, {vocab_size})"
                raise SamplingParamError("stop_token_ids", f"stop_token_ids must hold {allowed}, got {t!r}")
        self.logit_bias = check_logit_bias(self.logit_bias, vocab_size)

    @classmethod
    def from_dict(cls, d: dict[str, Any], vocab_size: int | None = None) -> "SamplingParams":
        """Build from JSON-like input: unknown keys and wrong types are errors."""
        if not isinstance(d, dict):
            raise ValueError(f"sampling params must be an object, got {type(d).__name__}")
        unknown = sorted(set(d) - set(_FIELD_TYPES))
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(map(str, unknown))}; "
                             f"allowed: {', '.join(_FIELD_TYPES)}")
        for name, value in d.items():
            if not _is_type(value, _FIELD_TYPES[name]):
                raise SamplingParamError(name, f"{name} must be {_type_names(_FIELD_TYPES[name])}, got {value!r}")
        params = cls(**{k: (list(v) if isinstance(v, list) else v) for k, v in d.items()})
        params.validate(vocab_size)
        return params


STRUCTURE_KINDS = ("json", "json_object", "regex", "choice", "grammar")
THINK_FIRST = (None, "optional", "open")


def check_structured_outputs(spec: dict | None) -> None:
    """Raise ValueError unless `spec` is None or one structure of STRUCTURE_KINDS of the right type
    (whether the schema, regex or grammar itself is valid is the grammar compiler's to say)."""
    if spec is None:
        return
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in STRUCTURE_KINDS:
        raise SamplingParamError("structured_outputs", f"structured_outputs must hold exactly one of "
                                 f"{', '.join(STRUCTURE_KINDS)}, got {spec!r}"[:300])
    kind, value = next(iter(spec.items()))
    ok = {
        "json": isinstance(value, (dict, str, bool)),
        "json_object": value is True,
        "regex": isinstance(value, str) and value != "",
        "choice": isinstance(value, list) and bool(value) and all(isinstance(c, str) for c in value),
        "grammar": isinstance(value, str) and value.strip() != "",
    }[kind]
    if not ok:
        allowed = {"json": "a JSON schema (an object or its text)", "json_object": "true",
                   "regex": "a non-empty string", "choice": "a non-empty list of strings",
                   "grammar": "a non-empty Lark or GBNF grammar"}[kind]
        raise SamplingParamError("structured_outputs",
                                 f"structured_outputs.{kind} must be {allowed}, got {value!r}"[:300])


def check_stop_strings(stop: list) -> None:
    """Raise ValueError unless `stop` is a list of at most MAX_STOP_STRINGS strings of at most
    MAX_STOP_CHARS characters in all."""
    for s in stop:
        if not isinstance(s, str):
            raise SamplingParamError("stop", f"stop must hold strings only, got {s!r}")
    if len(stop) > MAX_STOP_STRINGS:
        raise SamplingParamError("stop", f"stop holds {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
    total = sum(len(s) for s in stop)
    if total > MAX_STOP_CHARS:
        raise SamplingParamError("stop", f"stop strings hold {total} characters in all; at most {MAX_STOP_CHARS} "
                                 f"are allowed")


def check_logit_bias(bias: dict | None, vocab_size: int | None = None) -> dict[int, float] | None:
    """`bias` with int token ids and float biases, or SamplingParamError: at most MAX_LOGIT_BIAS entries,
    keys token ids in [0, vocab_size) (ints, or strings of ints as JSON objects have them), each id once,
    biases numbers in [-MAX_BIAS, MAX_BIAS]."""
    if not bias:
        return bias

    def fail(message: str) -> NoReturn:
        raise SamplingParamError("logit_bias", f"logit_bias {message}"[:300])

    if len(bias) > MAX_LOGIT_BIAS:
        fail(f"holds {len(bias)} entries; at most {MAX_LOGIT_BIAS} are allowed")
    out: dict[int, float] = {}
    for key, value in bias.items():
        if isinstance(key, str) and re.fullmatch(r"-?[0-9]+", key):
            token = int(key)
        elif _is_type(key, (int,)):
            token = int(key)
        else:
            fail(f"keys must be token ids (integers, or strings of integers), got {key!r}")
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            allowed = f"in [0, {vocab_size})" if vocab_size is not None else ">= 0"
            fail(f"token ids must be {allowed}, got {key!r}")
        if token in out:
            fail(f"gives token id {token} twice")
        if not _is_type(value, (float,)) or not -MAX_BIAS <= value <= MAX_BIAS:
            fail(f"values must be numbers in [-{MAX_BIAS:g}, {MAX_BIAS:g}], got {value!r} for token id {token}")
        out[token] = float(value)
    return out


# field -> accepted types; `float` fields also take ints (JSON has one number type)
_FIELD_TYPES: dict[str, tuple] = {
    "max_tokens": (int,),
    "temperature": (float,),
    "top_p": (float,),
    "top_k": (int,),
    "min_p": (float,),
    "repetition_penalty": (float,),
    "presence_penalty": (float,),
    "frequency_penalty": (float,),
    "seed": (int, type(None)),
    "stop": (str, list),
    "stop_token_ids": (list,),
    "ignore_eos": (bool,),
    "logprobs": (int, type(None)),
    "prompt_logprobs": (int, type(None)),
    "speculate": (bool,),
    "structured_outputs": (dict, type(None)),
    "think_first": (str, type(None)),
    "logit_bias": (dict, type(None)),
    "min_tokens": (int,),
    "include_stop_str_in_output": (bool,),
    "skip_special_tokens": (bool,),
}
assert set(_FIELD_TYPES) == {f.name for f in dataclasses.fields(SamplingParams)}


def _is_type(value: Any, kinds: tuple) -> bool:
    if isinstance(value, bool):  # bool is an int subclass; only accept it where asked
        return bool in kinds
    if isinstance(value, (int, np.integer)):
        return int in kinds or float in kinds
    if isinstance(value, (float, np.floating)):
        return float in kinds
    return isinstance(value, kinds)


def _type_names(kinds: tuple) -> str:
    names = {int: "an int", float: "a number", bool: "a bool", str: "a string",
             list: "a list", dict: "an object", type(None): "null"}
    return " or ".join(names[k] for k in kinds)


def request_seed(params: SamplingParams) -> int:
    """The seed a request samples with: the user's, else a fresh random one."""
    return params.seed if params.seed is not None else secrets.randbits(32)


def pack_sampling(params: Sequence[SamplingParams | None], num_rows: int,
                  seeds: Sequence[int], steps: Sequence[int]) -> SamplingBatch:
    """Pack per-request params into arrays padded to `num_rows` (the row bucket).

    `params[i]` is None for an empty row; rows past len(params) are padding.
    Both get greedy, penalty-free defaults. `seeds[i]` is the request's seed
    (see `request_seed`), `steps[i]` how many tokens it has generated so far.
    """
    n = len(params)
    if n > num_rows or len(seeds) != n or len(steps) != n:
        raise ValueError(f"pack_sampling: {n} params, {len(seeds)} seeds, {len(steps)} steps "
                         f"for {num_rows} rows")

    def column(get, default, dtype):
        out = np.full((num_rows,), default, dtype)
        for i, p in enumerate(params):
            if p is not None:
                out[i] = get(p, i)
        return out

    return SamplingBatch(
        temperature=column(lambda p, i: p.temperature, 0.0, np.float32),
        top_p=column(lambda p, i: p.top_p, 1.0, np.float32),
        top_k=column(lambda p, i: max(p.top_k, 0), 0, np.int32),
        min_p=column(lambda p, i: p.min_p, 0.0, np.float32),
        repetition_penalty=column(lambda p, i: p.repetition_penalty, 1.0, np.float32),
        presence_penalty=column(lambda p, i: p.presence_penalty, 0.0, np.float32),
        frequency_penalty=column(lambda p, i: p.frequency_penalty, 0.0, np.float32),
        seed=column(lambda p, i: seeds[i] % 2**32, 0, np.uint32),
        step=column(lambda p, i: steps[i], 0, np.int32),
        logprobs=column(lambda p, i: -1 if p.logprobs is None else p.logprobs, -1, np.int32),
    )


PENALTY_MIN_LEN = 256  # the penalty history's shortest compiled length


def penalty_lengths(max_model_len: int) -> tuple[int, ...]:
    """The penalty history's compiled lengths: powers of four from PENALTY_MIN_LEN below
    max_model_len, then max_model_len (each one a sampling program per rows bucket: few)."""
    return bucket_sizes(PENALTY_MIN_LEN, max_model_len, base=4)


def penalty_len(longest: int, max_model_len: int | None = None) -> int:
    """The compiled length of a history of `longest` tokens (one of `penalty_lengths`)."""
    n = PENALTY_MIN_LEN
    while n < longest:
        n *= 4
    return n if max_model_len is None else min(n, max_model_len)


def pack_penalty_tokens(prompts: Sequence[Sequence[int] | None],
                        outputs: Sequence[Sequence[int] | None], num_rows: int,
                        max_model_len: int | None = None, length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Token history for penalties: (penalty_ids i32[B, L], penalty_is_output bool[B, L]).

    Row i holds prompts[i] then outputs[i], padded with -1. L is `length`, else `penalty_len` of
    the longest row (so the step compiles for few lengths).
    """
    rows = [(list(p or ()), list(o or ())) for p, o in zip(prompts, outputs, strict=True)]
    longest = max((len(p) + len(o) for p, o in rows), default=0)
    length = penalty_len(longest, max_model_len) if length is None else length
    if longest > length:
        raise ValueError(f"a penalty history of {longest} tokens does not fit length {length}")
    ids = np.full((num_rows, length), -1, np.int32)
    is_output = np.zeros((num_rows, length), bool)
    for i, (p, o) in enumerate(rows):
        ids[i, :len(p) + len(o)] = p + o
        is_output[i, len(p):len(p) + len(o)] = True
    return ids, is_output


def pack_logit_bias(params: Sequence[SamplingParams | None], num_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """The rows' logit biases: (ids i32[B, MAX_LOGIT_BIAS], biases f32[B, MAX_LOGIT_BIAS]), -1 ids padding.
    `params[i]` is None for a row that samples nothing."""
    ids = np.full((num_rows, MAX_LOGIT_BIAS), -1, np.int32)
    biases = np.zeros((num_rows, MAX_LOGIT_BIAS), np.float32)
    for i, p in enumerate(params):
        bias = (p.logit_bias or {}) if p is not None else {}
        ids[i, : len(bias)] = [int(t) for t in bias]
        biases[i, : len(bias)] = list(bias.values())
    return ids, biases


# ----------------------------------------------------------------------------- device side


