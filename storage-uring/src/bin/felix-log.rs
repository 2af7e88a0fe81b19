//! `felix-log`: inspect and exercise a segment log directory.
//!
//! - `dump`: print records as JSON lines (read-only).
//! - `verify`: run recovery read-only, checksum every batch, check offsets are
//!   contiguous, and report what a broker's open would repair; exit 1 on corruption.
//! - `repair`: cut the torn tail a broker's open would cut, and say exactly which offsets
//!   that loses; `--dry-run` only says it. Refuses (exit 2) when the log has damage that
//!   recovery cannot repair without losing acknowledged records.
//! - `write`: append deterministic records until killed or a count is reached, printing
//!   one `{"ack":first,"end":end}` line per acknowledged batch, flushed as it happens.
//!   The crash test kills it mid-append and checks every acknowledged record survives.
//!
//! Output is JSON lines on stdout (`repair`: text, or one JSON object with `--json`);
//! diagnostics go to stderr.

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
    /// Cut the torn tail recovery would cut (exit 0), or refuse when the damage is not a
    /// torn tail (exit 2).
    Repair {
        /// The log directory.
        #[arg(long)]
        dir: PathBuf,
        /// Change nothing: print what a repair would cut (exit 2 if it would refuse).
        #[arg(long)]
        dry_run: bool,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
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
        Command::Repair { dir, dry_run, json } => {
            drop(out);
            let code = repair(&dir, dry_run, json).await?;
            if code != 0 {
                std::process::exit(code);
            }
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

/// What `repair` found, decided or did.
enum RepairOutcome {
    /// Recovery repairs the log (or would): what it cuts, and the log after it.
    Repairable(felix_storage_uring::RecoveryReport),
    /// Recovery refuses: the damage is not a torn tail.
    Refused(StorageError),
}

/// `felix-log repair`: returns the exit code (0 repaired or nothing to do, 2 refused).
async fn repair(dir: &std::path::Path, dry_run: bool, json: bool) -> anyhow::Result<i32> {
    // A read-only open reports exactly what a read-write one would do, and changes
    // nothing, so a refusal leaves the directory as it was.
    let intent_pending = dir
        .join(felix_storage_uring::log::cut::INTENT_FILE)
        .exists();
    let plan = if intent_pending {
        if dry_run {
            bail!(
                "an interrupted truncation or reset is pending ({}): a read-write open \
                 finishes it first, so a dry run cannot see past it; run repair without \
                 --dry-run",
                felix_storage_uring::log::cut::INTENT_FILE
            );
        }
        None
    } else {
        Some(analyse(dir).await?)
    };
    let outcome = match plan {
        Some(refused @ RepairOutcome::Refused(_)) => refused,
        Some(plan) if dry_run => plan,
        _ => {
            let backend = DmaBackend::open_dir(dir).await?;
            let config = LogConfig {
                verify_on_open: VerifyOnOpen::All,
                ..LogConfig::default()
            };
            match SegmentLog::open(backend, config).await {
                Ok((log, report)) => {
                    log.close().await?;
                    RepairOutcome::Repairable(report)
                }
                Err(e) if refusal(&e) => RepairOutcome::Refused(e),
                Err(e) => return Err(e.into()),
            }
        }
    };
    let mut out = std::io::stdout().lock();
    if json {
        writeln!(out, "{}", repair_json(&outcome, dry_run))?;
    } else {
        write!(out, "{}", repair_text(&outcome, dry_run))?;
    }
    Ok(match outcome {
        RepairOutcome::Repairable(_) => 0,
        RepairOutcome::Refused(_) => 2,
    })
}

/// Runs recovery read-only: what a repair would do, or why it would refuse.
async fn analyse(dir: &std::path::Path) -> anyhow::Result<RepairOutcome> {
    match open_read_only(dir, VerifyOnOpen::All).await {
        Ok((_, report)) => Ok(RepairOutcome::Repairable(report)),
        Err(e) => match e.downcast::<StorageError>() {
            Ok(e) if refusal(&e) => Ok(RepairOutcome::Refused(e)),
            Ok(e) => Err(e.into()),
            Err(e) => Err(e),
        },
    }
}

/// Errors that mean "recovery will not repair this": damage that is not a torn tail.
fn refusal(e: &StorageError) -> bool {
    matches!(
        e,
        StorageError::Corrupt(_) | StorageError::ForeignFile { .. }
    )
}

fn repair_json(outcome: &RepairOutcome, dry_run: bool) -> serde_json::Value {
    match outcome {
        RepairOutcome::Repairable(r) => {
            let cut = r.torn_tail.as_ref().map(|t| {
                json!({
                    "segment": t.segment,
                    "position": t.position,
                    "bytes": t.bytes,
                    "first_offset": t.first_offset,
                    "last_offset": t.records.map(|n| t.first_offset + n - 1),
                    "records": t.records,
                    "data_after": t.data_after,
                    "cause": t.cause.to_string(),
                })
            });
            json!({
                "dry_run": dry_run,
                "repairable": true,
                "cut": cut,
                "discarded_segments": r.discarded_segments,
                "finished_intent": r.finished_intent,
                "base_offset": r.base_offset,
                "next_offset": r.next_offset,
                "segments": r.segments,
            })
        }
        RepairOutcome::Refused(e) => {
            let mut v = json!({
                "dry_run": dry_run,
                "repairable": false,
                "error": e.to_string(),
            });
            if let StorageError::Corrupt(c) = e {
                v["segment"] = json!(c.segment);
                v["position"] = json!(c.position);
                v["offset"] = json!(c.offset);
            }
            v
        }
    }
}

fn repair_text(outcome: &RepairOutcome, dry_run: bool) -> String {
    let (cuts, ends) = if dry_run {
        ("would cut", "would end")
    } else {
        ("cut", "ends")
    };
    let r = match outcome {
        RepairOutcome::Refused(e) => {
            return format!(
                "repair impossible: {e}\n\
                 Only the end of the newest segment (a torn tail, or damage within one \
                 flush round of the end of its data) can be cut without losing acknowledged \
                 records. Nothing was changed; restore this log from a replica or a \
                 backup.\n"
            );
        }
        RepairOutcome::Repairable(r) => r,
    };
    let mut text = String::new();
    if r.finished_intent {
        text += "finished an interrupted truncation or reset\n";
    }
    if r.discarded_segments > 0 {
        text += &format!(
            "{} {} segment file(s) whose creation never completed (no records)\n",
            if dry_run { "would remove" } else { "removed" },
            r.discarded_segments
        );
    }
    match &r.torn_tail {
        None => text += "no torn tail: nothing to cut\n",
        Some(t) => {
            text += &match t.data_after {
                None => format!("segment {}: torn tail at byte {}", t.segment, t.position),
                Some(at) => format!(
                    "segment {}: torn last flush round at byte {}, data resumes at byte {at} \
                     (a power cut during its fdatasync; none of it was acknowledged)",
                    t.segment, t.position
                ),
            };
            text += &format!(" ({})\n{cuts} {} bytes: ", t.cause, t.bytes);
            text += &match t.records {
                Some(n) => format!(
                    "offsets {}..={} ({n} record{})\n",
                    t.first_offset,
                    t.first_offset + n - 1,
                    if n == 1 { "" } else { "s" }
                ),
                None if t.data_after.is_none() => format!(
                    "the batch header at offset {} is damaged, so how many records it held \
                     is unknown; nothing from offset {} on remains\n",
                    t.first_offset, t.first_offset
                ),
                None => format!(
                    "a batch header from offset {} on is damaged, so how many records are \
                     lost is unknown; nothing from offset {} on remains\n",
                    t.first_offset, t.first_offset
                ),
            };
        }
    }
    text += &format!(
        "the log {ends} at offset {} (base {}, {} segment{})\n",
        r.next_offset,
        r.base_offset,
        r.segments,
        if r.segments == 1 { "" } else { "s" }
    );
    text
}
