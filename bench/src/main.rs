//! `felix-bench`: see `docs/benchmarks.md`.

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "felix-bench",
    about = "Felix benchmarks, side by side with baselines"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// QUIC transport: our per-core driver vs quinn/tokio (RTT, throughput, scaling).
    Quic {
        /// Repetitions (medians are reported).
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// RTT samples per round.
        #[arg(long, default_value_t = 5000)]
        rtt_samples: usize,
        /// Bytes per throughput run.
        #[arg(long, default_value_t = 256 << 20)]
        bytes: u64,
        /// Throughput directions to run (`upload`, `download`); both by default.
        #[arg(
            long,
            value_enum,
            value_delimiter = ',',
            default_value = "upload,download"
        )]
        directions: Vec<felix_bench::quic::Direction>,
    },
    /// The scenario matrix against our broker, NATS JetStream and Redis Streams; writes
    /// results.json, results.md, throughput.svg and latency.svg.
    Compare {
        /// Cell size.
        #[arg(long, value_enum, default_value = "small")]
        scale: felix_bench::compare::Scale,
        /// Brokers to drive.
        #[arg(
            long,
            value_enum,
            value_delimiter = ',',
            default_value = "felix,nats,redis"
        )]
        peers: Vec<felix_bench::compare::Peer>,
        /// Our broker's cores.
        #[arg(long, default_value = "0-1")]
        cores: String,
        /// Output directory.
        #[arg(long, default_value = "bench-results")]
        out: std::path::PathBuf,
        /// Repetitions of the whole matrix; each cell reports its median round.
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// Only these scenarios (e.g. `S1,S3`); the ours-only figures need the full set.
        #[arg(long, value_delimiter = ',')]
        only: Vec<String>,
        /// Run the load generator only on these CPUs (e.g. `1`) and confine every
        /// broker, peers included, to `--cores` (e.g. `0`): msgs/s per broker core.
        #[arg(long)]
        load_cores: Option<String>,
    },
    /// Replication's cost: a one-copy stream and a Quorum stream with three copies on
    /// three brokers in this process, same load, same run.
    Replication {
        /// Repetitions (medians are reported).
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// Batches of 64 per throughput cell.
        #[arg(long, default_value_t = 2000)]
        batches: usize,
        /// One-at-a-time latency samples.
        #[arg(long, default_value_t = 1000)]
        samples: usize,
        /// The three brokers' cores, one CPU each (e.g. `0,1,2` on a machine with cores
        /// to spare); cores 0, 1, 0 when not given.
        #[arg(long, value_delimiter = ',')]
        broker_cores: Vec<String>,
        /// Confine the load generator's threads to these CPUs (e.g. `3-15`).
        #[arg(long)]
        load_cores: Option<String>,
    },
    /// Per-core scaling, ours alone: S3's load from producers pinned one stream per core,
    /// for each broker core count (broker on CPUs 0..n, the load on `--load-cores`).
    Scaling {
        /// Broker core counts.
        #[arg(long, value_delimiter = ',', default_value = "1,2")]
        counts: Vec<usize>,
        /// CPUs for the load generator, apart from the broker's.
        #[arg(long)]
        load_cores: String,
        /// Producers per broker core.
        #[arg(long, default_value_t = 1)]
        per_core: usize,
        /// Records per producer.
        #[arg(long, default_value_t = 1_000_000)]
        records: u64,
        /// Repetitions (medians are reported).
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// `on-commit`, `periodic:<ms>` or `none`.
        #[arg(long, default_value = "none")]
        fsync: String,
    },
    /// Queues: consumer groups, durable, against NATS JetStream pull consumers and Redis
    /// Streams consumer groups: claim + ack throughput and round latency.
    Queue {
        /// Brokers to drive.
        #[arg(
            long,
            value_enum,
            value_delimiter = ',',
            default_value = "felix,nats,redis"
        )]
        peers: Vec<felix_bench::compare::Peer>,
        /// Consumer counts.
        #[arg(long, value_delimiter = ',', default_value = "1,8")]
        consumers: Vec<usize>,
        /// Records per cell (1 KiB each). 200,000 by default: over a few hundred rounds
        /// (20,000 records) every broker is slower than at steady state, and the ratio
        /// between them is not the steady one (docs/benchmarks.md, "Queues").
        #[arg(long, default_value_t = 200_000)]
        records: usize,
        /// Records one claim takes at most.
        #[arg(long, default_value_t = 64)]
        batch: usize,
        /// Repetitions (medians are reported).
        #[arg(long, default_value_t = 3)]
        rounds: usize,
    },
    /// Caches and counters, durable, against Redis with `appendfsync always`: put, get
    /// and increment throughput, latency and server CPU per operation.
    Cache {
        /// Brokers to drive (`felix`, `redis`).
        #[arg(long, value_enum, value_delimiter = ',', default_value = "felix,redis")]
        peers: Vec<felix_bench::compare::Peer>,
        /// Requests in flight on the one connection.
        #[arg(long, value_delimiter = ',', default_value = "1,64")]
        windows: Vec<usize>,
        /// Operations per cell.
        #[arg(long, default_value_t = 20_000)]
        ops: usize,
        /// Repetitions (medians are reported).
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// Our broker's cores (`0`: the connection always lands on the cache's core).
        #[arg(long, default_value = "0-1")]
        cores: String,
        /// Open our connection on a core other than the cache shard's (reconnecting
        /// until it lands there): the case load following is for.
        #[arg(long)]
        cross_core: bool,
    },
    /// Runs our broker for the other commands, in a process of its own (internal).
    #[command(hide = true)]
    ServeBroker {
        /// Cores.
        #[arg(long)]
        cores: Option<String>,
        /// `on-commit`, `periodic:<ms>` or `none`.
        #[arg(long)]
        fsync: String,
        /// Pin rules.
        #[arg(long = "pin")]
        pins: Vec<String>,
        /// Data directory.
        #[arg(long)]
        dir: std::path::PathBuf,
    },
    /// Runs our QUIC echo server for the other commands, in a process of its own
    /// (internal).
    #[command(hide = true)]
    ServeEcho {
        /// CPUs, one core each (`0,1`).
        #[arg(long, value_delimiter = ',')]
        cpus: Vec<usize>,
        /// Busy-poll this long before parking.
        #[arg(long)]
        spin_us: Option<u64>,
        /// Directory holding the DER files `cert` and `key`.
        #[arg(long)]
        certs: std::path::PathBuf,
    },
    /// Broker: 1 KiB records, batch 1 and 64, fanout 1 and 10; ack and delivery latency.
    Broker {
        /// `on-commit`, `periodic:<ms>` or `none`.
        #[arg(long, default_value = "on-commit")]
        fsync: String,
        /// Records per batch-64 cell (batch-1 cells send an eighth).
        #[arg(long, default_value_t = 400_000)]
        records: u64,
        /// Latency samples.
        #[arg(long, default_value_t = 3000)]
        samples: usize,
        /// Broker cores (`0`, `0-1`, `all`).
        #[arg(long)]
        cores: Option<String>,
    },
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Quic {
            rounds,
            rtt_samples,
            bytes,
            directions,
        } => felix_bench::quic::run(rounds, rtt_samples, bytes, &directions),
        Command::Compare {
            scale,
            peers,
            cores,
            out,
            rounds,
            only,
            load_cores,
        } => {
            let md = felix_bench::compare::run(&felix_bench::compare::Options {
                scale,
                peers,
                cores,
                out,
                progress: true,
                rounds,
                only,
                load_cores,
            })?;
            println!("{md}");
            Ok(())
        }
        Command::Replication {
            rounds,
            batches,
            samples,
            broker_cores,
            load_cores,
        } => {
            println!(
                "{}",
                felix_bench::replication::run(
                    rounds,
                    batches,
                    samples,
                    &broker_cores,
                    load_cores.as_deref()
                )?
            );
            Ok(())
        }
        Command::Scaling {
            counts,
            load_cores,
            per_core,
            records,
            rounds,
            fsync,
        } => {
            println!(
                "{}",
                felix_bench::compare::scaling_curve(
                    &counts,
                    &load_cores,
                    per_core,
                    records,
                    rounds,
                    &fsync
                )?
            );
            Ok(())
        }
        Command::Queue {
            peers,
            consumers,
            records,
            batch,
            rounds,
        } => {
            println!(
                "{}",
                felix_bench::queue::run(&peers, &consumers, records, batch, rounds)?
            );
            Ok(())
        }
        Command::Cache {
            peers,
            windows,
            ops,
            rounds,
            cores,
            cross_core,
        } => {
            println!(
                "{}",
                felix_bench::cache::run(&peers, &windows, ops, rounds, &cores, cross_core)?
            );
            Ok(())
        }
        Command::ServeBroker {
            cores,
            fsync,
            pins,
            dir,
        } => felix_bench::broker::serve_child(cores.as_deref(), &fsync, &pins, &dir),
        Command::ServeEcho {
            cpus,
            spin_us,
            certs,
        } => felix_bench::quic::serve_echo_child(
            cpus,
            spin_us.map(std::time::Duration::from_micros),
            &certs,
        ),
        Command::Broker {
            fsync,
            records,
            samples,
            cores,
        } => felix_bench::broker::run(cores.as_deref(), &fsync, records, samples),
    }
}
