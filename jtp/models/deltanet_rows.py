"""The DeltaNet layers' row layouts: flat step tokens [T] <-> padded per-row [B, L] arrays.

A hybrid step's rows (decodes, prompt chunks, verify rows) are ragged; the conv and the delta rule
run per row, so each row's tokens are gathered into [B, L] (L the static bound on tokens per row,
rounded up to the chunk), run from the row's state slot, and scattered back to the flat order.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jtp.core.buckets import SHORT_ROW, long_rows
from jtp.models.attention import AttentionMetadata

CHUNK = 64  # HF's chunk size for the chunked delta rule


class RowLayout(NamedTuple):
    """Index maps between the flat token order [T] and the padded per-row layout [B, L]."""

    gather: jax.Array  # i32[B, L] flat index of row b's t-th token (clipped for padding)
    valid: jax.Array  # bool[B, L]
    fresh: jax.Array  # bool[B] the row starts from the zero state (no slot to read)
    read_slots: jax.Array  # i32[B]
    write_slots: jax.Array  # i32[B] state slot to write; the scratch slot (the last) for padding rows
    token_row: jax.Array  # i32[T] row of each flat token
    token_t: jax.Array  # i32[T] its index within the row
    # Verify steps: each row's state after its first keep_lens[b] tokens goes to keep_slots[b]
    # (the scratch slot: not kept). None in other steps.
    keep_slots: jax.Array | None = None
    keep_lens: jax.Array | None = None


class SplitRows(NamedTuple):
    """A prompt step's DeltaNet rows in two layouts: its rows of several tokens compacted into
    `many` [P, L] (the chunked rule; P = `long_rows` of the step's shape), every row's lone token
    (decodes) in `one` [B, 1] (one recurrence step). `single` [T]: the flat tokens `one` computes."""

    many: RowLayout
    one: RowLayout
    single: jax.Array


def row_layout(meta: AttentionMetadata, num_tokens: int, length: int, num_slots: int, idx=None,
               taken=None) -> RowLayout:
    """The [B, L] layout of meta's rows, or of the rows `idx` [P] among them; with `taken` ([B], or
    [P] with idx) the entries not taken are empty rows: no tokens, they write the scratch slot."""
    t = jnp.arange(length)
    B = meta.row_starts.shape[0]
    pick = (lambda a: a) if idx is None else (lambda a: a[idx])  # noqa: E731
    lens = pick(meta.row_lens) if taken is None else jnp.where(taken, pick(meta.row_lens), 0)
    gather = jnp.clip(pick(meta.row_starts)[:, None] + t[None, :], 0, num_tokens - 1)
    valid = t[None, :] < lens[:, None]
    real = (lens > 0) & (pick(meta.state_writes) >= 0)
    token_row = jnp.clip(meta.token_rows, 0, B - 1)
    token_t = jnp.clip(jnp.arange(num_tokens) - meta.row_starts[token_row], 0, length - 1)
    if idx is not None:  # each token's entry of idx: its row's rank among the chosen rows
        rank = jnp.zeros(B, jnp.int32).at[idx].set(jnp.arange(idx.shape[0], dtype=jnp.int32))
        token_row = rank[token_row]
    keeps = None if meta.state_keeps is None else pick(meta.state_keeps)
    return RowLayout(
        gather=gather,
        valid=valid,
        fresh=pick(meta.state_reads) < 0,
        read_slots=jnp.clip(pick(meta.state_reads), 0, num_slots - 1),
        write_slots=jnp.where(real, pick(meta.state_writes), num_slots - 1),
        token_row=token_row,
        token_t=token_t,
        keep_slots=None if keeps is None else jnp.where(real & (keeps >= 0), keeps, num_slots - 1),
        keep_lens=None if meta.keep_lens is None else pick(meta.keep_lens),
    )


def deltanet_rows(meta: AttentionMetadata, num_tokens: int, length: int, num_slots: int) -> RowLayout | SplitRows:
    """The step's DeltaNet row layout: [B, L] (decode steps, short rows, verify steps), or, for a
    step whose bound on tokens per row is over SHORT_ROW, `SplitRows`. (Such a step takes the most
    rows its token bucket holds, free for attention; [B, L] would run the chunked rule over every
    one of them, 64x a lone prompt's work in a 64-row step.)

    The step must hold at most `long_rows` rows of several tokens: rows past that are computed in
    neither layout. The scheduler keeps to it and the runner refuses a step past it; a caller of
    the model's forward alone must keep to it too."""
    B = meta.row_starts.shape[0]
    bound = num_tokens if meta.query_bound is None else min(meta.query_bound.shape[0], num_tokens)
    P = long_rows(num_tokens, B, bound)
    if bound <= SHORT_ROW or P >= B or meta.state_keeps is not None:
        return row_layout(meta, num_tokens, length, num_slots)
    several = meta.row_lens > 1
    many = jnp.argsort(~several, stable=True)[:P].astype(jnp.int32)  # the rows of several tokens, in order
    one = row_layout(meta, num_tokens, 1, num_slots, taken=meta.row_lens == 1)
    return SplitRows(
        many=row_layout(meta, num_tokens, length, num_slots, many, several[many]),
        one=one,
        single=meta.row_lens[one.token_row] == 1,
    )


def deltanet_row_length(meta: AttentionMetadata, num_tokens: int) -> tuple[int, int]:
    """Static (L, chunk) of the padded per-row DeltaNet layout.

    The bound on tokens per row is `meta.query_bound`'s static length (T when unknown, never
    more than T). L = 1: the single-step path (chunk unused). Otherwise rows run in chunks of
    min(64, bound) tokens and L is the bound rounded up to a multiple of the chunk.
    """
    bound = num_tokens if meta.query_bound is None else min(meta.query_bound.shape[0], num_tokens)
    bound = max(bound, 1)
    if bound == 1:
        return 1, 1
    chunk = min(CHUNK, bound)
    return -(-bound // chunk) * chunk, chunk
