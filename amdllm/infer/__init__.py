"""Using a model: KV-cache generation, perplexity, the continuous-batching engine and the
OpenAI-compatible server."""
