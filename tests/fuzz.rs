//! Fuzz targets for every parser that reads what a peer or an operator wrote: the packet
//! decoder and gRPC frame reassembly, the HTTP-CONNECT request head, agent identifiers
//! and link metadata, the HPACK shim on Unix sockets and its decoder (against
//! loona-hpack's), the certificate and CSR parsers,
//! and the CCM cloud config. Under `cargo test` each replays its corpus
//! (`tests/__fuzz__/<target>/corpus`, and any `crashes`) and then runs random inputs for
//! `FUZZ_SECONDS` (1 s by default; `BOLERO_RANDOM_TEST_TIME_MS` overrides it); for as
//! long as you like by hand: `TETHER_FUZZ_SECONDS=600 cargo test --test fuzz`, or
//! coverage-guided with `cargo bolero test --test fuzz <target>` where cargo-bolero
//! is installed. A finding becomes a corpus file here and a regression test beside the
//! parser.

use std::time::Duration;

use prost::Message;
use tether_proto::Packet;

fn budget() -> Duration {
    let secs = std::env::var("TETHER_FUZZ_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    Duration::from_secs(secs)
}

macro_rules! fuzz {
    () => {
        bolero::check!().with_test_time(budget())
    };
}

#[test]
fn fuzz_packet_decoder() {
    fuzz!().for_each(|bytes: &[u8]| {
        if let Ok(p) = Packet::decode(bytes) {
            // What decodes re-encodes to something that decodes to the same packet.
            let again = Packet::decode(p.encode_to_vec().as_slice()).expect("re-encoded");
            assert_eq!(again, p);
        }
    });
}

#[test]
fn fuzz_frame_reassembly() {
    fuzz!().for_each(|bytes: &[u8]| {
        let Some((&cut, wire)) = bytes.split_first() else {
            return;
        };
        // However the wire is cut into DATA frames, the same packets come out (or the
        // same refusal).
        let whole = tether_client::fuzzing::fuzz_messages(wire, wire.len().max(1));
        let cut = tether_client::fuzzing::fuzz_messages(wire, cut as usize + 1);
        assert_eq!(whole.is_ok(), cut.is_ok(), "{whole:?} / {cut:?}");
        if let (Ok(a), Ok(b)) = (whole, cut) {
            assert_eq!(a, b);
        }
    });
}

#[test]
fn fuzz_framed_packets_round_trip() {
    fuzz!().for_each(|bytes: &[u8]| {
        // Well-formed frames of whatever packets the bytes decode to: always read back.
        let packets: Vec<Packet> = bytes
            .chunks(16)
            .filter_map(|c| Packet::decode(c).ok())
            .collect();
        let wire: Vec<u8> = packets
            .iter()
            .flat_map(|p| tether_client::fuzzing::frame(p).to_vec())
            .collect();
        let cut = bytes.first().map_or(1, |&b| b as usize + 1);
        assert_eq!(
            tether_client::fuzzing::fuzz_messages(&wire, cut).unwrap(),
            packets
        );
    });
}

#[test]
fn fuzz_http_connect_head() {
    fuzz!().for_each(|bytes: &[u8]| {
        // Accepted targets are checked inside (a valid host:port); nothing panics.
        let _ = tether_server::frontend::http_connect::fuzz_head(bytes);
        // The same bytes as the parts of a request line and headers, so that most
        // inputs get past the method and reach the target and header parsing.
        let mut parts = bytes.split(|&b| b == b'|');
        let method = ["CONNECT", "GET", "CONNECT", "connect"][bytes.len() % 4];
        let mut head = format!("{method} ").into_bytes();
        head.extend_from_slice(parts.next().unwrap_or_default());
        head.extend_from_slice(b" HTTP/1.1\r\n");
        while let (Some(k), Some(v)) = (parts.next(), parts.next()) {
            head.extend_from_slice(k);
            head.extend_from_slice(b": ");
            head.extend_from_slice(v);
            head.extend_from_slice(b"\r\n");
        }
        head.extend_from_slice(b"\r\nleftover");
        let _ = tether_server::frontend::http_connect::fuzz_head(&head);
    });
}

#[test]
fn fuzz_agent_identifiers() {
    fuzz!().for_each(|bytes: &[u8]| {
        let Ok(text) = std::str::from_utf8(bytes) else {
            return;
        };
        for strict in [false, true] {
            if let Ok(ids) = tether_core::identifiers::AgentIdentifiers::parse(text, strict) {
                let _ = ids.matches_host("node-1");
                let _ = ids.matches_cidr("10.0.0.1");
            }
        }
        if let Ok(c) = text.parse::<tether_core::identifiers::Cidr>() {
            assert!(c.normalized().contains(c.network()));
        }
    });
}

#[test]
fn fuzz_link_metadata() {
    use tether_proto::{header, link};
    fuzz!().for_each(|bytes: &[u8]| {
        // Every header the link reads, each given zero, one or two values from the input.
        let mut headers = http::HeaderMap::new();
        let mut values = bytes.split(|&b| b == 0);
        for key in [
            header::AGENT_ID,
            header::AGENT_IDENTIFIERS,
            header::SERVER_ID,
            header::SERVER_COUNT,
            header::FLOW_WINDOW,
        ] {
            for _ in 0..values.next().map_or(0, |v| v.len() % 3) {
                if let Some(Ok(v)) = values.next().map(http::HeaderValue::from_bytes) {
                    headers.append(key, v);
                }
            }
        }
        let md = tonic::metadata::MetadataMap::from_headers(headers);
        for key in [header::AGENT_ID, header::SERVER_ID, header::SERVER_COUNT] {
            let _ = link::single(&md, key);
        }
        if let Some(w) = link::peer_window(&md) {
            assert!(link::WINDOW_RANGE.contains(&w), "window {w}");
        }
    });
}

#[test]
fn fuzz_uds_authority_shim() {
    fuzz!().for_each(|bytes: &[u8]| {
        let Some((&cut, rest)) = bytes.split_first() else {
            return;
        };
        // After a real preface, so that the frame parser and HPACK decoder are reached:
        // the raw bytes, then the same bytes as well-framed HEADERS/CONTINUATION/DATA
        // frames of HPACK fragments.
        for input in [[PREFACE, rest].concat(), [PREFACE, &frames(rest)].concat()] {
            let whole = tether_server::frontend::uds_authority::fuzz(&input, input.len());
            let cut = tether_server::frontend::uds_authority::fuzz(&input, cut as usize + 1);
            // How reads cut the stream changes nothing.
            match (whole, cut) {
                (Ok(a), Ok(b)) => assert_eq!(a, b),
                (Err(_), Err(_)) => {}
                (a, b) => panic!("{a:?} / {b:?}"),
            }
        }
    });
}

#[test]
fn fuzz_hpack_decoder() {
    use tether_server::frontend::hpack;
    fuzz!().for_each(|bytes: &[u8]| {
        // Two blocks on one connection, so the second reads the table the first left.
        let cut = bytes
            .first()
            .map_or(0, |&c| usize::from(c))
            .min(bytes.len());
        let (first, second) = bytes.split_at(cut);
        let mut ours = hpack::Decoder::new(65_536);
        let mut theirs = loona_hpack::Decoder::new();
        theirs.set_max_allowed_table_size(65_536);
        for block in [first, second] {
            let mut got = Vec::new();
            let mine = ours.decode(block, |n, v| {
                got.push((n.to_vec(), v.to_vec()));
                true
            });
            let other = theirs.decode(block);
            // Where both decode, they agree. loona-hpack is more lenient in places (a
            // late table size update, an over-long integer) and stricter in one: a
            // block may not end with a size update, which RFC 7541 does not say.
            match (mine, other) {
                (Ok(()), Ok(expected)) => assert_eq!(got, expected),
                (Ok(()), Err(loona_hpack::decoder::DecoderError::SizeUpdateAtEnd)) => return,
                (Ok(()), Err(e)) => panic!("only loona-hpack refused {block:?}: {e:?}"),
                _ => return,
            }
        }
        // Any bytes as a Huffman string: decoded or refused, never a panic.
        let _ = hpack::huffman_decode(bytes);
    });
}

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// HTTP/2 frames built from `bytes`: each run up to a 0xff byte is one frame whose first
/// byte picks the type, flags and stream, and whose other bytes pick HPACK fragments
/// (the `:authority` and `:path` a gRPC client sends, table size updates, indexed
/// fields) or pass through as they are.
fn frames(bytes: &[u8]) -> Vec<u8> {
    const FRAGMENTS: &[&[u8]] = &[
        &[0x83],
        &[0x86],
        &[0x41, 0x0c],
        b"/tmp/x.sock\x00",
        &[0x44, 0x13],
        b"/ProxyService/Proxy",
        &[0x3f, 0xe1, 0x1f],
        &[0x20],
        &[0xbe],
        &[0x40, 0x0a],
        b":authority",
        &[0x01, 0x05],
        b"local",
        &[0xff, 0xff, 0xff, 0xff, 0x0f],
    ];
    let mut out = Vec::new();
    for run in bytes.split(|&b| b == 0xff) {
        let Some((&pick, body)) = run.split_first() else {
            continue;
        };
        let ty = [1u8, 9, 0, 1, 4, 8, 1, 9][pick as usize % 8];
        let flags = [0x4u8, 0x0, 0x5, 0x24, 0x1, 0x8, 0x4, 0x4][(pick >> 3) as usize % 8];
        let stream = [1u32, 1, 3, 0, 1, 5, 3, 1][(pick >> 5) as usize % 8];
        let mut payload = Vec::new();
        for &b in body {
            match FRAGMENTS.get(b as usize) {
                Some(f) => payload.extend_from_slice(f),
                None => payload.push(b),
            }
        }
        let len = payload.len().min(0xff_ffff) as u32;
        out.extend_from_slice(&len.to_be_bytes()[1..]);
        out.push(ty);
        out.push(flags);
        out.extend_from_slice(&stream.to_be_bytes());
        out.extend_from_slice(&payload[..len as usize]);
    }
    out
}

#[test]
fn fuzz_certificate_parsers() {
    fuzz!().for_each(|bytes: &[u8]| {
        let _ = tether_certs::inspect::parse_der(bytes);
        let _ = tether_certs::csr::parse_csr_der(bytes);
        let _ = tether_certs::csr::parse_csr_pem(bytes);
        if let Ok(text) = std::str::from_utf8(bytes) {
            let _ = tether_certs::inspect::parse_pem(text);
        }
    });
}

#[test]
fn fuzz_ccm_cloud_config() {
    fuzz!().for_each(|bytes: &[u8]| {
        if let Ok(text) = std::str::from_utf8(bytes) {
            let _ = tether_ccm::provider::parse(std::path::Path::new("cloud.yaml"), text);
        }
    });
}
