"""The handle of a submitted generation (GenerationStream): iterate it for TokenEvents, wait for its
GenerationResult, cancel it from any thread. Both engines feed it (`_emit`, `_conclude`); apart
from generation.py because it holds the request (requests.py), which generation.py's types make up."""
from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from .errors import Cancelled, ModelUnloaded
from .generation import NOT_A_TOKEN, GenerationResult, TokenEvent, cut_by_context
from .requests import GenerationRequest


_ids = itertools.count(1)


class GenerationStream:
    """Handle of a submitted request: iterate for TokenEvents, `result()` for the whole result.

    Any thread may call `cancel()`; the scheduler stops the request between two tokens.
    """

    def __init__(self, request: GenerationRequest, on_token: Callable[[TokenEvent], None] | None = None):
        self.id = next(_ids)
        self.request = request
        self.on_token = on_token
        self.submitted_at = time.perf_counter()
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Event()
        self._cancel = threading.Event()
        self._result: GenerationResult | None = None
        self._error: BaseException | None = None
        self.cancel_reason = "cancelled"
        #: warnings the engine found at submit; the result carries them
        self.warnings: list[str] = []
        self._done_callbacks: list[Callable[[GenerationStream], None]] = []
        self._cancel_callbacks: list[Callable[[], None]] = []
        self._cb_lock = threading.Lock()

    # -- caller side -------------------------------------------------------------------------
    def cancel(self, reason: str = "cancelled") -> None:
        if self._cancel.is_set():
            return
        self.cancel_reason = reason
        self._cancel.set()
        for fn in list(self._cancel_callbacks):
            fn()   # the engine's: it stops the step this request is in, where that step is long

    def add_cancel_callback(self, fn: Callable[[], None]) -> None:
        """Call fn() (on the cancelling thread, which must not wait for it) when the stream is cancelled."""
        self._cancel_callbacks.append(fn)

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def __iter__(self) -> Iterator[TokenEvent]:
        while True:
            ev = self._events.get()
            if ev is None:
                break
            yield ev
        # A cancelled stream just ends (the canceller knows); other errors surface here.
        if self._error is not None and not isinstance(self._error, Cancelled):
            raise self._error

    def add_done_callback(self, fn: Callable[[GenerationStream], None]) -> None:
        """Call fn(stream) once the stream has finished (at once if it has): lets an event loop wait
        for the end without a thread blocked in result()."""
        with self._cb_lock:
            if not self._done.is_set():
                self._done_callbacks.append(fn)
                return
        fn(self)

    def text_chunks(self) -> Iterator[str]:
        for ev in self:
            if ev.text:
                yield ev.text

    def result(self, timeout: float | None = None) -> GenerationResult:
        """Wait for the end. Raises the request's error (Cancelled included)."""
        if not self._done.wait(timeout):
            raise TimeoutError("generation still running")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    # -- scheduler side ------------------------------------------------------------------------
    def _emit(self, ev: TokenEvent) -> None:
        self._events.put(ev)
        if self.on_token is not None:
            try:
                self.on_token(ev)
            except Exception:  # a broken callback must not kill the scheduler
                import logging

                logging.getLogger("a3b").exception("on_token callback failed; cancelling request")
                self.cancel("callback failed")

    def _finish(self, result: GenerationResult | None, error: BaseException | None = None) -> None:
        if self._done.is_set():
            return
        self._result, self._error = result, error
        self._events.put(None)
        with self._cb_lock:
            self._done.set()
            callbacks, self._done_callbacks = self._done_callbacks, []
        for fn in callbacks:
            try:
                fn(self)
            except Exception:
                import logging

                logging.getLogger("a3b").exception("done callback failed")

    def _conclude(self, asm: Any, reason: str, error: BaseException | None, *, model: str,
                  tokens: list[int] | None, n_tokens: int, n_prompt: int, n_cached: int, seed: int,
                  t_first: float | None, t_last: float | None, drafted: int = 0,
                  accepted: int = 0, sampler: str = "") -> GenerationResult:
        """End the stream, for either engine: release the held-back text of both channels (`asm` is
        a reasoning.ChannelAssembler), build the result, and finish with it, or with the error. A
        cancelled request ends with Cancelled (ModelUnloaded when an unload cancelled it), and the
        text so far travels with every error as `.partial`."""
        tail_r, tail = asm.flush()
        if tail or tail_r:
            self._emit(TokenEvent(tail, NOT_A_TOKEN, None, reasoning=tail_r))
        text, spans, reasoning, rspans = asm.final()
        result = GenerationResult(
            text=text, tokens=tokens, finish_reason=reason, n_prompt_tokens=n_prompt, n_cached_prompt_tokens=n_cached,
            seed=seed, spans=spans, entropies=list(asm.entropies),
            time_to_first_token=(t_first - self.submitted_at) if t_first else 0.0,
            total_time=time.perf_counter() - self.submitted_at,
            decode_time=(t_last - t_first) if t_first and t_last else 0.0, n_tokens=n_tokens,
            reasoning=reasoning, reasoning_spans=rspans, n_reasoning_tokens=asm.n_reasoning,
            reasoning_closed_by=asm.closed_by, warnings=list(self.warnings), n_drafted_tokens=drafted,
            n_accepted_tokens=accepted, sampler=sampler,
            context_full=cut_by_context(reason, asm.n_answer, n_tokens, self.request.max_tokens,
                                        self.request.max_total_tokens))
        if reason == "cancelled" and error is None:
            if self.cancel_reason.startswith("unloaded"):
                error = ModelUnloaded(f"{model} was unloaded while this request ran; "
                                      f"{n_tokens} tokens were generated before it stopped.")
            else:
                error = Cancelled(f"Generation cancelled after {n_tokens} tokens.")
        if error is not None:
            error.partial = result   # nothing is lost: the text so far travels with the error
        self._finish(result if error is None else None, error)
        return result
