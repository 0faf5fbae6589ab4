"""The Pallas ragged paged-attention kernel (interpret mode on CPU) against the jnp reference.

Every run draws fresh random inputs (the seed is printed on failure): the kernel must compute the
same function on any valid ragged batch, not on one lucky draw.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtp.attention import AttentionMetadata, LayerKV, attention_impl, paged_attention, paged_attention_reference, write_kv
from jtp.kernels.ragged_paged_attention import ragged_paged_attention

_ENTROPY = np.random.SeedSequence().entropy  # fresh each run; shown in failure messages


def _rng(case: int) -> tuple[np.random.Generator, str]:
    seq = np.random.SeedSequence(_ENTROPY, spawn_key=(case,))
    return np.random.default_rng(seq), f"entropy={_ENTROPY} case={case}"


def make_batch(rng, rows, T, B, hkv, group, D, dtype, block_size=16, num_blocks=48, max_blocks=8):
    """rows: list of (query tokens, context after this step); the rest of B are padding rows.

    Pages are scattered over the pool; K/V of this step are written through write_kv like the
    model does; tokens past the rows (T - sum) are padding (slot -1).
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
    cache = LayerKV(jnp.asarray(rng.standard_normal(shape), dtype), jnp.asarray(rng.standard_normal(shape), dtype))
    k_new = jnp.asarray(rng.standard_normal((T, hkv, D)), dtype)
    v_new = jnp.asarray(rng.standard_normal((T, hkv, D)), dtype)
    meta = AttentionMetadata(
        jnp.asarray(positions), jnp.asarray(slots), jnp.asarray(token_rows), jnp.asarray(tables),
        jnp.asarray(ctx), jnp.asarray(starts), jnp.asarray(lens), jnp.full(B, -1, jnp.int32),
    )
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
        out = ragged_paged_attention(
            q, cache.k, cache.v, meta.positions, meta.block_tables, meta.context_lens, meta.row_starts,
            meta.row_lens, scale=0.125, interpret=True,
        )
        _check(out, ref, n_real, jnp.bfloat16, f"{tag} rows={rows}")
        assert np.all(np.asarray(out[n_real:], np.float32) == 0), "padding tokens should be zero"


def test_dispatch(monkeypatch):
    """JTP_ATTENTION forces either path; the default on CPU is the reference."""
    rng, tag = _rng(200)
    q, cache, meta, n_real = make_batch(rng, [(1, 30), (5, 5)], 16, 8, 2, 2, 64, jnp.float32)
    monkeypatch.delenv("JTP_ATTENTION", raising=False)
    assert attention_impl() == ("kernel" if jax.default_backend() == "gpu" else "reference")
    monkeypatch.setenv("JTP_ATTENTION", "kernel")
    assert attention_impl() == "kernel"
    kern = jax.jit(lambda q, c, m: paged_attention(q, c, m, 0.125))(q, cache, meta)
    monkeypatch.setenv("JTP_ATTENTION", "reference")
    ref = jax.jit(lambda q, c, m: paged_attention(q, c, m, 0.125))(q, cache, meta)
    _check(kern, ref, n_real, jnp.float32, tag)
    monkeypatch.setenv("JTP_ATTENTION", "bogus")
    with pytest.raises(ValueError):
        attention_impl()


def test_lowers_to_triton_for_cuda():
    """The Pallas -> Triton lowering runs on CPU too: catches unsupported ops before a GPU is lent."""
    S = jax.ShapeDtypeStruct
    for T, B, hq, hkv, D in ((16, 8, 32, 8, 128), (2048, 64, 16, 8, 128)):
        f = jax.jit(
            lambda q, k, v, p, bt, c, rs, rl: ragged_paged_attention(q, k, v, p, bt, c, rs, rl, scale=D**-0.5)
        )
        args = (
            S((T, hq, D), jnp.bfloat16), S((64, 16, hkv, D), jnp.bfloat16), S((64, 16, hkv, D), jnp.bfloat16),
            S((T,), jnp.int32), S((B, 32), jnp.int32), S((B,), jnp.int32), S((B,), jnp.int32), S((B,), jnp.int32),
        )
        try:
            text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        except Exception as e:  # noqa: BLE001
            if "cuda" in str(e).lower() and "platform" in str(e).lower():
                pytest.skip(f"this jax cannot lower for cuda here: {e}")
            raise
        assert "triton" in text


def test_kernel_under_tensor_parallelism(monkeypatch):
    """tp=2 (conftest forces 8 CPU devices): the kernel runs per head shard inside shard_map."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jtp.attention import attention_mesh
    from jtp.sharding import make_mesh

    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    monkeypatch.setenv("JTP_ATTENTION", "kernel")
    rng, tag = _rng(300)
    mesh = make_mesh(2)
    q, cache, meta, n_real = make_batch(rng, [(1, 70), (9, 9), (4, 40), (1, 3)], 32, 8, 4, 2, 64, jnp.bfloat16)
    ref = paged_attention_reference(q, cache, meta, 0.125)
    q = jax.device_put(q, NamedSharding(mesh, P(None, "tp", None)))
    cache = jax.device_put(cache, NamedSharding(mesh, P(None, None, "tp", None)))
    meta = jax.device_put(meta, NamedSharding(mesh, P()))
    f = jax.jit(lambda q, c, m: paged_attention(q, c, m, 0.125))
    with attention_mesh(mesh):
        text = f.lower(q, cache, meta).as_text()
        out = f(q, cache, meta)
    assert "manual" in text.lower(), "expected a shard_map (manual computation) around the kernel"
    assert out.sharding.spec[1] == "tp" if hasattr(out.sharding, "spec") else True
    _check(out, ref, n_real, jnp.bfloat16, tag)
