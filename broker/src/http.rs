//! The operator HTTP endpoint: `/metrics` (OpenMetrics text via `prometheus-client`),
//! `/livez`, `/readyz`, `/placement`, `/cores` (what `felix top` shows), `POST /pins`
//! (live re-pin), `/replication/halted`, and, only when fault injection is enabled,
//! `/debug/storage-faults`, `/debug/replica-sync`, `/debug/hold-opens` and `/debug/panic`.
//!
//! axum on its own thread and a current-thread tokio runtime: never on a core, never
//! on the data path. Each connection is its own task and each answer has a deadline, so
//! a slow client cannot hold up `/livez`. It reads only the relaxed atomics the cores
//! publish.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::Router;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use felix_storage_uring::FaultTimes;

use crate::core::{CoreMetrics, Shared};
use felix_core_runtime::placement::PinRule;
use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;

/// How long any answer may take.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(5);

type Read = fn(&CoreMetrics) -> u64;

/// Per-core series: name, type, help, reader.
const PER_CORE: &[(&str, &str, &str, Read)] = &[
    (
        "felix_broker_publish_batches_total",
        "counter",
        "Publish batches appended.",
        |m| m.publish_batches.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_publish_records_total",
        "counter",
        "Records appended.",
        |m| m.publish_records.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_publish_bytes_total",
        "counter",
        "Payload bytes received for appends.",
        |m| m.publish_bytes.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_publish_errors_total",
        "counter",
        "Publishes refused or failed.",
        |m| m.publish_errors.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_events_queued_total",
        "counter",
        "Batches handed to subscriber queues.",
        |m| m.events_queued.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_events_dropped_total",
        "counter",
        "Batches a full subscriber or core queue dropped (read back from the log).",
        |m| m.events_dropped.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_subscriptions",
        "gauge",
        "Live subscriptions.",
        |m| m.subscriptions.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_connections",
        "gauge",
        "Open client connections.",
        |m| m.connections.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_revoked_connections_total",
        "counter",
        "Connections closed because a token they authenticated with was revoked or its key retired.",
        |m| m.revoked_connections.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_cache_ops_total",
        "counter",
        "Cache operations.",
        |m| m.cache_ops.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_cache_compactions_total",
        "counter",
        "Cache logs compacted (live values copied past a cut, older segments removed).",
        |m| m.cache_compactions.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_subscriptions_lagged_total",
        "counter",
        "Subscriptions ended with subscription_lagged: retention removed records they had not read.",
        |m| m.subscriptions_lagged.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_cache_expired_total",
        "counter",
        "Expired cache values deleted (a delete written to the log by housekeeping).",
        |m| m.cache_expired.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_subscriptions_moved_total",
        "counter",
        "Subscriptions ended with shard_moved because their shard moved to another broker.",
        |m| m.subscriptions_moved.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_idempotent_duplicates_total",
        "counter",
        "Idempotent re-sends answered from the log instead of appended again.",
        |m| m.idempotent_duplicates.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_producer_snapshots_saved_total",
        "counter",
        "Idempotent-producer tables saved as snapshots beside their shard's log.",
        |m| m.producer_snapshots_saved.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_producer_tables_from_snapshot_total",
        "counter",
        "Idempotent-producer tables built from a snapshot and the log after it.",
        |m| m.producer_tables_from_snapshot.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_cache_watch_log_reads_total",
        "counter",
        "Cache watch reads answered from the log: watchers catching up from behind the cache's recent changes kept in memory.",
        |m| m.cache_watch_log_reads.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_producer_table_read_bytes_total",
        "counter",
        "Record bytes read from logs to build idempotent-producer tables (a leader's, and a follower's to save).",
        |m| m.producer_table_read_bytes.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_group_ops_total",
        "counter",
        "Consumer-group requests.",
        |m| m.group_ops.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_group_snapshots_total",
        "counter",
        "Group snapshots written (every group's durable state, so a new leader folds only the log after it).",
        |m| m.group_snapshots.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_group_folds_total",
        "counter",
        "Builds of a shard's groups by folding its log (once per leadership).",
        |m| m.group_folds.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_group_folds_from_snapshot_total",
        "counter",
        "Of those, folds that started from a group snapshot.",
        |m| m.group_folds_from_snapshot.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_group_fold_bytes_total",
        "counter",
        "Record bytes read by those folds.",
        |m| m.group_fold_bytes.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_requests_held_total",
        "counter",
        "Requests held while their shard moved to this core (live re-pin).",
        |m| m.requests_held.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_requests_held_refused_total",
        "counter",
        "Requests refused overloaded rather than held: the core held HELD_MAX for moving shards.",
        |m| m.requests_held_refused.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_takeover_held_total",
        "counter",
        "Publishes held while this broker took their replicated shard over (a move's or failover's cut-over).",
        |m| m.takeover_held.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_requests_passed_on_total",
        "counter",
        "Requests that reached this core under an older placement and were passed on to the owning core.",
        |m| m.requests_passed_on.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_shards_moved_in_total",
        "counter",
        "Shards moved to this core by live re-pins.",
        |m| m.shards_moved_in.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_follow_load_moves_total",
        "counter",
        "Shards re-pinned automatically to the core their requests arrive on (counted by the core that applies re-pins).",
        |m| m.follow_moves.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_subscriber_queued_batches",
        "gauge",
        "Batches waiting in this core's subscriber queues (sampled).",
        |m| m.subscriber_queued.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_mesh_messages_sent_total",
        "counter",
        "Cross-core messages sent.",
        |m| m.mesh_sent.load(Ordering::Relaxed),
    ),
    ("felix_broker_shards_open", "gauge", "Shards open.", |m| {
        m.shards_open.load(Ordering::Relaxed)
    }),
    (
        "felix_broker_forwarded_total",
        "counter",
        "Requests forwarded to the shard's leader.",
        |m| m.forwarded.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_subscriber_catchups_total",
        "counter",
        "Times a subscriber read missed batches back from the log.",
        |m| m.subscriber_catchups.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_log_syncs",
        "gauge",
        "Device syncs of data by this core's stream logs (open ones, and those closed here since the start): fdatasync calls and durable O_DSYNC writes.",
        |m| m.log_syncs.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_log_synced_batches",
        "gauge",
        "Batches made durable by those syncs.",
        |m| m.log_synced_batches.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_log_zero_ahead_bytes",
        "gauge",
        "Zeros this core's stream logs wrote past their data so appends overwrite blocks instead of growing the file (zero_ahead_bytes).",
        |m| m.log_zero_ahead_bytes.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_log_dsync_writes",
        "gauge",
        "Of felix_broker_log_syncs, the rounds written with one durable O_DSYNC write instead of a write and an fdatasync (dsync_writes).",
        |m| m.log_dsync_writes.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_foreign_batches_total",
        "counter",
        "Live batches a subscriber refused as another shard's.",
        |m| m.foreign_batches.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_cross_core_refused_total",
        "counter",
        "Cross-core requests refused at the per-core-pair bound.",
        |m| m.cross_core_refused.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_cross_core_outstanding",
        "gauge",
        "Cross-core requests awaiting an answer.",
        |m| m.cross_core_outstanding.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_unfinished_frames_closed_total",
        "counter",
        "Connections closed (QUIC error 3) for holding more bytes of begun, unfinished frames than their own bound or, as the largest, the core's.",
        |m| m.unfinished_closed.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_unread_answers_closed_total",
        "counter",
        "Connections closed (QUIC error 4) for leaving more bytes of answers unread (waiting for QUIC to take them) than their own bound or, as the largest, the core's.",
        |m| m.unwritten_closed.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_request_bytes_in_flight",
        "gauge",
        "Request bytes in flight on the core, all connections together (a publish's records, any other request's frame, each at least 4 KiB), bounded by max_inflight_request_bytes_per_core.",
        |m| m.request_bytes_in_flight.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_poll_waits_cut_total",
        "counter",
        "Group polls answered at once instead of waiting: past their connection's max_waiting_polls_per_connection or the waiting polls one core may hold at another.",
        |m| m.poll_waits_cut.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_poisoned_logs",
        "gauge",
        "Open logs poisoned by a failed write or fsync.",
        |m| m.poisoned_logs.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_disk_full",
        "gauge",
        "1 while appends fail for lack of disk space (one refused in the last 5 s, none taken since).",
        |m| u64::from(m.disk_full_now()),
    ),
    (
        "felix_broker_disk_full_refusals_total",
        "counter",
        "Appends refused for lack of disk space.",
        |m| m.disk_full_refusals.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_core_alive",
        "gauge",
        "1 while the core serves.",
        |m| m.alive.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_retention_segments_removed_total",
        "counter",
        "Segments removed by retention.",
        |m| m.retention_segments_removed.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_state_copies_total",
        "counter",
        "State entries copied to the log's tail before retention removed their record.",
        |m| m.state_copies.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_replicas_left_total",
        "counter",
        "Copies of replicated shards removed after this broker left their set.",
        |m| m.replicas_left.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_replication_lag_records",
        "gauge",
        "Records the led Leader-consistency shards hold that their slowest non-halted follower lacks: what a failover now could lose.",
        |m| m.replication_lag_records.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_replication_halted",
        "gauge",
        "Followers of led shards halted (they would have to cut committed records).",
        |m| m.replication_halted.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_replication_shipped_total",
        "counter",
        "Records shipped to followers.",
        |m| m.replication_shipped.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_replicated_total",
        "counter",
        "Records stored as a follower.",
        |m| m.replicated.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_quorum_unknown_total",
        "counter",
        "Quorum publishes answered outcome-unknown (no majority in time, or leadership changed first).",
        |m| m.quorum_unknown.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_lease_refusals_total",
        "counter",
        "Writes refused because this broker's lease had run out.",
        |m| m.lease_refusals.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_replicas_rebuilding",
        "gauge",
        "Copies of replicated shards found damaged, set aside and being rebuilt from the other copies (counted in no election until whole).",
        |m| m.replicas_rebuilding.load(Ordering::Relaxed),
    ),
    (
        "felix_broker_subscriber_queue_bytes",
        "gauge",
        "Bytes the cores' subscriber queues hold, sampled each housekeeping round (each core's are bounded together at 1 GiB; past it, batches for a queue holding anything are read back from the log).",
        |m| m.subscriber_queue_bytes.load(Ordering::Relaxed),
    ),
];

/// Renders every metric in the OpenMetrics text format, through `prometheus-client`.
/// The cores record into their own relaxed atomics (no registry, no lock on the data
/// path); a collector reads them at scrape time.
pub fn render(shared: &Arc<Shared>, damaged: (u64, u64)) -> String {
    let mut registry = prometheus_client::registry::Registry::default();
    registry.register_collector(Box::new(Collector(shared.clone(), damaged)));
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, &registry)
        .expect("writing to a String cannot fail");
    out
}

/// Reads the cores' atomics for one scrape, with the damaged copies (count, bytes)
/// counted from disk for it.
#[derive(Debug)]
struct Collector(Arc<Shared>, (u64, u64));

/// `prometheus-client` adds `_total` to a counter's samples: descriptors are named
/// without it.
fn family(name: &str, kind: &str) -> (String, MetricType) {
    match kind {
        "counter" => (
            name.strip_suffix("_total").unwrap_or(name).to_owned(),
            MetricType::Counter,
        ),
        _ => (name.to_owned(), MetricType::Gauge),
    }
}

impl prometheus_client::collector::Collector for Collector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let shared = &self.0;
        let cores: Vec<[(&str, String); 1]> = (0..shared.metrics.len())
            .map(|c| [("core", c.to_string())])
            .collect();
        for (name, kind, help, read) in PER_CORE {
            let (name, kind) = family(name, kind);
            let mut m = encoder.encode_descriptor(&name, help, None, kind)?;
            for (labels, metrics) in cores.iter().zip(&shared.metrics) {
                let v = read(metrics);
                let mut f = m.encode_family(labels)?;
                match kind {
                    MetricType::Counter => f.encode_counter::<NoLabelSet, _, u64>(&v, None)?,
                    _ => f.encode_gauge(&v)?,
                }
            }
        }
        let cpu = encoder.encode_descriptor(
            "felix_broker_core_cpu_seconds",
            "CPU time of this core's thread, sampled every 250 ms.",
            None,
            MetricType::Counter,
        );
        let mut cpu = cpu?;
        for (labels, m) in cores.iter().zip(&shared.metrics) {
            let secs = m.cpu_ns.load(Ordering::Relaxed) as f64 / 1e9;
            cpu.encode_family(labels)?
                .encode_counter::<NoLabelSet, _, u64>(&secs, None)?;
        }
        for (name, help, pick) in [
            (
                "felix_broker_publish_ack_seconds",
                "From a publish read off its stream to its acknowledgement being ready (appended, replicated as the stream asks).",
                (|m: &CoreMetrics| &m.publish_ack)
                    as fn(&CoreMetrics) -> &crate::histogram::Histogram,
            ),
            (
                "felix_broker_append_commit_seconds",
                "From a batch's offsets being claimed to its commit on the shard's core (device write and fdatasync under fsync on-commit).",
                |m: &CoreMetrics| &m.append_commit,
            ),
            (
                "felix_broker_mesh_hop_seconds",
                "From a publish leaving the connection's core to the shard's core taking it up (cross-core publishes only).",
                |m: &CoreMetrics| &m.mesh_hop,
            ),
            (
                "felix_broker_log_write_seconds",
                "One flush round's device writes on this core's logs, the sync included when the round is one durable O_DSYNC write (dsync_writes; sampled every 250 ms).",
                |m: &CoreMetrics| &m.log_write,
            ),
            (
                "felix_broker_log_fsync_seconds",
                "One fdatasync on this core's logs; a group commit covers a whole round. With dsync_writes only rolls and each log's first round after it opens fdatasync (sampled every 250 ms).",
                |m: &CoreMetrics| &m.log_fsync,
            ),
            (
                "felix_broker_answer_send_seconds",
                "From an answer or delivery written to a client connection's stream to the first datagram that connection sends after it.",
                |m: &CoreMetrics| &m.answer_send,
            ),
        ] {
            let mut m = encoder.encode_descriptor(name, help, None, MetricType::Histogram)?;
            for (labels, metrics) in cores.iter().zip(&shared.metrics) {
                let h = pick(metrics);
                let buckets: Vec<(f64, u64)> = h
                    .buckets()
                    .into_iter()
                    .enumerate()
                    .map(|(i, n)| {
                        let le = crate::histogram::BOUNDS_US
                            .get(i)
                            .map_or(f64::MAX, |us| *us as f64 / 1e6);
                        (le, n)
                    })
                    .collect();
                // The count is the buckets' total as read: read apart while a core
                // observes, `_count` could differ from the `+Inf` bucket, which the
                // text format forbids.
                let count = buckets.iter().map(|(_, n)| n).sum();
                m.encode_family(labels)?.encode_histogram::<NoLabelSet>(
                    h.sum_seconds(),
                    count,
                    &buckets,
                    None,
                )?;
            }
        }
        let mut one = |name: &str, help: &str, kind: MetricType, v: u64| {
            let mut m = encoder.encode_descriptor(name, help, None, kind)?;
            match kind {
                MetricType::Counter => m.encode_counter::<NoLabelSet, _, u64>(&v, None),
                _ => m.encode_gauge(&v),
            }
        };
        one(
            "felix_broker_ready",
            "1 when /readyz answers ready.",
            MetricType::Gauge,
            u64::from(unready_reasons(shared).is_empty()),
        )?;
        one(
            "felix_broker_quic_missed_wakeups",
            "Socket reads forced by the QUIC driver's periodic check that found datagrams its readiness probe had not reported (each one a stall of up to 50 ms while datagrams flow, 250 ms or 1 s on an endpoint quiet for 200 ms).",
            MetricType::Counter,
            felix_core_runtime::quic::missed_wakeups_total(),
        )?;
        one(
            "felix_broker_quic_send_errors",
            "Datagrams the socket refused for good (e.g. to an unreachable or forged address), every endpoint together; logged at the 1st, 2nd, 4th, 8th...",
            MetricType::Counter,
            felix_core_runtime::quic::send_errors_total(),
        )?;
        one(
            "felix_broker_damaged_copies",
            "Damaged replica copies kept under damaged-copies/ for an operator (the oldest deleted beyond damaged_copies_kept).",
            MetricType::Gauge,
            self.1.0,
        )?;
        one(
            "felix_broker_damaged_copies_bytes",
            "Bytes the kept damaged replica copies take on disk.",
            MetricType::Gauge,
            self.1.1,
        )?;
        one(
            "felix_broker_watch_snapshot_bytes",
            "Bytes of current values starting cache watches hold (keys and entries; the values are the caches'), bounded by max_watch_snapshot_bytes.",
            MetricType::Gauge,
            shared.watch_snapshots.held() as u64,
        )?;
        if let Some(c) = &shared.cluster {
            one(
                "felix_broker_controlplane_syncs",
                "Full syncs from the control plane.",
                MetricType::Counter,
                c.syncs.load(Ordering::Relaxed),
            )?;
            one(
                "felix_broker_heartbeats",
                "Heartbeats the control plane accepted.",
                MetricType::Counter,
                c.heartbeats.load(Ordering::Relaxed),
            )?;
            one(
                "felix_broker_shards_led",
                "Shards this broker leads.",
                MetricType::Gauge,
                c.shards_led() as u64,
            )?;
            let status = c.sync_status.lock().map(|s| s.clone()).unwrap_or_default();
            one(
                "felix_broker_controlplane_sync_failures",
                "Syncs from the control plane that failed (the last snapshot was kept).",
                MetricType::Counter,
                c.sync_failures.load(Ordering::Relaxed),
            )?;
            one(
                "felix_broker_controlplane_unverified",
                "1 while the last sync failed (unreachable, or its certificate did not verify).",
                MetricType::Gauge,
                u64::from(status.last_error.is_some()),
            )?;
            one(
                "felix_broker_controlplane_refused_key_sets",
                "Tenants whose key set the last sync refused (they keep their last good keys).",
                MetricType::Gauge,
                status.unverified_tenants.len() as u64,
            )?;
        }
        let table = shared.placement.load();
        one(
            "felix_broker_placement_cores",
            "Cores shards are placed on.",
            MetricType::Gauge,
            table.cores() as u64,
        )?;
        one(
            "felix_broker_placement_pin_rules",
            "Pin rules: operators' and load following's.",
            MetricType::Gauge,
            table.rules().len() as u64,
        )?;
        Ok(())
    }
}

/// Why the broker is not ready; empty when it is.
pub fn unready_reasons(shared: &Shared) -> Vec<String> {
    let mut reasons = Vec::new();
    if !shared.ready.load(Ordering::Relaxed) {
        reasons.push("starting".to_owned());
    }
    // Both turn new connections away: a load balancer must stop sending clients here
    // (it kept doing so for the drain's up to 15 s and the stop after it).
    if shared
        .cluster
        .as_ref()
        .is_some_and(|c| c.draining.load(Ordering::Relaxed))
    {
        reasons.push("draining: handing the shards it leads to replicas".to_owned());
    }
    if shared.stopping.load(Ordering::Relaxed) {
        reasons.push("stopping".to_owned());
    }
    for (core, m) in shared.metrics.iter().enumerate() {
        if shared.ready.load(Ordering::Relaxed) && m.alive.load(Ordering::Relaxed) == 0 {
            reasons.push(format!("core {core} is not running"));
        }
        let poisoned = m.poisoned_logs.load(Ordering::Relaxed);
        if poisoned > 0 {
            reasons.push(format!(
                "core {core}: {poisoned} log(s) poisoned by a failed write or fsync (restart to recover)"
            ));
        }
        if m.disk_full_now() {
            reasons.push(format!("core {core}: disk full, appends refused"));
        }
    }
    reasons
}

async fn livez() -> &'static str {
    "ok\n"
}

/// What the broker serves with but could not refresh: it stays ready (its last good
/// keys and assignments still hold) and says so.
pub fn degraded_reasons(shared: &Shared) -> Vec<String> {
    let Some(c) = &shared.cluster else {
        return Vec::new();
    };
    let status = c.sync_status.lock().map(|s| s.clone()).unwrap_or_default();
    let mut out = Vec::new();
    if let Some(e) = status.last_error {
        out.push(format!(
            "degraded: control plane not synced, serving with the last good keys and assignments: {e}"
        ));
    }
    for (tenant, why) in status.unverified_tenants {
        out.push(format!(
            "degraded: tenant {tenant}'s key set refused ({why}); its last good keys kept"
        ));
    }
    out
}

async fn readyz(State(shared): State<Arc<Shared>>) -> Response {
    let reasons = unready_reasons(&shared);
    if reasons.is_empty() {
        let mut body = "ready\n".to_owned();
        for line in degraded_reasons(&shared) {
            body.push_str(&line);
            body.push('\n');
        }
        body.into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("{}\n", reasons.join("\n")),
        )
            .into_response()
    }
}

async fn metrics(State(shared): State<Arc<Shared>>) -> Response {
    // The damaged copies are counted from disk, on a blocking thread: never stale
    // (an operator may delete them by hand), and a slow disk does not hold this
    // thread, which also answers `/livez`.
    let root = shared.data_dir.join(crate::core::DAMAGED_DIR);
    let damaged = tokio::task::spawn_blocking(move || crate::core::count_damaged_copies(&root))
        .await
        .unwrap_or_default();
    (
        [(
            "content-type",
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        render(&shared, damaged),
    )
        .into_response()
}

#[derive(serde::Deserialize)]
struct PinBody {
    /// `tenant/namespace/name[/shard]=core`.
    rule: String,
}

/// How long a re-pin may take before the answer gives up waiting (it still completes).
const PIN_TIMEOUT: Duration = Duration::from_secs(4);

/// Pins shards to a core on the running broker and keeps the pin across restarts.
async fn pin(State(shared): State<Arc<Shared>>, axum::Json(body): axum::Json<PinBody>) -> Response {
    let rule: PinRule = match body.rule.parse() {
        Ok(r) => r,
        Err(e) => return (StatusCode::BAD_REQUEST, format!("{e}\n")).into_response(),
    };
    let (tx, rx) = futures_channel::oneshot::channel();
    let job = crate::core::moves::RepinJob {
        rule,
        auto: false,
        answer: tx,
    };
    if shared.repins.unbounded_send(job).is_err() {
        return (StatusCode::SERVICE_UNAVAILABLE, "the broker is stopping\n").into_response();
    }
    match tokio::time::timeout(PIN_TIMEOUT, rx).await {
        Ok(Ok(Ok(report))) => axum::Json(report).into_response(),
        Ok(Ok(Err(crate::error::BrokerError::InvalidRequest(e)))) => {
            (StatusCode::BAD_REQUEST, format!("{e}\n")).into_response()
        }
        Ok(Ok(Err(e))) => (StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")).into_response(),
        Ok(Err(_)) => (StatusCode::SERVICE_UNAVAILABLE, "the broker is stopping\n").into_response(),
        Err(_) => (
            StatusCode::ACCEPTED,
            "still moving; GET /placement shows when it is done\n",
        )
            .into_response(),
    }
}

/// Per-core figures for `felix top`: counters, CPU time, latency buckets and the open
/// shards, as the cores last sampled them.
async fn cores(State(shared): State<Arc<Shared>>) -> Response {
    let table = shared.placement.load();
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let cores: Vec<serde_json::Value> = shared
        .metrics
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let shards = m.shards.lock().map(|s| s.clone()).unwrap_or_default();
            serde_json::json!({
                "core": i,
                "cpu_ns": m.cpu_ns.load(Ordering::Relaxed),
                "publish_records": m.publish_records.load(Ordering::Relaxed),
                "publish_batches": m.publish_batches.load(Ordering::Relaxed),
                "connections": m.connections.load(Ordering::Relaxed),
                "subscriptions": m.subscriptions.load(Ordering::Relaxed),
                "subscriber_queued": m.subscriber_queued.load(Ordering::Relaxed),
                "mesh_sent": m.mesh_sent.load(Ordering::Relaxed),
                "append_commit_buckets": m.append_commit.buckets(),
                "publish_ack_buckets": m.publish_ack.buckets(),
                "shards": shards,
            })
        })
        .collect();
    axum::Json(serde_json::json!({
        "now_ms": now_ms,
        "version": table.version(),
        "bounds_us": crate::histogram::BOUNDS_US,
        "cores": cores,
    }))
    .into_response()
}

async fn placement(State(shared): State<Arc<Shared>>) -> Response {
    let table = shared.placement.load();
    let autos = shared.auto_pins.lock().expect("auto pins lock").clone();
    let rules: Vec<String> = table.rules().iter().map(ToString::to_string).collect();
    // The rules load following added (`core/follow.rs`); the others are operators'.
    let automatic: Vec<String> = table
        .rules()
        .iter()
        .filter(|r| autos.contains(r))
        .map(ToString::to_string)
        .collect();
    let mut owners = Vec::new();
    // Streams' shards and caches' (placed by a hash of their own: caches were left out).
    for (stream, kind, field) in [
        (
            true,
            felix_core_runtime::placement::ShardKind::Stream,
            "stream",
        ),
        (
            false,
            felix_core_runtime::placement::ShardKind::Cache,
            "cache",
        ),
    ] {
        for (name, spec) in shared.catalog.list(stream) {
            let mut parts = name.splitn(3, '/');
            let (t, ns, s) = (
                parts.next().unwrap_or(""),
                parts.next().unwrap_or(""),
                parts.next().unwrap_or(""),
            );
            for shard in 0..spec.shards {
                let key = felix_core_runtime::placement::ShardKey {
                    kind,
                    tenant: t.into(),
                    namespace: ns.into(),
                    name: s.into(),
                    shard,
                };
                let rule = crate::core::follow::rule_for(&key, table.core_for(&key));
                let pinned = crate::core::follow::operator_pinned(&table, &autos, &rule);
                let followed = !pinned && autos.contains(&rule);
                owners.push(serde_json::json!({field: name, "kind": field, "shard": shard, "core": table.core_for(&key).index(), "pinned": pinned, "followed": followed}));
            }
        }
    }
    axum::Json(serde_json::json!({"cores": table.cores(), "version": table.version(), "rules": rules, "automatic_rules": automatic, "shards": owners}))
        .into_response()
}

#[derive(serde::Deserialize)]
struct FaultQuery {
    /// `write`, `sync` or `open` (a log's directory); absent with `clear`.
    op: Option<String>,
    /// `eio` (default), `enospc` or `emfile`.
    errno: Option<String>,
    /// `once` (default) or `always`.
    times: Option<String>,
    /// Clear every armed fault.
    #[serde(default)]
    clear: bool,
}

/// Arms a storage fault on every core's logs (tests and chaos runs only).
async fn storage_faults(
    State(shared): State<Arc<Shared>>,
    Query(q): Query<FaultQuery>,
) -> Response {
    let Some(faults) = &shared.faults else {
        return (StatusCode::NOT_FOUND, "fault injection is off\n").into_response();
    };
    if q.clear {
        faults.clear();
        return "cleared\n".into_response();
    }
    let errno = match q.errno.as_deref() {
        Some("eio") | None => libc::EIO,
        Some("enospc") => libc::ENOSPC,
        Some("emfile") => libc::EMFILE,
        Some(other) => {
            return (
                StatusCode::BAD_REQUEST,
                format!("unknown errno {other:?}\n"),
            )
                .into_response();
        }
    };
    let times = match q.times.as_deref() {
        Some("always") => FaultTimes::Always,
        Some("once") | None => FaultTimes::Once,
        Some(other) => {
            return (
                StatusCode::BAD_REQUEST,
                format!("unknown times {other:?}\n"),
            )
                .into_response();
        }
    };
    match q.op.as_deref() {
        Some("write") => faults.fail_writes(errno, times),
        Some("sync") => faults.fail_syncs(errno, times),
        Some("open") => faults.fail_opens(errno, times),
        other => {
            return (
                StatusCode::BAD_REQUEST,
                format!("op must be write, sync or open, not {other:?}\n"),
            )
                .into_response();
        }
    }
    "armed\n".into_response()
}

/// Followers halted because they would have to cut committed records (`[]` when none).
async fn halted(State(shared): State<Arc<Shared>>) -> Response {
    let mut out = Vec::new();
    if let Some(c) = &shared.cluster
        && let Ok(reports) = c.reports.lock()
    {
        for r in reports.values() {
            for f in r.followers.iter().filter(|f| f.halted) {
                out.push(serde_json::json!({
                    "stream": format!("{}/{}/{}", r.tenant_id, r.namespace, r.name),
                    "shard": r.shard,
                    "node": f.node_id,
                    "generation": r.generation,
                    "progress": f.durable_end,
                    "reason": "diverged below the commit mark",
                    "advice": "the follower's log disagrees with committed records; remove its data for the shard so it is rebuilt",
                }));
            }
        }
    }
    axum::Json(serde_json::Value::Array(out)).into_response()
}

#[derive(serde::Deserialize)]
struct PanicQuery {
    core: i64,
}

#[derive(serde::Deserialize)]
struct ReplicaSyncQuery {
    pause: bool,
}

/// Pauses (`pause=true`) or resumes every core's look at the assignments for its
/// replicas (fault injection only).
async fn replica_sync(
    State(shared): State<Arc<Shared>>,
    Query(q): Query<ReplicaSyncQuery>,
) -> Response {
    if shared.faults.is_none() {
        return (StatusCode::NOT_FOUND, "fault injection is off\n").into_response();
    }
    shared.replica_sync_paused.store(q.pause, Ordering::SeqCst);
    if q.pause { "paused\n" } else { "resumed\n" }.into_response()
}

#[derive(serde::Deserialize)]
struct HoldOpensQuery {
    hold: bool,
}

/// Holds (`hold=true`) or lets go of every shard log opened, before the requests
/// waiting for it get it (fault injection only).
async fn hold_opens(
    State(shared): State<Arc<Shared>>,
    Query(q): Query<HoldOpensQuery>,
) -> Response {
    if shared.faults.is_none() {
        return (StatusCode::NOT_FOUND, "fault injection is off\n").into_response();
    }
    shared.opens_held.store(q.hold, Ordering::SeqCst);
    if q.hold { "held\n" } else { "let go\n" }.into_response()
}

/// Makes a core panic at its next housekeeping tick (fault injection only).
async fn panic_core(State(shared): State<Arc<Shared>>, Query(q): Query<PanicQuery>) -> Response {
    if shared.faults.is_none() {
        return (StatusCode::NOT_FOUND, "fault injection is off\n").into_response();
    }
    shared.panic_core.store(q.core, Ordering::SeqCst);
    "armed\n".into_response()
}

/// On a loopback listener, a request must name a loopback host (`127.0.0.1`, `[::1]`,
/// `localhost`) or an IP address: a web page whose name was rebound to 127.0.0.1 (DNS
/// rebinding) names its own, and could otherwise read `/placement` and `POST /pins`
/// from the broker's host in the browser's same-origin rules (until 2026-12-08). Off
/// loopback (a management network) any name is taken, as before.
async fn loopback_host(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    match req.headers().get(axum::http::header::HOST) {
        Some(host) if !loopback_name(host.to_str().unwrap_or("")) => (
            StatusCode::MISDIRECTED_REQUEST,
            "this endpoint answers only to a loopback host name or an IP address\n",
        )
            .into_response(),
        _ => next.run(req).await,
    }
}

/// Whether a `Host` header names an IP address or `localhost` (with any port).
fn loopback_name(host: &str) -> bool {
    let name = match host.strip_prefix('[') {
        // `[::1]:9090`
        Some(rest) => rest.split_once(']').map_or("", |(name, _)| name),
        None => host.rsplit_once(':').map_or(host, |(name, _)| name),
    };
    name.parse::<std::net::IpAddr>().is_ok()
        || name.eq_ignore_ascii_case("localhost")
        || name.to_ascii_lowercase().ends_with(".localhost")
}

/// Serves on `addr` until the process exits; returns the bound address.
pub fn spawn(addr: SocketAddr, shared: Arc<Shared>) -> anyhow::Result<SocketAddr> {
    let listener = std::net::TcpListener::bind(addr)
        .map_err(|e| anyhow::anyhow!("binding --http {addr}: {e}"))?;
    listener.set_nonblocking(true)?;
    let bound = listener.local_addr()?;
    let app = Router::new()
        .route("/livez", get(livez))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/placement", get(placement))
        .route("/pins", post(pin))
        .route("/cores", get(cores))
        .route("/replication/halted", get(halted))
        .route("/debug/storage-faults", post(storage_faults))
        .route("/debug/panic", post(panic_core))
        .route("/debug/replica-sync", post(replica_sync))
        .route("/debug/hold-opens", post(hold_opens))
        .with_state(shared)
        .layer(axum::middleware::from_fn(deadline));
    let app = if bound.ip().is_loopback() {
        app.layer(axum::middleware::from_fn(loopback_host))
    } else {
        app
    };
    std::thread::Builder::new()
        .name("felix-http".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    tracing::error!(error = %e, "the HTTP endpoint's runtime did not start");
                    return;
                }
            };
            rt.block_on(async move {
                let listener = match tokio::net::TcpListener::from_std(listener) {
                    Ok(l) => l,
                    Err(e) => {
                        tracing::error!(error = %e, "the HTTP endpoint's listener");
                        return;
                    }
                };
                felix_controlplane::bounded::serve(
                    listener,
                    app,
                    felix_controlplane::bounded::ADMIN,
                    std::future::pending(),
                )
                .await;
            });
        })?;
    Ok(bound)
}

/// Every answer within [`ANSWER_TIMEOUT`].
async fn deadline(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    match tokio::time::timeout(ANSWER_TIMEOUT, next.run(req)).await {
        Ok(r) => r,
        Err(_) => (StatusCode::SERVICE_UNAVAILABLE, "timed out\n").into_response(),
    }
}

#[cfg(test)]
mod tests {
    /// Loopback names and IP addresses pass; any other name (a page's own, rebound to
    /// 127.0.0.1) does not.
    #[test]
    fn only_loopback_names_and_addresses_pass() {
        use super::loopback_name;
        for ok in [
            "127.0.0.1:9090",
            "127.0.0.1",
            "[::1]:9090",
            "[::1]",
            "localhost:9090",
            "LocalHost",
            "felix.localhost:9090",
            "10.0.0.7:9090",
        ] {
            assert!(loopback_name(ok), "{ok}");
        }
        for refused in [
            "evil.example:9090",
            "evil.example",
            "localhost.evil.example",
            "",
            "[::1",
        ] {
            assert!(!loopback_name(refused), "{refused}");
        }
    }
}
