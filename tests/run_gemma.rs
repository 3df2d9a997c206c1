//! `grpo run` on a tiny random Gemma 3 (a sliding and a global layer, Gemma's chat template
//! over SmolLM2's tokenizer): the arithmetic task's reward rises, a resumed run trains
//! identically, LoRA adapts its projections, and the export loads as a Gemma 3 again.

mod common;

use common::*;
use std::path::Path;

/// A reward the tiny model can learn in a few steps (at a learning rate only a model this small
/// takes): the response starts with a letter from a to m, which few of its first tokens do at
/// random initialisation.
const REWARD: &str = "reward.scorers={starts_a_to_m: {kind: format_regex, pattern: '^[a-m]'}}";
const SOURCES: &str = "reward.data_sources={grpo/arithmetic: starts_a_to_m}";

#[test]
fn a_tiny_gemma3_learns_resumes_exactly_and_exports() {
    let dir = tempfile::tempdir().unwrap();
    let model = testkit::tiny_gemma_chat_model(dir.path());
    let train = arithmetic(dir.path(), "train", 1, 64);
    let val = arithmetic(dir.path(), "val", 2, 4);
    let run = |out: &Path, steps: u64, extra: &[&str]| {
        let r = tiny_recipe(dir.path(), "gemma.yaml", &model, &train, &val, out, 12, "");
        let total = format!("trainer.total_training_steps={steps}");
        let mut args = vec!["run", r.to_str().unwrap(), "--quiet", "--set", &total];
        args.extend(["--set", REWARD, "--set", SOURCES, "--set", "actor.optim.lr=0.1"]);
        args.extend_from_slice(extra);
        let o = run_grpo(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    };
    let whole = dir.path().join("whole");
    run(&whole, 12, &[]);
    let m = metrics(&whole);
    let score = metric_series(&m, "critic/score/mean");
    let mean = |s: &[f64]| s.iter().sum::<f64>() / s.len() as f64;
    let (first, last) = (mean(&score[..4]), mean(&score[8..]));
    assert!(last > first + 0.5, "reward over the steps: {score:?}");
    assert!(metric_series(&m, "actor/grad_norm").iter().all(|g| *g > 0.0));

    let resumed = dir.path().join("resumed");
    run(&resumed, 6, &[]);
    run(&resumed, 12, &[]);
    assert_same_training(&whole, &resumed, "stopped at step 6 and resumed");

    // Exported, the model loads as the same Gemma 3, its norm offsets and GeGLU trained.
    assert_exported_and_trained(
        &whole,
        &dir.path().join("exported"),
        &model,
        &[
            "model.layers.0.post_feedforward_layernorm.weight",
            "model.layers.1.mlp.gate_proj.weight",
            "model.embed_tokens.weight",
        ],
    );

    // LoRA on the attention and the GeGLU's projections (a step whose groups all score alike
    // has no gradient: the first, here).
    let lora = dir.path().join("lora");
    run(
        &lora,
        4,
        &[
            "--set",
            "actor.lora_rank=4",
            "--set",
            "actor.target_modules=[q_proj, o_proj, gate_proj, down_proj]",
        ],
    );
    let norms = metric_series(&metrics(&lora), "actor/grad_norm");
    assert!(norms.iter().any(|g| *g > 0.0), "{norms:?}");
}
