//! Fuzzing entry points, shared by the `cargo fuzz` targets in `wire/fuzz` and by the
//! corpus replay in the test suite. Each feeds arbitrary bytes to a decoder and checks
//! that whatever decodes re-encodes to something that decodes the same.

use bytes::{Bytes, BytesMut};

use crate::binary::{EventBatch, PublishAck, PublishBatch};
use crate::flags::Flags;
use crate::frame::{Decoded, FrameReader, HEADER_LEN};
use crate::internal::{self, InternalError, InternalHeader, InternalMessage, InternalReader};
use crate::message::Message;

/// Frames: arbitrary bytes through a [`FrameReader`], pushed in two pieces at a point
/// chosen by the first byte. Frames that come out respect the limit.
pub fn frames(data: &[u8]) {
    let limit = 256;
    let split = data.first().map_or(0, |b| usize::from(*b)).min(data.len());
    let mut reader = FrameReader::new(limit);
    for piece in [&data[..split], &data[split..]] {
        reader.push(Bytes::copy_from_slice(piece));
        loop {
            match reader.next_frame() {
                Ok(Some(frame)) => assert!(frame.payload.len() <= limit as usize),
                Ok(None) => break,
                Err(e) if e.stream_still_aligned() => continue,
                Err(_) => return,
            }
        }
    }
    assert!(reader.buffered() <= data.len());
    assert!(reader.buffered() < HEADER_LEN + limit as usize || reader.needed() == 0);
}

/// JSON messages: whatever decodes re-encodes and decodes to the same message.
pub fn json_message(data: &[u8]) {
    if let Ok(message) = Message::decode(data)
        && !matches!(message, Message::Unknown)
    {
        let again = Message::decode(&message.to_payload()).expect("our own encoding decodes");
        assert_eq!(again, message);
    }
}

/// Binary layouts: the first two bytes are flags, the rest a payload offered to every
/// binary decoder.
pub fn binary_layouts(data: &[u8]) {
    publish_batch(data);
    publish_ack(data);
    event_batch(data);
}

fn split_flags(data: &[u8]) -> Option<(Flags, Bytes)> {
    let (head, rest) = data.split_first_chunk::<2>()?;
    Some((
        Flags(u16::from_be_bytes(*head)),
        Bytes::copy_from_slice(rest),
    ))
}

/// Publish batches: the first two bytes are flags. Whatever decodes re-encodes to the
/// identical payload (the layout is canonical) under the same flags.
pub fn publish_batch(data: &[u8]) {
    let Some((flags, payload)) = split_flags(data) else {
        return;
    };
    if let Ok(batch) = PublishBatch::decode(flags, &payload) {
        let mut buf = BytesMut::new();
        batch
            .encode_frame(&mut buf)
            .expect("a decoded batch re-encodes");
        assert_eq!(
            &buf[HEADER_LEN..],
            &payload[..],
            "publish batch is canonical"
        );
        assert_eq!(batch.flags(), flags);
    }
}

/// Publish acks: the first two bytes are flags. Whatever decodes re-encodes and decodes
/// to the same ack.
pub fn publish_ack(data: &[u8]) {
    let Some((flags, payload)) = split_flags(data) else {
        return;
    };
    if let Ok(ack) = PublishAck::decode(flags, &payload) {
        let mut buf = BytesMut::new();
        ack.encode_frame(&mut buf, Flags::KNOWN)
            .expect("a decoded ack re-encodes");
        let again = PublishAck::decode(ack.flags(Flags::KNOWN), &buf.freeze().slice(HEADER_LEN..))
            .expect("our own ack decodes");
        assert_eq!(again, ack);
    }
}

/// Event batches: the first two bytes are flags. Whatever decodes re-encodes to the
/// identical payload.
pub fn event_batch(data: &[u8]) {
    let Some((flags, payload)) = split_flags(data) else {
        return;
    };
    if let Ok(events) = EventBatch::decode(flags, &payload) {
        let mut buf = BytesMut::new();
        events
            .encode_frame(&mut buf)
            .expect("a decoded batch re-encodes");
        assert_eq!(&buf[HEADER_LEN..], &payload[..], "event batch is canonical");
    }
}

/// Internal (broker-to-broker) frames: arbitrary bytes decoded frame by frame. Whatever
/// decodes re-encodes to the same bytes (an `Unknown` message, whose body is skipped,
/// to its kind and correlation id). An [`InternalReader`] fed the same bytes in two
/// pieces, split at a point chosen by the first byte, yields the same messages and
/// errors in the same order.
pub fn internal(data: &[u8]) {
    let limit = 4096;
    let mut expected: Vec<Result<InternalMessage, InternalError>> = Vec::new();
    let mut rest = Bytes::copy_from_slice(data);
    loop {
        match internal::decode_frame(&rest, limit) {
            Ok(Decoded::Complete { value, consumed }) => {
                let mut buf = BytesMut::new();
                value
                    .encode(&mut buf)
                    .expect("a decoded internal message re-encodes");
                if let InternalMessage::Unknown { kind, .. } = value {
                    // Only the kind and the correlation id survive an unknown kind.
                    assert!(!internal::kind::is_known(kind));
                    assert_eq!(&buf[..8], &rest[..8], "magic, version, kind");
                    assert_eq!(
                        &buf[internal::HEADER_LEN..],
                        &rest[internal::HEADER_LEN..][..8]
                    );
                } else {
                    assert_eq!(
                        &buf[..],
                        &rest[..consumed],
                        "internal encoding is canonical"
                    );
                }
                expected.push(Ok(value));
                let _ = rest.split_to(consumed);
            }
            Ok(Decoded::NeedMore(n)) => {
                assert!(n > 0);
                break;
            }
            Err(e) if e.is_fatal() => {
                expected.push(Err(e));
                break;
            }
            Err(e) => {
                let header = InternalHeader::parse(&rest)
                    .expect("a malformed body had a valid header")
                    .expect("and a whole one");
                assert!(header.length <= limit && rest.len() >= header.frame_len());
                expected.push(Err(e));
                let _ = rest.split_to(header.frame_len());
            }
        }
    }

    let split = data.first().map_or(0, |b| usize::from(*b)).min(data.len());
    let mut reader = InternalReader::new(limit);
    let mut got = Vec::new();
    'pieces: for piece in [&data[..split], &data[split..]] {
        reader.push(Bytes::copy_from_slice(piece));
        loop {
            match reader.next() {
                Ok(Some(message)) => got.push(Ok(message)),
                Ok(None) => break,
                Err(e) => {
                    let fatal = e.is_fatal();
                    got.push(Err(e));
                    if fatal {
                        break 'pieces;
                    }
                }
            }
        }
    }
    assert_eq!(got, expected, "the reader agrees with one-shot decoding");
    assert!(reader.buffered() <= data.len());
}
