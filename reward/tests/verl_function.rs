//! `reward.custom_reward_function`: a reward file written for VeRL
//! (`fixtures/verl_style_reward.py`) run by python3 through grpo scores exactly as the same
//! function called directly in Python; a function that raises, hangs, crashes or returns
//! something that is not a score costs only its own samples (score 0, error counted).

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use reward::{PoolOptions, RewardConfig, RewardPool, Sample, ScoredSample};

const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/verl_style_reward.py");

fn sample(id: u64, data_source: &str, response: &str, truth: &str, split: &str) -> Sample {
    Sample {
        id,
        data_source: data_source.to_string(),
        prompt: serde_json::Value::Null,
        response: response.to_string(),
        ground_truth: truth.to_string(),
        extra: serde_json::json!({"extra_info": {"split": split, "index": id}, "ability": "math"}),
        response_length: response.len(),
        truncated: false,
    }
}

fn config(yaml: &str) -> RewardConfig {
    serde_yaml::from_str(&format!("custom_reward_function: {{path: {FIXTURE}, {yaml}}}")).unwrap()
}

fn cases() -> Vec<Sample> {
    let responses = [
        ("So the answer is 72.", "72"),
        ("I think 71", "72"),
        ("#### 1,234", "1234"),
        ("no number here", "5"),
        ("-3 - 4 = -7", "-7"),
        ("3.50 dollars", "3.5"),
    ];
    responses
        .iter()
        .enumerate()
        .map(|(i, (r, t))| {
            sample(
                i as u64,
                "openai/gsm8k",
                r,
                t,
                if i % 2 == 0 { "train" } else { "test" },
            )
        })
        .collect()
}

/// The function called directly in Python on `samples`, as VeRL's naive manager calls it.
fn direct(function: &str, kwargs: &str, samples: &[Sample]) -> Vec<serde_json::Value> {
    let calls: Vec<serde_json::Value> = samples
        .iter()
        .map(|s| {
            serde_json::json!({"data_source": s.data_source, "solution_str": s.response,
                               "ground_truth": s.ground_truth, "extra_info": s.extra["extra_info"]})
        })
        .collect();
    let script = format!(
        "import importlib.util, json, sys\n\
         spec = importlib.util.spec_from_file_location('user_reward', {FIXTURE:?})\n\
         m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n\
         calls = json.loads(sys.argv[1]); kwargs = json.loads(sys.argv[2])\n\
         print(json.dumps([getattr(m, {function:?})(**c, **kwargs) for c in calls]))\n"
    );
    let out = Command::new("python3")
        .args(["-c", &script, &serde_json::to_string(&calls).unwrap(), kwargs])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn pool(config: &RewardConfig) -> RewardPool {
    RewardPool::new(
        Arc::new(config.build(None).unwrap()),
        PoolOptions {
            num_workers: 4,
            time_limit: Duration::from_secs(20),
            log_first_errors: 2,
        },
    )
}

fn score_all(pool: &RewardPool, samples: Vec<Sample>) -> Vec<ScoredSample> {
    let count = samples.len();
    for s in samples {
        pool.submit(s).unwrap();
    }
    let mut results: Vec<ScoredSample> = (0..count)
        .map(|_| {
            pool.recv_timeout(Duration::from_secs(30))
                .expect("a result within 30 s")
        })
        .collect();
    results.sort_by_key(|r| r.id);
    results
}

#[test]
fn a_verl_reward_file_scores_as_it_does_in_python() {
    // A number per call, with reward_kwargs.
    let pool = pool(&config(
        "name: compute_score, reward_kwargs: {format_score: 0.1}, workers: 2",
    ));
    let results = score_all(&pool, cases());
    let want = direct("compute_score", r#"{"format_score": 0.1}"#, &cases());
    for (got, want) in results.iter().zip(&want) {
        assert_eq!(got.error, None);
        assert_eq!(got.score, want.as_f64().unwrap(), "sample {}", got.id);
    }
    assert_eq!(
        results.iter().map(|r| r.score).collect::<Vec<_>>(),
        [1.0, 0.1, 1.0, 0.0, 1.0, 1.0]
    );

    // A dict: the score, its numeric keys as extras, `pred`; VeRL's extra_info from the row.
    let pool = self::pool(&config("name: score_with_details"));
    let results = score_all(&pool, cases());
    let want = direct("score_with_details", "{}", &cases());
    for (got, want) in results.iter().zip(&want) {
        assert_eq!(got.score, want["score"].as_f64().unwrap());
        assert_eq!(
            got.extras["acc"],
            if want["acc"].as_bool().unwrap() { 1.0 } else { 0.0 }
        );
        assert_eq!(
            got.extras["is_train"],
            if want["is_train"].as_bool().unwrap() {
                1.0
            } else {
                0.0
            }
        );
        assert_eq!(got.pred.as_deref(), want["pred"].as_str());
        assert!(
            !got.extras.contains_key("label"),
            "a string other than pred is not a metric"
        );
    }

    // VeRL's batch manager form, and a coroutine function.
    for (yaml, function) in [
        (
            "name: batch_compute_score, reward_manager: batch, reward_kwargs: {format_score: 0.1}",
            "compute_score",
        ),
        ("name: async_compute_score", "compute_score"),
    ] {
        let kwargs = if yaml.contains("format_score") {
            r#"{"format_score": 0.1}"#
        } else {
            "{}"
        };
        let results = score_all(&self::pool(&config(yaml)), cases());
        let want = direct(function, kwargs, &cases());
        let got: Vec<f64> = results.iter().map(|r| r.score).collect();
        let want: Vec<f64> = want.iter().map(|w| w.as_f64().unwrap()).collect();
        assert_eq!(got, want, "{yaml}");
    }
}

#[test]
fn raising_hanging_crashing_and_garbage_cost_only_their_own_samples() {
    let pool = pool(&config("name: misbehaving, workers: 3, timeout_s: 5"));
    let responses = [
        "fine",
        "raise",
        "string",
        "nan",
        "crash",
        "fine again",
        "hang",
        "fine at last",
    ];
    let samples = responses
        .iter()
        .enumerate()
        .map(|(i, r)| sample(i as u64, "any", r, "1", "test"))
        .collect();
    let started = Instant::now();
    let results = score_all(&pool, samples);
    let by = |response: &str| &results[responses.iter().position(|r| *r == response).unwrap()];
    for fine in ["fine", "fine again", "fine at last"] {
        assert_eq!((by(fine).score, by(fine).error.as_deref()), (1.0, None), "{fine}");
    }
    let error = |response: &str| {
        by(response)
            .error
            .clone()
            .unwrap_or_else(|| panic!("{response}: no error"))
    };
    assert!(
        error("raise").contains("ValueError: cannot score this"),
        "{}",
        error("raise")
    );
    assert!(
        error("raise").contains("verl_style_reward.py"),
        "{}",
        error("raise")
    );
    assert!(
        error("string").contains("misbehaving returned '1.0' (str)"),
        "{}",
        error("string")
    );
    assert!(error("nan").contains("not finite"), "{}", error("nan"));
    assert!(error("crash").contains("exited"), "{}", error("crash"));
    assert!(
        error("hang").contains("did not finish sample 6 within 5s"),
        "{}",
        error("hang")
    );
    for bad in ["raise", "string", "nan", "crash", "hang"] {
        assert_eq!(by(bad).score, 0.0, "{bad}");
    }
    assert!(
        started.elapsed() < Duration::from_secs(25),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(pool.metrics().errors, 5);
}

#[test]
fn a_missing_file_or_function_is_a_recipe_error_before_the_run() {
    let missing: RewardConfig =
        serde_yaml::from_str("custom_reward_function: {path: /nonexistent/reward.py}").unwrap();
    let error = missing.build(None).err().unwrap().to_string();
    assert!(
        error.contains("reward.custom_reward_function.path")
            && error.contains("no such file: /nonexistent/reward.py"),
        "{error}"
    );
    let error = config("name: compute_scores")
        .build(None)
        .err()
        .unwrap()
        .to_string();
    assert!(
        error.contains("has no `compute_scores`") && error.contains("compute_score, "),
        "{error}"
    );
    let both: RewardConfig = serde_yaml::from_str(&format!(
        "custom_reward_function: {{path: {FIXTURE}}}\ndata_sources: {{openai/gsm8k: gsm8k}}"
    ))
    .unwrap();
    let error = both.build(None).err().unwrap().to_string();
    assert!(error.contains("scores every data source"), "{error}");
}

/// `workers` Python processes serve the function side by side: concurrent samples are scored by
/// as many distinct processes as there are workers.
#[test]
fn workers_processes_serve_the_function_side_by_side() {
    let file = std::env::temp_dir().join(format!("pid_reward_{}.py", std::process::id()));
    std::fs::write(
        &file,
        "import os, time\n\
         def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    \
             time.sleep(0.3)\n    \
             return {'score': 1.0, 'pid': float(os.getpid())}\n",
    )
    .unwrap();
    let processes = |workers: usize| {
        let config: RewardConfig = serde_yaml::from_str(&format!(
            "custom_reward_function: {{path: {}, workers: {workers}}}",
            file.display()
        ))
        .unwrap();
        let pool = pool(&config);
        let samples = (0..4).map(|i| sample(i, "any", "1", "1", "train")).collect();
        let mut pids: Vec<u64> = score_all(&pool, samples)
            .iter()
            .map(|r| r.extras["pid"] as u64)
            .collect();
        pids.sort();
        pids.dedup();
        pids.len()
    };
    let (one, two) = (processes(1), processes(2));
    std::fs::remove_file(&file).unwrap();
    assert_eq!((one, two), (1, 2));
}
