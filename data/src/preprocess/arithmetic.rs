//! A synthetic, verifiable arithmetic task in VeRL's schema, generated from a seed.
//!
//! Each row asks for the value of an integer expression such as `17 + 4 * 3` (operands drawn
//! uniformly from `0..=max_value`, operators from `ops`, usual precedence: `*` before `+` and
//! `-`; results may be negative). The answer format is GSM8K's: the prompt ends with VeRL's
//! GSM8K instruction (output the final answer after `####`), and `reward_model.ground_truth` is
//! the integer value in decimal, so the GSM8K scorer (strict: the last `#### <number>`) judges
//! it. `data_source` is [`ARITHMETIC_DATA_SOURCE`]; `extra_info` is `{split, index,
//! expression}`.
//!
//! The same options and seed give the same rows, on every platform. The default (two operands up
//! to 20, `+` and `-`) is within reach of a 135M-parameter chat model, so GRPO visibly improves
//! it; more operands, larger values and `*` make it harder.

use std::path::Path;

use crate::error::{DataError, Result};
use crate::example::Message;
use crate::preprocess::gsm8k::GSM8K_INSTRUCTION;
use crate::preprocess::{ExtraType, ExtraValue, VerlRecord, VerlWriter, WriteReport, ROWS_PER_ROW_GROUP};
use crate::rng::SplitMix64;

/// The `data_source` of generated arithmetic rows.
pub const ARITHMETIC_DATA_SOURCE: &str = "grpo/arithmetic";

/// The `extra_info` fields of arithmetic rows.
pub const ARITHMETIC_EXTRA_INFO: [(&str, ExtraType); 3] = [
    ("split", ExtraType::Text),
    ("index", ExtraType::Int),
    ("expression", ExtraType::Text),
];

/// The most operands an expression may have.
pub const MAX_OPERANDS_LIMIT: usize = 16;

/// How to generate the task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArithmeticOptions {
    /// Seed of the generator.
    pub seed: u64,
    /// Rows to generate.
    pub count: u64,
    /// Fewest operands per expression (at least 2).
    pub min_operands: usize,
    /// Most operands per expression (at most [`MAX_OPERANDS_LIMIT`]).
    pub max_operands: usize,
    /// Largest operand (operands are drawn from `0..=max_value`).
    pub max_value: i64,
    /// The operators to draw from, a non-empty selection of `+`, `-`, `*`.
    pub ops: String,
    /// `extra_info.split`.
    pub split: String,
    /// What the prompt asks the answer to look like.
    pub answer_format: AnswerFormat,
}

/// How the prompt asks for the answer (the `arithmetic` scorer accepts every form).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AnswerFormat {
    /// GSM8K's instruction: think step by step, then `#### <answer>`.
    #[default]
    Hashes,
    /// "Reply with only the number.": the whole response is the answer. Small chat models
    /// (SmolLM2-135M) follow this often enough for GRPO to have a signal from the first step.
    Number,
    /// For `rollout.multi_turn` with the calculator: the prompt is a conversation that shows
    /// the calculator called in the Hermes format (`<tool_call>...</tool_call>`), its result as
    /// a `tool` message, and the answer as `#### <number>` ([`calculator_demonstration`]), then
    /// the question. SmolLM2-135M-Instruct, which never calls a tool unprompted, calls it in
    /// most samples after this.
    Calculator,
}

impl AnswerFormat {
    /// The instruction appended to the question.
    pub fn instruction(self) -> &'static str {
        match self {
            AnswerFormat::Hashes => GSM8K_INSTRUCTION,
            AnswerFormat::Number => NUMBER_INSTRUCTION,
            AnswerFormat::Calculator => CALCULATOR_INSTRUCTION,
        }
    }
}

/// The instruction of [`AnswerFormat::Calculator`].
pub const CALCULATOR_INSTRUCTION: &str = "Use the calculator, then answer as #### <number>.";

/// A calculator call in the Hermes format, as the demonstrations write it.
fn calculator_call(expression: &str) -> String {
    format!("<tool_call>\n{{\"name\": \"calculator\", \"arguments\": {{\"expression\": \"{expression}\"}}}}\n</tool_call>")
}

/// The conversation [`AnswerFormat::Calculator`] puts before each question: a system message
/// naming the tool and two solved questions.
pub fn calculator_demonstration() -> Vec<Message> {
    let mut messages = vec![Message::new(
        "system",
        format!(
            "You are a helpful assistant with a calculator. For arithmetic, call it like this:\n{}",
            calculator_call("2 + 2")
        ),
    )];
    for (expression, value) in [("123 * 456", "56088"), ("77 + 905", "982")] {
        messages.push(Message::new(
            "user",
            format!("What is {expression}? {CALCULATOR_INSTRUCTION}"),
        ));
        messages.push(Message::new("assistant", calculator_call(expression)));
        messages.push(Message::new("tool", value));
        messages.push(Message::new("assistant", format!("#### {value}")));
    }
    messages
}

/// The instruction of [`AnswerFormat::Number`].
pub const NUMBER_INSTRUCTION: &str = "Reply with only the number.";

impl Default for ArithmeticOptions {
    fn default() -> Self {
        Self {
            seed: 0,
            count: 1000,
            min_operands: 2,
            max_operands: 2,
            max_value: 20,
            ops: "+-".into(),
            split: "train".into(),
            answer_format: AnswerFormat::Hashes,
        }
    }
}

fn invalid(option: &str, problem: String) -> DataError {
    DataError::InvalidOption {
        option: option.into(),
        problem,
    }
}

impl ArithmeticOptions {
    /// Checks the options, including that no expression can overflow 64-bit integers.
    pub fn validate(&self) -> Result<Vec<char>> {
        if self.count == 0 {
            return Err(invalid("--count", "must be at least 1".into()));
        }
        if self.min_operands < 2 {
            return Err(invalid(
                "--min-operands",
                format!("is {}; expressions need at least 2 operands", self.min_operands),
            ));
        }
        if self.max_operands < self.min_operands || self.max_operands > MAX_OPERANDS_LIMIT {
            return Err(invalid(
                "--max-operands",
                format!(
                    "is {}; it must be between --min-operands ({}) and {MAX_OPERANDS_LIMIT}",
                    self.max_operands, self.min_operands
                ),
            ));
        }
        if self.max_value < 1 {
            return Err(invalid(
                "--max-value",
                format!("is {}; it must be at least 1", self.max_value),
            ));
        }
        let mut ops: Vec<char> = Vec::new();
        for op in self.ops.chars().filter(|c| !c.is_whitespace()) {
            if !matches!(op, '+' | '-' | '*') {
                return Err(invalid(
                    "--ops",
                    format!("has `{op}`; the operators are +, - and *"),
                ));
            }
            if !ops.contains(&op) {
                ops.push(op);
            }
        }
        if ops.is_empty() {
            return Err(invalid("--ops", "is empty; give some of +, - and *".into()));
        }
        // The largest magnitude any expression can reach: all operands at max_value, multiplied.
        let bound = (self.max_value as i128)
            .checked_pow(self.max_operands as u32)
            .map(|product| product * self.max_operands as i128);
        if bound.is_none_or(|bound| bound > i64::MAX as i128) {
            return Err(invalid(
                "--max-value",
                format!(
                    "{} with up to {} operands can overflow 64-bit integers; lower either",
                    self.max_value, self.max_operands
                ),
            ));
        }
        if self.split.is_empty() {
            return Err(invalid("--split", "is empty".into()));
        }
        Ok(ops)
    }
}

/// One generated problem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The expression, operands and operators separated by spaces (`3 + 4 * 2`).
    pub expression: String,
    /// Its value.
    pub answer: i64,
}

/// Evaluates `operands[0] ops[0] operands[1] ...` with `*` before `+` and `-`.
fn evaluate(operands: &[i64], ops: &[char]) -> i64 {
    let mut total = 0i64;
    let mut sign = 1i64;
    let mut term = operands[0];
    for (op, &operand) in ops.iter().zip(&operands[1..]) {
        match op {
            '*' => term *= operand,
            '+' | '-' => {
                total += sign * term;
                sign = if *op == '+' { 1 } else { -1 };
                term = operand;
            }
            other => unreachable!("operator {other} was rejected by validate"),
        }
    }
    total + sign * term
}

/// Generates the problems of `options` (already validated operators in `ops`).
pub fn generate(options: &ArithmeticOptions) -> Result<Vec<Problem>> {
    let ops = options.validate()?;
    let mut rng = SplitMix64::for_stream(options.seed, 0);
    let mut problems = Vec::with_capacity(options.count.min(1 << 20) as usize);
    for _ in 0..options.count {
        let operand_count = rng.in_range(options.min_operands as i64, options.max_operands as i64) as usize;
        let operands: Vec<i64> = (0..operand_count)
            .map(|_| rng.in_range(0, options.max_value))
            .collect();
        let chosen: Vec<char> = (1..operand_count)
            .map(|_| ops[rng.below(ops.len() as u64) as usize])
            .collect();
        let mut expression = operands[0].to_string();
        for (op, operand) in chosen.iter().zip(&operands[1..]) {
            expression.push_str(&format!(" {op} {operand}"));
        }
        problems.push(Problem {
            answer: evaluate(&operands, &chosen),
            expression,
        });
    }
    Ok(problems)
}

/// The VeRL record for one problem.
pub fn arithmetic_record(problem: &Problem, split: &str, index: i64, format: AnswerFormat) -> VerlRecord {
    VerlRecord {
        data_source: ARITHMETIC_DATA_SOURCE.into(),
        prompt: {
            let mut messages = match format {
                AnswerFormat::Calculator => calculator_demonstration(),
                AnswerFormat::Hashes | AnswerFormat::Number => Vec::new(),
            };
            messages.push(Message::new(
                "user",
                format!("What is {}? {}", problem.expression, format.instruction()),
            ));
            messages
        },
        ability: "math".into(),
        style: "rule".into(),
        ground_truth: problem.answer.to_string(),
        extra_info: vec![
            ExtraValue::Text(split.into()),
            ExtraValue::Int(index),
            ExtraValue::Text(problem.expression.clone()),
        ],
    }
}

/// Generates the task and writes it to `output`.
pub fn preprocess_arithmetic(options: &ArithmeticOptions, output: &Path) -> Result<WriteReport> {
    let problems = generate(options)?;
    let mut writer = VerlWriter::create(output, &ARITHMETIC_EXTRA_INFO)?;
    for (chunk_index, chunk) in problems.chunks(ROWS_PER_ROW_GROUP).enumerate() {
        let first = chunk_index * ROWS_PER_ROW_GROUP;
        let records: Vec<VerlRecord> = chunk
            .iter()
            .enumerate()
            .map(|(i, problem)| {
                arithmetic_record(problem, &options.split, (first + i) as i64, options.answer_format)
            })
            .collect();
        writer.write(&records)?;
    }
    writer.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evaluates_with_precedence() {
        assert_eq!(evaluate(&[3, 4, 2], &['+', '*']), 11);
        assert_eq!(evaluate(&[3, 4, 2], &['*', '-']), 10);
        assert_eq!(evaluate(&[3, 4, 2, 5], &['-', '*', '+']), 0);
        assert_eq!(evaluate(&[2, 9], &['-']), -7);
    }

    #[test]
    fn generation_is_deterministic_and_answers_are_right() {
        let options = ArithmeticOptions {
            seed: 11,
            count: 300,
            min_operands: 2,
            max_operands: 4,
            max_value: 9,
            ops: "+-*".into(),
            split: "train".into(),
            answer_format: AnswerFormat::Hashes,
        };
        let first = generate(&options).unwrap();
        assert_eq!(first, generate(&options).unwrap());
        let other = generate(&ArithmeticOptions {
            seed: 12,
            ..options.clone()
        })
        .unwrap();
        assert_ne!(first, other);
        for problem in &first {
            // Re-evaluate the printed expression independently: split into tokens, fold `*`
            // first, then `+`/`-` left to right.
            let tokens: Vec<&str> = problem.expression.split(' ').collect();
            let mut terms: Vec<(i64, i64)> = vec![(1, tokens[0].parse().unwrap())];
            for pair in tokens[1..].chunks(2) {
                let value: i64 = pair[1].parse().unwrap();
                assert!((0..=9).contains(&value));
                match pair[0] {
                    "*" => terms.last_mut().unwrap().1 *= value,
                    "+" => terms.push((1, value)),
                    "-" => terms.push((-1, value)),
                    other => panic!("unexpected operator {other}"),
                }
            }
            let expected: i64 = terms.iter().map(|(sign, term)| sign * term).sum();
            assert_eq!(problem.answer, expected, "{}", problem.expression);
            assert!((2..=4).contains(&tokens.len().div_ceil(2)));
        }
        // Every operator and operand count occurs.
        for needle in [" + ", " - ", " * "] {
            assert!(first.iter().any(|p| p.expression.contains(needle)), "{needle}");
        }
    }

    #[test]
    fn rejects_bad_options() {
        let check = |options: ArithmeticOptions| options.validate().unwrap_err().to_string();
        let base = ArithmeticOptions::default();
        assert_eq!(
            check(ArithmeticOptions {
                ops: "+/".into(),
                ..base.clone()
            }),
            "invalid option `--ops`: has `/`; the operators are +, - and *"
        );
        assert_eq!(
            check(ArithmeticOptions {
                min_operands: 1,
                ..base.clone()
            }),
            "invalid option `--min-operands`: is 1; expressions need at least 2 operands"
        );
        assert!(check(ArithmeticOptions {
            max_value: 1_000_000,
            max_operands: 8,
            ..base.clone()
        })
        .contains("can overflow 64-bit integers"));
        assert!(check(ArithmeticOptions { count: 0, ..base }).contains("--count"));
    }

    #[test]
    fn the_calculator_format_demonstrates_the_tool_before_the_question() {
        let problem = Problem {
            expression: "4821 * 3907".into(),
            answer: 4821 * 3907,
        };
        let record = arithmetic_record(&problem, "train", 0, AnswerFormat::Calculator);
        let roles: Vec<&str> = record.prompt.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(
            roles,
            [
                "system",
                "user",
                "assistant",
                "tool",
                "assistant",
                "user",
                "assistant",
                "tool",
                "assistant",
                "user"
            ]
        );
        assert_eq!(
            record.prompt[2].content,
            "<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"123 * 456\"}}\n</tool_call>"
        );
        // The demonstration's results are the calculator's own answers.
        for (call, result) in [(2, 3), (6, 7)] {
            let text = &record.prompt[call].content;
            let args: serde_json::Value = serde_json::from_str(
                text.trim_start_matches("<tool_call>")
                    .trim_end_matches("</tool_call>")
                    .trim(),
            )
            .unwrap();
            let (a, b) = args["arguments"]["expression"]
                .as_str()
                .unwrap()
                .split_once(['*', '+'])
                .unwrap();
            let (a, b): (i64, i64) = (a.trim().parse().unwrap(), b.trim().parse().unwrap());
            let value = if text.contains('*') { a * b } else { a + b };
            assert_eq!(record.prompt[result].content, value.to_string());
            assert_eq!(record.prompt[result + 1].content, format!("#### {value}"));
        }
        assert_eq!(
            record.prompt[9].content,
            "What is 4821 * 3907? Use the calculator, then answer as #### <number>."
        );
        assert_eq!(record.ground_truth, "18835647");
    }

    #[test]
    fn record_uses_the_gsm8k_answer_format() {
        let problem = Problem {
            expression: "7 - 9".into(),
            answer: -2,
        };
        let plain = arithmetic_record(&problem, "test", 3, AnswerFormat::Number);
        assert_eq!(
            plain.prompt[0].content,
            "What is 7 - 9? Reply with only the number."
        );
        let record = arithmetic_record(&problem, "test", 3, AnswerFormat::Hashes);
        assert_eq!(record.data_source, "grpo/arithmetic");
        assert_eq!(
            record.prompt[0].content,
            "What is 7 - 9? Let's think step by step and output the final answer after \"####\"."
        );
        assert_eq!(record.ground_truth, "-2");
        assert_eq!(record.extra_info[2], ExtraValue::Text("7 - 9".into()));
    }
}
