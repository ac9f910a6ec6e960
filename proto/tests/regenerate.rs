//! Regenerates the Rust code from proto/*.proto and fails if it differs from the
//! checked-in copy in src/gen/. Run with `TETHER_BLESS=1` to update the copy.

use std::path::PathBuf;

#[test]
fn generated_code_is_current() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let out = tempdir();
    let protoc = protoc_bin_vendored::protoc_bin_path().expect("vendored protoc");
    // SAFETY of set_var: this test is the only one in this binary.
    std::env::set_var("PROTOC", protoc);
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        // DATA payloads as `Bytes`: the data path passes buffers on without copying.
        .bytes(".")
        // No `Client::connect(endpoint)` constructor: it would clash with the
        // AgentService `Connect` rpc; callers build channels themselves.
        .build_transport(false)
        // Small per-stream buffers (see `codec`): thousands of idle streams.
        .codec_path("crate::codec::PacketCodec")
        .emit_rerun_if_changed(false)
        .out_dir(&out)
        .compile_protos(
            &[
                root.join("proto/client.proto"),
                root.join("proto/agent.proto"),
            ],
            &[root.join("proto")],
        )
        .expect("protoc run");

    // No package: prost writes everything into `_.rs`.
    let fresh = std::fs::read_to_string(out.join("_.rs")).expect("generated _.rs");
    let checked_in = root.join("src/gen/konnectivity.rs");
    if std::env::var_os("TETHER_BLESS").is_some() {
        std::fs::create_dir_all(checked_in.parent().unwrap()).unwrap();
        std::fs::write(&checked_in, &fresh).unwrap();
    }
    let current = std::fs::read_to_string(&checked_in).unwrap_or_default();
    std::fs::remove_dir_all(&out).ok();
    assert!(
        current == fresh,
        "proto/src/gen/konnectivity.rs is stale: run `TETHER_BLESS=1 cargo test -p tether-proto` and commit the result"
    );
}

fn tempdir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tether-proto-gen-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
