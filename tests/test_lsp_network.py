"""The language server over TCP and WebSocket: several editors on one process, the token, loopback
only, disconnects, limits, and the in-process server sharing ComfyUI's loaded model.

Server tests run over the fake engine (fast tier) and the embedded model (`slow`); see conftest's `srv`."""
from __future__ import annotations

import asyncio
import os
import re
import socket
import time

import psutil
import pytest
import pytest_asyncio
from lsprotocol import types as T
from pytest_lsp import client_capabilities
from pytest_lsp.client import make_test_lsp_client

from lsp_helpers import SAMPLE, SINGLE, RawClient, Server, inline, model_stats, open_doc, status

pytestmark = pytest.mark.asyncio(loop_scope="module")
TOKEN = "s3cret-token"


async def start_server(srv: Server, kind: str, *extra: str, env_token: str | None = None, env: dict | None = None):
    env = {**os.environ, **(env or {})}
    env.pop("A3B_LSP_TOKEN", None)
    if env_token:
        env["A3B_LSP_TOKEN"] = env_token
    proc = await asyncio.create_subprocess_exec(*srv.command, f"--{kind}", "127.0.0.1:0", *extra,
                                                stderr=asyncio.subprocess.PIPE, env=env)

    async def port() -> int:
        while line := (await proc.stderr.readline()).decode():
            m = re.search(r"listening on (tcp|ws)://127\.0\.0\.1:(\d+)", line)
            if m:
                return int(m.group(2))
        raise AssertionError("the server exited before listening")

    try:
        return proc, await asyncio.wait_for(port(), 60)
    except asyncio.TimeoutError:
        await stop_server(proc)
        raise AssertionError(f"the {kind} server did not say it was listening within 60 s") from None


async def stop_server(proc) -> None:
    proc.terminate()
    try:
        await asyncio.wait_for(proc.wait(), 10)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()


def non_loopback_ipv4() -> str | None:
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return None


async def lsp_client(kind: str, port: int, token: str | None):
    client = make_test_lsp_client()
    await (client.start_tcp if kind == "tcp" else client.start_ws)("127.0.0.1", port)
    await client.initialize_session(T.InitializeParams(
        capabilities=client_capabilities("neovim"), initialization_options={"token": token, "debounceMs": 0}))
    return client


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def tcp_server(srv):
    proc, port = await start_server(srv, "tcp", "--token", TOKEN)
    yield port
    await stop_server(proc)


async def test_two_editors_share_one_tcp_server_and_one_model(tcp_server):
    a = await lsp_client("tcp", tcp_server, TOKEN)
    b = await lsp_client("tcp", tcp_server, TOKEN)
    try:
        for c, name in ((a, "a"), (b, "b")):
            open_doc(c, f"file:///w/{name}.py", SAMPLE)
        got_a, got_b = await asyncio.gather(inline(a, "file:///w/a.py", SINGLE), inline(b, "file:///w/b.py", SINGLE))
        assert got_a and got_b
        st = await status(b)
        assert st["server"]["clients"] == 2
        assert st["runtime"]["weight_loads"] == 1          # one process, one copy of the weights
        assert st["open_documents"] == 1                   # each editor has its own workspace
        # exit closes only that editor's connection; the other keeps working
        await a.shutdown_session()
        for _ in range(50):
            if (await status(b))["server"]["clients"] == 1:
                break
            await asyncio.sleep(0.1)
        assert (await status(b))["server"]["clients"] == 1
        assert await inline(b, "file:///w/b.py", SINGLE) == got_b
    finally:
        await b.shutdown_session()
        await a.stop()
        await b.stop()


async def test_tcp_token_is_required(tcp_server):
    for token in (None, "wrong"):
        raw = await RawClient.tcp("127.0.0.1", tcp_server)
        res = await raw.initialize(options={"token": token} if token else None)
        assert res["error"]["code"] == -32001 and "token" in res["error"]["message"]
        assert await raw.recv(10) is None   # and the connection is closed
        await raw.close()
    raw = await RawClient.tcp("127.0.0.1", tcp_server)
    raw.request(5, "workspace/executeCommand", {"command": "a3b.status"})   # no initialize at all
    assert (await raw.response(5))["error"]["code"] == -32001
    await raw.close()


async def test_websocket_initialize_with_a_wrong_token_gets_its_error_before_the_close(srv):
    from websockets.asyncio.client import connect

    proc, port = await start_server(srv, "ws", env_token=TOKEN)
    try:
        async with connect(f"ws://127.0.0.1:{port}") as ws:
            await ws.send('{"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"capabilities": {}, '
                          '"initializationOptions": {"token": "wrong"}}}')
            reply = await asyncio.wait_for(ws.recv(), 30)
            assert '"code": -32001' in reply.replace('"code":-32001', '"code": -32001')
            await asyncio.wait_for(ws.wait_closed(), 30)
    finally:
        await stop_server(proc)


async def test_connection_limit_and_initialize_timeout(srv):
    proc, port = await start_server(srv, "tcp", env={"A3B_LSP_MAX_CLIENTS": "2", "A3B_LSP_INIT_TIMEOUT_S": "1.5"})
    try:
        a = await RawClient.tcp("127.0.0.1", port)
        b = await RawClient.tcp("127.0.0.1", port)
        await asyncio.sleep(0.2)
        c = await RawClient.tcp("127.0.0.1", port)     # the third is refused, with a reason
        msg = await c.recv(10)
        assert msg["error"]["code"] == -32000 and "Too many connections" in msg["error"]["message"]
        assert await c.recv(10) is None
        await a.initialize()
        # b never initializes: closed after the initialize timeout, a (initialized) stays
        t0 = time.monotonic()
        assert await b.recv(10) is None and time.monotonic() - t0 < 5
        a.request(7, "workspace/executeCommand", {"command": "a3b.status"})
        assert "result" in await a.response(7)
        for x in (a, b, c):
            await x.close()
    finally:
        await stop_server(proc)


async def test_tcp_refuses_a_peer_that_is_not_loopback(tcp_server):
    ip = non_loopback_ipv4()
    if ip is None:
        pytest.skip("this machine has no non-loopback IPv4 address to connect from")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((ip, 0))      # a packet from a non-loopback source, to the loopback listener
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", tcp_server))
    raw = await RawClient.tcp(None, None, sock=sock)
    raw.request(0, "initialize", {"processId": None, "rootUri": None, "capabilities": {},
                                  "initializationOptions": {"token": TOKEN}})
    assert await raw.recv(10) is None   # closed without an answer
    await raw.close()


async def test_disconnect_mid_generation_stops_it_and_leaks_nothing(tcp_server):
    watcher = await lsp_client("tcp", tcp_server, TOKEN)
    try:
        before = model_stats(await status(watcher))
        raw = await RawClient.tcp("127.0.0.1", tcp_server)
        await raw.initialize(options={"token": TOKEN, "debounceMs": 0})
        raw.notify("textDocument/didOpen", {"textDocument": {"uri": "file:///w/d.py", "languageId": "python",
                                                             "version": 1, "text": SAMPLE}})
        raw.request(1, "workspace/executeCommand", {"command": "a3b.explainSelection", "arguments": [
            "file:///w/d.py", {"start": {"line": 0, "character": 0}, "end": {"line": 22, "character": 0}}]})
        await asyncio.sleep(1.0)
        raw.writer.transport.abort()   # the editor crashed
        for _ in range(100):
            st = await status(watcher)
            if model_stats(st).get("finished_cancelled", 0) > before.get("finished_cancelled", 0) \
                    and not st["runtime"]["models"][0]["busy"]:
                break
            await asyncio.sleep(0.1)
        after = model_stats(st)
        assert after["finished_cancelled"] == before.get("finished_cancelled", 0) + 1
        assert not st["runtime"]["models"][0]["busy"]
        assert st["server"]["clients"] == 1               # the dead connection's session is gone
    finally:
        await watcher.shutdown_session()
        await watcher.stop()


async def test_websocket_server_with_token_origin_and_loopback_checks(srv):
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    proc, port = await start_server(srv, "ws", env_token=TOKEN)
    try:
        client = await lsp_client("ws", port, TOKEN)
        try:
            open_doc(client, "file:///w/ws.py", SAMPLE)
            assert await inline(client, "file:///w/ws.py", SINGLE)
        finally:
            await client.shutdown_session()
            await client.stop()
        # a web page in a browser could reach a loopback port: browser origins are refused
        with pytest.raises(InvalidStatus) as e:
            async with connect(f"ws://127.0.0.1:{port}", origin="http://evil.example"):
                pass
        assert e.value.response.status_code == 403
        with pytest.raises(InvalidStatus) as e:
            async with connect(f"ws://127.0.0.1:{port}/?token=wrong"):
                pass
        assert e.value.response.status_code == 401
        # the right token in the URL authorizes the connection without initializationOptions
        async with connect(f"ws://127.0.0.1:{port}/?token={TOKEN}") as ws:
            await ws.send('{"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"capabilities": {}}}')
            assert '"capabilities"' in await asyncio.wait_for(ws.recv(), 30)
        ip = non_loopback_ipv4()
        if ip is not None:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((ip, 0))
            sock.connect(("127.0.0.1", port))
            with pytest.raises(InvalidStatus) as e:
                async with connect(f"ws://127.0.0.1:{port}/?token={TOKEN}", sock=sock):
                    pass
            assert e.value.response.status_code == 403
    finally:
        await stop_server(proc)


async def test_listening_on_a_non_loopback_address_is_refused(srv):
    proc = await asyncio.create_subprocess_exec(*srv.command, "--tcp", "0.0.0.0:7011", stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2
    assert "only binds to loopback addresses" in err.decode()


@pytest.mark.slow
async def test_in_process_server_shares_the_comfyui_model(rt):
    """ComfyUI loads the pack in its own process; the server then runs on a thread beside the nodes."""
    from comfyui_a3b.lsp_server import inprocess
    from comfyui_a3b.nodes import core as nodes, generation

    assert inprocess.maybe_start({}) is None                       # off by default
    spec = nodes.load_model()                                       # what an A3BLoader node does
    loads = rt.store.weight_loads
    info = inprocess.maybe_start({"A3B_LSP": "tcp:127.0.0.1:0", "A3B_LSP_TOKEN": TOKEN})
    try:
        assert info["running"] and info["address"].startswith("tcp://127.0.0.1:") and info["token_required"]
        port = int(info["address"].rsplit(":", 1)[1])
        client = await lsp_client("tcp", port, TOKEN)
        try:
            open_doc(client, "file:///w/inproc.py", SAMPLE)
            comfy = asyncio.get_running_loop().run_in_executor(
                None, lambda: generation.generate(spec, "Write a haiku about autumn.", max_new_tokens=24))
            got = await inline(client, "file:///w/inproc.py", SINGLE)
            generated = await comfy
            assert got and generated.text
            assert rt.store.weight_loads == loads                   # one load, shared by both sides
            session = next(iter(inprocess._state["engine"].sessions))
            assert session.spec() == spec                           # same spec: same scheduler, so
            assert rt.store.entry(spec).model is session.model_if_loaded()  # editor priority applies
            st = rt.status()["lsp"]
            assert st["clients"] == 1 and st["address"] == info["address"]
            assert st["stats"]["answered"] >= 1
        finally:
            await client.shutdown_session()
            await client.stop()
    finally:
        inprocess.stop()
    assert "lsp" not in rt.status_providers
