"""`a3b tune`: a LoRA adapter trained on a repository's code, written as a GGUF adapter llama.cpp loads.

collect.py and ignore.py choose the files and split them; samples.py lays them out as the editor
asks the model (fill-in-the-middle, or plain windows); lora.py, model.py and train.py train the
adapter on prune/'s torch reference forward with the base frozen; adapter.py writes it; run.py is
the whole command, cli.py its flags. The language server runs the command in a child process
(lsp_server/tuning.py) and does not import this package. Torch is imported by the training modules
only; nothing outside this package imports it except the root cli.py, lazily.
"""
