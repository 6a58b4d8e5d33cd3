"""The completion cache: answers without the model when the context was seen before.

Two kinds of hit:

* exact: the text before the cursor ends as it did when a suggestion was cached (its last TAIL
  characters, or all of it when it was shorter), in the same bucket;
* typed ahead: the user has typed the first characters of a cached suggestion since it was made;
  the rest of the suggestion is still right, so it is answered at once.

Entries live in buckets named by `bucket_key` over everything else that must be equal for a hit.
The completion logic (`Completer.cache_key` in completion.py) builds it from the loaded model (its file
path and the identity of its loaded weights), the document URI, the prompt kind (fill-in-the-middle
or plain prefix), the rest of the cursor's line, and the first 240 characters after the cursor.
The single/multi-line mode is not part of it: it follows from the same context. Inside a bucket,
an entry matches when the text before the cursor ends with the entry's tail plus the typed part of
its suggestion.
"""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass

TAIL = 400          # characters of the prefix an entry keeps for matching
PER_BUCKET = 24


@dataclass
class Entry:
    tail: str           # last TAIL characters before the cursor when the suggestion was made
    suggestion: str     # "" caches "nothing to suggest here" (exact hits only)


def bucket_key(*parts: str) -> str:
    """A bucket's name: a hash of `parts`, in order."""
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        h.update(p.encode("utf-8", "surrogatepass"))
        h.update(b"\x00")
    return h.hexdigest()


class CompletionCache:
    def __init__(self, max_buckets: int = 512):
        self.max_buckets = max_buckets
        self._b: OrderedDict[str, deque[Entry]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits_exact = 0
        self.hits_typed = 0
        self.misses = 0

    def put(self, key: str, prefix: str, suggestion: str) -> None:
        with self._lock:
            d = self._b.get(key)
            if d is None:
                d = self._b[key] = deque(maxlen=PER_BUCKET)
                while len(self._b) > self.max_buckets:
                    self._b.popitem(last=False)
            else:
                self._b.move_to_end(key)
            tail = prefix[-TAIL:]
            for e in list(d):
                if e.tail == tail:
                    d.remove(e)
            d.appendleft(Entry(tail, suggestion))

    def get(self, key: str, prefix: str, count: bool = True) -> tuple[str, str] | None:
        """(kind, remaining suggestion) for a hit, kind being "exact" or "typed"; None on a miss."""
        with self._lock:
            d = self._b.get(key)
            hit = self._match(d, prefix) if d else None
            if count:
                if hit is None:
                    self.misses += 1
                elif hit[0] == "exact":
                    self.hits_exact += 1
                else:
                    self.hits_typed += 1
            return hit

    @staticmethod
    def _match(d: deque[Entry], prefix: str) -> tuple[str, str] | None:
        lp = len(prefix)
        for e in d:
            lt = len(e.tail)
            if prefix.endswith(e.tail) and (lt == TAIL or lp == lt):
                return "exact", e.suggestion
            sug = e.suggestion
            # typed ahead: prefix == ... + tail + sug[:n] for some 0 < n < len(sug)
            for n in range(1, min(len(sug), lp + 1)):
                if not prefix.endswith(sug[:n]):
                    continue
                if prefix.endswith(e.tail, 0, lp - n) and (lt == TAIL or lp - n == lt):
                    return "typed", sug[n:]
        return None

    def stats(self) -> dict:
        total = self.hits_exact + self.hits_typed + self.misses
        return {"hits_exact": self.hits_exact, "hits_typed_ahead": self.hits_typed, "misses": self.misses,
                "hit_rate": (self.hits_exact + self.hits_typed) / total if total else 0.0,
                "buckets": len(self._b)}

    def clear(self) -> None:
        with self._lock:
            self._b.clear()
