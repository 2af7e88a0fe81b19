//! Every chaos scenario, briefly (`felix-cluster chaos` runs them long): the checker
//! must find nothing wrong. And the checker is worth something only if it catches
//! bugs: each deliberate bug (a mutant flag) must be caught by the scenario that
//! exposes it.

use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

use felix_cluster::chaos::{SCENARIOS, run_with, scenario};
use serde_json::Value;

/// One cluster at a time: two cores cannot run several and keep their timing.
static SERIAL: Mutex<()> = Mutex::new(());

fn run(name: &str, seconds: u64, mutant: Option<&str>) -> Value {
    run_seed(name, 1, seconds, mutant)
}

fn run_seed(name: &str, seed: u64, seconds: u64, mutant: Option<&str>) -> Value {
    let _one = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let s = scenario(name).expect("a scenario");
    let line = run_with(
        s,
        seed,
        Duration::from_secs(seconds),
        mutant,
        Path::new(env!("CARGO_BIN_EXE_felix-broker-under-test")),
        Path::new(env!("CARGO_BIN_EXE_felix-controlplane-under-test")),
    )
    .unwrap_or_else(|e| panic!("{name}: {e:#}"));
    let mut brief = line.clone();
    brief.as_object_mut().unwrap().remove("timeline");
    eprintln!("{brief}");
    line
}

fn assert_clean(name: &str) {
    let line = run(name, 8, None);
    assert_eq!(line["valid"], true, "{name}: {}", line["report"]);
    assert!(
        line["report"]["acked"].as_u64().unwrap() > 0,
        "{name}: nothing was acknowledged"
    );
}

#[test]
fn every_scenario_is_listed_here() {
    let here = [
        "kill-restart",
        "leader-kill",
        "leader-bounce",
        "leader-pause",
        "leader-isolated",
        "leader-one-way",
        "controlplane-partition",
        "flaky-links",
        "planned-move",
        "staged-move",
        "sigterm-drain",
        "controlplane-restart",
        "controlplane-clock",
        "fsync-eio",
        "disk-full",
        "core-panic",
        "damaged-restart",
        "damaged-replica",
        "fd-exhaustion",
        "duplicate-node",
        "delete-recreate",
        "delete-recreate-away",
        "hostile-clients",
        "hostile-frames",
        "filesystem-full",
        "filesystem-full-replicated",
    ];
    let all: Vec<_> = SCENARIOS.iter().map(|s| s.name).collect();
    assert_eq!(all, here);
}

#[test]
fn kill_restart() {
    assert_clean("kill-restart");
}

#[test]
fn leader_kill() {
    assert_clean("leader-kill");
}

#[test]
fn leader_bounce() {
    assert_clean("leader-bounce");
}

#[test]
fn leader_pause() {
    assert_clean("leader-pause");
}

#[test]
fn leader_isolated() {
    assert_clean("leader-isolated");
}

#[test]
fn leader_one_way() {
    assert_clean("leader-one-way");
}

#[test]
fn controlplane_partition() {
    assert_clean("controlplane-partition");
}

#[test]
fn flaky_links() {
    assert_clean("flaky-links");
}

#[test]
fn planned_move() {
    assert_clean("planned-move");
}

#[test]
fn staged_move() {
    assert_clean("staged-move");
}

#[test]
fn sigterm_drain() {
    assert_clean("sigterm-drain");
}

#[test]
fn controlplane_restart() {
    assert_clean("controlplane-restart");
}

#[test]
fn controlplane_clock() {
    assert_clean("controlplane-clock");
}

#[test]
fn fsync_eio() {
    assert_clean("fsync-eio");
}

#[test]
fn disk_full() {
    assert_clean("disk-full");
}

#[test]
fn core_panic() {
    assert_clean("core-panic");
}

#[test]
fn damaged_restart() {
    assert_clean("damaged-restart");
}

#[test]
fn damaged_replica() {
    assert_clean("damaged-replica");
}

#[test]
fn fd_exhaustion() {
    assert_clean("fd-exhaustion");
}

#[test]
fn duplicate_node() {
    assert_clean("duplicate-node");
}

#[test]
fn delete_recreate() {
    assert_clean("delete-recreate");
}

#[test]
fn delete_recreate_away() {
    assert_clean("delete-recreate-away");
}

#[test]
fn hostile_clients() {
    assert_clean("hostile-clients");
}

#[test]
fn hostile_frames() {
    assert_clean("hostile-frames");
}

#[test]
fn filesystem_full() {
    let probe = tempfile::tempdir().unwrap();
    if felix_cluster::LoopFs::mount(probe.path(), 16).is_none() {
        eprintln!("SKIPPED: needs root and a loop device to mount a small ext4");
        return;
    }
    assert_clean("filesystem-full");
    assert_clean("filesystem-full-replicated");
}

/// The mutant must be caught within four runs (seeds 1 to 4; most are caught by the
/// first). A Leader-stream loss is allowed when a leadership change follows the
/// publish's start (the old leader may have decided the ack before it), so the
/// ack-after-lease mutant shows only through publishes that start after the change and
/// reach the deposed leader before it syncs: an 8 s run does not always have one (see
/// [`the_checker_catches_acks_after_the_lease`]).
fn assert_caught(name: &str, mutant: &str, classes: &[&str]) {
    assert_caught_within(name, mutant, classes, 4, 8);
}

/// As [`assert_caught`], trying seeds `1..=seeds` with runs of `secs` seconds. Caught
/// means found as one of `classes`: a run found invalid for another reason (a flaky
/// anomaly of its own) is not the mutant caught, and the next seed is tried.
fn assert_caught_within(name: &str, mutant: &str, classes: &[&str], seeds: u64, secs: u64) {
    let mut reports = Vec::new();
    for seed in 1..=seeds {
        let line = run_seed(name, seed, secs, Some(mutant));
        let anomalies = line["anomalies"].to_string();
        let found = line["anomalies"].as_array().cloned().unwrap_or_default();
        if classes.iter().any(|c| found.iter().any(|a| a == c)) {
            return;
        }
        reports.push(format!("seed {seed}: {anomalies} {}", line["report"]));
    }
    panic!("{name} with {mutant}: the checker found nothing in {seeds} runs: {reports:?}");
}

#[test]
fn the_checker_catches_offsets_handed_out_twice() {
    assert_caught(
        "kill-restart",
        "reuse-offsets",
        // Offsets given twice show as a record read at an offset the final log holds
        // another at, two values at one, a record lost, or a group's acks landing on
        // the wrong records.
        &[
            "two_values",
            "duplicates",
            "lost",
            "uncommitted_reads",
            "group_acked_handed_out_again",
        ],
    );
}

/// `leader-pause` wakes the paused leader still cut from the control plane and the
/// other brokers for 0.3-0.8 s, so the mutant acknowledges every publish its clients
/// send in that time (hundreds in an 8 s run). Only a run's last pause counts (a later
/// leadership change excuses earlier losses): seeds 1-6 caught 5 (2026-12-07; before
/// the cut, when the window was the few milliseconds between waking and reading the
/// demotion, 4 of 11 and one CI run missed seeds 1-10). Ten seeds make a miss rare.
#[test]
fn the_checker_catches_acks_after_the_lease() {
    assert_caught_within("leader-pause", "ack-after-lease", &["lost"], 10, 8);
}

/// The run's consumer group (group `chaos` on every durable stream) is checked too: a
/// broker that answers acks without writing them hands acked records out again after
/// a restart.
#[test]
fn the_checker_catches_group_acks_never_written() {
    for seed in 1..=4 {
        let line = run_seed("kill-restart", seed, 8, Some("unwritten-group-acks"));
        let anomalies = line["anomalies"].to_string();
        if anomalies.contains("group_acked_handed_out_again") {
            return;
        }
        assert_eq!(
            line["valid"], true,
            "seed {seed}: caught, but not as expected: {anomalies}"
        );
    }
    panic!("kill-restart with unwritten-group-acks: not caught in 4 runs");
}

// `skip-fence` (a new leader serving on its own log without fencing a majority): a
// planned move hands leadership to a member that may still lack the newest committed
// records; fencing makes it fetch them before it serves, the mutant serves without
// them. A move catches it only when its target lags at the cut-over, which depends on
// timing: here, by hand, about one run in two (8 s runs, seeds 1-4: seed 2, 182
// acknowledged records lost; 16 s runs: seeds 2 and 4), but 0 of 10 in one `.ci/run`
// (2026-12-02). Too unreliable to gate the suite on, so it is run by hand
// (`cargo test -p felix-cluster --test chaos -- --ignored`) and its figures are in
// docs/reliability.md; the simulator's test (`cargo test`) catches the mutant every time. The failover scenarios (`leader-kill`, `leader-pause`) do
// not catch it: the control plane promotes only a follower whose reported position
// covers the commit mark, and followers refuse to cut committed records. The
// replication simulator catches it at once (`the_simulator_catches_replicas_that_skip_fencing`).
#[test]
#[ignore = "timing-dependent: run by hand, see above"]
fn the_checker_catches_leaders_that_skip_fencing() {
    assert_caught_within("planned-move", "skip-fence", &["lost", "two_values"], 10, 8);
}
