"""The fused layer kernels on this device against the plain (XLA) path: the residual add + RMSNorm
(jtp/kernels/add_rms_norm.py) and a DeltaNet layer's decode token (conv, gates and recurrence:
jtp/kernels/delta_rule_step.py), at real shapes, without loading a model. Prints, per case, the largest difference from the plain path and
microseconds per call of each (calls chained from the host, so small ones include the dispatch).

    python3 scripts/fused_kernels_check.py [--json OUT.json]     # Qwen3-8B / Qwen3.5-9B shapes
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from types import SimpleNamespace


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
    from jtp.models.delta_rule import fused_decode
    from jtp.models.qwen3 import add_rms_norm
    from jtp.models.deltanet_rows import RowLayout
    from jtp.models.qwen3_5 import DeltaNetState, deltanet_mixer

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
    Hk = H // 2 if H % 2 == 0 else H  # two value heads per key head, as Qwen3.5-9B's 32 on 16
    cfg = SimpleNamespace(linear_num_key_heads=Hk, linear_num_value_heads=H, linear_key_head_dim=D,
                          linear_value_head_dim=D)
    for B in map(int, args.rows.split(",")):
        normal = lambda *shape, dtype=jnp.bfloat16: jnp.asarray(rng.standard_normal(shape), dtype)  # noqa: E731
        q, k, v, a, b = normal(B, Hk * D), normal(B, Hk * D), normal(B, H * D), normal(B, H), normal(B, H)
        channels = (Hk * D, Hk * D, H * D)
        convs = tuple(normal(c, 4) * 0.5 for c in channels)
        a_log, dt_bias = normal(H, dtype=jnp.float32), normal(H)
        slots = 2 * B + 1
        states = (*(normal(slots, c, 3) for c in channels), normal(slots, H, D, D, dtype=jnp.float32))
        read, write = jnp.arange(B, dtype=jnp.int32), jnp.arange(B, dtype=jnp.int32) + B
        fresh, token, valid = jnp.zeros(B, bool).at[0].set(True), jnp.arange(B, dtype=jnp.int32), jnp.ones(B, bool)

        def kernel_step(states, q, k, v, a, b):
            columns = [(x, 0, x.shape[1]) for x in (q, k, v, a, b)]
            o, conv_states, pool = fused_decode(columns, convs, states[:3], a_log, dt_bias, states[3],
                                                (token, valid, read, fresh, write), impls["kernel"])
            return o, (*conv_states, pool)

        def xla_step(states, q, k, v, a, b):
            rows = RowLayout(token[:, None], valid[:, None], fresh, read, write, token, jnp.zeros(B, jnp.int32))
            params = dict(gdn_conv_q=convs[0], gdn_conv_k=convs[1], gdn_conv_v=convs[2], gdn_A_log=a_log,
                          gdn_dt_bias=dt_bias)
            o, state = deltanet_mixer(params, cfg, q, k, v, a, b, DeltaNetState(*states), rows, 64)
            return o[:, 0], tuple(state)

        steps = {"kernel": kernel_step, "xla": xla_step}
        outs = {name: jax.jit(f)(states, q, k, v, a, b) for name, f in steps.items()}
        case = {"max_diff": max(float(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32)).max())
                                for x, y in zip(jax.tree.leaves(outs["kernel"]), jax.tree.leaves(outs["xla"])))}
        for name, f in steps.items():  # the states donated and fed back, as in a step: updated in place
            chained = jax.jit(lambda s, *a, f=f: f(s, *a)[1], donate_argnums=0)
            case[f"{name}_us"] = chained_us(chained, (jax.tree.map(lambda x: x + 0, states), q, k, v, a, b), feed=0)
        report["cases"][f"DeltaNet decode token, {B} rows x {H} heads x {D} x {D}"] = case

    for name, case in report["cases"].items():
        print(f"{name}: {case}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
