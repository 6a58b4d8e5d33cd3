"""The Runtime: the one object nodes, the language server and the CLI talk to.

It resolves model references, owns the model store, renders chat prompts, and hands requests to
the loaded model's worker. Callers see the Runtime, requests and streams, and of a loaded model only
its engine-neutral `info` (ModelInfo) and `vocab` (tokenizer): never llama.cpp.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from . import chat as chatmod
from .errors import InvalidRequest
from .generation import (ConfidenceConfig, GenerationRequest, GenerationResult, GenerationStream,
                         PRIORITY_BATCH, SamplingParams, TokenEvent)
from .engine import engine_for, scheme_of
from .errors import ModelUnloaded
from .worker import LoadedModel
from .locate import resolve_model
from .options import LoadSpec
from .store import ModelStore

log = logging.getLogger("a3b")


class Runtime:
    def __init__(self, budget_bytes: int | None = None):
        self.store = ModelStore(budget_bytes)
        self.created = time.time()
        self.pid = os.getpid()
        #: Extra status providers (the in-process language server registers one).
        self.status_providers: dict[str, Callable[[], Any]] = {}
        self._latency_lock = threading.Lock()

    # -- models --------------------------------------------------------------------------------
    def spec(self, model: str | os.PathLike | LoadSpec | None = None, *, restrict: bool = False,
             **options: Any) -> LoadSpec:
        """A LoadSpec for a model reference (path, name in a model folder, or None = default)."""
        options = {k: v for k, v in options.items() if v is not None}
        if isinstance(model, LoadSpec):
            spec = replace(model, **options) if options else model
            spec.validate()
            return spec
        if model is not None and scheme_of(str(model)) is not None:
            path = str(model)   # a registered engine's URL (engine.py): not a file
            check = getattr(engine_for(path), "check_reference", None)
            if check is not None:
                check(path, restrict)
        else:
            path = str(resolve_model(model, restrict=restrict))
        spec = LoadSpec(path=path, **options)
        spec.validate()
        return spec

    def load(self, model: str | os.PathLike | LoadSpec | None = None, **options: Any) -> LoadedModel:
        return self.store.get(self.spec(model, **options))

    def gpu_available(self, model: str | LoadSpec | None = None) -> bool:
        """Whether the engine of `model` (default: the local llama.cpp one) can use a GPU here."""
        engine = engine_for(model.path if isinstance(model, LoadSpec) else str(model or ""))
        return bool(getattr(engine, "gpus", lambda: [])())

    def estimate_gpu_bytes(self, model: LoadSpec) -> int:
        """GPU memory `model` would take fully offloaded (0 for engines that do not say)."""
        fn = getattr(engine_for(model.path), "gpu_bytes", None)
        return int(fn(model)) if fn else 0

    def loaded(self, model: LoadSpec) -> LoadedModel | None:
        """The model loaded for `model` if it is loaded now (never loads)."""
        return self.store.peek(model)

    def unload(self, model: LoadSpec | None = None) -> int:
        return self.store.unload(model)

    def _with_model(self, model, fn: Callable[[LoadedModel], Any]) -> Any:
        """fn(loaded model), loading it first; once more if an unload races the call (the weights
        refuse use once they are being freed, so the second attempt reloads them)."""
        try:
            return fn(self.load(model))
        except ModelUnloaded:
            return fn(self.load(model))

    def chat_tokens(self, messages: list[dict[str, str]], *, model: str | LoadSpec | None = None,
                    template: str | None = None) -> list[int]:
        """The prompt tokens of chat `messages` as `submit` would feed them (for budgets)."""
        def run(m: LoadedModel) -> list[int]:
            return m.vocab.tokenize(self.render_chat(m, messages, template), add_bos=m.vocab.add_bos, special=True)
        return self._with_model(model, run)

    def tokenize(self, text: str, *, model: str | LoadSpec | None = None, add_bos: bool = False,
                 special: bool = False) -> list[int]:
        return self._with_model(model, lambda m: m.vocab.tokenize(text, add_bos=add_bos, special=special))

    # -- generation ----------------------------------------------------------------------------
    def render_chat(self, model: LoadedModel, msgs: list[dict[str, str]], template: str | None = None) -> str:
        """Chat messages as the prompt text the model expects (its own template, or a named one)."""
        own = getattr(model, "render_chat", None)   # an engine that applies chat templates itself
        if own is not None:
            return own(msgs, template)
        v = model.vocab
        return chatmod.render(msgs, gguf_template=model.info.chat_template, template=template,
                              bos=v.token_text(v.bos) if v.bos >= 0 else "",
                              eos=v.token_text(v.eos) if v.eos >= 0 else "", tokenizer_adds_bos=v.add_bos)

    def submit(self, prompt: str = "", *, model: str | LoadSpec | None = None, system: str | None = None,
               messages: list[dict[str, str]] | None = None, chat: bool = True, template: str | None = None,
               max_tokens: int = 512, sampling: SamplingParams | None = None, stop: Sequence[str] = (),
               priority: int = PRIORITY_BATCH, confidence: ConfidenceConfig | None = None,
               prompt_tokens: list[int] | None = None, logprobs: int | None = None,
               on_token: Callable[[TokenEvent], None] | None = None) -> GenerationStream:
        """Start a generation and return its stream (iterate it, or call .result())."""
        return self._with_model(model, lambda m: self._submit(
            m, prompt, system=system, messages=messages, chat=chat, template=template, max_tokens=max_tokens,
            sampling=sampling, stop=stop, priority=priority, confidence=confidence, prompt_tokens=prompt_tokens,
            logprobs=logprobs, on_token=on_token))

    def _submit(self, m: LoadedModel, prompt: str, *, system, messages, chat, template, max_tokens, sampling,
                stop, priority, confidence, prompt_tokens, logprobs, on_token) -> GenerationStream:
        for what, text in (("The prompt", prompt), ("The system prompt", system),
                           *((f"Message #{i}", msg.get("content")) for i, msg in enumerate(messages or [])
                             if isinstance(msg, dict))):
            if isinstance(text, str):
                check_text(what, text)
        if prompt_tokens is None:
            if chat:
                if messages is None:
                    if not prompt or not prompt.strip():
                        raise InvalidRequest("The prompt is empty; give some text to answer.")
                    messages = chatmod.messages(prompt, system)
                text = self.render_chat(m, messages, template)
            else:
                if system:
                    raise InvalidRequest("A system prompt needs chat mode (chat=True).")
                text = prompt
        else:
            text = ""
        req = GenerationRequest(prompt=text, max_tokens=max_tokens, sampling=sampling or SamplingParams(),
                                stop=tuple(stop), priority=priority,
                                confidence=confidence or ConfidenceConfig(), prompt_tokens=prompt_tokens,
                                logprobs=logprobs)
        return m.submit(req, on_token=on_token)

    def generate(self, prompt: str = "", **kwargs: Any) -> GenerationResult:
        """Blocking generation; see `submit` for the arguments."""
        return self.submit(prompt, **kwargs).result()

    # -- embeddings ----------------------------------------------------------------------------
    def embed(self, texts: Iterable[str], *, model: str | LoadSpec | None = None, pooling: str = "mean",
              normalize: bool = True, priority: int = PRIORITY_BATCH,
              cancelled: Callable[[], bool] | None = None) -> np.ndarray:
        """Pooled embeddings of `texts`, one row each. `cancelled` is polled between small packs of
        texts; once true, the call raises Cancelled."""
        texts = list(texts)
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise InvalidRequest(f"Item #{i} to embed is a {type(t).__name__}, not text.")
            check_text(f"Item #{i} to embed", t)
        if not texts:
            raise InvalidRequest("Nothing to embed: give at least one text.")

        def run(m: LoadedModel) -> np.ndarray:
            toks = [m.vocab.tokenize(t, add_bos=m.vocab.add_bos, special=False) for t in texts]
            return m.embed_tokens(toks, pooling=pooling, normalize=normalize, priority=priority,
                                  cancelled=cancelled)
        return self._with_model(model, run)

    # -- status --------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        from .llama.binding import llama_cpp_version

        try:
            import psutil

            rss = psutil.Process().memory_info().rss
        except Exception:  # noqa: BLE001 - psutil is optional and a status report must never fail
            rss = None
        models = []
        for e in self.store.loaded():
            m = e.model
            models.append({
                "name": m.name, "path": e.spec.path, "architecture": m.info.architecture, "engine": m.info.engine,
                "file_type": m.info.file_type, "served_file": m.info.path, "n_ctx_train": m.info.n_ctx_train,
                "n_gpu_layers": m.info.n_gpu_layers, "offload": m.info.offload,
                "spec": e.spec.as_dict(), "weights_bytes": m.info.size_bytes, "kv_bytes": e.est_bytes,
                "busy": m.busy(), "stats": dict(m.stats), "warnings": e.warnings,
                "loaded_at": e.loaded_at, **({"features": m.features} if hasattr(m, "features") else {}),
            })
        out = {
            "pid": self.pid, "llama_cpp_python": llama_cpp_version(), "rss_bytes": rss,
            "memory_bytes": self.store.memory_bytes(), "budget_bytes": self.store.budget_bytes,
            "weight_loads": self.store.weight_loads, "cache_hits": self.store.hits,
            "evictions": self.store.evictions, "models": models,
        }
        for name, fn in list(self.status_providers.items()):
            try:
                out[name] = fn()
            except Exception as e:  # noqa: BLE001 - a broken status provider must not fail the status report
                out[name] = {"error": str(e)}
        return out


def check_text(what: str, text: str) -> None:
    """InvalidRequest for text that is not valid Unicode (a lone surrogate, as a UTF-16 client or a
    careless decoder can produce), instead of a UnicodeEncodeError from deep inside tokenization."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequest(f"{what} is not valid Unicode: {e.reason} at character {e.start} "
                             f"({text[max(0, e.start - 20):e.start]!r} ...). "
                             "Remove or replace that character.") from None


_runtime: Runtime | None = None
_runtime_lock = threading.Lock()


def get_runtime() -> Runtime:
    """The process's one Runtime (created on first use)."""
    global _runtime
    if _runtime is None:
        with _runtime_lock:
            if _runtime is None:
                _runtime = Runtime()
    return _runtime
