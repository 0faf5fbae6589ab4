"""FP8 weights at load: where an FP8 checkpoint's block scales come from, and `quantize_params`
(`--quantization fp8`: a full-precision model quantized on its devices).

Where the block scales come from: for each quantized linear weight, a `Source` of
its `weight_scale_inv` tensors laid out as the weight is, one entry per block.

Qwen's FP8 checkpoints store a linear weight X.weight [out, in] as float8_e4m3fn and beside it
X.weight_scale_inv float32 [out / br, in / bc] (weight = values x scale, block by block). Every way
a family reads a weight (as is, KV heads repeated, experts stacked, rows of a fused projection)
reads the scales the same way in block units, so each device gets the scales of exactly its own
blocks. A weight whose rows or segments do not fall on block boundaries cannot be served from
its blocks: that is an error naming the tensor, not a silent approximation.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jtp.config.quantization import Quantization
from jtp.errors import CheckpointError
from jtp.loading.sources import FusedExperts, RepeatedHeads, Source, StackedExperts, StridedRows, Tensor
from jtp.models.layers import E4M3_MAX, BlockFp8, Int4Groups

SCALE_SUFFIX = "weight_scale_inv"


def block_scales(layout: dict[str, Source], names: set[str], quantization: Quantization) -> dict[str, Source]:
    """Parameter path -> the Source of its block scales, for every weight the checkpoint stores in FP8."""
    out = {}
    for path, source in layout.items():
        scale = _scale_source(source, quantization.block, names)
        if scale is not None:
            out[path] = scale
    return out


def scale_name(weight: str) -> str:
    return weight[: -len("weight")] + SCALE_SUFFIX


def _scale_source(source: Source, block: tuple[int, int], names: set[str]) -> Source | None:
    weights = list(source.expected()) if hasattr(source, "expected") else []
    if not weights or not all(w.endswith(".weight") for w in weights):
        return None
    present = [scale_name(w) in names for w in weights]
    if not any(present):
        return None  # kept in full precision (embeddings, norms, a router, modules_to_not_convert)
    if not all(present):
        missing = next(w for w, p in zip(weights, present) if not p)
        raise CheckpointError(f"{missing!r} has no {SCALE_SUFFIX} beside it, but the other tensors it is read "
                              f"with do: an FP8 checkpoint quantizes all of them or none")
    return block_source(source, block, scale_name, "FP8 block")


def block_source(source: Source, block: tuple[int, int], name_of, label: str) -> Source:
    """`source` read in units of `block` (rows, columns of the HF [out, in] weight) from the tensors
    `name_of(weight name)`: one entry per block, split and repeated as the weight is. `label` names
    the blocks in the error for a weight that does not fall on their boundaries."""
    br, bc = block
    first = next(iter(source.expected()))

    def blocks(n: int, b: int, what: str) -> int:
        if n % b:
            raise CheckpointError(f"{first!r}: {what} ({n}) does not fall on the {label} boundaries "
                                  f"({b}); jtp serves weights whose rows and columns split into whole blocks")
        return n // b

    if isinstance(source, Tensor) and len(source.shape) == 2:
        rows, cols = source.shape
        return Tensor(name_of(source.name), (blocks(rows, br, "its rows"), blocks(cols, bc, "its columns")),
                      source.axes)
    if isinstance(source, RepeatedHeads):
        rows, cols = source.source_shape
        return dataclasses.replace(
            source, name=name_of(source.name), head_dim=blocks(source.head_dim, br, "a KV head's rows"),
            source_shape=(blocks(rows, br, "its rows"), blocks(cols, bc, "its columns")))
    if isinstance(source, StackedExperts):
        rows, cols = source.source_shape
        return StackedExperts(tuple(name_of(n) for n in source.names),
                              (blocks(rows, br, "its rows"), blocks(cols, bc, "its columns")), source.axes)
    if isinstance(source, StridedRows) and len(source.source_shape) == 2 and not source.squeeze:
        rows, cols = source.source_shape
        return dataclasses.replace(
            source, name=name_of(source.name),
            source_shape=(blocks(rows, br, "its rows"), blocks(cols, bc, "its columns")),
            rows=blocks(source.rows, br, "a segment's rows"), run=blocks(source.run, br, "a head group's rows"),
            stride=blocks(source.stride, br, "a head group's stride") if source.stride else 0,
            offset=blocks(source.offset, br, "a segment's first row"))
    if isinstance(source, FusedExperts):
        experts, rows, cols = source.source_shape
        return dataclasses.replace(
            source, name=name_of(source.name),
            source_shape=(experts, blocks(rows, br, "its rows"), blocks(cols, bc, "its columns")),
            offset=blocks(source.offset, br, "a segment's first row"), rows=blocks(source.rows, br, "a segment's rows"))
    raise CheckpointError(f"{first!r} is stored in {label}s, but jtp reads it in a way it cannot split "
                          f"into blocks ({type(source).__name__})")


# ----------------------------------------------------------------------------- quantizing at load

FP8_BLOCK = (128, 128)  # Qwen's block size: `--quantization fp8`'s expert stacks
MIN_CHANNELS = 128  # `--quantization fp8` leaves narrower linear weights as they are
# The linear weights of a decoder layer that FP8 checkpoints quantize (never the router, the shared
# expert's gate, convolutions, norms, embeddings or the LM head).
QUANTIZED_WEIGHTS = frozenset({
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    "experts_gate", "experts_up", "experts_down", "shared_gate", "shared_up", "shared_down",
    "gdn_q", "gdn_k", "gdn_v", "gdn_z", "gdn_a", "gdn_b", "gdn_out",
})


def quantize_params(params: dict, block: tuple[int, int] | None = None) -> dict:
    """The decoder layers' linear weights in FP8, each quantized on its devices in its own sharding,
    the full-precision copies freed as they go. Random weights of an FP8 config: the config's
    blocks. `--quantization fp8` (block None): a linear weight [N, K] gets one scale per output channel
    of each device's K shard (blocks of 1 x K / shards), so its products with more than a few rows run
    as W8A8 FP8 GEMMs (`layers.w8a8_matmul`); expert stacks get 128 x 128 blocks (the grouped kernel's
    format). A weight whose shards do not split into whole blocks (a narrow split), or a linear weight
    of fewer than MIN_CHANNELS outputs (DeltaNet's a and b, which feed its gates and which Qwen's FP8
    releases keep in bf16), stays as it is."""
    layers = []
    for layer in params["layers"]:
        new = dict(layer)
        for name, weight in layer.items():
            if name not in QUANTIZED_WEIGHTS or not isinstance(weight, jax.Array) or weight.ndim < 2:
                continue  # already quantized (FP8, int4), or a vector
            blocks = block or (FP8_BLOCK if weight.ndim > 2 else (1, weight.sharding.shard_shape(weight.shape)[-1]))
            if _splits_into_blocks(weight, blocks) and (block or weight.ndim > 2 or weight.shape[0] >= MIN_CHANNELS):
                new[name] = _quantizer(weight.shape, weight.dtype, weight.sharding, blocks)(weight)
                weight.delete()
        layers.append(new)
    return {**params, "layers": layers}


def random_int4_params(params: dict, group_size: int, seed: int = 0) -> dict:
    """Random weights of an AWQ / GPTQ config (`--load-format dummy`): the decoder layers' linear
    weights as `Int4Groups` of uniform 4-bit values, zero 8 and one scale that gives N(0, 0.02)'s
    spread, drawn on their devices in their own sharding (groups along the input dim: a linear's
    last, an expert stack's middle). A weight whose shards hold no whole groups and words stays as
    drawn. The full-precision draws are freed as they go."""
    layers = []
    for i, layer in enumerate(params["layers"]):
        new = dict(layer)
        for name, weight in layer.items():
            if name in QUANTIZED_WEIGHTS and isinstance(weight, jax.Array) and weight.ndim >= 2:
                grouped = -1 if weight.ndim == 2 else -2  # the input dim
                shard = weight.sharding.shard_shape(weight.shape)
                if shard[-1] % 8 == 0 and shard[grouped] % group_size == 0:
                    key = jax.random.fold_in(jax.random.key(seed), i * 64 + sorted(QUANTIZED_WEIGHTS).index(name))
                    new[name] = _int4_drawer(weight.shape, weight.sharding, group_size, grouped)(key)
                    weight.delete()
        layers.append(new)
    return {**params, "layers": layers}


@functools.cache
def _int4_drawer(shape: tuple[int, ...], sharding, group_size: int, grouped: int):
    words_shape = (*shape[:-1], shape[-1] // 8)
    groups_shape = tuple(n // group_size if d == len(shape) + grouped else n for d, n in enumerate(shape))

    def draw(key) -> Int4Groups:
        words = jax.lax.bitcast_convert_type(jax.random.bits(key, words_shape, jnp.uint32), jnp.int32)
        # (q - 8) is uniform on -8..7 (standard deviation ~4.6): this scale makes it ~0.02.
        return Int4Groups(words, jnp.full(groups_shape, 8, jnp.int8), jnp.full(groups_shape, 0.02 / 4.6, jnp.float16))

    return jax.jit(draw, out_shardings=Int4Groups(sharding, sharding, sharding))


def _splits_into_blocks(weight: jax.Array, block: tuple[int, int]) -> bool:
    shard = weight.sharding.shard_shape(weight.shape)
    return shard[-2] % block[0] == 0 and shard[-1] % block[1] == 0


@functools.cache
def _quantizer(shape: tuple[int, ...], dtype, sharding, block: tuple[int, int]):
    br, bc = block

    def quantize(weight: jax.Array) -> BlockFp8:
        *lead, rows, cols = weight.shape
        blocks = weight.astype(jnp.float32).reshape(*lead, rows // br, br, cols // bc, bc)
        scale = jnp.maximum(jnp.max(jnp.abs(blocks), axis=(-3, -1)), 1e-12) / E4M3_MAX
        values = jnp.clip(blocks / scale[..., :, None, :, None], -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
        return BlockFp8(values.reshape(weight.shape), scale)

    return jax.jit(quantize, out_shardings=BlockFp8(sharding, sharding))
