//! The frame envelope: a 12-byte big-endian header, then `length` payload bytes.
//!
//! | offset | size | field | value |
//! |---|---|---|---|
//! | 0 | 4 | magic | `FLX1` (0x464C5831) |
//! | 4 | 2 | version | 1; anything else is refused |
//! | 6 | 2 | flags | 0 = JSON message; bits select binary layouts ([`Flags`]) |
//! | 8 | 4 | length | payload bytes |
//!
//! A receiver enforces its own payload limit on the header alone, before buffering the
//! body: 64 KiB before a stream authenticates, a configured maximum after. An unknown
//! flag bit is refused, never masked, but only once the body has been consumed, so the
//! stream stays frame-aligned and the peer can be told why.

use bytes::{BufMut, Bytes, BytesMut};

use crate::flags::{FlagComboError, Flags, FrameKind};

/// `FLX1`.
pub const MAGIC: u32 = 0x464C_5831;
/// The only protocol version.
pub const VERSION: u16 = 1;
/// Header size in bytes.
pub const HEADER_LEN: usize = 12;
/// Payload limit on a stream that has not authenticated.
pub const PREAUTH_MAX_PAYLOAD_BYTES: u32 = 64 * 1024;
/// Default payload limit after authentication.
pub const DEFAULT_MAX_PAYLOAD_BYTES: u32 = 16 * 1024 * 1024;

/// Why a frame cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// The first four bytes are not `FLX1`.
    #[error("bad frame magic {found:#010x}, expected 0x464c5831 (FLX1)")]
    BadMagic {
        /// What was there.
        found: u32,
    },
    /// A version other than 1.
    #[error("unsupported frame version {found}; this peer speaks version 1")]
    UnsupportedVersion {
        /// What was there.
        found: u16,
    },
    /// The payload is larger than this receiver accepts.
    #[error("frame payload of {length} bytes exceeds the limit of {max} bytes")]
    TooLarge {
        /// Declared length.
        length: u32,
        /// This receiver's limit.
        max: u32,
    },
    /// The header carries flag bits this implementation does not know. The frame's body
    /// was consumed, so the stream is still frame-aligned.
    #[error("unknown frame flag bits {unknown:?} in {flags:?}")]
    UnknownFlags {
        /// All the header's flags.
        flags: Flags,
        /// The unknown ones.
        unknown: Flags,
    },
    /// Known bits that do not describe one layout. The body was consumed.
    #[error(transparent)]
    BadFlagCombination(#[from] FlagComboError),
    /// An encoder was asked to write a payload larger than `u32::MAX`.
    #[error("payload of {length} bytes cannot be framed (limit u32::MAX)")]
    PayloadTooLong {
        /// Attempted length.
        length: usize,
    },
}

impl FrameError {
    /// True when the stream is still frame-aligned after this error (the body was
    /// consumed), so the receiver may answer and keep reading.
    pub fn stream_still_aligned(&self) -> bool {
        matches!(
            self,
            FrameError::UnknownFlags { .. } | FrameError::BadFlagCombination(_)
        )
    }
}

/// A parsed header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// Layout bits. May contain unknown bits until [`FrameHeader::kind`] is asked.
    pub flags: Flags,
    /// Payload length.
    pub length: u32,
}

impl FrameHeader {
    /// Reads a header from the first 12 bytes. `Ok(None)` means fewer than 12 bytes are
    /// available. Checks magic and version; flags are checked by [`FrameHeader::kind`].
    pub fn parse(bytes: &[u8]) -> Result<Option<FrameHeader>, FrameError> {
        let Some(h) = bytes.get(..HEADER_LEN) else {
            return Ok(None);
        };
        let magic = u32::from_be_bytes([h[0], h[1], h[2], h[3]]);
        if magic != MAGIC {
            return Err(FrameError::BadMagic { found: magic });
        }
        let version = u16::from_be_bytes([h[4], h[5]]);
        if version != VERSION {
            return Err(FrameError::UnsupportedVersion { found: version });
        }
        Ok(Some(FrameHeader {
            flags: Flags(u16::from_be_bytes([h[6], h[7]])),
            length: u32::from_be_bytes([h[8], h[9], h[10], h[11]]),
        }))
    }

    /// The layout the flags select; unknown bits and broken combinations are errors.
    pub fn kind(&self) -> Result<FrameKind, FrameError> {
        let unknown = self.flags.unknown();
        if !unknown.is_empty() {
            return Err(FrameError::UnknownFlags {
                flags: self.flags,
                unknown,
            });
        }
        Ok(FrameKind::of(self.flags)?)
    }

    /// The 12 header bytes.
    pub fn to_bytes(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        out[..4].copy_from_slice(&MAGIC.to_be_bytes());
        out[4..6].copy_from_slice(&VERSION.to_be_bytes());
        out[6..8].copy_from_slice(&self.flags.0.to_be_bytes());
        out[8..].copy_from_slice(&self.length.to_be_bytes());
        out
    }
}

/// One whole frame. The payload is a zero-copy slice of what was received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// Layout bits (all known; checked when the frame was read).
    pub flags: Flags,
    /// Which layout they select.
    pub kind: FrameKind,
    /// The payload.
    pub payload: Bytes,
}

/// What a decode attempt found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decoded<T> {
    /// A whole value, and how many input bytes it used.
    Complete {
        /// The value.
        value: T,
        /// Input bytes consumed.
        consumed: usize,
    },
    /// Not malformed, just short: at least this many more bytes are needed.
    NeedMore(usize),
}

/// Decodes one frame from the front of `buf` without copying its payload.
///
/// On `Err` with [`FrameError::stream_still_aligned`], the frame was whole and
/// `frame_len` of the error's frame can be skipped with [`skip_len`].
pub fn decode_frame(buf: &Bytes, max_payload_bytes: u32) -> Result<Decoded<Frame>, FrameError> {
    let Some(header) = FrameHeader::parse(buf)? else {
        return Ok(Decoded::NeedMore(HEADER_LEN - buf.len()));
    };
    if header.length > max_payload_bytes {
        return Err(FrameError::TooLarge {
            length: header.length,
            max: max_payload_bytes,
        });
    }
    let total = HEADER_LEN + header.length as usize;
    if buf.len() < total {
        return Ok(Decoded::NeedMore(total - buf.len()));
    }
    let kind = header.kind()?;
    Ok(Decoded::Complete {
        value: Frame {
            flags: header.flags,
            kind,
            payload: buf.slice(HEADER_LEN..total),
        },
        consumed: total,
    })
}

/// The whole length of the frame at the front of `buf`, if its header is readable and
/// the frame is complete. Used to skip a frame refused for its flags.
pub fn skip_len(buf: &[u8]) -> Option<usize> {
    let header = FrameHeader::parse(buf).ok()??;
    let total = HEADER_LEN + header.length as usize;
    (buf.len() >= total).then_some(total)
}

/// Starts a frame in `buf`: writes a header with a zero length and returns where it
/// starts. Append the payload, then call [`finish_frame`].
pub fn begin_frame(buf: &mut BytesMut, flags: Flags) -> usize {
    let start = buf.len();
    buf.put_slice(&FrameHeader { flags, length: 0 }.to_bytes());
    start
}

/// Patches the length of the frame begun at `start` to cover everything appended since.
pub fn finish_frame(buf: &mut BytesMut, start: usize) -> Result<(), FrameError> {
    let length = buf.len() - start - HEADER_LEN;
    let length32 = u32::try_from(length).map_err(|_| FrameError::PayloadTooLong { length })?;
    buf[start + 8..start + HEADER_LEN].copy_from_slice(&length32.to_be_bytes());
    Ok(())
}

/// Appends a whole frame with the given payload.
pub fn write_frame(buf: &mut BytesMut, flags: Flags, payload: &[u8]) -> Result<(), FrameError> {
    let length = u32::try_from(payload.len()).map_err(|_| FrameError::PayloadTooLong {
        length: payload.len(),
    })?;
    buf.reserve(HEADER_LEN + payload.len());
    buf.put_slice(&FrameHeader { flags, length }.to_bytes());
    buf.put_slice(payload);
    Ok(())
}

/// Reassembles frames from a byte stream delivered in arbitrary chunks.
///
/// Whole frames inside a pushed chunk are sliced out of it without copying; only a
/// frame split across chunks is copied into the reader's own buffer. The buffer never
/// holds more than one partial frame, and a header announcing more than the limit is
/// refused before its body is buffered.
#[derive(Debug)]
pub struct FrameReader {
    /// Bytes of a frame split across chunks (empty when `chunk` is not).
    partial: BytesMut,
    /// The unread rest of the last pushed chunk.
    chunk: Bytes,
    max_payload_bytes: u32,
}

impl FrameReader {
    /// A reader that accepts payloads up to `max_payload_bytes`.
    pub fn new(max_payload_bytes: u32) -> Self {
        Self {
            partial: BytesMut::new(),
            chunk: Bytes::new(),
            max_payload_bytes,
        }
    }

    /// A reader for a stream that has not authenticated (64 KiB limit).
    pub fn preauth() -> Self {
        Self::new(PREAUTH_MAX_PAYLOAD_BYTES)
    }

    /// Changes the limit, e.g. once the stream authenticated.
    pub fn set_max_payload_bytes(&mut self, max_payload_bytes: u32) {
        self.max_payload_bytes = max_payload_bytes;
    }

    /// The current limit.
    pub fn max_payload_bytes(&self) -> u32 {
        self.max_payload_bytes
    }

    /// Bytes received but not yet returned as frames.
    pub fn buffered(&self) -> usize {
        self.partial.len() + self.chunk.len()
    }

    /// What the reader holds for a frame split across chunks: the frame's announced
    /// length once its header is in (the buffer is reserved for it then, so a client that
    /// sends only headers is charged what they announce), else the bytes it has. 0 when
    /// no split frame is pending; whole frames still in the last pushed chunk are not
    /// counted.
    pub fn reserved(&self) -> usize {
        if self.partial.is_empty() {
            return 0;
        }
        match FrameHeader::parse(&self.partial) {
            // A header past the limit reserves nothing: the frame is refused.
            Ok(Some(h)) if h.length <= self.max_payload_bytes => {
                (HEADER_LEN + h.length as usize).max(self.partial.len())
            }
            _ => self.partial.len(),
        }
    }

    /// Adds received bytes. Call [`FrameReader::next_frame`] until it returns `Ok(None)`
    /// before pushing again, or the chunk is copied.
    pub fn push(&mut self, data: Bytes) {
        if self.partial.is_empty() && self.chunk.is_empty() {
            self.chunk = data;
        } else {
            self.spill_chunk();
            self.partial.extend_from_slice(&data);
        }
    }

    /// Adds received bytes from a slice (always copied).
    pub fn push_slice(&mut self, data: &[u8]) {
        self.spill_chunk();
        self.partial.extend_from_slice(data);
    }

    fn spill_chunk(&mut self) {
        if !self.chunk.is_empty() {
            self.partial.extend_from_slice(&self.chunk);
            self.chunk = Bytes::new();
        }
    }

    /// The next whole frame, `Ok(None)` when more bytes are needed. After an error for
    /// which [`FrameError::stream_still_aligned`] holds, the refused frame has been
    /// consumed and reading may continue; after any other error the stream is unusable.
    pub fn next_frame(&mut self) -> Result<Option<Frame>, FrameError> {
        if !self.chunk.is_empty() {
            match decode_frame(&self.chunk, self.max_payload_bytes) {
                Ok(Decoded::Complete { value, consumed }) => {
                    let _ = self.chunk.split_to(consumed);
                    return Ok(Some(value));
                }
                Ok(Decoded::NeedMore(_)) => self.spill_chunk(),
                Err(e) => {
                    if e.stream_still_aligned()
                        && let Some(len) = skip_len(&self.chunk)
                    {
                        let _ = self.chunk.split_to(len);
                    }
                    return Err(e);
                }
            }
        }
        // The partial buffer: only the header is inspected until the frame is whole.
        let Some(header) = FrameHeader::parse(&self.partial)? else {
            return Ok(None);
        };
        if header.length > self.max_payload_bytes {
            return Err(FrameError::TooLarge {
                length: header.length,
                max: self.max_payload_bytes,
            });
        }
        let total = HEADER_LEN + header.length as usize;
        if self.partial.len() < total {
            self.partial.reserve(total - self.partial.len());
            return Ok(None);
        }
        let whole = self.partial.split_to(total).freeze();
        let kind = header.kind()?;
        Ok(Some(Frame {
            flags: header.flags,
            kind,
            payload: whole.slice(HEADER_LEN..),
        }))
    }

    /// How many more bytes the next frame needs (0 when one is ready or nothing is
    /// buffered and the header is not started).
    pub fn needed(&self) -> usize {
        let pending: &[u8] = if self.chunk.is_empty() {
            &self.partial
        } else {
            &self.chunk
        };
        match FrameHeader::parse(pending) {
            Ok(Some(h)) => (HEADER_LEN + h.length as usize).saturating_sub(pending.len()),
            Ok(None) => HEADER_LEN - pending.len(),
            Err(_) => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_split_frame_reserves_its_announced_length_once_its_header_is_in() {
        let mut r = FrameReader::new(1 << 20);
        let f = frame(0, &vec![7u8; 100_000]);
        r.push(Bytes::copy_from_slice(&f[..8]));
        assert_eq!(r.next_frame().unwrap(), None);
        assert!(r.reserved() < 1024, "no header yet: {}", r.reserved());
        r.push(Bytes::copy_from_slice(&f[8..20]));
        assert_eq!(r.next_frame().unwrap(), None);
        assert!(r.reserved() >= f.len(), "{} of {}", r.reserved(), f.len());
        r.push(Bytes::copy_from_slice(&f[20..]));
        assert!(r.next_frame().unwrap().is_some());
        assert_eq!(r.reserved(), 0, "a finished frame is not charged");
        // A header announcing more than the limit is refused, and charged only its bytes
        // (it was charged 4 GiB, and a hostile client's connection closed).
        let mut r = FrameReader::new(1 << 20);
        let mut huge = frame(0, b"x");
        huge[8..12].copy_from_slice(&u32::MAX.to_be_bytes());
        r.push(Bytes::copy_from_slice(&huge[..12]));
        assert!(r.next_frame().is_err());
        assert!(r.reserved() <= 12, "{}", r.reserved());
        // Small whole frames served from a chunk reserve nothing.
        let mut r = FrameReader::new(1 << 20);
        let two = [frame(0, b"a"), frame(0, b"b")].concat();
        r.push(Bytes::from(two));
        assert!(r.next_frame().unwrap().is_some());
        assert_eq!(r.reserved(), 0);
    }

    fn frame(flags: u16, payload: &[u8]) -> Vec<u8> {
        let mut buf = BytesMut::new();
        write_frame(&mut buf, Flags(flags), payload).unwrap();
        buf.to_vec()
    }

    #[test]
    fn short_input_needs_more_and_is_not_malformed() {
        let bytes = frame(0, b"{\"type\":\"ok\"}");
        for cut in 0..bytes.len() {
            let prefix = Bytes::copy_from_slice(&bytes[..cut]);
            match decode_frame(&prefix, 1024) {
                Ok(Decoded::NeedMore(n)) => {
                    assert!(n > 0);
                    if cut >= HEADER_LEN {
                        assert_eq!(n, bytes.len() - cut);
                    }
                }
                other => panic!("cut {cut}: {other:?}"),
            }
        }
    }

    #[test]
    fn bad_headers_are_typed() {
        let mut b = frame(0, b"x");
        b[0] = b'G';
        assert!(matches!(
            decode_frame(&Bytes::from(b), 1024),
            Err(FrameError::BadMagic { .. })
        ));
        let mut b = frame(0, b"x");
        b[5] = 2;
        assert_eq!(
            decode_frame(&Bytes::from(b), 1024),
            Err(FrameError::UnsupportedVersion { found: 2 })
        );
        let b = frame(0, &[b'x'; 100]);
        assert_eq!(
            decode_frame(&Bytes::copy_from_slice(&b[..HEADER_LEN]), 64),
            Err(FrameError::TooLarge {
                length: 100,
                max: 64
            }),
            "the limit is enforced on the header alone"
        );
    }

    #[test]
    fn unknown_flags_are_refused_after_consuming_the_body() {
        let mut stream = frame(0x8000, b"junk");
        stream.extend(frame(0, b"{}"));
        let mut reader = FrameReader::new(1024);
        reader.push(Bytes::from(stream));
        let err = reader.next_frame().unwrap_err();
        assert!(err.stream_still_aligned());
        assert_eq!(
            err,
            FrameError::UnknownFlags {
                flags: Flags(0x8000),
                unknown: Flags(0x8000)
            }
        );
        let next = reader.next_frame().unwrap().unwrap();
        assert_eq!(&next.payload[..], b"{}");
    }

    #[test]
    fn reader_reassembles_frames_split_anywhere() {
        let mut stream = Vec::new();
        for i in 0..20u8 {
            stream.extend(frame(0, &vec![i; i as usize * 7]));
        }
        for split in [1, 2, 5, 11, 12, 13, 64, 1000] {
            let mut reader = FrameReader::new(1024);
            let mut got = Vec::new();
            for piece in stream.chunks(split) {
                reader.push(Bytes::copy_from_slice(piece));
                while let Some(f) = reader.next_frame().unwrap() {
                    got.push(f.payload);
                }
            }
            assert_eq!(got.len(), 20, "split {split}");
            for (i, p) in got.iter().enumerate() {
                assert_eq!(p.len(), i * 7);
                assert!(p.iter().all(|b| *b == i as u8));
            }
            assert_eq!(reader.buffered(), 0);
        }
    }

    #[test]
    fn whole_frames_in_a_chunk_are_not_copied() {
        let chunk = Bytes::from(frame(0, b"{\"type\":\"ok\"}"));
        let base = chunk.as_ptr() as usize;
        let mut reader = FrameReader::new(1024);
        reader.push(chunk);
        let f = reader.next_frame().unwrap().unwrap();
        assert_eq!(f.payload.as_ptr() as usize, base + HEADER_LEN);
    }
}
