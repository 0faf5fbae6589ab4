"""The fused residual add + RMSNorm kernel (interpreted off-GPU) against numpy and the plain path.

Through the engine's step it runs in tests/test_hf_parity.py::test_gpu_kernels_match_hf (every
Qwen3 layer's two norms, against HF)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cpu_env import cuda_lowering

from jtp.kernels import add_rms_norm as fused
from jtp.models.attention import PagedAttention
from jtp.models.qwen3 import add_rms_norm


@pytest.mark.parametrize("T, hidden, dtype, zero_centered", [
    (1, 4096, jnp.bfloat16, False), (3, 2560, jnp.float32, False), (5, 64, jnp.bfloat16, False),
    (2, 5120, jnp.float32, False), (1, 4096, jnp.bfloat16, True), (3, 2048, jnp.float32, True)])
def test_kernel_matches_numpy_and_the_plain_path(T, hidden, dtype, zero_centered):
    """Qwen3's norm (weight x) and the hybrids' zero-centred one ((1 + weight) x)."""
    rng = np.random.default_rng(hidden + T)
    x, delta = (jnp.asarray(rng.standard_normal((T, hidden)) * 3, dtype) for _ in range(2))
    weight = jnp.asarray(rng.standard_normal(hidden), dtype)
    fused_norm = jax.jit(lambda *a: add_rms_norm(*a, 1e-6, PagedAttention("kernel"), zero_centered))
    assert "jtp_add_rms_norm" in str(fused_norm.trace(x, delta, weight).jaxpr)
    h, y = fused_norm(x, delta, weight)
    plain_h, plain_y = add_rms_norm(x, delta, weight, 1e-6, PagedAttention("reference"), zero_centered)

    want_h = np.asarray(x, np.float64) + np.asarray(delta, np.float64)
    scale = np.asarray(weight, np.float64) + (1 if zero_centered else 0)
    want_y = want_h / np.sqrt(np.mean(want_h**2, axis=-1, keepdims=True) + 1e-6) * scale
    f64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)  # noqa: E731
    tol = dict(rtol=2e-2, atol=5e-2) if dtype == jnp.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(f64(h), want_h, **tol)
    np.testing.assert_allclose(f64(y), want_y, **tol)
    # The plain path rounds at the same points: h equal, y within one rounding of the product.
    np.testing.assert_array_equal(f64(h), f64(plain_h))
    np.testing.assert_allclose(f64(y), f64(plain_y), rtol=1e-2 if dtype == jnp.bfloat16 else 1e-6, atol=1e-6)


def test_which_sizes_and_steps_take_the_kernel():
    """Powers of two, or a few equal power-of-two slices (Qwen3-4B's 2560, 14B's 5120); few tokens."""
    assert [fused.pieces(h) for h in (1024, 2560, 4096, 5120, 8192, 3000)] == [1, 5, 1, 5, 2, 0]
    assert fused.supported(fused.MAX_TOKENS, 4096) and not fused.supported(fused.MAX_TOKENS + 1, 4096)
    S = jax.ShapeDtypeStruct
    for T, impl, taken in ((1, "kernel", True), (fused.MAX_TOKENS + 1, "kernel", False), (1, "reference", False)):
        x = S((T, 4096), jnp.bfloat16)
        text = str(jax.make_jaxpr(lambda a, b, w: add_rms_norm(a, b, w, 1e-6, PagedAttention(impl)))(
            x, x, S((4096,), jnp.bfloat16)))
        assert ("jtp_add_rms_norm" in text) == taken, (T, impl)


@pytest.mark.parametrize("hidden, zero_centered", [(4096, False), (5120, False), (4096, True)])
def test_lowers_to_triton_for_cuda(hidden, zero_centered):
    S = jax.ShapeDtypeStruct
    x = S((4, hidden), jnp.bfloat16)
    text = cuda_lowering(lambda a, b, w: fused.add_rms_norm(a, b, w, eps=1e-6, zero_centered=zero_centered), x, x,
                         S((hidden,), jnp.bfloat16))
    assert "triton" in text and "jtp_add_rms_norm" in text


def test_under_tensor_parallelism():
    """tp=2: the activations are replicated; the kernel runs on each device's copy inside shard_map."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jtp.parallel.sharding import make_mesh

    mesh = make_mesh(2)
    rng = np.random.default_rng(2)
    put = lambda a: jax.device_put(jnp.asarray(a, jnp.float32), NamedSharding(mesh, P()))  # noqa: E731
    x, delta, weight = put(rng.standard_normal((3, 256))), put(rng.standard_normal((3, 256))), put(rng.random(256))
    f = jax.jit(lambda *a: add_rms_norm(*a, 1e-6, PagedAttention("kernel", mesh)))
    assert "jtp_add_rms_norm" in str(f.trace(x, delta, weight).jaxpr)
    for got, want in zip(f(x, delta, weight), add_rms_norm(x, delta, weight, 1e-6, PagedAttention("reference"))):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_fused_kernels_check_script(tmp_path):
    """scripts/fused_kernels_check.py (the GPU check of the fused layer kernels) at tiny shapes: every
    case within a rounding of the plain path."""
    import json

    from scripts_loader import load_script

    out = tmp_path / "check.json"
    assert load_script("fused_kernels_check").main(
        ["--hidden", "256", "--tokens", "1,3", "--heads", "2", "--head-dim", "32", "--rows", "1,3", "--calls", "1",
         "--json", str(out)]) == 0
    cases = json.loads(out.read_text())["cases"]
    assert len(cases) == 4 and all(c["max_diff"] <= 1 / 32 and c["kernel_us"] > 0 for c in cases.values()), cases
