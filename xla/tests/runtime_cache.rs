//! The executable cache against the real CPU plugin: memory hits, disk hits in a fresh client,
//! and corrupt, stale and foreign disk entries being ignored, logged and replaced.

use sha2::{Digest, Sha256};
use xla::runtime::{CacheConfig, Client, ClientOptions, CompileOptions, OptionValue, PluginKind};

/// The plugin under test: `GRPO_TEST_PLUGIN=cuda` (scripts/gpu-check.sh) or the CPU plugin.
fn kind() -> PluginKind {
    std::env::var("GRPO_TEST_PLUGIN")
        .ok()
        .map(|k| PluginKind::parse(&k).expect("GRPO_TEST_PLUGIN must be cpu, cuda or tpu"))
        .unwrap_or(PluginKind::Cpu)
}

fn client_with_cache(dir: &std::path::Path) -> Client {
    let create_options = match kind() {
        PluginKind::Cpu => vec![("cpu_device_count".into(), OptionValue::Int(1))],
        _ => vec![],
    };
    Client::new(
        kind(),
        None,
        ClientOptions {
            create_options,
            cache: CacheConfig::Dir(dir.to_path_buf()),
        },
    )
    .unwrap()
}

fn program(k: f32) -> String {
    format!(
        r#"module @affine {{
  func.func public @main(%a: tensor<3xf32>) -> tensor<3xf32> {{
    %k = stablehlo.constant dense<{k:.6e}> : tensor<3xf32>
    %0 = stablehlo.multiply %a, %k : tensor<3xf32>
    %1 = stablehlo.add %0, %k : tensor<3xf32>
    return %1 : tensor<3xf32>
  }}
}}"#
    )
}

fn run(c: &Client, mlir: &str) -> Vec<f32> {
    let exe = c.compile(mlir, &CompileOptions::default()).unwrap();
    let a = c.buffer_from_host(&[1f32, 2.0, 3.0], &[3], 0).unwrap();
    exe.execute(&[&a]).unwrap()[0].to_host::<f32>().unwrap()
}

#[test]
fn memory_then_disk_hits_give_the_same_numbers() {
    let dir = tempfile::tempdir().unwrap();
    let mlir = program(2.0);
    let first = client_with_cache(dir.path());
    assert_eq!(run(&first, &mlir), vec![4.0, 6.0, 8.0]);
    let s = first.cache().stats();
    assert_eq!((s.misses, s.writes, s.disk_hits), (1, 1, 0));
    // Same client: from memory, the very same executable.
    let a = first.compile(&mlir, &CompileOptions::default()).unwrap();
    let b = first.compile(&mlir, &CompileOptions::default()).unwrap();
    assert!(a.same_as(&b));
    assert_eq!(first.cache().stats().memory_hits, 2);
    // A fresh client (as in a second run): from disk.
    let second = client_with_cache(dir.path());
    assert_eq!(run(&second, &mlir), vec![4.0, 6.0, 8.0]);
    let s = second.cache().stats();
    assert_eq!((s.disk_hits, s.misses, s.rejected), (1, 0, 0));
    // Other options are another entry.
    let spmd_like = CompileOptions {
        num_partitions: 1,
        donated_args: vec![0],
    };
    assert_ne!(
        Client::fingerprint(&mlir, &spmd_like),
        Client::fingerprint(&mlir, &CompileOptions::default())
    );
}

fn entry_path(c: &Client, mlir: &str) -> std::path::PathBuf {
    c.cache_entry_path(&Client::fingerprint(mlir, &CompileOptions::default()))
        .unwrap()
}

#[test]
fn corrupt_entry_is_ignored_logged_and_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let mlir = program(3.0);
    let first = client_with_cache(dir.path());
    run(&first, &mlir);
    let path = entry_path(&first, &mlir);
    assert!(path.is_file());
    std::fs::write(&path, b"garbage garbage garbage").unwrap();

    let second = client_with_cache(dir.path());
    assert_eq!(run(&second, &mlir), vec![6.0, 9.0, 12.0]);
    let s = second.cache().stats();
    assert_eq!((s.rejected, s.misses, s.writes, s.disk_hits), (1, 1, 1, 0));
    let why = second.cache().last_rejection().unwrap();
    assert!(why.contains("bad magic"), "{why}");

    // The entry was rewritten and loads again.
    let third = client_with_cache(dir.path());
    assert_eq!(run(&third, &mlir), vec![6.0, 9.0, 12.0]);
    assert_eq!(third.cache().stats().disk_hits, 1);
}

#[test]
fn foreign_entry_is_not_trusted() {
    let dir = tempfile::tempdir().unwrap();
    let (p1, p2) = (program(5.0), program(7.0));
    let first = client_with_cache(dir.path());
    run(&first, &p1);
    // Put program 1's entry where program 2's belongs.
    std::fs::copy(entry_path(&first, &p1), entry_path(&first, &p2)).unwrap();
    let second = client_with_cache(dir.path());
    assert_eq!(
        run(&second, &p2),
        vec![14.0, 21.0, 28.0],
        "not program 1's numbers"
    );
    let why = second.cache().last_rejection().unwrap();
    assert!(why.contains("another program, plugin build or host"), "{why}");
    assert_eq!(second.cache().stats().rejected, 1);
}

#[test]
fn stale_entry_that_the_plugin_cannot_load_is_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let mlir = program(11.0);
    let c = client_with_cache(dir.path());
    // A well-formed entry (right key, right checksum) holding bytes no plugin can load, as left
    // by an incompatible plugin build.
    let fingerprint = Client::fingerprint(&mlir, &CompileOptions::default());
    let key = c.cache_entry_key(&fingerprint);
    let payload = b"serialized by some other XLA build".to_vec();
    let mut entry = b"GRPOPJRT\x01".to_vec();
    entry.extend_from_slice(&(key.len() as u32).to_le_bytes());
    entry.extend_from_slice(key.as_bytes());
    entry.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    entry.extend_from_slice(&Sha256::digest(&payload));
    entry.extend_from_slice(&payload);
    let path = entry_path(&c, &mlir);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(&path, &entry).unwrap();

    assert_eq!(run(&c, &mlir), vec![22.0, 33.0, 44.0]);
    let why = c.cache().last_rejection().unwrap();
    assert!(why.contains("the plugin cannot load it"), "{why}");
    assert_ne!(std::fs::read(&path).unwrap(), entry, "replaced by a good entry");
}

#[test]
fn disabled_disk_cache_writes_nothing() {
    let c = Client::new(
        kind(),
        None,
        ClientOptions {
            create_options: vec![],
            cache: CacheConfig::Disabled,
        },
    )
    .unwrap();
    assert!(c.cache().dir().is_none());
    run(&c, &program(1.0));
    assert_eq!(c.cache().stats().writes, 0);
}
