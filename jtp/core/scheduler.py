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

Prefix caching: a request starts from the longest prefix of its prompt whose KV blocks are
cached (and, on hybrid models, whose recurrent state is: the hit ends at a checkpoint), and
prefills only the rest. Full blocks are registered in the cache once their tokens are known on
the host; on hybrid models a row that ends at a checkpoint position freezes its state slot
(see `Scheduler._checkpoint`). At least one prompt token is always computed: its logits give
the first output token.

What crosses to the worker is a `SchedulerOutput` (request-level numbers and diffs, see
jtp/core/scheduler_output.py); the worker lays the step's arrays out, padded to `Buckets`.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections import deque
from typing import Any

import numpy as np

from jtp.config.speculative import SpeculativeConfig, propose_ngram
from jtp.core.block_hash import chain_key
from jtp.core.buckets import SHORT_ROW, Buckets, long_rows
from jtp.core.multimodal import MultiModalPrompt
from jtp.core.page_pool import PagePool
from jtp.core.sampling_params import SamplingParams
from jtp.core.scheduler_output import NewRequest, SchedulerOutput
from jtp.core.state_pool import StatePool
from jtp.core.step_input import StepPlan


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
    num_unseen_tokens: int = 0  # tokens sampled by a dispatched step that the host has not seen yet
    last_scheduled: int = -1  # the scheduler's step count when it last ran (a pipeline serves the oldest first)
    seq_slot: int = -1  # row of the device's sampled-token buffer while running
    status: Status = Status.WAITING
    finish_reason: str | None = None
    arrival: float = dataclasses.field(default_factory=time.monotonic)
    scheduled_time: float | None = None  # admitted: its first row scheduled (time.monotonic, as arrival)
    first_token_time: float | None = None
    # Prefix cache
    cached_tokens: int = 0  # prompt tokens whose KV (and state) came from the cache
    block_keys: list[bytes] = dataclasses.field(default_factory=list)  # keys of the known full blocks
    num_registered: int = 0  # leading blocks already offered to the cache
    kv_hit_end: int = 0  # tokens of the longest cached KV prefix at admission (>= cached_tokens)
    # Recurrent state (hybrid models): the slot holding the state at num_computed (-1: zero state),
    # whether a slot is reserved for the next write, and checkpoints waiting for their block's key.
    state_slot: int = -1
    state_reserved: bool = False
    pending_checkpoints: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (block, slot)
    decode_checkpoint: tuple[int, int] | None = None  # the latest one past the prompt (block, slot)
    # A verify step in flight: the slot with the state before its drafts (-1: none), which the
    # request goes back to if a draft is rejected (`Scheduler.accepted`).
    spec_state_kept: int = -1
    mtp_drafts: list[int] = dataclasses.field(default_factory=list)  # the MTP head's guesses after the last token
    grammar: Any = None  # structured outputs: the engine's matcher of the request's grammar (None: free text)
    mm: MultiModalPrompt | None = None  # its images (None: text alone), their rows in the worker's pool:
    image_rows: tuple[int, ...] = ()
    # What the worker's persistent batch holds of this request (see `Scheduler.output`).
    num_sent_tokens: int = 0
    num_sent_blocks: int = 0

    @property
    def num_tokens(self) -> int:
        """Tokens that exist, on the host or (pending) on the device."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_unseen_tokens

    @property
    def num_generated(self) -> int:
        return len(self.output_ids) + self.num_unseen_tokens

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_ids) + self.params.max_tokens

    def token(self, position: int) -> int:
        """The token at `position`; -1 for the pending one, which the device fills in itself."""
        n = len(self.prompt_ids)
        if position < n:
            return self.prompt_ids[position]
        return self.output_ids[position - n] if position - n < len(self.output_ids) else -1


@dataclasses.dataclass
class ScheduledRow:
    request: Request
    start: int  # first position fed this step
    num_tokens: int
    # This row's last logits pick the request's next token (a prefill chunk short of the prompt's
    # end does not). Computed at construction: the request grows once the row is dispatched.
    picks_next_token: bool = dataclasses.field(init=False)
    state_read: int = -1  # recurrent-state slots (hybrid models)
    state_write: int = -1
    state_keep: int = -1  # a speculating row's state before its drafts (see Scheduler.accepted)
    steps: int = 1  # tokens the row samples: several in a multi-step decode (one token fed, K sampled)
    drafts: tuple[int, ...] = ()  # speculative tokens fed after the row's last known token

    def __post_init__(self):
        # The row reaches the end of the known tokens, so its last logits pick the next one.
        self.picks_next_token = self.start + self.num_tokens - len(self.drafts) == self.request.num_tokens


class Scheduler:
    def __init__(
        self, pool: PagePool, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
        states: StatePool | None = None, cache_root: bytes | None = None,
        bucket_row_lens: bool = True, limit_long_rows: bool = False,
        num_scheduler_steps: int = 1, speculative: SpeculativeConfig | None = None, pipeline_depth: int = 1,
    ):
        """`states`: the recurrent-state pool of a hybrid model (None: attention only).
        `cache_root`: the root key of the prefix cache's hash chain (None: prefix caching off).
        `num_scheduler_steps`: the most decode steps one pure decode step may run on the device.
        `speculative`: n-gram drafts for decode rows (attention-only models; the engine runs lockstep).
        `pipeline_depth` > 1 (pipeline parallelism): that many steps are in flight at once, so a step
        takes no request whose sampled token is still in flight, and at most 1/depth of the requests:
        the rest are left for the steps behind it (micro-batch groups, each stage busy with one).
        `limit_long_rows`: a step with a row of more than SHORT_ROW tokens holds at most
        `buckets.long_rows` rows of several tokens, unless it verifies drafts (a hybrid's DeltaNet layout)."""
        if max_num_batched_tokens <= max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must exceed max_num_seqs ({max_num_seqs}) "
                "so prefill always gets tokens alongside a full batch of decodes"
            )
        if states is not None and states.num_slots <= max_num_seqs:
            raise ValueError(f"{states.num_slots} state slots cannot serve {max_num_seqs} running requests and checkpoints")
        self.pool = pool
        self.states = states
        self.cache_root = cache_root
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.num_scheduler_steps = num_scheduler_steps
        self.speculative = speculative
        self.pipeline_depth = pipeline_depth
        self.limit_long_rows = limit_long_rows
        self.steps_scheduled = 0
        max_blocks = -(-max_model_len // pool.block_size)
        self.buckets = Buckets.make(max_num_batched_tokens, max_num_seqs, max_blocks, bucket_row_lens)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_seq_slots = list(range(max_num_seqs - 1, -1, -1))
        self._release_after_dispatch: list[int] = []  # state slots the scheduled step still reads
        self._admitted: list[Request] = []  # admitted since the last `output`
        self._finished_slots: list[int] = []  # slots given back since the last `output`
        # Counters: prompt tokens looked up / found in the prefix cache, prompt tokens computed.
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.prompt_tokens_computed = 0
        # Speculative decoding: drafted and accepted tokens, rows verified, recurrent states rolled back.
        self.spec_draft_tokens = self.spec_accepted_tokens = self.spec_verified_rows = 0
        self.spec_state_rollbacks = 0

    @property
    def caching(self) -> bool:
        return self.cache_root is not None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Drop a finished or aborted request: its full blocks go to the prefix cache, the rest of
        its blocks and its state slots are given back at once."""
        if request.status is Status.RUNNING:
            self.running.remove(request)
            if self.caching:
                self.register_computed(request)
            self.pool.free(request.id)
            self.free_seq_slots.append(request.seq_slot)
            self._finished_slots.append(request.seq_slot)
            request.seq_slot = -1
            if self.states is not None:
                for _, slot in request.pending_checkpoints:  # their keys never became known
                    self.states.release(slot)
                request.pending_checkpoints.clear()
                for slot in (request.state_slot, request.spec_state_kept):
                    if slot >= 0:
                        self.states.release(slot)
                request.state_slot = request.spec_state_kept = -1
                if request.state_reserved:
                    self.states.unreserve()
                    request.state_reserved = False
        elif request.status is Status.WAITING:
            self.waiting.remove(request)
        request.status = Status.FINISHED

    def schedule(self, overlap: bool = True) -> list[ScheduledRow]:
        """The next step's rows. `overlap=False`: the engine runs this step alone (lockstep), so a
        pipeline's step takes every request it can rather than its share."""
        self.steps_scheduled += 1
        if self.caching:
            bs = self.pool.block_size
            for r in self.running:
                if r.pending_checkpoints or r.num_computed // bs > r.num_registered:  # else nothing to offer
                    self.register_computed(r)
        budget = self.max_num_batched_tokens
        rows: list[ScheduledRow] = []
        # A request whose last token is already pending has nothing left to run; in a pipeline, one
        # whose next token is (its step still in flight) waits for it.
        pipelined = self.pipeline_depth > 1
        active = [r for r in self.running if r.num_generated < r.params.max_tokens
                  and not (pipelined and r.num_unseen_tokens)]
        max_rows = self.max_num_seqs
        if pipelined:
            active.sort(key=lambda r: r.last_scheduled)  # (stable) those that waited longest first
            if overlap:  # this step's share of the requests: the running and those a free row could admit
                admissible = min(len(self.waiting), self.max_num_seqs - len(self.running))
                max_rows = -(-(len(self.running) + admissible) // self.pipeline_depth)
        decoding = [r for r in active if r.num_tokens - r.num_computed == 1]
        prefilling = [r for r in active if r.num_tokens - r.num_computed > 1]
        for r in decoding + prefilling:
            if budget == 0 or len(rows) == max_rows:
                break
            chunk = self._chunk_within_long_rows(rows, self._chunk(r, budget))
            # A row that reaches the last known token may append drafts (a decode row, or one that
            # recomputes the tokens a hybrid's state rollback took back).
            drafts = self._drafts(r, budget - chunk) if r.num_computed + chunk == r.num_tokens else ()
            rows.append(ScheduledRow(r, r.num_computed, chunk + len(drafts), drafts=drafts))
            budget -= rows[-1].num_tokens
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and len(rows) < max_rows:
            r = self.waiting[0]
            if not self._admit(r):
                break  # FCFS: the head waits for blocks (or a state slot), nobody overtakes it
            self.waiting.popleft()
            r.scheduled_time = time.monotonic()
            self.running.append(r)
            self._admitted.append(r)
            rows.append(ScheduledRow(r, r.num_computed, self._chunk_within_long_rows(rows, self._chunk(r, budget))))
            budget -= rows[-1].num_tokens
        steps = self._decode_steps(rows)
        for row in rows:
            row.steps = steps
            row.request.last_scheduled = self.steps_scheduled
            self.pool.append_slots(row.request.id, row.start + row.num_tokens + steps - 1)
            if self.states is not None:
                self._assign_state_slots(row)
        return rows

    def dispatched(self, rows: list[ScheduledRow]) -> None:
        """The step of these rows is on the device: advance the requests, make checkpoints."""
        for row in rows:
            # A speculating row's drafts count as computed only once accepted (`accepted`).
            r, end = row.request, row.start + row.num_tokens - len(row.drafts) + row.steps - 1
            r.num_computed = end
            r.num_unseen_tokens += row.picks_next_token * row.steps
            self.prompt_tokens_computed += max(0, min(end, len(r.prompt_ids)) - row.start)
            if self.states is not None and self.caching and not row.drafts:  # drafts: once accepted
                self._checkpoint(r)
        for slot in self._release_after_dispatch:
            self.states.release(slot)
        self._release_after_dispatch.clear()

    def accepted(self, row: ScheduledRow, num_accepted: int) -> None:
        """The target agreed with the row's first `num_accepted` drafts: their K/V is the sequence's;
        the rest is discarded (the pool shrinks back to the computed tokens).

        Hybrid models: a recurrent state cannot drop tokens, so a verify row writes two states: the
        state after all its tokens (`state_write`, a fresh slot) and the state before its drafts
        (`state_keep`, in place of the one it read). All drafts accepted: the first is the
        request's. Else the request goes back to the second, and its next row recomputes the
        accepted drafts (their K/V, already right, is written again with the same values): a
        rollback costs num_accepted tokens of the next step and no memory beyond the slot in flight."""
        r = row.request
        self.spec_draft_tokens += len(row.drafts)
        self.spec_accepted_tokens += num_accepted
        self.spec_verified_rows += 1
        if r.status is not Status.RUNNING:
            r.num_computed += num_accepted
            return  # finished or aborted meanwhile: `remove` gave everything back
        self.pool.truncate(r.id, r.num_computed + num_accepted)
        r.num_sent_blocks = min(r.num_sent_blocks, self.pool.num_blocks(r.id))
        if self.states is None:
            r.num_computed += num_accepted
            return
        kept, r.spec_state_kept = r.spec_state_kept, -1
        if num_accepted == len(row.drafts):
            r.num_computed += num_accepted
            self.states.release(kept)
        else:
            self.states.release(r.state_slot)  # the state after the rejected drafts
            r.state_slot = kept
            self.spec_state_rollbacks += 1
        if self.caching:
            self._checkpoint(r)

    def _drafts(self, r: Request, room: int) -> tuple[int, ...]:
        """Drafts (n-gram, or the MTP head's) for a generating row whose last token the host knows, at
        most `room` of them and never past max_tokens (the last token of a request is never drafted) nor,
        short of min_tokens, past it (every position samples under the row's one mask). On hybrid models
        the row needs its own state slot (the state before the drafts goes there) and a spare one (for
        the state after them), else it does not draft."""
        spec = self.speculative
        if (spec is None or r.num_unseen_tokens or r.num_computed < len(r.prompt_ids) or not r.params.speculate
                or r.params.has_penalties):
            return ()
        k = min(spec.num_speculative_tokens, room, r.params.mask_limit(r.num_generated) - r.num_generated - 1)
        if spec.method == "mtp":  # the guesses the MTP head made in the step that produced the last token
            drafts = tuple(r.mtp_drafts[: max(k, 0)])
        else:
            tokens = r.prompt_ids + r.output_ids
            drafts = tuple(propose_ngram(tokens, k, spec.prompt_lookup_max, spec.prompt_lookup_min))
        if drafts and self.states is not None:
            if r.state_slot < 0 or not self.states.is_exclusive(r.state_slot):
                return ()
            if not r.state_reserved:
                if not self.states.reserve():
                    return ()
                r.state_reserved = True
        return drafts

    def _decode_steps(self, rows: list[ScheduledRow]) -> int:
        """How many decode steps this step runs on the device: up to num_scheduler_steps when every
        row decodes (a prompt chunk runs alone), as far as every row may still generate under one token
        mask (min_tokens), one when a row needs its exact token history (penalties), and on hybrids with
        prefix caching no further than the next block boundary (where a row's state checkpoint is taken)."""
        if self.num_scheduler_steps == 1 or not rows:
            return 1
        if any(row.num_tokens != 1 or not row.picks_next_token or row.request.params.has_penalties for row in rows):
            return 1
        steps = min(self.num_scheduler_steps,
                    *(r.request.params.mask_limit(r.request.num_generated) - r.request.num_generated for r in rows))
        if self.states is not None and self.caching:
            bs = self.pool.block_size
            steps = min(steps, *(bs - r.start % bs for r in rows))
        return max(steps, 1)

    def _admit(self, r: Request) -> bool:
        """Reserve the request's worst case, starting from its longest cached prefix; False
        (nothing changed) when the pool cannot take it now."""
        prefix, state_slot = [], -1
        if self.caching and r.params.prompt_logprobs is None:  # prompt logprobs: every position computed
            keys = self._keys(r)
            limit = (len(r.prompt_ids) - 1) // self.pool.block_size  # leave a token to compute
            prefix = self.pool.lookup(keys[:limit])
            r.kv_hit_end = len(prefix) * self.pool.block_size
            prefix, state_slot = self.restorable(prefix, keys)
        if self.states is not None:
            if state_slot >= 0:
                self.states.acquire(state_slot)
            if not self.states.reserve():
                if state_slot >= 0:
                    self.states.release(state_slot)
                return False
        if not self.pool.reserve(r.id, r.max_total_tokens, prefix):
            if self.states is not None:
                self.states.unreserve()
                if state_slot >= 0:
                    self.states.release(state_slot)
            return False
        r.status, r.seq_slot = Status.RUNNING, self.free_seq_slots.pop()
        r.num_computed = r.cached_tokens = len(prefix) * self.pool.block_size
        r.num_registered = len(prefix)
        r.state_slot, r.state_reserved = state_slot, self.states is not None
        if self.caching:
            self.prefix_queries += len(r.prompt_ids)
            self.prefix_hits += r.cached_tokens
        return True

    def restorable(self, blocks: list[int], keys: list[bytes]) -> tuple[list[int], int]:
        """The leading cached `blocks` (of the blocks keyed `keys`) a sequence can start from, and
        the state slot it restores (-1: none). Hybrid models: the prefix must end at a state
        checkpoint, so it is cut back to the last one."""
        if self.states is None:
            return blocks, -1
        blocks = list(blocks)
        while blocks and self.states.lookup(keys[len(blocks) - 1]) is None:
            blocks.pop()
        return blocks, self.states.lookup(keys[len(blocks) - 1]) if blocks else -1

    def _chunk(self, r: Request, budget: int) -> int:
        """Tokens of the request's next row: what is left, within the budget, ending at the next
        checkpoint position on hybrid models (a row's end is the only place its state exists)."""
        start = r.num_computed
        end = min(r.num_tokens, start + budget)
        for target in self._checkpoint_targets(r):
            if start < target < end:
                end = target
        return end - start

    def _chunk_within_long_rows(self, rows: list[ScheduledRow], chunk: int) -> int:
        """A prompt chunk's tokens beside `rows` under `limit_long_rows`: the whole chunk where the
        step's shape holds it, else SHORT_ROW tokens, else one (a lone token always fits: it adds
        no row of several tokens, and the step's tokens, hence its room, only grow). A request
        admitted with one token has reserved its whole worst case all the same."""
        if not self.limit_long_rows or chunk <= 1 or any(row.drafts for row in rows):
            return chunk
        lens = [row.num_tokens for row in rows]
        for n in (chunk, min(chunk, SHORT_ROW)):
            T, B, bound = self.buckets.step_shape(sum(lens) + n, len(lens) + 1, max(lens + [n]))
            if bound <= SHORT_ROW or sum(m > 1 for m in lens) + 1 <= long_rows(T, B, bound):
                return n
        return 1

    def _checkpoint_targets(self, r: Request) -> tuple[int, ...]:
        """Where a hybrid model's prompt keeps its state (block-aligned positions):
        * the end of the cached KV prefix found at admission, when its state was not cached: the
          point where this prompt left a shared one (a document many questions ask about), so
          the next request with that prefix restores from here instead of from the start;
        * the prompt's last block boundary (a repeat of the prompt, or a follow-up turn that
          rewrites the answer, e.g. without its reasoning, continues from here)."""
        if self.states is None or not self.caching:
            return ()
        last = (len(r.prompt_ids) - 1) // self.pool.block_size * self.pool.block_size
        return (r.kv_hit_end, last)

    def _keys(self, r: Request) -> list[bytes]:
        """The request's block keys, extended over every full block of host-known tokens."""
        bs, keys = self.pool.block_size, r.block_keys
        known = len(r.prompt_ids) + len(r.output_ids)
        while (len(keys) + 1) * bs <= known:
            start = len(keys) * bs
            # A block with image tokens is keyed by the images' digests too: same text, other images, other K/V.
            parent = (keys[-1] if keys else self.cache_root) + (r.mm.block_extra(len(keys), bs) if r.mm else b"")
            keys.append(chain_key(parent, [r.token(p) for p in range(start, start + bs)]))
        return keys

    def reset_prefix_cache(self) -> int:
        """Forget every cached block and state checkpoint that nothing holds; how many blocks."""
        if self.states is not None:
            self.states.reset_cache()
        return self.pool.reset_cache()

    def register_computed(self, r: Request) -> None:
        """Offer the request's computed full blocks (and frozen state checkpoints) to the cache,
        as far as their tokens are known on the host (a pending token's block waits a step)."""
        keys = self._keys(r)
        full = min(len(keys), r.num_computed // self.pool.block_size)
        for i in range(r.num_registered, full):
            self.pool.cache_block(r.id, i, keys[i])
        r.num_registered = max(r.num_registered, full)
        waiting = []
        for block, slot in r.pending_checkpoints:
            if block < len(keys):
                self.states.cache(slot, keys[block])  # False: an equal checkpoint exists; this one goes
                self.states.release(slot)
            else:
                waiting.append((block, slot))
        r.pending_checkpoints = waiting

    def _checkpoint(self, r: Request) -> None:
        """After a row: keep the request's state as a checkpoint if the row ended at a checkpoint
        position (`_checkpoint_targets`, or a block boundary past the prompt: the latest such one
        serves a follow-up turn that resends this conversation; earlier ones are dropped). The
        slot is frozen (an extra hold), so the request's next row writes a fresh slot instead."""
        bs, end = self.pool.block_size, r.num_computed
        if end == 0 or end % bs or r.state_slot < 0:
            return
        in_prompt = end < len(r.prompt_ids)
        if in_prompt and end not in self._checkpoint_targets(r):
            return
        if not r.state_reserved and not self.states.reserve():
            return  # no spare slot for the request's next write: skip this checkpoint
        r.state_reserved = True  # (a request holding no exclusive slot always has one reserved)
        self.states.acquire(r.state_slot)
        checkpoint = (end // bs - 1, r.state_slot)
        r.pending_checkpoints.append(checkpoint)
        if not in_prompt:
            if r.decode_checkpoint is not None:
                self._drop_checkpoint(r, r.decode_checkpoint)
            r.decode_checkpoint = checkpoint

    def _drop_checkpoint(self, r: Request, checkpoint: tuple[int, int]) -> None:
        if checkpoint in r.pending_checkpoints:
            r.pending_checkpoints.remove(checkpoint)
            self.states.release(checkpoint[1])
            return
        block, slot = checkpoint
        # Only if the slot still is that checkpoint and nobody holds it (a restore, a snapshot).
        if block < len(r.block_keys) and self.states.lookup(r.block_keys[block]) == slot and not self.states.refs(slot):
            self.states.uncache(slot)

    def _assign_state_slots(self, row: ScheduledRow) -> None:
        """The row reads the request's state slot and writes it in place, or writes a fresh slot
        when the current one must stay intact (a checkpoint, a restored prefix, the zero state,
        a speculating row's state before its drafts)."""
        r = row.request
        row.state_read = r.state_slot
        if not row.drafts and r.state_slot >= 0 and self.states.is_exclusive(r.state_slot):
            row.state_write = r.state_slot
            if r.state_reserved:  # its checkpoint was a duplicate and went back: the slot is its own again
                self.states.unreserve()
                r.state_reserved = False
            return
        row.state_write = self.states.allocate()  # against the request's reservation
        r.state_reserved = False
        if row.drafts:  # the state before the drafts goes in place, kept until they are verified
            row.state_keep = r.spec_state_kept = r.state_slot
        elif r.state_slot >= 0:
            self._release_after_dispatch.append(r.state_slot)
        r.state_slot = row.state_write

    def output(self, rows: list[ScheduledRow]) -> SchedulerOutput:
        """What the worker needs of this step (call once per scheduled step, before `dispatched`):
        the requests admitted since the last call, the tokens and blocks each row's request gained
        since the worker last heard of it, and the rows' request-level numbers."""
        new = []
        for r in self._admitted:
            if r.status is Status.RUNNING:
                known = r.prompt_ids + r.output_ids
                new.append(NewRequest(r.seq_slot, known, len(r.prompt_ids), r.params, r.seed, r.stop_ids, r.mm,
                                      r.image_rows))
                r.num_sent_tokens, r.num_sent_blocks = len(known), 0
        self._admitted.clear()
        finished, self._finished_slots = self._finished_slots, []
        n = len(rows)
        ints = np.empty((8, n), np.int32)
        picks = np.empty(n, bool)
        drafts: list[int] = []
        tok_slot: list[int] = []
        tok_pos: list[int] = []
        tok_ids: list[int] = []
        block_updates = []
        pool = self.pool
        for b, row in enumerate(rows):
            r = row.request
            slot = r.seq_slot
            num_blocks = pool.num_blocks(r.id)
            ints[:, b] = (slot, row.start, row.num_tokens, len(row.drafts), row.state_read, row.state_write,
                          row.state_keep, num_blocks)
            picks[b] = row.picks_next_token
            if row.drafts:
                drafts += row.drafts
            sent, prompt = r.num_sent_tokens, len(r.prompt_ids)
            if prompt + len(r.output_ids) > sent:  # outputs the host accepted since the last step
                new_ids = r.output_ids[sent - prompt :]
                tok_ids += new_ids
                tok_pos += range(sent, sent + len(new_ids))
                tok_slot += [slot] * len(new_ids)
                r.num_sent_tokens = sent + len(new_ids)
            if num_blocks > r.num_sent_blocks:
                block_updates.append((slot, r.num_sent_blocks, pool.blocks_from(r.id, r.num_sent_blocks)))
                r.num_sent_blocks = num_blocks
        return SchedulerOutput(
            rows=rows, new_requests=new, slots=ints[0], starts=ints[1], num_tokens=ints[2], num_drafts=ints[3],
            picks_next_token=picks, state_reads=ints[4], state_writes=ints[5], state_keeps=ints[6], num_blocks=ints[7],
            draft_tokens=np.asarray(drafts, np.int32), num_steps=rows[0].steps if rows else 1,
            token_updates=(np.asarray(tok_slot, np.int32), np.asarray(tok_pos, np.int32), np.asarray(tok_ids, np.int32)),
            block_updates=block_updates, finished_slots=finished,
        )

    def padding_plan(self, T: int, B: int, max_row_len: int, verify: bool = False) -> StepPlan:
        """A step of the given shape with nothing in it: no K/V or state is written (warm-up).
        `verify`: sample like a speculative verify step ([1 + k, B] logits indices)."""
        return StepPlan.padding(T, B, max_row_len, self.buckets.table_width, self.speculative.verify_positions if verify else 0)
