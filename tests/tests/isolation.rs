//! Subscribers whose clients die without closing (SIGKILL) end with their connection,
//! and their records never reach anybody else: new clients, subscribed to other streams
//! on connections that reuse the dead ones' slots, see only their own stream.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use felix_cluster::{BrokerProcess, expect_success, manifest_dir, python, run_python, wait_for};

const IDLE_TIMEOUT_MS: u64 = 1000;

/// Starts `tests/python/<script> <broker args> <args>` and waits for it to print
/// "subscribed".
fn subscriber(b: &BrokerProcess, script: &str, args: &[&str]) -> Child {
    let mut child = Command::new(python().unwrap())
        .arg(manifest_dir().join("python").join(script))
        .arg(b.listen.to_string())
        .arg(b.data_dir.join("dev/token"))
        .arg(b.ca_file())
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut line = String::new();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "subscribed", "{script} {args:?}");
    // Keep draining its output so it never blocks on a full pipe.
    std::thread::spawn(move || for _ in out.lines() {});
    child
}

#[test]
fn killed_subscribers_end_and_never_leak_records_to_other_streams() {
    let dir = tempfile::tempdir().unwrap();
    let b = BrokerProcess::start_dev(
        std::path::Path::new(env!("CARGO_BIN_EXE_felix-broker-under-test")),
        &dir.path().join("data"),
        &["--idle-timeout-ms", &IDLE_TIMEOUT_MS.to_string()],
    )
    .unwrap();
    const ROUNDS: usize = 12;
    const EVENTS: usize = 5;
    let subscriptions = || b.metric("felix_broker_subscriptions").unwrap();
    let mut victims = Vec::new();
    for round in 0..ROUNDS {
        // A client subscribes and dies without closing its connection.
        let mut v = subscriber(&b, "subscribe_hang.py", &[&format!("victim{round}")]);
        v.kill().unwrap();
        v.wait().unwrap();
        victims.push(format!("victim{round}"));
        if round % 3 == 2 {
            // Its subscription ends with the connection, within the idle timeout.
            wait_for(
                "the dead clients' subscriptions to end",
                Duration::from_millis(IDLE_TIMEOUT_MS + 3000),
                || (subscriptions() == 0).then_some(()),
            )
            .unwrap();
        }
    }
    // New clients, on connections that may land in the dead ones' slots, subscribe to
    // other streams; then every stream gets records labelled with its own name.
    let others: Vec<String> = (0..ROUNDS).map(|i| format!("other{i}")).collect();
    let mut checkers: Vec<Child> = others
        .iter()
        .map(|s| subscriber(&b, "isolated_subscriber.py", &[s, &EVENTS.to_string()]))
        .collect();
    assert_eq!(
        subscriptions(),
        ROUNDS as u64,
        "only the live subscriptions count"
    );
    let mut streams: Vec<&str> = victims.iter().map(String::as_str).collect();
    streams.extend(others.iter().map(String::as_str));
    let mut args = vec![EVENTS.to_string()];
    args.extend(streams.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = run_python(&b, "publish_labelled.py", &args).unwrap();
    expect_success("publish_labelled.py", &out).unwrap();
    for (c, s) in checkers.iter_mut().zip(&others) {
        let status = c.wait().unwrap();
        assert!(
            status.success(),
            "{s}: a subscriber saw another stream's record or missed its own"
        );
    }
    wait_for(
        "every subscription to end with its client",
        Duration::from_millis(IDLE_TIMEOUT_MS + 3000),
        || (subscriptions() == 0).then_some(()),
    )
    .unwrap();
    assert_eq!(b.metric("felix_broker_foreign_batches_total").unwrap(), 0);
}
