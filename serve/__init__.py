"""jaxlora-serve: an OpenAI-compatible multi-LoRA server with continuous batching over jaxlora.

`serve.engine` (continuous batching, paged KV cache, adapter pool), `serve.app` (HTTP API),
`serve.cli` (the `jaxlora-serve` command)."""
