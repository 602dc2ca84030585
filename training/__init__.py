"""A thin GRPO / DAPO trainer showing where ``ktae_kernels.token_advantage`` slots into an RL loop.

Run ``python -m training.train --help``. Modules: ``train`` (loop + CLI), ``config`` (TrainConfig,
presets), ``rollout`` (transformers generate / vLLM), ``loss`` (advantages, clipped PG loss),
``tasks`` (verifiable toy task), ``model`` / ``tokenizer`` (tiny local model), ``warmup`` (SFT),
``logs`` (CSV / JSON / PNG), ``compare`` (GRPO vs KTAE over seeds).
"""
