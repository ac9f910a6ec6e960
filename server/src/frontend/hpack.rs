//! HPACK (RFC 7541) for the Unix-socket `:authority` shim: decoding header blocks (the
//! client's dynamic table, integers, string literals, and a Huffman decoder whose
//! tables are built once per process), and the one stateless representation the shim
//! re-encodes fields with. (loona-hpack, used before, built a nested hash map of the
//! whole code for every Huffman-coded string and walked it bit by bit with two hash
//! lookups per bit: about 17 us for one `:path`, which the h2 crate's clients send as a
//! Huffman literal on every request.)

use std::borrow::Cow;
use std::collections::VecDeque;
use std::sync::OnceLock;

/// Why a header block could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HpackError {
    /// The block ends inside a representation.
    #[error("header block truncated")]
    Truncated,
    /// An integer does not fit.
    #[error("integer too large")]
    Overflow,
    /// An index names no entry of the static or dynamic table.
    #[error("no table entry {0}")]
    BadIndex(usize),
    /// A Huffman-coded string is malformed (bad padding, or EOS inside it).
    #[error("bad Huffman coding")]
    Huffman,
    /// A dynamic table size update above what the decoder allows.
    #[error("table size {0} above the limit")]
    TableSize(usize),
    /// A dynamic table size update after a header field (RFC 7541 section 4.2).
    #[error("table size update after a header field")]
    LateSizeUpdate,
}

/// The protocol's initial dynamic table size (SETTINGS_HEADER_TABLE_SIZE).
const INITIAL_TABLE_SIZE: usize = 4096;

/// Bytes an entry counts beyond its name and value (RFC 7541 section 4.1).
const ENTRY_OVERHEAD: usize = 32;

/// A dynamic table entry: name and value.
type Entry = (Box<[u8]>, Box<[u8]>);

/// A decoder holding one peer's dynamic table.
#[derive(Debug)]
pub struct Decoder {
    /// Newest first.
    dynamic: VecDeque<Entry>,
    size: usize,
    max_size: usize,
    limit: usize,
}

impl Decoder {
    /// A decoder that accepts table size updates up to `limit` bytes.
    pub fn new(limit: usize) -> Self {
        Decoder {
            dynamic: VecDeque::new(),
            size: 0,
            max_size: INITIAL_TABLE_SIZE.min(limit),
            limit,
        }
    }

    /// Decodes one whole header block, handing each field to `field` in order; `field`
    /// answers false to stop decoding there (the rest of the block is left undecoded,
    /// and the table is then out of step with the peer's: close the connection).
    pub fn decode(
        &mut self,
        mut block: &[u8],
        mut field: impl FnMut(&[u8], &[u8]) -> bool,
    ) -> Result<(), HpackError> {
        let mut fields = 0usize;
        while let Some(&first) = block.first() {
            if first & 0x80 != 0 {
                // Indexed header field.
                let index = integer(&mut block, 7)?;
                let (name, value) = self.entry(index)?;
                if !field(name, value) {
                    return Ok(());
                }
            } else if first & 0xe0 == 0x20 {
                // Dynamic table size update.
                if fields > 0 {
                    return Err(HpackError::LateSizeUpdate);
                }
                let size = integer(&mut block, 5)?;
                if size > self.limit {
                    return Err(HpackError::TableSize(size));
                }
                self.max_size = size;
                self.evict(0);
                continue;
            } else {
                // A literal: with incremental indexing (01), or without / never
                // indexed (0000 / 0001).
                let (indexing, prefix) = if first & 0xc0 == 0x40 {
                    (true, 6)
                } else {
                    (false, 4)
                };
                // A name from the table is copied only when this field is indexed
                // too; a bad index is reported before the value is read.
                let name = match integer(&mut block, prefix)? {
                    0 => string(&mut block)?,
                    index => Cow::Borrowed(self.entry(index)?.0),
                };
                let value = string(&mut block)?;
                if !field(&name, &value) {
                    return Ok(());
                }
                if indexing {
                    let (name, value) = (name.into_owned().into(), value.into_owned().into());
                    self.insert(name, value);
                }
            }
            fields += 1;
        }
        Ok(())
    }

    /// Entry `index` (1-based: the static table, then the dynamic table newest first).
    fn entry(&self, index: usize) -> Result<(&[u8], &[u8]), HpackError> {
        match index {
            0 => Err(HpackError::BadIndex(0)),
            i if i <= STATIC_TABLE.len() => {
                let (n, v) = STATIC_TABLE[i - 1];
                Ok((n.as_bytes(), v.as_bytes()))
            }
            i => self
                .dynamic
                .get(i - STATIC_TABLE.len() - 1)
                .map(|(n, v)| (&n[..], &v[..]))
                .ok_or(HpackError::BadIndex(i)),
        }
    }

    fn insert(&mut self, name: Box<[u8]>, value: Box<[u8]>) {
        let size = name.len() + value.len() + ENTRY_OVERHEAD;
        self.evict(size);
        // An entry larger than the whole table empties it and is not added.
        if size <= self.max_size {
            self.size += size;
            self.dynamic.push_front((name, value));
        }
    }

    /// Drops the oldest entries until `room` more bytes fit.
    fn evict(&mut self, room: usize) {
        while self.size + room > self.max_size {
            let Some((n, v)) = self.dynamic.pop_back() else {
                break;
            };
            self.size -= n.len() + v.len() + ENTRY_OVERHEAD;
        }
    }
}

/// Appends a literal header field without indexing, with a new name and neither string
/// Huffman-coded (RFC 7541 section 6.2.2): a representation any decoder takes without
/// touching its table.
pub fn encode_literal(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.push(0);
    for s in [name, value] {
        encode_integer(out, s.len(), 7);
        out.extend_from_slice(s);
    }
}

/// Appends `value` as an integer with a `prefix`-bit prefix, the bits above it zero
/// (RFC 7541 section 5.1); the inverse of [`integer`].
fn encode_integer(out: &mut Vec<u8>, value: usize, prefix: u8) {
    let max = (1usize << prefix) - 1;
    if value < max {
        out.push(value as u8);
        return;
    }
    out.push(max as u8);
    let mut rest = value - max;
    while rest >= 0x80 {
        out.push((rest & 0x7f) as u8 | 0x80);
        rest >>= 7;
    }
    out.push(rest as u8);
}

/// An integer with an `prefix`-bit prefix (RFC 7541 section 5.1), taken off `block`.
fn integer(block: &mut &[u8], prefix: u8) -> Result<usize, HpackError> {
    let (&first, mut rest) = block.split_first().ok_or(HpackError::Truncated)?;
    let max = (1usize << prefix) - 1;
    let mut value = usize::from(first) & max;
    if value == max {
        let mut shift = 0u32;
        loop {
            let (&b, tail) = rest.split_first().ok_or(HpackError::Truncated)?;
            rest = tail;
            // Four continuation bytes reach 2^28: far above any size or index.
            if shift > 21 {
                return Err(HpackError::Overflow);
            }
            value += usize::from(b & 0x7f) << shift;
            shift += 7;
            if b & 0x80 == 0 {
                break;
            }
        }
    }
    *block = rest;
    Ok(value)
}

/// A string literal (RFC 7541 section 5.2), taken off `block`.
fn string<'a>(block: &mut &'a [u8]) -> Result<Cow<'a, [u8]>, HpackError> {
    let huffman = block.first().ok_or(HpackError::Truncated)? & 0x80 != 0;
    let len = integer(block, 7)?;
    if len > block.len() {
        return Err(HpackError::Truncated);
    }
    let (raw, rest) = block.split_at(len);
    *block = rest;
    if huffman {
        Ok(Cow::Owned(huffman_decode(raw)?))
    } else {
        Ok(Cow::Borrowed(raw))
    }
}

/// The canonical Huffman code by length: codes of one length are consecutive, so a
/// code of `len` bits is the symbol at `offset[len] + code - first[len]` when it is
/// below `first[len] + count[len]`.
struct Canonical {
    first: [u32; 31],
    count: [u32; 31],
    offset: [usize; 31],
    symbols: [u16; 257],
}

fn canonical() -> &'static Canonical {
    static TABLE: OnceLock<Canonical> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut order: Vec<u16> = (0..257).collect();
        order.sort_by_key(|&s| (CODES[usize::from(s)].1, CODES[usize::from(s)].0));
        let mut t = Canonical {
            first: [0; 31],
            count: [0; 31],
            offset: [0; 31],
            symbols: [0; 257],
        };
        for (i, &s) in order.iter().enumerate() {
            let (code, len) = CODES[usize::from(s)];
            let len = usize::from(len);
            if t.count[len] == 0 {
                t.first[len] = code;
                t.offset[len] = i;
            }
            assert_eq!(
                code,
                t.first[len] + t.count[len],
                "HPACK's code is canonical"
            );
            t.count[len] += 1;
            t.symbols[i] = s;
        }
        t
    })
}

/// Decodes a Huffman-coded string (RFC 7541 section 5.2 and appendix B).
pub fn huffman_decode(input: &[u8]) -> Result<Vec<u8>, HpackError> {
    let t = canonical();
    // Most symbols take 5 to 8 bits.
    let mut out = Vec::with_capacity(input.len() * 8 / 5);
    let (mut code, mut len) = (0u32, 0usize);
    for &byte in input {
        for bit in (0..8).rev() {
            code = (code << 1) | u32::from((byte >> bit) & 1);
            len += 1;
            if len > 30 {
                return Err(HpackError::Huffman);
            }
            let (first, count) = (t.first[len], t.count[len]);
            if count > 0 && code >= first && code - first < count {
                let symbol = t.symbols[t.offset[len] + (code - first) as usize];
                if symbol == 256 {
                    return Err(HpackError::Huffman);
                }
                out.push(symbol as u8);
                code = 0;
                len = 0;
            }
        }
    }
    // Padding: fewer than 8 bits, all ones (a prefix of EOS).
    if len > 7 || code != (1u32 << len) - 1 {
        return Err(HpackError::Huffman);
    }
    Ok(out)
}

/// The static table (RFC 7541 appendix A).
const STATIC_TABLE: [(&str, &str); 61] = [
    (":authority", ""),
    (":method", "GET"),
    (":method", "POST"),
    (":path", "/"),
    (":path", "/index.html"),
    (":scheme", "http"),
    (":scheme", "https"),
    (":status", "200"),
    (":status", "204"),
    (":status", "206"),
    (":status", "304"),
    (":status", "400"),
    (":status", "404"),
    (":status", "500"),
    ("accept-charset", ""),
    ("accept-encoding", "gzip, deflate"),
    ("accept-language", ""),
    ("accept-ranges", ""),
    ("accept", ""),
    ("access-control-allow-origin", ""),
    ("age", ""),
    ("allow", ""),
    ("authorization", ""),
    ("cache-control", ""),
    ("content-disposition", ""),
    ("content-encoding", ""),
    ("content-language", ""),
    ("content-length", ""),
    ("content-location", ""),
    ("content-range", ""),
    ("content-type", ""),
    ("cookie", ""),
    ("date", ""),
    ("etag", ""),
    ("expect", ""),
    ("expires", ""),
    ("from", ""),
    ("host", ""),
    ("if-match", ""),
    ("if-modified-since", ""),
    ("if-none-match", ""),
    ("if-range", ""),
    ("if-unmodified-since", ""),
    ("last-modified", ""),
    ("link", ""),
    ("location", ""),
    ("max-forwards", ""),
    ("proxy-authenticate", ""),
    ("proxy-authorization", ""),
    ("range", ""),
    ("referer", ""),
    ("refresh", ""),
    ("retry-after", ""),
    ("server", ""),
    ("set-cookie", ""),
    ("strict-transport-security", ""),
    ("transfer-encoding", ""),
    ("user-agent", ""),
    ("vary", ""),
    ("via", ""),
    ("www-authenticate", ""),
];

/// The Huffman code (RFC 7541 appendix B): (code, length in bits) for each symbol,
/// 256 being EOS.
const CODES: [(u32, u8); 257] = [
    (0x1ff8, 13),
    (0x7fffd8, 23),
    (0xfffffe2, 28),
    (0xfffffe3, 28), // 0
    (0xfffffe4, 28),
    (0xfffffe5, 28),
    (0xfffffe6, 28),
    (0xfffffe7, 28), // 4
    (0xfffffe8, 28),
    (0xffffea, 24),
    (0x3ffffffc, 30),
    (0xfffffe9, 28), // 8
    (0xfffffea, 28),
    (0x3ffffffd, 30),
    (0xfffffeb, 28),
    (0xfffffec, 28), // 12
    (0xfffffed, 28),
    (0xfffffee, 28),
    (0xfffffef, 28),
    (0xffffff0, 28), // 16
    (0xffffff1, 28),
    (0xffffff2, 28),
    (0x3ffffffe, 30),
    (0xffffff3, 28), // 20
    (0xffffff4, 28),
    (0xffffff5, 28),
    (0xffffff6, 28),
    (0xffffff7, 28), // 24
    (0xffffff8, 28),
    (0xffffff9, 28),
    (0xffffffa, 28),
    (0xffffffb, 28), // 28
    (0x14, 6),
    (0x3f8, 10),
    (0x3f9, 10),
    (0xffa, 12), // 32
    (0x1ff9, 13),
    (0x15, 6),
    (0xf8, 8),
    (0x7fa, 11), // 36
    (0x3fa, 10),
    (0x3fb, 10),
    (0xf9, 8),
    (0x7fb, 11), // 40
    (0xfa, 8),
    (0x16, 6),
    (0x17, 6),
    (0x18, 6), // 44
    (0x0, 5),
    (0x1, 5),
    (0x2, 5),
    (0x19, 6), // 48
    (0x1a, 6),
    (0x1b, 6),
    (0x1c, 6),
    (0x1d, 6), // 52
    (0x1e, 6),
    (0x1f, 6),
    (0x5c, 7),
    (0xfb, 8), // 56
    (0x7ffc, 15),
    (0x20, 6),
    (0xffb, 12),
    (0x3fc, 10), // 60
    (0x1ffa, 13),
    (0x21, 6),
    (0x5d, 7),
    (0x5e, 7), // 64
    (0x5f, 7),
    (0x60, 7),
    (0x61, 7),
    (0x62, 7), // 68
    (0x63, 7),
    (0x64, 7),
    (0x65, 7),
    (0x66, 7), // 72
    (0x67, 7),
    (0x68, 7),
    (0x69, 7),
    (0x6a, 7), // 76
    (0x6b, 7),
    (0x6c, 7),
    (0x6d, 7),
    (0x6e, 7), // 80
    (0x6f, 7),
    (0x70, 7),
    (0x71, 7),
    (0x72, 7), // 84
    (0xfc, 8),
    (0x73, 7),
    (0xfd, 8),
    (0x1ffb, 13), // 88
    (0x7fff0, 19),
    (0x1ffc, 13),
    (0x3ffc, 14),
    (0x22, 6), // 92
    (0x7ffd, 15),
    (0x3, 5),
    (0x23, 6),
    (0x4, 5), // 96
    (0x24, 6),
    (0x5, 5),
    (0x25, 6),
    (0x26, 6), // 100
    (0x27, 6),
    (0x6, 5),
    (0x74, 7),
    (0x75, 7), // 104
    (0x28, 6),
    (0x29, 6),
    (0x2a, 6),
    (0x7, 5), // 108
    (0x2b, 6),
    (0x76, 7),
    (0x2c, 6),
    (0x8, 5), // 112
    (0x9, 5),
    (0x2d, 6),
    (0x77, 7),
    (0x78, 7), // 116
    (0x79, 7),
    (0x7a, 7),
    (0x7b, 7),
    (0x7ffe, 15), // 120
    (0x7fc, 11),
    (0x3ffd, 14),
    (0x1ffd, 13),
    (0xffffffc, 28), // 124
    (0xfffe6, 20),
    (0x3fffd2, 22),
    (0xfffe7, 20),
    (0xfffe8, 20), // 128
    (0x3fffd3, 22),
    (0x3fffd4, 22),
    (0x3fffd5, 22),
    (0x7fffd9, 23), // 132
    (0x3fffd6, 22),
    (0x7fffda, 23),
    (0x7fffdb, 23),
    (0x7fffdc, 23), // 136
    (0x7fffdd, 23),
    (0x7fffde, 23),
    (0xffffeb, 24),
    (0x7fffdf, 23), // 140
    (0xffffec, 24),
    (0xffffed, 24),
    (0x3fffd7, 22),
    (0x7fffe0, 23), // 144
    (0xffffee, 24),
    (0x7fffe1, 23),
    (0x7fffe2, 23),
    (0x7fffe3, 23), // 148
    (0x7fffe4, 23),
    (0x1fffdc, 21),
    (0x3fffd8, 22),
    (0x7fffe5, 23), // 152
    (0x3fffd9, 22),
    (0x7fffe6, 23),
    (0x7fffe7, 23),
    (0xffffef, 24), // 156
    (0x3fffda, 22),
    (0x1fffdd, 21),
    (0xfffe9, 20),
    (0x3fffdb, 22), // 160
    (0x3fffdc, 22),
    (0x7fffe8, 23),
    (0x7fffe9, 23),
    (0x1fffde, 21), // 164
    (0x7fffea, 23),
    (0x3fffdd, 22),
    (0x3fffde, 22),
    (0xfffff0, 24), // 168
    (0x1fffdf, 21),
    (0x3fffdf, 22),
    (0x7fffeb, 23),
    (0x7fffec, 23), // 172
    (0x1fffe0, 21),
    (0x1fffe1, 21),
    (0x3fffe0, 22),
    (0x1fffe2, 21), // 176
    (0x7fffed, 23),
    (0x3fffe1, 22),
    (0x7fffee, 23),
    (0x7fffef, 23), // 180
    (0xfffea, 20),
    (0x3fffe2, 22),
    (0x3fffe3, 22),
    (0x3fffe4, 22), // 184
    (0x7ffff0, 23),
    (0x3fffe5, 22),
    (0x3fffe6, 22),
    (0x7ffff1, 23), // 188
    (0x3ffffe0, 26),
    (0x3ffffe1, 26),
    (0xfffeb, 20),
    (0x7fff1, 19), // 192
    (0x3fffe7, 22),
    (0x7ffff2, 23),
    (0x3fffe8, 22),
    (0x1ffffec, 25), // 196
    (0x3ffffe2, 26),
    (0x3ffffe3, 26),
    (0x3ffffe4, 26),
    (0x7ffffde, 27), // 200
    (0x7ffffdf, 27),
    (0x3ffffe5, 26),
    (0xfffff1, 24),
    (0x1ffffed, 25), // 204
    (0x7fff2, 19),
    (0x1fffe3, 21),
    (0x3ffffe6, 26),
    (0x7ffffe0, 27), // 208
    (0x7ffffe1, 27),
    (0x3ffffe7, 26),
    (0x7ffffe2, 27),
    (0xfffff2, 24), // 212
    (0x1fffe4, 21),
    (0x1fffe5, 21),
    (0x3ffffe8, 26),
    (0x3ffffe9, 26), // 216
    (0xffffffd, 28),
    (0x7ffffe3, 27),
    (0x7ffffe4, 27),
    (0x7ffffe5, 27), // 220
    (0xfffec, 20),
    (0xfffff3, 24),
    (0xfffed, 20),
    (0x1fffe6, 21), // 224
    (0x3fffe9, 22),
    (0x1fffe7, 21),
    (0x1fffe8, 21),
    (0x7ffff3, 23), // 228
    (0x3fffea, 22),
    (0x3fffeb, 22),
    (0x1ffffee, 25),
    (0x1ffffef, 25), // 232
    (0xfffff4, 24),
    (0xfffff5, 24),
    (0x3ffffea, 26),
    (0x7ffff4, 23), // 236
    (0x3ffffeb, 26),
    (0x7ffffe6, 27),
    (0x3ffffec, 26),
    (0x3ffffed, 26), // 240
    (0x7ffffe7, 27),
    (0x7ffffe8, 27),
    (0x7ffffe9, 27),
    (0x7ffffea, 27), // 244
    (0x7ffffeb, 27),
    (0xffffffe, 28),
    (0x7ffffec, 27),
    (0x7ffffed, 27), // 248
    (0x7ffffee, 27),
    (0x7ffffef, 27),
    (0x7fffff0, 27),
    (0x3ffffee, 26),  // 252
    (0x3fffffff, 30), // 256
];

#[cfg(test)]
mod tests {
    use super::*;

    /// Huffman-codes `s` with the table (test side of the round trip).
    fn huffman_encode(s: &[u8]) -> Vec<u8> {
        let (mut bits, mut n, mut out) = (0u64, 0u32, Vec::new());
        for &c in s {
            let (code, len) = CODES[usize::from(c)];
            bits = (bits << len) | u64::from(code);
            n += u32::from(len);
            while n >= 8 {
                out.push((bits >> (n - 8)) as u8);
                n -= 8;
            }
        }
        if n > 0 {
            out.push(((bits << (8 - n)) | ((1 << (8 - n)) - 1)) as u8);
        }
        out
    }

    type Fields = Vec<(Vec<u8>, Vec<u8>)>;

    fn decode_all(d: &mut Decoder, block: &[u8]) -> Result<Fields, HpackError> {
        let mut out = Vec::new();
        d.decode(block, |n, v| {
            out.push((n.to_vec(), v.to_vec()));
            true
        })?;
        Ok(out)
    }

    #[test]
    fn every_byte_round_trips_through_the_huffman_code() {
        let all: Vec<u8> = (0..=255).collect();
        assert_eq!(huffman_decode(&huffman_encode(&all)).unwrap(), all);
        // RFC 7541 C.4.1: "www.example.com".
        let coded = [
            0xf1, 0xe3, 0xc2, 0xe5, 0xf2, 0x3a, 0x6b, 0xa0, 0xab, 0x90, 0xf4, 0xff,
        ];
        assert_eq!(huffman_decode(&coded).unwrap(), b"www.example.com");
        assert_eq!(huffman_encode(b"www.example.com"), coded);
    }

    #[test]
    fn integers_and_literals_round_trip() {
        // RFC 7541 C.1.1-2: 10 and 1337 with 5-bit prefixes.
        let mut out = Vec::new();
        encode_integer(&mut out, 10, 5);
        encode_integer(&mut out, 1337, 5);
        assert_eq!(out, [0x0a, 0x1f, 0x9a, 0x0a]);
        for prefix in [4, 5, 6, 7] {
            for value in [
                0,
                1,
                14,
                15,
                16,
                126,
                127,
                128,
                255,
                16_511,
                65_536,
                1 << 27,
            ] {
                let mut out = Vec::new();
                encode_integer(&mut out, value, prefix);
                let mut block = &out[..];
                assert_eq!(
                    integer(&mut block, prefix),
                    Ok(value),
                    "{value} in {prefix} bits"
                );
                assert!(block.is_empty());
            }
        }
        // A literal leaves the table as it was: the next block's indexes still hold.
        let mut d = Decoder::new(4096);
        let mut block = Vec::new();
        encode_literal(&mut block, b":authority", &[b'a'; 300]);
        encode_literal(&mut block, b"x", b"");
        assert_eq!(
            decode_all(&mut d, &block).unwrap(),
            [
                (b":authority".to_vec(), vec![b'a'; 300]),
                (b"x".to_vec(), vec![])
            ]
        );
        assert!(d.dynamic.is_empty());
    }

    #[test]
    fn literals_with_an_indexed_name_are_indexed_only_when_asked() {
        let mut d = Decoder::new(4096);
        // Without indexing, name 4 (`:path`); then with incremental indexing, name 1
        // (`:authority`), which adds an entry; then that entry (index 62) by index.
        let block = [&[0x04, 0x02][..], b"/x", &[0x41, 0x01], b"h", &[0xbe]].concat();
        assert_eq!(
            decode_all(&mut d, &block).unwrap(),
            [
                (b":path".to_vec(), b"/x".to_vec()),
                (b":authority".to_vec(), b"h".to_vec()),
                (b":authority".to_vec(), b"h".to_vec()),
            ]
        );
        assert_eq!(d.dynamic.len(), 1);
        // A bad name index is reported before the value is read.
        assert_eq!(
            decode_all(&mut d, &[0x0f, 0x50]),
            Err(HpackError::BadIndex(95))
        );
    }

    #[test]
    fn blocks_from_another_encoder_decode_alike() {
        // loona-hpack's encoder indexes what it sends: our dynamic table must follow it
        // block after block, and agree with loona's own decoder.
        let mut enc = loona_hpack::Encoder::new();
        let mut theirs = loona_hpack::Decoder::new();
        let mut ours = Decoder::new(65_536);
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for round in 0..300 {
            let fields: Vec<(Vec<u8>, Vec<u8>)> = (0..1 + round % 7)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let name = match x % 5 {
                        0 => b":authority".to_vec(),
                        1 => b":path".to_vec(),
                        _ => format!("x-h{}", x % 23).into_bytes(),
                    };
                    (
                        name,
                        format!("v{}", "z".repeat((x >> 8) as usize % 200)).into_bytes(),
                    )
                })
                .collect();
            let block = enc.encode(fields.iter().map(|(n, v)| (&n[..], &v[..])));
            let expected = theirs.decode(&block).unwrap();
            assert_eq!(decode_all(&mut ours, &block).unwrap(), expected);
            assert_eq!(expected, fields);
        }
        assert!(!ours.dynamic.is_empty() && ours.size <= INITIAL_TABLE_SIZE);
    }

    #[test]
    fn bad_huffman_padding_and_eos_are_refused() {
        // Padding of zeros, not ones.
        let mut coded = huffman_encode(b"a");
        *coded.last_mut().unwrap() &= 0xf8;
        assert_eq!(huffman_decode(&coded), Err(HpackError::Huffman));
        // A whole byte of padding.
        let mut coded = huffman_encode(b"abc");
        coded.push(0xff);
        assert_eq!(huffman_decode(&coded), Err(HpackError::Huffman));
        // EOS (30 ones) inside the string.
        assert_eq!(
            huffman_decode(&[0xff, 0xff, 0xff, 0xff]),
            Err(HpackError::Huffman)
        );
    }

    #[test]
    fn the_rfc_request_examples_decode_with_their_dynamic_table() {
        // RFC 7541 C.4: three requests with Huffman coding, one connection.
        let mut d = Decoder::new(4096);
        let first = [
            0x82, 0x86, 0x84, 0x41, 0x8c, 0xf1, 0xe3, 0xc2, 0xe5, 0xf2, 0x3a, 0x6b, 0xa0, 0xab,
            0x90, 0xf4, 0xff,
        ];
        let h = decode_all(&mut d, &first).unwrap();
        assert_eq!(h[3], (b":authority".to_vec(), b"www.example.com".to_vec()));
        assert_eq!(d.size, 57);
        let second = [
            0x82, 0x86, 0x84, 0xbe, 0x58, 0x86, 0xa8, 0xeb, 0x10, 0x64, 0x9c, 0xbf,
        ];
        let h = decode_all(&mut d, &second).unwrap();
        assert_eq!(h[3], (b":authority".to_vec(), b"www.example.com".to_vec()));
        assert_eq!(h[4], (b"cache-control".to_vec(), b"no-cache".to_vec()));
        assert_eq!(d.size, 110);
        let third = [
            0x82, 0x87, 0x85, 0xbf, 0x40, 0x88, 0x25, 0xa8, 0x49, 0xe9, 0x5b, 0xa9, 0x7d, 0x7f,
            0x89, 0x25, 0xa8, 0x49, 0xe9, 0x5b, 0xb8, 0xe8, 0xb4, 0xbf,
        ];
        let h = decode_all(&mut d, &third).unwrap();
        assert_eq!(h[1], (b":scheme".to_vec(), b"https".to_vec()));
        assert_eq!(h[4], (b"custom-key".to_vec(), b"custom-value".to_vec()));
        assert_eq!(d.size, 164);
    }

    #[test]
    fn the_table_evicts_oldest_first_and_honours_size_updates() {
        let mut d = Decoder::new(8192);
        // Literal with incremental indexing, new name: 10 + 90 + 32 = 132 bytes each.
        let entry = |i: u8| {
            let mut b = vec![0x40, 10];
            b.extend_from_slice(format!("name-{i:05}").as_bytes());
            b.push(90);
            b.extend(std::iter::repeat_n(b'v', 90));
            b
        };
        for i in 0..40 {
            decode_all(&mut d, &entry(i)).unwrap();
        }
        // 4096 / 132: the newest 31 stay.
        assert_eq!(d.dynamic.len(), 31);
        let h = decode_all(&mut d, &[0xbe]).unwrap(); // index 62: the newest
        assert_eq!(h[0].0, b"name-00039");
        assert_eq!(
            decode_all(&mut d, &[0xff, 0x01]),
            Err(HpackError::BadIndex(128))
        );
        // Shrink to 300 (two entries), then grow: what was evicted stays gone.
        decode_all(&mut d, &[0x3f, 0x8d, 0x02]).unwrap();
        assert_eq!(d.dynamic.len(), 2);
        // Above the limit, or after a field: refused.
        assert_eq!(
            decode_all(&mut d, &[0x3f, 0xe1, 0xff, 0x03]),
            Err(HpackError::TableSize(65_536))
        );
        assert_eq!(
            decode_all(&mut d, &[0x82, 0x20]),
            Err(HpackError::LateSizeUpdate)
        );
        // Truncations and overflow.
        assert_eq!(
            decode_all(&mut d, &[0x40, 0x05, b'a']),
            Err(HpackError::Truncated)
        );
        assert_eq!(decode_all(&mut d, &[0xff]), Err(HpackError::Truncated));
        assert_eq!(
            decode_all(&mut d, &[0xff, 0xff, 0xff, 0xff, 0xff, 0x01]),
            Err(HpackError::Overflow)
        );
    }
}
