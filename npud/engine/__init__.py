"""Synchronous model code: configuration, weights, tokenizer, forward pass and state."""
