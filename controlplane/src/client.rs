//! A small blocking HTTP/1.1 client for the control-plane API: what brokers use to
//! register, heartbeat and follow the feed from their sync thread, and what the `felix`
//! tool uses for `stream create`. One request per connection, JSON in and out, with
//! connect and request deadlines, so a stuck control plane never wedges a caller.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::Duration;

use serde_json::Value;

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The URL is not `http://host:port[/prefix]`.
    #[error("control-plane URL {0:?}: expected http://host:port")]
    BadUrl(String),
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

/// A control-plane endpoint plus a bearer token.
#[derive(Debug, Clone)]
pub struct ControlPlaneClient {
    host: String,
    prefix: String,
    token: Option<String>,
    /// Deadline to connect.
    pub connect_timeout: Duration,
    /// Deadline for the whole request (long polls add their wait).
    pub request_timeout: Duration,
}

impl ControlPlaneClient {
    /// A client for `url` (`http://host:port`).
    pub fn new(url: &str, token: Option<String>) -> Result<Self, ClientError> {
        let rest = url
            .strip_prefix("http://")
            .ok_or_else(|| ClientError::BadUrl(url.to_owned()))?;
        let (host, prefix) = match rest.find('/') {
            Some(i) => (&rest[..i], rest[i..].trim_end_matches('/')),
            None => (rest, ""),
        };
        if host.is_empty() || !host.contains(':') {
            return Err(ClientError::BadUrl(url.to_owned()));
        }
        Ok(ControlPlaneClient {
            host: host.to_owned(),
            prefix: prefix.to_owned(),
            token,
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
        let mut s = stream.ok_or_else(|| {
            self.unreachable(last.map_or_else(|| "no address".to_owned(), |e| e.to_string()))
        })?;
        let deadline = self.request_timeout + extra;
        s.set_read_timeout(Some(deadline))
            .map_err(|e| self.unreachable(e))?;
        s.set_write_timeout(Some(self.request_timeout))
            .map_err(|e| self.unreachable(e))?;
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
        s.read_to_end(&mut raw)
            .map_err(|e| self.unreachable(format!("reading the answer: {e}")))?;
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
        assert!(ControlPlaneClient::new("https://x:1", None).is_err());
        assert!(ControlPlaneClient::new("http://nohost", None).is_err());
    }
}
