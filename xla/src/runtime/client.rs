//! PJRT clients: creating one from a plugin with create options, its devices (id, kind, memory
//! where the plugin reports it), host-to-device transfers, and compiling StableHLO text into
//! [`Executable`]s through the executable cache.

use std::path::Path;
use std::sync::Arc;

use super::buffer::Buffer;
use super::cache::{CacheConfig, ExecutableCache};
use super::error::{Error, Result};
use super::executable::{compile_options_proto, program_name, CompileOptions, Executable, ExecutableInner};
use super::handle::{element_count, ClientHandle, DeviceInfo, DeviceMemory, TransferCounters, TransferStats};
use super::plugin::{args, pjrt_call, NamedValues, OptionValue, Plugin, PluginKind};
use super::sys::*;
use crate::{DType, NativeType};

/// Options for creating a client.
#[derive(Clone, Debug, Default)]
pub struct ClientOptions {
    /// Plugin create options, e.g. `("cpu_device_count", OptionValue::Int(4))`. Unknown names are
    /// rejected by the plugin.
    pub create_options: Vec<(String, OptionValue)>,
    /// Where compiled executables are cached on disk.
    pub cache: CacheConfig,
}

struct ClientInner {
    handle: Arc<ClientHandle>,
    cache: ExecutableCache,
}

/// A PJRT client: one plugin's devices. Cheap to clone; `Send + Sync`.
#[derive(Clone)]
pub struct Client {
    inner: Arc<ClientInner>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("platform", &self.inner.handle.platform_name)
            .field("devices", &self.inner.handle.devices.len())
            .field("plugin", &self.inner.handle.plugin.path())
            .finish()
    }
}

impl Client {
    /// Discover and load the CPU plugin (env var / installed Python package), create a client
    /// with `cpu_device_count = num_devices`.
    pub fn cpu(num_devices: usize) -> Result<Client> {
        let plugin = Plugin::discover(PluginKind::Cpu, None)?;
        Client::from_plugin(
            plugin,
            ClientOptions {
                create_options: vec![(
                    "cpu_device_count".to_string(),
                    OptionValue::Int(num_devices.max(1) as i64),
                )],
                cache: CacheConfig::from_env(),
            },
        )
    }

    /// Finds the plugin of `kind` (`path` first, then the environment variable, then the Python
    /// packages) and creates a client.
    pub fn new(kind: PluginKind, path: Option<&Path>, options: ClientOptions) -> Result<Client> {
        let plugin = Plugin::discover(kind, path)?;
        Client::from_plugin(plugin, options)
    }

    /// Creates a client on a loaded plugin.
    pub fn from_plugin(plugin: Arc<Plugin>, options: ClientOptions) -> Result<Client> {
        let named = NamedValues::new(&options.create_options);
        let mut create = args!(PJRT_Client_Create_Args, PJRT_Client_Create_Args_STRUCT_SIZE);
        create.create_options = named.as_ptr();
        create.num_options = named.values.len();
        // The CPU plugin logs its options at info level straight to stderr when a client is
        // made; that belongs in the log, not on a user's terminal.
        let created = if plugin.kind() == PluginKind::Cpu {
            let (created, printed) =
                super::plugin::capturing_stderr(|| pjrt_call!(&plugin, PJRT_Client_Create, &mut create));
            super::plugin::relay_plugin_stderr(&printed);
            created
        } else {
            pjrt_call!(&plugin, PJRT_Client_Create, &mut create)
        };
        if let Err(e) = created {
            let message = e
                .pjrt_message()
                .unwrap_or_default()
                .trim()
                .trim_end_matches('.')
                .to_string();
            let hint = match plugin.kind() {
                PluginKind::Tpu => "There is no TPU chip on this host (or it is in use): only deviceless \
                    compilation for a named topology is available (xla::runtime::compile_for_topology, \
                    `grpo devices --plugin tpu` lists the topologies)"
                    .to_string(),
                PluginKind::Cuda => {
                    "Check that an NVIDIA GPU and driver are present (`nvidia-smi`) and that \
                    the CUDA libraries are installed: `pip install 'jax-cuda13-plugin[with-cuda]'`"
                        .to_string()
                }
                PluginKind::Cpu => format!(
                    "Check the create options {:?} (the CPU plugin knows cpu_device_count and asynchronous)",
                    options.create_options
                ),
            };
            return Err(Error::ClientCreate {
                kind: plugin.kind().to_string(),
                path: plugin.path().to_path_buf(),
                message: if message.is_empty() {
                    e.to_string()
                } else {
                    message
                },
                hint,
            });
        }
        drop(named);
        let raw = create.client;
        // Wrap at once so the client is destroyed if anything below fails.
        let mut handle = ClientHandle {
            plugin: plugin.clone(),
            raw,
            devices: Vec::new(),
            device_info: Vec::new(),
            platform_name: String::new(),
            platform_version: String::new(),
            transfers: TransferCounters::default(),
        };
        let mut name = args!(
            PJRT_Client_PlatformName_Args,
            PJRT_Client_PlatformName_Args_STRUCT_SIZE
        );
        name.client = raw;
        pjrt_call!(&plugin, PJRT_Client_PlatformName, &mut name)?;
        // SAFETY: pointer/size owned by the client.
        handle.platform_name =
            unsafe { super::plugin::string_from(name.platform_name, name.platform_name_size) };
        let mut version = args!(
            PJRT_Client_PlatformVersion_Args,
            PJRT_Client_PlatformVersion_Args_STRUCT_SIZE
        );
        version.client = raw;
        pjrt_call!(&plugin, PJRT_Client_PlatformVersion, &mut version)?;
        // SAFETY: as above.
        handle.platform_version =
            unsafe { super::plugin::string_from(version.platform_version, version.platform_version_size) };
        let mut devices = args!(
            PJRT_Client_AddressableDevices_Args,
            PJRT_Client_AddressableDevices_Args_STRUCT_SIZE
        );
        devices.client = raw;
        pjrt_call!(&plugin, PJRT_Client_AddressableDevices, &mut devices)?;
        if devices.num_addressable_devices > 0 {
            // SAFETY: array of num_addressable_devices device pointers owned by the client.
            handle.devices = unsafe {
                std::slice::from_raw_parts(devices.addressable_devices, devices.num_addressable_devices)
            }
            .to_vec();
        }
        handle.device_info = handle
            .devices
            .iter()
            .enumerate()
            .map(|(index, device)| describe_device(&plugin, index, *device))
            .collect::<Result<_>>()?;
        let handle = Arc::new(handle);
        let cache = ExecutableCache::new(&options.cache);
        tracing::debug!(
            "created {} client ({} devices) from {}",
            handle.platform_name,
            handle.devices.len(),
            plugin.path().display()
        );
        Ok(Client {
            inner: Arc::new(ClientInner { handle, cache }),
        })
    }

    /// The plugin this client runs on.
    pub fn plugin(&self) -> &Arc<Plugin> {
        &self.inner.handle.plugin
    }

    /// The number of addressable devices.
    pub fn num_devices(&self) -> usize {
        self.inner.handle.devices.len()
    }

    /// The addressable devices.
    pub fn devices(&self) -> &[DeviceInfo] {
        &self.inner.handle.device_info
    }

    /// The platform name (`cpu`, `cuda`, `tpu`).
    pub fn platform_name(&self) -> &str {
        &self.inner.handle.platform_name
    }

    /// The platform version string the plugin reports.
    pub fn platform_version(&self) -> &str {
        &self.inner.handle.platform_version
    }

    /// Host transfers (and device-to-device copies) through this client so far.
    pub fn transfer_stats(&self) -> TransferStats {
        self.inner.handle.transfers.snapshot()
    }

    /// The executable cache of this client.
    pub fn cache(&self) -> &ExecutableCache {
        &self.inner.cache
    }

    /// The full key of the disk cache's entry for `fingerprint` on this client: everything
    /// that must match for a serialized executable to be loaded here.
    pub fn cache_entry_key(&self, fingerprint: &str) -> String {
        ExecutableCache::entry_key(&self.inner.handle, fingerprint)
    }

    /// The disk cache's file for `fingerprint` on this client (`None` without a disk cache).
    pub fn cache_entry_path(&self, fingerprint: &str) -> Option<std::path::PathBuf> {
        self.inner.cache.entry_path(&self.inner.handle, fingerprint)
    }

    /// The cache fingerprint of a program compiled with `options` (sha256 of the text, the
    /// compile options and the donated arguments).
    pub fn fingerprint(mlir: &str, options: &CompileOptions) -> String {
        super::cache::program_fingerprint(mlir, &options_key(options))
    }

    /// Compiles StableHLO text (a `module` with a `func.func @main`), through the in-memory and
    /// on-disk executable caches.
    pub fn compile(&self, mlir: &str, options: &CompileOptions) -> Result<Executable> {
        let fingerprint = Client::fingerprint(mlir, options);
        if let Some(executable) = self.inner.cache.memory_get(&fingerprint) {
            return Ok(executable);
        }
        let executable = match self
            .inner
            .cache
            .disk_load(&self.inner.handle, &fingerprint, |payload| {
                self.deserialize(payload, mlir, options)
            }) {
            Some(executable) => executable,
            None => {
                let executable = self.compile_uncached(mlir, options)?;
                self.inner
                    .cache
                    .disk_store(&self.inner.handle, &fingerprint, &executable);
                executable
            }
        };
        self.inner.cache.memory_insert(&fingerprint, &executable);
        Ok(executable)
    }

    /// Compiles without looking at or filling any cache.
    pub fn compile_uncached(&self, mlir: &str, options: &CompileOptions) -> Result<Executable> {
        let handle = &self.inner.handle;
        let proto = compile_options_proto(options, true);
        let format = "mlir";
        let mut program = args!(PJRT_Program, PJRT_Program_STRUCT_SIZE);
        program.code = mlir.as_ptr() as *mut std::ffi::c_char;
        program.code_size = mlir.len();
        program.format = format.as_ptr() as *const std::ffi::c_char;
        program.format_size = format.len();
        let mut compile = args!(PJRT_Client_Compile_Args, PJRT_Client_Compile_Args_STRUCT_SIZE);
        compile.client = handle.raw;
        compile.program = &program;
        compile.compile_options = proto.as_ptr() as *const std::ffi::c_char;
        compile.compile_options_size = proto.len();
        pjrt_call!(&handle.plugin, PJRT_Client_Compile, &mut compile).map_err(|e| Error::Compile {
            program: program_name(mlir),
            message: e.pjrt_message().unwrap_or_default().to_string(),
        })?;
        ExecutableInner::wrap(handle.clone(), compile.executable, mlir, options).map(Executable::from_inner)
    }

    /// Loads a serialized executable (from [`Executable::serialize`]) on this client.
    pub fn deserialize(&self, bytes: &[u8], mlir: &str, options: &CompileOptions) -> Result<Executable> {
        let handle = &self.inner.handle;
        let mut load = args!(
            PJRT_Executable_DeserializeAndLoad_Args,
            PJRT_Executable_DeserializeAndLoad_Args_STRUCT_SIZE
        );
        load.client = handle.raw;
        load.serialized_executable = bytes.as_ptr() as *const std::ffi::c_char;
        load.serialized_executable_size = bytes.len();
        pjrt_call!(&handle.plugin, PJRT_Executable_DeserializeAndLoad, &mut load)?;
        ExecutableInner::wrap(handle.clone(), load.loaded_executable, mlir, options)
            .map(Executable::from_inner)
    }

    /// Copies host data to `device`: `data` is dense row-major with shape `dims`.
    pub fn buffer_from_host<T: NativeType>(&self, data: &[T], dims: &[i64], device: usize) -> Result<Buffer> {
        // SAFETY: NativeType guarantees T is plain data with the layout of T::DTYPE.
        let bytes =
            unsafe { std::slice::from_raw_parts(data.as_ptr() as *const u8, std::mem::size_of_val(data)) };
        self.buffer_from_bytes(bytes, T::DTYPE, dims, device)
    }

    /// Copies raw little-endian bytes of `dtype` elements with shape `dims` to `device`.
    pub fn buffer_from_bytes(
        &self,
        bytes: &[u8],
        dtype: DType,
        dims: &[i64],
        device: usize,
    ) -> Result<Buffer> {
        let handle = &self.inner.handle;
        let device_ptr = handle.check_device(device)?;
        let elements = element_count(dims)?;
        let expected_bytes = elements * dtype.size_bytes();
        if bytes.len() != expected_bytes {
            return Err(Error::HostDataSize {
                dtype,
                dims: dims.to_vec(),
                elements,
                expected_bytes,
                got_bytes: bytes.len(),
            });
        }
        if dtype == DType::Bool && bytes.iter().any(|b| *b > 1) {
            return Err(Error::HostDataSize {
                dtype,
                dims: dims.to_vec(),
                elements,
                expected_bytes,
                got_bytes: bytes.len(),
            });
        }
        let mut transfer = args!(
            PJRT_Client_BufferFromHostBuffer_Args,
            PJRT_Client_BufferFromHostBuffer_Args_STRUCT_SIZE
        );
        transfer.client = handle.raw;
        transfer.data = bytes.as_ptr() as *const std::ffi::c_void;
        transfer.type_ = super::buffer::pjrt_type(dtype);
        transfer.dims = dims.as_ptr();
        transfer.num_dims = dims.len();
        transfer.host_buffer_semantics =
            PJRT_HostBufferSemantics_PJRT_HostBufferSemantics_kImmutableOnlyDuringCall;
        transfer.device = device_ptr;
        pjrt_call!(&handle.plugin, PJRT_Client_BufferFromHostBuffer, &mut transfer)?;
        let buffer = Buffer::wrap(handle.clone(), transfer.buffer, dtype, dims.to_vec(), device);
        handle.transfers.host_to_device(bytes.len());
        // The host data may be released only after this event.
        handle.plugin.await_event(transfer.done_with_host_buffer)?;
        Ok(buffer)
    }
}

/// The compile options as fingerprinted: the proto plus the donated arguments (which change how
/// the executable is run, not how it is compiled).
fn options_key(options: &CompileOptions) -> Vec<u8> {
    let mut key = compile_options_proto(options, true);
    let mut donated = options.donated_args.clone();
    donated.sort_unstable();
    donated.dedup();
    key.extend_from_slice(b"donated:");
    for index in donated {
        key.extend_from_slice(&(index as u64).to_le_bytes());
    }
    key
}

fn describe_device(plugin: &Plugin, index: usize, device: *mut PJRT_Device) -> Result<DeviceInfo> {
    let mut get = args!(
        PJRT_Device_GetDescription_Args,
        PJRT_Device_GetDescription_Args_STRUCT_SIZE
    );
    get.device = device;
    pjrt_call!(plugin, PJRT_Device_GetDescription, &mut get)?;
    let description = get.device_description;
    let mut id = args!(
        PJRT_DeviceDescription_Id_Args,
        PJRT_DeviceDescription_Id_Args_STRUCT_SIZE
    );
    id.device_description = description;
    pjrt_call!(plugin, PJRT_DeviceDescription_Id, &mut id)?;
    let mut kind = args!(
        PJRT_DeviceDescription_Kind_Args,
        PJRT_DeviceDescription_Kind_Args_STRUCT_SIZE
    );
    kind.device_description = description;
    pjrt_call!(plugin, PJRT_DeviceDescription_Kind, &mut kind)?;
    let mut text = args!(
        PJRT_DeviceDescription_ToString_Args,
        PJRT_DeviceDescription_ToString_Args_STRUCT_SIZE
    );
    text.device_description = description;
    pjrt_call!(plugin, PJRT_DeviceDescription_ToString, &mut text)?;
    let mut stats = args!(
        PJRT_Device_MemoryStats_Args,
        PJRT_Device_MemoryStats_Args_STRUCT_SIZE
    );
    stats.device = device;
    let memory = match pjrt_call!(plugin, PJRT_Device_MemoryStats, &mut stats) {
        Ok(()) => Some(DeviceMemory {
            bytes_limit: stats
                .bytes_limit_is_set
                .then_some(stats.bytes_limit.max(0) as u64),
            bytes_in_use: stats.bytes_in_use.max(0) as u64,
        }),
        Err(e) => {
            tracing::debug!("device {index} reports no memory stats: {e}");
            None
        }
    };
    // SAFETY: strings owned by the device description.
    unsafe {
        Ok(DeviceInfo {
            index,
            id: id.id,
            kind: super::plugin::string_from(kind.device_kind, kind.device_kind_size),
            description: super::plugin::string_from(text.to_string, text.to_string_size),
            memory,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_device_options_match_the_measured_minimum() {
        // {3: {4: 1, 5: 1}} is the minimum; we add device_ordinal=-1.
        let proto = compile_options_proto(&CompileOptions::default(), false);
        let mut expected = vec![0x1a, 15, 0x08];
        expected.extend_from_slice(&[0xff; 9]);
        expected.push(0x01);
        expected.extend_from_slice(&[0x20, 1, 0x28, 1]);
        assert_eq!(proto, expected);
        let portable = compile_options_proto(&CompileOptions::default(), true);
        assert_eq!(&portable[..proto.len()], &proto[..]);
        assert_eq!(&portable[proto.len()..], &[0x20, 1]);
    }

    #[test]
    fn spmd_options_set_partitioning_and_shardy() {
        let proto = compile_options_proto(
            &CompileOptions {
                num_partitions: 4,
                donated_args: vec![],
            },
            true,
        );
        let build = &proto[2..];
        assert_eq!(proto[1] as usize, build.len());
        // num_partitions(5)=4, use_spmd_partitioning(6)=1, use_shardy_partitioner(19)=1
        assert!(build.windows(2).any(|w| w == [0x28, 4]));
        assert!(build.windows(2).any(|w| w == [0x30, 1]));
        assert!(build.ends_with(&[0x98, 0x01, 1]));
        // SPMD programs are never portable.
        assert!(!proto.ends_with(&[0x20, 1]) || build.ends_with(&[0x20, 1]));
    }

    #[test]
    fn transfers_are_counted_by_direction_and_bytes() {
        let client = Client::cpu(2).expect("the CPU plugin");
        let start = client.transfer_stats();
        let a = client.buffer_from_host(&[1.0f32, 2.0, 3.0], &[3], 0).unwrap();
        let b = client.buffer_from_host(&[7i32; 4], &[2, 2], 1).unwrap();
        let copied = a.copy_to_device(1).unwrap();
        let back = copied.to_host::<f32>().unwrap();
        assert_eq!(back, vec![1.0, 2.0, 3.0]);
        let mut into = [0i32; 4];
        b.to_host_into(&mut into).unwrap();
        assert_eq!(b.to_bytes().unwrap().len(), 16);
        let moved = client.transfer_stats().since(&start);
        assert_eq!(
            moved,
            TransferStats {
                host_to_device: 2,
                host_to_device_bytes: 12 + 16,
                device_to_host: 3,
                device_to_host_bytes: 12 + 16 + 16,
                device_to_device: 1,
                device_to_device_bytes: 12,
            }
        );
        assert_eq!((moved.host_transfers(), moved.host_bytes()), (5, 72));
        // Another client counts its own transfers only.
        let other = Client::cpu(1).unwrap();
        other.buffer_from_host(&[0u8; 5], &[5], 0).unwrap();
        assert_eq!(client.transfer_stats().since(&start), moved);
    }

    #[test]
    fn element_count_rejects_negative_dims() {
        assert_eq!(element_count(&[2, 3]).unwrap(), 6);
        assert_eq!(element_count(&[]).unwrap(), 1);
        assert!(element_count(&[2, -1])
            .unwrap_err()
            .to_string()
            .contains("[2, -1]"));
    }
}
