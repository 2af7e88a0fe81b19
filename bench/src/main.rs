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
    },
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Quic {
            rounds,
            rtt_samples,
            bytes,
        } => felix_bench::quic::run(rounds, rtt_samples, bytes),
    }
}
