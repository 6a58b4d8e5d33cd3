"""Fill-in-the-middle prompts: an InfillPrompt as a local model's token ids.

The layout and the budget follow llama-server's /infill, so that an editor plugin written for it
(llama.vim, llama.vscode) gets the same prompt here:

    [BOS] <FIM_PRE> chunks prefix <FIM_SUF> suffix <FIM_MID> middle

* The context chunks come first, each ending with a newline, read together with the prefix: what
  changes only when the caller's window moves stays at the start, so the KV cache of a previous
  prompt covers it while the user types at the end of the prefix.
* The room is the context less the answer (`max_tokens`) and a few tokens of slack. The suffix gets
  at most a quarter of it, the middle what it takes, the prefix the rest, cut from its start (the
  text nearest the cursor stays).
* A model without the three FIM tokens completes `chunks prefix middle` instead, cut from the start.

Every part is tokenized with special-token parsing off: a document that contains "<|endoftext|>"
cannot inject control tokens.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .requests import InfillPrompt

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Vocab

#: Tokens left free beside the prompt and the answer (llama-server keeps a few for its own use).
SLACK = 4
#: The smallest room a prompt gets, however large max_tokens is (the request then fails on the
#: context check with a message, instead of an empty prompt).
MIN_ROOM = 16


def fim_ids(vocab: Vocab) -> tuple[int, int, int] | None:
    """(prefix, suffix, middle) token ids, or None where the model has not all three."""
    st = vocab.special_tokens()
    ids = (st.get("fim_pre", -1), st.get("fim_suf", -1), st.get("fim_mid", -1))
    return ids if min(ids) >= 0 else None


def chunks_text(prompt: InfillPrompt) -> str:
    """The context chunks as the text before the prefix: each ends with a newline."""
    return "".join(c.text if c.text.endswith("\n") else c.text + "\n" for c in prompt.chunks)


def build(prompt: InfillPrompt, vocab: Vocab, n_ctx: int, max_tokens: int) -> list[int]:
    """The token ids of `prompt` for a model with `vocab`, fitted into `n_ctx` beside `max_tokens`."""
    def tok(text: str) -> list[int]:
        return vocab.tokenize(text, add_bos=False, special=False) if text else []

    room = max(MIN_ROOM, n_ctx - max_tokens - SLACK)
    bos = [vocab.bos] if vocab.add_bos and vocab.bos >= 0 else []
    pre = tok(chunks_text(prompt) + prompt.prefix)
    mid = tok(prompt.middle)
    ids = fim_ids(vocab)
    if ids is None:   # no fill-in-the-middle tokens: complete the prefix
        return bos + (pre + mid)[-(room - len(bos)):]
    fim_pre, fim_suf, fim_mid = ids
    suf = tok(prompt.suffix)[:room // 4]
    keep = max(0, room - len(bos) - len(suf) - len(mid) - 3)
    pre = pre[-keep:] if keep else []
    return bos + [fim_pre] + pre + [fim_suf] + suf + [fim_mid] + mid
