//! `felix pin` and `felix top`: a broker's operator HTTP endpoint (`felix-broker
//! --http`), not the client protocol.
//!
//! `top` is a pure view over two `/cores` samples ([`view`]) and a loop that fetches,
//! renders and redraws each second; the view is tested without a terminal.

use std::collections::BTreeMap;
use std::io::{Read as _, Write as _};
use std::time::Duration;

use serde::Deserialize;

/// How long one HTTP exchange with the broker may take.
const HTTP_TIMEOUT: Duration = Duration::from_secs(10);

/// Why an operator call failed, with the `felix` exit code it maps to: the scale every
/// other command uses (`cli`'s module docs). Until 2026-12-08 `felix pin` and `felix
/// top` exited 1 for every failure, a broker that was down and a rule it refused alike.
#[derive(Debug)]
pub struct OpsError {
    /// The exit code: 2 refused as malformed, 3 unreachable (or stopping), 4 refused
    /// credentials, 5 not found, 6 any other failure, 7 timed out, 8 output not
    /// written.
    pub code: i32,
    /// What to tell the operator.
    pub message: String,
}

impl std::fmt::Display for OpsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for OpsError {}

impl OpsError {
    /// The exchange with `addr` failed.
    fn io(addr: &str, e: std::io::Error) -> Self {
        use std::io::ErrorKind::{TimedOut, WouldBlock};
        let code = if matches!(e.kind(), TimedOut | WouldBlock) {
            7
        } else {
            3
        };
        Self {
            code,
            message: format!("{addr}: {e}"),
        }
    }

    /// The broker answered something this does not read.
    fn answer(message: String) -> Self {
        Self { code: 6, message }
    }

    /// The broker refused with `status`.
    fn refused(status: u16, message: String) -> Self {
        let code = match status {
            400 | 413 | 422 => 2,
            401 | 403 => 4,
            404 => 5,
            503 => 3,
            _ => 6,
        };
        Self { code, message }
    }
}

/// `METHOD path` with an optional JSON body on a broker's operator endpoint (plain
/// HTTP/1.1): `(status, body)`.
pub fn http(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> Result<(u16, String), OpsError> {
    use std::net::ToSocketAddrs as _;
    let io = |e| OpsError::io(addr, e);
    let sock = addr
        .to_socket_addrs()
        .map_err(|e| OpsError {
            code: 2,
            message: format!("{addr}: {e}"),
        })?
        .next()
        .ok_or_else(|| OpsError {
            code: 2,
            message: format!("{addr}: no address"),
        })?;
    let mut s = std::net::TcpStream::connect_timeout(&sock, HTTP_TIMEOUT).map_err(io)?;
    s.set_read_timeout(Some(HTTP_TIMEOUT)).ok();
    s.set_write_timeout(Some(HTTP_TIMEOUT)).ok();
    let body = body.unwrap_or("");
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .map_err(io)?;
    let mut text = Vec::new();
    s.read_to_end(&mut text).map_err(io)?;
    let split = text
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| OpsError::answer(format!("{addr}: not an HTTP answer")))?;
    let (head, rest) = (String::from_utf8_lossy(&text[..split]), &text[split + 4..]);
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| OpsError::answer(format!("{addr}: not an HTTP answer")))?;
    let chunked = head.lines().any(|l| {
        l.to_ascii_lowercase()
            .starts_with("transfer-encoding: chunked")
    });
    let body = if chunked {
        dechunk(rest)
    } else {
        rest.to_vec()
    };
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

/// Joins a chunked body's chunks. On bytes, not text: a chunk may end inside a
/// character.
fn dechunk(mut s: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = s.windows(2).position(|w| w == b"\r\n") {
        let size = String::from_utf8_lossy(&s[..eol]);
        // A chunk size may carry extensions after a `;`.
        let size = size.split(';').next().unwrap_or_default().trim();
        let Ok(n) = usize::from_str_radix(size, 16) else {
            break;
        };
        let rest = &s[eol + 2..];
        if n == 0 || rest.len() < n {
            break;
        }
        out.extend_from_slice(&rest[..n]);
        s = &rest[n..];
        if s.starts_with(b"\r\n") {
            s = &s[2..];
        }
    }
    out
}

/// One `/cores` answer.
#[derive(Debug, Clone, Deserialize)]
pub struct Sample {
    /// Wall clock at the broker, ms.
    pub now_ms: u64,
    /// Upper bounds of the latency buckets, µs.
    pub bounds_us: Vec<u64>,
    /// Per core.
    pub cores: Vec<CoreSample>,
}

/// One core in a [`Sample`].
#[derive(Debug, Clone, Deserialize)]
pub struct CoreSample {
    /// Index.
    pub core: usize,
    /// Thread CPU time, ns.
    pub cpu_ns: u64,
    /// Records appended.
    pub publish_records: u64,
    /// Connections.
    pub connections: u64,
    /// Subscriptions.
    pub subscriptions: u64,
    /// Batches waiting in subscriber queues.
    pub subscriber_queued: u64,
    /// Cross-core messages sent.
    pub mesh_sent: u64,
    /// Append-to-commit latency (the device write and fsync) per bucket.
    pub append_commit_buckets: Vec<u64>,
    /// Open shards.
    pub shards: Vec<ShardSample>,
}

/// One open shard in a [`CoreSample`].
#[derive(Debug, Clone, Deserialize)]
pub struct ShardSample {
    /// Its name.
    pub shard: String,
    /// Where its log ends.
    pub end: u64,
}

/// One row of the per-core table.
#[derive(Debug, Clone, PartialEq)]
pub struct CoreRow {
    /// Core.
    pub core: usize,
    /// Busy %, from the thread's CPU time.
    pub busy_pct: f64,
    /// Records appended per second.
    pub msgs_per_s: f64,
    /// Open shards.
    pub shards: usize,
    /// Connections.
    pub connections: u64,
    /// Subscriptions.
    pub subscriptions: u64,
    /// Batches in subscriber queues.
    pub queued: u64,
    /// p99 of append-to-commit over the interval, µs (the bucket's upper bound).
    pub commit_p99_us: Option<u64>,
    /// Cross-core messages sent per second.
    pub mesh_per_s: f64,
}

/// One hot shard.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardRow {
    /// Name.
    pub shard: String,
    /// Its core.
    pub core: usize,
    /// Offsets written per second.
    pub per_s: f64,
}

/// What `felix top` shows for the interval between two samples.
#[derive(Debug, Clone, PartialEq)]
pub struct View {
    /// One row per core.
    pub cores: Vec<CoreRow>,
    /// Shards by rate, hottest first.
    pub hot: Vec<ShardRow>,
    /// Advice: pins that would spread hot shards sharing a core.
    pub suggestions: Vec<String>,
}

/// The upper bound of the bucket holding the 99th percentile of `after - before`.
fn p99(bounds: &[u64], before: &[u64], after: &[u64]) -> Option<u64> {
    let delta: Vec<u64> = after
        .iter()
        .zip(before.iter().chain(std::iter::repeat(&0)))
        .map(|(a, b)| a.saturating_sub(*b))
        .collect();
    let total: u64 = delta.iter().sum();
    if total == 0 {
        return None;
    }
    let want = total - total / 100;
    let mut seen = 0;
    for (i, n) in delta.iter().enumerate() {
        seen += n;
        if seen >= want {
            return Some(bounds.get(i).copied().unwrap_or(u64::MAX));
        }
    }
    None
}

/// The view of the interval from `before` to `after`.
pub fn view(before: &Sample, after: &Sample) -> View {
    let secs = (after.now_ms.saturating_sub(before.now_ms) as f64 / 1e3).max(1e-3);
    let mut cores = Vec::new();
    let mut hot = Vec::new();
    let ends: BTreeMap<&str, u64> = before
        .cores
        .iter()
        .flat_map(|c| c.shards.iter().map(|s| (s.shard.as_str(), s.end)))
        .collect();
    for c in &after.cores {
        let b = before.cores.iter().find(|x| x.core == c.core);
        let d = |f: fn(&CoreSample) -> u64| c_delta(b, c, f);
        cores.push(CoreRow {
            core: c.core,
            busy_pct: (d(|x| x.cpu_ns) as f64 / 1e9 / secs * 100.0).min(100.0),
            msgs_per_s: d(|x| x.publish_records) as f64 / secs,
            shards: c.shards.len(),
            connections: c.connections,
            subscriptions: c.subscriptions,
            queued: c.subscriber_queued,
            commit_p99_us: p99(
                &after.bounds_us,
                b.map_or(&[][..], |b| &b.append_commit_buckets[..]),
                &c.append_commit_buckets,
            ),
            mesh_per_s: d(|x| x.mesh_sent) as f64 / secs,
        });
        for s in &c.shards {
            // A shard that just moved here counts from its end at the old core.
            let was = ends.get(s.shard.as_str()).copied().unwrap_or(s.end);
            hot.push(ShardRow {
                shard: s.shard.clone(),
                core: c.core,
                per_s: s.end.saturating_sub(was) as f64 / secs,
            });
        }
    }
    hot.sort_by(|a, b| b.per_s.total_cmp(&a.per_s).then(a.shard.cmp(&b.shard)));
    let suggestions = suggest(&cores, &hot);
    View {
        cores,
        hot,
        suggestions,
    }
}

fn c_delta(before: Option<&CoreSample>, after: &CoreSample, f: fn(&CoreSample) -> u64) -> u64 {
    f(after).saturating_sub(before.map_or(f(after), f))
}

/// A shard rate worth moving for (records/s).
const HOT_PER_S: f64 = 1_000.0;

/// When two hot shards share a core while another core is idle-ish, suggest pinning
/// the second one there (advice only; nothing is changed).
fn suggest(cores: &[CoreRow], hot: &[ShardRow]) -> Vec<String> {
    let mut out = Vec::new();
    let mut load: BTreeMap<usize, f64> = cores.iter().map(|c| (c.core, c.busy_pct)).collect();
    let mut seen_on: BTreeMap<usize, usize> = BTreeMap::new();
    for s in hot.iter().filter(|s| s.per_s >= HOT_PER_S) {
        let n = seen_on.entry(s.core).or_default();
        *n += 1;
        if *n < 2 {
            continue;
        }
        let Some((&idle, &busy)) = load.iter().min_by(|a, b| a.1.total_cmp(b.1)) else {
            continue;
        };
        if idle == s.core || busy >= 50.0 {
            continue;
        }
        // `stream:tenant/ns/name/shard` -> `tenant/ns/name/shard=core`.
        let pattern = s.shard.split_once(':').map_or(s.shard.as_str(), |x| x.1);
        out.push(format!("felix pin {pattern}={idle}"));
        *load.entry(idle).or_default() += 50.0;
    }
    out
}

/// The view as terminal text, `width` columns wide at most.
pub fn render(v: &View, broker: &str, width: usize) -> String {
    let mut out = String::new();
    let line = |out: &mut String, s: String| {
        let s: String = s.chars().take(width).collect();
        out.push_str(&s);
        out.push('\n');
    };
    line(
        &mut out,
        format!("felix top — {broker}   (q or Ctrl-C to quit)"),
    );
    line(&mut out, String::new());
    line(
        &mut out,
        format!(
            "{:>4} {:>6} {:>11} {:>6} {:>5} {:>5} {:>7} {:>11} {:>10}",
            "CORE", "BUSY%", "MSGS/S", "SHARDS", "CONNS", "SUBS", "QUEUED", "FSYNC p99", "XCORE/S"
        ),
    );
    for c in &v.cores {
        let p99 = c.commit_p99_us.map_or("-".to_owned(), |u| match u {
            u64::MAX => ">1s".to_owned(),
            u if u >= 1000 => format!("≤{}ms", u / 1000),
            u => format!("≤{u}µs"),
        });
        line(
            &mut out,
            format!(
                "{:>4} {:>6.1} {:>11.0} {:>6} {:>5} {:>5} {:>7} {:>11} {:>10.0}",
                c.core,
                c.busy_pct,
                c.msgs_per_s,
                c.shards,
                c.connections,
                c.subscriptions,
                c.queued,
                p99,
                c.mesh_per_s
            ),
        );
    }
    line(&mut out, String::new());
    line(&mut out, "HOTTEST SHARDS".to_owned());
    for s in v.hot.iter().take(8) {
        line(
            &mut out,
            format!("  {:>10.0}/s  core {:<3} {}", s.per_s, s.core, s.shard),
        );
    }
    if !v.suggestions.is_empty() {
        line(&mut out, String::new());
        line(&mut out, "SUGGESTED PINS (advice only)".to_owned());
        for s in &v.suggestions {
            line(&mut out, format!("  {s}"));
        }
    }
    out
}

/// Fetches one sample.
pub fn sample(addr: &str) -> Result<Sample, OpsError> {
    let (status, body) = http(addr, "GET", "/cores", None)?;
    if status != 200 {
        let m = format!("{addr}/cores: HTTP {status}: {}", body.trim());
        return Err(OpsError::refused(status, m));
    }
    serde_json::from_str(&body).map_err(|e| OpsError::answer(format!("{addr}/cores: {e}")))
}

/// `felix pin RULE`: applies it, prints what moved.
pub fn pin(addr: &str, rule: &str, json: bool) -> Result<(), OpsError> {
    use std::fmt::Write as _;
    let body = serde_json::json!({ "rule": rule }).to_string();
    let (status, answer) = http(addr, "POST", "/pins", Some(&body))?;
    let mut text = String::new();
    match status {
        200 if !json => {
            let v: serde_json::Value = serde_json::from_str(&answer)
                .map_err(|e| OpsError::answer(format!("{addr}/pins: {e}")))?;
            let moved = v["moved"].as_array().cloned().unwrap_or_default();
            let _ = writeln!(
                text,
                "pinned {} (placement version {}): {} shard(s) moved, requests held {:.1} ms",
                v["rule"].as_str().unwrap_or(rule),
                v["version"],
                moved.len(),
                v["hold_ms"].as_f64().unwrap_or(0.0)
            );
            for m in moved {
                let _ = writeln!(
                    text,
                    "  {} core {} -> {}",
                    m[0].as_str().unwrap_or("?"),
                    m[1],
                    m[2]
                );
            }
        }
        200 | 202 => {
            let _ = writeln!(text, "{}", answer.trim());
        }
        _ => {
            return Err(OpsError::refused(
                status,
                format!("pin refused (HTTP {status}): {}", answer.trim()),
            ));
        }
    }
    let mut out = std::io::stdout().lock();
    written(out.write_all(text.as_bytes()).and_then(|()| out.flush()))
}

/// What could not be written out: exit 8, as the other commands (`println!` panicked
/// on a closed output, exit 101, and `felix top` went on drawing into it for good,
/// until 2026-12-08).
fn written(r: std::io::Result<()>) -> Result<(), OpsError> {
    r.map_err(|e| OpsError {
        code: 8,
        message: format!("writing out: {e}"),
    })
}

/// `felix top`: redraws each `interval` until `q`/Ctrl-C (or `iterations` frames).
pub fn top(addr: &str, interval: Duration, iterations: Option<u64>) -> Result<(), OpsError> {
    use std::io::IsTerminal as _;
    let tty = std::io::stdout().is_terminal();
    let width = terminal_width().unwrap_or(120);
    let mut before = sample(addr)?;
    let mut frames = 0u64;
    let quit = spawn_quit_watch(tty);
    loop {
        std::thread::sleep(interval);
        let after = sample(addr)?;
        let text = render(&view(&before, &after), addr, width);
        let mut out = std::io::stdout().lock();
        written(
            if tty {
                // Home, clear, draw.
                write!(out, "\x1b[H\x1b[2J{}", text.replace('\n', "\r\n"))
            } else {
                writeln!(out, "{text}")
            }
            .and_then(|()| out.flush()),
        )?;
        before = after;
        frames += 1;
        if iterations.is_some_and(|n| frames >= n)
            || quit
                .as_ref()
                .is_some_and(|q| q.load(std::sync::atomic::Ordering::Relaxed))
        {
            return Ok(());
        }
    }
}

fn terminal_width() -> Option<usize> {
    let mut ws = libc::winsize {
        ws_row: 0,
        ws_col: 0,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCGWINSZ fills the winsize `ws` points to; a failure is checked.
    let r = unsafe { libc::ioctl(1, libc::TIOCGWINSZ, &mut ws) };
    (r == 0 && ws.ws_col > 0).then_some(ws.ws_col as usize)
}

/// On a terminal, a thread that sets the flag when `q` is typed (the terminal stays
/// in line mode: `q` then Enter; Ctrl-C ends the process as usual).
fn spawn_quit_watch(tty: bool) -> Option<std::sync::Arc<std::sync::atomic::AtomicBool>> {
    if !tty {
        return None;
    }
    let flag = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let f = flag.clone();
    std::thread::spawn(move || {
        let mut line = String::new();
        while std::io::stdin().read_line(&mut line).is_ok_and(|n| n > 0) {
            if line.trim() == "q" {
                f.store(true, std::sync::atomic::Ordering::Relaxed);
                return;
            }
            line.clear();
        }
    });
    Some(flag)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn core(i: usize, cpu_ns: u64, records: u64, shards: &[(&str, u64)]) -> CoreSample {
        CoreSample {
            core: i,
            cpu_ns,
            publish_records: records,
            connections: 1,
            subscriptions: 0,
            subscriber_queued: 0,
            mesh_sent: records / 2,
            append_commit_buckets: vec![records, 0, 0],
            shards: shards
                .iter()
                .map(|(s, e)| ShardSample {
                    shard: (*s).to_owned(),
                    end: *e,
                })
                .collect(),
        }
    }

    #[test]
    fn rates_come_from_two_samples_and_hot_shards_sharing_a_core_get_a_suggestion() {
        let bounds = vec![25, 50];
        let before = Sample {
            now_ms: 1_000,
            bounds_us: bounds.clone(),
            cores: vec![
                core(0, 0, 0, &[("stream:t/d/a/0", 0), ("stream:t/d/b/0", 0)]),
                core(1, 0, 0, &[]),
            ],
        };
        let after = Sample {
            now_ms: 2_000,
            bounds_us: bounds,
            cores: vec![
                core(
                    0,
                    900_000_000,
                    30_000,
                    &[("stream:t/d/a/0", 20_000), ("stream:t/d/b/0", 10_000)],
                ),
                core(1, 10_000_000, 0, &[]),
            ],
        };
        let v = view(&before, &after);
        assert_eq!(v.cores[0].msgs_per_s, 30_000.0);
        assert!((v.cores[0].busy_pct - 90.0).abs() < 1e-9);
        assert!((v.cores[1].busy_pct - 1.0).abs() < 1e-9);
        assert_eq!(v.cores[0].commit_p99_us, Some(25));
        assert_eq!(v.cores[1].commit_p99_us, None);
        assert_eq!(v.hot[0].shard, "stream:t/d/a/0");
        assert_eq!(v.hot[1].per_s, 10_000.0);
        assert_eq!(v.suggestions, vec!["felix pin t/d/b/0=1".to_owned()]);
        let text = render(&v, "127.0.0.1:1", 200);
        assert!(text.contains("SUGGESTED PINS"), "{text}");
        assert_eq!(text.lines().filter(|l| l.starts_with("   0 ")).count(), 1);
    }

    #[test]
    fn p99_is_the_bucket_holding_the_99th_percentile_of_the_interval() {
        let bounds = [10, 20, 30];
        assert_eq!(p99(&bounds, &[5, 0, 0, 0], &[5, 99, 1, 0]), Some(20));
        assert_eq!(p99(&bounds, &[0, 0, 0, 0], &[0, 0, 0, 3]), Some(u64::MAX));
        assert_eq!(p99(&bounds, &[1, 1, 1, 1], &[1, 1, 1, 1]), None);
    }

    #[test]
    fn chunked_bodies_are_joined() {
        assert_eq!(dechunk(b"4\r\nabcd\r\n3\r\nefg\r\n0\r\n\r\n"), b"abcdefg");
        // "\u{e9}" (two bytes) sent a byte a chunk: each chunk ends inside the
        // character, which text slicing panicked on.
        assert_eq!(
            dechunk(b"1\r\n\xc3\r\n1;ext=1\r\n\xa9\r\n0\r\n\r\n"),
            "\u{e9}".as_bytes()
        );
    }
}
