//! Preprocessors that turn raw tasks into VeRL-schema Parquet files, and the writer they share.
//!
//! The schema written is exactly what VeRL's `examples/data_preprocess/*.py` produce through
//! Hugging Face `datasets` (checked column by column against VeRL's GSM8K script in the tests):
//!
//! ```text
//! data_source: string
//! prompt: list<element: struct<role: string, content: string>>
//! ability: string
//! reward_model: struct<style: string, ground_truth: string>
//! extra_info: struct<...task-specific fields...>
//! ```
//!
//! Files are Snappy-compressed (as pyarrow and `datasets` write them) in row groups of
//! [`ROWS_PER_ROW_GROUP`] rows, written to a temporary name and renamed when complete, so a
//! failed run never leaves a half-written file behind.

pub mod arithmetic;
pub mod gsm8k;

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::{ArrayRef, Int64Array, ListArray, RecordBatch, StringArray, StructArray};
use arrow_buffer::OffsetBuffer;
use arrow_schema::{DataType, Field, Fields, Schema, SchemaRef};
use parquet::arrow::ArrowWriter;
use parquet::basic::Compression;
use parquet::file::properties::WriterProperties;

use crate::error::{DataError, Result};
use crate::example::Message;

/// Rows per Parquet row group in files this crate writes (small enough that readers stream).
pub const ROWS_PER_ROW_GROUP: usize = 1024;

/// The type of one `extra_info` field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExtraType {
    /// A string.
    Text,
    /// A 64-bit integer.
    Int,
}

/// One `extra_info` value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExtraValue {
    /// A string.
    Text(String),
    /// A 64-bit integer.
    Int(i64),
}

/// One row in VeRL's schema.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerlRecord {
    /// Selects the scorer (`openai/gsm8k`, `grpo/arithmetic`, ...).
    pub data_source: String,
    /// The chat messages.
    pub prompt: Vec<Message>,
    /// The task family (`math`).
    pub ability: String,
    /// `reward_model.style` (`rule`).
    pub style: String,
    /// `reward_model.ground_truth`.
    pub ground_truth: String,
    /// `extra_info` values, in the order of the writer's `extra_info` fields.
    pub extra_info: Vec<ExtraValue>,
}

/// What a preprocessor wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteReport {
    /// The output file.
    pub path: PathBuf,
    /// Rows written.
    pub rows: u64,
    /// Row groups written.
    pub row_groups: usize,
}

/// Writes [`VerlRecord`]s to a Parquet file in batches.
pub struct VerlWriter {
    path: PathBuf,
    temporary: PartialFile,
    schema: SchemaRef,
    extra_fields: Vec<(String, ExtraType)>,
    writer: ArrowWriter<File>,
    rows: u64,
}

fn write_error(path: &Path, source: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> DataError {
    DataError::Write {
        path: path.to_owned(),
        source: source.into(),
    }
}

fn message_fields() -> Fields {
    Fields::from(vec![
        Field::new("role", DataType::Utf8, true),
        Field::new("content", DataType::Utf8, true),
    ])
}

fn reward_model_fields() -> Fields {
    Fields::from(vec![
        Field::new("style", DataType::Utf8, true),
        Field::new("ground_truth", DataType::Utf8, true),
    ])
}

impl VerlWriter {
    /// Creates `path` (through a temporary file beside it) with `extra_info` holding `fields`.
    pub fn create(path: &Path, extra_fields: &[(&str, ExtraType)]) -> Result<Self> {
        let extra: Fields = extra_fields
            .iter()
            .map(|(name, kind)| {
                let data_type = match kind {
                    ExtraType::Text => DataType::Utf8,
                    ExtraType::Int => DataType::Int64,
                };
                Field::new(*name, data_type, true)
            })
            .collect();
        let schema = Arc::new(Schema::new(vec![
            Field::new("data_source", DataType::Utf8, true),
            Field::new(
                "prompt",
                DataType::List(Arc::new(Field::new(
                    "element",
                    DataType::Struct(message_fields()),
                    true,
                ))),
                true,
            ),
            Field::new("ability", DataType::Utf8, true),
            Field::new("reward_model", DataType::Struct(reward_model_fields()), true),
            Field::new("extra_info", DataType::Struct(extra), true),
        ]));
        let file_name = path
            .file_name()
            .ok_or_else(|| write_error(path, "the output path names no file"))?;
        let mut temporary_name = std::ffi::OsString::from(".");
        temporary_name.push(file_name);
        temporary_name.push(".partial");
        let temporary = path.with_file_name(temporary_name);
        // Missing folders are made, as cargo and git make theirs.
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|e| write_error(path, e))?;
        }
        let file = File::create(&temporary).map_err(|e| write_error(path, e))?;
        let properties = WriterProperties::builder()
            .set_compression(Compression::SNAPPY)
            .set_max_row_group_row_count(Some(ROWS_PER_ROW_GROUP))
            .build();
        let writer = ArrowWriter::try_new(file, Arc::clone(&schema), Some(properties))
            .map_err(|e| write_error(path, e))?;
        Ok(Self {
            path: path.to_owned(),
            temporary: PartialFile(temporary),
            schema,
            extra_fields: extra_fields
                .iter()
                .map(|(name, kind)| ((*name).to_owned(), *kind))
                .collect(),
            writer,
            rows: 0,
        })
    }

    /// Appends `records` (each with one `extra_info` value per field, of the field's type).
    pub fn write(&mut self, records: &[VerlRecord]) -> Result<()> {
        if records.is_empty() {
            return Ok(());
        }
        let batch = self.batch(records)?;
        self.writer
            .write(&batch)
            .map_err(|e| write_error(&self.path, e))?;
        self.rows += records.len() as u64;
        Ok(())
    }

    fn batch(&self, records: &[VerlRecord]) -> Result<RecordBatch> {
        let strings = |get: &dyn Fn(&VerlRecord) -> &str| -> ArrayRef {
            Arc::new(StringArray::from_iter_values(records.iter().map(get)))
        };
        let messages = records.iter().flat_map(|r| r.prompt.iter());
        let roles = StringArray::from_iter_values(messages.clone().map(|m| m.role.as_str()));
        let contents = StringArray::from_iter_values(messages.map(|m| m.content.as_str()));
        let message_structs = StructArray::new(
            message_fields(),
            vec![Arc::new(roles) as ArrayRef, Arc::new(contents)],
            None,
        );
        let prompt = ListArray::new(
            Arc::new(Field::new("element", DataType::Struct(message_fields()), true)),
            OffsetBuffer::from_lengths(records.iter().map(|r| r.prompt.len())),
            Arc::new(message_structs),
            None,
        );
        let reward_model = StructArray::new(
            reward_model_fields(),
            vec![strings(&|r| &r.style), strings(&|r| &r.ground_truth)],
            None,
        );
        let mut extra_columns: Vec<ArrayRef> = Vec::with_capacity(self.extra_fields.len());
        for (position, (name, kind)) in self.extra_fields.iter().enumerate() {
            let mismatch = |row: usize| {
                write_error(
                    &self.path,
                    format!("record {row}: extra_info field `{name}` is missing or not of type {kind:?}"),
                )
            };
            let column: ArrayRef = match kind {
                ExtraType::Text => {
                    let mut values = Vec::with_capacity(records.len());
                    for (row, record) in records.iter().enumerate() {
                        match record.extra_info.get(position) {
                            Some(ExtraValue::Text(text)) => values.push(text.as_str()),
                            _ => return Err(mismatch(row)),
                        }
                    }
                    Arc::new(StringArray::from(values))
                }
                ExtraType::Int => {
                    let mut values = Vec::with_capacity(records.len());
                    for (row, record) in records.iter().enumerate() {
                        match record.extra_info.get(position) {
                            Some(ExtraValue::Int(value)) => values.push(*value),
                            _ => return Err(mismatch(row)),
                        }
                    }
                    Arc::new(Int64Array::from(values))
                }
            };
            extra_columns.push(column);
        }
        let DataType::Struct(extra_fields) = self.schema.field(4).data_type().clone() else {
            unreachable!("extra_info is a struct by construction");
        };
        let extra_info = StructArray::new(extra_fields, extra_columns, None);
        RecordBatch::try_new(
            Arc::clone(&self.schema),
            vec![
                strings(&|r| &r.data_source),
                Arc::new(prompt),
                strings(&|r| &r.ability),
                Arc::new(reward_model),
                Arc::new(extra_info),
            ],
        )
        .map_err(|e| write_error(&self.path, e))
    }

    /// Finishes the file and moves it to its final name.
    pub fn finish(self) -> Result<WriteReport> {
        let metadata = self.writer.close().map_err(|e| write_error(&self.path, e))?;
        std::fs::rename(&self.temporary.0, &self.path).map_err(|e| write_error(&self.path, e))?;
        Ok(WriteReport {
            path: self.path,
            rows: self.rows,
            row_groups: metadata.num_row_groups(),
        })
    }
}

/// A file being written; removed when dropped unless it was renamed away first, so an error
/// never leaves a half-written file behind.
struct PartialFile(PathBuf);

impl Drop for PartialFile {
    fn drop(&mut self) {
        // After a successful rename the file is gone and removal fails harmlessly.
        let _ = std::fs::remove_file(&self.0);
    }
}
