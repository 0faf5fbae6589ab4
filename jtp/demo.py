"""The embedded demo checkpoint: a tiny random-weight Qwen3 with a real tokenizer.

It lets the engine, the CLI and the tests run end to end with no download. The
tokenizer is a genuine byte-level BPE (trained here on a small embedded corpus),
so tokenization, chat templating and streaming behave like a real Qwen3; the
weights are random, so the generated text is meaningless.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

DEMO_LABEL = "demo checkpoint (random weights: output is meaningless)"

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DEMO_DIR = REPO_ROOT / "checkpoints" / "demo-qwen3"
DEMO_DIR_ENV = "JTP_DEMO_DIR"

DEMO_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "model.safetensors",
)

WEIGHT_SEED = 20250101
BPE_VOCAB_SIZE = 1536  # learned tokens, before the special tokens

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

# ChatML in the Qwen3 style, written for jtp. Every newline is spelled out in a
# string so trim_blocks/lstrip_blocks cannot change the output.
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

# Training text for the demo tokenizer: English prose and code, plus accented,
# Cyrillic, Greek, CJK, Korean, Arabic and emoji lines so those scripts get merges.
TRAINING_CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog sleeps in the sun.
A language model reads a sequence of tokens and predicts the next token.
Each token is a small piece of text: a word, a part of a word, or a single byte.
The model turns every token into a vector, mixes the vectors with attention,
and scores every word in the vocabulary to choose what comes next.
Attention lets each position look back at the positions before it.
The key and value vectors of past tokens are kept in a cache, so generating
one more token costs one step instead of reading the whole prompt again.
Grouped query attention shares each key and value head between several query heads,
which makes the cache smaller and the decoding faster.
Rotary position embeddings rotate the query and key vectors by an angle that
grows with the position, so the attention score depends on the distance.
RMS normalization divides a vector by its root mean square and scales it.
The feed forward block uses a gated linear unit with the SiLU activation.
Sampling with a temperature, top k and top p keeps the output varied but sensible.
Greedy decoding always picks the most likely token, which is fast and repeatable.
We compile the model with XLA, shard the weights over the devices, and stream the text.
Hello! How are you today? I am fine, thank you. What would you like to know?
Can you explain how this works? Sure, let me think about it step by step.
First, we load the weights. Second, we build the cache. Third, we run the prompt.
Then we decode one token at a time until we see the end of the turn.
The answer is 42. The year is 2025, and the time is 12:30. Call 555-0199.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 256 512 1024 2048 4096 65536.
Questions, answers, lists, tables and code are all just text to the model.
It was the best of times, it was the worst of times, it was the age of wisdom.
In the beginning the universe was created. This has made a lot of people very angry.
She sells sea shells by the sea shore. Peter Piper picked a peck of pickled peppers.
The rain in Spain stays mainly in the plain. To be, or not to be: that is the question.
user: write a short poem about the sea
assistant: The sea is wide, the sea is deep, it sings the sailors off to sleep.
user: what is the capital of France?
assistant: The capital of France is Paris.
user: translate "good morning" into German.
assistant: "Guten Morgen" means good morning.

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
Über den Wolken muss die Freiheit wohl grenzenlos sein. Schöne Grüße aus München.
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


def build_tokenizer():
    """Train the demo byte-level BPE tokenizer (deterministic for a given corpus)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

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
    # Repeat the corpus a little so frequent pairs clearly win ties.
    tokenizer.train_from_iterator(TRAINING_CORPUS.splitlines(keepends=True) * 3, trainer=trainer)
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
        "jtp_demo": "random weights: output is meaningless",
        "vocab_size": -(-vocab // 64) * 64,  # padded like real checkpoints
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 32,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "max_position_embeddings": 4096,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 4,
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


def random_weights(config: dict, seed: int = WEIGHT_SEED) -> dict[str, np.ndarray]:
    """HF Qwen3 tensor names and shapes, filled with small random numbers."""
    rng = np.random.default_rng(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config["head_dim"]
    q_dim = config["num_attention_heads"] * head_dim
    kv_dim = config["num_key_value_heads"] * head_dim

    def dense(*shape):
        return (0.02 * rng.standard_normal(shape)).astype(np.float32)

    def norm(size):
        # Not all ones, so a loader that drops or misplaces a norm weight shows up in outputs.
        return (1.0 + 0.1 * rng.standard_normal(size)).astype(np.float32)

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


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_demo_checkpoint(directory: str | Path) -> Path:
    """Write every demo file into `directory` (which must exist)."""
    from safetensors.numpy import save_file

    directory = Path(directory)
    tokenizer = build_tokenizer()
    config = model_config(tokenizer)
    tokenizer.save(str(directory / "tokenizer.json"), pretty=True)
    _write_json(directory / "tokenizer_config.json", tokenizer_config(tokenizer))
    _write_json(directory / "generation_config.json", generation_config(tokenizer))
    _write_json(directory / "config.json", config)
    # "format": "pt" is the metadata transformers expects on safetensors checkpoints.
    save_file(random_weights(config), str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def is_complete(directory: Path) -> bool:
    return all((directory / name).is_file() for name in DEMO_FILES)


def demo_dir() -> Path:
    return Path(os.environ.get(DEMO_DIR_ENV) or DEFAULT_DEMO_DIR)


def ensure_demo_checkpoint(path: str | Path | None = None) -> Path:
    """Return the demo checkpoint directory, building it first if it is missing or incomplete."""
    target = Path(path) if path is not None else demo_dir()
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build next to the target, then rename: a crash never leaves a half checkpoint behind.
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        write_demo_checkpoint(staging)
        if target.exists():
            if is_complete(target):  # another process finished first
                return target
            shutil.rmtree(target)
        try:
            os.replace(staging, target)
        except OSError:
            if not is_complete(target):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
