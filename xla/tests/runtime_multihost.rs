//! What the installed CPU PJRT plugin (lammps-jax-pjrt-cpu 0.11.2) does when asked to be one
//! process of a multi-process client (evidence in docs/multihost.md). It accepts `process_id` and numbers its devices by it, but never
//! calls the key-value store callbacks of `PJRT_Client_Create`, knows only its own devices, and
//! refuses to compile a program whose devices span processes: its C API never gives the CPU client
//! a cross-process collectives implementation (gloo / MPI are not in the build).
//!
//! This test pins those facts. If it fails because a plugin now forms the client (the callbacks
//! are called, or the cross-process compile succeeds), multi-host CPU has become possible:
//! build the distributed client options and the gRPC key-value store that the notes describe.

use std::collections::HashMap;
use std::ffi::c_char;
use std::sync::Mutex;

use xla::runtime::sys::*;
use xla::runtime::{Plugin, PluginKind};

/// An in-memory key-value store handed to the plugin through the callbacks' user argument; it
/// counts every call the plugin makes.
#[derive(Default)]
struct CountingStore {
    values: Mutex<HashMap<Vec<u8>, Vec<u8>>>,
    calls: Mutex<Vec<String>>,
}

impl CountingStore {
    /// Records a call `op` on `key`.
    fn record(&self, op: &str, key: &[u8]) {
        self.calls
            .lock()
            .unwrap()
            .push(format!("{op} {}", String::from_utf8_lossy(key)));
    }

    /// Records a read `op` of `key` and returns its value: `Ok((pointer, length))` of a copy
    /// for the plugin to free with [`free_value`], or the plugin's "not found" error.
    ///
    /// # Safety
    /// `callback_error` is the plugin's error constructor (or null).
    unsafe fn lookup(
        &self,
        op: &str,
        key: &[u8],
        callback_error: *mut PJRT_CallbackError,
    ) -> Result<(*mut c_char, usize), *mut PJRT_Error> {
        self.record(op, key);
        match self.values.lock().unwrap().get(key) {
            Some(value) => Ok((leak_value(value), value.len())),
            None => Err(not_found(callback_error, key)),
        }
    }
}

/// Copies a (pointer, length) byte string the plugin passed in.
///
/// # Safety
/// `ptr` must be valid for `len` bytes (or `len` is 0).
unsafe fn bytes_from(ptr: *const c_char, len: usize) -> Vec<u8> {
    if ptr.is_null() || len == 0 {
        return Vec::new();
    }
    std::slice::from_raw_parts(ptr as *const u8, len).to_vec()
}

unsafe extern "C" fn free_value(value: *mut c_char) {
    // Values are handed out as leaked boxed slices whose length is stored in front of the data.
    let base = (value as *mut u8).sub(8);
    let len = u64::from_le_bytes(std::slice::from_raw_parts(base, 8).try_into().unwrap()) as usize;
    drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(base, len + 8)));
}

/// Leaks `value` behind an 8-byte length prefix and returns a pointer to the data.
fn leak_value(value: &[u8]) -> *mut c_char {
    let mut boxed = Vec::with_capacity(value.len() + 8);
    boxed.extend_from_slice(&(value.len() as u64).to_le_bytes());
    boxed.extend_from_slice(value);
    let raw = Box::into_raw(boxed.into_boxed_slice()) as *mut u8;
    // SAFETY: the allocation is value.len() + 8 bytes long.
    unsafe { raw.add(8) as *mut c_char }
}

unsafe fn not_found(callback_error: *mut PJRT_CallbackError, key: &[u8]) -> *mut PJRT_Error {
    let message = format!("key {} not found", String::from_utf8_lossy(key));
    match callback_error.as_ref().and_then(|f| *f) {
        Some(f) => f(
            PJRT_Error_Code_PJRT_Error_Code_NOT_FOUND,
            message.as_ptr() as *const c_char,
            message.len(),
        ),
        None => std::ptr::null_mut(),
    }
}

unsafe extern "C" fn kv_get(args: *mut PJRT_KeyValueGetCallback_Args) -> *mut PJRT_Error {
    let args = &mut *args;
    let store = &*(args.user_arg as *const CountingStore);
    let key = bytes_from(args.key, args.key_size);
    match store.lookup("get", &key, args.callback_error) {
        Ok((value, size)) => {
            (args.value, args.value_size) = (value, size);
            args.value_deleter_callback = Some(free_value);
            std::ptr::null_mut()
        }
        Err(e) => e,
    }
}

unsafe extern "C" fn kv_try_get(args: *mut PJRT_KeyValueTryGetCallback_Args) -> *mut PJRT_Error {
    let args = &mut *args;
    let store = &*(args.user_arg as *const CountingStore);
    let key = bytes_from(args.key, args.key_size);
    match store.lookup("try_get", &key, args.callback_error) {
        Ok((value, size)) => {
            (args.value, args.value_size) = (value, size);
            args.value_deleter_callback = Some(free_value);
            std::ptr::null_mut()
        }
        Err(e) => e,
    }
}

unsafe extern "C" fn kv_put(args: *mut PJRT_KeyValuePutCallback_Args) -> *mut PJRT_Error {
    let args = &mut *args;
    let store = &*(args.user_arg as *const CountingStore);
    let key = bytes_from(args.key, args.key_size);
    let value = bytes_from(args.value, args.value_size);
    store.record("put", &key);
    store.values.lock().unwrap().insert(key, value);
    std::ptr::null_mut()
}

/// The message of a PJRT error (which is then destroyed), or `None` for success.
fn error_message(api: &PJRT_Api, error: *mut PJRT_Error) -> Option<String> {
    if error.is_null() {
        return None;
    }
    let mut message = PJRT_Error_Message_Args {
        struct_size: PJRT_Error_Message_Args_STRUCT_SIZE as usize,
        error,
        ..Default::default()
    };
    let mut destroy = PJRT_Error_Destroy_Args {
        struct_size: PJRT_Error_Destroy_Args_STRUCT_SIZE as usize,
        error,
        ..Default::default()
    };
    // SAFETY: a valid error object, read then destroyed once.
    unsafe {
        (api.PJRT_Error_Message.unwrap())(&mut message);
        let text = String::from_utf8_lossy(&bytes_from(message.message, message.message_size)).into_owned();
        (api.PJRT_Error_Destroy.unwrap())(&mut destroy);
        Some(text)
    }
}

fn int_option(name: &'static str, value: i64) -> PJRT_NamedValue {
    let mut option = PJRT_NamedValue {
        struct_size: PJRT_NamedValue_STRUCT_SIZE as usize,
        name: name.as_ptr() as *const c_char,
        name_size: name.len(),
        type_: PJRT_NamedValue_Type_PJRT_NamedValue_kInt64,
        value_size: 1,
        ..Default::default()
    };
    option.__bindgen_anon_1.int64_value = value;
    option
}

/// A raw client created as process `process_id` with `devices` CPU devices and the store's
/// callbacks; destroyed on drop.
struct ProcessClient<'a> {
    api: &'a PJRT_Api,
    raw: *mut PJRT_Client,
}

impl<'a> ProcessClient<'a> {
    fn create(
        api: &'a PJRT_Api,
        process_id: i64,
        devices: i64,
        store: &CountingStore,
    ) -> Result<ProcessClient<'a>, String> {
        let options = [
            int_option("cpu_device_count", devices),
            int_option("process_id", process_id),
        ];
        let user_arg = store as *const CountingStore as *mut std::ffi::c_void;
        let mut create = PJRT_Client_Create_Args {
            struct_size: PJRT_Client_Create_Args_STRUCT_SIZE as usize,
            create_options: options.as_ptr(),
            num_options: options.len(),
            kv_get_callback: Some(kv_get),
            kv_get_user_arg: user_arg,
            kv_put_callback: Some(kv_put),
            kv_put_user_arg: user_arg,
            kv_try_get_callback: Some(kv_try_get),
            kv_try_get_user_arg: user_arg,
            ..Default::default()
        };
        // SAFETY: the options and the store outlive the call; the plugin copies what it keeps.
        let error = unsafe { (api.PJRT_Client_Create.unwrap())(&mut create) };
        match error_message(api, error) {
            Some(message) => Err(message),
            None => Ok(ProcessClient {
                api,
                raw: create.client,
            }),
        }
    }

    /// The process index the client reports.
    fn process_index(&self) -> i32 {
        let mut args = PJRT_Client_ProcessIndex_Args {
            struct_size: PJRT_Client_ProcessIndex_Args_STRUCT_SIZE as usize,
            client: self.raw,
            ..Default::default()
        };
        // SAFETY: valid client.
        assert!(error_message(self.api, unsafe {
            (self.api.PJRT_Client_ProcessIndex.unwrap())(&mut args)
        })
        .is_none());
        args.process_index
    }

    /// The global ids of all devices the client knows, and of its addressable devices.
    fn device_ids(&self) -> (Vec<i32>, Vec<i32>) {
        let mut all = PJRT_Client_Devices_Args {
            struct_size: PJRT_Client_Devices_Args_STRUCT_SIZE as usize,
            client: self.raw,
            ..Default::default()
        };
        let mut addressable = PJRT_Client_AddressableDevices_Args {
            struct_size: PJRT_Client_AddressableDevices_Args_STRUCT_SIZE as usize,
            client: self.raw,
            ..Default::default()
        };
        // SAFETY: valid client; the device arrays are owned by it.
        unsafe {
            assert!(error_message(self.api, (self.api.PJRT_Client_Devices.unwrap())(&mut all)).is_none());
            assert!(error_message(
                self.api,
                (self.api.PJRT_Client_AddressableDevices.unwrap())(&mut addressable)
            )
            .is_none());
            (
                self.ids(std::slice::from_raw_parts(all.devices, all.num_devices)),
                self.ids(std::slice::from_raw_parts(
                    addressable.addressable_devices,
                    addressable.num_addressable_devices,
                )),
            )
        }
    }

    fn ids(&self, devices: &[*mut PJRT_Device]) -> Vec<i32> {
        devices
            .iter()
            .map(|device| {
                let mut get = PJRT_Device_GetDescription_Args {
                    struct_size: PJRT_Device_GetDescription_Args_STRUCT_SIZE as usize,
                    device: *device,
                    ..Default::default()
                };
                // SAFETY: valid device of this client.
                unsafe {
                    assert!(error_message(
                        self.api,
                        (self.api.PJRT_Device_GetDescription.unwrap())(&mut get)
                    )
                    .is_none());
                    let mut id = PJRT_DeviceDescription_Id_Args {
                        struct_size: PJRT_DeviceDescription_Id_Args_STRUCT_SIZE as usize,
                        device_description: get.device_description,
                        ..Default::default()
                    };
                    assert!(
                        error_message(self.api, (self.api.PJRT_DeviceDescription_Id.unwrap())(&mut id))
                            .is_none()
                    );
                    id.id
                }
            })
            .collect()
    }

    /// Compiles `mlir` with `compile_options` (a serialized `xla.CompileOptionsProto`); the error
    /// message on failure.
    fn compile(&self, mlir: &str, compile_options: &[u8]) -> Result<(), String> {
        let format = "mlir";
        let program = PJRT_Program {
            struct_size: PJRT_Program_STRUCT_SIZE as usize,
            code: mlir.as_ptr() as *mut c_char,
            code_size: mlir.len(),
            format: format.as_ptr() as *const c_char,
            format_size: format.len(),
            ..Default::default()
        };
        let mut compile = PJRT_Client_Compile_Args {
            struct_size: PJRT_Client_Compile_Args_STRUCT_SIZE as usize,
            client: self.raw,
            program: &program,
            compile_options: compile_options.as_ptr() as *const c_char,
            compile_options_size: compile_options.len(),
            ..Default::default()
        };
        // SAFETY: the program text and options outlive the call.
        let error = unsafe { (self.api.PJRT_Client_Compile.unwrap())(&mut compile) };
        if let Some(message) = error_message(self.api, error) {
            return Err(message);
        }
        let mut destroy = PJRT_LoadedExecutable_Destroy_Args {
            struct_size: PJRT_LoadedExecutable_Destroy_Args_STRUCT_SIZE as usize,
            executable: compile.executable,
            ..Default::default()
        };
        // SAFETY: the executable was just created and is destroyed once.
        unsafe { (self.api.PJRT_LoadedExecutable_Destroy.unwrap())(&mut destroy) };
        Ok(())
    }
}

impl Drop for ProcessClient<'_> {
    fn drop(&mut self) {
        let mut destroy = PJRT_Client_Destroy_Args {
            struct_size: PJRT_Client_Destroy_Args_STRUCT_SIZE as usize,
            client: self.raw,
            ..Default::default()
        };
        // SAFETY: the client is destroyed once, after everything compiled on it.
        unsafe { (self.api.PJRT_Client_Destroy.unwrap())(&mut destroy) };
    }
}

fn varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

fn bytes_field(out: &mut Vec<u8>, field: u64, bytes: &[u8]) {
    varint(out, (field << 3) | 2);
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// `xla.CompileOptionsProto` for an SPMD program over `device_ids.len()` partitions with an
/// explicit device assignment: `executable_build_options(3): {num_replicas(4)=1,
/// num_partitions(5)=N, use_spmd_partitioning(6), use_shardy_partitioner(19),
/// device_assignment(9): {replica_count(1)=1, computation_count(2)=N,
/// computation_devices(3): [{replica_device_ids(1): id}]}}`.
fn spmd_options_with_assignment(device_ids: &[i32]) -> Vec<u8> {
    let mut assignment = Vec::new();
    varint(&mut assignment, 1 << 3);
    varint(&mut assignment, 1);
    varint(&mut assignment, 2 << 3);
    varint(&mut assignment, device_ids.len() as u64);
    for id in device_ids {
        let mut computation = Vec::new();
        varint(&mut computation, 1 << 3);
        varint(&mut computation, *id as u64);
        bytes_field(&mut assignment, 3, &computation);
    }
    let mut build = Vec::new();
    for (field, value) in [(4u64, 1u64), (5, device_ids.len() as u64), (6, 1), (19, 1)] {
        varint(&mut build, field << 3);
        varint(&mut build, value);
    }
    bytes_field(&mut build, 9, &assignment);
    let mut out = Vec::new();
    bytes_field(&mut out, 3, &build);
    out
}

/// A sum over an array sharded on 4 devices: the partitioner turns it into a local reduce and an
/// all-reduce across the 4 devices.
const ALL_REDUCE_OVER_4: &str = r#"module @all_reduce_over_4 attributes {mhlo.num_partitions = 4 : i32, mhlo.num_replicas = 1 : i32} {
  sdy.mesh @mesh = <["x"=4]>
  func.func public @main(%arg0: tensor<8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"x"}]>}) -> (tensor<f32> {sdy.sharding = #sdy.sharding<@mesh, []>}) {
    %zero = stablehlo.constant dense<0.0> : tensor<f32>
    %sum = stablehlo.reduce(%arg0 init: %zero) applies stablehlo.add across dimensions = [0] : (tensor<8xf32>, tensor<f32>) -> tensor<f32>
    return %sum : tensor<f32>
  }
}"#;

#[test]
fn the_cpu_plugin_cannot_join_processes_into_one_client() {
    let plugin = Plugin::discover(PluginKind::Cpu, None).expect("the CPU plugin is installed");
    // SAFETY: the plugin's function table lives as long as the loaded plugin.
    let api = unsafe { &*plugin.raw_api() };
    let store = CountingStore::default();
    let first = ProcessClient::create(api, 0, 2, &store).expect("process 0 with 2 devices");
    let second = ProcessClient::create(api, 1, 2, &store).expect("process 1 with 2 devices");

    // process_id is taken: it renumbers the devices; but each client knows only its own two.
    assert_eq!(first.process_index(), 0);
    assert_eq!(second.process_index(), 1);
    let (first_all, first_local) = first.device_ids();
    let (second_all, second_local) = second.device_ids();
    assert_eq!(
        first_all, first_local,
        "process 0 sees a device of another process"
    );
    assert_eq!(
        second_all, second_local,
        "process 1 sees a device of another process"
    );
    assert_eq!(first_local.len(), 2);
    assert_eq!(second_local.len(), 2);
    assert!(
        first_local.iter().all(|id| !second_local.contains(id)),
        "process ids did not separate the device ids: {first_local:?} vs {second_local:?}"
    );

    // The key-value store was never used: no topology exchange happened.
    let calls = store.calls.lock().unwrap().clone();
    assert!(
        calls.is_empty(),
        "the plugin now uses the key-value store ({calls:?}): multi-process CPU clients may work; \
         see docs/multihost.md"
    );

    // One program over the 4 devices of both processes is refused by either process.
    let global: Vec<i32> = first_local.iter().chain(&second_local).copied().collect();
    let options = spmd_options_with_assignment(&global);
    for (process, client) in [(0, &first), (1, &second)] {
        let error = client
            .compile(ALL_REDUCE_OVER_4, &options)
            .expect_err("the plugin now compiles a program spanning two processes: build multi-host");
        assert!(
            error.contains("Multiprocess computations aren't implemented on the CPU backend"),
            "process {process}: {error}"
        );
    }
    // Within one process the same program over its own devices compiles (sanity of the options).
    let local_only = ProcessClient::create(api, 0, 4, &store).expect("one process with 4 devices");
    let (_, local_ids) = local_only.device_ids();
    local_only
        .compile(ALL_REDUCE_OVER_4, &spmd_options_with_assignment(&local_ids))
        .expect("4 devices of one process");
}
