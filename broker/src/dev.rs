//! `felix-broker dev`: everything a single-node broker needs, made on first start and
//! kept across restarts under `<data-dir>/dev/`: a CA and a `localhost` server
//! certificate (`ca.pem`, `server.pem`, `server.key.pem`), the tenant's signing key
//! (`signing-<tenant>.pk8`) and a token with every data permission (`token`).

use std::path::{Path, PathBuf};

use felix_core_runtime::quic;

use crate::auth::{self, Claims, SigningKey, TenantKeys};

/// What dev mode prepared.
#[derive(Debug)]
pub struct DevSetup {
    /// Server certificate chain (PEM).
    pub cert_pem: String,
    /// Server key (PEM).
    pub key_pem: String,
    /// Where the CA is.
    pub ca_path: PathBuf,
    /// Where the token is.
    pub token_path: PathBuf,
    /// The token.
    pub token: String,
    /// Verification keys.
    pub keys: TenantKeys,
}

/// Writes `data` to `path` readable by the owner only (atomically, durably).
pub fn write_private(path: &Path, data: &[u8]) -> anyhow::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .mode(0o600)
        .open(&tmp)?;
    std::io::Write::write_all(&mut f, data)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// Prepares (or reuses) the dev PKI, signing key and token for `tenant`.
pub fn prepare(data_dir: &Path, tenant: &str) -> anyhow::Result<DevSetup> {
    crate::catalog::validate_name("tenant", tenant)
        .map_err(|e| anyhow::anyhow!("--tenant: {e}"))?;
    let dir = data_dir.join("dev");
    std::fs::create_dir_all(&dir)?;
    let (ca_path, cert_path, key_path) = (
        dir.join("ca.pem"),
        dir.join("server.pem"),
        dir.join("server.key.pem"),
    );
    if !(ca_path.exists() && cert_path.exists() && key_path.exists()) {
        let certs = quic::generate_certs(&["localhost", "127.0.0.1"])?;
        write_private(&key_path, certs.key_pem.as_bytes())?;
        write_private(
            &cert_path,
            format!("{}{}", certs.cert_pem, certs.ca_pem).as_bytes(),
        )?;
        write_private(&ca_path, certs.ca_pem.as_bytes())?;
    }
    let signing_path = dir.join(format!("signing-{tenant}.pk8"));
    let kid = format!("{tenant}-dev");
    let key = if signing_path.exists() {
        SigningKey::from_pkcs8(&std::fs::read(&signing_path)?, &kid)?
    } else {
        let key = SigningKey::generate(&kid)?;
        write_private(&signing_path, key.pkcs8())?;
        key
    };
    let mut keys = TenantKeys::default();
    keys.add(tenant, &kid, key.public_key());
    let token_path = dir.join("token");
    let existing = std::fs::read_to_string(&token_path).ok();
    let token = match existing {
        Some(t)
            if keys
                .verify(&t, tenant, felix_core_runtime::clock::now().wall_secs())
                .is_ok() =>
        {
            t.trim().to_owned()
        }
        _ => {
            let now = felix_core_runtime::clock::now().wall_secs();
            let t = key.sign(&Claims {
                iss: auth::ISSUER.into(),
                aud: auth::BROKER_AUDIENCE.into(),
                sub: format!("{tenant}-dev-admin"),
                tid: tenant.to_owned(),
                iat: now,
                exp: now + 10 * 365 * 24 * 3600,
                nbf: None,
                perms: auth::all_data_perms(tenant),
                jti: None,
            });
            write_private(&token_path, t.as_bytes())?;
            t
        }
    };
    Ok(DevSetup {
        cert_pem: std::fs::read_to_string(&cert_path)?,
        key_pem: std::fs::read_to_string(&key_path)?,
        ca_path,
        token_path,
        token,
        keys,
    })
}

/// The snippet printed at start.
pub fn connect_snippet(listen: std::net::SocketAddr, tenant: &str, setup: &DevSetup) -> String {
    format!(
        "Connect with the standard SDK (pip install felix-client==0.6.2):\n\n\
         import felix\n\
         c = felix.Client(\"{listen}\", tenant_id=\"{tenant}\",\n\
         \x20               token=open(\"{token}\").read().strip(),\n\
         \x20               ca_file=\"{ca}\")\n\
         print(c.publish(\"{tenant}\", \"default\", \"orders\", b\"hello\"))\n",
        token = setup.token_path.display(),
        ca = setup.ca_path.display(),
    )
}
