"""Accuracy of the chunked rule's per-chunk products at each precision against float64 numpy-free HIGHEST."""
import os, jax, jax.numpy as jnp, numpy as np
from jtp.models.delta_rule import chunked_gated_delta_rule
rng = np.random.default_rng(0)
B, L, H, dk, dv, C = 2, 512, 4, 128, 128, 64
def nrm(x): return x / np.linalg.norm(x, axis=-1, keepdims=True)
q = jnp.asarray(nrm(rng.standard_normal((B, L, H, dk))), jnp.float32)
k = jnp.asarray(nrm(rng.standard_normal((B, L, H, dk))), jnp.float32)
v = jnp.asarray(rng.standard_normal((B, L, H, dv)), jnp.float32)
g = jnp.asarray(-rng.random((B, L, H)) * 0.5, jnp.float32)
beta = jnp.asarray(rng.random((B, L, H)), jnp.float32)
state = jnp.asarray(rng.standard_normal((B, H, dk, dv)) * 0.1, jnp.float32)
rl = jnp.asarray([L, L - 37], jnp.int32)
outs = {}
for name, prec in (("highest", jax.lax.Precision.HIGHEST), ("tf32x3", jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3),
                   ("bf16x3", jax.lax.Precision.HIGH), ("default", jax.lax.Precision.DEFAULT)):
    try:
        f = jax.jit(lambda *a: chunked_gated_delta_rule(*a, chunk=C, row_lens=rl, max_tokens=2 * L, kernel=True, precision=prec)[:2])
        o, s = f(q, k, v, g, beta, state)
        outs[name] = (np.asarray(o), np.asarray(s))
    except Exception as e:
        print(name, "failed:", type(e).__name__, str(e)[:300])
ref = outs["highest"]
for name, (o, s) in outs.items():
    print(f"{name}: max|o-ref|/max|ref| {np.abs(o-ref[0]).max()/np.abs(ref[0]).max():.2e}  state {np.abs(s-ref[1]).max()/np.abs(ref[1]).max():.2e}")
