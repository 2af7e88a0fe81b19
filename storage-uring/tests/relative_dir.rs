//! A log directory given as a relative path (the broker's default `./felix-data` is
//! one). Its own test binary: it changes the process's working directory.

mod common;

use common::run;
use felix_storage_uring::{DmaBackend, LogConfig, SegmentLog};

#[test]
fn a_relative_log_directory_works() {
    let tmp = tempfile::tempdir_in("/var/tmp").unwrap();
    std::env::set_current_dir(tmp.path()).unwrap();
    run(|| async {
        let backend = DmaBackend::open_dir("relative/log").await.unwrap();
        let (log, _) = SegmentLog::open(backend, LogConfig::default())
            .await
            .unwrap();
        log.append(&[b"x"], 0).await.unwrap();
        log.close().await.unwrap();
    });
    assert!(
        tmp.path()
            .join("relative/log/00000000000000000000.seg")
            .exists()
    );
}
