//! What `grpo verl` does with each key of VeRL's trainer config: one table, one entry per key or
//! per section (`critic.*`), the most specific entry deciding. It covers the keys of every
//! release and engine in [`super::version::VERSIONS`] (a key only some of them have is read only
//! where it exists). `grpo verl --keys` prints it, and a test checks it against their defaults
//! (every VeRL key covered, no entry for a key no VeRL config has, every mapped key reaching the
//! recipe).

/// What becomes of one VeRL key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum How {
    /// The value goes to this recipe key as it is (grpo's enums keep VeRL's names).
    Map(&'static str),
    /// Read by a rule of `translate` (sizes, devices, loggers, ...), described here.
    Rule(&'static str),
    /// Accepted; when its value differs from VeRL's default, a note says why it changes nothing
    /// here.
    NoEffect(&'static str),
    /// A value other than VeRL's default is an error with this reason and the nearest thing
    /// grpo has.
    Unsupported(&'static str),
}

/// One row: a dotted VeRL key, or a section ending in `.*`.
#[derive(Clone, Copy, Debug)]
pub struct Entry {
    pub key: &'static str,
    pub how: How,
}

/// Keys VeRL reads that its config does not list: users add them with Hydra's `+key=value`
/// (`target_parameters` is a field of VeRL's model dataclass, absent from its YAML).
pub const ADDED_KEYS: &[&str] = &[
    "actor_rollout_ref.model.target_parameters",
    "custom_reward_function.reward_kwargs.*",
    "reward.custom_reward_function.reward_kwargs.*",
    "reward.reward_kwargs.*",
    "reward_model.reward_kwargs.*",
];

const PROFILER: How = How::NoEffect(
    "PyTorch / Nsight / NPU profiling; grpo reports each phase's time as `timing_s/*` metrics, and \
     `grpo compile` the cost of its programs",
);
const FSDP: How = How::NoEffect(
    "PyTorch FSDP wrapping, offload and compile settings; grpo's learner is sharded by XLA over \
     the devices of the size rule (`actor.strategy: fsdp`), keeping f32 master weights",
);
const REF: How = How::NoEffect(
    "the reference policy lives in the learner's process with the learner's layout, and its \
     log-probs are computed in the learner's micro-batches (`actor.ppo_micro_batch_size`)",
);
const CRITIC: How = How::NoEffect(
    "a setting of VeRL's critic worker (FSDP wrapping and offload, profiling, checkpoint contents, \
     shuffling, forward batch sizes); grpo's critic (`adv_estimator=gae`) runs on the learner's \
     devices and mesh, and its checkpoint is part of each checkpoint",
);
const CRITIC_RULE: How = How::Rule(
    "with `algorithm.adv_estimator=gae` -> the recipe's `critic` key of the same name (else no \
     effect: VeRL builds a critic only for gae)",
);
const LOG_PROB_BATCH: How = How::NoEffect(
    "log-probs are computed in the learner's micro-batches (`actor.ppo_micro_batch_size`, from \
     `ppo_micro_batch_size_per_gpu` by the size rule)",
);
const VLLM: How = How::NoEffect(
    "a setting of vLLM / SGLang; grpo generates with its own engine (continuous batching on the \
     same compiled programs as the learner), sized by `rollout.max_num_seqs`",
);
const MTP: How = How::Unsupported("multi-token prediction is not in grpo");
const LORA_EXCLUDE: How = How::Unsupported(
    "grpo's LoRA names the adapted projections with `target_modules` only; list the projections to adapt there",
);
const MULTI_TURN: How = How::Unsupported(
    "grpo's multi-turn rollouts run the tools of `rollout.multi_turn.tools` and \
     `rollout.multi_turn.tool_config_path` (built-ins, JSON-lines commands, HTTP endpoints) and the \
     interactions of \
     `rollout.multi_turn.interaction_config_path`, or your own agent program through an \
     OpenAI-compatible endpoint (`rollout.multi_turn.agent`); VeRL's Python agent loop classes \
     and repeated rollouts are not in grpo",
);
const NEVER_RETOKENIZED: How = How::NoEffect(
    "grpo never renders or tokenizes a finished turn again: it trains on the ids it sampled, \
     joined with the tool messages' ids rendered once",
);
const SEQUENCE_SPLIT: How = How::Rule(
    "size rule: grpo does not split a sequence over devices (Ulysses, context parallelism); the \
     devices go to FSDP, each data device holding whole sequences (a note says so)",
);
const PIPELINE: How = How::Rule(
    "size rule: grpo does not pipeline; the devices go to FSDP, every layer sharded over them and \
     gathered when it runs (a note says so)",
);
const EXPERT_SPLIT: How = How::Rule(
    "size rule: must divide the devices; grpo splits the experts by expert over the \
     tensor-parallel devices and by width over the FSDP ones (every device storing 1/devices of \
     them) instead of exchanging tokens (a note says so)",
);
const TENSOR: How = How::Rule("size rule: -> actor.tensor_model_parallel_size (must divide the devices)");
const DTYPE: How = How::Rule(
    "bfloat16 (VeRL's default) -> actor.param_dtype: auto (bf16 where the device computes bf16 \
     natively, f32 elsewhere: an AVX2 CPU emulates bf16, slower than f32); float32/fp32 -> f32",
);
const MEGATRON: How = How::NoEffect(
    "a setting of Megatron-LM (offload, distributed optimizer and checkpoints, bridge, padding, \
     kernels); grpo's learner is sharded by XLA over the devices of the size rule, keeping f32 \
     master weights; recomputation is `enable_gradient_checkpointing`",
);
const VEOMNI: How = How::NoEffect(
    "a setting of VeOmni (offload, sharding, kernel implementations); grpo's learner is sharded by \
     XLA over the devices of the size rule, keeping f32 master weights",
);
const TORCHTITAN: How = How::NoEffect(
    "a setting of TorchTitan (sharding, offload, compile, attention kernel); grpo's learner is \
     sharded by XLA over the devices of the size rule, keeping f32 master weights",
);
const QAT: How = How::NoEffect("read only with `qat.enable`, which grpo refuses");
const QAT_ENABLE: How =
    How::Unsupported("quantization-aware training is not in grpo; it trains in bf16 or f32");
const ROUTER_REPLAY: How = How::Rule(
    "router replay rule: -> actor.router_replay.mode (disabled, R2 or R3), from this key or the \
     engine's own (megatron. / veomni.router_replay.mode), whichever is set away from disabled; \
     two that disagree are refused",
);
const MOE_LOAD: How = How::NoEffect(
    "grpo reports a mixture-of-experts model's expert load every step, from the learner's pass \
     (actor/router_load_max, actor/router_entropy, actor/router_aux_loss)",
);
const REPLAY_FILES: How = How::Unsupported(
    "grpo keeps recorded routes with their samples, in memory, not in files; R2 and R3 need none",
);
const REF_REPLAY: How = How::NoEffect(
    "the reference pass replays the experts the actor's update replays (actor.router_replay.mode)",
);
const SCHEDULE: How = How::Rule(
    "-> actor.optim.lr_scheduler_type (constant or cosine; others are refused), with the cosine's \
     floor -> actor.optim.min_lr_ratio (an absolute floor over `lr`)",
);
const FIXED_WARMUP: How = How::Unsupported(
    "grpo's warmup rises linearly from 0 (constant) or the cosine's floor, and the cosine decays \
     over all the run's optimizer steps after it",
);
const MASTER_F32: How = How::Unsupported("grpo keeps gradients and AdamW's moments in f32");
const MUON: How =
    How::NoEffect("read only with Megatron's `optimizer: muon`, which grpo refuses (its optimizer is AdamW)");
const DISTILLATION: How = How::NoEffect("read only with `distillation.enabled`, which grpo refuses");
const TRANSFER_QUEUE: How = How::NoEffect("read only with `transfer_queue.enable`, which grpo refuses");
const SKIP: How = How::Unsupported(
    "grpo generates every step's rollouts; a run's samples are a function of the recipe and the step",
);
const V1_TRAINER: How = How::NoEffect(
    "a setting of VeRL's v1 trainer (its sync and async modes, replay sampler); grpo's own loop \
     overlaps rollout and update by `trainer.off_policy_steps` in a recipe",
);
const REWARD_ROLLOUT: How =
    How::NoEffect("the reward model's serving settings (vLLM / SGLang, its resource pool); grpo runs it as a `reward_model` scorer on the run's devices");
const REWARD_MODEL: How = How::Rule(
    "true -> a `reward_model` scorer (`reward.scorers.verl_reward_model`) that scores every sample \
     (`reward.scorer`), as VeRL's reward model does without a custom function; beside VeRL 0.7.1's \
     custom function (which calls it through VeRL's router) or a reward manager other than naive \
     and batch, refused",
);
const REWARD_MODEL_PATH: How = How::Rule("with the reward model enabled -> the scorer's path");
const SANDBOX: How = How::Unsupported("code execution in a Sandbox Fusion server is not in grpo; a `custom_reward_function` file can run the code itself");
const MEGATRON_LORA: How = How::Rule(
    "with model_engine=megatron and `rank` > 0 -> actor.lora_rank / lora_alpha / target_modules \
     (linear_qkv -> q,k,v_proj; linear_proj -> o_proj; linear_fc1 -> gate,up_proj; linear_fc2 -> \
     down_proj); VeRL's FSDP engine reads `lora_rank` instead",
);
const TEXT_ONLY: How = How::NoEffect("grpo trains text-only models; image and video columns are not read");
const MULTIMODAL: How = How::Rule(
    "set on the command line (to any value), refused: it says the data has images, video or audio, \
     and grpo trains text-only models (it would drop them and train a different task)",
);
const ENTROPY: How = How::NoEffect(
    "grpo computes the entropy from the logits it already holds, without chunking or recomputing",
);

#[rustfmt::skip]
pub const TABLE: &[Entry] = &[
    // actor_rollout_ref.actor.optim
    Entry { key: "actor_rollout_ref.actor.optim.optimizer", how: How::Unsupported("grpo's optimizer is AdamW") },
    Entry { key: "actor_rollout_ref.actor.optim.optimizer_impl", how: How::NoEffect("grpo's AdamW is its own, compiled into the update program") },
    Entry { key: "actor_rollout_ref.actor.optim.lr", how: How::Map("actor.optim.lr") },
    Entry { key: "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio", how: How::Rule("with `lr_warmup_steps: -1`, warmup = ratio x optimizer steps of the run (needs `trainer.total_training_steps`) -> actor.optim.lr_warmup_steps") },
    Entry { key: "actor_rollout_ref.actor.optim.total_training_steps", how: How::NoEffect("VeRL fills it in from the run's length; so does grpo") },
    Entry { key: "actor_rollout_ref.actor.optim.weight_decay", how: How::Map("actor.optim.weight_decay") },
    Entry { key: "actor_rollout_ref.actor.optim.lr_warmup_steps", how: How::Rule("-1 -> from `lr_warmup_steps_ratio`; else -> actor.optim.lr_warmup_steps") },
    Entry { key: "actor_rollout_ref.actor.optim.betas", how: How::Map("actor.optim.betas") },
    Entry { key: "actor_rollout_ref.actor.optim.clip_grad", how: How::Rule("-> actor.grad_clip (with `actor.grad_clip`, whichever is not VeRL's default 1.0)") },
    Entry { key: "actor_rollout_ref.actor.optim.min_lr_ratio", how: SCHEDULE },
    Entry { key: "actor_rollout_ref.actor.optim.num_cycles", how: How::Unsupported("grpo's cosine schedule runs half a cycle (VeRL's default 0.5)") },
    Entry { key: "actor_rollout_ref.actor.optim.lr_scheduler_type", how: SCHEDULE },
    // The optimizer keys of the Megatron, VeOmni and TorchTitan engines.
    Entry { key: "actor_rollout_ref.actor.optim.lr_decay_style", how: SCHEDULE },
    Entry { key: "actor_rollout_ref.actor.optim.min_lr", how: SCHEDULE },
    Entry { key: "actor_rollout_ref.actor.optim.lr_min", how: SCHEDULE },
    Entry { key: "actor_rollout_ref.actor.optim.decay_type", how: SCHEDULE },
    Entry { key: "actor_rollout_ref.actor.optim.min_lr_factor", how: SCHEDULE },
    Entry { key: "actor_rollout_ref.actor.optim.lr_warmup_init", how: FIXED_WARMUP },
    Entry { key: "actor_rollout_ref.actor.optim.lr_start", how: FIXED_WARMUP },
    Entry { key: "actor_rollout_ref.actor.optim.lr_decay_steps", how: FIXED_WARMUP },
    Entry { key: "actor_rollout_ref.actor.optim.lr_decay_ratio", how: FIXED_WARMUP },
    Entry { key: "actor_rollout_ref.actor.optim.lr_wsd_decay_style", how: How::NoEffect("read only with `lr_decay_style: WSD`, which grpo refuses") },
    Entry { key: "actor_rollout_ref.actor.optim.lr_wsd_decay_steps", how: How::NoEffect("read only with `lr_decay_style: WSD`, which grpo refuses") },
    Entry { key: "actor_rollout_ref.actor.optim.weight_decay_incr_style", how: How::Unsupported("grpo's weight decay is constant") },
    Entry { key: "actor_rollout_ref.actor.optim.zero_indexed_step", how: How::NoEffect("grpo counts optimizer steps from 0, as torch's LambdaLR does") },
    Entry { key: "actor_rollout_ref.actor.load_weight", how: How::NoEffect("grpo always starts from the weights at `model.path`") },
    Entry { key: "actor_rollout_ref.rollout.layer_name_map.*", how: VLLM },
    Entry { key: "actor_rollout_ref.actor.optim.use_checkpoint_opt_param_scheduler", how: How::NoEffect("a grpo checkpoint always holds the optimizer state and the schedule's step") },
    Entry { key: "actor_rollout_ref.actor.optim.use_precision_aware_optimizer", how: How::NoEffect("grpo keeps gradients and AdamW's moments in f32 (the dtypes below)") },
    Entry { key: "actor_rollout_ref.actor.optim.main_grads_dtype", how: MASTER_F32 },
    Entry { key: "actor_rollout_ref.actor.optim.exp_avg_dtype", how: MASTER_F32 },
    Entry { key: "actor_rollout_ref.actor.optim.exp_avg_sq_dtype", how: MASTER_F32 },
    Entry { key: "actor_rollout_ref.actor.optim.use_layer_wise_distributed_optimizer", how: How::NoEffect("grpo's optimizer state is sharded with the weights (FSDP)") },
    Entry { key: "actor_rollout_ref.actor.optim.name", how: How::Unsupported("grpo's optimizer is AdamW") },
    Entry { key: "actor_rollout_ref.actor.optim.eps", how: How::Map("actor.optim.eps") },
    Entry { key: "actor_rollout_ref.actor.optim.muon_momentum", how: MUON },
    Entry { key: "actor_rollout_ref.actor.optim.muon_nesterov", how: MUON },
    Entry { key: "actor_rollout_ref.actor.optim.muon_split_qkv", how: MUON },
    Entry { key: "actor_rollout_ref.actor.optim.muon_scale_mode", how: MUON },
    Entry { key: "actor_rollout_ref.actor.optim.muon_coefficient_type", how: MUON },
    Entry { key: "actor_rollout_ref.actor.optim.muon_num_ns_steps", how: MUON },
    Entry { key: "actor_rollout_ref.actor.optim.muon_tp_mode", how: MUON },
    Entry { key: "actor_rollout_ref.actor.optim.muon_fp32_matmul_prec", how: MUON },
    Entry { key: "actor_rollout_ref.actor.optim.muon_extra_scale_factor", how: MUON },
    Entry { key: "actor_rollout_ref.actor.optim.muon_scalar_optimizer", how: MUON },
    Entry { key: "actor_rollout_ref.actor.optim.muon_match_adamw_update_rms", how: MUON },
    Entry { key: "actor_rollout_ref.actor.optim.warmup_style", how: How::Rule("VeRL's older name of `lr_scheduler_type`; when set, -> actor.optim.lr_scheduler_type") },
    Entry { key: "actor_rollout_ref.actor.optim.override_optimizer_config", how: How::Unsupported("grpo's AdamW takes lr, betas, weight_decay and eps (`actor.optim` in a recipe)") },
    // actor_rollout_ref.actor
    Entry { key: "actor_rollout_ref.actor.fsdp_config.*", how: FSDP },
    Entry { key: "actor_rollout_ref.actor.fsdp_config.dtype", how: DTYPE },
    Entry { key: "actor_rollout_ref.actor.fsdp_config.turbo_config.distributed.tensor_parallel_size", how: How::Rule("with `strategy: fsdp_turbo`: size rule -> actor.tensor_model_parallel_size (must divide the devices)") },
    Entry { key: "actor_rollout_ref.actor.fsdp_config.turbo_config.distributed.ulysses_parallel_size", how: SEQUENCE_SPLIT },
    Entry { key: "actor_rollout_ref.actor.fsdp_config.turbo_config.distributed.expert_parallel_size", how: EXPERT_SPLIT },
    Entry { key: "actor_rollout_ref.actor.fsdp_config.qat.*", how: QAT },
    Entry { key: "actor_rollout_ref.actor.fsdp_config.qat.enable", how: QAT_ENABLE },
    // model_engine=megatron
    Entry { key: "actor_rollout_ref.actor.megatron.*", how: MEGATRON },
    Entry { key: "actor_rollout_ref.actor.megatron.dtype", how: DTYPE },
    Entry { key: "actor_rollout_ref.actor.megatron.tensor_model_parallel_size", how: TENSOR },
    Entry { key: "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size", how: PIPELINE },
    Entry { key: "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size", how: PIPELINE },
    Entry { key: "actor_rollout_ref.actor.megatron.context_parallel_size", how: SEQUENCE_SPLIT },
    Entry { key: "actor_rollout_ref.actor.megatron.expert_model_parallel_size", how: EXPERT_SPLIT },
    Entry { key: "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size", how: EXPERT_SPLIT },
    Entry { key: "actor_rollout_ref.actor.megatron.router_replay.mode", how: ROUTER_REPLAY },
    Entry { key: "actor_rollout_ref.actor.megatron.router_replay.record_file", how: REPLAY_FILES },
    Entry { key: "actor_rollout_ref.actor.megatron.router_replay.replay_file", how: REPLAY_FILES },
    Entry { key: "actor_rollout_ref.actor.megatron.qat.*", how: QAT },
    Entry { key: "actor_rollout_ref.actor.megatron.qat.enable", how: QAT_ENABLE },
    Entry { key: "actor_rollout_ref.actor.megatron.entropy_from_logits_with_chunking", how: ENTROPY },
    Entry { key: "actor_rollout_ref.actor.megatron.entropy_from_logits_chunk_size", how: ENTROPY },
    // model_engine=veomni
    Entry { key: "actor_rollout_ref.actor.veomni.*", how: VEOMNI },
    Entry { key: "actor_rollout_ref.actor.veomni.mixed_precision", how: How::Rule("true (VeRL's default) -> actor.param_dtype: auto (bf16 compute with f32 master weights where the device computes bf16 natively); false -> f32") },
    Entry { key: "actor_rollout_ref.actor.veomni.ulysses_parallel_size", how: SEQUENCE_SPLIT },
    Entry { key: "actor_rollout_ref.actor.veomni.expert_parallel_size", how: EXPERT_SPLIT },
    Entry { key: "actor_rollout_ref.actor.veomni.router_replay.mode", how: ROUTER_REPLAY },
    Entry { key: "actor_rollout_ref.actor.veomni.entropy_from_logits_with_chunking", how: ENTROPY },
    Entry { key: "actor_rollout_ref.actor.veomni.entropy_checkpointing", how: ENTROPY },
    // model_engine=torchtitan
    Entry { key: "actor_rollout_ref.actor.torchtitan.*", how: TORCHTITAN },
    Entry { key: "actor_rollout_ref.actor.torchtitan.dtype", how: DTYPE },
    Entry { key: "actor_rollout_ref.actor.torchtitan.tensor_parallel_size", how: TENSOR },
    Entry { key: "actor_rollout_ref.actor.torchtitan.pipeline_parallel_size", how: PIPELINE },
    Entry { key: "actor_rollout_ref.actor.torchtitan.context_parallel_size", how: SEQUENCE_SPLIT },
    Entry { key: "actor_rollout_ref.actor.torchtitan.expert_parallel_size", how: EXPERT_SPLIT },
    Entry { key: "actor_rollout_ref.actor.torchtitan.entropy_from_logits_with_chunking", how: ENTROPY },
    Entry { key: "actor_rollout_ref.actor.torchtitan.entropy_from_logits_chunk_size", how: ENTROPY },
    Entry { key: "actor_rollout_ref.actor.torchtitan.entropy_checkpointing", how: ENTROPY },
    Entry { key: "actor_rollout_ref.actor.qat.*", how: QAT },
    Entry { key: "actor_rollout_ref.actor.qat.enable", how: QAT_ENABLE },
    Entry { key: "actor_rollout_ref.actor.entropy_from_logits_chunk_size", how: ENTROPY },
    Entry { key: "actor_rollout_ref.actor.pad_to_length", how: How::NoEffect("grpo pads each micro-batch to a length bucket (`actor.length_bucket`)") },
    Entry { key: "actor_rollout_ref.actor.policy_loss.dro_beta", how: How::NoEffect("read only with `loss_mode: dro`, which grpo does not have (its loss modes are refused by name)") },
    Entry { key: "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size", how: SEQUENCE_SPLIT },
    Entry { key: "actor_rollout_ref.actor.rollout_n", how: How::NoEffect("VeRL copies it from `rollout.n`, which grpo reads") },
    Entry { key: "actor_rollout_ref.actor.strategy", how: How::Rule("the engine's own (fsdp, fsdp2 or fsdp_turbo with model_engine=dp, else the engine's name) -> the learner is sharded over the devices of the size rule") },
    Entry { key: "actor_rollout_ref.actor.ppo_mini_batch_size", how: How::Map("actor.ppo_mini_batch_size") },
    Entry { key: "actor_rollout_ref.actor.ppo_micro_batch_size", how: How::Rule("size rule: global sequences per pass (VeRL's older form of `ppo_micro_batch_size_per_gpu`)") },
    Entry { key: "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", how: How::Rule("size rule: x devices -> actor.ppo_micro_batch_size") },
    Entry { key: "actor_rollout_ref.actor.use_dynamic_bsz", how: How::Rule("size rule: micro-batches from `ppo_max_token_len_per_gpu`") },
    Entry { key: "actor_rollout_ref.actor.ppo_max_token_len_per_gpu", how: How::Rule("size rule: with `use_dynamic_bsz`, tokens per device per pass / (max prompt + response length) sequences") },
    Entry { key: "actor_rollout_ref.actor.clip_ratio", how: How::Rule("with a loss that clips the ratio (not sapo, gpg or kl_cov) -> actor.clip_ratio_low / clip_ratio_high where those are null (as in VeRL); else no effect") },
    Entry { key: "actor_rollout_ref.actor.clip_ratio_low", how: How::Rule("with a loss that clips the ratio (not sapo, gpg or kl_cov) -> actor.clip_ratio_low (null: `clip_ratio`); else no effect") },
    Entry { key: "actor_rollout_ref.actor.clip_ratio_high", how: How::Rule("with a loss that clips the ratio (not sapo, gpg or kl_cov) -> actor.clip_ratio_high (null: `clip_ratio`); else no effect") },
    Entry { key: "actor_rollout_ref.actor.tau_pos", how: How::Rule("with `policy_loss.loss_mode=sapo` -> actor.tau_pos (else no effect, as in VeRL)") },
    Entry { key: "actor_rollout_ref.actor.tau_neg", how: How::Rule("with `policy_loss.loss_mode=sapo` -> actor.tau_neg (else no effect, as in VeRL)") },
    Entry { key: "actor_rollout_ref.actor.freeze_vision_tower", how: TEXT_ONLY },
    Entry { key: "actor_rollout_ref.actor.policy_loss.loss_mode", how: How::Map("actor.policy_loss.loss_mode") },
    Entry { key: "actor_rollout_ref.actor.policy_loss.clip_cov_ratio", how: How::Rule("with `loss_mode=clip_cov` -> actor.policy_loss.clip_cov_ratio (else no effect, as in VeRL)") },
    Entry { key: "actor_rollout_ref.actor.policy_loss.clip_cov_lb", how: How::Rule("with `loss_mode=clip_cov` -> actor.policy_loss.clip_cov_lb (else no effect, as in VeRL)") },
    Entry { key: "actor_rollout_ref.actor.policy_loss.clip_cov_ub", how: How::Rule("with `loss_mode=clip_cov` -> actor.policy_loss.clip_cov_ub (else no effect, as in VeRL)") },
    Entry { key: "actor_rollout_ref.actor.policy_loss.kl_cov_ratio", how: How::Rule("with `loss_mode=kl_cov` -> actor.policy_loss.kl_cov_ratio (else no effect, as in VeRL)") },
    Entry { key: "actor_rollout_ref.actor.policy_loss.ppo_kl_coef", how: How::Rule("with `loss_mode=kl_cov` -> actor.policy_loss.ppo_kl_coef (else no effect, as in VeRL)") },
    Entry { key: "actor_rollout_ref.actor.clip_ratio_c", how: How::Rule("with `policy_loss.loss_mode=vanilla` (PPO's dual clip) -> actor.clip_ratio_c (else no effect, as in VeRL)") },
    Entry { key: "actor_rollout_ref.actor.loss_agg_mode", how: How::Map("actor.loss_agg_mode") },
    Entry { key: "actor_rollout_ref.actor.loss_scale_factor", how: How::Unsupported("grpo scales the loss by `loss_agg_mode` alone") },
    Entry { key: "actor_rollout_ref.actor.entropy_coeff", how: How::Map("actor.entropy_coeff") },
    Entry { key: "actor_rollout_ref.actor.calculate_entropy", how: How::NoEffect("grpo always reports `actor/entropy`") },
    Entry { key: "actor_rollout_ref.actor.use_kl_loss", how: How::Map("actor.use_kl_loss") },
    Entry { key: "actor_rollout_ref.actor.use_prefix_grouper", how: How::NoEffect("grpo already runs each prompt once for its whole group (shared-prompt packing)") },
    Entry { key: "actor_rollout_ref.actor.use_torch_compile", how: How::NoEffect("grpo's programs are compiled by XLA") },
    Entry { key: "actor_rollout_ref.actor.kl_loss_coef", how: How::Map("actor.kl_loss_coef") },
    Entry { key: "actor_rollout_ref.actor.kl_loss_type", how: How::Map("actor.kl_loss_type") },
    Entry { key: "actor_rollout_ref.actor.ppo_epochs", how: How::Map("actor.ppo_epochs") },
    Entry { key: "actor_rollout_ref.actor.shuffle", how: How::Unsupported("grpo's mini-batches keep the rollout's order") },
    Entry { key: "actor_rollout_ref.actor.data_loader_seed", how: How::NoEffect("read only with `actor.shuffle`") },
    Entry { key: "actor_rollout_ref.actor.checkpoint.*", how: How::NoEffect("a grpo checkpoint always holds the weights, the optimizer state and the data position, written atomically") },
    Entry { key: "actor_rollout_ref.actor.use_fused_kernels", how: How::NoEffect("XLA fuses grpo's programs") },
    Entry { key: "actor_rollout_ref.actor.profiler.*", how: PROFILER },
    Entry { key: "actor_rollout_ref.actor.router_replay.mode", how: ROUTER_REPLAY },
    Entry { key: "actor_rollout_ref.actor.router_replay.record_file", how: REPLAY_FILES },
    Entry { key: "actor_rollout_ref.actor.router_replay.replay_file", how: REPLAY_FILES },
    Entry { key: "actor_rollout_ref.actor.grad_clip", how: How::Rule("-> actor.grad_clip (with `optim.clip_grad`, whichever is not VeRL's default 1.0)") },
    Entry { key: "actor_rollout_ref.actor.ulysses_sequence_parallel_size", how: SEQUENCE_SPLIT },
    Entry { key: "actor_rollout_ref.actor.entropy_from_logits_with_chunking", how: ENTROPY },
    Entry { key: "actor_rollout_ref.actor.entropy_checkpointing", how: ENTROPY },
    Entry { key: "actor_rollout_ref.actor.use_remove_padding", how: How::NoEffect("grpo packs each group's prompt once and pads only to length buckets (`actor.length_bucket`)") },
    Entry { key: "actor_rollout_ref.actor.calculate_sum_pi_squared", how: How::NoEffect("a statistic for VeRL's optimal-baseline estimators, which grpo does not have") },
    Entry { key: "actor_rollout_ref.actor.sum_pi_squared_checkpointing", how: How::NoEffect("a statistic for VeRL's optimal-baseline estimators, which grpo does not have") },
    // actor_rollout_ref.ref
    Entry { key: "actor_rollout_ref.ref.*", how: REF },
    Entry { key: "actor_rollout_ref.ref.log_prob_micro_batch_size", how: LOG_PROB_BATCH },
    Entry { key: "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", how: LOG_PROB_BATCH },
    Entry { key: "actor_rollout_ref.ref.profiler.*", how: PROFILER },
    Entry { key: "actor_rollout_ref.ref.router_replay.*", how: REF_REPLAY },
    Entry { key: "actor_rollout_ref.ref.fsdp_config.*", how: FSDP },
    // actor_rollout_ref.rollout
    Entry { key: "actor_rollout_ref.rollout.name", how: How::NoEffect("grpo generates with its own engine (continuous batching on the same compiled programs as the learner), not vLLM or SGLang") },
    Entry { key: "actor_rollout_ref.rollout.mode", how: How::NoEffect("grpo's engine batches continuously in either mode") },
    Entry { key: "actor_rollout_ref.rollout.temperature", how: How::Map("rollout.temperature") },
    Entry { key: "actor_rollout_ref.rollout.top_k", how: How::Map("rollout.top_k") },
    Entry { key: "actor_rollout_ref.rollout.top_p", how: How::Map("rollout.top_p") },
    Entry { key: "actor_rollout_ref.rollout.prompt_length", how: How::NoEffect("VeRL copies it from `data.max_prompt_length`, which grpo reads") },
    Entry { key: "actor_rollout_ref.rollout.response_length", how: How::NoEffect("VeRL copies it from `data.max_response_length`, which grpo reads") },
    Entry { key: "actor_rollout_ref.rollout.dtype", how: How::Rule("bfloat16 (VeRL's default) -> rollout.dtype: auto (bf16 where the device computes bf16 natively, f32 elsewhere); float32/fp32 -> f32") },
    Entry { key: "actor_rollout_ref.rollout.gpu_memory_utilization", how: How::NoEffect("it sizes vLLM's KV cache; grpo's is sized by `rollout.max_num_seqs` x (prompt + response length)") },
    Entry { key: "actor_rollout_ref.rollout.ignore_eos", how: How::Unsupported("grpo's responses end at the model's EOS tokens and `rollout.stop` strings") },
    Entry { key: "actor_rollout_ref.rollout.enforce_eager", how: VLLM },
    Entry { key: "actor_rollout_ref.rollout.cudagraph_capture_sizes", how: VLLM },
    Entry { key: "actor_rollout_ref.rollout.free_cache_engine", how: VLLM },
    Entry { key: "actor_rollout_ref.rollout.tensor_model_parallel_size", how: How::Map("rollout.tensor_model_parallel_size") },
    Entry { key: "actor_rollout_ref.rollout.data_parallel_size", how: How::NoEffect("a grpo rollout engine spreads its sequences over all the devices it is given, in groups of `tensor_model_parallel_size` (its data parallelism is the devices over that); a sample does not depend on which group runs it") },
    Entry {
        key: "actor_rollout_ref.rollout.expert_parallel_size",
        how: How::Rule(
            "expert rule: must divide rollout.tensor_model_parallel_size, over whose devices grpo's \
             rollout splits the experts by expert (a note says so); larger is refused",
        ),
    },
    Entry { key: "actor_rollout_ref.rollout.pipeline_model_parallel_size", how: How::Unsupported("pipeline parallelism is not in grpo; use `rollout.tensor_model_parallel_size`") },
    Entry { key: "actor_rollout_ref.rollout.max_num_batched_tokens", how: VLLM },
    Entry { key: "actor_rollout_ref.rollout.max_model_len", how: VLLM },
    Entry { key: "actor_rollout_ref.rollout.max_num_seqs", how: How::Rule("-> rollout.max_num_seqs, capped at the sequences of one step (train_batch_size x n): vLLM never holds more than it is given, and grpo allocates KV cache for every slot") },
    Entry { key: "actor_rollout_ref.rollout.enable_chunked_prefill", how: VLLM },
    Entry { key: "actor_rollout_ref.rollout.enable_prefix_caching", how: How::NoEffect("grpo prefills each prompt once for its whole group") },
    Entry { key: "actor_rollout_ref.rollout.logprobs_mode", how: VLLM },
    Entry { key: "actor_rollout_ref.rollout.scheduling_policy", how: VLLM },
    Entry { key: "actor_rollout_ref.rollout.load_format", how: How::NoEffect("grpo's engine takes the learner's weights on the devices; nothing is loaded from disk") },
    Entry { key: "actor_rollout_ref.rollout.log_prob_micro_batch_size", how: LOG_PROB_BATCH },
    Entry { key: "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", how: LOG_PROB_BATCH },
    Entry { key: "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz", how: LOG_PROB_BATCH },
    Entry { key: "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", how: LOG_PROB_BATCH },
    Entry { key: "actor_rollout_ref.rollout.disable_log_stats", how: VLLM },
    Entry { key: "actor_rollout_ref.rollout.do_sample", how: How::Rule("false -> rollout.temperature: 0 (greedy)") },
    Entry { key: "actor_rollout_ref.rollout.n", how: How::Map("rollout.n") },
    Entry { key: "actor_rollout_ref.rollout.over_sample_rate", how: How::Unsupported("grpo waits for every response of a step") },
    Entry { key: "actor_rollout_ref.rollout.multi_stage_wake_up", how: VLLM },
    Entry { key: "actor_rollout_ref.rollout.engine_kwargs.*", how: VLLM },
    Entry { key: "actor_rollout_ref.rollout.val_kwargs.top_k", how: How::Map("rollout.val_kwargs.top_k") },
    Entry { key: "actor_rollout_ref.rollout.val_kwargs.top_p", how: How::Map("rollout.val_kwargs.top_p") },
    Entry { key: "actor_rollout_ref.rollout.val_kwargs.temperature", how: How::Map("rollout.val_kwargs.temperature") },
    Entry { key: "actor_rollout_ref.rollout.val_kwargs.n", how: How::Map("rollout.val_kwargs.n") },
    Entry { key: "actor_rollout_ref.rollout.val_kwargs.do_sample", how: How::Map("rollout.val_kwargs.do_sample") },
    Entry { key: "actor_rollout_ref.rollout.multi_turn.*", how: MULTI_TURN },
    Entry { key: "actor_rollout_ref.rollout.multi_turn.enable", how: How::Map("rollout.multi_turn.enable") },
    Entry { key: "actor_rollout_ref.rollout.multi_turn.max_assistant_turns", how: How::Map("rollout.multi_turn.max_assistant_turns") },
    Entry { key: "actor_rollout_ref.rollout.multi_turn.max_parallel_calls", how: How::Map("rollout.multi_turn.max_parallel_calls") },
    Entry { key: "actor_rollout_ref.rollout.multi_turn.max_tool_response_length", how: How::Map("rollout.multi_turn.max_tool_response_length") },
    Entry { key: "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side", how: How::Map("rollout.multi_turn.tool_response_truncate_side") },
    Entry { key: "actor_rollout_ref.rollout.multi_turn.format", how: How::Map("rollout.multi_turn.format") },
    Entry { key: "actor_rollout_ref.rollout.multi_turn.tool_config_path", how: How::Map("rollout.multi_turn.tool_config_path") },
    Entry { key: "actor_rollout_ref.rollout.multi_turn.interaction_config_path", how: How::Map("rollout.multi_turn.interaction_config_path") },
    Entry { key: "actor_rollout_ref.rollout.multi_turn.max_user_turns", how: How::Map("rollout.multi_turn.max_user_turns") },
    Entry { key: "actor_rollout_ref.rollout.multi_turn.use_inference_chat_template", how: NEVER_RETOKENIZED },
    Entry { key: "actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode", how: NEVER_RETOKENIZED },
    Entry { key: "actor_rollout_ref.rollout.calculate_log_probs", how: How::NoEffect("grpo's engine always returns the log-probs of what it sampled") },
    Entry { key: "actor_rollout_ref.rollout.agent.*", how: MULTI_TURN },
    Entry { key: "actor_rollout_ref.rollout.agent.num_workers", how: How::NoEffect("grpo's engine runs in the orchestrator's process (or in `cluster.rollout_workers`)") },
    Entry { key: "actor_rollout_ref.rollout.checkpoint_engine.*", how: How::NoEffect("grpo passes the learner's weights to its engine on the devices, in one step") },
    Entry { key: "actor_rollout_ref.rollout.trace.*", how: How::NoEffect("grpo writes each validation's answers to its output directory, and `trainer.log_val_generations` to the trackers") },
    Entry { key: "actor_rollout_ref.rollout.skip_rollout", how: How::Unsupported("grpo generates every step's rollouts") },
    Entry { key: "actor_rollout_ref.rollout.skip_dump_dir", how: How::NoEffect("read only with `skip_rollout`") },
    Entry { key: "actor_rollout_ref.rollout.skip_tokenizer_init", how: VLLM },
    Entry {
        key: "actor_rollout_ref.rollout.enable_rollout_routing_replay",
        how: How::Map("rollout.enable_rollout_routing_replay"),
    },
    Entry { key: "actor_rollout_ref.rollout.moe_load_balance_metrics_interval", how: MOE_LOAD },
    Entry { key: "actor_rollout_ref.rollout.disaggregation.*", how: VLLM },
    Entry { key: "actor_rollout_ref.rollout.full_determinism", how: How::NoEffect("grpo's rollouts are always deterministic: a run's samples are a function of the recipe and the step") },
    Entry { key: "actor_rollout_ref.rollout.seed", how: How::NoEffect("grpo seeds sampling from `trainer.seed`, the step and the sample, so a resumed run samples alike") },
    Entry { key: "actor_rollout_ref.rollout.nnodes", how: How::NoEffect("the size of a separate rollout pool in VeRL's async trainers; grpo's rollout shares the learner's devices unless a recipe gives it `cluster.rollout_workers`") },
    Entry { key: "actor_rollout_ref.rollout.n_gpus_per_node", how: How::NoEffect("the size of a separate rollout pool in VeRL's async trainers; grpo's rollout shares the learner's devices unless a recipe gives it `cluster.rollout_workers`") },
    Entry { key: "actor_rollout_ref.rollout.qat", how: How::NoEffect("VeRL copies it from the actor's `qat`, which grpo refuses when enabled") },
    Entry { key: "actor_rollout_ref.rollout.profiler.*", how: PROFILER },
    Entry { key: "actor_rollout_ref.rollout.prometheus.*", how: How::NoEffect("grpo's engine reports to the run's metrics, not Prometheus") },
    Entry { key: "actor_rollout_ref.rollout.quantization", how: How::Unsupported("quantized rollouts are not in grpo; the engine computes in `rollout.dtype` (bf16 or f32)") },
    Entry { key: "actor_rollout_ref.rollout.quantization_config_file", how: How::Unsupported("quantized rollouts are not in grpo; the engine computes in `rollout.dtype` (bf16 or f32)") },
    Entry { key: "actor_rollout_ref.rollout.mtp", how: MTP },
    Entry { key: "actor_rollout_ref.rollout.layered_summon", how: How::NoEffect("grpo passes the learner's weights to its engine on the devices, in one step") },
    // actor_rollout_ref.model
    Entry { key: "actor_rollout_ref.model.path", how: How::Map("model.path") },
    Entry { key: "actor_rollout_ref.model.hf_config_path", how: How::Unsupported("grpo reads config.json beside the weights (or the GGUF's own metadata)") },
    Entry { key: "actor_rollout_ref.model.tokenizer_path", how: How::Map("model.tokenizer") },
    Entry { key: "actor_rollout_ref.model.use_shm", how: How::NoEffect("grpo reads the model from its path directly") },
    Entry { key: "actor_rollout_ref.model.trust_remote_code", how: How::NoEffect("grpo runs no Python code from a checkpoint; its architectures are built in") },
    Entry { key: "actor_rollout_ref.model.custom_chat_template", how: How::Unsupported("grpo reads a chat template from a file: write it to one and set `model.chat_template` in a recipe (`--print-recipe` gives one)") },
    Entry { key: "actor_rollout_ref.model.external_lib", how: How::Unsupported("grpo runs no Python model code; its architectures are built in (Llama, Qwen2, Qwen3, ...)") },
    Entry { key: "actor_rollout_ref.model.override_config.*", how: How::Unsupported("grpo builds the model from its config.json as it is") },
    Entry { key: "actor_rollout_ref.model.enable_gradient_checkpointing", how: How::Map("model.enable_gradient_checkpointing") },
    Entry { key: "actor_rollout_ref.model.enable_activation_offload", how: How::NoEffect("grpo keeps activations on the device; `enable_gradient_checkpointing` is how it saves their memory") },
    Entry { key: "actor_rollout_ref.model.use_remove_padding", how: How::NoEffect("grpo packs each group's prompt once and pads only to length buckets (`actor.length_bucket`)") },
    Entry { key: "actor_rollout_ref.model.lora_rank", how: How::Map("actor.lora_rank") },
    Entry { key: "actor_rollout_ref.model.lora_alpha", how: How::Map("actor.lora_alpha") },
    Entry { key: "actor_rollout_ref.model.target_modules", how: How::Map("actor.target_modules") },
    Entry { key: "actor_rollout_ref.model.target_parameters", how: How::Map("actor.target_parameters") },
    Entry { key: "actor_rollout_ref.model.exclude_modules", how: LORA_EXCLUDE },
    Entry { key: "actor_rollout_ref.model.lora_adapter_path", how: How::Map("model.lora_adapter_path") },
    Entry { key: "actor_rollout_ref.model.use_liger", how: How::NoEffect("XLA fuses grpo's programs") },
    Entry { key: "actor_rollout_ref.model.use_fused_kernels", how: How::NoEffect("XLA fuses grpo's programs") },
    Entry { key: "actor_rollout_ref.model.fused_kernel_options.*", how: How::NoEffect("XLA fuses grpo's programs") },
    Entry { key: "actor_rollout_ref.model.tiled_mlp.*", how: How::NoEffect("XLA schedules the MLP's memory; `enable_gradient_checkpointing` is how grpo saves activation memory") },
    Entry { key: "actor_rollout_ref.model.mtp.*", how: MTP },
    Entry { key: "actor_rollout_ref.model.lora.*", how: How::Unsupported("Megatron-Bridge LoRA settings grpo's LoRA does not have (rank, alpha, target modules and an adapter path are all it takes)") },
    Entry { key: "actor_rollout_ref.model.lora.rank", how: MEGATRON_LORA },
    Entry { key: "actor_rollout_ref.model.lora.alpha", how: MEGATRON_LORA },
    Entry { key: "actor_rollout_ref.model.lora.target_modules", how: MEGATRON_LORA },
    Entry { key: "actor_rollout_ref.model.lora.adapter_path", how: MEGATRON_LORA },
    Entry { key: "actor_rollout_ref.model.lora.merge", how: How::NoEffect("grpo chooses merged or applied adapters per device (`actor.lora_form` in a recipe)") },
    Entry { key: "actor_rollout_ref.model.lora.dtype", how: How::NoEffect("grpo's adapters train in f32 beside the base weights' compute type") },
    Entry { key: "actor_rollout_ref.model.lora.freeze_vision_model", how: TEXT_ONLY },
    Entry { key: "actor_rollout_ref.model.lora.freeze_vision_projection", how: TEXT_ONLY },
    Entry { key: "actor_rollout_ref.model.lora.a2a_experimental", how: How::NoEffect("a Megatron communication setting") },
    Entry { key: "actor_rollout_ref.hybrid_engine", how: How::NoEffect("grpo's rollout shares the learner's devices unless a recipe gives it `cluster.rollout_workers`") },
    Entry { key: "actor_rollout_ref.nccl_timeout", how: How::NoEffect("grpo's collectives are XLA's, inside its programs") },
    // data
    Entry { key: "data.tokenizer", how: How::Rule("-> model.tokenizer when `actor_rollout_ref.model.tokenizer_path` is null") },
    Entry { key: "data.use_shm", how: How::NoEffect("grpo reads the Parquet files from their paths directly") },
    Entry { key: "data.train_files", how: How::Map("data.train_files") },
    Entry { key: "data.val_files", how: How::Map("data.val_files") },
    Entry { key: "data.train_max_samples", how: How::Map("data.train_max_samples") },
    Entry { key: "data.val_max_samples", how: How::Map("data.val_max_samples") },
    Entry { key: "data.prompt_key", how: How::Map("data.prompt_key") },
    Entry { key: "data.reward_fn_key", how: How::Map("data.reward_fn_key") },
    Entry { key: "data.max_prompt_length", how: How::Map("data.max_prompt_length") },
    Entry { key: "data.max_response_length", how: How::Map("data.max_response_length") },
    Entry { key: "data.train_batch_size", how: How::Map("data.train_batch_size") },
    Entry { key: "data.val_batch_size", how: How::Map("data.val_batch_size") },
    Entry { key: "data.tool_config_path", how: MULTI_TURN },
    Entry { key: "data.return_raw_input_ids", how: How::NoEffect("grpo tokenizes prompts once, with the policy's tokenizer") },
    Entry { key: "data.return_raw_chat", how: How::NoEffect("grpo applies the chat template itself, once per prompt") },
    Entry { key: "data.return_full_prompt", how: How::NoEffect("grpo applies the chat template itself, once per prompt") },
    Entry { key: "data.shuffle", how: How::Map("data.shuffle") },
    Entry { key: "data.seed", how: How::Rule("-> data.seed (null: 1, as VeRL falls back to)") },
    Entry { key: "data.dataloader_num_workers", how: How::NoEffect("grpo reads and tokenizes the dataset once, when the run starts") },
    Entry { key: "data.image_patch_size", how: MULTIMODAL },
    Entry { key: "data.validation_shuffle", how: How::Map("data.validation_shuffle") },
    Entry { key: "data.filter_overlong_prompts", how: How::Map("data.filter_overlong_prompts") },
    Entry { key: "data.filter_overlong_prompts_workers", how: How::NoEffect("grpo filters while it tokenizes, once") },
    Entry { key: "data.truncation", how: How::Map("data.truncation") },
    Entry { key: "data.image_key", how: MULTIMODAL },
    Entry { key: "data.video_key", how: MULTIMODAL },
    Entry { key: "data.trust_remote_code", how: How::NoEffect("grpo runs no Python code from a checkpoint") },
    Entry { key: "data.custom_cls.*", how: How::Unsupported("grpo reads VeRL's Parquet schema (or TRL's prompt-only one) itself; `grpo preprocess` converts other data") },
    Entry { key: "data.return_multi_modal_inputs", how: TEXT_ONLY },
    Entry { key: "data.sampler.*", how: How::Unsupported("grpo draws batches in order or shuffled (`data.shuffle`); curriculum samplers are not in grpo") },
    Entry { key: "data.datagen.*", how: How::Unsupported("grpo trains on the Parquet files it is given; generated datasets are not in grpo") },
    Entry { key: "data.gen_batch_size", how: How::Map("data.gen_batch_size") },
    Entry { key: "data.audio_key", how: MULTIMODAL },
    Entry { key: "data.mm_processor_kwargs", how: MULTIMODAL },
    Entry { key: "data.function_tool_path", how: MULTI_TURN },
    Entry { key: "data.apply_chat_template_kwargs.*", how: How::Rule("each keyword -> data.apply_chat_template_kwargs, the variables every prompt and turn passes to the chat template (Qwen3's `enable_thinking`); one the template does not read is refused when the run starts") },
    // reward
    // reward, VeRL 0.7.0 and earlier (top-level sections)
    Entry { key: "reward_manager.source", how: How::Unsupported("grpo's reward managers are VeRL's registered `naive`, `batch` and `dapo`") },
    Entry { key: "reward_manager.name", how: How::Rule("naive / batch -> reward.custom_reward_function.reward_manager; dapo -> naive, with `reward_model.reward_kwargs.overlong_buffer_cfg` -> reward.overlong_buffer; others are refused") },
    Entry { key: "reward_manager.module.*", how: How::Unsupported("custom reward-manager classes are not in grpo; a `custom_reward_function` file is") },
    Entry { key: "custom_reward_function.path", how: How::Rule("-> reward.custom_reward_function.path (null: grpo's built-in scorers for VeRL's data sources); VeRL 0.7.1 moved it to `reward.custom_reward_function.path`, where grpo reads it then") },
    Entry { key: "custom_reward_function.name", how: How::Rule("-> reward.custom_reward_function.name") },
    Entry { key: "custom_reward_function.reward_kwargs.*", how: How::Rule("-> reward.custom_reward_function.reward_kwargs") },
    Entry { key: "reward_model.*", how: How::NoEffect("the reward-model worker's FSDP, batching and serving settings; grpo runs the model as a `reward_model` scorer (VeRL 0.7.1 moved the keys it reads to `reward.*`, and grpo reads them there)") },
    Entry { key: "reward_model.model.path", how: REWARD_MODEL_PATH },
    Entry { key: "reward_model.max_length", how: How::Rule("with `reward_model.enable` -> the scorer's max_length (null: grpo's 4096)") },
    Entry { key: "reward_model.reward_kwargs.*", how: How::Rule("the reward manager's keyword arguments: with `dapo`, `overlong_buffer_cfg.{enable,len,penalty_factor,log}` and `max_resp_len` -> reward.overlong_buffer") },
    Entry { key: "sandbox_fusion.*", how: SANDBOX },
    // reward, VeRL 0.7.1 and later
    Entry { key: "reward.num_workers", how: How::Map("reward.num_workers") },
    Entry { key: "reward.custom_reward_function.path", how: How::Rule("-> reward.custom_reward_function.path (null: grpo's built-in scorers for VeRL's data sources)") },
    Entry { key: "reward.custom_reward_function.name", how: How::Rule("-> reward.custom_reward_function.name") },
    Entry { key: "reward.custom_reward_function.reward_kwargs.*", how: How::Rule("-> reward.custom_reward_function.reward_kwargs") },
    Entry { key: "reward.reward_kwargs.*", how: How::Rule("the reward manager's keyword arguments: with `dapo`, `overlong_buffer_cfg.{enable,len,penalty_factor,log}` and `max_resp_len` -> reward.overlong_buffer") },
    Entry { key: "reward.reward_manager.name", how: How::Rule("naive / batch -> reward.custom_reward_function.reward_manager; dapo -> naive, with `reward.reward_kwargs.overlong_buffer_cfg` -> reward.overlong_buffer; others are refused") },
    Entry { key: "reward.reward_manager.source", how: How::Unsupported("grpo's reward managers are VeRL's registered `naive`, `batch` and `dapo`") },
    Entry { key: "reward.reward_manager.module.*", how: How::Unsupported("custom reward-manager classes are not in grpo; a `custom_reward_function` file is") },
    Entry { key: "reward.reward_model.*", how: REWARD_ROLLOUT },
    Entry { key: "reward.reward_model.enable", how: REWARD_MODEL },
    Entry { key: "reward.reward_model.model_path", how: REWARD_MODEL_PATH },
    Entry { key: "reward.reward_model.rollout.prompt_length", how: How::Rule("with `reward.reward_model.enable`, + `response_length` -> the scorer's max_length") },
    Entry { key: "reward.reward_model.rollout.response_length", how: How::Rule("with `reward.reward_model.enable`, + `prompt_length` -> the scorer's max_length") },
    Entry { key: "reward.sandbox_fusion.*", how: SANDBOX },
    Entry { key: "reward_model.enable", how: REWARD_MODEL },
    Entry { key: "reward_model.reward_manager", how: How::Rule("VeRL's older home of `reward_manager.name`, which reads it by default") },
    Entry { key: "reward_model.sandbox_fusion.*", how: How::Unsupported("code execution in a Sandbox Fusion server is not in grpo; a `custom_reward_function` file can run the code itself") },
    Entry { key: "reward_model.profiler.*", how: PROFILER },
    // critic
    Entry { key: "critic.*", how: CRITIC },
    Entry { key: "critic.enable", how: How::Rule("null: a critic exactly for `adv_estimator=gae` (VeRL's `need_critic`); True without gae or False with it is refused") },
    Entry { key: "critic.optim.optimizer", how: How::Unsupported("grpo's optimizer is AdamW") },
    Entry { key: "critic.optim.lr", how: CRITIC_RULE },
    Entry { key: "critic.optim.betas", how: CRITIC_RULE },
    Entry { key: "critic.optim.weight_decay", how: CRITIC_RULE },
    Entry { key: "critic.optim.min_lr_ratio", how: CRITIC_RULE },
    Entry { key: "critic.optim.lr_scheduler_type", how: CRITIC_RULE },
    Entry { key: "critic.optim.warmup_style", how: How::Rule("with gae, VeRL's older name of `lr_scheduler_type`; when set, -> critic.optim.lr_scheduler_type") },
    Entry { key: "critic.optim.lr_warmup_steps", how: How::Rule("with gae: -1 -> from `lr_warmup_steps_ratio`; else -> critic.optim.lr_warmup_steps") },
    Entry { key: "critic.optim.lr_warmup_steps_ratio", how: How::Rule("with gae and `lr_warmup_steps: -1`, warmup = ratio x the critic's optimizer steps of the run (needs `trainer.total_training_steps`) -> critic.optim.lr_warmup_steps") },
    Entry { key: "critic.optim.clip_grad", how: How::Rule("with gae -> critic.grad_clip (with `critic.grad_clip`, whichever is not VeRL's default 1.0)") },
    Entry { key: "critic.optim.num_cycles", how: How::Unsupported("grpo's cosine schedule runs half a cycle (VeRL's default 0.5)") },
    Entry { key: "critic.optim.override_optimizer_config", how: How::Unsupported("grpo's AdamW takes lr, betas, weight_decay and eps (`critic.optim` in a recipe)") },
    Entry { key: "critic.grad_clip", how: How::Rule("with gae -> critic.grad_clip (with `critic.optim.clip_grad`)") },
    Entry { key: "critic.cliprange_value", how: CRITIC_RULE },
    Entry { key: "critic.loss_agg_mode", how: CRITIC_RULE },
    Entry { key: "critic.ppo_mini_batch_size", how: CRITIC_RULE },
    Entry { key: "critic.ppo_epochs", how: CRITIC_RULE },
    Entry { key: "critic.ppo_micro_batch_size", how: How::Rule("with gae, size rule: global sequences per pass (VeRL's older form of `ppo_micro_batch_size_per_gpu`)") },
    Entry { key: "critic.ppo_micro_batch_size_per_gpu", how: How::Rule("with gae, size rule: x devices -> critic.ppo_micro_batch_size (null: the actor's)") },
    Entry { key: "critic.use_dynamic_bsz", how: How::Rule("with gae, size rule: sequences per pass from `ppo_max_token_len_per_gpu` / (max prompt + response length) -> critic.ppo_micro_batch_size") },
    Entry { key: "critic.ppo_max_token_len_per_gpu", how: How::Rule("with gae and `use_dynamic_bsz`, size rule (see `use_dynamic_bsz`)") },
    Entry { key: "critic.model.path", how: How::Rule("with gae, when set -> critic.model.path (VeRL's placeholder default: the critic starts from the actor's model)") },
    Entry { key: "critic.model.enable_gradient_checkpointing", how: CRITIC_RULE },
    Entry { key: "critic.model.lora_rank", how: How::Unsupported("grpo trains the critic's every weight; a LoRA critic is not in grpo") },
    Entry { key: "critic.model.tokenizer_path", how: How::NoEffect("the critic reads the policy's token ids; `critic.model.path` must share its vocabulary") },
    // algorithm
    Entry { key: "algorithm.rollout_correction.rollout_is", how: How::Map("algorithm.rollout_correction.rollout_is") },
    Entry { key: "algorithm.rollout_correction.rollout_is_threshold", how: How::Map("algorithm.rollout_correction.rollout_is_threshold") },
    Entry { key: "algorithm.rollout_correction.rollout_rs", how: How::Map("algorithm.rollout_correction.rollout_rs") },
    Entry { key: "algorithm.rollout_correction.rollout_rs_threshold", how: How::Map("algorithm.rollout_correction.rollout_rs_threshold") },
    Entry { key: "algorithm.rollout_correction.bypass_mode", how: How::Map("actor.use_rollout_log_probs") },
    Entry { key: "algorithm.rollout_correction.loss_type", how: How::Unsupported("grpo's bypass mode (`actor.use_rollout_log_probs`) is PPO's clip on the rollout's log-probs; the `reinforce` loss type is not in grpo") },
    Entry { key: "algorithm.rollout_correction.rollout_is_batch_normalize", how: How::Map("algorithm.rollout_correction.rollout_is_batch_normalize") },
    Entry { key: "algorithm.gamma", how: How::Rule("with `adv_estimator=reinforce_plus_plus` or `gae` -> algorithm.gamma (else no effect)") },
    Entry { key: "algorithm.lam", how: How::Rule("with `adv_estimator=gae` -> algorithm.lam (else no effect)") },
    Entry { key: "algorithm.adv_estimator", how: How::Map("algorithm.adv_estimator") },
    Entry { key: "algorithm.norm_adv_by_std_in_grpo", how: How::Map("algorithm.norm_adv_by_std_in_grpo") },
    Entry { key: "algorithm.use_kl_in_reward", how: How::Map("algorithm.use_kl_in_reward") },
    Entry { key: "algorithm.kl_penalty", how: How::Rule("with `use_kl_in_reward` -> algorithm.kl_penalty (kl, abs, mse, low_var_kl and their k1/k2/k3 names; `k1+` / `k3+` score as k1 / k3, their straight-through gradient being moot in a reward; `full` is refused)") },
    Entry { key: "algorithm.kl_ctrl.type", how: How::Rule("with `use_kl_in_reward` -> algorithm.kl_ctrl (fixed, or adaptive with `target_kl` and `horizon`)") },
    Entry { key: "algorithm.kl_ctrl.kl_coef", how: How::Map("algorithm.kl_coef") },
    Entry { key: "algorithm.kl_ctrl.horizon", how: How::Rule("-> algorithm.kl_ctrl.horizon with `type: adaptive`") },
    Entry { key: "algorithm.kl_ctrl.target_kl", how: How::Rule("-> algorithm.kl_ctrl.target_kl with `type: adaptive`") },
    Entry { key: "algorithm.filter_groups.enable", how: How::Map("algorithm.filter_groups.enable") },
    Entry { key: "algorithm.filter_groups.metric", how: How::Map("algorithm.filter_groups.metric") },
    Entry { key: "algorithm.filter_groups.max_num_gen_batches", how: How::Map("algorithm.filter_groups.max_num_gen_batches") },
    Entry { key: "algorithm.filter_groups.max_inflight_gen_batches", how: How::NoEffect("grpo generates a step's extra rounds one after another; the samples are the same") },
    Entry { key: "algorithm.use_pf_ppo", how: How::Unsupported("preference-feedback PPO reweighting is not in grpo") },
    Entry { key: "algorithm.pf_ppo.*", how: How::NoEffect("read only with `algorithm.use_pf_ppo`") },
    // trainer
    Entry { key: "trainer.balance_batch", how: How::NoEffect("grpo's micro-batches are padded to length buckets, not balanced over ranks") },
    Entry { key: "trainer.total_epochs", how: How::Map("trainer.total_epochs") },
    Entry { key: "trainer.total_training_steps", how: How::Map("trainer.total_training_steps") },
    Entry { key: "trainer.project_name", how: How::Map("trainer.project_name") },
    Entry { key: "trainer.experiment_name", how: How::Map("trainer.experiment_name") },
    Entry { key: "trainer.logger", how: How::Rule("-> trainer.logger, with `file` added (OUTPUT/metrics.jsonl, which `grpo plot` reads)") },
    Entry { key: "trainer.log_val_generations", how: How::Map("trainer.log_val_generations") },
    Entry { key: "trainer.rollout_data_dir", how: How::Map("trainer.rollout_data_dir") },
    Entry { key: "trainer.validation_data_dir", how: How::NoEffect("grpo writes each validation's answers to its output directory") },
    Entry { key: "trainer.nnodes", how: How::Rule("size rule: 1 (one host; a Ray cluster is a recipe's `cluster` section)") },
    Entry { key: "trainer.n_gpus_per_node", how: How::Rule("size rule: the devices of the run -> actor.strategy / actor.mesh (and cluster.cpu_device_count on CPU)") },
    Entry { key: "trainer.save_freq", how: How::Map("trainer.save_freq") },
    Entry { key: "trainer.esi_redundant_time", how: How::NoEffect("for VeRL's elastic-instance shutdown; grpo saves on `save_freq` and resumes from the newest checkpoint") },
    Entry { key: "trainer.resume_mode", how: How::Map("trainer.resume_mode") },
    Entry { key: "trainer.resume_from_path", how: How::Rule("with `resume_mode=resume_path` -> trainer.resume_from_path (else no effect, as in VeRL)") },
    Entry { key: "trainer.val_before_train", how: How::Map("trainer.val_before_train") },
    Entry { key: "trainer.val_only", how: How::Map("trainer.val_only") },
    Entry { key: "trainer.test_freq", how: How::Map("trainer.test_freq") },
    Entry { key: "trainer.critic_warmup", how: How::Rule("with `adv_estimator=gae` -> trainer.critic_warmup (else no effect)") },
    Entry { key: "trainer.default_hdfs_dir", how: How::Unsupported("grpo saves to local paths (`default_local_dir`); copy them to HDFS yourself") },
    Entry { key: "trainer.del_local_ckpt_after_load", how: How::NoEffect("grpo keeps checkpoints by `max_actor_ckpt_to_keep`") },
    Entry { key: "trainer.default_local_dir", how: How::Map("trainer.output_dir") },
    Entry { key: "trainer.max_actor_ckpt_to_keep", how: How::Map("trainer.max_checkpoints_to_keep") },
    Entry { key: "trainer.max_critic_ckpt_to_keep", how: How::NoEffect("the critic's state is part of each checkpoint, kept by `max_actor_ckpt_to_keep`") },
    Entry { key: "trainer.ray_wait_register_center_timeout", how: How::NoEffect("grpo verl starts no Ray workers") },
    Entry { key: "trainer.device", how: How::Rule("cuda / cpu / tpu -> cluster.device (npu is refused)") },
    Entry { key: "trainer.use_legacy_worker_impl", how: How::NoEffect("grpo has one learner") },
    Entry { key: "trainer.use_v1", how: V1_TRAINER },
    Entry { key: "trainer.v1.*", how: V1_TRAINER },
    Entry { key: "global_profiler.*", how: PROFILER },
    Entry { key: "skip.*", how: SKIP },
    Entry { key: "distillation.*", how: DISTILLATION },
    Entry { key: "distillation.enabled", how: How::Unsupported("on-policy distillation from a teacher model is not in grpo") },
    Entry { key: "transfer_queue.*", how: TRANSFER_QUEUE },
    Entry { key: "transfer_queue.enable", how: How::Unsupported("grpo passes batches between its roles itself (in process, or over gRPC to workers)") },
    Entry { key: "ray_kwargs.*", how: How::NoEffect("grpo verl runs on this host without Ray; a Ray cluster is a recipe's `cluster.launcher: ray`") },
];

/// The entry deciding `key`: the exact one, else the longest section (`a.b.*`) holding it.
pub fn entry(key: &str) -> Option<&'static Entry> {
    TABLE.iter().find(|e| e.key == key).or_else(|| {
        TABLE
            .iter()
            .filter(|e| e.key.strip_suffix(".*").is_some_and(|s| within(key, s)))
            .max_by_key(|e| e.key.len())
    })
}

/// Whether `key` is `section` or lies under it.
pub fn within(key: &str, section: &str) -> bool {
    key.strip_prefix(section)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
}

/// The table as Markdown (`grpo verl --keys`, docs/verl-keys.md).
pub fn markdown() -> String {
    let mut out = String::from("| VeRL key | what grpo does |\n|---|---|\n");
    for e in TABLE {
        let what = match e.how {
            How::Map(to) => format!("mapped to `{to}`"),
            How::Rule(rule) => format!("mapped by rule: {rule}"),
            How::NoEffect(why) => format!("accepted, no effect here: {why}"),
            How::Unsupported(why) => format!("unsupported unless left at VeRL's default: {why}"),
        };
        out.push_str(&format!("| `{}` | {} |\n", e.key, what.replace('|', "\\|")));
    }
    out
}
