//! Metric helpers shared by server and agent.

use prometheus::{IntCounter, IntCounterVec};
use tether_proto::PacketType;

/// Upstream's `packet_type` label values, indexed by the enum value.
pub const PACKET_TYPES: [&str; 7] = [
    "DIAL_REQ",
    "DIAL_RSP",
    "CLOSE_REQ",
    "CLOSE_RSP",
    "DATA",
    "DIAL_CLS",
    "DRAIN",
];

/// Per-packet counters resolved once, so counting a DATA packet costs one atomic add
/// instead of a label lookup.
#[derive(Clone)]
pub struct PacketCounters {
    counters: Vec<IntCounter>,
}

impl PacketCounters {
    /// Resolves `vec{<first label>=segment, packet_type=..}` for every segment.
    pub fn new(vec: &IntCounterVec, segments: &[&str]) -> Self {
        let mut counters = Vec::with_capacity(segments.len() * PACKET_TYPES.len());
        for seg in segments {
            for ty in PACKET_TYPES {
                counters.push(vec.with_label_values(&[seg, ty]));
            }
        }
        PacketCounters { counters }
    }

    /// Counts one packet of raw type `ty` on the segment with index `segment`.
    pub fn inc(&self, segment: usize, ty: i32) {
        if let Ok(ty) = PacketType::try_from(ty) {
            if let Some(c) = self
                .counters
                .get(segment * PACKET_TYPES.len() + ty as usize)
            {
                c.inc();
            }
        }
    }
}
