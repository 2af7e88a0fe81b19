//! Control-plane security end to end: HTTPS that brokers verify against their CA, and
//! revocation (a retired key, a denied token) that closes live connections.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use felix_cluster::{BrokerProcess, ClusterCerts, ControlPlaneProcess, free_udp_addr, wait_for};
use felix_controlplane::client::{ClientError, ClientTls, ControlPlaneClient};
use serde_json::{Value, json};

const BOOTSTRAP: &str = "security-test-bootstrap-token";

fn broker_config(
    dir: &Path,
    certs: &ClusterCerts,
    url: &str,
    control_plane_ca: &Path,
    node: &str,
    node_token: &str,
) -> std::path::PathBuf {
    let path = dir.join(format!("{node}.yaml"));
    std::fs::write(
        &path,
        format!(
            "node_id: {node}\ncores: \"0\"\nfsync: none\ntls_cert: {}\ntls_key: {}\npeer_ca: {}\ncontrolplane_url: {url}\ncontrolplane_ca: {}\nnode_token: {node_token}\n",
            certs.cert.display(),
            certs.key.display(),
            certs.ca.display(),
            control_plane_ca.display(),
        ),
    )
    .unwrap();
    path
}

fn node_token(admin: &ControlPlaneClient, node: &str) -> String {
    admin
        .post(
            "/v1/tenants/operator/tokens",
            &json!({"sub": node, "audience": "felix-controlplane", "perms": [format!("node.manage:node:{node}"), "node.view:cluster:*"]}),
        )
        .unwrap()["token"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// An HTTPS control plane (certificate from CA "real") and its operator client.
fn https_control_plane(dir: &Path) -> (ControlPlaneProcess, ClusterCerts, ControlPlaneClient) {
    let real = dir.join("real");
    std::fs::create_dir_all(&real).unwrap();
    let certs = ClusterCerts::write(&real).unwrap();
    let cert = certs.cert.display().to_string();
    let key = certs.key.display().to_string();
    let cp = ControlPlaneProcess::start(
        Path::new(env!("CARGO_BIN_EXE_felix-controlplane-under-test")),
        &[
            "--bootstrap-token",
            BOOTSTRAP,
            "--tls-cert-file",
            &cert,
            "--tls-key-file",
            &key,
            "--heartbeat-interval-ms",
            "200",
            "--expiry-timeout-ms",
            "1500",
            "--placement-interval-ms",
            "200",
        ],
    )
    .unwrap();
    assert!(cp.url.starts_with("https://127.0.0.1:"), "{}", cp.url);
    let tls = ClientTls::from_ca_file(&certs.ca).unwrap();
    let anon = ControlPlaneClient::with_tls(&cp.url, None, Some(tls)).unwrap();
    let boot = anon
        .post_with(
            "/internal/bootstrap",
            &json!({}),
            &[("X-Felix-Bootstrap-Token", BOOTSTRAP)],
        )
        .unwrap();
    let admin = anon.with_token(boot["token"].as_str().unwrap());
    (cp, certs, admin)
}

#[test]
fn a_broker_refuses_a_control_plane_whose_certificate_does_not_chain_to_its_ca() {
    let dir = tempfile::Builder::new()
        .prefix("felix-security")
        .tempdir_in("/var/tmp")
        .unwrap();
    let (cp, real, admin) = https_control_plane(dir.path());
    // A second, unrelated CA: what a machine in the middle would present, or a broker
    // configured with the wrong bundle.
    let other_dir = dir.path().join("other");
    std::fs::create_dir_all(&other_dir).unwrap();
    let other = ClusterCerts::write(&other_dir).unwrap();

    // Clients: the right CA works; the wrong one, none, or plain HTTP do not.
    assert_eq!(admin.get("/v1/system/live").unwrap()["status"], "live");
    let wrong = ControlPlaneClient::with_tls(
        &cp.url,
        None,
        Some(ClientTls::from_ca_file(&other.ca).unwrap()),
    )
    .unwrap();
    match wrong.get("/v1/system/live") {
        Err(ClientError::Tls(m)) => assert!(m.contains("certificate"), "{m}"),
        other => panic!("expected a certificate refusal, got {other:?}"),
    }
    assert!(matches!(
        ControlPlaneClient::new(&cp.url, None),
        Err(ClientError::Tls(_))
    ));
    let plain = ControlPlaneClient::new(&cp.url.replace("https://", "http://"), None).unwrap();
    assert!(plain.get("/v1/system/live").is_err());

    // A broker with the wrong CA stops at once, saying why, and never registers.
    let binary = Path::new(env!("CARGO_BIN_EXE_felix-broker-under-test"));
    let token = node_token(&admin, "node-x");
    let config = broker_config(dir.path(), &real, &cp.url, &other.ca, "node-x", &token);
    let started = Instant::now();
    let out = Command::new(binary)
        .args(["serve", "--config"])
        .arg(&config)
        .arg("--data-dir")
        .arg(dir.path().join("node-x"))
        .args(["--listen", &free_udp_addr().unwrap().to_string()])
        .args(["--http", "127.0.0.1:0"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("cannot verify the control plane") && stderr.contains("certificate"),
        "{stderr}"
    );
    assert!(started.elapsed() < Duration::from_secs(20));
    assert_eq!(
        admin.get("/v1/nodes").unwrap()["items"]
            .as_array()
            .unwrap()
            .len(),
        0,
        "the refused broker never registered"
    );

    // The same broker with the right CA joins.
    let config = broker_config(
        dir.path(),
        &real,
        &cp.url,
        &real.ca,
        "node-y",
        &node_token(&admin, "node-y"),
    );
    let _broker = BrokerProcess::start_serve(
        binary,
        &dir.path().join("node-y"),
        &config,
        free_udp_addr().unwrap(),
    )
    .unwrap();
    wait_for(
        "node-y registered over HTTPS",
        Duration::from_secs(20),
        || {
            let nodes: Value = admin.get("/v1/nodes").ok()?;
            nodes["items"]
                .as_array()?
                .iter()
                .any(|n| n["node_id"] == "node-y")
                .then_some(())
        },
    )
    .unwrap();
}
