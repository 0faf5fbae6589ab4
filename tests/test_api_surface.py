"""The endpoints vLLM users script against beside generation: GET /v1/models/{id} (the openai
client's models.retrieve), POST /tokenize and /detokenize (vLLM's shapes), GET /version; checked
against the tokenizer itself and the package's metadata, on a live uvicorn server on loopback."""

from __future__ import annotations

import importlib.metadata
import json

import httpx
import openai
import pytest
from loopback import serving
from scripted_engine import ScriptedEngine

from jtp.demo import ensure_demo_checkpoint
from jtp.engine.tokenizer import Tokenizer
from jtp.entrypoints.server import build_app

KEY = "surface-key"


@pytest.fixture(scope="module")
def served():
    tokenizer = Tokenizer.from_dir(ensure_demo_checkpoint())
    with serving(build_app(ScriptedEngine(tokenizer, max_model_len=512), "surface", api_key=KEY)) as url:
        yield tokenizer, url


def post(url: str, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    return httpx.post(url + path, json=body, headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=30)


def test_models_retrieve_and_version(served):
    _, url = served
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    model = client.models.retrieve("surface")
    assert model.id == "surface" and model.object == "model"
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("other")
    assert missing.value.body["code"] == "model_not_found"
    assert httpx.get(url + "/version").json() == {"version": importlib.metadata.version("jtp")}


def test_tokenize_and_detokenize_agree_with_the_tokenizer(served):
    tokenizer, url = served
    text = "Hello, world: Grüße"
    got = post(url, "/tokenize", {"prompt": text}).json()
    ids = tokenizer.encode(text, add_special_tokens=True)
    assert got == {"count": len(ids), "max_model_len": 512, "tokens": ids, "token_strs": None}
    strs = post(url, "/tokenize", {"prompt": text, "return_token_strs": True}).json()["token_strs"]
    assert strs == [tokenizer.id_to_token(i) for i in ids]
    assert post(url, "/detokenize", {"tokens": ids}).json() == {"prompt": tokenizer.decode(ids)}

    messages = [{"role": "user", "content": text}]
    chat = post(url, "/tokenize", {"messages": messages}).json()
    assert chat["tokens"] == tokenizer.encode(tokenizer.apply_chat_template(messages))
    bare = post(url, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert bare["tokens"] == tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=False))
    assert bare["count"] < chat["count"]
    # vLLM's add_generation_prompt on the chat endpoint renders the same prompt
    for body, want in (({}, chat), ({"add_generation_prompt": False}, bare)):
        reply = post(url, "/v1/chat/completions", {"messages": messages, "max_tokens": 1, **body}).json()
        assert reply["usage"]["prompt_tokens"] == want["count"]


def test_token_ids_turn_back_into_the_rendered_chat_with_its_special_tokens(served):
    """vLLM decodes token ids as they are (special tokens kept): /detokenize of a chat's /tokenize,
    and a completions echo of it, give back the rendered template, not the text between its markers."""
    tokenizer, url = served
    messages = [{"role": "user", "content": "Grüße"}]
    rendered = tokenizer.apply_chat_template(messages)
    assert rendered.startswith("<|im_start|>user")
    ids = post(url, "/tokenize", {"messages": messages}).json()["tokens"]
    assert post(url, "/detokenize", {"tokens": ids}).json() == {"prompt": rendered}
    echoed = post(url, "/v1/completions", {"prompt": ids, "echo": True, "max_tokens": 1}).json()
    assert echoed["choices"][0]["text"] == rendered + "ok"


def test_bad_tokenize_requests_are_400s_and_the_key_is_checked(served):
    tokenizer, url = served
    assert post(url, "/tokenize", {"prompt": "hi"}, key=None).status_code == 401
    for path, body, param in [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "hi", "add_special_tokens": "yes"}, "add_special_tokens"),
        ("/tokenize", {"messages": "hi"}, "messages"),
        ("/detokenize", {"tokens": [1, tokenizer.vocab_size]}, "tokens"),
        ("/detokenize", {"tokens": [True]}, "tokens"),
        ("/detokenize", {"tokens": [1], "model": "other"}, "model"),
    ]:
        r = post(url, path, body)
        assert r.status_code in (400, 404), (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.text)


def test_events_survive_text_with_unicode_line_breaks():
    """A model's text may hold U+2028, U+2029 or NEL: line readers that split like str.splitlines()
    must still see one event per data line (the H200 serving run's client once saw events cut there)."""
    from jtp.entrypoints.server.sse import sse_data, sse_event

    payload = {"text": "a\u2028b\u2029c\x85d\ne"}
    for event in (sse_data(payload), sse_event("x", payload)):
        lines = event.splitlines()
        assert len(lines) == (2 if event.startswith("data") else 3)
        assert json.loads(lines[-2 if event.startswith("event") else 0].removeprefix("data: ")) == payload


def test_probes_stay_out_of_the_access_log(served):
    """uvicorn's own access records, from a real server: /health, /ready and /metrics are left out
    by the filter `jtp serve` installs, other requests are logged."""
    import logging

    from jtp.entrypoints.server.launch import QuietProbes

    _, url = served
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    access = logging.getLogger("uvicorn.access")
    level, quiet = access.level, QuietProbes()
    access.setLevel(logging.INFO)
    access.addHandler(handler)
    try:
        for path in ("/health", "/ready?x=1", "/metrics", "/version"):
            httpx.get(url + path, timeout=10)
        logged = [r.args[2] for r in records if quiet.filter(r)]
    finally:
        access.removeHandler(handler)
        access.setLevel(level)
    assert len(records) == 4 and logged == ["/version"]
