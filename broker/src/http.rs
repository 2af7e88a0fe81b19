//! The operator HTTP endpoint: `/metrics` (Prometheus text), `/livez`, `/readyz`.
//!
//! A plain blocking server on its own thread: it is never on the data path, and it
//! reads only relaxed atomic counters the cores publish.

use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::core::Shared;

/// Renders every metric.
pub fn render(shared: &Shared) -> String {
    let mut out = String::new();
    type Read = fn(&crate::core::CoreMetrics) -> u64;
    let counters: [(&str, &str, Read); 15] = [
        ("felix_broker_publish_batches_total", "counter", |m| {
            m.publish_batches.load(Ordering::Relaxed)
        }),
        ("felix_broker_publish_records_total", "counter", |m| {
            m.publish_records.load(Ordering::Relaxed)
        }),
        ("felix_broker_publish_bytes_total", "counter", |m| {
            m.publish_bytes.load(Ordering::Relaxed)
        }),
        ("felix_broker_publish_errors_total", "counter", |m| {
            m.publish_errors.load(Ordering::Relaxed)
        }),
        ("felix_broker_events_queued_total", "counter", |m| {
            m.events_queued.load(Ordering::Relaxed)
        }),
        ("felix_broker_events_dropped_total", "counter", |m| {
            m.events_dropped.load(Ordering::Relaxed)
        }),
        ("felix_broker_subscriptions", "gauge", |m| {
            m.subscriptions.load(Ordering::Relaxed)
        }),
        ("felix_broker_connections", "gauge", |m| {
            m.connections.load(Ordering::Relaxed)
        }),
        ("felix_broker_cache_ops_total", "counter", |m| {
            m.cache_ops.load(Ordering::Relaxed)
        }),
        ("felix_broker_mesh_messages_sent_total", "counter", |m| {
            m.mesh_sent.load(Ordering::Relaxed)
        }),
        ("felix_broker_shards_open", "gauge", |m| {
            m.shards_open.load(Ordering::Relaxed)
        }),
        ("felix_broker_forwarded_total", "counter", |m| {
            m.forwarded.load(Ordering::Relaxed)
        }),
        ("felix_broker_subscriber_catchups_total", "counter", |m| {
            m.subscriber_catchups.load(Ordering::Relaxed)
        }),
        ("felix_broker_log_syncs", "gauge", |m| {
            m.log_syncs.load(Ordering::Relaxed)
        }),
        ("felix_broker_log_synced_batches", "gauge", |m| {
            m.log_synced_batches.load(Ordering::Relaxed)
        }),
    ];
    for (name, kind, get) in counters {
        let _ = writeln!(out, "# TYPE {name} {kind}");
        for (core, m) in shared.metrics.iter().enumerate() {
            let _ = writeln!(out, "{name}{{core=\"{core}\"}} {}", get(m));
        }
    }
    let _ = writeln!(out, "# TYPE felix_broker_ready gauge");
    let _ = writeln!(
        out,
        "felix_broker_ready {}",
        u8::from(shared.ready.load(Ordering::Relaxed))
    );
    if let Some(c) = &shared.cluster {
        let _ = writeln!(out, "# TYPE felix_broker_controlplane_syncs_total counter");
        let _ = writeln!(
            out,
            "felix_broker_controlplane_syncs_total {}",
            c.syncs.load(Ordering::Relaxed)
        );
        let _ = writeln!(out, "# TYPE felix_broker_heartbeats_total counter");
        let _ = writeln!(
            out,
            "felix_broker_heartbeats_total {}",
            c.heartbeats.load(Ordering::Relaxed)
        );
        let _ = writeln!(out, "# TYPE felix_broker_shards_led gauge");
        let _ = writeln!(out, "felix_broker_shards_led {}", c.shards_led());
    }
    let table = shared.placement.load();
    let _ = writeln!(out, "# TYPE felix_broker_placement_cores gauge");
    let _ = writeln!(out, "felix_broker_placement_cores {}", table.cores());
    let _ = writeln!(out, "# TYPE felix_broker_placement_pin_rules gauge");
    let _ = writeln!(
        out,
        "felix_broker_placement_pin_rules {}",
        table.rules().len()
    );
    out
}

fn handle(mut s: TcpStream, shared: &Shared) -> std::io::Result<()> {
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut line = String::new();
    BufReader::new(&s).read_line(&mut line)?;
    let path = line.split_whitespace().nth(1).unwrap_or("/");
    let (status, body, ctype) = match path {
        "/livez" => ("200 OK", "ok\n".to_owned(), "text/plain"),
        "/readyz" if shared.ready.load(Ordering::Relaxed) => {
            ("200 OK", "ready\n".to_owned(), "text/plain")
        }
        "/readyz" => (
            "503 Service Unavailable",
            "starting\n".to_owned(),
            "text/plain",
        ),
        "/metrics" => ("200 OK", render(shared), "text/plain; version=0.0.4"),
        "/placement" => {
            let table = shared.placement.load();
            let rules: Vec<String> = table.rules().iter().map(|r| format!("{r:?}")).collect();
            let streams = shared.catalog.streams();
            let mut owners = Vec::new();
            for (name, spec) in streams {
                let mut parts = name.splitn(3, '/');
                let (t, ns, s) = (
                    parts.next().unwrap_or(""),
                    parts.next().unwrap_or(""),
                    parts.next().unwrap_or(""),
                );
                for shard in 0..spec.shards {
                    let key = felix_core_runtime::placement::ShardKey {
                        kind: felix_core_runtime::placement::ShardKind::Stream,
                        tenant: t.into(),
                        namespace: ns.into(),
                        name: s.into(),
                        shard,
                    };
                    owners.push(serde_json::json!({"stream": name, "shard": shard, "core": table.core_for(&key).index(), "pinned": table.pinned(&key)}));
                }
            }
            let body = serde_json::json!({"cores": table.cores(), "version": table.version(), "rules": rules, "shards": owners});
            ("200 OK", format!("{body}\n"), "application/json")
        }
        _ => ("404 Not Found", "not found\n".to_owned(), "text/plain"),
    };
    write!(
        s,
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
}

/// Serves until the process exits.
pub fn spawn(addr: SocketAddr, shared: Arc<Shared>) -> anyhow::Result<SocketAddr> {
    let listener =
        TcpListener::bind(addr).map_err(|e| anyhow::anyhow!("binding --http {addr}: {e}"))?;
    let bound = listener.local_addr()?;
    std::thread::Builder::new()
        .name("felix-http".into())
        .spawn(move || {
            for s in listener.incoming().flatten() {
                let _ = handle(s, &shared);
            }
        })?;
    Ok(bound)
}
