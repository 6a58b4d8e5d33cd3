"""inspect_gguf reads a file's description from the bounded header scan (fast tier): the same
GGUFInfo as gguf's full reader gives, for the embedded model, a tiny model with the metadata a
pruned or MoE file carries, and the cases where it falls back to that reader."""
from __future__ import annotations

from pathlib import Path

import pytest

from comfyui_a3b.runtime.models import gguf_info
from comfyui_a3b.runtime.models.gguf_info import inspect_gguf

from tinygguf import rewritten_copy, write_tiny_gguf


_READER = gguf_info._inspect


def _full_reader(p: Path):
    return _READER(p, p.stat().st_size)


def _with_arrays(path: Path, a3b_strings: int, per_layer: int = 2) -> Path:
    """A tiny model with what pruning and MoE files add: a3b.* strings, numbers and string arrays,
    and per-layer number arrays."""
    import gguf

    def add(w):
        w.add_string("a3b.method", "a3b")
        w.add_float32("a3b.keep", 0.625)
        w.add_bool("a3b.bias_compensation", True)
        w.add_array("a3b.calib.prose_topics", [f"topic {i}" for i in range(a3b_strings)])
        w.add_key_value("a3b.widths", [96] * per_layer, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.UINT32)
        w.add_key_value("llama.expert_used_count", [2] * per_layer, gguf.GGUFValueType.ARRAY,
                        sub_type=gguf.GGUFValueType.UINT32)

    return rewritten_copy(write_tiny_gguf(path.with_suffix(".src.gguf")), path, add=add)


def test_the_embedded_model_is_described_as_the_full_reader_describes_it():
    from comfyui_a3b.runtime.models.locate import default_model_path

    p = default_model_path()
    fast = inspect_gguf(p)
    assert fast == _full_reader(Path(p)) and fast.vocab_size == 49152


@pytest.mark.parametrize("n", [3, 69, 5000], ids=["few", "more-than-64", "past-the-scan"])
def test_a3b_records_and_per_layer_arrays_match_the_full_reader(tmp_path, n, monkeypatch):
    p = _with_arrays(tmp_path / "m.gguf", n)
    used = []
    monkeypatch.setattr(gguf_info, "_inspect", lambda *a: used.append(1) or _READER(*a))
    fast = inspect_gguf(p)
    assert fast.a3b["a3b.calib.prose_topics"] == [f"topic {i}" for i in range(n)]
    assert fast.a3b["a3b.keep"] == pytest.approx(0.625) and fast.a3b["a3b.bias_compensation"] is True
    assert fast.expert_used_count == [2, 2]
    # an a3b array longer than the scan keeps (4096) is read by the full reader
    assert used == ([1] if n > 4096 else [])
    monkeypatch.undo()
    assert fast == _full_reader(p)
