"""What the `a3b` command says around a command's output, and how it reads what it is given: its
help layout and version, errors in the words of its flags, the note after a generation that the
context ran out; `-` for standard input, text files, and model files named as `--model` names them.

The runtime's errors name the fields a caller sets (`max_tokens must be >= 1`), as the nodes, the
language server and the HTTP server see them; on a command line the same setting is a flag
(`--max-tokens`), so the CLI rewrites those names before it prints an error.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from .runtime.errors import InvalidRequest
from .runtime.generation import context_note as generation_context_note

#: the runtime's names of settings that a flag spells another way (the others are a flag's dest)
FIELD_FLAGS = {"n_threads": "--threads", "n_parallel": "--parallel", "confidence threshold": "--entropy-threshold",
               "threshold": "--entropy-threshold", "min_run": "--entropy-run"}
#: the standard-input argument, as other Unix commands take it
STDIN = "-"


def version() -> str:
    """`a3b --version`: this package's version and the llama.cpp binding's, read from the installed
    distributions (importing llama_cpp would load the library for nothing)."""
    import platform
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    def v(name: str) -> str:
        try:
            return dist_version(name)
        except PackageNotFoundError:
            return "not installed"

    return (f"a3b (comfyui-a3b) {v('comfyui-a3b')}, llama-cpp-python {v('llama-cpp-python')}, "
            f"Python {platform.python_version()}")


def flag_words(message: str, parser: argparse.ArgumentParser | None) -> str:
    """`message` with the runtime's field names replaced by the flags of `parser` that set them.

    A name with an underscore (`max_tokens`) is replaced wherever it stands as a word; a plain word
    (`temperature`, `seed`) only where it names a setting: before `must`, `=`, `<` or `>`."""
    if parser is None:
        return message
    flags = {a.dest: max(a.option_strings, key=len) for a in parser._actions
             if a.option_strings and a.dest not in ("help", "version")}
    given = set(flags.values())
    flags.update({name: flag for name, flag in FIELD_FLAGS.items() if flag in given})
    if not flags:
        return message
    names = sorted(flags, key=len, reverse=True)   # the longest first: "confidence threshold" before "threshold"
    pattern = re.compile(r"(?<![\w./-])(" + "|".join(map(re.escape, names)) + r")(?![\w/])"
                         r"(?P<setting>(?=\s*(?:must\b|=|[<>])))?")
    return pattern.sub(lambda m: flags[m[1]] if "_" in m[1] or m["setting"] is not None else m[1], message)


def command_parser(parser: argparse.ArgumentParser, name: str | None) -> argparse.ArgumentParser | None:
    """The parser of subcommand `name`."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get(name)
    return None


def read_stdin(what: str) -> str:
    """All of standard input as text, for `-` in place of `what`; InvalidRequest when it is not UTF-8."""
    data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequest(f"Standard input ({what} '-') is not UTF-8 text (byte {e.start}).") from None


def spans(n: int) -> str:
    return f"{n} low-confidence span{'' if n == 1 else 's'}"


def summary(result, seconds: float) -> str:
    """The line after a streamed generation: tokens, speed, first token, prompt, seed, finish reason,
    low-confidence spans, reasoning tokens (of a thinking model), drafts, where the tokens were drawn
    (sampler_choice.py) and the time in all."""
    reasoning = f"{result.n_reasoning_tokens} reasoning tokens, " if result.n_reasoning_tokens else ""
    drafted = getattr(result, "n_drafted_tokens", 0)
    drafts = f"{result.n_accepted_tokens} of {drafted} drafted tokens accepted, " if drafted else ""
    sampler = getattr(result, "sampler", "")
    drafts += f"{sampler} sampler, " if sampler else ""
    return (f"[{result.n_tokens} tokens, {result.tokens_per_second:.1f} tokens/s, time to first token "
            f"{result.time_to_first_token * 1000:.0f} ms, prompt {result.n_prompt_tokens} tokens, "
            f"seed {result.seed}, {result.finish_reason}, {spans(len(result.spans))}, {reasoning}{drafts}"
            f"total {seconds:.2f} s]")


def context_note(result, n_ctx: int) -> str:
    """The runtime's note on an answer the context's end cut (runtime/generation.py), in the CLI's words."""
    return "a3b: note: " + generation_context_note(result, n_ctx, "--n-ctx", "--max-tokens")


class HelpFormatter(argparse.HelpFormatter):
    """Ends every option's help with its default, and keeps examples and tables as written.

    An option whose default is None, or whose help already says what happens without it, is left
    as is: its help text explains the default in words.
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.nargs == 0 or action.default in (None, argparse.SUPPRESS, []):
            return text
        return text + " (default: %(default)s)"

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        # Paragraphs with indented lines (examples, tables) keep their lines; prose is wrapped.
        out = []
        for para in text.split("\n\n"):
            lines = para.splitlines()
            if any(line.startswith(" ") for line in lines):
                out.append("\n".join(indent + line for line in lines))
            else:
                out.append(super()._fill_text(para, width, indent))
        return "\n\n".join(out)


def read_text_lines(path: str) -> list[str]:
    """The non-empty lines of an `embed --file` (`-`: standard input), or InvalidRequest saying why it
    cannot be read."""
    if path == STDIN:
        return [line for line in read_stdin("--file").splitlines() if line.strip()]
    try:
        with open(path, encoding="utf-8") as f:
            return [line.rstrip("\n") for line in f if line.strip()]
    except FileNotFoundError as e:
        raise InvalidRequest(f"--file {path}: no such file; give a text file with one text per line.") from e
    except UnicodeDecodeError as e:
        raise InvalidRequest(f"--file {path} is not UTF-8 text (byte {e.start}); give a text file "
                             "with one text per line.") from e
    except OSError as e:
        raise InvalidRequest(f"Cannot read --file {path}: {e.strerror or e}.") from e


def check_readable(path: str) -> None:
    """InvalidRequest for an existing file this user may not read; a missing file is left to the
    runtime, whose ModelNotFound says where models are looked for."""
    if os.path.isfile(path) and not os.access(path, os.R_OK):
        raise InvalidRequest(f"Cannot read {path}: permission denied.")


def model_file(ref: str) -> str:
    """A file named as --model names one ('default', a name in the model folders, a path); a
    reference that names none stays as given, for the reader's own message."""
    from .runtime.errors import ModelNotFound
    from .runtime.models.locate import resolve_model

    try:
        return str(resolve_model(ref))
    except ModelNotFound:
        return ref


def read_images(paths: Sequence[str] | None) -> tuple:
    """--image FILE arguments as image parts (read now: a missing file is a usage error)."""
    from .runtime.requests import ImagePart

    parts = []
    for path in paths or ():
        try:
            parts.append(ImagePart(data=Path(path).expanduser().read_bytes()))
        except OSError as e:
            raise InvalidRequest(f"Cannot read the image {path}: {e.strerror or e}.") from None
    return tuple(parts)


def command(sub, name: str, summary: str, description: str, **kwargs) -> argparse.ArgumentParser:
    """A subcommand's parser, laid out as every command's help is."""
    return sub.add_parser(name, help=summary, description=description, formatter_class=HelpFormatter, **kwargs)
