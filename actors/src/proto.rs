//! Code generated from `proto/grpo.proto` by the build script.

#![allow(clippy::all, missing_docs)]
tonic::include_proto!("grpo.v1");
