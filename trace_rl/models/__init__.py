"""Model plumbing: names to local folders (Hub ids, GGUF files, the tiny model), LoRA adapters, the
runtime types every sampler implements, and chat rendering with the model's tokenizer."""
