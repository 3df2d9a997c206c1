//! TensorBoard event files, written here: `events.out.tfevents.<time>.<host>.<pid>.<n>` in
//! `$TENSORBOARD_DIR` (VeRL's variable), else `OUTPUT/tensorboard`.
//!
//! The file is a sequence of TFRecords (length, masked CRC-32C of the length, an `Event`
//! protobuf, masked CRC-32C of it). Each step's metrics are one `Event` with a `Summary` of
//! `simple_value`s, tagged with the metric's name; the file is flushed after every step. A
//! resumed run first writes a `SessionLog` START at the step after its checkpoint, which tells
//! TensorBoard to drop the older file's events from that step on (they were not kept by the
//! resume), so the curves show each step once; a new run in its own output directory writes
//! one at step 0, so a previous run's curves there go as its `metrics.jsonl` does. (In a
//! `$TENSORBOARD_DIR` the user chose, which other runs may share, a new run drops nothing.)

use crate::{Generation, Logger, Metrics, Sink, TrackingConfig};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

/// `tensorflow.Event` (the fields written here).
#[derive(Clone, PartialEq, prost::Message)]
pub struct Event {
    #[prost(double, tag = "1")]
    pub wall_time: f64,
    #[prost(int64, tag = "2")]
    pub step: i64,
    #[prost(oneof = "What", tags = "3, 5, 7")]
    pub what: Option<What>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum What {
    #[prost(string, tag = "3")]
    FileVersion(String),
    #[prost(message, tag = "5")]
    Summary(Summary),
    #[prost(message, tag = "7")]
    SessionLog(SessionLog),
}

/// `tensorflow.Summary`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Summary {
    #[prost(message, repeated, tag = "1")]
    pub value: Vec<SummaryValue>,
}

/// `tensorflow.Summary.Value`: a scalar, or a tensor with the plugin that shows it (text).
#[derive(Clone, PartialEq, prost::Message)]
pub struct SummaryValue {
    #[prost(string, tag = "1")]
    pub tag: String,
    #[prost(float, optional, tag = "2")]
    pub simple_value: Option<f32>,
    #[prost(message, optional, tag = "8")]
    pub tensor: Option<TensorProto>,
    #[prost(message, optional, tag = "9")]
    pub metadata: Option<SummaryMetadata>,
}

/// `tensorflow.TensorProto`, here a scalar string (`DT_STRING` is 7).
#[derive(Clone, PartialEq, prost::Message)]
pub struct TensorProto {
    #[prost(int32, tag = "1")]
    pub dtype: i32,
    #[prost(message, optional, tag = "2")]
    pub tensor_shape: Option<TensorShape>,
    #[prost(bytes = "vec", repeated, tag = "8")]
    pub string_val: Vec<Vec<u8>>,
}

/// `tensorflow.TensorShapeProto` with no dimensions: a scalar.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TensorShape {}

/// `tensorflow.SummaryMetadata`: which plugin shows the value.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SummaryMetadata {
    #[prost(message, optional, tag = "1")]
    pub plugin_data: Option<PluginData>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct PluginData {
    #[prost(string, tag = "1")]
    pub plugin_name: String,
}

/// `tensorflow.SessionLog`; status 1 is START.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SessionLog {
    #[prost(int32, tag = "1")]
    pub status: i32,
}

const CRC32C: crc::Crc<u32> = crc::Crc::<u32>::new(&crc::CRC_32_ISCSI);

/// TFRecord's checksum: CRC-32C rotated right by 15 bits plus a constant.
fn masked_crc(bytes: &[u8]) -> u32 {
    let crc = CRC32C.checksum(bytes);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// One TFRecord: the framing TensorBoard reads.
pub fn record(data: &[u8]) -> Vec<u8> {
    let length = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&length);
    out.extend_from_slice(&masked_crc(&length).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc(data).to_le_bytes());
    out
}

/// The TensorBoard logger of a run.
pub struct TensorBoard {
    path: PathBuf,
    file: File,
}

impl TensorBoard {
    pub fn start(config: &TrackingConfig) -> Result<TensorBoard, String> {
        let shared = config.var("TENSORBOARD_DIR").map(PathBuf::from);
        let dir = shared
            .clone()
            .unwrap_or_else(|| config.output.join("tensorboard"));
        let mut writer = TensorBoard::create(&dir)?;
        // TensorBoard drops the earlier files' events at the restart's step and after: those of
        // the steps a resume does again, or, in the run's own directory, a previous run's.
        let restart = if config.resume {
            Some(config.start_step as i64 + 1)
        } else if shared.is_none() {
            Some(0)
        } else {
            None
        };
        if let Some(step) = restart {
            writer.write(&Event {
                wall_time: now(),
                step,
                what: Some(What::SessionLog(SessionLog { status: 1 })),
            })?;
        }
        Ok(writer)
    }

    /// A new event file in `dir` (created if missing), its version record written.
    pub fn create(dir: &Path) -> Result<TensorBoard, String> {
        std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "localhost".into());
        let seconds = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        static FILES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = FILES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = dir.join(format!(
            "events.out.tfevents.{seconds}.{host}.{}.{n}",
            std::process::id()
        ));
        let file = File::create(&path).map_err(|e| format!("cannot create {}: {e}", path.display()))?;
        let mut writer = TensorBoard { path, file };
        writer.write(&Event {
            wall_time: now(),
            step: 0,
            what: Some(What::FileVersion("brain.Event:2".into())),
        })?;
        Ok(writer)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn write(&mut self, event: &Event) -> Result<(), String> {
        let bytes = record(&prost::Message::encode_to_vec(event));
        self.file
            .write_all(&bytes)
            .and_then(|()| self.file.flush())
            .map_err(|e| format!("cannot write {}: {e}", self.path.display()))
    }
}

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

impl Sink for TensorBoard {
    fn logger(&self) -> Logger {
        Logger::Tensorboard
    }

    fn log(&mut self, step: u64, metrics: &Metrics) -> Result<(), String> {
        let value = metrics
            .iter()
            .map(|(tag, v)| SummaryValue {
                tag: tag.clone(),
                simple_value: Some(*v as f32),
                ..Default::default()
            })
            .collect();
        self.write(&Event {
            wall_time: now(),
            step: step as i64,
            what: Some(What::Summary(Summary { value })),
        })
    }

    /// A text summary `val/generations` in VeRL's markdown (TensorBoard's Text tab).
    fn log_generations(&mut self, step: u64, generations: &[Generation]) -> Result<(), String> {
        let mut text = format!("**Generation Results - Step {step}**\n\n");
        for (i, g) in generations.iter().enumerate() {
            text.push_str(&format!(
                "### Sample {}\n**Input:** {}\n\n**Output:** {}\n\n**Score:** {}\n\n---\n\n",
                i + 1,
                g.input,
                g.output,
                g.score
            ));
        }
        let value = SummaryValue {
            tag: "val/generations".into(),
            tensor: Some(TensorProto {
                dtype: 7,
                tensor_shape: Some(TensorShape {}),
                string_val: vec![text.into_bytes()],
            }),
            metadata: Some(SummaryMetadata {
                plugin_data: Some(PluginData {
                    plugin_name: "text".into(),
                }),
            }),
            ..Default::default()
        };
        self.write(&Event {
            wall_time: now(),
            step: step as i64,
            what: Some(What::Summary(Summary { value: vec![value] })),
        })
    }

    fn finish(&mut self, _ok: bool) -> Result<(), String> {
        self.file
            .sync_all()
            .map_err(|e| format!("cannot write {}: {e}", self.path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_carry_tfrecord_checksums() {
        // CRC-32C of "123456789" is 0xE3069283 (the catalogue's check value).
        assert_eq!(CRC32C.checksum(b"123456789"), 0xe306_9283);
        let r = record(b"abc");
        assert_eq!(r.len(), 8 + 4 + 3 + 4);
        assert_eq!(&r[..8], &3u64.to_le_bytes());
        assert_eq!(&r[12..15], b"abc");
        assert_eq!(
            u32::from_le_bytes(r[15..].try_into().unwrap()),
            masked_crc(b"abc")
        );
    }
}
