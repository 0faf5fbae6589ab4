"""The partition rules: one table from logical axes to mesh axes, the one place that says how
weights, caches and the kernels' operands are split.

Every parameter names the logical axis of each of its dims where it is declared (a model
family's `param_layout`: `Tensor("...q_proj.weight", (q_size, H), ("q_heads_x_dim", "embed"))`),
and so does every cache array and kernel operand. The table maps each logical axis to the mesh
axis "tp" or to None (not split). An axis missing from the table, or a split dim that "tp" does
not divide, is a `ShardingError` naming the array, never a silent replication.

Tensor parallelism follows Megatron: column-parallel q/k/v and gate/up (their output dim split),
row-parallel o_proj and down_proj (their input dim split). Activations stay whole between
blocks, so XLA (Auto mesh axes) inserts one all-reduce after each row-parallel matmul: two per
layer. The embedding and lm_head are split over the vocabulary. Routed experts are split inside
each expert (intra-expert TP over the intermediate dim; docs/architecture.md says why) or, with
expert parallelism, whole experts over the devices: the two tables below differ only there.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jtp.errors import ShardingError

Rules = Mapping[str, "str | None"]
Axes = Sequence["str | None"]

TENSOR_PARALLEL: Rules = {
    # Embedding and LM head [vocab, embed]: vocab-parallel. `embed` (the hidden size) is never
    # split: activations are whole on every device between row- and column-parallel matmuls.
    "vocab": "tp",
    "embed": None,
    # Attention projections, heads flattened with their head dim (head-major, so a split keeps
    # whole heads): q/k/v [heads*D, embed] column-parallel, o_proj [embed, q_heads*D] row-parallel.
    # KV heads are stored several times when tp > num_kv_heads (RepeatedHeads), so they divide.
    "q_heads_x_dim": "tp",
    "kv_heads_x_dim": "tp",
    "head_dim": None,  # per-head q/k norms: every device normalises its own heads
    # The attention kernel's operands: q [tokens, q_heads, head_dim], the paged K/V
    # [blocks, block_offset, kv_heads, head_dim]; attention is head-local, no collective.
    "tokens": None,
    "q_heads": "tp",
    "kv_heads": "tp",
    "blocks": None,
    "block_offset": None,
    # Dense MLP and shared expert: gate/up [mlp, embed] column-parallel, down [embed, mlp] row-parallel.
    "mlp": "tp",
    # Routed experts, gate/up [experts, embed, expert_mlp] and down [experts, expert_mlp, embed]:
    # intra-expert TP splits every expert's intermediate dim (down is then row-parallel).
    "experts": None,
    "expert_mlp": "tp",
    # A router's outputs (one score per expert; the shared expert's one gate): every device routes
    # every token, so router weights are whole.
    "scores": None,
    # Gated DeltaNet: q/k/v/z/b/a and the q/k/v conv weights are split by key or value heads (the
    # segment-wise split of the fused checkpoint tensors); value head h*r.. belongs to key head h,
    # so each device keeps whole key heads with the value heads they serve and the mixer is
    # head-local until out_proj [embed, v_heads*dv], row-parallel.
    "gdn_k_heads_x_dim": "tp",
    "gdn_v_heads_x_dim": "tp",
    "gdn_v_heads": "tp",
    "gdn_k_dim": None,
    "gdn_v_dim": None,
    "conv_taps": None,
    "state_slots": None,  # per-sequence DeltaNet states [slots, ...]: split like their channels
    # The MTP head's fc [embed, embed_concat] over [norm(embedding); norm(hidden)]: whole.
    "embed_concat": None,
    # Qwen3.5's vision tower (jtp/models/vision.py): replicated for now, every device encodes every
    # image (it is ~0.4B parameters at most; heads could split like the text attention's later).
    "vision_embed": None,
    "vision_qkv": None,
    "vision_mlp": None,
    "vision_merged": None,
    "vision_positions": None,
    "patch_channels": None,
    "patch_frames": None,
    "patch_pixels": None,
}

# --enable-expert-parallel: device d holds experts [d*E/tp, (d+1)*E/tp) whole.
EXPERT_PARALLEL: Rules = {**TENSOR_PARALLEL, "experts": "tp", "expert_mlp": None}


def rules_for(expert_parallel: bool) -> Rules:
    return EXPERT_PARALLEL if expert_parallel else TENSOR_PARALLEL


def partition_spec(axes: Axes, rules: Rules = TENSOR_PARALLEL, name: str = "array") -> P:
    """The PartitionSpec of an array whose dims have these logical axes."""
    unknown = [a for a in axes if a not in rules]
    if unknown:
        raise ShardingError(
            f"{name}: logical axis {unknown[0]!r} (axes {tuple(axes)}) has no partition rule; "
            "add it to jtp/parallel/rules.py"
        )
    return P(*(rules[a] for a in axes))


def logical_sharding(
    mesh: Mesh, name: str, shape: tuple[int, ...], axes: Axes, expert_parallel: bool = False
) -> NamedSharding:
    """The sharding of array `name` (a parameter path, a cache array) of this shape over the mesh.

    Every dim needs a logical axis the rules know, and every split dim must divide by its mesh axis."""
    if len(axes) != len(shape):
        raise ShardingError(f"{name} {list(shape)}: {len(axes)} logical axes {tuple(axes)} for {len(shape)} dims")
    spec = partition_spec(axes, rules_for(expert_parallel), f"{name} {list(shape)}")
    for dim, axis, mesh_axis in zip(shape, axes, spec):
        if mesh_axis is not None and dim % mesh.shape[mesh_axis]:
            raise ShardingError(
                f"{name} {list(shape)}: dim {dim} (logical axis {axis!r}) is split over mesh axis "
                f"{mesh_axis!r} but does not divide by {mesh_axis}={mesh.shape[mesh_axis]}"
            )
    return NamedSharding(mesh, spec)


_shapes_only = contextvars.ContextVar("shapes_only", default=False)


@contextlib.contextmanager
def shapes_only():
    """Inside it, `sharded_zeros` allocates nothing and returns the array's shape, dtype and sharding
    (what compiling a program over the array needs)."""
    token = _shapes_only.set(True)
    try:
        yield
    finally:
        _shapes_only.reset(token)


def sharded_zeros(mesh: Mesh, name: str, shape: tuple[int, ...], axes: Axes, dtype) -> jax.Array | jax.ShapeDtypeStruct:
    """A zeroed array (a cache), allocated on the devices in the sharding its axes give."""
    sharding = logical_sharding(mesh, name, shape, axes)
    if _shapes_only.get():
        return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=sharding)
    return _zeros(tuple(shape), jnp.dtype(dtype), sharding)()


@functools.cache
def _zeros(shape: tuple[int, ...], dtype, sharding: NamedSharding):
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)  # one compilation per kind of array
