//! The Konnectivity wire protocol: `Packet` and its payloads, `ProxyService` (frontend)
//! and `AgentService` (agent link), generated from `.proto` files identical to upstream.
//!
//! The generated code is checked in (`src/gen/`) so builds never need `protoc`; the test
//! `tests/regenerate.rs` regenerates it and fails on any difference.

#[allow(clippy::all, missing_docs)]
mod generated {
    include!("gen/konnectivity.rs");
}

pub use generated::*;

/// Largest gRPC message (one `Packet`) any Tether endpoint sends or accepts, on the
/// agent link and the frontend alike: upstream peers may send large DATA packets.
pub const MAX_MESSAGE: usize = 16 << 20;

pub mod codec {
    //! The gRPC codec of every Tether stream: prost encoding with no buffers up front.
    //! tonic's default gives each stream an 8 KiB encode and an 8 KiB decode buffer
    //! when it opens; with one stream per tunnel that is most of an idle tunnel's
    //! memory. The buffers grow with the messages a stream carries (a few dozen bytes
    //! for a tunnel that has only dialled), up to the largest one.

    use std::marker::PhantomData;

    use tonic::codec::{BufferSettings, Codec};
    use tonic_prost::{ProstCodec, ProstDecoder, ProstEncoder};

    /// Initial encode/decode buffer per stream: none. (tonic also uses this size as
    /// the growth step of (de)compression buffers, which would then divide by zero;
    /// no stream enables compression, and upstream never does either.)
    pub const INITIAL_BUFFER: usize = 0;

    /// Once this much is encoded, the batch is handed to HTTP/2.
    pub const YIELD_THRESHOLD: usize = 32 * 1024;

    /// Prost with [`INITIAL_BUFFER`]-byte initial buffers.
    #[derive(Debug, Clone)]
    pub struct PacketCodec<T, U>(PhantomData<(T, U)>);

    impl<T, U> Default for PacketCodec<T, U> {
        fn default() -> Self {
            PacketCodec(PhantomData)
        }
    }

    fn settings() -> BufferSettings {
        BufferSettings::new(INITIAL_BUFFER, YIELD_THRESHOLD)
    }

    impl<T, U> Codec for PacketCodec<T, U>
    where
        T: prost::Message + Send + 'static,
        U: prost::Message + Default + Send + 'static,
    {
        type Encode = T;
        type Decode = U;
        type Encoder = ProstEncoder<T>;
        type Decoder = ProstDecoder<U>;

        fn encoder(&mut self) -> Self::Encoder {
            ProstCodec::<T, U>::raw_encoder(settings())
        }

        fn decoder(&mut self) -> Self::Decoder {
            ProstCodec::<T, U>::raw_decoder(settings())
        }
    }
}

/// gRPC metadata keys, lowercase as on the wire.
pub mod header {
    /// Agent -> server: the agent's id (exactly one).
    pub const AGENT_ID: &str = "agentid";
    /// Agent -> server: URL query string of identifiers (host, ipv4, ipv6, cidr, default-route).
    pub const AGENT_IDENTIFIERS: &str = "agentidentifiers";
    /// Agent -> server: `Bearer <service-account token>`.
    pub const AUTHORIZATION: &str = "authorization";
    /// Server -> agent response header: the server's id.
    pub const SERVER_ID: &str = "serverid";
    /// Server -> agent response header: how many servers the agent should connect to.
    pub const SERVER_COUNT: &str = "servercount";
    /// Tether extension, both directions: "I do per-connection credit flow control
    /// (WINDOW_UPDATE) and give each connection this many bytes of receive window".
    /// Agent -> server in the request metadata; the server answers in its response
    /// headers only when the agent sent it. Upstream peers neither send nor answer it.
    pub const FLOW_WINDOW: &str = "tether-flow-window";
    /// Tether extension, agent -> server in the request metadata: "tell me with DRAIN
    /// when you stop", so the agent connects to the server's successor while the
    /// stream serves its last tunnels. Upstream servers ignore it and never send DRAIN;
    /// a Tether server sends it only to an agent that asked.
    pub const DRAIN_NOTICE: &str = "tether-drain-notice";
}

pub mod link {
    //! The agent link's metadata, read and written the same way at both ends: values
    //! that must appear exactly once, and the `tether-flow-window` offer and answer.

    use tonic::metadata::{MetadataMap, MetadataValue};

    use crate::header;

    /// The receive window each Tether peer advertises per connection (bytes).
    pub const DEFAULT_WINDOW: u32 = 1 << 20;

    /// Smallest and largest window a peer may advertise.
    pub const WINDOW_RANGE: std::ops::RangeInclusive<u32> = (64 << 10)..=(64 << 20);

    /// Why a metadata value could not be read.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub enum MetaError {
        /// The key is absent.
        Missing(&'static str),
        /// The key appears more than once.
        Repeated(&'static str),
        /// The value is not visible ASCII.
        NotAscii(&'static str),
    }

    impl std::fmt::Display for MetaError {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            match self {
                MetaError::Missing(k) => write!(f, "missing {k} metadata"),
                MetaError::Repeated(k) => write!(f, "expected exactly one {k}"),
                MetaError::NotAscii(k) => write!(f, "{k} is not valid ASCII"),
            }
        }
    }

    impl std::error::Error for MetaError {}

    /// The one value of `key`.
    pub fn single<'a>(md: &'a MetadataMap, key: &'static str) -> Result<&'a str, MetaError> {
        let mut values = md.get_all(key).iter();
        let (Some(one), None) = (values.next(), values.next()) else {
            return Err(if md.contains_key(key) {
                MetaError::Repeated(key)
            } else {
                MetaError::Missing(key)
            });
        };
        one.to_str().map_err(|_| MetaError::NotAscii(key))
    }

    /// Offers (agent, in its request) or accepts (server, in its response) credit flow
    /// control with our per-connection window.
    pub fn offer_window(md: &mut MetadataMap) {
        md.insert(header::FLOW_WINDOW, MetadataValue::from(DEFAULT_WINDOW));
    }

    /// The window the peer offered or accepted; `None` when absent, malformed or out of
    /// range (the peer is then treated as upstream, without credit).
    pub fn peer_window(md: &MetadataMap) -> Option<u32> {
        md.get(header::FLOW_WINDOW)?
            .to_str()
            .ok()?
            .trim()
            .parse::<u32>()
            .ok()
            .filter(|w| WINDOW_RANGE.contains(w))
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn single_values_and_windows() {
            let mut md = MetadataMap::new();
            assert_eq!(single(&md, "agentid"), Err(MetaError::Missing("agentid")));
            md.insert("agentid", "a".parse().unwrap());
            assert_eq!(single(&md, "agentid"), Ok("a"));
            md.append("agentid", "b".parse().unwrap());
            assert_eq!(single(&md, "agentid"), Err(MetaError::Repeated("agentid")));
            assert_eq!(peer_window(&md), None);
            offer_window(&mut md);
            assert_eq!(peer_window(&md), Some(DEFAULT_WINDOW));
            md.insert(header::FLOW_WINDOW, "1".parse().unwrap());
            assert_eq!(
                peer_window(&md),
                None,
                "below the range: upstream behaviour"
            );
        }
    }
}

// === impl Packet ===

impl Packet {
    /// A DIAL_REQ for `address` over `protocol` ("tcp").
    pub fn dial_request(protocol: &str, address: &str, random: i64) -> Self {
        Packet {
            r#type: PacketType::DialReq as i32,
            payload: Some(packet::Payload::DialRequest(DialRequest {
                protocol: protocol.to_string(),
                address: address.to_string(),
                random,
            })),
        }
    }

    /// A DIAL_RSP; `error` empty on success.
    pub fn dial_response(random: i64, connect_id: i64, error: impl Into<String>) -> Self {
        Packet {
            r#type: PacketType::DialRsp as i32,
            payload: Some(packet::Payload::DialResponse(DialResponse {
                error: error.into(),
                connect_id,
                random,
            })),
        }
    }

    /// A DATA packet carrying `data` for `connect_id`.
    pub fn data(connect_id: i64, data: impl Into<::prost::bytes::Bytes>) -> Self {
        Packet {
            r#type: PacketType::Data as i32,
            payload: Some(packet::Payload::Data(Data {
                connect_id,
                error: String::new(),
                data: data.into(),
            })),
        }
    }

    /// The CLOSE_RSP for a packet naming a connection the receiver does not have.
    pub fn unknown_connection(connect_id: i64) -> Self {
        Packet::close_response(connect_id, format!("unknown connectID {connect_id}"))
    }

    /// A CLOSE_REQ for `connect_id`.
    pub fn close_request(connect_id: i64) -> Self {
        Packet {
            r#type: PacketType::CloseReq as i32,
            payload: Some(packet::Payload::CloseRequest(CloseRequest { connect_id })),
        }
    }

    /// A CLOSE_RSP for `connect_id`; `error` empty on a clean close.
    pub fn close_response(connect_id: i64, error: impl Into<String>) -> Self {
        Packet {
            r#type: PacketType::CloseRsp as i32,
            payload: Some(packet::Payload::CloseResponse(CloseResponse {
                error: error.into(),
                connect_id,
            })),
        }
    }

    /// A DIAL_CLS cancelling the pending dial `random`.
    pub fn close_dial(random: i64) -> Self {
        Packet {
            r#type: PacketType::DialCls as i32,
            payload: Some(packet::Payload::CloseDial(CloseDial { random })),
        }
    }

    /// A DRAIN: the sender will take no new dials.
    pub fn drain() -> Self {
        Packet {
            r#type: PacketType::Drain as i32,
            payload: Some(packet::Payload::Drain(Drain {})),
        }
    }

    /// WINDOW_UPDATE: `bytes` more credit for connection `connect_id` (Tether extension).
    pub fn window_update(connect_id: i64, bytes: i64) -> Self {
        Packet {
            r#type: PacketType::WindowUpdate as i32,
            payload: Some(packet::Payload::WindowUpdate(WindowUpdate {
                connect_id,
                bytes,
            })),
        }
    }

    /// The packet type, or `None` for a value this build does not know.
    pub fn kind(&self) -> Option<PacketType> {
        PacketType::try_from(self.r#type).ok()
    }
}
