//! The `felix-broker` binary: see `felix_broker::cli`.

fn main() -> anyhow::Result<()> {
    felix_broker::cli::main()
}
