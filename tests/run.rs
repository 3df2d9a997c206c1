//! `grpo run` end to end on a tiny random-weight model with SmolLM2's tokenizer: the whole loop
//! (sampler -> rollout -> rewards -> learner -> weight sync -> metrics, validation,
//! checkpoints), resume after a kill -9, and the same run with its rollout and reward roles in
//! worker processes over gRPC.

mod common;

use common::*;
use std::path::Path;

#[test]
fn a_tiny_run_trains_validates_checkpoints_and_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_chat_model(dir.path());
    let train = arithmetic(dir.path(), "train", 1, 64);
    let val = arithmetic(dir.path(), "val", 2, 6);
    let out = dir.path().join("out");
    let r = tiny_recipe(dir.path(), "recipe.yaml", &model, &train, &val, &out, 3, "");
    let o = run_grpo(&["run", r.to_str().unwrap(), "--quiet"]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    let m = metrics(&out);
    assert_eq!(
        m.keys().copied().collect::<Vec<_>>(),
        vec![0, 1, 2, 3],
        "{stderr}"
    );
    for key in [
        "critic/score/mean",
        "critic/score/std",
        "response_length/mean",
        "actor/pg_loss",
        "actor/kl",
        "actor/entropy",
        "actor/grad_norm",
        "actor/lr",
        "timing_s/gen",
        "timing_s/reward",
        "timing_s/update",
        "timing_s/update_weights",
        "timing_s/step",
        "timing_per_token_ms/gen",
        "critic/score/max",
        "critic/rewards/mean",
        "critic/advantages/mean",
        "critic/returns/min",
        "prompt_length/clip_ratio",
        "response_length/clip_ratio",
        "perf/throughput",
        "perf/total_num_tokens",
        "training/global_step",
        "training/epoch",
        "perf/gen_tokens_per_s",
        "perf/train_tokens_per_s",
        "weights/version_lag",
        "reward/errors",
        // The rollout/learner mismatch, reported whatever the correction applies.
        "rollout_corr/kl",
        "rollout_corr/k3_kl",
        "rollout_corr/training_ppl",
        "rollout_corr/rollout_ppl",
        "rollout_corr/log_ppl_abs_diff",
        "rollout_corr/chi2_token",
        "rollout_corr/chi2_seq",
        "rollout_corr/rollout_is_mean",
        "rollout_corr/rollout_is_eff_sample_size",
    ] {
        assert!(
            m[&3].get(key).is_some_and(|v| v.is_number()),
            "step 3 lacks {key}: {}",
            m[&3]
        );
    }
    assert!(m[&0][VAL_CORE].is_number() && m[&2][VAL_CORE].is_number());
    let keys = m[&3].as_object().unwrap();
    assert!(
        !keys.keys().any(|k| k.contains("router")),
        "a dense model reports no router: {keys:?}"
    );
    assert_eq!(m[&3]["training/global_step"], 3.0);
    assert_eq!(m[&3]["weights/version"], 3.0);
    assert_eq!(m[&3]["weights/version_lag"], 0.0);
    assert!(out.join("checkpoints/step_2/manifest.json").is_file());
    assert!(out.join("checkpoints/step_3/manifest.json").is_file());
    let seen = prompts_seen(&out);
    assert_eq!(seen.len(), 3);
    assert!(seen.values().all(|v| v.len() == 4));
}

#[test]
fn auto_compute_types_follow_the_cpu_and_are_recorded() {
    let dir = tempfile::tempdir().unwrap();
    let (model, train, val) = tiny_inputs(dir.path(), 16, 4);
    // An output folder whose parents do not exist yet.
    let out = dir.path().join("runs/new/out");
    let r = tiny_recipe(dir.path(), "recipe.yaml", &model, &train, &val, &out, 1, "");
    let o = run_grpo(&[
        "run",
        r.to_str().unwrap(),
        "--quiet",
        "--set",
        "rollout.dtype=auto",
        "--set",
        "actor.param_dtype=auto",
    ]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    let (native, reason) = xla::runtime::HostCpu::get().bf16_support();
    let chosen = if native { "bf16" } else { "f32" };
    let line = format!("rollout.dtype and actor.param_dtype: auto chose {chosen}: {reason}");
    assert!(
        stderr.lines().next() == Some(line.as_str()),
        "the first line should be `{line}`:\n{stderr}"
    );
    let headers = run_headers(&out);
    assert_eq!(headers.len(), 1, "{headers:?}");
    assert_eq!(headers[0]["rollout_dtype"], chosen);
    assert_eq!(headers[0]["actor_param_dtype"], chosen);
    assert_eq!(headers[0]["start_step"], 0);
    assert_eq!(headers[0]["dtype_auto"], serde_json::json!([line]));
    // The workers' copy of the recipe holds the choice, not `auto`.
    let written = std::fs::read_to_string(out.join("recipe.yaml")).unwrap();
    assert!(written.contains(&format!("dtype: {chosen}")), "{written}");
    assert!(!written.contains("dtype: auto"), "{written}");
    assert_eq!(metrics(&out).keys().copied().collect::<Vec<_>>(), vec![0, 1]);
}

#[test]
fn validation_in_shuffled_batches_scores_the_same_rows_alike() {
    let dir = tempfile::tempdir().unwrap();
    let (model, train, val) = tiny_inputs(dir.path(), 16, 6);
    let validation = |name: &str, sets: &[&str]| {
        let out = dir.path().join(name);
        let r = tiny_recipe(
            dir.path(),
            &format!("{name}.yaml"),
            &model,
            &train,
            &val,
            &out,
            1,
            "",
        );
        let mut args = vec!["run", r.to_str().unwrap(), "--quiet"];
        for set in ["trainer.test_freq=-1", "trainer.save_freq=-1"]
            .iter()
            .chain(sets)
        {
            args.extend(["--set", set]);
        }
        let o = run_grpo(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let text = std::fs::read_to_string(out.join("validation/step_0.jsonl")).unwrap();
        let lines: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        (metrics(&out)[&0][VAL_CORE].clone(), lines)
    };
    let (whole_accuracy, whole) = validation("whole", &[]);
    let (batched_accuracy, batched) = validation(
        "batched",
        &["data.val_batch_size=4", "data.validation_shuffle=true"],
    );
    assert_eq!(batched_accuracy, whole_accuracy);
    let rows = |lines: &[serde_json::Value]| {
        lines
            .iter()
            .map(|l| l["row"].as_u64().unwrap())
            .collect::<Vec<_>>()
    };
    assert_eq!(rows(&whole), [0, 1, 2, 3, 4, 5]);
    let shuffled = rows(&batched);
    assert_ne!(shuffled, rows(&whole), "the shuffled order is the file order");
    let mut sorted = shuffled.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, rows(&whole), "every row once");
    // Each row's responses and scores are the same, whichever batch it was in.
    for line in &whole {
        let twin = batched.iter().find(|b| b["row"] == line["row"]).unwrap();
        assert_eq!(
            (&twin["response"], &twin["score"]),
            (&line["response"], &line["score"])
        );
    }
}

#[test]
fn kill_9_then_run_again_resumes_with_the_same_prompts_and_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_chat_model(dir.path());
    let train = arithmetic(dir.path(), "train", 1, 64);
    let val = arithmetic(dir.path(), "val", 2, 4);
    let whole = dir.path().join("whole");
    let broken = dir.path().join("broken");
    let r_whole = tiny_recipe(dir.path(), "whole.yaml", &model, &train, &val, &whole, 4, "");
    let r_broken = tiny_recipe(dir.path(), "broken.yaml", &model, &train, &val, &broken, 4, "");
    let save_each = [
        "--set",
        "trainer.save_freq=1",
        "--set",
        "trainer.test_freq=-1",
        "--quiet",
    ];

    let o = grpo().arg("run").arg(&r_whole).args(save_each).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));

    // Kill -9 once step 2 is saved, then run the same command again.
    let mut child = grpo()
        .arg("run")
        .arg(&r_broken)
        .args(save_each)
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let saved = broken.join("checkpoints/step_2/manifest.json");
    let t = std::time::Instant::now();
    while !saved.exists() {
        assert!(t.elapsed().as_secs() < 300, "no checkpoint at step 2 after 300 s");
        assert!(
            child.try_wait().unwrap().is_none(),
            "the run ended before it could be killed"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let o = grpo().arg("run").arg(&r_broken).args(save_each).output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");

    assert_eq!(prompts_seen(&whole), prompts_seen(&broken));
    let (a, b) = (metrics(&whole), metrics(&broken));
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    for key in [
        "critic/score/mean",
        "response_length/mean",
        "actor/pg_loss",
        "actor/grad_norm",
        "actor/kl",
    ] {
        assert_eq!(
            metric_series(&a, key),
            metric_series(&b, key),
            "{key} differs after the resume"
        );
    }
    // Running again once finished does nothing.
    let o = grpo().arg("run").arg(&r_broken).args(save_each).output().unwrap();
    assert!(String::from_utf8_lossy(&o.stderr).contains("nothing to do"));
}

#[test]
fn one_step_off_policy_overlaps_generation_with_the_update() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_chat_model(dir.path());
    let train = arithmetic(dir.path(), "train", 1, 64);
    let val = arithmetic(dir.path(), "val", 2, 4);
    let out = dir.path().join("out");
    let r = tiny_recipe(
        dir.path(),
        "r.yaml",
        &model,
        &train,
        &val,
        &out,
        3,
        "algorithm:\n  rollout_correction:\n    rollout_is: token\n    rollout_rs: token_k1\n    rollout_rs_threshold: 0.2_5\n",
    );
    let o = grpo()
        .arg("run")
        .arg(&r)
        .args(["--set", "trainer.off_policy_steps=1", "--quiet"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let m = metrics(&out);
    // Step 1 is generated by version 0 and trained at version 0; later steps were generated
    // while the previous update ran, one version behind.
    assert_eq!(metric_series(&m, "weights/version_lag"), vec![0.0, 1.0, 1.0]);
    assert_eq!(prompts_seen(&out).len(), 3);
    // The correction sees the lag: the rollout's and the learner's log-probs agree at step 1
    // (same weights) and part one version later.
    let gap = metric_series(&m, "rollout_corr/log_ppl_abs_diff");
    eprintln!("log_ppl_abs_diff per step: {gap:?}");
    assert!(gap[1] > 10.0 * gap[0] && gap[2] > 10.0 * gap[0], "{gap:?}");
    for key in [
        "rollout_corr/rollout_is_mean",
        "rollout_corr/rollout_rs_masked_fraction",
    ] {
        assert_eq!(metric_series(&m, key).len(), 3, "{key}");
    }
}

#[test]
fn rollout_and_reward_in_worker_processes_give_the_same_metrics_and_survive_kill_9() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_chat_model(dir.path());
    let train = arithmetic(dir.path(), "train", 1, 64);
    let val = arithmetic(dir.path(), "val", 2, 4);
    let run = |name: &str, cluster: &str| {
        let out = dir.path().join(name);
        let r = tiny_recipe(
            dir.path(),
            &format!("{name}.yaml"),
            &model,
            &train,
            &val,
            &out,
            4,
            cluster,
        );
        (out, r)
    };
    let (local, r_local) = run("local", "");
    let (remote, r_remote) = run("remote", "cluster:\n  rollout_workers: 1\n  reward_workers: 1\n");
    let (killed, r_killed) = run(
        "killed",
        "cluster:\n  rollout_workers: 2\n  reward_workers: 2\n  worker_timeout_s: 5\n",
    );
    for r in [&r_local, &r_remote] {
        let o = grpo().arg("run").arg(r).arg("--quiet").output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }

    // One rollout and one reward worker process: the samples are drawn in the same KV slots
    // with the same seeds, so every metric matches the in-process run's.
    assert_same_training(&local, &remote, "in process vs worker processes");

    // Two of each; kill -9 one rollout worker and one reward worker once step 1 is done.
    let mut child = grpo()
        .arg("run")
        .arg(&r_killed)
        .arg("--quiet")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let t = std::time::Instant::now();
    let first_step = |out: &Path| {
        std::fs::read_to_string(out.join("metrics.jsonl"))
            .map(|s| s.lines().any(|l| l.starts_with("{\"step\":1,")))
            .unwrap_or(false)
    };
    while !first_step(&killed) {
        assert!(t.elapsed().as_secs() < 300, "no step 1 after 300 s");
        assert!(child.try_wait().unwrap().is_none(), "the run ended early");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let rollout = run_worker_pids(&killed, "rollout");
    let reward = run_worker_pids(&killed, "reward");
    assert_eq!(
        (rollout.len(), reward.len()),
        (2, 2),
        "workers: {rollout:?} {reward:?}"
    );
    for pid in [rollout[0], reward[0]] {
        assert!(std::process::Command::new("kill")
            .args(["-9", &pid.to_string()])
            .status()
            .unwrap()
            .success());
    }
    let o = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    // Every step trained on all its prompts' samples, exactly once each, and alike: a sample's
    // tokens and log-probs do not depend on which worker drew it or beside how many others
    // (two workers draw half a step each until one dies, then one draws it all).
    let c = metrics(&killed);
    assert_eq!(metric_series(&c, "batch/samples"), vec![16.0; 4], "{stderr}");
    assert_same_training(&local, &killed, "one engine vs two workers, one killed");
    assert_eq!(
        metric_series(&metrics(&remote), "rollout/log_prob_diff_mean"),
        metric_series(&c, "rollout/log_prob_diff_mean"),
        "the rollout's log-probs: one worker vs two, one killed"
    );
    let failures = metric_series(&c, "workers/failures_total")
        .last()
        .copied()
        .unwrap_or(0.0);
    assert!(failures >= 2.0, "both failures should be recorded: {stderr}");
    assert!(
        metric_series(&c, "workers/replaced_total")
            .last()
            .copied()
            .unwrap_or(0.0)
            >= 1.0,
        "{stderr}"
    );
    // No worker outlives the run.
    for out in [&remote, &killed] {
        assert!(run_worker_pids(out, "rollout").is_empty() && run_worker_pids(out, "reward").is_empty());
    }
}

#[test]
fn a_reward_file_written_for_verl_scores_the_run_and_its_extras_become_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let (model, train, val) = tiny_inputs(dir.path(), 8, 4);
    let reward_file = dir.path().join("my_reward.py");
    std::fs::write(
        &reward_file,
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):\n\
         \x20   word = solution_str[:1].isalnum()\n\
         \x20   assert data_source == 'grpo/arithmetic' and 'split' in extra_info\n\
         \x20   return {'score': float(word) + bonus, 'acc': word, 'pred': solution_str[:1]}\n",
    )
    .unwrap();
    let out = dir.path().join("out");
    let recipe = tiny_recipe(dir.path(), "custom.yaml", &model, &train, &val, &out, 2, "");
    let custom = format!(
        "reward.custom_reward_function={{path: {}, reward_kwargs: {{bonus: 0.25}}, workers: 2}}",
        reward_file.display()
    );
    let o = run_grpo(&[
        "run",
        recipe.to_str().unwrap(),
        "--set",
        "reward.data_sources={}",
        "--set",
        &custom,
    ]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    let m = metrics(&out);
    for step in [1, 2] {
        assert_eq!(m[&step]["reward/errors"], 0.0, "{}", m[&step]);
        let acc = m[&step]["reward/extra/acc"].as_f64().unwrap();
        let score = m[&step]["critic/score/mean"].as_f64().unwrap();
        assert!(
            (score - (acc + 0.25)).abs() < 1e-12,
            "score {score} = acc {acc} + bonus"
        );
    }
    // Validation: the function's `acc` is the core variable, its predictions give maj@N only
    // with N > 1 responses (one here).
    let core = "val-core/grpo/arithmetic/acc/mean@1";
    assert!(m[&0][core].is_number() && m[&2][core].is_number(), "{}", m[&0]);
    assert!(m[&0]["val-aux/grpo/arithmetic/reward/mean@1"].is_number());

    // A file that does not load stops the run before any work, naming the key.
    let o = run_grpo(&[
        "run",
        recipe.to_str().unwrap(),
        "--set",
        "reward.data_sources={}",
        "--set",
        "reward.custom_reward_function={path: /nonexistent/reward.py}",
    ]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        stderr.contains("reward.custom_reward_function.path") && stderr.contains("no such file"),
        "{stderr}"
    );
}

#[test]
fn val_only_and_resume_path_work_as_in_verl() {
    let dir = tempfile::tempdir().unwrap();
    let (model, train, val) = tiny_inputs(dir.path(), 16, 4);
    let first = dir.path().join("first");
    let recipe = tiny_recipe(dir.path(), "r.yaml", &model, &train, &val, &first, 2, "");
    let run = |out: &Path, set: &[&str]| {
        let mut args = vec!["run", recipe.to_str().unwrap(), "--output", out.to_str().unwrap()];
        for s in set {
            args.extend(["--set", s]);
        }
        let o = run_grpo(&args);
        let stderr = String::from_utf8_lossy(&o.stderr).to_string();
        assert!(o.status.success(), "{stderr}");
        stderr
    };
    run(&first, &[]);
    let checkpoint = first.join("checkpoints/step_2");
    let from = format!("trainer.resume_from_path={}", checkpoint.display());

    // val_only on a checkpoint of another run: one validation at its step, no training.
    let validated = dir.path().join("validated");
    let stderr = run(
        &validated,
        &["trainer.val_only=true", "trainer.resume_mode=resume_path", &from],
    );
    assert!(
        stderr.contains("validation at step 2 (trainer.val_only)"),
        "{stderr}"
    );
    let m = metrics(&validated);
    assert_eq!(m.keys().copied().collect::<Vec<_>>(), [2]);
    assert_eq!(m[&2][VAL_CORE], metrics(&first)[&2][VAL_CORE]);
    assert!(!validated.join("checkpoints").exists());

    // resume_path continues another run's checkpoint exactly as that run resumes it.
    let continued = dir.path().join("continued");
    run(
        &continued,
        &[
            "trainer.total_training_steps=3",
            "trainer.resume_mode=resume_path",
            &from,
        ],
    );
    run(&first, &["trainer.total_training_steps=3"]);
    let (a, b) = (metrics(&first), metrics(&continued));
    assert_eq!(b.keys().copied().collect::<Vec<_>>(), [3]);
    for key in [
        "critic/score/mean",
        "actor/pg_loss",
        "actor/grad_norm",
        "response_length/mean",
    ] {
        assert_eq!(a[&3][key], b[&3][key], "{key}");
    }

    // Settings that cannot mean what they say are refused before any work.
    for (set, says) in [
        (
            vec!["trainer.val_only=true", "trainer.val_before_train=false"],
            "needs trainer.val_before_train: true",
        ),
        (
            vec![from.as_str()],
            "is read only with trainer.resume_mode: resume_path",
        ),
        (
            vec!["trainer.resume_mode=resume_path"],
            "needs trainer.resume_from_path",
        ),
    ] {
        let mut args = vec!["run", recipe.to_str().unwrap()];
        for s in &set {
            args.extend(["--set", s]);
        }
        let o = run_grpo(&args);
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && stderr.contains(says), "{set:?}: {stderr}");
    }
}

#[test]
fn an_adaptive_kl_in_the_reward_moves_its_coefficient_and_a_resume_keeps_it() {
    let dir = tempfile::tempdir().unwrap();
    let (model, train, val) = tiny_inputs(dir.path(), 64, 4);
    let kl = [
        "--set",
        "actor.use_kl_loss=false",
        "--set",
        "algorithm.use_kl_in_reward=true",
        "--set",
        "algorithm.kl_penalty=low_var_kl",
        "--set",
        "algorithm.kl_coef=0.01",
        "--set",
        "algorithm.kl_ctrl={type: adaptive, target_kl: 1.0e-5, horizon: 16}",
    ];
    let run = |out: &Path, steps: u64, extra: &[&str]| {
        let r = tiny_recipe(dir.path(), "kl.yaml", &model, &train, &val, out, 4, "");
        let total = format!("trainer.total_training_steps={steps}");
        let mut args = vec!["run", r.to_str().unwrap(), "--quiet", "--set", &total];
        args.extend_from_slice(&kl);
        args.extend_from_slice(extra);
        let o = run_grpo(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    };
    let whole = dir.path().join("whole");
    run(&whole, 4, &[]);
    let m = metrics(&whole);
    let coef = metric_series(&m, "actor/reward_kl_penalty_coeff");
    let seen = metric_series(&m, "actor/reward_kl_penalty");
    assert_eq!(coef[0], 0.01);
    // VeRL's controller after each step: 16 sequences over a horizon of 16.
    for k in 0..3 {
        let e = (seen[k] / 1.0e-5 - 1.0).clamp(-0.2, 0.2);
        let want = coef[k] * (1.0 + e * 16.0 / 16.0);
        assert!(
            (coef[k + 1] - want).abs() <= 1e-12 * want,
            "step {}: {} vs {want}",
            k + 2,
            coef[k + 1]
        );
    }
    assert!(coef.windows(2).all(|w| w[0] != w[1]), "{coef:?}");
    // Stopped after step 2 (a checkpoint) and run again to step 4: the same coefficients.
    let resumed = dir.path().join("resumed");
    run(&resumed, 2, &[]);
    run(&resumed, 4, &[]);
    let r = metrics(&resumed);
    assert_eq!(metric_series(&r, "actor/reward_kl_penalty_coeff"), coef);
    assert_same_training(&whole, &resumed, "stopped at step 2 and resumed");
    // The same with the learner in a worker process: the coefficient crosses gRPC both ways
    // (its updates, the checkpoint's state stream, the resumed worker's start).
    let worker = dir.path().join("worker");
    let in_worker = ["--set", "cluster.learner_workers=1"];
    run(&worker, 2, &in_worker);
    run(&worker, 4, &in_worker);
    let w = metrics(&worker);
    assert_eq!(metric_series(&w, "actor/reward_kl_penalty_coeff"), coef);
    assert_same_training(&whole, &worker, "a learner worker, stopped and resumed");
}

/// VeRL #7401: a run resumed from a checkpoint taken exactly at an epoch's end ran no steps and
/// exited 0. Here it runs the next epoch, over the same prompts in the next epoch's order.
#[test]
fn a_resume_from_an_epoch_boundary_runs_the_next_epoch() {
    let dir = tempfile::tempdir().unwrap();
    let (model, train, val) = tiny_inputs(dir.path(), 8, 4);
    let out = dir.path().join("out");
    let r = tiny_recipe(dir.path(), "epochs.yaml", &model, &train, &val, &out, 4, "");
    let run = |epochs: &str| {
        let o = run_grpo(&[
            "run",
            r.to_str().unwrap(),
            "--quiet",
            "--set",
            "trainer.total_training_steps=",
            "--set",
            epochs,
        ]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stderr).to_string()
    };
    // 8 prompts, 4 a step: an epoch is 2 steps, and step 2's checkpoint is its end.
    run("trainer.total_epochs=1");
    assert!(out.join("checkpoints/step_2").is_dir());
    let stderr = run("trainer.total_epochs=2");
    assert!(stderr.contains("trained to step 4"), "{stderr}");
    let seen = prompts_seen(&out);
    assert_eq!(seen.keys().copied().collect::<Vec<_>>(), [1, 2, 3, 4]);
    let epoch = |steps: [u64; 2]| {
        let mut rows: Vec<u64> = steps.iter().flat_map(|s| seen[s].clone()).collect();
        rows.sort();
        rows
    };
    assert_eq!(
        epoch([1, 2]),
        (0..8).collect::<Vec<u64>>(),
        "epoch 1 saw every prompt once"
    );
    assert_eq!(
        epoch([3, 4]),
        (0..8).collect::<Vec<u64>>(),
        "epoch 2 saw every prompt once"
    );
    let m = metrics(&out);
    assert_eq!(m[&3]["training/epoch"], 1.0, "{}", m[&3]);
}

/// Every advantage estimator and policy loss beyond GRPO's own trains a tiny run end to end
/// (paired, to keep the runs few): the recipe keys reach the learner, which reports the
/// estimator's advantages and finite losses. Their numbers are checked against VeRL's in
/// trainer/tests/verl_algorithms.rs.
#[test]
fn every_estimator_and_loss_trains_a_tiny_run() {
    let dir = tempfile::tempdir().unwrap();
    let (model, train, val) = tiny_inputs(dir.path(), 64, 4);
    let pairs = [
        ("reinforce_plus_plus", "sapo", "algorithm.gamma=0.9"),
        (
            "reinforce_plus_plus_baseline",
            "gpg",
            "actor.loss_agg_mode=seq-mean-token-sum",
        ),
        ("opo", "clip_cov", "actor.policy_loss.clip_cov_ratio=0.2"),
        ("gpg", "kl_cov", "actor.policy_loss.kl_cov_ratio=0.2"),
        ("grpo_passk", "geo_mean", "actor.clip_ratio_high=0.28"),
        ("rloo", "cispo", "actor.clip_ratio_high=0.28"),
        // ReMax's greedy baseline responses are generated and scored but not trained on.
        ("remax", "vanilla", "actor.loss_agg_mode=token-mean"),
    ];
    for (estimator, loss, extra) in pairs {
        let out = dir.path().join(format!("{estimator}-{loss}"));
        let r = tiny_recipe(dir.path(), "algo.yaml", &model, &train, &val, &out, 2, "");
        let est = format!("algorithm.adv_estimator={estimator}");
        let mode = format!("actor.policy_loss.loss_mode={loss}");
        let o = run_grpo(&[
            "run",
            r.to_str().unwrap(),
            "--quiet",
            "--set",
            &est,
            "--set",
            &mode,
            "--set",
            extra,
            "--set",
            "trainer.test_freq=-1",
            "--set",
            "trainer.val_before_train=false",
        ]);
        assert!(
            o.status.success(),
            "{estimator} + {loss}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let m = metrics(&out);
        for key in [
            "actor/pg_loss",
            "actor/grad_norm",
            "critic/advantages/mean",
            "critic/returns/max",
        ] {
            let v = metric_series(&m, key);
            assert_eq!(v.len(), 2, "{estimator} + {loss}: {key} at every step: {v:?}");
            assert!(
                v.iter().all(|x| x.is_finite()),
                "{estimator} + {loss}: {key} = {v:?}"
            );
        }
        assert_eq!(
            metric_series(&m, "batch/samples"),
            vec![16.0; 2],
            "{estimator} + {loss}: 4 prompts x rollout.n = 4"
        );
    }
}

/// DAPO's dynamic sampling (VeRL's DAPO trainer): with many groups whose rewards all agree, a
/// step keeps generating rounds until `data.train_batch_size` prompts with signal are in it,
/// and trains on exactly that many; when `max_num_gen_batches` rounds are used up first, the
/// run stops, as VeRL's does, with what to change.
#[test]
fn dynamic_sampling_refills_the_step_and_stops_at_its_limit() {
    let dir = tempfile::tempdir().unwrap();
    let (model, train, val) = tiny_inputs(dir.path(), 64, 4);
    let out = dir.path().join("dapo");
    let r = tiny_recipe(dir.path(), "dapo.yaml", &model, &train, &val, &out, 3, "");
    let args = |out: &Path, pattern: &str, limit: &str| {
        vec![
            "run".to_string(),
            r.to_str().unwrap().into(),
            "--quiet".into(),
            "--set".into(),
            format!("trainer.output_dir={}", out.display()),
            "--set".into(),
            format!("reward.scorers.starts_with_a_word.pattern={pattern}"),
            "--set".into(),
            "algorithm.filter_groups={enable: true, metric: seq_reward}".into(),
            "--set".into(),
            format!("algorithm.filter_groups.max_num_gen_batches={limit}"),
            "--set".into(),
            "data.gen_batch_size=2".into(),
            "--set".into(),
            "trainer.test_freq=-1".into(),
            "--set".into(),
            "trainer.val_before_train=false".into(),
        ]
    };
    let run = |a: Vec<String>| run_grpo(&a.iter().map(String::as_str).collect::<Vec<_>>());
    let o = run(args(&out, "^[a-z]", "0"));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let m = metrics(&out);
    let rounds = metric_series(&m, "train/num_gen_batches");
    let generated = metric_series(&m, "batch/generated_prompts");
    let with_signal = metric_series(&m, "batch/prompts_with_signal");
    eprintln!("rounds {rounds:?} generated {generated:?} with signal {with_signal:?}");
    // Every step trains on train_batch_size (4) prompts x rollout.n (4) samples, each of a group
    // whose rewards differ, though rounds of gen_batch_size (2) prompts had fewer.
    assert_eq!(metric_series(&m, "batch/samples"), vec![16.0; 3]);
    assert!(rounds.iter().all(|r| *r >= 2.0), "{rounds:?}");
    assert!(
        generated.iter().zip(&with_signal).any(|(g, s)| s < g),
        "no group without signal: pick another pattern ({generated:?}, {with_signal:?})"
    );
    assert!(with_signal.iter().all(|s| *s >= 4.0));
    for (step, g) in &m {
        if *step > 0 {
            assert!(g["critic/advantages/nonzero_frac"] == 1.0, "step {step}: {g}");
        }
    }
    let log = std::fs::read_to_string(out.join("prompts.jsonl")).unwrap();
    for line in log.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        assert_eq!(v["indices"].as_array().unwrap().len(), 4, "{line}");
        assert!(v["generated"].as_array().unwrap().len() >= 4, "{line}");
    }

    // A reward that never varies: the limit is reached and the run stops with VeRL's advice.
    let stuck = dir.path().join("stuck");
    let o = run(args(&stuck, "^NEVER$", "3"));
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("after 3 rounds of generation (algorithm.filter_groups.max_num_gen_batches = 3) only 0 of data.train_batch_size = 4 prompts"),
        "{err}"
    );
}

/// A resume compares the recipe with the one the checkpoint holds: a change to what the run
/// trains is refused with each key's old and new value (unless allowed, then a warning), while
/// run-control and layout keys may change.
#[test]
fn a_resume_with_a_changed_recipe_follows_the_stated_rule() {
    let dir = tempfile::tempdir().unwrap();
    let (model, train, val) = tiny_inputs(dir.path(), 64, 4);
    let out = dir.path().join("out");
    let r = tiny_recipe(dir.path(), "r.yaml", &model, &train, &val, &out, 2, "");
    let run = |extra: &[&str]| {
        let mut args = vec!["run", r.to_str().unwrap(), "--quiet"];
        args.extend_from_slice(extra);
        run_grpo(&args)
    };
    let o = run(&[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));

    // What the run trains changed: refused, nothing written.
    let o = run(&[
        "--set",
        "trainer.total_training_steps=3",
        "--set",
        "actor.optim.lr=2.0e-3",
        "--set",
        "rollout.temperature=0.7",
    ]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("the recipe differs from the one the checkpoint was saved under, in keys that change what the run trains:\n  actor.optim.lr: 0.001 -> 0.002\n  rollout.temperature: 1.0 -> 0.7"),
        "{err}"
    );
    assert!(
        !err.contains("total_training_steps: 2 -> 3"),
        "run-control keys are not refused: {err}"
    );
    assert_eq!(metrics(&out).keys().copied().collect::<Vec<_>>(), vec![0, 1, 2]);

    // Run-control and layout keys may change: the run goes on to step 3.
    let o = run(&[
        "--set",
        "trainer.total_training_steps=3",
        "--set",
        "actor.ppo_micro_batch_size=2",
        "--set",
        "trainer.test_freq=-1",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(
        metrics(&out).keys().copied().collect::<Vec<_>>(),
        vec![0, 1, 2, 3]
    );

    // Allowed: continues with the new learning rate, and says so.
    let o = run(&[
        "--set",
        "trainer.total_training_steps=4",
        "--set",
        "actor.optim.lr=2.0e-3",
        "--set",
        "trainer.allow_recipe_change_on_resume=true",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("actor.optim.lr: 0.001 -> 0.002"), "{err}");
    let lr = metrics(&out)[&4]["actor/lr"].as_f64().unwrap();
    assert!((lr - 2.0e-3).abs() < 1e-9, "{lr}");
}
