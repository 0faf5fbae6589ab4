"""Where an FP8 checkpoint's block scales come from: for each quantized linear weight, a `Source` of
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

from jtp.config.quantization import Quantization
from jtp.errors import CheckpointError
from jtp.loading.sources import FusedExperts, RepeatedHeads, Source, StackedExperts, StridedRows, Tensor

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
    br, bc = block

    def blocks(n: int, b: int, what: str) -> int:
        if n % b:
            raise CheckpointError(f"{weights[0]!r}: {what} ({n}) does not fall on the FP8 block boundaries "
                                  f"({b}); jtp serves weights whose rows and columns split into whole blocks")
        return n // b

    if isinstance(source, Tensor) and len(source.shape) == 2:
        rows, cols = source.shape
        return Tensor(scale_name(source.name), (blocks(rows, br, "its rows"), blocks(cols, bc, "its columns")),
                      source.axes)
    if isinstance(source, RepeatedHeads):
        rows, cols = source.source_shape
        return dataclasses.replace(
            source, name=scale_name(source.name), head_dim=blocks(source.head_dim, br, "a KV head's rows"),
            source_shape=(blocks(rows, br, "its rows"), blocks(cols, bc, "its columns")))
    if isinstance(source, StackedExperts):
        rows, cols = source.source_shape
        return StackedExperts(tuple(scale_name(n) for n in source.names),
                              (blocks(rows, br, "its rows"), blocks(cols, bc, "its columns")), source.axes)
    if isinstance(source, StridedRows) and len(source.source_shape) == 2 and not source.squeeze:
        rows, cols = source.source_shape
        return dataclasses.replace(
            source, name=scale_name(source.name),
            source_shape=(blocks(rows, br, "its rows"), blocks(cols, bc, "its columns")),
            rows=blocks(source.rows, br, "a segment's rows"), run=blocks(source.run, br, "a head group's rows"),
            stride=blocks(source.stride, br, "a head group's stride") if source.stride else 0,
            offset=blocks(source.offset, br, "a segment's first row"))
    if isinstance(source, FusedExperts):
        experts, rows, cols = source.source_shape
        return dataclasses.replace(
            source, name=scale_name(source.name),
            source_shape=(experts, blocks(rows, br, "its rows"), blocks(cols, bc, "its columns")),
            offset=blocks(source.offset, br, "a segment's first row"), rows=blocks(source.rows, br, "a segment's rows"))
    raise CheckpointError(f"{weights[0]!r} has FP8 block scales, but jtp reads it in a way it cannot split "
                          f"into blocks ({type(source).__name__})")
