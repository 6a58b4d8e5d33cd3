"""Faults and bad input never take down the host: crafted GGUFs, a bounded GGUF reader, broken chat
templates, invalid text, an unload racing generations, and a fuzz over mutated GGUF headers.

Anything that could abort the process runs in a subprocess, so the suite survives a regression.
"""
from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from comfyui_a3b.runtime import InvalidRequest, PathNotAllowed, Runtime, inspect_gguf
from comfyui_a3b.runtime.models import vet
from comfyui_a3b.runtime.models.ggufscan import scan_header

from tinygguf import write_tiny_gguf

TESTS = Path(__file__).resolve().parent
CRAFTED = {"block_count_0": dict(block_count=0), "block_count_9999": dict(block_count=9999),
           "duplicate_token": dict(duplicate_token=True)}


def run_py(code: str, timeout: float = 180, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter with the tests folder importable; never raise on its exit."""
    full = f"import sys; sys.path.insert(0, {str(TESTS)!r})\n" + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", full], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def crafted(tmp_path_factory):
    d = tmp_path_factory.mktemp("crafted")
    return {name: write_tiny_gguf(d / f"{name}.gguf", "llama", **kw) for name, kw in CRAFTED.items()}


def test_files_llama_cpp_aborts_on_are_refused_and_the_host_lives_on(crafted, tmp_path):
    """Each file aborts llama.cpp (shown first, in a bare child); through the runtime, the same
    files give CorruptGGUF naming llama.cpp's assertion, and the host goes on generating."""
    for name, path in crafted.items():
        bare = run_py(f"""
            import llama_cpp as L
            L.llama_backend_init()
            L.llama_model_load_from_file({str(path).encode()!r}, L.llama_model_default_params())
            print("survived")
        """, env={"GGML_NO_BACKTRACE": "1"})
        assert bare.returncode < 0 and "survived" not in bare.stdout, f"{name} no longer aborts llama.cpp"
    ok = write_tiny_gguf(tmp_path / "ok.gguf")
    p = run_py(f"""
        import json, time
        from comfyui_a3b.runtime import Runtime, CorruptGGUF
        rt = Runtime()
        out = {{}}
        for name, path in {json.dumps({k: str(v) for k, v in crafted.items()})}.items():
            try:
                rt.load(path)
                out[name] = "loaded"
            except CorruptGGUF as e:
                t0 = time.perf_counter()
                try:
                    rt.load(path)
                except CorruptGGUF:
                    pass
                out[name] = [str(e), time.perf_counter() - t0]
        out["after"] = rt.generate("Hello", model={str(ok)!r}, max_tokens=2).n_tokens
        print(json.dumps(out))
    """, env={"A3B_CACHE": str(tmp_path / "cache")})
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    for name in CRAFTED:
        message, second = out[name]
        assert "crash" in message and "GGML_ASSERT" in message, message
        assert second < 0.05      # the verdict is cached: no second child
    assert "n_layer" in out["block_count_0"][0] and "token_to_id" in out["duplicate_token"][0]
    assert out["after"] == 2
    verdicts = json.loads((tmp_path / "cache" / "vetted.json").read_text())
    assert sum(1 for v in verdicts if not v["verdict"]["ok"]) == 3     # kept across restarts


def test_inspect_of_a_crafted_file_is_one_error_line(crafted):
    p = subprocess.run([sys.executable, "-m", "comfyui_a3b.cli", "inspect", str(crafted["duplicate_token"])],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.count("a3b: error:") == 1 and "Traceback" not in p.stderr, p.stderr
    assert "crash" in p.stderr


def _retype(path: Path, key: bytes, new_type: int, out: Path) -> Path:
    data = bytearray(path.read_bytes())
    i = data.index(key) + len(key)
    struct.pack_into("<I", data, i, new_type)
    out.write_bytes(data)
    return out


@pytest.mark.parametrize("new_type", [9, 4, 12, 99])
def test_a_metadata_value_of_the_wrong_type_is_refused_in_bounded_time_and_memory(tmp_path, new_type):
    src = write_tiny_gguf(tmp_path / "ok.gguf")
    bad = _retype(src, b"general.architecture", new_type, tmp_path / "bad.gguf")
    # in a child with a 1 GB address-space limit: an unbounded reader would fail there, not here
    p = run_py(f"""
        import resource, time
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
        from comfyui_a3b.runtime import inspect_gguf
        t0 = time.perf_counter()
        try:
            inspect_gguf({str(bad)!r})
            print("accepted")
        except Exception as e:
            print(type(e).__name__, time.perf_counter() - t0)
    """)
    name, seconds = p.stdout.split()
    assert name in ("CorruptGGUF", "TruncatedGGUF") and float(seconds) < 1.0, p.stdout + p.stderr


def test_scan_header_reads_the_embedded_models_metadata(default_path):
    t0 = time.perf_counter()
    scan = scan_header(default_path)
    assert time.perf_counter() - t0 < 2.0
    assert scan.metadata["general.architecture"] == "llama" and scan.array_lengths["tokenizer.ggml.tokens"] == 49152
    assert scan.n_tensors == len(scan.tensors) == inspect_gguf(default_path).n_tensors


def test_a_chat_template_that_does_not_parse_is_a_clear_error(tmp_path, fake_engine):
    path = write_tiny_gguf(tmp_path / "badtmpl.gguf", chat_template="{% for m in messages %}{{ m.content ")
    rt = Runtime()
    try:
        spec = rt.spec(str(path), n_ctx=256)
        with pytest.raises(InvalidRequest, match="chat template does not work.*chatml"):
            rt.generate("Hi", model=spec, max_tokens=2)
        assert rt.generate("Hi", model=spec, max_tokens=2, template="chatml").n_tokens >= 1
    finally:
        rt.unload()
    p = subprocess.run([sys.executable, "-m", "comfyui_a3b.cli", "generate", "Hi", "-m", str(path), "--max-tokens", "2",
                        "--n-ctx", "256"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0 and p.stderr.startswith("a3b: error:"), p.stderr


def test_text_that_is_not_unicode_is_a_clear_error(fake_engine):
    rt = Runtime()
    try:
        with pytest.raises(InvalidRequest, match=r"Item #1 to embed is not valid Unicode"):
            rt.embed(["fine", "lone \ud800 surrogate"], model="fake://t")
        with pytest.raises(InvalidRequest, match="prompt is not valid Unicode"):
            rt.generate("x \udfff", model="fake://t")
    finally:
        rt.unload()


def test_a_link_out_of_the_model_folder_is_refused_with_one_clear_message(tmp_path, monkeypatch, default_path):
    from comfyui_a3b.runtime import list_models

    models = tmp_path / "models"
    models.mkdir()
    os.symlink(default_path.parent / "nonexistent-but-outside.gguf", models / "dangling.gguf")
    outside = write_tiny_gguf(tmp_path / "outside.gguf")
    os.symlink(outside, models / "link.gguf")
    monkeypatch.setenv("A3B_MODELS", str(models))
    assert "link.gguf" not in list_models()
    with pytest.raises(PathNotAllowed, match="is a link to .*outside the allowed model folders") as ei:
        Runtime().spec("link.gguf", restrict=True)
    assert "Available" not in str(ei.value)


def test_vetting_can_be_turned_off(tmp_path, monkeypatch, crafted):
    monkeypatch.setenv("A3B_VET", "off")
    assert not vet.enabled()
    vet.check_file(crafted["duplicate_token"])   # no child, no verdict: the caller trusts its files


@pytest.mark.slow
def test_unload_racing_generations_never_crashes_the_process():
    """4 threads generate 3 tokens (or embed) at a time while the main thread unloads the model 25
    times, on the real model. What must hold on any machine, however busy: the process lives, every
    request ends with an answer or the clear ModelUnloaded error, every thread ends, and the model
    serves afterwards. (How many requests get through meanwhile depends on the load: not asserted.)"""
    p = run_py("""
        import json, threading, time
        from comfyui_a3b.runtime import Runtime, ModelUnloaded, preset
        rt = Runtime()
        spec = rt.spec(n_ctx=256, n_parallel=2)
        stop = threading.Event()
        counts = [{"tried": 0, "answered": 0, "unloaded": 0} for _ in range(4)]
        errors = []
        def work(i):
            c = counts[i]
            while not stop.is_set():
                c["tried"] += 1
                try:
                    if i == 3:
                        out = rt.embed(["some text to embed", "more"], model=spec)
                        assert len(out) == 2
                    else:
                        assert rt.generate("Hi", model=spec, max_tokens=3, sampling=preset("greedy")).n_tokens >= 1
                    c["answered"] += 1
                except ModelUnloaded as e:
                    assert str(e)
                    c["unloaded"] += 1
                except BaseException as e:
                    errors.append(repr(e))
        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads: t.start()
        for _ in range(25):
            rt.unload(spec)
            time.sleep(0.02)
        stop.set()
        for t in threads: t.join(120)
        alive = sum(t.is_alive() for t in threads)
        after = rt.generate("Hi", model=spec, max_tokens=3, sampling=preset("greedy")).n_tokens
        print(json.dumps({"counts": counts, "errors": errors[:3], "n_errors": len(errors), "alive": alive,
                          "after": after}))
    """, timeout=300)
    assert p.returncode == 0, f"the process died (code {p.returncode}): {p.stderr[-2000:]}"
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["n_errors"] == 0 and out["alive"] == 0, out
    for c in out["counts"]:
        assert c["tried"] == c["answered"] + c["unloaded"], out
    assert out["after"] >= 1, out


def _mutants(src: bytes, header_end: int, n: int, seed: int = 1234):
    """Seeded mutants of a GGUF: bytes flipped, fields overwritten with edge values, cuts."""
    rng = random.Random(seed)
    edge = [0, 1, 2, 3, 7, 8, 9, 12, 13, 255, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 1 << 32, 1 << 62, (1 << 64) - 1]
    for i in range(n):
        data = bytearray(src)
        kind = i % 4
        if kind == 0:       # flip a few bytes in the header and metadata
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(4, header_end)] ^= 1 << rng.randrange(8)
        elif kind == 1:     # an edge value in a 4-byte field
            pos = rng.randrange(4, header_end - 4)
            struct.pack_into("<I", data, pos, rng.choice(edge) & 0xFFFFFFFF)
        elif kind == 2:     # an edge value in an 8-byte field
            pos = rng.randrange(4, header_end - 8)
            struct.pack_into("<Q", data, pos, rng.choice(edge))
        else:               # cut somewhere
            data = data[:rng.randrange(4, len(data))]
        yield bytes(data)


@pytest.mark.slow
def test_fuzzed_gguf_headers_never_crash_hang_or_leak_a_traceback(tmp_path):
    src_path = write_tiny_gguf(tmp_path / "src.gguf", "llama")
    src = src_path.read_bytes()
    header_end = scan_header(src_path).data_start
    folder = tmp_path / "mutants"
    folder.mkdir()
    n = 300
    for i, data in enumerate(_mutants(src, header_end, n)):
        (folder / f"m{i:03d}.gguf").write_bytes(data)
    p = run_py(f"""
        import json, resource, collections
        from pathlib import Path
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
        from comfyui_a3b.runtime import Runtime, A3BError, inspect_gguf
        rt = Runtime()
        outcomes, bugs = collections.Counter(), []
        for f in sorted(Path({str(folder)!r}).glob("*.gguf")):
            for what in ("inspect", "load"):
                try:
                    if what == "inspect":
                        inspect_gguf(f)
                    else:
                        rt.generate("Hi", model=str(f), max_tokens=2)
                        rt.unload()
                    outcomes[what + ":ok"] += 1
                except A3BError as e:
                    outcomes[what + ":" + type(e).__name__] += 1
                except BaseException as e:
                    bugs.append(f"{{f.name}} {{what}}: {{type(e).__name__}}: {{e}}")
        print(json.dumps({{"outcomes": outcomes, "bugs": bugs[:10], "n_bugs": len(bugs)}}))
    """, timeout=600, env={"A3B_CACHE": str(tmp_path / "cache")})
    assert p.returncode == 0, f"the process died (code {p.returncode}): {p.stderr[-3000:]}"
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["n_bugs"] == 0, res["bugs"]
    total = sum(res["outcomes"].values())
    assert total == 2 * n, res
    refused = sum(v for k, v in res["outcomes"].items() if not k.endswith(":ok"))
    assert refused > n // 2, res   # most mutants are damaged files, and each got a typed error


def test_output_into_a_closed_pipe_is_not_an_error(default_path):
    """`a3b inspect --json | head -1`: the reader goes away; no traceback, no error status."""
    p = subprocess.Popen([sys.executable, "-m", "comfyui_a3b.cli", "inspect", "--json", str(default_path)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()          # closed before the command writes a byte
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0 and b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()


@pytest.fixture
def fake_vetting(tmp_path, monkeypatch):
    """A vetting server replaced by `fake_vetting(answer)`: answer(name, repack) gives its reply; the
    (file name, repack) of every request is listed in the returned list. Verdicts go to tmp_path, and
    are forgotten afterwards (the next need reads the real cache's again)."""
    monkeypatch.setenv("A3B_CACHE", str(tmp_path / "cache"))
    vet.VERDICTS.reset()

    def install(answer):
        asked = []

        def server(path, size, repack=True):
            asked.append((Path(path).name, repack))
            return answer(Path(path).name, repack)

        monkeypatch.setattr(vet, "_ask", server)
        return asked

    yield install
    vet.VERDICTS.reset()


def test_a_crash_in_cpu_repacking_is_not_blamed_on_the_file(tmp_path, monkeypatch, fake_vetting):
    """A build whose CPU repacking kernels die (AMX compiled in, not allowed by the system) makes every
    quantised model crash in its first decode. Vetting then tries the file without repacking; when
    that works the file is fine, repacking is marked broken for this build (kept on disk), and later
    files are vetted and loaded without it. The vetting server is replaced by one that behaves so."""
    def answer(name, repack):
        if name == "bad.gguf":
            return {"ok": False, "status": "crashed", "signal": "SIGSEGV", "log": "llama.cpp aborted"}
        if repack:
            return {"ok": False, "status": "crashed", "signal": "SIGSEGV", "log": "ldtilecfg"}
        return {"ok": True, "loads": True, "decoded": True}

    asked = fake_vetting(answer)
    files = {n: write_tiny_gguf(tmp_path / n) for n in ("a.gguf", "b.gguf", "bad.gguf")}
    from comfyui_a3b.runtime import default_model_path

    vet.check_file(files["a.gguf"])       # no CorruptGGUF: the file is fine
    assert asked == [("a.gguf", True), ("a.gguf", False)]
    assert not vet.repack_allowed()
    vet.check_file(files["b.gguf"])       # known now: no crash to sit through again
    assert asked[2:] == [("b.gguf", False)]
    with pytest.raises(vet.CorruptGGUF, match="bad.gguf makes llama.cpp's loader crash"):
        vet.check_file(files["bad.gguf"])  # a file that crashes either way is still refused
    vet.VERDICTS.reset()         # a new process reads the verdict from disk
    assert not vet.repack_allowed()
    monkeypatch.setenv("A3B_VET", "off")
    assert not vet.repack_allowed()      # files trusted, the build not: it crashes on every file
    vet.VERDICTS.reset()
    (tmp_path / "cache" / "vetted.json").unlink()
    assert not vet.repack_allowed()      # learnt from the embedded model, vetting off or not
    assert asked[-2:] == [(default_model_path().name, True), (default_model_path().name, False)]
    monkeypatch.setenv("A3B_CPU_REPACK", "off")
    asked.clear()
    assert not vet.repack_allowed() and asked == []


def test_a_working_repack_is_recorded_and_a_crash_with_or_without_it_is_the_files(tmp_path, fake_vetting):
    def answer(name, repack):
        if name == "bad.gguf":
            return {"ok": False, "status": "crashed", "signal": "SIGABRT", "log": "GGML_ASSERT failed"}
        return {"ok": True, "loads": True, "decoded": True}

    asked = fake_vetting(answer)
    good, bad = write_tiny_gguf(tmp_path / "good.gguf"), write_tiny_gguf(tmp_path / "bad.gguf")
    vet.check_file(good)
    assert asked == [("good.gguf", True)]
    # a float file has nothing to repack: whether repacking works is learnt from the embedded model
    from comfyui_a3b.runtime import default_model_path

    assert vet.repack_allowed() and asked[1:] == [(default_model_path().name, True)]
    assert vet.repack_allowed() and len(asked) == 2   # known now
    with pytest.raises(vet.CorruptGGUF, match="GGML_ASSERT"):
        vet.check_file(bad)
    assert asked[2:] == [("bad.gguf", True)]   # an abort is the file's: not tried again without repacking


def test_the_verdicts_on_disk_keep_the_builds_and_forget_files_that_are_gone(tmp_path, monkeypatch, fake_vetting):
    """Many vetted files (a test suite's, a folder of downloads) never push out what was learnt of the
    build, which every process would otherwise learn again; deleted files' verdicts leave; a vetted
    file's verdict holds no llama.cpp log (only a failure's message needs one)."""
    asked = fake_vetting(lambda name, repack: {"ok": True, "loads": True, "decoded": True, "log": "x" * 4000})
    monkeypatch.setattr(vet, "MAX_FILE_VERDICTS", 3)
    assert vet.repack_allowed()                          # learnt from the embedded model
    files = [write_tiny_gguf(tmp_path / f"m{i}.gguf", seed=i) for i in range(5)]
    for f in files:
        vet.check_file(f)
    files[4].unlink()
    vet.check_file(files[0])                             # known: nothing saved
    vet.VERDICTS.save_disk()
    saved = json.loads((tmp_path / "cache" / "vetted.json").read_text())
    keys = [tuple(item["key"]) for item in saved]
    assert keys[0][0] == vet.BUILD_VERDICT and sum(k[0] == vet.BUILD_VERDICT for k in keys) == 1
    assert [Path(k[0]).name for k in keys[1:]] == ["m1.gguf", "m2.gguf", "m3.gguf"]
    assert all("log" not in item["verdict"] for item in saved[1:])
    vet.VERDICTS.reset()                                 # a new process
    n = len(asked)
    assert vet.repack_allowed() and len(asked) == n     # the build's verdict is still known
