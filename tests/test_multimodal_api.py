"""Images through the APIs: chat `image_url` parts, Responses `input_image` items, Anthropic `image`
blocks -> the chat template's placeholders -> each expanded to its image's token count -> the
engine's `submit(..., images=...)`.

A tiny composite Qwen3.5 checkpoint with a vision tower (transformers' layout, one vision block)
and a real byte-level BPE tokenizer whose special tokens have the config's ids (vocab 300, the
vision tokens 290-293), with a chat template that writes images as Qwen3.5's does. Checked: the
placeholder expansion and ImagePrompt offsets against an independent count from `image_grid`;
every refusal as a 400 in each API's own shape naming its field (and the server answering after);
and an image chat through the server (the openai client, whole and
streamed) equal to the engine's own greedy tokens for the same ids and images, two images in one
message, a URL of an allowed host, and `jtp generate --image`.
"""

from __future__ import annotations

import base64
import io
import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import httpx
import numpy as np
import openai
import pytest
from hf_hybrid import PREPROCESSOR
from loopback import serving

from jtp.config.vision_config import ImageProcessorConfig
from jtp.core.multimodal import MultiModalPrompt
from jtp.engine.image_processor import ImageError, image_grid
from jtp.engine.multimodal_input import check_image_count, expand_images, image_bytes, image_chat_prompt, load_images
from jtp.entrypoints.server.anthropic import parse_messages_request, to_chat_body
from jtp.entrypoints.server.protocol import parse_chat_request
from jtp.entrypoints.server.responses import input_messages, parse_responses_request

VOCAB = 300
SPECIAL = {"<|endoftext|>": 286, "<|im_start|>": 287, "<|im_end|>": 288, "<|box_start|>": 289,
           "<|vision_start|>": 290, "<|vision_end|>": 291, "<|image_pad|>": 292, "<|video_pad|>": 293}
IMAGE_ID, MERGE = SPECIAL["<|image_pad|>"], 2
# Qwen3.5's way with content lists: an item that is an image (`type` "image", or an "image" /
# "image_url" key) becomes <|vision_start|><|image_pad|><|vision_end|>, text items are written as
# they are, and each turn's content is trimmed.
TEMPLATE = (
    "{%- macro render_content(content) %}"
    "{%- if content is string %}{{- content }}"
    "{%- elif content is iterable and content is not mapping %}{%- for item in content %}"
    "{%- if 'image' in item or 'image_url' in item or item.type == 'image' %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif 'text' in item %}{{- item.text }}"
    "{%- else %}{{- raise_exception('Unexpected item type in content.') }}{%- endif %}"
    "{%- endfor %}{%- endif %}{%- endmacro %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + render_content(message.content)|trim + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
PAIRS = ["th", "he", "in", "er", "an", "re", "on", "en", "at", "ou", "nd", "or", "es", "ed", "is", "it", "ar",
         "al", "te", "st", "Ġt", "Ġa", "Ġs", "Ġw", "Ġo", "Ġc", "Ġb", "Ġf", "Ġm", "Ġp"]  # ids 256..285


def write_tokenizer(path) -> None:
    """Byte-level BPE: the 256 byte symbols, 30 merges, then the special tokens at their config ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    for pair in PAIRS:
        vocab[pair] = len(vocab)
    assert len(vocab) == min(SPECIAL.values())
    tok = Tokenizer(models.BPE(vocab, [tuple(p) if len(p) == 2 else (p[0], p[1:]) for p in PAIRS]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL))
    assert all(tok.token_to_id(t) == i for t, i in SPECIAL.items())
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": TEMPLATE}))


@pytest.fixture(scope="module")
def vision_dir(tmp_path_factory):
    import hf_hybrid

    model = hf_hybrid.build_model("qwen3_5", vision=dict(depth=1), vocab_size=VOCAB, eos_token_id=SPECIAL["<|im_end|>"],
                                  **hf_hybrid.SHALLOW)
    for key, token in (("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
                       ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")):
        setattr(model.config, key, SPECIAL[token])
    path = hf_hybrid.save_multimodal(model, tmp_path_factory.mktemp("qwen3_5_vision"))
    write_tokenizer(path)
    return path


def png(width: int, height: int, seed: int = 0, fmt: str = "PNG") -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, fmt)
    return out.getvalue()


def data_uri(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


PROCESSOR = ImageProcessorConfig.from_hf(PREPROCESSOR)
SIZES = [(40, 30), (200, 64), (17, 170), (96, 96), (300, 20)]  # (width, height): upscaled, downscaled, both


# ----------------------------------------------------------------------------- host side


def test_each_placeholder_becomes_its_images_tokens_at_the_final_offsets():
    rng = np.random.default_rng(0)
    for trial in range(6):
        sizes = [SIZES[i] for i in rng.choice(len(SIZES), size=1 + trial % 3)]
        images = load_images([png(w, h, k) for k, (w, h) in enumerate(sizes)], PROCESSOR)
        counts = [t * gh * gw // MERGE**2 for t, gh, gw in (image_grid(h, w, PROCESSOR) for w, h in sizes)]
        # text pieces (never the image token) around one placeholder per image
        pieces = [rng.integers(0, 280, rng.integers(0, 5)).tolist() for _ in range(len(sizes) + 1)]
        prompt = pieces[0] + sum(([IMAGE_ID] + p for p in pieces[1:]), [])
        ids, prompts = expand_images(prompt, images, IMAGE_ID, MERGE)

        expected, offsets = list(pieces[0]), []
        for count, piece in zip(counts, pieces[1:]):
            offsets.append(len(expected))
            expected += [IMAGE_ID] * count + piece
        assert ids == expected
        assert [p.offset for p in prompts] == offsets and [p.num_tokens for p in prompts] == counts
        for p, image in zip(prompts, images):
            assert p.grid_thw == tuple(image.grid_thw[0]) and np.array_equal(p.pixel_values, image.pixel_values)
        MultiModalPrompt.of(ids, prompts, IMAGE_ID, MERGE)  # the engine's own placement check agrees


def test_a_placeholder_without_an_image_is_refused():
    images = load_images([png(40, 30)], PROCESSOR)
    with pytest.raises(ImageError, match="2 image placeholder tokens for 1 images"):
        expand_images([1, IMAGE_ID, 2, IMAGE_ID], images, IMAGE_ID, MERGE)
    assert expand_images([1, 2], [], IMAGE_ID, MERGE) == ([1, 2], [])


def test_image_sources_and_their_refusals():
    data = png(40, 30)
    assert image_bytes(data_uri(data), 1) == data == image_bytes(data, 1)
    assert image_bytes(data_uri(data, "image/jpeg;charset=x"), 1) == data  # Pillow reads the bytes, not the type
    for source, message in [
        ("https://example.com/cat.png", "image 1: this server fetches no URLs; send the image as a data: URI"),
        ("data:text/plain;base64,aGk=", "image 1: not a base64 data: URI of an image"),
        ("data:image/png,rawbytes", "image 1: not a base64 data: URI of an image"),
        ("data:image/png;base64,@@@", "image 1: its data: URI is not valid base64"),
        ("file:///etc/passwd", "image 1: expected a data: URI"),
    ]:
        with pytest.raises(ImageError, match=message.replace("(", r"\(")):
            image_bytes(source, 1)
    with pytest.raises(ImageError, match="not among this server's --allowed-media-domains"):
        image_bytes("https://example.com/cat.png", 1, ["images.example.org"])
    with pytest.raises(ImageError) as e:
        load_images([data, b"not an image"], PROCESSOR)
    assert str(e.value) == "image 2: cannot be decoded: not an image file Pillow reads (PNG, JPEG, WebP, GIF, ...)"
    with pytest.raises(ImageError, match="image 1: .*aspect ratio"):
        load_images([png(1000, 4)], PROCESSOR)
    vision = SimpleNamespace(max_images_per_prompt=2)
    check_image_count(2, vision)
    with pytest.raises(ImageError, match="3 images; this server takes at most 2 per prompt"):
        check_image_count(3, vision)
    with pytest.raises(ImageError, match="'m' does not take images"):
        check_image_count(1, None, "model 'm'")
    check_image_count(0, None)


def test_big_and_small_images_are_resized_not_refused():
    for w, h in [(2000, 1500), (5, 7)]:
        (image,) = load_images([png(w, h)], PROCESSOR)
        _, gh, gw = image.grid_thw[0]
        assert PROCESSOR.min_pixels <= gh * gw * 16 * 16 <= PROCESSOR.max_pixels


def test_a_photo_with_an_exif_orientation_is_read_upright_as_hf_loads_it():
    """A phone's portrait JPEG: landscape pixels and an Orientation tag (6: turn 90 degrees clockwise).
    HF's load_image (and vLLM, and every viewer) turns it upright; so must the model's input."""
    from PIL import Image
    from transformers.image_utils import load_image

    raw = Image.fromarray(np.random.default_rng(0).integers(0, 256, (48, 96, 3), np.uint8))
    exif = raw.getexif()
    exif[0x0112] = 6
    out = io.BytesIO()
    raw.save(out, "JPEG", exif=exif)
    upright = load_image(data_uri(out.getvalue(), "image/jpeg"))
    assert upright.size == (48, 96)
    lossless = io.BytesIO()
    upright.save(lossless, "PNG")
    (ours,), (reference,) = load_images([out.getvalue()], PROCESSOR), load_images([lossless.getvalue()], PROCESSOR)
    assert ours.grid_thw.tolist() == reference.grid_thw.tolist()
    assert np.array_equal(ours.pixel_values, reference.pixel_values)


def test_the_three_apis_turn_images_into_chat_image_parts():
    url1, url2 = data_uri(png(40, 30, 1)), data_uri(png(30, 40, 2))
    req = parse_chat_request({"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "A "}, {"type": "image_url", "image_url": {"url": url1, "detail": "high"}},
                                     {"type": "text", "text": " and "}, {"type": "image_url", "image_url": url2}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert req.images == [url1, url2]
    assert req.messages[1]["content"] == [{"type": "text", "text": "A "}, {"type": "image"}, {"type": "text", "text": " and "},
                                          {"type": "image"}]
    assert req.messages[2]["content"] == "a\nb"  # text alone stays one string, as before

    anthropic = to_chat_body(parse_messages_request({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": url1.split(",")[1]}},
        {"type": "text", "text": "What is it?"}]}]}))
    assert anthropic["messages"][0]["content"] == [{"type": "image_url", "image_url": {"url": url1}},
                                                   {"type": "text", "text": "What is it?"}]
    responses = input_messages(parse_responses_request({"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "See "}, {"type": "input_image", "image_url": url2, "detail": "auto"}]}]}))
    assert responses == [{"role": "user", "content": [{"type": "text", "text": "See "},
                                                      {"type": "image_url", "image_url": {"url": url2}}]}]


# ----------------------------------------------------------------------------- through the server

ARGS = dict(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=512, block_size=16, num_blocks=128,
            warmup=False, enable_prefix_caching=False, limit_mm_per_prompt='{"image": 3}')


@pytest.fixture(scope="module")
def served(vision_dir):
    from jtp.config.engine_args import EngineArgs
    from jtp.engine.engine import Engine
    from jtp.entrypoints.server import build_app

    with Engine.from_args(EngineArgs(model=str(vision_dir), **ARGS)) as engine:
        assert engine.vision is not None and engine.vision.max_images_per_prompt == 3
        engine.start()
        engine.ready.set()
        with serving(build_app(engine, "tiny-vl", allowed_media_domains=("127.0.0.1",))) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
            yield SimpleNamespace(engine=engine, url=url, client=client)


def user(*parts) -> list[dict]:
    content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image_url", "image_url": {"url": data_uri(p)}}
               for p in parts]
    return [{"role": "user", "content": content}]


def test_refusals_are_400s_naming_the_field_and_the_server_goes_on(served):
    client, good = served.client, png(40, 30)
    bad = [
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}],
         "image 1: 'example.com' is not among this server's --allowed-media-domains"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:text/plain;base64,aGk="}}]}],
         "image 1: not a base64 data: URI of an image"),
        (user(good, b"\x89PNG\r\n\x1a\nbroken"), "image 2: cannot be decoded: "),
        (user(good, good, good, good), "4 images; this server takes at most 3 per prompt"),
        (user("Spelled: <|image_pad|>"), "1 image placeholder tokens for 0 images"),
    ]
    for messages, message in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny-vl", messages=messages, max_tokens=2)
        assert message in e.value.body["message"] and e.value.body["param"] == "messages", e.value.body
    # the Responses API names "input"; Anthropic's shape names the field in its message
    r = httpx.post(served.url + "/v1/responses", timeout=60, json={"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "https://example.com/a.png"}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input" and "not among" in r.json()["error"]["message"]
    r = httpx.post(served.url + "/v1/messages", timeout=60, json={"max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["message"].startswith("messages: image 1: cannot be decoded")
    reply = client.chat.completions.create(model="tiny-vl", messages=user("Hi"), max_tokens=2)
    assert reply.choices[0].finish_reason in ("stop", "length")
    from jtp.entrypoints.server import build_app

    with serving(build_app(served.engine, "tiny-vl")) as url:  # no --allowed-media-domains: no URL at all
        r = httpx.post(url + "/v1/chat/completions", timeout=60, json={"max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://127.0.0.1/a.png"}}]}]})
        assert r.status_code == 400 and r.json()["error"] == {
            "message": "image 1: this server fetches no URLs; send the image as a data: URI (data:image/png;base64,...)",
            "type": "invalid_request_error", "param": "messages", "code": None}


class _ImageHandler(BaseHTTPRequestHandler):
    body = b""

    def do_GET(self):  # noqa: N802
        if self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "http://localhost/elsewhere.png")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        if self.path == "/slow":  # a byte every 0.1 s of a body that claims 100000
            self.send_header("Content-Length", "100000")
            self.end_headers()
            for _ in range(60):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.1)
            return
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


def test_urls_of_allowed_hosts_are_fetched(served):
    _ImageHandler.body = png(40, 30, 5)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ImageHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        by_url = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": base + "/cat.png"}},
                                               {"type": "text", "text": "What?"}]}]
        by_data = user(_ImageHandler.body, "What?")
        ask = dict(model="tiny-vl", max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True})
        a = served.client.chat.completions.create(messages=by_url, **ask)
        b = served.client.chat.completions.create(messages=by_data, **ask)
        assert a.choices[0].message.content == b.choices[0].message.content
        assert a.usage.prompt_tokens == b.usage.prompt_tokens
        moved = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": base + "/moved"}}]}]
        with pytest.raises(openai.BadRequestError, match="not followed"):
            served.client.chat.completions.create(messages=moved, **ask)
    finally:
        server.shutdown()


def test_a_slow_sender_is_cut_off_at_the_fetch_deadline(monkeypatch):
    import jtp.engine.multimodal_input as multimodal_input

    monkeypatch.setattr(multimodal_input, "FETCH_TIMEOUT", 0.5)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ImageHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/slow"
    try:
        start = time.monotonic()
        with pytest.raises(ImageError) as e:
            image_bytes(url, 1, ["127.0.0.1"])
        assert time.monotonic() - start < 2  # not the sender's 6 s
        assert str(e.value) == f"image 1: fetching {url} took over 0.5 s"
    finally:
        server.shutdown()


def test_the_server_submits_the_expanded_ids_and_their_images(served, monkeypatch):
    """Each API hands `submit` the prompt the engine would build in process: same ids, same images
    (digests) at the same offsets, for every choice of the request."""
    engine, submitted = served.engine, []
    original = engine.submit

    def recording(prompt_ids, params=None, request_id=None, images=()):
        submitted.append((list(prompt_ids), list(images)))
        return original(prompt_ids, params, request_id, images=images)

    monkeypatch.setattr(engine, "submit", recording)
    one, two = png(64, 48, 1), png(40, 100, 2)
    template = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "vs"}, {"type": "image"}]}]
    ids, images = image_chat_prompt(engine.tokenizer, engine.vision, template, [one, two])
    between = len(engine.tokenizer.encode("<|vision_end|>vs<|vision_start|>"))
    assert [i.offset for i in images] == [ids.index(IMAGE_ID), ids.index(IMAGE_ID) + images[0].num_tokens + between]
    client, ask = served.client, dict(model="tiny-vl", max_tokens=2)
    client.chat.completions.create(messages=user(one, "vs", two), n=2, **ask)
    client.responses.create(model="tiny-vl", max_output_tokens=2, input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": data_uri(one)}, {"type": "input_text", "text": "vs"},
        {"type": "input_image", "image_url": data_uri(two)}]}])
    r = httpx.post(served.url + "/v1/messages", timeout=120, json={"max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(b).decode()}}
        if isinstance(b, bytes) else {"type": "text", "text": b} for b in (one, "vs", two)]}]})
    assert r.status_code == 200, r.text
    assert len(submitted) == 4
    for got_ids, got_images in submitted:
        assert got_ids == ids
        assert [(i.offset, i.num_tokens, i.grid_thw, i.digest) for i in got_images] == \
            [(i.offset, i.num_tokens, i.grid_thw, i.digest) for i in images]
    assert r.json()["usage"]["input_tokens"] == len(ids)


def in_process(engine, messages: list[dict], sources: list[bytes], max_tokens: int) -> tuple[list[int], str]:
    """The engine's own greedy tokens for the prompt the server builds (template, ids, images)."""
    from jtp.core.sampling_params import SamplingParams

    ids, images = image_chat_prompt(engine.tokenizer, engine.vision, messages, sources)
    rid = engine.submit(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), images=images)
    done = engine.result(rid)
    return done.token_ids, engine.tokenizer.decode(done.token_ids)


def test_an_image_chat_equals_the_engine_in_process_whole_and_streamed(served):
    client = served.client
    one, two = png(64, 48, 1), png(40, 100, 2)
    ask = dict(model="tiny-vl", max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True})
    for sources, texts in [([one], ["Describe ", None, " please."]), ([one, two], [None, "vs", None, "?"])]:
        it = iter(sources)
        parts = [p if p is not None else next(it) for p in texts]
        messages = user(*parts)
        template_messages = [{"role": "user", "content": [{"type": "text", "text": p} if isinstance(p, str)
                                                          else {"type": "image"} for p in parts]}]
        tokens, text = in_process(served.engine, template_messages, sources, 8)
        whole = client.chat.completions.create(messages=messages, **ask)
        assert whole.choices[0].message.content == text and whole.usage.completion_tokens == len(tokens)
        ids, images = image_chat_prompt(served.engine.tokenizer, served.engine.vision, template_messages, sources)
        assert whole.usage.prompt_tokens == len(ids) and sum(i.num_tokens for i in images) > len(sources)
        streamed = "".join(c.choices[0].delta.content or "" for c in
                           client.chat.completions.create(messages=messages, stream=True, **ask) if c.choices)
        assert streamed == text
    # /tokenize counts each image's placeholders as a request's prompt holds them
    r = httpx.post(served.url + "/tokenize", timeout=60, json={"messages": user(one, "hi")})
    assert r.status_code == 200 and r.json()["tokens"].count(IMAGE_ID) == image_count(one)


def image_count(data: bytes) -> int:
    (image,) = load_images([data], PROCESSOR)
    return int(np.prod(image.grid_thw[0])) // MERGE**2


def test_responses_input_image_and_anthropic_image_blocks(served):
    one = png(64, 48, 3)
    reference = served.client.chat.completions.create(model="tiny-vl", messages=user(one, "Name it."), max_tokens=6,
                                                      temperature=0.0, extra_body={"ignore_eos": True})
    response = served.client.responses.create(model="tiny-vl", max_output_tokens=6, temperature=0.0, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": data_uri(one), "detail": "auto"},
                                     {"type": "input_text", "text": "Name it."}]}], extra_body={"ignore_eos": True})
    assert response.output_text == reference.choices[0].message.content
    assert response.usage.input_tokens == reference.usage.prompt_tokens
    r = httpx.post(served.url + "/v1/messages", timeout=120, json={"max_tokens": 6, "temperature": 0.0, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                  "data": base64.b64encode(one).decode()}},
                                     {"type": "text", "text": "Name it."}]}]})
    assert r.status_code == 200 and r.json()["usage"]["input_tokens"] == reference.usage.prompt_tokens


def test_image_parts_an_api_cannot_take_are_refused_naming_the_part():
    """Not "content.str: Input should be a valid string" (the first union branch's complaint)."""
    from jtp.entrypoints.server.errors import APIError

    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    for parse, body, message in [
        (parse_messages_request, {"max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "file", "file_id": "f"}}]}]},
         "messages.0.content.0.image.source: Input tag 'file' found using 'type' does not match any of the "
         "expected tags: 'base64', 'url'"),
        (parse_messages_request, {"max_tokens": 2, "system": [{"type": "text", "text": "s"}, image],
                                  "messages": [{"role": "user", "content": "hi"}]},
         "system.1.type: Input should be 'text'"),
        (parse_responses_request, {"input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": {"url": data_uri(b"x")}}]}]},
         "input.0.MessageItem.content.0.input_image.image_url: Input should be a valid string"),
    ]:
        with pytest.raises(APIError) as e:
            parse(body)
        assert str(e.value) == message


def test_an_anthropic_tool_result_may_hold_images(served):
    """Anthropic's tool_result content takes image blocks (a tool that returns a screenshot): the
    tool message then carries them as image parts, and the prompt holds the image's tokens."""
    one = png(64, 48, 4)
    b64 = base64.b64encode(one).decode()
    body = {"max_tokens": 2, "messages": [
        {"role": "user", "content": "Take a screenshot."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "text", "text": "Here: "}, {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                             "data": b64}}]}]}]}
    chat = to_chat_body(parse_messages_request(body))
    assert chat["messages"][2] == {"role": "tool", "tool_call_id": "t1", "content": [
        {"type": "text", "text": "Here: "}, {"type": "image_url", "image_url": {"url": data_uri(one)}}]}
    r = httpx.post(served.url + "/v1/messages", timeout=120, json=body)
    assert r.status_code == 200, r.text
    template = [{"role": "user", "content": "Take a screenshot."}, {"role": "assistant", "content": ""},
                {"role": "tool", "content": [{"type": "text", "text": "Here: "}, {"type": "image"}]}]
    ids, _ = image_chat_prompt(served.engine.tokenizer, served.engine.vision, template, [one])
    assert r.json()["usage"]["input_tokens"] == len(ids)


def test_a_text_model_refuses_images_and_serves_on(demo_dir):
    from jtp.config.engine_args import EngineArgs
    from jtp.engine.engine import Engine
    from jtp.entrypoints.server import build_app

    args = dict(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=256, block_size=16, num_blocks=32, warmup=False)
    with Engine.from_args(EngineArgs(model=str(demo_dir), **args)) as engine:
        engine.start()
        engine.ready.set()
        with serving(build_app(engine, "demo")) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model="demo", messages=user("What is this?", png(40, 30)), max_tokens=2)
            assert e.value.body["message"].startswith("model 'demo' does not take images (its checkpoint has no vision tower")
            assert e.value.body["param"] == "messages"
            r = httpx.post(url + "/v1/responses", timeout=60, json={"input": [{"role": "user", "content": [
                {"type": "input_image", "image_url": data_uri(png(40, 30))}]}]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "input"
            assert client.chat.completions.create(model="demo", messages=user("Hi"), max_tokens=2).choices


# ----------------------------------------------------------------------------- jtp generate --image


def run_generate(*args: str) -> subprocess.CompletedProcess:
    from cpu_env import cpu_env

    env = {k: v for k, v in cpu_env(1).items() if k != "JTP_DEBUG"}
    return subprocess.run([sys.executable, "-m", "jtp.entrypoints.cli", "generate", *args], capture_output=True,
                          env=env, timeout=300)


def test_generate_image_refusals_are_one_line(tmp_path, demo_dir):
    proc = run_generate("--model", str(demo_dir), "--image", str(tmp_path / "missing.png"), "hi")
    assert proc.returncode == 2 and "error: --image" in proc.stderr.decode() and "cannot read it" in proc.stderr.decode()
    (tmp_path / "cat.png").write_bytes(png(40, 30))
    proc = run_generate("--model", str(demo_dir), "--max-tokens", "2", "--image", str(tmp_path / "cat.png"), "hi")
    assert proc.returncode == 2 and "this model does not take images" in proc.stderr.decode(), proc.stderr.decode()
    assert "Traceback" not in proc.stderr.decode()


def test_generate_with_images_equals_the_engine(tmp_path, served, vision_dir):
    one, two = png(64, 48, 1), png(40, 100, 2)
    (tmp_path / "1.png").write_bytes(one)
    (tmp_path / "2.png").write_bytes(two)
    proc = run_generate("--model", str(vision_dir), "--json", "--max-tokens", "6", "--temperature", "0",
                        "--image", str(tmp_path / "1.png"), "--image", str(tmp_path / "2.png"), "Compare.")
    assert proc.returncode == 0, proc.stderr.decode()
    record = json.loads(proc.stdout)
    template = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Compare."}]}]
    ids, _ = image_chat_prompt(served.engine.tokenizer, served.engine.vision, template, [one, two])
    assert record["prompt_token_ids"] == ids
    tokens, _ = in_process(served.engine, template, [one, two], len(record["token_ids"]))
    assert record["token_ids"] == tokens


def test_a_resent_image_conversation_hits_the_prefix_cache_and_another_image_does_not(vision_dir):
    """Counted by usage.prompt_tokens_details.cached_tokens against the block arithmetic: the resent
    turn reuses every whole block but the last token's; the same text with another image reuses at
    most the blocks before the image."""
    from jtp.config.engine_args import EngineArgs
    from jtp.engine.engine import Engine
    from jtp.entrypoints.server import build_app

    bs = ARGS["block_size"]
    with Engine.from_args(EngineArgs(model=str(vision_dir), **(ARGS | dict(enable_prefix_caching=True)))) as engine:
        engine.start()
        engine.ready.set()
        with serving(build_app(engine, "tiny-vl")) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
            ask = dict(model="tiny-vl", max_tokens=4, temperature=0.0, extra_body={"ignore_eos": True})
            tail = " and then some more words" * 6

            def turn(image: bytes):
                return client.chat.completions.create(messages=user("Look at this: ", image, tail), **ask)

            first, again, other = turn(png(64, 48, 1)), turn(png(64, 48, 1)), turn(png(64, 48, 5))
            template = [{"role": "user", "content": [{"type": "text", "text": "Look at this: "}, {"type": "image"},
                                                     {"type": "text", "text": tail}]}]
            ids, images = image_chat_prompt(engine.tokenizer, engine.vision, template, [png(64, 48, 1)])
            assert first.usage.prompt_tokens == len(ids) == other.usage.prompt_tokens
            assert first.usage.prompt_tokens_details.cached_tokens == 0
            assert again.usage.prompt_tokens_details.cached_tokens == (len(ids) - 1) // bs * bs > images[0].offset
            assert again.choices[0].message.content == first.choices[0].message.content
            assert other.usage.prompt_tokens_details.cached_tokens <= images[0].offset // bs * bs
            assert engine.runner.images.encoded == 2  # the resent image was not encoded again
