//! SIGKILL the broker while the standard SDK publishes with acks that wait for fsync;
//! after every restart, every acknowledged record is read back at its offset.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use felix_cluster::{BrokerProcess, expect_success, python, run_python};

#[test]
fn sigkill_loses_no_acknowledged_publish() {
    let dir = tempfile::tempdir().unwrap();
    let mut broker = BrokerProcess::start_dev(
        std::path::Path::new(env!("CARGO_BIN_EXE_felix-broker-under-test")),
        &dir.path().join("data"),
        &["--fsync", "on-commit"],
    )
    .unwrap();
    let script = felix_cluster::manifest_dir().join("python/publish_forever.py");
    let mut acked: BTreeMap<u64, String> = BTreeMap::new();
    for cycle in 0..3 {
        let mut publisher = Command::new(python().unwrap())
            .arg(&script)
            .arg(broker.listen.to_string())
            .arg(broker.data_dir.join("dev/token"))
            .arg(broker.ca_file())
            .arg(format!("c{cycle}"))
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdout = publisher.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        // Let it publish for a while, then kill the broker mid-stream.
        let until = Instant::now() + Duration::from_millis(800 + 300 * cycle);
        let mut this_cycle = 0;
        while Instant::now() < until {
            if let Ok(line) = rx.recv_timeout(Duration::from_millis(10)) {
                let mut parts = line.splitn(2, ' ');
                if let (Some(o), Some(p)) = (parts.next(), parts.next())
                    && let Ok(o) = o.parse::<u64>()
                {
                    acked.insert(o, p.to_owned());
                    this_cycle += 1;
                }
            }
        }
        broker.kill();
        // The SDK would keep retrying the dead broker; acks already printed are read
        // below, so stop it (the child we started) now.
        let _ = publisher.kill();
        for line in rx.iter() {
            let mut parts = line.splitn(2, ' ');
            if let (Some(o), Some(p)) = (parts.next(), parts.next())
                && let Ok(o) = o.parse::<u64>()
            {
                acked.insert(o, p.to_owned());
                this_cycle += 1;
            }
        }
        let _ = publisher.wait();
        reader.join().unwrap();
        assert!(
            this_cycle > 10,
            "cycle {cycle}: the publisher made progress ({this_cycle} acks)"
        );
        broker.restart().unwrap();
        let want = acked.keys().last().map_or(0, |o| o + 1);
        let out = run_python(&broker, "read_all.py", &[&want.to_string()]).unwrap();
        let text = expect_success("read_all.py", &out).unwrap();
        let mut read = BTreeMap::new();
        for line in text.lines() {
            let mut parts = line.splitn(2, ' ');
            read.insert(
                parts.next().unwrap().parse::<u64>().unwrap(),
                parts.next().unwrap_or("").to_owned(),
            );
        }
        for (o, p) in &acked {
            assert_eq!(
                read.get(o),
                Some(p),
                "cycle {cycle}: acknowledged offset {o} is back, intact"
            );
        }
        eprintln!(
            "cycle {cycle}: {} acknowledged records survived the SIGKILL",
            acked.len()
        );
    }
}
