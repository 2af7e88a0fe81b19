//! The `felix-controlplane` command line (the binary's `main` and the test harness's copy).

use std::path::PathBuf;

use crate::config::{self, FileConfig, Overrides};
use crate::server;
use clap::Parser;

/// The Felix control plane.
#[derive(Debug, Parser)]
#[command(name = "felix-controlplane", version)]
struct Args {
    /// YAML configuration file.
    #[arg(long)]
    config: Option<PathBuf>,
    /// HTTP address (default 127.0.0.1:7070).
    #[arg(long)]
    listen: Option<String>,
    /// `memory` or a postgres:// URL.
    #[arg(long)]
    store: Option<String>,
    /// Enables POST /internal/bootstrap with this token.
    #[arg(long)]
    bootstrap_token: Option<String>,
    /// How often brokers heartbeat.
    #[arg(long)]
    heartbeat_interval_ms: Option<u64>,
    /// Silence after which a broker is down and its shards move.
    #[arg(long)]
    expiry_timeout_ms: Option<u64>,
    /// Extra silence beyond the expiry before a broker is down (default and least:
    /// a quarter of the expiry).
    #[arg(long)]
    regrant_margin_ms: Option<u64>,
    /// How long a replica-set member may be down before it is replaced.
    #[arg(long)]
    replica_restore_after_ms: Option<u64>,
    /// Time between placement passes.
    #[arg(long)]
    placement_interval_ms: Option<u64>,
    /// File holding the key-encryption key (32 bytes, base64: `openssl rand -base64
    /// 32`) that seals tenants' signing keys in the store. Required with Postgres.
    #[arg(long)]
    key_encryption_key_file: Option<String>,
    /// A previous key-encryption key still accepted to open keys (repeatable; for
    /// rotation: every key is sealed again with the current one at start).
    #[arg(long = "previous-key-encryption-key-file")]
    previous_key_encryption_key_files: Vec<String>,
    /// Serve HTTPS with this certificate chain (PEM; with --tls-key-file).
    #[arg(long)]
    tls_cert_file: Option<String>,
    /// The certificate's private key (PEM).
    #[arg(long)]
    tls_key_file: Option<String>,
    /// Serve plain HTTP on an address that is not loopback (keys and assignments then
    /// travel unprotected; logged as a warning).
    #[arg(long)]
    insecure_http: bool,
    /// Serve POST /debug/clock, which steps this process's wall clock (tests and
    /// chaos runs only; also FELIX_FAULT_INJECTION=1).
    #[arg(long)]
    fault_injection: bool,
}

/// Parses the process arguments and serves until SIGTERM or SIGINT.
pub fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("FELIX_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let file = match &args.config {
        Some(p) => config::load_file(p)?,
        None => FileConfig::default(),
    };
    let config = config::resolve(
        file,
        Overrides {
            listen: args.listen,
            store: args.store,
            bootstrap_token: args.bootstrap_token,
            heartbeat_interval_ms: args.heartbeat_interval_ms,
            expiry_timeout_ms: args.expiry_timeout_ms,
            regrant_margin_ms: args.regrant_margin_ms,
            replica_restore_after_ms: args.replica_restore_after_ms,
            placement_interval_ms: args.placement_interval_ms,
            key_encryption_key_file: args.key_encryption_key_file,
            previous_key_encryption_key_files: args.previous_key_encryption_key_files,
            tls_cert_file: args.tls_cert_file,
            tls_key_file: args.tls_key_file,
            insecure_http: args.insecure_http,
        },
    )?;
    let mut config = config;
    config.api.fault_injection = args.fault_injection
        || std::env::var("FELIX_FAULT_INJECTION").is_ok_and(|v| v == "1" || v == "true");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let running = server::start(config).await?;
        // The one line scripts and the test harness wait for.
        println!(
            "felix-controlplane listening on {}://{}",
            running.scheme, running.addr
        );
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        running.stop().await;
        anyhow::Ok(())
    })
}
