//! `grpo run` with `rollout.multi_turn`. On the tiny random model: every request is an episode
//! answered by the tool environment (in the orchestrator, and in a rollout worker process,
//! which builds its own from the recipe), the per-turn budget ends long turns, the episodes'
//! metrics are reported, the learner trains on the sampled ids where decoding and encoding
//! them again would give others, and the run with its rollout in a worker trains exactly as in process
//! (a random model writes no tool calls, so its episodes end after the first turn); tools from
//! a tool config file (the Python executor, a user command) are set up in both places. On
//! SmolLM2-135M-Instruct with the calculator, whose episodes call it: a rollout worker killed
//! with -9 in the middle of a step's episodes, whose episodes are redone elsewhere and counted
//! once, and the learner's log-probs of the model's tokens equal to the rollout's.

mod common;

use common::*;

#[test]
fn episodes_run_in_process_and_in_a_rollout_worker_with_their_budgets_and_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let (model, train, val) = tiny_inputs(dir.path(), 64, 4);
    let multi_turn = [
        "--set",
        "rollout.multi_turn.enable=true",
        "--set",
        "rollout.multi_turn.tools=[calculator]",
        "--set",
        "rollout.multi_turn.max_turn_tokens=5",
    ];
    let run = |name: &str, cluster: &str, extra: &[&str]| {
        let out = dir.path().join(name);
        let r = tiny_recipe(
            dir.path(),
            &format!("{name}.yaml"),
            &model,
            &train,
            &val,
            &out,
            2,
            cluster,
        );
        let mut args = vec!["run", r.to_str().unwrap(), "--quiet"];
        args.extend_from_slice(extra);
        let o = run_grpo(&args);
        assert!(
            o.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        out
    };
    let single = run("single", "", &[]);
    let dump = dir.path().join("rollouts");
    let dump_key = format!("trainer.rollout_data_dir={}", dump.display());
    let mut with_dump = multi_turn.to_vec();
    with_dump.extend(["--set", &dump_key]);
    let local = run("local", "", &with_dump);
    trains_on_the_sampled_ids(&model.join("tokenizer.json"), &dump, &metrics(&local));
    let remote = run("remote", "cluster:\n  rollout_workers: 1\n", &multi_turn);
    assert_same_training(&local, &remote, "episodes in process vs in a rollout worker");

    let (s, m) = (metrics(&single), metrics(&local));
    assert!(
        s[&1].get("multi_turn/turns/mean").is_none(),
        "single-turn runs report no episodes"
    );
    for key in [
        "multi_turn/turns/mean",
        "multi_turn/tool_calls/mean",
        "multi_turn/tool_errors",
        "multi_turn/tool_timeouts",
        "multi_turn/model_tokens/mean",
        "multi_turn/env_tokens/mean",
        "timing_s/tools",
    ] {
        assert!(
            m[&2].get(key).is_some_and(|v| v.is_number()),
            "step 2 lacks {key}: {}",
            m[&2]
        );
    }
    assert_eq!(m[&2]["multi_turn/turns/mean"], 1.0);
    // A turn is cut at 5 tokens: a truncated sample, where the single-turn run goes to 12.
    assert_eq!(m[&2]["response_length/max"], 5.0);
    assert!(s[&2]["response_length/max"].as_f64().unwrap() > 5.0);
    assert!(m[&2]["response_length/clip_ratio"].as_f64().unwrap() > 0.0);
}

/// Re-tokenisation safety: the ids each step trained on (`trainer.rollout_data_dir`) include
/// model turns that decoding and encoding again would change (a random model's tokens often
/// merge or split differently), and the learner's log-probs of the response equal the
/// rollout's: it scored the ids that were sampled, not a re-encoding of their text.
fn trains_on_the_sampled_ids(
    tokenizer: &std::path::Path,
    dump: &std::path::Path,
    m: &std::collections::BTreeMap<u64, serde_json::Value>,
) {
    let tokenizer = model::ModelTokenizer::from_file(tokenizer).unwrap();
    let mut changed = 0;
    for step in [1, 2] {
        let text = std::fs::read_to_string(dump.join(format!("{step}.jsonl"))).unwrap();
        let lines: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(lines.len(), 16, "step {step}: 4 prompts x 4 samples");
        for line in &lines {
            assert_eq!(line["step"], step);
            let ids: Vec<u32> = serde_json::from_value(line["response_ids"].clone()).unwrap();
            assert!(!ids.is_empty());
            assert_eq!(line["output"], tokenizer.decode(&ids, true).unwrap());
            assert!(line["gts"].as_str().is_some_and(|g| !g.is_empty()));
            assert!(line["score"].is_number() && line["turns"] == 1);
            let again = tokenizer
                .encode(&tokenizer.decode(&ids, false).unwrap(), false)
                .unwrap();
            changed += usize::from(again != ids);
        }
    }
    assert!(
        changed > 0,
        "no sampled turn re-encodes differently, so this tests nothing"
    );
    let gap = metric_series(m, "rollout/log_prob_diff_mean");
    assert!(
        gap.iter().all(|&g| g < 1e-5),
        "rollout vs learner log-probs: {gap:?}"
    );
}

/// A tool config file (VeRL's `tool_config_path`) with the sandboxed Python executor under
/// VeRL's name for it and a user tool in a child process: the run sets them up in process and
/// in a rollout worker (which reads the file itself), and a file with a VeRL Python class or an
/// interpreter that does not exist is refused before any work, naming the file and the entry.
#[test]
fn tools_from_a_tool_config_file_run_in_process_and_in_a_rollout_worker() {
    let dir = tempfile::tempdir().unwrap();
    let (model, train, val) = tiny_inputs(dir.path(), 64, 4);
    let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/agent/tests/fixtures/tools.py");
    let schema = |name: &str, argument: &str| {
        format!(
            "{{type: function, function: {{name: {name}, description: A tool., parameters: {{type: object, \
             properties: {{{argument}: {{type: string}}}}, required: [{argument}]}}}}}}"
        )
    };
    let tools = dir.path().join("tools.yaml");
    std::fs::write(
        &tools,
        format!(
            "tools:\n  - class_name: python\n    config: {{memory_limit_mb: 256, default_timeout: 5}}\n    tool_schema: {}\n  \
             - class_name: command\n    config: {{command: [python3, {fixture}], timeout: 2}}\n    tool_schema: {}\n",
            schema("code_interpreter", "code"),
            schema("echo", "text")
        ),
    )
    .unwrap();
    let run = |name: &str, cluster: &str, tool_file: &std::path::Path| {
        let out = dir.path().join(name);
        let r = tiny_recipe(
            dir.path(),
            &format!("{name}.yaml"),
            &model,
            &train,
            &val,
            &out,
            1,
            cluster,
        );
        run_grpo(&[
            "run",
            r.to_str().unwrap(),
            "--quiet",
            "--set",
            "rollout.multi_turn.enable=true",
            "--set",
            &format!("rollout.multi_turn.tool_config_path={}", tool_file.display()),
        ])
    };
    for (name, cluster) in [("local", ""), ("remote", "cluster:\n  rollout_workers: 1\n")] {
        let o = run(name, cluster, &tools);
        assert!(
            o.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(metrics(&dir.path().join(name))[&1]
            .get("multi_turn/turns/mean")
            .is_some());
    }

    let verl_class = dir.path().join("tools-verl.yaml");
    std::fs::write(
        &verl_class,
        "tools:\n  - class_name: verl.tools.gsm8k_tool.Gsm8kTool\n",
    )
    .unwrap();
    let o = run("verl", "", &verl_class);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        stderr.contains("rollout.multi_turn.tool_config_path")
            && stderr.contains("tools[0] (verl.tools.gsm8k_tool.Gsm8kTool)")
            && stderr.contains("class_name: command"),
        "{stderr}"
    );
    let no_python = dir.path().join("tools-no-python.yaml");
    std::fs::write(
        &no_python,
        "tools:\n  - class_name: python\n    config: {interpreter: /no/such/python3}\n",
    )
    .unwrap();
    let o = run("no-python", "", &no_python);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(stderr.contains("\"/no/such/python3\" is not usable"), "{stderr}");
}

/// An interaction (a grader program, VeRL's `interaction_config_path`) in a rollout worker
/// answers SmolLM2's turns that call no tool; its rewards reach the `turn_scores` scorer.
#[test]
fn smollm2_episodes_get_an_interactions_replies_and_rewards_in_a_rollout_worker() {
    let dir = tempfile::tempdir().unwrap();
    // Asked for the number alone, SmolLM2 ends most turns within the per-turn budget.
    let train = arithmetic_with(dir.path(), "train", 1, 16, &["--answer-format", "number"]);
    let interactions = dir.path().join("interactions.yaml");
    let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/agent/tests/fixtures/interaction.py");
    std::fs::write(
        &interactions,
        format!("interaction:\n  - name: grader\n    class_name: command\n    config: {{command: [python3, {fixture}]}}\n"),
    )
    .unwrap();
    let out = dir.path().join("out");
    let recipe = dir.path().join("r.yaml");
    std::fs::write(
        &recipe,
        format!(
            "model:\n  path: {model}\n\
             data:\n  train_files: {train}\n  train_batch_size: 2\n  max_prompt_length: 256\n  max_response_length: 96\n\
             rollout:\n  n: 2\n  max_num_seqs: 4\n  multi_turn:\n    enable: true\n    interaction_config_path: {interactions}\n    \
             max_user_turns: 1\n    max_turn_tokens: 40\n\
             reward:\n  scorers:\n    graded: {{kind: turn_scores}}\n  data_sources:\n    grpo/arithmetic: graded\n\
             actor:\n  optim:\n    lr: 1.0e-5\n  ppo_mini_batch_size: 2\n  ppo_micro_batch_size: 4\n\
             trainer:\n  total_training_steps: 1\n  save_freq: 10\n  output_dir: {out}\n  seed: 1\n\
             cluster:\n  rollout_workers: 1\n",
            model = testkit::smollm2_gguf().display(),
            train = train.display(),
            interactions = interactions.display(),
            out = out.display(),
        ),
    )
    .unwrap();
    let o = run_grpo(&["run", recipe.to_str().unwrap(), "--quiet"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let m = metrics(&out);
    let replies = metric_series(&m, "multi_turn/user_turns/mean");
    assert!(
        replies.iter().any(|&r| r > 0.0),
        "no turn reached the interaction: {replies:?}"
    );
    assert!(metric_series(&m, "multi_turn/user_turns/max")
        .iter()
        .all(|&r| r <= 1.0));
    // Each reply carried a reward (0: the rows have no ground truth for the grader), and the
    // scorer saw each of them.
    assert_eq!(metric_series(&m, "reward/extra/turns_scored"), replies);
    assert!(metric_series(&m, "critic/score/mean").iter().all(|&s| s == 0.0));
    assert!(metric_series(&m, "multi_turn/tool_errors")
        .iter()
        .all(|&e| e == 0.0));
}

/// An agent program written for any OpenAI-compatible server (`tests/fixtures/episode_agent.py`,
/// standard library only) drives SmolLM2's episodes in a rollout worker through the endpoint
/// `rollout.multi_turn.agent` starts: each sample the learner trains is exactly the ids the
/// program was served over its calls (chat calls, and text completions with ids), the learner's
/// log-probs of the model's tokens equal the rollout's, the program's printed reward reaches the
/// `turn_scores` scorer, and a program that rewrites its conversation or crashes is counted as
/// an error while the run goes on.
#[test]
fn agent_programs_train_through_the_openai_endpoint_in_a_rollout_worker() {
    let dir = tempfile::tempdir().unwrap();
    let train = arithmetic_with(dir.path(), "train", 1, 16, &["--answer-format", "number"]);
    let logs = dir.path().join("episodes");
    std::fs::create_dir(&logs).unwrap();
    let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/episode_agent.py");
    let (out, dump) = (dir.path().join("out"), dir.path().join("dump"));
    let recipe = dir.path().join("r.yaml");
    std::fs::write(
        &recipe,
        format!(
            "model:\n  path: {model}\n\
             data:\n  train_files: {train}\n  train_batch_size: 2\n  max_prompt_length: 256\n  max_response_length: 96\n\
             rollout:\n  n: 2\n  max_num_seqs: 4\n  multi_turn:\n    enable: true\n    max_turn_tokens: 24\n    \
             agent:\n      command: [python3, {fixture}, {logs}, \"chat,completions,rewrite,crash\", \"2\"]\n      timeout_s: 120\n\
             reward:\n  scorers:\n    program: {{kind: turn_scores}}\n  data_sources:\n    grpo/arithmetic: program\n\
             actor:\n  optim:\n    lr: 1.0e-5\n  ppo_mini_batch_size: 2\n  ppo_micro_batch_size: 4\n\
             trainer:\n  total_training_steps: 2\n  save_freq: 10\n  output_dir: {out}\n  seed: 1\n  rollout_data_dir: {dump}\n\
             cluster:\n  rollout_workers: 1\n",
            model = testkit::smollm2_gguf().display(),
            train = train.display(),
            logs = logs.display(),
            out = out.display(),
            dump = dump.display(),
        ),
    )
    .unwrap();
    let o = run_grpo(&["run", recipe.to_str().unwrap(), "--quiet"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let m = metrics(&out);

    // What each episode's program was served, as ids from its prompt on.
    let mut served = Vec::new();
    let mut modes = std::collections::BTreeMap::<String, usize>::new();
    for entry in std::fs::read_dir(&logs).unwrap() {
        let log: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(entry.unwrap().path()).unwrap()).unwrap();
        let mode = log["mode"].as_str().unwrap().to_string();
        *modes.entry(mode.clone()).or_default() += 1;
        let calls = log["calls"].as_array().unwrap();
        let ok: Vec<&serde_json::Value> = calls.iter().filter(|c| c["status"] == 200).collect();
        let ids = |c: &serde_json::Value, key: &str| -> Vec<u32> {
            serde_json::from_value(c[key].clone()).unwrap()
        };
        let prompt = ids(ok[0], "prompt_token_ids");
        let last = ok.last().unwrap();
        let mut all = ids(last, "prompt_token_ids");
        all.extend(ids(last, "token_ids"));
        assert_eq!(
            all[..prompt.len()],
            prompt[..],
            "{mode}: every call extends the first"
        );
        served.push((mode.clone(), all[prompt.len()..].to_vec()));
        match mode.as_str() {
            "rewrite" => {
                assert_eq!(calls.len(), 2, "{log}");
                assert_eq!(calls[1]["status"], 400, "{log}");
                assert!(
                    calls[1]["error"].as_str().unwrap().contains("message 0 is not"),
                    "{log}"
                );
            }
            "crash" => assert_eq!(calls.len(), 1, "{log}"),
            _ => assert!(ok.len() >= 2, "{log}"),
        }
    }
    assert_eq!(modes.len(), 4, "every mode ran: {modes:?}");
    let mut trained = 0;
    for step in [1, 2] {
        for line in std::fs::read_to_string(dump.join(format!("{step}.jsonl")))
            .unwrap()
            .lines()
        {
            let line: serde_json::Value = serde_json::from_str(line).unwrap();
            let response: Vec<u32> = serde_json::from_value(line["response_ids"].clone()).unwrap();
            assert!(
                served.iter().any(|(_, ids)| *ids == response),
                "step {step}: a trained sample no program was served: {line}"
            );
            trained += 1;
        }
    }
    assert_eq!(trained, 8, "2 steps x 2 prompts x 2 samples");
    assert!(metric_series(&m, "multi_turn/turns/max")
        .iter()
        .any(|&t| t >= 2.0));
    assert!(metric_series(&m, "multi_turn/env_tokens/mean")
        .iter()
        .any(|&t| t > 0.0));
    // The rewrite and the crash of each step.
    assert!(metric_series(&m, "multi_turn/tool_errors")
        .iter()
        .all(|&e| e >= 2.0));
    assert!(metric_series(&m, "critic/score/mean").iter().all(|&s| s > 0.0));
    let gap = metric_series(&m, "rollout/log_prob_diff_mean");
    assert!(
        gap.iter().all(|&g| g < 1e-5),
        "rollout vs learner log-probs: {gap:?}"
    );
}

#[test]
fn multi_turn_without_a_tool_is_refused_before_any_work() {
    let dir = tempfile::tempdir().unwrap();
    let o = run_grpo(&[
        "run",
        "recipes/quickstart.yaml",
        "--set",
        "rollout.multi_turn.enable=true",
        "--set",
        &format!("trainer.output_dir={}", dir.path().display()),
    ]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        stderr.contains("rollout.multi_turn.tools") && stderr.contains("tools: [calculator]"),
        "{stderr}"
    );
}

#[test]
fn smollm2_episodes_call_the_calculator_and_survive_a_rollout_worker_killed_mid_step() {
    let dir = tempfile::tempdir().unwrap();
    let calculator = [
        "--max-value",
        "9999",
        "--ops",
        "*",
        "--answer-format",
        "calculator",
    ];
    let train = arithmetic_with(dir.path(), "train", 1, 64, &calculator);
    let recipe = |name: &str, cluster: &str| {
        let out = dir.path().join(name);
        let text = format!(
            "model:\n  path: {model}\n\
             data:\n  train_files: {train}\n  train_batch_size: 2\n  max_prompt_length: 320\n  max_response_length: 80\n\
             rollout:\n  n: 4\n  max_num_seqs: 8\n  multi_turn:\n    enable: true\n    tools: [calculator]\n    max_assistant_turns: 3\n    max_turn_tokens: 40\n\
             reward:\n  scorers:\n    answer: {{kind: arithmetic}}\n  data_sources:\n    grpo/arithmetic: answer\n\
             actor:\n  optim:\n    lr: 1.0e-5\n  ppo_mini_batch_size: 2\n  ppo_micro_batch_size: 8\n\
             trainer:\n  total_training_steps: 3\n  save_freq: 10\n  output_dir: {out}\n  seed: 1\n{cluster}",
            model = testkit::smollm2_gguf().display(),
            train = train.display(),
            out = out.display(),
        );
        let path = dir.path().join(format!("{name}.yaml"));
        std::fs::write(&path, text).unwrap();
        (out, path)
    };
    let (local, r_local) = recipe("local", "");
    let o = run_grpo(&["run", r_local.to_str().unwrap(), "--quiet"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));

    let (killed, r_killed) = recipe(
        "killed",
        "cluster:\n  rollout_workers: 2\n  worker_timeout_s: 5\n",
    );
    let mut child = grpo()
        .arg("run")
        .arg(&r_killed)
        .arg("--quiet")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    wait_for_step(&killed, 1, &mut child, std::time::Duration::from_secs(600));
    // Step 2's episodes are being generated (and their tools run) right now.
    let rollout = run_worker_pids(&killed, "rollout");
    assert_eq!(rollout.len(), 2, "rollout workers: {rollout:?}");
    assert!(send_signal(rollout[0], "KILL"));
    let o = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");

    let (a, b) = (metrics(&local), metrics(&killed));
    assert_eq!(prompts_seen(&local), prompts_seen(&killed));
    for m in [&a, &b] {
        // Every step trained on each of its prompts' samples exactly once, and they are episodes
        // with tool calls whose model tokens the learner scores as the rollout did.
        assert_eq!(metric_series(m, "batch/samples"), vec![8.0; 3], "{stderr}");
        assert!(metric_series(m, "multi_turn/tool_calls/mean")
            .iter()
            .all(|&c| c > 0.0));
        assert!(metric_series(m, "multi_turn/env_tokens/mean")
            .iter()
            .all(|&c| c > 0.0));
        let gap = metric_series(m, "rollout/log_prob_diff_mean");
        assert!(
            gap.iter().all(|&g| g < 1e-5),
            "rollout vs learner log-probs: {gap:?}"
        );
    }
    assert!(
        metric_series(&b, "workers/failures_total")
            .last()
            .copied()
            .unwrap_or(0.0)
            >= 1.0,
        "{stderr}"
    );
    assert!(
        run_worker_pids(&killed, "rollout").is_empty(),
        "no worker outlives the run"
    );
}
