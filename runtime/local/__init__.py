"""The in-process engine: the model worker (worker.py) and what it runs on, over runtime/llama/ (or
any `seam.Backend`, the seam below it): the scheduling policy (scheduler.py, steps.py, slots.py, units.py, jobs.py),
prompt rendering (prompting.py, imageprompt.py), sampling and verification (verify.py,
sampler_choice.py), a sampled token's way to its stream (delivery.py), the embedding path
(embedding.py) and speculative decoding (speculative.py, drafting.py, draftmodel.py).

Nothing above the runtime imports this package; the runtime's API and store reach it through
`engine.Engine` (runtime/llama/local_engine.py builds a worker over llama.cpp)."""
