"""Calibration: the text the unpruned model reads and the statistics gathered from it.

windows.py          calibration and recovery windows in the model's own tokens; the corpus-size checks
stats.py            per-layer FFN statistics (LayerStats), whichever forward gathered them
llama_stats.py      statistics from llama.cpp's own graph evaluation (any architecture it runs)
reference_stats.py  statistics from the torch reference forward (llama, qwen2, qwen3)

Above the base modules (settings, source files, corpus, files) and below the pruning paths (dense/,
experts/), which read what this gathers.
"""
