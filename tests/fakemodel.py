"""The fake model of the fake engine (fakeengine.py): what a `fake://` reference loads, its byte-level
vocabulary, its weights and its projector.

Model references: `fake://NAME[?key=value&...]` with keys
    text=...          the continuation the model writes (default: a pangram, repeated)
    eos_after=N       end with EOS after N generated tokens (default: never)
    delay_ms=N        sleep this long in every decode and every embedding pack (a slow model)
    embed_delay_ms=N  sleep this long in every embedding pack instead
    fim=1             give the vocabulary fill-in-the-middle tokens
    n_ctx_train=N     the trained context (default 4096)
    fail_decode=N     the N-th decode call (1-based, counted across reloads) fails
    grammar_fail=N    a request's grammar fails at its N-th constrained token (as a matcher over its
                      per-token bounds would: llama/grammar.py's Grammar.error)
    fatal=1           ... as a device error would (the model is closed and reloaded)
    gpu_layers=N      report N layers on a GPU (for the VRAM-sharing tests; nothing moves)
    template=NAME     the chat template: chatml (default), qwen3, r1, harmony (tests/templates.py)
    think=...         a thinking model: it writes this reasoning in a block, then `text` as its answer
                      (the block's tags byte by byte, so they split across tokens everywhere); what
                      it writes follows the sequence, so a block the runtime closes is answered too
    think_loop=1      ... and reasons forever (only a budget ends the block)
    vision=1          a projector: chat messages may carry images (each one `image_tokens` tokens,
                      default 4); what the model writes is shifted by the images it has read, so
                      another image gives other text
    encode_ms=N       sleep this long in every image encode (a slow vision tower)
    position=1        the text follows the sequence's length, not the tokens generated: two such models
                      agree on what comes next whatever prompt they read (a draft model's test)
    n_vocab=N         report a vocabulary of N tokens (a draft model that does not fit)
    move=0            the backend cannot copy a slot's cache into another (no holes closed)
    prompt_factor=X   a step that reads a prompt chunk takes X times delay_ms (a long prompt batch)
    speculative=MODE  load it with this speculative setting whatever the spec says (its text repeats,
                      so n-gram drafts make a slow fake fast: tests that time a long generation
                      turn that off)
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

import numpy as np

from comfyui_a3b.runtime.engine import ModelInfo
from comfyui_a3b.runtime.errors import ModelNotFound, ModelUnloaded

import templates

BOS, EOS, EOT, FIM_PRE, FIM_SUF, FIM_MID = 0, 1, 2, 3, 4, 5
OFFSET = 8                         # byte b is token OFFSET + b
N_VOCAB = OFFSET + 256
N_EMBD = 32
SPECIALS = {"<s>": BOS, "</s>": EOS, "<|eot|>": EOT}
DEFAULT_TEXT = "The quick brown fox jumps over the lazy dog. "
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{{ '<|im_start|>assistant\\n' }}{% if note is defined %}{{ note }}{% endif %}")


@dataclass
class FakeSettings:
    name: str
    text: str = DEFAULT_TEXT
    eos_after: int | None = None
    delay_ms: float = 0.0
    embed_delay_ms: float | None = None
    fim: bool = False
    n_ctx_train: int = 4096
    fail_decode: int | None = None
    grammar_fail: int | None = None
    fatal: bool = False
    gpu_layers: int = 0
    template: str = "chatml"
    think: str | None = None
    think_loop: bool = False
    vision: bool = False
    image_tokens: int = 4
    encode_ms: float = 0.0
    speculative: str | None = None
    position: bool = False
    n_vocab: int = N_VOCAB
    #: the fake can attach samplers to sequences (backend sampling)
    backend_sampling: bool = False
    #: its backend chains also measure each row's entropy
    backend_entropy: bool = False
    #: the fake can copy a slot's cache into another (the policy closes holes between slots)
    move: bool = True
    #: a step that reads a prompt chunk takes this many times delay_ms
    prompt_factor: float = 1.0

    @classmethod
    def parse(cls, ref: str) -> FakeSettings:
        u = urlsplit(ref)
        if u.scheme != "fake" or not u.netloc:
            raise ModelNotFound(f"Not a fake model reference: {ref!r}")
        q = {k: v[-1] for k, v in parse_qs(u.query).items()}
        return cls(name=u.netloc, text=q.get("text", DEFAULT_TEXT),
                   eos_after=int(q["eos_after"]) if "eos_after" in q else None,
                   delay_ms=float(q.get("delay_ms", 0)), fim=q.get("fim") == "1",
                   embed_delay_ms=float(q["embed_delay_ms"]) if "embed_delay_ms" in q else None,
                   n_ctx_train=int(q.get("n_ctx_train", 4096)),
                   fail_decode=int(q["fail_decode"]) if "fail_decode" in q else None, fatal=q.get("fatal") == "1",
                   grammar_fail=int(q["grammar_fail"]) if "grammar_fail" in q else None,
                   gpu_layers=int(q.get("gpu_layers", 0)), template=q.get("template", "chatml"),
                   think=q.get("think"), think_loop=q.get("think_loop") == "1", vision=q.get("vision") == "1",
                   image_tokens=int(q.get("image_tokens", 4)), encode_ms=float(q.get("encode_ms", 0)),
                   speculative=q.get("speculative"), position=q.get("position") == "1",
                   n_vocab=int(q.get("n_vocab", N_VOCAB)), backend_sampling=q.get("backend_sampling") == "1",
                   backend_entropy=q.get("backend_entropy") == "1",
                   move=q.get("move", "1") == "1", prompt_factor=float(q.get("prompt_factor", 1)))


class FakeVocab:
    """Bytes as tokens, plus a few specials. Thread-safe (no state)."""

    def __init__(self, fim: bool = False):
        self.n_vocab = N_VOCAB
        self.add_bos = True
        self.bos, self.eos = BOS, EOS
        self.fim = fim
        self.freed = False

    def _check(self) -> None:
        if self.freed:
            raise ModelUnloaded("fake model was unloaded; load it again.")

    def tokenize(self, text: str, add_bos: bool = False, special: bool = True) -> list[int]:
        self._check()
        out = [BOS] if add_bos else []
        i = 0
        while i < len(text):
            if special:
                hit = next((s for s in SPECIALS if text.startswith(s, i)), None)
                if hit:
                    out.append(SPECIALS[hit])
                    i += len(hit)
                    continue
            out.extend(OFFSET + b for b in text[i].encode("utf-8", "surrogatepass"))
            i += 1
        return out

    def piece(self, token: int) -> bytes:
        self._check()
        if token >= OFFSET:
            return bytes([token - OFFSET])
        return {BOS: b"<s>", EOS: b"</s>", EOT: b"<|eot|>"}.get(token, b"")

    def detokenize(self, tokens: list[int]) -> str:
        return b"".join(self.piece(t) for t in tokens).decode("utf-8", "replace")

    def is_eog(self, token: int) -> bool:
        return token in (EOS, EOT)

    def token_text(self, token: int) -> str:
        return self.piece(token).decode("utf-8", "replace")

    def special_tokens(self) -> dict[str, int]:
        fim = (FIM_PRE, FIM_SUF, FIM_MID) if self.fim else (-1, -1, -1)
        return {"bos": BOS, "eos": EOS, "eot": EOT, "fim_pre": fim[0], "fim_suf": fim[1], "fim_mid": fim[2],
                "fim_pad": -1, "fim_rep": -1, "fim_sep": -1}


class FakeWeights:
    def __init__(self, spec, settings: FakeSettings):
        self.settings = settings
        self.vocab = FakeVocab(settings.fim)
        self.vocab.n_vocab = settings.n_vocab
        self.size_bytes = 1 << 20
        self.n_layer_nextn = 0
        self.info = ModelInfo(name=settings.name, path=spec.path, architecture="fake", file_type="F32",
                              n_ctx_train=settings.n_ctx_train, n_vocab=settings.n_vocab, n_embd=N_EMBD, n_layer=1,
                              size_bytes=self.size_bytes,
                              chat_template=templates.BY_NAME.get(settings.template, CHATML),
                              special_tokens=self.vocab.special_tokens(), add_bos=True, engine="fake",
                              n_gpu_layers=settings.gpu_layers if spec.n_gpu_layers == "auto" else spec.n_gpu_layers)
        self.freed = False

    def free(self) -> None:
        self.freed = self.vocab.freed = True


class FakeChunk:
    """An image as the fake projector prepared it (freed when its request ends)."""

    def __init__(self, digest: str, n_tokens: int):
        self.digest, self.n_tokens, self.n_pos = digest, n_tokens, n_tokens
        self.freed = False

    def free(self) -> None:
        self.freed = True


class FakeVision:
    """A projector: splits the rendered text at its marker, an image becomes a FakeChunk; encodes are
    counted and cached by digest as the real one does."""

    marker = "<__media__>"
    info = None   # no projector file behind it

    def __init__(self, vocab: FakeVocab, settings: FakeSettings):
        self.vocab, self.settings = vocab, settings
        self.cache: dict[str, np.ndarray] = {}
        self.encoded: list[str] = []
        self.tokenized_threads: set[str] = set()
        self.chunks: list[FakeChunk] = []

    def tokenize(self, text: str, images, add_special: bool) -> list:
        self.tokenized_threads.add(threading.current_thread().name)
        out: list = []
        parts = text.split(self.marker)
        for i, part in enumerate(parts):
            out.extend(self.vocab.tokenize(part, add_bos=add_special and i == 0, special=True))
            if i < len(images):
                c = FakeChunk(images[i].digest, self.settings.image_tokens)
                self.chunks.append(c)
                out.append(c)
        return out

    def non_causal(self, chunk) -> bool:
        return False

    def embedding(self, chunk, *, count: bool = True) -> np.ndarray:
        assert not chunk.freed, "an image chunk was used after it was freed"
        if chunk.digest not in self.cache:
            if self.settings.encode_ms:
                time.sleep(self.settings.encode_ms / 1000.0)
            self.encoded.append(chunk.digest)
            self.cache[chunk.digest] = np.full((chunk.n_tokens, N_EMBD), int(chunk.digest[:4], 16), np.float32)
        return self.cache[chunk.digest]
