"""One decode token of the gated delta rule (Gated DeltaNet's recurrence) as one Pallas (Triton
backend) GPU kernel that reads each row's state from the slot pool and writes it back in place.

    S    = exp(g) * S_read                      (the zero state for a fresh row)
    S   += k (beta * (v - S^T k))^T
    o    = S^T q;   S -> pool[write slot]

Same function as `jtp.models.delta_rule.decode_step` (its reference: `gated_delta_step` between a
gather from the pool and `set_rows`).
Left to XLA, a step reads and writes each row's [dk, dv] fp32 state several times (the gather
from the pool, the prediction, the update, the output, the write back) in several kernels; here
program (row, value head, column block) loads its [dk, BV] tile of the state once, keeps it in
registers, and stores it once.

The pool is updated in place (input_output_aliases). A row's write slot is its own (it read it)
or a free one (no other row reads it this step; jtp/core/state_pool.py keeps that invariant), and
padding rows write the scratch slot, which nobody reads. Fresh and padding rows do load a tile (of
slot 0, possibly while its row rewrites it) but discard it for the zero state, so no value read
depends on the order in which programs run.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

COLUMNS = 32  # value columns per program: a [dk, 32] fp32 tile in registers


def supported(dk: int, dv: int) -> bool:
    pow2 = lambda n: n >= 16 and n & (n - 1) == 0  # noqa: E731
    return pow2(dk) and pow2(dv) and dv >= COLUMNS


def _kernel(read_ref, fresh_ref, write_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, pool_in, o_ref, pool_out):
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(j * COLUMNS, COLUMNS)
    state = pool_in[read_ref[b], h, :, cols].astype(jnp.float32)  # [dk, BV]; pool_out is the same buffer
    state = jnp.where(fresh_ref[b] != 0, 0.0, state)
    state = jnp.exp(g_ref[b, h]) * state
    k = k_ref[b, h, :]
    pred = jnp.sum(state * k[:, None], axis=0)  # S^T k, [BV]
    delta = beta_ref[b, h] * (v_ref[b, h, cols] - pred)
    state = state + k[:, None] * delta[None, :]
    o_ref[b, h, cols] = jnp.sum(state * q_ref[b, h, :][:, None], axis=0)
    pool_out[write_ref[b], h, :, cols] = state.astype(pool_out.dtype)


def delta_rule_step(q, k, v, g, beta, pool, read_slots, fresh, write_slots, *, interpret: bool = False):
    """q, k [B, H, dk]; v [B, H, dv]; g, beta [B, H] (fp32); pool [slots, H, dk, dv] fp32; read_slots,
    write_slots i32[B] (in range); fresh bool[B] -> (o [B, H, dv] fp32, the updated pool)."""
    B, H, dk = q.shape
    dv = v.shape[2]
    whole = lambda a: pl.BlockSpec(a.shape, lambda b, h, j: (0,) * a.ndim)  # noqa: E731
    args = (read_slots.astype(jnp.int32), fresh.astype(jnp.int32), write_slots.astype(jnp.int32),
            q, k, v, g, beta, pool)
    o, pool = pl.pallas_call(
        _kernel,
        grid=(B, H, dv // COLUMNS),
        in_specs=[whole(a) for a in args],
        out_specs=[pl.BlockSpec((B, H, dv), lambda b, h, j: (0, 0, 0)), whole(pool)],
        out_shape=[jax.ShapeDtypeStruct((B, H, dv), jnp.float32), jax.ShapeDtypeStruct(pool.shape, pool.dtype)],
        input_output_aliases={8: 1},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="jtp_delta_rule_step",
    )(*args)
    return o, pool
