"""The embedded demo checkpoint: a trained toy Qwen3 that prints words, deterministic, complete,
safe to build from several processes at once, and read the same way by HF transformers and jtp."""
import json
import os
import re
import subprocess
import sys
import threading

import numpy as np
import pytest
from safetensors.numpy import load_file

from jtp import demo
from jtp.config.engine_args import EngineArgs
from jtp.core.sampling_params import SamplingParams
from jtp.demo import DEMO_FILES, DEMO_LABEL, ensure_demo_checkpoint
from jtp.engine.engine import Engine
from jtp.engine.tokenizer import Tokenizer
from jtp.demo import build, corpus

# Prompts in the corpus's world; the greedy continuations must be words from its pages.
PROMPTS = ["Hello, world", "The quick brown fox", "The sea is", "In the morning", "A computer"]


@pytest.fixture(scope="session")
def config(demo_dir):
    return json.loads((demo_dir / "config.json").read_text())


@pytest.fixture(scope="module")
def engine(demo_dir):
    with Engine.from_args(EngineArgs(model=demo_dir, num_blocks=64, max_num_seqs=8)) as engine:
        yield engine


def greedy(engine, texts, max_tokens=48, **kwargs):
    tok = engine.tokenizer
    return engine.generate([tok.encode(t) for t in texts], SamplingParams(max_tokens=max_tokens, temperature=0, **kwargs))


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


# ---- what it is ----


def test_label_says_tiny_toy_model():
    assert "tiny toy model" in DEMO_LABEL and "few KB of text" in DEMO_LABEL


def test_files_and_config(demo_dir, config):
    assert sorted(p.name for p in demo_dir.iterdir()) == sorted(DEMO_FILES)
    tok = Tokenizer.from_dir(demo_dir)
    assert 1000 <= tok.vocab_size <= 2100
    assert config["vocab_size"] % 64 == 0 and tok.vocab_size <= config["vocab_size"] < tok.vocab_size + 64
    assert config["model_type"] == "qwen3" and config["architectures"] == ["Qwen3ForCausalLM"]
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (128, 256, 2)
    # 8 query / 4 KV heads: every tensor-parallel size up to 8 works.
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (8, 4, 16)
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 1000000.0}
    assert config["tie_word_embeddings"] is True and config["bos_token_id"] is None
    assert config["eos_token_id"] == tok.token_to_id("<|im_end|>")
    assert "toy model" in config["jtp_demo"]
    generation = json.loads((demo_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    # Special tokens come right after the learned vocab, in Qwen3's order.
    first = tok.token_to_id("<|endoftext|>")
    assert [tok.id_to_token(first + k) for k in range(5)] == [t for t, _ in corpus.SPECIAL_TOKENS]


def test_weights_names_shapes_and_trained(demo_dir, config):
    weights = load_file(str(demo_dir / "model.safetensors"))
    assert {k: v.shape for k, v in weights.items()} == expected_shapes(config)
    assert all(v.dtype == np.float32 and np.isfinite(v).all() for v in weights.values())
    assert "lm_head.weight" not in weights  # tied to the embedding
    initial = build.initial_weights(config)
    for name, value in weights.items():  # training moved every tensor, norms included
        assert not np.allclose(value, initial[name], atol=1e-4), name


def test_training_loss_drops_by_a_large_factor(demo_dir):
    log = json.loads((demo_dir / "training.json").read_text())
    assert log["recipe"] == demo.recipe()
    assert len(log["losses"]) == log["steps"] and log["loss_first"] == log["losses"][0]
    assert log["loss_first"] > 6.0  # about ln(vocab) at random init
    assert log["loss_last"] < log["loss_first"] / 20
    assert 2000 < log["corpus_bytes"] < 20000  # "a few KB of text"


# ---- it prints words ----


def test_greedy_output_is_corpus_words(engine):
    vocabulary = corpus.corpus_words()
    outs = greedy(engine, PROMPTS)
    # Whitespace-separated words, lower-cased, punctuation stripped ("Paris." -> "paris").
    words = [corpus.normalize_word(w) for o in outs for w in o.text.split()]
    words = [w for w in words if w]
    known = [w for w in words if w in vocabulary]
    print("\n".join(repr(p + o.text) for p, o in zip(PROMPTS, outs)))
    assert len(words) >= 40
    assert len(known) >= 0.8 * len(words), sorted(set(words) - vocabulary)
    assert not any("\ufffd" in o.text for o in outs)
    assert greedy(engine, ["The quick brown fox"], max_tokens=8)[0].text.startswith(" jumps over the lazy dog")


def test_chat_answers_a_sentence_and_stops(engine):
    tok = engine.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    out = greedy(engine, [prompt], max_tokens=40)[0]
    assert out.finish_reason == "stop", out.text
    assert re.fullmatch(r"[A-Z][A-Za-z ,'!?.]+[.!?]", out.text), out.text


def test_logits_are_peaked_so_bf16_greedy_agrees(demo_dir, engine):
    """Trained logits have clear winners: bf16 weights pick the same greedy tokens as fp32."""
    outs = greedy(engine, PROMPTS, max_tokens=16, logprobs=1)
    chosen = np.exp([lp for o in outs for lp in o.logprobs])
    assert np.median(chosen) > 0.8
    with Engine.from_args(EngineArgs(model=demo_dir, dtype="bfloat16", num_blocks=64, max_num_seqs=8)) as bf16:
        low = greedy(bf16, PROMPTS, max_tokens=16)
    agree = [a.token_ids == b.token_ids for a, b in zip(outs, low)]
    assert sum(agree) >= len(PROMPTS) - 1, [(a.text, b.text) for a, b in zip(outs, low)]


# ---- the build ----


@pytest.mark.slow
def test_build_is_deterministic(tmp_path, monkeypatch, demo_dir):
    """A fresh build (a new training run, no cache) is byte-identical to the one in use."""
    monkeypatch.setenv("JTP_DEMO_CACHE", "")
    again = ensure_demo_checkpoint(tmp_path / "again")
    for name in DEMO_FILES:
        if name != "training.json":  # it also records how long training took
            assert (again / name).read_bytes() == (demo_dir / name).read_bytes(), name
    logs = [json.loads((d / "training.json").read_text()) for d in (again, demo_dir)]
    assert logs[0]["losses"] == logs[1]["losses"]


def test_reuses_complete_and_repairs_incomplete(tmp_path):
    target = ensure_demo_checkpoint(tmp_path / "d")
    stamp = (target / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_checkpoint(target) == target
    assert (target / "model.safetensors").stat().st_mtime_ns == stamp  # not rewritten

    (target / "tokenizer.json").unlink()
    ensure_demo_checkpoint(target)
    assert demo.is_complete(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]  # no staging dirs left behind


def test_a_build_from_another_recipe_is_replaced(tmp_path, demo_dir):
    """An old checkout's demo (e.g. the former random-weight one) is rebuilt, not reused."""
    target = ensure_demo_checkpoint(tmp_path / "d")
    log = json.loads((target / "training.json").read_text())
    (target / "training.json").write_text(json.dumps({**log, "recipe": "something-older"}))
    (target / "model.safetensors").write_bytes(b"stale")
    assert not demo.is_complete(target)
    ensure_demo_checkpoint(target)
    assert (target / "model.safetensors").read_bytes() == (demo_dir / "model.safetensors").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def fake_training(calls):
    """A stand-in for the training subprocess: writes a valid-looking build, slowly."""

    def build(directory):
        calls.append(directory)
        for name in DEMO_FILES:
            threading.Event().wait(0.05)  # widen the window for a race
            (directory / name).write_text(json.dumps({"recipe": demo.recipe()}) if name == "training.json" else name)

    return build


def test_concurrent_builds_train_once_and_install_atomically(tmp_path, monkeypatch):
    """Several callers at once (a server test and the CLI, say): one training run in the cache,
    then each target is installed by rename; every caller gets a complete checkpoint."""
    calls = []
    monkeypatch.setattr(demo, "build_in_subprocess", fake_training(calls))
    monkeypatch.setenv("JTP_DEMO_CACHE", str(tmp_path / "cache"))
    target = tmp_path / "ckpt" / "demo"
    results, errors = [], []

    def worker():
        try:
            results.append(ensure_demo_checkpoint(target))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == [target] * 6
    assert len(calls) == 1  # the cache lock let only one caller train
    assert demo.is_complete(target)
    assert sorted(p.name for p in target.parent.iterdir()) == ["demo"]  # no staging dirs left


def test_concurrent_builds_without_cache(tmp_path, monkeypatch):
    """No cache: every caller trains in its own staging dir; the first rename wins, nobody fails."""
    calls = []
    monkeypatch.setattr(demo, "build_in_subprocess", fake_training(calls))
    monkeypatch.setenv("JTP_DEMO_CACHE", "")
    target = tmp_path / "demo"
    threads = [threading.Thread(target=ensure_demo_checkpoint, args=(target,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert demo.is_complete(target) and len(calls) >= 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo"]


def test_env_var_overrides_default(tmp_path, monkeypatch):
    monkeypatch.setenv("JTP_DEMO_DIR", str(tmp_path / "from-env"))
    assert ensure_demo_checkpoint() == tmp_path / "from-env"
    assert demo.is_complete(tmp_path / "from-env")


def test_default_location_is_repo_checkpoints(monkeypatch):
    monkeypatch.delenv("JTP_DEMO_DIR", raising=False)
    assert demo.demo_dir() == demo.REPO_ROOT / "checkpoints" / "demo-qwen3"
    assert (demo.REPO_ROOT / "jtp" / "demo" / "__init__.py").is_file()


def test_installed_jtp_keeps_the_demo_in_the_user_cache(tmp_path, monkeypatch):
    """`pip install .` puts jtp in site-packages: the demo goes to the per-user cache, not there."""
    site_packages = tmp_path / "site-packages"
    (site_packages / "jtp" / "demo").mkdir(parents=True)  # what an installed jtp looks like: no pyproject.toml
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert demo.default_demo_dir(site_packages) == tmp_path / "home" / ".cache" / "jtp" / "demo-qwen3"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert demo.default_demo_dir(site_packages) == tmp_path / "xdg" / "jtp" / "demo-qwen3"
    (site_packages / "pyproject.toml").touch()  # a source checkout keeps it beside the code
    assert demo.default_demo_dir(site_packages) == site_packages / "checkpoints" / "demo-qwen3"


def test_runtime_part_imports_no_trainer():
    """Serving the demo needs neither optax nor the corpus: only jtp/demo/__init__.py loads."""
    code = "import sys, jtp.demo; print(sorted(m for m in sys.modules if m.startswith(('optax', 'jtp.demo'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['jtp.demo']"


def test_building_without_optax_says_which_extra(tmp_path):
    """No optax (jtp installed without the demo extra): one clear error before any work."""
    code = f"""
import sys
sys.modules["optax"] = None  # what `import optax` meets when it is not installed
from jtp.demo import ensure_demo_checkpoint
ensure_demo_checkpoint({str(tmp_path / "demo")!r})
"""
    env = dict(os.environ, JTP_DEMO_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode != 0
    assert "jtp.errors.ConfigError: building the demo checkpoint needs optax" in proc.stderr
    assert "pip install 'jtp[demo]'" in proc.stderr
    assert not (tmp_path / "demo").exists() and not (tmp_path / "cache").exists()


def test_checkpoints_are_git_ignored():
    ignore = (demo.REPO_ROOT / ".gitignore").read_text().splitlines()
    assert "checkpoints/*" in ignore and "!checkpoints/README.md" in ignore


# ---- HF transformers reads the same model ----


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


def test_hf_greedy_and_logprobs_match_jtp(demo_dir, engine):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(demo_dir), dtype=torch.float32).eval()
    ours = greedy(engine, PROMPTS[:3], max_tokens=24, logprobs=0, ignore_eos=True)
    for prompt, out in zip(PROMPTS[:3], ours):
        ids = engine.tokenizer.encode(prompt)
        with torch.no_grad():
            logits = model(torch.tensor([ids + out.token_ids])).logits[0].double()
        ref = torch.log_softmax(logits, -1)[len(ids) - 1 : -1]
        assert out.token_ids == ref.argmax(-1).tolist(), prompt  # HF's greedy choices
        chosen = ref[torch.arange(len(out.token_ids)), torch.tensor(out.token_ids)].numpy()
        np.testing.assert_allclose(out.logprobs, chosen, atol=2e-3, err_msg=prompt)


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
    # The training chats are exactly what the template renders.
    assert corpus.chat_text("Hi", "Hello!") == ours.apply_chat_template(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}], add_generation_prompt=False
    )


def test_cache_prunes_old_builds_of_other_recipes(tmp_path):
    cache = tmp_path / "cache"
    for name in ("current", "old", "recent"):
        (cache / name).mkdir(parents=True)
        (cache / f"{name}.lock").touch()
    week_ago = os.path.getmtime(cache / "old") - 8 * 86400
    for path in (cache / "old", cache / "old.lock", cache / "current"):
        os.utime(path, (week_ago, week_ago))
    demo.prune_cache(cache, keep="current")
    assert sorted(p.name for p in cache.iterdir()) == ["current", "current.lock", "recent", "recent.lock"]
