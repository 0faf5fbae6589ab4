"""Where each parameter comes from in a checkpoint: its global shape, the logical axis of each
of its dims, and how to read any rectangular slice of it.

A model family's `param_layout` maps every parameter path to one of these `Source`s; the loader
(`jtp.loading.weights`) shards it by its axes (jtp/parallel/rules.py) and asks it for exactly the
slice a device owns. Both import this module, so the families do not depend on the loader.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np


class TensorReader(Protocol):
    """What a Source reads from: named checkpoint tensors, any rectangular slice."""

    def read(self, name: str, index: tuple[slice, ...] = ()) -> np.ndarray: ...


class _Declared:
    """A Source names one logical axis per dim of its (our) shape."""

    def __post_init__(self):
        if len(self.axes) != len(self.shape) or not all(isinstance(a, str) for a in self.axes):
            first = next(iter(self.expected()))
            raise ValueError(
                f"{type(self).__name__} of {first!r}: axes {self.axes} must name one logical axis for each of "
                f"the {len(self.shape)} dims"
            )


def _bounds(index: tuple[slice, ...], shape: tuple[int, ...]) -> list[tuple[int, int]]:
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return [s.indices(n)[:2] for s, n in zip(index, shape)]


@dataclasses.dataclass(frozen=True)
class Tensor(_Declared):
    """A checkpoint tensor used as is."""

    name: str
    shape: tuple[int, ...]
    axes: tuple[str, ...]

    def expected(self) -> dict[str, tuple[int, ...]]:
        return {self.name: self.shape}

    def read(self, ckpt: TensorReader, index) -> np.ndarray:
        return ckpt.read(self.name, tuple(slice(a, b) for a, b in _bounds(index, self.shape)))


@dataclasses.dataclass(frozen=True)
class RepeatedHeads(_Declared):
    """A KV projection (weight [heads*D, H] or bias [heads*D]) with each head stored `replicas` times."""

    name: str
    source_shape: tuple[int, ...]
    head_dim: int
    replicas: int
    axes: tuple[str, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.source_shape[0] * self.replicas, *self.source_shape[1:])

    def expected(self):
        return {self.name: self.source_shape}

    def read(self, ckpt: TensorReader, index) -> np.ndarray:
        (r0, r1), *rest = _bounds(index, self.shape)
        rows = np.arange(r0, r1)
        head, offset = divmod(rows, self.head_dim)
        source_rows = (head // self.replicas) * self.head_dim + offset
        lo, hi = int(source_rows.min()), int(source_rows.max()) + 1
        block = ckpt.read(self.name, (slice(lo, hi), *(slice(a, b) for a, b in rest)))
        return block[source_rows - lo]


@dataclasses.dataclass(frozen=True)
class StackedExperts(_Declared):
    """Per-expert matrices [out, in] stacked and transposed to [E, in, out] for ragged_dot."""

    names: tuple[str, ...]
    source_shape: tuple[int, int]  # of one expert, HF layout [out, in]
    axes: tuple[str, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.names), self.source_shape[1], self.source_shape[0])

    def expected(self):
        return {n: self.source_shape for n in self.names}

    def read(self, ckpt: TensorReader, index) -> np.ndarray:
        (e0, e1), (i0, i1), (o0, o1) = _bounds(index, self.shape)
        return np.stack([ckpt.read(self.names[e], (slice(o0, o1), slice(i0, i1))).T for e in range(e0, e1)])


@dataclasses.dataclass(frozen=True)
class StridedRows(_Declared):
    """Rows of a fused checkpoint projection, taken in runs of `run` rows every `stride` rows.

    Our row j is source row (j // run) * stride + offset + j % run. With run == rows it is one
    contiguous segment (Qwen3.5's in_proj_qkv -> Q | K | V, conv1d likewise); with run = one
    key-head group's share it de-interleaves Qwen3-Next's per-group in_proj_qkvz / in_proj_ba.
    `squeeze` drops the singleton dim 1 of conv1d.weight [C, 1, K].
    """

    name: str
    source_shape: tuple[int, ...]
    rows: int
    run: int
    stride: int
    offset: int
    axes: tuple[str, ...]
    squeeze: bool = False

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.rows, *self.source_shape[2 if self.squeeze else 1 :])

    def expected(self):
        return {self.name: self.source_shape}

    def read(self, ckpt: TensorReader, index) -> np.ndarray:
        (r0, r1), *rest = _bounds(index, self.shape)
        tail = (slice(0, 1),) * self.squeeze + tuple(slice(a, b) for a, b in rest)
        parts, j = [], r0
        while j < r1:  # one read per run that the slice touches
            end = min(r1, (j // self.run + 1) * self.run)
            src = (j // self.run) * self.stride + self.offset + j % self.run
            parts.append(ckpt.read(self.name, (slice(src, src + end - j), *tail)))
            j = end
        block = np.concatenate(parts, axis=0)
        return block[:, 0] if self.squeeze else block


def Segment(
    name: str, source_shape: tuple[int, ...], offset: int, rows: int, axes: tuple[str, ...], squeeze: bool = False
) -> StridedRows:
    """Rows [offset, offset + rows) of a fused checkpoint tensor."""
    return StridedRows(name, source_shape, rows, rows, 0, offset, axes, squeeze)


@dataclasses.dataclass(frozen=True)
class FusedExperts(_Declared):
    """Rows [offset, offset + rows) of a fused expert tensor [E, out, in], as [E, in, rows] for ragged_dot.

    Qwen3.5-MoE stores gate_up_proj [E, 2I, H] (gate rows first) and down_proj [E, H, I] on disk.
    """

    name: str
    source_shape: tuple[int, int, int]
    offset: int
    rows: int
    axes: tuple[str, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.source_shape[0], self.source_shape[2], self.rows)

    def expected(self):
        return {self.name: self.source_shape}

    def read(self, ckpt: TensorReader, index) -> np.ndarray:
        (e0, e1), (i0, i1), (o0, o1) = _bounds(index, self.shape)
        rows = slice(self.offset + o0, self.offset + o1)
        return ckpt.read(self.name, (slice(e0, e1), rows, slice(i0, i1))).transpose(0, 2, 1)


@dataclasses.dataclass(frozen=True)
class FirstPresent:
    """Alternative checkpoint layouts of one parameter (e.g. fused vs per-expert MoE weights).

    `resolve_layout` picks the first option whose tensors the checkpoint has; unresolved, it
    behaves as the first option, so errors name the preferred layout. Every option is the same
    parameter: one shape, one set of axes.
    """

    options: tuple

    def __post_init__(self):
        if len({(o.shape, o.axes) for o in self.options}) != 1:
            raise ValueError(f"{self}: options differ in shape or axes")

    @property
    def shape(self) -> tuple[int, ...]:
        return self.options[0].shape

    @property
    def axes(self) -> tuple[str, ...]:
        return self.options[0].axes

    def expected(self):
        return self.options[0].expected()

    def read(self, ckpt: TensorReader, index) -> np.ndarray:
        return self.options[0].read(ckpt, index)

    def resolve(self, names: set[str]):
        for option in self.options:
            if option.expected().keys() <= names:
                return option
        return self.options[0]


Source = Tensor | RepeatedHeads | StackedExperts | StridedRows | FusedExperts | FirstPresent
