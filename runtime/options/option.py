"""`Option`, one declared setting, and what every surface does with one: `check` a value against
it (its type, bounds or choices, and its `form` where it declares one), show it as a CLI flag
(`add_argument`), and where the caches live (`cache_root`)."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from ..environment import env
from ..errors import InvalidRequest


def cache_root() -> Path:
    """Where re-encoded copies and pruned variants are cached: $A3B_CACHE, else the user's cache
    folder ($XDG_CACHE_HOME or ~/.cache) / comfyui-a3b. Created on first use by the callers."""
    import os

    base = env("A3B_CACHE")
    if base:
        return Path(base).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "comfyui-a3b"


def check_finite(name: str, value: Any) -> float:
    """`value` as a float, or InvalidRequest when it is not a number, NaN or infinite."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequest(f"{name} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise InvalidRequest(f"{name} must be a finite number, got {value!r}")
    return v


@dataclass(frozen=True)
class Option:
    """One setting: what every surface shows and checks for it."""

    name: str
    type: type                      # int, float, str, bool, dict (a JSON object) or tuple (of choices)
    default: Any
    #: one or two sentences; node tooltips show it as written, the CLI's help in its own style
    help: str
    min: float | None = None
    max: float | None = None
    #: the bound itself is outside the range: top_p's (0, 1] is min=0, low_open=True
    low_open: bool = False
    high_open: bool = False
    choices: tuple[str, ...] | None = None
    #: words taken besides the numbers (n_gpu_layers' "auto"); None taken too where nullable
    words: tuple[str, ...] = ()
    nullable: bool = False
    #: how far a node widget's arrows move it; an open bound's widget stops one step inside it
    step: float | None = None
    #: the environment variable that gives its default, where there is one (environment.py)
    env: str | None = None
    #: what error messages call it where the field's name is not the words ("keep ratio")
    label: str | None = None
    #: said after a bad value, where the help alone would not tell what to choose
    hint: str | None = None
    #: a check of the value's form beyond its type and choices (speculative's draft:MODEL): raises
    #: InvalidRequest with the message to show; `check` runs it on a value of the right type
    form: Callable[[Any], object] | None = None

    def range_text(self) -> str:
        """The bounds in words: `in 1..64`, `>= 0`, `in (0, 1]`."""
        lo, hi = self.min, self.max
        if self.type is int:
            if lo is not None and hi is not None:
                return f"in {lo}..{hi}"
            return f">= {lo}" if lo is not None else f"<= {hi}"
        if lo is not None and hi is not None:
            return f"in {'(' if self.low_open else '['}{lo:g}, {hi:g}{')' if self.high_open else ']'}"
        if lo is not None:
            return f"{'>' if self.low_open else '>='} {lo:g}"
        return f"{'<' if self.high_open else '<='} {hi:g}"

    def describe(self, none: str = "None") -> str:
        """The valid values in words, e.g. `an integer in 1..64, or null` (with none="null")."""
        if self.choices is not None:
            text = "one of " + ", ".join(self.choices)
        elif self.type is bool:
            text = "true or false"
        elif self.type is str:
            text = "text"
        elif self.type is dict:
            text = "a JSON object"
        else:
            text = ("an integer" if self.type is int else "a number") + (
                "" if self.min is None and self.max is None else " " + self.range_text())
        words = [repr(w) for w in self.words] + ([none] if self.nullable else [])
        return text + "".join(f", or {w}" for w in words)

    def within(self, value: float) -> bool:
        lo, hi = self.min, self.max
        return ((lo is None or (value > lo if self.low_open else value >= lo))
                and (hi is None or (value < hi if self.high_open else value <= hi)))

    def widget_bounds(self) -> tuple[float | None, float | None]:
        """The smallest and largest value a node widget offers: the bounds, an open one a step inside."""
        lo = None if self.min is None else round(self.min + (self.step if self.low_open else 0), 10)
        hi = None if self.max is None else round(self.max - (self.step if self.high_open else 0), 10)
        return lo, hi

    def or_none(self) -> Option:
        """The same option where None (the runtime's default) may be given: a setting that leaves it open."""
        return replace(self, default=None, nullable=True)


def check(option: Option, value: Any, name: str | None = None, error: type[Exception] = InvalidRequest) -> Any:
    """`value` if `option` takes it, else `error` (InvalidRequest) saying what is taken, under
    `name` (default: the option's label or name). A value of the right type is then held to the
    option's `form`, whose message is kept."""
    value = _check_type(option, value, name or option.label or option.name, error)
    if option.form is not None and value is not None:
        try:
            option.form(value)
        except InvalidRequest as e:
            if error is InvalidRequest:
                raise
            raise error(str(e)) from None
    return value


def _check_type(option: Option, value: Any, name: str, error: type[Exception]) -> Any:
    """`value` if its type, bounds or choices are the option's, else `error`."""
    if value is None and option.nullable:
        return value
    if option.type is tuple:   # names from `choices`, in an order, each at most once
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise error(f"{name} must be a list of names ({', '.join(option.choices or ())}), got {value!r}")
        bad = [v for v in value if v not in (option.choices or ())]
        if bad or len(set(value)) < len(value):
            what = f"{bad[0]!r} is not supported" if bad else "a name is given twice"
            raise error(f"{name}: {what}; give each at most once, from {', '.join(option.choices or ())}")
        return tuple(value)
    if isinstance(value, str) and value in option.words:
        return value
    if option.choices is not None:
        if value not in option.choices:
            raise error(f"{name} must be one of {', '.join(option.choices)}; got {value!r}")
        return value
    kind = option.type
    if kind in (bool, str, dict):
        if not isinstance(value, kind):
            raise error(f"{name} must be {option.describe()}, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, int if kind is int else (int, float)):
        what = "an integer" if kind is int else "a number"
        raise error(f"{name} must be {what}{' or ' + ', '.join(map(repr, option.words)) if option.words else ''}, "
                    f"got {value!r}")
    if kind is float and not math.isfinite(value) and (option.min is None or option.max is None):
        raise error(f"{name} must be a finite number, got {value!r}")
    if not option.within(value):   # NaN is within no bounds, infinity not within two
        hint = f": {option.hint}" if option.hint else ""
        raise error(f"{name} must be {option.range_text()}, got {value!r}{hint}")
    return value


def cli_help(text: str) -> str:
    """An option's help as argparse shows it: lower case at the start (unless a capital word such as
    CPU starts it), no final full stop."""
    text = text.rstrip(".")
    return text[0].lower() + text[1:] if len(text) > 1 and text[1].islower() else text


def add_argument(parser, option: Option, *flags: str, default_text: str | None = None, **kwargs: Any):
    """Add `option` to an argparse parser: `flags` (default `--name-with-dashes`), its type or
    choices, its default and its help. A command that means something else by leaving it out (a
    preset's value) passes `default=` and says what in `default_text`."""
    kw: dict[str, Any] = {"default": option.default, "help": cli_help(option.help)}
    if default_text:
        kw["help"] += f" (default: {default_text})"
    if option.choices is not None:
        kw["choices"] = option.choices
    elif option.type is dict:   # a JSON object: the command line names a file holding it, which the command reads
        kw.update(type=str, metavar="FILE")
    elif option.type is not bool:
        kw["type"] = _parse_words(option) if option.words else option.type
    kw.update(kwargs)
    action = parser.add_argument(*(flags or ("--" + option.name.replace("_", "-"),)), **kw)
    action.option = option   # what the tests compare the flag with
    return action


def _parse_words(option: Option):
    def parse(text: str):
        import argparse

        if text.strip().lower() in option.words:
            return text.strip().lower()
        try:
            return option.type(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {option.describe()}, got {text!r}") from None
    return parse


def check_fields(obj: Any, options: dict[str, Option]) -> None:
    """Check every field of dataclass `obj` that `options` declares."""
    for f in fields(obj):
        if f.name in options:
            check(options[f.name], getattr(obj, f.name))


__all__ = ["cache_root", "check_finite", "Option", "check", "cli_help", "add_argument", "check_fields"]
