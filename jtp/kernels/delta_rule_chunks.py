"""The chunk-to-chunk part of the chunked gated delta rule (jtp/models/delta_rule.py,
`chunked_gated_delta_rule(kernel=True)`) as one Pallas (Triton backend) GPU kernel: the state
loop and each chunk's outputs, with the state held in registers from a row's first chunk to its last.

Per chunk c of C tokens (value head h), from the per-chunk precomputation done in jnp:

    new_v = U[c] - W[c] S                       [C, dv]   the chunk's values less what S predicts
    o[c]  = qg[c] S + qk[c] new_v               [C, dv]   qg = q e^gamma; qk = (q k^T) * decay (causal)
    S     = e^last[c] S + k_out[c]^T new_v      [dk, dv]  the state the next chunk starts from

program (row b, value head h, block of COLUMNS value columns) loads its [dk, COLUMNS] tile of row
b's initial state, runs the row's count[b] chunks (live chunks first[b] .. first[b] + count[b] - 1
of the [live, H, C, ...] arrays: a row's chunks are contiguous and in order there) and stores the
final state; on the way it stores the state chunk keep[b] starts from (the final state where
keep[b] >= count[b]): the kept state's start (a verify row's state before its drafts). Where the
jnp path runs one `lax.scan` trip per chunk over all rows (most of them empty in a prompt step)
and writes every chunk's start state to memory, this reads each live chunk once per program and
writes only the outputs. Chunks of no row (past the last row's) are not written.

Precision: TF32 x3 (Triton's input_precision "tf32x3": each fp32 operand split into two TF32
parts, three tensor-core products). The rule is fp32 math (the jnp path's Precision.HIGHEST);
Triton's "ieee" fp32 dot runs on the FMA units, several times slower, and plain TF32 errs by ~7e-4
(docs/bench/h200/speed9/m3/delta-rule.md), while TF32 x3 measured 6e-7 there against HIGHEST.
`PRECISION = jax.lax.Precision.HIGHEST` lowers to "ieee". In Pallas' interpreter (off-GPU) the
dots run at HIGHEST: XLA:CPU has no TF32 x3.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

COLUMNS = 32  # value columns per program: a [dk, 32] fp32 state tile in registers (dv 128: 4 programs a head)
PRECISION = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
NUM_WARPS, NUM_STAGES = 4, 1
_TRANSPOSED_LHS = (((0,), (0,)), ((), ()))  # a^T b


def supported(C: int, dk: int, dv: int) -> bool:
    """Tiles Triton's dots take (powers of two, 16 or more) and registers hold: chunks of up to 64
    tokens, key heads of up to 128, value heads of COLUMNS or more."""
    pow2 = lambda n: n >= 16 and n & (n - 1) == 0  # noqa: E731
    return pow2(C) and pow2(dk) and pow2(dv) and C <= 64 and dk <= 128 and dv >= COLUMNS


def _whole(a):
    return pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)


def _kernel(first_ref, count_ref, keep_ref, qg_ref, qk_ref, u_ref, w_ref, k_out_ref, last_ref, state_ref,
            o_ref, final_ref, kept_ref, *, precision):
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(j * COLUMNS, COLUMNS)
    first, count, keep = first_ref[b], count_ref[b], keep_ref[b]
    dot = functools.partial(jax.lax.dot_general, precision=precision, preferred_element_type=jnp.float32)
    mm = lambda a, s: dot(a, s, (((1,), (0,)), ((), ())))  # noqa: E731

    def chunk(i, S):  # S: [dk, COLUMNS], the state chunk i of the row starts from
        @pl.when(i == keep)
        def _():
            kept_ref[b, h, :, cols] = S

        c = first + i
        new_v = u_ref[c, h, :, cols] - mm(w_ref[c, h], S)  # [C, COLUMNS]
        o_ref[c, h, :, cols] = mm(qg_ref[c, h], S) + mm(qk_ref[c, h], new_v)
        return jnp.exp(last_ref[c, h]) * S + dot(k_out_ref[c, h], new_v, _TRANSPOSED_LHS)

    S = jax.lax.fori_loop(0, count, chunk, state_ref[b, h, :, cols])
    final_ref[b, h, :, cols] = S

    @pl.when(keep >= count)
    def _():
        kept_ref[b, h, :, cols] = S


def chunk_loop(qg, qk, u, w, k_out, last, state, first, count, keep, *, interpret: bool = False):
    """qg, w, k_out [live, H, C, dk]; qk [live, H, C, C]; u [live, H, C, dv]; last [live, H];
    state [B, H, dk, dv] (each row's initial state); first, count, keep i32[B]: row b's chunks are
    live chunks first[b] .. first[b] + count[b] - 1 (all in range), keep[b] the chunk whose start
    state is kept. All fp32. -> (o [live, H, C, dv] (chunks of no row unwritten), the final states,
    the kept start states [B, H, dk, dv])."""
    B, H, dk, dv = state.shape
    live, _, C, _ = qg.shape
    operands = (*(x.astype(jnp.int32) for x in (first, count, keep)), qg, qk, u, w, k_out, last, state)
    out_shape = [jax.ShapeDtypeStruct((live, H, C, dv), jnp.float32), jax.ShapeDtypeStruct(state.shape, jnp.float32),
                 jax.ShapeDtypeStruct(state.shape, jnp.float32)]
    return pl.pallas_call(
        functools.partial(_kernel, precision=jax.lax.Precision.HIGHEST if interpret else PRECISION),
        grid=(B, H, dv // COLUMNS),
        in_specs=[_whole(x) for x in operands],
        out_specs=[_whole(x) for x in out_shape],
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES),
        interpret=interpret,
        name="jtp_delta_rule_chunks",
    )(*operands)
