"""On the real embedded model, on a machine kept busy by other processes: a client that closes its
socket while its (non-streamed) prompt is being read frees the model within moments; the prompt
batch that was running is stopped in the middle (llama.cpp's abort callback), not read to its end."""
from __future__ import annotations

import multiprocessing
import os
import time

import pytest

from serve_helpers import raw_request

pytestmark = pytest.mark.slow

TOKEN = "disconnect-token"
LONG = "The lighthouse keepers of the northern coast kept a log of every ship they saw. " * 80


def _burn() -> None:
    while True:
        pass


@pytest.fixture()
def busy_machine():
    """Four processes per core spinning at full speed beside the server, as other work would."""
    procs = [multiprocessing.get_context("spawn").Process(target=_burn, daemon=True)
             for _ in range(4 * (os.cpu_count() or 2))]
    for p in procs:
        p.start()
    try:
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.join(10)


@pytest.fixture(scope="module")
def served(rt):
    from comfyui_a3b.serve import Server

    spec = rt.spec(None, n_parallel=2, n_ctx=4096, n_batch=2048, speculative="off")
    srv = Server(spec, "127.0.0.1", 0, token=TOKEN).start()
    try:
        yield srv
    finally:
        srv.stop()
        rt.unload(spec)


@pytest.mark.parametrize("path,body", [
    ("/infill", {"input_prefix": "# " + LONG + "\ndef f():\n", "input_suffix": "\n", "n_predict": 16}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}], "max_tokens": 16}),
], ids=["infill", "chat"])
def test_a_client_leaving_during_its_prompt_frees_the_model_on_a_busy_machine(rt, served, busy_machine, path, body):
    model = rt.load(served.cfg.spec)
    aborted, left = model.stats["aborted_steps"], served.cfg.stats["disconnects"]
    s = raw_request(served.port, path, body, b"Authorization: Bearer %s\r\n" % TOKEN.encode())
    t0 = time.monotonic()
    while model.stats["decode_calls"] == 0 and not model.busy() and time.monotonic() - t0 < 20:
        time.sleep(0.005)
    time.sleep(0.3)   # inside the prompt batch (it takes seconds here)
    assert model.busy(), "the request ended before the client left: make the prompt longer"
    t0 = time.monotonic()
    s.close()
    while model.busy() and time.monotonic() - t0 < 30:
        time.sleep(0.005)
    idle_after = time.monotonic() - t0
    print(f"{path}: idle {idle_after * 1000:.0f} ms after the client left, on a busy machine")
    assert served.cfg.stats["disconnects"] == left + 1
    assert model.stats["aborted_steps"] == aborted + 1, "the prompt batch ran to its end"
    assert idle_after < 1.0, f"the model was still busy {idle_after:.2f} s after its client left"
