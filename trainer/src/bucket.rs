//! Length buckets: the learner runs each micro-batch padded to the smallest bucket that holds
//! its longest prompt and its longest response, not to the recipe's maximum lengths.
//!
//! A [`DecoderPolicy`] row is a prompt left-padded to `P` columns followed by a response
//! right-padded to `L` columns. With buckets of `multiple` columns (`actor.length_bucket`), a
//! micro-batch whose longest prompt has `p` tokens and whose longest response has `r` runs at
//! `P' = min(ceil(p / multiple) * multiple, P)` prompt columns and
//! `L' = min(ceil(max(r, 1) / multiple) * multiple, L)` response columns; `multiple = 0` means
//! one bucket, the full `P + L`. Each `(P', L')` gets its own `train_step`, `accumulate` and
//! `log_probs` programs ([`build_shape_programs`]) (and a second set, with a prompt slot per
//! row, if a micro-batch's rows ever come out of their groups: [`DecoderPolicy::unshared`]), traced when the bucket first appears and
//! compiled on first use through the client's executable cache (in memory, and on disk across
//! runs); the parameters, the optimizer state, the accumulators and `apply` are shared, so
//! micro-batches of different buckets accumulate into one optimizer step. At most
//! `ceil(P / multiple) * ceil(L / multiple)` shapes exist ([`LengthBuckets::max_shapes`]).
//!
//! The result does not depend on the bucket, up to f32 rounding: positions come from the
//! attention mask, padding keys are masked out of attention, padded response columns have
//! response mask 0, and the loss's normalisers (token and sequence counts of the mini-batch,
//! and the `L` of `seq-mean-token-sum-norm`) are those of the full shape.

use std::collections::BTreeMap;

use model::ParamSpec;
use xla::runtime::Client;

use crate::policy::{DecoderPolicy, PackError, PackedRows};
use crate::step::{
    build_shape_programs, build_train_programs, Learner, LearnerState, MicroBatch, MicroBatchHost,
    StepConfig, StepMetrics, UsedRoutes,
};
use crate::{Result, TrainerError};

/// The bucket rule: prompt and response columns rounded up to a multiple of `multiple`,
/// capped at the maximum lengths (`multiple = 0`: always the maximum lengths).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LengthBuckets {
    /// Bucket granularity in columns (`actor.length_bucket`); 0 turns buckets off.
    pub multiple: usize,
    /// `P`, the most prompt columns (`data.max_prompt_length`).
    pub max_prompt: usize,
    /// `L`, the most response columns (`data.max_response_length`).
    pub max_response: usize,
}

fn round_up(len: usize, multiple: usize, max: usize) -> usize {
    if multiple == 0 {
        return max;
    }
    len.max(1).div_ceil(multiple).saturating_mul(multiple).min(max)
}

impl LengthBuckets {
    /// `(P', L')` for rows whose longest prompt has `longest_prompt` tokens and whose longest
    /// response has `longest_response` (see the module documentation). Lengths above the
    /// maximum give the maximum; packing then reports the row that does not fit.
    pub fn bucket(&self, longest_prompt: usize, longest_response: usize) -> (usize, usize) {
        (
            round_up(longest_prompt, self.multiple, self.max_prompt),
            round_up(longest_response, self.multiple, self.max_response),
        )
    }

    /// The most `(P', L')` shapes this rule can produce.
    pub fn max_shapes(&self) -> usize {
        if self.multiple == 0 {
            return 1;
        }
        self.max_prompt.div_ceil(self.multiple).max(1) * self.max_response.div_ceil(self.multiple).max(1)
    }
}

/// A micro-batch packed at its bucket's shape.
#[derive(Clone, Debug, PartialEq)]
pub struct PackedMicroBatch {
    /// `P'`: prompt columns of the bucket.
    pub prompt_len: usize,
    /// `L'`: response columns of the bucket.
    pub response_len: usize,
    /// Whether the rows share prompts in groups (else a prompt slot per row: see
    /// [`DecoderPolicy::unshared`]).
    pub shared: bool,
    /// Real rows (the rest, up to the micro-batch size, is padding).
    pub rows: usize,
    /// The packed prompts `[U, P']` and responses `[micro_batch_size, L']`.
    pub packed: PackedRows,
}

impl PackedMicroBatch {
    /// Columns each row stands for (`P' + L'`), whether or not its prompt is shared.
    pub fn width(&self) -> usize {
        self.prompt_len + self.response_len
    }
}

/// A learner shape: the bucket's columns and whether prompts are shared.
type ShapeKey = (usize, usize, bool);

/// A [`Learner`] over a [`DecoderPolicy`] whose micro-batches run at their length bucket.
/// Per-token arrays go in and come out at the full response length `L` (zeros past a
/// response), so callers index rows the same whatever the bucket.
pub struct BucketedLearner {
    learner: Learner,
    policy: DecoderPolicy,
    cfg: StepConfig,
    specs: Vec<ParamSpec>,
    buckets: LengthBuckets,
    /// `(P', L', shared)` -> learner shape; the full shape with shared prompts is 0.
    shapes: BTreeMap<ShapeKey, usize>,
}

impl BucketedLearner {
    /// Builds the full-shape programs for `policy` (its `prompt_len`, `response_len` and
    /// `micro_batch_size`) and uploads `state`, as [`Learner::from_state`]; buckets of
    /// `multiple` columns (0: every micro-batch at the full shape).
    pub fn from_state(
        client: &Client,
        policy: DecoderPolicy,
        cfg: StepConfig,
        state: &LearnerState,
        multiple: usize,
        max_consecutive_nonfinite: u32,
    ) -> Result<BucketedLearner> {
        if cfg.frozen != policy.frozen_specs() {
            return Err(TrainerError::Config {
                key: "actor.lora_rank",
                value: cfg.frozen.len().to_string(),
                message: format!(
                    "the step configuration has {} frozen tensors and the policy reads {}; build \
                     StepConfig::frozen from DecoderPolicy::frozen_specs",
                    cfg.frozen.len(),
                    policy.frozen_specs().len()
                ),
            });
        }
        if cfg.response_len != policy.response_len as i64
            || cfg.micro_batch_size != policy.micro_batch_size as i64
        {
            return Err(TrainerError::Config {
                key: "data.max_response_length",
                value: cfg.response_len.to_string(),
                message: format!(
                    "the step configuration ({} response columns, micro-batch {}) and the policy \
                     ({} response columns, micro-batch {}) must agree",
                    cfg.response_len, cfg.micro_batch_size, policy.response_len, policy.micro_batch_size
                ),
            });
        }
        let devices = cfg.parallel.data_devices(cfg.micro_batch_size)?;
        if policy.blocks.max(1) != devices {
            return Err(TrainerError::Config {
                key: "actor.mesh",
                value: devices.to_string(),
                message: format!(
                    "the policy packs its rows in {} blocks but the learner splits them over {devices} \
                     devices of its data axis; build the policy with one block per data device",
                    policy.blocks
                ),
            });
        }
        // A mixture of experts' grouped dispatch as this client's plugin lowers it.
        let policy = policy.for_plugin(client.plugin().kind());
        let specs = policy.param_specs();
        let p = policy.clone();
        let programs = build_train_programs(&cfg, &specs, &policy.input_specs(), move |params, batch| {
            p.forward(params, batch)
        })?;
        let learner = Learner::from_state(client, programs, &specs, &cfg, state, max_consecutive_nonfinite)?;
        let buckets = LengthBuckets {
            multiple,
            max_prompt: policy.prompt_len,
            max_response: policy.response_len,
        };
        let mut shapes = BTreeMap::new();
        shapes.insert((policy.prompt_len, policy.response_len, true), 0);
        Ok(BucketedLearner {
            learner,
            policy,
            cfg,
            specs,
            buckets,
            shapes,
        })
    }

    /// The learner (parameters, state, reference, compile log).
    pub fn learner(&self) -> &Learner {
        &self.learner
    }

    /// The learner, mutably (e.g. [`Learner::set_reference`]).
    pub fn learner_mut(&mut self) -> &mut Learner {
        &mut self.learner
    }

    /// The policy at its full shape.
    pub fn policy(&self) -> &DecoderPolicy {
        &self.policy
    }

    /// The bucket rule.
    pub fn buckets(&self) -> LengthBuckets {
        self.buckets
    }

    /// The `(P', L')` shapes registered so far (the full shape included), smallest first;
    /// a bucket with and without shared prompts counts once.
    pub fn shapes(&self) -> Vec<(usize, usize)> {
        let mut out: Vec<(usize, usize)> = self.shapes.keys().map(|&(p, l, _)| (p, l)).collect();
        out.dedup();
        out
    }

    /// The `(P', L')` of learner shape `shape` (as in [`crate::step::CompileRecord::shape`]).
    pub fn shape_columns(&self, shape: usize) -> Option<(usize, usize)> {
        self.shapes
            .iter()
            .find(|(_, &s)| s == shape)
            .map(|(&(p, l, _), _)| (p, l))
    }

    /// The policy of a learner shape.
    fn shape_policy(&self, (prompt_len, response_len, shared): ShapeKey) -> DecoderPolicy {
        let policy = self.policy.with_lengths(prompt_len, response_len);
        if shared {
            policy
        } else {
            policy.unshared()
        }
    }

    /// Packs up to `micro_batch_size` `(prompt, response)` rows at the shape of their bucket,
    /// sharing each group's prompt (a slot per row when the rows do not come in groups).
    pub fn pack(&self, rows: &[(&[u32], &[u32])]) -> std::result::Result<PackedMicroBatch, PackError> {
        self.pack_routed(rows, None)
    }

    /// [`BucketedLearner::pack`] with each row's routes to replay
    /// ([`DecoderPolicy::pack_routed`]).
    pub fn pack_routed(
        &self,
        rows: &[(&[u32], &[u32])],
        routes: Option<&[Vec<u8>]>,
    ) -> std::result::Result<PackedMicroBatch, PackError> {
        let longest_prompt = rows.iter().map(|(p, _)| p.len()).max().unwrap_or(1);
        let longest_response = rows.iter().map(|(_, r)| r.len()).max().unwrap_or(1);
        let (prompt_len, response_len) = self.buckets.bucket(longest_prompt, longest_response);
        let shared = self.policy.fits(rows);
        let policy = self.shape_policy((prompt_len, response_len, shared));
        Ok(PackedMicroBatch {
            prompt_len,
            response_len,
            shared,
            rows: rows.len(),
            packed: policy.pack_routed(rows, routes)?,
        })
    }

    /// The learner shape of a packed micro-batch, tracing its programs the first time.
    fn shape(&mut self, mb: &PackedMicroBatch) -> Result<usize> {
        let key = (mb.prompt_len, mb.response_len, mb.shared);
        if let Some(&shape) = self.shapes.get(&key) {
            return Ok(shape);
        }
        let response_len = key.1;
        let policy = self.shape_policy(key);
        let p = policy.clone();
        let programs = build_shape_programs(
            &self.cfg,
            &self.specs,
            &policy.input_specs(),
            response_len as i64,
            move |params, batch| p.forward(params, batch),
        )?;
        let shape = self.learner.add_shape(programs)?;
        self.shapes.insert(key, shape);
        Ok(shape)
    }

    /// The policy's per-token log-probs of `mb` under the current (or, with `reference`, the
    /// reference) parameters, `[micro_batch_size, L]` at the full response length.
    pub fn log_probs(&mut self, mb: &PackedMicroBatch, reference: bool) -> Result<Vec<f32>> {
        Ok(self.log_probs_routed(mb, reference)?.0)
    }

    /// [`BucketedLearner::log_probs`] with, for a policy that replays routes, each real row's
    /// routes the pass used ([`DecoderPolicy::unpack_routes`]) given the rows `mb` was packed
    /// from.
    pub fn log_probs_routed(
        &mut self,
        mb: &PackedMicroBatch,
        reference: bool,
    ) -> Result<(Vec<f32>, Option<UsedRoutes>)> {
        let shape = self.shape(mb)?;
        let (lp, chosen) = self
            .learner
            .log_probs_routed_in(shape, &self.inputs(mb), reference)?;
        Ok((widen(&lp, mb.response_len, self.policy.response_len), chosen))
    }

    /// The policy inputs of `mb` for this learner's policy.
    fn inputs(&self, mb: &PackedMicroBatch) -> Vec<crate::step::HostArray> {
        mb.packed.inputs(self.policy.replays())
    }

    /// Each of `rows`' routes from a pass's chosen experts over `mb`, packed from `rows`
    /// ([`DecoderPolicy::unpack_routes`] at `mb`'s shape).
    pub fn unpack_routes(
        &self,
        rows: &[(&[u32], &[u32])],
        mb: &PackedMicroBatch,
        chosen: &UsedRoutes,
    ) -> Vec<Vec<u8>> {
        self.shape_policy((mb.prompt_len, mb.response_len, mb.shared))
            .unpack_routes(rows, &mb.packed, &chosen[0], &chosen[1])
    }

    /// Uploads a micro-batch for [`BucketedLearner::step`]: the policy inputs are `mb`'s packed
    /// rows; the per-token arrays of `host` (old, reference and rollout log-probs, advantages,
    /// response mask) are `[micro_batch_size, L]` at the full response length and are cut to
    /// the bucket's `L'` columns; `host.inputs` must be empty.
    pub fn upload(
        &mut self,
        index: usize,
        mb: &PackedMicroBatch,
        host: &MicroBatchHost,
    ) -> Result<MicroBatch> {
        let err = |message: String| TrainerError::Batch { index, message };
        if !host.inputs.is_empty() {
            return Err(err(format!(
                "{} policy inputs given; with length buckets they come from the packed micro-batch, \
                 so pass none",
                host.inputs.len()
            )));
        }
        let shape = self.shape(mb)?;
        let (full, cut) = (self.policy.response_len, mb.response_len);
        let rows = self.policy.micro_batch_size.max(mb.rows);
        let narrow = |name: &str, v: &[f32]| -> Result<Vec<f32>> {
            if v.len() != rows * full {
                return Err(err(format!(
                    "{name} has {} values; expected {rows} x {full} (rows x the full response length)",
                    v.len()
                )));
            }
            if name == "response_mask" && v.chunks(full).any(|row| row[cut..].iter().any(|m| *m != 0.0)) {
                return Err(err(format!(
                    "response_mask has tokens past column {cut}, the bucket's response length; pack the \
                     micro-batch from the same rows"
                )));
            }
            Ok(v.chunks(full)
                .flat_map(|row| row[..cut].iter().copied())
                .collect())
        };
        let narrow_opt = |name: &str, v: &Option<Vec<f32>>| -> Result<Option<Vec<f32>>> {
            v.as_deref().map(|v| narrow(name, v)).transpose()
        };
        let critic = self.cfg.value_loss.is_some();
        // A value model's micro-batch carries no policy arrays, a policy's no values.
        let narrow_policy = |name: &str, v: &[f32]| -> Result<Vec<f32>> {
            if critic {
                Ok(Vec::new())
            } else {
                narrow(name, v)
            }
        };
        let narrowed = MicroBatchHost {
            old_log_probs: narrow_policy("old_log_probs", &host.old_log_probs)?,
            advantages: narrow_policy("advantages", &host.advantages)?,
            response_mask: narrow("response_mask", &host.response_mask)?,
            ref_log_probs: narrow_opt("ref_log_probs", &host.ref_log_probs)?,
            rollout_is_weights: narrow_opt("rollout_is_weights", &host.rollout_is_weights)?,
            values: narrow_opt("values", &host.values)?,
            returns: narrow_opt("returns", &host.returns)?,
            norm: host.norm,
            inputs: self.inputs(mb),
        };
        self.learner.upload_micro_batch_in(shape, index, &narrowed)
    }

    /// One optimizer step over uploaded micro-batches (of any buckets), as [`Learner::step`].
    pub fn step(&mut self, micro_batches: &[MicroBatch], lr: f64) -> Result<StepMetrics> {
        self.learner.step(micro_batches, lr)
    }
}

/// `[rows, cut]` -> `[rows, full]`, zeros in the new columns.
fn widen(values: &[f32], cut: usize, full: usize) -> Vec<f32> {
    if cut == full {
        return values.to_vec();
    }
    let mut out = Vec::with_capacity(values.len() / cut.max(1) * full);
    for row in values.chunks(cut) {
        out.extend_from_slice(row);
        out.resize(out.len() + full - cut, 0.0);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_round_up_and_cap() {
        let b = LengthBuckets {
            multiple: 16,
            max_prompt: 64,
            max_response: 40,
        };
        assert_eq!(b.bucket(46, 16), (48, 16));
        assert_eq!(b.bucket(1, 0), (16, 16));
        assert_eq!(b.bucket(64, 17), (64, 32));
        assert_eq!(b.bucket(63, 39), (64, 40));
        assert_eq!(b.bucket(200, 200), (64, 40));
        assert_eq!(b.max_shapes(), 4 * 3);
        let off = LengthBuckets { multiple: 0, ..b };
        assert_eq!(off.bucket(3, 1), (64, 40));
        assert_eq!(off.max_shapes(), 1);
    }

    #[test]
    fn widen_pads_each_row_with_zeros() {
        assert_eq!(
            widen(&[1.0, 2.0, 3.0, 4.0], 2, 3),
            vec![1.0, 2.0, 0.0, 3.0, 4.0, 0.0]
        );
        assert_eq!(widen(&[1.0, 2.0], 2, 2), vec![1.0, 2.0]);
    }
}
