"""The engine seam: what the runtime needs from whatever runs a model, and how an engine is chosen.

The runtime's own code (store, worker, scheduler, generation) never calls llama.cpp; it talks to an
`Engine` through these interfaces:

* `Engine` loads **weights** for a `LoadSpec` (once per file and weight options; the store shares
  them between specs) and opens a `Backend` over them (contexts for one spec).
* `Weights` carries the model's `ModelInfo` and its `Vocab`, both safe to use from any thread.
* `Backend` executes what the scheduling policy decided, on the model's worker thread only: trim a
  sequence's KV cache, decode a batch, sample a row of the last decode, embed a pack of texts.

The in-process llama.cpp engine (runtime/llama/) is the default. Other engines register a URL
scheme (`register_engine("fake", engine)`, then `rt.spec("fake://tiny")`), which is also how the
fast test tier runs the real runtime over a small fake engine, as simonw/llm's tests register a
mock model.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np

    from .generation import SamplingParams
    from .options import LoadSpec
    from .scheduler import DecodeStep


@dataclass(frozen=True)
class ModelInfo:
    """What callers may know about a loaded model, without any engine handle."""

    name: str
    path: str                      # the file served (a re-encoded copy when serve_as says so)
    architecture: str
    file_type: str | None
    n_ctx_train: int
    n_vocab: int
    n_embd: int
    n_layer: int
    size_bytes: int
    chat_template: str | None = None
    #: FIM and other special token ids (-1 when absent): bos, eos, eot, fim_pre, fim_suf, fim_mid, ...
    special_tokens: dict[str, int] = field(default_factory=dict)
    add_bos: bool = False
    engine: str = "llama.cpp"
    n_gpu_layers: int = 0         # as loaded (after "auto" was resolved)
    offload: str = ""             # how that was chosen, in words


class Vocab(Protocol):
    """A model's tokenizer. Any thread may call it."""

    n_vocab: int
    add_bos: bool
    bos: int
    eos: int

    def tokenize(self, text: str, add_bos: bool = False, special: bool = True) -> list[int]: ...
    def piece(self, token: int) -> bytes: ...
    def detokenize(self, tokens: list[int]) -> str: ...
    def is_eog(self, token: int) -> bool: ...
    def token_text(self, token: int) -> str: ...
    def special_tokens(self) -> dict[str, int]: ...


class Weights(Protocol):
    info: ModelInfo
    vocab: Vocab
    size_bytes: int

    def free(self) -> None: ...


class Backend(Protocol):
    """Contexts over one model's weights for one LoadSpec. Only the model's worker thread calls it."""

    #: tokens one sequence slot holds (prompt + answer)
    n_ctx_seq: int
    #: an embedding pack holds at most this many tokens (unless one text is longer) and texts
    embed_pack_tokens: int
    embed_pack_texts: int

    def trim(self, seq_id: int, keep: int) -> None:
        """Drop the KV cache of sequence `seq_id` from position `keep` on."""

    def decode(self, step: DecodeStep) -> None:
        """Run one batch; raise DecodeFailed when the engine refuses it."""

    def new_sampler(self, sampling: SamplingParams, seed: int) -> Any: ...
    def free_sampler(self, sampler: Any) -> None: ...

    def sample_rows(self, rows: list[tuple[Any, int, bool]]) -> list[tuple[int, float | None]]:
        """For each (sampler, row of the last decode's outputs, want entropy): the next token, and
        the Shannon entropy (nats) of the model's raw next-token distribution there (or None)."""

    def embed(self, token_lists: list[list[int]], pooling: str) -> np.ndarray:
        """Pooled, unnormalised embeddings of a pack of texts, one row each."""

    def close(self) -> None: ...


class Engine(Protocol):
    name: str

    def check(self, spec: LoadSpec) -> None:
        """Raise a typed error now if `spec` cannot be loaded (missing file, not a GGUF, ...)."""

    def weights_key(self, spec: LoadSpec) -> tuple:
        """Specs with the same key share one loaded copy of the weights."""

    def load_weights(self, spec: LoadSpec) -> Weights: ...
    def open(self, weights: Weights, spec: LoadSpec) -> Backend: ...

    def kv_bytes(self, weights: Weights, spec: LoadSpec) -> int:
        """Memory the backend's caches take for this spec (for the store's budget)."""

    def file_bytes(self, spec: LoadSpec) -> int:
        """Estimated memory of the weights before loading them (for the store's budget)."""


class DecodeFailed(RuntimeError):
    """The engine could not decode a batch: the jobs in it fail. With `fatal`, the engine's state is
    not to be trusted any more (a device error): the model is closed and loads again on next use."""

    def __init__(self, message: str, fatal: bool = False):
        super().__init__(message)
        self.fatal = fatal


_engines: dict[str, Engine] = {}
_lock = threading.Lock()


def register_engine(scheme: str, engine: Engine) -> None:
    """Route model references `SCHEME://...` to `engine`."""
    with _lock:
        _engines[scheme.lower()] = engine


def unregister_engine(scheme: str) -> None:
    with _lock:
        _engines.pop(scheme.lower(), None)


def scheme_of(ref: str) -> str | None:
    """The registered scheme a model reference starts with, or None (a path)."""
    head, sep, _ = str(ref).partition("://")
    if sep and head.lower() in _engines:
        return head.lower()
    return None


def engine_for(ref: str) -> Engine:
    """The engine that serves model reference `ref` (a path: the in-process llama.cpp engine)."""
    scheme = scheme_of(ref)
    if scheme is not None:
        return _engines[scheme]
    from .llama import ENGINE

    return ENGINE
