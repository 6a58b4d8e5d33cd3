"""Routing requests by task type: a served name that stands for several models, each request sent to
the model of the route its text matches (`a3b serve --route code=MODEL_A --route default=MODEL_B`).

The matcher uses what the process already has:

* **Rules** first: code fences, file names with a source extension, language names and keywords
  ("def", "#include", "Traceback", "SQL"...). A request with at least `route_rule_hits` distinct
  signs goes to the `code` route without being embedded.
* **Embeddings** otherwise: the head of the request (its first `route_head_tokens` tokens) against a
  few example prompts per route, embedded once at start-up. `route_embedding` says how: `tokens`
  (the embedding model's input token vectors, tokvec.py: a lookup) or `model` (its pooled output
  embedding through Runtime.embed, one pass over the head at interactive priority). The route whose
  nearest examples are nearest wins.
* With no embedding at all (a remote model that cannot embed), one code sign is enough.

Each route's model goes through the store like any other (one copy of each file; the embedding model
is one of them). A table without a `default` route, a route naming a model that cannot be found or
a route without examples is refused when the table is built: at start-up, not at the first request.
"""
from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import A3BError, InvalidRequest
from .generation import PRIORITY_INTERACTIVE
from .options import ROUTE_EMBEDDING, ROUTE_HEAD_TOKENS, ROUTE_RULE_HITS, LoadSpec, check

log = logging.getLogger("a3b.route")

DEFAULT, CODE = "default", "code"

#: Example prompts of the two built-in routes (a route table may give its own, and must for any
#: other route name). Short and plain: they say what a route is for, not every way to ask.
EXAMPLES: dict[str, tuple[str, ...]] = {
    CODE: (
        "Write a function that removes duplicates from a list while keeping the order.",
        "Why does this loop raise an index out of range error?",
        "Fix the bug in this class: the counter is never reset.",
        "Implement binary search over a sorted array and return the index.",
        "Refactor this module so the parser and the printer are separate.",
        "Write a unit test for the date parsing helper.",
        "How do I read a JSON file and iterate over its keys?",
        "Compute the shortest path in a weighted graph with Dijkstra's algorithm.",
        "Explain the time complexity of merge sort and write it.",
        "Write a SQL query that returns the ten customers with the most orders.",
        "Convert this callback code to async/await.",
        "Solve the equation and show the steps: 3x + 7 = 22.",
    ),
    DEFAULT: (
        "What should I see in Lisbon in two days?",
        "Write a short poem about the sea at night.",
        "Summarise the causes of the French Revolution.",
        "Give me ideas for a birthday party for a ten-year-old.",
        "How do I ask my manager for a raise?",
        "Describe a cozy cabin in the mountains for an image prompt.",
        "What is the difference between a virus and a bacterium?",
        "Translate 'good morning, how are you' into Spanish.",
        "Write a friendly email inviting colleagues to a picnic.",
        "Tell me a story about a dragon who is afraid of the dark.",
        "Which houseplants need little light?",
        "Explain how a rainbow forms.",
    ),
}

_EXT = ("py|pyi|ipynb|js|mjs|cjs|ts|tsx|jsx|java|kt|kts|scala|c|h|cc|cpp|cxx|hpp|hh|cs|go|rs|rb|php|swift|m|mm|"
        "lua|pl|r|jl|sh|bash|zsh|ps1|bat|sql|html|css|scss|vue|svelte|json|yaml|yml|toml|ini|cfg|xml|"
        "gradle|cmake|mk|dockerfile|tf|proto|asm|s|zig|dart|ex|exs|erl|hs|ml|fs|clj|elm|nim|v|sv|vhd")
#: Signs of code, each counted once per request. Every pattern is a bounded literal or starts only at a
#: word's start, so a match attempt never rescans a word: linear in the text.
_SIGNS = re.compile(
    r"(?P<fence>```|~~~)"
    rf"|(?P<file>(?<![\w.])\w[\w-]{{0,80}}\.(?:{_EXT})\b)"
    r"|(?P<syntax>#include\b|\bdef \w|\bimport \w|\bfrom \w+ import\b|\bfn \w|\bfunc \w|\bconsole\.log\b|"
    r"\bprintf\(|\bstd::|\bpublic static\b|\bself\.|=>|->|\+\+|!==|===|::|\);|\{\s*\}|\bnull\b|\bNone\b|"
    r"\breturn\b|\blambda\b|\bTraceback\b|(?<!\w)\w{0,80}?(?:Error|Exception)\b|\bsegfault\b|\bstack trace\b|"
    r"\bSELECT\b|\bINSERT INTO\b|\bCREATE TABLE\b|\$ \w)"
    r"|(?P<word>(?i:\b(?:python|javascript|typescript|java|kotlin|rust|golang|c\+\+|c#|ruby|php|swift|haskell|"
    r"bash|shell script|sql|regex|regexp|json|yaml|html|css|numpy|pandas|react|django|flask|pytorch|"
    r"function|method|class|variable|compile|compiler|debug|bug|refactor|unit test|algorithm|recursion|"
    r"array|linked list|hash ?map|dictionary|string|integer|boolean|loop|api|endpoint|script|code|program|"
    r"git|docker|kubernetes|linux|terminal|command line|big-o|complexity|equation|integral|derivative|"
    r"matrix|theorem|prime|factorial|fibonacci|sort|binary search|graph|dynamic programming|"
    r"implement|parse|parser|stack|queue|pointer|thread|async|sql query|database|schema)\b))")


def code_signs(text: str) -> set[str]:
    """The distinct signs of code in `text` (fences, source file names, keywords), lower-cased."""
    return {m.group(0).lower() for m in _SIGNS.finditer(text)}


@dataclass
class Decision:
    """Where a request went and why: the route, its model, the score of the winning route (cosine
    similarity; the count of code signs for a rule decision), the margin over the next route, how it
    was decided (rules, tokens, model, only) and the time it took."""

    route: str
    model: str
    spec: LoadSpec
    score: float
    margin: float
    method: str
    ms: float
    signs: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"route": self.route, "model": self.model, "score": round(self.score, 4),
                "margin": round(self.margin, 4), "method": self.method, "ms": round(self.ms, 3),
                "signs": self.signs}


def _unit(v: np.ndarray) -> np.ndarray:
    n = float(np.linalg.norm(v))
    return v / n if n > 0 else v


class Router:
    """A route table over loaded models: `decide(text)` picks the route of one request's text."""

    def __init__(self, rt, routes: Mapping[str, LoadSpec], names: Mapping[str, str] | None = None,
                 examples: Mapping[str, Sequence[str]] | None = None, *, embed_route: str | None = None,
                 embedding: str = ROUTE_EMBEDDING.default, head_tokens: int = ROUTE_HEAD_TOKENS.default,
                 rule_hits: int = ROUTE_RULE_HITS.default):
        if not routes:
            raise InvalidRequest("The route table is empty: give at least --route default=MODEL (and e.g. "
                                 "--route code=MODEL for code requests).")
        if DEFAULT not in routes:
            raise InvalidRequest(f"The route table has no {DEFAULT!r} route (it has {', '.join(routes)}): give "
                                 f"--route {DEFAULT}=MODEL for requests that match no other route.")
        self.rt = rt
        self.routes = dict(routes)
        self.names = {r: (names or {}).get(r, s.path) for r, s in self.routes.items()}
        self.embedding = check(ROUTE_EMBEDDING, embedding)
        self.head_tokens = check(ROUTE_HEAD_TOKENS, head_tokens)
        self.rule_hits = check(ROUTE_RULE_HITS, rule_hits)
        given = {k: tuple(v) for k, v in (examples or {}).items()}
        unknown = set(given) - set(self.routes)
        if unknown:
            raise InvalidRequest(f"Route examples name route(s) not in the table: {', '.join(sorted(unknown))}.")
        self.examples = {r: given.get(r) or EXAMPLES.get(r, ()) for r in self.routes}
        for r, ex in self.examples.items():
            if len(self.routes) > 1 and (not ex or not all(isinstance(e, str) and e.strip() for e in ex)):
                raise InvalidRequest(f"Route {r!r} has no example prompts: give a few in the route examples "
                                     "file (a JSON object of route name -> list of prompts).")
        self.embed_route = embed_route or DEFAULT
        if self.embed_route not in self.routes:
            raise InvalidRequest(f"The embedding route {self.embed_route!r} is not in the table.")
        self.embed_spec = self.routes[self.embed_route]
        self._vectors = None
        self._ex: dict[str, np.ndarray] = {}
        self._center: np.ndarray | None = None
        self.can_embed = False

    # -- start-up ------------------------------------------------------------------------------------
    def prepare(self) -> Router:
        """Load every route's model through the store and embed the examples once. Errors (a missing
        model, an engine that cannot embed with route_embedding=model) surface here."""
        for spec in dict.fromkeys(self.routes.values()):
            self.rt.load(spec)
        if len(self.routes) == 1:
            return self
        try:
            if self.embedding == "tokens":
                from .models.tokvec import TokenVectors

                if "://" in self.embed_spec.path:
                    raise InvalidRequest("token vectors need a local GGUF")
                self._vectors = TokenVectors(self.rt.loaded(self.embed_spec).info.path or self.embed_spec.path)
            vecs = {r: np.stack([self._raw(e) for e in ex]) for r, ex in self.examples.items()}
        except A3BError as e:
            log.warning("routing without embeddings (%s): rules decide every request", e)
            self._vectors = None
            return self
        self._center = np.concatenate(list(vecs.values())).mean(axis=0)
        self._ex = {r: np.stack([_unit(v - self._center) for v in m]) for r, m in vecs.items()}
        self.can_embed = True
        return self

    # -- one request --------------------------------------------------------------------------------
    def head(self, text: str) -> tuple[str, list[int]]:
        """The start of `text` the router reads, as text and (for token vectors) as token ids."""
        text = text[: self.head_tokens * 16]   # more characters than head_tokens tokens ever take
        if self.embedding != "tokens":
            return text[: self.head_tokens * 4], []
        ids = self.rt.tokenize(text, model=self.embed_spec)[: self.head_tokens]
        return text, ids

    def _raw(self, text: str) -> np.ndarray:
        head, ids = self.head(text)
        if self._vectors is not None:
            return self._vectors.mean(ids).astype(np.float32)
        return self.rt.embed([head or " "], model=self.embed_spec, priority=PRIORITY_INTERACTIVE)[0]

    def scores(self, text: str) -> dict[str, float]:
        """Each route's score for `text`: the mean cosine similarity of its three nearest examples."""
        v = _unit(self._raw(text) - self._center)
        out = {}
        for r, m in self._ex.items():
            sims = np.sort(m @ v)[::-1]
            out[r] = float(sims[: min(3, len(sims))].mean())
        return out

    def decide(self, text: str) -> Decision:
        t0 = time.perf_counter()
        if len(self.routes) == 1:
            return self._decision(DEFAULT, 1.0, 0.0, "only", t0)
        signs = len(code_signs(text[: self.head_tokens * 16])) if CODE in self.routes else 0
        if CODE in self.routes and self.rule_hits and signs >= self.rule_hits:
            return self._decision(CODE, float(signs), float(signs - self.rule_hits + 1), "rules", t0, signs)
        if not self.can_embed or not text.strip():
            route = CODE if signs and CODE in self.routes else DEFAULT
            return self._decision(route, float(signs), float(signs), "rules", t0, signs)
        scores = self.scores(text)
        ranked = sorted(scores.items(), key=lambda kv: kv[1], reverse=True)
        (best, s1), s2 = ranked[0], ranked[1][1] if len(ranked) > 1 else 0.0
        return self._decision(best, s1, s1 - s2, self.embedding, t0, signs)

    def _decision(self, route: str, score: float, margin: float, method: str, t0: float, signs: int = 0
                  ) -> Decision:
        d = Decision(route, self.names[route], self.routes[route], score, margin, method,
                     (time.perf_counter() - t0) * 1000, signs)
        log.info("route %s -> %s (score %.3f, margin %.3f, %s, %.2f ms)", d.route, d.model, d.score, d.margin,
                 d.method, d.ms)
        return d


def parse_route(text: str) -> tuple[str, str]:
    """("code", "MODEL") of a `--route code=MODEL` argument; InvalidRequest naming what is wrong."""
    name, sep, model = str(text).partition("=")
    name, model = name.strip(), model.strip()
    if not sep or not name or not model:
        raise InvalidRequest(f"--route {text!r}: give NAME=MODEL, e.g. --route code=qwen-coder.gguf.")
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
        raise InvalidRequest(f"--route {text!r}: a route name is letters, digits, '_', '.' or '-'.")
    return name, model


def read_examples(path: str) -> dict[str, list[str]]:
    """A route examples file: a JSON object of route name -> list of example prompts."""
    import json

    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise InvalidRequest(f"Cannot read the route examples {path}: {e.strerror or e}.") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"The route examples {path} are not JSON: {e}.") from e
    if not isinstance(data, dict) or not all(isinstance(v, list) and all(isinstance(x, str) for x in v)
                                             for v in data.values()):
        raise InvalidRequest(f"The route examples {path} must be a JSON object of route name -> list of prompts.")
    return data


__all__ = ["CODE", "DEFAULT", "EXAMPLES", "Decision", "Router", "code_signs", "parse_route", "read_examples"]
