//! A run's metrics: their type and `OUTPUT/metrics.jsonl` (one JSON object per step, flushed as
//! it is written, so a crash loses at most the step in progress). What goes into a step's is
//! `step_metrics.rs`'s; the progress display on stderr is `progress.rs`'s.
//!
//! Every start or resume first writes a header line, `{"run": ...}` (devices, compute types
//! and why `auto` chose them, the learner's and the rollout's meshes by axis), which readers of
//! the steps skip.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

/// One step's metrics, by name.
pub type Metrics = BTreeMap<String, f64>;

/// Appends one JSON line per step to `OUTPUT/metrics.jsonl`.
pub struct MetricsLog {
    path: PathBuf,
    file: File,
}

impl MetricsLog {
    /// Opens (appending) `dir/metrics.jsonl`.
    pub fn open(dir: &Path) -> std::io::Result<MetricsLog> {
        let path = dir.join("metrics.jsonl");
        let file = OpenOptions::new().create(true).append(true).open(&path)?;
        Ok(MetricsLog { path, file })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes the header of a run's start (or resume): `{"run": header}`, a line with no
    /// `step`, which readers of the steps skip.
    pub fn write_header(&mut self, header: serde_json::Value) -> std::io::Result<()> {
        let mut line = serde_json::json!({ "run": header }).to_string();
        line.push('\n');
        self.file.write_all(line.as_bytes())?;
        self.file.flush()
    }

    /// Writes `{"step": step, ...metrics}`; non-finite values become `null`.
    pub fn write(&mut self, step: u64, metrics: &Metrics) -> std::io::Result<()> {
        let mut obj = serde_json::Map::new();
        obj.insert("step".into(), step.into());
        for (k, v) in metrics {
            let value = serde_json::Number::from_f64(*v)
                .map(serde_json::Value::Number)
                .unwrap_or(serde_json::Value::Null);
            obj.insert(k.clone(), value);
        }
        let mut line = serde_json::Value::Object(obj).to_string();
        line.push('\n');
        self.file.write_all(line.as_bytes())?;
        self.file.flush()
    }
}

/// Mean and unbiased standard deviation (`torch.std`, as VeRL computes `critic/score/std`).
pub fn mean_std(values: &[f64]) -> (f64, f64) {
    let n = values.len() as f64;
    if values.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    let mean = values.iter().sum::<f64>() / n;
    let var = if values.len() > 1 {
        values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0)
    } else {
        0.0
    };
    (mean, var.sqrt())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_lines_are_json_with_null_for_non_finite() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = MetricsLog::open(dir.path()).unwrap();
        let mut m = Metrics::new();
        m.insert("reward/mean".into(), 0.5);
        m.insert("actor/kl".into(), f64::NAN);
        log.write(3, &m).unwrap();
        log.write(4, &m).unwrap();
        let text = std::fs::read_to_string(log.path()).unwrap();
        let lines: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0]["step"], 3);
        assert_eq!(lines[0]["reward/mean"], 0.5);
        assert!(lines[0]["actor/kl"].is_null());
    }

    #[test]
    fn std_is_unbiased() {
        let (m, s) = mean_std(&[1.0, 0.0, 1.0, 0.0]);
        assert_eq!(m, 0.5);
        assert!((s - (1.0f64 / 3.0).sqrt()).abs() < 1e-12);
        assert_eq!(mean_std(&[2.0]), (2.0, 0.0));
    }
}
