"""The vetting server: loads GGUF files llama.cpp has not seen yet, where a crash cannot hurt.

Run by runtime/models/vet.py as a separate process (`python vetchild.py`), standalone on purpose: it
imports only the standard library and llama_cpp, never the comfyui_a3b package. It reads one JSON
request per line on stdin, forks a child per file (forking is safe here: this process has a single
thread and never loads a model itself), and the child loads the file with llama.cpp on the CPU,
creates a small context and decodes one token (with or without llama.cpp's CPU weight repacking, as
the request says); a LoRA adapter is loaded over its base and applied for that token, a projector
is loaded over its text model and encodes a small image. The child's stderr and llama.cpp's log go to a pipe;
its last line is the result. An abort (llama.cpp's GGML_ASSERT), a segmentation fault or a timeout
kills only the child; the server reports it as one JSON line on stdout and goes on.
"""
import json
import os
import resource
import select
import signal
import sys
import time

RESULT = b"A3B-VET-RESULT "


def _log_to_stderr(L):
    """Send llama.cpp's log to this child's stderr (the host reads it back) and start the backend;
    the returned callback must stay referenced while llama.cpp runs."""
    import ctypes

    @L.llama_log_callback
    def _log(level, text, user_data):
        os.write(2, text)

    L.llama_log_set(_log, ctypes.c_void_p(0))
    L.llama_backend_init()
    return _log


def _load(L, path: str, repack: bool):
    """(model, its vocabulary, "Hello world" as up to 64 token ids, their count) on the CPU, weights
    repacked for it or not; (None, None, None, 0) when llama.cpp refuses the file."""
    params = L.llama_model_default_params()
    params.n_gpu_layers = 0
    if not repack:
        params.use_extra_bufts = False
    model = L.llama_model_load_from_file(path.encode("utf-8"), params)
    if not model:
        return None, None, None, 0
    vocab = L.llama_model_get_vocab(model)
    buf = (L.llama_token * 64)()
    text = b"Hello world"
    return model, vocab, buf, L.llama_tokenize(vocab, text, len(text), buf, 64, True, False)


def _decode(L, ctx, batch, seqs, start: int, toks) -> int:
    """One llama_decode of `toks` from position `start` in each of the sequences `seqs`, logits
    for each sequence's last token (binding.fill_batch's work: this process imports no package code)."""
    k = 0
    for s in seqs:
        for i, t in enumerate(toks):
            batch.token[k], batch.pos[k], batch.n_seq_id[k] = t, start + i, 1
            batch.seq_id[k][0], batch.logits[k] = s, i == len(toks) - 1
            k += 1
    batch.n_tokens = k
    return L.llama_decode(ctx, batch)


def _small_context(L, model):
    """A 64-token context on one thread, for the one decode a check makes (NULL when it cannot open)."""
    cp = L.llama_context_default_params()
    cp.n_ctx = cp.n_batch = cp.n_ubatch = 64
    cp.n_threads = cp.n_threads_batch = 1
    return L.llama_init_from_model(model, cp)


def _check(path: str, decode: bool, repack: bool = True) -> dict:

    import llama_cpp as L

    _log = _log_to_stderr(L)   # held while llama.cpp may call it
    model, vocab, buf, n = _load(L, path, repack)
    if not model:
        return {"ok": True, "loads": False}   # a clean refusal: the host's own load reports it
    if not decode or n <= 0:
        return {"ok": True, "loads": True, "decoded": False}
    ctx = _small_context(L, model)
    if not ctx:
        return {"ok": True, "loads": True, "decoded": False}
    rc = _decode(L, ctx, L.llama_batch_init(64, 0, 1), [0], 0, list(buf[:n]))
    return {"ok": True, "loads": True, "decoded": rc == 0}


def _check_lora(base: str, path: str, decode: bool, repack: bool) -> dict:
    """An adapter: the base loaded, the adapter loaded over it, and (a small base) one decode with the
    adapter applied, where llama.cpp multiplies with its tensors. A refusal is clean (the host's own
    load reports it); an abort or a fault ends only this child."""
    import ctypes

    import llama_cpp as L

    _log = _log_to_stderr(L)   # held while llama.cpp may call it
    model, vocab, buf, n = _load(L, base, repack)
    if not model:
        return {"ok": True, "loads": False, "why": "the base did not load"}
    adapter = L.llama_adapter_lora_init(model, path.encode("utf-8"))
    if not adapter:
        return {"ok": True, "loads": False}
    if not decode or n <= 0:
        return {"ok": True, "loads": True, "decoded": False}
    ctx = _small_context(L, model)
    if not ctx:
        return {"ok": True, "loads": True, "decoded": False}
    adapters = (L.llama_adapter_lora_p_ctypes * 1)(adapter)
    scales = (ctypes.c_float * 1)(1.0)
    L.llama_set_adapters_lora(ctx, adapters, 1, scales)
    rc = _decode(L, ctx, L.llama_batch_init(64, 0, 1), [0], 0, list(buf[:n]))
    return {"ok": True, "loads": True, "decoded": rc == 0}


def _check_sampling(path: str, repack: bool) -> dict:
    """Backend sampling with this build: a chain (top-k, temperature, dist) and a greedy one attached
    to two sequences of one context, a batch with a third sequence sampled on the CPU, two decodes.
    `works`: every backend token is a real token and the greedy one is the raw argmax of a context
    without backend chains. `entropy`: both chains carry graph_entropy's taps, and the entropy they
    measure matches the CPU's over the plain context's row. A crash here (an AMX kernel over repacked
    weights did) stays in the child."""
    import llama_cpp as L
    import numpy as np

    import graph_entropy   # beside this file, standalone like it
    from rows import entropy as cpu_entropy

    _log = _log_to_stderr(L)   # held while llama.cpp may call it
    model, vocab, buf, n = _load(L, path, repack)
    if not model or n <= 0:
        return {"ok": True, "works": False, "why": "the probe's model did not load"}

    def context():
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max, cp.kv_unified = 3 * 64, 64, 64, 3, False
        cp.n_threads = cp.n_threads_batch = 1
        return L.llama_init_from_model(model, cp)

    batch = L.llama_batch_init(64, 0, 1)

    def decode(ctx, seqs, start, toks):
        return _decode(L, ctx, batch, seqs, start, toks)

    plain = context()
    if decode(plain, [0], 0, list(buf[:n])) != 0:
        return {"ok": True, "works": False, "why": "plain decode failed"}
    n_vocab = L.llama_vocab_n_tokens(vocab)
    logits = np.ctypeslib.as_array(L.llama_get_logits_ith(plain, n - 1), shape=(n_vocab,))
    want, h_cpu = int(logits.argmax()), cpu_entropy(logits)
    ctx = context()
    chains = []
    for greedy in (True, False):
        c = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        measure, deliver = graph_entropy.taps(L)
        for smpl in ([measure, L.llama_sampler_init_greedy(), deliver] if greedy else
                     [measure, L.llama_sampler_init_top_k(40), L.llama_sampler_init_temp(0.7),
                      L.llama_sampler_init_dist(1), deliver]):
            L.llama_sampler_chain_add(c, smpl)
        if not L.llama_set_sampler(ctx, len(chains), c):
            return {"ok": True, "works": False, "why": "llama_set_sampler refused a chain"}
        chains.append(c)
    got = []
    for step in range(2):
        toks = list(buf[:n]) if step == 0 else [want]
        if decode(ctx, [0, 1, 2], 0 if step == 0 else n, toks) != 0:
            return {"ok": True, "works": False, "why": "decode with backend chains failed"}
        rows = [len(toks) * (s + 1) - 1 for s in range(3)]
        got.append([L.llama_get_sampled_token_ith(ctx, r) for r in rows[:2]])
        if step == 0:
            h_graph = [graph_entropy.read(L, ctx, r) for r in rows[:2]]
        for c, tok in zip(chains, got[-1]):
            L.llama_sampler_accept(c, tok)
    for s in range(2):
        L.llama_set_sampler(ctx, s, None)
    works = got[0][0] == want and all(0 <= t < n_vocab for pair in got for t in pair)
    # the same row, the same formula in float32: within a few units of the last place
    same = all(h is not None and abs(h - h_cpu) <= 1e-3 * max(1.0, h_cpu) for h in h_graph)
    return {"ok": True, "works": works, "entropy": works and same,
            "why": "" if works else f"tokens {got}, argmax {want}",
            "entropies": [h_cpu, *h_graph]}


def _check_mmproj(path: str, encode: bool, base: str | None = None) -> dict:
    """A projector: libmtmd's clip loader reads it over the text model `base` (without one, libmtmd
    cannot tokenize an image prompt, and nothing would be encoded), then, for a small file, encodes one
    small image: some values load and abort at the first encode (a head count of 0 reshapes by zero
    heads). A projector of another width than the text model is refused cleanly (the host says so)."""
    import ctypes

    lib_dir = os.environ.get("LLAMA_CPP_LIB_PATH")   # libmtmd beside libllama, as the host takes it
    if lib_dir and not os.environ.get("MTMD_CPP_LIB") and os.path.exists(os.path.join(lib_dir, "libmtmd.so")):
        os.environ["MTMD_CPP_LIB"] = lib_dir
    import llama_cpp as L
    from llama_cpp import mtmd_cpp as M

    _log = _log_to_stderr(L)   # held while llama.cpp may call it
    text_model = None
    if base:
        text_model = _load(L, base, False)[0]
        if not text_model:
            return {"ok": True, "loads": False, "why": "the text model did not load"}
    p = M.mtmd_context_params_default()
    p.use_gpu = False
    p.n_threads = 1
    p.warmup = False
    p.print_timings = False
    ctx = M.mtmd_init_from_file(path.encode("utf-8"), text_model, p)
    if not ctx:
        return {"ok": True, "loads": False}
    if not encode or not M.mtmd_support_vision(ctx):
        return {"ok": True, "loads": True, "decoded": False}
    side = 64
    rgb = (ctypes.c_ubyte * (side * side * 3))(*([128] * (side * side * 3)))
    bitmap = M.mtmd_bitmap_init(side, side, rgb)
    marker = M.mtmd_default_marker()
    text = b"look: " + marker
    inp = M.mtmd_input_text(text, len(text), False, True)
    chunks = M.mtmd_input_chunks_init()
    arr = (M.mtmd_bitmap_p_ctypes * 1)(bitmap)
    if M.mtmd_tokenize(ctx, chunks, ctypes.byref(inp), arr, 1) != 0:
        return {"ok": True, "loads": True, "decoded": False}
    for i in range(M.mtmd_input_chunks_size(chunks)):
        c = M.mtmd_input_chunks_get(chunks, i)
        if M.mtmd_input_chunk_get_type(c) == 1:
            return {"ok": True, "loads": True, "decoded": M.mtmd_encode_chunk(ctx, c) == 0}
    return {"ok": True, "loads": True, "decoded": False}


def _address_space() -> int:
    """Bytes of address space this process has mapped now (Linux; 0 where unknown)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _child(path: str, decode: bool, repack: bool, timeout: float, mem_limit: int, w: int,
           kind: str = "model", base: str | None = None) -> None:
    os.dup2(w, 2)   # GGML_ASSERT writes to stderr: its message reaches the parent before the abort
    os.dup2(w, 1)
    signal.alarm(max(1, int(timeout)))
    if mem_limit > 0:
        # On top of what the libraries (imported by the server before it forked) mapped already:
        # a CUDA or Vulkan build's runtime reserves
        # gigabytes of address space as it loads, so an absolute limit would fail its mappings.
        limit = _address_space() + mem_limit
        try:
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        except (ValueError, OSError):
            pass
    try:
        result = (_check_mmproj(path, decode, base) if kind == "mmproj" else
                  _check_lora(base, path, decode, repack) if kind == "lora" else
                  _check_sampling(path, repack) if kind == "sampling" else _check(path, decode, repack))
    except BaseException as e:  # noqa: BLE001 - a Python error in the check is not the file's fault
        result = {"ok": True, "error": f"{type(e).__name__}: {e}"}
    os.write(w, b"\n" + RESULT + json.dumps(result).encode() + b"\n")
    os._exit(0)


def _vet(req: dict) -> dict:
    path = req["path"]
    timeout = float(req.get("timeout", 120))
    r, w = os.pipe()
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            _child(path, bool(req.get("decode", True)), bool(req.get("repack", True)), timeout,
                   int(req.get("mem_limit", 0)), w, str(req.get("kind", "model")), req.get("base"))
        finally:
            os._exit(70)
    os.close(w)
    out = bytearray()
    deadline = t0 + timeout + 5
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            os.kill(pid, signal.SIGKILL)
            break
        ready, _, _ = select.select([r], [], [], left)
        if ready:
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            if len(out) < 1 << 20:
                out += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    seconds = round(time.monotonic() - t0, 3)
    text = bytes(out)
    if RESULT in text:
        head, _, tail = text.rpartition(RESULT)
        result = json.loads(tail.split(b"\n", 1)[0])
        result.update(seconds=seconds, log=head.decode("utf-8", "replace")[-4000:])
        return result
    log = text.decode("utf-8", "replace")[-4000:]
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        why = "timeout" if sig in (signal.SIGALRM, signal.SIGKILL) else "crashed"
        return {"ok": False, "status": why, "signal": name, "seconds": seconds, "log": log}
    return {"ok": False, "status": "crashed", "exit_code": os.WEXITSTATUS(status), "seconds": seconds, "log": log}


def main() -> None:
    import llama_cpp  # noqa: F401  (imported once here, so each fork starts warm)

    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            reply = _vet(json.loads(line))
        except Exception as e:  # noqa: BLE001 - a bad request must not end the server
            reply = {"ok": False, "status": "server_error", "log": f"{type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
