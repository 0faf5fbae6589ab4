"""Grouped matmul over expert groups as one Pallas (Triton backend) GPU kernel: the MoE GEMMs.

    y[p] = x[p] @ w[e]   for the rows p of group e, where the rows are sorted by group

Same function as `jax.lax.ragged_dot(x, w, group_sizes)` restricted to the groups
[first_group, first_group + E_local) whose rows start at `row_offset` (expert parallelism: a
device owns a contiguous range of experts, and sorted pairs put their rows in one contiguous run).

Work decomposition
------------------
* Each group's rows are cut into tiles of BM rows, and the tiles of all groups are listed densely
  (`tile_map`, plain jnp before the kernel): at most ceil(P / BM) + min(E, P) tiles.
* Program (tile, n block, k split) multiplies its tile's rows by the [K / splits, BN] slice of its
  group's weight. A program past the last used tile returns at once and reads nothing, so a decode
  step reads the weights of the experts its tokens chose and no others (B=1, top-8 of 128: 1/16 of
  the experts' bytes); a big batch reads every used expert once per tile of its rows.
* Few tiles (decode) leave SMs idle, so K is split over `splits` programs writing fp32 partials
  that jnp sums afterwards; with one split the kernel writes x.dtype directly.
* Rows past a tile's group (the next group's, or padding) are loaded but never stored.
* gate and up run as one pass (w = (gate, up)): x is read once and the SwiGLU activation is the
  epilogue, so an MoE layer is two kernels, sharing one tile map.
* FP8 experts (`scales`: float8_e4m3fn w with one f32 scale per block, Qwen's 128 x 128) are read as
  float8 and dequantized in registers, as jtp/kernels/fp8_matmul.py does: BK and BN divide the block,
  so each [BK, BN] tile lies in one block; the tile is converted to x's dtype (exact), multiplied in
  fp32 and the partial product scaled by its block's scale. A decode step reads the chosen experts'
  float8 bytes, half of bf16's, and no dequantized copy of the stack is made.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


@dataclasses.dataclass(frozen=True)
class GroupedMatmulConfig:
    bm: int  # rows per tile
    bn: int  # output columns per program
    bk: int  # contraction step
    splits: int  # programs sharing one tile's contraction (fp32 partials, summed after)
    warps: int = 4
    stages: int = 3


def _largest_pow2_divisor(n: int, cap: int) -> int:
    d = 1
    while d * 2 <= cap and n % (d * 2) == 0:
        d *= 2
    return d


def supported(k: int, n: int, block: tuple[int, int] | None = None) -> bool:
    """Triton tiles are powers of two of at least 16: K and N need such a divisor, and so do the
    (K, N) dims of an FP8 weight's scale `block` (a tile lies in one block), which tile K and N."""
    if block is not None and (k % block[0] or n % block[1]):
        return False
    return all(_largest_pow2_divisor(d, 64) >= 16 for d in (block or (k, n)))  # a block's divisor divides K, N


def tile_rows(rows: int, num_groups: int) -> int:
    """Rows per tile: the 16-row minimum of an MMA when groups are small (decode), 128 for prefill."""
    rows_per_group = rows / max(1, min(num_groups, rows))
    return int(os.environ.get("JTP_MOE_BM", 128 if rows_per_group >= 96 else 64 if rows_per_group >= 48 else 16))


def choose_config(rows: int, k: int, n: int, num_groups: int, num_weights: int = 1,
                  block: tuple[int, int] | None = None) -> GroupedMatmulConfig:
    """Static tile sizes for P = `rows` sorted rows of a [K] -> [N] projection; JTP_MOE_* override.

    Small groups (decode) use 16-row tiles, BN 64 and split K until about two programs per SM of an
    H200 are in flight even when only one token's experts are used; big groups (prefill) use
    128x128 tiles (the best of a sweep on an H200: docs/bench/h200-moe.md). `block`: an FP8 weight's
    (K, N) scale block, which BK and BN then divide.
    """
    env = lambda name, default: int(os.environ.get(f"JTP_MOE_{name}", default))  # noqa: E731
    bm = tile_rows(rows, num_groups)
    big = bm >= 64
    # Two accumulators (gate and up) in 128x128 tiles would spill registers: halve BN for them.
    bn = min(env("BN", (128 if num_weights == 1 else 64) if big else 64), _largest_pow2_divisor(n, 256))
    bk = min(env("BK", 64 if big else 128), _largest_pow2_divisor(k, 256))
    if block is not None:  # one scale per tile
        bk, bn = min(bk, _largest_pow2_divisor(block[0], 256)), min(bn, _largest_pow2_divisor(block[1], 256))
    # The used tiles are known only on the device; size the split for the fewest a step of this
    # shape may use when groups are small (one token's top-k: rows / 8 groups), so a B=1 decode
    # step still fills the SMs. Splitting a big batch further costs only a small fp32 partial sum.
    programs = (num_tiles(rows, num_groups, bm) if big else max(1, min(num_groups, rows // 8))) * (n // bn)
    splits = 1
    while programs * splits < 264 and k % (bk * splits * 2) == 0 and splits < 8:
        splits *= 2
    splits = env("SPLITS", splits)
    return GroupedMatmulConfig(bm, bn, bk, splits, env("WARPS", 4), env("STAGES", 3))


def num_tiles(rows: int, num_groups: int, bm: int) -> int:
    return max(1, min(num_groups, rows) + -(-rows // bm))


def _cumsum(v: jax.Array) -> jax.Array:
    """Inclusive cumsum of a short vector (one entry per expert) as one compare-and-sum fusion: XLA's
    GPU cumsum (a reduce_window) is slow for this, on every decode step's MoE layer (docs/bench/h200-moe.md)."""
    i = jnp.arange(v.shape[0])
    return jnp.sum(jnp.where(i[None, :] <= i[:, None], v[None, :], 0), axis=1)


def tile_map(group_sizes: jax.Array, row_offset, bm: int, count: int):
    """Dense list of (group, first row, rows) tiles over the groups; unused tiles have 0 rows."""
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    starts = row_offset + _cumsum(sizes) - sizes
    per_group = (sizes + bm - 1) // bm
    cum = _cumsum(per_group)  # inclusive
    t = jnp.arange(count, dtype=jnp.int32)
    group = jnp.sum((cum[None, :] <= t[:, None]).astype(jnp.int32), axis=1)  # first group with cum > t
    used = group < sizes.shape[0]
    group = jnp.minimum(group, sizes.shape[0] - 1)
    i = t - (cum[group] - per_group[group])
    start = starts[group] + i * bm
    n = jnp.where(used, jnp.clip(sizes[group] - i * bm, 0, bm), 0)
    return group.astype(jnp.int32), jnp.where(n > 0, start, 0).astype(jnp.int32), n.astype(jnp.int32)


def _kernel(tile_group_ref, tile_start_ref, tile_rows_ref, x_ref, *refs, bm, bk, k_steps, precision, gated,
            steps_per_block):
    """One (tile, n block, k split): acc = x[tile rows] @ w[group][k range, n block]; with two weights
    (gate, up) and one split, writes silu(x @ gate) * (x @ up). FP8 weights (steps_per_block: K steps
    per scale block; 0 for plain weights) come with their scale refs, [E, K blocks] of this n block."""
    count = 1 + gated
    w_refs, s_refs = refs[:count], refs[count : 2 * count] if steps_per_block else (None,) * count
    out_refs = refs[(2 if steps_per_block else 1) * count :]
    t, s = pl.program_id(0), pl.program_id(2)
    group, start, rows = tile_group_ref[t], tile_start_ref[t], tile_rows_ref[t]
    dot = functools.partial(lax.dot_general, dimension_numbers=(((1,), (0,)), ((), ())),
                            preferred_element_type=jnp.float32, precision=precision)

    @pl.when(rows > 0)  # an unused tile reads no weights
    def _():
        def body(i, accs):
            step = s * k_steps + i
            k0 = pl.multiple_of(step * bk, bk)
            x = x_ref[pl.ds(start, bm), pl.ds(k0, bk)]  # [BM, BK]
            if not steps_per_block:
                return tuple(acc + dot(x, w_ref[group, pl.ds(k0, bk), :]) for acc, w_ref in zip(accs, w_refs))
            # float8 [BK, BN] -> x's dtype is exact; the tile lies in one block: one scale for its product.
            kb = step // steps_per_block if steps_per_block > 1 else step
            return tuple(
                acc + dot(x, w_ref[group, pl.ds(k0, bk), :].astype(x.dtype)) * s_ref[group, kb]
                for acc, w_ref, s_ref in zip(accs, w_refs, s_refs)
            )

        zeros = jnp.zeros((bm, w_refs[0].shape[2]), jnp.float32)
        accs = lax.fori_loop(0, k_steps, body, (zeros,) * len(w_refs))
        if len(out_refs) < len(accs):  # gated, one split: the SwiGLU activation in the epilogue
            accs = (jax.nn.silu(accs[0]) * accs[1],)
        mask = jnp.broadcast_to((lax.broadcasted_iota(jnp.int32, (bm,), 0) < rows)[:, None], zeros.shape)
        for acc, o_ref in zip(accs, out_refs):
            plgpu.store(o_ref.at[pl.ds(start, bm), :], acc.astype(o_ref.dtype), mask=mask)


def grouped_matmul(
    x: jax.Array,
    w: jax.Array | tuple[jax.Array, jax.Array],
    group_sizes: jax.Array,
    row_offset: jax.Array | int = 0,
    *,
    num_rows: int | None = None,
    tiles=None,
    config: GroupedMatmulConfig | None = None,
    scales: jax.Array | tuple[jax.Array, jax.Array] | None = None,
    interpret: bool = False,
) -> jax.Array:
    """x [P', K] (rows sorted by group), w [E, K, N], group_sizes [E] -> [P', N] in x.dtype.

    w = (gate, up): one pass computes silu(x @ gate) * (x @ up), reading x once.
    Group e's rows are row_offset + sum(group_sizes[:e]) onwards, all below `num_rows` (default P').
    A tile loads BM rows from its first row, so x needs BM rows past num_rows: they are added here
    unless x already has them (the caller can gather them for free; their values are never used).
    Rows outside every group are left unwritten (unspecified): the caller masks or ignores them.
    `tiles`: `tile_map`'s output for these groups at this config's BM, when the caller shares it.
    `scales`: for float8 w, its f32 block scales [E, K / block_k, N / block_n] (one per weight of w,
    each for its weight's blocks): w x scale, block by block, is the weight multiplied.
    """
    weights = w if isinstance(w, tuple) else (w,)
    gated = len(weights) == 2
    P = num_rows if num_rows is not None else x.shape[0]
    K = x.shape[1]
    E, _, N = weights[0].shape
    scale_refs = () if scales is None else tuple(a.astype(jnp.float32) for a in (
        scales if isinstance(scales, tuple) else (scales,)))
    block = None
    if scale_refs:
        assert len(scale_refs) == len(weights) and len({a.shape for a in scale_refs}) == 1, "a scale per weight"
        block = (K // scale_refs[0].shape[1], N // scale_refs[0].shape[2])
    cfg = config or choose_config(P, K, N, E, len(weights), block)
    k_steps = K // (cfg.bk * cfg.splits)
    assert k_steps * cfg.bk * cfg.splits == K and N % cfg.bn == 0, (K, N, cfg)
    assert block is None or (block[0] % cfg.bk == 0 and block[1] % cfg.bn == 0), ("a tile spans blocks", block, cfg)
    if tiles is None:
        tiles = tile_map(group_sizes, jnp.asarray(row_offset, jnp.int32), cfg.bm, num_tiles(P, E, cfg.bm))
    count = tiles[0].shape[0]
    given_rows = x.shape[0]
    if given_rows < P + cfg.bm:
        x = jnp.pad(x, ((0, P + cfg.bm - x.shape[0]), (0, 0)))
    rows = x.shape[0]

    precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    kernel = functools.partial(
        _kernel, bm=cfg.bm, bk=cfg.bk, k_steps=k_steps, precision=precision, gated=gated,
        steps_per_block=block[0] // cfg.bk if block else 0,
    )
    vec = pl.BlockSpec((count,), lambda t, n, s: (0,))
    w_spec = pl.BlockSpec((E, K, cfg.bn), lambda t, n, s: (0, 0, n))
    in_specs = [vec, vec, vec, pl.BlockSpec((rows, K), lambda t, n, s: (0, 0))] + [w_spec] * len(weights)
    if block:  # each n block's column of scales: the block holding its BN columns
        s_spec = pl.BlockSpec((E, K // block[0], None), lambda t, n, s: (0, 0, n * cfg.bn // block[1]))
        in_specs += [s_spec] * len(weights)
    if cfg.splits == 1:
        out_shape = [jax.ShapeDtypeStruct((rows, N), x.dtype)]
        out_specs = [pl.BlockSpec((rows, cfg.bn), lambda t, n, s: (0, n))]
    else:  # fp32 partials, per weight
        out_shape = [jax.ShapeDtypeStruct((cfg.splits, rows, N), jnp.float32)] * len(weights)
        out_specs = [pl.BlockSpec((None, rows, cfg.bn), lambda t, n, s: (s, 0, n))] * len(weights)
    outs = pl.pallas_call(
        kernel,
        grid=(count, N // cfg.bn, cfg.splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.warps, num_stages=cfg.stages),
        interpret=interpret,
        name=f"jtp_grouped_matmul{'_swiglu' if gated else ''}{'_fp8' if block else ''}"
             f"_m{cfg.bm}_n{cfg.bn}_k{cfg.bk}_s{cfg.splits}",
    )(*tiles, x, *weights, *scale_refs)
    if cfg.splits == 1:
        out = outs[0]
    else:
        sums = [o.sum(axis=0) for o in outs]
        out = (jax.nn.silu(sums[0]) * sums[1] if gated else sums[0]).astype(x.dtype)
    return out[:given_rows]
