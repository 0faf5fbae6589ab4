"""Mesh construction and the partition rules: the one place that says how weights are split.

Tensor parallelism (`tp` axis) follows Megatron: column-parallel q/k/v and gate/up (split the
output dim), row-parallel o_proj and down_proj (split the input dim). Activations stay
replicated between blocks, so XLA inserts exactly one all-reduce after each row-parallel
matmul: two per layer. Embedding and lm_head are split over the vocabulary. MoE experts are
split inside each expert (intra-expert TP over the intermediate dim; docs/architecture.md
says why), or with expert parallelism whole experts over the devices (EXPERT_PARALLEL_RULES;
jtp/models/moe.py computes either inside shard_map). The `dp` axis is size 1 for now and reserved for
data-parallel replicas.
"""

from __future__ import annotations

import logging
import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jtp.config.model_config import ModelConfig
from jtp.errors import ShardingError

log = logging.getLogger(__name__)

# Routed experts, gate/up [E, H, I] and down [E, I, H]: split I inside every expert (intra-expert
# TP, the default; down is then row-parallel), or whole experts per device (expert parallelism).
# jtp/models/moe.py's shard_map takes these same specs.
EXPERTS_TP_SPECS = {"gate": P(None, None, "tp"), "up": P(None, None, "tp"), "down": P(None, "tp", None)}
EXPERTS_EP_SPEC = P("tp", None, None)

# (pattern on the parameter path, spec). First match wins; the path looks like "layers.3.q_proj".
PARTITION_RULES: list[tuple[str, P]] = [
    (r"^(embed|lm_head)$", P("tp", None)),  # vocab-parallel
    (r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)$", P("tp", None)),  # column-parallel
    (r"\.(q_bias|k_bias|v_bias)$", P("tp")),
    (r"\.(o_proj|down_proj)$", P(None, "tp")),  # row-parallel: XLA all-reduces the output
    (r"\.experts_gate$", EXPERTS_TP_SPECS["gate"]),
    (r"\.experts_up$", EXPERTS_TP_SPECS["up"]),
    (r"\.experts_down$", EXPERTS_TP_SPECS["down"]),  # all-reduce after
    # Hybrid families. Gated DeltaNet: q/k/v/z/b/a projections and the conv weights of the
    # q/k/v channels are separate parameters, each split contiguously by (key or value) heads,
    # which is the segment-wise split of the fused checkpoint tensors.
    (r"\.gdn_(q|k|v|z|b|a|conv_q|conv_k|conv_v)$", P("tp", None)),
    (r"\.gdn_(A_log|dt_bias)$", P("tp")),  # [Hv]
    (r"\.(shared_gate|shared_up)$", P("tp", None)),  # shared expert, column-parallel
    (r"\.(gdn_out|shared_down)$", P(None, "tp")),  # row-parallel: all-reduce after
    (r".*", P()),  # norms, router, o_bias: replicated
]

# --enable-expert-parallel: device d holds experts [d*E/tp, (d+1)*E/tp) whole.
EXPERT_PARALLEL_RULES: list[tuple[str, P]] = [(r"\.experts_(gate|up|down)$", EXPERTS_EP_SPEC)]

KV_CACHE_SPEC = P(None, None, "tp", None)  # [blocks, block_size, kv_heads, head_dim]: split heads
CONV_STATE_SPEC = P(None, "tp", None)  # [max_seqs, channels, K-1]: channels split like the conv weights
RECURRENT_STATE_SPEC = P(None, "tp", None, None)  # [max_seqs, Hv, dk, dv]: split value heads


def make_mesh(tensor_parallel: int, devices=None) -> Mesh:
    """A (dp=1, tp) mesh over the first `tensor_parallel` devices, with compiler-chosen collectives."""
    devices = list(jax.devices() if devices is None else devices)
    if tensor_parallel < 1 or tensor_parallel > len(devices):
        platform = devices[0].platform if devices else "none"
        # On CPU, XLA shows one device unless told to split the host (tests and trials of tp do this).
        hint = (f"; on CPU, XLA_FLAGS=--xla_force_host_platform_device_count={tensor_parallel} makes that many"
                if platform == "cpu" and tensor_parallel > 1 else "")
        raise ShardingError(
            f"tensor_parallel_size={tensor_parallel} but {len(devices)} device(s) are visible ({platform}){hint}"
        )
    grid = np.array(devices[:tensor_parallel]).reshape(1, tensor_parallel)
    # Auto axes: XLA picks the collectives (jax.make_mesh would default to Explicit axes).
    axis_types = (jax.sharding.AxisType.Auto,) * 2
    return Mesh(grid, ("dp", "tp"), axis_types=axis_types)


def tp_size(mesh: Mesh) -> int:
    return mesh.shape["tp"]


def kv_head_replicas(cfg: ModelConfig, tp: int) -> int:
    """How many copies of each KV head we store so every tp rank owns one (1 = no replication).

    With tp > num_kv_heads (e.g. 2 KV heads over 4 devices), rank r keeps a copy of KV head
    r // replicas, which is exactly the head its query heads attend to.
    """
    if tp <= cfg.num_kv_heads:
        if cfg.num_kv_heads % tp:
            raise ShardingError(f"num_key_value_heads ({cfg.num_kv_heads}) is not divisible by tp={tp}")
        return 1
    if tp % cfg.num_kv_heads:
        raise ShardingError(
            f"tp={tp} exceeds num_key_value_heads ({cfg.num_kv_heads}) and is not a multiple of it, "
            "so KV heads cannot be replicated evenly"
        )
    return tp // cfg.num_kv_heads


def validate_tp(cfg: ModelConfig, tp: int, expert_parallel: bool = False) -> None:
    checks = [("num_attention_heads", cfg.num_heads)]
    if expert_parallel:
        if not cfg.num_experts:
            raise ShardingError("expert parallelism needs a mixture-of-experts model; this one has no routed experts")
        checks.append(("num_experts", cfg.num_experts))
    if any(not cfg.is_moe_layer(i) for i in range(cfg.num_layers)):
        checks.append(("intermediate_size", cfg.intermediate_size))
    if cfg.num_experts and not expert_parallel:
        checks.append(("moe_intermediate_size", cfg.moe_intermediate_size))
    if cfg.shared_expert_intermediate_size:
        checks.append(("shared_expert_intermediate_size", cfg.shared_expert_intermediate_size))
    if "linear_attention" in cfg.layer_types:
        # Each rank keeps whole key heads and the value heads they serve (Hv is a multiple of Hk).
        checks.append(("linear_num_key_heads", cfg.linear_num_key_heads))
        checks.append(("linear_num_value_heads", cfg.linear_num_value_heads))
    for name, value in checks:
        if value % tp:
            raise ShardingError(f"{name} ({value}) is not divisible by tensor_parallel_size={tp}")
    kv_head_replicas(cfg, tp)


def spec_for(path: str, shape: tuple[int, ...], tp: int, expert_parallel: bool = False) -> P:
    for pattern, spec in (EXPERT_PARALLEL_RULES if expert_parallel else []) + PARTITION_RULES:
        if re.search(pattern, path):
            break
    # A vocabulary that does not divide evenly stays replicated rather than failing.
    for dim, axis in zip(shape, spec):
        if axis == "tp" and dim % tp:
            log.info("%s %s: dim %d not divisible by tp=%d, replicating", path, shape, dim, tp)
            return P()
    return spec


def named_sharding(mesh: Mesh, path: str, shape: tuple[int, ...], expert_parallel: bool = False) -> NamedSharding:
    return NamedSharding(mesh, spec_for(path, shape, tp_size(mesh), expert_parallel))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
