//! The optimizer as graph functions (AdamW, global gradient-norm clipping) and the
//! learning-rate schedule on the host. The learning rate is a runtime scalar argument of the
//! update program, so a schedule never recompiles it.

use xla::graph::Tensor;
use xla::DType;

use crate::config::{LrSchedule, OptimConfig};

/// The learning rate for the update that follows `step` completed optimizer steps
/// (0-based, as torch's `LambdaLR` counts), `lr * lambda(step)`:
///
/// - `constant` (HF `get_constant_schedule_with_warmup`):
///   `lambda = min(1, step / max(1, warmup))`;
/// - `cosine` (VeRL `verl/utils/torch_functional.py::get_cosine_schedule_with_warmup`):
///   during warmup `min_lr_ratio + (1 - min_lr_ratio) * step / max(1, warmup)`, then with
///   `p = (step - warmup) / max(1, total - warmup)`,
///   `max(min_lr_ratio, cos(2 pi num_cycles p) * (1 - min_lr_ratio) / 2 + (1 + min_lr_ratio) / 2)`.
pub fn learning_rate(cfg: &OptimConfig, step: u64) -> f64 {
    let warmup = cfg.lr_warmup_steps;
    let factor = match cfg.warmup_style {
        LrSchedule::Constant => {
            if step < warmup {
                step as f64 / warmup.max(1) as f64
            } else {
                1.0
            }
        }
        LrSchedule::Cosine => {
            let min = cfg.min_lr_ratio;
            if step < warmup {
                min + (1.0 - min) * step as f64 / warmup.max(1) as f64
            } else {
                let progress =
                    (step - warmup) as f64 / (cfg.total_training_steps.saturating_sub(warmup)).max(1) as f64;
                let x = (std::f64::consts::PI * cfg.num_cycles * 2.0 * progress).cos();
                (x * (1.0 - min) * 0.5 + (1.0 + min) * 0.5).max(min)
            }
        }
    };
    cfg.lr * factor
}

/// `sqrt(sum_p sum(g_p^2))`: the global L2 norm of all gradients (f32 scalar).
pub fn global_grad_norm(grads: &[Tensor]) -> Tensor {
    let mut total: Option<Tensor> = None;
    for g in grads {
        let g = g.convert_if_needed(DType::F32);
        let s = (&g * &g).sum_all();
        total = Some(match total {
            Some(t) => t + s,
            None => s,
        });
    }
    match total {
        Some(t) => t.sqrt(),
        None => panic!("global_grad_norm needs at least one gradient"),
    }
}

/// Global gradient-norm clipping as `torch.nn.utils.clip_grad_norm_` (which VeRL's actor
/// calls with `max_norm = actor.grad_clip`): `g * min(1, max_norm / (norm + 1e-6))`. `norm` is
/// the pre-clip [`global_grad_norm`].
pub fn clip_by_global_norm(grads: &[Tensor], norm: &Tensor, max_norm: f64) -> Vec<Tensor> {
    let coef = (1.0 / (norm + 1e-6) * max_norm).min(&norm.scalar_like(1.0));
    grads
        .iter()
        .map(|g| g * &coef.convert_if_needed(g.dtype()))
        .collect()
}

/// AdamW hyper-parameters baked into the program (the learning rate is a runtime argument).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamW {
    /// `beta1`.
    pub beta1: f64,
    /// `beta2`.
    pub beta2: f64,
    /// `eps`, added to `sqrt(v_hat)`.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
}

impl AdamW {
    /// From the recipe's `actor.optim`.
    pub fn from_config(cfg: &OptimConfig) -> AdamW {
        AdamW {
            beta1: cfg.betas[0],
            beta2: cfg.betas[1],
            eps: cfg.eps,
            weight_decay: cfg.weight_decay,
        }
    }

    /// One AdamW update of one f32 parameter, as torch.optim.AdamW (`_single_tensor_adamw`,
    /// `amsgrad=False`, `maximize=False`), with `t` the 1-based step count (f32 scalar) and
    /// `lr` a runtime f32 scalar:
    ///
    /// ```text
    /// p  = p * (1 - lr * weight_decay)
    /// m  = beta1 m + (1 - beta1) g;        v = beta2 v + (1 - beta2) g^2
    /// p  = p - (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
    /// ```
    /// Returns `(p, m, v)`.
    pub fn update(
        &self,
        p: &Tensor,
        g: &Tensor,
        m: &Tensor,
        v: &Tensor,
        t: &Tensor,
        lr: &Tensor,
    ) -> (Tensor, Tensor, Tensor) {
        let decayed = if self.weight_decay != 0.0 {
            p * &(1.0 - lr * self.weight_decay)
        } else {
            p.clone()
        };
        let m = m * self.beta1 + g * (1.0 - self.beta1);
        let v = v * self.beta2 + (g * g) * (1.0 - self.beta2);
        let bias_correction1 = 1.0 - t.scalar_like(self.beta1).pow(t);
        let bias_correction2_sqrt = (1.0 - t.scalar_like(self.beta2).pow(t)).sqrt();
        let step_size = lr / bias_correction1;
        let denom = v.sqrt() / bias_correction2_sqrt + self.eps;
        let p = decayed - (&m / &denom) * &step_size;
        (p, m, v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constant_schedule_warms_up_linearly_then_holds() {
        let cfg = OptimConfig {
            lr: 1e-3,
            lr_warmup_steps: 4,
            ..Default::default()
        };
        let lrs: Vec<f64> = (0..6).map(|s| learning_rate(&cfg, s)).collect();
        let want = [0.0, 2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3];
        for (a, b) in lrs.iter().zip(want) {
            assert!((a - b).abs() < 1e-15, "{lrs:?}");
        }
        let cfg = OptimConfig {
            lr: 1e-3,
            ..Default::default()
        };
        assert_eq!(learning_rate(&cfg, 0), 1e-3);
    }

    #[test]
    fn cosine_schedule_matches_hand_values() {
        let cfg = OptimConfig {
            lr: 1.0,
            lr_warmup_steps: 2,
            warmup_style: LrSchedule::Cosine,
            min_lr_ratio: 0.1,
            total_training_steps: 6,
            ..Default::default()
        };
        // warmup: 0.1 + 0.9 * s / 2
        assert!((learning_rate(&cfg, 0) - 0.1).abs() < 1e-15);
        assert!((learning_rate(&cfg, 1) - 0.55).abs() < 1e-15);
        // after warmup: p = (s - 2) / 4; cos(pi p) * 0.45 + 0.55
        assert!((learning_rate(&cfg, 2) - 1.0).abs() < 1e-15);
        assert!((learning_rate(&cfg, 4) - 0.55).abs() < 1e-12);
        let p = 0.25f64;
        assert!((learning_rate(&cfg, 3) - ((std::f64::consts::PI * p).cos() * 0.45 + 0.55)).abs() < 1e-12);
        assert!((learning_rate(&cfg, 6) - 0.1).abs() < 1e-12);
        // like VeRL, progress is not capped at 1: past the end the cosine climbs back
        // (p = 1.25 -> cos(1.25 pi) * 0.45 + 0.55)
        let past = (std::f64::consts::PI * 1.25).cos() * 0.45 + 0.55;
        assert!((learning_rate(&cfg, 7) - past).abs() < 1e-12);
    }
}
