//! The `felix` CLI the harness runs, built from the current client code (see
//! `felix-broker-under-test` for why the harness builds its own copies).

fn main() {
    felix_client::cli::main()
}
