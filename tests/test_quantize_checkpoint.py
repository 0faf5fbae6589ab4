"""scripts/quantize_checkpoint.py: quantized copies of tiny HF checkpoints in Qwen's FP8, AWQ and
GPTQ-Int4 layouts, and their decode.

The expectations are written here from the formats' specs, not from the script: which tensors a
release quantizes (a regex of its own), each tensor's safetensors dtype and shape (read from the
file's header), the configs, words packed from hand-made ramps whose 4-bit values are known, and a
second, per-element decode of the packed bits. Decoded weights lie within each format's rounding
error of the originals, and an HF model loaded with them runs with logits near the original's.
"""
from __future__ import annotations

import json
import math
import re
import struct

import ml_dtypes
import numpy as np
import pytest
from scripts_loader import load_script

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_models import make_hf_checkpoint  # noqa: E402

qc = load_script("quantize_checkpoint")

BLOCK, GROUP = 16, 32
# What the official releases quantize in these models (the router mlp.gate, norms, embeddings and
# lm_head never).
QUANTIZED = re.compile(r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(experts\.\d+\.)?(gate|up|down)_proj)"
                       r"\.weight$")
CONFIGS = {
    "fp8": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK]},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "version": "gemm", "zero_point": True,
            "modules_to_not_convert": None},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": True,
             "damp_percent": 0.01, "true_sequential": True, "static_groups": False},
}
NP = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn,
      "I32": np.int32}
IDS = [3, 17, 99, 42, 5, 64, 127, 0, 11, 23]
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's WQLinear_GEMM.from_linear: nibble k holds column AWQ_ORDER[k]


def raw(path) -> dict[str, tuple[str, list[int], bytes]]:
    """A safetensors file read by hand: name -> (dtype, shape, bytes)."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header.pop("__metadata__", None)
    return {k: (v["dtype"], v["shape"], data[8 + n + v["data_offsets"][0] : 8 + n + v["data_offsets"][1]])
            for k, v in header.items()}


def array(entry) -> np.ndarray:
    dtype, shape, data = entry
    return np.frombuffer(data, NP[dtype]).reshape(shape)


def expected_layout(src: dict, method: str) -> dict[str, tuple[str, list[int]]]:
    """Each tensor's (dtype, shape) in `method`'s release, from the spec."""
    out = {}
    for name, (dtype, shape, _) in src.items():
        if not QUANTIZED.match(name):
            out[name] = (dtype, shape)
            continue
        module, (o, i) = name[: -len(".weight")], shape
        if method == "fp8":
            out[name] = ("F8_E4M3", [o, i])
            out[f"{module}.weight_scale_inv"] = ("BF16", [math.ceil(o / BLOCK), math.ceil(i / BLOCK)])
        else:
            packed = [i, o // 8] if method == "awq" else [i // 8, o]
            out.update({f"{module}.qweight": ("I32", packed), f"{module}.qzeros": ("I32", [i // GROUP, o // 8]),
                        f"{module}.scales": ("F16", [i // GROUP, o])})
            if method == "gptq":
                out[f"{module}.g_idx"] = ("I32", [i])
    return out


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe"])
def source(request, tmp_path_factory):
    """(HF model, its directory, with a tokenizer file to copy)."""
    model, path = make_hf_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    (path / "tokenizer.json").write_text('{"model": "stand-in"}')
    return model, path


@pytest.fixture(scope="module")
def quantized(source, tmp_path_factory):
    """method -> the quantized copy of `source`."""
    _, src = source
    return {m: _quantize(src, tmp_path_factory.mktemp(m), m) for m in qc.METHODS}


def _quantize(src, dst, method, **kw):
    qc.quantize_checkpoint(src, dst, method, block=BLOCK, group_size=GROUP, **kw)
    return dst


@pytest.mark.parametrize("method", qc.METHODS)
def test_layout_config_and_copies(source, quantized, method):
    _, src_dir = source
    src, out = raw(src_dir / "model.safetensors"), raw(quantized[method] / "model.safetensors")
    assert {k: (d, s) for k, (d, s, _) in out.items()} == expected_layout(src, method)
    assert any(QUANTIZED.match(k) for k in src)
    for name, entry in src.items():
        if not QUANTIZED.match(name):
            assert out[name] == entry, name  # byte for byte
    config = json.loads((quantized[method] / "config.json").read_text())
    assert config.pop("quantization_config") == CONFIGS[method]
    assert config == json.loads((src_dir / "config.json").read_text())
    for name in ("tokenizer.json", "generation_config.json"):
        assert (quantized[method] / name).read_bytes() == (src_dir / name).read_bytes()


def _module_tensors(path, method):
    """module -> {suffix: array} of every quantized module of a directory, read by hand."""
    tensors = raw(path / "model.safetensors")
    modules = {k.rpartition(".")[0] for k in tensors if k.endswith(qc.SUFFIXES[method][1])}
    return {m: {s: array(tensors[f"{m}.{s}"]) for s in qc.SUFFIXES[method]} for m in modules}


def _per_element(per_group: np.ndarray, rows: int) -> np.ndarray:
    """[in / G, out] -> [out, in]."""
    return np.repeat(per_group.astype(np.float32), rows // per_group.shape[0], axis=0).T


@pytest.mark.parametrize("method", qc.METHODS)
def test_decode_is_within_rounding_error(source, quantized, method):
    _, src_dir = source
    src = {k: array(v) for k, v in raw(src_dir / "model.safetensors").items()}
    for module, t in _module_tensors(quantized[method], method).items():
        w = src[f"{module}.weight"]
        decoded = qc.dequantize(method, t, (BLOCK, BLOCK))
        assert decoded.dtype == np.float32 and decoded.shape == w.shape
        err = np.abs(decoded - w)
        if method == "fp8":
            scale = np.kron(t["weight_scale_inv"].astype(np.float32), np.ones((BLOCK, BLOCK)))
            scale = scale[: w.shape[0], : w.shape[1]]
            # e4m3 keeps 3 mantissa bits: half a unit is 2^-4 of the value, 2^-10 of the scale below 2^-6.
            assert np.all(err <= 2**-4 * np.abs(w) + 2**-10 * scale), module
        else:
            # Half a step, and a little for the float16 scale (a group's top can round one step past 15).
            assert np.all(err <= 0.51 * _per_element(t["scales"], w.shape[1])), module
        assert err.max() > 0, module


def _slow_unpack(words: np.ndarray, axis: int, order) -> np.ndarray:
    """Nibble k of word j along `axis` is value 8j + order[k]: one element at a time."""
    shape = list(words.shape)
    shape[axis] *= 8
    out = np.zeros(shape, np.int64)
    for idx, word in np.ndenumerate(words.view(np.uint32)):
        for k in range(8):
            at = list(idx)
            at[axis] = 8 * idx[axis] + order[k]
            out[tuple(at)] = (int(word) >> (4 * k)) & 15
    return out


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_vectorised_decode_matches_a_per_element_one(source, quantized, method):
    """On one layer of each shape kind: the bits as the formats define them, read one by one."""
    for module, t in sorted(_module_tensors(quantized[method], method).items())[:3]:
        if method == "awq":  # packed along the output dim, interleaved
            q, zeros = _slow_unpack(t["qweight"], 1, AWQ_ORDER), _slow_unpack(t["qzeros"], 1, AWQ_ORDER)
            g_idx = np.arange(q.shape[0]) // GROUP
        else:  # packed along the input dim, in order; zeros stored minus one
            q, zeros = _slow_unpack(t["qweight"], 0, range(8)), _slow_unpack(t["qzeros"], 1, range(8)) + 1
            g_idx = t["g_idx"]
            assert np.array_equal(g_idx, np.arange(q.shape[0]) // GROUP)
        scales = t["scales"].astype(np.float32)
        slow = np.zeros(q.shape, np.float32)
        for i, o in np.ndindex(*q.shape):
            slow[i, o] = np.float32(q[i, o] - zeros[g_idx[i], o]) * scales[g_idx[i], o]
        np.testing.assert_array_equal(qc.dequantize(method, t), slow.T, err_msg=module)


def test_unpack_inverts_autoawq_order():
    """AutoAWQ unpacks with AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7] (awq/utils/packing_utils.py)."""
    assert list(np.argsort(qc.AWQ_ORDER)) == [0, 4, 1, 5, 2, 6, 3, 7]


def _ramp(out_features=8, in_features=16):
    """q[i, o] = (o + i) % 16: every output column holds each 4-bit value once per group of 16."""
    return (np.arange(out_features)[None, :] + np.arange(in_features)[:, None]) % 16


def test_awq_packs_a_known_ramp():
    q = _ramp()
    w = ((q - 8) * 0.125).T.astype(np.float32)  # min -1, max 0.875: scale 0.125, zero 8
    t = qc.quantize_awq(w, group=16)
    words = t["qweight"].view(np.uint32)
    # Row 0 holds columns 0..7 = values 0..7 in the order 0, 2, 4, 6, 1, 3, 5, 7 (low nibble first).
    assert [hex(x) for x in words[:3, 0]] == ["0x75316420", "0x86427531", "0x97538642"]
    assert words.shape == (16, 1)
    assert t["qzeros"].view(np.uint32).tolist() == [[0x88888888]]
    assert t["scales"].dtype == np.float16 and np.all(t["scales"] == 0.125)
    np.testing.assert_array_equal(qc.dequantize("awq", t), w)


def test_gptq_packs_a_known_ramp():
    q = _ramp()
    w = np.where(q == 0, -7.5, q - 8.0).T.astype(np.float32) * 0.125  # amax 7.5 steps: scale 0.125
    t = qc.quantize_gptq(w, group=16)
    words = t["qweight"].view(np.uint32)
    # Column 0 of rows 0..15 holds values 0..15: input row 8i + k in nibble k of row i.
    assert [hex(x) for x in words[:, 0]] == ["0x76543210", "0xfedcba98"]
    assert hex(words[0, 1]) == "0x87654321"
    assert t["qzeros"].view(np.uint32).tolist() == [[0x77777777]]  # zero 8, stored as 7
    assert t["g_idx"].tolist() == [0] * 16 and t["g_idx"].dtype == np.int32
    assert t["scales"].dtype == np.float16 and np.all(t["scales"] == 0.125)
    expected = np.where(q == 0, -8.0, q - 8.0).T * 0.125  # -7.5 steps round (to even) to -8
    np.testing.assert_array_equal(qc.dequantize("gptq", t), expected)


@pytest.mark.parametrize("scale_dtype", [ml_dtypes.bfloat16, np.float32])
def test_fp8_partial_blocks(scale_dtype):
    rng = np.random.default_rng(0)
    w = rng.normal(size=(37, 50)).astype(np.float32) * np.repeat(np.logspace(-3, 1, 4), [10, 10, 10, 7])[:, None]
    w[:16, 16:32] = 0  # an all-zero block
    t = qc.quantize_fp8(w, 16, scale_dtype)
    assert t["weight"].dtype == ml_dtypes.float8_e4m3fn and t["weight"].shape == (37, 50)
    assert t["weight_scale_inv"].dtype == scale_dtype and t["weight_scale_inv"].shape == (3, 4)
    for r, c in np.ndindex(3, 4):
        block = w[16 * r : 16 * r + 16, 16 * c : 16 * c + 16]
        if block.any():
            assert t["weight_scale_inv"][r, c] == scale_dtype(np.abs(block).max() / 448)
    assert np.isfinite(t["weight_scale_inv"].astype(np.float32)).all()
    decoded = qc.dequantize("fp8", t, (16, 16))
    assert np.all(decoded[:16, 16:32] == 0)
    assert np.all(np.abs(decoded - w) <= 2**-4 * np.abs(w) + 1e-6 * np.abs(w).max())


@pytest.mark.parametrize("method", qc.METHODS)
def test_hf_model_runs_on_the_decoded_weights(source, quantized, method, tmp_path):
    """The parity tests' reference: the original model's logits against the decoded weights'. Dense:
    load_state_dict, strict; MoE (transformers fuses experts in memory): through write_dequantized."""
    model, src_dir = source
    ids = torch.tensor([IDS])
    with torch.no_grad():
        ref = model(ids).logits[0].numpy()
    if model.config.model_type == "qwen3_moe":
        reference = transformers.AutoModelForCausalLM.from_pretrained(qc.write_dequantized(quantized[method], tmp_path))
        assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
    else:
        reference = transformers.AutoModelForCausalLM.from_pretrained(src_dir)
        decoded = qc.dequantized_state_dict(quantized[method])
        reference.load_state_dict({k: torch.from_numpy(v) for k, v in decoded.items()}, strict=True)
    with torch.no_grad():
        logits = reference(ids).logits[0].numpy()
    err = np.abs(logits - ref).max()
    # Nonzero (the weights changed), and far below what scrambled weights give (~1.5x the logits).
    assert 0 < err < 0.5 * np.abs(ref).max(), err


@pytest.mark.parametrize("method", qc.METHODS)
def test_skip_keeps_modules_in_float_and_lists_them(source, tmp_path, method, capsys):
    _, src_dir = source
    assert qc.main(["--model", str(src_dir), "--out", str(tmp_path), "--method", method, "--block", str(BLOCK),
                    "--group-size", str(GROUP), "--skip", r"layers\.1\.mlp\.", "--skip", "^nothing$"]) == 0
    skipped = [f"model.layers.1.mlp.{p}_proj" for p in ("down", "gate", "up")]
    src, out = raw(src_dir / "model.safetensors"), raw(tmp_path / "model.safetensors")
    for module in skipped:
        assert out[f"{module}.weight"] == src[f"{module}.weight"]
    assert f"model.layers.0.self_attn.q_proj.{qc.SUFFIXES[method][1]}" in out  # the rest is quantized
    config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert json.loads(capsys.readouterr().out)["quantization_config"] == config
    if method == "gptq":  # GPTQModel's (and vLLM's) exclusion: re.match of "-:<regex>" on module names
        modules = {k.rpartition(".")[0] for k in src if k.endswith(".weight")}
        excluded = {m for m in modules for p in config["dynamic"] if re.match(p.removeprefix("-:"), m)}
        assert config["dynamic"] and excluded == set(skipped)
    else:
        assert config["modules_to_not_convert"] == skipped


def test_a_shape_that_does_not_pack_is_refused(source, tmp_path, capsys):
    _, src_dir = source
    with pytest.raises(ValueError, match=r"^model\.layers\.0\.\S+_proj: awq needs .*--skip"):
        qc.quantize_checkpoint(src_dir, tmp_path, "awq", group_size=48)  # 64 inputs: no 48-row groups
    assert qc.main(["--model", str(src_dir), "--out", str(tmp_path), "--method", "gptq", "--group-size", "48"]) == 1
    assert "group_size 48" in capsys.readouterr().err


HYBRID_QUANTIZED = re.compile(
    r"layers\.\d+\.(self_attn\.[qkvo]_proj|linear_attn\.(in_proj_qkvz|in_proj_qkv|in_proj_z|out_proj)"
    r"|mlp\.(experts\.\d+\.|shared_expert\.)?(gate|up|down)_proj)\.weight$")


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5_moe_text"])
def test_hybrid_linear_attention_and_fused_experts(kind, tmp_path):
    """Gated DeltaNet projections are quantized, its per-head gates (in_proj_ba / in_proj_a, b),
    conv1d, A_log and dt_bias are not; fused experts come out per expert, each quantized."""
    from hf_hybrid import build_model, save

    src_dir = save(build_model(kind), tmp_path / "src", fuse_experts=kind == "qwen3_5_moe_text")
    src = raw(src_dir / "model.safetensors")
    fused = {k: array(v) for k, v in src.items() if k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    assert bool(fused) == (kind == "qwen3_5_moe_text")
    for method, group in (("fp8", GROUP), ("awq", 8)):  # out_proj has 72 inputs
        dst = tmp_path / method
        qc.quantize_checkpoint(src_dir, dst, method, block=BLOCK, group_size=group)
        out = raw(dst / "model.safetensors")
        kept = [k for k in src if k not in fused and not HYBRID_QUANTIZED.search(k)]
        assert any("in_proj_b" in k for k in kept) and any("conv1d" in k for k in kept)
        assert all(out[k] == src[k] for k in kept)
        quantized = [k for k in out if HYBRID_QUANTIZED.search(k)] if method == "fp8" else \
            [k for k in out if k.endswith(".qweight")]
        assert any("linear_attn.out_proj" in k for k in quantized) and any("shared_expert." in k for k in quantized)
        assert not any(k in out for k in fused)
        decoded = qc.dequantized_state_dict(dst)
        for name, value in fused.items():  # [E, 2I, H] gate then up, [E, H, I]
            prefix, _, fused_kind = name.rpartition(".")
            for e in range(value.shape[0]):
                parts = dict(zip(("gate_proj", "up_proj"), np.split(value[e], 2))) if fused_kind == "gate_up_proj" \
                    else {"down_proj": value[e]}
                for proj, w in parts.items():  # exactly what quantizing that slice alone gives
                    expected = qc.dequantize(method, qc.quantize(method, w, BLOCK, group), (BLOCK, BLOCK))
                    np.testing.assert_array_equal(decoded[f"{prefix}.{e}.{proj}.weight"], expected)
