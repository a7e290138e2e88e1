"""Reading models from files: checkpoints (converted, Hugging Face, GGUF, llama2.c), the GGUF
reader and its quantized blocks, tokenizers and chat templates."""
