"""How often bf16 rounding alone changes a token's top-k experts: random routers at the real shapes
(N(0, 0.02) weights as scripts/make_random_checkpoint.py writes them, or 10x that), unit-RMS hidden
states, router logits computed from bf16 inputs and rounded to bf16 (the activation dtype, as jtp
and transformers both do) against the same in float32. numpy only:

    python scripts/router_flips.py
"""
import ml_dtypes
import numpy as np

bf = ml_dtypes.bfloat16
rng = np.random.default_rng(0)
def flips(E, k, H, n=4000, std=0.02, wscale=1.0):
    W = (rng.standard_normal((E, H)) * std * wscale).astype(np.float32)
    x = rng.standard_normal((n, H)).astype(np.float32)  # post-norm hidden: RMS 1
    ref = x @ W.T
    # bf16: inputs rounded, product accumulated in f32, logits rounded to bf16 (activation dtype)
    lb = (x.astype(bf).astype(np.float32) @ W.astype(bf).astype(np.float32).T).astype(bf).astype(np.float32)
    top_ref = np.argsort(-ref, 1)[:, :k]; top_b = np.argsort(-lb, 1)[:, :k]
    diff = np.array([len(set(a) ^ set(b)) > 0 for a, b in zip(top_ref, top_b)])
    srt = -np.sort(-ref, 1)
    gap = srt[:, k-1] - srt[:, k]
    return diff.mean(), np.median(gap), np.median(np.abs(ref[:, 0]))
for E,k in [(128,8),(256,8),(512,10)]:
    for ws in (1.0, 10.0):
        f, g, m = flips(E, k, 2048, wscale=ws)
        print(f"E={E} k={k} router std x{ws}: top-k set differs from f32 for {100*f:.1f}% of tokens per layer; median k-th gap {g:.3f}, |logit| {m:.2f}")
