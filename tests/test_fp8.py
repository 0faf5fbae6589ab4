"""FP8 weights: Qwen's FP8 checkpoints and `--quantization fp8`, against HF transformers.

Checkpoints in Qwen's FP8 block format are written by scripts/quantize_checkpoint.py from tiny HF
models (float8 values, bfloat16 block scales, as the releases store them). The reference is HF
transformers on the weights those files stand for (decoded by the script's numpy code, saved as a
float checkpoint): jtp's teacher-forced logprobs through the engine's real steps must equal HF's,
at tp 1 and 2, dense, MoE and the hybrids. `--quantization fp8` (per-channel weights, W8A8 prompt
products) is checked against HF with the same quantization done in torch.
"""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cpu_env import cuda_lowering
from scripts_loader import load_script

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_hybrid import SHALLOW, build_model, save  # noqa: E402
from hf_models import log_softmax, make_hf_checkpoint  # noqa: E402

from jtp.config.engine_args import EngineArgs  # noqa: E402
from jtp.core.sampling_params import SamplingParams  # noqa: E402
from jtp.engine.engine import Engine  # noqa: E402
from jtp.errors import CheckpointError, ShardingError  # noqa: E402
from jtp.kernels import grouped_matmul  # noqa: E402
from jtp.loading.weights import convert_to_orbax  # noqa: E402
from jtp.kernels import fp8_matmul  # noqa: E402
from jtp.models.layers import BlockFp8, Fp8KernelWeight, FusedFp8KernelWeight, linear, w8a8_matmul  # noqa: E402

qc = load_script("quantize_checkpoint")
PROMPT = np.random.default_rng(3).integers(0, 128, 28).tolist()


def hf_source(kind: str, path, **overrides):
    if kind in ("qwen3", "qwen3_moe"):
        return make_hf_checkpoint(kind, path, **overrides)[1]
    save(build_model(kind, **SHALLOW), path)
    return path


def hf_logprobs(model_dir, prompt) -> np.ndarray:
    """HF's teacher-forced logprob of each prompt token after the first (float64)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].to(torch.float64).numpy()
    ref = log_softmax(logits)
    return np.array([ref[p - 1, prompt[p]] for p in range(1, len(prompt))])


def jtp_logprobs(model_dir, prompt, tp: int = 1, **args) -> tuple[np.ndarray, Engine]:
    args = dict(dtype="float32", num_blocks=32, block_size=4, max_num_seqs=2, max_num_batched_tokens=16,
                tensor_parallel_size=tp, warmup=False) | args
    engine = Engine.from_args(EngineArgs(model=str(model_dir), **args))
    done = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
    return np.array(done.prompt_logprobs.logprobs[1:]), engine


def fp8_weights(engine) -> int:
    return sum(isinstance(w, BlockFp8) for layer in engine.runner.params["layers"] for w in layer.values())


@pytest.mark.parametrize("kind, block, tp", [
    ("qwen3", 16, 1), ("qwen3", 16, 2), ("qwen3_moe", 16, 1), ("qwen3_moe", 16, 2),
    ("qwen3_5_text", 4, 1), ("qwen3_next", 4, 2),
])
def test_fp8_checkpoints_give_hf_logprobs_on_their_weights(tmp_path, kind, block, tp):
    src = hf_source(kind, tmp_path / "src")
    fp8 = tmp_path / "fp8"
    qc.quantize_checkpoint(src, fp8, "fp8", block=block)
    reference = qc.write_dequantized(fp8, tmp_path / "decoded")
    ours, engine = jtp_logprobs(fp8, PROMPT, tp)
    assert fp8_weights(engine) > 0
    np.testing.assert_allclose(ours, hf_logprobs(reference, PROMPT), atol=1e-4, err_msg=f"{kind} tp={tp}")
    # The FP8 model stays near the original one: the quantization's own error, stated (these random
    # tiny models' weights are far from trained ones', so their error is larger).
    gap = np.abs(ours - hf_logprobs(src, PROMPT))
    assert gap.mean() < 0.2 and gap.max() < 1.0, (gap.mean(), gap.max())


def w8a8_hf_logprobs(model_dir, prompt, row_parallel_groups: int) -> np.ndarray:
    """HF's teacher-forced logprobs with every decoder projection run as W8A8 FP8 in torch: the
    weight quantized to float8 per output channel of each K group, the input per token and K group
    (scale = largest magnitude / 448), the product taken on the dequantized operands. The o and down
    projections (row-parallel: K split over the devices) have `row_parallel_groups` groups."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def quantize(t, groups):  # per row and K group, dequantized again
        g = t.reshape(*t.shape[:-1], groups, -1)
        scale = g.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 448
        return ((g / scale).to(torch.float8_e4m3fn).to(torch.float32) * scale).reshape(t.shape)

    for name, module in model.model.layers.named_modules():
        if isinstance(module, torch.nn.Linear) and name.endswith("proj"):
            groups = row_parallel_groups if name.endswith(("o_proj", "down_proj")) else 1
            weight = quantize(module.weight.data, groups)
            module.forward = lambda x, w=weight, groups=groups: torch.nn.functional.linear(quantize(x, groups), w)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].to(torch.float64).numpy()
    ref = log_softmax(logits)
    return np.array([ref[p - 1, prompt[p]] for p in range(1, len(prompt))])


def test_quantization_fp8_at_load_runs_w8a8_per_channel_as_torch_does(tmp_path):
    """--quantization fp8: every decoder projection in float8 with one scale per output channel (of
    each device's K shard), its prompt products W8A8 (x quantized per token): HF with the same
    quantization done in torch, at tp 1 and 2; and the FP8 model stays near the original one."""
    src = make_hf_checkpoint("qwen3", tmp_path / "src", hidden_size=128, num_key_value_heads=4,
                             intermediate_size=256)[1]
    for tp in (1, 2):  # one prompt step (a step of at most 4 tokens would multiply x unquantized)
        ours, engine = jtp_logprobs(src, PROMPT, tp, quantization="fp8", max_num_batched_tokens=32)
        assert fp8_weights(engine) == 3 * 7
        reference = w8a8_hf_logprobs(src, PROMPT, row_parallel_groups=tp)
        # Where x lands within float32 noise of a float8 rounding boundary, the two round it apart
        # (one element moves by 2^-4 of itself) and the positions after it drift: most positions
        # agree to float32 noise, the mean gap stays far below weight-only FP8's (~0.2 here).
        diff = np.abs(ours - reference)
        assert np.mean(diff < 1e-4) >= 0.75 and diff.mean() < 0.02 and diff.max() < 0.3, (tp, diff)
        gap = np.abs(ours - hf_logprobs(src, PROMPT))
        assert gap.mean() < 0.2 and gap.max() < 1.0, (gap.mean(), gap.max())


def test_w8a8_matmul_is_the_product_of_x_and_w_quantized_per_row_and_group():
    """layers.w8a8_matmul against numpy: x rounded to float8 per row and K group, times the weight's
    float8 values and channel scales; within float8's rounding of the exact product."""
    rng = np.random.default_rng(2)
    for groups in (1, 2):
        w = rng.normal(size=(96, 256)).astype(np.float32)
        wg = w.reshape(96, groups, -1)
        w_scale = np.abs(wg).max(-1) / 448
        values = jnp.asarray(wg / w_scale[..., None]).astype(jnp.float8_e4m3fn).reshape(96, 256)
        weight = (np.asarray(values.astype(jnp.float32)).reshape(96, groups, -1) * w_scale[..., None]).reshape(96, 256)
        x = rng.normal(size=(7, 256)).astype(np.float32)
        xg = x.reshape(7, groups, -1)
        x_scale = np.abs(xg).max(-1) / 448
        xq = np.asarray(jnp.asarray(xg / x_scale[..., None]).astype(jnp.float8_e4m3fn).astype(jnp.float32))
        ref = ((xq * x_scale[..., None]).reshape(7, 256)).astype(np.float64) @ weight.T
        ours = np.asarray(w8a8_matmul(jnp.asarray(x), values, jnp.asarray(w_scale, jnp.float32)))
        np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
        assert np.abs(ours - x @ w.T).max() < 0.05 * np.abs(x @ w.T).max()


def block_fp8(rng, n: int, k: int):
    values = jnp.asarray(rng.normal(size=(n, k)) * 0.05, jnp.float32).astype(jnp.float8_e4m3fn)
    scale = jnp.asarray(rng.uniform(0.5, 2, (n // 128, k // 128)), jnp.float32)
    return values, scale, np.asarray(BlockFp8(values, scale).dequantize(jnp.float32), np.float64)


@pytest.mark.parametrize("config", [None, fp8_matmul.Fp8MatmulConfig(16, 2, 2), fp8_matmul.Fp8MatmulConfig(64, 4),
                                    fp8_matmul.Fp8MatmulConfig(128, 1, 4), fp8_matmul.Fp8MatmulConfig(32, 2, 1, kind="gemv"),
                                    fp8_matmul.Fp8MatmulConfig(16, 4, 1, kind="gemv"),
                                    fp8_matmul.Fp8MatmulConfig(64, 2, 2, kind="gemv")])
def test_fp8_decode_kernel_equals_numpy_on_the_dequantized_weight(config):
    rng = np.random.default_rng(0)
    values, scale, weight = block_fp8(rng, 256, 512)
    gemv = config is not None and config.kind.startswith("gemv")
    for rows in (1, 3) if gemv else (1, 5, 64):
        x = rng.normal(size=(rows, 512)).astype(np.float32)
        ours = fp8_matmul.fp8_matmul(jnp.asarray(x), values, scale, config, interpret=True)
        np.testing.assert_allclose(ours, x @ weight.T, rtol=1e-5, atol=1e-5 * np.abs(x @ weight.T).max())
        if config is not None:  # a plain weight (no scales): x @ w.T as it is
            plain = np.asarray(values.astype(jnp.float32), np.float64)
            ours = fp8_matmul.fp8_matmul(jnp.asarray(x), values.astype(jnp.float32), None, config, interpret=True)
            np.testing.assert_allclose(ours, x @ plain.T, rtol=1e-5, atol=1e-5 * np.abs(x @ plain.T).max())


def test_w8a8_kernel_is_the_product_of_x_quantized_per_row_and_block():
    """The w8a8 kind quantizes each row's 128-column block of x to float8 (scale = its largest
    magnitude / 448): it equals numpy's product of that quantized x with the dequantized weight, and
    stays within float8's rounding (2^-4 relative per element) of the exact product."""
    rng = np.random.default_rng(1)
    values, scale, weight = block_fp8(rng, 256, 512)
    config = fp8_matmul.Fp8MatmulConfig(64, 2, 1, kind="w8a8")
    for rows in (1, 5, 64):
        x = rng.normal(size=(rows, 512)).astype(np.float32)
        blocks = x.reshape(rows, 4, 128)
        amax = np.abs(blocks).max(axis=2, keepdims=True)
        x_scale = amax * np.float32(1 / 448)
        xq = np.asarray(jnp.asarray(blocks * (np.float32(448) / amax)).astype(jnp.float8_e4m3fn), np.float64)
        ref = (xq * x_scale).reshape(rows, 512) @ weight.T
        ours = np.asarray(fp8_matmul.fp8_matmul(jnp.asarray(x), values, scale, config, interpret=True))
        np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
        exact = x @ weight.T
        assert np.abs(ours - exact).max() < 0.05 * np.abs(exact).max()


def test_fp8_decode_kernel_configs_are_checked():
    assert fp8_matmul.parse_config("32,4,1,4,4,gemv") == fp8_matmul.Fp8MatmulConfig(32, 4, 1, 4, 4, "gemv")
    assert fp8_matmul.parse_config("64,2") == fp8_matmul.Fp8MatmulConfig(64, 2)
    x, values = jnp.zeros((8, 256)), jnp.zeros((128, 256), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="at most 4 rows"):
        fp8_matmul.fp8_matmul(x, values, None, fp8_matmul.Fp8MatmulConfig(32, 1, kind="gemv"), interpret=True)
    with pytest.raises(ValueError, match="kind="):
        fp8_matmul.fp8_matmul(x, values, None, fp8_matmul.Fp8MatmulConfig(32, 1, kind="tiles"), interpret=True)


def test_per_channel_decode_kernel_scales_in_fp32_so_float16_does_not_overflow():
    """A per-channel weight's kernel product (rows <= 4) is unscaled until the channel scale is
    applied, ~448 / max|w| times the output: it must stay fp32 until then. x float16, outputs ~50:
    linear equals the dequantized product (the unscaled product, ~1e6, would be inf in float16)."""
    rng = np.random.default_rng(5)
    w = rng.normal(size=(64, 1024)).astype(np.float32) * 0.02
    scale = np.abs(w).max(1, keepdims=True) / 448
    values = jnp.asarray(w / scale).astype(jnp.float8_e4m3fn)
    weight = Fp8KernelWeight(values, jnp.asarray(scale))
    x = jnp.asarray(rng.normal(size=(1, 1024)) * 30, jnp.float16)
    ref = np.asarray(x, np.float32) @ (np.asarray(values.astype(jnp.float32)) * scale).T
    ours = np.asarray(linear(x, weight), np.float32)
    assert np.abs(ref).max() > 20 and np.isfinite(ours).all()
    np.testing.assert_allclose(ours, ref, rtol=2e-2, atol=2e-2 * np.abs(ref).max())


def decode_logprobs(model_dir, prompt, **args) -> tuple[list[int], np.ndarray]:
    """Greedy tokens of a lone request (decode steps of one row: the FP8 decode kernel's shape) and
    their logprobs."""
    args = dict(dtype="float32", num_blocks=32, block_size=4, max_num_seqs=2, max_num_batched_tokens=32,
                warmup=False) | args
    engine = Engine.from_args(EngineArgs(model=str(model_dir), **args))
    done = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0))[0]
    return done.token_ids, np.array(done.logprobs, np.float64)


def test_fp8_kernels_give_the_dequantizing_paths_logprobs(tmp_path, monkeypatch):
    """The FP8 decode kernel (interpreted here) through the engine's steps, projections fused, equals
    XLA's dequantizing product on `--quantization fp8`'s per-channel weights: decode steps of one row
    (the kernel, the channel scale applied to its fp32 output: float16 does not overflow) and prompt
    steps (W8A8 on both paths)."""
    src = make_hf_checkpoint("qwen3", tmp_path / "src", hidden_size=128, num_key_value_heads=4,
                             intermediate_size=256)[1]
    long_prompt = np.random.default_rng(4).integers(0, 128, 90).tolist()
    results = {}
    for kernel in ("0", "1"):
        monkeypatch.setenv("JTP_FP8_KERNEL", kernel)
        results[kernel] = [jtp_logprobs(src, PROMPT, quantization="fp8"),
                           jtp_logprobs(src, long_prompt, quantization="fp8", max_num_batched_tokens=128)]
        results[kernel + "-decode"] = [decode_logprobs(src, PROMPT, quantization="fp8", dtype=dtype)
                                       for dtype in ("float32", "float16")]
    for (xla_tokens, xla), (kernel_tokens, kernel), atol in zip(results["0-decode"], results["1-decode"], (1e-4, 2e-2)):
        assert kernel_tokens == xla_tokens and np.isfinite(kernel).all()
        np.testing.assert_allclose(kernel, xla, atol=atol)
    engine = results["1"][0][1]
    for layer in engine.runner.params["layers"]:
        assert {name for name, w in layer.items() if isinstance(w, FusedFp8KernelWeight)} == \
            {"q_proj+k_proj+v_proj", "gate_proj+up_proj"}
        assert all(isinstance(w, Fp8KernelWeight) for name, w in layer.items() if name in ("o_proj", "down_proj"))
    for (xla, _), (kernel, _) in zip(results["0"], results["1"]):
        np.testing.assert_allclose(kernel, xla, atol=1e-4)


def test_fp8_moe_kernel_reads_float8_experts_and_gives_ragged_dots_outputs(tmp_path, monkeypatch):
    """JTP_MOE=kernel (the grouped-matmul kernel, interpreted here) on an FP8 MoE checkpoint: the
    experts go to it as float8 values and block scales, not dequantized, at tp 1, 2 and with expert
    parallelism, and prefill and decode give JTP_MOE=ragged_dot's logprobs and greedy tokens."""
    src = hf_source("qwen3_moe", tmp_path / "src")
    qc.quantize_checkpoint(src, fp8 := tmp_path / "fp8", "fp8", block=16)  # I = 32: tp=2 holds whole blocks

    def run(tp: int = 1, ep: bool = False):
        engine = Engine.from_args(EngineArgs(model=str(fp8), dtype="float32", num_blocks=32, block_size=4,
                                             max_num_seqs=2, max_num_batched_tokens=16, tensor_parallel_size=tp,
                                             enable_expert_parallel=ep, warmup=False))
        done = engine.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0, logprobs=0,
                                                        prompt_logprobs=0))[0]
        return done.prompt_logprobs.logprobs[1:], done.logprobs, done.token_ids

    monkeypatch.setenv("JTP_MOE", "ragged_dot")
    prompt_base, decode_base, tokens_base = run()
    monkeypatch.setenv("JTP_MOE", "kernel")
    kernel = grouped_matmul.grouped_matmul
    scaled = []  # whether each traced kernel call was given block scales
    monkeypatch.setattr(grouped_matmul, "grouped_matmul",
                        lambda *a, **kw: scaled.append(kw.get("scales") is not None) or kernel(*a, **kw))
    for tp, ep in ((1, False), (2, False), (2, True)):
        scaled.clear()
        prompt, decode, tokens = run(tp, ep)
        assert scaled and all(scaled), (tp, ep)
        np.testing.assert_allclose(prompt, prompt_base, atol=1e-4, err_msg=f"prefill tp={tp} ep={ep}")
        np.testing.assert_allclose(decode, decode_base, atol=1e-4, err_msg=f"decode tp={tp} ep={ep}")
        assert tokens == tokens_base, (tp, ep)


def test_random_weights_of_an_fp8_config_are_fp8(tmp_path):
    src = hf_source("qwen3", tmp_path / "src")
    qc.quantize_checkpoint(src, tmp_path / "fp8", "fp8", block=16)
    (tmp_path / "fp8" / "model.safetensors").unlink()
    engine = Engine.from_args(EngineArgs(model=str(tmp_path / "fp8"), load_format="dummy", num_blocks=16,
                                         warmup=False))
    q = engine.runner.params["layers"][0]["q_proj"]
    assert isinstance(q, BlockFp8) and q.values.dtype == np.dtype("float8_e4m3fn") and q.scale.shape == (8, 4)
    assert len(engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0))[0].token_ids) == 4


def edit_tensors(model_dir, edit) -> None:
    tensors = qc.read_tensors(model_dir / "model.safetensors")
    edit(tensors)
    qc.write_tensors(model_dir / "model.safetensors", tensors)


def test_bad_fp8_checkpoints_are_refused_naming_the_tensor(tmp_path):
    src = hf_source("qwen3_moe", tmp_path / "src", intermediate_size=128)
    fp8 = tmp_path / "fp8"
    qc.quantize_checkpoint(src, fp8, "fp8", block=16)
    scale = "model.layers.0.self_attn.q_proj.weight_scale_inv"

    def refused(directory, *match, tp: int = 1, error=CheckpointError):
        with pytest.raises(error) as e:
            Engine.from_args(EngineArgs(model=str(directory), num_blocks=16, warmup=False, tensor_parallel_size=tp))
        for m in match:
            assert m in str(e.value)

    wrong = tmp_path / "wrong-shape"
    shutil.copytree(fp8, wrong)
    edit_tensors(wrong, lambda t: t.update({scale: t[scale][:, :1]}))
    refused(wrong, scale, "wrong shape")

    missing = tmp_path / "missing-scale"
    shutil.copytree(fp8, missing)
    edit_tensors(missing, lambda t: t.pop("model.layers.0.mlp.experts.1.up_proj.weight_scale_inv"))
    refused(missing, "experts.1.up_proj.weight", "no weight_scale_inv beside it")

    partial = tmp_path / "partial-blocks"
    qc.quantize_checkpoint(src, partial, "fp8", block=24)  # 64-wide rows end in a partial block
    refused(partial, "does not fall on the FP8 block boundaries (24)")

    wide = tmp_path / "wide-blocks"
    qc.quantize_checkpoint(src, wide, "fp8", block=64)  # each of the 2 KV heads repeated at tp=4: 32 rows
    refused(wide, "k_proj", "a KV head's rows (32) does not fall on the FP8 block boundaries (64)", tp=4)
    src4 = hf_source("qwen3", tmp_path / "src4", num_key_value_heads=4, intermediate_size=128)
    qc.quantize_checkpoint(src4, wide4 := tmp_path / "wide-blocks-4", "fp8", block=64)
    refused(wide4, "FP8 block scales", "does not divide by tp=4", tp=4, error=ShardingError)  # 2 blocks of rows

    with pytest.raises(CheckpointError, match="writes full-precision Orbax checkpoints only"):
        convert_to_orbax(fp8, tmp_path / "orbax")
    config = json.loads((fp8 / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [16, 16]


def test_fp8_kv_cache_holds_more_tokens_and_stays_near_hf(tmp_path, monkeypatch):
    """--kv-cache-dtype fp8: pages a quarter of float32's, logprobs near HF's (K/V rounded to e4m3),
    and the attention kernel (interpreted) reading float8 pages gives the reference's logprobs."""
    src = hf_source("qwen3", tmp_path / "src")
    ours, engine = jtp_logprobs(src, PROMPT, kv_cache_dtype="fp8")
    plain, plain_engine = jtp_logprobs(src, PROMPT)
    assert engine.runner.cache[0].k.dtype == np.dtype("float8_e4m3fn")
    assert 4 * engine.runner.bytes_per_block() == plain_engine.runner.bytes_per_block()
    assert engine.cache_identity != plain_engine.cache_identity  # the prefix cache and snapshots tell them apart
    gap = np.abs(ours - hf_logprobs(src, PROMPT))
    assert 0 < gap.mean() < 0.05 and gap.max() < 0.25, (gap.mean(), gap.max())  # stated: e4m3's rounding of K/V
    monkeypatch.setenv("JTP_ATTENTION", "kernel")
    kernel, _ = jtp_logprobs(src, PROMPT, kv_cache_dtype="fp8")
    np.testing.assert_allclose(kernel, ours, atol=1e-4)


def test_fp8_kernels_keep_qwen3_5_moe_shared_expert(tmp_path, monkeypatch):
    """Qwen3.5-MoE through the FP8 kernel path (interpreted): its shared expert's gate and up are
    fused like the MLP's, and the layer still finds and adds the shared expert."""
    src = save(build_model("qwen3_5_moe_text", **SHALLOW, hidden_size=128, shared_expert_intermediate_size=128,
                           moe_intermediate_size=128), tmp_path / "src")
    results = {}
    for kernel in ("0", "1"):
        monkeypatch.setenv("JTP_FP8_KERNEL", kernel)
        results[kernel] = jtp_logprobs(src, PROMPT, quantization="fp8")
    layers = results["1"][1].runner.params["layers"]
    assert any("shared_gate+shared_up" in layer for layer in layers)
    np.testing.assert_allclose(results["1"][0], results["0"][0], atol=1e-4)


@pytest.mark.parametrize("config", [fp8_matmul.Fp8MatmulConfig(32, 4, 1, 4, 3, "gemv"), fp8_matmul.Fp8MatmulConfig(64, 4),
                                    fp8_matmul.Fp8MatmulConfig(64, 2, 1, 4, 3, "w8a8")])
def test_fp8_decode_kernel_kinds_lower_to_triton_for_cuda(config):
    """Pallas -> Triton lowering on the CPU: an op a kind uses that Triton lacks fails here, not on a lent GPU."""
    S = jax.ShapeDtypeStruct
    rows = 1 if config.kind == "gemv" else 16
    args = S((rows, 1024), jnp.bfloat16), S((256, 1024), jnp.float8_e4m3fn), S((2, 8), jnp.float32)
    text = cuda_lowering(lambda x, v, s: fp8_matmul.fp8_matmul(x, v, s, config), *args)
    assert f"jtp_fp8_{config.kind}" in text and "triton" in text
