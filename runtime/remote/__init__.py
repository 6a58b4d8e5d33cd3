"""The remote engine: a model served by an OpenAI-compatible server (llama-server, vLLM, SGLang,
Ollama, llama_cpp.server, another process's `a3b serve`), chosen by giving its URL,
`http(s)://HOST:PORT/v1[#MODEL]`, wherever a model path goes.

client.py   the references, the API key, which references network callers may use; HTTP with the
            bounds on what a server may send; server-sent events
probe.py    what a server serves (model, context, endpoints beyond the OpenAI API)
wire.py     which prompt goes to which endpoint; streamed events and embeddings read and checked
model.py    RemoteModel (the engine's Model: requests sent as they are) and the engine
"""
from ..engine import register_engine
from .client import KEY_ENV, LIST_ENV, MAX_ANSWER_BYTES, MAX_EVENT_BYTES, listed, parse_ref
from .model import RemoteEngine, RemoteModel
from .wire import entropy_of

ENGINE = RemoteEngine()
for _scheme in ("http", "https"):
    register_engine(_scheme, ENGINE)

__all__ = ["ENGINE", "KEY_ENV", "LIST_ENV", "MAX_ANSWER_BYTES", "MAX_EVENT_BYTES", "RemoteEngine", "RemoteModel",
           "entropy_of", "listed", "parse_ref"]
