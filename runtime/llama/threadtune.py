"""How many threads a decode step of one token per request runs on, chosen by measuring.

llama.cpp runs every batch of more than one token on its batch threads (all cores by default), one
token on its decode threads (half of them). Several requests decoding together, one token each, lie
in between: the weights are read once for all of them, as for one token, but the arithmetic grows
with their number. Neither count is right everywhere:
- on idle cores, all of them nearly doubled the aggregate speed of 4 requests decoding together
  (2 cores, the embedded model: 133 against 61 tokens/s);
- on a machine whose other work keeps a core busy (a ComfyUI run, a compiler), all-core batches
  stall at every thread barrier of the graph: a 4-token request beside a long one took seconds
  instead of a tenth of one.
The machine's load changes while a model stays loaded, so this tuner measures instead of guessing.
For such batches it keeps a moving average of the seconds per token of each count, per batch size
class, runs the faster, and runs the other now and then so that a change of load is noticed.
Looking is bounded in time, not only in count: the other count runs at most once every EXPLORE
batches, and only when what it is expected to cost beyond the faster one fits in LOOK_SHARE of the
time the tuned batches took since the last look. On a busy machine the slower count can be a
hundred times slower (2 shared cores, the other one busy: 200 ms for a token that takes 2 ms on one
thread): looking once in 24 batches there made decoding eight times slower, while the time bound
keeps the cost of looking near LOOK_SHARE whatever the gap after the first looks (FIRST_LOOKS
batches per size class, right away: on a GPU host the batch threads ran 4 requests 1.7x faster, and
a single first look there measured them 1.4x slower than they were). A batch that reads a prompt chunk
(compute-bound) always gets the prompt threads. A single token is tuned the same way: llama.cpp
runs it on the decode threads (half the cores), which on idle cores left a single request at 0.75x
llama-server's speed (2 cores; 0.91x on both).
"""
from __future__ import annotations

EXPLORE = 24        # at most one batch in this many runs on the count that is not the faster one now
LOOK_SHARE = 0.04   # ... and only when its expected extra seconds fit in this share of the time since
ALPHA = 0.25        # weight of a new measurement in the moving average
FIRST_LOOKS = 2     # batches on the batch threads measured right away (one alone was seen off by 1.4x)


def size_class(tokens: int) -> int:
    """1 -> 0, 2 -> 1, 3-4 -> 2, 5-8 -> 3, 9 and more -> 4: per-token cost falls with the batch's size."""
    return min(4, (tokens - 1).bit_length())


class ThreadTuner:
    def __init__(self, decode: int, prompt: int):
        self.decode, self.prompt = decode, prompt
        self.cost: dict[tuple[int, int], float] = {}   # (size class, threads) -> seconds per token
        self.runs: dict[int, int] = {}                 # size class -> tuned batches seen
        self.since: dict[int, float] = {}              # size class -> seconds of tuned batches since a look
        self.samples: dict[tuple[int, int], int] = {}  # (size class, threads) -> batches measured
        self.last_look: dict[int, int] = {}            # size class -> the batch of the last look

    def choose(self, tokens: int, prompt_chunk: bool) -> int:
        """Threads for a batch of `tokens` tokens; `prompt_chunk` when some request reads its prompt."""
        if prompt_chunk:
            return self.prompt
        if self.decode == self.prompt:
            return self.decode
        size = size_class(tokens)
        n = self.runs[size] = self.runs.get(size, 0) + 1
        known = {t: self.cost[(size, t)] for t in (self.decode, self.prompt) if (size, t) in self.cost}
        if self.decode not in known:
            return self.decode          # the safe count first
        if self.samples.get((size, self.prompt), 0) < FIRST_LOOKS:
            return self.prompt          # looks at the other right away: it may be much faster
        best = min(known, key=known.__getitem__)
        other = self.prompt if best == self.decode else self.decode
        extra = (known[other] - known[best]) * tokens
        if n - self.last_look.get(size, 0) >= EXPLORE and extra <= LOOK_SHARE * self.since.get(size, 0.0):
            self.last_look[size], self.since[size] = n, 0.0
            return other
        return best

    def observe(self, tokens: int, prompt_chunk: bool, threads: int, seconds: float) -> None:
        """What a batch chosen by `choose` cost."""
        if prompt_chunk or self.decode == self.prompt or seconds <= 0:
            return
        key = (size_class(tokens), threads)
        self.since[key[0]] = self.since.get(key[0], 0.0) + seconds
        per_token = seconds / tokens
        self.samples[key] = self.samples.get(key, 0) + 1
        old = self.cost.get(key)
        self.cost[key] = per_token if old is None else old + ALPHA * (per_token - old)
