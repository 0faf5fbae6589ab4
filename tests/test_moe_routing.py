"""MoE routing on decode-sized steps: the softmax / top-k kernel (interpreted off-GPU) against
lax.top_k's path and numpy, and the sort-free grouping of (token, expert) pairs against numpy's
stable argsort and bincount. Through the engine's step: tests/test_moe.py's kernel-path test and
tests/test_hf_parity.py::test_gpu_kernels_match_hf (the MoE checkpoint against HF)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cpu_env import cuda_lowering

from jtp.kernels import route_top_k as kernel
from jtp.models import moe
from jtp.models.layers import route_top_k
from jtp.models.moe import RoutedExperts


def numpy_route(logits: np.ndarray, k: int, normalize: bool):
    z = logits.astype(np.float64)
    probs = np.exp(z - z.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :k]  # largest first; ties: the lower id
    weights = np.take_along_axis(probs, ids, -1)
    return (weights / weights.sum(-1, keepdims=True) if normalize else weights), ids


@pytest.mark.parametrize("T, E, k, normalize, dtype", [
    (1, 128, 8, True, jnp.bfloat16), (5, 128, 8, False, jnp.float32), (64, 512, 10, True, jnp.float32),
    (3, 8, 2, True, jnp.float32), (2, 256, 8, True, jnp.bfloat16)])
def test_kernel_matches_numpy_and_lax_top_k(T, E, k, normalize, dtype):
    """Qwen3-30B-A3B (128 experts, top-8), Qwen3.5-35B-A3B (256), Qwen3-Next (512, top-10: a width
    that is no power of two), a tiny test model (8, top-2)."""
    rng = np.random.default_rng(T * E + k)
    x = jnp.asarray(rng.standard_normal((T, 64)), dtype)
    router = jnp.asarray(rng.standard_normal((E, 64)) * 0.5, dtype)
    routed = RoutedExperts("kernel")
    fused = jax.jit(lambda a, r: routed.route(a, r, k, normalize))
    assert "jtp_route_top_k" in str(fused.trace(x, router).jaxpr)
    weights, ids = fused(x, router)
    plain_weights, plain_ids = route_top_k(x, router, k, normalize)
    assert weights.shape == (T, k) and weights.dtype == dtype and ids.dtype == jnp.int32

    logits = np.asarray(jnp.dot(x, router.T).astype(jnp.float32))
    want_weights, want_ids = numpy_route(logits, k, normalize)
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(plain_ids))
    tol = 1e-2 if dtype == jnp.bfloat16 else 1e-6
    np.testing.assert_allclose(np.asarray(weights, np.float64), want_weights, rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(weights, np.float32), np.asarray(plain_weights, np.float32), rtol=tol, atol=1e-7)


def test_ties_go_to_the_lower_expert_as_in_lax_top_k():
    logits = jnp.zeros((2, 16), jnp.float32).at[0, 3].set(1.0).at[1, 9].set(-1.0)
    weights, ids = kernel.route_top_k(logits, 4, False, jnp.float32, interpret=True)
    want_weights, want_ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), 4)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_array_equal(np.asarray(ids), [[3, 0, 1, 2], [0, 1, 2, 3]])
    np.testing.assert_allclose(np.asarray(weights), np.asarray(want_weights), rtol=1e-6)


def test_which_steps_take_the_kernel():
    S = jax.ShapeDtypeStruct
    for T, E, impl, taken in ((1, 128, "kernel", True), (kernel.MAX_TOKENS + 1, 128, "kernel", False),
                              (4, 96, "kernel", False), (1, 128, "ragged_dot", False)):
        text = str(jax.make_jaxpr(lambda a, r: RoutedExperts(impl).route(a, r, 8, True))(
            S((T, 64), jnp.bfloat16), S((E, 64), jnp.bfloat16)))
        assert ("jtp_route_top_k" in text) == taken, (T, E, impl)


@pytest.mark.parametrize("E, k", [(128, 8), (512, 10)])
def test_lowers_to_triton_for_cuda(E, k):
    text = cuda_lowering(lambda a: kernel.route_top_k(a, k, True, jnp.bfloat16), jax.ShapeDtypeStruct((8, E), jnp.bfloat16))
    assert "triton" in text and "jtp_route_top_k" in text


@pytest.mark.parametrize("P, E", [(8, 128), (64, 128), (128, 16), (moe.SMALL_PAIRS + 8, 128), (512, 64)])
def test_grouping_pairs_matches_a_stable_sort(P, E):
    """Both paths (compare all pairs up to SMALL_PAIRS, sort past it) with repeated ids and padding
    pairs (id E: past every group)."""
    rng = np.random.default_rng(P + E)
    flat = rng.integers(0, min(E, max(2, P // 3)), P)
    flat[rng.random(P) < 0.2] = E
    order, inverse, counts = jax.jit(moe._group_pairs, static_argnums=1)(jnp.asarray(flat, jnp.int32), E)
    want = np.argsort(flat, kind="stable")
    np.testing.assert_array_equal(np.asarray(order), want)
    np.testing.assert_array_equal(np.asarray(inverse)[want], np.arange(P))
    np.testing.assert_array_equal(np.asarray(counts), np.bincount(flat, minlength=E + 1)[:E])


def test_under_tensor_parallelism():
    """tp=2: each device routes its copy of the (replicated) tokens inside shard_map."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jtp.parallel.sharding import make_mesh

    mesh = make_mesh(2)
    rng = np.random.default_rng(4)
    put = lambda a: jax.device_put(jnp.asarray(a, jnp.float32), NamedSharding(mesh, P()))  # noqa: E731
    x, router = put(rng.standard_normal((3, 32))), put(rng.standard_normal((16, 32)))
    f = jax.jit(lambda a, r: RoutedExperts("kernel", mesh).route(a, r, 4, True))
    assert "jtp_route_top_k" in str(f.trace(x, router).jaxpr)
    weights, ids = f(x, router)
    want_weights, want_ids = route_top_k(x, router, 4, True)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_allclose(np.asarray(weights), np.asarray(want_weights), rtol=1e-6, atol=1e-7)
