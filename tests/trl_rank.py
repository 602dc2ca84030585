"""One process of the 2-rank TRL test (tests/test_integration_trl.py): a KTAE GRPO step on CPU with
gloo, groups split across the ranks; saves what went in and out and what was logged."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from test_integration_trl import _args, _even_majority, _model, _Recording, _tokenizer, datasets


def main(out_dir: str) -> None:
    prompts = datasets.Dataset.from_dict({"prompt": ["a b c", "d e f", "g h", "i j k l", "m n", "o p q"]})
    args = _args(out_dir, per_device_train_batch_size=6, max_steps=1, ddp_backend="gloo")  # 12 rows, 3 groups of 4
    trainer = _Recording(_model(), reward_funcs=_even_majority, args=args, train_dataset=prompts,
                         processing_class=_tokenizer())
    trainer.seen = []
    trainer.train()
    rank = trainer.accelerator.process_index
    logged = {k: v for entry in trainer.state.log_history for k, v in entry.items() if k.startswith("ktae/")}
    torch.save({"seen": trainer.seen, "logged": logged, "world": trainer.accelerator.num_processes},
               Path(out_dir) / f"rank{rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
