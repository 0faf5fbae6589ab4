"""The parameter tree the models read, and its flat "layers.3.q_proj" form the loaders write."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jtp.config.model_config import ModelConfig
from jtp.parallel.sharding import kv_head_replicas


def unflatten(flat: dict[str, jax.Array], num_layers: int) -> dict:
    """"layers.3.q_proj" -> tree["layers"][3]["q_proj"]; "mtp.layer.q_proj" -> tree["mtp"]["layer"]["q_proj"]."""
    tree: dict = {"layers": [{} for _ in range(num_layers)]}
    for path, value in flat.items():
        if path.startswith("layers."):
            _, i, name = path.split(".", 2)
            tree["layers"][int(i)][name] = value
        elif path.startswith("mtp."):
            *parents, name = path.split(".")
            node = tree
            for key in parents:
                node = node.setdefault(key, {})
            node[name] = value
        else:
            tree[path] = value
    return tree



def flatten(tree: dict) -> dict[str, jax.Array]:
    flat = {k: v for k, v in tree.items() if k not in ("layers", "mtp")}
    for i, layer in enumerate(tree["layers"]):
        flat.update({f"layers.{i}.{k}": v for k, v in layer.items()})
    mtp = tree.get("mtp", {})
    flat.update({f"mtp.{k}": v for k, v in mtp.items() if k != "layer"})
    flat.update({f"mtp.layer.{k}": v for k, v in mtp.get("layer", {}).items()})
    return flat



def repeat_kv_heads(value: jax.Array, cfg: ModelConfig, tp: int) -> jax.Array:
    """A KV projection [kv_heads * D, ...] with each head stored kv_head_replicas(cfg, tp) times in a
    row, as the loader lays it out for tp > num_key_value_heads (`RepeatedHeads`)."""
    replicas = kv_head_replicas(cfg, tp)
    value = value.reshape(cfg.num_kv_heads, 1, cfg.head_dim, *value.shape[1:])
    value = jnp.broadcast_to(value, (cfg.num_kv_heads, replicas, *value.shape[2:]))
    return value.reshape(cfg.num_kv_heads * replicas * cfg.head_dim, *value.shape[3:])
