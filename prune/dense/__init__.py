"""Pruning dense models: FFN neurons of every layer, query heads, and recovery by distillation.

llama_path.py   one-shot FFN-neuron pruning calibrated through llama.cpp, streamed tensor by tensor
                (llama, qwen2, qwen3, qwen35, gemma3): the default where nothing needs torch
torch_path.py   the torch reference forward's path (llama, qwen2, qwen3): sequential a3b, heads, recovery
methods.py      neuron importance and selection (random, magnitude, wanda, flap, obs), the OBS re-fit
sequential.py   the a3b method: OBS layer by layer on the pruned model's own activations
heads.py        query-head pruning that keeps grouped-query attention intact
distill.py      recovery: logit distillation from the unpruned model
qat.py          training through llama.cpp's rounding
gate.py         the dynamic FFN gate's thresholds (measured for quality; llama.cpp cannot use it)

Above calibration/ and writing/, below experts/ (which narrows a shared expert by these methods).
"""
