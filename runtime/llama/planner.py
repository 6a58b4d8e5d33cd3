"""Where each tensor goes: the VRAM planner behind `n_gpu_layers="auto"`, as pure policy.

Input: a model's tensor sizes grouped the way placement moves them (`Layout`, from the GGUF's tensor
index), the free device memory, the load options that size the KV cache and the compute buffers,
and the placement the caller fixed (expert layers, tensor overrides). Output: a `Plan` saying what
went where, the device and main memory it expects, and the speed class. Nothing here calls
llama.cpp; placement.py turns a plan into llama.cpp's load parameters.

The order of choices, each tried only when the one before does not fit:

1. everything on the GPU;
2. the movable FFN tensors to the CPU layer by layer from the first layer (`n_cpu_moe`; for a
   mixture-of-experts model the routed experts, for a dense model the dense FFN), attention, norms,
   shared experts and the KV cache staying on the GPU. Per token only the experts the router picks
   are read, so the CPU's share of the work is small next to that of whole layers;
3. every movable tensor on the CPU, and whole layers to the CPU from the first layer on (llama.cpp
   keeps the last `n_gpu_layers` layers on the GPU; the output layer only when every layer is there);
4. when not even one layer fits, a smaller context (halved down to CTX_FLOOR), said in the reason.

The estimate of device memory per plan (`gpu_bytes`) is what llama.cpp allocates after the CUDA
context exists: the weights placed there, their layers' KV cache, and the compute buffers. Those
buffers are estimated from the shapes: the logits of a batch, the attention scratch of a batch
against the whole context (a quarter of it with flash attention), and, when weights stay in main
memory, room for copies of them: llama.cpp moves a host-resident weight to the GPU for batches of
32 tokens and more (prompt reading), one tensor at a time. `MARGIN` is kept free beside all that
(the CUDA context, cuBLAS workspaces, fragmentation): it is part of the budget, not of the estimate.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from . import tensorpatterns

#: bytes per KV cache element, by KV cache type
KV_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "q8_0": 34 / 32, "q5_1": 24 / 32, "q5_0": 22 / 32,
            "q4_1": 20 / 32, "q4_0": 18 / 32}
#: kept free whatever the model: the CUDA context, cuBLAS workspaces and fragmentation
MARGIN = 600 << 20
#: the smallest context the planner shrinks to (a request's prompt and answer still fit a chat turn)
CTX_FLOOR = 1024
#: llama.cpp moves host-resident weights to the GPU for batches of this many tokens and more
OP_OFFLOAD_MIN_BATCH = 32

_BLK = re.compile(r"^blk\.(\d+)\.")
#: routed expert tensors (llama.cpp's names; gate_up where an architecture stores both in one)
EXPERT = re.compile(r"^blk\.\d+\.ffn_(gate|up|down|gate_up)_(ch)?exps\b")
#: a dense model's FFN tensors
DENSE_FFN = re.compile(r"^blk\.\d+\.ffn_(gate|up|down)\.weight$")

SPEED_CLASSES = {
    "gpu": "everything on the GPU",
    "experts-cpu": "attention and KV on the GPU, some expert/FFN tensors computed on the CPU",
    "layers-cpu": "some whole layers on the CPU (slowest hybrid)",
    "cpu": "CPU only",
}


@dataclass(frozen=True)
class Tensor:
    name: str
    nbytes: int
    layer: int        # -1 outside the blocks
    movable: bool     # an expert (MoE) or dense FFN tensor: what step 2 moves


@dataclass(frozen=True)
class Layout:
    """A model's tensors as placement sees them, and the dimensions that size its KV cache."""

    n_layer: int
    moe: bool
    tensors: tuple[Tensor, ...]
    n_head: int = 0
    n_head_kv: int = 0
    key_length: int = 0
    value_length: int = 0
    n_vocab: int = 32000
    tied_output: bool = False    # no output.weight: llama.cpp puts a copy of token_embd on the GPU
    #: hybrid models (qwen35: Gated DeltaNet between attention layers): the layers with a KV cache
    #: (None: all), and the float32 bytes of one sequence's state in each of the others (its
    #: convolution and recurrent state; llama.cpp keeps 1 + n_rs_seq such rows per sequence)
    kv_layers: tuple[int, ...] | None = None
    rs_bytes: int = 0

    @classmethod
    def of(cls, named_sizes, *, n_layer: int, n_head: int = 0, n_head_kv: int = 0, key_length: int = 0,
           value_length: int = 0, n_vocab: int = 0, kv_layers: tuple[int, ...] | None = None,
           rs_bytes: int = 0) -> Layout:
        """From (tensor name, bytes) pairs and the header's dimensions."""
        items = list(named_sizes)
        moe = any(EXPERT.match(n) for n, _ in items)
        movable = EXPERT if moe else DENSE_FFN
        tensors = []
        for name, nbytes in items:
            m = _BLK.match(name)
            layer = int(m.group(1)) if m and int(m.group(1)) < n_layer else -1
            tensors.append(Tensor(name, int(nbytes), layer, layer >= 0 and bool(movable.match(name))))
        tied = not any(n == "output.weight" for n, _ in items)
        return cls(n_layer, moe, tuple(tensors), n_head, n_head_kv or n_head, key_length, value_length or key_length,
                   n_vocab or 32000, tied, kv_layers, rs_bytes)

    def movable_bytes(self, layer: int | None = None) -> int:
        return sum(t.nbytes for t in self.tensors if t.movable and (layer is None or t.layer == layer))

    def kv_bytes_per_layer(self, n_cells: int, kv_type: str) -> int:
        return int(n_cells * self.n_head_kv * (self.key_length + self.value_length) * KV_BYTES.get(kv_type, 2))


@dataclass(frozen=True)
class Override:
    """One user tensor override: a compiled pattern and whether its device is the CPU."""

    pattern: str
    to_cpu: bool

    def matches(self, name: str) -> bool:
        return tensorpatterns.matches(self.pattern, name)   # linear time (RE2), whatever the pattern


@dataclass
class Plan:
    """A placement and what it is expected to cost; `measured` is filled in after the load."""

    n_gpu_layers: int            # what llama.cpp gets (n_layer + 1 = every layer and the output)
    n_cpu_moe: int               # the first N layers' movable tensors in main memory
    n_layer: int
    moe: bool
    n_ctx: int                   # per slot; smaller than asked when step 4 shrank it
    gpu_bytes: int               # expected device memory: weights + KV + compute
    gpu_weights: int
    gpu_kv: int
    gpu_compute: int
    host_bytes: int              # expected main memory: weights and KV left on the CPU
    free_bytes: int              # device memory free when planning (0: no GPU)
    reserve_bytes: int           # kept free beside MARGIN (what ComfyUI said it needs)
    speed: str                   # a SPEED_CLASSES key
    reason: str
    gpu: bool = True             # a GPU was there to plan for
    warnings: list[str] = field(default_factory=list)
    measured: dict = field(default_factory=dict)

    @property
    def full(self) -> bool:
        return self.n_gpu_layers > self.n_layer

    def describe(self) -> str:
        kind = "experts" if self.moe else "FFN tensors"
        where = f"{min(self.n_gpu_layers, self.n_layer)}/{self.n_layer} layers{' + output' if self.full else ''}"
        moved = f", {kind} of {self.n_cpu_moe} layers on the CPU" if self.n_cpu_moe else ""
        if not self.gpu:
            return f"CPU only{moved}: {self.reason}"
        return (f"{where} on the GPU{moved} (about {self.gpu_bytes / 2**30:.1f} GiB of "
                f"{self.free_bytes / 2**30:.1f} GiB free; {self.host_bytes / 2**30:.1f} GiB in RAM; "
                f"{self.speed}): {self.reason}")

    def as_dict(self) -> dict:
        out = asdict(self)
        out["describe"] = self.describe()
        return out


def _on_gpu_layers(n_gpu_layers: int, n_layer: int) -> int:
    return n_layer + 1 if n_gpu_layers < 0 else min(n_gpu_layers, n_layer + 1)


def cost(layout: Layout, *, n_gpu_layers: int, n_cpu_moe: int, n_ctx: int, n_parallel: int, n_batch: int,
         kv_type: str = "f16", flash_attn: str = "auto", overrides: tuple[Override, ...] = (),
         gpu: bool = True, n_rs_seq: int = 0) -> dict:
    """Expected bytes of one placement: on the GPU (weights, KV, compute) and in main memory.
    `n_rs_seq`: the recurrent-state snapshots each sequence keeps (speculative decoding)."""
    n_layer = layout.n_layer
    k = _on_gpu_layers(n_gpu_layers, n_layer) if gpu else 0
    first_gpu = n_layer - min(k, n_layer)
    gpu_w = host_w = 0
    largest_host = 0
    for t in layout.tensors:
        on_gpu = (t.layer >= first_gpu) if t.layer >= 0 else (t.name.startswith("output") and k > n_layer)
        if t.movable and t.layer < n_cpu_moe:
            on_gpu = False
        for o in overrides:   # the first matching override decides, as in llama.cpp
            if o.matches(t.name):
                on_gpu = gpu and not o.to_cpu
                break
        if on_gpu:
            gpu_w += t.nbytes
        else:
            host_w += t.nbytes
            if t.layer >= 0:
                largest_host = max(largest_host, t.nbytes)
    if layout.tied_output and k > n_layer:
        emb = next((t.nbytes for t in layout.tensors if t.name == "token_embd.weight"), 0)
        gpu_w += emb
    cells = n_ctx * n_parallel
    kv_layer = layout.kv_bytes_per_layer(cells, kv_type)
    kv_on = set(range(n_layer) if layout.kv_layers is None else layout.kv_layers)
    rs_layer = layout.rs_bytes * n_parallel * (1 + max(n_rs_seq, 0))   # a recurrent layer's rows
    gpu_kv = host_kv = 0
    for layer in range(n_layer):
        b = kv_layer if layer in kv_on else rs_layer
        if layer >= first_gpu:
            gpu_kv += b
        else:
            host_kv += b
    compute = 0
    if gpu_w or gpu_kv:
        batch = max(n_batch, n_parallel)
        scratch = cells * batch * max(layout.n_head, 1) * 4 // (4 if flash_attn != "off" else 1)
        compute = 2 * batch * layout.n_vocab * 4 + min(scratch, 4 << 30)
        if largest_host and batch >= OP_OFFLOAD_MIN_BATCH:
            compute += 2 * largest_host
    return {"gpu": gpu_w + gpu_kv + compute, "gpu_weights": gpu_w, "gpu_kv": gpu_kv, "gpu_compute": compute,
            "host": host_w + host_kv}


def _speed(layout: Layout, n_gpu_layers: int, n_cpu_moe: int, gpu: bool) -> str:
    if not gpu or n_gpu_layers == 0:
        return "cpu"
    if _on_gpu_layers(n_gpu_layers, layout.n_layer) <= layout.n_layer:
        return "layers-cpu"
    return "experts-cpu" if n_cpu_moe else "gpu"


def plan(layout: Layout, *, free_bytes: int, n_ctx: int, n_parallel: int = 1, n_batch: int = 256,
         kv_type: str = "f16", flash_attn: str = "auto", reserve_bytes: int = 0, n_cpu_moe: int | None = None,
         n_gpu_layers: int | str = "auto", overrides: tuple[Override, ...] = (), gpu: bool = True,
         experts_first: bool = True, n_rs_seq: int = 0) -> Plan:
    """The placement for `free_bytes` of device memory (module docstring for the order).

    `n_cpu_moe` None lets the planner choose the expert layers, a number fixes them; `n_gpu_layers`
    "auto" lets it choose the layers, a number fixes them (then the plan only adds the figures).
    `experts_first=False` skips step 2: today's layer-only offload, kept for comparison."""
    n_layer = layout.n_layer
    budget = free_bytes - MARGIN - reserve_bytes
    args = dict(n_parallel=n_parallel, n_batch=n_batch, kv_type=kv_type, flash_attn=flash_attn,
                overrides=overrides, gpu=gpu, n_rs_seq=n_rs_seq)
    notes: list[str] = []

    def make(k: int, n: int, ctx: int, reason: str) -> Plan:
        c = cost(layout, n_gpu_layers=k, n_cpu_moe=n, n_ctx=ctx, **args)
        return Plan(k, n, n_layer, layout.moe, ctx, c["gpu"], c["gpu_weights"], c["gpu_kv"], c["gpu_compute"],
                    c["host"], free_bytes, reserve_bytes, _speed(layout, k, n, gpu), reason, gpu, list(notes))

    if n_gpu_layers != "auto" or not gpu:
        k = 0 if not gpu else int(n_gpu_layers)
        n = n_layer if n_cpu_moe is None and not gpu else (n_cpu_moe or 0)
        return make(k, min(n, n_layer), n_ctx, "as asked" if gpu else "no GPU")

    def fits(k: int, n: int, ctx: int) -> bool:
        return cost(layout, n_gpu_layers=k, n_cpu_moe=n, n_ctx=ctx, **args)["gpu"] <= budget

    full = n_layer + 1
    movable = layout.movable_bytes() > 0
    ctx = n_ctx
    while True:
        if n_cpu_moe is None:
            if fits(full, 0, ctx):
                return make(full, 0, ctx, "the whole model fits")
            if movable and experts_first:
                for n in range(1, n_layer + 1):   # fewest layers' experts moved first
                    if fits(full, n, ctx):
                        kind = "experts" if layout.moe else "FFN tensors"
                        return make(full, n, ctx, f"{kind} of the first {n} layers to the CPU, attention and KV "
                                                  "cache on the GPU")
            n_fixed = n_layer if experts_first and movable else 0
        else:
            n_fixed = min(n_cpu_moe, n_layer)
            if fits(full, n_fixed, ctx):
                return make(full, n_fixed, ctx, "every layer fits beside the placement asked")
        if experts_first and movable and n_cpu_moe is None and ctx == n_ctx:
            need = cost(layout, n_gpu_layers=full, n_cpu_moe=n_layer, n_ctx=ctx, **args)["gpu"]
            notes.append(f"even with every {'expert' if layout.moe else 'FFN tensor'} on the CPU the rest needs "
                         f"about {need / 2**30:.1f} GiB, {max(budget, 0) / 2**30:.1f} GiB usable: whole layers "
                         "move to the CPU")
        for k in range(n_layer, 0, -1):
            if fits(k, n_fixed, ctx):
                return make(k, n_fixed, ctx, "as many layers as fit in the free memory, the first ones on the CPU")
        if ctx // 2 >= CTX_FLOOR and ctx > CTX_FLOOR:
            ctx //= 2
            notes[:] = [x for x in notes if not x.startswith("n_ctx shrunk")]
            notes.append(f"n_ctx shrunk from {n_ctx} to {ctx} per slot to fit the GPU")
            continue
        if ctx != n_ctx:   # shrinking did not help: keep the context asked for, on the CPU
            notes[:] = [x for x in notes if not x.startswith("n_ctx shrunk")]
        # everything on the CPU: no expert overrides of the planner's own (they would only change the
        # buffer type of tensors that are in main memory anyway)
        return make(0, n_fixed if n_cpu_moe is not None else 0, n_ctx,
                    "not even one layer fits next to the compute buffers")


def layer_only(layout: Layout, **kw) -> Plan:
    """Today's layer-only offload for the same budget (step 2 skipped): the comparison in the tables."""
    return plan(layout, experts_first=False, **kw)
