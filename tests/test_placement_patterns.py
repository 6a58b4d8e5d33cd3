"""Tensor placement patterns: matched in linear time (RE2) against the file's tensor names, handed to
llama.cpp as the exact names they matched; a subprocess loads a tiny qwen3moe with patterns that
make a backtracking matcher take exponential time, within a bound, placed as the plain pattern."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

from comfyui_a3b.runtime import InvalidRequest, LoadSpec
from comfyui_a3b.runtime.llama import placement, tensorpatterns

from tinygguf import write_tiny_gguf

#: patterns a backtracking engine takes exponential time on (nested quantifiers over the name)
PATHOLOGICAL = [r"(.*)*x", r"^([\w.]+)+!", r"(a|a?)+$", r"^(\w+\.?)*\d{3}$"]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("p") / "moe.gguf", "qwen3moe", n_layer=4, n_expert=8, seed=1)


def names(path) -> list[str]:
    return [t.name for t in placement.layout(path).tensors]


def placed(entries, tensor_names):
    """Where each tensor goes by llama.cpp's rule (the first pattern that matches, searched), as
    Python's engine reads the escaped, anchored patterns handed to llama.cpp."""
    out = {}
    for n in tensor_names:
        for pattern, device in entries:
            if re.search(pattern, n):
                out[n] = device
                break
    return out


def test_patterns_become_the_exact_names_they_match_with_the_first_match_deciding(moe):
    tensor_names = names(moe)
    user = [(r"blk\.0\.", "CUDA0"), (r"exps", "CPU"), (r"nothing-at-all", "CPU")]
    got = tensorpatterns.for_llama(user, tensor_names, 100)
    want = {}
    for n in tensor_names:
        if "blk.0." in n:
            want[n] = "CUDA0"
        elif "exps" in n:
            want[n] = "CPU"
    assert placed(got, tensor_names) == want and want
    for pattern, _ in got:   # anchored, no quantifier, no group but the alternation itself
        assert pattern.startswith("^(?:") and pattern.endswith(")$")
        assert not re.search(r"(?<!\\)[*+?{(]", pattern[4:-2])


def test_many_matched_names_are_split_into_short_patterns(moe):
    tensor_names = [f"blk.{i}.ffn_up_exps.weight" for i in range(100)]
    got = tensorpatterns.for_llama([(".*", "CPU")], tensor_names, 100)
    assert len(got) == -(-100 // tensorpatterns.NAMES_PER_PATTERN)
    assert placed(got, tensor_names) == {n: "CPU" for n in tensor_names}
    with pytest.raises(InvalidRequest, match="places 100 tensors, which takes 4 of llama.cpp's at most 3"):
        tensorpatterns.for_llama([(".*", "CPU")], tensor_names, 3)


def test_escaped_names_match_only_themselves():
    odd = ["a.b", "a+b", "a(b)", "a[b]", "a$b^c", "a|b", "a\\b", "a{1}b", "a-b/c", "aXb"]
    pattern = tensorpatterns.exact(odd[:-1])
    assert all(re.search(pattern, n) for n in odd[:-1]) and not re.search(pattern, "aXb")
    assert not re.search(pattern, "zz" + odd[0])


def test_backtracking_patterns_are_matched_in_linear_time():
    name = "blk.12.ffn_gate_exps.weight" + "a" * 36   # 63 characters: llama.cpp's longest tensor name
    t0 = time.perf_counter()
    for p in PATHOLOGICAL:
        tensorpatterns.matches(p, name)
        tensorpatterns.matches(p, "a" * 60 + "!")
    assert time.perf_counter() - t0 < 5   # a backtracking engine takes minutes on the first one


@pytest.mark.parametrize("pattern, name, hit", [
    (r"\Ablk\.0\.", "blk.0.attn_q.weight", True),
    (r"\Ablk\.0\.", "xblk.0.attn_q.weight", False),
    (r"exps\.weight\Z", "blk.0.ffn_up_exps.weight", True),
    (r"exps\Z", "blk.0.ffn_up_exps.weight", False),
    (r"\\Z", "a\\Z", True),        # an escaped backslash, then the letter
    (r"^blk\.\d+\.ffn_(up|down)_exps", "blk.3.ffn_down_exps.weight", True),
])
def test_start_and_end_of_text_anchors_mean_what_they_mean_in_python(pattern, name, hit):
    assert tensorpatterns.matches(pattern, name) is hit
    assert (re.search(pattern, name) is not None) is hit   # as Python reads them


@pytest.mark.parametrize("text, what", [
    (r"(?=blk)blk=CPU", "(?="),
    (r"(?<!x)exps=CPU", "(?<!"),
    (r"(exps)\1=CPU", r"\1"),
    (r"x{2000}=CPU", "{2000}"),
])
def test_what_a_linear_time_engine_cannot_express_is_refused_in_one_line(moe, text, what):
    with pytest.raises(InvalidRequest, match="not a valid regular expression for a linear-time match") as e:
        placement.choose(moe, LoadSpec(str(moe), override_tensor=text), gpus=[])
    assert what in str(e.value) and "\n" not in str(e.value)


def test_the_planner_reads_the_patterns_as_llama_cpp_is_handed_them(moe):
    p, entries = placement.choose(moe, LoadSpec(str(moe), override_tensor=r"(.*)*exps=CPU"), gpus=[])
    assert entries == [(r"(.*)*exps", "CPU")] and not p.warnings   # the user's pattern, as shown
    llama = placement.to_llama(moe, entries)
    assert set(placed(llama, names(moe))) == {n for n in names(moe) if "exps" in n}


LOAD = textwrap.dedent("""
    import json, sys, time
    from comfyui_a3b.runtime import Runtime
    rt = Runtime()
    t0 = time.perf_counter()
    m = rt.load(rt.spec(sys.argv[1], n_ctx=128, n_parallel=1, override_tensor=sys.argv[2]))
    print(json.dumps({"seconds": time.perf_counter() - t0,
                      "placed": m.info.placement["measured"]["overridden_tensors"]}))
    rt.unload()
""")


def _load(path, override, tmp_path) -> dict:
    env = {**os.environ, "A3B_CACHE": str(tmp_path / "cache"), "GGML_NO_BACKTRACE": "1"}
    p = subprocess.run([sys.executable, "-c", LOAD, str(path), override], capture_output=True, text=True,
                       timeout=240, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("pathological, plain", [
    (r"(.*)*x=CPU", r"x=CPU"),
    (r"^([\w.]+)+!=CPU", r"!=CPU"),
    (r"\Ablk\.0\..*exps\.weight\Z=CPU", r"^blk\.0\..*exps\.weight$=CPU"),
])
def test_backtracking_patterns_load_in_bounded_time_placed_as_the_plain_pattern(moe, tmp_path, pathological, plain):
    got, want = _load(moe, pathological, tmp_path), _load(moe, plain, tmp_path)
    assert got["placed"] == want["placed"]
    assert got["seconds"] < 60   # llama.cpp's own matcher took more than 150 s on these
    if "blk" in plain:
        assert want["placed"] == {"CPU": 3}   # \A and \Z placed something (the three expert tensors of layer 0)
