"""Small random adapter collections for the compression tests (odd sizes, fresh random factors)."""

import numpy as np

from jaxlora.compress.collection import Source
from jaxlora.lora.adapter import LoraAdapter, ModuleLora
from jaxlora.lora.adapter_config import LoraConfig
from jaxlora.nn.model_config import LlamaConfig, projection_shapes

# hidden 30, 3 heads of 10, 1 KV head, ffn 46. The collections target q_proj and o_proj (30 x 30
# each: one shape, so each method compiles once per adapter count, not once per module).
CONFIG = LlamaConfig(vocab_size=64, hidden_size=30, intermediate_size=46, num_layers=2, num_heads=3,
                     num_kv_heads=1, head_dim=10)
MODULES = ("q_proj", "o_proj")


def adapter_from(name: str, factors: dict, alpha_over_r: float = 1.5) -> LoraAdapter:
    """An adapter from {module: (a [L, k, r], b [L, r, n])} with scale alpha/r = `alpha_over_r`."""
    rank = next(iter(factors.values()))[0].shape[2]
    config = LoraConfig(r=rank, lora_alpha=alpha_over_r * rank, target_modules=tuple(factors))
    modules = {m: ModuleLora(a.astype(np.float32), b.astype(np.float32), np.full(a.shape[0], rank, np.int32),
                             np.full(a.shape[0], alpha_over_r, np.float32)) for m, (a, b) in factors.items()}
    return LoraAdapter(name, config, modules)


def random_sources(count: int, ranks=(3, 5), seed: int = 0, modules=MODULES, config=CONFIG) -> list[Source]:
    """`count` adapters with independent random factors, ranks cycling through `ranks`."""
    rng = np.random.default_rng(seed)
    shapes = projection_shapes(config)
    sources = []
    for i in range(count):
        r = ranks[i % len(ranks)]
        factors = {m: (rng.normal(size=(config.num_layers, shapes[m][0], r)),
                       rng.normal(size=(config.num_layers, r, shapes[m][1])) * 0.1) for m in modules}
        sources.append(Source(adapter_from(f"ad{i}", factors), base_model="tiny"))
    return sources


def shared_space_sources(count: int, shared_rank: int, seed: int = 0, modules=MODULES, config=CONFIG,
                         name: str = "sh") -> list[Source]:
    """`count` adapters whose products ΔW_i = P X_i Y_i Q all lie in one random `shared_rank`-dim
    column space (P [k, s]) and row space (Q [s, n]) per layer and module; each adapter rank 4."""
    rng = np.random.default_rng(seed)
    shapes = projection_shapes(config)
    layers = config.num_layers
    spaces = {m: (rng.normal(size=(layers, shapes[m][0], shared_rank)), rng.normal(size=(layers, shared_rank,
                                                                                         shapes[m][1])))
              for m in modules}
    sources = []
    for i in range(count):
        factors = {}
        for m, (p, q) in spaces.items():
            x, y = rng.normal(size=(layers, shared_rank, 4)), rng.normal(size=(layers, 4, shared_rank))
            factors[m] = (p @ x, y @ q)
        sources.append(Source(adapter_from(f"{name}{i}", factors), base_model="tiny"))
    return sources


def dense_delta(adapter: LoraAdapter, module: str, layer: int) -> np.ndarray:
    return np.asarray(adapter.delta_weight(module, layer), np.float64)


def total_error(collection, sources, modules=MODULES) -> tuple[float, float]:
    """(sum of squared reconstruction errors over adapters, layers, modules; sum of squared norms),
    computed densely from the reconstructed ΔW."""
    err = norm = 0.0
    for source in sources:
        for m in modules:
            for layer in range(CONFIG.num_layers):
                dense = dense_delta(source.adapter, m, layer)
                err += np.sum((collection.delta_weight(source.name, m, layer) - dense) ** 2)
                norm += np.sum(dense**2)
    return err, norm
