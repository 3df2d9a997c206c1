//! The raw PJRT client that every buffer and executable keeps alive (destroyed after the last
//! of them), and what it records: its devices and the copies made through it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::error::{Error, Result};
use super::plugin::{args, pjrt_call, Plugin};
use super::sys::*;

/// Memory of a device, as far as the plugin reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceMemory {
    /// Bytes the device may allocate (`bytes_limit`), when reported.
    pub bytes_limit: Option<u64>,
    /// Bytes allocated now.
    pub bytes_in_use: u64,
}

/// One addressable device of a client.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    /// Index in [`Client::devices`] (what `buffer_from_host` and `Buffer::device` use).
    pub index: usize,
    /// The plugin's global device id.
    pub id: i32,
    /// The device kind (`cpu`, `NVIDIA H100 80GB HBM3`, `TPU v5 lite`, ...).
    pub kind: String,
    /// The plugin's description of the device.
    pub description: String,
    /// Memory statistics, when the plugin reports them.
    pub memory: Option<DeviceMemory>,
}

/// Copies between the host and a client's devices (and between its devices) since the client
/// was created: how many and how many bytes. Every upload (`buffer_from_host`,
/// `buffer_from_bytes`) is a host-to-device copy, every read-back (`to_host`, `to_host_into`,
/// `to_bytes`) a device-to-host copy, `copy_to_device` a device-to-device copy; program runs
/// and their results are none of these. Take two snapshots and subtract
/// ([`TransferStats::since`]) to count what a piece of work moved.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TransferStats {
    /// Host-to-device copies.
    pub host_to_device: u64,
    /// Bytes of host-to-device copies.
    pub host_to_device_bytes: u64,
    /// Device-to-host copies.
    pub device_to_host: u64,
    /// Bytes of device-to-host copies.
    pub device_to_host_bytes: u64,
    /// Device-to-device copies (`Buffer::copy_to_device`).
    pub device_to_device: u64,
    /// Bytes of device-to-device copies.
    pub device_to_device_bytes: u64,
}

impl TransferStats {
    /// Copies in either direction between the host and the devices.
    pub fn host_transfers(&self) -> u64 {
        self.host_to_device + self.device_to_host
    }

    /// Bytes copied in either direction between the host and the devices.
    pub fn host_bytes(&self) -> u64 {
        self.host_to_device_bytes + self.device_to_host_bytes
    }

    /// What was copied between `earlier` (a snapshot of the same client) and this snapshot.
    pub fn since(&self, earlier: &TransferStats) -> TransferStats {
        TransferStats {
            host_to_device: self.host_to_device.saturating_sub(earlier.host_to_device),
            host_to_device_bytes: self
                .host_to_device_bytes
                .saturating_sub(earlier.host_to_device_bytes),
            device_to_host: self.device_to_host.saturating_sub(earlier.device_to_host),
            device_to_host_bytes: self
                .device_to_host_bytes
                .saturating_sub(earlier.device_to_host_bytes),
            device_to_device: self.device_to_device.saturating_sub(earlier.device_to_device),
            device_to_device_bytes: self
                .device_to_device_bytes
                .saturating_sub(earlier.device_to_device_bytes),
        }
    }
}

/// The live counters behind [`TransferStats`], one set per client.
#[derive(Debug, Default)]
pub(crate) struct TransferCounters {
    host_to_device: AtomicU64,
    host_to_device_bytes: AtomicU64,
    device_to_host: AtomicU64,
    device_to_host_bytes: AtomicU64,
    device_to_device: AtomicU64,
    device_to_device_bytes: AtomicU64,
}

impl TransferCounters {
    pub(crate) fn host_to_device(&self, bytes: usize) {
        self.host_to_device.fetch_add(1, Ordering::Relaxed);
        self.host_to_device_bytes
            .fetch_add(bytes as u64, Ordering::Relaxed);
    }

    pub(crate) fn device_to_host(&self, bytes: usize) {
        self.device_to_host.fetch_add(1, Ordering::Relaxed);
        self.device_to_host_bytes
            .fetch_add(bytes as u64, Ordering::Relaxed);
    }

    pub(crate) fn device_to_device(&self, bytes: usize) {
        self.device_to_device.fetch_add(1, Ordering::Relaxed);
        self.device_to_device_bytes
            .fetch_add(bytes as u64, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> TransferStats {
        TransferStats {
            host_to_device: self.host_to_device.load(Ordering::Relaxed),
            host_to_device_bytes: self.host_to_device_bytes.load(Ordering::Relaxed),
            device_to_host: self.device_to_host.load(Ordering::Relaxed),
            device_to_host_bytes: self.device_to_host_bytes.load(Ordering::Relaxed),
            device_to_device: self.device_to_device.load(Ordering::Relaxed),
            device_to_device_bytes: self.device_to_device_bytes.load(Ordering::Relaxed),
        }
    }
}

/// The part of a client that buffers and executables keep alive: destroyed after the last of
/// them.
pub(crate) struct ClientHandle {
    pub plugin: Arc<Plugin>,
    pub raw: *mut PJRT_Client,
    pub devices: Vec<*mut PJRT_Device>,
    pub device_info: Vec<DeviceInfo>,
    pub platform_name: String,
    pub platform_version: String,
    /// Host transfers through this client (see [`TransferStats`]).
    pub transfers: TransferCounters,
}

// SAFETY: PJRT clients and devices are thread-safe handles.
unsafe impl Send for ClientHandle {}
// SAFETY: as above.
unsafe impl Sync for ClientHandle {}

impl Drop for ClientHandle {
    fn drop(&mut self) {
        let mut d = args!(PJRT_Client_Destroy_Args, PJRT_Client_Destroy_Args_STRUCT_SIZE);
        d.client = self.raw;
        if let Err(e) = pjrt_call!(&self.plugin, PJRT_Client_Destroy, &mut d) {
            tracing::warn!("{e}");
        }
    }
}

impl ClientHandle {
    pub fn check_device(&self, device: usize) -> Result<*mut PJRT_Device> {
        self.devices
            .get(device)
            .copied()
            .ok_or_else(|| Error::NoSuchDevice {
                device,
                num_devices: self.devices.len(),
                platform: self.platform_name.clone(),
            })
    }
}

/// The number of elements of a shape; errors on negative dims.
pub(crate) fn element_count(dims: &[i64]) -> Result<usize> {
    if dims.iter().any(|d| *d < 0) {
        return Err(Error::BadDims { dims: dims.to_vec() });
    }
    Ok(dims.iter().product::<i64>() as usize)
}
