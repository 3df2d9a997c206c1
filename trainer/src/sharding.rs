//! The learner's SPMD layout: which mesh its programs span and how each tensor is laid out on
//! it. The host-side splitting and gathering of whole arrays is `xla::graph`'s
//! ([`xla::graph::shard_host`], [`xla::graph::assemble_host`]).
//!
//! A `dp` or `fsdp` learner over `N > 1` devices builds its programs on the mesh
//! [`DATA_AXIS`]` = N / tp` x [`model::MODEL_AXIS`]` = tp` (devices `0..N` of the client,
//! row-major; only the data axis when `tp` is 1). Every micro-batch tensor (loss inputs and
//! policy inputs, `[rows, ...]`) is split on its rows over the data axis and whole over the
//! model axis; scalars (learning rate, step count, normalisers, metrics) are replicated. A
//! parameter (with its Adam moments, gradient accumulator and compute copy) is split over the
//! model axis by the Megatron layout ([`model::ParamSpec::tensor_parallel_dim`]); under `fsdp`
//! also over the data axis along its first other dimension that divides ([`model::ParamLayout`]).
//! A mesh of one device builds the plain single-device programs.

use xla::graph::{Mesh, Sharding};

use crate::config::{Parallelism, Strategy};
use crate::Result;
use model::{ParamLayout, ParamSpec, MODEL_AXIS};

/// The name of the learner mesh's data (row) axis.
pub const DATA_AXIS: &str = "data";

/// The mesh and the tensor layouts of one learner.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LearnerMesh {
    strategy: Strategy,
    data: usize,
    model: usize,
}

impl LearnerMesh {
    /// The layout for `parallel` (resolved: see [`Parallelism::resolved`]) and a micro-batch
    /// of `micro_batch_size` rows, which must split evenly over the data axis.
    pub fn new(parallel: &Parallelism, micro_batch_size: i64) -> Result<LearnerMesh> {
        let devices = parallel.devices(micro_batch_size)?;
        let model = parallel.tensor_parallel.max(1);
        Ok(LearnerMesh {
            strategy: parallel.strategy,
            data: devices / model,
            model,
        })
    }

    /// The strategy.
    pub fn strategy(&self) -> Strategy {
        self.strategy
    }

    /// Devices the programs span (1 for single-device programs).
    pub fn devices(&self) -> usize {
        self.data * self.model
    }

    /// Devices of the data axis: the blocks a micro-batch's rows are split into.
    pub fn data_devices(&self) -> usize {
        self.data
    }

    /// Devices of the tensor-parallel axis (1: none).
    pub fn tensor_parallel(&self) -> usize {
        self.model
    }

    /// The mesh the programs are built on; `None` for single-device programs.
    pub fn mesh(&self) -> Option<Mesh> {
        match (self.devices(), self.model) {
            (1, _) => None,
            (n, 1) => Some(Mesh::new(&[(DATA_AXIS, n)])),
            _ => Some(Mesh::new(&[(DATA_AXIS, self.data), (MODEL_AXIS, self.model)])),
        }
    }

    /// The layout of parameter `spec` (and of its Adam moments, gradient accumulator and
    /// compute-dtype copy); `None` means whole on every device.
    pub fn param_sharding(&self, spec: &ParamSpec) -> Option<Sharding> {
        if self.devices() <= 1 {
            return None;
        }
        ParamLayout {
            fsdp: (self.strategy == Strategy::Fsdp).then_some((DATA_AXIS, self.data)),
            tensor_parallel: self.model,
        }
        .sharding(spec)
    }

    /// The layout of a micro-batch tensor of rank `rank` (rows first): rows split over the
    /// data axis.
    pub fn batch_sharding(&self, rank: usize) -> Option<Sharding> {
        (self.data > 1 && rank > 0).then(|| Sharding::split(rank, 0, DATA_AXIS))
    }

    /// Whether any parameter is split (so whole copies need a gather).
    pub fn splits_params(&self) -> bool {
        self.devices() > 1 && (self.strategy == Strategy::Fsdp || self.model > 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use model::ParamKind;

    fn spec(dims: &[usize]) -> ParamSpec {
        ParamSpec::new("w", dims.to_vec(), ParamKind::Matrix)
    }

    #[test]
    fn fsdp_splits_the_first_dimension_that_divides() {
        let m = LearnerMesh::new(&Parallelism::new(Strategy::Fsdp, 4), 8).unwrap();
        assert_eq!(
            m.param_sharding(&spec(&[8, 3])),
            Some(Sharding::split(2, 0, DATA_AXIS))
        );
        assert_eq!(
            m.param_sharding(&spec(&[6, 12])),
            Some(Sharding::split(2, 1, DATA_AXIS))
        );
        assert_eq!(m.param_sharding(&spec(&[6, 5])), None);
        assert_eq!(m.param_sharding(&spec(&[])), None);
        assert_eq!(m.batch_sharding(2), Some(Sharding::split(2, 0, DATA_AXIS)));
        assert_eq!(m.batch_sharding(0), None);
        assert_eq!(m.mesh().unwrap().num_devices(), 4);
        let dp = LearnerMesh::new(&Parallelism::new(Strategy::Dp, 4), 8).unwrap();
        assert_eq!(dp.param_sharding(&spec(&[8, 3])), None);
        assert!(!dp.splits_params());
        let one = LearnerMesh::new(&Parallelism::new(Strategy::Fsdp, 1), 3).unwrap();
        assert_eq!((one.mesh(), one.param_sharding(&spec(&[8, 4]))), (None, None));
        let err = LearnerMesh::new(&Parallelism::new(Strategy::Fsdp, 4), 6).unwrap_err();
        assert!(err
            .to_string()
            .contains("actor.ppo_micro_batch_size = 6: must divide by actor.mesh (4)"));
    }

    #[test]
    fn tensor_parallel_meshes_split_rows_by_data_and_parameters_by_model() {
        let m = LearnerMesh::new(&Parallelism::new(Strategy::Fsdp, 4).with_tensor_parallel(2), 2).unwrap();
        assert_eq!(m.mesh(), Some(Mesh::new(&[(DATA_AXIS, 2), (MODEL_AXIS, 2)])));
        assert_eq!((m.devices(), m.data_devices(), m.tensor_parallel()), (4, 2, 2));
        let column = spec(&[8, 6]).split_by_model(0, 1);
        assert_eq!(
            m.param_sharding(&column),
            Some(Sharding::split(2, 1, DATA_AXIS).and_split(0, MODEL_AXIS))
        );
        assert_eq!(m.batch_sharding(2), Some(Sharding::split(2, 0, DATA_AXIS)));
        // Pure tensor parallelism: a data axis of one device, rows whole.
        let tp = LearnerMesh::new(&Parallelism::new(Strategy::Dp, 2).with_tensor_parallel(2), 3).unwrap();
        assert_eq!(tp.batch_sharding(2), None);
        assert_eq!(
            tp.param_sharding(&column),
            Some(Sharding::split(2, 0, MODEL_AXIS))
        );
        assert_eq!(tp.param_sharding(&spec(&[8, 6])), None);
        assert!(tp.splits_params());
    }
}
