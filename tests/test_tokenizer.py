"""jtp.engine.tokenizer against independent references: HF transformers on the same files,
unicode round trips, and full-sequence decode for the streaming detokenizer."""
import json
import shutil
import unicodedata

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jtp.engine.tokenizer import REPLACEMENT_CHAR, Tokenizer


@pytest.fixture(scope="session")
def tok(demo_dir):
    return Tokenizer.from_dir(demo_dir)


@pytest.fixture(scope="session")
def hf_tok(demo_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(demo_dir))


def copy_tokenizer_only(src, dst):
    dst.mkdir()
    shutil.copy(src / "tokenizer.json", dst / "tokenizer.json")
    return dst


# Characters whose UTF-8 spans 2-4 bytes, including ones the demo BPE never saw,
# so some are split byte by byte across tokens.
MULTIBYTE = st.sampled_from(
    list("éèüßçñøåœ") + ["e\u0301", "n\u0303", "a\u0308\u0304"]
    + list("你好世界学习中文日本語한국어привет")
    + ["😀", "🚀", "🍕", "❤️", "👨‍👩‍👧‍👦", "🇯🇵", "👋🏽", "𝄞", "𓂀", "🦀", "\U0010fffd"]
)
MIXED_TEXT = st.lists(st.one_of(MULTIBYTE, st.text(max_size=4)), max_size=12).map("".join)
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


# ---- loading ----

def test_missing_directory_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        Tokenizer.from_dir(tmp_path / "nope")


def test_missing_tokenizer_json_is_named(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_basic_properties(tok, demo_dir):
    tokenizer_json = json.loads((demo_dir / "tokenizer.json").read_text())
    assert tok.vocab_size == len(tokenizer_json["model"]["vocab"]) + len(tokenizer_json["added_tokens"])
    im_end = tok.token_to_id("<|im_end|>")
    assert tok.id_to_token(im_end) == "<|im_end|>"
    assert tok.eos_token == "<|im_end|>"
    assert tok.pad_token_id == tok.token_to_id("<|endoftext|>")
    assert tok.bos_token is None and tok.bos_token_id is None
    assert tok.token_to_id("definitely-not-a-token") is None


# ---- eos ids ----

def test_demo_eos_ids_are_im_end_then_endoftext(tok):
    assert tok.eos_token_ids == (tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>"))


def test_eos_ids_union_of_all_configs(tmp_path, demo_dir, tok):
    d = copy_tokenizer_only(demo_dir, tmp_path / "m")
    im_end, eot, im_start = (tok.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>", "<|im_start|>"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"}}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, eot], "bos_token_id": 7}))
    # composite config: the text model's eos lives in text_config
    (d / "config.json").write_text(json.dumps({"eos_token_id": 5, "text_config": {"eos_token_id": [eot, im_start]}}))
    t = Tokenizer.from_dir(d)
    assert t.eos_token_ids == (im_end, eot, 5, im_start)
    assert t.bos_token_id == 7  # no bos_token string, so the generation config's id
    assert t.pad_token_id is None


def test_eos_ids_from_config_only(tmp_path, demo_dir):
    d = copy_tokenizer_only(demo_dir, tmp_path / "m")
    (d / "config.json").write_text(json.dumps({"eos_token_id": 3}))
    assert Tokenizer.from_dir(d).eos_token_ids == (3,)


# ---- encode / decode ----

@FAST
@given(text=st.text())
def test_any_unicode_round_trips(tok, text):
    # The pipeline NFC-normalizes (as Qwen3's does); everything else survives byte-exactly.
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", text)


@FAST
@given(text=MIXED_TEXT)
def test_encode_decode_match_hf(tok, hf_tok, text):
    ids = tok.encode(text)
    assert ids == hf_tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)


def test_special_tokens_in_text_and_skipping(tok):
    text = "<|im_start|>user\nhi<|im_end|><think>x</think>"
    ids = tok.encode(text)
    assert tok.token_to_id("<|im_start|>") in ids and tok.token_to_id("<think>") in ids
    assert tok.decode(ids, skip_special_tokens=False) == text
    # Like Qwen3, the think tags are plain added tokens and survive skipping.
    assert tok.decode(ids) == "user\nhi<think>x</think>"


def test_decode_accepts_numpy_ints(tok):
    np = pytest.importorskip("numpy")
    ids = tok.encode("hello world")
    assert tok.decode(np.array(ids)) == "hello world"


# ---- streaming detokenization ----

def stream(tok, ids, skip_special_tokens=True):
    detok = tok.incremental_decoder(skip_special_tokens=skip_special_tokens)
    pieces = [detok.add(i) for i in ids]
    pieces.append(detok.flush())
    return pieces


@FAST
@given(text=st.one_of(MIXED_TEXT, st.text()))
def test_streamed_text_equals_full_decode(tok, text):
    ids = tok.encode(text)
    pieces = stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids)
    if REPLACEMENT_CHAR not in text:
        assert not any(REPLACEMENT_CHAR in p for p in pieces)


def test_token_boundaries_fall_inside_characters(tok):
    text = "Notes 𝄞 and 𓂀, crab 🦀, rocket 🚀, 你好世界 and 한국어."
    ids = tok.encode(text)
    naive = [tok.decode([i]) for i in ids]
    # The premise: some token ends mid-character, so per-token decoding breaks ...
    assert any(REPLACEMENT_CHAR in piece for piece in naive)
    # ... while the streaming detokenizer never shows a broken character.
    pieces = stream(tok, ids)
    assert not any(REPLACEMENT_CHAR in p for p in pieces)
    assert "".join(pieces) == text
    assert "" in pieces  # it really did hold text back at least once


def test_stream_skips_special_tokens(tok):
    ids = tok.encode("<|im_start|>assistant\n好的 🚀<|im_end|>")
    assert "".join(stream(tok, ids)) == "assistant\n好的 🚀"
    assert "".join(stream(tok, ids, skip_special_tokens=False)) == "<|im_start|>assistant\n好的 🚀<|im_end|>"


def test_flush_emits_a_truncated_tail(tok):
    ids = tok.encode("ok 𝄞")
    cut = ids[:-1]  # last byte of the 4-byte char missing: the stream ended mid-character
    detok = tok.incremental_decoder()
    assert "".join(detok.add(i) for i in cut) == "ok "
    tail = detok.flush()
    assert tail.endswith(REPLACEMENT_CHAR)
    assert "ok " + tail == tok.decode(cut)
    assert detok.flush() == ""


# ---- chat template ----

SYSTEM_CHAT = [
    {"role": "system", "content": "You are terse. Réponds en français si besoin."},
    {"role": "user", "content": "Bonjour! 你好 🚀"},
]
MULTI_TURN = [
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
    {"role": "user", "content": "and 3+3?"},
    {"role": "assistant", "content": "6", "reasoning_content": "add again"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city, e.g. <Zürich> & Genève",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
TOOL_CHAT = [
    {"role": "system", "content": "Use tools."},
    {"role": "user", "content": "Weather in Zürich and Kyoto?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
            {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "京都"}'}},
        ],
    },
    {"role": "tool", "content": "12°C"},
    {"role": "tool", "content": "18°C"},
]


@pytest.mark.parametrize(
    "messages, kwargs",
    [
        (SYSTEM_CHAT, {}),
        (SYSTEM_CHAT, {"enable_thinking": False}),
        (SYSTEM_CHAT, {"enable_thinking": True}),
        (SYSTEM_CHAT, {"add_generation_prompt": False}),
        (SYSTEM_CHAT[1:], {}),
        (MULTI_TURN, {"add_generation_prompt": False}),
        (MULTI_TURN[:3], {"enable_thinking": False}),
        (TOOL_CHAT, {"tools": TOOLS}),
        (TOOL_CHAT[1:], {"tools": TOOLS, "enable_thinking": False}),
    ],
)
def test_chat_template_matches_hf(tok, hf_tok, messages, kwargs):
    kwargs = {"add_generation_prompt": True, **kwargs}
    ours = tok.apply_chat_template(messages, **kwargs)
    theirs = hf_tok.apply_chat_template(messages, tokenize=False, **kwargs)
    assert ours == theirs
    assert tok.encode(ours) == hf_tok.encode(theirs, add_special_tokens=False)


def test_chat_template_shape(tok):
    prompt = tok.apply_chat_template(SYSTEM_CHAT, enable_thinking=False)
    assert prompt == (
        "<|im_start|>system\nYou are terse. Réponds en français si besoin.<|im_end|>\n"
        "<|im_start|>user\nBonjour! 你好 🚀<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    # Tool schemas go in as raw JSON: no \\u escapes, no HTML escaping.
    with_tools = tok.apply_chat_template(SYSTEM_CHAT, tools=TOOLS)
    assert '"Weather for a city, e.g. <Zürich> & Genève"' in with_tools


@pytest.mark.parametrize("prefill", ["The sea is", "Bonjour 🚀", "<", "d", "m_end"])
def test_continue_final_message_ends_at_the_prefill(tok, hf_tok, prefill):
    """The chat cut after the final assistant message's text: the prompt of a turn opened for the
    model, then the prefill -- also a prefill the template's end of turn contains ("<", "d", where
    a search of the whole render for the text cuts inside <|im_end|>); ordinary ones as transformers."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": prefill}]
    ours = tok.render_chat(messages, continue_final_message=True)
    assert ours == hf_tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True) + prefill
    if prefill[0].isalpha() and len(prefill) > 2:
        assert ours == hf_tok.apply_chat_template(messages, tokenize=False, continue_final_message=True)


def test_raise_exception_is_a_value_error(tok):
    with pytest.raises(ValueError, match="unknown message role"):
        tok.apply_chat_template([{"role": "wizard", "content": "hi"}])


def test_no_chat_template_is_clear(tmp_path, demo_dir):
    d = copy_tokenizer_only(demo_dir, tmp_path / "m")
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_jinja_file_wins(tmp_path, demo_dir):
    d = copy_tokenizer_only(demo_dir, tmp_path / "m")
    shutil.copy(demo_dir / "tokenizer_config.json", d / "tokenizer_config.json")
    (d / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}{{ eos_token }}{{ strftime_now('%Y')|length }}{% endif %}"
    )
    rendered = Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "[user] hi\n<|im_end|>4"


def test_chat_template_list_uses_default(tmp_path, demo_dir):
    d = copy_tokenizer_only(demo_dir, tmp_path / "m")
    templates = [
        {"name": "tool_use", "template": "TOOLS{{ tools | tojson }}"},
        {"name": "default", "template": "DEFAULT{% for m in messages %}|{{ m.content }}{% endfor %}"},
    ]
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": templates}))
    t = Tokenizer.from_dir(d)
    assert t.apply_chat_template([{"role": "user", "content": "a"}]) == "DEFAULT|a"
    assert t.apply_chat_template([], tools=[{"n": "é"}]) == 'TOOLS[{"n": "é"}]'
