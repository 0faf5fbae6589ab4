"""Token masks: a request's JSON schema, regex, choice or grammar (structured outputs), and the stop
tokens it may not sample yet (min_tokens), as a token mask per step.

llguidance does the grammar work on the host (no torch: it fills numpy int32 bitmasks, 32 tokens a
word, in Rust with the GIL released). A request's grammar is compiled when it is submitted, on the
caller's thread (the server's intake threads), not on the step loop: the compiled grammar text is
cached by its spec, and each request gets a matcher of its own. While the request runs, the
engine fills its row of the step's mask before the step is dispatched and feeds the matcher each
token the request samples; the device sampler turns the mask's bits into -inf logits.

A request short of its min_tokens has its stop tokens' bits cleared (in its grammar's mask, or in
a mask of ones): that mask depends on the row alone, never on the step before, so it is known when
the step is scheduled and stays the same until the request reaches min_tokens, which lets the
scheduler run such a row several decode steps, or drafts, under one mask (`SamplingParams.mask_limit`).
"""

from __future__ import annotations

import collections
import json
import logging
import threading
from pathlib import Path
from typing import Any

import llguidance
import llguidance.numpy
import numpy as np

from jtp.core.scheduler import Status
from jtp.core.step_input import mask_words
from jtp.errors import RequestError

log = logging.getLogger(__name__)

CACHED_GRAMMARS = 256  # compiled grammars kept (by spec): a schema sent again is not compiled again
# JSON as models write it on one line, `{"a": 1, "b": [2, 3]}`: free whitespace would let a weak
# model pad forever before the closing brace (its outputs are noise, and a grammar cannot end them).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class StructuredOutputError(ValueError):
    """The schema, regex, choice or grammar cannot be compiled (the message says why)."""


class GrammarCompiler:
    def __init__(self, tokenizer_path: Path, vocab_size: int, eos_ids: frozenset[int]):
        """`vocab_size`: the model's (its logits' width), which may exceed the tokenizer's; tokens past
        the tokenizer's are never allowed. Nothing is loaded before the first structured request
        (or `load_in_background`)."""
        self.tokenizer_path, self.vocab_size, self.eos_ids = tokenizer_path, vocab_size, eos_ids
        self.words = mask_words(vocab_size)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._grammars: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._lock = threading.Lock()

    def load_in_background(self) -> None:
        """Build the tokenizer's llguidance copy on a thread (about a second at a 152k vocabulary, most
        of it under the GIL) while the engine starts, not at the first structured request. Not a
        daemon: a process that exits meanwhile waits for it (Rust code cut short by the interpreter's
        exit can crash the process)."""
        def load():
            try:
                self.tokenizer
            except StructuredOutputError as e:  # said again, to the request that asks for a grammar
                log.info("structured outputs unavailable: %s", e)

        threading.Thread(target=load, name="jtp-llguidance-tokenizer").start()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                try:
                    self._tokenizer = llguidance.LLTokenizer(self.tokenizer_path.read_text(), n_vocab=self.vocab_size,
                                                             eos_token=sorted(self.eos_ids))
                except ValueError as e:
                    raise StructuredOutputError(f"structured outputs cannot use this model's tokenizer: {e}") from None
                self._executor = llguidance.LLExecutor()
            return self._tokenizer

    def matcher(self, spec: dict, think_first: str | None = None) -> llguidance.LLMatcher:
        """A fresh matcher of `spec` (one of `SamplingParams.structured_outputs`) after the think block
        `think_first` says (`SamplingParams.think_first`), or StructuredOutputError."""
        return llguidance.LLMatcher(self.tokenizer, self.grammar(spec, think_first), log_level=0)

    def grammar(self, spec: dict, think_first: str | None = None) -> str:
        """The validated llguidance grammar of `spec`, after the think block `think_first` says (cached)."""
        tokenizer = self.tokenizer
        key = json.dumps([spec, think_first], sort_keys=True)
        with self._lock:
            if key in self._grammars:
                self._grammars.move_to_end(key)
                return self._grammars[key]
        kind, value = next(iter(spec.items()))
        try:
            grammar = _grammar(kind, value)
            if think_first is not None:
                grammar = _after_think(grammar, think_first)
        except ValueError as e:
            raise StructuredOutputError(f"invalid structured output {kind}: {e}") from None
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
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


def request_matcher(grammars: GrammarCompiler | None, params, unsupported: str | None):
    """The matcher of a request's structured output (None without one), or RequestError saying why
    not (`unsupported`: what in this engine cannot mask, else None)."""
    if params.structured_outputs is None:
        return None
    if grammars is None:
        unsupported = unsupported or "this model has no tokenizer"
    if unsupported:
        raise RequestError(f"structured outputs are not supported here: {unsupported}")
    try:
        return grammars.matcher(params.structured_outputs, params.think_first)
    except StructuredOutputError as e:
        raise RequestError(str(e)) from None


def constrained_rows(rows: list) -> list[tuple]:
    """(matcher, row index) of a step's scheduled rows (`ScheduledRow`s) that sample under a grammar;
    a request that ended meanwhile (its token is discarded) is left out."""
    return [(row.request.grammar, b) for b, row in enumerate(rows)
            if row.request.grammar is not None and row.picks_next_token and row.request.status is Status.RUNNING]


def short_rows(rows: list) -> list[tuple[int, frozenset[int]]]:
    """(row index, stop token ids) of a step's scheduled rows whose (first) sampled token comes before
    their request's min_tokens: those stop tokens cannot be sampled there."""
    out = []
    for b, row in enumerate(rows):
        req = row.request
        output_index = row.start + row.num_tokens - len(row.drafts) - len(req.prompt_ids)  # the token it samples
        if row.picks_next_token and output_index < req.params.min_tokens and req.stop_ids:
            out.append((b, req.stop_ids))
    return out


def has_masks(rows: list) -> bool:
    """Whether a step carries token masks: a row samples under a grammar or short of its min_tokens."""
    return bool(constrained_rows(rows) or short_rows(rows))


def token_masks(grammars: GrammarCompiler | None, rows: list, words: int) -> np.ndarray | None:
    """i32[rows, words]: the token masks of a step's scheduled rows (a grammar's, then min_tokens' stop
    tokens cleared; ones elsewhere), or None when no row has one."""
    constrained, short = constrained_rows(rows), short_rows(rows)
    if not constrained and not short:
        return None
    masks = grammars.fill(constrained, len(rows)) if constrained else np.full((len(rows), words), -1, np.int32)
    bits = masks.view(np.uint32)  # clearing a bit here clears it in `masks`
    for b, stop_ids in short:
        ids = np.fromiter(stop_ids, np.int64)
        row = bits[b].copy()
        np.bitwise_and.at(bits[b], ids // 32, ~np.left_shift(np.uint32(1), (ids % 32).astype(np.uint32)))
        if not bits[b].any():  # the grammar can only end: it wins over min_tokens (an empty mask samples noise)
            bits[b] = row
    return masks


def advance_grammars(rows: list, tokens: list[int]) -> dict[int, str]:
    """Feed each row's sampled token (`tokens[b]`) to its request's grammar, before the rest of the
    step's output is processed (so the next step's masks can be filled meanwhile): {row index: "stop"}
    for the rows whose grammar ended."""
    reasons = {}
    for b, row in enumerate(rows):
        if row.request.grammar is not None and row.picks_next_token and row.request.status is Status.RUNNING:
            if reason := advance_grammar(row.request, tokens[b]):
                reasons[b] = reason
    return reasons


def advance_grammar(request, token: int) -> str | None:
    """Feed a request's sampled token to its grammar: "stop" once the grammar is complete (the mask
    allowed only tokens it takes, so a refusal is a bug, logged, and ends the output too), else None."""
    grammar = request.grammar
    if grammar is None:
        return None
    if not grammar.consume_token(token):
        log.warning("request %s: the grammar refused sampled token %d (%s)", request.id, token, grammar.get_error())
        return "stop"
    return "stop" if grammar.is_stopped() else None


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


# A thinking model's think block before the structure: free text between the `<think>` and `</think>`
# tokens (named as special tokens: a text regex or literal cannot take a special token), then the
# newlines the model writes after it; "open": the prompt opened the block, the output closes it.
_THINK_BLOCK = {"optional": "(<think> THOUGHT </think> /\\n*/)?", "open": "THOUGHT </think> /\\n*/"}
_THOUGHT = "THOUGHT: /(.|\\n)*/\n"


def _after_think(grammar: str, think_first: str) -> str:
    """`grammar` (llguidance's JSON of its grammars, or Lark text) after a think block, as one grammar."""
    if think_first not in _THINK_BLOCK:
        raise ValueError(f"unknown think_first {think_first!r}")
    top = json.loads(grammar) if grammar.lstrip().startswith("{") else {"grammars": [{"lark_grammar": grammar}]}
    (answer,) = top["grammars"]
    wrapper = {"name": "start", "lark_grammar": f"start: {_THINK_BLOCK[think_first]} @answer\n{_THOUGHT}"}
    return json.dumps({**top, "grammars": [wrapper, {**answer, "name": "answer"}]})
