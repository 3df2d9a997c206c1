//! GSM8K (`openai/grade-school-math` JSON lines: `question`, `answer`) to VeRL's Parquet schema,
//! exactly as VeRL's `examples/data_preprocess/gsm8k.py` does it:
//!
//! - `data_source`: `"openai/gsm8k"`;
//! - `prompt`: one user message, the question + `" "` + [`GSM8K_INSTRUCTION`];
//! - `ability`: `"math"`;
//! - `reward_model`: `{style: "rule", ground_truth}`, the ground truth being the first match of
//!   the regular expression `#### (\-?[0-9\.\,]+)` with commas removed ([`extract_solution`]);
//! - `extra_info`: `{split, index, answer, question}` with the raw answer and question and the
//!   row's 0-based index within the input.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::Path;

use serde_json::Value;

use crate::error::{DataError, Result};
use crate::example::Message;
use crate::preprocess::{ExtraType, ExtraValue, VerlRecord, VerlWriter, WriteReport, ROWS_PER_ROW_GROUP};

/// The `data_source` VeRL gives GSM8K rows (it selects the GSM8K scorer).
pub const GSM8K_DATA_SOURCE: &str = "openai/gsm8k";

/// The instruction VeRL appends to every GSM8K question (after one space).
pub const GSM8K_INSTRUCTION: &str = "Let's think step by step and output the final answer after \"####\".";

/// VeRL's `extract_solution`: the first `#### ` followed by an optional `-` and at least one of
/// `0-9 . ,` (greedy), returned without the commas. `None` when the answer has no such part
/// (VeRL's script asserts in that case).
pub fn extract_solution(answer: &str) -> Option<String> {
    let mut search_from = 0;
    while let Some(found) = answer[search_from..].find("#### ") {
        let marker = search_from + found;
        let rest = &answer[marker + "#### ".len()..];
        let unsigned = rest.strip_prefix('-').unwrap_or(rest);
        let number_len = unsigned
            .bytes()
            .take_while(|b| b.is_ascii_digit() || *b == b'.' || *b == b',')
            .count();
        if number_len > 0 {
            let sign_len = rest.len() - unsigned.len();
            return Some(rest[..sign_len + number_len].replace(',', ""));
        }
        search_from = marker + 1;
    }
    None
}

/// The VeRL record for one GSM8K question.
pub fn gsm8k_record(question: &str, answer: &str, split: &str, index: i64) -> Option<VerlRecord> {
    let ground_truth = extract_solution(answer)?;
    Some(VerlRecord {
        data_source: GSM8K_DATA_SOURCE.into(),
        prompt: vec![Message::new("user", format!("{question} {GSM8K_INSTRUCTION}"))],
        ability: "math".into(),
        style: "rule".into(),
        ground_truth,
        extra_info: vec![
            ExtraValue::Text(split.into()),
            ExtraValue::Int(index),
            ExtraValue::Text(answer.into()),
            ExtraValue::Text(question.into()),
        ],
    })
}

/// The `extra_info` fields of GSM8K rows, in VeRL's order.
pub const GSM8K_EXTRA_INFO: [(&str, ExtraType); 4] = [
    ("split", ExtraType::Text),
    ("index", ExtraType::Int),
    ("answer", ExtraType::Text),
    ("question", ExtraType::Text),
];

/// Converts the JSON-lines file `input` to VeRL-schema Parquet at `output`, tagging rows with
/// `split` (`train` or `test`). Blank lines are skipped; any other line must be a JSON object
/// with string `question` and `answer`, the answer holding a `#### <number>` final answer.
/// Other keys are ignored.
pub fn preprocess_gsm8k(input: &Path, output: &Path, split: &str) -> Result<WriteReport> {
    let file = File::open(input).map_err(|source| DataError::Open {
        path: input.to_owned(),
        source,
    })?;
    let mut writer = VerlWriter::create(output, &GSM8K_EXTRA_INFO)?;
    let mut pending = Vec::with_capacity(ROWS_PER_ROW_GROUP);
    let mut index = 0i64;
    for (line_index, line) in BufReader::new(file).lines().enumerate() {
        let line_number = line_index + 1;
        let line = line.map_err(|source| DataError::ReadInput {
            path: input.to_owned(),
            source,
        })?;
        if line.trim().is_empty() {
            continue;
        }
        let bad = |problem: String| DataError::JsonLine {
            path: input.to_owned(),
            line: line_number,
            problem,
        };
        let value: Value = serde_json::from_str(&line)
            .map_err(|e| bad(format!("not valid JSON ({e}); expected one object per line")))?;
        let field = |key: &str| -> Result<&str> {
            match value.get(key) {
                Some(Value::String(text)) => Ok(text),
                Some(other) => Err(bad(format!("`{key}` is {other}, expected a string"))),
                None => Err(bad(format!(
                    "no `{key}` key; GSM8K lines need `question` and `answer`"
                ))),
            }
        };
        let question = field("question")?;
        let answer = field("answer")?;
        let record = gsm8k_record(question, answer, split, index).ok_or_else(|| {
            bad(
                "the answer has no final answer `#### <number>`, which VeRL's preprocessing \
                 requires"
                    .into(),
            )
        })?;
        pending.push(record);
        index += 1;
        if pending.len() == ROWS_PER_ROW_GROUP {
            writer.write(&pending)?;
            pending.clear();
        }
    }
    writer.write(&pending)?;
    if index == 0 {
        return Err(DataError::Empty {
            files: input.display().to_string(),
            detail: "the input has no GSM8K lines".into(),
        });
    }
    writer.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extract_solution_matches_verls_regex() {
        let cases = [
            ("so 72\n#### 72", Some("72")),
            ("#### 1,234,567", Some("1234567")),
            ("#### -5", Some("-5")),
            ("#### 3.50 dollars", Some("3.50")),
            ("#### .5", Some(".5")),
            ("#### x\n#### 9", Some("9")),
            ("#### -x #### 4", Some("4")),
            ("##### 8", Some("8")),
            ("#### 12\n#### 13", Some("12")),
            ("#### $5", None),
            ("####5", None),
            ("no answer", None),
        ];
        for (answer, expected) in cases {
            assert_eq!(extract_solution(answer).as_deref(), expected, "{answer:?}");
        }
    }

    #[test]
    fn builds_verls_record() {
        let record = gsm8k_record("What is 2+3?", "2+3=5\n#### 5", "test", 4).unwrap();
        assert_eq!(record.data_source, "openai/gsm8k");
        assert_eq!(
            record.prompt,
            vec![Message::new(
                "user",
                "What is 2+3? Let's think step by step and output the final answer after \"####\"."
            )]
        );
        assert_eq!(record.ground_truth, "5");
        assert_eq!(
            record.extra_info,
            vec![
                ExtraValue::Text("test".into()),
                ExtraValue::Int(4),
                ExtraValue::Text("2+3=5\n#### 5".into()),
                ExtraValue::Text("What is 2+3?".into()),
            ]
        );
    }
}
