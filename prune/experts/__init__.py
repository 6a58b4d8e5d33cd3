"""Mixture-of-experts pruning of qwen3moe and qwen35moe GGUFs: whole experts, and neurons inside experts.

Models such as Qwen3-30B-A3B route every token to a few (8) of many (128) experts per layer. Their
size, not their speed, keeps them off small GPUs, so removing whole experts is what pays. Experts are
ranked per layer on calibration text run through the GGUF as llama.cpp loads it (llama_stats.py):

- reap:      the mean, over the calibration tokens routed to the expert, of the router weight that
             scales its output times the norm of that output (REAP, router-weighted expert activation
             pruning); an expert never routed to scores 0.
- frequency: how many calibration tokens were routed to the expert.
- random:    a seeded random ranking (the floor the others must beat).

The same number of experts is kept in every layer (llama.cpp reads one `<arch>.expert_count` for all
layers). The router keeps its top-k over the remaining experts; the number routed per token
(`<arch>.expert_used_count`) is kept, and a ratio that would leave fewer experts than that is refused.
Both architectures renormalise the weights of the chosen experts to sum to one, so experts that
never win can go without changing any token's output.

`keep` < 1 also narrows every kept expert to one FFN width (`<arch>.expert_feed_forward_length`),
each expert choosing its own neurons from its routed tokens: random, magnitude, wanda (norm of the
down column x RMS of the neuron's activation), flap (variance x squared column norm, selection only:
experts carry no bias), and obs / a3b as the router-weighted wanda (the activation scaled by the
router weight, as in REAP). A shared expert (`*_shexp`, qwen35moe) is a dense FFN seen by every
token and is narrowed by the dense methods (obs / a3b as wanda; its least-squares re-fit is not done
here).

Streamed as the dense path (writing/gguf.py): one tensor in memory at a time. Removing experts slices the
stored bytes of the expert tensors and of the router rows (`ffn_gate_inp`), so quantised tensors keep
their bytes; narrowed experts keep their gate/up rows as stored bytes and requantise their down
projection per expert with llama.cpp's quantiser in its own type (or llama-quantize's fallback type
when the width does not fill its blocks), with the calibration's importance matrix.

layout.py  which tensors carry the experts, and the checks that a file's experts can be pruned
stats.py   the routing statistics gathered through llama.cpp (ExpertProbe), cached on disk
plan.py    which experts and expert neurons stay (the rankings above)
write.py   the pruned file, one tensor at a time
run.py     the whole run (prune_moe)

The top floor of the pruning tool: it reads calibration/, writing/ and, for the shared expert, the
dense methods (dense/methods.py).
"""
