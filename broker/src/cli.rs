//! The `felix-broker` command line (the binary's `main` and the test harness's copy).

use std::path::PathBuf;

use crate::config::{BrokerConfig, FileConfig, Overrides};
use crate::{dev, server};
use clap::{Args, Parser, Subcommand};

#[derive(Parser)]
#[command(name = "felix-broker", about = "A thread-per-core Felix broker")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Args, Clone)]
struct Common {
    /// Data directory (logs, catalog, dev credentials).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// QUIC address.
    #[arg(long)]
    listen: Option<String>,
    /// HTTP address for /metrics, /livez, /readyz ("off" to disable).
    #[arg(long)]
    http: Option<String>,
    /// Cores to run on: `0-3`, `0,2` or `all`.
    #[arg(long)]
    cores: Option<String>,
    /// Shard count of streams and caches created on first use.
    #[arg(long)]
    shards: Option<u32>,
    /// When acks are sent: `on-commit` (after fdatasync), `periodic:<ms>`, `none`.
    #[arg(long)]
    fsync: Option<String>,
    /// Follow this control plane (`http://host:port`) for placement and keys.
    #[arg(long)]
    controlplane: Option<String>,
    /// This node's id.
    #[arg(long)]
    node_id: Option<String>,
    /// Microseconds an idle core busy-polls before sleeping (lower latency, more CPU).
    #[arg(long)]
    spin_us: Option<u64>,
    /// Close a connection that has not authenticated a stream within this (0: never).
    #[arg(long)]
    auth_timeout_ms: Option<u64>,
    /// Close a connection silent this long (its subscriptions end with it).
    #[arg(long)]
    idle_timeout_ms: Option<u64>,
}

impl Common {
    fn overrides(&self) -> Overrides {
        Overrides {
            listen: self.listen.clone(),
            http: self.http.clone(),
            data_dir: self.data_dir.clone(),
            cores: self.cores.clone(),
            fsync: self.fsync.clone(),
            default_shards: self.shards,
            controlplane_url: self.controlplane.clone(),
            node_id: self.node_id.clone(),
            spin_us: self.spin_us,
            auth_timeout_ms: self.auth_timeout_ms,
            idle_timeout_ms: self.idle_timeout_ms,
        }
    }
}

#[derive(Subcommand)]
enum Command {
    /// A single-node broker with everything embedded (certificates, token, catalog).
    Dev {
        #[command(flatten)]
        common: Common,
        /// The tenant to create a token for.
        #[arg(long, default_value = "dev")]
        tenant: String,
        /// Address of the embedded control plane ("off" to run without one).
        #[arg(long, default_value = "127.0.0.1:7070")]
        controlplane_listen: String,
        /// A YAML file with more settings (limits, segment size); flags win.
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// A broker from a YAML config (overridden by FELIX_* env and flags).
    Serve {
        #[command(flatten)]
        common: Common,
        /// The YAML file.
        #[arg(long)]
        config: Option<PathBuf>,
    },
}

/// Fixes glibc's thresholds for large allocations before any thread starts. By default
/// glibc raises its mmap threshold to the size of each large block freed (up to 32 MiB),
/// so after the first flush round's buffers went back, later ones (log chunks of up to a
/// round, 8 MiB) came from the cores' arenas, where freeing them among a flood's small
/// frames stranded the space: after one 4-second flood of 60 KiB publishes the broker's
/// RSS was 123-193 MiB over five runs, against 105-116 MiB with these settings, and the
/// throughput cells did not move (S3, S5, S7 side by side; docs/configuration.md).
/// With the threshold fixed, a block of 4 MiB or more is mapped on its own (unmapped
/// when freed) unless free space in an arena fits it; the trim threshold is raised with
/// it so a freed top of a heap is not handed back (and faulted in again) at every round.
/// This overrides an operator's `MALLOC_*` or `GLIBC_TUNABLES` for the two.
fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets allocator parameters; it is called before the broker
    // starts any thread.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 4 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 32 << 20);
    }
}

/// A panic anywhere in the broker stops the process with exit code 70, so a supervisor
/// restarts it: a core that died would leave its connections hanging while the process
/// looked healthy.
fn exit_on_panic() {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        report(info);
        let thread = std::thread::current();
        eprintln!(
            "felix-broker: thread {:?} panicked; exiting (70) for a supervisor to restart the broker",
            thread.name().unwrap_or("unnamed")
        );
        // SAFETY: _exit ends the process at once, running no destructors or atexit
        // handlers that could deadlock against the panicking thread.
        unsafe { libc::_exit(70) };
    }));
}

/// Parses the process arguments and runs the broker until it is told to stop.
pub fn main() -> anyhow::Result<()> {
    use std::io::IsTerminal as _;
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("FELIX_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    tune_allocator();
    exit_on_panic();
    match Cli::parse().command {
        Command::Dev {
            common,
            tenant,
            controlplane_listen,
            config,
        } => {
            let file = match &config {
                Some(p) => BrokerConfig::load_file(p)?,
                None => FileConfig::default(),
            };
            let config = BrokerConfig::resolve(file, common.overrides(), true)?;
            let setup = dev::prepare(&config.data_dir, &tenant)?;
            let signals = server::stop_signals()?;
            let broker =
                server::start(&config, &setup.cert_pem, &setup.key_pem, setup.keys.clone())?;
            println!(
                "felix-broker dev: listening on {} (QUIC), http {}, cores {:?}, fsync {:?}, data {}",
                broker.started.listen,
                broker
                    .started
                    .http
                    .map_or("off".to_string(), |a| format!("http://{a}")),
                config.cores.cpus(),
                config.fsync,
                config.data_dir.display()
            );
            if controlplane_listen != "off" {
                let listen = controlplane_listen.parse().map_err(|e| {
                    anyhow::anyhow!("--controlplane-listen {controlplane_listen:?}: {e}")
                })?;
                let cp = crate::embedded::start(
                    listen,
                    &config.data_dir,
                    &tenant,
                    broker.shared.clone(),
                )?;
                println!(
                    "felix-broker dev: control plane {} (admin token {})",
                    cp.url,
                    cp.token_path.display()
                );
            }
            println!(
                "{}",
                dev::connect_snippet(broker.started.listen, &tenant, &setup)
            );
            server::shutdown_on_signals(signals, broker.shutdown_handle(), None)?;
            broker.join()?;
            println!("felix-broker: stopped cleanly");
        }
        Command::Serve { common, config } => {
            let file = match &config {
                Some(p) => BrokerConfig::load_file(p)?,
                None => FileConfig::default(),
            };
            let config = BrokerConfig::resolve(file, common.overrides(), false)?;
            let (cert, key) = config
                .tls
                .clone()
                .expect("resolve requires TLS outside dev mode");
            let cert_pem = std::fs::read_to_string(&cert)
                .map_err(|e| anyhow::anyhow!("tls_cert {}: {e}", cert.display()))?;
            let key_pem = std::fs::read_to_string(&key)
                .map_err(|e| anyhow::anyhow!("tls_key {}: {e}", key.display()))?;
            let signals = server::stop_signals()?;
            let broker = server::start(&config, &cert_pem, &key_pem, Default::default())?;
            println!(
                "felix-broker: listening on {} (QUIC), http {}, node {}{}",
                broker.started.listen,
                broker
                    .started
                    .http
                    .map_or("off".to_string(), |a| format!("http://{a}")),
                config.node_id,
                config
                    .cluster
                    .as_ref()
                    .map(|c| format!(", following {}", c.url))
                    .unwrap_or_default()
            );
            server::shutdown_on_signals(
                signals,
                broker.shutdown_handle(),
                broker.shared.cluster.clone(),
            )?;
            broker.join()?;
            println!("felix-broker: stopped cleanly");
        }
    }
    Ok(())
}
