"""Image inputs of diffusion chat requests: OpenAI ``image_url`` content parts to decoded pictures.

``extract_images`` walks the messages (pure: no PIL, no network), replaces each image part by
``{"type": "image"}`` (what chat templates render as the model's image placeholder) and returns
where each image comes from; ``load_images`` decodes them (data: URLs; http(s) only where the
deployment allows fetching). Every refusal names the part, e.g.
``messages[0].content[1].image_url``: too many images is a 400, too large a 413, an undecodable
image or an unsupported URL scheme a 400.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import warnings
from dataclasses import dataclass

from tandem_core.errors import ErrorKind, TandemError, invalid

MiB = 1024 * 1024


@dataclass(frozen=True)
class ImageLimits:
    max_images: int = 8  # per request
    max_image_bytes: int = 20 * MiB  # per image, encoded
    max_pixels: int = 40_000_000  # per image, decoded (decompression bombs)
    fetch_urls: bool = False  # http(s) image URLs: fetched by the replica, or refused
    fetch_timeout_s: float = 10.0


@dataclass(frozen=True)
class ImageSource:
    where: str  # the part, for error messages: messages[i].content[j].image_url
    data: bytes | None = None  # decoded from a data: URL
    url: str | None = None  # http(s), to fetch


def extract_images(messages: list, limits: ImageLimits) -> tuple[list, list[ImageSource]]:
    """Messages with image parts replaced by ``{"type": "image"}``, and the images in order."""
    out, sources = [], []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "image_url":
                where = f"messages[{i}].content[{j}].image_url"
                sources.append(_source(part.get("image_url"), where, limits))
                if len(sources) > limits.max_images:
                    raise invalid(f"messages: more than {limits.max_images} images in one request", "messages")
                parts.append({"type": "image"})
            else:
                parts.append(part)
        out.append({**message, "content": parts})
    return out, sources


def _source(value: object, where: str, limits: ImageLimits) -> ImageSource:
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise invalid(f"{where}: an object with a `url` (a data: URL or an http(s) URL) is required", "messages")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return ImageSource(where, data=_data_url(url, where, limits))
    if scheme in ("http", "https"):
        if not limits.fetch_urls:
            raise invalid(f"{where}: this deployment does not fetch image URLs; send the image inline as a "
                          "data:image/...;base64 URL", "messages")
        return ImageSource(where, url=url)
    raise invalid(f"{where}: unsupported URL scheme {scheme or '(none)'!r}; use a data: URL"
                  + (" or http(s)" if limits.fetch_urls else ""), "messages")


def _data_url(url: str, where: str, limits: ImageLimits) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise invalid(f"{where}: a data: URL must be base64 (data:image/png;base64,...)", "messages")
    if len(payload) * 3 // 4 > limits.max_image_bytes:
        raise _too_large(where, limits)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise invalid(f"{where}: the data: URL is not valid base64", "messages") from None


def _too_large(where: str, limits: ImageLimits) -> TandemError:
    return TandemError(ErrorKind.REQUEST_TOO_LARGE,
                       f"{where}: the image is larger than the limit of {limits.max_image_bytes} bytes", "messages")


async def load_images(sources: list[ImageSource], limits: ImageLimits) -> list:
    """The images as RGB PIL images, decoded off the event loop."""
    raws = []
    for src in sources:
        raws.append(src.data if src.data is not None else await _fetch(src, limits))
    return await asyncio.to_thread(lambda: [decode(raw, src.where, limits) for raw, src in zip(raws, sources,
                                                                                              strict=True)])


async def _fetch(src: ImageSource, limits: ImageLimits) -> bytes:
    import httpx

    try:
        async with httpx.AsyncClient(timeout=limits.fetch_timeout_s, follow_redirects=True) as client:
            async with client.stream("GET", src.url) as r:
                if r.status_code != 200:
                    raise invalid(f"{src.where}: fetching the image returned HTTP {r.status_code}", "messages")
                data = bytearray()
                async for chunk in r.aiter_bytes():
                    data += chunk
                    if len(data) > limits.max_image_bytes:
                        raise _too_large(src.where, limits)
                return bytes(data)
    except httpx.HTTPError as e:
        raise invalid(f"{src.where}: cannot fetch the image ({type(e).__name__})", "messages") from None


def decode(raw: bytes, where: str, limits: ImageLimits):
    from PIL import Image, UnidentifiedImageError

    if len(raw) > limits.max_image_bytes:
        raise _too_large(where, limits)
    too_many_pixels = TandemError(ErrorKind.REQUEST_TOO_LARGE, f"{where}: the image has more pixels than the limit "
                                  f"of {limits.max_pixels}", "messages")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)  # PIL's own bomb check: refuse
            with Image.open(io.BytesIO(raw)) as im:
                w, h = im.size
                if w * h > limits.max_pixels:
                    raise too_many_pixels
                im.load()
                return im.convert("RGB")
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise too_many_pixels from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        raise invalid(f"{where}: not a decodable image ({type(e).__name__})", "messages") from None
