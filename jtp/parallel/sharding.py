"""The device mesh, and the model-level checks that a tensor-parallel size fits a config.

How each array is split is not here: every parameter and cache array names its logical axes
where it is declared, and jtp/parallel/rules.py maps those to the mesh. The `dp` axis is size 1
for now and reserved for data-parallel replicas.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jtp.config.model_config import ModelConfig
from jtp.errors import ShardingError


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


def on_each_copy(fn, mesh: Mesh | None, *args):
    """fn(*args) where the args and results are replicated over "tp": under tensor parallelism each
    device runs fn on its own copy inside shard_map (a pallas_call is opaque to XLA's partitioner)."""
    if mesh is None or tp_size(mesh) == 1:
        return fn(*args)
    return jax.shard_map(fn, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)(*args)


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


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
