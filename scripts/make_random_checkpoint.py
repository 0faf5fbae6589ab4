#!/usr/bin/env python
"""Write a Hugging Face-format Qwen3 model directory with random weights (for benchmarks).

    python scripts/make_random_checkpoint.py --preset qwen3-0.6b --out /tmp/qwen3-0.6b
    python scripts/make_random_checkpoint.py --preset qwen3-8b --out /tmp/qwen3-8b --generator jax

config.json carries the published shapes of the preset (the real Qwen3 configs), and the
weights are random: N(0, 0.02) for matrices and embeddings, 1 + N(0, 0.02) for norm weights.
So the model's output is meaningless but its cost is exactly the real model's. Nothing is
downloaded: this is how benchmark machines without network access get weights.

Tensors are generated one at a time, split into chunks that a pool of threads fills (numpy's
generators release the GIL), and written with `safetensors.numpy.save_file` in the requested
dtype. Checkpoints larger than `--shard-gib` are written as several files plus
`model.safetensors.index.json`, so host memory stays around one shard.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

# Published Qwen3 dense configs (Hugging Face Qwen/Qwen3-*), plus small ones for CPUs.
_COMMON = dict(
    architectures=["Qwen3ForCausalLM"],
    model_type="qwen3",
    attention_bias=False,
    attention_dropout=0.0,
    bos_token_id=151643,
    eos_token_id=151645,
    head_dim=128,
    hidden_act="silu",
    initializer_range=0.02,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_scaling=None,
    rope_theta=1000000.0,
    sliding_window=None,
    use_cache=True,
    use_sliding_window=False,
    vocab_size=151936,
)

PRESETS: dict[str, dict] = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
    "qwen3-14b": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
                      num_attention_heads=40, num_key_value_heads=8, tie_word_embeddings=False),
    "qwen3-32b": dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                      num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False),
    # CPU-sized: same structure (GQA, qk-norm, untied head), seconds to run.
    "qwen3-tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, vocab_size=1024, max_position_embeddings=4096,
                       tie_word_embeddings=False, bos_token_id=None, eos_token_id=1023),
    "qwen3-small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                        num_key_value_heads=4, head_dim=64, vocab_size=8192, max_position_embeddings=8192,
                        tie_word_embeddings=True, bos_token_id=None, eos_token_id=8191),
}

WEIGHT_STD = 0.02
CHUNK = 1 << 24  # elements per generator call


def make_config(preset: str, dtype: str) -> dict:
    if preset not in PRESETS:
        raise SystemExit(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    cfg = {**_COMMON, **PRESETS[preset]}
    cfg["max_window_layers"] = cfg["num_hidden_layers"]
    cfg["torch_dtype"] = dtype  # transformers 4 name; 5 reads "dtype" and accepts both
    cfg["dtype"] = dtype
    cfg["jtp_random_weights"] = f"preset {preset}: random weights, output is meaningless"
    return dict(sorted(cfg.items()))


def tensor_specs(cfg: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) in checkpoint order; kind is 'weight' or 'norm'."""
    H, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    D = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * D, cfg["num_key_value_heads"] * D
    specs = [("model.embed_tokens.weight", (V, H), "weight")]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs += [
            (p + "input_layernorm.weight", (H,), "norm"),
            (p + "self_attn.q_proj.weight", (q, H), "weight"),
            (p + "self_attn.k_proj.weight", (kv, H), "weight"),
            (p + "self_attn.v_proj.weight", (kv, H), "weight"),
            (p + "self_attn.o_proj.weight", (H, q), "weight"),
            (p + "self_attn.q_norm.weight", (D,), "norm"),
            (p + "self_attn.k_norm.weight", (D,), "norm"),
            (p + "post_attention_layernorm.weight", (H,), "norm"),
            (p + "mlp.gate_proj.weight", (I, H), "weight"),
            (p + "mlp.up_proj.weight", (I, H), "weight"),
            (p + "mlp.down_proj.weight", (H, I), "weight"),
        ]
    specs.append(("model.norm.weight", (H,), "norm"))
    if not cfg["tie_word_embeddings"]:
        specs.append(("lm_head.weight", (V, H), "weight"))
    return specs


def np_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    if name in ("float16", "float32"):
        return np.dtype(name)
    raise SystemExit(f"unsupported dtype {name!r} (bfloat16, float16, float32)")


class Generator:
    """Fills tensors with N(mean, std) in parallel chunks of numpy; deterministic for a seed."""

    def __init__(self, seed: int, threads: int):
        self.seed = np.random.SeedSequence(seed)
        self.pool = cf.ThreadPoolExecutor(max_workers=threads)

    def make(self, shape: tuple[int, ...], dtype, mean: float, std: float) -> np.ndarray:
        n = int(np.prod(shape))
        out = np.empty(n, dtype)
        seeds = self.seed.spawn(-(-n // CHUNK))

        def fill(k: int) -> None:
            lo, hi = k * CHUNK, min(n, (k + 1) * CHUNK)
            x = np.random.default_rng(seeds[k]).standard_normal(hi - lo, dtype=np.float32)
            x *= std
            if mean:
                x += mean
            out[lo:hi] = x  # the cast to the checkpoint dtype happens here, in the thread

        list(self.pool.map(fill, range(len(seeds))))
        return out.reshape(shape)

    def close(self) -> None:
        self.pool.shutdown()


class JaxGenerator:
    """The same distribution drawn on the default JAX device (a GPU fills 16 GB in seconds),
    then copied to the host and written by the very same safetensors path."""

    def __init__(self, seed: int):
        import jax

        self.jax = jax
        self.key = jax.random.PRNGKey(seed)
        self.count = 0

    def make(self, shape: tuple[int, ...], dtype, mean: float, std: float) -> np.ndarray:
        jax, jnp = self.jax, self.jax.numpy
        key = jax.random.fold_in(self.key, self.count)
        self.count += 1
        x = _jax_normal(jax)(key, tuple(shape), np.dtype(dtype).name, float(mean), float(std))
        return np.asarray(jax.device_get(x)).view(dtype).reshape(shape)

    def close(self) -> None:
        pass


_JAX_NORMAL = None


def _jax_normal(jax):
    global _JAX_NORMAL
    if _JAX_NORMAL is None:
        import functools

        @functools.partial(jax.jit, static_argnums=(1, 2))
        def normal(key, shape, dtype, mean, std):
            x = jax.random.normal(key, shape, jax.numpy.float32) * std + mean
            return x.astype(dtype)

        _JAX_NORMAL = normal
    return _JAX_NORMAL


def write_checkpoint(preset: str, out: Path, dtype: str = "bfloat16", shard_gib: float = 4.0,
                     seed: int = 0, threads: int | None = None, quiet: bool = False,
                     generator: str = "numpy") -> dict:
    from safetensors.numpy import save_file

    cfg = make_config(preset, dtype)
    dt = np_dtype(dtype)
    out.mkdir(parents=True, exist_ok=True)
    for old in list(out.glob("*.safetensors")) + [out / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)  # a stale shard from an earlier run would confuse the loader
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen_cfg = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")

    specs = tensor_specs(cfg)
    total_bytes = sum(int(np.prod(s)) * dt.itemsize for _, s, _ in specs)
    shard_bytes = int(shard_gib * 2**30)
    # Group tensors into shards of at most shard_bytes (one shard if everything fits).
    shards: list[list] = [[]]
    size = 0
    for spec in specs:
        nbytes = int(np.prod(spec[1])) * dt.itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    names = (["model.safetensors"] if len(shards) == 1
             else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])

    gen = JaxGenerator(seed) if generator == "jax" else Generator(seed, threads or os.cpu_count() or 1)
    weight_map = {}
    t0 = time.perf_counter()
    for file, shard in zip(names, shards):
        tensors = {}
        for name, shape, kind in shard:
            mean, std = (1.0, WEIGHT_STD) if kind == "norm" else (0.0, WEIGHT_STD)
            tensors[name] = gen.make(shape, dt, mean, std)
            weight_map[name] = file
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        del tensors
        if not quiet:
            print(f"  wrote {file} ({time.perf_counter() - t0:.1f}s)", file=sys.stderr, flush=True)
    if len(shards) > 1:
        index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    gen.close()
    params = sum(int(np.prod(s)) for _, s, _ in specs)
    info = dict(preset=preset, out=str(out), dtype=dtype, generator=generator, params=params, bytes=total_bytes,
                files=len(shards), seconds=round(time.perf_counter() - t0, 2))
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", required=True, choices=sorted(PRESETS))
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--shard-gib", type=float, default=4.0, help="largest safetensors file (default 4 GiB)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="numpy generator threads (default: all cores)")
    ap.add_argument("--generator", choices=["numpy", "jax"], default="numpy",
                    help="draw with numpy on the host (default) or jax.random on the default device (fast on GPUs)")
    args = ap.parse_args(argv)
    info = write_checkpoint(args.preset, args.out, args.dtype, args.shard_gib, args.seed, args.threads,
                            generator=args.generator)
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
