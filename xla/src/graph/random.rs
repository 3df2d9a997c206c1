//! Counter-based random numbers: Threefry-2x32 (20 rounds, Salmon et al. 2011, as in JAX and
//! Random123) written with integer primitives, so the bits depend only on the key and the
//! element position, on every backend. A key is a `u32[2]` tensor (a program argument, so
//! seeds change without recompiling).
//!
//! Element `i` of [`random_bits`] is `y0 ^ y1` where `(y0, y1) = threefry(key, (0, i))`.

use crate::dtype::DType;
use crate::graph::builder::{Graph, Tensor};

const ROTATIONS: [u32; 8] = [13, 15, 26, 6, 17, 29, 16, 24];
const KEY_PARITY: u32 = 0x1BD1_1BDA;

/// Plain Rust Threefry-2x32 (20 rounds) of one counter pair: the reference the traced version
/// is tested against, and usable on the host.
pub fn threefry2x32(key: [u32; 2], counter: [u32; 2]) -> [u32; 2] {
    let ks = [key[0], key[1], key[0] ^ key[1] ^ KEY_PARITY];
    let mut x0 = counter[0].wrapping_add(ks[0]);
    let mut x1 = counter[1].wrapping_add(ks[1]);
    for r in 0..20 {
        x0 = x0.wrapping_add(x1);
        x1 = x1.rotate_left(ROTATIONS[r % 8]);
        x1 ^= x0;
        if r % 4 == 3 {
            let j = (r + 1) / 4;
            x0 = x0.wrapping_add(ks[j % 3]);
            x1 = x1.wrapping_add(ks[(j + 1) % 3]).wrapping_add(j as u32);
        }
    }
    [x0, x1]
}

/// The host-side counterpart of [`random_bits`] for `n` elements.
pub fn random_bits_reference(key: [u32; 2], n: usize) -> Vec<u32> {
    (0..n)
        .map(|i| {
            let [a, b] = threefry2x32(key, [0, i as u32]);
            a ^ b
        })
        .collect()
}

fn key_word(key: &Tensor, i: i64) -> Tensor {
    key.slice_axis(0, i, i + 1).reshape(&[])
}

/// Traced Threefry-2x32 of counter pairs `(c0, c1)` (u32 tensors of one shape) under `key`.
#[track_caller]
pub fn threefry2x32_traced(key: &Tensor, c0: &Tensor, c1: &Tensor) -> (Tensor, Tensor) {
    let graph = c0.graph().clone();
    if key.dtype() != DType::U32 || key.dims() != [2] {
        graph.op_error(
            "threefry2x32",
            format!("the key must be u32[2], got {}", key.ty()),
            std::panic::Location::caller(),
        );
        return (c0.clone(), c1.clone());
    }
    let dims = c0.dims().to_vec();
    let k0 = key_word(key, 0);
    let k1 = key_word(key, 1);
    let k01 = k0.xor(&k1);
    let k2 = k01.xor(&k01.full_like(KEY_PARITY as f64));
    let ks: Vec<Tensor> = [k0, k1, k2].iter().map(|k| k.broadcast_to(&dims)).collect();
    let rotl = |x: &Tensor, r: u32| -> Tensor {
        let left = x.shift_left(&graph.full(r as f64, DType::U32, &dims));
        let right = x.shift_right_logical(&graph.full((32 - r) as f64, DType::U32, &dims));
        left.or(&right)
    };
    let mut x0 = c0 + &ks[0];
    let mut x1 = c1 + &ks[1];
    for r in 0..20 {
        x0 = &x0 + &x1;
        x1 = rotl(&x1, ROTATIONS[r % 8]).xor(&x0);
        if r % 4 == 3 {
            let j = (r + 1) / 4;
            x0 = &x0 + &ks[j % 3];
            x1 = &(&x1 + &ks[(j + 1) % 3]) + j as f64;
        }
    }
    (x0, x1)
}

/// A `u32[2]` key from a seed, as a constant (`[0, seed]`, JAX's `PRNGKey` convention).
#[track_caller]
pub fn key_from_seed(graph: &Graph, seed: u32) -> Tensor {
    graph.constant_i64(&[0, seed as i64], DType::U32, &[2])
}

/// Uniform random `u32` bits of the given shape.
#[track_caller]
pub fn random_bits(key: &Tensor, dims: &[i64]) -> Tensor {
    let graph = key.graph().clone();
    let n: i64 = dims.iter().product();
    let lo = graph.iota(DType::U32, &[n], 0);
    let hi = graph.zeros(DType::U32, &[n]);
    let (y0, y1) = threefry2x32_traced(key, &hi, &lo);
    y0.xor(&y1).reshape(dims)
}

/// Uniform floats in `[0, 1)` with 23 random mantissa bits (made in f32, then converted to
/// `dtype`).
#[track_caller]
pub fn uniform(key: &Tensor, dims: &[i64], dtype: DType) -> Tensor {
    let bits = random_bits(key, dims);
    let graph = key.graph();
    let mantissa = bits.shift_right_logical(&graph.full(9.0, DType::U32, dims));
    let one_to_two = mantissa
        .or(&graph.full(0x3F80_0000 as f64, DType::U32, dims))
        .bitcast(DType::F32);
    (&one_to_two - 1.0).convert_if_needed(dtype)
}

/// Standard normal samples (Box-Muller over two uniform streams from split keys).
#[track_caller]
pub fn normal(key: &Tensor, dims: &[i64], dtype: DType) -> Tensor {
    let keys = split(key, 2);
    let k1 = keys.slice_axis(0, 0, 1).reshape(&[2]);
    let k2 = keys.slice_axis(0, 1, 2).reshape(&[2]);
    let u1 = 1.0 - &uniform(&k1, dims, DType::F32);
    let u2 = uniform(&k2, dims, DType::F32);
    let r = (&u1.log() * -2.0).sqrt();
    let z = &r * &(&u2 * std::f64::consts::TAU).cos();
    z.convert_if_needed(dtype)
}

/// `n` independent keys `u32[n, 2]` derived from `key`.
#[track_caller]
pub fn split(key: &Tensor, n: i64) -> Tensor {
    let graph = key.graph().clone();
    let c0 = &graph.iota(DType::U32, &[n], 0) + 1.0;
    let c1 = graph.zeros(DType::U32, &[n]);
    let (y0, y1) = threefry2x32_traced(key, &c0, &c1);
    Tensor::concat(&[&y0.reshape(&[n, 1]), &y1.reshape(&[n, 1])], 1)
}

/// A new key from `key` and a u32 scalar `data` (e.g. the step number).
#[track_caller]
pub fn fold_in(key: &Tensor, data: &Tensor) -> Tensor {
    let graph = key.graph().clone();
    let c0 = graph.zeros(DType::U32, &[1]);
    let c1 = data.reshape(&[1]);
    let (y0, y1) = threefry2x32_traced(key, &c0, &c1);
    Tensor::concat(&[&y0, &y1], 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threefry_known_answers() {
        // Known-answer vectors of Random123 / JAX's threefry_2x32 test.
        assert_eq!(threefry2x32([0, 0], [0, 0]), [0x6b20_0159, 0x99ba_4efe]);
        assert_eq!(
            threefry2x32([u32::MAX, u32::MAX], [u32::MAX, u32::MAX]),
            [0x1cb9_96fc, 0xbb00_2be7]
        );
        assert_eq!(
            threefry2x32([0x1319_8a2e, 0x0370_7344], [0x243f_6a88, 0x85a3_08d3]),
            [0xc492_3a9c, 0x483d_f7a0]
        );
    }
}
