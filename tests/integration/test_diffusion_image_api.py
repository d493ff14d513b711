"""Images through the whole stack (gateway, Ray actor, diffusion engine) with the `openai` SDK:
image parts as data: URLs are answered, streamed or not; two concurrent requests that differ
only in their image keep their own answers (swap the images, the answers swap); bad, too many
and oversized images get the right status in the OpenAI envelope and the server keeps serving;
image metrics are exported; an autoregressive model without vision input refuses image parts."""

import base64
import concurrent.futures as cf
import io

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from tests.waiting import wait_for

MODEL = "tiny-diffusiongemma"


def _png(seed: int, size=(40, 64)) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def _url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(raw).decode()}"


def _messages(*urls: str, text: str = "What is in this picture?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text},
                                         *({"type": "image_url", "image_url": {"url": u}} for u in urls)]}]


def _ask(stack, *urls, **kw):
    return stack.client().chat.completions.create(model=MODEL, messages=_messages(*urls), max_tokens=24, seed=5,
                                                  temperature=0, **kw)


def test_an_image_request_is_answered_streamed_or_not(stack):
    url = _url(_png(1))
    r = _ask(stack, url)
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.prompt_tokens > 60  # soft tokens counted
    chunks = list(_ask(stack, url, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content


def test_concurrent_requests_keep_their_own_images(stack):
    a, b = _url(_png(1)), _url(_png(2, (96, 32)))
    with cf.ThreadPoolExecutor(4) as ex:
        first = list(ex.map(lambda u: _ask(stack, u).choices[0].message.content, [a, b, a, b]))
        swapped = list(ex.map(lambda u: _ask(stack, u).choices[0].message.content, [b, a]))
    assert first[0] == first[2] and first[1] == first[3]  # the same image, the same answer, whatever the batch
    assert first[0] != first[1]  # the image matters
    assert swapped == [first[1], first[0]]


@pytest.mark.parametrize("urls, status, words", [
    ([_url(b"this is not an image at all")], 400, "messages[0].content[1].image_url: not a decodable image"),
    (["data:image/png;base64,@@@not-base64@@@"], 400, "not valid base64"),
    (["ftp://example.com/cat.png"], 400, "unsupported URL scheme 'ftp'"),
    (["file:///etc/passwd"], 400, "unsupported URL scheme 'file'"),
    (["http://127.0.0.1:9/cat.png"], 400, "does not fetch image URLs"),
    ([_url(_png(3))] * 5, 400, "more than 4 images"),
    ([_url(_png(4, (300, 300)))], 413, "larger than the limit of 200000 bytes"),
    ([_url(_png(5, (700, 700))[:190_000])], 400, "not a decodable image"),  # a truncated PNG
])
def test_bad_images_get_the_right_status_and_the_server_keeps_serving(stack, urls, status, words):
    r = httpx.post(stack.url + "/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": _messages(*urls), "max_tokens": 8})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == "messages" and words in err["message"]
    assert _ask(stack, _url(_png(1))).choices[0].message.content is not None


def test_too_many_pixels_is_413(stack):
    buf = io.BytesIO()
    Image.new("RGB", (2000, 1000), (255, 0, 0)).save(buf, format="PNG")  # compresses tiny, decodes huge
    assert len(buf.getvalue()) < 200_000
    r = httpx.post(stack.url + "/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": _messages(_url(buf.getvalue())), "max_tokens": 8})
    assert r.status_code == 413 and "pixels" in r.json()["error"]["message"]


def _metric(stack, name: str) -> float:
    for line in httpx.get(stack.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") and f'model="{MODEL}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_image_metrics_are_exported(stack):
    before = _metric(stack, "tandem_diffusion_images_total")
    _ask(stack, _url(_png(7)), _url(_png(8)))
    # the gateway polls engine stats every 2 s
    wait_for(lambda: _metric(stack, "tandem_diffusion_images_total") >= before + 2, "the image count exported")
    assert _metric(stack, "tandem_diffusion_image_requests_total") >= 1
    assert _metric(stack, "tandem_diffusion_image_encode_seconds_total") > 0


def test_an_autoregressive_model_without_vision_refuses_image_parts(stack):
    with pytest.raises(openai.BadRequestError) as e:
        stack.client().chat.completions.create(model="tiny-llama", messages=_messages(_url(_png(1))), max_tokens=4)
    assert e.value.status_code == 400
    assert stack.client().chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=4).choices
