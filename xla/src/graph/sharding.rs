//! SPMD layouts: a device mesh with named axes and per-tensor shardings, emitted as Shardy
//! (`sdy.mesh`, `#sdy.sharding`) attributes that XLA's partitioner turns into a program per
//! device (compile with `num_partitions` = mesh size, SPMD and the Shardy partitioner on).
//!
//! A data-parallel step shards the batch on dim 0 along the mesh axis and replicates the
//! parameters (XLA inserts the gradient all-reduce); a fully-sharded (FSDP) step also shards the
//! parameters and optimizer state on dim 0.

use std::fmt::Write;

/// The name every emitted program gives its mesh symbol.
pub(crate) const MESH_SYMBOL: &str = "mesh";

/// A logical device mesh: named axes with sizes, e.g. `[("data", 4)]`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Mesh {
    axes: Vec<(String, usize)>,
}

impl Mesh {
    /// A mesh with the given `(axis name, size)` pairs; the number of devices is their product.
    pub fn new(axes: &[(&str, usize)]) -> Mesh {
        Mesh {
            axes: axes.iter().map(|(n, s)| (n.to_string(), *s)).collect(),
        }
    }

    /// The axes in order.
    pub fn axes(&self) -> &[(String, usize)] {
        &self.axes
    }

    /// The size of the named axis, if the mesh has it.
    pub fn axis_size(&self, name: &str) -> Option<usize> {
        self.axes.iter().find(|(n, _)| n == name).map(|(_, s)| *s)
    }

    /// The number of devices the mesh spans.
    pub fn num_devices(&self) -> usize {
        self.axes.iter().map(|(_, s)| *s).product()
    }

    /// `sdy.mesh @mesh = <["data"=4]>`
    pub(crate) fn mlir(&self) -> String {
        let axes: Vec<String> = self.axes.iter().map(|(n, s)| format!("\"{n}\"={s}")).collect();
        format!("sdy.mesh @{MESH_SYMBOL} = <[{}]>", axes.join(", "))
    }
}

/// How one tensor is laid out over the mesh: for each dimension, the mesh axes it is split
/// along (empty = not split). A tensor with no split dimension is replicated on every device.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Sharding {
    dims: Vec<Vec<String>>,
}

impl Sharding {
    /// Every device holds the whole tensor of the given rank.
    pub fn replicated(rank: usize) -> Sharding {
        Sharding {
            dims: vec![Vec::new(); rank],
        }
    }

    /// Dimension `dim` of a rank-`rank` tensor is split along mesh axis `axis`.
    pub fn split(rank: usize, dim: usize, axis: &str) -> Sharding {
        let mut s = Sharding::replicated(rank);
        if dim < rank {
            s.dims[dim].push(axis.to_string());
        }
        s
    }

    /// A sharding given per dimension (`None` = not split).
    pub fn from_dims(dims: &[Option<&str>]) -> Sharding {
        Sharding {
            dims: dims
                .iter()
                .map(|d| d.map(|a| vec![a.to_string()]).unwrap_or_default())
                .collect(),
        }
    }

    /// The rank this sharding describes.
    pub fn rank(&self) -> usize {
        self.dims.len()
    }

    /// The mesh axes each dimension is split along.
    pub fn dims(&self) -> &[Vec<String>] {
        &self.dims
    }

    /// True when no dimension is split.
    pub fn is_replicated(&self) -> bool {
        self.dims.iter().all(|d| d.is_empty())
    }

    /// Checks this sharding against a tensor shape and mesh: the rank matches, every axis
    /// exists in the mesh, and each split dimension divides evenly.
    pub(crate) fn validate(&self, dims: &[i64], mesh: &Mesh) -> Result<(), String> {
        if self.dims.len() != dims.len() {
            return Err(format!(
                "sharding has {} dimensions but the tensor has rank {} (shape {:?})",
                self.dims.len(),
                dims.len(),
                dims
            ));
        }
        for (d, axes) in self.dims.iter().enumerate() {
            let mut ways = 1usize;
            for a in axes {
                match mesh.axis_size(a) {
                    Some(s) => ways *= s,
                    None => {
                        return Err(format!(
                            "sharding names mesh axis {a:?}, but the mesh has only {:?}",
                            mesh.axes.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>()
                        ))
                    }
                }
            }
            if dims[d] % ways as i64 != 0 {
                return Err(format!(
                    "dimension {d} of size {} does not split evenly {ways} ways (shape {:?})",
                    dims[d], dims
                ));
            }
        }
        Ok(())
    }

    /// The shape one device holds of a tensor with global shape `dims`.
    pub fn local_dims(&self, dims: &[i64], mesh: &Mesh) -> Vec<i64> {
        dims.iter()
            .enumerate()
            .map(|(d, &n)| {
                let ways: usize = self
                    .dims
                    .get(d)
                    .map(|axes| axes.iter().map(|a| mesh.axis_size(a).unwrap_or(1)).product())
                    .unwrap_or(1);
                n / ways as i64
            })
            .collect()
    }

    /// `<@mesh, [{"data"}, {}]>` (the body of `#sdy.sharding<...>` and of
    /// `sdy.sharding_constraint`).
    pub(crate) fn mlir_body(&self) -> String {
        let mut s = format!("<@{MESH_SYMBOL}, [");
        for (i, axes) in self.dims.iter().enumerate() {
            if i > 0 {
                s.push_str(", ");
            }
            s.push('{');
            for (j, a) in axes.iter().enumerate() {
                if j > 0 {
                    s.push_str(", ");
                }
                let _ = write!(s, "\"{a}\"");
            }
            s.push('}');
        }
        s.push_str("]>");
        s
    }

    /// `#sdy.sharding<@mesh, [{"data"}, {}]>`
    pub(crate) fn mlir_attr(&self) -> String {
        format!("#sdy.sharding{}", self.mlir_body())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mesh_and_sharding_text() {
        let mesh = Mesh::new(&[("data", 4)]);
        assert_eq!(mesh.mlir(), "sdy.mesh @mesh = <[\"data\"=4]>");
        assert_eq!(mesh.num_devices(), 4);
        let s = Sharding::split(2, 0, "data");
        assert_eq!(s.mlir_attr(), "#sdy.sharding<@mesh, [{\"data\"}, {}]>");
        assert_eq!(Sharding::replicated(0).mlir_attr(), "#sdy.sharding<@mesh, []>");
        assert_eq!(s.local_dims(&[8, 3], &mesh), vec![2, 3]);
        assert!(!s.is_replicated());
    }

    #[test]
    fn validation_names_the_problem() {
        let mesh = Mesh::new(&[("data", 4)]);
        let err = Sharding::split(2, 0, "data")
            .validate(&[6, 3], &mesh)
            .unwrap_err();
        assert!(
            err.contains("dimension 0 of size 6 does not split evenly 4 ways"),
            "{err}"
        );
        let err = Sharding::split(2, 1, "model")
            .validate(&[8, 4], &mesh)
            .unwrap_err();
        assert!(err.contains("mesh axis \"model\""), "{err}");
        let err = Sharding::replicated(1).validate(&[8, 4], &mesh).unwrap_err();
        assert!(err.contains("rank 2"), "{err}");
    }
}
