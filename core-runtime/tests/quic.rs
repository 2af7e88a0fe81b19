//! A stock quinn (tokio) client against our glommio + quinn-proto driver.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

use felix_core_runtime::quic::{
    self, Connection, Endpoint, EndpointOptions, EndpointStats, TransportLimits,
};

struct Server {
    addr: SocketAddr,
    ca: rustls::pki_types::CertificateDer<'static>,
    stats: Arc<Mutex<EndpointStats>>,
    stop: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(1, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Echo on bi streams; a client uni stream is answered on a server-opened uni stream.
async fn serve(conn: Connection) {
    loop {
        let bi = conn.accept_bi();
        let uni = conn.accept_uni();
        futures_lite::pin!(bi);
        futures_lite::pin!(uni);
        let which = futures_lite::future::or(
            async { Ok::<_, ()>(Some(bi.await.map_err(|_| ())?)) },
            async {
                let mut r = uni.await.map_err(|_| ())?;
                let conn = conn.clone();
                glommio::spawn_local(async move {
                    let mut got = Vec::new();
                    while let Ok(Some(c)) = r.read_chunk(64 * 1024).await {
                        got.extend_from_slice(&c);
                    }
                    if let Ok(mut s) = conn.open_uni().await {
                        let _ = s.write_all(&got).await;
                        let _ = s.finish();
                    }
                })
                .detach();
                Ok(None)
            },
        )
        .await;
        match which {
            Ok(Some((mut send, mut recv))) => {
                glommio::spawn_local(async move {
                    while let Ok(Some(chunk)) = recv.read_chunk(64 * 1024).await {
                        if send.write_chunk(chunk).await.is_err() {
                            return;
                        }
                    }
                    let _ = send.finish();
                })
                .detach();
            }
            Ok(None) => {}
            Err(()) => return,
        }
    }
}

fn start_server(max_connections: usize) -> Server {
    start_server_with(max_connections, TransportLimits::default())
}

fn start_server_with(max_connections: usize, limits: TransportLimits) -> Server {
    let certs = quic::generate_certs(&["localhost"]).unwrap();
    let ca = certs.ca_der.clone();
    let (tx, rx) = mpsc::channel();
    let stats = Arc::new(Mutex::new(EndpointStats::default()));
    let stop = Arc::new(AtomicU64::new(0));
    let (stats2, stop2) = (stats.clone(), stop.clone());
    let thread = std::thread::spawn(move || {
        glommio::LocalExecutorBuilder::default()
            .make()
            .unwrap()
            .run(async move {
                let config =
                    quic::server_config(vec![certs.cert_der.clone()], certs.key(), limits).unwrap();
                let ep = Endpoint::bind(
                    "127.0.0.1:0".parse().unwrap(),
                    EndpointOptions {
                        server: Some(Arc::new(config)),
                        crowded_server: None,
                        max_connections,
                        reuse_port: false,
                        reset_secret: None,
                        on_sent: None,
                        windows: None,
                    },
                )
                .unwrap();
                tx.send(ep.local_addr()).unwrap();
                let ep2 = ep.clone();
                glommio::spawn_local(async move {
                    while let Some(conn) = ep2.accept().await {
                        glommio::spawn_local(serve(conn)).detach();
                    }
                })
                .detach();
                while stop2.load(Ordering::SeqCst) == 0 {
                    *stats2.lock().unwrap() = ep.stats();
                    glommio::timer::sleep(Duration::from_millis(20)).await;
                }
                ep.close(0, b"bye");
            });
    });
    Server {
        addr: rx.recv().unwrap(),
        ca,
        stats,
        stop,
        thread: Some(thread),
    }
}

fn client(server: &Server, alpn: bool) -> quinn::Endpoint {
    let mut ep = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    ep.set_default_client_config(
        quic::client_config(
            std::slice::from_ref(&server.ca),
            alpn,
            TransportLimits::default(),
        )
        .unwrap(),
    );
    ep
}

#[test]
fn a_quinn_client_exchanges_data_on_bi_and_uni_streams() {
    let server = start_server(100);
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        for alpn in [false, true] {
            let ep = client(&server, alpn);
            let conn = ep.connect(server.addr, "localhost").unwrap().await.unwrap();
            if alpn {
                let hd = conn.handshake_data().unwrap();
                let hd = hd
                    .downcast::<quinn::crypto::rustls::HandshakeData>()
                    .unwrap();
                assert_eq!(hd.protocol.as_deref(), Some(&b"felix/1"[..]));
            }
            // Bi: 1 MiB echoed back exactly.
            let (mut s, mut r) = conn.open_bi().await.unwrap();
            let data: Vec<u8> = (0..1 << 20).map(|i| (i * 7 % 251) as u8).collect();
            let writer = {
                let data = data.clone();
                tokio::spawn(async move {
                    s.write_all(&data).await.unwrap();
                    s.finish().unwrap();
                })
            };
            let back = r.read_to_end(4 << 20).await.unwrap();
            writer.await.unwrap();
            assert_eq!(back, data);
            // Many concurrent bi streams on one connection.
            let mut tasks = Vec::new();
            for i in 0..50u32 {
                let conn = conn.clone();
                tasks.push(tokio::spawn(async move {
                    let (mut s, mut r) = conn.open_bi().await.unwrap();
                    let msg = format!("stream {i}").into_bytes();
                    s.write_all(&msg).await.unwrap();
                    s.finish().unwrap();
                    assert_eq!(r.read_to_end(1024).await.unwrap(), msg);
                }));
            }
            for t in tasks {
                t.await.unwrap();
            }
            // Uni out, and the server answers on a uni stream it opens.
            let mut u = conn.open_uni().await.unwrap();
            u.write_all(b"uni hello").await.unwrap();
            u.finish().unwrap();
            let mut back = conn.accept_uni().await.unwrap();
            assert_eq!(back.read_to_end(1024).await.unwrap(), b"uni hello");
            conn.close(0u32.into(), b"done");
            ep.wait_idle().await;
        }
    });
}

/// A broker forwarding its clients' requests offers its own ALPN before `felix/1` and
/// gets it (and for requests forwarded to it, its second one), so the receiver knows
/// how far to forward them; a client offering `felix/1` gets that (the server lists the
/// forwarding ones first).
#[test]
fn a_forwarding_broker_is_told_apart_by_its_alpn() {
    let server = start_server(100);
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        let forwarding = |again| {
            quic::forwarding_client_config(
                std::slice::from_ref(&server.ca),
                TransportLimits::default(),
                again,
            )
            .unwrap()
        };
        for (config, want) in [
            (forwarding(false), felix_wire::internal::FORWARD_ALPN),
            (forwarding(true), felix_wire::internal::FORWARD_AGAIN_ALPN),
            (
                quic::client_config(
                    std::slice::from_ref(&server.ca),
                    true,
                    TransportLimits::default(),
                )
                .unwrap(),
                &b"felix/1"[..],
            ),
        ] {
            let mut ep = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
            ep.set_default_client_config(config);
            let conn = ep.connect(server.addr, "localhost").unwrap().await.unwrap();
            let hd = conn.handshake_data().unwrap();
            let hd = hd
                .downcast::<quinn::crypto::rustls::HandshakeData>()
                .unwrap();
            assert_eq!(hd.protocol.as_deref(), Some(want));
            conn.close(0u32.into(), b"done");
            ep.wait_idle().await;
        }
    });
}

/// A client that stops reading each answer before the server finishes the answer's
/// stream (it read what it wanted, then finishes its own side) gets its stream credit
/// back: the server resets a stream the peer stopped instead of leaving it allocated.
/// With the server allowing 8 streams at once, 40 such exchanges in a row on one
/// connection; they used to stop at the ninth, waiting forever for a stream.
#[test]
fn streams_the_client_stopped_reading_are_freed_and_their_credit_comes_back() {
    let limits = TransportLimits {
        max_streams: 8,
        ..TransportLimits::default()
    };
    let server = start_server_with(10, limits);
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        let ep = client(&server, false);
        let conn = ep.connect(server.addr, "localhost").unwrap().await.unwrap();
        for i in 0..40 {
            let exchange = async {
                let (mut s, mut r) = conn.open_bi().await.unwrap();
                s.write_all(b"ping").await.unwrap();
                let mut pong = [0u8; 4];
                r.read_exact(&mut pong).await.unwrap();
                assert_eq!(&pong, b"ping");
                // Stop reading (STOP_SENDING), then end our side: the server's finish
                // meets a stopped stream.
                drop(r);
                tokio::time::sleep(Duration::from_millis(5)).await;
                s.finish().unwrap();
            };
            tokio::time::timeout(Duration::from_secs(5), exchange)
                .await
                .unwrap_or_else(|_| panic!("exchange {i} never got a stream"));
        }
        conn.close(0u32.into(), b"done");
        ep.wait_idle().await;
    });
}

#[test]
fn a_thousand_connections_open_and_close_and_leave_nothing_behind() {
    let server = start_server(2000);
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        let ep = client(&server, false);
        for wave in 0..20 {
            let mut tasks = Vec::new();
            for i in 0..50u32 {
                let ep = ep.clone();
                let addr = server.addr;
                tasks.push(tokio::spawn(async move {
                    let conn = ep.connect(addr, "localhost").unwrap().await.unwrap();
                    let (mut s, mut r) = conn.open_bi().await.unwrap();
                    let msg = format!("{wave}/{i}").into_bytes();
                    s.write_all(&msg).await.unwrap();
                    s.finish().unwrap();
                    assert_eq!(r.read_to_end(64).await.unwrap(), msg);
                    conn.close(0u32.into(), b"");
                }));
            }
            for t in tasks {
                t.await.unwrap();
            }
        }
        ep.wait_idle().await;
    });
    // The server forgets every connection once the closes drain.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let s = *server.stats.lock().unwrap();
        if s.accepted >= 1000 && s.open == 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "connections linger: {s:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn connections_beyond_the_limit_are_refused_and_garbage_is_ignored() {
    let server = start_server(2);
    // Garbage datagrams cost nothing but a drop.
    let sock = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    for i in 0..1000u32 {
        let _ = sock.send_to(&i.to_be_bytes().repeat(300), server.addr);
    }
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        let ep = client(&server, false);
        let a = ep.connect(server.addr, "localhost").unwrap().await.unwrap();
        let b = ep.connect(server.addr, "localhost").unwrap().await.unwrap();
        let c = ep.connect(server.addr, "localhost").unwrap().await;
        assert!(c.is_err(), "third connection refused");
        // The first two still work.
        for conn in [&a, &b] {
            let (mut s, mut r) = conn.open_bi().await.unwrap();
            s.write_all(b"ok").await.unwrap();
            s.finish().unwrap();
            assert_eq!(r.read_to_end(16).await.unwrap(), b"ok");
        }
    });
    // Stats are sampled every 20 ms.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let s = *server.stats.lock().unwrap();
        if s.refused >= 1 && s.datagrams_in >= 1000 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{s:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}
