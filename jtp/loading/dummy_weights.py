"""`--load-format dummy` (vLLM's name for it): random weights at the model's real shapes, drawn on
the devices in their serving sharding, from config.json alone.

For benchmarks of models whose checkpoint is not on the machine or does not fit its disk
(Qwen3-235B-A22B is ~470 GB in bf16; an 8-GPU H200 host has 235 GiB of disk): each step costs what
the real model's does, and its output is meaningless. The values follow
scripts/make_random_checkpoint.py, so routers spread tokens over the experts as that script's
checkpoints do: N(0, 0.02) for matrices, embeddings and biases; 1 + N(0, 0.02) for norm weights
applied as w (Qwen3's RMSNorm, the Gated DeltaNet output norm) and for dt_bias; N(0, 0.02) for the
hybrids' zero-centred norms, applied as (1 + w).

Each parameter is drawn from its own key (the seed folded with its path) at its tp=1 shape with
JAX's partitionable threefry, so every tensor-parallel size, and every process of a group, draws the
same model: KV heads replicated for tp > num_key_value_heads are drawn once and then repeated.
"""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp

from jtp.config.model_config import HYBRID_MODEL_TYPES, ModelConfig
from jtp.loading.param_tree import repeat_kv_heads, unflatten
from jtp.models import family_of
from jtp.parallel.rules import logical_sharding
from jtp.parallel.sharding import replicated, tp_size

STD = 0.02


def init_mean(cfg: ModelConfig, tensor_name: str) -> float:
    """Mean of a checkpoint tensor's random values: 1 where the model multiplies by the weight itself."""
    if tensor_name.endswith("dt_bias"):
        return 1.0
    if tensor_name.endswith("norm.weight"):
        zero_centred = cfg.model_type in HYBRID_MODEL_TYPES and not tensor_name.endswith("linear_attn.norm.weight")
        return 0.0 if zero_centred else 1.0
    return 0.0


@functools.lru_cache(maxsize=None)
def _sampler(shape: tuple[int, ...], dtype, mean: float, sharding):
    """A jitted draw of one parameter, computed shard by shard where it will live."""
    return jax.jit(
        lambda key: (jax.random.normal(key, shape, jnp.float32) * STD + mean).astype(dtype), out_shardings=sharding
    )


def random_params(cfg: ModelConfig, mesh, dtype, expert_parallel: bool = False, mtp: bool = False,
                  seed: int = 0, keep=None) -> dict:
    """The params pytree `load_params` would return for this config, with random values (each
    parameter's drawn from its path: the same values whichever `keep` selects them)."""
    family = family_of(cfg)
    tp = tp_size(mesh)
    canonical, target = family.param_layout(cfg, 1, mtp), family.param_layout(cfg, tp, mtp)
    base = jax.random.key(seed)
    flat = {}
    for path, source in target.items():
        if keep is not None and not keep(path):
            continue
        mean = init_mean(cfg, next(iter(source.expected())))  # a source's tensors share one kind
        key = jax.random.fold_in(base, zlib.crc32(path.encode()))
        sharding = logical_sharding(mesh, path, source.shape, source.axes, expert_parallel)
        shape = canonical[path].shape
        if shape == source.shape:
            flat[path] = _sampler(shape, dtype, mean, sharding)(key)
            continue
        # A KV projection with heads replicated over the ranks: every copy of a head is the same head.
        value = repeat_kv_heads(_sampler(shape, dtype, mean, replicated(mesh))(key), cfg, tp)
        flat[path] = jax.jit(lambda v: v, out_shardings=sharding)(value)
    return unflatten(flat, cfg.num_layers)
