//! The learner's SPMD layout: which mesh its programs span and how each tensor is laid out on
//! it, plus the host-side splitting and gathering that turn whole host arrays into per-device
//! shards and back.
//!
//! A `dp` or `fsdp` learner over `N > 1` devices builds its programs on a one-axis mesh
//! [`DATA_AXIS`]` = N` (devices `0..N` of the client). Every micro-batch tensor (loss inputs
//! and policy inputs, `[rows, ...]`) is split on its rows; scalars (learning rate, step count,
//! normalisers, metrics) are replicated. Under `dp` parameters, Adam moments and gradient
//! accumulators are replicated; under `fsdp` each is split along its first dimension that
//! divides by `N` (replicated when none does). A mesh of one device builds the plain
//! single-device programs: splitting one way is the identity.
//!
//! Shards are contiguous blocks of the split dimension in device order, the layout XLA's
//! partitioner uses for a one-axis mesh, so [`split_host`] and [`gather_host`] are exact
//! inverses and a checkpoint is the same bytes whatever the strategy.

use xla::graph::{Mesh, Sharding};

use crate::config::{Parallelism, Strategy};
use crate::Result;

/// The name of the learner mesh's only axis.
pub const DATA_AXIS: &str = "data";

/// The mesh and the tensor layouts of one learner.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LearnerMesh {
    strategy: Strategy,
    devices: usize,
}

impl LearnerMesh {
    /// The layout for `parallel` (resolved: see [`Parallelism::resolved`]) and a micro-batch
    /// of `micro_batch_size` rows, which must split evenly over the mesh.
    pub fn new(parallel: &Parallelism, micro_batch_size: i64) -> Result<LearnerMesh> {
        let devices = parallel.devices(micro_batch_size)?;
        Ok(LearnerMesh {
            strategy: parallel.strategy,
            devices,
        })
    }

    /// The strategy.
    pub fn strategy(&self) -> Strategy {
        self.strategy
    }

    /// Devices the programs span (1 for single-device programs).
    pub fn devices(&self) -> usize {
        self.devices
    }

    /// The mesh the programs are built on; `None` for single-device programs.
    pub fn mesh(&self) -> Option<Mesh> {
        (self.devices > 1).then(|| Mesh::new(&[(DATA_AXIS, self.devices)]))
    }

    /// The layout of a parameter (and of its Adam moments, gradient accumulator and
    /// compute-dtype copy) of shape `dims`; `None` means whole on every device.
    pub fn param_sharding(&self, dims: &[i64]) -> Option<Sharding> {
        if self.devices <= 1 || self.strategy != Strategy::Fsdp {
            return None;
        }
        dims.iter()
            .position(|d| *d > 0 && d % self.devices as i64 == 0)
            .map(|dim| Sharding::split(dims.len(), dim, DATA_AXIS))
    }

    /// The layout of a micro-batch tensor of rank `rank` (rows first): rows split.
    pub fn batch_sharding(&self, rank: usize) -> Option<Sharding> {
        (self.devices > 1 && rank > 0).then(|| Sharding::split(rank, 0, DATA_AXIS))
    }
}

/// The split dimension of `sharding` (at most one on a one-axis mesh).
fn split_dim(sharding: Option<&Sharding>) -> Option<usize> {
    sharding.and_then(|s| s.dims().iter().position(|axes| !axes.is_empty()))
}

/// The shard shape and the `(outer, extent, inner)` block structure of splitting `dims` along
/// `dim` into `devices` parts.
fn blocks(dims: &[i64], dim: usize, devices: usize) -> (Vec<i64>, usize, usize, usize) {
    let mut local = dims.to_vec();
    local[dim] /= devices as i64;
    let outer: i64 = dims[..dim].iter().product();
    let inner: i64 = dims[dim + 1..].iter().product();
    (local, outer as usize, dims[dim] as usize, inner as usize)
}

/// Device `d`'s shard of a row-major host array of shape `dims` for `devices` devices, with its
/// shape: the whole array when `sharding` splits nothing, else block `d` of the split
/// dimension.
pub fn split_host<T: Copy>(
    values: &[T],
    dims: &[i64],
    sharding: Option<&Sharding>,
    devices: usize,
    d: usize,
) -> (Vec<T>, Vec<i64>) {
    let Some(dim) = split_dim(sharding).filter(|_| devices > 1) else {
        return (values.to_vec(), dims.to_vec());
    };
    let (local, outer, extent, inner) = blocks(dims, dim, devices);
    let chunk = extent / devices;
    let mut out = Vec::with_capacity(outer * chunk * inner);
    for o in 0..outer {
        let start = (o * extent + d * chunk) * inner;
        out.extend_from_slice(&values[start..start + chunk * inner]);
    }
    (out, local)
}

/// The whole row-major array of shape `dims` from the shards of every device (the inverse of
/// [`split_host`]); a replicated array is device 0's copy.
pub fn gather_host<T: Copy>(mut shards: Vec<Vec<T>>, dims: &[i64], sharding: Option<&Sharding>) -> Vec<T> {
    let devices = shards.len();
    let Some(dim) = split_dim(sharding).filter(|_| devices > 1) else {
        return shards.swap_remove(0);
    };
    let (_, outer, extent, inner) = blocks(dims, dim, devices);
    let chunk = extent / devices;
    let mut out = Vec::with_capacity(outer * extent * inner);
    for o in 0..outer {
        for shard in &shards {
            out.extend_from_slice(&shard[o * chunk * inner..(o + 1) * chunk * inner]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fsdp_splits_the_first_dimension_that_divides() {
        let m = LearnerMesh::new(&Parallelism::new(Strategy::Fsdp, 4), 8).unwrap();
        assert_eq!(m.param_sharding(&[8, 3]), Some(Sharding::split(2, 0, DATA_AXIS)));
        assert_eq!(m.param_sharding(&[6, 12]), Some(Sharding::split(2, 1, DATA_AXIS)));
        assert_eq!(m.param_sharding(&[6, 5]), None);
        assert_eq!(m.param_sharding(&[]), None);
        assert_eq!(m.batch_sharding(2), Some(Sharding::split(2, 0, DATA_AXIS)));
        assert_eq!(m.batch_sharding(0), None);
        assert_eq!(m.mesh().unwrap().num_devices(), 4);
        let dp = LearnerMesh::new(&Parallelism::new(Strategy::Dp, 4), 8).unwrap();
        assert_eq!(dp.param_sharding(&[8, 3]), None);
        let one = LearnerMesh::new(&Parallelism::new(Strategy::Fsdp, 1), 3).unwrap();
        assert_eq!((one.mesh(), one.param_sharding(&[8, 4])), (None, None));
        let err = LearnerMesh::new(&Parallelism::new(Strategy::Fsdp, 4), 6).unwrap_err();
        assert!(err
            .to_string()
            .contains("actor.ppo_micro_batch_size = 6: must divide by actor.mesh (4)"));
    }

    #[test]
    fn split_and_gather_are_inverses_on_any_dimension() {
        // [2, 4, 3] split on dim 1 over 2 devices.
        let values: Vec<i32> = (0..24).collect();
        let s = Sharding::split(3, 1, DATA_AXIS);
        let (d0, l0) = split_host(&values, &[2, 4, 3], Some(&s), 2, 0);
        let (d1, _) = split_host(&values, &[2, 4, 3], Some(&s), 2, 1);
        assert_eq!(l0, vec![2, 2, 3]);
        assert_eq!(d0, vec![0, 1, 2, 3, 4, 5, 12, 13, 14, 15, 16, 17]);
        assert_eq!(d1, vec![6, 7, 8, 9, 10, 11, 18, 19, 20, 21, 22, 23]);
        assert_eq!(gather_host(vec![d0, d1], &[2, 4, 3], Some(&s)), values);
        // Rows over 4 devices.
        let r = Sharding::split(2, 0, DATA_AXIS);
        let shards: Vec<Vec<i32>> = (0..4)
            .map(|d| split_host(&values, &[8, 3], Some(&r), 4, d).0)
            .collect();
        assert_eq!(shards[3], vec![18, 19, 20, 21, 22, 23]);
        assert_eq!(gather_host(shards, &[8, 3], Some(&r)), values);
        // Replicated.
        assert_eq!(split_host(&values, &[24], None, 4, 2).0, values);
        assert_eq!(gather_host(vec![values.clone(), vec![]], &[24], None), values);
    }
}
