"""Persistent ggml threadpools of a generation context: the struct, which pool runs what, their end."""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from comfyui_a3b.runtime import ConfidenceConfig, Runtime, preset
from comfyui_a3b.runtime.llama import threadpool
from comfyui_a3b.runtime.llama.threadpool import ThreadpoolParams

GREEDY = preset("greedy")
NO_CONF = ConfidenceConfig(enabled=False)


def test_the_params_struct_has_ggml_h_layout():
    # sizeof and offsetof of struct ggml_threadpool_params, printed by a C program built on ggml.h
    assert ctypes.sizeof(ThreadpoolParams) == 528
    assert [getattr(ThreadpoolParams, f).offset for f in ("n_threads", "prio", "poll", "strict_cpu", "paused")] \
        == [512, 516, 520, 524, 525]


class FakeApi:
    """ggml's and llama's pool functions, recording the calls."""

    def __init__(self, fail: bool = False):
        self.calls: list[tuple] = []
        self.fail, self.next = fail, 100

    def ggml_threadpool_params_init(self, p, n):
        p._obj.n_threads = n   # p: ctypes.byref of the struct

    def ggml_threadpool_new(self, p):
        p = p._obj
        self.next += 1
        self.calls.append(("new", p.n_threads, p.paused, p.poll))
        return None if self.fail and p.n_threads > 1 else self.next

    def ggml_threadpool_free(self, tp):
        self.calls.append(("free", tp))

    def ggml_threadpool_pause(self, tp):
        self.calls.append(("pause", tp))

    def llama_attach_threadpool(self, ctx, tp, tpb):
        self.calls.append(("attach", ctx, tp, tpb))


@pytest.fixture
def fake_api(monkeypatch):
    api = FakeApi()
    monkeypatch.setattr(threadpool, "_api", (api, api))
    return api


def test_a_batch_on_the_decode_threads_runs_on_the_decode_pool(fake_api):
    base = threadpool.live_pools()        # pools of models other tests keep loaded in this process
    pools = threadpool.attach("ctx", 4, 8)
    # the single-token pool starts paused (llama.cpp's tools do the same): batches come first
    assert fake_api.calls == [("new", 4, True, threadpool.POLL), ("new", 8, False, threadpool.POLL),
                              ("attach", "ctx", 101, 102)]
    assert threadpool.live_pools() == base + 2
    del fake_api.calls[:]
    pools.use(8)                          # already so: nothing to do
    pools.use(4)                          # the tuner chose the decode threads for a batch
    pools.use(4)
    pools.use(8)
    assert fake_api.calls == [("attach", "ctx", 101, 101), ("attach", "ctx", 101, 102)]
    del fake_api.calls[:]
    pools.idle()
    pools.free()
    assert sorted(fake_api.calls) == [("free", 101), ("free", 102), ("pause", 101), ("pause", 102)]
    assert threadpool.live_pools() == base


def test_equal_counts_share_one_pool_and_a_failed_pool_leaves_none(fake_api):
    base = threadpool.live_pools()
    pools = threadpool.attach("ctx", 2, 2)
    assert fake_api.calls == [("new", 2, False, threadpool.POLL), ("attach", "ctx", 101, 101)]
    pools.free()
    assert fake_api.calls[-1] == ("free", 101) and threadpool.live_pools() == base
    fake_api.fail, fake_api.calls = True, []
    assert threadpool.attach("ctx", 1, 2) is None              # the batch pool failed: no pools at all
    assert [c[0] for c in fake_api.calls] == ["new", "new", "free"] and threadpool.live_pools() == base


def test_no_pools_where_the_build_lacks_them(monkeypatch):
    monkeypatch.setattr(threadpool, "_api", False)
    assert threadpool.attach("ctx", 1, 2) is None


def test_the_worker_tells_its_backend_when_work_ends(fake_engine):
    rt = Runtime()
    try:
        m = rt.load("fake://m")
        rt.generate("Hello", model="fake://m", chat=False, max_tokens=4, sampling=GREEDY, confidence=NO_CONF)
        deadline = time.monotonic() + 10
        while getattr(m.backend, "idles", 0) < 1:
            assert time.monotonic() < deadline, "the backend never heard that work ended"
            time.sleep(0.005)
    finally:
        rt.unload()


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _answers(rt: Runtime, spec) -> list[str]:
    out: list[str] = [""] * 4

    def one(i: int):
        out[i] = rt.generate(f"Story number {i}:", model=spec, chat=False, max_tokens=24, sampling=GREEDY,
                             confidence=NO_CONF).text

    ts = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    alone = rt.generate("The capital of France is", model=spec, chat=False, max_tokens=24, sampling=GREEDY,
                        confidence=NO_CONF).text
    return out + [alone]


@pytest.mark.slow
def test_pools_give_the_same_greedy_answers_and_end_with_their_model(default_path, monkeypatch):
    rt = Runtime()
    base = threadpool.live_pools()                            # pools of other tests' loaded models
    spec = rt.spec(str(default_path), n_parallel=4, n_ctx=256)
    m = rt.load(spec)
    assert m.backend.pools is not None                       # this build has them
    sizes = m.backend.pools.sizes
    assert threadpool.live_pools() == base + (1 if sizes[0] == sizes[1] else 2)
    with_pools = _answers(rt, spec)
    rt.unload()
    assert threadpool.live_pools() == base
    before = _threads()
    for _ in range(3):                                        # no thread or pool left behind per load
        m = rt.load(spec)
        rt.generate("Hi", model=spec, chat=False, max_tokens=4, sampling=GREEDY, confidence=NO_CONF)
        rt.unload()
        assert threadpool.live_pools() == base
    assert _threads() <= before
    monkeypatch.setattr(threadpool, "_api", False)            # as a build without them
    m = rt.load(spec)
    assert m.backend.pools is None
    assert _answers(rt, spec) == with_pools
    rt.unload()


@pytest.mark.skipif(shutil.which("gcc") is None or not sys.platform.startswith("linux"),
                    reason="needs gcc with OpenMP on Linux")
def test_the_openmp_team_a_load_leaves_on_its_thread_is_released(tmp_path):
    """An OpenMP parallel region on the loading thread (llama.cpp's AMX weight conversion) leaves idle
    threads that make a second team beside the worker's; the helper the load calls frees them."""
    src = tmp_path / "team.c"
    src.write_text("int team(void) { int n = 0;\n#pragma omp parallel num_threads(3)\n{\n#pragma omp atomic\nn++;\n}\n"
                   "return n; }\n")
    lib = tmp_path / "libteam.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-fopenmp", "-o", str(lib), str(src)], check=True, timeout=120)
    code = textwrap.dedent(f"""
        import ctypes, os
        from comfyui_a3b.runtime.llama.threadpool import release_openmp_threads
        threads = lambda: len(os.listdir("/proc/self/task"))
        before = threads()
        print(ctypes.CDLL({str(lib)!r}).team(), threads() - before)
        print(release_openmp_threads(), threads() - before)
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    team, released = p.stdout.splitlines()
    assert team == "3 2" and released == "True 0"


@pytest.mark.slow
def test_a_load_releases_the_openmp_threads_of_its_own_thread(default_path, monkeypatch):
    """The runtime asks once per load, on the loading thread (where llama.cpp's AMX conversion runs its
    OpenMP region), and the model then decodes as before."""
    calls = []
    real = threadpool.release_openmp_threads
    monkeypatch.setattr(threadpool, "release_openmp_threads",
                        lambda: calls.append(threading.current_thread()) or real())
    rt = Runtime()
    spec = rt.spec(str(default_path), n_parallel=1, n_ctx=256)
    rt.load(spec)
    assert calls == [threading.current_thread()]
    assert rt.generate("Hi", model=spec, chat=False, max_tokens=4, sampling=GREEDY, confidence=NO_CONF).n_tokens == 4
    rt.unload()
