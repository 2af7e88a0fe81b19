//! Field-level reading and writing for the internal protocol.
//!
//! Every read checks the bytes left first and names its field, so a short or lying body
//! is a [`BodyError`], never a panic. Strings are `u32` length + UTF-8 and carry their
//! limit with their name ([`Field`]), so the limit is checked on the length prefix
//! before the bytes are looked at, and the writer enforces the same limit.

use bytes::{BufMut, Bytes, BytesMut};

use super::error::{BodyError, EncodeError};
use super::{HEADER_LEN, InternalHeader, MAX_IDENT_BYTES, MAX_TEXT_BYTES, MAX_TOKEN_BYTES};
use crate::binary::WireStr;

/// A string field: its name and its limit in bytes.
#[derive(Debug, Clone, Copy)]
pub(super) struct Field {
    pub(super) name: &'static str,
    pub(super) max: usize,
}

pub(super) const NODE_ID: Field = Field {
    name: "node_id",
    max: MAX_IDENT_BYTES,
};
pub(super) const LEADER: Field = Field {
    name: "leader",
    max: MAX_IDENT_BYTES,
};
pub(super) const TENANT: Field = Field {
    name: "tenant",
    max: MAX_IDENT_BYTES,
};
pub(super) const NAMESPACE: Field = Field {
    name: "namespace",
    max: MAX_IDENT_BYTES,
};
pub(super) const NAME: Field = Field {
    name: "name",
    max: MAX_IDENT_BYTES,
};
pub(super) const INCARNATION: Field = Field {
    name: "incarnation",
    max: MAX_IDENT_BYTES,
};
pub(super) const TOKEN: Field = Field {
    name: "token",
    max: MAX_TOKEN_BYTES,
};
pub(super) const REASON: Field = Field {
    name: "reason",
    max: MAX_TEXT_BYTES,
};
pub(super) const DETAIL: Field = Field {
    name: "detail",
    max: MAX_TEXT_BYTES,
};

/// A bounds-checked big-endian reader over a shared buffer.
pub(super) struct Cursor<'a> {
    buf: &'a Bytes,
    pos: usize,
}

impl<'a> Cursor<'a> {
    pub(super) fn new(buf: &'a Bytes) -> Self {
        Self { buf, pos: 0 }
    }

    pub(super) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, len: usize, field: &'static str) -> Result<&'a [u8], BodyError> {
        let available = self.remaining();
        if len > available {
            return Err(BodyError::Truncated {
                field,
                needed: len,
                available,
            });
        }
        let start = self.pos;
        self.pos += len;
        Ok(&self.buf[start..self.pos])
    }

    fn array<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N], BodyError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N, field)?);
        Ok(a)
    }

    pub(super) fn u8(&mut self, field: &'static str) -> Result<u8, BodyError> {
        Ok(self.take(1, field)?[0])
    }

    pub(super) fn u16(&mut self, field: &'static str) -> Result<u16, BodyError> {
        Ok(u16::from_be_bytes(self.array(field)?))
    }

    pub(super) fn u32(&mut self, field: &'static str) -> Result<u32, BodyError> {
        Ok(u32::from_be_bytes(self.array(field)?))
    }

    pub(super) fn u64(&mut self, field: &'static str) -> Result<u64, BodyError> {
        Ok(u64::from_be_bytes(self.array(field)?))
    }

    /// `len` bytes as a zero-copy slice of the input.
    pub(super) fn bytes(&mut self, len: usize, field: &'static str) -> Result<Bytes, BodyError> {
        let start = self.pos;
        self.take(len, field)?;
        Ok(self.buf.slice(start..self.pos))
    }

    /// Everything left, as a zero-copy slice; the cursor is then at the end.
    pub(super) fn rest(&mut self) -> Bytes {
        let start = self.pos;
        self.pos = self.buf.len();
        self.buf.slice(start..)
    }

    /// A `u32`-length-prefixed UTF-8 string, zero-copy. The limit is checked on the
    /// prefix, before the bytes.
    pub(super) fn wire_str(&mut self, field: Field) -> Result<WireStr, BodyError> {
        let len = self.u32(field.name)? as usize;
        if len > field.max {
            return Err(BodyError::StringTooLong {
                field: field.name,
                len,
                max: field.max,
            });
        }
        let bytes = self.bytes(len, field.name)?;
        WireStr::from_utf8(bytes).map_err(|_| BodyError::InvalidUtf8 { field: field.name })
    }

    /// A `u32`-length-prefixed UTF-8 string, owned.
    pub(super) fn string(&mut self, field: Field) -> Result<String, BodyError> {
        Ok(self.wire_str(field)?.as_str().to_owned())
    }

    /// A `u32` element count, checked against what the rest of the body could hold
    /// (`min_element_bytes` each) so a lying count cannot make the caller allocate.
    pub(super) fn count(
        &mut self,
        min_element_bytes: usize,
        field: &'static str,
    ) -> Result<usize, BodyError> {
        let count = self.u32(field)? as usize;
        let fits = self.remaining() / min_element_bytes.max(1);
        if count > fits {
            return Err(BodyError::CountTooLarge {
                field,
                count,
                remaining: self.remaining(),
            });
        }
        Ok(count)
    }

    pub(super) fn finish(self) -> Result<(), BodyError> {
        match self.remaining() {
            0 => Ok(()),
            count => Err(BodyError::TrailingBytes { count }),
        }
    }
}

/// Appends a `u32`-length-prefixed string, refusing one over the field's limit.
pub(super) fn put_str(buf: &mut BytesMut, field: Field, s: &str) -> Result<(), BodyError> {
    if s.len() > field.max {
        return Err(BodyError::StringTooLong {
            field: field.name,
            len: s.len(),
            max: field.max,
        });
    }
    // The limit is far below u32::MAX.
    buf.put_u32(s.len() as u32);
    buf.put_slice(s.as_bytes());
    Ok(())
}

/// Appends one whole frame: header, `correlation_id`, then what `body` writes. On any
/// error the buffer is left as it was.
pub(super) fn encode_frame(
    buf: &mut BytesMut,
    kind: u16,
    correlation_id: u64,
    body_len_hint: usize,
    body: impl FnOnce(&mut BytesMut) -> Result<(), BodyError>,
) -> Result<(), EncodeError> {
    let start = buf.len();
    buf.reserve(HEADER_LEN + 8 + body_len_hint);
    buf.put_slice(&InternalHeader { kind, length: 0 }.to_bytes());
    buf.put_u64(correlation_id);
    if let Err(problem) = body(buf) {
        buf.truncate(start);
        return Err(EncodeError::Invalid { kind, problem });
    }
    let length = buf.len() - start - HEADER_LEN;
    let Ok(length32) = u32::try_from(length) else {
        buf.truncate(start);
        return Err(EncodeError::PayloadTooLong { length });
    };
    buf[start + 8..start + HEADER_LEN].copy_from_slice(&length32.to_be_bytes());
    Ok(())
}
