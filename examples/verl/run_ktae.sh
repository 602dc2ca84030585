#!/usr/bin/env bash
# GRPO + KTAE or DAPO + KTAE with verl (>= 0.9; the v1 trainer and its config tree), the paper's setting: Qwen2.5-Math-7B, MATH levels 3-5,
# G = 16 rollouts per prompt, 1024 prompts per step, responses up to 3072 tokens, lr 1e-6, temperature 1.0;
# DAPO: clip 0.2 / 0.28, token-mean loss, overlong buffer 512, groups filtered on accuracy.
#
#   pip install -e ".[verl]" vllm                   # in a clone of ktae_kernels (not on PyPI); or, without a clone:
#   pip install "ktae_kernels[verl] @ git+https://github.com/<your-org>/ktae_kernels" vllm
#   python examples/verl/prepare_math.py --out ~/data/ktae_math
#   bash examples/verl/run_ktae.sh grpo             # or: dapo; extra Hydra overrides may follow
#
# KTAE is one line: algorithm.adv_estimator=ktae (+algorithm.ktae.* for its settings). The trainer is verl's own
# (any trainer.v1.trainer_mode). KTAE_PRINT_OVERRIDES=1 prints the overrides instead of launching (the tests use it).
# Before launching, the script checks that `import verl` registers KTAE and that the algorithm.ktae settings parse
# (python -m ktae_kernels.integrations.verl --check), so a broken install fails here, not after model load.
# Sized for one node of 8 x 80 GB GPUs; scale trainer.nnodes / n_gpus_per_node and the micro-batch settings.
set -euo pipefail

ALGO="${1:-grpo}"
shift || true
MODEL="${MODEL:-Qwen/Qwen2.5-Math-7B}"
DATA="${DATA:-$HOME/data/ktae_math}"
NNODES="${NNODES:-1}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
PROJECT="${PROJECT:-ktae}"
MAX_PROMPT=1024
MAX_RESPONSE=3072
OVERLONG=512

COMMON=(
  algorithm.adv_estimator=ktae
  +algorithm.ktae.alpha=1.0
  +algorithm.ktae.beta=1.0
  "+algorithm.ktae.ignore_token_ids=[151643]"  # Qwen's <|endoftext|>, hard-coded upstream
  +algorithm.ktae.metrics=advantages
  algorithm.norm_adv_by_std_in_grpo=True
  algorithm.use_kl_in_reward=False
  data.train_files="$DATA/train.parquet"
  data.val_files="$DATA/test.parquet"
  data.train_batch_size=1024
  data.max_prompt_length=$MAX_PROMPT
  data.max_response_length=$MAX_RESPONSE
  data.filter_overlong_prompts=True
  data.truncation=error
  actor_rollout_ref.model.path="$MODEL"
  actor_rollout_ref.model.use_remove_padding=True
  actor_rollout_ref.model.enable_gradient_checkpointing=True
  actor_rollout_ref.actor.optim.lr=1e-6
  actor_rollout_ref.actor.ppo_mini_batch_size=256
  actor_rollout_ref.actor.use_dynamic_bsz=True
  actor_rollout_ref.actor.ppo_max_token_len_per_gpu=$(( (MAX_PROMPT + MAX_RESPONSE) * 4 ))
  actor_rollout_ref.actor.use_kl_loss=False
  actor_rollout_ref.actor.entropy_coeff=0
  actor_rollout_ref.actor.fsdp_config.param_offload=False
  actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
  actor_rollout_ref.rollout.name=vllm
  actor_rollout_ref.rollout.n=16
  actor_rollout_ref.rollout.temperature=1.0
  actor_rollout_ref.rollout.tensor_model_parallel_size=2
  actor_rollout_ref.rollout.gpu_memory_utilization=0.7
  actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True
  actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True
  trainer.n_gpus_per_node=$GPUS_PER_NODE
  trainer.nnodes=$NNODES
  trainer.project_name="$PROJECT"
  trainer.experiment_name="qwen2.5-math-7b-${ALGO}-ktae"
  "trainer.logger=[console,wandb]"
  trainer.total_epochs=10
  trainer.save_freq=50
  trainer.test_freq=10
)

case "$ALGO" in
  grpo)
    ALGO_ARGS=(
      actor_rollout_ref.actor.clip_ratio_low=0.2
      actor_rollout_ref.actor.clip_ratio_high=0.2
      actor_rollout_ref.actor.loss_agg_mode=token-mean
    )
    ;;
  dapo)
    ALGO_ARGS=(
      actor_rollout_ref.actor.clip_ratio_low=0.2
      actor_rollout_ref.actor.clip_ratio_high=0.28
      actor_rollout_ref.actor.loss_agg_mode=token-mean
      algorithm.filter_groups.enable=True
      algorithm.filter_groups.metric=acc
      algorithm.filter_groups.max_num_gen_batches=10
      reward.reward_manager.name=dapo
      +reward.reward_kwargs.max_resp_len=$MAX_RESPONSE
      +reward.reward_kwargs.overlong_buffer_cfg.enable=True
      +reward.reward_kwargs.overlong_buffer_cfg.len=$OVERLONG
      +reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0
      +reward.reward_kwargs.overlong_buffer_cfg.log=False
    )
    ;;
  *)
    echo "usage: $0 grpo|dapo [extra Hydra overrides...]" >&2
    exit 2
    ;;
esac

if [[ "${KTAE_PRINT_OVERRIDES:-0}" == "1" ]]; then
  printf '%s\n' "${COMMON[@]}" "${ALGO_ARGS[@]}" "$@"
  exit 0
fi

# verl imports VERL_USE_EXTERNAL_MODULES before its plugins and raises when that import fails (a plugin that fails
# is only logged at DEBUG): KTAE loads loudly in the driver whatever the entry point does.
export VERL_USE_EXTERNAL_MODULES="${VERL_USE_EXTERNAL_MODULES:+$VERL_USE_EXTERNAL_MODULES,}ktae_kernels.integrations.verl"
python3 -m ktae_kernels.integrations.verl --check "${COMMON[@]}" "${ALGO_ARGS[@]}" "$@"
exec python3 -m verl.trainer.main_ppo "${COMMON[@]}" "${ALGO_ARGS[@]}" "$@"
