"""The demo's text and its tokenizer: plain English written for jtp, a few chat turns, and a
byte-level BPE trained on them (plus a multilingual sample, so other scripts get merges).

Only the build (jtp/demo/build.py) imports this module; serving the demo never does.
"""
from __future__ import annotations

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
