"""A step's arrays one by one, as plain numpy: `StepInput`.

What a step computes (`StepPlan`: token ids, positions, KV slots, block tables, rows, state
slots), the rows' sampling parameters (`SamplingBatch`) and, for penalties and logit biases,
their token histories and biases. The serving path packs these into two buffers (`jtp.core.packed_step.PackedStep`, also
the followers' wire format); this explicit form is what the warm-up's padding steps and tools
build, and what `PackedStep.to_step_input` gives back for inspection. Imports numpy only.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

GREEDY_EPS = 1e-5  # temperatures below this are greedy (x / 1e-6 would overflow)
STOP_IDS_WIDTH = 4  # stop tokens per row the device checks in a multi-step decode
PROMPT_CHUNK = 256  # prompt positions one prompt-logprobs program scores (a step runs it as often as needed)


def bucket_sizes(lo: int, hi: int, base: int = 2) -> tuple[int, ...]:
    """A static dimension's sizes: lo, lo x base, ... below hi, then hi itself."""
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= base
    return tuple(out) + (hi,)


def scored_prompt_positions(start: int, num_tokens: int, num_prompt: int) -> int:
    """How many of a row's positions [start, start + num_tokens) predict a prompt token (position p
    predicts token p + 1): what a prompt-logprobs request's row scores in its step."""
    return max(0, min(start + num_tokens, num_prompt - 1) - start)


def mask_words(vocab_size: int) -> int:
    """Words of one row's token mask: 32 tokens a word."""
    return -(-vocab_size // 32)


def pack_stop_ids(stop_ids: list[frozenset[int]], num_rows: int) -> np.ndarray:
    """i32[num_rows, STOP_IDS_WIDTH]: each row's stop tokens (the first few, sorted), -1 padded."""
    out = np.full((num_rows, STOP_IDS_WIDTH), -1, np.int32)
    for b, ids in enumerate(stop_ids):
        ids = sorted(ids)[:STOP_IDS_WIDTH]
        out[b, : len(ids)] = ids
    return out


@dataclasses.dataclass
class StepPlan:
    """One step of work, as numpy arrays padded to bucket sizes (T tokens, B rows, M blocks per row)."""

    token_ids: np.ndarray  # i32[T]
    positions: np.ndarray  # i32[T]
    slot_mapping: np.ndarray  # i32[T], -1 for padding tokens
    token_rows: np.ndarray  # i32[T]
    block_tables: np.ndarray  # i32[B, M]
    context_lens: np.ndarray  # i32[B]
    row_starts: np.ndarray  # i32[B]
    row_lens: np.ndarray  # i32[B]
    seq_slots: np.ndarray  # i32[B] each running request's index in the sampled-token buffer (-1 = padding row)
    state_reads: np.ndarray  # i32[B] recurrent-state slot each row restores from (-1 = zero state)
    state_writes: np.ndarray  # i32[B] recurrent-state slot each row writes (-1 = none)
    # i32[B] slot for a speculating row's state before its drafts (-1 = none): where a hybrid goes
    # back to when a draft is rejected (only read in verify steps)
    state_keeps: np.ndarray
    # i32[B] index (into T) of the token whose logits each row samples from; [1 + k, B] in a verify step
    # (speculative decoding): row b samples at each of logits_indices[:, b], with generation steps step + j
    logits_indices: np.ndarray
    max_row_len: int | None = None  # static bound on tokens per row (a bucket); None = T
    # Decode steps run by this one dispatch (multi-step decode: only in a pure decode step, whose
    # rows then each sample `num_steps` tokens in a row on the device; 1 otherwise).
    num_steps: int = 1

    @classmethod
    def padding(cls, T: int, B: int, max_row_len: int, M: int, verify_positions: int = 0) -> "StepPlan":
        """A step of the given shape with nothing in it: no K/V or state is written (warm-up).
        `verify_positions` > 0: sample like a speculative verify step ([verify_positions, B] logits indices)."""
        zeros = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
        return cls(
            zeros(T), zeros(T), np.full(T, -1, np.int32), zeros(T), zeros(B, M), zeros(B),
            zeros(B), zeros(B), *(np.full(B, -1, np.int32) for _ in range(4)),
            zeros(verify_positions, B) if verify_positions else zeros(B), max_row_len=max_row_len,
        )


class SamplingFlags(NamedTuple):
    """Compile-time (static, hashable) facts about a batch."""
    needs_top_k_p_min_p: bool
    needs_penalties: bool
    num_logprobs: int
    needs_mask: bool = False  # a token mask per row (structured outputs): [B, ceil(V / 32)] bits


class SamplingBatch(NamedTuple):
    """Per-row sampling parameters as numpy arrays [B] (a pytree of arrays)."""
    temperature: np.ndarray  # f32
    top_p: np.ndarray  # f32
    top_k: np.ndarray  # i32, <= 0 disabled
    min_p: np.ndarray  # f32
    repetition_penalty: np.ndarray  # f32
    presence_penalty: np.ndarray  # f32
    frequency_penalty: np.ndarray  # f32
    seed: np.ndarray  # u32, the request seed mod 2**32
    step: np.ndarray  # i32, tokens generated so far by the request
    logprobs: np.ndarray  # i32, -1 => none

    def static_flags(self) -> SamplingFlags:
        greedy = np.asarray(self.temperature) < GREEDY_EPS
        sampled = ~greedy
        truncates = ((np.asarray(self.top_k) > 0) | (np.asarray(self.top_p) < 1.0)
                     | (np.asarray(self.min_p) > 0.0))
        penalised = ((np.asarray(self.repetition_penalty) != 1.0)
                     | (np.asarray(self.presence_penalty) != 0.0)
                     | (np.asarray(self.frequency_penalty) != 0.0))
        return SamplingFlags(
            needs_top_k_p_min_p=bool(np.any(sampled & truncates)),
            needs_penalties=bool(np.any(penalised)),
            num_logprobs=int(max(0, np.max(self.logprobs, initial=0))),
        )



@dataclasses.dataclass(frozen=True)
class StepInput:
    plan: StepPlan
    sampling: SamplingBatch
    penalty_tokens: tuple[np.ndarray, np.ndarray] | None = None  # (ids [B, N], is_output [B, N])
    # i32[B, STOP_IDS_WIDTH]: tokens that end each row (-1 = none). A multi-step decode stops early
    # once every row has sampled one; rows with more stop ids than fit are only checked on the host.
    stop_ids: np.ndarray | None = None
    # i32[B, ceil(V / 32)]: the tokens each row may sample, bit t % 32 of word t // 32 (llguidance's
    # bitmask layout; -1 allows every token). None: no mask.
    token_mask: np.ndarray | None = None
    # (ids i32[B, MAX_LOGIT_BIAS], biases f32[B, MAX_LOGIT_BIAS]), -1 ids padding: each row's logit bias
    # (`pack_logit_bias`). A step with a penalty history always carries one (None there: no row has a bias).
    logit_bias: tuple[np.ndarray, np.ndarray] | None = None
    # i32[2, P] (P a multiple of PROMPT_CHUNK): the flat token indices whose hidden states score a prompt
    # token, and those tokens (prompt logprobs; padding scores token 0 at index 0). None: none.
    prompt_targets: np.ndarray | None = None
