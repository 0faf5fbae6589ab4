"""Tokenizer for Hugging Face model directories: ids, chat template, streaming text.

Wraps the Rust `tokenizers` library (tokenizer.json) and reads the special
tokens and the chat template from tokenizer_config.json, generation_config.json
and config.json the way HF transformers does, without importing transformers.
"""
from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Sequence

import jinja2
import tokenizers

from jtp.engine.template_sandbox import TemplateLimits, make_environment, render_bounded
from jtp.errors import ConfigError

REPLACEMENT_CHAR = "\ufffd"  # what a partial UTF-8 sequence decodes to

# Names a message's reasoning may arrive under; Qwen3 templates read the first.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _read_json(path: Path) -> dict:
    """A JSON object file of the checkpoint ({} when absent); anything else is a ConfigError naming it."""
    if not path.is_file():
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise ConfigError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not valid UTF-8 ({e})") from e


_ID_FIELDS = ("eos_token_id", "bos_token_id", "pad_token_id")
_TOKEN_FIELDS = ("bos_token", "eos_token", "pad_token", "unk_token")


def _check_ids(path: Path, config: dict) -> None:
    """Token ids are an integer or a list of integers, in the config and its text_config."""
    text = config.get("text_config") or {}
    if not isinstance(text, dict):
        raise ConfigError(f"{path}: text_config must be an object, got {type(text).__name__}")
    for where, fields in (("", config), ("text_config.", text)):
        for key in _ID_FIELDS:
            value = fields.get(key)
            values = value if isinstance(value, list) else [value]
            if not all(v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in values):
                raise ConfigError(f"{path}: {where}{key} must be a token id or a list of them, got {value!r}")


def _check_tokenizer_config(path: Path, config: dict) -> None:
    for key in _TOKEN_FIELDS:
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if value is not None and not isinstance(value, str):
            raise ConfigError(f"{path}: {key} must be a string or an AddedToken object, got {config[key]!r}")
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return
    if isinstance(template, dict) and all(isinstance(v, str) for v in template.values()):
        return
    named = isinstance(template, list) and all(
        isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str) for t in template)
    if not named:
        raise ConfigError(f"{path}: chat_template must be a string or a list of {{'name', 'template'}} objects")


def _load_tokenizer(path: Path) -> tokenizers.Tokenizer:
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust library's errors name no file
        raise ConfigError(f"{path}: not a readable tokenizers file ({e})") from e


def _token_content(value: Any) -> str | None:
    # tokenizer_config stores special tokens as plain strings or as AddedToken dicts
    if isinstance(value, dict):
        return value.get("content")
    return value


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


class Tokenizer:
    """Encode/decode text and render chat prompts for one model directory."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        tokenizer_config: dict | None = None,
        generation_config: dict | None = None,
        model_config: dict | None = None,
        chat_template: str | dict[str, str] | None = None,
    ):
        self._tok = tokenizer
        self.tokenizer_config = tokenizer_config or {}
        generation_config = generation_config or {}
        model_config = model_config or {}

        self.bos_token = _token_content(self.tokenizer_config.get("bos_token"))
        self.eos_token = _token_content(self.tokenizer_config.get("eos_token"))
        self.pad_token = _token_content(self.tokenizer_config.get("pad_token"))
        self.unk_token = _token_content(self.tokenizer_config.get("unk_token"))

        # Composite (e.g. vision-language) configs keep the text model's ids in text_config.
        text_config = model_config.get("text_config") or {}
        config_sources = (generation_config, model_config, text_config)

        eos_ids = [] if self.eos_token is None else _as_id_list(self._tok.token_to_id(self.eos_token))
        for source in config_sources:
            eos_ids += _as_id_list(source.get("eos_token_id"))
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_ids))  # ordered union

        self.pad_token_id = self._special_id(self.pad_token, "pad_token_id", config_sources)
        # Informational only: encode() prepends nothing unless tokenizer.json's post-processor does.
        self.bos_token_id = self._special_id(self.bos_token, "bos_token_id", config_sources)

        self._chat_templates = self._normalize_templates(chat_template)
        self._compiled: dict[str, jinja2.Template] = {}

    def _special_id(self, token: str | None, key: str, sources: Iterable[dict]) -> int | None:
        if token is not None and self._tok.token_to_id(token) is not None:
            return self._tok.token_to_id(token)
        for source in sources:
            ids = _as_id_list(source.get(key))
            if ids:
                return ids[0]
        return None

    @staticmethod
    def _normalize_templates(chat_template) -> dict[str, str]:
        # One template, or a list of {"name", "template"} dicts (older multi-template configs).
        if chat_template is None:
            return {}
        if isinstance(chat_template, str):
            return {"default": chat_template}
        if isinstance(chat_template, dict):
            return dict(chat_template)
        return {entry["name"]: entry["template"] for entry in chat_template}

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"model directory not found: {path}")
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"no tokenizer.json in {path}: jtp needs the fast (tokenizers) tokenizer file of the checkpoint"
            )
        tokenizer_config = _read_json(path / "tokenizer_config.json")
        _check_tokenizer_config(path / "tokenizer_config.json", tokenizer_config)
        configs = {name: _read_json(path / name) for name in ("generation_config.json", "config.json")}
        for name, config in configs.items():
            _check_ids(path / name, config)
        chat_template = tokenizer_config.get("chat_template")
        # Newer HF saves write the template to its own file, which wins over the config entry.
        jinja_file = path / "chat_template.jinja"
        if jinja_file.is_file():
            chat_template = _read_text(jinja_file)
        return cls(
            _load_tokenizer(tokenizer_file),
            tokenizer_config=tokenizer_config,
            generation_config=configs["generation_config.json"],
            model_config=configs["config.json"],
            chat_template=chat_template,
        )

    # ---- ids <-> text ----

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added/special tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """An upper bound on the characters one token covers: its longest vocabulary entry (byte-
        level entries spell each byte as one character, so they never undercount)."""
        return max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def certainly_longer_than(self, text: str, max_tokens: int, chunk_chars: int = 16384) -> bool:
        """True if `text` encodes to more than `max_tokens` tokens, found without encoding all of it.

        The Rust encoder holds the GIL for the whole call (~1 us per character here), so a
        multi-megabyte text would stall every other thread for seconds: count piece by piece
        (other threads run between pieces) and stop once the count is past the bound. A cut
        changes only the tokens next to it, so a few per cut are allowed for."""
        count = 0
        for start in range(0, len(text), chunk_chars):
            count += len(self.encode(text[start:start + chunk_chars]))
            if count > max_tokens + 4 * (start // chunk_chars + 1):
                return True
        return False

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(int(token_id))

    def incremental_decoder(self, skip_special_tokens: bool = True) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)

    # ---- chat template ----

    @property
    def chat_template(self) -> str | None:
        return self._chat_templates.get("default")

    def apply_chat_template(
        self,
        messages: Sequence[dict],
        add_generation_prompt: bool = True,
        tools: Sequence[dict] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render `messages` to a prompt string, like transformers' apply_chat_template(tokenize=False).

        Extra keyword arguments become template variables (e.g. enable_thinking=False for Qwen3).
        """
        return self.render_chat(messages, add_generation_prompt, tools, template_kwargs)

    def render_chat(
        self,
        messages: Sequence[dict],
        add_generation_prompt: bool = True,
        tools: Sequence[dict] | None = None,
        variables: dict[str, Any] | None = None,
        limits: TemplateLimits = TemplateLimits(),
        continue_final_message: bool = False,
    ) -> str:
        """`apply_chat_template` with the template variables as a dict and explicit limits
        (TemplateLimitError when the template runs too long or produces too much);
        `continue_final_message`: end at the final message's text, for the model to go on writing it."""
        name = "tool_use" if tools is not None and "tool_use" in self._chat_templates else "default"
        if name not in self._chat_templates:
            if self._chat_templates:
                raise ValueError(
                    f"no 'default' chat template; this checkpoint has {sorted(self._chat_templates)}"
                )
            raise ValueError(
                "this checkpoint has no chat template (neither tokenizer_config.json 'chat_template' "
                "nor chat_template.jinja); encode a raw prompt instead"
            )
        if name not in self._compiled:
            self._compiled[name] = _compile_template(self._chat_templates[name])

        if tools is not None and not all(isinstance(tool, dict) for tool in tools):
            raise TypeError("tools must be JSON-schema dicts")
        special_tokens = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "unk_token": self.unk_token,
        }
        context = {k: v for k, v in special_tokens.items() if v is not None}
        context.update(variables or {})  # caller's variables win, as in transformers

        def render(messages: Sequence[dict]) -> str:
            return render_bounded(self._compiled[name], {
                **context, "messages": [_normalize_message(m) for m in messages], "tools": tools,
                "add_generation_prompt": add_generation_prompt and not continue_final_message}, limits)

        rendered = render(messages)
        if not continue_final_message:
            return rendered
        # The template's end of turn after the final message: what follows a marker in its place.
        marked = render([*messages[:-1], _with_text(messages[-1], _MARKER)])
        end_of_turn = marked[marked.rindex(_MARKER) + len(_MARKER):] if _MARKER in marked else ""
        if end_of_turn and rendered.endswith(end_of_turn):
            rendered = rendered[:-len(end_of_turn)]
        return _cut_after_final_message(rendered, messages[-1])


_MARKER = "\x00jtp-final-message\x00"


def _final_text(message: dict):
    content = message.get("content")
    if isinstance(content, list):
        return next((p["text"] for p in reversed(content) if isinstance(p, dict) and "text" in p), None)
    return content


def _with_text(message: dict, text: str) -> dict:
    """`message` with its (last) text replaced by `text`."""
    content = message.get("content")
    if isinstance(content, list):
        last = max((i for i, p in enumerate(content) if isinstance(p, dict) and "text" in p), default=None)
        if last is not None:
            return {**message, "content": [*content[:last], {**content[last], "text": text}, *content[last + 1:]]}
    return {**message, "content": text}


def _cut_after_final_message(rendered: str, message: dict) -> str:
    """The rendered chat (its final end of turn already cut) up to the end of its final message's
    text, as transformers' continue_final_message cuts it."""
    content = _final_text(message)
    if not isinstance(content, str) or not content.strip() or content.strip() not in rendered:
        raise ValueError("the final message's text does not appear in the rendered chat, so it cannot be continued")
    start, kept = rendered.rindex(content.strip()), content.lstrip()
    # its trailing whitespace too, where the template kept it
    return rendered[:start + (len(kept) if rendered.startswith(kept, start) else len(content.strip()))]


def _normalize_message(message: dict) -> dict:
    # Like transformers: drop None values (OpenAI clients send content=None next to tool_calls),
    # and expose reasoning under every name templates read it by.
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def _raise_exception(message: str):
    raise ValueError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # jinja's own tojson HTML-escapes '<' '>' '&', which would change the prompt text
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_template(source: str) -> jinja2.Template:
    # Templates come from model repos, so they run sandboxed and bounded (template_sandbox).
    env = make_environment()
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text without splitting UTF-8 characters.

    Byte-level BPE can cut one character (emoji, CJK) across tokens; decoding the
    partial bytes gives U+FFFD. We hold text back until it decodes cleanly. Two
    offsets into the ids: `prefix` starts a short context window (decoders such as
    SentencePiece's change the first token's spacing, so we always decode with some
    context) and `read` marks where the already-emitted text ends.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _pending_text(self) -> tuple[str, str]:
        emitted = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        return emitted, full

    def add(self, token_id: int) -> str:
        """Append one token; return the newly completed text (often "", never a partial character)."""
        self.ids.append(int(token_id))
        emitted, full = self._pending_text()
        if len(full) > len(emitted) and not full.endswith(REPLACEMENT_CHAR):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return full[len(emitted) :]
        return ""

    def flush(self) -> str:
        """End of stream: return whatever is still held back (a genuinely broken tail stays U+FFFD)."""
        emitted, full = self._pending_text()
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(emitted) :]
