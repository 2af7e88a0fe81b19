//! Writing a compare run out: JSON, a Markdown table with ratios against each peer and
//! the targets, and two SVG plots (throughput bars, ack latency percentiles).

use std::fmt::Write as _;

use serde_json::{Value, json};

use crate::compare::Measured;

/// Everything a run measured.
#[derive(Debug)]
pub struct Report {
    /// Machine facts.
    pub machine: Value,
    /// Scenario id, description, durable.
    pub specs: Vec<(&'static str, &'static str, bool)>,
    /// (scenario, broker, result).
    pub results: Vec<(String, String, Result<Measured, String>)>,
    /// Ours-only figures (S13, pinning, S14).
    pub extra: serde_json::Map<String, Value>,
}

const OURS: &str = "felix";
const COLORS: &[&str] = &["#1f77b4", "#d62728", "#2ca02c", "#9467bd"];

/// Whether a scenario is judged by latency (lower is better) rather than throughput.
fn latency_judged(id: &str) -> bool {
    id == "S1" || id == "S1d" || id.starts_with("S12")
}

/// Whether a scenario's headline is deliveries rather than acks.
fn delivery_judged(id: &str) -> bool {
    id == "S2" || id == "S5"
}

/// The number a scenario is judged by.
pub fn headline_of(id: &str, m: &Measured) -> f64 {
    headline(id, m)
}

fn headline(id: &str, m: &Measured) -> f64 {
    if latency_judged(id) {
        m.ack[1]
    } else if delivery_judged(id) {
        m.delivered_per_sec
    } else {
        m.acked_per_sec
    }
}

fn fmt_rate(v: f64) -> String {
    if v >= 1e6 {
        format!("{:.2}M", v / 1e6)
    } else if v >= 1e3 {
        format!("{:.1}k", v / 1e3)
    } else {
        format!("{v:.0}")
    }
}

impl Report {
    fn brokers(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for (_, b, _) in &self.results {
            if !out.contains(b) {
                out.push(b.clone());
            }
        }
        out
    }

    fn get(&self, id: &str, broker: &str) -> Option<&Result<Measured, String>> {
        self.results
            .iter()
            .find(|(i, b, _)| i == id && b == broker)
            .map(|(_, _, r)| r)
    }

    /// Cells that failed (ours-only figures included).
    pub fn failures(&self) -> usize {
        self.results.iter().filter(|(_, _, r)| r.is_err()).count()
            + self
                .extra
                .values()
                .filter(|v| v.get("error").is_some())
                .count()
    }

    /// The JSON document.
    pub fn json(&self) -> Value {
        let cells: Vec<Value> = self
            .results
            .iter()
            .map(|(id, b, r)| match r {
                Ok(m) => json!({
                    "scenario": id, "broker": b,
                    "acked_per_sec": m.acked_per_sec, "mb_per_sec": m.mb_per_sec,
                    "delivered_per_sec": m.delivered_per_sec,
                    "ack_us": {"p50": m.ack[0], "p99": m.ack[1], "p999": m.ack[2]},
                    "e2e_us": m.e2e.map(|e| json!({"p50": e[0], "p99": e[1], "p999": e[2]})),
                    "ack_curve_us": m.curve.iter().map(|(p, v)| json!([p, v])).collect::<Vec<_>>(),
                    "batches_per_fdatasync": m.appends_per_flush,
                    "server_cpu_us_per_msg": m.server_cpu_us,
                    "stages_us": m.stages.iter().map(|(n, p50, p99)| json!({"stage": n, "p50_le": p50, "p99_le": p99})).collect::<Vec<_>>(),
                }),
                Err(e) => json!({"scenario": id, "broker": b, "error": e}),
            })
            .collect();
        json!({
            "machine": self.machine,
            "scenarios": self.specs.iter().map(|(id, what, durable)| json!({"id": id, "what": what, "durable": durable})).collect::<Vec<_>>(),
            "cells": cells,
            "felix_only": self.extra,
        })
    }

    /// The Markdown report.
    pub fn markdown(&self) -> String {
        let m = &self.machine;
        let brokers = self.brokers();
        let peers: Vec<&String> = brokers.iter().filter(|b| *b != OURS).collect();
        let mut s = String::new();
        let _ = writeln!(s, "# felix-bench compare\n");
        let _ = writeln!(
            s,
            "Machine: {} cores ({}), kernel {}, 4 KiB write+fdatasync p50 {:.0} us / p99 {:.0} us. Scale `{}`; our broker on cores `{}`; {}.\n",
            m["cores"],
            m["cpu"].as_str().unwrap_or("?"),
            m["kernel"].as_str().unwrap_or("?"),
            m["fsync_4k_p50_us"].as_f64().unwrap_or(0.0),
            m["fsync_4k_p99_us"].as_f64().unwrap_or(0.0),
            m["scale"].as_str().unwrap_or("?"),
            m["felix_cores"].as_str().unwrap_or("?"),
            match m["load_cores"].as_str() {
                Some(l) => format!(
                    "load generator confined to CPUs `{l}`, every broker (peers included) to `{}`: msgs/s here are per broker core",
                    m["felix_cores"].as_str().unwrap_or("?")
                ),
                None => "load generator in the same machine, on any CPU".to_owned(),
            },
        );
        let _ = writeln!(
            s,
            "Headline per scenario: acked msgs/s; delivered msgs/s for fanout cells (S2, S5); ack p99 in µs for latency cells (S1, S12: lower is better, and the ratio is peer ÷ ours).\n"
        );
        let mut header = "| scenario | what | durable |".to_owned();
        let mut rule = "|---|---|---|".to_owned();
        for b in &brokers {
            header.push_str(&format!(" {b} |"));
            rule.push_str("---|");
        }
        for p in &peers {
            header.push_str(&format!(" felix vs {p} |"));
            rule.push_str("---|");
        }
        let _ = writeln!(s, "{header}\n{rule}");
        for (id, what, durable) in &self.specs {
            let mut row = format!(
                "| {id} | {what} | {} |",
                if *durable { "fsync" } else { "no" }
            );
            for b in &brokers {
                row.push_str(&match self.get(id, b) {
                    Some(Ok(m)) if latency_judged(id) => format!(" {:.0} µs |", headline(id, m)),
                    Some(Ok(m)) => format!(" {} |", fmt_rate(headline(id, m))),
                    Some(Err(e)) => format!(" failed: {} |", e.replace('|', "/")),
                    None => " - |".into(),
                });
            }
            for p in &peers {
                row.push_str(&match (self.get(id, OURS), self.get(id, p)) {
                    (Some(Ok(o)), Some(Ok(q))) => {
                        let (ours, theirs) = (headline(id, o), headline(id, q));
                        let ratio = if latency_judged(id) {
                            theirs / ours
                        } else {
                            ours / theirs
                        };
                        format!(" {ratio:.2}x |")
                    }
                    _ => " - |".into(),
                });
            }
            let _ = writeln!(s, "{row}");
        }
        let _ = writeln!(
            s,
            "\n## Broker CPU per acknowledged message\n\nµs of the broker's threads (schedstat) per acked message, deliveries included; lower is better, the ratio is peer ÷ ours.\n"
        );
        let _ = writeln!(s, "{header}\n{rule}");
        for (id, what, durable) in &self.specs {
            let cpu = |b: &str| match self.get(id, b) {
                Some(Ok(m)) => m.server_cpu_us,
                _ => None,
            };
            let mut row = format!(
                "| {id} | {what} | {} |",
                if *durable { "fsync" } else { "no" }
            );
            for b in &brokers {
                row.push_str(&cpu(b).map_or(" - |".to_owned(), |v| format!(" {v:.1} |")));
            }
            for p in &peers {
                row.push_str(&match (cpu(OURS), cpu(p)) {
                    (Some(o), Some(q)) if o > 0.0 => format!(" {:.2}x |", q / o),
                    _ => " - |".into(),
                });
            }
            let _ = writeln!(s, "{row}");
        }
        let staged: Vec<_> = self
            .results
            .iter()
            .filter_map(|(id, b, r)| Some((id, b, r.as_ref().ok()?)))
            .filter(|(_, _, m)| !m.stages.is_empty())
            .collect();
        if !staged.is_empty() {
            let _ = writeln!(
                s,
                "\n## Where an acknowledgement's time goes (ours)\n\nPer-stage p50 / p99 over each cell from the broker's per-core histograms (µs, upper bound of the bucket: 25, 50, 100, 200, 300, 500, 1000, …). Device write and fdatasync are per flush round (with durable O_DSYNC writes, the broker's default under fsync, the write includes the sync and the fdatasync column is empty); the mesh hop counts cross-core publishes only; written to sent is an answer's (or a delivery's) last step, from its write to the connection's stream to the next datagram that connection sends.\n"
            );
            // In path order, those any cell saw.
            let names: Vec<&str> = crate::drivers::STAGES
                .iter()
                .copied()
                .filter(|n| {
                    staged
                        .iter()
                        .any(|(_, _, m)| m.stages.iter().any(|x| x.0 == *n))
                })
                .collect();
            let _ = writeln!(s, "| scenario | {} |", names.join(" | "));
            let _ = writeln!(s, "|---|{}", "---|".repeat(names.len()));
            for (id, _, m) in staged {
                let cells: Vec<String> = names
                    .iter()
                    .map(|n| {
                        m.stages
                            .iter()
                            .find(|x| x.0 == *n)
                            .map_or("-".to_owned(), |x| format!("≤{} / ≤{}", x.1, x.2))
                    })
                    .collect();
                let _ = writeln!(s, "| {id} | {} |", cells.join(" | "));
            }
        }
        let _ = writeln!(s, "\n## Every cell\n");
        let _ = writeln!(
            s,
            "| scenario | broker | acked msgs/s | MB/s | delivered msgs/s | ack p50 / p99 / p999 µs | e2e p50 / p99 / p999 µs | batches per sync | broker CPU µs/msg |"
        );
        let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|");
        for (id, b, r) in &self.results {
            match r {
                Ok(m) => {
                    let e2e = m.e2e.map_or("-".to_owned(), |e| {
                        format!("{:.0} / {:.0} / {:.0}", e[0], e[1], e[2])
                    });
                    let apf = m
                        .appends_per_flush
                        .map_or("-".to_owned(), |v| format!("{v:.1}"));
                    let cpu = m
                        .server_cpu_us
                        .map_or("-".to_owned(), |v| format!("{v:.1}"));
                    let _ = writeln!(
                        s,
                        "| {id} | {b} | {:.0} | {:.1} | {:.0} | {:.0} / {:.0} / {:.0} | {e2e} | {apf} | {cpu} |",
                        m.acked_per_sec,
                        m.mb_per_sec,
                        m.delivered_per_sec,
                        m.ack[0],
                        m.ack[1],
                        m.ack[2]
                    );
                }
                Err(e) => {
                    let _ = writeln!(
                        s,
                        "| {id} | {b} | failed: {} | | | | | | |",
                        e.replace('|', "/")
                    );
                }
            }
        }
        let _ = writeln!(s, "\n## Ours only\n");
        for (k, v) in &self.extra {
            if let Some(e) = v.get("error") {
                let _ = writeln!(s, "- {k}: failed: {}", e.as_str().unwrap_or("?"));
            }
        }
        let ok = |k: &str| self.extra.get(k).filter(|v| v.get("error").is_none());
        if let Some(v) = ok("S13") {
            let _ = writeln!(
                s,
                "- S13 scaling (S3 load, 2 producers on 2 streams): 1 core {} msgs/s, 2 cores {} msgs/s: {:.2}x.",
                fmt_rate(v["cores_0"].as_f64().unwrap_or(0.0)),
                fmt_rate(v["cores_0-1"].as_f64().unwrap_or(0.0)),
                v["ratio"].as_f64().unwrap_or(0.0)
            );
        }
        if let Some(v) = ok("pinning") {
            let _ = writeln!(
                s,
                "- Pinning sweep (2 hot streams, S3 load): placement by hash {} msgs/s; both pinned to core 0 {} msgs/s.",
                fmt_rate(v["hashed"].as_f64().unwrap_or(0.0)),
                fmt_rate(v["all_on_core_0"].as_f64().unwrap_or(0.0))
            );
            let live = &v["live_repin"];
            if live["before_msgs_per_sec"].is_number() {
                let _ = writeln!(
                    s,
                    "- Live re-pin (2 streams on core 0, one moved to core 1 under load): {} msgs/s before, {} after ({:.2}x); ack p99 {:.0} µs before, {:.0} µs during the move ({:.1} ms, requests held {:.1} ms: barriers {:.1}, old core finishing and closing {:.1}, new core opening {:.1}).",
                    fmt_rate(live["before_msgs_per_sec"].as_f64().unwrap_or(0.0)),
                    fmt_rate(live["after_msgs_per_sec"].as_f64().unwrap_or(0.0)),
                    live["after_msgs_per_sec"].as_f64().unwrap_or(0.0)
                        / live["before_msgs_per_sec"].as_f64().unwrap_or(1.0).max(1.0),
                    live["before_p99_us"].as_f64().unwrap_or(0.0),
                    live["during_move_p99_us"].as_f64().unwrap_or(0.0),
                    live["move_ms"].as_f64().unwrap_or(0.0),
                    live["hold_ms"].as_f64().unwrap_or(0.0),
                    live["flush_ms"].as_f64().unwrap_or(0.0),
                    live["release_ms"].as_f64().unwrap_or(0.0),
                    live["take_ms"].as_f64().unwrap_or(0.0)
                );
            }
        }
        if let Some(v) = ok("S11") {
            let _ = writeln!(
                s,
                "- S11 QUIC transport ceiling (1 connection, 64 KiB writes): client to server, our driver {:.0} MB/s, quinn/tokio {:.0} MB/s ({:.2}x); server to client {:.0} vs {:.0} MB/s ({:.2}x); 64 B RTT p50 {:.0} µs.",
                v["felix_mb_per_sec"].as_f64().unwrap_or(0.0),
                v["quinn_mb_per_sec"].as_f64().unwrap_or(0.0),
                v["ratio"].as_f64().unwrap_or(0.0),
                v["felix_download_mb_per_sec"].as_f64().unwrap_or(0.0),
                v["quinn_download_mb_per_sec"].as_f64().unwrap_or(0.0),
                v["download_ratio"].as_f64().unwrap_or(0.0),
                v["felix_rtt_p50_us"].as_f64().unwrap_or(0.0)
            );
        }
        if let Some(v) = ok("S14") {
            let _ = writeln!(
                s,
                "- S14 recovery: restart over {:.1} MB of log and reopen the shard in {:.3} s ({:.0} MB/s, broker start included).",
                v["bytes"].as_f64().unwrap_or(0.0) / 1e6,
                v["seconds"].as_f64().unwrap_or(0.0),
                v["mb_per_sec"].as_f64().unwrap_or(0.0)
            );
        }
        let _ = writeln!(s, "\n## Targets (issues 8 and 18)\n");
        for line in self.targets() {
            let _ = writeln!(s, "- {line}");
        }
        s
    }

    /// Each target: met or missed, and by how much.
    pub fn targets(&self) -> Vec<String> {
        let mut out = Vec::new();
        let show = |v: f64| {
            if v < 100.0 {
                format!("{v:.2}")
            } else {
                fmt_rate(v)
            }
        };
        let mut check = |what: String, got: Option<f64>, want: f64, higher: bool| {
            let Some(got) = got else {
                out.push(format!("{what}: not measured"));
                return;
            };
            let met = if higher { got >= want } else { got <= want };
            let by = if higher { got / want } else { want / got };
            out.push(format!(
                "{what}: {} (got {}, target {}; {:.2}x of target)",
                if met { "met" } else { "MISSED" },
                show(got),
                show(want),
                by
            ));
        };
        let ours = |id: &str, f: fn(&Measured) -> f64| match self.get(id, OURS) {
            Some(Ok(m)) => Some(f(m)),
            _ => None,
        };
        check(
            "S3 acked msgs/s ≥ 550k".into(),
            ours("S3", |m| m.acked_per_sec),
            550e3,
            true,
        );
        check(
            "S5 delivered msgs/s ≥ 1.4M".into(),
            ours("S5", |m| m.delivered_per_sec),
            1.4e6,
            true,
        );
        check(
            "S7 durable msgs/s ≥ 180k".into(),
            ours("S7", |m| m.acked_per_sec),
            180e3,
            true,
        );
        check(
            "S1 ack p99 ≤ 200 µs".into(),
            ours("S1", |m| m.ack[1]),
            200.0,
            false,
        );
        // Issue 18: S1 against the same run's raw QUIC echo (S11), and its broker CPU.
        let rtt = |key: &str| self.extra.get("S11").and_then(|v| v[key].as_f64());
        let s1 = |i: usize| match self.get("S1", OURS) {
            Some(Ok(m)) => Some(m.ack[i]),
            _ => None,
        };
        check(
            "S1 ack p50 ≤ 1.5x the S11 64 B echo RTT p50 (issue 18)".into(),
            s1(0).zip(rtt("felix_rtt_p50_us")).map(|(a, r)| a / r),
            1.5,
            false,
        );
        check(
            "S1 ack p99 ≤ 2x the S11 64 B echo RTT p99 (issue 18)".into(),
            s1(1).zip(rtt("felix_rtt_p99_us")).map(|(a, r)| a / r),
            2.0,
            false,
        );
        // The durable one at a time: one round trip plus one device write and sync.
        let bound = rtt("felix_rtt_p50_us")
            .zip(self.machine["fsync_4k_p50_us"].as_f64())
            .map(|(r, f)| r + f + 50.0);
        let s1d = match self.get("S1d", OURS) {
            Some(Ok(m)) => Some(m.ack[0]),
            _ => None,
        };
        check(
            "S1d (fsync before ack) ack p50 ≤ the S11 echo RTT p50 + the run's 4 KiB write+fdatasync p50 + 50 µs (issue 18)".into(),
            bound.and(s1d),
            bound.unwrap_or(0.0),
            false,
        );
        let cpu = |peer: &str| match self.get("S1", peer) {
            Some(Ok(m)) => m.server_cpu_us,
            _ => None,
        };
        check(
            "S1 broker CPU per ack ≤ 100 µs (issue 18)".into(),
            cpu(OURS),
            100.0,
            false,
        );
        for peer in ["nats-jetstream", "redis-streams"] {
            check(
                format!("S1 broker CPU per ack, ours ÷ {peer}'s ≤ 1 (issue 18)"),
                cpu(OURS).zip(cpu(peer)).map(|(o, p)| o / p),
                1.0,
                false,
            );
        }
        let s8 = match (self.get("S8", OURS), self.get("S8", "redis-streams")) {
            (Some(Ok(o)), Some(Ok(p))) => Some(o.acked_per_sec / p.acked_per_sec),
            _ => None,
        };
        check(
            "S8 vs redis-streams ≥ 1.5x (issue 18)".into(),
            s8,
            1.5,
            true,
        );
        let s13 = self.extra.get("S13").and_then(|v| v["ratio"].as_f64());
        check("S13 2 cores ≥ 1.8x 1 core".into(), s13, 1.8, true);
        for (peer, want) in [("redis-streams", 3.0), ("nats-jetstream", 10.0)] {
            for id in ["S6", "S7", "S8"] {
                let ratio = match (self.get(id, OURS), self.get(id, peer)) {
                    (Some(Ok(o)), Some(Ok(p))) => Some(o.acked_per_sec / p.acked_per_sec),
                    _ => None,
                };
                check(format!("{id} vs {peer} ≥ {want}x"), ratio, want, true);
            }
        }
        out
    }

    /// Grouped bars of each throughput scenario's headline, log scale.
    pub fn throughput_svg(&self) -> String {
        let brokers = self.brokers();
        let ids: Vec<&str> = self
            .specs
            .iter()
            .map(|(id, _, _)| *id)
            .filter(|id| !latency_judged(id))
            .collect();
        let (w, h, left, bottom, top) = (900.0, 420.0, 70.0, 60.0, 40.0);
        let plot_h = h - bottom - top;
        let group = (w - left - 20.0) / ids.len().max(1) as f64;
        let bar = group * 0.8 / brokers.len().max(1) as f64;
        let (lo, hi) = (3.0f64, 7.0f64); // 1k .. 10M msgs/s
        let y =
            |v: f64| top + plot_h * (1.0 - ((v.max(1.0).log10() - lo) / (hi - lo)).clamp(0.0, 1.0));
        let mut s = format!(
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
        );
        let _ = write!(
            s,
            r#"<text x="{left}" y="20" font-size="14">msgs/s per scenario (acked; delivered for S2, S5), log scale</text>"#
        );
        for e in 3..=7 {
            let yy = y(10f64.powi(e));
            let _ = write!(
                s,
                r##"<line x1="{left}" x2="{}" y1="{yy}" y2="{yy}" stroke="#ddd"/><text x="{}" y="{}" text-anchor="end">{}</text>"##,
                w - 20.0,
                left - 6.0,
                yy + 4.0,
                fmt_rate(10f64.powi(e))
            );
        }
        for (gi, id) in ids.iter().enumerate() {
            let gx = left + gi as f64 * group + group * 0.1;
            for (bi, b) in brokers.iter().enumerate() {
                if let Some(Ok(m)) = self.get(id, b) {
                    let v = headline(id, m);
                    let x = gx + bi as f64 * bar;
                    let yy = y(v);
                    let _ = write!(
                        s,
                        r#"<rect x="{x:.1}" y="{yy:.1}" width="{:.1}" height="{:.1}" fill="{}"><title>{id} {b}: {}</title></rect>"#,
                        bar - 2.0,
                        top + plot_h - yy,
                        COLORS[bi % COLORS.len()],
                        fmt_rate(v)
                    );
                }
            }
            let _ = write!(
                s,
                r#"<text x="{:.1}" y="{}" text-anchor="middle">{id}</text>"#,
                gx + group * 0.4,
                h - bottom + 18.0
            );
        }
        for (bi, b) in brokers.iter().enumerate() {
            let x = left + bi as f64 * 160.0;
            let _ = write!(
                s,
                r#"<rect x="{x}" y="{}" width="12" height="12" fill="{}"/><text x="{}" y="{}">{b}</text>"#,
                h - 24.0,
                COLORS[bi % COLORS.len()],
                x + 16.0,
                h - 14.0
            );
        }
        s.push_str("</svg>\n");
        s
    }

    /// Ack latency by percentile for S1 and S12b, log scale.
    pub fn latency_svg(&self) -> String {
        let brokers = self.brokers();
        let panels = ["S1", "S12b"];
        let (w, h, top, bottom) = (900.0, 380.0, 40.0, 60.0);
        let pw = w / panels.len() as f64;
        let plot_h = h - top - bottom;
        let (lo, hi) = (1.0f64, 6.0f64); // 10 µs .. 1 s
        let y =
            |v: f64| top + plot_h * (1.0 - ((v.max(1.0).log10() - lo) / (hi - lo)).clamp(0.0, 1.0));
        let mut s = format!(
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
        );
        for (pi, id) in panels.iter().enumerate() {
            let x0 = pi as f64 * pw + 60.0;
            let pw_in = pw - 80.0;
            let _ = write!(
                s,
                r#"<text x="{x0}" y="20" font-size="14">{id}: ack latency (µs) by percentile</text>"#
            );
            for e in 1..=6 {
                let yy = y(10f64.powi(e));
                let _ = write!(
                    s,
                    r##"<line x1="{x0}" x2="{}" y1="{yy}" y2="{yy}" stroke="#ddd"/><text x="{}" y="{}" text-anchor="end">{}</text>"##,
                    x0 + pw_in,
                    x0 - 4.0,
                    yy + 4.0,
                    fmt_rate(10f64.powi(e))
                );
            }
            let labels = ["p50", "p75", "p90", "p95", "p99", "p99.5", "p99.9", "max"];
            let xs = |i: usize| x0 + pw_in * i as f64 / (labels.len() - 1) as f64;
            for (i, l) in labels.iter().enumerate() {
                let _ = write!(
                    s,
                    r#"<text x="{:.1}" y="{}" text-anchor="middle">{l}</text>"#,
                    xs(i),
                    h - bottom + 16.0
                );
            }
            for (bi, b) in brokers.iter().enumerate() {
                if let Some(Ok(m)) = self.get(id, b) {
                    let pts: Vec<String> = m
                        .curve
                        .iter()
                        .enumerate()
                        .map(|(i, (_, v))| format!("{:.1},{:.1}", xs(i), y(*v)))
                        .collect();
                    let _ = write!(
                        s,
                        r#"<polyline fill="none" stroke="{}" stroke-width="2" points="{}"/>"#,
                        COLORS[bi % COLORS.len()],
                        pts.join(" ")
                    );
                }
            }
        }
        for (bi, b) in brokers.iter().enumerate() {
            let x = 60.0 + bi as f64 * 160.0;
            let _ = write!(
                s,
                r#"<rect x="{x}" y="{}" width="12" height="12" fill="{}"/><text x="{}" y="{}">{b}</text>"#,
                h - 24.0,
                COLORS[bi % COLORS.len()],
                x + 16.0,
                h - 14.0
            );
        }
        s.push_str("</svg>\n");
        s
    }
}
