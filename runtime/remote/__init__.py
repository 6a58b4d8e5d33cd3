"""The remote engine: a model served by an OpenAI-compatible server (llama-server, vLLM, SGLang,
Ollama, llama_cpp.server, another process's `a3b serve`), chosen by giving its URL,
`http(s)://HOST:PORT/v1[#MODEL]`, wherever a model path goes. See model.py for what maps to what,
client.py for the references, the API key and which references network callers may use.
"""
from ..engine import register_engine
from .client import KEY_ENV, LIST_ENV, listed, parse_ref
from .model import RemoteEngine, RemoteModel, TextVocab, entropy_of

ENGINE = RemoteEngine()
for _scheme in ("http", "https"):
    register_engine(_scheme, ENGINE)

__all__ = ["ENGINE", "KEY_ENV", "LIST_ENV", "RemoteEngine", "RemoteModel", "TextVocab", "entropy_of", "listed",
           "parse_ref"]
