"""What the scheduler tells the worker about one step: request-level numbers, no tensor layout.

`SchedulerOutput` carries only what changed since the last step, as vLLM's does: requests that
joined (their slot, prompt, sampling parameters), tokens the host learnt since (a request's
accepted outputs), blocks its table gained (or the length it shrank to), and for each row of this
step its slot, where it starts, how many tokens it feeds (drafts last) and its recurrent-state
slots. The worker's `InputBatch` (jtp/worker/input_batch.py) keeps per-slot rows updated by these
diffs and lays the step's arrays out from them. `rows` (the scheduler's own `ScheduledRow`s, with
their `Request`s) stay on the leader: output processing reads them, the worker never does.
Imports numpy only.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from jtp.core.multimodal import MultiModalPrompt
from jtp.core.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class NewRequest:
    """A request that took a slot this step: written into the slot's row once."""

    slot: int
    token_ids: list[int]  # prompt (and any outputs already known)
    num_prompt: int
    params: SamplingParams
    seed: int
    stop_ids: frozenset[int]
    mm: MultiModalPrompt | None = None  # its images: M-RoPE positions, placeholders
    image_rows: tuple[int, ...] = ()  # each image's first row in the image-embedding pool


@dataclasses.dataclass
class SchedulerOutput:
    rows: list  # list[ScheduledRow], leader-side only
    new_requests: list[NewRequest]
    # Per row of the step, in row order (i32[n]):
    slots: np.ndarray  # the request's slot (its row of the persistent batch and of the sampled-token buffer)
    starts: np.ndarray  # first position fed
    num_tokens: np.ndarray  # tokens fed, drafts included
    num_drafts: np.ndarray  # drafts among them (last)
    picks_next_token: np.ndarray  # bool: the row's last known token's logits pick its next token
    state_reads: np.ndarray
    state_writes: np.ndarray
    state_keeps: np.ndarray
    num_blocks: np.ndarray  # blocks in the request's table (the worker's copy may hold stale ones past it)
    draft_tokens: np.ndarray  # i32[sum(num_drafts)], row after row
    num_steps: int  # decode steps of this dispatch
    # Diffs to the persistent rows:
    token_updates: tuple[np.ndarray, np.ndarray, np.ndarray]  # (slot, position, token) of tokens learnt since
    # (slot, first block index, block ids): the slot's table from that index on is these blocks
    block_updates: list[tuple[int, int, list[int]]]
    finished_slots: list[int]  # slots given back since the last step

    @property
    def num_rows(self) -> int:
        return len(self.slots)
