"""The fused layer kernels on this device against the plain (XLA) path: the residual add + RMSNorm
(jtp/kernels/add_rms_norm.py) and the DeltaNet decode step (jtp/kernels/delta_rule_step.py), at real
shapes, without loading a model. Prints, per case, the largest difference from the plain path and
microseconds per call of each (calls chained from the host, so small ones include the dispatch).

    python3 scripts/fused_kernels_check.py [--json OUT.json]     # Qwen3-8B / Qwen3.5-9B shapes
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--tokens", default="1,64")
    ap.add_argument("--heads", type=int, default=32, help="DeltaNet value heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jtp.models.attention import PagedAttention
    from jtp.models.delta_rule import decode_step
    from jtp.models.qwen3 import add_rms_norm

    impls = {"kernel": PagedAttention("kernel"), "xla": PagedAttention("reference")}
    rng = np.random.default_rng(0)
    report = {"device": str(jax.devices()[0]), "cases": {}}

    def chained_us(f, call_args, feed=None):
        """Microseconds per call; `feed` (an index): each call's output is the next call's argument there."""
        out = jax.block_until_ready(f(*call_args))
        start = time.perf_counter()
        for _ in range(args.calls):
            if feed is not None:
                call_args = (*call_args[:feed], out, *call_args[feed + 1:])
            out = f(*call_args)
        jax.block_until_ready(out)
        return round((time.perf_counter() - start) / args.calls * 1e6, 1)

    for T in map(int, args.tokens.split(",")):
        x, delta = (jnp.asarray(rng.standard_normal((T, args.hidden)), jnp.bfloat16) for _ in range(2))
        weight = jnp.asarray(rng.standard_normal(args.hidden), jnp.bfloat16)
        fns = {name: jax.jit(lambda *a, impl=impl: add_rms_norm(*a, 1e-6, impl)) for name, impl in impls.items()}
        outs = {name: f(x, delta, weight) for name, f in fns.items()}
        report["cases"][f"add + RMSNorm, {T} x {args.hidden} bf16"] = {
            "max_diff": max(float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max())
                            for a, b in zip(outs["kernel"], outs["xla"])),
            **{f"{name}_us": chained_us(f, (x, delta, weight)) for name, f in fns.items()},
        }

    H, D = args.heads, args.head_dim
    for B in map(int, args.rows.split(",")):
        normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
        unit = lambda a: a / jnp.linalg.norm(a, axis=-1, keepdims=True)  # noqa: E731
        q, k, v = unit(normal(B, H, D)), unit(normal(B, H, D)), normal(B, H, D)
        g, beta = -jnp.abs(normal(B, H)), jax.nn.sigmoid(normal(B, H))
        pool = normal(2 * B + 1, H, D, D)
        read, write = jnp.arange(B, dtype=jnp.int32), jnp.arange(B, dtype=jnp.int32) + B
        fresh = jnp.zeros(B, bool).at[0].set(True)
        step_args = (q, k, v, g, beta, pool, read, fresh, write)
        outs = {name: jax.jit(lambda *a, impl=impl: decode_step(*a, impl))(*step_args) for name, impl in impls.items()}
        case = {"max_diff": max(float(jnp.abs(a - b).max()) for a, b in zip(outs["kernel"], outs["xla"]))}
        for name, impl in impls.items():  # the pool donated and fed back, as in a step: updated in place
            f = jax.jit(lambda *a, impl=impl: decode_step(*a, impl)[1], donate_argnums=5)
            case[f"{name}_us"] = chained_us(f, (*step_args[:5], pool + 0, *step_args[6:]), feed=5)
        report["cases"][f"DeltaNet decode step, {B} rows x {H} heads x {D} x {D} fp32"] = case

    for name, case in report["cases"].items():
        print(f"{name}: {case}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
