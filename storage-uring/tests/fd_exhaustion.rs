//! Durable writes while the process is out of file descriptors. Its own test binary: it
//! lowers the process's descriptor limit and uses every descriptor up (one test at a
//! time: [`EXCLUSIVE`]).

mod common;

use std::sync::Mutex;
use std::time::Duration;

use common::run;
use felix_storage_uring::{DmaBackend, FsyncMode, LogConfig, SegmentLog};

/// Held by each test: a test using every descriptor up fails any other's opens.
static EXCLUSIVE: Mutex<()> = Mutex::new(());

/// Lowers the soft descriptor limit, so using every descriptor up is quick.
fn low_descriptor_limit() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a live struct.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit), 0);
        let low = libc::rlimit {
            rlim_cur: limit.rlim_cur.min(512),
            rlim_max: limit.rlim_max,
        };
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &low), 0);
    }
}

/// Opens `/dev/null` until no descriptor is left; dropping the result frees them.
fn every_descriptor() -> Vec<std::fs::File> {
    let mut hog = Vec::new();
    loop {
        match std::fs::File::open("/dev/null") {
            Ok(f) => hog.push(f),
            Err(e) => {
                assert_eq!(e.raw_os_error(), Some(libc::EMFILE), "{e}");
                return hog;
            }
        }
    }
}

/// Reads every record of the log at `dir` back.
fn read_back(dir: std::path::PathBuf, config: LogConfig) -> Vec<Vec<u8>> {
    run(move || async move {
        let backend = DmaBackend::open_dir(&dir).await.unwrap();
        let (log, _) = SegmentLog::open(backend, config).await.unwrap();
        let mut out = Vec::new();
        let mut at = 0;
        loop {
            let batches = log.read(at, 1 << 20).await.unwrap();
            if batches.is_empty() {
                break;
            }
            for b in batches {
                out.extend(b.records.iter().map(|r| r.to_vec()));
                at = b.end_offset();
            }
        }
        log.close().await.unwrap();
        out
    })
}

/// With `dsync_writes`, a segment's durable writes go through a second, O_DSYNC
/// descriptor opened on first use. When no descriptor can be had then, the writes are
/// made durable through the segment's own descriptor (write, then fdatasync): the log
/// keeps acknowledging, and poisons nothing (it did: "log is poisoned by a failed
/// durable write (Too many open files)", seen in the chaos suite's `fd-exhaustion`).
#[test]
fn durable_writes_go_on_when_no_descriptor_is_left() {
    let _one = EXCLUSIVE.lock().unwrap_or_else(|e| e.into_inner());
    let tmp = tempfile::tempdir_in("/var/tmp").unwrap();
    let dir = tmp.path().join("log");
    let config = LogConfig {
        fsync: FsyncMode::OnCommit,
        dsync_writes: true,
        ..LogConfig::default()
    };
    low_descriptor_limit();
    let (dir2, config2) = (dir.clone(), config.clone());
    run(move || async move {
        let backend = DmaBackend::open_dir(&dir2).await.unwrap();
        let (log, _) = SegmentLog::open(backend, config2).await.unwrap();
        // The first round after open syncs with fdatasync; the O_DSYNC descriptor is
        // opened by the next one, which finds none left.
        log.append(&[b"before".as_slice()], 0).await.unwrap();
        let hog = every_descriptor();
        for i in 0..20u32 {
            let r = format!("during {i}");
            log.append(&[r.as_bytes()], 0)
                .await
                .expect("acknowledged with no descriptor left");
        }
        assert!(log.poisoned().is_none(), "{:?}", log.poisoned());
        drop(hog);
        log.append(&[b"after".as_slice()], 0).await.unwrap();
        log.close().await.unwrap();
    });
    let records = read_back(dir, config);
    assert_eq!(records.len(), 22);
    assert_eq!(records[0], b"before");
    assert_eq!(records[7], b"during 6");
    assert_eq!(records[21], b"after");
}

/// A roll that finds no descriptor to create its next segment with waits for one (the
/// log's writes wait meanwhile) instead of poisoning the log; once one frees up, every
/// write waiting lands. (Without the wait the log poisons at the roll and the appends
/// fail; the freer, which waits for the roll's tries, is never reached.)
#[test]
fn a_roll_waits_for_a_descriptor_instead_of_poisoning_the_log() {
    let _one = EXCLUSIVE.lock().unwrap_or_else(|e| e.into_inner());
    let tmp = tempfile::tempdir_in("/var/tmp").unwrap();
    let dir = tmp.path().join("log");
    let config = LogConfig {
        fsync: FsyncMode::OnCommit,
        segment_bytes_max: 64 * 1024,
        ..LogConfig::default()
    };
    low_descriptor_limit();
    let (dir2, config2) = (dir.clone(), config.clone());
    run(move || async move {
        let backend = DmaBackend::open_dir(&dir2).await.unwrap();
        let (log, _) = SegmentLog::open(backend, config2).await.unwrap();
        let log = std::rc::Rc::new(log);
        log.append(&[b"before".as_slice()], 0).await.unwrap();
        let hog = every_descriptor();
        // Freed once the roll has waited a while (the process's other work letting go),
        // however long the appends before it took.
        let freer = {
            let log = log.clone();
            glommio::spawn_local(async move {
                while log.stats().roll_descriptor_waits < 5 {
                    glommio::timer::sleep(Duration::from_millis(5)).await;
                }
                drop(hog);
            })
        };
        let record = vec![7u8; 1000];
        for _ in 0..100 {
            log.append(&[record.as_slice()], 0)
                .await
                .expect("acknowledged once a descriptor frees up");
        }
        freer.await;
        let stats = log.stats();
        assert!(stats.rolls >= 1, "{stats:?}");
        assert!(stats.roll_descriptor_waits > 0, "{stats:?}");
        assert!(log.poisoned().is_none(), "{:?}", log.poisoned());
        log.close().await.unwrap();
    });
    let records = read_back(dir, config);
    assert_eq!(records.len(), 101);
    assert_eq!(records[0], b"before");
    assert!(records[1..].iter().all(|r| r == &vec![7u8; 1000]));
}
