"""A chat request's images -> what `Engine.submit(prompt_ids, params, images=...)` takes (host side:
numpy and Pillow, no jax).

    sources (data: URIs, allowed URLs, bytes)  -> decoded and preprocessed, one by one (`load_images`)
    messages with {"type": "image"} parts      -> the chat template writes one <|image_pad|> per image
    token ids                                  -> each <|image_pad|> expanded to its image's token count,
                                                  ImagePrompts at the final offsets (`expand_images`)

The chat template sees an image as a content item {"type": "image"}: Qwen3.5's and Qwen3-VL's test
`item.type == 'image'` (or an 'image' key) and write <|vision_start|><|image_pad|><|vision_end|>.
Errors are `ImageError`s (HTTP 400) that say which image ("image 2: ..."), counted from 1 in
conversation order.

`vision` below is the engine's `engine.vision`: image_token_id, merge_size, processor (the
ImageProcessorConfig) and max_images_per_prompt.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence

import numpy as np

from jtp.config.vision_config import ImageProcessorConfig
from jtp.core.multimodal import ImagePrompt
from jtp.engine.image_processor import ImageError, ImageInputs, preprocess_images, upright

FETCH_TIMEOUT = 10.0  # seconds for one image from an --allowed-media-domains host
MAX_FETCH_BYTES = 20 * 2**20  # an image fetched from a URL; a data: URI is bounded by the request size
MAX_DECODED_PIXELS = 64 * 2**20  # an image's canvas at most (any is resized to the processor's max_pixels after)
_DATA_URI = re.compile(r"data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*?);base64,(?P<data>.*)", re.S | re.I)
URL_REFUSED = "this server fetches no URLs; send the image as a data: URI (data:image/png;base64,...)"


def image_bytes(source: str | bytes, number: int, allowed_domains: Sequence[str] = (), param: str | None = None) -> bytes:
    """The encoded image of a data: URI (base64), an http(s) URL on an allowed host, or bytes as they are."""
    if isinstance(source, (bytes, bytearray)):
        return bytes(source)
    head = source[:64].lower()
    if head.startswith("data:"):
        match = _DATA_URI.fullmatch(source)
        if match is None or not (match["type"] or "image/").lower().startswith("image/"):
            raise ImageError(f"image {number}: not a base64 data: URI of an image (data:image/png;base64,...)",
                             param=param)
        try:
            return base64.b64decode(match["data"].strip(), validate=True)
        except (binascii.Error, ValueError) as e:
            raise ImageError(f"image {number}: its data: URI is not valid base64 ({e})", param=param) from None
    if head.startswith(("http://", "https://")):
        return _fetch(source, number, allowed_domains, param)
    raise ImageError(f"image {number}: expected a data: URI (data:image/png;base64,...), got {source[:40]!r}",
                     param=param)


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):  # a redirect could leave the allowed hosts
        raise urllib.error.HTTPError(req.full_url, code, f"redirects to {newurl} (not followed)", headers, fp)


def _fetch(url: str, number: int, allowed_domains: Sequence[str], param: str | None) -> bytes:
    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    if not allowed_domains:
        raise ImageError(f"image {number}: {URL_REFUSED}", param=param)
    if host not in {d.lower() for d in allowed_domains}:
        raise ImageError(f"image {number}: {host or url[:40]!r} is not among this server's --allowed-media-domains; "
                         "send the image as a data: URI", param=param)
    opener = urllib.request.build_opener(_NoRedirects)
    deadline = time.monotonic() + FETCH_TIMEOUT  # for the whole body: a slow sender cannot hold a thread longer
    try:
        with opener.open(url, timeout=FETCH_TIMEOUT) as response:
            data = b""
            # read1: what has arrived (read(n) would wait for all n bytes, past the deadline)
            while len(data) <= MAX_FETCH_BYTES and (chunk := response.read1(1 << 16)):
                data += chunk
                if time.monotonic() > deadline:
                    raise ImageError(f"image {number}: fetching {url[:200]} took over {FETCH_TIMEOUT} s", param=param)
    except ImageError:
        raise
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise ImageError(f"image {number}: cannot fetch {url[:200]}: {getattr(e, 'reason', e)}", param=param) from None
    if len(data) > MAX_FETCH_BYTES:
        raise ImageError(f"image {number}: {url[:200]} is larger than {MAX_FETCH_BYTES} bytes", param=param)
    return data


def decode_image(data: bytes, number: int, param: str | None = None):
    """The decoded PIL image (any format Pillow reads); an ImageError naming the image if it cannot be."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))  # reads the header only
    except UnidentifiedImageError:  # its own message names a BytesIO object at an address
        raise ImageError(f"image {number}: cannot be decoded: not an image file Pillow reads "
                         "(PNG, JPEG, WebP, GIF, ...)", param=param) from None
    except Exception as e:  # noqa: BLE001 - Pillow's decoders raise many kinds on bad bytes; all are the client's
        raise ImageError(f"image {number}: cannot be decoded: {e}", param=param) from None
    # A small file can declare a huge canvas (a decompression bomb): refused before it is decoded.
    if image.width * image.height > MAX_DECODED_PIXELS:
        raise ImageError(f"image {number}: {image.width} x {image.height} pixels, more than the "
                         f"{MAX_DECODED_PIXELS} this server decodes", param=param)
    try:
        return upright(image)
    except Exception as e:  # noqa: BLE001
        raise ImageError(f"image {number}: cannot be decoded: {e}", param=param) from None


def load_images(sources: Sequence[str | bytes], processor: ImageProcessorConfig, allowed_domains: Sequence[str] = (),
                param: str | None = None) -> list[ImageInputs]:
    """Each image decoded and preprocessed (resized within the processor's min and max pixels)."""
    out = []
    for number, source in enumerate(sources, 1):
        image = decode_image(image_bytes(source, number, allowed_domains, param), number, param)
        try:
            out.append(preprocess_images([image], processor))
        except ImageError as e:
            raise ImageError(f"image {number}: {e}", param=param) from None
    return out


def check_image_count(count: int, vision, model: str = "this model", param: str | None = None) -> None:
    """Images for a model without a vision tower (`vision` None), or more than --limit-mm-per-prompt: 400s."""
    if count and vision is None:
        raise ImageError(f"{model} does not take images (its checkpoint has no vision tower, or it is served by "
                         "a worker group of several processes)", param=param)
    limit = getattr(vision, "max_images_per_prompt", None)
    if limit is not None and count > limit:
        raise ImageError(f"the request has {count} images; this server takes at most {limit} per prompt "
                         "(--limit-mm-per-prompt)", param=param)


def expand_images(prompt_ids: Sequence[int], images: Sequence[ImageInputs], image_token_id: int, merge_size: int,
                  param: str | None = None) -> tuple[list[int], list[ImagePrompt]]:
    """The prompt with its k-th image-pad token repeated as many times as image k has tokens, and the
    ImagePrompts at their offsets in that final prompt."""
    ids = np.asarray(prompt_ids, np.int64)
    pads = np.flatnonzero(ids == image_token_id)
    if len(pads) != len(images):
        raise ImageError(f"the rendered prompt holds {len(pads)} image placeholder tokens for {len(images)} images "
                         "(is the placeholder written in the text, or does the chat template drop images?)",
                         param=param)
    out: list[int] = []
    prompts, start = [], 0
    for pad, image in zip(pads.tolist(), images):
        out += ids[start:pad].tolist()
        (grid,) = image.grid_thw.tolist()
        prompt = ImagePrompt.of(image.pixel_values, grid, len(out), merge_size)
        out += [image_token_id] * prompt.num_tokens
        prompts.append(prompt)
        start = pad + 1
    out += ids[start:].tolist()
    return out, prompts


def image_chat_prompt(tokenizer, vision, messages: Sequence[dict], sources: Sequence[str | bytes],
                      **template_kwargs) -> tuple[list[int], list[ImagePrompt]]:
    """For Python callers and `jtp generate --image`: chat messages whose content lists hold
    {"type": "image"} items (one per source, in order) -> (prompt ids, images) for `Engine.submit`."""
    check_image_count(len(sources), vision)
    images = load_images(sources, vision.processor)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **template_kwargs)
    return expand_images(tokenizer.encode(text), images, vision.image_token_id, vision.merge_size)
