"""A Gated DeltaNet decode token (rows of one token each) as two Pallas (Triton backend) GPU
kernels that read each row's state from the slot pools and write it back in place.

`conv_update`: the causal depthwise conv of the q, k and v channels, one step:

    full = [conv state (K-1 inputs, the zero state for a fresh row) | x]
    y    = silu(sum_j full[:, j] w[:, j]) (fp32, stored in x's dtype);   conv state <- full[:, 1:]

program (row, block of channels) over the q, k and v channels in one launch.

Both kernels read their inputs (q, k, v before the conv; a, b) as columns of the arrays that hold
them, typically the one output of the layer's fused input projection: a slice passed to a custom
call is a copy, one small kernel each.

`delta_rule_step`: the gates, the q/k normalisation and the recurrence, per value head h (key head
h // r):

    q, k = l2norm(q) / sqrt(dk), l2norm(k);   beta = sigmoid(b);   g = -exp(A_log) softplus(a + dt_bias)
    S    = exp(g) S_read;   S += k (beta (v - S^T k))^T;   o = S^T q;   S -> pool[write slot]

program (row, value head, block of value columns) loads its [dk, BV] tile of the state once, keeps
it in registers and stores it once. A row that is not `valid` (padding, or in a prompt step a row
of several tokens, which the chunked rule runs) reads and writes no state and outputs zeros: a
lone prompt's step in a 64-row bucket moves no state for its 63 other rows.

Same functions as the jnp path of jtp/models/qwen3_5.py (`conv_step`, the gates, and
jtp/models/delta_rule.py's `gated_delta_step` between a gather from the pool and `set_rows`), where
XLA makes ~15 small kernels of a layer's decode step.

In place: a row's write slot is its own (it read it) or a free one (no other row reads it this
step; jtp/core/state_pool.py keeps that invariant), and rows that are not valid write nothing
(the jnp path writes their state unchanged to the scratch slot, which nobody reads); each program reads and writes only its own channels of its own row. Fresh rows do
load their tile (of slot 0, possibly while its row rewrites it) but discard it for the zero state,
so no value used depends on the order in which programs run.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

COLUMNS = 32  # value columns per program of the recurrence: a [dk, 32] fp32 tile in registers
MAX_CHANNELS = 128  # conv channels per program


def channel_block(*channels: int) -> int:
    """Conv channels per program: the largest power of two (<= 128) dividing every part's count."""
    return math.gcd(MAX_CHANNELS, *channels) if channels else 0


def supported(dk: int, dv: int, *channels: int) -> bool:
    pow2 = lambda n: n >= 16 and n & (n - 1) == 0  # noqa: E731
    return pow2(dk) and pow2(dv) and dv >= COLUMNS and channel_block(*channels) >= 16


def _rows(*arrays):
    return tuple(a.astype(jnp.int32) for a in arrays)


def _whole(a):
    return pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)


def _conv_kernel(token_ref, valid_ref, read_ref, fresh_ref, write_ref, *refs, sources, parts, block):
    n = len(parts)
    x_refs, refs = refs[:sources], refs[sources:]
    w_refs, state_in, out_refs, state_out = (refs[i * n : (i + 1) * n] for i in range(4))
    b, c = pl.program_id(0), pl.program_id(1)
    taps = w_refs[0].shape[1]
    valid = valid_ref[b] != 0
    first = 0
    for i, (source, offset) in enumerate(parts):
        count = w_refs[i].shape[0] // block
        part = (c >= first) & (c < first + count)

        @pl.when(part & ~valid)
        def _(i=i, first=first):
            out_refs[i][b, pl.ds((c - first) * block, block)] = jnp.zeros((block,), out_refs[i].dtype)

        @pl.when(part & valid)
        def _(i=i, source=source, offset=offset, first=first):
            cols = pl.ds((c - first) * block, block)
            x = x_refs[source][token_ref[b], pl.ds(offset + (c - first) * block, block)]
            fresh = fresh_ref[b] != 0
            slot = read_ref[b]
            prev = [jnp.where(fresh, 0.0, state_in[i][slot, cols, j].astype(jnp.float32)).astype(x.dtype)
                    for j in range(taps - 1)]
            full = prev + [x]
            y = sum(full[j].astype(jnp.float32) * w_refs[i][cols, j].astype(jnp.float32) for j in range(taps))
            out_refs[i][b, cols] = (y * jax.nn.sigmoid(y)).astype(out_refs[i].dtype)
            for j in range(taps - 1):
                state_out[i][write_ref[b], cols, j] = full[j + 1].astype(state_out[i].dtype)

        first += count


def conv_update(sources, parts, weights, states, token, valid, read_slots, fresh, write_slots, *,
                interpret: bool = False):
    """One conv step of each part (q, k, v): part i is columns [offset, offset + C_i) of
    sources[src] [T, W] (flat tokens; row b's is token[b]), parts[i] = (src, offset); weights
    [C_i, K], states [slots, C_i, K-1] -> (outputs [B, C_i] in the sources' dtype, the states)."""
    n, B = len(parts), token.shape[0]
    if len({x.dtype for x in sources}) != 1:
        raise ValueError(f"conv_update: the sources' dtypes differ: {[x.dtype for x in sources]}")
    block = channel_block(*(w.shape[0] for w in weights))
    rows = _rows(token, valid, read_slots, fresh, write_slots)
    operands = (*rows, *sources, *weights, *states)
    out_shape = [jax.ShapeDtypeStruct((B, w.shape[0]), sources[0].dtype) for w in weights] + \
        [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in states]
    outs = pl.pallas_call(
        lambda *refs: _conv_kernel(*refs, sources=len(sources), parts=tuple(parts), block=block),
        grid=(B, sum(w.shape[0] // block for w in weights)),
        in_specs=[_whole(a) for a in operands],
        out_specs=[_whole(a) for a in out_shape],
        out_shape=out_shape,
        input_output_aliases={len(rows) + len(sources) + n + i: n + i for i in range(n)},
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="jtp_conv_update",
    )(*operands)
    return tuple(outs[:n]), tuple(outs[n:])


def _l2_normalize(x):
    return x * jax.lax.rsqrt(jnp.sum(x * x) + 1e-6)


def _step_kernel(token_ref, valid_ref, read_ref, fresh_ref, write_ref, q_ref, k_ref, v_ref, *refs, sources: int,
                 a_part, b_part, ratio: int):
    gate_refs, (a_log_ref, dt_bias_ref, pool_in, o_ref, pool_out) = refs[:sources], refs[sources:]
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    dk = pool_in.shape[2]
    cols = pl.ds(j * COLUMNS, COLUMNS)
    valid = valid_ref[b] != 0

    @pl.when(~valid)
    def _():
        o_ref[b, h, cols] = jnp.zeros((COLUMNS,), o_ref.dtype)

    @pl.when(valid)
    def _():
        t = token_ref[b]
        key = pl.ds((h // ratio) * dk, dk)
        q = _l2_normalize(q_ref[b, key].astype(jnp.float32)) * dk**-0.5
        k = _l2_normalize(k_ref[b, key].astype(jnp.float32))
        beta = jax.nn.sigmoid(gate_refs[b_part[0]][t, b_part[1] + h].astype(jnp.float32))
        z = gate_refs[a_part[0]][t, a_part[1] + h].astype(jnp.float32) + dt_bias_ref[h].astype(jnp.float32)
        softplus = jnp.maximum(z, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(z)))
        g = -jnp.exp(a_log_ref[h].astype(jnp.float32)) * softplus
        v = v_ref[b, pl.ds(h * pool_in.shape[3] + j * COLUMNS, COLUMNS)].astype(jnp.float32)

        state = pool_in[read_ref[b], h, :, cols].astype(jnp.float32)  # [dk, BV]; pool_out is the same buffer
        state = jnp.where(fresh_ref[b] != 0, 0.0, state)
        state = jnp.exp(g) * state
        pred = jnp.sum(state * k[:, None], axis=0)  # S^T k, [BV]
        state = state + k[:, None] * (beta * (v - pred))[None, :]
        o_ref[b, h, cols] = jnp.sum(state * q[:, None], axis=0)
        pool_out[write_ref[b], h, :, cols] = state.astype(pool_out.dtype)


def delta_rule_step(q, k, v, sources, a_part, b_part, a_log, dt_bias, pool, token, valid, read_slots, fresh,
                    write_slots, *, interpret: bool = False):
    """q, k [B, Hk * dk] and v [B, Hv * dv] (the conv outputs); a and b [T, Hv] are columns
    [offset, offset + Hv) of sources[src] (flat tokens; row r's is token[r]), a_part / b_part =
    (src, offset); a_log, dt_bias [Hv]; pool [slots, Hv, dk, dv] fp32; token, read_slots,
    write_slots i32[B] (in range); valid, fresh bool[B] -> (o [B, Hv, dv] fp32, the updated pool)."""
    B = token.shape[0]
    _, H, dk, dv = pool.shape
    operands = (*_rows(token, valid, read_slots, fresh, write_slots), q, k, v, *sources, a_log, dt_bias, pool)
    kernel = functools.partial(_step_kernel, sources=len(sources), a_part=tuple(a_part), b_part=tuple(b_part),
                               ratio=H * dk // q.shape[1])
    o, pool = pl.pallas_call(
        kernel,
        grid=(B, H, dv // COLUMNS),
        in_specs=[_whole(x) for x in operands],
        out_specs=[pl.BlockSpec((B, H, dv), lambda *_: (0, 0, 0)), _whole(pool)],
        out_shape=[jax.ShapeDtypeStruct((B, H, dv), jnp.float32), jax.ShapeDtypeStruct(pool.shape, pool.dtype)],
        input_output_aliases={len(operands) - 1: 1},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="jtp_delta_rule_step",
    )(*operands)
    return o, pool
