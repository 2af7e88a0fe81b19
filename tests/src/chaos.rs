//! Chaos runs: a workload recorded into a [`History`], a nemesis that injects one kind
//! of fault on a seeded schedule, and the checker over the final logs.
//!
//! A run starts a cluster ([`TestCluster`], behind proxies where the scenario cuts
//! links), creates its streams, starts producers (one record at a time, or eight in
//! flight) and a reader per durable stream, lets the nemesis act until the duration is
//! up, heals everything (links, paused and killed brokers), lets the workload run on
//! briefly, stops it, reads every shard back from its leader and checks. The result is
//! one JSON object: the seed, the fault timeline, the workload's counts and the
//! checker's report.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use felix_client::{ClientError, ClusterClient, ReconnectPolicy};
use felix_wire::Offset;
use felix_wire::message::StartPosition;
use felix_wire::{AckMode, RetryClass};
use serde_json::{Value, json};

use crate::cluster::{CP_ARGS, NAMESPACE, TENANT, TestCluster};
use crate::history::{
    FinalLogs, History, Op, OpKind, Outcome, Promise, RegisterOp, check, check_register,
};
use crate::proxy::{Link, Party};
use crate::wait_for;

/// One stream a scenario writes.
#[derive(Debug, Clone, Copy)]
pub struct StreamSpec {
    /// Its name.
    pub name: &'static str,
    /// Copies.
    pub replication_factor: u32,
    /// `Quorum` or `Leader`.
    pub consistency: &'static str,
}

/// What a scenario does to the cluster.
pub type NemesisFn = fn(&mut Nemesis<'_>) -> anyhow::Result<()>;

/// A named fault schedule over a cluster shape.
#[derive(Debug, Clone, Copy)]
pub struct Scenario {
    /// Its name on the command line.
    pub name: &'static str,
    /// What it injects.
    pub about: &'static str,
    /// Brokers.
    pub nodes: usize,
    /// Whether links go through proxies.
    pub proxies: bool,
    /// Extra broker configuration.
    pub broker_yaml: &'static str,
    /// The streams.
    pub streams: &'static [StreamSpec],
    /// Producers per stream.
    pub producers: usize,
    /// Records in flight per producer (1 = sequential).
    pub depth: usize,
    /// No leadership may change (the faults must not cost a failover).
    pub stable: bool,
    /// The control plane keeps its metadata in Postgres (a fresh database of the test
    /// server) instead of memory.
    pub postgres: bool,
    /// The nemesis.
    pub nemesis: NemesisFn,
}

const Q3: StreamSpec = StreamSpec {
    name: "q",
    replication_factor: 3,
    consistency: "Quorum",
};
const Q3B: StreamSpec = StreamSpec {
    name: "r",
    replication_factor: 3,
    consistency: "Quorum",
};
const Q2: StreamSpec = StreamSpec {
    name: "s",
    replication_factor: 2,
    consistency: "Quorum",
};
const Q2B: StreamSpec = StreamSpec {
    name: "u",
    replication_factor: 2,
    consistency: "Quorum",
};
const L3: StreamSpec = StreamSpec {
    name: "l",
    replication_factor: 3,
    consistency: "Leader",
};
const ONE: [StreamSpec; 3] = [
    StreamSpec {
        name: "a",
        replication_factor: 1,
        consistency: "Quorum",
    },
    StreamSpec {
        name: "b",
        replication_factor: 1,
        consistency: "Quorum",
    },
    StreamSpec {
        name: "c",
        replication_factor: 1,
        consistency: "Quorum",
    },
];

/// Every scenario.
pub const SCENARIOS: &[Scenario] = &[
    Scenario {
        name: "kill-restart",
        about: "one broker, three streams, eight records in flight per producer: SIGKILL and restart every 1-3 s",
        nodes: 1,
        proxies: false,
        broker_yaml: "",
        streams: &ONE,
        producers: 1,
        depth: 8,
        stable: false,
        postgres: false,
        nemesis: kill_restart,
    },
    Scenario {
        name: "leader-kill",
        about: "three brokers, Quorum streams: SIGKILL a leader, restart it 2-4 s later",
        nodes: 3,
        proxies: false,
        broker_yaml: "",
        streams: &[Q3, Q3B],
        producers: 2,
        depth: 1,
        stable: false,
        postgres: false,
        nemesis: leader_kill,
    },
    Scenario {
        name: "leader-bounce",
        about: "three brokers, Quorum streams: SIGKILL a leader and restart it at once, before the control plane notices",
        nodes: 3,
        proxies: false,
        broker_yaml: "",
        streams: &[Q3, Q3B],
        producers: 2,
        depth: 1,
        stable: false,
        postgres: false,
        nemesis: leader_bounce,
    },
    Scenario {
        name: "leader-pause",
        about: "three brokers behind proxies, a Quorum and a Leader stream: SIGSTOP the Leader stream's leader past its lease, SIGCONT it still cut from the control plane and the other brokers for 0.3-0.8 s (it wakes not knowing it was replaced)",
        nodes: 3,
        proxies: true,
        broker_yaml: "",
        streams: &[Q3, L3],
        producers: 2,
        depth: 4,
        stable: false,
        postgres: false,
        nemesis: leader_pause,
    },
    Scenario {
        name: "leader-isolated",
        about: "three brokers behind proxies: cut a leader from its followers both ways for 3-5 s",
        nodes: 3,
        proxies: true,
        broker_yaml: "",
        streams: &[Q3, Q3B],
        producers: 2,
        depth: 1,
        stable: false,
        postgres: false,
        nemesis: leader_isolated,
    },
    Scenario {
        name: "leader-one-way",
        about: "three brokers behind proxies: a leader's packets to its followers dropped (it still hears them) for 3-5 s",
        nodes: 3,
        proxies: true,
        broker_yaml: "",
        streams: &[Q3],
        producers: 2,
        depth: 1,
        stable: false,
        postgres: false,
        nemesis: leader_one_way,
    },
    Scenario {
        name: "controlplane-partition",
        about: "three brokers behind proxies: cut a leader from the control plane for 3-5 s (its lease lapses)",
        nodes: 3,
        proxies: true,
        broker_yaml: "",
        streams: &[Q3, Q3B],
        producers: 2,
        depth: 1,
        stable: false,
        postgres: false,
        nemesis: controlplane_partition,
    },
    Scenario {
        name: "flaky-links",
        about: "three brokers behind proxies: every link drops 5%, duplicates 5%, delays 0-20 ms (reordering); a leader is killed now and then",
        nodes: 3,
        proxies: true,
        broker_yaml: "",
        streams: &[Q3, L3],
        producers: 2,
        depth: 1,
        stable: false,
        postgres: false,
        nemesis: flaky_links,
    },
    Scenario {
        name: "planned-move",
        about: "three brokers, Quorum streams: move a shard's leadership to another replica every 1.5-3 s (POST /v1/shard-moves)",
        nodes: 3,
        proxies: false,
        broker_yaml: "",
        streams: &[Q3, Q3B],
        producers: 2,
        depth: 4,
        stable: false,
        postgres: false,
        nemesis: planned_move,
    },
    Scenario {
        name: "staged-move",
        about: "three brokers, Quorum streams with two copies: move a shard to the broker holding no copy every 1.5-3 s (a staged copy, cut-over, retirement); now and then SIGKILL a broker and restart it 1-3 s later, in the middle of a move",
        nodes: 3,
        proxies: false,
        broker_yaml: "",
        streams: &[Q2, Q2B],
        producers: 2,
        depth: 4,
        stable: false,
        postgres: false,
        nemesis: staged_move,
    },
    Scenario {
        name: "sigterm-drain",
        about: "three brokers, Quorum streams, four records in flight: SIGTERM a leader (it drains: its shards move to replicas, then it exits 0 within 20 s), start it again",
        nodes: 3,
        proxies: false,
        broker_yaml: "",
        streams: &[Q3, Q3B],
        producers: 2,
        depth: 4,
        stable: false,
        postgres: false,
        nemesis: sigterm_drain,
    },
    Scenario {
        name: "controlplane-restart",
        about: "three brokers, the control plane on Postgres: SIGKILL the control plane every 2-4 s and start it again 0.3-1.5 s later (leases lapse, brokers re-register)",
        nodes: 3,
        proxies: false,
        broker_yaml: "",
        streams: &[Q3, L3],
        producers: 2,
        depth: 1,
        stable: false,
        postgres: true,
        nemesis: controlplane_restart,
    },
    Scenario {
        name: "controlplane-clock",
        about: "three brokers: the control plane's wall clock steps forward and back by seconds to minutes; no broker may be declared down, no leadership may move",
        nodes: 3,
        proxies: false,
        broker_yaml: "",
        streams: &[Q3, L3],
        producers: 2,
        depth: 1,
        stable: true,
        postgres: false,
        nemesis: controlplane_clock,
    },
    Scenario {
        name: "fsync-eio",
        about: "one broker: fdatasync fails with EIO (once), the shard refuses writes, the broker restarts",
        nodes: 1,
        proxies: false,
        broker_yaml: "fault_injection: true\n",
        streams: &ONE,
        producers: 1,
        depth: 4,
        stable: false,
        postgres: false,
        nemesis: fsync_eio,
    },
    Scenario {
        name: "disk-full",
        about: "one broker: every write fails with ENOSPC for 0.3-1 s (appends refused, retryable), then space returns; no restart",
        nodes: 1,
        proxies: false,
        broker_yaml: "fault_injection: true\n",
        streams: &ONE,
        producers: 1,
        depth: 4,
        stable: false,
        postgres: false,
        nemesis: disk_full,
    },
    Scenario {
        name: "core-panic",
        about: "one broker on two cores: a core panics (the process must exit 70), the broker restarts",
        nodes: 1,
        proxies: false,
        broker_yaml: "fault_injection: true\n",
        streams: &ONE,
        producers: 1,
        depth: 4,
        stable: false,
        postgres: false,
        nemesis: core_panic,
    },
    Scenario {
        name: "damaged-restart",
        about: "one broker, 64 KiB segments: SIGKILL, then garbage in whole sectors past the end of each shard's newest segment (a torn last round) and sealed segments' indexes deleted, cut short or garbled; restart",
        nodes: 1,
        proxies: false,
        broker_yaml: "segment_bytes: 65536\n",
        streams: &ONE,
        producers: 1,
        depth: 8,
        stable: false,
        postgres: false,
        nemesis: damaged_restart,
    },
    Scenario {
        name: "damaged-replica",
        about: "three brokers, Quorum streams, 16 KiB segments: SIGKILL a broker (a leader one time in two), flip a bit inside a sealed segment of each of its copies, restart it; its damaged copies are set aside and rebuilt from the others before the next round",
        nodes: 3,
        proxies: false,
        broker_yaml: "segment_bytes: 16384\n",
        streams: &[Q3, Q3B],
        producers: 1,
        depth: 8,
        stable: false,
        postgres: false,
        nemesis: damaged_replica,
    },
    Scenario {
        name: "fd-exhaustion",
        about: "one broker: its soft open-files limit is lowered to what it has open plus 0-8 for 0.5-2 s, the first time and one time in three after that right after a restart and with no spare descriptor (shard logs cannot open until it is raised), then raised back",
        nodes: 1,
        proxies: false,
        broker_yaml: "",
        streams: &ONE,
        producers: 1,
        depth: 4,
        stable: false,
        postgres: false,
        nemesis: fd_exhaustion,
    },
    Scenario {
        name: "duplicate-node",
        about: "three brokers, Quorum streams: every 1.5-3 s a second broker is started under a live broker's node id (its config, its own data directory and ports); it must be refused and exit non-zero, and no leadership may move",
        nodes: 3,
        proxies: false,
        broker_yaml: "",
        streams: &[Q3, Q3B],
        producers: 2,
        depth: 1,
        stable: true,
        postgres: false,
        nemesis: duplicate_node,
    },
    Scenario {
        name: "delete-recreate",
        about: "three brokers, a Quorum stream under the checked load, and a second Quorum stream of three copies deleted and created again under its name every 0.2-0.8 s after 20 records were written to it and read back; one time in two a broker is SIGKILLed and restarted right after the delete. No incarnation may hold a record of an earlier one or lose one it acknowledged, and no live broker may keep a copy after a delete",
        nodes: 3,
        proxies: false,
        broker_yaml: "",
        streams: &[Q3],
        producers: 2,
        depth: 4,
        stable: false,
        postgres: false,
        nemesis: delete_recreate,
    },
    Scenario {
        name: "delete-recreate-away",
        about: "as delete-recreate, and one time in three a broker is down across the delete and the re-create, then comes back and is made the new incarnation's leader (finds an open bug: see docs/reliability.md row 23)",
        nodes: 3,
        proxies: false,
        broker_yaml: "",
        streams: &[Q3],
        producers: 2,
        depth: 4,
        stable: false,
        postgres: false,
        nemesis: delete_recreate_away,
    },
    Scenario {
        name: "hostile-clients",
        about: "one broker under the checked load, and every 0.1-0.6 s a hostile client: a forged, misaddressed or another tenant's token (and, past 63 s, an expired one); another tenant's valid token writing here; a connection asking four times its subscription bound; one that never reads its answers; subscribers that vanish without closing; a token denied while its connection publishes; an authenticated connection sending hostile frames (every kind of request, the session fuzz corpus, each sent as is, mutated or replaced by garbage). Each must be refused or bounded as documented, every error answer must carry a code, the broker must answer afterwards and never exit, dead clients' subscriptions must end within the idle timeout, no record may reach another stream's subscriber, memory must stay bounded",
        nodes: 1,
        proxies: false,
        broker_yaml: "idle_timeout_ms: 5000\nmax_subscriptions_per_connection: 32\n",
        streams: &ONE,
        producers: 1,
        depth: 4,
        stable: false,
        postgres: false,
        nemesis: hostile_clients,
    },
    Scenario {
        name: "hostile-frames",
        about: "one broker under the checked load, and back to back authenticated connections each opening 1-6 request streams of hostile frames (every kind of request, the session fuzz corpus, each sent as is, mutated or replaced by garbage; one stream in five publish-only): every answer must be a well-formed frame, every error must carry a code, the broker must answer a request after each connection and never exit, dead subscriptions must end and memory stay bounded",
        nodes: 1,
        proxies: false,
        broker_yaml: "idle_timeout_ms: 5000\n",
        streams: &ONE,
        producers: 1,
        depth: 4,
        stable: false,
        postgres: false,
        nemesis: hostile_frames_only,
    },
    Scenario {
        name: "filesystem-full",
        about: "one broker whose data directory is on a 64 MiB ext4 of its own (a loop device; needs root), 64 KiB segments: every 1-2.5 s the filesystem is filled until ext4 refuses, 0-256 KiB given back, for 0.5-2 s (appends refused, retryable), one time in three the broker is SIGKILLed and restarted while it is full; then the filler is removed",
        nodes: 1,
        proxies: false,
        broker_yaml: "segment_bytes: 65536\n",
        streams: &ONE,
        producers: 1,
        depth: 4,
        stable: false,
        postgres: false,
        nemesis: filesystem_full,
    },
    Scenario {
        name: "filesystem-full-replicated",
        about: "three brokers, a Quorum and a Leader stream, each broker's data directory on a 64 MiB ext4 of its own (loop devices; needs root), 64 KiB segments: every 1-2.5 s one broker's filesystem (half the time a leader's) is filled until ext4 refuses, 0-256 KiB given back, for 0.5-2 s, one time in three that broker is SIGKILLed and restarted while it is full; then the filler is removed",
        nodes: 3,
        proxies: false,
        broker_yaml: "segment_bytes: 65536\n",
        streams: &[Q3, L3],
        producers: 2,
        depth: 4,
        stable: false,
        postgres: false,
        nemesis: filesystem_full,
    },
];

/// The scenario named `name`.
pub fn scenario(name: &str) -> Option<&'static Scenario> {
    SCENARIOS.iter().find(|s| s.name == name)
}

/// A small seeded generator (splitmix64).
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// Seeded.
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// The next number.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[lo, hi]`.
    pub fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }
}

/// What a nemesis acts on: the cluster, its seeded randomness, its deadline, and the
/// timeline it writes.
#[derive(Debug)]
pub struct Nemesis<'a> {
    /// The cluster.
    pub cluster: &'a mut TestCluster,
    /// The scenario's streams.
    pub streams: &'static [StreamSpec],
    /// Seeded randomness.
    pub rng: Rng,
    began: Instant,
    deadline: Instant,
    timeline: Vec<Value>,
    paused: Vec<usize>,
    killed: Vec<usize>,
    /// What must outlive the brokers (a filesystem their data sits on): dropped after
    /// the cluster.
    held: Vec<Box<dyn std::any::Any>>,
    /// The run has the chaos register ([`REGISTER`]).
    register: bool,
}

impl Nemesis<'_> {
    /// Whether the run's time is not up.
    pub fn running(&self) -> bool {
        Instant::now() < self.deadline
    }

    /// Writes an event into the timeline.
    pub fn event(&mut self, what: &str, detail: Value) {
        self.timeline.push(
            json!({"t_ms": self.began.elapsed().as_millis() as u64, "fault": what, "detail": detail}),
        );
    }

    /// Sleeps a random time in `[lo, hi]` ms, or less when the run ends first.
    pub fn sleep_ms(&mut self, lo: u64, hi: u64) {
        let d = Duration::from_millis(self.rng.between(lo, hi));
        let left = self.deadline.saturating_duration_since(Instant::now());
        std::thread::sleep(d.min(left.max(Duration::from_millis(1))));
    }

    /// The leader of a random stream's shard 0, once there is one.
    pub fn some_leader(&mut self) -> anyhow::Result<(usize, &'static str)> {
        let spec = self.streams[self.rng.between(0, self.streams.len() as u64 - 1) as usize];
        let (leader, _) =
            self.cluster
                .wait_leader(spec.name, 0, None, 0, Duration::from_secs(30))?;
        Ok((leader, spec.name))
    }

    /// The broker a leader fault hits: some stream's leader, or one time in three
    /// one of the registers' when the run has them (so they fail over too).
    pub fn target_leader(&mut self) -> anyhow::Result<usize> {
        if self.register && self.rng.between(0, 2) == 0 {
            if self.rng.between(0, 1) == 0 {
                let (leader, _) = self.cluster.wait_leader(
                    STATE_REGISTER,
                    0,
                    None,
                    0,
                    Duration::from_secs(30),
                )?;
                return Ok(leader);
            }
            let leader = wait_for("the register's leader", Duration::from_secs(30), || {
                let a = self
                    .cluster
                    .assignments()
                    .ok()?
                    .into_iter()
                    .find(|a| a["kind"] == "cache" && a["name"] == REGISTER)?;
                Some(self.cluster.index(a["leader"].as_str()?))
            })?;
            return Ok(leader);
        }
        Ok(self.some_leader()?.0)
    }

    /// SIGKILL broker `i`.
    pub fn kill(&mut self, i: usize) {
        self.cluster.brokers[i].kill();
        self.killed.push(i);
        self.event("kill", json!({"node": i}));
    }

    /// Starts broker `i` again.
    pub fn restart(&mut self, i: usize) -> anyhow::Result<()> {
        self.cluster.brokers[i].restart()?;
        self.killed.retain(|k| *k != i);
        self.event("restart", json!({"node": i}));
        Ok(())
    }

    /// SIGSTOP broker `i`.
    pub fn pause(&mut self, i: usize) {
        self.cluster.brokers[i].signal(libc::SIGSTOP);
        self.paused.push(i);
        self.event("pause", json!({"node": i}));
    }

    /// SIGCONT broker `i`.
    pub fn resume(&mut self, i: usize) {
        self.cluster.brokers[i].signal(libc::SIGCONT);
        self.paused.retain(|k| *k != i);
        self.event("resume", json!({"node": i}));
    }

    /// Sets a link rule.
    pub fn link(&mut self, from: Party, to: Party, link: Link) {
        self.cluster.rules().set(from, to, link);
        self.event(
            "link",
            json!({"from": from.to_string(), "to": to.to_string(), "cut": link.cut,
                   "drop": link.drop, "duplicate": link.duplicate,
                   "delay_ms": link.delay.as_millis() as u64, "jitter_ms": link.jitter.as_millis() as u64}),
        );
    }

    /// Every link back to normal.
    pub fn heal_links(&mut self) {
        if self.cluster.net.is_some() {
            self.cluster.rules().heal();
            self.event("heal", json!({}));
        }
    }

    /// Heals everything: links, paused and killed brokers.
    fn heal_all(&mut self) -> anyhow::Result<()> {
        self.heal_links();
        for i in self.paused.clone() {
            self.resume(i);
        }
        for i in self.killed.clone() {
            self.restart(i)?;
        }
        Ok(())
    }
}

fn kill_restart(n: &mut Nemesis<'_>) -> anyhow::Result<()> {
    while n.running() {
        n.sleep_ms(1000, 3000);
        n.kill(0);
        n.restart(0)?;
    }
    Ok(())
}

fn leader_kill(n: &mut Nemesis<'_>) -> anyhow::Result<()> {
    while n.running() {
        n.sleep_ms(1500, 3000);
        let leader = n.target_leader()?;
        n.kill(leader);
        n.sleep_ms(2000, 4000);
        n.restart(leader)?;
    }
    Ok(())
}

fn leader_bounce(n: &mut Nemesis<'_>) -> anyhow::Result<()> {
    while n.running() {
        n.sleep_ms(1500, 3000);
        let leader = n.target_leader()?;
        n.kill(leader);
        n.restart(leader)?;
    }
    Ok(())
}

fn leader_pause(n: &mut Nemesis<'_>) -> anyhow::Result<()> {
    while n.running() {
        n.sleep_ms(1500, 3000);
        // A Leader-consistency stream's leader when there is one: its acks need no
        // majority, so one acknowledged after the lease ran out would show.
        let (leader, _) = match n.streams.iter().find(|s| s.consistency == "Leader") {
            Some(s) => (
                n.cluster
                    .wait_leader(s.name, 0, None, 0, Duration::from_secs(30))?
                    .0,
                s.name,
            ),
            None => (n.target_leader()?, ""),
        };
        n.pause(leader);
        // Cut from the control plane and the other brokers while it sleeps, so that
        // neither the assignment naming its successor nor the successor's fence is
        // waiting in its sockets when it wakes: it wakes past its lease believing it
        // leads, with clients still connected, and until the links heal only the
        // lease keeps it from acknowledging what its successor never gets.
        let mut parties = vec![Party::ControlPlane];
        parties.extend(others(n, leader).into_iter().map(Party::Node));
        for p in parties {
            n.link(Party::Node(leader), p, Link::cut());
            n.link(p, Party::Node(leader), Link::cut());
        }
        // The harness's lease is 1.125 s; the control plane moves leadership ~1.9 s on.
        std::thread::sleep(Duration::from_millis(n.rng.between(2500, 4000)));
        n.resume(leader);
        std::thread::sleep(Duration::from_millis(n.rng.between(300, 800)));
        n.heal_links();
    }
    Ok(())
}

fn others(n: &Nemesis<'_>, i: usize) -> Vec<usize> {
    (0..n.cluster.brokers.len()).filter(|j| *j != i).collect()
}

fn leader_isolated(n: &mut Nemesis<'_>) -> anyhow::Result<()> {
    while n.running() {
        n.sleep_ms(1500, 3000);
        let leader = n.target_leader()?;
        for j in others(n, leader) {
            n.link(Party::Node(leader), Party::Node(j), Link::cut());
            n.link(Party::Node(j), Party::Node(leader), Link::cut());
        }
        std::thread::sleep(Duration::from_millis(n.rng.between(3000, 5000)));
        n.heal_links();
    }
    Ok(())
}

fn leader_one_way(n: &mut Nemesis<'_>) -> anyhow::Result<()> {
    while n.running() {
        n.sleep_ms(1500, 3000);
        let leader = n.target_leader()?;
        for j in others(n, leader) {
            n.link(Party::Node(leader), Party::Node(j), Link::cut());
        }
        std::thread::sleep(Duration::from_millis(n.rng.between(3000, 5000)));
        n.heal_links();
    }
    Ok(())
}

fn controlplane_partition(n: &mut Nemesis<'_>) -> anyhow::Result<()> {
    while n.running() {
        n.sleep_ms(1500, 3000);
        let leader = n.target_leader()?;
        n.link(Party::Node(leader), Party::ControlPlane, Link::cut());
        std::thread::sleep(Duration::from_millis(n.rng.between(3000, 5000)));
        n.heal_links();
    }
    Ok(())
}

fn flaky_links(n: &mut Nemesis<'_>) -> anyhow::Result<()> {
    let flaky = Link {
        drop: 0.05,
        duplicate: 0.05,
        jitter: Duration::from_millis(20),
        ..Link::default()
    };
    let nodes = n.cluster.brokers.len();
    for i in 0..nodes {
        n.link(Party::Client, Party::Node(i), flaky);
        n.link(Party::Node(i), Party::Client, flaky);
        for j in others(n, i) {
            n.link(Party::Node(i), Party::Node(j), flaky);
        }
    }
    while n.running() {
        n.sleep_ms(3000, 6000);
        if !n.running() {
            break;
        }
        let leader = n.target_leader()?;
        n.kill(leader);
        n.sleep_ms(1000, 3000);
        n.restart(leader)?;
    }
    Ok(())
}

fn planned_move(n: &mut Nemesis<'_>) -> anyhow::Result<()> {
    while n.running() {
        n.sleep_ms(1500, 3000);
        let (leader, stream) = n.some_leader()?;
        let to = others(n, leader)[n.rng.between(0, 1) as usize];
        move_and_record(n, "move", stream, to, json!({"from": leader}));
    }
    Ok(())
}

/// `POST /v1/shard-moves` of shard 0 of `stream` to broker `to`, recorded as event
/// `what` with `detail`, the stream, the destination and how the request ended.
fn move_and_record(n: &mut Nemesis<'_>, what: &str, stream: &str, to: usize, mut detail: Value) {
    let answer = n.cluster.admin.post(
        "/v1/shard-moves",
        &json!({"tenant_id": crate::cluster::TENANT, "namespace": NAMESPACE,
                "stream": stream, "shard": 0, "destination": format!("node-{to}")}),
    );
    detail["stream"] = json!(stream);
    detail["to"] = json!(to);
    detail["ok"] = json!(answer.is_ok());
    detail["error"] = json!(answer.err().map(|e| e.to_string()));
    n.event(what, detail);
}

fn staged_move(n: &mut Nemesis<'_>) -> anyhow::Result<()> {
    while n.running() {
        n.sleep_ms(1500, 3000);
        if n.rng.between(0, 3) == 0 {
            let victim = n.rng.between(0, n.cluster.brokers.len() as u64 - 1) as usize;
            n.kill(victim);
            n.sleep_ms(1000, 3000);
            n.restart(victim)?;
            continue;
        }
        let (_, stream) = n.some_leader()?;
        let Some(a) = n.cluster.assignment(stream, 0) else {
            continue;
        };
        let members: Vec<String> = a["replicas"]
            .as_array()
            .map(|m| {
                m.iter()
                    .filter_map(|r| r.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default();
        let Some(to) =
            (0..n.cluster.brokers.len()).find(|i| !members.contains(&format!("node-{i}")))
        else {
            continue;
        };
        move_and_record(n, "staged-move", stream, to, json!({"members": members}));
    }
    Ok(())
}

fn sigterm_drain(n: &mut Nemesis<'_>) -> anyhow::Result<()> {
    while n.running() {
        n.sleep_ms(1500, 3000);
        let (leader, _) = n.some_leader()?;
        n.event("sigterm", json!({"node": leader}));
        let started = Instant::now();
        let clean = n.cluster.brokers[leader].terminate(Duration::from_secs(20));
        n.event(
            "exited",
            json!({"node": leader, "clean": clean, "after_ms": started.elapsed().as_millis() as u64}),
        );
        anyhow::ensure!(
            clean,
            "node {leader} did not drain and exit 0 within 20 s of SIGTERM"
        );
        n.sleep_ms(500, 1500);
        n.restart(leader)?;
    }
    Ok(())
}

fn controlplane_restart(n: &mut Nemesis<'_>) -> anyhow::Result<()> {
    while n.running() {
        n.sleep_ms(2000, 4000);
        n.cluster.cp.kill();
        n.event("controlplane-kill", json!({}));
        n.sleep_ms(300, 1500);
        let started = Instant::now();
        n.cluster.cp.restart()?;
        n.event(
            "controlplane-restart",
            json!({"start_ms": started.elapsed().as_millis() as u64}),
        );
    }
    Ok(())
}

fn controlplane_clock(n: &mut Nemesis<'_>) -> anyhow::Result<()> {
    let steps: [i64; 6] = [5_000, -5_000, 60_000, -120_000, 3_600_000, -3_540_000];
    let mut i = 0;
    while n.running() {
        n.sleep_ms(700, 1500);
        let step = steps[i % steps.len()];
        i += 1;
        n.cluster
            .admin
            .post("/debug/clock", &json!({ "step_ms": step }))
            .map_err(|e| anyhow::anyhow!("stepping the control plane's clock: {e}"))?;
        n.event("controlplane-clock", json!({ "step_ms": step }));
    }
    Ok(())
}

fn fsync_eio(n: &mut Nemesis<'_>) -> anyhow::Result<()> {
    while n.running() {
        n.sleep_ms(1500, 3000);
        let (status, body) =
            n.cluster.brokers[0].http_post("/debug/storage-faults?op=sync&errno=eio&times=once")?;
        anyhow::ensure!(status == 200, "arming the fault: {status} {body}");
        n.event("fsync-eio", json!({"node": 0}));
        n.sleep_ms(1000, 2000);
        // A poisoned shard stays refusing until the broker restarts and recovers.
        n.kill(0);
        n.restart(0)?;
    }
    Ok(())
}

fn disk_full(n: &mut Nemesis<'_>) -> anyhow::Result<()> {
    while n.running() {
        n.sleep_ms(1000, 2000);
        let (status, body) = n.cluster.brokers[0]
            .http_post("/debug/storage-faults?op=write&errno=enospc&times=always")?;
        anyhow::ensure!(status == 200, "arming the fault: {status} {body}");
        n.event("disk-full", json!({"node": 0}));
        n.sleep_ms(300, 1000);
        let (status, body) = n.cluster.brokers[0].http_post("/debug/storage-faults?clear=true")?;
        anyhow::ensure!(status == 200, "clearing the fault: {status} {body}");
        n.event("space-back", json!({"node": 0}));
    }
    Ok(())
}

fn core_panic(n: &mut Nemesis<'_>) -> anyhow::Result<()> {
    while n.running() {
        n.sleep_ms(1500, 3000);
        let core = n.rng.between(0, 1);
        let (status, body) =
            n.cluster.brokers[0].http_post(&format!("/debug/panic?core={core}"))?;
        anyhow::ensure!(status == 200, "arming the panic: {status} {body}");
        let armed = Instant::now();
        let code = loop {
            if let Some(s) = n.cluster.brokers[0].exit_status() {
                break s.code();
            }
            anyhow::ensure!(
                armed.elapsed() < Duration::from_secs(10),
                "core {core} was told to panic; the process still runs after 10 s"
            );
            std::thread::sleep(Duration::from_millis(10));
        };
        anyhow::ensure!(
            code == Some(70),
            "a core panicked; the process exited {code:?}, not 70"
        );
        n.event(
            "core-panic",
            json!({"core": core, "exit_ms": armed.elapsed().as_millis() as u64}),
        );
        n.restart(0)?;
    }
    Ok(())
}

fn damaged_restart(n: &mut Nemesis<'_>) -> anyhow::Result<()> {
    while n.running() {
        n.sleep_ms(1000, 3000);
        n.kill(0);
        let root = n.cluster.brokers[0].data_dir.join("streams");
        let (mut torn, mut indexes) = (0, 0);
        for shard in shard_dirs(&root)? {
            let mut names: Vec<String> = std::fs::read_dir(&shard)?
                .filter_map(|e| e.ok()?.file_name().into_string().ok())
                .collect();
            names.sort();
            let segments: Vec<&String> = names.iter().filter(|n| n.ends_with(".seg")).collect();
            // A torn round: sectors past the end of what the newest segment holds
            // reached the disk while an earlier one of the round did not (a sector is
            // written whole: the garbage starts at a 4 KiB boundary, zeros before it).
            // Not in a segment whose header block is not there yet: a segment's header
            // is synced before any batch is written to it.
            let newest = segments
                .last()
                .map(|n| shard.join(n))
                .filter(|p| std::fs::metadata(p).is_ok_and(|m| m.len() >= 4096));
            if let Some(path) = newest {
                use std::io::Write as _;
                let end = std::fs::metadata(&path)?.len();
                // At least one sector of the round did not land before the garbage: the
                // rest of the sector holding the end, or (an end on a sector boundary)
                // whole sectors. Garbage right at an aligned end would be a first
                // sector that landed holding no batch — no power cut writes that, and
                // recovery rightly refuses it (seed 20261207 once drew it).
                let pad = (4096 - end % 4096) % 4096;
                let hole = if pad == 0 {
                    n.rng.between(1, 2) * 4096
                } else {
                    n.rng.between(0, 2) * 4096 + pad
                };
                let len = n.rng.between(1, 6000) as usize;
                let mut bytes = vec![0u8; hole as usize];
                bytes.extend((0..len).map(|i| (0xa5 ^ i as u8) | 1));
                std::fs::OpenOptions::new()
                    .append(true)
                    .open(&path)?
                    .write_all(&bytes)?;
                torn += 1;
            }
            // Sealed segments' indexes: deleted, cut short, or garbled.
            for idx in names.iter().filter(|n| n.ends_with(".idx")) {
                let path = shard.join(idx);
                match n.rng.between(0, 3) {
                    0 => std::fs::remove_file(&path)?,
                    1 => {
                        let len = std::fs::metadata(&path)?.len();
                        std::fs::OpenOptions::new()
                            .write(true)
                            .open(&path)?
                            .set_len(len / 2)?;
                    }
                    2 => {
                        let mut bytes = std::fs::read(&path)?;
                        if let Some(b) = bytes.get_mut(n.rng.between(0, 63) as usize) {
                            *b ^= 0x5a;
                        }
                        std::fs::write(&path, bytes)?;
                    }
                    _ => continue,
                }
                indexes += 1;
            }
        }
        n.event("damage", json!({"torn_tails": torn, "indexes": indexes}));
        n.restart(0)?;
    }
    Ok(())
}

/// The brokers' default `damaged_copies_kept`.
const DAMAGED_COPIES_KEPT: usize = 4;

fn damaged_replica(n: &mut Nemesis<'_>) -> anyhow::Result<()> {
    let mut damaged: HashMap<usize, usize> = HashMap::new();
    while n.running() {
        n.sleep_ms(1500, 3000);
        let b = if n.rng.between(0, 1) == 0 {
            n.some_leader()?.0
        } else {
            n.rng.between(0, n.cluster.brokers.len() as u64 - 1) as usize
        };
        n.kill(b);
        let root = n.cluster.brokers[b].data_dir.join("streams");
        let mut flipped = Vec::new();
        for shard in shard_dirs(&root)? {
            let mut sealed: Vec<PathBuf> = std::fs::read_dir(&shard)?
                .filter_map(|e| {
                    let p = e.ok()?.path();
                    (p.extension()? == "seg").then_some(p)
                })
                .collect();
            sealed.sort();
            sealed.pop(); // the active segment
            if sealed.is_empty() {
                continue;
            }
            let path = &sealed[n.rng.between(0, sealed.len() as u64 - 1) as usize];
            let mut bytes = std::fs::read(path)?;
            // Past the header block, inside the batches (a sealed segment's tail may
            // be padding no checksum covers).
            if bytes.len() < 3 * 4096 {
                continue;
            }
            let at = n.rng.between(4096, bytes.len() as u64 * 3 / 4) as usize;
            bytes[at] ^= 1 << n.rng.between(0, 7);
            std::fs::write(path, &bytes)?;
            flipped.push(path.strip_prefix(&root)?.display().to_string());
        }
        n.event("damage", json!({"node": b, "flipped": flipped}));
        n.restart(b)?;
        // One damaged broker at a time: copies being rebuilt count in no election, so
        // a second one could leave a shard with no majority that may elect.
        let began = Instant::now();
        let rebuilt = wait_for("the copies rebuilt", Duration::from_secs(30), || {
            let b = &n.cluster.brokers[b];
            (b.metric("felix_broker_shards_open").ok()? >= flipped.len() as u64
                && b.metric("felix_broker_replicas_rebuilding").ok()? == 0)
                .then_some(())
        });
        // Copies damaged so far on that broker, and those it keeps set aside: the
        // oldest beyond `damaged_copies_kept` are deleted by a prune that runs after
        // each copy is set aside, not awaited by the reopen, so the bound may take a
        // moment.
        *damaged.entry(b).or_default() += flipped.len();
        let root = n.cluster.brokers[b].data_dir.join("damaged-copies");
        let count = || std::fs::read_dir(&root).map_or(0, |d| d.count());
        let bounded = wait_for("the damaged copies pruned", Duration::from_secs(10), || {
            (count() <= DAMAGED_COPIES_KEPT).then_some(())
        });
        let kept = count();
        n.event(
            if rebuilt.is_ok() {
                "rebuilt"
            } else {
                "not-rebuilt"
            },
            json!({"node": b, "ms": began.elapsed().as_millis() as u64,
                   "damaged_so_far": damaged[&b], "kept": kept,
                   "kept_metric": n.cluster.brokers[b].metric("felix_broker_damaged_copies").ok()}),
        );
        anyhow::ensure!(
            bounded.is_ok(),
            "broker {b} keeps {kept} damaged copies (damaged_copies_kept is {DAMAGED_COPIES_KEPT})"
        );
    }
    Ok(())
}

fn fd_exhaustion(n: &mut Nemesis<'_>) -> anyhow::Result<()> {
    let mut first = true;
    while n.running() {
        n.sleep_ms(1000, 2500);
        // The first round always restarts, so every run (a short one too) opens logs
        // under the limit.
        let restarted = std::mem::take(&mut first) || n.rng.between(0, 2) == 0;
        if restarted {
            n.kill(0);
            n.restart(0)?;
        }
        let pid = n.cluster.brokers[0].pid();
        let open = std::fs::read_dir(format!("/proc/{pid}/fd"))?.count() as u64;
        // Right after a restart no log is open yet: no spare descriptor at all, so the
        // first opens are refused until the limit is lifted.
        let limit = open + if restarted { 0 } else { n.rng.between(0, 8) };
        let was = crate::set_open_files(pid, limit)?;
        n.event(
            "fd-limit",
            json!({"open": open, "limit": limit, "after_restart": restarted}),
        );
        n.sleep_ms(500, 2000);
        crate::set_open_files(pid, was)?;
        n.event("fd-limit-lifted", json!({ "limit": was }));
    }
    Ok(())
}

fn duplicate_node(n: &mut Nemesis<'_>) -> anyhow::Result<()> {
    let mut k = 0;
    while n.running() {
        n.sleep_ms(1500, 3000);
        let i = n.rng.between(0, n.cluster.brokers.len() as u64 - 1) as usize;
        let b = &n.cluster.brokers[i];
        let node = b
            .data_dir
            .file_name()
            .and_then(|f| f.to_str())
            .context("a broker's data directory is named after its node")?
            .to_owned();
        let dir = b.data_dir.parent().context("the cluster directory")?;
        // The live broker's config, with its own peer listener (the rest, node id
        // and token included, is the live broker's).
        let config = std::fs::read_to_string(dir.join(format!("{node}.yaml")))?;
        let internal = crate::free_udp_addr()?;
        let config: String = config
            .lines()
            .map(|l| {
                if l.starts_with("internal_listen:") {
                    format!("internal_listen: {internal}\n")
                } else {
                    format!("{l}\n")
                }
            })
            .collect();
        k += 1;
        let path = dir.join(format!("impostor-{k}.yaml"));
        std::fs::write(&path, config)?;
        let started = Instant::now();
        let mut impostor = std::process::Command::new(b.binary())
            .args(["serve", "--config"])
            .arg(&path)
            .arg("--data-dir")
            .arg(dir.join(format!("impostor-{k}")))
            .args(["--listen", &crate::free_udp_addr()?.to_string()])
            .args(["--http", "127.0.0.1:0"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()?;
        let status = loop {
            if let Some(s) = impostor.try_wait()? {
                break s;
            }
            if started.elapsed() > Duration::from_secs(20) {
                let _ = impostor.kill();
                let _ = impostor.wait();
                anyhow::bail!("a second broker under {node} kept running for 20 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        anyhow::ensure!(!status.success(), "a second broker under {node} exited 0");
        n.event(
            "duplicate-node",
            json!({"node": node, "exit": status.code(), "exit_ms": started.elapsed().as_millis() as u64}),
        );
    }
    Ok(())
}

fn filesystem_full(n: &mut Nemesis<'_>) -> anyhow::Result<()> {
    // Each broker's data directory moves onto a filesystem of its own, small enough to
    // fill: a loop-mounted ext4 in a directory of its own (unmounted after the brokers
    // are gone). One broker at a time, so a cluster keeps serving.
    let mut mounts = Vec::new();
    for i in 0..n.cluster.brokers.len() {
        let dir = tempfile::tempdir()?;
        let fs = crate::LoopFs::mount(dir.path(), 64)
            .context("filesystem-full needs root and a loop device to mount a small ext4")?;
        let mount = fs.mount.clone();
        // Tuple fields drop in order: unmount, then remove the directory.
        n.held.push(Box::new((fs, dir)));
        n.kill(i);
        let data = n.cluster.brokers[i].data_dir.clone();
        let moved = mount.join("data");
        let copied = std::process::Command::new("cp")
            .arg("-a")
            .arg(&data)
            .arg(&moved)
            .status()?;
        anyhow::ensure!(copied.success(), "copying the data directory: {copied}");
        std::fs::remove_dir_all(&data)?;
        std::os::unix::fs::symlink(&moved, &data)?;
        n.restart(i)?;
        for s in n.streams {
            n.cluster
                .wait_leader(s.name, 0, None, 0, Duration::from_secs(30))?;
        }
        n.event(
            "data-on-small-filesystem",
            json!({"node": i, "free": crate::free_bytes(&mount)?}),
        );
        mounts.push(mount);
    }
    while n.running() {
        n.sleep_ms(1000, 2500);
        // Half the time a leader's (a follower's full disk costs a Quorum write
        // nothing while the other follower answers).
        let i = if n.rng.between(0, 1) == 0 {
            n.some_leader()?.0
        } else {
            n.rng.between(0, mounts.len() as u64 - 1) as usize
        };
        let filler = mounts[i].join("filler");
        // Filled until ext4 refuses (it keeps a little it never hands out), then
        // 0-256 KiB given back: room for a few small writes, not for a segment.
        let filled = crate::fill(&filler, u64::MAX)?;
        let leave = n.rng.between(0, 64) * 4096;
        std::fs::OpenOptions::new()
            .write(true)
            .open(&filler)?
            .set_len(filled.saturating_sub(leave))?;
        let restart = n.rng.between(0, 2) == 0;
        n.event(
            "filesystem-full",
            json!({"node": i, "filled": filled.saturating_sub(leave), "given_back": leave,
                   "free": crate::free_bytes(&mounts[i])?, "restart": restart}),
        );
        n.sleep_ms(500, 2000);
        if restart {
            n.kill(i);
            n.restart(i)?;
        }
        std::fs::remove_file(&filler)?;
        n.event(
            "space-back",
            json!({"node": i, "free": crate::free_bytes(&mounts[i])?}),
        );
    }
    Ok(())
}

fn delete_recreate(n: &mut Nemesis<'_>) -> anyhow::Result<()> {
    churn(n, false)
}

fn delete_recreate_away(n: &mut Nemesis<'_>) -> anyhow::Result<()> {
    churn(n, true)
}

/// The `delete-recreate` nemesis; with `away`, a broker may also be down across a
/// delete and the re-create, then made the new incarnation's leader.
fn churn(n: &mut Nemesis<'_>, away_too: bool) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let streams = format!("/v1/tenants/{TENANT}/namespaces/{NAMESPACE}/streams");
    let dirs: Vec<PathBuf> = n
        .cluster
        .brokers
        .iter()
        .map(|b| {
            b.data_dir
                .join(format!("streams/{TENANT}/{NAMESPACE}/churn"))
        })
        .collect();
    let nodes = n.cluster.brokers.len() as u64;
    let mut round = 0u64;
    // A broker down across the last delete and re-create, still to start again.
    let mut away: Option<usize> = None;
    while n.running() {
        n.sleep_ms(200, 800);
        // The name is free once the control plane forgot the last incarnation.
        crate::wait_for("the name to be free", Duration::from_secs(15), || {
            n.cluster.create_stream("churn", 1, 3, "Quorum").ok()
        })?;
        n.cluster
            .wait_leader("churn", 0, None, 0, Duration::from_secs(30))?;
        let mut checked = Vec::new();
        if let Some(i) = away.take() {
            // It comes back holding a copy of the deleted incarnation under the same
            // name; then it is made leader of the new one and read from.
            n.restart(i)?;
            checked.push(churn_check(&rt, n.cluster, round, None)?);
            let (_, generation) =
                n.cluster
                    .wait_leader("churn", 0, None, 0, Duration::from_secs(5))?;
            let moved = n.cluster.admin.post(
                "/v1/shard-moves",
                &json!({"tenant_id": TENANT, "namespace": NAMESPACE, "stream": "churn",
                        "kind": "stream", "shard": 0, "destination": format!("node-{i}")}),
            );
            let leader = match moved {
                Ok(_) => {
                    n.cluster
                        .wait_leader("churn", 0, None, generation, Duration::from_secs(30))?
                        .0
                }
                Err(e) if e.to_string().contains("already_leader") => i,
                Err(e) => return Err(e.into()),
            };
            checked.push(churn_check(&rt, n.cluster, round, Some(leader))?);
        } else {
            checked.push(churn_check(&rt, n.cluster, round, None)?);
        }
        // Now and then a broker restarts right after the delete (it must not bring its
        // copy back); with `away_too`, one may be down across the delete and the next
        // re-create.
        let mode = n.rng.between(0, if away_too { 2 } else { 1 });
        let victim = n.rng.between(0, nodes - 1) as usize;
        if mode == 2 {
            n.kill(victim);
        }
        n.cluster.admin.delete(&format!("{streams}/churn"))?;
        if mode == 1 {
            n.kill(victim);
            n.restart(victim)?;
        }
        let down = (mode == 2).then_some(victim);
        crate::wait_for(
            "the deleted stream's data to leave every live broker",
            Duration::from_secs(30),
            || {
                dirs.iter()
                    .enumerate()
                    .all(|(b, d)| Some(b) == down || !d.exists())
                    .then_some(())
            },
        )?;
        n.event(
            "delete-recreate",
            json!({"incarnation": round, "checked": checked,
                   "restarted_after_delete": (mode == 1).then_some(victim),
                   "down_across_recreate": down}),
        );
        away = down;
        round += 1;
    }
    if let Some(i) = away {
        n.restart(i)?;
    }
    Ok(())
}

/// Writes 20 records to the stream `churn` (incarnation `round`) and reads it whole
/// (from `leader`, once it leads): it must hold every record acknowledged and none of
/// an earlier incarnation. Returns what it wrote and read.
fn churn_check(
    rt: &tokio::runtime::Runtime,
    cluster: &TestCluster,
    round: u64,
    leader: Option<usize>,
) -> anyhow::Result<Value> {
    let (acked, read) = rt.block_on(churn_round(cluster, round))?;
    let foreign: Vec<&String> = read
        .iter()
        .filter(|p| !p.starts_with(&format!("churn/{round}/")))
        .collect();
    anyhow::ensure!(
        foreign.is_empty(),
        "incarnation {round} of a re-created stream (leader {leader:?}) holds {} records of earlier ones: {:?}",
        foreign.len(),
        &foreign[..foreign.len().min(5)]
    );
    let missing = acked.iter().filter(|p| !read.contains(p)).count();
    anyhow::ensure!(
        missing == 0,
        "incarnation {round} (leader {leader:?}) lost {missing} of its {} acknowledged records",
        acked.len()
    );
    Ok(json!({"acked": acked.len(), "read": read.len(), "leader": leader}))
}

/// Writes 20 records to the stream `churn`, tagged with its incarnation, then reads it
/// whole: the payloads acknowledged, and every payload it holds.
async fn churn_round(
    cluster: &TestCluster,
    round: u64,
) -> anyhow::Result<(Vec<String>, Vec<String>)> {
    let c = ClusterClient::connect(&cluster.seeds(), "localhost", cluster.client_config()?).await?;
    let mut acked = Vec::new();
    for k in 0..20 {
        let payload = format!("churn/{round}/{k}");
        let r = tokio::time::timeout(
            Duration::from_secs(6),
            c.publish(
                TENANT,
                NAMESPACE,
                "churn",
                payload.clone().into_bytes(),
                AckMode::PerMessage,
            ),
        )
        .await;
        if let Ok(Ok(_)) = r {
            acked.push(payload);
        }
    }
    let mut sub = c
        .subscribe_shard(TENANT, NAMESPACE, "churn", 0, Some(StartPosition::Earliest))
        .await?;
    let mut read = Vec::new();
    while let Ok(Ok(Some(e))) =
        tokio::time::timeout(Duration::from_millis(1500), sub.next_event()).await
    {
        read.push(String::from_utf8_lossy(&e.payload).into_owned());
    }
    Ok((acked, read))
}

/// The broker's idle timeout in `hostile-clients`: a client that dies without closing
/// loses its connection (and its subscriptions) this long after its last packet.
const HOSTILE_IDLE_MS: u64 = 5000;

/// The subscriptions one connection may hold in `hostile-clients`.
const HOSTILE_SUBSCRIPTIONS: usize = 32;

fn hostile_clients(n: &mut Nemesis<'_>) -> anyhow::Result<()> {
    use felix_wire::{ErrorCode, Message};
    let admin = n.cluster.admin.clone();
    admin.post("/v1/tenants", &json!({"tenant_id": "intruder"}))?;
    admin.post(
        "/v1/tenants/intruder/namespaces",
        &json!({"namespace": NAMESPACE}),
    )?;
    let mint = |tenant: &str, audience: &str, ttl_seconds: u64| -> anyhow::Result<Value> {
        Ok(admin.post(
            &format!("/v1/tenants/{tenant}/tokens"),
            &json!({"sub": "hostile", "audience": audience, "ttl_seconds": ttl_seconds,
                    "perms": felix_wire::token::all_data_perms(tenant)}),
        )?)
    };
    let text = |v: &Value| v["token"].as_str().unwrap_or_default().to_owned();
    let intruder = text(&mint("intruder", "felix-broker", 3600)?);
    let mut bad = forgeries(&n.cluster.client_token)?;
    bad.push(("another-tenant", intruder.clone()));
    bad.push((
        "wrong-audience",
        text(&mint(TENANT, "felix-controlplane", 3600)?),
    ));
    let expiring = text(&mint(TENANT, "felix-broker", 1)?);
    let minted = Instant::now();
    let Hostile {
        addr,
        ca,
        good,
        templates,
        rss_before,
        live,
        rt,
    } = hostile_target(n)?;
    let mut frames_tally = FramesTally::default();
    let mut tally: BTreeMap<&'static str, u64> = BTreeMap::new();
    while n.running() {
        n.sleep_ms(100, 600);
        let attack = match n.rng.between(0, 11) {
            0..=2 => "bad-token",
            3 => "foreign-stream",
            4 | 5 => "subscription-flood",
            6 => "unread-answers",
            7 | 8 => "dead-subscriber",
            9 => "denied-mid-connection",
            _ => "hostile-frames",
        };
        *tally.entry(attack).or_default() += 1;
        match attack {
            "bad-token" => {
                let mut choices = bad.clone();
                // Verification allows 60 s of clock skew past `exp`: a one-second token
                // is refused from a minute on (runs longer than that try it).
                if minted.elapsed() > Duration::from_secs(63) {
                    choices.push(("expired", expiring.clone()));
                }
                let (what, token) = &choices[n.rng.between(0, choices.len() as u64 - 1) as usize];
                let answer = rt.block_on(auth_answer(addr, &ca, TENANT, token))?;
                anyhow::ensure!(
                    matches!(
                        answer,
                        Message::Error {
                            code: Some(ErrorCode::Unauthenticated),
                            ..
                        }
                    ),
                    "a {what} token was answered {answer:?}"
                );
                n.event("bad-token", json!({ "token": what }));
            }
            "foreign-stream" => {
                // Another tenant's valid token, writing to this tenant's stream.
                let stream = n.streams[n.rng.between(0, n.streams.len() as u64 - 1) as usize].name;
                let refused = rt.block_on(async {
                    let quinn = felix_client::quic_client_config_from_file(&ca, false)?;
                    let mut config = felix_client::ClientConfig::optimized_defaults(quinn);
                    config.auth_tenant_id = Some("intruder".into());
                    config.auth_token = Some(intruder.clone());
                    let c = felix_client::Client::connect(addr, "localhost", config).await?;
                    let r = c
                        .publish(
                            TENANT,
                            NAMESPACE,
                            stream,
                            b"intruder".to_vec(),
                            AckMode::PerMessage,
                        )
                        .await;
                    anyhow::Ok(r)
                })?;
                match refused {
                    Err(ClientError::Broker(b)) if b.code == Some(ErrorCode::Forbidden) => {}
                    other => {
                        anyhow::bail!("another tenant's publish to {stream} was answered {other:?}")
                    }
                }
                n.event("foreign-stream", json!({ "stream": stream }));
            }
            "subscription-flood" => {
                let stream = n.streams[n.rng.between(0, n.streams.len() as u64 - 1) as usize].name;
                let dies = n.rng.between(0, 1) == 0;
                let (subscribed, refused) =
                    subscription_flood(addr, &ca, &good, stream, 4 * HOSTILE_SUBSCRIPTIONS, dies)?;
                anyhow::ensure!(
                    subscribed == HOSTILE_SUBSCRIPTIONS && refused == 3 * HOSTILE_SUBSCRIPTIONS,
                    "a connection asking {} subscriptions got {subscribed}, {refused} refused limit_exceeded (bound {HOSTILE_SUBSCRIPTIONS})",
                    4 * HOSTILE_SUBSCRIPTIONS
                );
                n.event(
                    "subscription-flood",
                    json!({"stream": stream, "subscribed": subscribed, "refused": refused, "died": dies}),
                );
            }
            "unread-answers" => {
                let (written, held) = unread_answers(addr, &ca, &good)?;
                anyhow::ensure!(
                    held,
                    "a client that never read its answers was never held back ({written} publishes written)"
                );
                n.event("unread-answers", json!({ "written": written }));
            }
            "dead-subscriber" => {
                let stream = n.streams[n.rng.between(0, n.streams.len() as u64 - 1) as usize].name;
                let (subscribed, _) = subscription_flood(addr, &ca, &good, stream, 1, true)?;
                anyhow::ensure!(subscribed == 1, "a subscriber was refused");
                n.event("dead-subscriber", json!({ "stream": stream }));
            }
            "hostile-frames" => {
                let seed = n.rng.next_u64();
                let one = rt.block_on(hostile_frames(addr, &ca, &good, &templates, seed))?;
                anyhow::ensure!(
                    n.cluster.brokers[0].exit_status().is_none(),
                    "the broker exited under hostile frames (seed {seed})"
                );
                n.event("hostile-frames", one.summary());
                frames_tally.add(&one);
            }
            _ => {
                let token = mint(TENANT, "felix-broker", 3600)?;
                let took = rt.block_on(denied_mid_connection(&admin, addr, &ca, &token))?;
                n.event(
                    "denied-mid-connection",
                    json!({"closed_ms": took.as_millis() as u64}),
                );
            }
        }
    }
    // Every dead client's subscriptions end with its connection, within the idle
    // timeout; nothing reached another stream's subscriber; memory stayed bounded.
    let b = &n.cluster.brokers[0];
    let ended = subscriptions_end(b, live);
    let rss_after = b.rss_kib();
    let foreign = b.metric("felix_broker_foreign_batches_total")?;
    n.event(
        "afterwards",
        json!({"attacks": tally, "hostile_frames": frames_tally.summary(),
               "subscriptions": b.metric("felix_broker_subscriptions")?,
               "live_before": live, "rss_kib_before": rss_before, "rss_kib_after": rss_after,
               "foreign_batches": foreign}),
    );
    ended?;
    anyhow::ensure!(
        foreign == 0,
        "{foreign} batches reached a foreign subscriber"
    );
    anyhow::ensure!(
        rss_after < rss_before + 256 * 1024,
        "the broker grew from {rss_before} KiB to {rss_after} KiB under hostile clients"
    );
    Ok(())
}

/// Tokens that must be refused, made from the valid `token`: its signature garbled, an
/// unsigned (`alg: none`) and an HS256 one, a `kid` no key has, its claims widened
/// under the old signature, and something that is not a token at all.
fn forgeries(token: &str) -> anyhow::Result<Vec<(&'static str, String)>> {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let mut parts = token.trim().split('.');
    let (Some(h), Some(c), Some(s)) = (parts.next(), parts.next(), parts.next()) else {
        anyhow::bail!("the client token is not a JWT");
    };
    let enc = |v: &Value| b64.encode(v.to_string());
    let mut header: Value = serde_json::from_slice(&b64.decode(h)?)?;
    let mut claims: Value = serde_json::from_slice(&b64.decode(c)?)?;
    let mut sig = b64.decode(s)?;
    sig[0] ^= 1;
    header["kid"] = json!("no-such-key");
    claims["exp"] = json!(claims["exp"].as_u64().unwrap_or(0) + 10 * 365 * 86_400);
    Ok(vec![
        ("garbled-signature", format!("{h}.{c}.{}", b64.encode(&sig))),
        (
            "alg-none",
            format!("{}.{c}.", enc(&json!({"alg": "none", "typ": "JWT"}))),
        ),
        (
            "hs256",
            format!("{}.{c}.{s}", enc(&json!({"alg": "HS256", "typ": "JWT"}))),
        ),
        ("unknown-kid", format!("{}.{c}.{s}", enc(&header))),
        ("widened-claims", format!("{h}.{}.{s}", enc(&claims))),
        ("not-a-token", "not.a-token".into()),
    ])
}

/// What the broker answers an `auth` with `token` on a fresh connection.
async fn auth_answer(
    addr: std::net::SocketAddr,
    ca: &Path,
    tenant: &str,
    token: &str,
) -> anyhow::Result<felix_wire::Message> {
    let (_ep, conn) = crate::raw_connect_to(addr, ca).await?;
    let (mut send, mut recv) = conn.open_bi().await?;
    send.write_all(&crate::raw_auth(tenant, token)).await?;
    let answer = tokio::time::timeout(Duration::from_secs(5), crate::read_messages(&mut recv, 1))
        .await
        .context("no answer to auth within 5 s")??;
    answer
        .into_iter()
        .next()
        .flatten()
        .context("the auth answer is not a message")
}

/// Runs `work` on a runtime of its own, then leaves it: with `dies`, the client
/// vanishes without closing anything (its connections are forgotten and the runtime
/// that drives them dropped, so the broker hears nothing more and must time them out).
fn on_own_runtime<T: 'static>(
    dies: bool,
    work: impl std::future::Future<Output = anyhow::Result<(T, Box<dyn std::any::Any>)>>,
) -> anyhow::Result<T> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (out, held) = rt.block_on(work)?;
    if dies {
        std::mem::forget(held);
        rt.shutdown_background();
    } else {
        drop(held);
        // Its close goes out while the runtime still drives the connection.
        rt.block_on(async { tokio::time::sleep(Duration::from_millis(50)).await });
    }
    Ok(out)
}

/// One connection asks `asked` subscriptions to `stream`; returns how many were taken
/// and how many refused `limit_exceeded`. With `dies`, the client then vanishes.
fn subscription_flood(
    addr: std::net::SocketAddr,
    ca: &Path,
    token: &str,
    stream: &str,
    asked: usize,
    dies: bool,
) -> anyhow::Result<(usize, usize)> {
    use felix_wire::{ErrorCode, FrameReader, Message};
    let subscribe = Message::Subscribe {
        tenant_id: TENANT.into(),
        namespace: NAMESPACE.into(),
        stream: stream.into(),
        subscription_id: None,
        start: None,
        shard: None,
        queue_capacity: None,
    }
    .to_frame();
    let auth = crate::raw_auth(TENANT, token);
    on_own_runtime(dies, async move {
        let (ep, conn) = crate::raw_connect_to(addr, ca).await?;
        let (mut send, mut recv) = conn.open_bi().await?;
        send.write_all(&auth).await?;
        for _ in 0..asked {
            send.write_all(&subscribe).await?;
        }
        let mut reader = FrameReader::new(1 << 20);
        let (mut subscribed, mut refused, mut answered) = (0, 0, 0);
        while answered < asked {
            let chunk =
                tokio::time::timeout(Duration::from_secs(10), recv.read_chunk(1 << 16, true))
                    .await
                    .context("every subscribe is answered within 10 s")??
                    .context("the stream ended before every subscribe was answered")?;
            reader.push(chunk.bytes);
            while let Some(f) = reader.next_frame()? {
                // Events of the subscriptions taken interleave with the answers.
                match Message::decode(&f.payload) {
                    Ok(Message::Subscribed { .. }) => subscribed += 1,
                    Ok(Message::Error {
                        code: Some(ErrorCode::LimitExceeded),
                        ..
                    }) => refused += 1,
                    Ok(Message::Error { message, .. }) => {
                        anyhow::bail!("a subscribe was refused: {message}")
                    }
                    _ => continue,
                }
                answered += 1;
            }
        }
        let held: Box<dyn std::any::Any> = Box::new((ep, conn, send, recv));
        Ok(((subscribed, refused), held))
    })
}

/// One connection (small receive windows, so its unread answers soon stop the
/// broker's writer) writes acked publishes to `flood` for up to 5 s and never reads an
/// answer, then vanishes; returns how many it wrote and whether the broker held it back
/// (a write blocked by flow control: the broker stopped reading it).
fn unread_answers(
    addr: std::net::SocketAddr,
    ca: &Path,
    token: &str,
) -> anyhow::Result<(u64, bool)> {
    let auth = crate::raw_auth(TENANT, token);
    on_own_runtime(true, async move {
        let limits = felix_core_runtime::quic::TransportLimits {
            stream_window_bytes: 16 * 1024,
            connection_window_bytes: 256 * 1024,
            ..Default::default()
        };
        let (ep, conn) = crate::raw_connect_with(addr, ca, limits).await?;
        let (mut send, recv) = conn.open_bi().await?;
        send.write_all(&auth).await?;
        let payload = vec![7u8; 1024];
        let (mut written, mut held) = (0u64, false);
        let until = Instant::now() + Duration::from_secs(5);
        while Instant::now() < until {
            let frame =
                crate::raw_publish((TENANT, NAMESPACE, "flood"), b"k", &payload, Some(written));
            match tokio::time::timeout(Duration::from_millis(300), send.write_all(&frame)).await {
                Ok(Ok(())) => written += 1,
                Ok(Err(e)) => anyhow::bail!("writing unread publishes: {e}"),
                Err(_) => {
                    held = true;
                    break;
                }
            }
        }
        let kept: Box<dyn std::any::Any> = Box::new((ep, conn, send, recv));
        Ok(((written, held), kept))
    })
}

/// A token is denied by id while its connection publishes: the broker closes that
/// connection within 5 s, and the token cannot connect again. Returns how long the
/// close took.
async fn denied_mid_connection(
    admin: &felix_controlplane::client::ControlPlaneClient,
    addr: std::net::SocketAddr,
    ca: &Path,
    token: &Value,
) -> anyhow::Result<Duration> {
    let connect = || async {
        let quinn = felix_client::quic_client_config_from_file(ca, false)?;
        let mut config = felix_client::ClientConfig::optimized_defaults(quinn);
        config.auth_tenant_id = Some(TENANT.into());
        config.auth_token = token["token"].as_str().map(str::to_owned);
        anyhow::Ok(felix_client::Client::connect(addr, "localhost", config).await?)
    };
    let c = connect().await?;
    c.publish(
        TENANT,
        NAMESPACE,
        "flood",
        b"x".to_vec(),
        AckMode::PerMessage,
    )
    .await
    .context("a fresh token publishes")?;
    admin.post(
        &format!("/v1/tenants/{TENANT}/token-denials"),
        &json!({"jti": token["jti"], "reason": "hostile-clients"}),
    )?;
    let denied = Instant::now();
    while !c.is_closed() {
        anyhow::ensure!(
            denied.elapsed() < Duration::from_secs(5),
            "a denied token's connection was still open after 5 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let took = denied.elapsed();
    anyhow::ensure!(connect().await.is_err(), "a denied token connected again");
    Ok(took)
}

/// What the hostile scenarios aim at and start from: the broker's address and CA, a
/// valid token, the frame templates (after creating the `flood` stream and `hostile`
/// cache they address), and the broker's RSS and live subscriptions before.
struct Hostile {
    addr: std::net::SocketAddr,
    ca: PathBuf,
    good: String,
    templates: Vec<bytes::Bytes>,
    rss_before: u64,
    live: u64,
    rt: tokio::runtime::Runtime,
}

fn hostile_target(n: &mut Nemesis<'_>) -> anyhow::Result<Hostile> {
    // Where the floods write: a stream of its own, so the checked ones hold only the
    // history's records.
    n.cluster.create_stream("flood", 1, 1, "Quorum")?;
    n.cluster
        .wait_leader("flood", 0, None, 0, Duration::from_secs(30))?;
    let b = &n.cluster.brokers[0];
    Ok(Hostile {
        templates: hostile_templates(n)?,
        addr: b.listen,
        ca: n.cluster.certs.ca.clone(),
        good: n.cluster.client_token.clone(),
        rss_before: b.rss_kib(),
        live: b.metric("felix_broker_subscriptions")?,
        rt: tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?,
    })
}

/// Waits (the idle timeout and 10 s) until the broker holds no more subscriptions
/// than the `live` ones from before the hostile clients.
fn subscriptions_end(b: &crate::BrokerProcess, live: u64) -> anyhow::Result<u64> {
    crate::wait_for(
        "the hostile clients' subscriptions to end",
        Duration::from_millis(HOSTILE_IDLE_MS + 10_000),
        || {
            b.metric("felix_broker_subscriptions")
                .ok()
                .filter(|s| *s <= live)
        },
    )
}

/// Row 18's long form: hostile frames back to back (see [`hostile_frames`]).
fn hostile_frames_only(n: &mut Nemesis<'_>) -> anyhow::Result<()> {
    let Hostile {
        addr,
        ca,
        good,
        templates,
        rss_before,
        live,
        rt,
    } = hostile_target(n)?;
    let mut tally = FramesTally::default();
    let mut connections = 0u64;
    while n.running() {
        let seed = n.rng.next_u64();
        let one = rt.block_on(hostile_frames(addr, &ca, &good, &templates, seed))?;
        anyhow::ensure!(
            n.cluster.brokers[0].exit_status().is_none(),
            "the broker exited under hostile frames (seed {seed})"
        );
        tally.add(&one);
        connections += 1;
        if connections.is_multiple_of(25) {
            n.event(
                "hostile-frames",
                json!({"connections": connections, "so_far": tally.summary()}),
            );
        }
    }
    let b = &n.cluster.brokers[0];
    let ended = subscriptions_end(b, live);
    let rss_after = b.rss_kib();
    n.event(
        "afterwards",
        json!({"connections": connections, "hostile_frames": tally.summary(),
               "subscriptions": b.metric("felix_broker_subscriptions")?, "live_before": live,
               "rss_kib_before": rss_before, "rss_kib_after": rss_after}),
    );
    ended?;
    anyhow::ensure!(
        rss_after < rss_before + 256 * 1024,
        "the broker grew from {rss_before} KiB to {rss_after} KiB under hostile frames"
    );
    // The checks above judged something: answers came, refusals among them.
    anyhow::ensure!(
        tally.answers > 0 && !tally.errors.is_empty(),
        "hostile frames drew {} answers and no refusal to check",
        tally.answers
    );
    Ok(())
}

/// Valid requests the hostile-frames attack starts from: every kind a client sends,
/// addressed to this tenant's `flood` stream and `hostile` cache (no mutation reaches a
/// checked stream short of rewriting its name), two binary publishes, and the session
/// fuzz corpus (another tenant's requests, frames cut short, lying counts, bad magic).
fn hostile_templates(n: &Nemesis<'_>) -> anyhow::Result<Vec<bytes::Bytes>> {
    n.cluster.admin.post(
        &format!("/v1/tenants/{TENANT}/namespaces/{NAMESPACE}/caches"),
        &json!({"cache": "hostile", "shards": 1}),
    )?;
    let (t, ns, s, c) = (TENANT, NAMESPACE, "flood", "hostile");
    let b = "aG9zdGlsZQ=="; // "hostile"
    let target = json!({"tenant_id": t, "namespace": ns, "stream": s});
    let cache = json!({"tenant_id": t, "namespace": ns, "cache": c, "key": "k"});
    let group = json!({"tenant_id": t, "namespace": ns, "stream": s, "shard": 0, "group": "g"});
    let with = |base: &Value, kind: &str, more: Value| {
        let mut v = base.clone();
        v["type"] = json!(kind);
        for (k, x) in more.as_object().expect("an object") {
            v[k] = x.clone();
        }
        v
    };
    let requests = [
        with(
            &target,
            "publish",
            json!({"payload": b, "request_id": 1, "ack": "per_message"}),
        ),
        with(
            &target,
            "publish_batch",
            json!({"payloads": [b, b], "request_id": 2, "ack": "per_batch"}),
        ),
        with(
            &target,
            "publish_if",
            json!({"payloads": [b], "expected_offset": 0, "request_id": 3}),
        ),
        json!({"type": "producer_init", "request_id": 4}),
        with(
            &target,
            "publish_idempotent",
            json!({"payloads": [b], "request_id": 5, "producer_id": 1, "sequence": 0}),
        ),
        with(
            &target,
            "subscribe",
            json!({"subscription_id": 6, "queue_capacity": 4}),
        ),
        with(
            &target,
            "stream_read",
            json!({"shard": 0, "from": 0, "max_records": 10, "request_id": 7}),
        ),
        with(
            &target,
            "offset_for_time",
            json!({"shard": 0, "at_micros": 0, "request_id": 8}),
        ),
        with(&target, "stream_shards", json!({"request_id": 9})),
        with(
            &cache,
            "cache_put",
            json!({"value": b, "request_id": 10, "ttl_ms": 60000}),
        ),
        with(&cache, "cache_get", json!({"request_id": 11})),
        with(&cache, "cache_delete", json!({"request_id": 12})),
        with(
            &cache,
            "cache_put_if",
            json!({"value": b, "condition": "absent", "request_id": 13}),
        ),
        with(
            &cache,
            "cache_delete_if",
            json!({"version": 1, "request_id": 14}),
        ),
        with(
            &cache,
            "cache_watch",
            json!({"retained": true, "subscription_id": 15}),
        ),
        with(&cache, "counter_add", json!({"delta": 1, "request_id": 16})),
        with(&cache, "counter_get", json!({"request_id": 17})),
        with(
            &target,
            "commit",
            json!({"entity_key": b, "event": b, "request_id": 18,
            "changes": [{"op": "put", "key": "k", "value": b}, {"op": "delete", "key": "j"}]}),
        ),
        with(
            &target,
            "state_get",
            json!({"entity_key": b, "key": "k", "request_id": 19}),
        ),
        with(
            &group,
            "group_poll",
            json!({"max_records": 4, "wait_ms": 200, "request_id": 20, "reclaim": false}),
        ),
        with(&group, "group_ack", json!({"offset": 0, "request_id": 21})),
        with(
            &group,
            "group_nack",
            json!({"offset": 0, "request_id": 22, "delay_ms": 10}),
        ),
        with(
            &group,
            "group_extend",
            json!({"offset": 0, "request_id": 23, "attempts": 1, "extend_ms": 100}),
        ),
        with(
            &group,
            "group_dead_letter",
            json!({"offset": 0, "request_id": 24}),
        ),
        with(&group, "group_dead_letters", json!({"request_id": 25})),
        with(
            &group,
            "group_redrive",
            json!({"offset": 0, "request_id": 26}),
        ),
        with(
            &group,
            "group_seek",
            json!({"start": "earliest", "if_new": false, "request_id": 27}),
        ),
        with(&group, "group_describe", json!({"request_id": 28})),
        with(&group, "group_delete", json!({"request_id": 29})),
        json!({"type": "shard_inspect", "tenant_id": t, "namespace": ns, "name": s, "kind": "stream", "shard": 0, "request_id": 30}),
        json!({"type": "subscriptions_list", "limit": 5, "request_id": 31}),
    ];
    let mut out = Vec::new();
    for r in requests {
        let m = felix_wire::Message::decode(&serde_json::to_vec(&r)?)
            .with_context(|| format!("the hostile template {r} decodes"))?;
        out.push(m.to_frame());
    }
    out.push(crate::raw_publish((t, ns, s), b"k", b"hostile", Some(1)));
    out.push(crate::raw_publish((t, ns, s), b"k", b"hostile", None));
    let corpus = crate::manifest_dir().join("../broker/fuzz/corpus/session");
    for entry in std::fs::read_dir(&corpus).with_context(|| corpus.display().to_string())? {
        let data = std::fs::read(entry?.path())?;
        // The first byte picks the fuzz harness's mode; the rest is what was sent.
        if let Some(rest) = data.get(1..) {
            out.push(bytes::Bytes::copy_from_slice(rest));
        }
    }
    Ok(out)
}

/// `frame` damaged 1-4 times: a bit flipped, a byte overwritten, cut short, bytes
/// inserted, a range repeated, or its header's flags or length rewritten.
fn mutate(frame: &[u8], rng: &mut Rng) -> Vec<u8> {
    let mut f = frame.to_vec();
    for _ in 0..rng.between(1, 4) {
        let at = |rng: &mut Rng, len: usize| rng.between(0, len.max(1) as u64 - 1) as usize;
        match rng.between(0, 6) {
            0 if !f.is_empty() => {
                let i = at(rng, f.len());
                f[i] ^= 1 << rng.between(0, 7);
            }
            1 if !f.is_empty() => {
                let i = at(rng, f.len());
                f[i] = rng.next_u64() as u8;
            }
            2 => f.truncate(at(rng, f.len())),
            3 => {
                let i = at(rng, f.len() + 1).min(f.len());
                let junk: Vec<u8> = (0..rng.between(1, 64))
                    .map(|_| rng.next_u64() as u8)
                    .collect();
                f.splice(i..i, junk);
            }
            4 if f.len() >= 12 => {
                let length = match rng.between(0, 2) {
                    0 => rng.next_u64() as u32,
                    1 => (f.len() as u32).wrapping_add(rng.between(0, 64) as u32),
                    _ => u32::MAX,
                };
                f[8..12].copy_from_slice(&length.to_be_bytes());
            }
            5 if f.len() >= 8 => {
                let flags = rng.next_u64() as u16;
                f[6..8].copy_from_slice(&flags.to_be_bytes());
            }
            _ if f.len() >= 2 => {
                let i = at(rng, f.len() - 1);
                let j = (i + rng.between(1, 256) as usize).min(f.len());
                let copy = f[i..j].to_vec();
                f.splice(j..j, copy);
            }
            _ => {}
        }
    }
    f
}

/// What one hostile-frames attack sent and was answered.
#[derive(Debug, Default)]
struct FramesTally {
    streams: u64,
    frames: u64,
    mutated: u64,
    garbage: u64,
    answers: u64,
    errors: BTreeMap<String, u64>,
    streams_reset: u64,
    connections_closed: u64,
}

impl FramesTally {
    fn add(&mut self, o: &FramesTally) {
        self.streams += o.streams;
        self.frames += o.frames;
        self.mutated += o.mutated;
        self.garbage += o.garbage;
        self.answers += o.answers;
        self.streams_reset += o.streams_reset;
        self.connections_closed += o.connections_closed;
        for (k, v) in &o.errors {
            *self.errors.entry(k.clone()).or_default() += v;
        }
    }

    fn summary(&self) -> Value {
        json!({"streams": self.streams, "frames": self.frames, "mutated": self.mutated,
               "garbage": self.garbage, "answers": self.answers, "errors": self.errors,
               "streams_reset": self.streams_reset,
               "connections_closed": self.connections_closed})
    }
}

/// Checks one answer to hostile frames: it decodes as the layout its flags name, and if
/// it refuses something it carries a code (the connection offered error codes, and the
/// flag for coded binary acks). Returns the refusal's code.
fn answer_code(f: &felix_wire::Frame) -> anyhow::Result<Option<String>> {
    use felix_wire::flags::FrameKind;
    use felix_wire::{Message, PublishAck, PublishAckStatus};
    match f.kind {
        FrameKind::Json => match Message::decode(&f.payload) {
            Ok(Message::Error { code, message, .. }) => Ok(Some(format!(
                "{:?}",
                code.with_context(|| format!("an error without a code: {message:?}"))?
            ))),
            Ok(Message::PublishError { code, message, .. }) => Ok(Some(format!(
                "{:?}",
                code.with_context(|| format!("a publish error without a code: {message:?}"))?
            ))),
            Ok(_) => Ok(None),
            Err(e) => anyhow::bail!("a JSON answer that does not decode: {e}"),
        },
        FrameKind::PublishAck => {
            let ack = PublishAck::decode(f.flags, &f.payload)
                .map_err(|e| anyhow::anyhow!("a binary ack that does not decode: {e}"))?;
            if ack.status != PublishAckStatus::Error {
                return Ok(None);
            }
            let code = ack.code.with_context(|| {
                format!(
                    "a binary publish ack refused without a code: {:?}",
                    ack.message
                )
            })?;
            Ok(Some(format!("{:?}", code.code)))
        }
        FrameKind::EventBatch => {
            felix_wire::EventBatch::decode(f.flags, &f.payload)
                .map_err(|e| anyhow::anyhow!("an event batch that does not decode: {e}"))?;
            Ok(None)
        }
        FrameKind::PublishBatch => anyhow::bail!("the broker sent a publish batch"),
    }
}

/// One authenticated connection opens 1-6 request streams, each the auth frame then 1-8
/// hostile frames: a template as is, mutated, or bytes that are no frame at all (one
/// stream in five publish-only). Every answer must be a well-formed frame and every
/// error must carry a code; afterwards the connection, or a new one where the broker
/// closed it, must answer a request within 5 s.
async fn hostile_frames(
    addr: std::net::SocketAddr,
    ca: &Path,
    token: &str,
    templates: &[bytes::Bytes],
    seed: u64,
) -> anyhow::Result<FramesTally> {
    use felix_wire::{FrameReader, Message};
    let mut rng = Rng::new(seed);
    let mut tally = FramesTally::default();
    let auth = crate::raw_auth(TENANT, token);
    let (ep, conn) = crate::raw_connect_to(addr, ca).await?;
    for _ in 0..rng.between(1, 6) {
        let mut bytes = auth.to_vec();
        for _ in 0..rng.between(1, 8) {
            let template = &templates[rng.between(0, templates.len() as u64 - 1) as usize];
            match rng.between(0, 19) {
                0..=3 => bytes.extend_from_slice(template),
                4..=16 => {
                    bytes.extend(mutate(template, &mut rng));
                    tally.mutated += 1;
                }
                _ => {
                    bytes.extend((0..rng.between(1, 256)).map(|_| rng.next_u64() as u8));
                    tally.garbage += 1;
                }
            }
            tally.frames += 1;
        }
        tally.streams += 1;
        if rng.between(0, 4) == 0 {
            let Ok(mut send) = conn.open_uni().await else {
                break;
            };
            let _ = send.write_all(&bytes).await;
            let _ = send.finish();
            continue;
        }
        let Ok((mut send, mut recv)) = conn.open_bi().await else {
            break;
        };
        let _ = send.write_all(&bytes).await;
        let _ = send.finish();
        // Answers until the broker ends the stream (or 1 s: a subscription or a watch
        // the garbage happened to ask for stays open, which is no hang). A read answers
        // up to 4 MiB of records, more once encoded: the reader takes 64 MiB.
        let mut reader = FrameReader::new(64 << 20);
        let until = tokio::time::Instant::now() + Duration::from_secs(1);
        loop {
            match tokio::time::timeout_at(until, recv.read_chunk(1 << 16, true)).await {
                Ok(Ok(Some(c))) => reader.push(c.bytes),
                Ok(Ok(None)) | Err(_) => break,
                Ok(Err(_)) => {
                    tally.streams_reset += 1;
                    break;
                }
            }
            while let Some(f) = reader.next_frame().map_err(|e| {
                anyhow::anyhow!("the broker's answer is no frame: {e} (seed {seed})")
            })? {
                tally.answers += 1;
                if let Some(code) = answer_code(&f)
                    .with_context(|| format!("a hostile-frames answer (seed {seed})"))?
                {
                    *tally.errors.entry(code).or_default() += 1;
                }
            }
        }
    }
    // The broker still answers: on this connection, or a new one if it closed this.
    let conn = if conn.close_reason().is_some() {
        tally.connections_closed += 1;
        crate::raw_connect_to(addr, ca).await?.1
    } else {
        conn
    };
    let probe = Message::decode(&serde_json::to_vec(&json!({
        "type": "stream_shards", "tenant_id": TENANT, "namespace": NAMESPACE,
        "stream": "flood", "request_id": 1}))?)?
    .to_frame();
    let answered = tokio::time::timeout(Duration::from_secs(5), async {
        let (mut send, mut recv) = conn.open_bi().await?;
        send.write_all(&auth).await?;
        send.write_all(&probe).await?;
        let _ = send.finish();
        crate::read_messages(&mut recv, 2).await
    })
    .await
    .with_context(|| {
        format!("the broker did not answer within 5 s after hostile frames (seed {seed})")
    })??;
    anyhow::ensure!(
        matches!(
            answered.as_slice(),
            [
                Some(Message::AuthOk { .. }),
                Some(Message::StreamShardsView { .. })
            ]
        ),
        "after hostile frames (seed {seed}) a stream_shards request was answered {answered:?}"
    );
    conn.close(0u32.into(), b"done");
    // Sent while this runtime still drives the endpoint: the broker ends whatever the
    // garbage happened to subscribe to now, not after its idle timeout.
    let _ = tokio::time::timeout(Duration::from_secs(1), ep.wait_idle()).await;
    Ok(tally)
}

/// Every shard directory under a broker's `streams/` (tenant / namespace / stream /
/// shard).
fn shard_dirs(root: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut level = vec![root.to_path_buf()];
    for _ in 0..4 {
        let mut next = Vec::new();
        for dir in level {
            let Ok(entries) = std::fs::read_dir(&dir) else {
                continue;
            };
            for e in entries.flatten() {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    next.push(e.path());
                }
            }
        }
        level = next;
    }
    Ok(level)
}

/// The broker and control-plane binaries: this package's own targets next to the
/// running executable when cargo built them (tests), otherwise links to this
/// executable under their names (`cargo run -p felix-cluster` builds only the chaos
/// binary, which acts as either when called by those names).
pub fn sibling_binaries() -> anyhow::Result<(PathBuf, PathBuf)> {
    let exe = std::env::current_exe()?;
    let mut dir = exe
        .parent()
        .context("the executable's directory")?
        .to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    let broker = dir.join(BROKER_BIN);
    let cp = dir.join(CONTROLPLANE_BIN);
    if broker.exists() && cp.exists() {
        return Ok((broker, cp));
    }
    let links = std::env::temp_dir().join(format!("felix-cluster-bin-{}", std::process::id()));
    std::fs::create_dir_all(&links)?;
    let (broker, cp) = (links.join(BROKER_BIN), links.join(CONTROLPLANE_BIN));
    for l in [&broker, &cp] {
        let _ = std::fs::remove_file(l);
        std::os::unix::fs::symlink(&exe, l)?;
    }
    Ok((broker, cp))
}

/// The broker binary's name.
pub const BROKER_BIN: &str = "felix-broker-under-test";
/// The control plane binary's name.
pub const CONTROLPLANE_BIN: &str = "felix-controlplane-under-test";

/// Classifies a publish's failure.
pub fn outcome_of(e: &ClientError) -> Outcome {
    match e {
        ClientError::NotLeader(_) => Outcome::Refused,
        ClientError::Broker(b) => match (&b.code, b.retry) {
            (Some(code), retry) => {
                if retry.unwrap_or_else(|| code.default_retry()) == RetryClass::OutcomeUnknown {
                    Outcome::Unknown
                } else {
                    Outcome::Refused
                }
            }
            (None, _) => Outcome::Unknown,
        },
        _ => Outcome::Unknown,
    }
}

async fn connect(
    seeds: &[std::net::SocketAddr],
    config: &felix_client::ClientConfig,
) -> Option<ClusterClient> {
    connect_with(seeds, config, ReconnectPolicy::default()).await
}

async fn connect_with(
    seeds: &[std::net::SocketAddr],
    config: &felix_client::ClientConfig,
    policy: ReconnectPolicy,
) -> Option<ClusterClient> {
    tokio::time::timeout(
        Duration::from_secs(5),
        ClusterClient::connect_with_policy(seeds, "localhost", config.clone(), policy),
    )
    .await
    .ok()?
    .ok()
}

/// The worker's client, connecting a new one under `policy` if it has none (none,
/// after a pause, when no broker answered).
async fn connected(
    client: &mut Option<Arc<ClusterClient>>,
    seeds: &[std::net::SocketAddr],
    config: &felix_client::ClientConfig,
    policy: &ReconnectPolicy,
) -> Option<Arc<ClusterClient>> {
    if client.is_none() {
        match connect_with(seeds, config, *policy).await {
            Some(c) => *client = Some(Arc::new(c)),
            None => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
    client.clone()
}

/// One producer: publishes `stream/p<id>/<seq>` until `stop`, `depth` at a time.
async fn producer(
    id: u32,
    stream: &'static str,
    depth: usize,
    seeds: Vec<std::net::SocketAddr>,
    config: felix_client::ClientConfig,
    history: Arc<History>,
    stop: Arc<AtomicBool>,
) {
    let mut client: Option<Arc<ClusterClient>> = None;
    let policy = ReconnectPolicy::default();
    let mut seq = 0u64;
    while !stop.load(Ordering::SeqCst) {
        let Some(c) = connected(&mut client, &seeds, &config, &policy).await else {
            continue;
        };
        let mut batch = Vec::with_capacity(depth);
        for _ in 0..depth {
            let payload = format!("{stream}/p{id}/{seq}").into_bytes();
            let (c, history) = (c.clone(), history.clone());
            let this = seq;
            seq += 1;
            batch.push(tokio::spawn(async move {
                let start_us = history.now_us();
                // Longer than the broker's quorum wait (5 s): a publish a paused leader
                // holds is still waiting when it wakes.
                let r = tokio::time::timeout(
                    Duration::from_secs(6),
                    c.publish(
                        TENANT,
                        NAMESPACE,
                        stream,
                        payload.clone(),
                        AckMode::PerMessage,
                    ),
                )
                .await;
                let (outcome, offset, error, timed_out) = match r {
                    Ok(Ok(offset)) => (Outcome::Ok, offset, None, false),
                    Ok(Err(e)) => (outcome_of(&e), None, Some(e.to_string()), false),
                    Err(_) => (Outcome::Unknown, None, Some("timed out".into()), true),
                };
                let refused = outcome == Outcome::Refused;
                history.record(Op {
                    process: id,
                    seq: this,
                    sequential: depth == 1,
                    stream: stream.to_owned(),
                    kind: OpKind::Publish { payload, offset },
                    start_us,
                    end_us: history.now_us(),
                    outcome,
                    error,
                });
                (timed_out, refused)
            }));
        }
        let (mut reconnect, mut refused) = (false, false);
        for b in batch {
            let (t, r) = b.await.unwrap_or((true, false));
            reconnect |= t;
            refused |= r;
        }
        if reconnect {
            // A connection to a dead broker hangs until its idle timeout: start over.
            client = None;
        } else if refused {
            // No leader yet, or not here: give the cluster a moment.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// The chaos register: key `k` of this Quorum cache of three copies, in every
/// scenario of three or more brokers with a Quorum stream of three copies. The
/// checker reads no cache otherwise: this one checks that a cache's reads are
/// linearizable through the scenario's faults ([`check_register`]).
const REGISTER: &str = "reg";

/// The register's operations, in the order they ended.
type RegisterLog = Arc<std::sync::Mutex<Vec<RegisterOp>>>;

/// The stream of the state register: its entity `e`'s key `k`, set by commits.
const STATE_REGISTER: &str = "st";

/// Where a register lives.
#[derive(Debug, Clone, Copy)]
enum RegisterKind {
    /// Key `k` of the cache [`REGISTER`].
    Cache,
    /// State key `k` of entity `e` on the stream [`STATE_REGISTER`], written by commits
    /// (the event is the value too).
    State,
}

impl RegisterKind {
    async fn read(self, c: &ClusterClient) -> Result<Option<bytes::Bytes>, ClientError> {
        match self {
            RegisterKind::Cache => c.cache_get(TENANT, NAMESPACE, REGISTER, "k").await,
            RegisterKind::State => Ok(c
                .state_get(TENANT, NAMESPACE, STATE_REGISTER, "e", "k")
                .await?
                .0
                .map(|(v, _)| v)),
        }
    }

    async fn write(self, c: &ClusterClient, value: u64) -> Result<(), ClientError> {
        let v = bytes::Bytes::from(value.to_string());
        match self {
            RegisterKind::Cache => c.cache_put(TENANT, NAMESPACE, REGISTER, "k", v, None).await,
            RegisterKind::State => {
                let put = felix_wire::message::StateChange::Put {
                    key: "k".into(),
                    value: v.clone(),
                };
                c.commit(TENANT, NAMESPACE, STATE_REGISTER, "e", v, vec![put], None)
                    .await
                    .map(|_| ())
            }
        }
    }
}

/// Adds to the register cache's counter `n`: adds begun and acknowledged.
type CounterTally = Arc<(std::sync::atomic::AtomicU64, std::sync::atomic::AtomicU64)>;

/// Adds 1 to counter `n` of the register's cache, one add at a time, until `stop`.
async fn counter_adder(
    seeds: Vec<std::net::SocketAddr>,
    config: felix_client::ClientConfig,
    tally: CounterTally,
    stop: Arc<AtomicBool>,
) {
    let mut client: Option<Arc<ClusterClient>> = None;
    let policy = ReconnectPolicy::default();
    while !stop.load(Ordering::SeqCst) {
        let Some(c) = connected(&mut client, &seeds, &config, &policy).await else {
            continue;
        };
        tally.0.fetch_add(1, Ordering::SeqCst);
        let r = tokio::time::timeout(
            Duration::from_secs(6),
            c.counter_add(TENANT, NAMESPACE, REGISTER, "n", 1),
        )
        .await;
        match r {
            Ok(Ok(_)) => {
                tally.1.fetch_add(1, Ordering::SeqCst);
            }
            Ok(Err(e)) if outcome_of(&e) == Outcome::Refused => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            _ => client = None,
        }
    }
}

/// Sets the register to 1, 2, 3, ... one write at a time until `stop` (`reader`
/// false), or reads it every 10 ms (`reader` true).
async fn register_worker(
    kind: RegisterKind,
    reader: bool,
    seeds: Vec<std::net::SocketAddr>,
    config: felix_client::ClientConfig,
    history: Arc<History>,
    log: RegisterLog,
    stop: Arc<AtomicBool>,
) {
    let mut client: Option<Arc<ClusterClient>> = None;
    // A writer makes one attempt per call: a resend the client made on its own could
    // land after the next write while the call was answered OK (every failed attempt
    // is then one the checker counts as maybe applied, at any time).
    let policy = if reader {
        ReconnectPolicy::default()
    } else {
        ReconnectPolicy {
            attempts: 1,
            ..ReconnectPolicy::default()
        }
    };
    let mut value = 0u64;
    while !stop.load(Ordering::SeqCst) {
        let Some(c) = connected(&mut client, &seeds, &config, &policy).await else {
            continue;
        };
        let start_us = history.now_us();
        // Longer than the broker's quorum wait (5 s), as for publishes.
        let within = Duration::from_secs(6);
        let (outcome, read) = if reader {
            match tokio::time::timeout(within, kind.read(&c)).await {
                Ok(Ok(v)) => (Outcome::Ok, register_value(v)),
                Ok(Err(_)) => (Outcome::Refused, 0),
                Err(_) => (Outcome::Unknown, 0),
            }
        } else {
            value += 1;
            let r = tokio::time::timeout(within, kind.write(&c, value)).await;
            // The client retries a put (and a commit after a lost connection): a
            // refusal may follow an attempt that applied, so any failure counts as
            // maybe applied.
            let outcome = if matches!(r, Ok(Ok(()))) {
                Outcome::Ok
            } else {
                Outcome::Unknown
            };
            (outcome, value)
        };
        log.lock().expect("register log").push(RegisterOp {
            write: !reader,
            value: read,
            start_us,
            end_us: history.now_us(),
            outcome,
        });
        match outcome {
            // A connection to a dead broker hangs until its idle timeout: start over.
            Outcome::Unknown => client = None,
            Outcome::Refused => tokio::time::sleep(Duration::from_millis(50)).await,
            Outcome::Ok if reader => tokio::time::sleep(Duration::from_millis(10)).await,
            Outcome::Ok => {}
        }
    }
}

/// What a read of a register returned: 0 when absent, and anything but a number its
/// writer wrote as from the future.
fn register_value(v: Option<bytes::Bytes>) -> u64 {
    v.map_or(Some(0), |b| std::str::from_utf8(&b).ok()?.parse().ok())
        .unwrap_or(u64::MAX)
}

/// `read` after the run, through any broker, until it answers (none if it did not
/// within 30 s).
async fn read_back<T, F, Fut>(
    seeds: Vec<std::net::SocketAddr>,
    config: felix_client::ClientConfig,
    read: F,
) -> Option<T>
where
    F: Fn(ClusterClient) -> Fut,
    Fut: std::future::Future<Output = Result<T, ClientError>>,
{
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if let Some(c) = connect(&seeds, &config).await
            && let Ok(Ok(v)) = tokio::time::timeout(Duration::from_secs(6), read(c)).await
        {
            return Some(v);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    None
}

/// A register's value after the run.
async fn register_final(
    kind: RegisterKind,
    seeds: Vec<std::net::SocketAddr>,
    config: felix_client::ClientConfig,
) -> Option<u64> {
    read_back(seeds, config, |c| async move { kind.read(&c).await })
        .await
        .map(register_value)
}

/// The register cache's counter's sum after the run.
async fn counter_final(
    seeds: Vec<std::net::SocketAddr>,
    config: felix_client::ClientConfig,
) -> Option<i64> {
    read_back(seeds, config, |c| async move {
        c.counter_get(TENANT, NAMESPACE, REGISTER, "n").await
    })
    .await
    .map(|s| s.unwrap_or(0))
}

/// One reader of `stream`'s shard 0: records every record it is delivered.
async fn reader(
    id: u32,
    stream: &'static str,
    seeds: Vec<std::net::SocketAddr>,
    config: felix_client::ClientConfig,
    history: Arc<History>,
    stop: Arc<AtomicBool>,
) {
    let mut next = 0u64;
    let mut seq = 0u64;
    let mut session = 0u64;
    while !stop.load(Ordering::SeqCst) {
        session += 1;
        let Some(c) = connect(&seeds, &config).await else {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        };
        let from = if next == 0 {
            StartPosition::Earliest
        } else {
            StartPosition::Offset(Offset(next))
        };
        let Ok(Ok(mut sub)) = tokio::time::timeout(
            Duration::from_secs(5),
            c.subscribe_shard(TENANT, NAMESPACE, stream, 0, Some(from)),
        )
        .await
        else {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        };
        while !stop.load(Ordering::SeqCst) {
            match tokio::time::timeout(Duration::from_secs(3), sub.next_event()).await {
                Ok(Ok(Some(e))) => {
                    let Some(offset) = e.offset else { continue };
                    let at = history.now_us();
                    history.record(Op {
                        process: id,
                        seq,
                        sequential: false,
                        stream: stream.to_owned(),
                        kind: OpKind::Read {
                            shard: 0,
                            offset,
                            payload: e.payload.to_vec(),
                            session,
                        },
                        start_us: at,
                        end_us: at,
                        outcome: Outcome::Ok,
                        error: None,
                    });
                    seq += 1;
                    next = offset + 1;
                }
                // Quiet for a while (a dead leader keeps a subscription silent): start over.
                Ok(Ok(None)) | Ok(Err(_)) | Err(_) => break,
            }
        }
    }
}

/// What a run's consumer group saw: the group `chaos` over a durable stream's shard 0.
#[derive(Debug, Default)]
pub struct GroupLog {
    /// Each record handed out: its offset, payload, and when the poll that brought it
    /// was sent (the history's clock, µs).
    pub deliveries: Vec<(u64, Vec<u8>, u64)>,
    /// Acks answered OK: the offset and when the answer came (µs).
    pub acked: Vec<(u64, u64)>,
    /// Polls answered, and requests that failed.
    pub polls: u64,
    /// Requests that failed (any error or timeout).
    pub failures: u64,
    /// Whether it ended on polls that found nothing for [`GROUP_DRAIN_QUIET`] after the
    /// workload stopped: every record of the log has gone out by then.
    pub drained: bool,
}

/// A claim's visibility timeout in chaos runs: a claim whose answer was lost comes back.
const GROUP_VISIBILITY: Duration = Duration::from_secs(3);
/// Empty polls for this long after the producers are done end the drain: past a
/// visibility timeout, so claims whose answers were lost have come back.
const GROUP_DRAIN_QUIET: Duration = Duration::from_secs(4);
/// The drain's bound, from when the workload is told to stop.
const GROUP_DRAIN_MAX: Duration = Duration::from_secs(30);

/// One consumer of group `chaos` on `stream`'s shard 0: polls, acks every record, and
/// after `stop` drains what is left once `producers_done`. Follows the leader (a
/// `not_leader` names it; any other failure tries the next broker).
async fn group_consumer(
    stream: &'static str,
    seeds: Vec<std::net::SocketAddr>,
    config: felix_client::ClientConfig,
    history: Arc<History>,
    stop: Arc<AtomicBool>,
    producers_done: Arc<AtomicBool>,
) -> GroupLog {
    use felix_client::{GroupRef, PollOptions};
    let g = GroupRef::new(TENANT, NAMESPACE, stream, 0, "chaos");
    let opts = PollOptions {
        max_records: 64,
        wait: Duration::from_millis(300),
        visibility: Some(GROUP_VISIBILITY),
    };
    let mut log = GroupLog::default();
    let (mut client, mut target, mut turn) = (None::<felix_client::Client>, None, 0usize);
    let (mut drain_until, mut quiet_since) = (None::<Instant>, None::<Instant>);
    loop {
        if stop.load(Ordering::SeqCst) {
            let until = *drain_until.get_or_insert_with(|| Instant::now() + GROUP_DRAIN_MAX);
            if Instant::now() > until {
                break;
            }
        }
        let c = match &client {
            Some(c) => c.clone(),
            None => {
                let addr = target.take().unwrap_or_else(|| {
                    turn += 1;
                    seeds[turn % seeds.len()]
                });
                let connected = tokio::time::timeout(
                    Duration::from_secs(5),
                    felix_client::Client::connect(addr, "localhost", config.clone()),
                )
                .await;
                match connected {
                    Ok(Ok(c)) => {
                        client = Some(c.clone());
                        c
                    }
                    _ => {
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        continue;
                    }
                }
            }
        };
        let sent = history.now_us();
        let failed = match tokio::time::timeout(Duration::from_secs(6), c.group_poll(&g, opts))
            .await
        {
            Ok(Ok(records)) => {
                log.polls += 1;
                if records.is_empty() {
                    if producers_done.load(Ordering::SeqCst) {
                        let since = *quiet_since.get_or_insert_with(Instant::now);
                        if since.elapsed() >= GROUP_DRAIN_QUIET {
                            log.drained = true;
                            break;
                        }
                    }
                    continue;
                }
                quiet_since = None;
                for r in &records {
                    log.deliveries.push((r.offset.0, r.payload.to_vec(), sent));
                }
                // Every ack of the poll in flight at once (they group-commit).
                let acks: Vec<_> = records
                    .iter()
                    .map(|r| {
                        let (c, g, history, o) =
                            (c.clone(), g.clone(), history.clone(), r.offset.0);
                        tokio::spawn(async move {
                            let acked =
                                tokio::time::timeout(Duration::from_secs(6), c.group_ack(&g, o))
                                    .await;
                            (o, acked, history.now_us())
                        })
                    })
                    .collect();
                let mut failed = None;
                for a in acks {
                    match a.await {
                        Ok((o, Ok(Ok(())), at)) => log.acked.push((o, at)),
                        Ok((_, Ok(Err(e)), _)) => failed = Some(Some(e)),
                        _ => failed = Some(None),
                    }
                }
                failed
            }
            Ok(Err(e)) => Some(Some(e)),
            Err(_) => Some(None),
        };
        if let Some(error) = failed {
            log.failures += 1;
            client = None;
            // A failed poll may have claimed records whose answer was lost: the quiet
            // that ends the drain starts again after it.
            quiet_since = None;
            if let Some(ClientError::NotLeader(nl)) = error {
                target = nl.addr.and_then(|a| a.parse().ok());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    log
}

/// What a group's log says against the stream's final log: records handed out that the
/// log does not hold at their offset (below the end of what was read back), records
/// handed out again by a poll sent after their ack was answered, records never handed
/// out once the consumer drained, and a consumer that never drained (a group stuck on
/// a healed cluster, or one that never served).
pub fn check_group(log: &GroupLog, final_log: &BTreeMap<u64, Vec<u8>>) -> Value {
    let read_end = final_log.keys().next_back().map_or(0, |o| o + 1);
    let acked: HashMap<u64, u64> = log.acked.iter().fold(HashMap::new(), |mut m, &(o, at)| {
        let e = m.entry(o).or_insert(at);
        *e = (*e).min(at);
        m
    });
    let (mut wrong, mut again) = (Vec::new(), Vec::new());
    let mut delivered = std::collections::BTreeSet::new();
    for (o, payload, sent) in &log.deliveries {
        delivered.insert(*o);
        let differs = match final_log.get(o) {
            Some(p) => p != payload,
            // Past the end of the read back (a record landed after it): unchecked.
            None => *o < read_end,
        };
        if differs {
            wrong.push(*o);
        }
        if acked.get(o).is_some_and(|at| at < sent) {
            again.push(*o);
        }
    }
    let skipped: Vec<u64> = if log.drained {
        final_log
            .keys()
            .filter(|o| !delivered.contains(o))
            .copied()
            .collect()
    } else {
        Vec::new()
    };
    let mut anomalies = Vec::new();
    if !wrong.is_empty() {
        anomalies.push("group_wrong_record");
    }
    if !again.is_empty() {
        anomalies.push("group_acked_handed_out_again");
    }
    if !skipped.is_empty() {
        anomalies.push("group_skipped");
    }
    if !log.drained {
        anomalies.push("group_not_drained");
    }
    let first = |v: &Vec<u64>| v.iter().take(10).copied().collect::<Vec<_>>();
    json!({
        "polls": log.polls,
        "failures": log.failures,
        "delivered": log.deliveries.len(),
        "distinct": delivered.len(),
        "acked": log.acked.len(),
        "drained": log.drained,
        "anomalies": anomalies,
        "wrong": {"count": wrong.len(), "first": first(&wrong)},
        "acked_handed_out_again": {"count": again.len(), "first": first(&again)},
        "skipped": {"count": skipped.len(), "first": first(&skipped)},
    })
}

/// Every record of every stream's shard 0, read from its leader until a read goes
/// quiet past the highest acknowledged offset (or 60 s pass).
pub async fn final_logs(
    cluster: &TestCluster,
    streams: &[StreamSpec],
    at_least: &HashMap<String, u64>,
) -> anyhow::Result<FinalLogs> {
    let mut out = FinalLogs::new();
    let config = cluster.client_config()?;
    for spec in streams {
        let want = at_least.get(spec.name).copied().unwrap_or(0);
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut got = BTreeMap::new();
        // A whole read (the subscription went quiet) that ends short of the highest
        // acknowledged offset, the same for 15 s running, is the log as it is: it goes
        // to the checker, which reports what it lacks (a log shorter than what was
        // acknowledged is exactly what the checker is for). Not sooner: a deposed
        // broker that has not heard of its successor yet serves its own, shorter log for
        // a few seconds.
        let mut short: Option<(u64, Instant)> = None;
        // How each read ended, for the error if none reaches the end.
        let mut tries: Vec<String> = Vec::new();
        loop {
            anyhow::ensure!(
                Instant::now() < deadline,
                "could not read {} back (have {} records, want offsets past {want}; reads: {})",
                spec.name,
                got.len(),
                tries.join("; ")
            );
            got.clear();
            let Some(c) = connect(&cluster.seeds(), &config).await else {
                continue;
            };
            let Ok(Ok(mut sub)) = tokio::time::timeout(
                Duration::from_secs(5),
                c.subscribe_shard(
                    TENANT,
                    NAMESPACE,
                    spec.name,
                    0,
                    Some(StartPosition::Earliest),
                ),
            )
            .await
            else {
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            };
            let began = Instant::now();
            let ended = loop {
                match tokio::time::timeout(Duration::from_secs(2), sub.next_event()).await {
                    Ok(Ok(Some(e))) => {
                        if let Some(o) = e.offset {
                            got.insert(o, e.payload.to_vec());
                        }
                    }
                    Ok(Ok(None)) => break "ended".to_owned(),
                    Ok(Err(e)) => break format!("error: {e}"),
                    Err(_) => break "2 s quiet".to_owned(),
                }
            };
            let end = got.keys().next_back().map_or(0, |o| o + 1);
            if end < want {
                tries.push(format!(
                    "{} records to {end} in {:.1} s, {ended}",
                    got.len(),
                    began.elapsed().as_secs_f64()
                ));
            }
            if end >= want {
                break;
            }
            match short {
                Some((e, since)) if e == end => {
                    if since.elapsed() >= Duration::from_secs(15) {
                        break;
                    }
                }
                _ => short = Some((end, Instant::now())),
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        out.insert((spec.name.to_owned(), 0), got);
    }
    Ok(out)
}

/// Runs `scenario` for `duration` with `seed`, with the deliberate bug `mutant` when
/// given; returns the result line.
pub fn run(
    scenario: &Scenario,
    seed: u64,
    duration: Duration,
    mutant: Option<&str>,
) -> anyhow::Result<Value> {
    let (broker, cp) = sibling_binaries()?;
    run_with(scenario, seed, duration, mutant, &broker, &cp)
}

/// Every stream's leadership changes, as the history's clock saw them (polled every
/// 100 ms until `stop`).
fn watch_leadership(
    admin: felix_controlplane::client::ControlPlaneClient,
    history: Arc<History>,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<HashMap<String, Vec<u64>>> {
    std::thread::spawn(move || {
        let mut last: HashMap<String, u64> = HashMap::new();
        let mut changes: HashMap<String, Vec<u64>> = HashMap::new();
        while !stop.load(Ordering::SeqCst) {
            if let Ok(v) = admin.get("/v1/shard-assignments") {
                let now = history.now_us();
                for a in v["items"].as_array().into_iter().flatten() {
                    let (Some(name), Some(g)) = (a["name"].as_str(), a["generation"].as_u64())
                    else {
                        continue;
                    };
                    if last.insert(name.to_owned(), g).is_some_and(|old| old != g) {
                        changes.entry(name.to_owned()).or_default().push(now);
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        changes
    })
}

/// As [`run`], with the binaries given.
pub fn run_with(
    scenario: &Scenario,
    seed: u64,
    duration: Duration,
    mutant: Option<&str>,
    broker: &Path,
    cp: &Path,
) -> anyhow::Result<Value> {
    let began = Instant::now();
    let start = if scenario.proxies {
        TestCluster::start_with_proxies
    } else {
        TestCluster::start
    };
    let mut yaml = scenario.broker_yaml.to_owned();
    if let Some(m) = mutant {
        if !yaml.contains("fault_injection") {
            yaml.push_str("fault_injection: true\n");
        }
        yaml.push_str(&format!("mutant: {m}\n"));
    }
    let mut cp_args: Vec<String> = CP_ARGS.iter().map(|s| s.to_string()).collect();
    cp_args.push("--fault-injection".into());
    let kek_dir = tempfile::tempdir()?;
    // Dropped after the cluster (declared before it): the run's database goes with it.
    let _database = if scenario.postgres {
        let (args, db) = crate::postgres_store_args(kek_dir.path())?;
        cp_args.extend(args);
        Some(db)
    } else {
        None
    };
    let cp_args: Vec<&str> = cp_args.iter().map(String::as_str).collect();
    // Declared before the cluster, so dropped after its brokers are gone.
    let mut _held: Vec<Box<dyn std::any::Any>> = Vec::new();
    let mut cluster = start(broker, cp, scenario.nodes, &cp_args, &yaml)?;
    let mut promise = HashMap::new();
    for s in scenario.streams {
        cluster.create_stream(s.name, 1, s.replication_factor, s.consistency)?;
        promise.insert(
            s.name.to_owned(),
            if s.consistency == "Leader" && s.replication_factor > 1 {
                Promise::LeaderOnly
            } else {
                Promise::Durable
            },
        );
    }
    for s in scenario.streams {
        cluster.wait_leader(s.name, 0, None, 0, Duration::from_secs(30))?;
    }
    let register = scenario.nodes >= 3
        && scenario
            .streams
            .iter()
            .any(|s| s.replication_factor == 3 && s.consistency == "Quorum");
    if register {
        cluster.admin.post(
            &format!("/v1/tenants/{TENANT}/namespaces/{NAMESPACE}/caches"),
            &json!({"cache": REGISTER, "shards": 1, "replication_factor": 3, "consistency": "Quorum"}),
        )?;
        cluster.create_stream(STATE_REGISTER, 1, 3, "Quorum")?;
        cluster.wait_leader(STATE_REGISTER, 0, None, 0, Duration::from_secs(30))?;
        // Led before leadership is watched (its first election is no change).
        wait_for("the register's leader", Duration::from_secs(30), || {
            cluster.assignments().ok()?.into_iter().find(|a| {
                a["kind"] == "cache" && a["name"] == REGISTER && a["generation"].as_u64() > Some(0)
            })
        })?;
    }
    let history = Arc::new(History::default());
    let stop = Arc::new(AtomicBool::new(false));
    let watcher = watch_leadership(cluster.admin.clone(), history.clone(), stop.clone());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut tasks = Vec::new();
    let mut groups = Vec::new();
    let producers_done = Arc::new(AtomicBool::new(false));
    let mut id = 0u32;
    for s in scenario.streams {
        for _ in 0..scenario.producers {
            tasks.push(rt.spawn(producer(
                id,
                s.name,
                scenario.depth,
                cluster.seeds(),
                cluster.client_config()?,
                history.clone(),
                stop.clone(),
            )));
            id += 1;
        }
        if promise[s.name] == Promise::Durable {
            groups.push((
                s.name,
                rt.spawn(group_consumer(
                    s.name,
                    cluster.seeds(),
                    cluster.client_config()?,
                    history.clone(),
                    stop.clone(),
                    producers_done.clone(),
                )),
            ));
            tasks.push(rt.spawn(reader(
                id,
                s.name,
                cluster.seeds(),
                cluster.client_config()?,
                history.clone(),
                stop.clone(),
            )));
            id += 1;
        }
    }
    let register_log: RegisterLog = Arc::default();
    let state_log: RegisterLog = Arc::default();
    let tally: CounterTally = Arc::default();
    if register {
        tasks.push(rt.spawn(counter_adder(
            cluster.seeds(),
            cluster.client_config()?,
            tally.clone(),
            stop.clone(),
        )));
        for (kind, log) in [
            (RegisterKind::Cache, &register_log),
            (RegisterKind::State, &state_log),
        ] {
            for reader in [false, true] {
                tasks.push(rt.spawn(register_worker(
                    kind,
                    reader,
                    cluster.seeds(),
                    cluster.client_config()?,
                    history.clone(),
                    log.clone(),
                    stop.clone(),
                )));
            }
        }
    }
    let mut nemesis = Nemesis {
        cluster: &mut cluster,
        streams: scenario.streams,
        rng: Rng::new(seed),
        began,
        deadline: Instant::now() + duration,
        timeline: Vec::new(),
        paused: Vec::new(),
        killed: Vec::new(),
        held: Vec::new(),
        register,
    };
    let acted = (scenario.nemesis)(&mut nemesis);
    let healed = nemesis.heal_all();
    let timeline = std::mem::take(&mut nemesis.timeline);
    _held = std::mem::take(&mut nemesis.held);
    acted?;
    healed?;
    for s in scenario.streams {
        cluster.wait_leader(s.name, 0, None, 0, Duration::from_secs(30))?;
    }
    // The workload runs on against the healed cluster, then stops.
    std::thread::sleep(Duration::from_secs(2));
    stop.store(true, Ordering::SeqCst);
    rt.block_on(async {
        for t in tasks {
            let _ = tokio::time::timeout(Duration::from_secs(10), t).await;
        }
    });
    producers_done.store(true, Ordering::SeqCst);
    // The group consumers drain what is left (bounded by GROUP_DRAIN_MAX).
    let group_logs: Vec<(&str, Option<GroupLog>)> = rt.block_on(async {
        let mut out = Vec::new();
        for (name, t) in groups {
            let log = tokio::time::timeout(GROUP_DRAIN_MAX + Duration::from_secs(10), t)
                .await
                .ok()
                .and_then(Result::ok);
            out.push((name, log));
        }
        out
    });
    let ops = history.ops();
    let changes = watcher.join().unwrap_or_default();
    let mut at_least: HashMap<String, u64> = HashMap::new();
    for op in &ops {
        if let (
            OpKind::Publish {
                offset: Some(o), ..
            },
            Outcome::Ok,
        ) = (&op.kind, op.outcome)
            && promise.get(&op.stream) == Some(&Promise::Durable)
        {
            let e = at_least.entry(op.stream.clone()).or_default();
            *e = (*e).max(o + 1);
        }
    }
    let mut per_stream = serde_json::Map::new();
    for s in scenario.streams {
        let mine = ops.iter().filter(|o| o.stream == s.name);
        let (mut acked, mut reads) = (0u64, 0u64);
        for o in mine {
            match (&o.kind, o.outcome) {
                (OpKind::Publish { .. }, Outcome::Ok) => acked += 1,
                (OpKind::Read { .. }, _) => reads += 1,
                _ => {}
            }
        }
        per_stream.insert(
            s.name.to_owned(),
            json!({"acked": acked, "reads": reads, "acked_end": at_least.get(s.name)}),
        );
    }
    let finals = match rt.block_on(final_logs(&cluster, scenario.streams, &at_least)) {
        Ok(f) => f,
        Err(e) => {
            if let Some(secs) = std::env::var("FELIX_CHAOS_HOLD")
                .ok()
                .and_then(|s| s.parse().ok())
            {
                let token = cluster.path().join("client.token");
                let _ = std::fs::write(&token, &cluster.client_token);
                eprintln!(
                    "holding the cluster in {} for {secs} s: {e:#}; streams {per_stream:?}; control plane {}; brokers {:?}; client token in {}",
                    cluster.path().display(),
                    cluster.cp.url,
                    cluster.seeds(),
                    token.display()
                );
                std::thread::sleep(Duration::from_secs(secs));
            }
            // A broker that died on its own is the likeliest reason: say so.
            let exits: Vec<String> = cluster
                .brokers
                .iter_mut()
                .enumerate()
                .filter_map(|(i, b)| b.exit_status().map(|s| format!("broker {i} exited: {s}")))
                .collect();
            return Err(e.context(format!(
                "streams {}{}",
                Value::Object(per_stream),
                if exits.is_empty() {
                    String::new()
                } else {
                    format!("; {}", exits.join("; "))
                }
            )));
        }
    };
    let report = check(&ops, &finals, &promise, &changes);
    let register_report = if register {
        let (seeds, config) = (cluster.seeds(), cluster.client_config()?);
        let final_value = rt.block_on(register_final(
            RegisterKind::Cache,
            seeds.clone(),
            config.clone(),
        ));
        let sum = rt.block_on(counter_final(seeds, config));
        let ops = std::mem::take(&mut *register_log.lock().expect("register log"));
        let mut report = check_register(&ops, final_value);
        // No acknowledged add may be lost. (No upper bound: an add whose answer was lost
        // with its connection is sent again and may count twice.)
        let (begun, acked) = (
            tally.0.load(Ordering::SeqCst),
            tally.1.load(Ordering::SeqCst),
        );
        report["counter"] = json!({"adds": begun, "acked": acked, "final": sum});
        let counter_anomaly = match sum {
            None => Some("counter_unread"),
            Some(s) if s < acked as i64 => Some("counter_lost_add"),
            Some(_) => None,
        };
        if let (Some(a), Some(list)) = (counter_anomaly, report["anomalies"].as_array_mut()) {
            list.push(json!(a));
        }
        report
    } else {
        Value::Null
    };
    let state_report = if register {
        let final_value = rt.block_on(register_final(
            RegisterKind::State,
            cluster.seeds(),
            cluster.client_config()?,
        ));
        let ops = std::mem::take(&mut *state_log.lock().expect("register log"));
        check_register(&ops, final_value)
    } else {
        Value::Null
    };
    let register_anomalies: Vec<String> = [
        ("register", &register_report),
        ("state_register", &state_report),
    ]
    .into_iter()
    .flat_map(|(prefix, report)| {
        report["anomalies"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(move |a| Some(format!("{prefix}_{}", a.as_str()?)))
    })
    .collect();
    let mut group_reports = serde_json::Map::new();
    let mut group_anomalies = Vec::new();
    for (name, log) in &group_logs {
        let checked = match log {
            Some(log) => {
                let empty = BTreeMap::new();
                let final_log = finals.get(&(name.to_string(), 0)).unwrap_or(&empty);
                check_group(log, final_log)
            }
            None => json!({"anomalies": ["group_consumer_hung"]}),
        };
        for a in checked["anomalies"].as_array().into_iter().flatten() {
            if let Some(a) = a.as_str()
                && !group_anomalies.iter().any(|g| g == a)
            {
                group_anomalies.push(a.to_owned());
            }
        }
        group_reports.insert(name.to_string(), checked);
    }
    // What failed publishes were answered, most frequent first (digits elided, so
    // offsets and ids do not split one kind of answer into many).
    let mut errors: BTreeMap<(String, String), u64> = BTreeMap::new();
    for op in &ops {
        if let (OpKind::Publish { .. }, Some(e)) = (&op.kind, &op.error) {
            let text: String = e
                .chars()
                .filter(|c| !c.is_ascii_digit())
                .take(120)
                .collect();
            *errors
                .entry((format!("{:?}", op.outcome), text))
                .or_default() += 1;
        }
    }
    let mut errors: Vec<_> = errors.into_iter().collect();
    errors.sort_by_key(|e| std::cmp::Reverse(e.1));
    let errors: Vec<Value> = errors
        .into_iter()
        .take(8)
        .map(|((outcome, text), count)| json!({"outcome": outcome, "error": text, "count": count}))
        .collect();
    // Copies brokers removed after leaving a shard's set (counted since each one's
    // last start; a run that moves shards around shows the removals it exercised).
    let copies_removed: u64 = cluster
        .brokers
        .iter()
        .filter_map(|b| b.metric("felix_broker_replicas_left_total").ok())
        .sum();
    let moved = scenario.stable && !changes.is_empty();
    let mut anomalies: Vec<String> = report.classes().into_iter().map(str::to_owned).collect();
    if moved {
        anomalies.push("leadership_moved".into());
    }
    anomalies.extend(group_anomalies.iter().cloned());
    anomalies.extend(register_anomalies.iter().cloned());
    Ok(json!({
        "scenario": scenario.name,
        "seed": seed,
        "mutant": mutant,
        "leadership_changes": changes,
        "duration_s": duration.as_secs_f64(),
        "wall_s": began.elapsed().as_secs_f64(),
        "nodes": scenario.nodes,
        "timeline": timeline,
        "valid": report.valid() && !moved && group_anomalies.is_empty() && register_anomalies.is_empty(),
        "anomalies": anomalies,
        "streams": per_stream,
        "copies_removed": copies_removed,
        "errors": errors,
        "report": report.json(),
        "groups": group_reports,
        "register": register_report,
        "state_register": state_report,
    }))
}
