//! `felix-controlplane` settings: defaults < YAML file < `FELIX_CONTROLPLANE_*`
//! environment < flags. An error names the key and where its value came from.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;

use crate::api::ApiConfig;
use crate::sealing::read_kek;
use crate::server::{KeySource, ServerConfig, StoreConfig};

/// The YAML file (every key optional).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    /// HTTP address.
    pub listen: Option<String>,
    /// `memory` or a `postgres://` URL.
    pub store: Option<String>,
    /// Token that enables `POST /internal/bootstrap`.
    pub bootstrap_token: Option<String>,
    /// How often brokers heartbeat.
    pub heartbeat_interval_ms: Option<u64>,
    /// Silence after which a broker is down and its shards move.
    pub expiry_timeout_ms: Option<u64>,
    /// Extra silence beyond the expiry before a broker is marked down (≥ expiry/4).
    pub regrant_margin_ms: Option<u64>,
    /// How long a replica-set member may be down before it is replaced.
    pub replica_restore_after_ms: Option<u64>,
    /// Time between placement passes.
    pub placement_interval_ms: Option<u64>,
    /// File holding the key-encryption key (32 bytes, base64) that seals tenants'
    /// signing keys in the store.
    pub key_encryption_key_file: Option<String>,
    /// Files of earlier key-encryption keys, still accepted to open (a rotation).
    pub previous_key_encryption_key_files: Option<Vec<String>>,
    /// Serve HTTPS with this certificate chain (PEM) ...
    pub tls_cert_file: Option<String>,
    /// ... and this private key (PEM).
    pub tls_key_file: Option<String>,
    /// Serve plain HTTP on an address that is not loopback.
    pub insecure_http: Option<bool>,
}

/// Values given as flags.
#[derive(Debug, Default, Clone)]
pub struct Overrides {
    /// `--listen`.
    pub listen: Option<String>,
    /// `--store`.
    pub store: Option<String>,
    /// `--bootstrap-token`.
    pub bootstrap_token: Option<String>,
    /// `--heartbeat-interval-ms`.
    pub heartbeat_interval_ms: Option<u64>,
    /// `--expiry-timeout-ms`.
    pub expiry_timeout_ms: Option<u64>,
    /// `--regrant-margin-ms`.
    pub regrant_margin_ms: Option<u64>,
    /// `--replica-restore-after-ms`.
    pub replica_restore_after_ms: Option<u64>,
    /// `--placement-interval-ms`.
    pub placement_interval_ms: Option<u64>,
    /// `--key-encryption-key-file`.
    pub key_encryption_key_file: Option<String>,
    /// `--previous-key-encryption-key-file` (repeatable).
    pub previous_key_encryption_key_files: Vec<String>,
    /// `--tls-cert-file`.
    pub tls_cert_file: Option<String>,
    /// `--tls-key-file`.
    pub tls_key_file: Option<String>,
    /// `--insecure-http`.
    pub insecure_http: bool,
}

/// A bad setting.
#[derive(Debug, thiserror::Error)]
#[error("configuration key `{key}` (from {source_name}): {message}")]
pub struct ConfigError {
    /// The key.
    pub key: &'static str,
    /// `flag`, `environment`, `config file` or `default`.
    pub source_name: &'static str,
    /// What is wrong.
    pub message: String,
}

fn pick(env: &str, file: Option<String>, flag: Option<String>) -> (Option<String>, &'static str) {
    if flag.is_some() {
        return (flag, "flag");
    }
    if let Ok(v) = std::env::var(env) {
        return (Some(v), "environment");
    }
    (file, "config file")
}

fn millis(
    key: &'static str,
    env: &str,
    file: Option<u64>,
    flag: Option<u64>,
    default: u64,
) -> Result<Duration, ConfigError> {
    Ok(optional_millis(key, env, file, flag)?.unwrap_or(Duration::from_millis(default)))
}

/// A positive number of milliseconds from the layers, or `None` when no layer sets it.
fn optional_millis(
    key: &'static str,
    env: &str,
    file: Option<u64>,
    flag: Option<u64>,
) -> Result<Option<Duration>, ConfigError> {
    let (v, source_name) = pick(
        env,
        file.map(|n| n.to_string()),
        flag.map(|n| n.to_string()),
    );
    let Some(v) = v else {
        return Ok(None);
    };
    match v.parse::<u64>() {
        Ok(n) if n > 0 => Ok(Some(Duration::from_millis(n))),
        _ => Err(ConfigError {
            key,
            source_name,
            message: format!("{v:?} is not a positive number of milliseconds"),
        }),
    }
}

/// Resolves the layers into a server configuration.
pub fn resolve(file: FileConfig, flags: Overrides) -> Result<ServerConfig, ConfigError> {
    let (v, source_name) = pick("FELIX_CONTROLPLANE_LISTEN", file.listen, flags.listen);
    let listen: SocketAddr = match v {
        Some(v) => v.parse().map_err(|e| ConfigError {
            key: "listen",
            source_name,
            message: format!("{v:?}: {e}"),
        })?,
        None => ([127, 0, 0, 1], 7070).into(),
    };
    let (v, source_name) = pick("FELIX_CONTROLPLANE_STORE", file.store, flags.store);
    let store = match v {
        Some(v) => v.parse::<StoreConfig>().map_err(|message| ConfigError {
            key: "store",
            source_name,
            message,
        })?,
        None => StoreConfig::Memory,
    };
    let (bootstrap_token, _) = pick(
        "FELIX_CONTROLPLANE_BOOTSTRAP_TOKEN",
        file.bootstrap_token,
        flags.bootstrap_token,
    );
    if bootstrap_token.as_deref().is_some_and(|t| t.len() < 16) {
        return Err(ConfigError {
            key: "bootstrap_token",
            source_name: "any",
            message: "must be at least 16 characters".into(),
        });
    }
    let heartbeat_interval = millis(
        "heartbeat_interval_ms",
        "FELIX_CONTROLPLANE_HEARTBEAT_INTERVAL_MS",
        file.heartbeat_interval_ms,
        flags.heartbeat_interval_ms,
        1000,
    )?;
    let expiry_timeout = millis(
        "expiry_timeout_ms",
        "FELIX_CONTROLPLANE_EXPIRY_TIMEOUT_MS",
        file.expiry_timeout_ms,
        flags.expiry_timeout_ms,
        5000,
    )?;
    // A broker's lease runs three quarters of the expiry from the heartbeat that
    // renewed it, and the next heartbeat goes an interval later: with an interval past
    // half the expiry every lease lapsed before its renewal (writes refused each cycle),
    // with no room for one lost heartbeat.
    if expiry_timeout < heartbeat_interval * 2 {
        return Err(ConfigError {
            key: "expiry_timeout_ms",
            source_name: "any",
            message: format!(
                "{expiry_timeout:?} must be at least twice heartbeat_interval_ms \
                 ({heartbeat_interval:?}): a broker's lease runs 3/4 of it from each heartbeat"
            ),
        });
    }
    // Unset, the margin follows the expiry (a quarter of it); set, it may not be less.
    let regrant_margin = optional_millis(
        "regrant_margin_ms",
        "FELIX_CONTROLPLANE_REGRANT_MARGIN_MS",
        file.regrant_margin_ms,
        flags.regrant_margin_ms,
    )?;
    if let Some(m) = regrant_margin
        && m * 4 < expiry_timeout
    {
        return Err(ConfigError {
            key: "regrant_margin_ms",
            source_name: "any",
            message: format!(
                "{m:?} is below a quarter of expiry_timeout_ms ({expiry_timeout:?}): a broker \
                 gives up its lease a quarter early, the margin must cover that"
            ),
        });
    }
    let replica_restore_after = millis(
        "replica_restore_after_ms",
        "FELIX_CONTROLPLANE_REPLICA_RESTORE_AFTER_MS",
        file.replica_restore_after_ms,
        flags.replica_restore_after_ms,
        60_000,
    )?;
    let placement_interval = millis(
        "placement_interval_ms",
        "FELIX_CONTROLPLANE_PLACEMENT_INTERVAL_MS",
        file.placement_interval_ms,
        flags.placement_interval_ms,
        1000,
    )?;
    let (kek, source_name) = pick(
        "FELIX_CONTROLPLANE_KEK_FILE",
        file.key_encryption_key_file,
        flags.key_encryption_key_file,
    );
    let (previous, _) = pick(
        "FELIX_CONTROLPLANE_PREVIOUS_KEK_FILES",
        file.previous_key_encryption_key_files.map(|v| v.join(",")),
        (!flags.previous_key_encryption_key_files.is_empty())
            .then(|| flags.previous_key_encryption_key_files.join(",")),
    );
    let keys = match kek {
        None if previous.is_some() => {
            return Err(ConfigError {
                key: "previous_key_encryption_key_files",
                source_name: "any",
                message: "given without key_encryption_key_file".into(),
            });
        }
        None => KeySource::Ephemeral,
        Some(path) => {
            let read = |p: &str, key: &'static str, source_name: &'static str| {
                read_kek(Path::new(p)).map_err(|e| ConfigError {
                    key,
                    source_name,
                    message: e.to_string(),
                })
            };
            KeySource::Material {
                current: read(&path, "key_encryption_key_file", source_name)?,
                previous: previous
                    .iter()
                    .flat_map(|p| p.split(','))
                    .filter(|p| !p.is_empty())
                    .map(|p| read(p, "previous_key_encryption_key_files", "any"))
                    .collect::<Result<_, _>>()?,
            }
        }
    };
    let (cert, cert_source) = pick(
        "FELIX_CONTROLPLANE_TLS_CERT_FILE",
        file.tls_cert_file,
        flags.tls_cert_file,
    );
    let (key, _) = pick(
        "FELIX_CONTROLPLANE_TLS_KEY_FILE",
        file.tls_key_file,
        flags.tls_key_file,
    );
    let tls = match (cert, key) {
        (None, None) => None,
        (Some(cert), Some(key)) => Some(
            crate::tls::ServerTls::from_files(Path::new(&cert), Path::new(&key)).map_err(|e| {
                ConfigError {
                    key: "tls_cert_file",
                    source_name: cert_source,
                    message: e.to_string(),
                }
            })?,
        ),
        _ => {
            return Err(ConfigError {
                key: "tls_cert_file",
                source_name: "any",
                message: "tls_cert_file and tls_key_file go together".into(),
            });
        }
    };
    // The flag, else the environment, else the file: ORed, the environment's `false`
    // could not turn off the file's `true`.
    let insecure_http = flags.insecure_http
        || match std::env::var("FELIX_CONTROLPLANE_INSECURE_HTTP") {
            Ok(v) if !v.is_empty() => match v.to_ascii_lowercase().as_str() {
                "1" | "true" | "yes" | "on" => true,
                "0" | "false" | "no" | "off" => false,
                _ => {
                    return Err(ConfigError {
                        key: "insecure_http",
                        source_name: "environment",
                        message: format!("{v:?} is not a switch: true or false (1 or 0)"),
                    });
                }
            },
            _ => file.insecure_http.unwrap_or(false),
        };
    Ok(ServerConfig {
        tls,
        insecure_http,
        keys,
        listen,
        store,
        api: ApiConfig {
            bootstrap_token,
            heartbeat_interval,
            expiry_timeout,
            regrant_margin,
            replica_restore_after,
            fault_injection: false,
        },
        placement_interval,
    })
}

/// Reads the YAML file.
pub fn load_file(path: &Path) -> anyhow::Result<FileConfig> {
    let text =
        std::fs::read_to_string(path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    serde_yaml::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_beat_the_file_and_errors_name_the_key() {
        let file: FileConfig =
            serde_yaml::from_str("listen: 127.0.0.1:7100\nexpiry_timeout_ms: 3000\n").unwrap();
        let c = resolve(
            file,
            Overrides {
                listen: Some("127.0.0.1:7101".into()),
                ..Overrides::default()
            },
        )
        .unwrap();
        assert_eq!(c.listen.port(), 7101);
        assert_eq!(c.api.expiry_timeout, Duration::from_secs(3));
        assert_eq!(c.store, StoreConfig::Memory);

        let file: FileConfig = serde_yaml::from_str("store: mysql://x\n").unwrap();
        assert_eq!(
            resolve(file, Overrides::default()).unwrap_err().key,
            "store"
        );
        // The expiry is at least twice the interval: a broker's lease runs 3/4 of it from
        // each heartbeat, and 4 s beats against a 5 s expiry lapsed every cycle.
        for (beat, expiry, ok) in [(5000, 4000, false), (4000, 5000, false), (2500, 5000, true)] {
            let file: FileConfig = serde_yaml::from_str(&format!(
                "heartbeat_interval_ms: {beat}\nexpiry_timeout_ms: {expiry}\n"
            ))
            .unwrap();
            match resolve(file, Overrides::default()) {
                Ok(_) => assert!(ok, "{beat} / {expiry} taken"),
                Err(e) => assert!(
                    !ok && e.key == "expiry_timeout_ms",
                    "{beat} / {expiry}: {e:?}"
                ),
            }
        }
        assert!(
            serde_yaml::from_str::<FileConfig>("lisen: x\n").is_err(),
            "unknown keys are refused"
        );
    }

    #[test]
    fn the_regrant_margin_defaults_to_a_quarter_and_may_not_be_less() {
        let file: FileConfig = serde_yaml::from_str("expiry_timeout_ms: 8000\n").unwrap();
        let c = resolve(file, Overrides::default()).unwrap();
        assert_eq!(c.api.regrant_margin, None);
        assert_eq!(c.api.regrant_margin(), Duration::from_secs(2));
        assert_eq!(c.api.down_after(), Duration::from_secs(10));
        assert_eq!(c.api.replica_restore_after, Duration::from_secs(60));
        let file: FileConfig =
            serde_yaml::from_str("expiry_timeout_ms: 8000\nregrant_margin_ms: 3000\n").unwrap();
        let c = resolve(file, Overrides::default()).unwrap();
        assert_eq!(c.api.down_after(), Duration::from_secs(11));
        let file: FileConfig =
            serde_yaml::from_str("expiry_timeout_ms: 8000\nregrant_margin_ms: 1999\n").unwrap();
        assert_eq!(
            resolve(file, Overrides::default()).unwrap_err().key,
            "regrant_margin_ms"
        );
        let c = resolve(
            FileConfig::default(),
            Overrides {
                replica_restore_after_ms: Some(250),
                ..Overrides::default()
            },
        )
        .unwrap();
        assert_eq!(c.api.replica_restore_after, Duration::from_millis(250));
    }
}
