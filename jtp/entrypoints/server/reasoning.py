"""Qwen3 thinking output: `<think>reasoning</think>answer` split into reasoning and content.

The parser is fed text deltas as the engine streams them and returns the part of each delta
that is reasoning and the part that is content. A tag can arrive cut across deltas
(`</thi` + `nk>`), so text that could still become a tag is held back until it is decided.
Whole (non-streamed) outputs go through the same parser, so both ways give the same split.

Rules (what Qwen3 checkpoints emit):
- the output is reasoning from an opening `<think>` (leading whitespace before it dropped)
  up to `</think>`; without a leading `<think>` it is all content, unless the prompt itself
  ended inside a think block (templates that open `<think>` for the model);
- newlines right inside the tags and right after `</think>` are dropped, as Qwen3's chat
  template does when it renders a past turn;
- an output cut off while thinking (max_tokens) is all reasoning.
"""

from __future__ import annotations

THINK_START = "<think>"
THINK_END = "</think>"
TURN_START = "<|im_start|>"  # Qwen's chat turns

REASONING_PARSERS = ("qwen3",)

_START, _REASONING, _CONTENT = "start", "reasoning", "content"


def partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class Qwen3ReasoningParser:
    def __init__(self, prompt_ends_in_think: bool = False):
        self._state = _REASONING if prompt_ends_in_think else _START
        self._held = ""  # text received but not yet returned
        self._strip_newlines = prompt_ends_in_think  # at the start of a block's text

    @staticmethod
    def prompt_ends_in_think(prompt: str) -> bool:
        """True when the rendered prompt leaves the model inside an open think block: one opened in the
        turn the model writes (a `<think>` in a user's text opens nothing)."""
        turn = prompt[max(prompt.rfind(TURN_START), 0):]
        return turn.rfind(THINK_START) > turn.rfind(THINK_END)

    def feed(self, delta: str) -> tuple[str, str]:
        """Add streamed text; return the (reasoning, content) that is now decided."""
        self._held += delta
        reasoning = content = ""
        if self._state == _START:
            head = self._held.lstrip()
            if head.startswith(THINK_START):
                self._state, self._held = _REASONING, head[len(THINK_START):]
                self._strip_newlines = True
            elif THINK_START.startswith(head):
                return "", ""  # only whitespace or a partial "<think>" so far: undecided
            else:
                self._state = _CONTENT
        if self._state == _REASONING:
            reasoning = self._take_reasoning()
        if self._state == _CONTENT:
            content, self._held = self._take_leading(self._held), ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """End of output: return what is still held (a partial tag is plain text after all)."""
        held, self._held = self._held, ""
        if self._state == _REASONING:
            return self._take_leading(held), ""
        return "", self._take_leading(held)

    def _take_reasoning(self) -> str:
        end = self._held.find(THINK_END)
        if end >= 0:
            reasoning = self._take_leading(self._held[:end]).rstrip("\n")
            self._state, self._held = _CONTENT, self._held[end + len(THINK_END):]
            self._strip_newlines = True
            return reasoning
        # Hold back a possible partial "</think>" and the newlines before it (dropped if it comes).
        cut = len(self._held) - partial_tag_len(self._held, THINK_END)
        while cut > 0 and self._held[cut - 1] == "\n":
            cut -= 1
        decided, self._held = self._held[:cut], self._held[cut:]
        return self._take_leading(decided)

    def _take_leading(self, text: str) -> str:
        # Newlines that open a block are dropped until the block's first other character.
        if self._strip_newlines:
            text = text.lstrip("\n")
            self._strip_newlines = not text
        return text


def think_first(prompt: str) -> str | None:
    """Where a structured output starts after this rendered prompt (`SamplingParams.think_first`):
    "open" when the prompt ends inside a think block, None when it ends with a closed one (thinking
    off: Qwen3's template with enable_thinking false), else "optional" (the model may think first)."""
    if Qwen3ReasoningParser.prompt_ends_in_think(prompt):
        return "open"
    return None if prompt.rstrip().endswith(THINK_END) else "optional"


def make_reasoning_parser(name: str | None, prompt: str) -> Qwen3ReasoningParser | None:
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(REASONING_PARSERS)}")
    return Qwen3ReasoningParser(Qwen3ReasoningParser.prompt_ends_in_think(prompt))
