#![allow(non_upper_case_globals)]
//! Device buffers: element type and shape, reading back to the host (which waits for the value),
//! readiness, and donation tracking (a donated buffer is consumed; using it is a clear error).

use std::sync::{Arc, OnceLock};

use super::error::{Error, Result};
use super::handle::{element_count, ClientHandle};
use super::plugin::{args, pjrt_call};
use super::sys::*;
use crate::{DType, NativeType};

/// The PJRT element type of a [`DType`].
pub(crate) fn pjrt_type(dtype: DType) -> PJRT_Buffer_Type {
    match dtype {
        DType::F64 => PJRT_Buffer_Type_PJRT_Buffer_Type_F64,
        DType::F32 => PJRT_Buffer_Type_PJRT_Buffer_Type_F32,
        DType::BF16 => PJRT_Buffer_Type_PJRT_Buffer_Type_BF16,
        DType::F16 => PJRT_Buffer_Type_PJRT_Buffer_Type_F16,
        DType::I64 => PJRT_Buffer_Type_PJRT_Buffer_Type_S64,
        DType::I32 => PJRT_Buffer_Type_PJRT_Buffer_Type_S32,
        DType::U32 => PJRT_Buffer_Type_PJRT_Buffer_Type_U32,
        DType::U8 => PJRT_Buffer_Type_PJRT_Buffer_Type_U8,
        DType::Bool => PJRT_Buffer_Type_PJRT_Buffer_Type_PRED,
    }
}

/// The [`DType`] of a PJRT element type, if this crate supports it.
pub(crate) fn dtype_of(t: PJRT_Buffer_Type) -> Option<DType> {
    Some(match t {
        PJRT_Buffer_Type_PJRT_Buffer_Type_F64 => DType::F64,
        PJRT_Buffer_Type_PJRT_Buffer_Type_F32 => DType::F32,
        PJRT_Buffer_Type_PJRT_Buffer_Type_BF16 => DType::BF16,
        PJRT_Buffer_Type_PJRT_Buffer_Type_F16 => DType::F16,
        PJRT_Buffer_Type_PJRT_Buffer_Type_S64 => DType::I64,
        PJRT_Buffer_Type_PJRT_Buffer_Type_S32 => DType::I32,
        PJRT_Buffer_Type_PJRT_Buffer_Type_U32 => DType::U32,
        PJRT_Buffer_Type_PJRT_Buffer_Type_U8 => DType::U8,
        PJRT_Buffer_Type_PJRT_Buffer_Type_PRED => DType::Bool,
        _ => return None,
    })
}

/// Why a buffer no longer exists.
#[derive(Debug)]
pub(crate) struct Donation {
    pub program: String,
    pub argument: usize,
}

/// An array on one device. Dropping it frees the device memory (once no execution uses it).
pub struct Buffer {
    handle: Arc<ClientHandle>,
    raw: *mut PJRT_Buffer,
    dtype: DType,
    dims: Vec<i64>,
    device: usize,
    donated: OnceLock<Donation>,
}

// SAFETY: PJRT buffers are thread-safe handles; the donation flag is a OnceLock.
unsafe impl Send for Buffer {}
// SAFETY: as above.
unsafe impl Sync for Buffer {}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Buffer({}{:?} on device {}{})",
            self.dtype,
            self.dims,
            self.device,
            if self.donated.get().is_some() {
                ", donated"
            } else {
                ""
            }
        )
    }
}

impl Buffer {
    pub(crate) fn wrap(
        handle: Arc<ClientHandle>,
        raw: *mut PJRT_Buffer,
        dtype: DType,
        dims: Vec<i64>,
        device: usize,
    ) -> Buffer {
        Buffer {
            handle,
            raw,
            dtype,
            dims,
            device,
            donated: OnceLock::new(),
        }
    }

    /// Wraps an output buffer of an execution, asking the plugin for its type and shape.
    pub(crate) fn from_output(
        handle: Arc<ClientHandle>,
        raw: *mut PJRT_Buffer,
        device: usize,
    ) -> Result<Buffer> {
        let plugin = handle.plugin.clone();
        // Wrap first so the buffer is freed if a query fails.
        let mut buffer = Buffer::wrap(handle, raw, DType::F32, Vec::new(), device);
        let mut element = args!(
            PJRT_Buffer_ElementType_Args,
            PJRT_Buffer_ElementType_Args_STRUCT_SIZE
        );
        element.buffer = raw;
        pjrt_call!(&plugin, PJRT_Buffer_ElementType, &mut element)?;
        buffer.dtype = dtype_of(element.type_).ok_or_else(|| Error::UnsupportedElementType {
            what: "an execution output".to_string(),
            pjrt_type: element.type_,
        })?;
        let mut dims = args!(
            PJRT_Buffer_Dimensions_Args,
            PJRT_Buffer_Dimensions_Args_STRUCT_SIZE
        );
        dims.buffer = raw;
        pjrt_call!(&plugin, PJRT_Buffer_Dimensions, &mut dims)?;
        if dims.num_dims > 0 {
            // SAFETY: num_dims values owned by the buffer.
            buffer.dims = unsafe { std::slice::from_raw_parts(dims.dims, dims.num_dims) }.to_vec();
        }
        Ok(buffer)
    }

    pub(crate) fn raw(&self) -> *mut PJRT_Buffer {
        self.raw
    }

    pub(crate) fn client_handle(&self) -> &Arc<ClientHandle> {
        &self.handle
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The shape.
    pub fn dims(&self) -> &[i64] {
        &self.dims
    }

    /// The number of elements.
    pub fn element_count(&self) -> usize {
        self.dims.iter().product::<i64>() as usize
    }

    /// The index of the device holding it.
    pub fn device(&self) -> usize {
        self.device
    }

    /// Whether the buffer was donated to an execution and no longer exists.
    pub fn is_donated(&self) -> bool {
        self.donated.get().is_some()
    }

    /// Whether the plugin itself reports the buffer deleted (a donated buffer is, once an
    /// execution consumed it); [`Buffer::is_donated`] is this crate's own record.
    pub fn is_deleted_in_plugin(&self) -> Result<bool> {
        let mut d = args!(PJRT_Buffer_IsDeleted_Args, PJRT_Buffer_IsDeleted_Args_STRUCT_SIZE);
        d.buffer = self.raw;
        pjrt_call!(&self.handle.plugin, PJRT_Buffer_IsDeleted, &mut d)?;
        Ok(d.is_deleted)
    }

    /// Errors if the buffer was donated; `what` names the attempted use.
    pub(crate) fn ensure_live(&self, what: &str) -> Result<()> {
        match self.donated.get() {
            None => Ok(()),
            Some(donation) => Err(Error::BufferDonated {
                what: what.to_string(),
                dtype: self.dtype,
                dims: self.dims.clone(),
                device: self.device,
                donated_to: donation.program.clone(),
                argument: donation.argument,
            }),
        }
    }

    pub(crate) fn mark_donated(&self, program: &str, argument: usize) {
        let _ = self.donated.set(Donation {
            program: program.to_string(),
            argument,
        });
    }

    /// Waits until the value is computed (or its computation failed).
    pub fn block_until_ready(&self) -> Result<()> {
        self.ensure_live("block_until_ready")?;
        let mut ready = args!(
            PJRT_Buffer_ReadyEvent_Args,
            PJRT_Buffer_ReadyEvent_Args_STRUCT_SIZE
        );
        ready.buffer = self.raw;
        pjrt_call!(&self.handle.plugin, PJRT_Buffer_ReadyEvent, &mut ready)?;
        self.handle.plugin.await_event(ready.event)
    }

    /// Copies the value to the host (waits for it); `T` must be the buffer's element type.
    pub fn to_host<T: NativeType>(&self) -> Result<Vec<T>> {
        if T::DTYPE != self.dtype {
            return Err(Error::DtypeMismatch {
                requested: T::DTYPE,
                actual: self.dtype,
                dims: self.dims.clone(),
            });
        }
        let n = element_count(&self.dims)?;
        let mut out: Vec<T> = Vec::with_capacity(n);
        // SAFETY: the plugin writes exactly n elements of T's layout (checked size) before the
        // event completes; set_len only after a successful await.
        unsafe {
            self.copy_to_host_raw(
                out.as_mut_ptr() as *mut std::ffi::c_void,
                n * std::mem::size_of::<T>(),
            )?;
            out.set_len(n);
        }
        Ok(out)
    }

    /// Copies the value into `dst` (waits for it), without allocating.
    pub fn to_host_into<T: NativeType>(&self, dst: &mut [T]) -> Result<()> {
        if T::DTYPE != self.dtype {
            return Err(Error::DtypeMismatch {
                requested: T::DTYPE,
                actual: self.dtype,
                dims: self.dims.clone(),
            });
        }
        let n = element_count(&self.dims)?;
        if dst.len() != n {
            return Err(Error::HostDataSize {
                dtype: self.dtype,
                dims: self.dims.clone(),
                elements: n,
                expected_bytes: n * self.dtype.size_bytes(),
                got_bytes: std::mem::size_of_val(dst),
            });
        }
        // SAFETY: dst is valid for its full size, which equals the buffer's.
        unsafe {
            self.copy_to_host_raw(
                dst.as_mut_ptr() as *mut std::ffi::c_void,
                std::mem::size_of_val(dst),
            )
        }
    }

    /// Copies the value to the host as raw little-endian bytes (waits for it).
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let n = element_count(&self.dims)? * self.dtype.size_bytes();
        let mut out = vec![0u8; n];
        // SAFETY: out is valid for n bytes, the buffer's dense size.
        unsafe { self.copy_to_host_raw(out.as_mut_ptr() as *mut std::ffi::c_void, n)? };
        Ok(out)
    }

    /// # Safety
    /// `dst` must be valid for writes of `size` bytes, the buffer's dense row-major size.
    unsafe fn copy_to_host_raw(&self, dst: *mut std::ffi::c_void, size: usize) -> Result<()> {
        self.ensure_live("reading it to the host")?;
        let mut copy = args!(
            PJRT_Buffer_ToHostBuffer_Args,
            PJRT_Buffer_ToHostBuffer_Args_STRUCT_SIZE
        );
        copy.src = self.raw;
        copy.dst = dst;
        copy.dst_size = size;
        pjrt_call!(&self.handle.plugin, PJRT_Buffer_ToHostBuffer, &mut copy)?;
        self.handle.transfers.device_to_host(size);
        self.handle.plugin.await_event(copy.event)
    }

    /// Copies the buffer to another device of the same client.
    pub fn copy_to_device(&self, device: usize) -> Result<Buffer> {
        self.ensure_live("copying it to another device")?;
        let target = self.handle.check_device(device)?;
        let mut copy = args!(
            PJRT_Buffer_CopyToDevice_Args,
            PJRT_Buffer_CopyToDevice_Args_STRUCT_SIZE
        );
        copy.buffer = self.raw;
        copy.dst_device = target;
        pjrt_call!(&self.handle.plugin, PJRT_Buffer_CopyToDevice, &mut copy)?;
        self.handle
            .transfers
            .device_to_device(self.element_count() * self.dtype.size_bytes());
        Ok(Buffer::wrap(
            self.handle.clone(),
            copy.dst_buffer,
            self.dtype,
            self.dims.clone(),
            device,
        ))
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        if self.raw.is_null() {
            return;
        }
        let mut d = args!(PJRT_Buffer_Destroy_Args, PJRT_Buffer_Destroy_Args_STRUCT_SIZE);
        d.buffer = self.raw;
        if let Err(e) = pjrt_call!(&self.handle.plugin, PJRT_Buffer_Destroy, &mut d) {
            tracing::warn!("{e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_dtype_round_trips_through_the_pjrt_type() {
        for dtype in DType::ALL {
            assert_eq!(dtype_of(pjrt_type(dtype)), Some(dtype));
        }
        assert_eq!(dtype_of(PJRT_Buffer_Type_PJRT_Buffer_Type_C64), None);
    }
}
