"""The environment variables the package reads, declared once, and the one way to read them.

Each `Variable` names its default (the value when it is unset or empty) and who reads it;
docs/configuration.md documents the same names, and a test keeps the two lists equal both ways and
checks that no source reads an `A3B_*` variable that is not declared here. Readers call `env()` (or
one of its typed forms) when they need the value, not at import, so that a value set before the first
use counts; docs/configuration.md marks the few still read once at import.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

log = logging.getLogger("a3b")

#: values of an on/off environment variable that mean off (any case, spaces around ignored)
OFF_WORDS = ("0", "off", "no", "false")


def switched_off(value: str) -> bool:
    """Whether an on/off environment variable's value says off."""
    return value.strip().lower() in OFF_WORDS


@dataclass(frozen=True)
class Variable:
    name: str
    #: the value when unset or empty, as text; None: unset means none, empty or off
    default: str | None
    help: str
    #: the modules that read it
    readers: tuple[str, ...]


VARIABLES: dict[str, Variable] = {v.name: v for v in (
    Variable("A3B_MODELS", None, "folders searched for a model given by name (os.pathsep-separated)",
             ("runtime/models/locate.py",)),
    Variable("A3B_LORAS", None, "more folders for GGUF LoRA adapters (os.pathsep-separated)",
             ("nodes/comfy.py", "runtime/models/locate.py")),
    Variable("A3B_CACHE", None, "the cache folder (default: $XDG_CACHE_HOME or ~/.cache, /comfyui-a3b)",
             ("runtime/options/option.py",)),
    Variable("A3B_MEMORY_BUDGET_MB", None, "memory budget of the model store, in MiB", ("runtime/models/store.py",)),
    Variable("A3B_VET", "on", "off: no crash isolation for unseen GGUF files", ("runtime/models/vet.py",)),
    Variable("A3B_VET_DECODE_MAX_GB", "4", "files larger than this many GiB are not decoded while vetted",
             ("runtime/models/vet.py",)),
    Variable("A3B_IMAGE_MAX_PIXELS", None, "largest image taken, in pixels (default 50000000)",
             ("runtime/images.py",)),
    Variable("A3B_IMAGE_MAX_BYTES", None, "largest encoded image file taken, in bytes (default 33554432)",
             ("runtime/images.py",)),
    Variable("A3B_GRAMMAR_MAX_BYTES", None, "largest json_schema (JSON text) or GBNF grammar taken, in bytes "
             "(default 262144)", ("runtime/grammars.py",)),
    Variable("A3B_GRAMMAR_TIMEOUT_S", None, "longest a json_schema or grammar may take to compile, in seconds "
             "(default 10)", ("runtime/grammars.py",)),
    Variable("A3B_CPU_REPACK", "on", "off: no llama.cpp CPU weight repacking", ("runtime/models/vet.py",)),
    Variable("A3B_SAMPLE_THREADS", None, "threads sampling the rows of one decode step (default: the CPU cores, "
             "at most 16; 0 or 1: off)", ("runtime/llama/backend.py",)),
    Variable("A3B_COUNT_PASSES", "off", "on: count llama.cpp's passes through the model per decode step (slower)",
             ("runtime/llama/passes.py",)),
    Variable("A3B_MALLOC_TUNING", "on", "off: leave glibc's allocator alone", ("runtime/models/memory.py",)),
    Variable("A3B_PRELOAD_LLAMA", "on", "off: do not import llama-cpp-python early for the library order",
             ("runtime/llama/cxxruntime.py",)),
    Variable("A3B_VRAM_POLICY", "offload", "offload, resident or unload-after-run when ComfyUI needs VRAM",
             ("nodes/vram.py",)),
    Variable("A3B_LSP", None, "tcp:HOST:PORT or ws:HOST:PORT: the language server inside ComfyUI",
             ("lsp_server/inprocess.py",)),
    Variable("A3B_LSP_TOKEN", None, "the token language-server clients must send",
             ("lsp_server/__init__.py", "lsp_server/inprocess.py")),
    Variable("A3B_LSP_MAX_CLIENTS", "32", "TCP and WebSocket connections served at once", ("lsp_server/transport.py",)),
    Variable("A3B_LSP_INIT_TIMEOUT_S", "30", "seconds a new connection has to send initialize",
             ("lsp_server/transport.py",)),
    Variable("A3B_LSP_IDLE_TIMEOUT_S", "21600", "seconds an initialized connection may stay silent (0: never)",
             ("lsp_server/transport.py",)),
    Variable("A3B_SERVE", None, "HOST:PORT: `a3b serve` inside ComfyUI", ("serve/inprocess.py",)),
    Variable("A3B_SERVE_TOKEN", None, "the bearer token every request to `a3b serve` must carry",
             ("serve/__init__.py", "serve/inprocess.py")),
    Variable("A3B_SERVE_MODEL", None, "the model the server inside ComfyUI serves", ("serve/inprocess.py",)),
    Variable("A3B_SERVE_ORIGINS", None, "browser Origins the server inside ComfyUI allows (comma-separated)",
             ("serve/inprocess.py",)),
    Variable("A3B_REMOTE_API_KEY", None, "the API key sent to remote OpenAI-compatible servers",
             ("runtime/remote/client.py",)),
    Variable("A3B_REMOTE_MODELS", None, "server URLs that workflows and editors may name (comma-separated)",
             ("runtime/remote/client.py",)),
    Variable("A3B_REMOTE_TIMEOUT", "300", "read timeout for a remote server's answers, in seconds",
             ("runtime/remote/client.py",)),
)}


def env(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The value of the declared variable `name` in `environ` (default: the process's environment),
    or its declared default when it is unset or empty. An undeclared name is a KeyError: declare it
    in VARIABLES (and document it) first."""
    var = VARIABLES[name]
    value = (os.environ if environ is None else environ).get(name)
    return value if value else var.default


def env_on(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """An on/off variable: on unless its value is one of OFF_WORDS."""
    return not switched_off(env(name, environ) or "off")


def env_number(name: str, kind: type = float) -> float | int | None:
    """A numeric variable as `kind`; a value that is not a number logs a warning and counts as the
    default (None where the variable has none)."""
    value, default = env(name), VARIABLES[name].default
    try:
        return None if value is None else kind(float(value)) if kind is int else kind(value)
    except ValueError:
        log.warning("%s=%r is not a number; using %s", name, value, default or "none")
        return None if default is None else kind(default)


def env_list(name: str, environ: Mapping[str, str] | None = None) -> list[str]:
    """A comma-separated variable's non-empty items, stripped."""
    return [part.strip() for part in (env(name, environ) or "").split(",") if part.strip()]


def env_paths(name: str) -> list[str]:
    """A folder list variable's non-empty items (separated by os.pathsep: `:`, `;` on Windows)."""
    return [part for part in (env(name) or "").split(os.pathsep) if part]


def usable_cpus() -> int:
    """The cores this process may run on: its affinity where the system has one (a container or
    `taskset` limits it), else every core."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):   # no affinity on this system (macOS, Windows)
        return os.cpu_count() or 1
