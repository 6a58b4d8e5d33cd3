"""Typed errors. Every failure a user can cause is one of these, with a message that says what to do.

Nodes show the message in ComfyUI's error panel, the language server answers with it, and the CLI
prints it as one line and exits non-zero.
"""
from __future__ import annotations


class A3BError(Exception):
    """Base class of every error the runtime raises on purpose."""

    #: Short machine-readable code, used by the language server and the HTTP routes.
    code = "a3b_error"


class LlamaCppUnavailable(A3BError):
    code = "llama_cpp_unavailable"


class ModelNotFound(A3BError):
    code = "model_not_found"


class PathNotAllowed(A3BError):
    code = "path_not_allowed"


class NotGGUF(A3BError):
    code = "not_gguf"


class TruncatedGGUF(A3BError):
    code = "truncated_gguf"


class CorruptGGUF(A3BError):
    """A GGUF whose structure is invalid, or that makes llama.cpp's loader crash."""

    code = "corrupt_gguf"


class UnsupportedArchitecture(A3BError):
    code = "unsupported_architecture"


class ChecksumMismatch(A3BError):
    code = "checksum_mismatch"


class ModelLoadFailed(A3BError):
    code = "model_load_failed"


class ContextTooLarge(A3BError):
    """n_ctx asked beyond the model's trained context while the policy is 'refuse'."""

    code = "context_too_large"


class PromptTooLong(A3BError):
    code = "prompt_too_long"


class InvalidRequest(A3BError):
    code = "invalid_request"


class InvalidImage(InvalidRequest):
    """An image that cannot be used: not an image, damaged, empty, too large, a bad tensor."""


class VisionUnavailable(InvalidRequest):
    """Images were sent to a model that has no multimodal projector loaded."""


class Cancelled(A3BError):
    code = "cancelled"


class ModelUnloaded(A3BError):
    """The model was unloaded (explicitly or by eviction) while a request waited or ran."""

    code = "model_unloaded"


class EmbeddingsUnsupported(A3BError):
    code = "embeddings_unsupported"


class RemoteError(A3BError):
    """An OpenAI-compatible server used as a remote engine failed; the message names the server."""

    code = "remote_error"


class RemoteUnreachable(RemoteError):
    code = "remote_unreachable"


class RemoteAuthFailed(RemoteError):
    code = "remote_auth_failed"


class RemoteProtocolError(RemoteError):
    """The server does not answer as an OpenAI-compatible server does, or broke off an answer."""

    code = "remote_protocol_error"
