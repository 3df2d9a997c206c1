fn main() {
    let extra: Vec<String> = std::env::var("GEN_CLANG_ARGS")
        .map(|s| s.split_whitespace().map(String::from).collect())
        .unwrap_or_default();
    let b = bindgen::Builder::default()
        .header("../pjrt_c_api.h")
        .clang_args(extra)
        .allowlist_item("PJRT_.*")
        .allowlist_var("PJRT_.*_STRUCT_SIZE")
        .derive_default(true)
        .layout_tests(false)
        .generate_comments(false)
        .generate()
        .expect("bindgen failed");
    b.write_to_file("../../src/runtime/sys.rs").expect("write failed");
}
