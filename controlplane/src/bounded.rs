//! Serving an axum router with bounds on what clients can hold: at most
//! [`Limits::connections`] connections at once (past it the listener waits, and new
//! connections wait in the kernel's backlog), and a request's head read within
//! [`Limits::header_timeout`] of the connection asking for it, idle keep-alive
//! connections included. `axum::serve` has neither: its header-read timeout takes
//! effect only with a timer it does not set, so a client that sent half a request line,
//! or connections opened and left idle, were held for good, one task and one
//! descriptor each (the process's descriptors are the ones its shards' logs need).
//!
//! A body read is bounded by each service's own deadline (`api::BODY_TIMEOUT`, the
//! broker admin endpoint's answer deadline).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinSet;

/// What one endpoint lets its clients hold.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Connections served at once.
    pub connections: usize,
    /// Longest a connection may take to send a request's head, counted from when the
    /// server is ready for it (so from the end of the last answer on a kept-alive one).
    pub header_timeout: Duration,
}

/// The control plane's API: brokers hold about three connections each (a long poll of
/// the feed, a heartbeat, a report; one request per connection).
pub const API: Limits = Limits {
    connections: 1024,
    header_timeout: Duration::from_secs(10),
};

/// A broker's admin endpoint (probes, metrics, pins).
pub const ADMIN: Limits = Limits {
    connections: 128,
    header_timeout: Duration::from_secs(10),
};

/// Serves `app` on `listener` within `limits` until `shutdown` completes, then lets
/// each connection finish the request it is on and returns once all have closed.
/// Dropped (its task aborted), it closes every connection at once.
pub async fn serve<L>(
    mut listener: L,
    app: Router,
    limits: Limits,
    shutdown: impl Future<Output = ()>,
) where
    L: axum::serve::Listener,
{
    let slots = Arc::new(Semaphore::new(limits.connections));
    let (stop, stopping) = watch::channel(false);
    let mut shutdown = std::pin::pin!(shutdown);
    let mut connections = JoinSet::new();
    loop {
        while connections.try_join_next().is_some() {}
        let slot = tokio::select! {
            s = slots.clone().acquire_owned() => s.expect("the semaphore is never closed"),
            () = &mut shutdown => break,
        };
        let io = tokio::select! {
            (io, _) = listener.accept() => io,
            () = &mut shutdown => break,
        };
        let service = TowerToHyperService::new(app.clone());
        let mut stopping = stopping.clone();
        connections.spawn(async move {
            let _slot = slot;
            let mut http = hyper::server::conn::http1::Builder::new();
            http.timer(TokioTimer::new())
                .header_read_timeout(limits.header_timeout);
            let conn = http.serve_connection(TokioIo::new(io), service);
            let mut conn = std::pin::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => return,
                _ = stopping.wait_for(|s| *s) => conn.as_mut().graceful_shutdown(),
            }
            let _ = conn.await;
        });
    }
    drop(listener);
    let _ = stop.send(true);
    while connections.join_next().await.is_some() {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    const SMALL: Limits = Limits {
        connections: 2,
        header_timeout: Duration::from_millis(1500),
    };

    async fn start() -> std::net::SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = Router::new().route("/", axum::routing::get(|| async { "ok" }));
        tokio::spawn(serve(listener, app, SMALL, std::future::pending()));
        addr
    }

    /// Reads until the server closes; `None` if it has not within `within`.
    async fn closed_within(s: &mut TcpStream, within: Duration) -> Option<Vec<u8>> {
        let mut got = Vec::new();
        tokio::time::timeout(within, s.read_to_end(&mut got))
            .await
            .ok()
            .map(|_| got)
    }

    async fn get(addr: std::net::SocketAddr) -> TcpStream {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        s
    }

    #[tokio::test]
    async fn a_connection_that_never_finishes_its_request_head_is_closed() {
        let addr = start().await;
        let mut half = TcpStream::connect(addr).await.unwrap();
        half.write_all(b"GET / HTTP/1.1\r\nHost:").await.unwrap();
        let mut idle = TcpStream::connect(addr).await.unwrap();
        assert!(
            closed_within(&mut half, Duration::from_secs(6))
                .await
                .is_some(),
            "a half-sent request head held its connection"
        );
        assert!(
            closed_within(&mut idle, Duration::from_secs(6))
                .await
                .is_some(),
            "a connection that sent nothing was held"
        );
    }

    #[tokio::test]
    async fn connections_past_the_limit_wait_until_one_closes() {
        let addr = start().await;
        let stalled = [
            TcpStream::connect(addr).await.unwrap(),
            TcpStream::connect(addr).await.unwrap(),
        ];
        tokio::time::sleep(Duration::from_millis(50)).await;
        let mut third = get(addr).await;
        // Not served while both slots are held (well inside their header timeout)...
        assert!(
            closed_within(&mut third, Duration::from_millis(300))
                .await
                .is_none(),
            "a connection past the limit was served"
        );
        // ...and served once the stalled ones are closed by their timeout.
        let answer = closed_within(&mut third, Duration::from_secs(6))
            .await
            .expect("the waiting connection was never served");
        assert!(
            String::from_utf8_lossy(&answer).starts_with("HTTP/1.1 200"),
            "{}",
            String::from_utf8_lossy(&answer)
        );
        drop(stalled);
    }
}
