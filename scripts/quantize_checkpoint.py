#!/usr/bin/env python
"""Write a quantized copy of a Hugging Face checkpoint in the layout of the official releases.

    python scripts/quantize_checkpoint.py --model SRC --out DST --method fp8 [--block 128]
    python scripts/quantize_checkpoint.py --model SRC --out DST --method awq|gptq [--group-size 128]
        [--skip REGEX ...]

For tests: a tiny float checkpoint (config.json + one model.safetensors, as `save_pretrained`
writes it) becomes a directory with the tensor names, dtypes, shapes and config.json
`quantization_config` of Qwen's FP8, AWQ and GPTQ-Int4 releases, so a loader can be tested
without downloading them. Every other file is copied; every tensor that is not quantized is copied
byte for byte. Quantization is plain round-to-nearest (no calibration, no GPTQ Hessian updates):
what matters here is the format. `dequantize` / `dequantized_state_dict` decode it again with
numpy, as a reader of the official files must; `write_dequantized` turns a quantized directory
back into a float checkpoint that transformers loads (the reference of parity tests).

What is quantized: the 2-D weights of the linear layers inside the decoder layers
(`model.layers.N.` or `model.language_model.layers.N.`): self_attn.{q,k,v,o}_proj,
mlp.{gate,up,down}_proj (also per expert and in the shared expert) and the Gated DeltaNet
projections linear_attn.{in_proj_qkvz, in_proj_qkv, in_proj_z, out_proj}. Left as they are:
embeddings, lm_head, norms, biases, the MoE router mlp.gate, shared_expert_gate, conv1d, A_log,
dt_bias, the MTP head and the vision tower, and linear_attn.{in_proj_ba, in_proj_a, in_proj_b}:
Qwen's Qwen3.5 FP8 releases keep those per-head gate projections in bf16 (their
modules_to_not_convert), and their few outputs (2 * value heads) rarely pack into int4 words.
`--skip REGEX` (re.search on the module name, e.g. 'layers\\.0\\.mlp') keeps more modules in
float; they are listed in the config: FP8 `modules_to_not_convert`, AWQ `modules_to_not_convert`,
GPTQ `dynamic` ({"-:<module regex>": {}}, GPTQModel's and vLLM's way of excluding a module).

Fused experts (the 3-D `mlp.experts.gate_up_proj` [E, 2I, H] / `mlp.experts.down_proj` [E, H, I]
of Qwen3.5-MoE files) are first split into per-expert `mlp.experts.N.{gate,up,down}_proj.weight`,
the layout of Qwen's own Qwen3.5-MoE FP8 release; then each expert is quantized like any linear.

The formats (weight [out, in] as nn.Linear stores it):

  fp8   X.weight F8_E4M3 [out, in] and X.weight_scale_inv [ceil(out/B), ceil(in/B)] with
        weight ~= fp8 * scale_inv per B x B block (the last blocks partial). scale_inv =
        amax(|block|) / 448, rounded to its stored dtype first and fp8 = round(w / scale_inv),
        clipped to +-448, so the decode uses exactly the scale the encode divided by. Stored in
        bfloat16 by default: Qwen's Qwen3 / Qwen3.5 FP8 files store it so (read from the
        safetensors headers of Qwen3-1.7B-FP8 in modular/modular#7142 and of Qwen3-32B-FP8 in
        HabanaAI/vllm-fork#2141); DeepSeek-V3's files use float32 (--scale-dtype float32).
  awq   AutoAWQ GEMM: X.qweight I32 [in, out/8], X.qzeros I32 [in/G, out/8], X.scales F16
        [in/G, out]. Per group of G input rows and output column: scale = max(max - min, 1e-5) / 15,
        zero = clip(round(-min / scale), 0, 15), q = clip(round(w / scale) + zero, 0, 15);
        w ~= (q - zero) * scale. 8 nibbles per int32 along the output dim in AWQ_ORDER: bits
        4k..4k+3 of word j hold output column 8j + AWQ_ORDER[k] (AutoAWQ's
        WQLinear_GEMM.from_linear; its reader undoes it with AWQ_REVERSE_ORDER, the inverse
        permutation, in awq/utils/packing_utils.py). qzeros packed the same way.
  gptq  AutoGPTQ / GPTQModel v1 ("gptq" checkpoint format), sym, desc_act false: X.qweight I32
        [in/8, out] (input row 8i + k in bits 4k..4k+3 of row i), X.qzeros I32 [in/G, out/8]
        (output column 8j + k in bits 4k.. of word j, storing zero - 1 = 7), X.scales F16
        [in/G, out], X.g_idx I32 [in] = arange(in) // G. AutoGPTQ's symmetric rule (its
        Quantizer.find_params, maxq = 15): scale = 2 * amax / 15, zero = 8, q = clip(round(w /
        scale) + 8, 0, 15); w ~= (q - zero) * scale. (For a group with no negative weight
        AutoGPTQ takes the range [0, amax] instead, i.e. scale = amax / 15 with values clipped at
        7 * scale; that quirk is not copied, every group here gets the symmetric range.)

One model.safetensors is read and one is written (the tiny checkpoints of the tests; a real
model's shards would need an index).
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import struct
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

WEIGHTS = "model.safetensors"
METHODS = ("fp8", "awq", "gptq")
E4M3_MAX = 448.0  # float8_e4m3fn's largest finite value
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble k of an AWQ word holds output column AWQ_ORDER[k]
SEQUENTIAL = tuple(range(8))
PACK = 8  # 4-bit values per int32
# What each method writes for a quantized module X (its tensors are X.<suffix>).
SUFFIXES = {"fp8": ("weight", "weight_scale_inv"), "awq": ("qweight", "qzeros", "scales"),
            "gptq": ("qweight", "qzeros", "scales", "g_idx")}
DECODER_LAYER = re.compile(r"^model\.(language_model\.)?layers\.\d+\.")
LINEAR = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
          "in_proj_qkvz", "in_proj_qkv", "in_proj_z", "out_proj"}
FUSED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
          "F8_E4M3": ml_dtypes.float8_e4m3fn, "I64": np.int64, "I32": np.int32, "I16": np.int16,
          "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
SCALE_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}


# ----------------------------------------------------------------------------- safetensors files


def read_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file, memory-mapped. Read from the header by hand: the
    safetensors library's numpy reader has no float8."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    header.pop("__metadata__", None)
    data = np.memmap(path, np.uint8, mode="r", offset=8 + header_len)
    tensors = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        tensors[name] = data[begin:end].view(DTYPES[entry["dtype"]]).reshape(entry["shape"])
    return tensors


def write_tensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path), metadata={"format": "pt"})


# ----------------------------------------------------------------------------- which weights


def unfuse_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """3-D fused expert tensors as per-expert linear weights (gate rows first in gate_up_proj)."""
    out = {}
    for name, value in tensors.items():
        m = FUSED_EXPERTS.match(name)
        if not m or value.ndim != 3:
            out[name] = value
            continue
        prefix, kind = m.groups()
        for e, w in enumerate(value):
            if kind == "down_proj":
                out[f"{prefix}.{e}.down_proj.weight"] = w
            else:
                gate, up = np.split(w, 2)
                out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = gate, up
    return out


def linear_modules(tensors: dict[str, np.ndarray]) -> list[str]:
    """The modules (tensor name less '.weight') whose weight the official releases quantize."""
    return [name[: -len(".weight")] for name, value in tensors.items()
            if name.endswith(".weight") and value.ndim == 2 and DECODER_LAYER.match(name)
            and name.split(".")[-2] in LINEAR]


# ----------------------------------------------------------------------------- fp8


def _expand(per_block: np.ndarray, block: tuple[int, int], shape: tuple[int, int]) -> np.ndarray:
    """One value per block -> one per element (the last, partial blocks cut to the shape)."""
    return np.repeat(np.repeat(per_block, block[0], 0), block[1], 1)[: shape[0], : shape[1]]


def quantize_fp8(w: np.ndarray, block: int, scale_dtype=ml_dtypes.bfloat16) -> dict[str, np.ndarray]:
    w, b = np.asarray(w, np.float32), (block, block)
    rows, cols = -(-w.shape[0] // block), -(-w.shape[1] // block)
    padded = np.zeros((rows * block, cols * block), np.float32)
    padded[: w.shape[0], : w.shape[1]] = np.abs(w)
    amax = padded.reshape(rows, block, cols, block).max(axis=(1, 3))
    # The floor keeps an all-zero block's scale finite (its values stay 0).
    scale_inv = np.maximum(amax / E4M3_MAX, np.finfo(np.float32).tiny).astype(scale_dtype)
    scaled = w / _expand(scale_inv.astype(np.float32), b, w.shape)
    # Clipped: a scale rounded down to bfloat16 can put the block's largest value just past 448.
    return {"weight": np.clip(scaled, -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn),
            "weight_scale_inv": scale_inv}


def dequantize_fp8(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    return weight.astype(np.float32) * _expand(scale_inv.astype(np.float32), tuple(block), weight.shape)


# ----------------------------------------------------------------------------- int4 packing


def pack_int4(q: np.ndarray, order=SEQUENTIAL) -> np.ndarray:
    """Values 0..15 [..., n] -> int32 [..., n/8]: bits 4k..4k+3 of word j hold value 8j + order[k]."""
    nibbles = q.astype(np.uint32).reshape(*q.shape[:-1], -1, PACK)[..., list(order)]
    words = np.zeros(nibbles.shape[:-1], np.uint32)
    for k in range(PACK):
        words |= nibbles[..., k] << np.uint32(4 * k)
    return words.view(np.int32)


def unpack_int4(words: np.ndarray, order=SEQUENTIAL) -> np.ndarray:
    """pack_int4's inverse: int32 [..., n/8] -> int32 [..., n]."""
    shifts = np.arange(0, 32, 4, dtype=np.uint32)
    nibbles = (words.view(np.uint32)[..., None] >> shifts) & np.uint32(15)
    # Value c sits at nibble argsort(order)[c]; for AWQ_ORDER that is AutoAWQ's AWQ_REVERSE_ORDER.
    nibbles = nibbles[..., np.argsort(order)]
    return nibbles.reshape(*words.shape[:-1], -1).astype(np.int32)


def _groups(w: np.ndarray, group: int) -> np.ndarray:
    """[out, in] -> [in / group, group, out]: the input rows of each group."""
    return np.asarray(w, np.float32).T.reshape(w.shape[1] // group, group, w.shape[0])


# ----------------------------------------------------------------------------- awq


def quantize_awq(w: np.ndarray, group: int) -> dict[str, np.ndarray]:
    g = _groups(w, group)
    lo, hi = g.min(axis=1), g.max(axis=1)
    scales = (np.maximum(hi - lo, 1e-5) / 15).astype(np.float16)
    s = scales.astype(np.float32)  # quantize with the scale that is stored
    zeros = np.clip(np.round(-lo / s), 0, 15)
    q = np.clip(np.round(g / s[:, None]) + zeros[:, None], 0, 15).reshape(w.shape[1], w.shape[0])
    return {"qweight": pack_int4(q, AWQ_ORDER), "qzeros": pack_int4(zeros, AWQ_ORDER), "scales": scales}


def dequantize_awq(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray) -> np.ndarray:
    q = unpack_int4(qweight, AWQ_ORDER)  # [in, out]
    group = q.shape[0] // scales.shape[0]
    zeros = np.repeat(unpack_int4(qzeros, AWQ_ORDER), group, 0)
    return ((q - zeros).astype(np.float32) * np.repeat(scales.astype(np.float32), group, 0)).T


# ----------------------------------------------------------------------------- gptq


def quantize_gptq(w: np.ndarray, group: int) -> dict[str, np.ndarray]:
    g = _groups(w, group)
    amax = np.abs(g).max(axis=1)
    # AutoGPTQ widens an all-zero group's range to [-1, 1].
    scales = (np.where(amax > 0, 2 * amax, 2.0) / 15).astype(np.float16)
    q = np.clip(np.round(g / scales.astype(np.float32)[:, None]) + 8, 0, 15).reshape(w.shape[1], w.shape[0])
    return {"qweight": np.ascontiguousarray(pack_int4(q.T).T),
            "qzeros": pack_int4(np.full(scales.shape, 8 - 1)),  # v1 stores zero - 1
            "scales": scales,
            "g_idx": (np.arange(w.shape[1]) // group).astype(np.int32)}


def dequantize_gptq(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, g_idx: np.ndarray) -> np.ndarray:
    q = unpack_int4(np.ascontiguousarray(qweight.T)).T  # [in, out]
    zeros = unpack_int4(qzeros) + 1
    return ((q - zeros[g_idx]).astype(np.float32) * scales.astype(np.float32)[g_idx]).T


# ----------------------------------------------------------------------------- one weight, one config


def quantize(method: str, w: np.ndarray, block: int = 128, group_size: int = 128,
             scale_dtype=ml_dtypes.bfloat16) -> dict[str, np.ndarray]:
    """One weight [out, in] -> its tensors in `method`'s format, by suffix (SUFFIXES)."""
    if method == "fp8":
        return quantize_fp8(w, block, scale_dtype)
    out_features, in_features = w.shape
    if in_features % group_size or out_features % PACK or in_features % PACK:
        raise ValueError(f"{method} needs in % group_size == 0 and in, out % {PACK} == 0; "
                         f"weight is [{out_features}, {in_features}], group_size {group_size}")
    return (quantize_awq if method == "awq" else quantize_gptq)(w, group_size)


def dequantize(method: str, tensors: dict[str, np.ndarray], block: tuple[int, int] = (128, 128)) -> np.ndarray:
    """One module's tensors (by suffix, SUFFIXES[method]) -> its float32 weight [out, in].
    block: FP8's weight_block_size; the int4 formats carry their groups in their shapes."""
    if method == "fp8":
        return dequantize_fp8(tensors["weight"], tensors["weight_scale_inv"], block)
    if method == "awq":
        return dequantize_awq(tensors["qweight"], tensors["qzeros"], tensors["scales"])
    if method == "gptq":
        return dequantize_gptq(tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors["g_idx"])
    raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")


def quantization_config(method: str, block: int, group_size: int, skipped: list[str]) -> dict:
    if method == "fp8":
        config = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                  "weight_block_size": [block, block]}
        return {**config, "modules_to_not_convert": skipped} if skipped else config
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "version": "gemm", "zero_point": True,
                "modules_to_not_convert": skipped or None}
    config = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": False, "sym": True,
              "damp_percent": 0.01, "true_sequential": True, "static_groups": False}
    return {**config, "dynamic": {f"-:{re.escape(m)}$": {} for m in skipped}} if skipped else config


# ----------------------------------------------------------------------------- directories


def _copy_other_files(src: Path, dst: Path) -> None:
    """Tokenizer files, generation_config.json, ...: everything but the weights and config.json."""
    for path in src.iterdir():
        if path.is_file() and path.name not in (WEIGHTS, "config.json"):
            shutil.copy2(path, dst / path.name)


def _write_config(src: Path, dst: Path, quant_config: dict | None) -> None:
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    if quant_config is not None:
        config["quantization_config"] = quant_config
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def quantize_checkpoint(src, dst, method: str, block: int = 128, group_size: int = 128, skip=(),
                        scale_dtype: str = "bfloat16") -> dict:
    """Write `method`'s quantized copy of checkpoint `src` into `dst`; returns its quantization_config."""
    src, dst = Path(src), Path(dst)
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")
    if not (src / WEIGHTS).is_file():
        raise FileNotFoundError(f"{src}: no {WEIGHTS} (sharded checkpoints are not supported)")
    if dst.resolve() == src.resolve():
        raise ValueError("--out must not be the source directory")
    tensors = unfuse_experts(read_tensors(src / WEIGHTS))
    modules = linear_modules(tensors)
    skipped = [m for m in modules if any(re.search(p, m) for p in skip)]
    targets = {f"{m}.weight": m for m in modules if m not in skipped}
    out = {}
    for name, value in tensors.items():
        module = targets.get(name)
        if module is None:
            out[name] = value
            continue
        try:
            quantized = quantize(method, value, block, group_size, SCALE_DTYPES[scale_dtype])
        except ValueError as e:
            raise ValueError(f"{module}: {e} (leave it in float with --skip)") from e
        out.update({f"{module}.{suffix}": t for suffix, t in quantized.items()})
    dst.mkdir(parents=True, exist_ok=True)
    write_tensors(dst / WEIGHTS, out)
    config = quantization_config(method, block, group_size, sorted(skipped))
    _write_config(src, dst, config)
    _copy_other_files(src, dst)
    return config


def dequantized_state_dict(model_dir) -> dict[str, np.ndarray]:
    """Every tensor of a quantized directory as float32, each quantized module's tensors replaced by
    its decoded `X.weight`: the float checkpoint the directory stands for (HF names)."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())["quantization_config"]
    method = config["quant_method"]
    block = config.get("weight_block_size")  # fp8 only
    suffixes = SUFFIXES[method]
    tensors = read_tensors(model_dir / WEIGHTS)
    marker = "." + suffixes[1]  # weight_scale_inv / qzeros: only a quantized module has it
    modules = {name[: -len(marker)] for name in tensors if name.endswith(marker)}
    out = {name: value.astype(np.float32) for name, value in tensors.items()
           if name.rpartition(".")[0] not in modules or name.rpartition(".")[2] not in suffixes}
    for module in modules:
        out[f"{module}.weight"] = dequantize(method, {s: tensors[f"{module}.{s}"] for s in suffixes}, block)
    return out


def write_dequantized(model_dir, dst, dtype=np.float32) -> Path:
    """A float checkpoint (no quantization_config) of what quantized `model_dir` stands for, in
    float32 (exact) or `dtype` (e.g. ml_dtypes.bfloat16: the reference of a bfloat16 comparison)."""
    model_dir, dst = Path(model_dir), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    write_tensors(dst / WEIGHTS, {k: v.astype(dtype, copy=False) for k, v in dequantized_state_dict(model_dir).items()})
    _write_config(model_dir, dst, None)
    _copy_other_files(model_dir, dst)
    return dst


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="source directory (config.json + model.safetensors)")
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument("--method", required=True, choices=METHODS)
    p.add_argument("--block", type=int, default=128, help="fp8: weight_block_size [B, B]")
    p.add_argument("--group-size", type=int, default=128, help="awq / gptq: input rows per scale")
    p.add_argument("--skip", action="append", default=[], metavar="REGEX",
                   help="leave modules whose name matches in float (repeatable)")
    p.add_argument("--scale-dtype", choices=sorted(SCALE_DTYPES), default="bfloat16",
                   help="fp8: dtype of weight_scale_inv")
    args = p.parse_args(argv)
    try:
        config = quantize_checkpoint(args.model, args.out, args.method, args.block, args.group_size, args.skip,
                                     args.scale_dtype)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps({"quantization_config": config}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
