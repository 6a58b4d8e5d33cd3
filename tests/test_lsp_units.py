"""The language server's parts without a client: documents, prompts (real tokenizers), suggestion
cleanup, the cache, settings, traceback parsing, message framing and the pygls internals it uses."""
from __future__ import annotations

import inspect
import json
from importlib.metadata import version

import pytest
from comfyui_a3b.lsp_server import config as cfg
from comfyui_a3b.lsp_server import pygls_compat
from comfyui_a3b.lsp_server.cache import CompletionCache
from comfyui_a3b.lsp_server.context import chunk_text
from comfyui_a3b.lsp_server.documents import Document, DocumentError
from comfyui_a3b.lsp_server.fixes import extract_code, parse_traceback
from comfyui_a3b.lsp_server.messages import strict_converter
from comfyui_a3b.lsp_server.postprocess import finish
from comfyui_a3b.lsp_server.prompt import PromptBuilder, is_multiline
from comfyui_a3b.runtime import InfillPrompt, TextPrompt
from comfyui_a3b.runtime.fim import fim_ids
from comfyui_a3b.lsp_server.framing import MAX_HEADER_BYTES, MAX_MESSAGE_BYTES, FrameParser, FramingError
from comfyui_a3b.lsp_server.transport import is_loopback, parse_address
from lsprotocol import types as T
from pygls.lsp.server import LanguageServer
from tinygguf import write_tiny_gguf


def cursor_at(text: str, language: str = "python"):
    i = text.index("|")
    doc = Document("file:///w/demo.py", text.replace("|", "", 1), 1, language)
    return doc.cursor(doc.position_at(i), "utf-16")


# -- documents ----------------------------------------------------------------------------------
def test_positions_follow_the_negotiated_encoding():
    doc = Document("file:///a.py", "a = '😀é'\nb = 2\n")
    # '😀' is 2 UTF-16 units, 4 UTF-8 bytes, 1 code point
    assert doc.offset_at(T.Position(0, 7), "utf-16") == 6
    assert doc.offset_at(T.Position(0, 9), "utf-8") == 6
    assert doc.offset_at(T.Position(0, 6), "utf-32") == 6
    assert doc.position_at(8, "utf-16") == T.Position(0, 9)


def test_incremental_edits_and_line_endings_lsp_counts():
    doc = Document("file:///a.py", "x = 1\r\ny = 2\x0cz\rw\n")
    assert doc.line_count() == 4  # \r\n, \r and \n end lines; a form feed does not
    doc.apply(T.TextDocumentContentChangePartial(range=T.Range(T.Position(1, 4), T.Position(1, 5)), text="42"))
    assert doc.text == "x = 1\r\ny = 42\x0cz\rw\n"
    doc.apply(T.TextDocumentContentChangeWholeDocument(text="new"))
    assert doc.text == "new" and doc.line_count() == 1


def test_position_outside_the_document_is_a_clear_error():
    doc = Document("file:///a.py", "one\ntwo\n")
    with pytest.raises(DocumentError, match=r"outside the document .* 3 lines"):
        doc.offset_at(T.Position(9, 0))
    # a character past the end of a line means the line's end, as the LSP specifies
    assert doc.offset_at(T.Position(0, 99)) == 3


def test_binary_and_oversized_documents_are_refused_with_a_reason():
    with pytest.raises(DocumentError, match="binary"):
        Document("file:///b.bin", "ELF\x00\x01\x02").check_usable(1 << 20)
    with pytest.raises(DocumentError, match="maxDocumentBytes"):
        Document("file:///big.py", "x" * 5000).check_usable(1024)


# -- single vs multi-line, cleanup --------------------------------------------------------------
def test_single_or_multi_line_by_position():
    assert not is_multiline(cursor_at("x = foo(|a)\n"))
    assert is_multiline(cursor_at("def f():|\n"))
    assert is_multiline(cursor_at("def f():\n    |\n"))
    assert not is_multiline(cursor_at("total = |\n"))
    assert not is_multiline(cursor_at("call(|)\n"))  # only closers after the cursor: one line


def test_suggestion_that_repeats_the_suffix_or_next_line_is_dropped():
    cur = cursor_at("x = foo(a|)\ny = 2\n")
    assert finish(")", cur, False) == ""                       # only the bracket already there
    assert finish(", b)", cur, False) == ", b"                 # the bracket is not doubled
    cur = cursor_at("def f():\n    |\n    return total\n")
    assert finish("return total\n", cur, True) == ""           # repeats the code below
    cur = cursor_at("a = 1\n|\nb = 2\n")
    assert finish("b = 2", cur, False) == ""


def test_multi_line_stops_at_the_end_of_the_block_and_keeps_indentation():
    cur = cursor_at("def f():|\n\nprint(1)\n")
    assert finish("\n    a = 1\n    return a\ndef g():\n    pass\n", cur, True) == "\n    a = 1\n    return a"
    cur = cursor_at("def f():\n    |\n")
    assert finish("    a = 1\n    return a\n", cur, True) == "a = 1\n    return a"   # no double indent


# -- cache --------------------------------------------------------------------------------------
def test_cache_exact_and_typed_ahead_hits():
    c = CompletionCache()
    c.put("k", "def area(r", "adius):")
    assert c.get("k", "def area(r") == ("exact", "adius):")
    assert c.get("k", "def area(rad") == ("typed", "ius):")
    assert c.get("k", "def area(rx") is None          # typed something else
    assert c.get("other", "def area(r") is None       # a different suffix or document
    assert c.get("k", "def area(radius):") is None     # the whole suggestion was typed
    st = c.stats()
    assert st["hits_exact"] == 1 and st["hits_typed_ahead"] == 1 and st["misses"] == 3


# -- prompts from real tokenizers ---------------------------------------------------------------
def test_prefix_prompt_keeps_the_window_start_while_typing(rt):
    m = rt.load()
    b = PromptBuilder(m)
    assert not b.fim  # the embedded SmolLM2 has no FIM tokens: the prefix path
    body = "".join(f"value_{i} = compute({i})\n" for i in range(200))
    cur1 = cursor_at(body + "result = comp|")
    p1 = b.build(cur1, anchor=None, context_block="", budget=120, suffix_tokens=16, use_fim=True)
    assert p1.mode == "prefix" and isinstance(p1.sent, TextPrompt) and p1.window_tokens <= 120
    cur2 = cursor_at(body + "result = compu|")
    p2 = b.build(cur2, anchor=p1.anchor, context_block="", budget=120, suffix_tokens=16, use_fim=True)
    assert p2.anchor == p1.anchor
    t1, t2 = m.prompt_tokens(p1.sent), m.prompt_tokens(p2.sent)
    common = 0
    while common < min(len(t1), len(t2)) and t1[common] == t2[common]:
        common += 1
    assert common >= len(t1) - 3  # only the last word's tokens differ: the KV cache covers the rest
    text = m.vocab.detokenize(t1)
    assert text.startswith("# demo.py\n")


def test_a_cursor_after_indentation_cuts_the_prompt_at_the_line_break_and_heals_the_answer(rt):
    """SmolLM2 writes a line break and eight spaces as "\\n       " then " return": a prompt ending in
    the spaces as tokens of their own is one it never saw. The prompt ends at the line above; the
    answer must start with the break and the indentation typed, and only what follows is shown."""
    from comfyui_a3b.lsp_server.postprocess import healed

    m = rt.load()
    b = PromptBuilder(m)
    cur = cursor_at("def area(r):\n    x = r * r\n    |")
    p = b.build(cur, anchor=None, context_block="", budget=120, suffix_tokens=16, use_fim=False)
    assert p.heal == "\n    " and p.sent.text.endswith("x = r * r")
    assert healed("\n    return x\n", p.heal) == "return x\n"
    assert healed("\n      return x", p.heal) == "  return x"       # deeper: the extra spaces stay
    assert healed("\n  ", p.heal) == ""                               # not past the heal yet
    assert healed("  # a comment on the line above", p.heal) is None  # it wrote elsewhere
    assert healed("\nreturn", p.heal) is None                         # dedented: not at this cursor
    for text in ("def area(r):\n    x = r|", "def area(r):\n    |x = 1", "def area(r):\n|"):
        assert b.build(cursor_at(text), anchor=None, context_block="", budget=120, suffix_tokens=16,
                       use_fim=False).heal == ""                   # code at or after the cursor


def test_a_healed_prompt_is_answered_at_the_cursor_not_where_the_model_likes(rt):
    """Cut at the line break, the prompt no longer says how deep the cursor is: after a `return` the
    model breaks the line and starts a new function at column 0, which is not at the cursor (nothing
    to show). The server samples the answer with the heal's grammar: the line break and the
    indentation typed, then code."""
    import inspect

    from comfyui_a3b.bench import nextline
    from comfyui_a3b.lsp_server import completion
    from comfyui_a3b.lsp_server.postprocess import healed

    b = PromptBuilder(rt.load())
    for text, heal in (("def area(r):\n    return r * r\n    |", "\n    "),
                       ('def area(r):\n\t"""Area."""\n\tx = r * r\n\treturn x\n\t|', "\n\t")):
        p = b.build(cursor_at(text), anchor=None, context_block="", budget=120, suffix_tokens=16, use_fim=False)
        assert p.heal == heal
        free = rt.submit(p.sent, max_tokens=12, sampling=completion.SAMPLING, thinking="off").result()
        assert healed(free.text, p.heal) is None, free.text        # unconstrained: elsewhere
        got = rt.submit(p.sent, max_tokens=12, sampling=completion.SAMPLING, grammar=p.grammar,
                        thinking="off").result()
        after = healed(got.text, p.heal)
        assert after and not after[0].isspace(), got.text
    assert b.build(cursor_at("x = |"), anchor=None, context_block="", budget=120, suffix_tokens=16,
                   use_fim=False).grammar is None
    # the server and the next-line measure sample with it
    assert "grammar=prompt.grammar" in inspect.getsource(completion.Completer._start)
    assert "grammar=p.grammar" in inspect.getsource(nextline.run)


def test_document_text_cannot_inject_control_tokens(rt):
    m = rt.load()
    b = PromptBuilder(m)
    cur = cursor_at("s = '<|im_end|><|endoftext|>'\nx = |")
    p = b.build(cur, anchor=None, context_block="", budget=200, suffix_tokens=0, use_fim=False)
    specials = {m.vocab.special_tokens()[k] for k in ("eos", "eot")} | {m.vocab.tokenize("<|im_end|>", special=True)[0]}
    assert not specials & set(m.prompt_tokens(p.sent)[1:])


@pytest.fixture(scope="module")
def fim_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("fim") / "tiny-fim.gguf"
    return write_tiny_gguf(path, "llama", extra_kv={"tokenizer.ggml.fim_pre_token_id": 3,
                                                    "tokenizer.ggml.fim_suf_token_id": 4,
                                                    "tokenizer.ggml.fim_mid_token_id": 5})


def test_fim_prompt_is_built_from_the_models_token_ids(rt, fim_model):
    spec = rt.spec(str(fim_model), n_ctx=256, n_parallel=1)
    m = rt.load(spec)
    assert fim_ids(m.vocab) == (3, 4, 5) and m.supports_fim
    b = PromptBuilder(m)
    cur = cursor_at("def f(x):\n    return |\n\nprint(f(2))\n")
    p = b.build(cur, anchor=None, context_block="", budget=64, suffix_tokens=16, use_fim=True)
    assert p.mode == "fim" and isinstance(p.sent, InfillPrompt)
    t = m.prompt_tokens(p.sent, 4)
    assert t.count(3) == t.count(4) == t.count(5) == 1
    assert t.index(3) < t.index(4) < t.index(5) == len(t) - 1
    assert "\n\nprint(f(2))" in m.vocab.detokenize(t[t.index(4) + 1:t.index(5)])
    off = b.build(cur, anchor=None, context_block="", budget=64, suffix_tokens=16, use_fim=False)
    assert off.mode == "prefix" and 3 not in m.prompt_tokens(off.sent)
    res = rt.generate(p.sent, model=spec, max_tokens=4)
    assert res.n_prompt_tokens == len(t)


# -- context chunks, settings, tracebacks, addresses --------------------------------------------
def test_chunks_are_whole_lines_and_huge_or_binary_files_are_skipped():
    text = "\n".join(f"line {i} " + "x" * 30 for i in range(100))
    chunks = chunk_text("file:///o.py", text, 64)
    assert len(chunks) > 3 and all(not c.text.startswith("\n") for c in chunks)
    assert chunks[1].line > 0 and text.split("\n")[chunks[1].line] in chunks[1].text
    assert chunk_text("file:///b", "a\x00b", 64) == []
    assert chunk_text("file:///h", "x\n" * 400_000, 64) == []


def test_settings_validation_reports_each_bad_value_and_keeps_the_rest():
    s, errors = cfg.apply(cfg.Settings(), {"a3b": {"debounceMs": 10, "maxTokens": -3, "fim": "maybe",
                                                   "bogus": 1, "nCtx": 1024}})
    assert s.debounce_ms == 10 and s.n_ctx == 1024
    assert s.max_tokens == cfg.Settings().max_tokens and s.fim == "auto"
    assert len(errors) == 3
    assert any("'maxTokens' must be an integer in 1..1024" in e for e in errors)
    assert any("Unknown A3B setting 'bogus'" in e for e in errors)
    _, errors = cfg.apply(cfg.Settings(), ["not", "an", "object"])
    assert errors and "must be an object" in errors[0]


def test_traceback_parsing_and_code_extraction():
    tb = parse_traceback('Some log\nTraceback (most recent call last):\n  File "/w/app.py", line 12, in <module>\n'
                         '    main()\n  File "/w/lib.py", line 3, in main\n    return 1 / 0\n'
                         '           ~~^~~\nZeroDivisionError: division by zero\n')
    assert [(f.path, f.line) for f in tb.frames] == [("/w/app.py", 12), ("/w/lib.py", 3)]
    assert tb.error == "ZeroDivisionError: division by zero"
    assert parse_traceback("no traceback here") is None
    assert extract_code("Here:\n```python\nreturn 1\n```\n", "    return 1 / 0") == "    return 1"


def test_only_loopback_addresses_are_accepted():
    assert parse_address("127.0.0.1:7011") == ("127.0.0.1", 7011)
    assert parse_address("[::1]:0") == ("::1", 0)
    assert parse_address("localhost:7011") == ("127.0.0.1", 7011)
    for bad in ("0.0.0.0:7011", "192.168.1.5:7011", "example.com:80"):
        with pytest.raises(ValueError, match="only binds to loopback"):
            parse_address(bad)
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_address("7011")
    assert is_loopback("::ffff:127.0.0.1") and not is_loopback("10.0.0.1")


# -- framing: bytes in, message bodies out, no I/O ----------------------------------------------
def frame(body: bytes, *headers: str, eol: str = "\r\n") -> bytes:
    head = "".join(h + eol for h in headers or (f"Content-Length: {len(body)}",))
    return (head + eol).encode() + body


BODIES = [b'{"jsonrpc": "2.0", "method": "initialized", "params": {}}', "é😀 \r\n\n".encode(), b""]
STREAM = (frame(BODIES[0]) + b"\r\n\n"     # blank lines between messages are tolerated
          + frame(BODIES[1], "Content-Type: application/vscode-jsonrpc; charset=utf-8",
                  f"content-length:{len(BODIES[1])}")
          + frame(BODIES[2], eol="\n"))


def test_frames_split_at_every_byte_boundary():
    assert FrameParser().feed(STREAM) == BODIES         # several messages in one chunk
    for i in range(len(STREAM) + 1):
        p = FrameParser()
        assert p.feed(STREAM[:i]) + p.feed(STREAM[i:]) == BODIES, f"split at byte {i}"
    p = FrameParser()
    assert [b for i in range(len(STREAM)) for b in p.feed(STREAM[i:i + 1])] == BODIES   # byte by byte


def test_an_incomplete_message_waits_for_its_bytes():
    p = FrameParser()
    assert p.feed(b"Content-Length: 5\r\n\r\nabc") == []
    assert p.feed(b"de" + b"Content-Len") == [b"abcde"]
    assert p.feed(b"gth: 2\r\n\r\n{}") == [b"{}"]


def test_bad_framing_is_refused_with_a_reason():
    padding = b"x" * (MAX_HEADER_BYTES - len(b"Content-Type: \r\n"))
    assert FrameParser().feed(b"Content-Type: " + padding + b"\r\nContent-Length: 2\r\n\r\n{}") == [b"{}"]
    for data, reason in (
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "Not an LSP header"),
        (b"Content-Length 5\r\n", "Not an LSP header"),
        (b"Content-Type: text/plain\r\n\r\n{}", "without Content-Length"),
        (b"Content-Length: ten\r\n\r\n", "not a number"),
        (b"Content-Length: -1\r\n\r\n", "larger than the limit"),
        (f"Content-Length: {MAX_MESSAGE_BYTES + 1}\r\n\r\n".encode(), "larger than the limit"),
        (b"Content-Type: " + padding + b"x\r\n", "too long"),           # one byte over, line end included
        (b"C" * (MAX_HEADER_BYTES + 1), "too long"),                    # no line end in sight
    ):
        with pytest.raises(FramingError, match=reason):
            FrameParser().feed(data)
        p = FrameParser()
        with pytest.raises(FramingError, match=reason):       # the same, a byte at a time
            for i in range(len(data)):
                p.feed(data[i:i + 1])


def test_messages_before_bad_bytes_are_kept_and_the_error_sticks():
    p = FrameParser()
    with pytest.raises(FramingError, match="Not an LSP header") as e:
        p.feed(frame(b"{}") + frame(b"[]") + b"GET / HTTP/1.1\r\n")
    assert e.value.messages == [b"{}", b"[]"]
    with pytest.raises(FramingError, match="Not an LSP header") as e:
        p.feed(frame(b"{}"))
    assert e.value.messages == []


# -- the pygls internals behind lsp_server/pygls_compat.py --------------------------------------
class _Writer:
    def __init__(self):
        self.written: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def close(self) -> None:
        pass


def _require(ok: bool, attribute: str, shape: str) -> None:
    assert ok, (f"pygls {version('pygls')}: {attribute} is no longer {shape}. "
                "lsp_server/pygls_compat.py relies on it and must be updated for this pygls version.")


def test_pygls_private_attributes_the_adapter_relies_on_still_exist():
    shapes = {
        "_send_data": ("a method taking one message (data)",
                       lambda v: callable(v) and list(inspect.signature(v).parameters) == ["data"]),
        "_request_futures": ("a dict of message id -> future", lambda v: isinstance(v, dict)),
        "_result_types": ("a dict of message id -> reply type", lambda v: isinstance(v, dict)),
    }
    assert set(shapes) == set(pygls_compat.PRIVATE_ATTRIBUTES), \
        "every private attribute pygls_compat uses needs its shape checked here"
    proto = LanguageServer("shape-check", "0").protocol
    for attr, (shape, ok) in shapes.items():
        _require(hasattr(proto, attr) and ok(getattr(proto, attr)), f"JsonRPCProtocol.{attr}", shape)


def test_pygls_compat_functions_do_what_they_say():
    ls = LanguageServer("shape-check", "0")
    proto, out = ls.protocol, _Writer()
    proto.set_writer(out, include_headers=True)
    error = {"jsonrpc": "2.0", "id": None, "error": {"code": -32700, "message": "Parse error"}}
    pygls_compat.send_raw(proto, error)
    _require([json.loads(b) for w in out.written for b in FrameParser().feed(w)] == [error],
             "JsonRPCProtocol._send_data", "writing a message dict as one framed JSON body")
    fut = proto.send_request(T.WORKSPACE_CONFIGURATION, T.ConfigurationParams(items=[]))
    _require(pygls_compat.pending_requests(proto) == [fut], "JsonRPCProtocol._request_futures",
             "holding the future of a request awaiting its reply")
    _require(not pygls_compat.has_workspace(ls), "LanguageServer.workspace", "raising RuntimeError before initialize")
    proto.handle_message(proto.structure_message(
        {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"capabilities": {}}}))
    _require(pygls_compat.has_workspace(ls), "LanguageServer.workspace", "available after initialize")
    [fut_id] = [i for i, f in proto._request_futures.items() if f is fut]
    _require(pygls_compat.awaits_reply(proto, fut_id),
             "JsonRPCProtocol._result_types", "holding the id of a request awaiting its reply")
    _require(not pygls_compat.awaits_reply(proto, 1), "JsonRPCProtocol._result_types",
             "holding only the ids of requests this server sent")
    pygls_compat.fail_request(proto, fut_id, ValueError("unreadable"))
    _require(isinstance(fut.exception(timeout=0), ValueError) and not pygls_compat.awaits_reply(proto, fut_id),
             "JsonRPCProtocol._request_futures", "holding futures ended by set_exception")


@pytest.mark.parametrize("value, kind", [
    ({"line": 1, "character": 2.7}, T.Position),          # a column of 2.7 is not column 2
    ({"line": True, "character": 0}, T.Position),
    ({"applied": "no"}, T.ApplyWorkspaceEditResult),       # "no" is not True
    ({"range": {"start": {"line": 0, "character": 0}, "end": {"line": 0, "character": 1}}, "text": 5},
     T.TextDocumentContentChangePartial),                  # 5 is not the text "5"
])
def test_the_strict_converter_refuses_values_of_another_type(value, kind):
    import cattrs

    with pytest.raises(cattrs.ClassValidationError) as e:
        strict_converter().structure(value, kind)
    assert any("expected" in line for line in cattrs.transform_error(e.value)), cattrs.transform_error(e.value)


def test_the_strict_converter_reads_what_the_protocol_allows():
    conv = strict_converter()
    assert conv.structure({"line": 3, "character": 4}, T.Position) == T.Position(3, 4)
    assert conv.structure({"applied": False, "failureReason": "no"}, T.ApplyWorkspaceEditResult).applied is False
    assert conv.structure({"scopeUri": None, "section": "a3b"}, T.ConfigurationItem).section == "a3b"
    assert conv.structure(2, float) == 2 and conv.structure(0.5, float) == 0.5


def test_context_chunks_by_embedding_similarity_leave_out_near_copies(rt):
    from comfyui_a3b.lsp_server.context import ContextIndex, VectorCache

    spec = rt.spec(None)

    def embed(texts):
        return rt.embed(texts, model=spec)

    embed.model_key = spec.path
    idx = ContextIndex(VectorCache())
    current = "def parse_csv_row(line):\n    fields = line.split(',')\n    return [f.strip() for f in fields]\n"
    idx.set_document("file:///w/current.py", current, 96)
    idx.set_document("file:///w/copy.py", current, 96)     # an exact copy of the code at the cursor
    idx.set_document("file:///w/csvutil.py", "def read_csv(path):\n    with open(path) as f:\n"
                     "        return [parse_csv_row(l) for l in f]\n", 96)
    idx.set_document("file:///w/colors.py", "RED = (255, 0, 0)\nGREEN = (0, 255, 0)\nBLUE = (0, 0, 255)\n", 96)
    picked = idx.select(embed, "file:///w/current.py", current, k=1, max_similarity=0.99, chunk_tokens=96)
    assert [c.uri for c, _ in picked] == ["file:///w/csvutil.py"]
    everything = idx.select(embed, "file:///w/current.py", current, k=3, max_similarity=1.01, chunk_tokens=96)
    assert everything[0][0].uri == "file:///w/copy.py" and everything[0][1] > 0.99   # what the cut removes
    assert all(c.uri != "file:///w/current.py" for c, _ in everything)



def test_the_strict_converter_still_reads_the_protocols_enumerations():
    # the hooks of int and str also serve their subclasses: IntEnum and str enumerations
    conv = strict_converter()
    rng = {"start": {"line": 1, "character": 4}, "end": {"line": 1, "character": 8}}
    assert conv.structure({"range": rng, "message": "m", "severity": 1}, T.Diagnostic).severity \
        is T.DiagnosticSeverity.Error
    assert conv.structure({"kind": "markdown", "value": "x"}, T.MarkupContent).kind is T.MarkupKind.Markdown
    with pytest.raises(Exception):   # noqa: B017 - cattrs' error group; what matters is the refusal
        conv.structure({"range": rng, "message": "m", "severity": "1"}, T.Diagnostic)


async def test_a_healed_generation_streams_only_what_follows_the_heal_and_stops_when_it_writes_elsewhere():
    from types import SimpleNamespace

    from comfyui_a3b.lsp_server.completion import Gen

    class Stream:
        reason = None

        def cancel(self, reason):
            self.reason = reason

    cur = cursor_at("def area(r):\n    x = r * r\n    |")
    g = Gen(cur, "k", True, 0, heal="\n    ")
    g.stream = Stream()
    for piece in ("\n  ", "  ret", "urn x", " * 2"):
        g.on_token(SimpleNamespace(text=piece))
    assert g.text == "return x * 2" and g.agrees("return") and g.stream.reason is None
    wrong = Gen(cur, "k", True, 0, heal="\n    ")
    wrong.stream = Stream()
    wrong.on_token(SimpleNamespace(text=" # a comment"))   # the line above, not the cursor's
    assert wrong.stream.reason == "heal mismatch" and wrong.text == ""
