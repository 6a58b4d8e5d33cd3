"""Shared fixtures.

Two tiers: tests marked `slow` run the real embedded model on real llama.cpp (nothing mocked); the
rest form the fast tier, pure logic and the real runtime over a small fake engine at the engine seam
(fakeengine.py). `python -m pytest -m "not slow"` runs the fast tier alone.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tinygguf helpers

from serve_helpers import client, server  # noqa: E402, F401  (the fake-model server of the serve tests)
from tinygguf import write_tiny_gguf  # noqa: E402


class _RootIsNotATestPackage:
    """Collect the repository root as a plain directory, not as a Python package.

    The root holds the pack's `__init__.py` (ComfyUI imports the folder as a package), so pytest
    would collect it as a package and import that file under the folder's name to look for setup
    functions. A clone named `comfyui-a3b` is not an importable name, and the file's relative
    imports then fail. The tests import the pack as the installed package `comfyui_a3b` instead.
    """

    @pytest.hookimpl(tryfirst=True)
    def pytest_collect_directory(self, path, parent):
        if Path(path).resolve() == ROOT:
            return pytest.Dir.from_parent(parent, path=path)
        return None


def _share_the_cores() -> None:
    """Under pytest-xdist, each worker runs on its own share of the cores (and so do the processes it
    starts). llama.cpp sizes its thread pools from the cores a process may use, and its threads spin
    at a barrier after every operation: two workers that each took every core would preempt each
    other's spinning threads (the slow tier took longer on two workers than on one)."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count < 2 or not hasattr(os, "sched_setaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= count:
        os.sched_setaffinity(0, cpus[int(worker[2:]) % count::count])


def pytest_configure(config):
    config.pluginmanager.register(_RootIsNotATestPackage(), "a3b-root-is-not-a-test-package")
    _share_the_cores()


@pytest.fixture(scope="session")
def rt():
    """The process's runtime (the same object nodes and the language server use)."""
    from comfyui_a3b.runtime import get_runtime

    return get_runtime()


@pytest.fixture()
def remote_models_unloaded(rt):
    """Models on remote servers that a test loaded are unloaded after it."""
    yield
    for e in rt.store.loaded():
        if e.spec.path.startswith("http"):
            rt.unload(e.spec)


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
    from comfyui_a3b.runtime.models import locate

    before = list(locate._extra_dirs)
    yield
    locate._extra_dirs[:] = before


@pytest.fixture()
def draft_cost_at_prior(monkeypatch):
    """How many tokens a request drafts follows the step times its model measured (StepCost in
    runtime/local/speculative.py): on a busy core, as a parallel test run's worker has, a drafted
    token can cost a whole step and drafting pauses. Tests whose point needs drafts hold the cost
    at its prior; the cost model itself is tested in tests/test_speculative.py."""
    from comfyui_a3b.runtime.local.speculative import StepCost

    monkeypatch.setattr(StepCost, "extra_at", lambda self, rows=1: self._prior)


@pytest.fixture(scope="session")
def fake_engine():
    """The fake engine (tests/fakeengine.py), registered for `fake://` model references."""
    import fakeengine

    return fakeengine.install()


@pytest.fixture(scope="module", params=["fake", pytest.param("real", marks=pytest.mark.slow)])
def srv(request, fake_engine):
    """A language server to start: over the fake engine (fast tier) or the embedded model (slow)."""
    from lsp_helpers import SERVERS

    return SERVERS[request.param]
