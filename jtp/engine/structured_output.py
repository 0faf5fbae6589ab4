"""Structured outputs: a request's JSON schema, regex, choice or grammar as a token mask per step.

llguidance does the grammar work on the host (no torch: it fills numpy int32 bitmasks, 32 tokens a
word, in Rust with the GIL released). A request's grammar is compiled when it is submitted, on the
caller's thread (the server's intake threads), not on the step loop: the compiled grammar text is
cached by its spec, and each request gets a matcher of its own. While the request runs, the
engine fills its row of the step's mask before the step is dispatched and feeds the matcher each
token the request samples; the device sampler turns the mask's bits into -inf logits.
"""

from __future__ import annotations

import collections
import json
import threading
from typing import Any

import llguidance
import llguidance.numpy
import numpy as np

from jtp.core.step_input import mask_words

CACHED_GRAMMARS = 256  # compiled grammars kept (by spec): a schema sent again is not compiled again
# JSON as models write it on one line, `{"a": 1, "b": [2, 3]}`: free whitespace would let a weak
# model pad forever before the closing brace (its outputs are noise, and a grammar cannot end them).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class StructuredOutputError(ValueError):
    """The schema, regex, choice or grammar cannot be compiled (the message says why)."""


class GrammarCompiler:
    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: frozenset[int]):
        """`vocab_size`: the model's (its logits' width), which may exceed the tokenizer's; tokens past
        the tokenizer's are never allowed."""
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=sorted(eos_ids))
        self.words = mask_words(vocab_size)
        self._executor = llguidance.LLExecutor()
        self._grammars: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._lock = threading.Lock()

    def matcher(self, spec: dict) -> llguidance.LLMatcher:
        """A fresh matcher of `spec` (one of `SamplingParams.structured_outputs`), or StructuredOutputError."""
        return llguidance.LLMatcher(self.tokenizer, self.grammar(spec), log_level=0)

    def grammar(self, spec: dict) -> str:
        """The validated llguidance grammar of `spec` (cached)."""
        key = json.dumps(spec, sort_keys=True)
        with self._lock:
            if key in self._grammars:
                self._grammars.move_to_end(key)
                return self._grammars[key]
        kind, value = next(iter(spec.items()))
        try:
            grammar = _grammar(kind, value)
        except ValueError as e:
            raise StructuredOutputError(f"invalid structured output {kind}: {e}") from None
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise StructuredOutputError(f"invalid structured output {kind}: {error.strip()[:1000]}")
        with self._lock:
            self._grammars[key] = grammar
            while len(self._grammars) > CACHED_GRAMMARS:
                self._grammars.popitem(last=False)
        return grammar

    def fill(self, rows: list[tuple[llguidance.LLMatcher, int]], num_rows: int) -> np.ndarray:
        """i32[num_rows, words]: row i's allowed tokens for the matchers given as (matcher, i); every
        other row allows every token."""
        mask = np.full((num_rows, self.words), -1, np.int32)
        llguidance.numpy.fill_next_token_bitmask_par(self._executor, rows, mask)
        return mask


def _grammar(kind: str, value: Any) -> str:
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, JSON_OPTIONS)
    if kind == "json":
        if isinstance(value, bool):  # JSON Schema's true: any JSON value
            value = {} if value else {"not": {}}
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"the schema is not JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"a JSON schema must be an object, got {type(value).__name__}")
        return llguidance.LLMatcher.grammar_from_json_schema(value, JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
    if kind == "grammar":
        return llguidance.grammar_from("grammar", value)
    raise ValueError(f"unknown kind {kind!r}")
