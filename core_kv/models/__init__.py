"""Model helpers: the proxy LM (tokenizer, training data, training loop) and per-family cache access."""
