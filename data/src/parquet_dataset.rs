//! Parquet files as one row-addressable dataset, read a row group at a time.
//!
//! Opening reads only each file's footer: the schema (checked once, so a missing or mistyped
//! column is reported before training starts) and the row count of every row group. The result
//! is an index of (file, row group, first row, row count). Rows are decoded on demand by their
//! global index (file 0's rows first, then file 1's, ...): [`ParquetDataset::read`] decodes only
//! the row groups that hold the requested rows, keeping recently decoded row groups in a cache of
//! bounded size (shuffled batches revisit them), or, for row groups too large to cache, decoding
//! only the requested rows with a row selection; [`ParquetDataset::iter`] streams every row in
//! order, one record batch at a time. Memory use is bounded by the cache budget plus one row
//! group's column chunks, whatever the files' total size.

use std::collections::VecDeque;
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use arrow_array::{Array, RecordBatch};
use arrow_schema::Schema;
use parquet::arrow::arrow_reader::{
    ArrowReaderMetadata, ArrowReaderOptions, ParquetRecordBatchReader, ParquetRecordBatchReaderBuilder,
    RowSelection,
};
use parquet::arrow::ProjectionMask;
use serde_json::{Map, Value};

use crate::columns::{check_json_type, check_prompt_type, JsonColumn, PromptColumn, PROMPT_TYPES};
use crate::error::{DataError, Result};
use crate::example::{Example, Prompt};

/// Rows per record batch when streaming.
const STREAM_BATCH_ROWS: usize = 1024;

/// Which columns play which part.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ColumnNames {
    /// The prompt column (`data.prompt_key`).
    pub prompt: String,
    /// The scorer-selecting column (`data.reward_fn_key`).
    pub data_source: String,
}

impl Default for ColumnNames {
    fn default() -> Self {
        Self {
            prompt: "prompt".into(),
            data_source: "data_source".into(),
        }
    }
}

/// One row group in the dataset's index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowGroupInfo {
    /// Index of the file in [`ParquetDataset::files`].
    pub file: usize,
    /// The row group within the file.
    pub row_group: usize,
    /// Global index of the row group's first row.
    pub first_index: u64,
    /// The row group's first row within its file.
    pub first_row_in_file: u64,
    /// Number of rows.
    pub rows: u64,
}

impl RowGroupInfo {
    fn global_range(&self) -> Range<u64> {
        self.first_index..self.first_index + self.rows
    }
}

struct DataFile {
    path: Arc<Path>,
    metadata: ArrowReaderMetadata,
    prompt_column: usize,
}

/// Several Parquet files read as one dataset (see the module documentation).
pub struct ParquetDataset {
    files: Vec<DataFile>,
    row_groups: Vec<RowGroupInfo>,
    len: u64,
    names: ColumnNames,
    cache: Mutex<RowGroupCache>,
}

/// Default memory budget of decoded row groups kept for random access.
pub const DEFAULT_CACHE_BYTES: usize = 256 << 20;

/// Decoded row groups kept for [`ParquetDataset::read`], least recently used first out, within a
/// byte budget. Shuffled batches touch many row groups; without the cache each batch would decode
/// each of them again.
#[derive(Default)]
struct RowGroupCache {
    budget: usize,
    used: usize,
    /// (row group, its record batches, their memory size), most recently used last.
    entries: VecDeque<(usize, Arc<Vec<RecordBatch>>, usize)>,
}

impl RowGroupCache {
    fn get(&mut self, group: usize) -> Option<Arc<Vec<RecordBatch>>> {
        let position = self.entries.iter().position(|(g, _, _)| *g == group)?;
        let entry = self.entries.remove(position).expect("position is in range");
        let batches = Arc::clone(&entry.1);
        self.entries.push_back(entry);
        Some(batches)
    }

    fn insert(&mut self, group: usize, batches: Arc<Vec<RecordBatch>>) {
        let bytes: usize = batches.iter().map(RecordBatch::get_array_memory_size).sum();
        if bytes > self.budget {
            return;
        }
        while self.used + bytes > self.budget {
            let (_, _, freed) = self.entries.pop_front().expect("used > 0 means entries exist");
            self.used -= freed;
        }
        self.used += bytes;
        self.entries.push_back((group, batches, bytes));
    }
}

impl std::fmt::Debug for ParquetDataset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParquetDataset")
            .field("files", &self.files().collect::<Vec<_>>())
            .field("rows", &self.len)
            .field("row_groups", &self.row_groups.len())
            .finish()
    }
}

fn column_list(schema: &Schema) -> String {
    schema
        .fields()
        .iter()
        .map(|field| field.name().as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

fn open_file(path: &Path, names: &ColumnNames) -> Result<DataFile> {
    let file = File::open(path).map_err(|source| DataError::Open {
        path: path.to_owned(),
        source,
    })?;
    let metadata =
        ArrowReaderMetadata::load(&file, ArrowReaderOptions::new()).map_err(|source| DataError::Corrupt {
            path: path.to_owned(),
            source,
        })?;
    let schema = metadata.schema().clone();
    let prompt_column = schema
        .index_of(&names.prompt)
        .map_err(|_| DataError::MissingColumn {
            path: path.to_owned(),
            column: names.prompt.clone(),
            available: column_list(&schema),
            hint: "; set data.prompt_key to the column that holds the prompts",
        })?;
    for (index, field) in schema.fields().iter().enumerate() {
        let checked = if index == prompt_column {
            check_prompt_type(field.data_type()).map_err(|found| (found, PROMPT_TYPES.to_owned()))
        } else if field.name() == &names.data_source {
            if crate::columns::is_string_column_type(field.data_type()) {
                Ok(())
            } else {
                Err((
                    field.data_type().to_string(),
                    "a string naming the scorer (e.g. \"openai/gsm8k\")".to_owned(),
                ))
            }
        } else {
            check_json_type(field.data_type())
                .map_err(|found| (found, "a type with a JSON conversion".to_owned()))
        };
        if let Err((found, expected)) = checked {
            return Err(DataError::ColumnType {
                path: path.to_owned(),
                column: field.name().clone(),
                found,
                expected,
            });
        }
    }
    Ok(DataFile {
        path: Arc::from(path),
        metadata,
        prompt_column,
    })
}

impl ParquetDataset {
    /// Opens `paths` (read in that order) and indexes their row groups. Fails, naming the file
    /// and column, on a missing or unreadable file, a missing prompt column or a column of an
    /// unusable type, and when the files hold no rows at all.
    pub fn open(paths: &[PathBuf], names: ColumnNames) -> Result<Self> {
        let mut files = Vec::with_capacity(paths.len());
        let mut row_groups = Vec::new();
        let mut len = 0u64;
        for (file_index, path) in paths.iter().enumerate() {
            let file = guarded(path, || open_file(path, &names))?;
            let mut first_row_in_file = 0u64;
            for (row_group, info) in file.metadata.metadata().row_groups().iter().enumerate() {
                let rows = info.num_rows().max(0) as u64;
                if rows > 0 {
                    row_groups.push(RowGroupInfo {
                        file: file_index,
                        row_group,
                        first_index: len,
                        first_row_in_file,
                        rows,
                    });
                }
                len += rows;
                first_row_in_file += rows;
            }
            if first_row_in_file == 0 {
                tracing::warn!(file = %path.display(), "data file has no rows");
            }
            files.push(file);
        }
        if files.is_empty() {
            return Err(DataError::Empty {
                files: "[]".into(),
                detail: "no files were given".into(),
            });
        }
        if len == 0 {
            return Err(DataError::Empty {
                files: paths
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
                detail: "the files have no rows".into(),
            });
        }
        Ok(Self {
            files,
            row_groups,
            len,
            names,
            cache: Mutex::new(RowGroupCache {
                budget: DEFAULT_CACHE_BYTES,
                ..RowGroupCache::default()
            }),
        })
    }

    /// Sets the memory budget of decoded row groups kept for [`ParquetDataset::read`] (default
    /// [`DEFAULT_CACHE_BYTES`]). Row groups whose uncompressed size exceeds a quarter of the
    /// budget are never cached: reads decode only the requested rows of them instead. 0 turns
    /// the cache off.
    pub fn with_cache_bytes(self, bytes: usize) -> Self {
        *self.cache.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = RowGroupCache {
            budget: bytes,
            ..RowGroupCache::default()
        };
        self
    }

    /// Number of rows over all files.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Always false: opening fails on an empty dataset.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The files, in the order their rows are numbered.
    pub fn files(&self) -> impl Iterator<Item = &Path> + '_ {
        self.files.iter().map(|file| file.path.as_ref())
    }

    /// The index of row groups (empty row groups are left out).
    pub fn row_groups(&self) -> &[RowGroupInfo] {
        &self.row_groups
    }

    /// The column names in use.
    pub fn column_names(&self) -> &ColumnNames {
        &self.names
    }

    /// Where global row `index` lives: (file path, row within the file).
    pub fn locate(&self, index: u64) -> Result<(&Path, u64)> {
        let group = self.group_of(index)?;
        let info = &self.row_groups[group];
        Ok((
            &self.files[info.file].path,
            info.first_row_in_file + (index - info.first_index),
        ))
    }

    fn group_of(&self, index: u64) -> Result<usize> {
        if index >= self.len {
            return Err(DataError::IndexOutOfRange { index, len: self.len });
        }
        Ok(self
            .row_groups
            .partition_point(|group| group.first_index + group.rows <= index))
    }

    /// One row.
    pub fn get(&self, index: u64) -> Result<Example> {
        Ok(self.read(&[index])?.remove(0))
    }

    /// The rows at `indices`, in that order (repeats allowed). Each row group involved is
    /// decoded once: whole, and kept in the cache, when it is small enough; otherwise only the
    /// requested rows (a row selection).
    pub fn read(&self, indices: &[u64]) -> Result<Vec<Example>> {
        let mut wanted: Vec<(u64, usize)> = indices
            .iter()
            .enumerate()
            .map(|(slot, &index)| (index, slot))
            .collect();
        wanted.sort_unstable();
        if let Some(&(last, _)) = wanted.last() {
            if last >= self.len {
                return Err(DataError::IndexOutOfRange {
                    index: last,
                    len: self.len,
                });
            }
        }
        let mut out: Vec<Option<Example>> = vec![None; indices.len()];
        let mut start = 0;
        while start < wanted.len() {
            let group = self.group_of(wanted[start].0)?;
            let info = &self.row_groups[group];
            let range = info.global_range();
            let end = start + wanted[start..].partition_point(|(index, _)| range.contains(index));
            let mut offsets: Vec<usize> = wanted[start..end]
                .iter()
                .map(|(index, _)| (index - info.first_index) as usize)
                .collect();
            offsets.dedup();
            let path = self.files[info.file].path.clone();
            let decoded = guarded(&path, || match self.cached_group(group)? {
                Some(batches) => self.rows_from_batches(group, &batches, &offsets),
                None => self.rows_by_selection(group, &offsets),
            })?;
            for &(index, slot) in &wanted[start..end] {
                let position = offsets
                    .binary_search(&((index - info.first_index) as usize))
                    .expect("every wanted row was decoded");
                out[slot] = Some(decoded[position].clone());
            }
            start = end;
        }
        Ok(out
            .into_iter()
            .map(|example| example.expect("every slot filled"))
            .collect())
    }

    /// The whole decoded row group from the cache, decoding and caching it on a miss; `None`
    /// when the group is too large to cache.
    fn cached_group(&self, group: usize) -> Result<Option<Arc<Vec<RecordBatch>>>> {
        let info = &self.row_groups[group];
        let file = &self.files[info.file];
        let size = file
            .metadata
            .metadata()
            .row_group(info.row_group)
            .total_byte_size()
            .max(0) as usize;
        let mut cache = self.cache.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if size > cache.budget / 4 {
            return Ok(None);
        }
        if let Some(batches) = cache.get(group) {
            return Ok(Some(batches));
        }
        drop(cache);
        let reader = self.reader(group, None, ProjectionMask::all(), STREAM_BATCH_ROWS)?;
        let batches = reader
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|source| self.read_error(group, source.into()))?;
        let batches = Arc::new(batches);
        self.cache
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .insert(group, Arc::clone(&batches));
        Ok(Some(batches))
    }

    /// Converts the rows at sorted `offsets` of a fully decoded row group.
    fn rows_from_batches(
        &self,
        group: usize,
        batches: &[RecordBatch],
        offsets: &[usize],
    ) -> Result<Vec<Example>> {
        let info = &self.row_groups[group];
        let path = &self.files[info.file].path;
        let mut decoded = Vec::with_capacity(offsets.len());
        let mut batch_start = 0usize;
        let mut next = 0usize;
        for batch in batches {
            let batch_end = batch_start + batch.num_rows();
            if next < offsets.len() && offsets[next] < batch_end {
                let rows = BatchRows::new(batch, &self.names, path)?;
                while next < offsets.len() && offsets[next] < batch_end {
                    let offset = offsets[next];
                    decoded.push(rows.example(
                        offset - batch_start,
                        info.first_index + offset as u64,
                        info.first_row_in_file + offset as u64,
                    )?);
                    next += 1;
                }
            }
            batch_start = batch_end;
        }
        if decoded.len() != offsets.len() {
            return Err(self.read_error(
                group,
                format!(
                    "the row group holds {batch_start} rows, not the {} its metadata says",
                    info.rows
                )
                .into(),
            ));
        }
        Ok(decoded)
    }

    /// Decodes only the rows at sorted `offsets` of a row group.
    fn rows_by_selection(&self, group: usize, offsets: &[usize]) -> Result<Vec<Example>> {
        let info = &self.row_groups[group];
        let selection = RowSelection::from_consecutive_ranges(
            offsets.iter().map(|&offset| offset..offset + 1),
            info.rows as usize,
        );
        let reader = self.reader(group, Some(selection), ProjectionMask::all(), offsets.len())?;
        let mut decoded = Vec::with_capacity(offsets.len());
        for batch in reader {
            let batch = batch.map_err(|source| self.read_error(group, source.into()))?;
            let rows = BatchRows::new(&batch, &self.names, &self.files[info.file].path)?;
            for row in 0..batch.num_rows() {
                let offset = *offsets.get(decoded.len()).ok_or_else(|| {
                    self.read_error(group, "the row group returned more rows than selected".into())
                })? as u64;
                decoded.push(rows.example(
                    row,
                    info.first_index + offset,
                    info.first_row_in_file + offset,
                )?);
            }
        }
        if decoded.len() != offsets.len() {
            return Err(self.read_error(
                group,
                format!(
                    "the row group returned {} of the {} rows selected",
                    decoded.len(),
                    offsets.len()
                )
                .into(),
            ));
        }
        Ok(decoded)
    }

    /// Streams every row in order.
    pub fn iter(&self) -> Examples<'_> {
        Examples {
            dataset: self,
            next_group: 0,
            reader: None,
            buffered: VecDeque::new(),
            stopped: false,
        }
    }

    /// Streams only the prompt column, calling `visit(global index, file, row in file, prompt)`
    /// for every row in order; used to filter prompts without decoding the other columns.
    pub fn for_each_prompt(
        &self,
        mut visit: impl FnMut(u64, &Path, u64, Prompt) -> Result<()>,
    ) -> Result<()> {
        for (group, info) in self.row_groups.iter().enumerate() {
            let file = &self.files[info.file];
            let mask = ProjectionMask::roots(file.metadata.parquet_schema(), [file.prompt_column]);
            let reader = self.reader(group, None, mask, STREAM_BATCH_ROWS)?;
            let mut offset = 0u64;
            for batch in reader {
                let batch = batch.map_err(|source| self.read_error(group, source.into()))?;
                let column = batch.column(0);
                let prompts = PromptColumn::new(column.as_ref())
                    .expect("the prompt column type was checked when the file was opened");
                for row in 0..batch.num_rows() {
                    let file_row = info.first_row_in_file + offset;
                    let prompt = prompts
                        .prompt(row)
                        .map_err(|problem| self.bad_prompt(&file.path, file_row, problem))?;
                    visit(info.first_index + offset, &file.path, file_row, prompt)?;
                    offset += 1;
                }
            }
        }
        Ok(())
    }

    fn bad_prompt(&self, path: &Path, row: u64, problem: String) -> DataError {
        DataError::BadValue {
            path: path.to_owned(),
            row,
            column: self.names.prompt.clone(),
            problem,
        }
    }

    fn reader(
        &self,
        group: usize,
        selection: Option<RowSelection>,
        projection: ProjectionMask,
        batch_rows: usize,
    ) -> Result<ParquetRecordBatchReader> {
        let info = &self.row_groups[group];
        let file = &self.files[info.file];
        let handle = File::open(&file.path).map_err(|source| DataError::Open {
            path: file.path.to_path_buf(),
            source,
        })?;
        let mut builder = ParquetRecordBatchReaderBuilder::new_with_metadata(handle, file.metadata.clone())
            .with_row_groups(vec![info.row_group])
            .with_projection(projection)
            .with_batch_size(batch_rows.max(1));
        if let Some(selection) = selection {
            builder = builder.with_row_selection(selection);
        }
        builder
            .build()
            .map_err(|source| self.read_error(group, source.into()))
    }

    fn read_error(&self, group: usize, source: Box<dyn std::error::Error + Send + Sync>) -> DataError {
        let info = &self.row_groups[group];
        DataError::ReadRowGroup {
            path: self.files[info.file].path.to_path_buf(),
            row_group: info.row_group,
            first_row: info.first_row_in_file,
            end_row: info.first_row_in_file + info.rows,
            source,
        }
    }
}

/// Streaming iterator over all rows of a [`ParquetDataset`] (from [`ParquetDataset::iter`]).
/// Holds at most one record batch of decoded rows. After an error it yields nothing more.
pub struct Examples<'a> {
    dataset: &'a ParquetDataset,
    next_group: usize,
    reader: Option<(usize, u64, ParquetRecordBatchReader)>,
    /// Decoded rows not yet returned; an error ends the stream after the rows before it.
    buffered: VecDeque<Result<Example>>,
    stopped: bool,
}

impl Examples<'_> {
    /// Decodes the next record batch into `buffered`; `Err` when reading fails.
    fn fill(&mut self) -> Result<()> {
        while self.buffered.is_empty() {
            if self.reader.is_none() {
                if self.next_group >= self.dataset.row_groups.len() {
                    return Ok(());
                }
                let group = self.next_group;
                self.next_group += 1;
                let reader = self
                    .dataset
                    .reader(group, None, ProjectionMask::all(), STREAM_BATCH_ROWS)?;
                self.reader = Some((group, 0, reader));
            }
            let (group, offset, reader) = self.reader.as_mut().expect("reader set above");
            let Some(batch) = reader.next() else {
                self.reader = None;
                continue;
            };
            let group = *group;
            let batch = batch.map_err(|e| self.dataset.read_error(group, e.into()))?;
            let info = &self.dataset.row_groups[group];
            let rows = BatchRows::new(&batch, &self.dataset.names, &self.dataset.files[info.file].path)?;
            for row in 0..batch.num_rows() {
                let within = *offset + row as u64;
                let example = rows.example(row, info.first_index + within, info.first_row_in_file + within);
                let failed = example.is_err();
                self.buffered.push_back(example);
                if failed {
                    self.stopped = true;
                    break;
                }
            }
            *offset += batch.num_rows() as u64;
        }
        Ok(())
    }
}

impl Iterator for Examples<'_> {
    type Item = Result<Example>;

    fn next(&mut self) -> Option<Self::Item> {
        if let Some(next) = self.buffered.pop_front() {
            return Some(next);
        }
        if self.stopped {
            return None;
        }
        if let Err(error) = self.fill() {
            self.stopped = true;
            return Some(Err(error));
        }
        self.buffered.pop_front()
    }
}

/// One record batch prepared for row-by-row conversion to [`Example`]s.
struct BatchRows<'a> {
    path: &'a Arc<Path>,
    names: &'a ColumnNames,
    prompt: PromptColumn<'a>,
    others: Vec<(&'a str, JsonColumn<'a>)>,
}

impl<'a> BatchRows<'a> {
    fn new(batch: &'a RecordBatch, names: &'a ColumnNames, path: &'a Arc<Path>) -> Result<Self> {
        let schema: &'a Schema = batch.schema_ref();
        let mut prompt = None;
        let mut others = Vec::with_capacity(batch.num_columns());
        for (field, column) in schema.fields().iter().zip(batch.columns()) {
            let array: &'a dyn Array = column.as_ref();
            let type_error = |expected: &str| DataError::ColumnType {
                path: path.to_path_buf(),
                column: field.name().clone(),
                found: field.data_type().to_string(),
                expected: expected.to_owned(),
            };
            if field.name() == &names.prompt {
                prompt = Some(PromptColumn::new(array).ok_or_else(|| type_error(PROMPT_TYPES))?);
            } else {
                let json = JsonColumn::new(array).map_err(|_| type_error("a type with a JSON conversion"))?;
                others.push((field.name().as_str(), json));
            }
        }
        let prompt = prompt.ok_or_else(|| DataError::MissingColumn {
            path: path.to_path_buf(),
            column: names.prompt.clone(),
            available: column_list(schema),
            hint: "; set data.prompt_key to the column that holds the prompts",
        })?;
        Ok(Self {
            path,
            names,
            prompt,
            others,
        })
    }

    fn example(&self, row: usize, index: u64, file_row: u64) -> Result<Example> {
        let prompt = self.prompt.prompt(row).map_err(|problem| DataError::BadValue {
            path: self.path.to_path_buf(),
            row: file_row,
            column: self.names.prompt.clone(),
            problem,
        })?;
        let mut columns = Map::new();
        for (name, column) in &self.others {
            columns.insert((*name).to_owned(), column.value(row));
        }
        let text = |key: &str| columns.get(key).and_then(Value::as_str).map(str::to_owned);
        let data_source = text(&self.names.data_source);
        let ability = text("ability");
        let ground_truth = columns
            .get("reward_model")
            .and_then(|reward_model| reward_model.get("ground_truth"))
            .filter(|value| !value.is_null())
            .or_else(|| columns.get("ground_truth").filter(|value| !value.is_null()))
            .cloned();
        Ok(Example {
            index,
            file: Arc::clone(self.path),
            row: file_row,
            prompt,
            data_source,
            ability,
            ground_truth,
            columns,
        })
    }
}

/// Runs a call into the `parquet` crate, turning a panic into [`DataError::Corrupt`] for `path`:
/// the crate asserts on some malformed metadata (negative column offsets, for one) instead of
/// returning an error, and a damaged file must not take the run down.
fn guarded<T>(path: &Path, f: impl FnOnce() -> Result<T>) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|panic| {
        let what = panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        Err(DataError::Corrupt {
            path: path.to_path_buf(),
            source: parquet::errors::ParquetError::General(format!(
                "the Parquet reader failed on it: {what}"
            )),
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::{ArrayRef, Int64Array};

    fn batch(rows: i64) -> Arc<Vec<RecordBatch>> {
        let column: ArrayRef = Arc::new(Int64Array::from_iter_values(0..rows));
        Arc::new(vec![RecordBatch::try_from_iter(vec![("n", column)]).unwrap()])
    }

    #[test]
    fn cache_evicts_least_recently_used_within_budget() {
        let one = batch(1000);
        let size = one[0].get_array_memory_size();
        let mut cache = RowGroupCache {
            budget: 2 * size,
            ..RowGroupCache::default()
        };
        cache.insert(0, Arc::clone(&one));
        cache.insert(1, batch(1000));
        assert!(cache.get(0).is_some(), "0 is now the most recently used");
        cache.insert(2, batch(1000));
        assert!(cache.get(1).is_none(), "1 was evicted");
        assert!(cache.get(0).is_some() && cache.get(2).is_some());
        assert_eq!(cache.used, 2 * size);
        cache.insert(3, batch(10_000));
        assert!(cache.get(3).is_none(), "larger than the whole budget: not cached");
        assert_eq!(cache.entries.len(), 2);
    }
}
