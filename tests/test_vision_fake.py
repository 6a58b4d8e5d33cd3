"""Images in, over the fake engine and in the scheduling policy: the request plumbing (image parts
in chat messages, placeholders, the embedding cache, cancellation between images, bad inputs) and
how the policy feeds image units (whole, apart from the token batch, positions).
"""
from __future__ import annotations

import io
import time

import numpy as np
import pytest

from comfyui_a3b.runtime import Cancelled, ChatPrompt, InvalidRequest, PromptTooLong, Runtime, preset
from comfyui_a3b.runtime.errors import InvalidImage, VisionUnavailable
from comfyui_a3b.runtime.images import decode, from_data_url, png_bytes
from comfyui_a3b.runtime.requests import ImagePart, prompt_images
from comfyui_a3b.runtime.generation import PRIORITY_INTERACTIVE
from comfyui_a3b.runtime.local.scheduler import Job, Policy

GREEDY = preset("greedy")
VISION = "fake://eye?vision=1"


@pytest.fixture
def rt(fake_engine):
    r = Runtime()
    yield r
    r.unload()


def rgb_part(seed: int, w: int = 8, h: int = 6) -> ImagePart:
    px = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    return ImagePart(rgb=px.tobytes(), width=w, height=h)


def png_part(seed: int, mode: str = "RGB", size=(8, 6)) -> ImagePart:
    from PIL import Image

    img = Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.convert(mode).save(buf, format="PNG")
    return ImagePart(data=buf.getvalue(), mime="image/png")


def chat(*content) -> ChatPrompt:
    return ChatPrompt([{"role": "user", "content": tuple(content)}])


# -- the request -----------------------------------------------------------------------------------
def test_content_parts_are_kept_in_order_and_checked():
    p = chat("look ", rgb_part(1), " and ", rgb_part(2))
    assert len(prompt_images(p)) == 2
    p.check()
    with pytest.raises(InvalidRequest, match="neither text nor an image"):
        chat("a", 5).check()
    with pytest.raises(InvalidRequest, match="either encoded image bytes"):
        chat(ImagePart()).check()
    with pytest.raises(InvalidRequest, match="RGB image has 12"):
        chat(ImagePart(rgb=b"\0" * 5, width=2, height=2)).check()
    with pytest.raises(InvalidRequest, match="width must be a positive"):
        chat(ImagePart(rgb=b"", width=0, height=2)).check()


def test_an_image_changes_the_answer_deterministically_and_is_encoded_once(rt):
    a = rt.generate(chat("Describe ", rgb_part(1), " please"), model=VISION, max_tokens=12, sampling=GREEDY)
    again = rt.generate(chat("Describe ", rgb_part(1), " please"), model=VISION, max_tokens=12,
                        sampling=preset("creative", seed=3))
    b = rt.generate(chat("Describe ", rgb_part(2), " please"), model=VISION, max_tokens=12, sampling=GREEDY)
    plain = rt.generate(chat("Describe  please"), model=VISION, max_tokens=12, sampling=GREEDY)
    same = rt.generate(chat("Describe ", rgb_part(1), " please"), model=VISION, max_tokens=12, sampling=GREEDY)
    assert a.text == same.text and a.text != b.text and a.text != plain.text
    m = rt.load(VISION)
    v = m.backend.vision
    # the image of the first request was encoded once, and re-queued requests reused its KV cache
    assert v.encoded.count(decode(rgb_part(1)).digest) == 1 and len(v.encoded) == 2
    assert again.n_cached_prompt_tokens >= a.n_prompt_tokens - 1
    assert a.n_prompt_tokens == len(m.render_chat(chat("Describe ", rgb_part(1), " please")).encode()) \
        - len(v.marker) + 1 + 4   # BOS, the text, 4 image tokens
    assert all(c.freed for c in v.chunks), "every image chunk is freed when its request ends"
    # the same picture as a PNG file is the same image (the digest is of the pixels)
    assert decode(png_part(7)).digest == decode(ImagePart(rgb=decode(png_part(7)).rgb, width=8, height=6)).digest


def test_the_same_image_after_its_kv_was_dropped_comes_from_the_embedding_cache(rt):
    spec = rt.spec(VISION, n_parallel=1)
    rt.generate(chat("one ", rgb_part(5), " x"), model=spec, max_tokens=3, sampling=GREEDY)
    rt.generate("evict the slot with other text " * 3, model=spec, chat=False, max_tokens=3, sampling=GREEDY)
    rt.generate(chat("one ", rgb_part(5), " x"), model=spec, max_tokens=3, sampling=GREEDY)
    v = rt.load(spec).backend.vision
    b = rt.load(spec).backend
    assert len(v.encoded) == 1 and len(b.images_decoded) == 2


def test_a_model_without_a_projector_says_what_to_add(rt):
    with pytest.raises(VisionUnavailable, match="mmproj"):
        rt.generate(chat("Describe ", rgb_part(1)), model="fake://blind", max_tokens=3)
    # text only still works on it
    assert rt.generate(chat("hi"), model="fake://blind", max_tokens=3, sampling=GREEDY).text


def test_the_marker_in_user_text_is_refused_beside_images(rt):
    with pytest.raises(InvalidRequest, match="stands for an image"):
        rt.generate(chat("say <__media__> ", rgb_part(1)), model=VISION, max_tokens=3)
    with pytest.raises(InvalidRequest, match="stands for an image"):
        rt.generate(ChatPrompt([{"role": "system", "content": "<__media__>"},
                                {"role": "user", "content": ("x", rgb_part(1))}]), model=VISION, max_tokens=3)
    # without images it is text like any other: nothing reads it as an image
    assert rt.generate(chat("say <__media__>"), model=VISION, max_tokens=3, sampling=GREEDY).text


def test_an_image_that_does_not_fit_gets_the_too_long_prompt_error(rt):
    with pytest.raises(PromptTooLong, match="context holds 512"):
        rt.generate(chat("x", rgb_part(1)), model=rt.spec("fake://eye?vision=1&image_tokens=600", n_ctx=512),
                    max_tokens=3)


def test_cancel_between_images_stops_before_the_next_encode(rt):
    spec = rt.spec("fake://slow?vision=1&encode_ms=300", n_parallel=1)
    stream = rt.submit(chat("a ", rgb_part(1), " b ", rgb_part(2), " c ", rgb_part(3), " d"), model=spec,
                       max_tokens=5, sampling=GREEDY)
    v = rt.load(spec).backend.vision
    deadline = time.monotonic() + 10
    while not v.encoded and time.monotonic() < deadline:
        time.sleep(0.01)
    stream.cancel()
    with pytest.raises(Cancelled):
        stream.result()
    assert 1 <= len(v.encoded) < 3


@pytest.mark.parametrize("part, message", [
    (ImagePart(data=b"this is not an image"), "not an image format"),
    (ImagePart(data=b"\x89PNG\r\n\x1a\n" + b"\0" * 30), "could not be read|damaged|not an image"),
])
def test_bad_image_bytes_get_a_clear_error(rt, part, message):
    with pytest.raises(InvalidImage, match=message):
        rt.generate(chat("x", part), model=VISION, max_tokens=3)


def test_truncated_png_and_jpeg_are_refused():
    from PIL import Image

    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8))
    for fmt in ("PNG", "JPEG"):
        buf = io.BytesIO()
        img.save(buf, format=fmt)
        data = buf.getvalue()
        with pytest.raises(InvalidImage, match="damaged or truncated"):
            decode(ImagePart(data=data[: len(data) // 2]))


def test_limits_are_checked_before_decoding(monkeypatch):
    monkeypatch.setenv("A3B_IMAGE_MAX_PIXELS", "40")
    with pytest.raises(InvalidImage, match="at most 40"):
        decode(png_part(1))   # 48 pixels, read from the header
    with pytest.raises(InvalidImage, match="at most 40"):
        decode(rgb_part(1))
    monkeypatch.setenv("A3B_IMAGE_MAX_BYTES", "20")
    with pytest.raises(InvalidImage, match="at most 20 are taken"):
        decode(png_part(1))


def test_grayscale_alpha_and_16_bit_images_become_rgb():
    from PIL import Image

    for mode in ("L", "RGBA", "LA", "P"):
        im = decode(png_part(3, mode))
        assert len(im.rgb) == 8 * 6 * 3
    rgba = Image.new("RGBA", (2, 1), (10, 20, 30, 0))   # fully transparent: white
    buf = io.BytesIO()
    rgba.save(buf, format="PNG")
    assert decode(ImagePart(data=buf.getvalue())).rgb == b"\xff" * 6
    g16 = Image.fromarray(np.array([[0, 65535]], dtype=np.uint16))
    buf = io.BytesIO()
    g16.save(buf, format="PNG")
    assert decode(ImagePart(data=buf.getvalue())).rgb == b"\0\0\0\xff\xff\xff"


def test_data_urls_only():
    part = from_data_url("data:image/png;base64," + __import__("base64").b64encode(png_bytes(decode(rgb_part(1))))
                         .decode())
    assert decode(part).rgb == decode(rgb_part(1)).rgb
    with pytest.raises(InvalidImage, match="nothing is fetched"):
        from_data_url("https://example.com/cat.png")
    with pytest.raises(InvalidImage, match="not valid base64"):
        from_data_url("data:image/png;base64,@@@")
    with pytest.raises(InvalidImage, match="not an image"):
        from_data_url("data:text/plain;base64,aGk=")


# -- the policy ------------------------------------------------------------------------------------
class Unit:
    def __init__(self, n_tokens: int, n_pos: int | None = None):
        self.n_tokens, self.n_pos = n_tokens, n_tokens if n_pos is None else n_pos


def job_with_units(prompt_len: int = 20, units=None, priority: int = 0) -> Job:
    units = ((5, Unit(6)),) if units is None else units
    toks = list(range(1, prompt_len + 1))
    for start, u in units:
        toks[start:start + u.n_tokens] = [-1 - i for i in range(u.n_tokens)]
    return Job(toks, priority, units=dict(units))


def feed(policy: Policy):
    step = policy.next_step()
    policy.decoded(step)
    return step


def test_a_unit_is_fed_whole_in_an_entry_of_its_own_kind():
    p = Policy(n_slots=1, batch_tokens=4)
    job = job_with_units()
    p.submit(job)
    p.admit()
    spans = []
    while job.remaining:
        step = feed(p)
        e = step.entries[0]
        spans.append((e.start, e.count, e.unit is not None, e.output))
    # text stops at the unit; the unit (6 tokens, more than the batch's 4) goes whole; only the last
    # text entry has an output row, and a unit never takes a row
    assert spans == [(0, 4, False, None), (4, 1, False, None), (5, 6, True, None), (11, 4, False, None),
                     (15, 4, False, None), (19, 1, False, 0)]


def test_positions_follow_units_with_fewer_positions_than_tokens():
    job = job_with_units(30, ((5, Unit(8, 3)), (15, Unit(4, 2))))
    assert [job.position(i) for i in (0, 5, 13, 15, 19, 29)] == [0, 5, 8, 10, 12, 22]
    p = Policy(n_slots=1, batch_tokens=64)
    p.submit(job)
    p.admit()
    entries = []
    while job.remaining:
        entries += feed(p).entries
    assert [(e.start, e.position) for e in entries] == [(0, 0), (5, 5), (13, 8), (15, 10), (19, 12)]
    # past a unit, a trim names the position, not the index
    p.release(job)
    third = job_with_units(30, ((5, Unit(8, 3)), (15, Unit(4, 2))))
    third.seq[14] = 77
    p.submit(third)
    adm = p.admit()
    assert adm.trims[0].keep == 14 and adm.trims[0].position == 9 and third.fed == 14
    # a job that shares the prefix into the middle of a unit keeps only what is before the unit
    p.release(third)
    other = job_with_units(30, ((5, Unit(8, 3)),))
    other.seq[9] = 99   # differs inside the unit
    p.submit(other)
    adm = p.admit()
    assert adm.trims[0].keep == 5 and adm.trims[0].position == 5 and other.fed == 5


def test_an_editor_waits_for_at_most_one_image_of_a_workflow():
    p = Policy(n_slots=2, batch_tokens=256, yield_tokens=64)
    wf = job_with_units(60, ((5, Unit(20)), (25, Unit(20))))
    p.submit(wf)
    p.admit()
    feed(p)   # the text before the first image
    editor = Job(list(range(1, 9)), PRIORITY_INTERACTIVE)
    p.submit(editor)
    p.admit()
    step = feed(p)
    assert [e.job for e in step.entries] == [editor], "the editor's prompt goes first, alone"
    while editor.remaining:
        step = feed(p)
        assert all(e.job is editor or e.count == 1 for e in step.entries)


def test_a_unit_takes_no_row_of_the_token_batch():
    p = Policy(n_slots=2, batch_tokens=64)
    a = job_with_units(7, ((2, Unit(4)),))
    p.submit(a)
    p.admit()
    feed(p)   # a's first two tokens
    b = Job(list(range(1, 9)))
    p.submit(b)
    p.admit()
    step = p.next_step()
    assert [(e.job, e.unit is not None) for e in step.entries] == [(a, True), (b, False)]
    assert step.entries[0].output is None and step.entries[1].output == 7   # b's last token is row 7, not 11


# -- finding the projector ---------------------------------------------------------------------------
def test_the_projector_beside_the_model(tmp_path, caplog):
    from comfyui_a3b.runtime.models import mmproj
    from comfyui_a3b.runtime.errors import ModelNotFound

    model = tmp_path / "Qwen2.5-VL-3B-Instruct-Q4_K_M.gguf"
    model.write_bytes(b"GGUF")
    assert mmproj.resolve(model, "auto") is None
    own = tmp_path / "mmproj-Qwen2.5-VL-3B-Instruct-f16.gguf"
    own.write_bytes(b"GGUF")
    assert mmproj.resolve(model, "auto") == own
    (tmp_path / "mmproj-gemma-3-4b-it-f16.gguf").write_bytes(b"GGUF")   # another model's, in the same folder
    assert mmproj.resolve(model, "auto") == own
    (tmp_path / "mmproj-Qwen2.5-VL-3B-Instruct-q8_0.gguf").write_bytes(b"GGUF")   # two of its own: say so
    assert mmproj.resolve(model, "auto") is None and "several projectors" in caplog.text
    assert mmproj.resolve(model, "off") is None
    assert mmproj.resolve(model, own.name) == own   # a name beside the model
    with pytest.raises(ModelNotFound, match="was not found"):
        mmproj.resolve(model, "nope.gguf")
