"""Checkpoint and config loading: sharded == single file, clear errors that name the culprit,
Orbax round trip, `jtp convert`."""

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jtp.config.engine_args import EngineArgs
from jtp.config.model_config import ConfigError, ModelConfig
from jtp.errors import CheckpointError
from jtp.loading.weights import convert_to_orbax, save_orbax
from jtp.worker.runner import ModelRunner

pytest.importorskip("torch")
from hf_models import assert_same_outputs, logprob_error, make_hf_checkpoint  # noqa: E402
from test_hf_parity import prefill_then_decode  # noqa: E402

IDS = np.random.default_rng(7).integers(0, 128, 14)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    _, path = make_hf_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3"))
    return path


def outputs_of(path, tp=1, dtype="float32"):
    """The serving step's greedy tokens and top-20 logprobs over a prefill and 4 decode steps."""
    return prefill_then_decode(ModelRunner.from_args(EngineArgs(
        model=path, tensor_parallel_size=tp, dtype=dtype, num_blocks=8, block_size=4)), IDS, 10)


def copy_with(src, dst, tensors: dict, config_edit=None):
    """A copy of the checkpoint directory with model.safetensors replaced by `tensors`."""
    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    save_file(tensors, str(dst / "model.safetensors"))
    if config_edit:
        cfg = json.loads((dst / "config.json").read_text())
        config_edit(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_sharded_checkpoint_loads_like_single_file(qwen3_dir, tmp_path):
    tensors = load_file(str(qwen3_dir / "model.safetensors"))
    names = sorted(tensors)
    shard_dir = tmp_path / "sharded"
    shutil.copytree(qwen3_dir, shard_dir)
    (shard_dir / "model.safetensors").unlink()
    weight_map = {}
    for i, part in enumerate(np.array_split(names, 3)):
        file = f"model-{i + 1:05d}-of-00003.safetensors"
        save_file({n: tensors[n] for n in part}, str(shard_dir / file))
        weight_map.update(dict.fromkeys(part, file))
    (shard_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert_same_outputs(outputs_of(shard_dir, tp=2), outputs_of(qwen3_dir, tp=2))


def test_tied_embeddings(tmp_path):
    _, tied = make_hf_checkpoint("qwen3", tmp_path / "tied", tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(str(tied / "model.safetensors"))
    import torch

    model, _ = make_hf_checkpoint("qwen3", tmp_path / "tied2", tie_word_embeddings=True)
    with torch.no_grad():
        ref = model(torch.tensor([IDS.tolist()])).logits[0].numpy()[9:]
    assert logprob_error(outputs_of(tied), ref) < 1e-4


def test_bfloat16_and_float16_checkpoints_load(qwen3_dir, tmp_path):
    import ml_dtypes

    tensors = load_file(str(qwen3_dir / "model.safetensors"))
    as_f32 = outputs_of(qwen3_dir, dtype="bfloat16")
    for name, dt in [("bf16", ml_dtypes.bfloat16), ("f16", np.float16)]:
        d = copy_with(qwen3_dir, tmp_path / name, {k: v.astype(dt) for k, v in tensors.items()})
        got = outputs_of(d, dtype="bfloat16")
        assert np.isfinite(got.top_logprobs).all()
        # bf16 checkpoint into a bf16 model is exactly the fp32 checkpoint cast to bf16.
        if name == "bf16":
            assert_same_outputs(got, as_f32)


def test_missing_tensor_is_named(qwen3_dir, tmp_path):
    tensors = load_file(str(qwen3_dir / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    d = copy_with(qwen3_dir, tmp_path / "missing", tensors)
    with pytest.raises(CheckpointError, match=r"1 expected tensor\(s\) are missing, e\.g\. 'model\.layers\.1\.mlp\.up_proj\.weight' \(shape \[96, 64\]\)"):
        ModelRunner.from_args(EngineArgs(model=d, num_blocks=4))


def test_unexpected_tensor_is_named(qwen3_dir, tmp_path):
    tensors = load_file(str(qwen3_dir / "model.safetensors"))
    tensors["model.layers.0.self_attn.extra.weight"] = np.zeros((2, 2), np.float32)
    d = copy_with(qwen3_dir, tmp_path / "extra", tensors)
    with pytest.raises(CheckpointError, match=r"unexpected tensor.*'model\.layers\.0\.self_attn\.extra\.weight'"):
        ModelRunner.from_args(EngineArgs(model=d, num_blocks=4))


def test_wrong_shape_names_tensor_and_both_shapes(qwen3_dir, tmp_path):
    tensors = load_file(str(qwen3_dir / "model.safetensors"))
    tensors["model.layers.2.self_attn.k_proj.weight"] = np.zeros((32, 64), np.float32)
    d = copy_with(qwen3_dir, tmp_path / "shape", tensors)
    with pytest.raises(CheckpointError, match=r"'model\.layers\.2\.self_attn\.k_proj\.weight' has shape \[32, 64\].*\[64, 64\]"):
        ModelRunner.from_args(EngineArgs(model=d, num_blocks=4))


def test_config_mismatch_with_weights(qwen3_dir, tmp_path):
    tensors = load_file(str(qwen3_dir / "model.safetensors"))
    d = copy_with(qwen3_dir, tmp_path / "cfg", tensors, lambda c: c.update(intermediate_size=80))
    with pytest.raises(CheckpointError, match=r"gate_proj\.weight' has shape \[96, 64\].*\[80, 64\]"):
        ModelRunner.from_args(EngineArgs(model=d, num_blocks=4))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c.update(model_type="llama"), "model_type 'llama' is not supported"),
        (lambda c: c.pop("hidden_size"), "'hidden_size' is missing"),
        (lambda c: c.update(num_key_value_heads=3), "multiple of num_key_value_heads"),
        (lambda c: c.update(num_hidden_layers="4"), "'num_hidden_layers' must be an integer"),
        # Every RoPE type but default and yarn changes the math and is not implemented: refused.
        (lambda c: c.update(rope_parameters={"rope_type": "linear", "factor": 4.0}), "rope_type 'linear'"),
        (lambda c: c.update(rope_scaling={"type": "dynamic", "factor": 2.0}), "rope_type 'dynamic'"),
        (lambda c: c.update(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "rope_type 'llama3'"),
        (lambda c: c.update(rope_parameters={"rope_type": "longrope"}), "rope_type 'longrope'"),
        # rope_scaling beside rope_parameters: transformers reads rope_scaling alone, so a value of
        # rope_parameters it would drop is refused (here the theta: HF would run with 10000).
        (lambda c: (c.pop("rope_theta", None), c.update(rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                                                        rope_scaling={"rope_type": "yarn", "factor": 4.0})),
         r"rope_parameters.rope_theta \(1000000.0\) would be dropped.*giving rope_theta 10000.0"),
        (lambda c: c.update(rope_parameters={"rope_type": "yarn", "factor": 2.0},
                            rope_scaling={"rope_type": "yarn", "factor": 4.0}), r"rope_parameters.factor \(2.0\)"),
        (lambda c: c.update(rope_parameters={"rope_type": "yarn", "factor": 0.5}), "'factor' must be a number >= 1.0"),
        (lambda c: c.update(rope_scaling=[1]), "rope_scaling must be an object"),
        (lambda c: c.update(use_sliding_window=True), "use_sliding_window"),
        (lambda c: c.update(dual_chunk_attention_config={"chunk_size": 262144}), "dual_chunk_attention_config"),
        (lambda c: c.update(hidden_act="gelu"), "hidden_act"),
    ],
)
def test_config_errors_name_the_field(qwen3_dir, edit, message):
    raw = json.loads((qwen3_dir / "config.json").read_text())
    edit(raw)
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf(raw)


def test_yarn_fields_as_transformers_reads_them():
    base = dict(model_type="qwen3", vocab_size=10, hidden_size=64, num_attention_heads=4, num_hidden_layers=1,
                intermediate_size=8, max_position_embeddings=40960)
    # Qwen3's documented YaRN: rope_scaling beside rope_parameters' default type (and the top-level theta).
    cfg = ModelConfig.from_hf(base | dict(rope_theta=1e6, rope_parameters={"rope_type": "default"}, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}))
    assert cfg.rope_theta == 1e6 and cfg.rope_yarn.factor == 4.0
    assert cfg.rope_yarn.original_max_position_embeddings == 32768
    assert (cfg.rope_yarn.beta_fast, cfg.rope_yarn.beta_slow, cfg.rope_yarn.truncate) == (32.0, 1.0, True)
    assert cfg.rope_yarn.attention_factor == pytest.approx(0.1 * np.log(4.0) + 1)
    assert cfg.max_position_embeddings == 131072  # the extended context, as vLLM derives it
    # No original_max_position_embeddings: max_position_embeddings (transformers' standardisation);
    # a top-level one wins; mscale / mscale_all_dim give DeepSeek's attention factor.
    cfg = ModelConfig.from_hf(base | dict(rope_parameters={"rope_type": "yarn", "factor": 2.0}))
    assert cfg.rope_yarn.original_max_position_embeddings == 40960 and cfg.max_position_embeddings == 81920
    cfg = ModelConfig.from_hf(base | dict(original_max_position_embeddings=4096, rope_parameters={
        "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8192, "mscale": 1, "mscale_all_dim": 2}))
    assert cfg.rope_yarn.original_max_position_embeddings == 4096
    assert cfg.rope_yarn.attention_factor == pytest.approx((0.1 * np.log(2) + 1) / (0.2 * np.log(2) + 1))
    assert ModelConfig.from_hf(base).rope_yarn is None


def test_config_defaults_and_legacy_keys():
    # qwen3 head_dim defaults to 128 whatever the hidden size; legacy rope_theta is honoured.
    cfg = ModelConfig.from_hf(dict(model_type="qwen3", vocab_size=10, hidden_size=64, num_attention_heads=4,
                                   num_hidden_layers=1, intermediate_size=8, rope_theta=5e6))
    assert (cfg.head_dim, cfg.rope_theta, cfg.num_kv_heads) == (128, 5e6, 4)
    # qwen3_moe: num_local_experts (what save_pretrained writes) and defaults from the HF class.
    moe = ModelConfig.from_hf(dict(model_type="qwen3_moe", vocab_size=10, hidden_size=64, num_attention_heads=4,
                                   num_hidden_layers=2, intermediate_size=8, num_local_experts=16,
                                   mlp_only_layers=[0]))
    assert (moe.num_experts, moe.num_experts_per_tok, moe.norm_topk_prob, moe.head_dim) == (16, 8, False, 16)
    assert moe.moe_layers == (False, True)
    with pytest.raises(ConfigError, match=r"num_experts_per_tok \(8\) exceeds num_experts \(6\)"):
        ModelConfig.from_hf(dict(model_type="qwen3_moe", vocab_size=10, hidden_size=64, num_attention_heads=4,
                                 num_hidden_layers=2, intermediate_size=8, num_local_experts=6))
    with pytest.raises(ConfigError, match="contradicts"):
        ModelConfig.from_hf(dict(model_type="qwen3_moe", vocab_size=10, hidden_size=64, num_attention_heads=4,
                                 num_hidden_layers=2, intermediate_size=8, num_local_experts=6, num_experts=4))
    # A missing rope_theta is HF's default_theta (10000), not a guess from the model family.
    assert ModelConfig.from_hf(dict(model_type="qwen2", vocab_size=10, hidden_size=64, num_attention_heads=4,
                                    num_hidden_layers=1, intermediate_size=8)).rope_theta == 10000.0


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_orbax_round_trip_gives_identical_outputs(kind, tmp_path):
    _, hf_dir = make_hf_checkpoint(kind, tmp_path / "hf")
    out = convert_to_orbax(hf_dir, tmp_path / "orbax_model")
    assert not list(out.glob("*.safetensors")) and (out / "orbax").is_dir() and (out / "config.json").is_file()
    # Restored at another tp (with KV-head replication) straight into that sharding.
    for tp in (1, 4):
        assert_same_outputs(outputs_of(out, tp=tp), outputs_of(hf_dir, tp=tp))


def test_orbax_saved_with_replicated_kv_heads_restores_at_any_tp(qwen3_dir, tmp_path):
    """Saved from tp=4 (each of the 2 KV heads stored twice), the checkpoint holds each head once."""
    out = tmp_path / "saved_at_tp4"
    out.mkdir()
    shutil.copy2(qwen3_dir / "config.json", out / "config.json")
    runner = ModelRunner.from_args(EngineArgs(model=qwen3_dir, tensor_parallel_size=4, num_blocks=8, block_size=4))
    save_orbax(runner.params, runner.cfg, 4, out / "orbax")
    assert_same_outputs(outputs_of(out, tp=1), outputs_of(qwen3_dir, tp=1))


def test_orbax_of_a_multimodal_checkpoint_serves_its_text_model(tmp_path):
    """`jtp convert` of a Qwen3.5 checkpoint with its vision tower keeps the language model (not the
    tower): the converted directory serves text, as the safetensors do."""
    from hf_hybrid import SHALLOW, build_model, save_multimodal

    path = save_multimodal(build_model("qwen3_5", **SHALLOW), tmp_path / "hf")
    out = convert_to_orbax(path, tmp_path / "orbax_model")
    assert_same_outputs(outputs_of(out), outputs_of(path))
