"""The `a3b` command line: generate, embed, inspect, verify, doctor, lsp, prune.

It sits at the package root (beside `__init__.py`) because it wires the runtime and the language
server together, which runtime/ itself must not do. Every user error exits with status 2 and one line
on stderr that says what to do.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Sequence


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=None, help="GGUF path or name in $A3B_MODELS (default: embedded SmolLM2-135M)")
    p.add_argument("--n-ctx", type=int, default=None, help="context tokens per request (default 2048)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--n-gpu-layers", type=int, default=None, help="layers to offload to a GPU (-1 = all)")
    p.add_argument("--ctx-policy", choices=["warn", "refuse"], default=None,
                   help="n_ctx beyond the trained context: warn (default) or refuse")


def _spec(rt, args):
    return rt.spec(args.model, n_ctx=args.n_ctx, n_threads=args.threads, n_gpu_layers=args.n_gpu_layers,
                   ctx_policy=args.ctx_policy)


def cmd_generate(args) -> int:
    from .runtime import ConfidenceConfig, get_runtime, preset

    rt = get_runtime()
    spec = _spec(rt, args)
    sampling = preset(args.preset, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                      min_p=args.min_p, repeat_penalty=args.repeat_penalty, seed=args.seed)
    conf = ConfidenceConfig(enabled=True, threshold=args.entropy_threshold, min_run=args.entropy_run,
                            insert_marker=args.mark_low_confidence)
    t0 = time.perf_counter()
    stream = rt.submit(args.prompt, model=spec, system=args.system, chat=not args.raw, max_tokens=args.max_tokens,
                       sampling=sampling, stop=args.stop or (), confidence=conf, template=args.template)
    out = sys.stdout
    try:
        for chunk in stream.text_chunks():
            if not args.json:
                out.write(chunk)
                out.flush()
        res = stream.result()
    except KeyboardInterrupt:
        stream.cancel()
        print("\n[cancelled]", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps(res.as_dict(), indent=2))
    else:
        if args.mark_low_confidence and res.spans:
            out.write("\n--- with low-confidence markers ---\n" + res.text)
        out.write("\n")
        total = time.perf_counter() - t0
        print(f"[{res.n_tokens} tokens, {res.tokens_per_second:.1f} tokens/s, time to first token "
              f"{res.time_to_first_token * 1000:.0f} ms, prompt {res.n_prompt_tokens} tokens, "
              f"seed {res.seed}, {res.finish_reason}, {len(res.spans)} low-confidence spans, "
              f"total {total:.2f} s]", file=sys.stderr)
    return 0


def cmd_embed(args) -> int:
    import numpy as np

    from .runtime import get_runtime

    rt = get_runtime()
    texts = list(args.texts)
    if args.file:
        with open(args.file, encoding="utf-8") as f:
            texts += [line.rstrip("\n") for line in f if line.strip()]
    vecs = rt.embed(texts, model=_spec(rt, args), pooling=args.pooling, normalize=not args.no_normalize)
    if args.npy:
        np.save(args.npy, vecs)
        print(f"wrote {vecs.shape[0]} x {vecs.shape[1]} float32 to {args.npy}", file=sys.stderr)
    else:
        print(json.dumps({"model": rt.spec(args.model).path, "pooling": args.pooling,
                          "normalized": not args.no_normalize, "dim": int(vecs.shape[1]),
                          "embeddings": [{"text": t, "embedding": [round(float(x), 6) for x in v]}
                                         for t, v in zip(texts, vecs)]}))
    return 0


def cmd_inspect(args) -> int:
    from .runtime import inspect_gguf
    from .runtime.llama import llama_cpp_version, probe_architecture

    info = inspect_gguf(args.file)
    ok, why = probe_architecture(info.path)
    d = info.as_dict()
    d["llama_cpp_supports_architecture"] = ok
    d["llama_cpp_python"] = llama_cpp_version()
    if not ok:
        d["llama_cpp_detail"] = why
    if args.json:
        print(json.dumps(d, indent=2, default=str))
        return 0 if ok else 1
    from rich.console import Console
    from rich.table import Table

    t = Table(title=info.path, show_header=False)
    rows = [("architecture", info.architecture), ("name", info.name), ("file size", f"{info.file_size / 1e6:.1f} MB"),
            ("parameters", f"{info.n_params / 1e6:.1f} M"), ("tensors", info.n_tensors),
            ("quantisation", info.file_type), ("tensor types", ", ".join(f"{k}×{v}" for k, v in info.tensor_types.items())),
            ("context length", info.context_length), ("embedding length", info.embedding_length),
            ("layers", info.block_count), ("FFN width", info.feed_forward_length),
            ("heads / KV heads", f"{info.head_count} / {info.head_count_kv}"), ("RoPE base", info.rope_freq_base),
            ("vocabulary", info.vocab_size), ("chat template", "yes" if info.has_chat_template else "no"),
            ("FIM tokens", ", ".join(info.fim_tokens) or "none"),
            ("llama.cpp supports it", f"yes (llama-cpp-python {llama_cpp_version()})" if ok
             else f"NO: {why} (llama-cpp-python {llama_cpp_version()})")]
    rows += [(k, str(v)) for k, v in info.a3b.items()]
    for k, v in rows:
        t.add_row(k, str(v))
    Console().print(t)
    return 0 if ok else 1


def cmd_verify(args) -> int:
    from .runtime import verify_sha256

    digest = verify_sha256(args.file, args.sha256, progress=not args.quiet)
    print(f"OK {digest}  {args.file}")
    return 0


def cmd_doctor(args) -> int:
    import platform

    lines: list[tuple[str, str, bool]] = [("python", f"{platform.python_version()} ({sys.executable})", True)]
    ok_all = True
    try:
        from .runtime.llama import system_info

        si = system_info()
        lines.append(("llama-cpp-python", si["llama_cpp_python"], True))
        lines.append(("llama.cpp build", si["system_info"], True))
        lines.append(("GPU offload compiled in", "yes" if si["gpu_offload"] else "no (CPU only build)", True))
    except Exception as e:
        lines.append(("llama-cpp-python", str(e), False))
        ok_all = False
    try:
        from .runtime import default_model_path, inspect_gguf

        p = default_model_path()
        info = inspect_gguf(p)
        lines.append(("default model", f"{p} ({info.architecture}, {info.file_type}, {info.file_size / 1e6:.0f} MB)", True))
    except Exception as e:
        lines.append(("default model", str(e), False))
        ok_all = False
    if ok_all:
        try:
            from .runtime import get_runtime, preset

            rt = get_runtime()
            t0 = time.perf_counter()
            rt.load()
            load_s = time.perf_counter() - t0
            res = rt.generate("Say hello.", max_tokens=16, sampling=preset("greedy"))
            lines.append(("model load", f"{load_s * 1000:.0f} ms", True))
            lines.append(("generation", f"{res.n_tokens} tokens at {res.tokens_per_second:.0f} tokens/s, "
                          f"first token after {res.time_to_first_token * 1000:.0f} ms: {res.text.strip()[:60]!r}",
                          res.n_tokens > 0))
            vec = rt.embed(["hello"])
            lines.append(("embedding", f"dim {vec.shape[1]}", True))
        except Exception as e:
            lines.append(("generation", f"{type(e).__name__}: {e}", False))
            ok_all = False
    for name, value, ok in lines:
        print(f"{'ok ' if ok else 'ERR'} {name:24} {value}")
    return 0 if ok_all and all(ok for *_, ok in lines) else 1


def cmd_lsp(args) -> int:
    from .lsp_server import main as lsp_main  # the language server is an adapter over the runtime

    return lsp_main(args)


def cmd_prune(args) -> int:
    from . import prune

    return prune.cli_main(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="a3b", description="One local GGUF model for ComfyUI and your editor.")
    p.add_argument("-v", "--verbose", action="store_true", help="log llama.cpp and runtime details")
    sub = p.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="stream text from a model")
    g.add_argument("prompt")
    _add_model_args(g)
    g.add_argument("--system", default=None, help="system prompt")
    g.add_argument("--raw", action="store_true", help="no chat template: continue the prompt as is")
    g.add_argument("--template", default=None, help="llama.cpp chat template name instead of the model's own")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--preset", default="default", help="sampling preset: default, greedy, code, creative, precise")
    g.add_argument("--temperature", type=float, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--min-p", type=float, default=None)
    g.add_argument("--repeat-penalty", type=float, default=None)
    g.add_argument("--seed", type=int, default=None, help="sampler seed: same seed and settings, same text")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--entropy-threshold", type=float, default=2.1, help="nats; low-confidence threshold")
    g.add_argument("--entropy-run", type=int, default=5, help="consecutive tokens that make a low-confidence span")
    g.add_argument("--mark-low-confidence", action="store_true", help="insert a verification marker before low-confidence spans")
    g.add_argument("--json", action="store_true", help="print the result as JSON instead of streaming")
    g.set_defaults(func=cmd_generate)

    e = sub.add_parser("embed", help="print embeddings of texts")
    e.add_argument("texts", nargs="*")
    _add_model_args(e)
    e.add_argument("--file", help="also embed each non-empty line of this file")
    e.add_argument("--pooling", choices=["mean", "cls", "last"], default="mean")
    e.add_argument("--no-normalize", action="store_true")
    e.add_argument("--npy", help="write a float32 .npy file instead of JSON")
    e.set_defaults(func=cmd_embed)

    i = sub.add_parser("inspect", help="show a GGUF's metadata and whether llama.cpp supports it")
    i.add_argument("file")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=cmd_inspect)

    v = sub.add_parser("verify", help="check a file's SHA-256")
    v.add_argument("file")
    v.add_argument("--sha256", required=True)
    v.add_argument("--quiet", action="store_true")
    v.set_defaults(func=cmd_verify)

    d = sub.add_parser("doctor", help="check the installation and run a minimal generation")
    d.set_defaults(func=cmd_doctor)

    lsp = sub.add_parser("lsp", help="run the language server")
    mode = lsp.add_mutually_exclusive_group()
    mode.add_argument("--stdio", action="store_true", help="talk over stdin/stdout (default)")
    mode.add_argument("--tcp", metavar="HOST:PORT", help="listen for editors over TCP")
    mode.add_argument("--ws", metavar="HOST:PORT", help="listen for editors over WebSocket")
    lsp.add_argument("--token", default=None, help="shared secret TCP/WS clients must send (default: $A3B_LSP_TOKEN)")
    lsp.add_argument("--model", "-m", default=None)
    lsp.set_defaults(func=cmd_lsp)

    # add_help=False: `a3b prune --help` is answered by the pruning tool's own parser (args.extra)
    pr = sub.add_parser("prune", help="A3B gated-FFN pruning (needs the 'prune' extra: torch)", add_help=False)
    pr.add_argument("model", nargs="?", default=None)
    pr.set_defaults(func=cmd_prune, _prune_parser=pr)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    import logging

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.cmd != "prune":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    from .runtime.errors import A3BError

    try:
        return int(args.func(args) or 0)
    except A3BError as e:
        print(f"a3b: error: {e}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:
        print(f"a3b: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
