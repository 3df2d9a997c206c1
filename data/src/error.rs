//! The data crate's error type: every failure names the file, the row (0-based, as pandas and
//! pyarrow count) and the column where it happened, and says what to do about it.

use std::path::PathBuf;

/// An error from the tokenizer a caller supplies through [`crate::PromptTokenizer`].
pub type TokenizeError = Box<dyn std::error::Error + Send + Sync>;

/// Everything that can go wrong reading, filtering, sampling or writing datasets.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// No files were configured for a dataset.
    #[error("no data files given for `data.{key}`: set it to a Parquet file or a list of them")]
    NoFiles {
        /// The recipe key (`train_files` or `val_files`).
        key: &'static str,
    },

    /// A file could not be opened (missing, unreadable).
    #[error("cannot open {}: {source}; check the path (relative paths are resolved from the working directory)", path.display())]
    Open {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },

    /// A file exists but is not a readable Parquet file (truncated, corrupt, another format).
    #[error("{} is not a readable Parquet file: {source}; re-create it (e.g. with `grpo preprocess`) or check that it was copied completely", path.display())]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What the Parquet reader said.
        source: parquet::errors::ParquetError,
    },

    /// Decoding a row group failed after the file's footer was read successfully.
    #[error("{}: reading row group {row_group} (rows {first_row}..{end_row}) failed: {source}; the file is damaged", path.display())]
    ReadRowGroup {
        /// The file.
        path: PathBuf,
        /// The row group within the file.
        row_group: usize,
        /// First row (within the file) of the row group.
        first_row: u64,
        /// One past the last row of the row group.
        end_row: u64,
        /// What the Parquet or Arrow decoder said.
        source: Box<dyn std::error::Error + Send + Sync>,
    },

    /// A required column is absent.
    #[error("{}: column `{column}` is missing; the file has columns [{available}]{hint}", path.display())]
    MissingColumn {
        /// The file.
        path: PathBuf,
        /// The column looked for.
        column: String,
        /// The columns the file has, comma-separated.
        available: String,
        /// A suggestion of what to set.
        hint: &'static str,
    },

    /// A column has a type the reader cannot use.
    #[error("{}: column `{column}` has type {found}; expected {expected}", path.display())]
    ColumnType {
        /// The file.
        path: PathBuf,
        /// The column.
        column: String,
        /// The Arrow type found.
        found: String,
        /// What was expected.
        expected: String,
    },

    /// One value in one row is unusable (null or empty prompt, message without a role, ...).
    #[error("{}: row {row}, column `{column}`: {problem}", path.display())]
    BadValue {
        /// The file.
        path: PathBuf,
        /// The row within the file (0-based).
        row: u64,
        /// The column.
        column: String,
        /// What is wrong with the value and what to do.
        problem: String,
    },

    /// The dataset has no rows (before or after filtering).
    #[error("the dataset {files} is empty: {detail}")]
    Empty {
        /// The files, comma-separated.
        files: String,
        /// Why it is empty.
        detail: String,
    },

    /// A prompt is longer than `data.max_prompt_length` and `data.truncation` is `error`.
    #[error("{}: row {row}, column `{column}`: the prompt has {tokens} tokens, more than data.max_prompt_length = {max}; set data.filter_overlong_prompts: true to drop such rows, data.truncation: left|right|middle to cut them, or raise data.max_prompt_length", path.display())]
    PromptTooLong {
        /// The file.
        path: PathBuf,
        /// The row within the file (0-based).
        row: u64,
        /// The prompt column.
        column: String,
        /// The prompt's token count.
        tokens: usize,
        /// `data.max_prompt_length`.
        max: usize,
    },

    /// The caller's tokenizer failed on a prompt.
    #[error("{}: row {row}, column `{column}`: tokenizing the prompt failed: {source}", path.display())]
    Tokenize {
        /// The file.
        path: PathBuf,
        /// The row within the file (0-based).
        row: u64,
        /// The prompt column.
        column: String,
        /// The tokenizer's error.
        source: TokenizeError,
    },

    /// A position passed to the dataset is outside it.
    #[error("row {index} is out of range: the dataset has {len} rows")]
    IndexOutOfRange {
        /// The requested position.
        index: u64,
        /// The number of rows.
        len: u64,
    },

    /// A saved sampler state does not fit the dataset or sampler it is restored into.
    #[error("cannot restore the data sampler: {0}")]
    SamplerState(String),

    /// An option has an invalid value.
    #[error("invalid option `{option}`: {problem}")]
    InvalidOption {
        /// The option (recipe key or command-line flag).
        option: String,
        /// What is wrong and what is allowed.
        problem: String,
    },

    /// A line of a JSON-lines input file is unusable.
    #[error("{}: line {line}: {problem}", path.display())]
    JsonLine {
        /// The file.
        path: PathBuf,
        /// The line number (1-based, as editors count).
        line: usize,
        /// What is wrong.
        problem: String,
    },

    /// Reading an input file failed.
    #[error("cannot read {}: {source}", path.display())]
    ReadInput {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },

    /// Writing an output file failed.
    #[error("cannot write {}: {source}; check that its folder is writable", path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// The I/O, Arrow or Parquet error.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// Short alias used throughout the crate.
pub type Result<T, E = DataError> = std::result::Result<T, E>;
