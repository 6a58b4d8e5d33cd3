"""`POST /v1/completions`: the text completion request, read once from its JSON body: a prompt (a
non-empty string, or one list of token ids), the shared fields (common.py) and structured output
(llama-server's json_schema and grammar, or response_format). Tools and the chat's thinking fields
need a chat: a text completion renders no template, so nothing could honour them.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...runtime.errors import InvalidRequest
from ...runtime.requests import TextPrompt, TokenPrompt
from .common import Generation, Structured, generation_of, structured_of

#: chat fields refused on a text completion
CHAT_ONLY = ("reasoning_budget", "max_total_tokens", "reasoning_effort", "think", "chat_template_kwargs")


@dataclass(frozen=True)
class CompletionRequest:
    prompt: TextPrompt | TokenPrompt
    gen: Generation
    structured: Structured = Structured()

    def settings(self) -> dict:
        """Runtime.submit's keywords of this completion."""
        return {**self.gen.settings(), **self.structured.settings()}


def parse_completion(body: dict) -> CompletionRequest:
    """The text completion of a JSON body, or InvalidRequest naming the field that does not fit."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        typed: TextPrompt | TokenPrompt = TokenPrompt(tuple(prompt))
    elif isinstance(prompt, str) and prompt:
        typed = TextPrompt(prompt)
    else:
        raise InvalidRequest("prompt must be a non-empty string (or one list of token ids).")
    if body.get("tools"):
        raise InvalidRequest("tools need the chat endpoint (/v1/chat/completions).")
    for name in CHAT_ONLY:
        if body.get(name) is not None:
            raise InvalidRequest(f"{name} applies to chat requests (/v1/chat/completions), not to a text completion.")
    structured = structured_of(body)
    return CompletionRequest(typed, generation_of(body, chat=False), structured)


__all__ = ["CHAT_ONLY", "CompletionRequest", "parse_completion"]
