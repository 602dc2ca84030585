#!/usr/bin/env bash
# GRPO + KTAE with OpenRLHF (>= 0.10.2, < 0.12: the dotted CLI), the paper's setting: Qwen2.5-Math-7B, MATH levels 3-5,
# 16 samples per prompt, responses up to 3072 tokens, lr 1e-6, temperature 1.0, clip 0.2 / 0.28.
#
#   pip install -e ".[openrlhf]"                   # in a clone of ktae_kernels (not on PyPI); OpenRLHF needs CUDA
#   # without a clone: pip install "ktae_kernels[openrlhf] @ git+https://github.com/<your-org>/ktae_kernels"
#   python examples/verl/prepare_math.py --out ~/data/ktae_math   # also writes train.jsonl / test.jsonl
#   bash examples/openrlhf/run_ktae.sh                  # extra OpenRLHF flags may follow
#
# KTAE's settings travel as a JSON object (KTAEConfig fields + backend + metrics); KTAE_PRINT_ARGS=1 prints the
# command instead of running it. Sized for one node of 8 x 80 GB GPUs.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
MODEL="${MODEL:-Qwen/Qwen2.5-Math-7B}"
DATA="${DATA:-$HOME/data/ktae_math}"
SAVE="${SAVE:-./ckpt/qwen2.5-math-7b-grpo-ktae}"
KTAE='{"alpha": 1.0, "beta": 1.0, "ignore_token_ids": [151643], "metrics": "advantages"}'

ARGS=(
  --actor.model_name_or_path "$MODEL"
  --ref.num_nodes 1 --ref.num_gpus_per_node 8
  --actor.num_nodes 1 --actor.num_gpus_per_node 8
  --vllm.num_engines 4 --vllm.tensor_parallel_size 2 --vllm.gpu_memory_utilization 0.6
  --train.colocate_all
  --algo.advantage.estimator group_norm
  --algo.kl.init_coef 0
  --algo.dynamic_filtering_enable --algo.dynamic_filtering_range 0 1
  --actor.eps_clip_low_high 0.2 0.28
  --actor.adam.lr 1e-6
  --reward.remote_url "$HERE/reward_func.py"
  --data.prompt_dataset "$DATA/train.jsonl" --data.input_key prompt --data.label_key label
  --data.apply_chat_template
  --rollout.n_samples_per_prompt 16
  --rollout.batch_size 1024 --rollout.micro_batch_size 16
  --rollout.max_new_tokens 3072
  --train.batch_size 4096 --train.micro_batch_size 4
  --ds.zero_stage 3 --ds.param_dtype bf16 --ds.packing_samples
  --actor.gradient_checkpointing_enable
  --ckpt.output_dir "$SAVE" --ckpt.save_steps 50 --ckpt.save_hf
  --logger.logging_steps 1
)

if [[ "${KTAE_PRINT_ARGS:-0}" == "1" ]]; then
  printf '%s\n' --ktae "$KTAE" -- "${ARGS[@]}" "$@"
  exit 0
fi

exec python3 "$HERE/train_ktae_ray.py" --ktae "$KTAE" -- "${ARGS[@]}" "$@"
