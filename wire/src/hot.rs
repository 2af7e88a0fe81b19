//! Decoding the requests a broker serves most, and the answers a client reads most,
//! without serde's buffering of tagged enums.
//!
//! `Message` is tagged by `"type"` inside the object, and serde decodes such an enum by
//! first copying the whole object into a buffer of values (its tag may come last), then
//! decoding the variant from that buffer: a cache put's 1 KiB value is copied as a
//! string before it is decoded from base64. Every client we know writes `"type"` first,
//! and so does our broker, so for the hot messages ([`decode`]) a payload that begins
//! `{"type":"<name>"` is decoded straight into a struct of that variant's fields, about
//! half the time for a small request (`cargo run --release -p felix-wire --example
//! decode_speed`).
//!
//! Each struct here mirrors its variant field for field, with the same serde attributes
//! (but a poll answer's records, read by [`strict_records`]: see there).
//! A payload the struct does not take (a field missing or mistyped, a key given twice,
//! whitespace or an escape before the name) is left to the generic decoder, so its
//! error is the generic decoder's. So is one with a field the variant does not know:
//! the enum ignores such a field only after reading its value in full (a number out of
//! range, a lone surrogate, bytes that are not UTF-8, nesting past 128 are refused),
//! where a struct would skip it unchecked.
//! `tests::the_fast_path_decodes_as_the_generic_one` and
//! `tests::the_fast_path_decodes_a_polls_records_as_the_generic_one` hold the two to the
//! same answer.

use bytes::Bytes;
use serde::Deserialize;
use serde::de::IgnoredAny;

use crate::ids::{Offset, RequestId, ShardId};
use crate::message::Message;

/// Declares each hot message: its tag, variant and fields (with their serde
/// attributes), a struct of those fields and the conversion to the variant.
macro_rules! hot {
    ($($tag:literal => $variant:ident {
        $($(#[$attr:meta])* $field:ident: $ty:ty,)*
    })*) => {
        $(
            #[derive(Deserialize)]
            #[serde(deny_unknown_fields)]
            struct $variant {
                /// Read so that a second `type` key is refused, as the enum refuses it.
                #[serde(rename = "type")]
                _tag: IgnoredAny,
                $($(#[$attr])* $field: $ty,)*
            }

            impl From<$variant> for Message {
                fn from(v: $variant) -> Message {
                    Message::$variant { $($field: v.$field,)* }
                }
            }
        )*

        /// `payload` decoded by the fast path: `None` when it is not one of the hot
        /// messages written `{"type":"<name>"...`, or when the struct refuses it.
        pub(crate) fn decode(payload: &[u8]) -> Option<Message> {
            let rest = payload.strip_prefix(br#"{"type":""#)?;
            let name = &rest[..rest.iter().position(|&b| b == b'"')?];
            match name {
                $($tag => serde_json::from_slice::<$variant>(payload).ok().map(Message::from),)*
                _ => None,
            }
        }
    };
}

hot! {
    b"group_poll" => GroupPoll {
        tenant_id: String,
        namespace: String,
        stream: String,
        shard: ShardId,
        group: String,
        max_records: u32,
        #[serde(default)]
        wait_ms: u64,
        request_id: RequestId,
        #[serde(default)]
        consumer: Option<String>,
        #[serde(default)]
        reclaim: bool,
        #[serde(default)]
        visibility_ms: Option<u64>,
    }
    b"group_ack" => GroupAck {
        tenant_id: String,
        namespace: String,
        stream: String,
        shard: ShardId,
        group: String,
        offset: Offset,
        request_id: RequestId,
    }
    b"group_nack" => GroupNack {
        tenant_id: String,
        namespace: String,
        stream: String,
        shard: ShardId,
        group: String,
        offset: Offset,
        request_id: RequestId,
        #[serde(default)]
        delay_ms: Option<u64>,
        #[serde(default)]
        attempts: Option<u32>,
    }
    b"cache_put" => CachePut {
        tenant_id: String,
        namespace: String,
        cache: String,
        key: String,
        #[serde(with = "crate::b64")]
        value: Bytes,
        #[serde(default)]
        request_id: Option<RequestId>,
        #[serde(default)]
        ttl_ms: Option<u64>,
    }
    b"cache_get" => CacheGet {
        tenant_id: String,
        namespace: String,
        cache: String,
        key: String,
        #[serde(default)]
        request_id: Option<RequestId>,
    }
    b"counter_add" => CounterAdd {
        tenant_id: String,
        namespace: String,
        cache: String,
        key: String,
        delta: i64,
        request_id: RequestId,
    }
    b"group_records" => GroupRecords {
        #[serde(deserialize_with = "strict_records")]
        records: Vec<crate::message::GroupRecord>,
        request_id: RequestId,
    }
    b"publish_ok" => PublishOk {
        request_id: RequestId,
        #[serde(default)]
        offset: Option<Offset>,
    }
    b"cache_ok" => CacheOk {
        request_id: RequestId,
    }
    b"counter_value" => CounterValue {
        #[serde(default)]
        value: Option<i64>,
        request_id: RequestId,
    }
    b"cache_value" => CacheValue {
        tenant_id: String,
        namespace: String,
        cache: String,
        key: String,
        #[serde(with = "crate::b64::option")]
        value: Option<Bytes>,
        #[serde(default)]
        request_id: Option<RequestId>,
        #[serde(default)]
        version: Option<u64>,
    }
    b"counter_get" => CounterGet {
        tenant_id: String,
        namespace: String,
        cache: String,
        key: String,
        request_id: RequestId,
    }
}

/// A poll answer's records, each refusing a member [`GroupRecord`] does not know: the
/// generic decoder reads such a member's value in full (and refuses a bad one), where
/// `GroupRecord` alone would skip it unchecked; refused here, the payload goes to the
/// generic decoder.
///
/// [`GroupRecord`]: crate::message::GroupRecord
fn strict_records<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Vec<crate::message::GroupRecord>, D::Error> {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Strict {
        offset: Offset,
        #[serde(with = "crate::b64")]
        payload: Bytes,
        #[serde(default)]
        attempts: u32,
        #[serde(default)]
        skipped_before: u64,
        #[serde(default)]
        publisher: Option<String>,
        #[serde(default)]
        timestamp_micros: Option<u64>,
    }
    let records = Vec::<Strict>::deserialize(d)?;
    Ok(records
        .into_iter()
        .map(|r| crate::message::GroupRecord {
            offset: r.offset,
            payload: r.payload,
            attempts: r.attempts,
            skipped_before: r.skipped_before,
            publisher: r.publisher,
            timestamp_micros: r.timestamp_micros,
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::GroupRecord;

    /// One message of each hot request and answer, optional fields set and not.
    fn samples() -> Vec<Message> {
        let (t, n) = (|| "t1".to_string(), || "default".to_string());
        vec![
            Message::GroupPoll {
                tenant_id: t(),
                namespace: n(),
                stream: "orders".into(),
                shard: ShardId(3),
                group: "workers".into(),
                max_records: 64,
                wait_ms: 200,
                request_id: RequestId(9),
                consumer: None,
                reclaim: false,
                visibility_ms: None,
            },
            Message::GroupPoll {
                tenant_id: t(),
                namespace: n(),
                stream: "orders".into(),
                shard: ShardId(0),
                group: "w\"x\\y".into(),
                max_records: 1,
                wait_ms: 0,
                request_id: RequestId(u64::MAX),
                consumer: Some("c-1".into()),
                reclaim: true,
                visibility_ms: Some(60_000),
            },
            Message::GroupAck {
                tenant_id: t(),
                namespace: n(),
                stream: "q".into(),
                shard: ShardId(0),
                group: "workers".into(),
                offset: Offset(123_456),
                request_id: RequestId(7),
            },
            Message::GroupNack {
                tenant_id: t(),
                namespace: n(),
                stream: "q".into(),
                shard: ShardId(1),
                group: "workers".into(),
                offset: Offset(5),
                request_id: RequestId(8),
                delay_ms: Some(250),
                attempts: Some(2),
            },
            Message::GroupNack {
                tenant_id: t(),
                namespace: n(),
                stream: "q".into(),
                shard: ShardId(1),
                group: "workers".into(),
                offset: Offset(5),
                request_id: RequestId(8),
                delay_ms: None,
                attempts: None,
            },
            Message::CachePut {
                tenant_id: t(),
                namespace: n(),
                cache: "primary".into(),
                key: "k\u{e9}y".into(),
                value: Bytes::from(vec![0xA5; 1024]),
                request_id: Some(RequestId(11)),
                ttl_ms: Some(1000),
            },
            Message::CachePut {
                tenant_id: t(),
                namespace: n(),
                cache: "primary".into(),
                key: "k".into(),
                value: Bytes::new(),
                request_id: None,
                ttl_ms: None,
            },
            Message::CacheGet {
                tenant_id: t(),
                namespace: n(),
                cache: "primary".into(),
                key: "demo-key".into(),
                request_id: Some(RequestId(12)),
            },
            Message::CounterAdd {
                tenant_id: t(),
                namespace: n(),
                cache: "counters".into(),
                key: "hits".into(),
                delta: -5,
                request_id: RequestId(13),
            },
            Message::CounterGet {
                tenant_id: t(),
                namespace: n(),
                cache: "counters".into(),
                key: "hits".into(),
                request_id: RequestId(14),
            },
            // Answers.
            Message::GroupRecords {
                records: vec![
                    GroupRecord {
                        offset: Offset(40),
                        payload: Bytes::from(vec![0x5A; 1024]),
                        attempts: 1,
                        skipped_before: 0,
                        publisher: None,
                        timestamp_micros: None,
                    },
                    GroupRecord {
                        offset: Offset(43),
                        payload: Bytes::new(),
                        attempts: 3,
                        skipped_before: 2,
                        publisher: Some("svc-\"a\"".into()),
                        timestamp_micros: Some(1_764_979_200_000_000),
                    },
                ],
                request_id: RequestId(15),
            },
            Message::GroupRecords {
                records: Vec::new(),
                request_id: RequestId(16),
            },
            Message::PublishOk {
                request_id: RequestId(17),
                offset: Some(Offset(99)),
            },
            Message::PublishOk {
                request_id: RequestId(18),
                offset: None,
            },
            Message::CacheOk {
                request_id: RequestId(19),
            },
            Message::CounterValue {
                value: Some(i64::MIN),
                request_id: RequestId(20),
            },
            Message::CounterValue {
                value: None,
                request_id: RequestId(21),
            },
            Message::CacheValue {
                tenant_id: t(),
                namespace: n(),
                cache: "primary".into(),
                key: "k".into(),
                value: Some(Bytes::from(vec![1, 2, 3])),
                request_id: Some(RequestId(22)),
                version: Some(7),
            },
            Message::CacheValue {
                tenant_id: t(),
                namespace: n(),
                cache: "primary".into(),
                key: "gone".into(),
                value: None,
                request_id: None,
                version: None,
            },
        ]
    }

    /// Values put in place of a member's own.
    const ODD: [&str; 13] = [
        "null",
        "\"x\"",
        "1.5",
        "-1",
        "0",
        "{}",
        "[]",
        "true",
        "\"\"",
        "18446744073709551616",
        "4294967296",
        "\"QUJD\"",
        "\"QUJD=\"",
    ];

    /// Members of no message, good and bad: the generic decoder reads their values in
    /// full and refuses the bad ones.
    fn unknown_values() -> Vec<Vec<u8>> {
        vec![
            b"[1,{\"a\":2}]".to_vec(),
            b"1e999".to_vec(),
            b"\"\\ud800\"".to_vec(),
            b"\"\xff\"".to_vec(),
            [vec![b'['; 200], vec![b']'; 200]].concat(),
        ]
    }

    /// The same for the members of a poll answer's record (the struct path decodes them
    /// with a struct of its own): each dropped, given twice or given another value, and
    /// members no record has, good and bad.
    #[test]
    fn the_fast_path_decodes_a_polls_records_as_the_generic_one() {
        let record = GroupRecord {
            offset: Offset(43),
            payload: Bytes::from_static(b"abc"),
            attempts: 3,
            skipped_before: 2,
            publisher: Some("svc".into()),
            timestamp_micros: Some(5),
        };
        let base = members(serde_json::to_string(&record).unwrap().as_bytes());
        let mut records: Vec<Vec<u8>> = vec![object(&base)];
        for i in 0..base.len() {
            let mut v = base.clone();
            v.remove(i);
            records.push(object(&v));
            let mut v = base.clone();
            v.push(base[i].clone());
            records.push(object(&v));
            for o in ODD {
                let mut v = base.clone();
                v[i].1 = o.to_string();
                records.push(object(&v));
            }
        }
        let whole = object(&base);
        let bad = unknown_values();
        for extra in &bad {
            records.push([&whole[..whole.len() - 1], b",\"x\":", extra, b"}"].concat());
        }
        let (mut fast, mut refused_unknown) = (0, 0);
        for (i, r) in records.iter().enumerate() {
            let p = [
                &br#"{"type":"group_records","records":["#[..],
                r,
                br#",{"offset":1,"payload":""}],"request_id":7}"#,
            ]
            .concat();
            let generic = serde_json::from_slice::<Message>(&p);
            match decode(&p) {
                Some(got) => {
                    fast += 1;
                    let text = String::from_utf8_lossy(&p);
                    assert_eq!(generic.as_ref().ok(), Some(&got), "{text}");
                }
                None if i >= records.len() - bad.len() => refused_unknown += 1,
                None => {}
            }
        }
        assert!(fast > 10, "{fast} of {} took the fast path", records.len());
        assert_eq!(
            refused_unknown,
            bad.len(),
            "records with members of no record"
        );
    }

    /// An object's members in the order written.
    struct Ordered(Vec<(String, serde_json::Value)>);

    impl<'de> Deserialize<'de> for Ordered {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Ordered, D::Error> {
            struct Members;
            impl<'de> serde::de::Visitor<'de> for Members {
                type Value = Ordered;
                fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                    f.write_str("an object")
                }
                fn visit_map<A: serde::de::MapAccess<'de>>(
                    self,
                    mut map: A,
                ) -> Result<Ordered, A::Error> {
                    let mut out = Vec::new();
                    while let Some(entry) = map.next_entry()? {
                        out.push(entry);
                    }
                    Ok(Ordered(out))
                }
            }
            d.deserialize_map(Members)
        }
    }

    /// The payload with its top-level members as (key, value) texts, in order.
    fn members(payload: &[u8]) -> Vec<(String, String)> {
        let Ordered(v) = serde_json::from_slice(payload).expect("an object");
        v.into_iter().map(|(k, v)| (k, v.to_string())).collect()
    }

    fn object(members: &[(String, String)]) -> Vec<u8> {
        let inner: Vec<String> = members
            .iter()
            .map(|(k, v)| format!("{}:{v}", serde_json::Value::String(k.clone())))
            .collect();
        format!("{{{}}}", inner.join(",")).into_bytes()
    }

    /// Every sample, and every way we could think of to bend it: each member dropped,
    /// given twice, or given another value; a member added; members reordered; the
    /// tag escaped or spaced. Wherever the fast path answers, the generic one answers
    /// the same; and it answers every sample as written.
    #[test]
    fn the_fast_path_decodes_as_the_generic_one() {
        let odd = ODD;
        let mut tried = 0;
        let mut fast = 0;
        for m in samples() {
            let payload = m.to_payload();
            assert_eq!(decode(&payload).as_ref(), Some(&m), "{m:?}");
            let base = members(&payload);
            // The tag stays first (the fast path's precondition) in all but the last.
            let mut variants: Vec<Vec<(String, String)>> = Vec::new();
            for i in 1..base.len() {
                let mut v = base.clone();
                v.remove(i);
                variants.push(v);
                let mut v = base.clone();
                v.push(base[i].clone());
                variants.push(v);
                for o in odd {
                    let mut v = base.clone();
                    v[i].1 = o.to_string();
                    variants.push(v);
                }
            }
            let mut v = base.clone();
            v.push(("unknown_field".into(), "[1,{\"a\":2}]".into()));
            variants.push(v);
            let mut v = base.clone();
            v[1..].reverse();
            variants.push(v);
            let mut v = base.clone();
            v.push(base[0].clone());
            variants.push(v);
            let mut v = base.clone();
            v[0].1 = "\"other\"".into();
            variants.push(v);
            let mut v = base.clone();
            v.rotate_left(1);
            variants.push(v);
            let mut payloads: Vec<Vec<u8>> = variants.iter().map(|v| object(v)).collect();
            let text = String::from_utf8(payload.clone()).unwrap();
            payloads.push(text.replacen("{\"type\":", "{ \"type\":", 1).into_bytes());
            payloads.push(text.replacen("_", "\\u005f", 1).into_bytes());
            // Fields the variant does not know, good and bad.
            let close = payload.len() - 1;
            for extra in unknown_values() {
                payloads.push([&payload[..close], b",\"x\":", &extra, b"}"].concat());
            }
            for p in payloads {
                tried += 1;
                let generic = serde_json::from_slice::<Message>(&p);
                if let Some(got) = decode(&p) {
                    fast += 1;
                    let text = String::from_utf8_lossy(&p);
                    assert_eq!(generic.as_ref().ok(), Some(&got), "{text}");
                }
            }
        }
        assert!(
            fast > 100 && fast < tried,
            "{fast} of {tried} took the fast path"
        );
    }
}
