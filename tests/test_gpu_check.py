"""scripts/gpu_check.py (the device's correctness run) on the tiny presets, on forced CPU devices:
tp=2 greedy tokens equal tp=1 (the step's collectives counted) and logprobs match transformers, for the dense, MoE and hybrid families.
A 37-token prompt takes the hybrid's 64-token chunked DeltaNet path at tp=2 (XLA:CPU's triangular
solve deadlocked there when both devices ran it)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from cpu_env import cpu_env

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_passes_on_tiny_presets(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    env = cpu_env(2)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts/gpu_check.py"), "--out", str(tmp_path / "out"), "--presets",
         "qwen3-tiny,qwen3-moe-tiny,qwen3.5-tiny", "--checkpoints", str(tmp_path / "ckpt"), "--tokens", "8",
         "--prompt-lengths", "5,37", "--fp8"], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "out/gpu_check.json").read_text())
    assert report["passed"] and report["devices"] == ["cpu", "cpu"]
    names = {(c["preset"], c["check"]) for c in report["checks"]}
    for preset in ("qwen3-tiny", "qwen3-moe-tiny", "qwen3.5-tiny"):
        assert (preset, "float32 greedy tokens, tp=2 == tp=1") in names
        assert (preset, "float32 top-20 logprobs vs transformers") in names
        assert (preset, "bfloat16 top-20 logprobs vs transformers") in names
        (coll,) = [c for c in report["checks"] if c["preset"] == preset and c["check"].startswith("decode step coll")]
        layers = json.loads((tmp_path / "ckpt" / preset / "config.json").read_text())["num_hidden_layers"]
        assert coll["ok"] and coll["activation_all_reduces"] == coll["expected"] == 2 * layers + 1
        (loop,) = [c for c in report["checks"] if c["preset"] == preset and c["check"].startswith("decode loop")]
        assert loop["ok"] and loop["argmax_agreement"] == 1.0 and loop["max_abs_diff"] <= 2e-3, loop
        for name in ("FP8 checkpoint", "FP8 checkpoint, one request at a time", "FP8 weights (--quantization fp8)",
                     "FP8 KV cache"):
            (fp8,) = [c for c in report["checks"] if c["preset"] == preset and c["check"].startswith(name + ":")]
            assert fp8["ok"] and 0 < fp8["mean_abs_diff"], fp8  # quantized: near HF's bf16, not equal
        # Against its own dequantized weights the FP8 checkpoint is closer than to the unquantized ones.
        for c in report["checks"]:
            if c["preset"] == preset and c["check"].startswith("FP8 checkpoint"):
                assert c["mean_abs_diff"] < c["vs_unquantized_mean"], c
    f32 = [c for c in report["checks"] if c["check"].startswith("float32 top-20")]
    assert all(c["max_abs_diff"] <= 2e-3 and c["argmax_agreement"] == 1.0 for c in f32)
    # bf16 is also measured against float32 transformers, for jtp and for transformers' own bf16.
    bf16 = [c for c in report["checks"] if c["check"].startswith("bfloat16")]
    assert all(0 < c["jtp_bf16_vs_f32"]["mean_abs_diff"] and 0 < c["hf_bf16_vs_f32"]["mean_abs_diff"] for c in bf16)
