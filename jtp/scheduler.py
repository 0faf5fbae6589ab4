"""Continuous-batching scheduler: which tokens of which requests run in the next step.

Each step has a token budget (`max_num_batched_tokens`) and at most `max_num_seqs` rows.
A row feeds a request's not-yet-computed tokens: one token for a request that is decoding,
a chunk of the prompt for one that is prefilling. Order of service, every step:

  1. every decoding request gets its one token (decode is never starved by a long prompt);
  2. requests part-way through their prompt get chunks from what is left of the budget;
  3. waiting requests are admitted first-come-first-served while their worst case
     (prompt + max_tokens, in KV blocks) can be reserved and a row is free.

Because the budget exceeds `max_num_seqs`, step 2/3 always get tokens: prompts are never
starved by decode. Admission reserves the worst case, so an admitted request always runs
to completion and the queue always drains.

The result is a plain-numpy `StepPlan` padded to bucket sizes (see `Buckets`).
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections import deque

import numpy as np

from jtp.page_pool import PagePool
from jtp.runner import StepPlan
from jtp.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Request:
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    stop_ids: frozenset[int]  # eos (unless ignore_eos) + stop_token_ids
    output_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V (and recurrent state) are in the cache
    pending: int = 0  # tokens sampled by a dispatched step that the host has not seen yet
    state_slot: int = -1
    status: Status = Status.WAITING
    finish_reason: str | None = None
    arrival: float = dataclasses.field(default_factory=time.monotonic)
    first_token_time: float | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens that exist, on the host or (pending) on the device."""
        return len(self.prompt_ids) + len(self.output_ids) + self.pending

    @property
    def num_generated(self) -> int:
        return len(self.output_ids) + self.pending

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_ids) + self.params.max_tokens

    def token(self, position: int) -> int:
        """The token at `position`; -1 for the pending one, which the device fills in itself."""
        n = len(self.prompt_ids)
        if position < n:
            return self.prompt_ids[position]
        return self.output_ids[position - n] if position - n < len(self.output_ids) else -1


@dataclasses.dataclass(frozen=True)
class Buckets:
    """Static shapes of the jitted step: each dimension is padded up to one of these.

    tokens: powers of two from 16 to max_num_batched_tokens (plus that value itself);
    rows: powers of two from 8 to max_num_seqs. A pure decode step picks it from its row count;
      a step with a longer row takes the most rows its token bucket can hold (padding rows
      cost almost nothing there, and the step shape then depends on the tokens alone);
    tokens per row: 1 in a pure decode step, else a power of four from 4, at most the tokens;
    blocks per row: powers of four up to the blocks of max_model_len; just that maximum when
      attention cost does not depend on the table's width (the GPU kernels walk a row's own
      pages; only the plain-jnp reference gathers the whole table).
    The last two are coarse because they multiply every other dimension (see `shapes`).
    """

    tokens: tuple[int, ...]
    rows: tuple[int, ...]
    blocks: tuple[int, ...]
    row_lens: tuple[int, ...]

    @classmethod
    def make(
        cls, max_num_batched_tokens: int, max_num_seqs: int, max_blocks_per_seq: int, bucket_blocks: bool = True
    ) -> "Buckets":
        return cls(
            tokens=_powers(16, max_num_batched_tokens),
            rows=_powers(8, max_num_seqs),
            blocks=_powers(1, max_blocks_per_seq, base=4) if bucket_blocks else (max_blocks_per_seq,),
            row_lens=(1,) + _powers(4, max_num_batched_tokens, base=4),
        )

    @staticmethod
    def pick(buckets: tuple[int, ...], n: int) -> int:
        return next(b for b in buckets if b >= n)

    def step_shape(self, num_tokens: int, num_rows: int, longest_row: int) -> tuple[int, int, int]:
        """(tokens, rows, tokens per row) buckets of a step."""
        T = self.pick(self.tokens, num_tokens)
        if longest_row == 1:
            return T, self.pick(self.rows, num_rows), 1
        return T, self.pick(self.rows, min(T, self.rows[-1])), min(self.pick(self.row_lens, longest_row), T)

    def shapes(self) -> list[tuple[int, int, int, int]]:
        """Every (tokens, rows, tokens per row, blocks per row) the scheduler can pick, decode first."""
        decode = {self.step_shape(n, n, 1) for n in range(1, self.rows[-1] + 1)}
        # A step with a row of m >= 2 tokens has at least m tokens: any token bucket T >= m.
        mixed = {
            self.step_shape(T, 1, m)
            for T in self.tokens
            for m in {2} | {q for q in self.row_lens if 2 <= q <= T} | {T}
        }
        return [(T, B, q, M) for T, B, q in sorted(decode) + sorted(mixed) for M in self.blocks]


def _powers(lo: int, hi: int, base: int = 2) -> tuple[int, ...]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= base
    return tuple(out) + (hi,)


@dataclasses.dataclass
class ScheduledRow:
    request: Request
    start: int  # first position fed this step
    num_tokens: int
    samples: bool = dataclasses.field(init=False)  # frozen now: the request grows once dispatched

    def __post_init__(self):
        # The row reaches the end of the known tokens, so its last logits pick the next one.
        self.samples = self.start + self.num_tokens == self.request.num_tokens


class Scheduler:
    def __init__(
        self, pool: PagePool, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
        bucket_blocks: bool = True,
    ):
        if max_num_batched_tokens <= max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must exceed max_num_seqs ({max_num_seqs}) "
                "so prefill always gets tokens alongside a full batch of decodes"
            )
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        max_blocks = -(-max_model_len // pool.block_size)
        self.buckets = Buckets.make(max_num_batched_tokens, max_num_seqs, max_blocks, bucket_blocks)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Drop a finished or aborted request and give back its blocks and state slot at once."""
        if request.status is Status.RUNNING:
            self.running.remove(request)
            self.pool.free(request.id)
            self.free_slots.append(request.state_slot)
            request.state_slot = -1
        elif request.status is Status.WAITING:
            self.waiting.remove(request)
        request.status = Status.FINISHED

    def schedule(self) -> list[ScheduledRow]:
        budget = self.max_num_batched_tokens
        rows: list[ScheduledRow] = []
        # A request whose last token is already pending has nothing left to run.
        active = [r for r in self.running if r.num_generated < r.params.max_tokens]
        decoding = [r for r in active if r.num_tokens - r.num_computed == 1]
        prefilling = [r for r in active if r.num_tokens - r.num_computed > 1]
        for r in decoding + prefilling:
            if budget == 0:
                break
            n = min(r.num_tokens - r.num_computed, budget)
            rows.append(ScheduledRow(r, r.num_computed, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            r = self.waiting[0]
            if not self.pool.reserve(r.id, r.max_total_tokens):
                break  # FCFS: the head waits for blocks, nobody overtakes it
            self.waiting.popleft()
            r.status, r.state_slot = Status.RUNNING, self.free_slots.pop()
            self.running.append(r)
            n = min(r.num_tokens, budget)
            rows.append(ScheduledRow(r, 0, n))
            budget -= n
        for row in rows:
            self.pool.append_slots(row.request.id, row.start + row.num_tokens)
        return rows

    def build_plan(self, rows: list[ScheduledRow]) -> StepPlan:
        total = sum(r.num_tokens for r in rows)
        longest = max(r.num_tokens for r in rows)
        T, B, max_row_len = self.buckets.step_shape(total, len(rows), longest)
        tables = [self.pool.block_table(r.request.id) for r in rows]
        M = Buckets.pick(self.buckets.blocks, max(len(t) for t in tables))

        token_ids = np.zeros(T, np.int32)
        positions = np.zeros(T, np.int32)
        slot_mapping = np.full(T, -1, np.int32)
        token_rows = np.zeros(T, np.int32)
        block_tables = np.zeros((B, M), np.int32)
        context_lens = np.zeros(B, np.int32)
        row_starts = np.full(B, total, np.int32)
        row_lens = np.zeros(B, np.int32)
        state_slots = np.full(B, -1, np.int32)
        logits_indices = np.zeros(B, np.int32)
        cursor = 0
        for b, (row, table) in enumerate(zip(rows, tables)):
            req, end = row.request, row.start + row.num_tokens
            span = slice(cursor, cursor + row.num_tokens)
            token_ids[span] = [req.token(p) for p in range(row.start, end)]
            positions[span] = np.arange(row.start, end)
            slot_mapping[span] = self.pool.slot_mapping(req.id, row.start, end)
            token_rows[span] = b
            block_tables[b, : len(table)] = table
            context_lens[b] = end
            row_starts[b], row_lens[b], state_slots[b] = cursor, row.num_tokens, req.state_slot
            logits_indices[b] = cursor + row.num_tokens - 1
            cursor += row.num_tokens
        return StepPlan(
            token_ids, positions, slot_mapping, token_rows, block_tables, context_lens,
            row_starts, row_lens, state_slots, logits_indices,
            max_row_len=max_row_len,
        )

    def padding_plan(self, T: int, B: int, max_row_len: int, M: int) -> StepPlan:
        """A step of the given shape with nothing in it: no K/V or state is written (warm-up)."""
        zeros = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
        return StepPlan(
            zeros(T), zeros(T), np.full(T, -1, np.int32), zeros(T), zeros(B, M), zeros(B),
            zeros(B), zeros(B), np.full(B, -1, np.int32), zeros(B), max_row_len=max_row_len,
        )
