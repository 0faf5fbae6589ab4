"""What a model family is: the functions the loader and the runner call, as a typed Protocol.

A family is a module (jtp/models/qwen3.py, jtp/models/qwen3_5.py) whose functions satisfy
`ModelFamily`. Parameters live in a pytree of dicts (`params["layers"][i]["q_proj"]`), described
by `param_layout`: one `Source` per parameter path, which says where it comes from in the
checkpoint, its shape, and the logical axis of each dim (jtp/parallel/rules.py splits by those).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import jax
    from jax.sharding import Mesh

    from jtp.config.model_config import ModelConfig
    from jtp.loading.sources import Source
    from jtp.models.attention import AttentionMetadata, LayerKV, PagedAttention
    from jtp.models.moe import RoutedExperts


class MtpForward(Protocol):
    def __call__(
        self, params: dict, cfg: ModelConfig, hidden: jax.Array, next_tokens: jax.Array, kv: LayerKV,
        meta: AttentionMetadata, attend: PagedAttention, routed: RoutedExperts,
    ) -> tuple[jax.Array, LayerKV]:
        """(target hidden h_t [T, H], token t+1 [T]) -> the head's hidden state [T, H] (compute_logits
        turns it into a guess for token t+2) and its K/V written at the step's positions."""
        ...


@runtime_checkable
class ModelFamily(Protocol):
    def param_layout(self, cfg: ModelConfig, tp: int = 1, mtp: bool = False) -> dict[str, Source]:
        """Parameter path ("layers.3.q_proj") -> its Source; with `mtp`, the MTP head's too ("mtp.*")."""
        ...

    def init_cache(
        self, cfg: ModelConfig, mesh: Mesh, num_blocks: int, block_size: int, num_state_slots: int, dtype,
        kv_dtype=None, layer_ids: range | None = None,
    ) -> list:
        """One zeroed cache entry per layer of `layer_ids` (default all; paged K/V in `kv_dtype`,
        default `dtype`, or a recurrent layer's state slots), sharded; each with one scratch page or
        slot past the pool's, where padding tokens and rows write."""
        ...

    def forward(
        self, params: dict, cfg: ModelConfig, tokens: jax.Array, cache: list, meta: AttentionMetadata,
        attend: PagedAttention, routed: RoutedExperts,
    ) -> tuple[jax.Array, list]:
        """tokens [T] of a ragged batch -> final-normed hidden states [T, H] and the updated cache:
        `final_norm(decoder_layers(embed(tokens)))` over every layer."""
        ...

    # `forward` in the three parts a pipeline stage runs some of (jtp/worker/pipeline.py).
    def embed(self, params: dict, cfg: ModelConfig, tokens: jax.Array, meta: AttentionMetadata) -> jax.Array:
        """tokens [T] -> the first layer's input [T, H]."""
        ...

    def decoder_layers(
        self, params: dict, cfg: ModelConfig, x: jax.Array, cache: list, meta: AttentionMetadata,
        attend: PagedAttention, routed: RoutedExperts, layer_ids: range,
    ) -> tuple[jax.Array, list]:
        """Layers `layer_ids` over x [T, H] (`cache`: theirs, in that order) -> x and their updated cache."""
        ...

    def final_norm(self, params: dict, cfg: ModelConfig, x: jax.Array) -> jax.Array:
        ...

    def compute_logits(self, params: dict, hidden: jax.Array) -> jax.Array:
        """hidden [N, H] -> float32 logits [N, V]."""
        ...

    # The multi-token-prediction head (jtp/models/mtp.py drafts with it); None: the family has none.
    mtp_forward: MtpForward | None
    # Whether `forward`'s own layers read the static bound on tokens per row (meta.query_bound's
    # length) beyond "1: a pure decode step"; the attention implementation says so for itself.
    uses_row_len_bound: bool
    # Whether a step with a row over SHORT_ROW tokens holds at most `buckets.long_rows` rows of
    # several tokens (the family lays them out apart).
    lays_out_long_rows_apart: bool
