//! A small blocking HTTP/1.1 client for the control-plane API: what brokers use to
//! register, heartbeat and follow the feed from their sync thread, and what the `felix`
//! tool uses for `stream create`. One request per connection, JSON in and out, with
//! connect and request deadlines, so a stuck control plane never wedges a caller.
//!
//! `https://` URLs are spoken over TLS 1.2/1.3 (rustls), the server's certificate
//! verified against a CA the caller configures ([`ClientTls`]). Plain `http://` is
//! accepted for a loopback host (the embedded dev control plane); for any other host
//! only through [`ControlPlaneClient::new_insecure`], because everything brokers learn
//! from the control plane (verification keys, assignments) would travel unprotected.

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, ServerName};

use serde_json::Value;

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The URL is not `http(s)://host:port[/prefix]`.
    #[error("control-plane URL {0:?}: expected https://host:port or http://host:port")]
    BadUrl(String),
    /// TLS settings that cannot be used (an unreadable CA, an https URL without one,
    /// plain HTTP to a host that is not loopback).
    #[error("control-plane TLS: {0}")]
    Tls(String),
    /// Could not reach or talk to the service.
    #[error("control plane at {addr}: {message}")]
    Unreachable {
        /// Where.
        addr: String,
        /// What happened.
        message: String,
    },
    /// The service answered with an error.
    #[error("{status} {code}: {message}{}", field.as_deref().map(|f| format!(" (field `{f}`)")).unwrap_or_default())]
    Api {
        /// HTTP status.
        status: u16,
        /// The JSON error `code`.
        code: String,
        /// The JSON error `message`.
        message: String,
        /// The JSON error `field`, for validation errors.
        field: Option<String>,
    },
}

impl ClientError {
    /// The HTTP status of an API error.
    pub fn status(&self) -> Option<u16> {
        match self {
            ClientError::Api { status, .. } => Some(*status),
            _ => None,
        }
    }
}

/// The trust a client puts in the control plane's certificate: a CA bundle.
#[derive(Clone)]
pub struct ClientTls(Arc<rustls::ClientConfig>);

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClientTls")
    }
}

impl ClientTls {
    /// Trusts the certificates in `pem` (one or more CERTIFICATE blocks) as roots.
    pub fn from_ca_pem(pem: &[u8]) -> Result<ClientTls, ClientError> {
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(pem) {
            let cert = cert.map_err(|e| ClientError::Tls(format!("CA bundle: {e}")))?;
            roots
                .add(cert)
                .map_err(|e| ClientError::Tls(format!("CA certificate: {e}")))?;
        }
        if roots.is_empty() {
            return Err(ClientError::Tls("CA bundle holds no certificate".into()));
        }
        let config = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| ClientError::Tls(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth();
        Ok(ClientTls(Arc::new(config)))
    }

    /// Reads a CA bundle file.
    pub fn from_ca_file(path: &std::path::Path) -> Result<ClientTls, ClientError> {
        let pem = std::fs::read(path)
            .map_err(|e| ClientError::Tls(format!("CA file {}: {e}", path.display())))?;
        Self::from_ca_pem(&pem)
    }
}

/// Largest answer read (a JWKS or snapshot past this is refused, not buffered): room
/// for what [`crate::limits`] lets the cluster hold, at its longest names.
pub const MAX_ANSWER_BYTES: u64 = 64 << 20;

/// A control-plane endpoint plus a bearer token.
#[derive(Debug, Clone)]
pub struct ControlPlaneClient {
    host: String,
    prefix: String,
    token: Option<String>,
    tls: Option<(ClientTls, ServerName<'static>)>,
    /// Deadline to connect.
    pub connect_timeout: Duration,
    /// Deadline for the whole request (long polls add their wait).
    pub request_timeout: Duration,
}

/// Whether `host` (`name:port` or `ip:port`) is a loopback address.
fn loopback(host: &str) -> bool {
    let name = host.rsplit_once(':').map_or(host, |(h, _)| h);
    let name = name.trim_start_matches('[').trim_end_matches(']');
    name == "localhost" || name.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

impl ControlPlaneClient {
    /// A client for `http://host:port` on a loopback host (anything else needs TLS:
    /// [`ControlPlaneClient::with_tls`]).
    pub fn new(url: &str, token: Option<String>) -> Result<Self, ClientError> {
        Self::build(url, token, None, false)
    }

    /// A client for `url`: `https://` verified against `tls`, or `http://` to a
    /// loopback host.
    pub fn with_tls(
        url: &str,
        token: Option<String>,
        tls: Option<ClientTls>,
    ) -> Result<Self, ClientError> {
        Self::build(url, token, tls, false)
    }

    /// As [`ControlPlaneClient::with_tls`], but also plain `http://` to any host. Keys
    /// and assignments then travel unprotected; callers log a warning.
    pub fn new_insecure(
        url: &str,
        token: Option<String>,
        tls: Option<ClientTls>,
    ) -> Result<Self, ClientError> {
        Self::build(url, token, tls, true)
    }

    fn build(
        url: &str,
        token: Option<String>,
        tls: Option<ClientTls>,
        insecure: bool,
    ) -> Result<Self, ClientError> {
        let (secure, rest) = match (url.strip_prefix("https://"), url.strip_prefix("http://")) {
            (Some(rest), _) => (true, rest),
            (None, Some(rest)) => (false, rest),
            (None, None) => return Err(ClientError::BadUrl(url.to_owned())),
        };
        let (host, prefix) = match rest.find('/') {
            Some(i) => (&rest[..i], rest[i..].trim_end_matches('/')),
            None => (rest, ""),
        };
        if host.is_empty() || !host.contains(':') {
            return Err(ClientError::BadUrl(url.to_owned()));
        }
        let tls = match (secure, tls) {
            (true, Some(tls)) => {
                let name = host.rsplit_once(':').map_or(host, |(h, _)| h);
                let name = name.trim_start_matches('[').trim_end_matches(']');
                let server = ServerName::try_from(name.to_owned())
                    .map_err(|e| ClientError::BadUrl(format!("{url}: {e}")))?;
                Some((tls, server))
            }
            (true, None) => {
                return Err(ClientError::Tls(format!(
                    "{url}: an https control plane needs a CA to verify it (control_plane_ca)"
                )));
            }
            (false, _) if insecure || loopback(host) => None,
            (false, _) => {
                return Err(ClientError::Tls(format!(
                    "{url}: plain HTTP to a host that is not loopback would let anyone on \
                     the path read or rewrite keys and assignments; use https (or the \
                     explicit insecure setting)"
                )));
            }
        };
        Ok(ControlPlaneClient {
            host: host.to_owned(),
            prefix: prefix.to_owned(),
            token,
            tls,
            connect_timeout: Duration::from_secs(2),
            request_timeout: Duration::from_secs(5),
        })
    }

    /// Replaces the bearer token.
    pub fn with_token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        self
    }

    /// `GET path`.
    pub fn get(&self, path: &str) -> Result<Value, ClientError> {
        self.call("GET", path, None, &[], Duration::ZERO)
    }

    /// `GET path`, allowing `extra` beyond the request deadline (long polls).
    pub fn get_long(&self, path: &str, extra: Duration) -> Result<Value, ClientError> {
        self.call("GET", path, None, &[], extra)
    }

    /// `POST path` with a JSON body.
    pub fn post(&self, path: &str, body: &Value) -> Result<Value, ClientError> {
        self.call("POST", path, Some(body), &[], Duration::ZERO)
    }

    /// `POST path` with extra headers.
    pub fn post_with(
        &self,
        path: &str,
        body: &Value,
        headers: &[(&str, &str)],
    ) -> Result<Value, ClientError> {
        self.call("POST", path, Some(body), headers, Duration::ZERO)
    }

    /// `PATCH path` with a JSON body.
    pub fn patch(&self, path: &str, body: &Value) -> Result<Value, ClientError> {
        self.call("PATCH", path, Some(body), &[], Duration::ZERO)
    }

    /// `DELETE path`.
    pub fn delete(&self, path: &str) -> Result<Value, ClientError> {
        self.call("DELETE", path, None, &[], Duration::ZERO)
    }

    fn unreachable(&self, message: impl std::fmt::Display) -> ClientError {
        ClientError::Unreachable {
            addr: self.host.clone(),
            message: message.to_string(),
        }
    }

    fn resolve(&self) -> Result<Vec<SocketAddr>, ClientError> {
        self.host
            .to_socket_addrs()
            .map(Iterator::collect)
            .map_err(|e| self.unreachable(format!("resolving: {e}")))
    }

    fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
        headers: &[(&str, &str)],
        extra: Duration,
    ) -> Result<Value, ClientError> {
        let addrs = self.resolve()?;
        let mut last = None;
        let mut stream = None;
        for a in addrs {
            match TcpStream::connect_timeout(&a, self.connect_timeout) {
                Ok(s) => {
                    stream = Some(s);
                    break;
                }
                Err(e) => last = Some(e),
            }
        }
        let s = stream.ok_or_else(|| {
            self.unreachable(last.map_or_else(|| "no address".to_owned(), |e| e.to_string()))
        })?;
        let deadline = self.request_timeout + extra;
        s.set_read_timeout(Some(deadline))
            .map_err(|e| self.unreachable(e))?;
        s.set_write_timeout(Some(self.request_timeout))
            .map_err(|e| self.unreachable(e))?;
        match &self.tls {
            None => self.exchange(s, method, path, body, headers),
            Some((tls, name)) => {
                let conn = rustls::ClientConnection::new(tls.0.clone(), name.clone())
                    .map_err(|e| ClientError::Tls(e.to_string()))?;
                let mut tls_stream = rustls::StreamOwned::new(conn, s);
                // Finish the handshake first, so a certificate that does not verify
                // is reported as such rather than as a failed write.
                while tls_stream.conn.is_handshaking() {
                    tls_stream
                        .conn
                        .complete_io(&mut tls_stream.sock)
                        .map_err(|e| self.tls_failure(e))?;
                }
                self.exchange(tls_stream, method, path, body, headers)
            }
        }
    }

    fn tls_failure(&self, e: std::io::Error) -> ClientError {
        match e.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>()) {
            Some(tls) => ClientError::Tls(format!("{}: {tls}", self.host)),
            None => self.unreachable(format!("TLS handshake: {e}")),
        }
    }

    fn exchange(
        &self,
        mut s: impl Read + Write,
        method: &str,
        path: &str,
        body: Option<&Value>,
        headers: &[(&str, &str)],
    ) -> Result<Value, ClientError> {
        let payload = body.map(|b| serde_json::to_vec(b).expect("JSON values serialize"));
        let mut req = format!(
            "{method} {}{path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nAccept: application/json\r\n",
            self.prefix, self.host
        );
        if let Some(t) = &self.token {
            req.push_str(&format!("Authorization: Bearer {t}\r\n"));
        }
        for (k, v) in headers {
            req.push_str(&format!("{k}: {v}\r\n"));
        }
        match &payload {
            Some(p) => req.push_str(&format!(
                "Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
                p.len()
            )),
            None => req.push_str("Content-Length: 0\r\n\r\n"),
        }
        s.write_all(req.as_bytes())
            .map_err(|e| self.unreachable(e))?;
        if let Some(p) = &payload {
            s.write_all(p).map_err(|e| self.unreachable(e))?;
        }
        let mut raw = Vec::new();
        let read = s.take(MAX_ANSWER_BYTES + 1).read_to_end(&mut raw);
        // A TLS peer that closes without close_notify: the body's length decides.
        if let Err(e) = read
            && e.kind() != std::io::ErrorKind::UnexpectedEof
        {
            return Err(self.unreachable(format!("reading the answer: {e}")));
        }
        if raw.len() as u64 > MAX_ANSWER_BYTES {
            return Err(self.unreachable(format!("answer over {MAX_ANSWER_BYTES} bytes refused")));
        }
        let (status, body) = parse_response(&raw).map_err(|m| self.unreachable(m))?;
        let value: Value = if body.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&body)
                .map_err(|e| self.unreachable(format!("answer is not JSON: {e}")))?
        };
        if (200..300).contains(&status) {
            return Ok(value);
        }
        let text = |k: &str| value.get(k).and_then(Value::as_str).map(str::to_owned);
        Err(ClientError::Api {
            status,
            code: text("code").unwrap_or_else(|| "http_error".into()),
            message: text("message").unwrap_or_else(|| String::from_utf8_lossy(&body).into_owned()),
            field: text("field"),
        })
    }
}

/// Splits an HTTP/1.1 response into status and (de-chunked) body.
fn parse_response(raw: &[u8]) -> Result<(u16, Vec<u8>), String> {
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or("truncated response head")?;
    let head = std::str::from_utf8(&raw[..end]).map_err(|_| "response head is not UTF-8")?;
    let mut lines = head.split("\r\n");
    let status: u16 = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|c| c.parse().ok())
        .ok_or("malformed status line")?;
    let mut chunked = false;
    let mut length = None;
    for l in lines {
        let Some((k, v)) = l.split_once(':') else {
            continue;
        };
        let (k, v) = (k.trim().to_ascii_lowercase(), v.trim());
        if k == "transfer-encoding" && v.eq_ignore_ascii_case("chunked") {
            chunked = true;
        } else if k == "content-length" {
            length = v.parse::<usize>().ok();
        }
    }
    let rest = &raw[end + 4..];
    if !chunked {
        let n = length.unwrap_or(rest.len());
        if rest.len() < n {
            return Err(format!("body cut short: {} of {n} bytes", rest.len()));
        }
        return Ok((status, rest[..n].to_vec()));
    }
    let mut body = Vec::new();
    let mut at = rest;
    loop {
        let line_end = at
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or("truncated chunk")?;
        let size_text = std::str::from_utf8(&at[..line_end]).map_err(|_| "bad chunk size")?;
        let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
            .map_err(|_| "bad chunk size")?;
        at = &at[line_end + 2..];
        if size == 0 {
            return Ok((status, body));
        }
        if at.len() < size + 2 {
            return Err("truncated chunk".into());
        }
        body.extend_from_slice(&at[..size]);
        at = &at[size + 2..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_plain_and_chunked_bodies() {
        let plain = b"HTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\n{}";
        assert_eq!(parse_response(plain).unwrap(), (201, b"{}".to_vec()));
        let chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\n{\"a\r\n4\r\n\":1}\r\n0\r\n\r\n";
        assert_eq!(
            parse_response(chunked).unwrap(),
            (200, b"{\"a\":1}".to_vec())
        );
        assert!(parse_response(b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\n{}").is_err());
        assert!(parse_response(b"garbage").is_err());
    }

    #[test]
    fn urls_need_a_host_and_port() {
        assert!(ControlPlaneClient::new("http://127.0.0.1:7070", None).is_ok());
        assert!(ControlPlaneClient::new("http://127.0.0.1:7070/api/", None).is_ok());
        assert!(matches!(
            ControlPlaneClient::new("https://x:1", None),
            Err(ClientError::Tls(_))
        ));
        assert!(ControlPlaneClient::new("http://nohost", None).is_err());
        assert!(ControlPlaneClient::new("http://localhost:7070", None).is_ok());
        assert!(ControlPlaneClient::new("http://[::1]:7070", None).is_ok());
        // Plain HTTP off loopback only when asked for explicitly.
        assert!(matches!(
            ControlPlaneClient::new("http://10.0.0.5:7070", None),
            Err(ClientError::Tls(_))
        ));
        assert!(ControlPlaneClient::new_insecure("http://10.0.0.5:7070", None, None).is_ok());
    }
}
