//! A real process, a real disk, a real SIGKILL: `felix-log write` appends with
//! on-commit fsync and prints each acknowledged batch; it is killed at a random moment,
//! many times over the same directory. After every kill the log must hold every
//! acknowledged record intact, contiguous from the start, and nothing that is not the
//! payload written at its offset.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use rand::{RngExt, SeedableRng};

const BIN: &str = env!("CARGO_BIN_EXE_felix-log");

fn verify(dir: &std::path::Path) -> serde_json::Value {
    let out = Command::new(BIN)
        .args(["verify", "--expect-written-payloads", "--dir"])
        .arg(dir)
        .output()
        .expect("felix-log verify runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "verify failed: {stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(stdout.lines().last().expect("a verdict line")).unwrap()
}

#[test]
fn sigkill_mid_append_never_loses_an_acknowledged_record() {
    let seed = std::env::var("FELIX_CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| rand::rng().random::<u64>());
    eprintln!("FELIX_CRASH_SEED={seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let tmp = tempfile::Builder::new()
        .prefix("felix-crash")
        .tempdir_in("/var/tmp")
        .unwrap();
    let dir = tmp.path().join("log");
    let cycles = 12;
    let mut acked_end = 0u64;
    let mut truncations = 0u64;
    for cycle in 0..cycles {
        let mut child = Command::new(BIN)
            .args(["write", "--concurrency", "16", "--payload-bytes", "1000"])
            // Small segments so kills also land in the middle of rolls.
            .args(["--segment-bytes", "262144", "--dir"])
            .arg(&dir)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("felix-log write starts");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        // Wait until it is appending, then kill it at a random point.
        let opened: serde_json::Value =
            serde_json::from_str(&rx.recv_timeout(Duration::from_secs(30)).unwrap()).unwrap();
        let next = opened["next_offset"].as_u64().unwrap();
        assert!(
            next >= acked_end,
            "cycle {cycle}: reopened at {next}, below acked {acked_end}"
        );
        truncations += u64::from(opened["truncated_bytes"].as_u64().unwrap() > 0);
        let kill_after = Duration::from_millis(rng.random_range(20..400));
        let started = Instant::now();
        while started.elapsed() < kill_after {
            if let Ok(line) = rx.recv_timeout(Duration::from_millis(5)) {
                let v: serde_json::Value = serde_json::from_str(&line).unwrap();
                if let Some(end) = v["end"].as_u64() {
                    acked_end = acked_end.max(end);
                }
            }
        }
        // SAFETY-free kill: SIGKILL by pid of the child we started.
        child.kill().unwrap();
        child.wait().unwrap();
        // Acks already printed before the kill count too.
        for line in rx.try_iter() {
            let v: serde_json::Value = serde_json::from_str(&line).unwrap();
            if let Some(end) = v["end"].as_u64() {
                acked_end = acked_end.max(end);
            }
        }
        reader.join().unwrap();
        let verdict = verify(&dir);
        let records = verdict["records"].as_u64().unwrap();
        assert!(
            records >= acked_end,
            "cycle {cycle}: {records} records survive but {acked_end} were acknowledged: {verdict}"
        );
        eprintln!(
            "cycle {cycle}: acked {acked_end}, on disk {records}, would truncate {}",
            verdict["would_truncate_bytes"]
        );
    }
    assert!(acked_end > 1000, "the writer made progress: {acked_end}");
    eprintln!("{cycles} kills, {truncations} torn tails repaired");
}
