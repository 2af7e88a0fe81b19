//! `felix`: see `felix_client::cli`.

fn main() {
    felix_client::cli::main()
}
