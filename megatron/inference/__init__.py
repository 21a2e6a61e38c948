"""Text generation: sampling (megatron.inference.sampling); the KV-cache engine, the API and the
server join in their own modules (issue: text generation)."""
