//! Programs built with the graph builder give the same numbers as plain Rust on random
//! inputs: element-wise math, matmul, reductions, gather/scatter, softmax and the other
//! composites, cumsum, sort/top-k, shape ops and random bits.

mod graph_support;

use graph_support::{assert_close, read, rng, run, uniform, upload};
use rand::Rng;
use xla::graph::{random, DotDims, Graph, Tensor};
use xla::DType;

fn to_f64(v: &[f32]) -> Vec<f64> {
    v.iter().map(|x| *x as f64).collect()
}

#[test]
fn elementwise_math_matches_rust() {
    let mut r = rng("elementwise");
    let n = 12;
    let x = uniform(&mut r, n, 0.2, 3.0);
    let y = uniform(&mut r, n, -2.0, 2.0);
    let g = Graph::new("elementwise");
    let tx = g.parameter("x", DType::F64, &[3, 4]);
    let ty = g.parameter("y", DType::F64, &[3, 4]);
    type F = fn(f64, f64) -> f64;
    let cases: Vec<(&str, Tensor, F)> = vec![
        ("neg", tx.neg(), |a, _| -a),
        ("exp", ty.exp(), |_, b| b.exp()),
        ("log", tx.log(), |a, _| a.ln()),
        ("log1p", tx.log1p(), |a, _| a.ln_1p()),
        ("tanh", ty.tanh(), |_, b| b.tanh()),
        ("logistic", ty.logistic(), |_, b| 1.0 / (1.0 + (-b).exp())),
        ("sqrt", tx.sqrt(), |a, _| a.sqrt()),
        ("rsqrt", tx.rsqrt(), |a, _| 1.0 / a.sqrt()),
        ("abs", ty.abs(), |_, b| b.abs()),
        ("sign", ty.sign(), |_, b| b.signum()),
        ("sin", ty.sin(), |_, b| b.sin()),
        ("cos", ty.cos(), |_, b| b.cos()),
        ("floor", ty.floor(), |_, b| b.floor()),
        ("add", &tx + &ty, |a, b| a + b),
        ("sub", &tx - &ty, |a, b| a - b),
        ("mul", &tx * &ty, |a, b| a * b),
        ("div", &ty / &tx, |a, b| b / a),
        ("pow", tx.pow(&ty), |a, b| a.powf(b)),
        ("max", tx.max(&ty), |a, b| a.max(b)),
        ("min", tx.min(&ty), |a, b| a.min(b)),
        ("rem", ty.rem(&tx), |a, b| b % a),
        ("scalar", &(2.5 - &tx) * 3.0, |a, _| (2.5 - a) * 3.0),
        ("clamp", ty.clamp_scalar(-0.5, 0.7), |_, b| b.clamp(-0.5, 0.7)),
        (
            "select",
            tx.gt(&ty).select(&tx, &ty),
            |a, b| if a > b { a } else { b },
        ),
    ];
    let outs: Vec<&Tensor> = cases.iter().map(|c| &c.1).collect();
    let bx = upload(&x, &[3, 4]);
    let by = upload(&y, &[3, 4]);
    let got = run(&g.build(&outs).unwrap(), &[&bx, &by]);
    for ((name, _, f), b) in cases.iter().zip(&got) {
        let want: Vec<f64> = x.iter().zip(&y).map(|(a, b)| f(*a, *b)).collect();
        assert_close(name, &read::<f64>(b), &want, 1e-12);
    }
}

#[test]
fn integer_bool_and_compare_ops_match_rust() {
    let mut r = rng("integer");
    let a: Vec<u32> = (0..8).map(|_| r.random()).collect();
    let b: Vec<u32> = (0..8).map(|_| r.random_range(0..32)).collect();
    let s: Vec<i32> = (0..8).map(|_| r.random_range(-50..50)).collect();
    let t: Vec<i32> = (0..8).map(|_| r.random_range(1..9)).collect();
    let g = Graph::new("ints");
    let ta = g.parameter("a", DType::U32, &[8]);
    let tb = g.parameter("b", DType::U32, &[8]);
    let ts = g.parameter("s", DType::I32, &[8]);
    let tt = g.parameter("t", DType::I32, &[8]);
    let outs = [
        ta.xor(&tb),
        ta.and(&tb),
        ta.or(&tb),
        ta.shift_left(&tb),
        ta.shift_right_logical(&tb),
        &ta + &tb,
        ts.rem(&tt),
        &ts / &tt,
        ts.not(),
    ];
    let cmp = [ts.lt(&tt), ts.ge(&tt), ts.eq(&ts), ts.ne(&tt), ts.gt(&tt).not()];
    let mut refs: Vec<&Tensor> = outs.iter().collect();
    refs.extend(cmp.iter());
    let args = [
        upload(&a, &[8]),
        upload(&b, &[8]),
        upload(&s, &[8]),
        upload(&t, &[8]),
    ];
    let got = run(&g.build(&refs).unwrap(), &args.iter().collect::<Vec<_>>());
    let u = |i: usize| read::<u32>(&got[i]);
    let si = |i: usize| read::<i32>(&got[i]);
    let bo = |i: usize| read::<bool>(&got[i]);
    for k in 0..8 {
        assert_eq!(u(0)[k], a[k] ^ b[k]);
        assert_eq!(u(1)[k], a[k] & b[k]);
        assert_eq!(u(2)[k], a[k] | b[k]);
        assert_eq!(u(3)[k], a[k] << b[k]);
        assert_eq!(u(4)[k], a[k] >> b[k]);
        assert_eq!(u(5)[k], a[k].wrapping_add(b[k]));
        assert_eq!(si(6)[k], s[k] % t[k]);
        assert_eq!(si(7)[k], s[k] / t[k]);
        assert_eq!(si(8)[k], !s[k]);
        assert_eq!(bo(9)[k], s[k] < t[k]);
        assert_eq!(bo(10)[k], s[k] >= t[k]);
        assert!(bo(11)[k]);
        assert_eq!(bo(12)[k], s[k] != t[k]);
        assert_eq!(bo(13)[k], s[k] <= t[k]);
    }
}

fn matmul_ref(a: &[f64], b: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
    let mut c = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            c[i * n + j] = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
        }
    }
    c
}

#[test]
fn matmul_and_batched_dot_match_rust() {
    let mut r = rng("matmul");
    let (bt, m, k, n) = (3, 5, 7, 4);
    let a = uniform(&mut r, bt * m * k, -1.0, 1.0);
    let b = uniform(&mut r, bt * k * n, -1.0, 1.0);
    let g = Graph::new("matmul");
    let ta = g.parameter("a", DType::F32, &[bt as i64, m as i64, k as i64]);
    let tb = g.parameter("b", DType::F32, &[bt as i64, k as i64, n as i64]);
    let batched = ta.matmul(&tb);
    // The same product through bf16 operands with f32 results.
    let mixed = ta.convert(DType::BF16).dot_general(
        &tb.convert(DType::BF16),
        DotDims {
            lhs_batch: vec![0],
            rhs_batch: vec![0],
            lhs_contract: vec![2],
            rhs_contract: vec![1],
        },
        Some(DType::F32),
    );
    // Plain 2-D matmul of the first batch.
    let first = ta.slice_axis(0, 0, 1).reshape(&[m as i64, k as i64]);
    let plain = first.matmul(&tb.slice_axis(0, 0, 1).reshape(&[k as i64, n as i64]));
    let af: Vec<f32> = a.iter().map(|x| *x as f32).collect();
    let bf: Vec<f32> = b.iter().map(|x| *x as f32).collect();
    let p = g.build(&[&batched, &mixed, &plain]).unwrap();
    assert!(
        p.mlir()
            .contains("batching_dims = [0] x [0], contracting_dims = [2] x [1]"),
        "{}",
        p.mlir()
    );
    let got = run(
        &p,
        &[
            &upload(&af, &[bt as i64, m as i64, k as i64]),
            &upload(&bf, &[bt as i64, k as i64, n as i64]),
        ],
    );
    let a32 = to_f64(&af);
    let b32 = to_f64(&bf);
    let round_bf16 = |v: &[f64]| {
        v.iter()
            .map(|x| half::bf16::from_f64(*x).to_f64())
            .collect::<Vec<_>>()
    };
    let (abf, bbf) = (round_bf16(&a32), round_bf16(&b32));
    let mut want = Vec::new();
    let mut want_bf = Vec::new();
    for i in 0..bt {
        want.extend(matmul_ref(
            &a32[i * m * k..(i + 1) * m * k],
            &b32[i * k * n..(i + 1) * k * n],
            m,
            k,
            n,
        ));
        want_bf.extend(matmul_ref(
            &abf[i * m * k..(i + 1) * m * k],
            &bbf[i * k * n..(i + 1) * k * n],
            m,
            k,
            n,
        ));
    }
    assert_close("batched", &to_f64(&read::<f32>(&got[0])), &want, 1e-5);
    assert_close("bf16->f32", &to_f64(&read::<f32>(&got[1])), &want_bf, 1e-5);
    assert_close("plain", &to_f64(&read::<f32>(&got[2])), &want[..m * n], 1e-5);
}

/// The grouped product in its masked lowering (what the CPU plugin runs): each row times its
/// group's matrix, an empty group, rows past the groups' total zero; and the per-group form.
#[test]
fn ragged_dot_matches_rust() {
    let mut r = rng("ragged_dot");
    let (m, k, n) = (7usize, 3usize, 4usize);
    let sizes = [2i32, 0, 3, 1];
    let g_count = sizes.len();
    let a = uniform(&mut r, m * k, -1.0, 1.0);
    let b = uniform(&mut r, g_count * k * n, -1.0, 1.0);
    let c = uniform(&mut r, m * n, -1.0, 1.0);
    let g = Graph::new("ragged_dot");
    let ta = g.parameter("a", DType::F64, &[m as i64, k as i64]);
    let tb = g.parameter("b", DType::F64, &[g_count as i64, k as i64, n as i64]);
    let tc = g.parameter("c", DType::F64, &[m as i64, n as i64]);
    let ts = g.parameter("sizes", DType::I32, &[g_count as i64]);
    let rows = ta.ragged_dot(&tb, &ts, false, None);
    let groups = ta.ragged_dot_per_group(&tc, &ts, false, None);
    let p = g.build(&[&rows, &groups]).unwrap();
    let got = run(
        &p,
        &[
            &upload(&a, &[m as i64, k as i64]),
            &upload(&b, &[g_count as i64, k as i64, n as i64]),
            &upload(&c, &[m as i64, n as i64]),
            &upload(&sizes, &[g_count as i64]),
        ],
    );
    // The group of each row (None past the total).
    let mut group_of = vec![None; m];
    let mut row = 0;
    for (gi, &size) in sizes.iter().enumerate() {
        for _ in 0..size {
            group_of[row] = Some(gi);
            row += 1;
        }
    }
    let mut want_rows = vec![0.0; m * n];
    let mut want_groups = vec![0.0; g_count * k * n];
    for (i, gi) in group_of.iter().enumerate() {
        let Some(gi) = *gi else { continue };
        for j in 0..n {
            want_rows[i * n + j] = (0..k).map(|x| a[i * k + x] * b[(gi * k + x) * n + j]).sum();
            for x in 0..k {
                want_groups[(gi * k + x) * n + j] += a[i * k + x] * c[i * n + j];
            }
        }
    }
    assert!(
        want_rows[6 * n..].iter().all(|v| *v == 0.0),
        "row 6 is in no group"
    );
    assert_close("ragged_dot", &read::<f64>(&got[0]), &want_rows, 1e-12);
    assert_close("ragged_dot per group", &read::<f64>(&got[1]), &want_groups, 1e-12);
}

#[test]
fn reductions_and_argmax_match_rust() {
    let mut r = rng("reduce");
    let (a, b, c) = (3usize, 4usize, 5usize);
    let x = uniform(&mut r, a * b * c, -3.0, 3.0);
    let g = Graph::new("reduce");
    let t = g.parameter("x", DType::F64, &[a as i64, b as i64, c as i64]);
    let outs = [
        t.reduce_sum(&[0, 2]),
        t.reduce_max(&[1]),
        t.reduce_min(&[2]),
        t.sum_all(),
        t.argmax(-1).convert(DType::F64),
        t.mean_axis(1, false),
    ];
    let got = run(
        &g.build(&outs.iter().collect::<Vec<_>>()).unwrap(),
        &[&upload(&x, &[a as i64, b as i64, c as i64])],
    );
    let at = |i: usize, j: usize, k: usize| x[(i * b + j) * c + k];
    let sum02: Vec<f64> = (0..b)
        .map(|j| {
            (0..a)
                .flat_map(|i| (0..c).map(move |k| (i, k)))
                .map(|(i, k)| at(i, j, k))
                .sum()
        })
        .collect();
    let mut max1 = Vec::new();
    let mut min2 = Vec::new();
    let mut argmax = Vec::new();
    let mut mean1 = Vec::new();
    for i in 0..a {
        for k in 0..c {
            max1.push((0..b).map(|j| at(i, j, k)).fold(f64::NEG_INFINITY, f64::max));
            mean1.push((0..b).map(|j| at(i, j, k)).sum::<f64>() / b as f64);
        }
        for j in 0..b {
            min2.push((0..c).map(|k| at(i, j, k)).fold(f64::INFINITY, f64::min));
            let row: Vec<f64> = (0..c).map(|k| at(i, j, k)).collect();
            let best = (0..c).fold(0, |bi, k| if row[k] > row[bi] { k } else { bi });
            argmax.push(best as f64);
        }
    }
    assert_close("sum", &read::<f64>(&got[0]), &sum02, 1e-12);
    assert_close("max", &read::<f64>(&got[1]), &max1, 0.0);
    assert_close("min", &read::<f64>(&got[2]), &min2, 0.0);
    assert_close("sum_all", &read::<f64>(&got[3]), &[x.iter().sum()], 1e-12);
    assert_close("argmax", &read::<f64>(&got[4]), &argmax, 0.0);
    assert_close("mean", &read::<f64>(&got[5]), &mean1, 1e-12);
}

#[test]
fn gather_and_scatter_add_match_rust() {
    let mut r = rng("gather");
    let (v, d) = (6usize, 3usize);
    let table = uniform(&mut r, v * d, -1.0, 1.0);
    let ids: Vec<i32> = (0..8).map(|_| r.random_range(0..v as i32)).collect();
    let upd = uniform(&mut r, 8 * d, -1.0, 1.0);
    let g = Graph::new("gather");
    let tt = g.parameter("table", DType::F64, &[v as i64, d as i64]);
    let ti = g.parameter("ids", DType::I32, &[2, 4]);
    let tu = g.parameter("upd", DType::F64, &[2, 4, d as i64]);
    let rows = tt.take(&ti, 0);
    let set_rows = g.constant_i64(&[4, 1], DType::I32, &[2]);
    let replaced = tt.scatter(
        &set_rows,
        &tu.slice_axis(0, 0, 1).reshape(&[4, d as i64]).slice_axis(0, 0, 2),
        0,
    );
    let scattered = tt.scatter_add(&ti, &tu, 0);
    let cols = tt.take(
        &ti.slice_axis(0, 0, 1)
            .reshape(&[4])
            .clamp_scalar(0.0, (d - 1) as f64),
        1,
    );
    let ta = g.parameter("along", DType::I32, &[v as i64, 1]);
    let along = tt.take_along_last_axis(&ta);
    let p = g.build(&[&rows, &scattered, &cols, &along, &replaced]).unwrap();
    let along_ids: Vec<i32> = (0..v).map(|_| r.random_range(0..d as i32)).collect();
    let got = run(
        &p,
        &[
            &upload(&table, &[v as i64, d as i64]),
            &upload(&ids, &[2, 4]),
            &upload(&upd, &[2, 4, d as i64]),
            &upload(&along_ids, &[v as i64, 1]),
        ],
    );
    let want_rows: Vec<f64> = ids
        .iter()
        .flat_map(|&i| table[i as usize * d..(i as usize + 1) * d].to_vec())
        .collect();
    assert_close("take rows", &read::<f64>(&got[0]), &want_rows, 0.0);
    let mut want_sc = table.clone();
    for (n, &i) in ids.iter().enumerate() {
        for j in 0..d {
            want_sc[i as usize * d + j] += upd[n * d + j];
        }
    }
    assert_close("scatter_add", &read::<f64>(&got[1]), &want_sc, 1e-12);
    let col_ids: Vec<usize> = ids[..4].iter().map(|&i| (i as usize).min(d - 1)).collect();
    let want_cols: Vec<f64> = (0..v)
        .flat_map(|row| col_ids.iter().map(move |&c| (row, c)))
        .map(|(row, c)| table[row * d + c])
        .collect();
    assert_close("take columns", &read::<f64>(&got[2]), &want_cols, 0.0);
    let mut want_set = table.clone();
    for (k, row) in [4usize, 1].iter().enumerate() {
        want_set[row * d..(row + 1) * d].copy_from_slice(&upd[k * d..(k + 1) * d]);
    }
    assert_close("scatter (replace)", &read::<f64>(&got[4]), &want_set, 0.0);
    let want_along: Vec<f64> = (0..v)
        .map(|row| table[row * d + along_ids[row] as usize])
        .collect();
    assert_close("take_along_last_axis", &read::<f64>(&got[3]), &want_along, 0.0);
}

/// The KV-cache write: a `[S, H, L, D]` cache, one `[H, D]` row per slot written at
/// (slot, position) in the cache's own 4-D layout; a position past the end is dropped, and
/// the same points read back with `take_at`.
#[test]
fn point_gather_and_scatter_over_two_axes_match_rust() {
    let mut r = rng("points");
    let (s, h, l, d) = (3usize, 2usize, 5usize, 4usize);
    let cache = uniform(&mut r, s * h * l * d, -1.0, 1.0);
    let rows = uniform(&mut r, s * h * d, -1.0, 1.0);
    // Slot 1's position is past the end: its row is dropped by the scatters.
    let points: Vec<i32> = vec![0, 3, 1, l as i32, 2, 0];
    let g = Graph::new("points");
    let tc = g.parameter("cache", DType::F64, &[s as i64, h as i64, l as i64, d as i64]);
    let tr = g.parameter("rows", DType::F64, &[s as i64, h as i64, d as i64]);
    let tp = g.parameter("points", DType::I32, &[s as i64, 2]);
    let set = tc.scatter_at(&tp, &tr, &[0, 2]);
    let added = tc.scatter_add_at(&tp, &tr, &[0, 2]);
    let read_back = set.take_at(&tp, &[0, 2]);
    assert_eq!(read_back.dims(), &[s as i64, h as i64, d as i64]);
    let p = g.build(&[&set, &added, &read_back]).unwrap();
    let got = run(
        &p,
        &[
            &upload(&cache, &[s as i64, h as i64, l as i64, d as i64]),
            &upload(&rows, &[s as i64, h as i64, d as i64]),
            &upload(&points, &[s as i64, 2]),
        ],
    );
    let at = |slot: usize, head: usize, pos: usize| ((slot * h + head) * l + pos) * d;
    let (mut want_set, mut want_add) = (cache.clone(), cache.clone());
    let mut want_read = vec![0.0; s * h * d];
    for slot in 0..s {
        let (at_slot, pos) = (points[2 * slot] as usize, points[2 * slot + 1] as usize);
        for head in 0..h {
            for j in 0..d {
                let new = rows[(slot * h + head) * d + j];
                if pos < l {
                    want_set[at(at_slot, head, pos) + j] = new;
                    want_add[at(at_slot, head, pos) + j] += new;
                    want_read[(slot * h + head) * d + j] = new;
                } else {
                    // The gather clamps the position to the last one, which kept its value.
                    want_read[(slot * h + head) * d + j] = cache[at(at_slot, head, l - 1) + j];
                }
            }
        }
    }
    assert_close("scatter_at", &read::<f64>(&got[0]), &want_set, 0.0);
    assert_close("scatter_add_at", &read::<f64>(&got[1]), &want_add, 1e-12);
    assert_close("take_at", &read::<f64>(&got[2]), &want_read, 0.0);
}

#[test]
fn softmax_and_other_composites_match_rust() {
    let mut r = rng("composites");
    let (rows, n) = (3usize, 6usize);
    let x = uniform(&mut r, rows * n, -4.0, 4.0);
    let w = uniform(&mut r, n, 0.5, 1.5);
    let targets: Vec<i32> = (0..rows).map(|_| r.random_range(0..n as i32)).collect();
    let g = Graph::new("composites");
    let tx = g.parameter("x", DType::F64, &[rows as i64, n as i64]);
    let tw = g.parameter("w", DType::F64, &[n as i64]);
    let tt = g.parameter("t", DType::I32, &[rows as i64]);
    let cos = g.parameter("cos", DType::F64, &[n as i64]);
    let sin = g.parameter("sin", DType::F64, &[n as i64]);
    let outs = [
        tx.softmax(-1),
        tx.log_softmax(-1),
        tx.logsumexp(-1, false),
        tx.rms_norm(&tw, 1e-6),
        tx.silu(),
        tx.token_log_probs(&tt),
        tx.entropy(),
        tx.rope(&cos, &sin),
        tx.cross_entropy(&tt),
    ];
    let angles = uniform(&mut r, n, 0.0, 3.0);
    let cv: Vec<f64> = angles.iter().map(|a| a.cos()).collect();
    let sv: Vec<f64> = angles.iter().map(|a| a.sin()).collect();
    let p = g.build(&outs.iter().collect::<Vec<_>>()).unwrap();
    let got = run(
        &p,
        &[
            &upload(&x, &[rows as i64, n as i64]),
            &upload(&w, &[n as i64]),
            &upload(&targets, &[rows as i64]),
            &upload(&cv, &[n as i64]),
            &upload(&sv, &[n as i64]),
        ],
    );
    let mut want: Vec<Vec<f64>> = vec![Vec::new(); 9];
    for i in 0..rows {
        let row = &x[i * n..(i + 1) * n];
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = row.iter().map(|v| (v - m).exp()).sum();
        let lse = m + z.ln();
        want[0].extend(row.iter().map(|v| (v - lse).exp()));
        want[1].extend(row.iter().map(|v| v - lse));
        want[2].push(lse);
        let ms = row.iter().map(|v| v * v).sum::<f64>() / n as f64;
        want[3].extend(row.iter().zip(&w).map(|(v, wi)| v / (ms + 1e-6).sqrt() * wi));
        want[4].extend(row.iter().map(|v| v / (1.0 + (-v).exp())));
        want[5].push(row[targets[i] as usize] - lse);
        want[6].push(-row.iter().map(|v| (v - lse).exp() * (v - lse)).sum::<f64>());
        let h = n / 2;
        want[7].extend((0..n).map(|j| {
            let rot = if j < h { -row[j + h] } else { row[j - h] };
            row[j] * cv[j] + rot * sv[j]
        }));
        want[8].push(lse - row[targets[i] as usize]);
    }
    let names = [
        "softmax",
        "log_softmax",
        "logsumexp",
        "rms_norm",
        "silu",
        "token_log_probs",
        "entropy",
        "rope",
        "cross_entropy",
    ];
    for k in 0..9 {
        assert_close(names[k], &read::<f64>(&got[k]), &want[k], 1e-12);
    }
}

#[test]
fn cumsum_sort_and_top_k_match_rust() {
    let mut r = rng("sort");
    let (rows, n) = (3usize, 7usize);
    let x = uniform(&mut r, rows * n, -5.0, 5.0);
    let g = Graph::new("sort");
    let t = g.parameter("x", DType::F32, &[rows as i64, n as i64]);
    let (asc, asc_i) = t.sort(false);
    let (top, top_i) = t.top_k(3);
    let outs = [t.cumsum(-1, false), t.cumsum(0, true), asc, asc_i, top, top_i];
    let xf: Vec<f32> = x.iter().map(|v| *v as f32).collect();
    let got = run(
        &g.build(&outs.iter().collect::<Vec<_>>()).unwrap(),
        &[&upload(&xf, &[rows as i64, n as i64])],
    );
    let xd = to_f64(&xf);
    let mut cum = Vec::new();
    let mut rev = vec![0.0; rows * n];
    let mut sorted = Vec::new();
    let mut sorted_i = Vec::new();
    let mut topv = Vec::new();
    let mut topi = Vec::new();
    for i in 0..rows {
        let row = &xd[i * n..(i + 1) * n];
        let mut acc = 0.0;
        for v in row {
            acc += v;
            cum.push(acc);
        }
        let mut idx: Vec<usize> = (0..n).collect();
        idx.sort_by(|a, b| row[*a].partial_cmp(&row[*b]).unwrap());
        sorted.extend(idx.iter().map(|&j| row[j]));
        sorted_i.extend(idx.iter().map(|&j| j as i32));
        topv.extend(idx.iter().rev().take(3).map(|&j| row[j]));
        topi.extend(idx.iter().rev().take(3).map(|&j| j as i32));
    }
    for j in 0..n {
        let mut acc = 0.0;
        for i in (0..rows).rev() {
            acc += xd[i * n + j];
            rev[i * n + j] = acc;
        }
    }
    assert_close("cumsum", &to_f64(&read::<f32>(&got[0])), &cum, 1e-5);
    assert_close("reverse cumsum", &to_f64(&read::<f32>(&got[1])), &rev, 1e-5);
    assert_close("sorted", &to_f64(&read::<f32>(&got[2])), &sorted, 0.0);
    assert_eq!(read::<i32>(&got[3]), sorted_i);
    assert_close("top_k values", &to_f64(&read::<f32>(&got[4])), &topv, 0.0);
    assert_eq!(read::<i32>(&got[5]), topi);
}

#[test]
fn shape_ops_match_rust() {
    let mut r = rng("shape");
    let x = uniform(&mut r, 24, -1.0, 1.0);
    let g = Graph::new("shape");
    let t = g.parameter("x", DType::F64, &[2, 3, 4]);
    let i = g.parameter("i", DType::I32, &[]);
    let u = g.parameter("u", DType::F64, &[1, 2, 2]);
    let zero = g.scalar(0.0, DType::I32);
    let pad_value = g.scalar(-7.0, DType::F64);
    let outs = [
        t.transpose(&[2, 0, 1]),
        t.slice(&[0, 1, 0], &[2, 3, 4], &[1, 1, 2]),
        t.dynamic_slice(&[&zero, &i, &i], &[2, 2, 2]),
        t.dynamic_update_slice(&u, &[&i, &zero, &i]),
        Tensor::concat(&[&t, &t.neg()], 1),
        t.slice_axis(0, 0, 1)
            .reshape(&[3, 4])
            .pad(&pad_value, &[1, 0], &[0, 2], &[1, 0]),
        t.slice_axis(2, 0, 1).broadcast_to(&[2, 3, 4]),
        g.iota(DType::F64, &[2, 3], 1),
        t.convert(DType::BF16).convert(DType::F64),
        t.reshape(&[4, 6]),
    ];
    let uv = [10.0, 20.0, 30.0, 40.0];
    let got = run(
        &g.build(&outs.iter().collect::<Vec<_>>()).unwrap(),
        &[
            &upload(&x, &[2, 3, 4]),
            &upload(&[1i32], &[]),
            &upload(&uv, &[1, 2, 2]),
        ],
    );
    let at = |a: usize, b: usize, c: usize| x[(a * 3 + b) * 4 + c];
    let tr: Vec<f64> = (0..4)
        .flat_map(|c| (0..2).flat_map(move |a| (0..3).map(move |b| (a, b, c))))
        .map(|(a, b, c)| at(a, b, c))
        .collect();
    assert_close("transpose", &read::<f64>(&got[0]), &tr, 0.0);
    let sl: Vec<f64> = (0..2)
        .flat_map(|a| (1..3).flat_map(move |b| [0, 2].map(move |c| (a, b, c))))
        .map(|(a, b, c)| at(a, b, c))
        .collect();
    assert_close("slice", &read::<f64>(&got[1]), &sl, 0.0);
    let ds: Vec<f64> = (0..2)
        .flat_map(|a| (1..3).flat_map(move |b| (1..3).map(move |c| (a, b, c))))
        .map(|(a, b, c)| at(a, b, c))
        .collect();
    assert_close("dynamic_slice", &read::<f64>(&got[2]), &ds, 0.0);
    let mut dus = x.clone();
    for b in 0..2 {
        for c in 0..2 {
            dus[(3 + b) * 4 + 1 + c] = uv[b * 2 + c];
        }
    }
    assert_close("dynamic_update_slice", &read::<f64>(&got[3]), &dus, 0.0);
    let cat: Vec<f64> = (0..2)
        .flat_map(|a| (0..6).flat_map(move |b| (0..4).map(move |c| (a, b, c))))
        .map(|(a, b, c)| if b < 3 { at(a, b, c) } else { -at(a, b - 3, c) })
        .collect();
    assert_close("concat", &read::<f64>(&got[4]), &cat, 0.0);
    // rows: pad low 1, interior 1 -> [p, r0, p, r1, p, r2] (6 rows); cols: 4 + high 2.
    let mut pad = vec![-7.0; 6 * 6];
    for b in 0..3 {
        for c in 0..4 {
            pad[(1 + 2 * b) * 6 + c] = at(0, b, c);
        }
    }
    assert_close("pad", &read::<f64>(&got[5]), &pad, 0.0);
    let bc: Vec<f64> = (0..2)
        .flat_map(|a| (0..3).flat_map(move |b| (0..4).map(move |_| (a, b))))
        .map(|(a, b)| at(a, b, 0))
        .collect();
    assert_close("broadcast", &read::<f64>(&got[6]), &bc, 0.0);
    assert_close(
        "iota",
        &read::<f64>(&got[7]),
        &[0.0, 1.0, 2.0, 0.0, 1.0, 2.0],
        0.0,
    );
    let bf: Vec<f64> = x.iter().map(|v| half::bf16::from_f64(*v).to_f64()).collect();
    assert_close("bf16 round trip", &read::<f64>(&got[8]), &bf, 0.0);
    assert_close("reshape", &read::<f64>(&got[9]), &x, 0.0);
}

#[test]
fn random_bits_match_the_reference_and_look_uniform() {
    let g = Graph::new("rng");
    let key = g.parameter("key", DType::U32, &[2]);
    let n = 20_000i64;
    let bits = random::random_bits(&key, &[4, 5]);
    let u = random::uniform(&key, &[n], DType::F32);
    let z = random::normal(&key, &[n], DType::F32);
    let keys = random::split(&key, 3);
    let step = g.parameter("step", DType::U32, &[]);
    let folded = random::fold_in(&key, &step);
    let p = g.build(&[&bits, &u, &z, &keys, &folded]).unwrap();
    let exe = graph_support::compile(&p);
    let key_a = [0u32, 42];
    let key_b = [0u32, 43];
    let step_buf = upload(&[7u32], &[]);
    let run_key = |k: [u32; 2]| exe.execute(&[&upload(&k, &[2]), &step_buf]).unwrap();
    let a1 = run_key(key_a);
    let a2 = run_key(key_a);
    let b1 = run_key(key_b);
    let bits_a = read::<u32>(&a1[0]);
    assert_eq!(
        bits_a,
        random::random_bits_reference(key_a, 20),
        "traced threefry differs from the Rust reference"
    );
    assert_eq!(bits_a, read::<u32>(&a2[0]), "same key must give the same bits");
    let bits_b = read::<u32>(&b1[0]);
    assert!(
        bits_a.iter().zip(&bits_b).filter(|(x, y)| x == y).count() <= 1,
        "different keys gave the same bits"
    );
    let uf = to_f64(&read::<f32>(&a1[1]));
    assert!(uf.iter().all(|v| (0.0..1.0).contains(v)));
    let mean = uf.iter().sum::<f64>() / n as f64;
    let var = uf.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n as f64;
    // Uniform[0,1): mean 1/2, variance 1/12; 20k samples give a standard error of ~0.002.
    assert!((mean - 0.5).abs() < 0.01, "uniform mean {mean}");
    assert!((var - 1.0 / 12.0).abs() < 0.005, "uniform variance {var}");
    let zf = to_f64(&read::<f32>(&a1[2]));
    let zm = zf.iter().sum::<f64>() / n as f64;
    let zv = zf.iter().map(|v| (v - zm) * (v - zm)).sum::<f64>() / n as f64;
    assert!(
        zm.abs() < 0.03 && (zv - 1.0).abs() < 0.05,
        "normal mean {zm} variance {zv}"
    );
    let ks = read::<u32>(&a1[3]);
    for i in 0..3u32 {
        assert_eq!(
            &ks[2 * i as usize..2 * i as usize + 2],
            &random::threefry2x32(key_a, [i + 1, 0])
        );
    }
    assert_eq!(read::<u32>(&a1[4]), random::threefry2x32(key_a, [0, 7]).to_vec());
}

/// A rematerialised region ([`Graph::checkpoint`]) gives the gradients of the plain trace,
/// and its program recomputes the region's forward (its products appear twice) behind an
/// optimization barrier.
#[test]
fn checkpointed_layers_give_the_plain_gradients_and_recompute_their_forward() {
    let mut r = rng("checkpoint");
    let (n, d) = (4usize, 5usize);
    let x = uniform(&mut r, n * d, -1.0, 1.0);
    let w1 = uniform(&mut r, d * d, -1.0, 1.0);
    let w2 = uniform(&mut r, d * d, -1.0, 1.0);
    let trace = |remat: bool| {
        let g = Graph::new(if remat { "remat" } else { "plain" });
        let tx = g.parameter("x", DType::F64, &[n as i64, d as i64]);
        let t1 = g.parameter("w1", DType::F64, &[d as i64, d as i64]);
        let t2 = g.parameter("w2", DType::F64, &[d as i64, d as i64]);
        let layer = |h: &Tensor, w: &Tensor| {
            let f = || {
                let a = h.matmul(w).tanh();
                &(&a * &a).softmax(-1) + h
            };
            if remat {
                g.checkpoint(f)
            } else {
                f()
            }
        };
        let h = layer(&layer(&tx, &t1), &t2);
        let loss = (&h * &h).sum_all();
        let grads = xla::graph::grad(&loss, &[&tx, &t1, &t2]).unwrap();
        let mut outs = vec![&loss];
        outs.extend(grads.iter());
        g.build(&outs).unwrap()
    };
    let (plain, remat) = (trace(false), trace(true));
    let dots = |p: &xla::graph::Program| p.mlir().matches("dot_general").count();
    // Two layers: one forward product each, recomputed once each in the backward pass.
    assert_eq!(dots(&remat), dots(&plain) + 2, "{}", remat.mlir());
    assert!(remat.mlir().contains("optimization_barrier"));
    assert!(!plain.mlir().contains("optimization_barrier"));
    let args = [
        upload(&x, &[n as i64, d as i64]),
        upload(&w1, &[d as i64, d as i64]),
        upload(&w2, &[d as i64, d as i64]),
    ];
    let refs: Vec<_> = args.iter().collect();
    let (want, got) = (run(&plain, &refs), run(&remat, &refs));
    for (i, (w, g)) in want.iter().zip(&got).enumerate() {
        assert_close(&format!("output {i}"), &read::<f64>(g), &read::<f64>(w), 1e-12);
    }
}

/// A scan over stacked weights (`Graph::scan`) computes what the unrolled layers compute,
/// forwards and backwards, in either direction and nested, with the body emitted once as a
/// `stablehlo.while`; a captured value gets the sum of every iteration's cotangent.
#[test]
fn scanned_layers_give_the_unrolled_values_and_gradients() {
    let mut r = rng("scan");
    let (layers, n, d) = (3usize, 4usize, 5usize);
    let x = uniform(&mut r, n * d, -1.0, 1.0);
    let w = uniform(&mut r, layers * d * d, -1.0, 1.0);
    let c = uniform(&mut r, d, -1.0, 1.0);
    let (li, ni, di) = (layers as i64, n as i64, d as i64);
    let layer = |h: &Tensor, w: &Tensor, c: &Tensor| {
        let a = (&h.matmul(w) + &c.broadcast_to(h.dims())).tanh();
        (&a * &a).softmax(-1) + h.clone()
    };
    // mode: 0 unrolled, 1 scanned, 2 scanned in reverse over reversed weights, 3 nested scans.
    let trace = |mode: usize| {
        let g = Graph::new(&format!("scan{mode}"));
        let tx = g.parameter("x", DType::F64, &[ni, di]);
        let tw = g.parameter("w", DType::F64, &[li, di, di]);
        let tc = g.parameter("c", DType::F64, &[di]);
        let slice = |i: i64| tw.slice_axis(0, i, i + 1).reshape(&[di, di]);
        let (h, ys) = match mode {
            0 => {
                let mut h = tx.clone();
                let mut ys = Vec::new();
                for i in 0..li {
                    h = layer(&h, &slice(i), &tc);
                    ys.push(h.sum_axis(1, false).reshape(&[1, ni]));
                }
                let refs: Vec<&Tensor> = ys.iter().collect();
                (h, Tensor::concat(&refs, 0))
            }
            1 => {
                let (carry, ys) = g.scan(
                    std::slice::from_ref(&tx),
                    std::slice::from_ref(&tw),
                    false,
                    |h, s| {
                        let next = layer(&h[0], &s[0], &tc);
                        let y = next.sum_axis(1, false);
                        (vec![next], vec![y])
                    },
                );
                (carry[0].clone(), ys[0].clone())
            }
            2 => {
                let parts: Vec<Tensor> = (0..li).rev().map(|i| tw.slice_axis(0, i, i + 1)).collect();
                let refs: Vec<&Tensor> = parts.iter().collect();
                let reversed = Tensor::concat(&refs, 0);
                let (carry, ys) = g.scan(std::slice::from_ref(&tx), &[reversed], true, |h, s| {
                    let next = layer(&h[0], &s[0], &tc);
                    (vec![next.clone()], vec![next.sum_axis(1, false)])
                });
                // Iteration order is reversed, outputs are stored by slice: flip them back.
                let rows: Vec<Tensor> = (0..li).rev().map(|i| ys[0].slice_axis(0, i, i + 1)).collect();
                let refs: Vec<&Tensor> = rows.iter().collect();
                (carry[0].clone(), Tensor::concat(&refs, 0))
            }
            _ => {
                // Layer i as an inner scan over a one-slice stack of itself.
                let (carry, ys) = g.scan(
                    std::slice::from_ref(&tx),
                    std::slice::from_ref(&tw),
                    false,
                    |h, s| {
                        let one = s[0].reshape(&[1, di, di]);
                        let (inner, _) = g.scan(&[h[0].clone()], &[one], false, |h2, s2| {
                            (vec![layer(&h2[0], &s2[0], &tc)], vec![])
                        });
                        (vec![inner[0].clone()], vec![inner[0].sum_axis(1, false)])
                    },
                );
                (carry[0].clone(), ys[0].clone())
            }
        };
        let loss = &(&h * &h).sum_all() + &(&ys * &ys).sum_all();
        let grads = xla::graph::grad(&loss, &[&tx, &tw, &tc]).unwrap();
        let mut outs = vec![&loss, &h, &ys];
        outs.extend(grads.iter());
        g.build(&outs).unwrap()
    };
    let args = [
        upload(&x, &[ni, di]),
        upload(&w, &[li, di, di]),
        upload(&c, &[di]),
    ];
    let refs: Vec<_> = args.iter().collect();
    let plain = trace(0);
    let want = run(&plain, &refs);
    for mode in 1..4 {
        let p = trace(mode);
        let whiles = p.mlir().matches("stablehlo.while").count();
        // Forward and backward loops; nested: the backward outer loop runs the inner forward
        // again (from its saved carry) before the inner backward loop.
        assert_eq!(whiles, if mode == 3 { 5 } else { 2 }, "{}", p.mlir());
        let got = run(&p, &refs);
        for (i, (w, g)) in want.iter().zip(&got).enumerate() {
            assert_close(
                &format!("mode {mode} output {i}"),
                &read::<f64>(g),
                &read::<f64>(w),
                1e-12,
            );
        }
    }
    // The scanned program's forward product is emitted once, not once per layer.
    let dots = |p: &xla::graph::Program| p.mlir().matches("dot_general").count();
    assert!(dots(&trace(1)) < dots(&plain), "{}", trace(1).mlir());
}
