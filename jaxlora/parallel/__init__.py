"""Manual (shard_map) parallelism: tensor-parallel layers that can run Pallas LoRA kernels, a
GPipe pipeline over the `stage` mesh axis, and pipeline bubble accounting (docs/parallelism.md;
docs/architecture.md, "Training")."""
