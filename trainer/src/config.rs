//! The learner's knobs, named as in VeRL's recipes (`algorithm.adv_estimator`,
//! `actor.clip_ratio_low`, `actor.loss_agg_mode`, `actor.kl_loss_type`, `actor.optim.*`), each
//! enum chosen by its VeRL string through serde.

use serde::{Deserialize, Serialize};

use crate::{Result, TrainerError};

/// `x > bound`, false for NaN.
fn above(x: f64, bound: f64) -> bool {
    x > bound
}

/// `x >= bound`, false for NaN.
fn at_least(x: f64, bound: f64) -> bool {
    x >= bound
}

/// `algorithm.adv_estimator`: how sequence rewards become advantages (see
/// [`crate::advantage::compute_advantages`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum AdvantageEstimator {
    /// Group-normalised outcome reward (VeRL `compute_grpo_outcome_advantage`).
    #[serde(rename = "grpo")]
    Grpo,
    /// Leave-one-out baseline (VeRL `compute_rloo_outcome_advantage`).
    #[serde(rename = "rloo")]
    Rloo,
    /// Length-weighted group baseline (VeRL `compute_opo_outcome_advantage`).
    #[serde(rename = "opo")]
    Opo,
    /// Group mean baseline scaled by the batch's share of non-zero rewards (VeRL
    /// `compute_gpg_outcome_advantage`).
    #[serde(rename = "gpg")]
    Gpg,
    /// Only each group's best response is pushed, by its margin over the runner-up (VeRL
    /// `compute_grpo_passk_outcome_advantage`).
    #[serde(rename = "grpo_passk")]
    GrpoPassk,
    /// Discounted token returns whitened over the batch (VeRL
    /// `compute_reinforce_plus_plus_outcome_advantage`).
    #[serde(rename = "reinforce_plus_plus")]
    ReinforcePlusPlus,
    /// Group mean baseline, then whitened over the batch's tokens (VeRL
    /// `compute_reinforce_plus_plus_baseline_outcome_advantage`).
    #[serde(rename = "reinforce_plus_plus_baseline")]
    ReinforcePlusPlusBaseline,
    /// Token returns less the reward of the prompt's greedy response (VeRL
    /// `compute_remax_outcome_advantage`); the run generates that response.
    #[serde(rename = "remax")]
    Remax,
    /// Generalized advantage estimation over a learned critic's values (VeRL
    /// `compute_gae_advantage_return`): PPO. Needs [`AdvantageEstimator::needs_critic`].
    #[serde(rename = "gae")]
    Gae,
}

impl AdvantageEstimator {
    /// Whether the estimator reads a critic's values (the run then trains a value model).
    pub fn needs_critic(self) -> bool {
        matches!(self, AdvantageEstimator::Gae)
    }
}

/// The advantage side of VeRL's `algorithm.*` keys.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdvantageConfig {
    /// `algorithm.adv_estimator`.
    pub estimator: AdvantageEstimator,
    /// `algorithm.norm_adv_by_std_in_grpo`: divide by the group's standard deviation (`grpo`,
    /// `grpo_passk`; false is Dr. GRPO).
    pub norm_adv_by_std_in_grpo: bool,
    /// `algorithm.gamma`: the discount of `reinforce_plus_plus`'s and `gae`'s token returns.
    pub gamma: f64,
    /// `algorithm.lam`: GAE's λ, the trade-off between the critic's bootstrap (0) and the
    /// Monte Carlo return (1).
    pub lam: f64,
}

impl Default for AdvantageConfig {
    fn default() -> Self {
        AdvantageConfig {
            estimator: AdvantageEstimator::Grpo,
            norm_adv_by_std_in_grpo: true,
            gamma: 1.0,
            lam: 1.0,
        }
    }
}

/// `actor.router_replay.mode` (VeRL's names): which experts a mixture-of-experts policy's
/// learner passes use. The combine weights always come from the live router, so it trains
/// whichever experts are replayed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum RouterReplay {
    /// Every pass routes by its own router's top-k.
    #[default]
    #[serde(rename = "disabled")]
    Disabled,
    /// Routing Replay: the old-log-prob pass routes by its router and records the experts;
    /// the reference pass and every update pass replay them, so the importance ratio compares
    /// the same experts across the update's optimizer steps.
    R2,
    /// Rollout Routing Replay (arXiv 2510.11370): every learner pass (old log-probs,
    /// reference, update, recomputation under remat and scan) replays the experts the rollout
    /// chose for each token it fed; the response's last token, never fed, routes by the router.
    R3,
}

/// `actor.loss_agg_mode`: how a `[batch, response_len]` loss matrix becomes a scalar (VeRL
/// `agg_loss`; see [`crate::loss::agg_loss`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum LossAggMode {
    /// Mean over all unmasked tokens of the mini-batch.
    #[serde(rename = "token-mean")]
    TokenMean,
    /// Sum over each sequence's tokens, mean over sequences.
    #[serde(rename = "seq-mean-token-sum")]
    SeqMeanTokenSum,
    /// Mean over each sequence's tokens, mean over sequences.
    #[serde(rename = "seq-mean-token-mean")]
    SeqMeanTokenMean,
    /// Sum over all tokens divided by the (padded) response length (Dr. GRPO).
    #[serde(rename = "seq-mean-token-sum-norm")]
    SeqMeanTokenSumNorm,
}

/// `actor.kl_loss_type` / `algorithm.kl_penalty`: the KL estimator (VeRL `kl_penalty`; see
/// [`crate::loss::kl_penalty`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum KlPenalty {
    /// `k1`: `log p - log p_ref`.
    #[serde(rename = "kl", alias = "k1")]
    K1,
    /// `|log p - log p_ref|`.
    #[serde(rename = "abs")]
    Abs,
    /// `k2`: `0.5 (log p - log p_ref)^2`.
    #[serde(rename = "mse", alias = "k2")]
    K2,
    /// `k3` (Schulman's low-variance estimator), clamped as VeRL does.
    #[serde(rename = "low_var_kl", alias = "k3")]
    K3,
}

/// `algorithm.kl_ctrl`: how the in-reward KL coefficient moves (VeRL `get_kl_controller`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum KlControl {
    /// The coefficient stays at `algorithm.kl_coef`.
    Fixed,
    /// Ziegler et al. (2019)'s proportional controller, VeRL's `AdaptiveKLController`: after
    /// each step `e = clip(KL / target_kl - 1, -0.2, 0.2)` and
    /// `kl_coef <- kl_coef * (1 + e * n / horizon)`, `n` the step's sequences.
    Adaptive {
        #[serde(default = "default_target_kl")]
        target_kl: f64,
        #[serde(default = "default_horizon")]
        horizon: f64,
    },
}

fn default_target_kl() -> f64 {
    0.1
}

fn default_horizon() -> f64 {
    10000.0
}

/// `actor.policy_loss.loss_mode`: which surrogate (VeRL's policy-loss registry names).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PolicyLossMode {
    /// PPO clipped surrogate with dual clip (VeRL `compute_policy_loss_vanilla`).
    #[serde(rename = "vanilla")]
    Vanilla,
    /// GSPO's sequence-level ratio (VeRL `compute_policy_loss_gspo`).
    #[serde(rename = "gspo")]
    Gspo,
    /// SAPO's smooth sigmoid gate in place of the clip (VeRL `compute_policy_loss_sapo`).
    #[serde(rename = "sapo")]
    Sapo,
    /// Plain policy gradient `-A log p` (VeRL `compute_policy_loss_gpg`).
    #[serde(rename = "gpg")]
    Gpg,
    /// PPO clip that also drops the gradient of a few high-covariance tokens (VeRL
    /// `compute_policy_loss_clip_cov`).
    #[serde(rename = "clip_cov")]
    ClipCov,
    /// Unclipped ratio with a KL penalty on the highest-covariance tokens (VeRL
    /// `compute_policy_loss_kl_cov`).
    #[serde(rename = "kl_cov")]
    KlCov,
    /// GMPO's geometric mean of the token ratios (VeRL `compute_policy_loss_geo_mean`).
    #[serde(rename = "geo_mean")]
    GeoMean,
    /// CISPO's clipped, gradient-stopped importance weight on `A log p` (VeRL
    /// `compute_policy_loss_cispo`).
    #[serde(rename = "cispo")]
    Cispo,
}

/// The critic's loss (VeRL's `critic.*`): the clipped value loss of
/// [`crate::loss::value_loss`]. Defaults are VeRL's.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ValueLossConfig {
    /// `critic.cliprange_value`: a prediction moves at most this far from the value it had when
    /// the batch was generated before the clipped term takes over.
    pub cliprange_value: f64,
    /// `critic.loss_agg_mode`.
    pub loss_agg_mode: LossAggMode,
}

impl Default for ValueLossConfig {
    fn default() -> Self {
        ValueLossConfig {
            cliprange_value: 0.5,
            loss_agg_mode: LossAggMode::TokenMean,
        }
    }
}

impl ValueLossConfig {
    /// The first value out of range, as an error naming its key.
    pub fn validate(&self) -> Result<()> {
        if !above(self.cliprange_value, 0.0) {
            return Err(TrainerError::Config {
                key: "critic.cliprange_value",
                value: self.cliprange_value.to_string(),
                message: "must be above 0 (VeRL's default is 0.5)".into(),
            });
        }
        Ok(())
    }
}

/// The loss side of the actor config (VeRL's `actor.*` and the rollout-IS keys of
/// `algorithm.*`). Defaults are VeRL's.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PolicyLossConfig {
    /// `actor.policy_loss.loss_mode`.
    pub loss_mode: PolicyLossMode,
    /// `actor.clip_ratio_low`: the ratio is clipped below at `1 - clip_ratio_low`.
    pub clip_ratio_low: f64,
    /// `actor.clip_ratio_high`: the ratio is clipped above at `1 + clip_ratio_high` (DAPO's
    /// clip-higher when larger than `clip_ratio_low`).
    pub clip_ratio_high: f64,
    /// `actor.clip_ratio_c`: dual-clip bound for negative advantages (must exceed 1).
    pub clip_ratio_c: f64,
    /// `actor.loss_agg_mode` (ignored by GSPO, which always uses `seq-mean-token-mean`).
    pub loss_agg_mode: LossAggMode,
    /// `actor.use_kl_loss`: add `kl_loss_coef * agg(kl(log p, log p_ref))` to the loss.
    pub use_kl_loss: bool,
    /// `actor.kl_loss_coef`.
    pub kl_loss_coef: f64,
    /// `actor.kl_loss_type`.
    pub kl_loss_type: KlPenalty,
    /// `actor.entropy_coeff`: subtract `entropy_coeff * agg(entropy)` from the loss.
    pub entropy_coeff: f64,
    /// Whether the loss takes per-token rollout importance weights (an input of the step,
    /// computed once per batch by [`crate::rollout_correction`] when
    /// `algorithm.rollout_correction.rollout_is` is set) and multiplies each token's policy
    /// loss by its weight.
    pub rollout_is_weights: bool,
    /// `actor.tau_pos`: SAPO's gate temperature for tokens with a positive advantage.
    pub tau_pos: f64,
    /// `actor.tau_neg`: SAPO's gate temperature for the other tokens.
    pub tau_neg: f64,
    /// `actor.policy_loss.clip_cov_ratio`: the share of a micro-batch's tokens whose gradient
    /// `clip_cov` drops.
    pub clip_cov_ratio: f64,
    /// `actor.policy_loss.clip_cov_lb`: `clip_cov` only drops tokens whose covariance exceeds
    /// this.
    pub clip_cov_lb: f64,
    /// `actor.policy_loss.clip_cov_ub`: ... and is below this.
    pub clip_cov_ub: f64,
    /// `actor.policy_loss.kl_cov_ratio`: the share of a micro-batch's tokens `kl_cov`
    /// penalises.
    pub kl_cov_ratio: f64,
    /// `actor.policy_loss.ppo_kl_coef`: `kl_cov`'s penalty weight.
    pub ppo_kl_coef: f64,
    /// `actor.router_aux_loss_coef`: a mixture-of-experts policy adds this times its
    /// load-balancing loss ([`model::moe::load_balancing_loss`]) to the loss. 0, as VeRL's RL
    /// recipes set it, reports the loss without training on it.
    pub router_aux_loss_coef: f64,
}

impl Default for PolicyLossConfig {
    fn default() -> Self {
        PolicyLossConfig {
            loss_mode: PolicyLossMode::Vanilla,
            clip_ratio_low: 0.2,
            clip_ratio_high: 0.2,
            clip_ratio_c: 3.0,
            loss_agg_mode: LossAggMode::TokenMean,
            use_kl_loss: false,
            kl_loss_coef: 0.001,
            kl_loss_type: KlPenalty::K3,
            entropy_coeff: 0.0,
            rollout_is_weights: false,
            tau_pos: 1.0,
            tau_neg: 1.05,
            clip_cov_ratio: 0.0002,
            clip_cov_lb: 1.0,
            clip_cov_ub: 5.0,
            kl_cov_ratio: 0.0002,
            ppo_kl_coef: 0.1,
            router_aux_loss_coef: 0.0,
        }
    }
}

impl PolicyLossConfig {
    /// Checks the ranges VeRL asserts (`clip_ratio_c > 1`) and the ones that would make the
    /// loss meaningless: the first violation (see [`PolicyLossConfig::violations`]).
    pub fn validate(&self) -> Result<()> {
        match self.violations().into_iter().next() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Every range violation, each naming its recipe key (recipe validation reports them all
    /// with their lines).
    pub fn violations(&self) -> Vec<TrainerError> {
        let mut out = Vec::new();
        let bad = |key: &'static str, value: f64, message: &str| TrainerError::Config {
            key,
            value: value.to_string(),
            message: message.to_string(),
        };
        if !above(self.clip_ratio_c, 1.0) {
            out.push(bad(
                "actor.clip_ratio_c",
                self.clip_ratio_c,
                "the dual-clip bound must be greater than 1.0",
            ));
        }
        if !(self.clip_ratio_low >= 0.0 && self.clip_ratio_low < 1.0) {
            out.push(bad(
                "actor.clip_ratio_low",
                self.clip_ratio_low,
                "must be in [0, 1)",
            ));
        }
        if !at_least(self.clip_ratio_high, 0.0) {
            out.push(bad("actor.clip_ratio_high", self.clip_ratio_high, "must be >= 0"));
        }
        for (key, tau) in [("actor.tau_pos", self.tau_pos), ("actor.tau_neg", self.tau_neg)] {
            if !above(tau, 0.0) {
                out.push(bad(key, tau, "SAPO's gate temperature must be > 0"));
            }
        }
        for (key, ratio) in [
            ("actor.policy_loss.clip_cov_ratio", self.clip_cov_ratio),
            ("actor.policy_loss.kl_cov_ratio", self.kl_cov_ratio),
        ] {
            if !(above(ratio, 0.0) && ratio <= 1.0) {
                out.push(bad(key, ratio, "a share of the tokens: must be in (0, 1]"));
            }
        }
        if !above(self.clip_cov_ub, self.clip_cov_lb) {
            out.push(bad(
                "actor.policy_loss.clip_cov_ub",
                self.clip_cov_ub,
                &format!("must be greater than clip_cov_lb ({})", self.clip_cov_lb),
            ));
        }
        if !(self.router_aux_loss_coef >= 0.0 && self.router_aux_loss_coef.is_finite()) {
            out.push(bad(
                "actor.router_aux_loss_coef",
                self.router_aux_loss_coef,
                "must be a finite number >= 0",
            ));
        }
        out
    }
}

/// `actor.optim.warmup_style`: the learning-rate shape after warmup.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum LrSchedule {
    /// Linear warmup from 0, then constant (HF `get_constant_schedule_with_warmup`).
    #[serde(rename = "constant")]
    Constant,
    /// Linear warmup from `min_lr_ratio`, then half a cosine down to `min_lr_ratio` (VeRL
    /// `get_cosine_schedule_with_warmup`).
    #[serde(rename = "cosine")]
    Cosine,
}

/// `actor.optim.*` and `actor.grad_clip`. Defaults are VeRL's.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OptimConfig {
    /// `actor.optim.lr`: the peak learning rate.
    pub lr: f64,
    /// `actor.optim.betas`.
    pub betas: [f64; 2],
    /// `actor.optim.eps` (torch's default 1e-8).
    pub eps: f64,
    /// `actor.optim.weight_decay`: decoupled, as torch.optim.AdamW.
    pub weight_decay: f64,
    /// `actor.grad_clip`: the global L2 norm the gradients are clipped to; `None` disables.
    pub grad_clip: Option<f64>,
    /// `actor.optim.lr_warmup_steps`.
    pub lr_warmup_steps: u64,
    /// `actor.optim.warmup_style`.
    pub warmup_style: LrSchedule,
    /// `actor.optim.min_lr_ratio` (cosine only).
    pub min_lr_ratio: f64,
    /// `actor.optim.num_cycles` (cosine only; 0.5 is half a period).
    pub num_cycles: f64,
    /// `actor.optim.total_training_steps`: the length of the cosine decay.
    pub total_training_steps: u64,
}

impl Default for OptimConfig {
    fn default() -> Self {
        OptimConfig {
            lr: 1e-6,
            betas: [0.9, 0.999],
            eps: 1e-8,
            weight_decay: 0.01,
            grad_clip: Some(1.0),
            lr_warmup_steps: 0,
            warmup_style: LrSchedule::Constant,
            min_lr_ratio: 0.0,
            num_cycles: 0.5,
            total_training_steps: 1,
        }
    }
}

impl OptimConfig {
    /// Checks ranges (`betas` in [0, 1), `eps` > 0, `min_lr_ratio` in [0, 1], positive clip). The first violation (see [`OptimConfig::violations`]).
    pub fn validate(&self) -> Result<()> {
        match self.violations().into_iter().next() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Every range violation, each naming its recipe key.
    pub fn violations(&self) -> Vec<TrainerError> {
        let mut out = Vec::new();
        let bad = |key: &'static str, value: String, message: &str| TrainerError::Config {
            key,
            value,
            message: message.to_string(),
        };
        if self.betas.iter().any(|b| !(0.0..1.0).contains(b)) {
            out.push(bad(
                "actor.optim.betas",
                format!("{:?}", self.betas),
                "each beta must be in [0, 1)",
            ));
        }
        if !above(self.eps, 0.0) {
            out.push(bad("actor.optim.eps", self.eps.to_string(), "must be > 0"));
        }
        if !above(self.lr, 0.0) || !self.lr.is_finite() {
            out.push(bad(
                "actor.optim.lr",
                self.lr.to_string(),
                "must be a finite number > 0",
            ));
        }
        if !(0.0..=1.0).contains(&self.min_lr_ratio) {
            out.push(bad(
                "actor.optim.min_lr_ratio",
                self.min_lr_ratio.to_string(),
                "must be in [0, 1]",
            ));
        }
        if let Some(c) = self.grad_clip {
            if !above(c, 0.0) {
                out.push(bad(
                    "actor.grad_clip",
                    c.to_string(),
                    "must be > 0 (or null to disable)",
                ));
            }
        }
        out
    }
}

/// `actor.strategy`: how the learner's programs use the devices of its client.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Strategy {
    /// One device: plain single-device programs (no mesh).
    #[default]
    #[serde(rename = "single")]
    Single,
    /// Data parallel: parameters and optimizer state replicated on every device of the mesh,
    /// each micro-batch's rows split over the `data` axis; XLA's partitioner inserts the
    /// gradient all-reduce inside the compiled step.
    #[serde(rename = "dp")]
    Dp,
    /// Fully sharded data parallel: parameters, both Adam moments and the gradient
    /// accumulators split along their first dimension that divides by the mesh size
    /// (replicated when none does), rows split as in `dp`; XLA all-gathers the parameters for
    /// the forward and reduce-scatters the gradients.
    #[serde(rename = "fsdp")]
    Fsdp,
}

impl Strategy {
    /// The recipe spelling.
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Single => "single",
            Strategy::Dp => "dp",
            Strategy::Fsdp => "fsdp",
        }
    }
}

/// `actor.strategy`, `actor.mesh` and `actor.tensor_model_parallel_size`: the learner's
/// device layout, a mesh of `data` x `model` devices (`model` = the tensor-parallel size).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Parallelism {
    /// How parameters and rows are laid out over the devices.
    pub strategy: Strategy,
    /// Devices of the mesh (`dp`, `fsdp`): devices `0..mesh` of the learner's client. `None`
    /// means all devices of the client; resolve it with [`Parallelism::resolved`] before
    /// building programs. Ignored by `single`.
    pub mesh: Option<usize>,
    /// Devices of the tensor-parallel axis (VeRL's `tensor_model_parallel_size`): every
    /// parameter split by the Megatron layout ([`model::ModelSplit`]) over this many devices,
    /// the rows over the remaining `mesh / tensor_parallel` (the `data` axis). 1: none.
    pub tensor_parallel: usize,
}

impl Default for Parallelism {
    fn default() -> Parallelism {
        Parallelism {
            strategy: Strategy::Single,
            mesh: None,
            tensor_parallel: 1,
        }
    }
}

impl Parallelism {
    /// `strategy` over `mesh` devices, no tensor parallelism.
    pub fn new(strategy: Strategy, mesh: usize) -> Parallelism {
        Parallelism {
            strategy,
            mesh: Some(mesh),
            tensor_parallel: 1,
        }
    }

    /// This layout with a tensor-parallel axis of `tp` devices.
    pub fn with_tensor_parallel(self, tp: usize) -> Parallelism {
        Parallelism {
            tensor_parallel: tp,
            ..self
        }
    }

    /// This layout with an unset mesh filled in as all `client_devices` devices.
    pub fn resolved(self, client_devices: usize) -> Parallelism {
        Parallelism {
            mesh: self.mesh.or(Some(client_devices)),
            ..self
        }
    }

    /// The number of devices the learner's programs span: 1 for `single`, the mesh size
    /// otherwise. Refuses an unresolved or empty mesh, a mesh the tensor-parallel size does
    /// not divide, and a micro-batch whose rows do not split evenly over the `data` axis.
    pub fn devices(&self, micro_batch_size: i64) -> Result<usize> {
        let tp = self.tensor_parallel.max(1);
        if self.strategy == Strategy::Single {
            if tp > 1 {
                return Err(TrainerError::Config {
                    key: "actor.tensor_model_parallel_size",
                    value: tp.to_string(),
                    message: format!(
                        "tensor parallelism spans several devices; actor.strategy single uses \
                         one: set actor.strategy dp (parameters whole over the data axis) or \
                         fsdp (also split over it) with actor.mesh a multiple of {tp}"
                    ),
                });
            }
            return Ok(1);
        }
        let n = self.mesh.ok_or_else(|| TrainerError::Config {
            key: "actor.mesh",
            value: "null".to_string(),
            message: format!(
                "actor.strategy {} needs the number of devices before the programs are built; \
                 set actor.mesh or resolve it from the client (Parallelism::resolved)",
                self.strategy.name()
            ),
        })?;
        if n == 0 {
            return Err(TrainerError::Config {
                key: "actor.mesh",
                value: "0".to_string(),
                message: "the mesh needs at least 1 device".to_string(),
            });
        }
        if !n.is_multiple_of(tp) {
            return Err(TrainerError::Config {
                key: "actor.mesh",
                value: n.to_string(),
                message: format!(
                    "must be a multiple of actor.tensor_model_parallel_size ({tp}): the mesh is \
                     data x model devices, {tp} on the model axis"
                ),
            });
        }
        let data = n / tp;
        if micro_batch_size % data as i64 != 0 {
            let (divisor, over) = if tp > 1 {
                (
                    format!(
                        "{data}, the data axis of actor.mesh ({n}) / actor.tensor_model_parallel_size ({tp})"
                    ),
                    format!("the {data} devices of the data axis"),
                )
            } else {
                (format!("actor.mesh ({n})"), "the devices".to_string())
            };
            return Err(TrainerError::Config {
                key: "actor.ppo_micro_batch_size",
                value: micro_batch_size.to_string(),
                message: format!(
                    "must divide by {divisor}: actor.strategy {} splits each micro-batch's \
                     rows evenly over {over}; pick a micro-batch size that is a multiple of \
                     {data} or a mesh that divides {micro_batch_size}",
                    self.strategy.name()
                ),
            });
        }
        Ok(n)
    }

    /// The devices of the `data` axis (the row blocks of a micro-batch): [`Parallelism::devices`]
    /// divided by the tensor-parallel size.
    pub fn data_devices(&self, micro_batch_size: i64) -> Result<usize> {
        Ok(self.devices(micro_batch_size)? / self.tensor_parallel.max(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enums_read_verl_names_and_aliases() {
        let kl: Vec<KlPenalty> =
            serde_json::from_str(r#"["kl","k1","abs","mse","k2","low_var_kl","k3"]"#).unwrap();
        use KlPenalty::*;
        assert_eq!(kl, vec![K1, K1, Abs, K2, K2, K3, K3]);
        let agg: Vec<LossAggMode> = serde_json::from_str(
            r#"["token-mean","seq-mean-token-sum","seq-mean-token-mean","seq-mean-token-sum-norm"]"#,
        )
        .unwrap();
        assert_eq!(agg.len(), 4);
        assert_eq!(
            serde_json::to_string(&LossAggMode::SeqMeanTokenSumNorm).unwrap(),
            "\"seq-mean-token-sum-norm\""
        );
        let est: AdvantageEstimator = serde_json::from_str("\"rloo\"").unwrap();
        assert_eq!(est, AdvantageEstimator::Rloo);
        let err = serde_json::from_str::<LossAggMode>("\"token_mean\"")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("unknown variant `token_mean`") && err.contains("token-mean"),
            "{err}"
        );
    }

    #[test]
    fn configs_take_defaults_and_refuse_unknown_keys() {
        let c: PolicyLossConfig = serde_json::from_str(r#"{"clip_ratio_high": 0.28}"#).unwrap();
        assert_eq!(c.clip_ratio_high, 0.28);
        assert_eq!(c.clip_ratio_low, 0.2);
        assert_eq!(c.clip_ratio_c, 3.0);
        let err = serde_json::from_str::<PolicyLossConfig>(r#"{"clip_ratio_hi": 0.28}"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown field `clip_ratio_hi`"), "{err}");
        let c = PolicyLossConfig {
            clip_ratio_c: 1.0,
            ..Default::default()
        };
        let err = c.validate().unwrap_err().to_string();
        assert_eq!(
            err,
            "config: actor.clip_ratio_c = 1: the dual-clip bound must be greater than 1.0"
        );
        let o = OptimConfig {
            betas: [0.9, 1.0],
            ..Default::default()
        };
        assert!(o
            .validate()
            .unwrap_err()
            .to_string()
            .contains("actor.optim.betas"));
        assert!(OptimConfig::default().validate().is_ok());
    }

    #[test]
    fn parallelism_resolves_and_checks_the_micro_batch() {
        let p: Parallelism = serde_json::from_str(r#"{"strategy": "fsdp"}"#).unwrap();
        assert_eq!(p.strategy, Strategy::Fsdp);
        assert_eq!(p.mesh, None);
        let err = p.devices(8).unwrap_err().to_string();
        assert!(
            err.starts_with("config: actor.mesh = null: actor.strategy fsdp needs"),
            "{err}"
        );
        assert_eq!(p.resolved(4).devices(8).unwrap(), 4);
        assert_eq!(
            Parallelism::new(Strategy::Dp, 2).resolved(4).devices(8).unwrap(),
            2
        );
        assert_eq!(Parallelism::default().devices(3).unwrap(), 1);
        let err = Parallelism::new(Strategy::Dp, 4)
            .devices(6)
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "config: actor.ppo_micro_batch_size = 6: must divide by actor.mesh (4): actor.strategy \
             dp splits each micro-batch's rows evenly over the devices; pick a micro-batch size \
             that is a multiple of 4 or a mesh that divides 6"
        );
        assert!(Parallelism::new(Strategy::Dp, 0).devices(6).is_err());
        assert!(serde_json::from_str::<Parallelism>(r#"{"strategy": "tp"}"#).is_err());
    }

    #[test]
    fn tensor_parallelism_splits_the_mesh_into_data_and_model_axes() {
        let p = Parallelism::new(Strategy::Fsdp, 4).with_tensor_parallel(2);
        assert_eq!((p.devices(2).unwrap(), p.data_devices(2).unwrap()), (4, 2));
        let err = p.devices(3).unwrap_err().to_string();
        assert!(
            err.contains(
                "must divide by 2, the data axis of actor.mesh (4) / actor.tensor_model_parallel_size (2)"
            ),
            "{err}"
        );
        let err = Parallelism::new(Strategy::Dp, 6)
            .with_tensor_parallel(4)
            .devices(8)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("actor.mesh = 6: must be a multiple of actor.tensor_model_parallel_size (4)"),
            "{err}"
        );
        let err = Parallelism::default()
            .with_tensor_parallel(2)
            .devices(2)
            .unwrap_err()
            .to_string();
        assert!(err.contains("set actor.strategy dp"), "{err}");
        let json: Parallelism = serde_json::from_str(r#"{"strategy": "dp", "mesh": 4}"#).unwrap();
        assert_eq!(json.tensor_parallel, 1);
    }
}
