//! SPMD layouts: a device mesh with named axes and per-tensor shardings, emitted as Shardy
//! (`sdy.mesh`, `#sdy.sharding`) attributes that XLA's partitioner turns into a program per
//! device (compile with `num_partitions` = mesh size, SPMD and the Shardy partitioner on).
//!
//! A data-parallel step shards the batch on dim 0 along the mesh axis and replicates the
//! parameters (XLA inserts the gradient all-reduce); a fully-sharded (FSDP) step also shards the
//! parameters and optimizer state on dim 0.
//!
//! The host side of a layout lives here too: [`shard_host`] cuts a whole host array into a
//! device's part by a sharding and [`assemble_host`] joins the parts back, exactly inverse;
//! [`Mesh::common_refinement`] finds the mesh two layouts both nest in, on which one program
//! reshards tensors from one layout to the other.

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

    /// Device `device`'s coordinate on each axis. Devices `0..N` fill the mesh in row-major
    /// order (the last axis varies fastest), the order XLA's partitioner assigns a mesh's
    /// logical devices to the partitions `0..N` of a program.
    pub fn coords(&self, device: usize) -> Vec<usize> {
        let mut rest = device;
        let mut coords = vec![0; self.axes.len()];
        for (i, (_, size)) in self.axes.iter().enumerate().rev() {
            coords[i] = rest % size;
            rest /= size;
        }
        coords
    }

    /// The mesh refining both `self` and `other` (two meshes over the same devices `0..N`),
    /// with each of their axes as the refined axes it spans, major first: e.g. `["data"=4]`
    /// and `["slots"=2, "model"=2]` give `["r0"=2, "r1"=2]` with `data -> [r0, r1]`,
    /// `slots -> [r0]`, `model -> [r1]`. A program that takes tensors laid out on one mesh
    /// and returns them laid out on the other is built on it. `None` when the meshes span
    /// different device counts or their axes cut the row-major device order at places that
    /// do not nest (`[2, 3]` and `[3, 2]`).
    pub fn common_refinement(&self, other: &Mesh) -> Option<Refinement> {
        let n = self.num_devices();
        if other.num_devices() != n {
            return None;
        }
        // Cut points: the number of blocks of the devices before each axis boundary.
        let cuts = |m: &Mesh| -> Vec<usize> {
            let mut p = 1;
            let mut out = vec![1];
            for (_, s) in &m.axes {
                p *= s;
                out.push(p);
            }
            out
        };
        let mut all: Vec<usize> = cuts(self).into_iter().chain(cuts(other)).collect();
        all.sort_unstable();
        all.dedup();
        if all.windows(2).any(|w| w[1] % w[0] != 0) {
            return None;
        }
        let names: Vec<String> = (1..all.len()).map(|i| format!("r{}", i - 1)).collect();
        let mesh = Mesh {
            axes: names
                .iter()
                .zip(all.windows(2))
                .map(|(name, w)| (name.clone(), w[1] / w[0]))
                .collect(),
        };
        let spans = |m: &Mesh| -> Vec<(String, Vec<String>)> {
            let mut p = 1;
            m.axes
                .iter()
                .map(|(axis, s)| {
                    let (from, to) = (p, p * s);
                    p = to;
                    let a = all.iter().position(|&c| c == from).expect("a cut");
                    let b = all.iter().position(|&c| c == to).expect("a cut");
                    (axis.clone(), names[a..b].to_vec())
                })
                .collect()
        };
        Some(Refinement {
            first: spans(self),
            second: spans(other),
            mesh,
        })
    }

    /// `sdy.mesh @mesh = <["data"=4]>`
    pub(crate) fn mlir(&self) -> String {
        let axes: Vec<String> = self.axes.iter().map(|(n, s)| format!("\"{n}\"={s}")).collect();
        format!("sdy.mesh @{MESH_SYMBOL} = <[{}]>", axes.join(", "))
    }
}

/// Two meshes over the same devices expressed on one finer mesh ([`Mesh::common_refinement`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refinement {
    /// The finer mesh.
    pub mesh: Mesh,
    first: Vec<(String, Vec<String>)>,
    second: Vec<(String, Vec<String>)>,
}

impl Refinement {
    /// A sharding on the first mesh, on the finer one.
    pub fn first(&self, sharding: &Sharding) -> Sharding {
        sharding.renamed(&self.first)
    }

    /// A sharding on the second mesh, on the finer one.
    pub fn second(&self, sharding: &Sharding) -> Sharding {
        sharding.renamed(&self.second)
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

    /// Dimension `dim` split along `axis` besides what it is split along already (after
    /// them: `axis` is the minor one).
    pub fn and_split(mut self, dim: usize, axis: &str) -> Sharding {
        if dim < self.dims.len() {
            self.dims[dim].push(axis.to_string());
        }
        self
    }

    /// The mesh axes this sharding names, each once.
    pub fn axes(&self) -> Vec<&str> {
        let mut out: Vec<&str> = Vec::new();
        for a in self.dims.iter().flatten() {
            if !out.contains(&a.as_str()) {
                out.push(a);
            }
        }
        out
    }

    /// This sharding with each axis replaced by the axes `names` maps it to (in order).
    fn renamed(&self, names: &[(String, Vec<String>)]) -> Sharding {
        Sharding {
            dims: self
                .dims
                .iter()
                .map(|axes| {
                    axes.iter()
                        .flat_map(|a| {
                            names
                                .iter()
                                .find(|(n, _)| n == a)
                                .map(|(_, to)| to.clone())
                                .unwrap_or_else(|| vec![a.clone()])
                        })
                        .collect()
                })
                .collect(),
        }
    }

    /// The block of every dimension that the device at mesh coordinates `coords` holds:
    /// `(index, blocks)` per dimension; a dimension split along several axes counts its
    /// blocks with the first axis major.
    fn blocks_at(&self, mesh: &Mesh, coords: &[usize]) -> Vec<(usize, usize)> {
        self.dims
            .iter()
            .map(|axes| {
                axes.iter().fold((0, 1), |(index, ways), a| {
                    let i = mesh
                        .axes
                        .iter()
                        .position(|(n, _)| n == a)
                        .expect("validated axis");
                    let size = mesh.axes[i].1;
                    (index * size + coords[i], ways * size)
                })
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

/// The block of a row-major array of global shape `dims` that one device holds: per
/// dimension its first index and extent.
fn block_of(
    dims: &[i64],
    sharding: Option<&Sharding>,
    mesh: Option<&Mesh>,
    device: usize,
) -> Vec<(usize, usize)> {
    match (sharding, mesh) {
        (Some(s), Some(m)) if !s.is_replicated() => s
            .blocks_at(m, &m.coords(device))
            .into_iter()
            .zip(dims)
            .map(|((index, ways), &n)| {
                let local = n as usize / ways;
                (index * local, local)
            })
            .collect(),
        _ => dims.iter().map(|&n| (0, n as usize)).collect(),
    }
}

/// Calls `f(global offset, local offset, run)` for each contiguous run of the block `block`
/// of a row-major array of shape `dims` (runs along the last dimension).
fn for_each_run(dims: &[i64], block: &[(usize, usize)], mut f: impl FnMut(usize, usize, usize)) {
    if dims.is_empty() {
        f(0, 0, 1);
        return;
    }
    let rank = dims.len();
    let run = block[rank - 1].1;
    if block.iter().any(|(_, n)| *n == 0) {
        return;
    }
    let outer: usize = block[..rank - 1].iter().map(|(_, n)| n).product();
    let mut index = vec![0usize; rank - 1];
    for local_row in 0..outer {
        let mut global = 0usize;
        for d in 0..rank - 1 {
            global = global * dims[d] as usize + block[d].0 + index[d];
        }
        global = global * dims[rank - 1] as usize + block[rank - 1].0;
        f(global, local_row * run, run);
        for d in (0..rank - 1).rev() {
            index[d] += 1;
            if index[d] < block[d].1 {
                break;
            }
            index[d] = 0;
        }
    }
}

/// Device `device`'s part of a row-major host array of global shape `dims` laid out by
/// `sharding` on `mesh`, with its shape: the whole array when either is `None` or nothing is
/// split. Blocks follow [`Mesh::coords`], as XLA's partitioner lays them out, so
/// [`assemble_host`] is the exact inverse.
pub fn shard_host<T: Copy>(
    values: &[T],
    dims: &[i64],
    sharding: Option<&Sharding>,
    mesh: Option<&Mesh>,
    device: usize,
) -> (Vec<T>, Vec<i64>) {
    let block = block_of(dims, sharding, mesh, device);
    let local: Vec<i64> = block.iter().map(|(_, n)| *n as i64).collect();
    if local == dims {
        return (values.to_vec(), local);
    }
    let mut out = Vec::with_capacity(local.iter().product::<i64>() as usize);
    for_each_run(dims, &block, |global, _, run| {
        out.extend_from_slice(&values[global..global + run]);
    });
    (out, local)
}

/// The devices whose parts [`assemble_host`] reads: the first device holding each distinct
/// block of a tensor laid out by `sharding` on `mesh` (device 0 alone when nothing is split).
pub fn holders(dims: &[i64], sharding: Option<&Sharding>, mesh: Option<&Mesh>) -> Vec<usize> {
    let n = mesh.map_or(1, Mesh::num_devices);
    let mut seen: Vec<Vec<(usize, usize)>> = Vec::new();
    let mut out = Vec::new();
    for d in 0..n {
        let b = block_of(dims, sharding, mesh, d);
        if !seen.contains(&b) {
            seen.push(b);
            out.push(d);
        }
    }
    out
}

/// The whole row-major array of shape `dims` laid out by `sharding` on `mesh`, from the parts
/// of the devices [`holders`] names, each read with `read(device)` (the inverse of
/// [`shard_host`]).
pub fn assemble_host<T: Copy + Default, E>(
    dims: &[i64],
    sharding: Option<&Sharding>,
    mesh: Option<&Mesh>,
    mut read: impl FnMut(usize) -> Result<Vec<T>, E>,
) -> Result<Vec<T>, E> {
    let devices = holders(dims, sharding, mesh);
    if devices.len() == 1
        && block_of(dims, sharding, mesh, devices[0])
            .iter()
            .zip(dims)
            .all(|((_, n), &d)| *n as i64 == d)
    {
        return read(devices[0]);
    }
    let mut out = vec![T::default(); dims.iter().product::<i64>() as usize];
    for d in devices {
        let part = read(d)?;
        for_each_run(dims, &block_of(dims, sharding, mesh, d), |global, local, run| {
            out[global..global + run].copy_from_slice(&part[local..local + run]);
        });
    }
    Ok(out)
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

    #[test]
    fn coordinates_are_row_major_and_blocks_follow_them() {
        let mesh = Mesh::new(&[("data", 2), ("model", 3)]);
        assert_eq!(mesh.coords(0), vec![0, 0]);
        assert_eq!(mesh.coords(4), vec![1, 1]);
        assert_eq!(mesh.coords(5), vec![1, 2]);
        // [4, 6]: rows over data, columns over model.
        let values: Vec<i32> = (0..24).collect();
        let s = Sharding::from_dims(&[Some("data"), Some("model")]);
        let (part, local) = shard_host(&values, &[4, 6], Some(&s), Some(&mesh), 4);
        assert_eq!(local, vec![2, 2]);
        assert_eq!(part, vec![14, 15, 20, 21]);
        let whole = assemble_host::<i32, ()>(&[4, 6], Some(&s), Some(&mesh), |d| {
            Ok(shard_host(&values, &[4, 6], Some(&s), Some(&mesh), d).0)
        })
        .unwrap();
        assert_eq!(whole, values);
        // Replicated over data: devices 0..3 hold the three column blocks.
        let cols = Sharding::split(2, 1, "model");
        assert_eq!(holders(&[4, 6], Some(&cols), Some(&mesh)), vec![0, 1, 2]);
        // Rows split over both axes, data major: device (1, 0) holds block 3 of 6.
        let both = Sharding::split(2, 0, "data").and_split(0, "model");
        let (part, local) = shard_host(&values[..], &[6, 4], Some(&both), Some(&mesh), 3);
        assert_eq!((part, local), (vec![12, 13, 14, 15], vec![1, 4]));
        let read = |d| Ok::<_, ()>(shard_host(&values, &[6, 4], Some(&both), Some(&mesh), d).0);
        assert_eq!(
            assemble_host(&[6, 4], Some(&both), Some(&mesh), read).unwrap(),
            values
        );
        // Scalars and replicated tensors are whole everywhere.
        assert_eq!(shard_host(&[7], &[], None, Some(&mesh), 5), (vec![7], vec![]));
        assert_eq!(holders(&[24], None, Some(&mesh)), vec![0]);
    }

    #[test]
    fn meshes_over_the_same_devices_refine_when_their_cuts_nest() {
        let fsdp = Mesh::new(&[("data", 4)]);
        let tp = Mesh::new(&[("slots", 2), ("model", 2)]);
        let r = fsdp.common_refinement(&tp).unwrap();
        assert_eq!(r.mesh, Mesh::new(&[("r0", 2), ("r1", 2)]));
        assert_eq!(
            r.first(&Sharding::split(2, 1, "data")),
            Sharding::split(2, 1, "r0").and_split(1, "r1")
        );
        assert_eq!(
            r.second(&Sharding::split(2, 0, "model")),
            Sharding::split(2, 0, "r1")
        );
        // The same device's block is the same on the refined mesh.
        let values: Vec<i32> = (0..32).collect();
        let s = Sharding::split(2, 1, "data");
        for d in 0..4 {
            assert_eq!(
                shard_host(&values, &[4, 8], Some(&s), Some(&fsdp), d),
                shard_host(&values, &[4, 8], Some(&r.first(&s)), Some(&r.mesh), d)
            );
        }
        let a = Mesh::new(&[("data", 2), ("model", 4)]);
        let b = Mesh::new(&[("slots", 4), ("model", 2)]);
        let r = a.common_refinement(&b).unwrap();
        assert_eq!(r.mesh.axes().len(), 3);
        assert_eq!(
            r.first(&Sharding::split(1, 0, "model")),
            Sharding::split(1, 0, "r1").and_split(0, "r2")
        );
        assert!(Mesh::new(&[("a", 2), ("b", 3)])
            .common_refinement(&Mesh::new(&[("c", 3), ("d", 2)]))
            .is_none());
        assert!(fsdp.common_refinement(&Mesh::new(&[("x", 8)])).is_none());
    }
}
