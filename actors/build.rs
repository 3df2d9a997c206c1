//! Generates the gRPC code from `proto/grpo.proto` with a vendored `protoc` (none is installed).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY: build scripts are single-threaded.
    unsafe { std::env::set_var("PROTOC", protoc) };
    println!("cargo:rerun-if-changed=proto/grpo.proto");
    tonic_prost_build::configure().compile_protos(&["proto/grpo.proto"], &["proto"])?;
    Ok(())
}
