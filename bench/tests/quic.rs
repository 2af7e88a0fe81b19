//! The QUIC bench's transfers move every byte both ways on both servers, and its CPU
//! accounting finds each side's threads.

use felix_bench::quic::{Certs, Client, Direction, start_ours, start_quinn};

#[test]
fn transfers_move_every_byte_and_charge_the_server_threads() {
    // Our server runs as `felix-bench serve-echo`; this binary is the test harness.
    felix_bench::broker::use_executable(env!("CARGO_BIN_EXE_felix-bench"));
    let certs = Certs::new().unwrap();
    let client = Client::new(&certs, 1).unwrap();
    for (server, threads) in [
        (start_ours(&certs, 1).unwrap(), "ours"),
        (start_quinn(&certs, 1).unwrap(), "quinn"),
    ] {
        for dir in [Direction::Upload, Direction::Download] {
            // 3 MiB + 1 byte: rounded up to whole 64 KiB writes, checked by byte count
            // inside `transfer`.
            let t = client.transfer(&*server, dir, 2, (3 << 20) + 1).unwrap();
            assert!(t.mb_per_sec > 0.0, "{threads} {dir:?}: {t:?}");
            assert!(t.server_cpu_per_gb > 0.0, "{threads} {dir:?}: {t:?}");
            assert!(t.client_cores > 0.0, "{threads} {dir:?}: {t:?}");
        }
        server.stop();
    }
}
