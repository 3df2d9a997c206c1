//! The progress display on stderr: a bar on a terminal, one line per step otherwise.

use super::metrics::Metrics;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;

/// The progress display.
pub struct Progress {
    bar: Option<ProgressBar>,
    total: u64,
    /// A line per step (`trainer.logger` lists `console`).
    step_lines: bool,
}

impl Progress {
    /// A bar when stderr is a terminal (and `quiet` is off), plain lines otherwise; a line per
    /// step only with `step_lines`.
    pub fn new(start: u64, total: u64, quiet: bool, step_lines: bool) -> Progress {
        let bar = (!quiet && std::io::stderr().is_terminal()).then(|| {
            let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
            bar.set_style(
                ProgressStyle::with_template(
                    "{spinner} step {pos}/{len} [{bar:30}] {msg} (elapsed {elapsed}, ETA {eta})",
                )
                .expect("valid template")
                .progress_chars("=> "),
            );
            bar.set_position(start);
            bar.enable_steady_tick(std::time::Duration::from_millis(250));
            bar
        });
        Progress {
            bar,
            total,
            step_lines,
        }
    }

    /// Shows what the run is doing now (generating, updating, validating...).
    pub fn phase(&self, what: &str) {
        if let Some(bar) = &self.bar {
            bar.set_message(what.to_string());
        }
    }

    /// Reports a finished step.
    pub fn step_done(&self, step: u64, m: &Metrics) {
        if let (Some(bar), false) = (&self.bar, self.step_lines) {
            bar.set_position(step);
        }
        if !self.step_lines {
            return;
        }
        let get = |k: &str| m.get(k).copied().unwrap_or(f64::NAN);
        let summary = format!(
            "reward {:.3} ± {:.3}, length {:.0}, {:.0} gen tok/s, {:.0} train tok/s, step {:.1}s",
            get("critic/score/mean"),
            get("critic/score/std"),
            get("response_length/mean"),
            get("perf/gen_tokens_per_s"),
            get("perf/train_tokens_per_s"),
            get("timing_s/step"),
        );
        let core = super::val_metrics::core_means(m);
        let val = if core.is_empty() {
            core
        } else {
            format!(", validation {core}")
        };
        match &self.bar {
            Some(bar) => {
                bar.set_position(step);
                bar.set_message(format!("reward {:.3}", get("critic/score/mean")));
                bar.println(format!("step {step}/{}: {summary}{val}", self.total));
            }
            None => eprintln!("step {step}/{}: {summary}{val}", self.total),
        }
    }

    /// A line of its own (validation results, events).
    pub fn note(&self, line: &str) {
        match &self.bar {
            Some(bar) => bar.println(line),
            None => eprintln!("{line}"),
        }
    }

    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}
