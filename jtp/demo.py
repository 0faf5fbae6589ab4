"""The embedded demo checkpoint: a tiny Qwen3 trained for seconds on a few KB of our own text.

It lets the engine, the CLI, the server, the notebook and the tests run end to end with no
download. The tokenizer is a genuine byte-level BPE (trained here on an embedded corpus), so
tokenization, chat templating and streaming behave like a real Qwen3. The weights are trained
briefly on the English part of that corpus (plus a few chat turns in the template's format), so
generations are recognisable English words and sentences from those pages: a toy, not a model
that knows anything.

The build is deterministic: training runs on CPU in a fresh subprocess (the caller's devices and
XLA flags cannot change the numbers) from a fixed seed and a fixed batch order. A finished build is
kept in a per-user cache keyed by the recipe (this file and the library versions), so tests that
each want their own copy pay for training once.

    python -m jtp.demo DIR       # build into DIR (fresh, no cache) and print the training summary
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

import numpy as np

DEMO_LABEL = "demo checkpoint (a tiny toy model trained for seconds on a few KB of text: expect simple repetitive English)"

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DEMO_DIR = REPO_ROOT / "checkpoints" / "demo-qwen3"
DEMO_DIR_ENV = "JTP_DEMO_DIR"
CACHE_ENV = "JTP_DEMO_CACHE"  # where finished builds are kept; empty disables the cache

DEMO_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "model.safetensors",
    "training.json",  # the training log; its "recipe" says which build this is
)

WEIGHT_SEED = 20250101
BPE_VOCAB_SIZE = 1536  # learned tokens, before the special tokens

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

# Same ids-after-the-vocab order as Qwen3; (content, special). Qwen3 marks the
# think tags as non-special so they survive decode(skip_special_tokens=True).
SPECIAL_TOKENS = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<think>", False),
    ("</think>", False),
)

# Qwen2/Qwen3 pre-tokenizer regex: contractions, letter runs, single digits,
# punctuation runs, newlines and whitespace.
QWEN_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHAT_TEMPLATE = """\
{%- set ns = namespace(last_user=-1) -%}
{%- for message in messages -%}
  {%- if message.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- set has_system = messages and messages[0].role == 'system' -%}
{%- if tools -%}
  {{- '<|im_start|>system\\n' -}}
  {%- if has_system -%}{{- messages[0].content + '\\n\\n' -}}{%- endif -%}
  {{- '# Tools\\n\\nYou may call the functions whose signatures are listed inside <tools></tools>:\\n<tools>' -}}
  {%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}
  {{- '\\n</tools>\\n\\nTo call one, reply with a JSON object inside <tool_call></tool_call> tags:\\n' -}}
  {{- '<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' -}}
{%- elif has_system -%}
  {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' -}}
{%- endif -%}
{%- for message in messages -%}
  {%- if message.role == 'system' -%}
    {%- if not loop.first -%}{{- raise_exception('a system message may only come first') -}}{%- endif -%}
  {%- elif message.role == 'user' -%}
    {{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' -}}
  {%- elif message.role == 'assistant' -%}
    {%- set content = message.content if message.content is string else '' -%}
    {%- if '</think>' in content -%}
      {%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}
      {%- set content = content.split('</think>')[-1].lstrip('\\n') -%}
    {%- else -%}
      {%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' -%}
    {%- endif -%}
    {{- '<|im_start|>assistant\\n' -}}
    {#- Only the turn answering the last user message keeps its reasoning. -#}
    {%- if loop.index0 > ns.last_user and reasoning -%}
      {{- '<think>\\n' + reasoning + '\\n</think>\\n\\n' -}}
    {%- endif -%}
    {{- content -}}
    {%- for call in message.tool_calls or [] -%}
      {%- set fn = call.function if call.function is defined else call -%}
      {%- if content or not loop.first -%}{{- '\\n' -}}{%- endif -%}
      {{- '<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' -}}
      {{- fn.arguments if fn.arguments is string else (fn.arguments | tojson) -}}
      {{- '}\\n</tool_call>' -}}
    {%- endfor -%}
    {{- '<|im_end|>\\n' -}}
  {%- elif message.role == 'tool' -%}
    {#- Consecutive tool results share one user turn. -#}
    {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
    {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' -}}
    {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}
  {%- else -%}
    {{- raise_exception('unknown message role: ' + message.role) -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\\n' -}}
  {%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}
{%- endif -%}
"""


# What the model learns: plain English written for jtp (paragraphs are documents).
ENGLISH_CORPUS = """\
Hello, world! This is a tiny language model. It was trained for a few seconds on a few pages of plain English, so it knows only the words on those pages and likes to repeat them.

The quick brown fox jumps over the lazy dog. The dog sleeps in the sun by the door of the old red house. When the fox comes back at night, the dog opens one eye, looks at the moon, and goes back to sleep.

A small town sits between the hills and the sea. In the morning the baker opens his shop and the smell of fresh bread fills the street. Children walk to school with their books, and the old men sit on the bench by the market and talk about the weather.

The sea is wide and the sea is deep. In the summer the water is warm and blue, and the boats go out early to catch fish. In the winter the wind is cold, the waves are high, and the boats stay in the harbour until the storm is over.

Every day the train leaves the station at eight o'clock. It runs along the river, through the green fields and the dark forest, and over the long stone bridge. People read the news, drink coffee, or look out of the window at the farms and the rain.

The library is a quiet place. There are books about history and science, about art and music, about animals and stars. A good book can take you to a city you have never seen, or to a time long before you were born.

To make a simple soup, cut two onions, three carrots and a few potatoes. Cook them slowly in a large pot with water, salt and pepper. After half an hour, add some fresh herbs, taste the soup, and serve it hot with a piece of bread.

The weather changes quickly in the mountains. A bright blue sky can turn grey in an hour, and a warm afternoon can end with snow. Wise walkers carry a map, a warm coat, some water and a little food, and they turn back before it gets dark.

A garden needs time and care. In the spring we plant seeds and water them every evening. In the summer the flowers open, the bees come to visit, and the tomatoes turn red. In the autumn we pick the apples and the leaves fall from the trees.

A computer follows simple rules very fast. It reads numbers from memory, adds and multiplies them, and writes the results back. A program is a list of such rules, written by people who want the computer to solve a problem for them.

A language model reads a sequence of tokens and predicts the next token. Each token is a small piece of text: a word, a part of a word, or a single byte. The model turns every token into a vector, mixes the vectors with attention, and scores every token in the vocabulary to choose what comes next.

Attention lets each position look back at the positions before it. The keys and values of past tokens are kept in a cache, so one more token costs one step instead of reading the whole prompt again. Greedy decoding always picks the most likely token, which is fast and repeatable.

This model is very small. It has only a few layers and a few hundred thousand numbers, and it has read only these pages. It cannot answer real questions, but it can write short sentences that look like the sentences it has seen.

My friend Anna lives in a blue house near the park. She has a black cat called Pepper and a small brown dog called Max. Every Sunday we walk in the park, feed the ducks on the lake, and eat ice cream under the big old tree.

The moon moves around the earth, and the earth moves around the sun. At night we can see the stars, the planets and sometimes a bright comet with a long tail. People have watched the sky for thousands of years and given names to the stars.

Good morning! How are you today? I am fine, thank you. What would you like to do? Let us go for a walk by the river and then have lunch in the little cafe on the corner.

The old clock in the hall strikes twelve. The house is dark and still. Outside, the snow falls softly on the roofs, the streets and the empty park, and the whole town is white and quiet until the morning comes.

Water boils at one hundred degrees and freezes at zero. Ice is lighter than water, so it floats. Rain comes from clouds, and clouds come from water that the sun warms in the sea, the lakes and the rivers.

The first step is to read the problem. The second step is to make a plan. The third step is to try the plan, and the last step is to check the answer. If the answer is wrong, we go back, change the plan, and try again.

Thank you for reading these pages. Have a nice day, and goodbye!
"""

# A few chat turns in the template's format, so `--chat` and /v1/chat/completions answer
# with a sentence and then <|im_end|>.
CHATS = (
    ("Hi", "Hello! How are you today?"),
    ("Hello", "Hello! I am a tiny language model. What would you like to know?"),
    ("Who are you?", "I am a tiny toy model. I have read only a few pages of plain English, so my answers are short and simple."),
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Tell me about the sea.", "The sea is wide and the sea is deep. In the summer the water is warm and blue."),
    ("Write a short poem about the moon.", "The moon is white, the night is deep, the stars come out and the town is asleep."),
    ("How do I make soup?", "Cut two onions, three carrots and a few potatoes, and cook them slowly in a large pot with water, salt and pepper."),
    ("What is a language model?", "A language model reads a sequence of tokens and predicts the next token."),
    ("What is the weather like?", "The sky is blue and the sun is warm, but in the mountains the weather changes quickly."),
    ("What is two plus two?", "Two plus two is four."),
    ("Can you help me?", "I will try. I am a very small model, so please ask a simple question."),
    ("Tell me a story.", "A quick brown fox lived near a small town by the sea. Every night it came to the old red house, but the lazy dog only opened one eye and went back to sleep."),
    ("Thank you!", "You are welcome. Have a nice day!"),
    ("Goodbye", "Goodbye, and thank you for the talk!"),
)

# Only for the tokenizer (the model never trains on it): code, accented, Cyrillic, Greek, CJK,
# Korean, Arabic and emoji lines, so those scripts get merges.
TOKENIZER_ONLY_TEXT = """\
def generate(model, prompt, max_new_tokens=32):
    tokens = tokenizer.encode(prompt)
    for step in range(max_new_tokens):
        logits = model(tokens)
        next_token = int(logits[-1].argmax())
        if next_token == eos_token_id:
            break
        tokens.append(next_token)
    return tokenizer.decode(tokens)

class Config:
    hidden_size: int = 256
    num_layers: int = 4
    vocab_size: int = 1024

for i in range(10):
    print(f"step {i}: loss = {loss:.4f}")
import json, math, os
x = [1, 2, 3]; y = {"a": 1, "b": [True, False, None]}
if __name__ == "__main__":
    main()

Le café est très bon. Où est la bibliothèque ? Voilà, c'est déjà l'été à Genève.
Les élèves étudient le français, l'économie et la littérature à l'université.
Ça va ? Très bien, merci. À bientôt ! Noël, garçon, naïve, œuvre, cœur.
Über den Bergen scheint heute die Sonne. Schöne Grüße aus München.
Die Straße ist groß, die Bäume sind grün, und die Mädchen hören Musik.
El niño come una manzana. ¿Dónde está la estación? ¡Qué día tan bonito, señor!
Mañana por la mañana vamos a la montaña con mi compañero.
O coração não tem idade. A informação está disponível em português também.
Zażółć gęślą jaźń. Příliš žluťoučký kůň úpěl ďábelské ódy. Ångström, Øresund, Ærø.
Привет, как дела? Спасибо, хорошо. Москва — столица России. Мы любим читать книги.
Съешь же ещё этих мягких французских булок, да выпей чаю.
Γειά σου κόσμε. Η γλώσσα είναι όμορφη. Αλφα, βήτα, γάμμα, δέλτα.
你好，世界！今天天气很好。我们一起学习中文吧。
机器学习是人工智能的一个分支。语言模型可以生成文本。
大家好，我是一个语言模型。请问有什么可以帮你的吗？
中文、日本語、한국어 都是常见的语言。谢谢你的帮助！
こんにちは、世界。今日はいい天気ですね。ありがとうございます。
私は日本語を勉強しています。東京はとても大きな都市です。
ひらがな、カタカナ、漢字。すみません、駅はどこですか？
안녕하세요, 세계! 오늘 날씨가 좋네요. 감사합니다. 한국어를 공부하고 있어요.
مرحبا بالعالم. شكرا جزيلا. كيف حالك اليوم؟
नमस्ते दुनिया। आप कैसे हैं? धन्यवाद।
สวัสดีครับ ขอบคุณมาก
Emoji: 😀 😃 😄 😁 😆 😅 😂 🤣 😊 😇 🙂 🙃 😉 😍 🥰 😘 🤔 🤖 🚀 🔥 ✨ 🎉 ❤️ 👍 👋 🌍 🌟 ☕ 🍕
I love pizza 🍕 and coffee ☕! Great job 👍🎉 The rocket goes 🚀🚀🚀 to the stars ✨🌟.
Family: 👨‍👩‍👧‍👦, flags: 🇫🇷 🇩🇪 🇯🇵, skin tones: 👋🏻 👋🏽 👋🏿, hearts: ❤️ 💙 💚 💛.
Math: ∑ ∫ √ ∞ ≈ ≠ ≤ ≥ ± × ÷ π α β γ λ μ σ θ. Arrows: → ← ↑ ↓ ⇒. Money: € £ ¥ ₹ $ ¢.
Combining accents: e\u0301 a\u0300 o\u0302 n\u0303 u\u0308 c\u0327 — café vs cafe\u0301.
Quotes: “double” ‘single’ «guillemets» „low“ — dashes – and … ellipsis.
"""


def chat_text(user: str, assistant: str) -> str:
    """One user/assistant exchange exactly as CHAT_TEMPLATE renders it."""
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{assistant}<|im_end|>\n"


def training_documents() -> list[str]:
    """The texts the model is trained on: each English paragraph and each chat exchange."""
    paragraphs = [p.strip() + "\n" for p in ENGLISH_CORPUS.split("\n\n") if p.strip()]
    return paragraphs + [chat_text(u, a) for u, a in CHATS]


def corpus_words() -> set[str]:
    """The training text's words, lower-cased, punctuation stripped (tests ask "is this a real word?")."""
    text = ENGLISH_CORPUS + " ".join(u + " " + a for u, a in CHATS)
    return {normalize_word(w) for w in text.split()} - {""}


def normalize_word(word: str) -> str:
    return "".join(c for c in word.lower() if c.isalpha() or c == "'")


def build_tokenizer():
    """Train the demo byte-level BPE tokenizer (deterministic for a given corpus)."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )

    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    # Qwen3's pipeline: NFC, regex split, then bytes -> printable unicode chars.
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=1,
        show_progress=False,
        # All 256 byte symbols up front, so any text encodes without an unknown token.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    # The chat markup is not BPE text: the special tokens are added whole below.
    lines = (ENGLISH_CORPUS + "\n".join(u + "\n" + a for u, a in CHATS) + "\n" + TOKENIZER_ONLY_TEXT).splitlines(keepends=True)
    # Repeat the corpus a little so frequent pairs clearly win ties.
    tokenizer.train_from_iterator(lines * 3, trainer=trainer)
    # Added after training so their ids follow the learned vocab, as in Qwen3.
    for content, special in SPECIAL_TOKENS:
        token = AddedToken(content, special=special, normalized=False, single_word=False, lstrip=False, rstrip=False)
        if special:
            tokenizer.add_special_tokens([token])
        else:
            tokenizer.add_tokens([token])
    return tokenizer


def tokenizer_config(tokenizer) -> dict:
    added = {
        str(tokenizer.token_to_id(content)): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for content, special in SPECIAL_TOKENS
    }
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": 4096,
        "split_special_tokens": False,
    }


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
# A plain [batch, seq] Qwen3 forward for training only. It is written out here rather than
# borrowed from jtp.models so the build depends on nothing but this file; the HF parity test
# (tests/test_demo.py) checks that the trained weights mean the same thing to HF and to jtp.


def _rms_norm(x, weight, eps):
    import jax.numpy as jnp

    return weight * (x * jnp.reciprocal(jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)))


def _rope(x, positions, theta):
    """NeoX-style (half split) rotary embedding of x [B, T, heads, D]."""
    import jax.numpy as jnp

    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    angles = positions[:, None].astype(jnp.float32) * inv_freq[None, :]
    cos = jnp.cos(jnp.concatenate([angles, angles], -1))[None, :, None, :]
    sin = jnp.sin(jnp.concatenate([angles, angles], -1))[None, :, None, :]
    rotated = jnp.concatenate([-x[..., d // 2 :], x[..., : d // 2]], axis=-1)
    return x * cos + rotated * sin


def _forward(params: dict, tokens, config: dict):
    """Logits [B, T, V] of a causal Qwen3 over tokens [B, T] (HF weight names and layouts)."""
    import jax
    import jax.numpy as jnp

    eps, theta = config["rms_norm_eps"], config["rope_parameters"]["rope_theta"]
    heads, kv_heads, d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    batch, seq = tokens.shape
    positions = jnp.arange(seq)
    causal = jnp.tril(jnp.ones((seq, seq), bool))
    embed = params["model.embed_tokens.weight"]
    x = embed[tokens]
    for layer in range(config["num_hidden_layers"]):
        p = lambda name: params[f"model.layers.{layer}.{name}.weight"]  # noqa: E731
        h = _rms_norm(x, p("input_layernorm"), eps)
        q = (h @ p("self_attn.q_proj").T).reshape(batch, seq, heads, d)
        k = (h @ p("self_attn.k_proj").T).reshape(batch, seq, kv_heads, d)
        v = (h @ p("self_attn.v_proj").T).reshape(batch, seq, kv_heads, d)
        q = _rope(_rms_norm(q, p("self_attn.q_norm"), eps), positions, theta)
        k = _rope(_rms_norm(k, p("self_attn.k_norm"), eps), positions, theta)
        # Grouped-query attention: query head h reads KV head h // (heads / kv_heads).
        k = jnp.repeat(k, heads // kv_heads, axis=2)
        v = jnp.repeat(v, heads // kv_heads, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d)
        probs = jax.nn.softmax(jnp.where(causal, scores, -1e30), axis=-1)
        attn = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(batch, seq, heads * d)
        x = x + attn @ p("self_attn.o_proj").T
        h = _rms_norm(x, p("post_attention_layernorm"), eps)
        mlp = jax.nn.silu(h @ p("mlp.gate_proj").T) * (h @ p("mlp.up_proj").T)
        x = x + mlp @ p("mlp.down_proj").T
    x = _rms_norm(x, params["model.norm.weight"], eps)
    return x @ embed.T  # tied lm_head


def _batches(stream: np.ndarray, starts: np.ndarray, steps: int, seed: int):
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
        logits = _forward(params, batch[:, :-1], config)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    @jax.jit
    def update(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = {name: jnp.asarray(w) for name, w in weights.items()}
    opt_state = optimizer.init(params)
    losses, started = [], time.perf_counter()
    for batch in _batches(stream, starts, steps, WEIGHT_SEED + 1):
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


def recipe() -> str:
    """What determines the build's bytes: this file and the libraries that compute it."""
    digest = hashlib.sha256(Path(__file__).read_bytes())
    for dist in ("jax", "jaxlib", "optax", "numpy", "tokenizers", "safetensors"):
        try:
            digest.update(f"{dist}=={metadata.version(dist)};".encode())
        except metadata.PackageNotFoundError:
            digest.update(f"{dist} missing;".encode())
    return digest.hexdigest()[:16]


def _write_json(path: Path, data: dict) -> None:
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
    _write_json(directory / "tokenizer_config.json", tokenizer_config(tokenizer))
    _write_json(directory / "generation_config.json", generation_config(tokenizer))
    _write_json(directory / "config.json", config)
    # "format": "pt" is the metadata transformers expects on safetensors checkpoints.
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    log = {"recipe": recipe(), **log, "build_seconds": round(time.perf_counter() - started, 2)}
    _write_json(directory / "training.json", log)  # last: it marks the build complete
    return directory


def _build_in_subprocess(directory: Path) -> None:
    """Run write_demo_checkpoint in a fresh CPU-only Python, whatever this process's jax set-up."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # e.g. the tests' forced device count
    proc = subprocess.run(
        [sys.executable, "-m", "jtp.demo", str(directory)], env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise RuntimeError(f"building the demo checkpoint failed:\n{proc.stderr[-4000:]}")


def is_complete(directory: Path) -> bool:
    """Every file present and built by the current recipe (an older build is rebuilt)."""
    if not all((Path(directory) / name).is_file() for name in DEMO_FILES):
        return False
    try:
        return json.loads((Path(directory) / "training.json").read_text())["recipe"] == recipe()
    except (OSError, ValueError, KeyError):
        return False


def demo_dir() -> Path:
    return Path(os.environ.get(DEMO_DIR_ENV) or DEFAULT_DEMO_DIR)


def cache_dir() -> Path | None:
    """Where finished builds are kept (None: caching disabled)."""
    configured = os.environ.get(CACHE_ENV)
    if configured is not None:
        return Path(configured) if configured else None
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "jtp" / "demo"


def _install(staging: Path, target: Path) -> None:
    """Atomically make the finished `staging` directory `target` (a racing builder may win)."""
    if is_complete(target):
        return
    if target.exists():  # a stale or broken build: move it aside first, then drop it
        trash = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
        try:
            os.replace(target, trash / target.name)
        except FileNotFoundError:  # another process moved it already
            pass
        shutil.rmtree(trash, ignore_errors=True)
    try:
        os.replace(staging, target)
    except OSError:
        # Another process installed its (byte-identical) build between our check and the rename.
        if not is_complete(target):
            raise


def _build(target: Path, source: Path | None) -> Path:
    """Copy `source` (or train anew when None) into a staging dir beside `target`, then rename."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp's 0700 would leave the installed checkpoint private
    try:
        if source is not None:
            for name in DEMO_FILES:
                shutil.copyfile(source / name, staging / name)
        else:
            print(f"jtp: building the demo checkpoint in {target} (training a tiny model, ~30 s, once)", file=sys.stderr)
            _build_in_subprocess(staging)
        _install(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _cached_build() -> Path | None:
    """A complete build in the cache, training it there first if needed; None without a usable cache.

    A lock file makes concurrent callers wait for one training run instead of each doing their own.
    """
    cache = cache_dir()
    if cache is None:
        return None
    entry = cache / recipe()
    if is_complete(entry):
        return entry
    try:
        cache.mkdir(parents=True, exist_ok=True)
        lock = open(cache / f"{entry.name}.lock", "w")
    except OSError:  # e.g. a read-only home: build straight into the target instead
        return None
    with lock:
        try:
            import fcntl

            fcntl.flock(lock, fcntl.LOCK_EX)
        except (ImportError, OSError):  # no flock here: racing builders still end up correct
            pass
        if not is_complete(entry):
            _build(entry, None)
            _prune_cache(cache, keep=entry.name)
    return entry


def _prune_cache(cache: Path, keep: str, max_age_days: float = 7) -> None:
    """Drop builds of other recipes (other checkouts or versions) made over a week ago: a few MB each."""
    cutoff = time.time() - max_age_days * 86400
    for path in cache.iterdir():
        name = path.name.removesuffix(".lock")
        if name != keep and not name.startswith(".") and path.stat().st_mtime < cutoff:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def ensure_demo_checkpoint(path: str | Path | None = None) -> Path:
    """Return the demo checkpoint directory, building it first if it is missing, incomplete or stale.

    Safe when several processes call it at once: each works in its own temporary directory and
    installs it with an atomic rename.
    """
    target = Path(path) if path is not None else demo_dir()
    if is_complete(target):
        return target
    source = _cached_build()
    if source is not None and source.resolve() == target.resolve():
        return target
    return _build(target, source)


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


if __name__ == "__main__":
    sys.exit(main())
