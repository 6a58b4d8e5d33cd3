"""The in-process engine's seam below `engine.Model`: what LoadedModel's one worker thread asks of
the contexts over a model's weights (`Backend`: trim, decode, sample, embed), the weights with their
vocabulary (`LocalWeights`), and how a decode fails. runtime/llama/backend.py implements it over
llama.cpp; the fast test tier's fake engine (tests/fakeengine.py) implements it in Python."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from ..engine import Vocab, Weights
from ..errors import InvalidRequest

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np

    from ..generation import SamplingParams
    from .scheduler import DecodeStep


class LocalWeights(Weights, Protocol):
    """Weights of a model run in this process: with its vocabulary."""

    vocab: Vocab
    #: multi-token-prediction layers the file carries (0: none)
    n_layer_nextn: int


class Backend(Protocol):
    """Contexts over one model's weights for one LoadSpec. Only the model's worker thread calls it."""

    #: tokens one sequence slot holds (prompt + answer)
    n_ctx_seq: int
    #: an embedding pack holds at most this many tokens (unless one text is longer) and texts
    embed_pack_tokens: int
    embed_pack_texts: int
    #: tokens `trim` can drop from a sequence's end (recurrent layers); None: any number
    max_rollback: int | None = None
    #: the projector that lets the model see images (llama/vision.py), or None
    vision: Any = None
    #: the multi-token-prediction context that drafts from the model's own MTP layers, or None
    mtp: Any = None

    #: whether `move` may be asked (the policy closes holes between running slots: slots.py)
    can_move: bool = False
    #: the engine's count of passes through the model per decode (a diagnostic), or None; given the
    #: model's stats counter in `passes.stats`, it keeps `passes` and `decode_step_passes` there
    passes: Any = None

    def trim(self, seq_id: int, keep: int) -> None:
        """Drop the KV cache of sequence `seq_id` from position `keep` on."""

    def move(self, src: int, dst: int) -> None:
        """Make sequence `dst`'s KV cache a copy of `src`'s (before the next decode)."""

    def interrupt(self, on: bool) -> None:
        """From any thread: with True, the decode running now stops at its next chance and raises
        DecodeAborted (an engine that cannot stop one finishes it); False clears that before a step."""

    def decode(self, step: DecodeStep) -> None:
        """Run one batch; raise DecodeFailed when the engine refuses it."""

    def synchronize(self) -> None:
        """Wait until the last decode is computed (a GPU's queue drained): `decode` may return once
        the work is launched. An engine that decodes before it returns has nothing to wait for."""

    #: whether new_sampler may attach a chain to a sequence, drawn inside the decode (sampler_choice.py)
    backend_sampling: bool = False
    #: whether such a chain can also give each row's entropy (measured where the logits are)
    backend_entropy: bool = False

    def new_sampler(self, sampling: SamplingParams, seed: int, grammar: Any = None,
                    seq_id: int | None = None, entropy: bool = False) -> Any:
        """A request's sampler; with `grammar` (what compile_grammar returned), constrained by it;
        with `seq_id`, attached to that sequence so the next decodes draw its tokens (where the
        engine can: the sampler's `backend`, a bool every sampler has, says), and with `entropy`
        (where backend_entropy) measuring each row's entropy there. Every sampler has `grammar` too:
        None, or the matcher whose `error` (None while it goes on) says why it gave up."""

    def prepare(self, sampler: Any, seq_id: int, backend: bool) -> None:
        """Before a decode with an output row of `seq_id` for `sampler`'s request: a backend sampler
        (`backend`) follows its request there; for a CPU sampler no other chain stays attached
        there (the row's logits come back, not a token drawn by that chain)."""

    def free_sampler(self, sampler: Any) -> None: ...

    def compile_grammar(self, json_schema: Any, gbnf: str | None, abandoned: Any = None) -> Any:
        """The request's grammar for a JSON schema (or GBNF text), compiled within runtime/grammars.py's
        bounds (size, time; `abandoned`, a threading.Event, stops the wait); InvalidRequest when it
        does not compile. Called from the submitting thread, never the worker's."""
        raise InvalidRequest("This engine has no grammar sampler: json_schema and grammar are not supported.")

    def sample_rows(self, rows: list[tuple[Any, int, bool]]) -> list[tuple[int, float | None]]:
        """For each (sampler, row of the last decode's outputs, want entropy): the next token, and
        the Shannon entropy (nats) of the model's raw next-token distribution there (or None)."""

    def logprobs(self, row: int, token: int, n: int) -> tuple[float, list[tuple[int, float]]]:
        """Log-probability of `token` in row `row` of the last decode (softmax of the raw logits),
        and the `n` most likely tokens there with theirs, best first."""

    def embed(self, token_lists: list[list[int]], pooling: str) -> np.ndarray:
        """Pooled, unnormalised embeddings of a pack of texts, one row each."""

    def idle(self) -> None:
        """Work just ended (nothing runnable): let go of what only running work needs (CPU threads)."""

    def close(self) -> None: ...


class DecodeFailed(RuntimeError):
    """The engine could not decode a batch: the jobs in it fail. With `fatal`, the engine's state is
    not to be trusted any more (a device error): the model is closed and loads again on next use."""

    def __init__(self, message: str, fatal: bool = False):
        super().__init__(message)
        self.fatal = fatal


class DecodeAborted(DecodeFailed):
    """The decode stopped because `Backend.interrupt` asked: nothing of the step stays in the cache
    (the engine trimmed every entry back to where it began), and the step runs again without the
    requests that were cancelled."""
