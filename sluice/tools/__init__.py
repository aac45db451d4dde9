"""Offline tools: synthetic checkpoints (synth), inflation of a real model (inflate), GGUF export, tokenizer training.

Nothing here runs while a model generates; the runtime path (checkpoint -> io -> store -> models -> engine) never
imports this package.
"""
