//! The CPU plugin's large host allocations come from `xla::runtime::host_blocks` (its own test
//! binary: the counters are per process). A program with a 36 MB temporary runs three times:
//! the results are right every time, the first run maps the blocks, the later runs reuse them.

mod graph_support;

use graph_support::{client, compile, read, rng, upload};
use rand::Rng;
use xla::graph::{DotDims, Graph};
use xla::runtime::host_blocks;
use xla::DType;

#[test]
fn large_temporaries_are_reused_across_runs_and_results_stay_right() {
    let (rows, cols) = (3072_usize, 256_usize);
    let g = Graph::new("row_sums_of_gram");
    let x = g.parameter("x", DType::F32, &[rows as i64, cols as i64]);
    // x x^T is [3072, 3072] f32 = 36 MB, a temporary of the program (two reductions read it);
    // its row sums are checked.
    let gram = x.dot_general(
        &x,
        DotDims {
            lhs_contract: vec![1],
            rhs_contract: vec![1],
            ..Default::default()
        },
        None,
    );
    let sums = gram.reduce_sum(&[1]);
    let maxima = gram.reduce_max(&[0]);
    let program = g.build(&[&sums, &maxima]).expect("build");
    let exe = compile(&program);
    if std::env::var(host_blocks::DISABLE_ENV).is_ok_and(|v| v.trim() == "0") {
        assert!(!host_blocks::installed());
        return;
    }
    assert!(
        host_blocks::installed(),
        "the CPU plugin's allocator was not redirected"
    );

    let mut r = rng("large_temporaries_are_reused_across_runs_and_results_stay_right");
    let data: Vec<f32> = (0..rows * cols).map(|_| r.random_range(-1.0..1.0)).collect();
    // sum_j x_i . x_j = x_i . (sum_j x_j)
    let column_sums: Vec<f64> = (0..cols)
        .map(|c| (0..rows).map(|i| data[i * cols + c] as f64).sum())
        .collect();
    let want: Vec<f64> = (0..rows)
        .map(|i| {
            (0..cols)
                .map(|c| data[i * cols + c] as f64 * column_sums[c])
                .sum()
        })
        .collect();
    let input = upload(&data, &[rows as i64, cols as i64]);

    // A run frees its temporary just after its outputs are ready: wait for that before the
    // next run, so that each run finds the previous one's block idle.
    let before = host_blocks::stats();
    let settle = || {
        let start = std::time::Instant::now();
        while host_blocks::stats().busy_bytes != before.busy_bytes {
            assert!(
                start.elapsed() < std::time::Duration::from_secs(5),
                "a temporary was never freed: {:?} (before the runs: {before:?})",
                host_blocks::stats()
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        host_blocks::stats()
    };
    let mut after = Vec::new();
    for run in 0..3 {
        let out = exe.execute(&[&input]).expect("execute");
        let got: Vec<f32> = read(&out[0]);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (*g as f64 - w).abs() <= 1e-3 * w.abs().max(50.0),
                "run {run}, row {i}: {g} vs {w}"
            );
        }
        drop(out);
        after.push(settle());
    }
    eprintln!("{after:#?}");
    assert!(
        after[0].mapped >= 1,
        "the first run maps its temporary: {:?}",
        after[0]
    );
    assert_eq!(after[2].mapped, after[1].mapped, "the third run maps nothing new");
    assert!(
        after[2].reused >= after[0].reused + 2,
        "runs 2 and 3 reuse blocks"
    );
    assert!(after[2].held_bytes >= 36 << 20);
    assert!(client().num_devices() >= 1);
}
