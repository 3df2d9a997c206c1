//! `grpo plot` end to end: the binary reads a metrics.jsonl written the way `grpo run` writes it
//! (run headers, validation-only step 0, missing keys, nulls, a resumed run repeating steps, a
//! half-written last line) and writes decodable PNG charts plus a summary; and its error messages.

use std::path::Path;
use std::process::{Command, Output};

fn grpo_plot(args: &[&std::ffi::OsStr]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_grpo"))
        .env_remove("RUST_LOG")
        .arg("plot")
        .args(args)
        .output()
        .expect("grpo runs")
}

/// A 14-step run: rewards 0.1, 0.15, ... rising; validation every 5 steps; the run was killed
/// after step 9 and resumed from a checkpoint at step 7, so steps 8 and 9 appear twice (the
/// first copies with reward 0.0, which must not count); each start writes a run header; the
/// last line is being written.
fn write_metrics(directory: &Path) {
    let header =
        |start: u64| format!("{{\"run\": {{\"start_step\": {start}, \"rollout_dtype\": \"f32\"}}}}\n");
    let mut text = header(0);
    text.push_str("{\"step\": 0, \"val/accuracy\": 0.1}\n");
    let line = |step: u64, reward: f64| {
        format!(
            "{{\"step\": {step}, \"reward/mean\": {reward}, \"reward/std\": 0.2, \
             \"response_length/mean\": {}, \"actor/pg_loss\": 0.01, \"actor/kl\": {}, \
             \"actor/entropy\": {}, \"actor/grad_norm\": 0.5, \"actor/lr\": 1e-6, \
             \"timing_s/step\": 12.5, \"perf/gen_tokens_per_s\": 1500.0, \
             \"perf/train_tokens_per_s\": null, \"weights/version_lag\": 0, \
             \"reward/errors\": 0}}\n",
            60 - step,
            if step == 3 {
                "null".to_string()
            } else {
                format!("{}", 0.001 * step as f64)
            },
            1.2 - 0.01 * step as f64,
        )
    };
    for step in 1..=9 {
        let reward = if step >= 8 { 0.0 } else { 0.05 + 0.05 * step as f64 };
        text.push_str(&line(step, reward));
        if step == 5 {
            text.push_str("{\"step\": 5, \"val/accuracy\": 0.3}\n");
        }
    }
    text.push_str(&header(7));
    for step in 8..=14 {
        text.push_str(&line(step, 0.05 + 0.05 * step as f64));
        if step == 10 {
            text.push_str("{\"step\": 10, \"val/accuracy\": 0.55}\n");
        }
    }
    text.push_str("{\"step\": 15, \"reward/me");
    std::fs::write(directory.join("metrics.jsonl"), text).unwrap();
}

fn decode_png(path: &Path) -> (u32, u32, usize) {
    let bytes = std::fs::read(path).unwrap();
    let decoder = png::Decoder::new(std::io::Cursor::new(bytes));
    let mut reader = decoder.read_info().expect("PNG header");
    let mut pixels = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut pixels).expect("PNG data");
    let inked = pixels[..info.buffer_size()]
        .chunks(3)
        .filter(|p| p != &[255, 255, 255])
        .count();
    (info.width, info.height, inked)
}

#[test]
fn plots_a_resumed_run_and_summarises_it() {
    let run = tempfile::tempdir().unwrap();
    write_metrics(run.path());
    let output = grpo_plot(&[run.path().as_os_str()]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(stderr.contains("last line is incomplete"), "{stderr}");
    let stdout = String::from_utf8(output.stdout).unwrap();
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 8, "{stdout}");
    let plots = run.path().join("plots");
    for (line, name) in lines.iter().zip([
        "reward.png",
        "val_accuracy.png",
        "kl.png",
        "entropy.png",
        "response_length.png",
        "throughput.png",
        "overview.png",
    ]) {
        assert_eq!(Path::new(line), plots.join(name));
        let (width, height, inked) = decode_png(Path::new(line));
        if name == "overview.png" {
            assert_eq!((width, height), (1800, 1040));
        } else {
            assert_eq!((width, height), (900, 540));
        }
        assert!(inked > 10_000, "{name}: only {inked} non-white pixels");
    }
    // Rewards of steps 1..14 are 0.1, 0.15, ..., 0.75 (the abandoned copies of steps 8 and 9
    // are gone): the first five average 0.2, the last five 0.65.
    assert_eq!(
        lines[7],
        "14 training steps (steps 1..14); mean reward first 5: 0.200, last 5: 0.650 (+0.450); \
         validation accuracy 0.100 (step 0) -> 0.550 (step 10)"
    );
}

#[test]
fn output_flag_and_a_metrics_file_path_are_accepted() {
    let run = tempfile::tempdir().unwrap();
    write_metrics(run.path());
    let elsewhere = run.path().join("docs").join("img");
    let output = grpo_plot(&[
        run.path().join("metrics.jsonl").as_os_str(),
        "--output".as_ref(),
        elsewhere.as_os_str(),
    ]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(elsewhere.join("overview.png").is_file());
    assert!(!run.path().join("plots").exists());
}

#[test]
fn explains_a_missing_file_a_bad_line_and_an_empty_run() {
    let run = tempfile::tempdir().unwrap();
    let missing = grpo_plot(&[run.path().as_os_str()]);
    assert_eq!(missing.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&missing.stderr);
    assert!(
        stderr.contains("metrics.jsonl: no such file; run `grpo run RECIPE` first"),
        "{stderr}"
    );

    let metrics = run.path().join("metrics.jsonl");
    std::fs::write(
        &metrics,
        "{\"step\": 0, \"val/accuracy\": 0.1}\n{\"step\": 1, \"reward/mean\": 0.5}\n\
         {\"step\": 2, \"reward/mean\": [0.5]}\n",
    )
    .unwrap();
    let bad = grpo_plot(&[run.path().as_os_str()]);
    assert_eq!(bad.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(
        stderr.contains(&format!(
            "{}:3: `reward/mean` must be a number or null, found [0.5]",
            metrics.display()
        )),
        "{stderr}"
    );

    std::fs::write(&metrics, "{\"step\": 0, \"val/accuracy\": 0.1}\n").unwrap();
    let empty = grpo_plot(&[run.path().as_os_str()]);
    assert_eq!(empty.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&empty.stderr);
    assert!(
        stderr.contains(
            "no training steps yet (only validation metrics, for step 0); wait until `grpo run` \
             has finished its first step"
        ),
        "{stderr}"
    );
    assert!(!run.path().join("plots").exists());
}
