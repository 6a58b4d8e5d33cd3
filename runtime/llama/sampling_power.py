"""What a load's generation context may draw inside the decode (sampler_choice.py decides per
request): backend sampler chains at all, and the entropy of a row measured in the graph beside them
(graph_entropy.py). Both are learnt once per build by the probe in the vetting child."""
from __future__ import annotations

from ..models import vet
from ..options import LoadSpec
from .binding import llama
from .weights import Weights


def backend_powers(weights: Weights, spec: LoadSpec) -> tuple[bool, bool]:
    """(backend chains may be attached to this load's context, they may also measure the entropy).

    Chains: asked for (auto), and the build runs them with this placement. A chain attached to a
    context whose CPU weights sit in llama.cpp's repacked (AMX) buffers crashed this build's first
    decode, so that case is probed in the vetting child (vet.backend_sampling_works) before it is
    trusted here; a model wholly on the GPU is probed without repacking (its matrix products do not
    run on the CPU)."""
    if spec.backend_sampling == "off":
        return False, False
    info = weights.info
    cpu = cpu_matmuls(llama().llama_supports_gpu_offload(), info.n_gpu_layers, info.n_layer, info.n_cpu_moe,
                      bool(spec.override_tensor) or bool(spec.cpu_moe))
    return vet.backend_sampling_works(repack=weights.repacked and cpu)


def cpu_matmuls(gpu_offload: bool, n_gpu_layers: int, n_layer: int, n_cpu_moe: int, overrides: bool) -> bool:
    """Whether some matrix products of a load run on the CPU (over weights llama.cpp may repack).
    llama.cpp offloads every layer and the output layer for a negative count or one above n_layer;
    n_layer itself leaves the output layer on the CPU."""
    wholly = n_gpu_layers < 0 or n_gpu_layers > n_layer
    return not gpu_offload or not wholly or n_cpu_moe > 0 or overrides
