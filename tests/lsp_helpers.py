"""Helpers for the language server tests: sample code, request shortcuts, a raw JSON-RPC client."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from lsprotocol import types as T

SERVER = [sys.executable, "-m", "comfyui_a3b.cli", "lsp"]
#: the same server over the fake engine (fast tier): add "--model", "fake://..."
FAKE_SERVER = [sys.executable, str(Path(__file__).resolve().parent / "fakeserver.py"), "lsp"]
#: the fake model of the language server tests writes this line (it completes "    return len"),
#: 8 ms a token, so a long generation can be caught and cancelled
FAKE_MODEL = "fake://code?text=(text.split())%0A&delay_ms=8&speculative=off"


@dataclass
class Server:
    """How to start a language server for a test: over the fake engine, or the embedded model."""

    kind: str
    command: list[str]     # the command line without the transport flag
    model_name: str

    @property
    def fake(self) -> bool:
        return self.kind == "fake"


SERVERS = {"fake": Server("fake", FAKE_SERVER + ["--model", FAKE_MODEL], "code"),
           "real": Server("real", SERVER, "SmolLM2-135M-Instruct.Q4_1.gguf")}


def real_only(srv: Server) -> None:
    if srv.fake:
        import pytest

        pytest.skip("what this checks needs the embedded model's own text (it runs in the slow tier)")

SAMPLE = '''import os
import sys


def read_lines(path):
    """Return the lines of a text file."""
    with open(path) as f:
        return f.read().splitlines()


def count_words(text):
    """Count the words in a string."""
    return len


def main(argv):
    for name in argv[1:]:
        lines = read_lines(name)
        total = 0
        for line in lines:
            total += count_words(line)
        print(name, total)
'''
#: "    return len" (line 12): the embedded model completes it on one line.
SINGLE = T.Position(line=12, character=14)
#: after "    with open(path) as f:" (line 6): a multi-line spot.
MULTI = T.Position(line=6, character=25)


@contextlib.asynccontextmanager
async def started_client(command: list[str], env: dict[str, str]):
    """A pytest-lsp client of the language server started with `command` (over stdio) and `env`,
    initialised as VS Code (no debounce) and shut down after use."""
    from pytest_lsp import ClientServerConfig, client_capabilities

    c = await ClientServerConfig(server_command=command + ["--stdio"], server_env=env).start(devtools=None)
    try:
        await c.initialize_session(T.InitializeParams(capabilities=client_capabilities("visual-studio-code"),
                                                      initialization_options={"a3b": {"debounceMs": 0}}))
        yield c
        await c.shutdown_session()
    finally:
        await c.stop()


@contextlib.asynccontextmanager
async def remote_model_client(url: str, api_key: str):
    """A client of the language server over the remote model at `url`."""
    async with started_client(SERVER + ["--model", url], {**os.environ, "A3B_REMOTE_API_KEY": api_key}) as c:
        yield c


@contextlib.asynccontextmanager
async def folder_client(root: Path):
    """A client of the fake-model language server whose cache is root/cache and whose model folder
    is root/models (made here), as the tuning tests need."""
    (root / "models").mkdir()
    env = {**os.environ, "A3B_CACHE": str(root / "cache"), "A3B_MODELS": str(root / "models")}
    async with started_client(SERVERS["fake"].command, env) as c:
        yield c


def open_doc(client, uri: str, text: str, language: str = "python", version: int = 1) -> None:
    client.text_document_did_open(T.DidOpenTextDocumentParams(
        T.TextDocumentItem(uri=uri, language_id=language, version=version, text=text)))


def insert(client, uri: str, version: int, pos: T.Position, text: str) -> None:
    client.text_document_did_change(T.DidChangeTextDocumentParams(
        text_document=T.VersionedTextDocumentIdentifier(uri=uri, version=version),
        content_changes=[T.TextDocumentContentChangePartial(range=T.Range(pos, pos), text=text)]))


def inline_params(uri: str, pos: T.Position) -> T.InlineCompletionParams:
    return T.InlineCompletionParams(text_document=T.TextDocumentIdentifier(uri), position=pos,
                                    context=T.InlineCompletionContext(trigger_kind=T.InlineCompletionTriggerKind.Automatic))


async def inline(client, uri: str, pos: T.Position) -> list[str]:
    r = await client.text_document_inline_completion_async(inline_params(uri, pos))
    items = r.items if isinstance(r, T.InlineCompletionList) else (r or [])
    return [i.insert_text if isinstance(i.insert_text, str) else i.insert_text.value for i in items]


async def inline_on_sample(client, uri: str) -> list[str]:
    """Open SAMPLE as `uri` and ask for inline completions at SINGLE (one line expected)."""
    open_doc(client, uri, SAMPLE)
    return await inline(client, uri, SINGLE)


async def status(client, uri: str | None = None) -> dict:
    return await client.workspace_execute_command_async(
        T.ExecuteCommandParams(command="a3b.status", arguments=[uri] if uri else None))


async def configure(client, **settings) -> None:
    client.workspace_did_change_configuration(T.DidChangeConfigurationParams(settings={"a3b": settings}))
    await status(client)  # a round trip: the notification has been handled


def counters(st: dict) -> dict:
    return st["server"]["counters"]


def model_stats(st: dict) -> dict:
    return st["runtime"]["models"][0]["stats"] if st["runtime"]["models"] else {}


class RawClient:
    """Bytes in, JSON-RPC messages out: for the inputs a well-behaved client never sends."""

    def __init__(self, reader: asyncio.StreamReader, writer, proc=None):
        self.reader, self.writer, self.proc = reader, writer, proc

    @classmethod
    async def stdio(cls, *extra: str, env=None, server=SERVER) -> RawClient:
        proc = await asyncio.create_subprocess_exec(*server, "--stdio", *extra, stdin=asyncio.subprocess.PIPE,
                                                    stdout=asyncio.subprocess.PIPE, env=env, limit=1 << 26)
        return cls(proc.stdout, proc.stdin, proc)

    @classmethod
    async def tcp(cls, host: str, port: int, **kw) -> RawClient:
        r, w = await asyncio.open_connection(host, port, limit=1 << 26, **kw)
        return cls(r, w)

    def send_bytes(self, body: bytes) -> None:
        self.writer.write(b"Content-Length: %d\r\n\r\n" % len(body) + body)

    def send(self, msg: dict) -> None:
        self.send_bytes(json.dumps(msg).encode())

    def request(self, id_, method: str, params=None) -> None:
        self.send({"jsonrpc": "2.0", "id": id_, "method": method, "params": params})

    def notify(self, method: str, params=None) -> None:
        self.send({"jsonrpc": "2.0", "method": method, "params": params})

    async def recv(self, timeout: float = 30.0) -> dict | None:
        """The next message, or None once the server has closed the connection."""
        try:
            return await asyncio.wait_for(self._read_message(), timeout)
        except (ConnectionResetError, asyncio.IncompleteReadError):
            return None  # the server closed the connection
        except asyncio.TimeoutError:
            raise AssertionError(f"the server sent nothing within {timeout:g} s") from None

    async def _read_message(self) -> dict | None:
        n = None
        while True:     # header lines, up to the blank line after Content-Length (recv has the deadline)
            line = await self.reader.readline()
            if not line:
                return None
            if line in (b"\r\n", b"\n"):
                if n is not None:
                    break
                continue
            k, _, v = line.decode().partition(":")
            if k.strip().lower() == "content-length":
                n = int(v)
        return json.loads(await self.reader.readexactly(n))

    async def response(self, id_, timeout: float = 60.0) -> dict:
        """The response to request `id_`, skipping notifications and server requests."""
        async def wait() -> dict:
            while True:     # wait_for below is the deadline
                msg = await self.recv(timeout)
                if msg is None:
                    raise EOFError("the server closed the connection")
                if msg.get("id") == id_ and "method" not in msg:
                    return msg
        try:
            return await asyncio.wait_for(wait(), timeout)
        except asyncio.TimeoutError:
            raise AssertionError(f"no response to request {id_!r} within {timeout:g} s") from None

    async def initialize(self, options=None, capabilities=None) -> dict:
        self.request(0, "initialize", {"processId": None, "rootUri": None, "capabilities": capabilities or {},
                                       "initializationOptions": options})
        res = await self.response(0)
        if "result" in res:
            self.notify("initialized", {})
        return res

    async def close(self) -> None:
        try:
            self.writer.close()
        except Exception:  # noqa: BLE001 - closing a connection the test may have broken must not fail teardown
            pass
        if self.proc is not None:
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except asyncio.TimeoutError:
                self.proc.kill()
                await self.proc.wait()
