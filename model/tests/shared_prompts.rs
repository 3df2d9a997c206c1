//! `logprobs_graph_shared_prompts` (each prompt run once, its group of responses attending to
//! its keys and values) gives the same log-probabilities, entropies and parameter gradients as
//! `logprobs_graph_span` over the same rows with the prompt copied into each row, for the tiny
//! Llama, Qwen2 and Qwen3 models: prompts of different lengths (1 token up to the full width),
//! responses of different lengths (empty, one token, full), a padding row, two blocks, and a
//! response length of one column.

use std::path::PathBuf;
use testkit::client;

use model::forward::{logprobs_graph_shared_prompts, logprobs_graph_span, DecoderParams, SharedPrompts};
use model::params::param_table;
use model::programs::DeviceModel;
use model::safetensors_io::load_hf_checkpoint;
use xla::graph::{value_and_grad, Graph, Tensor};
use xla::runtime::Buffer;
use xla::DType;

/// Rows as (block, prompt slot in the block, response); `None` is a padding row.
struct Case {
    prompt_len: usize,
    response_len: usize,
    blocks: usize,
    /// Prompts of each block.
    prompts: Vec<Vec<Vec<i32>>>,
    rows: Vec<Option<(usize, usize, Vec<i32>)>>,
}

impl Case {
    fn slots(&self) -> usize {
        self.prompts[0].len()
    }

    /// Inputs of the shared program: prompts, prompt mask, responses, response mask, index.
    fn shared_inputs(&self) -> Vec<(Vec<i32>, Vec<i64>)> {
        let (p, l) = (self.prompt_len, self.response_len);
        let u = self.blocks * self.slots();
        let (mut pt, mut pm) = (vec![0; u * p], vec![0; u * p]);
        for (s, prompt) in self.prompts.iter().flatten().enumerate() {
            for (i, &t) in prompt.iter().enumerate() {
                pt[s * p + p - prompt.len() + i] = t;
                pm[s * p + p - prompt.len() + i] = 1;
            }
        }
        let b = self.rows.len();
        let (mut rt, mut rm, mut idx) = (vec![0; b * l], vec![0; b * l], vec![0; b]);
        for (r, row) in self.rows.iter().enumerate() {
            if let Some((_, slot, response)) = row {
                idx[r] = *slot as i32;
                for (j, &t) in response.iter().enumerate() {
                    rt[r * l + j] = t;
                    rm[r * l + j] = 1;
                }
            }
        }
        let (u, p, b, l) = (u as i64, p as i64, b as i64, l as i64);
        vec![
            (pt, vec![u, p]),
            (pm, vec![u, p]),
            (rt, vec![b, l]),
            (rm, vec![b, l]),
            (idx, vec![b]),
        ]
    }

    /// Inputs of the per-row program: tokens and mask `[B, P + L]`.
    fn row_inputs(&self) -> Vec<(Vec<i32>, Vec<i64>)> {
        let (p, l) = (self.prompt_len, self.response_len);
        let w = p + l;
        let b = self.rows.len();
        let (mut t, mut m) = (vec![0; b * w], vec![0; b * w]);
        for (r, row) in self.rows.iter().enumerate() {
            if let Some((block, slot, response)) = row {
                let prompt = &self.prompts[*block][*slot];
                for (i, &x) in prompt.iter().enumerate() {
                    t[r * w + p - prompt.len() + i] = x;
                    m[r * w + p - prompt.len() + i] = 1;
                }
                for (j, &x) in response.iter().enumerate() {
                    t[r * w + p + j] = x;
                    m[r * w + p + j] = 1;
                }
            }
        }
        vec![(t, vec![b as i64, w as i64]), (m, vec![b as i64, w as i64])]
    }
}

fn two_block_case() -> Case {
    Case {
        prompt_len: 5,
        response_len: 4,
        blocks: 2,
        prompts: vec![
            vec![vec![3, 17, 25, 9, 1], vec![7]],
            vec![vec![11, 12, 13], vec![30, 2]],
        ],
        rows: vec![
            Some((0, 0, vec![4, 5, 6, 7])),
            Some((0, 0, vec![8, 9])),
            Some((0, 1, vec![10])),
            Some((1, 1, vec![])),
            Some((1, 0, vec![21, 22, 23])),
            None,
        ],
    }
}

fn one_column_case() -> Case {
    Case {
        prompt_len: 3,
        response_len: 1,
        blocks: 1,
        prompts: vec![vec![vec![5, 6], vec![1, 2, 3]]],
        rows: vec![Some((0, 1, vec![9])), Some((0, 0, vec![4])), Some((0, 1, vec![]))],
    }
}

/// `n` token ids (1..=383, within the tiny models' vocabulary), varied by `seed`.
fn tokens(n: usize, seed: usize) -> Vec<i32> {
    (0..n)
        .map(|i| ((i * 37 + seed * 11 + 5) % 383 + 1) as i32)
        .collect()
}

/// Rows of 256 columns: the per-row program runs its attention in two causal halves
/// (`model::forward::CAUSAL_HALVES_FROM`), the shared program does not, so this also checks the
/// halves against whole attention, left padding and empty responses included.
fn long_case() -> Case {
    assert_eq!(model::forward::CAUSAL_HALVES_FROM, 256);
    Case {
        prompt_len: 100,
        response_len: 156,
        blocks: 1,
        prompts: vec![vec![tokens(100, 1), tokens(37, 2)]],
        rows: vec![
            Some((0, 0, tokens(156, 3))),
            Some((0, 0, tokens(90, 4))),
            Some((0, 1, tokens(156, 5))),
            Some((0, 1, vec![])),
        ],
    }
}

/// Prompts of 256 columns: the shared program runs the prompts' attention in halves (split at
/// 128), the per-row program its rows of 260 (split at 130).
fn long_prompt_case() -> Case {
    Case {
        prompt_len: 256,
        response_len: 4,
        blocks: 1,
        prompts: vec![vec![tokens(256, 1), tokens(140, 2)]],
        rows: vec![
            Some((0, 0, tokens(4, 3))),
            Some((0, 1, tokens(2, 4))),
            Some((0, 1, tokens(4, 5))),
            Some((0, 0, vec![])),
        ],
    }
}

/// Runs `log-probs, entropies, d(loss)/d(every parameter)` for both formulations and returns
/// them (shared first).
fn both(family: &str, dtype: DType, case: &Case) -> [Vec<Vec<f32>>; 2] {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/tiny")
        .join(family);
    let weights = load_hf_checkpoint(&dir).expect("tiny checkpoint");
    let config = weights.config.clone();
    let model = DeviceModel::upload(client(), &weights, dtype, 0).unwrap();
    let n_params = param_table(&config).len();
    let (b, l) = (case.rows.len() as i64, case.response_len as i64);
    // A loss that weighs every position differently, so each gradient entry is checked.
    let weights_lp: Vec<f64> = (0..b * l).map(|i| 0.3 + (i % 7) as f64 * 0.1).collect();

    let run = |shared: bool| -> Vec<Vec<f32>> {
        let g = Graph::new(if shared { "shared" } else { "rows" });
        let p = DecoderParams::declare(&g, &config, dtype);
        let inputs = if shared {
            case.shared_inputs()
        } else {
            case.row_inputs()
        };
        let args: Vec<Tensor> = inputs
            .iter()
            .enumerate()
            .map(|(i, (_, dims))| g.parameter(&format!("in{i}"), DType::I32, dims))
            .collect();
        let temp = g.scalar(0.7, DType::F32);
        let forward = |params: &[Tensor]| {
            let p = DecoderParams::from_tensors(&config, params).unwrap();
            if shared {
                let batch = SharedPrompts::from_inputs(&args, case.blocks as i64);
                logprobs_graph_shared_prompts(&g, &p, &batch, &temp)
            } else {
                logprobs_graph_span(&g, &p, &args[0], &args[1], &temp, case.prompt_len as i64)
            }
        };
        let (lp, ent) = forward(&p.all);
        let w = g.constant_f64(&weights_lp, DType::F32, &[b, l]);
        let (_, grads) = value_and_grad(
            |params| {
                let (lp, ent) = forward(params);
                &(&lp * &w).sum_all() + &(&ent.sum_all() * 0.1)
            },
            &p.all,
            &(0..n_params).collect::<Vec<_>>(),
        )
        .unwrap();
        // Gradients of bf16 parameters are bf16; read them as f32.
        let grads: Vec<Tensor> = grads.iter().map(|t| t.convert_if_needed(DType::F32)).collect();
        let mut outs = vec![&lp, &ent];
        outs.extend(grads.iter());
        let exe = g.build(&outs).unwrap().compile(client()).unwrap();
        let bufs: Vec<Buffer> = inputs
            .iter()
            .map(|(v, dims)| client().buffer_from_host(v, dims, 0).unwrap())
            .collect();
        let mut call: Vec<&Buffer> = model.weights().iter().collect();
        call.extend(bufs.iter());
        exe.execute(&call)
            .unwrap()
            .iter()
            .map(|o| o.to_host::<f32>().unwrap())
            .collect()
    };
    [run(true), run(false)]
}

fn assert_close(what: &str, a: &[f32], b: &[f32], rel: f32) {
    assert_eq!(a.len(), b.len(), "{what}");
    let scale = b.iter().fold(0.0f32, |m, x| m.max(x.abs())).max(1e-3);
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= rel * scale,
            "{what}[{i}]: shared prompts {x}, one row each {y} (scale {scale})"
        );
    }
}

fn check(family: &str, dtype: DType, case: &Case, rel: f32) {
    let [shared, rows] = both(family, dtype, case);
    let table = param_table(
        &load_hf_checkpoint(
            &PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("fixtures/tiny")
                .join(family),
        )
        .unwrap()
        .config,
    );
    assert_close(&format!("{family} {dtype} log-probs"), &shared[0], &rows[0], rel);
    assert_close(&format!("{family} {dtype} entropies"), &shared[1], &rows[1], rel);
    // Real tokens have non-zero log-probs; padding and empty responses give exactly 0.
    let l = case.response_len;
    for (r, row) in case.rows.iter().enumerate() {
        let len = row.as_ref().map_or(0, |(_, _, resp)| resp.len());
        for j in 0..l {
            let v = shared[0][r * l + j];
            assert_eq!(v != 0.0, j < len, "{family} row {r} column {j}: {v}");
        }
    }
    for (k, spec) in table.iter().enumerate() {
        assert_close(
            &format!("{family} {dtype} gradient of {}", spec.name),
            &shared[2 + k],
            &rows[2 + k],
            rel,
        );
    }
}

#[test]
fn llama_shared_prompts_equal_one_row_each() {
    check("llama", DType::F32, &two_block_case(), 1e-4);
    check("llama", DType::F32, &one_column_case(), 1e-4);
    check("llama", DType::F32, &long_case(), 1e-4);
    check("llama", DType::F32, &long_prompt_case(), 1e-4);
}

#[test]
fn qwen2_shared_prompts_equal_one_row_each() {
    check("qwen2", DType::F32, &two_block_case(), 1e-4);
}

#[test]
fn qwen3_shared_prompts_equal_one_row_each() {
    check("qwen3", DType::F32, &two_block_case(), 1e-4);
}

/// Mistral with a sliding window of 5: a response's queries reach back into its prompt only
/// as far as the window, whatever the prompt's length and padding (and past the causal halves
/// of long rows).
#[test]
fn sliding_window_shared_prompts_equal_one_row_each() {
    check("mistral_window", DType::F32, &two_block_case(), 1e-4);
    check("mistral_window", DType::F32, &long_case(), 1e-4);
}

/// Gemma 3's sliding layers (window 5) and its global layer, each with its own RoPE, over
/// shared prompts: the responses' keys into their prompt masked per layer kind.
#[test]
fn gemma3_shared_prompts_equal_one_row_each() {
    check("gemma3", DType::F32, &two_block_case(), 1e-4);
    check("gemma3", DType::F32, &long_case(), 1e-4);
}

/// In bf16 both round keys and values to bf16 before the attention products; what is left is
/// the order of the f32 sums.
#[test]
fn bf16_shared_prompts_equal_one_row_each() {
    check("llama", DType::BF16, &two_block_case(), 2e-2);
}
