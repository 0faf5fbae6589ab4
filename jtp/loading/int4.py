"""int4 weight-only checkpoints at load (AWQ, GPTQ): where each quantized weight's words, zeros and
scales come from, read into `Int4Groups` in the layout the model reads.

A linear module X of such a checkpoint has no X.weight [out, in]; it has (G input rows per group):

  awq   X.qweight I32 [in, out/8]  8 values along the output dim, AutoAWQ's nibble order
        X.qzeros  I32 [in/G, out/8] packed the same way; X.scales F16 [in/G, out]
  gptq  X.qweight I32 [in/8, out]  8 values along the input dim, in order
        X.qzeros  I32 [in/G, out/8] in order, storing zero - 1; X.scales F16 [in/G, out];
        X.g_idx   I32 [in], the group of each input row (served: arange(in) // G only)

`Int4Reader` presents those tensors as the family's Sources expect a weight: X.qweight as the
values q [out, in], X.qzeros and X.scales as [out, in/G] (zeros with GPTQ's 1 added back), each
unpacked from only the words a slice touches. So every way a family reads a weight (as is, KV
heads repeated, experts stacked and transposed, rows of a fused projection) reads the values,
zeros and scales of exactly the device's own slice, and `Packed` packs the values again, 8 to an
int32 along the model's last dim, so the devices hold 4 bits per weight. A tp split that falls
inside a group or inside a packed word is an error naming the tensor and the split.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jtp.config.quantization import Quantization
from jtp.errors import CheckpointError
from jtp.loading.quantized import block_source
from jtp.loading.sources import Source, TensorReader

PACK = 8  # 4-bit values per int32 word
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble k of an AWQ word holds output column 8j + AWQ_ORDER[k]
IN_ORDER = tuple(range(PACK))
SHIFTS = np.arange(0, 32, 4, dtype=np.uint32)


def quantized_name(weight: str, suffix: str) -> str:
    return weight[: -len("weight")] + suffix


def weight_names(names: set[str]) -> set[str]:
    """The checkpoint's names with X.weight standing in for each int4 module X, so the family's
    alternative layouts (FirstPresent) resolve as for a float checkpoint."""
    return names | {n[: -len("qweight")] + "weight" for n in names if n.endswith(".qweight")}


@dataclasses.dataclass(frozen=True)
class Packed:
    """A Source of 4-bit values as int32 words, 8 consecutive values of its last dim to a word."""

    values: Source

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.values.shape[:-1], self.values.shape[-1] // PACK)

    @property
    def axes(self) -> tuple[str, ...]:
        return self.values.axes

    def read(self, reader: TensorReader, index) -> np.ndarray:
        index = tuple(index) + (slice(None),) * (len(self.shape) - len(index))
        w0, w1 = index[-1].indices(self.shape[-1])[:2]
        values = self.values.read(reader, (*index[:-1], slice(w0 * PACK, w1 * PACK)))
        nibbles = values.astype(np.uint32).reshape(*values.shape[:-1], -1, PACK) << SHIFTS
        return np.bitwise_or.reduce(nibbles, axis=-1).view(np.int32)


@dataclasses.dataclass(frozen=True)
class Int4Weight:
    """Where one int4 parameter comes from: values (q, the model's layout), words (values packed),
    zeros and scales (the values' Source in group units), and the checkpoint tensors it reads,
    name -> (shape, dtypes, what they must be)."""

    values: Source
    words: Packed
    zeros: Source
    scales: Source
    tensors: dict[str, tuple[tuple[int, ...], frozenset[str], str]]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def group_shape(self) -> tuple[int, ...]:
        """The rows of each dim that share one zero and scale (G along the input dim, else 1)."""
        return tuple(n // g for n, g in zip(self.values.shape, self.scales.shape))


def int4_weights(layout: dict[str, Source], names: set[str], quantization: Quantization) -> dict[str, Int4Weight]:
    """Parameter path -> its Int4Weight, for every weight the checkpoint stores as int4 groups."""
    out = {}
    for path, source in layout.items():
        weights = list(source.expected()) if hasattr(source, "expected") else []
        if not weights or not all(w.endswith(".weight") for w in weights):
            continue
        present = [quantized_name(w, "qweight") in names for w in weights]
        if not any(present):
            continue  # kept in full precision (embeddings, norms, a router, modules_to_not_convert)
        if not all(present):
            missing = next(w for w, p in zip(weights, present) if not p)
            raise CheckpointError(f"{missing!r} has no qweight beside it, but the other tensors it is read with "
                                  f"do: an {quantization.method} checkpoint quantizes all of them or none")
        out[path] = _int4_weight(source, quantization)
    return out


def _int4_weight(source: Source, quantization: Quantization) -> Int4Weight:
    G, method = quantization.group_size, quantization.method

    def renamed(suffix: str, block: tuple[int, int]) -> Source:
        return block_source(source, block, lambda w: quantized_name(w, suffix), f"{method} group")

    tensors = {}
    for weight, (out_dim, in_dim) in source.expected().items():
        if in_dim % G or out_dim % PACK:
            raise CheckpointError(f"{weight!r} [{out_dim}, {in_dim}] cannot be stored in {method} groups of {G}: "
                                  f"its input dim must divide into groups and its output dim into words of {PACK}")
        int32 = "I32", "int4 words are int32"
        tensors[quantized_name(weight, "qweight")] = (
            ((in_dim, out_dim // PACK) if method == "awq" else (in_dim // PACK, out_dim)), *int32)
        tensors[quantized_name(weight, "qzeros")] = ((in_dim // G, out_dim // PACK), *int32)
        tensors[quantized_name(weight, "scales")] = ((in_dim // G, out_dim), "F16", "int4 scales are float16")
        if method == "gptq":
            tensors[quantized_name(weight, "g_idx")] = ((in_dim,), "I32", "GPTQ's g_idx is int32")
    tensors = {name: (shape, frozenset({dtype}), why) for name, (shape, dtype, why) in tensors.items()}
    values = renamed("qweight", (1, 1))
    if values.shape[-1] % PACK:
        raise CheckpointError(f"{next(iter(tensors))!r}: jtp packs 8 values of the last dim of its layout "
                              f"{list(values.shape)} to a word, which {values.shape[-1]} does not divide into")
    return Int4Weight(values, Packed(values), renamed("qzeros", (1, G)), renamed("scales", (1, G)), tensors)


def check_g_idx(ckpt, weights: dict[str, Int4Weight], group_size: int) -> None:
    """GPTQ: every g_idx must be the groups of consecutive input rows (act-order ones are refused)."""
    for weight in weights.values():
        for name, (shape, _, _) in weight.tensors.items():
            if name.endswith(".g_idx") and not np.array_equal(ckpt.read(name), np.arange(shape[0]) // group_size):
                raise CheckpointError(
                    f"{name!r} is not arange({shape[0]}) // {group_size}: GPTQ's act-order groups (desc_act true) "
                    "are not served; jtp loads GPTQ whose groups are consecutive input rows (desc_act false)")


def check_split(weight: Int4Weight, shard: tuple[int, ...]) -> None:
    """Each device's shard (of the weight's logical shape) must hold whole groups and whole words."""
    qweight = next(iter(weight.tensors))
    for n, s, g in zip(weight.shape, shard, weight.group_shape):
        if s % g:
            raise CheckpointError(f"{qweight!r}: tp={n // s} splits a dim of {n} into shards of {s}, inside its "
                                  f"int4 groups of {g} rows; serve it at a tp whose shards hold whole groups")
    if shard[-1] % PACK:
        raise CheckpointError(f"{qweight!r}: tp={weight.shape[-1] // shard[-1]} splits a dim of {weight.shape[-1]} "
                              f"into shards of {shard[-1]}, inside the int32 words that pack {PACK} of its values")


class Int4Reader:
    """The checkpoint, with each int4 module's X.qweight read as its values [out, in] and X.qzeros,
    X.scales as [out, in / G] (the orientation of HF's X.weight); other tensors as they are."""

    def __init__(self, ckpt, method: str):
        self.ckpt, self.method = ckpt, method
        self.order = AWQ_ORDER if method == "awq" else IN_ORDER

    def read(self, name: str, index: tuple[slice, ...] = ()) -> np.ndarray:
        kind = name.rpartition(".")[2]
        if kind not in ("qweight", "qzeros", "scales"):
            return self.ckpt.read(name, index)
        stored = self.ckpt.shape(name)
        packed_in = kind == "qweight" and self.method == "gptq"
        rows = stored[1] * (PACK if kind != "scales" and not packed_in else 1)  # output columns
        cols = stored[0] * (PACK if packed_in else 1)  # input rows (or groups)
        index = tuple(index) + (slice(None),) * (2 - len(index))
        (o0, o1), (i0, i1) = index[0].indices(rows)[:2], index[1].indices(cols)[:2]
        if kind == "scales":
            return self.ckpt.read(name, (slice(i0, i1), slice(o0, o1))).T
        if packed_in:  # GPTQ's qweight [in/8, out]: the words of input rows [i0, i1)
            words = self.ckpt.read(name, (slice(i0 // PACK, -(-i1 // PACK)), slice(o0, o1))).T
            return _unpack(words, IN_ORDER)[:, i0 % PACK: i0 % PACK + i1 - i0]
        words = self.ckpt.read(name, (slice(i0, i1), slice(o0 // PACK, -(-o1 // PACK))))
        values = _unpack(words, self.order)[:, o0 % PACK: o0 % PACK + o1 - o0].T
        return values + 1 if kind == "qzeros" and self.method == "gptq" else values  # GPTQ v1 stores zero - 1


def _unpack(words: np.ndarray, order: tuple[int, ...]) -> np.ndarray:
    """int32 [..., n] -> int8 [..., 8n]: value 8j + order[k] from bits 4k..4k+3 of word j."""
    nibbles = (words.view(np.uint32)[..., None] >> SHIFTS) & np.uint32(15)
    return nibbles[..., np.argsort(order)].reshape(*words.shape[:-1], -1).astype(np.int8)
