"""Pruning's memory follows the model's size: no buffer of a fixed size, none the size of the
vocabulary times the batch, no second dequantised copy of the model.

Each measure runs in a child process (its peak resident size above what it held before the measured
call: the kernel's high-water mark, VmHWM, reset just before the call; `ru_maxrss` would not do, as a
child starts with the peak of the process it was forked from) on models the tests make: tiny files
whose FFN is wide (so the Gram matrices of one-shot pruning dominate), and a reference model with a
large vocabulary (so distillation's logits would). bench/bench_prune_memory.py measures the real
embedded model.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the prune extra (torch) is not installed")

from tinygguf import write_tiny_gguf  # noqa: E402

from comfyui_a3b.prune import ggufindex  # noqa: E402
from comfyui_a3b.prune.dense import distill  # noqa: E402
from comfyui_a3b.prune.reference import RefModel, StreamedLayers  # noqa: E402
from comfyui_a3b.prune.source import SourceModel  # noqa: E402

pytestmark = [pytest.mark.slow,  # torch and llama.cpp in child processes
              pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(),
                                 reason="peaks are read from Linux's /proc")]

TESTS = Path(__file__).resolve().parent


def _child(code: str, timeout: int = 600, args: tuple[str, ...] = ()) -> dict:
    """Run `code` in a fresh interpreter (with `args` as sys.argv[1:]); it prints one JSON line (the
    last of its output)."""
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                       timeout=timeout, cwd=TESTS)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


PEAK = """
    import json
    def status(key):
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith(key + ":"))
    def above(run):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the high-water mark starts again from what the process holds now
        before = status("VmRSS")
        run()
        return status("VmHWM") - before
"""


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """8 layers of FFN width 1024: 8 Gram matrices of 8.4 MB, for a file of about 7 MB."""
    return write_tiny_gguf(tmp_path_factory.mktemp("wide") / "wide.gguf", "llama", n_embd=64, n_layer=8,
                           n_ff=1024, n_ctx=256, seed=5)


def _one_shot_peak(path: Path, out: Path, cache: Path, budget_mb) -> dict:
    return _child(PEAK + f"""
    import torch  # what obs imports, before the baseline
    from comfyui_a3b.prune import PruneConfig
    from comfyui_a3b.prune.dense.llama_path import prune_streamed
    cfg = PruneConfig(keep=0.75, method="obs", calib_windows=12, seq_len=256, recover_steps=0,
                      gram_budget_mb={budget_mb!r})
    res = {{}}
    peak = above(lambda: res.update(m=prune_streamed({str(path)!r}, {str(out)!r}, cfg, progress=False,
                                                     cache_dir={str(cache)!r}).metadata))
    print(json.dumps({{"peak": peak, "passes": res["m"]["calib.passes"], "n_ff": res["m"]["n_ff"]}}))
    """)


def test_one_shot_gram_matrices_are_not_all_held_at_once(wide, tmp_path):
    """By default as many Gram matrices are held as half the file holds (here one); the other layers'
    inputs go through files in one pass, and the pruned file is the same as with every matrix held."""
    gram = 1024 * 1024 * 8
    held = _one_shot_peak(wide, tmp_path / "held.gguf", tmp_path / "c1", 4096)
    spilled = _one_shot_peak(wide, tmp_path / "spilled.gguf", tmp_path / "c2", None)
    assert held["passes"] == spilled["passes"] == 1 and held["n_ff"] == spilled["n_ff"] == 768
    assert held["peak"] > 8 * gram, (held, spilled)  # every layer's matrix at once
    # the other 7 matrices are not held (llama.cpp's context and the fit's own matrices are in both)
    assert held["peak"] - spilled["peak"] > 5 * gram, (held, spilled)
    assert (tmp_path / "held.gguf").read_bytes() == (tmp_path / "spilled.gguf").read_bytes()
    assert not list((tmp_path / "c2").glob(".spill-*"))  # its files are gone


def _reference_model(n_vocab: int, seed: int) -> RefModel:
    from comfyui_a3b.prune.source import HParams

    hp = HParams(arch="llama", n_layer=2, n_embd=64, n_ff=128, n_head=4, n_head_kv=2, head_dim=16, n_vocab=n_vocab,
                 eps=1e-5, rope_base=10000.0, rope_type="norm", rope_scale=1.0, n_ctx_train=256, file_type=None,
                 tied_output=True)
    rng = np.random.default_rng(seed)
    w = {"token_embd.weight": rng.normal(0, 0.02, (n_vocab, 64)), "output_norm.weight": np.ones(64)}
    for i in range(2):
        p = f"blk.{i}."
        shapes = {"attn_q": (64, 64), "attn_k": (32, 64), "attn_v": (32, 64), "attn_output": (64, 64),
                  "ffn_gate": (128, 64), "ffn_up": (128, 64), "ffn_down": (64, 128)}
        w.update({f"{p}{t}.weight": rng.normal(0, 0.1, shape) for t, shape in shapes.items()})
        w.update({p + "attn_norm.weight": np.ones(64), p + "ffn_norm.weight": np.ones(64)})
    return RefModel(hp, {k: v.astype(np.float32) for k, v in w.items()})


def test_distillation_never_holds_the_logits_of_a_whole_batch():
    """8 x 128 tokens of a 32k vocabulary: one float32 logits tensor is 134 MB, and a step over whole
    tensors holds several (both models' logits, their log-softmax, the KL, the gradients)."""
    logits = 8 * 128 * 32768 * 4
    got = _child(PEAK + """
    import numpy as np
    from test_prune_memory import _reference_model
    from comfyui_a3b.prune.dense import distill
    teacher, student = _reference_model(32768, 0), _reference_model(32768, 1)
    wins = [np.random.default_rng(0).integers(3, 32768, (16, 128)).astype(np.int32)]
    distill.distill(student, teacher, wins, 1, batch=8, progress=False)  # warm-up: optimiser, threads
    peak = above(lambda: distill.distill(student, teacher, wins, 2, batch=8, progress=False))
    print(json.dumps({"peak": peak}))
    """)
    assert got["peak"] < 2 * logits, got


def test_the_kl_step_gives_the_whole_logits_loss_and_gradient(monkeypatch):
    F = torch.nn.functional
    monkeypatch.setattr(distill, "LOGITS_CHUNK_BYTES", 4 * 600 * 7)  # slices of 7 of the 120 tokens
    teacher, student = _reference_model(600, 0), _reference_model(600, 1)
    params = [p for p in student.parameters() if p.dim() == 2 and p.shape[0] != 600]
    for p in params:
        p.requires_grad_(True)
    x = torch.from_numpy(np.random.default_rng(2).integers(3, 600, (3, 40)))
    whole = F.kl_div(F.log_softmax(student(x), -1).flatten(0, 1), F.log_softmax(teacher(x), -1).flatten(0, 1),
                     log_target=True, reduction="batchmean")
    whole.backward()
    want = [p.grad.clone() for p in params]
    for checkpoint in (False, True):
        for p in params:
            p.grad = None
        student.checkpoint = checkpoint
        got = distill.kl_step(student, teacher, x)
        assert abs(float(got) - float(whole.detach())) < 1e-6
        assert all(torch.allclose(p.grad, g, atol=1e-7) for p, g in zip(params, want))


def test_the_streamed_teacher_computes_what_the_whole_model_does(tmp_path):
    src = SourceModel(write_tiny_gguf(tmp_path / "t.gguf", "qwen3", n_layer=3, seed=4))
    whole = RefModel.from_source(src)
    streamed = RefModel(src.hp, {n: src.weight(n) for n in src.tensors if not n.startswith("blk.")},
                        layers=StreamedLayers(src))
    x = torch.from_numpy(np.random.default_rng(0).integers(3, 271, (2, 30)))
    with torch.no_grad():
        assert torch.equal(whole(x), streamed(x))
    assert not any(n.startswith("layers") for n, _ in streamed.named_parameters())  # no block weights kept


def test_recovery_says_how_long_it_takes_and_how_to_shorten_it(caplog):
    teacher, student = _reference_model(300, 0), _reference_model(300, 1)
    wins = [np.random.default_rng(0).integers(3, 300, (8, 16)).astype(np.int32)]
    with caplog.at_level("INFO", logger="comfyui_a3b.prune"):
        distill.distill(student, teacher, wins, distill.TIMED_STEPS + 3, batch=2, progress=False)
    (line,) = [r.getMessage() for r in caplog.records if "per step measured" in r.getMessage()]
    assert "for the 3 steps left (until " in line and "--recover-steps N; 0 = no recovery" in line


def test_obs_holds_one_matrix_the_size_of_the_fit_beside_the_statistics_it_takes():
    """The Gram matrix is given away, the inverse comes through the Cholesky factor and the OBS update
    is made in place: beside what the caller held, about one n x n float64 matrix at a time (a
    general inverse of a copy held four, an update through a temporary one more)."""
    n = 2048
    gram = n * n * 8
    got = _child(PEAK + f"""
    import numpy as np, torch
    from comfyui_a3b.prune.calibration.stats import LayerStats
    from comfyui_a3b.prune.dense import methods
    rng = np.random.default_rng(0)
    h = rng.normal(size=(3 * {n}, {n}))
    down = rng.normal(size=(32, {n})).astype(np.float32)
    def stats():
        return LayerStats(count=len(h), sum=h.sum(0), sumsq=(h * h).sum(0), sumabs=np.abs(h).sum(0), gram=h.T @ h)
    kept = methods.plan_layer("obs", None, None, down, None, stats(), {n} - 64, rng, False, chunk=32)
    st = stats()
    res = {{}}
    peak = above(lambda: res.update(p=methods.plan_layer("obs", None, None, down, None, st, {n} - 64, rng, False,
                                                         chunk=32, consume=True)))
    print(json.dumps({{"peak": peak, "taken": st.gram is None,
                      "same": bool(np.array_equal(res["p"].keep, kept.keep)),
                      "close": bool(np.allclose(res["p"].down, kept.down, rtol=1e-4, atol=1e-4))}}))
    """)
    assert got["taken"] and got["same"] and got["close"], got
    assert got["peak"] < 1.6 * gram, (got, gram)


#: `mapped(path)`: the bytes of `path` resident in this process's maps of it
MAPPED = """
    import json
    def mapped(path):
        rss, mine = 0, False
        with open("/proc/self/smaps") as f:
            for ln in f:
                if ln[:1] in "0123456789abcdef" and "-" in ln.split()[0]:
                    mine = ln.rstrip().endswith(path)
                elif mine and ln.startswith("Rss:"):
                    rss += int(ln.split()[1]) * 1024
        return rss
"""


def test_the_writer_lets_go_of_the_source_files_pages(tmp_path):
    """Tensors copied as they are stored are read through the source's memory map; once written, their
    pages leave the process (else the whole source file would count in the peak of every run)."""
    path = write_tiny_gguf(tmp_path / "w.gguf", "llama", n_embd=64, n_layer=8, n_ff=4096, n_ctx=256, seed=3)
    got = _child(MAPPED + f"""
    from comfyui_a3b.prune.source import SourceModel
    from comfyui_a3b.prune.writing import gguf
    src = SourceModel({str(path)!r}, torch_reference=False)
    gguf.write_file(src, {str(tmp_path / "out.gguf")!r}, [gguf.copy_tensor(src, n) for n in src.tensors],
                    n_ff=None, a3b={{}})
    print(json.dumps({{"resident": mapped({str(path)!r})}}))
    """)
    size = path.stat().st_size
    assert size > 8 << 20
    assert got["resident"] < size // 10, (got, size)
    assert (tmp_path / "out.gguf").stat().st_size > size * 0.9


def test_the_streamed_teacher_lets_go_of_the_source_files_pages(tmp_path):
    """Recovery's teacher on the CPU reads every block from the file in each forward; the pages it read
    leave the process once dequantised (they kept the whole file resident beside the student)."""
    path = write_tiny_gguf(tmp_path / "s.gguf", "llama", n_embd=64, n_layer=8, n_ff=4096, n_ctx=256, seed=3)
    got = _child(MAPPED + f"""
    import numpy as np, torch
    from comfyui_a3b.prune.reference import RefModel, StreamedLayers
    from comfyui_a3b.prune.source import SourceModel
    src = SourceModel({str(path)!r})
    teacher = RefModel(src.hp, {{n: src.weight(n) for n in src.tensors if not n.startswith("blk.")}},
                       layers=StreamedLayers(src))
    with torch.no_grad():
        teacher(torch.arange(3, 40)[None])
    after_forward = mapped({str(path)!r})
    for n in src.tensors:
        src.weight(n)
    touched = mapped({str(path)!r})
    src.release_all()
    print(json.dumps({{"after_forward": after_forward, "touched": touched, "released": mapped({str(path)!r})}}))
    """)
    size = path.stat().st_size
    assert got["touched"] > size // 2, (got, size)   # reading does make the pages resident
    assert got["after_forward"] < size // 10 and got["released"] < size // 10, (got, size)


def _same_index(path: Path) -> None:
    from gguf import GGUFReader

    reader = GGUFReader(str(path), "r")
    _, fields, tensors = ggufindex.read_index(path)
    assert list(fields) == list(reader.fields)
    for name, f in reader.fields.items():
        got, want = fields[name].contents(), f.contents()
        assert fields[name].types == list(f.types) and got == want and type(got) is type(want), name
        if isinstance(want, list) and want:
            assert type(got[0]) is type(want[0]), name
    assert list(tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        u = tensors[t.name]
        assert (u.tensor_type, u.shape, u.n_elements, u.n_bytes, u.data_offset) == (
            t.tensor_type, tuple(int(x) for x in t.shape), t.n_elements, t.n_bytes, t.data_offset), t.name
        assert u.data.dtype == t.data.dtype and u.data.shape == t.data.shape and np.array_equal(u.data, t.data)


@pytest.mark.parametrize("lazy", [False, True])
def test_the_source_index_gives_what_gguf_reader_does(tmp_path, monkeypatch, lazy):
    if lazy:  # every array undecoded until asked for, as the vocabulary of a real model is
        monkeypatch.setattr(ggufindex, "LAZY_ITEMS", 0)
    for dtype in (np.float32, np.float16):
        _same_index(write_tiny_gguf(tmp_path / f"{dtype.__name__}.gguf", "qwen3", n_layer=2, seed=1, dtype=dtype,
                                    extra_kv={"general.name": "tiny", "qwen3.rope.freq_base": 5e5}))


def _embedded() -> Path:
    from comfyui_a3b.runtime import default_model_path

    return default_model_path()


def test_the_embedded_models_index_is_the_readers_and_holds_no_object_per_token():
    """Its 49k-token vocabulary and merges: GGUFReader's views (one per string) left 80 MB held
    through the whole run; the index holds the values undecoded. (The transient peak is inspect_gguf's,
    which vets the file first, and is below the run's peak.) Counted in anonymous memory: the pages of
    the mapped file the header walk touched are the page cache's, shared and given back under pressure."""
    model = _embedded()
    _same_index(model)
    got = _child(PEAK + f"""
    from comfyui_a3b.prune.source import SourceModel
    before = status("RssAnon")
    src = SourceModel({str(model)!r}, torch_reference=False)
    print(json.dumps({{"held": status("RssAnon") - before, "tokens": len(src.meta("tokenizer.ggml.tokens"))}}))
    """)
    assert got["tokens"] == 49152 and got["held"] < 20 << 20, got


def test_one_shot_prune_of_the_embedded_model_peaks_under_one_and_a_half_times_its_file(tmp_path):
    """`a3b prune --recover-steps 0` as the benchmark runs it (bench_prune_memory): the peak above a
    process that only imports what pruning imports is at most 1.5 times the file (it was 1.83)."""
    from comfyui_a3b.bench.bench_prune_memory import BASELINE, PEAK as RUN, rss_of

    model = _embedded()
    base, _, _ = rss_of(BASELINE)
    peak, _, _ = rss_of(RUN, "prune", str(model), "--out", str(tmp_path / "o.gguf"), "--quiet", "--device", "cpu",
                        "--cache-dir", str(tmp_path / "cache"), "--recover-steps", "0", "--calib-windows", "12")
    size = model.stat().st_size
    assert peak - base <= 1.5 * size, (peak, base, size, (peak - base) / size)


def test_pruning_imports_torch_with_mkls_memory_manager_off_unless_the_user_set_it():
    """MKL's fast memory manager kept its product buffers through recovery (10-29 MiB of its peak):
    pruning's torch import turns it off, before MKL reads the setting, and leaves a user's own value."""
    code = """
    import json, os, sys
    os.environ.pop("MKL_DISABLE_FAST_MM", None)
    if len(sys.argv) > 1:
        os.environ["MKL_DISABLE_FAST_MM"] = sys.argv[1]
    from comfyui_a3b.prune.errors import require_torch
    assert "torch" not in sys.modules
    require_torch()
    print(json.dumps({"value": os.environ.get("MKL_DISABLE_FAST_MM")}))
    """
    assert _child(code)["value"] == "1"
    assert _child(code, args=("0",))["value"] == "0"
