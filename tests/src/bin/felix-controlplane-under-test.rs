//! The control-plane binary the harness spawns, rebuilt with this package (see
//! `felix-broker-under-test`).

fn main() -> anyhow::Result<()> {
    felix_controlplane::cli::main()
}
