//! Our SDK against `felix-broker dev`: the guide's examples run as written, publish /
//! subscribe / cache, the `felix` CLI, and a sharded subscription that survives the
//! broker being killed and restarted.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use felix_client::{
    AckMode, ClientConfig, ClusterClient, ReconnectPolicy, ShardEvent, StartPosition,
};
use felix_cluster::BrokerProcess;

fn broker(extra: &[&str]) -> (BrokerProcess, tempfile::TempDir) {
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_felix-broker-under-test"));
    BrokerProcess::start_dev_in_temp_dir(bin, extra).unwrap()
}

/// `felix-broker dev` with `yaml` as its configuration file.
fn broker_with_config(yaml: &str) -> (BrokerProcess, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let b = BrokerProcess::start_dev_with_config(
        std::path::Path::new(env!("CARGO_BIN_EXE_felix-broker-under-test")),
        dir.path(),
        yaml,
        &[],
    )
    .unwrap();
    (b, dir)
}

fn config(b: &BrokerProcess) -> ClientConfig {
    let quinn = felix_client::quic_client_config_from_file(&b.ca_file(), false).unwrap();
    let mut config = ClientConfig::from_env_or_yaml(quinn, None).unwrap();
    config.auth_tenant_id = Some("dev".to_string());
    config.auth_token = Some(b.token());
    config
}

/// [`config`] whose idle connections end after 1 s: a broker gone is seen at once.
fn short_idle_config(b: &BrokerProcess) -> ClientConfig {
    let mut config = config(b);
    let mut transport = quinn::TransportConfig::default();
    transport.max_idle_timeout(Some(Duration::from_secs(1).try_into().unwrap()));
    config.quinn.transport_config(Arc::new(transport));
    config
}

/// The `felix` command, pointed at `b` with its dev token and CA.
fn felix(b: &BrokerProcess) -> std::process::Command {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_felix-under-test"));
    cmd.arg("--broker")
        .arg(b.listen.to_string())
        .arg("--token-file")
        .arg(b.data_dir.join("dev/token"))
        .arg("--ca")
        .arg(b.ca_file());
    cmd
}

/// Runs `felix args` against `b`, asserts it succeeded and returns what it wrote out.
fn felix_ok(b: &BrokerProcess, args: &[&str]) -> String {
    let out = felix(b).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn the_guides_connect_with_policy_example_runs() {
    let (b, _dir) = broker(&[]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        // As in the guide, with this broker's address as the one seed.
        let seeds: [SocketAddr; 1] = [b.listen];
        let client = ClusterClient::connect_with_policy(
            &seeds,
            "localhost",
            config(&b),
            ReconnectPolicy {
                attempts: 5,
                backoff: Duration::from_millis(200),
                max_backoff: Duration::from_secs(2),
                deadline: Some(Duration::from_secs(10)),
            },
        )
        .await
        .unwrap();
        let o = client
            .publish_at_least_once(
                "dev",
                "default",
                "orders",
                b"payload".to_vec(),
                AckMode::PerMessage,
            )
            .await
            .unwrap();
        assert_eq!(o, Some(0));
        // A single broker's topology names itself: the seed, once.
        assert_eq!(client.refresh_topology().await.unwrap(), 1);
        assert_eq!(
            client.endpoints(),
            vec![b.listen],
            "the seed and the broker it names are one endpoint"
        );
    });
}

/// Publishes owed no ack that a broker never read, on a connection a `ClusterClient`
/// then replaced, are its next flush's error: the flush of the client in use alone
/// answered `Ok` with them lost (until 2026-12-08).
#[test]
fn a_cluster_clients_flush_reports_what_a_replaced_connection_lost() {
    let (mut b, _dir) = broker(&[]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let config = short_idle_config(&b);
        let cc = ClusterClient::connect(&[b.listen], "localhost", config)
            .await
            .unwrap();
        let publish =
            |payload: &[u8], ack| cc.publish("dev", "default", "replaced", payload.to_vec(), ack);
        publish(b"first", AckMode::PerMessage).await.unwrap();
        // Killed, the broker reads none of these (stopped, it read them from its
        // socket's buffer once let go on); the connection then times out.
        b.kill();
        for _ in 0..50 {
            publish(b"unread", AckMode::None).await.unwrap();
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
        b.restart().unwrap();
        // The next call finds the connection lost and replaces it.
        let replaced = publish(b"after", AckMode::PerMessage).await;
        assert!(replaced.is_err(), "{replaced:?}");
        publish(b"after", AckMode::PerMessage).await.unwrap();
        let flushed = cc.flush_publishes().await;
        assert!(flushed.is_err(), "{flushed:?}");
        let (records, _) = cc
            .client()
            .stream_read("dev", "default", "replaced", 0, 0, None, None)
            .await
            .unwrap();
        let payloads: Vec<&[u8]> = records.iter().map(|r| &r.payload[..]).collect();
        assert_eq!(payloads, [&b"first"[..], b"after"], "the unread were lost");
        // Reported once: the next flush has nothing to say.
        cc.flush_publishes().await.unwrap();
    });
}

/// A publish owed no ack whose write fails is that call's error, and only that: the
/// next flush, with nothing else sent owed no ack, succeeds (it reported the same
/// record lost again until 2026-12-08, and a caller resending on that error sent it
/// twice).
#[test]
fn a_publish_owed_no_ack_whose_write_fails_is_reported_once() {
    let (b, _dir) = broker(&[]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let connect = || async {
        let config = short_idle_config(&b);
        felix_client::Client::connect(b.listen, "localhost", config)
            .await
            .unwrap()
    };
    rt.block_on(async {
        let c = connect().await;
        c.publish(
            "dev",
            "default",
            "once",
            b"first".to_vec(),
            AckMode::PerMessage,
        )
        .await
        .unwrap();
        // Stopped, the broker grants no more than its first window: the write of a
        // record larger than that waits until the connection times out.
        b.signal(libc::SIGSTOP);
        let big = vec![7u8; 12 << 20];
        let r = c
            .publish("dev", "default", "once", big, AckMode::None)
            .await;
        b.signal(libc::SIGCONT);
        assert!(
            matches!(r, Err(felix_client::ClientError::Connection { .. })),
            "{r:?}"
        );
        let flushed = c.flush_publishes().await;
        assert!(flushed.is_ok(), "reported twice: {flushed:?}");
        // One owed no ack sent before on that stream is still the flush's to report:
        // the stream's reset may have cut it off unread.
        let c = connect().await;
        c.publish("dev", "default", "once", b"before".to_vec(), AckMode::None)
            .await
            .unwrap();
        b.signal(libc::SIGSTOP);
        let r = c
            .publish("dev", "default", "once", vec![7u8; 12 << 20], AckMode::None)
            .await;
        b.signal(libc::SIGCONT);
        assert!(r.is_err(), "{r:?}");
        assert!(c.flush_publishes().await.is_err());
    });
}

/// With the cluster gone, a one-shot publish returns after one round of connects over
/// the endpoints, not the policy's five: it replaced its connection under the whole
/// policy, waiting out every round and backoff (with 6 s handshakes, half a minute and
/// more for a call meant to fail fast). A retried one makes its attempts' rounds and no
/// more. The next call still finds a broker that is back.
#[test]
fn a_one_shot_publish_with_the_cluster_down_returns_after_one_round_of_connects() {
    let (mut b, _dir) = broker(&[]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        // Idle connections end after 1 s here, and a handshake with no answer after
        // about 3 s (quinn waits three probe timeouts at least): eight rounds take 24 s
        // and more, one about 3.
        let config = short_idle_config(&b);
        let policy = ReconnectPolicy {
            attempts: 8,
            backoff: Duration::from_millis(100),
            max_backoff: Duration::from_millis(100),
            deadline: None,
        };
        let client =
            ClusterClient::connect_with_policy(&[b.listen], "localhost", config.clone(), policy)
                .await
                .unwrap();
        // A retried call's reconnects make one round each too, within its three
        // attempts: three rounds in all, not three for each reconnect.
        let retried = ClusterClient::connect_with_policy(
            &[b.listen],
            "localhost",
            config,
            ReconnectPolicy {
                attempts: 3,
                ..policy
            },
        )
        .await
        .unwrap();
        let publish = || {
            client.publish(
                "dev",
                "default",
                "orders",
                b"x".to_vec(),
                AckMode::PerMessage,
            )
        };
        let keyed = || {
            client.publish_keyed(
                "dev",
                "default",
                "orders",
                b"x".to_vec(),
                bytes::Bytes::from_static(b"k"),
                AckMode::PerMessage,
            )
        };
        assert_eq!(publish().await.unwrap(), Some(0));
        b.kill();
        let started = Instant::now();
        publish().await.unwrap_err();
        let first = started.elapsed();
        let started = Instant::now();
        keyed().await.unwrap_err();
        let second = started.elapsed();
        eprintln!("with the broker gone: a publish failed in {first:?}, a keyed one in {second:?}");
        assert!(first < Duration::from_secs(12), "{first:?}");
        assert!(second < Duration::from_secs(12), "{second:?}");
        let started = Instant::now();
        retried
            .publish_at_least_once(
                "dev",
                "default",
                "orders",
                b"x".to_vec(),
                AckMode::PerMessage,
            )
            .await
            .unwrap_err();
        let third = started.elapsed();
        eprintln!("a retried publish gave up in {third:?}");
        assert!(third < Duration::from_secs(17), "{third:?}");
        // Back: a one-shot call fails at most once more (on the connection the last
        // round could not replace), then lands.
        b.restart().unwrap();
        let mut landed = None;
        for _ in 0..3 {
            if let Ok(o) = publish().await {
                landed = o;
                break;
            }
        }
        assert_eq!(
            landed,
            Some(1),
            "the broker kept the first record and took this one"
        );
    });
}

#[test]
fn publish_subscribe_and_cache_through_the_sdk() {
    let (b, _dir) = broker(&[]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let c = ClusterClient::connect(&[b.listen], "localhost", config(&b))
            .await
            .unwrap();
        let mut live = c
            .subscribe_from("dev", "default", "s", Some(StartPosition::Latest))
            .await
            .unwrap();
        for i in 0..50u64 {
            let o = c
                .publish(
                    "dev",
                    "default",
                    "s",
                    format!("m{i}").into_bytes(),
                    AckMode::PerMessage,
                )
                .await
                .unwrap();
            assert_eq!(o, Some(i));
        }
        assert_eq!(
            c.publish("dev", "default", "s", b"x".to_vec(), AckMode::None)
                .await
                .unwrap(),
            None
        );
        let batch = c
            .client()
            .publish_batch(
                "dev",
                "default",
                "s",
                vec![b"b0".to_vec(), b"b1".to_vec()],
                AckMode::PerBatch,
            )
            .await
            .unwrap();
        assert_eq!(batch, Some(51));
        for i in 0..50u64 {
            let e = live.next_event().await.unwrap().unwrap();
            assert_eq!(
                (e.offset, e.payload.as_ref()),
                (Some(i), format!("m{i}").as_bytes())
            );
        }
        let mut replay = c
            .subscribe_from(
                "dev",
                "default",
                "s",
                Some(StartPosition::Offset(felix_wire::Offset(49))),
            )
            .await
            .unwrap();
        let e = replay.next_event().await.unwrap().unwrap();
        assert_eq!(e.offset, Some(49));
        assert!(matches!(
            c.subscribe_from(
                "dev",
                "default",
                "s",
                Some(StartPosition::Offset(felix_wire::Offset(999)))
            )
            .await,
            Err(felix_client::ClientError::Cursor(_))
        ));
        c.cache_put(
            "dev",
            "default",
            "c",
            "k",
            bytes::Bytes::from_static(b"v"),
            Some(60_000),
        )
        .await
        .unwrap();
        assert_eq!(
            c.cache_get("dev", "default", "c", "k")
                .await
                .unwrap()
                .as_deref(),
            Some(&b"v"[..])
        );
        assert_eq!(
            c.cache_delete("dev", "default", "c", "k")
                .await
                .unwrap()
                .as_deref(),
            Some(&b"v"[..])
        );
        assert_eq!(c.cache_get("dev", "default", "c", "k").await.unwrap(), None);
        // Another tenant's stream is refused before anything is sent.
        assert!(matches!(
            c.client().subscribe("other", "default", "s").await,
            Err(felix_client::ClientError::Config(_))
        ));
        // A wrong token is a terminal credential failure.
        let mut bad = config(&b);
        bad.auth_token = Some("nope".into());
        let started = std::time::Instant::now();
        let err = ClusterClient::connect(&[b.listen], "localhost", bad)
            .await
            .unwrap_err();
        assert!(err.is_credential_failure(), "{err}");
        assert!(
            started.elapsed() < Duration::from_millis(190),
            "not retried with backoff"
        );
    });
}

#[test]
fn a_sharded_subscription_survives_a_broker_restart_without_a_gap() {
    // 4 shards on 2 cores: the placement spreads them over both.
    let (mut b, _dir) = broker(&["--shards", "4", "--cores", "0-1"]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let policy = ReconnectPolicy {
            attempts: 40,
            backoff: Duration::from_millis(50),
            max_backoff: Duration::from_millis(250),
            deadline: None,
        };
        let c = Arc::new(
            ClusterClient::connect_with_policy(&[b.listen], "localhost", config(&b), policy)
                .await
                .unwrap(),
        );
        for i in 0..40u32 {
            c.publish_keyed(
                "dev",
                "default",
                "wide",
                format!("a{i}").into_bytes(),
                bytes::Bytes::from(format!("k{i}")),
                AckMode::PerMessage,
            )
            .await
            .unwrap();
        }
        let mut sub = c
            .subscribe_sharded("dev", "default", "wide", Some(StartPosition::Earliest))
            .await
            .unwrap();
        assert_eq!(sub.shards(), 4);
        let (_, placement) = b.http_get("/placement").unwrap();
        let mut seen: BTreeMap<u32, Vec<u64>> = BTreeMap::new();
        let mut payloads = Vec::new();
        while payloads.len() < 40 {
            if let Some(ShardEvent::Record { shard, event }) = sub.next().await {
                seen.entry(shard).or_default().push(event.offset.unwrap());
                payloads.push(event.payload);
            }
        }
        let cores: std::collections::BTreeSet<u64> =
            serde_json::from_str::<serde_json::Value>(&placement).unwrap()["shards"]
                .as_array()
                .map(|a| a.iter().filter_map(|s| s["core"].as_u64()).collect())
                .unwrap_or_default();
        assert_eq!(
            cores.len(),
            2,
            "the four shards live on both cores: {placement}"
        );
        // Kill the broker mid-subscription, restart it, publish more.
        b.restart().unwrap();
        let mut lost = std::collections::BTreeSet::new();
        let mut recovered = std::collections::BTreeSet::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        while recovered.len() < 4 {
            match tokio::time::timeout_at(deadline, sub.next())
                .await
                .expect("shards recover in time")
            {
                Some(ShardEvent::ShardLost { shard, .. }) => {
                    lost.insert(shard);
                }
                Some(ShardEvent::ShardRecovered { shard }) => {
                    assert!(lost.contains(&shard), "recovered only after lost");
                    recovered.insert(shard);
                }
                Some(ShardEvent::Record { .. }) => panic!("no new records were published"),
                Some(other) => panic!("a restart is not a move or a deletion: {other:?}"),
                None => panic!("the subscription ended"),
            }
        }
        assert_eq!(lost.len(), 4, "every shard was lost");
        for i in 40..80u32 {
            c.publish_keyed(
                "dev",
                "default",
                "wide",
                format!("a{i}").into_bytes(),
                bytes::Bytes::from(format!("k{i}")),
                AckMode::PerMessage,
            )
            .await
            .unwrap();
        }
        while payloads.len() < 80 {
            match tokio::time::timeout_at(deadline, sub.next())
                .await
                .expect("records after the restart")
            {
                Some(ShardEvent::Record { shard, event }) => {
                    seen.entry(shard).or_default().push(event.offset.unwrap());
                    payloads.push(event.payload);
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        for (shard, offsets) in &seen {
            assert_eq!(
                offsets,
                &(0..offsets.len() as u64).collect::<Vec<_>>(),
                "shard {shard}: no gap and no repeat across the restart"
            );
        }
        let mut got: Vec<_> = payloads
            .iter()
            .map(|p| String::from_utf8_lossy(p).to_string())
            .collect();
        got.sort();
        let mut want: Vec<_> = (0..80).map(|i| format!("a{i}")).collect();
        want.sort();
        assert_eq!(got, want);
    });
}

#[test]
fn felix_pub_piped_into_felix_sub() {
    let (b, _dir) = broker(&[]);
    let sub = felix(&b)
        .args(["sub", "orders", "--from", "earliest", "--count", "3"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut publ = felix(&b)
        .args(["pub", "orders"])
        .stdin(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    publ.stdin
        .take()
        .unwrap()
        .write_all(b"one\ntwo\nthree\n")
        .unwrap();
    assert!(publ.wait().unwrap().success());
    let out = sub.wait_with_output().unwrap();
    assert!(out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stdout), "one\ntwo\nthree\n");
}

/// Runs `felix args` against `b` with `input` on its standard input; its output.
fn felix_with_input(b: &BrokerProcess, args: &[&str], input: &[u8]) -> std::process::Output {
    use std::io::Write;
    let mut child = felix(b)
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(input).unwrap();
    child.wait_with_output().unwrap()
}

/// `felix read` reads every page up to `--end` or `--max` (a broker answers at most
/// 1,000 records a read when no maximum is asked): it printed the first page and exited
/// 0 (until 2026-12-08).
#[test]
fn felix_read_reads_every_page_it_was_asked_for() {
    let (b, _dir) = broker(&[]);
    let lines: String = (0..2500).map(|i| format!("r{i}\n")).collect();
    let published = felix_with_input(&b, &["pub", "pages"], lines.as_bytes());
    assert!(published.status.success(), "{published:?}");
    let count = |args: &[&str]| felix_ok(&b, args).lines().count();
    assert_eq!(count(&["read", "pages"]), 2500);
    assert_eq!(count(&["read", "pages", "--end", "1500"]), 1500);
    assert_eq!(
        count(&["read", "pages", "--from", "100", "--max", "1200"]),
        1200
    );
    let json = felix_ok(&b, &["--json", "read", "pages", "--from", "2000"]);
    let last: serde_json::Value = serde_json::from_str(json.lines().last().unwrap()).unwrap();
    assert_eq!(last["next_offset"], 2500, "{last}");
    assert_eq!(json.lines().count(), 501);
}

/// Payloads need not be text: `felix pub` takes standard input's lines as bytes (a line
/// that was not UTF-8 ended it part-way, exit 2), and `--json` gives a payload that is
/// not UTF-8 in base64 beside its text (which has U+FFFD in place of the bytes, all a
/// JSON reader got until 2026-12-08).
#[test]
fn felix_publishes_and_shows_payloads_that_are_not_text() {
    let (b, _dir) = broker(&[]);
    let published = felix_with_input(&b, &["pub", "bytes"], b"a\n\xff\xfe\r\nc\n");
    assert!(published.status.success(), "{published:?}");
    let json = felix_ok(&b, &["--json", "read", "bytes"]);
    let rows: Vec<serde_json::Value> = json
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows[0]["payload"], "a");
    assert!(rows[0].get("payload_base64").is_none(), "{}", rows[0]);
    assert_eq!(rows[1]["payload_base64"], "//4=", "{}", rows[1]);
    assert_eq!(rows[2]["payload"], "c");
    assert_eq!(rows.len(), 4, "three records and the next offset: {json}");
}

/// What a command could not write out is exit 8 (as the module docs say), also where
/// the result was printed and not otherwise needed: the commands ignored those write
/// errors and exited 0; `felix pin` panicked (101) after pinning, and `felix top` drew
/// into a closed output for good (until 2026-12-08). Bad numbers of seconds are usage
/// errors: `nan` panicked, a negative time to live put a value that expired at once.
#[test]
fn felix_output_it_could_not_write_and_bad_seconds_are_failures() {
    let (b, _dir) = broker(&[]);
    let full = || {
        std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .unwrap()
    };
    let code = |args: &[&str]| {
        let out = felix(&b).args(args).stdout(full()).output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (published, why) = code(&["--json", "pub", "full", "x"]);
    assert_eq!(published, Some(8), "{why}");
    let http = b.http.to_string();
    let (pinned, why) = code(&["pin", "--http", &http, "dev/default/full/0=0"]);
    assert_eq!(pinned, Some(8), "{why}");
    let (drawn, why) = code(&["top", "--http", &http, "--interval", "0.1"]);
    assert_eq!(drawn, Some(8), "{why}");
    let usage = |args: &[&str]| felix(&b).args(args).output().unwrap().status.code();
    assert_eq!(
        usage(&["top", "--http", &http, "--interval", "nan"]),
        Some(2)
    );
    assert_eq!(
        usage(&["cache", "put", "c", "k", "v", "--ttl", "-5"]),
        Some(2)
    );
    assert_eq!(
        usage(&["cache", "put", "c", "k", "v", "--ttl", "0"]),
        Some(2)
    );
}

/// `felix pub --ack none` delivers every message before it exits: a publish without an
/// ack returns once written to the send buffer, and the command exited (0) with its
/// messages still there.
#[test]
fn felix_pub_without_acks_delivers_every_message_before_it_exits() {
    let (b, _dir) = broker(&[]);
    let messages: Vec<String> = (0..200).map(|i| format!("m{i}")).collect();
    let status = felix(&b)
        .args(["pub", "fire", "--ack", "none"])
        .args(&messages)
        .status()
        .unwrap();
    assert!(status.success());
    let mut sub = felix(&b)
        .args(["sub", "fire", "--from", "earliest", "--count", "200"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while sub.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = sub.kill();
            panic!("`felix sub --count 200` still waits: messages were lost");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = sub.wait_with_output().unwrap();
    assert!(out.status.success());
    let got: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_owned)
        .collect();
    assert_eq!(got, messages);
}

/// A publish cancelled part way through writing its frame (a timeout around it) leaves
/// the connection's publish stream usable: the next publish is not read as the rest of
/// the cut frame, and every record read back is one that was published whole.
#[test]
fn a_publish_cancelled_part_way_leaves_the_publish_stream_whole() {
    let (b, _dir) = broker(&[]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let client = felix_client::Client::connect(b.listen, "localhost", config(&b))
            .await
            .unwrap();
        // Past the broker's 8 MiB stream window: the write waits for the broker to read.
        let big = vec![b'x'; 12 << 20];
        // How long one takes whole: the cuts below spread over it.
        let started = Instant::now();
        client
            .publish("dev", "default", "cut", big.clone(), AckMode::PerMessage)
            .await
            .unwrap();
        let whole = started.elapsed().as_micros() as u64;
        eprintln!("a 12 MiB publish takes {whole} µs");
        let mut cut = 0;
        for i in 0..20u64 {
            // Before, during and after the frame's write.
            let after = Duration::from_micros((i * 7_919) % whole.max(1));
            let publish = client.publish("dev", "default", "cut", big.clone(), AckMode::PerMessage);
            if tokio::time::timeout(after, publish).await.is_err() {
                cut += 1;
            }
            let small = format!("small-{i}").into_bytes();
            client
                .publish("dev", "default", "cut", small, AckMode::PerMessage)
                .await
                .unwrap_or_else(|e| panic!("the publish after {i}: {e}"));
        }
        eprintln!("{cut} of 20 large publishes cancelled part way");
        assert!(cut > 0, "no publish was cancelled: the test tests nothing");
        let mut sub = client
            .subscribe_from("dev", "default", "cut", Some(StartPosition::Earliest))
            .await
            .unwrap();
        let mut smalls = 0;
        let first = sub.next_event().await.unwrap().unwrap();
        assert_eq!(first.payload.len(), big.len(), "the whole one first");
        while smalls < 20 {
            let e = tokio::time::timeout(Duration::from_secs(10), sub.next_event())
                .await
                .expect("every record is read back")
                .unwrap()
                .unwrap();
            if e.payload.starts_with(b"small-") {
                assert_eq!(e.payload, format!("small-{smalls}").as_bytes());
                smalls += 1;
            } else {
                assert_eq!(e.payload.len(), big.len(), "a record of a cut frame");
                assert!(e.payload.iter().all(|c| *c == b'x'));
            }
        }
    });
}

/// `positions()` names the last record the application took, not the last one the
/// shard tasks read ahead into the channel: resuming from it skips nothing.
#[test]
fn a_sharded_subscriptions_positions_are_what_the_application_took() {
    let (b, _dir) = broker(&["--shards", "1"]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let c = Arc::new(
            ClusterClient::connect(&[b.listen], "localhost", config(&b))
                .await
                .unwrap(),
        );
        for i in 0..100u32 {
            c.publish(
                "dev",
                "default",
                "ahead",
                format!("r{i}").into_bytes(),
                AckMode::PerMessage,
            )
            .await
            .unwrap();
        }
        let mut sub = c
            .subscribe_sharded("dev", "default", "ahead", Some(StartPosition::Earliest))
            .await
            .unwrap();
        for want in 0..3u64 {
            match sub.next().await {
                Some(ShardEvent::Record { event, .. }) => assert_eq!(event.offset, Some(want)),
                other => panic!("{other:?}"),
            }
        }
        // Time for the shard task to read ahead into the channel.
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(sub.positions(), BTreeMap::from([(0, 2)]));
        drop(sub);
        let mut again = c
            .resubscribe_sharded(
                "dev",
                "default",
                "ahead",
                BTreeMap::from([(0, 2)]),
                Some(StartPosition::Earliest),
            )
            .await
            .unwrap();
        match again.next().await {
            Some(ShardEvent::Record { event, .. }) => assert_eq!(event.offset, Some(3)),
            other => panic!("{other:?}"),
        }
    });
}

/// A shard lost before it delivered anything resumes where its subscription began,
/// not at the latest record again: what was written while it was lost is delivered.
#[test]
fn a_sharded_subscription_from_the_latest_record_lost_before_its_first_misses_nothing() {
    let (mut b, _dir) = broker(&["--shards", "1"]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let policy = ReconnectPolicy {
            attempts: 40,
            backoff: Duration::from_millis(50),
            max_backoff: Duration::from_millis(250),
            deadline: None,
        };
        let c = Arc::new(
            ClusterClient::connect_with_policy(&[b.listen], "localhost", config(&b), policy)
                .await
                .unwrap(),
        );
        c.publish(
            "dev",
            "default",
            "quiet",
            b"before".to_vec(),
            AckMode::PerMessage,
        )
        .await
        .unwrap();
        let mut sub = c
            .subscribe_sharded("dev", "default", "quiet", None)
            .await
            .unwrap();
        b.restart().unwrap();
        // Written at once, while the shard is being re-established.
        let writer = felix_client::Client::connect(b.listen, "localhost", config(&b))
            .await
            .unwrap();
        for i in 0..50 {
            writer
                .publish(
                    "dev",
                    "default",
                    "quiet",
                    format!("r{i}").into_bytes(),
                    AckMode::PerMessage,
                )
                .await
                .unwrap();
        }
        let mut got = Vec::new();
        while got.len() < 50 {
            match tokio::time::timeout(Duration::from_secs(20), sub.next()).await {
                Ok(Some(ShardEvent::Record { event, .. })) => {
                    got.push(String::from_utf8_lossy(&event.payload).to_string())
                }
                Ok(Some(ShardEvent::ShardLost { .. } | ShardEvent::ShardRecovered { .. })) => {}
                other => panic!("{} of 50 delivered, then {other:?}", got.len()),
            }
        }
        assert_eq!(got, (0..50).map(|i| format!("r{i}")).collect::<Vec<_>>());
    });
}

/// An idempotent producer's call dropped part way (a timeout around it) leaves its
/// batch in doubt: the next batch is refused locally until that one is re-sent, and
/// the producer never ends. (Its sequence went to the next batch: where the dropped
/// one had landed, the broker refused that `sequence_reused` and ended the producer.)
#[test]
fn an_idempotent_call_dropped_part_way_leaves_its_batch_in_doubt_not_its_sequence_reused() {
    let (b, _dir) = broker(&[]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let cluster = ClusterClient::connect(&[b.listen], "localhost", config(&b))
            .await
            .unwrap();
        let p = cluster.idempotent_producer().await.unwrap();
        let mut in_doubt = 0;
        for i in 0..40u64 {
            let a = format!("a{i}").into_bytes();
            let after = Duration::from_micros((i * 7_919) % 3_000);
            let _ =
                tokio::time::timeout(after, p.publish("dev", "default", "doubt", a.clone())).await;
            let b_i = format!("b{i}").into_bytes();
            loop {
                match p.publish("dev", "default", "doubt", b_i.clone()).await {
                    Ok(_) => break,
                    Err(felix_client::ClientError::Config(why)) if why.contains("re-send") => {
                        in_doubt += 1;
                        p.publish("dev", "default", "doubt", a.clone())
                            .await
                            .unwrap_or_else(|e| panic!("re-sending a{i}: {e}"));
                    }
                    Err(e) => panic!("b{i}: {e}"),
                }
            }
        }
        eprintln!("{in_doubt} of 40 batches were in doubt after their call was dropped");
        assert!(
            in_doubt > 0,
            "no call was dropped part way: the test tests nothing"
        );
        // Every b once, in order; every a at most once, before its b.
        let c = cluster.client();
        let mut sub = c
            .subscribe_from("dev", "default", "doubt", Some(StartPosition::Earliest))
            .await
            .unwrap();
        let mut seen = Vec::new();
        while seen.last().map(String::as_str) != Some("b39") {
            let e = tokio::time::timeout(Duration::from_secs(10), sub.next_event())
                .await
                .expect("every record is read back")
                .unwrap()
                .unwrap();
            seen.push(String::from_utf8_lossy(&e.payload).to_string());
        }
        let mut want_b = 0;
        for r in &seen {
            if let Some(n) = r.strip_prefix('b') {
                assert_eq!(n.parse::<u64>().unwrap(), want_b, "{seen:?}");
                want_b += 1;
            }
        }
        let a_seen: Vec<_> = seen.iter().filter(|r| r.starts_with('a')).collect();
        let distinct: std::collections::BTreeSet<_> = a_seen.iter().collect();
        assert_eq!(distinct.len(), a_seen.len(), "an a landed twice: {seen:?}");
    });
}

/// A request larger than a frame may be, or a batch of more records than a publish
/// may hold, is refused before anything is sent. The broker ended the stream on the
/// frame's header, so the call failed as a lost connection, outcome unknown:
/// `publish_at_least_once` reconnected and sent it five times, and an idempotent
/// producer kept the batch in doubt for good (every later batch refused locally until
/// that one was sent again, which could never succeed).
#[test]
fn requests_too_large_for_a_frame_are_refused_before_they_are_sent() {
    let (b, _dir) = broker(&[]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let cluster = ClusterClient::connect(&[b.listen], "localhost", config(&b))
            .await
            .unwrap();
        let too_large = |r: Result<_, felix_client::ClientError>| {
            matches!(r, Err(felix_client::ClientError::Config(why)) if why.contains("nothing was sent"))
        };
        let before = cluster.client();
        let big = vec![b'x'; 17 << 20];
        let sent = cluster
            .publish_at_least_once("dev", "default", "big", big.clone(), AckMode::PerMessage)
            .await;
        assert!(too_large(sent.map(|_| ())), "refused locally, not given up on");
        assert!(Arc::ptr_eq(&before, &cluster.client()), "no reconnect");
        let c = cluster.client();
        let many = vec![b"r".to_vec(); 65_537];
        assert!(too_large(c.publish_batch("dev", "default", "big", many, AckMode::PerBatch).await.map(|_| ())));
        let o = c.publish("dev", "default", "big", b"small".to_vec(), AckMode::PerMessage).await;
        assert_eq!(o.unwrap(), Some(0), "nothing of the refused ones was written");
        // An idempotent producer's batch goes as JSON, its payloads in base64: 13 MiB
        // is past the frame.
        let p = cluster.idempotent_producer().await.unwrap();
        let r = p.publish("dev", "default", "big", vec![b'x'; 13 << 20]).await;
        assert!(too_large(r.map(|_| ())));
        p.publish("dev", "default", "big", b"next".to_vec())
            .await
            .expect("the refused batch is not in doubt");
    });
}

/// `felix sub --count N` whose stream is deleted before N records fails, saying so: it
/// exited 0, as if it had read them.
#[test]
fn felix_sub_cut_short_by_a_deleted_stream_fails() {
    let (b, _dir) = broker(&[]);
    let admin = b.admin().unwrap();
    let streams = "/v1/tenants/dev/namespaces/default/streams";
    admin
        .post(
            streams,
            &serde_json::json!({"stream": "doomed", "kind": "Stream", "shards": 1}),
        )
        .unwrap();
    let mut sub = felix(&b)
        .args(["sub", "doomed", "--from", "earliest", "--count", "5"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    admin.delete(&format!("{streams}/doomed")).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while sub.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = sub.kill();
            panic!("`felix sub` still waits on a deleted stream");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = sub.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "exited 0 with 0 of 5 records: {err}");
    assert!(err.contains("deleted"), "{err}");
}

#[test]
fn dev_mode_embeds_a_control_plane() {
    let (b, _dir) = broker(&[]);
    let url = b
        .controlplane
        .clone()
        .expect("dev mode reports its control plane");
    let felix = |args: &[&str]| {
        felix(&b)
            .args(["--controlplane", &url, "--controlplane-token-file"])
            .arg(b.data_dir.join("dev/controlplane.token"))
            .args(args)
            .output()
            .unwrap()
    };
    // A stream made through the API reaches the broker with its shard count.
    let out = felix(&["stream", "create", "wide", "--shards", "4"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    felix_cluster::wait_for(
        "the broker learns of `wide`",
        Duration::from_secs(10),
        || {
            let out = felix(&["shards", "wide"]);
            (String::from_utf8_lossy(&out.stdout).trim() == "4").then_some(())
        },
    )
    .unwrap();
    // A stream the broker made on first use shows up in the API.
    let out = felix(&["pub", "auto", "hello"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    felix_cluster::wait_for(
        "`auto` listed by the control plane",
        Duration::from_secs(10),
        || {
            let out = felix(&["stream", "list"]);
            let text = String::from_utf8_lossy(&out.stdout).to_string();
            (text.contains("auto shards=1") && text.contains("wide shards=4")).then_some(())
        },
    )
    .unwrap();
    // The API refuses to redefine what the broker already made.
    let out = felix(&["stream", "create", "auto", "--shards", "4"]);
    assert_eq!(
        out.status.code(),
        Some(6),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn our_sdk_and_the_felix_command_serve_consumer_groups() {
    use felix_client::{GroupRef, PollOptions};
    let (b, _dir) = broker(&[]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let seeds: [SocketAddr; 1] = [b.listen];
        let cluster = ClusterClient::connect(&seeds, "localhost", config(&b))
            .await
            .unwrap();
        for i in 0..6 {
            cluster
                .publish(
                    "dev",
                    "default",
                    "tasks",
                    format!("t{i}").into_bytes(),
                    AckMode::PerMessage,
                )
                .await
                .unwrap();
        }
        let c = cluster.client();
        let g = GroupRef::new("dev", "default", "tasks", 0, "sdk");
        let quick = PollOptions {
            max_records: 4,
            wait: Duration::from_millis(200),
            visibility: Some(Duration::from_secs(60)),
        };
        let got = c.group_poll(&g, quick).await.unwrap();
        assert_eq!(
            got.iter().map(|r| r.offset.0).collect::<Vec<_>>(),
            vec![0, 1, 2, 3]
        );
        c.group_ack(&g, 0).await.unwrap();
        c.group_ack(&g, 1).await.unwrap();
        c.group_dead_letter(&g, 2).await.unwrap();
        c.group_nack(&g, 3, got[3].attempts, Duration::from_secs(30))
            .await
            .unwrap();
        let info = c.group_describe(&g).await.unwrap();
        assert_eq!(info.committed, Some(3), "{info:?}");
        // The tail counts the group's own events too (they live in the shard's log).
        assert!(info.tail >= 6, "{info:?}");
        assert_eq!((info.owed, info.dead_letters), (1, 1), "{info:?}");
        // The delayed record waits; the next two go out.
        let got = c.group_poll(&g, quick).await.unwrap();
        assert_eq!(
            got.iter().map(|r| r.offset.0).collect::<Vec<_>>(),
            vec![4, 5]
        );
        assert_eq!(c.group_dead_letters(&g).await.unwrap(), vec![2]);
        // Seek moves the cursor and forgets claims; delete removes the group.
        assert_eq!(
            c.group_seek(&g, StartPosition::Offset(felix_wire::Offset(5)), false)
                .await
                .unwrap(),
            (5, true)
        );
        assert_eq!(c.group_describe(&g).await.unwrap().in_flight, 0);
        assert!(c.group_delete(&g).await.unwrap());
        assert!(!c.group_delete(&g).await.unwrap());
        assert_eq!(c.group_describe(&g).await.unwrap().committed, None);
        // A nack names its delivery's attempt: once that claim lapsed and went to
        // another consumer, the nack is refused and the other's claim stands (sent
        // without it, the nack took the record back from the other consumer).
        let g = GroupRef::new("dev", "default", "tasks", 0, "lapsing");
        let brief = PollOptions {
            max_records: 1,
            visibility: Some(Duration::from_millis(100)),
            ..quick
        };
        let first = c.group_poll(&g, brief).await.unwrap();
        assert_eq!((first[0].offset.0, first[0].attempts), (0, 1));
        tokio::time::sleep(Duration::from_millis(300)).await;
        let one = PollOptions {
            max_records: 1,
            ..quick
        };
        let second = c.group_poll(&g, one).await.unwrap();
        assert_eq!((second[0].offset.0, second[0].attempts), (0, 2));
        let e = c
            .group_nack(&g, 0, first[0].attempts, Duration::ZERO)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("claim"), "{e}");
        let third = c.group_poll(&g, one).await.unwrap();
        assert_eq!(
            third.iter().map(|r| r.offset.0).collect::<Vec<_>>(),
            vec![1],
            "the second consumer still holds offset 0"
        );
        assert!(c.group_delete(&g).await.unwrap());
        // An ack the group never handed out is a typed stale claim.
        let e = c
            .group_ack(&GroupRef::new("dev", "default", "tasks", 0, "other"), 1)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("stale"), "{e}");

        // 64 acks sent at once all settle: the cursor passes every record.
        let payloads = (0..64).map(|i| format!("b{i}").into_bytes()).collect();
        c.publish_batch("dev", "default", "burst", payloads, AckMode::PerMessage)
            .await
            .unwrap();
        let g = GroupRef::new("dev", "default", "burst", 0, "sdk");
        let claimed = c
            .group_poll(
                &g,
                PollOptions {
                    max_records: 64,
                    ..quick
                },
            )
            .await
            .unwrap();
        assert_eq!(claimed.len(), 64);
        let acks: Vec<_> = claimed
            .iter()
            .map(|r| {
                let (c, g, o) = (c.clone(), g.clone(), r.offset.0);
                tokio::spawn(async move { c.group_ack(&g, o).await })
            })
            .collect();
        for a in acks {
            a.await.unwrap().unwrap();
        }
        let info = c.group_describe(&g).await.unwrap();
        assert_eq!((info.in_flight, info.owed), (0, 0), "{info:?}");
        // Past the records and the group's own events after them.
        assert_eq!(info.committed, Some(info.tail), "{info:?}");
        assert!(info.tail > claimed[63].offset.0, "{info:?}");

        // A named member's poll; the record it gets counts the group's 64 ack events
        // below it, the offsets between it and the last record holding none.
        let next = c
            .publish_batch(
                "dev",
                "default",
                "burst",
                vec![b"next".to_vec()],
                AckMode::PerBatch,
            )
            .await
            .unwrap()
            .unwrap();
        let mine = c.group_poll_as(&g, quick, "worker-a", false).await.unwrap();
        assert_eq!(mine.len(), 1, "{mine:?}");
        assert_eq!(mine[0].offset.0, next);
        assert_eq!(mine[0].skipped_before, next - claimed[63].offset.0 - 1);
        assert!(mine[0].skipped_before >= 64, "{mine:?}");
        // Its claim is its own: a reclaim hands it back on the same attempt.
        let back = c.group_poll_as(&g, quick, "worker-a", true).await.unwrap();
        assert_eq!(
            back.iter()
                .map(|r| (r.offset.0, r.attempts))
                .collect::<Vec<_>>(),
            vec![(next, 1)]
        );
    });
    // The command line: poll with --ack, then describe.
    let run = |args: &[&str]| felix_ok(&b, args);
    let polled = run(&[
        "group", "poll", "tasks", "cli", "--max", "10", "--wait", "0.2", "--ack",
    ]);
    assert_eq!(polled, "t0\nt1\nt2\nt3\nt4\nt5\n");
    // A named member, with what --json shows of each record.
    run(&["pub", "tasks", "t6"]);
    let polled = run(&[
        "--json",
        "group",
        "poll",
        "tasks",
        "cli",
        "--consumer",
        "worker-a",
        "--wait",
        "0.2",
        "--ack",
    ]);
    let polled: serde_json::Value = serde_json::from_str(polled.trim()).unwrap();
    assert_eq!(polled["attempts"], 1, "{polled}");
    assert!(polled["skipped_before"].as_u64().unwrap() > 0, "{polled}");
    let described = run(&["group", "describe", "tasks", "cli"]);
    // Everything is finished: the cursor passed the records and the group events after
    // them, so the lag is 0.
    assert!(described.contains("\nlag 0\n"), "{described}");
    assert_eq!(run(&["group", "dead-letters", "tasks", "cli"]), "");
}

/// Publishes `batches` batches of 30 records of 1,000 bytes `fill` to `dev/default/jobs`;
/// their offsets.
async fn publish_jobs(
    c: &felix_client::Client,
    batches: usize,
    fill: u8,
) -> std::collections::BTreeSet<u64> {
    let mut offsets = std::collections::BTreeSet::new();
    for _ in 0..batches {
        let records = vec![vec![fill; 1000]; 30];
        let first = c
            .publish_batch("dev", "default", "jobs", records, AckMode::PerBatch)
            .await
            .unwrap()
            .unwrap();
        offsets.extend(first..first + 30);
    }
    offsets
}

/// A shard's groups are rebuilt after a restart from the newest group snapshot, reading
/// a bounded stretch of the log instead of all of it, and come back exactly: acked
/// records are not handed out again, unacked ones are, once each, and the dead letters
/// are listed; a restarted broker that sees no group request still snapshots them as
/// records arrive. (4 MiB of records in 256 KiB segments, a snapshot every 128 KiB.)
#[test]
fn a_restart_builds_a_groups_state_from_its_newest_snapshot() {
    use felix_client::{GroupRef, PollOptions};
    use std::collections::BTreeSet;
    let (mut b, _dir) = broker_with_config(
        "segment_bytes: 262144\ngroup_snapshot_bytes: 131072\nhousekeeping_ms: 100\n",
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    let g = GroupRef::new("dev", "default", "jobs", 0, "workers");
    let poll = PollOptions {
        max_records: 300,
        wait: Duration::from_millis(300),
        visibility: Some(Duration::from_secs(600)),
    };
    // Left unacked, and dead-lettered: by offset.
    let unacked = |o: u64| o.is_multiple_of(97);
    let dead = |o: u64| o % 101 == 5 && !unacked(o);
    let (mut left, dead_letters) = rt.block_on(async {
        let c = felix_client::Client::connect(b.listen, "localhost", config(&b))
            .await
            .unwrap();
        let (mut left, mut dead_letters) = (BTreeSet::new(), BTreeSet::new());
        for _round in 0..10 {
            let mut published: BTreeSet<u64> = publish_jobs(&c, 10, b'r').await;
            while !published.is_empty() {
                let got = c.group_poll(&g, poll).await.unwrap();
                assert!(!got.is_empty(), "records still unclaimed: {published:?}");
                for r in got {
                    let o = r.offset.0;
                    assert!(published.remove(&o), "offset {o} handed out twice");
                    if unacked(o) {
                        left.insert(o);
                    } else if dead(o) {
                        c.group_dead_letter(&g, o).await.unwrap();
                        dead_letters.insert(o);
                    } else {
                        c.group_ack(&g, o).await.unwrap();
                    }
                }
            }
        }
        (left, dead_letters)
    });
    let snapshots = b.metric("felix_broker_group_snapshots_total").unwrap();
    assert!(snapshots >= 5, "{snapshots} snapshots in ~3 MB");
    // Records keep coming while nobody consumes: snapshots go on (housekeeping), so the
    // next fold still starts near the end.
    rt.block_on(async {
        let c = felix_client::Client::connect(b.listen, "localhost", config(&b))
            .await
            .unwrap();
        left.extend(publish_jobs(&c, 20, b'i').await);
    });
    felix_cluster::wait_for(
        "a snapshot with no group request",
        Duration::from_secs(10),
        || (b.metric("felix_broker_group_snapshots_total").ok()? > snapshots).then_some(()),
    )
    .unwrap();
    let log_bytes = 4_200 * 1_000;
    let snapshots = b.metric("felix_broker_group_snapshots_total").unwrap();
    b.kill();
    b.restart().unwrap();
    // Restarted, with records arriving and no group request: the broker knows from its
    // log that the stream has groups, and snapshots them as before.
    rt.block_on(async {
        let c = felix_client::Client::connect(b.listen, "localhost", config(&b))
            .await
            .unwrap();
        left.extend(publish_jobs(&c, 20, b'j').await);
    });
    felix_cluster::wait_for(
        "a snapshot after the restart with no group request",
        Duration::from_secs(10),
        || (b.metric("felix_broker_group_snapshots_total").ok()? > 0).then_some(()),
    )
    .unwrap();
    rt.block_on(async {
        let c = felix_client::Client::connect(b.listen, "localhost", config(&b))
            .await
            .unwrap();
        let mut again = BTreeSet::new();
        loop {
            let got = c.group_poll(&g, poll).await.unwrap();
            if got.is_empty() {
                break;
            }
            for r in got {
                assert!(again.insert(r.offset.0), "{} handed out twice", r.offset.0);
            }
        }
        let extra: Vec<_> = again.difference(&left).take(10).collect();
        let missing: Vec<_> = left.difference(&again).take(10).collect();
        assert!(
            extra.is_empty() && missing.is_empty(),
            "exactly the {} unacked records go out again: {} did, among them acked {extra:?}; missing {missing:?}",
            left.len(),
            again.len()
        );
        assert_eq!(
            c.group_dead_letters(&g)
                .await
                .unwrap()
                .into_iter()
                .collect::<BTreeSet<_>>(),
            dead_letters
        );
    });
    let (folds, from_snapshot, read) = (
        b.metric("felix_broker_group_folds_total").unwrap(),
        b.metric("felix_broker_group_folds_from_snapshot_total")
            .unwrap(),
        b.metric("felix_broker_group_fold_bytes_total").unwrap(),
    );
    eprintln!(
        "{snapshots} snapshots; after the restart {folds} fold(s), {from_snapshot} from a snapshot, {read} bytes read of ~{log_bytes}"
    );
    assert_eq!((folds, from_snapshot), (1, 1));
    assert!(
        read < 3 << 19,
        "the fold read {read} bytes of a ~{log_bytes}-byte log"
    );
}

#[test]
fn an_idempotent_resend_lands_once_even_after_a_broker_restart() {
    use felix_client::ClientError;
    use felix_wire::message::PublishRefusalReason;
    let (mut b, _dir) = broker(&[]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let seeds: [SocketAddr; 1] = [b.listen];
    let publish = |c: &felix_client::Client, producer: u64, seq: u64, body: &str| {
        let payloads = vec![bytes::Bytes::from(body.to_string())];
        let c = c.clone();
        async move {
            c.publish_idempotent("dev", "default", "idem", None, payloads, producer, seq)
                .await
        }
    };
    let producer = rt.block_on(async {
        let cluster = ClusterClient::connect(&seeds, "localhost", config(&b))
            .await
            .unwrap();
        let p = cluster.idempotent_producer().await.unwrap();
        for i in 0..5u64 {
            assert_eq!(
                p.publish("dev", "default", "idem", format!("r{i}").into_bytes())
                    .await
                    .unwrap(),
                i
            );
        }
        let c = cluster.client();
        // A re-send of batch 3 (its answer lost, say) is answered with its offset, not
        // appended again.
        assert_eq!(publish(&c, p.producer_id(), 3, "r3").await.unwrap(), 3);
        // A gap and a producer the broker never saw are refused, typed.
        match publish(&c, p.producer_id(), 9, "x").await {
            Err(ClientError::Refused {
                reason: PublishRefusalReason::SequenceGap { expected },
                ..
            }) => {
                assert_eq!(expected.0, 5)
            }
            other => panic!("expected a sequence gap, got {other:?}"),
        }
        match publish(&c, 12345, 4, "x").await {
            Err(ClientError::Refused {
                reason: PublishRefusalReason::UnknownProducer,
                ..
            }) => {}
            other => panic!("expected unknown_producer, got {other:?}"),
        }
        p.producer_id()
    });
    // After a restart the broker rebuilds what it knows of the producer from the log.
    b.kill();
    b.restart().unwrap();
    rt.block_on(async {
        let c = felix_client::Client::connect(b.listen, "localhost", config(&b))
            .await
            .unwrap();
        assert_eq!(
            publish(&c, producer, 4, "r4").await.unwrap(),
            4,
            "re-send after restart"
        );
        assert_eq!(
            publish(&c, producer, 5, "r5").await.unwrap(),
            5,
            "the next batch appends"
        );
        let mut sub = c
            .subscribe_from("dev", "default", "idem", Some(StartPosition::Earliest))
            .await
            .unwrap();
        let mut got = Vec::new();
        while got.len() < 6 {
            let e = tokio::time::timeout(Duration::from_secs(5), sub.next_event())
                .await
                .unwrap()
                .unwrap()
                .unwrap();
            got.push(String::from_utf8(e.payload.to_vec()).unwrap());
        }
        assert_eq!(got, ["r0", "r1", "r2", "r3", "r4", "r5"], "each batch once");
        assert!(
            tokio::time::timeout(Duration::from_millis(300), sub.next_event())
                .await
                .is_err(),
            "and nothing more"
        );
    });
}

/// The first idempotent publish after a restart builds the shard's producer table from
/// the snapshot housekeeping saved (or a clean stop saved) and the log after it, not
/// from the whole log, and decides as the whole log would: a batch from before the
/// snapshot and one after it are both answered from the log, the next appends, a gap is
/// refused with the sequence expected.
#[test]
fn an_idempotent_producers_table_is_built_from_its_snapshot_after_a_restart() {
    use felix_client::ClientError;
    use felix_wire::message::PublishRefusalReason;
    let (mut b, _dir) = broker_with_config(
        "segment_bytes: 65536\nproducer_snapshot_bytes: 65536\nhousekeeping_ms: 50\n",
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    let publish = |c: &felix_client::Client, producer: u64, seq: u64, body: Vec<u8>| {
        let c = c.clone();
        async move {
            c.publish_idempotent(
                "dev",
                "default",
                "snap",
                None,
                vec![bytes::Bytes::from(body)],
                producer,
                seq,
            )
            .await
        }
    };
    let body = |producer: u64, seq: u64| {
        let mut v = format!("{producer}-{seq}-").into_bytes();
        v.resize(1000, b'x');
        v
    };
    let connect = |b: &BrokerProcess| {
        let config = config(b);
        let listen = b.listen;
        async move {
            felix_client::Client::connect(listen, "localhost", config)
                .await
                .unwrap()
        }
    };
    // Producer 7 writes early (only the snapshot knows it after the restart); producer
    // 8 goes on writing ~400 KB, past several snapshots' worth.
    let log_bytes = 400_000u64;
    rt.block_on(async {
        let c = connect(&b).await;
        for seq in 0..3 {
            assert_eq!(publish(&c, 7, seq, body(7, seq)).await.unwrap(), seq);
        }
        for seq in 0..400 {
            assert_eq!(publish(&c, 8, seq, body(8, seq)).await.unwrap(), 3 + seq);
        }
    });
    felix_cluster::wait_for("a producer snapshot", Duration::from_secs(10), || {
        (b.metric("felix_broker_producer_snapshots_saved_total")
            .ok()?
            >= 2)
            .then_some(())
    })
    .unwrap();
    rt.block_on(async {
        let c = connect(&b).await;
        for seq in 400..410 {
            assert_eq!(publish(&c, 8, seq, body(8, seq)).await.unwrap(), 3 + seq);
        }
    });
    let decide_as_the_whole_log = |b: &BrokerProcess, next: u64| {
        rt.block_on(async {
            let c = connect(b).await;
            assert_eq!(
                publish(&c, 7, 1, body(7, 1)).await.unwrap(),
                1,
                "before the snapshot"
            );
            assert_eq!(
                publish(&c, 8, next - 1, body(8, next - 1)).await.unwrap(),
                2 + next,
                "the newest batch"
            );
            assert_eq!(publish(&c, 8, next, body(8, next)).await.unwrap(), 3 + next);
            match publish(&c, 7, 5, body(7, 5)).await {
                Err(ClientError::Refused {
                    reason: PublishRefusalReason::SequenceGap { expected },
                    ..
                }) => assert_eq!(expected.0, 3),
                other => panic!("expected a sequence gap, got {other:?}"),
            }
            match publish(&c, 8, 3, body(8, 4)).await {
                Err(ClientError::Refused {
                    reason: PublishRefusalReason::SequenceExpired,
                    ..
                }) => {}
                other => panic!("expected sequence_expired, got {other:?}"),
            }
        });
        (
            b.metric("felix_broker_producer_tables_from_snapshot_total")
                .unwrap(),
            b.metric("felix_broker_producer_table_read_bytes_total")
                .unwrap(),
        )
    };
    // A crash: the snapshot housekeeping saved last, then the log after it.
    b.kill();
    b.restart().unwrap();
    let (from_snapshot, read) = decide_as_the_whole_log(&b, 410);
    eprintln!(
        "after a crash: {from_snapshot} table(s) from a snapshot, {read} bytes read of ~{log_bytes}"
    );
    assert_eq!(from_snapshot, 1);
    assert!(
        read < log_bytes / 3,
        "read {read} bytes of a ~{log_bytes}-byte log"
    );
    // A clean stop saves the table as of the end: nothing is read after it.
    assert!(b.terminate(Duration::from_secs(30)), "stopped cleanly");
    b.restart().unwrap();
    let (from_snapshot, read) = decide_as_the_whole_log(&b, 411);
    eprintln!("after a clean stop: {from_snapshot} table(s) from a snapshot, {read} bytes read");
    assert_eq!((from_snapshot, read), (1, 0));
}

/// Requests on one client share a stream, one at a time. A request dropped part way
/// (a caller's timeout, a cancelled task) left its answer on that stream, and every
/// later request took the answer before its own: a `cache_get` answered with a
/// counter's sum, for good. Requests are cancelled here at random points around the
/// round trip; every request after each must get its own answer.
#[test]
fn a_request_dropped_part_way_leaves_no_answer_for_the_next_one() {
    let (b, _dir) = broker(&[]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let client = felix_client::Client::connect(b.listen, "localhost", config(&b))
            .await
            .unwrap();
        let v = bytes::Bytes::from_static(b"value");
        client
            .cache_put("dev", "default", "c", "k", v.clone(), None)
            .await
            .unwrap();
        let mut cancelled = 0;
        for i in 0..400u64 {
            // 0-600 µs: before the request is sent, while the broker answers, after.
            let after = Duration::from_micros((i * 7_919) % 600);
            let add = client.counter_add("dev", "default", "c", "n", 1);
            if tokio::time::timeout(after, add).await.is_err() {
                cancelled += 1;
            }
            let got = client.cache_get("dev", "default", "c", "k").await;
            assert_eq!(got.unwrap(), Some(v.clone()), "after request {i}");
        }
        eprintln!("{cancelled} of 400 adds cancelled part way");
        assert!(
            cancelled > 0,
            "no request was cancelled: the test tests nothing"
        );
    });
}

#[test]
fn conditional_cache_writes_apply_once_under_a_race() {
    use felix_wire::message::CacheCondition;
    let (b, _dir) = broker(&["--shards", "2"]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let connect = || async {
            felix_client::Client::connect(b.listen, "localhost", config(&b))
                .await
                .unwrap()
        };
        let clients: Vec<_> = futures_join(8, connect).await;
        // Eight clients race to create the same key: one wins.
        let racers = clients.iter().enumerate().map(|(i, c)| {
            let c = c.clone();
            tokio::spawn(async move {
                c.cache_put_if(
                    "dev",
                    "default",
                    "locks",
                    "leader",
                    format!("c{i}").into(),
                    None,
                    CacheCondition::Absent,
                )
                .await
                .unwrap()
            })
        });
        let mut won = Vec::new();
        for (i, r) in racers.collect::<Vec<_>>().into_iter().enumerate() {
            let (applied, version) = r.await.unwrap();
            if applied {
                won.push((i, version.unwrap()));
            }
        }
        assert_eq!(won.len(), 1, "exactly one create applies: {won:?}");
        let (winner, version) = won[0];
        let c = &clients[0];
        assert_eq!(
            c.cache_get("dev", "default", "locks", "leader")
                .await
                .unwrap()
                .as_deref(),
            Some(format!("c{winner}").as_bytes())
        );
        // A read gives the version a read-modify-write conditions on.
        assert_eq!(
            c.cache_get_versioned("dev", "default", "locks", "leader")
                .await
                .unwrap(),
            Some((format!("c{winner}").into(), version))
        );
        assert_eq!(
            c.cache_get_versioned("dev", "default", "locks", "absent")
                .await
                .unwrap(),
            None
        );
        // Eight race to replace it at the version they read: one wins again.
        let racers = clients.iter().enumerate().map(|(i, c)| {
            let c = c.clone();
            tokio::spawn(async move {
                c.cache_put_if(
                    "dev",
                    "default",
                    "locks",
                    "leader",
                    format!("r{i}").into(),
                    None,
                    CacheCondition::Version(version),
                )
                .await
                .unwrap()
            })
        });
        let mut applied = 0;
        let mut newest = None;
        for r in racers.collect::<Vec<_>>() {
            let (ok, v) = r.await.unwrap();
            if ok {
                applied += 1;
                newest = v;
            } else {
                assert!(
                    v.is_some_and(|v| v > version),
                    "a loser learns the newer version"
                );
            }
        }
        assert_eq!(applied, 1, "exactly one replace applies");
        // A delete at a stale version does nothing; at the current one it removes.
        assert!(
            !c.cache_delete_if("dev", "default", "locks", "leader", version)
                .await
                .unwrap()
        );
        assert!(
            c.cache_delete_if("dev", "default", "locks", "leader", newest.unwrap())
                .await
                .unwrap()
        );
        assert_eq!(
            c.cache_get("dev", "default", "locks", "leader")
                .await
                .unwrap(),
            None
        );
    });
}

/// `publish_if` writes a batch only where the caller expects the shard's tail: the
/// right tail appends at it, a stale one is refused with the tail and writes nothing,
/// eight racers at one tail land exactly one batch, and `felix pub --if-tail` does the
/// same from the command line. A commit's `expected_offset` works alongside.
#[test]
fn a_conditional_publish_lands_only_at_the_tail_it_expects() {
    use felix_wire::message::PublishRefusalReason;
    let (b, _dir) = broker(&["--shards", "2"]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let tail_refused = |r: Result<u64, felix_client::ClientError>| match r {
        Err(felix_client::ClientError::Refused {
            reason: PublishRefusalReason::OffsetMismatch { tail },
            ..
        }) => tail.0,
        other => panic!("expected an offset_mismatch refusal, got {other:?}"),
    };
    rt.block_on(async {
        let connect = || async {
            felix_client::Client::connect(b.listen, "localhost", config(&b))
                .await
                .unwrap()
        };
        let clients: Vec<_> = futures_join(8, connect).await;
        let c = &clients[0];
        let batch = |tag: &str, n: usize| -> Vec<bytes::Bytes> {
            (0..n)
                .map(|i| bytes::Bytes::from(format!("{tag}-{i}")))
                .collect()
        };
        // An empty shard's tail is 0; shard 1 is another log.
        assert_eq!(
            c.publish_if("dev", "default", "ledger", None, batch("a", 3), 0)
                .await
                .unwrap(),
            0
        );
        assert_eq!(
            c.publish_if("dev", "default", "ledger", Some(1), batch("z", 1), 0)
                .await
                .unwrap(),
            0
        );
        // A stale tail: refused with the tail, nothing written.
        assert_eq!(
            tail_refused(
                c.publish_if("dev", "default", "ledger", None, batch("b", 2), 0)
                    .await
            ),
            3
        );
        assert_eq!(
            tail_refused(
                c.publish_if("dev", "default", "ledger", None, batch("b", 2), 7)
                    .await
            ),
            3
        );
        assert_eq!(
            c.publish_if("dev", "default", "ledger", None, batch("b", 2), 3)
                .await
                .unwrap(),
            3
        );
        // Eight racers at tail 5: exactly one batch lands, the rest learn the new tail.
        let racers = clients.iter().enumerate().map(|(i, c)| {
            let c = c.clone();
            tokio::spawn(async move {
                let payloads = vec![
                    bytes::Bytes::from(format!("r{i}-0")),
                    bytes::Bytes::from(format!("r{i}-1")),
                ];
                (
                    i,
                    c.publish_if("dev", "default", "ledger", None, payloads, 5)
                        .await,
                )
            })
        });
        let mut won = Vec::new();
        for r in racers.collect::<Vec<_>>() {
            let (i, outcome) = r.await.unwrap();
            match outcome {
                Ok(offset) => won.push((i, offset)),
                refused => assert_eq!(tail_refused(refused), 7),
            }
        }
        assert_eq!(won.len(), 1, "exactly one racer lands: {won:?}");
        let winner = won[0].0;
        // A commit expecting a stale tail is refused the same way; at the tail it lands
        // (entity key "" routes to shard 1, which holds one record).
        let commit = |expected| {
            c.commit(
                "dev",
                "default",
                "ledger",
                "",
                bytes::Bytes::from("event"),
                vec![],
                Some(expected),
            )
        };
        assert_eq!(tail_refused(commit(0).await), 1);
        assert_eq!(commit(1).await.unwrap(), 1);
        // The shard holds exactly what was accepted, in order.
        let (records, _) = c
            .stream_read("dev", "default", "ledger", 0, 0, None, Some(100))
            .await
            .unwrap();
        let got: Vec<String> = records
            .iter()
            .map(|r| String::from_utf8_lossy(&r.payload).into_owned())
            .collect();
        let expected: Vec<String> = ["a-0", "a-1", "a-2", "b-0", "b-1"]
            .iter()
            .map(|s| s.to_string())
            .chain([format!("r{winner}-0"), format!("r{winner}-1")])
            .collect();
        assert_eq!(got, expected);
    });
    // The command line: the right tail prints the offset; a stale one fails and says
    // the tail.
    let run = |args: &[&str]| felix(&b).arg("--json").args(args).output().unwrap();
    let ok = run(&["pub", "ledger", "--if-tail", "0", "--shard", "1", "x"]);
    assert_eq!(
        ok.status.code(),
        Some(9),
        "shard 1's tail is 2: the condition fails"
    );
    assert!(
        String::from_utf8_lossy(&ok.stderr).contains("the shard's tail is 2"),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    let ok = run(&["pub", "ledger", "--if-tail", "2", "--shard", "1", "x", "y"]);
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&ok.stdout).trim(),
        r#"{"offset":2}"#
    );
}

async fn futures_join<F, Fut>(n: usize, f: F) -> Vec<felix_client::Client>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = felix_client::Client>,
{
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(f().await);
    }
    out
}

/// One key overwritten by 8 writers (12,000 puts and as many counter adds by default;
/// `FELIX_CACHE_OVERWRITES` asks for more — the long form ran 1,000,000, see
/// docs/state.md): the cache's log on disk stays under 1 MiB throughout (sampled every
/// 100 ms) and at the end, and every value, version and the counter's sum come back
/// after SIGKILL and restart.
#[test]
fn an_overwritten_cache_stays_small_on_disk_and_keeps_every_value_across_a_restart() {
    use felix_wire::message::CacheCondition;
    let (mut b, _dir) = broker_with_config("segment_bytes: 65536\ncache_compact_after: 2000\n");
    let rt = tokio::runtime::Runtime::new().unwrap();
    const WRITERS: usize = 8;
    let each: usize = std::env::var("FELIX_CACHE_OVERWRITES")
        .ok()
        .and_then(|n| n.parse::<usize>().ok())
        .unwrap_or(12_000)
        / WRITERS;
    let dir_bytes = |p: &std::path::Path| -> u64 {
        walk(p)
            .iter()
            .map(|f| f.metadata().map_or(0, |m| m.len()))
            .sum()
    };
    let caches = b.data_dir.join("caches");
    let sampling = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let peak = {
        let (sampling, caches) = (sampling.clone(), caches.clone());
        std::thread::spawn(move || {
            let mut peak = 0;
            while sampling.load(std::sync::atomic::Ordering::Relaxed) {
                peak = peak.max(dir_bytes(&caches));
                std::thread::sleep(Duration::from_millis(100));
            }
            peak
        })
    };
    let (pinned_version, hot_before) = rt.block_on(async {
        let c = felix_client::Client::connect(b.listen, "localhost", config(&b))
            .await
            .unwrap();
        c.cache_put(
            "dev",
            "default",
            "hot",
            "pinned",
            "written once".into(),
            None,
        )
        .await
        .unwrap();
        let (_, pinned_version) = c
            .cache_put_if(
                "dev",
                "default",
                "hot",
                "pinned",
                "written once".into(),
                None,
                CacheCondition::Absent,
            )
            .await
            .unwrap();
        let writers: Vec<_> = (0..WRITERS)
            .map(|w| {
                let config = config(&b);
                let addr = b.listen;
                tokio::spawn(async move {
                    let c = felix_client::Client::connect(addr, "localhost", config)
                        .await
                        .unwrap();
                    for i in 0..each {
                        let v = format!("{w}-{i}-{}", "x".repeat(100));
                        c.cache_put("dev", "default", "hot", "key", v.into(), None)
                            .await
                            .unwrap();
                        c.counter_add("dev", "default", "hot", "writes", 1)
                            .await
                            .unwrap();
                    }
                })
            })
            .collect();
        for w in writers {
            w.await.unwrap();
        }
        let hot = c.cache_get("dev", "default", "hot", "key").await.unwrap();
        (pinned_version.expect("the current version"), hot)
    });
    let compactions = b.metric("felix_broker_cache_compactions_total").unwrap();
    sampling.store(false, std::sync::atomic::Ordering::Relaxed);
    let peak = peak.join().unwrap();
    let on_disk = dir_bytes(&caches);
    let written = WRITERS * each;
    eprintln!(
        "{written} puts and {written} adds: {compactions} compactions, {on_disk} bytes of \
         cache log on disk at the end, {peak} at most"
    );
    assert!(compactions > 0, "the cache was compacted");
    assert!(
        on_disk < 1 << 20 && peak < 1 << 20,
        "an overwritten cache stays under 1 MiB on disk ({on_disk} bytes at the end, \
         {peak} at most; {written} puts of ~130 bytes written)"
    );
    b.kill();
    b.restart().unwrap();
    rt.block_on(async {
        let c = felix_client::Client::connect(b.listen, "localhost", config(&b))
            .await
            .unwrap();
        assert_eq!(
            c.cache_get("dev", "default", "hot", "key").await.unwrap(),
            hot_before
        );
        assert_eq!(
            c.cache_get("dev", "default", "hot", "pinned")
                .await
                .unwrap()
                .as_deref(),
            Some(&b"written once"[..])
        );
        assert_eq!(
            c.counter_get("dev", "default", "hot", "writes")
                .await
                .unwrap(),
            Some((WRITERS * each) as i64),
            "every add survives compaction and restart"
        );
        // The value kept its version through the copies.
        let (applied, _) = c
            .cache_put_if(
                "dev",
                "default",
                "hot",
                "pinned",
                "v2".into(),
                None,
                CacheCondition::Version(pinned_version),
            )
            .await
            .unwrap();
        assert!(applied, "the version a compaction carried still matches");
    });
}

fn walk(p: &std::path::Path) -> Vec<std::fs::DirEntry> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(p) {
        for e in rd.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                out.extend(walk(&e.path()));
            } else {
                out.push(e);
            }
        }
    }
    out
}

#[test]
fn stream_read_returns_a_bounded_range_and_offset_for_time_finds_the_first_record_after() {
    let (b, _dir) = broker(&[]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let c = felix_client::Client::connect(b.listen, "localhost", config(&b))
            .await
            .unwrap();
        let publish = |i: usize| {
            let c = c.clone();
            async move {
                c.publish(
                    "dev",
                    "default",
                    "ranges",
                    format!("r{i}").into_bytes(),
                    AckMode::PerMessage,
                )
                .await
                .unwrap()
                .unwrap()
            }
        };
        for i in 0..10 {
            publish(i).await;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        let middle = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_micros() as u64;
        tokio::time::sleep(Duration::from_millis(20)).await;
        for i in 10..20 {
            publish(i).await;
        }
        // A group's events and an atomic commit sit in the log too.
        let g = felix_client::GroupRef::new("dev", "default", "ranges", 0, "g");
        let polled = c
            .group_poll(
                &g,
                felix_client::PollOptions {
                    max_records: 2,
                    wait: Duration::ZERO,
                    visibility: None,
                },
            )
            .await
            .unwrap();
        c.group_ack(&g, polled[0].offset.0).await.unwrap();
        let committed = c
            .commit(
                "dev",
                "default",
                "ranges",
                "e",
                "the event".into(),
                vec![],
                None,
            )
            .await
            .unwrap();

        let (records, next) = c
            .stream_read("dev", "default", "ranges", 0, 5, Some(15), None)
            .await
            .unwrap();
        let offsets: Vec<u64> = records.iter().map(|r| r.offset.0).collect();
        assert_eq!(offsets, (5..15).collect::<Vec<_>>());
        assert_eq!(next, 15);
        assert_eq!(records[0].payload.as_ref(), b"r5");
        let (records, next) = c
            .stream_read("dev", "default", "ranges", 0, 5, None, Some(3))
            .await
            .unwrap();
        assert_eq!(
            (records.len(), next),
            (3, 8),
            "max_records bounds it; next resumes"
        );
        // From 18 to the end: r18, r19, then the commit's event; the group's events are
        // passed over.
        let (records, _) = c
            .stream_read("dev", "default", "ranges", 0, 18, None, None)
            .await
            .unwrap();
        let payloads: Vec<_> = records.iter().map(|r| r.payload.clone()).collect();
        assert_eq!(payloads, [&b"r18"[..], b"r19", b"the event"]);
        assert_eq!(records.last().unwrap().offset.0, committed);
        assert_eq!(
            c.offset_for_time("dev", "default", "ranges", 0, middle)
                .await
                .unwrap(),
            Some(10),
            "the first record at or after the instant"
        );
        assert_eq!(
            c.offset_for_time("dev", "default", "ranges", 0, 0)
                .await
                .unwrap(),
            Some(0)
        );
        assert_eq!(
            c.offset_for_time("dev", "default", "ranges", 0, u64::MAX)
                .await
                .unwrap(),
            None
        );
    });
}

/// Dropping a client closes its connection at the broker, unless a subscription made
/// on it is still alive: that subscription keeps delivering until it is dropped too.
/// (The client's event-stream router once held the connection forever, so every
/// dropped client kept a broker connection open until the process exited.)
#[test]
fn a_dropped_client_closes_its_connection_once_its_subscriptions_are_gone() {
    let (b, _dir) = broker(&[]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let connections = || b.metric("felix_broker_connections").unwrap();
    let settles_at = |want: u64| {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let n = connections();
            if n == want {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the broker still counts {n} connections, expected {want}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    let publisher = rt
        .block_on(felix_client::Client::connect(
            b.listen,
            "localhost",
            config(&b),
        ))
        .unwrap();
    let publish = |i: u64| {
        rt.block_on(publisher.publish(
            "dev",
            "default",
            "s",
            format!("m{i}").into_bytes(),
            AckMode::PerMessage,
        ))
        .unwrap()
    };
    publish(0);
    settles_at(1);
    // A client used once and dropped.
    rt.block_on(async {
        let c = felix_client::Client::connect(b.listen, "localhost", config(&b))
            .await
            .unwrap();
        assert!(c.cache_get("dev", "default", "c", "k").await.is_ok());
    });
    settles_at(1);
    // A client dropped while its subscription lives on.
    let mut sub = rt.block_on(async {
        let c = felix_client::Client::connect(b.listen, "localhost", config(&b))
            .await
            .unwrap();
        c.subscribe_from("dev", "default", "s", Some(StartPosition::Latest))
            .await
            .unwrap()
    });
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(connections(), 2, "the subscription keeps its connection");
    let offset = publish(1);
    let event = rt
        .block_on(async { tokio::time::timeout(Duration::from_secs(10), sub.next_event()).await })
        .expect("the subscription delivers after its client was dropped")
        .unwrap()
        .expect("an event");
    assert_eq!(event.offset, offset);
    drop(sub);
    settles_at(1);
}

#[test]
fn a_standalone_broker_answers_topology_with_itself() {
    let (b, _dir) = broker(&[]);
    let out = felix(&b).arg("topology").output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(text.trim(), format!("node-1 {}", b.listen), "{text}");
}

/// `felix pin` and `felix top` exit on the scale every other command uses: a rule the
/// broker refuses 2, an operator endpoint nobody answers 3, where both exited 1 for
/// every failure (until 2026-12-08).
#[test]
fn felix_pin_and_top_exit_with_the_codes_of_the_other_commands() {
    let (b, _dir) = broker(&[]);
    let code = |args: &[&str]| {
        let out = felix(&b).args(args).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        (out.status.code(), stderr)
    };
    let http = b.http.to_string();
    let (refused, why) = code(&["pin", "--http", &http, "dev/default/orders/0=99"]);
    assert_eq!(refused, Some(2), "{why}");
    let (malformed, why) = code(&["pin", "--http", &http, "not a rule"]);
    assert_eq!(malformed, Some(2), "{why}");
    // A port nothing listens on: bound, then let go.
    let gone = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string();
    let (down, why) = code(&["pin", "--http", &gone, "dev/default/orders/0=0"]);
    assert_eq!(down, Some(3), "{why}");
    let (down, why) = code(&["top", "--http", &gone, "--iterations", "1"]);
    assert_eq!(down, Some(3), "{why}");
    let (served, why) = code(&[
        "top",
        "--http",
        &http,
        "--iterations",
        "1",
        "--interval",
        "0.1",
    ]);
    assert_eq!(served, Some(0), "{why}");
}

#[test]
fn felix_top_in_a_terminal_shows_per_core_rows_that_move_with_load() {
    let (b, _dir) = broker(&["--cores", "0-1", "--fsync", "none"]);
    // A tmux server of our own (its own socket), a fixed-size terminal.
    let socket = format!("felix-top-test-{}", std::process::id());
    let tmux = |args: &[&str]| {
        std::process::Command::new("tmux")
            .args(["-L", &socket])
            .args(args)
            .output()
            .expect("tmux runs (.ci/test installs it)")
    };
    let felix = env!("CARGO_BIN_EXE_felix-under-test");
    let started = tmux(&[
        "new-session",
        "-d",
        "-x",
        "120",
        "-y",
        "30",
        &format!("{felix} top --http {} --interval 0.5", b.http),
    ]);
    assert!(started.status.success(), "{started:?}");
    let screen = || String::from_utf8_lossy(&tmux(&["capture-pane", "-p"]).stdout).into_owned();
    // `(core, msgs/s)` per row on the screen now.
    let rows = |text: &str| -> Vec<(u64, f64)> {
        text.lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                let core = f.first()?.parse().ok()?;
                let rate = f.get(2)?.parse().ok()?;
                (f.len() >= 9).then_some((core, rate))
            })
            .collect()
    };
    let wait_screen = |want: &dyn Fn(&str) -> bool| {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let s = screen();
            if want(&s) {
                return s;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "screen never matched:\n{s}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    };
    let idle = wait_screen(&|s| rows(s).len() == 2);
    assert!(
        idle.contains("BUSY%") && idle.contains("FSYNC p99"),
        "{idle}"
    );
    assert!(rows(&idle).iter().all(|r| r.1 == 0.0), "{idle}");
    // Under load, a core's row shows the rate and the shard is the hottest.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let load = {
        let (stop, config, addr) = (stop.clone(), config(&b), b.listen);
        std::thread::spawn(move || {
            tokio::runtime::Runtime::new()
                .unwrap()
                .block_on(async move {
                    let c = felix_client::Client::connect(addr, "localhost", config)
                        .await
                        .unwrap();
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        c.publish(
                            "dev",
                            "default",
                            "topload",
                            b"x".to_vec(),
                            AckMode::PerMessage,
                        )
                        .await
                        .unwrap();
                    }
                })
        })
    };
    // Waits for the shard's row too: once in four runs of this file here, the frame
    // that first showed the core's rate did not list the shard (cause not found).
    let busy = wait_screen(&|s| {
        rows(s).iter().any(|r| r.1 > 50.0) && s.contains("stream:dev/default/topload/0")
    });
    eprintln!("felix top under load:\n{busy}");
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    load.join().unwrap();
    // And back to idle once it stops.
    wait_screen(&|s| rows(s).len() == 2 && rows(s).iter().all(|r| r.1 == 0.0));
    tmux(&["kill-server"]);
}

/// The broker hands its log settings to the logs it opens: by default a stream's log
/// writes zeros ahead of its data (`zero_ahead_bytes`, 1 MiB) and, under on-commit
/// fsync, writes each round after the first durably (`dsync_writes`); told otherwise it
/// does neither (`felix_broker_log_zero_ahead_bytes`, `felix_broker_log_dsync_writes`,
/// sampled every 250 ms).
#[test]
fn a_brokers_stream_logs_take_its_write_settings() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    for (yaml, on) in [
        ("fsync: on-commit\n", true),
        ("zero_ahead_bytes: 0\ndsync_writes: false\n", false),
    ] {
        let (b, _dir) = broker_with_config(yaml);
        rt.block_on(async {
            let c = felix_client::Client::connect(b.listen, "localhost", config(&b))
                .await
                .unwrap();
            publish_jobs(&c, 3, b'z').await;
        });
        felix_cluster::wait_for("the logs' syncs sampled", Duration::from_secs(10), || {
            (b.metric("felix_broker_log_synced_batches").ok()? >= 3).then_some(())
        })
        .unwrap();
        let zeros = b.metric("felix_broker_log_zero_ahead_bytes").unwrap();
        assert_eq!(
            zeros > 0,
            on,
            "{yaml:?}: {zeros} bytes of zeros written ahead"
        );
        let dsync = b.metric("felix_broker_log_dsync_writes").unwrap();
        assert_eq!(dsync > 0, on, "{yaml:?}: {dsync} durable writes");
    }
}

/// Records larger than the log's 1 MiB read window, behind a small one, are read back by
/// a subscriber from the start and by `stream_read` (such a read re-located from the
/// sparse index to before the large batch, read a window ending inside it, and started
/// over for ever: `a_batch_larger_than_the_read_window_is_read_whole`).
#[test]
fn records_larger_than_the_read_window_are_read_back() {
    let (b, _dir) = broker(&[]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let c = felix_client::Client::connect(b.listen, "localhost", config(&b))
            .await
            .unwrap();
        let key = bytes::Bytes::from_static(b"k");
        let publish = |payload: Vec<u8>| {
            let (c, key) = (c.clone(), key.clone());
            async move {
                c.publish_keyed("dev", "default", "large", key, payload, AckMode::PerMessage)
                    .await
                    .unwrap()
            }
        };
        publish(b"small".to_vec()).await;
        for i in 0..3u8 {
            publish(vec![i; 4 << 20]).await;
        }
        let shards = c.stream_shards("dev", "default", "large").await.unwrap();
        let shard = felix_wire::shard_for_key(Some(b"k"), shards, Default::default()).0;
        let (records, next) = tokio::time::timeout(
            Duration::from_secs(10),
            c.stream_read("dev", "default", "large", shard, 1, None, None),
        )
        .await
        .expect("a stream read of a 4 MiB record is answered")
        .unwrap();
        assert_eq!((records.len(), next), (1, 2));
        assert_eq!(records[0].payload.len(), 4 << 20);
        let mut sub = c
            .subscribe_shard(
                "dev",
                "default",
                "large",
                shard,
                Some(felix_client::StartPosition::Earliest),
            )
            .await
            .unwrap();
        let mut lens = Vec::new();
        for _ in 0..4 {
            let e = tokio::time::timeout(Duration::from_secs(10), sub.next_event())
                .await
                .expect("the subscriber reads the history")
                .unwrap()
                .unwrap();
            lens.push(e.payload.len());
        }
        assert_eq!(lens, [5, 4 << 20, 4 << 20, 4 << 20]);
    });
}

/// A subscribe given up before it was answered (its future dropped) leaves nothing on
/// the broker once its event stream goes unclaimed for the request timeout: the stream
/// was parked for the connection's life, its subscription live on the broker and its
/// events filling the connection's receive window (past the broker's bound on unread
/// answers, the whole connection was closed).
#[test]
fn a_subscribe_given_up_leaves_no_subscription_behind() {
    let (b, _dir) = broker(&[]);
    let mut config = config(&b);
    config.request_timeout = Duration::from_secs(1);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let client = felix_client::Client::connect(b.listen, "localhost", config)
            .await
            .unwrap();
        client
            .publish(
                "dev",
                "default",
                "gone",
                b"one".to_vec(),
                AckMode::PerMessage,
            )
            .await
            .unwrap();
        let mut given_up = 0;
        for i in 0..40u64 {
            let subscribe =
                client.subscribe_from("dev", "default", "gone", Some(StartPosition::Earliest));
            // Given up 0-2 ms in, timed by spinning: tokio's timer ticks in milliseconds,
            // and on a machine quick enough every subscribe was answered before its
            // timeout fired (given_up stayed 0).
            let give_up_at = Instant::now() + Duration::from_micros(50 * i);
            let spin = async {
                while Instant::now() < give_up_at {
                    tokio::task::yield_now().await;
                }
            };
            let sub = tokio::select! {
                biased;
                s = subscribe => Ok(s),
                () = spin => Err(()),
            };
            given_up += usize::from(sub.is_err());
        }
        assert!(given_up > 0, "some subscribes were given up part way");
        let live = || b.metric("felix_broker_subscriptions").unwrap();
        // A subscribe given up may still be on its way to the broker's owning core and
        // registered after a first look found none (the count read 0, then 1): past
        // the request timeout every one has been answered or its stream is unclaimed.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let until = std::time::Instant::now() + Duration::from_secs(10);
        while live() > 0 && std::time::Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(live(), 0, "no subscription is left behind");
        client
            .publish(
                "dev",
                "default",
                "gone",
                b"two".to_vec(),
                AckMode::PerMessage,
            )
            .await
            .unwrap();
    });
}

/// `felix group poll --ack` whose output cannot be written (a reader gone: `| head`, a
/// full disk) stops and fails without acking what it could not show: it acked every
/// record it polled and exited 0, records finished for the group that reached nobody.
#[test]
fn felix_group_poll_acks_nothing_it_could_not_write_out() {
    let (b, _dir) = broker(&[]);
    let run = |args: &[&str]| felix_ok(&b, args);
    for i in 0..3 {
        run(&["pub", "jobs", &format!("j{i}")]);
    }
    // Its output a pipe whose reader is gone.
    let mut child = felix(&b)
        .args([
            "group", "poll", "jobs", "cli", "--max", "10", "--wait", "0.2", "--ack",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    assert!(
        !out.status.success(),
        "it fails: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let described = run(&["group", "describe", "jobs", "cli"]);
    assert!(
        !described.contains("\nlag 0\n"),
        "nothing acked: {described}"
    );
}

/// A broker that takes the client's streams but never answers their `auth` (alive: the
/// connection does not time out) fails the call after the request timeout: opening and
/// authenticating a stream waited for good.
#[test]
fn a_broker_that_never_answers_auth_fails_the_call_after_the_request_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["localhost".to_owned()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, cert.pem()).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let server_config = felix_core_runtime::quic::server_config(
            vec![cert.der().clone()],
            rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
            felix_core_runtime::quic::TransportLimits::default(),
        )
        .unwrap();
        let server =
            quinn::Endpoint::server(server_config, "127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = server.local_addr().unwrap();
        tokio::spawn(async move {
            while let Some(incoming) = server.accept().await {
                tokio::spawn(async move {
                    let Ok(conn) = incoming.await else { return };
                    // Taken, read from, never answered.
                    let mut held = Vec::new();
                    while let Ok(stream) = conn.accept_bi().await {
                        held.push(stream);
                    }
                });
            }
        });
        let quinn = felix_client::quic_client_config_from_file(&ca, false).unwrap();
        let mut config = ClientConfig::from_env_or_yaml(quinn, None).unwrap();
        config.auth_tenant_id = Some("dev".to_string());
        config.auth_token = Some("token".to_string());
        config.request_timeout = Duration::from_millis(500);
        let started = Instant::now();
        let connected = tokio::time::timeout(
            Duration::from_secs(10),
            felix_client::Client::connect(addr, "localhost", config),
        )
        .await
        .expect("the call gave up by itself");
        assert!(
            matches!(connected, Err(felix_client::ClientError::Timeout(_))),
            "{:?}",
            connected.err()
        );
        assert!(started.elapsed() < Duration::from_secs(5));
    });
}

/// Our SDK's cache watch, as the standard SDK's: a key watch sees each put and delete of
/// its key in order (not other keys, not counters); a prefix watch its prefix only; a
/// retained one the current values first, then live; one from an offset replays from
/// there.
#[test]
fn a_cache_watch_sees_its_keys_changes_in_order() {
    use felix_client::{CacheChange, CacheWatchFilter, CacheWatchStart};
    let (b, _dir) = broker(&[]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let c = felix_client::Client::connect(b.listen, "localhost", config(&b))
            .await
            .unwrap();
        let seen = |c: &CacheChange| {
            (
                c.key.clone(),
                c.value
                    .as_ref()
                    .map(|v| String::from_utf8_lossy(v).into_owned()),
            )
        };
        let key = CacheWatchFilter::Key("room-1".into());
        let mut w = c
            .watch_cache("dev", "default", "rooms", &key, CacheWatchStart::Now)
            .await
            .unwrap();
        let put = |k: &'static str, v: &'static str| {
            c.cache_put("dev", "default", "rooms", k, bytes::Bytes::from(v), None)
        };
        put("room-1", "ada").await.unwrap();
        put("room-2", "not watched").await.unwrap();
        c.counter_add("dev", "default", "rooms", "room-1", 5)
            .await
            .unwrap();
        put("room-1", "grace").await.unwrap();
        c.cache_delete("dev", "default", "rooms", "room-1")
            .await
            .unwrap();
        let mut got = Vec::new();
        for _ in 0..3 {
            got.push(next_change(&mut w).await);
        }
        assert_eq!(
            got.iter().map(seen).collect::<Vec<_>>(),
            [
                ("room-1".into(), Some("ada".into())),
                ("room-1".into(), Some("grace".into())),
                ("room-1".into(), None)
            ]
        );
        assert!(got[0].offset < got[1].offset && got[1].offset < got[2].offset);
        assert!(
            tokio::time::timeout(Duration::from_millis(300), w.next_change())
                .await
                .is_err(),
            "nothing else: not the counter, not another key"
        );
        let prefix = CacheWatchFilter::Prefix {
            prefix: "user:".into(),
            shard: None,
        };
        let mut p = c
            .watch_cache("dev", "default", "rooms", &prefix, CacheWatchStart::Now)
            .await
            .unwrap();
        put("user:1", "a").await.unwrap();
        put("other", "x").await.unwrap();
        put("user:2", "b").await.unwrap();
        assert_eq!(next_change(&mut p).await.key, "user:1");
        assert_eq!(next_change(&mut p).await.key, "user:2");
        let mut r = c
            .watch_cache(
                "dev",
                "default",
                "rooms",
                &prefix,
                CacheWatchStart::Retained,
            )
            .await
            .unwrap();
        assert_eq!(r.retained_count(), Some(2));
        let mut current = vec![
            seen(&next_change(&mut r).await),
            seen(&next_change(&mut r).await),
        ];
        current.sort();
        assert_eq!(
            current,
            [
                ("user:1".into(), Some("a".into())),
                ("user:2".into(), Some("b".into()))
            ]
        );
        put("user:3", "c").await.unwrap();
        assert_eq!(next_change(&mut r).await.key, "user:3", "then live");
        let mut h = c
            .watch_cache(
                "dev",
                "default",
                "rooms",
                &key,
                CacheWatchStart::Offset(got[0].offset),
            )
            .await
            .unwrap();
        for want in &got {
            assert_eq!(&next_change(&mut h).await, want, "replayed from the offset");
        }
    });
}

/// The `felix` command's cache, counter, state and read operations: a watch prints
/// each change of its key; conditional puts and deletes apply once and exit 9 when
/// their condition does not hold; counters add up and one never written is not found
/// (exit 5); a commit's changes are read back; `read` and `offset-at` find records by
/// position and time.
#[test]
fn the_felix_command_watches_writes_conditionally_counts_commits_and_reads() {
    let (b, _dir) = broker(&[]);
    let run = |args: &[&str]| felix_ok(&b, args);
    let fails = |args: &[&str]| {
        let out = felix(&b).args(args).output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    run(&["cache", "put", "rooms", "room-1", "ada"]);
    run(&["cache", "put", "rooms", "room-2", "other"]);
    run(&["cache", "put", "rooms", "room-1", "grace"]);
    run(&["cache", "delete", "rooms", "room-1"]);
    // From the cache's first offset (live watches: the SDK's test above).
    let watch = [
        "cache", "watch", "rooms", "--key", "room-1", "--from", "0", "--count", "3",
    ];
    assert_eq!(run(&watch), "room-1=ada\nroom-1=grace\nroom-1 deleted\n");
    let replay = run(&[&["--json"][..], &watch].concat());
    let offsets: Vec<u64> = replay
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["offset"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(offsets, [0, 2, 3], "{replay}");

    let created: serde_json::Value = serde_json::from_str(
        run(&[
            "--json",
            "cache",
            "put",
            "rooms",
            "lock",
            "me",
            "--if-absent",
        ])
        .trim(),
    )
    .unwrap();
    assert_eq!(created["applied"], true, "{created}");
    let version = created["version"].as_u64().unwrap().to_string();
    let (code, why) = fails(&["cache", "put", "rooms", "lock", "you", "--if-absent"]);
    assert_eq!(code, Some(9), "{why}");
    assert!(why.contains(&format!("its version is {version}")), "{why}");
    run(&[
        "cache",
        "put",
        "rooms",
        "lock",
        "me again",
        "--if-version",
        &version,
    ]);
    let (code, why) = fails(&[
        "cache",
        "put",
        "rooms",
        "lock",
        "stale",
        "--if-version",
        &version,
    ]);
    assert_eq!(code, Some(9), "{why}");
    assert_eq!(run(&["cache", "get", "rooms", "lock"]), "me again\n");
    let (code, _) = fails(&["cache", "delete", "rooms", "lock", "--if-version", &version]);
    assert_eq!(code, Some(9), "a delete at an old version");
    assert_eq!(run(&["cache", "get", "rooms", "lock"]), "me again\n");

    let (code, why) = fails(&["cache", "counter", "rooms", "hits"]);
    assert_eq!(code, Some(5), "{why}");
    assert_eq!(run(&["cache", "add", "rooms", "hits", "5"]), "5\n");
    assert_eq!(run(&["cache", "add", "rooms", "hits", "-2"]), "3\n");
    assert_eq!(run(&["cache", "counter", "rooms", "hits"]), "3\n");

    let first = run(&[
        "state",
        "commit",
        "accounts",
        "acct-1",
        "--event",
        "opened",
        "--put",
        "balance=10",
        "--put",
        "owner=ann",
    ]);
    let first: u64 = first.trim().parse().unwrap();
    let got: serde_json::Value = serde_json::from_str(
        run(&["--json", "state", "get", "accounts", "acct-1", "balance"]).trim(),
    )
    .unwrap();
    assert_eq!(got["payload"], "10", "{got}");
    assert_eq!(got["version"], first, "{got}");
    run(&["state", "commit", "accounts", "acct-1", "--delete", "owner"]);
    let (code, _) = fails(&["state", "get", "accounts", "acct-1", "owner"]);
    assert_eq!(code, Some(5), "a deleted key is not found");
    let (code, why) = fails(&[
        "state",
        "commit",
        "accounts",
        "acct-1",
        "--put",
        "x=1",
        "--expect-offset",
        &first.to_string(),
    ]);
    assert_eq!(code, Some(9), "a commit expecting an old offset: {why}");
    let (code, _) = fails(&["state", "get", "accounts", "acct-1", "x"]);
    assert_eq!(code, Some(5), "the refused commit wrote nothing");
    let (code, why) = fails(&["state", "commit", "accounts", "acct-1", "--put", "=1"]);
    assert_eq!(code, Some(2), "an empty key: {why}");

    run(&["pub", "orders", "a", "b", "c"]);
    assert_eq!(run(&["read", "orders", "--from", "1", "--max", "1"]), "b\n");
    let read = run(&["--json", "read", "orders", "--from", "1"]);
    let lines: Vec<serde_json::Value> = read
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(
        lines.len(),
        3,
        "two records and where the next read starts: {read}"
    );
    assert_eq!(lines[2]["next_offset"], 3);
    let at = lines[1]["timestamp_micros"].as_u64().unwrap();
    assert_eq!(run(&["offset-at", "orders", &at.to_string()]), "2\n");
    let (code, _) = fails(&["offset-at", "orders", &(at + 3_600_000_000).to_string()]);
    assert_eq!(code, Some(5), "nothing appended after an hour from now");
}

/// A watch's next change, within 10 s.
async fn next_change(w: &mut felix_client::CacheWatch) -> felix_client::CacheChange {
    tokio::time::timeout(Duration::from_secs(10), w.next_change())
        .await
        .expect("a change within 10 s")
        .unwrap()
        .expect("the watch goes on")
}

/// A commit without an expected offset is never sent again once it may have been
/// applied, but one on a connection that had closed before it (its broker restarted)
/// sent nothing: it goes once the client has reconnected, instead of giving up "in
/// doubt" about a commit the broker never saw.
#[test]
fn a_commit_on_a_connection_closed_before_it_goes_once_reconnected() {
    let (mut b, _dir) = broker(&[]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    async fn commit(
        c: &ClusterClient,
        event: &'static str,
    ) -> Result<u64, felix_client::ClientError> {
        c.commit(
            "dev",
            "default",
            "entities",
            "e",
            bytes::Bytes::from(event),
            vec![],
            None,
        )
        .await
    }
    let c = rt.block_on(async {
        let c = ClusterClient::connect(&[b.listen], "localhost", config(&b))
            .await
            .unwrap();
        c.publish(
            "dev",
            "default",
            "entities",
            b"first".to_vec(),
            AckMode::PerMessage,
        )
        .await
        .unwrap();
        commit(&c, "one").await.unwrap();
        c
    });
    assert!(b.terminate(Duration::from_secs(20)), "a clean stop");
    b.restart().unwrap();
    rt.block_on(async {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !c.client().is_closed() {
            assert!(
                Instant::now() < deadline,
                "the client never saw its connection close"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let r = commit(&c, "two").await;
        assert!(r.is_ok(), "{r:?}");
    });
}
