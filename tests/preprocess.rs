//! End-to-end tests of `grpo preprocess`: GSM8K from the real train file against VeRL's own
//! preprocessing (fixture rows made by data/tests/fixtures/verl_gsm8k_reference.py), the seeded
//! arithmetic task, bad input, and the help text.
//!
//! The GSM8K train file (7,473 rows) is looked for in `$GRPO_GSM8K_DIR`, else in the copy
//! committed in `data/gsm8k`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use data::serde_json::{self, json, Value};
use data::{ColumnNames, ParquetDataset, Prompt};

fn grpo(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_grpo"))
        .args(args)
        .output()
        .expect("the grpo binary runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn gsm8k_dir() -> PathBuf {
    let dir = std::env::var_os("GRPO_GSM8K_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("data/gsm8k"));
    assert!(
        dir.join("train.jsonl").is_file(),
        "GSM8K train.jsonl not found in {}: set GRPO_GSM8K_DIR to the folder holding the \
         openai/grade-school-math train.jsonl and test.jsonl",
        dir.display()
    );
    dir
}

#[test]
fn gsm8k_train_matches_verl_field_by_field() {
    let dir = tempfile::tempdir().unwrap();
    let output = dir.path().join("train.parquet");
    let input = gsm8k_dir().join("train.jsonl");
    let run = grpo(&[
        "preprocess",
        "gsm8k",
        "--input",
        input.to_str().unwrap(),
        "--output",
        output.to_str().unwrap(),
        "--split",
        "train",
    ]);
    assert!(run.status.success(), "stderr: {}", text(&run.stderr));
    assert_eq!(
        text(&run.stdout),
        format!("wrote 7473 rows (8 row groups) to {}\n", output.display())
    );

    let fixture_path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("data/tests/fixtures/gsm8k_train_verl_rows.json");
    let reference: Value = serde_json::from_str(&std::fs::read_to_string(fixture_path).unwrap()).unwrap();
    assert_eq!(reference["num_rows"], json!(7473));

    let dataset = ParquetDataset::open(std::slice::from_ref(&output), ColumnNames::default()).unwrap();
    assert_eq!(dataset.len(), 7473);
    let rows = reference["rows"].as_object().unwrap();
    let indices: Vec<u64> = rows.keys().map(|k| k.parse().unwrap()).collect();
    assert!(indices.len() >= 8);
    let examples = dataset.read(&indices).unwrap();
    for (example, index) in examples.iter().zip(&indices) {
        let expected = &rows[&index.to_string()];
        for column in ["data_source", "ability", "reward_model", "extra_info"] {
            assert_eq!(
                example.columns[column], expected[column],
                "row {index}, column {column}"
            );
        }
        assert_eq!(
            serde_json::to_value(&example.prompt).unwrap(),
            expected["prompt"],
            "row {index}"
        );
        assert_eq!(example.data_source.as_deref(), Some("openai/gsm8k"));
        assert_eq!(
            example.ground_truth,
            Some(expected["reward_model"]["ground_truth"].clone())
        );
    }
    // Row 0 spelled out, to read without the fixture.
    let first = &examples[indices.iter().position(|&i| i == 0).unwrap()];
    let Prompt::Messages(messages) = &first.prompt else {
        panic!("chat prompt expected")
    };
    assert_eq!(messages.len(), 1);
    assert_eq!(messages[0].role, "user");
    assert!(messages[0]
        .content
        .starts_with("Natalia sold clips to 48 of her friends in April"));
    assert!(messages[0]
        .content
        .ends_with("May? Let's think step by step and output the final answer after \"####\"."));
    assert_eq!(first.ground_truth_text().as_deref(), Some("72"));
    assert_eq!(first.columns["extra_info"]["index"], json!(0));
    assert_eq!(first.columns["extra_info"]["split"], json!("train"));
}

fn arithmetic(seed: &str, output: &Path, extra: &[&str]) -> Output {
    let mut args = vec![
        "preprocess",
        "arithmetic",
        "--seed",
        seed,
        "--count",
        "200",
        "--output",
        output.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    grpo(&args)
}

#[test]
fn arithmetic_is_deterministic_and_correct() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b, c) = (
        dir.path().join("a.parquet"),
        dir.path().join("b.parquet"),
        dir.path().join("c.parquet"),
    );
    let hard = ["--max-operands", "4", "--max-value", "50", "--ops", "+-*"];
    for (seed, path) in [("5", &a), ("5", &b), ("6", &c)] {
        let run = arithmetic(seed, path, &hard);
        assert!(run.status.success(), "stderr: {}", text(&run.stderr));
        assert_eq!(
            text(&run.stdout),
            format!("wrote 200 rows (1 row group) to {}\n", path.display())
        );
    }
    let bytes = |p: &Path| std::fs::read(p).unwrap();
    assert_eq!(bytes(&a), bytes(&b), "same seed, same file");
    assert_ne!(bytes(&a), bytes(&c), "another seed, another file");

    let dataset = ParquetDataset::open(std::slice::from_ref(&a), ColumnNames::default()).unwrap();
    assert_eq!(dataset.len(), 200);
    for example in dataset.iter() {
        let example = example.unwrap();
        assert_eq!(example.data_source.as_deref(), Some("grpo/arithmetic"));
        let expression = example.columns["extra_info"]["expression"]
            .as_str()
            .unwrap()
            .to_owned();
        let Prompt::Messages(messages) = &example.prompt else {
            panic!("chat prompt expected")
        };
        assert_eq!(
            messages[0].content,
            format!(
                "What is {expression}? Let's think step by step and output the final answer after \"####\"."
            )
        );
        // Evaluate independently: `*` first, then `+`/`-` left to right.
        let tokens: Vec<&str> = expression.split(' ').collect();
        let mut terms = vec![tokens[0].parse::<i64>().unwrap()];
        for pair in tokens[1..].chunks(2) {
            let value: i64 = pair[1].parse().unwrap();
            match pair[0] {
                "*" => *terms.last_mut().unwrap() *= value,
                "+" => terms.push(value),
                "-" => terms.push(-value),
                other => panic!("operator {other}"),
            }
        }
        let answer: i64 = terms.iter().sum();
        assert_eq!(
            example.ground_truth_text(),
            Some(answer.to_string()),
            "{expression}"
        );
    }
}

#[test]
fn missing_output_folders_are_made() {
    let dir = tempfile::tempdir().unwrap();
    let run = Command::new(env!("CARGO_BIN_EXE_grpo"))
        .args(["preprocess", "arithmetic", "--seed", "1", "--count", "10"])
        .args(["--output", "a/new/folder/train.parquet"])
        .current_dir(dir.path())
        .output()
        .expect("the grpo binary runs");
    assert!(run.status.success(), "stderr: {}", text(&run.stderr));
    assert_eq!(
        text(&run.stdout),
        "wrote 10 rows (1 row group) to a/new/folder/train.parquet\n"
    );
    let written = dir.path().join("a/new/folder/train.parquet");
    let dataset = ParquetDataset::open(std::slice::from_ref(&written), ColumnNames::default()).unwrap();
    assert_eq!(dataset.len(), 10);
    // Only the file itself is left: the temporary beside it is gone.
    let names: Vec<_> = std::fs::read_dir(dir.path().join("a/new/folder"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["train.parquet"]);
}

#[test]
fn an_unwritable_output_states_the_os_error_once() {
    let dir = tempfile::tempdir().unwrap();
    // A file where a folder of the output path should be: no permission trick a root user
    // would bypass.
    std::fs::write(dir.path().join("blocker"), "not a folder").unwrap();
    let output = dir.path().join("blocker/train.parquet");
    let run = arithmetic("1", &output, &[]);
    assert_eq!(run.status.code(), Some(2));
    let stderr = text(&run.stderr);
    assert!(
        stderr.starts_with(&format!(
            "error: grpo preprocess arithmetic failed: cannot write {}: ",
            output.display()
        )),
        "{stderr}"
    );
    assert_eq!(stderr.matches("(os error").count(), 1, "{stderr}");
}

#[test]
fn bad_input_fails_with_a_clear_message() {
    let dir = tempfile::tempdir().unwrap();
    let output = dir.path().join("out.parquet");
    let missing = dir.path().join("missing.jsonl");
    let run = grpo(&[
        "preprocess",
        "gsm8k",
        "--input",
        missing.to_str().unwrap(),
        "--output",
        output.to_str().unwrap(),
    ]);
    assert_eq!(run.status.code(), Some(2));
    let stderr = text(&run.stderr);
    assert!(
        stderr.starts_with(&format!(
            "error: grpo preprocess gsm8k failed: cannot open {}: No such file",
            missing.display()
        )),
        "{stderr}"
    );

    let bad = dir.path().join("bad.jsonl");
    std::fs::write(
        &bad,
        "{\"question\": \"q\", \"answer\": \"#### 3\"}\n{\"question\": \"q\"}\n",
    )
    .unwrap();
    let run = grpo(&[
        "preprocess",
        "gsm8k",
        "--input",
        bad.to_str().unwrap(),
        "--output",
        output.to_str().unwrap(),
    ]);
    assert_eq!(run.status.code(), Some(2));
    assert!(text(&run.stderr).contains(&format!(
        "{}: line 2: no `answer` key; GSM8K lines need `question` and `answer`",
        bad.display()
    )));
    assert!(!output.exists());

    let run = arithmetic("1", &output, &["--ops", "+/"]);
    assert_eq!(run.status.code(), Some(2));
    assert!(text(&run.stderr).contains("invalid option `--ops`: has `/`; the operators are +, - and *"));
}

#[test]
fn help_explains_every_option_with_examples() {
    let run = grpo(&["preprocess", "--help"]);
    assert!(run.status.success());
    let help = text(&run.stdout);
    assert!(help.contains("gsm8k") && help.contains("arithmetic"), "{help}");
    assert!(
        help.contains("grpo preprocess gsm8k --input gsm8k/train.jsonl"),
        "{help}"
    );

    let help = text(&grpo(&["preprocess", "gsm8k", "--help"]).stdout);
    for option in ["--input", "--output", "--split", "Example: `--split test`"] {
        assert!(help.contains(option), "missing {option}: {help}");
    }
    let help = text(&grpo(&["preprocess", "arithmetic", "--help"]).stdout);
    for option in [
        "--seed",
        "--count",
        "--output",
        "--min-operands",
        "--max-operands",
        "--max-value",
        "--ops",
        "--split",
        "Example: `--ops \"+-*\"`",
        "grpo/arithmetic",
    ] {
        assert!(help.contains(option), "missing {option}: {help}");
    }
}
