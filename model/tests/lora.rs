//! LoRA adapters in PEFT's format on the tiny fixture models (`model/scripts/make_lora_fixtures.py`):
//! - adapters PEFT made (all-linear; rsLoRA on three projections of Qwen2; and on a Qwen3-MoE's
//!   attention, dense MLP and stacked experts through `target_parameters`) load and the merged
//!   model's logits equal the PeftModel's;
//! - an adapter grpo writes (on Llama, and on the Qwen3-MoE's experts) is byte for byte the
//!   committed `grpo_llama/` / `grpo_qwen3_moe/`, which PEFT loaded to make its reference
//!   logits, and grpo's logits with it equal those;
//! - a fresh (PEFT-initialised) adapter leaves the weights exactly as they were;
//! - the gradient reaching `A` and `B` through the merge matches finite differences, in f64 on
//!   the merge itself and in f32 through the whole decoder's log-probabilities;
//! - adapters that do not fit the base model are refused, naming the tensor.

use std::path::{Path, PathBuf};

use model::forward::{logprobs_graph, DecoderParams};
use model::lora::{lora_param_table, merge_params, merged_weight, LoraAdapter, LoraConfig, Target};
use model::programs::{DeviceModel, FullLogitsProgram};
use model::safetensors_io::load_hf_checkpoint;
use model::{HostTensor, ModelWeights};
use rand::{Rng, SeedableRng};
use testkit::client;
use xla::graph::{value_and_grad, Graph, Tensor};
use xla::runtime::Buffer;
use xla::DType;

const TOL: f32 = 1e-4;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

fn base(family: &str) -> ModelWeights {
    load_hf_checkpoint(&fixtures().join("tiny").join(family)).expect("tiny checkpoint")
}

/// The reference sequences and their logits `[T * vocab]` from a reference file.
fn reference(path: &Path) -> Vec<(Vec<u32>, Vec<f32>)> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; make it with python3 model/scripts/make_lora_fixtures.py",
            path.display()
        )
    });
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let le = |name: String| -> Vec<[u8; 4]> {
        st.tensor(&name)
            .unwrap()
            .data()
            .chunks(4)
            .map(|c| c.try_into().unwrap())
            .collect()
    };
    (0..2)
        .map(|i| {
            let ids = le(format!("input_ids_{i}"))
                .into_iter()
                .map(|b| i32::from_le_bytes(b) as u32);
            let logits = le(format!("logits_{i}")).into_iter().map(f32::from_le_bytes);
            (ids.collect(), logits.collect())
        })
        .collect()
}

/// Every reference sequence's logits from `weights` within [`TOL`] of the reference file's.
fn logits_match(weights: &ModelWeights, reference_file: &Path) {
    let model = DeviceModel::upload(client(), weights, DType::F32, 0).unwrap();
    let vocab = weights.config.vocab_size;
    for (ids, want) in reference(reference_file) {
        let program = FullLogitsProgram::compile(&model, 1, ids.len()).unwrap();
        let got = program.run(&model, &ids, &vec![1; ids.len()]).unwrap();
        assert_eq!(got.len(), ids.len() * vocab);
        let d = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(d < TOL, "{}: max |logit - PEFT| = {d}", reference_file.display());
    }
}

#[test]
fn adapters_made_by_peft_give_peft_logits() {
    for (dir, family, targets, rslora) in [
        ("peft_llama", "llama", Target::ALL.to_vec(), false),
        (
            "peft_qwen2_rslora",
            "qwen2",
            vec![Target::Q, Target::V, Target::Down],
            true,
        ),
        (
            "peft_qwen3_moe",
            "qwen3_moe",
            vec![
                Target::Q,
                Target::Down,
                Target::ExpertsGateUp,
                Target::ExpertsDown,
            ],
            false,
        ),
    ] {
        let path = fixtures().join("lora").join(dir);
        let w = base(family);
        let adapter = LoraAdapter::load_peft(&path, &w.config).unwrap();
        assert_eq!(adapter.lora.targets, targets, "{dir}");
        assert_eq!(adapter.lora.use_rslora, rslora, "{dir}");
        // The attention's adapters on every layer, the MLP's on the dense layers, the experts'
        // on the others.
        let moe_layers = w.config.moe_layers();
        let layers = w.config.num_hidden_layers;
        let pairs: usize = targets
            .iter()
            .map(|t| match t {
                t if t.is_experts() => moe_layers,
                Target::Gate | Target::Up | Target::Down => layers - moe_layers,
                _ => layers,
            })
            .sum();
        assert_eq!(adapter.tensors.len(), 2 * pairs, "{dir}");
        let merged = adapter.merge_into(client(), 0, &w).unwrap();
        // The adapter matters: the merged weights are not the base's.
        assert_ne!(merged, w, "{dir}");
        logits_match(&merged, &path.join("reference.safetensors"));
    }
}

/// The log-prob tests' batch: rows and tokens per row.
const BATCH: i64 = 2;
const LEN: i64 = 9;

/// A log-prob graph's arguments: the model's weights, the adapters of `specs` (f32), then
/// tokens and mask `[BATCH, LEN]` and the temperature, as [`fixed_inputs`] uploads them.
struct LogProbArgs {
    g: Graph,
    p: DecoderParams,
    adapters: Vec<Tensor>,
    tokens: Tensor,
    mask: Tensor,
    temp: Tensor,
}

impl LogProbArgs {
    fn declare(name: &str, config: &model::ModelConfig, specs: &[model::ParamSpec]) -> LogProbArgs {
        let g = Graph::new(name);
        let p = DecoderParams::declare(&g, config, DType::F32);
        let adapters = specs
            .iter()
            .map(|s| g.parameter(&s.name, DType::F32, &s.dims()))
            .collect();
        let tokens = g.parameter("tokens", DType::I32, &[BATCH, LEN]);
        let mask = g.parameter("mask", DType::I32, &[BATCH, LEN]);
        let temp = g.parameter("temperature", DType::F32, &[]);
        LogProbArgs {
            g,
            p,
            adapters,
            tokens,
            mask,
            temp,
        }
    }

    /// The summed log-probs over `params`.
    fn loss(&self, params: &DecoderParams) -> Tensor {
        logprobs_graph(&self.g, params, &self.tokens, &self.mask, &self.temp)
            .0
            .sum_all()
    }

    /// The summed log-probs on the merged weights `W + s·B·A` of the adapters `args`.
    fn merged_loss(&self, config: &model::ModelConfig, lora: &LoraConfig, args: &[Tensor]) -> Tensor {
        let merged = merge_params(config, lora, &self.p.all, args);
        self.loss(&DecoderParams::from_tensors(config, &merged).unwrap())
    }
}

/// Two rows of tokens (the second padded) and temperature 0.8, on device 0.
fn fixed_inputs() -> [Buffer; 3] {
    let tokens: Vec<i32> = vec![1, 17, 250, 3, 99, 383, 42, 7, 8, 5, 6, 7, 200, 201, 0, 0, 0, 0];
    let mask: Vec<i32> = vec![1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0];
    [
        client().buffer_from_host(&tokens, &[BATCH, LEN], 0).unwrap(),
        client().buffer_from_host(&mask, &[BATCH, LEN], 0).unwrap(),
        client().buffer_from_host(&[0.8f32], &[], 0).unwrap(),
    ]
}

/// `adapter`'s tensors as f32 buffers on device 0.
fn upload_adapter(adapter: &LoraAdapter) -> Vec<Buffer> {
    adapter
        .tensors
        .iter()
        .map(|t| {
            let dims: Vec<i64> = t.shape.iter().map(|&d| d as i64).collect();
            client().buffer_from_host(&t.to_f32_vec(), &dims, 0).unwrap()
        })
        .collect()
}

/// `adapter` with `B` drawn uniformly in ±0.1 (as after training) instead of PEFT's zeros.
fn with_random_b(mut adapter: LoraAdapter, seed: u64) -> LoraAdapter {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    for t in adapter
        .tensors
        .iter_mut()
        .filter(|t| t.name.ends_with("lora_B.weight"))
    {
        let values: Vec<f32> = (0..t.numel()).map(|_| rng.random_range(-0.1..0.1)).collect();
        *t = HostTensor::from_f32(t.name.clone(), t.shape.clone(), &values);
    }
    adapter
}

/// A deterministic adapter with non-zero `B` (a trained one), written by grpo: on a dense
/// model's attention and MLP, on a mixture of experts' attention and stacked experts.
fn grpo_adapter(weights: &ModelWeights) -> LoraAdapter {
    let targets = match weights.config.moe {
        None => vec![Target::Q, Target::K, Target::O, Target::Up, Target::Down],
        Some(_) => vec![Target::K, Target::O, Target::ExpertsGateUp, Target::ExpertsDown],
    };
    let lora = LoraConfig {
        rank: 3,
        alpha: 5.0,
        targets,
        use_rslora: false,
    };
    with_random_b(LoraAdapter::init(&weights.config, &lora, 11), 12)
}

#[test]
fn an_adapter_written_by_grpo_loads_in_peft_with_the_same_logits() {
    for family in ["llama", "qwen3_moe"] {
        written_adapter_loads_in_peft(family);
    }
}

fn written_adapter_loads_in_peft(family: &str) {
    let w = base(family);
    let adapter = grpo_adapter(&w);
    let committed = fixtures().join(format!("lora/grpo_{family}"));
    let base_path = format!("model/fixtures/tiny/{family}");
    if std::env::var_os("GRPO_WRITE_LORA_FIXTURE").is_some() {
        adapter.save_peft(&committed, &base_path).unwrap();
    }
    let tmp = tempfile::tempdir().unwrap();
    let written = tmp.path().join("adapter");
    adapter.save_peft(&written, &base_path).unwrap();
    for file in ["adapter_config.json", "adapter_model.safetensors"] {
        let want = std::fs::read(committed.join(file)).unwrap_or_else(|e| {
            panic!(
                "{}: {e}; write it with GRPO_WRITE_LORA_FIXTURE=1 cargo test -p model --test lora, \
                 then run python3 model/scripts/make_lora_fixtures.py",
                committed.join(file).display()
            )
        });
        assert!(
            std::fs::read(written.join(file)).unwrap() == want,
            "{file} differs from the committed fixture PEFT loaded"
        );
    }
    assert_eq!(LoraAdapter::load_peft(&written, &w.config).unwrap(), adapter);
    let merged = adapter.merge_into(client(), 0, &w).unwrap();
    logits_match(
        &merged,
        &fixtures().join(format!("lora/grpo_{family}_reference.safetensors")),
    );
}

#[test]
fn a_fresh_adapter_changes_nothing() {
    let w = base("qwen3");
    let lora = LoraConfig {
        rank: 8,
        alpha: 16.0,
        targets: Target::ALL.to_vec(),
        use_rslora: false,
    };
    let merged = LoraAdapter::init(&w.config, &lora, 1)
        .merge_into(client(), 0, &w)
        .unwrap();
    assert_eq!(merged, w);
}

#[test]
fn adapters_that_do_not_fit_the_base_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let llama = base("llama");
    let qwen3 = base("qwen3");
    // An adapter made for another model: Qwen3's q_proj has head_dim 32, not 16.
    let e = LoraAdapter::load_peft(&fixtures().join("lora/peft_llama"), &qwen3.config)
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("tensor `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`")
            || e.contains("has shape"),
        "{e}"
    );
    // A tensor missing, and one too many.
    let adapter = grpo_adapter(&llama);
    let mut short = adapter.clone();
    let gone = short.tensors.remove(3).name;
    short.save_peft(&tmp.path().join("short"), "x").unwrap();
    let e = LoraAdapter::load_peft(&tmp.path().join("short"), &llama.config)
        .unwrap_err()
        .to_string();
    assert!(e.starts_with(&format!("tensor `{gone}` (expected shape")), "{e}");
    assert!(e.contains("is missing from"), "{e}");
    let mut narrow = adapter.clone();
    narrow.lora.targets = vec![Target::Q];
    narrow.save_peft(&tmp.path().join("extra"), "x").unwrap();
    let e = LoraAdapter::load_peft(&tmp.path().join("extra"), &llama.config)
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("unexpected tensor `base_model.model.model.layers.0.mlp.down_proj.lora_A.weight`"),
        "{e}"
    );
    // PEFT's pickle format, and no adapter at all.
    let bin = tmp.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    std::fs::copy(
        fixtures().join("lora/peft_llama/adapter_config.json"),
        bin.join("adapter_config.json"),
    )
    .unwrap();
    std::fs::write(bin.join("adapter_model.bin"), b"pickle").unwrap();
    let e = LoraAdapter::load_peft(&bin, &llama.config)
        .unwrap_err()
        .to_string();
    assert!(e.contains("safe_serialization=True"), "{e}");
    let e = LoraAdapter::load_peft(tmp.path(), &llama.config)
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("reading ") && e.contains("adapter_config.json"),
        "{e}"
    );
}

/// Central differences of `loss` along a random unit direction of argument `arg` of `args`.
fn directional(
    exe: &xla::runtime::Executable,
    args: &[Buffer],
    arg: usize,
    values: &[f64],
    dims: &[i64],
    h: f64,
    seed: u64,
) -> (Vec<f64>, f64) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut dir: Vec<f64> = (0..values.len()).map(|_| rng.random::<f64>() - 0.5).collect();
    let norm = dir.iter().map(|x| x * x).sum::<f64>().sqrt();
    dir.iter_mut().for_each(|x| *x /= norm);
    let at = |sign: f64| {
        let moved: Vec<f64> = values.iter().zip(&dir).map(|(v, d)| v + sign * h * d).collect();
        let b = client().buffer_from_host(&moved, dims, 0).unwrap();
        let mut refs: Vec<&Buffer> = args.iter().collect();
        refs[arg] = &b;
        exe.execute(&refs).unwrap()[0].to_host::<f64>().unwrap()[0]
    };
    let numeric = (at(1.0) - at(-1.0)) / (2.0 * h);
    (dir, numeric)
}

#[test]
fn the_merge_gradient_matches_finite_differences_in_f64() {
    // loss = sum(c * tanh(X · (W + s·B·A)^T)), with A, B the differentiated arguments.
    let (o, i, r, n) = (5i64, 4i64, 2i64, 3i64);
    let build = |with_grad: bool| {
        let g = Graph::new("merge_grad");
        let w = g.parameter("w", DType::F64, &[o, i]);
        let a = g.parameter("a", DType::F64, &[r, i]);
        let b = g.parameter("b", DType::F64, &[o, r]);
        let x = g.parameter("x", DType::F64, &[n, i]);
        let c = g.parameter("c", DType::F64, &[n, o]);
        let loss_of = |args: &[Tensor]| {
            let merged = merged_weight(&args[0], &args[1], &args[2], 1.5);
            let y = x.matmul(&merged.t()).tanh();
            (&y * &c).sum_all()
        };
        let all = [w, a, b];
        let program = if with_grad {
            let (loss, grads) = value_and_grad(loss_of, &all, &[1, 2]).unwrap();
            g.build(&[&loss, &grads[0], &grads[1]]).unwrap()
        } else {
            g.build(&[&loss_of(&all)]).unwrap()
        };
        program.compile(client()).unwrap()
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    let mut draw = |len: i64| -> Vec<f64> { (0..len).map(|_| rng.random::<f64>() - 0.5).collect() };
    let shapes: [&[i64]; 5] = [&[o, i], &[r, i], &[o, r], &[n, i], &[n, o]];
    let values: Vec<Vec<f64>> = shapes.iter().map(|s| draw(s.iter().product())).collect();
    let args: Vec<Buffer> = values
        .iter()
        .zip(shapes)
        .map(|(v, s)| client().buffer_from_host(v, s, 0).unwrap())
        .collect();
    let refs: Vec<&Buffer> = args.iter().collect();
    let out = build(true).execute(&refs).unwrap();
    let loss_exe = build(false);
    for (k, arg) in [1usize, 2].into_iter().enumerate() {
        let grad = out[1 + k].to_host::<f64>().unwrap();
        let (dir, numeric) = directional(
            &loss_exe,
            &args,
            arg,
            &values[arg],
            shapes[arg],
            1e-5,
            40 + k as u64,
        );
        let analytic: f64 = grad.iter().zip(&dir).map(|(g, d)| g * d).sum();
        assert!(
            (analytic - numeric).abs() <= 1e-8 * analytic.abs().max(1.0),
            "argument {arg}: analytic {analytic}, finite difference {numeric}"
        );
    }
}

#[test]
fn adapter_gradients_through_the_decoder_match_finite_differences() {
    // The summed log-probabilities of a padded batch through the tiny Qwen2 (biases, tied
    // head) with adapters on q, o and up, differentiated with respect to every A and B.
    adapter_gradients_match("qwen2", vec![Target::Q, Target::O, Target::Up]);
    // The tiny Qwen3-MoE with adapters on v, the dense layer's down and both stacked experts.
    adapter_gradients_match(
        "qwen3_moe",
        vec![
            Target::V,
            Target::Down,
            Target::ExpertsGateUp,
            Target::ExpertsDown,
        ],
    );
}

fn adapter_gradients_match(family: &str, targets: Vec<Target>) {
    let w = base(family);
    let config = w.config.clone();
    let lora = LoraConfig {
        rank: 3,
        alpha: 5.0,
        targets,
        use_rslora: false,
    };
    let adapter = with_random_b(LoraAdapter::init(&config, &lora, 5), 6);
    let specs = lora_param_table(&config, &adapter.lora);
    let n_base = w.tensors.len();
    let build = |with_grad: bool| {
        let a = LogProbArgs::declare("lora_lp", &config, &specs);
        let loss_of = |args: &[Tensor]| a.merged_loss(&config, &adapter.lora, args);
        let wrt: Vec<usize> = (0..a.adapters.len()).collect();
        let program = if with_grad {
            let (loss, grads) = value_and_grad(loss_of, &a.adapters, &wrt).unwrap();
            let mut outs = vec![&loss];
            outs.extend(grads.iter());
            a.g.build(&outs).unwrap()
        } else {
            a.g.build(&[&loss_of(&a.adapters)]).unwrap()
        };
        program.compile(client()).unwrap()
    };
    let model = DeviceModel::upload(client(), &w, DType::F32, 0).unwrap();
    let adapter_bufs = upload_adapter(&adapter);
    let extra = fixed_inputs();
    let run = |exe: &xla::runtime::Executable, replace: Option<(usize, &Buffer)>| {
        let mut args: Vec<&Buffer> = model.weights().iter().chain(&adapter_bufs).collect();
        if let Some((i, b)) = replace {
            args[n_base + i] = b;
        }
        args.extend(extra.iter());
        exe.execute(&args).unwrap()
    };
    let out = run(&build(true), None);
    let loss_exe = build(false);
    let mut rng = rand::rngs::StdRng::seed_from_u64(42);
    let h = 0.05f64;
    // Tolerance as in forward_grad.rs: an f32 loss of about -100.
    for (k, t) in adapter.tensors.iter().enumerate() {
        let grad = out[1 + k].to_host::<f32>().unwrap();
        assert!(grad.iter().any(|&g| g != 0.0), "{}: zero gradient", t.name);
        let base_values = t.to_f32_vec();
        let mut dir: Vec<f64> = (0..base_values.len())
            .map(|_| rng.random::<f64>() - 0.5)
            .collect();
        let norm = dir.iter().map(|x| x * x).sum::<f64>().sqrt();
        dir.iter_mut().for_each(|x| *x /= norm);
        let analytic: f64 = grad.iter().zip(&dir).map(|(g, d)| *g as f64 * d).sum();
        let shape: Vec<i64> = t.shape.iter().map(|&d| d as i64).collect();
        let loss_at = |sign: f64| {
            let moved: Vec<f32> = base_values
                .iter()
                .zip(&dir)
                .map(|(v, d)| (*v as f64 + sign * h * d) as f32)
                .collect();
            let b = client().buffer_from_host(&moved, &shape, 0).unwrap();
            run(&loss_exe, Some((k, &b)))[0].to_host::<f32>().unwrap()[0] as f64
        };
        let numeric = (loss_at(1.0) - loss_at(-1.0)) / (2.0 * h);
        let tol = 1e-2 * analytic.abs().max(numeric.abs()) + 2e-3;
        assert!(
            (analytic - numeric).abs() <= tol,
            "{}: analytic directional derivative {analytic}, finite difference {numeric}",
            t.name
        );
    }
}

/// Adapters applied beside the frozen weights (`x·Wᵀ + s·(x·Aᵀ)·Bᵀ`,
/// `DecoderParams::with_adapters`) compute the function of the merged weights: the summed
/// log-probabilities of a padded batch through the tiny Llama, Qwen2, Qwen3 and Qwen3-MoE (its
/// experts adapted too) with adapters on every projection agree in f32, and so do their
/// gradients with respect to every A and B.
#[test]
fn adapters_applied_beside_the_weights_give_the_merged_weights_function_and_gradients() {
    for (family, seed) in [("llama", 11), ("qwen2", 12), ("qwen3", 13), ("qwen3_moe", 14)] {
        let w = base(family);
        let config = w.config.clone();
        let mut targets = Target::ALL.to_vec();
        if config.moe.is_some() {
            targets.extend(Target::EXPERTS);
        }
        let lora = LoraConfig {
            rank: 3,
            alpha: 5.0,
            targets,
            use_rslora: false,
        };
        let adapter = with_random_b(LoraAdapter::init(&config, &lora, seed), seed + 1);
        let specs = lora_param_table(&config, &adapter.lora);
        let a = LogProbArgs::declare("lora_applied_vs_merged", &config, &specs);
        let merged_loss = |args: &[Tensor]| a.merged_loss(&config, &adapter.lora, args);
        let applied_loss = |args: &[Tensor]| a.loss(&a.p.clone().with_adapters(&adapter.lora, args).unwrap());
        let wrt: Vec<usize> = (0..a.adapters.len()).collect();
        let (lm, gm) = value_and_grad(merged_loss, &a.adapters, &wrt).unwrap();
        let (la, ga) = value_and_grad(applied_loss, &a.adapters, &wrt).unwrap();
        let mut outs = vec![&lm, &la];
        outs.extend(gm.iter().chain(ga.iter()));
        let exe = a.g.build(&outs).unwrap().compile(client()).unwrap();
        let model = DeviceModel::upload(client(), &w, DType::F32, 0).unwrap();
        let adapter_bufs = upload_adapter(&adapter);
        let extra = fixed_inputs();
        let args: Vec<&Buffer> = model
            .weights()
            .iter()
            .chain(&adapter_bufs)
            .chain(&extra)
            .collect();
        let out = exe.execute(&args).unwrap();
        let value = |b: &Buffer| b.to_host::<f32>().unwrap();
        let (merged, applied) = (value(&out[0])[0], value(&out[1])[0]);
        assert!(
            (merged - applied).abs() <= 1e-5 * merged.abs().max(1.0),
            "{family}: log-prob sum merged {merged}, applied {applied}"
        );
        let n = specs.len();
        for (k, spec) in specs.iter().enumerate() {
            let (gm, ga) = (value(&out[2 + k]), value(&out[2 + n + k]));
            let scale = gm.iter().fold(0.0f32, |m, x| m.max(x.abs())).max(1e-3);
            let worst = gm.iter().zip(&ga).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(
                worst <= 1e-4 * scale,
                "{family}: gradient of {} differs by {worst} (largest entry {scale})",
                spec.name
            );
        }
    }
}
