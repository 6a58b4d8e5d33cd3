"""`a3b generate`'s options for thinking models and structured output, and how it prints reasoning.

The options' defaults, bounds and help come from their declarations in runtime/options/. The
reasoning streams dimmed on stderr (plain when stderr is not a terminal), so stdout carries the
answer alone and a pipe gets only the answer; `--show-reasoning` prints it on stdout before the
answer instead.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .runtime.errors import InvalidRequest
from .runtime.options import (JSON_SCHEMA, MAX_TOTAL_TOKENS, REASONING_BUDGET, SHOW_REASONING, THINKING, add_argument,
                              cli_help)

DIM, RESET = "\033[2m", "\033[0m"


def _template_var(text: str) -> tuple[str, Any]:
    """KEY=VALUE, the value read as JSON when it is JSON (true, 3, "x", [..]) and as text otherwise."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


def add_arguments(g: argparse.ArgumentParser) -> None:
    add_argument(g, THINKING)
    g.add_argument("--template-var", action="append", type=_template_var, metavar="KEY=VALUE",
                   help="a chat template variable, e.g. enable_thinking=false (repeatable; the value is read as "
                        "JSON when it is JSON; default: none)")
    add_argument(g, REASONING_BUDGET, metavar="N", default_text="no limit")
    add_argument(g, MAX_TOTAL_TOKENS, metavar="N", default_text="the context is the limit")
    add_argument(g, JSON_SCHEMA, default_text="none, free text")
    # a display choice of this command alone: a plain flag with the declaration's help
    g.add_argument("--show-reasoning", action="store_true", help=cli_help(SHOW_REASONING.help))


def read_schema(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            schema = json.load(f)
    except FileNotFoundError:
        raise InvalidRequest(f"--json-schema {path}: no such file; give a JSON file holding a schema.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"--json-schema {path} is not JSON ({e}).") from None
    except OSError as e:
        raise InvalidRequest(f"Cannot read --json-schema {path}: {e.strerror or e}.") from None
    if not isinstance(schema, dict):
        raise InvalidRequest(f"--json-schema {path} must hold a JSON object (a schema).")
    return schema


def request_kwargs(args) -> dict[str, Any]:
    """The Runtime.submit keywords of these options."""
    out: dict[str, Any] = {"thinking": args.thinking, "reasoning_budget": args.reasoning_budget,
                           "max_total_tokens": args.max_total_tokens}
    if args.json_schema:
        out["json_schema"] = read_schema(args.json_schema)
    if args.template_var:
        out["variables"] = dict(args.template_var)
    return out


class Printer:
    """Streams an answer to stdout and its reasoning apart (dimmed on stderr, or first on stdout)."""

    def __init__(self, show: bool, out=None, err=None):
        self.out = out or sys.stdout
        self.show = show
        self.err = err or sys.stderr
        self.dim = not show and getattr(self.err, "isatty", lambda: False)()
        self._thinking = False

    def event(self, ev) -> None:
        if ev.reasoning:
            dest = self.out if self.show else self.err
            dest.write((DIM if self.dim and not self._thinking else "") + ev.reasoning)
            dest.flush()
            self._thinking = True
        if ev.text:
            self._end_reasoning()
            self.out.write(ev.text)
            self.out.flush()

    def _end_reasoning(self) -> None:
        if self._thinking:
            dest = self.out if self.show else self.err
            dest.write((RESET if self.dim else "") + "\n" + ("\n" if self.show else ""))
            dest.flush()
            self._thinking = False

    def end(self) -> None:
        self._end_reasoning()


__all__ = ["Printer", "add_arguments", "read_schema", "request_kwargs"]
