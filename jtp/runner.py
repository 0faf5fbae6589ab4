"""ModelRunner: the device side of the engine. It owns the sharded weights, the paged KV
cache and the one jitted step; it consumes plain-numpy `StepPlan`s and returns numpy results.

Everything about *which* tokens run is decided on the host (scheduler); the runner only
executes. Followers in a multi-process deployment run the very same calls on their devices.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jtp.attention import AttentionMetadata
from jtp.config import ModelConfig
from jtp.models import family_of
from jtp.sharding import make_mesh, replicated, tp_size
from jtp.weights import load_params, resolve_dtype

log = logging.getLogger(__name__)


@dataclasses.dataclass
class StepPlan:
    """One step of work, as numpy arrays padded to bucket sizes (T tokens, B rows, M blocks per row)."""

    token_ids: np.ndarray  # i32[T]
    positions: np.ndarray  # i32[T]
    slot_mapping: np.ndarray  # i32[T], -1 for padding tokens
    token_rows: np.ndarray  # i32[T]
    block_tables: np.ndarray  # i32[B, M]
    context_lens: np.ndarray  # i32[B]
    row_starts: np.ndarray  # i32[B]
    row_lens: np.ndarray  # i32[B]
    state_slots: np.ndarray  # i32[B]
    logits_indices: np.ndarray  # i32[B] index (into T) of the token whose logits each row samples from

    def metadata(self) -> AttentionMetadata:
        return AttentionMetadata(
            positions=self.positions,
            slot_mapping=self.slot_mapping,
            token_rows=self.token_rows,
            block_tables=self.block_tables,
            context_lens=self.context_lens,
            row_starts=self.row_starts,
            row_lens=self.row_lens,
            state_slots=self.state_slots,
        )


class ModelRunner:
    def __init__(
        self,
        model_dir: str | Path,
        tensor_parallel_size: int = 1,
        dtype: str | None = None,
        num_blocks: int | None = None,
        block_size: int = 16,
        max_seqs: int = 64,
        devices=None,
    ):
        self.model_dir = Path(model_dir)
        self.cfg = ModelConfig.from_dir(model_dir)
        self.mesh = make_mesh(tensor_parallel_size, devices)
        self.dtype = resolve_dtype(self.cfg, dtype)
        self.params = load_params(model_dir, self.cfg, self.mesh, self.dtype)
        self.block_size = block_size
        self.num_blocks = num_blocks if num_blocks is not None else 256
        self.max_seqs = max_seqs
        self.family = family_of(self.cfg)
        self.cache = self.family.init_cache(self.cfg, self.mesh, self.num_blocks, block_size, max_seqs, self.dtype)
        self._logits_fn = jax.jit(functools.partial(_forward_logits, self.family, self.cfg), donate_argnums=(1,))

    @property
    def tp(self) -> int:
        return tp_size(self.mesh)

    def _device_plan(self, plan: StepPlan):
        rep = replicated(self.mesh)
        return jax.tree.map(lambda a: jax.device_put(np.asarray(a, np.int32), rep), (plan.token_ids, plan.metadata(), plan.logits_indices))

    def logits(self, plan: StepPlan) -> np.ndarray:
        """Run one step and return float32 logits [B, V] at each row's logits index."""
        tokens, meta, idx = self._device_plan(plan)
        logits, self.cache = self._logits_fn(self.params, self.cache, tokens, meta, idx)
        return np.asarray(logits)


def _forward_logits(family, cfg, params, cache, tokens, meta, logits_indices):
    hidden, cache = family.forward(params, cfg, tokens, cache, meta)
    return family.compute_logits(params, hidden[logits_indices]), cache
