"""The chunked delta rule's chunk kernel (jtp/kernels/delta_rule_chunks.py, interpreted off-GPU)
against the jnp path of `chunked_gated_delta_rule` and the token-by-token recurrence.

Through the engine's step it runs in tests/test_qwen3_5.py::test_gpu_kernels_in_a_split_prompt_step_match_hf
(a prompt step's chunked rows on the kernel path, against HF)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cpu_env import cuda_lowering
from test_qwen3_5 import delta_rule_inputs

from jtp.kernels import delta_rule_chunks as chunk_kernel
from jtp.models.attention import PagedAttention
from jtp.models.delta_rule import (
    chunk_kernel_supported,
    chunked_gated_delta_rule,
    chunked_rule_kernel,
    gated_delta_step,
)

B, L, H, DK, DV, C = 4, 64, 2, 16, 32, 16
# A full row, an empty one, one ending mid-chunk, one ending on a chunk's edge.
LENS = np.array([64, 0, 37, 16])
# Kept states: in the full row's last chunk, none (m = -1), the mid-chunk row's last token (its
# last chunk), and in a row's first chunk.
KEEP = np.array([50, 0, 37, 5])


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def inputs(seed=0):
    """Random q, k, v, g, beta and a nonzero initial state; k = g = beta = 0 past each row's end."""
    return delta_rule_inputs(B, L, H, DK, DV, jnp.asarray(np.arange(L)[None, :] >= LENS[:, None]), seed)


@functools.cache
def recurrence():
    """The L = 1 recurrence over every token: (outputs [B, L, H, dv], the states after 0..L tokens)."""
    x = inputs()
    step, S, outs, states = jax.jit(gated_delta_step), x[5], [], [x[5]]
    for t in range(L):
        o, S = step(*(a[:, t] for a in x[:5]), S)
        outs.append(o)
        states.append(S)
    return np.stack(outs, 1), states


rule = jax.jit(chunked_gated_delta_rule, static_argnames=("chunk", "max_tokens", "kernel"))


@pytest.mark.parametrize("skip", [False, True], ids=["all-chunks", "live-chunks"])
def test_kernel_equals_jnp_rule_and_recurrence(skip):
    """Outputs, final and kept states of the kernel path equal the jnp path's and the token-by-token
    recurrence's, with the chunks past each row's end skipped (row_lens, max_tokens) and without."""
    x, keep = inputs(), jnp.asarray(KEEP, jnp.int32)
    kw = dict(chunk=C, keep_lens=keep, row_lens=jnp.asarray(LENS, jnp.int32) if skip else None,
              max_tokens=int(LENS.sum()) if skip else None)
    assert "jtp_delta_rule_chunks" in str(rule.trace(*x, kernel=True, **kw).jaxpr)
    assert "jtp_delta_rule_chunks" not in str(rule.trace(*x, kernel=False, **kw).jaxpr)
    o, final, kept = rule(*x, kernel=True, **kw)
    o_jnp, final_jnp, kept_jnp = rule(*x, kernel=False, **kw)
    outs, states = recurrence()
    real = (np.arange(L)[None, :] < LENS[:, None])[..., None, None]
    assert np.isfinite(np.asarray(o)).all()
    if skip:  # chunks past a row's last are not computed: zeros (the kernel writes no chunk of no row)
        past = (np.arange(L)[None, :] // C * C >= LENS[:, None])[..., None, None]
        np.testing.assert_array_equal(np.where(past, o, 0.0), 0.0)
    mask = lambda a: np.where(real, a, 0.0)  # noqa: E731
    for got, want in ((mask(o), mask(o_jnp)), (final, final_jnp), (kept, kept_jnp)):
        assert rel(got, want) < 1e-5
    assert rel(mask(o), mask(outs)) < 1e-5
    assert rel(final, states[-1]) < 1e-5
    np.testing.assert_allclose(final[1], x[5][1])  # the empty row keeps its state
    for b, n in enumerate(KEEP.tolist()):
        assert rel(kept[b], states[n][b]) < 1e-5, f"row {b}: state after {n} tokens"


def test_heads_split_over_tp_equal_one_device():
    """Under tp = 2 the kernel runs per head shard inside shard_map and equals the unsharded call."""
    from jtp.parallel.sharding import make_mesh

    x, lens, keep = inputs(1), jnp.asarray(LENS, jnp.int32), jnp.asarray(KEEP, jnp.int32)
    call = lambda attend: jax.jit(lambda *a: chunked_rule_kernel(attend, *a[:6], C, a[6], a[7],  # noqa: E731
                                                                 max_tokens=int(LENS.sum())))
    run = lambda attend: call(attend)(*x, lens, keep)  # noqa: E731
    jaxpr = str(call(PagedAttention("kernel", make_mesh(2))).trace(*x, lens, keep).jaxpr)
    assert "shard_map" in jaxpr and "jtp_delta_rule_chunks" in jaxpr
    for got, want in zip(run(PagedAttention("kernel", make_mesh(2))), run(PagedAttention("kernel"))):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_which_chunk_shapes_take_the_kernel():
    from jtp.parallel.sharding import make_mesh

    kernel = PagedAttention("kernel")
    assert chunk_kernel_supported(kernel, 64, 128, 128, 16)  # Qwen3.5-9B
    assert chunk_kernel_supported(kernel, 16, 16, 32, 2)
    assert not chunk_kernel_supported(PagedAttention("reference"), 64, 128, 128, 16)
    assert not chunk_kernel_supported(kernel, 12, 16, 32, 2)  # a chunk of 12 tokens (a short step's bound)
    assert not chunk_kernel_supported(kernel, 64, 128, 16, 16)  # fewer value columns than a program's 32
    assert not chunk_kernel_supported(kernel, 64, 256, 128, 16)  # a state tile too large for registers
    assert chunk_kernel_supported(PagedAttention("kernel", make_mesh(2)), 64, 128, 128, 16)
    assert not chunk_kernel_supported(PagedAttention("kernel", make_mesh(2)), 64, 128, 128, 3)


@pytest.mark.parametrize("heads", [16, 32])
def test_lowers_to_triton_at_qwen3_5_shapes(heads):
    """Qwen3.5's shapes (chunk 64, dk = dv = 128) lower to Triton on the CPU: an op Triton lacks
    fails here, not on a lent GPU."""
    S, f32, i32 = jax.ShapeDtypeStruct, jnp.float32, jnp.int32
    live, rows, dk, dv = 36, 4, 128, 128
    text = cuda_lowering(chunk_kernel.chunk_loop, S((live, heads, 64, dk), f32), S((live, heads, 64, 64), f32),
                         S((live, heads, 64, dv), f32), S((live, heads, 64, dk), f32), S((live, heads, 64, dk), f32),
                         S((live, heads), f32), S((rows, heads, dk, dv), f32), S((rows,), i32), S((rows,), i32),
                         S((rows,), i32))
    assert "triton" in text and "jtp_delta_rule_chunks" in text
