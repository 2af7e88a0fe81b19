//! The standard SDK (`felix-client==0.6.2` from PyPI, `import felix`) against
//! `felix-broker dev`, as a user would drive it.

use felix_cluster::{BrokerProcess, expect_success, run_python};

fn broker(extra: &[&str]) -> (BrokerProcess, tempfile::TempDir) {
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_felix-broker-under-test"));
    BrokerProcess::start_dev_in_temp_dir(bin, extra).unwrap()
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

/// A broker whose group claims lapse in a second and whose records dead-letter after
/// three deliveries, so the script sees both within seconds.
fn group_broker() -> (BrokerProcess, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let b = BrokerProcess::start_dev_with_config(
        std::path::Path::new(env!("CARGO_BIN_EXE_felix-broker-under-test")),
        dir.path(),
        "group_visibility_ms: 1000\ngroup_max_attempts: 3\n",
        &[],
    )
    .unwrap();
    (b, dir)
}

#[test]
fn sdk_consumer_groups_claim_ack_nack_dead_letter_and_redrive() {
    let (b, _dir) = group_broker();
    let out = run_python(&b, "groups.py", &[]).unwrap();
    eprintln!("{}", expect_success("groups.py", &out).unwrap());
}

#[test]
fn sdk_named_group_members_reclaim_their_own_claims_after_a_restart() {
    let (b, _dir) = broker(&[]);
    let out = run_python(&b, "group_members.py", &[]).unwrap();
    eprintln!("{}", expect_success("group_members.py", &out).unwrap());
}

#[test]
fn sdk_group_records_count_the_offsets_without_a_record_before_them() {
    let (b, _dir) = broker(&[]);
    let out = run_python(&b, "group_skipped.py", &[]).unwrap();
    eprintln!("{}", expect_success("group_skipped.py", &out).unwrap());
}

#[test]
fn a_group_neither_redelivers_acked_records_nor_loses_unacked_ones_across_sigkill() {
    let (mut b, dir) = group_broker();
    let acked = dir.path().join("acked.txt");
    let acked = acked.to_str().unwrap();
    let out = run_python(&b, "groups_restart.py", &["before", acked]).unwrap();
    eprintln!(
        "{}",
        expect_success("groups_restart.py before", &out).unwrap()
    );
    b.kill();
    b.restart().unwrap();
    let out = run_python(&b, "groups_restart.py", &["after", acked]).unwrap();
    eprintln!(
        "{}",
        expect_success("groups_restart.py after", &out).unwrap()
    );
}

#[test]
fn sdk_counters_are_exact_under_concurrent_writers_and_survive_sigkill() {
    let (mut b, _dir) = broker(&["--shards", "2"]);
    let out = run_python(&b, "counters.py", &["run"]).unwrap();
    eprintln!("{}", expect_success("counters.py run", &out).unwrap());
    b.kill();
    b.restart().unwrap();
    let out = run_python(&b, "counters.py", &["check"]).unwrap();
    eprintln!("{}", expect_success("counters.py check", &out).unwrap());
}

#[test]
fn sdk_commit_and_state_get_agree_on_versions_and_survive_sigkill() {
    let (mut b, _dir) = broker(&[]);
    let out = run_python(&b, "commit.py", &["run"]).unwrap();
    eprintln!("{}", expect_success("commit.py run", &out).unwrap());
    b.kill();
    b.restart().unwrap();
    let out = run_python(&b, "commit.py", &["check"]).unwrap();
    eprintln!("{}", expect_success("commit.py check", &out).unwrap());
}

/// Commits route by their entity key as keyed publishes do, and a prefix watch of a
/// cache of several shards names its shard: the broker read the SDK's base64 entity
/// key as text (an entity's events landed on another shard than its records), and
/// watched shard 0 of a prefix watch naming none (missing the others' keys).
#[test]
fn sdk_commits_route_by_entity_key_and_prefix_watches_name_a_shard() {
    run("commit_routing.py", &["--shards", "4"]);
}

#[test]
fn sdk_cache_watches_by_key_prefix_retained_and_from_an_offset() {
    run("watch.py", &[]);
}

/// Sixteen watchers of one cache taking 300 writes each see their changes in order,
/// answered from the changes the broker keeps in memory: each watcher read the log once
/// per write of any key of the cache (16 × 300 reads), every watcher woken by every
/// write.
#[test]
fn sdk_many_watchers_of_a_busy_cache_are_answered_without_reading_the_log() {
    let (b, _dir) = broker(&[]);
    let out = run_python(&b, "watch_many.py", &[]).unwrap();
    eprintln!("{}", expect_success("watch_many.py", &out).unwrap());
    let reads = b
        .metric("felix_broker_cache_watch_log_reads_total")
        .unwrap();
    eprintln!("{reads} watch reads from the log");
    assert!(reads <= 16, "{reads} watch reads from the log");
}

#[test]
fn health_and_metrics_endpoints_answer() {
    let (b, _dir) = broker(&[]);
    assert_eq!(b.http_get("/livez").unwrap().0, 200);
    assert_eq!(b.http_get("/readyz").unwrap().0, 200);
    let (status, body) = b.http_get("/metrics").unwrap();
    assert_eq!(status, 200);
    // Every series has HELP and TYPE, and every series the Grafana dashboard queries
    // exists (the dashboard cannot drift from the names).
    let typed: std::collections::BTreeSet<&str> = body
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE ")?.split(' ').next())
        .collect();
    for l in body
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let name = l.split(['{', ' ']).next().unwrap();
        let base = ["_bucket", "_sum", "_count", "_total"]
            .iter()
            .find_map(|s| name.strip_suffix(s).filter(|b| typed.contains(b)))
            .unwrap_or(name);
        assert!(typed.contains(base), "{name} has no TYPE line");
        assert!(
            body.contains(&format!("# HELP {base} ")),
            "{base} has no HELP line"
        );
    }
    let dashboard = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/ops/grafana-dashboard.json"),
    )
    .unwrap();
    let mut queried = 0;
    for part in dashboard.split("felix_broker_").skip(1) {
        let name: String = part
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || *c == '_')
            .collect();
        let name = format!("felix_broker_{name}");
        let base = ["_bucket", "_total"]
            .iter()
            .find_map(|s| name.strip_suffix(s).filter(|b| typed.contains(b)))
            .unwrap_or(&name);
        assert!(
            typed.contains(base),
            "the dashboard queries {name}, which /metrics lacks"
        );
        queried += 1;
    }
    assert!(queried >= 20, "{queried}");
    assert!(body.contains("felix_broker_ready 1"), "{body}");
    assert!(
        body.contains("felix_broker_publish_records_total{core=\"0\"}"),
        "{body}"
    );
    // Latency histograms: cumulative buckets per core, counted once per acked publish.
    assert!(
        body.contains("# TYPE felix_broker_publish_ack_seconds histogram"),
        "{body}"
    );
    let count = |body: &str, name: &str| -> u64 {
        body.lines()
            .filter(|l| l.starts_with(&format!("{name}_count{{")))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum()
    };
    assert_eq!(count(&body, "felix_broker_publish_ack_seconds"), 0);
    let out = run_python(&b, "streams.py", &[]).unwrap();
    expect_success("streams.py", &out).unwrap();
    let (_, body) = b.http_get("/metrics").unwrap();
    let acked = count(&body, "felix_broker_publish_ack_seconds");
    assert!(
        acked >= 20,
        "the acked publishes were timed: {acked}\n{body}"
    );
    let appends = count(&body, "felix_broker_append_commit_seconds");
    assert!(appends >= acked);
    // The last stage: answers written to a connection, then sent (once per send that
    // follows writes, so at most one per answer).
    let sent = count(&body, "felix_broker_answer_send_seconds");
    assert!(sent > 0, "answers' sends were timed: {body}");
    // The device stages (fsync on-commit here): each round's write and fdatasync,
    // sampled from the logs every 250 ms.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let (_, body) = b.http_get("/metrics").unwrap();
        let (writes, syncs) = (
            count(&body, "felix_broker_log_write_seconds"),
            count(&body, "felix_broker_log_fsync_seconds"),
        );
        if writes > 0 && syncs > 0 {
            // Per flush round, not per record: a round serves at least one append (a
            // publish without an ack may take a round of its own, so not per ack).
            assert!(
                syncs <= appends && writes <= appends,
                "{writes} {syncs} {appends}"
            );
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no device times: {body}"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    // The +Inf bucket of each core counts every observation.
    let inf: u64 = body
        .lines()
        .filter(|l| {
            l.starts_with("felix_broker_publish_ack_seconds_bucket{") && l.contains("le=\"+Inf\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum();
    assert_eq!(inf, acked, "{body}");
    assert!(body.ends_with("# EOF\n"), "OpenMetrics ends with # EOF");
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
