"""Images as the model's projector takes them: 8-bit RGB pixels, checked, with a content hash.

A chat message's `ImagePart` (requests.py) holds an encoded file (PNG, JPEG, WebP, ...) or RGB
pixels already decoded (a ComfyUI IMAGE tensor, converted by the nodes). `decode` turns either into
an `RGBImage`: the limits (bytes, then pixels from the file's header) are checked before anything
is decoded; the decoding is Pillow's (in ComfyUI's environment; elsewhere `pip install pillow`), so
a truncated or malformed file is a Python error with a message, never a crash in native code that
was not built for hostile input. What a user may hand in is taken as a picture is seen: grayscale
becomes gray RGB, transparency is laid over white, 16-bit channels keep their top 8 bits.

The digest (SHA-256 of the size and the pixels) is the image's identity in the embedding cache: the
same picture from a file, a data URL or a tensor is encoded once.
"""
from __future__ import annotations

import hashlib
import io
import struct
import zlib
from dataclasses import dataclass

from .environment import env_number
from .errors import InvalidImage
from .options import IMAGE_MAX_BYTES, IMAGE_MAX_PIXELS
from .requests import ImagePart


@dataclass(frozen=True, eq=False)
class RGBImage:
    width: int
    height: int
    rgb: bytes
    digest: str

    def __repr__(self) -> str:
        return f"RGBImage({self.width}x{self.height}, {self.digest[:12]})"


def max_pixels() -> int:
    n = env_number("A3B_IMAGE_MAX_PIXELS", int)
    return IMAGE_MAX_PIXELS.default if n is None or n <= 0 else int(n)


def max_bytes() -> int:
    n = env_number("A3B_IMAGE_MAX_BYTES", int)
    return IMAGE_MAX_BYTES.default if n is None or n <= 0 else int(n)


def digest_of(width: int, height: int, rgb: bytes) -> str:
    h = hashlib.sha256(struct.pack("<II", width, height))
    h.update(rgb)
    return h.hexdigest()


def _check_size(width: int, height: int, what: str) -> None:
    if width <= 0 or height <= 0:
        raise InvalidImage(f"{what} has no pixels ({width}x{height}).")
    if width * height > max_pixels():
        raise InvalidImage(f"{what} is {width}x{height} = {width * height} pixels; at most {max_pixels()} are taken "
                           "(A3B_IMAGE_MAX_PIXELS). Scale it down first.")


def decode(part: ImagePart, what: str = "The image") -> RGBImage:
    """`part` as checked 8-bit RGB pixels (InvalidImage with a message for anything else)."""
    part.check()
    if part.rgb is not None:
        _check_size(part.width, part.height, what)
        rgb = bytes(part.rgb)
        return RGBImage(part.width, part.height, rgb, digest_of(part.width, part.height, rgb))
    data = bytes(part.data)
    if len(data) > max_bytes():
        raise InvalidImage(f"{what} is {len(data)} bytes; at most {max_bytes()} are taken (A3B_IMAGE_MAX_BYTES).")
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise InvalidImage("Decoding PNG/JPEG images needs Pillow, which is not installed: pip install pillow "
                           "(ComfyUI has it).") from None
    try:
        img = Image.open(io.BytesIO(data))   # reads the header only
    except UnidentifiedImageError:
        raise InvalidImage(f"{what} is not an image format Pillow reads (PNG, JPEG, WebP, GIF, BMP, ...): it starts "
                           f"with {data[:12]!r}.") from None
    except Exception as e:  # noqa: BLE001 - a malformed header is the file's fault
        raise InvalidImage(f"{what} could not be read: {e}") from None
    _check_size(img.width, img.height, what)
    try:
        img.load()
        rgb = _to_rgb(img)
    except Image.DecompressionBombError as e:
        raise InvalidImage(f"{what} is too large to decode: {e}") from None
    except Exception as e:  # noqa: BLE001 - a truncated or damaged file: say so
        raise InvalidImage(f"{what} is damaged or truncated ({img.format}: {e}).") from None
    raw = rgb.tobytes()
    return RGBImage(rgb.width, rgb.height, raw, digest_of(rgb.width, rgb.height, raw))


def _to_rgb(img):
    """8-bit RGB from any mode Pillow decodes: 16-bit gray keeps its top 8 bits, transparency over white."""
    from PIL import Image

    if img.mode.startswith("I") or img.mode == "F":
        import numpy as np

        a = np.asarray(img, dtype=np.float64)
        top = 65535.0 if img.mode.startswith("I;16") or a.max(initial=0) > 255 else 255.0
        img = Image.fromarray(np.clip(a * (255.0 / top), 0, 255).astype(np.uint8), "L")
    if img.mode == "P":
        img = img.convert("RGBA")
    if img.mode in ("RGBA", "LA", "PA") or "transparency" in img.info:
        img = img.convert("RGBA")
        back = Image.new("RGBA", img.size, (255, 255, 255, 255))
        img = Image.alpha_composite(back, img)
    return img.convert("RGB")


def png_bytes(image: RGBImage) -> bytes:
    """`image` as a PNG file (no dependency: zlib and the PNG chunk layout), for servers that take files."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)

    row = image.width * 3
    raw = b"".join(b"\0" + image.rgb[y * row:(y + 1) * row] for y in range(image.height))
    head = struct.pack(">IIBBBBB", image.width, image.height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", head) + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b"")


def from_data_url(url: str, what: str = "The image") -> ImagePart:
    """An ImagePart from a `data:image/...;base64,...` URL; anything else (a remote URL) is refused:
    the runtime fetches nothing."""
    import base64
    import binascii

    if not isinstance(url, str):
        raise InvalidImage(f"{what}'s url must be text, got {type(url).__name__}.")
    if not url.startswith("data:"):
        raise InvalidImage(f"{what} is given by URL ({url[:60]!r}); only data URLs "
                           "(data:image/png;base64,...) are taken: nothing is fetched. Put the image's bytes "
                           "in the request.")
    head, sep, body = url.partition(",")
    if not sep or ";base64" not in head:
        raise InvalidImage(f"{what} must be a base64 data URL (data:image/png;base64,...).")
    mime = head[5:].split(";")[0] or None
    if mime is not None and not mime.startswith("image/"):
        raise InvalidImage(f"{what} is a data URL of type {mime!r}, not an image.")
    if len(body) > max_bytes() * 4 // 3 + 8:
        raise InvalidImage(f"{what} is larger than {max_bytes()} bytes (A3B_IMAGE_MAX_BYTES).")
    try:
        data = base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidImage(f"{what}'s data URL is not valid base64.") from None
    return ImagePart(data=data, mime=mime)


def data_url(part: ImagePart) -> str:
    """`part` as a data URL (PNG for raw pixels), what an OpenAI-compatible server takes."""
    import base64

    if part.data is not None:
        return f"data:{part.mime or 'image/png'};base64,{base64.b64encode(bytes(part.data)).decode()}"
    return "data:image/png;base64," + base64.b64encode(png_bytes(decode(part))).decode()


__all__ = ["InvalidImage", "RGBImage", "data_url", "decode", "digest_of", "from_data_url", "max_bytes", "max_pixels",
           "png_bytes"]
