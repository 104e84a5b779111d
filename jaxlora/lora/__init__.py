"""LoRA: configs, host adapters, PEFT I/O, the device adapter pool and its trainable split, the batch
plan, the LoRA op.

Submodules are imported directly (`from jaxlora.lora.pool import AdapterPool`) so that the model,
which uses only `ops` and `plan`, does not import the rest."""
