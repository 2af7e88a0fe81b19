//! `felix-log repair` on a real directory: a log is written through the io_uring backend,
//! damaged the way a crash or a stray writer leaves it, and repaired. A dry run must name
//! exactly the offsets the repair loses and change nothing; the repair must cut exactly
//! those and leave a log that reopens clean; damage that is not a torn tail is refused
//! (exit 2) and left alone.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use common::{Disk, Fixture, payload, run};
use felix_storage_uring::format::{SEGMENT_HEADER_BYTES, batch_len};
use felix_storage_uring::{DmaBackend, LogConfig, SegmentLog};

const BIN: &str = env!("CARGO_BIN_EXE_felix-log");
const SEGMENT: &str = "00000000000000000000.seg";
/// Batches written, each of `RECORDS` records of `LEN` bytes: offsets 0..30.
const BATCHES: u64 = 10;
const RECORDS: u64 = 3;
const LEN: usize = 100;

fn records(first: u64) -> Vec<Vec<u8>> {
    (first..first + RECORDS).map(|o| payload(o, LEN)).collect()
}

/// Byte position of batch `k` in the segment.
fn batch_pos(k: u64) -> u64 {
    SEGMENT_HEADER_BYTES as u64 + k * batch_len(&records(0)) as u64
}

/// A closed log of `BATCHES` batches on disk.
fn written_log() -> Disk {
    let disk = Disk::new();
    let dir = disk.0.clone();
    run(move || async move {
        let backend = DmaBackend::open_dir(&dir).await.unwrap();
        let (log, _) = SegmentLog::open(backend, LogConfig::default())
            .await
            .unwrap();
        for k in 0..BATCHES {
            log.append(&records(k * RECORDS), 0).await.unwrap();
        }
        log.close().await.unwrap();
    });
    disk
}

/// Every file of the log directory and its bytes.
fn snapshot(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let name = e.file_name().into_string().unwrap();
            (name, std::fs::read(e.path()).unwrap())
        })
        .collect()
}

/// Runs `felix-log repair` with `args`: exit code and stdout.
fn repair(dir: &Path, args: &[&str]) -> (i32, String) {
    let out = Command::new(BIN)
        .arg("repair")
        .args(args)
        .arg("--dir")
        .arg(dir)
        .output()
        .expect("felix-log repair runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let code = out.status.code().expect("exited");
    eprintln!(
        "repair {args:?}: exit {code}\n{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    (code, stdout)
}

fn repair_json(dir: &Path, args: &[&str]) -> (i32, serde_json::Value) {
    let mut args = args.to_vec();
    args.push("--json");
    let (code, stdout) = repair(dir, &args);
    (
        code,
        serde_json::from_str(stdout.trim()).expect("one JSON object"),
    )
}

/// The log reopens without anything to repair and holds exactly offsets `0..end`, each
/// the record appended there.
fn assert_reopens_clean(dir: &Path, end: u64) {
    let dir = dir.to_owned();
    run(move || async move {
        let config = LogConfig {
            read_only: true,
            ..LogConfig::default()
        };
        let backend = DmaBackend::open_dir(&dir).await.unwrap();
        let (log, report) = SegmentLog::open(backend, config).await.unwrap();
        assert_eq!(report.truncated_bytes, 0, "{report:?}");
        assert_eq!(report.torn_tail, None);
        assert_eq!(report.next_offset, end);
        let mut at = 0;
        while at < end {
            for b in log.read(at, 1 << 20).await.unwrap() {
                assert_eq!(b.base_offset, at);
                for (i, r) in b.records.iter().enumerate() {
                    assert_eq!(r.to_vec(), payload(at + i as u64, LEN));
                }
                at = b.end_offset();
            }
        }
        assert_eq!(at, end);
    });
}

#[test]
fn a_batch_torn_mid_way_is_cut_exactly_and_the_dry_run_says_which_offsets() {
    let disk = written_log();
    let dir = disk.0.clone();
    // The last batch (offsets 27..=29) lost its end: its header survived.
    let last = batch_pos(BATCHES - 1);
    disk.set_len(SEGMENT, last + 100);
    let before = snapshot(&dir);

    let (code, v) = repair_json(&dir, &["--dry-run"]);
    assert_eq!(code, 0);
    assert_eq!(v["dry_run"], true);
    assert_eq!(v["repairable"], true);
    let cut = &v["cut"];
    assert_eq!(cut["segment"], SEGMENT);
    assert_eq!(cut["position"], last);
    assert_eq!(cut["bytes"], 100);
    assert_eq!(cut["first_offset"], 27);
    assert_eq!(cut["last_offset"], 29);
    assert_eq!(cut["records"], 3);
    assert_eq!(v["next_offset"], 27);
    let (code, text) = repair(&dir, &["--dry-run"]);
    assert_eq!(code, 0);
    assert!(
        text.contains("would cut 100 bytes: offsets 27..=29 (3 records)"),
        "{text}"
    );
    assert!(text.contains(SEGMENT), "{text}");
    assert_eq!(snapshot(&dir), before, "a dry run changes nothing");

    let (code, v) = repair_json(&dir, &[]);
    assert_eq!(code, 0);
    assert_eq!(v["dry_run"], false);
    assert_eq!(v["cut"], *cut, "the repair cuts what the dry run said");
    assert_eq!(disk.len(SEGMENT), last, "cut at the torn batch");
    assert_reopens_clean(&dir, 27);
    let (code, v) = repair_json(&dir, &[]);
    assert_eq!((code, &v["cut"]), (0, &serde_json::Value::Null));
}

#[test]
fn garbage_after_the_last_batch_is_cut_and_loses_no_record() {
    let disk = written_log();
    let dir = disk.0.clone();
    // A stray write into the zero padding after the data: no header survives there.
    let end = batch_pos(BATCHES);
    disk.corrupt(SEGMENT, end, b"not a batch header");
    let len = disk.len(SEGMENT);
    let before = snapshot(&dir);

    let (code, v) = repair_json(&dir, &["--dry-run"]);
    assert_eq!(code, 0);
    assert_eq!(v["cut"]["position"], end);
    assert_eq!(v["cut"]["bytes"], len - end);
    assert_eq!(v["cut"]["first_offset"], 30);
    assert_eq!(v["cut"]["records"], serde_json::Value::Null);
    assert_eq!(v["cut"]["last_offset"], serde_json::Value::Null);
    let (_, text) = repair(&dir, &["--dry-run"]);
    assert!(text.contains("header at offset 30 is damaged"), "{text}");
    assert_eq!(snapshot(&dir), before, "a dry run changes nothing");

    let (code, _) = repair(&dir, &[]);
    assert_eq!(code, 0);
    assert_eq!(disk.len(SEGMENT), end);
    assert_reopens_clean(&dir, 30);
}

#[test]
fn interior_damage_is_refused_with_exit_2_and_left_alone() {
    let disk = written_log();
    let dir = disk.0.clone();
    // A flipped byte inside batch 4's body: batches after it hold acknowledged records.
    let pos = batch_pos(4) + 80;
    disk.corrupt(SEGMENT, pos, &[0xFF]);
    let before = snapshot(&dir);

    let (code, v) = repair_json(&dir, &["--dry-run"]);
    assert_eq!(code, 2);
    assert_eq!(v["repairable"], false);
    assert_eq!(v["segment"], SEGMENT);
    assert_eq!(v["position"], batch_pos(4));
    assert_eq!(v["offset"], 12);
    assert!(
        v["error"].as_str().unwrap().contains("interior damage"),
        "{v}"
    );
    for args in [&[][..], &["--json"][..]] {
        let (code, out) = repair(&dir, args);
        assert_eq!(code, 2);
        assert!(out.contains("interior damage"), "{out}");
    }
    let (_, text) = repair(&dir, &[]);
    assert!(text.starts_with("repair impossible:"), "{text}");
    assert_eq!(snapshot(&dir), before, "a refused repair changes nothing");
}

#[test]
fn a_refused_repair_does_not_even_tidy_up_what_recovery_would() {
    let disk = written_log();
    let dir = disk.0.clone();
    disk.corrupt(SEGMENT, batch_pos(4) + 80, &[0xFF]);
    // An interrupted roll left a blank newest segment: a read-write open removes it
    // before it finds the damage and refuses.
    disk.write("00000000000000000030.seg", &[0u8; SEGMENT_HEADER_BYTES]);
    let before = snapshot(&dir);
    let (code, v) = repair_json(&dir, &[]);
    assert_eq!(
        (code, &v["repairable"]),
        (2, &serde_json::Value::Bool(false))
    );
    assert_eq!(snapshot(&dir), before, "a refused repair changes nothing");
}

/// A refused repair writes no index either: recovery wrote a sealed segment's missing
/// (or stale) index file again on a read-only open too, into a directory a running
/// broker may own, though the repair said it changed nothing.
#[test]
fn a_refused_repair_writes_no_sealed_segments_index() {
    let disk = Disk::new();
    let dir = disk.0.clone();
    // Three records of 1,500 bytes a batch, three batches a segment: two segments.
    let big = |k: u64| -> Vec<Vec<u8>> { (k * 3..k * 3 + 3).map(|o| payload(o, 1_500)).collect() };
    run(move || async move {
        let backend = DmaBackend::open_dir(&dir).await.unwrap();
        let config = LogConfig {
            segment_bytes_max: 20_000,
            ..LogConfig::default()
        };
        let (log, _) = SegmentLog::open(backend, config).await.unwrap();
        for k in 0..6 {
            log.append(&big(k), 0).await.unwrap();
        }
        log.close().await.unwrap();
    });
    let dir = disk.0.clone();
    let mut segments: Vec<String> = disk
        .names()
        .into_iter()
        .filter(|n| n.ends_with(".seg"))
        .collect();
    segments.sort();
    assert_eq!(segments.len(), 2, "{segments:?}");
    disk.remove("00000000000000000000.idx");
    // Interior damage in the newest segment: its first batch, a whole one after it.
    disk.corrupt(&segments[1], SEGMENT_HEADER_BYTES as u64 + 80, &[0xFF]);
    let before = snapshot(&dir);
    let (code, v) = repair_json(&dir, &[]);
    assert_eq!(
        (code, &v["repairable"]),
        (2, &serde_json::Value::Bool(false)),
        "{v}"
    );
    let after = snapshot(&dir);
    let changed: Vec<&String> = after
        .keys()
        .chain(before.keys())
        .filter(|n| after.get(*n) != before.get(*n))
        .collect();
    assert!(changed.is_empty(), "a refused repair changed {changed:?}");
}
