//! Storage failures under a running broker: a failed fdatasync poisons the shard's log
//! (typed refusals, `/readyz` unready, nothing acknowledged lost across a restart); a
//! full disk refuses appends with a typed retryable error and takes them again once
//! space is freed, without a restart. Faults come through the broker's storage fault
//! seam (`/debug/storage-faults`) and, as root, from a really full loop-mounted ext4.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use felix_client::{Client, ClientConfig, ClientError};
use felix_cluster::{BrokerProcess, LoopFs, wait_for};
use felix_wire::message::StartPosition;
use felix_wire::{AckMode, ErrorCode};

fn start(data: &Path, config: &str, extra: &[&str]) -> BrokerProcess {
    let path = data.with_extension("yaml");
    std::fs::write(&path, config).unwrap();
    let mut args = vec!["--config", path.to_str().unwrap(), "--fsync", "on-commit"];
    args.extend_from_slice(extra);
    BrokerProcess::start_dev(
        Path::new(env!("CARGO_BIN_EXE_felix-broker-under-test")),
        data,
        &args,
    )
    .unwrap()
}

async fn client(b: &BrokerProcess) -> Client {
    let quinn = felix_client::quic_client_config_from_file(&b.ca_file(), false).unwrap();
    let mut config = ClientConfig::from_env_or_yaml(quinn, None).unwrap();
    config.auth_tenant_id = Some("dev".to_string());
    config.auth_token = Some(b.token());
    Client::connect(b.listen, "localhost", config)
        .await
        .unwrap()
}

async fn publish(c: &Client, payload: &[u8]) -> Result<u64, ClientError> {
    c.publish("dev", "default", "s", payload.to_vec(), AckMode::PerMessage)
        .await
        .map(|o| o.expect("acks carry offsets"))
}

/// Every record of the stream, by offset.
async fn read_all(c: &Client, n: usize) -> Vec<(u64, Vec<u8>)> {
    let mut sub = c
        .subscribe_from("dev", "default", "s", Some(StartPosition::Earliest))
        .await
        .unwrap();
    let mut out = Vec::new();
    while out.len() < n {
        match tokio::time::timeout(Duration::from_secs(5), sub.next_event()).await {
            Ok(Ok(Some(e))) => out.push((e.offset.unwrap(), e.payload.to_vec())),
            _ => break,
        }
    }
    out
}

fn arm(b: &BrokerProcess, query: &str) {
    let (status, body) = b
        .http_post(&format!("/debug/storage-faults?{query}"))
        .unwrap();
    assert_eq!(status, 200, "{body}");
}

fn readyz(b: &BrokerProcess) -> (u16, String) {
    b.http_get("/readyz").unwrap()
}

fn code(e: &ClientError) -> Option<ErrorCode> {
    match e {
        ClientError::Broker(b) => b.code.clone(),
        _ => None,
    }
}

#[test]
fn a_failed_fsync_poisons_the_log_and_loses_nothing_acknowledged() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let mut b = start(&data, "fault_injection: true\n", &[]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let acked = rt.block_on(async {
        let c = client(&b).await;
        let mut acked = Vec::new();
        for i in 0..50u32 {
            let p = format!("r{i}");
            acked.push((publish(&c, p.as_bytes()).await.unwrap(), p.into_bytes()));
        }
        arm(&b, "op=sync&errno=eio&times=once");
        let e = publish(&c, b"doomed").await.unwrap_err();
        assert_eq!(code(&e), Some(ErrorCode::Storage), "{e}");
        let e = publish(&c, b"after").await.unwrap_err();
        assert_eq!(
            code(&e),
            Some(ErrorCode::Storage),
            "refused until restart: {e}"
        );
        acked
    });
    let (status, body) = wait_for("/readyz to turn unready", Duration::from_secs(5), || {
        let r = readyz(&b);
        (r.0 == 503).then_some(r)
    })
    .unwrap();
    assert_eq!(status, 503);
    assert!(body.contains("poisoned"), "{body}");
    b.restart().unwrap();
    assert_eq!(readyz(&b).0, 200, "recovery reads what reached the disk");
    rt.block_on(async {
        let c = client(&b).await;
        let got = read_all(&c, acked.len() + 2).await;
        assert!(got.len() >= acked.len());
        for (i, (o, p)) in acked.iter().enumerate() {
            assert_eq!(got[i], (*o, p.clone()), "acknowledged record {i} intact");
        }
        publish(&c, b"again").await.unwrap();
    });
}

#[test]
fn a_full_disk_refuses_appends_and_recovers_without_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let b = start(&dir.path().join("data"), "fault_injection: true\n", &[]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let c = client(&b).await;
        let mut acked = Vec::new();
        for i in 0..20u32 {
            let p = format!("r{i}");
            acked.push((publish(&c, p.as_bytes()).await.unwrap(), p.into_bytes()));
        }
        arm(&b, "op=write&errno=enospc&times=always");
        for _ in 0..3 {
            let e = publish(&c, b"no room").await.unwrap_err();
            assert_eq!(code(&e), Some(ErrorCode::Overloaded), "{e}");
        }
        let (status, body) = readyz(&b);
        assert_eq!(status, 503);
        assert!(body.contains("disk full"), "{body}");
        arm(&b, "clear=true");
        for i in 20..30u32 {
            let p = format!("r{i}");
            acked.push((publish(&c, p.as_bytes()).await.unwrap(), p.into_bytes()));
        }
        assert_eq!(readyz(&b).0, 200, "ready again, no restart");
        let got = read_all(&c, acked.len() + 1).await;
        assert_eq!(
            got, acked,
            "every acknowledged record, contiguous, nothing refused"
        );
    });
}

#[test]
fn a_really_full_filesystem_refuses_appends_until_space_is_freed() {
    let dir = tempfile::tempdir().unwrap();
    let Some(fs) = LoopFs::mount(dir.path(), 48) else {
        eprintln!("SKIPPED: needs root and a loop device to mount a small ext4");
        return;
    };
    let data = fs.mount.join("data");
    // Small segments, so a full disk is met when the log rolls into a new one.
    let b = start(&data, "segment_bytes: 2097152\n", &[]);
    // Fill what is left but a little, with a file the test can remove.
    let filler = fs.mount.join("filler");
    let avail = {
        let out = Command::new("df")
            .args(["--output=avail", "-B1"])
            .arg(&fs.mount)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .nth(1)
            .unwrap()
            .trim()
            .parse::<u64>()
            .unwrap()
    };
    let ok = Command::new("fallocate")
        .arg("-l")
        .arg((avail.saturating_sub(6 << 20)).to_string())
        .arg(&filler)
        .status()
        .unwrap()
        .success();
    assert!(ok, "filling the filesystem");
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let c = client(&b).await;
        let payload = vec![b'x'; 64 * 1024];
        let mut acked = Vec::new();
        let mut refused = None;
        for _ in 0..400 {
            match publish(&c, &payload).await {
                Ok(o) => acked.push(o),
                Err(e) => {
                    refused = Some(e);
                    break;
                }
            }
        }
        let e = refused.expect("the filesystem fills up");
        assert_eq!(
            code(&e),
            Some(ErrorCode::Overloaded),
            "typed and retryable: {e}"
        );
        eprintln!(
            "disk full after {} acknowledged 64 KiB records",
            acked.len()
        );
        let (status, body) = readyz(&b);
        assert_eq!(status, 503, "{body}");
        std::fs::remove_file(&filler).unwrap();
        // Appends resume by themselves.
        let next = publish(&c, &payload).await.expect("space was freed");
        assert_eq!(
            next,
            acked.last().map_or(0, |o| o + 1),
            "offsets stay contiguous"
        );
        acked.push(next);
        assert_eq!(readyz(&b).0, 200);
        let got = read_all(&c, acked.len() + 1).await;
        let offsets: Vec<u64> = got.iter().map(|(o, _)| *o).collect();
        assert_eq!(offsets, acked, "every acknowledged record, nothing more");
    });
    drop(b);
}
