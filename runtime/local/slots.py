"""Sequence slots, and keeping the running ones side by side: what llama.cpp needs to decode a step
in one pass.

The generation context gives every slot a KV stream of its own (`kv_unified` off, see
llama/backend.py), and llama.cpp then cuts a batch into micro-batches by its "equal split": one
micro-batch takes the same number of tokens from each sequence, and only sequences whose ids
follow each other (`seq_id == previous + 1`, in batch order) go together. A step decoding slots
0, 1, 2, 3 is one pass through the model; slots 0, 2, 5, 9 are four, each a full pass that reads
every weight again (measured on one H200: 16 decoding rows in 8-16 passes ran at 195 tokens/s, in
one pass at 1543). So the policy (scheduler.py)

* puts a step's rows in ascending slot order (`DecodeStep` rows, scheduler.Policy._decode),
* places a new request in the free slot that keeps the running slots together, unless another one
  holds a longer cached prefix by `PREFIX_WORTH` tokens or more (prefix reuse saves reading
  those tokens again) and covers a share of the prompt (`reuse_worth`), and
* when a step's slots are not side by side (finished requests left holes that no waiting request
  filled; only a higher priority class decodes while others wait in their slots), moves requests
  into the holes before the step (`gather`): the engine copies the slot's KV stream (llama.cpp's
  `llama_memory_seq_cp` between streams, a device-to-device copy on a GPU), where its backend
  declares it can.

Why not one unified KV stream, which llama.cpp always decodes in one pass: attention then runs
over every cell of the shared cache, cached prefixes of idle slots included, for every row (an
H200 step at 16 rows and 512-token slots took 9.6 ms unified against 9.0 ms ordered, and the gap
grows with what the slots hold), and a sequence's cells are no longer bounded by its own stream.
"""
from __future__ import annotations

from typing import Any

#: cached-prefix tokens that outweigh keeping the running slots together: below this, a slot
#: beside the running ones wins (reading 64 prompt tokens again costs about one decode pass on a
#: GPU; a pass of its own costs one for every token the request generates)
PREFIX_WORTH = 64


class Slot:
    """A sequence slot: the tokens whose KV cache it holds, and the job using it (if any)."""

    def __init__(self, seq_id: int):
        self.seq_id = seq_id
        self.tokens: list[int] = []
        self.job: Any = None   # the scheduler's Job running here, or None
        self.last_used = 0   # logical clock: higher is more recent

    def __repr__(self) -> str:
        return f"Slot({self.seq_id}, {len(self.tokens)} tokens, job={self.job.id if self.job else None})"


def runs(ids: set[int] | list[int]) -> int:
    """How many runs of consecutive ids: the passes llama.cpp's equal split needs for a step that
    decodes one token in each of these sequences (rows in ascending order)."""
    s = set(ids)
    return sum(1 for i in s if i - 1 not in s)


def together_delta(running: set[int], seq_id: int) -> int:
    """How the runs change when `seq_id` joins `running`: -1 fills a hole, 0 extends a run, +1 starts
    a new one (or the first)."""
    return (1 - (seq_id - 1 in running) - (seq_id + 1 in running)) if running else 1


#: the share of a prompt a slot's cached prefix must cover to be taken for it. llama-server's
#: --slot-prompt-similarity is 0.1, which short prompts reach with a shared template header or first
#: words alone ("Request 1: ..." and "Request 2: ..." share 2 of 18 tokens); the same prompt again, a
#: chat's next turn and a completion further down the same file cover most of theirs.
REUSE_SHARE = 0.5


def reuse_worth(common: int, prompt_len: int) -> int:
    """The cached-prefix tokens a slot saves a prompt of `prompt_len` tokens: `common`, when it covers
    more than REUSE_SHARE of the prompt; else 0, as for an empty slot."""
    return common if common > REUSE_SHARE * prompt_len else 0


def placement_key(slot: Slot, common: int, running: set[int], prompt_len: int = 0) -> tuple:
    """Sort key of a free slot for a request of `prompt_len` tokens with `common` cached-prefix tokens
    there.

    The slot's prefix counts when it is a share of the prompt (`reuse_worth`); a slot that keeps the
    running slots together is worth `PREFIX_WORTH` tokens more per run it saves. Between slots whose
    prefix does not count, an empty slot comes first, then the one used longest ago (its cache is the
    least likely to be asked for again), then the lower id (the block stays low and compact): as
    llama-server picks, by prefix similarity, else the least recently used. Taking the longest prefix
    whatever it was let prompts that share only their first tokens (a template's header, "Request"
    and a number) each take the slot of the one before while other slots stood empty: the same prompt
    sent again was read whole every time (110 ms for 29 tokens on 2 cores; 15 ms from its cache). A
    prompt whose shared start is most of it (a long system prompt before a short question) still
    takes such a slot, as in llama-server."""
    worth = reuse_worth(common, prompt_len) - PREFIX_WORTH * together_delta(running, slot.seq_id)
    return worth, not slot.tokens, -slot.last_used, -slot.seq_id


def gather(slots: list[Slot], together: set[int]) -> list[tuple[Slot, Slot]]:
    """Moves (from, to) that bring the slots `together` (the ones a step decodes) into one run of
    consecutive ids with the fewest moves: among the windows of as many slots, each free or one of
    them, the one that holds the most of them already (the lowest such window); each slot outside it
    moves into a free slot inside it. None when they are in one run already or no window fits."""
    k = len(together)
    if k < 2 or runs(together) == 1:
        return []
    usable = [s.job is None or s.seq_id in together for s in slots]
    best, most = None, -1
    for a in range(len(slots) - k + 1):
        if all(usable[a:a + k]):
            inside = sum(1 for s in slots[a:a + k] if s.seq_id in together)
            if inside > most:
                best, most = a, inside
    if best is None:
        return []
    window = slots[best:best + k]
    holes = [s for s in window if s.seq_id not in together]
    outside = [s for s in slots if s.seq_id in together and s not in window]
    return list(zip(outside, holes))


def passes(rows: list[tuple[int, int]]) -> int:
    """The micro-batches llama.cpp's equal split cuts a batch into, the batch given as (sequence id,
    tokens) in ascending ids, as a step's rows go: each micro-batch takes, from the first sequence with
    tokens left, the sequences whose ids follow each other, and as many tokens of each as the one with
    the fewest left has (a step's tokens fit one micro-batch: the policy's budget is its size)."""
    left = [[seq_id, n] for seq_id, n in rows if n > 0]
    count = 0
    while left:
        chosen = [left[0]]
        for r in left[1:]:
            if r[0] == chosen[-1][0] + 1:
                chosen.append(r)
        take = min(r[1] for r in chosen)
        for r in chosen:
            r[1] -= take
        left = [r for r in left if r[1] > 0]
        count += 1
    return count
