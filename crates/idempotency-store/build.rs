//! Generates the gRPC service (server and, for tests and tools, client) from the schema in
//! `proto/`, with the vendored protoc.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    const SCHEMA: &str = "../../proto/idempotency_store.proto";
    println!("cargo:rerun-if-changed={SCHEMA}");
    std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?);
    tonic_prost_build::configure()
        .build_transport(false)
        .compile_protos(&[SCHEMA], &["../../proto"])?;
    Ok(())
}
