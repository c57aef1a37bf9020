//! Compiles the node protocol with protox (a protobuf compiler in Rust), so
//! the build needs no `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "../proto/strata/node/v1/node.proto",
        "../proto/strata/api/v1/api.proto",
    ];
    for f in files {
        println!("cargo:rerun-if-changed={f}");
    }
    let fds = protox::compile(files, ["../proto"])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .codec_path("crate::codec::SmallCodec")
        .compile_fds(fds)?;
    Ok(())
}
