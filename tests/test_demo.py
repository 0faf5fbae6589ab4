"""The embedded demo checkpoint: deterministic, complete, and loadable by HF transformers."""
import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from jtp import demo
from jtp.demo import DEMO_FILES, DEMO_LABEL, ensure_demo_checkpoint
from jtp.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory):
    return ensure_demo_checkpoint(tmp_path_factory.mktemp("ckpt") / "demo-qwen3")


@pytest.fixture(scope="session")
def config(demo_dir):
    return json.loads((demo_dir / "config.json").read_text())


def expected_shapes(c):
    h, i, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], h), "model.norm.weight": (h,)}
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
    return shapes


def test_label():
    assert DEMO_LABEL == "demo checkpoint (random weights: output is meaningless)"


def test_files_and_config(demo_dir, config):
    assert sorted(p.name for p in demo_dir.iterdir()) == sorted(DEMO_FILES)
    tok = Tokenizer.from_dir(demo_dir)
    assert 1000 <= tok.vocab_size <= 2100
    assert config["vocab_size"] % 64 == 0 and tok.vocab_size <= config["vocab_size"] < tok.vocab_size + 64
    assert config["model_type"] == "qwen3" and config["architectures"] == ["Qwen3ForCausalLM"]
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (256, 768, 4)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (8, 4, 32)
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 1000000.0}
    assert config["tie_word_embeddings"] is True and config["bos_token_id"] is None
    assert config["eos_token_id"] == tok.token_to_id("<|im_end|>")
    assert "meaningless" in config["jtp_demo"]
    generation = json.loads((demo_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    # Special tokens come right after the learned vocab, in Qwen3's order.
    first = tok.token_to_id("<|endoftext|>")
    assert [tok.id_to_token(first + k) for k in range(5)] == [t for t, _ in demo.SPECIAL_TOKENS]


def test_weights_names_shapes_and_values(demo_dir, config):
    weights = load_file(str(demo_dir / "model.safetensors"))
    shapes = expected_shapes(config)
    assert {k: v.shape for k, v in weights.items()} == shapes
    assert all(v.dtype == np.float32 for v in weights.values())
    assert "lm_head.weight" not in weights  # tied to the embedding
    assert abs(weights["model.embed_tokens.weight"].std() - 0.02) < 1e-3
    norm = weights["model.layers.0.self_attn.q_norm.weight"]
    assert abs(norm.mean() - 1.0) < 0.1 and norm.std() > 0.05
    # Layers differ from each other (the rng advances).
    q0, q1 = (weights[f"model.layers.{n}.self_attn.q_proj.weight"] for n in (0, 1))
    assert not np.array_equal(q0, q1)


def test_build_is_deterministic(tmp_path, demo_dir):
    again = ensure_demo_checkpoint(tmp_path / "again")
    for name in DEMO_FILES:
        assert (again / name).read_bytes() == (demo_dir / name).read_bytes(), name


def test_reuses_complete_and_repairs_incomplete(tmp_path):
    target = ensure_demo_checkpoint(tmp_path / "d")
    stamp = (target / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_checkpoint(target) == target
    assert (target / "model.safetensors").stat().st_mtime_ns == stamp  # not rewritten

    (target / "tokenizer.json").unlink()
    ensure_demo_checkpoint(target)
    assert demo.is_complete(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]  # no staging dirs left behind


def test_env_var_overrides_default(tmp_path, monkeypatch):
    monkeypatch.setenv("JTP_DEMO_DIR", str(tmp_path / "from-env"))
    assert ensure_demo_checkpoint() == tmp_path / "from-env"
    assert demo.is_complete(tmp_path / "from-env")


def test_default_location_is_repo_checkpoints(monkeypatch):
    monkeypatch.delenv("JTP_DEMO_DIR", raising=False)
    assert demo.demo_dir() == demo.REPO_ROOT / "checkpoints" / "demo-qwen3"
    assert (demo.REPO_ROOT / "jtp" / "demo.py").is_file()


def test_hf_loads_weights_without_missing_keys(demo_dir, config):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(demo_dir), dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    weights = load_file(str(demo_dir / "model.safetensors"))
    state = model.state_dict()
    for name, value in weights.items():
        assert np.array_equal(state[name].numpy(), value), name
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)  # tied
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert logits.shape == (1, 4, config["vocab_size"]) and torch.isfinite(logits).all()


def test_hf_tokenizer_agrees(demo_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(demo_dir))
    ours = Tokenizer.from_dir(demo_dir)
    for text in ["Hello, world!", "Größe 你好 🚀🇯🇵", "def f(x):\n    return x  # ok", "<|im_end|>"]:
        assert ours.encode(text) == hf.encode(text, add_special_tokens=False)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    for kwargs in ({}, {"enable_thinking": False}, {"add_generation_prompt": False}):
        kwargs = {"add_generation_prompt": True, **kwargs}
        assert ours.apply_chat_template(messages, **kwargs) == hf.apply_chat_template(
            messages, tokenize=False, **kwargs
        )
