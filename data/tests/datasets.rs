//! Reading Parquet datasets end to end: VeRL and TRL layouts written here, several files and row
//! groups, filtering and truncation with a whitespace tokenizer, resumable sampling over a real
//! file, and every kind of bad input with the error text it must produce.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::builder::{ListBuilder, StringBuilder, StructBuilder};
use arrow_array::{ArrayRef, Int64Array, RecordBatch, StringArray};
use arrow_schema::{DataType, Field, Fields, Schema};
use data::preprocess::{ExtraType, ExtraValue, VerlRecord, VerlWriter};
use data::{
    ColumnNames, DataConfig, DataError, Message, ParquetDataset, Prompt, PromptDataset, PromptTokenizer,
    Sampler, Split, TokenizeError, Truncation,
};
use parquet::arrow::ArrowWriter;
use parquet::file::properties::WriterProperties;
use serde_json::json;

/// One token per whitespace-separated word of the prompt text.
fn words(prompt: &Prompt) -> Result<Vec<u32>, TokenizeError> {
    Ok(prompt
        .text()
        .split_whitespace()
        .map(|word| word.len() as u32)
        .collect())
}

/// Writes `rows` VeRL rows whose prompt is `n` words `w0 w1 ...` with `n = 1 + row % 7`.
fn write_verl(path: &Path, rows: usize, first_index: i64) {
    let mut writer = VerlWriter::create(path, &[("index", ExtraType::Int)]).unwrap();
    let records: Vec<VerlRecord> = (0..rows)
        .map(|row| {
            let index = first_index + row as i64;
            let words: Vec<String> = (0..1 + index % 7).map(|w| format!("w{w}")).collect();
            VerlRecord {
                data_source: "test/words".into(),
                prompt: vec![
                    Message::new("system", "Count."),
                    Message::new("user", words.join(" ")),
                ],
                ability: "math".into(),
                style: "rule".into(),
                ground_truth: index.to_string(),
                extra_info: vec![ExtraValue::Int(index)],
            }
        })
        .collect();
    writer.write(&records).unwrap();
    writer.finish().unwrap();
}

fn write_batch(path: &Path, batch: &RecordBatch) {
    let file = std::fs::File::create(path).unwrap();
    let properties = WriterProperties::builder()
        .set_max_row_group_row_count(Some(2))
        .build();
    let mut writer = ArrowWriter::try_new(file, batch.schema(), Some(properties)).unwrap();
    writer.write(batch).unwrap();
    writer.close().unwrap();
}

fn open(paths: &[PathBuf]) -> Result<ParquetDataset, DataError> {
    ParquetDataset::open(paths, ColumnNames::default())
}

#[test]
fn reads_verl_rows_across_files_and_row_groups() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a.parquet"), dir.path().join("b.parquet"));
    write_verl(&a, 2500, 0);
    write_verl(&b, 30, 2500);
    let dataset = open(&[a.clone(), b.clone()]).unwrap();
    assert_eq!(dataset.len(), 2530);
    let groups: Vec<(usize, u64, u64)> = dataset
        .row_groups()
        .iter()
        .map(|g| (g.file, g.first_index, g.rows))
        .collect();
    assert_eq!(
        groups,
        vec![(0, 0, 1024), (0, 1024, 1024), (0, 2048, 452), (1, 2500, 30)]
    );

    // Random access in any order, repeats included, across row groups and files.
    let wanted = [2529, 3, 1500, 3, 2047, 2048, 0];
    let rows = dataset.read(&wanted).unwrap();
    for (example, &index) in rows.iter().zip(&wanted) {
        assert_eq!(example.index, index);
        assert_eq!(example.ground_truth_text(), Some(index.to_string()));
        assert_eq!(example.columns["extra_info"], json!({"index": index}));
        assert_eq!(example.data_source.as_deref(), Some("test/words"));
        assert_eq!(example.ability.as_deref(), Some("math"));
        let n = 1 + index % 7;
        let Prompt::Messages(messages) = &example.prompt else {
            panic!("messages expected")
        };
        assert_eq!(messages[0], Message::new("system", "Count."));
        assert_eq!(messages[1].content.split(' ').count() as u64, n);
    }
    assert_eq!(rows[0].file.as_ref(), b.as_path());
    assert_eq!(rows[0].row, 29);
    assert_eq!(rows[2].row, 1500);
    assert_eq!(dataset.locate(2500).unwrap(), (b.as_path(), 0));

    // Streaming visits every row once, in order.
    let mut count = 0u64;
    for (expected, example) in dataset.iter().enumerate() {
        let example = example.unwrap();
        assert_eq!(example.index, expected as u64);
        count += 1;
    }
    assert_eq!(count, 2530);

    // Without the row-group cache, reads decode only the selected rows: same results.
    let uncached = open(&[a.clone(), b.clone()]).unwrap().with_cache_bytes(0);
    assert_eq!(uncached.read(&wanted).unwrap(), rows);
    // A cache smaller than the dataset evicts and re-decodes: same results again.
    let small = open(&[a.clone(), b.clone()]).unwrap().with_cache_bytes(1 << 20);
    for _ in 0..2 {
        assert_eq!(small.read(&wanted).unwrap(), rows);
    }

    let error = dataset.read(&[2530]).unwrap_err();
    assert_eq!(
        error.to_string(),
        "row 2530 is out of range: the dataset has 2530 rows"
    );
}

#[test]
fn reads_trl_prompt_only_files_and_passes_columns_through() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("trl.parquet");
    let prompts: ArrayRef = Arc::new(StringArray::from(vec!["2+2=", "3*3=", "1-1="]));
    let solutions: ArrayRef = Arc::new(StringArray::from(vec!["4", "9", "0"]));
    let levels: ArrayRef = Arc::new(Int64Array::from(vec![1, 2, 3]));
    let mut tags = ListBuilder::new(StringBuilder::new());
    tags.append_value([Some("easy")]);
    tags.append_value([Some("mul"), Some("easy")]);
    tags.append_null();
    let batch = RecordBatch::try_from_iter(vec![
        ("prompt", prompts),
        ("ground_truth", solutions),
        ("level", levels),
        ("tags", Arc::new(tags.finish()) as ArrayRef),
    ])
    .unwrap();
    write_batch(&path, &batch);
    let dataset = open(std::slice::from_ref(&path)).unwrap();
    assert_eq!(dataset.row_groups().len(), 2);
    let rows = dataset.read(&[1, 2]).unwrap();
    assert_eq!(rows[0].prompt, Prompt::Text("3*3=".into()));
    assert_eq!(rows[0].ground_truth, Some(json!("9")));
    assert_eq!(rows[0].data_source, None);
    assert_eq!(
        serde_json::Value::Object(rows[0].columns.clone()),
        json!({"ground_truth": "9", "level": 2, "tags": ["mul", "easy"]})
    );
    assert_eq!(rows[1].columns["tags"], serde_json::Value::Null);
}

#[test]
fn reads_messages_from_a_configured_prompt_key() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("chat.parquet");
    let fields = Fields::from(vec![
        Field::new("content", DataType::Utf8, true),
        Field::new("role", DataType::Utf8, true),
    ]);
    let mut chats = ListBuilder::new(StructBuilder::from_fields(fields, 0));
    for text in ["hello", "bye"] {
        let structs = chats.values();
        structs
            .field_builder::<StringBuilder>(0)
            .unwrap()
            .append_value(text);
        structs
            .field_builder::<StringBuilder>(1)
            .unwrap()
            .append_value("user");
        structs.append(true);
        chats.append(true);
    }
    let sources: ArrayRef = Arc::new(StringArray::from(vec!["x", "y"]));
    let batch = RecordBatch::try_from_iter(vec![
        ("chat", Arc::new(chats.finish()) as ArrayRef),
        ("task", sources),
    ])
    .unwrap();
    write_batch(&path, &batch);
    let names = ColumnNames {
        prompt: "chat".into(),
        data_source: "task".into(),
    };
    let dataset = ParquetDataset::open(std::slice::from_ref(&path), names).unwrap();
    let example = dataset.get(1).unwrap();
    assert_eq!(
        example.prompt,
        Prompt::Messages(vec![Message::new("user", "bye")])
    );
    assert_eq!(example.data_source.as_deref(), Some("y"));

    // With the default prompt key the same file has no prompt column.
    let error = open(std::slice::from_ref(&path)).unwrap_err();
    assert_eq!(
        error.to_string(),
        format!(
            "{}: column `prompt` is missing; the file has columns [chat, task]; set \
             data.prompt_key to the column that holds the prompts",
            path.display()
        )
    );
}

#[test]
fn filters_overlong_prompts_and_truncates() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("train.parquet");
    write_verl(&path, 70, 0);
    // Prompt text is "Count.\n" + n words, so the whitespace count is n + 1, n = 1 + row % 7.
    let config = DataConfig {
        train_files: [path.clone()].into_iter().collect(),
        max_prompt_length: 5,
        filter_overlong_prompts: true,
        train_batch_size: 8,
        ..DataConfig::default()
    };
    let tokenizer: &dyn PromptTokenizer = &words;
    let dataset = PromptDataset::open(&config, Split::Train, Some(tokenizer)).unwrap();
    // n + 1 <= 5 keeps n in 1..=4: 4 of every 7 rows.
    assert_eq!(dataset.report().dropped_overlong, 30);
    assert_eq!(dataset.len(), 40);
    let kept = dataset.read(&[0, 1, 2, 3, 4]).unwrap();
    let indices: Vec<u64> = kept.iter().map(|e| e.index).collect();
    assert_eq!(indices, vec![0, 1, 2, 3, 7]);

    // Without filtering, an overlong prompt fails under `error` and is cut otherwise.
    let unfiltered = DataConfig {
        filter_overlong_prompts: false,
        ..config.clone()
    };
    let dataset = PromptDataset::open(&unfiltered, Split::Train, None).unwrap();
    let long = dataset.read(&[6]).unwrap().remove(0);
    let error = dataset.encode_prompt(&long, tokenizer).unwrap_err();
    assert_eq!(
        error.to_string(),
        format!(
            "{}: row 6, column `prompt`: the prompt has 8 tokens, more than \
             data.max_prompt_length = 5; set data.filter_overlong_prompts: true to drop such \
             rows, data.truncation: left|right|middle to cut them, or raise \
             data.max_prompt_length",
            path.display()
        )
    );
    let left = DataConfig {
        truncation: Truncation::Left,
        ..unfiltered
    };
    let dataset = PromptDataset::open(&left, Split::Train, None).unwrap();
    // "Count." w0..w6 as word lengths: [6, 2, 2, 2, 2, 2, 2, 2]; left truncation keeps the end.
    assert_eq!(dataset.encode_prompt(&long, tokenizer).unwrap(), vec![2; 5]);

    // Filtering everything away is an error that says so.
    let tiny = DataConfig {
        max_prompt_length: 1,
        ..config
    };
    let error = PromptDataset::open(&tiny, Split::Train, Some(tokenizer)).unwrap_err();
    assert!(
        error
            .to_string()
            .ends_with("is empty: all 70 prompts are longer than data.max_prompt_length = 1 tokens; raise it or turn data.filter_overlong_prompts off and set data.truncation"),
        "{error}"
    );
}

#[test]
fn tokenizer_failures_name_the_row() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("train.parquet");
    write_verl(&path, 10, 0);
    let config = DataConfig {
        train_files: [path.clone()].into_iter().collect(),
        filter_overlong_prompts: true,
        ..DataConfig::default()
    };
    let failing = |prompt: &Prompt| -> Result<Vec<u32>, TokenizeError> {
        if prompt.text().contains("w5") {
            Err("unknown token `w5`".into())
        } else {
            words(prompt)
        }
    };
    let error = PromptDataset::open(&config, Split::Train, Some(&failing)).unwrap_err();
    assert_eq!(
        error.to_string(),
        format!(
            "{}: row 5, column `prompt`: tokenizing the prompt failed: unknown token `w5`",
            path.display()
        )
    );
}

#[test]
fn max_samples_takes_a_seeded_subset() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("train.parquet");
    write_verl(&path, 100, 0);
    let config = DataConfig {
        train_files: [path].into_iter().collect(),
        train_max_samples: 10,
        train_batch_size: 4,
        ..DataConfig::default()
    };
    let first = PromptDataset::open(&config, Split::Train, None).unwrap();
    assert_eq!(first.len(), 10);
    assert_eq!(first.report().dropped_by_max_samples, 90);
    let indices = |d: &PromptDataset| -> Vec<u64> {
        d.read(&(0..10).collect::<Vec<_>>())
            .unwrap()
            .iter()
            .map(|e| e.index)
            .collect()
    };
    let chosen = indices(&first);
    assert!(chosen.windows(2).all(|w| w[0] < w[1]), "{chosen:?}");
    assert_ne!(chosen, (0..10).collect::<Vec<_>>());
    let again = PromptDataset::open(&config, Split::Train, None).unwrap();
    assert_eq!(indices(&again), chosen);
}

/// Validation reads `val_max_samples` rows of its file (a seeded subset, as for training) and
/// generates them in batches of `val_batch_size` (all at once without it).
#[test]
fn validation_takes_its_subset_in_batches_of_its_size() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("val.parquet");
    write_verl(&path, 30, 0);
    let config = |val_max_samples: i64, val_batch_size: Option<usize>| DataConfig {
        train_files: [path.clone()].into_iter().collect(),
        val_files: [path.clone()].into_iter().collect(),
        val_max_samples,
        val_batch_size,
        ..DataConfig::default()
    };
    let batches = |config: &DataConfig| -> (u64, Vec<usize>) {
        let dataset = PromptDataset::open(config, Split::Validation, None).unwrap();
        let mut sampler = dataset.validation_sampler(config).unwrap();
        let sizes = (0..sampler.batches_per_epoch())
            .map(|_| sampler.next_batch().positions.len())
            .collect();
        (dataset.len(), sizes)
    };
    assert_eq!(batches(&config(-1, None)), (30, vec![30]));
    assert_eq!(batches(&config(-1, Some(8))), (30, vec![8, 8, 8, 6]));
    assert_eq!(batches(&config(10, Some(8))), (10, vec![8, 2]));
}

#[test]
fn sampling_a_real_file_resumes_exactly_at_an_epoch_boundary() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("train.parquet");
    write_verl(&path, 50, 0);
    let config = DataConfig {
        train_files: [path].into_iter().collect(),
        train_batch_size: 16,
        seed: 3,
        ..DataConfig::default()
    };
    let dataset = PromptDataset::open(&config, Split::Train, None).unwrap();
    let mut reference = dataset.train_sampler(&config).unwrap();
    assert_eq!(reference.batches_per_epoch(), 3);
    let mut seen = Vec::new();
    for _ in 0..3 {
        seen.extend(reference.next_batch().positions);
    }
    // Saved at the end of epoch 0: 48 distinct rows seen, 2 dropped with the last partial batch.
    let saved = serde_json::to_string(&reference.state()).unwrap();
    seen.sort_unstable();
    seen.dedup();
    assert_eq!(seen.len(), 48);
    let mut resumed: Sampler = dataset.train_sampler(&config).unwrap();
    resumed.restore(serde_json::from_str(&saved).unwrap()).unwrap();
    for _ in 0..4 {
        let (expected, got) = (reference.next_batch(), resumed.next_batch());
        assert_eq!(expected, got);
        assert_eq!(got.epoch, 1);
        let prompts: Vec<_> = dataset.read(&got.positions).unwrap();
        assert_eq!(prompts.len(), 16);
        if got.offset == 32 {
            break;
        }
    }
}

#[test]
fn bad_inputs_give_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let show = |path: &Path| path.display().to_string();

    // A missing file.
    let missing = dir.path().join("missing.parquet");
    let error = open(std::slice::from_ref(&missing)).unwrap_err();
    assert!(
        error.to_string().starts_with(&format!(
            "cannot open {}: No such file or directory",
            show(&missing)
        )),
        "{error}"
    );

    // A file that is not Parquet, and a Parquet file cut short.
    let corrupt = dir.path().join("corrupt.parquet");
    std::fs::write(&corrupt, b"question,answer\n1+1,2\n").unwrap();
    let error = open(std::slice::from_ref(&corrupt)).unwrap_err();
    assert!(
        error
            .to_string()
            .starts_with(&format!("{} is not a readable Parquet file:", show(&corrupt))),
        "{error}"
    );
    let good = dir.path().join("good.parquet");
    write_verl(&good, 20, 0);
    let bytes = std::fs::read(&good).unwrap();
    let truncated = dir.path().join("truncated.parquet");
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    assert!(matches!(
        open(std::slice::from_ref(&truncated)).unwrap_err(),
        DataError::Corrupt { .. }
    ));

    // Damaged data pages behind an intact footer: reported when the row group is decoded.
    let mut damaged = bytes.clone();
    for byte in &mut damaged[8..bytes.len() / 3] {
        *byte = 0xAB;
    }
    let damaged_path = dir.path().join("damaged.parquet");
    std::fs::write(&damaged_path, &damaged).unwrap();
    let dataset = open(std::slice::from_ref(&damaged_path)).unwrap();
    let error = dataset.read(&[3]).unwrap_err();
    assert!(
        error.to_string().starts_with(&format!(
            "{}: reading row group 0 (rows 0..20) failed:",
            show(&damaged_path)
        )),
        "{error}"
    );

    // A prompt column of the wrong type.
    let wrong_type = dir.path().join("wrong_type.parquet");
    let batch = RecordBatch::try_from_iter(vec![(
        "prompt",
        Arc::new(Int64Array::from(vec![1, 2])) as ArrayRef,
    )])
    .unwrap();
    write_batch(&wrong_type, &batch);
    let error = open(std::slice::from_ref(&wrong_type)).unwrap_err();
    assert_eq!(
        error.to_string(),
        format!(
            "{}: column `prompt` has type Int64; expected a string (plain-text prompt) or a \
             list of structs with string fields `role` and `content` (chat messages)",
            show(&wrong_type)
        )
    );

    // A data_source column that is not a string.
    let bad_source = dir.path().join("bad_source.parquet");
    let batch = RecordBatch::try_from_iter(vec![
        ("prompt", Arc::new(StringArray::from(vec!["a"])) as ArrayRef),
        ("data_source", Arc::new(Int64Array::from(vec![7])) as ArrayRef),
    ])
    .unwrap();
    write_batch(&bad_source, &batch);
    let error = open(std::slice::from_ref(&bad_source)).unwrap_err();
    assert_eq!(
        error.to_string(),
        format!(
            "{}: column `data_source` has type Int64; expected a string naming the scorer \
             (e.g. \"openai/gsm8k\")",
            show(&bad_source)
        )
    );

    // An empty dataset.
    let empty = dir.path().join("empty.parquet");
    let schema = Arc::new(Schema::new(vec![Field::new("prompt", DataType::Utf8, true)]));
    write_batch(&empty, &RecordBatch::new_empty(schema));
    let error = open(std::slice::from_ref(&empty)).unwrap_err();
    assert_eq!(
        error.to_string(),
        format!("the dataset {} is empty: the files have no rows", show(&empty))
    );
    let error = PromptDataset::open(&DataConfig::default(), Split::Train, None).unwrap_err();
    assert_eq!(
        error.to_string(),
        "no data files given for `data.train_files`: set it to a Parquet file or a list of them"
    );

    // A row with an empty prompt, found both by random access and by streaming.
    let empty_prompt = dir.path().join("empty_prompt.parquet");
    let batch = RecordBatch::try_from_iter(vec![(
        "prompt",
        Arc::new(StringArray::from(vec![
            Some("fine"),
            Some("also fine"),
            Some("   "),
            None,
        ])) as ArrayRef,
    )])
    .unwrap();
    write_batch(&empty_prompt, &batch);
    let dataset = open(std::slice::from_ref(&empty_prompt)).unwrap();
    let expected = format!(
        "{}: row 2, column `prompt`: the prompt is empty; every row needs a non-empty prompt",
        show(&empty_prompt)
    );
    assert_eq!(dataset.read(&[0, 2]).unwrap_err().to_string(), expected);
    let streamed: Vec<_> = dataset.iter().collect();
    assert_eq!(streamed.len(), 3, "streaming stops at the first error");
    assert_eq!(streamed[2].as_ref().unwrap_err().to_string(), expected);

    // The same within one row group: the rows before the bad one still come out first.
    let one_group = dir.path().join("one_group.parquet");
    let file = std::fs::File::create(&one_group).unwrap();
    let mut writer = ArrowWriter::try_new(file, batch.schema(), None).unwrap();
    writer.write(&batch).unwrap();
    writer.close().unwrap();
    let single_group = open(std::slice::from_ref(&one_group)).unwrap();
    assert_eq!(single_group.row_groups().len(), 1);
    let streamed: Vec<_> = single_group.iter().collect();
    assert_eq!(streamed.len(), 3);
    assert_eq!(
        streamed[1].as_ref().unwrap().prompt,
        Prompt::Text("also fine".into())
    );
    assert!(streamed[2]
        .as_ref()
        .unwrap_err()
        .to_string()
        .contains("row 2, column `prompt`"));
    assert_eq!(
        dataset.get(3).unwrap_err().to_string(),
        format!(
            "{}: row 3, column `prompt`: the prompt is null; every row needs a prompt (drop \
             the row or fill it in)",
            show(&empty_prompt)
        )
    );
}
