"""Shared fixtures. Everything runs on the real embedded model and real llama.cpp; nothing is mocked."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tinygguf helpers

from tinygguf import write_tiny_gguf  # noqa: E402


@pytest.fixture(scope="session")
def rt():
    """The process's runtime (the same object nodes and the language server use)."""
    from comfyui_a3b.runtime import get_runtime

    return get_runtime()


@pytest.fixture(scope="session")
def default_path():
    from comfyui_a3b.runtime import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def tiny_models(tiny_dir):
    """One tiny random GGUF per supported architecture."""
    return {arch: write_tiny_gguf(tiny_dir / f"tiny-{arch}.gguf", arch) for arch in ("llama", "qwen2", "qwen3")}


@pytest.fixture(autouse=True)
def _model_folders_restored():
    """Folders a test registers with add_model_dir are forgotten after it (no order dependence)."""
    from comfyui_a3b.runtime import locate

    before = list(locate._extra_dirs)
    yield
    locate._extra_dirs[:] = before
