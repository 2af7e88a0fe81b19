//! Answers: the one place publish outcomes, relayed leader answers and errors become
//! frames. Every string an answer carries is bounded before it is written (see
//! [`crate::error::ERROR_TEXT_MAX_BYTES`]), so encoding never fails.

use bytes::{Bytes, BytesMut};
use felix_wire::binary::OwnerHint;
use felix_wire::flags::FrameKind;
use felix_wire::message::PublishRefusalReason;
use felix_wire::{
    ErrorCode, Features, Flags, Frame, Generation, Message, Offset, PublishAck, RequestId,
};

use crate::cluster::Route;
use crate::error::{BrokerError, ERROR_TEXT_MAX_BYTES, cut_to};
use crate::session::Session;

/// Who is owed an answer to a publish, and in which layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AnswerTo {
    /// Nobody: an unacked publish.
    Nothing,
    /// A binary `publish_ack`.
    Binary(RequestId),
    /// A JSON `publish_ok` / `publish_error`.
    Json(RequestId),
}

impl AnswerTo {
    /// Whether an answer is owed.
    pub fn owed(self) -> bool {
        self != AnswerTo::Nothing
    }
}

/// An `error` frame for this client.
pub fn error(session: &Session, e: &BrokerError) -> Bytes {
    e.to_message(session.coded()).to_frame()
}

/// `frame`, or `limit_exceeded` in its place when its payload is more than a client's
/// frames carry ([`felix_wire::frame::DEFAULT_MAX_PAYLOAD_BYTES`], 16 MiB: one record
/// over about 12 MiB, base64 in JSON, makes such an answer; answers carry at most 4 MiB
/// of records but always one). Sent, the client's decoder refused it and its connection
/// was lost, and asked again it came again: a reader that could never get past the
/// record. `what` names what was asked (`records from offset 7`).
pub fn fit(session: &Session, frame: Bytes, what: impl FnOnce() -> String) -> Bytes {
    let payload = frame.len().saturating_sub(felix_wire::frame::HEADER_LEN);
    let max = felix_wire::frame::DEFAULT_MAX_PAYLOAD_BYTES as usize;
    if payload <= max {
        return frame;
    }
    let e = BrokerError::LimitExceeded(format!(
        "{}: the answer is {payload} bytes, more than a frame carries ({max}); a record \
         over about 12 MiB cannot be carried base64 in JSON",
        what()
    ));
    error(session, &e)
}

/// The answer to a publish: `Ok(first offset)` or why it failed. `owner` names the
/// leader when the publish was forwarded (binary acks carry it as a routing hint).
/// `None` when nothing is owed.
pub fn publish(
    session: &Session,
    to: AnswerTo,
    result: Result<u64, BrokerError>,
    owner: Option<&Route>,
) -> Option<Bytes> {
    let result = reused_for(session, result);
    match to {
        AnswerTo::Nothing => None,
        AnswerTo::Binary(rid) => {
            let mut ack = match result {
                Ok(first) => PublishAck::ok(rid, Some(Offset(first))),
                Err(e) => failed_ack(rid, &e),
            };
            ack.owner = owner.map(owner_hint);
            Some(encode_ack(session, &ack))
        }
        AnswerTo::Json(rid) => Some(
            match result {
                Err(BrokerError::Refused(reason)) => Message::PublishRefused {
                    request_id: rid,
                    message: format!("{reason:?}"),
                    reason,
                },
                Err(BrokerError::OffsetMismatch { tail }) => Message::PublishRefused {
                    request_id: rid,
                    reason: felix_wire::message::PublishRefusalReason::OffsetMismatch {
                        tail: Offset(tail),
                    },
                    message: format!("the shard's tail is {tail}"),
                },
                Ok(first) => Message::PublishOk {
                    request_id: rid,
                    offset: session
                        .flags
                        .contains(Flags::BINARY_PUBLISH_ACK_OFFSET)
                        .then_some(Offset(first)),
                },
                Err(e) => {
                    let coded = session.coded();
                    Message::PublishError {
                        request_id: rid,
                        message: e.wire_text(),
                        code: coded.then(|| e.code()),
                        retry: coded.then(|| e.retry_class()),
                        detail: if coded { e.detail() } else { None },
                    }
                }
            }
            .to_frame(),
        ),
    }
}

/// A client that does not read `sequence_reused` (it did not offer
/// `FEATURE_SEQUENCE_REUSED`) is told `invalid_request` instead: a refusal reason it
/// cannot decode, or an answer from the log that drops its batch, are both worse.
fn reused_for(session: &Session, result: Result<u64, BrokerError>) -> Result<u64, BrokerError> {
    match result {
        Err(BrokerError::Refused(PublishRefusalReason::SequenceReused))
            if !session.features.contains(Features::SEQUENCE_REUSED) =>
        {
            Err(BrokerError::InvalidRequest(
                "sequence_reused: this producer's sequence was used for another batch".into(),
            ))
        }
        other => other,
    }
}

fn failed_ack(rid: RequestId, e: &BrokerError) -> PublishAck {
    let mut ack = PublishAck::error(rid, e.wire_text(), e.code());
    if let (Some(code), Some(detail)) = (ack.code.as_mut(), e.detail()) {
        code.detail = Some((
            cut_to(&detail.reason.unwrap_or_default(), 256).to_owned(),
            detail.retry_after_ms.unwrap_or(0),
        ));
    }
    ack
}

fn owner_hint(route: &Route) -> OwnerHint {
    OwnerHint {
        node_id: cut_to(&route.leader, 256).to_owned(),
        addr: route.addr.map(|a| a.to_string()),
        generation: Generation(route.generation),
    }
}

fn encode_ack(session: &Session, ack: &PublishAck) -> Bytes {
    debug_assert!(ack.message.len() <= ERROR_TEXT_MAX_BYTES);
    let mut buf = BytesMut::with_capacity(64 + ack.message.len());
    ack.encode_frame(&mut buf, session.flags)
        .expect("every string of an ack is bounded far below its 16-bit length");
    buf.freeze()
}

/// The leader's answer to a forwarded publish, as an outcome for [`publish`]: its offset
/// or its error. A missing answer means the leader may or may not have applied it.
pub fn leader_publish_outcome(
    answer: Result<Option<Frame>, BrokerError>,
) -> Result<u64, BrokerError> {
    let frame = match answer {
        Ok(Some(f)) => f,
        Ok(None) => {
            return Err(BrokerError::Unacknowledged(
                "no answer from the shard leader".into(),
            ));
        }
        Err(e) => return Err(e),
    };
    let unexpected =
        || BrokerError::Unacknowledged("unexpected answer from the shard leader".into());
    match frame.kind {
        FrameKind::PublishAck => match PublishAck::decode(frame.flags, &frame.payload) {
            Ok(a) if a.status == felix_wire::binary::PublishAckStatus::Ok => {
                a.first_offset.map(|o| o.0).ok_or_else(unexpected)
            }
            Ok(a) => {
                let (code, detail) = a.code.map_or((None, None), |c| (Some(c.code), c.detail));
                Err(relayed_error(a.message, code, detail))
            }
            Err(_) => Err(unexpected()),
        },
        FrameKind::Json => match Message::decode(&frame.payload) {
            Ok(Message::PublishOk {
                offset: Some(o), ..
            }) => Ok(o.0),
            Ok(Message::PublishRefused { reason, .. }) => Err(BrokerError::Refused(reason)),
            Ok(Message::PublishError {
                message,
                code,
                detail,
                ..
            }) => Err(relayed_error(
                message,
                code,
                detail.map(|d| (d.reason.unwrap_or_default(), d.retry_after_ms.unwrap_or(0))),
            )),
            Ok(Message::Error {
                message,
                code,
                detail,
                ..
            }) => Err(relayed_error(
                message,
                code,
                detail.map(|d| (d.reason.unwrap_or_default(), d.retry_after_ms.unwrap_or(0))),
            )),
            _ => Err(unexpected()),
        },
        _ => Err(unexpected()),
    }
}

/// A leader's refusal as our own error, keeping its code (and so its retry class).
fn relayed_error(
    message: String,
    code: Option<ErrorCode>,
    detail: Option<(String, u64)>,
) -> BrokerError {
    let message = cut_to(&message, ERROR_TEXT_MAX_BYTES / 2);
    // The leader's message is its error's text, which starts with the kind's own words
    // ("unacknowledged: ..."): rewrapped whole it would say them twice.
    let prefix = match code {
        Some(ErrorCode::Unauthenticated) => "unauthenticated: ",
        Some(ErrorCode::Forbidden) => "forbidden: ",
        Some(ErrorCode::InvalidRequest) => "invalid request: ",
        Some(ErrorCode::ShardUnavailable) => "shard unavailable: ",
        Some(ErrorCode::Overloaded) => "overloaded: ",
        Some(ErrorCode::LimitExceeded) => "limit exceeded: ",
        Some(ErrorCode::Storage) => "storage: ",
        Some(ErrorCode::Unacknowledged) => "unacknowledged: ",
        _ => "",
    };
    let message = message.strip_prefix(prefix).unwrap_or(message).to_owned();
    let reason = detail.map(|(r, _)| r).unwrap_or_default();
    match code {
        Some(ErrorCode::Unauthenticated) => BrokerError::Unauthenticated(message),
        Some(ErrorCode::Forbidden) => BrokerError::Forbidden(message),
        Some(ErrorCode::NotFound) => BrokerError::NotFound(message),
        Some(ErrorCode::InvalidRequest) => BrokerError::InvalidRequest(message),
        Some(ErrorCode::ShardUnavailable) if !reason.is_empty() => {
            BrokerError::ShardUnavailable(cut_to(&reason, 64).to_owned())
        }
        Some(ErrorCode::ShardUnavailable) => BrokerError::ShardUnavailable(message),
        Some(ErrorCode::Overloaded) => BrokerError::Overloaded(if reason.is_empty() {
            message
        } else {
            cut_to(&reason, 64).to_owned()
        }),
        Some(ErrorCode::LimitExceeded) => BrokerError::LimitExceeded(message),
        Some(ErrorCode::Draining) => BrokerError::ShardUnavailable("owner_unavailable".into()),
        Some(ErrorCode::Storage) => BrokerError::Storage(message),
        Some(ErrorCode::Unacknowledged) => BrokerError::Unacknowledged(message),
        _ => BrokerError::Internal(message),
    }
}

/// A forwarded read whose answer was lost on the way: nothing was written, so it is
/// safe to ask again (`shard_unavailable`), where a write's outcome is unknown.
pub fn read_lost_is_retryable(e: BrokerError) -> BrokerError {
    match e {
        BrokerError::Unacknowledged(why) => BrokerError::ShardUnavailable(why),
        e => e,
    }
}

/// The leader's answer to a forwarded JSON request (a cache operation), passed through
/// as it came; our own error when there was none.
pub fn relay_json(session: &Session, answer: Result<Option<Frame>, BrokerError>) -> Bytes {
    match answer {
        Ok(Some(f)) if f.kind == FrameKind::Json => crate::forward::json_frame(&f.payload),
        Ok(_) => error(
            session,
            &BrokerError::Unacknowledged("unexpected answer from the shard leader".into()),
        ),
        Err(e) => error(session, &e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::testing::{parse_frame, session};

    #[test]
    fn an_ack_for_a_huge_error_text_still_encodes() {
        let s = session();
        let huge = "x".repeat(200_000);
        let e = BrokerError::InvalidRequest(format!("invalid stream name {huge:?}"));
        let frame = publish(&s, AnswerTo::Binary(RequestId(7)), Err(e), None).unwrap();
        let f = parse_frame(&frame);
        let ack = PublishAck::decode(f.flags, &f.payload).unwrap();
        assert_eq!(ack.request_id, RequestId(7));
        assert!(
            ack.message.len() <= ERROR_TEXT_MAX_BYTES,
            "{}",
            ack.message.len()
        );
    }

    #[test]
    fn binary_and_json_answers_say_the_same_thing() {
        let s = session();
        let b = parse_frame(&publish(&s, AnswerTo::Binary(RequestId(1)), Ok(42), None).unwrap());
        let ack = PublishAck::decode(b.flags, &b.payload).unwrap();
        assert_eq!(ack.first_offset, Some(Offset(42)));
        let j = parse_frame(&publish(&s, AnswerTo::Json(RequestId(1)), Ok(42), None).unwrap());
        assert!(matches!(
            Message::decode(&j.payload).unwrap(),
            Message::PublishOk {
                offset: Some(Offset(42)),
                ..
            }
        ));
        assert!(publish(&s, AnswerTo::Nothing, Ok(1), None).is_none());
        // A leader's coded refusal keeps its code through the relay.
        let refused = publish(
            &s,
            AnswerTo::Binary(RequestId(2)),
            Err(BrokerError::Overloaded("disk_full".into())),
            None,
        )
        .unwrap();
        let relayed = leader_publish_outcome(Ok(Some(parse_frame(&refused)))).unwrap_err();
        assert_eq!(relayed.code(), ErrorCode::Overloaded);
        // ... and says what the leader said once, not the kind's words twice.
        let unknown = publish(
            &s,
            AnswerTo::Binary(RequestId(3)),
            Err(BrokerError::Unacknowledged("leadership changed".into())),
            None,
        )
        .unwrap();
        let relayed = leader_publish_outcome(Ok(Some(parse_frame(&unknown)))).unwrap_err();
        assert_eq!(relayed.to_string(), "unacknowledged: leadership changed");
    }
}
