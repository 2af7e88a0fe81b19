//! The standard SDK (`felix-client==0.6.2` from PyPI, `import felix`) against
//! `felix-broker dev`, as a user would drive it.

use felix_cluster::{BrokerProcess, expect_success, run_python};

fn broker(extra: &[&str]) -> (BrokerProcess, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let b = BrokerProcess::start_dev(
        std::path::Path::new(env!("CARGO_BIN_EXE_felix-broker-under-test")),
        &dir.path().join("data"),
        extra,
    )
    .unwrap();
    (b, dir)
}

fn run(script: &str, extra: &[&str]) {
    let (b, _dir) = broker(extra);
    let out = run_python(&b, script, &[]).unwrap();
    let text = expect_success(script, &out).unwrap();
    eprintln!("{text}");
}

#[test]
fn sdk_publishes_with_every_ack_mode_and_subscribes_from_every_start() {
    run("streams.py", &[]);
}

#[test]
fn sdk_reads_a_multi_shard_stream_with_subscribe_sharded() {
    run("sharded.py", &["--shards", "4"]);
}

#[test]
fn sdk_cache_put_get_delete_and_ttl() {
    run("cache.py", &["--shards", "3"]);
}

#[test]
fn sdk_gets_typed_errors_for_bad_tokens_and_wrong_tenants() {
    run("auth.py", &[]);
}

#[test]
fn health_and_metrics_endpoints_answer() {
    let (b, _dir) = broker(&[]);
    assert_eq!(b.http_get("/livez").unwrap().0, 200);
    assert_eq!(b.http_get("/readyz").unwrap().0, 200);
    let (status, body) = b.http_get("/metrics").unwrap();
    assert_eq!(status, 200);
    assert!(body.contains("felix_broker_ready 1"), "{body}");
    assert!(
        body.contains("felix_broker_publish_records_total{core=\"0\"}"),
        "{body}"
    );
}

#[test]
fn sigterm_drains_and_exits_cleanly() {
    let (mut b, _dir) = broker(&[]);
    let out = run_python(&b, "cache.py", &[]).unwrap();
    expect_success("cache.py", &out).unwrap();
    assert!(
        b.terminate(std::time::Duration::from_secs(10)),
        "exit status 0 after SIGTERM"
    );
}
