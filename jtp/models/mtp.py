"""Multi-token-prediction drafting: the checkpoint's MTP head guesses each row's next tokens.

After the target model's forward and sampling, the serving step (jtp/worker/runner.py) calls
`propose_drafts`, which runs the family's `mtp_forward` over the step and chains it on its own
guesses; the greedy guesses are the rows' drafts in the next step (jtp/config/speculative.py says
why verifying them keeps the output exact).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jtp.config.model_config import ModelConfig
from jtp.models.attention import AttentionMetadata, LayerKV, PagedAttention
from jtp.models.base import ModelFamily
from jtp.models.moe import RoutedExperts


def propose_drafts(
    family: ModelFamily, cfg: ModelConfig, attention: PagedAttention, experts: RoutedExperts, num_drafts: int,
    params: dict, hidden: jax.Array, tokens: jax.Array, meta: AttentionMetadata, logits_indices: jax.Array,
    seq_slots: jax.Array, samples: jax.Array, kv: LayerKV,
) -> tuple[jax.Array, LayerKV]:
    """Drafts for every row's next step from the MTP head, [B, num_drafts] (-1: no draft there), and
    the head's updated K/V.

    hidden [T, H]: the target's final-normed output over the step's tokens [T]; logits_indices [B]
    (or [P, B] in a verify step): the positions each row sampled at; samples [P, B]: the tokens
    sampled there (P = 1 outside verify steps).

    The head runs over every token of the step: at position t it takes the target's hidden state
    and token t+1 (the row's next token in this step, or at a sampled position the token sampled
    there) and guesses token t+2; this writes its K/V for the step's positions. Each row's first
    draft is the guess at its last accepted position, counted here as the host counts it (drafts
    accepted while the target sampled them). Causal attention makes that guess independent of the
    rejected positions after it. Further drafts chain the head on its own output hidden state and
    last guess, one position on, writing its K/V into the row's pages as far as they are allocated
    (a chain stops at the end of the row's last page; the next step rewrites those positions)."""
    if family.mtp_forward is None:
        raise ValueError("this model family has no multi-token-prediction head")
    T = tokens.shape[0]
    B = seq_slots.shape[0]
    indices = logits_indices if logits_indices.ndim == 2 else logits_indices[None]
    real_row = seq_slots >= 0
    # A row with fewer positions repeats its last one: only a new index is a draft position.
    fresh = jnp.concatenate([real_row[None], indices[1:] != indices[:-1]], axis=0)  # [P, B]
    following = jnp.concatenate([tokens[1:], tokens[:1]])
    for j in range(indices.shape[0]):
        following = following.at[jnp.where(fresh[j] & real_row, indices[j], T)].set(samples[j], mode="drop")
    mtp_hidden, kv = family.mtp_forward(params, cfg, hidden, following, kv, meta, attention, experts)

    # The last accepted position of each row: drafts (the tokens at positions 1..) matched in a row.
    matched = (samples[:-1] == tokens[indices[1:]]) & fresh[1:]
    accepted = jnp.sum(jnp.cumprod(matched.astype(jnp.int32), axis=0), axis=0)  # [B]
    last = indices[accepted, jnp.arange(B)]
    h = mtp_hidden[last]
    guess = jnp.argmax(family.compute_logits(params, h), axis=-1).astype(jnp.int32)
    drafts = [jnp.where(real_row, guess, -1)]

    block_size = kv.k.shape[1]
    pos = meta.positions[last]
    allocated = -(-meta.context_lens // block_size) * block_size  # the row's pages end here
    alive = real_row
    rows = jnp.arange(B, dtype=jnp.int32)
    for _ in range(num_drafts - 1):
        pos = pos + 1
        alive = alive & (pos < allocated)
        page = jnp.take_along_axis(meta.block_tables, (pos // block_size)[:, None], axis=1)[:, 0]
        chain_meta = meta._replace(
            positions=pos,
            slot_mapping=jnp.where(alive, page * block_size + pos % block_size, -1),
            token_rows=rows,
            context_lens=jnp.where(alive, pos + 1, 0),
            row_starts=rows,
            row_lens=alive.astype(jnp.int32),
            query_bound=jnp.arange(1, dtype=jnp.int32),
            state_keeps=None,
            keep_lens=None,
        )
        h, kv = family.mtp_forward(params, cfg, h, jnp.maximum(drafts[-1], 0), kv, chain_meta, attention, experts)
        guess = jnp.argmax(family.compute_logits(params, h), axis=-1).astype(jnp.int32)
        drafts.append(jnp.where(alive, guess, -1))
    return jnp.stack(drafts, axis=1), kv
