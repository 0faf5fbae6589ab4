"""On-device sampling with per-row parameters.

The engine's jitted step produces float32 logits [B, V]; `sample` turns them into
token ids on device, each row using its own parameters, so only ids (and
optional logprobs) come back to the host.

Processing order (per row; `process_logits` returns the result of steps 1-4):

0. Token mask (structured outputs, min_tokens): tokens the row may not sample
   get -inf logits.
1. Logit bias (OpenAI's logit_bias): each listed token's bias is added to its
   logit (vLLM's order: bias, then penalties, then temperature).
2. Penalties:
   - repetition (HF): for every token seen in the prompt or the output,
     logit > 0 -> logit / penalty, else logit * penalty;
   - frequency (OpenAI): logit -= frequency_penalty * count_in_output;
   - presence (OpenAI):  logit -= presence_penalty * (count_in_output > 0).
3. Temperature: logits / temperature. Rows with temperature < GREEDY_EPS are
   greedy: their token is the argmax of the biased, penalised logits and steps
   4-5 do not apply to them (`process_logits` returns those logits as is).
4. Truncation, masked tokens set to -inf:
   - top-k keeps the tokens whose logit >= the k-th largest logit;
   - top-p, over the distribution renormalised to the top-k survivors, keeps
     the shortest prefix (in descending order) whose mass reaches top_p;
   - min-p keeps the tokens with p >= min_p * p_max.
   Thresholds are values, so tokens tied with the last kept one are kept too:
   the kept set depends only on the logit values, never on sort order. The
   most likely token always survives.
5. Sampling with the Gumbel-max trick, argmax(logits + Gumbel noise), the noise
   drawn from the row key fold_in(PRNGKey(seed), step): a row's draw depends
   only on its own seed and step, never on the rest of the batch.

Ties: argmax (greedy and Gumbel) picks the lowest token index.

Logprobs are of the raw model distribution (log_softmax of the logits before
the mask, bias, penalties and temperature), like vLLM's default.

Compile-time flags (`SamplingBatch.static_flags()`) let the common case of
greedy / plain temperature skip the sort and the penalty inputs entirely.

Engine usage, per step:

    batch = pack_sampling(row_params, num_rows, seeds, steps)      # numpy, host
    flags = batch.static_flags()                                   # hashable
    extra = {}
    if flags.needs_penalties:
        ids, is_output = pack_penalty_tokens(prompts, outputs, num_rows)
        extra = dict(penalty_ids=ids, penalty_is_output=is_output)
    if any(p.logit_bias for p in row_params):
        bias_ids, biases = pack_logit_bias(row_params, num_rows)
        extra.update(logit_bias_ids=bias_ids, logit_bias=biases)
    result = sample_jit(logits, batch, **flags._asdict(), **extra)
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jtp.core.step_input import GREEDY_EPS, SamplingBatch


class SampleResult(NamedTuple):
    tokens: jax.Array  # i32[B]
    logprob: jax.Array  # f32[B], raw log_softmax at the chosen token
    top_ids: jax.Array | None  # i32[B, num_logprobs], None when num_logprobs == 0
    top_logprobs: jax.Array | None  # f32[B, num_logprobs]
    draft: jax.Array | None = None  # i32[B, k]: MTP speculation's drafts for each row's next step (-1: none)
    prompt: tuple[PromptScores, ...] | None = None  # the step's prompt logprobs, a chunk each (not per row)


class PromptScores(NamedTuple):
    """Prompt logprobs of PROMPT_CHUNK positions (`jtp.worker.runner`'s prompt-logprobs program)."""
    logprob: jax.Array  # f32[C]: the raw log-probability of the prompt token each position predicts
    rank: jax.Array  # i32[C]: that token's rank in the distribution (1: the most likely)
    top_ids: jax.Array  # i32[C, MAX_LOGPROBS], most likely first
    top_logprobs: jax.Array  # f32[C, MAX_LOGPROBS]


def build_penalty_counts(penalty_ids: jax.Array, penalty_is_output: jax.Array,
                         vocab_size: int) -> tuple[jax.Array, jax.Array]:
    """(output_counts i32[B, V], prompt_mask bool[B, V]) from padded ids (-1 ignored)."""
    batch = penalty_ids.shape[0]
    valid = penalty_ids >= 0
    # invalid ids point one past the vocab and are dropped by the scatter
    cols = jnp.where(valid, penalty_ids, vocab_size)
    rows = jnp.broadcast_to(jnp.arange(batch)[:, None], cols.shape)
    is_output = penalty_is_output.astype(bool)
    output_counts = jnp.zeros((batch, vocab_size), jnp.int32).at[rows, cols].add(
        (valid & is_output).astype(jnp.int32), mode="drop")
    prompt_mask = jnp.zeros((batch, vocab_size), bool).at[rows, cols].max(
        valid & ~is_output, mode="drop")
    return output_counts, prompt_mask


def build_logit_bias(logit_bias_ids: jax.Array, logit_bias: jax.Array, vocab_size: int) -> jax.Array:
    """f32[B, V]: each row's biases scattered onto its tokens, from padded [B, N] ids (-1 ignored) and biases."""
    batch = logit_bias_ids.shape[0]
    cols = jnp.where(logit_bias_ids >= 0, logit_bias_ids, vocab_size)  # padding: past the vocab, dropped
    rows = jnp.broadcast_to(jnp.arange(batch)[:, None], cols.shape)
    return jnp.zeros((batch, vocab_size), jnp.float32).at[rows, cols].add(logit_bias.astype(jnp.float32), mode="drop")


def apply_penalties(logits: jax.Array, batch: SamplingBatch, output_counts: jax.Array,
                    prompt_mask: jax.Array) -> jax.Array:
    """Repetition, then frequency and presence penalties (identity for neutral rows)."""
    rep = jnp.asarray(batch.repetition_penalty, jnp.float32)[:, None]
    freq = jnp.asarray(batch.frequency_penalty, jnp.float32)[:, None]
    pres = jnp.asarray(batch.presence_penalty, jnp.float32)[:, None]
    in_output = output_counts > 0
    seen = prompt_mask | in_output
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - freq * output_counts.astype(jnp.float32)
    return logits - pres * in_output.astype(jnp.float32)


def _truncation_mask(scaled: jax.Array, batch: SamplingBatch) -> jax.Array:
    """True for tokens that survive top-k, then top-p, then min-p (value thresholds)."""
    vocab = scaled.shape[-1]
    top_k = jnp.asarray(batch.top_k, jnp.int32)[:, None]
    top_p = jnp.asarray(batch.top_p, jnp.float32)[:, None]
    min_p = jnp.asarray(batch.min_p, jnp.float32)[:, None]

    descending = -jnp.sort(-scaled, axis=-1)  # the one sort per row
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth_value = jnp.take_along_axis(descending, k - 1, axis=-1)
    in_top_k = descending >= kth_value  # a prefix of `descending`, ties included

    # top-p over the top-k survivors, renormalised
    probs = jax.nn.softmax(jnp.where(in_top_k, descending, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    # top_p == 1 keeps everything; don't let cumsum rounding cut the tail
    in_top_p = in_top_k & ((mass_before < top_p) | (top_p >= 1.0))
    num_kept = jnp.maximum(jnp.sum(in_top_p, axis=-1, keepdims=True), 1)  # >= 1 anyway
    cutoff = jnp.take_along_axis(descending, num_kept - 1, axis=-1)

    # min-p in log space: p >= min_p * p_max  <=>  logit >= max_logit + log(min_p)
    min_p_cutoff = descending[:, :1] + jnp.log(min_p)  # log(0) = -inf keeps all
    return scaled >= jnp.maximum(cutoff, min_p_cutoff)


def _greedy_rows(batch: SamplingBatch) -> jax.Array:
    return jnp.asarray(batch.temperature, jnp.float32) < GREEDY_EPS


def process_logits(logits: jax.Array, batch: SamplingBatch, *, needs_top_k_p_min_p: bool,
                   needs_penalties: bool, output_counts: jax.Array | None = None,
                   prompt_mask: jax.Array | None = None, logit_bias: jax.Array | None = None) -> jax.Array:
    """Steps 1-4 of the module docstring: biased (`logit_bias` f32[B, V], when given), penalised,
    scaled, truncated (-inf) logits.

    Greedy rows come back biased and penalised only (no temperature, no truncation); their token
    is the argmax of this output.
    """
    logits = logits.astype(jnp.float32)
    if logit_bias is not None:
        logits = logits + logit_bias
    if needs_penalties:
        if output_counts is None or prompt_mask is None:
            raise ValueError("needs_penalties requires output_counts and prompt_mask")
        logits = apply_penalties(logits, batch, output_counts, prompt_mask)
    greedy = _greedy_rows(batch)[:, None]
    temperature = jnp.asarray(batch.temperature, jnp.float32)[:, None]
    scaled = logits / jnp.where(greedy, 1.0, temperature)
    if needs_top_k_p_min_p:
        scaled = jnp.where(greedy | _truncation_mask(scaled, batch), scaled, -jnp.inf)
    return scaled


def unpack_token_mask(words: jax.Array, vocab: int) -> jax.Array:
    """bool[B, V] from i32[B, ceil(V / 32)]: token t is allowed when bit t % 32 of word t // 32 is set."""
    bits = (words[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    return bits.reshape(words.shape[0], -1)[:, :vocab].astype(bool)


def row_keys(batch: SamplingBatch) -> jax.Array:
    """Per-row PRNG keys fold_in(key(seed), step); same bits as PRNGKey(seed)."""
    seeds = jnp.asarray(batch.seed).astype(jnp.uint32)
    steps = jnp.asarray(batch.step, jnp.int32)
    return jax.vmap(lambda s, t: jax.random.fold_in(jax.random.key(s), t))(seeds, steps)


def sample(logits: jax.Array, batch: SamplingBatch, *, needs_top_k_p_min_p: bool,
           needs_penalties: bool, num_logprobs: int, needs_mask: bool = False,
           penalty_ids: jax.Array | None = None, penalty_is_output: jax.Array | None = None,
           output_counts: jax.Array | None = None,
           prompt_mask: jax.Array | None = None, token_mask: jax.Array | None = None,
           logit_bias_ids: jax.Array | None = None, logit_bias: jax.Array | None = None) -> SampleResult:
    """Sample one token per row. Pass the flags from `batch.static_flags()` as static.

    With needs_penalties, give either penalty_ids/penalty_is_output (see
    `pack_penalty_tokens`) or prebuilt output_counts/prompt_mask [B, V]. With needs_mask, give
    token_mask i32[B, ceil(V / 32)] (`unpack_token_mask`): a row samples only the tokens it allows.
    With logit_bias_ids i32[B, N] and logit_bias f32[B, N] (`pack_logit_bias`), each row's biases
    are added to its logits first.
    """
    if needs_mask != (token_mask is not None):
        raise ValueError("needs_mask and token_mask go together")
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    if needs_penalties and output_counts is None:
        if penalty_ids is None or penalty_is_output is None:
            raise ValueError("needs_penalties requires penalty_ids and penalty_is_output "
                             "(or output_counts and prompt_mask)")
        output_counts, prompt_mask = build_penalty_counts(penalty_ids, penalty_is_output, vocab)
    bias = None if logit_bias_ids is None else build_logit_bias(logit_bias_ids, logit_bias, vocab)
    # The raw distribution gives the logprobs; the allowed tokens alone are sampled from.
    allowed = logits if token_mask is None else jnp.where(unpack_token_mask(token_mask, vocab), logits, -jnp.inf)
    processed = process_logits(allowed, batch, needs_top_k_p_min_p=needs_top_k_p_min_p,
                               needs_penalties=needs_penalties, output_counts=output_counts,
                               prompt_mask=prompt_mask, logit_bias=bias)

    greedy_tokens = jnp.argmax(processed, axis=-1).astype(jnp.int32)  # ties -> lowest id
    # Gumbel noise costs B x V random numbers, well under 1% of a decode step; drawing it for
    # all-greedy batches too saves a compiled variant of every step shape.
    gumbel = jax.vmap(lambda key: jax.random.gumbel(key, (vocab,), jnp.float32))(row_keys(batch))
    sampled = jnp.argmax(processed + gumbel, axis=-1).astype(jnp.int32)
    tokens = jnp.where(_greedy_rows(batch), greedy_tokens, sampled)

    log_probs = jax.nn.log_softmax(logits, axis=-1)  # raw model distribution
    logprob = jnp.take_along_axis(log_probs, tokens[:, None], axis=-1)[:, 0]
    top_ids = top_logprobs = None
    if num_logprobs > 0:
        top_logprobs, top_ids = jax.lax.top_k(log_probs, num_logprobs)
        top_ids = top_ids.astype(jnp.int32)
    return SampleResult(tokens, logprob, top_ids, top_logprobs)


# flags are Python values baked into the trace: one compile per (flags, shapes)
sample_jit = jax.jit(sample, static_argnames=(
    "needs_top_k_p_min_p", "needs_penalties", "num_logprobs", "needs_mask"))

