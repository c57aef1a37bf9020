//! Compiles the node protocol's client side with protox (no `protoc`).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = ["../proto/strata/node/v1/node.proto"];
    for f in files {
        println!("cargo:rerun-if-changed={f}");
    }
    let fds = protox::compile(files, ["../proto"])?;
    tonic_prost_build::configure()
        .build_server(false)
        .build_client(true)
        .compile_fds(fds)?;
    Ok(())
}
