"""The options of a request and of the servers: sampling, confidence spans, the request's limits,
thinking and structured output, llama-server's and Ollama's own fields, routing by task type, the
servers' tokens, images and grammars; the options of each runtime type and `OPTIONS`, every option
by name."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from .load import LOAD_OPTIONS, MAX_CONTEXT, N_CTX
from .option import Option

#: Embedding pooling over a text's tokens (llama.cpp's own pooling types).
POOLINGS = ("mean", "cls", "last")
#: Whether a thinking model reasons before its answer.
THINKING_MODES = ("auto", "on", "off")

# -- sampling (SamplingParams) ------------------------------------------------------------------------------
TEMPERATURE = Option("temperature", float, 0.4, "Sampling temperature; 0 = always the likeliest token.",
                     min=0.0, max=2.0, step=0.05)   # OpenAI's range
TOP_P = Option("top_p", float, 0.95,
               "Nucleus sampling: the smallest set of tokens whose probabilities sum to top_p.",
               min=0.0, low_open=True, max=1.0, step=0.01)
TOP_K = Option("top_k", int, 40, "Sample among the top_k likeliest tokens; 0 = off.",
               min=0, max=1 << 20)   # beyond the vocabulary it means all of it
MIN_P = Option("min_p", float, 0.05, "Drop tokens below min_p times the likeliest token's probability.",
               min=0.0, max=1.0, high_open=True, step=0.01)
REPEAT_PENALTY = Option("repeat_penalty", float, 1.1, "Penalty on recently seen tokens; 1 = off.",
                        min=0.0, low_open=True, max=2.0, step=0.01)
REPEAT_LAST_N = Option("repeat_last_n", int, 64, "Recent tokens the repeat penalty looks at; 0 = none.",
                       min=0, max=MAX_CONTEXT)
#: the samplers a request may order, and their order when it gives none (llama-server's names)
SAMPLER_NAMES = ("top_k", "penalties", "top_p", "min_p", "temperature", "infill")
SAMPLERS = Option("samplers", tuple, None,
                  "The order in which the samplers apply, as llama-server's field names them (top_k, penalties, "
                  "top_p, min_p, temperature, infill); one left out does not apply. Default: top_k, penalties, "
                  "top_p, min_p, temperature.", choices=SAMPLER_NAMES, nullable=True)
IGNORE_EOS = Option("ignore_eos", bool, False,
                    "Never end at the model's end-of-generation token: generate up to max_tokens (or a stop "
                    "string); llama-server's and vLLM's field of the same name.")
SEED = Option("seed", int, None, "Sampler seed: the same seed and settings give the same text.",
              min=0, max=2**32 - 1, nullable=True)   # None: a fresh seed per request, recorded in the result


def wrap_seed(value: Any) -> Any:
    """An integer seed brought into llama.cpp's 32 bits (ComfyUI's seed widget and OpenAI clients send
    up to 64); anything else as it is, for the check to name."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value % (SEED.max + 1)
    return value


# -- confidence (ConfidenceConfig) and the request (GenerationRequest) -------------------------------------
THRESHOLD = Option("threshold", float, 2.1,
                   "Entropy (nats) of the next-token distribution above which a token is low-confidence.",
                   # no distribution over 2**20 tokens or fewer has an entropy above ln(2**20) = 13.9 nats
                   min=0.0, low_open=True, max=16.0, step=0.1, label="confidence threshold")
MIN_RUN = Option("min_run", int, 5, "Consecutive low-confidence tokens that make a low-confidence span.",
                 min=1, max=MAX_CONTEXT)
MAX_TOKENS = Option("max_tokens", int, 512, "Most tokens to generate.", min=1, max=MAX_CONTEXT)
LOGPROBS = Option("logprobs", int, None,
                  "Log-probabilities reported with every token: the sampled token's and this many likeliest "
                  "alternatives'.", min=0, max=20, nullable=True)   # OpenAI's top_logprobs range

# -- thinking models and structured output (GenerationRequest) ---------------------------------------------
THINKING = Option("thinking", str, "auto",
                  "Reasoning before the answer (thinking models): auto = as the model's template does unasked, on, "
                  "or off (off where the template has a switch; otherwise the block is closed as soon as it opens).",
                  choices=THINKING_MODES)
REASONING_BUDGET = Option("reasoning_budget", int, None,
                          "Most reasoning tokens; at the limit the reasoning block is closed and the model answers "
                          "(0 = thinking off).", min=0, max=MAX_CONTEXT, nullable=True)   # None: no limit
MAX_TOTAL_TOKENS = Option("max_total_tokens", int, None,
                          "Most tokens of reasoning and answer together (max_tokens counts the answer alone).",
                          min=1, max=MAX_CONTEXT, nullable=True)   # None: the context is the limit
JSON_SCHEMA = Option("json_schema", dict, None,
                     "The JSON schema the answer must follow (compiled by llguidance; with thinking on it applies "
                     "to the answer only). A keyword that cannot be enforced is refused, naming it.", nullable=True)
#: `a3b generate`'s alone: where the reasoning is printed
SHOW_REASONING = Option("show_reasoning", bool, False,
                        "Print the reasoning on stdout before the answer (default: dimmed on stderr).")

POOLING = Option("pooling", str, POOLINGS[0], "How a text's token vectors become one vector.", choices=POOLINGS)
NORMALIZE = Option("normalize", bool, True, "Unit length, so a dot product is the cosine similarity.")

# -- llama-server's own fields, as `a3b serve` takes them ---------------------------------------------------
N_PREDICT = Option("n_predict", int, -1, "Most tokens to generate; -1 or 0 = the default.", min=-1,
                   max=MAX_TOKENS.max)
#: /infill's answer length where a request gives none: its editor clients expect short answers
INFILL_N_PREDICT = replace(N_PREDICT, default=128, min=1, help="Most tokens of an /infill answer.")
T_MAX_PREDICT_MS = Option("t_max_predict_ms", int, 0, "Time limit of an /infill generation, in ms; 0 = none.",
                          min=0, max=10**7)
N_INDENT = Option("n_indent", int, 0,
                  "Every line of the answer after the first must be indented by at least this many spaces or tabs; "
                  "the first one that is not ends the answer there (llama-server's field; 0 = off).",
                  min=0, max=MAX_CONTEXT)

# -- Ollama's request options, as `a3b serve` takes them (serve/ollama_protocol.py) ------------------------
NUM_PREDICT = Option("num_predict", int, -1,
                     "Most tokens to generate (Ollama's option); -1 = until the answer ends or the context is full.",
                     min=-1, max=MAX_CONTEXT)
NUM_CTX = replace(N_CTX, help="Context tokens of the request (Ollama's option): at most the served model's context, "
                  "which is fixed when it loads; a smaller value bounds prompt and answer together.")
KEEP_ALIVE = Option("keep_alive", float, None,
                    "How long a model stays loaded after a request (Ollama's keep_alive), in seconds or as a duration "
                    "such as 5m; 0 = unload once idle, negative = keep loaded; left out = the store's own policy "
                    "(loaded until evicted or unloaded).", min=-1e9, max=1e9, nullable=True)

# -- routing requests by task type (runtime/routing.py) -----------------------------------------------------
#: how a request's text becomes a vector for routing: the model's input token embeddings (a lookup in the
#: memory-mapped GGUF, no pass through the model) or its pooled output embedding (one pass over the head)
ROUTE_EMBEDDINGS = ("tokens", "model")
ROUTE_EMBEDDING = Option("route_embedding", str, "tokens",
                         "How the router embeds a request: tokens = the embedding model's input token vectors "
                         "(a table lookup, well under a millisecond), model = its pooled output embedding (one "
                         "pass through the model over the head of the request).", choices=ROUTE_EMBEDDINGS)
ROUTE_HEAD_TOKENS = Option("route_head_tokens", int, 48,
                           "Tokens of a request the router reads (the start of the last user message).",
                           min=4, max=4096)
ROUTE_RULE_HITS = Option("route_rule_hits", int, 2,
                         "Code signs (fences, file names, language keywords) that let the rules decide a request "
                         "for the code route without embedding it; 0 = always embed.", min=0, max=64)

# -- the servers' tokens ------------------------------------------------------------------------------------
LSP_TOKEN = Option("token", str, None, "Shared secret TCP/WebSocket editors must send.", nullable=True,
                   env="A3B_LSP_TOKEN")
SERVE_TOKEN = Option("token", str, None, "Bearer token every request must carry.", nullable=True,
                     env="A3B_SERVE_TOKEN")

# -- images (images.py) ----------------------------------------------------------------------------------
IMAGE_MAX_PIXELS = Option("image_max_pixels", int, 50_000_000,
                          "Largest image taken, in pixels (width x height), checked before it is decoded; the "
                          "projector then resizes it to what its model was trained on.", min=1, max=1 << 31,
                          env="A3B_IMAGE_MAX_PIXELS")
IMAGE_MAX_BYTES = Option("image_max_bytes", int, 32 << 20,
                         "Largest encoded image file taken (PNG, JPEG, ...), in bytes.", min=1, max=1 << 31,
                         env="A3B_IMAGE_MAX_BYTES")

# -- structured output (llama/grammar.py) -------------------------------------------------------------------
GRAMMAR_MAX_BYTES = Option("grammar_max_bytes", int, 256 << 10,
                           "Largest json_schema (as JSON text) or GBNF grammar taken, in bytes; a larger one is "
                           "refused before it is compiled.", min=1, max=1 << 30, env="A3B_GRAMMAR_MAX_BYTES")
GRAMMAR_TIMEOUT_S = Option("grammar_timeout_s", float, 10.0,
                           "Longest a json_schema or grammar may take to compile (off the request queue), in seconds; "
                           "a slower one is refused.", min=0.0, max=3600.0, low_open=True,
                           env="A3B_GRAMMAR_TIMEOUT_S")

#: the options of each runtime type, by field name (LOAD_OPTIONS: load.py)
SAMPLING_OPTIONS = {o.name: o for o in (TEMPERATURE, TOP_P, TOP_K, MIN_P, REPEAT_PENALTY, REPEAT_LAST_N, SEED,
                                        IGNORE_EOS, SAMPLERS)}
CONFIDENCE_OPTIONS = {o.name: o for o in (THRESHOLD, MIN_RUN)}
REQUEST_OPTIONS = {o.name: o for o in (MAX_TOKENS, LOGPROBS, THINKING, REASONING_BUDGET, MAX_TOTAL_TOKENS,
                                        JSON_SCHEMA, N_INDENT)}
#: every option above, by name
OPTIONS = {**LOAD_OPTIONS, **SAMPLING_OPTIONS, **CONFIDENCE_OPTIONS, **REQUEST_OPTIONS, POOLING.name: POOLING,
           NORMALIZE.name: NORMALIZE, IMAGE_MAX_PIXELS.name: IMAGE_MAX_PIXELS, IMAGE_MAX_BYTES.name: IMAGE_MAX_BYTES,
           GRAMMAR_MAX_BYTES.name: GRAMMAR_MAX_BYTES, GRAMMAR_TIMEOUT_S.name: GRAMMAR_TIMEOUT_S,
           **{o.name: o for o in (ROUTE_EMBEDDING, ROUTE_HEAD_TOKENS, ROUTE_RULE_HITS)}}


__all__ = ["POOLINGS", "THINKING_MODES", "TEMPERATURE", "TOP_P", "TOP_K", "MIN_P", "REPEAT_PENALTY", "REPEAT_LAST_N",
           "SAMPLER_NAMES", "SAMPLERS", "IGNORE_EOS", "SEED", "wrap_seed", "THRESHOLD", "MIN_RUN", "MAX_TOKENS",
           "LOGPROBS", "THINKING", "REASONING_BUDGET", "MAX_TOTAL_TOKENS", "JSON_SCHEMA", "SHOW_REASONING",
           "POOLING", "NORMALIZE", "N_PREDICT", "INFILL_N_PREDICT", "T_MAX_PREDICT_MS", "N_INDENT", "NUM_PREDICT",
           "NUM_CTX", "KEEP_ALIVE", "ROUTE_EMBEDDINGS", "ROUTE_EMBEDDING", "ROUTE_HEAD_TOKENS", "ROUTE_RULE_HITS",
           "LSP_TOKEN", "SERVE_TOKEN", "IMAGE_MAX_PIXELS", "IMAGE_MAX_BYTES", "GRAMMAR_MAX_BYTES",
           "GRAMMAR_TIMEOUT_S", "SAMPLING_OPTIONS", "CONFIDENCE_OPTIONS", "REQUEST_OPTIONS", "OPTIONS"]
