"""Tiny GGUF files written with the `gguf` package: random weights, llama / qwen2 / qwen2vl / qwen3 /
qwen35 / gemma3 / qwen3moe / qwen35moe shapes (qwen2vl: qwen2's layers with M-RoPE, for projectors).

They load in llama.cpp in milliseconds and cover architectures and broken files the embedded model
cannot: an unknown architecture, a truncated copy, a file that is not GGUF at all.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

#: Architectures written with a mixture-of-experts FFN (router, routed experts; qwen35moe adds a
#: shared expert).
MOE_ARCHS = ("qwen3moe", "qwen35moe")


def _vocab() -> tuple[list[str], list[float], list[int]]:
    import gguf

    tokens = ["<unk>", "<s>", "</s>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    tokens += [f"<0x{i:02X}>" for i in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    words = ["\u2581", "\u2581the", "\u2581a", "\u2581def", "\u2581return", "e", "t", "a", "o", "n", "s", "\u2581x"]
    tokens += words
    types += [gguf.TokenType.NORMAL] * len(words)
    scores = [0.0] * 259 + [-float(i) for i in range(len(words))]
    return tokens, scores, [int(t) for t in types]


def write_tiny_gguf(path: str | Path, arch: str = "llama", *, n_embd: int = 64, n_layer: int = 2,
                    n_head: int = 4, n_head_kv: int = 2, n_ff: int | list[int] = 128, n_ctx: int = 256,
                    seed: int = 0, dtype=np.float32, extra_kv: dict | None = None,
                    block_count: int | None = None, duplicate_token: bool = False,
                    chat_template: str | None = None, n_expert: int = 4, n_expert_used: int = 2,
                    n_ff_shexp: int = 64, moe: bool | None = None, fused_gate_up: bool = False,
                    mtp_layers: int = 0, tensor_hook: Callable[[str, np.ndarray], np.ndarray] | None = None) -> Path:
    """Write a random-weight model of `arch` (llama, qwen2, qwen3, qwen35, gemma3, qwen3moe, or any name
    for unknown-arch tests).

    qwen35 is the Gated-DeltaNet / attention hybrid (every fourth layer attention, the others linear
    attention); gemma3 has post-attention and post-FFN norms and a GELU FFN; qwen3moe has an expert
    FFN (`n_expert` experts of width `n_ff`, `n_expert_used` routed per token) and qwen35moe the
    qwen35 layers with that FFN plus a shared expert of width `n_ff_shexp`; `moe=True` writes the
    expert FFN under any other architecture name; `fused_gate_up` stores each expert's gate and up rows
    in one ffn_gate_up_exps (the same values as the separate tensors). `n_ff` may be a list (one width per layer).
    `tensor_hook(name, values)` may replace any tensor's values before it is written (planted
    structure in tests).

    `mtp_layers` (qwen35 only) appends that many multi-token-prediction ("nextn") blocks after the
    `n_layer` trunk blocks, as llama.cpp reads them: counted in block_count, named by
    `qwen35.nextn_predict_layers`, each a full-attention block plus nextn.eh_proj / enorm / hnorm.

    `block_count` writes that layer count into the metadata whatever the tensors hold, and
    `duplicate_token` gives two vocabulary entries the same text: files llama.cpp's loader asserts on.
    """
    import gguf

    rng = np.random.default_rng(seed)
    path = Path(path)
    moe = arch in MOE_ARCHS if moe is None else moe
    hybrid = arch in ("qwen35", "qwen35moe")  # Gated DeltaNet layers between attention layers
    w = gguf.GGUFWriter(str(path), arch)
    head_dim = n_embd // n_head
    w.add_name(f"tiny-{arch}")
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    if mtp_layers and arch != "qwen35":
        raise ValueError("mtp_layers: qwen35 only")
    w.add_block_count(n_layer + mtp_layers if block_count is None else block_count)
    if mtp_layers:
        w.add_uint32(f"{arch}.nextn_predict_layers", mtp_layers)
    if isinstance(n_ff, (list, tuple)):
        w.add_array(f"{arch}.feed_forward_length", [int(x) for x in n_ff])
        widths = [int(x) for x in n_ff]
    else:
        w.add_feed_forward_length(n_ff)
        widths = [int(n_ff)] * (n_layer + mtp_layers)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    if arch in ("qwen3", "qwen35", "gemma3") + MOE_ARCHS:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "gemma3":
        w.add_sliding_window(64)
    if arch == "qwen2vl":   # M-RoPE sections of the rotary half: temporal, height, width
        w.add_array(f"{arch}.rope.dimension_sections", [head_dim // 8, head_dim * 3 // 16, head_dim * 3 // 16, 0])
    if hybrid:  # linear attention: 2 key heads and 4 value heads of 8, conv kernel 4
        w.add_uint32(f"{arch}.ssm.conv_kernel", 4)
        w.add_uint32(f"{arch}.ssm.inner_size", 32)
        w.add_uint32(f"{arch}.ssm.state_size", 8)
        w.add_uint32(f"{arch}.ssm.time_step_rank", 4)
        w.add_uint32(f"{arch}.ssm.group_count", 2)
        w.add_uint32(f"{arch}.full_attention_interval", 2)
        w.add_uint32(f"{arch}.rope.dimension_count", head_dim)
        w.add_array(f"{arch}.rope.dimension_sections", [head_dim // 4, head_dim // 4, 0, 0])
    if moe:
        w.add_expert_count(n_expert)
        w.add_expert_used_count(n_expert_used)
        w.add_uint32(f"{arch}.expert_feed_forward_length", widths[0])
        if arch == "qwen35moe":
            w.add_uint32(f"{arch}.expert_shared_feed_forward_length", n_ff_shexp)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if dtype == np.float32 else gguf.LlamaFileType.MOSTLY_F16)
    tokens, scores, types = _vocab()
    if duplicate_token:
        tokens[-1] = tokens[-2]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_chat_template(chat_template or "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    for k, v in (extra_kv or {}).items():
        if isinstance(v, str):
            w.add_string(k, v)
        elif isinstance(v, float):
            w.add_float32(k, v)
        else:
            w.add_uint32(k, int(v))

    def add(name: str, values: np.ndarray):
        w.add_tensor(name, tensor_hook(name, values) if tensor_hook is not None else values)

    def r(*shape: int, scale: float = 0.08) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(dtype)

    def t(name: str, *shape: int, scale: float = 0.08):
        add(name, r(*shape, scale=scale))

    def ones(name: str, n: int):
        add(name, np.ones(n, dtype=np.float32))

    n_vocab = len(tokens)
    t("token_embd.weight", n_vocab, n_embd)
    ones("output_norm.weight", n_embd)
    t("output.weight", n_vocab, n_embd)
    for i in range(n_layer + mtp_layers):
        p = f"blk.{i}."
        ff = widths[i]
        mtp = i >= n_layer   # a nextn block: full attention, then what joins it to the trunk
        if mtp:
            t(p + "nextn.eh_proj.weight", n_embd, 2 * n_embd)
            ones(p + "nextn.enorm.weight", n_embd)
            ones(p + "nextn.hnorm.weight", n_embd)
        ones(p + "attn_norm.weight", n_embd)
        if hybrid and (i + 1) % 2 and not mtp:  # a linear-attention (Gated DeltaNet) layer
            key_dim, value_dim = 8 * 2, 8 * 4
            t(p + "attn_qkv.weight", key_dim * 2 + value_dim, n_embd)
            t(p + "attn_gate.weight", value_dim, n_embd)
            t(p + "ssm_conv1d.weight", key_dim * 2 + value_dim, 4)
            add(p + "ssm_dt.bias", np.zeros(4, dtype=np.float32))
            add(p + "ssm_a", -np.ones(4, dtype=np.float32))
            t(p + "ssm_beta.weight", 4, n_embd)
            t(p + "ssm_alpha.weight", 4, n_embd)
            ones(p + "ssm_norm.weight", 8)
            t(p + "ssm_out.weight", n_embd, value_dim)
        else:
            q_rows = n_head * head_dim * (2 if hybrid else 1)  # qwen35: query and its gate
            t(p + "attn_q.weight", q_rows, n_embd)
            t(p + "attn_k.weight", n_head_kv * head_dim, n_embd)
            t(p + "attn_v.weight", n_head_kv * head_dim, n_embd)
            t(p + "attn_output.weight", n_embd, n_head * head_dim)
            if arch in ("qwen2", "qwen2vl"):
                w.add_tensor(p + "attn_q.bias", np.zeros(n_head * head_dim, dtype=np.float32))
                w.add_tensor(p + "attn_k.bias", np.zeros(n_head_kv * head_dim, dtype=np.float32))
                w.add_tensor(p + "attn_v.bias", np.zeros(n_head_kv * head_dim, dtype=np.float32))
            if arch in ("qwen3", "qwen35", "gemma3") + MOE_ARCHS:
                ones(p + "attn_q_norm.weight", head_dim)
                ones(p + "attn_k_norm.weight", head_dim)
        if hybrid or arch == "gemma3":
            ones(p + "post_attention_norm.weight", n_embd)
        if not hybrid:
            ones(p + "ffn_norm.weight", n_embd)
        if arch == "gemma3":
            ones(p + "post_ffw_norm.weight", n_embd)
        if moe:
            t(p + "ffn_gate_inp.weight", n_expert, n_embd)
            if fused_gate_up:
                gate, up = r(n_expert, ff, n_embd), r(n_expert, ff, n_embd)
                add(p + "ffn_gate_up_exps.weight", np.concatenate([gate, up], 1))
            else:
                t(p + "ffn_gate_exps.weight", n_expert, ff, n_embd)
                t(p + "ffn_up_exps.weight", n_expert, ff, n_embd)
            t(p + "ffn_down_exps.weight", n_expert, n_embd, ff)
            if arch == "qwen35moe":
                t(p + "ffn_gate_inp_shexp.weight", n_embd)
                t(p + "ffn_gate_shexp.weight", n_ff_shexp, n_embd)
                t(p + "ffn_up_shexp.weight", n_ff_shexp, n_embd)
                t(p + "ffn_down_shexp.weight", n_embd, n_ff_shexp)
            continue
        t(p + "ffn_gate.weight", ff, n_embd)
        t(p + "ffn_up.weight", ff, n_embd)
        t(p + "ffn_down.weight", n_embd, ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def truncated_copy(src: str | Path, dst: str | Path, keep_fraction: float = 0.6) -> Path:
    data = Path(src).read_bytes()
    Path(dst).write_bytes(data[: int(len(data) * keep_fraction)])
    return Path(dst)


def write_tiny_lora(path: str | Path, *, n_embd: int = 64, n_head: int = 4, rank: int = 4,
                    scale: float = 0.5, seed: int = 1, arch: str = "llama") -> Path:
    """A LoRA adapter GGUF for write_tiny_gguf's model: low-rank deltas on every layer's attn_q/attn_v."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", float(rank))
    for i in range(2):
        for name in ("attn_q", "attn_v"):
            n_out = n_embd if name == "attn_q" else (n_embd // n_head) * 2
            w.add_tensor(f"blk.{i}.{name}.weight.lora_a",
                         (rng.standard_normal((rank, n_embd)) * scale).astype(np.float32))
            w.add_tensor(f"blk.{i}.{name}.weight.lora_b",
                         (rng.standard_normal((n_out, rank)) * scale).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


#: struct formats of GGUF's integer value types (gguf.GGUFValueType numbering)
_INT_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 10: "<Q", 11: "<q"}


def numeric_fields(path: str | Path) -> dict[str, tuple[int, str]]:
    """Where a GGUF keeps its integer header values: {name: (byte offset, struct format)}.

    Names are the metadata keys with an integer scalar value, `tensor_count` and `kv_count`, and
    `tensor:NAME:dim` for each dimension of each tensor (64-bit). Read with the `gguf` package."""
    import gguf

    r = gguf.GGUFReader(str(path), "r")
    out = {"tensor_count": (8, "<Q"), "kv_count": (16, "<Q")}
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or len(f.types) != 1 or int(f.types[0]) not in _INT_FORMATS:
            continue
        out[name] = (f.offset + 8 + len(name.encode()) + 4, _INT_FORMATS[int(f.types[0])])
    for t in r.tensors:
        base = t.field.offset + 8 + len(t.name.encode()) + 4
        for i in range(len(t.shape)):
            out[f"tensor:{t.name}:{i}"] = (base + 8 * i, "<Q")
    return out


def patched_copy(src: str | Path, dst: str | Path, values: dict[str, int]) -> Path:
    """A copy of `src` with integer header values replaced ({name as in numeric_fields: value}); a value
    is wrapped to the field's width, as a writer with an overflow would store it."""
    import struct

    fields = numeric_fields(src)
    data = bytearray(Path(src).read_bytes())
    for name, value in values.items():
        offset, fmt = fields[name]
        bits = struct.calcsize(fmt) * 8
        v = value % (1 << bits)
        if fmt[1].islower() and v >= 1 << (bits - 1):   # signed: the same bits
            v -= 1 << bits
        struct.pack_into(fmt, data, offset, v)
    Path(dst).write_bytes(data)
    return Path(dst)


def rewritten_copy(src: str | Path, dst: str | Path, replace: dict[str, Any] | None = None,
                   add: Callable[[Any], None] | None = None) -> Path:
    """`src` written anew by gguf's writer into `dst` (which may be `src`): every metadata key with its
    stored types, the values in `replace` put in place of theirs, then what `add(writer)` adds, then
    the tensors as stored."""
    import gguf

    r = gguf.GGUFReader(str(src))
    tmp = str(dst) + ".tmp"
    w = gguf.GGUFWriter(tmp, r.fields["general.architecture"].contents())
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, (replace or {}).get(name, f.contents()), vtype, sub_type=sub)
    if add is not None:
        add(w)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_shape=list(reversed([int(x) for x in t.shape])),
                     raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, dst)
    return Path(dst)
