"""Qwen3.5's vision encoder: image patches -> embeddings that replace the image placeholder tokens.

    x = W_patch p + b                                    Conv3d with kernel = stride: one matmul per patch
    x += sum_k w_k E_pos[i_k]                            learned square grid, bilinearly resampled to the image's
    per block:  x += Proj(Attn(LN1(x)));  x += FC2(act(FC1(LN2(x))))
        Attn: fused qkv (with bias), 2-D RoPE (a patch's row on the first half of the rotated
        frequencies, its column on the second), softmax(q k^T / sqrt(d)) over the patches of its
        own image only (block-diagonal)
    merged = FC2(GELU(FC1(concat of LN(x) over each merge x merge block)))  -> [tokens, text hidden]

Patches arrive in merge-block order (jtp/engine/image_processor.py), so a token's merge^2
patches are consecutive rows. Qwen3.5 has no deepstack features (Qwen3-VL does); this matches
transformers' Qwen3_5VisionModel and Qwen3_5Model.get_image_features.

The per-patch bookkeeping (image id, row/column, position-embedding taps and weights) is host
numpy (`patch_layout`); the device part (`encode_patches`) is jitted per padded bucket of patch
counts: padding patches form an image of their own and their tokens are dropped. Parameters are
replicated (jtp/parallel/rules.py); the loader is jtp/loading/vision_weights.py.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jtp.config.vision_config import VisionConfig
from jtp.loading.sources import Source, Tensor
from jtp.models.layers import linear

LN_EPS = 1e-6  # HF's nn.LayerNorm(eps=1e-6) in every block and the merger
MIN_BUCKET = 64  # patches: the smallest padded batch


class PatchLayout(NamedTuple):
    """Per-patch host arrays of a padded batch of images (`patch_layout`)."""

    image: np.ndarray  # int32 [P] the image each patch belongs to (padding: one past the last)
    row_col: np.ndarray  # int32 [P, 2] the patch's row and column in its image (the 2-D RoPE positions)
    pos_index: np.ndarray  # int32 [P, 4] the four position-table entries it interpolates
    pos_weight: np.ndarray  # float32 [P, 4] their bilinear weights


# ----------------------------------------------------------------------------- host bookkeeping


def patch_bucket(num_patches: int, merge_unit: int) -> int:
    """The padded patch count a batch of `num_patches` runs at: a power of two (>= MIN_BUCKET)
    rounded up to whole image tokens, so few shapes compile."""
    size = max(MIN_BUCKET, 1 << max(0, num_patches - 1).bit_length())
    return -(-size // merge_unit) * merge_unit


def _axis_taps(index: np.ndarray, size: np.ndarray, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear taps (floor, floor + 1, clamped to the table) and weights along one axis, with
    align_corners: target 0 and size-1 map onto table entries 0 and side-1 (float32 as HF)."""
    src = index.astype(np.float32) * np.float32(side - 1) / np.maximum(size - 1, 1).astype(np.float32)
    floor = np.floor(src)
    offsets = np.arange(2)
    taps = np.clip(floor.astype(np.int64)[:, None] + offsets, 0, side - 1)
    weights = np.clip(1 - np.abs(src[:, None] - floor[:, None] - offsets), 0, None).astype(np.float32)
    return taps, weights


def patch_layout(cfg: VisionConfig, grid_thw: np.ndarray, num_patches: int | None = None) -> PatchLayout:
    """The per-patch arrays of images with these grids (t, h, w), padded to `num_patches`."""
    grid_thw = np.asarray(grid_thw, np.int64).reshape(-1, 3)
    m, side = cfg.spatial_merge_size, cfg.position_grid_side
    counts = grid_thw.prod(axis=1)
    total = int(counts.sum())
    num_patches = total if num_patches is None else num_patches
    if num_patches < total:
        raise ValueError(f"{total} patches do not fit a batch of {num_patches}")
    if np.any(grid_thw[:, 1:] % m):
        raise ValueError(f"image grids {grid_thw.tolist()} are not whole {m}x{m} merge blocks")
    image = np.repeat(np.arange(len(grid_thw)), counts)
    heights, widths = np.repeat(grid_thw[:, 1], counts), np.repeat(grid_thw[:, 2], counts)
    # Index within a frame's h*w patches (frames repeat), listed merge block by merge block.
    within = (np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)) % (heights * widths)
    block, in_block = divmod(within, m * m)
    block_row, block_col = divmod(block, widths // m)
    row, col = block_row * m + in_block // m, block_col * m + in_block % m
    h_taps, h_weights = _axis_taps(row, heights, side)
    w_taps, w_weights = _axis_taps(col, widths, side)
    pos_index = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    pos_weight = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)

    pad = num_patches - total
    return PatchLayout(
        image=np.concatenate([image, np.full(pad, len(grid_thw))]).astype(np.int32),
        row_col=np.concatenate([np.stack([row, col], 1), np.zeros((pad, 2), np.int64)]).astype(np.int32),
        pos_index=np.concatenate([pos_index, np.zeros((pad, 4), np.int64)]).astype(np.int32),
        pos_weight=np.concatenate([pos_weight, np.zeros((pad, 4), np.float32)]).astype(np.float32),
    )


# ----------------------------------------------------------------------------- the encoder


def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array, eps: float = LN_EPS) -> jax.Array:
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps) * weight.astype(jnp.float32) + bias.astype(jnp.float32)
    return y.astype(x.dtype)


def activation(name: str, x: jax.Array) -> jax.Array:
    if name == "gelu_pytorch_tanh":
        return jax.nn.gelu(x, approximate=True)
    if name == "gelu":
        return jax.nn.gelu(x, approximate=False)
    if name == "quick_gelu":
        return x * jax.nn.sigmoid(1.702 * x)
    return jax.nn.silu(x)


def rope_2d(row_col: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """float32 cos/sin [P, head_dim]: head_dim/4 frequencies over the row, as many over the column,
    the pair repeated for NeoX half-split rotation of the whole head."""
    quarter = head_dim // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(0, quarter, 2, dtype=jnp.float32) / quarter))
    angles = row_col.astype(jnp.float32)[:, :, None] * inv_freq  # [P, 2, head_dim / 4]
    angles = angles.reshape(angles.shape[0], -1)  # [row freqs | col freqs]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [P, heads, d] rotated in float32 and cast back (as HF's apply_rotary_pos_emb_vision)."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).astype(x.dtype)


@functools.partial(jax.jit, static_argnames=("cfg",))
def vision_block(p: dict, x: jax.Array, cos: jax.Array, sin: jax.Array, same_image: jax.Array, *,
                 cfg: VisionConfig) -> jax.Array:
    """x += Proj(Attn(LN1(x)));  x += FC2(act(FC1(LN2(x)))). same_image: bool [P, P]."""
    P, heads, d = x.shape[0], cfg.num_heads, cfg.head_dim
    qkv = linear(layer_norm(x, p["norm1"], p["norm1_bias"]), p["qkv"], p["qkv_bias"]).reshape(P, 3, heads, d)
    q, k, v = _rotate(qkv[:, 0], cos, sin), _rotate(qkv[:, 1], cos, sin), qkv[:, 2]
    scores = jnp.einsum("qhd,khd->hqk", q, k, preferred_element_type=jnp.float32) * d**-0.5
    probs = jax.nn.softmax(jnp.where(same_image[None], scores, -jnp.inf), axis=-1).astype(v.dtype)
    o = jnp.einsum("hqk,khd->qhd", probs, v).reshape(P, heads * d)
    x = x + linear(o, p["proj"], p["proj_bias"])
    h = activation(cfg.hidden_act, linear(layer_norm(x, p["norm2"], p["norm2_bias"]), p["fc1"], p["fc1_bias"]))
    return x + linear(h, p["fc2"], p["fc2_bias"])


@functools.partial(jax.jit, static_argnames=("cfg",))
def encode_patches(params: dict, pixel_values: jax.Array, layout: PatchLayout, *, cfg: VisionConfig) -> jax.Array:
    """Padded patches [P, C T p p] and their `PatchLayout` -> merged embeddings [P / merge^2, out_hidden]
    in the parameters' dtype (the padding's tokens included)."""
    dtype = params["pos_embed"].dtype
    x = linear(pixel_values.astype(dtype), params["patch_embed"].reshape(cfg.hidden_size, -1), params["patch_bias"])
    taps = params["pos_embed"][layout.pos_index]  # [P, 4, hidden]
    pos = jnp.sum(taps.astype(jnp.float32) * layout.pos_weight[..., None], axis=1)
    x = x + pos.astype(dtype)
    cos, sin = rope_2d(layout.row_col, cfg.head_dim, cfg.rope_theta)
    same_image = layout.image[:, None] == layout.image[None, :]
    for block in params["blocks"]:
        x = vision_block(block, x, cos, sin, same_image, cfg=cfg)
    m = params["merger"]
    merged = layer_norm(x, m["norm"], m["norm_bias"]).reshape(-1, cfg.hidden_size * cfg.merge_unit)
    return linear(jax.nn.gelu(linear(merged, m["fc1"], m["fc1_bias"]), approximate=False), m["fc2"], m["fc2_bias"])


def encode_images(params: dict, cfg: VisionConfig, pixel_values: np.ndarray, grid_thw: np.ndarray,
                  num_patches: int | None = None) -> jax.Array:
    """Preprocessed images (jtp/engine/image_processor.py: pixel_values [patches, C T p p], grid_thw
    [images, 3]) -> their image-token embeddings [tokens, out_hidden], image after image, in the
    order of the placeholders. Runs padded to `num_patches` (default `patch_bucket`)."""
    pixel_values = np.asarray(pixel_values)
    total = pixel_values.shape[0]
    if pixel_values.ndim != 2 or pixel_values.shape[1] != cfg.patch_dim:
        raise ValueError(f"pixel_values {pixel_values.shape}: expected [patches, {cfg.patch_dim}]")
    if total != int(np.asarray(grid_thw).reshape(-1, 3).prod(axis=1).sum()):
        raise ValueError(f"{total} patches but grid_thw {np.asarray(grid_thw).tolist()} describes another count")
    num_patches = patch_bucket(total, cfg.merge_unit) if num_patches is None else num_patches
    if num_patches % cfg.merge_unit:
        raise ValueError(f"a batch of {num_patches} patches is not whole image tokens of {cfg.merge_unit}")
    layout = patch_layout(cfg, grid_thw, num_patches)
    padded = np.zeros((num_patches, cfg.patch_dim), np.float32)
    padded[:total] = pixel_values
    return encode_patches(params, padded, layout, cfg=cfg)[: total // cfg.merge_unit]


# ----------------------------------------------------------------------------- parameters

_BLOCK = {  # our name -> (checkpoint name under blocks.N., shape, axes) as functions of the config
    "norm1": ("norm1.weight", lambda c: (c.hidden_size,), ("vision_embed",)),
    "norm1_bias": ("norm1.bias", lambda c: (c.hidden_size,), ("vision_embed",)),
    "qkv": ("attn.qkv.weight", lambda c: (3 * c.hidden_size, c.hidden_size), ("vision_qkv", "vision_embed")),
    "qkv_bias": ("attn.qkv.bias", lambda c: (3 * c.hidden_size,), ("vision_qkv",)),
    "proj": ("attn.proj.weight", lambda c: (c.hidden_size, c.hidden_size), ("vision_embed", "vision_qkv")),
    "proj_bias": ("attn.proj.bias", lambda c: (c.hidden_size,), ("vision_embed",)),
    "norm2": ("norm2.weight", lambda c: (c.hidden_size,), ("vision_embed",)),
    "norm2_bias": ("norm2.bias", lambda c: (c.hidden_size,), ("vision_embed",)),
    "fc1": ("mlp.linear_fc1.weight", lambda c: (c.intermediate_size, c.hidden_size), ("vision_mlp", "vision_embed")),
    "fc1_bias": ("mlp.linear_fc1.bias", lambda c: (c.intermediate_size,), ("vision_mlp",)),
    "fc2": ("mlp.linear_fc2.weight", lambda c: (c.hidden_size, c.intermediate_size), ("vision_embed", "vision_mlp")),
    "fc2_bias": ("mlp.linear_fc2.bias", lambda c: (c.hidden_size,), ("vision_embed",)),
}


def param_layout(cfg: VisionConfig) -> dict[str, Source]:
    """Parameter path ("blocks.0.qkv", "merger.fc1") -> its tensor under the checkpoint's model.visual.*."""
    v, H, M = cfg.checkpoint_prefix, cfg.hidden_size, cfg.hidden_size * cfg.merge_unit
    layout: dict[str, Source] = {
        "patch_embed": Tensor(v + "patch_embed.proj.weight",
                              (H, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size),
                              ("vision_embed", "patch_channels", "patch_frames", "patch_pixels", "patch_pixels")),
        "patch_bias": Tensor(v + "patch_embed.proj.bias", (H,), ("vision_embed",)),
        "pos_embed": Tensor(v + "pos_embed.weight", (cfg.num_position_embeddings, H), ("vision_positions", "vision_embed")),
        "merger.norm": Tensor(v + "merger.norm.weight", (H,), ("vision_embed",)),
        "merger.norm_bias": Tensor(v + "merger.norm.bias", (H,), ("vision_embed",)),
        "merger.fc1": Tensor(v + "merger.linear_fc1.weight", (M, M), ("vision_merged", "vision_merged")),
        "merger.fc1_bias": Tensor(v + "merger.linear_fc1.bias", (M,), ("vision_merged",)),
        "merger.fc2": Tensor(v + "merger.linear_fc2.weight", (cfg.out_hidden_size, M), ("embed", "vision_merged")),
        "merger.fc2_bias": Tensor(v + "merger.linear_fc2.bias", (cfg.out_hidden_size,), ("embed",)),
    }
    for i in range(cfg.depth):
        for name, (hf, shape, axes) in _BLOCK.items():
            layout[f"blocks.{i}.{name}"] = Tensor(f"{v}blocks.{i}.{hf}", shape(cfg), axes)
    return layout


def unflatten(flat: dict[str, jax.Array], depth: int) -> dict:
    """"blocks.3.qkv" -> tree["blocks"][3]["qkv"]; "merger.fc1" -> tree["merger"]["fc1"]."""
    tree: dict = {"blocks": [{} for _ in range(depth)], "merger": {}}
    for path, value in flat.items():
        if path.startswith("blocks."):
            _, i, name = path.split(".", 2)
            tree["blocks"][int(i)][name] = value
        elif path.startswith("merger."):
            tree["merger"][path.split(".", 1)[1]] = value
        else:
            tree[path] = value
    return tree
