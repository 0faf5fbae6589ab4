"""The gated delta rule, Gated DeltaNet's recurrence (jtp/models/qwen3_5.py; "reference" below is
the Qwen3.5 architecture reference):

    S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T,   o_t = S_t^T q_t   (per value head, fp32)

over chunks of a row's tokens (prefill, `chunked_gated_delta_rule`) and one token at a time
(decode, `gated_delta_step`, with each row's state read from and written to the slot pool:
`decode_step`); and a layer's whole decode token, conv and gates included, as two Pallas kernels
on GPUs (`fused_decode`, jtp/kernels/delta_rule_step.py); and the chunked rule's chunk-to-chunk
loop as one (`chunked_rule_kernel`, jtp/kernels/delta_rule_chunks.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jtp.kernels import delta_rule_chunks as chunk_kernel
from jtp.kernels import delta_rule_step as fused
from jtp.models.attention import PagedAttention, set_rows

_HIGHEST = jax.lax.Precision.HIGHEST  # the recurrence is fp32 math; no TF32 shortcuts on GPUs


def unit_lower_inverse(A: jax.Array, precision=_HIGHEST) -> jax.Array:
    """(I + A)^-1 for strictly lower-triangular A [..., C, C]. A is nilpotent (A^C = 0), so
    (I + A)^-1 = sum_j (-A)^j = (I - A)(I + A^2)(I + A^4)...: about 2 log2(C) matmuls, no solve.
    Why not lax.linalg.triangular_solve: a solve is sequential where matmuls run on tensor cores,
    and XLA:CPU's solve deadlocks when several devices of one process run it at once."""
    eye = jnp.eye(A.shape[-1], dtype=A.dtype)
    inverse, power = eye - A, A
    for _ in range(max(0, (A.shape[-1] - 1).bit_length() - 1)):
        power = jnp.matmul(power, power, precision=precision)  # A^2, A^4, ...
        inverse = jnp.matmul(inverse, eye + power, precision=precision)
    return inverse


def chunked_gated_delta_rule(q, k, v, g, beta, state, chunk: int, keep_lens=None, row_lens=None,
                             max_tokens: int | None = None, precision=_HIGHEST, kernel: bool = False):
    """The gated delta rule over [B, L] rows, `chunk` tokens at a time (reference §2 step 7), in
    its chunkwise-parallel form: everything a chunk computes from its own tokens (the intra-chunk
    system, its solve, the masked q k^T) runs for all chunks at once, and only the state is carried
    from chunk to chunk (two matmuls a chunk, all rows together).

    q, k [B, L, H, dk]; v [B, L, H, dv]; g (log decay), beta [B, L, H]; state [B, H, dk, dv];
    all fp32, L a multiple of chunk. Padding tokens must have k = g = beta = 0 (no-ops).
    Given row_lens [B] (tokens per row) and max_tokens (a static bound on their sum), the per-chunk
    work skips chunks past a row's end: it runs on ceil(max_tokens / chunk) + B chunks, not B L / chunk.
    Returns o [B, L, H, dv], the final state and, given keep_lens [B], the state after each
    row's first keep_lens[b] tokens (else None).
    kernel: the chunk-to-chunk loop and the outputs in one Pallas kernel
    (jtp/kernels/delta_rule_chunks.py; Pallas' interpreter off-GPU) where it tiles the shapes.
    """
    B, L, H, dk = k.shape
    n, C = L // chunk, chunk
    kernel = kernel and chunk_kernel.supported(C, dk, v.shape[-1])
    einsum = functools.partial(jnp.einsum, precision=precision)

    def chunks(x):  # [B, L, H, ...] -> [B n, H, C, ...]: one entry per chunk, rows' chunks in order
        x = jnp.swapaxes(x.reshape(B, n, C, H, *x.shape[3:]), 2, 3)
        return x.reshape(B * n, H, C, *x.shape[4:])

    live = B * n  # chunks that get the per-chunk work
    if row_lens is not None and max_tokens is not None:
        live = min(live, -(-max_tokens // C) + B)  # ceil(tokens / C), plus one part-filled chunk a row
    idx = None
    if live < B * n:  # the live chunks first (in order), then enough empty ones to fill `live`
        is_live = (jnp.arange(n)[None, :] * C < row_lens[:, None]).reshape(B * n)
        idx = jnp.argsort(~is_live, stable=True)[:live]

    def take(x):  # [B n, ...] -> [live, ...]
        return x if idx is None else x[idx]

    def spread(x):  # [live, ...] -> [B, n, ...]; the chunks not taken are zero
        if idx is not None:
            x = jnp.zeros((B * n, *x.shape[1:]), x.dtype).at[idx].set(x)
        return x.reshape(B, n, *x.shape[1:])

    # Per chunk, from its own tokens alone ([live, H, C, ...]).
    q_, k_, v_, g_, beta_ = (take(chunks(x)) for x in (q, k, v, g, beta))
    causal = jnp.tril(jnp.ones((C, C), bool))  # j <= i
    strict = jnp.tril(jnp.ones((C, C), bool), -1)  # j < i
    gamma = jnp.cumsum(g_, axis=-1)
    # exp(gamma_i - gamma_j) for j <= i; masked before exp so nothing overflows.
    decay = jnp.exp(jnp.where(causal, gamma[..., :, None] - gamma[..., None, :], -jnp.inf))
    kb = k_ * beta_[..., None]
    A = einsum("nhid,nhjd->nhij", kb, k_) * jnp.where(strict, decay, 0.0)
    # (I + A) [U | W] = [beta v | beta k e^gamma], as two products with the one inverse (a
    # concatenated right-hand side would be a copy of both).
    inverse = unit_lower_inverse(A, precision)
    U = einsum("nhij,nhjd->nhid", inverse, v_ * beta_[..., None])
    W = einsum("nhij,nhjd->nhid", inverse, kb * jnp.exp(gamma)[..., None])
    last = gamma[..., -1]  # [live, H]
    k_out = k_ * jnp.exp(last[..., None] - gamma)[..., None]  # what each key adds to the chunk's end state

    if kernel:  # the loop and the outputs in one kernel, each row's chunks from its first live one
        if idx is None:
            first, count = jnp.arange(B) * n, jnp.full((B,), n)
        else:
            count = is_live.reshape(B, n).sum(1)
            first = jnp.minimum(jnp.cumsum(count) - count, live)
            count = jnp.minimum(count, live - first)  # never past the live chunks (max_tokens too small)
        m = keep_lens - 1 if keep_lens is not None else jnp.full((B,), -1)
        keep = jnp.where(m >= 0, jnp.clip(m // C, 0, n - 1), 0)  # chunk 0 starts from the initial state
        qk = einsum("nhid,nhjd->nhij", q_, k_) * decay
        o, state, start = chunk_kernel.chunk_loop(q_ * jnp.exp(gamma)[..., None], qk, U, W, k_out, last, state,
                                                  first, count, keep, interpret=jax.default_backend() != "gpu")
        if idx is not None:  # the chunks of no row, which the kernel does not write
            o = jnp.where((jnp.arange(live) < count.sum())[:, None, None, None], o, 0.0)
    else:  # from chunk to chunk: S' = e^last S + k_out^T (U - W S), for all rows at once
        def step(S, c):
            U, W, k_out, last = c
            new_values = U - einsum("bhck,bhkv->bhcv", W, S)
            return jnp.exp(last)[..., None, None] * S + einsum("bhck,bhcv->bhkv", k_out, new_values), S

        U_rows, W_rows, k_out_rows, last_rows = (spread(x) for x in (U, W, k_out, last))  # [B, n, ...]
        xs = tuple(jnp.moveaxis(x, 1, 0) for x in (U_rows, W_rows, k_out_rows, last_rows))  # [n, B, ...]
        state, starts = jax.lax.scan(step, state, xs)  # starts: the state each chunk starts from [n, B, ...]
        starts = jnp.moveaxis(starts, 0, 1)  # [B, n, H, dk, dv]

        S = take(starts.reshape(B * n, H, dk, -1))
        new_values = U - einsum("nhck,nhkv->nhcv", W, S)
        o = einsum("nhik,nhkv->nhiv", q_ * jnp.exp(gamma)[..., None], S)
        o = o + einsum("nhij,nhjv->nhiv", einsum("nhid,nhjd->nhij", q_, k_) * decay, new_values)
    o = jnp.swapaxes(spread(o), 2, 3).reshape(B, L, H, -1)  # [B, n, H, C, dv] -> [B, L, H, dv]

    kept = None
    if keep_lens is not None:  # the state after token m = keep_lens - 1, from its chunk's start state
        m = keep_lens - 1
        rows, c = jnp.arange(B), jnp.clip(m // C, 0, n - 1)  # that chunk of each row
        if kernel:  # that chunk's U and W where it is live (else zero, as spread makes them)
            has = (keep < count)[:, None, None, None]
            U_c, W_c = (jnp.where(has, x[jnp.minimum(first + keep, live - 1)], 0.0) for x in (U, W))
        else:
            start, U_c, W_c = starts[rows, c], U_rows[rows, c], W_rows[rows, c]
        gamma_c = jnp.cumsum(jnp.swapaxes(g.reshape(B, n, C, H)[rows, c], 1, 2), axis=-1)  # [B, H, C]
        k_c = jnp.swapaxes(k.reshape(B, n, C, H, dk)[rows, c], 1, 2)  # [B, H, C, dk]
        pos = jnp.clip(m - c * C, 0, C - 1)
        gamma_m = jnp.take_along_axis(gamma_c, pos[:, None, None], axis=-1)  # [B, H, 1]
        upto = (jnp.arange(C) <= pos[:, None])[:, None, :]  # [B, 1, C]
        weight = jnp.where(upto, jnp.exp(jnp.where(upto, gamma_m - gamma_c, 0.0)), 0.0)
        values = U_c - einsum("bhck,bhkv->bhcv", W_c, start)
        S_m = jnp.exp(gamma_m)[..., None] * start + einsum("bhck,bhcv->bhkv", k_c * weight[..., None], values)
        kept = jnp.where((m >= 0)[:, None, None, None], S_m, start if kernel else starts[:, 0])
    return o, state, kept


def gated_delta_step(q, k, v, g, beta, state):
    """One token of the gated delta rule per row (reference §2 step 6; the L = 1 decode path).

    q, k [B, H, dk]; v [B, H, dv]; g, beta [B, H]; state [B, H, dk, dv]; all fp32. An empty row
    has k = g = beta = 0, which leaves its state unchanged. Returns o [B, H, dv] and the state.
    """
    S = jnp.exp(g)[..., None, None] * state
    pred = jnp.einsum("bhkv,bhk->bhv", S, k, precision=_HIGHEST)  # S^T k
    S = S + k[..., :, None] * (beta[..., None] * (v - pred))[..., None, :]
    return jnp.einsum("bhkv,bhk->bhv", S, q, precision=_HIGHEST), S


def read_states(pool, read_slots, fresh):
    """Each row's state from a slot pool [slots, ...]: pool[read_slots], the zero state where fresh."""
    s = pool[read_slots]
    return jnp.where(fresh.reshape(-1, *(1,) * (s.ndim - 1)), jnp.zeros_like(s), s)


def decode_step(q, k, v, g, beta, pool, read_slots, fresh, write_slots):
    """`gated_delta_step` for each row's state in the pool: read from read_slots (the zero state
    where fresh), written to write_slots (all in range). q, k [B, H, dk]; v [B, H, dv]; g, beta [B, H];
    pool [slots, H, dk, dv]. Returns (o [B, H, dv], the updated pool)."""
    o, final = gated_delta_step(q, k, v, g, beta, read_states(pool, read_slots, fresh))
    return o, set_rows(pool, write_slots, final)


def chunk_kernel_supported(attend: PagedAttention, chunk: int, dk: int, dv: int, key_heads: int) -> bool:
    """Whether a DeltaNet layer's chunked rule takes the chunk kernel (`chunked_rule_kernel`): the
    GPU kernel path (attend.impl "kernel"), shapes the kernel tiles, key heads that split over tp."""
    return attend.impl == "kernel" and key_heads % attend.tp == 0 and chunk_kernel.supported(chunk, dk, dv)


def chunked_rule_kernel(attend: PagedAttention, q, k, v, g, beta, state, chunk: int, keep_lens, row_lens,
                        max_tokens: int | None):
    """`chunked_gated_delta_rule(kernel=True)`; under tensor parallelism per head shard inside
    shard_map (a pallas_call is opaque to XLA's SPMD partitioner; the rule is head-local).
    row_lens [B] (not None); keep_lens [B] or None."""
    rule = functools.partial(chunked_gated_delta_rule, chunk=chunk, max_tokens=max_tokens, kernel=True)
    if attend.tp == 1:
        return rule(q, k, v, g, beta, state, keep_lens=keep_lens, row_lens=row_lens)
    keep = keep_lens is not None

    def local(q, k, v, g, beta, state, row_lens, keep_lens):
        o, final, kept = rule(q, k, v, g, beta, state, keep_lens=keep_lens if keep else None, row_lens=row_lens)
        return o, final, kept if keep else final

    heads, states = P(None, None, "tp"), P(None, "tp")
    o, final, kept = jax.shard_map(local, mesh=attend.mesh, in_specs=(heads,) * 5 + (states, P(), P()),
                                   out_specs=(heads, states, states), check_vma=False)(
        q, k, v, g, beta, state, row_lens, keep_lens if keep else row_lens)
    return o, final, kept if keep else None


def fused_decode_supported(attend: PagedAttention, dk: int, dv: int, key_heads: int, *channels: int) -> bool:
    """Whether a DeltaNet layer's decode token takes `fused_decode`: the GPU kernels (attend.impl
    "kernel", the runner's choice for the sequence mixers) at head sizes they tile, per device."""
    tp = attend.tp
    return attend.impl == "kernel" and key_heads % tp == 0 and all(c % tp == 0 for c in channels) \
        and fused.supported(dk, dv, *(c // tp for c in channels))


def fused_decode(columns, conv_weights, conv_states, a_log, dt_bias, pool, rows, attend: PagedAttention):
    """A DeltaNet layer's decode token (rows of at most one token) in two kernels: the conv update of
    the q, k and v channels, then the gates, q/k normalisation and recurrence
    (jtp/kernels/delta_rule_step.py); under tensor parallelism per head shard inside shard_map.

    columns: (array, first column, columns) of q, k, v (before the conv) and a, b, each [T, ...]
    (`layers.project_columns`: a fused projection's output is read in place, not sliced);
    conv_weights / conv_states: the three parts' [C, K] / [slots, C, K-1]; a_log, dt_bias [Hv];
    pool [slots, Hv, dk, dv]; rows: (token, valid, read_slots, fresh, write_slots), each [B].
    Returns (o [B, Hv, dv] fp32, the conv states, the pool)."""
    if attend.tp > 1:  # each part its own array, split over "tp" (projections are fused on one device only)
        columns = [(y if size == y.shape[-1] else y[..., first : first + size], 0, size) for y, first, size in columns]
    sources, parts = [], []
    for y, first, _ in columns:
        if not any(y is s for s in sources):
            sources.append(y)
        parts.append((next(i for i, s in enumerate(sources) if s is y), first))
    interpret = jax.default_backend() != "gpu"

    def local(sources, conv_weights, conv_states, a_log, dt_bias, pool, rows):
        (q, k, v), conv_states = fused.conv_update(sources, parts[:3], conv_weights, conv_states, *rows,
                                                   interpret=interpret)
        o, pool = fused.delta_rule_step(q, k, v, sources, parts[3], parts[4], a_log, dt_bias, pool, *rows,
                                        interpret=interpret)
        return o, conv_states, pool

    args = (tuple(sources), tuple(conv_weights), tuple(conv_states), a_log, dt_bias, pool, tuple(rows))
    if attend.tp == 1:
        return local(*args)
    weights, states = (P("tp", None),) * 3, (P(None, "tp", None),) * 3
    heads, state_pool = P("tp"), P(None, "tp", None, None)
    in_specs = ((P(None, "tp"),) * len(sources), weights, states, heads, heads, state_pool, (P(),) * 5)
    return jax.shard_map(local, mesh=attend.mesh, in_specs=in_specs,
                         out_specs=(P(None, "tp", None), states, state_pool), check_vma=False)(*args)
