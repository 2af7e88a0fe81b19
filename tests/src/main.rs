//! `felix-cluster`: chaos runs from the command line.
//!
//! ```text
//! cargo run -p felix-cluster -- chaos --scenario leader-kill --seed 7 --duration 60s
//! cargo run -p felix-cluster -- chaos --scenario all --duration 30s
//! cargo run -p felix-cluster -- chaos --scenario kill-restart --mutant reuse-offsets
//! cargo run -p felix-cluster -- list
//! ```
//!
//! Each run prints one JSON line: the scenario, seed, fault timeline and the checker's
//! report; the exit status is 1 when any run found an anomaly. Called by the broker's
//! or control plane's binary name (the harness links them to this executable), it is
//! that program.

use std::time::Duration;

use anyhow::{Context, bail};
use felix_cluster::chaos::{self, BROKER_BIN, CONTROLPLANE_BIN, SCENARIOS};

fn main() -> anyhow::Result<()> {
    let argv0 = std::env::args().next().unwrap_or_default();
    if argv0.ends_with(BROKER_BIN) {
        return felix_broker::cli::main();
    }
    if argv0.ends_with(CONTROLPLANE_BIN) {
        return felix_controlplane::cli::main();
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("list") => {
            for s in SCENARIOS {
                println!("{:<24} {}", s.name, s.about);
            }
            Ok(())
        }
        Some("chaos") => chaos_cmd(&args[1..]),
        _ => bail!(
            "usage: felix-cluster chaos --scenario NAME|all [--seed S] [--duration 60s] [--mutant ack-after-lease|skip-fence|reuse-offsets|forget-rebuilding] | felix-cluster list"
        ),
    }
}

fn parse_duration(s: &str) -> anyhow::Result<Duration> {
    let (n, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: u64 = n.parse().with_context(|| format!("duration {s:?}"))?;
    Ok(match unit {
        "" | "s" => Duration::from_secs(n),
        "ms" => Duration::from_millis(n),
        "m" => Duration::from_secs(n * 60),
        _ => bail!("duration {s:?}: use s, ms or m"),
    })
}

fn chaos_cmd(args: &[String]) -> anyhow::Result<()> {
    let (mut name, mut seed, mut duration) = (None, None, Duration::from_secs(60));
    let mut mutant: Option<String> = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = || it.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--scenario" => name = Some(value()?.clone()),
            "--seed" => seed = Some(value()?.parse::<u64>().context("--seed")?),
            "--duration" => duration = parse_duration(value()?)?,
            "--mutant" => mutant = Some(value()?.clone()),
            other => bail!("unknown argument {other:?}"),
        }
    }
    let name = name.context("--scenario NAME (or all; see `list`)")?;
    let chosen: Vec<_> = if name == "all" {
        SCENARIOS.iter().collect()
    } else {
        vec![chaos::scenario(&name).with_context(|| format!("no scenario {name:?}; see `list`"))?]
    };
    let seed = seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    });
    let mut failed = false;
    for s in chosen {
        let line = match chaos::run(s, seed, duration, mutant.as_deref()) {
            Ok(v) => v,
            Err(e) => {
                serde_json::json!({"scenario": s.name, "seed": seed, "valid": false, "error": format!("{e:#}")})
            }
        };
        failed |= line["valid"] != true;
        println!("{line}");
    }
    if failed {
        std::process::exit(1);
    }
    Ok(())
}
