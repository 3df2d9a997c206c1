//! DAPO's overlong-response penalty, as VeRL's `verl/workers/reward_manager/dapo.py`
//! (volcengine/verl at commit b178a3cd56f58b2d502255daba591e92833930a7) computes it:
//!
//! ```text
//! expected_len   = max_response_length - buffer_len
//! exceed_len     = response_length - expected_len
//! overlong_reward = min(-exceed_len / buffer_len * penalty_factor, 0)
//! reward        += overlong_reward
//! ```
//!
//! So responses up to `max_response_length - buffer_len` tokens are not penalised, and the
//! penalty grows linearly to `-penalty_factor` at `max_response_length`. As in VeRL it applies to
//! every sample, truncated or not.

use serde::{Deserialize, Serialize};

/// The penalty's parameters.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct OverlongPenalty {
    /// `overlong_buffer.len`: the length of the penalised zone before the limit, in tokens (> 0).
    pub buffer_len: usize,
    /// `overlong_buffer.penalty_factor`: the penalty at the limit.
    pub penalty_factor: f64,
    /// The rollout's maximum response length in tokens (`data.max_response_length`).
    pub max_response_length: usize,
}

impl OverlongPenalty {
    /// The (non-positive) reward to add for a response of `response_length` tokens.
    pub fn penalty(&self, response_length: usize) -> f64 {
        let expected_len = self.max_response_length as f64 - self.buffer_len as f64;
        let exceed_len = response_length as f64 - expected_len;
        (-exceed_len / self.buffer_len as f64 * self.penalty_factor).min(0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_dapo_formula() {
        let penalty = OverlongPenalty {
            buffer_len: 4,
            penalty_factor: 1.0,
            max_response_length: 20,
        };
        assert_eq!(penalty.penalty(0), 0.0);
        assert_eq!(penalty.penalty(16), 0.0);
        assert_eq!(penalty.penalty(17), -0.25);
        assert_eq!(penalty.penalty(18), -0.5);
        assert_eq!(penalty.penalty(20), -1.0);
        // VeRL does not clamp beyond the limit either.
        assert_eq!(penalty.penalty(24), -2.0);
        let doubled = OverlongPenalty {
            penalty_factor: 2.0,
            ..penalty
        };
        assert_eq!(doubled.penalty(19), -1.5);
    }
}
