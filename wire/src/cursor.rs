//! A bounds-checked big-endian reader over a shared buffer, for the binary layouts.
//!
//! Every read checks the remaining length first and names the field it was reading, so
//! a truncated or lying layout becomes a typed error and never a panic. Byte strings are
//! returned as slices of the input [`Bytes`], never copied.

use bytes::Bytes;

use crate::binary::{BinaryError, WireStr};

pub(crate) struct Reader<'a> {
    buf: &'a Bytes,
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a Bytes) -> Self {
        Self { buf, pos: 0 }
    }

    pub(crate) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, len: usize, field: &'static str) -> Result<&'a [u8], BinaryError> {
        let available = self.remaining();
        if len > available {
            return Err(BinaryError::Truncated {
                field,
                needed: len,
                available,
            });
        }
        let start = self.pos;
        self.pos += len;
        Ok(&self.buf[start..self.pos])
    }

    pub(crate) fn u8(&mut self, field: &'static str) -> Result<u8, BinaryError> {
        Ok(self.take(1, field)?[0])
    }

    pub(crate) fn u16(&mut self, field: &'static str) -> Result<u16, BinaryError> {
        let b = self.take(2, field)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }

    pub(crate) fn u32(&mut self, field: &'static str) -> Result<u32, BinaryError> {
        let b = self.take(4, field)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    pub(crate) fn u64(&mut self, field: &'static str) -> Result<u64, BinaryError> {
        let b = self.take(8, field)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_be_bytes(a))
    }

    /// `len` bytes as a zero-copy slice of the input.
    pub(crate) fn bytes(&mut self, len: usize, field: &'static str) -> Result<Bytes, BinaryError> {
        let start = self.pos;
        self.take(len, field)?;
        Ok(self.buf.slice(start..self.pos))
    }

    /// A `u16`-length-prefixed byte string.
    pub(crate) fn bytes16(&mut self, field: &'static str) -> Result<Bytes, BinaryError> {
        let len = self.u16(field)?;
        self.bytes(usize::from(len), field)
    }

    /// A `u16`-length-prefixed UTF-8 string.
    pub(crate) fn str16(&mut self, field: &'static str) -> Result<WireStr, BinaryError> {
        let bytes = self.bytes16(field)?;
        WireStr::from_utf8(bytes).map_err(|_| BinaryError::InvalidUtf8 { field })
    }

    /// A `u8`-length-prefixed UTF-8 string.
    pub(crate) fn str8(&mut self, field: &'static str) -> Result<WireStr, BinaryError> {
        let len = self.u8(field)?;
        let bytes = self.bytes(usize::from(len), field)?;
        WireStr::from_utf8(bytes).map_err(|_| BinaryError::InvalidUtf8 { field })
    }

    /// A `u32` element count, checked against what the rest of the buffer could hold
    /// (`min_element_bytes` each) so a lying count cannot make the caller allocate.
    pub(crate) fn count(
        &mut self,
        min_element_bytes: usize,
        field: &'static str,
    ) -> Result<usize, BinaryError> {
        let count = self.u32(field)? as usize;
        let fits = self.remaining() / min_element_bytes.max(1);
        if count > fits {
            return Err(BinaryError::CountTooLarge {
                field,
                count,
                remaining: self.remaining(),
            });
        }
        Ok(count)
    }

    pub(crate) fn finish(self) -> Result<(), BinaryError> {
        match self.remaining() {
            0 => Ok(()),
            count => Err(BinaryError::TrailingBytes { count }),
        }
    }
}
