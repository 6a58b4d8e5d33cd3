"""What a request's thinking settings mean for one model: template variables, the effective budget,
and the warnings a caller gets instead of an error.

A request says `thinking` ("auto", "on", "off") and `reasoning_budget` (None, or N reasoning tokens;
0 means thinking off). Where the model's template has a switch (reasoning.SWITCHES) the setting
becomes that template variable; where it has none, "off" and a budget of 0 close the reasoning
block as soon as it opens (the worker injects the template's end-of-thinking text), and "on"
changes nothing; both are said in a warning rather than refused, since the answer still comes.
Template variables the caller set themselves win over `thinking="auto"`, and a contradiction
between the two is refused.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from .errors import InvalidRequest
from .reasoning import GPT_OSS, NONE, detect_format, thinking_switch
from .requests import ChatPrompt, GenerationRequest, Prompt


@dataclass
class Plan:
    """How one request runs on one model."""

    #: the reasoning format to split the output with (reasoning.FORMATS)
    format: str
    #: the prompt to render (a chat prompt with the thinking switch set, where it has one)
    prompt: Prompt
    #: reasoning tokens after which the runtime closes the block (None: no limit)
    budget: int | None
    warnings: list[str] = field(default_factory=list)


def asks_off(request: GenerationRequest) -> bool:
    """Whether `request` asks for thinking off (thinking 'off', or a reasoning budget of 0); both
    engines read it. InvalidRequest where it asks both ways."""
    if request.thinking == "on" and request.reasoning_budget == 0:
        raise InvalidRequest("thinking='on' with a reasoning budget of 0 contradicts itself: a budget of 0 is "
                             "thinking off. Give a budget of at least 1, or thinking 'off'.")
    return request.thinking == "off" or request.reasoning_budget == 0


def switch(variables: dict[str, Any], name: str, off: bool) -> None:
    """Set the template's thinking switch `name` in `variables` (thinking on or off); InvalidRequest
    where the prompt's own variable says the opposite. Both engines set it this way."""
    if name in variables and bool(variables[name]) == off:
        raise InvalidRequest(f"thinking={'off' if off else 'on'} contradicts the template variable "
                             f"{name}={variables[name]!r}; give one of them.")
    variables[name] = not off


def plan(template: str | None, request: GenerationRequest) -> Plan:
    """The plan for `request` on a model whose own chat template is `template`."""
    p = request.prompt
    budget = request.reasoning_budget
    mode = request.thinking
    off = asks_off(request)
    if not isinstance(p, ChatPrompt):
        # text, tokens and infill prompts have no template: nothing to split, nothing to switch
        warnings = [] if mode != "on" else ["thinking='on' applies to chat prompts; this one is sent as it is."]
        return Plan(NONE, p, None, warnings)
    fmt = detect_format(template)
    own = not p.template   # the model's own template renders the variables
    name = thinking_switch(template) if own else None
    warnings: list[str] = []
    variables: dict[str, Any] = dict(p.variables)
    if name in ("enable_thinking", "thinking") and (mode != "auto" or off):
        switch(variables, name, off)
        if off:
            budget = None   # the template writes an empty block: nothing to close
    elif mode != "auto" or off:
        where = "this model's chat template" if own else f"the named template {p.template!r}"
        if fmt == NONE and mode == "auto":
            pass   # a budget of 0 where there is no block: nothing to do, nothing to say
        elif fmt == NONE:
            warnings.append(f"thinking={'off' if off else 'on'}: {where} shows no reasoning format, so there "
                            "is nothing to switch; the model answers as it does.")
        elif off:
            budget = 0
            if mode == "off":   # a budget of 0 asks for exactly this: no warning then
                why = "only lowers reasoning_effort" if name == "reasoning_effort" and fmt == GPT_OSS \
                    else "has no switch"
                warnings.append(f"thinking=off: {where} {why}; the reasoning block is closed as soon as it opens.")
        else:
            warnings.append(f"thinking=on: {where} has no thinking switch; it thinks as its template does.")
    if variables != dict(p.variables):
        p = replace(p, variables=variables)
    return Plan(fmt, p, budget, warnings)


__all__ = ["Plan", "plan"]
