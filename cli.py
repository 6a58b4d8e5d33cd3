"""The `a3b` command line: generate, embed, inspect, verify, doctor, lsp, serve, prune, tune.

It sits at the package root (beside `__init__.py`) because it wires the runtime and the language
server together, which runtime/ itself must not do. cli_files.py (inspect, verify), cli_doctor.py
and cli_reasoning.py hold commands of their own; cliwords.py holds what it says around a
command's output (help layout, version, errors in the words of its flags) and how it reads its input.

Exit status: 0 on success; 2 for a user error, either a usage error argparse reports or a typed
runtime error (`A3BError`), printed as one line `a3b: error: ...`; 1 when a check fails (`inspect`
of an architecture llama.cpp does not know, `doctor`) and for anything else, which is a bug and
prints its traceback; 130 after Ctrl-C.

Every option the runtime takes is added from its declaration in runtime/options/ (its type or
choices, default and help), and the pruning tool's defaults come from PruneConfig, so the help
cannot drift from what a command does.
"""
from __future__ import annotations

import argparse
import errno
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from . import cli_doctor, cli_files, cli_reasoning, cliwords
# prune.cli declares arguments only: importing it imports neither torch nor the pipeline.
from .prune import cli as prune_cli
from .runtime.errors import A3BError, InvalidRequest
from .runtime import options as opt
from .runtime.generation import PRESETS, ConfidenceConfig
from .runtime.options import add_argument

DESCRIPTION = ("One local GGUF model for ComfyUI and your editor: generate and embed text with it, inspect and "
               "verify GGUF files, check the installation, run the language server, and A3B-prune a model.")

EPILOG = """\
examples:
  a3b generate "Write a haiku about the sea." --preset creative --seed 7
  a3b embed "first text" "second text" --npy vectors.npy
  a3b inspect model.gguf
  a3b lsp --tcp 127.0.0.1:7011 --token SECRET
  a3b serve --http 127.0.0.1:8080
  a3b generate "Hello" --model http://gpu-box:8080/v1#qwen3-30b-a3b
  a3b prune model.gguf --keep 0.63 --out model.a3b.gguf
  a3b tune ~/src/myproject --model qwen2.5-coder-1.5b.gguf --out myproject.lora.gguf

`a3b COMMAND --help` documents every option of a command and its default.

exit status: 0 success; 1 a failed check (inspect, doctor) or an internal error, with a traceback; \
2 a usage or user error, explained in one line on stderr; 130 interrupted."""

#: The sampling settings a preset fixes and the command line can override, as shown in the help.
SAMPLING_OPTIONS = ("temperature", "top_p", "top_k", "min_p", "repeat_penalty")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    """The model and its load options, as runtime/options/ declares them."""
    p.add_argument("--model", "-m", default=None,
                   help="GGUF path, a name in ComfyUI's models/LLM or $A3B_MODELS, or an OpenAI-compatible "
                        "server's URL http(s)://HOST:PORT/v1[#MODEL] (API key: $A3B_REMOTE_API_KEY) "
                        "(default: the embedded SmolLM2-135M)")
    add_argument(p, opt.N_CTX, metavar="N")
    add_argument(p, opt.N_THREADS, "--threads", metavar="N")
    add_argument(p, opt.N_BATCH, metavar="N")
    add_argument(p, opt.N_GPU_LAYERS, metavar="N|auto")
    add_argument(p, opt.CTX_POLICY)
    add_argument(p, opt.CPU_MOE, action="store_true")
    add_argument(p, opt.N_CPU_MOE, metavar="N")
    add_argument(p, opt.OVERRIDE_TENSOR, "--override-tensor", "-ot", metavar="REGEX=DEVICE", action="append",
                 default_text="none; the flag may be repeated")
    add_argument(p, opt.MMPROJ, metavar="FILE|auto|off")
    add_argument(p, opt.SPECULATIVE, metavar="MODE")
    add_argument(p, opt.DRAFT_MAX, metavar="N")
    add_argument(p, opt.BACKEND_SAMPLING)


def _add_lora_args(p: argparse.ArgumentParser) -> None:
    add_argument(p, opt.LORA_PATH, "--lora", metavar="ADAPTER.gguf", default_text="none")
    add_argument(p, opt.LORA_SCALE, "--lora-scale", metavar="X")


def _spec(rt, args):
    lora = getattr(args, "lora", None)
    return rt.spec(args.model, n_ctx=args.n_ctx, n_threads=args.threads, n_batch=args.n_batch,
                   n_gpu_layers=args.n_gpu_layers,
                   ctx_policy=args.ctx_policy, speculative=args.speculative, draft_max=args.draft_max,
                   backend_sampling=args.backend_sampling,
                   cpu_moe=args.cpu_moe or None, n_cpu_moe=args.n_cpu_moe or None,
                   override_tensor=",".join(args.override_tensor) if args.override_tensor else None,
                   lora_path=str(Path(lora).resolve()) if lora else None,
                   lora_scale=getattr(args, "lora_scale", None) if lora else None,
                   **({"mmproj": args.mmproj} if getattr(args, "mmproj", None) else {}))


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).splitlines()) or type(error).__name__


def _address(text: str) -> str:
    """argparse type of --tcp/--ws: a loopback HOST:PORT, checked while parsing so that a typo is a
    usage error. Returns the text unchanged; the language server parses it again."""
    from .lsp_server.transport import parse_address

    try:
        parse_address(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    return text


def cmd_generate(args) -> int:
    from .runtime import get_runtime, preset

    rt = get_runtime()
    spec = _spec(rt, args)
    sampling = preset(args.preset, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                      min_p=args.min_p, repeat_penalty=args.repeat_penalty, seed=args.seed,
                      ignore_eos=args.ignore_eos)
    conf = ConfidenceConfig(enabled=True, threshold=args.entropy_threshold, min_run=args.entropy_run,
                            insert_marker=args.mark_low_confidence)
    prompt = cliwords.read_stdin("the prompt") if args.prompt == cliwords.STDIN else args.prompt
    t0 = time.perf_counter()
    images = cliwords.read_images(args.image)
    stream = rt.submit(prompt, model=spec, system=args.system, chat=not args.raw, max_tokens=args.max_tokens,
                       sampling=sampling, stop=args.stop or (), confidence=conf, template=args.template,
                       images=images, **cli_reasoning.request_kwargs(args))
    out, printer = sys.stdout, cli_reasoning.Printer(args.show_reasoning)
    try:
        for ev in stream:
            if not args.json:
                printer.event(ev)
        printer.end()
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
        print(cliwords.summary(res, time.perf_counter() - t0), file=sys.stderr)
        if res.context_full:
            print(cliwords.context_note(res, spec.n_ctx), file=sys.stderr)
        for w in res.warnings:
            print(f"a3b: warning: {w}", file=sys.stderr)
    return 0


def cmd_embed(args) -> int:
    import numpy as np

    from .runtime import get_runtime

    texts = list(args.texts) + (cliwords.read_text_lines(args.file) if args.file else [])
    rt = get_runtime()
    vecs = rt.embed(texts, model=_spec(rt, args), pooling=args.pooling, normalize=not args.no_normalize)
    if args.npy:
        try:
            np.save(args.npy, vecs)
        except OSError as e:
            raise InvalidRequest(f"Cannot write --npy {args.npy}: {e.strerror or e}.") from e
        print(f"wrote {vecs.shape[0]} x {vecs.shape[1]} float32 to {args.npy}", file=sys.stderr)
    else:
        print(json.dumps({"model": rt.spec(args.model).path, "pooling": args.pooling,
                          "normalized": not args.no_normalize, "dim": int(vecs.shape[1]),
                          "embeddings": [{"text": t, "embedding": [round(float(x), 6) for x in v]}
                                         for t, v in zip(texts, vecs)]}))
    return 0


def cmd_lsp(args) -> int:
    # The language server is an adapter over the runtime, imported only by this command.
    from .lsp_server import main as lsp_main

    try:
        return lsp_main(args)
    except OSError as e:
        if e.errno != errno.EADDRINUSE:
            raise
        raise InvalidRequest(f"{args.tcp or args.ws} is already in use; stop what listens there or choose "
                             "another port.") from e


def cmd_serve(args) -> int:
    # The HTTP server is an adapter over the runtime, imported only by this command.
    import logging

    from .runtime import get_runtime
    from .serve import Server, parse_address

    rt = get_runtime()
    spec = _spec(rt, args)
    if args.parallel is not None:
        spec = rt.spec(spec, n_parallel=args.parallel)
    host, port = parse_address(args.http)
    router = None
    if args.route is not None or args.route_examples:   # every route's model loads now: errors at start-up
        from .serve.routed import build_router

        router = build_router(rt, spec, args.route or [], args.route_examples, embedding=args.route_embedding,
                              head_tokens=args.route_head_tokens, rule_hits=args.route_rule_hits)
        spec = router.routes["default"]
    srv = Server(spec, host, port, token=args.token, origins=tuple(args.allow_origin or ()), name=args.name,
                 access_log=not args.quiet, router=router, route_name=args.route_name)
    rt.load(spec)   # errors now, not at the first request
    srv.bind()      # a clear line now rather than a log line from the HTTP server later; the real port
    if not args.quiet:   # one line per request on stderr, as it is
        access = logging.getLogger("a3b.serve.access")
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        access.addHandler(handler)
        access.setLevel(logging.INFO)
        access.propagate = False
    print(f"a3b serve: {srv.cfg.model_id} on {srv.url}" + (" (bearer token required)" if srv.cfg.token else ""),
          file=sys.stderr, flush=True)
    srv.run()
    return 0


def cmd_prune(args) -> int:
    return prune_cli.run(args)


def _presets_epilog() -> str:
    rows = [f"  {name:<9} " + ", ".join(f"{opt.replace('_', '-')} {getattr(params, opt):g}" for opt in SAMPLING_OPTIONS)
            for name, params in PRESETS.items()]
    return "sampling presets (--temperature and the options after it override single values):\n" + "\n".join(rows)


def _add_generate(sub) -> None:
    g = cliwords.command(sub, "generate", "stream text from a model",
                 "Stream a model's answer to PROMPT (or, with --raw, its continuation of PROMPT), then print "
                 "one line on stderr: tokens, tokens/s, time to first token, prompt tokens, the seed, the "
                 "finish reason and the number of low-confidence spans. The same seed and settings give "
                 "the same text.", epilog=_presets_epilog())
    g.add_argument("prompt", help="text to answer, or to continue with --raw; - reads it from standard input")
    _add_model_args(g)
    _add_lora_args(g)
    g.add_argument("--system", default=None, metavar="TEXT", help="system prompt (chat mode only; default: none)")
    g.add_argument("--raw", action="store_true", help="no chat template: continue the prompt as is")
    g.add_argument("--image", action="append", metavar="FILE",
                   help="an image the model looks at, before the prompt's text (PNG, JPEG, WebP, ...; repeatable; "
                        "needs the model's projector, see --mmproj) (default: none)")
    g.add_argument("--template", default=None, metavar="NAME",
                   help="llama.cpp chat template name, e.g. chatml (default: the model's own template)")
    add_argument(g, opt.MAX_TOKENS, metavar="N")
    g.add_argument("--preset", choices=list(PRESETS), default="default",
                   help="sampling preset; its values are listed below")
    for name in SAMPLING_OPTIONS:
        add_argument(g, opt.SAMPLING_OPTIONS[name], default=None, default_text="the preset's value")
    add_argument(g, opt.SEED, metavar="N", default_text="a fresh seed per run, printed at the end")
    add_argument(g, opt.IGNORE_EOS, action="store_true")
    g.add_argument("--stop", action="append", metavar="TEXT",
                   help="stop before this text (repeatable; default: none)")
    add_argument(g, opt.THRESHOLD, "--entropy-threshold", metavar="NATS")
    add_argument(g, opt.MIN_RUN, "--entropy-run", metavar="N")
    g.add_argument("--mark-low-confidence", action="store_true",
                   help="after the streamed text, print it again with a verification marker before "
                        "each low-confidence span")
    g.add_argument("--json", action="store_true", help="print the result as JSON instead of streaming")
    cli_reasoning.add_arguments(g)
    g.set_defaults(func=cmd_generate)


def _add_embed(sub) -> None:
    e = cliwords.command(sub, "embed", "print embeddings of texts",
                 "Embed each TEXT and each non-empty line of --file with the model: one vector per text, "
                 "printed as JSON or written as a float32 .npy array.")
    e.add_argument("texts", nargs="*", metavar="TEXT", help="a text to embed")
    _add_model_args(e)
    e.add_argument("--file", metavar="FILE", help="also embed each non-empty line of this UTF-8 file, - for standard "
                                                 "input (default: none)")
    add_argument(e, opt.POOLING)
    e.add_argument("--no-normalize", action="store_true", help="keep the vectors' lengths instead of scaling them to 1")
    e.add_argument("--npy", metavar="FILE",
                   help="write a float32 .npy array, one row per text, instead of JSON (default: JSON on stdout)")
    e.set_defaults(func=cmd_embed)


def _add_doctor(sub) -> None:
    d = cliwords.command(sub, "doctor", "check the installation and run a minimal generation",
                 "Check Python, llama-cpp-python, the llama.cpp build (CPU features, GPU offload) and the "
                 "default model, then load it and run a minimal generation and embedding. Exit status 1 "
                 "when a check fails.")
    d.set_defaults(func=cli_doctor.cmd_doctor)


def _add_lsp(sub) -> None:
    lsp = cliwords.command(sub, "lsp", "run the language server",
                   "Run the language server (inline completions, quick fixes, embeddings from the local model) for "
                   "VS Code, Neovim and other LSP editors: over stdin/stdout for one editor, or on a "
                   "loopback TCP or WebSocket address several editors share.")
    mode = lsp.add_mutually_exclusive_group()
    mode.add_argument("--stdio", action="store_true", help="talk to one editor over stdin/stdout (the default)")
    mode.add_argument("--tcp", type=_address, metavar="HOST:PORT",
                      help="listen for editors over TCP on a loopback address, e.g. 127.0.0.1:7011 "
                           "(default: --stdio)")
    mode.add_argument("--ws", type=_address, metavar="HOST:PORT",
                      help="listen for editors over WebSocket on a loopback address (default: --stdio)")
    add_argument(lsp, opt.LSP_TOKEN, default_text=f"${opt.LSP_TOKEN.env}; without either, any local user can "
                 "connect")
    lsp.add_argument("--model", "-m", default=None,
                     help="model for editors whose settings name none (default: the embedded SmolLM2-135M)")
    lsp.set_defaults(func=cmd_lsp)


def _add_serve(sub) -> None:
    sv = cliwords.command(sub, "serve", "serve the model over the OpenAI API",
                  "Serve the model over an OpenAI-compatible HTTP API (/v1/models, /v1/chat/completions, "
                  "/v1/completions, /v1/embeddings) and llama-server's /infill, /tokenize, /props and /health, "
                  "for Open WebUI, Continue, Zed, the openai client, llama.vim and llama.vscode. Loopback only "
                  "unless a token is given; browser Origins are refused unless allowed.")
    sv.add_argument("--http", default="127.0.0.1:8080", metavar="HOST:PORT",
                    help="address to listen on; a non-loopback host needs --token")
    _add_model_args(sv)
    _add_lora_args(sv)
    add_argument(sv, opt.N_PARALLEL, "--parallel", metavar="N")
    add_argument(sv, opt.SERVE_TOKEN, default_text=f"${opt.SERVE_TOKEN.env}; without either, any local user can "
                 "connect")
    sv.add_argument("--allow-origin", action="append", metavar="ORIGIN",
                    help="a browser Origin allowed to call the server, e.g. http://localhost:3000 (repeatable; "
                         "default: none, every browser page is refused)")
    sv.add_argument("--name", default=None, help="the model's id in /v1/models (default: the file's name)")
    sv.add_argument("--quiet", "-q", action="store_true", help="no line per request on stderr")
    sv.add_argument("--route", action="append", metavar="NAME=MODEL",
                    help="route requests by task type: code=MODEL, default=MODEL (repeatable; requests naming "
                         "--route-name are sent to the model whose route matches, see docs/scaling.md; default: none, "
                         "no routing)")
    sv.add_argument("--route-name", default="auto", help="the served name that routes (default: auto)")
    sv.add_argument("--route-examples", metavar="FILE",
                    help="JSON object: route name -> example prompts (default: built-in ones for code and default)")
    for o in (opt.ROUTE_EMBEDDING, opt.ROUTE_HEAD_TOKENS, opt.ROUTE_RULE_HITS):
        add_argument(sv, o)
    sv.set_defaults(func=cmd_serve)


def _add_prune(sub) -> None:
    pr = cliwords.command(sub, "prune", "A3B gated-FFN pruning (needs the 'prune' extra: torch)", prune_cli.DESCRIPTION)
    prune_cli.add_arguments(pr)
    pr.set_defaults(func=cmd_prune)


def _add_tune(sub) -> None:
    from .tune import cli as tune_cli   # the arguments only: no torch until the command runs

    tu = cliwords.command(sub, "tune", "train a LoRA adapter on a repository's code (needs the 'prune' extra: torch)",
                  tune_cli.DESCRIPTION)
    tune_cli.add_arguments(tu)
    tu.set_defaults(func=tune_cli.run)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="a3b", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=cliwords.HelpFormatter)
    p.add_argument("-v", "--verbose", action="store_true", help="log llama.cpp and runtime details to stderr")
    p.add_argument("--version", action="version", version=cliwords.version(),
                   help="print the versions of a3b, llama-cpp-python and Python, and exit")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND", title="commands",
                         help="`a3b COMMAND --help` documents its options")
    for add in (_add_generate, _add_embed, cli_files.add_inspect, cli_files.add_verify, _add_doctor, _add_lsp,
                _add_serve, _add_prune, _add_tune):
        add(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. Typed user errors become one line on stderr and status 2; any other
    exception propagates (a traceback, status 1), since it is a bug to report, not a user mistake."""
    import logging

    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except A3BError as e:
        words = cliwords.flag_words(_one_line(e), cliwords.command_parser(parser, args.cmd))
        print(f"a3b: error: {words}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # the reader went away (`a3b inspect --json | head`): not an error of ours. Point stdout at
        # /dev/null so the interpreter's final flush does not complain a second time.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
