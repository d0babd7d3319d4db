"""GGUF checkpoints (llama.cpp's single-file format): metadata -> config, tensors -> weights,
vocabulary -> tokenizer. A `.gguf` path is accepted wherever a checkpoint directory is."""

from npud.engine.gguf.reader import GgufFile, is_gguf, open_gguf

__all__ = ["GgufFile", "is_gguf", "open_gguf"]
