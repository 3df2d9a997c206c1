//! `grpo plot`: reads a run's `OUTPUT/metrics.jsonl` (one JSON object per training step, written
//! by `grpo run`) and draws PNG charts of reward, validation accuracy, KL, entropy, response
//! length and throughput over the steps: one file per chart and `overview.png` with every panel
//! in a grid. Text is drawn with a font compiled into the binary (Noto Sans, from the
//! `ttf-noto-sans` crate), so the charts look the same on machines without any system fonts.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// Arguments of `grpo plot`.
#[derive(clap::Args, Debug)]
#[command(
    about = "Draw PNG charts of a training run's metrics (reward, accuracy, KL, entropy, ...)",
    long_about = "Draw PNG charts of a training run's metrics from OUTPUT/metrics.jsonl: reward \
                  (mean with a ±1 std band), validation accuracy, KL to the reference model, \
                  policy entropy, mean response length and throughput (generation and training \
                  tokens/s), each over the training steps, plus overview.png with all six panels. \
                  Works while the run is still going (a half-written last line is skipped) and \
                  after a resumed run (a step written again replaces the earlier one). Prints the \
                  files it wrote and a one-line summary of the reward.",
    after_help = "Examples:\n  \
                  grpo plot runs/quickstart\n  \
                  grpo plot runs/gsm8k --output docs/img/gsm8k"
)]
pub struct PlotArgs {
    /// The run's output directory (the one `grpo run` writes metrics.jsonl into), or the path of
    /// a metrics.jsonl file. Example: `runs/quickstart`.
    #[arg(value_name = "OUTPUT")]
    run: PathBuf,
    /// Directory to write the PNG files into (created if missing; files of the same name are
    /// replaced). Default: `OUTPUT/plots`. Example: `--output docs/img`.
    #[arg(long, value_name = "DIR")]
    output: Option<PathBuf>,
}

/// What can go wrong while reading metrics or drawing charts.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    /// The metrics file does not exist.
    #[error(
        "{}: no such file; run `grpo run RECIPE` first (it appends one line to \
         OUTPUT/metrics.jsonl after every training step) and pass its output directory",
        path.display()
    )]
    MetricsMissing {
        /// The metrics file looked for.
        path: PathBuf,
    },
    /// The metrics file exists but cannot be read.
    #[error("cannot read {}: {cause}", path.display())]
    Read {
        /// The metrics file.
        path: PathBuf,
        /// The I/O error.
        cause: std::io::Error,
    },
    /// A line is not a JSON object with an integer `step` and numeric metrics.
    #[error(
        "{}:{line}: {problem}; every line of metrics.jsonl must be one JSON object with a \
         non-negative integer `step` and numbers (or null) as metric values",
        path.display()
    )]
    MalformedLine {
        /// The metrics file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong with the line.
        problem: String,
    },
    /// The file has no line with training metrics yet.
    #[error(
        "{}: no training steps yet{detail}; wait until `grpo run` has finished its first step, \
         then run `grpo plot` again",
        path.display()
    )]
    NoSteps {
        /// The metrics file.
        path: PathBuf,
        /// What the file does hold, e.g. " (only a validation line for step 0)".
        detail: String,
    },
    /// Drawing a chart failed inside the plotting library.
    #[error("cannot draw the chart {chart}: {message}")]
    Draw {
        /// The chart's file name.
        chart: String,
        /// The plotting library's message.
        message: String,
    },
    /// A PNG file or the output directory cannot be written.
    #[error("cannot write {}: {cause}; check that the directory is writable, or pass --output DIR", path.display())]
    Write {
        /// The file or directory.
        path: PathBuf,
        /// The I/O error.
        cause: std::io::Error,
    },
}

/// The metrics of one training step (or of the validation before training, step 0): metric name
/// to value, finite numbers only.
#[derive(Debug, Clone, PartialEq)]
pub struct StepMetrics {
    /// The step number from the line's `step` key.
    pub step: u64,
    /// Every metric of the step that had a finite numeric value.
    pub values: BTreeMap<String, f64>,
}

/// A parsed metrics.jsonl: one entry per step, in increasing step order.
#[derive(Debug, Clone, PartialEq)]
pub struct MetricsLog {
    /// The steps, strictly increasing.
    pub steps: Vec<StepMetrics>,
    /// True when the file's last line was incomplete (no newline, not valid JSON) and was
    /// skipped: the run was probably writing it at that moment.
    pub partial_last_line: bool,
}

impl MetricsLog {
    /// The finite values of `key` as `(step, value)` points, in step order.
    pub fn series(&self, key: &str) -> Vec<(i64, f64)> {
        self.steps
            .iter()
            .filter_map(|s| s.values.get(key).map(|&v| (step_coordinate(s.step), v)))
            .collect()
    }

    /// The steps that carry training metrics (any key outside validation's), in step order; a line
    /// holding only validation (such as the step-0 validation before training) is not one.
    pub fn training_steps(&self) -> Vec<u64> {
        self.steps
            .iter()
            .filter(|s| s.values.keys().any(|k| !is_validation_key(k)))
            .map(|s| s.step)
            .collect()
    }
}

/// Steps as chart coordinates (steps beyond `i64::MAX` do not occur in practice; saturate).
fn step_coordinate(step: u64) -> i64 {
    i64::try_from(step).unwrap_or(i64::MAX)
}

/// Metric names of files written before grpo took VeRL's names, and the names they read as.
const RENAMED: &[(&str, &str)] = &[
    ("reward/mean", "critic/score/mean"),
    ("reward/std", "critic/score/std"),
    ("reward/max", "critic/score/max"),
    ("reward/min", "critic/score/min"),
    ("timing_s/sync", "timing_s/update_weights"),
    ("timing_s/validation", "timing_s/testing"),
];

/// Metric keys that the charts draw: a non-numeric value for one of these is a malformed line
/// (other keys may hold anything and are ignored). Validation's `val-core/.../mean@N` keys are
/// charted too.
const CHARTED_KEYS: &[&str] = &[
    "critic/score/mean",
    "critic/score/std",
    "val/accuracy",
    "actor/kl",
    "actor/entropy",
    "response_length/mean",
    "perf/gen_tokens_per_s",
    "perf/train_tokens_per_s",
];

/// Reads and parses the metrics file at `path`.
pub fn read_metrics(path: &Path) -> Result<MetricsLog, PlotError> {
    let text = std::fs::read_to_string(path).map_err(|cause| {
        if cause.kind() == std::io::ErrorKind::NotFound {
            PlotError::MetricsMissing {
                path: path.to_path_buf(),
            }
        } else {
            PlotError::Read {
                path: path.to_path_buf(),
                cause,
            }
        }
    })?;
    parse_metrics(&text, path)
}

/// Parses the text of a metrics.jsonl file (`path` only names it in errors).
///
/// Blank lines and run headers are skipped; null and non-finite values (`NaN`, `Infinity` as bare tokens or
/// strings) leave a gap in their chart. When a step number repeats, the later line wins: a line
/// with the same step as the line just before it is merged into it (its values replace the
/// earlier ones, a null removes one), and a step lower than the one before means a resumed run
/// went back to a checkpoint, so every earlier entry from that step on is dropped.
pub fn parse_metrics(text: &str, path: &Path) -> Result<MetricsLog, PlotError> {
    let mut steps: Vec<StepMetrics> = Vec::new();
    let mut partial_last_line = false;
    let lines: Vec<&str> = text.split_inclusive('\n').collect();
    for (index, raw_line) in lines.iter().enumerate() {
        let line_number = index + 1;
        let line = raw_line.trim();
        if line.is_empty() {
            continue;
        }
        let malformed = |problem: String| PlotError::MalformedLine {
            path: path.to_path_buf(),
            line: line_number,
            problem,
        };
        let value: serde_json::Value = match serde_json::from_str(line) {
            Ok(value) => value,
            Err(first_error) => {
                match replace_bare_non_finite(line).and_then(|fixed| serde_json::from_str(&fixed).ok()) {
                    Some(value) => value,
                    None if index + 1 == lines.len() && !raw_line.ends_with('\n') => {
                        partial_last_line = true;
                        break;
                    }
                    None => return Err(malformed(format!("not valid JSON ({first_error})"))),
                }
            }
        };
        let serde_json::Value::Object(object) = value else {
            return Err(malformed(format!(
                "expected a JSON object, found {}",
                json_kind(&value)
            )));
        };
        let step = match object.get("step") {
            // A run's header (`{"run": {...}}`, written when it starts or resumes).
            None if object.contains_key("run") => continue,
            None => return Err(malformed("no `step` key".to_string())),
            Some(step) => step
                .as_u64()
                .ok_or_else(|| malformed(format!("`step` must be a non-negative integer, found {step}")))?,
        };
        let mut values: BTreeMap<String, Option<f64>> = BTreeMap::new();
        for (key, value) in &object {
            if key == "step" {
                continue;
            }
            // Stored under today's name; errors name the key as the file has it.
            let (written, key) = (
                key,
                &RENAMED
                    .iter()
                    .find(|(old, _)| old == key)
                    .map_or_else(|| key.clone(), |(_, new)| new.to_string()),
            );
            let number = match value {
                serde_json::Value::Number(number) => number.as_f64().filter(|v| v.is_finite()),
                serde_json::Value::Null => None,
                serde_json::Value::String(text) if is_non_finite_word(text) => None,
                other if CHARTED_KEYS.contains(&key.as_str()) || is_validation_mean(key) => {
                    return Err(malformed(format!(
                        "`{written}` must be a number or null, found {other}"
                    )))
                }
                _ => continue,
            };
            values.insert(key.clone(), number);
        }
        match steps.last_mut() {
            Some(last) if last.step == step => {
                for (key, value) in values {
                    match value {
                        Some(v) => last.values.insert(key, v),
                        None => last.values.remove(&key),
                    };
                }
            }
            last => {
                if last.is_some_and(|last| last.step > step) {
                    steps.retain(|s| s.step < step);
                }
                steps.push(StepMetrics {
                    step,
                    values: values
                        .into_iter()
                        .filter_map(|(k, v)| v.map(|v| (k, v)))
                        .collect(),
                });
            }
        }
    }
    Ok(MetricsLog {
        steps,
        partial_last_line,
    })
}

/// The JSON type of `value`, for messages.
fn json_kind(value: &serde_json::Value) -> &'static str {
    match value {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// Whether a string value spells a non-finite number (as some writers store NaN and infinity).
fn is_non_finite_word(text: &str) -> bool {
    matches!(
        text.to_ascii_lowercase().as_str(),
        "nan" | "-nan" | "inf" | "+inf" | "-inf" | "infinity" | "+infinity" | "-infinity"
    )
}

/// Replaces the bare tokens `NaN`, `Infinity` and `-Infinity` outside strings (as Python's json
/// module writes them) with `null`; `None` when the line has none.
fn replace_bare_non_finite(line: &str) -> Option<String> {
    let mut out = String::with_capacity(line.len());
    let mut rest = line;
    let mut in_string = false;
    let mut escaped = false;
    let mut replaced = false;
    while let Some(c) = rest.chars().next() {
        if !in_string {
            if let Some(token) = ["-Infinity", "Infinity", "NaN"]
                .iter()
                .find(|token| rest.starts_with(*token))
            {
                out.push_str("null");
                rest = &rest[token.len()..];
                replaced = true;
                continue;
            }
        }
        out.push(c);
        rest = &rest[c.len_utf8()..];
        if in_string {
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_string = false;
            }
        } else if c == '"' {
            in_string = true;
        }
    }
    replaced.then_some(out)
}

/// Whether `key` is a validation metric (`val/`, VeRL's `val-core/` and `val-aux/`).
fn is_validation_key(key: &str) -> bool {
    ["val/", "val-core/", "val-aux/"]
        .iter()
        .any(|p| key.starts_with(p))
}

/// Whether `key` is a validation core mean (`val-core/{data_source}/{var}/mean@N`).
fn is_validation_mean(key: &str) -> bool {
    key.strip_prefix("val-core/")
        .and_then(|rest| rest.rsplit_once('/'))
        .is_some_and(|(_, metric)| {
            metric
                .strip_prefix("mean@")
                .is_some_and(|n| n.parse::<u32>().is_ok())
        })
}

/// One line of a chart.
#[derive(Debug, Clone)]
pub struct ChartLine {
    /// The metric key in metrics.jsonl.
    pub key: String,
    /// The legend label.
    pub label: String,
    /// The line colour.
    pub color: RGBColor,
}

/// One chart: which metrics it draws and how.
#[derive(Debug, Clone)]
pub struct ChartSpec {
    /// File name of the chart's PNG.
    pub file_name: &'static str,
    /// The title above the chart.
    pub title: &'static str,
    /// The y axis description.
    pub y_label: &'static str,
    /// The lines drawn.
    pub lines: Vec<ChartLine>,
    /// `(mean key, std key)`: a shaded band of mean ± std around the first line.
    pub band: Option<(&'static str, &'static str)>,
    /// Use the y range 0..1 when every value lies in it (accuracies).
    pub unit_interval: bool,
}

const BLUE_LINE: RGBColor = RGBColor(31, 119, 180);
const ORANGE_LINE: RGBColor = RGBColor(230, 110, 20);
const GREEN_LINE: RGBColor = RGBColor(44, 160, 44);
const RED_LINE: RGBColor = RGBColor(214, 39, 40);
const PURPLE_LINE: RGBColor = RGBColor(148, 103, 189);
const BROWN_LINE: RGBColor = RGBColor(140, 86, 75);

/// The six charts `grpo plot` draws for `log`, in overview order. Validation has a line per
/// data source's core mean (`val-core/{data_source}/{var}/mean@N`), or `val/accuracy` in
/// files from before VeRL's names.
pub fn chart_specs(log: &MetricsLog) -> Vec<ChartSpec> {
    let single = |key: &str, label: &str, color| ChartLine {
        key: key.to_string(),
        label: label.to_string(),
        color,
    };
    let palette = [
        GREEN_LINE,
        BLUE_LINE,
        ORANGE_LINE,
        RED_LINE,
        PURPLE_LINE,
        BROWN_LINE,
    ];
    let mut validation: Vec<String> = log
        .steps
        .iter()
        .flat_map(|s| s.values.keys())
        .filter(|k| is_validation_mean(k))
        .cloned()
        .collect();
    validation.sort();
    validation.dedup();
    let mut validation_lines: Vec<ChartLine> = validation
        .iter()
        .zip(palette.iter().cycle())
        .map(|(key, &color)| {
            // `{data_source}/{var}/{metric}`: the data source may hold slashes, the rest not.
            let mut parts = key.trim_start_matches("val-core/").rsplitn(3, '/');
            let (metric, var, source) = (parts.next(), parts.next(), parts.next());
            let label = format!(
                "{} {} {}",
                source.unwrap_or(""),
                var.unwrap_or(""),
                metric.unwrap_or("")
            );
            single(key, &label, color)
        })
        .collect();
    if validation_lines.is_empty() {
        validation_lines.push(single("val/accuracy", "accuracy", GREEN_LINE));
    }
    vec![
        ChartSpec {
            file_name: "reward.png",
            title: "Reward (mean ± std over samples)",
            y_label: "reward",
            lines: vec![single("critic/score/mean", "mean", BLUE_LINE)],
            band: Some(("critic/score/mean", "critic/score/std")),
            unit_interval: false,
        },
        ChartSpec {
            file_name: "val_accuracy.png",
            title: "Validation accuracy",
            y_label: "accuracy",
            lines: validation_lines,
            band: None,
            unit_interval: true,
        },
        ChartSpec {
            file_name: "kl.png",
            title: "KL (actor/kl)",
            y_label: "KL",
            lines: vec![single("actor/kl", "KL", RED_LINE)],
            band: None,
            unit_interval: false,
        },
        ChartSpec {
            file_name: "entropy.png",
            title: "Policy entropy",
            y_label: "entropy (nats/token)",
            lines: vec![single("actor/entropy", "entropy", PURPLE_LINE)],
            band: None,
            unit_interval: false,
        },
        ChartSpec {
            file_name: "response_length.png",
            title: "Mean response length",
            y_label: "tokens",
            lines: vec![single("response_length/mean", "mean length", BROWN_LINE)],
            band: None,
            unit_interval: false,
        },
        ChartSpec {
            file_name: "throughput.png",
            title: "Throughput",
            y_label: "tokens/s",
            lines: vec![
                single("perf/gen_tokens_per_s", "generation", BLUE_LINE),
                single("perf/train_tokens_per_s", "training", ORANGE_LINE),
            ],
            band: None,
            unit_interval: false,
        },
    ]
}

/// Pixel size of one chart's PNG.
pub const CHART_SIZE: (u32, u32) = (900, 540);
/// Pixel size of `overview.png` (3 columns by 2 rows of panels under a title).
pub const OVERVIEW_SIZE: (u32, u32) = (1800, 1040);
/// File name of the grid of all panels.
pub const OVERVIEW_FILE: &str = "overview.png";

/// The font family name the embedded font is registered under.
const FONT_FAMILY: &str = "sans-serif";

/// Registers the embedded Noto Sans as the plotting font (once per process).
fn register_embedded_font() {
    static REGISTERED: OnceLock<()> = OnceLock::new();
    REGISTERED.get_or_init(|| {
        // The font is a fixed, known-good TTF compiled into the binary; a failure here is a
        // build defect that the unit tests catch, and text would only be missing.
        if plotters::style::register_font(FONT_FAMILY, FontStyle::Normal, ttf_noto_sans::REGULAR).is_err() {
            tracing::error!("the embedded Noto Sans font could not be parsed; charts lack text");
        }
    });
}

fn draw_error(chart: &str) -> impl Fn(String) -> PlotError + '_ {
    move |message| PlotError::Draw {
        chart: chart.to_string(),
        message,
    }
}

/// Text for a y tick at `value` on an axis spanning `span`: enough decimals to tell ticks
/// apart, trailing zeros dropped; scientific notation for very large or tiny magnitudes.
fn tick_label(value: f64, span: f64) -> String {
    // A tick at zero computed as the sum of float steps lands a rounding error away from it.
    if value == 0.0 || value.abs() < span.abs() * 1e-9 {
        return "0".to_string();
    }
    let magnitude = value.abs().max(span.abs());
    if !(1e-4..1e6).contains(&magnitude) {
        return format!("{value:.2e}");
    }
    let tick_step = (span / 5.0).max(f64::MIN_POSITIVE);
    let decimals = ((-tick_step.log10()).ceil() as i64 + 1).clamp(0, 8) as usize;
    let text = format!("{value:.decimals$}");
    if text.contains('.') {
        let trimmed = text.trim_end_matches('0').trim_end_matches('.');
        if trimmed == "-0" {
            "0".to_string()
        } else {
            trimmed.to_string()
        }
    } else {
        text
    }
}

/// The y range for values between `low` and `high`, padded so lines do not touch the frame.
fn y_range(low: f64, high: f64, unit_interval: bool) -> (f64, f64) {
    if unit_interval && low >= 0.0 && high <= 1.0 {
        return (0.0, 1.0);
    }
    if high > low {
        let pad = (high - low) * 0.08;
        (low - pad, high + pad)
    } else {
        let pad = if low != 0.0 { low.abs() * 0.1 } else { 1.0 };
        (low - pad, high + pad)
    }
}

/// Font sizes in pixels for a panel of the given height.
struct FontSizes {
    title: f64,
    label: f64,
    description: f64,
}

impl FontSizes {
    fn for_height(height: u32) -> Self {
        let scale = (f64::from(height) / 540.0).clamp(0.6, 2.0);
        Self {
            title: 24.0 * scale,
            label: 15.0 * scale,
            description: 16.0 * scale,
        }
    }
}

/// Draws `spec` from `log` into `area`, with x from `steps.0` to `steps.1`.
fn draw_chart(
    area: &DrawingArea<BitMapBackend<'_>, Shift>,
    spec: &ChartSpec,
    log: &MetricsLog,
    steps: (i64, i64),
) -> Result<(), String> {
    let fonts = FontSizes::for_height(area.dim_in_pixel().1);
    let series: Vec<Vec<(i64, f64)>> = spec.lines.iter().map(|l| log.series(&l.key)).collect();
    let band: Vec<(i64, f64, f64)> = match spec.band {
        Some((mean_key, std_key)) => {
            let stds: BTreeMap<i64, f64> = log.series(std_key).into_iter().collect();
            log.series(mean_key)
                .into_iter()
                .filter_map(|(x, mean)| stds.get(&x).map(|std| (x, mean - std, mean + std)))
                .collect()
        }
        None => Vec::new(),
    };
    let values = series
        .iter()
        .flatten()
        .map(|&(_, y)| y)
        .chain(band.iter().flat_map(|&(_, low, high)| [low, high]));
    let (low, high) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), y| {
        (lo.min(y), hi.max(y))
    });
    if low > high {
        // Nothing to draw yet (e.g. no validation has run): say so inside the panel.
        let keys: Vec<String> = spec.lines.iter().map(|l| format!("`{}`", l.key)).collect();
        let inner = area
            .titled(spec.title, (FONT_FAMILY, fonts.title))
            .map_err(|e| e.to_string())?;
        let (width, height) = inner.dim_in_pixel();
        let grey = BLACK.mix(0.6);
        let style = TextStyle::from((FONT_FAMILY, fonts.label).into_font())
            .color(&grey)
            .pos(Pos::new(HPos::Center, VPos::Center));
        inner
            .draw_text(
                &format!("no {} values in metrics.jsonl yet", keys.join(" or ")),
                &style,
                ((width / 2) as i32, (height / 2) as i32),
            )
            .map_err(|e| e.to_string())?;
        return Ok(());
    }
    let (y_low, y_high) = y_range(low, high, spec.unit_interval);
    let span = y_high - y_low;
    // Pad the steps by about 2% (at least one step) so markers at the ends are not cut off.
    let x_pad = ((steps.1 - steps.0) / 50).max(1);
    let x_extent = (steps.0 - x_pad, steps.1 + x_pad);
    let x_range = x_extent.0..x_extent.1;
    let x_formatter = |step: &i64| {
        if *step < 0 {
            String::new()
        } else {
            step.to_string()
        }
    };
    let label_px = fonts.label;
    let mut chart = ChartBuilder::on(area)
        .caption(spec.title, (FONT_FAMILY, fonts.title))
        .margin((fonts.label * 0.8) as u32)
        .x_label_area_size((fonts.label * 3.0) as u32)
        .y_label_area_size((fonts.label * 5.0) as u32)
        .build_cartesian_2d(x_range, y_low..y_high)
        .map_err(|e| e.to_string())?;
    let y_formatter = move |v: &f64| tick_label(*v, span);
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc(spec.y_label)
        .x_labels(8)
        .y_labels(6)
        .x_label_formatter(&x_formatter)
        .y_label_formatter(&y_formatter)
        .label_style((FONT_FAMILY, label_px))
        .axis_desc_style((FONT_FAMILY, fonts.description))
        .bold_line_style(BLACK.mix(0.12))
        .light_line_style(BLACK.mix(0.04))
        .draw()
        .map_err(|e| e.to_string())?;

    let first_color = spec.lines[0].color;
    if !band.is_empty() {
        let fill = first_color.mix(0.2);
        let polygon: Vec<(i64, f64)> = band
            .iter()
            .map(|&(x, _, high)| (x, high))
            .chain(band.iter().rev().map(|&(x, low, _)| (x, low)))
            .collect();
        let std_label = if band.len() > 1 {
            chart
                .draw_series(std::iter::once(Polygon::new(polygon, fill.filled())))
                .map_err(|e| e.to_string())?
        } else {
            let (x, low, high) = band[0];
            chart
                .draw_series(std::iter::once(PathElement::new(
                    vec![(x, low), (x, high)],
                    first_color.mix(0.5).stroke_width(3),
                )))
                .map_err(|e| e.to_string())?
        };
        std_label
            .label("± 1 std")
            .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 22, y + 6)], fill.filled()));
    }
    for (line, points) in spec.lines.iter().zip(&series) {
        let color = line.color;
        chart
            .draw_series(LineSeries::new(points.iter().copied(), color.stroke_width(2)))
            .map_err(|e| e.to_string())?
            .label(line.label.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 22, y)], color.stroke_width(2)));
        if points.len() <= 40 {
            chart
                .draw_series(points.iter().map(|&point| Circle::new(point, 3, color.filled())))
                .map_err(|e| e.to_string())?;
        }
    }
    if spec.lines.len() > 1 || !band.is_empty() {
        let drawn_points: Vec<(i64, f64)> = series
            .iter()
            .flatten()
            .copied()
            .chain(band.iter().flat_map(|&(x, low, high)| [(x, low), (x, high)]))
            .collect();
        chart
            .configure_series_labels()
            .position(legend_position(&drawn_points, x_extent, (y_low, y_high)))
            .label_font((FONT_FAMILY, label_px))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.3))
            .draw()
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// The place in the plot where the legend covers the fewest data points: a corner (the outer
/// 25% of the x range by the outer 20% of the y range) or the middle of the left or right
/// edge. Ties go to the earlier place in the order upper left, upper right, lower right, lower
/// left, middle right, middle left.
fn legend_position(points: &[(i64, f64)], x_range: (i64, i64), y_range: (f64, f64)) -> SeriesLabelPosition {
    let x_span = (x_range.1 - x_range.0).max(1) as f64;
    let y_span = y_range.1 - y_range.0;
    // (position, the x side: 0 left / 1 right, the y band as fractions of the range)
    let places = [
        (SeriesLabelPosition::UpperLeft, 0, (0.8, 1.0)),
        (SeriesLabelPosition::UpperRight, 1, (0.8, 1.0)),
        (SeriesLabelPosition::LowerRight, 1, (0.0, 0.2)),
        (SeriesLabelPosition::LowerLeft, 0, (0.0, 0.2)),
        (SeriesLabelPosition::MiddleRight, 1, (0.4, 0.6)),
        (SeriesLabelPosition::MiddleLeft, 0, (0.4, 0.6)),
    ];
    let mut best = (SeriesLabelPosition::UpperLeft, usize::MAX);
    for (position, side, (y_from, y_to)) in places {
        let covered = points
            .iter()
            .filter(|&&(x, y)| {
                let x = (x - x_range.0) as f64 / x_span;
                let y = (y - y_range.0) / y_span;
                let in_x = if side == 1 { x >= 0.75 } else { x <= 0.25 };
                in_x && (y_from..=y_to).contains(&y)
            })
            .count();
        if covered < best.1 {
            best = (position, covered);
        }
    }
    best.0
}

/// The step range all panels share: the first to the last step in the log.
fn step_range(log: &MetricsLog) -> (i64, i64) {
    match (log.steps.first(), log.steps.last()) {
        (Some(first), Some(last)) => (step_coordinate(first.step), step_coordinate(last.step)),
        _ => (0, 1),
    }
}

/// Renders into a white RGB canvas of `size` with `draw`, then encodes it as PNG.
fn render_png(
    size: (u32, u32),
    chart_name: &str,
    draw: impl FnOnce(&DrawingArea<BitMapBackend<'_>, Shift>) -> Result<(), String>,
) -> Result<Vec<u8>, PlotError> {
    register_embedded_font();
    let to_error = draw_error(chart_name);
    let (width, height) = size;
    let mut pixels = vec![255u8; width as usize * height as usize * 3];
    {
        let root = BitMapBackend::with_buffer(&mut pixels, size).into_drawing_area();
        root.fill(&WHITE).map_err(|e| to_error(e.to_string()))?;
        draw(&root).map_err(&to_error)?;
        root.present().map_err(|e| to_error(e.to_string()))?;
    }
    let mut png_bytes = Vec::new();
    {
        let mut encoder = png::Encoder::new(&mut png_bytes, width, height);
        encoder.set_color(png::ColorType::Rgb);
        encoder.set_depth(png::BitDepth::Eight);
        let mut writer = encoder
            .write_header()
            .map_err(|e| to_error(format!("PNG encoding: {e}")))?;
        writer
            .write_image_data(&pixels)
            .map_err(|e| to_error(format!("PNG encoding: {e}")))?;
    }
    Ok(png_bytes)
}

/// Renders one chart as a PNG of `size` pixels.
pub fn render_chart_png(spec: &ChartSpec, log: &MetricsLog, size: (u32, u32)) -> Result<Vec<u8>, PlotError> {
    let steps = step_range(log);
    render_png(size, spec.file_name, |root| draw_chart(root, spec, log, steps))
}

/// Renders every chart of `specs` in a grid of 3 columns under `title`, as a PNG of `size`.
pub fn render_overview_png(
    specs: &[ChartSpec],
    log: &MetricsLog,
    title: &str,
    size: (u32, u32),
) -> Result<Vec<u8>, PlotError> {
    let steps = step_range(log);
    render_png(size, OVERVIEW_FILE, |root| {
        let fonts = FontSizes::for_height(size.1 / 2);
        let body = root
            .titled(title, (FONT_FAMILY, fonts.title * 1.2))
            .map_err(|e| e.to_string())?;
        let columns = 3;
        let rows = specs.len().div_ceil(columns);
        for (panel, spec) in body.split_evenly((rows, columns)).iter().zip(specs) {
            draw_chart(panel, spec, log, steps)?;
        }
        Ok(())
    })
}

/// Writes `bytes` to `path` through a temporary file in the same directory, so a reader (a
/// browser showing the README) never sees half a PNG.
fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), PlotError> {
    let temporary = path.with_extension("png.partial");
    let write_error = |cause| PlotError::Write {
        path: path.to_path_buf(),
        cause,
    };
    std::fs::write(&temporary, bytes).map_err(write_error)?;
    std::fs::rename(&temporary, path).map_err(write_error)
}

/// Draws every chart and the overview of `log` into `directory` (created if missing); returns
/// the paths written, the overview last.
pub fn write_plots(log: &MetricsLog, directory: &Path, title: &str) -> Result<Vec<PathBuf>, PlotError> {
    std::fs::create_dir_all(directory).map_err(|cause| PlotError::Write {
        path: directory.to_path_buf(),
        cause,
    })?;
    let specs = chart_specs(log);
    let mut written = Vec::with_capacity(specs.len() + 1);
    for spec in &specs {
        let path = directory.join(spec.file_name);
        write_atomically(&path, &render_chart_png(spec, log, CHART_SIZE)?)?;
        written.push(path);
    }
    let path = directory.join(OVERVIEW_FILE);
    write_atomically(&path, &render_overview_png(&specs, log, title, OVERVIEW_SIZE)?)?;
    written.push(path);
    Ok(written)
}

/// Mean of the values, or `None` for an empty slice.
fn mean_of(values: &[f64]) -> Option<f64> {
    (!values.is_empty()).then(|| values.iter().sum::<f64>() / values.len() as f64)
}

/// The one-line summary: training steps, mean reward of the first and last 5 steps with reward,
/// and the first and last value of each validation line when there is any.
pub fn summary_line(log: &MetricsLog) -> String {
    let steps = log.training_steps();
    let mut text = match (steps.first(), steps.last()) {
        (Some(first), Some(last)) => format!(
            "{} training step{} (steps {first}..{last})",
            steps.len(),
            if steps.len() == 1 { "" } else { "s" }
        ),
        _ => "0 training steps".to_string(),
    };
    let rewards: Vec<f64> = log.series("critic/score/mean").into_iter().map(|p| p.1).collect();
    let window = rewards.len().min(5);
    match (
        mean_of(&rewards[..window]),
        mean_of(&rewards[rewards.len() - window..]),
    ) {
        (Some(first), Some(last)) => text.push_str(&format!(
            "; mean reward first {window}: {first:.3}, last {window}: {last:.3} ({:+.3})",
            last - first
        )),
        _ => text.push_str("; no critic/score/mean values yet"),
    }
    for line in &chart_specs(log)[1].lines {
        let points = log.series(&line.key);
        if let (Some(first), Some(last)) = (points.first(), points.last()) {
            let what = if line.key == "val/accuracy" {
                "accuracy"
            } else {
                &line.label
            };
            text.push_str(&format!(
                "; validation {what} {:.3} (step {}) -> {:.3} (step {})",
                first.1, first.0, last.1, last.0
            ));
        }
    }
    text
}

/// Runs `grpo plot`.
pub fn run(args: PlotArgs) -> anyhow::Result<ExitCode> {
    let (metrics_path, run_directory) = if args.run.is_file() {
        let parent = args
            .run
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from("."));
        (args.run.clone(), parent)
    } else {
        (args.run.join("metrics.jsonl"), args.run.clone())
    };
    let log = read_metrics(&metrics_path)?;
    if log.partial_last_line {
        tracing::warn!(
            "{}: the last line is incomplete (the run is probably writing it); plotted the \
             steps before it",
            metrics_path.display()
        );
    }
    if log.training_steps().is_empty() {
        let detail = if log.steps.is_empty() {
            " (the file has no metrics lines)".to_string()
        } else {
            format!(
                " (only validation metrics, for step {})",
                log.steps
                    .iter()
                    .map(|s| s.step.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        };
        return Err(PlotError::NoSteps {
            path: metrics_path,
            detail,
        }
        .into());
    }
    let output = args.output.unwrap_or_else(|| run_directory.join("plots"));
    let run_name = run_directory
        .canonicalize()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| run_directory.display().to_string());
    let training_steps = log.training_steps().len();
    let title = format!(
        "grpo run {run_name}: {training_steps} training step{}",
        if training_steps == 1 { "" } else { "s" }
    );
    for path in write_plots(&log, &output, &title)? {
        println!("{}", path.display());
    }
    println!("{}", summary_line(&log));
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<MetricsLog, PlotError> {
        parse_metrics(text, Path::new("runs/x/metrics.jsonl"))
    }

    /// Decodes a PNG: (width, height, RGB pixels).
    fn decode(png_bytes: &[u8]) -> (u32, u32, Vec<u8>) {
        let decoder = png::Decoder::new(std::io::Cursor::new(png_bytes));
        let mut reader = decoder.read_info().expect("PNG header");
        let mut pixels = vec![0; reader.output_buffer_size().expect("buffer size")];
        let info = reader.next_frame(&mut pixels).expect("PNG frame");
        assert_eq!(info.color_type, png::ColorType::Rgb);
        pixels.truncate(info.buffer_size());
        (info.width, info.height, pixels)
    }

    /// Pixels in rows `rows` that are not white.
    fn ink(pixels: &[u8], width: u32, rows: std::ops::Range<u32>) -> usize {
        let row_bytes = width as usize * 3;
        pixels[rows.start as usize * row_bytes..rows.end as usize * row_bytes]
            .chunks(3)
            .filter(|p| p != &[255, 255, 255])
            .count()
    }

    fn count_color(pixels: &[u8], color: RGBColor) -> usize {
        pixels
            .chunks(3)
            .filter(|p| p == &[color.0, color.1, color.2])
            .count()
    }

    fn rising_log(steps: u64) -> MetricsLog {
        let mut text = String::from("{\"step\": 0, \"val/accuracy\": 0.2}\n");
        for step in 1..=steps {
            let reward = 0.1 + 0.05 * step as f64;
            text.push_str(&format!(
                "{{\"step\": {step}, \"reward/mean\": {reward}, \"reward/std\": 0.1, \
                 \"actor/kl\": {}, \"actor/entropy\": 1.5, \"response_length/mean\": 40, \
                 \"perf/gen_tokens_per_s\": 1200.5, \"perf/train_tokens_per_s\": 3400}}\n",
                0.001 * step as f64
            ));
            if step.is_multiple_of(4) {
                text.push_str(&format!(
                    "{{\"step\": {step}, \"val/accuracy\": {}}}\n",
                    0.2 + 0.1 * (step / 4) as f64
                ));
            }
        }
        parse(&text).expect("valid metrics")
    }

    #[test]
    fn parses_missing_keys_nulls_and_non_finite_values() {
        let log = parse(
            "{\"step\": 0, \"val/accuracy\": 0.25}\n\
             \n\
             {\"step\": 1, \"reward/mean\": 0.5, \"actor/kl\": null, \"note\": \"warmup\"}\n\
             {\"step\": 2, \"reward/mean\": NaN, \"actor/kl\": 0.01, \"actor/lr\": \"inf\"}\n\
             {\"step\": 3, \"reward/mean\": 0.75, \"actor/kl\": -Infinity, \"tag\": \"NaN in a string\"}\n",
        )
        .expect("valid metrics");
        assert!(!log.partial_last_line);
        assert_eq!(log.steps.iter().map(|s| s.step).collect::<Vec<_>>(), [0, 1, 2, 3]);
        assert_eq!(log.series("critic/score/mean"), [(1, 0.5), (3, 0.75)]);
        assert_eq!(log.series("actor/kl"), [(2, 0.01)]);
        assert_eq!(log.series("val/accuracy"), [(0, 0.25)]);
        assert!(log.series("actor/lr").is_empty());
        assert!(log.series("actor/entropy").is_empty());
        assert_eq!(log.training_steps(), [1, 2, 3]);
    }

    #[test]
    fn repeated_steps_the_later_line_wins() {
        let log = parse(
            "{\"step\": 1, \"reward/mean\": 0.1}\n\
             {\"step\": 2, \"reward/mean\": 0.2, \"actor/kl\": 0.5}\n\
             {\"step\": 3, \"reward/mean\": 0.3}\n\
             {\"step\": 4, \"reward/mean\": 0.4}\n\
             {\"step\": 3, \"reward/mean\": 0.35}\n\
             {\"step\": 3, \"val/accuracy\": 0.6}\n\
             {\"step\": 4, \"reward/mean\": 0.45}\n\
             {\"step\": 2, \"reward/mean\": 0.22, \"actor/kl\": null}\n\
             {\"step\": 2, \"val/accuracy\": 0.5}\n",
        )
        .expect("valid metrics");
        // The resumed run went back to step 2 twice: only its lines count from there on.
        assert_eq!(log.series("critic/score/mean"), [(1, 0.1), (2, 0.22)]);
        assert_eq!(log.series("val/accuracy"), [(2, 0.5)]);
        assert!(log.series("actor/kl").is_empty());

        let merged = parse(
            "{\"step\": 5, \"reward/mean\": 0.5, \"actor/kl\": 0.1}\n\
             {\"step\": 5, \"actor/kl\": 0.2, \"val/accuracy\": 0.9}\n",
        )
        .expect("valid metrics");
        assert_eq!(merged.steps.len(), 1);
        assert_eq!(merged.series("critic/score/mean"), [(5, 0.5)]);
        assert_eq!(merged.series("actor/kl"), [(5, 0.2)]);
        assert_eq!(merged.series("val/accuracy"), [(5, 0.9)]);
    }

    #[test]
    fn a_half_written_last_line_is_skipped_but_not_one_in_the_middle() {
        let log = parse("{\"step\": 1, \"reward/mean\": 0.5}\n{\"step\": 2, \"rew")
            .expect("partial last line is tolerated");
        assert!(log.partial_last_line);
        assert_eq!(log.series("critic/score/mean"), [(1, 0.5)]);

        let error =
            parse("{\"step\": 1, \"reward/mean\": 0.5}\n{\"step\": 2, \"rew{\"step\": 2}\n{\"step\": 3}\n")
                .unwrap_err();
        let message = error.to_string();
        assert!(
            message.starts_with("runs/x/metrics.jsonl:2: not valid JSON ("),
            "{message}"
        );
        assert!(message.contains("column"), "{message}");
    }

    #[test]
    fn bad_lines_are_reported_with_file_line_and_problem() {
        let cases = [
            (
                "{\"step\": 1}\n[1, 2]\n",
                "runs/x/metrics.jsonl:2: expected a JSON object, found an array; every line",
            ),
            (
                "\n\n{\"reward/mean\": 0.5}\n",
                "runs/x/metrics.jsonl:3: no `step` key;",
            ),
            (
                "{\"step\": -4}\n",
                "runs/x/metrics.jsonl:1: `step` must be a non-negative integer, found -4;",
            ),
            (
                "{\"step\": \"7\"}\n",
                "runs/x/metrics.jsonl:1: `step` must be a non-negative integer, found \"7\";",
            ),
            (
                "{\"step\": 1, \"reward/mean\": \"high\"}\n",
                "runs/x/metrics.jsonl:1: `reward/mean` must be a number or null, found \"high\";",
            ),
        ];
        for (text, expected) in cases {
            let message = parse(text).unwrap_err().to_string();
            assert!(message.starts_with(expected), "{message}");
        }
    }

    #[test]
    fn missing_file_says_to_run_grpo_run_first() {
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("metrics.jsonl");
        let message = read_metrics(&path).unwrap_err().to_string();
        assert!(message.contains("metrics.jsonl: no such file"), "{message}");
        assert!(message.contains("run `grpo run RECIPE` first"), "{message}");
    }

    #[test]
    fn replaces_bare_non_finite_tokens_outside_strings_only() {
        assert_eq!(
            replace_bare_non_finite(r#"{"a": NaN, "b": "NaN \"Infinity\"", "c": -Infinity}"#).as_deref(),
            Some(r#"{"a": null, "b": "NaN \"Infinity\"", "c": null}"#)
        );
        assert_eq!(replace_bare_non_finite(r#"{"a": 1}"#), None);
    }

    #[test]
    fn tick_labels_are_short_and_distinct() {
        assert_eq!(tick_label(0.2, 1.0), "0.2");
        assert_eq!(tick_label(0.25, 1.0), "0.25");
        assert_eq!(tick_label(1.0, 1.0), "1");
        assert_eq!(tick_label(12000.0, 5000.0), "12000");
        assert_eq!(tick_label(0.0003, 0.0005), "0.0003");
        assert_eq!(tick_label(2e-6, 5e-6), "2.00e-6");
        assert_eq!(tick_label(-0.0000001, 1.0), "0");
        assert_eq!(tick_label(0.0, 3.0), "0");
        assert_eq!(tick_label(-8.47e-22, 6e-6), "0");
    }

    #[test]
    fn the_legend_goes_where_no_points_are() {
        let rising: Vec<(i64, f64)> = (0..=10).map(|x| (x, x as f64 / 10.0)).collect();
        assert_eq!(
            legend_position(&rising, (0, 10), (0.0, 1.0)),
            SeriesLabelPosition::UpperLeft
        );
        let falling: Vec<(i64, f64)> = (0..=10).map(|x| (x, 1.0 - x as f64 / 10.0)).collect();
        assert_eq!(
            legend_position(&falling, (0, 10), (0.0, 1.0)),
            SeriesLabelPosition::UpperRight
        );
        // Two flat lines, one high and one low: every corner is taken, the right middle is free.
        let flat: Vec<(i64, f64)> = (0..=10).flat_map(|x| [(x, 0.1), (x, 0.9)]).collect();
        assert_eq!(
            legend_position(&flat, (0, 10), (0.0, 1.0)),
            SeriesLabelPosition::MiddleRight
        );
    }

    #[test]
    fn y_range_pads_and_handles_flat_series() {
        assert_eq!(y_range(0.2, 0.9, true), (0.0, 1.0));
        let (low, high) = y_range(0.0, 1.0, false);
        assert!((low + 0.08).abs() < 1e-12 && (high - 1.08).abs() < 1e-12);
        assert_eq!(y_range(5.0, 5.0, false), (4.5, 5.5));
        assert_eq!(y_range(0.0, 0.0, false), (-1.0, 1.0));
        assert_eq!(y_range(0.5, 1.5, true).0, 0.5 - 0.08);
    }

    #[test]
    fn renders_a_reward_chart_with_text_band_and_line() {
        let log = rising_log(12);
        let spec = &chart_specs(&log)[0];
        let (width, height, pixels) =
            decode(&render_chart_png(spec, &log, CHART_SIZE).expect("chart renders"));
        assert_eq!((width, height), CHART_SIZE);
        let total = ink(&pixels, width, 0..height);
        assert!(
            total > 20_000,
            "only {total} non-white pixels: the chart is nearly blank"
        );
        // The title row holds text drawn with the embedded font.
        let title_ink = ink(&pixels, width, 0..30);
        assert!(
            title_ink > 300,
            "title rows have {title_ink} inked pixels: no text"
        );
        // The mean line in its exact colour, and the ±std band as a lighter blend of it.
        assert!(count_color(&pixels, BLUE_LINE) > 500);
        let band = BLUE_LINE.mix(0.2);
        let blend = |c: u8| (0.2 * f64::from(c) + 0.8 * 255.0) as u8;
        let band_pixels = pixels
            .chunks(3)
            .filter(|p| {
                p.iter()
                    .zip([band.0, band.1, band.2])
                    .all(|(&a, b)| a.abs_diff(blend(b)) <= 2)
            })
            .count();
        assert!(band_pixels > 5_000, "band covers {band_pixels} pixels");
    }

    #[test]
    fn a_chart_without_values_says_so_instead_of_failing() {
        let log = parse("{\"step\": 1, \"reward/mean\": 0.5}\n").unwrap();
        let spec = &chart_specs(&log)[1];
        let (width, height, pixels) =
            decode(&render_chart_png(spec, &log, (400, 300)).expect("chart renders"));
        assert_eq!((width, height), (400, 300));
        // Title and the centred message, but no axes and no data line.
        assert!(ink(&pixels, width, 0..40) > 100);
        assert!(ink(&pixels, width, 130..170) > 100);
        assert_eq!(count_color(&pixels, GREEN_LINE), 0);
    }

    #[test]
    fn renders_the_overview_with_every_panel() {
        let log = rising_log(8);
        let specs = chart_specs(&log);
        let (width, height, pixels) = decode(
            &render_overview_png(&specs, &log, "grpo run test: 8 training steps", (900, 540))
                .expect("overview renders"),
        );
        assert_eq!((width, height), (900, 540));
        for line in specs.iter().flat_map(|s| &s.lines) {
            assert!(
                count_color(&pixels, line.color) > 50,
                "no pixels of the {} line",
                line.key
            );
        }
    }

    #[test]
    fn writes_all_charts_and_summarises_the_reward() {
        let log = rising_log(12);
        let directory = tempfile::tempdir().unwrap();
        let plots = directory.path().join("plots");
        let written = write_plots(&log, &plots, "test").expect("plots written");
        let names: Vec<String> = written
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            names,
            [
                "reward.png",
                "val_accuracy.png",
                "kl.png",
                "entropy.png",
                "response_length.png",
                "throughput.png",
                "overview.png"
            ]
        );
        for path in &written {
            let (width, height, _) = decode(&std::fs::read(path).unwrap());
            let expected = if path.ends_with(OVERVIEW_FILE) {
                OVERVIEW_SIZE
            } else {
                CHART_SIZE
            };
            assert_eq!((width, height), expected, "{}", path.display());
        }
        // Rewards 0.15, 0.20, ... 0.70: first five average 0.25, last five 0.60.
        assert_eq!(
            summary_line(&log),
            "12 training steps (steps 1..12); mean reward first 5: 0.250, last 5: 0.600 \
             (+0.350); validation accuracy 0.200 (step 0) -> 0.500 (step 12)"
        );
    }

    #[test]
    fn verl_named_files_chart_each_data_sources_validation_and_old_files_read_as_new() {
        let log = parse(
            "{\"step\": 0, \"val-core/openai/gsm8k/acc/mean@4\": 0.25, \"val-aux/openai/gsm8k/acc/std@4\": 0.1, \
             \"val-core/lighteval/MATH/reward/mean@4\": 0.5}\n\
             {\"step\": 1, \"critic/score/mean\": 0.4, \"critic/score/std\": 0.1, \"timing_s/update_weights\": 2}\n\
             {\"step\": 2, \"reward/mean\": 0.6, \"reward/std\": 0.1, \"timing_s/sync\": 3, \
             \"val-core/openai/gsm8k/acc/mean@4\": 0.75, \"val-core/lighteval/MATH/reward/mean@4\": 0.625}\n",
        )
        .unwrap();
        assert_eq!(log.training_steps(), [1, 2]);
        assert_eq!(log.series("critic/score/mean"), [(1, 0.4), (2, 0.6)]);
        assert_eq!(log.series("timing_s/update_weights"), [(1, 2.0), (2, 3.0)]);
        let specs = chart_specs(&log);
        let lines: Vec<(&str, &str)> = specs[1]
            .lines
            .iter()
            .map(|l| (l.key.as_str(), l.label.as_str()))
            .collect();
        assert_eq!(
            lines,
            [
                (
                    "val-core/lighteval/MATH/reward/mean@4",
                    "lighteval/MATH reward mean@4"
                ),
                ("val-core/openai/gsm8k/acc/mean@4", "openai/gsm8k acc mean@4"),
            ]
        );
        assert_eq!(
            summary_line(&log),
            "2 training steps (steps 1..2); mean reward first 2: 0.500, last 2: 0.500 (+0.000); \
             validation lighteval/MATH reward mean@4 0.500 (step 0) -> 0.625 (step 2); \
             validation openai/gsm8k acc mean@4 0.250 (step 0) -> 0.750 (step 2)"
        );
        let (width, height, pixels) =
            decode(&render_chart_png(&specs[1], &log, CHART_SIZE).expect("chart renders"));
        assert_eq!((width, height), CHART_SIZE);
        assert!(count_color(&pixels, GREEN_LINE) > 50 && count_color(&pixels, BLUE_LINE) > 50);
    }
}
