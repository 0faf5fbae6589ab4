"""--load-format dummy: random weights from config.json alone, drawn on the devices.

Checked against independent references: the params a real checkpoint of the same preset loads into
(structure, shapes, dtypes, shardings at every tp, expert-parallel too), the value kinds that
scripts/make_random_checkpoint.py lists tensor by tensor, and tp=1's greedy tokens through the
serving step (every tp draws the same model, KV heads replicated included)."""
from __future__ import annotations

from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest
from scripts_loader import load_script
from test_sharding import greedy

from jtp.config.engine_args import EngineArgs
from jtp.config.model_config import ModelConfig
from jtp.errors import CheckpointError
from jtp.loading.param_tree import flatten
from jtp.loading.weights import load_params, resolve_layout
from jtp.models import family_of
from jtp.parallel.sharding import make_mesh
from jtp.worker.runner import ModelRunner

PRESETS = ["qwen3-tiny", "qwen3-moe-tiny", "qwen3.5-moe-tiny", "qwen3-next-tiny"]


@pytest.fixture(scope="module")
def mk():
    return load_script("make_random_checkpoint")


@pytest.fixture(scope="module")
def written(mk, tmp_path_factory):
    """preset -> (directory with weights, directory with config.json only)."""
    out = {}
    for preset in PRESETS:
        full, bare = tmp_path_factory.mktemp(preset), tmp_path_factory.mktemp(preset + "-config")
        mk.write_checkpoint(preset, full, "float32", quiet=True)
        mk.write_checkpoint(preset, bare, "float32", config_only=True)
        out[preset] = full, bare
    return out


def cases(cfg: ModelConfig):
    """(tp, expert_parallel) settings this tiny config can be split into (hybrids: whole key heads)."""
    tps = (1, 2) if cfg.layer_types else (1, 4)
    return [(tp, False) for tp in tps] + ([(tps[-1], True)] if cfg.num_experts else [])


@pytest.mark.parametrize("preset", PRESETS)
def test_dummy_params_are_laid_out_as_loaded_ones(written, preset):
    full, bare = written[preset]
    cfg = ModelConfig.from_dir(bare)
    for tp, ep in cases(cfg):
        mesh = make_mesh(tp)
        mtp = bool(cfg.mtp_layers)
        loaded = flatten(load_params(full, cfg, mesh, jnp.float32, ep, mtp))
        drawn = flatten(load_params(bare, cfg, mesh, jnp.float32, ep, mtp, load_format="dummy"))
        assert drawn.keys() == loaded.keys()
        for path, value in drawn.items():
            ref = loaded[path]
            assert (value.shape, value.dtype) == (ref.shape, ref.dtype), path
            assert value.sharding.is_equivalent_to(ref.sharding, value.ndim), (path, tp, ep)


@pytest.mark.parametrize("preset", ["qwen3-tiny", "qwen3.5-moe-tiny", "qwen3-next-tiny"])
def test_dummy_values_follow_the_random_checkpoint_script(mk, written, preset):
    """Mean 1 where the script writes a 'norm' tensor (weights applied as w, dt_bias), else 0; std 0.02.
    The script's per-tensor table is the reference, not the rule in jtp/loading/dummy_weights.py."""
    _, bare = written[preset]
    cfg = ModelConfig.from_dir(bare)
    kinds = {name: kind for name, _, kind in mk.tensor_specs(mk.make_config(preset, "float32"))}
    layout = family_of(cfg).param_layout(cfg, 1, mtp=bool(cfg.mtp_layers))
    layout = resolve_layout(layout, SimpleNamespace(names=set(kinds)))  # fused or per-expert, as the script writes
    drawn = flatten(load_params(bare, cfg, make_mesh(1), jnp.float32, mtp=bool(cfg.mtp_layers), load_format="dummy"))
    means = set()
    for path, value in drawn.items():
        names = layout[path].expected().keys()
        expected_mean = {1.0 if kinds[n] == "norm" else 0.0 for n in names}
        assert len(expected_mean) == 1, path
        (mean,) = expected_mean
        v = np.asarray(value, np.float64)
        tol = 5 * 0.02 / np.sqrt(v.size) + 1e-6
        assert abs(v.mean() - mean) < tol, (path, v.mean(), mean)
        if v.size >= 64:
            assert v.std() == pytest.approx(0.02, rel=0.35), path
        means.add(mean)
    assert means == {0.0, 1.0}  # both kinds occur


@pytest.mark.parametrize("preset", ["qwen3-moe-tiny", "qwen3-next-tiny"])
def test_every_tp_draws_the_same_model(written, preset):
    """Greedy tokens through the serving step at tp > 1 (and expert parallelism) equal tp=1's: each
    parameter's values do not depend on how it is split, replicated KV heads included."""
    _, bare = written[preset]
    cfg = ModelConfig.from_dir(bare)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, 11).tolist()

    def tokens(tp, ep):
        runner = ModelRunner.from_args(EngineArgs(
            model=bare, tensor_parallel_size=tp, dtype="float32", num_blocks=16, block_size=4,
            enable_expert_parallel=ep, load_format="dummy"))
        return greedy(runner, prompt, 6).tokens.tolist()

    base = tokens(1, False)
    assert len(set(base)) > 1  # not a degenerate model that repeats one token
    for tp, ep in cases(cfg)[1:]:
        assert tokens(tp, ep) == base, (tp, ep)


def test_replicated_kv_heads_are_copies(written):
    _, bare = written["qwen3-moe-tiny"]  # 2 KV heads over 4 devices: each stored twice
    cfg = ModelConfig.from_dir(bare)
    k = np.asarray(load_params(bare, cfg, make_mesh(4), jnp.float32, load_format="dummy")["layers"][0]["k_proj"])
    heads = k.reshape(cfg.num_kv_heads, 2, cfg.head_dim, -1)
    np.testing.assert_array_equal(heads[:, 0], heads[:, 1])
    k1 = np.asarray(load_params(bare, cfg, make_mesh(1), jnp.float32, load_format="dummy")["layers"][0]["k_proj"])
    np.testing.assert_array_equal(heads[:, 0].reshape(k1.shape), k1)


def test_a_directory_without_weights_names_the_dummy_format(written):
    _, bare = written["qwen3-tiny"]
    cfg = ModelConfig.from_dir(bare)
    with pytest.raises(CheckpointError, match="no model.safetensors.*--load-format dummy"):
        load_params(bare, cfg, make_mesh(1))
    with pytest.raises(CheckpointError, match="load format 'pt': expected one of auto, dummy"):
        load_params(bare, cfg, make_mesh(1), load_format="pt")


def test_engine_args_take_the_dummy_format(written):
    """The engine's flag: a config-only directory serves (bench.py's flag: test_bench's tp-scaling run)."""
    from jtp.config.engine_args import EngineArgs
    from jtp.core.sampling_params import SamplingParams
    from jtp.engine.engine import Engine

    _, bare = written["qwen3-moe-tiny"]
    args = EngineArgs(model=str(bare), load_format="dummy", max_num_seqs=2, num_blocks=32, warmup=False)
    with Engine.from_args(args) as engine:
        (out,) = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out.token_ids) == 4


def test_followers_fingerprint_dummy_weights_by_name(written):
    """A group's processes compare fingerprints before serving: with dummy weights there are no files
    to hash, and the format itself is what must match."""
    from jtp.config.engine_args import EngineArgs
    from jtp.distributed.launcher import fingerprint

    _, bare = written["qwen3-tiny"]
    assert fingerprint(EngineArgs(model=str(bare), load_format="dummy", num_processes=2))["weights"] == "dummy"


def test_snapshots_of_a_dummy_engine_save_and_load(written, tmp_path):
    """Snapshots record the weights they were computed with: dummy weights are named, not hashed
    (there are no files), and a saved snapshot continues exactly as the live engine does."""
    from jtp.config.engine_args import EngineArgs
    from jtp.core.sampling_params import SamplingParams
    from jtp.engine.engine import Engine

    _, bare = written["qwen3-tiny"]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    args = EngineArgs(model=str(bare), load_format="dummy", max_num_seqs=2, num_blocks=32, block_size=4, warmup=False)
    prefix = list(range(1, 14))
    with Engine.from_args(args) as engine:
        sid = engine.snapshot(tokens=prefix)
        engine.save_snapshots(tmp_path / "snap", [sid])
        live = engine.generate([prefix + [7]], params)[0].token_ids
    with Engine.from_args(args) as engine:
        (loaded,) = engine.load_snapshots(tmp_path / "snap")
        assert engine.generate([prefix + [7]], params)[0].token_ids == live
        assert engine.scheduler.cache_root is not None and loaded
