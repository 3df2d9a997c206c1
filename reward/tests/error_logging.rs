//! The pool logs the first `log_first_errors` scoring errors in full through `tracing`, then one
//! note that further errors are only counted. (Own test binary: it installs a global subscriber,
//! because the messages come from the pool's worker threads.)

use std::fmt::Write as _;
use std::sync::{Arc, Mutex};

use reward::{PoolOptions, RewardFunction, RewardPool, Sample};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

/// Collects every event as `LEVEL field=value ...`.
struct Capture(Arc<Mutex<Vec<String>>>);

struct Fields(String);

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        let _ = write!(self.0, "{}={:?} ", field.name(), value);
    }
}

impl Subscriber for Capture {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, event: &Event<'_>) {
        let mut fields = Fields(String::new());
        event.record(&mut fields);
        self.0
            .lock()
            .unwrap()
            .push(format!("{} {}", event.metadata().level(), fields.0.trim_end()));
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

#[test]
fn first_errors_are_logged_then_only_counted() {
    let events = Arc::new(Mutex::new(Vec::new()));
    tracing::subscriber::set_global_default(Capture(events.clone())).unwrap();
    let pool = RewardPool::new(
        Arc::new(RewardFunction::new()),
        PoolOptions {
            num_workers: 2,
            log_first_errors: 2,
            ..PoolOptions::default()
        },
    );
    let samples = (0..5).map(|id| Sample {
        id,
        data_source: format!("unknown/{id}"),
        prompt: serde_json::Value::Null,
        response: String::new(),
        ground_truth: String::new(),
        extra: serde_json::Value::Null,
        response_length: 0,
        truncated: false,
    });
    let results = pool.score_all(samples).unwrap();
    assert!(results.iter().all(|r| r.score == 0.0 && r.error.is_some()));
    assert_eq!(pool.metrics().errors, 5);
    let events = events.lock().unwrap().clone();
    let warnings: Vec<&String> = events.iter().filter(|e| e.starts_with("WARN")).collect();
    assert_eq!(warnings.len(), 3, "{events:#?}");
    // Workers log concurrently, so the order of the three lines is not fixed.
    let (full, notes): (Vec<&String>, Vec<&String>) = warnings
        .iter()
        .partition(|w| w.contains("reward error (sample scored 0)"));
    assert_eq!(full.len(), 2, "{warnings:#?}");
    for warning in full {
        assert!(
            warning.contains("no scorer for data_source `unknown/"),
            "{warning}"
        );
        assert!(warning.contains("kind=\"no_scorer\""), "{warning}");
    }
    assert_eq!(notes.len(), 1, "{warnings:#?}");
    assert!(
        notes[0].contains("more reward errors: counted in the metrics, no longer logged"),
        "{}",
        notes[0]
    );
}
