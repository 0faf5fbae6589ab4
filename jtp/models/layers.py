"""Building blocks shared by the model families: norms, RoPE, projections, MLP and MoE.

Weights keep the Hugging Face layout [out_features, in_features]; `linear` contracts the
input dim directly, so loading never transposes. A weight of an FP8 checkpoint is a `BlockFp8`
(its float8 values and per-block scales) wherever an array would be, one of an AWQ / GPTQ checkpoint
an `Int4Groups`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jtp.config.rope import Yarn
from jtp.kernels import fp8_matmul


class BlockFp8(NamedTuple):
    """A weight stored as float8_e4m3fn values [..., R, C] with one float32 scale per block of its
    last two dims, [..., R / br, C / bc] (Qwen's FP8 checkpoints: weight = values x scale). Blocks of
    one row (`per_channel`) are `--quantization fp8`'s linear weights."""

    values: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    def dequantize(self, dtype) -> jax.Array:
        *lead, rows, cols = self.values.shape
        br, bc = rows // self.scale.shape[-2], cols // self.scale.shape[-1]
        blocks = self.values.astype(jnp.float32).reshape(*lead, rows // br, br, cols // bc, bc)
        return (blocks * self.scale[..., :, None, :, None]).reshape(self.values.shape).astype(dtype)


class Fp8KernelWeight(BlockFp8):
    """A BlockFp8 of 128 x 128 blocks, or per channel, whose products with few rows (decode) run in
    the FP8 kernel (jtp/kernels/fp8_matmul.py), which reads its float8 bytes once; more rows
    (prefill) dequantize for cuBLAS, or per channel run W8A8. The runner makes these on a single GPU
    only: a pallas_call is opaque to XLA's partitioner."""


E4M3_MAX = 448.0  # float8_e4m3fn's largest finite value
W8A8_MIN_ROWS = fp8_matmul.GEMV_MAX_ROWS + 1  # per-channel FP8: from here on x is quantized too


def per_channel(weight) -> bool:
    """A float8 linear weight [N, K] with one scale per output channel (of each K group): scale [N, G]."""
    return isinstance(weight, (BlockFp8, FusedFp8KernelWeight)) and weight.values.ndim == 2 \
        and weight.scale.shape[0] == weight.values.shape[0]


def w8a8_matmul(x: jax.Array, values: jax.Array, scale: jax.Array) -> jax.Array:
    """x [M, K] @ (values [N, K] float8 x scale [N, G]).T with x quantized to float8 too, per row and
    K group (dynamic: the group's largest magnitude maps to 448): the product of two float8 operands
    (cuBLASLt's FP8 GEMM on Hopper, at up to 1.9x bf16's rate: docs/bench/h200-speed10.md), the row
    and channel scales applied to its output. -> [M, N] in x.dtype."""
    (M, K), (N, G) = x.shape, scale.shape
    xg = x.astype(jnp.float32).reshape(M, G, K // G)
    x_scale = jnp.maximum(jnp.max(jnp.abs(xg), axis=-1), 1e-30) / E4M3_MAX  # [M, G]
    xq = (xg / x_scale[..., None]).astype(jnp.float8_e4m3fn)
    out = jnp.bfloat16 if x.dtype == jnp.bfloat16 else jnp.float32
    if G == 1:
        y = jax.lax.dot_general(xq[:, 0], values, (((1,), (1,)), ((), ())), preferred_element_type=out)
        return (y.astype(jnp.float32) * x_scale * scale[:, 0]).astype(x.dtype)
    y = jnp.einsum("mgk,ngk->mgn", xq, values.reshape(N, G, K // G), preferred_element_type=out)
    return jnp.sum(y.astype(jnp.float32) * x_scale[..., None] * scale.T[None], axis=1).astype(x.dtype)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["values", "scale"], meta_fields=["sizes"])
@dataclasses.dataclass(frozen=True)
class FusedFp8KernelWeight:
    """Several Fp8KernelWeights that multiply the same input, concatenated along their outputs
    (`sizes` each): one kernel launch instead of one per projection."""

    values: jax.Array
    scale: jax.Array
    sizes: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    def dequantize(self, dtype) -> jax.Array:
        return BlockFp8(self.values, self.scale).dequantize(dtype)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["values"], meta_fields=["sizes"])
@dataclasses.dataclass(frozen=True)
class FusedWeight:
    """Plain weights that multiply the same input, concatenated along their outputs (`sizes` each):
    one GEMM instead of one per projection (a small one, such as k or v, reads below the copy rate)."""

    values: jax.Array
    sizes: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape


# Projections of one input that one device multiplies as one: each group's name in a layer is "+".join(group).
FUSED_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("shared_gate", "shared_up"),
                     # DeltaNet's six input projections, or, where their kinds differ (Qwen's FP8
                     # releases keep the small a and b in bf16), its q/k/v/z and its a/b apart
                     ("gdn_q", "gdn_k", "gdn_v", "gdn_z", "gdn_a", "gdn_b"), ("gdn_q", "gdn_k", "gdn_v", "gdn_z"),
                     ("gdn_a", "gdn_b"))


def fuse_projections(params: dict, fp8_kernel: bool) -> dict:
    """`params` for a single device: with `fp8_kernel`, each decoder-layer linear weight the FP8 kernels
    can serve becomes a Fp8KernelWeight; then each FUSED_PROJECTIONS group of plain weights, or of
    Fp8KernelWeights, is concatenated. Layers are replaced one at a time, so the unfused copies are
    freed as it goes. (Under tensor parallelism a concatenation of sharded weights would be resharded
    on every step, so the runner calls this on one device only.)"""
    def pick(w):
        if fp8_kernel and type(w) is BlockFp8 and w.values.ndim == 2 and fp8_matmul.supported(1, *w.shape) and (
                w.scale.shape == (w.shape[0], 1) or w.shape[0] // w.scale.shape[0] == w.shape[1] // w.scale.shape[1]
                == fp8_matmul.BLOCK):
            return Fp8KernelWeight(*w)
        return w

    def plain(w):
        return isinstance(w, jax.Array) and w.ndim == 2

    layers = params.get("layers", [])  # none: a pipeline stage that another process holds
    for i, layer in enumerate(layers):
        layer = {k: pick(w) for k, w in layer.items()}
        for group in FUSED_PROJECTIONS:
            parts = [layer.get(name) for name in group]
            if all(type(w) is Fp8KernelWeight for w in parts):
                layer["+".join(group)] = FusedFp8KernelWeight(
                    jnp.concatenate([w.values for w in parts]), jnp.concatenate([w.scale for w in parts]),
                    tuple(w.shape[0] for w in parts))
            elif all(plain(w) for w in parts) and len({(w.dtype, w.shape[1]) for w in parts}) == 1:
                layer["+".join(group)] = FusedWeight(jnp.concatenate(parts), tuple(w.shape[0] for w in parts))
            else:
                continue
            for name in group:
                del layer[name]
        layers[i] = layer
    return params


class Int4Groups(NamedTuple):
    """A weight stored as 4-bit integers with one zero and one scale per group (AWQ / GPTQ checkpoints):
    weight = (q - zero) x scale, in the layout the model reads (linear [out, in], experts [E, in, out]).

    words: int32 [..., n / 8], value 8j + k of the last dim in bits 4k..4k+3 of word j;
    zeros: int8 and scales: float16, the weight's shape with the grouped dim (its input dim)
    divided by the group size. The loader (jtp/loading/int4.py) repacks both checkpoint layouts
    into this one."""

    words: jax.Array
    zeros: jax.Array
    scales: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.words.shape[:-1], self.words.shape[-1] * 8)

    def dequantize(self, dtype) -> jax.Array:
        # >> on int32 copies the sign bit down; the mask keeps the 4 bits of each value.
        q = (self.words[..., None] >> jnp.arange(0, 32, 4, dtype=jnp.int32)) & 15
        # Each dim split into (groups, rows per group), zeros and scales broadcast over the rows.
        grouped = q.reshape(sum(((g, n // g) for g, n in zip(self.scales.shape, self.shape)), ()))
        per_group = tuple(x for _ in self.shape for x in (slice(None), None))
        # (q - zero) is exact in int32 and its product with a float16 scale exact in float32.
        w = (grouped - self.zeros.astype(jnp.int32)[per_group]).astype(jnp.float32) * \
            self.scales.astype(jnp.float32)[per_group]
        return w.reshape(self.shape).astype(dtype)


def dense(weight, dtype) -> jax.Array:
    """The weight as an array of `dtype` (dequantized when stored quantized)."""
    if isinstance(weight, FusedWeight):
        return weight.values
    return weight.dequantize(dtype) if isinstance(weight, (BlockFp8, FusedFp8KernelWeight, Int4Groups)) else weight


def linear(x: jax.Array, weight, bias: jax.Array | None = None) -> jax.Array:
    rows = math.prod(x.shape[:-1])
    if per_channel(weight) and rows >= W8A8_MIN_ROWS:
        y = w8a8_matmul(x.reshape(rows, -1), weight.values, weight.scale).reshape(*x.shape[:-1], -1)
    elif isinstance(weight, (Fp8KernelWeight, FusedFp8KernelWeight)) and fp8_matmul.supported(rows, *weight.shape):
        channels = per_channel(weight)  # (then scale [N, 1]: on one device)
        # Per channel, the unscaled product is ~448 / max|w| times the output: kept in fp32 until scaled.
        y = fp8_matmul.fp8_matmul(x.reshape(rows, -1), weight.values, None if channels else weight.scale,
                                  out_dtype=jnp.float32 if channels else None,
                                  interpret=jax.default_backend() != "gpu").reshape(*x.shape[:-1], -1)
        if channels:
            y = (y * weight.scale[:, 0]).astype(x.dtype)
    else:
        y = jnp.einsum("...i,oi->...o", x, dense(weight, x.dtype))
    return y if bias is None else y + bias


def project_columns(x: jax.Array, p: dict, *names: str) -> list[tuple[jax.Array, int, int]]:
    """Each name's product x @ p[name].T as (array, first column, columns): one product for each run
    of names the layer holds fused (FUSED_PROJECTIONS, the longest run first), its output left whole.
    A kernel that reads several parts takes the one array (a slice handed to a custom call is a
    copy). No biases."""
    out, i = [], 0
    while i < len(names):
        j = next((j for j in range(len(names), i + 1, -1) if "+".join(names[i:j]) in p), i + 1)
        weight = p["+".join(names[i:j])]
        y = linear(x, weight)
        sizes = weight.sizes if j > i + 1 else (y.shape[-1],)
        out += [(y, start - size, size) for start, size in zip(itertools.accumulate(sizes), sizes)]
        i = j
    return out


def take_columns(column: tuple[jax.Array, int, int]) -> jax.Array:
    """One (array, first column, columns) of `project_columns` as its own array."""
    y, first, size = column
    return y if size == y.shape[-1] else y[..., first : first + size]


def project(x: jax.Array, p: dict, *names: str) -> tuple[jax.Array, ...]:
    """linear(x, p[name], p[name's bias]) for each name, fused runs split afterwards
    (`project_columns`). A name "q_proj"'s bias is "q_bias"."""
    ys = [take_columns(column) for column in project_columns(x, p, *names)]
    return tuple(y if p.get(name.removesuffix("_proj") + "_bias") is None else y + p[name.removesuffix("_proj") + "_bias"]
                 for y, name in zip(ys, names))


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Qwen3 RMSNorm: statistics in fp32, cast back, then scale (HF's order of operations)."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def rope_cos_sin(
    positions: jax.Array, rotary_dim: int, theta: float, dtype, yarn: Yarn | None = None
) -> tuple[jax.Array, jax.Array]:
    """cos/sin [T, rotary_dim] for NeoX-style (half-split) rotation, computed in fp32; with YaRN,
    its frequencies and its attention factor on both (as transformers applies it)."""
    if yarn is None:
        inv_freq, scale = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim)), None
    else:
        inv_freq, scale = jnp.asarray(yarn_inv_freq(rotary_dim, theta, yarn)), yarn.attention_factor
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if scale is not None:
        cos, sin = cos * scale, sin * scale
    return cos.astype(dtype), sin.astype(dtype)


def mrope_axes(num_freqs: int, mrope_section: tuple[int, int, int]) -> np.ndarray:
    """Which position row (0 T, 1 H, 2 W) drives each rotary frequency under Qwen3.5's interleaved
    M-RoPE: frequency f follows H if f % 3 == 1 and f < 3 s_H, W if f % 3 == 2 and f < 3 s_W, else T
    (transformers' Qwen3_5TextRotaryEmbedding, which interleaves whatever `mrope_interleaved` says)."""
    f = np.arange(num_freqs)
    return np.where((f % 3 == 1) & (f < 3 * mrope_section[1]), 1,
                    np.where((f % 3 == 2) & (f < 3 * mrope_section[2]), 2, 0))


def mrope_cos_sin(
    positions: jax.Array, rotary_dim: int, theta: float, mrope_section: tuple[int, int, int], dtype
) -> tuple[jax.Array, jax.Array]:
    """`rope_cos_sin` for three position rows [3, T] (T, H, W; jtp.core.mrope): each frequency's
    angle uses its row (`mrope_axes`). Three equal rows give exactly `rope_cos_sin` of one."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    rows = jnp.asarray(positions).astype(jnp.float32)[mrope_axes(rotary_dim // 2, mrope_section)]  # [R/2, T]
    angles = rows.T * inv_freq[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def yarn_inv_freq(rotary_dim: int, theta: float, yarn: Yarn) -> np.ndarray:
    """YaRN's per-pair frequencies (float32, as transformers' _compute_yarn_parameters): high
    frequencies (many rotations within the original context) are kept, low ones divided by the
    factor, with a linear ramp between the dimensions of beta_fast and beta_slow rotations."""
    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times
        return rotary_dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    pos_freqs = np.float32(theta) ** (np.arange(0, rotary_dim, 2, dtype=np.float32) / np.float32(rotary_dim))
    extrapolated = np.float32(1) / pos_freqs
    interpolated = np.float32(1) / (np.float32(yarn.factor) * pos_freqs)
    ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    keep = np.float32(1) - ramp.astype(np.float32)
    return (interpolated * (1 - keep) + extrapolated * keep).astype(np.float32)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the first rotary_dim dims of x [T, heads, D]; the rest pass through."""
    rotary_dim = cos.shape[-1]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated_half = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    rot = rot * cos[:, None, :] + rotated_half * sin[:, None, :]
    return jnp.concatenate([rot, rest], axis=-1) if rest.shape[-1] else rot


def swiglu_mlp(x: jax.Array, p: dict, gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj") -> jax.Array:
    g, u = project(x, p, gate, up)
    return linear(jax.nn.silu(g) * u, p[down])


def route_top_k(x: jax.Array, router: jax.Array, top_k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """Softmax router in fp32, top-k of the probabilities, optional renormalisation."""
    probs = jax.nn.softmax(linear(x, router).astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights.astype(x.dtype), experts


def rms_norm_zero_centered(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Qwen3-Next / Qwen3.5 RMSNorm: the stored weight w is applied as (1 + w), in fp32, then cast."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def gated_rms_norm(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Gated DeltaNet output norm: plain (not zero-centred) RMSNorm over the last dim, times silu(gate)."""
    xf = x.astype(jnp.float32)
    normed = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    return ((weight * normed).astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)
