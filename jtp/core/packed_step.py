"""A step's host arrays packed into two flat buffers: what the jitted step takes, and what the
leader sends each follower.

Every array a step needs (`StepPlan`'s, the sampling columns, stop ids, the penalty history) sits
at a static offset of one int32 buffer or one float32 buffer. The offsets depend only on the
step's `StepLayout` (its bucket shape and what it carries), which is a static argument of the
jitted step: the step slices its arrays back out of the buffers, and the call transfers two
arrays instead of two dozen. The compiled shapes are the buckets' as before; the layout adds no
variant a `StepInput` would not have had.

The int buffer ends with the sampling part (`SamplingLayout`: the rows' slots, sampling columns,
stop ids, step count, penalty history and logit-bias ids, token masks), which depends on the rows
alone: the runner's forward program reads the buffer up to the penalty history, and its sampling
program (one per rows bucket and sampling variant, shared by every token bucket) reads that tail.

Wire format (`PackedStep.encode` / `decode`): magic, version, a length-prefixed JSON header (the
layout), then the two buffers' raw bytes. No pickle, nothing executable. Imports numpy only.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import struct
from typing import NamedTuple

import numpy as np

from jtp.core.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS
from jtp.core.step_input import (
    STOP_IDS_WIDTH,
    SamplingBatch,
    SamplingFlags,
    StepInput,
    StepPlan,
    pack_stop_ids,
)

# Names of the plan's, then the sampling batch's, arrays in each buffer.
# seq_slots opens the sampling part: the sampling program updates the sampled-token buffer with it.
_PLAN_INTS = ("token_ids", "positions", "slot_mapping", "token_rows", "block_tables", "context_lens",
              "row_starts", "row_lens", "state_reads", "state_writes", "state_keeps", "logits_indices", "seq_slots")
_SAMPLING_INTS = ("top_k", "seed", "step", "logprobs")
_SAMPLING_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
NO_FLAGS = SamplingFlags(needs_top_k_p_min_p=False, needs_penalties=False, num_logprobs=0)  # the forward program's


class StepLayout(NamedTuple):
    """The static facts of a packed step (hashable: the jitted step's static argument)."""

    num_tokens: int  # T
    num_rows: int  # B
    max_blocks: int  # M: block-table width
    max_row_len: int | None  # the tokens-per-row bucket (None: T)
    verify_positions: int  # 1 + k in a speculative verify step ([1 + k, B] logits indices), else 0
    penalty_len: int  # L of the [B, L] penalty history (which brings [B, MAX_LOGIT_BIAS] logit biases), 0: none
    flags: SamplingFlags
    mask_words: int = 0  # W of the [B, W] token mask (flags.needs_mask), 0 without one
    # An engine of a model that takes images: every step carries each token's M-RoPE positions
    # [3, T] and its row of the image-embedding pool [T] (-1: a token's own embedding).
    multimodal: bool = False

    def shapes(self) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
        return _shapes(self)

    def offsets(self) -> tuple[dict[str, tuple[int, tuple[int, ...]]], dict[str, tuple[int, tuple[int, ...]]], int, int]:
        """(int fields, float fields) as name -> (offset, shape), and the two buffers' lengths."""
        return _offsets(self)

    def views(self, ints, floats=None) -> dict:
        """Every field as a view (numpy) or slice (traced) of the two buffers (of `ints` alone
        without `floats`; `ints` may stop at the penalty history when there is none to read)."""
        int_fields, float_fields, _, _ = self.offsets()
        return _views(((ints, int_fields), (floats, float_fields)))

    @property
    def sampling(self) -> "SamplingLayout":
        return SamplingLayout(self.num_rows, self.verify_positions, self.penalty_len, self.flags, self.mask_words)

    @property
    def forward(self) -> "StepLayout":
        """The layout the forward program compiles for: the sampling variant is not its business."""
        return self._replace(penalty_len=0, flags=NO_FLAGS, mask_words=0)

    def sampling_start(self) -> int:
        """Where the sampling part (`SamplingLayout`) begins in the int buffer."""
        return self.offsets()[0]["seq_slots"][0]


class SamplingLayout(NamedTuple):
    """The static facts of a step's sampling part: the tail of its int buffer, and its float buffer."""

    num_rows: int
    verify_positions: int
    penalty_len: int
    flags: SamplingFlags
    mask_words: int = 0

    def views(self, tail, floats) -> dict:
        ints, float_fields = _sampling_shapes(self.num_rows, self.penalty_len, self.mask_words)
        return _views(((tail, _fields(ints)[0]), (floats, _fields(float_fields)[0])))


def _views(buffers) -> dict:
    out = {}
    for buf, fields in buffers:
        if buf is None:
            continue
        for name, (start, shape) in fields.items():
            out[name] = buf[start : start + _size(shape)].reshape(shape)
    return out


def _fields(shapes: dict) -> tuple[dict[str, tuple[int, tuple[int, ...]]], int]:
    fields, cursor = {}, 0
    for name, shape in shapes.items():
        fields[name] = (cursor, shape)
        cursor += _size(shape)
    return fields, cursor


def _size(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@functools.cache
def _sampling_shapes(B: int, penalty_len: int, mask_words: int = 0):
    ints = {"seq_slots": (B,), **{name: (B,) for name in _SAMPLING_INTS}, "stop_ids": (B, STOP_IDS_WIDTH),
            "num_steps": (1,)}
    floats = {name: (B,) for name in _SAMPLING_FLOATS}
    if penalty_len:  # last: the forward program's buffer stops before it
        ints["penalty_ids"] = ints["penalty_is_output"] = (B, penalty_len)
        ints["logit_bias_ids"] = (B, MAX_LOGIT_BIAS)
        floats["logit_bias"] = (B, MAX_LOGIT_BIAS)
    if mask_words:
        ints["token_mask"] = (B, mask_words)
    return ints, floats


@functools.cache
def _shapes(layout: StepLayout):
    T, B, M = layout.num_tokens, layout.num_rows, layout.max_blocks
    ints = {name: (T,) for name in _PLAN_INTS[:4]}
    ints["block_tables"] = (B, M)
    ints.update({name: (B,) for name in _PLAN_INTS[5:11]})
    ints["logits_indices"] = (layout.verify_positions, B) if layout.verify_positions else (B,)
    if layout.multimodal:
        ints["rope_positions"], ints["image_rows"] = (3, T), (T,)
    sampling_ints, floats = _sampling_shapes(B, layout.penalty_len, layout.mask_words)
    return {**ints, **sampling_ints}, floats


@functools.cache
def _offsets(layout: StepLayout):
    (int_fields, n_int), (float_fields, n_float) = (_fields(shapes) for shapes in _shapes(layout))
    return int_fields, float_fields, n_int, n_float


def compiled_flags(flags: SamplingFlags) -> SamplingFlags:
    """The sampling variant a step with these needs compiles as: any top-n request rounded up to
    MAX_LOGPROBS with truncation on (one variant instead of forty), and so does a token mask beside
    truncation (a masked step whose rows neither truncate nor ask for logprobs, greedy structured
    outputs, keeps the mask alone: the truncation's sort is most of a sampling program's time); with
    penalties, every option on, the mask included (one variant per history length instead of eight).
    Truncation with top_k 0, top_p 1 and min_p 0 keeps every token, and so does a mask of ones, so a
    row samples the same tokens in every variant; the rarer steps pay for the options they did not
    ask for, and warm-up has fewer programs to compile."""
    if flags.needs_penalties:
        return SamplingFlags(needs_top_k_p_min_p=True, needs_penalties=True, num_logprobs=MAX_LOGPROBS,
                             needs_mask=True)
    if flags.num_logprobs or (flags.needs_mask and flags.needs_top_k_p_min_p):
        return SamplingFlags(needs_top_k_p_min_p=True, needs_penalties=False, num_logprobs=MAX_LOGPROBS,
                             needs_mask=flags.needs_mask)
    return flags


@dataclasses.dataclass
class PackedStep:
    layout: StepLayout
    ints: np.ndarray  # i32[n]
    floats: np.ndarray  # f32[m]
    # i32[2, P] or None: the prompt positions this step scores (`StepInput.prompt_targets`); a program of
    # its own reads them, so they stay out of the buffers (whose layouts they would multiply).
    prompt_targets: np.ndarray | None = None

    MAGIC = b"JTPP"
    # 2: the sampling part (seq_slots first) at the end of the int buffer; 3: token masks; 4: logit biases;
    # 5: prompt targets; 6: multimodal layouts
    VERSION = 6

    @classmethod
    def empty(cls, layout: StepLayout) -> "PackedStep":
        _, _, n_int, n_float = layout.offsets()
        return cls(layout, np.zeros(n_int, np.int32), np.zeros(n_float, np.float32))

    def fields(self) -> dict[str, np.ndarray]:
        return self.layout.views(self.ints, self.floats)

    @property
    def num_steps(self) -> int:
        int_fields = self.layout.offsets()[0]
        return int(self.ints[int_fields["num_steps"][0]])

    @classmethod
    def from_step_input(cls, step: StepInput, multimodal: bool = False) -> "PackedStep":
        """Pack an explicit `StepInput` (warm-up, tests, tools); `multimodal`: in the layout of a model
        that takes images, its tokens text (M-RoPE rows all `positions`, no image rows)."""
        plan, sampling, penalty = step.plan, step.sampling, step.penalty_tokens
        if step.logit_bias is not None and penalty is None:
            raise ValueError("a logit bias rides the penalty history's sampling variant: give penalty_tokens too")
        li = plan.logits_indices
        masked = step.token_mask is not None
        # (without a mask, a penalised step's variant has none; the engine's always has one)
        flags = compiled_flags(sampling.static_flags()._replace(needs_mask=masked))._replace(needs_mask=masked)
        layout = StepLayout(
            len(plan.token_ids), *plan.block_tables.shape, plan.max_row_len, li.shape[0] if li.ndim == 2 else 0,
            penalty[0].shape[1] if penalty is not None else 0, flags,
            step.token_mask.shape[1] if step.token_mask is not None else 0, multimodal,
        )
        packed = cls.empty(layout)
        f = packed.fields()
        for name in _PLAN_INTS:
            f[name][...] = getattr(plan, name)
        if multimodal:
            f["rope_positions"][...], f["image_rows"][...] = plan.positions, -1
        for name in _SAMPLING_INTS + _SAMPLING_FLOATS:
            value = np.asarray(getattr(sampling, name))
            f[name][...] = value.view(np.int32) if value.dtype == np.uint32 else value
        B = layout.num_rows
        f["stop_ids"][...] = step.stop_ids if step.stop_ids is not None else pack_stop_ids([], B)
        f["num_steps"][0] = plan.num_steps
        if penalty is not None:
            f["penalty_ids"][...], f["penalty_is_output"][...] = penalty
            f["logit_bias_ids"][...], f["logit_bias"][...] = (step.logit_bias if step.logit_bias is not None
                                                              else (-1, 0.0))
        if step.token_mask is not None:
            f["token_mask"][...] = step.token_mask
        packed.prompt_targets = step.prompt_targets
        return packed

    def to_step_input(self) -> StepInput:
        """The explicit arrays again (copies): what tests and tools inspect."""
        f = {k: np.array(v) for k, v in self.fields().items()}
        plan = StepPlan(**{name: f[name] for name in _PLAN_INTS}, max_row_len=self.layout.max_row_len,
                        num_steps=int(f["num_steps"][0]))
        sampling = SamplingBatch(**{name: f[name] for name in _SAMPLING_INTS + _SAMPLING_FLOATS})
        sampling = sampling._replace(seed=sampling.seed.view(np.uint32))
        penalty = (f["penalty_ids"], f["penalty_is_output"].astype(bool)) if self.layout.penalty_len else None
        logit_bias = (f["logit_bias_ids"], f["logit_bias"]) if self.layout.penalty_len else None
        targets = None if self.prompt_targets is None else np.array(self.prompt_targets)
        return StepInput(plan, sampling, penalty, f["stop_ids"], f.get("token_mask"), logit_bias, targets)

    def encode(self) -> bytes:
        targets = self.prompt_targets if self.prompt_targets is not None else np.zeros((2, 0), np.int32)
        header = json.dumps({"layout": [*self.layout[:6], list(self.layout.flags), self.layout.mask_words,
                                        self.layout.multimodal],
                             "prompt_positions": targets.shape[1]}).encode()
        return b"".join([self.MAGIC, struct.pack("<HI", self.VERSION, len(header)), header,
                         np.ascontiguousarray(self.ints, np.int32).tobytes(),
                         np.ascontiguousarray(self.floats, np.float32).tobytes(),
                         np.ascontiguousarray(targets, np.int32).tobytes()])

    @classmethod
    def decode(cls, data: bytes | memoryview) -> "PackedStep":
        data = memoryview(data)
        if bytes(data[:4]) != cls.MAGIC:
            raise ValueError("not a jtp packed step (bad magic)")
        version, length = struct.unpack_from("<HI", data, 4)
        if version != cls.VERSION:
            raise ValueError(f"packed step version {version}, this jtp reads {cls.VERSION}")
        header = json.loads(bytes(data[10 : 10 + length]))
        fields, positions = header["layout"], int(header["prompt_positions"])
        flags = fields[6]
        layout = StepLayout(*(int(x) if x is not None else None for x in fields[:6]),
                            SamplingFlags(bool(flags[0]), bool(flags[1]), int(flags[2]), bool(flags[3])),
                            int(fields[7]), bool(fields[8]))
        _, _, n_int, n_float = layout.offsets()
        start, n_targets = 10 + length, 2 * positions
        if len(data) != start + 4 * (n_int + n_float + n_targets):
            raise ValueError(f"packed step of {len(data)} bytes, its layout needs "
                             f"{start + 4 * (n_int + n_float + n_targets)}")
        ints = np.frombuffer(data[start : start + 4 * n_int], np.int32).copy()
        start += 4 * n_int
        floats = np.frombuffer(data[start : start + 4 * n_float], np.float32).copy()
        start += 4 * n_float
        targets = np.frombuffer(data[start:], np.int32).reshape(2, positions).copy() if positions else None
        return cls(layout, ints, floats, targets)
