//! `grpo run` scored by a discriminative reward model (`reward.scorers.NAME: {kind:
//! reward_model}`) and a generative judge (`kind: judge`) combined with a rule scorer by a
//! `weighted` scorer: in the orchestrator's process, and in a reward worker process that is
//! killed with SIGKILL mid-run and replaced (loading the models again) while the run goes on.

mod common;

use common::*;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

/// The tiny recipe with its reward replaced: 1.0 x the reward model + 0.5 x the rule + 0.25 x
/// the judge (the tiny chat model asked whether the answer is right, its P(yes)), and each
/// step's samples written to `OUTPUT/rollouts`.
fn recipe(dir: &Path, name: &str, rm: &Path, output: &Path, cluster: &str) -> std::path::PathBuf {
    let (model, train, val) = (
        dir.join("tiny-smollm2"),
        dir.join("train.parquet"),
        dir.join("val.parquet"),
    );
    let path = tiny_recipe(dir, name, &model, &train, &val, output, 4, cluster);
    let text = std::fs::read_to_string(&path).unwrap();
    let start = text.find("reward:\n").unwrap();
    let end = text.find("actor:\n").unwrap();
    let reward = format!(
        "reward:\n  scorers:\n    starts_with_a_word: {{kind: format_regex, pattern: '^\\S'}}\n    \
         rm: {{kind: reward_model, path: {rm}, max_length: 256, dtype: f32}}\n    \
         judge: {{kind: judge, path: {judge}, dtype: f32, instruction: \"Question: {{{{ prompt }}}}\\nAnswer: {{{{ response }}}}\\nRight?\", \
         verdict: {{kind: probability, yes: \"Yes\", no: \"No\"}}}}\n    \
         rm_and_word: {{kind: weighted, parts: [{{scorer: rm, weight: 1.0}}, {{scorer: starts_with_a_word, weight: 0.5}}, {{scorer: judge, weight: 0.25}}]}}\n  \
         data_sources:\n    grpo/arithmetic: rm_and_word\n",
        rm = rm.display(),
        judge = dir.join("tiny-smollm2").display(),
    );
    let text = format!("{}{reward}{}", &text[..start], &text[end..]).replace(
        "trainer:\n",
        &format!(
            "trainer:\n  rollout_data_dir: {}\n",
            output.join("rollouts").display()
        ),
    );
    std::fs::write(&path, text).unwrap();
    path
}

/// Each sample of `step`'s rollout dump: (output text, score, reward model part, rule part,
/// judge part).
fn scored(output: &Path, step: u64) -> Vec<(String, f64, f64, f64, f64)> {
    let text = std::fs::read_to_string(output.join("rollouts").join(format!("{step}.jsonl"))).unwrap();
    text.lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            let f = |k: &str| v[k].as_f64().unwrap_or_else(|| panic!("no `{k}` in {v}"));
            (
                v["output"].as_str().unwrap().to_string(),
                f("score"),
                f("rm"),
                f("starts_with_a_word"),
                f("judge"),
            )
        })
        .collect()
}

#[test]
fn a_reward_model_scores_the_run_in_process_and_in_a_worker_that_survives_kill_9() {
    let dir = tempfile::tempdir().unwrap();
    tiny_inputs(dir.path(), 64, 4);
    let rm = testkit::tiny_reward_model(dir.path(), 11);
    let (local, remote) = (dir.path().join("local"), dir.path().join("remote"));
    let r_local = recipe(dir.path(), "local.yaml", &rm, &local, "");
    let r_remote = recipe(
        dir.path(),
        "remote.yaml",
        &rm,
        &remote,
        "cluster:\n  reward_workers: 1\n  worker_timeout_s: 2\n",
    );
    let o = grpo().arg("run").arg(&r_local).arg("--quiet").output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));

    let mut run = grpo()
        .arg("run")
        .arg(&r_remote)
        .arg("--quiet")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for_step(&remote, 1, &mut run, Duration::from_secs(300));
    let workers = run_worker_pids(&remote, "reward");
    assert_eq!(workers.len(), 1, "{workers:?}");
    assert!(send_signal(workers[0], "KILL"), "kill -9 {}", workers[0]);
    let deadline = Instant::now() + Duration::from_secs(300);
    let status = loop {
        if let Some(status) = run.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = run.kill();
            panic!("the run did not finish within 300 s of the kill");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut run.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(status.success(), "{stderr}");
    assert!(
        stderr.contains("starting a replacement for reward worker 0"),
        "{stderr}"
    );

    let (m_local, m_remote) = (metrics(&local), metrics(&remote));
    assert_eq!(
        metric_series(&m_remote, "batch/samples"),
        vec![16.0; 4],
        "{stderr}"
    );
    assert!(
        metric_series(&m_remote, "workers/failures_total")
            .last()
            .copied()
            .unwrap_or(0.0)
            >= 1.0
    );
    assert_eq!(prompts_seen(&local), prompts_seen(&remote));
    for step in 1..=4 {
        let samples = scored(&remote, step);
        assert_eq!(samples.len(), 16);
        for (text, score, rm, word, judge) in &samples {
            assert!(rm.is_finite() && (*word == 0.0 || *word == 1.0), "{text:?}");
            assert!(*judge > 0.0 && *judge < 1.0, "{text:?}: P(yes) {judge}");
            let expected = rm + 0.5 * word + 0.25 * judge;
            assert!(
                (score - expected).abs() < 1e-9,
                "{text:?}: {score} vs {rm} + 0.5 x {word} + 0.25 x {judge}"
            );
        }
        let rms: Vec<f64> = samples.iter().map(|s| s.2).collect();
        assert!(
            rms.iter().any(|&x| x != rms[0]),
            "step {step}: the model gives every response {}",
            rms[0]
        );
        assert_eq!(
            m_remote[&step]["reward/errors"].as_f64(),
            Some(0.0),
            "step {step}: {stderr}"
        );
    }
    eprintln!(
        "step 1 (reward model, judge) scores: {:?}",
        scored(&remote, 1).iter().map(|s| (s.2, s.4)).collect::<Vec<_>>()
    );
    // Step 1 (before the kill, same weights and seeds): the worker, which received each
    // prompt over gRPC, scored every sample as the orchestrator's own models did.
    let (a, b) = (scored(&local, 1), scored(&remote, 1));
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.0, y.0);
        assert!(
            (x.2 - y.2).abs() < 1e-5,
            "{:?}: {} in process vs {} in the worker",
            x.0,
            x.2,
            y.2
        );
        assert!((x.4 - y.4).abs() < 1e-6, "{:?}: judge {} vs {}", x.0, x.4, y.4);
    }
    let mean =
        |m: &std::collections::BTreeMap<u64, serde_json::Value>| m[&1]["critic/score/mean"].as_f64().unwrap();
    assert!((mean(&m_local) - mean(&m_remote)).abs() < 1e-5);
}
