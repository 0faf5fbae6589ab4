"""The persistent input batch: per-slot rows the worker keeps between steps, and each step's
packed host arrays laid out from them with vectorised numpy.

A slot's row is written once when its request is admitted (prompt tokens, sampling columns,
stop ids, logit bias) and then only changed by the diffs of each `SchedulerOutput` (tokens the host
accepted, blocks its table gained). A step then costs a handful of array operations whatever its
batch: token ids are one gather from the token table (-1 where the device's sampled-token buffer
fills in a token the host has not seen), positions and slot mapping come from `np.repeat` of the
rows' starts, sampling parameters are gathered by slot. The result is a `PackedStep`: two flat
buffers at the static offsets of its `StepLayout` (jtp/core/packed_step.py).

Numpy only (the device side is the runner's).
"""
from __future__ import annotations

import numpy as np

from jtp.core.packed_step import PackedStep, StepLayout, compiled_flags
from jtp.core.sampling_params import MAX_LOGIT_BIAS, penalty_len
from jtp.core.buckets import Buckets
from jtp.core.scheduler_output import SchedulerOutput
from jtp.core.step_input import GREEDY_EPS, PROMPT_CHUNK, STOP_IDS_WIDTH, SamplingFlags, scored_prompt_positions

# Sampling columns, in their packed order, and the value of a row that does not sample (greedy,
# no penalties). "step" is the row's own (tokens it generated so far), computed every step.
_FLOAT_COLUMNS = {"temperature": 0.0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0,
                  "presence_penalty": 0.0, "frequency_penalty": 0.0}
_INT_COLUMNS = {"top_k": 0, "seed": 0, "step": 0, "logprobs": -1}


class InputBatch:
    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int, buckets: Buckets,
                 verify_positions: int = 0, mask_words: int = 0, multimodal: bool = False):
        """`verify_positions`: 1 + k of the speculative config (0: never a verify step).
        `mask_words`: words of a row's token mask (`step_input.mask_words` of the vocabulary; 0: no masks).
        `multimodal`: the model takes images; every step carries M-RoPE positions and image rows."""
        self.multimodal = multimodal
        self.images: list = [None] * max_num_seqs  # per slot: (MultiModalPrompt, pool rows) or None
        self.has_images = np.zeros(max_num_seqs, bool)
        self.buckets = buckets
        self.mask_words = mask_words
        self.block_size = block_size
        self.verify_positions = verify_positions
        S = max_num_seqs
        # Zero pages cost nothing until written: the table only touches what prompts fill.
        self.token_table = np.zeros((S, max_model_len), np.int32)
        self.num_known = np.zeros(S, np.int32)  # tokens of the slot's request the host knows
        self.num_prompt = np.zeros(S, np.int32)
        self.block_table = np.zeros((S, buckets.table_width), np.int32)
        self.sampling_floats = np.tile(np.array(list(_FLOAT_COLUMNS.values()), np.float32), (S, 1))
        self.sampling_ints = np.tile(np.array(list(_INT_COLUMNS.values()), np.int32), (S, 1))
        self.stop_ids = np.full((S, STOP_IDS_WIDTH), -1, np.int32)
        self.logit_bias_ids = np.full((S, MAX_LOGIT_BIAS), -1, np.int32)
        self.logit_bias = np.zeros((S, MAX_LOGIT_BIAS), np.float32)
        # Per-slot facts behind the step's static sampling flags.
        self.truncates = np.zeros(S, bool)  # samples (not greedy) and uses top-k / top-p / min-p
        self.penalised = np.zeros(S, bool)  # a penalty or a logit bias: the penalised sampling variant
        self.scores_prompt = np.zeros(S, bool)  # prompt logprobs: its prompt rows score their positions
        self._arange = np.arange(max(buckets.tokens[-1], buckets.table_width, verify_positions, S) + 1, dtype=np.int32)
        self._templates: dict[StepLayout, tuple[np.ndarray, np.ndarray]] = {}

    # ------------------------------------------------------------------ diffs

    def update(self, out: SchedulerOutput) -> None:
        """Apply the step's diffs: new requests' rows, accepted tokens, grown block tables."""
        for new in out.new_requests:
            s, p = new.slot, new.params
            n = len(new.token_ids)
            self.token_table[s, :n] = new.token_ids
            self.num_known[s], self.num_prompt[s] = n, new.num_prompt
            self.block_table[s] = 0
            self.sampling_floats[s] = [getattr(p, name) for name in _FLOAT_COLUMNS]
            seed = int(np.uint32(new.seed % 2**32).view(np.int32))
            self.sampling_ints[s] = (max(p.top_k, 0), seed, 0, -1 if p.logprobs is None else p.logprobs)
            stops = sorted(new.stop_ids)[:STOP_IDS_WIDTH]
            self.stop_ids[s] = -1
            self.stop_ids[s, : len(stops)] = stops
            bias = p.logit_bias or {}
            self.logit_bias_ids[s], self.logit_bias[s] = -1, 0.0
            self.logit_bias_ids[s, : len(bias)] = [int(t) for t in bias]
            self.logit_bias[s, : len(bias)] = list(bias.values())
            # From the float32 columns, as the device sees them.
            temperature, top_p, min_p, rep, pres, freq = self.sampling_floats[s]
            self.truncates[s] = temperature >= GREEDY_EPS and (p.top_k > 0 or top_p < 1.0 or min_p > 0.0)
            self.penalised[s] = rep != 1.0 or pres != 0.0 or freq != 0.0 or bool(bias)
            self.scores_prompt[s] = p.prompt_logprobs is not None
            self.images[s] = (new.mm, new.image_rows) if new.mm is not None else None
            self.has_images[s] = new.mm is not None
        slots, positions, tokens = out.token_updates
        if len(tokens):
            self.token_table[slots, positions] = tokens
            np.maximum.at(self.num_known, slots, positions + 1)
        for slot, first, blocks in out.block_updates:
            self.block_table[slot, first : first + len(blocks)] = blocks

    # ------------------------------------------------------------------ the step's arrays

    def prepare(self, out: SchedulerOutput, masked: bool = False) -> PackedStep:
        """Apply the diffs, then lay the step out: a `PackedStep` padded to the buckets. `masked`: the
        step carries token masks, all ones here (the caller writes the constrained rows' masks)."""
        self.update(out)
        n = out.num_rows
        slots, starts, lens = out.slots, out.starts, out.num_tokens
        samples = out.picks_next_token
        all_sample = bool(samples.all())
        total = int(lens.sum())
        # Tokens: row b's run starts at cu[b] - lens[b] in the flat batch.
        cu = np.cumsum(lens, dtype=np.int32)
        first = cu - lens
        targets = self._prompt_targets(out, first) if self.scores_prompt[slots].any() else None
        # A step that scores prompt positions runs the forward program: never a pure decode shape, which
        # may loop on the device (a lone prompt token of a long prompt's chunked prefill can be one).
        T, B, max_row_len = self.buckets.step_shape(total, n, max(int(lens.max()), 1 + (targets is not None)))
        M = self.buckets.table_width
        verify = len(out.draft_tokens) > 0
        sampling_slots = slots if all_sample else slots[samples]
        flags = compiled_flags(SamplingFlags(
            needs_top_k_p_min_p=bool(self.truncates[sampling_slots].any()),
            needs_penalties=bool(self.penalised[sampling_slots].any()),
            num_logprobs=int((self.sampling_ints[sampling_slots, 3] > 0).any()),
            needs_mask=masked,
        ))
        if not self.mask_words:
            flags = flags._replace(needs_mask=False)
        history_len = 0
        if flags.needs_penalties:
            known = np.where(samples, self.num_known[slots], 0)
            history_len = penalty_len(int(known.max(initial=0)), self.token_table.shape[1])
        layout = StepLayout(T, B, M, max_row_len, self.verify_positions if verify else 0, history_len, flags,
                            self.mask_words if flags.needs_mask else 0, self.multimodal)
        ints, floats = (buf.copy() for buf in self._template(layout))
        packed = PackedStep(layout, ints, floats, targets)
        f = packed.fields()

        token_rows = np.repeat(self._arange[:n], lens)
        positions = self._arange[:total] + (starts - first)[token_rows]
        token_slots = slots[token_rows]
        width = self.token_table.shape[1]
        token_ids = self.token_table[token_slots, np.minimum(positions, width - 1)]
        token_ids[positions >= self.num_known[token_slots]] = -1  # pending: the device fills it in
        if verify:  # a row's drafts are its last num_drafts tokens
            draft_from = (cu - out.num_drafts)[token_rows]
            token_ids[self._arange[:total] >= draft_from] = out.draft_tokens
        bs = self.block_size
        f["token_ids"][:total] = token_ids
        f["positions"][:total] = positions
        f["slot_mapping"][:total] = self.block_table[token_slots, positions // bs] * bs + positions % bs
        f["token_rows"][:total] = token_rows
        if self.multimodal:
            self._images(f, positions, token_slots, total)

        # Rows (padding rows keep the template's values).
        table = self.block_table[slots, :M]
        table[self._arange[:M] >= out.num_blocks[:, None]] = 0  # blocks past the row's own: stale
        f["block_tables"][:n] = table
        f["context_lens"][:n] = starts + lens
        f["row_starts"][:n] = first
        f["row_starts"][n:] = total
        f["row_lens"][:n] = lens
        f["seq_slots"][:n] = slots
        f["state_reads"][:n] = out.state_reads
        f["state_writes"][:n] = out.state_writes
        f["state_keeps"][:n] = out.state_keeps
        last = cu - 1
        if verify:
            P = self.verify_positions
            f["logits_indices"][:, :n] = np.minimum(last - out.num_drafts + self._arange[:P, None], last)
        else:
            f["logits_indices"][:n] = last
        f["stop_ids"][:n] = self.stop_ids[slots]
        f["num_steps"][0] = out.num_steps

        # Sampling: the slot's columns for rows that sample (the template's neutral values elsewhere),
        # written as the [columns, B] blocks they are in the buffers.
        int_fields = layout.offsets()[0]
        start = int_fields["top_k"][0]
        sampling_ints = ints[start : start + 4 * B].reshape(4, B)
        sampling_floats = floats[: 6 * B].reshape(6, B)
        rows = slice(None) if all_sample else samples
        sampling_ints[:, :n][:, rows] = self.sampling_ints[slots[rows]].T
        sampling_floats[:, :n][:, rows] = self.sampling_floats[slots[rows]].T
        # A sampling row generates its token number (tokens so far) - (prompt).
        sampling_ints[2, :n] = np.where(samples, starts + lens - out.num_drafts - self.num_prompt[slots], 0)
        if history_len:
            cols = np.arange(history_len, dtype=np.int32)[None, :]
            history = np.zeros((n, history_len), np.int32)
            w = min(history_len, width)
            history[:, :w] = self.token_table[slots, :w]
            in_history = cols < known[:, None]
            f["penalty_ids"][:n] = np.where(in_history, history, -1)
            f["penalty_is_output"][:n] = in_history & (cols >= self.num_prompt[slots][:, None])
            f["logit_bias_ids"][:n] = np.where(samples[:, None], self.logit_bias_ids[slots], -1)
            f["logit_bias"][:n] = np.where(samples[:, None], self.logit_bias[slots], 0.0)
        return packed

    def _images(self, f: dict, positions: np.ndarray, token_slots: np.ndarray, total: int) -> None:
        """A multimodal step's M-RoPE rows (text: three equal rows) and image-pool rows (-1: none)."""
        rope, rows = f["rope_positions"], f["image_rows"]
        rope[:, :total] = positions
        rows[...] = -1
        for slot in np.unique(token_slots[self.has_images[token_slots]]):  # text rows: nothing more
            mm, pool_starts = self.images[slot]
            at = np.flatnonzero(token_slots == slot)
            rope[:, at] = mm.rope_positions(positions[at], int(self.num_prompt[slot]))
            rows[at] = mm.image_rows(positions[at], pool_starts)

    def _prompt_targets(self, out: SchedulerOutput, first: np.ndarray) -> np.ndarray | None:
        """i32[2, P]: the flat indices of the positions the step's prompt-logprobs rows score, and the
        prompt token each predicts, padded to a multiple of PROMPT_CHUNK (None: no such position)."""
        indices, targets = [], []
        for b in np.flatnonzero(self.scores_prompt[out.slots]):
            slot, start = out.slots[b], int(out.starts[b])
            n = scored_prompt_positions(start, int(out.num_tokens[b]), int(self.num_prompt[slot]))
            indices.append(first[b] + self._arange[:n])
            targets.append(self.token_table[slot, start + 1 : start + 1 + n])
        total = sum(len(i) for i in indices)
        if not total:
            return None
        packed = np.zeros((2, -(-total // PROMPT_CHUNK) * PROMPT_CHUNK), np.int32)
        packed[0, :total], packed[1, :total] = np.concatenate(indices), np.concatenate(targets)
        return packed

    def _template(self, layout: StepLayout) -> tuple[np.ndarray, np.ndarray]:
        """Buffers of the layout holding a padding step's values (copied, then filled, each step)."""
        template = self._templates.get(layout)
        if template is None:
            packed = PackedStep.empty(layout)
            f = packed.fields()
            for name in ("slot_mapping", "seq_slots", "state_reads", "state_writes", "state_keeps", "stop_ids"):
                f[name][...] = -1
            if layout.penalty_len:
                f["penalty_ids"][...] = f["logit_bias_ids"][...] = -1
            if layout.mask_words:
                f["token_mask"][...] = -1  # every token allowed
            for name, default in _INT_COLUMNS.items():
                f[name][...] = default
            for name, default in _FLOAT_COLUMNS.items():
                f[name][...] = default
            template = self._templates[layout] = (packed.ints, packed.floats)
        return template
