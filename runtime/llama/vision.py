"""A model's multimodal projector over llama.cpp's libmtmd: images into the text model's embedding space.

One `Projector` per loaded weights (it belongs to the llama_model, one copy, freed with it). It
does three things, and the worker calls the expensive two from its own thread only:

* `tokenize(text, images)`: the rendered chat (images as libmtmd's marker) split into text tokens
  and `ImageChunk`s, each image already preprocessed by libmtmd as its model expects (resized,
  tiled, normalised). Runs on the caller's thread, under the projector's lock.
* `embedding(chunk)`: the image's vision-tower output, cached by the image's content digest (an
  LRU bounded in bytes), so a request queued again with another seed does not encode it again.
* `decode(chunk, lctx, position, seq_id, n_batch)`: the embeddings written into one sequence of the
  generation context by libmtmd's helper (it sets M-RoPE's 2-D positions for Qwen-VL models and
  non-causal attention for Gemma 3's image tokens).

libmtmd is found beside libllama: where llama-cpp-python reads its libraries from elsewhere
(LLAMA_CPP_LIB_PATH), libmtmd is taken from the same folder, so one copy of ggml is loaded.
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InvalidRequest, ModelLoadFailed
from ..images import RGBImage
from .binding import llama, log_mark, log_since

log = logging.getLogger("a3b.vision")

#: Image embeddings kept per projector, in bytes (a 448x448 Qwen-VL image: 256 x 2048 floats = 2 MiB).
EMBED_CACHE_BYTES = 256 << 20
#: MTMD_INPUT_CHUNK_TYPE_TEXT / _IMAGE
CHUNK_TEXT, CHUNK_IMAGE = 0, 1

_mtmd = None
_mtmd_lock = threading.Lock()


def mtmd():
    """llama-cpp-python's libmtmd binding, loaded once (from libllama's folder when that is not the package's)."""
    global _mtmd
    if _mtmd is None:
        with _mtmd_lock:
            if _mtmd is None:
                llama()
                lib_dir = os.environ.get("LLAMA_CPP_LIB_PATH")
                if lib_dir and not os.environ.get("MTMD_CPP_LIB") and (Path(lib_dir) / "libmtmd.so").exists():
                    os.environ["MTMD_CPP_LIB"] = lib_dir
                try:
                    from llama_cpp import mtmd_cpp
                except Exception as e:  # a build without libmtmd
                    raise ModelLoadFailed(f"This llama-cpp-python has no multimodal library (libmtmd): {e}. "
                                          "Install llama-cpp-python 0.3.36 or later.") from e
                from . import binding

                # libmtmd logs on its own channel: into the same log as llama.cpp's
                mtmd_cpp.mtmd_log_set(binding._log_cb, ctypes.c_void_p(0))
                mtmd_cpp.mtmd_helper_log_set(binding._log_cb, ctypes.c_void_p(0))
                _mtmd = mtmd_cpp
    return _mtmd


class ImageChunk:
    """One image of a prompt as libmtmd tokenized it: its token count, the positions it takes, its
    digest, and the chunk (the preprocessed image) until it is freed."""

    def __init__(self, handle: Any, n_tokens: int, n_pos: int, digest: str):
        self.handle = handle
        self.n_tokens = n_tokens
        self.n_pos = n_pos
        self.digest = digest

    def free(self) -> None:
        h, self.handle = self.handle, None
        if h:
            mtmd().mtmd_input_chunk_free(h)

    def __del__(self):
        try:
            self.free()
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass

    def __repr__(self) -> str:
        return f"ImageChunk({self.n_tokens} tokens, {self.n_pos} positions, {self.digest[:12]})"


@dataclass
class ProjectorInfo:
    path: str
    size_bytes: int
    n_embd: int
    mrope: bool
    marker: str


class Projector:
    def __init__(self, path: Path, text_model: Any, *, use_gpu: bool, n_threads: int,
                 guard: Any = contextlib.nullcontext):
        """`guard()`: held around calls that read the text model (libmtmd tokenizes the text with its
        vocabulary), so that an unload cannot free it meanwhile (Weights.use)."""
        M = mtmd()
        L = llama()
        self.path = Path(path)
        p = M.mtmd_context_params_default()
        p.use_gpu = bool(use_gpu)
        p.n_threads = max(1, int(n_threads))
        p.print_timings = False
        # on a GPU, a trial encode at load reserves the compute buffers (a projector that does not fit
        # fails here, not at the first image); on the CPU it would cost seconds for a large tower
        p.warmup = bool(use_gpu)
        mark = log_mark()
        self.ctx = M.mtmd_init_from_file(str(path).encode("utf-8"), text_model, p)
        if not self.ctx:
            lines = [ln.strip() for ln in log_since(mark).splitlines() if ln.strip()]
            said = [ln for ln in lines if "error" in ln.lower() or "fail" in ln.lower() or "mismatch" in ln.lower()]
            raise ModelLoadFailed(f"llama.cpp could not load the projector {self.path.name}: "
                                  f"{' | '.join((said or lines)[-2:]) or 'no detail'}. Is it the mmproj file of "
                                  "this model?")
        if not M.mtmd_support_vision(self.ctx):
            M.mtmd_free(self.ctx)
            self.ctx = None
            raise ModelLoadFailed(f"{self.path.name} is a projector without a vision encoder (audio only?); "
                                  "images need a vision projector.")
        self.n_embd = int(L.llama_model_n_embd_inp(text_model))
        self.info = ProjectorInfo(str(path), os.path.getsize(path), self.n_embd,
                                  bool(M.mtmd_decode_use_mrope(self.ctx)), M.mtmd_default_marker().decode())
        self.marker = self.info.marker
        self._guard = guard
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[str, np.ndarray] = collections.OrderedDict()
        self._cache_bytes = 0
        self.stats: collections.Counter = collections.Counter()

    # -- caller threads -------------------------------------------------------------------------
    def tokenize(self, text: str, images: list[RGBImage], add_special: bool) -> list[int | ImageChunk]:
        """Text tokens and image chunks, in order; `text` holds one marker per image."""
        M = mtmd()
        bitmaps = [M.mtmd_bitmap_init(im.width, im.height, (ctypes.c_ubyte * len(im.rgb)).from_buffer_copy(im.rgb))
                   for im in images]
        data = text.encode("utf-8")
        inp = M.mtmd_input_text(data, len(data), bool(add_special), True)
        arr = (M.mtmd_bitmap_p_ctypes * max(1, len(bitmaps)))(*bitmaps)
        chunks = M.mtmd_input_chunks_init()
        out: list[int | ImageChunk] = []
        try:
            if any(not b for b in bitmaps):
                raise InvalidRequest("llama.cpp could not take an image (out of memory?).")
            with self._guard(), self._lock:
                if not self.ctx:
                    raise InvalidRequest(f"The projector {self.path.name} was unloaded; load the model again.")
                mark = log_mark()
                rc = M.mtmd_tokenize(self.ctx, chunks, ctypes.byref(inp), arr, len(bitmaps))
            if rc != 0:
                detail = " | ".join(ln.strip() for ln in log_since(mark).splitlines() if ln.strip())[-300:]
                raise InvalidRequest(f"The prompt with its images could not be prepared (code {rc}: "
                                     f"{detail or 'no detail'}).")
            image = 0
            for i in range(M.mtmd_input_chunks_size(chunks)):
                c = M.mtmd_input_chunks_get(chunks, i)
                kind = M.mtmd_input_chunk_get_type(c)
                if kind == CHUNK_TEXT:
                    n = ctypes.c_size_t()
                    toks = M.mtmd_input_chunk_get_tokens_text(c, ctypes.byref(n))
                    out.extend(toks[:n.value])
                elif kind == CHUNK_IMAGE:
                    out.append(ImageChunk(M.mtmd_input_chunk_copy(c), int(M.mtmd_input_chunk_get_n_tokens(c)),
                                          int(M.mtmd_input_chunk_get_n_pos(c)), images[image].digest))
                    image += 1
                else:
                    raise InvalidRequest("The projector made a chunk that is not text or an image (audio?).")
        except BaseException:
            for piece in out:
                if isinstance(piece, ImageChunk):
                    piece.free()
            raise
        finally:
            M.mtmd_input_chunks_free(chunks)
            for b in bitmaps:
                if b:
                    M.mtmd_bitmap_free(b)
        return out

    def non_causal(self, chunk: ImageChunk) -> bool:
        return bool(mtmd().mtmd_decode_use_non_causal(self.ctx, chunk.handle))

    # -- the worker thread ----------------------------------------------------------------------
    def embedding(self, chunk: ImageChunk, *, count: bool = True) -> np.ndarray:
        """The chunk's embeddings (n_tokens x n_embd), from the cache or encoded now (`count`: a cache
        hit counts in stats; the decode that follows the worker's encode does not count)."""
        with self._lock:
            hit = self._cache.get(chunk.digest)
            if hit is not None and hit.shape[0] == chunk.n_tokens:
                self._cache.move_to_end(chunk.digest)
                self.stats["cache_hits"] += count
                return hit
            if not self.ctx or not chunk.handle:
                raise InvalidRequest("The projector or the image was released before the image was read.")
            M = mtmd()
            mark = log_mark()
            t0 = time.perf_counter()
            rc = M.mtmd_encode_chunk(self.ctx, chunk.handle)
            if rc != 0:
                raise InvalidRequest(f"The projector failed to encode an image (code {rc}: "
                                     f"{log_since(mark).strip()[-200:] or 'no detail'}).")
            ptr = M.mtmd_get_output_embd(self.ctx)
            emb = np.ctypeslib.as_array(ptr, shape=(chunk.n_tokens * self.n_embd,)).copy()
            emb = emb.reshape(chunk.n_tokens, self.n_embd)
            self.stats["encoded"] += 1
            self.stats["encode_ms"] += int((time.perf_counter() - t0) * 1000)
            self._cache[chunk.digest] = emb
            self._cache_bytes += emb.nbytes
            while self._cache_bytes > EMBED_CACHE_BYTES and len(self._cache) > 1:
                _, old = self._cache.popitem(last=False)
                self._cache_bytes -= old.nbytes
            return emb

    def decode(self, chunk: ImageChunk, lctx: Any, position: int, seq_id: int, n_batch: int) -> int:
        """Write the image into sequence `seq_id` of `lctx` from `position`; llama_decode's code (0: done)."""
        M = mtmd()
        emb = self.embedding(chunk, count=False)
        new_pos = ctypes.c_int32(0)
        return int(M.mtmd_helper_decode_image_chunk(
            self.ctx, lctx, chunk.handle, emb.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), position, seq_id,
            n_batch, ctypes.byref(new_pos), M.mtmd_helper_post_decode_callback(), None))

    def cached(self, digest: str) -> bool:
        with self._lock:
            return digest in self._cache

    def free(self) -> None:
        with self._lock:
            ctx, self.ctx = self.ctx, None
            self._cache.clear()
            self._cache_bytes = 0
        if ctx:
            mtmd().mtmd_free(ctx)


__all__ = ["EMBED_CACHE_BYTES", "ImageChunk", "Projector", "ProjectorInfo", "mtmd"]
