"""Image parts of chat messages: extraction, data: URLs, limits and decoding (no model)."""

import asyncio
import base64
import io
import random

import pytest
from PIL import Image

from diffusion_plugin.api.images import ImageLimits, decode, extract_images, load_images
from tandem_core.errors import TandemError

LIMITS = ImageLimits(max_images=2, max_image_bytes=50_000, max_pixels=100_000)


def _png(size=(8, 6), color=(10, 20, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def _part(url):
    return {"type": "image_url", "image_url": {"url": url}}


def _data(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def test_image_parts_become_placeholders_in_order_and_text_is_kept():
    a, b = _png(color=(1, 2, 3)), _png(color=(4, 5, 6))
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "compare"}, _part(_data(a)),
                                             {"type": "image_url", "image_url": _data(b)}]}]
    out, sources = extract_images(messages, LIMITS)
    assert out[0] == messages[0]
    assert out[1]["content"] == [{"type": "text", "text": "compare"}, {"type": "image"}, {"type": "image"}]
    assert [s.data for s in sources] == [a, b] and sources[1].where == "messages[1].content[2].image_url"
    assert messages[1]["content"][1]["type"] == "image_url"  # the caller's messages are left alone
    pictures = asyncio.run(load_images(sources, LIMITS))
    assert [p.getpixel((0, 0)) for p in pictures] == [(1, 2, 3), (4, 5, 6)] and pictures[0].mode == "RGB"


def test_text_only_messages_have_no_images():
    messages = [{"role": "user", "content": "hi"}, {"role": "user", "content": [{"type": "text", "text": "x"}]}, 5]
    out, sources = extract_images(messages, LIMITS)
    assert out == messages and sources == []


@pytest.mark.parametrize("part, status, words", [
    (_part("ftp://x/y.png"), 400, "unsupported URL scheme 'ftp'"),
    (_part("no-scheme-at-all"), 400, "unsupported URL scheme '(none)'"),
    (_part("https://example.com/a.png"), 400, "does not fetch image URLs"),
    (_part("data:image/png,rawbytes"), 400, "must be base64"),
    (_part("data:image/png;base64,%%%"), 400, "not valid base64"),
    (_part(_data(b"x" * 60_000)), 413, "larger than the limit of 50000 bytes"),
    ({"type": "image_url", "image_url": {"no": "url"}}, 400, "`url`"),
    ({"type": "image_url"}, 400, "`url`"),
])
def test_bad_parts_name_the_part(part, status, words):
    with pytest.raises(TandemError) as e:
        extract_images([{"role": "user", "content": [{"type": "text", "text": "x"}, part]}], LIMITS)
    assert e.value.status == status and words in e.value.message and e.value.param == "messages"
    assert e.value.message.startswith("messages[0].content[1].image_url") or "more than" in e.value.message


def test_too_many_images_is_400():
    with pytest.raises(TandemError) as e:
        extract_images([{"role": "user", "content": [_part(_data(_png()))] * 3}], LIMITS)
    assert e.value.status == 400 and "more than 2 images" in e.value.message


def test_decode_refuses_garbage_truncation_and_too_many_pixels():
    for raw in (b"not an image", _png((64, 64))[:40]):
        with pytest.raises(TandemError) as e:
            decode(raw, "w", LIMITS)
        assert e.value.status == 400 and "not a decodable image" in e.value.message
    with pytest.raises(TandemError) as e:
        decode(_png((400, 300)), "w", LIMITS)  # 120k pixels, a small file
    assert e.value.status == 413 and "pixels" in e.value.message
    assert decode(_png((300, 300)), "w", LIMITS).size == (300, 300)


def test_engine_args_carry_the_limits():
    from diffusion_plugin.engine_args import DiffusionEngineArgs

    limits = DiffusionEngineArgs.model_validate({"max_images": 3, "max_image_bytes": 10, "image_fetch": True}).image_limits()
    assert (limits.max_images, limits.max_image_bytes, limits.fetch_urls) == (3, 10, True)
    _, sources = extract_images([{"role": "user", "content": [_part("https://example.com/a.png")]}], limits)
    assert sources[0].url == "https://example.com/a.png"


def test_fetching_an_http_image_where_allowed(tmp_path):
    import functools
    import http.server
    import threading

    (tmp_path / "a.png").write_bytes(_png(color=(7, 8, 9)))
    noise = io.BytesIO()
    Image.frombytes("RGB", (100, 100), random.Random(0).randbytes(30_000)).save(noise, format="PNG")
    assert len(noise.getvalue()) > 5_000
    (tmp_path / "big.png").write_bytes(noise.getvalue())
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    limits = ImageLimits(fetch_urls=True, max_image_bytes=5_000, fetch_timeout_s=5)
    try:
        _, sources = extract_images([{"role": "user", "content": [_part(base + "/a.png")]}], limits)
        assert asyncio.run(load_images(sources, limits))[0].getpixel((0, 0)) == (7, 8, 9)
        for path, status in (("/missing.png", 400), ("/big.png", 413)):
            _, sources = extract_images([{"role": "user", "content": [_part(base + path)]}], limits)
            with pytest.raises(TandemError) as e:
                asyncio.run(load_images(sources, limits))
            assert e.value.status == status, e.value.message
    finally:
        server.shutdown()
        server.server_close()
