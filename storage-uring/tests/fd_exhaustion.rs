//! Durable writes while the process is out of file descriptors. Its own test binary: it
//! lowers the process's descriptor limit and uses every descriptor up.

mod common;

use common::run;
use felix_storage_uring::{DmaBackend, FsyncMode, LogConfig, SegmentLog};

/// With `dsync_writes`, a segment's durable writes go through a second, O_DSYNC
/// descriptor opened on first use. When no descriptor can be had then, the writes are
/// made durable through the segment's own descriptor (write, then fdatasync): the log
/// keeps acknowledging, and poisons nothing (it did: "log is poisoned by a failed
/// durable write (Too many open files)", seen in the chaos suite's `fd-exhaustion`).
#[test]
fn durable_writes_go_on_when_no_descriptor_is_left() {
    let tmp = tempfile::tempdir_in("/var/tmp").unwrap();
    let dir = tmp.path().join("log");
    let config = LogConfig {
        fsync: FsyncMode::OnCommit,
        dsync_writes: true,
        ..LogConfig::default()
    };
    // A low soft limit, so using every descriptor up is quick.
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
    let (dir2, config2) = (dir.clone(), config.clone());
    run(move || async move {
        let backend = DmaBackend::open_dir(&dir2).await.unwrap();
        let (log, _) = SegmentLog::open(backend, config2).await.unwrap();
        // The first round after open syncs with fdatasync; the O_DSYNC descriptor is
        // opened by the next one, which finds none left.
        log.append(&[b"before".as_slice()], 0).await.unwrap();
        let mut hog = Vec::new();
        loop {
            match std::fs::File::open("/dev/null") {
                Ok(f) => hog.push(f),
                Err(e) => {
                    assert_eq!(e.raw_os_error(), Some(libc::EMFILE), "{e}");
                    break;
                }
            }
        }
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
    run(move || async move {
        let backend = DmaBackend::open_dir(&dir).await.unwrap();
        let (log, report) = SegmentLog::open(backend, config).await.unwrap();
        assert_eq!(report.next_offset, 22);
        let batches = log.read(0, 1 << 20).await.unwrap();
        let records: Vec<Vec<u8>> = batches
            .iter()
            .flat_map(|b| b.records.iter().map(|r| r.to_vec()))
            .collect();
        assert_eq!(records.len(), 22);
        assert_eq!(records[0], b"before");
        assert_eq!(records[7], b"during 6");
        assert_eq!(records[21], b"after");
        log.close().await.unwrap();
    });
}
