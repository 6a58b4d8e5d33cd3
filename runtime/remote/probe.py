"""What a server serves: the model, its context, and the endpoints it has beyond the OpenAI API
(llama-server's /infill, /props and /tokenize; llama_cpp.server's /extras/tokenize)."""
from __future__ import annotations

import logging
from typing import Any

from ..engine import ModelInfo, Weights
from ..errors import InvalidRequest, ModelNotFound, RemoteProtocolError
from .client import Client, RemoteRef

log = logging.getLogger("a3b.remote")


class RemoteWeights(Weights):
    """What `probe` found out about the server: its model, context, endpoints."""

    size_bytes = 0

    def __init__(self, ref: RemoteRef, client: Client, info: ModelInfo, features: dict[str, Any]):
        self.ref, self.client, self.info, self.features = ref, client, info, features

    def free(self) -> None:
        self.client.close()


def probe(ref: RemoteRef) -> RemoteWeights:
    """Ask the server what it serves and which of the endpoints beyond the OpenAI API it has."""
    client = Client(ref)
    try:
        listing = client.get("/models")
        if not isinstance(listing, dict) or not isinstance(listing.get("data"), list):
            raise RemoteProtocolError(f"The server at {ref.base} is not an OpenAI-compatible server: GET /models "
                                      "did not answer with a model list. Check the URL (usually ending in /v1).")
        name = _model_name(ref, [m.get("id") for m in listing["data"]
                                 if isinstance(m, dict) and isinstance(m.get("id"), str)])
        props = client.get("/props", root=True, expect_json=False) if client.status("/props", root=True) == 200 else {}
        props = props if isinstance(props, dict) else {}
        settings = props.get("default_generation_settings")
        n_ctx = (settings.get("n_ctx") if isinstance(settings, dict) else None) or props.get("n_ctx") or 0
        tokenize = None
        if isinstance(client.try_post("/tokenize", {"content": "a"}, root=True), dict):
            tokenize = "/tokenize"
        elif isinstance(client.try_post("/extras/tokenize", {"input": "a"}, root=True), dict):
            tokenize = "/extras/tokenize"
        features = {
            "server": "llama-server" if props else ("llama_cpp.server" if tokenize == "/extras/tokenize" else "openai"),
            "infill": bool(props) and _fills_in(client),
            "tokenize": tokenize,
            "n_ctx": n_ctx if isinstance(n_ctx, int) and not isinstance(n_ctx, bool) and n_ctx > 0 else 0,
        }
        modalities = props.get("modalities")
        if isinstance(modalities, dict) and modalities.get("vision") is True:   # llama-server with --mmproj
            features["vision"] = True
        template = props.get("chat_template")
        info = ModelInfo(name=name, path=ref.url, architecture="remote", file_type=None, n_ctx_train=0,
                         n_vocab=0, n_embd=0, n_layer=0, size_bytes=0,
                         chat_template=template if isinstance(template, str) and template else None,
                         special_tokens={}, add_bos=False, engine=f"remote: {features['server']} at {ref.base}")
        missing = [what for what, ok in (("fill-in-the-middle (/infill)", features["infill"]),
                                         ("exact token counts (/tokenize)", tokenize)) if not ok]
        if missing:
            log.info("%s at %s cannot give: %s; prompts use a prefix, counts an estimate",
                     features["server"], ref.base, ", ".join(missing))
        return RemoteWeights(ref, client, info, features)
    except BaseException:
        client.close()
        raise


#: An /infill request that llama-server refuses before it tokenizes anything: it first checks that
#: the model has FIM tokens (501 where not), then the fields (400: `input_extra` is not a list;
#: a3b serve checks the same). The one-token bound is for a server that would take it anyway.
INFILL_PROBE = {"input_prefix": "", "input_suffix": "", "input_extra": "probe", "n_predict": 1, "max_tokens": 1}


def _fills_in(client: Client) -> bool:
    """Whether the server's /infill fills in the middle: llama-server has /infill for every model,
    and answers it with 501 where the model has no FIM tokens."""
    return client.status("/infill", root=True, body=INFILL_PROBE) not in (404, 405, 501)


def _model_name(ref: RemoteRef, ids: list[str]) -> str:
    """The model to use: the one after '#' in the reference, or the server's only one."""
    if ref.model is not None:
        if ref.model not in ids:
            raise ModelNotFound(f"The server at {ref.base} does not serve {ref.model!r}; it serves: "
                                f"{', '.join(ids[:20]) or 'nothing'}. Put one of those after '#'.")
        return ref.model
    if len(ids) == 1:
        return ids[0]
    if ids:
        raise InvalidRequest(f"The server at {ref.base} serves several models ({', '.join(ids[:20])}); add the one "
                             f"to use after '#', e.g. {ref.base}#{ids[0]}.")
    raise ModelNotFound(f"The server at {ref.base} serves no model yet.")
