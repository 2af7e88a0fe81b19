//! Serde helpers: byte fields travel in JSON as standard, padded base64 strings.

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use bytes::Bytes;
use serde::de::{Error, SeqAccess, Visitor};
use serde::{Deserializer, Serializer};
use std::fmt;

struct B64Visitor;

impl<'de> Visitor<'de> for B64Visitor {
    type Value = Bytes;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a base64 string")
    }

    fn visit_str<E: Error>(self, v: &str) -> Result<Bytes, E> {
        STANDARD
            .decode(v)
            .map(Bytes::from)
            .map_err(|e| E::custom(format_args!("invalid base64: {e}")))
    }
}

pub(crate) fn serialize<S: Serializer>(v: &Bytes, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&STANDARD.encode(v))
}

pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Bytes, D::Error> {
    d.deserialize_str(B64Visitor)
}

pub(crate) mod option {
    use super::*;

    pub(crate) fn serialize<S: Serializer>(v: &Option<Bytes>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(b) => super::serialize(b, s),
            None => s.serialize_none(),
        }
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Bytes>, D::Error> {
        struct OptVisitor;
        impl<'de> Visitor<'de> for OptVisitor {
            type Value = Option<Bytes>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a base64 string or null")
            }
            fn visit_none<E: Error>(self) -> Result<Self::Value, E> {
                Ok(None)
            }
            fn visit_unit<E: Error>(self) -> Result<Self::Value, E> {
                Ok(None)
            }
            fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
                super::deserialize(d).map(Some)
            }
        }
        d.deserialize_option(OptVisitor)
    }
}

pub(crate) mod vec {
    use super::*;
    use serde::ser::SerializeSeq;

    pub(crate) fn serialize<S: Serializer>(v: &[Bytes], s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(v.len()))?;
        for b in v {
            seq.serialize_element(&STANDARD.encode(b))?;
        }
        seq.end()
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Bytes>, D::Error> {
        struct VecVisitor;
        impl<'de> Visitor<'de> for VecVisitor {
            type Value = Vec<Bytes>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an array of base64 strings")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                // The hint comes from the peer; cap it so a lie cannot allocate.
                let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1024));
                while let Some(s) = seq.next_element::<std::borrow::Cow<'de, str>>()? {
                    out.push(B64Visitor.visit_str::<A::Error>(&s)?);
                }
                Ok(out)
            }
        }
        d.deserialize_seq(VecVisitor)
    }
}

/// [`vec`] for a request's records: past [`crate::internal::MAX_RECORDS_PER_MESSAGE`]
/// only one more is kept (the rest are read and checked, not kept), for a batch the
/// broker refuses by its count anyway. (The broker's decoder refuses a request of more
/// than a million JSON values first; up to that, serde's tagged-enum buffering still
/// holds each value once, and this saves the second list.)
pub(crate) mod vec_capped {
    use super::*;

    pub(crate) fn serialize<S: Serializer>(v: &[Bytes], s: S) -> Result<S::Ok, S::Error> {
        super::vec::serialize(v, s)
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Bytes>, D::Error> {
        struct CappedVisitor;
        impl<'de> Visitor<'de> for CappedVisitor {
            type Value = Vec<Bytes>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an array of base64 strings")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let keep = crate::internal::MAX_RECORDS_PER_MESSAGE + 1;
                let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1024));
                while let Some(s) = seq.next_element::<std::borrow::Cow<'de, str>>()? {
                    let b = B64Visitor.visit_str::<A::Error>(&s)?;
                    if out.len() < keep {
                        out.push(b);
                    }
                }
                Ok(out)
            }
        }
        d.deserialize_seq(CappedVisitor)
    }
}

#[cfg(test)]
mod tests {
    /// A JSON batch of more records than one message carries keeps one more than that,
    /// however many it names (the broker refuses it by its count, naming its request);
    /// one at the limit decodes whole.
    #[test]
    fn a_json_batch_of_more_records_than_a_message_carries_keeps_one_more() {
        let max = crate::internal::MAX_RECORDS_PER_MESSAGE;
        for n in [max, max + 1, max * 3] {
            let payloads = vec!["\"\""; n].join(",");
            let json = format!(
                r#"{{"type":"publish_batch","tenant_id":"t","namespace":"n","stream":"s","payloads":[{payloads}],"request_id":7}}"#
            );
            let m = crate::Message::decode(json.as_bytes()).unwrap();
            let crate::Message::PublishBatch { payloads, .. } = m else {
                panic!("{m:?}");
            };
            assert_eq!(payloads.len(), n.min(max + 1), "{n}");
        }
    }
}
