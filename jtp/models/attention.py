"""Paged attention: where K/V live and how a ragged batch of query tokens reads them.

The KV cache of one layer is a pair of page arrays [num_blocks + 1, block_size, kv_heads, head_dim]:
the pool's pages, then a scratch page that no block table names (padding tokens write there).
A step processes T flattened query tokens that belong to B batch rows (decode tokens and
prefill chunks mixed); `AttentionMetadata` says, for each token, where its K/V goes and which
row it belongs to, and for each row, which pages hold its context.

The model calls the `PagedAttention` it is given (to rotate q/k and write K/V, then to attend) or
`write_kv`; a fast GPU kernel replaces the reference implementation behind it without touching the
model.
"""

from __future__ import annotations

import dataclasses
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jtp.config.model_config import ModelConfig
from jtp.kernels import ragged_paged_attention, rope_kv_write, supported
from jtp.models.layers import apply_rope, rms_norm
from jtp.parallel.rules import partition_spec, sharded_zeros
from jtp.parallel.sharding import kv_head_replicas, tp_size

# Masked scores use a large finite value, not -inf: a padding token whose row has no context
# then yields a harmless uniform softmax instead of NaN.
_MASKED = -1e30
CHUNK_KEYS = 256  # keys the reference attention reads per loop iteration


class AttentionMetadata(NamedTuple):
    positions: jax.Array  # i32[T] absolute position of each query token (also drives RoPE)
    slot_mapping: jax.Array  # i32[T] flat cache slot (block * block_size + offset); -1 = padding, not written
    token_rows: jax.Array  # i32[T] batch row of each token
    block_tables: jax.Array  # i32[B, max_blocks] pages of each row, in order
    context_lens: jax.Array  # i32[B] tokens in each row's cache once this step's K/V are written
    # Per-row views of the ragged batch, for layers that scan a row's tokens in order (DeltaNet):
    row_starts: jax.Array  # i32[B] index in T of each row's first query token
    row_lens: jax.Array  # i32[B] query tokens of each row in this step (0 = padding row)
    # Recurrent-state slots (hybrid models): each row restores its state from state_reads (-1: the
    # zero state of a fresh sequence) and writes its final state to state_writes (-1: padding row).
    state_reads: jax.Array
    state_writes: jax.Array
    # i32[L] = arange(L): only its static length matters, a bucketed bound on row_lens (L = 1 in a
    # pure decode step), so per-row layouts can be [B, L] instead of [B, T]. None: no bound known.
    query_bound: jax.Array | None = None
    # Verify steps (speculative decoding) on hybrid models: each row also writes its state after its
    # first keep_lens[b] tokens (those before its drafts) to slot state_keeps[b] (-1: none). None otherwise.
    state_keeps: jax.Array | None = None
    keep_lens: jax.Array | None = None
    # Models that take images: i32[3, T] M-RoPE positions (RoPE then ignores `positions`) and i32[T]
    # each token's row of the image-embedding pool (-1: its token embedding). None otherwise.
    rope_positions: jax.Array | None = None
    image_rows: jax.Array | None = None


class LayerKV(NamedTuple):
    k: jax.Array  # [num_blocks + 1, block_size, kv_heads, head_dim]: the last page is scratch
    v: jax.Array


KV_AXES = ("blocks", "block_offset", "kv_heads", "head_dim")  # of LayerKV.k and .v
Q_AXES = ("tokens", "q_heads", "head_dim")  # of the queries (and the output) of attention


def zeroed_layer_kv(cfg: ModelConfig, mesh: Mesh, num_blocks: int, block_size: int, dtype) -> LayerKV:
    """One attention layer's paged K/V, zeroed, heads split over tp (replicated heads counted): the
    pool's `num_blocks` pages and the scratch page."""
    heads = cfg.num_kv_heads * kv_head_replicas(cfg, mesh.shape["tp"])
    shape = (num_blocks + 1, block_size, heads, cfg.head_dim)
    return LayerKV(sharded_zeros(mesh, "kv cache k", shape, KV_AXES, dtype),
                   sharded_zeros(mesh, "kv cache v", shape, KV_AXES, dtype))


def set_rows(array: jax.Array, rows: jax.Array, values: jax.Array) -> jax.Array:
    """array with values[i] at array[rows[i]], every row in range (padding points at a scratch row).

    In-range rows need no bounds check: one row is a single dynamic-update-slice. A row that might
    be dropped (mode="drop") costs a read of the old value and a select besides, two more kernels
    per write on a GPU."""
    values = values.astype(array.dtype)
    if values.shape[0] == 1:
        return jax.lax.dynamic_update_slice(array, values, (rows[0],) + (0,) * (array.ndim - 1))
    return array.at[rows].set(values, mode="promise_in_bounds")


def write_kv(cache: LayerKV, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> LayerKV:
    """Scatter this step's k/v [T, kv_heads, head_dim] into their slots; padding (-1) writes the scratch page."""
    num_pages, block_size = cache.k.shape[:2]
    num_slots = num_pages * block_size
    slots = jnp.where(slot_mapping < 0, num_slots - 1, slot_mapping)

    def scatter(pages, new):
        new = rope_kv_write.to_page(new, pages.dtype)
        if new.shape[0] == 1:  # into the pages as they are: XLA:CPU copies a pool it updates through a reshape
            start = (slots[0] // block_size, slots[0] % block_size, 0, 0)
            return jax.lax.dynamic_update_slice(pages, new[None], start)
        flat = pages.reshape(num_slots, *pages.shape[2:])
        return set_rows(flat, slots, new).reshape(pages.shape)

    return LayerKV(scatter(cache.k, k), scatter(cache.v, v))


def rope_and_write_reference(q, k, v, cache: LayerKV, slots, cos, sin, q_norm=None, k_norm=None, eps: float = 1e-6):
    """Per-head RMSNorm of q and k (when their weights are given), RoPE on both, k and v written to
    their slots. Returns (rotated q, the updated cache)."""
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    return q, write_kv(cache, k, v, slots)


def paged_attention_reference(q: jax.Array, cache: LayerKV, meta: AttentionMetadata, scale: float) -> jax.Array:
    """Causal GQA attention of q [T, q_heads, D] over each token's row context, in plain jnp (the
    yardstick of the GPU kernels; `attend_reference` without the cache it hands back)."""
    return attend_reference(q, cache, meta, scale)[0]


def attend_reference(q: jax.Array, cache: LayerKV, meta: AttentionMetadata,
                     scale: float) -> tuple[jax.Array, LayerKV]:
    """Causal GQA attention of q [T, q_heads, D] over each token's row context, in plain jnp;
    returns it with the cache as it came out of the loop.

    Walks the block table CHUNK_KEYS keys at a time, for as many chunks as the longest context
    needs (a while loop: the work follows the contexts, not the table's width, so one program
    serves every width), with an online softmax in f32. Meant for CPUs and tests.

    The pages ride in the loop's carry and the layer keeps the pages the loop hands back: a loop
    that only read them would make XLA copy the whole pool every layer and step, so that the
    loop's own carried copy and the layer's output do not alias (on a CPU that copy, not the
    attention, set a decode step's cost).
    """
    T, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = cache.k.shape
    group = num_q_heads // num_kv_heads
    pages = max(1, CHUNK_KEYS // block_size)  # pages per chunk
    keys_per_chunk = pages * block_size

    width = -(-meta.block_tables.shape[1] // pages) * pages
    tables = jnp.pad(meta.block_tables, ((0, 0), (0, width - meta.block_tables.shape[1])))  # [B, width]
    # Keys a token sees: its row's context up to its own position.
    visible_len = jnp.minimum(meta.positions + 1, meta.context_lens[meta.token_rows])  # [T]
    num_chunks = jnp.minimum(-(-jnp.max(visible_len) // keys_per_chunk), width // pages)
    qg = q.reshape(T, num_kv_heads, group, head_dim)

    def chunk(carry):
        i, running_max, denominator, out, k_pages, v_pages = carry
        # The last page written back to itself, before the reads, through a barrier XLA cannot see
        # through: the loop then seems to change its pages (in place), so XLA takes the layer's
        # cache from the loop instead of keeping the pages it was given beside a copy of its own.
        k_pages, v_pages = (x.at[-1].set(jax.lax.optimization_barrier(x[-1])) for x in (k_pages, v_pages))
        page_ids = jax.lax.dynamic_slice_in_dim(tables, i * pages, pages, axis=1)[meta.token_rows]  # [T, pages]
        keys, values = (x[page_ids].reshape(T, keys_per_chunk, num_kv_heads, head_dim).astype(q.dtype)
                        for x in (k_pages, v_pages))  # [T, S, kv_heads, D]
        scores = jnp.einsum("tkgd,tskd->tkgs", qg, keys, preferred_element_type=jnp.float32) * scale
        key_pos = i * keys_per_chunk + jnp.arange(keys_per_chunk)
        scores = jnp.where((key_pos[None, :] < visible_len[:, None])[:, None, None, :], scores, _MASKED)
        new_max = jnp.maximum(running_max, scores.max(axis=-1))
        rescale = jnp.exp(running_max - new_max)
        probs = jnp.exp(scores - new_max[..., None])
        denominator = denominator * rescale + probs.sum(axis=-1)
        out = out * rescale[..., None] + jnp.einsum(
            "tkgs,tskd->tkgd", probs.astype(values.dtype), values, preferred_element_type=jnp.float32)
        return i + 1, new_max, denominator, out, k_pages, v_pages

    stats = jnp.full((T, num_kv_heads, group), _MASKED, jnp.float32)
    init = (jnp.int32(0), stats, jnp.zeros_like(stats), jnp.zeros((T, num_kv_heads, group, head_dim), jnp.float32),
            cache.k, cache.v)
    _, _, denominator, out, k_pages, v_pages = jax.lax.while_loop(lambda c: c[0] < num_chunks, chunk, init)
    out = out / jnp.maximum(denominator, 1e-30)[..., None]
    return (out.reshape(T, num_q_heads, head_dim).astype(q.dtype),
            LayerKV(k_pages, v_pages))


# ----------------------------------------------------------------------------- dispatch


IMPLS = ("kernel", "reference")


@dataclasses.dataclass(frozen=True)
class PagedAttention:
    """The attention a model calls, with its implementation and mesh fixed up front.

    ModelRunner builds one (`choose_attention`) and closes the jitted step over it, so a trace is
    a function of its inputs alone: no globals, no environment read while tracing.

    impl "kernel": the Pallas kernel (jtp/kernels; Pallas' interpreter off-GPU: slow, for tests),
    where the shapes suit it; "reference": `paged_attention_reference`. The layers read the same
    choice for their other kernels (the DeltaNet decode step, jtp/models/delta_rule.py; the residual
    add + RMSNorm, qwen3.add_rms_norm). A pallas_call is opaque to XLA's SPMD partitioner, so with a
    mesh whose "tp" axis is > 1 the kernel runs inside shard_map over it (heads split, metadata
    replicated); attention is head-local, so no collective is needed.
    """

    impl: str = "reference"
    mesh: Mesh | None = None

    def __post_init__(self):
        if self.impl not in IMPLS:
            raise ValueError(f"attention {self.impl!r}: expected kernel or reference (JTP_ATTENTION also takes auto)")

    @property
    def tp(self) -> int:
        """Devices the heads split over (1 without a mesh)."""
        return tp_size(self.mesh) if self.mesh is not None else 1

    def __call__(self, q: jax.Array, cache: LayerKV, meta: AttentionMetadata,
                 scale: float) -> tuple[jax.Array, LayerKV]:
        """(attention output, the cache to keep: the one given, or the reference loop's own)."""
        tp = self.tp
        if (
            self.impl == "kernel"
            and supported(q.shape, cache.k.shape)
            and q.shape[1] % tp == 0
            and cache.k.shape[2] % tp == 0
        ):
            return paged_attention_kernel(q, cache, meta, scale, self.mesh if tp > 1 else None), cache
        return attend_reference(q, cache, meta, scale)

    def rope_and_write(self, q, k, v, cache: LayerKV, meta: AttentionMetadata, cos, sin, q_norm=None, k_norm=None,
                       eps: float = 1e-6):
        """`rope_and_write_reference`; impl "kernel": one fused kernel where it applies
        (jtp/kernels/rope_kv_write.py: few tokens, rotation over the whole head, cache in q's dtype or float8)."""
        tp = self.tp
        if (
            self.impl == "kernel"
            and rope_kv_write.supported(q.shape[0], q.shape[2], cos.shape[-1], q.dtype, cache.k.dtype)
            and q.shape[1] % tp == 0
            and k.shape[1] % tp == 0
        ):
            return rope_and_write_kernel(q, k, v, cache, meta.slot_mapping, cos, sin, q_norm, k_norm, eps,
                                         self.mesh if tp > 1 else None)
        return rope_and_write_reference(q, k, v, cache, meta.slot_mapping, cos, sin, q_norm, k_norm, eps)


def choose_attention(mesh: Mesh | None = None, impl: str | None = None) -> PagedAttention:
    """The kernel on GPUs, the reference elsewhere; `impl` or JTP_ATTENTION=reference|kernel|auto
    (read here, once) forces one."""
    impl = impl or os.environ.get("JTP_ATTENTION", "").strip().lower() or "auto"
    if impl == "auto":
        impl = "kernel" if jax.default_backend() == "gpu" else "reference"
    return PagedAttention(impl, mesh)


def paged_attention_kernel(
    q: jax.Array, cache: LayerKV, meta: AttentionMetadata, scale: float, mesh: Mesh | None = None
) -> jax.Array:
    """The Pallas kernel, sharded over mesh's "tp" axis when given; interpreted off-GPU."""
    interpret = jax.default_backend() != "gpu"
    # Static bound on tokens per row: 1 in a pure decode step, which then runs the decode kernel.
    max_row_len = meta.query_bound.shape[0] if meta.query_bound is not None else None

    def local(q, k, v, positions, token_rows, block_tables, context_lens, row_starts, row_lens):
        return ragged_paged_attention(
            q, k, v, positions, block_tables, context_lens, row_starts, row_lens, scale=scale, interpret=interpret,
            max_row_len=max_row_len, token_rows=token_rows,
        )

    args = (
        q, cache.k, cache.v, meta.positions, meta.token_rows, meta.block_tables, meta.context_lens,
        meta.row_starts, meta.row_lens,
    )
    if mesh is None:
        return local(*args)
    head, kv, rep = partition_spec(Q_AXES), partition_spec(KV_AXES), P()  # metadata: replicated
    in_specs = (head, kv, kv, rep, rep, rep, rep, rep, rep)
    # check_vma=False: the pallas_call has no varying-manual-axes rule to check against.
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=head, check_vma=False)(*args)


def rope_and_write_kernel(q, k, v, cache: LayerKV, slots, cos, sin, q_norm, k_norm, eps: float,
                          mesh: Mesh | None = None):
    """The fused Pallas kernel, per head shard inside shard_map when given a mesh; interpreted off-GPU."""
    interpret = jax.default_backend() != "gpu"

    def local(q, k, v, k_pages, v_pages, slots, cos, sin, q_norm, k_norm):
        q, k_pages, v_pages = rope_kv_write.rope_and_write(
            q, k, v, k_pages, v_pages, slots, cos, sin, q_norm, k_norm, eps=eps, interpret=interpret)
        return q, LayerKV(k_pages, v_pages)

    args = (q, k, v, cache.k, cache.v, slots, cos, sin, q_norm, k_norm)
    if mesh is None:
        return local(*args)
    head, kv, rep = partition_spec(Q_AXES), partition_spec(KV_AXES), P()
    in_specs = (head, head, head, kv, kv, rep, rep, rep, rep if q_norm is not None else None,
                rep if k_norm is not None else None)
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=(head, LayerKV(kv, kv)),
                         check_vma=False)(*args)
