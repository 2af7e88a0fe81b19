//! `felix-log`: inspect and exercise a segment log directory.
//!
//! - `dump`: print records as JSON lines (read-only).
//! - `verify`: run recovery read-only, checksum every batch, check offsets are
//!   contiguous, and report what a broker's open would repair; exit 1 on corruption.
//! - `write`: append deterministic records until killed or a count is reached, printing
//!   one `{"ack":first,"end":end}` line per acknowledged batch, flushed as it happens.
//!   The crash test kills it mid-append and checks every acknowledged record survives.
//!
//! Output is JSON lines on stdout; diagnostics go to stderr.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, bail};
use clap::{Parser, Subcommand, ValueEnum};
use felix_storage_uring::{
    DmaBackend, FsyncMode, LogConfig, SegmentLog, StorageError, VerifyOnOpen, memlock,
};
use serde_json::json;

#[derive(Parser)]
#[command(
    name = "felix-log",
    about = "Inspect and exercise a Felix segment log directory"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum PayloadFormat {
    /// Only the length.
    Len,
    /// Hex.
    Hex,
    /// UTF-8 (lossy).
    Utf8,
}

#[derive(Subcommand)]
enum Command {
    /// Print records as JSON lines.
    Dump {
        /// The log directory.
        #[arg(long)]
        dir: PathBuf,
        /// First offset (default: the oldest retained).
        #[arg(long)]
        from: Option<u64>,
        /// Maximum records.
        #[arg(long)]
        count: Option<u64>,
        /// How to print payloads.
        #[arg(long, value_enum, default_value = "len")]
        payload: PayloadFormat,
    },
    /// Checksum everything read-only and report what recovery would repair.
    Verify {
        /// The log directory.
        #[arg(long)]
        dir: PathBuf,
        /// Also check each record is the deterministic payload `write` produces.
        #[arg(long)]
        expect_written_payloads: bool,
    },
    /// Append deterministic records, reporting each acknowledgement.
    #[command(hide = true)]
    Write {
        /// The log directory.
        #[arg(long)]
        dir: PathBuf,
        /// Stop after this many records (default: run until killed).
        #[arg(long)]
        records: Option<u64>,
        /// Concurrent appenders.
        #[arg(long, default_value_t = 8)]
        concurrency: usize,
        /// Payload size.
        #[arg(long, default_value_t = 1024)]
        payload_bytes: usize,
        /// none, on-commit or periodic:<ms>.
        #[arg(long, default_value = "on-commit")]
        fsync: FsyncMode,
        /// Segment size.
        #[arg(long, default_value_t = 64 << 20)]
        segment_bytes: u64,
    },
}

/// The payload `write` stores at `offset`: the offset, then a byte pattern derived from
/// it, so any record can be checked on its own.
fn written_payload(offset: u64, len: usize) -> Vec<u8> {
    let mut v = offset.to_be_bytes().to_vec();
    v.extend((0..len.saturating_sub(8)).map(|i| (offset as usize).wrapping_add(i) as u8));
    v
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    memlock::ensure(2 << 20).context("io_uring needs locked memory")?;
    glommio::LocalExecutorBuilder::default()
        .io_memory(2 << 20)
        .spawn(move || async move { run(cli.command).await })
        .map_err(|e| anyhow::anyhow!("starting the executor: {e}"))?
        .join()
        .map_err(|e| anyhow::anyhow!("executor: {e}"))?
}

async fn run(command: Command) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    match command {
        Command::Dump {
            dir,
            from,
            count,
            payload,
        } => {
            let log = open_read_only(&dir, VerifyOnOpen::Tail).await?.0;
            let mut at = from.unwrap_or_else(|| log.base_offset());
            let mut left = count.unwrap_or(u64::MAX);
            while left > 0 {
                let batches = log.read(at, 1 << 20).await?;
                if batches.is_empty() {
                    break;
                }
                for b in batches {
                    for (i, r) in b.records.iter().enumerate() {
                        if left == 0 {
                            break;
                        }
                        let shown = match payload {
                            PayloadFormat::Len => json!(r.len()),
                            PayloadFormat::Hex => {
                                json!(r.iter().map(|b| format!("{b:02x}")).collect::<String>())
                            }
                            PayloadFormat::Utf8 => json!(String::from_utf8_lossy(r)),
                        };
                        writeln!(
                            out,
                            "{}",
                            json!({
                                "offset": b.base_offset + i as u64,
                                "timestamp_micros": b.timestamp_micros,
                                "kind": format!("{:?}", b.kind),
                                "producer": b.producer.map(|p| json!({"id": p.producer_id, "sequence": p.sequence})),
                                "payload": shown,
                            })
                        )?;
                        left -= 1;
                    }
                    at = b.end_offset();
                }
            }
        }
        Command::Verify {
            dir,
            expect_written_payloads,
        } => {
            let started = Instant::now();
            let (log, report) = match open_read_only(&dir, VerifyOnOpen::All).await {
                Ok(x) => x,
                Err(e) => {
                    writeln!(
                        out,
                        "{}",
                        json!({"event": "corrupt", "error": e.to_string()})
                    )?;
                    std::process::exit(1);
                }
            };
            let mut at = log.base_offset();
            let mut records = 0u64;
            let mut generation_starts = 0u64;
            let mut first_payload_len = None;
            loop {
                let batches = log.read(at, 4 << 20).await?;
                if batches.is_empty() {
                    break;
                }
                for b in batches {
                    if b.base_offset != at {
                        bail!("offset gap: expected {at}, found {}", b.base_offset);
                    }
                    if b.kind == felix_storage_uring::BatchKind::GenerationStart {
                        generation_starts += 1;
                    } else if expect_written_payloads {
                        for (i, r) in b.records.iter().enumerate() {
                            let o = b.base_offset + i as u64;
                            let len = *first_payload_len.get_or_insert(r.len());
                            if r[..] != written_payload(o, len)[..] {
                                bail!("record {o} is not the payload written at that offset");
                            }
                        }
                    }
                    records += b.records.len() as u64;
                    at = b.end_offset();
                }
            }
            writeln!(
                out,
                "{}",
                json!({
                    "event": "verified",
                    "base_offset": report.base_offset,
                    "next_offset": report.next_offset,
                    "records": records,
                    "generation_starts": generation_starts,
                    "segments": report.segments,
                    "would_truncate_bytes": report.truncated_bytes,
                    "would_discard_segments": report.discarded_segments,
                    "would_rebuild_indexes": report.rebuilt_indexes,
                    "verified_bytes": report.verified_bytes,
                    "recovery_seconds": report.duration.as_secs_f64(),
                    "seconds": started.elapsed().as_secs_f64(),
                })
            )?;
        }
        Command::Write {
            dir,
            records,
            concurrency,
            payload_bytes,
            fsync,
            segment_bytes,
        } => {
            let backend = DmaBackend::open_dir(&dir).await?;
            let config = LogConfig {
                fsync,
                segment_bytes_max: segment_bytes,
                ..LogConfig::default()
            };
            let (log, report) = SegmentLog::open(backend, config).await?;
            writeln!(
                out,
                "{}",
                json!({"event": "opened", "next_offset": report.next_offset, "truncated_bytes": report.truncated_bytes})
            )?;
            out.flush()?;
            drop(out);
            let limit = records.map(|n| report.next_offset + n);
            let mut tasks = Vec::new();
            for _ in 0..concurrency.max(1) {
                let log = log.clone();
                tasks.push(glommio::spawn_local(async move {
                    loop {
                        let offset = log.next_offset();
                        if limit.is_some_and(|l| offset >= l) {
                            return Ok::<(), StorageError>(());
                        }
                        let pending = log.begin_append(
                            &[written_payload(offset, payload_bytes)],
                            offset,
                            None,
                        )?;
                        let a = log.commit(pending).await?;
                        // Printed only once the append is acknowledged.
                        let mut out = std::io::stdout().lock();
                        let _ = writeln!(out, "{{\"ack\":{},\"end\":{}}}", a.first, a.end);
                        let _ = out.flush();
                    }
                }));
            }
            for t in tasks {
                t.await?;
            }
            log.close().await?;
            println!(
                "{}",
                json!({"event": "done", "next_offset": log.next_offset()})
            );
        }
    }
    Ok(())
}

async fn open_read_only(
    dir: &std::path::Path,
    verify: VerifyOnOpen,
) -> anyhow::Result<(SegmentLog<DmaBackend>, felix_storage_uring::RecoveryReport)> {
    if !dir.is_dir() {
        bail!("{} is not a directory", dir.display());
    }
    let backend = DmaBackend::open_dir(dir).await?;
    let config = LogConfig {
        read_only: true,
        verify_on_open: verify,
        ..LogConfig::default()
    };
    Ok(SegmentLog::open(backend, config).await?)
}
