"""The Pallas ragged paged-attention kernel (interpret mode on CPU) against the jnp reference.

Every run draws fresh random inputs (the seed is printed on failure): the kernel must compute the
same function on any valid ragged batch, not on one lucky draw.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cpu_env import cuda_lowering, jit_optimized

from jtp.kernels.ragged_paged_attention import _operand_dtype, choose_decode_config, ragged_paged_attention
from jtp.models.attention import (
    AttentionMetadata,
    LayerKV,
    PagedAttention,
    choose_attention,
    paged_attention_reference,
    write_kv,
)

_ENTROPY = np.random.SeedSequence().entropy  # fresh each run; shown in failure messages
KERNEL = PagedAttention("kernel")  # unsharded; Pallas' interpreter off-GPU


def _rng(case: int) -> tuple[np.random.Generator, str]:
    seq = np.random.SeedSequence(_ENTROPY, spawn_key=(case,))
    return np.random.default_rng(seq), f"entropy={_ENTROPY} case={case}"


def make_batch(rng, rows, T, B, hkv, group, D, dtype, block_size=16, num_blocks=48, max_blocks=8, bound=None,
               page_dtype=None):
    """rows: list of (query tokens, context after this step); the rest of B are padding rows.
    page_dtype: the pages' dtype when not q's (float8 e4m3: `--kv-cache-dtype fp8`).

    Pages are scattered over the pool; K/V of this step are written through write_kv like the
    model does; tokens past the rows (T - sum) are padding (slot -1). bound: the static bound L on
    tokens per row (metadata.query_bound = arange(L), like the runner; 1 = pure decode), or None.
    """
    positions = np.zeros(T, np.int32)
    token_rows = np.zeros(T, np.int32)
    slots = np.full(T, -1, np.int32)
    tables = np.zeros((B, max_blocks), np.int32)
    ctx = np.zeros(B, np.int32)
    starts = np.zeros(B, np.int32)
    lens = np.zeros(B, np.int32)
    perm = rng.permutation(num_blocks)
    used = cursor = 0
    for b, (n, c) in enumerate(rows):
        pages = -(-c // block_size)
        assert pages <= max_blocks and used + pages <= num_blocks and cursor + n <= T
        tables[b, :pages] = perm[used : used + pages]
        used += pages
        pos = np.arange(c - n, c)
        positions[cursor : cursor + n] = pos
        token_rows[cursor : cursor + n] = b
        slots[cursor : cursor + n] = tables[b, pos // block_size] * block_size + pos % block_size
        ctx[b], starts[b], lens[b] = c, cursor, n
        cursor += n
    starts[len(rows) :] = cursor  # like the scheduler: padding rows start at the end
    hq = hkv * group
    q = jnp.asarray(rng.standard_normal((T, hq, D)), dtype)
    shape = (num_blocks, block_size, hkv, D)
    page_dtype = page_dtype or dtype
    cache = LayerKV(*(jnp.asarray(rng.standard_normal(shape), dtype).astype(page_dtype) for _ in range(2)))
    k_new = jnp.asarray(rng.standard_normal((T, hkv, D)), dtype)
    v_new = jnp.asarray(rng.standard_normal((T, hkv, D)), dtype)
    meta = AttentionMetadata(
        jnp.asarray(positions), jnp.asarray(slots), jnp.asarray(token_rows), jnp.asarray(tables),
        jnp.asarray(ctx), jnp.asarray(starts), jnp.asarray(lens), jnp.full(B, -1, jnp.int32), jnp.full(B, -1, jnp.int32),
        None if bound is None else jnp.arange(bound, dtype=jnp.int32),
    )
    assert bound is None or all(n <= bound for n, _ in rows)
    cache = write_kv(cache, k_new, v_new, meta.slot_mapping)
    return q, cache, meta, cursor


def _check(out, ref, n_real, dtype, tag):
    out = np.asarray(out.astype(jnp.float32))
    ref = np.asarray(ref.astype(jnp.float32))
    assert np.isfinite(out).all(), f"non-finite output ({tag})"
    assert np.isfinite(ref).all(), f"non-finite reference ({tag})"
    err = np.linalg.norm(out[:n_real] - ref[:n_real]) / np.linalg.norm(ref[:n_real])
    tol = 1e-2 if dtype == jnp.bfloat16 else 1e-5
    assert err < tol, f"relative error {err:.3g} >= {tol} ({tag})"
    return err


def _random_rows(rng, B, T, max_ctx):
    """A ragged mix: decode rows (1 token), prefill chunks (first or later), a padding row or two."""
    rows, tokens = [], 0
    for _ in range(B - 2):
        kind = rng.integers(3)
        if kind == 0:  # decode
            n, c = 1, int(rng.integers(1, max_ctx + 1))
        elif kind == 1:  # first prefill chunk
            n = int(rng.integers(2, 24))
            c = n
        else:  # later chunk
            n = int(rng.integers(2, 24))
            c = int(rng.integers(n, max_ctx + 1))
        if tokens + n > T - 3:  # keep some padding tokens
            break
        rows.append((n, c))
        tokens += n
    return rows


def _dense_attention(q, cache, meta, scale, n_real):
    """Each real token's causal attention over its row's pages, in float64 numpy, one token at a time."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, cache.k, cache.v))
    block_size, hkv = k.shape[1], k.shape[2]
    group = q.shape[1] // hkv
    tables, rows, positions = (np.asarray(x) for x in (meta.block_tables, meta.token_rows, meta.positions))
    out = np.zeros_like(q)
    for t in range(n_real):
        n = int(positions[t]) + 1
        pos = np.arange(n)
        slots = tables[rows[t], pos // block_size] * block_size + pos % block_size
        keys = k.reshape(-1, hkv, k.shape[-1])[slots]  # [n, hkv, D]
        values = v.reshape(-1, hkv, v.shape[-1])[slots]
        for h in range(q.shape[1]):
            scores = keys[:, h // group] @ q[t, h] * scale
            p = np.exp(scores - scores.max())
            out[t, h] = (p / p.sum()) @ values[:, h // group]
    return out


def test_reference_matches_dense_attention_over_several_chunks_and_any_table_width():
    """The reference walks the table CHUNK_KEYS keys at a time for as many chunks as the longest
    context needs: the same numbers as a dense softmax per token, and the same for any table width
    (which is why the scheduler needs one width only)."""
    from jtp.models.attention import CHUNK_KEYS

    rng, tag = _rng(900)
    block_size, T, B = 16, 64, 8
    longest = 2 * CHUNK_KEYS + 37  # three chunks
    rows = [(1, longest), (20, 20), (1, 1), (30, CHUNK_KEYS + 30), (1, CHUNK_KEYS)]
    max_blocks = -(-longest // block_size) + 3  # not a multiple of the pages per chunk
    q, cache, meta, n_real = make_batch(rng, rows, T, B, 2, 2, 32, jnp.float32, block_size, num_blocks=160,
                                        max_blocks=max_blocks)
    out = np.asarray(jax.jit(paged_attention_reference, static_argnums=3)(q, cache, meta, 0.2))
    assert np.isfinite(out).all(), "padding tokens must not produce NaN"
    dense = _dense_attention(q, cache, meta, 0.2, n_real)
    err = np.abs(out[:n_real] - dense[:n_real]).max()
    assert err < 1e-4, f"max error {err:.3g} ({tag})"
    wider = meta._replace(block_tables=jnp.pad(meta.block_tables, ((0, 0), (0, 45))))
    np.testing.assert_array_equal(np.asarray(paged_attention_reference(q, cache, wider, 0.2))[:n_real], out[:n_real])


CASES = [
    # (group, hkv, D, dtype, config)  config = (tq, pages/iter, splits, warps, stages) or None
    (1, 2, 64, jnp.float32, None),
    (2, 2, 64, jnp.bfloat16, None),
    (4, 2, 128, jnp.bfloat16, None),
    (4, 1, 64, jnp.float32, (4, 2, 3, 4, 2)),  # flash-decoding splits, 2 pages per iteration
    (2, 2, 128, jnp.float32, (16, 1, 1, 4, 2)),  # tiles of 16 tokens
    (4, 2, 64, jnp.bfloat16, (2, 4, 2, 4, 2)),  # 64 keys per iteration, splits
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_kernel_matches_reference(case):
    group, hkv, D, dtype, config = CASES[case]
    rng, tag = _rng(case)
    T, B = 64, 8
    rows = _random_rows(rng, B, T, max_ctx=120)
    q, cache, meta, n_real = make_batch(rng, rows, T, B, hkv, group, D, dtype)
    scale = D**-0.5
    ref = paged_attention_reference(q, cache, meta, scale)
    out = jax.jit(
        lambda q, k, v, m: ragged_paged_attention(
            q, k, v, m.positions, m.block_tables, m.context_lens, m.row_starts, m.row_lens,
            scale=scale, config=config, interpret=True,
        )
    )(q, cache.k, cache.v, meta)
    assert out.shape == q.shape and out.dtype == q.dtype
    _check(out, ref, n_real, dtype, f"{tag} rows={rows} case={CASES[case]}")


def test_decode_only_and_long_prefill():
    """Decode rows only (one tile each), then one prefill chunk spanning many tiles and pages."""
    rng, tag = _rng(100)
    for rows, T, B in (([(1, 100), (1, 1), (1, 17), (1, 64)], 16, 8), ([(48, 120)], 64, 8)):
        q, cache, meta, n_real = make_batch(rng, rows, T, B, 2, 4, 64, jnp.bfloat16)
        ref = paged_attention_reference(q, cache, meta, 0.125)
        out = jit_optimized(lambda q, k, v, m: ragged_paged_attention(
            q, k, v, m.positions, m.block_tables, m.context_lens, m.row_starts, m.row_lens, scale=0.125,
            interpret=True,
        ))(q, cache.k, cache.v, meta)
        _check(out, ref, n_real, jnp.bfloat16, f"{tag} rows={rows}")
        assert np.all(np.asarray(out[n_real:], np.float32) == 0), "padding tokens should be zero"


DECODE_CASES = [
    # (B real rows, group, hkv, D, dtype, config)  config = (unused, pages/iter, splits, warps, stages)
    (1, 4, 2, 128, jnp.bfloat16, None),  # B=1: default splits + merge kernel
    (1, 8, 1, 64, jnp.float32, (1, 1, 4, 4, 2)),
    (1, 4, 8, 128, jnp.bfloat16, (1, 1, 32, 4, 2)),  # 32 splits of one page each (more splits than pages used)
    (3, 1, 2, 64, jnp.float32, None),
    (3, 2, 2, 128, jnp.bfloat16, (1, 2, 1, 4, 2)),  # no splits: the kernel writes the output
    (8, 4, 2, 64, jnp.bfloat16, (1, 4, 2, 4, 2)),
    (8, 8, 2, 128, jnp.float32, None),
    (64, 2, 2, 64, jnp.bfloat16, None),  # B=64: one pass
    (64, 4, 1, 128, jnp.float32, (1, 2, 2, 4, 2)),
]


@pytest.mark.parametrize("case", range(len(DECODE_CASES)))
def test_decode_kernel_matches_reference(monkeypatch, case):
    """Pure decode steps (query_bound of length 1) through paged_attention take the decode kernel.

    Contexts are random (mostly not multiples of the page), pages scattered, T and B padded to
    buckets like the scheduler (padding tokens and rows), plus a context-1 row.
    """
    B, group, hkv, D, dtype, config = DECODE_CASES[case]
    rng, tag = _rng(400 + case)
    T = 1 if B == 1 else max(16, 1 << (B - 1).bit_length())  # the scheduler's buckets: a lone row is 1 token
    B_pad = max(8, T if B > 8 else 8)
    max_ctx = 120 if B <= 8 else 60
    ctxs = [int(c) for c in rng.integers(1, max_ctx + 1, B)]
    ctxs[0] = 1 if B > 2 else ctxs[0]
    rows = [(1, c) for c in ctxs]
    q, cache, meta, n_real = make_batch(
        rng, rows, T, B_pad, hkv, group, D, dtype, num_blocks=B * 8 + 8, bound=1
    )
    scale = D**-0.5
    ref = paged_attention_reference(q, cache, meta, scale)
    if config is not None:
        _, ppi, splits, _, _ = config
        monkeypatch.setenv("JTP_ATTN_DECODE_KEYS", str(ppi * 16))
        monkeypatch.setenv("JTP_ATTN_DECODE_SPLITS", str(splits))
    # B = 64: a grid that runs long in Pallas' interpreter, faster with XLA's optimisations on.
    jit = jit_optimized if B > 8 else jax.jit
    f = jit(lambda q, c, m: KERNEL(q, c, m, scale)[0])
    names = [str(e.params.get("name")) for e in f.trace(q, cache, meta).jaxpr.eqns if e.primitive.name == "pallas_call"]
    assert any("jtp_paged_decode_attention" in n for n in names), names
    out = f(q, cache, meta)
    assert out.shape == q.shape and out.dtype == q.dtype
    _check(out, ref, n_real, dtype, f"{tag} ctxs={ctxs} case={DECODE_CASES[case]}")
    assert np.all(np.asarray(out[n_real:], np.float32) == 0), "padding tokens should be zero"
    # The same step without the bound (general tiled kernel) agrees too.
    gen = jit(lambda q, c, m: KERNEL(q, c, m._replace(query_bound=None), scale)[0])(q, cache, meta)
    _check(gen, ref, n_real, dtype, f"{tag} general kernel")


@pytest.mark.parametrize("B, bound, config", [(1, 1, None), (8, 1, (1, 2, 2, 4, 2)), (64, 1, None), (6, None, None)])
def test_kernels_read_float8_pages(monkeypatch, B, bound, config):
    """`--kv-cache-dtype fp8`: both kernels (decode: bound 1; general: mixed rows) read float8 e4m3
    pages under a bfloat16 q (their dots in float16) and agree with the reference, which converts the
    pages to bfloat16; e4m3 converts exactly to either, so only the dots' roundings differ."""
    rng, tag = _rng(900 + B)
    if bound == 1:
        T = 1 if B == 1 else max(16, 1 << (B - 1).bit_length())
        rows, B_pad = [(1, int(c)) for c in rng.integers(1, 61 if B > 8 else 121, B)], max(8, T if B > 8 else 8)
    else:
        T, B_pad = 64, 8
        rows = _random_rows(rng, B_pad, T, max_ctx=120)
    q, cache, meta, n_real = make_batch(rng, rows, T, B_pad, 2, 4, 128, jnp.bfloat16, num_blocks=len(rows) * 8 + 8,
                                        bound=bound, page_dtype=jnp.float8_e4m3fn)
    assert cache.k.dtype == jnp.float8_e4m3fn
    if config is not None:
        monkeypatch.setenv("JTP_ATTN_DECODE_KEYS", str(config[1] * 16))
        monkeypatch.setenv("JTP_ATTN_DECODE_SPLITS", str(config[2]))
    scale = 128**-0.5
    ref = paged_attention_reference(q, cache, meta, scale)
    f = (jit_optimized if B > 8 else jax.jit)(lambda q, c, m: KERNEL(q, c, m, scale)[0])
    names = [str(e.params.get("name")) for e in f.trace(q, cache, meta).jaxpr.eqns if e.primitive.name == "pallas_call"]
    assert any(("jtp_paged_decode" if bound == 1 else "jtp_ragged_paged") in n for n in names), names
    out = f(q, cache, meta)
    assert out.dtype == jnp.bfloat16
    _check(out, ref, n_real, jnp.bfloat16, f"{tag} rows={rows}")
    # float16 operands, and 128 keys an iteration (8 pages of 16) where q is 16-bit; float32 q keeps both.
    assert _operand_dtype(jnp.bfloat16, jnp.float8_e4m3fn) == jnp.float16
    assert _operand_dtype(jnp.float32, jnp.float8_e4m3fn) == jnp.float32 == _operand_dtype(jnp.float32, jnp.float32)
    if config is None:
        page_keys = {(1, 2): 8, (1, 4): 4, (2, 2): 4}
        for (page_size, q_size), ppi in page_keys.items():
            assert choose_decode_config(64, 64, 8, 4, 16, 64, 128, page_size, q_size)[1] == ppi
    exact = _dense_attention(q, cache._replace(k=cache.k.astype(jnp.float32), v=cache.v.astype(jnp.float32)),
                             meta, scale, n_real)
    kernel_err = np.abs(np.asarray(out, np.float64)[:n_real] - exact[:n_real]).max()
    ref_err = np.abs(np.asarray(ref, np.float64)[:n_real] - exact[:n_real]).max()
    assert kernel_err <= 1.5 * ref_err + 1e-3, (kernel_err, ref_err, tag)  # float16 dots: no worse than bf16's


def _ops_around_kernel(jaxpr) -> tuple[list[str], int]:
    """Primitive names outside pallas_calls (nested jits/shard_maps opened) and the pallas_call count."""
    ops, kernels = [], 0

    def walk(j):
        nonlocal kernels
        for e in j.eqns:
            if e.primitive.name == "pallas_call":
                kernels += 1
                continue
            subs = [getattr(v, "jaxpr", v) for v in e.params.values() if hasattr(v, "eqns") or hasattr(v, "jaxpr")]
            if subs:
                for sub in subs:
                    walk(sub)
            else:
                ops.append(e.primitive.name)

    walk(jaxpr)
    return ops, kernels


# Ops that are free on GPU (bitcasts / no data movement) around the kernel.
_FREE_OPS = {"reshape", "squeeze", "expand_dims", "bitcast_convert_type"}


@pytest.mark.parametrize("splits", [1, 8])
def test_decode_path_op_count(monkeypatch, splits):
    """The decode step's fixed overhead stays small: at most 2 pallas_calls (kernel + split merge)
    and at most 4 non-trivial XLA ops around them (today: none, only free reshapes).

    Before the decode kernel, this step was 1 pallas_call among ~106 jaxpr ops (q transpose + pad,
    positions repeat, tile map, split merge, output transpose, padding mask).
    """
    monkeypatch.setenv("JTP_ATTN_DECODE_SPLITS", str(splits))
    S = jax.ShapeDtypeStruct
    T, B, hq, hkv, D, M = 16, 8, 32, 8, 128, 64  # Qwen3-8B, decode B <= 8
    i32 = lambda *shape: S(shape, jnp.int32)  # noqa: E731
    meta = AttentionMetadata(i32(T), i32(T), i32(T), i32(B, M), i32(B), i32(B), i32(B), i32(B), i32(B), i32(1))
    cache = LayerKV(S((256, 16, hkv, D), jnp.bfloat16), S((256, 16, hkv, D), jnp.bfloat16))
    jaxpr = jax.make_jaxpr(lambda q, c, m: KERNEL(q, c, m, D**-0.5)[0])(S((T, hq, D), jnp.bfloat16), cache, meta)
    ops, kernels = _ops_around_kernel(jaxpr.jaxpr)
    heavy = [o for o in ops if o not in _FREE_OPS]
    assert kernels == (1 if splits == 1 else 2), (kernels, ops)
    assert len(heavy) <= 4, f"decode path grew XLA ops around the kernel: {heavy}"
    assert len(ops) <= 8, ops
    # Mixed steps keep the general kernel.
    meta_mixed = meta._replace(query_bound=i32(16))
    jaxpr = jax.make_jaxpr(lambda q, c, m: KERNEL(q, c, m, D**-0.5)[0])(
        S((T, hq, D), jnp.bfloat16), cache, meta_mixed
    )
    assert "jtp_ragged_paged_attention" in str(jaxpr) and "jtp_paged_decode" not in str(jaxpr)


def test_general_kernel_with_row_bound():
    """Mixed steps with query_bound (L > 1): the tile map is sized from L, results unchanged."""
    for i, (rows, L) in enumerate((([(1, 50), (7, 7), (3, 90), (1, 1)], 8), ([(16, 40), (2, 100)], 16))):
        rng, tag = _rng(500 + i)
        q, cache, meta, n_real = make_batch(rng, rows, 32, 8, 2, 4, 64, jnp.float32, bound=L)
        ref = paged_attention_reference(q, cache, meta, 0.125)
        out = jax.jit(lambda q, c, m: KERNEL(q, c, m, 0.125)[0])(q, cache, meta)
        _check(out, ref, n_real, jnp.float32, f"{tag} rows={rows} L={L}")
        assert np.all(np.asarray(out[n_real:], np.float32) == 0), "padding tokens should be zero"


def test_dispatch(monkeypatch):
    """The kernel on GPUs, the reference elsewhere; JTP_ATTENTION (read once, when the runner
    chooses) or an explicit impl forces either. Both paths agree."""
    rng, tag = _rng(200)
    q, cache, meta, n_real = make_batch(rng, [(1, 30), (5, 5)], 16, 8, 2, 2, 64, jnp.float32)
    monkeypatch.delenv("JTP_ATTENTION", raising=False)
    assert choose_attention().impl == ("kernel" if jax.default_backend() == "gpu" else "reference")
    monkeypatch.setenv("JTP_ATTENTION", "kernel")
    kernel = choose_attention()
    assert kernel.impl == "kernel" and choose_attention(impl="reference").impl == "reference"
    monkeypatch.setenv("JTP_ATTENTION", "reference")
    assert kernel.impl == "kernel", "the choice is made once, not at trace time"
    kern, kern_cache = jax.jit(lambda q, c, m: kernel(q, c, m, 0.125))(q, cache, meta)
    ref, ref_cache = jax.jit(lambda q, c, m: choose_attention()(q, c, m, 0.125))(q, cache, meta)
    _check(kern, ref, n_real, jnp.float32, tag)
    # Attention reads the pages: both hand back the cache they were given, every page (the scratch one too).
    for pages in (kern_cache, ref_cache):
        np.testing.assert_array_equal(np.asarray(pages.k), np.asarray(cache.k))
        np.testing.assert_array_equal(np.asarray(pages.v), np.asarray(cache.v))
    monkeypatch.setenv("JTP_ATTENTION", "bogus")
    with pytest.raises(ValueError, match="bogus"):
        choose_attention()


LOWER_CASES = [
    # (T, B, hq, hkv, D, max_row_len, config); max_row_len 1 = the decode kernel (+ merge if splits)
    (16, 8, 32, 8, 128, None, None),
    (2048, 64, 16, 8, 128, None, None),
    (2048, 64, 16, 8, 128, 512, None),
    (16, 8, 32, 8, 128, 1, None),  # Qwen3-8B decode B<=8: splits + merge kernel
    (64, 64, 32, 8, 128, 1, None),  # B=64: one pass, no merge
    (16, 8, 8, 8, 64, 1, None),  # group 1
    (16, 8, 64, 8, 128, 1, (1, 8, 4, 4, 3)),  # group 8, 128 keys per iteration
    (16, 8, 12, 3, 128, 1, (1, 4, 1, 4, 2)),  # Hq not a power of two
]


@pytest.mark.parametrize("case", LOWER_CASES)
def test_lowers_to_triton_for_cuda(case):
    """The Pallas -> Triton lowering runs on CPU too: catches unsupported ops before a GPU is lent."""
    S = jax.ShapeDtypeStruct
    T, B, hq, hkv, D, L, config = case
    f = lambda q, k, v, p, tr, bt, c, rs, rl: ragged_paged_attention(  # noqa: E731
        q, k, v, p, bt, c, rs, rl, scale=D**-0.5, max_row_len=L, token_rows=tr, config=config
    )
    args = (
        S((T, hq, D), jnp.bfloat16), S((64, 16, hkv, D), jnp.bfloat16), S((64, 16, hkv, D), jnp.bfloat16),
        S((T,), jnp.int32), S((T,), jnp.int32), S((B, 32), jnp.int32), S((B,), jnp.int32), S((B,), jnp.int32),
        S((B,), jnp.int32),
    )
    text = cuda_lowering(f, *args)
    assert "triton" in text
    assert ("jtp_paged_decode_attention" in text) == (L == 1)


@pytest.mark.parametrize("decode", [False, True])
def test_kernel_under_tensor_parallelism(decode):
    """tp=2 (conftest forces 8 CPU devices): the kernel runs per head shard inside shard_map."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jtp.parallel.sharding import make_mesh

    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    rng, tag = _rng(300 + decode)
    mesh = make_mesh(2)
    rows = [(1, 70), (1, 9), (1, 40), (1, 3)] if decode else [(1, 70), (9, 9), (4, 40), (1, 3)]
    q, cache, meta, n_real = make_batch(rng, rows, 32, 8, 4, 2, 64, jnp.bfloat16, bound=1 if decode else 16)
    ref = paged_attention_reference(q, cache, meta, 0.125)
    q = jax.device_put(q, NamedSharding(mesh, P(None, "tp", None)))
    cache = jax.device_put(cache, NamedSharding(mesh, P(None, None, "tp", None)))
    meta = jax.device_put(meta, NamedSharding(mesh, P()))
    sharded = PagedAttention("kernel", mesh)
    f = jax.jit(lambda q, c, m: sharded(q, c, m, 0.125)[0])
    text = f.lower(q, cache, meta).as_text()
    jaxpr_text = str(f.trace(q, cache, meta).jaxpr)
    out = f(q, cache, meta)
    assert "manual" in text.lower(), "expected a shard_map (manual computation) around the kernel"
    assert out.sharding.spec[1] == "tp" if hasattr(out.sharding, "spec") else True
    assert ("jtp_paged_decode_attention" in jaxpr_text) == decode, "decode steps must take the decode kernel"
    _check(out, ref, n_real, jnp.bfloat16, tag)
    assert np.all(np.asarray(out[n_real:], np.float32) == 0), "padding tokens should be zero"


def test_kernel_tiles_fit_shared_memory_in_float32():
    """Float32 with head_dim 256 (Qwen3.5's attention) at the bf16 tile sizes asked an H200 for
    320 KiB of shared memory (227 KiB exist); the configs shrink their K/V tiles to fit, and leave
    the bf16 configs as tuned."""
    from jtp.kernels.ragged_paged_attention import (
        SHARED_MEMORY_BUDGET,
        _decode_rows,
        choose_config,
        choose_decode_config,
    )

    for d, itemsize in [(128, 2), (256, 2), (128, 4), (256, 4)]:
        for bs in (16, 32, 64):
            tq, ppi, _, _, stages = choose_config(4096, 2, 4, bs, 4096, d, itemsize)
            assert (tq * 4 + 2 * stages * ppi * bs) * d * itemsize <= SHARED_MEMORY_BUDGET
            _, ppi, _, _, stages = choose_decode_config(8, 8, 2, 4, bs, 64, d, itemsize)
            assert (_decode_rows(4) + 2 * stages * ppi * bs) * d * itemsize <= SHARED_MEMORY_BUDGET
    assert choose_config(4096, 2, 4, 16, 4096, 256, 2) == choose_config(4096, 2, 4, 16, 4096)
    assert choose_config(4096, 2, 4, 16, 4096, 256, 4)[1] < choose_config(4096, 2, 4, 16, 4096, 256, 2)[1]


def test_kernel_block_tables_keep_several_pages_per_iteration():
    """The GPU decode kernel reads `pages per iteration` pages at a time, a count that must divide
    the block table's width (else it falls back to one page per iteration: 1.5x the attention time
    of Qwen3-8B at B=1 on an H200). The scheduler's width is a multiple of 16 pages for any
    max_model_len, e.g. bench.py's 2049 tokens (129 pages of 16)."""
    from jtp.core.buckets import Buckets
    from jtp.kernels.ragged_paged_attention import choose_decode_config

    for max_blocks in (1, 7, 64, 129, 2560):
        width = Buckets.make(2048, 64, max_blocks).table_width
        assert width >= max_blocks and width % 16 == 0
        _, ppi, _, _, _ = choose_decode_config(16, 8, 8, 4, 16, width)
        assert ppi == 4  # JTP_ATTN_DECODE_KEYS 64 / block_size 16


@pytest.mark.parametrize("slots", [[5], [-1], [3, -1, 17, -1], [-1, -1]])
def test_write_kv_writes_its_slots_and_sends_padding_to_the_scratch_page(slots):
    """Real tokens land in their slots (numpy's assignment is the reference); padding (-1) changes no
    page of the pool, only the scratch page past it."""
    num_blocks, block_size, heads, dim = 4, 8, 2, 16
    rng = np.random.default_rng(len(slots))
    shape = (num_blocks + 1, block_size, heads, dim)
    old = LayerKV(*(jnp.asarray(rng.normal(size=shape), jnp.float32) for _ in range(2)))
    k, v = (rng.normal(size=(len(slots), heads, dim)).astype(np.float32) for _ in range(2))
    new = write_kv(old, jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots, jnp.int32))
    for pages, before, values in ((new.k, old.k, k), (new.v, old.v, v)):
        want = np.asarray(before).reshape(-1, heads, dim).copy()
        for i, slot in enumerate(slots):
            if slot >= 0:
                want[slot] = values[i]
        got = np.asarray(pages).reshape(-1, heads, dim)
        pool = num_blocks * block_size
        np.testing.assert_array_equal(got[:pool], want[:pool])
        if -1 not in slots:
            np.testing.assert_array_equal(got[pool:], want[pool:])


def test_cache_writes_need_no_bounds_check():
    """Every index write_kv uses is in range (padding goes to the scratch page), so a one-token
    step's write is a dynamic_update_slice and a longer one's a scatter that promises in-range
    indices: no scatter that drops, which XLA lowers to a read of the old value and a select."""
    S = jax.ShapeDtypeStruct
    cache = LayerKV(S((9, 16, 8, 128), jnp.bfloat16), S((9, 16, 8, 128), jnp.bfloat16))
    for T in (1, 3):
        new = S((T, 8, 128), jnp.bfloat16)
        eqns = jax.make_jaxpr(write_kv)(cache, new, new, S((T,), jnp.int32)).jaxpr.eqns
        names = [e.primitive.name for e in eqns]
        scatters = [e for e in eqns if e.primitive.name == "scatter"]
        if T == 1:
            assert names.count("dynamic_update_slice") == 2 and not scatters, names
        else:
            assert len(scatters) == 2 and all("PROMISE_IN_BOUNDS" in str(e.params["mode"]) for e in scatters), scatters


# ----------------------------------------------------------------------------- rope + K/V write


def _rope_case(rng, T, hq, hkv, D, dtype, norm, num_blocks=6, block_size=4):
    """Random q/k/v, pages and cos/sin of random positions; slots: distinct real slots and padding (-1)."""
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)  # noqa: E731
    num_slots = num_blocks * block_size
    slots = rng.permutation(num_slots)[:T]
    slots[1:][rng.random(T - 1) < 0.3] = -1  # token 0 always real: a lone token's write is checked
    positions = rng.integers(0, 4096, T)
    inv_freq = 1e6 ** (-np.arange(0, D, 2) / D)
    angles = np.concatenate([positions[:, None] * inv_freq] * 2, axis=1)
    pages = lambda: normal(num_blocks + 1, block_size, hkv, D)  # noqa: E731
    return dict(q=normal(T, hq, D), k=normal(T, hkv, D), v=normal(T, hkv, D), cache=LayerKV(pages(), pages()),
                slots=jnp.asarray(slots, jnp.int32), cos=jnp.asarray(np.cos(angles), dtype),
                sin=jnp.asarray(np.sin(angles), dtype),
                q_norm=normal(D) if norm else None, k_norm=normal(D) if norm else None)


def _rope_numpy(x, cos, sin, weight, eps=1e-6):
    """float64: per-head RMSNorm (if a weight), then NeoX rotation over the whole head."""
    x, cos, sin = (np.asarray(a, np.float64) for a in (x, cos, sin))
    if weight is not None:
        x = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * np.asarray(weight, np.float64)
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None] + rotated * sin[:, None]


ROPE_CASES = [  # (T, hq, hkv, D, dtype, norm)
    (1, 32, 8, 128, jnp.bfloat16, True),  # Qwen3-8B decode, one request
    (7, 4, 2, 64, jnp.float32, True),
    (5, 6, 2, 64, jnp.float32, False),  # Qwen2: no q/k norm; heads not a power of two
    (9, 8, 8, 128, jnp.bfloat16, False),
    (3, 16, 8, 128, jnp.float32, True),  # Qwen3-0.6B
]


@pytest.mark.parametrize("case", range(len(ROPE_CASES)))
def test_rope_and_write_kernel_matches_numpy(case):
    """The fused kernel (interpreted) against float64 numpy: rotated q, k and v in their slots,
    every other page of the pool untouched; and against the jnp reference within one rounding."""
    from jtp.models.attention import rope_and_write_kernel, rope_and_write_reference

    T, hq, hkv, D, dtype, norm = ROPE_CASES[case]
    rng, tag = _rng(700 + case)
    c = _rope_case(rng, T, hq, hkv, D, dtype, norm)
    args = (c["q"], c["k"], c["v"], c["cache"], c["slots"], c["cos"], c["sin"], c["q_norm"], c["k_norm"])
    q, cache = jax.jit(lambda *a: rope_and_write_kernel(*a, 1e-6))(*args)
    ref_q, ref_cache = jax.jit(lambda *a: rope_and_write_reference(*a, 1e-6))(*args)

    f32 = lambda a: np.asarray(jnp.asarray(a, jnp.float32))  # noqa: E731
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == jnp.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    # vs the reference: bf16 rounds each of its ops, the kernel once (cancellation: a few ulps of the terms)
    same = dict(rtol=1e-2, atol=3e-2) if dtype == jnp.bfloat16 else dict(rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(f32(q), _rope_numpy(c["q"], c["cos"], c["sin"], c["q_norm"]), **tol, err_msg=tag)
    want_k = _rope_numpy(c["k"], c["cos"], c["sin"], c["k_norm"])
    slots = np.asarray(c["slots"])
    pool = c["cache"].k.shape[0] * c["cache"].k.shape[1] - c["cache"].k.shape[1]  # slots before the scratch page
    for pages, before, want, ref in ((cache.k, c["cache"].k, want_k, ref_cache.k),
                                     (cache.v, c["cache"].v, np.asarray(c["v"], np.float64), ref_cache.v)):
        got, old = f32(pages).reshape(-1, hkv, D), f32(before).reshape(-1, hkv, D)
        written = slots[slots >= 0]
        np.testing.assert_allclose(got[written], want[slots >= 0], **tol, err_msg=tag)
        untouched = np.setdiff1d(np.arange(pool), written)
        np.testing.assert_array_equal(got[untouched], old[untouched], err_msg=f"{tag}: a page outside the slots changed")
        np.testing.assert_allclose(got[:pool], f32(ref).reshape(-1, hkv, D)[:pool], **same, err_msg=tag)
    np.testing.assert_allclose(f32(q), f32(ref_q), **same, err_msg=tag)


@pytest.mark.parametrize("T", [1, 6])
def test_rope_and_write_kernel_into_float8_pages(T):
    """`--kv-cache-dtype fp8`: the kernel (interpreted) writes k and v as the reference does, values
    past e4m3's largest finite one saturated at +-448 (none become NaN), v bit-identical, k within
    bit-identical to the kernel's own bf16 pages saturated into float8 (one rounding after the bf16
    rotation), and near the reference (which rounds per op: under cancellation a few bf16 ulps of
    the terms, then one float8 rounding); the rotated q matches as in bf16 pages' case, and no
    other slot of the pool changes."""
    from jtp.kernels.rope_kv_write import to_page
    from jtp.models.attention import rope_and_write_kernel, rope_and_write_reference

    rng, tag = _rng(750 + T)
    c = _rope_case(rng, T, 8, 2, 64, jnp.bfloat16, True)
    c["v"] = c["v"] * 300  # a third of the values beyond 448
    c["cache"] = LayerKV(*(p.astype(jnp.float8_e4m3fn) for p in c["cache"]))
    args = (c["q"], c["k"], c["v"], c["cache"], c["slots"], c["cos"], c["sin"], c["q_norm"], c["k_norm"])
    q, cache = jax.jit(lambda *a: rope_and_write_kernel(*a, 1e-6))(*args)
    ref_q, ref_cache = jax.jit(lambda *a: rope_and_write_reference(*a, 1e-6))(*args)

    f32 = lambda a: np.asarray(jnp.asarray(a, jnp.float32)).reshape(-1, 2, 64)  # noqa: E731
    slots = np.asarray(c["slots"])
    written = slots[slots >= 0]
    assert cache.k.dtype == cache.v.dtype == jnp.float8_e4m3fn
    v_got = f32(cache.v)
    np.testing.assert_array_equal(v_got, f32(ref_cache.v), err_msg=tag)
    want_v = np.clip(np.asarray(c["v"], np.float32)[slots >= 0], -448, 448)
    np.testing.assert_allclose(v_got[written], want_v, rtol=2 ** -3, err_msg=tag)  # e4m3: 3 mantissa bits
    assert np.abs(v_got[written]).max() == 448 and np.isfinite(v_got).all()
    bf16_args = (*args[:3], LayerKV(*(p.astype(jnp.bfloat16) for p in c["cache"])), *args[4:])
    _, bf16_cache = jax.jit(lambda *a: rope_and_write_kernel(*a, 1e-6))(*bf16_args)
    np.testing.assert_array_equal(f32(cache.k), f32(to_page(bf16_cache.k, jnp.float8_e4m3fn)), err_msg=tag)
    np.testing.assert_allclose(f32(cache.k), f32(ref_cache.k), rtol=2 ** -3, atol=3e-2, err_msg=tag)
    untouched = np.setdiff1d(np.arange(c["cache"].k.shape[0] * c["cache"].k.shape[1]), written)
    for got, before in ((cache.k, c["cache"].k), (cache.v, c["cache"].v)):
        np.testing.assert_array_equal(f32(got)[untouched[:-4]], f32(before)[untouched[:-4]], err_msg=tag)
    np.testing.assert_allclose(np.asarray(q, np.float32), np.asarray(ref_q, np.float32), rtol=1e-2, atol=3e-2)


def test_rope_and_write_dispatch():
    """PagedAttention("kernel") fuses where the kernel applies: few tokens, rotation over the whole
    head, pages in q's dtype or float8 e4m3; else (a long prefill, Qwen3.5's partial rotation, pages
    of another dtype) the reference."""
    from jtp.kernels.rope_kv_write import MAX_TOKENS

    S = jax.ShapeDtypeStruct

    def traced(T, rotary=128, page_dtype=jnp.bfloat16, impl=KERNEL):
        i32 = lambda *shape: S(shape, jnp.int32)  # noqa: E731
        meta = AttentionMetadata(i32(T), i32(T), i32(T), i32(4, 8), i32(4), i32(4), i32(4), i32(4), i32(4))
        cache = LayerKV(S((9, 16, 8, 128), page_dtype), S((9, 16, 8, 128), page_dtype))
        x = lambda h: S((T, h, 128), jnp.bfloat16)  # noqa: E731
        cs = S((T, rotary), jnp.bfloat16)
        w = S((128,), jnp.bfloat16)
        return str(jax.make_jaxpr(lambda q, k, v, c, m, cos, sin, qn, kn: impl.rope_and_write(
            q, k, v, c, m, cos, sin, qn, kn))(x(32), x(8), x(8), cache, meta, cs, cs, w, w))

    assert "jtp_rope_kv_write_norm" in traced(1) and "jtp_rope_kv_write" in traced(MAX_TOKENS)
    assert "jtp_rope_kv_write" in traced(1, page_dtype=jnp.float8_e4m3fn)
    for text in (traced(MAX_TOKENS + 1), traced(1, rotary=64), traced(1, page_dtype=jnp.float32),
                 traced(1, impl=PagedAttention("reference"))):
        assert "jtp_rope_kv_write" not in text


@pytest.mark.parametrize("dtype, norm, page_dtype", [(jnp.bfloat16, True, None), (jnp.float32, False, None),
                                                     (jnp.bfloat16, True, jnp.float8_e4m3fn)])
def test_rope_and_write_lowers_to_triton_for_cuda(dtype, norm, page_dtype):
    from jtp.kernels.rope_kv_write import rope_and_write

    S = jax.ShapeDtypeStruct
    x = lambda h: S((4, h, 128), dtype)  # noqa: E731
    pages = S((65, 16, 8, 128), page_dtype or dtype)
    w = S((128,), dtype) if norm else None
    text = cuda_lowering(lambda q, k, v, kp, vp, s, c, si, qn, kn: rope_and_write(q, k, v, kp, vp, s, c, si, qn, kn),
                         x(32), x(8), x(8), pages, pages, S((4,), jnp.int32), S((4, 128), dtype), S((4, 128), dtype),
                         w, w)
    assert "triton" in text and "jtp_rope_kv_write" in text


@pytest.mark.parametrize("dtype, norm", [(jnp.float32, True), (jnp.bfloat16, False)])
def test_rope_and_write_under_tensor_parallelism(dtype, norm):
    """tp=2: the kernel runs per head shard inside shard_map; same q and pages as the reference
    (bf16: within a rounding, see rope_kv_write.py)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jtp.parallel.sharding import make_mesh

    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    mesh = make_mesh(2)
    rng, tag = _rng(800)
    c = _rope_case(rng, 6, 8, 4, 64, dtype, norm)
    heads = NamedSharding(mesh, P(None, "tp", None))
    q, k, v = (jax.device_put(c[n], heads) for n in ("q", "k", "v"))
    cache = jax.device_put(c["cache"], NamedSharding(mesh, P(None, None, "tp", None)))
    i32 = jnp.zeros(6, jnp.int32)
    meta = AttentionMetadata(i32, c["slots"], i32, jnp.zeros((1, 1), jnp.int32), *(jnp.zeros(1, jnp.int32),) * 5)
    f = jax.jit(lambda *a: PagedAttention("kernel", mesh).rope_and_write(*a))
    args = (q, k, v, cache, meta, c["cos"], c["sin"], c["q_norm"], c["k_norm"])
    assert "jtp_rope_kv_write" in str(f.trace(*args).jaxpr)
    out_q, out_cache = f(*args)
    ref_q, ref_cache = PagedAttention("reference").rope_and_write(*args)
    f32 = lambda a: np.asarray(jnp.asarray(a, jnp.float32))  # noqa: E731
    tol = dict(rtol=1e-2, atol=3e-2) if dtype == jnp.bfloat16 else dict(rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(f32(out_q), f32(ref_q), **tol, err_msg=tag)
    for got, want in zip(out_cache, ref_cache):
        n = got.shape[0] * got.shape[1] - got.shape[1]  # the pool, not the scratch page
        np.testing.assert_allclose(f32(got).reshape(-1, 4, 64)[:n], f32(want).reshape(-1, 4, 64)[:n], **tol,
                                   err_msg=tag)
