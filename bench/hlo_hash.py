"""Lowers the training grad step of a tiny model on a text batch (onehot and gather backends) and prints a hash
of its StableHLO, locations stripped: the same hash before and after a change means the same GPU program.

    PYTHONPATH=. python bench/hlo_hash.py"""
import hashlib, sys, re
import jax, jax.numpy as jnp
sys.path.insert(0, "tests/jaxlora/lora"); sys.path.insert(0, ".")
import test_backends as tb
from jaxlora.parallel.grad_step import make_grad_step
model = tb.tiny_model()
pool = tb.random_stacked_pool()
trainable, frozen = tb.split_pool({m: pool[m] for m in tb.TARGETS})
batch, token_slot = tb.packed_batch()
plan = tb.build_plan(token_slot)
inputs = (trainable, frozen, batch, plan, jnp.full(4, 0.1), jax.random.key(5))
for backend in ("onehot", "gather"):
    step = make_grad_step(model, num_slots=4, lora_backend=backend)
    text = step.lower(*inputs).as_text() if hasattr(step, "lower") else jax.jit(step).lower(*inputs).as_text()
    text = re.sub(r"loc\(.*?\)", "", text)
    text = "\n".join(l for l in text.splitlines() if not l.lstrip().startswith("#loc"))
    print(backend, hashlib.sha256(text.encode()).hexdigest()[:16], len(text))
