//! `grpo verl`: three of VeRL's own GRPO example scripts (tests/fixtures/verl/, changed only in
//! the command's name and the model and data paths) run and train, with sizes cut for this
//! machine by overrides appended at the end; bad command lines fail with messages that teach.

mod common;

use common::*;
use std::path::Path;
use testkit::trackers::python;

/// Overrides appended to every script (its trailing `$@`): one CPU device, the tiny model's
/// sizes, two steps into `output`.
fn cut_sizes(output: &Path) -> Vec<String> {
    [
        "trainer.device=cpu",
        "trainer.n_gpus_per_node=1",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "data.train_batch_size=4",
        "data.max_prompt_length=96",
        "data.max_response_length=12",
        "data.val_max_samples=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "trainer.total_training_steps=2",
        "trainer.test_freq=2",
        "trainer.save_freq=2",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([format!("trainer.default_local_dir={}", output.display())])
    .collect()
}

/// `bash tests/fixtures/verl/SCRIPT` with the size cuts into `output` appended, in `dir`, with
/// the model and data paths the scripts read.
fn script(script: &str, dir: &Path, model: &Path, output: &Path) -> std::process::Command {
    let mut c = std::process::Command::new("bash");
    c.arg(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/verl")
            .join(script),
    )
    .args(cut_sizes(output))
    .current_dir(dir)
    .env("GRPO", env!("CARGO_BIN_EXE_grpo"))
    .env("GRPO_VERL_DATA", dir.join("data"))
    .env("GRPO_VERL_MODEL", model);
    c
}

fn run_script(name: &str, dir: &Path, model: &Path, output: &Path) -> String {
    let out = script(name, dir, model, output)
        .env("GRPO_PYTHON", python())
        .env("WANDB_MODE", "offline")
        .env("HOME", dir)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "{name}:\n{stderr}");
    stderr
}

/// What the scripts read in `dir`: the tiny chat model (returned) and `data/{train,test}.parquet`.
fn script_inputs(dir: &Path) -> std::path::PathBuf {
    let data = dir.join("data");
    std::fs::create_dir_all(&data).unwrap();
    arithmetic(&data, "train", 1, 32);
    arithmetic(&data, "test", 2, 8);
    tiny_chat_model(dir)
}

/// `output`'s metrics after a two-step run: both steps there, each with a finite score, policy
/// loss (and KL loss, for the scripts that use it), response length and generation time, and a
/// gradient.
fn trained_two_steps(
    output: &Path,
    script: &str,
    kl_loss: bool,
) -> std::collections::BTreeMap<u64, serde_json::Value> {
    let m = metrics(output);
    assert_eq!(
        m.keys().copied().filter(|s| *s > 0).collect::<Vec<_>>(),
        [1, 2],
        "{script}"
    );
    for step in [1, 2] {
        let s = &m[&step];
        let keys = [
            "critic/score/mean",
            "actor/pg_loss",
            "response_length/mean",
            "timing_s/gen",
        ];
        for key in keys.iter().chain(kl_loss.then_some(&"actor/kl_loss")) {
            assert!(
                s[key].as_f64().is_some_and(f64::is_finite),
                "{script} step {step}: {key} in {s}"
            );
        }
        assert!(s["actor/grad_norm"].as_f64().unwrap() > 0.0, "{script}: {s}");
    }
    m
}

#[test]
fn verls_own_grpo_scripts_run_and_train() {
    let dir = tempfile::tempdir().unwrap();
    let model = script_inputs(dir.path());
    for script in [
        "run_qwen2-7b.sh",
        "run_deepseek7b_llm.sh",
        "run_qwen2-7b_seq_balance.sh",
    ] {
        let output = dir.path().join(script.trim_end_matches(".sh"));
        let stderr = run_script(script, dir.path(), &model, &output);
        // Their keys that change nothing here are named once each.
        for note in [
            "note: actor_rollout_ref.rollout.name=",
            "note: actor_rollout_ref.rollout.gpu_memory_utilization=0.6 has no effect in grpo: it sizes vLLM's KV cache",
            "note: actor_rollout_ref.ref.fsdp_config.param_offload=true has no effect in grpo",
        ] {
            assert_eq!(stderr.matches(note).count(), 1, "{script}: {note}\n{stderr}");
        }
        let m = trained_two_steps(&output, script, true);
        // Validation ran at step 2 (VeRL's core metric of the data source), and before
        // training unless the script says otherwise (seq_balance sets val_before_train=False).
        assert!(
            m[&2].get("val-core/grpo/arithmetic/acc/mean@1").is_some() || m[&2].get(VAL_CORE).is_some(),
            "{script}: {}",
            m[&2]
        );
        assert_eq!(
            m.contains_key(&0),
            script != "run_qwen2-7b_seq_balance.sh",
            "{script}: {:?}",
            m.get(&0)
        );
        assert!(output.join("checkpoints/step_2").is_dir(), "{script}");
        // The logger list the script gave: wandb (offline here) or console only.
        assert_eq!(
            output.join("wandb").is_dir(),
            script != "run_deepseek7b_llm.sh",
            "{script}"
        );
    }
    // The same command line with --print-recipe gives a recipe `grpo run` takes.
    let seq = dir.path().join("seq_balance_recipe");
    let out = script("run_qwen2-7b_seq_balance.sh", dir.path(), &model, &seq)
        .arg("--print-recipe")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let recipe = dir.path().join("seq.yaml");
    std::fs::write(&recipe, &out.stdout).unwrap();
    let printed = run_grpo(&["run", recipe.to_str().unwrap(), "--print-config"]);
    assert!(
        printed.status.success(),
        "{}",
        String::from_utf8_lossy(&printed.stderr)
    );
    let text = String::from_utf8_lossy(&printed.stdout);
    // use_dynamic_bsz with 24000 tokens per GPU: every sequence of a device's share of the
    // mini-batch (2 prompts x 5) in one pass.
    assert!(text.contains("ppo_micro_batch_size: 10"), "{text}");
    assert!(text.contains("kl_loss_type: low_var_kl"), "{text}");
}

/// VeRL's own PPO example (`examples/ppo_trainer/run_deepseek7b_llm.sh`): GAE with a critic of
/// the actor's model, the critic's keys carried over (its learning rate, micro-batch and
/// gradient checkpointing); two steps train both and checkpoint the critic beside the policy.
#[test]
fn verls_own_ppo_script_trains_a_critic() {
    let dir = tempfile::tempdir().unwrap();
    let model = script_inputs(dir.path());
    let script_name = "ppo_run_deepseek7b_llm.sh";
    let output = dir.path().join("ppo");
    let stderr = run_script(script_name, dir.path(), &model, &output);
    assert_eq!(
        stderr
            .matches("note: critic.model.use_remove_padding=true has no effect in grpo")
            .count(),
        1,
        "{stderr}"
    );
    let m = metrics(&output);
    assert_eq!(m.keys().copied().filter(|s| *s > 0).collect::<Vec<_>>(), [1, 2]);
    for step in [1, 2] {
        let s = &m[&step];
        for key in [
            "actor/pg_loss",
            "critic/vf_loss",
            "critic/values/mean",
            "critic/vf_explained_var",
            "critic/grad_norm",
        ] {
            assert!(
                s[key].as_f64().is_some_and(f64::is_finite),
                "step {step}: {key} in {s}"
            );
        }
        // The script's critic.optim.lr.
        assert!((s["critic/lr"].as_f64().unwrap() - 1e-5).abs() < 1e-12, "{s}");
    }
    let ck = output.join("checkpoints/step_2");
    assert!(ck.join("critic_params.safetensors").is_file(), "{}", ck.display());
    assert!(ck.join("critic_optimizer.safetensors").is_file());
    // The recipe the command line makes says so.
    let out = script(script_name, dir.path(), &model, &dir.path().join("printed"))
        .arg("--print-recipe")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let recipe: serde_yaml::Value = serde_yaml::from_slice(&out.stdout).unwrap();
    let at = |path: &str| path.split('.').fold(&recipe, |v, k| &v[k]).clone();
    assert_eq!(at("algorithm.adv_estimator"), "gae");
    assert_eq!(at("critic.optim.lr").as_f64(), Some(1e-5));
    assert_eq!(at("critic.model.enable_gradient_checkpointing"), true);
    // 32 per GPU, fitted to each device's share of a mini-batch (2 prompts x 1 response).
    assert_eq!(at("critic.ppo_micro_batch_size").as_u64(), Some(2));
}

#[test]
fn bad_command_lines_say_what_and_how_to_fix_it() {
    let fail = |args: &[&str]| {
        let mut all = vec![
            "verl",
            "algorithm.adv_estimator=grpo",
            "trainer.n_gpus_per_node=1",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        ];
        all.extend_from_slice(args);
        let out = run_grpo(&all);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    let unknown = fail(&["trainer.total_epoch=3"]);
    assert!(
        unknown.contains("error: trainer.total_epoch=3: `trainer.total_epoch` is not a key of VeRL's config")
            && unknown.contains("did you mean `trainer.total_epochs`?"),
        "{unknown}"
    );
    let unsupported = fail(&["actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts=3"]);
    assert!(
        unsupported.contains(
            "actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts=3: not supported: grpo's multi-turn rollouts \
             run the tools of `rollout.multi_turn.tools` and `rollout.multi_turn.tool_config_path`"
        ),
        "{unsupported}"
    );
    // Mapped, then checked as any recipe: episodes need one of grpo's tools.
    let no_tool = fail(&["actor_rollout_ref.rollout.multi_turn.enable=True"]);
    assert!(
        no_tool.contains("`rollout.multi_turn.tools` = []: episodes need at least one tool to call"),
        "{no_tool}"
    );
    let malformed = fail(&["data.train_batch_size"]);
    assert!(
        malformed.contains("error: data.train_batch_size: expected key=value (Hydra's override syntax)"),
        "{malformed}"
    );
    // VeRL's default device is cuda; this machine has no CUDA plugin, and the error names the
    // key that runs the command line here.
    let out = run_grpo(&[
        "verl",
        "algorithm.adv_estimator=grpo",
        "trainer.n_gpus_per_node=1",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
    ]);
    let no_gpu = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        no_gpu.contains("`trainer.device` is VeRL's default, cuda, and this machine has no CUDA plugin")
            && no_gpu.contains("add `trainer.device=cpu` to the command line"),
        "{no_gpu}"
    );
    let keys = run_grpo(&["verl", "--keys"]);
    assert!(keys.status.success());
    let doc =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/verl-keys.md")).unwrap();
    assert_eq!(
        String::from_utf8_lossy(&keys.stdout),
        doc,
        "docs/verl-keys.md is `grpo verl --keys`"
    );
}

/// What `grpo verl` must make of one of VeRL's current `examples/grpo_trainer` scripts.
enum Outcome {
    /// A recipe.
    Recipe,
    /// A refusal naming a capability grpo lacks: text the error must contain.
    Lacks(&'static str),
    /// The script stops before it runs VeRL (it says where the example moved).
    NotReached,
}

const MULTI_HOST: Outcome = Outcome::Lacks(
    "a learner spanning several hosts (one program over every host's devices) is not in grpo yet",
);
// A rollout's experts split over more devices than its tensor-parallel group, over which grpo
// splits them.
const ROLLOUT_EXPERTS: Outcome =
    Outcome::Lacks("grpo's rollout splits the experts over its tensor-parallel devices only");
const VISION: Outcome = Outcome::Lacks("vision, video and audio input is not in grpo");

/// Every script of tests/fixtures/verl/1dda039b/ (VeRL's, unchanged) and what grpo verl makes of
/// it, run as the user ran them (`trainer.device=cpu --print-recipe`, no other cut). No
/// script is refused for a key's spelling or a config file's location.
const TODAYS_SCRIPTS: &[(&str, Outcome)] = &[
    ("run_deepseek_v3_671b_megatron.sh", MULTI_HOST),
    ("run_deepseek_v4_flash_megatron.sh", MULTI_HOST),
    ("run_deepseek_v4_megatron_lite.sh", Outcome::NotReached),
    ("run_deepseek_v4_veomni.sh", MULTI_HOST),
    ("run_glm4_1v_9b_fsdp.sh", VISION),
    // VeRL's own Hydra refuses this script at 1dda039b too: `+...fsdp_config.model_dtype` over
    // its default `fp32` ("Could not append to config. An item is already at ...").
    (
        "run_gpt_oss_20b_fsdp.sh",
        Outcome::Lacks("is already in VeRL's config with a value"),
    ),
    ("run_hy_v3_megatron.sh", MULTI_HOST),
    // Megatron-Lite's actor config comes from another package (`hydra.searchpath`).
    (
        "run_kimi_k2_6_glm5_1_megatron_lite.sh",
        Outcome::Lacks("not one of the configs VeRL ships"),
    ),
    (
        "run_minicpm_o_2_6_fsdp.sh",
        Outcome::Lacks("grpo reads VeRL's Parquet schema"),
    ),
    ("run_mistral_nemo_12b_skyworkrm_fsdp.sh", Outcome::Recipe),
    ("run_moonlight_16b_a3b_megatron.sh", MULTI_HOST),
    ("run_nemotron_nano_v3_30b_a3b_megatron.sh", Outcome::Recipe),
    ("run_qwen2-7b_math_megatron_fsdp.sh", Outcome::Recipe),
    ("run_qwen2_5_32b_fsdp.sh", MULTI_HOST),
    ("run_qwen2_5_vl_7b_fsdp.sh", VISION),
    ("run_qwen2_5_vl_7b_megatron.sh", VISION),
    ("run_qwen3_235b_a22b_megatron.sh", MULTI_HOST),
    ("run_qwen3_30b_a3b_fsdp.sh", Outcome::Recipe),
    ("run_qwen3_30b_a3b_megatron.sh", Outcome::Recipe),
    ("run_qwen3_30b_veomni.sh", ROLLOUT_EXPERTS),
    ("run_qwen3_4b_fsdp.sh", Outcome::Recipe),
    ("run_qwen3_5-122b-a10b_veomni.sh", MULTI_HOST),
    ("run_qwen3_5_122b_a10b_megatron.sh", MULTI_HOST),
    ("run_qwen3_5_27b_fsdp.sh", VISION),
    ("run_qwen3_5_27b_fsdp_turbo.sh", VISION),
    ("run_qwen3_5_2b_openr1_fsdp.sh", VISION),
    ("run_qwen3_5_2b_video_fsdp.sh", VISION),
    ("run_qwen3_5_35b_a3b_veomni.sh", MULTI_HOST),
    ("run_qwen3_5_35b_fsdp.sh", VISION),
    ("run_qwen3_5_35b_fsdp_turbo.sh", VISION),
    ("run_qwen3_5_35b_megatron.sh", Outcome::Recipe),
    (
        "run_qwen3_5_35b_megatron_lite.sh",
        Outcome::Lacks("not one of the configs VeRL ships"),
    ),
    ("run_qwen3_5_397b_megatron.sh", MULTI_HOST),
    ("run_qwen3_8b_fsdp.sh", Outcome::Recipe),
    ("run_qwen3_8b_megatron.sh", Outcome::Recipe),
    ("run_qwen3_next_80b_a3b_fsdp.sh", MULTI_HOST),
    ("run_qwen3_vl_235b_a22b_megatron.sh", MULTI_HOST),
    ("run_qwen3_vl_30b_a3b_fsdp.sh", VISION),
    ("run_qwen3_vl_30b_a3b_megatron.sh", Outcome::Recipe),
    ("run_qwen3_vl_30b_moe_veomni.sh", VISION),
    ("run_qwen3_vl_8b_fsdp.sh", VISION),
    ("run_qwen3_vl_8b_megatron.sh", VISION),
    ("run_seed_oss_36b_fsdp.sh", Outcome::Recipe),
];

/// `bash tests/fixtures/verl/1dda039b/SCRIPT ARGS...` as a user runs it from a VeRL checkout:
/// in `home` (`$HOME`, holding `data/`), `MODEL_PATH` the tiny model, `VERL_USE_UV=0`, the
/// variables some scripts require, and on `PATH` a `python3` / `python` that runs `grpo verl`
/// for `-m verl.trainer.main_ppo` and the real interpreter for anything else (and an `hf` that
/// downloads nothing).
fn todays_script(name: &str, home: &Path, model: &Path, args: &[String]) -> std::process::Command {
    use std::os::unix::fs::PermissionsExt;
    let shim = home.join("shim");
    if !shim.is_dir() {
        std::fs::create_dir_all(&shim).unwrap();
        for exe in ["python3", "python"] {
            let path = shim.join(exe);
            std::fs::write(
                &path,
                "#!/bin/sh\nif [ \"$1\" = -m ] && [ \"$2\" = verl.trainer.main_ppo ]; then\n  \
                 shift 2\n  exec \"$GRPO\" verl \"$@\"\nfi\nexec \"$REAL_PYTHON\" \"$@\"\n",
            )
            .unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        // One script downloads its model with Hugging Face's `hf` first; MODEL_PATH is here.
        let hf = shim.join("hf");
        std::fs::write(&hf, "#!/bin/sh\nexit 0\n").unwrap();
        std::fs::set_permissions(&hf, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let mut c = std::process::Command::new("bash");
    c.arg(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/verl/1dda039b")
            .join(name),
    )
    .args(args)
    .current_dir(home)
    .env("HOME", home)
    .env("MODEL_PATH", model)
    .env("VERL_USE_UV", "0")
    // What some scripts require a user to set (they stop with `unbound variable` otherwise).
    .env("INFER_BACKEND", "vllm")
    .env("DATA_ROOT", home.join("data"))
    .env("RAY_DATA_HOME", home)
    .env("HDFS_ROOT", home)
    .env("GRPO", env!("CARGO_BIN_EXE_grpo"))
    .env("REAL_PYTHON", {
        static PYTHON: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
        PYTHON.get_or_init(python)
    })
    .env(
        "PATH",
        format!("{}:{}", shim.display(), std::env::var("PATH").unwrap_or_default()),
    );
    c
}

/// `$HOME/data/{gsm8k,math}/{train,test}.parquet` (the data VeRL's GRPO scripts read) and the
/// tiny chat model, under `home`.
fn todays_inputs(home: &Path) -> std::path::PathBuf {
    for (set, seed) in [("gsm8k", 1), ("math", 3)] {
        let data = home.join("data").join(set);
        std::fs::create_dir_all(&data).unwrap();
        arithmetic(&data, "train", seed, 32);
        arithmetic(&data, "test", seed + 1, 8);
    }
    tiny_chat_model(home)
}

#[test]
fn every_one_of_verls_current_grpo_scripts_translates_or_names_what_grpo_lacks() {
    let home = tempfile::tempdir().unwrap();
    let model = todays_inputs(home.path());
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/verl/1dda039b");
    let mut scripts: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .filter(|n| n.ends_with(".sh"))
        .collect();
    scripts.sort();
    let listed: Vec<&str> = TODAYS_SCRIPTS.iter().map(|(s, _)| *s).collect();
    assert_eq!(scripts, listed, "every committed script has its expected outcome");
    let args: Vec<String> = ["trainer.device=cpu", "--print-recipe"]
        .map(String::from)
        .to_vec();
    let mut report = String::new();
    for (name, outcome) in TODAYS_SCRIPTS {
        let out = todays_script(name, home.path(), &model, &args).output().unwrap();
        // Some scripts `tee` VeRL's output to a log: grpo's messages may be on either stream.
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stderr),
            String::from_utf8_lossy(&out.stdout)
        );
        // The lines grpo printed (the scripts trace themselves with `set -x`).
        let grpo: Vec<&str> = said
            .lines()
            .filter(|l| l.starts_with("note: ") || l.starts_with("error: ") || l.starts_with("  "))
            .collect();
        report.push_str(&format!("== {name}: {}\n{}\n", out.status, grpo.join("\n")));
        match outcome {
            Outcome::Recipe => {
                assert!(
                    out.status.success(),
                    "{name} should translate:\n{}",
                    grpo.join("\n")
                );
                let recipe: serde_yaml::Value = serde_yaml::from_slice(&out.stdout).unwrap();
                // The script's model (MODEL_PATH, where the script reads it).
                assert!(
                    recipe["model"]["path"].as_str().is_some_and(|p| !p.is_empty()),
                    "{name}"
                );
                assert!(
                    said.contains("note: read as VeRL 0.7.1 and later"),
                    "{name}: {said}"
                );
            }
            Outcome::Lacks(why) => {
                assert!(
                    !out.status.success(),
                    "{name} should be refused:\n{}",
                    grpo.join("\n")
                );
                assert!(
                    said.contains(why),
                    "{name}: expected `{why}` in\n{}",
                    grpo.join("\n")
                );
            }
            Outcome::NotReached => {
                assert!(!out.status.success(), "{name}");
                assert!(!said.contains("note: read as"), "{name} ran grpo verl: {said}");
            }
        }
        for spelling in [
            "is not a key of VeRL's config",
            "not a key grpo verl knows",
            "no such file",
        ] {
            assert!(
                !said.contains(spelling),
                "{name}: {spelling}:\n{}",
                grpo.join("\n")
            );
        }
    }
    // docs/from-verl.md's command: the script's `python3` renamed `grpo verl` by sed, the rest
    // unchanged (`-m verl.trainer.main_ppo` is taken), `grpo` on PATH.
    let bin = home.path().join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_grpo"), bin.join("grpo")).unwrap();
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "sed 's/^LAUNCH=(python3)/LAUNCH=(grpo verl)/' {} | bash -s -- trainer.device=cpu --print-recipe",
            dir.join("run_qwen3_8b_fsdp.sh").display()
        ))
        .current_dir(home.path())
        .env("HOME", home.path())
        .env("MODEL_PATH", &model)
        .env("VERL_USE_UV", "0")
        .env(
            "PATH",
            format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default()),
        )
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let recipe: serde_yaml::Value = serde_yaml::from_slice(&out.stdout).unwrap();
    assert_eq!(recipe["model"]["path"].as_str(), model.to_str());
    if let Ok(path) = std::env::var("GRPO_VERL_REPORT") {
        std::fs::write(path, report).unwrap();
    }
}

/// Two of today's scripts train two steps on the tiny model: one FSDP, one Megatron (its
/// tensor and pipeline sizes cut to this machine's one device).
#[test]
fn todays_fsdp_and_megatron_scripts_train() {
    let home = tempfile::tempdir().unwrap();
    let model = todays_inputs(home.path());
    for (name, extra) in [
        ("run_qwen3_8b_fsdp.sh", &[][..]),
        (
            "run_qwen3_8b_megatron.sh",
            &[
                "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
                "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1",
            ][..],
        ),
    ] {
        let output = home.path().join(name.trim_end_matches(".sh"));
        let mut args = cut_sizes(&output);
        args.push("trainer.logger=['console']".into());
        args.extend(extra.iter().map(|s| s.to_string()));

        let out = todays_script(name, home.path(), &model, &args).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{name}:\n{stderr}");
        trained_two_steps(&output, name, true);
        assert!(output.join("checkpoints/step_2").is_dir(), "{name}");
    }
}

/// Today's FSDP script with a Gemma 3 as its `MODEL_PATH` (the tiny one, Gemma's chat template
/// over SmolLM2's tokenizer): `grpo verl` takes the model as it takes any, two steps train.
#[test]
fn todays_fsdp_script_trains_a_gemma3() {
    let home = tempfile::tempdir().unwrap();
    todays_inputs(home.path());
    let model = testkit::tiny_gemma_chat_model(home.path());
    let output = home.path().join("gemma3");
    let mut args = cut_sizes(&output);
    args.push("trainer.logger=['console']".into());
    let name = "run_qwen3_4b_fsdp.sh";
    let out = todays_script(name, home.path(), &model, &args).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{name}:\n{stderr}");
    trained_two_steps(&output, name, true);
}

/// VeRL's GRPO script with a reward model (Mistral-Nemo scored by Skywork's reward model) trains
/// two steps with the tiny model and a tiny reward model beside it: VeRL's reward-model worker
/// becomes a `reward_model` scorer of every sample.
#[test]
fn todays_reward_model_script_trains() {
    let home = tempfile::tempdir().unwrap();
    let model = todays_inputs(home.path());
    let rm = testkit::tiny_reward_model(home.path(), 3);
    let name = "run_mistral_nemo_12b_skyworkrm_fsdp.sh";
    let output = home.path().join("rm");
    let mut args = cut_sizes(&output);
    args.push("trainer.logger=['console']".into());
    let data = home.path().join("data/gsm8k");
    let out = todays_script(name, home.path(), &model, &args)
        .env("REWARD_MODEL_PATH", &rm)
        .env("TRAIN_FILE", data.join("train.parquet"))
        .env("TEST_FILE", data.join("test.parquet"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{name}:\n{stderr}");
    let m = trained_two_steps(&output, name, false);
    // The reward model's scores are not the arithmetic rule's 0 / 0.2 / 1.
    let scores: Vec<f64> = [1, 2]
        .iter()
        .map(|s| m[s]["critic/score/mean"].as_f64().unwrap())
        .collect();
    assert!(scores.iter().all(|s| ![0.0, 0.2, 1.0].contains(s)), "{scores:?}");
}
