//! `grpo preprocess`: turns raw tasks into training data in VeRL's Parquet schema: GSM8K from its
//! JSON-lines release, or a synthetic arithmetic task generated from a seed.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use data::preprocess::arithmetic::{preprocess_arithmetic, AnswerFormat, ArithmeticOptions};
use data::preprocess::gsm8k::preprocess_gsm8k;
use data::preprocess::WriteReport;

/// Arguments of `grpo preprocess`.
#[derive(clap::Args, Debug)]
#[command(
    about = "Write training data in VeRL's Parquet schema (GSM8K, or a seeded arithmetic task)",
    long_about = "Write training data in VeRL's Parquet schema: one row per prompt with columns \
                  data_source, prompt (chat messages), ability, reward_model {style, ground_truth} \
                  and extra_info. Point data.train_files / data.val_files of a recipe at the \
                  files written.",
    after_help = "Examples:\n  \
                  grpo preprocess gsm8k --input gsm8k/train.jsonl --output data/gsm8k/train.parquet\n  \
                  grpo preprocess gsm8k --input gsm8k/test.jsonl --output data/gsm8k/test.parquet --split test\n  \
                  grpo preprocess arithmetic --seed 1 --count 5000 --output data/arith/train.parquet\n  \
                  grpo preprocess arithmetic --seed 2 --count 500 --split test --output data/arith/test.parquet"
)]
pub struct PreprocessArgs {
    #[command(subcommand)]
    task: Task,
}

#[derive(clap::Subcommand, Debug)]
enum Task {
    Gsm8k(Gsm8kArgs),
    Arithmetic(ArithmeticArgs),
}

/// Arguments of `grpo preprocess gsm8k`.
#[derive(clap::Args, Debug)]
#[command(
    about = "Convert GSM8K JSON lines to VeRL's GSM8K Parquet schema",
    long_about = "Convert GSM8K JSON lines (the openai/grade-school-math release: one object per \
                  line with `question` and `answer`) to Parquet exactly as VeRL's \
                  examples/data_preprocess/gsm8k.py does: data_source \"openai/gsm8k\"; prompt \
                  [{role: user, content: question + \" Let's think step by step and output the \
                  final answer after \\\"####\\\".\"}]; ability \"math\"; reward_model {style: \
                  \"rule\", ground_truth: the number after \"#### \" without commas}; extra_info \
                  {split, index, answer, question}.",
    after_help = "Example:\n  grpo preprocess gsm8k --input train.jsonl --output train.parquet --split train"
)]
struct Gsm8kArgs {
    /// The GSM8K JSON-lines file. Example: `--input gsm8k/train.jsonl`.
    #[arg(long, value_name = "FILE.jsonl")]
    input: PathBuf,
    /// The Parquet file to write (replaced if it exists). Example: `--output train.parquet`.
    #[arg(long, value_name = "FILE.parquet")]
    output: PathBuf,
    /// Stored in extra_info.split: `train` or `test`. Example: `--split test`.
    #[arg(long, default_value = "train", value_parser = ["train", "test"])]
    split: String,
}

/// Arguments of `grpo preprocess arithmetic`.
#[derive(clap::Args, Debug)]
#[command(
    about = "Generate a seeded, verifiable arithmetic task in VeRL's schema",
    long_about = "Generate integer arithmetic problems such as \"What is 17 + 4 * 3?\" (usual \
                  precedence; results may be negative) in VeRL's schema, with data_source \
                  \"grpo/arithmetic\". The prompt asks for the final answer after \"####\" (the \
                  GSM8K format, so the gsm8k scorer judges it) or, with --answer-format number, \
                  for the number alone and reward_model.ground_truth is \
                  the integer value. The same options and seed always give the same file. The \
                  defaults (2 operands up to 20, + and -) suit a small chat model; raise \
                  --max-operands, --max-value or add * for harder tasks.",
    after_help = "Examples:\n  grpo preprocess arithmetic --seed 1 --count 5000 --output train.parquet\n  \
                  grpo preprocess arithmetic --seed 7 --count 2000 --min-operands 2 --max-operands 4 \
                  --max-value 99 --ops \"+-*\" --output hard.parquet"
)]
struct ArithmeticArgs {
    /// Seed of the generator. Example: `--seed 1`.
    #[arg(long)]
    seed: u64,
    /// Number of problems. Example: `--count 5000`.
    #[arg(long)]
    count: u64,
    /// The Parquet file to write (replaced if it exists). Example: `--output train.parquet`.
    #[arg(long, value_name = "FILE.parquet")]
    output: PathBuf,
    /// Fewest operands per problem (at least 2). Example: `--min-operands 2`.
    #[arg(long, default_value_t = 2)]
    min_operands: usize,
    /// Most operands per problem (at most 16). Example: `--max-operands 4`.
    #[arg(long, default_value_t = 2)]
    max_operands: usize,
    /// Largest operand; operands are drawn from 0..=V. Example: `--max-value 99`.
    #[arg(long, value_name = "V", default_value_t = 20)]
    max_value: i64,
    /// Operators to draw from, some of + - *. Example: `--ops "+-*"`.
    #[arg(long, default_value = "+-")]
    ops: String,
    /// Stored in extra_info.split. Example: `--split test`.
    #[arg(long, default_value = "train")]
    split: String,
    /// What the prompt asks for: `hashes` (GSM8K's "think step by step, then #### answer"),
    /// `number` ("Reply with only the number.", which small chat models follow), or
    /// `calculator` (a conversation showing the calculator tool called, then the question: for
    /// `rollout.multi_turn` with `tools: [calculator]`). The arithmetic scorer accepts each.
    /// Example: `--answer-format number`.
    #[arg(long, value_enum, default_value = "hashes")]
    answer_format: AnswerFormatArg,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum AnswerFormatArg {
    Hashes,
    Number,
    Calculator,
}

/// Runs the chosen preprocessor and prints what it wrote.
pub fn run(args: PreprocessArgs) -> anyhow::Result<ExitCode> {
    let report = match args.task {
        Task::Gsm8k(args) => preprocess_gsm8k(&args.input, &args.output, &args.split)
            .context("grpo preprocess gsm8k failed")?,
        Task::Arithmetic(args) => {
            let options = ArithmeticOptions {
                seed: args.seed,
                count: args.count,
                min_operands: args.min_operands,
                max_operands: args.max_operands,
                max_value: args.max_value,
                ops: args.ops,
                split: args.split,
                answer_format: match args.answer_format {
                    AnswerFormatArg::Hashes => AnswerFormat::Hashes,
                    AnswerFormatArg::Number => AnswerFormat::Number,
                    AnswerFormatArg::Calculator => AnswerFormat::Calculator,
                },
            };
            preprocess_arithmetic(&options, &args.output).context("grpo preprocess arithmetic failed")?
        }
    };
    print_report(&report);
    Ok(ExitCode::SUCCESS)
}

fn print_report(report: &WriteReport) {
    let plural = if report.row_groups == 1 { "" } else { "s" };
    println!(
        "wrote {} rows ({} row group{plural}) to {}",
        report.rows,
        report.row_groups,
        report.path.display()
    );
}
