"""The Runtime: the one object nodes, the language server and the CLI talk to.

It resolves model references, owns the model store, turns a caller's arguments into a
`GenerationRequest` (requests.py) and hands it to the loaded model (engine.py's `Model`), whatever
engine runs it. Callers see the Runtime, requests and streams, and of a loaded model only the
request-level Model interface and its engine-neutral `info` (ModelInfo): never llama.cpp.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from . import chat as chatmod
from .engine import Embedded, Model, engine_for, scheme_of
from .errors import InvalidRequest, ModelUnloaded
from .generation import ConfidenceConfig, GenerationResult, PRIORITY_BATCH, SamplingParams, TokenEvent
from .stream import GenerationStream
from .models.locate import resolve_model
from .options import NORMALIZE, POOLING, LoadSpec, parse_speculative
from .requests import (DEFAULT_MAX_TOKENS, PROMPT_TYPES, ChatPrompt, GenerationRequest, Prompt, TextPrompt,
                       TokenPrompt, check_text, embed_texts)
from .models.store import ModelStore

log = logging.getLogger("a3b")

#: GenerationRequest fields `Runtime.request` passes on by name
THINKING_FIELDS = frozenset({"thinking", "reasoning_budget", "max_total_tokens", "json_schema", "grammar", "abandoned",
                             "speculative", "draft_max", "n_indent"})


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
        if isinstance(options.get("speculative"), str):
            options["speculative"] = _draft_resolved(options["speculative"], restrict)
        if isinstance(model, LoadSpec):
            spec = replace(model, **options) if options else model
            spec.validate()
            return spec
        if model is not None and scheme_of(str(model)) is not None:
            path = str(model)   # a registered engine's URL (engine.py): not a file
            engine_for(path).check_reference(path, restrict)
        else:
            path = str(resolve_model(model, restrict=restrict))
        spec = LoadSpec(path=path, **options)
        spec.validate()
        return spec

    def load(self, model: str | os.PathLike | LoadSpec | None = None, **options: Any) -> Model:
        return self.store.get(self.spec(model, **options))

    def gpu_available(self, model: str | LoadSpec | None = None) -> bool:
        """Whether the engine of `model` (default: the local llama.cpp one) can use a GPU here."""
        engine = engine_for(model.path if isinstance(model, LoadSpec) else str(model or ""))
        return bool(engine.gpus())

    def estimate_gpu_bytes(self, model: LoadSpec) -> int:
        """GPU memory `model` would take fully offloaded (0 for engines that do not say)."""
        return int(engine_for(model.path).gpu_bytes(model))

    def loaded(self, model: LoadSpec) -> Model | None:
        """The model loaded for `model` if it is loaded now (never loads)."""
        return self.store.peek(model)

    def unload(self, model: LoadSpec | None = None) -> int:
        return self.store.unload(model)

    def _with_model(self, model, fn: Callable[[Model], Any]) -> Any:
        """fn(loaded model), loading it first; once more if an unload races the call (the weights
        refuse use once they are being freed, so the second attempt reloads them)."""
        try:
            return fn(self.load(model))
        except ModelUnloaded:
            return fn(self.load(model))

    def count_tokens(self, prompt: Prompt, *, model: str | LoadSpec | None = None, exact: bool = True) -> int:
        """The prompt tokens `prompt` takes on `model` (for budgets; see Model.count_tokens)."""
        return self._with_model(model, lambda m: m.count_tokens(prompt, exact=exact))

    def tokenize(self, text: str, *, model: str | LoadSpec | None = None, add_bos: bool = False,
                 special: bool = False) -> list[int]:
        return self._with_model(model, lambda m: m.tokenize(text, add_bos=add_bos, special=special))

    # -- generation ----------------------------------------------------------------------------
    @staticmethod
    def request(prompt: str | Prompt = "", *, system: str | None = None,
                messages: Sequence[Mapping[str, str]] | None = None, chat: bool = True, template: str | None = None,
                variables: Mapping[str, Any] | None = None, max_tokens: int = DEFAULT_MAX_TOKENS,
                sampling: SamplingParams | None = None, stop: Sequence[str] = (), priority: int = PRIORITY_BATCH,
                confidence: ConfidenceConfig | None = None, prompt_tokens: Sequence[int] | None = None,
                logprobs: int | None = None, tools: Sequence[dict] = (), images: Sequence[Any] = (),
                **thinking: Any) -> GenerationRequest:
        """A GenerationRequest from the conveniences callers use: a typed prompt as it is; else token
        ids (`prompt_tokens`), chat `messages`, or `prompt` text, which `chat` (the default) sends as
        one user message after `system` (with `images`, ImageParts, before its text), and chat=False
        as plain text to continue. `thinking` holds
        the request's other fields by name (thinking, reasoning_budget, max_total_tokens,
        json_schema, grammar, speculative, draft_max)."""
        unknown = set(thinking) - THINKING_FIELDS
        if unknown:
            raise InvalidRequest(f"Unknown request setting(s): {', '.join(sorted(unknown))}.")
        images = tuple(images or ())
        if images and (not chat or messages is not None or isinstance(prompt, PROMPT_TYPES)
                       or prompt_tokens is not None):
            raise InvalidRequest("Images go with a chat prompt given as text (chat=True); in chat messages or a "
                                 "ChatPrompt, put them in a message's content parts instead.")
        if isinstance(prompt, PROMPT_TYPES):
            if system or messages is not None or prompt_tokens is not None or template or variables or tools:
                raise InvalidRequest("A typed prompt carries its own messages, template and variables: give them "
                                     "there, not beside it.")
            p = prompt
        elif prompt_tokens is not None:
            p = TokenPrompt(tuple(prompt_tokens))
        elif chat:
            for what, text in (("The prompt", prompt), ("The system prompt", system)):
                if isinstance(text, str):
                    check_text(what, text)
            if messages is None:
                if not isinstance(prompt, str) or not prompt.strip():
                    raise InvalidRequest("The prompt is empty; give some text to answer.")
                messages = chatmod.messages(prompt, system)
                if images:
                    messages[-1] = {**messages[-1], "content": (*images, messages[-1]["content"])}
            p = ChatPrompt(tuple(dict(m) if isinstance(m, Mapping) else m for m in messages), template=template or None,
                           variables=variables or {}, tools=tuple(tools))
        else:
            if system or variables or tools:
                raise InvalidRequest("A system prompt, template variables and tools need chat mode (chat=True).")
            p = TextPrompt(prompt)
        return GenerationRequest(prompt=p, max_tokens=max_tokens, sampling=sampling or SamplingParams(),
                                 stop=tuple(stop), priority=priority, confidence=confidence or ConfidenceConfig(),
                                 logprobs=logprobs, **{k: v for k, v in thinking.items() if v is not None})

    def submit(self, prompt: str | Prompt | GenerationRequest = "", *, model: str | LoadSpec | None = None,
               on_token: Callable[[TokenEvent], None] | None = None, **kwargs: Any) -> GenerationStream:
        """Start a generation and return its stream (iterate it, or call .result()). `prompt` is a
        GenerationRequest, or a prompt (typed, or text) with the keyword arguments of `request`."""
        if isinstance(prompt, GenerationRequest):
            if kwargs:
                raise InvalidRequest("A GenerationRequest carries its own settings; got "
                                     f"{', '.join(kwargs)} beside it.")
            req = prompt
        else:
            req = self.request(prompt, **kwargs)
        return self._with_model(model, lambda m: m.submit(req, on_token=on_token))

    def generate(self, prompt: str | Prompt | GenerationRequest = "", **kwargs: Any) -> GenerationResult:
        """Blocking generation; see `submit` for the arguments."""
        return self.submit(prompt, **kwargs).result()

    # -- embeddings ----------------------------------------------------------------------------
    def embed(self, texts: Iterable[str], *, model: str | LoadSpec | None = None, pooling: str = POOLING.default,
              normalize: bool = NORMALIZE.default, priority: int = PRIORITY_BATCH,
              cancelled: Callable[[], bool] | None = None) -> np.ndarray:
        """Pooled embeddings of `texts`, one row each. `cancelled` is polled between small packs of
        texts; once true, the call raises Cancelled."""
        return self.embed_counted(texts, model=model, pooling=pooling, normalize=normalize, priority=priority,
                                  cancelled=cancelled).vectors

    def embed_counted(self, texts: Iterable[str], *, model: str | LoadSpec | None = None,
                      pooling: str = POOLING.default, normalize: bool = NORMALIZE.default,
                      priority: int = PRIORITY_BATCH, cancelled: Callable[[], bool] | None = None) -> Embedded:
        """`embed`, with the input tokens the texts took as the engine counted them (an API's usage)."""
        texts = embed_texts(texts, pooling)
        return self._with_model(model, lambda m: m.embed(texts, pooling=pooling, normalize=normalize,
                                                         priority=priority, cancelled=cancelled))

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
                "n_gpu_layers": m.info.n_gpu_layers, "offload": m.info.offload, "placement": m.info.placement,
                "spec": e.spec.as_dict(), "weights_bytes": m.info.size_bytes, "kv_bytes": e.est_bytes,
                "busy": m.busy(), "stats": dict(m.stats), "warnings": e.warnings,
                "loaded_at": e.loaded_at, **({"features": m.features} if m.features else {}),
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


def _draft_resolved(speculative: str, restrict: bool) -> str:
    """`speculative` with a draft model's name resolved to its file, as the target's name is."""
    mode, name = parse_speculative(speculative)
    if mode != "draft":
        return speculative
    if scheme_of(name) is not None:   # another engine's model (the fake engine's in tests)
        engine_for(name).check_reference(name, restrict)
        return f"draft:{name}"
    return f"draft:{resolve_model(name, restrict=restrict)}"


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
