"""bench/nextline.py's pure parts: the cases come from the files given, the document the server
sees has the line emptied to its indentation, and the interval and sign test are right."""
from __future__ import annotations

import math

from comfyui_a3b.bench import nextline
from comfyui_a3b.tune.collect import SourceFile

TEXT = "import os\n\n\ndef f(x):\n    if x:\n        return os.path.join(x)\n    return None\n"


def test_document_empties_the_line_to_its_indentation():
    text, off, line = nextline.document(TEXT, 5)
    assert line == "        return os.path.join(x)"
    assert text[:off] == "import os\n\n\ndef f(x):\n    if x:\n        "
    assert text[off:] == "\n    return None\n"      # the code below stays, the line itself is gone


def test_cases_are_seeded_lines_of_the_given_files_in_order():
    files = [SourceFile("a.py", "python", TEXT * 20), SourceFile("b.py", "python", TEXT * 20)]
    got = nextline.cases(files, 30, seed=0)
    assert len(got) == 30 and got == sorted(got) and got == nextline.cases(files, 30, seed=0)
    assert got != nextline.cases(files, 30, seed=1)
    for fi, i in got:
        lines = files[fi].text.splitlines()
        assert len(lines[i].strip()) >= 8 and len("\n".join(lines[:i])) >= 199


def test_interval_and_sign_test():
    lo, hi = nextline.wilson(3, 48)
    assert 0.02 < lo < 3 / 48 < hi < 0.18
    assert nextline.sign_test(0, 0) == 1.0
    assert math.isclose(nextline.sign_test(0, 5), 2 / 32)
    assert math.isclose(nextline.sign_test(2, 8), 2 * (1 + 10 + 45) / 1024)
    c = nextline.compare([True, False, True, False], [True, True, False, True])
    assert (c["base_hits"], c["tuned_hits"], c["only_base"], c["only_tuned"]) == (2, 3, 1, 2)


def test_completions_are_sampled_without_a_repeat_penalty_and_the_measure_samples_alike():
    """Code repeats its own names from line to line; a repeat penalty pushes the model off them."""
    import inspect

    from comfyui_a3b.lsp_server import completion
    from comfyui_a3b.runtime import preset

    code = preset("code")
    assert completion.SAMPLING.repeat_penalty == 1.0 and code.repeat_penalty > 1.0
    assert (completion.SAMPLING.temperature, completion.SAMPLING.top_k) == (code.temperature, code.top_k)
    assert completion.SAMPLING.seed is not None                    # the same suggestion for the same prompt
    assert "sampling=SAMPLING" in inspect.getsource(completion.Completer._start)
    assert "sampling=SAMPLING" in inspect.getsource(nextline.run)
