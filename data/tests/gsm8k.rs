//! `preprocess_gsm8k` against VeRL's own preprocessing: the fixture holds rows and the Arrow
//! schema that VeRL's examples/data_preprocess/gsm8k.py produced (made by
//! tests/fixtures/verl_gsm8k_reference.py). The raw question and answer of each fixture row are
//! fed back through our preprocessor and every column compared.

use std::io::Write;
use std::path::Path;

use arrow_schema::DataType;
use data::preprocess::gsm8k::preprocess_gsm8k;
use data::{ColumnNames, ParquetDataset};
use parquet::arrow::arrow_reader::ArrowReaderMetadata;
use serde_json::{json, Value};

fn fixture() -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gsm8k_train_verl_rows.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// An Arrow type as pyarrow prints it (for the types VeRL's files use).
fn pyarrow_type(data_type: &DataType) -> String {
    match data_type {
        DataType::Utf8 => "string".into(),
        DataType::Int64 => "int64".into(),
        DataType::List(item) => format!("list<{}: {}>", item.name(), pyarrow_type(item.data_type())),
        DataType::Struct(fields) => format!(
            "struct<{}>",
            fields
                .iter()
                .map(|f| format!("{}: {}", f.name(), pyarrow_type(f.data_type())))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        other => panic!("unexpected type {other}"),
    }
}

#[test]
fn matches_verls_preprocessing_column_by_column() {
    let reference = fixture();
    let rows = reference["rows"].as_object().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("excerpt.jsonl");
    let mut lines = std::fs::File::create(&input).unwrap();
    let mut original_indices = Vec::new();
    for (index, row) in rows {
        let raw = json!({
            "question": row["extra_info"]["question"],
            "answer": row["extra_info"]["answer"],
        });
        writeln!(lines, "{raw}").unwrap();
        original_indices.push(index.parse::<u64>().unwrap());
    }
    drop(lines);
    let output = dir.path().join("excerpt.parquet");
    let report = preprocess_gsm8k(&input, &output, "train").unwrap();
    assert_eq!(report.rows, rows.len() as u64);

    // The schema, as pyarrow prints it, equals that of VeRL's file.
    let file = std::fs::File::open(&output).unwrap();
    let metadata = ArrowReaderMetadata::load(&file, Default::default()).unwrap();
    let schema: Vec<String> = metadata
        .schema()
        .fields()
        .iter()
        .map(|f| format!("{}: {}", f.name(), pyarrow_type(f.data_type())))
        .collect();
    let expected: Vec<String> = serde_json::from_value(reference["schema"].clone()).unwrap();
    assert_eq!(schema, expected);

    let dataset = ParquetDataset::open(&[output], ColumnNames::default()).unwrap();
    for (position, example) in dataset.iter().enumerate() {
        let example = example.unwrap();
        let expected = &rows[&original_indices[position].to_string()];
        let mut columns = example.columns.clone();
        // Our excerpt numbers its rows 0.., VeRL's file by position in the whole split.
        assert_eq!(columns["extra_info"]["index"], json!(position));
        columns["extra_info"]["index"] = expected["extra_info"]["index"].clone();
        for column in ["data_source", "ability", "reward_model", "extra_info"] {
            assert_eq!(
                columns[column], expected[column],
                "row {position} column {column}"
            );
        }
        let prompt = serde_json::to_value(&example.prompt).unwrap();
        assert_eq!(prompt, expected["prompt"], "row {position} prompt");
        assert_eq!(
            example.ground_truth,
            Some(expected["reward_model"]["ground_truth"].clone())
        );
    }
}

#[test]
fn bad_gsm8k_input_names_the_line() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("bad.jsonl");
    let output = dir.path().join("out.parquet");
    let cases = [
        (
            "{\"question\": \"q\", \"answer\": \"#### 1\"}\nnot json\n",
            2,
            "not valid JSON",
        ),
        (
            "{\"question\": \"q\"}\n",
            1,
            "no `answer` key; GSM8K lines need `question` and `answer`",
        ),
        (
            "{\"question\": 3, \"answer\": \"#### 1\"}\n",
            1,
            "`question` is 3, expected a string",
        ),
        (
            "\n{\"question\": \"q\", \"answer\": \"no final answer\"}\n",
            2,
            "the answer has no final answer `#### <number>`, which VeRL's preprocessing requires",
        ),
    ];
    for (text, line, problem) in cases {
        std::fs::write(&input, text).unwrap();
        let error = preprocess_gsm8k(&input, &output, "train")
            .unwrap_err()
            .to_string();
        let prefix = format!("{}: line {line}: ", input.display());
        assert!(error.starts_with(&prefix) && error.contains(problem), "{error}");
        assert!(!output.exists(), "no partial output after an error");
        let leftovers: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(leftovers.len(), 1, "only the input remains");
    }
    std::fs::write(&input, "\n\n").unwrap();
    let error = preprocess_gsm8k(&input, &output, "train")
        .unwrap_err()
        .to_string();
    assert_eq!(
        error,
        format!(
            "the dataset {} is empty: the input has no GSM8K lines",
            input.display()
        )
    );
    let error = preprocess_gsm8k(&dir.path().join("nope.jsonl"), &output, "train")
        .unwrap_err()
        .to_string();
    assert!(
        error.starts_with("cannot open ") && error.contains("No such file"),
        "{error}"
    );
}
