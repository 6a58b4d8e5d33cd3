"""One loaded llama_model: the weights, their vocabulary, and what llama.cpp says about them.

A `Weights` object is shared by every context and every LoadSpec that uses the file (the store keys
it by file and weight options). Its vocabulary may be used from any thread; `free()` waits until no
thread is inside a vocabulary call, so an unload racing a tokenization cannot free memory in use.
"""
from __future__ import annotations

import contextlib
import ctypes
import re
import threading
import time
from pathlib import Path

from ..models import vet
from ..engine import ModelInfo
from ..errors import ModelLoadFailed, ModelUnloaded, TruncatedGGUF, UnsupportedArchitecture
from ..models.gguf_info import FILE_TYPES
from .binding import lib_lock, llama, llama_cpp_version, log_mark, log_since
from . import threadpool


def unknown_arch_from_log(text: str) -> str | None:
    m = re.search(r"unknown model architecture: '([^']+)'", text)
    return m.group(1) if m else None


def unsupported_error(arch: str) -> UnsupportedArchitecture:
    return UnsupportedArchitecture(
        f"The installed llama.cpp (llama-cpp-python {llama_cpp_version()}) does not know the "
        f"architecture {arch!r}. Upgrade llama-cpp-python (pip install -U llama-cpp-python), "
        "or pick a model of a supported architecture.")


def load_error(path: Path, log_text: str) -> Exception:
    """Turn llama.cpp's load failure (a NULL and some log lines) into a typed error."""
    unknown = unknown_arch_from_log(log_text)
    if unknown:
        return unsupported_error(unknown)
    lines = [ln.strip() for ln in log_text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower() or "fail" in ln.lower()]
    detail = " | ".join((errors or lines)[-2:]) or "no detail"
    if ("not within the file bounds" in log_text or "failed to read" in log_text
            or "corrupted or incomplete" in log_text):
        return TruncatedGGUF(f"{path} is truncated or damaged ({detail}). Copy or download the file again.")
    return ModelLoadFailed(f"llama.cpp could not load {path}: {detail}")


def probe_architecture(path) -> tuple[bool, str]:
    """Ask the installed llama.cpp whether it knows a file's architecture, without loading weights.

    A vocab-only load reads the metadata and builds the tokenizer; an unknown architecture fails
    there, before any tensor is touched.
    """
    vet.check_file(path)   # a file llama.cpp could crash on is refused before it reaches it here
    L = llama()
    params = L.llama_model_default_params()
    params.vocab_only = True
    mark = log_mark()
    with lib_lock:
        ptr = L.llama_model_load_from_file(str(path).encode("utf-8"), params)
    if ptr:
        L.llama_model_free(ptr)
        return True, "supported"
    text = log_since(mark)
    unknown = unknown_arch_from_log(text)
    if unknown:
        return False, f"unknown architecture {unknown!r}"
    return False, (text.strip().splitlines() or ["load failed"])[-1]


class Weights:
    """A loaded llama_model and its vocabulary (the `Vocab` of engine.py)."""

    def __init__(self, path: Path, n_gpu_layers: int = 0, use_mmap: bool = True, name: str | None = None,
                 offload: str = "", vocab_only: bool = False, repack: bool = True,
                 overrides: list[tuple[str, str]] = (), placement: dict | None = None, load_mtp: bool = False):
        """`vocab_only`: the vocabulary without the weights (tokenizing). `repack`: let llama.cpp's CPU
        backend copy weights into its interleaved layouts (faster CPU matrix products, but anonymous
        memory the size of those weights instead of the memory-mapped file's pages). `load_mtp`: load
        the multi-token-prediction layers too (llama.cpp skips them otherwise; speculative=mtp)."""
        vet.check_file(path)   # first load of a file: in a child process, see runtime/models/vet.py
        L = llama()
        self.path = Path(path)
        params = L.llama_model_default_params()
        params.n_gpu_layers = int(n_gpu_layers)
        params.load_mode = L.LLAMA_LOAD_MODE_MMAP if use_mmap else L.LLAMA_LOAD_MODE_NONE
        params.vocab_only = bool(vocab_only)
        if load_mtp:
            params.load_mtp = True
        if not repack or not vet.repack_allowed():
            params.use_extra_bufts = False
        #: whether llama.cpp may keep CPU weights in its repacked layouts (backend sampling asks)
        self.repacked = bool(params.use_extra_bufts)
        self.overrides = None
        if overrides:
            from .placement import Overrides

            self.overrides = Overrides(list(overrides))   # llama.cpp keeps the pointer: held while the model lives
            params.tensor_buft_overrides = self.overrides.pointer
        mark = log_mark()
        t0 = time.perf_counter()
        ptr = L.llama_model_load_from_file(str(path).encode("utf-8"), params)
        self.load_seconds = time.perf_counter() - t0
        threadpool.release_openmp_threads()   # the load's threads (AMX weight conversion); see there
        if not ptr:
            raise load_error(self.path, log_since(mark))
        self.ptr = ptr
        self._users = 0
        self._closing = False
        self._cond = threading.Condition()
        self.vocab_ptr = L.llama_model_get_vocab(ptr)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab_ptr)
        self.vocab_only = bool(vocab_only)
        if vocab_only:  # llama.cpp aborts on per-layer queries of a model loaded without its layers
            self.n_ctx_train = self.n_embd = self.n_layer = self.n_head = self.n_head_kv = self.size_bytes = 0
            self.has_encoder = False
        else:
            self.n_ctx_train = L.llama_model_n_ctx_train(ptr)
            self.n_embd = L.llama_model_n_embd(ptr)
            self.n_layer = L.llama_model_n_layer(ptr)
            self.n_head = L.llama_model_n_head(ptr)
            self.n_head_kv = L.llama_model_n_head_kv(ptr)
            self.size_bytes = int(L.llama_model_size(ptr))
            self.has_encoder = bool(L.llama_model_has_encoder(ptr))
        #: multi-token-prediction ("nextn") layers the file carries (qwen35 and qwen35moe GGUFs may)
        self.n_layer_nextn = 0 if vocab_only else int(getattr(L, "llama_model_n_layer_nextn", lambda _: 0)(ptr))
        self.add_bos = bool(L.llama_vocab_get_add_bos(self.vocab_ptr))
        self.bos = L.llama_vocab_bos(self.vocab_ptr)
        self.eos = L.llama_vocab_eos(self.vocab_ptr)
        self._pieces: dict[int, bytes] = {}
        self._eog: dict[int, bool] = {}
        self._eog_all: list[int] | None = None
        self._buf = ctypes.create_string_buffer(256)
        self._piece_lock = threading.Lock()
        self._adapters: dict[str, object] = {}
        #: the multimodal projector (vision.py), attached by the engine after the load
        self.projector = None
        arch = self.meta("general.architecture") or "unknown"
        ftype = self.meta("general.file_type")
        self.info = ModelInfo(
            name=name or self.path.name, path=str(self.path), architecture=arch,
            file_type=FILE_TYPES.get(int(ftype), ftype) if ftype and ftype.isdigit() else ftype,
            n_ctx_train=self.n_ctx_train, n_vocab=self.n_vocab, n_embd=self.n_embd, n_layer=self.n_layer,
            size_bytes=self.size_bytes, chat_template=self.meta("tokenizer.chat_template"),
            special_tokens=self.special_tokens(), add_bos=self.add_bos, n_gpu_layers=int(n_gpu_layers),
            offload=offload, n_cpu_moe=int((placement or {}).get("n_cpu_moe", 0)), placement=placement or {})
        self.load_log = log_since(mark)

    @property
    def vocab(self) -> Weights:
        return self

    # -- lifetime: no free while a thread is inside a call --------------------------------------
    @contextlib.contextmanager
    def use(self):
        """Hold the weights for the duration of a call; ModelUnloaded once they are being freed."""
        with self._cond:
            if self._closing:
                raise ModelUnloaded(f"{self.path.name} was unloaded; load it again.")
            self._users += 1
        try:
            yield
        finally:
            with self._cond:
                self._users -= 1
                if self._users == 0:
                    self._cond.notify_all()

    def free(self) -> None:
        """Free the weights once every thread using them has left (callers stop using them first)."""
        with self._cond:
            self._closing = True
            while self._users:
                self._cond.wait()
            if not self.ptr:
                return
            L = llama()
            if self.projector is not None:
                self.projector.free()
                self.projector = None
            for a in self._adapters.values():
                L.llama_adapter_lora_free(a)
            self._adapters.clear()
            L.llama_model_free(self.ptr)
            self.ptr = None

    # -- vocabulary (any thread) --------------------------------------------------------------
    def tokenize(self, text: str, add_bos: bool = False, special: bool = True) -> list[int]:
        L = llama()
        data = text.encode("utf-8")
        n = len(data) + 8
        buf = (L.llama_token * n)()
        with self.use():
            got = L.llama_tokenize(self.vocab_ptr, data, len(data), buf, n, add_bos, special)
            if got < 0:
                n = -got
                buf = (L.llama_token * n)()
                got = L.llama_tokenize(self.vocab_ptr, data, len(data), buf, n, add_bos, special)
        return list(buf[:got])

    def piece(self, token: int) -> bytes:
        p = self._pieces.get(token)
        if p is None:
            L = llama()
            with self.use(), self._piece_lock:
                n = L.llama_token_to_piece(self.vocab_ptr, token, self._buf, len(self._buf), 0, False)
                if n < 0:
                    self._buf = ctypes.create_string_buffer(-n + 1)
                    n = L.llama_token_to_piece(self.vocab_ptr, token, self._buf, len(self._buf), 0, False)
                p = self._buf.raw[:n]
            self._pieces[token] = p
        return p

    def detokenize(self, tokens: list[int]) -> str:
        return b"".join(self.piece(t) for t in tokens).decode("utf-8", "replace")

    def is_eog(self, token: int) -> bool:
        v = self._eog.get(token)
        if v is None:
            with self.use():
                v = self._eog[token] = bool(llama().llama_vocab_is_eog(self.vocab_ptr, token))
        return v

    def eog_tokens(self) -> list[int]:
        """Every end-of-generation token id (a pass over the vocabulary, once)."""
        if self._eog_all is None:
            L = llama()
            with self.use():
                self._eog_all = [t for t in range(self.n_vocab) if L.llama_vocab_is_eog(self.vocab_ptr, t)]
        return self._eog_all

    def token_text(self, token: int) -> str:
        with self.use():
            return llama().llama_vocab_get_text(self.vocab_ptr, token).decode("utf-8", "replace")

    def special_tokens(self) -> dict[str, int]:
        """FIM and other special token ids (-1 when the model has none)."""
        L = llama()
        v = self.vocab_ptr
        with self.use():
            return {"bos": self.bos, "eos": self.eos, "eot": L.llama_vocab_eot(v),
                    "fim_pre": L.llama_vocab_fim_pre(v), "fim_suf": L.llama_vocab_fim_suf(v),
                    "fim_mid": L.llama_vocab_fim_mid(v), "fim_pad": L.llama_vocab_fim_pad(v),
                    "fim_rep": L.llama_vocab_fim_rep(v), "fim_sep": L.llama_vocab_fim_sep(v)}

    def meta(self, key: str) -> str | None:
        L = llama()
        buf = ctypes.create_string_buffer(1 << 16)
        with self.use():
            n = L.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
            if n < 0:
                return None
            if n >= len(buf):
                buf = ctypes.create_string_buffer(n + 1)
                L.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace")

    def adapter(self, path: str):
        """A LoRA adapter loaded over these weights (once per path)."""
        a = self._adapters.get(path)
        if a is None:
            with self.use():
                a = llama().llama_adapter_lora_init(self.ptr, path.encode("utf-8"))
            if not a:
                raise ModelLoadFailed(f"Could not load LoRA adapter {path}: is it a GGUF LoRA made for "
                                      f"this base model ({self.path.name})?")
            self._adapters[path] = a
        return a
