//! `felix-controlplane`: serve the control-plane API.

fn main() -> anyhow::Result<()> {
    felix_controlplane::cli::main()
}
