"""Logprobs in the two OpenAI shapes: the legacy completions one and the chat one.

The engine reports, per generated token, the sampled token's logprob and (when asked) a dict
of the top tokens' logprobs; here token ids become the token strings and bytes clients show.
"""

from __future__ import annotations

import functools

from jtp.engine.tokenizer import Tokenizer

MIN_LOGPROB = -9999.0  # JSON has no -inf; a logprob that underflowed is reported as this


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """Byte-level BPE's printable stand-in character -> the byte it stands for (GPT-2's table)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    shifted = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + shifted)
            shifted += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class TokenNames:
    """Token id -> the string and UTF-8 bytes logprobs show for it (cached per id)."""

    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer
        self.text = functools.lru_cache(maxsize=1 << 16)(self._text)
        self.bytes = functools.lru_cache(maxsize=1 << 16)(self._bytes)

    def decode(self, token_ids: list[int]) -> str:
        """The text of a token id prompt (echo): its special tokens kept, as its logprobs' tokens show them."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=False) if self.tokenizer is not None else ""

    def _text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _bytes(self, token_id: int) -> list[int]:
        # A byte-level BPE token can be part of a UTF-8 character, which decodes to U+FFFD;
        # its vocabulary entry still spells the exact bytes.
        piece = self.tokenizer.id_to_token(token_id) if self.tokenizer is not None else None
        table = _byte_level_decoder()
        if piece and all(c in table for c in piece):
            return [table[c] for c in piece]
        return list(self.text(token_id).encode("utf-8"))


def _finite(logprob: float) -> float:
    return max(float(logprob), MIN_LOGPROB)


def completion_logprobs(names: TokenNames, token_ids: list[int], logprobs: list[float],
                        top: list[dict[int, float]] | None, text_offset: int) -> tuple[dict, int]:
    """The legacy shape for some tokens: parallel lists, `top_logprobs` as {token: logprob}
    including the sampled token (as OpenAI does). Offsets add up the token strings from
    `text_offset`; returns the shape and the offset after the last token."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for k, (token_id, logprob) in enumerate(zip(token_ids, logprobs)):
        text = names.text(token_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(_finite(logprob))
        candidates = {names.text(t): _finite(v) for t, v in (top[k] if top else {}).items()}
        candidates.setdefault(text, _finite(logprob))
        out["top_logprobs"].append(candidates)
        out["text_offset"].append(text_offset)
        text_offset += len(text)
    return out, text_offset


def echo_logprobs(names: TokenNames, scores) -> tuple[dict, int]:
    """The legacy shape for an echoed prompt (its `PromptLogprobs`): as `completion_logprobs`, but
    the first token, which nothing predicts, has null logprobs (as OpenAI and vLLM send it)."""
    prompt_ids = scores.token_ids
    out, offset = completion_logprobs(names, prompt_ids[1:], scores.logprobs[1:], scores.top[1:],
                                      len(names.text(prompt_ids[0])))
    for key, first in (("tokens", names.text(prompt_ids[0])), ("token_logprobs", None), ("top_logprobs", None),
                       ("text_offset", 0)):
        out[key].insert(0, first)
    return out, offset


def prompt_logprobs_entries(names: TokenNames, scores) -> list[dict | None]:
    """vLLM's `prompt_logprobs` (from a `PromptLogprobs`): per prompt token, None for the first, else
    {token id: {"logprob", "rank", "decoded_token"}} for the prompt token and the top tokens there."""
    prompt_ids = scores.token_ids
    entries: list[dict | None] = [None]
    for k in range(1, len(prompt_ids)):
        top = scores.top[k] or {}
        entry = {str(t): {"logprob": _finite(v), "rank": rank, "decoded_token": names.text(t)}
                 for rank, (t, v) in enumerate(top.items(), 1)}
        entry[str(prompt_ids[k])] = {"logprob": _finite(scores.logprobs[k]), "rank": scores.ranks[k],
                                     "decoded_token": names.text(prompt_ids[k])}
        entries.append(entry)
    return entries


def merge_completion_logprobs(parts: list[dict]) -> dict:
    return {key: [v for part in parts for v in part[key]] for key in ("tokens", "token_logprobs", "top_logprobs",
                                                                      "text_offset")}


def chat_logprobs(names: TokenNames, token_ids: list[int], logprobs: list[float],
                  top: list[dict[int, float]] | None) -> list[dict]:
    """The chat shape: one entry per token, `top_logprobs` a list ordered best first."""

    def entry(token_id: int, logprob: float) -> dict:
        return {"token": names.text(token_id), "logprob": _finite(logprob), "bytes": names.bytes(token_id)}

    entries = []
    for k, (token_id, logprob) in enumerate(zip(token_ids, logprobs)):
        ranked = sorted((top[k] if top else {}).items(), key=lambda item: -item[1])
        entries.append({**entry(token_id, logprob), "top_logprobs": [entry(t, v) for t, v in ranked]})
    return entries
