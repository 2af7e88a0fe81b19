//! Runs the curl walkthrough in `docs/control-plane.md` against a fresh control plane,
//! so the documented commands keep working.

use std::time::Duration;

use felix_controlplane::api::ApiConfig;
use felix_controlplane::server::{self, ServerConfig};

const BOOTSTRAP: &str = "docs-walkthrough-bootstrap";

fn walkthrough() -> String {
    let doc = include_str!("../../docs/control-plane.md");
    let start = doc
        .find("<!-- walkthrough:start -->")
        .expect("start marker");
    let end = doc.find("<!-- walkthrough:end -->").expect("end marker");
    let block = &doc[start..end];
    let code = block.split("```bash\n").nth(1).expect("a bash block");
    code.split("```").next().unwrap().to_owned()
}

#[test]
fn the_documented_curl_walkthrough_works() {
    for tool in ["curl", "jq"] {
        let found = std::process::Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false);
        assert!(found, "{tool} is needed (.ci/test installs it)");
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    let running = rt
        .block_on(server::start(ServerConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            api: ApiConfig {
                bootstrap_token: Some(BOOTSTRAP.into()),
                ..ApiConfig::default()
            },
            placement_interval: Duration::from_millis(200),
            ..ServerConfig::default()
        }))
        .unwrap();
    let out = std::process::Command::new("bash")
        .args(["-euo", "pipefail", "-c", &walkthrough()])
        .env("CP", format!("http://{}", running.addr))
        .env("BOOTSTRAP", BOOTSTRAP)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the walkthrough failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains(r#""tenant_id":"acme""#), "{stdout}");
    assert!(
        stdout.contains(r#""moved_on": true"#),
        "the PATCH applied: {stdout}"
    );
    let placed = stdout
        .lines()
        .filter(|l| l.contains(r#""leader":"node-a""#))
        .count();
    assert_eq!(placed, 4, "four shards on node-a: {stdout}");
    assert!(stdout.contains(r#""field":"shards""#), "{stdout}");
    assert!(stdout.trim_end().ends_with("401"), "{stdout}");
    rt.block_on(running.stop());
}
