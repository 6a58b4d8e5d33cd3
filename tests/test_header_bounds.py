"""Header values read before llama.cpp has accepted a file are bounded.

The layer planner and the main-memory check read a GGUF's layer count, head counts, key lengths,
vocabulary and tensor shapes before the file is loaded; a crafted value there must be a clean error,
not a list of four billion layers. Crafted files are tiny GGUFs with integer header values patched
(tinygguf.patched_copy). Everything that could allocate without bound runs in a child process with
a limit on its address space, so a regression fails instead of swapping the machine.
"""
from __future__ import annotations

import json
import os
import random
import resource
import subprocess
import sys
import textwrap
import time

import pytest

from tinygguf import numeric_fields, patched_copy, write_tiny_gguf

TESTS = os.path.dirname(os.path.abspath(__file__))
#: address space of the child processes: far above what a tiny model needs, far below a list of 2**31 layers
LIMIT_BYTES = 4 << 30
#: the head and key-length keys present, so that each can be patched
EXTRA = {"llama.vocab_size": 271, "llama.attention.key_length": 16, "llama.attention.value_length": 16}
CRAFTED = {
    "llama.block_count": [2**31, 2**32 - 1, 513],
    "llama.attention.head_count": [2**31, 2**32 - 1],
    "llama.attention.head_count_kv": [2**32 - 1],
    "llama.attention.key_length": [2**32 - 1],
    "llama.embedding_length": [2**32 - 1],
    "llama.vocab_size": [2**32 - 1],
    "tensor:token_embd.weight:1": [2**40],
    "tensor:blk.1.ffn_down.weight:0": [2**39],
}


def _limit() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT_BYTES, LIMIT_BYTES))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("bounds") / "tiny.gguf", extra_kv=EXTRA)


def _crafted(tiny, tmp_path):
    out = {}
    for key, values in CRAFTED.items():
        for v in values:
            out[f"{key}={v}"] = str(patched_copy(tiny, tmp_path / f"{len(out)}.gguf", {key: v}))
    return out


def test_the_bounded_values_of_a_sound_file(tiny):
    from comfyui_a3b.runtime.models.ggufscan import Dims, scan_header

    d = Dims.of(scan_header(tiny), tiny)
    assert (d.n_layer, d.n_embd, d.n_head, d.n_head_kv, d.key_length, d.n_vocab) == (2, 64, 4, 2, 16, 271)


def test_each_crafted_header_value_is_refused_by_the_planner_naming_its_key(tiny, tmp_path):
    """In a child with a 4 GiB address space: `[0] * n_layer` of a crafted block_count fails there."""
    files = _crafted(tiny, tmp_path)
    code = f"""
        import json, resource, time
        resource.setrlimit(resource.RLIMIT_AS, ({LIMIT_BYTES}, {LIMIT_BYTES}))
        from comfyui_a3b.runtime.llama import offload
        out = {{}}
        for name, path in {json.dumps(files)}.items():
            t0 = time.perf_counter()
            try:
                offload.host_bytes(path, n_gpu_layers=0, n_ctx=256, n_parallel=1, kv_cache_type="f16")
                out[name] = ["accepted", ""]
            except Exception as e:
                out[name] = [type(e).__name__, str(e), time.perf_counter() - t0]
        print(json.dumps(out))
    """
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    for name, (kind, message, *seconds) in out.items():
        key = name.split("=")[0]
        assert kind in ("CorruptGGUF", "TruncatedGGUF"), (name, kind, message)
        assert (key.split(":")[1] if key.startswith("tensor:") else key) in message, (name, message)
        assert seconds[0] < 2.0, (name, seconds)


@pytest.mark.parametrize("vetting", ["on", "off"])
@pytest.mark.parametrize("block_count", [2**31, 2**32 - 1])
def test_a3b_generate_on_a_crafted_layer_count_ends_at_once_with_one_line(tiny, tmp_path, vetting, block_count):
    """Before: 2**31 layers hung past 45 s, 2**32 - 1 ended in a MemoryError traceback. With vetting
    on, llama.cpp's assertion in the vetting child says it; with vetting off, the planner's bound."""
    bad = patched_copy(tiny, tmp_path / "bad.gguf", {"llama.block_count": block_count})
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "comfyui_a3b.cli", "generate", "Hi", "--model", str(bad),
                        "--max-tokens", "2", "--n-ctx", "256"], capture_output=True, text=True, timeout=90,
                       preexec_fn=_limit, env={**os.environ, "A3B_VET": vetting, "A3B_CACHE": str(tmp_path / "c")})
    elapsed = time.monotonic() - t0
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("a3b: error:"), p.stderr
    assert ("LLAMA_MAX_LAYERS" if vetting == "on" else "block_count is") in lines[0], lines[0]
    assert elapsed < 30, elapsed


#: edge values a damaged or hostile writer puts in an integer field
EDGES = [0, 1, 2, 3, 255, 256, 65535, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**63, 2**64 - 1]


def _mutants(fields: list[str], n: int, seed: int = 2028) -> list[dict[str, int]]:
    """`n` seeded mutations of one or two integer header fields each: edge values or random ones."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        picks = rng.sample(fields, rng.choice((1, 1, 2)))
        out.append({f: rng.choice(EDGES) if rng.random() < 0.8 else rng.getrandbits(rng.choice((8, 32, 64)))
                    for f in picks})
    return out


def test_fuzzed_integer_header_fields_end_in_time_with_success_or_one_error_line(tiny, tmp_path):
    """36 seeded mutants of the tiny model's integer header fields (layer, head, context and
    vocabulary sizes, token ids, tensor dimensions, the counts), each run through `a3b generate` in one
    child with a 4 GiB address space: every one ends within 20 s, with exit status 0 or 2 and, for 2,
    exactly one line on stderr."""
    fields = sorted(numeric_fields(tiny))
    # every field the runtime reads before llama.cpp accepts a file is among those mutated
    assert {"llama.block_count", "llama.attention.head_count", "llama.vocab_size", "tensor_count"} <= set(fields)
    files = {}
    for i, values in enumerate(_mutants(fields, 36)):
        files[f"m{i:02d} {values}"] = str(patched_copy(tiny, tmp_path / f"m{i:02d}.gguf", values))
    code = f"""
        import contextlib, io, json, resource, sys, time
        resource.setrlimit(resource.RLIMIT_AS, ({LIMIT_BYTES}, {LIMIT_BYTES}))
        from comfyui_a3b import cli
        from comfyui_a3b.runtime.models import vet
        with contextlib.redirect_stderr(io.StringIO()):
            vet.repack_allowed()   # learnt once per build from the embedded model: its warning is not a mutant's
        for name, path in {json.dumps(files)}.items():
            out, err = io.StringIO(), io.StringIO()
            t0 = time.perf_counter()
            try:
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                    rc = cli.main(["generate", "Hi", "--model", path, "--max-tokens", "2", "--n-ctx", "256"])
            except BaseException as e:
                rc, err = "bug", io.StringIO(f"{{type(e).__name__}}: {{e}}")
            print(json.dumps([name, rc, time.perf_counter() - t0, err.getvalue()]), flush=True)
    """
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                       timeout=600, env={**os.environ, "A3B_CACHE": str(tmp_path / "cache")})
    done = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("[")]
    assert p.returncode == 0 and len(done) == len(files), (p.returncode, done[-3:], p.stderr[-2000:])
    outcomes = {0: 0, 2: 0}
    for name, rc, seconds, err in done:
        assert rc in (0, 2), (name, rc, err)
        assert seconds < 20, (name, seconds)
        if rc == 2:
            lines = err.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("a3b: error:"), (name, err)
        outcomes[rc] += 1
    assert outcomes[2] >= 12, outcomes     # most mutants are damaged files, and each got its error
