//! Generates the gRPC code from `proto/grpo.proto` with a vendored `protoc` (none is installed).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY: build scripts are single-threaded.
    unsafe { std::env::set_var("PROTOC", protoc) };
    println!("cargo:rerun-if-changed=proto/grpo.proto");
    tonic_prost_build::configure()
        // Weight chunks are sliced out of one host copy of a tensor on the sending side and
        // decoded without a copy on the receiving side.
        .bytes(".grpo.v1.WeightChunk.data")
        .compile_protos(&["proto/grpo.proto"], &["proto"])?;
    Ok(())
}
