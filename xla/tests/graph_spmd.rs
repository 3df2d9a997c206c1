//! The same MLP training step on 1 device and as an SPMD program on 4 CPU devices
//! (data-parallel: batch split, parameters replicated; and fully sharded: `w1` and its Adam
//! state split on dim 0) gives the same results within rounding. The SPMD step also carries
//! a sharding constraint on the hidden activations, so its gradient (identity) is exercised.

mod graph_support;

use graph_support::{client4, mlp_param_dims, mlp_problem, mlp_step_program, Layout, IN};
use xla::runtime::Buffer;

const BATCH: usize = 64;
const DEVICES: usize = 4;
const STEPS: usize = 5;

/// Runs `STEPS` steps; returns the 12 state tensors (whole, gathered from shards) and the
/// losses.
fn train(layout: Layout) -> (Vec<Vec<f32>>, Vec<f32>) {
    let c = client4();
    let devices = if layout == Layout::Single { 1 } else { DEVICES };
    let program = mlp_step_program(BATCH as i64, layout, devices);
    let exe = program
        .compile(c)
        .unwrap_or_else(|e| panic!("compile {layout:?}: {e}\n{}", program.mlir()));
    let (params, x, y) = mlp_problem(BATCH);
    let dims = mlp_param_dims();
    // Host values of every argument except t.
    let mut host: Vec<(Vec<f32>, Vec<i64>)> = Vec::new();
    for group in 0..3 {
        for (k, d) in dims.iter().enumerate() {
            let v = if group == 0 {
                params[k].clone()
            } else {
                vec![0.0; params[k].len()]
            };
            host.push((v, d.clone()));
        }
    }
    host.push((x, vec![BATCH as i64, IN]));
    host.push((y, vec![BATCH as i64, 1]));
    // Per device: its shard of each argument (shards are contiguous row blocks on dim 0).
    let shard = |arg: usize, d: usize| -> Buffer {
        let (v, dims) = &host[arg];
        let local = program.local_arg_dims(arg);
        let n: usize = local.iter().product::<i64>() as usize;
        let start = if local == *dims { 0 } else { d * n };
        c.buffer_from_host(&v[start..start + n], &local, d)
            .expect("upload shard")
    };
    let mut state: Vec<Vec<Buffer>> = (0..devices)
        .map(|d| (0..12).map(|a| shard(a, d)).collect())
        .collect();
    let data: Vec<Vec<Buffer>> = (0..devices).map(|d| vec![shard(12, d), shard(13, d)]).collect();
    let mut losses = Vec::new();
    for step in 1..=STEPS {
        let ts: Vec<Buffer> = (0..devices)
            .map(|d| c.buffer_from_host(&[step as f32], &[], d).unwrap())
            .collect();
        let args: Vec<Vec<&Buffer>> = (0..devices)
            .map(|d| {
                let mut a: Vec<&Buffer> = state[d].iter().collect();
                a.extend(data[d].iter());
                a.push(&ts[d]);
                a
            })
            .collect();
        let mut out = if devices == 1 {
            vec![exe.execute(&args[0]).expect("step")]
        } else {
            exe.execute_spmd(&args).expect("spmd step")
        };
        let loss0 = out[0].pop().unwrap().to_host::<f32>().unwrap()[0];
        for (d, o) in out.iter_mut().enumerate().skip(1) {
            let l = o.pop().unwrap().to_host::<f32>().unwrap()[0];
            assert_eq!(l, loss0, "replicated loss differs on device {d}");
        }
        losses.push(loss0);
        state = out;
    }
    // Gather: sharded results concatenate over devices, replicated ones come from device 0.
    let whole: Vec<Vec<f32>> = (0..12)
        .map(|i| {
            if program.local_result_dims(i) == program.result_types()[i].dims {
                state[0][i].to_host::<f32>().unwrap()
            } else {
                (0..devices)
                    .flat_map(|d| state[d][i].to_host::<f32>().unwrap())
                    .collect()
            }
        })
        .collect();
    (whole, losses)
}

fn assert_same(what: &str, a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= 1e-5 * y.abs().max(1e-2),
            "{what}[{i}]: {x} vs {y}"
        );
    }
}

#[test]
fn data_parallel_and_fsdp_steps_match_one_device() {
    let (single, single_losses) = train(Layout::Single);
    for layout in [Layout::DataParallel, Layout::Fsdp] {
        let (spmd, losses) = train(layout);
        eprintln!("{layout:?}: losses {losses:?} vs single {single_losses:?}");
        assert_same(&format!("{layout:?} losses"), &losses, &single_losses);
        for (i, (a, b)) in spmd.iter().zip(&single).enumerate() {
            assert_same(&format!("{layout:?} state {i}"), a, b);
        }
    }
}

#[test]
fn spmd_program_text_declares_mesh_and_shardings() {
    let p = mlp_step_program(BATCH as i64, Layout::Fsdp, DEVICES);
    let t = p.mlir();
    assert_eq!(p.num_partitions(), 4);
    assert!(t.contains("sdy.mesh @mesh = <[\"data\"=4]>"), "{t}");
    assert!(t.contains("%arg0: tensor<16x32xf32> {tf.aliasing_output = 0 : i32, sdy.sharding = #sdy.sharding<@mesh, [{\"data\"}, {}]>}"), "{t}");
    assert!(t.contains("sdy.sharding_constraint"), "{t}");
    assert_eq!(p.local_arg_dims(0), vec![4, 32]);
    assert_eq!(p.local_arg_dims(12), vec![16, 16]);
}
