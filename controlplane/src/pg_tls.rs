//! Postgres over TLS (rustls): `sslmode=verify-full` with `sslrootcert=<CA file>`, as
//! libpq spells it. The server's certificate must chain to that CA and name the host
//! the URL connects to. Modes that encrypt without verifying (`require`, `verify-ca`)
//! are refused: a store reached that way can be impersonated, and the store holds
//! every tenant's (sealed) keys and every assignment.

use std::future::Future;
use std::io;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect, TlsStream};

/// How a store URL asks to be reached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PgTls {
    /// No TLS (`sslmode` absent, `disable` or `prefer`).
    Off,
    /// `sslmode=verify-full`: TLS, the certificate verified against this CA.
    VerifyFull {
        /// `sslrootcert`.
        ca: PathBuf,
    },
}

/// Splits the TLS settings out of a store URL (`postgres://...?sslmode=..&sslrootcert=..`
/// or `host=.. sslmode=..`), returning the URL tokio-postgres should parse.
pub fn split(url: &str) -> Result<(String, PgTls), String> {
    let (mut mode, mut ca) = (None::<String>, None::<String>);
    let rest = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        match url.split_once('?') {
            None => url.to_owned(),
            Some((base, query)) => {
                let mut kept = Vec::new();
                for pair in query.split('&').filter(|p| !p.is_empty()) {
                    match pair.split_once('=') {
                        Some(("sslmode", v)) => mode = Some(v.to_owned()),
                        Some(("sslrootcert", v)) => ca = Some(v.to_owned()),
                        _ => kept.push(pair),
                    }
                }
                if kept.is_empty() {
                    base.to_owned()
                } else {
                    format!("{base}?{}", kept.join("&"))
                }
            }
        }
    } else {
        let mut kept = Vec::new();
        for word in url.split_whitespace() {
            match word.split_once('=') {
                Some(("sslmode", v)) => mode = Some(v.to_owned()),
                Some(("sslrootcert", v)) => ca = Some(v.to_owned()),
                _ => kept.push(word),
            }
        }
        kept.join(" ")
    };
    let tls = match mode.as_deref() {
        None | Some("disable" | "prefer") => PgTls::Off,
        Some("verify-full") => PgTls::VerifyFull {
            ca: ca
                .ok_or("sslmode=verify-full needs sslrootcert (the CA file)")?
                .into(),
        },
        Some(m @ ("require" | "verify-ca" | "allow")) => {
            return Err(format!(
                "sslmode={m} does not verify who the server is; use sslmode=verify-full with \
                 sslrootcert"
            ));
        }
        Some(m) => return Err(format!("unknown sslmode {m:?}")),
    };
    Ok((rest, tls))
}

/// A tokio-postgres TLS connector over rustls.
#[derive(Clone)]
pub struct MakeRustls(Arc<rustls::ClientConfig>);

impl std::fmt::Debug for MakeRustls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MakeRustls")
    }
}

impl MakeRustls {
    /// Trusts the CA certificates in `ca` (PEM).
    pub fn from_ca_file(ca: &std::path::Path) -> anyhow::Result<MakeRustls> {
        use rustls::pki_types::CertificateDer;
        use rustls::pki_types::pem::PemObject as _;
        let pem =
            std::fs::read(ca).map_err(|e| anyhow::anyhow!("sslrootcert {}: {e}", ca.display()))?;
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(&pem) {
            roots.add(cert.map_err(|e| anyhow::anyhow!("sslrootcert {}: {e}", ca.display()))?)?;
        }
        if roots.is_empty() {
            anyhow::bail!("sslrootcert {} holds no certificate", ca.display());
        }
        let config = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
        Ok(MakeRustls(Arc::new(config)))
    }
}

impl<S> MakeTlsConnect<S> for MakeRustls
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = RustlsStream<S>;
    type TlsConnect = RustlsConnect;
    type Error = io::Error;

    fn make_tls_connect(&mut self, domain: &str) -> Result<RustlsConnect, io::Error> {
        let name = ServerName::try_from(domain.to_owned())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        Ok(RustlsConnect {
            config: self.0.clone(),
            name,
        })
    }
}

/// One connection's connector.
#[derive(Debug)]
pub struct RustlsConnect {
    config: Arc<rustls::ClientConfig>,
    name: ServerName<'static>,
}

impl<S> TlsConnect<S> for RustlsConnect
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = RustlsStream<S>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<RustlsStream<S>>> + Send>>;

    fn connect(self, stream: S) -> Self::Future {
        Box::pin(async move {
            let tls = tokio_rustls::TlsConnector::from(self.config)
                .connect(self.name, stream)
                .await?;
            Ok(RustlsStream(tls))
        })
    }
}

/// A TLS stream to Postgres.
pub struct RustlsStream<S>(tokio_rustls::client::TlsStream<S>);

impl<S> std::fmt::Debug for RustlsStream<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RustlsStream")
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for RustlsStream<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for RustlsStream<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> TlsStream for RustlsStream<S> {
    /// No channel binding: the certificate is verified against the configured CA, which
    /// is what binds the session to the server.
    fn channel_binding(&self) -> ChannelBinding {
        ChannelBinding::none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_settings_are_split_out_of_both_url_forms() {
        assert_eq!(
            split("postgres://u@h/db").unwrap(),
            ("postgres://u@h/db".into(), PgTls::Off)
        );
        assert_eq!(
            split("postgres://u@h/db?sslmode=verify-full&sslrootcert=/ca.pem&connect_timeout=5")
                .unwrap(),
            (
                "postgres://u@h/db?connect_timeout=5".into(),
                PgTls::VerifyFull {
                    ca: "/ca.pem".into()
                }
            )
        );
        assert_eq!(
            split("host=h user=u sslmode=verify-full sslrootcert=/ca.pem").unwrap(),
            (
                "host=h user=u".into(),
                PgTls::VerifyFull {
                    ca: "/ca.pem".into()
                }
            )
        );
        assert!(
            split("postgres://h/db?sslmode=verify-full")
                .unwrap_err()
                .contains("sslrootcert")
        );
        assert!(
            split("postgres://h/db?sslmode=require")
                .unwrap_err()
                .contains("verify-full")
        );
        assert!(split("postgres://h/db?sslmode=bogus").is_err());
    }
}
