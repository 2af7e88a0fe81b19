//! Accepting clients that offer ALPN `felix/1` and clients that offer no ALPN at all.
//!
//! QUIC's TLS is strict about ALPN: a rustls server configured with protocols refuses a
//! client that offers none, and one configured with none refuses a client that offers
//! some. The standard SDK offers none by default and `felix/1` when asked, and a broker
//! must take both. This wrapper starts both sessions, buffers the ClientHello until it is
//! whole, looks for the ALPN extension, keeps the matching session and feeds it the
//! bytes. Initial keys depend only on the version and connection id, so either session
//! answers them.

use std::any::Any;
use std::sync::Arc;

use quinn_proto::crypto::{
    self, ExportKeyingMaterialError, HeaderKey, KeyPair, Keys, PacketKey, UnsupportedVersion,
};
use quinn_proto::transport_parameters::TransportParameters;
use quinn_proto::{ConnectionId, Side, TransportError};

/// Two server configs, with and without ALPN; each connection gets the one that fits.
pub(crate) struct EitherAlpn {
    pub with_alpn: Arc<dyn crypto::ServerConfig>,
    pub without_alpn: Arc<dyn crypto::ServerConfig>,
}

impl crypto::ServerConfig for EitherAlpn {
    fn initial_keys(
        &self,
        version: u32,
        dst_cid: &ConnectionId,
    ) -> Result<Keys, UnsupportedVersion> {
        self.with_alpn.initial_keys(version, dst_cid)
    }

    fn retry_tag(&self, version: u32, orig_dst_cid: &ConnectionId, packet: &[u8]) -> [u8; 16] {
        self.with_alpn.retry_tag(version, orig_dst_cid, packet)
    }

    fn start_session(
        self: Arc<Self>,
        version: u32,
        params: &TransportParameters,
    ) -> Box<dyn crypto::Session> {
        Box::new(Deferred {
            candidates: Some((
                self.with_alpn.clone().start_session(version, params),
                self.without_alpn.clone().start_session(version, params),
            )),
            chosen: None,
            hello: Vec::new(),
        })
    }
}

struct Deferred {
    candidates: Option<(Box<dyn crypto::Session>, Box<dyn crypto::Session>)>,
    chosen: Option<Box<dyn crypto::Session>>,
    hello: Vec<u8>,
}

/// Whether a complete ClientHello carries the ALPN extension; `None` while incomplete.
fn offers_alpn(hello: &[u8]) -> Option<bool> {
    let len = usize::from(*hello.get(1)?) << 16
        | usize::from(*hello.get(2)?) << 8
        | usize::from(*hello.get(3)?);
    let body = hello.get(4..4 + len)?;
    // A malformed hello: let rustls judge it (with ALPN, the stricter config).
    Some(scan_extensions(body).unwrap_or(true))
}

fn scan_extensions(body: &[u8]) -> Option<bool> {
    let mut p = 2 + 32; // legacy_version, random
    let sid = usize::from(*body.get(p)?);
    p += 1 + sid;
    let suites = usize::from(u16::from_be_bytes([*body.get(p)?, *body.get(p + 1)?]));
    p += 2 + suites;
    let comp = usize::from(*body.get(p)?);
    p += 1 + comp;
    let ext_len = usize::from(u16::from_be_bytes([*body.get(p)?, *body.get(p + 1)?]));
    p += 2;
    let end = p + ext_len;
    while p + 4 <= end.min(body.len()) {
        let ty = u16::from_be_bytes([body[p], body[p + 1]]);
        let len = usize::from(u16::from_be_bytes([body[p + 2], body[p + 3]]));
        if ty == 0x0010 {
            return Some(true);
        }
        p += 4 + len;
    }
    Some(false)
}

impl Deferred {
    fn any(&self) -> &dyn crypto::Session {
        match (&self.chosen, &self.candidates) {
            (Some(s), _) => s.as_ref(),
            (None, Some((a, _))) => a.as_ref(),
            (None, None) => unreachable!("a deferred session always holds a session"),
        }
    }
}

impl crypto::Session for Deferred {
    fn initial_keys(&self, dst_cid: &ConnectionId, side: Side) -> Keys {
        self.any().initial_keys(dst_cid, side)
    }

    fn handshake_data(&self) -> Option<Box<dyn Any>> {
        self.chosen.as_ref()?.handshake_data()
    }

    fn peer_identity(&self) -> Option<Box<dyn Any>> {
        self.chosen.as_ref()?.peer_identity()
    }

    fn early_crypto(&self) -> Option<(Box<dyn HeaderKey>, Box<dyn PacketKey>)> {
        self.chosen.as_ref()?.early_crypto()
    }

    fn early_data_accepted(&self) -> Option<bool> {
        self.chosen.as_ref()?.early_data_accepted()
    }

    fn is_handshaking(&self) -> bool {
        self.chosen.as_ref().is_none_or(|s| s.is_handshaking())
    }

    fn read_handshake(&mut self, buf: &[u8]) -> Result<bool, TransportError> {
        if let Some(s) = &mut self.chosen {
            return s.read_handshake(buf);
        }
        self.hello.extend_from_slice(buf);
        let Some(alpn) = offers_alpn(&self.hello) else {
            if self.hello.len() > 64 * 1024 {
                return Err(TransportError {
                    code: quinn_proto::TransportErrorCode::PROTOCOL_VIOLATION,
                    frame: None,
                    reason: "client hello too large".into(),
                });
            }
            return Ok(false);
        };
        let (with, without) = self
            .candidates
            .take()
            .expect("candidates exist until chosen");
        let mut chosen = if alpn { with } else { without };
        let hello = std::mem::take(&mut self.hello);
        let result = chosen.read_handshake(&hello);
        self.chosen = Some(chosen);
        result
    }

    fn transport_parameters(&self) -> Result<Option<TransportParameters>, TransportError> {
        match &self.chosen {
            Some(s) => s.transport_parameters(),
            None => Ok(None),
        }
    }

    fn write_handshake(&mut self, buf: &mut Vec<u8>) -> Option<Keys> {
        self.chosen.as_mut()?.write_handshake(buf)
    }

    fn next_1rtt_keys(&mut self) -> Option<KeyPair<Box<dyn PacketKey>>> {
        self.chosen.as_mut()?.next_1rtt_keys()
    }

    fn is_valid_retry(&self, orig_dst_cid: &ConnectionId, header: &[u8], payload: &[u8]) -> bool {
        self.any().is_valid_retry(orig_dst_cid, header, payload)
    }

    fn export_keying_material(
        &self,
        output: &mut [u8],
        label: &[u8],
        context: &[u8],
    ) -> Result<(), ExportKeyingMaterialError> {
        match &self.chosen {
            Some(s) => s.export_keying_material(output, label, context),
            None => Err(ExportKeyingMaterialError),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello(extensions: &[(u16, &[u8])]) -> Vec<u8> {
        let mut body = vec![3, 3];
        body.extend([0u8; 32]);
        body.push(0); // session id
        body.extend([0, 2, 0x13, 0x01]); // one suite
        body.extend([1, 0]); // compression
        let mut ext = Vec::new();
        for (ty, data) in extensions {
            ext.extend(ty.to_be_bytes());
            ext.extend((data.len() as u16).to_be_bytes());
            ext.extend(*data);
        }
        body.extend((ext.len() as u16).to_be_bytes());
        body.extend(ext);
        let mut h = vec![1];
        h.extend(&(body.len() as u32).to_be_bytes()[1..]);
        h.extend(body);
        h
    }

    #[test]
    fn the_alpn_extension_is_found_only_in_a_whole_hello() {
        let with = hello(&[(0x000a, &[0, 2, 0, 29]), (0x0010, b"\x00\x08\x07felix/1")]);
        let without = hello(&[(0x000a, &[0, 2, 0, 29])]);
        assert_eq!(offers_alpn(&with), Some(true));
        assert_eq!(offers_alpn(&without), Some(false));
        assert_eq!(offers_alpn(&with[..with.len() - 1]), None, "incomplete");
        assert_eq!(offers_alpn(&[1, 0]), None);
    }
}
