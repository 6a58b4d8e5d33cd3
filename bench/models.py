"""The models benchmarks write for themselves: random-weight Q4_0 GGUFs at real shapes (qwen3,
qwen3moe, Qwen2-VL's text model), for memory and speed, not text; their prompts (token ids: the
random model's text would tokenize to bytes); and the tiny models of the test suite
(tests/tinygguf.py, in a source checkout). Projectors for vision are in mmproj.py.
"""
from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import numpy as np

SHAPES = {
    # Qwen3-8B: https://huggingface.co/Qwen/Qwen3-8B/blob/main/config.json
    "qwen3-8b": dict(n_layer=36, n_embd=4096, n_ff=12288, n_head=32, n_head_kv=8, head_dim=128, n_vocab=151936),
    "tiny": dict(n_layer=2, n_embd=256, n_ff=512, n_head=4, n_head_kv=2, head_dim=64, n_vocab=2048),
    # Qwen3-30B-A3B: https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json (every layer a
    # mixture of experts: 128 experts of width 768 (moe_intermediate_size), 8 routed per token)
    "qwen3-30b-a3b": dict(n_layer=48, n_embd=2048, n_ff=768, n_head=32, n_head_kv=4, head_dim=128, n_vocab=151936,
                          n_expert=128, n_expert_used=8),
    "tiny-moe": dict(n_layer=2, n_embd=256, n_ff=128, n_head=4, n_head_kv=2, head_dim=64, n_vocab=2048,
                     n_expert=16, n_expert_used=4),
}
#: prompts are token ids (the random model's text would tokenize to bytes)
PROMPT_IDS = [(i * 7919) % 1500 + 300 for i in range(4000)]


def prompt(n_tokens: int, offset: int = 0) -> list[int]:
    """A prompt for a random model: BOS, then `n_tokens` ids from `offset` on."""
    return [1] + PROMPT_IDS[offset:offset + n_tokens]


def q4_0_blocks(rng: np.random.Generator, n: int, scale: float) -> np.ndarray:
    """`n` weights as Q4_0 blocks (an f16 scale, then 16 bytes of nibbles per 32 weights)."""
    blocks = np.empty((n // 32, 18), dtype=np.uint8)
    blocks[:, :2] = np.frombuffer(np.float16(scale).tobytes(), dtype=np.uint8)
    blocks[:, 2:] = rng.integers(0, 256, size=(n // 32, 16), dtype=np.uint8)
    return blocks.reshape(-1)


def write_model(path: Path, shape: dict, seed: int = 0, arch: str = "qwen3") -> Path:
    """A random Q4_0 model of `shape`: qwen3, or qwen3moe where the shape has experts (`n_expert`;
    `n_ff` is then each expert's width), or qwen2vl (Qwen2-VL's text model: qwen2's layers with
    biases, M-RoPE). Tensors are held until written (about the file's size in RAM)."""
    import gguf

    arch = "qwen3moe" if "n_expert" in shape else arch
    w = gguf.GGUFWriter(str(path), arch)
    _hyperparameters(w, arch, shape)
    _vocabulary(w, shape["n_vocab"])
    _Tensors(w, arch, shape, np.random.default_rng(seed)).add_all()
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def random_model(given: str | None, path: Path, shape: str) -> tuple[Path, float | None]:
    """The model a benchmark runs: the file `given`, else the random model of `shape` at `path`,
    written now unless it is there (and the seconds the writing took, None if nothing was written)."""
    if given:
        return Path(given), None
    if path.exists():
        return path, None
    print(f"writing {path}", flush=True)
    t0 = time.perf_counter()
    write_model(path, SHAPES[shape])
    return path, time.perf_counter() - t0


def _hyperparameters(w, arch: str, s: dict) -> None:
    import gguf

    w.add_name(f"random-{arch}")
    w.add_context_length(8192)
    w.add_embedding_length(s["n_embd"])
    w.add_block_count(s["n_layer"])
    w.add_feed_forward_length(s["n_ff"])
    if "n_expert" in s:
        w.add_expert_count(s["n_expert"])
        w.add_expert_used_count(s["n_expert_used"])
        w.add_expert_feed_forward_length(s["n_ff"])
    w.add_head_count(s["n_head"])
    w.add_head_count_kv(s["n_head_kv"])
    w.add_key_length(s["head_dim"])
    w.add_value_length(s["head_dim"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    if arch == "qwen2vl":   # M-RoPE: temporal, height and width sections of the rotary half (Qwen2-VL's 16/24/24 of 64)
        half = s["head_dim"] // 2
        w.add_array(f"{arch}.rope.dimension_sections", [half // 4, half * 3 // 8, half * 3 // 8, 0])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)


def _vocabulary(w, n_vocab: int) -> None:
    """A SentencePiece-style vocabulary: <unk>, <s>, </s>, the 256 bytes, then made-up words."""
    import gguf

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tokens += [f"\u2581w{i}" for i in range(n_vocab - len(tokens))]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    types += [gguf.TokenType.NORMAL] * (n_vocab - len(types))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types([int(t) for t in types])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


class _Tensors:
    """The random tensors of one model, added to the writer `w` in llama.cpp's order."""

    def __init__(self, w, arch: str, shape: dict, rng: np.random.Generator):
        self.w, self.arch, self.s, self.rng = w, arch, shape, rng

    def quant(self, name: str, rows: int, cols: int, scale: float = 0.002, zero_rows: int = 0, n: int = 0) -> None:
        # raw quantised bytes, one row of blocks per matrix row (n > 0: n such matrices, one per
        # expert); gguf derives the shape from them
        import gguf

        blocks = q4_0_blocks(self.rng, max(n, 1) * rows * cols, scale).reshape(*((n,) if n else ()), rows, -1)
        blocks[..., :zero_rows, :] = 0   # scale 0: these rows compute 0
        self.w.add_tensor(name, blocks, raw_dtype=gguf.GGMLQuantizationType.Q4_0)

    def ones(self, name: str, n: int) -> None:
        self.w.add_tensor(name, np.ones(n, dtype=np.float32))

    def add_all(self) -> None:
        s, e = self.s, self.s["n_embd"]
        self.quant("token_embd.weight", s["n_vocab"], e, 0.01)
        self.ones("output_norm.weight", e)
        # the control tokens' logits are 0, below the largest of the others, so greedy decoding never
        # ends early at </s> and every request generates the tokens it asks for
        self.quant("output.weight", s["n_vocab"], e, zero_rows=3)
        for i in range(s["n_layer"]):
            self.attention(f"blk.{i}.")
            self.ffn(f"blk.{i}.")

    def attention(self, p: str) -> None:
        s, e, hd = self.s, self.s["n_embd"], self.s["head_dim"]
        self.ones(p + "attn_norm.weight", e)
        self.quant(p + "attn_q.weight", s["n_head"] * hd, e)
        self.quant(p + "attn_k.weight", s["n_head_kv"] * hd, e)
        self.quant(p + "attn_v.weight", s["n_head_kv"] * hd, e)
        self.quant(p + "attn_output.weight", e, s["n_head"] * hd)
        if self.arch == "qwen2vl":
            for name, heads in (("attn_q", s["n_head"]), ("attn_k", s["n_head_kv"]), ("attn_v", s["n_head_kv"])):
                self.w.add_tensor(p + name + ".bias", np.zeros(heads * hd, dtype=np.float32))
        else:
            self.ones(p + "attn_q_norm.weight", hd)
            self.ones(p + "attn_k_norm.weight", hd)

    def ffn(self, p: str) -> None:
        s, e, f = self.s, self.s["n_embd"], self.s["n_ff"]
        self.ones(p + "ffn_norm.weight", e)
        if "n_expert" not in s:
            self.quant(p + "ffn_gate.weight", f, e)
            self.quant(p + "ffn_up.weight", f, e)
            self.quant(p + "ffn_down.weight", e, f)
            return
        # the router: random rows with a spread of norms, so that some experts win more often
        # than others (as trained routers do)
        n_exp = s["n_expert"]
        router = self.rng.standard_normal((n_exp, e)).astype(np.float32) * 0.02
        router *= np.linspace(0.5, 1.5, n_exp, dtype=np.float32)[self.rng.permutation(n_exp), None]
        self.w.add_tensor(p + "ffn_gate_inp.weight", router)
        self.quant(p + "ffn_gate_exps.weight", f, e, n=n_exp)
        self.quant(p + "ffn_up_exps.weight", f, e, n=n_exp)
        self.quant(p + "ffn_down_exps.weight", e, f, n=n_exp)


def tinygguf(benchmark: str):
    """The test suite's tiny-model writer (tests/tinygguf.py), for `benchmark`: only in a source checkout."""
    path = Path(__file__).resolve().parents[1] / "tests" / "tinygguf.py"
    if not path.is_file():
        raise SystemExit(f"{benchmark} writes its models with tests/tinygguf.py: run it from a source checkout")
    spec = importlib.util.spec_from_file_location("tinygguf", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
