"""Building the demo checkpoint: configs, initial weights, a short AdamW training run, the files.

Needs the `demo` extra (optax). The runtime side (jtp/demo/__init__.py) runs this module as
`python -m jtp.demo DIR` in a fresh CPU-only subprocess, so the numbers never depend on the
caller's devices or XLA flags.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from jtp.demo import recipe
from jtp.demo.corpus import build_tokenizer, tokenizer_config, training_documents

WEIGHT_SEED = 20250101

# Training: small enough to finish in ~20-30 s on two busy CPU cores.
TRAIN_STEPS = 200
TRAIN_BATCH = 8
TRAIN_SEQ_LEN = 64
TRAIN_PEAK_LR = 6e-3
TRAIN_WARMUP = 20

# Model shape (see model_config).
HIDDEN = 128
INTERMEDIATE = 256
LAYERS = 2
HEAD_DIM = 16


def model_config(tokenizer) -> dict:
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "jtp_demo": "a tiny toy model trained for seconds on a few KB of text (see training.json)",
        "vocab_size": -(-vocab // 64) * 64,  # padded like real checkpoints
        # 8 query / 4 KV heads so every tensor-parallel size up to 8 divides the heads.
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "max_position_embeddings": 4096,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": LAYERS,
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
        "use_cache": True,
        "dtype": "float32",
        "bos_token_id": None,
        "eos_token_id": tokenizer.token_to_id("<|im_end|>"),
    }


def generation_config(tokenizer) -> dict:
    return {
        "eos_token_id": [tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")],
        "pad_token_id": tokenizer.token_to_id("<|endoftext|>"),
        "do_sample": True,
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
    }


def initial_weights(config: dict, seed: int = WEIGHT_SEED) -> dict[str, np.ndarray]:
    """HF Qwen3 tensor names and shapes: small random matrices, norms near one."""
    rng = np.random.default_rng(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config["head_dim"]
    q_dim = config["num_attention_heads"] * head_dim
    kv_dim = config["num_key_value_heads"] * head_dim

    def dense(*shape):
        return (0.02 * rng.standard_normal(shape)).astype(np.float32)

    def norm(size):
        return np.ones(size, np.float32)

    weights = {"model.embed_tokens.weight": dense(config["vocab_size"], hidden)}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        weights[p + "input_layernorm.weight"] = norm(hidden)
        weights[p + "self_attn.q_proj.weight"] = dense(q_dim, hidden)
        weights[p + "self_attn.k_proj.weight"] = dense(kv_dim, hidden)
        weights[p + "self_attn.v_proj.weight"] = dense(kv_dim, hidden)
        weights[p + "self_attn.o_proj.weight"] = dense(hidden, q_dim)
        weights[p + "self_attn.q_norm.weight"] = norm(head_dim)
        weights[p + "self_attn.k_norm.weight"] = norm(head_dim)
        weights[p + "post_attention_layernorm.weight"] = norm(hidden)
        weights[p + "mlp.gate_proj.weight"] = dense(inter, hidden)
        weights[p + "mlp.up_proj.weight"] = dense(inter, hidden)
        weights[p + "mlp.down_proj.weight"] = dense(hidden, inter)
    weights["model.norm.weight"] = norm(hidden)
    return weights


# ---------------------------------------------------------------------------- training
# jtp's serving forward (jtp/models/qwen3.py) runs a flat ragged batch against a paged KV cache;
# training wants a plain [batch, seq] causal pass with gradients and no cache, so only the
# attention is written out here and every other piece is jtp's own (jtp/models/layers.py).


def forward(params: dict, tokens, config: dict):
    """Logits [B, T, V] of a causal Qwen3 over tokens [B, T] (HF weight names and layouts)."""
    import jax
    import jax.numpy as jnp

    from jtp.models.layers import apply_rope, linear, rms_norm, rope_cos_sin, swiglu_mlp

    eps, theta = config["rms_norm_eps"], config["rope_parameters"]["rope_theta"]
    heads, kv_heads, d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    batch, seq = tokens.shape
    cos, sin = rope_cos_sin(jnp.arange(seq), d, theta, jnp.float32)
    causal = jnp.tril(jnp.ones((seq, seq), bool))
    embed = params["model.embed_tokens.weight"]

    x = embed[tokens]
    for layer in range(config["num_hidden_layers"]):
        p = lambda name: params[f"model.layers.{layer}.{name}.weight"]  # noqa: E731
        h = rms_norm(x, p("input_layernorm"), eps)
        q = linear(h, p("self_attn.q_proj")).reshape(batch, seq, heads, d)
        k = linear(h, p("self_attn.k_proj")).reshape(batch, seq, kv_heads, d)
        v = linear(h, p("self_attn.v_proj")).reshape(batch, seq, kv_heads, d)
        # apply_rope's cos/sin [T, D] broadcast over a leading batch axis too.
        q = apply_rope(rms_norm(q, p("self_attn.q_norm"), eps), cos, sin)
        k = apply_rope(rms_norm(k, p("self_attn.k_norm"), eps), cos, sin)
        # Grouped-query attention: query head h reads KV head h // (heads / kv_heads).
        k = jnp.repeat(k, heads // kv_heads, axis=2)
        v = jnp.repeat(v, heads // kv_heads, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d)
        probs = jax.nn.softmax(jnp.where(causal, scores, -1e30), axis=-1)
        attn = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(batch, seq, heads * d)
        x = x + linear(attn, p("self_attn.o_proj"))
        h = rms_norm(x, p("post_attention_layernorm"), eps)
        x = x + swiglu_mlp(h, {name: p(f"mlp.{name}") for name in ("gate_proj", "up_proj", "down_proj")})
    x = rms_norm(x, params["model.norm.weight"], eps)
    return linear(x, embed)  # tied lm_head


def batches(stream: np.ndarray, starts: np.ndarray, steps: int, seed: int):
    """Fixed-order training windows [TRAIN_BATCH, TRAIN_SEQ_LEN + 1] from the token stream.

    Half the windows begin at a document start (so text at position 0 looks like the corpus
    to the model), half anywhere.
    """
    rng = np.random.default_rng(seed)
    last = len(stream) - TRAIN_SEQ_LEN - 1
    doc_starts = starts[starts <= last]
    for _ in range(steps):
        at_doc = rng.choice(doc_starts, TRAIN_BATCH // 2)
        anywhere = rng.integers(0, last + 1, TRAIN_BATCH - TRAIN_BATCH // 2)
        yield np.stack([stream[s : s + TRAIN_SEQ_LEN + 1] for s in np.concatenate([at_doc, anywhere])])


def train(weights: dict[str, np.ndarray], config: dict, tokenizer, steps: int = TRAIN_STEPS):
    """AdamW on next-token cross-entropy over the training documents; returns (weights, log)."""
    import jax
    import jax.numpy as jnp
    import optax

    # One long stream: documents back to back, repeated so any window fits.
    docs = [tokenizer.encode(text).ids for text in training_documents()]
    stream, starts = [], []
    while len(stream) < 4 * TRAIN_SEQ_LEN or not starts:
        for ids in docs:
            starts.append(len(stream))
            stream.extend(ids)
    stream, starts = np.asarray(stream, np.int32), np.asarray(starts)

    schedule = optax.warmup_cosine_decay_schedule(0.0, TRAIN_PEAK_LR, TRAIN_WARMUP, steps, end_value=TRAIN_PEAK_LR / 20)
    # No weight decay on the norms (it would pull their scales towards zero).
    decay_mask = {name: w.ndim == 2 for name, w in weights.items()}
    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.98, weight_decay=0.01, mask=decay_mask),
    )

    def loss_fn(params, batch):
        logits = forward(params, batch[:, :-1], config)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    @jax.jit
    def update(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = {name: jnp.asarray(w) for name, w in weights.items()}
    opt_state = optimizer.init(params)
    losses, started = [], time.perf_counter()
    for batch in batches(stream, starts, steps, WEIGHT_SEED + 1):
        params, opt_state, loss = update(params, opt_state, batch)
        losses.append(loss)
    losses = [round(float(x), 4) for x in losses]
    log = {
        "steps": steps,
        "batch": TRAIN_BATCH,
        "seq_len": TRAIN_SEQ_LEN,
        "corpus_tokens": int(sum(len(d) for d in docs)),
        "corpus_bytes": len("".join(training_documents()).encode()),
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "losses": losses,
        "train_seconds": round(time.perf_counter() - started, 2),
    }
    return {name: np.asarray(value) for name, value in params.items()}, log


# ---------------------------------------------------------------------------- the build


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_demo_checkpoint(directory: str | Path) -> Path:
    """Tokenizer, configs, training and weights into `directory` (which must exist), in this process."""
    from safetensors.numpy import save_file

    directory = Path(directory)
    started = time.perf_counter()
    tokenizer = build_tokenizer()
    config = model_config(tokenizer)
    weights, log = train(initial_weights(config), config, tokenizer)
    tokenizer.save(str(directory / "tokenizer.json"), pretty=True)
    write_json(directory / "tokenizer_config.json", tokenizer_config(tokenizer))
    write_json(directory / "generation_config.json", generation_config(tokenizer))
    write_json(directory / "config.json", config)
    # "format": "pt" is the metadata transformers expects on safetensors checkpoints.
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    log = {"recipe": recipe(), **log, "build_seconds": round(time.perf_counter() - started, 2)}
    write_json(directory / "training.json", log)  # last: it marks the build complete
    return directory


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m jtp.demo DIR   (builds the demo checkpoint into DIR)", file=sys.stderr)
        return 2
    directory = Path(argv[0])
    directory.mkdir(parents=True, exist_ok=True)
    write_demo_checkpoint(directory)
    log = json.loads((directory / "training.json").read_text())
    print(f"loss {log['loss_first']} -> {log['loss_last']} in {log['steps']} steps; build {log['build_seconds']} s")
    return 0

