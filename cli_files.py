"""`a3b inspect` and `a3b verify`: what a GGUF holds and whether llama.cpp runs it, and a file's
SHA-256 against its published digest; neither loads a model."""
from __future__ import annotations

import json

from . import cliwords


def cmd_inspect(args) -> int:
    from .runtime import inspect_gguf
    from .runtime.llama import llama_cpp_version
    from .runtime.llama.weights import probe_architecture

    cliwords.check_readable(args.file)
    info = inspect_gguf(cliwords.model_file(args.file))
    if info.architecture == "clip":   # a projector is no model of its own
        ok, why = False, "a multimodal projector (mmproj): it is loaded beside its model (--mmproj), not alone"
    else:
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
            ("quantisation", info.file_type),
            ("tensor types", ", ".join(f"{k}×{v}" for k, v in info.tensor_types.items())),
            ("context length", info.context_length), ("embedding length", info.embedding_length),
            ("layers", info.block_count), ("FFN width", info.feed_forward_length),
            ("heads / KV heads", f"{info.head_count} / {info.head_count_kv}"), ("RoPE base", info.rope_freq_base),
            ("vocabulary", info.vocab_size), ("chat template", "yes" if info.has_chat_template else "no"),
            ("FIM tokens", ", ".join(info.fim_tokens) or "none"),
            ("llama.cpp supports it", f"yes (llama-cpp-python {llama_cpp_version()})" if ok
             else f"NO: {why} (llama-cpp-python {llama_cpp_version()})")]
    if info.expert_count:
        rows += [("experts / used per token", f"{info.expert_count} / {info.expert_used_count}"),
                 ("expert FFN width", info.expert_feed_forward_length)]
    rows += [(k, str(v)) for k, v in info.a3b.items()]
    for k, v in rows:
        t.add_row(k, str(v))
    Console().print(t)
    return 0 if ok else 1


def cmd_verify(args) -> int:
    from .runtime import verify_sha256

    cliwords.check_readable(args.file)
    digest = verify_sha256(args.file, args.sha256, progress=not args.quiet)
    print(f"OK {digest}  {args.file}")
    return 0


def add_inspect(sub) -> None:
    i = cliwords.command(sub, "inspect", "show a GGUF's metadata and whether llama.cpp supports it",
                 "Show a GGUF's architecture, sizes, context length, quantisation, RoPE base, chat template "
                 "and a3b.* keys, and whether the installed llama.cpp supports its architecture (exit "
                 "status 1 when it does not).")
    i.add_argument("file", metavar="FILE", help="the GGUF file: a path, a name in the model folders, or default "
                                                "(the embedded model), as --model takes it")
    i.add_argument("--json", action="store_true", help="print JSON instead of a table")
    i.set_defaults(func=cmd_inspect)


def add_verify(sub) -> None:
    v = cliwords.command(sub, "verify", "check a file's SHA-256",
                 "Stream FILE's SHA-256 (constant memory, with a progress bar) and compare it with the "
                 "expected digest; a mismatch is an error (exit status 2).")
    v.add_argument("file", metavar="FILE", help="the file to check")
    v.add_argument("--sha256", required=True, metavar="HEX", help="expected digest: 64 hex characters")
    v.add_argument("--quiet", action="store_true", help="no progress bar")
    v.set_defaults(func=cmd_verify)
