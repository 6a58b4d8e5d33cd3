"""The engine seam: the request-level `Model` every caller talks to, the `Engine` that opens one, and
how an engine is chosen for a model reference.

* `Model` is a loaded model as the runtime's callers see it: it takes a `GenerationRequest`
  (requests.py: a typed prompt, sampling, stop strings, priority, confidence, logprobs) and returns
  a `GenerationStream`; it embeds texts and counts tokens for budgets. Both engines implement it:
  worker.LoadedModel for models run in this process (token by token, over a `Backend`), and
  remote.RemoteModel for a model behind an OpenAI-compatible server (requests sent as they are).
* `Engine` checks and loads **weights** for a `LoadSpec` (once per file and weight options; the
  store shares them between specs) and opens a `Model` over them (`open_model`, the one way to get
  one). `prepare` (slow work before the store takes its lock) and `check_reference` (which model
  references network callers may use) have defaults that do nothing.
* `Vocab` is a model's tokenizer as the in-process engines and the prompt builders use it; below
  `Model`, the in-process engine's own seam (`Backend`: contexts that trim, decode, sample and
  embed, driven by LoadedModel's one worker thread) is local/seam.py.

The engine for file paths (in-process llama.cpp, runtime/llama/) is set by the runtime package
(`set_default_engine`), so this module imports no engine. Other engines register a URL scheme
(`register_engine("fake", engine)`, then `rt.spec("fake://tiny")`): the remote engine takes
http(s), and the fast test tier runs the real runtime over a small fake engine this way, as
simonw/llm's tests register a mock model.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # pragma: no cover
    import collections

    import numpy as np

    from .generation import TokenEvent
    from .stream import GenerationStream
    from .options import LoadSpec
    from .requests import GenerationRequest, Prompt


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
    n_cpu_moe: int = 0            # layers whose expert (or FFN) tensors stay in main memory, as loaded
    #: the placement plan: what went where, memory expected and measured (runtime/llama/planner.py)
    placement: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Embedded:
    """Pooled embeddings, one row per text, and the input tokens they took (what an API reports as
    its usage): counted by the engine that embedded them, so no caller tokenizes the texts again."""

    vectors: np.ndarray
    n_tokens: int


class Weights(Protocol):
    """What an engine loaded for a file (or found out about a server), shared between specs."""

    info: ModelInfo
    size_bytes: int

    def free(self) -> None: ...


class Model(Protocol):
    """A loaded model, whatever runs it: what the store hands out and every caller uses.

    Any thread may call it. `submit` checks the request and returns at once; the answer streams.
    """

    info: ModelInfo
    spec: LoadSpec
    name: str
    #: tokens one request holds (prompt + answer)
    n_ctx_seq: int
    stats: collections.Counter
    #: set once the model has stopped (after close)
    closed: threading.Event
    #: time.monotonic() of the last request's end
    last_used: float
    #: what the engine found it can do beyond the basics, for the status (empty where nothing to say)
    features: dict[str, Any]
    #: run in this process, token by token over a Backend (a draft model must be such a model)
    runs_here: bool = False
    #: what it drafts with under speculative=draft or mtp (draftmodel.py), attached as its engine opened it
    draft_source: Any = None

    @property
    def alive(self) -> bool:
        """Not closed nor closing: requests are taken."""

    @property
    def supports_fim(self) -> bool:
        """An InfillPrompt reaches the model as fill-in-the-middle (else it completes the prefix)."""

    def submit(self, request: GenerationRequest,
               on_token: Callable[[TokenEvent], None] | None = None) -> GenerationStream:
        """Start a generation; InvalidRequest or PromptTooLong now when it cannot run."""

    def embed(self, texts: Sequence[str], *, pooling: str = "mean", normalize: bool = True, priority: int = 0,
              cancelled: Callable[[], bool] | None = None) -> Embedded:
        """Pooled embeddings, one row per text, with the tokens they took. `cancelled` is polled
        between small packs of texts: once it turns true the call raises Cancelled without embedding
        the rest."""

    def count_tokens(self, prompt: Prompt, *, exact: bool = True) -> int:
        """The prompt tokens `prompt` takes, for budgets. With exact=False an engine may estimate
        instead of asking someone (a remote server): for callers on an event loop."""

    def tokenize(self, text: str, *, add_bos: bool = False, special: bool = False) -> list[int]:
        """`text` as token ids of the model's own vocabulary."""

    def busy(self) -> bool:
        """Requests are running or waiting."""

    def wake(self) -> None:
        """Re-check cancellations now (a caller cancelled a request that is still waiting)."""

    def close(self, reason: str = "unloaded", wait: bool = True) -> None:
        """Stop taking requests; running ones end with ModelUnloaded (and the text so far)."""


@runtime_checkable
class Engine(Protocol):
    """What runs models: engines subclass this. The last four steps are optional (their defaults do
    nothing); the others each engine gives."""

    name: str

    def check(self, spec: LoadSpec) -> None:
        """Raise a typed error now if `spec` cannot be loaded (missing file, not a GGUF, ...)."""
        raise NotImplementedError

    def weights_key(self, spec: LoadSpec) -> tuple:
        """Specs with the same key share one loaded copy of the weights."""
        raise NotImplementedError

    def load_weights(self, spec: LoadSpec) -> Weights:
        """Load (or find out about) what `spec` names; the store shares it between specs of one key."""
        raise NotImplementedError

    def open_model(self, weights: Weights, spec: LoadSpec, models: Callable[[LoadSpec], Model]) -> Model:
        """The model for `spec` over loaded `weights` (the one way to get a Model). `models` gets
        another model through the model store (an entry of its own there, as a draft model that
        this one drafts with is): an engine that speculates attaches its drafts as it opens a model,
        and raises InvalidRequest (closing what it opened) when `spec` asks drafts it cannot make."""
        raise NotImplementedError

    def kv_bytes(self, weights: Weights, spec: LoadSpec) -> int:
        """Memory the model's caches take for this spec (for the store's budget)."""
        raise NotImplementedError

    def file_bytes(self, spec: LoadSpec) -> int:
        """Estimated memory of the weights before loading them (for the store's budget)."""
        raise NotImplementedError

    def prepare(self, spec: LoadSpec) -> None:
        """Slow work before a load (a remote server's answers), which the store runs without holding
        its lock: network I/O there would stall every other load in the process."""

    def check_reference(self, ref: str, restrict: bool) -> None:
        """Raise a typed error if model reference `ref` (of this engine's scheme) may not be used;
        `restrict`: it arrived over a network API (a workflow, an editor's settings)."""

    def gpus(self) -> list:
        """The GPUs this engine can use here (none by default)."""
        return []

    def gpu_bytes(self, spec: LoadSpec) -> int:
        """GPU memory `spec` would take fully offloaded (0: the engine does not say)."""
        return 0

    def smaller_placement(self, spec: LoadSpec, info: ModelInfo, nbytes: int) -> int | None:
        """A device-memory cap under which `spec` loads again holding at least `nbytes` less than
        it does now (`info`: as loaded), or None: this engine cannot place it otherwise."""
        return None


# -- a model's tokenizer (the in-process engines, the prompt builders) ---------------------------------
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


_engines: dict[str, Engine] = {}
_default: list[Engine] = []
_lock = threading.Lock()


def _checked(engine: Engine) -> Engine:
    if not isinstance(engine, Engine):
        raise TypeError(f"{engine!r} is not an Engine: subclass runtime.engine.Engine (it has the optional steps).")
    return engine


def register_engine(scheme: str, engine: Engine) -> None:
    """Route model references `SCHEME://...` to `engine`."""
    with _lock:
        _engines[scheme.lower()] = _checked(engine)


def unregister_engine(scheme: str) -> None:
    with _lock:
        _engines.pop(scheme.lower(), None)


def set_default_engine(engine: Engine) -> None:
    """The engine for model references that are file paths (the runtime package sets llama.cpp's)."""
    with _lock:
        _default[:] = [_checked(engine)]


def scheme_of(ref: str) -> str | None:
    """The registered scheme a model reference starts with, or None (a path)."""
    head, sep, _ = str(ref).partition("://")
    if sep and head.lower() in _engines:
        return head.lower()
    return None


def engine_for(ref: str) -> Engine:
    """The engine that serves model reference `ref` (a path: the default engine)."""
    scheme = scheme_of(ref)
    if scheme is not None:
        return _engines[scheme]
    if not _default:
        raise RuntimeError("No engine for model files: import the runtime package (it sets llama.cpp's).")
    return _default[0]
