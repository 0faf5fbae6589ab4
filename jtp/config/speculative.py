"""Speculative decoding: the configuration, and n-gram (prompt-lookup) drafts.

Drafts come from prompt lookup (`propose_ngram`, on the host) or, with method "mtp", from the
checkpoint's multi-token-prediction head, which every step runs after the target on the device
(`jtp.models.mtp.propose_drafts`): its greedy guess at a row's last accepted position, then k - 1 more
by chaining the head on its own output, are the row's drafts in the next step. Either way each draft
is one proposal (a point mass), so the rule below is exact.

A speculating decode row feeds its last token plus k drafted tokens in one ragged step; the step
samples the target model at each of the 1 + k positions with the key of that generation step, and
the host accepts drafts while they equal what the target sampled, then takes the target's token at
the first mismatch. An n-gram draft is a single proposal (a one-hot draft distribution), for which
"sample x ~ p and accept iff x == draft" is exactly the rejection-sampling rule: accept with
probability p(draft), otherwise a sample from p without the draft. So the output is not only
distributed like the non-speculative output: with the same seed it is the same tokens.
"""

from __future__ import annotations

import dataclasses
import json

from jtp.errors import ConfigError

METHODS = ("ngram", "mtp")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4  # drafts per row and step (k)
    prompt_lookup_max: int = 3  # the longest n-gram matched against the request's earlier tokens
    prompt_lookup_min: int = 1  # ... and the shortest

    @property
    def mtp_drafts(self) -> int:
        """Drafts the MTP head makes per row and step (0: not the MTP method)."""
        return self.num_speculative_tokens if self.method == "mtp" else 0

    @property
    def verify_positions(self) -> int:
        """Positions a verify step samples per row: the last known token and each draft."""
        return 1 + self.num_speculative_tokens

    @classmethod
    def parse(cls, spec: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """vLLM's spelling: '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'."""
        if spec is None or isinstance(spec, SpeculativeConfig):
            return spec
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as e:
                raise ConfigError(f"--speculative-config is not valid JSON: {e}") from None
        if not isinstance(spec, dict):
            raise ConfigError(f"--speculative-config must be a JSON object, not {type(spec).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ConfigError(f"--speculative-config: unknown key(s) {unknown}; known: {sorted(known)}")
        if spec.get("method") == "mtp":  # the checkpoints' one MTP layer: one draft unless asked for more
            spec = {"num_speculative_tokens": 1, **spec}
        config = cls(**spec)
        config.validate()
        return config

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"speculative method {self.method!r} is unknown; one of {list(METHODS)}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 16:
                raise ConfigError(f"speculative {name} must be an integer in 1..16, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(
                f"speculative prompt_lookup_min ({self.prompt_lookup_min}) exceeds prompt_lookup_max "
                f"({self.prompt_lookup_max})"
            )


def propose_ngram(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the sequence's last n tokens,
    for the longest n in max_n..min_n that occurs; [] if none does (prompt lookup decoding)."""
    if k <= 0:
        return []
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = tokens[size - n :]
        # The latest match first: recent context predicts best. It must leave a token after it.
        for start in range(size - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []
