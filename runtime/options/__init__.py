"""Every option a caller can choose, declared once: name, type, default, bounds or choices, help
text and environment variable, in one `Option` each.

The package, by job: `option.py` is the `Option` itself and what every surface does with one
(`check`, `add_argument`); `load.py` the load options and `LoadSpec`; `request.py` the options of a
request and of the servers, the options of each runtime type and `OPTIONS`, every option by name.
Callers take every name from the package (`from ..options import N_CTX`, `opt.N_CTX`), never from
one of its modules.

The runtime's own types take their defaults and checks from these declarations (`LoadSpec`,
SamplingParams and ConfidenceConfig in generation.py, GenerationRequest in requests.py), and every
surface reads the same ones: the CLI's flags (`add_argument`), the ComfyUI node widgets (nodes/defs.py
maps an Option to an INT/FLOAT/COMBO input), the language-server settings (lsp_server/config.py) and
`a3b serve`'s request parsing (`check`). A surface that deliberately means something else (the
language server's own completion length, a widget that cannot hold None) declares its own Option
instead of writing a second default. The lists of choices here are the only ones in the project.
A value's form beyond its type and choices (speculative's `draft:MODEL`) is declared on its Option
too (`form`), so that `check` alone decides it on every surface. A spec is checked by `validate()`
before any weights load, so a typo in a KV cache type fails in microseconds with a message instead
of inside llama.cpp. Environment variables are declared in environment.py.
"""
from __future__ import annotations

# each module names its public names in __all__; they are the package's names
from .load import *  # noqa: F403
from .load import __all__ as _load
from .option import *  # noqa: F403
from .option import __all__ as _option
from .request import *  # noqa: F403
from .request import __all__ as _request

__all__ = [*_option, *_load, *_request]
