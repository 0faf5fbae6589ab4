"""int4 weight-only checkpoints (AWQ, GPTQ) against HF transformers.

Checkpoints in AutoAWQ's GEMM and AutoGPTQ's v1 layouts are written by
scripts/quantize_checkpoint.py from tiny HF models; the reference is HF transformers on the
weights those files stand for (decoded by the script's numpy code, saved as a float checkpoint).
jtp's teacher-forced logprobs through the engine's real steps must equal HF's, at tp 1 and 2,
dense, MoE and the hybrids. Then the refusals: bit widths and versions not served, act-order
groups, a misshaped scale, int32 words stored as floats, a tp split inside a group.
"""

import json
import shutil

import numpy as np
import pytest
from scripts_loader import load_script

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_fp8 import PROMPT, edit_tensors, hf_logprobs, hf_source, jtp_logprobs  # noqa: E402

from jtp.config.engine_args import EngineArgs  # noqa: E402
from jtp.config.model_config import ModelConfig  # noqa: E402
from jtp.core.sampling_params import SamplingParams  # noqa: E402
from jtp.engine.engine import Engine  # noqa: E402
from jtp.errors import CheckpointError, ConfigError  # noqa: E402
from jtp.models.layers import Int4Groups  # noqa: E402

qc = load_script("quantize_checkpoint")


def int4_weights(engine) -> int:
    return sum(isinstance(w, Int4Groups) for layer in engine.runner.params["layers"] for w in layer.values())


@pytest.mark.parametrize("method", ["awq", "gptq"])
@pytest.mark.parametrize("kind, tp", [
    ("qwen3", 1), ("qwen3", 2), ("qwen3_moe", 1), ("qwen3_moe", 2),
    ("qwen3_5_text", 1), ("qwen3_next", 2), ("qwen3_5_moe", 2),
])
def test_int4_checkpoints_give_hf_logprobs_on_their_weights(tmp_path, method, kind, tp):
    src = hf_source(kind, tmp_path / "src")
    int4 = tmp_path / method
    if kind.startswith("qwen3_"):  # the hybrids: groups of 8, the narrowest (their widths are multiples of 8,
        # but at tp=2 the 72-wide input of the tiny out_proj splits inside one: kept in float there)
        qc.quantize_checkpoint(src, int4, method, group_size=8, skip=[r"linear_attn\.out_proj"] * (tp > 1))
    else:
        qc.quantize_checkpoint(src, int4, method, group_size=16)
    reference = qc.write_dequantized(int4, tmp_path / "decoded")
    ours, engine = jtp_logprobs(int4, PROMPT, tp)
    # qwen3: every attention and MLP projection of the 3 layers (7 each; the MoE layers' experts stacked).
    assert int4_weights(engine) == 3 * 7 if kind in ("qwen3", "qwen3_moe") else int4_weights(engine) > 0
    np.testing.assert_allclose(ours, hf_logprobs(reference, PROMPT), atol=1e-4, err_msg=f"{method} {kind} tp={tp}")
    # The int4 model stays near the original one (round-to-nearest on random tiny weights).
    gap = np.abs(ours - hf_logprobs(src, PROMPT))
    assert gap.mean() < 0.5, (gap.mean(), gap.max())


@pytest.mark.parametrize("config, reason", [
    ({"quant_method": "awq", "bits": 3, "group_size": 128, "version": "gemm", "zero_point": True},
     "awq with bits 3 is not served"),
    ({"quant_method": "awq", "bits": 8, "group_size": 128, "version": "gemm", "zero_point": True},
     "awq with bits 8 is not served"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv", "zero_point": True},
     "awq version 'gemv' is not served"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": False},
     "awq zero_point False is not served"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128, "desc_act": False}, "gptq with bits 8 is not served"),
    ({"quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": False}, "group_size -1 is not served"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "gptq_v2"},
     "checkpoint_format 'gptq_v2' is not served"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "dynamic": {"+:.*down_proj": {"bits": 8}}},
     "dynamic '+:.*down_proj' is not served"),
])
def test_int4_configs_not_served_are_refused_in_one_line(config, reason):
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_hf({"model_type": "qwen3", "hidden_size": 64, "num_attention_heads": 4,
                             "num_hidden_layers": 1, "intermediate_size": 96, "vocab_size": 128,
                             "quantization_config": config})
    assert reason in str(e.value) and "quantization_config" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_quantization_fp8_of_an_int4_checkpoint_is_refused(tmp_path, method):
    """--quantization fp8 quantizes full-precision weights: on an int4 checkpoint it would quantize
    nothing and serve int4 silently. Refused in one line, as vLLM refuses a method the checkpoint's
    own quantization_config contradicts."""
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1,
        "intermediate_size": 96, "vocab_size": 128,
        "quantization_config": {"quant_method": method, "bits": 4, "group_size": 32}}))
    with pytest.raises(ConfigError) as e:
        Engine.from_args(EngineArgs(model=str(tmp_path), quantization="fp8", warmup=False))
    assert f"--quantization fp8: the checkpoint is already quantized ({method}" in str(e.value)
    assert "\n" not in str(e.value)


def refused(directory, *match, tp: int = 1):
    with pytest.raises(CheckpointError) as e:
        Engine.from_args(EngineArgs(model=str(directory), num_blocks=16, warmup=False, tensor_parallel_size=tp))
    for m in match:
        assert m in str(e.value), str(e.value)


def test_bad_int4_checkpoints_are_refused_naming_the_tensor(tmp_path):
    src = hf_source("qwen3", tmp_path / "src", hidden_size=128, intermediate_size=128)
    gptq = tmp_path / "gptq"
    qc.quantize_checkpoint(src, gptq, "gptq", group_size=32)

    act_order = tmp_path / "act-order"
    shutil.copytree(gptq, act_order)
    g_idx = "model.layers.1.mlp.up_proj.g_idx"
    edit_tensors(act_order, lambda t: t.update({g_idx: t[g_idx][::-1].copy()}))
    config = json.loads((act_order / "config.json").read_text())
    config["quantization_config"]["desc_act"] = True
    (act_order / "config.json").write_text(json.dumps(config))
    refused(act_order, g_idx, "act-order groups (desc_act true) are not served")

    wrong = tmp_path / "wrong-scales"
    shutil.copytree(gptq, wrong)
    scales = "model.layers.0.self_attn.o_proj.scales"
    edit_tensors(wrong, lambda t: t.update({scales: t[scales][:, :8]}))
    refused(wrong, scales, "wrong shape")

    words = tmp_path / "float-words"
    shutil.copytree(gptq, words)
    qweight = "model.layers.2.self_attn.q_proj.qweight"
    edit_tensors(words, lambda t: t.update({qweight: t[qweight].astype(np.float32)}))
    refused(words, qweight, "is F32 (int4 words are int32)")

    # Groups of 128 input rows: o_proj's and down_proj's 128 inputs split in two at tp=2.
    wide = tmp_path / "wide-groups"
    qc.quantize_checkpoint(src, wide, "awq", group_size=128)
    refused(wide, "o_proj.qweight", "tp=2 splits a dim of 128 into shards of 64, inside its int4 groups of 128",
            tp=2)


@pytest.mark.parametrize("kind, method, tp", [("qwen3", "awq", 1), ("qwen3_moe", "gptq", 2)])
def test_random_weights_of_an_int4_config_are_int4_groups(tmp_path, kind, method, tp):
    """--load-format dummy of an AWQ / GPTQ config (for benchmarks): the linear weights drawn as int4
    groups in each device's sharding, with the shapes the checkpoint's would load as, and served."""
    src = hf_source(kind, tmp_path / "src")
    qc.quantize_checkpoint(src, tmp_path / "int4", method, group_size=16)
    loaded = Engine.from_args(EngineArgs(model=str(tmp_path / "int4"), num_blocks=16, warmup=False,
                                         tensor_parallel_size=tp))
    (tmp_path / "int4" / "model.safetensors").unlink()
    drawn = Engine.from_args(EngineArgs(model=str(tmp_path / "int4"), load_format="dummy", num_blocks=16, warmup=False,
                                        tensor_parallel_size=tp))
    for real, random in zip(loaded.runner.params["layers"], drawn.runner.params["layers"]):
        assert real.keys() == random.keys()
        for name, w in real.items():
            assert type(random[name]) is type(w), name
            if isinstance(w, Int4Groups):
                for a, b in zip(w, random[name]):
                    assert (a.shape, a.dtype, a.sharding.spec) == (b.shape, b.dtype, b.sharding.spec), name
    assert any(isinstance(w, Int4Groups) for w in drawn.runner.params["layers"][0].values())
    assert len(drawn.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0))[0].token_ids) == 4
