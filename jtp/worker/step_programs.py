"""The step's device programs: pure functions of (weights, cache, packed step buffers) that the
runner jits. A step is one forward program and one sampling program, or one fused program (the MTP
head's, or the decode loop's several steps); the packed buffers are unpacked inside the jit."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from jtp.core.packed_step import SamplingLayout, StepLayout
from jtp.core.sampling_params import MAX_LOGPROBS
from jtp.core.step_input import SamplingBatch
from jtp.models import mtp
from jtp.models.attention import AttentionMetadata
from jtp.worker.sampler import PromptScores, SampleResult, sample
from jtp.worker.trace_count import note_trace


def unpack(layout: StepLayout, ints, floats):
    """The step's arrays, sliced out of the packed buffers (inside the jit: static offsets).

    Returns (tokens, attention metadata, logits indices, seq_slots, sampling, penalty inputs or
    None, token mask or None, stop ids, num_steps)."""
    f = layout.views(ints, floats)
    return (*plan_arrays(layout, f), *_sampling_arrays(layout.penalty_len, f))


def plan_arrays(layout: StepLayout, f: dict):
    """(tokens, attention metadata, logits indices, seq_slots) from the step's fields."""
    verify = layout.verify_positions > 0  # a row's first sampled position is its last known token
    logits_indices = f["logits_indices"]
    meta = AttentionMetadata(
        positions=f["positions"],
        slot_mapping=f["slot_mapping"],
        token_rows=f["token_rows"],
        block_tables=f["block_tables"],
        context_lens=f["context_lens"],
        row_starts=f["row_starts"],
        row_lens=f["row_lens"],
        state_reads=f["state_reads"],
        state_writes=f["state_writes"],
        query_bound=jnp.arange(layout.max_row_len or layout.num_tokens, dtype=jnp.int32),
        state_keeps=f["state_keeps"] if verify else None,
        keep_lens=(logits_indices[0] - f["row_starts"] + 1).astype(jnp.int32) if verify else None,
        rope_positions=f.get("rope_positions"),
        image_rows=f.get("image_rows"),
    )
    return f["token_ids"], meta, logits_indices, f["seq_slots"]


def _sampling_arrays(penalty_len: int, f: dict):
    """(sampling, penalty inputs or None, token mask or None, stop ids, num_steps) from the step's fields.
    The penalty inputs (the penalised variant's): (history ids, is_output, logit bias ids, biases)."""
    sampling = SamplingBatch(
        temperature=f["temperature"], top_p=f["top_p"], top_k=f["top_k"], min_p=f["min_p"],
        repetition_penalty=f["repetition_penalty"], presence_penalty=f["presence_penalty"],
        frequency_penalty=f["frequency_penalty"], seed=jax.lax.bitcast_convert_type(f["seed"], jnp.uint32),
        step=f["step"], logprobs=f["logprobs"],
    )
    penalty = ((f["penalty_ids"], f["penalty_is_output"].astype(bool), f["logit_bias_ids"], f["logit_bias"])
               if penalty_len else None)
    return sampling, penalty, f.get("token_mask"), f["stop_ids"], f["num_steps"][0]


def forward_logits(family, cfg, attention, experts, logits_sharding, params, cache, hidden_out, sampled, ints, layout):
    """The forward program of a step: the model over the ragged batch, then f32 logits [N, V] at the
    rows' sample positions (N = B, or (1 + k) x B position-major in a verify step), split over the
    vocabulary like the LM head, and the hidden states written to the front of `hidden_out`. One
    program per step shape, whatever the rows' sampling asks."""
    note_trace()
    tokens, meta, logits_indices, seq_slots = plan_arrays(layout, layout.views(ints))
    hidden, cache, _ = _forward(family, cfg, attention, experts, params, cache, sampled, tokens, meta, seq_slots)
    logits = family.compute_logits(params, hidden[logits_indices.reshape(-1)])
    hidden_out = jax.lax.dynamic_update_slice(hidden_out, hidden.astype(hidden_out.dtype), (0, 0))
    return jax.lax.with_sharding_constraint(logits, logits_sharding), cache, hidden_out


def score_prompt(family, params, hidden, targets) -> PromptScores:
    """The prompt-logprobs program: at each of PROMPT_CHUNK flat token indices (targets[0]), the
    raw log-distribution's value at the prompt token it predicts (targets[1]), that token's rank
    (1: the most likely) and the MAX_LOGPROBS most likely tokens."""
    note_trace()
    log_probs = jax.nn.log_softmax(family.compute_logits(params, hidden[targets[0]]), axis=-1)
    chosen = jnp.take_along_axis(log_probs, targets[1][:, None], axis=-1)[:, 0]
    rank = 1 + jnp.sum(log_probs > chosen[:, None], axis=-1, dtype=jnp.int32)
    top_logprobs, top_ids = jax.lax.top_k(log_probs, MAX_LOGPROBS)
    return PromptScores(chosen, rank, top_ids.astype(jnp.int32), top_logprobs)


def sample_rows(logits, sampled, tail, floats, layout: SamplingLayout):
    """The sampling program of a step: each row's token (and logprobs) from the forward program's
    logits, recorded in the sampled-token buffer. One program per rows bucket and sampling variant."""
    note_trace()
    f = layout.views(tail, floats)
    sampling, penalty_inputs, token_mask, _, _ = _sampling_arrays(layout.penalty_len, f)
    positions = _sample_positions(logits, sampling, penalty_inputs, layout.flags, max(1, layout.verify_positions),
                                  token_mask)
    return _stack(positions), _record(sampled, f["seq_slots"], positions[0].tokens)


def step(family, cfg, attention, experts, mtp_drafts, params, cache, sampled, ints, floats, layout):
    """A step as one program, forward and sampling together (with the MTP head, which drafts from
    both). Results get a leading axis of one step (the decode loop's results have several)."""
    note_trace()
    tokens, meta, logits_indices, seq_slots, sampling, penalty_inputs, token_mask, _, _ = unpack(layout, ints, floats)
    result, cache, sampled = _forward_and_sample(
        family, cfg, attention, experts, mtp_drafts, params, cache, sampled, tokens, meta, logits_indices, seq_slots,
        sampling, penalty_inputs, token_mask, layout.flags,
    )
    if logits_indices.ndim == 1:
        result = jax.tree.map(lambda x: x[None], result)
    return result, cache, sampled


# XLA's default command-buffer types, with WHILE and CONDITIONAL added: only then is the decode loop
# one CUDA graph (its body re-launched on the device by a conditional node) instead of every kernel of
# every step launched from the host. docs/bench/h200-speed5.md measures it.
DECODE_LOOP_COMMAND_BUFFER = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL"


def decode_loop_compiler_options() -> dict[str, str]:
    """The decode loop program's XLA options; none where XLA_FLAGS already chooses the command buffers."""
    if "xla_gpu_enable_command_buffer" in os.environ.get("XLA_FLAGS", ""):
        return {}
    return {"xla_gpu_enable_command_buffer": DECODE_LOOP_COMMAND_BUFFER}


def decode_steps(
    family, cfg, attention, experts, mtp_drafts, block_size, max_steps, params, cache, sampled, ints, floats, layout,
):
    """Up to `num_steps` decode steps of a pure decode batch (one token per row) in one call.

    Step i feeds each row the token step i-1 sampled, one position further (its K/V slot found in
    the row's block table, which the scheduler extended for every step), samples with the row's
    key for generation step `step + i` (what i separate steps would use), and writes the state
    slot it wrote before. The loop ends early once every row has sampled one of its stop ids. A
    token mask holds for every step (the scheduler runs a masked row several steps only while its
    mask stays the same: short of min_tokens, its stop tokens cleared).
    """
    note_trace()
    (tokens, meta, logits_indices, seq_slots, sampling, penalty_inputs, token_mask, stop_ids,
     num_steps) = unpack(layout, ints, floats)
    flags = layout.flags
    real_token = meta.slot_mapping >= 0
    real_row = seq_slots >= 0
    B, n = seq_slots.shape[0], flags.num_logprobs
    zeros = lambda dtype, *shape: jnp.zeros((max_steps, B, *shape), dtype)  # noqa: E731
    results = SampleResult(zeros(jnp.int32), zeros(jnp.float32), zeros(jnp.int32, n) if n else None,
                           zeros(jnp.float32, n) if n else None, zeros(jnp.int32, mtp_drafts) if mtp_drafts else None)

    def advance(meta):
        positions = meta.positions + real_token
        table_row = meta.block_tables[meta.token_rows]
        page = jnp.take_along_axis(table_row, (positions // block_size)[:, None], axis=1)[:, 0]
        return meta._replace(
            positions=positions,
            slot_mapping=jnp.where(real_token, page * block_size + positions % block_size, -1),
            context_lens=meta.context_lens + real_row,
            state_reads=jnp.where(meta.state_writes >= 0, meta.state_writes, meta.state_reads),
            # A generated token is text: its three M-RoPE rows all one past the last token's largest (which
            # may be an image placeholder's), its embedding its own.
            rope_positions=None if meta.rope_positions is None else jnp.where(
                real_token, jnp.max(meta.rope_positions, axis=0) + 1, meta.rope_positions),
            image_rows=None if meta.image_rows is None else jnp.full_like(meta.image_rows, -1),
        )

    def body(carry):
        i, cache, sampled, tokens, meta, results, done = carry
        step_sampling = sampling._replace(step=sampling.step + i)
        result, cache, sampled = _forward_and_sample(
            family, cfg, attention, experts, mtp_drafts, params, cache, sampled, tokens, meta, logits_indices, seq_slots,
            step_sampling, penalty_inputs, token_mask, flags,
        )
        results = jax.tree.map(lambda acc, r: acc.at[i].set(r), results, result)
        done = done | jnp.any(result.tokens[:, None] == stop_ids, axis=1)
        tokens = jnp.where(real_token, -1, tokens)  # from now on: what the row sampled last
        return i + 1, cache, sampled, tokens, advance(meta), results, done

    def more(carry):
        i, *_, done = carry
        return (i < num_steps) & ~jnp.all(done)

    carry = (jnp.int32(0), cache, sampled, tokens, meta, results, ~real_row)
    _, cache, sampled, _, _, results, _ = jax.lax.while_loop(more, body, carry)
    return results, cache, sampled


def _forward(family, cfg, attention, experts, params, cache, sampled, tokens, meta, seq_slots):
    """(hidden [T, H], the model's cache, tokens): the model over the batch, token -1 read from the
    sampled-token buffer. The cache's last layer is the MTP head's K/V when the head is loaded."""
    slot_of_token = seq_slots[meta.token_rows]
    tokens = jnp.where(tokens >= 0, tokens, sampled[jnp.maximum(slot_of_token, 0)])
    model_cache = cache[:-1] if "mtp" in params else cache
    hidden, model_cache = family.forward(params, cfg, tokens, model_cache, meta, attention, experts)
    return hidden, model_cache, tokens


def _sample_positions(logits, sampling, penalty_inputs, flags, num_positions: int,
                      token_mask=None) -> list[SampleResult]:
    """Sample logits [num_positions x B, V] (position-major): position j of a row samples generation
    step `step + j`, with the key a step-by-step decode would use there (a verify step: the host
    accepts; otherwise one position). `token_mask` [B, W]: the tokens each row may sample, at every
    position (structured outputs never speculate; a row short of min_tokens drafts no further than it)."""
    penalty_ids, penalty_is_output, bias_ids, biases = penalty_inputs if penalty_inputs is not None else (None,) * 4
    B = logits.shape[0] // num_positions
    return [
        sample(logits[j * B : (j + 1) * B], sampling._replace(step=sampling.step + j),
               needs_top_k_p_min_p=flags.needs_top_k_p_min_p, needs_penalties=flags.needs_penalties,
               num_logprobs=flags.num_logprobs, needs_mask=token_mask is not None, penalty_ids=penalty_ids,
               penalty_is_output=penalty_is_output, token_mask=token_mask, logit_bias_ids=bias_ids,
               logit_bias=biases)
        for j in range(num_positions)
    ]


def _stack(per_position: list[SampleResult]) -> SampleResult:
    return jax.tree.map(lambda *xs: jnp.stack(xs), *per_position)


def _record(sampled, seq_slots, tokens):
    """The sampled-token buffer with each row's token at its slot (padding rows point past the end
    and are dropped). Speculating engines run lockstep and never read it: a verify step records
    position 0."""
    slots = jnp.where(seq_slots >= 0, seq_slots, sampled.shape[0])
    return sampled.at[slots].set(tokens, mode="drop")


def _forward_and_sample(
    family, cfg, attention, experts, mtp_drafts, params, cache, sampled, tokens, meta, logits_indices, seq_slots,
    sampling, penalty_inputs, token_mask, flags,
):
    hidden, model_cache, tokens = _forward(family, cfg, attention, experts, params, cache, sampled, tokens, meta,
                                           seq_slots)
    verify = logits_indices.ndim == 2
    logits = family.compute_logits(params, hidden[logits_indices.reshape(-1)])
    per_position = _sample_positions(logits, sampling, penalty_inputs, flags, logits_indices.shape[0] if verify else 1,
                                     token_mask)
    result = _stack(per_position) if verify else per_position[0]
    if "mtp" in params:
        drafts, mtp_kv = mtp.propose_drafts(
            family, cfg, attention, experts, mtp_drafts, params, hidden, tokens, meta, logits_indices, seq_slots,
            jnp.stack([r.tokens for r in per_position]), cache[-1],
        )
        # [B, num_drafts] per step; a verify step's results are per position, each carries the same drafts.
        result = result._replace(draft=jnp.broadcast_to(drafts, (len(per_position), *drafts.shape))
                                 if verify else drafts)
        model_cache = [*model_cache, mtp_kv]
    return result, model_cache, _record(sampled, seq_slots, per_position[0].tokens)
