"""`jaxlora-train JOBS.yaml [key=value ...] [--resume]`: trains several LoRA adapters together."""

from __future__ import annotations

import argparse
import sys

from jaxlora.lora.config import AdapterError
from jaxlora.weights import WeightsError
from train.config import ConfigError, load_train_config


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxlora-train", description=__doc__)
    parser.add_argument("config", help="YAML file: base_model, output_dir, jobs: [...]")
    parser.add_argument("overrides", nargs="*", help="key=value, e.g. capacity=512 jobs.0.learning_rate=1e-3")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        config = load_train_config(args.config, args.overrides)
        from train.trainer import Trainer  # imports JAX: only once the config is known to be good

        trainer = Trainer(config)
        losses = trainer.run(resume=args.resume)
    except (ConfigError, WeightsError, AdapterError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for name, values in losses.items():
        last = f"{values[-1]:.4f}" if values else "n/a"
        print(f"{name}: {len(values)} steps, final loss {last}, adapter in {config.output_dir}/{name}")
    return 0
