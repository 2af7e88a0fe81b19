//! The internal frame header, one-shot frame decoding, and [`InternalReader`] for a byte
//! stream delivered in arbitrary chunks.
//!
//! The header is judged alone (magic, version, length against the limit) before any of
//! the body is buffered; the body is decoded only once the whole frame is there, so a
//! short stream is always "need more bytes" and never an error.

use bytes::{Bytes, BytesMut};

use super::error::InternalError;
use super::message::InternalMessage;
use super::{DEFAULT_MAX_PAYLOAD_BYTES, HEADER_LEN, MAGIC, VERSION};
use crate::frame::Decoded;

/// A parsed internal frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InternalHeader {
    /// The message kind ([`kind`](super::kind)); unknown kinds are not refused here.
    pub kind: u16,
    /// Payload length in bytes.
    pub length: u32,
}

impl InternalHeader {
    /// Reads a header from the first 12 bytes; `Ok(None)` when fewer are available.
    /// Checks magic and version, not the length (see [`InternalHeader::check_length`]).
    pub fn parse(bytes: &[u8]) -> Result<Option<InternalHeader>, InternalError> {
        let Some(h) = bytes.first_chunk::<HEADER_LEN>() else {
            return Ok(None);
        };
        let magic = u32::from_be_bytes([h[0], h[1], h[2], h[3]]);
        if magic != MAGIC {
            return Err(InternalError::BadMagic { found: magic });
        }
        let version = u16::from_be_bytes([h[4], h[5]]);
        if version != VERSION {
            return Err(InternalError::UnsupportedVersion { found: version });
        }
        Ok(Some(InternalHeader {
            kind: u16::from_be_bytes([h[6], h[7]]),
            length: u32::from_be_bytes([h[8], h[9], h[10], h[11]]),
        }))
    }

    /// Refuses a payload longer than `max_payload_bytes`.
    pub fn check_length(&self, max_payload_bytes: u32) -> Result<(), InternalError> {
        if self.length > max_payload_bytes {
            return Err(InternalError::TooLarge {
                length: self.length,
                max: max_payload_bytes,
            });
        }
        Ok(())
    }

    /// Header plus payload, in bytes.
    pub fn frame_len(&self) -> usize {
        HEADER_LEN + self.length as usize
    }

    /// The 12 header bytes.
    pub fn to_bytes(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        out[..4].copy_from_slice(&MAGIC.to_be_bytes());
        out[4..6].copy_from_slice(&VERSION.to_be_bytes());
        out[6..8].copy_from_slice(&self.kind.to_be_bytes());
        out[8..].copy_from_slice(&self.length.to_be_bytes());
        out
    }
}

/// Decodes one message from the front of `buf`. The message's strings and records are
/// zero-copy slices of `buf`. On [`InternalError::Malformed`] the frame was whole and
/// its length is the header's ([`InternalHeader::frame_len`]).
pub fn decode_frame(
    buf: &Bytes,
    max_payload_bytes: u32,
) -> Result<Decoded<InternalMessage>, InternalError> {
    let Some(header) = InternalHeader::parse(buf)? else {
        return Ok(Decoded::NeedMore(HEADER_LEN - buf.len()));
    };
    header.check_length(max_payload_bytes)?;
    let total = header.frame_len();
    if buf.len() < total {
        return Ok(Decoded::NeedMore(total - buf.len()));
    }
    let value = InternalMessage::decode_payload(header.kind, &buf.slice(HEADER_LEN..total))?;
    Ok(Decoded::Complete {
        value,
        consumed: total,
    })
}

/// Reassembles internal messages from a byte stream delivered in arbitrary chunks.
///
/// Whole frames inside a pushed chunk are decoded in place, so their records are slices
/// of that chunk; only a frame split across chunks is copied into the reader's own
/// buffer, which never holds more than one partial frame. A header announcing more than
/// the limit is refused before its body is buffered.
#[derive(Debug)]
pub struct InternalReader {
    /// Bytes of a frame split across chunks (empty when `chunk` is not).
    partial: BytesMut,
    /// The unread rest of the last pushed chunk.
    chunk: Bytes,
    max_payload_bytes: u32,
}

impl Default for InternalReader {
    /// A reader with the default 64 MiB limit.
    fn default() -> Self {
        Self::new(DEFAULT_MAX_PAYLOAD_BYTES)
    }
}

impl InternalReader {
    /// A reader that accepts payloads up to `max_payload_bytes`.
    pub fn new(max_payload_bytes: u32) -> Self {
        Self {
            partial: BytesMut::new(),
            chunk: Bytes::new(),
            max_payload_bytes,
        }
    }

    /// Changes the limit, e.g. once `Hello` was accepted.
    pub fn set_max_payload_bytes(&mut self, max_payload_bytes: u32) {
        self.max_payload_bytes = max_payload_bytes;
    }

    /// The current limit.
    pub fn max_payload_bytes(&self) -> u32 {
        self.max_payload_bytes
    }

    /// Bytes received but not yet returned as messages.
    pub fn buffered(&self) -> usize {
        self.partial.len() + self.chunk.len()
    }

    /// Adds received bytes. Call [`InternalReader::next`] until it returns `Ok(None)`
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

    /// The next message; `Ok(None)` when more bytes are needed.
    ///
    /// After [`InternalError::Malformed`] the refused frame has been consumed and
    /// reading may continue. After a fatal error ([`InternalError::is_fatal`]) the
    /// stream is unusable: the bytes stay buffered and every call repeats the error.
    #[allow(
        clippy::should_implement_trait,
        reason = "not an Iterator: None means 'need more bytes', and reading resumes after push"
    )]
    pub fn next(&mut self) -> Result<Option<InternalMessage>, InternalError> {
        if !self.chunk.is_empty() {
            if let Some(header) = InternalHeader::parse(&self.chunk)? {
                header.check_length(self.max_payload_bytes)?;
                let total = header.frame_len();
                if self.chunk.len() >= total {
                    let frame = self.chunk.split_to(total);
                    return Self::decode(header, &frame);
                }
            }
            self.spill_chunk();
        }
        let Some(header) = InternalHeader::parse(&self.partial)? else {
            return Ok(None);
        };
        header.check_length(self.max_payload_bytes)?;
        let total = header.frame_len();
        if self.partial.len() < total {
            self.partial.reserve(total - self.partial.len());
            return Ok(None);
        }
        let frame = self.partial.split_to(total).freeze();
        Self::decode(header, &frame)
    }

    fn decode(
        header: InternalHeader,
        frame: &Bytes,
    ) -> Result<Option<InternalMessage>, InternalError> {
        InternalMessage::decode_payload(header.kind, &frame.slice(HEADER_LEN..)).map(Some)
    }

    /// How many more bytes the next frame needs at least: 0 when a whole frame is
    /// buffered or after a fatal error, the rest of the header while it is incomplete.
    pub fn needed(&self) -> usize {
        let pending: &[u8] = if self.chunk.is_empty() {
            &self.partial
        } else {
            &self.chunk
        };
        match InternalHeader::parse(pending) {
            Ok(Some(h)) => h.frame_len().saturating_sub(pending.len()),
            Ok(None) => HEADER_LEN - pending.len(),
            Err(_) => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::internal::{Ping, Pong};

    fn ping(correlation_id: u64) -> Vec<u8> {
        let mut buf = BytesMut::new();
        Ping { correlation_id }.encode(&mut buf).unwrap();
        buf.to_vec()
    }

    #[test]
    fn needed_counts_down_to_a_whole_frame() {
        let bytes = ping(1);
        let mut reader = InternalReader::default();
        assert_eq!(reader.needed(), HEADER_LEN);
        reader.push_slice(&bytes[..5]);
        assert_eq!(reader.needed(), HEADER_LEN - 5);
        reader.push_slice(&bytes[5..14]);
        assert_eq!(reader.next(), Ok(None));
        assert_eq!(reader.needed(), bytes.len() - 14);
        reader.push_slice(&bytes[14..]);
        assert_eq!(reader.needed(), 0);
        assert_eq!(reader.next(), Ok(Some(Ping { correlation_id: 1 }.into())));
        assert_eq!(reader.buffered(), 0);
    }

    #[test]
    fn a_frame_split_across_chunks_is_joined_and_the_rest_stays_sliced() {
        let mut stream = ping(1);
        stream.extend(ping(2));
        let mut pong = BytesMut::new();
        Pong { correlation_id: 3 }.encode(&mut pong).unwrap();
        stream.extend_from_slice(&pong);
        let mut reader = InternalReader::new(64);
        // The first chunk ends inside the second frame.
        reader.push(Bytes::copy_from_slice(&stream[..30]));
        assert_eq!(reader.next(), Ok(Some(Ping { correlation_id: 1 }.into())));
        assert_eq!(reader.next(), Ok(None));
        reader.push(Bytes::copy_from_slice(&stream[30..]));
        assert_eq!(reader.next(), Ok(Some(Ping { correlation_id: 2 }.into())));
        assert_eq!(reader.next(), Ok(Some(Pong { correlation_id: 3 }.into())));
        assert_eq!(reader.next(), Ok(None));
        assert_eq!(reader.buffered(), 0);
    }

    #[test]
    fn header_round_trips() {
        let header = InternalHeader {
            kind: 0xBEEF,
            length: 0x0102_0304,
        };
        assert_eq!(InternalHeader::parse(&header.to_bytes()), Ok(Some(header)));
        assert_eq!(InternalHeader::parse(&header.to_bytes()[..11]), Ok(None));
        assert_eq!(&header.to_bytes()[..6], b"FLXI\x00\x01");
    }
}
