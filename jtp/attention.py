"""Paged attention: where K/V live and how a ragged batch of query tokens reads them.

The KV cache of one layer is a pair of page arrays [num_blocks, block_size, kv_heads, head_dim].
A step processes T flattened query tokens that belong to B batch rows (decode tokens and
prefill chunks mixed); `AttentionMetadata` says, for each token, where its K/V goes and which
row it belongs to, and for each row, which pages hold its context.

The model only calls `write_kv` and `paged_attention`; a fast GPU kernel replaces the
reference implementation behind `paged_attention` without touching the model.
"""

from __future__ import annotations

import contextlib
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

# Masked scores use a large finite value, not -inf: a padding token whose row has no context
# then yields a harmless uniform softmax instead of NaN.
_MASKED = -1e30


class AttentionMetadata(NamedTuple):
    positions: jax.Array  # i32[T] absolute position of each query token (also drives RoPE)
    slot_mapping: jax.Array  # i32[T] flat cache slot (block * block_size + offset); -1 = padding, not written
    token_rows: jax.Array  # i32[T] batch row of each token
    block_tables: jax.Array  # i32[B, max_blocks] pages of each row, in order
    context_lens: jax.Array  # i32[B] tokens in each row's cache once this step's K/V are written
    # Per-row views of the ragged batch, for layers that scan a row's tokens in order (DeltaNet):
    row_starts: jax.Array  # i32[B] index in T of each row's first query token
    row_lens: jax.Array  # i32[B] query tokens of each row in this step (0 = padding row)
    state_slots: jax.Array  # i32[B] recurrent-state slot of each row (-1 = padding row)
    # i32[L] = arange(L): only its static length matters, a bucketed bound on row_lens (L = 1 in a
    # pure decode step), so per-row layouts can be [B, L] instead of [B, T]. None: no bound known.
    query_bound: jax.Array | None = None


class LayerKV(NamedTuple):
    k: jax.Array  # [num_blocks, block_size, kv_heads, head_dim]
    v: jax.Array


def write_kv(cache: LayerKV, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> LayerKV:
    """Scatter this step's k/v [T, kv_heads, head_dim] into their slots; padding (-1) is dropped."""
    num_blocks, block_size = cache.k.shape[:2]
    num_slots = num_blocks * block_size
    # Out-of-range indices are dropped by mode="drop"; -1 would wrap around, so send it past the end.
    slots = jnp.where(slot_mapping < 0, num_slots, slot_mapping)

    def scatter(pages, new):
        flat = pages.reshape(num_slots, *pages.shape[2:])
        flat = flat.at[slots].set(new.astype(pages.dtype), mode="drop")
        return flat.reshape(pages.shape)

    return LayerKV(scatter(cache.k, k), scatter(cache.v, v))


def paged_attention_reference(q: jax.Array, cache: LayerKV, meta: AttentionMetadata, scale: float) -> jax.Array:
    """Causal GQA attention of q [T, q_heads, D] over each token's row context, in plain jnp.

    Gathers every token's context pages (T x max_blocks x block_size keys): simple and exact,
    meant for CPUs, tests and as the yardstick of the GPU kernels.
    """
    T, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = cache.k.shape
    group = num_q_heads // num_kv_heads

    tables = meta.block_tables[meta.token_rows]  # [T, max_blocks]
    slots = (tables[:, :, None] * block_size + jnp.arange(block_size)).reshape(T, -1)  # [T, S]
    flat_k = cache.k.reshape(-1, num_kv_heads, head_dim)
    flat_v = cache.v.reshape(-1, num_kv_heads, head_dim)
    keys, values = flat_k[slots], flat_v[slots]  # [T, S, kv_heads, D]

    qg = q.reshape(T, num_kv_heads, group, head_dim)
    scores = jnp.einsum("tkgd,tskd->tkgs", qg, keys, preferred_element_type=jnp.float32) * scale
    key_pos = jnp.arange(slots.shape[1])
    visible = (key_pos[None, :] <= meta.positions[:, None]) & (
        key_pos[None, :] < meta.context_lens[meta.token_rows][:, None]
    )
    scores = jnp.where(visible[:, None, None, :], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("tkgs,tskd->tkgd", probs.astype(values.dtype), values, preferred_element_type=jnp.float32)
    return out.reshape(T, num_q_heads, head_dim).astype(q.dtype)


# ----------------------------------------------------------------------------- dispatch
#
# `paged_attention` picks, at trace time, the Pallas kernel (jtp/kernels) on GPUs and the reference
# elsewhere. JTP_ATTENTION=reference|kernel forces one (on a CPU "kernel" runs Pallas' interpreter:
# slow, for tests). A pallas_call is opaque to XLA's SPMD partitioner, so under tensor parallelism
# the kernel runs inside shard_map over the mesh's "tp" axis (heads split, metadata replicated);
# attention is head-local, so no collective is needed. The mesh comes from `attention_mesh(mesh)`
# or, failing that, from the ambient `jax.set_mesh` context; without
# either, the kernel is called unsharded, which is right for one device.

_MESH = None


@contextlib.contextmanager
def attention_mesh(mesh):
    """Within this block (wrap the *tracing* of a jitted step), attention shards over mesh's "tp"."""
    global _MESH
    prev, _MESH = _MESH, mesh
    try:
        yield
    finally:
        _MESH = prev


def attention_impl() -> str:
    """"kernel" or "reference": what paged_attention will trace right now."""
    forced = os.environ.get("JTP_ATTENTION", "").strip().lower()
    if forced in ("reference", "kernel"):
        return forced
    if forced not in ("", "auto"):
        raise ValueError(f"JTP_ATTENTION={forced!r}: expected reference, kernel or auto")
    return "kernel" if jax.default_backend() == "gpu" else "reference"


def _tp_mesh():
    mesh = _MESH
    if mesh is None:
        try:
            mesh = jax.sharding.get_abstract_mesh()
        except Exception:  # noqa: BLE001 - older jax has no ambient mesh
            mesh = None
    if mesh is None or "tp" not in getattr(mesh, "axis_names", ()) or mesh.shape["tp"] == 1:
        return None
    return mesh


def paged_attention_kernel(q: jax.Array, cache: LayerKV, meta: AttentionMetadata, scale: float, mesh=None) -> jax.Array:
    """The Pallas kernel, sharded over mesh's "tp" axis when given; interpreted off-GPU."""
    from jtp.kernels import ragged_paged_attention

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
    head, kv, rep = P(None, "tp", None), P(None, None, "tp", None), P()
    in_specs = (head, kv, kv, rep, rep, rep, rep, rep, rep)
    smap = getattr(jax, "shard_map", None)
    if smap is not None:
        try:
            fn = smap(local, mesh=mesh, in_specs=in_specs, out_specs=head, check_vma=False)
        except TypeError:
            fn = smap(local, mesh=mesh, in_specs=in_specs, out_specs=head, check_rep=False)
    else:  # jax < 0.7
        from jax.experimental.shard_map import shard_map

        fn = shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=head, check_rep=False)
    return fn(*args)


def paged_attention(q: jax.Array, cache: LayerKV, meta: AttentionMetadata, scale: float) -> jax.Array:
    """The attention the model calls: the GPU kernel on GPUs, the reference elsewhere (see above)."""
    from jtp.kernels import supported

    if attention_impl() == "kernel" and supported(q.shape, cache.k.shape):
        mesh = _tp_mesh()
        tp = mesh.shape["tp"] if mesh is not None else 1
        if q.shape[1] % tp == 0 and cache.k.shape[2] % tp == 0:
            return paged_attention_kernel(q, cache, meta, scale, mesh)
    return paged_attention_reference(q, cache, meta, scale)
