//! `felix-cluster`: the harness that runs real broker processes for integration, fault
//! and history tests.
//!
//! [`BrokerProcess`] starts the broker binary on loopback with a fresh or reused data
//! directory, reads the address it bound from its first line of output, and stops it
//! gracefully (SIGTERM) or kills it (SIGKILL) by its own pid. [`python`] finds (or
//! installs) the standard SDK, `felix-client==0.6.2`, so tests drive the broker as a
//! user would.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

pub mod chaos;
pub mod cluster;
pub mod history;
pub mod proxy;

/// A broker process under test.
#[derive(Debug)]
pub struct BrokerProcess {
    child: Option<Child>,
    /// The test looked at how the process ended (`exit_status`): an exit it expected.
    exit_seen: bool,
    /// A signal that ends the process was sent to it ([`BrokerProcess::signal`]).
    signalled: std::sync::atomic::AtomicBool,
    binary: PathBuf,
    args: Vec<String>,
    /// The data directory (kept across restarts).
    pub data_dir: PathBuf,
    /// QUIC address.
    pub listen: SocketAddr,
    /// HTTP address.
    pub http: SocketAddr,
    /// The embedded control plane's URL (dev mode).
    pub controlplane: Option<String>,
}

impl BrokerProcess {
    /// Starts `binary dev` on loopback over `data_dir` with extra flags.
    pub fn start_dev(
        binary: &Path,
        data_dir: &Path,
        extra: &[&str],
    ) -> anyhow::Result<BrokerProcess> {
        let mut args: Vec<String> = vec![
            "dev".into(),
            "--data-dir".into(),
            data_dir.display().to_string(),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--http".into(),
            "127.0.0.1:0".into(),
            "--controlplane-listen".into(),
            "127.0.0.1:0".into(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut p = BrokerProcess {
            child: None,
            exit_seen: false,
            signalled: std::sync::atomic::AtomicBool::new(false),
            binary: binary.to_path_buf(),
            args,
            data_dir: data_dir.to_path_buf(),
            listen: "0.0.0.0:0".parse().expect("valid"),
            http: "0.0.0.0:0".parse().expect("valid"),
            controlplane: None,
        };
        p.spawn(None)?;
        Ok(p)
    }

    /// As [`BrokerProcess::start_dev`], its data in `data` under a new temporary
    /// directory, which is returned too: keep it while the broker runs.
    pub fn start_dev_in_temp_dir(
        binary: &Path,
        extra: &[&str],
    ) -> anyhow::Result<(BrokerProcess, tempfile::TempDir)> {
        let dir = tempfile::tempdir()?;
        let b = Self::start_dev(binary, &dir.path().join("data"), extra)?;
        Ok((b, dir))
    }

    /// As [`BrokerProcess::start_dev`], with `yaml` written to `dir/broker.yaml` as the
    /// configuration file, the data in `dir/data`, and `extra` arguments after it.
    pub fn start_dev_with_config(
        binary: &Path,
        dir: &Path,
        yaml: &str,
        extra: &[&str],
    ) -> anyhow::Result<BrokerProcess> {
        let path = dir.join("broker.yaml");
        std::fs::write(&path, yaml)?;
        let path = path.to_str().context("a UTF-8 data path")?.to_owned();
        let mut args = vec!["--config", path.as_str()];
        args.extend_from_slice(extra);
        Self::start_dev(binary, &dir.join("data"), &args)
    }

    /// Starts `binary serve --config <config>` on `listen` (a fixed port: a broker that
    /// follows a control plane advertises it) over `data_dir`.
    pub fn start_serve(
        binary: &Path,
        data_dir: &Path,
        config: &Path,
        listen: SocketAddr,
    ) -> anyhow::Result<BrokerProcess> {
        let args: Vec<String> = vec![
            "serve".into(),
            "--config".into(),
            config.display().to_string(),
            "--data-dir".into(),
            data_dir.display().to_string(),
            "--listen".into(),
            listen.to_string(),
            "--http".into(),
            "127.0.0.1:0".into(),
        ];
        let mut p = BrokerProcess {
            child: None,
            exit_seen: false,
            signalled: std::sync::atomic::AtomicBool::new(false),
            binary: binary.to_path_buf(),
            args,
            data_dir: data_dir.to_path_buf(),
            listen,
            http: "0.0.0.0:0".parse().expect("valid"),
            controlplane: None,
        };
        p.spawn(None)?;
        Ok(p)
    }

    /// Sends `signal` (e.g. `libc::SIGSTOP`) to the process.
    pub fn signal(&self, signal: libc::c_int) {
        if !matches!(signal, libc::SIGSTOP | libc::SIGCONT) {
            self.signalled
                .store(true, std::sync::atomic::Ordering::SeqCst);
        }
        // SAFETY: signalling the child we spawned, by its pid.
        unsafe {
            libc::kill(self.pid() as libc::pid_t, signal);
        }
    }

    fn spawn(&mut self, listen: Option<SocketAddr>) -> anyhow::Result<()> {
        let mut args = self.args.clone();
        if let Some(addr) = listen
            && let Some(i) = args.iter().position(|a| a == "--listen")
        {
            args[i + 1] = addr.to_string();
        }
        // A broker restarted on its fixed port can find it briefly taken (another
        // process's ephemeral socket got it while the broker was down): it exits at
        // once saying so. Try again a few times rather than fail the run, and never
        // wait out the whole deadline for a process that is already gone.
        let mut attempt = 0;
        let (child, rx, line) = loop {
            attempt += 1;
            let (mut child, rx) = self.start_child(&args)?;
            match rx.recv_timeout(Duration::from_secs(60)) {
                Ok(Some(line)) => break (child, rx, line),
                Ok(None) => {
                    let status = child.wait()?;
                    if attempt < 4 {
                        eprintln!(
                            "harness: {} exited before reporting its address ({status}); starting it again",
                            self.binary.display()
                        );
                        std::thread::sleep(Duration::from_millis(500 * attempt));
                        continue;
                    }
                    bail!(
                        "the broker exited before reporting its address ({status}), {attempt} tries"
                    );
                }
                Err(_) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    bail!("the broker did not report its address within 60 s");
                }
            }
        };
        // "... listening on 127.0.0.1:PORT (QUIC), http http://127.0.0.1:PORT, ..."
        let listen = line
            .split("listening on ")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .context("no QUIC address in the start line")?;
        self.listen = listen.parse()?;
        if let Some(http) = line
            .split("http://")
            .nth(1)
            .and_then(|r| r.split([',', ' ']).next())
        {
            self.http = http.parse()?;
        }
        let embedded = self.args.first().is_some_and(|a| a == "dev")
            && !self
                .args
                .windows(2)
                .any(|w| w[0] == "--controlplane-listen" && w[1] == "off");
        if embedded {
            let line = rx
                .recv_timeout(Duration::from_secs(30))
                .ok()
                .flatten()
                .context("the dev broker did not report its control plane")?;
            self.controlplane = line
                .split("control plane ")
                .nth(1)
                .and_then(|r| r.split_whitespace().next())
                .map(str::to_owned);
        }
        self.child = Some(child);
        self.exit_seen = false;
        *self.signalled.get_mut() = false;
        Ok(())
    }

    /// Starts the process; the receiver gets each start line (`Some`), then `None` when
    /// its output ends (it exited).
    fn start_child(
        &self,
        args: &[String],
    ) -> anyhow::Result<(Child, std::sync::mpsc::Receiver<Option<String>>)> {
        let mut child = harness_child(&self.binary)
            .args(args)
            .spawn()
            .with_context(|| format!("starting {}", self.binary.display()))?;
        let stdout = child.stdout.take().expect("piped");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if line.contains("listening on") || line.contains("control plane http://") {
                    let _ = tx.send(Some(line.clone()));
                }
            }
            let _ = tx.send(None);
        });
        Ok((child, rx))
    }

    /// The dev token.
    pub fn token(&self) -> String {
        std::fs::read_to_string(self.data_dir.join("dev/token"))
            .expect("dev mode writes a token")
            .trim()
            .to_owned()
    }

    /// The dev CA file.
    pub fn ca_file(&self) -> PathBuf {
        self.data_dir.join("dev/ca.pem")
    }

    /// The broker binary it runs.
    pub fn binary(&self) -> &Path {
        &self.binary
    }

    /// The pid.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// The exit status, if the process has exited.
    pub fn exit_status(&mut self) -> Option<std::process::ExitStatus> {
        let status = self
            .child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten());
        self.exit_seen |= status.is_some();
        status
    }

    /// The embedded control plane's admin client (dev mode).
    pub fn admin(&self) -> anyhow::Result<felix_controlplane::client::ControlPlaneClient> {
        let url = self
            .controlplane
            .as_deref()
            .context("no embedded control plane")?;
        let token = std::fs::read_to_string(self.data_dir.join("dev/controlplane.token"))?;
        Ok(felix_controlplane::client::ControlPlaneClient::new(
            url,
            Some(token.trim().to_owned()),
        )?)
    }

    /// SIGKILL, then wait.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            // A broker exits 70 when one of its cores panicked, and dies of a signal
            // nobody here sent when it aborts, faults or is killed for memory: a test
            // that did not ask for that fails here, whatever else it checked (a harness
            // that restarts brokers would otherwise hide it).
            if let Ok(Some(status)) = c.try_wait()
                && !self.exit_seen
                && !std::thread::panicking()
            {
                use std::os::unix::process::ExitStatusExt as _;
                if status.code() == Some(70) {
                    panic!(
                        "the broker in {} exited 70 (a core panicked) before the test stopped it",
                        self.data_dir.display()
                    );
                }
                if let Some(signal) = status
                    .signal()
                    .filter(|_| !self.signalled.load(std::sync::atomic::Ordering::SeqCst))
                {
                    panic!(
                        "the broker in {} died of signal {signal} before the test stopped it",
                        self.data_dir.display()
                    );
                }
            }
            // SAFETY: signalling the child we spawned, by its pid.
            unsafe {
                libc::kill(c.id() as libc::pid_t, libc::SIGKILL);
            }
            let _ = c.wait();
        }
    }

    /// SIGTERM, then wait up to `timeout`; returns whether it exited cleanly.
    pub fn terminate(&mut self, timeout: Duration) -> bool {
        let Some(mut c) = self.child.take() else {
            return true;
        };
        // SAFETY: signalling the child we spawned, by its pid.
        unsafe {
            libc::kill(c.id() as libc::pid_t, libc::SIGTERM);
        }
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(status)) = c.try_wait() {
                return status.success();
            }
            if Instant::now() > deadline {
                let _ = c.kill();
                let _ = c.wait();
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Starts again on the same data directory and port.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.kill();
        let addr = self.listen;
        self.spawn(Some(addr))
    }

    /// `GET path` on the HTTP endpoint.
    pub fn http_get(&self, path: &str) -> anyhow::Result<(u16, String)> {
        self.http_request("GET", path)
    }

    /// `POST path` (empty body) on the HTTP endpoint.
    pub fn http_post(&self, path: &str) -> anyhow::Result<(u16, String)> {
        self.http_request("POST", path)
    }

    fn http_request(&self, method: &str, path: &str) -> anyhow::Result<(u16, String)> {
        self.http_exchange(method, path, None)
    }

    /// One exchange with the broker's operator endpoint, through the `felix` command's
    /// own HTTP client.
    fn http_exchange(
        &self,
        method: &str,
        path: &str,
        body: Option<&str>,
    ) -> anyhow::Result<(u16, String)> {
        felix_client::ops::http(&self.http.to_string(), method, path, body)
            .map_err(|e| anyhow::anyhow!(e))
    }

    /// A metric's sum over cores.
    pub fn metric(&self, name: &str) -> anyhow::Result<u64> {
        let (_, body) = self.http_get("/metrics")?;
        Ok(body
            .lines()
            .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum())
    }

    /// The broker's resident memory, in KiB (from /proc).
    pub fn rss_kib(&self) -> u64 {
        std::fs::read_to_string(format!("/proc/{}/status", self.pid()))
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("VmRSS:"))
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            })
            .unwrap_or(0)
    }

    /// The resident set by kind (`RssAnon`, `RssFile`, `RssShmem`), for messages: a
    /// mapped file counts in the RSS as much as the heap does.
    pub fn rss_kinds(&self) -> String {
        let status =
            std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap_or_default();
        status
            .lines()
            .filter(|l| l.starts_with("Rss"))
            .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

impl Drop for BrokerProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A broker or control-plane process as the harness runs it: logs at `FELIX_LOG`
/// (default `warn`) on our stderr, its start lines on a pipe.
fn harness_child(binary: &Path) -> Command {
    let mut cmd = Command::new(binary);
    cmd.env(
        "FELIX_LOG",
        std::env::var("FELIX_LOG").unwrap_or_else(|_| "warn".into()),
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::inherit());
    cmd
}

/// A UDP address on `ip` (any of 127.0.0.0/8 is loopback) for a broker that keeps its
/// port across restarts: free now, never handed out before by this process, and below
/// the kernel's ephemeral range, so no client socket opened while the broker is down
/// can take it (an ephemeral port once did, and the restart failed).
pub fn free_udp_addr_on(ip: std::net::IpAddr) -> anyhow::Result<SocketAddr> {
    static HANDED_OUT: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    const LOWEST: u16 = 10_000;
    let ephemeral_from = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32_768);
    let span = u32::from(ephemeral_from.saturating_sub(LOWEST));
    let mut handed_out = HANDED_OUT.lock().unwrap_or_else(|p| p.into_inner());
    // Start somewhere different in each process, so two test binaries rarely probe
    // the same ports in the same order.
    let start = std::process::id().wrapping_mul(7_919)
        ^ std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
    for i in 0..span {
        let port = LOWEST + ((start.wrapping_add(i)) % span) as u16;
        if handed_out.contains(&port) {
            continue;
        }
        if let Ok(s) = std::net::UdpSocket::bind(SocketAddr::new(ip, port)) {
            handed_out.push(port);
            return Ok(s.local_addr()?);
        }
    }
    Ok(std::net::UdpSocket::bind(SocketAddr::new(ip, 0))?.local_addr()?)
}

/// As [`free_udp_addr_on`], on 127.0.0.1.
pub fn free_udp_addr() -> anyhow::Result<SocketAddr> {
    free_udp_addr_on(std::net::Ipv4Addr::LOCALHOST.into())
}

/// TLS files for brokers that must trust each other and be trusted by clients: one CA,
/// one leaf for `localhost` and 127.0.0.1.
#[derive(Debug, Clone)]
pub struct ClusterCerts {
    /// Leaf chain (PEM).
    pub cert: PathBuf,
    /// Leaf key (PEM).
    pub key: PathBuf,
    /// The CA (PEM).
    pub ca: PathBuf,
}

impl ClusterCerts {
    /// Generates and writes them under `dir`.
    pub fn write(dir: &Path) -> anyhow::Result<ClusterCerts> {
        let g = felix_core_runtime::quic::generate_certs(&["localhost", "127.0.0.1"])?;
        let c = ClusterCerts {
            cert: dir.join("cert.pem"),
            key: dir.join("key.pem"),
            ca: dir.join("ca.pem"),
        };
        std::fs::write(&c.cert, &g.cert_pem)?;
        std::fs::write(&c.key, &g.key_pem)?;
        std::fs::write(&c.ca, &g.ca_pem)?;
        Ok(c)
    }
}

/// A control-plane process under test (in-memory store unless told otherwise).
#[derive(Debug)]
pub struct ControlPlaneProcess {
    child: Option<Child>,
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    binary: PathBuf,
    extra: Vec<String>,
}

impl ControlPlaneProcess {
    /// Starts `binary --listen 127.0.0.1:0 <extra>` and waits for its address.
    pub fn start(binary: &Path, extra: &[&str]) -> anyhow::Result<ControlPlaneProcess> {
        let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        let (child, url) = Self::spawn(binary, "127.0.0.1:0", &extra)?
            .context("the control plane exited during start")?;
        Ok(ControlPlaneProcess {
            child: Some(child),
            url,
            binary: binary.to_path_buf(),
            extra,
        })
    }

    /// Spawns it on `listen`; `None` when it exited before reporting its address.
    fn spawn(
        binary: &Path,
        listen: &str,
        extra: &[String],
    ) -> anyhow::Result<Option<(Child, String)>> {
        let mut child = harness_child(binary)
            .args(["--listen", listen])
            .args(extra)
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        let stdout = child.stdout.take().expect("piped");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(url) = line.split("listening on ").nth(1) {
                    let _ = tx.send(url.trim().to_owned());
                }
            }
        });
        match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(url) => Ok(Some((child, url))),
            // Its output ended: it exited (a port still held, say).
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                let _ = child.wait();
                Ok(None)
            }
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                Err(anyhow::anyhow!(
                    "the control plane did not report its address: {e}"
                ))
            }
        }
    }

    /// SIGKILL.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again on the same address with the same arguments (a Postgres store
    /// keeps the metadata; a memory one starts empty), retrying while the port is held.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.kill();
        let listen = self
            .url
            .trim_start_matches("http://")
            .trim_end_matches('/')
            .to_owned();
        for _ in 0..20 {
            if let Some((child, _)) = Self::spawn(&self.binary, &listen, &self.extra)? {
                self.child = Some(child);
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        anyhow::bail!("the control plane did not start again on {listen}")
    }
}

/// Control-plane arguments for a store in a fresh database of the test Postgres
/// (`tests/postgres/setup.sh` starts it, installing the server if needed; or
/// `FELIX_TEST_POSTGRES_URL` / `FELIX_TEST_POSTGRES_CA`), reached over TLS with the
/// server verified, and a key-encryption key written under `dir`.
pub fn postgres_store_args(dir: &Path) -> anyhow::Result<(Vec<String>, TestDatabase)> {
    let setup = |args: &[&str]| -> anyhow::Result<String> {
        let out = Command::new("bash")
            .arg(manifest_dir().join("postgres/setup.sh"))
            .args(args)
            .stderr(Stdio::inherit())
            .output()?;
        anyhow::ensure!(out.status.success(), "tests/postgres/setup.sh failed");
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    };
    let base = match std::env::var("FELIX_TEST_POSTGRES_URL") {
        Ok(u) => u,
        Err(_) => setup(&[])?,
    };
    let ca = match std::env::var("FELIX_TEST_POSTGRES_CA") {
        Ok(c) => c,
        Err(_) => setup(&["--ca"])?,
    };
    let db = format!(
        "felix_chaos_{}_{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_nanos()
            % 1_000_000_000
    );
    let createdb = std::iter::once(PathBuf::from("createdb"))
        .chain(
            std::fs::read_dir("/usr/lib/postgresql")
                .into_iter()
                .flatten()
                .flatten()
                .map(|v| v.path().join("bin/createdb")),
        )
        .find(|p| {
            Command::new(p)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        })
        .context("no createdb found")?;
    let out = Command::new(&createdb)
        .arg(format!("--maintenance-db={base}"))
        .arg(&db)
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "createdb {db}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let guard = TestDatabase {
        dropdb: createdb.with_file_name("dropdb"),
        base: base.clone(),
        name: db.clone(),
    };
    let (prefix, _) = base.rsplit_once('/').context("a database URL")?;
    let kek = dir.join("kek");
    // Test data: a fixed key.
    std::fs::write(&kek, "QkJCQkJCQkJCQkJCQkJCQkJCQkJCQkJCQkJCQkJCQkI=\n")?;
    Ok((
        vec![
            "--store".into(),
            format!("{prefix}/{db}?sslmode=verify-full&sslrootcert={ca}"),
            "--key-encryption-key-file".into(),
            kek.display().to_string(),
        ],
        guard,
    ))
}

/// A database made for one run; dropped (with any connection left to it) when this is,
/// so repeated chaos runs do not fill the test server's disk.
#[derive(Debug)]
pub struct TestDatabase {
    dropdb: PathBuf,
    base: String,
    name: String,
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        let dropped = Command::new(&self.dropdb)
            .arg(format!("--maintenance-db={}", self.base))
            .args(["--if-exists", "--force"])
            .arg(&self.name)
            .output();
        if !dropped.is_ok_and(|o| o.status.success()) {
            eprintln!("could not drop the test database {}", self.name);
        }
    }
}

impl Drop for ControlPlaneProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Polls `f` every 50 ms until it returns `Some` or `timeout` passes.
pub fn wait_for<T>(
    what: &str,
    timeout: Duration,
    mut f: impl FnMut() -> Option<T>,
) -> anyhow::Result<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return Ok(v);
        }
        if Instant::now() > deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Runs `tests/python/<script>` with `args`.
pub fn run_python_args(script: &str, args: &[&str]) -> anyhow::Result<Output> {
    let path = manifest_dir().join("python").join(script);
    Ok(Command::new(python()?).arg(&path).args(args).output()?)
}

/// The python interpreter with the standard SDK installed (installing it once).
pub fn python() -> anyhow::Result<PathBuf> {
    static PY: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    PY.get_or_init(|| {
        if let Ok(p) = std::env::var("FELIX_PYTHON") {
            return Ok(PathBuf::from(p));
        }
        let script = manifest_dir().join("python/setup.sh");
        let out = Command::new("bash")
            .arg(&script)
            .stderr(Stdio::inherit())
            .output()
            .map_err(|e| format!("running {}: {e}", script.display()))?;
        if !out.status.success() {
            return Err(format!(
                "{} failed: cannot install felix-client==0.6.2",
                script.display()
            ));
        }
        Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
    })
    .clone()
    .map_err(|e| anyhow::anyhow!(e))
}

/// Runs `tests/python/<script>` against `broker` with extra arguments.
pub fn run_python(broker: &BrokerProcess, script: &str, args: &[&str]) -> anyhow::Result<Output> {
    let path = manifest_dir().join("python").join(script);
    let out = Command::new(python()?)
        .arg(&path)
        .arg(broker.listen.to_string())
        .arg(broker.data_dir.join("dev/token"))
        .arg(broker.ca_file())
        .args(args)
        .output()?;
    Ok(out)
}

/// Fails with the script's output unless it exited 0.
pub fn expect_success(what: &str, out: &Output) -> anyhow::Result<String> {
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    if !out.status.success() {
        bail!(
            "{what} failed ({}):\n--- stdout\n{stdout}\n--- stderr\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(stdout)
}

/// A raw QUIC connection to `broker` (stock quinn), for protocol-level tests.
pub async fn raw_connect(
    broker: &BrokerProcess,
) -> anyhow::Result<(quinn::Endpoint, quinn::Connection)> {
    raw_connect_to(broker.listen, &broker.ca_file()).await
}

/// A raw QUIC connection to the broker at `addr` whose certificate chains to the CA in
/// `ca` (stock quinn).
pub async fn raw_connect_to(
    addr: SocketAddr,
    ca: &Path,
) -> anyhow::Result<(quinn::Endpoint, quinn::Connection)> {
    raw_connect_with(addr, ca, Default::default()).await
}

/// A raw connection to `b` with small receive windows (16 KiB a stream, 1 MiB in all):
/// what it does not read soon stays with the broker.
pub async fn raw_connect_small_windows(
    b: &BrokerProcess,
) -> anyhow::Result<(quinn::Endpoint, quinn::Connection)> {
    raw_connect_with(
        b.listen,
        &b.ca_file(),
        felix_core_runtime::quic::TransportLimits {
            stream_window_bytes: 16 * 1024,
            connection_window_bytes: 1 << 20,
            ..Default::default()
        },
    )
    .await
}

/// As [`raw_connect_to`], with the client's transport `limits` (its receive windows).
pub async fn raw_connect_with(
    addr: SocketAddr,
    ca: &Path,
    limits: felix_core_runtime::quic::TransportLimits,
) -> anyhow::Result<(quinn::Endpoint, quinn::Connection)> {
    let pem = std::fs::read_to_string(ca)?;
    let roots = felix_core_runtime::quic::certs_from_pem(&pem)?;
    let mut ep = quinn::Endpoint::client("127.0.0.1:0".parse().expect("valid"))?;
    ep.set_default_client_config(felix_core_runtime::quic::client_config(
        &roots, false, limits,
    )?);
    let conn = ep.connect(addr, "localhost")?.await?;
    Ok((ep, conn))
}

/// An `auth` frame for `tenant` with `token`, offering error codes and pipelined
/// publishes.
pub fn raw_auth(tenant: &str, token: &str) -> bytes::Bytes {
    use felix_wire::{Features, Message};
    let (lo, hi) = Features::ERROR_CODES
        .union(Features::PUBLISH_PIPELINE)
        .union(Features::STREAM_PUBLISH_WINDOW)
        .offer();
    Message::Auth {
        tenant_id: tenant.into(),
        token: token.into(),
        client_flags: Some(0x1FFF),
        client_features: lo,
        client_features_hi: hi,
    }
    .to_frame()
}

/// A binary publish of one record to `tenant/namespace/stream`, acked under request id
/// `ack` (none: unacked).
pub fn raw_publish(
    (tenant, namespace, stream): (&str, &str, &str),
    key: &[u8],
    payload: &[u8],
    ack: Option<u64>,
) -> bytes::Bytes {
    let mut buf = bytes::BytesMut::new();
    felix_wire::PublishBatchHeader {
        tenant,
        namespace,
        stream,
        ack: ack.map(|id| felix_wire::binary::AckPrefix {
            request_id: felix_wire::RequestId(id),
            ack_mode: felix_wire::AckMode::PerMessage,
        }),
        idempotent: None,
        key: Some(key),
    }
    .encode_frame(&mut buf, &[payload])
    .expect("a small publish encodes");
    buf.freeze()
}

/// Reads frames from `recv` until the stream ends; returns them decoded as messages
/// (binary frames as `None`).
pub async fn read_messages(
    recv: &mut quinn::RecvStream,
    max: usize,
) -> anyhow::Result<Vec<Option<felix_wire::Message>>> {
    let mut reader = felix_wire::FrameReader::new(1 << 20);
    let mut out = Vec::new();
    while out.len() < max {
        if let Some(f) = reader.next_frame()? {
            out.push(felix_wire::Message::decode(&f.payload).ok());
            continue;
        }
        match recv.read_chunk(1 << 16, true).await {
            Ok(Some(c)) => reader.push(c.bytes),
            _ => break,
        }
    }
    Ok(out)
}

/// This package's directory: cargo's value at run time (a build reused from another
/// checkout must not read that checkout's files), the compile-time one otherwise.
pub fn manifest_dir() -> std::path::PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR").map_or_else(
        || env!("CARGO_MANIFEST_DIR").into(),
        std::path::PathBuf::from,
    )
}

/// Sets process `pid`'s soft limit on open files to `soft` (the hard limit stays, so it
/// can be raised again); returns the soft limit it had.
pub fn set_open_files(pid: u32, soft: u64) -> anyhow::Result<u64> {
    let mut old = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: valid pointers to rlimit structs; `pid` names a process (a broker this
    // harness started).
    let got = unsafe {
        libc::prlimit(
            pid as libc::pid_t,
            libc::RLIMIT_NOFILE,
            std::ptr::null(),
            &mut old,
        )
    };
    anyhow::ensure!(
        got == 0,
        "reading the open-files limit: {}",
        std::io::Error::last_os_error()
    );
    let new = libc::rlimit {
        rlim_cur: soft.min(old.rlim_max),
        rlim_max: old.rlim_max,
    };
    // SAFETY: as above.
    let set = unsafe {
        libc::prlimit(
            pid as libc::pid_t,
            libc::RLIMIT_NOFILE,
            &new,
            std::ptr::null_mut(),
        )
    };
    anyhow::ensure!(
        set == 0,
        "setting the open-files limit: {}",
        std::io::Error::last_os_error()
    );
    Ok(old.rlim_cur)
}

/// A small ext4 image mounted on a loop device (as root), unmounted and removed on drop.
#[derive(Debug)]
pub struct LoopFs {
    /// Where it is mounted.
    pub mount: PathBuf,
    image: PathBuf,
}

impl LoopFs {
    /// Makes a `mib` MiB ext4 image in `dir` and mounts it at `dir/mnt`; `None` when
    /// this process is not root or the image cannot be made or mounted.
    pub fn mount(dir: &Path, mib: u64) -> Option<LoopFs> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return None;
        }
        let image = dir.join("fs.img");
        let mount = dir.join("mnt");
        std::fs::create_dir_all(&mount).ok()?;
        let ok = |cmd: &mut Command| cmd.status().is_ok_and(|s| s.success());
        if !ok(Command::new("truncate")
            .arg("-s")
            .arg(format!("{mib}M"))
            .arg(&image))
            || !ok(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&image))
            || !ok(Command::new("mount")
                .args(["-o", "loop"])
                .arg(&image)
                .arg(&mount))
        {
            return None;
        }
        Some(LoopFs { mount, image })
    }
}

/// Bytes a root process may still allocate on the filesystem holding `path` (reserved
/// blocks included).
pub fn free_bytes(path: &Path) -> anyhow::Result<u64> {
    let path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())?;
    // SAFETY: an all-zero statvfs is a valid value to be overwritten.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: a NUL-terminated path and a valid out pointer.
    if unsafe { libc::statvfs(path.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    Ok(st.f_bfree * st.f_frsize)
}

/// Allocates to the file at `path` (created), 1 MiB and then 4 KiB at a time, until the
/// filesystem refuses or `bytes` are allocated; returns how much it got.
pub fn fill(path: &Path, bytes: u64) -> anyhow::Result<u64> {
    use std::os::fd::AsRawFd as _;
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)?;
    let mut done = 0u64;
    for step in [1u64 << 20, 4096] {
        while bytes - done >= step {
            // SAFETY: an open file descriptor; plain allocation, no flags.
            let r = unsafe { libc::fallocate(f.as_raw_fd(), 0, done as i64, step as i64) };
            if r != 0 {
                break;
            }
            done += step;
        }
    }
    Ok(done)
}

impl Drop for LoopFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.mount).status();
        let _ = std::fs::remove_file(&self.image);
    }
}

/// What [`writes_of_one_key_in_order`] answers when the writes land in the order sent.
pub const WRITES_OF_ONE_KEY_IN_ORDER: (Option<bool>, Option<bool>, Option<Option<bytes::Bytes>>) = (
    Some(true),
    Some(false),
    Some(Some(bytes::Bytes::from_static(b"v5"))),
);

/// Sends, pipelined on one stream after `auth` to the broker at `addr`, writes of key
/// `k` of `(tenant, namespace, cache)`: put v1, delete, put-if-absent v2, put v3,
/// put-if-absent v4, delete, put v5; then, once they are answered, a get. Returns
/// whether each put-if applied and what the get read. In the order sent the first
/// put-if applies (the delete removed v1), the second does not (v3 is there), and v5
/// is the last value: `(Some(true), Some(false), Some(Some("v5")))`.
pub async fn writes_of_one_key_in_order(
    addr: SocketAddr,
    ca: &Path,
    auth: bytes::Bytes,
    (tenant, namespace, cache): (&str, &str, &str),
) -> (Option<bool>, Option<bool>, Option<Option<bytes::Bytes>>) {
    use felix_wire::message::CacheCondition;
    use felix_wire::{Message, RequestId};
    let (t, ns, c) = (tenant.to_owned(), namespace.to_owned(), cache.to_owned());
    let put = |v: &'static str, id: u64| Message::CachePut {
        tenant_id: t.clone(),
        namespace: ns.clone(),
        cache: c.clone(),
        key: "k".into(),
        value: bytes::Bytes::from_static(v.as_bytes()),
        request_id: Some(RequestId(id)),
        ttl_ms: None,
    };
    let delete = |id: u64| Message::CacheDelete {
        tenant_id: t.clone(),
        namespace: ns.clone(),
        cache: c.clone(),
        key: "k".into(),
        request_id: Some(RequestId(id)),
    };
    let put_if_absent = |v: &'static str, id: u64| Message::CachePutIf {
        tenant_id: t.clone(),
        namespace: ns.clone(),
        cache: c.clone(),
        key: "k".into(),
        value: bytes::Bytes::from_static(v.as_bytes()),
        ttl_ms: None,
        condition: CacheCondition::Absent,
        request_id: RequestId(id),
    };
    let writes = [
        put("v1", 1),
        delete(2),
        put_if_absent("v2", 3),
        put("v3", 4),
        put_if_absent("v4", 5),
        delete(6),
        put("v5", 7),
    ];
    let get = Message::CacheGet {
        tenant_id: t.clone(),
        namespace: ns.clone(),
        cache: c.clone(),
        key: "k".into(),
        request_id: Some(RequestId(8)),
    };
    let (_ep, conn) = raw_connect_to(addr, ca).await.unwrap();
    let (mut s, mut r) = conn.open_bi().await.unwrap();
    let mut all = auth.to_vec();
    for w in &writes {
        all.extend_from_slice(&w.to_frame());
    }
    s.write_all(&all).await.unwrap();
    let mut answers = read_messages(&mut r, writes.len() + 1).await.unwrap();
    // Only once the writes are answered: sent with them, it could be read before they
    // apply.
    s.write_all(&get.to_frame()).await.unwrap();
    s.finish().unwrap();
    answers.extend(read_messages(&mut r, 1).await.unwrap());
    let applied = |id: u64| {
        answers.iter().flatten().find_map(|m| match m {
            Message::CacheConditionResult {
                applied,
                request_id,
                ..
            } if *request_id == RequestId(id) => Some(*applied),
            _ => None,
        })
    };
    let read = answers.iter().flatten().find_map(|m| match m {
        Message::CacheValue {
            value,
            request_id: Some(RequestId(8)),
            ..
        } => Some(value.clone()),
        _ => None,
    });
    (applied(3), applied(5), read)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restartable_ports_are_distinct_and_outside_the_ephemeral_range() {
        let ephemeral_from: u16 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .unwrap()
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap();
        let ports: Vec<u16> = (0..50).map(|_| free_udp_addr().unwrap().port()).collect();
        assert!(ports.iter().all(|p| *p < ephemeral_from), "{ports:?}");
        let mut distinct = ports.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), ports.len(), "{ports:?}");
    }
}
