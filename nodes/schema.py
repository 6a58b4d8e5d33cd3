"""How a node is declared: its inputs (a widget made from a declared option, or a socket), its
outputs and its `run` function, as plain data that v3.py and v1.py present to ComfyUI. No ComfyUI
import here."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..runtime.options import Option

CATEGORY = "A3B"


@dataclass
class In:
    name: str
    type: str                 # INT FLOAT STRING BOOLEAN COMBO, or a custom type name
    default: Any = None
    tooltip: str | None = None
    optional: bool = False
    min: float | None = None
    max: float | None = None
    step: float | None = None
    round: float | None = None
    multiline: bool = False
    force_input: bool = False
    control_after_generate: bool = False
    options: Callable[[], list[str]] | list[str] | None = None
    #: the declaration a widget was made from (`widget`), for the tests that compare the two
    option: Option | None = None
    #: the number that stands for None in an INT widget (`widget`'s none_below)
    none_value: float | None = None
    #: shown only when the node's advanced inputs are (the frontend's "Show Advanced")
    advanced: bool = False

    @property
    def is_widget(self) -> bool:
        return self.type in ("INT", "FLOAT", "STRING", "BOOLEAN", "COMBO") and not self.force_input

    def choices(self) -> list[str]:
        opts = self.options() if callable(self.options) else self.options
        return list(opts or [])


@dataclass
class Out:
    name: str
    type: str
    tooltip: str | None = None
    is_list: bool = False


@dataclass
class NodeDef:
    node_id: str
    display_name: str
    description: str
    inputs: list[In]
    outputs: list[Out]
    #: run(node_id=..., **inputs) -> (outputs tuple, ui dict or None)
    run: Callable[..., tuple[tuple, dict | None]]
    fingerprint: Callable[..., Any] | None = None
    output_node: bool = False
    input_is_list: bool = False
    not_idempotent: bool = False
    category: str = CATEGORY
    extra: dict = field(default_factory=dict)

    def call(self, node_id: str | None = None, **inputs: Any) -> tuple[tuple, dict | None]:
        """Run the node. Inputs ComfyUI leaves out (an optional input added after a workflow was
        saved, an unconnected socket) take their declared defaults: the declaration is the one
        place a node's defaults are written."""
        return self.run(node_id, **{**self.defaults(), **inputs})

    def fingerprint_of(self, **inputs: Any) -> Any:
        return self.fingerprint(**{**self.defaults(), **inputs}) if self.fingerprint else None

    def defaults(self) -> dict[str, Any]:
        out = {}
        for i in self.inputs:
            if i.type == "COMBO":
                ch = i.choices()
                out[i.name] = i.default if i.default is not None else (ch[0] if ch else None)
            elif i.default is not None:
                out[i.name] = i.default
        return out


_KINDS = {int: "INT", float: "FLOAT", bool: "BOOLEAN", str: "STRING", dict: "STRING"}


def widget(option: Option, name: str | None = None, *, note: str = "", none_below: bool = False, **extra: Any) -> In:
    """The widget of a declared option: its default, bounds (an open one a step inside), step,
    choices and help. An INT widget holds neither a word nor None, so the number below the minimum
    stands for the option's word (n_gpu_layers' -2 = auto), or with `none_below` for None where None
    means something no number does (reasoning_budget's -1 = no limit); any other option whose default
    is None (the seed) starts at its minimum. An INT widget with a step has its minimum on the step's
    grid (n_ctx: 256, not 16), since the frontend snaps values to minimum + k * step.
    A text widget (a JSON object's included) starts empty.
    `note` adds what only the node says to the tooltip."""
    lo, hi = option.widget_bounds()
    default = option.default
    kind = "COMBO" if option.choices else _KINDS[option.type]
    none = None
    if option.words or none_below:
        lo = option.min - 1
        default = lo if default in option.words or (none_below and default is None) else default
        none = lo if none_below else None
    if default is None and option.choices is None:
        default = "" if kind == "STRING" else option.min
    if kind == "INT" and option.step and lo is not None and none is None and not option.words and lo % option.step:
        # ComfyUI's frontend snaps an INT widget to min + k * step: a minimum on the step's grid makes the
        # values people type (n_ctx 2048, 4096) land as typed rather than a step off
        lo = -(-lo // option.step) * option.step
        default = max(default, lo)
    return In(name or option.name, kind, default,
              tooltip=option.help + (" " + note if note else ""), min=lo, max=hi, step=option.step,
              options=list(option.choices) if option.choices else None, option=option, none_value=none, **extra)
