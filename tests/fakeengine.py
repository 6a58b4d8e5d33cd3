"""A small fake engine at the runtime's engine seam (runtime/engine.py), for the fast test tier.

Its `open_model` returns the real in-process Model, worker.LoadedModel, over a fake Backend, so
everything above the backend is real: the Runtime, the model store, the worker thread, the
scheduling policy, prompt rendering (chat templates, fill-in-the-middle), streams, stop strings,
confidence spans, the nodes and the language server. Only the model is fake: a byte-level
vocabulary and a deterministic "language model" whose next token is a function of the sequence so
far, so tests know exactly what a request must produce.

The fake also checks the worker's bookkeeping: every decode must continue each sequence's KV cache
exactly where it stands (no gap, no overlap), and sampling reads the logits of the rows the step
asked for, as llama.cpp would.

Model references (`fake://NAME?...`) and the fake model itself: fakemodel.py.
"""
from __future__ import annotations

import hashlib
import random
import threading
import time
from dataclasses import dataclass, field, replace

import numpy as np

from comfyui_a3b.runtime.engine import Engine, register_engine
from comfyui_a3b.runtime.local.seam import Backend, DecodeAborted, DecodeFailed
from comfyui_a3b.runtime.grammars import check_size, compile_bounded
from comfyui_a3b.runtime.llama.grammar import check_text, grammar_text
from comfyui_a3b.runtime.local.worker import LoadedModel

import templates

from fakemodel import (BOS, CHATML, DEFAULT_TEXT, EOS, EOT, FIM_MID, FIM_PRE, FIM_SUF, N_EMBD,  # noqa: F401
                       N_VOCAB, OFFSET, SPECIALS, FakeChunk, FakeSettings, FakeVision, FakeVocab, FakeWeights)


class FakeGrammarState:
    """What the worker reads of a failed grammar (llama/grammar.py's Grammar.error)."""

    def __init__(self, error: str):
        self.error = error


class FakeSampler(dict):
    """A fake request's sampler: its state by key; `grammar` (an attribute, as the real Sampler's)
    holds a failed grammar's state."""

    grammar: FakeGrammarState | None = None

    @property
    def backend(self) -> bool:
        """Whether its chain is attached to a sequence (sampled on the backend)."""
        return self["seq_id"] is not None


def equal_split_passes(seqs: list[int], n_ubatch: int) -> int:
    """Micro-batches llama.cpp cuts a batch into when every sequence has a KV stream of its own: its
    `llama_batch_allocr::split_equal(n_ubatch, sequential=true)`, for a batch whose token i belongs
    to sequence seqs[i]. Each micro-batch takes sequences in batch order whose ids follow the first
    one's by one (0, 1, 2, ...), and the same number of tokens from each."""
    used = [False] * len(seqs)
    passes = 0
    while not all(used):
        chosen: list[int] = []
        for i, s in enumerate(seqs):
            if not used[i] and s not in chosen and (not chosen or s == chosen[-1] + 1):
                chosen.append(s)
                if len(chosen) > n_ubatch:
                    break
        left = {s: [i for i, t in enumerate(seqs) if t == s and not used[i]] for s in chosen}
        per_seq = 0
        while all(per_seq < len(v) for v in left.values()):
            for v in left.values():
                used[v[per_seq]] = True
            per_seq += 1
            if (per_seq + 1) * len(chosen) > n_ubatch:
                break
        passes += 1
    return passes


class FakeBackend(Backend):
    """Decodes by bookkeeping: the KV cache is the list of tokens each sequence holds."""

    embed_pack_tokens = 32
    embed_pack_texts = 8

    def __init__(self, weights: FakeWeights, spec, decode_counter: dict | None = None):
        self.weights = weights
        self.decode_counter = decode_counter if decode_counter is not None else {}
        self.path = spec.path
        self.settings = weights.settings
        self.n_ctx_seq = spec.n_ctx
        self.kv: dict[int, list[int]] = {i: [] for i in range(spec.n_parallel)}
        self.rows: dict[int, list[int]] = {}
        self.decodes = 0
        self.batch_sizes: list[int] = []
        self.embedded: list[list[int]] = []
        #: the text each request had generated when its grammar came into the sampler chain
        self.grammar_starts: list[str] = []
        #: seconds each grammar compilation sleeps first (a slow compilation, for the bounds tests)
        self.compile_delay = 0.0
        #: (exception name, when) of each compilation that failed
        self.compile_errors: list[tuple[str, float]] = []
        self.closed = False
        self.thread: threading.Thread | None = None
        self.vision = FakeVision(weights.vocab, self.settings) if self.settings.vision else None
        #: unit entries decoded: (seq_id, start, digest)
        self.images_decoded: list[tuple[int, int, str]] = []
        self.backend_sampling = self.settings.backend_sampling
        self.backend_entropy = self.settings.backend_entropy
        #: seq_id -> the sampler attached there, as llama.cpp keeps it; every attach, in order
        self.attached: dict[int, dict] = {}
        self.attaches: list[int] = []
        self.prepares: list[tuple[int, bool]] = []   # (sequence, backend) before each output row's decode
        self.can_move = self.settings.move
        self._interrupt = False
        self.aborted = 0
        self.moved: list[tuple[int, int]] = []
        self.n_ubatch = max(spec.n_batch, spec.n_parallel)
        #: micro-batches llama.cpp would cut each text decode into (equal_split_passes)
        self.split_passes: list[int] = []
        self.passes = None   # no pass counter of llama.cpp's own

    def _same_thread(self) -> None:
        # the worker thread is the only caller of a backend: fail loudly otherwise
        if self.thread is None:
            self.thread = threading.current_thread()
        assert threading.current_thread() is self.thread, "a backend was called from two threads"

    def trim(self, seq_id: int, keep: int) -> None:
        self._same_thread()
        del self.kv[seq_id][keep:]

    def move(self, src: int, dst: int) -> None:
        self._same_thread()
        assert self.can_move, "a slot moved on a backend that cannot copy one"
        assert src != dst
        self.kv[dst] = list(self.kv[src])
        self.moved.append((src, dst))

    def interrupt(self, on: bool) -> None:
        self._interrupt = on

    def decode(self, step) -> None:
        self._same_thread()
        self.decodes += 1
        self.decode_counter[self.path] = self.decode_counter.get(self.path, 0) + 1
        if self.settings.delay_ms:   # a slow step, which an interrupt stops (nothing of it is kept)
            end = time.monotonic() + self.settings.delay_ms / 1000.0 * (
                self.settings.prompt_factor if any(e.count > 1 for e in step.entries) else 1)
            while time.monotonic() < end:
                if self._interrupt:
                    self.aborted += 1
                    raise DecodeAborted("interrupted")
                time.sleep(min(0.005, max(0.0, end - time.monotonic())))
        if self.settings.fail_decode == self.decode_counter[self.path]:
            raise DecodeFailed("fake decode failure", fatal=self.settings.fatal)
        self.batch_sizes.append(step.n_tokens)
        seqs = [e.job.slot.seq_id for e in step.entries if e.unit is None for _ in range(e.count + len(e.draft))]
        if seqs:
            self.split_passes.append(equal_split_passes(seqs, self.n_ubatch))
        self.rows = {}   # batch index -> the sequence's tokens up to it (what its logits depend on)
        self.row_seq: dict[int, int] = {}
        n = 0
        for e in step.entries:
            kv = self.kv[e.job.slot.seq_id]
            assert e.start == len(kv), f"decode at position {e.start} but the sequence holds {len(kv)} tokens"
            assert e.position == e.start, "the fake's images take one position per token"
            kv.extend(e.tokens())
            assert len(kv) <= self.n_ctx_seq, "a sequence outgrew its slot"
            if e.unit is not None:
                assert self.vision is not None and e.unit.digest in self.vision.cache, "an image decoded unencoded"
                assert e.output is None, "an image entry has no logits row"
                assert all(t < 0 for t in e.tokens()), "an image entry over text tokens"
                self.images_decoded.append((e.job.slot.seq_id, e.start, e.unit.digest))
                continue
            assert all(t >= 0 for t in e.tokens()), "a text entry over an image's placeholders"
            n += e.count + len(e.draft)
            if e.output is not None:
                assert e.output == n - 1 - len(e.draft), "an output row that is not the entry's last token"
                for j in range(len(e.draft) + 1):   # the last token's row, then one per drafted token
                    self.rows[e.output + j] = kv[:len(kv) - len(e.draft) + j]
                    self.row_seq[e.output + j] = e.job.slot.seq_id
            else:
                assert not e.draft, "drafts on an entry without an output row"

    def _history(self, row: int) -> list[int]:
        return self.rows[row]   # KeyError: sampling a row the step did not ask logits for

    def new_sampler(self, sampling, seed: int, grammar: str | None = None, seq_id: int | None = None,
                    entropy: bool = False):
        s = FakeSampler(sampling=sampling, rng=random.Random(seed), grammar=grammar, seq_id=None)
        if seq_id is not None:
            assert self.backend_sampling and grammar is None, "a backend chain where the fake has none"
            s["entropy"] = entropy and self.backend_entropy
            self._attach(s, seq_id)
        return s

    def _attach(self, sampler: dict, seq_id: int) -> None:
        old = self.attached.pop(seq_id, None)
        if old is not None and old is not sampler:
            old["seq_id"] = None
        self.attached[seq_id] = sampler
        sampler["seq_id"] = seq_id
        self.attaches.append(seq_id)

    def prepare(self, sampler, seq_id: int, backend: bool) -> None:
        self.prepares.append((seq_id, backend))
        held = self.attached.get(seq_id)
        if not backend and held is not None and held is not sampler:   # a CPU row there: its logits
            del self.attached[seq_id]
            held["seq_id"] = None
        if backend and (sampler["seq_id"] != seq_id or self.attached.get(seq_id) is not sampler):
            if sampler["seq_id"] is not None and self.attached.get(sampler["seq_id"]) is sampler:
                del self.attached[sampler["seq_id"]]
            self._attach(sampler, seq_id)

    def compile_grammar(self, json_schema, gbnf, abandoned=None):
        # the real checks, bounds and compiler (without a vocabulary); the fake model does not follow grammars.
        # `compile_delay` (seconds) stands for a slow compilation
        def work():
            if self.compile_delay:
                time.sleep(self.compile_delay)
            return check_text("json_schema" if json_schema is not None else "grammar", grammar_text(json_schema, gbnf))
        check_size(json_schema, gbnf)
        try:
            return compile_bounded(work, abandoned, "json_schema" if json_schema is not None else "grammar")
        except Exception as e:
            self.compile_errors.append((type(e).__name__, time.monotonic()))
            raise

    def free_sampler(self, sampler) -> None:
        seq = sampler.get("seq_id")
        if seq is not None and self.attached.get(seq) is sampler:
            del self.attached[seq]   # detached before it is freed, as llama.cpp needs
        sampler.clear()

    def _next(self, history: list[int], n_gen: int) -> int:
        s = self.settings
        if s.eos_after is not None and n_gen >= s.eos_after:
            return EOS
        data = s.text.encode("utf-8")
        if s.position:
            return OFFSET + data[len(history) % len(data)]
        if s.think is None:   # images read shift the text: another image, other text
            shift = sum(-t for t in history if t < 0) % len(data)
            return OFFSET + data[(n_gen + shift) % len(data)]
        return OFFSET + self._thinking(self._generated(history), data)

    def _generated(self, history: list[int]) -> bytes:
        """What follows the last generation prompt in `history` (as bytes)."""
        raw = bytes(t - OFFSET for t in history if t >= OFFSET)
        mark = templates.GEN_MARK[self.settings.template]
        at = raw.find(mark, max(raw.rfind(b"user"), 0))   # the first after the last user turn
        return raw[at + len(mark):] if at >= 0 else b""

    def _thinking(self, out: bytes, answer: bytes) -> int:
        """The next byte of a thinking model that has written `out` so far."""
        s = self.settings
        reasoning = s.think.encode("utf-8")
        if s.template == "harmony":
            head, close = b"<|channel|>analysis<|message|>", b"<|end|><|start|>assistant<|channel|>final<|message|>"
        else:
            head, close = b"<think>", b"\n</think>"
        final = b"<|channel|>final<|message|>" if s.template == "harmony" else b"</think>"
        if final in out:   # answering: after the block (and the blank line a <think> model writes)
            tail = out[out.rfind(final) + len(final):]
            lead = b"" if s.template == "harmony" else b"\n\n"
            return lead[len(tail)] if len(tail) < len(lead) else answer[(len(tail) - len(lead)) % len(answer)]
        opened = out.find(head) if s.template == "harmony" else out.find(b"<think>")
        if opened < 0:
            return head[len(out)] if len(out) < len(head) else answer[0]
        tail = out[opened + len(head):]
        body = (b"\n" if s.template != "harmony" else b"") + reasoning
        if s.think_loop:
            return body[len(tail) % len(body)]
        script = body + close
        return script[len(tail)] if len(tail) < len(script) else answer[0]

    def sample_rows(self, rows):
        for s, _, want in rows:   # a backend row has no raw logits: its entropy comes from the chain's taps
            assert not (want and s.get("seq_id") is not None and not s.get("entropy")), \
                "an entropy asked of a backend row whose chain does not measure it"
        return [(self._sample(s, row), self._entropy(row) if want else None) for s, row, want in rows]

    def _sample(self, sampler, row: int) -> int:
        history = self._history(row)
        if sampler.get("seq_id") is not None:   # drawn in the decode: the chain must sit on the row's sequence
            assert self.attached.get(self.row_seq[row]) is sampler, "a backend row without its chain attached"
        if sampler.get("grammar") and not sampler.get("logged"):
            sampler["logged"] = True
            self.grammar_starts.append(self._generated(history).decode("utf-8", "replace"))
        n_gen = sampler.setdefault("n_gen", 0)
        sampler["n_gen"] = n_gen + 1
        if sampler.get("grammar") is not None and self.settings.grammar_fail is not None:
            sampler["n_constrained"] = sampler.get("n_constrained", 0) + 1
            if sampler["n_constrained"] >= self.settings.grammar_fail:
                sampler.grammar = FakeGrammarState("the fake grammar's step limit")
                return EOS
        tok = self._next(history, n_gen)
        sp = sampler["sampling"]
        if sp.ignore_eos and tok in (EOS, EOT):   # the end-of-generation tokens are never drawn
            tok = OFFSET + ord(".")
        if sp.temperature > 0 and tok >= OFFSET and sampler["rng"].random() < min(sp.temperature, 1.0) * 0.5:
            # a "creative" choice: an uppercase letter, chosen by the seeded generator
            tok = OFFSET + ord("A") + sampler["rng"].randrange(26)
        return tok

    def logprobs(self, row: int, token: int, n: int):
        self._history(row)   # KeyError: a row the step did not ask logits for
        alts = [token] + [OFFSET + b for b in b"xyz" if OFFSET + b != token]
        return -0.1, [(t, -0.1 if t == token else -3.0 - i) for i, t in enumerate(alts[:n])]

    def _entropy(self, row: int) -> float:
        # uncertain after a digit, sure otherwise: lets tests place low-confidence spans
        last = self._history(row)[-1]
        return 3.0 if OFFSET + ord("0") <= last <= OFFSET + ord("9") else 0.2

    def embed(self, token_lists: list[list[int]], pooling: str) -> np.ndarray:
        self._same_thread()
        delay = self.settings.delay_ms if self.settings.embed_delay_ms is None else self.settings.embed_delay_ms
        if delay:
            time.sleep(delay / 1000.0)
        self.embedded.extend(token_lists)
        out = np.zeros((len(token_lists), N_EMBD), dtype=np.float32)
        for i, toks in enumerate(token_lists):
            for t in toks:  # a hashed bag of tokens: similar texts get similar vectors
                h = int(hashlib.blake2b(bytes([t % 256, t // 256]), digest_size=2).hexdigest(), 16)
                out[i, h % N_EMBD] += 1.0
            if pooling == "mean":
                out[i] /= max(len(toks), 1)
        return out

    def idle(self) -> None:
        self.idles = getattr(self, "idles", 0) + 1

    def close(self) -> None:
        self.closed = True


@dataclass
class FakeEngine(Engine):
    name: str = "fake"
    loads: int = 0
    backends: list = field(default_factory=list)
    decodes: dict = field(default_factory=dict)   # decode calls per model reference, across reloads

    def check(self, spec) -> None:
        FakeSettings.parse(spec.path)

    def weights_key(self, spec) -> tuple:
        return (spec.path, spec.n_gpu_layers)   # a copy per placement, as the llama.cpp engine keys them

    def file_bytes(self, spec) -> int:
        return 1 << 20

    def load_weights(self, spec) -> FakeWeights:
        self.loads += 1
        return FakeWeights(spec, FakeSettings.parse(spec.path))

    def open_model(self, weights: FakeWeights, spec, models) -> LoadedModel:
        b = FakeBackend(weights, spec, self.decodes)
        self.backends.append(b)
        if weights.settings.speculative is not None:
            spec = replace(spec, speculative=weights.settings.speculative)
        return LoadedModel.open(weights, b, spec, models)

    def kv_bytes(self, weights, spec) -> int:
        return spec.n_ctx * spec.n_parallel * 64

    def gpus(self) -> list:
        return []

    def gpu_bytes(self, spec) -> int:
        return 3 << 30


ENGINE = FakeEngine()


def install() -> FakeEngine:
    register_engine("fake", ENGINE)
    return ENGINE
