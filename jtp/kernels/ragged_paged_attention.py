"""Ragged paged attention as one Pallas (Triton backend) GPU kernel.

Same function as `jtp.models.attention.paged_attention_reference`: T flat query tokens of B rows
(decode tokens and prefill chunks mixed, each row's tokens contiguous), causal GQA over each
row's pages of a [num_blocks, block_size, kv_heads, head_dim] cache.

Work decomposition
------------------
* A row's tokens are cut into query tiles of TQ tokens. The tiles of all rows are listed
  densely (`_tile_map`, plain jnp before the kernel): at most min(T, B + ceil(T / TQ)) tiles, so
  the grid does not grow with rows x max_row_len, and a decode step has one tile per row.
* Program (kv head h, tile j, split s) holds the tile's TQ tokens x G query heads of KV head h
  as one [TQ*G, D] matrix (q is laid out [kv_heads, tokens*G, D] beforehand, so the tile is one
  contiguous block), and streams the row's pages, `pages_per_iter` pages per iteration (gathered
  as key rows of a [num_blocks * block_size, D] view, so the load feeds the dot), only up
  to the tile's causal limit min(context_len, last position + 1): decode tiles read the row's
  context exactly once, prefill tiles skip pages past their last token.
* For small batches the key range of each tile is split over `num_splits` programs (flash
  decoding); partial (o, m, l) are merged in jnp afterwards. With num_splits == 1 the kernel
  normalises and writes q.dtype output directly.
* Pure decode steps (every row has at most one token: `max_row_len == 1`) take a dedicated path,
  `paged_decode_attention`: one program per (token, kv head, split) reads its G query heads straight
  from the [T, Hq, D] layout and writes the output in place, no tile map, no transposes, no
  padding mask; with splits a second tiny Pallas kernel merges the partials. Around the kernel(s)
  only free reshapes remain (see tests/test_attention.py::test_decode_path_op_count).
* Online softmax in fp32 with exp2 (scale * log2 e folded into the scores), masked scores get a
  large finite negative value: no inf - inf, no NaN.
"""

from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import (
    triton as plgpu,  # masked loads/stores, compiler params
)

_MASKED = -1e30
_LOG2E = math.log2(math.e)


def _attend_pages(q, k_ref, v_ref, bt_ref, row, it0, it1, ppi, block_size, limit, scale_log2, precision):
    """Online softmax of q [M, D] over the row's pages it0*ppi .. it1*ppi (ppi pages per iteration).

    K/V refs are one kv head's cache as [num_blocks * block_size, D] key rows; each iteration
    gathers its keys' rows by the block table as one 2-D load that feeds the dot directly (a load
    of whole [ppi, block_size, D] pages needs a reshape before the dot, which kept Triton from
    pipelining it: B=64 decode ran at 1.9 TB/s against 2.9 this way, docs/bench/h200-speed8.md).
    Keys past `limit` (the last visible position, per query row or shared) are masked. Returns the
    unnormalised accumulator [M, D], the running max (log2 units) and the running denominator.
    Float8 pages with a 16-bit q are multiplied in float16 (`_operand_dtype`).
    """
    q = q.astype(_operand_dtype(q.dtype, k_ref.dtype))
    m_rows, head_dim = q.shape
    n_keys = ppi * block_size
    key_iota = lax.broadcasted_iota(jnp.int32, (n_keys,), 0)

    def body(it, carry):
        acc, m_prev, l_prev = carry
        slot = it * n_keys + key_iota  # the row's key positions this iteration
        key_rows = bt_ref[row, slot // block_size] * block_size + slot % block_size
        k = k_ref[key_rows].astype(q.dtype)  # [N, D]; float8 pages: converted in registers
        v = v_ref[key_rows].astype(q.dtype)
        scores = lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32, precision=precision
        ) * scale_log2  # [M, N], in log2 units
        scores = jnp.where(slot[None, :] <= limit, scores, _MASKED)
        m_next = jnp.maximum(m_prev, jnp.max(scores, axis=1))
        corr = jnp.exp2(m_prev - m_next)
        p = jnp.exp2(scores - m_next[:, None])
        l_next = l_prev * corr + jnp.sum(p, axis=1)
        pv = lax.dot_general(
            p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32, precision=precision
        )
        return acc * corr[:, None] + pv, m_next, l_next

    init = (
        jnp.zeros((m_rows, head_dim), jnp.float32),
        jnp.full((m_rows,), _MASKED, jnp.float32),
        jnp.zeros((m_rows,), jnp.float32),
    )
    return lax.fori_loop(it0, it1, body, init)


def _operand_dtype(q_dtype, page_dtype):
    """The dtype both dots take their operands in. Float8 e4m3 pages under a 16-bit q: float16, to
    which e4m3 converts exactly in one instruction per pair on sm_89+ (converted to bfloat16, float8
    pages read no faster than bfloat16 ones: docs/bench/h200-speed11.md); a bfloat16 q rounds to
    float16 exactly within float16's range, and the softmax weights gain precision. Else q's dtype."""
    if jnp.dtype(page_dtype) == jnp.dtype(jnp.float8_e4m3fn) and jnp.dtype(q_dtype).itemsize == 2:
        return jnp.float16
    return q_dtype


# ----------------------------------------------------------------------------- config


def _pow2_floor(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


# Shared memory one program may use: an H200 (sm_90) gives a block 227 KiB; keep room for Triton's
# own scratch (scores, running max and sum).
SHARED_MEMORY_BUDGET = 192 * 1024


def fit_shared_memory(q_rows: int, ppi: int, stages: int, block_size: int, head_dim: int, itemsize: int):
    """(pages per iteration, stages) whose tiles fit SHARED_MEMORY_BUDGET: a [q_rows, D] query tile
    plus `stages` buffered [keys, D] K and V tiles. Float32 with D = 256 (Qwen3.5's attention) at
    the bf16 tile sizes asks 320 KiB; halving the keys per iteration, then the pipelining, fits it."""
    def need(ppi, stages):
        return (q_rows + 2 * stages * ppi * block_size) * head_dim * itemsize

    while need(ppi, stages) > SHARED_MEMORY_BUDGET and ppi > 1:
        ppi //= 2
    while need(ppi, stages) > SHARED_MEMORY_BUDGET and stages > 1:
        stages -= 1
    return ppi, stages


def choose_config(T: int, num_kv_heads: int, group: int, block_size: int, max_row_len: int | None = None,
                  head_dim: int = 128, itemsize: int = 2):
    """Static tile sizes for a step shape (T tokens, local kv heads, rows of at most
    `max_row_len` tokens); env vars override.

    Steps of short rows (T <= 128 and rows of at most 16 tokens: decodes, small prompts) use 16
    query rows (TQ*G) per tile, so the MMA is the minimum 16 and a decode row wastes least; a step
    with a longer row (a prefill chunk, or the tail of a prompt whose prefix came from the cache,
    which attends over the whole cached context) uses 64 rows for K/V reuse, which cut a cached
    follow-up turn's time to first token (docs/bench/h200-prefix-cache.md).
    Splits: enough programs for the 132 SMs when there are few rows (B=1: 8 kv heads x 8).
    """
    short = T <= 128 and (max_row_len is None or max_row_len <= 16)
    rows = int(os.environ.get("JTP_ATTN_ROWS", "16" if short else "64"))
    tq = max(1, _pow2_floor(rows // group)) if group <= rows else 1
    keys = int(os.environ.get("JTP_ATTN_KEYS", "64"))
    ppi = max(1, _pow2_floor(max(keys // block_size, 1)))
    env_splits = os.environ.get("JTP_ATTN_SPLITS")
    if env_splits:
        splits = int(env_splits)
    else:
        splits = max(1, min(8, 1024 // max(1, num_kv_heads * T)))
    warps = int(os.environ.get("JTP_ATTN_WARPS", "4"))
    stages = int(os.environ.get("JTP_ATTN_STAGES", "2"))
    ppi, stages = fit_shared_memory(tq * group, ppi, stages, block_size, head_dim, itemsize)
    return tq, ppi, splits, warps, stages


def supported(q_shape, k_shape) -> bool:
    """Shapes the kernel handles (Triton tiles must be powers of two)."""
    _, hq, d = q_shape
    _, bs, hkv, dk = k_shape
    pow2 = lambda n: n >= 1 and n & (n - 1) == 0  # noqa: E731
    return d == dk and hq % hkv == 0 and pow2(hq // hkv) and pow2(d) and d >= 16 and pow2(bs)


# ----------------------------------------------------------------------------- kernel


def _kernel(
    tile_row_ref, tile_start_ref, tile_len_ref,  # [NT] each
    ctx_ref,  # [B]
    bt_ref,  # [B, M_pad]
    pos_ref,  # [(T+TQ)*G] position of each q row (token position repeated G times)
    q_ref,  # [(T+TQ)*G, D] this kv head's query rows
    k_ref, v_ref,  # [num_blocks * block_size, D] this kv head's key rows
    *out_refs,
    tq: int, group: int, ppi: int, block_size: int, num_splits: int, scale_log2: float, precision,
):
    j = pl.program_id(1)
    s = pl.program_id(2)
    m_rows = tq * group
    head_dim = k_ref.shape[-1]
    n_keys = ppi * block_size

    row = tile_row_ref[j]
    q0 = tile_start_ref[j]
    qn = tile_len_ref[j]
    ctx = ctx_ref[row]

    rows_sl = pl.ds(q0 * group, m_rows)
    row_pos = pos_ref[rows_sl]  # [M]
    row_valid = (lax.broadcasted_iota(jnp.int32, (m_rows,), 0) // group) < qn
    last_pos = jnp.max(jnp.where(row_valid, row_pos, -1))
    kv_end = jnp.minimum(ctx, last_pos + 1)  # keys this tile needs (0 for an empty tile)
    n_iters = pl.cdiv(jnp.maximum(kv_end, 0), n_keys)
    per_split = pl.cdiv(n_iters, num_splits)
    it0 = s * per_split
    it1 = jnp.minimum(it0 + per_split, n_iters)

    q = q_ref[rows_sl, :]  # [M, D]
    limit = jnp.minimum(row_pos, ctx - 1)[:, None]  # [M, 1] last visible key position

    acc, m_i, l_i = _attend_pages(q, k_ref, v_ref, bt_ref, row, it0, it1, ppi, block_size, limit, scale_log2, precision)

    mask2d = jnp.broadcast_to(row_valid[:, None], (m_rows, head_dim))
    if num_splits == 1:
        (o_ref,) = out_refs
        out = acc / jnp.where(l_i > 0, l_i, 1.0)[:, None]
        plgpu.store(o_ref.at[rows_sl, :], out.astype(o_ref.dtype), mask=mask2d)
    else:
        o_ref, m_ref, l_ref = out_refs
        plgpu.store(o_ref.at[rows_sl, :], acc, mask=mask2d)
        plgpu.store(m_ref.at[rows_sl], m_i, mask=row_valid)
        plgpu.store(l_ref.at[rows_sl], l_i, mask=row_valid)


def _key_rows(pages):
    """[num_blocks, block_size, Hkv, D] -> [num_blocks * block_size, Hkv, D]: a free reshape."""
    n, bs, hkv, d = pages.shape
    return pages.reshape(n * bs, hkv, d)


def _tile_map(row_starts, row_lens, tq: int, num_tiles: int):
    """Dense list of (row, first token, tokens) query tiles; unused tiles have 0 tokens."""
    B = row_lens.shape[0]
    lens = jnp.maximum(row_lens, 0)
    per_row = (lens + tq - 1) // tq
    cum = jnp.cumsum(per_row)  # inclusive
    j = jnp.arange(num_tiles, dtype=jnp.int32)
    row = jnp.sum((cum[None, :] <= j[:, None]).astype(jnp.int32), axis=1)  # first row with cum > j
    in_range = row < B
    row = jnp.minimum(row, B - 1)
    i = j - (cum[row] - per_row[row])
    start = row_starts[row] + i * tq
    n = jnp.clip(lens[row] - i * tq, 0, tq)
    n = jnp.where(in_range, n, 0)
    start = jnp.where(n > 0, start, 0)
    return row.astype(jnp.int32), start.astype(jnp.int32), n.astype(jnp.int32)


def ragged_paged_attention(
    q, k_pages, v_pages, positions, block_tables, context_lens, row_starts, row_lens, *,
    scale: float, config=None, interpret: bool = False, max_row_len: int | None = None, token_rows=None,
):
    """q [T, Hq, D]; pages [num_blocks, block_size, Hkv, D] -> [T, Hq, D] in q.dtype.

    Tokens outside every row's range get zeros. `max_row_len` (static, optional): a bound on
    row_lens (the length of AttentionMetadata.query_bound); it shrinks the tile map, and with
    max_row_len == 1 and `token_rows` (i32[T], the row of each token) given, the step runs the
    dedicated decode kernel (`paged_decode_attention`; `config` then means its config too).
    """
    T, hq, d = q.shape
    num_blocks, block_size, hkv, _ = k_pages.shape
    group = hq // hkv
    B, max_blocks = block_tables.shape
    if max_row_len == 1 and token_rows is not None and supported(q.shape, k_pages.shape):
        return paged_decode_attention(
            q, k_pages, v_pages, positions, token_rows, block_tables, context_lens, row_starts, row_lens,
            scale=scale, config=config, interpret=interpret,
        )
    tq, ppi, num_splits, warps, stages = config or choose_config(
        T, hkv, group, block_size, max_row_len, d, k_pages.dtype.itemsize)
    num_tiles = max(1, min(T, B + -(-T // tq)))
    if max_row_len is not None:  # each row has at most ceil(L / tq) tiles
        num_tiles = max(1, min(num_tiles, B * -(-int(max_row_len) // tq)))
    m_pad = -(-max_blocks // ppi) * ppi
    t_pad = T + tq

    # [T, Hq, D] -> [Hkv, (T+TQ)*G, D]: a tile of TQ tokens x G heads is one contiguous block.
    qh = q.reshape(T, hkv, group, d).transpose(1, 0, 2, 3)
    qh = jnp.pad(qh, ((0, 0), (0, tq), (0, 0), (0, 0))).reshape(hkv, t_pad * group, d)
    pos = jnp.repeat(jnp.pad(positions.astype(jnp.int32), (0, tq)), group)
    bt = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, m_pad - max_blocks)))
    tile_row, tile_start, tile_len = _tile_map(row_starts.astype(jnp.int32), row_lens.astype(jnp.int32), tq, num_tiles)

    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    kernel = functools.partial(
        _kernel, tq=tq, group=group, ppi=ppi, block_size=block_size, num_splits=num_splits,
        scale_log2=float(scale) * _LOG2E, precision=precision,
    )
    full1 = lambda n: pl.BlockSpec((n,), lambda h, j, s: (0,))  # noqa: E731
    kv_spec = pl.BlockSpec((num_blocks * block_size, None, d), lambda h, j, s: (0, h, 0))  # one head's key rows
    in_specs = [
        full1(num_tiles), full1(num_tiles), full1(num_tiles), full1(B),
        pl.BlockSpec((B, m_pad), lambda h, j, s: (0, 0)),
        full1(t_pad * group),
        pl.BlockSpec((None, t_pad * group, d), lambda h, j, s: (h, 0, 0)),
        kv_spec,
        kv_spec,
    ]
    rows = t_pad * group
    if num_splits == 1:
        out_shape = [jax.ShapeDtypeStruct((hkv, rows, d), q.dtype)]
        out_specs = [pl.BlockSpec((None, rows, d), lambda h, j, s: (h, 0, 0))]
    else:
        out_shape = [
            jax.ShapeDtypeStruct((num_splits, hkv, rows, d), jnp.float32),
            jax.ShapeDtypeStruct((num_splits, hkv, rows), jnp.float32),
            jax.ShapeDtypeStruct((num_splits, hkv, rows), jnp.float32),
        ]
        out_specs = [
            pl.BlockSpec((None, None, rows, d), lambda h, j, s: (s, h, 0, 0)),
            pl.BlockSpec((None, None, rows), lambda h, j, s: (s, h, 0)),
            pl.BlockSpec((None, None, rows), lambda h, j, s: (s, h, 0)),
        ]
    outs = pl.pallas_call(
        kernel,
        grid=(hkv, num_tiles, num_splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
        name=f"jtp_ragged_paged_attention_tq{tq}_g{group}_p{ppi}_s{num_splits}",
    )(tile_row, tile_start, tile_len, context_lens.astype(jnp.int32), bt, pos, qh, _key_rows(k_pages), _key_rows(v_pages))

    if num_splits == 1:
        o = outs[0]
    else:
        o_p, m_p, l_p = outs
        m = jnp.max(m_p, axis=0)
        w = jnp.exp2(m_p - m[None])  # [S, Hkv, rows]
        l = jnp.sum(l_p * w, axis=0)
        o = jnp.sum(o_p * w[..., None], axis=0) / jnp.where(l > 0, l, 1.0)[..., None]
    o = o.reshape(hkv, t_pad, group, d)[:, :T].transpose(1, 0, 2, 3).reshape(T, hq, d)

    # Tokens outside every row were never written (or hold stale partials): make them zero.
    tok = jnp.arange(T, dtype=jnp.int32)
    owner_start = row_starts[None, :]
    owner_end = (row_starts + jnp.maximum(row_lens, 0))[None, :]
    valid = jnp.any((tok[:, None] >= owner_start) & (tok[:, None] < owner_end), axis=1)
    return jnp.where(valid[:, None, None], o, 0).astype(q.dtype)


# ----------------------------------------------------------------------------- decode path
#
# A pure decode step (AttentionMetadata.query_bound of length 1) needs none of the tiling above:
# every real token is alone in its row. The grid runs over (token, kv head, split) of the flat
# [T, Hq, D] q: a program takes the G query heads of kv head h of token t as a window of
# M = max(16, G) consecutive rows of q viewed as [T*Hq, D] (16 = the smallest MMA; the window is
# shifted left at the end of the array, the G real rows are a mask; a step too small for one window,
# such as a lone request's 1 token with Hq < 16, is padded with tokens of no row), streams the row's pages and
# writes its G output rows in place. Tokens that belong to no row (padding) get an empty key range
# and so write zeros. The only XLA ops around the kernel are the free [T, Hq, D] <-> [T*Hq, D]
# reshapes. With splits (few rows: not enough programs to pull HBM bandwidth) each program writes
# fp32 partials (o, m, l) only for a non-empty key range, and `_decode_merge_kernel`, one program
# per (token, kv head), combines the splits that ran and writes [T, Hq, D] in q.dtype.


def _decode_rows(group: int) -> int:
    return max(16, group)


def choose_decode_config(T: int, B: int, num_kv_heads: int, group: int, block_size: int, max_blocks: int,
                         head_dim: int = 128, itemsize: int = 2, q_itemsize: int = 2):
    """(unused, pages per iteration, splits, warps, stages) of the decode kernel; env vars override.

    Keys per iteration: 64; 128 from float8 pages under a 16-bit q, the same bytes a load (Qwen3-8B
    B=64 decode with float8 pages: 8,106 against 7,258 tok/s at 64 keys, docs/bench/h200-speed11.md;
    a float32 q's converted tiles would be four times the loaded ones). Splits: at most min(T, B)
    tokens are real; aim at ~512 programs (H200: 132 SMs) and at most 16
    splits (32 made a lone token's call slower: the merge grows; 16 beat 8 by 6% at Qwen3-0.6B B=1,
    docs/bench/h200-speed6.md). Only splits that get keys write
    partials, so an over-estimate costs little. Split programs pipeline 3 stages, unsplit ones (large
    batches) 2 (docs/bench/h200-speed4.md).
    """
    keys = int(os.environ.get("JTP_ATTN_DECODE_KEYS", "128" if itemsize == 1 and q_itemsize == 2 else "64"))
    ppi = max(1, _pow2_floor(max(keys // block_size, 1)))
    ppi = math.gcd(ppi, max(1, max_blocks))  # tile the (unpadded) block table exactly
    env_splits = os.environ.get("JTP_ATTN_DECODE_SPLITS")
    if env_splits:
        splits = int(env_splits)
    else:
        splits = min(16, _pow2_floor(max(1, 512 // max(1, min(T, B) * num_kv_heads))))
    warps = int(os.environ.get("JTP_ATTN_WARPS", "4"))
    stages = int(os.environ.get("JTP_ATTN_STAGES", "3" if splits > 1 else "2"))
    ppi, stages = fit_shared_memory(_decode_rows(group), ppi, stages, block_size, head_dim, itemsize)
    return 1, ppi, splits, warps, stages


def _decode_key_range(t, tok_row_ref, pos_ref, starts_ref, lens_ref, ctx_ref, n_keys: int, num_splits: int):
    """(row, position, ctx, iterations, iterations per split) of token t; 0 iterations if padding."""
    row = tok_row_ref[t]
    valid = (lens_ref[row] > 0) & (starts_ref[row] == t)  # rows hold <= 1 token here
    pos = pos_ref[t]
    ctx = ctx_ref[row]
    kv_end = jnp.where(valid, jnp.minimum(ctx, pos + 1), 0)
    n_iters = pl.cdiv(jnp.maximum(kv_end, 0), n_keys)
    per_split = pl.cdiv(n_iters, num_splits)
    return row, pos, ctx, n_iters, per_split


def _decode_kernel(
    tok_row_ref, pos_ref, starts_ref, lens_ref,  # [T], [T], [B], [B]
    ctx_ref,  # [B]
    bt_ref,  # [B, max_blocks]
    q_ref,  # [T*Hq, D]
    k_ref, v_ref,  # [num_blocks * block_size, D] this kv head's key rows
    *out_refs,
    group: int, hq: int, m_rows: int, ppi: int, block_size: int, num_splits: int, scale_log2: float, precision,
):
    t = pl.program_id(0)
    h = pl.program_id(1)
    s = pl.program_id(2)
    head_dim = k_ref.shape[-1]
    n_keys = ppi * block_size
    total_rows = q_ref.shape[0]

    row, pos, ctx, n_iters, per_split = _decode_key_range(
        t, tok_row_ref, pos_ref, starts_ref, lens_ref, ctx_ref, n_keys, num_splits
    )
    it0 = s * per_split
    it1 = jnp.minimum(it0 + per_split, n_iters)

    first = t * hq + h * group  # this program's G rows of the [T*Hq, D] view
    start = jnp.minimum(first, total_rows - m_rows)
    off = first - start
    ri = lax.broadcasted_iota(jnp.int32, (m_rows,), 0)
    row_mask = (ri >= off) & (ri < off + group)
    rows_sl = pl.ds(start, m_rows)

    q = q_ref[rows_sl, :]  # [M, D]
    limit = jnp.minimum(pos, ctx - 1)  # last visible key (same for all M rows)

    acc, m_i, l_i = _attend_pages(q, k_ref, v_ref, bt_ref, row, it0, it1, ppi, block_size, limit, scale_log2, precision)
    mask2d = jnp.broadcast_to(row_mask[:, None], (m_rows, head_dim))
    if num_splits == 1:  # normalise and write q.dtype (zeros for padding tokens: acc = 0, l = 0)
        (o_ref,) = out_refs
        out = acc / jnp.where(l_i > 0, l_i, 1.0)[:, None]
        plgpu.store(o_ref.at[rows_sl, :], out.astype(o_ref.dtype), mask=mask2d)
    else:  # partials, only where this split had keys; the merge reads only those

        @pl.when(it1 > it0)
        def _():
            o_ref, m_ref, l_ref = out_refs
            plgpu.store(o_ref.at[rows_sl, :], acc, mask=mask2d)
            plgpu.store(m_ref.at[rows_sl], m_i, mask=row_mask)
            plgpu.store(l_ref.at[rows_sl], l_i, mask=row_mask)


def _decode_merge_kernel(
    tok_row_ref, pos_ref, starts_ref, lens_ref, ctx_ref,
    o_p_ref,  # [S, G, D] block of [S, T, Hq, D]
    m_p_ref, l_p_ref,  # [S, G] blocks of [S, T, Hq]
    o_ref,  # [G, D] block of [T, Hq, D]
    *, n_keys: int, num_splits: int,
):
    t = pl.program_id(0)
    _, _, _, n_iters, per_split = _decode_key_range(
        t, tok_row_ref, pos_ref, starts_ref, lens_ref, ctx_ref, n_keys, num_splits
    )
    n_used = pl.cdiv(n_iters, jnp.maximum(per_split, 1))  # splits that wrote partials (0: padding)
    group, head_dim = o_ref.shape
    used = lax.broadcasted_iota(jnp.int32, (num_splits, group), 0) < n_used  # [S, G]
    used3 = jnp.broadcast_to(used[:, :, None], (num_splits, group, head_dim))
    m_p = plgpu.load(m_p_ref, mask=used, other=_MASKED)
    l_p = plgpu.load(l_p_ref, mask=used, other=0.0)
    o_p = plgpu.load(o_p_ref, mask=used3, other=0.0)
    m_p = jnp.where(used, m_p, _MASKED)  # unwritten partials may hold anything, even NaN
    m = jnp.max(m_p, axis=0)  # [G]
    w = jnp.where(used, jnp.exp2(m_p - m[None, :]), 0.0)  # [S, G]
    l = jnp.sum(jnp.where(used, l_p, 0.0) * w, axis=0)
    o = jnp.sum(jnp.where(used3, o_p, 0.0) * w[:, :, None], axis=0)
    o_ref[...] = (o / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)


def paged_decode_attention(
    q, k_pages, v_pages, positions, token_rows, block_tables, context_lens, row_starts, row_lens, *,
    scale: float, config=None, interpret: bool = False,
):
    """`ragged_paged_attention` for a step whose rows hold at most one token each (pure decode).

    q [T, Hq, D]; pages [num_blocks, block_size, Hkv, D] -> [T, Hq, D] in q.dtype; a token that is
    not its row's (row_starts, row_lens) token gets zeros. config = (ignored, pages per iteration,
    splits, warps, stages), default `choose_decode_config`.
    """
    T, hq, d = q.shape
    num_blocks, block_size, hkv, _ = k_pages.shape
    group = hq // hkv
    B, max_blocks = block_tables.shape
    _, ppi, num_splits, warps, stages = config or choose_decode_config(
        T, B, hkv, group, block_size, max_blocks, d, k_pages.dtype.itemsize, q.dtype.itemsize)
    ppi = math.gcd(int(ppi), max_blocks)  # pl.ds over the block table must stay in bounds
    num_splits = _pow2_floor(num_splits)  # the merge's [S, G, D] block: Triton shapes are powers of 2
    m_rows = _decode_rows(group)
    real_tokens = T
    if T * hq < m_rows:  # the q window needs M rows of [T*Hq, D]: pad tokens (they belong to no row: zeros)
        extra = -(-m_rows // hq) - T
        q, positions, token_rows = (jnp.pad(a, ((0, extra),) + ((0, 0),) * (a.ndim - 1)) for a in (q, positions, token_rows))
        T += extra
    n_keys = ppi * block_size
    i32 = lambda x: x if x.dtype == jnp.int32 else x.astype(jnp.int32)  # noqa: E731
    meta = (i32(token_rows), i32(positions), i32(row_starts), i32(row_lens), i32(context_lens))

    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    kernel = functools.partial(
        _decode_kernel, group=group, hq=hq, m_rows=m_rows, ppi=ppi, block_size=block_size, num_splits=num_splits,
        scale_log2=float(scale) * _LOG2E, precision=precision,
    )
    full1 = lambda n: pl.BlockSpec((n,), lambda t, h, s: (0,))  # noqa: E731
    rows = T * hq
    kv_spec = pl.BlockSpec((num_blocks * block_size, None, d), lambda t, h, s: (0, h, 0))  # one head's key rows
    in_specs = [
        full1(T), full1(T), full1(B), full1(B), full1(B),
        pl.BlockSpec((B, max_blocks), lambda t, h, s: (0, 0)),
        pl.BlockSpec((rows, d), lambda t, h, s: (0, 0)),
        kv_spec,
        kv_spec,
    ]
    if num_splits == 1:
        out_shape = [jax.ShapeDtypeStruct((rows, d), q.dtype)]
        out_specs = [pl.BlockSpec((rows, d), lambda t, h, s: (0, 0))]
    else:
        out_shape = [
            jax.ShapeDtypeStruct((num_splits, rows, d), jnp.float32),
            jax.ShapeDtypeStruct((num_splits, rows), jnp.float32),
            jax.ShapeDtypeStruct((num_splits, rows), jnp.float32),
        ]
        out_specs = [
            pl.BlockSpec((None, rows, d), lambda t, h, s: (s, 0, 0)),
            pl.BlockSpec((None, rows), lambda t, h, s: (s, 0)),
            pl.BlockSpec((None, rows), lambda t, h, s: (s, 0)),
        ]
    outs = pl.pallas_call(
        kernel,
        grid=(T, hkv, num_splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
        name=f"jtp_paged_decode_attention_g{group}_p{ppi}_s{num_splits}",
    )(*meta, block_tables if block_tables.dtype == jnp.int32 else block_tables.astype(jnp.int32),
      q.reshape(rows, d), _key_rows(k_pages), _key_rows(v_pages))
    if num_splits == 1:
        return outs[0].reshape(T, hq, d)[:real_tokens]

    o_p, m_p, l_p = outs
    full1m = lambda n: pl.BlockSpec((n,), lambda t, h: (0,))  # noqa: E731
    merge = functools.partial(_decode_merge_kernel, n_keys=n_keys, num_splits=num_splits)
    out = pl.pallas_call(
        merge,
        grid=(T, hkv),
        in_specs=[
            full1m(T), full1m(T), full1m(B), full1m(B), full1m(B),
            pl.BlockSpec((num_splits, None, group, d), lambda t, h: (0, t, h, 0)),
            pl.BlockSpec((num_splits, None, group), lambda t, h: (0, t, h)),
            pl.BlockSpec((num_splits, None, group), lambda t, h: (0, t, h)),
        ],
        out_specs=pl.BlockSpec((None, group, d), lambda t, h: (t, h, 0)),
        out_shape=jax.ShapeDtypeStruct((T, hq, d), q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=1 if group * d <= 512 else 2, num_stages=1),
        interpret=interpret,
        name=f"jtp_paged_decode_merge_g{group}_s{num_splits}",
    )(*meta, o_p.reshape(num_splits, T, hq, d), m_p.reshape(num_splits, T, hq), l_p.reshape(num_splits, T, hq))
    return out[:real_tokens]
